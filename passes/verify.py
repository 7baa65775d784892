"""verify: check the invariants the other passes rely on, after any of them.

- the graph is well formed and topologically ordered (``Graph.lint``);
- every ``_c10d_functional`` collective (and each gloo collective that fills its
  first argument) is waited on exactly once, and only the wait reads it
  (``waited_node``), so nothing uses a collective's buffer before it is complete;
- no storage mutation is left (``fsdp.set_``, ``fsdp.resize_storage_``, ``aten.set_``,
  ``inductor.resize_storage_bytes_``);
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
