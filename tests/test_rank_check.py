"""Ranks that would run different collectives raise ``RankMismatchError`` in seconds instead of hanging.

Each case runs gloo ranks whose compiled graphs differ in one way a real job's can:
pass settings, a rank-dependent branch, a graph break, a recompile on one rank. Every
rank writes what it raised, and when, to a file, and leaves the process as a failed
job's rank does (a rank blocked in a collective fails as its peer's process ends).
The process groups time out after 60 s: a check that missed the mismatch makes the
case fail there, with gloo's timeout instead of the expected error.

Most cases compile with an AOT backend that runs the suite's partitioned passes and
runs the graphs eagerly (``CapturingBackend``, the path of a custom backend); one runs
Inductor, whose compiled code carries the check.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from compile_shard import fully_shard
from compile_shard._annotation import GroupAnnotation, write_group_annotation
from compile_shard.debug import recompiles
from compile_shard.ops.rank_check import _digest, _state, mismatch_message
from compile_shard.passes import ShardedGraphBreakWarning, overridden, rank_check, settings, warn_if_partial
from compile_shard.passes.dump import GraphDump
from compile_shard.passes.rank_check import collective_record
from dist_utils import FakeProcessGroup, run_gloo, tmp_path_for_workers
from graph_utils import CapturingBackend, trace

_DIM = 15  # odd: the ranks hold uneven shards
_HANG = datetime.timedelta(seconds=60)
# How long a rank that recompiled waits for its peer's check in these tests.
_TIMEOUT_S = 3.0


class Block(nn.Module):
    """A linear block; ``break_here``: a graph break inside it; ``calls``: sharded modules it also calls."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(_DIM, _DIM)
        self.break_here = False
        self.calls: list[nn.Module] = []  # a list: not submodules, sharded on their own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.linear(x))
        if self.break_here:
            torch._dynamo.graph_break()
        for module in self.calls:
            x = module(x)
        return x


class Blocks(nn.Module):
    """Sharded blocks and one more sharded ``extra`` block, which runs only where the model's code says so.

    ``extra_call_above``: the root calls ``extra`` for batches with more rows (a
    recompile that changes the collectives on a rank whose batch grew).
    """

    def __init__(self, n_blocks: int = 3, *, extra_call_above: int | None = None):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.extra = Block()
        self.extra_call_above = extra_call_above

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        if self.extra_call_above is not None and x.size(0) > self.extra_call_above:
            x = self.extra(x)
        return x


# The pass and the message, on small hand-built graphs ---------------------------------

c10d = torch.ops._c10d_functional


def _graph(reduce_group: str = "1", gather_group: str = "0"):
    """A forward-like graph: an all-gather over ``gather_group``, then a reduce-scatter over ``reduce_group``."""

    def gather_then_reduce(shard, grad):
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(shard, 2, gather_group))
        reduced = c10d.wait_tensor(c10d.reduce_scatter_tensor(grad, "sum", 2, reduce_group))
        return gathered, reduced

    graph = trace(gather_then_reduce, torch.randn(3, 4), torch.randn(8, dtype=torch.bfloat16)).graph
    (gather,) = graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default)
    write_group_annotation(gather, GroupAnnotation("blocks.0", True, members=("blocks.0",), model_groups=("blocks.0",)))
    return graph


_PAIRS = {"0": (0, 1), "1": (0, 2)}
# The module (``compile_shard.passes.rank_check`` the attribute is the pass function).
rank_check_pass = importlib.import_module("compile_shard.passes.rank_check")


def test_the_record_lists_each_groups_collectives_in_issue_order():
    record = collective_record(_graph(), _PAIRS.get)
    assert record["groups"] == {
        "0,1": ["all_gather_into_tensor float32[12] of blocks.0"],
        "0,2": ["reduce_scatter_tensor bfloat16[8]"],
    }
    assert record["graph"] == "forward" and record["partial"] is False
    assert record["settings"]["bucket_cap_mb"] is None


