"""compile_regions: keep a sharded block's compile region from saving its unsharded parameters for backward.

[Note: region parameters are saved as inputs]
With ``settings.compile_regions`` each block's compute is one ``invoke_subgraph``
whose arguments include the block's unsharded parameters (see [Note: sharded blocks
as nested compile regions]). AOTAutograd partitions the region's own joint graph
before the outer one, and its partitioner saves the parameters, or views of them (the
transposes its matmuls read), as extra outputs of the forward region. An output of a
region cannot be recomputed by the outer partitioner, so every block's gathered
parameters would stay alive until backward: FSDP's memory gone.

This pass (in the suite, on the outer joint graph) points the backward region at what
the forward region computes such an output from. Where the output is an argument, it
reads the argument. Where it is a view of an unsharded parameter argument (a chain of
single-input view and copy ops, ``patterns.copy_out_chain``, from the argument), it
reads a copy of that chain, made in the outer graph from the argument. A region that
copies out its block's parameters ([Note: a region copies out its block's parameters]
in compile_shard._regions._call) takes the all-gather output and returns it, or views of
the parameters it copied out, the chain starting at that argument. Either way the
backward region reads the outer graph's copy-out chain, which ``reshard`` tags for
recompute, so backward gathers again. The region still returns the view, which nothing
reads. The pass runs after the region's partition and after whatever joint-graph
passes the backend ran on the region (Inductor's drop no-op views), so it recognises the
chain by its shape alone, and holds for every backend's partitioner.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from compile_shard._annotation import group_annotation

from ._graph import fsdp, invoke_subgraph, region_module
from .patterns import copy_out_chain, unshard_nodes


def _is_backward(node: fx.Node) -> bool:
    return node.meta.get("partitioner_tag") == "is_backward"


def _unsharded_parameters(graph: fx.Graph) -> set[fx.Node]:
    """Every node of every group's unshard: the all-gathers, their copy-outs and the unsharded parameters."""
    return {
        node
        for all_gather in graph.find_nodes(op="call_function", target=fsdp.all_gather_into.default)
        if group_annotation(all_gather) is not None
        for node in unshard_nodes(all_gather)
    }


def _argument_views(region: fx.GraphModule) -> dict[int, int]:
    """Output index -> argument index where a forward region returns a view (or copy chain) of that argument."""
    (output,) = region.graph.find_nodes(op="output")
    chains = {
        node: index
        for index, placeholder in enumerate(region.graph.find_nodes(op="placeholder"))
        for node in copy_out_chain(placeholder)[1:]
    }
    return {index: chains[value] for index, value in enumerate(output.args[0]) if value in chains}


def _copy_into(graph: fx.Graph, value: fx.Node, copies: dict[fx.Node, fx.Node], before: fx.Node) -> fx.Node:
    """Copies what ``value`` is computed from in its region into ``graph`` before ``before``; returns its copy.

    ``copies`` maps the region's nodes to the outer graph's: its placeholders to the
    call's arguments, and what an earlier output of the same call copied already (a
    region's ``fsdp.copy_out`` of the parameters, copied once for all of them); it
    gains this output's copies.
    """
    needed: set[fx.Node] = set()
    frontier = [value]
    while frontier:
        node = frontier.pop()
        if node not in needed and node not in copies:
            needed.add(node)
            frontier.extend(node.all_input_nodes)
    for node in value.graph.nodes:  # in the region's order: producers first
        if node in needed:
            with graph.inserting_before(before):
                copies[node] = graph.node_copy(node, copies.__getitem__)
            for key in ("recompute", "ac_graph_id", "custom", "partitioner_tag"):
                copies[node].meta.pop(key, None)
    return copies[value]


def compile_regions(graph: fx.Graph) -> int:
    """Reads a forward region's argument, or a copy of its view chain, where the region returns either.

    Returns how many uses moved.
    """
    moved = 0
    unsharded = _unsharded_parameters(graph)
    regions: dict[str, tuple[list[fx.Node], tuple, dict[int, int]]] = {}
    for region_call in graph.find_nodes(op="call_function", target=invoke_subgraph):
        if _is_backward(region_call):
            continue
        name = region_call.args[1]
        if name not in regions:  # every block calls the same region: inspect it once
            region = region_module(region_call)
            (output,) = region.graph.find_nodes(op="output")
            placeholders = list(region.graph.find_nodes(op="placeholder"))
            regions[name] = (placeholders, output.args[0], _argument_views(region))
        placeholders, outputs, argument_views = regions[name]
        operands = region_call.args[2:]
        copies = dict(zip(placeholders, operands))
        anchor = region_call.next  # every copy before the call's first reader, producers first
        for user in list(region_call.users):
            if user.target is not operator.getitem or not user.users:
                continue
            index = user.args[1]
            if outputs[index] in placeholders:
                replacement = operands[placeholders.index(outputs[index])]
            elif index in argument_views and operands[argument_views[index]] in unsharded:
                replacement = _copy_into(graph, outputs[index], copies, anchor)
            else:
                continue
            moved += len(user.users)
            user.replace_all_uses_with(replacement)
    return moved
