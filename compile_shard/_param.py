"""One parameter under fully_shard: its dim-0 shard, the padded storage behind it,
and the modules that use it.

[Note: the tensors of a sharded parameter]
The one vocabulary of the runtime, the ops and the passes. For a parameter of
``rows`` rows on a process group of ``world_size`` ranks, each rank holds
``padded_rows = ceil(rows / world_size)`` rows (``_layout.padded_rows``):

- original parameter: the ``nn.Parameter`` the user built; gone after ``fully_shard``.
- sharded parameter (``FSDPParam.sharded_param``): the ``nn.Parameter(DTensor)``,
  ``Shard(0)``, registered on the module: what the optimizer and state dicts see.
  Its local tensor (``to_local()``) is this rank's real rows.
- padded shard (``FSDPParam.padded_shard``): the storage behind the local tensor,
  ``padded_rows`` rows; the rows past the real ones are zero padding
  ([Note: sharded storage]).
- shard (``FSDPParam.shard``): a plain leaf tensor over the local tensor's storage;
  what the all-gather reads and what autograd gives the gradient to
  ([Note: the shard autograd sees]).
- offloaded shard: with ``CPUOffloadPolicy`` on an accelerator's mesh, the padded
  shard, the sharded parameter and its gradient live in CPU memory; the all-gather
  reads a copy of the shard on the mesh's device ([Note: CPU offload] in
  ``_shard_memory``).
- all-gather input: one group's shards cast to the wire dtype, flattened, padded to
  ``padded_rows`` and concatenated (the copy-in), inside ``fsdp::all_gather_into`` or,
  after ``lower``, one ``fsdp::copy_in`` in the graph.
- wire dtype: what a parameter is all-gathered and computed in, the mixed-precision
  policy's ``param_dtype`` for a floating-point parameter, else its own dtype. A
  group gathers each wire dtype in one all-gather, an all-gather part
  (``_group_settings.AllGatherPart``, [Note: one all-gather per wire dtype]); most groups have one.
- all-gather output: the flat buffer every rank's all-gather input lands in, rank by
  rank (rank-major).
- copy-out: the views and copies from the all-gather output to each unsharded
  parameter (``passes.patterns.match_copy_out``).
- unsharded parameter (``FSDPParam.unsharded_param``): the full ``rows``-row tensor
  the forward computes with, shown to the modules between unshard and reshard.
- tensor-parallel parameter: an original parameter that is already a DTensor on a
  tensor-parallel (TP) mesh, after ``parallelize_module``. Its local tensor takes the
  original parameter's place above: sharded on dim 0 over the data-parallel mesh,
  gathered back, and shown to the modules as a DTensor with the TP placements, so the
  forward's TP collectives run as they do without fully_shard ([Note: sharding a
  tensor-parallel parameter]).
- reduce-scatter input: a group's unsharded gradients padded and laid out rank-major
  (``fsdp::reduce_scatter_input``), the all-gather output's layout, in the reduction
  dtype: the policy's ``reduce_dtype``, else the trainable parameters' wire dtype
  (``FSDPParamGroup.reduction_dtype``).
- all-gather extension: a parameter whose local tensor is a tensor subclass with FSDP2's
  ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``; its all-gather inputs are what
  the first makes of the shard, and its unsharded parameter what the second makes of
  their all-gather outputs ([Note: all-gather extensions] in ``_extension``).
- post-forward chunk: with ``reshard_after_forward=<int>``, the part of a group's
  all-gather output a rank keeps between forward and backward, gathered back over the
  smaller group in backward ([Note: resharding to a smaller group] in ``_group_settings``).
- sharded gradient: this rank's reduced rows, the ``.grad`` of the sharded parameter.
- group (``FSDPParamGroup``): the parameters of one ``fully_shard`` call, gathered by
  one all-gather and reduced by one reduce-scatter; named after its module's path
  under the root (``"layers.0"``; the root, whose path is empty, by its class name,
  ``"Llama"``; a call on several modules joins their names with ``+``), when the root
  claims it (``FSDPState.claim_root``): the name the passes' annotation carries
  ([Note: the group annotation]). A bucket is several groups merged by the passes.
- process group: the c10d group the collectives run on (the mesh's); ops take its
  name, ``group_name``. On HSDP's 2-D mesh the shard group (dim 1) gathers and
  reduce-scatters, and the replicate group (dim 0) all-reduces the sharded gradient
  ([Note: HSDP reduction] in compile_shard.ops); a group of one rank issues no
  collective ([Note: a group of one rank]).

The passes add three words for sets of nodes: a group's *copy-out chain* (the
copy-out's nodes, ``passes.patterns.copy_out_chain``), its all-gather or reduction
*unit* (copy-in, collective, wait and copy-out, or the reduction's input, collective,
wait and what reads the wait, gloo's sum or a forced sum's division: what ``reorder``
moves as one), and a bucket's *members* (the groups it merged).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from . import ops
from ._classes import subclass, user_class, user_class_name
from ._extension import AllGatherExtension
from ._gradient_rules import GradientRules, grad_dtype_policy_of
from ._layout import padded_rows
from ._shard_memory import ShardMemory
from ._tensor_parallel import (
    shard_placements,
    spmd_layout,
    tensor_parallel_layout,
    unsharded_dtensor,
    unsharded_local,
)


@dataclass(frozen=True)
class ParamUsage:
    """A place where a parameter is registered: ``module._parameters[name]``."""

    module: nn.Module
    name: str


#: The ``id`` of each parameter a fully_shard call sharded, original and sharded, to its ``FSDPParam``
#: ([Note: a parameter in one group]). By ``id``: a weak reference to a parameter would keep
#: ``torch.utils.swap_tensors`` (``module.to_empty()``) from swapping it.
_SHARDED_BY: weakref.WeakValueDictionary[int, FSDPParam] = weakref.WeakValueDictionary()


def sharding_of(param: torch.Tensor) -> FSDPParam | None:
    """The ``FSDPParam`` that sharded ``param`` (an original or a sharded parameter), None for any other tensor.

    [Note: a parameter in one group]
    Each group all-gathers its parameters and reduce-scatters their gradients on its
    own, so a parameter in two groups (an embedding tied to the output projection,
    each sharded by a ``fully_shard`` call of its own) would be gathered twice and its
    sharded gradient written by each group with that group's contribution alone: a
    silently wrong gradient. FSDP2 raises ``ValueError`` at its lazy init. Here every
    parameter a call shards is noted, original and sharded, and ``fully_shard`` raises
    where a later call finds one in its subtree (``_init.managed_params``); a tie made
    after ``fully_shard`` (``output.weight = embed.weight``) puts another group's
    sharded parameter into a module's ``_parameters``, which the root finds before
    each step (``_state.check_registrations``). A parameter shared within one group is
    one ``FSDPParam`` with several usages, gathered and reduced once.
    """
    fsdp_param = _SHARDED_BY.get(id(param))
    if fsdp_param is None or param is not fsdp_param.sharded_param and param is not fsdp_param.original_param():
        return None  # another tensor at the address of a freed one
    return fsdp_param


def shared_between_groups(where: str, fqn: str, module: nn.Module, other: FSDPParam) -> ValueError:
    owners = " and ".join(dict.fromkeys(user_class_name(usage.module) for usage in other.usages))
    return ValueError(
        f"{where}: parameter {fqn!r} of {user_class_name(module)} is shared with {owners} ({other.fqn!r}), which another "
        "fully_shard call "
        "sharded: each group gathers and reduces its parameters on its own, so the shared parameter's gradient "
        "would miss one group's contribution. Shard the modules that share it in one group, "
        "fully_shard([module_a, module_b]), or apply fully_shard to a common ancestor of both only"
    )


_MANAGED_ATTR = "_compile_shard_managed"
_ATTRIBUTE_CLASSES: dict[tuple[type, frozenset[str]], type] = {}


def _managed_attribute(name: str) -> property:
    def get(module: nn.Module) -> torch.Tensor:
        return getattr(module, _MANAGED_ATTR)[name].module_attribute()

    return property(get, doc=f"``{name}``, managed by fully_shard: sharded outside forward/backward")


def install_managed_attribute(usage: ParamUsage, fsdp_param: FSDPParam) -> None:
    """Makes ``usage.module.<name>`` read through ``fsdp_param``.

    [Note: parameters are read through properties]
    ``module._parameters`` always holds the sharded DTensor, so ``parameters()``,
    ``state_dict()``, optimizers and ``_apply`` see the sharded view at all times,
    also in the middle of a forward. The module's class is swapped for a subclass
    whose property ``<name>`` returns what the forward should use
    (``FSDPParam.module_attribute``): the unsharded tensor between unshard and
    reshard. Unsharding changes the parameter's slot in its group's list
    ([Note: one mutated list per group]) instead of rewriting the ``_parameters``
    dicts of every module that uses the parameter.
    """
    module = usage.module
    managed = module.__dict__.setdefault(_MANAGED_ATTR, {})
    managed[usage.name] = fsdp_param
    base = user_class(type(module))
    key = (base, frozenset(managed))
    if key not in _ATTRIBUTE_CLASSES:
        namespace = {name: _managed_attribute(name) for name in managed}
        _ATTRIBUTE_CLASSES[key] = subclass(base, (base,), namespace)
    module.__class__ = _ATTRIBUTE_CLASSES[key]


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _sharded_dtensor(
    local_tensor: torch.Tensor, mesh: DeviceMesh, placements: tuple, shape: torch.Size, stride: tuple[int, ...]
) -> DTensor:
    """A DTensor over ``local_tensor`` itself, also where that is in CPU memory on an accelerator's mesh.

    ``DTensor.from_local`` copies a local tensor to the mesh's device, which would undo
    CPU offload ([Note: CPU offload] in ``_shard_memory``); FSDP2 builds such DTensors
    directly, as here.
    """
    if local_tensor.is_meta or local_tensor.device.type == mesh.device_type:
        return DTensor.from_local(local_tensor, mesh, placements, run_check=False, shape=shape, stride=stride)
    spec = DTensorSpec(mesh, tuple(placements), TensorMeta(shape, stride, local_tensor.dtype))
    return DTensor(local_tensor, spec, requires_grad=local_tensor.requires_grad)


class _RoundedGradient(torch.autograd.Function):
    """The identity, whose backward rounds the gradient to ``dtype`` and back.

    [Note: gradient contributions]
    Autograd adds the gradients of a tensor read several times (a weight tied between
    the embedding and the output layer) in the tensor's dtype, here ``param_dtype``.
    FSDP2 on torch 2.15 (``ROUNDS_EACH_GRADIENT_CONTRIBUTION``) gives its unsharded
    parameter, an autograd leaf, the reduction's ``grad_dtype``, so where ``reduce_dtype``
    is narrower (fp32 parameters reduced in bf16) each contribution is rounded to it
    before they are added. compile_shard's unsharded parameters are all-gather outputs,
    not leaves, so each read rounds its own contribution instead: to the narrower dtype
    and back, which the addition in the wider one keeps exact. Where ``reduce_dtype`` is
    wider, FSDP2 adds contributions in ``param_dtype`` too, except in the first
    micro-batch without gradient sync, where it adds them in the wider dtype; an
    all-gather output cannot take a wider gradient, so there compile_shard's tied
    parameters keep ``param_dtype``'s addition (docs/api.md, "torch versions").
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.dtype = dtype
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype).to(grad.dtype), None


