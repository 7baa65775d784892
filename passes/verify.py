"""verify: check the invariants the other passes rely on, after any of them.

- the graph is well formed and topologically ordered (``Graph.lint``);
- every ``_c10d_functional`` collective (and each gloo collective that fills its
  first argument) is waited on exactly once, and only the wait reads it
  (``waited_node``), so nothing uses a collective's buffer before it is complete;
- no storage mutation is left (``fsdp.set_``, ``fsdp.resize_storage_``, ``aten.set_``,
  ``inductor.resize_storage_bytes_``);
- in a forward graph: no resharded group's gathered parameter is saved for backward.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ._graph import c10d, fsdp, group_annotation, waited_node
from .place import gathered_nodes
from .reshard import copy_out_chain

_COLLECTIVES = {
    c10d.all_gather_into_tensor.default,
    c10d.all_gather_into_tensor_out.default,
    fsdp.all_gather_send_recv_.default,
    fsdp.all_gather_params_.default,
    fsdp.all_to_all_into_.default,
    fsdp.all_to_all_grads_.default,
    c10d.reduce_scatter_tensor.default,
    c10d.all_reduce.default,
    c10d.all_to_all_single.default,
}
_MUTATIONS = {
    fsdp.set_.default,
    fsdp.resize_storage_.default,
    torch.ops.aten.set_.source_Tensor,
    torch.ops.inductor.resize_storage_bytes_.default,
}


class GraphInvariantError(AssertionError):
    """A pass produced a graph that breaks one of compile_shard's invariants."""


def verify(graph: fx.Graph) -> None:
    """Raises ``GraphInvariantError`` naming the first node that breaks an invariant."""
    try:
        graph.lint()
    except RuntimeError as error:
        raise GraphInvariantError(f"malformed graph: {error}") from error
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _MUTATIONS:
            raise GraphInvariantError(f"storage mutation left in the graph: {node.format_node()}")
        if node.target in _COLLECTIVES:
            users = [user for user in waited_node(node).users if user is not node]
            waits = [user for user in users if user.target is c10d.wait_tensor.default]
            if len(waits) != 1 or len(users) != 1:
                raise GraphInvariantError(
                    f"collective {node.name} must be read by exactly one wait_tensor, got users "
                    f"{[user.name for user in users]}"
                )


def verify_forward(graph: fx.Graph) -> None:
    """``verify``, plus: the forward saves no gathered parameter of a resharded group."""
    verify(graph)
    (output,) = graph.find_nodes(op="output")
    outputs = set(output.all_input_nodes)
    for gathered in gathered_nodes(graph):
        annotation = group_annotation(gathered)
        if not annotation["reshard_after_forward"]:
            continue
        saved = [chain_node.name for chain_node in copy_out_chain(gathered) if chain_node in outputs]
        if saved:
            raise GraphInvariantError(
                f"group {annotation['group']!r} reshards after forward, but the forward saves its "
                f"gathered parameters: {saved}"
            )
