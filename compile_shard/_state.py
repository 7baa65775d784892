"""The state of one ``fully_shard`` call: its group, the root's duties, and the forward's unshard and reshard.

What ``FSDPModule``'s forward wrapper calls, eagerly and in a trace, and the checks the
root makes before each step (FSDP2 keeps the same in ``_fsdp_state.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._pytree import tree_map

from ._classes import user_class_name
from ._group import FSDPParamGroup, tensors_in
from ._param import shared_between_groups, sharding_of
from ._regions import count_writes, enters_gathered_as_views, runs_outside_regions
from ._gc_during_compile import defer_full_collections_while_compiling
from .passes.settings import settings



STATE_ATTR = "_compile_shard_state"


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
        # FSDP2's ``cast_forward_inputs``: floating-point inputs cast to ``param_dtype`` (where set) before the
        # unshard. Read inline, not through a method: a trace pays an inlined frame per call, at every block.
        self.forward_input_dtype = mp_policy.param_dtype if mp_policy.cast_forward_inputs else None
        self.is_root = True
        self.lazy_initialized = False  # whether the root's first forward ran FSDP2's lazy-init steps
        # FSDP2's set_manual_backward_finalization ([Note: manual backward finalization] in _group_config).
        self.manual_backward_finalization = False
        self.subtree_states: list[FSDPState] = []
        self._final_callback_queued = False
        self._shown_by_method: list[list[FSDPParamGroup]] = []
        # For [Note: sharded blocks as nested compile regions]: the modules of a
        # module whose subtree holds no other fully_shard module, else empty.
        self.region_modules: list[nn.Module] = []
        self.is_block = False  # whether ``region_modules`` lists any: a plain read, where the list is one per module
        # The writes to the block's modules that Dynamo does not guard ([Note: a block's attribute writes are
        # counted] in ``_regions._attribute_writes``).
        self.region_writes = 0

    def region_changed(self) -> None:
        """Lists the modules of a block traced as a compile region, and counts their writes.

        Again after a submodule was added, replaced or deleted ([Note: a block's attribute
        writes are counted] in ``_regions._attribute_writes``).
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
                state = get_state(submodule)
                if state is not None:
                    names.setdefault(state, []).append(name or user_class_name(submodule))
        self.subtree_states = list(names)
        for state, state_names in names.items():
            state.is_root = state is self
            if state.group is None:
                continue
            state.group.name("+".join(state_names), state.resolved_reshard_after_forward())
            for fsdp_param in state.group.fsdp_params:
                fsdp_param.fqn = fqns.get(id(fsdp_param.sharded_param), fsdp_param.fqn)
        model_groups = tuple(state.group.settings.module_name for state in self.subtree_states if state.group is not None)
        for state in self.subtree_states:
            if state.group is not None:
                state.group.set_model_groups(model_groups)

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
            raise ValueError(f"{knob}: {user_class_name(self.module)} has no parameters of its own to prefetch after")
        return self.group

    def resolved_reshard_after_forward(self) -> bool:
        if self.reshard_after_forward is None:
            return not self.is_root  # FSDP2: the root is needed right away in backward
        return self.reshard_after_forward

    # Around the module's forward -----------------------------------------------------

    def compiles_as_region(self) -> bool:
        """Whether this trace runs the module's forward in its shared compile region, where it takes the arguments
        (``call_in_region``)."""
        return (
            settings.compile_regions
            and torch.compiler.is_compiling()
            and not self.is_root
            and self.is_block
            and (self.group.shown_params[0] is not None or self.group.traced_all_gather_outputs is not None)
            # Over one rank nothing is gathered, and the unsharded parameters are views of
            # one tensor: a region refuses arguments that alias each other.
            and self.group.world_size > 1
            and not runs_outside_regions(self)
            and not enters_gathered_as_views(self.module)
        )

    def _gathers_for_region(self) -> bool:
        """Whether the root's traced unshard leaves this block's copy-out to its block ([Note: a region copies
        out its block's parameters] in ``_regions._call``); ``passes.bucket`` may still merge its collectives
        with its neighbours' ([Note: a bucket of regions' groups]).
        """
        group = self.group
        return (
            settings.compile_regions
            and not self.is_root
            and self.is_block
            and group.copies_out_in_region
            and group.settings.reshard_after_backward
            and group.kept_after_backward is None
            and not runs_outside_regions(self)
        )

    def pre_forward(
        self, args: tuple, kwargs: dict, requires_grad_noted: bool = False
    ) -> tuple[list[FSDPParamGroup], tuple, dict]:
        """Unshards before the module's forward; returns the groups a trace showed and the inputs.

        ``requires_grad_noted``: the root's eager forward compared the parameters'
        ``requires_grad`` before this trace's frame ([Note: settings a trace reads as
        constants] in compile_shard._group_gather); else the trace reads those it gathers.
        """
        if self.is_root:
            if torch.compiler.is_compiling():
                defer_full_collections_while_compiling()  # [Note: full collections during a compile]
                _validate_compilable(self)
            _validate_devices(self)
        if self.forward_input_dtype is not None:  # FSDP2's cast_forward_inputs, before the unshard
            args, kwargs = _cast_floating_tensors(self.forward_input_dtype, (args, kwargs))
        if torch.compiler.is_compiling():
            # [Note: traced unshard]: the outermost sharded module gathers its whole
            # subtree, so that nothing is written inside a checkpoint region below it.
            # A block finds its group gathered by the root: the check comes before any other read.
            shown = []
            for state in self.subtree_states:
                group = state.group
                if group is None or group.shown_params[0] is not None or group.traced_all_gather_outputs is not None:
                    continue
                if state._gathers_for_region():
                    group.gather_traced()
                else:
                    group.show_traced_unsharded_params()
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
        if self.mp_policy.output_dtype is None:
            return output
        return _cast_floating_tensors(self.mp_policy.output_dtype, output)  # FSDP2's output_dtype: cast last

    def _register_root_pre_backward(self, output: Any) -> None:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if not self._final_callback_queued:
                self._final_callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._root_post_backward_final_callback)
            return grad

        for tensor in tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(hook)

    def _root_post_backward_final_callback(self) -> None:
        self._final_callback_queued = False
        with torch.profiler.record_function("FSDP::root_post_backward_callback"):
            for state in self.subtree_states:
                if state.group is not None:
                    state.group.finalize_backward()


