"""The graph patterns of a group, found in one place for every pass and for ``verify``.

A group's forward, as the runtime traces it ([Note: traced unshard]) and ``lower``
rewrites it:

- the all-gather: ``fsdp.all_gather_into`` (the all-gather output), or after
  ``lower`` a ``_c10d_functional`` all-gather (or a custom comm's
  ``fsdp.all_gather_with_comm``) whose ``wait_tensor`` holds the
  all-gather output; ``all_gather_outputs`` finds these, ``waited_node`` the buffer a
  collective's wait reads;
- the copy-out: the all-gather output viewed rank-major, split into each
  parameter's columns, each column cloned and viewed in the parameter's shape
  (``match_copy_out``); every view and copy after the all-gather output, up to the
  nodes that compute with the unsharded parameters (``copy_out_chain``,
  ``chain_readers``);
- the shard views that feed the all-gather input (``all_gather_chain``);
- with all-gather extensions, the transforms around the all-gathers (``unshard_nodes``).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from compile_shard._annotation import group_annotation
from compile_shard._collectives import node_collective

from ._graph import VIEWS, c10d, fsdp

aten = torch.ops.aten
_SPLITS = (aten.split_with_sizes.default, aten.split.Tensor)
# Single-tensor-input ops that make up the shard views and the copy-out chain.
_CHAIN_OPS = {
    *VIEWS,
    aten.split_with_sizes.default,
    aten.slice.Tensor,
    aten.clone.default,
    aten.alias.default,
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.expand.default,
    aten._to_copy.default,
    fsdp.post_forward_chunk.default,
    fsdp.copy_out.default,
}


# What ``lower`` makes of a group's all-gather: a c10d all-gather, or a custom comm's.
LOWERED_GATHERS = (c10d.all_gather_into_tensor.default, fsdp.all_gather_with_comm.default)


def only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def waited_node(collective: fx.Node) -> fx.Node:
    """The node a ``wait_tensor`` reads to wait for ``collective``.

    A collective's own result, except for the ops that fill their first argument in
    place and return nothing (the gloo ops of ``gather_buffers``).
    """
    return collective.args[0] if node_collective(collective).in_place else collective


def _is_gathered(node: fx.Node) -> bool:
    if group_annotation(node) is None:
        return False
    if node.target is fsdp.all_gather_into.default:
        return True
    return node.target is c10d.wait_tensor.default and node.args[0].target in LOWERED_GATHERS


def all_gather_outputs(graph: fx.Graph) -> list[fx.Node]:
    """The node holding each group's all-gather output: the fsdp op, or the wait after ``lower``."""
    return [node for node in graph.nodes if _is_gathered(node)]


@dataclasses.dataclass(frozen=True)
class CopyOut:
    """A group's copy-out, from its all-gather output to each unsharded parameter's copy."""

    #: The all-gather output viewed ``[world_size, -1]``.
    rank_major: fx.Node
    #: Its split into the parameters' columns (dim 1).
    split: fx.Node
    #: The split's outputs (``getitem``), in parameter order.
    columns: tuple[fx.Node, ...]
    #: Each column's copy, ``view(clone(column))``, in parameter order; ``None`` where
    #: some column is read another way (no clone yet, or a bucket's split).
    copies: tuple[fx.Node, ...] | None


def match_copy_out(all_gather_output: fx.Node) -> CopyOut | None:
    """The copy-out that reads ``all_gather_output``; ``None`` if it has another shape.

    Other readers of the all-gather output (the forward's output, when a group is
    saved for backward) are allowed: callers that replace the copy-out check for them.
    """
    views = [user for user in all_gather_output.users if user.target in VIEWS]
    if len(views) != 1:
        return None
    (rank_major,) = views
    split = only_user(rank_major)
    if split is None or split.target not in _SPLITS or split.args[2:] != (1,):
        return None
    if any(column.target is not operator.getitem for column in split.users):
        return None
    columns = tuple(sorted(split.users, key=lambda column: column.args[1]))
    copies = []
    for column in columns:
        clone = only_user(column)
        copy = only_user(clone) if clone is not None and clone.target is aten.clone.default else None
        if copy is None or copy.target not in VIEWS:
            return CopyOut(rank_major, split, columns, None)
        copies.append(copy)
    return CopyOut(rank_major, split, columns, tuple(copies))