def test_the_record_leaves_out_groups_without_peers():
    assert collective_record(_graph(), {"0": (0, 1)}.get)["groups"] == {
        "0,1": ["all_gather_into_tensor float32[12] of blocks.0"]
    }
    assert collective_record(_graph(), lambda name: None) is None


def test_a_collective_of_uneven_shards_reads_the_same_on_every_rank():
    """Of 3 rows over 2 ranks, rank 0 holds 2 and rank 1 one; both send 2 rows, padded."""

    def gather(weight_shard):
        return torch.ops.fsdp.all_gather_into([weight_shard], [8], 2, "0")

    records = [collective_record(trace(gather, torch.randn(rows, 4)).graph, _PAIRS.get) for rows in (2, 1)]
    assert records[0]["groups"] == records[1]["groups"] == {"0,1": ["all_gather_into float32[8]"]}


def test_rank_check_puts_the_record_first_once(monkeypatch):
    graph = _graph()
    monkeypatch.setattr(rank_check_pass, "group_ranks", _PAIRS.get)
    assert rank_check(graph) == 1
    first = next(node for node in graph.nodes if node.op != "placeholder")
    assert first.target is torch.ops.fsdp.rank_check.default
    assert json.loads(first.args[0]) == collective_record(graph, _PAIRS.get)
    assert rank_check(graph) == 0  # one check per graph
    assert len(graph.find_nodes(op="call_function", target=torch.ops.fsdp.rank_check.default)) == 1


def test_while_dumping_the_record_names_the_graphs_dump_folder(monkeypatch, tmp_path):
    monkeypatch.setattr(rank_check_pass, "group_ranks", _PAIRS.get)
    monkeypatch.setattr(GraphDump, "latest", None)
    graph = _graph()
    rank_check(graph)
    assert "dump" not in json.loads(_check_node(graph).args[0])
    monkeypatch.setattr(GraphDump, "latest", GraphDump(tmp_path / "rank0" / "graph_003"))
    graph = _graph()
    rank_check(graph)
    assert json.loads(_check_node(graph).args[0])["dump"] == str(tmp_path / "rank0" / "graph_003")


def _check_node(graph):
    (check,) = graph.find_nodes(op="call_function", target=torch.ops.fsdp.rank_check.default)
    return check


def test_rank_check_leaves_graphs_of_the_fake_group_and_without_collectives_alone():
    with FakeProcessGroup(2):
        name = dist.distributed_c10d._get_default_group().group_name
        graph = _graph(reduce_group=name, gather_group=name)
        before = [node.target for node in graph.nodes]
        assert rank_check(graph) == 0
        assert [node.target for node in graph.nodes] == before
    plain = trace(lambda x: x + 1, torch.randn(2)).graph
    assert rank_check(plain) == 0


def test_a_split_graph_is_recorded_as_partial():
    def fn(shard):
        gathered = torch.ops.fsdp.all_gather_into([shard], [8], 2, "0")
        return gathered.view(2, -1)[:, :8].reshape(-1)  # the gathered parameter leaves the graph

    graph = trace(fn, torch.randn(8)).graph
    annotation = GroupAnnotation("blocks.0", True, members=("blocks.0",), model_groups=("blocks.0",))
    for node in graph.find_nodes(op="call_function", target=torch.ops.fsdp.all_gather_into.default):
        write_group_annotation(node, annotation)
    with pytest.warns(ShardedGraphBreakWarning):
        warn_if_partial(graph)
    assert collective_record(graph, lambda name: (0, 1))["partial"] is True


def _record(collectives, partial=False, **settings_changes):
    record = collective_record(_graph(), _PAIRS.get)
    record["groups"]["0,1"] = collectives
    record["partial"] = partial
    record["settings"].update(settings_changes)
    return record


