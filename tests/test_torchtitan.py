"""torchtitan's Llama3 debug model, sharded by torchtitan's own ``parallelize_llama`` with compile_shard underneath.

Runs where torchtitan 0.2 is installed (docs/torchtitan.md): it imports triton at
import time, which torch's CPU wheel lacks, so with 2.14's or 2.15's PyPI wheel. The
oracle is torch FSDP2 under the same code, with one call added to both:
torchtitan sets a gradient divide factor of 1, which FSDP2 spells as a
``PREMUL_SUM`` reduction that gloo lacks; ``set_force_sum_reduction_for_comms(True)``
makes it a plain sum, the same numbers.

bf16 eager is bitwise FSDP2's, but for RMSNorm's weights on torch 2.15 (within bf16's
rounding: docs/api.md, "torch versions"). Compiled with Inductor, ours is one graph,
within 1e-6 of FSDP2 eager in fp32, and in both dtypes no further from FSDP2 eager
than FSDP2 with every module compiled ([Note: the compiled oracle] in
test_inductor_numerics), step by step.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import compile_shard
from compile_shard._versions import ROUNDS_EACH_GRADIENT_CONTRIBUTION
from dist_utils import run_gloo

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None or importlib.util.find_spec("triton") is None,
    reason="needs torchtitan 0.2 (pip install torchtitan==0.2.2), which imports triton (a CUDA wheel of torch has it)",
)

STEPS = 5
SEQ = 64
# Ours may be this many times the oracle's largest distance from eager over the run,
# plus fp32's parity bound, where the oracle happens to be exact for a parameter.
TOLERANCE_FACTOR = 2
FP32_FLOOR = 1e-6


def _parallelized(fully_shard_name: str, param_dtype: str):
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config.job_config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import Transformer, llama3_args, parallelize_llama

    parallel_dims_module.device_type = "cpu"  # torchtitan picks CUDA where the wheel has it
    with torch.device("meta"):
        model = Transformer(llama3_args["debugmodel"])
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=2)
    parallel_dims.build_mesh()
    job = JobConfig()
    job.training.mixed_precision_param = param_dtype
    job.training.seq_len = SEQ
    job.compile.enable = False
    job.activation_checkpoint.mode = "none"
    if fully_shard_name == "compile_shard":
        with compile_shard.as_torch_fully_shard():
            model = parallelize_llama(model, parallel_dims, job)
    else:
        model = parallelize_llama(model, parallel_dims, job)
    for module in model.modules():  # FSDP2's setter is per module, not recursive
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


# FSDP2's unsharded parameter is an autograd leaf with the reduction's grad_dtype from
# torch 2.15 on, and the fused RMSNorm backward then hands its weight gradient over in
# fp32; compile_shard's unsharded parameter is an all-gather output, whose gradient
# autograd rounds to param_dtype, as it did for FSDP2 up to 2.14.
_FSDP2_KEEPS_FP32_NORM_GRADS = ROUNDS_EACH_GRADIENT_CONTRIBUTION


def _bf16_rounding(gradient):
    """The most a bf16 rounding of each rank's contribution can move the reduced gradient by."""
    return gradient.abs().max().item() * 2.0**-8


def _compile_every_module(model):
    """torch FSDP2 with every computation compiled ([Note: the compiled oracle] in test_inductor_numerics)."""
    for block in model.layers.values():
        block.compile()
    for name, child in list(model.named_children()):
        if name != "layers":
            setattr(model, name, torch.compile(child))
    return model


def _step(run, model, tokens):
    """The logits and each parameter's full gradient."""
    logits = run(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    result = {"logits": logits.detach().float()}
    result.update((name.replace("_orig_mod.", ""), param.grad.full_tensor().float()) for name, param in model.named_parameters())
    model.zero_grad()
    return result


def _relative_distances(result, eager_result):
    return {name: ((value - eager_result[name]).norm() / eager_result[name].norm()).item() for name, value in result.items()}


def _batch(step, rank, vocab):
    return torch.randint(0, vocab, (2, SEQ + 1), generator=torch.Generator().manual_seed(10 * step + rank))


def _worker(rank, world_size, param_dtype, compiled):
    """Eager: ours bitwise FSDP2's. Compiled: as close to FSDP2 eager as FSDP2 compiled is, step by step.

    Every step starts all models from FSDP2 eager's parameters, copied after its AdamW
    step, so that each step compares the same parameters' gradients.
    """
    eager, ours = _parallelized("torch", param_dtype), _parallelized("compile_shard", param_dtype)
    assert isinstance(ours, compile_shard.FSDPModule) and not isinstance(eager, compile_shard.FSDPModule)
    graphs = CompileCounterWithBackend("inductor")  # ours only: the oracle compiles graphs of its own
    runs = {"ours": (torch.compile(ours, backend=graphs) if compiled else ours, ours)}
    if compiled:
        oracle = _compile_every_module(_parallelized("torch", param_dtype))
        runs["oracle"] = (oracle, oracle)
    optimizer = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    distances = {name: [] for name in runs}
    vocab = eager.tok_embeddings.weight.shape[0]
    for step in range(STEPS):
        tokens = torch.randint(0, vocab, (2, SEQ + 1), generator=torch.Generator().manual_seed(10 * step + rank))
        eager_result = _step(eager, eager, tokens)
        for name, (run, model) in runs.items():
            result = _step(run, model, tokens)
            if not compiled:
                for quantity, value in result.items():
                    expected = eager_result[quantity]
                    # FSDP2 from torch 2.15 gives RMSNorm's weight its fp32 gradient, unrounded (docs/torchtitan.md).
                    atol = _bf16_rounding(expected) if quantity.endswith("norm.weight") and _FSDP2_KEEPS_FP32_NORM_GRADS else 0
                    torch.testing.assert_close(value, expected, rtol=0, atol=atol, msg=lambda m, q=quantity: f"{q}, step {step}: {m}")
            distances[name].append(_relative_distances(result, eager_result))
        optimizer.step()
        with torch.no_grad():
            for _, model in runs.values():
                for param, eager_param in zip(model.parameters(), eager.parameters()):
                    param.to_local().copy_(eager_param.to_local())
    if compiled:
        scale = {quantity: max(step[quantity] for step in distances["oracle"]) for quantity in distances["oracle"][0]}
        for step, step_distances in enumerate(distances["ours"]):
            for quantity, distance in step_distances.items():
                if param_dtype == "float32":  # fp32's parity bound, whatever the oracle's distance
                    assert distance <= FP32_FLOOR, f"step {step}: {quantity} {distance:.3g} from FSDP2 eager's"
                assert distance <= TOLERANCE_FACTOR * scale[quantity] + FP32_FLOOR, (
                    f"{param_dtype}, step {step}: {quantity} {distance:.3g} from FSDP2 eager's, "
                    f"more than {TOLERANCE_FACTOR}x FSDP2 + torch.compile's {scale[quantity]:.3g}"
                )
        assert graphs.frame_count == 1, f"{graphs.frame_count} graphs: expected one, without breaks or recompiles"


@pytest.mark.parametrize(
    "param_dtype, compiled",
    [("float32", True), ("bfloat16", True), ("bfloat16", False)],
    ids=["fp32_inductor", "bf16_inductor", "bf16_eager"],
)
def test_torchtitans_llama3_debug_model_matches_torch_fsdp2_under_the_same_code(param_dtype, compiled):
    run_gloo(_worker, 2, param_dtype, compiled)
