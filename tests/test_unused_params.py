"""Parameters the forward leaves unused: FSDP2 gives them no gradient, or a zero one with
``set_reduce_scatter_unused_params(True)`` ([Note: unused parameters] in passes.unused_params)."""

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from compile_shard import fully_shard
from compile_shard.debug import CollectiveCounter
from compile_shard.passes import settings
from dist_utils import FakeProcessGroup, copy_out_in_regions, run_gloo
from graph_utils import CapturingBackend, pass_settings

STEPS = 3


class Block(nn.Module):
    """A block with a branch its forward skips unless asked to take it."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(12, 12)
        self.skipped = nn.Linear(12, 12)

    def forward(self, x, take_skipped=False):
        x = x + torch.tanh(self.used(x))
        return x + self.skipped(x) if take_skipped else x


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(12, 5)
        self.unused_head = nn.Linear(12, 5)

    def forward(self, x, take_skipped=False):
        for block in self.blocks:
            x = block(x, take_skipped)
        return self.head(x)


def _build(shard, model_class=None):
    torch.manual_seed(0)
    model = (model_class or Branchy)()
    for block in model.blocks:
        shard(block)
    shard(model)
    return model


def _step(run, model, x):
    with CollectiveCounter() as counter:
        run(x).square().mean().backward()
    grads = {name: None if p.grad is None else p.grad.to_local().clone() for name, p in model.named_parameters()}
    # Compiled on gloo, a reduce-scatter runs as an all-to-all ([Note: gloo reduce-scatter]).
    return grads, counter.counts["reduce_scatter"] + counter.counts["all_to_all"]


def _assert_same_grads(grads, expected, label):
    assert {n for n, g in grads.items() if g is None} == {n for n, g in expected.items() if g is None}, label
    for name, grad in grads.items():
        if grad is not None:
            torch.testing.assert_close(grad, expected[name], rtol=0, atol=0, msg=f"{label}: {name}")


def _parity_worker(rank, world_size):
    settings.bucket_cap_mb = 0  # the compiled reductions are counted against FSDP2's, one per group
    theirs, ours, compiled_model = _build(torch_fully_shard), _build(fully_shard), _build(fully_shard)
    models = (theirs, ours, compiled_model)
    runs = (theirs, ours, torch.compile(compiled_model, backend="aot_eager"))
    # Weight decay changes a parameter that gets a zero gradient, not one that gets none.
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1) for model in models]
    counters.clear()
    for step in range(STEPS + 1):
        if step == STEPS:  # the other setting, on every model: zero gradients, and compiled recompiles once
            for model in models:
                model.set_reduce_scatter_unused_params(True)
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(10 * step + rank))
        (expected, expected_reductions), *results = [_step(run, model, x) for run, model in zip(runs, models)]
        unused = {name for name, grad in expected.items() if grad is None}
        assert unused == (set() if step == STEPS else {n for n in expected if "skipped" in n or "unused" in n})
        for (grads, reductions), label in zip(results, ("eager", "compiled")):
            _assert_same_grads(grads, expected, f"step {step}, {label}")
            assert reductions == expected_reductions, (label, reductions, expected_reductions)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        for model in models[1:]:
            for (name, param), other in zip(model.named_parameters(), theirs.parameters()):
                torch.testing.assert_close(param.to_local(), other.to_local(), rtol=0, atol=0, msg=name)
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]


@pytest.mark.skipif(
    not hasattr(TorchFSDPModule, "set_reduce_scatter_unused_params"),
    reason="this torch's FSDP2, the oracle, has no set_reduce_scatter_unused_params",
)
def test_unused_parameters_get_no_gradient_as_in_torch_fsdp2():
    run_gloo(_parity_worker, 2)


def _ranks_disagree_worker(rank, world_size):
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(rank))
    for reduce_scatter_unused_params in (False, True):
        torch.manual_seed(0)
        block = fully_shard(Block())
        block.set_reduce_scatter_unused_params(reduce_scatter_unused_params)
        # Rank 0 takes the skipped branch, rank 1 does not: FSDP2's reduce-scatters would not match.
        loss = block(x, take_skipped=rank == 0).square().mean()
        if rank == 1 and not reduce_scatter_unused_params:
            with pytest.raises(RuntimeError, match=r"'skipped\.(weight|bias)' was not used by this rank's forward"):
                loss.backward()
            continue
        loss.backward()
        assert all(param.grad.to_local().any() for param in block.parameters())


def test_ranks_using_different_parameters_raise_unless_unused_parameters_are_reduced():
    run_gloo(_ranks_disagree_worker, 2)


class _SkippingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(12, 12)
        self.skipped = nn.Linear(12, 12)

    def forward(self, x):
        return x + torch.tanh(self.used(x))


class _RegionBlocks(nn.Module):
    """Alike blocks, the later ones called in their shared region, each with a parameter it leaves unused."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(12, 12)
        self.blocks = nn.ModuleList(_SkippingBlock() for _ in range(3))

    def forward(self, x):
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return x


def _region_parity_worker(rank, world_size):
    theirs, compiled_model = _build(torch_fully_shard, _RegionBlocks), _build(fully_shard, _RegionBlocks)
    compiled = torch.compile(copy_out_in_regions(compiled_model), backend="aot_eager")
    models = (theirs, compiled_model)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1) for model in models]
    for step in range(STEPS):
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(10 * step + rank))
        (expected, _), (grads, _) = _step(theirs, theirs, x), _step(compiled, compiled_model, x)
        assert {name for name, grad in expected.items() if grad is None} == {
            f"blocks.{index}.skipped.{kind}" for index in range(3) for kind in ("weight", "bias")
        }
        _assert_same_grads(grads, expected, f"step {step}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        for (name, param), other in zip(compiled_model.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(param.to_local(), other.to_local(), rtol=0, atol=0, msg=name)


def test_an_unused_parameter_of_a_region_block_gets_no_gradient_as_in_torch_fsdp2():
    """A region that copies out its block's parameters returns one gradient for its all-gather output
    ([Note: a region copies out its block's parameters]); the unused parameter's zeros in it are found there."""
    with FakeProcessGroup(2), pass_settings(compile_regions=True):
        model = _build(fully_shard, _RegionBlocks)
        capture = CapturingBackend()
        torch.compile(model, backend=capture.backend)(torch.randn(4, 12)).sum().backward()
    forward = capture.forward_graphs[0].graph
    assert len(forward.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)) == 2
    run_gloo(_region_parity_worker, 2)
