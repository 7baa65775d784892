"""DTensor parameters under fully_shard: where their shards live, and what the forward sees.

A parameter that is already a DTensor is either tensor-parallel (a DTensor on a TP
mesh, after ``parallelize_module``, sharded over a separate data-parallel mesh) or
lives on a full SPMD mesh that ``dp_mesh_dims`` names the data-parallel dims of
(``Replicate()`` there). Either way its local tensor is what the group shards, gathers
and reduces, exactly like a plain parameter; this module only says how the sharded
parameter and the unsharded one are laid out as DTensors, FSDP2's way.

[Note: sharding a tensor-parallel parameter]
The sharded parameter lives on the data-parallel dims and the parameter's own mesh
dims together: the data-parallel mesh followed by the TP mesh, or the SPMD mesh
itself. Its data-parallel shard placement is ``Shard(0)`` over the local tensor's
rows; where a later mesh dim already splits dim 0 (``ColwiseParallel``), each rank's
rows are a slice of that dim's slice, so the global rows it holds are strided, FSDP2's
``_StridedShard(0, split_factor=<shards of dim 0 on later dims>)``. The state dict then
holds FSDP2's DTensors, and DCP moves checkpoints between the two both ways. The
forward sees the gathered local tensor as a DTensor with the parameter's own
placements again, so the model's collectives (TP's, or the SPMD mesh's) run as
without fully_shard, eagerly and in the traced graphs. Its gradient reaches the
group's reduction as a local tensor: redistributed to the parameter's placements on
the TP dims (``DTensor.from_local``'s backward), but left a ``Partial`` sum on an SPMD
mesh's data-parallel dims (``from_local``'s ``grad_placements``), which the
reduce-scatter and all-reduce then reduce, as FSDP2 does; redistributing those too
would reduce them twice. A ``Partial`` sum is what a batch sharded over the
data-parallel dims produces. The placements are fixed when the graph is traced, not
read from the gradient: a custom autograd function that read them would see Dynamo's
guess (the forward output's placements) instead of the gradient's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _StridedShard


def shard_placements(mesh: DeviceMesh, dim: int = 0) -> tuple[Placement, ...]:
    """FSDP2's placements: ``Shard(dim)`` on a 1-D mesh, ``(Replicate(), Shard(dim))`` on HSDP's mesh."""
    return (Shard(dim),) if mesh.ndim == 1 else (Replicate(), Shard(dim))


def _shards_dim_0(placement: Placement) -> bool:
    return isinstance(placement, (Shard, _StridedShard)) and placement.dim == 0


def _data_parallel_shard(shards_on_later_dims: int) -> Placement:
    return _StridedShard(0, split_factor=shards_on_later_dims) if shards_on_later_dims > 1 else Shard(0)


def tensor_parallel_layout(mesh: DeviceMesh, spec: DTensorSpec) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The sharded parameter's mesh and placements for a DTensor on a TP mesh beside the data-parallel ``mesh``."""
    data_parallel = shard_placements(mesh)
    data_parallel = (*data_parallel[:-1], _data_parallel_shard(spec.num_shards_map[0]))
    return DeviceMesh._concatenate([mesh, spec.mesh]), (*data_parallel, *spec.placements)


def spmd_layout(spec: DTensorSpec, shard_dim: int) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The sharded parameter's mesh and placements for a DTensor on the full SPMD mesh, sharded on ``shard_dim``."""
    mesh, placements = spec.mesh, list(spec.placements)
    later_shards = 1
    for dim in range(shard_dim + 1, mesh.ndim):
        if _shards_dim_0(placements[dim]):
            later_shards *= mesh.size(dim)
    placements[shard_dim] = _data_parallel_shard(later_shards)
    return mesh, tuple(placements)


def _grad_placements(
    placements: Sequence[Placement], data_parallel_dims: Sequence[int]
) -> tuple[Placement, ...] | None:
    if not data_parallel_dims:
        return None
    return tuple(Partial() if dim in data_parallel_dims else placement for dim, placement in enumerate(placements))


def unsharded_dtensor(local: torch.Tensor, spec: DTensorSpec, data_parallel_dims: Sequence[int]) -> DTensor:
    """The gathered ``local`` tensor as the parameter the forward computes with (see the note above).

    On an SPMD mesh the gradient is declared a ``Partial`` sum on the data-parallel
    dims (``grad_placements``, torch >= 2.12 like ``dp_mesh_dims`` itself), what a batch
    sharded over them produces, so the backward redistributes it on the other dims only.
    """
    layout = dict(run_check=False, shape=spec.shape, stride=spec.stride)
    grad_placements = _grad_placements(spec.placements, data_parallel_dims)
    if grad_placements is not None:
        layout["grad_placements"] = grad_placements
    return DTensor.from_local(local, spec.mesh, spec.placements, **layout)


def unsharded_local(unsharded: DTensor, data_parallel_dims: Sequence[int]) -> torch.Tensor:
    """``unsharded_dtensor``'s ``local`` again, its gradient declared as ``unsharded_dtensor`` declares it."""
    return unsharded.to_local(grad_placements=_grad_placements(unsharded.placements, data_parallel_dims))
