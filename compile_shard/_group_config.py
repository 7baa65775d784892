"""A group's parameters and settings: what FSDP2's knobs set, what the dtypes make of them, and what a trace reads.

The first of a group's three layers: ``ConfiguredGroup`` (here) holds the parameters,
the frozen settings and dtypes and their setters, and the gradients accumulated
between reductions; ``GatheringGroup`` (``_group_gather``) gathers them, eagerly and in
a trace; ``FSDPParamGroup`` (``_group``) runs the unshard/reshard lifecycle around the
modules' forward and backward.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from . import ops
from ._annotation import GroupAnnotation
from ._gradient_buffers import GradientBuffers
from ._group_settings import (
    AllGatherPart,
    GatherSettings,
    GradientReduction,
    GroupDtypes,
    GroupSettings,
    PartSettings,
    ReshardGroup,
    settings_version,
    wire_dtype,
)
from ._param import FSDPParam, share_slots
from ._regions import register_owned_state
from ._versions import ROUNDS_EACH_GRADIENT_CONTRIBUTION




class ConfiguredGroup:
    """The parameters of one ``fully_shard`` call and the settings they are gathered and reduced with."""

    def __init__(
        self,
        fsdp_params: list[FSDPParam],
        module_name: str,
        mesh: DeviceMesh,
        reshard_after_forward: bool,
        forwards_per_iteration: int = 1,
        mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
        reshard_group: ReshardGroup | None = None,
    ):
        self.fsdp_params = fsdp_params
        for fsdp_param in fsdp_params:
            fsdp_param.group_ref = weakref.ref(self)
        # What the modules read, and the eager use flags, per parameter ([Note: one mutated list per group]).
        self.shown_params, self.use_flags = share_slots(fsdp_params)
        # A traced forward's all-gather outputs, gathered for the block's region to copy out ([Note: a region
        # copies out its block's parameters] in compile_shard._regions._call); None outside that window.
        self.traced_all_gather_outputs: list[torch.Tensor] | None = None
        register_owned_state(self, (self, self.shown_params, self.use_flags))
        self.mesh = mesh
        # The shard dimension's group gathers and reduce-scatters; on HSDP's 2-D mesh each
        # reduce-scatter is followed by an all-reduce over the replicate dimension's group.
        self.world_size = mesh.size(-1)
        self.group_name = mesh.get_group(mesh.ndim - 1).group_name
        #: Its global ranks: ``set_separate_reduce_scatter_group`` makes one group per set of them.
        self.ranks = tuple(dist.get_process_group_ranks(mesh.get_group(mesh.ndim - 1)))
        self.replicate_group_name = mesh.get_group(0).group_name if mesh.ndim == 2 else None
        self.data_parallel_size = mesh.size()
        # FSDP2's knobs a trace reads, set through the named setters below ([Note: settings a trace reads as
        # constants]); the gradient reduction is chosen with the dtypes (``_resolve_dtypes``).
        self.settings = GroupSettings(
            module_name=module_name,
            reshard_after_forward=reshard_after_forward,
            reshard_group=reshard_group,
            model_groups=(module_name,),
        )
        self.mp_policy = mp_policy
        # [Note: all-gather extensions] in compile_shard._extension.
        self.has_extensions = any(fsdp_param.has_extension for fsdp_param in fsdp_params)
        # Whether the unshard could be one all-gather per part and a plain copy-out, extensions aside.
        self._gathers_plainly = (
            mesh.size(-1) > 1
            and reshard_group is None
            and forwards_per_iteration == 1
            and all(fsdp_param.shard_dim == 0 and fsdp_param.tp_spec is None for fsdp_param in fsdp_params)
        )
        self._extensions_changed()
        # FSDP2's knobs for the gradient reduction (set_gradient_divide_factor and
        # set_force_sum_reduction_for_comms); read when the all-gather runs or is traced.
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction_for_comms = False
        # FSDP2's set_requires_gradient_sync and set_requires_all_reduce, and what they accumulate.
        self.buffers = GradientBuffers(replicates=self.replicate_group_name is not None)
        # The all-gather parts and the gradients' and reduction's dtypes: from the parameters'
        # dtypes now, and again where they change ([Note: dtypes settled before each step]).
        self._resolve_dtypes()
        # The objects bound for FSDP2's all-reduce hook and custom collectives, by the settings field that
        # names them: field -> (name, object).
        self._bound: dict[str, tuple[str, Any]] = {}
        # A list of modules forms one group (``fully_shard([norm, output])``): as in
        # FSDP2 it stays unsharded until each of them has run its forward, so one
        # all-gather and one reduce-scatter serve them all.
        self.forwards_per_iteration = forwards_per_iteration
        # [Note: settings a trace reads as constants]
        self._noted_requires_grad = self._requires_grad()
        self._settings_changed()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        self.buffers.set_requires_gradient_sync(requires_gradient_sync, self._gradient_buffer)

    def set_requires_all_reduce(self, requires_all_reduce: bool) -> None:
        self.buffers.set_requires_all_reduce(requires_all_reduce, self._gradient_buffer)

    def reduce_accumulated_grad(self) -> None:
        """FSDP2's ``finalize_backward`` (torch 2.15): the gradients accumulated without sync, reduced now.

        [Note: manual backward finalization]
        FSDP2 2.15's ``set_manual_backward_finalization(True)`` leaves what a backward
        did not reduce to ``finalize_backward()``: micro-batches accumulate their
        gradients without sync, sync goes back on, and finalization reduces each group's
        accumulated gradients, with no backward of its own (a pipeline's schedule makes
        it a step of its own). compile_shard reduces in each backward what that backward
        reduces (eagerly, or inside the compiled graph), so what is left for
        finalization is exactly the buffer of gradients accumulated without sync
        (``accumulated_grad``): reduced here, eagerly, with the group's settings of now,
        in the ops of the all-gather's backward. As in FSDP2, HSDP's partial reduction
        (``set_requires_all_reduce(False)``) cannot be finalized this way.
        """
        buffers = self.buffers
        if buffers.partial_reduce_output is not None and buffers.accumulated_grad is not None and buffers.requires_gradient_sync:
            raise RuntimeError(
                f"fully_shard({self.settings.module_name!r}): manual backward finalization does not support HSDP's partial "
                "gradient reduction (set_requires_all_reduce(False)); turn the all-reduce back on before the last "
                "backward, or finalize automatically"
            )
        accumulated = self.buffers.take_for_finalization()
        if accumulated is None:
            return
        part = self._part_taking_gradients()
        part_settings = self.gather_settings().parts[self.dtypes.all_gather_parts.index(part)]
        shards = [self.fsdp_params[index].all_gather_shard(False) for index in part.indices]
        grads = ops.reduce_accumulated_grad(
            accumulated, shards, part.padded_numels, self.world_size, self.group_name, part_settings.options
        )
        for index, grad in zip(part.indices, grads):
            fsdp_param = self.fsdp_params[index]
            grad = fsdp_param.reduced_gradient_if_used(grad)
            if grad is not None:
                fsdp_param.accumulate_sharded_grad(grad.to(fsdp_param.shard.device))

    def _gradient_buffer(self, unsharded: bool) -> torch.Tensor | None:
        """A zeroed buffer of the unsharded gradients (or one rank's), in the reduction dtype; None without any."""
        part = self._part_taking_gradients()
        if part is None:
            return None
        numel = sum(part.padded_numels) * (self.world_size if unsharded else 1)
        fsdp_param = self.fsdp_params[0]  # on the mesh's device, also where the shard is offloaded to CPU memory
        return fsdp_param.shard.new_zeros(numel, dtype=self.dtypes.reduction_dtype, device=fsdp_param.compute_device)

    def set_custom_all_gather(self, comm: Any) -> None:
        if comm is not None and self.has_extensions:
            raise NotImplementedError(
                f"fully_shard({self.settings.module_name!r}): set_custom_all_gather is not supported for a group with "
                "all-gather extensions (fsdp_pre_all_gather)"
            )
        self._bind("all_gather_comm_name", comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        self._bind("reduce_scatter_comm_name", comm)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None] | None) -> None:
        self._bind("all_reduce_hook_name", hook)

    def _bind(self, field: str, obj: Any) -> None:
        """Registers ``obj`` under a name of the group's, which the settings ``field`` holds and traced code reads.

        One name per group and field, so that setting another object needs no
        recompile; the field is None where no object is set.
        """
        name = self._bound[field][0] if field in self._bound else ops.new_name(f"{self.settings.module_name}.{field}")
        ops.bind(name, obj)
        self._bound[field] = (name, obj)
        self._replace_settings(**{field: None if obj is None else name})

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy.deepcopy``, unpickling) registers its copies of the objects under names of its own."""
        self.__dict__.update(state)
        for fsdp_param in self.fsdp_params:
            fsdp_param.group_ref = weakref.ref(self)
        register_owned_state(self, (self, self.shown_params, self.use_flags))
        bound, self._bound = self._bound, {}
        for field, (_, obj) in bound.items():
            self._bind(field, obj)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool) -> None:
        self._replace_settings(reduce_scatter_unused_params=reduce_scatter_unused_params)
        for fsdp_param in self.fsdp_params:
            fsdp_param.used_since_reduction = None

    def set_separate_reduce_scatter_group(self, enable: bool, new_groups: dict[tuple[int, ...], str]) -> None:
        """Gives the reduce-scatters a process group of their own over the shard group's ranks (FSDP2's knob).

        ``new_groups`` holds the groups one call made, by ranks, so that groups over
        the same ranks share one process group, as in FSDP2.
        """
        if not enable:
            self._replace_settings(reduce_scatter_group_name=None)
            return
        if self.ranks not in new_groups:
            new_groups[self.ranks] = self.settings.reduce_scatter_group_name or dist.new_group(
                list(self.ranks), use_local_synchronization=True, group_desc="fsdp_reduce_scatter"
            ).group_name
        self._replace_settings(reduce_scatter_group_name=new_groups[self.ranks])

    def _part_taking_gradients(self) -> AllGatherPart | None:
        requires_grad = self._requires_grad()
        return next((part for part in self.dtypes.all_gather_parts if any(requires_grad[i] for i in part.indices)), None)

    def _replace_settings(self, **changes: Any) -> None:
        """Replaces settings a trace reads, and numbers them anew ([Note: settings a trace reads as constants])."""
        self.settings = dataclasses.replace(self.settings, **changes)
        self._settings_changed()

    def name(self, module_name: str, reshard_after_forward: bool) -> None:
        """The root names the group after its modules, and resolves FSDP2's default ``reshard_after_forward``."""
        self._replace_settings(module_name=module_name, reshard_after_forward=reshard_after_forward)

    def set_model_groups(self, model_groups: tuple[str, ...]) -> None:
        self._replace_settings(model_groups=model_groups)

    def set_reshard_after_forward(self, reshard_after_forward: bool) -> None:
        """FSDP2's ``set_reshard_after_forward``: a bool, which reshards over the whole shard group."""
        self._replace_settings(reshard_after_forward=reshard_after_forward, reshard_group=None)

    def set_reshard_after_backward(self, reshard_after_backward: bool) -> None:
        self._replace_settings(reshard_after_backward=reshard_after_backward)

    def set_forward_prefetch(self, groups: list[ConfiguredGroup]) -> None:
        self._replace_settings(forward_prefetch=tuple(groups))

    def set_backward_prefetch(self, groups: list[ConfiguredGroup]) -> None:
        self._replace_settings(backward_prefetch=tuple(groups))

    def _settings_changed(self) -> None:
        settings = (self.annotation(), self.gather_settings())
        self.settings_version = settings_version(settings)

    def _requires_grad(self) -> tuple[bool, ...]:
        return tuple(fsdp_param.sharded_param.requires_grad for fsdp_param in self.fsdp_params)

    def _extensions_changed(self) -> None:
        """What depends on whether the group has all-gather extensions ([Note: all-gather extensions] in ``_extension``)."""
        if self.has_extensions and self.settings.reshard_group is not None:
            raise NotImplementedError(
                f"fully_shard({self.settings.module_name}): reshard_after_forward as a smaller group is not supported for "
                "parameters with an all-gather extension (fsdp_pre_all_gather), as in FSDP2; pass True or False"
            )
        # Whether the unshard is one all-gather per part and a plain copy-out, which a block's region
        # can take over ([Note: a region copies out its block's parameters] in compile_shard._regions._call).
        self.has_plain_copy_out = self._gathers_plainly and not self.has_extensions
        # Whether a trace leaves it to the region: not on gloo, whose exchange in place needs
        # the copy-out in the outer graph ([Note: gloo exchange in place] in compile_shard.ops.transport).
        self.copies_out_in_region = self.has_plain_copy_out and not ops.gathers_by_send_recv(
            self.group_name, torch.device(self.mesh.device_type)
        )

    def init_extensions(self) -> None:
        """FSDP2's lazy init: each parameter's all-gather extension read again, set after ``fully_shard`` or not."""
        for fsdp_param in self.fsdp_params:
            fsdp_param.init_extensions()
        has_extensions = any(fsdp_param.has_extension for fsdp_param in self.fsdp_params)
        if has_extensions == self.has_extensions:
            return
        if has_extensions and self.settings.all_gather_comm_name is not None:
            raise NotImplementedError(
                f"fully_shard({self.settings.module_name!r}): set_custom_all_gather is not supported for a group with "
                "all-gather extensions (fsdp_pre_all_gather)"
            )
        self.has_extensions = has_extensions
        self._extensions_changed()
        self._settings_changed()

    def note_requires_grad(self) -> None:
        """Eager: the settings' version again where a parameter was frozen or unfrozen since the last call."""
        requires_grad = self._requires_grad()
        if requires_grad != self._noted_requires_grad:
            self._noted_requires_grad = requires_grad
            self._settings_changed()
        self._check_trainable_dtypes()
        self.resolve_dtypes()

    def resolve_dtypes(self) -> None:
        """The dtypes again, where a parameter's dtype, trainability or ``grad_dtype`` changed since
        ([Note: dtypes settled before each step] in ``_group_settings``)."""
        for fsdp_param in self.fsdp_params:
            fsdp_param.capture_grad_dtype_policy()
        if GroupDtypes.key_of(self.fsdp_params) != self.dtypes.key:
            self._resolve_dtypes()
            self._settings_changed()

    def _check_trainable_dtypes(self) -> None:
        """One dtype for the trainable parameters, checked before a step ([Note: dtypes settled before each step])."""
        trainable = {
            fsdp_param.sharded_param.dtype for fsdp_param in self.fsdp_params if fsdp_param.sharded_param.requires_grad
        }
        if len(trainable) > 1:
            listing = "; ".join(
                f"{fsdp_param.fqn}: {fsdp_param.sharded_param.dtype}"
                for fsdp_param in self.fsdp_params
                if fsdp_param.sharded_param.requires_grad
            )
            raise AssertionError(
                f"fully_shard({self.settings.module_name!r}): the trainable parameters of one group are reduce-scattered as "
                f"one buffer and need one dtype, but got {listing}. Cast them to one dtype, freeze the others "
                "(requires_grad_(False)), or apply fully_shard to the submodules with the other dtype first"
            )

    def _resolve_dtypes(self) -> None:
        """FSDP2's ``_init_mp_dtypes`` (its lazy init) on the parameters' current dtypes, and what follows from them."""
        for fsdp_param in self.fsdp_params:
            fsdp_param.capture_grad_dtype_policy()
            fsdp_param.apply_grad_dtype_policy()
        self.dtypes = dtypes = GroupDtypes.resolve(self.fsdp_params, self.mp_policy)
        rounds = (
            ROUNDS_EACH_GRADIENT_CONTRIBUTION
            and dtypes.reduce_dtype is not None
            and dtypes.reduce_dtype.itemsize < dtypes.gradient_dtype.itemsize
        )
        for fsdp_param in self.fsdp_params:  # [Note: gradient contributions] in compile_shard._param
            trainable = fsdp_param.sharded_param.requires_grad
            fsdp_param.contribution_dtype = dtypes.reduce_dtype if rounds and trainable else None
        reduction = GradientReduction.choose(
            self.data_parallel_size, self.gradient_divide_factor, self.force_sum_reduction_for_comms, dtypes.reduction_dtype
        )
        self.settings = dataclasses.replace(self.settings, gradient_reduction=reduction)
        self.buffers.to(dtypes.reduction_dtype)

    def gradients_wider_than_parameters(self) -> list[str]:
        """The parameters whose gradients a compiled backward would round ([Note: grad_dtype] in ``_gradient_rules``)."""
        return [
            fsdp_param.fqn
            for fsdp_param in self.fsdp_params
            if fsdp_param.sharded_param.requires_grad
            and fsdp_param.sharded_grad_dtype(self.dtypes.reduction_dtype).itemsize > fsdp_param.sharded_param.dtype.itemsize
        ]

    def guard_requires_grad(self) -> None:
        """Reads each sharded parameter's ``requires_grad`` in a trace, for Dynamo to guard on, where the root's
        eager forward did not compare them ([Note: settings a trace reads as constants])."""
        self._requires_grad()

    def gather_settings(self) -> GatherSettings:
        """What the all-gathers take from the settings, read now (in a trace, ``traced_settings`` reads them)."""
        requires_grad = self._requires_grad()
        reduction = self.settings.gradient_reduction
        parts = []
        for part in self.dtypes.all_gather_parts:
            options = ops.ReductionOptions(
                reduce_op=reduction.reduce_op,
                premul_factor=reduction.premul_factor,
                postdivide_factor=reduction.postdivide_factor,
                param_dtype=part.param_dtype,
                reduce_dtype=self.dtypes.reduce_dtype,
                replicate_group_name=self.replicate_group_name,
                reduce_scatter_group_name=self.settings.reduce_scatter_group_name,
                all_reduce_hook=self.settings.all_reduce_hook_name,
                all_gather_comm=self.settings.all_gather_comm_name,
                reduce_scatter_comm=self.settings.reduce_scatter_comm_name,
                grad_dtypes=part.grad_dtypes,
            )
            takes_gradients = any(requires_grad[index] for index in part.indices)
            reads_shards = all(
                requires_grad[index] and self.fsdp_params[index].compute_device is None for index in part.indices
            )
            parts.append(PartSettings(takes_gradients, reads_shards, options, *options.positional()))
        return GatherSettings(requires_grad, self.dtypes.all_gather_parts, tuple(parts))

    def set_gradient_reduction(self, divide_factor: float | None, force_sum: bool) -> None:
        self.gradient_divide_factor = divide_factor
        self.force_sum_reduction_for_comms = force_sum
        self._replace_settings(
            gradient_reduction=GradientReduction.choose(
                self.data_parallel_size, divide_factor, force_sum, self.dtypes.reduction_dtype
            )
        )

    def annotation(self) -> GroupAnnotation:
        """What the pass suite learns about this group from the traced graph."""
        return GroupAnnotation(
            name=self.settings.module_name,
            # Kept after backward, the parameters outlive the forward anyway: backward reads them, gathering nothing.
            reshard_after_forward=self.settings.reshard_after_forward and self.settings.reshard_after_backward,
            members=(self.settings.module_name,),
            model_groups=self.settings.model_groups,
            forward_prefetch=tuple(group.settings.module_name for group in self.settings.forward_prefetch),
            backward_prefetch=tuple(group.settings.module_name for group in self.settings.backward_prefetch),
            reshard_group=None
            if self.settings.reshard_group is None
            else (self.settings.reshard_group.size, self.settings.reshard_group.rank, self.settings.reshard_group.group_name),
            reduce_scatter_unused_params=self.settings.reduce_scatter_unused_params,
            kept_after_backward=not self.settings.reshard_after_backward,
            **self._dtype_annotation(),
        )

    def _wire_dtypes(self) -> list[torch.dtype]:
        """Each all-gather part's dtype ([Note: one all-gather per wire dtype])."""
        return [wire_dtype(self.fsdp_params[part.indices[0]], self.mp_policy) for part in self.dtypes.all_gather_parts]

    def _dtype_annotation(self) -> dict[str, Any]:
        if self.has_extensions:  # the extension's pre- and post-all-gather decide the dtypes
            return {}
        return {
            "all_gather_dtypes": tuple(str(dtype) for dtype in self._wire_dtypes()),
            "gradient_dtype": str(self.dtypes.gradient_dtype),
            "reduction_dtype": str(self.dtypes.reduction_dtype),
        }