# Ops that join chain nodes only: ``copy_out``'s concatenation, and the all-gather
# output with this rank's post-forward chunk written back ([Note: resharding to a
# smaller group]).
_JOINS = (aten.cat.default, aten.slice_scatter.default)


def _is_chain_node(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in _CHAIN_OPS or node.target is operator.getitem)


def copy_out_chain(all_gather_output: fx.Node) -> list[fx.Node]:
    """``all_gather_output`` and the view/copy nodes that follow it: single-input ones, and a
    join of chain nodes only (``_JOINS``)."""
    chain = {all_gather_output: None}  # a dict for its order and its lookups: a bucket's chain is long
    frontier = list(all_gather_output.users)
    while frontier:
        node = frontier.pop()
        if node in chain:
            continue
        joins_chain = node.target in _JOINS and all(producer in chain for producer in node.all_input_nodes)
        if not (joins_chain or _is_chain_node(node)):
            continue
        chain[node] = None
        frontier.extend(node.users)
    return list(chain)


def chain_readers(chain: list[fx.Node]) -> list[fx.Node]:
    """The nodes outside ``chain`` that read one of its nodes: where the gathered parameters are used."""
    members = set(chain)
    return [user for node in chain for user in node.users if user not in members]


def all_gather_chain(all_gather: fx.Node) -> list[fx.Node]:
    """An ``fsdp.all_gather_into``, the shard views feeding it, and its copy-out chain."""
    shard_views = [shard for shard in all_gather.args[0] if _is_chain_node(shard)]
    return shard_views + copy_out_chain(all_gather)


def _same_group(node: fx.Node, name: str) -> bool:
    if node.op != "call_function":
        return False
    annotation = group_annotation(node)
    return annotation is not None and annotation.name == name


def unshard_nodes(all_gather: fx.Node) -> list[fx.Node]:
    """``all_gather_chain`` (or, after ``lower``, the wait's copy-out chain), and every node the group's unshard
    traced around it.

    Before the all-gather, an all-gather extension's ``fsdp_pre_all_gather``; after it,
    its ``fsdp_post_all_gather``, which may join the outputs of the group's other
    all-gathers, and ``fsdp.as_gathered`` ([Note: all-gather extensions] in
    ``compile_shard._param``). For a group without extensions, its all-gather chain.
    """
    lowered = all_gather.target is not fsdp.all_gather_into.default
    nodes = copy_out_chain(all_gather) if lowered else all_gather_chain(all_gather)
    annotation = group_annotation(all_gather)
    if annotation is None:
        return nodes
    members = set(nodes)
    frontier = [neighbour for node in nodes for neighbour in (*node.all_input_nodes, *node.users)]
    while frontier:
        node = frontier.pop()
        if node in members or not _same_group(node, annotation.name):
            continue
        members.add(node)
        nodes.append(node)
        frontier.extend((*node.all_input_nodes, *node.users))
    return nodes


def gathers_saved_chunks(all_gather: fx.Node) -> bool:
    """Whether an ``fsdp.all_gather_into`` gathers chunks the forward saved: a backward gather over a smaller group.

    ``reshard`` builds it ([Note: resharding to a smaller group] in ``compile_shard._group``);
    ``place`` leaves it where backward reads it, and ``lower`` leaves it whole until the
    partitioner has put it in the backward graph.
    """
    return all(shard.meta.get("recompute") is CheckpointPolicy.MUST_SAVE for shard in all_gather.args[0])
