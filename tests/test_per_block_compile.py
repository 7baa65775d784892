"""Modules compiled on their own, before or after fully_shard, against torch FSDP2.

Torchtitan's per-block compile: each block compiled on its own, the root eager. The
sharding runs eagerly around each block's compiled forward and every block shares one
graph ([Note: a block compiled on its own] in compile_shard/_api.py). A root compiled
before fully_shard compiles every block into one graph.
"""

import copy
import warnings

import pytest
import torch
from torch._dynamo.utils import clear_compilation_metrics, counters
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from compile_shard import fully_shard
from compile_shard.debug import recompiles
from compile_shard.models import Llama, LlamaConfig
from compile_shard.passes import ShardedGraphBreakWarning, settings
from dist_utils import (
    assert_gradients_match,
    counted_step,
    global_batch,
    run_gloo,
    step_optimizers_and_compare,
    train_against_torch_fsdp2,
)

CONFIG = LlamaConfig(n_layers=3)
CHECKPOINTED = LlamaConfig(n_layers=3, checkpoint_blocks=True)  # torchtitan: activation checkpointing, then compile


def _compiled_per_block(shard, order: str, config: LlamaConfig = CONFIG) -> Llama:
    """A Llama sharded per block by ``shard``, each block compiled on its own in ``order`` (any other: uncompiled).

    Every order compiles with ``fullgraph=True``, as torchtitan does.
    """
    torch.manual_seed(0)
    model = Llama(config)
    for index, block in enumerate(model.layers):
        if order == "torch_compile_then_shard":  # torchtitan's order
            model.layers[index] = torch.compile(block, backend="aot_eager", fullgraph=True)
        elif order == "block_compile_then_shard":
            block.compile(backend="aot_eager", fullgraph=True)
    for block in model.layers:
        shard(block)
    shard(model)
    for index, block in enumerate(model.layers):
        if order == "shard_then_block_compile":
            block.compile(backend="aot_eager", fullgraph=True)
        elif order == "shard_then_torch_compile":
            model.layers[index] = torch.compile(block, backend="aot_eager", fullgraph=True)
    return model


def _train_against_torch_fsdp2(rank: int, world_size: int, order: str, config: LlamaConfig) -> None:
    """At 3 ranks the oracle is compile_shard uncompiled: FSDP2 sums the ranks' gradients in another order.

    See [Note: parity tolerance] in test_parity.py.
    """
    ours = _compiled_per_block(fully_shard, order, config)
    oracle = (torch_fully_shard, order) if world_size == 2 else (fully_shard, "")
    theirs = _compiled_per_block(*oracle, config)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in (theirs, ours)]
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardedGraphBreakWarning)
        for step in range(3):
            tokens = global_batch(step, world_size, 2, 16, config.vocab_size).chunk(world_size)[rank]
            collectives = counted_step(ours, tokens)
            # One graph for the three blocks, then one for torch FSDP2's, and none after the first step.
            assert counters["stats"]["unique_graphs"] == (1 if step == 0 or world_size == 3 else 2)
            assert collectives == counted_step(theirs, tokens)
            assert_gradients_match(ours, theirs)
            step_optimizers_and_compare(optimizers, [ours], theirs)
    assert counters["stats"]["unique_graphs"] == (2 if world_size == 2 else 1)


@pytest.mark.parametrize(
    "order, world_size, config",
    [
        pytest.param("torch_compile_then_shard", 2, CONFIG, id="torch_compile_then_shard"),
        pytest.param("torch_compile_then_shard", 3, CONFIG, id="torch_compile_then_shard_uneven"),
        pytest.param("torch_compile_then_shard", 2, CHECKPOINTED, id="torch_compile_then_shard_checkpointed"),
        pytest.param("block_compile_then_shard", 2, CONFIG, id="block_compile_then_shard"),
        pytest.param("shard_then_block_compile", 2, CONFIG, id="shard_then_block_compile"),
        pytest.param("shard_then_block_compile", 2, CHECKPOINTED, id="shard_then_block_compile_checkpointed"),
        pytest.param("shard_then_torch_compile", 2, CONFIG, id="shard_then_torch_compile"),
    ],
)
def test_blocks_compiled_on_their_own_share_one_graph_and_match_torch_fsdp2(order, world_size, config):
    """Collectives, gradients and parameters equal torch FSDP2's bitwise over 3 AdamW steps; no recompile.

    At 3 ranks (uneven shards) they equal compile_shard's uncompiled run's instead.
    Where both models compile the same block class (compiled before sharding), Dynamo
    compiles its forward once per model, as the sharded block's class differs.
    """
    run_gloo(_train_against_torch_fsdp2, world_size, order, config)


def _whole_model_over_compiled_blocks(rank: int, world_size: int) -> None:
    theirs = _compiled_per_block(torch_fully_shard, "")
    ours = _compiled_per_block(fully_shard, "shard_then_block_compile")

    def tokens_for_step(step: int) -> torch.Tensor:
        return global_batch(step, world_size, 2, 8, CONFIG.vocab_size).chunk(world_size)[rank]

    train_against_torch_fsdp2(theirs, [ours], ["aot_eager"], tokens_for_step)


def test_compiling_the_whole_model_traces_blocks_compiled_on_their_own_into_its_one_graph():
    """``block.compile()`` and then ``torch.compile(model)``: one graph with every collective, FSDP2's numbers."""
    run_gloo(_whole_model_over_compiled_blocks, 2)


def _root_compiled_before_fully_shard(rank: int, world_size: int) -> None:
    """The oracle runs uncompiled: compiled too, FSDP2's hooks break its graph in the loop over the blocks,
    and Dynamo then runs ``Llama.forward`` eagerly for both models, which share its code."""
    settings.bucket_cap_mb = 0  # its all-gathers are counted against FSDP2's, one per group
    torch.manual_seed(0)
    ours = Llama(CONFIG)
    theirs = copy.deepcopy(ours)
    for block in ours.layers:
        fully_shard(block)
    ours = fully_shard(torch.compile(ours, backend="aot_eager", fullgraph=True))
    for block in theirs.layers:
        torch_fully_shard(block)
    torch_fully_shard(theirs)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in (theirs, ours)]
    clear_compilation_metrics()
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardedGraphBreakWarning)
        for step in range(3):
            tokens = global_batch(step, world_size, 2, 16, CONFIG.vocab_size).chunk(world_size)[rank]
            # Only the all-gathers compare: on gloo the compiled backward reduces by all-to-all.
            counts, nbytes = counted_step(ours, tokens)
            torch_counts, torch_nbytes = counted_step(theirs, tokens)
            assert counts["all_gather"] == torch_counts["all_gather"]
            assert nbytes["all_gather"] == torch_nbytes["all_gather"]
            assert_gradients_match(ours, theirs)
            step_optimizers_and_compare(optimizers, [ours], theirs)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"] and recompiles() == 0


def test_a_root_compiled_before_fully_shard_compiles_its_blocks_into_one_graph():
    """``fully_shard(torch.compile(model, fullgraph=True))``: one graph with every group's collectives, the
    root's too; all-gathers, gradients and parameters equal FSDP2's bitwise over 3 steps."""
    run_gloo(_root_compiled_before_fully_shard, 2)
