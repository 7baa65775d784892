"""One ``fully_shard`` call's parameters and their unshard/reshard lifecycle."""

from __future__ import annotations

import dataclasses
import enum
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import ops
from ._annotation import GroupAnnotation, annotating_group, group_metadata
from ._group_settings import (
    AllGatherPart,
    GatherSettings,
    GradientReduction,
    GroupSettings,
    PartSettings,
    ReshardGroup,
    all_gather_parts_of,
    gradient_dtype_of,
    reduce_dtype_of,
    TracedSettings,
    settings_version,
    wire_dtype,
)
from ._param import FSDPParam, share_slots
from ._region import register_slot_lists
from ._versions import ROUNDS_EACH_GRADIENT_CONTRIBUTION


def _unpadded(padded: torch.Tensor, rows: int) -> torch.Tensor:
    """``padded``'s first ``rows`` rows; ``padded`` itself where it has no others (no slice node in a trace)."""
    return padded if padded.size(0) == rows else padded[:rows]


@torch.compiler.assume_constant_result
def traced_settings(group: FSDPParamGroup, settings_version: int) -> TracedSettings:
    """``group``'s settings, read in plain Python while Dynamo traces.

    [Note: settings a trace reads as constants]
    A trace reads a group's settings where it builds the all-gather and its
    annotation: FSDP2's knobs, dtypes, process group names, prefetch lists, and each
    sharded parameter's ``requires_grad``. Traced, each read costs Dynamo time and a
    guard, for every group of every trace, and ``requires_grad`` of a DTensor
    parameter costs a fake DTensor each (docs/benchmarks.md, "Capture time by
    depth"). So a trace reads them here once per group, as a constant, and guards on
    ``settings_version`` alone (passed as an argument, a traced read). FSDP2's knobs
    are one frozen ``GroupSettings`` per group, which every setter replaces through
    ``_replace_settings``; that numbers what this constant holds: the next call
    recompiles, or finds the graph of settings it had before (a loop that alternates
    two compiles each once). ``requires_grad_()`` has no setter: the
    root's eager forward compares the flags before each step
    (``note_requires_grad``), and a trace that does not start there (the root's
    forward traced inside a frame compiled around it) reads the flags of the groups
    it gathers (``guard_requires_grad``), which Dynamo guards. Eager mode reads
    everything live (``gather_settings``); the trace reads what changes between
    steps (accumulated gradients, kept parameters, grad mode) as before.
    """
    return TracedSettings(group.gather_settings(), group_metadata(group.annotation()))


class TrainingState(enum.Enum):
    IDLE = enum.auto()
    FORWARD = enum.auto()
    #: A forward that activation checkpointing recomputes in backward, before the group's pre-backward.
    RECOMPUTE = enum.auto()
    PRE_BACKWARD = enum.auto()


