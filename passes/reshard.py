"""reshard: decide per group whether backward re-gathers (reshard after forward) or reuses saved parameters.

[Note: partitioner tags for resharding]
The partitioner keeps a collective's output alive for backward unless told
otherwise, which would keep every unsharded parameter in memory. For a group with
``reshard_after_forward=True`` this pass tags the all-gather, the shard views that
feed it and the whole single-input copy-out chain after it ``MUST_RECOMPUTE``
(with an ``ac_graph_id`` of the group's own): the forward then saves only the
shards, and backward runs the chain again. Tagging only the all-gather is not
enough: the partitioner would save the first view after it instead. For
``reshard_after_forward=False`` the all-gather is tagged ``MUST_SAVE`` and any
recompute tag an activation-checkpoint region put on the chain is dropped, so
backward uses the gathered parameters without a second all-gather.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ._graph import fsdp, group_annotation

# Single-tensor-input ops that make up the shard views and the copy-out chain.
_CHAIN_OPS = {
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.split_with_sizes.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.clone.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.t.default,
    torch.ops.aten.permute.default,
    torch.ops.aten.expand.default,
    torch.ops.aten._to_copy.default,
}
_GETITEM = __import__("operator").getitem
# Recompute-region ids well above the ones torch.utils.checkpoint hands out.
_AC_GRAPH_ID_BASE = 1_000_000


def _is_chain_node(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in _CHAIN_OPS or node.target is _GETITEM)


def copy_out_chain(gathered: fx.Node) -> list[fx.Node]:
    """``gathered`` and the view/copy nodes that follow it: single-input ones, and a
    ``cat`` of chain nodes only (``copy_out`` concatenates a group's copies)."""
    chain = [gathered]
    frontier = list(gathered.users)
    while frontier:
        node = frontier.pop()
        if node in chain:
            continue
        joins_chain = node.target is torch.ops.aten.cat.default and all(
            producer in chain for producer in node.all_input_nodes
        )
        if not (joins_chain or _is_chain_node(node)):
            continue
        chain.append(node)
        frontier.extend(node.users)
    return chain


def chain_readers(chain: list[fx.Node]) -> list[fx.Node]:
    """The nodes outside ``chain`` that read one of its nodes: where the gathered parameters are used."""
    members = set(chain)
    return [user for node in chain for user in node.users if user not in members]


def all_gather_chain(all_gather: fx.Node) -> list[fx.Node]:
    """An ``fsdp.all_gather_into``, the shard views feeding it, and its copy-out chain."""
    shard_views = [shard for shard in all_gather.args[0] if _is_chain_node(shard)]
    return shard_views + copy_out_chain(all_gather)


def reshard(graph: fx.Graph) -> int:
    """Tags every annotated ``fsdp.all_gather_into`` chain; returns how many groups it tagged.

    A chain whose gathered parameters are outputs of the graph (a graph break made
    them cross into the next graph) stays untagged: they are alive anyway, and an
    output cannot be recomputed.
    """
    (output,) = graph.find_nodes(op="output")
    outputs = set(output.all_input_nodes)
    tagged = 0
    for index, node in enumerate(graph.find_nodes(op="call_function", target=fsdp.all_gather_into.default)):
        annotation = group_annotation(node)
        if annotation is None:
            continue
        chain = all_gather_chain(node)
        if outputs.intersection(chain):
            continue
        if annotation["reshard_after_forward"]:
            for chain_node in chain:
                chain_node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                chain_node.meta["ac_graph_id"] = _AC_GRAPH_ID_BASE + index
        else:
            for chain_node in chain:
                chain_node.meta.pop("recompute", None)
                chain_node.meta.pop("ac_graph_id", None)
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        tagged += 1
    return tagged
