"""``fully_shard`` and ``FSDPModule``: FSDP2's public API over the ``fsdp`` ops."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils._pytree import tree_flatten

from ._group import FSDPParamGroup
from ._param import FSDPParam, ParamUsage
from ._region import (
    REGIONS_SUPPORTED,
    accepts_region_call,
    call_in_region,
    runs_hooks_inside,
    runs_inlined_after_restart,
    updates_running_stats,
)
from .passes import install
from .passes.settings import settings

__all__ = ["FSDPModule", "fully_shard"]

_STATE_ATTR = "_compile_shard_state"


class FSDPState:
    """Per-module state of ``fully_shard``: the group, root duties, forward wrapping."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh, group: FSDPParamGroup | None, reshard_after_forward):
        self.module = module
        self.mesh = mesh
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.is_root = True
        self.subtree_states: list[FSDPState] = []
        self._final_callback_queued = False
        # For [Note: sharded blocks as nested compile regions]: the modules of a
        # module whose subtree holds no other fully_shard module, else empty.
        self.region_modules: list[nn.Module] = []

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
        fqns = {id(param): fqn for fqn, param in self.module.named_parameters()}
        self.subtree_states = []
        for name, submodule in self.module.named_modules():
            state = _get_state(submodule)
            if state is None:
                continue
            state.is_root = state is self
            self.subtree_states.append(state)
            if state.group is None:
                continue
            state.group.module_name = name or _label(self.module)
            state.group.reshard_after_forward = state.resolved_reshard_after_forward()
            for fsdp_param in state.group.fsdp_params:
                fsdp_param.fqn = fqns.get(id(fsdp_param.sharded_param), fsdp_param.fqn)
        model_groups = tuple(state.group.module_name for state in self.subtree_states if state.group is not None)
        for state in self.subtree_states:
            if state.group is not None:
                state.group.model_groups = model_groups

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
            and bool(self.region_modules)
            and self.group.fsdp_params[0].unsharded_param is not None
            and accepts_region_call(args, kwargs)
            and not runs_hooks_inside(self.module)
            and not updates_running_stats(self.module)
            and not runs_inlined_after_restart(self.module)
        )

    def pre_forward(self) -> list[FSDPParamGroup]:
        """Unshards before the module's forward; returns the groups a trace showed."""
        if self.is_root:
            device_type = self.mesh.device_type  # read once: in a trace, each read is traced anew
            for state in self.subtree_states:
                if state.group is not None:
                    for fsdp_param in state.group.fsdp_params:
                        fsdp_param.validate_device(device_type)
        if torch.compiler.is_compiling():
            # [Note: traced unshard]: the outermost sharded module gathers its whole
            # subtree, so that nothing is written inside a checkpoint region below it.
            groups = [state.group for state in self.subtree_states if state.group is not None]
            return [group for group in groups if group.show_traced_unsharded_params()]
        if self.group is not None:
            self.group.pre_forward()
        return []

    def post_forward(self, output: Any, shown: list[FSDPParamGroup]) -> Any:
        for group in shown:
            group.hide_traced_unsharded_params()
        if self.group is not None and not torch.compiler.is_compiling():
            output = self.group.post_forward(output)
        if self.is_root and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            self._register_root_pre_backward(output)
        return output

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
        for state in self.subtree_states:
            if state.group is not None:
                state.group.finalize_backward()


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


