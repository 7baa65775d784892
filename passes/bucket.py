"""bucket: merge the all-gathers (and reduce-scatters) of groups used one after another into one collective.

Groups whose forwards follow each other are merged while the bucket's unsharded size
stays within a cap: fewer, larger collectives, which pays off where per-collective
latency dominates (small groups, a slow network). ``settings.bucket_cap_mb`` sets the
cap; 0 keeps one all-gather and one reduce-scatter per group, as in FSDP2.

[Note: the cost model's buckets]
By default (``bucket_cap_mb=None``) the cost model sets the cap, per process group:
the unsharded size below which a ring collective over its ranks costs more latency
than transfer on the cost profile (``cost_model.latency_bound_bytes``: world size x
ring-step latency x bus bandwidth). Merging two groups under it saves about one
collective's latency and costs less than that in transfer time that prefetch no
longer hides, and a bucket holds no more memory than one collective that size
moves: small by construction (with the profiles' constants, about 30 MB over 8 ranks
of an H100 node, under 1 MB over 2 gloo ranks of ``cpu_gloo``), so groups of a large
model keep FSDP2's collectives and a small model's groups share a few.
``describe_buckets`` says what was chosen and why; a graph dump writes it at the end
of ``schedule.txt``.

[Note: bucketed copy-out]
A group's gathered buffer is rank-major: ``[rank 0: p0 p1 ..., rank 1: p0 p1 ...]``,
and the runtime copies it out with ``view(world_size, -1).split(padded_numels, 1)``.
The merged all-gather takes the concatenated shard lists, so its buffer is
``[rank 0: group A's shards, group B's shards, rank 1: ...]``, and one
``split`` over the concatenated ``padded_numels`` yields exactly the chunks the
groups' own splits did: their ``getitem`` readers are pointed at the merged split
and no extra copy appears. The matching reduce-scatters in backward are merged by
concatenating the groups' gradients per rank (``cat`` on dim 1 of the
``[world_size, numel]`` views) and splitting the reduced shard back (on HSDP after
one all-reduce of the bucket, [Note: bucketed HSDP all-reduce]). The merged
nodes carry one annotation whose ``group`` is ``"A+B"`` and whose ``members``
names the groups, so the later passes and the graph dumps treat a bucket as one group.

[Note: a bucket of regions' groups]
A block whose compile region copies out its own parameters ([Note: a region copies
out its block's parameters] in compile_shard._regions._call) reads its group's
all-gather output whole: the region takes it as an argument, and the ``fsdp.copy_out``
that ``compile_regions`` gave the backward region reads it too. In a bucket, that
group's columns of the merged buffer are one chunk of the split, a
``[world_size, numel]`` block strided by the bucket's row; its contiguous copy,
flattened, is the rank-major buffer the group's own all-gather gave, so it replaces
that output for every reader, and the region keeps its body and its copy-out. The
copy is one more pass over the group's bytes (``copy_out`` makes it part of the
bucket's one ``fsdp.copy_out``), paid only where the cap lets groups merge: groups
small enough that the collective's latency costs more.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import Counter
from collections.abc import Sequence

import torch
import torch.fx as fx

from compile_shard._annotation import GroupAnnotation, group_annotation, write_group_annotation

from ._graph import NodeInserter, c10d, cast_dtype, fake_value, fsdp, invoke_subgraph, op_argument, reorder_by_priority
from .cost_model import cost_profile, get_profile, group_ranks, latency_bound_bytes
from .patterns import chain_readers, copy_out_chain, match_copy_out, only_user
from .settings import settings

aten = torch.ops.aten
prims = torch.ops.prims


def _copy_out_split(all_gather: fx.Node) -> fx.Node | None:
    """The ``split`` of the runtime's copy-out, where the copy-out is the all-gather output's only reader."""
    copy_out = match_copy_out(all_gather)
    return copy_out.split if copy_out is not None and len(all_gather.users) == 1 else None


def _read_whole(all_gather: fx.Node) -> bool:
    """Whether only block regions and ``fsdp.copy_out`` read the all-gather output, each all of it
    ([Note: a bucket of regions' groups])."""
    readers = all_gather.users
    return bool(readers) and all(user.target in (invoke_subgraph, fsdp.copy_out.default) for user in readers)


def _first_reader(all_gather: fx.Node, position: dict[fx.Node, int]) -> int | None:
    readers = chain_readers(copy_out_chain(all_gather))
    if not readers or any(reader.op == "output" for reader in readers):
        return None
    return min(position[reader] for reader in readers)


def _bucket_key(all_gather: fx.Node) -> tuple:
    """Groups can share a collective only on the same process groups, dtypes and resharding policy (and group).

    The process groups: the all-gather's, and the reduce-scatter's where it has one of
    its own (``set_separate_reduce_scatter_group``).

    The dtypes: the shards' and the all-gather's (``param_dtype`` under mixed precision).
    """
    world_size, group_name = all_gather.args[2:4]
    annotation = group_annotation(all_gather)
    dtypes = all_gather.args[0][0].meta["val"].dtype, all_gather.meta["val"].dtype
    reduce_scatter_group = op_argument(all_gather, "reduce_scatter_group_name")
    resharding = annotation.reshard_after_forward, annotation.reshard_group
    return world_size, group_name, reduce_scatter_group, dtypes, *resharding


_CUSTOM_COMMS = ("all_gather_comm", "reduce_scatter_comm")


@dataclasses.dataclass(frozen=True)
class BucketCap:
    """The largest unsharded size a bucket of groups may reach, and where that size comes from."""

    bytes: float
    reason: str


def bucket_cap(ranks: Sequence[int], profile_name: str, cap_mb: float | None = None) -> BucketCap:
    """For a process group of these global ranks: ``cap_mb`` (default ``settings.bucket_cap_mb``), or the cost
    model's ([Note: the cost model's buckets])."""
    cap_mb = settings.bucket_cap_mb if cap_mb is None else cap_mb
    if cap_mb is not None:
        per_group = ": one collective per group" if cap_mb == 0 else ""
        return BucketCap(cap_mb * 2**20, f"settings.bucket_cap_mb={cap_mb:g}{per_group}")
    cap = latency_bound_bytes(get_profile(profile_name), len(ranks), ranks)
    reason = f"below it a collective over {len(ranks)} ranks costs more latency than transfer on {profile_name}"
    return BucketCap(cap, reason)


def _gathered_bytes(all_gather: fx.Node) -> int:
    return all_gather.meta["val"].untyped_storage().nbytes()


def _cap_of(all_gather: fx.Node, profile_name: str, cap_mb: float | None) -> BucketCap:
    world_size, group_name = all_gather.args[2:4]
    ranks = group_ranks(group_name) or range(world_size)  # no live group (a hand-built graph): one node
    return bucket_cap(ranks, profile_name, cap_mb)


def _gathers_in_forward_order(graph: fx.Graph) -> list[fx.Node]:
    """The annotated all-gathers the forward reads, in the order it first reads them."""
    position = {node: index for index, node in enumerate(graph.nodes)}
    gathers = [
        node
        for node in graph.find_nodes(op="call_function", target=fsdp.all_gather_into.default)
        if group_annotation(node) is not None
    ]
    ordered = sorted(
        ((reader, node) for node in gathers if (reader := _first_reader(node, position)) is not None),
        key=lambda reader_and_node: reader_and_node[0],
    )
    return [node for _, node in ordered]


def _plan(graph: fx.Graph, profile_name: str, cap_mb: float | None) -> list[list[fx.Node]]:
    """Runs of all-gathers, in forward order, to merge; each run within its cap (``bucket_cap``)."""
    gathers = _gathers_in_forward_order(graph)
    per_group = Counter(group_annotation(node).name for node in gathers)
    runs, current = [], []
    for node in gathers:
        copied_out = _copy_out_split(node) is not None or _read_whole(node)
        mergeable = per_group[group_annotation(node).name] == 1 and copied_out
        # A custom comm collects one group's buffers, as in FSDP2 ([Note: custom collectives] in compile_shard.ops).
        mergeable = mergeable and not any(op_argument(node, name) for name in _CUSTOM_COMMS)
        fits = current and _bucket_key(current[0]) == _bucket_key(node)
        merged_bytes = sum(_gathered_bytes(n) for n in current) + _gathered_bytes(node)
        fits = fits and merged_bytes <= _cap_of(node, profile_name, cap_mb).bytes
        if mergeable and fits:
            current.append(node)
            continue
        runs.append(current)
        current = [node] if mergeable else []
    runs.append(current)
    return [run for run in runs if len(run) > 1]


def describe_buckets(graph: fx.Graph) -> str:
    """What each forward all-gather of ``graph`` (after this pass) gathers, and the cap that decided it."""
    profile_name = cost_profile(graph)
    lines = []
    for node in _gathers_in_forward_order(graph):
        annotation = group_annotation(node)
        cap = _cap_of(node, profile_name, None)
        merged = f"{len(annotation.members)} groups" if len(annotation.members) > 1 else "alone"
        lines.append(
            f"{annotation.name}: {merged}, {_gathered_bytes(node) / 2**20:.3f} MiB unsharded; cap "
            f"{cap.bytes / 2**20:.3f} MiB ({cap.reason})"
        )
    return "\n".join(lines) + "\n" if lines else ""


def _bucket_annotation(nodes: list[fx.Node]) -> GroupAnnotation:
    annotations = [group_annotation(node) for node in nodes]
    groups = tuple(group for annotation in annotations for group in annotation.members)

    def listed(knob: str) -> tuple[str, ...]:
        names = [name for annotation in annotations for name in getattr(annotation, knob) if name not in groups]
        return tuple(dict.fromkeys(names))

    return dataclasses.replace(
        annotations[0],
        name="+".join(groups),
        members=groups,
        forward_prefetch=listed("forward_prefetch"),
        backward_prefetch=listed("backward_prefetch"),
    )


def _annotate(nodes: list[fx.Node], annotation: GroupAnnotation) -> None:
    for node in nodes:
        write_group_annotation(node, annotation)


def _merge_gathers(graph: fx.Graph, gathers: list[fx.Node], annotation: GroupAnnotation) -> None:
    first = gathers[0]
    world_size, group_name = first.args[2:4]
    shards = [shard for node in gathers for shard in node.args[0]]
    padded_numels = [numel for node in gathers for numel in node.args[1]]
    insert = NodeInserter(graph, first, first)
    param_dtype = op_argument(first, "param_dtype")
    options = {} if param_dtype is None else {"param_dtype": param_dtype}
    merged = insert(fsdp.all_gather_into.default, shards, padded_numels, world_size, group_name, **options)
    per_rank = insert(aten.view.default, merged, [world_size, -1])
    # A group read whole takes one chunk, the others one per parameter.
    read_whole = [_read_whole(node) for node in gathers]
    chunks = [[sum(node.args[1])] if whole else list(node.args[1]) for node, whole in zip(gathers, read_whole)]
    split = insert(aten.split_with_sizes.default, per_rank, [numel for sizes in chunks for numel in sizes], 1)
    new_nodes, replaced = [merged, per_rank, split], []
    offset = 0
    for node, sizes, whole in zip(gathers, chunks, read_whole):
        if whole:  # [Note: a bucket of regions' groups]
            chunk = insert(operator.getitem, split, offset)
            contiguous = insert(aten.clone.default, chunk, memory_format=torch.contiguous_format)
            rank_major = insert(aten.view.default, contiguous, [-1])
            new_nodes += [chunk, contiguous, rank_major]
            node.replace_all_uses_with(rank_major)
            offset += 1
            replaced.append(node)
            continue
        old_split = _copy_out_split(node)
        for getitem in old_split.users:
            replacement = insert(operator.getitem, split, offset + getitem.args[1])
            new_nodes.append(replacement)
            getitem.replace_all_uses_with(replacement)
            for user in list(replacement.users):
                if user.target is aten.view.default:
                    # A lone group's chunk was contiguous and viewed; inside a bucket it is
                    # strided and must be copied, in the form traces copy other chunks.
                    contiguous = insert(aten.clone.default, replacement, memory_format=torch.contiguous_format)
                    new_nodes.append(contiguous)
                    user.args = (contiguous, *user.args[1:])
                    user.target = aten._unsafe_view.default
                    user.meta["val"] = fake_value(user.target, user.args, user.kwargs)
        offset += len(sizes)
        replaced += [*old_split.users, old_split, old_split.args[0], node]
    # Erased only now: ``first`` anchors the insertions above.
    for node in replaced:
        graph.erase_node(node)
    _annotate(new_nodes, annotation)


def _reduce_scatter_args(node: fx.Node) -> tuple:
    return (*node.args[:3], op_argument(node, "reduce_op"))


def _replicate_all_reduces(reductions: list[fx.Node]) -> list[fx.Node] | None:
    """HSDP: each reduction's all-reduce over the replicate group, if that is all that reads it, alike for all.

    [Note: bucketed HSDP all-reduce]
    Each group's reduce-scattered gradient is all-reduced over the replicate group and
    then split into its shards. The bucket reduces its groups' gradients in one
    reduce-scatter, so it all-reduces the merged result once too, before splitting it
    per group: elementwise, so every element is reduced as before. A reduction that
    adds an earlier partial reduction first (``set_requires_all_reduce``) is not read
    by its all-reduce alone, and keeps one all-reduce per group.
    """
    all_reduces = []
    for node in reductions:
        all_reduce = only_user(node)
        if all_reduce is None or all_reduce.target is not c10d.all_reduce.default:
            return None
        wait = only_user(all_reduce)
        if wait is None or wait.target is not c10d.wait_tensor.default:
            return None
        all_reduces.append(all_reduce)
    return all_reduces if len({tuple(node.args[1:]) for node in all_reduces}) == 1 else None


def _reduction_inputs(reductions: list[fx.Node]) -> tuple[list[fx.Node], torch.dtype | None]:
    """The gradients the reductions read, and the reduction dtype they are all cast to first, if they are.

    [Note: a bucket's mixed-precision reduction]
    Under ``MixedPrecisionPolicy(reduce_dtype=...)`` each group's reduce-scatter reads
    its gradients cast to the reduction dtype ([Note: mixed-precision reduction] in
    ``lower``). The bucket concatenates the gradients as computed and casts the
    concatenation once, so that ``lower`` still finds the policy's gradient dtype in
    the reduction input and casts while it lays the gradients out, as for one group.
    """
    inputs = [_reduce_scatter_args(node)[0] for node in reductions]
    dtypes = {cast_dtype(node) for node in inputs}
    if len(dtypes) == 1 and None not in dtypes:
        return [node.args[0] for node in inputs], dtypes.pop()
    return inputs, None


def _merge_reductions(graph: fx.Graph, reductions: list[fx.Node], annotation: GroupAnnotation) -> None:
    position = {node: index for index, node in enumerate(graph.nodes)}
    last = max(reductions, key=position.__getitem__)
    _, world_size, group_name, reduce_op = _reduce_scatter_args(last)
    insert = NodeInserter(graph, last, last)
    gradients, reduce_dtype = _reduction_inputs(reductions)
    per_rank = [insert(aten.view.default, gradient, [world_size, -1]) for gradient in gradients]
    concatenated = insert(aten.cat.default, per_rank, 1)
    flat = insert(aten.view.default, concatenated, [-1])
    new_nodes = [*per_rank, concatenated, flat]
    if reduce_dtype is not None:  # [Note: a bucket's mixed-precision reduction]
        flat = insert(prims.convert_element_type.default, flat, reduce_dtype)
        new_nodes.append(flat)
    merged = insert(fsdp.reduce_scatter_grad.default, flat, world_size, group_name, reduce_op)
    new_nodes.append(merged)
    replaced, erased = reductions, list(reductions)
    all_reduces = _replicate_all_reduces(reductions)
    if all_reduces is not None:  # [Note: bucketed HSDP all-reduce]
        all_reduce = insert(c10d.all_reduce.default, merged, *all_reduces[0].args[1:])
        merged = insert(c10d.wait_tensor.default, all_reduce)
        new_nodes += [all_reduce, merged]
        replaced = [only_user(node) for node in all_reduces]
        erased = [*replaced, *all_reduces, *reductions]
    split = insert(aten.split_with_sizes.default, merged, [node.meta["val"].numel() for node in replaced])
    new_nodes.append(split)
    for index, node in enumerate(replaced):
        replacement = insert(operator.getitem, split, index)
        new_nodes.append(replacement)
        node.replace_all_uses_with(replacement)
    casts = [_reduce_scatter_args(node)[0] for node in reductions] if reduce_dtype is not None else []
    for node in erased:  # erased only now, users first: ``last`` anchors the insertions above
        graph.erase_node(node)
    for node in casts:  # each group's own cast, replaced by the bucket's
        if not node.users:
            graph.erase_node(node)
    _annotate(new_nodes, annotation)


def _reductions_of(graph: fx.Graph, gathers: list[fx.Node]) -> list[fx.Node] | None:
    """The bucket's reduce-scatters (one per group, in group order), or None if they cannot be merged."""
    by_group: dict[str, list[fx.Node]] = {}
    for node in graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_grad.default):
        annotation = group_annotation(node)
        if annotation is not None:
            by_group.setdefault(annotation.name, []).append(node)
    groups = [group_annotation(node).name for node in gathers]
    if any(len(by_group.get(group, [])) != 1 for group in groups):
        return None
    reductions = [by_group[group][0] for group in groups]
    keys = {(_reduce_scatter_args(node)[1:], node.meta["val"].dtype) for node in reductions}
    return reductions if len(keys) == 1 else None


def bucket(graph: fx.Graph, cap_mb: float | None = None) -> int:
    """Merges runs of adjacent groups within their cap (``bucket_cap``); returns how many collectives it removed.

    ``cap_mb`` defaults to ``settings.bucket_cap_mb``; ``None`` there lets the cost model
    choose ([Note: the cost model's buckets]), 0 merges nothing: one all-gather and
    one reduce-scatter per group, as in FSDP2.

    A group whose gradients cannot be merged alike (no reduce-scatter in this graph,
    as in an inference trace, or different reduce settings) keeps its all-gather
    too, so forward and backward buckets always match.
    """
    cap_mb = settings.bucket_cap_mb if cap_mb is None else cap_mb
    if cap_mb == 0:
        return 0
    removed = 0
    for gathers in _plan(graph, cost_profile(graph), cap_mb):
        reductions = _reductions_of(graph, gathers)
        has_backward = bool(graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_grad.default))
        if has_backward and reductions is None:
            continue
        annotation = _bucket_annotation(gathers)
        _merge_gathers(graph, gathers, annotation)
        removed += len(gathers) - 1
        if reductions:
            _merge_reductions(graph, reductions, annotation)
            removed += len(reductions) - 1
    if removed:
        reorder_by_priority(graph, {})
    return removed
