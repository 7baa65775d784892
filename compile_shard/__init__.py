"""compile_shard: FSDP2-style fully sharded data parallel that torch.compile captures whole."""

from . import ops
from ._api import FSDPModule, fully_shard
from ._region import RegionSideEffectError

__all__ = ["FSDPModule", "RegionSideEffectError", "fully_shard", "ops"]
