"""rank_check: start each compiled graph with the check that its group's ranks run the same collectives.

[Note: the rank check]
Every rank compiles its own graphs. A rank whose graph issues other collectives than
its peers' (another order, other sizes, another bucket boundary; from different pass
settings, a rank-dependent branch, a graph break or a recompile on one rank) makes
them wait on each other until the process group's timeout, or pairs collectives of
equal size silently. This pass writes the graph's collective sequence, per process
group, into the graph: one ``fsdp.rank_check`` node before every other node, whose
argument is the record (``collective_record``). The op's kernel
(``compile_shard.ops.rank_check``) compares it across each group's ranks the first
time a rank runs a sequence it has not agreed on, and raises ``RankMismatchError``
naming the first differing collective instead of hanging.

The record lives in the graph, not in this process: a graph loaded from Inductor's or
AOTAutograd's cache carries the check it was compiled with, and the check sees what
the rank runs, after ``reorder``, from whichever cache. The record holds nothing
rank-specific (ranks of a shared cache may load each other's graphs) but, while graphs
are dumped, the rank's dump folder of the graph: dumping turns the caches off, and the
digest the ranks compare leaves the folder out. The pass runs last, on the final
partitioned graphs, so the order recorded is the order issued.
Graphs whose collectives run on no group of two or more real ranks (the fake process
group of the graph tests, a world of one) are left alone.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from compile_shard._annotation import group_annotation
from compile_shard._collectives import node_collective

from ._graph import fsdp, invoke_subgraph, is_backward, op_argument, region_module
from .dump import GraphDump
from .graph_breaks import holds_part_of_a_model
from .settings import settings


def group_ranks(group_name: str) -> tuple[int, ...] | None:
    """The global ranks of the process group named ``group_name``; ``None`` where no peer could disagree.

    A group of one rank has no peer; the fake backend's peers are not processes.
    """
    group = dist.distributed_c10d._resolve_process_group(group_name)
    if dist.get_backend(group) == "fake":
        return None
    ranks = tuple(dist.get_process_group_ranks(group))
    return ranks if len(ranks) > 1 else None


def _sent(node: fx.Node) -> str:
    """``dtype[numel]`` of what a collective sends from each rank, the same on every rank.

    An op that takes a group's shards (uneven: the last ranks' are shorter) sends them
    padded to ``padded_numels``; the others send their data argument as it is.
    """
    value = node.args[node_collective(node).data_arg]
    tensors = [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, fx.Node)]
    values = [t.meta.get("val") for t in tensors]
    if not values or not all(isinstance(v, torch.Tensor) for v in values):
        return "?"
    if any(argument.name == "padded_numels" for argument in node.target._schema.arguments):
        numel = sum(op_argument(node, "padded_numels"))
    else:
        numel = sum(v.numel() for v in values)
    return f"{str(values[0].dtype).removeprefix('torch.')}[{numel}]"


def _describe(node: fx.Node) -> str:
    """One collective as the check's messages show it: op, data sent, fully_shard group."""
    text = f"{node.target.overloadpacket.__name__} {_sent(node)}"
    annotation = group_annotation(node)
    return text if annotation is None else f"{text} of {annotation.name}"


def _collective_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The collectives ``graph`` issues, in order, those of each compile region it calls included."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is invoke_subgraph:
            found.extend(_collective_nodes(region_module(node).graph))
        elif (collective := node_collective(node)) is not None and collective.group_arg is not None:
            found.append(node)
    return found


def collective_record(graph: fx.Graph, ranks_of: Callable[[str], tuple[int, ...] | None]) -> dict | None:
    """What ``fsdp.rank_check`` compares: the graph's collectives per group of ranks, and what explains a difference.

    ``ranks_of`` maps a process group's name to its ranks (``group_ranks``).

    ``groups`` maps each group (its ranks, comma-separated) to its collectives in issue
    order; ``graph`` is ``forward`` or ``backward``; ``partial`` says the graph holds
    part of a sharded model (a graph break: what runs after it differs too, so the
    check compares it with the collectives); ``settings`` are the pass settings it
    was compiled with.
    ``None`` where no collective runs on a group with peers.
    """
    groups: dict[str, list[str]] = {}
    for node in _collective_nodes(graph):
        ranks = ranks_of(node.args[node_collective(node).group_arg])
        if ranks is not None:
            groups.setdefault(",".join(map(str, ranks)), []).append(_describe(node))
    if not groups:
        return None
    return {
        "graph": "backward" if is_backward(graph) else "forward",
        "partial": holds_part_of_a_model(graph),
        "settings": dataclasses.asdict(settings),
        "groups": groups,
    }


def rank_check(graph: fx.Graph) -> int:
    """Puts ``fsdp.rank_check`` with the graph's record before its first node; returns how many it put (0 or 1)."""
    record = collective_record(graph, group_ranks)
    if record is None or graph.find_nodes(op="call_function", target=fsdp.rank_check.default):
        return 0
    if GraphDump.latest is not None:
        record["dump"] = str(GraphDump.latest.folder)
    first = next(node for node in graph.nodes if node.op != "placeholder")
    with graph.inserting_before(first):
        check = graph.call_function(fsdp.rank_check.default, (json.dumps(record, sort_keys=True),))
    check.meta["val"] = None
    return 1
