"""The Python objects op arguments name: a group's all-reduce hook and its custom collectives.

[Note: Python objects named in op arguments]
FSDP2's ``set_all_reduce_hook``, ``set_custom_all_gather`` and
``set_custom_reduce_scatter`` give a group Python objects that its collectives call.
An op argument cannot carry an object, but a string can: a group registers each
object under a name (``new_name``, then ``bind`` for every object it sets), passes
the name to the op, and the op's kernel looks the object up when it runs (``bound``),
as FSDP2 reads its hook and comms when it uses them. Traced, the name is a constant
of the graph and the op a call the compiled graph makes: a compiled graph calls the
Python object in every step, untraced, so its side effects and collectives run as in
eager mode, and binding another object to the name needs no recompile. Names are
numbered in the order groups first register one, which is the same on every rank and
in every run of one program, so a graph from the compile caches calls the object
registered under its name in this process.

The registry refers to each object weakly: the group that set it holds it, as FSDP2's
group holds its hook and comms, so the object goes with its model. A hook that reaches
its model (a trainer's bound method) held strongly by this module's global registry
would keep the model alive for the rest of the process. An object Python cannot refer
to weakly (a method descriptor, an instance of a class with ``__slots__`` and no
``__weakref__``) is held strongly instead.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch

_BOUND: dict[str, Callable[[], Any]] = {}  # name -> the object, dereferenced by calling
_NUMBERS = itertools.count()


def new_name(label: str) -> str:
    """A name no other object in this process is registered under."""
    return f"{label}#{next(_NUMBERS)}"


def bind(name: str, obj: Any) -> None:
    """Registers ``obj`` under ``name``, weakly: the caller keeps ``obj`` alive (see the note above)."""
    if obj is None:
        _BOUND.pop(name, None)
        return
    try:
        _BOUND[name] = weakref.ref(obj, lambda _, name=name: _BOUND.pop(name, None))
    except TypeError:  # cannot be referred to weakly
        _BOUND[name] = lambda: obj


def bound(op_name: str, name: str) -> Any:
    """The object registered under ``name``; an error naming ``op_name`` where there is none."""
    reference = _BOUND.get(name)
    obj = None if reference is None else reference()
    torch._check(obj is not None, lambda: f"fsdp::{op_name}: no object is registered under the name {name!r}")
    return obj
