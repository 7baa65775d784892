"""``fully_shard`` and ``FSDPModule``: FSDP2's public API over the ``fsdp`` ops."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._C._dynamo.eval_frame import set_code_exec_strategy
from torch._dynamo.eval_frame import OptimizedModule, skip_code
from torch._dynamo.types import FrameAction, FrameExecStrategy
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem, _get_registry
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, UnshardHandle
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._pytree import tree_flatten, tree_map

from . import ops
from ._attribute_writes import CountsWrites, count_writes
from ._group import FSDPParamGroup, ReshardGroup, in_backward
from ._param import FSDPParam, ParamUsage, sharding_of
from ._region import (
    REGIONS_SUPPORTED,
    accepts_region_call,
    call_copied_out,
    call_in_region,
    compiling_gathered,
    enters_gathered_as_views,
    runs_outside_regions,
)
from ._gc_during_compile import defer_full_collections_while_compiling
from ._versions import CompletedGradientReduction, GradientReductionHandle, warn_if_regions_cannot_run
from .ops.rank_check import raise_for_a_peer_stop
from .passes import install
from .passes.settings import settings

__all__ = ["FSDPModule", "fully_shard"]

_STATE_ATTR = "_compile_shard_state"
#: The entry under "fully_shard" in torch's composable-API registry, which ``replicate()`` and FSDP2
#: read to leave a sharded subtree alone. One object for every call: a block's region signature
#: compares the objects its modules hold (``_region.block_signature``).
_REGISTRY_ITEM = RegistryItem()
#: Where ``fully_shard`` keeps an ``OptimizedModule``'s ``forward`` ([Note: a block compiled on its own]).
_COMPILED_FORWARD_ATTR = "_compile_shard_compiled_forward"


class FSDPState:
    """State of one ``fully_shard`` call: the group, root duties, forward wrapping.

    Shared by the modules of a list (``fully_shard([norm, output])``), whose group
    they all read.
    """

    def __init__(
        self,
        modules: list[nn.Module],
        mesh: DeviceMesh,
        group: FSDPParamGroup | None,
        reshard_after_forward: bool | None,
        mp_policy: MixedPrecisionPolicy,
    ):
        self.modules = modules
        self.module = modules[0]
        self.mesh = mesh
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy
        self.is_root = True
        self.lazy_initialized = False  # whether the root's first forward ran FSDP2's lazy-init steps
        # FSDP2's set_manual_backward_finalization ([Note: manual backward finalization] in _group).
        self.manual_backward_finalization = False
        self.subtree_states: list[FSDPState] = []
        self._final_callback_queued = False
        self._shown_by_method: list[list[FSDPParamGroup]] = []
        # For [Note: sharded blocks as nested compile regions]: the modules of a
        # module whose subtree holds no other fully_shard module, else empty.
        self.region_modules: list[nn.Module] = []
        self.is_block = False  # whether ``region_modules`` lists any: a plain read, where the list is one per module
        # The writes to the block's modules that Dynamo does not guard ([Note: a block's attribute writes are
        # counted] in ``_attribute_writes``).
        self.region_writes = 0

    def region_changed(self) -> None:
        """Lists the modules of a block traced as a compile region, and counts their writes.

        Again after a submodule was added, replaced or deleted ([Note: a block's attribute
        writes are counted] in ``_attribute_writes``).
        """
        self.region_modules = list(self.module.modules())
        self.is_block = True
        count_writes(self.region_modules, self)

    def claim_root(self) -> None:
        """Makes this state the root of every fully_shard state below it.

        [Note: the root is known at fully_shard time]
        FSDP2 picks the root lazily, at the first forward. Here the root is simply
        the fully_shard module with no fully_shard ancestor: ``fully_shard`` is
        applied bottom-up, so each call demotes the roots below it. Deciding it
        eagerly keeps the first forward free of one-time Python side effects, which
        a torch.compile trace would have to guard on (and recompile for on the
        second step).
        """
        fqns: dict[int, str] = {}
        names: dict[FSDPState, list[str]] = {}  # in module order; a list's state under each of its names
        for top in self.modules:
            fqns.update({id(param): fqn for fqn, param in top.named_parameters()})
            for name, submodule in top.named_modules():
                state = _get_state(submodule)
                if state is not None:
                    names.setdefault(state, []).append(name or _label(submodule))
        self.subtree_states = list(names)
        for state, state_names in names.items():
            state.is_root = state is self
            if state.group is None:
                continue
            state.group.change_settings(
                module_name="+".join(state_names), reshard_after_forward=state.resolved_reshard_after_forward()
            )
            for fsdp_param in state.group.fsdp_params:
                fsdp_param.fqn = fqns.get(id(fsdp_param.sharded_param), fsdp_param.fqn)
        model_groups = tuple(state.group.module_name for state in self.subtree_states if state.group is not None)
        for state in self.subtree_states:
            if state.group is not None:
                state.group.change_settings(model_groups=model_groups)

    # What torch's own helpers read from an FSDP2 state ----------------------------------
    # ``register_fsdp_forward_method`` wraps a method in ``_pre_forward`` / ``_post_forward``;
    # ``share_comm_ctx`` shares ``_comm_ctx`` between roots (compile_shard issues every
    # collective on the current stream, so there are no streams to share).

    _comm_ctx = None

    @property
    def _fsdp_param_groups(self) -> list[FSDPParamGroup]:
        return [] if self.group is None else [self.group]

    @property
    def _fsdp_param_group(self) -> FSDPParamGroup | None:
        """The same group under torch 2.11's name, which its ``_apply`` and ``share_comm_ctx`` read."""
        return self.group

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        shown, args, kwargs = self.pre_forward(args, kwargs)
        self._shown_by_method.append(shown)
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return self.post_forward(output, self._shown_by_method.pop())

    def reset_iter_state(self) -> None:
        """Forgets an iteration that raised: every group resharded and idle, no callback queued."""
        self._final_callback_queued = False
        for state in self.subtree_states:
            state._shown_by_method.clear()
            if state.group is not None:
                state.group.reset_iter_state()

    def group_for_prefetch(self, knob: str) -> FSDPParamGroup:
        if self.group is None:
            raise ValueError(f"{knob}: {_label(self.module)} has no parameters of its own to prefetch after")
        return self.group

    def resolved_reshard_after_forward(self) -> bool:
        if self.reshard_after_forward is None:
            return not self.is_root  # FSDP2: the root is needed right away in backward
        return self.reshard_after_forward

    # Around the module's forward -----------------------------------------------------

    def compiles_as_region(self, args: tuple, kwargs: dict) -> bool:
        """Whether this trace runs the module's forward in its shared compile region."""
        return (
            settings.compile_regions
            and REGIONS_SUPPORTED
            and torch.compiler.is_compiling()
            and not self.is_root
            and self.is_block
            and (self.group.shown_params[0] is not None or self.group.shown_params[-1] is not None)
            # Over one rank nothing is gathered, and the unsharded parameters are views of
            # one tensor: a region refuses arguments that alias each other.
            and self.group.world_size > 1
            and accepts_region_call(args, kwargs)
            and not runs_outside_regions(self)
            and not enters_gathered_as_views(self.module)
        )

    def _gathers_for_region(self) -> bool:
        """Whether the root's traced unshard leaves this block's copy-out to its block ([Note: a region copies
        out its block's parameters] in ``_region``).

        Not with ``bucket_cap_mb``: ``passes.bucket`` merges groups by their copy-outs in the graph.
        """
        group = self.group
        return (
            settings.compile_regions
            and settings.bucket_cap_mb is None
            and REGIONS_SUPPORTED
            and not self.is_root
            and self.is_block
            and group.copies_out_in_region
            and group.reshard_after_backward
            and group.kept_after_backward is None
            and not runs_outside_regions(self)
        )

    def pre_forward(
        self, args: tuple, kwargs: dict, requires_grad_noted: bool = False
    ) -> tuple[list[FSDPParamGroup], tuple, dict]:
        """Unshards before the module's forward; returns the groups a trace showed and the inputs.

        ``requires_grad_noted``: the root's eager forward compared the parameters'
        ``requires_grad`` before this trace's frame ([Note: settings a trace reads as
        constants] in compile_shard._group); else the trace reads those it gathers.
        """
        if self.is_root:
            if torch.compiler.is_compiling():
                defer_full_collections_while_compiling()  # [Note: full collections during a compile]
                _validate_compilable(self)
            _validate_devices(self)
        args, kwargs = self._cast_forward_inputs(args, kwargs)
        if torch.compiler.is_compiling():
            # [Note: traced unshard]: the outermost sharded module gathers its whole
            # subtree, so that nothing is written inside a checkpoint region below it.
            shown = []
            for state in self.subtree_states:
                group = state.group
                if group is None:
                    continue
                if state._gathers_for_region():
                    gathered = group.gather_traced()
                else:
                    gathered = group.show_traced_unsharded_params()
                if gathered:
                    shown.append(group)
                    if not requires_grad_noted:
                        group.guard_requires_grad()
            return shown, args, kwargs
        if self.is_root:
            with torch.profiler.record_function("FSDP::root_pre_forward"):
                for state in self.subtree_states:
                    if state.group is not None:
                        state.group.start_iteration()
        if self.group is not None:
            self.group.pre_forward()
            args, kwargs = self.group.register_post_backward_on_inputs(args, kwargs)
        return [], args, kwargs

    def post_forward(self, output: Any, shown: list[FSDPParamGroup]) -> Any:
        for group in shown:
            group.hide_traced_unsharded_params()
        if self.group is not None and not torch.compiler.is_compiling():
            output = self.group.post_forward(output)
        if self.is_root and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            self._register_root_pre_backward(output)
        return self._cast_output(output)

    def _cast_forward_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """FSDP2's ``cast_forward_inputs``: floating-point inputs to ``param_dtype``, before the unshard."""
        if not (self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype):
            return args, kwargs
        return _cast_floating_tensors(self.mp_policy.param_dtype, (args, kwargs))

    def _cast_output(self, output: Any) -> Any:
        """FSDP2's ``output_dtype``: floating-point outputs cast last, after the backward hooks."""
        if self.mp_policy.output_dtype is None:
            return output
        return _cast_floating_tensors(self.mp_policy.output_dtype, output)

    def _register_root_pre_backward(self, output: Any) -> None:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if not self._final_callback_queued:
                self._final_callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._root_post_backward_final_callback)
            return grad

        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(hook)

    def _root_post_backward_final_callback(self) -> None:
        self._final_callback_queued = False
        with torch.profiler.record_function("FSDP::root_post_backward_callback"):
            for state in self.subtree_states:
                if state.group is not None:
                    state.group.finalize_backward()


