"""A region call's arguments as one flat tuple, and back.

[Note: region arguments are flat]
Dynamo flattens a region call's arguments with a traced ``pytree.tree_flatten``
unless every argument is already a leaf (a tensor, a module or a constant); that and
tracing the block's signature inside the key (``signature_hash`` computes it
untraced) cost Dynamo time at every call site. So a region call passes the unsharded
parameters, the args' leaves, the kwargs' names and then their values' leaves one by
one, with the count of parameters and a layout string that rebuilds the args and
kwargs (``_flatten``: a tuple or list of leaves, such as Hugging Face's
``position_embeddings``, is one level deep). The kwargs come sorted by name: a reused
subgraph maps its tensor inputs by position, so blocks called with the same keywords
in another order must line up. The key reads the leaves and the layout without
rebuilding anything.
"""

from __future__ import annotations

from typing import Any

import torch

from ._attribute_writes import PLAIN

_ACCEPTED = (torch.Tensor, *PLAIN)


def _flatten(values: list[Any]) -> tuple[str, list[Any], bool]:
    """``values`` as leaves, a layout that rebuilds them (per value ``.``, a leaf, or ``t``/``l`` and a count), and
    whether a region can take them: tensors and plain values, and tuples and lists of those.

    Anything else runs the block inlined: a deeper structure or an object (the layout
    describes one level). Loops, not ``all()``: Dynamo traces this at every block, and a
    generator costs it more.
    """
    tokens, leaves, accepted = [], [], True
    for value in values:
        if isinstance(value, (tuple, list)):
            tokens.append(("t" if isinstance(value, tuple) else "l") + str(len(value)))
            leaves.extend(value)
            for item in value:
                if not isinstance(item, _ACCEPTED):
                    accepted = False
        else:
            tokens.append(".")
            leaves.append(value)
            if not isinstance(value, _ACCEPTED):
                accepted = False
    return ",".join(tokens), leaves, accepted


def _unflatten(layout: str, leaves: tuple) -> tuple[list[Any], tuple]:
    """The values ``_flatten`` made ``layout`` and the first of ``leaves`` from, and the leaves left."""
    values, at = [], 0
    for token in layout.split(",") if layout else ():
        if token == ".":
            values.append(leaves[at])
            at += 1
        else:
            items = leaves[at : at + int(token[1:])]
            values.append(tuple(items) if token[0] == "t" else list(items))
            at += len(items)
    return values, leaves[at:]


def flat_arguments(inputs: list[torch.Tensor], args: tuple, kwargs: dict) -> tuple[tuple, str, bool]:
    """A region call's flat arguments (``inputs``, then the call's), the layout that rebuilds the call's, and
    whether a region can take them (``_flatten``)."""
    names = tuple(sorted(kwargs))
    positional, arg_leaves, args_accepted = _flatten(list(args))
    named, value_leaves, values_accepted = _flatten([kwargs[name] for name in names])
    flat = (*inputs, *arg_leaves, *names, *value_leaves)
    return flat, f"{positional}|{named}", args_accepted and values_accepted


def call_arguments(num_params: int, layout: str, flat: tuple) -> tuple[tuple, list, dict]:
    """Splits ``flat_arguments``'s tuple back into unsharded parameters, args and kwargs."""
    params = flat[:num_params]
    positional, named = layout.split("|")
    args, rest = _unflatten(positional, flat[num_params:])
    num_names = len(named.split(",")) if named else 0
    values, _ = _unflatten(named, rest[num_names:])
    return params, args, dict(zip(rest[:num_names], values))
