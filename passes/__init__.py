"""compile_shard's FX pass suite over the AOT joint graph (installed as ``compile_shard.passes``).

The passes run, in this order, on the joint forward-backward graph of a model
sharded with ``fully_shard``, right before the partitioner splits it:

1. ``refunctionalize``: remove traced storage mutations.
2. ``reshard``: tag each group's all-gather chain for recompute or for saving.
3. ``save_attention``: save zero-dropout attention that a checkpoint region would
   recompute (a torch 2.13 partitioner workaround).
4. ``lower``: ``fsdp`` collectives become ``_c10d_functional`` collectives.
5. ``place``: move each group's all-gather next to the forward's first use.
6. ``verify``: check the graph invariants.

``fully_shard`` installs them (``install()``); ``settings`` switches each one off.
A graph holding only part of a sharded model (a graph break) raises a
``ShardedGraphBreakWarning`` once.
The source lives in the repository's top-level ``passes/`` folder and is installed
under the ``compile_shard`` package, so no generic ``passes`` name lands in
site-packages.
"""

from .graph_breaks import ShardedGraphBreakWarning, warn_if_partial
from .install import has_sharded_params, install, run_suite
from .lower import lower
from .place import place
from .refunctionalize import refunctionalize
from .reshard import reshard
from .save_attention import save_attention
from .settings import PassSettings, settings
from .verify import GraphInvariantError, verify, verify_forward

__all__ = [
    "GraphInvariantError",
    "PassSettings",
    "ShardedGraphBreakWarning",
    "has_sharded_params",
    "install",
    "lower",
    "place",
    "refunctionalize",
    "reshard",
    "run_suite",
    "save_attention",
    "settings",
    "verify",
    "verify_forward",
    "warn_if_partial",
]
