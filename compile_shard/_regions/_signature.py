"""What must be equal for two sharded blocks to share one compiled region, apart from what the key reads."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from .._classes import user_class
from ._attribute_writes import PLAIN


def _plain_value(value: Any) -> Any:
    """``value`` itself if plain, containers item by item (a hook dict by its hooks), else its identity.

    A ``functools.partial`` by its function and arguments: ``checkpoint_wrapper`` gives
    each block its own ``partial(checkpoint, use_reentrant=False, ...)``, which calls
    the same function with the same arguments in every block.
    """
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, functools.partial):
        keywords = tuple((name, _plain_value(item)) for name, item in value.keywords.items())
        return ("partial", _plain_value(value.func), _plain_value(value.args), keywords)
    if isinstance(value, (tuple, list)):
        return tuple(_plain_value(item) for item in value)
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(repr(_plain_value(item)) for item in value))
    if isinstance(value, dict):
        return tuple(_plain_value(item) for item in value.values())
    return ("object", id(value))


# Left out of a block's signature: the tensors and submodules, which it lists itself,
# and the state-dict hooks, which no forward runs (``checkpoint_wrapper`` registers
# a bound method of each wrapper).
_NOT_SIGNED = frozenset(
    {
        "_parameters",
        "_buffers",
        "_modules",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    }
)


def block_signature(module: nn.Module) -> tuple:
    """Per submodule: its user class, its parameters' and buffers' names, shapes, dtypes
    and ``requires_grad``, its hooks, and its other attributes that are not plain
    values (containers item by item, objects by identity).

    Plain values (``training``, ``eps``, a ``layer_id``) are left out: the key reads
    those the body's traces read, where Dynamo guards on them ([Note: region keys are
    guarded] in ``_key``).
    """
    signature = []
    for name, submodule in module.named_modules():
        cls = user_class(type(submodule))
        tensors = tuple(
            (kind, tensor_name, tuple(tensor.shape), tensor.dtype, tensor.requires_grad)
            for kind, tensors in (("param", submodule._parameters), ("buffer", submodule._buffers))
            for tensor_name, tensor in tensors.items()
            if tensor is not None
        )
        attributes = tuple(
            (key, _plain_value(value))
            for key, value in sorted(submodule.__dict__.items())
            if key not in _NOT_SIGNED and not key.startswith("_compile_shard") and not isinstance(value, PLAIN)
        )
        signature.append((name, cls.__module__, cls.__qualname__, tensors, attributes))
    return tuple(signature)


@torch.compiler.assume_constant_result
def signature_hash(module: nn.Module) -> int:
    """``hash(block_signature(module))``, computed by plain Python while Dynamo traces the call.

    Traced, the signature costs Dynamo time at each call site (see [Note: region
    arguments are flat] in ``_arguments``); computed here, it is read when each trace
    runs, so hooks and attributes set after ``fully_shard`` count. Dynamo does not
    guard on it: an attribute written after the first compile recompiles because the
    key reads the plain values and the count of the other writes ([Note: region keys
    are guarded] in ``_key``). A hook added after the first compile is not seen, as
    Dynamo does not guard on hooks by default (``skip_nnmodule_hook_guards``), with or
    without regions.
    """
    return hash(block_signature(module))
