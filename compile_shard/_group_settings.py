"""A group's settings: what FSDP2's knobs and dtypes make of a ``fully_shard`` call, and what a trace reads.

The eager runtime (``_group``) and the traced one read the same values: the all-gather
parts and their dtypes, the gradient reduction, and ``GroupSettings``, the knobs a trace
treats as one constant ([Note: settings a trace reads as constants]).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from . import ops
from ._param import FSDPParam
from ._versions import REDUCES_IN_THE_PARAMETER_DTYPE


@dataclass(frozen=True)
class GradientReduction:
    """How a group's gradients are reduced: FSDP2's reduce op and divide factors.

    The default averages over the process group. ``FSDPModule.set_gradient_divide_factor(f)``
    divides the sum by ``f`` instead: as one average when ``f`` is the world size, else by
    multiplying each rank's gradient by ``1 / f`` before the sum (FSDP2's
    ``PREMUL_SUM``, which gloo lacks: torch FSDP2 raises there, compile_shard does not).
    ``set_force_sum_reduction_for_comms(True)`` makes the collective a plain sum and
    divides its output by ``f`` (default: the world size) after it, skipping a division
    by 1. A reduction in a dtype with a narrow range (fp16, anything but fp32 and bf16)
    also sums, dividing by a power of two close to ``sqrt(f)`` before the sum and by the
    rest after it, against overflow (multiplying by ``2**-k`` is exact, so it gives the
    bits of FSDP2's division).
    """

    reduce_op: str = "avg"
    premul_factor: float = 1.0
    postdivide_factor: float = 1.0

    @staticmethod
    def choose(
        world_size: int, divide_factor: float | None, force_sum: bool, reduce_dtype: torch.dtype
    ) -> GradientReduction:
        factor = float(world_size if divide_factor is None else divide_factor)
        overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
        if not overflow_risk and not force_sum:
            if factor == world_size:
                return GradientReduction()
            return GradientReduction("sum", premul_factor=1.0 / factor)
        if not overflow_risk:
            return GradientReduction("sum", postdivide_factor=factor)
        predivide_factor = 1
        while factor % predivide_factor == 0 and factor / predivide_factor > predivide_factor:
            predivide_factor *= 2
        return GradientReduction(
            "sum", premul_factor=1.0 / predivide_factor, postdivide_factor=factor / predivide_factor
        )


@dataclass(frozen=True)
class AllGatherPart:
    """The parameters of a group that one ``fsdp::all_gather_into`` gathers.

    [Note: one all-gather per wire dtype]
    An all-gather moves one dtype: the parameters' ``param_dtype`` under mixed
    precision, else their own. A group whose parameters arrive in several dtypes (frozen
    bf16 weights beside trainable fp32 adapters) gathers once per dtype, in the order
    the parameters first appear; FSDP2 packs them as bytes into one all-gather instead
    (the same bytes, one collective fewer), which would leave autograd without a
    floating-point output to differentiate. Trainable parameters share one dtype
    (``fully_shard`` checks it, as FSDP2 does at its first forward), so one part at
    most takes gradients and the group still has one reduce-scatter.
    """

    indices: tuple[int, ...]
    padded_numels: tuple[int, ...]
    unsharded_shapes: tuple[torch.Size, ...]
    #: ``all_gather_into``'s cast: the part's dtype where a shard is in another, else None.
    param_dtype: torch.dtype | None
    #: torch 2.15's grad_dtype: the sharded gradients' dtypes, comma-separated, where one is not its shard's.
    grad_dtypes: str | None = None


@dataclass(frozen=True)
class ReshardGroup:
    """FSDP2's ``reshard_after_forward=<int>``: the smaller group a group's parameters stay sharded over after forward.

    [Note: resharding to a smaller group]
    Between forward and backward each rank keeps ``1 / size`` of every all-gather
    output, its post-forward chunk (FSDP2's post-forward shard): the all-gather output
    is rank-major over the group's ``world_size`` ranks, so chunk ``rank`` of ``size`` equal chunks holds the
    shards of ``world_size / size`` consecutive ranks. Backward all-gathers these
    chunks over ``size`` ranks (``group_name``: ranks that are consecutive within the
    shard group, FSDP2's post-forward mesh), which rebuilds the whole output in the
    same layout: fewer bytes held than the unsharded parameters, a smaller group to
    gather over than the shard group.
    """

    size: int
    rank: int
    group_name: str

    def chunk(self, all_gather_output: torch.Tensor) -> torch.Tensor:
        """This rank's post-forward chunk of ``all_gather_output``: a copy, so the output itself can be freed."""
        return ops.post_forward_chunk(all_gather_output.detach(), self.size, self.rank)


def wire_dtype(fsdp_param: FSDPParam, mp_policy: MixedPrecisionPolicy) -> torch.dtype:
    """What the parameter is all-gathered and computed in: ``param_dtype`` for floating-point parameters (FSDP2)."""
    dtype = fsdp_param.sharded_param.dtype
    return mp_policy.param_dtype if mp_policy.param_dtype is not None and dtype.is_floating_point else dtype


def all_gather_parts_of(fsdp_params: list[FSDPParam], mp_policy: MixedPrecisionPolicy) -> tuple[AllGatherPart, ...]:
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, fsdp_param in enumerate(fsdp_params):
        by_dtype.setdefault(wire_dtype(fsdp_param, mp_policy), []).append(index)
    parts = []
    for dtype, indices in by_dtype.items():
        params = [fsdp_params[index] for index in indices]
        casts = any(fsdp_param.sharded_param.dtype != dtype for fsdp_param in params)
        parts.append(
            AllGatherPart(
                tuple(indices),
                tuple(fsdp_param.padded_numel for fsdp_param in params),
                tuple(fsdp_param.unsharded_shape for fsdp_param in params),
                dtype if casts else None,
            )
        )
    return tuple(parts)


def gradient_dtype_of(fsdp_params: list[FSDPParam], mp_policy: MixedPrecisionPolicy) -> torch.dtype:
    """The dtype of the group's unsharded gradients: its trainable parameters' wire dtype."""
    trainable = [fsdp_param for fsdp_param in fsdp_params if fsdp_param.sharded_param.requires_grad]
    return wire_dtype((trainable or fsdp_params)[0], mp_policy)


def reduce_dtype_of(
    fsdp_params: list[FSDPParam], mp_policy: MixedPrecisionPolicy, gradient_dtype: torch.dtype
) -> torch.dtype | None:
    """What gradients are cast to for the reduction; None where they are reduced in their own dtype.

    ``reduce_dtype``, else on torch 2.15 the trainable parameters' own dtype
    (``REDUCES_IN_THE_PARAMETER_DTYPE``); FSDP2 clamps one equal to the gradients' dtype.
    """
    reduce_dtype = mp_policy.reduce_dtype
    if reduce_dtype is None and REDUCES_IN_THE_PARAMETER_DTYPE:
        trainable = [fsdp_param for fsdp_param in fsdp_params if fsdp_param.sharded_param.requires_grad]
        # FSDP2 2.15: promoted over each parameter's unsharded grad dtype: an explicit grad_dtype, else its
        # own dtype; grad_dtype=None takes the incoming gradient's (``gradient_dtype``).
        dtypes = [_unsharded_grad_dtype(p) or gradient_dtype for p in (trainable or fsdp_params)]
        reduce_dtype = functools.reduce(torch.promote_types, dtypes)
    return None if reduce_dtype in (None, gradient_dtype) else reduce_dtype


def _unsharded_grad_dtype(fsdp_param: FSDPParam) -> torch.dtype | None:
    explicit, dtype = fsdp_param.grad_dtype_policy
    return dtype if explicit else fsdp_param.sharded_param.dtype


class PartSettings(NamedTuple):
    """What one part's all-gather takes from the group's settings."""

    takes_gradients: bool
    #: Whether the all-gather reads every parameter's ``shard`` as it is: each takes a gradient and none is kept in
    #: CPU memory (``ShardMemory.all_gather_shard`` has the general case).
    reads_shards: bool
    #: ``fsdp::all_gather_into``'s optional arguments from the settings; those that gradient
    #: accumulation changes from step to step at their defaults (``_all_gather_options``).
    options: ops.ReductionOptions
    #: ``options.positional()``: each field's value, and how many a call passes.
    values: tuple
    given: int


class GatherSettings(NamedTuple):
    """What the all-gathers take from the group's settings: per parameter, ``requires_grad``; per part, its own."""

    requires_grad: tuple[bool, ...]
    #: The group's, fixed when it was sharded: a constant in a trace, like the rest.
    all_gather_parts: tuple[AllGatherPart, ...]
    parts: tuple[PartSettings, ...]


class TracedSettings(NamedTuple):
    """What a trace reads of a group's settings, as one constant ([Note: settings a trace reads as constants])."""

    gather: GatherSettings
    #: ``annotating_group``'s argument ([Note: the group annotation] in compile_shard._annotation).
    annotation: dict


#: Per distinct settings (of any group), their version: settings set back to earlier values
#: get the earlier version back, and the graph compiled for it.
_settings_versions: dict[tuple, int] = {}


def settings_version(settings: tuple) -> int:
    """The version of ``settings`` (a group's annotation and gather settings), the same for equal ones."""
    return _settings_versions.setdefault(settings, len(_settings_versions))


@dataclass(frozen=True)
class GroupSettings:
    """The knobs of one group that a trace reads, set by the group's named setters.

    One frozen value per group, replaced whole (``dataclasses.replace``: a misspelt name
    raises): what ``traced_settings`` reads as a constant, what the settings version a
    recompile keys on is computed from, and the source of the group's annotation
    ([Note: the group annotation]). What eager mode alone reads (gradient sync, kept
    storage) stays on the group.
    """

    module_name: str
    reshard_after_forward: bool
    #: FSDP2's ``reshard_after_forward=<int>``: the smaller group to reshard to instead.
    reshard_group: ReshardGroup | None = None
    #: The names of every group under the same root, set by the root: lets the pass suite
    #: notice a graph that holds only part of the model (a graph break).
    model_groups: tuple[str, ...] = ()
    #: FSDP2's ``set_reshard_after_backward`` ([Note: unsharded parameters kept after backward]).
    reshard_after_backward: bool = True
    #: FSDP2's explicit prefetch lists: the groups to gather when this one's forward (backward) starts.
    forward_prefetch: tuple = ()
    backward_prefetch: tuple = ()
    #: FSDP2's divide factors and reduce op, chosen for the reduction's dtype.
    gradient_reduction: GradientReduction = GradientReduction()
    #: FSDP2's ``set_reduce_scatter_unused_params`` ([Note: unused parameters] in passes.unused_params).
    reduce_scatter_unused_params: bool = False
    #: FSDP2's ``set_separate_reduce_scatter_group``: the reduce-scatters' own process group.
    reduce_scatter_group_name: str | None = None
    #: The names the ops find FSDP2's all-reduce hook and custom collectives by ([Note: Python
    #: objects named in op arguments] in compile_shard.ops.names), None where unset.
    all_reduce_hook_name: str | None = None
    all_gather_comm_name: str | None = None
    reduce_scatter_comm_name: str | None = None


@dataclass(frozen=True)
class GroupDtypes:
    """What the parameters' dtypes and the mixed-precision policy make of a group: FSDP2's ``_init_mp_dtypes``.

    [Note: dtypes settled before each step]
    FSDP2 settles its dtypes at its lazy init, the first forward: a model sharded in
    bf16 and then cast with ``.to(torch.float32)`` trains in fp32, and a policy's
    dtypes are clamped against the parameters' dtypes of then. compile_shard settles
    them at ``fully_shard`` and again wherever the parameters' dtypes, ``requires_grad``
    or ``grad_dtype`` changed since (``key``): in ``_apply`` (``module.to``) and before
    each of the root's steps, where a new settings version makes a compiled model
    recompile. As at FSDP2's lazy init, the trainable parameters of a group must share
    one dtype by then (``AssertionError``, FSDP2's type): their gradients are reduced as
    one buffer.
    """

    #: What they were resolved from: each parameter's dtype, ``requires_grad`` and ``grad_dtype``.
    key: tuple
    all_gather_parts: tuple[AllGatherPart, ...]
    #: The dtype of the group's unsharded gradients: its trainable parameters' wire dtype.
    gradient_dtype: torch.dtype
    #: What gradients are cast to for the reduction; None where they are reduced in their own dtype.
    reduce_dtype: torch.dtype | None

    @property
    def reduction_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced (and accumulated without sync) in: FSDP2's order of fallbacks."""
        return self.reduce_dtype or self.gradient_dtype

    @staticmethod
    def key_of(fsdp_params: list[FSDPParam]) -> tuple:
        return tuple(
            (fsdp_param.sharded_param.dtype, fsdp_param.sharded_param.requires_grad, fsdp_param.grad_dtype_policy)
            for fsdp_param in fsdp_params
        )

    @classmethod
    def resolve(cls, fsdp_params: list[FSDPParam], mp_policy: MixedPrecisionPolicy) -> GroupDtypes:
        gradient_dtype = gradient_dtype_of(fsdp_params, mp_policy)
        reduce_dtype = reduce_dtype_of(fsdp_params, mp_policy, gradient_dtype)
        reduction_dtype = reduce_dtype or gradient_dtype
        parts = []
        for part in all_gather_parts_of(fsdp_params, mp_policy):  # [Note: grad_dtype] in compile_shard._gradient_rules
            dtypes = [fsdp_params[index].sharded_grad_dtype(reduction_dtype) for index in part.indices]
            differs = any(dtype != fsdp_params[index].sharded_param.dtype for dtype, index in zip(dtypes, part.indices))
            names = ",".join(str(dtype).removeprefix("torch.") for dtype in dtypes) if differs else None
            parts.append(dataclasses.replace(part, grad_dtypes=names))
        return cls(cls.key_of(fsdp_params), tuple(parts), gradient_dtype, reduce_dtype)