@torch._dynamo.disable(recursive=True)
def _before_step(root: FSDPState) -> None:
    """Before the root's step, eager or compiled: the registrations checked, and the frozen parameters noted.

    A new settings version for each group whose parameters were frozen or unfrozen.
    Disabled: the root's forward runs eagerly, but Dynamo would compile the frames it calls.
    """
    first = not root.lazy_initialized
    root.lazy_initialized = True
    for state in root.subtree_states:
        if state.group is not None:
            _check_registrations(state.group)
            if first:  # FSDP2's lazy init reads the all-gather extensions again: set after fully_shard, they count
                state.group.init_extensions()
            state.group.note_requires_grad()


def _check_registrations(group: FSDPParamGroup) -> None:
    """Each module still holds what the group registered on it; another group's sharded parameter raises.

    A parameter assigned since (``load_state_dict(assign=True)`` does it, or a user's
    ``module.weight = ...``) becomes the sharded parameter, as FSDP2's lazy init makes
    it ([Note: a sharded parameter assigned by load_state_dict] in ``_param``); one
    that another group sharded is a tie made after ``fully_shard`` ([Note: a parameter
    in one group] in ``_param``).
    """
    for fsdp_param in group.fsdp_params:
        for usage in fsdp_param.usages:
            found = usage.module._parameters.get(usage.name)
            if found is fsdp_param.registered:
                continue
            other = None if found is None else sharding_of(found)
            if other is not None and other is not fsdp_param:
                raise _shared_between_groups(f"fully_shard({group.module_name!r})", fsdp_param.fqn, usage.module, other)
            fsdp_param.adopt_loaded_param()