def test_the_message_names_the_first_difference_and_the_setting():
    ours = _record(["all_gather_into_tensor float32[12] of a", "all_gather_into_tensor float32[12] of b"])
    theirs = _record(["all_gather_into_tensor float32[24] of a+b"], bucket_cap_mb=25.0)
    message = mismatch_message("0,1", 0, ours, {1: theirs}, [], 60.0)
    assert "First differing collective on this group: #0 of the forward graph." in message
    assert "rank 0: all_gather_into_tensor float32[12] of a\n  rank 1: all_gather_into_tensor float32[24] of a+b" in message
    assert "bucket_cap_mb: rank 0 None, rank 1 25.0" in message
    assert "rank-dependent branch" not in message


def test_the_message_tells_a_split_graph_and_a_late_peer():
    same = ["all_gather_into_tensor float32[12] of a"]
    split = mismatch_message("0,1", 0, _record(same), {1: _record(same, partial=True)}, [], 60.0)
    assert "Both forward graphs issue the same 1 collectives" in split
    assert "a graph break on rank 1" in split
    late = mismatch_message("0,1", 1, _record(same + same), {0: _record(same)}, [0], 5.0)
    assert "Rank 0 checked no new forward graph within 5 s" in late
    assert "a recompile or a graph break on rank 1 only" in late
    assert "#1 of the forward graph.\n  rank 1: all_gather_into_tensor float32[12] of a\n  rank 0: none" in late
    assert "rank-dependent branch" not in late


def test_the_message_names_each_ranks_dump_folder_or_how_to_dump():
    ours, theirs = _record(["all_gather_into_tensor float32[12] of a"]), _record([])
    assert "dump them: compile_shard.debug.dump_graphs(path)" in mismatch_message("0,1", 0, ours, {1: theirs}, [], 60.0)
    ours["dump"], theirs["dump"] = "dumps/rank0/graph_001", "dumps/rank1/graph_002"
    message = mismatch_message("0,1", 0, ours, {1: theirs}, [], 60.0)
    assert "Rank 0's graph and its passes are dumped in dumps/rank0/graph_001." in message
    assert "Rank 1's graph and its passes are dumped in dumps/rank1/graph_002." in message
    assert "dump_graphs(path)" not in message


def test_the_digest_covers_the_kind_the_split_and_the_collectives_not_the_settings():
    base = _record(["x"])
    assert _digest(base, "0,1") == _digest(_record(["x"], bucket_cap_mb=3.0), "0,1")
    assert _digest(base, "0,1") != _digest(_record(["x"], partial=True), "0,1")
    assert _digest(base, "0,1") != _digest(_record(["y"]), "0,1")
    assert _digest(base, "0,1") != _digest({**base, "graph": "backward"}, "0,1")


# Gloo ranks that differ ---------------------------------------------------------------


