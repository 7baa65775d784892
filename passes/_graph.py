"""Small FX helpers shared by the passes: recognizing ops and inserting nodes with metadata."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_map

from compile_shard._group import GROUP_ANNOTATION

fsdp = torch.ops.fsdp
c10d = torch.ops._c10d_functional

# Metadata a replacement node inherits from the node it replaces: the partitioner's
# recompute tags and compile_shard's group annotation.
INHERITED_META = ("custom", "recompute", "ac_graph_id", "seq_nr", "stack_trace", "nn_module_stack")


def group_annotation(node: fx.Node) -> dict[str, Any] | None:
    """The ``{"group": ..., "reshard_after_forward": ...}`` the runtime attached, if any."""
    return node.meta.get("custom", {}).get(GROUP_ANNOTATION)


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
