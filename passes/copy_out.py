"""copy_out: gather a group's per-parameter copy-outs into one concatenation that Inductor emits as one kernel.

[Note: one copy-out per group]
The gathered buffer is rank-major; each parameter's padded tensor is a copy of a
strided chunk of it (``clone`` + ``_unsafe_view`` in the traced graph). Left alone,
Inductor fuses each parameter's clone into whichever kernel reads that parameter
first, so a group's copy-out is spread over as many kernels as it has parameters
(measured in the CPU code of the test Llama). This pass makes the clones feed one
``cat`` and every parameter a view of it: the clones then have a single reader,
Inductor inlines them into the concatenation, and the whole copy-out is one kernel
reading the buffer once. Eager execution of the graph (``aot_eager``) pays one
extra copy; Inductor pays none. New nodes inherit the clones' metadata, so the
partitioner recomputes or saves them with the rest of the chain.

The concatenation reads each clone, a ``[world_size, shard_numel]`` block, flattened:
element ``i`` comes from rank ``i // shard_numel``, an index Inductor's CPU backend
vectorizes. Flattening the parameter-shaped view instead nests a second floor/mod
pair (``1024 * (i // 1024) + i % 1024``) that sympy does not fold, and the copy
became a scalar loop with two integer divisions per element.
"""

from __future__ import annotations


import torch
import torch.fx as fx

from ._graph import NodeInserter, reorder_by_priority
from .patterns import all_gather_outputs, match_copy_out

aten = torch.ops.aten


def _parameter_copies(all_gather_output: fx.Node) -> tuple[fx.Node, ...] | None:
    """The ``view(clone(column))`` of each parameter, if the copy-out has the runtime's shape."""
    copy_out = match_copy_out(all_gather_output)
    if copy_out is None or copy_out.copies is None or len(copy_out.copies) < 2:
        return None
    if copy_out.split.target is not aten.split_with_sizes.default:
        return None
    if not all(copy.meta["val"].is_contiguous() for copy in copy_out.copies):
        return None  # a clone that kept the column's strides: not a flat copy to concatenate
    return copy_out.copies


def _fuse(graph: fx.Graph, copies: list[fx.Node]) -> None:
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
    """Rewrites every gathered group's copy-out into one ``cat``; returns how many groups it rewrote."""
    rewritten = 0
    for all_gather_output in all_gather_outputs(graph):
        copies = _parameter_copies(all_gather_output)
        if copies is not None:
            _fuse(graph, copies)
            rewritten += 1
    if rewritten:
        reorder_by_priority(graph, {})  # readers of the copies now read views placed after them
    return rewritten
