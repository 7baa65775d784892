"""Graph dumps, the graph printer users read them with, and the collective counter."""

import pytest
import torch
import torch._dynamo
import torch.nn as nn

from torch._dynamo.utils import counters

from compile_shard import fully_shard
from compile_shard.debug import CollectiveCounter, dump_graphs, format_graph, recompiles
from compile_shard.models import LlamaConfig
from dist_utils import FakeProcessGroup, build_sharded_llama, lm_loss
from graph_utils import CapturingBackend, pass_settings, trace


def _compile_small_model(backend="aot_eager"):
    torch._dynamo.reset()
    with FakeProcessGroup(2):
        model = nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 2))
        fully_shard(model[0])
        fully_shard(model)
        torch.compile(model, backend=backend, fullgraph=True)(torch.randn(4, 5)).sum().backward()
    torch._dynamo.reset()


def test_dump_graphs_writes_each_stage_and_the_schedule(tmp_path):
    with dump_graphs(tmp_path):
        # A backend with the post-partition hook, as Inductor has: the schedule is dumped too.
        _compile_small_model(CapturingBackend().backend)
    folder = tmp_path / "rank0" / "graph_000"
    assert sorted(path.name for path in folder.iterdir()) == [
        "00_joint.txt",
        "01_refunctionalize.txt",
        "02_unused_params.txt",
        "03_compile_regions.txt",
        "04_bucket.txt",
        "05_reshard.txt",
        "06_save_attention.txt",
        "07_lower.txt",
        "08_copy_out.txt",
        "09_place.txt",
        "10_forward.txt",
        "11_backward.txt",
        "index.html",
        "schedule.txt",
        "timeline.svg",
    ]
    assert "fsdp.all_gather_into.default" in (folder / "00_joint.txt").read_text()
    lowered = (folder / "07_lower.txt").read_text()
    assert "_c10d_functional.all_gather_into_tensor.default" in lowered
    # What stays in the fsdp namespace after lowering are the copies: the copy-in and the reduction input.
    assert {line.split(" = ")[1].split("(")[0] for line in lowered.splitlines() if " = fsdp." in line} == {
        "fsdp.copy_in.default",
        "fsdp.reduce_scatter_input.default",
    }
    assert "MUST_RECOMPUTE" in (folder / "05_reshard.txt").read_text()
    schedule = (folder / "schedule.txt").read_text().splitlines()
    rows = [line.split() for line in schedule if line.startswith(("forward ", "backward "))]
    # Forward: group 0 (the first Linear) first, then the root's prefetch. Backward needs no
    # re-gather (the first layer's input needs no gradient) and reduces in reverse order.
    assert [(row[0], row[2], row[3]) for row in rows] == [
        ("forward", "all_gather", "0"),
        ("forward", "all_gather", "Sequential"),
        ("backward", "reduce_scatter", "Sequential"),
        ("backward", "reduce_scatter", "0"),
    ]
    # Then each forward all-gather's bucket and the cap that chose it: the root keeps its
    # parameters after forward, so no block may share its all-gather.
    buckets = schedule[schedule.index("buckets (each forward all-gather):") + 1 :]
    assert [line.split(",")[0] for line in buckets] == ["0: alone", "Sequential: alone"]
    assert all(line.endswith("costs more latency than transfer on cpu_gloo)") for line in buckets), buckets
    svg = (folder / "timeline.svg").read_text()
    assert svg.count("<rect") > 10 and ">Sequential</text>" in svg and ">0</text>" in svg
    page = (folder / "index.html").read_text()
    assert "<svg" in page and 'href="10_forward.txt"' in page and "cpu_gloo" in page


def test_dump_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPILE_SHARD_DUMP_DIR", str(tmp_path))
    _compile_small_model()
    _compile_small_model()
    assert sorted(p.name for p in (tmp_path / "rank0").iterdir()) == ["graph_000", "graph_001"]


def test_a_warm_cache_does_not_skip_the_dump(tmp_path):
    """Inductor twice on the same model: the second compile would hit the caches, skipping the passes."""
    for _ in range(2):
        with dump_graphs(tmp_path):
            _compile_small_model("inductor")
    for folder in ("graph_000", "graph_001"):
        forward = (tmp_path / "rank0" / folder / "10_forward.txt").read_text()
        assert "all_gather_into_tensor_out.default" in forward  # gather_buffers ran: Inductor's post-grad hook


def test_no_dump_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv("COMPILE_SHARD_DUMP_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    _compile_small_model()
    assert not list(tmp_path.iterdir())


def test_format_graph_is_stable_and_readable():
    graph = trace(lambda x, y: (x @ y).relu(), torch.randn(2, 3), torch.randn(3, 4)).graph
    assert format_graph(graph) == (
        "x_1: float32[2, 3]\n"
        "y_1: float32[3, 4]\n"
        "mm: float32[2, 4] = aten.mm.default(x_1, y_1)\n"
        "relu: float32[2, 4] = aten.relu.default(mm)\n"
        "return relu\n"
    )


def test_recompiles_counts_dynamo_recompilations():
    torch._dynamo.reset()
    torch._dynamo.utils.clear_compilation_metrics()
    double = torch.compile(lambda x: x * 2, backend="eager")
    double(torch.randn(2))
    assert recompiles() == 0
    double(torch.randn(2, 2))  # another rank: a guard fails, Dynamo compiles again
    assert recompiles() == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("compile_regions", [False, True], ids=["inlined", "regions"])
def test_collective_counter_around_a_compiled_model_counts_without_changing_what_is_compiled(
    fresh_dynamo, per_group_collectives, compile_regions
):
    """The counter sees the compiled graphs' collectives; compiling inside it or after it is the same.

    With regions, ``aot_eager`` runs each block's region as a higher-order op, which
    reaches the counter too.
    """
    with FakeProcessGroup(2), pass_settings(compile_regions=compile_regions):
        model, _ = build_sharded_llama(LlamaConfig())
        tokens = torch.randint(0, 1001, (1, 9))
        with CollectiveCounter() as eager:
            lm_loss(model, tokens).backward()
        compiled = torch.compile(model, backend="aot_eager")
        for _ in range(2):  # the first call compiles inside the counter
            with CollectiveCounter() as counter:
                lm_loss(compiled, tokens).backward()
            assert counter.counts == eager.counts
        lm_loss(compiled, tokens).backward()
    assert recompiles() == 0 and not counters["graph_break"]