@torch._dynamo.disable(recursive=True)
def before_step(root: FSDPState) -> None:
    """Before the root's step, eager or compiled: the registrations checked, and the frozen parameters noted.

    A new settings version for each group whose parameters were frozen or unfrozen.
    Disabled: the root's forward runs eagerly, but Dynamo would compile the frames it calls.
    """
    first = not root.lazy_initialized
    root.lazy_initialized = True
    for state in root.subtree_states:
        if state.group is not None:
            check_registrations(state.group)
            if first:  # FSDP2's lazy init reads the all-gather extensions again: set after fully_shard, they count
                state.group.init_extensions()
            state.group.note_requires_grad()


def check_registrations(group: FSDPParamGroup) -> None:
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
                raise shared_between_groups(f"fully_shard({group.settings.module_name!r})", fsdp_param.fqn, usage.module, other)
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

    A ``grad_dtype`` wider than its parameter ([Note: grad_dtype] in ``_gradient_rules``), and
    unsharded storage kept across reshards ([Note: unsharded storage kept across
    reshards] in ``_group``).
    """
    for state in root.subtree_states:
        if state.group is not None and state.group.keep_unsharded_storage:
            raise RuntimeError(
                f"torch.compile: fully_shard({state.group.settings.module_name!r}) keeps its unsharded storage across "
                "reshards (set_keep_unsharded_storage(True)), which only eager mode honours: a compiled graph's "
                "unsharded parameters are buffers Inductor plans (CUDA graphs, mode='reduce-overhead', keep them "
                "at fixed addresses). Turn it off to compile"
            )
        if state.group is not None and (wider := state.group.gradients_wider_than_parameters()):
            raise RuntimeError(
                f"torch.compile: {', '.join(map(repr, wider))} of fully_shard({state.group.settings.module_name!r}) "
                "take gradients wider than the parameters (grad_dtype, or a grad_dtype of None beside a wider "
                "reduce_dtype); a compiled backward gives each parameter's gradient in the parameter's own dtype, "
                "so they would arrive rounded. Train it eagerly, or keep the parameters in the gradients' dtype and "
                "compute in the narrower one with MixedPrecisionPolicy(param_dtype=...)"
            )
    return True


@torch._dynamo.disable(recursive=True)
def pre_forward_eagerly(state: FSDPState, args: tuple, kwargs: dict) -> tuple[list[FSDPParamGroup], tuple, dict]:
    return state.pre_forward(args, kwargs)


@torch._dynamo.disable(recursive=True)
def post_forward_eagerly(state: FSDPState, output: Any, shown: list[FSDPParamGroup]) -> Any:
    return state.post_forward(output, shown)


def _cast_floating_tensors(dtype: torch.dtype, tree: Any) -> Any:
    return tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x,
        tree,
    )


def get_state(module: nn.Module) -> FSDPState | None:
    return module.__dict__.get(STATE_ATTR)
