"""One ``fully_shard`` call's parameters in eager mode: their unshard/reshard lifecycle around forward and backward."""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import ops
from ._group_gather import GatheringGroup


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


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to each tensor in it, found as FSDP2 finds a module's inputs and outputs.

    In lists, tuples, named tuples, dicts and dataclasses (a block may hand the next
    its activations in a dataclass): each is rebuilt around the new tensors, a
    dataclass as a shallow copy, as FSDP2's ``_apply_to_tensors`` rebuilds it.
    """
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        rebuilt = copy.copy(tree)
        for field in dataclasses.fields(tree):
            object.__setattr__(rebuilt, field.name, map_tensors(fn, getattr(tree, field.name)))
        return rebuilt
    if isinstance(tree, dict):
        return type(tree)((key, map_tensors(fn, value)) for key, value in tree.items())
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a named tuple
        return type(tree)(*(map_tensors(fn, item) for item in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tensors(fn, item) for item in tree)
    return tree


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors of a module's inputs or outputs (``map_tensors``' structures)."""
    found: list[torch.Tensor] = []
    map_tensors(lambda tensor: found.append(tensor) or tensor, tree)
    return found


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


class FSDPParamGroup(GatheringGroup):
    """The parameters of one ``fully_shard`` call: one all-gather, one reduce-scatter, and their lifecycle.

    The unshard and reshard of eager mode around the modules' forward and backward; the
    settings and the gathers it runs are its layers below (``_group_config``,
    ``_group_gather``).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        """``ConfiguredGroup``'s arguments; then the lifecycle's state."""
        super().__init__(*args, **kwargs)
        self.kept_after_backward = None
        self._kept_by_trace = False
        self.training_state = TrainingState.IDLE
        self.forwards_left = 0
        # FSDP2's set_unshard_in_backward: False for a group whose backward reads no
        # parameter (an embedding's gradient needs only its indices): eager backward
        # then gathers nothing. Compiled graphs gather in backward only what it reads.
        self.unshard_in_backward = True
        # FSDP2's set_keep_unsharded_storage ([Note: unsharded storage kept across reshards]).
        self.keep_unsharded_storage = False
        self._kept_storage: list[torch.Tensor] | None = None
        self.unsharded: UnshardedParams | None = None
        self._live: list[weakref.ref[UnshardedParams]] = []


    # Collectives ------------------------------------------------------------------


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

    @_profiled("pre_forward")
    def pre_forward(self) -> None:
        if self.training_state is TrainingState.PRE_BACKWARD:
            # An activation-checkpoint recompute after the pre-backward: the parameters are unsharded
            # already. Shown again as the forward showed them, so that the recompute saves what the
            # forward saved (a tensor-parallel parameter's DTensor is made anew at each show).
            if self.unsharded is not None and self.unshard_in_backward:
                for fsdp_param, tensor in zip(self.fsdp_params, self.unsharded.tensors):
                    fsdp_param.show_unsharded(tensor)
            return
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

        for tensor in tensors_in(output):
            if tensor.requires_grad:
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
        taking_gradients = list({id(x): x for x in tensors_in((args, kwargs)) if x.requires_grad}.values())
        if not taking_gradients:
            return args, kwargs
        wrapped = _PostBackward.apply(lambda: self.post_backward(unsharded), *taking_gradients)
        replacement = {id(tensor): wrapper for tensor, wrapper in zip(taking_gradients, wrapped)}
        return map_tensors(lambda tensor: replacement.get(id(tensor), tensor), (args, kwargs))

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
