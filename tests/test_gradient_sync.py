"""Gradient accumulation without sync (``set_requires_gradient_sync``), eager and compiled.

[Note: gradient accumulation without sync] in compile_shard.ops: backward adds the
unsharded gradients into a buffer per group while sync is off, and the micro-batch
with sync on reduce-scatters the sum once.
"""

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import clear_compilation_metrics
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from compile_shard._collectives import node_collective
from compile_shard.debug import CollectiveCounter, recompiles
from compile_shard.models import LlamaConfig
from compile_shard.passes import settings
from dist_utils import build_sharded_llama, global_batch, lm_loss, run_gloo

MICRO_BATCHES = 4
CONFIG = LlamaConfig()
GROUPS = CONFIG.n_layers + 1


def accumulate_micro_batches(model, runnable, step, rank, world_size, keep_unsharded=False):
    """One step of MICRO_BATCHES micro-batches, sync on the last only; returns the collectives it ran.

    ``keep_unsharded``: backward keeps the unsharded parameters for the next
    micro-batch, except after the last (FSDP2's ``set_reshard_after_backward``).
    """
    tokens = global_batch(step, world_size, 2 * MICRO_BATCHES, 8, CONFIG.vocab_size)
    local = tokens[2 * MICRO_BATCHES * rank : 2 * MICRO_BATCHES * (rank + 1)]
    with CollectiveCounter() as counter:
        for index, micro_batch in enumerate(local.chunk(MICRO_BATCHES)):
            last = index == MICRO_BATCHES - 1
            model.set_requires_gradient_sync(last)
            if keep_unsharded:
                model.set_reshard_after_backward(last)
            (lm_loss(runnable, micro_batch) / MICRO_BATCHES).backward()
    return counter.counts


def _eager_worker(rank, world_size, reshard):
    ours, reference = build_sharded_llama(CONFIG, block_reshard=reshard)
    theirs, _ = build_sharded_llama(CONFIG, shard=torch_fully_shard, block_reshard=reshard)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(2):
        reductions = [
            accumulate_micro_batches(model, model, step, rank, world_size)["reduce_scatter"] for model in (ours, theirs)
        ]
        assert reductions[0] == GROUPS, reductions
        for (name, param), other in zip(ours.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(param.grad.full_tensor(), other.grad.full_tensor(), rtol=0, atol=0, msg=name)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.parametrize("reshard", [None, False], ids=["reshard_default", "reshard_false"])
def test_accumulating_without_sync_matches_torch_fsdp2(reshard):
    run_gloo(_eager_worker, 2, reshard)


def _keep_unsharded_worker(rank, world_size):
    for reshard in (None, False):
        ours, _ = build_sharded_llama(CONFIG, block_reshard=reshard)
        theirs, _ = build_sharded_llama(CONFIG, shard=torch_fully_shard, block_reshard=reshard)
        optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
        for step in range(2):
            collectives = [accumulate_micro_batches(m, m, step, rank, world_size, keep_unsharded=True) for m in (ours, theirs)]
            # The micro-batches after the first gather only what forward resharded.
            assert collectives[0] == collectives[1], (reshard, collectives)
            gathers_without_keeping = MICRO_BATCHES * (GROUPS if reshard is False else 2 * GROUPS - 1)
            assert collectives[0]["all_gather"] < gathers_without_keeping
            for (name, param), other in zip(ours.named_parameters(), theirs.parameters()):
                torch.testing.assert_close(param.grad.to_local(), other.grad.to_local(), rtol=0, atol=0, msg=name)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()


def test_keeping_unsharded_parameters_between_micro_batches_matches_torch_fsdp2():
    """``set_reshard_after_backward(False)`` on all but the last micro-batch: FSDP2's all-gathers and gradients."""
    run_gloo(_keep_unsharded_worker, 2)


def _reductions_in(graph) -> int:
    kinds = [node_collective(node) for node in graph.nodes if node.op == "call_function"]
    return sum(kind is not None and kind.kind in ("reduce_scatter", "all_to_all") for kind in kinds)


def _compiled_worker(rank, world_size, keep_unsharded):
    """aot_eager against eager, micro-batch by micro-batch; the reductions each backward graph holds.

    ``keep_unsharded``: all micro-batches but the last keep the unsharded parameters
    (``set_reshard_after_backward(False)``), so the compiled step gathers each group
    once, in the first micro-batch's forward.
    """
    settings.bucket_cap_mb = 0  # the reductions are counted per group, FSDP2's
    backward_reductions = []

    def forward_compiler(graph_module, example_inputs):
        return graph_module

    def backward_compiler(graph_module, example_inputs):
        backward_reductions.append(_reductions_in(graph_module.graph))
        return graph_module

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)
    compiled_model, _ = build_sharded_llama(CONFIG)
    eager_model, _ = build_sharded_llama(CONFIG)
    runnable = torch.compile(compiled_model, backend=backend)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (compiled_model, eager_model)]
    clear_compilation_metrics()
    for step in range(20):
        tokens = global_batch(step, world_size, 2 * MICRO_BATCHES, 8, CONFIG.vocab_size)
        local = tokens[2 * MICRO_BATCHES * rank : 2 * MICRO_BATCHES * (rank + 1)]
        # Eager is the reference for the first steps; the later ones count recompiles only.
        runs = ((compiled_model, runnable), (eager_model, eager_model)) if step < 3 else ((compiled_model, runnable),)
        compiled_gathers = 0
        for index, micro_batch in enumerate(local.chunk(MICRO_BATCHES)):
            for model, run in runs:
                model.set_requires_gradient_sync(index == MICRO_BATCHES - 1)
                if keep_unsharded:
                    model.set_reshard_after_backward(index == MICRO_BATCHES - 1)
                with CollectiveCounter() as counter:
                    (lm_loss(run, micro_batch) / MICRO_BATCHES).backward()
                if model is compiled_model:
                    compiled_gathers += counter.counts["all_gather"]
        # Blocks reshard after forward: without keeping, backward gathers them again in every micro-batch.
        assert compiled_gathers == (GROUPS if keep_unsharded else MICRO_BATCHES * (2 * GROUPS - 1)), compiled_gathers
        if step < 3:
            for (name, param), other in zip(compiled_model.named_parameters(), eager_model.parameters()):
                torch.testing.assert_close(param.grad.full_tensor(), other.grad.full_tensor(), rtol=0, atol=0, msg=name)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    # One graph per setting: no reduction while accumulating, one per group with sync on. Keeping
    # the unsharded parameters adds a graph for the micro-batches that compute with kept ones.
    expected = [0, 0, GROUPS] if keep_unsharded else [0, GROUPS]
    assert backward_reductions == expected, backward_reductions
    assert recompiles() == len(expected) - 1  # then none over 20 steps


@pytest.mark.parametrize(
    "keep_unsharded, world_size",
    [(False, 2), pytest.param(True, 2, marks=pytest.mark.slow), pytest.param(True, 3, marks=pytest.mark.slow)],
    ids=["resharding", "keeping_unsharded", "keeping_unsharded_uneven"],
)
def test_accumulating_without_sync_compiled_matches_eager_with_one_graph_per_setting(keep_unsharded, world_size):
    run_gloo(_compiled_worker, world_size, keep_unsharded)
