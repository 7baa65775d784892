"""Collectives per training step equal torch FSDP2's for the same wrapping, eager and compiled."""

import dataclasses

import pytest
import torch
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from compile_shard import fully_shard
from compile_shard.debug import CollectiveCounter
from compile_shard.dry_run import capture_step
from compile_shard.models import LlamaConfig
from compile_shard.passes.cost_model import PROFILES, get_profile
from dist_utils import FakeProcessGroup, build_sharded_llama, lm_loss
from graph_utils import op_counts, pass_settings

WRAPPINGS = [
    pytest.param(False, None, None, id="default"),
    pytest.param(False, False, False, id="no_reshard"),
    pytest.param(False, True, True, id="all_reshard"),
    pytest.param(True, None, None, id="checkpointed_blocks"),
]


def _step_counts(shard, checkpoint_blocks, block_reshard, root_reshard):
    config = LlamaConfig(n_layers=3, checkpoint_blocks=checkpoint_blocks)
    model, _ = build_sharded_llama(config, shard=shard, block_reshard=block_reshard, root_reshard=root_reshard)
    tokens = torch.randint(0, config.vocab_size, (2, 9))
    lm_loss(model, tokens).backward()  # first step: lazy init outside the count
    with CollectiveCounter() as counter:
        lm_loss(model, tokens).backward()
    return dict(counter.counts)


@pytest.mark.parametrize("world_size", [2, 8])
@pytest.mark.parametrize("checkpoint_blocks, block_reshard, root_reshard", WRAPPINGS)
def test_collectives_per_step_equal_torch_fsdp2(world_size, checkpoint_blocks, block_reshard, root_reshard):
    with FakeProcessGroup(world_size):
        ours = _step_counts(fully_shard, checkpoint_blocks, block_reshard, root_reshard)
        theirs = _step_counts(torch_fully_shard, checkpoint_blocks, block_reshard, root_reshard)
    assert ours == theirs
    groups, resharded_blocks = 4, 3 if block_reshard is not False else 0
    resharded_root = 1 if root_reshard else 0
    assert ours == {"all_gather": groups + resharded_blocks + resharded_root, "reduce_scatter": groups}


def _compiled_step_counts(checkpoint_blocks, block_reshard, root_reshard, bucket_cap_mb=0):
    """Collectives in the compiled step; ``bucket_cap_mb=0``: one per group, FSDP2's."""
    config = LlamaConfig(n_layers=3, checkpoint_blocks=checkpoint_blocks)
    model, _ = build_sharded_llama(config, block_reshard=block_reshard, root_reshard=root_reshard)
    tokens = torch.randint(0, config.vocab_size, (2, 9))
    with pass_settings(bucket_cap_mb=bucket_cap_mb):
        graphs = capture_step(model, lambda compiled: lm_loss(compiled, tokens))
    counts = op_counts(graphs[0].graph) + op_counts(graphs[1].graph)
    return {kind: counts[kind] for kind in ("all_gather", "reduce_scatter")}


@pytest.mark.parametrize("checkpoint_blocks, block_reshard, root_reshard", WRAPPINGS)
def test_compiled_collectives_per_step_equal_torch_fsdp2_and_fewer_with_buckets(
    checkpoint_blocks, block_reshard, root_reshard
):
    with FakeProcessGroup(8):
        theirs = _step_counts(torch_fully_shard, checkpoint_blocks, block_reshard, root_reshard)
        ours = _compiled_step_counts(checkpoint_blocks, block_reshard, root_reshard)
        # A cap that fits two blocks (0.19 MB each, unsharded) but not three.
        bucketed = _compiled_step_counts(checkpoint_blocks, block_reshard, root_reshard, bucket_cap_mb=0.5)
    assert ours == theirs
    assert bucketed["all_gather"] < ours["all_gather"] and bucketed["reduce_scatter"] < ours["reduce_scatter"]


def test_by_default_the_cost_model_buckets_small_blocks_and_keeps_fsdp2s_collectives_for_large_ones(monkeypatch):
    """[Note: the cost model's buckets] on a compiled model whose blocks' regions copy out inside their bucket
    ([Note: a bucket of regions' groups])."""
    no_latency = dataclasses.replace(get_profile("h100_nvlink"), name="no_latency", link_latency_s=0.0)
    monkeypatch.setitem(PROFILES, "no_latency", no_latency)
    with FakeProcessGroup(8):
        theirs = _step_counts(torch_fully_shard, False, None, None)
        chosen = _compiled_step_counts(False, None, None, bucket_cap_mb=None)
        with pass_settings(cost_profile="no_latency"):  # nothing is latency-bound: every group is "large"
            unbucketed = _compiled_step_counts(False, None, None, bucket_cap_mb=None)
    # Three blocks of 0.19 MB, under the 2.6 MB below which a collective over 8 gloo ranks
    # is latency-bound (cpu_gloo), share one bucket; the root keeps its parameters after
    # forward (FSDP2's default) and gathers alone.
    assert chosen == {"all_gather": 2 + 1, "reduce_scatter": 2}
    assert unbucketed == theirs
