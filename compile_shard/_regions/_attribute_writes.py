"""Counts the writes to a sharded block's modules that Dynamo does not guard, so that a compiled region sees them.

[Note: a block's attribute writes are counted]
A block that reuses another block's compiled region runs a body Dynamo traced, and
guarded, on the first block's modules: nothing guards what the later blocks hold. So
``call_in_region`` reads the plain attributes of each block's modules that the body
reads in the outer trace, a guard on each value ([Note: region keys are guarded] in
``_regions._key``), and the region key holds the rest of the block's signature by identity
when the trace runs.
Two kinds of write escape both: an attribute added to (or deleted from) a later block
after the first compile, and an object attribute replaced by another object. Each module of
a region block therefore has a class with ``CountsWrites``'s ``__setattr__`` and
``__delattr__``, which raise the block's count (``region_writes`` of its ``FSDPState``,
of each block a module shared between blocks belongs to) on such a write;
``call_in_region`` reads that one integer with the plain attributes, so the write fails
the guard, and the recompile keys the block anew.

A submodule added, replaced or deleted counts too, and the block's owner (its
``FSDPState``) lists its modules anew (``region_changed``), so that the new ones count
their writes and their hooks and attributes are read like the others'.

Not counted, so that a write the guards already see costs no recompile: a plain value
replaced by a plain value (guarded by value where a body reads it, and nothing
computed depends on it where none does), and a tensor replaced by a
tensor (Dynamo reads a tensor attribute from its module at every call, and guards on
whether two blocks' tensors are the same object, which the region key reads). A
non-tensor object assigned to a block's attribute at every step (by the caller, in
the compiled forward) therefore recompiles at every step: pass it as an argument.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from .._classes import subclass

#: The owners (``RegionOwner``) of the blocks a module belongs to, set on the module.
_OWNERS_ATTR = "_compile_shard_region_owners"

#: Values compared by value: a region key holds them, and Dynamo guards on each read of one.
PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)
_ABSENT = object()


def _changes_what_guards_miss(before: Any, after: Any) -> bool:
    if before is after:
        return False
    if before is _ABSENT or after is _ABSENT:
        return True
    if isinstance(before, PLAIN) and isinstance(after, PLAIN):
        return False
    return not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor))


class RegionOwner(Protocol):
    """What holds a region block's list of modules and counts their writes (``FSDPState``)."""

    region_writes: int

    def region_changed(self) -> None:
        """Lists the block's modules anew: a submodule was added, replaced or deleted."""


def _held(module: torch.nn.Module, name: str) -> Any:
    """What ``name`` names on ``module``: an entry of its ``__dict__`` or a submodule."""
    value = module.__dict__.get(name, _ABSENT)
    return module.__dict__.get("_modules", {}).get(name, _ABSENT) if value is _ABSENT else value


class CountsWrites:
    """Mixed into the classes fully_shard gives modules; counts writes on the modules of region blocks only."""

    def __setattr__(self, name: str, value: Any) -> None:
        before = _held(self, name)
        super().__setattr__(name, value)
        self._count_write(before, _held(self, name))

    def __delattr__(self, name: str) -> None:
        before = _held(self, name)
        super().__delattr__(name)
        self._count_write(before, _held(self, name))

    def _count_write(self, before: Any, after: Any) -> None:
        owners = self.__dict__.get(_OWNERS_ATTR)
        if owners is None or not _changes_what_guards_miss(before, after):
            return
        submodule_changed = isinstance(before, torch.nn.Module) or isinstance(after, torch.nn.Module)
        for owner in owners:
            owner.region_writes += 1
            if submodule_changed:
                owner.region_changed()


_COUNTING_CLASSES: dict[type, type] = {}


def writes_counting_class(cls: type) -> type:
    """``cls`` if it counts writes, else its subclass that does ([Note: the classes of a sharded module])."""
    if issubclass(cls, CountsWrites):
        return cls
    if cls not in _COUNTING_CLASSES:
        _COUNTING_CLASSES[cls] = subclass(cls, (CountsWrites, cls), {})
    return _COUNTING_CLASSES[cls]


def count_writes(modules: list[torch.nn.Module], owner: RegionOwner) -> None:
    """Starts counting the writes to ``modules`` (a region block's modules) that Dynamo does not guard."""
    for module in modules:
        module.__class__ = writes_counting_class(type(module))
        owners = module.__dict__.get(_OWNERS_ATTR, ())
        if owner not in owners:
            module.__dict__[_OWNERS_ATTR] = (*owners, owner)
