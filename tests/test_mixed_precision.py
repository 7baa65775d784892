"""Mixed precision (FSDP2's ``MixedPrecisionPolicy``): torch FSDP2 parity on gloo, eager and compiled.

Every combination FSDP2's own tests cover, on the same Llama with the same policies:
losses, gradients and parameters after several AdamW steps are bitwise torch FSDP2's
in eager mode ([Note: mixed-precision reduction] in compile_shard.ops), and the
collectives move ``param_dtype`` and the reduction's dtype. Inductor's numbers are
tests/test_inductor_numerics.py's.
"""

import pytest
import torch
from torch._dynamo.utils import clear_compilation_metrics, counters
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from compile_shard import fully_shard
from compile_shard._versions import ROUNDS_EACH_GRADIENT_CONTRIBUTION
from compile_shard.debug import CollectiveCounter, recompiles
from compile_shard.models import Llama, LlamaConfig
from dist_utils import FakeProcessGroup, global_batch, lm_loss, run_gloo
from test_gradient_sync import accumulate_micro_batches

STEPS = 5
BF16 = torch.bfloat16
FP32 = torch.float32

# name: (the blocks' policy, the root's policy)
POLICIES = {
    "param": (MixedPrecisionPolicy(param_dtype=BF16), MixedPrecisionPolicy(param_dtype=BF16)),
    "param_reduce": (
        MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32),
        MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32),
    ),
    "reduce": (MixedPrecisionPolicy(reduce_dtype=BF16), MixedPrecisionPolicy(reduce_dtype=BF16)),
    # fp16 reductions divide before and after the sum, against overflow (FSDP2's choice).
    "fp16_reduce": (
        MixedPrecisionPolicy(reduce_dtype=torch.float16),
        MixedPrecisionPolicy(reduce_dtype=torch.float16),
    ),
    "output_dtype": (
        MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32),
        MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, output_dtype=FP32),
    ),
    # fp32 root and bf16 blocks that cast their outputs back: policies differ within the model.
    "root_differs": (MixedPrecisionPolicy(param_dtype=BF16, output_dtype=FP32), MixedPrecisionPolicy()),
}


@pytest.fixture
def fake_pg():
    with FakeProcessGroup(2):
        yield


def build(shard, policies, *, config=LlamaConfig(), seed=0):
    block_policy, root_policy = policies
    torch.manual_seed(seed)
    model = Llama(config)
    for block in model.layers:
        shard(block, mp_policy=block_policy)
    shard(model, mp_policy=root_policy)
    return model


def _assert_equal(ours, theirs, what):
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=what)


def _assert_reduced_alike(ours, theirs, reduction_dtype, what):
    """Within two units in the last place of the reduction's dtype, at the gradient's scale."""
    scale = theirs.abs().max().item()
    eps = torch.finfo(reduction_dtype).eps
    torch.testing.assert_close(ours, theirs, rtol=2 * eps, atol=2 * eps * scale, msg=what)


def _reduction_dtype(policy: MixedPrecisionPolicy) -> torch.dtype:
    return policy.reduce_dtype or policy.param_dtype or FP32


def _eager_worker(rank, world_size, policy_names):
    for policy_name in policy_names:
        _eager_parity(rank, world_size, policy_name)


