"""Debugging aids: what a sharded model does per step."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveCounter", "unsharded_bytes"]


def _collective_kinds() -> dict[object, str]:
    kinds = {
        "all_gather": [
            "fsdp.all_gather_into",
            "c10d._allgather_base_",
            "c10d.allgather_",
            "c10d.allgather_into_tensor_coalesced_",
            "_c10d_functional.all_gather_into_tensor",
            "_c10d_functional.all_gather_into_tensor_coalesced",
        ],
        "reduce_scatter": [
            "fsdp.reduce_scatter_grad",
            "c10d._reduce_scatter_base_",
            "c10d.reduce_scatter_",
            "c10d.reduce_scatter_tensor_coalesced_",
            "_c10d_functional.reduce_scatter_tensor",
            "_c10d_functional.reduce_scatter_tensor_coalesced",
        ],
        "all_reduce": ["c10d.allreduce_", "c10d.allreduce_coalesced_", "_c10d_functional.all_reduce"],
    }
    table = {}
    for kind, names in kinds.items():
        for name in names:
            namespace, op_name = name.split(".")
            packet = getattr(getattr(torch.ops, namespace), op_name, None)
            if packet is not None:
                table[packet] = kind
    return table


class CollectiveCounter(TorchDispatchMode):
    """Counts collectives by kind (``all_gather``, ``reduce_scatter``, ``all_reduce``).

    Sees compile_shard's ``fsdp`` ops and torch's own c10d ops alike, so the same
    counter measures compile_shard and torch FSDP2 on the same model.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._kinds = _collective_kinds()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = self._kinds.get(func.overloadpacket)
        if kind is not None:
            self.counts[kind] += 1
        return func(*args, **(kwargs or {}))


def unsharded_bytes(module: torch.nn.Module) -> int:
    """Bytes of unsharded parameter storage alive for the fully_shard groups under ``module``.

    Counts storages that autograd still holds for backward as well as the ones
    registered on modules, so it shows whether resharding really freed memory.
    """
    from ._api import _get_state

    states = (_get_state(submodule) for submodule in module.modules())
    return sum(state.group.live_unsharded_bytes() for state in states if state is not None and state.group)