@torch.compiler.assume_constant_result
def _validate_devices(root: FSDPState) -> bool:
    """Raises for a parameter of the root's subtree that its forward cannot gather; returns True.

    In a trace Dynamo runs it once, as a constant, rather than tracing a read of every
    parameter's device: those are guarded anyway, since each ``shard`` is a graph
    input, so a parameter moved after compiling recompiles, and is checked again.
    """
    device_type = root.mesh.device_type
    for state in root.subtree_states:
        if state.group is not None:
            for fsdp_param in state.group.fsdp_params:
                fsdp_param.validate_device(device_type)
    return True


@torch.compiler.assume_constant_result
def _validate_compilable(root: FSDPState) -> bool:
    """Raises, in a trace, for settings a compiled step cannot honour.

    A ``grad_dtype`` wider than its parameter ([Note: grad_dtype] in ``_param``), and
    unsharded storage kept across reshards ([Note: unsharded storage kept across
    reshards] in ``_group``).
    """
    for state in root.subtree_states:
        if state.group is not None and state.group.keep_unsharded_storage:
            raise RuntimeError(
                f"torch.compile: fully_shard({state.group.module_name!r}) keeps its unsharded storage across "
                "reshards (set_keep_unsharded_storage(True)), which only eager mode honours: a compiled graph's "
                "unsharded parameters are buffers Inductor plans (CUDA graphs, mode='reduce-overhead', keep them "
                "at fixed addresses). Turn it off to compile"
            )
        if state.group is not None and (wider := state.group.gradients_wider_than_parameters()):
            raise RuntimeError(
                f"torch.compile: {', '.join(map(repr, wider))} of fully_shard({state.group.module_name!r}) "
                "take gradients wider than the parameters (grad_dtype, or a grad_dtype of None beside a wider "
                "reduce_dtype); a compiled backward gives each parameter's gradient in the parameter's own dtype, "
                "so they would arrive rounded. Train it eagerly, or keep the parameters in the gradients' dtype and "
                "compute in the narrower one with MixedPrecisionPolicy(param_dtype=...)"
            )
    return True


@torch._dynamo.disable(recursive=True)
def _pre_forward_eagerly(state: FSDPState, args: tuple, kwargs: dict) -> tuple[list[FSDPParamGroup], tuple, dict]:
    return state.pre_forward(args, kwargs)


