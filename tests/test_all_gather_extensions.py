"""FSDP2's all-gather extensions: tensor-subclass parameters gathered as other tensors.

The subclass here, ``Int8Rows``, is the tests' own: an fp32 weight all-gathered as two
inputs, its rows rounded to int8 and one fp32 scale per row, with the int8 range as
metadata; ``fsdp_post_all_gather`` dequantizes them into ``param_dtype``, and the
weight's gradient goes straight through, as FSDP2 gives it ([Note: all-gather
extensions] in compile_shard/_param.py). torch FSDP2 runs the same subclass on the same
model and data in every parity test. torchao's float8 training weights, whose
unsharded parameter is itself a tensor subclass, run eagerly against FSDP2 (torchao is
in the ``test`` extra).
"""

import importlib.util
from collections import Counter

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import clear_compilation_metrics, counters
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils._pytree import tree_map_only

from compile_shard import fully_shard
from compile_shard._layout import padded_rows
from compile_shard.debug import recompiles
from compile_shard.models import Llama, LlamaConfig
from dist_utils import (
    FakeProcessGroup,
    assert_gradients_match,
    counted_step,
    global_batch,
    lm_loss,
    run_gloo,
    step_optimizers_and_compare,
)
from test_unused_params import Branchy

aten = torch.ops.aten
# Every block's weights shard evenly at 2 and 3 ranks: an unevenly sharded parameter's
# all-gather inputs must all have the padded shard's size (FSDP2's rule), which a scale
# per row does not (test_uneven_inputs_of_another_size_raise).
CONFIG = LlamaConfig(dim=48, n_heads=4, ffn_hidden=96)
STEPS = 3
BF16_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# torch FSDP2 at 3 ranks: gloo's reduce-scatter sums an element's ranks in an order that
# depends on its place in the buffer, as for every model (tests/test_parity.py).
# AdamW's step divides by the root of the second moment, which magnifies those last bits
# where a gradient is small.
TORCH_FSDP2_TOLERANCE = {2: 0.0, 3: 5e-6}
PARAM_TOLERANCE = {2: 0.0, 3: 2e-5}

# The ops whose outputs stay Int8Rows: views, copies and the sharding's own ops.
_KEEPS_SUBCLASS = {
    aten.detach.default,
    aten.view.default,
    aten.slice.Tensor,
    aten.new_zeros.default,
    aten.clone.default,
    aten.split.Tensor,
    aten.chunk.default,
    aten.alias.default,
    aten._to_copy.default,
}


class Int8Rows(torch.Tensor):
    """An fp32 weight all-gathered as int8 rows and an fp32 scale per row."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), dtype=data.dtype, device=data.device
        )

    def __init__(self, data: torch.Tensor):
        self._data = data

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"Int8Rows({self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, metadata, outer_size, outer_stride):
        return cls(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrapped = tree_map_only(Int8Rows, lambda tensor: tensor._data, (args, kwargs or {}))
        output = func(*unwrapped[0], **unwrapped[1])
        if func in _KEEPS_SUBCLASS:
            return tree_map_only(torch.Tensor, cls, output)
        if func._schema.is_mutable and isinstance(args[0], Int8Rows):
            return args[0]  # in place on the fp32 data (the optimizer's updates)
        return output

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        rows = self._data
        scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        return (torch.round(rows / scale).to(torch.int8), scale), 127

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        rows, scale = all_gather_outputs
        unsharded = rows.to(param_dtype) * (scale * (127 / metadata)).to(param_dtype)
        if out is not None:  # torch FSDP2 refills its unsharded parameter in place
            with torch.no_grad(), _unsafe_preserve_version_counter(out):
                out.copy_(unsharded)
            return None
        return unsharded, (unsharded,)


def build(shard, mp_policy=MixedPrecisionPolicy(), *, subclass=Int8Rows, config=CONFIG) -> Llama:
    """A Llama whose blocks' linear weights are ``subclass``, sharded per block and at the root."""
    torch.manual_seed(0)
    model = Llama(config)
    for block in model.layers:
        for module in block.modules():
            if isinstance(module, nn.Linear):
                module.weight = nn.Parameter(subclass(module.weight.data))
        shard(block, mp_policy=mp_policy)
    shard(model, mp_policy=mp_policy)
    return model


