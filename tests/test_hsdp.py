"""HSDP: a 2-D (replicate, shard) mesh, against torch FSDP2 on the same mesh and wrapping.

compile_shard gathers and reduce-scatters over the shard dimension and all-reduces the
reduce-scattered gradients over the replicate dimension ([Note: HSDP reduction] in
compile_shard.ops), FSDP2's placements ``(Replicate(), Shard(0))``.
"""

import functools

import pytest
import torch
from torch._dynamo.utils import clear_compilation_metrics, counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Replicate, Shard

from compile_shard import fully_shard
from compile_shard.debug import recompiles
from compile_shard.models import LlamaConfig
from dist_utils import (
    FakeProcessGroup,
    build_sharded_llama,
    counted_step,
    global_batch,
    lm_loss,
    run_gloo,
    train_against_torch_fsdp2,
)
from graph_utils import CapturingBackend, op_counts, pass_settings

CONFIG = LlamaConfig()
STEPS = 3


def _hsdp_worker(rank, world_size, shape, backends):
    """Each backend's compile_shard model against torch FSDP2: placements, gradients and parameters bitwise."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    theirs, _ = build_sharded_llama(CONFIG, shard=functools.partial(torch_fully_shard, mesh=mesh))
    models = [build_sharded_llama(CONFIG, shard=functools.partial(fully_shard, mesh=mesh))[0] for _ in backends]
    replica = rank // shape[1]  # the replicas train on different rows of the global batch

    def tokens_for_step(step):
        return global_batch(step, shape[0], 2, 8, CONFIG.vocab_size)[2 * replica : 2 * replica + 2]

    train_against_torch_fsdp2(theirs, models, backends, tokens_for_step)
    assert all(param.placements == (Replicate(), Shard(0)) for model in models for param in model.parameters())


# (1, 2): FSDP over both ranks with a replicate group of one; (2, 1): NO_SHARD, two
# replicas of unsharded parameters, all-reduced, with no all-gather and no
# reduce-scatter ([Note: a group of one rank] in compile_shard.ops); (2, 2): both at
# once, on 4 processes.
@pytest.mark.parametrize(
    "shape, backends",
    [((1, 2), (None, "aot_eager")), ((2, 1), (None,)), ((2, 2), (None, "aot_eager"))],
    ids=["1x2", "2x1", "2x2"],
)
def test_hsdp_matches_torch_fsdp2(shape, backends):
    run_gloo(_hsdp_worker, shape[0] * shape[1], shape, backends)


@pytest.mark.usefixtures("per_group_collectives")
@pytest.mark.parametrize("shape", [(2, 4), (4, 4), (2, 1)], ids=["2x4", "4x4", "2x1_no_shard"])
def test_compiled_hsdp_is_one_graph_each_way_with_an_all_reduce_per_reduction(shape):
    """A fake process group: torch FSDP2's collectives per step, the all-reduces in the backward graph, 20 steps.

    NO_SHARD's graphs gather and reduce-scatter nothing: one all-reduce per group.
    """
    capture = CapturingBackend()
    torch._dynamo.reset()
    clear_compilation_metrics()
    counters.clear()
    with FakeProcessGroup(shape[0] * shape[1]):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        theirs, _ = build_sharded_llama(CONFIG, shard=functools.partial(torch_fully_shard, mesh=mesh))
        model, _ = build_sharded_llama(CONFIG, shard=functools.partial(fully_shard, mesh=mesh))
        compiled = torch.compile(model, backend=capture.backend, fullgraph=True)
        for step in range(20):
            tokens = global_batch(step, 1, 2, 8, CONFIG.vocab_size)
            collectives = counted_step(compiled, tokens)
        assert collectives == counted_step(theirs, tokens)  # counts and bytes
        assert recompiles() == 0 and not counters["graph_break"]
    torch._dynamo.reset()
    (forward,), (backward,) = capture.forward_graphs, capture.backward_graphs
    groups = CONFIG.n_layers + 1
    sharded = shape[1] > 1
    assert op_counts(forward.graph)["all_gather"] == (groups if sharded else 0)
    backward_counts = op_counts(backward.graph)
    assert backward_counts["all_gather"] == (CONFIG.n_layers if sharded else 0)  # the resharded blocks again
    assert backward_counts["reduce_scatter"] == (groups if sharded else 0)
    assert backward_counts["all_reduce"] == groups


MICRO_BATCHES = 4


def _accumulate_without_all_reduce_worker(rank, world_size, backend):
    """NO_SHARD at (2, 1): the all-reduce on the last micro-batch only; FSDP2's gradients, collectives and graphs."""
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    theirs, _ = build_sharded_llama(CONFIG, shard=functools.partial(torch_fully_shard, mesh=mesh))
    ours, _ = build_sharded_llama(CONFIG, shard=functools.partial(fully_shard, mesh=mesh))
    run = ours if backend is None else torch.compile(ours, backend=backend)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in (theirs, ours)]
    clear_compilation_metrics()
    counters.clear()
    for step in range(2):  # compiled, the second step reuses both graphs
        tokens = global_batch(step, world_size, 2 * MICRO_BATCHES, 8, CONFIG.vocab_size)
        local = tokens[2 * MICRO_BATCHES * rank : 2 * MICRO_BATCHES * (rank + 1)].chunk(MICRO_BATCHES)
        for index, micro_batch in enumerate(local):
            last = index == MICRO_BATCHES - 1
            collectives = []
            for model, runnable in ((theirs, theirs), (ours, run)):
                model.set_requires_all_reduce(last)
                collectives.append(counted_step(runnable, micro_batch))
            assert collectives[0] == collectives[1], collectives
            assert collectives[1][0].get("all_reduce", 0) == (CONFIG.n_layers + 1 if last else 0)
            for (name, param), other in zip(ours.named_parameters(), theirs.parameters()):
                if not last:
                    assert param.grad is None and other.grad is None, name
                    continue
                torch.testing.assert_close(param.grad.full_tensor(), other.grad.full_tensor(), rtol=0, atol=0, msg=name)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    if backend is not None:  # one graph per setting
        assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"] and recompiles() == 1


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "aot_eager"])
def test_accumulating_without_the_all_reduce_matches_torch_fsdp2(backend):
    run_gloo(_accumulate_without_all_reduce_worker, 2, backend)


def test_bucketed_hsdp_all_reduces_each_bucket_once():
    """[Note: bucketed HSDP all-reduce]: as many all-reduces as reduce-scatters once groups share buckets."""
    capture = CapturingBackend()
    torch._dynamo.reset()
    with FakeProcessGroup(8), pass_settings(bucket_cap_mb=100.0):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
        model, _ = build_sharded_llama(CONFIG, shard=functools.partial(fully_shard, mesh=mesh))
        tokens = global_batch(0, 1, 2, 8, CONFIG.vocab_size)
        lm_loss(torch.compile(model, backend=capture.backend, fullgraph=True), tokens).backward()
    torch._dynamo.reset()
    (backward,) = capture.backward_graphs
    counts = op_counts(backward.graph)
    assert counts["reduce_scatter"] == counts["all_reduce"] < CONFIG.n_layers + 1, counts
