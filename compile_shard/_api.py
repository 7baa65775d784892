"""``fully_shard`` and ``FSDPModule``: FSDP2's public API over the ``fsdp`` ops."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn as nn
from torch._C._dynamo.eval_frame import set_code_exec_strategy
from torch._dynamo.eval_frame import OptimizedModule, skip_code
from torch._dynamo.types import FrameAction, FrameExecStrategy
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, UnshardHandle
from torch.distributed.tensor import DTensor, Shard

from . import ops
from ._attribute_writes import CountsWrites
from ._classes import subclass, user_class, user_class_name
from ._group import FSDPParamGroup, in_backward
from ._param import FSDPParam, ParamUsage
from ._region import call_copied_out, call_in_region, compiling_gathered
from ._init import (
    as_module_list,
    check_contiguous,
    check_mesh,
    check_policy_types,
    check_spmd_params,
    check_tensor_parallel_params,
    chosen_shard_dim,
    data_parallel_dims,
    default_mesh,
    managed_buffers,
    managed_params,
    move_to_mesh_device,
    resolve_reshard_after_forward,
    shard_memory,
    smaller_reshard_group,
    tensor_parallel_dims,
)
from ._state import STATE_ATTR, FSDPState, before_step, get_state, post_forward_eagerly, pre_forward_eagerly
from ._versions import CompletedGradientReduction, GradientReductionHandle
from .ops.rank_check import raise_for_a_peer_stop
from .passes import install

__all__ = ["FSDPModule", "fully_shard"]

#: The entry under "fully_shard" in torch's composable-API registry, which ``replicate()`` and FSDP2
#: read to leave a sharded subtree alone. One object for every call: a block's region signature
#: compares the objects its modules hold (``_region.block_signature``).
_REGISTRY_ITEM = RegistryItem()
#: Where ``fully_shard`` keeps an ``OptimizedModule``'s ``forward`` ([Note: a block compiled on its own]).
_COMPILED_FORWARD_ATTR = "_compile_shard_compiled_forward"


def _prefetch_groups(modules: list[FSDPModule], knob: str) -> list[FSDPParamGroup]:
    groups = []
    for module in modules:
        state = get_state(module) if isinstance(module, nn.Module) else None
        if state is None or state.group is None:
            raise ValueError(
                f"{knob}: {type(module).__name__} is not a module with parameters sharded by fully_shard; "
                "pass modules returned by fully_shard(...)"
            )
        groups.append(state.group)
    return groups


class FSDPModule(CountsWrites, TorchFSDPModule):
    """Mixed into the class of every module passed to :func:`fully_shard`.

    A subclass of torch's ``FSDPModule``, so that code which finds FSDP2 modules with
    ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` finds these too. Every method
    of torch's class is overridden here: each runs on compile_shard's state, or raises
    ``NotImplementedError`` saying why (docs/api.md lists them all).

    [Note: forward wrapper instead of hooks]
    FSDP2 unshards in a forward pre-hook. compile_shard wraps ``forward`` instead:
    ``torch.compile(model)`` runs the root module's hooks outside the compiled
    frame (each becomes a graph of its own), while the root's ``forward`` (through
    ``_sharded_forward``, [Note: a block compiled on its own]) is the compiled frame
    itself. Wrapping ``forward`` puts the root's all-gather in the one forward graph,
    and behaves the same in eager mode.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Building a sharded module's class anew (a container's slice) builds the user's class.

        Without arguments it is ``copy`` or ``pickle`` allocating the object whose
        state they fill next (``copy.deepcopy`` of a sharded model): that keeps the class.
        """
        if not args and not kwargs:
            return object.__new__(cls)
        return user_class(cls)(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Dynamo never traces this frame on its own (``skip_code`` below); traced inside a frame, it inlines.

        [Note: a block compiled on its own]
        Torchtitan compiles each block on its own and runs the root eagerly. FSDP2's
        hooks then run eagerly around each block's compiled forward, and all blocks of
        a class share one graph. So do compile_shard's:
        - Compiled after ``fully_shard`` (``block.compile()``, ``torch.compile(block)``),
          Dynamo skips torch's ``_call_impl`` and would start at this frame. It skips it
          too, so the sharding runs eagerly, and Dynamo starts at ``_user_forward``.
          Gathering inside the block's graph instead would guard the graph on the
          block's state: each block would compile anew, and past torch's recompile limit
          (8) the rest would run uncompiled.
        - Compiled before (torchtitan's order), the block is torch's ``OptimizedModule``,
          whose ``forward`` is an instance attribute, the compiled call of the original
          module: ``fully_shard`` moves it where ``_user_forward`` calls it.
        - The root's frame is ``_sharded_forward``, which Dynamo traces: the one graph of
          ``torch.compile(model)``, every block's forward inlined into it. A root compiled
          before ``fully_shard`` compiles that frame with its own compile options, so it
          makes the same graph; run eagerly instead, it would gather its own parameters
          outside the graph of its compiled forward.
        """
        state = self.__dict__[STATE_ATTR]  # no call: each would be a frame Dynamo compiles on its own
        compiling = torch.compiler.is_compiling()
        if state.is_root and not compiling:
            before_step(state)
            sharded_forward = self._sharded_forward
            if isinstance(self, OptimizedModule):
                sharded_forward = self.dynamo_ctx(sharded_forward)
            try:
                return sharded_forward(args, kwargs, requires_grad_noted=True)
            except BaseException as error:
                _trace_the_root_frame_again()
                raise_for_a_peer_stop(error)
                raise
        if compiling:
            return self._sharded_forward(args, kwargs)
        shown, args, kwargs = pre_forward_eagerly(state, args, kwargs)
        return post_forward_eagerly(state, self._user_forward(*args, **kwargs), shown)

    def _sharded_forward(self, args: tuple, kwargs: dict, requires_grad_noted: bool = False) -> Any:
        """The forward between unshard and reshard; traced, the all-gathers and reductions are in the graph.

        It reads the state through ``self``: Dynamo keeps the sizes of tensors reached
        through a module static, where a recompile would make those of an argument's
        symbolic (automatic dynamic). ``requires_grad_noted``: see ``FSDPState.pre_forward``.
        """
        state = self._get_fsdp_state()
        shown, args, kwargs = state.pre_forward(args, kwargs, requires_grad_noted)
        if state.compiles_as_region(args, kwargs):
            output = call_in_region(cast(nn.Module, self), args, kwargs)
        elif compiling_gathered(state.group):
            output = call_copied_out(cast(nn.Module, self), args, kwargs)
        else:
            output = self._user_forward(*args, **kwargs)
        return state.post_forward(output, shown)

    def _user_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own forward, which the region calls: its class's, or the compiled one torch.compile set."""
        compiled_forward = self.__dict__.get(_COMPILED_FORWARD_ATTR)
        if compiled_forward is not None:
            return compiled_forward(*args, **kwargs)
        return super().forward(*args, **kwargs)  # type: ignore[misc]

    def _get_fsdp_state(self) -> FSDPState:
        return cast(FSDPState, get_state(cast(nn.Module, self)))

    def _fsdp_modules(self, recurse: bool) -> list[FSDPModule]:
        modules = cast(nn.Module, self).modules() if recurse else [self]
        return [module for module in modules if isinstance(module, FSDPModule)]

    def _groups(self, recurse: bool = False) -> list[FSDPParamGroup]:
        """The groups of this module (and below), each once: a list's modules share one."""
        states = (module._get_fsdp_state() for module in self._fsdp_modules(recurse))
        return list(dict.fromkeys(state.group for state in states if state.group is not None))

    # Unshard and reshard ---------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gathers this module's parameters now and registers the unsharded tensors.

        A later forward uses them without another all-gather. Call it with the grad
        mode the forward will use: the all-gather is part of the autograd graph.
        The all-gather has completed when this returns, so with ``async_op=True``
        the returned handle's ``wait()`` has nothing left to wait for.
        """
        for group in self._groups():
            group.unshard()
            group.hide_unsharded_params()  # the forward shows them; until then the registered ones are read
        return UnshardHandle() if async_op else None

    def reshard(self) -> None:
        """Frees this module's unsharded parameters and registers the sharded ones (not recursive)."""
        for group in self._groups():
            group.reshard()

    def reset_iter_state(self) -> None:
        """After a forward or backward raised: reshards every group and forgets the iteration (FSDP2's recovery).

        Call it on the root. Gradients of the failed iteration that were not reduced
        yet are lost, as in FSDP2.
        """
        state = self._get_fsdp_state()
        if not state.is_root:
            raise RuntimeError(
                f"reset_iter_state: {user_class_name(cast(nn.Module, self))} is not the root fully_shard module; "
                "call it on the module fully_shard was applied to last (the model)"
            )
        state.reset_iter_state()

    # Training-loop settings ------------------------------------------------------------

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Sets whether the unsharded parameters are freed after forward (and re-gathered in backward)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for module in self._fsdp_modules(recurse):
            state = module._get_fsdp_state()
            state.reshard_after_forward = reshard_after_forward
            if state.group is not None:
                # FSDP2: a bool reshards over the whole shard group
                state.group.set_reshard_after_forward(state.resolved_reshard_after_forward())

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Sets whether backward frees the unsharded parameters (FSDP2's semantics), eager and compiled.

        False keeps them after backward, and the next forward computes with them
        instead of all-gathering: fewer all-gathers between gradient-accumulation
        micro-batches, for the unsharded parameters' memory. As in FSDP2 they are not
        refreshed, so set it back to True for the last micro-batch (or call
        ``reshard()``) before the optimizer step. Compiled, a group holding kept
        parameters runs a graph of its own ([Note: unsharded parameters kept after
        backward] in compile_shard._group_gather).
        """
        for group in self._groups(recurse):
            if not reshard_after_backward and group.settings.reshard_group is not None:
                raise NotImplementedError(
                    f"fully_shard({group.settings.module_name!r}): set_reshard_after_backward(False) with "
                    f"reshard_after_forward={group.settings.reshard_group.size} is not supported; reshard after forward "
                    "over the whole group (True) to keep the unsharded parameters between micro-batches"
                )
            group.set_reshard_after_backward(bool(reshard_after_backward))

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Sets whether backward reduce-scatters the gradients (FSDP1's ``no_sync``), eager and compiled.

        While False, each backward adds the unsharded gradients into a buffer per group
        (FSDP2's memory cost: one unsharded gradient per group, allocated here) and
        leaves ``.grad`` alone; the next backward with sync on adds the buffer to its
        gradients and reduce-scatters once. A compiled model keeps one graph per
        setting ([Note: gradient accumulation without sync] in compile_shard.ops).
        """
        for group in self._groups(recurse):
            group.set_requires_gradient_sync(bool(requires_gradient_sync))

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Sets whether HSDP's backward all-reduces over the replicate dimension, eager and compiled.

        While False, each backward still reduce-scatters, and adds the reduce-scattered
        gradients into a buffer per group (one rank's shards) without all-reducing them
        or touching ``.grad``; the next backward with the all-reduce on adds the buffer
        and all-reduces once (FSDP2's gradient accumulation for HSDP). A 1-D mesh has no
        all-reduce, so there it changes nothing, as in FSDP2. A compiled model keeps one
        graph per setting.
        """
        for group in self._groups(recurse):
            group.set_requires_all_reduce(bool(requires_all_reduce))

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted (FSDP2's knob): every backward here finishes its reductions before it returns.

        FSDP2 uses it to skip waiting on reduce-scatters at the end of non-last
        micro-batches; compile_shard's reductions complete inside backward, so there is
        nothing to skip and nothing to wait for.
        """

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """FSDP2's (torch 2.15): whether ``finalize_backward()`` reduces what the backwards left, eager and compiled.

        Enabled, micro-batches accumulate their gradients without sync
        (``set_requires_gradient_sync(False)``), sync goes back on, and
        ``finalize_backward()`` reduces the accumulated gradients without another
        backward ([Note: manual backward finalization] in compile_shard._group_config). Call it on
        the root, outside backward.
        """
        state = self._get_fsdp_state()
        if not state.is_root:
            raise RuntimeError(
                f"set_manual_backward_finalization must be called on the root fully_shard module, not on "
                f"{user_class_name(cast(nn.Module, self))}"
            )
        if in_backward() and bool(enabled) != state.manual_backward_finalization:
            raise RuntimeError("set_manual_backward_finalization cannot change mode during backward")
        state.manual_backward_finalization = bool(enabled)

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """FSDP2's (torch 2.15): reduces the gradients accumulated without sync, with sync back on.

        Requires ``set_manual_backward_finalization(True)``; before the first forward it
        does nothing, as in FSDP2. The reductions run eagerly and are complete when it
        returns, so with ``async_op`` the handle's ``wait()`` has nothing left to wait for.
        """
        state = self._get_fsdp_state()
        if state.lazy_initialized:
            if not state.is_root:
                raise RuntimeError(
                    f"finalize_backward must be called on the root fully_shard module, not on "
                    f"{user_class_name(cast(nn.Module, self))}"
                )
            if not state.manual_backward_finalization:
                raise RuntimeError(
                    "finalize_backward requires manual backward finalization: call "
                    "set_manual_backward_finalization(True) on the root before the forward"
                )
            if in_backward():
                raise RuntimeError("finalize_backward must be called after backward completes, not inside it")
            for substate in reversed(state.subtree_states):
                if substate.group is not None:
                    substate.group.reduce_accumulated_grad()
        return CompletedGradientReduction() if async_op else None

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """FSDP2's (torch 2.15): whether resharding keeps the unsharded parameters' storage, and with it their addresses.

        Eager mode: each gather copies into the storage the first one allocated, and
        resharding frees nothing ([Note: unsharded storage kept across reshards] in
        compile_shard._group). A compiled graph's unsharded parameters are buffers that
        Inductor plans, so compiling a model with the setting on raises.
        """
        for group in self._groups(recurse):
            group.set_keep_unsharded_storage(bool(keep))

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Sets whether backward gathers this module's parameters again (not recursive; FSDP2's knob).

        False suits a module whose backward reads none of its parameters, such as an
        embedding: its resharded parameters stay freed through backward, saving an
        all-gather. A backward that does read them then fails on the freed storage,
        as in FSDP2. Compiled graphs gather in backward only what backward reads.
        """
        for group in self._groups():
            group.unshard_in_backward = bool(unshard_in_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divides this module's reduced gradients by ``factor`` instead of the world size (not recursive).

        FSDP2's semantics (``compile_shard._group_settings.GradientReduction``). Set it before
        compiling or between steps: a compiled model recompiles for a new factor.
        """
        for group in self._groups():
            group.set_gradient_reduction(float(factor), group.force_sum_reduction_for_comms)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's deprecated name for :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduces this module's gradients with a sum and divides after it (not recursive; FSDP2's semantics)."""
        for group in self._groups():
            group.set_gradient_reduction(group.gradient_divide_factor, bool(enable))

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Sets whether a parameter the forward left unused gets a zero gradient (True) or none (False, the default).

        FSDP2's semantics, eager and compiled ([Note: unused parameters] in
        ``compile_shard.passes.unused_params``): by default such a parameter keeps its
        ``.grad``, so the optimizer skips it. Ranks that use different parameters (for
        example a mixture of experts) need True, as in FSDP2; eager backward raises
        where it sees that another rank used a parameter this one did not. A compiled
        model recompiles for a new setting.
        """
        for group in self._groups(recurse):
            group.set_reduce_scatter_unused_params(bool(reduce_scatter_unused_params))

    # Prefetching -----------------------------------------------------------------------

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gathers ``modules``' parameters when this module's forward starts (FSDP2's knob).

        Eager: their all-gathers are issued right after this module's own. Compiled:
        the ``reorder`` pass issues them no later than this module's wait. A compiled
        model recompiles for a new list.
        """
        group = self._get_fsdp_state().group_for_prefetch("set_modules_to_forward_prefetch")
        group.set_forward_prefetch(_prefetch_groups(modules, "set_modules_to_forward_prefetch"))

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Re-gathers ``modules``' parameters when this module's backward starts (FSDP2's knob)."""
        group = self._get_fsdp_state().group_for_prefetch("set_modules_to_backward_prefetch")
        group.set_backward_prefetch(_prefetch_groups(modules, "set_modules_to_backward_prefetch"))

    # Streams, buffers and communication backends ---------------------------------------

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Accepted (FSDP2's knob): the all-gathers here run on the current stream, after the optimizer step."""

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """Validated and accepted: reduce-scatter inputs here are planned by Inductor or freed at once in eager."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """FSDP2's knob: the collectives' buffers from the process group's own allocator, where its backend has one.

        A backend without one (gloo, the fake and threaded test groups) makes FSDP2 fall
        back to torch's allocator, as compile_shard always does: accepted there. A
        backend with one (NCCL with a memory allocator) raises ``NotImplementedError``;
        Inductor plans the compiled graphs' buffers instead ([Note: planned all-gather
        buffers]). As in FSDP2, it cannot be combined with a custom all-gather or
        reduce-scatter (``AssertionError``), whose buffers are their own.
        """
        for group in self._groups():
            custom = group.settings.all_gather_comm_name or group.settings.reduce_scatter_comm_name
            if custom is not None:
                raise AssertionError(
                    f"fully_shard({group.settings.module_name!r}): cannot call set_allocate_memory_from_process_group_for_comm "
                    "after set_custom_all_gather or set_custom_reduce_scatter: the custom collective allocates its "
                    "own buffers (FSDP2's rule)"
                )
            if enable and ops.allocates_comm_tensors(
                group.mesh.get_group(group.mesh.ndim - 1), torch.device(group.mesh.device_type)
            ):
                raise NotImplementedError(
                    f"fully_shard({group.settings.module_name!r}): set_allocate_memory_from_process_group_for_comm(True) on "
                    "a process group that allocates tensors is not supported: compile_shard allocates collective "
                    "buffers as ordinary tensors, planned by Inductor in compiled graphs"
                )

    def set_custom_all_gather(self, comm: Any) -> None:
        """Gathers this module's group with ``comm`` (FSDP2's ``AllGather``; not recursive), eager and compiled.

        ``comm.allocate(size, dtype=, device=)`` makes the all-gather output and
        ``comm(output_tensor=, input_tensor=, group=, async_op=)`` runs it, as in FSDP2;
        a compiled graph calls it in every step ([Note: custom collectives] in
        compile_shard.ops.all_gather). ``None`` goes back to compile_shard's all-gather.
        """
        for group in self._groups():
            group.set_custom_all_gather(comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Reduce-scatters this module's gradients with ``comm`` (FSDP2's ``ReduceScatter``), eager and compiled.

        ``comm.allocate`` makes the reduce-scatter input and output, and
        ``comm(output_tensor=, input_tensor=, group=, op=)`` runs it, as in FSDP2; a
        compiled backward calls it in every step. ``None`` goes back to compile_shard's
        reduce-scatter.
        """
        for group in self._groups():
            group.set_custom_reduce_scatter(comm)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None] | None, *, stream: Any = None) -> None:
        """Calls ``hook(reduced_gradient)`` in each backward of this module's group (not recursive), eager and compiled.

        FSDP2's semantics: the hook gets the group's reduce-scatter output (after
        HSDP's all-reduce), flat and padded, in the reduction dtype, and may change it
        in place before the post-division and the copy into ``.grad``. A compiled
        backward calls the Python hook in every step too: it is not traced ([Note: the
        all-reduce hook] in compile_shard.ops). ``stream`` is accepted except with HSDP
        (FSDP2's ``ValueError``); the hook runs on the current stream.
        """
        for group in self._groups():
            if stream is not None and group.replicate_group_name is not None:
                raise ValueError("stream cannot be set when using native HSDP")
            group.set_all_reduce_hook(hook)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Runs the gradient reduce-scatters on a process group of their own (FSDP2's semantics), eager and compiled.

        One new process group over each set of shard ranks, made by this call on every
        rank (a collective call, as in FSDP2); ``False`` goes back to the shard group.
        The values do not change; the reduce-scatters no longer queue behind the
        all-gathers on one communicator. A compiled model recompiles for a new setting.
        """
        new_groups: dict[tuple[int, ...], str] = {}
        for group in self._groups(recurse):
            group.set_separate_reduce_scatter_group(bool(enable), new_groups)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        raise NotImplementedError(
            "set_symm_mem_for_comm: symmetric-memory all-gathers need NCCL on CUDA (FSDP2 fails at its first "
            "all-gather without them), and compile_shard's collectives do not use them; its compiled graphs' "
            "all-gather buffers are planned by Inductor instead"
        )

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """``module.to(...)``, ``to_empty(...)``: re-pads shards whose storage was replaced.

        ``nn.Module._apply`` itself, not torch ``FSDPModule``'s, which reads torch's own
        ``FSDPParam`` (torch 2.15's captures each parameter's ``grad_dtype`` there).
        """
        self.reshard()
        group = self._get_fsdp_state().group
        for fsdp_param in group.fsdp_params if group is not None else ():
            fsdp_param.capture_grad_dtype_policy()
        result = nn.Module._apply(cast(nn.Module, self), *args, **kwargs)
        if group is not None:
            for fsdp_param in group.fsdp_params:
                fsdp_param.adopt_loaded_param()  # as FSDP2's reset_sharded_param, a parameter assigned since
                fsdp_param.reset_sharded_param()
                fsdp_param.apply_grad_dtype_policy()
            group.resolve_dtypes()
        return result


skip_code(FSDPModule.forward.__code__)  # [Note: a block compiled on its own]


def _trace_the_root_frame_again() -> None:
    """After a forward that raised, Dynamo traces the root's frame again at the next call.

    [Note: a trace that raised]
    Where a traced forward raises (a parameter still on the meta device, a user's own
    ``raise`` in a block), Dynamo cannot resume after the error, runs the frame eagerly
    to raise it, and marks the frame's code to be skipped from then on. That code,
    ``_sharded_forward``, is every sharded model's root frame: every later
    ``torch.compile`` in the process, of any sharded model, would start its traces at
    the runtime's inner functions instead, several graphs where there was one, which
    then disagree about what was gathered. The root's frame is entered from here,
    eagerly, so the error passes through here first: its code gets Dynamo's default
    strategy back (its compiled entries stay), and the next call traces it as one graph.
    """
    set_code_exec_strategy(
        FSDPModule._sharded_forward.__code__, FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT)
    )


_FSDP_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    """``FSDP<Class>``: ``FSDPModule`` first, then the module's class ([Note: the classes of a sharded module])."""
    if cls not in _FSDP_CLASSES:
        fsdp_class = subclass(cls, (FSDPModule, cls), {})
        fsdp_class.__name__ = fsdp_class.__qualname__ = f"FSDP{fsdp_class.__name__}"
        _FSDP_CLASSES[cls] = fsdp_class
    return _FSDP_CLASSES[cls]


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
) -> FSDPModule:
    """Shards ``module``'s parameters on dim 0 (or ``shard_placement_fn``'s dim) across ``mesh`` (FSDP2 semantics).

    Apply it bottom-up: to each block first, then to the root. Each call forms one
    group: one all-gather before the module's forward, one reduce-scatter of its
    gradients in backward. ``reshard_after_forward`` frees the unsharded parameters
    after forward and gathers them again before backward; ``None`` (the default)
    means True except for the root module, as in FSDP2 (an int is FSDP2's group size
    to reshard to: 1 is False, the shard group's size True, another factor a smaller
    group the parameters stay sharded over until backward). A list of modules forms one
    group, unsharded until each of them has run its forward. Parameters that are
    DTensors on a tensor-parallel mesh (after ``parallelize_module``) are sharded over
    ``mesh`` beside it, as in FSDP2; with ``dp_mesh_dims`` (torch's
    ``DataParallelMeshDims``) ``mesh`` is the full SPMD mesh the parameters live on
    and the named dims are the data-parallel ones. ``ignored_params`` stay
    plain, unsharded parameters whose gradients are not reduced. ``mp_policy`` and
    ``offload_policy`` are torch's own policies with FSDP2's semantics; a value of
    another type is a ``TypeError``, and what compile_shard cannot honour
    (another ``OffloadPolicy`` subclass, CPU offload of an all-gather extension) a
    ``NotImplementedError`` naming it (docs/api.md).
    """
    modules = as_module_list(module)
    label = "+".join(user_class_name(m) for m in modules)
    check_policy_types(label, mp_policy, offload_policy)
    mesh = mesh if mesh is not None else default_mesh()
    spmd_mesh, spmd_data_parallel_dims = None, ()
    if dp_mesh_dims is None:
        check_mesh(label, mesh, tensor_parallel_dims(modules))
    else:
        spmd_mesh, spmd_data_parallel_dims = mesh, data_parallel_dims(label, mesh, dp_mesh_dims)
        if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
            raise NotImplementedError(
                f"fully_shard({label}): reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims)"
            )
        dims = [spmd_mesh[spmd_mesh.mesh_dim_names[dim]] for dim in spmd_data_parallel_dims]
        mesh = dims[0] if len(dims) == 1 else DeviceMesh._concatenate(dims)  # the data-parallel mesh
    pin_memory, compute_device = shard_memory(label, mesh, offload_policy)
    reshard_after_forward = resolve_reshard_after_forward(label, reshard_after_forward, mesh.size(-1))
    reshard_size = None  # of a smaller group to reshard to
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        reshard_size, reshard_after_forward = reshard_after_forward, True
    ignored = {id(param) for param in ignored_params or ()}
    usages: dict[nn.Parameter, list[ParamUsage]] = {}
    named: dict[str, nn.Parameter] = {}
    for index, top in enumerate(modules):
        # A list's parameters are named by position until the root names them ([Note: the root ...]).
        prefix = f"[{index}]." if len(modules) > 1 else ""
        fqn_of = {id(param): prefix + fqn for fqn, param in top.named_parameters()}
        for param, param_usages in managed_params(top, label, ignored).items():
            if param not in usages:
                named[fqn_of[id(param)]] = param
            usages.setdefault(param, []).extend(param_usages)
    if spmd_mesh is None:
        check_tensor_parallel_params(label, mesh, named)
        if reshard_size is not None and any(isinstance(param, DTensor) for param in named.values()):
            raise NotImplementedError(
                f"fully_shard({label}): resharding to a smaller group (reshard_after_forward={reshard_size}) is "
                "not supported for DTensor (tensor-parallel) parameters, as in torch FSDP2; pass True or False"
            )
    else:
        check_spmd_params(label, spmd_mesh, named, spmd_data_parallel_dims)
    move_to_mesh_device(label, mesh, [*named.values(), *managed_buffers(modules)])
    check_contiguous(label, named)
    shard_dims = [chosen_shard_dim(label, fqn, param, shard_placement_fn, mesh) for fqn, param in named.items()]
    group = None
    if usages:
        fsdp_params = [
            FSDPParam(param, fqn, usage, mesh, spmd_data_parallel_dims, shard_dim, pin_memory, compute_device)
            for (fqn, param), usage, shard_dim in zip(named.items(), usages.values(), shard_dims)
        ]
        group = FSDPParamGroup(
            fsdp_params,
            label,
            mesh,
            reshard_after_forward=reshard_after_forward is not False,
            forwards_per_iteration=len(modules),
            mp_policy=mp_policy,
            reshard_group=None if reshard_size is None else smaller_reshard_group(mesh, reshard_size),
        )
    install()  # the pass suite, for torch.compile of this model
    state = FSDPState(modules, mesh, group, reshard_after_forward, mp_policy)
    sharded_below = any(get_state(sub) is not None for top in modules for sub in top.modules())
    for top in modules:
        top.__dict__[STATE_ATTR] = state
        top.__dict__.setdefault(REGISTRY_KEY, {}).setdefault("fully_shard", _REGISTRY_ITEM)
        if isinstance(top, OptimizedModule):  # compiled before fully_shard: [Note: a block compiled on its own]
            top.__dict__[_COMPILED_FORWARD_ATTR] = top.__dict__.pop("forward")
        top.__class__ = _fsdp_class(type(top))
    if group is not None and not sharded_below and len(modules) == 1:
        state.region_changed()
    state.claim_root()
    return cast(FSDPModule, module)


def _state(module: nn.Module) -> FSDPState | None:
    """``fully_shard.state(module)``: the state of the ``fully_shard`` call applied to ``module``, else None.

    The accessor torch's composable-API contract gives FSDP2's ``fully_shard``; the
    modules of one list share one state.
    """
    return get_state(module)


fully_shard.state = _state  # type: ignore[attr-defined]


