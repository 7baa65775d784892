"""refunctionalize: remove traced storage mutations and point their readers at the gathered tensors.

A runtime that manages unsharded storage in place (FSDP2's ``resize_`` + ``copy_``
re-gather, ``set_`` swaps) leaves mutations of parameter storage in a trace. None of
them has a meaning in a functional graph, and Inductor must not see them: this pass
deletes ``fsdp.resize_storage_``, and for every ``fsdp.set_`` / ``aten.set_`` and every
``aten.copy_`` into a storage that was resized in the graph, it rewrites the later
readers of the destination to read the source, then deletes the mutation.
compile_shard's own runtime traces none of these (see [Note: traced unshard]); the
pass keeps graphs from other tracing paths, and hand-written ones, functional.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ._graph import fsdp

aten = torch.ops.aten
_SET_OPS = (fsdp.set_.default, aten.set_.source_Tensor)


def _redirect_later_readers(order: dict[fx.Node, int], mutation: fx.Node, destination: fx.Node, source: fx.Node) -> None:
    for reader in list(destination.users):
        if reader is not mutation and order[reader] > order[mutation]:
            reader.replace_input_with(destination, source)


def refunctionalize(graph: fx.Graph) -> int:
    """Removes storage mutations from ``graph``; returns how many it removed."""
    resized = {node.args[0] for node in graph.find_nodes(op="call_function", target=fsdp.resize_storage_.default)}
    order = {node: index for index, node in enumerate(graph.nodes)}
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is fsdp.resize_storage_.default:
            graph.erase_node(node)
        elif node.target in _SET_OPS or (node.target is aten.copy_.default and node.args[0] in resized):
            destination, source = node.args[:2]
            _redirect_later_readers(order, node, destination, source)
            node.replace_all_uses_with(source)
            graph.erase_node(node)
        else:
            continue
        removed += 1
    return removed
