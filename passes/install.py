"""Installs the suite into torch.compile's pipeline, chained with passes already there.

Five hooks, all set once by ``fully_shard`` (``install()`` is idempotent):

- ``torch._inductor.config.pre_grad_custom_pass`` runs inside Inductor on Dynamo's
  graph, before AOTAutograd traces it: ``reuse_first_blocks``
  (``run_pre_grad_suite``). Its ``uuid`` keys the caches as the joint pre-pass's does.
- ``torch._functorch.config.joint_custom_pass`` runs on the AOT joint graph right
  before partitioning, for every backend (``aot_eager`` and ``inductor`` alike): the
  suite runs there.
- ``torch._inductor.config.joint_custom_pre_pass`` runs inside Inductor on the same
  joint graph afterwards; ours verifies the invariants again after Inductor's own
  joint-graph preparation and, through its ``uuid``, puts the pass settings into
  Inductor's and AOTAutograd's cache keys (the functorch hook is not part of them).
- ``torch._inductor.config.post_grad_custom_post_pass`` runs on the partitioned
  forward and backward graphs: ``reorder`` schedules them there and
  ``gather_buffers`` hands the all-gather outputs to Inductor's memory planner
  (``run_partitioned_suite``). Backends without such a hook (``aot_eager``) run the
  partitioner's order; a custom backend can call ``run_partitioned_suite`` itself.
- ``torch._inductor.config.reorder_for_compute_comm_overlap_passes`` gets
  ``keep_order``, so Inductor's scheduler emits that order (see ``keep_order``).

A pass a user had set on either hook before keeps running, after ours.

[Note: Inductor's own collective passes]
compile_shard's passes decide the buckets and the order of the collectives; Inductor
has passes that would decide them too, and they are left as torch sets them:

- ``aten_distributed_optimizations.enable_simple_overlap`` (torch 2.15, on by
  default) runs after the scheduler, so after ``keep_order``: it moves waits later
  and collectives earlier, and never one collective past another. On compile_shard's
  graphs it moves at most the wait on a gather's input past a reduction's copy-in;
  the collectives are issued in the scheduled order
  (``tests/test_compile.py::test_inductor_issues_the_collectives_in_the_scheduled_order``),
  and the gloo suite, compiled with Inductor, neither hangs nor changes numbers on 2.15.
- ``enable_overlap_scheduling`` and ``collective_bucketing`` (off by default) would
  bucket and schedule again what ``bucket`` and ``reorder`` did; they estimate compute
  by running it on CUDA, and fail on a machine without a GPU. Leave them off.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from compile_shard._annotation import group_annotation
from compile_shard.ops.rank_check import count_compiles

from ._graph import fsdp, is_backward
from .bucket import bucket, describe_buckets
from .compile_regions import compile_regions
from .copy_out import copy_out
from .cost_model import HardwareProfile, cost_profile, get_profile
from .dump import GraphDump, turn_off_caches_when_dumping_from_environment
from .gather_buffers import gather_buffers
from .graph_breaks import warn_if_partial
from .keep_order import keep_order
from .lower import lower
from .place import place
from .profile_ranges import profile_ranges
from .rank_check import rank_check
from .refunctionalize import refunctionalize
from .reorder import reorder, reorder_within_budget
from .reshard import reshard
from .reuse_first_blocks import reuse_first_blocks
from .save_attention import save_attention
from .settings import settings
from .simulate import simulate
from .unused_params import unused_params
from .verify import verify

# Every pass module: a change to any of them must miss Inductor's caches.
_PASS_SOURCES = tuple(sorted(str(path) for path in Path(__file__).parent.glob("*.py")))


def has_sharded_params(graph: fx.Graph) -> bool:
    """Whether ``graph`` came from a model sharded by compile_shard."""
    return any(
        node.target in (fsdp.all_gather_into.default, fsdp.reduce_scatter_grad.default)
        or group_annotation(node) is not None
        for node in graph.nodes
    )


#: The passes on the joint graph, in order; each returns how much it changed. A pass
#: is named once: its function, its module, its switch in ``settings`` and its dump
#: file share the name.
JOINT_PASSES: tuple[Callable[[fx.Graph], int], ...] = (
    refunctionalize,
    unused_params,
    compile_regions,
    bucket,
    reshard,
    save_attention,
    lower,
    copy_out,
    place,
)


def _after(graph_pass: Callable[..., int], graph: fx.Graph, dump: GraphDump | None) -> None:
    """What follows every pass: its dump stage, then ``verify``, which blames it for a broken invariant."""
    if dump:
        dump.write(graph_pass.__name__, graph)
    if settings.verify:
        verify(graph, after=graph_pass.__name__)


def run_suite(graph: fx.Graph) -> dict[str, int]:
    """Runs the enabled passes on a joint graph in order; returns what each changed.

    With graph dumps on (``compile_shard.debug.dump_graphs``), writes the graph
    before the suite and after each pass.
    """
    dump = GraphDump.start()
    if dump:
        dump.write("joint", graph)
    changes = {}
    for graph_pass in JOINT_PASSES:
        if getattr(settings, graph_pass.__name__):
            changes[graph_pass.__name__] = graph_pass(graph)
            _after(graph_pass, graph, dump)
            if dump and graph_pass is bucket:
                dump.buckets = describe_buckets(graph)
    return changes


def scheduled_depths(profile: HardwareProfile) -> tuple[int, int]:
    """``settings.prefetch_depth`` and ``reduce_scatter_depth``, a ``None`` resolved for ``profile``.

    A prefetch or a reduction in flight holds one group's unsharded size to hide a
    transfer behind compute. Where the profile says nothing overlaps (``cpu_gloo``: the
    collectives need the cores compute runs on) it hides nothing, so the default there
    is 0, the memory of FSDP2 without prefetch; elsewhere 1, FSDP2's own schedule.
    """
    default = 1 if profile.overlaps_communication else 0
    return (
        default if settings.prefetch_depth is None else settings.prefetch_depth,
        default if settings.reduce_scatter_depth is None else settings.reduce_scatter_depth,
    )


def reuses_first_blocks(graph: fx.Graph) -> bool:
    """``settings.reuse_first_blocks``, a ``None`` resolved for ``graph``'s cost profile.

    Inlined, a first block hides its reduce-scatter behind its own input gradient's
    matmuls; a region returns both gradients together. Where the profile says nothing
    overlaps (``cpu_gloo``) that hides nothing, so the default reuses the region there;
    elsewhere it keeps the overlap.
    """
    if settings.reuse_first_blocks is not None:
        return settings.reuse_first_blocks
    return not get_profile(cost_profile(graph)).overlaps_communication


def run_pre_grad_suite(graph: fx.Graph) -> int:
    """Runs the suite's pass on Dynamo's graph, before AOTAutograd traces it (Inductor's pre-grad hook):
    ``reuse_first_blocks``; returns how many blocks it changed. A custom backend can call it itself."""
    if not settings.compile_regions or not reuses_first_blocks(graph):
        return 0
    return reuse_first_blocks(graph)


def run_partitioned_suite(graph: fx.Graph, *, planned_buffers: bool = False) -> int:
    """Schedules one partitioned forward or backward graph (``reorder``); returns how many nodes moved.

    ``planned_buffers`` (Inductor's hook sets it): then ``gather_buffers`` lets the
    compiler allocate every all-gather's output. With graph dumps on, writes the final
    graph and the simulated schedule into the folder of the joint graph it came from.
    """
    moved = 0
    # A backward gather from saved chunks is lowered only now ([Note: resharding to a smaller group]).
    if settings.lower and lower(graph, partitioned=True):
        _after(lower, graph, None)
    profile_name = cost_profile(graph)
    profile = get_profile(profile_name)
    prefetch_depth, reduce_scatter_depth = scheduled_depths(profile)
    if settings.reorder and settings.memory_budget_mb is None:
        moved = reorder(graph, prefetch_depth, reduce_scatter_depth)
    elif settings.reorder:
        moved = reorder_within_budget(
            graph,
            prefetch_depth,
            reduce_scatter_depth,
            settings.memory_budget_mb * 2**20,
            lambda scheduled: simulate(scheduled, profile).peak_memory_bytes,
        )
    if settings.reorder:
        _after(reorder, graph, None)
    if planned_buffers and settings.gather_buffers:
        gather_buffers(graph)
        _after(gather_buffers, graph, None)
    if settings.profile_ranges and profile_ranges(graph):
        _after(profile_ranges, graph, None)
    if settings.rank_check and rank_check(graph):
        _after(rank_check, graph, None)
    if GraphDump.latest is not None:
        GraphDump.latest.write_partitioned("backward" if is_backward(graph) else "forward", graph, profile_name)
    return moved


class _JointPass:
    """The functorch joint-graph hook: the suite, then the previously installed pass."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, graph_module: fx.GraphModule, joint_inputs):
        if has_sharded_params(graph_module.graph):
            warn_if_partial(graph_module.graph)
            run_suite(graph_module.graph)
            graph_module.recompile()
        if self.previous is not None:
            graph_module = self.previous(graph_module, joint_inputs)
        return graph_module


class _ChainedInductorPass(CustomGraphPass):
    """An Inductor hook that runs ``run`` on sharded graphs, then the previously installed pass.

    Its ``uuid`` keys Inductor's caches on the pass sources and the settings, and on
    the previous pass's own key.
    """

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, graph: fx.Graph) -> None:
        if has_sharded_params(graph):
            self.run(graph)
        if self.previous is not None:
            self.previous(graph)

    def run(self, graph: fx.Graph) -> None:
        raise NotImplementedError

    def uuid(self):
        previous = self.previous.uuid() if isinstance(self.previous, CustomGraphPass) else None
        return (get_hash_for_files(_PASS_SOURCES), settings.cache_key(), rank_cache_key(), previous)


def rank_cache_key() -> int | None:
    """This process's rank where the suite's graphs depend on it, for the cache keys; else ``None``.

    [Note: rank-specific graphs and the caches]
    AOTAutograd's and Inductor's caches are keyed on the Dynamo graph, which is the
    same on every rank with the same shard shapes. A compiled graph that depends on
    the rank would then be loaded by the other ranks sharing a cache directory: wrong
    gradients, no error. No op takes a rank today (gloo's reduction is an all-to-all
    and ``fsdp::sum_shards``, [Note: gloo reduce-scatter]), but on gloo the suite
    rewrites collectives into point-to-point transfers whose kernels read the rank
    from the process group; keying gloo's graphs on the rank keeps a future
    rank-specific rewrite from turning into that silent failure, at the price of one
    cache entry per rank. Elsewhere ranks share one entry.
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank() if "gloo" in dist.get_backend() else None


class _InductorJointPrePass(_ChainedInductorPass):
    """Inductor's joint pre-pass hook: re-verifies, and keys Inductor's caches on the settings."""

    def run(self, graph: fx.Graph) -> None:
        if settings.verify:
            verify(graph, after="Inductor's joint-graph passes")


class _PreGradPass(_ChainedInductorPass):
    """Inductor's pre-grad hook, on Dynamo's graph before AOTAutograd (``run_pre_grad_suite``)."""

    def run(self, graph: fx.Graph) -> None:
        run_pre_grad_suite(graph)


class _PostGradPass(_ChainedInductorPass):
    """Inductor's post-grad hook: schedules each partitioned forward and backward graph, planned buffers on."""

    def run(self, graph: fx.Graph) -> None:
        run_partitioned_suite(graph, planned_buffers=True)


def install() -> None:
    """Puts the suite on every hook unless it is already there."""
    turn_off_caches_when_dumping_from_environment()
    count_compiles()
    functorch_config = torch._functorch.config
    if not isinstance(functorch_config.joint_custom_pass, _JointPass):
        functorch_config.joint_custom_pass = _JointPass(functorch_config.joint_custom_pass)
    inductor_config = torch._inductor.config
    if not isinstance(inductor_config.pre_grad_custom_pass, _PreGradPass):
        inductor_config.pre_grad_custom_pass = _PreGradPass(inductor_config.pre_grad_custom_pass)
    if not isinstance(inductor_config.joint_custom_pre_pass, _InductorJointPrePass):
        inductor_config.joint_custom_pre_pass = _InductorJointPrePass(inductor_config.joint_custom_pre_pass)
    if not isinstance(inductor_config.post_grad_custom_post_pass, _PostGradPass):
        inductor_config.post_grad_custom_post_pass = _PostGradPass(inductor_config.post_grad_custom_post_pass)
    if keep_order not in inductor_config.reorder_for_compute_comm_overlap_passes:
        # Torch's own overlap passes stay if the user turned them on; ours runs last.
        previous = inductor_config.reorder_for_compute_comm_overlap_passes
        inductor_config.reorder_for_compute_comm_overlap_passes = [
            *(previous if inductor_config.reorder_for_compute_comm_overlap else ()),
            keep_order,
        ]
        inductor_config.reorder_for_compute_comm_overlap = True