@torch._dynamo.disable(recursive=True)
def _post_forward_eagerly(state: FSDPState, output: Any, shown: list[FSDPParamGroup]) -> Any:
    return state.post_forward(output, shown)


def _cast_floating_tensors(dtype: torch.dtype, tree: Any) -> Any:
    return tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x,
        tree,
    )


def _prefetch_groups(modules: list[FSDPModule], knob: str) -> list[FSDPParamGroup]:
    groups = []
    for module in modules:
        state = _get_state(module) if isinstance(module, nn.Module) else None
        if state is None or state.group is None:
            raise ValueError(
                f"{knob}: {type(module).__name__} is not a module with parameters sharded by fully_shard; "
                "pass modules returned by fully_shard(...)"
            )
        groups.append(state.group)
    return groups


def _get_state(module: nn.Module) -> FSDPState | None:
    return module.__dict__.get(_STATE_ATTR)


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
        return _user_class(cls)(*args, **kwargs)

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
        state = self.__dict__[_STATE_ATTR]  # no call: each would be a frame Dynamo compiles on its own
        compiling = torch.compiler.is_compiling()
        if state.is_root and not compiling:
            _before_step(state)
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
        shown, args, kwargs = _pre_forward_eagerly(state, args, kwargs)
        return _post_forward_eagerly(state, self._user_forward(*args, **kwargs), shown)

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
        return cast(FSDPState, _get_state(cast(nn.Module, self)))

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
                f"reset_iter_state: {_label(cast(nn.Module, self))} is not the root fully_shard module; "
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
                state.group.change_settings(
                    reshard_after_forward=state.resolved_reshard_after_forward(), reshard_group=None
                )

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Sets whether backward frees the unsharded parameters (FSDP2's semantics), eager and compiled.

        False keeps them after backward, and the next forward computes with them
        instead of all-gathering: fewer all-gathers between gradient-accumulation
        micro-batches, for the unsharded parameters' memory. As in FSDP2 they are not
        refreshed, so set it back to True for the last micro-batch (or call
        ``reshard()``) before the optimizer step. Compiled, a group holding kept
        parameters runs a graph of its own ([Note: unsharded parameters kept after
        backward] in compile_shard._group).
        """
        for group in self._groups(recurse):
            if not reshard_after_backward and group.reshard_group is not None:
                raise NotImplementedError(
                    f"fully_shard({group.module_name!r}): set_reshard_after_backward(False) with "
                    f"reshard_after_forward={group.reshard_group.size} is not supported; reshard after forward "
                    "over the whole group (True) to keep the unsharded parameters between micro-batches"
                )
            group.change_settings(reshard_after_backward=bool(reshard_after_backward))

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
        backward ([Note: manual backward finalization] in compile_shard._group). Call it on
        the root, outside backward.
        """
        state = self._get_fsdp_state()
        if not state.is_root:
            raise RuntimeError(
                f"set_manual_backward_finalization must be called on the root fully_shard module, not on "
                f"{_label(cast(nn.Module, self))}"
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
                    f"{_label(cast(nn.Module, self))}"
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

        FSDP2's semantics (``compile_shard._group.GradientReduction``). Set it before
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
        group.change_settings(forward_prefetch=_prefetch_groups(modules, "set_modules_to_forward_prefetch"))

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Re-gathers ``modules``' parameters when this module's backward starts (FSDP2's knob)."""
        group = self._get_fsdp_state().group_for_prefetch("set_modules_to_backward_prefetch")
        group.change_settings(backward_prefetch=_prefetch_groups(modules, "set_modules_to_backward_prefetch"))

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
            custom = group.all_gather_comm_name or group.reduce_scatter_comm_name
            if custom is not None:
                raise AssertionError(
                    f"fully_shard({group.module_name!r}): cannot call set_allocate_memory_from_process_group_for_comm "
                    "after set_custom_all_gather or set_custom_reduce_scatter: the custom collective allocates its "
                    "own buffers (FSDP2's rule)"
                )
            if enable and ops.allocates_comm_tensors(
                group.mesh.get_group(group.mesh.ndim - 1), torch.device(group.mesh.device_type)
            ):
                raise NotImplementedError(
                    f"fully_shard({group.module_name!r}): set_allocate_memory_from_process_group_for_comm(True) on "
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
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
    return _FSDP_CLASSES[cls]


def _user_class(cls: type) -> type:
    """The class the user built, behind the classes fully_shard swapped in."""
    if issubclass(cls, FSDPModule):
        cls = cls.__bases__[1]
    return getattr(cls, "_compile_shard_base", None) or cls


def _label(module: nn.Module) -> str:
    """The user's class name, also for a module whose class fully_shard swapped."""
    return _user_class(type(module)).__name__


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard: torch.distributed is not initialized; call dist.init_process_group(...) "
            "or pass mesh=init_device_mesh(...)"
        )
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _managed_params(module: nn.Module, label: str, ignored: set[int]) -> dict[nn.Parameter, list[ParamUsage]]:
    """Parameters registered in ``module``'s subtree, minus subtrees already sharded and ``ignored``.

    A parameter another ``fully_shard`` call sharded already is FSDP2's ``ValueError``
    ([Note: a parameter in one group] in ``_param``).
    """
    usages: dict[nn.Parameter, list[ParamUsage]] = {}

    def visit(submodule: nn.Module, prefix: str) -> None:
        for name, param in submodule._parameters.items():
            if param is None or id(param) in ignored:
                continue
            other = sharding_of(param)
            if other is not None:
                raise _shared_between_groups(f"fully_shard({label})", prefix + name, submodule, other)
            usages.setdefault(param, []).append(ParamUsage(submodule, name))
        for child_name, child in submodule.named_children():
            if _get_state(child) is None and _composable_with_fsdp(child):
                visit(child, f"{prefix}{child_name}.")

    visit(module, "")
    return usages


def _shared_between_groups(where: str, fqn: str, module: nn.Module, other: FSDPParam) -> ValueError:
    owners = " and ".join(dict.fromkeys(_label(usage.module) for usage in other.usages))
    return ValueError(
        f"{where}: parameter {fqn!r} of {_label(module)} is shared with {owners} ({other.fqn!r}), which another "
        "fully_shard call "
        "sharded: each group gathers and reduces its parameters on its own, so the shared parameter's gradient "
        "would miss one group's contribution. Shard the modules that share it in one group, "
        "fully_shard([module_a, module_b]), or apply fully_shard to a common ancestor of both only"
    )


def _composable_with_fsdp(module: nn.Module) -> bool:
    """FSDP2's rule: a subtree that ``replicate()`` (composable DDP) manages is left to it."""
    return "replicate" not in (_get_registry(module) or {})


def _managed_buffers(modules: list[nn.Module]) -> list[torch.Tensor]:
    """Buffers registered in the modules' subtrees, minus subtrees already sharded (FSDP2's managed buffers)."""
    buffers: dict[int, torch.Tensor] = {}
    stack = list(modules)
    while stack:
        module = stack.pop()
        buffers.update((id(buffer), buffer) for buffer in module._buffers.values() if buffer is not None)
        stack.extend(child for child in module.children() if _get_state(child) is None and _composable_with_fsdp(child))
    return list(buffers.values())


def _mesh_device(label: str, mesh: DeviceMesh) -> torch.device:
    """The device of the mesh's type this process computes on: the current one, as in FSDP2."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    handle = getattr(torch, mesh.device_type, None)
    if handle is None or not handle.is_available():
        raise ValueError(
            f"fully_shard({label}): the mesh covers {mesh.device_type!r} devices, which this process "
            f"does not have; build the mesh on a device it has (for example init_device_mesh('cpu', ...) "
            "with gloo), or keep the module on meta"
        )
    return torch.device(mesh.device_type, handle.current_device())


def _move_to_mesh_device(label: str, mesh: DeviceMesh, tensors: list[torch.Tensor]) -> None:
    """Moves the parameters and buffers this call manages to the mesh's device, in place, as FSDP2 does.

    A model built on the CPU then sharded over a GPU mesh is FSDP2's usual
    initialization: each ``fully_shard`` moves what it manages to the current device
    of the mesh's type, through ``.data`` so that references to the parameters stay
    valid. Meta tensors stay on meta for deferred initialization.
    """
    to_move = [tensor for tensor in tensors if not tensor.is_meta]
    if not to_move:
        return
    device = _mesh_device(label, mesh)
    with torch.no_grad():
        for tensor in to_move:
            if tensor.device != device:
                tensor.data = tensor.to(device)


def _check_mesh(label: str, mesh: DeviceMesh, tensor_parallel_dims: set[str]) -> None:
    """Accepts FSDP2's meshes: 1-D (FSDP) or 2-D (HSDP: replicate, shard); refuses one that leaves ranks unsynchronised.

    A 1-D slice of a larger mesh reduces gradients within itself only: sharding over
    ``mesh["shard"]`` of a (replicate, shard) mesh would never reduce across replicas,
    and with a shard dim of size 1 not at all. Pass the 2-D mesh instead (HSDP). The
    other dims may hold tensor parallelism (``tensor_parallel_dims``: the dims of the
    DTensor parameters' meshes), which keeps those ranks in step by itself.
    """
    if mesh.ndim > 2:
        raise ValueError(
            f"fully_shard({label}): expected a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP), got a "
            f"{mesh.ndim}-D mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}. Pass the data-parallel dimensions, "
            "e.g. mesh['dp_replicate', 'dp_shard']"
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise AssertionError(  # FSDP2's type
            f"fully_shard({label}): the 2-D mesh {tuple(mesh.shape)} for HSDP needs mesh_dim_names, e.g. "
            "init_device_mesh(device, (replicate, shard), mesh_dim_names=('replicate', 'shard'))"
        )
    root = mesh._get_root_mesh()
    if mesh.ndim == 2 or root is mesh or root.size() == mesh.size():
        return
    others = [
        name
        for name in root.mesh_dim_names or ()
        if name not in (mesh.mesh_dim_names or ()) and name not in tensor_parallel_dims
    ]
    if others and (mesh.size() == 1 or any("replicate" in name for name in others)):
        raise ValueError(
            f"fully_shard({label}): the mesh {mesh.mesh_dim_names} of size {mesh.size()} is a slice of the "
            f"{tuple(root.shape)} mesh {root.mesh_dim_names}; gradients would be reduced within it only, never "
            f"across {others}, so replicas would train apart. For HSDP pass the 2-D (replicate, shard) mesh, "
            "e.g. mesh[('replicate', 'shard')]"
        )


def _tensor_parallel_dims(modules: list[nn.Module]) -> set[str]:
    """The mesh dims that the modules' DTensor parameters (tensor parallelism, sharded or not yet) live on."""
    return {
        name
        for module in modules
        for param in module.parameters()
        if isinstance(param, DTensor)
        for name in param.device_mesh.mesh_dim_names or ()
    }


def _check_tensor_parallel_params(label: str, mesh: DeviceMesh, named: dict[str, nn.Parameter]) -> None:
    """A DTensor parameter is FSDP2's tensor parallelism: one Shard or Replicate placement, another dim of the mesh."""
    for fqn, param in named.items():
        if not isinstance(param, DTensor):
            continue
        tp_mesh = param.device_mesh
        if tp_mesh.ndim != 1 or not all(type(p) in (Shard, Replicate) for p in param.placements):
            raise NotImplementedError(
                f"fully_shard({label}): parameter {fqn!r} is a DTensor with placements {param.placements} on the "
                f"{tp_mesh.ndim}-D mesh {tp_mesh.mesh_dim_names}; compile_shard shards tensor-parallel parameters "
                "with one Shard or Replicate placement on a 1-D tensor-parallel mesh (as ColwiseParallel and "
                "RowwiseParallel make them). Parallelize the module with such a plan first"
            )
        tp_dims, dp_dims = tp_mesh.mesh_dim_names, mesh.mesh_dim_names
        if tp_dims is None or dp_dims is None or set(tp_dims) & set(dp_dims) or not _joins(mesh, tp_mesh):
            raise ValueError(
                f"fully_shard({label}): parameter {fqn!r} is a DTensor on the mesh {tp_dims}, which is not another "
                f"dim of the data-parallel mesh {dp_dims}'s named mesh. Slice both from one mesh, e.g. "
                "world_mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), "
                "parallelize_module(..., world_mesh['tp'], plan) and fully_shard(..., mesh=world_mesh['dp'])"
            )


def _joins(mesh: DeviceMesh, tp_mesh: DeviceMesh) -> bool:
    """Whether ``DeviceMesh._concatenate`` joins the meshes: FSDP2's own test of a tensor-parallel mesh.

    It compares the ranks both meshes lie over and that their dims do not overlap, not
    the root mesh objects: two equal meshes made one after the other (a test suite, a
    notebook, a restart inside one process) have two roots.
    """
    try:
        DeviceMesh._concatenate([mesh, tp_mesh])
    except RuntimeError:
        return False
    return True


def _check_policy_types(label: str, mp_policy: Any, offload_policy: Any) -> None:
    """FSDP2's policies, by type and dtype: a wrong value fails here, naming the module, not in the first step."""
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"fully_shard({label}): mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got "
            f"{type(mp_policy).__name__}"
        )
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(mp_policy, field)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(
                f"fully_shard({label}): mp_policy.{field} must be a floating-point torch.dtype or None, got "
                f"{dtype!r}; for example MixedPrecisionPolicy({field}=torch.bfloat16)"
            )
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"fully_shard({label}): offload_policy must be a torch.distributed.fsdp.OffloadPolicy, got "
            f"{type(offload_policy).__name__}"
        )


def _shard_memory(label: str, mesh: DeviceMesh, offload_policy: OffloadPolicy) -> tuple[bool, torch.device | None]:
    """FSDP2's ``OffloadPolicy``: whether the shards are pinned, and the mesh's device where they are offloaded.

    ``CPUOffloadPolicy`` keeps the sharded parameters in CPU memory, pinned with
    ``pin_memory=True`` (an error where no accelerator is available, as in FSDP2). On
    an accelerator's mesh the all-gathers then read copies of them on the mesh's
    device ([Note: CPU offload] in ``_param``); on a CPU mesh they live there anyway,
    and nothing moves, as in FSDP2.
    """
    if type(offload_policy) is OffloadPolicy:
        return False, None
    if type(offload_policy) is not CPUOffloadPolicy:
        raise NotImplementedError(f"fully_shard({label}): {type(offload_policy).__name__} is not supported")
    compute_device = None if mesh.device_type == "cpu" else _mesh_device(label, mesh)
    return offload_policy.pin_memory, compute_device


def _data_parallel_dims(label: str, mesh: DeviceMesh, dp_mesh_dims: Any) -> tuple[int, ...]:
    """FSDP2's ``dp_mesh_dims`` (``DataParallelMeshDims``) as ``mesh`` dims: (replicate,) shard, the shard dim last."""
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None:
        raise ValueError(f"fully_shard({label}): mesh must have mesh_dim_names when dp_mesh_dims is provided")
    shard, replicate = dp_mesh_dims.shard, dp_mesh_dims.replicate
    for role, value in (("shard", shard), ("replicate", replicate)):
        if value is not None and not isinstance(value, str):
            raise NotImplementedError(
                f"fully_shard({label}): dp_mesh_dims.{role}={value!r} names several mesh dims to flatten; "
                "compile_shard takes one name each. Flatten them into one named dim of the mesh first"
            )
        if value is not None and value not in names:
            raise ValueError(f"fully_shard({label}): mesh dim name {value!r} not found in mesh.mesh_dim_names {names}")
    if shard is None:
        raise NotImplementedError(
            f"fully_shard({label}): dp_mesh_dims without a shard dim (plain replication) is not supported; name a "
            "shard dim, of size 1 for NO_SHARD"
        )
    return tuple(names.index(name) for name in (replicate, shard) if name is not None)


def _check_spmd_params(label: str, mesh: DeviceMesh, named: dict[str, nn.Parameter], dims: tuple[int, ...]) -> None:
    """With ``dp_mesh_dims`` every parameter is a DTensor on ``mesh`` itself, replicated on the data-parallel dims."""
    for fqn, param in named.items():
        if not isinstance(param, DTensor) or param.device_mesh is not mesh:
            raise ValueError(
                f"fully_shard({label}): with dp_mesh_dims every parameter must be a DTensor on the mesh passed to "
                f"fully_shard (e.g. via distribute_tensor or distribute_module), but {fqn!r} is "
                f"{'on another mesh' if isinstance(param, DTensor) else 'a plain tensor'}"
            )
        for dim in dims:
            if not isinstance(param.placements[dim], Replicate):
                raise ValueError(
                    f"fully_shard({label}): parameter {fqn!r} has {param.placements[dim]!r} on the data-parallel dim "
                    f"{mesh.mesh_dim_names[dim]!r}; with dp_mesh_dims it must be Replicate() there"
                )


def _resolve_reshard_after_forward(label: str, reshard_after_forward: Any, world_size: int) -> bool | int | None:
    """FSDP2's ``reshard_after_forward``: a bool, None, or an int that is the size of a group to reshard to.

    FSDP2 reads the int 1 as False (with a warning) and the shard group's size as True;
    another factor of that size is the size of the smaller group to reshard to
    ([Note: resharding to a smaller group] in ``_group``); anything else is FSDP2's
    ``ValueError``.
    """
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return reshard_after_forward
    if not isinstance(reshard_after_forward, int):
        raise ValueError(
            f"fully_shard({label}): reshard_after_forward should be a bool or an int representing the group "
            f"size to reshard to, not {reshard_after_forward!r}"
        )
    if reshard_after_forward < 1 or world_size % reshard_after_forward != 0:
        raise ValueError(
            f"fully_shard({label}): if passing reshard_after_forward as an int, it should be a factor of "
            f"{world_size}, not {reshard_after_forward}"
        )
    if reshard_after_forward == 1:
        warnings.warn(
            f"fully_shard({label}): reshard_after_forward=1 (int) means resharding parameters to world size 1, "
            "instead of reshard_after_forward=True (bool)",
            stacklevel=3,
        )
        return False
    if reshard_after_forward == world_size:
        return True
    return reshard_after_forward


def _reshard_group(mesh: DeviceMesh, size: int) -> ReshardGroup:
    """FSDP2's post-forward mesh: the data-parallel ranks in rows of ``size``; a rank reshards over its row."""
    rows = DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, size), mesh_dim_names=("reshard_rows", "reshard"))
    return ReshardGroup(size, rows.get_local_rank(1), rows.get_group(1).group_name)


