"""The one settings object that switches each pass of the suite on or off."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Iterator


@dataclasses.dataclass
class PassSettings:
    """Which passes run on the AOT joint graph of a sharded model.

    Change the module-level ``settings`` instance before compiling, e.g.
    ``compile_shard.passes.settings.lower = False``. Every field takes part in
    Inductor's cache key, so changing one recompiles instead of reusing a graph.
    """

    #: Remove traced storage mutations (``fsdp.set_``, ``fsdp.resize_storage_``, copies into resized storage).
    refunctionalize: bool = True
    #: Give a parameter the forward left unused no gradient, FSDP2's default (off: a zero
    #: gradient); see [Note: unused parameters].
    unused_params: bool = True
    #: Trace each sharded block (a fully_shard module with none below it) as a nested
    #: compile region that every block with the same signature reuses: the block is
    #: compiled once instead of once per layer (off: every block inlined into the
    #: step's graph). See [Note: sharded blocks as nested compile regions].
    compile_regions: bool = True
    #: With Inductor: the first block of each reuse key, which Dynamo traces inlined,
    #: calls the region its later blocks call, so Inductor compiles one block, not two
    #: (off: it stays inlined, and hides its reduce-scatter behind its own input
    #: gradient). ``None``: on where the cost profile overlaps no communication with
    #: compute (``cpu_gloo``), off elsewhere; see [Note: the first block calls its region
    #: after Dynamo].
    reuse_first_blocks: bool | None = None
    #: Recompute resharded groups' all-gathers in backward; save the others' gathered parameters.
    reshard: bool = True
    #: Save (not recompute) zero-dropout attention in checkpoint regions;
    #: see [Note: seeded ops under activation checkpointing].
    save_attention: bool = True
    #: Merge adjacent groups' collectives up to a cap in unsharded MB (``bucket_cap_mb``).
    bucket: bool = True
    #: Bucket size cap in MB; 0 keeps one all-gather and one reduce-scatter per group (FSDP2);
    #: ``None``: the cost model's cap, under which a collective is latency-bound on the cost
    #: profile ([Note: the cost model's buckets]).
    bucket_cap_mb: float | None = None
    #: Replace ``fsdp`` collectives with ``_c10d_functional`` collectives plus explicit copy-in.
    lower: bool = True
    #: Make each group's copy-out one ``fsdp.copy_out`` (on gloo one concatenation); see
    #: [Note: one copy-out per group].
    copy_out: bool = True
    #: Issue each group's all-gather right before the forward first reads it.
    place: bool = True
    #: Schedule the partitioned forward and backward graphs for overlap (see ``reorder``).
    reorder: bool = True
    #: How many groups ahead an all-gather is issued (0: right before use). ``None``: 1
    #: where the cost profile overlaps communication with compute, else 0 (see
    #: ``scheduled_depths``).
    prefetch_depth: int | None = None
    #: How many reduce-scatters stay in flight before the oldest is waited on; ``None`` as above.
    reduce_scatter_depth: int | None = None
    #: With Inductor: all-gathers write into compiler-allocated buffers that its memory
    #: planner reuses from group to group; see [Note: planned all-gather buffers].
    gather_buffers: bool = True
    #: Run each group's collectives inside FSDP2's profiler ranges in the partitioned
    #: graphs; see [Note: profiler ranges in compiled graphs].
    profile_ranges: bool = True
    #: Peak-memory cap for a scheduled graph in MB; the prefetch depth is lowered to fit.
    memory_budget_mb: float | None = None
    #: Hardware profile for the simulator (budget, dumps) and the default bucket cap; ``None``: by the graph's device.
    cost_profile: str | None = None
    #: Check the graph invariants after every pass (raises ``GraphInvariantError`` naming the pass).
    verify: bool = True
    #: Start each compiled graph with the check that every rank of each of its process
    #: groups runs the same collectives (``RankMismatchError`` instead of a hang); see
    #: [Note: the rank check].
    rank_check: bool = True
    #: How long a rank that runs a newly compiled graph waits for a peer to check one
    #: too, not counting the peer's compiles, before it reports a recompile or a graph
    #: break on one rank only. Ranks that reach the check together never wait for it.
    rank_check_timeout_s: float = 60.0

    def cache_key(self) -> str:
        fields = sorted(dataclasses.asdict(self).items())
        return hashlib.sha256(repr(fields).encode()).hexdigest()


settings = PassSettings()


@contextlib.contextmanager
def overridden(**overrides) -> Iterator[PassSettings]:
    """Sets fields of ``settings`` inside the block and restores them after, e.g. ``overridden(reorder=False)``."""
    saved = {name: getattr(settings, name) for name in overrides}
    for name, value in overrides.items():
        setattr(settings, name, value)
    try:
        yield settings
    finally:
        for name, value in saved.items():
            setattr(settings, name, value)
