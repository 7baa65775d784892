"""profile_ranges: each group's collectives run inside FSDP2's profiler ranges, compiled."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from compile_shard import fully_shard
from compile_shard._annotation import write_group_annotation
from compile_shard.models import Llama, LlamaConfig
from compile_shard.passes import profile_ranges, settings
from dist_utils import FakeProcessGroup, run_gloo
from graph_utils import c10d, fsdp, make_annotation, trace

profiler = torch.ops.profiler


def _gather_and_reduce(shard, grad):
    """A group's copy-in and all-gather, then a reduction of one computed gradient, flattened."""
    all_gather_input = fsdp.copy_in([shard], [8], None)
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(all_gather_input, 2, "0"))
    reduced = c10d.wait_tensor(c10d.reduce_scatter_tensor((grad * 2).reshape(-1), "avg", 2, "0"))
    return gathered, reduced


def _graph(annotate=True):
    graph = trace(_gather_and_reduce, torch.randn(2, 4), torch.randn(4, 4)).graph
    if annotate:
        for node in graph.nodes:
            if node.op == "call_function" and node.target in (
                c10d.all_gather_into_tensor.default,
                c10d.reduce_scatter_tensor.default,
            ):
                write_group_annotation(node, make_annotation("blocks.0"))
    return graph


def _summary(graph):
    """Each call's target, and for range nodes their name."""
    summary = []
    for node in graph.nodes:
        if node.target is profiler._record_function_enter_new.default:
            summary.append(f"enter {node.args[0]}")
        elif node.target is profiler._record_function_exit._RecordFunction:
            summary.append("exit")
        elif node.op == "call_function":
            summary.append(node.target._opname)
    return summary


def test_each_groups_collective_runs_from_its_copy_in_inside_fsdp2s_range():
    graph = _graph()
    assert profile_ranges(graph) == 2
    assert _summary(graph) == [
        "enter FSDP::all_gather (blocks.0)",
        "copy_in",
        "all_gather_into_tensor",
        "exit",
        "wait_tensor",
        "mul",  # the gradient's compute stays outside its reduction's range
        "enter FSDP::post_backward_reduce (blocks.0)",
        "view",
        "reduce_scatter_tensor",
        "exit",
        "wait_tensor",
    ]
    exits = graph.find_nodes(op="call_function", target=profiler._record_function_exit._RecordFunction)
    assert [exit.args[0].args[0] for exit in exits] == [
        "FSDP::all_gather (blocks.0)",
        "FSDP::post_backward_reduce (blocks.0)",
    ]


def test_collectives_without_a_group_are_left_alone():
    graph = _graph(annotate=False)
    before = _summary(graph)
    assert profile_ranges(graph) == 0
    assert _summary(graph) == before


def _profiled_compiled_step():
    """One compiled step of a two-block Llama, profiled: each FSDP range and the ops in it."""
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=37, dim=16, n_layers=2, n_heads=2, ffn_hidden=24, max_seq_len=8))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    compiled = torch.compile(model)
    tokens = torch.randint(0, 37, (2, 8))
    compiled(tokens).sum().backward()
    with torch.profiler.profile() as profile:
        compiled(tokens).sum().backward()
    torch._dynamo.reset()
    return [(e.name, [c.name for c in e.cpu_children]) for e in profile.events() if e.name.startswith("FSDP::")]


def _gloo_ranges(rank, world_size):
    """On gloo the collectives are compile_shard's in-place gloo ops; one per group (the cost model would put
    these small blocks in one bucket)."""
    settings.bucket_cap_mb = 0
    ranges = _profiled_compiled_step()
    assert [name for name, _ in ranges] == [
        *(f"FSDP::all_gather ({g})" for g in ("Llama", "layers.0", "layers.1", "layers.1")),
        "FSDP::post_backward_reduce (layers.1)",
        "FSDP::all_gather (layers.0)",
        "FSDP::post_backward_reduce (layers.0)",
        "FSDP::post_backward_reduce (Llama)",
    ]
    for name, ops in ranges:
        assert any(op.startswith("fsdp::all_") for op in ops), (name, ops)
        assert "aten::mm" not in ops, (name, ops)  # the block's compute runs outside


@pytest.mark.slow
def test_on_gloo_each_collective_runs_inside_its_groups_range():
    run_gloo(_gloo_ranges, 2)


@pytest.mark.usefixtures("per_group_collectives")
def test_a_compiled_step_runs_each_collective_inside_its_groups_range():
    with FakeProcessGroup(2):
        ranges = _profiled_compiled_step()
    gathers = ["Llama", "layers.0", "layers.1", "layers.1", "layers.0"]  # forward, then backward's recomputed
    reductions = ["layers.1", "layers.0", "Llama"]
    assert [name for name, _ in ranges if "all_gather (" in name] == [f"FSDP::all_gather ({g})" for g in gathers]
    assert [name for name, _ in ranges if "reduce (" in name] == [
        f"FSDP::post_backward_reduce ({g})" for g in reductions
    ]
    for name, ops in ranges:
        assert "aten::mm" not in ops, (name, ops)  # the block's compute runs outside
        if "all_gather" in name:
            assert ops[0] == "fsdp::copy_in" and "_c10d_functional::all_gather_into_tensor_out" in ops, name
        elif ops and ops[0] == "fsdp::reduce_scatter_input_into_":
            assert "_c10d_functional::reduce_scatter_tensor" in ops, name
        elif torch.__version__ < "2.15":
            # A reduction with no copy-in. torch 2.15's Inductor issues it before its
            # range opens ([Note: profiler ranges in compiled graphs]).
            assert ops == ["_c10d_functional::reduce_scatter_tensor"], name
