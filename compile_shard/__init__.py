"""compile_shard: FSDP2-style fully sharded data parallel that torch.compile captures whole."""

from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    register_fsdp_forward_method,
    share_comm_ctx,
)

from . import ops  # registers the fsdp op library (torch.ops.fsdp)
from ._api import FSDPModule, fully_shard
from ._cache_artifacts import load_cache_artifacts, save_cache_artifacts
from ._regions import RegionInlinedWarning
from ._stand_in import as_torch_fully_shard
from ._versions import warn_if_untested
from .ops import RankMismatchError

warn_if_untested()

# torch's own MixedPrecisionPolicy, OffloadPolicy, CPUOffloadPolicy, DataParallelMeshDims, UnshardHandle,
# register_fsdp_forward_method and share_comm_ctx, the same objects: they work on compile_shard's modules,
# which are torch FSDPModules. Code imports them from torch.distributed.fsdp (docs/api.md).
__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "RankMismatchError",
    "RegionInlinedWarning",
    "UnshardHandle",
    "as_torch_fully_shard",
    "fully_shard",
    "load_cache_artifacts",
    "register_fsdp_forward_method",
    "save_cache_artifacts",
    "share_comm_ctx",
]
