"""The cost model and the two-lane simulator on small hand-built graphs, with a round-number profile."""

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from compile_shard.passes import lower
from compile_shard.passes._graph import fake_value
from compile_shard.passes.cost_model import (
    PROFILES,
    HardwareProfile,
    collective_info,
    collective_seconds,
    compute_seconds,
    get_profile,
    is_view,
    latency_bound_bytes,
    node_flops,
)
from compile_shard.passes.simulate import simulate, simulate_step
from dist_utils import FakeProcessGroup
from graph_utils import c10d, fsdp, trace

aten = torch.ops.aten

# 1 TFLOP/s, 100 GB/s memory, 1 us per kernel, 1 GB/s links with 10 us per ring step.
PROFILE = HardwareProfile(
    name="test",
    flops_per_s={torch.float32: 1e12},
    memory_bytes_per_s=1e11,
    kernel_overhead_s=1e-6,
    link_bytes_per_s=1e9,
    link_latency_s=1e-5,
    description="round numbers for hand-checked tests",
)
# An all-gather of 1024 float32 per rank at world size 2: 8192 output bytes -> 4.096 us + 10 us.
GATHER_1K_WS2 = 0.5 * 8192 / 1e9 + 1e-5


def _node(graph_module: fx.GraphModule, target) -> fx.Node:
    (node,) = graph_module.graph.find_nodes(op="call_function", target=target)
    return node


def _append(graph_module: fx.GraphModule, target, *args) -> fx.Node:
    """A node with its fake value, inserted before the output."""
    (output,) = graph_module.graph.find_nodes(op="output")
    with graph_module.graph.inserting_before(output):
        node = graph_module.graph.call_function(target, args)
    node.meta["val"] = fake_value(target, args)
    return node


# compute ---------------------------------------------------------------------------


def test_square_matmul_is_flop_bound():
    graph_module = trace(torch.mm, torch.randn(256, 256), torch.randn(256, 256))
    mm = _node(graph_module, aten.mm.default)
    assert node_flops(mm) == 2 * 256**3
    # 33.55 us of FLOPs against 7.86 us of bytes (3 * 256 KiB).
    assert compute_seconds(mm, PROFILE) == pytest.approx(2 * 256**3 / 1e12 + 1e-6)


def test_outer_product_matmul_is_bandwidth_bound():
    graph_module = trace(torch.mm, torch.randn(4096, 1), torch.randn(1, 4096))
    mm = _node(graph_module, aten.mm.default)
    # 33.55 us of FLOPs against a 64 MiB output (671 us).
    assert compute_seconds(mm, PROFILE) == pytest.approx((2 * 4096 * 4 + 4096 * 4096 * 4) / 1e11 + 1e-6)


def test_elementwise_costs_bytes_read_and_written():
    graph_module = trace(lambda x, y: x + y, torch.randn(1024, 1024), torch.randn(1024, 1024))
    add = _node(graph_module, aten.add.Tensor)
    assert node_flops(add) == 0
    assert compute_seconds(add, PROFILE) == pytest.approx(3 * 4 * 2**20 / 1e11 + 1e-6)


def test_unknown_dtype_uses_the_slowest_listed_peak():
    profile = dataclasses.replace(PROFILE, flops_per_s={torch.bfloat16: 4e12, torch.float32: 1e12})
    assert profile.peak_flops(torch.bfloat16) == 4e12
    assert profile.peak_flops(torch.float64) == 1e12


def test_symbolic_shapes_use_their_hints_and_size_arithmetic_costs_nothing():
    def flat_matmul(a, b):
        return torch.mm(a, b).view(a.shape[0] * b.shape[1])

    symbolic = make_fx(flat_matmul, tracing_mode="symbolic")(torch.randn(256, 128), torch.randn(128, 64))
    mm = _node(symbolic, aten.mm.default)
    assert isinstance(mm.meta["val"].shape[0], torch.SymInt)
    assert node_flops(mm) == 2 * 256 * 128 * 64
    assert compute_seconds(mm, PROFILE) == pytest.approx(2 * 256 * 128 * 64 / 1e12 + 1e-6)
    sizes = [node for node in symbolic.graph.nodes if isinstance(node.meta.get("val"), torch.SymInt)]
    assert sizes and all(compute_seconds(node, PROFILE) == 0 for node in sizes)


