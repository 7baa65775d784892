"""copy_out: make each group's per-parameter copy-out one ``fsdp.copy_out``, or on gloo one concatenation.

[Note: one copy-out per group]
The gathered buffer is rank-major; each parameter's padded tensor is a copy of a
strided chunk of it (``clone`` + ``_unsafe_view`` in the traced graph). Left alone,
Inductor fuses each parameter's clone into whichever kernel reads that parameter
first, so a group's copy-out is spread over as many kernels as it has parameters
(measured in the CPU code of the test Llama), each a variant Inductor generates and
compiles. This pass makes the copies one ``fsdp.copy_out`` (FSDP2's
``split_with_sizes_copy``; the op a region copies out with, [Note: a region copies
out its block's parameters] in ``compile_shard._regions._call``), which Inductor calls as a
fixed kernel and fuses with nothing, and every parameter a view of one of its outputs.
New nodes inherit the clones' metadata, so the partitioner recomputes or saves them
with the rest of the chain.

On gloo, ``gather_buffers`` replaces a group's copy-in, all-gather and copy-out by one
exchange straight into the parameters' rows ([Note: gloo exchange in place] in
``compile_shard.ops.transport``), and reads the copy-out as one concatenation: there
the clones feed one ``cat`` and every parameter is a view of it. The concatenation
reads each clone, a ``[world_size, shard_numel]`` block, flattened: element ``i``
comes from rank ``i // shard_numel``, an index Inductor's CPU backend vectorizes.
Flattening the parameter-shaped view instead nests a second floor/mod pair
(``1024 * (i // 1024) + i % 1024``) that sympy does not fold, and the copy became a
scalar loop with two integer divisions per element.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from compile_shard.ops import gathers_by_send_recv

from ._graph import NodeInserter, fsdp, reorder_by_priority
from .patterns import CopyOut, all_gather_outputs, match_copy_out

aten = torch.ops.aten


def _parameter_copies(all_gather_output: fx.Node) -> CopyOut | None:
    """The copy-out, if it has the runtime's shape: a ``view(clone(column))`` per parameter."""
    copy_out = match_copy_out(all_gather_output)
    if copy_out is None or copy_out.copies is None or len(copy_out.copies) < 2:
        return None
    if copy_out.split.target is not aten.split_with_sizes.default:
        return None
    if not all(copy.meta["val"].is_contiguous() for copy in copy_out.copies):
        return None  # a clone that kept the column's strides: not a flat copy to concatenate
    return copy_out


def _exchanged_in_place(all_gather_output: fx.Node) -> bool:
    """Whether ``gather_buffers`` may exchange the group in place: a gloo group (see the note above)."""
    if all_gather_output.target is fsdp.all_gather_into.default:
        group_name = all_gather_output.args[3]
    else:
        group_name = all_gather_output.args[0].args[2]  # the wait's collective: (input, world_size, group_name)
    return gathers_by_send_recv(group_name, all_gather_output.meta["val"].device)


def _as_one_op(graph: fx.Graph, all_gather_output: fx.Node, copy_out: CopyOut) -> bool:
    """Replaces the copies by one ``fsdp.copy_out``; False where its sizes are symbolic or a copy changes dtype."""
    world_size, _ = copy_out.rank_major.meta["val"].shape
    padded_numels = list(copy_out.split.args[1])
    if not all(is_concrete_int(size) for size in (world_size, *padded_numels)):
        return False
    if any(copy.meta["val"].dtype != all_gather_output.meta["val"].dtype for copy in copy_out.copies):
        return False
    clones = [copy.args[0] for copy in copy_out.copies]
    insert = NodeInserter(graph, copy_out.rank_major, clones[0])
    copied = insert(fsdp.copy_out.default, all_gather_output, int(world_size), [int(n) for n in padded_numels])
    for column, copy in zip(copy_out.columns, copy_out.copies):  # a column nobody reads has no ``getitem``
        flat = insert(operator.getitem, copied, column.args[1])
        copy.replace_all_uses_with(insert(aten.view.default, flat, list(copy.meta["val"].shape)))
    for node in (*copy_out.copies, *clones, *copy_out.columns, copy_out.split, copy_out.rank_major):
        graph.erase_node(node)
    return True


def _concatenate(graph: fx.Graph, copies: tuple[fx.Node, ...]) -> None:
    position = {node: index for index, node in enumerate(graph.nodes)}
    anchor = max(copies, key=position.__getitem__).next
    insert = NodeInserter(graph, anchor, copies[0].args[0])
    # Flatten the clone, not the parameter-shaped view of it: see [Note: one copy-out per group].
    flat = [insert(aten.view.default, copy.args[0], [-1]) for copy in copies]
    concatenated = insert(aten.cat.default, flat)
    offset = 0
    for copy in copies:
        numel = copy.meta["val"].numel()
        piece = insert(aten.slice.Tensor, concatenated, 0, offset, offset + numel)
        parameter = insert(aten.view.default, piece, list(copy.meta["val"].shape))
        copy.replace_all_uses_with(parameter)
        graph.erase_node(copy)
        offset += numel


def copy_out(graph: fx.Graph) -> int:
    """Rewrites every gathered group's copy-out into one op (on gloo one ``cat``); returns how many groups it
    rewrote."""
    rewritten = concatenated = 0
    for all_gather_output in all_gather_outputs(graph):
        parameter_copies = _parameter_copies(all_gather_output)
        if parameter_copies is None:
            continue
        if _exchanged_in_place(all_gather_output) or not _as_one_op(graph, all_gather_output, parameter_copies):
            _concatenate(graph, parameter_copies.copies)
            concatenated += 1
        rewritten += 1
    if concatenated:
        reorder_by_priority(graph, {})  # readers of the copies now read views placed after them
    return rewritten
