"""The suite installs itself, chains with passes a user set before, and each pass can be switched off."""

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
    # reorder (the default) prefetches it: issued before the first layer computes.
    gathers, first_compute = _first_gather_position(_compile_mlp().forward_graphs[0].graph)
    assert gathers[1] < first_compute
