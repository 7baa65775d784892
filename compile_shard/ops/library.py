"""The ``fsdp`` library object, and how an op module adds an op to it.

An op module ``define``s each op from its schema, which gives the op's Python name,
and registers each function where it is written: ``@kernel(name)`` on the real
kernel, ``@meta(name)`` on the Meta one, ``@autograd(name, setup_context=...)`` on
the backward. So an op's schema, kernels and formula are found by its name, and no
module ends in a table of registrations that must be kept in step with its functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch.library import Library

_lib = Library("fsdp", "FRAGMENT")  # torch.distributed.fsdp owns other fsdp:: names

# The real kernels' keys: one Python implementation serves both (docs/design.md, "The ops").
_BACKEND_KEYS = ("CPU", "CUDA")

_Function = TypeVar("_Function", bound=Callable)


def define(schema: str) -> torch._ops.OpOverload:
    """Defines the op ``schema`` declares and returns its default overload: the op under its Python name.

    An op module binds the result to the op's name (``copy_in = define("copy_in(...) -> Tensor")``), which
    ``compile_shard.ops`` exports, so the name is written once, next to the schema.
    """
    _lib.define(schema)
    return getattr(torch.ops.fsdp, schema.split("(")[0]).default


def kernel(name: str) -> Callable[[_Function], _Function]:
    """Registers the decorated function as op ``name``'s kernel for every backend key; returns it unchanged,
    as other kernels call some of them directly."""

    def register(function: _Function) -> _Function:
        for key in _BACKEND_KEYS:
            _lib.impl(name, function, key)
        return function

    return register


def meta(name: str) -> Callable[[_Function], _Function]:
    """Registers the decorated function as op ``name``'s Meta kernel, which FakeTensor mode (Dynamo, AOTAutograd)
    runs as the op's fake implementation; returns it unchanged."""

    def register(function: _Function) -> _Function:
        _lib.impl(name, function, "Meta")
        return function

    return register


def autograd(name: str, *, setup_context: Callable) -> Callable[[_Function], _Function]:
    """Registers the decorated function as op ``name``'s backward, with ``setup_context`` recording what it reads
    (``torch.library.register_autograd``); returns it unchanged, as eager-mode autograd functions reuse some."""

    def register(backward: _Function) -> _Function:
        torch.library.register_autograd(f"fsdp::{name}", backward, setup_context=setup_context, lib=_lib)
        return backward

    return register
