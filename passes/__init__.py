"""compile_shard's FX pass suite over the AOT joint graph (installed as ``compile_shard.passes``).

First, with Inductor, on Dynamo's graph before AOTAutograd traces it (Inductor's
pre-grad hook, ``run_pre_grad_suite``): ``reuse_first_blocks`` makes the first block of
each reuse key, which Dynamo traced inlined, call the region its later blocks call.

Then the passes run, in this order, on the joint forward-backward graph of a model
sharded with ``fully_shard``, right before the partitioner splits it. Each is named
once: its function, its module, its switch in ``settings`` and its dump file.

1. ``refunctionalize``: remove traced storage mutations.
2. ``unused_params``: a parameter the forward left unused gets no gradient (FSDP2's
   default; a semantic pass: switched off, such a parameter gets a zero gradient).
3. ``compile_regions``: with ``settings.compile_regions``, backward
   reads a block region's parameter arguments, not the region's copies of them.
4. ``bucket``: merge adjacent groups' collectives while a bucket stays latency-bound on the
   cost profile (or within ``settings.bucket_cap_mb``).
5. ``reshard``: tag each group's all-gather chain for recompute or for saving (and
   give a group resharded to a smaller group its backward gather from a saved chunk).
6. ``save_attention``: save zero-dropout attention that a checkpoint region would
   recompute (a torch 2.13 partitioner workaround).
7. ``lower``: ``fsdp`` collectives become ``_c10d_functional`` collectives.
8. ``copy_out``: each group's per-parameter copy-outs become one ``fsdp.copy_out``
   (on gloo one concatenation, which ``gather_buffers`` replaces).
9. ``place``: move each group's all-gather next to the forward's first use.

``verify`` checks the graph invariants after each of them and names the pass that
broke one (``settings.verify``).

Then, on each partitioned forward and backward graph (Inductor's post-grad hook,
``run_partitioned_suite``): ``lower`` lowers a backward gather from saved chunks, which
it left whole in the joint graph ([Note: resharding to a smaller group]);
``reorder`` issues all-gathers ahead and reduce-scatters
early (the schedule); with Inductor, ``gather_buffers`` lets its memory planner
allocate (and reuse) the all-gather outputs; ``profile_ranges`` names each group's
collectives for the profiler as FSDP2 does ([Note: profiler ranges in
compiled graphs]); ``verify`` after each. ``keep_order`` makes Inductor's scheduler keep
that schedule. Last, ``rank_check`` puts the check that every rank of a group runs the
same collectives first in the graph ([Note: the rank check]).

``fully_shard`` installs them (``install()``); ``settings`` switches each one off.
A graph holding only part of a sharded model (a graph break) raises a
``ShardedGraphBreakWarning`` once.
The source lives in the repository's top-level ``passes/`` folder and is installed
under the ``compile_shard`` package, so no generic ``passes`` name lands in
site-packages.
"""

from .graph_breaks import ShardedGraphBreakWarning, warn_if_partial
from .bucket import bucket
from .compile_regions import compile_regions
from .copy_out import copy_out
from .gather_buffers import gather_buffers
from .install import JOINT_PASSES, has_sharded_params, install, run_partitioned_suite, run_pre_grad_suite, run_suite
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
from .unused_params import unused_params
from .settings import PassSettings, overridden, settings
from .verify import GraphInvariantError, verify, verify_forward

__all__ = [
    "GraphInvariantError",
    "JOINT_PASSES",
    "PassSettings",
    "ShardedGraphBreakWarning",
    "bucket",
    "compile_regions",
    "copy_out",
    "gather_buffers",
    "has_sharded_params",
    "install",
    "keep_order",
    "lower",
    "overridden",
    "place",
    "profile_ranges",
    "rank_check",
    "refunctionalize",
    "reorder",
    "reorder_within_budget",
    "reshard",
    "reuse_first_blocks",
    "run_partitioned_suite",
    "run_pre_grad_suite",
    "run_suite",
    "save_attention",
    "settings",
    "unused_params",
    "verify",
    "verify_forward",
    "warn_if_partial",
]
