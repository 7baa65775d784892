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

import operator

import torch
import torch.fx as fx

from ._graph import NodeInserter, reorder_by_priority
from .place import gathered_nodes

aten = torch.ops.aten
# Traces spell the view after a copy ``_unsafe_view``; Inductor's decompositions, ``view``.
_VIEWS = (aten._unsafe_view.default, aten.view.default)


def _parameter_copies(gathered: fx.Node) -> list[fx.Node] | None:
    """The ``view(clone(chunk))`` of each parameter, if the copy-out has the runtime's shape."""
    views = [user for user in gathered.users if user.target is aten.view.default]
    if len(views) != 1 or len(views[0].users) != 1:
        return None
    (split,) = views[0].users
    if split.target is not aten.split_with_sizes.default:
        return None
    copies = []
    for getitem in split.users:
        users = list(getitem.users)
        if getitem.target is not operator.getitem or len(users) != 1 or users[0].target is not aten.clone.default:
            return None
        views_of_clone = list(users[0].users)
        if len(views_of_clone) != 1 or views_of_clone[0].target not in _VIEWS:
            return None
        if not views_of_clone[0].meta["val"].is_contiguous():
            return None  # a clone that kept the chunk's strides: not a flat copy to concatenate
        copies.append(views_of_clone[0])
    return copies if len(copies) > 1 else None


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
    for gathered in gathered_nodes(graph):
        copies = _parameter_copies(gathered)
        if copies is not None:
            _fuse(graph, copies)
            rewritten += 1
    if rewritten:
        reorder_by_priority(graph, {})  # readers of the copies now read views placed after them
    return rewritten
