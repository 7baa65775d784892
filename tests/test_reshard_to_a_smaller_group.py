"""FSDP2's ``reshard_after_forward=<int>``: after forward the parameters stay sharded over a smaller group.

[Note: resharding to a smaller group] in compile_shard._group: each rank keeps a chunk
of the all-gather output and backward all-gathers the chunks over ``reshard_after_forward``
ranks, eagerly and in the compiled backward graph.
"""

import functools

import pytest
import torch
from torch._dynamo.utils import clear_compilation_metrics, counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from compile_shard import fully_shard
from compile_shard.debug import recompiles
from compile_shard.models import LlamaConfig
from dist_utils import FakeProcessGroup, build_sharded_llama, counted_step, global_batch, lm_loss, run_gloo
from graph_utils import CapturingBackend, c10d

CONFIG = LlamaConfig()
STEPS = 3


def _worker(rank, world_size):
    """Blocks resharded to groups of 2 of 4 ranks: torch FSDP2's collectives, the whole-group run's gradients."""
    mesh = init_device_mesh("cpu", (world_size,))

    def build(shard, block_reshard):
        return build_sharded_llama(CONFIG, block_reshard=block_reshard, shard=functools.partial(shard, mesh=mesh))[0]

    theirs, ours, whole_group, compiled = (
        build(torch_fully_shard, 2),
        build(fully_shard, 2),
        build(fully_shard, True),
        build(fully_shard, 2),
    )
    models = (theirs, ours, whole_group, compiled)
    runs = (theirs, ours, whole_group, torch.compile(compiled, backend="aot_eager"))
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in models]
    clear_compilation_metrics()
    counters.clear()
    for step in range(STEPS):
        tokens = global_batch(step, world_size, 2, 8, CONFIG.vocab_size)[2 * rank : 2 * rank + 2]
        collectives = [counted_step(run, tokens) for run in runs]
        assert collectives[0] == collectives[1], collectives  # counts and bytes: backward gathers 2 ranks' chunks
        for name, param in ours.named_parameters():
            same = [model.get_parameter(name).grad.to_local() for model in (whole_group, compiled)]
            for other in same:
                torch.testing.assert_close(param.grad.to_local(), other, rtol=0, atol=0, msg=name)
            # gloo's ring all-reduce under torch FSDP2's reduce-scatter adds 4 ranks in
            # another order ([Note: gloo reduce-scatter] in compile_shard.ops.backend)
            torch.testing.assert_close(
                param.grad.to_local(), theirs.get_parameter(name).grad.to_local(), rtol=0, atol=1e-6, msg=name
            )
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"] and recompiles() == 0


def test_reshard_to_a_smaller_group_matches_torch_fsdp2():
    run_gloo(_worker, 4)


@pytest.mark.parametrize("shape, size", [((8,), 4), ((2, 4), 2)], ids=["fsdp_8_to_4", "hsdp_2x4_to_2"])
def test_compiled_backward_gathers_over_the_smaller_group(shape, size):
    """The forward gathers over the shard group; the backward over groups of ``size``, from chunks the forward saved."""
    capture = CapturingBackend()
    torch._dynamo.reset()
    with FakeProcessGroup(shape[0] * shape[-1]):
        names = ("replicate", "shard") if len(shape) == 2 else None
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        model, _ = build_sharded_llama(CONFIG, block_reshard=size, shard=functools.partial(fully_shard, mesh=mesh))
        tokens = global_batch(0, 1, 2, 8, CONFIG.vocab_size)
        lm_loss(torch.compile(model, backend=capture.backend, fullgraph=True), tokens).backward()
    torch._dynamo.reset()
    (forward,), (backward,) = capture.forward_graphs, capture.backward_graphs

    def gathered_over(graph):
        gathers = graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default)
        return sorted(node.args[1] for node in gathers)

    assert gathered_over(forward.graph) == [shape[-1]] * (CONFIG.n_layers + 1)
    assert gathered_over(backward.graph) == [size] * CONFIG.n_layers
