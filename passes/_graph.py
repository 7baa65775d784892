"""Small FX helpers shared by the passes: recognizing ops and inserting nodes with metadata."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_map


T = TypeVar("T")

aten = torch.ops.aten
prims = torch.ops.prims
fsdp = torch.ops.fsdp
c10d = torch.ops._c10d_functional
invoke_subgraph = torch.ops.higher_order.invoke_subgraph

# The views the traced and lowered chains are spelled with (Inductor's decompositions turn
# ``_unsafe_view`` into ``view`` and some views into ``reshape``).
VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)

# Metadata a replacement node inherits from the node it replaces: the partitioner's
# recompute tags and compile_shard's group annotation.
INHERITED_META = ("custom", "recompute", "ac_graph_id", "seq_nr", "stack_trace", "nn_module_stack")



def op_argument(node: fx.Node, name: str) -> Any:
    """The value of an op's argument ``name`` in ``node``: given positionally, by keyword, or its default."""
    for index, argument in enumerate(node.target._schema.arguments):
        if argument.name == name:
            if index < len(node.args):
                return node.args[index]
            return node.kwargs.get(name, argument.default_value)
    raise KeyError(f"{node.target} has no argument {name!r}")


def cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype ``node`` casts its input to, where it is a plain dtype cast (``x.to(dtype)`` in a trace)."""
    if node.op != "call_function":
        return None
    if node.target is prims.convert_element_type.default:
        return node.args[1]
    if node.target is aten._to_copy.default and set(node.kwargs) == {"dtype"} and len(node.args) == 1:
        return node.kwargs["dtype"]
    return None

# [Note: recompute graph ids]
# The partitioner recomputes a node tagged MUST_RECOMPUTE together with the other
# nodes of its ``ac_graph_id``: one id is one recompute region. torch.utils.checkpoint
# numbers its regions from 0 up; the passes' own regions must never share an id with
# them or with each other, so each pass that tags draws from its own range here:
# ``reshard`` one id per resharded gather chain (two for a group resharded to a smaller
# group), ``compile_regions`` one for every region's
# parameter views.
_AC_GRAPH_ID_RANGES = {"reshard": 1_000_000, "compile_regions": 2_000_000}
_AC_GRAPH_ID_RANGE_SIZE = 1_000_000


def ac_graph_id(pass_name: str, index: int = 0) -> int:
    """Recompute-region id number ``index`` of the pass ``pass_name`` ([Note: recompute graph ids])."""
    if not 0 <= index < _AC_GRAPH_ID_RANGE_SIZE:
        raise ValueError(f"{pass_name}: recompute region {index} is outside its id range")
    return _AC_GRAPH_ID_RANGES[pass_name] + index


def region_module(call: fx.Node) -> fx.GraphModule:
    """The subgraph an ``invoke_subgraph`` node calls (a compile region)."""
    return getattr(call.graph.owning_module, call.args[0].target)


def is_backward(graph: fx.Graph) -> bool:
    """Whether a partitioned graph is the backward one: AOTAutograd names its gradient inputs ``tangents_*``."""
    return any(node.name.startswith("tangents") for node in graph.find_nodes(op="placeholder"))


def fake_value(target: Callable, args: tuple, kwargs: dict | None = None) -> Any:
    """Runs ``target`` on the fake values of the argument nodes (for ``meta["val"]``)."""
    kwargs = kwargs or {}
    values = tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a, (args, kwargs))
    fake_mode = detect_fake_mode(values)
    if fake_mode is None:
        return target(*values[0], **values[1])
    with fake_mode:
        return target(*values[0], **values[1])


class NodeInserter:
    """Inserts ``call_function`` nodes before ``anchor`` with fake values and inherited meta."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, meta_source: fx.Node):
        self.graph = graph
        self.anchor = anchor
        self.meta_source = meta_source

    def __call__(self, target: Callable, *args: Any, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        node.meta["val"] = fake_value(target, args, kwargs)
        for key in INHERITED_META:
            if key in self.meta_source.meta:
                node.meta[key] = self.meta_source.meta[key]
        return node


def reorder_by_priority(graph: fx.Graph, priority: dict[fx.Node, float]) -> int:
    """Reorders ``graph`` topologically, running the ready node with the lowest priority first.

    A node inherits the lowest priority of its users, so an urgent node's producers
    are not starved by less urgent ready work. Nodes without a priority keep their
    current position as one; ties keep the current order. Placeholders stay first, in
    their order, and the output last. Returns how many nodes changed position.
    """
    nodes = list(graph.nodes)
    position = {node: index for index, node in enumerate(nodes)}
    # A pass may have inserted nodes out of order: inherit along a true topological order.
    effective = {}
    for node in reversed(_fx_topological_order(nodes, position)):
        own = priority.get(node, float(position[node]))
        effective[node] = min([own, *(effective[user] for user in node.users)])
    order = _fx_topological_order(nodes, {node: (effective[node], position[node]) for node in nodes})
    # Placeholders are the calling convention: they keep their order.
    placeholders = [node for node in nodes if node.op == "placeholder"]
    (output,) = [node for node in order if node.op == "output"]
    order = placeholders + [node for node in order if node.op not in ("placeholder", "output")] + [output]
    moved = sum(1 for index, node in enumerate(order) if position[node] != index)
    for node in order[len(placeholders) : -1]:
        output.prepend(node)
    return moved


def _fx_topological_order(nodes: list[fx.Node], key: dict[fx.Node, Any]) -> list[fx.Node]:
    order = topological_order(nodes, lambda node: node.all_input_nodes, key.__getitem__)
    if order is None:
        raise RuntimeError("graph has a cycle")
    return order


def topological_order(items: list[T], producers: Callable[[T], Iterable[T]], key: Callable[[T], Any]) -> list[T] | None:
    """Kahn's algorithm: ``items`` each after its ``producers``, the ready item with the lowest ``key`` first.

    Ties keep the order of ``items``. None where the items form a cycle. FX nodes
    (``reorder_by_priority``) and Inductor's scheduler nodes (``keep_order``) sort with it.
    """
    index = {item: i for i, item in enumerate(items)}
    users: dict[T, list[T]] = {item: [] for item in items}
    waiting = {}
    for item in items:
        found = {producer for producer in producers(item) if producer in index and producer is not item}
        waiting[item] = len(found)
        for producer in found:
            users[producer].append(item)
    ready = [(key(item), index[item]) for item in items if waiting[item] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(items[i])
        for user in users[items[i]]:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (key(user), index[user]))
    return order if len(order) == len(items) else None
