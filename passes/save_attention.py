"""save_attention: save, instead of recompute, zero-dropout attention inside checkpoint regions.

[Note: seeded ops under activation checkpointing]
The SDPA kernels are tagged ``nondeterministic_seeded`` (for their dropout). When an
activation-checkpoint region asks for such an op to be recomputed, torch 2.13's
partitioner saves its RNG state for backward (``functionalize_rng_ops``) and appends
that state after the ``DeviceMesh`` objects that DTensor parameters save, which shifts
the saved-tensor slices and fails at run time ("expected all
tensors_saved_with_vc_check to be Tensors"). With ``dropout_p == 0`` the op uses no
randomness, so nothing needs replaying: this pass takes such ops out of recompute and
saves their outputs instead, which is also what torchtitan's selective activation
checkpointing does for attention. Ops with real dropout are left alone.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

_RECOMPUTE = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def _is_deterministic_seeded_op(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    names = [argument.name for argument in target._schema.arguments]
    if "dropout_p" not in names:
        return False
    index = names.index("dropout_p")
    dropout_p = node.args[index] if index < len(node.args) else node.kwargs.get("dropout_p", 0.0)
    return dropout_p == 0


def save_attention(graph: fx.Graph) -> int:
    """Saves every recompute-tagged zero-dropout seeded op; returns how many."""
    changed = 0
    for node in graph.nodes:
        if node.meta.get("recompute") not in _RECOMPUTE or not _is_deterministic_seeded_op(node):
            continue
        node.meta.pop("recompute")
        for user in node.users:
            if user.target is operator.getitem:
                user.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        changed += 1
    return changed
