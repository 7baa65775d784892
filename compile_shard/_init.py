"""What ``fully_shard`` checks and decides before it shards: the modules, mesh, policies and parameters.

Each refusal is FSDP2's, with its exception type, and names the module or parameter and
the fix (FSDP2 keeps the same in ``_fsdp_init.py``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.contract import _get_registry
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._classes import user_class, user_class_name
from ._group_settings import ReshardGroup
from ._param import ParamUsage, shared_between_groups, sharding_of
from ._state import get_state



def default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard: torch.distributed is not initialized; call dist.init_process_group(...) "
            "or pass mesh=init_device_mesh(...)"
        )
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def managed_params(module: nn.Module, label: str, ignored: set[int]) -> dict[nn.Parameter, list[ParamUsage]]:
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
                raise shared_between_groups(f"fully_shard({label})", prefix + name, submodule, other)
            usages.setdefault(param, []).append(ParamUsage(submodule, name))
        for child_name, child in submodule.named_children():
            if get_state(child) is None and _composable_with_fsdp(child):
                visit(child, f"{prefix}{child_name}.")

    visit(module, "")
    return usages


def _composable_with_fsdp(module: nn.Module) -> bool:
    """FSDP2's rule: a subtree that ``replicate()`` (composable DDP) manages is left to it."""
    return "replicate" not in (_get_registry(module) or {})


def managed_buffers(modules: list[nn.Module]) -> list[torch.Tensor]:
    """Buffers registered in the modules' subtrees, minus subtrees already sharded (FSDP2's managed buffers)."""
    buffers: dict[int, torch.Tensor] = {}
    stack = list(modules)
    while stack:
        module = stack.pop()
        buffers.update((id(buffer), buffer) for buffer in module._buffers.values() if buffer is not None)
        stack.extend(child for child in module.children() if get_state(child) is None and _composable_with_fsdp(child))
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


def move_to_mesh_device(label: str, mesh: DeviceMesh, tensors: list[torch.Tensor]) -> None:
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


def check_mesh(label: str, mesh: DeviceMesh, tensor_parallel_dims: set[str]) -> None:
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


def tensor_parallel_dims(modules: list[nn.Module]) -> set[str]:
    """The mesh dims that the modules' DTensor parameters (tensor parallelism, sharded or not yet) live on."""
    return {
        name
        for module in modules
        for param in module.parameters()
        if isinstance(param, DTensor)
        for name in param.device_mesh.mesh_dim_names or ()
    }


def check_tensor_parallel_params(label: str, mesh: DeviceMesh, named: dict[str, nn.Parameter]) -> None:
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


def check_policy_types(label: str, mp_policy: Any, offload_policy: Any) -> None:
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


def shard_memory(label: str, mesh: DeviceMesh, offload_policy: OffloadPolicy) -> tuple[bool, torch.device | None]:
    """FSDP2's ``OffloadPolicy``: whether the shards are pinned, and the mesh's device where they are offloaded.

    ``CPUOffloadPolicy`` keeps the sharded parameters in CPU memory, pinned with
    ``pin_memory=True`` (an error where no accelerator is available, as in FSDP2). On
    an accelerator's mesh the all-gathers then read copies of them on the mesh's
    device ([Note: CPU offload] in ``_shard_memory``); on a CPU mesh they live there anyway,
    and nothing moves, as in FSDP2.
    """
    if type(offload_policy) is OffloadPolicy:
        return False, None
    if type(offload_policy) is not CPUOffloadPolicy:
        raise NotImplementedError(f"fully_shard({label}): {type(offload_policy).__name__} is not supported")
    compute_device = None if mesh.device_type == "cpu" else _mesh_device(label, mesh)
    return offload_policy.pin_memory, compute_device


def data_parallel_dims(label: str, mesh: DeviceMesh, dp_mesh_dims: Any) -> tuple[int, ...]:
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


def check_spmd_params(label: str, mesh: DeviceMesh, named: dict[str, nn.Parameter], dims: tuple[int, ...]) -> None:
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


def resolve_reshard_after_forward(label: str, reshard_after_forward: Any, world_size: int) -> bool | int | None:
    """FSDP2's ``reshard_after_forward``: a bool, None, or an int that is the size of a group to reshard to.

    FSDP2 reads the int 1 as False (with a warning) and the shard group's size as True;
    another factor of that size is the size of the smaller group to reshard to
    ([Note: resharding to a smaller group] in ``_group_settings``); anything else is FSDP2's
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


def smaller_reshard_group(mesh: DeviceMesh, size: int) -> ReshardGroup:
    """FSDP2's post-forward mesh: the data-parallel ranks in rows of ``size``; a rank reshards over its row."""
    rows = DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, size), mesh_dim_names=("reshard_rows", "reshard"))
    return ReshardGroup(size, rows.get_local_rank(1), rows.get_group(1).group_name)


def chosen_shard_dim(label: str, fqn: str, param: nn.Parameter, shard_placement_fn, mesh: DeviceMesh) -> int:
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
        raise AssertionError(  # FSDP2's type
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


def check_contiguous(label: str, named: dict[str, nn.Parameter]) -> None:
    """FSDP2 shards contiguous parameters only (``NotImplementedError``): a channels_last weight is refused."""
    for fqn, param in named.items():
        if not param.is_contiguous():
            raise NotImplementedError(
                f"fully_shard({label}): parameter {fqn!r} is not contiguous (shape {tuple(param.shape)}, stride "
                f"{param.stride()}), which FSDP2 does not shard either. Make it contiguous before fully_shard, "
                "e.g. module.to(memory_format=torch.contiguous_format), and convert activations instead"
            )


def as_module_list(module: nn.Module | list[nn.Module]) -> list[nn.Module]:
    """``fully_shard``'s module argument as a list: one module, or FSDP2's list of modules forming one group.

    FSDP2's refusals, with its exception types: a container without a forward of its
    own (``ValueError``: it has no forward to unshard around), a module sharded twice
    (``AssertionError``, from torch's composable-API contract).
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(f"fully_shard: expected an nn.Module or a non-empty list of them, got {module!r}")
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and user_class(type(module)).forward is nn.Module.forward:
        raise ValueError(
            f"fully_shard: {type(module).__name__} has no forward of its own, so there is no forward to unshard its "
            "parameters around (FSDP2 refuses it too). Apply fully_shard to each module it holds, or pass them as "
            "one group: fully_shard(list(container))"
        )
    for m in modules:
        if get_state(m) is not None:
            raise AssertionError(
                f"fully_shard was already applied to this {user_class_name(m)}; apply it once per module "
                "(bottom-up: blocks first, then the root)"
            )
    if len({id(m) for m in modules}) != len(modules):
        raise AssertionError("fully_shard: the list holds the same module twice; list each module once")
    return modules