def _shard_dim(label: str, fqn: str, param: nn.Parameter, shard_placement_fn, mesh: DeviceMesh) -> int:
    """The dim ``shard_placement_fn`` shards ``param`` on (0 without one), checked as FSDP2 checks it."""
    placement = None if shard_placement_fn is None else shard_placement_fn(param)
    if placement is None:
        return 0
    if type(placement) is not Shard:
        raise NotImplementedError(
            f"fully_shard({label}): shard_placement_fn gave {placement!r} for {fqn!r}; compile_shard shards on one "
            "dim: return Shard(dim) or None"
        )
    if not -param.dim() <= placement.dim < param.dim():
        raise ValueError(
            f"fully_shard({label}): shard_placement_fn gave {placement!r} for {fqn!r}, a {param.dim()}-D parameter "
            f"of shape {tuple(param.shape)}"
        )
    dim = placement.dim % param.dim()
    if dim == 0:
        return 0
    if isinstance(param, DTensor):
        raise NotImplementedError(
            f"fully_shard({label}): shard_placement_fn gave {placement!r} for the DTensor parameter {fqn!r}; "
            "tensor-parallel parameters are sharded on dim 0 here (return Shard(0) or None for them)"
        )
    world_size = mesh.size(-1)
    if param.size(dim) % world_size:
        raise NotImplementedError(
            f"fully_shard({label}): {fqn!r} has {param.size(dim)} entries on dim {dim}, not divisible by the "
            f"{world_size} ranks; as in FSDP2, sharding on a dim other than 0 must be even (shard it on dim 0)"
        )
    return dim