def _profiled(phase: str) -> Callable:
    """Records a group's eager phase for the profiler as FSDP2 names it: ``FSDP::<phase> (<group>)``.

    A trace of an eager compile_shard run then reads like FSDP2's (docs/debugging.md,
    "Profiling"). The methods it wraps run eagerly only, never in a trace.
    """

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def recorded(self: FSDPParamGroup, *args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(f"FSDP::{phase} ({self.settings.module_name})"):
                return method(self, *args, **kwargs)

        return recorded

    return decorate


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (FSDP2's ``is_bw``)."""
    return torch._C._current_graph_task_id() != -1


class UnshardedParams:
    """The unsharded parameters produced by one all-gather of a group.

    [Note: unsharded storage lifetime]
    The unsharded tensors are outputs of the differentiable ``fsdp::all_gather_into``
    (plus copy-out views), not persistent parameters: autograd routes their
    gradients through the all-gather's backward, a reduce-scatter, straight into the
    sharded DTensor parameters. Autograd saves them (or views of them, such as
    ``weight.t()`` in ``F.linear``) for backward. Resharding therefore frees their
    *storage* with ``fsdp::resize_storage_(t, 0)`` while the tensor objects stay
    alive inside the autograd graph, and unsharding for backward resizes the same
    storages back and copies freshly gathered values in. Saved views see the new
    values because they share the storage; ``set_`` to a new storage would leave them
    pointing at the freed one. The refill preserves version counters: the values
    are bit-identical to what forward saw, so autograd's saved-tensor version check
    must not fire.
    """

    def __init__(
        self,
        tensors: list[torch.Tensor],
        all_gather_outputs: list[torch.Tensor],
        post_forward_chunks: list[torch.Tensor] | None = None,
    ):
        self.tensors = tensors
        # [Note: resharding to a smaller group]: what backward gathers from, instead of the shards.
        self.post_forward_chunks = post_forward_chunks
        self.storage_nbytes = [[leaf.untyped_storage().nbytes() for leaf in _storage_leaves(t)] for t in tensors]
        nodes = [out.grad_fn for out in all_gather_outputs if out.grad_fn is not None]
        self.takes_gradients = bool(nodes)
        # The node whose backward ends the group's backward: the all-gather's, where every
        # part takes gradients. A part that takes none (frozen parameters beside trainable
        # ones, [Note: one all-gather per wire dtype]) may still be read by a backward node
        # that runs after it, so such a group ends its backward on its inputs instead, as a
        # frozen group does ([Note: post-backward of a frozen group]).
        self.all_gather_node = nodes[0] if len(nodes) == len(all_gather_outputs) else None
        self.is_freed = False
        self.backward_done = False
        # Set by the group: the settings version it was gathered under, and whether backward kept it
        # ([Note: one gather per backward window]).
        self.settings_version: int | None = None
        self.kept = False
        self.keeps_storage = False  # set by the group: [Note: unsharded storage kept across reshards]
        # The parameters registered on the modules while these are unsharded ([Note: registered parameters]).
        self.registered: list[torch.nn.Parameter] | None = None

    def free(self) -> None:
        if self.is_freed:
            return
        if not self.keeps_storage:  # [Note: unsharded storage kept across reshards]
            _free_storages(self.tensors)
        self.is_freed = True

    def refill(self, fresh: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for tensor, nbytes, values in zip(self.tensors, self.storage_nbytes, fresh):
                for leaf, leaf_nbytes, leaf_values in zip(_storage_leaves(tensor), nbytes, _storage_leaves(values)):
                    ops.resize_storage_(leaf, leaf_nbytes)
                    with torch.autograd._unsafe_preserve_version_counter(leaf):
                        leaf.copy_(leaf_values)
        self.is_freed = False


def _free_storages(tensors: Sequence[torch.Tensor]) -> None:
    for tensor in tensors:
        for leaf in _storage_leaves(tensor):
            ops.resize_storage_(leaf, 0)


def _live_bytes(tensors: Sequence[torch.Tensor]) -> int:
    storages = [leaf.untyped_storage() for tensor in tensors for leaf in _storage_leaves(tensor)]
    return sum({storage._cdata: storage.nbytes() for storage in storages}.values())


def _storage_leaves(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors whose storage holds ``tensor``: itself, or a tensor subclass's inner tensors.

    An all-gather extension's unsharded parameter may be a tensor subclass (torchao's
    float8 weights); its storage is its inner tensors', which free and refill reach
    through ``__tensor_flatten__``. A fresh gather of the same subclass has the same
    inner tensors, so a refill copies each into its counterpart.
    """
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [leaf for name in names for leaf in _storage_leaves(getattr(tensor, name))]


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs the module's post-backward callback."""

    @staticmethod
    def forward(ctx, callback, *inputs):
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


class FSDPParamGroup:
    """The parameters of one ``fully_shard`` call: one all-gather, one reduce-scatter."""

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
        # After the parameters' slots, ``shown_params`` holds a traced forward's all-gather outputs where the
        # block's region copies out ([Note: a region copies out its block's parameters] in compile_shard._region).
        self.shown_params, self.use_flags = share_slots(fsdp_params)
        self.shown_params.append(None)
        register_slot_lists(self, (self.shown_params, self.use_flags))
        self.mesh = mesh
        # The shard dimension's group gathers and reduce-scatters; on HSDP's 2-D mesh each
        # reduce-scatter is followed by an all-reduce over the replicate dimension's group.
        self.world_size = mesh.size(-1)
        self.group_name = mesh.get_group(mesh.ndim - 1).group_name
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
        # [Note: all-gather extensions] in compile_shard._param.
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
        self.accumulated_grad: torch.Tensor | None = None
        self.partial_reduce_output: torch.Tensor | None = None
        # all_gather_parts, gradient_dtype, reduce_dtype, gradient_reduction: from the parameters'
        # dtypes now, and again where they changed (FSDP2 resolves them at its lazy init).
        self._resolved_dtypes: tuple | None = None
        self._resolve_dtypes()
        # FSDP2's set_requires_gradient_sync: while False, backward adds the unsharded
        # gradients into ``accumulated_grad`` instead of reducing them
        # ([Note: gradient accumulation without sync] in compile_shard.ops).
        self.requires_gradient_sync = True
        # FSDP2's set_requires_all_reduce on HSDP: while False, backward adds the
        # reduce-scattered gradients into ``partial_reduce_output`` instead of
        # all-reducing them ([Note: HSDP reduction] in compile_shard.ops).
        self.requires_all_reduce = True
        # The objects bound for FSDP2's all-reduce hook and custom collectives, by the settings field that
        # names them: field -> (name, object).
        self._bound: dict[str, tuple[str, Any]] = {}
        self.training_state = TrainingState.IDLE
        # A list of modules forms one group (``fully_shard([norm, output])``): as in
        # FSDP2 it stays unsharded until each of them has run its forward, so one
        # all-gather and one reduce-scatter serve them all.
        self.forwards_per_iteration = forwards_per_iteration
        self.forwards_left = 0
        # FSDP2's set_unshard_in_backward: False for a group whose backward reads no
        # parameter (an embedding's gradient needs only its indices): eager backward
        # then gathers nothing. Compiled graphs gather in backward only what it reads.
        self.unshard_in_backward = True
        self.kept_after_backward: tuple[torch.Tensor, ...] | None = None
        # FSDP2's set_keep_unsharded_storage ([Note: unsharded storage kept across reshards]).
        self.keep_unsharded_storage = False
        self._kept_storage: list[torch.Tensor] | None = None
        self._kept_by_trace = False
        self.unsharded: UnshardedParams | None = None
        self._live: list[weakref.ref[UnshardedParams]] = []
        # [Note: settings a trace reads as constants]
        self._noted_requires_grad = self._requires_grad()
        self._settings_changed()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Allocates the accumulation buffer here, in eager Python, so that a trace only reads it."""
        self.requires_gradient_sync = requires_gradient_sync
        part = self._part_taking_gradients()
        if not requires_gradient_sync and self.accumulated_grad is None and part is not None:
            self.accumulated_grad = self._gradient_buffer(self.world_size * sum(part.padded_numels))

    def set_requires_all_reduce(self, requires_all_reduce: bool) -> None:
        """Allocates the partial reduction's buffer here, in eager Python, so that a trace only reads it."""
        self.requires_all_reduce = requires_all_reduce
        part = self._part_taking_gradients()
        if (
            not requires_all_reduce
            and self.replicate_group_name is not None
            and self.partial_reduce_output is None
            and part is not None
        ):
            self.partial_reduce_output = self._gradient_buffer(sum(part.padded_numels))

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
        if self.accumulated_grad is None or not self.requires_gradient_sync:
            return
        if self.partial_reduce_output is not None:
            raise RuntimeError(
                f"fully_shard({self.settings.module_name!r}): manual backward finalization does not support HSDP's partial "
                "gradient reduction (set_requires_all_reduce(False)); turn the all-reduce back on before the last "
                "backward, or finalize automatically"
            )
        part = self._part_taking_gradients()
        settings = self.gather_settings()
        part_settings = settings.parts[self.all_gather_parts.index(part)]
        accumulated, self.accumulated_grad = self.accumulated_grad, None
        shards = [self.fsdp_params[index].all_gather_shard(False) for index in part.indices]
        grads = ops.reduce_accumulated_grad(
            accumulated, shards, part.padded_numels, self.world_size, self.group_name, part_settings.options
        )
        for index, grad in zip(part.indices, grads):
            fsdp_param = self.fsdp_params[index]
            grad = fsdp_param.reduced_gradient_if_used(grad)
            if grad is not None:
                fsdp_param.accumulate_sharded_grad(grad.to(fsdp_param.shard.device))

    def _gradient_buffer(self, numel: int) -> torch.Tensor:
        """A zeroed buffer for gradients accumulated between reductions, in the reduction dtype."""
        fsdp_param = self.fsdp_params[0]  # on the mesh's device, also where the shard is offloaded to CPU memory
        return fsdp_param.shard.new_zeros(numel, dtype=self.reduction_dtype, device=fsdp_param.compute_device)

    @property
    def reduction_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced (and accumulated without sync) in: FSDP2's order of fallbacks."""
        return self.reduce_dtype or self.gradient_dtype

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
        register_slot_lists(self, (self.shown_params, self.use_flags))
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
        ranks = tuple(dist.get_process_group_ranks(self.mesh.get_group(self.mesh.ndim - 1)))
        if ranks not in new_groups:
            new_groups[ranks] = self.settings.reduce_scatter_group_name or dist.new_group(
                list(ranks), use_local_synchronization=True, group_desc="fsdp_reduce_scatter"
            ).group_name
        self._replace_settings(reduce_scatter_group_name=new_groups[ranks])

    def _part_taking_gradients(self) -> AllGatherPart | None:
        requires_grad = self._requires_grad()
        return next((part for part in self.all_gather_parts if any(requires_grad[i] for i in part.indices)), None)

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

    def set_forward_prefetch(self, groups: list[FSDPParamGroup]) -> None:
        self._replace_settings(forward_prefetch=tuple(groups))

    def set_backward_prefetch(self, groups: list[FSDPParamGroup]) -> None:
        self._replace_settings(backward_prefetch=tuple(groups))

    def _settings_changed(self) -> None:
        settings = (self.annotation(), self.gather_settings())
        self.settings_version = settings_version(settings)

    def _requires_grad(self) -> tuple[bool, ...]:
        return tuple(fsdp_param.sharded_param.requires_grad for fsdp_param in self.fsdp_params)

    def _extensions_changed(self) -> None:
        """What depends on whether the group has all-gather extensions ([Note: all-gather extensions] in ``_param``)."""
        if self.has_extensions and self.settings.reshard_group is not None:
            raise NotImplementedError(
                f"fully_shard({self.settings.module_name}): reshard_after_forward as a smaller group is not supported for "
                "parameters with an all-gather extension (fsdp_pre_all_gather), as in FSDP2; pass True or False"
            )
        # Whether the unshard is one all-gather per part and a plain copy-out, which a block's region
        # can take over ([Note: a region copies out its block's parameters] in compile_shard._region).
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

    def _dtype_key(self) -> tuple:
        for p in self.fsdp_params:
            p.capture_grad_dtype_policy()
        return tuple((p.sharded_param.dtype, p.sharded_param.requires_grad, p.grad_dtype_policy) for p in self.fsdp_params)

    def resolve_dtypes(self) -> None:
        """The dtype-dependent settings again, where a parameter's dtype (or trainability) changed since.

        [Note: dtypes settled before each step]
        FSDP2 settles its dtypes at its lazy init, the first forward: a model sharded in
        bf16 and then cast with ``.to(torch.float32)`` trains in fp32, and a policy's
        dtypes are clamped against the parameters' dtypes of then. compile_shard settles
        them at ``fully_shard`` and again wherever the parameters' dtypes or
        ``requires_grad`` changed since: in ``_apply`` (``module.to``) and before each of
        the root's steps, where a new settings version makes a compiled model recompile.
        As at FSDP2's lazy init, the trainable parameters of a group must share one dtype
        by then (``AssertionError``, FSDP2's type): their gradients are reduced as one
        buffer.
        """
        if self._dtype_key() != self._resolved_dtypes:
            self._resolve_dtypes()
            self._settings_changed()

    def _check_trainable_dtypes(self) -> None:
        """[Note: dtypes settled before each step]: one dtype for the trainable parameters, checked before a step."""
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
        """FSDP2's ``_init_mp_dtypes`` (its lazy init) on the parameters' current dtypes."""
        fsdp_params, mp_policy = self.fsdp_params, self.mp_policy
        self._resolved_dtypes = self._dtype_key()
        for fsdp_param in fsdp_params:
            fsdp_param.apply_grad_dtype_policy()
        self.all_gather_parts = all_gather_parts_of(fsdp_params, mp_policy)
        self.gradient_dtype = gradient_dtype_of(fsdp_params, mp_policy)
        self.reduce_dtype = reduce_dtype_of(fsdp_params, mp_policy, self.gradient_dtype)
        rounds = (
            ROUNDS_EACH_GRADIENT_CONTRIBUTION
            and self.reduce_dtype is not None
            and self.reduce_dtype.itemsize < self.gradient_dtype.itemsize
        )
        for fsdp_param in fsdp_params:  # [Note: gradient contributions] in compile_shard._param
            fsdp_param.contribution_dtype = (
                self.reduce_dtype if rounds and fsdp_param.sharded_param.requires_grad else None
            )
        reduction = GradientReduction.choose(
            self.data_parallel_size, self.gradient_divide_factor, self.force_sum_reduction_for_comms, self.reduction_dtype
        )
        self.settings = dataclasses.replace(self.settings, gradient_reduction=reduction)
        parts = []
        for part in self.all_gather_parts:  # [Note: grad_dtype] in compile_shard._param
            dtypes = [fsdp_params[index].sharded_grad_dtype(self.reduction_dtype) for index in part.indices]
            differs = any(dtype != fsdp_params[index].sharded_param.dtype for dtype, index in zip(dtypes, part.indices))
            names = ",".join(str(dtype).removeprefix("torch.") for dtype in dtypes) if differs else None
            parts.append(dataclasses.replace(part, grad_dtypes=names))
        self.all_gather_parts = tuple(parts)
        for name in ("accumulated_grad", "partial_reduce_output"):  # pending gradients follow
            buffer = getattr(self, name)
            if buffer is not None and buffer.dtype != self.reduction_dtype:
                setattr(self, name, buffer.to(self.reduction_dtype))

    def gradients_wider_than_parameters(self) -> list[str]:
        """The parameters whose gradients a compiled backward would round ([Note: grad_dtype] in ``_param``)."""
        return [
            fsdp_param.fqn
            for fsdp_param in self.fsdp_params
            if fsdp_param.sharded_param.requires_grad
            and fsdp_param.sharded_grad_dtype(self.reduction_dtype).itemsize > fsdp_param.sharded_param.dtype.itemsize
        ]

    def guard_requires_grad(self) -> None:
        """Reads each sharded parameter's ``requires_grad`` in a trace, for Dynamo to guard on, where the root's
        eager forward did not compare them ([Note: settings a trace reads as constants])."""
        self._requires_grad()

    def gather_settings(self) -> GatherSettings:
        """What the all-gathers take from the settings, read now (in a trace, ``_traced_settings`` reads them)."""
        requires_grad = self._requires_grad()
        reduction = self.settings.gradient_reduction
        parts = []
        for part in self.all_gather_parts:
            options = ops.ReductionOptions(
                reduce_op=reduction.reduce_op,
                premul_factor=reduction.premul_factor,
                postdivide_factor=reduction.postdivide_factor,
                param_dtype=part.param_dtype,
                reduce_dtype=self.reduce_dtype,
                replicate_group_name=self.replicate_group_name,
                reduce_scatter_group_name=self.settings.reduce_scatter_group_name,
                all_reduce_hook=self.settings.all_reduce_hook_name,
                all_gather_comm=self.settings.all_gather_comm_name,
                reduce_scatter_comm=self.settings.reduce_scatter_comm_name,
                grad_dtypes=part.grad_dtypes,
            )
            takes_gradients = any(requires_grad[index] for index in part.indices)
            parts.append(PartSettings(takes_gradients, options, *options.positional()))
        return GatherSettings(requires_grad, self.all_gather_parts, tuple(parts))

    def _all_gather_options(self, settings: PartSettings) -> tuple:
        """``fsdp::all_gather_into``'s optional arguments for this gathering, trailing defaults left out.

        The settings' options with this step's accumulation in place: a gathering with
        gradients takes the accumulated gradient with it (the group forgets it: the
        backward that receives it reduces it); one without gradients (an evaluation
        forward, a refill) leaves it for the next.
        """
        takes_gradients = torch.is_grad_enabled() and settings.takes_gradients
        accumulated_grad, reduce_grads = None, True
        if self.accumulated_grad is not None and takes_gradients:
            accumulated_grad, reduce_grads = self.accumulated_grad, self.requires_gradient_sync
            if reduce_grads:
                self.accumulated_grad = None
        partial_reduce_output, all_reduce_grads = None, True
        if self.partial_reduce_output is not None and takes_gradients and reduce_grads:
            partial_reduce_output, all_reduce_grads = self.partial_reduce_output, self.requires_all_reduce
            if all_reduce_grads:
                self.partial_reduce_output = None
        return ops.ReductionOptions.with_accumulation(
            settings.values, settings.given, accumulated_grad, reduce_grads, all_reduce_grads, partial_reduce_output
        )

    def set_gradient_reduction(self, divide_factor: float | None, force_sum: bool) -> None:
        self.gradient_divide_factor = divide_factor
        self.force_sum_reduction_for_comms = force_sum
        self._replace_settings(
            gradient_reduction=GradientReduction.choose(
                self.data_parallel_size, divide_factor, force_sum, self.reduction_dtype
            )
        )

    # Collectives ------------------------------------------------------------------

    def _all_gather(self, settings: GatherSettings) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """All-gathers the group (one collective per part) and copies out one tensor per parameter."""
        if self.has_extensions:
            return self._as_gathered(self._gather_with_extensions(), settings)
        all_gather_outputs = self._all_gather_outputs(settings)
        return self._copy_out(all_gather_outputs, settings.all_gather_parts), all_gather_outputs

    def _all_gather_outputs(self, settings: GatherSettings) -> list[torch.Tensor]:
        """One all-gather per part, not copied out."""
        all_gather_outputs = []
        for part, part_settings in zip(settings.all_gather_parts, settings.parts):
            shards = [
                self.fsdp_params[index].all_gather_shard(settings.requires_grad[index]) for index in part.indices
            ]
            options = self._all_gather_options(part_settings)
            all_gather_outputs.append(
                ops.all_gather_into(shards, part.padded_numels, self.world_size, self.group_name, *options)
            )
        return all_gather_outputs

    def _gather_with_extensions(self) -> list[torch.Tensor]:
        """The unsharded parameters of a group with all-gather extensions, without autograd.

        One all-gather per dtype of the all-gather inputs: the extensions' inputs and the
        other parameters' shards cast to their wire dtype ([Note: all-gather extensions]
        in compile_shard._param).
        """
        mesh = self.mesh if self.mesh.ndim == 1 else self.mesh[self.mesh.mesh_dim_names[-1]]
        inputs: list[list[torch.Tensor]] = []
        metadata: list[Any] = []
        by_dtype: dict[torch.dtype, list[tuple[int, int]]] = {}
        with torch.no_grad():
            for index, fsdp_param in enumerate(self.fsdp_params):
                if fsdp_param.has_extension:
                    tensors, meta = fsdp_param.extension_inputs(mesh, self.mp_policy)
                    dtypes = [tensor.dtype for tensor in tensors]
                else:
                    tensors, meta = [fsdp_param.shard.detach()], None
                    dtypes = [wire_dtype(fsdp_param, self.mp_policy)]
                inputs.append(tensors)
                metadata.append(meta)
                for position, dtype in enumerate(dtypes):
                    by_dtype.setdefault(dtype, []).append((index, position))
            gathered: list[list[torch.Tensor | None]] = [[None] * len(tensors) for tensors in inputs]
            for dtype, places in by_dtype.items():
                shards = [inputs[index][position] for index, position in places]
                padded_numels = [
                    tensor.numel() if self.fsdp_params[index].has_extension else self.fsdp_params[index].padded_numel
                    for (index, _), tensor in zip(places, shards)
                ]
                cast = {"param_dtype": dtype} if any(shard.dtype != dtype for shard in shards) else {}
                output = ops.all_gather_into(shards, padded_numels, self.world_size, self.group_name, **cast)
                per_rank = output.view(self.world_size, -1).split(padded_numels, dim=1)
                for (index, position), shard, chunk in zip(places, shards, per_rank):
                    gathered[index][position] = chunk.reshape(-1, *shard.shape[1:])
            unsharded = []
            for fsdp_param, outputs, meta in zip(self.fsdp_params, gathered, metadata):
                if fsdp_param.has_extension:
                    param_dtype = wire_dtype(fsdp_param, self.mp_policy)
                    unsharded.append(fsdp_param.unsharded_from_extension(outputs, meta, param_dtype))
                else:
                    rows = _unpadded(outputs[0], fsdp_param.unsharded_shape[0])
                    unsharded.append(fsdp_param.unsharded_from_rows(rows))
        return unsharded

    def _as_gathered(
        self, gathered: list[torch.Tensor], settings: GatherSettings
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Unsharded parameters gathered another way as a new all-gather's outputs.

        Kept from an earlier all-gather, gathered by a custom all-gather or through
        all-gather extensions ([Note: unsharded parameters gathered outside
        all_gather_into] in compile_shard.ops).
        """
        unsharded: list[torch.Tensor] = [None] * len(self.fsdp_params)  # type: ignore[list-item]
        outputs = []
        for part, part_settings in zip(settings.all_gather_parts, settings.parts):
            params = [self.fsdp_params[index] for index in part.indices]
            tensors = [gathered[index].detach() for index in part.indices]
            output = tensors[0]
            if torch.is_grad_enabled() and part_settings.takes_gradients:
                # as_gathered's autograd node works on rows ([Note: sharding on another dim]).
                rows = [fsdp_param.rows_of(tensor) for fsdp_param, tensor in zip(params, tensors)]
                shards = [
                    fsdp_param.all_gather_shard(settings.requires_grad[index])
                    for fsdp_param, index in zip(params, part.indices)
                ]
                options = self._all_gather_options(part_settings)
                # Eager mode takes views; a traced graph needs the op, whose outputs are new tensors, except
                # for a tensor subclass ([Note: an unsharded tensor subclass in a trace] in compile_shard.ops).
                plain = all(type(row) is torch.Tensor for row in rows)
                as_gathered = ops.as_gathered if torch.compiler.is_compiling() and plain else ops.as_gathered_views
                gathered_rows = as_gathered(
                    rows, shards, part.padded_numels, self.world_size, self.group_name, *options
                )
                output = gathered_rows[0]  # the node whose backward reduces
                # A view each: a node of its own per parameter, which backward runs only where the forward
                # used it, as the copy-out's views ([Note: unused parameters] in passes.unused_params).
                rows = [row.view_as(row) for row in gathered_rows]
                tensors = [fsdp_param.unsharded_from_rows(row) for fsdp_param, row in zip(params, rows)]
            outputs.append(output)
            for index, tensor in zip(part.indices, tensors):
                unsharded[index] = tensor
        return unsharded, outputs

    def _all_gather_post_forward_chunks(self, post_forward_chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """The unsharded parameters, gathered back over the smaller group ([Note: resharding to a smaller group])."""
        reshard_group = self.settings.reshard_group
        all_gather_outputs = [
            ops.all_gather_into([chunk], [chunk.numel()], reshard_group.size, reshard_group.group_name)
            for chunk in post_forward_chunks
        ]
        return self._copy_out(all_gather_outputs, self.all_gather_parts)

    def _copy_out(
        self, all_gather_outputs: list[torch.Tensor], all_gather_parts: Sequence[AllGatherPart]
    ) -> list[torch.Tensor]:
        """One tensor per parameter, in the group's order, from each part's all-gather output."""
        unsharded: list[torch.Tensor] = [None] * len(self.fsdp_params)  # type: ignore[list-item]
        for part, all_gather_output in zip(all_gather_parts, all_gather_outputs):
            per_rank = all_gather_output.view(self.world_size, -1).split(part.padded_numels, dim=1)
            for index, chunk, shape in zip(part.indices, per_rank, part.unsharded_shapes):
                rows = _unpadded(chunk.reshape(-1, *shape[1:]), shape[0])
                unsharded[index] = self.fsdp_params[index].unsharded_from_rows(rows)
        return unsharded

    def traced_unsharded_params(self) -> list[torch.Tensor]:
        """The group's unsharded parameters inside a torch.compile trace.

        [Note: traced unshard]
        Eager mode keeps Python state that backward needs: the gathered tensors and
        their storage (``UnshardedParams``), hooks on outputs and on the all-gather's
        autograd node, storage frees and refills. A trace can hold none of that, and
        storage resizing has no functional form. So while compiling, the outermost
        sharded module's forward wrapper gathers every group below it and shows the
        tensors to the modules until it returns (Dynamo replays the net effect, which
        is nothing). Nested wrappers find their group shown and write nothing: Dynamo
        refuses Python state writes inside an activation-checkpoint region, and a
        sharded block is often called inside one. The pass suite then decides per
        group, from the annotation below, what eager's storage management decides:
        where to gather (``place``), and whether backward saves the unsharded
        parameters or gathers them again (``reshard``).
        """
        kept = self.kept_after_backward
        settings = traced_settings(self, self.settings_version)
        with annotating_group(settings.annotation):
            if kept is None:
                tensors, _ = self._all_gather(settings.gather)
            else:
                tensors, _ = self._as_gathered(list(kept), settings.gather)
        self._keep_traced(tensors, kept)
        return tensors

    def _keep_traced(self, tensors: list[torch.Tensor], kept: tuple[torch.Tensor, ...] | None) -> None:
        """What a traced forward keeps for the next one.

        [Note: unsharded parameters kept after backward]
        FSDP2's ``set_reshard_after_backward(False)``: backward keeps the unsharded
        parameters, and the next forward computes with them instead of all-gathering
        (``as_gathered`` gives them this forward's reduction). They are not refreshed:
        until the setting is True again, every forward computes with the same values.
        Eager mode keeps what backward computed with. A traced forward keeps what it
        computes with, as a graph output the group holds: the same values, since the
        parameters do not change between a forward and its backward, and the next
        compiled forward takes them as graph inputs. A group is specialised on whether
        it holds kept parameters (Dynamo guards the attribute), so a loop that keeps on
        all micro-batches but the last runs three graphs and recompiles no more. Eager
        mode keeps only what backward left gathered (FSDP2's), while a compiled graph
        keeps the gathered parameters from the first forward: its backward then
        computes with them instead of gathering again. So ``reshard()`` frees the
        storage an eager backward kept, as FSDP2 does, but only drops what a traced
        forward kept: that forward's backward may not have run yet.
        """
        keeps = not self.settings.reshard_after_backward and torch.is_grad_enabled()
        if keeps and kept is None:
            self.kept_after_backward = tuple(tensor.detach() for tensor in tensors)
            self._kept_by_trace = True
        elif not keeps and kept is not None:
            self.kept_after_backward = None

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

    def _dtype_annotation(self) -> dict[str, Any]:
        if self.has_extensions:  # the extension's pre- and post-all-gather decide the dtypes
            return {}
        wire_dtypes = [wire_dtype(self.fsdp_params[part.indices[0]], self.mp_policy) for part in self.all_gather_parts]
        return {
            "all_gather_dtypes": tuple(str(dtype) for dtype in wire_dtypes),
            "gradient_dtype": str(self.gradient_dtype),
            "reduction_dtype": str(self.reduction_dtype),
        }

    # Lifecycle --------------------------------------------------------------------

    def unshard(self) -> UnshardedParams:
        if self.unsharded is not None and self._needs_autograd_graph(self.unsharded):
            self.reshard()  # gathered under no_grad but now needed with gradients
        if self.unsharded is None:
            self.unsharded = self._gather_awaiting_backward()
        if self.unsharded is None:
            tensors, all_gather_outputs = self._gather_for_forward()
            post_forward_chunks = None
            if self.settings.reshard_group is not None and self.settings.reshard_after_forward and torch.is_grad_enabled():
                post_forward_chunks = [self.settings.reshard_group.chunk(output) for output in all_gather_outputs]
            self.unsharded = UnshardedParams(tensors, all_gather_outputs, post_forward_chunks)
            self.unsharded.settings_version = self.settings_version
            self.unsharded.keeps_storage = self.keep_unsharded_storage
            self._live = [ref for ref in self._live if ref() is not None] + [weakref.ref(self.unsharded)]
            self._watch_use(tensors)
            self._drop_unused_gradients(all_gather_outputs)
            if self.unsharded.all_gather_node is not None:
                self._register_post_backward(self.unsharded)
        elif self.unsharded.is_freed:
            self._refill(self.unsharded)
        for fsdp_param, tensor in zip(self.fsdp_params, self.unsharded.tensors):
            fsdp_param.show_unsharded(tensor)
        self._register_unsharded(self.unsharded)
        return self.unsharded

    def _register_unsharded(self, unsharded: UnshardedParams) -> None:
        """Registers the unsharded parameters on the modules, as FSDP2 does ([Note: registered parameters] in ``_param``)."""
        if unsharded.registered is None:
            unsharded.registered = [fsdp_param.unsharded_parameter() for fsdp_param in self.fsdp_params]
        for fsdp_param, param in zip(self.fsdp_params, unsharded.registered):
            fsdp_param.register(param)

    def hide_unsharded_params(self) -> None:
        """The modules read the registered parameters again, the unsharded ones still registered (eager)."""
        for fsdp_param in self.fsdp_params:
            fsdp_param.show_sharded()

    def _register_sharded(self) -> None:
        for fsdp_param in self.fsdp_params:
            fsdp_param.show_sharded()
            fsdp_param.register(fsdp_param.sharded_param)

    def _gather_awaiting_backward(self) -> UnshardedParams | None:
        """The group's latest gather whose backward has not run, for another forward to compute with.

        [Note: one gather per backward window]
        FSDP2 keeps one unsharded parameter per parameter: every forward that uses the group
        before its post-backward adds its gradient into the same unsharded ``.grad``, and the
        post-backward reduce-scatters the sum once (a list's member called again after the
        list's forward, two forwards before one backward). Here each gather's all-gather node
        reduce-scatters what reaches it, so a forward whose group was resharded since an
        earlier forward computes with that forward's gather again (refilled) instead of a new
        one: autograd sums both gradients into it, and its backward reduces the sum, FSDP2's
        bits. Not once its backward has run (a new window), nor across a change of settings
        or outside grad mode.
        """
        if not torch.is_grad_enabled() or self.kept_after_backward is not None:
            return None
        for ref in reversed(self._live):
            unsharded = ref()
            if unsharded is not None:
                if (
                    unsharded.backward_done
                    or not unsharded.takes_gradients
                    or unsharded.settings_version != self.settings_version
                ):
                    return None
                return unsharded
        return None

    @_profiled("all_gather")
    def _gather_for_forward(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The unsharded parameters and their all-gather outputs: the ones kept after backward, or gathered now."""
        if self.kept_after_backward is not None:
            kept, self.kept_after_backward = self.kept_after_backward, None
            return self._as_gathered(list(kept), self.gather_settings())
        if self.keep_unsharded_storage:
            return self._as_gathered(self._gather_into_kept_storage(), self.gather_settings())
        return self._all_gather(self.gather_settings())

    def _gather_into_kept_storage(self) -> list[torch.Tensor]:
        """All-gathers into the storage kept across reshards: the same tensors at every gather.

        [Note: unsharded storage kept across reshards]
        FSDP2 2.15's ``set_keep_unsharded_storage(True)`` keeps the unsharded parameters'
        storage when it reshards, so that they keep their addresses (what a CUDA graph
        captured reads). Here each group keeps the tensors of its first gather, copies
        every later gather into them, and gives them the all-gather's backward through
        ``as_gathered`` (views, with a node of this forward: [Note: unsharded parameters
        gathered outside all_gather_into] in compile_shard.ops), as for parameters kept
        after backward; resharding then frees nothing, and a backward that gathers again
        copies into the same storage (``UnshardedParams.refill``). Eager mode only: a
        compiled graph's unsharded parameters are buffers Inductor plans, so compiling a
        group that keeps its storage raises.
        """
        with torch.no_grad():
            fresh, _ = self._all_gather(self.gather_settings())
            if self._kept_storage is None:
                self._kept_storage = [tensor.detach() for tensor in fresh]
            else:
                for kept, tensor in zip(self._kept_storage, fresh):
                    kept.copy_(tensor)
        return list(self._kept_storage)

    def set_keep_unsharded_storage(self, keep: bool) -> None:
        self.keep_unsharded_storage = keep
        if not keep:
            self._kept_storage = None

    def _watch_use(self, tensors: list[torch.Tensor]) -> None:
        """Watches each unsharded parameter for whether backward reaches it ([Note: unused parameters] in
        passes.unused_params)."""
        if not self.settings.reduce_scatter_unused_params:
            for fsdp_param, tensor in zip(self.fsdp_params, tensors):
                if tensor.requires_grad:
                    fsdp_param.watch_use(tensor)

    def _drop_unused_gradients(self, all_gather_outputs: list[torch.Tensor]) -> None:
        """Each eager all-gather's backward gives no gradient to a parameter no forward used since the last reduction.

        ([Note: unused parameters] in passes.unused_params.) A hook on the all-gather's
        node, which sees the reduced gradient of each shard (the node's last inputs) before
        autograd adds what other backwards give the same shard: a compiled forward beside
        an eager call of one of its modules (a chunked loss's head) reduces the group's
        parameters in both. Weakly held, as in ``_register_post_backward``.
        """
        if self.settings.reduce_scatter_unused_params:
            return
        group_ref = weakref.ref(self)
        for part, output in zip(self.all_gather_parts, all_gather_outputs):
            if output.grad_fn is None:
                continue

            def hook(grad_inputs, grad_outputs, indices=part.indices):
                group = group_ref()
                if group is None:
                    return None
                head, grads = grad_inputs[: -len(indices)], grad_inputs[-len(indices) :]
                kept = [group.fsdp_params[index].reduced_gradient_if_used(grad) for index, grad in zip(indices, grads)]
                return (*head, *kept)

            output.grad_fn.register_hook(hook)

    def _needs_autograd_graph(self, unsharded: UnshardedParams) -> bool:
        return (
            not unsharded.takes_gradients
            and torch.is_grad_enabled()
            and any(fsdp_param.sharded_param.requires_grad for fsdp_param in self.fsdp_params)
        )

    def reshard(self) -> None:
        self._register_sharded()
        if self.kept_after_backward is not None and not self._kept_by_trace:
            _free_storages(self.kept_after_backward)  # as FSDP2 frees them, whatever else holds them
            for ref in self._live:  # and the gather they came from refills before another backward reads them
                unsharded = ref()
                if unsharded is not None and unsharded.kept:
                    unsharded.is_freed = True
                    unsharded.kept = False
        # A traced forward's are dropped, not freed: its own backward may still read them.
        self.kept_after_backward = None
        if self.unsharded is not None:
            self.unsharded.free()
            self.unsharded = None

    @_profiled("all_gather")
    def _refill(self, unsharded: UnshardedParams) -> None:
        with torch.no_grad():
            if unsharded.post_forward_chunks is not None:
                fresh = self._all_gather_post_forward_chunks(unsharded.post_forward_chunks)
            else:
                fresh, _ = self._all_gather(self.gather_settings())
        unsharded.refill(fresh)

    def show_traced_unsharded_params(self) -> bool:
        """Inside a trace: gathers and shows the group unless it is already shown."""
        if self.shown_params[0] is not None:
            return False
        for slot, (fsdp_param, tensor) in enumerate(zip(self.fsdp_params, self.traced_unsharded_params())):
            fsdp_param.show_unsharded(tensor)
            # The compiled backward finds unused parameters itself (passes.unused_params): an eager
            # watch, left by a gather whose backward never ran, must not judge its gradients.
            self.use_flags[slot] = None
        return True

    def owns_slot_list(self, object_id: int) -> bool:
        return object_id in (id(self.shown_params), id(self.use_flags))

    def gather_traced(self) -> bool:
        """Inside a trace: all-gathers the group unless already done, and leaves the copy-out to its block."""
        if self.shown_params[0] is not None or self.shown_params[-1] is not None:
            return False
        settings = traced_settings(self, self.settings_version)
        with annotating_group(settings.annotation):
            self.shown_params[-1] = self._all_gather_outputs(settings.gather)
        for slot in range(len(self.fsdp_params)):
            self.use_flags[slot] = None  # see show_traced_unsharded_params
        return True

    def copy_out_in_region(self, all_gather_outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The unsharded parameters a region copies out: one ``fsdp.copy_out`` per part, and views of its outputs."""
        unsharded: list[torch.Tensor] = [None] * len(self.fsdp_params)  # type: ignore[list-item]
        for part, all_gather_output in zip(self.all_gather_parts, all_gather_outputs):
            padded = ops.copy_out(all_gather_output, self.world_size, part.padded_numels)
            for index, flat, shape in zip(part.indices, padded, part.unsharded_shapes):
                unsharded[index] = _unpadded(flat.view(-1, *shape[1:]), shape[0])
        return unsharded

    def copy_out_traced(self, all_gather_outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies out and shows the unsharded parameters from ``gather_traced``'s all-gather outputs."""
        settings = traced_settings(self, self.settings_version)
        with annotating_group(settings.annotation):
            tensors = self._copy_out(all_gather_outputs, settings.gather.all_gather_parts)
        for fsdp_param, tensor in zip(self.fsdp_params, tensors):
            fsdp_param.show_unsharded(tensor)
        return tensors

    def hide_traced_unsharded_params(self) -> None:
        self.shown_params[:] = [None] * len(self.shown_params)

    @_profiled("pre_forward")
    def pre_forward(self) -> None:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return  # activation-checkpoint recompute: parameters are already unsharded
        if in_backward():
            # [Note: a forward recomputed in backward]
            # Activation checkpointing recomputes a region's forward when backward first
            # reads one of its saved tensors: for a group inside the region (a nested
            # fully_shard on feed_forward.w1 of a checkpointed block) that is before the
            # group's pre-backward. The recompute computes with the gather its forward
            # made ([Note: one gather per backward window]), refilled, and does not
            # reshard after it, as FSDP2's post-forward does not in backward: the
            # checkpoint keeps views of these tensors for the original graph's backward,
            # and the group's post-backward frees them.
            self.training_state = TrainingState.RECOMPUTE
            self.unshard()
            return
        if self.forwards_left == 0:
            self.forwards_left = self.forwards_per_iteration
        self.training_state = TrainingState.FORWARD
        self.unshard()
        for group in self.settings.forward_prefetch:
            with torch.profiler.record_function(f"FSDP::forward_prefetch for {group.settings.module_name}"):
                group.unshard()

    @_profiled("post_forward")
    def post_forward(self, output: Any) -> Any:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return output
        if self.training_state is TrainingState.RECOMPUTE:  # [Note: a forward recomputed in backward]
            self.training_state = TrainingState.IDLE
            self.hide_unsharded_params()
            return output
        unsharded = self.unsharded
        if unsharded is None:
            self.training_state = TrainingState.IDLE
            return output
        self._register_pre_backward(output, unsharded)
        self.forwards_left -= 1
        if self.forwards_left > 0:
            return output  # another module of the list runs its forward with these parameters
        self.training_state = TrainingState.IDLE
        for fsdp_param in self.fsdp_params:
            fsdp_param.show_sharded()
        if self.settings.reshard_after_forward:
            self.reshard()
        return output

    def _register_pre_backward(self, output: Any, unsharded: UnshardedParams) -> None:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            self.pre_backward(unsharded)
            return grad

        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(hook)

    def register_post_backward_on_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """For a group with frozen parameters: frees its parameters once backward reaches the module's inputs.

        [Note: post-backward of a frozen group]
        A group whose parameters all have ``requires_grad=False`` gathers them
        detached: its all-gather has no autograd node to hook, yet backward still
        runs through the module (for its inputs' gradients) and needs the unsharded
        parameters refilled (pre-backward, on the outputs) and freed after. FSDP2's
        answer, used here too: an identity autograd function on the inputs, whose
        backward runs once the module's backward has produced their gradients. A
        module whose inputs take no gradient has no backward to run; the root's final
        callback reshards anything left (``finalize_backward``). A group with frozen
        parameters of another dtype than its trainable ones ends its backward here too
        (``UnshardedParams.all_gather_node``).
        """
        unsharded = self.unsharded
        if (
            unsharded is None
            or unsharded.all_gather_node is not None
            or self.training_state is not TrainingState.FORWARD
            or self.forwards_left != self.forwards_per_iteration  # a list's first module: its backward ends last
            or not torch.is_grad_enabled()
        ):
            return args, kwargs
        flat, spec = tree_flatten((args, kwargs))
        positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not positions:
            return args, kwargs
        wrapped = _PostBackward.apply(lambda: self.post_backward(unsharded), *(flat[i] for i in positions))
        for i, tensor in zip(positions, wrapped):
            flat[i] = tensor
        return tree_unflatten(flat, spec)

    def _register_post_backward(self, unsharded: UnshardedParams) -> None:
        """Runs ``post_backward`` when the all-gather's backward has run.

        [Note: no reference cycle through an autograd node]
        Python's garbage collector does not look into autograd's C++ objects: a hook on
        a node (``grad_fn.register_hook``) or a leaf's post-accumulate-grad hook that
        reaches back to what holds the node or the leaf closes a cycle ``gc.collect()``
        never frees. This hook lives on the all-gather's node, which the unsharded
        parameters reach through their ``grad_fn``; holding ``unsharded`` or the group,
        every forward's unsharded parameters, and with them the group, its sharded
        parameters and the module, would outlive the model. It holds weak references
        instead, as ``FSDPParam``'s hook on its shard does. Until its backward has run,
        the forward's outputs keep ``unsharded`` alive through their pre-backward hooks
        (``_register_pre_backward``), which the graph holds and which hold nothing that
        holds the graph.
        """
        group_ref, unsharded_ref = weakref.ref(self), weakref.ref(unsharded)
        # FSDP2's profiler range around the reduction, which the all-gather's backward runs (``_profiled``).
        reduction = torch.profiler.record_function(f"FSDP::post_backward_reduce ({self.settings.module_name})")

        def pre_hook(grad_outputs):
            reduction.__enter__()

        def hook(grad_inputs, grad_outputs):
            reduction.__exit__(None, None, None)
            group, live = group_ref(), unsharded_ref()
            if group is not None and live is not None:
                group.post_backward(live)

        unsharded.all_gather_node.register_prehook(pre_hook)
        unsharded.all_gather_node.register_hook(hook)

    @_profiled("pre_backward")
    def pre_backward(self, unsharded: UnshardedParams) -> None:
        if self.training_state is TrainingState.PRE_BACKWARD and self.unsharded is unsharded:
            return
        # Another backward through a gather whose backward already ran (a backward per chunk of
        # a loss, retain_graph=True): as in FSDP2, it gathers again and its all-gather's backward
        # reduce-scatters this backward's gradients too, added to the sharded ones.
        unsharded.backward_done = False
        self.unsharded = unsharded
        if self.unshard_in_backward:
            if unsharded.is_freed:
                self._refill(unsharded)
            for fsdp_param, tensor in zip(self.fsdp_params, unsharded.tensors):
                fsdp_param.show_unsharded(tensor)
        self.training_state = TrainingState.PRE_BACKWARD
        for group in self.settings.backward_prefetch:
            with torch.profiler.record_function(f"FSDP::backward_prefetch for {group.settings.module_name}"):
                group.prefetch_for_backward()

    def prefetch_for_backward(self) -> None:
        """Re-gathers, ahead of its own backward, the parameters the group's latest forward freed."""
        for ref in reversed(self._live):
            unsharded = ref()
            if unsharded is not None and not unsharded.backward_done:
                if unsharded.is_freed and self.unshard_in_backward:
                    self._refill(unsharded)
                return

    @_profiled("post_backward_reshard")
    def post_backward(self, unsharded: UnshardedParams) -> None:
        unsharded.backward_done = True
        if (
            not self.settings.reshard_after_backward
            and not unsharded.is_freed
            and (self.kept_after_backward is None or unsharded.kept)
        ):
            self.kept_after_backward, self._kept_by_trace = tuple(unsharded.tensors), False
            unsharded.kept = True
        else:
            unsharded.free()
        unsharded.post_forward_chunks = None
        if self.unsharded is unsharded:
            self.unsharded = None
        if self.unsharded is None and self.kept_after_backward is None:
            self._register_sharded()
        else:  # kept after backward, or unsharded by a later forward: still registered, as in FSDP2
            for fsdp_param in self.fsdp_params:
                fsdp_param.show_sharded()
        self.training_state = TrainingState.IDLE

    def reset_iter_state(self) -> None:
        self.reshard()
        self.training_state = TrainingState.IDLE
        self.forwards_left = 0

    def start_iteration(self) -> None:
        """At the root's forward: a list's modules that did not all run last time start over."""
        self.forwards_left = 0

    def finalize_backward(self) -> None:
        """Reshards a group whose all-gather received no gradient in this backward."""
        if self.training_state is TrainingState.PRE_BACKWARD:
            self.reshard()
        self.training_state = TrainingState.IDLE

    def live_unsharded_bytes(self) -> int:
        """Bytes of unsharded storage alive for this group, also inside autograd's graph."""
        self._live = [ref for ref in self._live if ref() is not None]
        tensors = [tensor for ref in self._live for tensor in ref().tensors] + list(self.kept_after_backward or ())
        return _live_bytes(tensors)