def _tokens(step: int, rank: int, world_size: int) -> torch.Tensor:
    return global_batch(step, world_size, 2, 8, CONFIG.vocab_size)[2 * rank : 2 * rank + 2]


def _wire_bytes(model: Llama, world_size: int) -> int:
    """Bytes one all-gather of every group moves: the extensions' inputs, the other parameters' padded shards."""
    total = 0
    for name, param in model.named_parameters():
        rows, columns = param.shape[0], param.numel() // param.shape[0]
        padded = padded_rows(rows, world_size)
        if isinstance(param.to_local(), Int8Rows):
            total += padded * columns + padded * 4  # int8 rows, an fp32 scale per row
        else:
            total += padded * columns * param.element_size()
    return world_size * total


def _eager_worker(rank, world_size, policy_names):
    for policy_name in policy_names:
        policy = {"fp32": MixedPrecisionPolicy(), "bf16": BF16_POLICY}[policy_name]
        ours, theirs = build(fully_shard, policy), build(torch_fully_shard, policy)
        optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in (ours, theirs)]
        tolerance = TORCH_FSDP2_TOLERANCE[world_size]
        for step in range(STEPS):
            tokens = _tokens(step, rank, world_size)
            (our_counts, our_bytes), (their_counts, their_bytes) = (counted_step(m, tokens) for m in (ours, theirs))
            # One reduce-scatter per group and the same bytes both ways; the inputs of
            # several dtypes are one all-gather each here, where FSDP2 packs them as bytes.
            assert our_bytes == their_bytes and our_counts["reduce_scatter"] == their_counts["reduce_scatter"]
            if step == 0 and policy_name == "fp32":
                # Forward gathers every group; backward gathers the blocks again (the root keeps its parameters).
                blocks = sum(_wire_bytes(block, world_size) for block in ours.layers)
                assert our_bytes["all_gather"] == _wire_bytes(ours, world_size) + blocks
            if tolerance == 0.0:
                assert_gradients_match(ours, theirs)
                step_optimizers_and_compare(optimizers, [ours], theirs)
            else:
                for (name, param), other in zip(ours.named_parameters(), theirs.parameters()):
                    torch.testing.assert_close(
                        param.grad.full_tensor(), other.grad.full_tensor(), rtol=0, atol=tolerance, msg=name
                    )
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad()
        for (name, param), other in zip(ours.named_parameters(), theirs.parameters()):
            assert type(param.to_local()) is type(other.to_local()), name
            torch.testing.assert_close(
                param.full_tensor(),
                other.full_tensor(),
                rtol=0,
                atol=PARAM_TOLERANCE[world_size],
                msg=lambda message, name=name: f"{name}: {message}",
            )


@pytest.mark.parametrize("world_size, policy_names", [(2, ["fp32", "bf16"]), (3, ["fp32"])])
def test_eager_matches_torch_fsdp2(world_size, policy_names):
    run_gloo(_eager_worker, world_size, policy_names)


def _compiled_worker(rank, world_size):
    """aot_eager against torch FSDP2: bitwise, one graph, and the eager bytes in the compiled graphs."""
    clear_compilation_metrics()
    counters.clear()
    compiled_model, theirs = build(fully_shard), build(torch_fully_shard)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in (compiled_model, theirs)]
    for step in range(STEPS):
        tokens = _tokens(step, rank, world_size)
        _, their_bytes = counted_step(theirs, tokens)
        _, compiled_bytes = counted_step(compiled, tokens)
        if step > 0:  # the first step also counts what compiling runs
            # On gloo the compiled reductions are all-to-alls of the same buffers ([Note: gloo reduce-scatter]).
            assert compiled_bytes == {
                "all_gather": their_bytes["all_gather"],
                "all_to_all": their_bytes["reduce_scatter"],
            }, (compiled_bytes, their_bytes)
        assert_gradients_match(compiled_model, theirs)
        step_optimizers_and_compare(optimizers, [compiled_model], theirs)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"] and recompiles() == 0


