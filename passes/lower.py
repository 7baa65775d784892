"""lower: replace ``fsdp`` collectives with ``_c10d_functional`` collectives, ``wait_tensor`` and explicit copy-in.

Inductor buckets, reorders and overlaps only its own collective IR; an ``fsdp`` custom
op would reach it as an opaque synchronous fallback. After this pass the collectives are
the ones Inductor understands, averaging in the collective as FSDP2 does. The copy-in
(flatten, cast, pad, concatenate) becomes one ``fsdp.copy_in``, which Inductor does not
fuse on purpose ([Note: the copy-in as one op] in ``compile_shard.ops.all_gather``); a
group of one shard that needs no cast or padding all-gathers the shard's flat view. A
reduction's input, which autograd built from the gradients as padding, views and a
``cat``, becomes one ``fsdp.reduce_scatter_input`` instead, which Inductor does not fuse
on purpose ([Note: one reduction input per group] in ``compile_shard.ops``). On gloo a
gradient reduction becomes an all-to-all and ``fsdp.sum_shards``, which sums and
averages ([Note: gloo reduce-scatter] in ``compile_shard.ops``), and a float8 all-gather
travels as ``uint8`` views (``gathers_as_bytes``). A group with a custom all-gather or
reduce-scatter gets ``fsdp.all_gather_with_comm`` or ``fsdp.reduce_scatter_with_comm``
and a wait instead of the c10d collective ([Note: custom collectives] in
``compile_shard.ops.all_gather``). Every new node inherits the replaced node's metadata
(group annotation, recompute tags), so the partitioner treats the lowered chain exactly
as the ``fsdp`` node it replaces.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils.checkpoint import CheckpointPolicy

from compile_shard._layout import padded_rows
from compile_shard.ops import gathers_as_bytes, reduces_by_all_to_all

from ._graph import VIEWS, NodeInserter, c10d, cast_dtype, fsdp, op_argument
from .patterns import gathers_saved_chunks

aten = torch.ops.aten


def _lower_all_gather(graph: fx.Graph, node: fx.Node) -> None:
    shards, padded_numels, world_size, group_name = node.args[:4]
    param_dtype = op_argument(node, "param_dtype")
    insert = NodeInserter(graph, node, node)
    if _copies_nothing(shards, padded_numels, param_dtype):
        all_gather_input = insert(aten.reshape.default, shards[0], [-1])
    else:  # [Note: the copy-in as one op] in compile_shard.ops.all_gather
        all_gather_input = insert(fsdp.copy_in.default, list(shards), list(padded_numels), param_dtype)
    inserted = [all_gather_input]
    comm = op_argument(node, "all_gather_comm")
    if comm is not None:  # [Note: custom collectives] in compile_shard.ops.all_gather
        inserted.append(insert(fsdp.all_gather_with_comm.default, all_gather_input, world_size, group_name, comm))
        gathered = insert(c10d.wait_tensor.default, inserted[-1])
    elif world_size == 1:  # [Note: a group of one rank] in compile_shard.ops
        gathered = all_gather_input
    else:
        dtype = all_gather_input.meta["val"].dtype
        as_bytes = gathers_as_bytes(dtype, group_name, all_gather_input.meta["val"].device)
        wire = insert(aten.view.dtype, all_gather_input, torch.uint8) if as_bytes else all_gather_input
        inserted.append(insert(c10d.all_gather_into_tensor.default, wire, world_size, group_name))
        gathered = insert(c10d.wait_tensor.default, inserted[-1])
        if as_bytes:
            inserted += [wire, gathered]
            gathered = insert(aten.view.dtype, gathered, dtype)
    if node.meta.get("recompute") is CheckpointPolicy.MUST_SAVE:
        # Save the gathered parameters only, not the copy-in buffers or the un-waited collective.
        for copy_in_node in inserted:
            if copy_in_node is not gathered:
                copy_in_node.meta.pop("recompute", None)
    node.replace_all_uses_with(gathered)
    graph.erase_node(node)


def _copies_nothing(shards: list[fx.Node], padded_numels: list, param_dtype: torch.dtype | None) -> bool:
    """One shard that needs no cast and no padding: its flat view is the all-gather input."""
    if len(shards) != 1 or isinstance(padded_numels[0], fx.Node):
        return False
    shard = shards[0].meta["val"]
    numel = shard.numel()
    return param_dtype in (None, shard.dtype) and is_concrete_int(numel) and int(numel) == padded_numels[0]


_PADDING = (aten.slice_backward.default, aten.slice_scatter.default, aten.full.default, aten.cat.default)


def _unpadded(gradient: fx.Node) -> fx.Node | None:
    """What a zero padding of dim 0's tail adds rows to, or None if ``gradient`` is no such padding.

    Autograd pads with ``slice_backward``; Inductor's decompositions (applied while
    AOTAutograd traces) turn that into ``slice_scatter`` of the gradient into zeros.
    """
    if gradient.target is aten.slice_backward.default:
        sliced, _, dim, start, end, step = gradient.args
    elif gradient.target is aten.slice_scatter.default:
        zeros, sliced, *rest = gradient.args
        dim, start, end, step = (*rest, *(0, None, None, 1)[len(rest) :])
        if zeros.target is not aten.full.default or zeros.args[1] != 0:
            return None
    else:
        return None
    if (dim, start, step) != (0, 0, 1) or end is None or end < sliced.meta["val"].size(0):
        return None
    return sliced


def _padded_gradient(piece: fx.Node, world_size: int) -> fx.Node | None:
    """The gradient behind one ``[world_size, padded_numel]`` piece of a reduction input, if it is one.

    Autograd pads a gradient to the gathered parameter's padded rows (none when the
    rows divide evenly, see ``_unpadded``) and views it rank-major. The reduction
    input pads on its own, so the padded copy is left out.
    """
    if piece.target not in VIEWS:
        return None

    def fits(gradient: fx.Node) -> bool:
        value = gradient.meta["val"]
        if value.dim() == 0:
            return False
        return list(piece.meta["val"].shape) == [world_size, padded_rows(value.size(0), world_size) * value[0].numel()]

    gradient = piece.args[0]
    unpadded = _unpadded(gradient)
    if unpadded is not None and fits(unpadded):
        return unpadded
    if gradient.target is aten.slice_backward.default or not fits(gradient):
        return None
    return gradient


def _reduction_gradients(unsharded_grad: fx.Node, world_size: int) -> list[fx.Node] | None:
    """The unsharded gradients a flat reduction input concatenates rank-major, or None.

    A bucket's input (``bucket``) concatenates its groups' inputs the same way, one
    level up: their gradients are collected in order.
    """
    if unsharded_grad.target not in VIEWS or unsharded_grad.meta["val"].dim() != 1:
        return None
    concatenated = unsharded_grad.args[0]
    if concatenated.target is not aten.cat.default or concatenated.args[1:] != (1,):
        return None
    if concatenated.meta["val"].dim() != 2 or concatenated.meta["val"].size(0) != world_size:
        return None  # not rank-major
    gradients = []
    for piece in concatenated.args[0]:
        nested = _reduction_gradients(piece.args[0], world_size) if piece.target in VIEWS else None
        if nested is None:
            gradient = _padded_gradient(piece, world_size)
            if gradient is None:
                return None
            nested = [gradient]
        gradients += nested
    return gradients


def _erase_unused_padding(graph: fx.Graph, node: fx.Node) -> None:
    """Erases a replaced reduction input: ``node`` and the views, pads and cats only it read."""
    stack = [node]
    while stack:
        node = stack.pop()
        if node.op == "call_function" and not node.users and (node.target in (*VIEWS, *_PADDING) or cast_dtype(node)):
            inputs = node.all_input_nodes
            graph.erase_node(node)
            stack.extend(inputs)


def _lower_reduce_scatter(graph: fx.Graph, node: fx.Node) -> None:
    unsharded_grad, world_size, group_name = node.args[:3]
    reduce_op = op_argument(node, "reduce_op")
    insert = NodeInserter(graph, node, node)
    autograd_input = unsharded_grad
    # A mixed-precision reduction casts the gradient first ([Note: mixed-precision reduction]).
    reduce_dtype = cast_dtype(unsharded_grad)
    laid_out = unsharded_grad if reduce_dtype is None else unsharded_grad.args[0]
    gradients = _reduction_gradients(laid_out, world_size) if isinstance(world_size, int) else None
    if gradients is not None and {g.meta["val"].dtype for g in gradients} != {laid_out.meta["val"].dtype}:
        gradients = None  # a cat that promoted dtypes: not a group's input
    if gradients is not None:  # [Note: one reduction input per group] in compile_shard.ops
        dtype = () if reduce_dtype is None else (reduce_dtype,)
        unsharded_grad = insert(fsdp.reduce_scatter_input.default, gradients, world_size, *dtype)
    shard_numel = node.meta["val"].numel()
    comm = op_argument(node, "comm")
    if world_size == 1:  # [Note: a group of one rank] in compile_shard.ops: a sum or an average of one
        sharded_grad = unsharded_grad
        if unsharded_grad.meta["val"].dim() != 1:
            sharded_grad = insert(aten.reshape.default, unsharded_grad, [-1])
    elif comm is not None:  # [Note: custom collectives] in compile_shard.ops.all_gather
        reduced = insert(fsdp.reduce_scatter_with_comm.default, unsharded_grad, world_size, group_name, reduce_op, comm)
        sharded_grad = insert(c10d.wait_tensor.default, reduced)
    elif reduces_by_all_to_all(group_name, unsharded_grad.meta["val"].device) and is_concrete_int(shard_numel):
        split_sizes = [int(shard_numel)] * world_size
        if unsharded_grad.meta["val"].dim() != 1:
            unsharded_grad = insert(aten.reshape.default, unsharded_grad, [-1])
        received = insert(c10d.all_to_all_single.default, unsharded_grad, split_sizes, split_sizes, group_name)
        received = insert(c10d.wait_tensor.default, received)
        sharded_grad = insert(fsdp.sum_shards.default, received, world_size, reduce_op)
    else:
        reduced = insert(c10d.reduce_scatter_tensor.default, unsharded_grad, reduce_op, world_size, group_name)
        sharded_grad = insert(c10d.wait_tensor.default, reduced)
    node.replace_all_uses_with(sharded_grad)
    graph.erase_node(node)
    if gradients is not None:
        _erase_unused_padding(graph, autograd_input)


def lower(graph: fx.Graph, *, partitioned: bool = False) -> int:
    """Lowers every ``fsdp`` collective in ``graph``; returns how many it replaced.

    In the joint graph, a backward gather from saved chunks stays an ``fsdp`` op: a
    pure op, which the partitioner leaves out of the forward graph (a
    ``_c10d_functional`` wait it would keep there, gathering twice). The suite lowers it
    in the partitioned backward graph (``partitioned=True``).
    """
    lowered = 0
    for node in list(graph.nodes):
        if node.target is fsdp.all_gather_into.default:
            if not partitioned and gathers_saved_chunks(node):
                continue
            _lower_all_gather(graph, node)
        elif node.target is fsdp.reduce_scatter_grad.default:
            _lower_reduce_scatter(graph, node)
        else:
            continue
        lowered += 1
    return lowered
