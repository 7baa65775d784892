"""What the runtime tells the pass suite through the traced graph.

The runtime and the passes both import this module and nothing of each other's
(the passes read the runtime's intent from the graph, never from its objects), so
imports run one way: ``_api`` -> ``passes`` -> this module.

[Note: the group annotation]
While tracing, a group's all-gather runs under ``torch.fx.traceback.annotate``, and
AOTAutograd copies that annotation onto every node derived from it, forward and
backward: the all-gather, its copy-out, the unsharded parameters' views, and their
gradients up to the reduce-scatter. ``GroupAnnotation`` is that record. It is stored
in ``node.meta["custom"]`` as a plain dict (torch copies and caches node metadata,
so it holds only builtin values), written by ``write_group_annotation`` or
``annotating_group`` (with ``group_metadata``) and read by ``group_annotation`` alone.

[Note: what the trace records for reuse_first_blocks]
``passes.reuse_first_blocks`` swaps the inlined first block of each reuse key for a
call of the region body its later blocks call ([Note: the first block calls its
region after Dynamo]). Nothing in Dynamo's graph tells which nodes were that block,
what it took for each region argument, or which of a body's call operands is which
argument, so ``_regions._first_block`` notes them while Dynamo traces: ``InlinedFirstBlock`` per
inlined first block (``note_inlined_first_block``), and per region body its key and,
per argument leaf, the caller's node the call it was traced for passed
(``note_region_body``; the body lifts what it reads as placeholders of its own, in
the order it reads them, and that call passes the caller's nodes in their place).
They hold nodes, so they live beside the graph, not in its metadata: weakly keyed by
the graph object, which Dynamo hands to the backend and Inductor's pre-grad hook
unchanged. A graph that was copied, or a trace Dynamo restarted, finds none of them,
and its first blocks stay inlined.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any

import torch
import torch.fx as fx

# Keys of ``node.meta["custom"]``.
GROUP_ANNOTATION = "compile_shard_group"


@dataclasses.dataclass(frozen=True)
class GroupAnnotation:
    """One group (or one bucket of groups) as the passes see it.

    ``name``: the group's, after the module ``fully_shard`` was called on
    (``"layers.0"``; the root's is its class name). ``bucket`` merges adjacent groups
    into one whose name joins theirs (``"layers.0+layers.1"``) and whose ``members``
    lists them.
    """

    name: str
    reshard_after_forward: bool
    # The groups this annotation stands for: (group,), or a bucket's groups.
    members: tuple[str, ...]
    # Every group of the sharded model this group belongs to: a graph that holds only
    # some of them is part of a model split by a graph break.
    model_groups: tuple[str, ...]
    # FSDP2's explicit prefetch lists (``set_modules_to_forward_prefetch`` and backward).
    forward_prefetch: tuple[str, ...] = ()
    backward_prefetch: tuple[str, ...] = ()
    # FSDP2's reshard_after_forward=<int>: (size, rank among them, process group name) of
    # the smaller group backward gathers over ([Note: resharding to a smaller group]).
    reshard_group: tuple[int, int, str] | None = None
    # FSDP2's set_reduce_scatter_unused_params: an unused parameter gets a zero gradient
    # (True) or none (False, the default; [Note: unused parameters] in passes.unused_params).
    reduce_scatter_unused_params: bool = False
    # FSDP2's set_reshard_after_backward(False): the forward's unsharded parameters are graph
    # outputs the group keeps for the next forward, not a graph break's ([Note: unsharded
    # parameters kept after backward] in compile_shard._group_gather).
    kept_after_backward: bool = False
    # FSDP2's MixedPrecisionPolicy as the graph must show it ([Note: mixed-precision
    # dtypes] in passes.verify), as ``str(dtype)``: what each all-gather output may be,
    # what the unsharded gradients are computed in, and what they are reduced in.
    # Empty or None where all-gather extensions decide them.
    all_gather_dtypes: tuple[str, ...] = ()
    gradient_dtype: str | None = None
    reduction_dtype: str | None = None


_ANNOTATION_FIELDS = tuple(field.name for field in dataclasses.fields(GroupAnnotation))


def _stored(annotation: GroupAnnotation) -> dict:
    """``annotation`` as the plain dict a node's metadata holds.

    Not ``dataclasses.asdict``: its fields are builtin values already, and Dynamo
    traces ``asdict``'s recursive deep copy at every block's all-gather, of
    ``model_groups`` too, which lists every group: a capture quadratic in depth
    (docs/benchmarks.md, "Capture time by depth").
    """
    return {name: getattr(annotation, name) for name in _ANNOTATION_FIELDS}


def group_annotation(node: fx.Node) -> GroupAnnotation | None:
    """The annotation of the group ``node`` belongs to, if any."""
    stored = node.meta.get("custom", {}).get(GROUP_ANNOTATION)
    return None if stored is None else GroupAnnotation(**stored)


def write_group_annotation(node: fx.Node, annotation: GroupAnnotation) -> None:
    """Annotates a node a pass created as part of ``annotation``'s group."""
    node.meta["custom"] = {**node.meta.get("custom", {}), GROUP_ANNOTATION: _stored(annotation)}


def group_metadata(annotation: GroupAnnotation) -> dict:
    """``annotating_group``'s argument: the runtime reads it once per group and trace, as a constant."""
    return {GROUP_ANNOTATION: _stored(annotation)}


def annotating_group(metadata: dict) -> contextlib.AbstractContextManager[None]:
    """Annotates every node traced inside the block (the runtime's all-gather) with ``group_metadata``'s.

    torch's context manager itself: Dynamo traces a generator of ours around it at every group.
    """
    return torch.fx.traceback.annotate(metadata)


@dataclasses.dataclass
class InlinedFirstBlock:
    """A first block of its reuse key that ran inlined in Dynamo's graph ([Note: what the trace records for
    reuse_first_blocks])."""

    #: Its reuse key: the later blocks with this key call one region body.
    key: int
    #: Per leaf of its region arguments: the node, or the plain value.
    inputs: list[Any]
    #: The nodes of the tensors its forward returned, in order.
    outputs: list[fx.Node]
    #: Its own nodes, its copy-out included, in graph order.
    nodes: list[fx.Node]


_INLINED_FIRST_BLOCKS: weakref.WeakKeyDictionary[fx.Graph, list[InlinedFirstBlock]] = weakref.WeakKeyDictionary()
_REGION_BODIES: weakref.WeakKeyDictionary[fx.Graph, tuple[int, list[fx.Node | None]]] = weakref.WeakKeyDictionary()


def note_inlined_first_block(graph: fx.Graph, block: InlinedFirstBlock) -> None:
    _INLINED_FIRST_BLOCKS.setdefault(graph, []).append(block)


def note_region_body(graph: fx.Graph, key: int, leaf_nodes: list[fx.Node | None]) -> None:
    """``graph``: the body's; ``leaf_nodes``: per argument leaf, the caller's node (None for a plain value)."""
    _REGION_BODIES[graph] = (key, leaf_nodes)


def inlined_first_blocks(graph: fx.Graph) -> list[InlinedFirstBlock]:
    """The first blocks that ran inlined in ``graph``, Dynamo's graph as the backend receives it."""
    return _INLINED_FIRST_BLOCKS.get(graph, [])


def region_body(graph: fx.Graph) -> tuple[int, list[fx.Node | None]] | None:
    """The key a region body's ``graph`` was traced for and the caller's node of each argument leaf; or None."""
    return _REGION_BODIES.get(graph)