def _resharding(module: nn.Module, *args: Any, **kwargs: Any) -> None:
    """``state_dict`` and ``load_state_dict``'s pre-hook on every module that uses a sharded parameter.

    As FSDP2's: the groups reshard, so the sharded parameters are registered ([Note: registered parameters]).
    """
    for fsdp_param in getattr(module, _MANAGED_ATTR, {}).values():
        group = fsdp_param.group_ref()
        if group is not None:
            group.reshard()


def _adopting_loaded_params(module: nn.Module, incompatible_keys: Any) -> None:
    """``load_state_dict``'s post-hook on every module that uses a sharded parameter."""
    for fsdp_param in getattr(module, _MANAGED_ATTR, {}).values():
        fsdp_param.adopt_loaded_param()


# [Note: sharded storage]
# ``sharded_param`` is an ``nn.Parameter`` wrapping a DTensor (``Shard(0)``), which
# is what the optimizer, ``clip_grad_norm_`` and ``state_dict()`` see. Its local
# tensor is a view of ``padded_shard``, a buffer of ``padded_rows`` rows that
# every rank allocates with the same size (FSDP2's layout): rows past the rank's
# real shard are padding, never visible to the user, never read back. The
# all-gather's copy-in still pads on its own: it reads ``shard`` (below), which
# holds the real rows only.
# When something outside fully_shard replaces the local tensor's storage (for
# example ``model.to_empty()`` after meta-device init), ``reset_sharded_param``
# copies the new values into fresh padded storage and re-points the same local
# tensor at it with ``fsdp::set_``, so any object holding the local tensor (an
# optimizer state, a state dict) stays valid.
#
# [Note: the shard autograd sees]
# The all-gather reads ``shard``, a plain tensor that shares the local tensor's
# storage (``detach()``) and is a leaf of its own, not the DTensor through
# ``to_local()``. A DTensor graph input costs torch.compile per parameter: Dynamo
# builds a fake DTensor and guards on its spec, AOTAutograd traces through its
# subclass wrapping and wraps its gradient at every call (docs/benchmarks.md has
# the cost on config B). The gradient reaches ``sharded_param.grad``
# through ``shard``'s post-accumulate-grad hook instead, which FSDP2 also
# writes by hand: set, or added to a gradient already there (accumulation), then
# the parameter's own post-accumulate-grad hooks. ``shard`` always requires grad;
# the all-gather reads it detached while ``sharded_param.requires_grad`` is False
# (``all_gather_shard``), and freezing a parameter after compiling recompiles
# instead of computing its gradient ([Note: settings a trace reads as constants]
# in compile_shard._group_gather). ``shard`` follows
# the local tensor through ``reset_sharded_param``; a local tensor replaced any
# other way (``param.data = ...``) is not seen, as with FSDP2.
#
# [Note: a sharded parameter assigned by load_state_dict]
# ``load_state_dict(state_dict, assign=True)`` puts the state dict's own parameters
# into the modules: FSDP2's tutorial loads a checkpoint into a model built on meta
# that way, from DTensors made with ``distribute_tensor(full, mesh, placements)`` of
# the sharded parameters. As in FSDP2 (a post-load hook per module), the new
# parameter then becomes the sharded parameter (``adopt_loaded_param``): it must have
# the sharded parameter's mesh, placements and shape; its values are copied into
# fresh padded storage by ``reset_sharded_param``, and every module that shares the
# parameter gets it, so tied weights stay tied. An optimizer built before the load
# holds the replaced parameters, as with FSDP2: build it after loading.
#
# [Note: sharding on another dim]
# FSDP2's ``shard_placement_fn`` may shard a parameter on a dim ``d > 0``. Everything
# here shards rows, so such a parameter is sharded as its transpose
# ``param.transpose(0, d)``: the padded shard, ``shard``, the all-gather, the copy-out
# and the reduction all see that transpose's rows, unchanged, and the passes with them.
# The sharded parameter's local tensor is transposed back, a view of the same storage,
# so the optimizer and the state dicts see ``Shard(d)`` and the original shape, and a
# gradient arriving for ``shard`` is transposed back the same way. The copy-out
# transposes each gathered parameter back into a contiguous copy
# (``unsharded_from_rows``): the modules compute with FSDP2's contiguous unsharded
# parameter, whose kernels a transposed view would change, and that copy is what the
# group frees and refills. Each rank holds the same rows of dim ``d`` as in FSDP2,
# whose local tensor is contiguous where this one is a transposed view.