def _sharded(model: nn.Module, mesh=None) -> nn.Module:
    torch.manual_seed(0)
    for block in [*model.blocks, model.extra]:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train(model: nn.Module, batches, backend) -> None:
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, rows in enumerate(batches):
        _outcome["step"] = step
        _outcome["step_started"] = time.monotonic()
        compiled(torch.randn(rows, _DIM)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    _outcome["recompiles"] = recompiles()
    _outcome["checked_groups"] = sorted(_state.rounds)


_outcome: dict = {}


def _run_and_record(rank: int, folder: str, train) -> None:
    """Runs ``train()``; writes what it raised to ``folder/<rank>.json``; leaves the process as a failed job's rank does.

    ``seconds``: from the moment the rank ran its step's graphs (the step's start, or
    the end of its last compile) to the error, the time the ranks' mismatch cost.
    """
    _outcome.clear()
    # One collective per group, which the expected differences count in, unless the test
    # set a bucket cap (on one rank).
    if settings.bucket_cap_mb is None:
        settings.bucket_cap_mb = 0
    torch._dynamo.callback_handler.register_end_callback(lambda *args: _outcome.update(compiled=time.monotonic()))
    try:
        train()
        _outcome["raised"] = None
    except Exception as error:  # noqa: BLE001 - the outcome is what the test checks
        _outcome["raised"] = type(error).__name__
        _outcome["message"] = str(error)
        _outcome["traceback"] = traceback.format_exc()
        running_since = max(_outcome.get("step_started", 0.0), _outcome.get("compiled", 0.0))
        _outcome["seconds"] = time.monotonic() - running_since
    _outcome.pop("step_started", None)
    _outcome.pop("compiled", None)
    Path(folder, f"{rank}.json").write_text(json.dumps(_outcome))
    if _outcome["raised"] is None:
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _outcomes(folder: str, world_size: int) -> list[dict]:
    return [json.loads(Path(folder, f"{rank}.json").read_text()) for rank in range(world_size)]


def _assert_every_rank_stopped(outcomes: list[dict], *expected: str) -> None:
    for rank, outcome in enumerate(outcomes):
        assert outcome["raised"] == "RankMismatchError", (rank, outcome)
        assert outcome["seconds"] < 30, (rank, outcome)
        for text in expected:
            assert text in outcome["message"], (rank, text, outcome["message"])


def _settings_differ(rank, world_size, folder):
    backend = CapturingBackend().backend
    knobs = {"bucket_cap_mb": 1e6} if rank == 1 else {}
    with overridden(**knobs):
        _run_and_record(rank, folder, lambda: _train(_sharded(Blocks()), [4, 4, 4], backend))


def _branch_on_one_rank(rank, world_size, folder):
    backend = CapturingBackend().backend
    model = _sharded(Blocks())
    if rank == 1:
        model.blocks[0].calls.append(model.extra)
    _run_and_record(rank, folder, lambda: _train(model, [4, 4, 4], backend))


def _break_on_one_rank(rank, world_size, folder):
    backend = CapturingBackend().backend
    model = _sharded(Blocks())
    model.blocks[1].break_here = rank == 1
    _run_and_record(rank, folder, lambda: _train(model, [4, 4, 4], backend))


def _recompile_on_one_rank(rank, world_size, folder, collectives_change):
    backend = CapturingBackend().backend
    model = Blocks(extra_call_above=4 if collectives_change else None)
    batches = [4, 4, 8 if rank == 1 else 4]
    with overridden(rank_check_timeout_s=_TIMEOUT_S):
        _run_and_record(rank, folder, lambda: _train(_sharded(model), batches, backend))


def test_settings_that_differ_stop_both_ranks_naming_the_setting():
    folder = tmp_path_for_workers()
    run_gloo(_settings_differ, 2, folder, timeout=_HANG)
    outcomes = _outcomes(folder, 2)
    _assert_every_rank_stopped(
        outcomes,
        "process group [0,1]",
        "First differing collective on this group: #0 of the forward graph",
        "rank 1: all_gather_into_tensor float32[384] of blocks.0+blocks.1+blocks.2",
        "bucket_cap_mb: rank",
    )
    assert all(outcome["step"] == 0 for outcome in outcomes)


def test_a_rank_dependent_branch_stops_both_ranks():
    folder = tmp_path_for_workers()
    run_gloo(_branch_on_one_rank, 2, folder, timeout=_HANG)
    _assert_every_rank_stopped(
        _outcomes(folder, 2),
        "First differing collective on this group: #1 of the forward graph",
        "all_gather_into_tensor float32[128] of extra",
        "rank-dependent branch",
    )


def test_a_graph_break_on_one_rank_stops_both_ranks():
    folder = tmp_path_for_workers()
    run_gloo(_break_on_one_rank, 2, folder, timeout=_HANG)
    _assert_every_rank_stopped(_outcomes(folder, 2), "a graph break on rank 1")


def test_a_recompile_on_one_rank_that_changes_the_collectives_stops_both_ranks():
    folder = tmp_path_for_workers()
    run_gloo(_recompile_on_one_rank, 2, folder, True, timeout=_HANG)
    outcomes = _outcomes(folder, 2)
    _assert_every_rank_stopped(
        outcomes,
        "a recompile or a graph break on rank 1 only",
        "First differing collective on this group: #3 of the forward graph",
        "rank 1: all_gather_into_tensor float32[128] of extra",
    )
    assert [outcome["step"] for outcome in outcomes] == [2, 2]


def test_a_recompile_on_one_rank_that_keeps_the_collectives_trains_on():
    folder = tmp_path_for_workers()
    run_gloo(_recompile_on_one_rank, 2, folder, False, timeout=_HANG)
    outcomes = _outcomes(folder, 2)
    assert [outcome["raised"] for outcome in outcomes] == [None, None]
    assert [outcome["recompiles"] for outcome in outcomes] == [0, 1]


def _settings_differ_with_inductor(rank, world_size, folder):
    knobs = {"bucket_cap_mb": 1e6} if rank == 1 else {}
    with overridden(**knobs):
        _run_and_record(rank, folder, lambda: _train(_sharded(Blocks()), [4, 4, 4], "inductor"))


def test_inductor_compiled_graphs_carry_the_check():
    folder = tmp_path_for_workers()
    run_gloo(_settings_differ_with_inductor, 2, folder, timeout=_HANG)
    _assert_every_rank_stopped(
        _outcomes(folder, 2), "rank 1: all_gather_params_ float32[384] of blocks.0+blocks.1+blocks.2"
    )


def _hsdp_with_one_rank_apart(rank, world_size, folder):
    """A (2, 2) mesh, replicate x shard; rank 3 buckets its groups."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    backend = CapturingBackend().backend
    with overridden(**({"bucket_cap_mb": 1e6} if rank == 3 else {})):
        _run_and_record(rank, folder, lambda: _train(_sharded(Blocks(), mesh), [4, 4, 4], backend))


def test_a_2d_mesh_checks_each_group_with_its_own_ranks():
    """Rank 3 differs: its groups' ranks (2: shard group [2,3]; 1: replicate group [1,3]) name that group.

    Rank 0 shares no group with rank 3: its own checks agree, it hears of the stop and
    raises it when its collective fails.
    """
    folder = tmp_path_for_workers()
    run_gloo(_hsdp_with_one_rank_apart, 4, folder, timeout=_HANG)
    outcomes = _outcomes(folder, 4)
    _assert_every_rank_stopped(outcomes)
    groups = {rank: outcome["message"].split("process group [")[1].split("]")[0] for rank, outcome in enumerate(outcomes)}
    assert groups[1] in ("1,3", "2,3") and groups[2] in ("1,3", "2,3") and groups[3] in ("1,3", "2,3"), groups
    assert groups[0] in ("1,3", "2,3"), groups


def _pipeline_stages(rank, world_size, folder):
    """Ranks 0-1 and ranks 2-3 train different models, each sharded over its own pair (two pipeline stages)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("stage", "shard"))["shard"]
    backend = CapturingBackend().backend
    n_blocks = 2 if rank < 2 else 4
    _run_and_record(rank, folder, lambda: _train(_sharded(Blocks(n_blocks), mesh), [4, 4, 4], backend))


def test_groups_that_compile_different_graphs_by_design_are_not_flagged():
    folder = tmp_path_for_workers()
    run_gloo(_pipeline_stages, 4, folder, timeout=_HANG)
    outcomes = _outcomes(folder, 4)
    assert [outcome["raised"] for outcome in outcomes] == [None] * 4
    assert [outcome["checked_groups"] for outcome in outcomes] == [["0,1"], ["0,1"], ["2,3"], ["2,3"]]


def _slow_compile_on_one_rank(rank, world_size, folder):
    inner = CapturingBackend().backend

    def backend(graph_module, example_inputs):
        if rank == 1:
            time.sleep(2 * _TIMEOUT_S)  # a cache miss on one rank, a slower host
        return inner(graph_module, example_inputs)

    with overridden(rank_check_timeout_s=_TIMEOUT_S):
        _run_and_record(rank, folder, lambda: _train(_sharded(Blocks()), [4, 4, 4], backend))


def test_a_peer_that_compiles_longer_than_the_timeout_is_waited_for():
    folder = tmp_path_for_workers()
    run_gloo(_slow_compile_on_one_rank, 2, folder, timeout=_HANG)
    assert [outcome["raised"] for outcome in _outcomes(folder, 2)] == [None, None]
