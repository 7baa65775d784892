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
reads the argument. Where it is a view of a parameter argument (the region marks the
views through which it reads its parameters, ``annotating_region_params``), it reads a
copy of that view chain, made in the outer graph from the argument. Either way the
backward region reads the outer graph's copy-out chain, which ``reshard`` tags for
recompute, so backward gathers again. The region still returns the view, which nothing
reads. This happens after the region's partition, so it holds for every backend's
partitioner, with no tag inside the region.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from compile_shard._annotation import is_region_param_view

from ._graph import invoke_subgraph, region_module
from .patterns import copy_out_chain


def _is_backward(node: fx.Node) -> bool:
    return node.meta.get("partitioner_tag") == "is_backward"


def region_parameter_views(graph: fx.Graph) -> list[fx.Node]:
    """The annotated views through which a region's forward reads its unsharded parameter arguments.

    AOTAutograd copies the annotation onto the backward nodes made from each view
    (the gradient's reshape); those are left out.
    """
    return [
        node
        for node in graph.nodes
        if is_region_param_view(node) and not _is_backward(node)
    ]


def _parameter_view_outputs(region: fx.GraphModule) -> set[int]:
    """The output indices where a forward region returns a view of a parameter argument (or its chain)."""
    (output,) = region.graph.find_nodes(op="output")
    chains = {node for view in region_parameter_views(region.graph) for node in copy_out_chain(view)}
    return {index for index, value in enumerate(output.args[0]) if value in chains}


def _copy_into(graph: fx.Graph, value: fx.Node, operands: dict[fx.Node, fx.Node], before: fx.Node) -> fx.Node:
    """Copies what ``value`` is computed from in its region into ``graph`` before ``before``; returns its copy.

    ``operands`` maps the region's placeholders to the outer graph's arguments.
    """
    needed: set[fx.Node] = set()
    frontier = [value]
    while frontier:
        node = frontier.pop()
        if node not in needed and node not in operands:
            needed.add(node)
            frontier.extend(node.all_input_nodes)
    copies = dict(operands)
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
    regions: dict[str, tuple[list[fx.Node], tuple, set[int]]] = {}
    for region_call in graph.find_nodes(op="call_function", target=invoke_subgraph):
        if _is_backward(region_call):
            continue
        name = region_call.args[1]
        if name not in regions:  # every block calls the same region: inspect it once
            region = region_module(region_call)
            (output,) = region.graph.find_nodes(op="output")
            placeholders = list(region.graph.find_nodes(op="placeholder"))
            regions[name] = (placeholders, output.args[0], _parameter_view_outputs(region))
        placeholders, outputs, view_outputs = regions[name]
        operands = region_call.args[2:]
        for user in list(region_call.users):
            if user.target is not operator.getitem or not user.users:
                continue
            index = user.args[1]
            if outputs[index] in placeholders:
                replacement = operands[placeholders.index(outputs[index])]
            elif index in view_outputs:
                replacement = _copy_into(graph, outputs[index], dict(zip(placeholders, operands)), user)
            else:
                continue
            moved += len(user.users)
            user.replace_all_uses_with(replacement)
    return moved