def _check_contiguous(label: str, named: dict[str, nn.Parameter]) -> None:
    """FSDP2 shards contiguous parameters only (``NotImplementedError``): a channels_last weight is refused."""
    for fqn, param in named.items():
        if not param.is_contiguous():
            raise NotImplementedError(
                f"fully_shard({label}): parameter {fqn!r} is not contiguous (shape {tuple(param.shape)}, stride "
                f"{param.stride()}), which FSDP2 does not shard either. Make it contiguous before fully_shard, "
                "e.g. module.to(memory_format=torch.contiguous_format), and convert activations instead"
            )


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
    modules = _as_module_list(module)
    label = "+".join(_label(m) for m in modules)
    _check_policy_types(label, mp_policy, offload_policy)
    mesh = mesh if mesh is not None else _default_mesh()
    spmd_mesh, spmd_data_parallel_dims = None, ()
    if dp_mesh_dims is None:
        _check_mesh(label, mesh, _tensor_parallel_dims(modules))
    else:
        spmd_mesh, spmd_data_parallel_dims = mesh, _data_parallel_dims(label, mesh, dp_mesh_dims)
        if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
            raise NotImplementedError(
                f"fully_shard({label}): reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims)"
            )
        dims = [spmd_mesh[spmd_mesh.mesh_dim_names[dim]] for dim in spmd_data_parallel_dims]
        mesh = dims[0] if len(dims) == 1 else DeviceMesh._concatenate(dims)  # the data-parallel mesh
    pin_memory, compute_device = _shard_memory(label, mesh, offload_policy)
    reshard_after_forward = _resolve_reshard_after_forward(label, reshard_after_forward, mesh.size(-1))
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
        for param, param_usages in _managed_params(top, label, ignored).items():
            if param not in usages:
                named[fqn_of[id(param)]] = param
            usages.setdefault(param, []).extend(param_usages)
    if spmd_mesh is None:
        _check_tensor_parallel_params(label, mesh, named)
        if reshard_size is not None and any(isinstance(param, DTensor) for param in named.values()):
            raise NotImplementedError(
                f"fully_shard({label}): resharding to a smaller group (reshard_after_forward={reshard_size}) is "
                "not supported for DTensor (tensor-parallel) parameters, as in torch FSDP2; pass True or False"
            )
    else:
        _check_spmd_params(label, spmd_mesh, named, spmd_data_parallel_dims)
    _move_to_mesh_device(label, mesh, [*named.values(), *_managed_buffers(modules)])
    _check_contiguous(label, named)
    shard_dims = [_shard_dim(label, fqn, param, shard_placement_fn, mesh) for fqn, param in named.items()]
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
            reshard_group=None if reshard_size is None else _reshard_group(mesh, reshard_size),
        )
    install()  # the pass suite, for torch.compile of this model
    warn_if_regions_cannot_run(settings.compile_regions)
    state = FSDPState(modules, mesh, group, reshard_after_forward, mp_policy)
    sharded_below = any(_get_state(sub) is not None for top in modules for sub in top.modules())
    for top in modules:
        top.__dict__[_STATE_ATTR] = state
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
    return _get_state(module)


fully_shard.state = _state  # type: ignore[attr-defined]


def _as_module_list(module: nn.Module | list[nn.Module]) -> list[nn.Module]:
    """``fully_shard``'s module argument as a list: one module, or FSDP2's list of modules forming one group.

    FSDP2's refusals, with its exception types: a container without a forward of its
    own (``ValueError``: it has no forward to unshard around), a module sharded twice
    (``AssertionError``, from torch's composable-API contract).
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(f"fully_shard: expected an nn.Module or a non-empty list of them, got {module!r}")
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and _user_class(type(module)).forward is nn.Module.forward:
        raise ValueError(
            f"fully_shard: {type(module).__name__} has no forward of its own, so there is no forward to unshard its "
            "parameters around (FSDP2 refuses it too). Apply fully_shard to each module it holds, or pass them as "
            "one group: fully_shard(list(container))"
        )
    for m in modules:
        if _get_state(m) is not None:
            raise AssertionError(
                f"fully_shard was already applied to this {_label(m)}; apply it once per module "
                "(bottom-up: blocks first, then the root)"
            )
    if len({id(m) for m in modules}) != len(modules):
        raise AssertionError("fully_shard: the list holds the same module twice; list each module once")
    return modules