def test_aot_eager_matches_torch_fsdp2_in_one_graph():
    run_gloo(_compiled_worker, 2)


def _build_branchy(shard):
    """test_unused_params' model with skipped branches and an unused head, its blocks' weights ``Int8Rows``."""
    torch.manual_seed(0)
    model = Branchy()
    for module in model.blocks.modules():
        if isinstance(module, nn.Linear):
            module.weight = nn.Parameter(Int8Rows(module.weight.data))
    for block in model.blocks:
        shard(block)
    shard(model)
    return model


def _unused_worker(rank, world_size):
    """A weight the forward leaves unused gets no gradient, as in FSDP2, eager and compiled."""
    theirs, ours, compiled_model = (_build_branchy(shard) for shard in (torch_fully_shard, fully_shard, fully_shard))
    models = (theirs, ours, compiled_model)
    runs = (theirs, ours, torch.compile(compiled_model, backend="aot_eager", fullgraph=True))
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1) for model in models]
    for step in range(2):
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(10 * step + rank))
        for run in runs:
            run(x).square().mean().backward()
        for model in models[1:]:
            for (name, param), other in zip(model.named_parameters(), theirs.parameters()):
                assert (param.grad is None) == (other.grad is None), (name, model is compiled_model)
                if other.grad is not None:
                    torch.testing.assert_close(param.grad.to_local(), other.grad.to_local(), rtol=0, atol=0, msg=name)
        step_optimizers_and_compare(optimizers, models[1:], theirs)
    assert theirs.blocks[0].skipped.weight.grad is None


def test_unused_parameters_get_no_gradient_as_in_torch_fsdp2():
    run_gloo(_unused_worker, 2)


@pytest.fixture
def fake_pg():
    with FakeProcessGroup(2):
        yield


class _PreAllGatherOnly(Int8Rows):
    @property
    def fsdp_post_all_gather(self):
        raise AttributeError("fsdp_post_all_gather")


class _MeshOnly(Int8Rows):
    """FSDP2's older signature, ``fsdp_pre_all_gather(mesh)``, which it still accepts."""

    calls: list = []

    def fsdp_pre_all_gather(self, mesh):
        _MeshOnly.calls.append(mesh)
        return super().fsdp_pre_all_gather(mesh, None, None, None, None)


class _SubclassOut(Int8Rows):
    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        unsharded, _ = super().fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype)
        return Int8Rows(unsharded), ()


def test_an_extension_needs_both_methods(fake_pg):
    with pytest.raises(ValueError, match=r"parameter 'attention.wq.weight' is a _PreAllGatherOnly with only one"):
        build(fully_shard, subclass=_PreAllGatherOnly)


def test_the_older_pre_all_gather_signature_gets_the_mesh(fake_pg):
    _MeshOnly.calls.clear()
    model = build(fully_shard, subclass=_MeshOnly)
    lm_loss(model, torch.zeros(1, 8, dtype=torch.long)).backward()
    linears = sum(isinstance(module, nn.Linear) for module in model.layers.modules())
    # Forward gathers each block, backward again.
    assert len(_MeshOnly.calls) == 2 * linears and Counter(mesh.size() for mesh in _MeshOnly.calls) == {2: 2 * linears}


class _RecordsUnsharded(Int8Rows):
    storages: list[int] = []

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        result = super().fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)
        _RecordsUnsharded.storages.append(result[0].untyped_storage().data_ptr())
        return result