def _eager_parity(rank, world_size, policy_name):
    """Bitwise torch FSDP2 at two ranks; at three, each step's gradients from the same parameters.

    At three ranks the reductions add the ranks' gradients in different orders
    (compile_shard in rank order, gloo in the order its ring all-reduce's chunking
    gives each element; [Note: parity tolerance] in test_parity.py), so the gradients
    differ in the reduction dtype's last bits, and AdamW would carry that into the
    parameters. There, our parameters are reset to torch FSDP2's after every step.
    """
    policies = POLICIES[policy_name]
    ours, theirs = build(fully_shard, policies), build(torch_fully_shard, policies)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(STEPS):
        tokens = global_batch(step, world_size, 2, 8, LlamaConfig().vocab_size)[2 * rank : 2 * rank + 2]
        losses = [lm_loss(model, tokens) for model in (ours, theirs)]
        _assert_equal(losses[0], losses[1], f"{policy_name}: loss, step {step}")
        for loss in losses:
            loss.backward()
        for (name, param), other in zip(ours.named_parameters(), theirs.parameters()):
            assert param.dtype == FP32 and param.grad.dtype == FP32, name
            what = f"{policy_name}: {name}.grad, step {step}"
            grad, other_grad = param.grad.full_tensor(), other.grad.full_tensor()
            if world_size == 2:
                _assert_equal(grad, other_grad, what)
            else:
                policy = policies[1] if "." not in name else policies[0]
                _assert_reduced_alike(grad, other_grad, _reduction_dtype(policy), what)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        if world_size != 2:
            with torch.no_grad():
                for param, other in zip(ours.parameters(), theirs.parameters()):
                    param.to_local().copy_(other.to_local())
    for (name, param), other in zip(ours.named_parameters(), theirs.parameters()):
        _assert_equal(param.full_tensor(), other.full_tensor(), f"{policy_name}: {name}")


# Every policy at two ranks; at three (uneven shards) the two reduction arithmetics:
# a bf16 average, and fp16's division before and after the sum. One set of processes
# per world size runs its policies one after the other.
@pytest.mark.parametrize(
    "world_size, policy_names", [(2, list(POLICIES)), (3, ["param", "fp16_reduce"])], ids=["W2", "W3"]
)
def test_eager_matches_torch_fsdp2(world_size, policy_names):
    run_gloo(_eager_worker, world_size, policy_names)


class ResidualBlock(torch.nn.Module):
    """Casts its input for the linear layer itself and adds the uncast input back."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        return x + self.linear(x.to(self.linear.weight.dtype))


def _no_input_cast_worker(rank, world_size):
    """``cast_forward_inputs=False``: the blocks' residual stays fp32, as in FSDP2 (a cast would round it)."""
    models = []
    for shard in (fully_shard, torch_fully_shard):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(ResidualBlock() for _ in range(3)), torch.nn.Linear(16, 4))
        for block in model[:3]:
            shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=BF16, cast_forward_inputs=False))
        models.append(shard(model))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for step in range(STEPS):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        outputs = [model(x) for model in models]
        assert outputs[0].dtype == FP32
        _assert_equal(outputs[0], outputs[1], f"output, step {step}")
        for output in outputs:
            output.square().mean().backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for (name, param), other in zip(models[0].named_parameters(), models[1].parameters()):
        _assert_equal(param.full_tensor(), other.full_tensor(), name)


def test_cast_forward_inputs_false_matches_torch_fsdp2():
    run_gloo(_no_input_cast_worker, 2)


def _compiled_worker(rank, world_size, policy_names, backend):
    for policy_name in policy_names:
        torch._dynamo.reset()
        _compiled_parity(rank, world_size, policy_name, backend)


def _compiled_parity(rank, world_size, policy_name, backend):
    """Compiled against compile_shard eager, same policies: one graph each way, bitwise under aot_eager."""
    clear_compilation_metrics()
    counters.clear()
    policies = POLICIES[policy_name]
    compiled_model, eager_model = build(fully_shard, policies), build(fully_shard, policies)
    compiled = torch.compile(compiled_model, backend=backend, fullgraph=True)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (compiled_model, eager_model)]
    for step in range(3):
        tokens = global_batch(step, world_size, 2, 8, LlamaConfig().vocab_size)[2 * rank : 2 * rank + 2]
        losses = [lm_loss(model, tokens) for model in (compiled, eager_model)]
        _assert_equal(losses[0], losses[1], f"{policy_name}: loss, step {step}")
        for loss in losses:
            loss.backward()
        for (name, param), other in zip(compiled_model.named_parameters(), eager_model.parameters()):
            what = f"{policy_name}: {name}.grad, step {step}"
            _assert_equal(param.grad.full_tensor(), other.grad.full_tensor(), what)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"] and recompiles() == 0


def test_aot_eager_matches_eager():
    run_gloo(_compiled_worker, 2, ["param_reduce", "root_differs"], "aot_eager")


