"""The suite installs itself, chains with passes a user set before, and each pass can be switched off."""

import hashlib

import pytest

import torch
import torch._dynamo
import torch.fx as fx
import torch.nn as nn
from torch._inductor.custom_graph_pass import CustomGraphPass

import compile_shard.passes as passes
from compile_shard import fully_shard
from dist_utils import FakeProcessGroup
from graph_utils import CapturingBackend, op_counts, pass_settings


def _compile_mlp():
    torch._dynamo.reset()
    capture = CapturingBackend()
    with FakeProcessGroup(2):
        model = nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 2))
        fully_shard(model[0])
        fully_shard(model)
        torch.compile(model, backend=capture.backend, fullgraph=True)(torch.randn(4, 5)).sum().backward()
    torch._dynamo.reset()
    return capture


class _UserInductorPass(CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph: fx.Graph) -> None:
        self.calls += 1

    def uuid(self):
        return "user-pass"


def test_install_chains_with_passes_set_before():
    seen = []

    def user_joint_pass(graph_module, joint_inputs):
        seen.append(op_counts(graph_module.graph))
        return graph_module

    user_inductor_pass = _UserInductorPass()
    with torch._functorch.config.patch(joint_custom_pass=user_joint_pass), torch._inductor.config.patch(
        joint_custom_pre_pass=user_inductor_pass
    ):
        passes.install()
        passes.install()  # idempotent: wraps once
        _compile_mlp()
        inductor_hook = torch._inductor.config.joint_custom_pre_pass
        inductor_hook(fx.Graph())
        assert inductor_hook.previous is user_inductor_pass and user_inductor_pass.calls == 1
        assert user_inductor_pass.uuid() in inductor_hook.uuid()
    # The user's pass ran once, after the suite: it saw the lowered collectives.
    assert len(seen) == 1 and seen[0]["all_gather"] == 2 and "fsdp.all_gather_into" not in seen[0]


def test_settings_change_the_inductor_cache_key():
    passes.install()
    hook = torch._inductor.config.joint_custom_pre_pass
    before = hook.uuid()
    with pass_settings(place=False):
        assert hook.uuid() != before
    assert hook.uuid() == before


def test_switching_off_lower_keeps_fsdp_ops():
    with pass_settings(lower=False):
        capture = _compile_mlp()
    assert op_counts(capture.forward_graphs[0].graph) == {"fsdp.all_gather_into": 2}
    assert op_counts(capture.backward_graphs[0].graph)["fsdp.reduce_scatter_grad"] == 2


def _first_gather_position(graph):
    nodes = list(graph.nodes)
    first_compute = min(i for i, n in enumerate(nodes) if n.target is torch.ops.aten.addmm.default)
    gathers = [i for i, n in enumerate(nodes) if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default]
    return gathers, first_compute


def test_switching_off_place_and_reorder_keeps_every_gather_at_the_start():
    with pass_settings(place=False, reorder=False):
        gathers, first_compute = _first_gather_position(_compile_mlp().forward_graphs[0].graph)
    assert all(g < first_compute for g in gathers)
    # place alone: the second layer's gather waits for the first layer's compute.
    with pass_settings(reorder=False):
        gathers, first_compute = _first_gather_position(_compile_mlp().forward_graphs[0].graph)
    assert gathers[0] < first_compute < gathers[1]
    # reorder (the default) prefetches it on a machine that overlaps: issued before the first layer computes.
    with pass_settings(cost_profile="h100_nvlink"):
        gathers, first_compute = _first_gather_position(_compile_mlp().forward_graphs[0].graph)
    assert gathers[1] < first_compute


def test_schedule_depths_default_to_what_the_cost_profile_can_overlap():
    from compile_shard.passes.cost_model import get_profile
    from compile_shard.passes.install import scheduled_depths

    assert scheduled_depths(get_profile("cpu_gloo")) == (0, 0)  # gloo shares the compute cores
    assert scheduled_depths(get_profile("h100_nvlink")) == (1, 1)
    with pass_settings(prefetch_depth=2):
        assert scheduled_depths(get_profile("cpu_gloo")) == (2, 0)
    with pass_settings(reduce_scatter_depth=3):
        assert scheduled_depths(get_profile("h100_nvlink")) == (1, 3)


def _cache_keys_differ_between_ranks(rank, world_size):
    import torch.distributed as dist

    passes.install()
    # A digest of each rank's key, gathered as a tensor (gathering Python objects needs numpy).
    digest = hashlib.sha256(repr(torch._inductor.config.joint_custom_pre_pass.uuid()).encode()).digest()
    key = torch.tensor(int.from_bytes(digest[:8], "little", signed=True))
    keys = [torch.zeros((), dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(keys, key)
    # gloo lowers reductions rank-specifically ([Note: rank-specific graphs and the caches]).
    assert len({k.item() for k in keys}) == world_size


def test_cache_key_holds_the_rank_on_gloo_only():
    from dist_utils import run_gloo

    run_gloo(_cache_keys_differ_between_ranks, 2)
    from compile_shard.passes.install import rank_cache_key

    with FakeProcessGroup(2):
        assert rank_cache_key() is None  # rank-agnostic graphs: every rank shares one cache entry


def _train_from_the_cache_directory(rank, world_size, folder, phase):
    """Two compiled steps of a 2-layer Llama under Inductor, with the caches in ``folder``; its losses saved there."""
    import os

    from torch._dynamo.utils import counters

    from compile_shard.models import LlamaConfig
    from dist_utils import build_sharded_llama, global_batch, lm_loss

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, "inductor")
    config = LlamaConfig(n_layers=2)
    model, _ = build_sharded_llama(config)
    compiled = torch.compile(model, fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(2):
        loss = lm_loss(compiled, global_batch(step, world_size, 2, 16, config.vocab_size)[2 * rank : 2 * rank + 2])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    path = os.path.join(folder, f"losses_rank{rank}.pt")
    if phase == "cold":
        assert counters["aot_autograd"]["autograd_cache_miss"] == 1
        torch.save(losses, path)
    else:  # the whole step from the caches: no joint trace, partition, pass suite or Inductor compile
        aot_cache = counters["aot_autograd"]
        assert aot_cache["autograd_cache_hit"] == 1 and not aot_cache["autograd_cache_miss"]
        torch.testing.assert_close(torch.stack(losses), torch.stack(torch.load(path)), rtol=0, atol=0)


@pytest.mark.slow
def test_a_restarted_job_loads_its_compiled_step_from_the_caches():
    """A second launch with the same cache directory hits AOTAutograd's cache and computes the same losses.

    Guards a restart's first step (docs/benchmarks.md, "A restarted job's first step"):
    a pass that made the graphs uncacheable would compile everything again.
    """
    from dist_utils import run_gloo, tmp_path_for_workers

    folder = tmp_path_for_workers()
    for phase in ("cold", "warm"):
        run_gloo(_train_from_the_cache_directory, 2, folder, phase)