def test_eager_mode_computes_with_what_fsdp_post_all_gather_returned(fake_pg):
    """No copy of it: eager mode gives it the all-gather's backward as views (``ops.as_gathered_views``)."""
    _RecordsUnsharded.storages.clear()
    model = build(fully_shard, subclass=_RecordsUnsharded)
    read = []
    model.layers[0].attention.wq.register_forward_pre_hook(
        lambda module, args: read.append(module.weight.untyped_storage().data_ptr())
    )
    lm_loss(model, torch.zeros(1, 8, dtype=torch.long)).backward()
    assert len(read) == 1 and read[0] in _RecordsUnsharded.storages
    assert model.layers[0].attention.wq.weight.grad is not None


def test_an_unsharded_tensor_subclass_trains_eagerly_and_compiled_in_one_graph(fake_pg):
    """Eager mode frees and refills a tensor subclass through its inner tensors; a compiled graph (fullgraph)
    gives it the all-gather's backward ([Note: an unsharded tensor subclass in a trace]) and the same gradients."""
    models = [build(fully_shard, subclass=_SubclassOut) for _ in range(2)]
    tokens = torch.zeros(1, 8, dtype=torch.long)
    lm_loss(models[0], tokens).backward()
    lm_loss(torch.compile(models[1], backend="aot_eager", fullgraph=True), tokens).backward()
    for (name, param), other in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(param.grad.to_local(), other.grad.to_local(), rtol=0, atol=0, msg=name)


def _torchao_worker(rank, world_size, backend):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def build_float8(shard):
        torch.manual_seed(0)
        model = Llama(CONFIG)
        for block in model.layers:
            convert_to_float8_training(block, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
            shard(block)
        shard(model)
        return model

    ours, theirs = build_float8(fully_shard), build_float8(torch_fully_shard)
    runnable = ours if backend is None else torch.compile(ours, backend=backend, fullgraph=True)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in (ours, theirs)]
    for step in range(STEPS):
        tokens = _tokens(step, rank, world_size)
        (our_counts, our_bytes), (their_counts, their_bytes) = (counted_step(m, tokens) for m in (runnable, theirs))
        # float8 weights on the wire, and the scales' amax all-reduces, as in FSDP2.
        assert our_bytes["all_gather"] == their_bytes["all_gather"], (our_bytes, their_bytes)
        assert our_counts["all_reduce"] == their_counts["all_reduce"] > 0
        if backend is None:
            assert our_bytes == their_bytes
        assert_gradients_match(ours, theirs)
        step_optimizers_and_compare(optimizers, [ours], theirs)


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_torchao_float8_all_gather_matches_torch_fsdp2(backend):
    """torchao's float8 training weights, whose fsdp_post_all_gather returns a tensor subclass; compiled in one graph."""
    # Found, not imported: only the ranks import torchao, which registers ops and pytree types.
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is in the test extra: pip install -e '.[test]'")
    run_gloo(_torchao_worker, 2, backend)


def test_uneven_inputs_of_another_size_raise(fake_pg):
    """As in FSDP2: 64 rows over 2 ranks shard evenly, a vocabulary of 1001 rows does not."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig())
    model.output.weight = nn.Parameter(Int8Rows(model.output.weight.data))
    fully_shard(model)
    with pytest.raises(ValueError, match=r"'output.weight' is sharded unevenly \(1001 rows over 2 ranks\)"):
        model(torch.zeros(1, 8, dtype=torch.long))


def test_a_custom_all_gather_is_refused_for_a_group_with_extensions(fake_pg):
    """compile_shard gathers an extension's inputs itself, so a custom all-gather would be ignored there."""
    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(Int8Rows(model.weight.data))
    fully_shard(model)
    with pytest.raises(NotImplementedError, match=r"fully_shard\('Linear'\): set_custom_all_gather is not supported"):
        model.set_custom_all_gather(object())
