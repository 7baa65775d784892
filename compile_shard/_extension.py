"""FSDP2's all-gather extension protocol: how a tensor-subclass parameter is gathered.

[Note: all-gather extensions]
FSDP2's protocol for tensor-subclass parameters (quantized all-gathers, float8
training): a local tensor with ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``.
Before each all-gather, ``fsdp_pre_all_gather(mesh, size, stride, module,
mp_policy)`` makes the shard into all-gather inputs (several, of any dtypes, each of
the padded shard's size when the parameter is sharded unevenly) and metadata; each
input is gathered rank-major, and ``fsdp_post_all_gather(outputs, metadata,
param_dtype)`` makes the unsharded parameter of them, whose first ``rows`` rows the
modules compute with. The group gathers the inputs by dtype
(``GatheringGroup._gather_with_extensions``), under no_grad: nothing the transforms
compute is differentiated. As in FSDP2, the gradient of the unsharded parameter is
the sharded parameter's, straight through the two transforms: ``ops.as_gathered``
gives the unsharded parameter the all-gather's backward ([Note: unsharded parameters
gathered outside all_gather_into] in compile_shard.ops), so it is reduced like any
other in one reduce-scatter per group. Traced, Dynamo inlines both methods on the
subclass input, and the graph holds their ops beside the gathers.
compile_shard calls ``fsdp_post_all_gather`` without ``out=`` at every gather and
copies the result into the freed unsharded storage on a refill. Where the result is
a tensor subclass (torchao's float8 weights), eager mode frees and refills its inner
tensors (``_group._storage_leaves``) and gives it the all-gather's backward as views
(``ops.as_gathered_views``); a compiled graph refuses it: Dynamo traces the
gradient of such a view as the subclass, which the reduction cannot take.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy


@dataclass(frozen=True)
class AllGatherExtension:
    """A local tensor's ``fsdp_pre_all_gather`` and ``fsdp_post_all_gather``, as they are called.

    Read off the local tensor outside any trace, at ``fully_shard`` and again at the
    first forward (FSDP2's lazy init reads them again too: "allow monkey patch after
    init", so methods set on the local tensor object after ``fully_shard`` or
    ``to_empty`` count). Dynamo does not trace ``inspect.signature``. A class's methods
    are kept as functions, which Dynamo inlines where it would record a method call on
    the tensor as one opaque node; methods set on the object are called bound, as
    FSDP2 calls them. FSDP2 accepts the older form, ``fsdp_pre_all_gather(mesh)``, too.
    """

    pre_all_gather: Callable[..., Any]
    post_all_gather: Callable[..., Any]
    pre_all_gather_takes_mesh_only: bool

    @classmethod
    def of(cls, local_tensor: torch.Tensor, fqn: str) -> AllGatherExtension | None:
        """The extension of ``local_tensor``, None where it has none; only one of the two methods is FSDP2's error."""
        has_pre = hasattr(local_tensor, "fsdp_pre_all_gather")
        if has_pre != hasattr(local_tensor, "fsdp_post_all_gather"):
            raise ValueError(
                f"fully_shard: parameter {fqn!r} is a {type(local_tensor).__name__} with only one of "
                "fsdp_pre_all_gather and fsdp_post_all_gather; an all-gather extension defines both, as in FSDP2"
            )
        if not has_pre:
            return None
        own = getattr(local_tensor, "__dict__", {})
        functions = []
        for name in ("fsdp_pre_all_gather", "fsdp_post_all_gather"):
            method = own.get(name)
            if method is None:
                functions.append(getattr(type(local_tensor), name))
            else:  # set on the object: called bound, without the shard a class's function takes first

                def function(shard: torch.Tensor, *args: Any, _method: Any = method, **kwargs: Any) -> Any:
                    return _method(*args, **kwargs)

                functions.append(function)
        takes_mesh_only = len(inspect.signature(local_tensor.fsdp_pre_all_gather).parameters) == 1
        return cls(*functions, takes_mesh_only)

    def inputs(
        self,
        shard: torch.Tensor,
        mesh: DeviceMesh,
        unsharded_shape: torch.Size,
        contiguous_stride: tuple[int, ...],
        module: torch.nn.Module,
        mp_policy: MixedPrecisionPolicy,
    ) -> tuple[list[torch.Tensor], Any]:
        """The all-gather inputs and metadata ``fsdp_pre_all_gather`` makes of the shard."""
        if self.pre_all_gather_takes_mesh_only:
            inputs, metadata = self.pre_all_gather(shard, mesh)
        else:
            inputs, metadata = self.pre_all_gather(shard, mesh, unsharded_shape, contiguous_stride, module, mp_policy)
        return list(inputs), metadata

    def unsharded(
        self, shard: torch.Tensor, all_gather_outputs: list[torch.Tensor], metadata: Any, param_dtype: torch.dtype
    ) -> torch.Tensor:
        """What ``fsdp_post_all_gather`` makes of the gathered inputs."""
        unsharded, _ = self.post_all_gather(shard, tuple(all_gather_outputs), metadata, param_dtype)
        return unsharded