@pytest.mark.parametrize(
    "policy, error, message",
    [
        (MixedPrecisionPolicy(param_dtype=torch.int8), ValueError, r"fully_shard\(Linear\): mp_policy.param_dtype"),
        (MixedPrecisionPolicy(reduce_dtype="bf16"), ValueError, "reduce_dtype must be a floating-point torch.dtype"),
        ({"param_dtype": torch.bfloat16}, TypeError, "must be a torch.distributed.fsdp.MixedPrecisionPolicy, got dict"),
    ],
    ids=["int_param_dtype", "string_reduce_dtype", "dict"],
)
def test_bad_policies_raise_naming_the_module(fake_pg, policy, error, message):
    with pytest.raises(error, match=message):
        fully_shard(torch.nn.Linear(4, 4), mp_policy=policy)


def _step_collectives(model, tokens):
    with CollectiveCounter() as counter:
        lm_loss(model, tokens).backward()
    return counter


def _bytes_worker(rank, world_size):
    """bf16 all-gathers and fp32 reductions: torch FSDP2's bytes, eager and in the compiled graphs."""
    policies = POLICIES["param_reduce"]
    ours, theirs = build(fully_shard, policies), build(torch_fully_shard, policies)
    fp32 = build(fully_shard, (MixedPrecisionPolicy(), MixedPrecisionPolicy()))
    compiled_model = build(fully_shard, policies)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    tokens = global_batch(0, world_size, 2, 8, LlamaConfig().vocab_size)[2 * rank : 2 * rank + 2]
    lm_loss(compiled, tokens).backward()  # compiles
    eager, torch_eager, fp32_eager, graphs = (_step_collectives(m, tokens) for m in (ours, theirs, fp32, compiled))
    assert eager.counts == torch_eager.counts and eager.bytes == torch_eager.bytes, (eager.bytes, torch_eager.bytes)
    assert eager.bytes["all_gather"] * 2 == fp32_eager.bytes["all_gather"]
    assert eager.bytes["reduce_scatter"] == fp32_eager.bytes["reduce_scatter"]
    # On gloo the compiled reductions are all-to-alls of the same buffers ([Note: gloo reduce-scatter]).
    assert graphs.bytes == {"all_gather": eager.bytes["all_gather"], "all_to_all": eager.bytes["reduce_scatter"]}


def test_collectives_move_torch_fsdp2_bytes():
    run_gloo(_bytes_worker, 2)


def _accumulation_worker(rank, world_size):
    """Without sync, gradients accumulate in the reduction's dtype (bf16, or fp32 with ``reduce_dtype``): FSDP2's.

    On torch 2.15 FSDP2 accumulates in the parameters' dtype (fp32) without a
    ``reduce_dtype`` too, and in the first micro-batch adds the tied weight's two
    contributions in fp32, where compile_shard adds them in bf16 first
    ([Note: gradient contributions] in compile_shard._param): that weight's gradient
    is then within bf16's rounding of FSDP2's, every other one bitwise.
    """
    for policy_name in ("param", "param_reduce"):
        policies = POLICIES[policy_name]
        ours, theirs = build(fully_shard, policies), build(torch_fully_shard, policies)
        for step in range(2):
            reductions = [
                accumulate_micro_batches(model, model, step, rank, world_size)["reduce_scatter"]
                for model in (ours, theirs)
            ]
            assert reductions[0] == len(ours.layers) + 1, reductions
            for (name, param), other in zip(ours.named_parameters(), theirs.parameters()):
                what = f"{policy_name}: {name}.grad, step {step}"
                grad, other_grad = param.grad.full_tensor(), other.grad.full_tensor()
                if ROUNDS_EACH_GRADIENT_CONTRIBUTION and name == "tok_embeddings.weight":
                    _assert_reduced_alike(grad, other_grad, BF16, what)
                else:
                    _assert_equal(grad, other_grad, what)
            for model in (ours, theirs):
                model.zero_grad()


def test_accumulating_without_sync_matches_torch_fsdp2():
    run_gloo(_accumulation_worker, 2)
