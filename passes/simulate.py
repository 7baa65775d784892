"""simulate: replay a partitioned FX graph on two lanes (compute, communication) with the cost model.

Bucketing and reordering trade exposed communication against peak memory; a pass
(or a person) choosing between schedules needs both numbers for the hardware the
schedule is meant for, on a machine that has none of it. This replays a graph's
node order against ``cost_model`` estimates, with no tensor computed.

Time
----
- Nodes run one at a time in graph order on the compute lane, each for
  ``compute_seconds(node)`` (0 for views, placeholders and the output).
- A ``_c10d_functional`` collective costs no compute time: when the compute lane
  reaches it, it is issued to a FIFO communication lane, ``start = max(issue time,
  end of the collective before it)``, ``end = start + collective_seconds``.
- ``wait_tensor`` advances the compute lane to ``max(now, end)`` of its collective
  (the one whose ``waited_node`` it reads); the stall is exposed communication,
  charged to that collective. A collective that no wait reads is waited at the
  output node.
- ``fsdp.all_gather_into`` / ``fsdp.reduce_scatter_grad`` (a joint graph before
  ``lower``) wait inside the op: issued and waited at the same node, fully exposed.
  So does every collective on a profile whose communication cannot overlap compute
  (``HardwareProfile.overlaps_communication``: gloo on a CPU whose cores all compute).
- ``step_seconds = compute_seconds + exposed_communication_seconds``.

Memory
------
- Every node that is not a view allocates the bytes of its outputs when it runs (a
  collective: at issue). Views (``cost_model.is_view``), ``wait_tensor`` and in-place
  ops allocate nothing and alias their first argument, extending its lifetime.
- A buffer is freed once the last node reading it (or any alias of it) has run;
  a collective's input is read until its wait (funcol keeps it alive that long).
- Placeholders are live for the whole graph and count toward the peak; buffers the
  output returns stay live to the end. The peak is taken while a node's output and
  its inputs are all live.
- A multi-output op's outputs form one buffer, freed when the last of them is.

``simulate_step`` replays a forward and a backward graph back to back; its peak is
the larger of the two graphs' peaks, not their sum: the tensors the forward saves
are its outputs and the backward's placeholders, so each graph's peak already counts
what is live across the boundary. Memory outside the graphs (optimizer state, buffers
no graph reads) is not modelled.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.fx as fx

from compile_shard._annotation import group_annotation

from ._graph import c10d
from .cost_model import (
    HardwareProfile,
    collective_info,
    collective_seconds,
    compute_seconds,
    is_collective,
    is_view,
    tensor_bytes,
)
from .patterns import waited_node

#: How many compute node names a ``CollectiveRecord`` keeps in ``overlapped_compute``.
OVERLAP_NAMES = 8


@dataclass(frozen=True)
class Interval:
    """One node's busy time on one lane; ``node`` is the FX node name."""

    node: str
    lane: Literal["compute", "communication"]
    start: float
    end: float
    group: str | None
    #: Index of the graph in ``simulate_step``'s sequence (names repeat across forward and backward).
    graph: int = 0


@dataclass
class CollectiveRecord:
    """One collective's schedule: when it was issued, ran and was waited for."""

    name: str
    kind: str
    group: str | None
    bytes: int
    #: The compute node that ran last before the issue, None at the start of the graph.
    issued_after: str | None
    waited_at: str | None
    start: float
    end: float
    #: Compute-lane stall at the wait: the part of this collective nothing hid.
    exposed_seconds: float
    #: The first ``OVERLAP_NAMES`` compute nodes that ran while it was on the wire.
    overlapped_compute: list[str] = field(default_factory=list)
    graph: int = 0


