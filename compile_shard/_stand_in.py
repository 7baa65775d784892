"""compile_shard's ``fully_shard`` standing in for torch's inside code written for FSDP2.

[Note: standing in for torch's fully_shard]
Trainers (torchtitan, Hugging Face Accelerate) call torch's ``fully_shard``, most of
them through a name bound when their module was imported
(``from torch.distributed.fsdp import fully_shard``). Rebinding
``torch.distributed.fsdp.fully_shard`` alone would miss those, so
``as_torch_fully_shard`` rebinds every global named ``fully_shard`` that holds torch's
function object: in torch's own modules and in every loaded module (a name a user
chose for torch's function, ``torch_fully_shard``, is left alone). A module imported inside the block
binds compile_shard's function through torch's rebound name. On exit every such
binding is torch's again, the ones made inside the block included, so nothing stays
patched. Nothing else changes: compile_shard's modules are torch ``FSDPModule``
instances (``isinstance`` checks hold), and ``MixedPrecisionPolicy`` and the other
classes trainers pass in are torch's own.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from types import ModuleType

from torch.distributed.fsdp._fully_shard import _fully_shard as _torch_module

from ._api import fully_shard

_TORCH_FULLY_SHARD = _torch_module.fully_shard


def _bindings(function: object) -> list[ModuleType]:
    """The loaded modules whose global ``fully_shard`` is ``function``."""
    return [
        module
        for module in list(sys.modules.values())
        if isinstance(getattr(module, "__dict__", None), dict) and module.__dict__.get("fully_shard") is function
    ]


@contextlib.contextmanager
def as_torch_fully_shard() -> Iterator[None]:
    """Inside the block, code that calls torch's ``fully_shard`` calls compile_shard's.

    ``with compile_shard.as_torch_fully_shard(): parallelize(model)`` shards a model
    that a framework builds with FSDP2's calls; ``torch.compile`` of it then gives one
    forward and one backward graph. See [Note: standing in for torch's fully_shard].
    """

    # A wrapper of this block's own: on exit, what holds it was bound through torch's names.
    @functools.wraps(fully_shard)
    def stand_in(*args, **kwargs):
        return fully_shard(*args, **kwargs)

    for module in _bindings(_TORCH_FULLY_SHARD):
        module.fully_shard = stand_in
    try:
        yield
    finally:
        for module in _bindings(stand_in):
            module.fully_shard = _TORCH_FULLY_SHARD
