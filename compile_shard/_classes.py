"""The classes ``fully_shard`` gives a module, and the user's class behind them.

[Note: the classes of a sharded module]
``fully_shard`` swaps a module's class for a subclass of it, each over the one before:

- where the module registers a sharded parameter, a class with one property per such
  name ([Note: parameters are read through properties] in ``_param``);
- where the module belongs to a block traced as a compile region, a class that counts
  the writes Dynamo does not guard ([Note: a block's attribute writes are counted] in
  ``_regions._attribute_writes``);
- where ``fully_shard`` was applied to it, ``FSDP<Class>``, a subclass of ``FSDPModule``
  (``_api``).

Each of them names the class the user built in ``USER_CLASS``, so that one lookup
finds it from any of them: error messages name it, a container's slice builds it, and
a block's region signature keys on it.
"""

from __future__ import annotations

import torch.nn as nn

#: The attribute of every class ``fully_shard`` swaps in that holds the user's class.
USER_CLASS = "_compile_shard_base"


def user_class(cls: type) -> type:
    """The class the user built, behind every class ``fully_shard`` swapped in."""
    return getattr(cls, USER_CLASS, None) or cls


def user_class_name(module: nn.Module) -> str:
    """The user's class name of ``module``: what messages and group names call it."""
    return user_class(type(module)).__name__


def subclass(cls: type, bases: tuple[type, ...], namespace: dict) -> type:
    """A class swapped in for ``cls``: named and placed as the user's class, which it records."""
    base = user_class(cls)
    namespace = {**namespace, USER_CLASS: base, "__module__": base.__module__, "__qualname__": base.__qualname__}
    return type(base.__name__, bases, namespace)
