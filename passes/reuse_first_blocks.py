"""reuse_first_blocks: the inlined first block of each reuse key calls the region its later blocks call.

[Note: the first block calls its region after Dynamo]
Dynamo traces the first block of each reuse key inlined ([Note: the first block of
each key runs inlined] in ``compile_shard._regions._first_block``): what it reads, writes and
returns decides whether the later blocks may share one region body, and a graph break
in it splits the graph where it would without regions. Past Dynamo that block is only
a copy of the body's computation that Inductor lowers, fuses and compiles apart from
the body: a block's kernels of its own in the forward and the backward, and another
schedule for its backward. This pass runs on Dynamo's graph, before AOTAutograd
(Inductor's pre-grad hook), and replaces that copy by a call of the body the later
blocks call, with the block's own arguments: its all-gather outputs or unsharded
parameters, its activations and plain values, as recorded while Dynamo traced it
([Note: what the trace records for reuse_first_blocks] in ``compile_shard._annotation``).

It is the same computation, as the later blocks' calls are: equal keys mean the same
signature, the same plain attributes read and the same argument metadata. The pass
leaves a block inlined where the swap could change what the graph computes: a node
of the block read by anything but through the block's outputs (a parameter the root
reads again), a write in place inside it, an output that is not the block's own
node, or an input the body lifted itself that the later calls do not all pass alike
(a buffer of each block). Without a later block of its key there is no body to call
(Dynamo also inlines a region only one block calls, so two like blocks keep none).
Backends without Inductor's hook (``aot_eager``) keep the block inlined.

Called from the region, the block's backward returns its weight and input gradients
together, so its reduce-scatter loses the overlap with its own input gradient that
the inlined block gives it ([Note: the first block of each key runs inlined]). So the
suite runs the pass by default only where the cost profile overlaps no communication
with compute (``install.reuses_first_blocks``), and ``settings.reuse_first_blocks``
decides elsewhere.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from compile_shard._annotation import InlinedFirstBlock, inlined_first_blocks, region_body

invoke_subgraph = torch.ops.higher_order.invoke_subgraph
_IN_PLACE_OPERATORS = {
    getattr(operator, name)
    for name in ("iadd", "iand", "ifloordiv", "ilshift", "imatmul", "imod", "imul", "ior", "ipow", "irshift",
                 "isub", "itruediv", "ixor")
}  # fmt: skip


def _writes_in_place(node: fx.Node) -> bool:
    """Whether a node of Dynamo's graph writes to a tensor: an in-place method, operator or op."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("_")
    if node.op != "call_function":
        return False
    if node.target in _IN_PLACE_OPERATORS:
        return True
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable
    name = getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.startswith("_")


def _operands(block: InlinedFirstBlock, traced_leaves: list, calls: list[fx.Node], own: set[fx.Node]) -> list | None:
    """What the block passes in place of each operand of the first call, the one the body was traced for;
    None where one cannot be told. ``traced_leaves``: ``region_body``'s nodes."""
    operands = []
    for position, passed in enumerate(calls[0].args[2:]):
        leaves = [leaf for leaf, node in enumerate(traced_leaves) if node is passed]
        if leaves:  # an argument leaf: the block's own; one node for each leaf the traced call passed it for
            candidates = {block.inputs[leaf] for leaf in leaves}
            if len(candidates) != 1:
                return None
            (operand,) = candidates
        else:  # an input the body lifted itself: only one every call passes alike
            alike = {call.args[2 + position] for call in calls}
            if len(calls) < 2 or len(alike) != 1:
                return None
            (operand,) = alike
        if not isinstance(operand, fx.Node) or operand in own:
            return None
        operands.append(operand)
    return operands


def _replaceable(graph: fx.Graph, block: InlinedFirstBlock, operands: list[fx.Node], num_outputs: int) -> bool:
    """Whether the block's nodes can all go for a call taking ``operands`` and returning ``num_outputs``."""
    alive = set(graph.nodes)
    own = set(block.nodes)
    outputs = set(block.outputs)
    if not own <= alive or not outputs <= own or len(block.outputs) != num_outputs:
        return False
    position = {node: index for index, node in enumerate(graph.nodes)}
    first = min(position[node] for node in block.nodes)
    if any(position[operand] > first for operand in operands):
        return False
    for node in block.nodes:
        if _writes_in_place(node):
            return False
        if node not in outputs and any(user not in own for user in node.users):
            return False
    return True


def _reuse(graph: fx.Graph, block: InlinedFirstBlock, calls: list[fx.Node]) -> bool:
    """Replaces ``block``'s nodes by a call of the body ``calls`` call; False where it cannot (see the note)."""
    body_attribute = calls[0].args[0]
    body = getattr(graph.owning_module, body_attribute.target)
    own = set(block.nodes)
    _, traced_leaves = region_body(body.graph)
    operands = _operands(block, traced_leaves, calls, own)
    (body_output,) = body.graph.find_nodes(op="output")
    if operands is None or not _replaceable(graph, block, operands, len(body_output.args[0])):
        return False
    with graph.inserting_after(block.nodes[-1]):
        attribute = graph.get_attr(body_attribute.target)
    with graph.inserting_after(attribute):
        call = graph.call_function(invoke_subgraph, (attribute, calls[0].args[1], *operands))
    call.meta.update(calls[0].meta)
    last = call
    for index, output in enumerate(block.outputs):
        with graph.inserting_after(last):
            last = graph.call_function(operator.getitem, (call, index))
        last.meta.update(output.meta)
        output.replace_all_uses_with(last, delete_user_cb=lambda user: user not in own)
    for node in reversed(block.nodes):
        graph.erase_node(node)
    return True


def reuse_first_blocks(graph: fx.Graph) -> int:
    """Makes each inlined first block call its key's region body; returns how many it replaced."""
    blocks = inlined_first_blocks(graph)
    if not blocks:
        return 0
    calls_by_key: dict[int, list[fx.Node]] = {}
    for call in graph.find_nodes(op="call_function", target=invoke_subgraph):
        body = getattr(graph.owning_module, call.args[0].target, None)
        recorded = region_body(body.graph) if isinstance(body, fx.GraphModule) else None
        if recorded is not None:
            calls_by_key.setdefault(recorded[0], []).append(call)
    replaced = sum(_reuse(graph, block, calls_by_key[block.key]) for block in blocks if block.key in calls_by_key)
    if replaced:
        graph.lint()
    return replaced