class FSDPParam(GradientRules, ShardMemory):
    """The sharded form of one original parameter: its padded storage, the shard, and what the modules read.

    Its invariants are the notes above the class. The rules for its sharded gradient
    (``_gradient_rules``) and where its shard lives (``_shard_memory``) are its bases'.
    """

    def __init__(
        self,
        param: nn.Parameter,
        fqn: str,
        usages: list[ParamUsage],
        mesh: DeviceMesh,
        spmd_data_parallel_dims: tuple[int, ...] = (),
        shard_dim: int = 0,
        pin_memory: bool = False,
        compute_device: torch.device | None = None,
    ):
        """``mesh``: the data-parallel mesh. ``spmd_data_parallel_dims``: with ``dp_mesh_dims``, the data-parallel
        dims of the parameter's own (SPMD) mesh, the shard dim last. ``shard_dim``: the dim ``shard_placement_fn``
        chose ([Note: sharding on another dim]). ``pin_memory``: the padded shard is in pinned memory
        (``CPUOffloadPolicy``). ``compute_device``: the mesh's device where the shard is kept in CPU memory
        instead ([Note: CPU offload] in ``_shard_memory``), else None."""
        self.grad_dtype_policy = grad_dtype_policy_of(param)
        if param.dim() == 0:
            raise ValueError(
                f"fully_shard: parameter {fqn!r} is 0-dimensional and cannot be sharded on dim 0; "
                "reshape it to shape (1,) or keep it out of fully_shard"
            )
        self.fqn = fqn
        self.usages = usages
        # Weak: only to recognize the parameter if another module still uses it.
        self.original_param = weakref.ref(param)
        # A DTensor parameter's own layout, which the unsharded parameter takes again
        # ([Note: sharding a tensor-parallel parameter]).
        self.tp_spec: DTensorSpec | None = param._spec if isinstance(param, DTensor) else None
        self.spmd_data_parallel_dims = spmd_data_parallel_dims
        self.shard_dim = shard_dim
        if self.tp_spec is None:
            self.sharded_mesh, self.placements = mesh, shard_placements(mesh, shard_dim)
        elif not spmd_data_parallel_dims:
            self.sharded_mesh, self.placements = tensor_parallel_layout(mesh, self.tp_spec)
        else:
            self.sharded_mesh, self.placements = spmd_layout(self.tp_spec, spmd_data_parallel_dims[-1])
        data = param if self.tp_spec is None else param._local_tensor
        data = self.rows_of(data)
        self.world_size = mesh.size(-1)
        self.rank = mesh.get_local_rank(mesh.ndim - 1)
        self.unsharded_shape = data.shape
        self.contiguous_stride = _contiguous_stride(data.shape)
        self.padded_rows = padded_rows(data.size(0), self.world_size)
        self.padded_numel = self.padded_rows * math.prod(data.shape[1:])
        start = min(self.rank * self.padded_rows, data.size(0))
        end = min(start + self.padded_rows, data.size(0))
        self.shard_rows = end - start
        self.pin_memory = pin_memory
        self.compute_device = compute_device
        self.padded_shard = self._new_padded_shard(data)
        with torch.no_grad():
            self.padded_shard[: self.shard_rows].copy_(data[start:end])
        local_tensor = self.rows_of(self.padded_shard[: self.shard_rows])
        sharded = _sharded_dtensor(local_tensor, self.sharded_mesh, self.placements, param.shape, param.stride())
        self.sharded_param = nn.Parameter(sharded, requires_grad=param.requires_grad)
        self.shard = self._new_shard()
        self.apply_grad_dtype_policy()
        self._installed_local = local_tensor  # what reset_sharded_param compares a subclass local tensor to
        self.init_extensions()
        # The slots behind unsharded_param and used_since_reduction: this parameter's own until
        # its group shares them ([Note: one mutated list per group]).
        self._shown: list[torch.Tensor | None] = [None]
        self._used: list[bool | None] = [None]
        self._slot = 0
        # The dtype each read rounds its gradient contribution to, set by the group
        # ([Note: gradient contributions]); None: contributions add in the read's dtype.
        self.contribution_dtype: torch.dtype | None = None
        # What the modules' ``_parameters`` hold ([Note: registered parameters]).
        self.registered: nn.Parameter = self.sharded_param
        # The group this parameter is in, set by the group: what the state-dict hooks reshard.
        self.group_ref: Callable[[], Any] = lambda: None
        _SHARDED_BY[id(param)] = _SHARDED_BY[id(self.sharded_param)] = self
        for usage in usages:
            usage.module._parameters[usage.name] = self.sharded_param
            install_managed_attribute(usage, self)
            usage.module.register_load_state_dict_post_hook(_adopting_loaded_params)
            usage.module.register_state_dict_pre_hook(_resharding)
            usage.module.register_load_state_dict_pre_hook(_resharding)

    def init_extensions(self) -> None:
        """Reads the all-gather extension off the local tensor: at ``fully_shard``, and again at the first forward."""
        self.extension = AllGatherExtension.of(self.local_tensor, self.fqn)
        if self.extension is None:
            return
        if self.offload_to_cpu:
            raise NotImplementedError(
                f"fully_shard: parameter {self.fqn!r} has an all-gather extension (fsdp_pre_all_gather); "
                "compile_shard does not offload such parameters to CPU memory. Pass OffloadPolicy() for its module"
            )
        if self.tp_spec is not None or self.shard_dim != 0:
            raise NotImplementedError(
                f"fully_shard: parameter {self.fqn!r} has an all-gather extension (fsdp_pre_all_gather) and is "
                + ("a DTensor" if self.tp_spec is not None else f"sharded on dim {self.shard_dim}")
                + "; compile_shard supports extensions on plain parameters sharded on dim 0"
            )

    @property
    def has_extension(self) -> bool:
        """Whether the local tensor has FSDP2's all-gather extension ([Note: all-gather extensions] in ``_extension``)."""
        return self.extension is not None

    @property
    def unsharded_param(self) -> torch.Tensor | None:
        """What the modules read between ``show_unsharded`` and ``show_sharded``; ``None`` otherwise."""
        return self._shown[self._slot]

    @unsharded_param.setter
    def unsharded_param(self, value: torch.Tensor | None) -> None:
        self._shown[self._slot] = value

    def rows_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` with the shard dim first, or back: a transposed view ([Note: sharding on another dim])."""
        return tensor if self.shard_dim == 0 else tensor.transpose(0, self.shard_dim)

    def unsharded_from_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The unsharded parameter, contiguous in its own layout, from the gathered rows (a copy for ``d > 0``)."""
        return rows if self.shard_dim == 0 else rows.transpose(0, self.shard_dim).contiguous()

    @property
    def local_tensor(self) -> torch.Tensor:
        return self.sharded_param._local_tensor

    def _new_shard(self) -> torch.Tensor:
        """See [Note: the shard autograd sees]."""
        shard = self.rows_of(self.local_tensor.detach()).requires_grad_(True)
        # Not the bound method: it would close a cycle through autograd's C++ hook list
        # ([Note: no reference cycle through an autograd node] in compile_shard._group).
        fsdp_param_ref = weakref.ref(self)

        def accumulate_sharded_grad(shard: torch.Tensor) -> None:
            fsdp_param = fsdp_param_ref()
            if fsdp_param is not None:
                fsdp_param._accumulate_sharded_grad(shard)

        shard.register_post_accumulate_grad_hook(accumulate_sharded_grad)
        return shard

    def extension_inputs(self, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> tuple[list[torch.Tensor], Any]:
        """The all-gather inputs and metadata the extension makes of the shard.

        ``mesh``: the shard mesh (the shard dim's on HSDP), as FSDP2 passes it.
        """
        module = self.usages[0].module
        inputs, metadata = self.extension.inputs(
            self.shard.detach(), mesh, self.unsharded_shape, self.contiguous_stride, module, mp_policy
        )
        padded_size = torch.Size((self.padded_rows, *self.unsharded_shape[1:]))
        # FSDP2 checks this on the ranks that hold padding only, and the others then wait in
        # the all-gather; every rank checks it here.
        uneven = self.unsharded_shape[0] % self.world_size != 0
        if uneven and any(tensor.size() != padded_size for tensor in inputs):
            raise ValueError(
                f"fully_shard: parameter {self.fqn!r} is sharded unevenly ({self.unsharded_shape[0]} rows over "
                f"{self.world_size} ranks), so its fsdp_pre_all_gather must return all-gather inputs of the padded "
                f"shard size {tuple(padded_size)}, as FSDP2 requires; got {[tuple(t.size()) for t in inputs]}"
            )
        return inputs, metadata

    def unsharded_from_extension(
        self, all_gather_outputs: list[torch.Tensor], metadata: Any, param_dtype: torch.dtype
    ) -> torch.Tensor:
        """The unsharded parameter ``fsdp_post_all_gather`` makes of the gathered inputs, in the parameter's shape."""
        unsharded = self.extension.unsharded(self.shard.detach(), all_gather_outputs, metadata, param_dtype)
        return torch.as_strided(unsharded, self.unsharded_shape, self.contiguous_stride, 0)

    def _accumulate_sharded_grad(self, shard: torch.Tensor) -> None:
        grad, shard.grad = shard.grad, None
        if grad is not None:  # None: a compiled backward's for a parameter frozen in the graph
            self.accumulate_sharded_grad(grad)

    def accumulate_sharded_grad(self, grad: torch.Tensor) -> None:
        """Sets or adds the reduced gradient of ``shard`` into the sharded parameter's ``.grad``, then its hooks."""
        param, grad = self.sharded_param, self.rows_of(grad)
        if param.grad is None:
            param.grad = _sharded_dtensor(grad, self.sharded_mesh, self.placements, param.shape, param.stride())
        else:
            param.grad._local_tensor.add_(grad)
        for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
            hook(param)

    def show_sharded(self) -> None:
        """The modules read the sharded parameter again; freeing the unsharded storage is the group's job."""
        self._shown[self._slot] = None

    def show_unsharded(self, unsharded_param: torch.Tensor) -> None:
        """The modules read ``unsharded_param`` until ``show_sharded`` (a tensor-parallel one as a DTensor again)."""
        if self.tp_spec is not None:
            unsharded_param = unsharded_dtensor(unsharded_param, self.tp_spec, self.spmd_data_parallel_dims)
        self._shown[self._slot] = unsharded_param

    def register(self, param: nn.Parameter) -> None:
        """Puts ``param`` in the ``_parameters`` of every module that uses this parameter.

        [Note: registered parameters]
        FSDP2 registers the unsharded parameters on the modules from unshard to reshard:
        after ``unshard()``, after a forward that does not reshard (the root's, by
        default) and until backward reshards, ``module.parameters()`` are plain
        unsharded parameters; otherwise the sharded DTensors. Its ``state_dict()`` and
        ``load_state_dict()`` reshard first. compile_shard's unsharded tensors are
        all-gather outputs inside autograd's graph, which the forward reads through the
        modules' properties ([Note: parameters are read through properties]); what eager
        mode registers in their place is an ``nn.Parameter`` over the same storage
        (``unsharded_parameter``), freed and refilled with it, so that ``parameters()``
        and the properties outside forward show what FSDP2's show. A compiled graph keeps
        its unsharded tensors inside: around a compiled step the sharded parameters stay
        registered (docs/api.md).
        """
        self.registered = param
        for usage in self.usages:
            usage.module._parameters[usage.name] = param

    def unsharded_parameter(self) -> nn.Parameter:
        """The ``nn.Parameter`` registered while the modules read the shown unsharded tensor: a leaf over its storage."""
        return nn.Parameter(self._shown[self._slot].detach(), requires_grad=self.sharded_param.requires_grad)

    def unsharded_local(self) -> torch.Tensor:
        """The tensor ``show_unsharded`` was given: a tensor-parallel parameter's local tensor."""
        unsharded_param = self._shown[self._slot]
        if self.tp_spec is None:
            return unsharded_param
        return unsharded_local(unsharded_param, self.spmd_data_parallel_dims)

    def module_attribute(self) -> torch.Tensor:
        """What ``module.<name>`` returns for every module that uses this parameter.

        The unsharded tensor between unshard and reshard (eager, and for the duration
        of a traced forward, see [Note: traced unshard]), else the registered parameter
        ([Note: registered parameters]): FSDP2's registration semantics. Each read
        rounds its own gradient contribution where FSDP2 does ([Note: gradient
        contributions]).
        """
        unsharded_param = self._shown[self._slot]  # not the property: traced, a call costs an inlining
        if unsharded_param is None:
            return self.registered
        if self.contribution_dtype is None:
            return unsharded_param
        return _RoundedGradient.apply(unsharded_param, self.contribution_dtype)

    def adopt_loaded_param(self) -> None:
        """See [Note: a sharded parameter assigned by load_state_dict]."""
        loaded = next(
            (
                param
                for usage in self.usages
                if (param := usage.module._parameters.get(usage.name)) is not self.registered
            ),
            None,
        )
        if loaded is None:
            return
        sharded = self.sharded_param
        if not (
            isinstance(loaded, DTensor)
            and loaded.device_mesh == self.sharded_mesh
            and loaded.placements == self.placements
            and (loaded.shape, loaded.dtype) == (sharded.shape, sharded.dtype)
        ):
            mesh = self.sharded_mesh.mesh_dim_names or tuple(self.sharded_mesh.shape)
            expected = (
                f"a {sharded.dtype} DTensor of shape {tuple(sharded.shape)} on the mesh {mesh} with placements "
                f"{self.placements}"
            )
            found = f"a {loaded.dtype} {type(loaded).__name__} of shape {tuple(loaded.shape)}"
            if isinstance(loaded, DTensor):
                found += f" with placements {loaded.placements}"
            raise ValueError(
                f"load_state_dict(assign=True): parameter {self.fqn!r} must be {expected}, got {found}. Make it "
                "from the full tensor with distribute_tensor(full, param.device_mesh, param.placements) of the "
                "sharded parameter (model.state_dict()), or load with assign=False"
            )
        if not isinstance(loaded, nn.Parameter):
            loaded = nn.Parameter(loaded, requires_grad=sharded.requires_grad)
        self.sharded_param = loaded
        _SHARDED_BY[id(loaded)] = self
        self.register(loaded)
        self.reset_sharded_param()

    def reset_sharded_param(self) -> None:
        """Re-establishes the [Note: sharded storage] invariant after an outside change."""
        local_tensor = self.local_tensor
        if type(local_tensor) is not torch.Tensor:
            # A tensor subclass (TwoTensor, float8 weights) has no storage of its own to re-point
            # with fsdp::set_; as in FSDP2, its new values go to a fresh padded shard, and the
            # DTensor's local tensor becomes a view of it (``to_empty`` swapped the object anyway).
            if local_tensor is self._installed_local:
                return
            rows = self.rows_of(local_tensor)
            padded = self._new_padded_shard(rows)
            with torch.no_grad():
                padded[: self.shard_rows].copy_(rows)
            self.sharded_param._local_tensor = self._installed_local = self.rows_of(padded[: self.shard_rows])
            self.padded_shard = padded
            self.shard = self._new_shard()
            return
        if self.offload_to_cpu and local_tensor.device.type not in ("cpu", "meta"):
            raise RuntimeError(
                f"fully_shard: parameter {self.fqn!r} was moved to {local_tensor.device}, but CPUOffloadPolicy keeps "
                "sharded parameters in CPU memory. Move nothing to the device after fully_shard, and materialize a "
                "meta-device module with module.to_empty(device='cpu'), as in FSDP2"
            )
        if (
            local_tensor.untyped_storage().data_ptr() == self.padded_shard.untyped_storage().data_ptr()
            and local_tensor.dtype == self.padded_shard.dtype
            and (not self.pin_memory or local_tensor.is_meta or local_tensor.is_pinned())
        ):
            return
        rows = self.rows_of(local_tensor)
        padded = self._new_padded_shard(rows)
        with torch.no_grad():
            padded[: self.shard_rows].copy_(rows)
        ops.set_(local_tensor, self.rows_of(padded[: self.shard_rows]))
        self.padded_shard = padded
        self.shard = self._new_shard()
        self.apply_grad_dtype_policy()


def share_slots(fsdp_params: list[FSDPParam]) -> tuple[list[torch.Tensor | None], list[bool | None]]:
    """Puts a group's unsharded parameters and use flags in one list each; returns the two lists.

    [Note: one mutated list per group]
    A traced forward shows each group's unsharded parameters to its modules and hides
    them again (``unsharded_param``), and clears the eager use flags
    (``used_since_reduction``). Dynamo replays every Python object a trace mutated
    after each call of the compiled graph, and at compile time formats a user stack
    for each one, logged or not (torch's ``side_effect_replay_policy``). Held as
    attributes of each ``FSDPParam``, those were 9 mutated objects in every block of
    a Llama; held in two lists per group, they are 2. The traced code writes and
    reads the slots directly: a property call costs Dynamo an inlined call, which
    outweighed the saving (docs/benchmarks.md, "What a block's capture costs").
    """
    shown = [fsdp_param.unsharded_param for fsdp_param in fsdp_params]
    used = [fsdp_param.used_since_reduction for fsdp_param in fsdp_params]
    for slot, fsdp_param in enumerate(fsdp_params):
        fsdp_param._shown, fsdp_param._used, fsdp_param._slot = shown, used, slot
    return shown, used