def test_attention_flops_forward_and_backward():
    def attention_and_grads(q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return torch.autograd.grad(out.sum(), (q, k, v))

    b, h, s, d = 2, 3, 16, 8
    qkv = [torch.randn(b, h, s, d, requires_grad=True) for _ in range(3)]
    graph_module = trace(attention_and_grads, *qkv)
    forward = _node(graph_module, aten._scaled_dot_product_flash_attention_for_cpu.default)
    backward = _node(graph_module, aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    one_bmm = 2 * b * h * s * s * d  # q @ k^T, and each of the other s x s x d products
    assert node_flops(forward) == 2 * one_bmm
    assert node_flops(backward) == 5 * one_bmm


def test_view_ops_cost_nothing():
    def views(x):
        first, _ = aten.split_with_sizes.default(x, [2, 2])
        unsqueezed = aten.unsqueeze.default(x, 0)
        return (
            first,
            aten.view.default(x, [24]),
            aten._unsafe_view.default(x, [6, 4]),
            aten.t.default(x),
            aten.permute.default(x, [1, 0]),
            aten.expand.default(unsqueezed, [3, 4, 6]),
            aten.squeeze.dim(unsqueezed, 0),
            aten.slice.Tensor(x, 0, 0, 2),
            aten.detach.default(x),
            aten.alias.default(x),
            aten.as_strided.default(x, [2, 2], [1, 1]),
        )

    graph_module = trace(views, torch.randn(4, 6))
    nodes = [node for node in graph_module.graph.nodes if node.op == "call_function"]
    assert len(nodes) == 14
    assert all(compute_seconds(node, PROFILE) == 0 for node in graph_module.graph.nodes)
    assert all(is_view(node) for node in nodes)


def test_reshape_is_a_view_of_a_contiguous_input_and_a_copy_otherwise():
    graph_module = trace(lambda x: aten.t.default(x), torch.randn(4, 6))
    (x,) = graph_module.graph.find_nodes(op="placeholder")
    flat = _append(graph_module, aten.reshape.default, x, [-1])
    copied = _append(graph_module, aten.reshape.default, _node(graph_module, aten.t.default), [-1])
    assert is_view(flat) and compute_seconds(flat, PROFILE) == 0
    assert not is_view(copied)
    assert compute_seconds(copied, PROFILE) == pytest.approx(2 * 96 / 1e11 + 1e-6)


# collectives -----------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 8])
def test_ring_formula(world_size):
    def collectives(shard, full):
        gathered = c10d.all_gather_into_tensor(shard, world_size, "0")
        scattered = c10d.reduce_scatter_tensor(full, "sum", world_size, "0")
        return c10d.wait_tensor(gathered), c10d.wait_tensor(scattered)

    graph_module = trace(collectives, torch.randn(1024), torch.randn(world_size * 256))
    steps = world_size - 1
    gather_bytes, scatter_bytes = world_size * 4096, world_size * 1024
    assert collective_seconds(_node(graph_module, c10d.all_gather_into_tensor.default), PROFILE) == pytest.approx(
        steps / world_size * gather_bytes / 1e9 + steps * 1e-5
    )
    assert collective_seconds(_node(graph_module, c10d.reduce_scatter_tensor.default), PROFILE) == pytest.approx(
        steps / world_size * scatter_bytes / 1e9 + steps * 1e-5
    )


def test_ring_formula_at_world_size_2_in_numbers():
    graph_module = trace(lambda x: c10d.wait_tensor(c10d.all_gather_into_tensor(x, 2, "0")), torch.randn(1024))
    assert collective_seconds(_node(graph_module, c10d.all_gather_into_tensor.default), PROFILE) == pytest.approx(
        14.096e-6
    )


def test_all_reduce_is_two_reduce_scatters_with_the_group_size_from_its_process_group():
    with FakeProcessGroup(8):
        group_name = dist.group.WORLD.group_name
        graph_module = trace(lambda x: c10d.wait_tensor(c10d.all_reduce(x, "sum", group_name)), torch.randn(2048))
        all_reduce = _node(graph_module, c10d.all_reduce.default)
        assert collective_seconds(all_reduce, PROFILE) == pytest.approx(2 * (7 / 8 * 8192 / 1e9 + 7 * 1e-5))
    assert collective_seconds(all_reduce, PROFILE, world_size=2) == pytest.approx(2 * (0.5 * 8192 / 1e9 + 1e-5))
    with pytest.raises(ValueError, match="pass world_size"):
        collective_seconds(all_reduce, PROFILE)


def test_a_group_that_spans_nodes_is_charged_the_network_between_them():
    """h100_nvlink_ib400 on a (2, 8) HSDP mesh of 16: shard groups stay in a node, replicate groups cross nodes."""
    from torch.distributed.device_mesh import init_device_mesh

    profile = get_profile("h100_nvlink_ib400")
    with FakeProcessGroup(16):
        mesh = init_device_mesh("cpu", (2, 8), mesh_dim_names=("replicate", "shard"))
        shard_group, replicate_group = (mesh.get_group(name).group_name for name in ("shard", "replicate"))

        def collectives(full, shard):
            scattered = c10d.wait_tensor(c10d.reduce_scatter_tensor(full, "sum", 8, shard_group))
            return scattered, c10d.wait_tensor(c10d.all_reduce(shard, "avg", replicate_group))

        graph_module = trace(collectives, torch.randn(8 * 1024), torch.randn(1024))
        scatter = collective_seconds(_node(graph_module, c10d.reduce_scatter_tensor.default), profile)
        all_reduce = collective_seconds(_node(graph_module, c10d.all_reduce.default), profile)
    assert scatter == pytest.approx(7 / 8 * 8 * 4096 / 370e9 + 7 * 10e-6)  # NVLink
    assert all_reduce == pytest.approx(2 * (0.5 * 4096 / 45e9 + 20e-6))  # InfiniBand
    round_trip = HardwareProfile.from_json(json.loads(json.dumps(profile.to_json())))
    assert round_trip == profile


@pytest.mark.parametrize("world_size", [2, 8])
def test_at_the_latency_bound_size_a_collective_spends_as_long_on_transfer_as_on_latency(world_size):
    size = latency_bound_bytes(PROFILE, world_size)
    assert size == pytest.approx(world_size * 1e-5 * 1e9)
    shard_numel = int(size) // 4 // world_size
    graph_module = trace(
        lambda x: c10d.wait_tensor(c10d.all_gather_into_tensor(x, world_size, "0")), torch.randn(shard_numel)
    )
    latency = (world_size - 1) * 1e-5
    seconds = collective_seconds(_node(graph_module, c10d.all_gather_into_tensor.default), PROFILE)
    assert seconds == pytest.approx(2 * latency)


def test_the_latency_bound_size_of_a_group_across_nodes_is_the_slower_network_s():
    profile = get_profile("h100_nvlink_ib400")
    assert latency_bound_bytes(profile, 8, range(8)) == pytest.approx(8 * 10e-6 * 370e9)
    assert latency_bound_bytes(profile, 2, [0, 8]) == pytest.approx(2 * 20e-6 * 45e9)


def test_all_to_all_moves_what_a_reduce_scatter_of_the_same_input_moves():
    def exchange(x):
        return c10d.wait_tensor(c10d.all_to_all_single(x, [512] * 4, [512] * 4, "0"))

    graph_module = trace(exchange, torch.randn(2048))
    info = collective_info(_node(graph_module, c10d.all_to_all_single.default))
    assert (info.kind, info.world_size, info.bytes) == ("all_to_all", 4, 8192)
    assert collective_seconds(_node(graph_module, c10d.all_to_all_single.default), PROFILE) == pytest.approx(
        3 / 4 * 8192 / 1e9 + 3 * 1e-5
    )


def test_fsdp_ops_are_estimated_like_their_lowering():
    def fsdp_ops(shard, grad):
        return torch.ops.fsdp.all_gather_into([shard], [1024], 2, "0"), torch.ops.fsdp.reduce_scatter_grad(grad, 2, "0")

    graph_module = trace(fsdp_ops, torch.randn(32, 32), torch.randn(2048))
    assert collective_seconds(_node(graph_module, fsdp.all_gather_into.default), PROFILE) == pytest.approx(
        GATHER_1K_WS2
    )
    assert collective_seconds(_node(graph_module, fsdp.reduce_scatter_grad.default), PROFILE) == pytest.approx(
        GATHER_1K_WS2
    )
    # Synchronous: the simulator exposes all of it.
    simulation = simulate(graph_module.graph, PROFILE)
    assert simulation.exposed_communication_seconds == pytest.approx(2 * GATHER_1K_WS2)
    assert [record.waited_at for record in simulation.collectives] == ["all_gather_into", "reduce_scatter_grad"]


def test_a_bf16_all_gather_is_charged_its_bf16_bytes_before_and_after_lowering():
    """Mixed precision: the wire dtype's bytes, half of fp32's (the latency term stays)."""

    def gathers(shard):
        dtypes = (None, torch.bfloat16)
        return [torch.ops.fsdp.all_gather_into([shard], [1024], 2, "0", param_dtype=dtype) for dtype in dtypes]

    graph_module = trace(gathers, torch.randn(32, 32))
    fp32, bf16 = graph_module.graph.find_nodes(op="call_function", target=fsdp.all_gather_into.default)
    latency = 1e-5
    assert collective_info(bf16).bytes * 2 == collective_info(fp32).bytes == 2 * 1024 * 4
    assert collective_seconds(bf16, PROFILE) - latency == pytest.approx((GATHER_1K_WS2 - latency) / 2)
    lower(graph_module.graph)
    lowered = graph_module.graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default)
    assert sorted(collective_info(node).bytes for node in lowered) == [4096, 8192]


def test_collective_seconds_rejects_other_nodes():
    graph_module = trace(lambda x: x + 1, torch.randn(4))
    with pytest.raises(ValueError, match="not a collective"):
        collective_seconds(_node(graph_module, aten.add.Tensor), PROFILE)


# simulate ---------------------------------------------------------------------------

MM_256 = 2 * 256**3 / 1e12 + 1e-6  # 34.55 us, longer than GATHER_1K_WS2


def _gather(x):
    return c10d.all_gather_into_tensor(x, 2, "0")


def test_a_collective_waited_right_away_is_fully_exposed():
    def exposed(x, w):
        gathered = c10d.wait_tensor(_gather(x))
        return torch.mm(w, w), gathered

    simulation = simulate(trace(exposed, torch.randn(1024), torch.randn(256, 256)).graph, PROFILE)
    (record,) = simulation.collectives
    assert (record.start, record.end) == (0, pytest.approx(GATHER_1K_WS2))
    assert record.exposed_seconds == pytest.approx(GATHER_1K_WS2)
    assert record.issued_after is None and record.waited_at == "wait_tensor"
    assert record.overlapped_compute == []
    assert simulation.compute_seconds == pytest.approx(MM_256)
    assert simulation.step_seconds == pytest.approx(MM_256 + GATHER_1K_WS2)


def test_a_collective_issued_before_long_enough_compute_is_hidden():
    def hidden(x, w):
        gathered = _gather(x)
        return torch.mm(w, w), c10d.wait_tensor(gathered)

    simulation = simulate(trace(hidden, torch.randn(1024), torch.randn(256, 256)).graph, PROFILE)
    (record,) = simulation.collectives
    assert record.exposed_seconds == 0 and simulation.exposed_communication_seconds == 0
    assert record.overlapped_compute == ["mm"]
    assert simulation.step_seconds == pytest.approx(MM_256)
    assert simulation.communication_seconds == pytest.approx(GATHER_1K_WS2)
    lanes = {(interval.node, interval.lane) for interval in simulation.intervals}
    assert lanes == {("all_gather_into_tensor", "communication"), ("mm", "compute")}


def test_nothing_overlaps_on_a_profile_whose_communication_needs_the_compute_cores():
    def hidden(x, w):
        gathered = _gather(x)
        return torch.mm(w, w), c10d.wait_tensor(gathered)

    busy_cores = dataclasses.replace(PROFILE, overlaps_communication=False)
    simulation = simulate(trace(hidden, torch.randn(1024), torch.randn(256, 256)).graph, busy_cores)
    (record,) = simulation.collectives
    assert record.exposed_seconds == pytest.approx(GATHER_1K_WS2)
    assert simulation.step_seconds == pytest.approx(MM_256 + GATHER_1K_WS2)
    assert not get_profile("cpu_gloo").overlaps_communication and get_profile("h100_ib400").overlaps_communication


def test_the_communication_lane_is_fifo():
    def back_to_back(x, y, z):
        first, second = _gather(x), _gather(y)
        z = z.relu()  # 1.08 us of compute
        return c10d.wait_tensor(first), c10d.wait_tensor(second), z

    simulation = simulate(trace(back_to_back, *(torch.randn(1024) for _ in range(3))).graph, PROFILE)
    first, second = simulation.collectives
    relu = 2 * 4096 / 1e11 + 1e-6
    assert second.start == pytest.approx(first.end) and second.end == pytest.approx(2 * GATHER_1K_WS2)
    assert first.exposed_seconds == pytest.approx(GATHER_1K_WS2 - relu)
    assert second.exposed_seconds == pytest.approx(GATHER_1K_WS2)
    assert simulation.step_seconds == pytest.approx(2 * GATHER_1K_WS2)


def test_peak_memory_by_hand():
    def fn(x):  # x: 4096 B, live throughout
        y = x * 2  # +4096 -> 8192
        gathered = _gather(y)  # +8192 at issue -> 16384; y stays alive until the wait
        z = x + 1  # +4096 -> 20480, the peak
        w = c10d.wait_tensor(gathered)  # y freed -> 16384
        return w.view(2, -1).sum() + z.sum()  # the scalars: 4 B each

    simulation = simulate(trace(fn, torch.randn(1024)).graph, PROFILE)
    assert simulation.peak_memory_bytes == 20480
    # x, y, gathered, z, y freed at the wait; sum(w) frees w; sum(z) frees z; the add frees both sums.
    expected = [4096, 8192, 16384, 20480, 16384, 16388, 8196, 8200, 4104, 4108, 4100]
    assert [live for _, live in simulation.memory_timeline] == expected


def test_exposed_beyond_first_and_last():
    def step(a, b, c, g):
        first = c10d.wait_tensor(_gather(a))  # exposed, unavoidable
        second = _gather(b)
        c = c.relu()  # hides 1.08 us of the second gather
        second = c10d.wait_tensor(second)
        last = c10d.wait_tensor(c10d.reduce_scatter_tensor(g, "sum", 2, "0"))  # exposed, unavoidable
        return first, second, c, last

    simulation = simulate(trace(step, *(torch.randn(1024) for _ in range(3)), torch.randn(2048)).graph, PROFILE)
    relu = 2 * 4096 / 1e11 + 1e-6
    assert [record.kind for record in simulation.collectives] == ["all_gather", "all_gather", "reduce_scatter"]
    assert simulation.exposed_communication_seconds == pytest.approx(3 * GATHER_1K_WS2 - relu)
    assert simulation.exposed_beyond_first_and_last() == pytest.approx(GATHER_1K_WS2 - relu)
    assert simulation.collectives[1].issued_after is None and simulation.collectives[2].issued_after == "relu"


def test_simulate_step_runs_graphs_back_to_back():
    def forward(x, w):
        gathered = c10d.wait_tensor(_gather(x))
        return torch.mm(w, w), gathered

    def backward(g):
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(g.relu(), "sum", 2, "0"))

    graphs = [
        trace(forward, torch.randn(1024), torch.randn(256, 256)).graph,
        trace(backward, torch.randn(1 << 16)).graph,
    ]
    parts = [simulate(graph, PROFILE) for graph in graphs]
    step = simulate_step(graphs, PROFILE)
    assert step.step_seconds == pytest.approx(parts[0].step_seconds + parts[1].step_seconds)
    assert step.exposed_communication_seconds == pytest.approx(sum(p.exposed_communication_seconds for p in parts))
    assert step.peak_memory_bytes == max(p.peak_memory_bytes for p in parts) == parts[1].peak_memory_bytes
    backward_gather = step.collectives[1]
    assert backward_gather.graph == 1 and backward_gather.issued_after == "relu"
    assert backward_gather.start == pytest.approx(parts[0].step_seconds + parts[1].collectives[0].start)
    assert step.exposed_beyond_first_and_last() == 0


# profiles ----------------------------------------------------------------------------


def test_profiles():
    assert get_profile("h100_nvlink").peak_flops(torch.bfloat16) == 989e12
    assert get_profile("h100_ib400").link_bytes_per_s < get_profile("h100_nvlink").link_bytes_per_s
    cpu = get_profile("cpu_gloo")
    assert cpu.flops_per_s[torch.float32] > 0 and "calibrate_cpu.py" in cpu.description
    assert all(HardwareProfile.from_json(p.to_json()) == p for p in PROFILES.values())


def test_unknown_profile_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown hardware profile 'a100'.*cpu_gloo, h100_ib400, h100_nvlink"):
        get_profile("a100")
