"""verify: check the invariants the other passes rely on, after any of them.

- the graph is well formed and topologically ordered (``Graph.lint``);
- every ``_c10d_functional`` collective (and each gloo collective that fills its
  first argument) is waited on exactly once, and only the wait reads it
  (``waited_node``), so nothing uses a collective's buffer before it is complete;
- no storage mutation is left (``fsdp.set_``, ``fsdp.resize_storage_``, ``aten.set_``,
  ``inductor.resize_storage_bytes_``);
- each group's all-gather outputs, unsharded gradients and reduction are in the
  dtypes of its mixed-precision policy ([Note: mixed-precision dtypes]);
- in a forward graph: no resharded group's gathered parameter is saved for backward
  (a post-forward chunk may be: [Note: resharding to a smaller group]).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from compile_shard._annotation import group_annotation
from compile_shard._collectives import node_collective

from ._graph import c10d, fsdp
from .patterns import all_gather_outputs, copy_out_chain, waited_node

_MUTATIONS = {
    fsdp.set_.default,
    fsdp.resize_storage_.default,
    torch.ops.aten.set_.source_Tensor,
    torch.ops.inductor.resize_storage_bytes_.default,
}


# [Note: mixed-precision dtypes]
# FSDP2's MixedPrecisionPolicy fixes three dtypes per group, and the passes must keep
# all three: the all-gather output, which the forward and the backward compute with,
# is in ``param_dtype``; the unsharded gradients autograd computes from it are in
# that dtype too, rounded there before the reduction casts them; the reduction (its
# input, its collective, the sharded gradient it produces) runs in ``reduce_dtype``.
# A rewrite that cast the gradient before its last op, or gathered before casting,
# would train with other numbers and at fp32's speed without a word. The runtime
# writes the three into the group annotation; the nodes that show them are the
# all-gathers (their outputs, or the buffers they fill), the ops that lay out the
# reduction input (the gradients in, the reduction dtype out) and, before ``lower``,
# ``fsdp.reduce_scatter_grad``.
_REDUCTION_INPUTS = {
    # op: (index of the gradients, index of the reduction buffer; None: the op's result)
    fsdp.reduce_scatter_input.default: (0, None),
    fsdp.reduce_scatter_input_into_.default: (1, 0),
    fsdp.all_to_all_grads_.default: (1, 0),
}


def _dtype(node) -> str | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return str(value.dtype) if isinstance(value, torch.Tensor) else None


def _wrong_dtypes(node: fx.Node) -> str | None:
    """What in ``node`` breaks its group's policy dtypes, or None."""
    annotation = group_annotation(node)
    if annotation is None or annotation.gradient_dtype is None:
        return None
    found = node_collective(node)
    if found is not None and found.kind == "all_gather":
        output_dtype = _dtype(waited_node(node))
        if output_dtype not in (None, *annotation.all_gather_dtypes):
            return f"all-gather output in {output_dtype}, the policy's {annotation.all_gather_dtypes}"
    if node.target is fsdp.reduce_scatter_grad.default and _dtype(node) != annotation.reduction_dtype:
        return f"reduction in {_dtype(node)}, the policy's {annotation.reduction_dtype}"
    if node.target in _REDUCTION_INPUTS:
        grads_index, buffer_index = _REDUCTION_INPUTS[node.target]
        grad_dtypes = {_dtype(grad) for grad in node.args[grads_index]} - {None}
        if grad_dtypes - {annotation.gradient_dtype}:
            return f"unsharded gradients in {sorted(grad_dtypes)}, the policy's {annotation.gradient_dtype}"
        buffer = node if buffer_index is None else node.args[buffer_index]
        if _dtype(buffer) not in (None, annotation.reduction_dtype):
            return f"reduction input in {_dtype(buffer)}, the policy's {annotation.reduction_dtype}"
    return None


class GraphInvariantError(AssertionError):
    """A pass produced a graph that breaks one of compile_shard's invariants."""


def verify(graph: fx.Graph, after: str | None = None) -> None:
    """Raises ``GraphInvariantError`` naming the first node that breaks an invariant.

    ``after`` names the pass that just ran, so the error blames the pass that broke
    the invariant rather than a later one that tripped over it.
    """
    blame = f"after {after}: " if after else ""
    try:
        graph.lint()
    except RuntimeError as error:
        raise GraphInvariantError(f"{blame}malformed graph: {error}") from error
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _MUTATIONS:
            raise GraphInvariantError(f"{blame}storage mutation left in the graph: {node.format_node()}")
        wrong_dtypes = _wrong_dtypes(node)
        if wrong_dtypes is not None:
            raise GraphInvariantError(
                f"{blame}group {group_annotation(node).name!r}: {wrong_dtypes} ({node.format_node()})"
            )
        found = node_collective(node)
        if found is not None and not found.synchronous:
            users = [user for user in waited_node(node).users if user is not node]
            waits = [user for user in users if user.target is c10d.wait_tensor.default]
            if len(waits) != 1 or len(users) != 1:
                raise GraphInvariantError(
                    f"{blame}collective {node.name} must be read by exactly one wait_tensor, got users "
                    f"{[user.name for user in users]}"
                )


def verify_forward(graph: fx.Graph) -> None:
    """``verify``, plus: the forward saves no gathered parameter of a resharded group."""
    verify(graph)
    (output,) = graph.find_nodes(op="output")
    outputs = set(output.all_input_nodes)
    for all_gather_output in all_gather_outputs(graph):
        annotation = group_annotation(all_gather_output)
        if not annotation.reshard_after_forward:
            continue
        saved = [
            chain_node.name
            for chain_node in copy_out_chain(all_gather_output)
            if chain_node in outputs and chain_node.meta.get("recompute") is not CheckpointPolicy.MUST_SAVE
        ]
        if saved:
            raise GraphInvariantError(
                f"group {annotation.name!r} reshards after forward, but the forward saves its "
                f"gathered parameters: {saved}"
            )