@dataclass
class Simulation:
    """The replay of one graph, or of a step's graphs back to back (``simulate_step``)."""

    step_seconds: float
    compute_seconds: float
    #: Sum of the collectives' durations, hidden or not.
    communication_seconds: float
    exposed_communication_seconds: float
    peak_memory_bytes: int
    intervals: list[Interval]
    collectives: list[CollectiveRecord]
    #: (time, live bytes) after every change.
    memory_timeline: list[tuple[float, int]]

    def exposed_beyond_first_and_last(self) -> float:
        """Exposed communication except that of the first all-gather and the last reduction.

        No compute precedes a step's first all-gather and none follows its last
        reduce-scatter (nor, on HSDP, the last all-reduce), so those can never be
        hidden: a schedule that overlaps everything else scores 0 here.
        """
        gathers = [record for record in self.collectives if record.kind == "all_gather"]
        scatters = [record for record in self.collectives if record.kind in ("reduce_scatter", "all_to_all")]
        all_reduces = [record for record in self.collectives if record.kind == "all_reduce"]
        unavoidable = [gathers[0]] if gathers else []
        unavoidable += [scatters[-1]] if scatters else []
        unavoidable += [all_reduces[-1]] if all_reduces else []
        return sum(
            record.exposed_seconds
            for record in self.collectives
            if not any(record is excluded for excluded in unavoidable)
        )


def _group(node: fx.Node) -> str | None:
    annotation = group_annotation(node)
    return None if annotation is None else annotation.name


def _alias_source(node: fx.Node) -> fx.Node | None:
    """The node whose memory ``node``'s output is, or None when it allocates its own."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if is_view(node) or node.target is c10d.wait_tensor.default:
        return node.args[0]
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target._schema.returns:
        alias = target._schema.returns[0].alias_info
        if alias is not None and alias.is_write:  # in-place or out=: returns the argument it wrote
            for index, argument in enumerate(target._schema.arguments):
                if argument.alias_info is not None and argument.alias_info.before_set == alias.before_set:
                    return node.kwargs[argument.name] if argument.kwarg_only else node.args[index]
    return None


class _Memory:
    """Live bytes over time: which buffer each node's output is in, and when each buffer dies."""

    def __init__(self, nodes: list[fx.Node], start: float):
        self.buffer: dict[fx.Node, fx.Node] = {}
        for node in nodes:
            source = _alias_source(node)
            self.buffer[node] = node if source is None else self.buffer[source]
        inputs = [node for node in nodes if node.op in ("placeholder", "get_attr")]
        pinned = set(inputs)
        last_read = {}
        collective_of = {waited_node(node): node for node in nodes if is_collective(node)}
        for index, node in enumerate(nodes):
            last_read.setdefault(self.buffer[node], index)
            reads = list(node.all_input_nodes)
            if node.target is c10d.wait_tensor.default and node.args[0] in collective_of:
                reads += collective_of[node.args[0]].all_input_nodes
            for read in reads:
                last_read[self.buffer[read]] = index
            if node.op == "output":
                pinned.update(self.buffer[read] for read in reads)
        self.frees: dict[int, list[fx.Node]] = {}
        for buffer, index in last_read.items():
            if buffer not in pinned:
                self.frees.setdefault(index, []).append(buffer)
        self.live = self.peak = sum(tensor_bytes(node.meta.get("val")) for node in inputs)
        self.timeline = [(start, self.live)]

    def _change(self, time: float, change: int) -> None:
        if change:
            self.live += change
            self.peak = max(self.peak, self.live)
            self.timeline.append((time, self.live))

    def allocate(self, node: fx.Node, time: float) -> None:
        """``node`` runs (or is issued) at ``time``: its own buffer, if it has one, comes alive."""
        if node.op == "call_function" and self.buffer[node] is node:
            self._change(time, tensor_bytes(node.meta.get("val")))

    def release(self, index: int, time: float) -> None:
        """The node at ``index`` has finished at ``time``: the buffers it read last die."""
        self._change(time, -sum(tensor_bytes(buffer.meta.get("val")) for buffer in self.frees.get(index, [])))


def _fill_overlaps(records: list[CollectiveRecord], intervals: list[Interval]) -> None:
    """Sets each record's ``overlapped_compute``; compute intervals run one after another, so both ends are sorted."""
    compute = [interval for interval in intervals if interval.lane == "compute"]
    starts, ends = [interval.start for interval in compute], [interval.end for interval in compute]
    for record in records:
        first = bisect.bisect_right(ends, record.start)
        stop = min(bisect.bisect_left(starts, record.end), first + OVERLAP_NAMES)
        record.overlapped_compute = [interval.node for interval in compute[first:stop]]


