"""``FSDPModule``'s settings: FSDP2's knobs on a sharded module, each passed to its groups.

A base of ``FSDPModule`` (``_api``), which gives it the groups to set
(``_groups``, ``_fsdp_modules``, ``_get_fsdp_state``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from . import ops
from ._group import FSDPParamGroup
from ._state import get_state


def _prefetch_groups(modules: list[nn.Module], knob: str) -> list[FSDPParamGroup]:
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


class FSDPModuleSettings:
    """FSDP2's ``FSDPModule`` setters, eager and compiled: each sets its module's groups (or its subtree's).

    A compiled model reads them as constants of the trace and recompiles for a new
    value ([Note: settings a trace reads as constants] in compile_shard._group_gather).
    """

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

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """All-gathers ``modules``' parameters when this module's forward starts (FSDP2's knob).

        Eager: their all-gathers are issued right after this module's own. Compiled:
        the ``reorder`` pass issues them no later than this module's wait. A compiled
        model recompiles for a new list.
        """
        group = self._get_fsdp_state().group_for_prefetch("set_modules_to_forward_prefetch")
        group.set_forward_prefetch(_prefetch_groups(modules, "set_modules_to_forward_prefetch"))

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """Re-gathers ``modules``' parameters when this module's backward starts (FSDP2's knob)."""
        group = self._get_fsdp_state().group_for_prefetch("set_modules_to_backward_prefetch")
        group.set_backward_prefetch(_prefetch_groups(modules, "set_modules_to_backward_prefetch"))

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
