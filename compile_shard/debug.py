"""Debugging aids: what a sharded model does per step."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ._compile_counts import recompiles
from ._state import get_state
from ._collectives import collective
from .passes.dump import dump_graphs, format_graph

__all__ = ["CollectiveCounter", "dump_graphs", "format_graph", "recompiles", "unsharded_bytes"]


class CollectiveCounter(TorchDispatchMode):
    """Counts collectives and their bytes by kind (``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``).

    Sees compile_shard's ``fsdp`` ops and torch's own c10d ops alike, so the same
    counter measures compile_shard and torch FSDP2 on the same model. ``bytes`` holds,
    per kind, the bytes of each collective's largest buffer: the all-gather output,
    the reduce-scatter input (padded, in the reduction's dtype), what an all-to-all
    or all-reduce sends. They are the same for torch FSDP2's ops and compile_shard's
    (mixed precision shows in them: ``param_dtype`` all-gathers, ``reduce_dtype``
    reductions).

    Around a compiled model it counts what the compiled graphs run and leaves
    compilation alone (``ignore_compile_internals``): torch.compile would otherwise
    run every frame eagerly while a dispatch mode is active, and compile it again
    once the mode is gone. The compiled graphs hold the lowered collectives, so on
    gloo a compiled reduce-scatter counts as an ``all_to_all`` ([Note: gloo
    reduce-scatter] in compile_shard.ops).
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        found = collective(func)
        # The fsdp ops autograd sees issue nothing over a group of one rank
        # ([Note: a group of one rank] in compile_shard.ops).
        if found is not None and not (found.synchronous and args[found.size_arg] == 1):
            self.counts[found.kind] += 1
            self.bytes[found.kind] += max(_nbytes(value) for value in (*args, *kwargs.values(), output))
        return output


@torch.ops.higher_order.invoke_subgraph.py_impl(CollectiveCounter)
def _count_inside_a_region(mode: CollectiveCounter, subgraph, identifier, *operands):
    """A compile region run by an eager backend (``aot_eager``) runs its body's ops under the counter.

    The higher-order op reaches a dispatch mode only through a rule registered for
    that mode's class; the body itself is plain ops.
    """
    with mode:
        return subgraph(*operands)


def _nbytes(value: object) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or a list of them)."""
    return sum(leaf.nbytes for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor))


def unsharded_bytes(module: torch.nn.Module) -> int:
    """Bytes of unsharded parameter storage alive for the fully_shard groups under ``module``.

    Counts storages that autograd still holds for backward as well as the ones
    registered on modules, so it shows whether resharding really freed memory.
    """
    states = (get_state(submodule) for submodule in module.modules())
    return sum(state.group.live_unsharded_bytes() for state in states if state is not None and state.group)
