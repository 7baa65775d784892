"""Graph dumps and the graph printer users read them with."""

import torch
import torch._dynamo
import torch.nn as nn

from compile_shard import fully_shard
from compile_shard.debug import dump_graphs, format_graph
from dist_utils import FakeProcessGroup
from graph_utils import trace


def _compile_small_model():
    torch._dynamo.reset()
    with FakeProcessGroup(2):
        model = nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 2))
        fully_shard(model[0])
        fully_shard(model)
        torch.compile(model, backend="aot_eager", fullgraph=True)(torch.randn(4, 5)).sum().backward()
    torch._dynamo.reset()


def test_dump_graphs_writes_each_stage(tmp_path):
    with dump_graphs(tmp_path):
        _compile_small_model()
    stages = sorted(path.name for path in (tmp_path / "rank0" / "graph_000").iterdir())
    assert stages == [
        "00_joint.txt",
        "01_refunctionalize.txt",
        "02_bucket.txt",
        "03_reshard.txt",
        "04_save_attention.txt",
        "05_lower.txt",
        "06_place.txt",
    ]
    folder = tmp_path / "rank0" / "graph_000"
    assert "fsdp.all_gather_into.default" in (folder / "00_joint.txt").read_text()
    lowered = (folder / "05_lower.txt").read_text()
    assert "_c10d_functional.all_gather_into_tensor.default" in lowered and "fsdp." not in lowered
    assert "MUST_RECOMPUTE" in (folder / "03_reshard.txt").read_text()


def test_dump_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPILE_SHARD_DUMP_DIR", str(tmp_path))
    _compile_small_model()
    _compile_small_model()
    assert sorted(p.name for p in (tmp_path / "rank0").iterdir()) == ["graph_000", "graph_001"]


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