class FSDPModule:
    """Mixed into the class of every module passed to :func:`fully_shard`.

    [Note: forward wrapper instead of hooks]
    FSDP2 unshards in a forward pre-hook. compile_shard wraps ``forward`` instead:
    ``torch.compile(model)`` runs the root module's hooks outside the compiled
    frame (each becomes a graph of its own), while the root's ``forward`` is the
    compiled frame itself. Wrapping ``forward`` puts the root's all-gather in the one
    forward graph, and behaves the same in eager mode.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = self._fsdp_state()
        shown = state.pre_forward()
        if state.compiles_as_region(args, kwargs):
            output = call_in_region(cast(nn.Module, self), args, kwargs)
        else:
            output = self._user_forward(*args, **kwargs)
        return state.post_forward(output, shown)

    def _user_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The forward of the user's class, which the region calls."""
        return super().forward(*args, **kwargs)  # type: ignore[misc]

    def _fsdp_state(self) -> FSDPState:
        return cast(FSDPState, _get_state(cast(nn.Module, self)))

    def unshard(self) -> None:
        """All-gathers this module's parameters now and registers the unsharded tensors.

        A later forward uses them without another all-gather. Call it with the grad
        mode the forward will use: the all-gather is part of the autograd graph.
        """
        group = self._fsdp_state().group
        if group is not None:
            group.unshard()

    def reshard(self) -> None:
        """Frees this module's unsharded parameters and registers the sharded ones."""
        group = self._fsdp_state().group
        if group is not None:
            group.reshard()

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gathers ``modules``' parameters when this module's forward starts (FSDP2's knob).

        Eager: their all-gathers are issued right after this module's own. Compiled:
        the ``reorder`` pass issues them no later than this module's wait. Set it
        before compiling: the lists are read when the model is traced.
        """
        self._fsdp_state().group_for_prefetch("set_modules_to_forward_prefetch").forward_prefetch = (
            _prefetch_groups(modules, "set_modules_to_forward_prefetch")
        )

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Re-gathers ``modules``' parameters when this module's backward starts (FSDP2's knob)."""
        self._fsdp_state().group_for_prefetch("set_modules_to_backward_prefetch").backward_prefetch = (
            _prefetch_groups(modules, "set_modules_to_backward_prefetch")
        )

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """``module.to(...)``, ``to_empty(...)``: re-pads shards whose storage was replaced."""
        self.reshard()
        result = super()._apply(*args, **kwargs)  # type: ignore[misc]
        group = self._fsdp_state().group
        if group is not None:
            for fsdp_param in group.fsdp_params:
                fsdp_param.reset_sharded_param()
        return result

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Sets whether the unsharded parameters are freed after forward (and re-gathered in backward)."""
        modules = cast(nn.Module, self).modules() if recurse else [self]
        for module in modules:
            state = _get_state(module)
            if state is not None:
                state.reshard_after_forward = reshard_after_forward
                if state.group is not None:
                    state.group.reshard_after_forward = state.resolved_reshard_after_forward()


_FSDP_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
    return _FSDP_CLASSES[cls]


def _label(module: nn.Module) -> str:
    """The user's class name, also for a module whose class fully_shard swapped."""
    cls = type(module)
    return (cls.__bases__[1] if issubclass(cls, FSDPModule) else cls).__name__


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard: torch.distributed is not initialized; call dist.init_process_group(...) "
            "or pass mesh=init_device_mesh(...)"
        )
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _managed_params(module: nn.Module) -> dict[nn.Parameter, list[ParamUsage]]:
    """Parameters registered in ``module``'s subtree, minus subtrees already sharded."""
    sharded_below = {
        id(tensor)
        for submodule in module.modules()
        if (state := _get_state(submodule)) is not None and state.group is not None
        for fsdp_param in state.group.fsdp_params
        for tensor in (fsdp_param.sharded_param, fsdp_param.original_param())
    }
    usages: dict[nn.Parameter, list[ParamUsage]] = {}

    def visit(submodule: nn.Module, prefix: str) -> None:
        for name, param in submodule._parameters.items():
            if param is None:
                continue
            if id(param) in sharded_below:
                raise ValueError(
                    f"fully_shard({_label(module)}): parameter {prefix + name!r} is already sharded by "
                    "another fully_shard call (a parameter shared across groups). Apply fully_shard to a "
                    "common ancestor of every module that uses it instead"
                )
            usages.setdefault(param, []).append(ParamUsage(submodule, name))
        for child_name, child in submodule.named_children():
            if _get_state(child) is None:
                visit(child, f"{prefix}{child_name}.")

    visit(module, "")
    return usages


def _check_one_dtype(module: nn.Module, named: dict[str, nn.Parameter]) -> None:
    by_dtype: dict[torch.dtype, list[str]] = {}
    for fqn, param in named.items():
        by_dtype.setdefault(param.dtype, []).append(fqn)
    if len(by_dtype) > 1:
        listing = "; ".join(f"{dtype}: {', '.join(fqns)}" for dtype, fqns in by_dtype.items())
        raise ValueError(
            f"fully_shard({_label(module)}): one group is all-gathered as one buffer and needs one "
            f"dtype, but got {listing}. Cast the module to one dtype, or apply fully_shard to the "
            "submodules with the other dtype first"
        )


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | None = None,
) -> FSDPModule:
    """Shards ``module``'s parameters on dim 0 across ``mesh`` (FSDP2 semantics).

    Apply it bottom-up: to each block first, then to the root. Each call forms one
    group: one all-gather before the module's forward, one reduce-scatter of its
    gradients in backward. ``reshard_after_forward`` frees the unsharded parameters
    after forward and gathers them again before backward; ``None`` (the default)
    means True except for the root module, as in FSDP2.
    """
    if _get_state(module) is not None:
        raise ValueError(
            f"fully_shard was already applied to this {_label(module)}; apply it once per module "
            "(bottom-up: blocks first, then the root)"
        )
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise ValueError(
            f"fully_shard({_label(module)}): reshard_after_forward must be True, False or None, got "
            f"{reshard_after_forward!r} (resharding to a smaller world is not supported yet)"
        )
    mesh = mesh if mesh is not None else _default_mesh()
    if mesh.ndim != 1:
        raise ValueError(
            f"fully_shard({_label(module)}): expected a 1-D DeviceMesh, got a {mesh.ndim}-D mesh "
            f"{tuple(mesh.shape)}. HSDP on a 2-D mesh is not supported yet; pass mesh[dim_name] for the "
            "data-parallel dimension"
        )
    usages = _managed_params(module)
    fqn_of = {id(param): fqn for fqn, param in module.named_parameters()}
    named = {fqn_of[id(param)]: param for param in usages}
    for fqn, param in named.items():
        if not param.is_meta and param.device.type != mesh.device_type:
            raise ValueError(
                f"fully_shard({_label(module)}): parameter {fqn!r} is on {param.device} but the mesh "
                f"covers {mesh.device_type!r} devices; move the module to {mesh.device_type!r} (or keep it "
                "on meta and materialize it later) before fully_shard"
            )
    _check_one_dtype(module, named)
    group = None
    if usages:
        fsdp_params = [
            FSDPParam(param, fqn, usage, mesh) for (fqn, param), usage in zip(named.items(), usages.values())
        ]
        group = FSDPParamGroup(
            fsdp_params,
            _label(module),
            mesh,
            reshard_after_forward=reshard_after_forward is not False,
        )
    install()  # the pass suite, for torch.compile of this model
    state = FSDPState(module, mesh, group, reshard_after_forward)
    sharded_below = any(_get_state(submodule) is not None for submodule in module.modules())
    module.__dict__[_STATE_ATTR] = state
    module.__class__ = _fsdp_class(type(module))
    if group is not None and not sharded_below:
        state.region_modules = list(module.modules())
    state.claim_root()
    return cast(FSDPModule, module)
