"""reshard: decide per group whether backward re-gathers (reshard after forward) or reuses saved parameters.

[Note: partitioner tags for resharding]
The partitioner keeps a collective's output alive for backward unless told
otherwise, which would keep every unsharded parameter in memory. For a group with
``reshard_after_forward=True`` this pass tags the all-gather, the shard views that
feed it and the whole single-input copy-out chain after it ``MUST_RECOMPUTE``, and
with all-gather extensions the transforms around it (``patterns.unshard_nodes``)
(with an ``ac_graph_id`` of the group's own): the forward then saves only the
shards, and backward runs the chain again. Tagging only the all-gather is not
enough: the partitioner would save the first view after it instead. For
``reshard_after_forward=False`` the all-gather is tagged ``MUST_SAVE`` and any
recompute tag an activation-checkpoint region put on the chain is dropped, so
backward uses the gathered parameters without a second all-gather.

A group that reshards to a smaller group ([Note: resharding to a smaller group] in
``compile_shard._group``) is tagged as a resharded one, and its backward reads a
second copy-out chain instead: ``_reshard_to_smaller_group`` copies this rank's chunk
of the all-gather output (``fsdp.post_forward_chunk``, which the forward saves:
``MUST_SAVE``), all-gathers the chunks over the smaller group and copies out again, all
``MUST_RECOMPUTE``, so the partitioner runs that gather in backward from the saved chunk. A group whose
forward an activation checkpoint recomputes in backward gathers over the whole group
there, as with ``True``: the recomputed forward reads the parameters anyway.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from compile_shard._annotation import group_annotation

from ._graph import NodeInserter, ac_graph_id, fsdp
from .patterns import chain_readers, copy_out_chain, unshard_nodes

aten = torch.ops.aten


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The joint graph's backward: every node that depends on a gradient input (``tangents_*``)."""
    backward: set[fx.Node] = set()
    frontier = [node for node in graph.find_nodes(op="placeholder") if node.name.startswith("tangents")]
    while frontier:
        node = frontier.pop()
        if node not in backward:
            backward.add(node)
            frontier.extend(node.users)
    return backward


def _tag(nodes: list[fx.Node], region: int) -> None:
    """Recompute ``nodes`` in backward, as recompute region ``region`` of this pass."""
    for node in nodes:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = ac_graph_id("reshard", region)


def _reshard_to_smaller_group(
    graph: fx.Graph, all_gather: fx.Node, backward: set[fx.Node], index: int, position: dict[fx.Node, int]
) -> None:
    """Backward gathers the group over its smaller group from a saved chunk (see the module's docstring)."""
    chain = copy_out_chain(all_gather)
    readers = chain_readers(chain)
    backward_readers = [reader for reader in readers if reader in backward]
    forward_readers = [reader for reader in readers if reader not in backward]
    recomputed = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
    if not backward_readers or not forward_readers or any(
        reader.meta.get("recompute") in recomputed for reader in forward_readers
    ):
        return  # an activation-checkpointed block gathers over the whole group to recompute anyway
    size, rank, group_name = group_annotation(all_gather).reshard_group
    numel = all_gather.meta["val"].numel() // size
    forward_users = list(all_gather.users)
    insert = NodeInserter(graph, all_gather.next, all_gather)
    chunk = insert(fsdp.post_forward_chunk.default, all_gather, size, rank)
    chunk.meta.pop("ac_graph_id", None)
    chunk.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    # Backward reads a second copy-out chain, from the chunks gathered over the smaller group.
    insert = NodeInserter(graph, min(backward_readers, key=position.__getitem__), all_gather)
    copies = {all_gather: insert(fsdp.all_gather_into.default, [chunk], [numel], size, group_name)}
    for node in sorted(chain[1:], key=position.__getitem__):
        with graph.inserting_before(insert.anchor):
            copies[node] = graph.node_copy(node, lambda argument: copies.get(argument, argument))
    _tag(list(copies.values()), 2 * index + 1)  # a region of its own, beside the first chain's
    for copy in copies.values():  # the default partitioner splits the joint graph where its forward tags end
        copy.meta["partitioner_tag"] = "is_backward"
    for node in chain:
        for user in list(node.users):
            if user in backward and user not in copies.values():
                user.replace_input_with(node, copies[node])
    # The partitioner saves only what the forward itself needs: the forward reads the
    # all-gather output with the chunk written back into it (the same values), so the
    # chunk is part of the forward and saved, not computed in backward from a gather
    # over the whole group.
    insert = NodeInserter(graph, chunk.next, all_gather)
    with_chunk = insert(aten.slice_scatter.default, all_gather, chunk, 0, rank * numel, (rank + 1) * numel)
    for user in forward_users:
        if user not in backward:
            user.replace_input_with(all_gather, with_chunk)
    # A forward node that read the parameters is saved for backward, not recomputed
    # there, which would gather over the whole group again.
    for reader in forward_readers:
        reader.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def reshard(graph: fx.Graph) -> int:
    """Tags every annotated ``fsdp.all_gather_into`` chain; returns how many groups it tagged.

    A chain whose gathered parameters are outputs of the graph (a graph break made
    them cross into the next graph) stays untagged: they are alive anyway, and an
    output cannot be recomputed.
    """
    (output,) = graph.find_nodes(op="output")
    outputs = set(output.all_input_nodes)
    backward = _backward_nodes(graph)
    position = {node: index for index, node in enumerate(graph.nodes)}
    tagged = 0
    # The gathers before any is added for a smaller group.
    for index, node in enumerate(list(graph.find_nodes(op="call_function", target=fsdp.all_gather_into.default))):
        annotation = group_annotation(node)
        if annotation is None:
            continue
        chain = unshard_nodes(node)
        if outputs.intersection(chain):
            continue
        if annotation.reshard_after_forward:
            _tag(chain, 2 * index)
            if annotation.reshard_group is not None:
                _reshard_to_smaller_group(graph, node, backward, index, position)
        else:
            for chain_node in chain:
                chain_node.meta.pop("recompute", None)
                chain_node.meta.pop("ac_graph_id", None)
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        tagged += 1
    return tagged
