"""unused_params: a parameter the forward left unused gets no gradient, FSDP2's default.

[Note: unused parameters]
FSDP2 reduces only the parameters whose unsharded gradient autograd computed; the
others keep their ``.grad`` (``None`` before the first step), so an optimizer such
as AdamW skips them instead of decaying them. ``set_reduce_scatter_unused_params(True)``
gives them a zero gradient instead (for ranks that use different parameters).

compile_shard reduces a group's gradients as one buffer laid out like its all-gather
output, so an unused parameter's part of the reduction input is zeros, not absent,
and the reduction gives it a zero gradient. Both paths then withhold that gradient:

- eager: each unsharded parameter records, with a tensor hook, whether backward
  reached it; the sharded gradient of one that was not reached is dropped
  (``FSDPParam.reduced_gradient_if_used``). That gradient is zero unless another rank
  used the parameter, which FSDP2 cannot reduce either: it raises there, naming the
  parameter and ``set_reduce_scatter_unused_params(True)``.
- compiled: autograd fills an unused parameter's part of the reduction input with a
  ``zeros`` node of the rank-major piece's shape (of the parameter's, in the
  ``fsdp.reduce_scatter_input`` of ``fsdp.as_gathered``'s backward, and of its
  ``fsdp.copy_out`` output, in a region's backward), which no used
  gradient is. This pass finds such pieces and returns ``None`` as that parameter's
  gradient, so AOTAutograd's backward gives it none. Ranks whose graphs use different parameters
  are not detected here: as in FSDP2, they need ``set_reduce_scatter_unused_params(True)``.

The zeros still travel in the reduce-scatter, where FSDP2 leaves them out: the bytes
differ, the values do not. A reduction that adds a gradient accumulated earlier
(without sync, or on HSDP without the all-reduce) is left alone, since an earlier
micro-batch may have used the parameter: one that no micro-batch used gets a zero
gradient there.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from compile_shard._annotation import group_annotation
from compile_shard._layout import padded_rows

from ._graph import VIEWS, c10d, cast_dtype, fsdp, invoke_subgraph, region_module

aten = torch.ops.aten
_ZEROS = (aten.zeros.default, aten.full.default)
# What lies between a reduce-scatter's output and the split into sharded gradients (beside
# the cast back to the shards' dtype): the post-division, and HSDP's all-reduce and its
# wait. Not an addition: HSDP's partial reduction, accumulated without the all-reduce,
# may hold a gradient for a parameter this backward left unused.
_ELEMENTWISE = (aten.div.Tensor, c10d.all_reduce.default, c10d.wait_tensor.default)


def _pieces(unsharded_grad: fx.Node) -> list[tuple[fx.Node, int]] | None:
    """Per parameter, the node a reduction input lays out and its numel per rank, or None.

    Autograd's spelling of the input (the ``[world_size, padded_numel]`` pieces a ``cat``
    joins), or ``fsdp.reduce_scatter_input`` of the unsharded gradients, as
    ``fsdp.as_gathered``'s backward and, inside a region, ``fsdp.copy_out``'s spell it.
    """
    node = unsharded_grad
    while node.op == "call_function" and (cast_dtype(node) is not None or node.target is aten.mul.Tensor):
        node = node.args[0]  # the mixed-precision cast, the pre-multiplication
    node = _region_output(node)
    if node.target is fsdp.reduce_scatter_input.default:
        gradients, world_size = node.args[:2]
        shapes = [gradient.meta["val"].shape for gradient in gradients]
        return [
            (gradient, padded_rows(shape[0], world_size) * shape[1:].numel())
            for gradient, shape in zip(gradients, shapes)
        ]
    if node.target not in VIEWS or node.meta["val"].dim() != 1:
        return None
    concatenated = node.args[0]
    if concatenated.target is not aten.cat.default or concatenated.args[1:] != (1,):
        return None
    pieces = concatenated.args[0]
    if any(piece.meta["val"].dim() != 2 for piece in pieces):
        return None
    return [(piece, piece.meta["val"].shape[1]) for piece in pieces]


def _region_output(node: fx.Node) -> fx.Node:
    """What a region's backward computes ``node`` as, where ``node`` is one of its outputs; else ``node``.

    A block whose region copies out its parameters ([Note: a region copies out its
    block's parameters] in compile_shard._regions._call) returns the gradient of its
    all-gather output, laid out by the copy-out's backward inside the region.
    """
    call = node.args[0] if node.target is operator.getitem else None
    if call is None or call.op != "call_function" or call.target is not invoke_subgraph:
        return node
    (output,) = region_module(call).graph.find_nodes(op="output")
    value = output.args[0][node.args[1]]
    return value if isinstance(value, fx.Node) else node


def _is_zeros(piece: fx.Node) -> bool:
    while piece.target in VIEWS:  # a custom op's backward gets its unused outputs' gradients as zeros
        piece = piece.args[0]
    if piece.target not in _ZEROS:
        return False
    return piece.target is aten.zeros.default or piece.args[1] == 0


def _sharded_grads_split(reduce_scatter: fx.Node) -> fx.Node | None:
    """The ``split_with_sizes`` that cuts the reduced gradient into the shards' gradients."""
    node = reduce_scatter
    while len(node.users) == 1:
        (user,) = node.users
        if user.target is aten.split_with_sizes.default:
            return user
        if user.target not in _ELEMENTWISE and cast_dtype(user) is None:
            return None
        node = user
    return None


def _one_piece_per_shard(pieces: list[tuple[fx.Node, int]], split: fx.Node) -> bool:
    """Whether piece ``i`` of the reduction input is what split ``i`` of its output reduces."""
    sizes = split.args[1]
    return len(pieces) == len(sizes) and all(
        isinstance(size, int) and numel == size for (_, numel), size in zip(pieces, sizes)
    )


def _graph_output_of(getitem: fx.Node, output: fx.Node) -> list[fx.Node] | None:
    """The chain from ``getitem`` to the graph output (slice, view, cast), each node read only by the next."""
    chain = [getitem]
    while True:
        users = list(chain[-1].users)
        if users == [output]:
            return chain
        if len(users) != 1:
            return None
        chain.append(users[0])


def unused_params(graph: fx.Graph) -> int:
    """Withholds the gradient of each parameter a group's forward left unused; returns how many."""
    output = graph.output_node()
    withheld = 0
    for reduce_scatter in graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_grad.default):
        annotation = group_annotation(reduce_scatter)
        if annotation is None or annotation.reduce_scatter_unused_params:
            continue
        pieces = _pieces(reduce_scatter.args[0])
        split = _sharded_grads_split(reduce_scatter)
        if pieces is None or split is None or not _one_piece_per_shard(pieces, split):
            continue
        for getitem in list(split.users):
            if getitem.target is not operator.getitem or not _is_zeros(pieces[getitem.args[1]][0]):
                continue
            chain = _graph_output_of(getitem, output)
            if chain is None:
                continue
            output.args = (_replaced(output.args[0], chain[-1]),)
            for node in reversed(chain):
                graph.erase_node(node)
            withheld += 1
    return withheld


def _replaced(outputs: list | tuple, gradient: fx.Node) -> list | tuple:
    return type(outputs)(None if value is gradient else value for value in outputs)
