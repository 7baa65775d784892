"""lower: replace ``fsdp`` collectives with ``_c10d_functional`` collectives, ``wait_tensor`` and explicit copy-in.

Inductor buckets, reorders and overlaps only its own collective IR; an ``fsdp`` custom
op would reach it as an opaque synchronous fallback. After this pass the copy-in
(flatten, pad, concatenate) and the averaging division are plain aten ops that
Inductor fuses, and the collectives are the ones it understands. On gloo a gradient
reduction becomes an all-to-all and ``fsdp.sum_shards``, which sums and averages
([Note: gloo reduce-scatter] in ``compile_shard.ops``). Every new node inherits the replaced node's metadata (group
annotation, recompute tags), so the partitioner treats the lowered chain exactly as
the ``fsdp`` node it replaces.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils.checkpoint import CheckpointPolicy

from compile_shard.ops import reduces_by_all_to_all

from ._graph import NodeInserter, c10d, fsdp

aten = torch.ops.aten


def _lower_all_gather(graph: fx.Graph, node: fx.Node) -> None:
    shards, padded_numels, world_size, group_name = node.args
    insert = NodeInserter(graph, node, node)
    padded = []
    for shard, padded_numel in zip(shards, padded_numels):
        flat = insert(aten.reshape.default, shard, [-1])
        numel = shard.meta["val"].numel()
        if is_concrete_int(numel):
            numel = int(numel)
        else:  # dynamic shapes
            numel = insert(aten.sym_numel.default, shard)
        if isinstance(padded_numel, fx.Node) or isinstance(numel, fx.Node):
            pad = insert(operator.sub, padded_numel, numel)
        else:
            pad = padded_numel - numel
        padded.append(flat if pad == 0 else insert(aten.constant_pad_nd.default, flat, [0, pad], 0.0))
    all_gather_input = padded[0] if len(padded) == 1 else insert(aten.cat.default, padded)
    gathered = insert(c10d.all_gather_into_tensor.default, all_gather_input, world_size, group_name)
    if node.meta.get("recompute") is CheckpointPolicy.MUST_SAVE:
        # Save the gathered parameters only, not the copy-in buffers or the un-waited collective.
        for copy_in_node in [*padded, all_gather_input, gathered]:
            copy_in_node.meta.pop("recompute", None)
    node.replace_all_uses_with(insert(c10d.wait_tensor.default, gathered))
    graph.erase_node(node)


def _lower_reduce_scatter(graph: fx.Graph, node: fx.Node) -> None:
    unsharded_grad, world_size, group_name, *rest = node.args
    reduce_op = rest[0] if rest else node.kwargs.get("reduce_op", "avg")
    insert = NodeInserter(graph, node, node)
    shard_numel = node.meta["val"].numel()
    if reduces_by_all_to_all(group_name, unsharded_grad.meta["val"].device) and is_concrete_int(shard_numel):
        split_sizes = [int(shard_numel)] * world_size
        if unsharded_grad.meta["val"].dim() != 1:
            unsharded_grad = insert(aten.reshape.default, unsharded_grad, [-1])
        received = insert(c10d.all_to_all_single.default, unsharded_grad, split_sizes, split_sizes, group_name)
        received = insert(c10d.wait_tensor.default, received)
        sharded_grad = insert(fsdp.sum_shards.default, received, world_size, reduce_op)
    else:
        reduced = insert(c10d.reduce_scatter_tensor.default, unsharded_grad, "sum", world_size, group_name)
        sharded_grad = insert(c10d.wait_tensor.default, reduced)
        if reduce_op == "avg":
            sharded_grad = insert(aten.div.Tensor, sharded_grad, world_size)
    node.replace_all_uses_with(sharded_grad)
    graph.erase_node(node)


def lower(graph: fx.Graph) -> int:
    """Lowers every ``fsdp`` collective in ``graph``; returns how many it replaced."""
    lowered = 0
    for node in list(graph.nodes):
        if node.target is fsdp.all_gather_into.default:
            _lower_all_gather(graph, node)
        elif node.target is fsdp.reduce_scatter_grad.default:
            _lower_reduce_scatter(graph, node)
        else:
            continue
        lowered += 1
    return lowered
