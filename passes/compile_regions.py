"""compile_regions: keep a sharded block's compile region from saving its unsharded parameters for backward.

[Note: region parameters are saved as inputs]
With ``settings.compile_regions`` each block's compute is one ``invoke_subgraph``
whose arguments include the block's unsharded parameters (see [Note: sharded blocks
as nested compile regions]). AOTAutograd partitions the region's own joint graph
before the outer one, and left alone its min-cut saves views of the parameters
(the transposes its matmuls read) as extra outputs of the forward region. An output
of a region cannot be recomputed by the outer partitioner, so every block's gathered
parameters would stay alive until backward: FSDP's memory gone.

Two steps restore resharding:

- ``tag_region_parameters`` (Inductor's joint pre-pass, which also runs on each
  region's joint graph before its partition) tags the views through which the region
  reads its parameter arguments, and everything computed from them alone,
  ``MUST_RECOMPUTE``: the region then saves the parameter arguments themselves.
- ``compile_regions`` (in the suite, on the outer joint graph) points the
  backward region at the forward region's *argument* wherever the forward region
  merely returns an argument for it. The saved parameter is then the outer graph's
  all-gather chain, which ``reshard`` tags for recompute, and backward gathers again.

Backends without Inductor's joint pre-pass (``aot_eager``) skip the first step;
``compile_regions`` then finds a saved parameter view and raises instead of
keeping every block gathered. A custom AOT backend takes the first step by wrapping
its partitioner: ``aot_autograd(..., partition_fn=with_region_tags(partition_fn))``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from compile_shard._annotation import is_region_param_view

from ._graph import ac_graph_id, invoke_subgraph, region_module
from .patterns import copy_out_chain
from .verify import GraphInvariantError


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


def tag_region_parameters(graph: fx.Graph) -> int:
    """Tags each parameter view's chain ``MUST_RECOMPUTE`` in a region's joint graph; returns how many views."""
    views = region_parameter_views(graph)
    for view in views:
        for node in copy_out_chain(view):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = ac_graph_id("compile_regions")
    return len(views)


def with_region_tags(partition_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``partition_fn`` preceded by ``tag_region_parameters``, as Inductor's partitioner runs it."""

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        tag_region_parameters(joint.graph)
        return partition_fn(joint, joint_inputs, **kwargs)

    return partition


def _saved_parameter_views(region: fx.GraphModule) -> dict[int, str]:
    """Output index -> name of the parameter view a forward region returns there."""
    (output,) = region.graph.find_nodes(op="output")
    chains = {node: view for view in region_parameter_views(region.graph) for node in copy_out_chain(view)}
    return {index: chains[value].format_node() for index, value in enumerate(output.args[0]) if value in chains}


def compile_regions(graph: fx.Graph) -> int:
    """Points readers of a forward region's output at the region's argument where the output is that argument.

    Returns how many uses moved.

    Raises ``GraphInvariantError`` when a region still returns a view of a parameter
    argument that the graph uses (its partition was not tagged).
    """
    moved = 0
    regions: dict[str, tuple[list[fx.Node], tuple, dict[int, str]]] = {}
    for region_call in graph.find_nodes(op="call_function", target=invoke_subgraph):
        if _is_backward(region_call):
            continue
        name = region_call.args[1]
        if name not in regions:  # every block calls the same region: inspect it once
            region = region_module(region_call)
            (output,) = region.graph.find_nodes(op="output")
            placeholders = list(region.graph.find_nodes(op="placeholder"))
            regions[name] = (placeholders, output.args[0], _saved_parameter_views(region))
        placeholders, outputs, saved_views = regions[name]
        operands = region_call.args[2:]
        for user in list(region_call.users):
            if user.target is not operator.getitem or not user.users:
                continue
            index = user.args[1]
            if outputs[index] in placeholders:
                moved += len(user.users)
                user.replace_all_uses_with(operands[placeholders.index(outputs[index])])
            elif index in saved_views:
                raise GraphInvariantError(
                    f"compile region {name!r} saves a view of its unsharded parameter for "
                    f"backward ({saved_views[index]}), which keeps every block's gathered parameters alive. "
                    "Compile with the Inductor backend (its joint pre-pass marks the region's parameters), wrap "
                    "a custom AOT backend's partitioner in compile_shard.passes.compile_regions.with_region_tags, or set "
                    "compile_shard.passes.settings.compile_regions = False"
                )
    return moved