def _replay(
    graph: fx.Graph, profile: HardwareProfile, world_size: int | None, graph_index: int, start: float
) -> Simulation:
    """Replays ``graph`` from time ``start`` (see the module docstring for the rules)."""
    nodes = list(graph.nodes)
    memory = _Memory(nodes, start)
    now = lane_free = start
    compute_total = communication_total = exposed_total = 0.0
    intervals: list[Interval] = []
    records: list[CollectiveRecord] = []
    in_flight: dict[fx.Node, CollectiveRecord] = {}
    last_compute: str | None = None

    def wait(record: CollectiveRecord, at: fx.Node) -> None:
        nonlocal now, exposed_total
        stall = max(0.0, record.end - now)
        record.exposed_seconds, record.waited_at = stall, at.name
        now += stall
        exposed_total += stall

    for index, node in enumerate(nodes):
        if is_collective(node):
            info = collective_info(node, world_size)
            duration = collective_seconds(node, profile, world_size)
            begin = max(now, lane_free)
            lane_free = begin + duration
            communication_total += duration
            group = _group(node)
            record = CollectiveRecord(
                node.name, info.kind, group, info.bytes, last_compute, None, begin, lane_free, 0.0, graph=graph_index
            )
            records.append(record)
            intervals.append(Interval(node.name, "communication", begin, lane_free, group, graph_index))
            memory.allocate(node, now)
            if info.synchronous or not profile.overlaps_communication:
                wait(record, node)
            else:
                in_flight[waited_node(node)] = record
        elif node.target is c10d.wait_tensor.default and node.args[0] in in_flight:
            wait(in_flight.pop(node.args[0]), node)
        elif node.op == "output":
            for record in in_flight.values():
                wait(record, node)
        else:
            memory.allocate(node, now)
            duration = compute_seconds(node, profile)
            if duration > 0:
                intervals.append(Interval(node.name, "compute", now, now + duration, _group(node), graph_index))
                now += duration
                compute_total += duration
                last_compute = node.name
        memory.release(index, now)

    _fill_overlaps(records, intervals)
    return Simulation(
        step_seconds=now - start,
        compute_seconds=compute_total,
        communication_seconds=communication_total,
        exposed_communication_seconds=exposed_total,
        peak_memory_bytes=memory.peak,
        intervals=intervals,
        collectives=records,
        memory_timeline=memory.timeline,
    )


def simulate(graph: fx.Graph, profile: HardwareProfile, *, world_size: int | None = None) -> Simulation:
    """Replays ``graph`` from time 0; ``world_size`` is only needed for all_reduce, see ``collective_info``."""
    return _replay(graph, profile, world_size, graph_index=0, start=0.0)


def simulate_step(
    graphs: Sequence[fx.Graph], profile: HardwareProfile, *, world_size: int | None = None
) -> Simulation:
    """Replays ``graphs`` (a forward, then a backward) back to back, each starting when the one before ends.

    Times add up; ``peak_memory_bytes`` is the largest per-graph peak (see the module
    docstring); intervals and records carry their graph's index in ``graph``.
    """
    parts: list[Simulation] = []
    end = 0.0
    for index, graph in enumerate(graphs):
        parts.append(_replay(graph, profile, world_size, graph_index=index, start=end))
        end += parts[-1].step_seconds
    return Simulation(
        step_seconds=end,
        compute_seconds=sum(part.compute_seconds for part in parts),
        communication_seconds=sum(part.communication_seconds for part in parts),
        exposed_communication_seconds=sum(part.exposed_communication_seconds for part in parts),
        peak_memory_bytes=max((part.peak_memory_bytes for part in parts), default=0),
        intervals=[interval for part in parts for interval in part.intervals],
        collectives=[record for part in parts for record in part.collectives],
        memory_timeline=[point for part in parts for point in part.memory_timeline],
    )
