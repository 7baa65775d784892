"""compile_shard: FSDP2-style fully sharded data parallel that torch.compile captures whole."""

from . import ops
from ._api import FSDPModule, fully_shard
from ._region import RegionInlinedWarning

__all__ = ["FSDPModule", "RegionInlinedWarning", "fully_shard", "ops"]
