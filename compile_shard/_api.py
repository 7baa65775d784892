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

from ._classes import subclass, user_class, user_class_name
from ._group import FSDPParamGroup, in_backward
from ._param import FSDPParam, ParamUsage
from ._regions import CountsWrites, call_copied_out, call_in_region, compiling_gathered
from ._module_settings import FSDPModuleSettings
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
#: compares the objects its modules hold (``_regions.block_signature``).
_REGISTRY_ITEM = RegistryItem()
#: Where ``fully_shard`` keeps an ``OptimizedModule``'s ``forward`` ([Note: a block compiled on its own]).
_COMPILED_FORWARD_ATTR = "_compile_shard_compiled_forward"


class FSDPModule(CountsWrites, FSDPModuleSettings, TorchFSDPModule):
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
        # Plain reads, no ``_get_fsdp_state()`` or ``cast``: each call costs Dynamo an inlined frame at every block.
        state = self.__dict__[STATE_ATTR]
        shown, args, kwargs = state.pre_forward(args, kwargs, requires_grad_noted)
        if state.compiles_as_region():
            output = call_in_region(self, args, kwargs)  # type: ignore[arg-type]
        elif compiling_gathered(state.group):
            output = call_copied_out(self, args, kwargs)  # type: ignore[arg-type]
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

    # Finalizing backward by hand (torch 2.15) -------------------------------------------

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


