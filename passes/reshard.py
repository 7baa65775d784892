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

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from compile_shard._annotation import group_annotation

from ._graph import ac_graph_id, fsdp
from .patterns import all_gather_chain

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
        if annotation.reshard_after_forward:
            for chain_node in chain:
                chain_node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                chain_node.meta["ac_graph_id"] = ac_graph_id("reshard", index)
        else:
            for chain_node in chain:
                chain_node.meta.pop("recompute", None)
                chain_node.meta.pop("ac_graph_id", None)
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        tagged += 1
    return tagged
