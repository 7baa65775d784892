"""reorder: issue all-gathers ahead of their group's compute and reduce-scatters as soon as gradients are final.

Runs on the partitioned forward and backward graphs (the partitioner decides where
backward's recomputed gathers and gradient reductions go, so scheduling them on the
joint graph would be undone). It sees *units*: a gather unit is a group's copy-in,
all-gather, wait and copy-out; a reduce unit is a group's gradient copy-in,
reduce-scatter, wait and what reads the wait (``fsdp.sum_shards``, a division).
Everything else is compute, kept in its order.

[Note: the schedule]
Gather units are numbered in the order the graph first reads them (forward order in
the forward graph, reverse order in backward). With prefetch depth ``d``, unit ``k``
is issued right before unit ``k - d`` is waited on, so its transfer overlaps the
compute of the ``d`` groups before it; units ``k < d`` are issued at the start. Its
wait and copy-out stay right before its first reader. A group's
``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` lists
(FSDP2's knobs) add constraints: each listed group is issued no later than the
prefetching group's wait. A reduce unit is issued as soon as its last gradient is
computed; its wait goes right after the next ``reduce_scatter_depth``-th reduce unit
is issued (the last ones at the end), so that many reductions are in flight while
backward computes; what reads the wait (gloo's sum, a division) follows it at once. On
HSDP the replicate all-reduce of the reduced gradient is issued right after that and
waited with the reduce-scatter ``reduce_scatter_depth`` units later. All
of it is one priority-ordered topological sort (``reorder_by_priority``), so data
dependencies always win over the schedule.

Each issued-but-unwaited all-gather holds a group's unsharded parameters: a deeper
prefetch costs one group's unsharded size per step of depth. With a memory budget,
the depth is lowered until the simulated peak of the graph fits.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch.fx as fx

from compile_shard._annotation import group_annotation

from ._graph import c10d, fsdp, is_backward, reorder_by_priority
from .patterns import LOWERED_GATHERS, chain_readers, copy_out_chain

# A gradient reduction is a reduce-scatter, or an all-to-all where the backend has no
# reduce-scatter (see [Note: gloo reduce-scatter] in ``compile_shard.ops``), or a custom comm's
# ([Note: custom collectives] in compile_shard.ops.all_gather).
_REDUCE = (c10d.reduce_scatter_tensor.default, c10d.all_to_all_single.default, fsdp.reduce_scatter_with_comm.default)


@dataclass
class _Unit:
    collective: fx.Node
    wait: fx.Node

    @property
    def members(self) -> list[str]:
        return list(group_annotation(self.collective).members)


def _copy_in(unit: _Unit) -> list[fx.Node]:
    """The unit's own producers of its collective: shard views, padding and cat, or gradient slices and cat.

    They carry the annotation of one of the unit's groups; the first producer that
    does not (a shard input, a gradient matmul) is where the unit starts to depend
    on the rest of the graph.
    """
    groups = set(unit.members)
    found, stack = [], list(unit.collective.all_input_nodes)
    while stack:
        node = stack.pop()
        annotation = group_annotation(node)
        if node in found or node.op != "call_function" or annotation is None:
            continue
        if not set(annotation.members) <= groups:
            continue
        found.append(node)
        stack.extend(node.all_input_nodes)
    return found


def _units(graph: fx.Graph, targets: tuple) -> list[_Unit]:
    units = []
    for collective in [node for target in targets for node in graph.find_nodes(op="call_function", target=target)]:
        if group_annotation(collective) is None or len(collective.users) != 1:
            continue
        (wait,) = collective.users
        units.append(_Unit(collective, wait))
    return units


def _first_reader(unit: _Unit, position: dict[fx.Node, int]) -> int | None:
    """Where the graph first computes with the unit's gathered parameters.

    The output does not count: a forward that saves the parameters for backward
    (no resharding) still computes with them first.
    """
    readers = [reader for reader in chain_readers(copy_out_chain(unit.wait)) if reader.op != "output"]
    return min(position[reader] for reader in readers) if readers else None


def _gather_priorities(graph, position, depth: int, explicit_key: str) -> dict[fx.Node, float]:
    units = _units(graph, LOWERED_GATHERS)
    timed = sorted(
        (reader, index) for index, unit in enumerate(units) if (reader := _first_reader(unit, position)) is not None
    )
    ordered = [units[index] for _, index in timed]
    wait_at = {id(unit): reader - 0.5 for (reader, _), unit in zip(timed, ordered)}
    issue_at = {}
    for k, unit in enumerate(ordered):
        issue_at[id(unit)] = wait_at[id(ordered[k - depth])] - 0.25 if k >= depth else -1.0
    by_group = {group: unit for unit in ordered for group in unit.members}
    for unit in ordered:
        for group in getattr(group_annotation(unit.collective), explicit_key):
            target = by_group.get(group)
            if target is not None and target is not unit:
                issue_at[id(target)] = min(issue_at[id(target)], wait_at[id(unit)] - 0.25)
    priority = {}
    for unit in ordered:
        for node in [*_copy_in(unit), unit.collective]:
            priority[node] = issue_at[id(unit)]
        for node in copy_out_chain(unit.wait):
            priority[node] = wait_at[id(unit)]
    return priority


def _reduce_priorities(graph, position, depth: int) -> dict[fx.Node, float]:
    """Issue each reduce-scatter right after its last gradient; wait ``depth`` reductions later."""
    units = _units(graph, _REDUCE)
    ready_at = {}
    copy_in = {id(unit): _copy_in(unit) for unit in units}
    for unit in units:
        inside = set(copy_in[id(unit)])
        producers = [p for node in [*inside, unit.collective] for p in node.all_input_nodes if p not in inside]
        ready_at[id(unit)] = max(position[producer] for producer in producers) + 0.5
    units.sort(key=lambda unit: ready_at[id(unit)])
    end = float(len(position))
    priority = {}
    for j, unit in enumerate(units):
        for node in [*copy_in[id(unit)], unit.collective]:
            priority[node] = ready_at[id(unit)]
        priority[unit.wait] = ready_at[id(units[j + depth])] + 0.75 if j + depth < len(units) else end
        for node in _reduced(unit):
            priority[node] = priority[unit.wait]
    for j, unit in enumerate(units):
        for all_reduce in _all_reduces(unit):
            # HSDP: the replicate all-reduce is issued once the reduce-scatter is waited
            # and waited when the reduce-scatter ``depth`` units later is, so it runs
            # behind that backward compute as the reduce-scatters do.
            priority[all_reduce] = priority[unit.wait]
            later = j + depth
            priority[next(iter(all_reduce.users))] = priority[units[later].wait] + 0.1 if later < len(units) else end
    return priority


def _reduced(unit: _Unit) -> list[fx.Node]:
    """The group's nodes that read the reduction's wait: ``fsdp.sum_shards`` on gloo, a division, the gradients' views.

    The partitioner leaves them where the gradients are returned, at the end of the
    backward, which would keep every group's unsharded reduction buffer alive until
    then; right after the wait, each frees its buffer before the next group reduces.
    """
    return [user for user in unit.wait.users if group_annotation(user) is not None]


def _all_reduces(unit: _Unit) -> list[fx.Node]:
    """HSDP's all-reduces of the unit's reduced gradient ([Note: HSDP reduction] in compile_shard.ops)."""
    reduced = [unit.wait, *_reduced(unit)]
    return [
        user
        for node in reduced
        for user in node.users
        if user.target is c10d.all_reduce.default and group_annotation(user) is not None and len(user.users) == 1
    ]


def reorder(graph: fx.Graph, prefetch_depth: int = 1, reduce_scatter_depth: int = 1) -> int:
    """Reorders one partitioned graph; returns how many nodes moved.

    ``prefetch_depth`` 0 gathers right before use (no overlap); ``reduce_scatter_depth``
    0 waits every reduce-scatter as soon as it is issued.
    """
    position = {node: index for index, node in enumerate(graph.nodes)}
    explicit_key = "backward_prefetch" if is_backward(graph) else "forward_prefetch"
    priority = _gather_priorities(graph, position, prefetch_depth, explicit_key)
    priority.update(_reduce_priorities(graph, position, reduce_scatter_depth))
    if not priority:
        return 0
    return reorder_by_priority(graph, priority)


def reorder_within_budget(
    graph: fx.Graph,
    prefetch_depth: int,
    reduce_scatter_depth: int,
    memory_budget_bytes: float,
    peak_memory: Callable[[fx.Graph], int],
) -> int:
    """``schedule``, lowering the prefetch depth until ``peak_memory(graph)`` fits the budget.

    Warns when even gathering right before use (depth 0) does not fit: the budget is
    then below what the graph needs without any prefetch, which no schedule fixes.
    """
    moved = reorder(graph, prefetch_depth, reduce_scatter_depth)
    while (peak := peak_memory(graph)) > memory_budget_bytes and prefetch_depth > 0:
        prefetch_depth -= 1
        moved += reorder(graph, prefetch_depth, reduce_scatter_depth)
    if peak > memory_budget_bytes:
        kind = "backward" if is_backward(graph) else "forward"
        warnings.warn(
            f"compile_shard: the {kind} graph needs {peak / 2**20:.1f} MiB at its simulated peak even without "
            f"prefetch, over settings.memory_budget_mb = {memory_budget_bytes / 2**20:.1f}; raise the budget or "
            "shard into more groups",
            stacklevel=2,
        )
    return moved
