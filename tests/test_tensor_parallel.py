"""Tensor parallelism + FSDP: blocks parallelized over ``mesh["tp"]``, sharded over ``mesh["dp"]``.

Against torch FSDP2 on the same 2-D mesh, plan and wrapping: placements (FSDP2's
``_StridedShard`` where TP already shards dim 0, [Note: sharding a tensor-parallel
parameter] in compile_shard._param), collectives, gradients and parameters.
"""

import functools
import math

import pytest
import torch
from torch._dynamo.utils import clear_compilation_metrics, compilation_time_metrics, counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from compile_shard import fully_shard
from compile_shard.debug import recompiles
from compile_shard.models import LlamaConfig
from compile_shard.passes import settings
from dist_utils import (
    FakeProcessGroup,
    assert_gradients_match,
    build_tensor_parallel_llama,
    counted_step,
    dcp_exchange_both_ways,
    global_batch,
    run_gloo,
    step_optimizers_and_compare,
    train_against_torch_fsdp2,
)
from graph_utils import CapturingBackend, op_counts

CONFIG = LlamaConfig()
STEPS = 3


def _mesh(shape):
    """The (dp, tp) mesh; for a 3-D shape, HSDP's (replicate, shard) dims as "dp" beside "tp"."""
    if len(shape) == 2:
        return init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    world = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp"))
    return {"dp": world["replicate", "shard"], "tp": world["tp"]}


def _parity_worker(rank, world_size, shape, backends, mp_policy):
    """Each backend's compile_shard model against torch FSDP2: placements, gradients and parameters bitwise."""
    mesh = _mesh(shape)
    theirs = build_tensor_parallel_llama(CONFIG, mesh, shard=functools.partial(torch_fully_shard, mp_policy=mp_policy))
    models = [
        build_tensor_parallel_llama(CONFIG, mesh, shard=functools.partial(fully_shard, mp_policy=mp_policy))
        for _ in backends
    ]
    data_parallel_rank = rank // shape[-1]  # the TP ranks of one data-parallel rank read the same rows

    def tokens_for_step(step):
        tokens = global_batch(step, world_size // shape[-1], 2, 8, CONFIG.vocab_size)
        return tokens[2 * data_parallel_rank : 2 * data_parallel_rank + 2]

    train_against_torch_fsdp2(theirs, models, backends, tokens_for_step)
    if shape == (2, 2):
        wq = models[0].layers[0].attention.wq.weight
        assert wq.placements == (_StridedShard(0, split_factor=2), Shard(0))


BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


# (1, 2): tensor parallelism alone, FSDP over groups of one rank; (2, 1): FSDP alone on
# DTensor parameters of a TP mesh of one; (2, 2): both, on 4 processes; (2, 1, 2): HSDP
# (two replicas of a shard group of one) beside TP, on 4 processes, in bf16 with fp32
# reductions, as torchtitan trains.
@pytest.mark.parametrize(
    "shape, backends, mp_policy",
    [
        ((1, 2), (None, "aot_eager"), MixedPrecisionPolicy()),
        ((2, 1), (None,), MixedPrecisionPolicy()),
        ((2, 2), (None, "aot_eager"), MixedPrecisionPolicy()),
        ((2, 1, 2), (None,), BF16),
    ],
    ids=["1x2", "2x1", "2x2", "hsdp_2x1x2_bf16"],
)
def test_tensor_parallel_fsdp_matches_torch_fsdp2(shape, backends, mp_policy):
    run_gloo(_parity_worker, math.prod(shape), shape, backends, mp_policy)


@pytest.mark.usefixtures("per_group_collectives")
@pytest.mark.parametrize("shape", [(2, 4), (4, 4)], ids=["2x4", "4x4"])
def test_compiled_tensor_parallel_fsdp_is_one_graph_each_way(shape):
    """A fake process group: one graph each way holding FSDP's and TP's collectives (torch FSDP2's per step), no
    recompile in 20 steps."""
    capture = CapturingBackend()
    torch._dynamo.reset()
    clear_compilation_metrics()
    counters.clear()
    with FakeProcessGroup(shape[0] * shape[1]):
        mesh = _mesh(shape)
        theirs = build_tensor_parallel_llama(CONFIG, mesh, shard=torch_fully_shard)
        model = build_tensor_parallel_llama(CONFIG, mesh)
        compiled = torch.compile(model, backend=capture.backend, fullgraph=True)
        for step in range(20):
            tokens = global_batch(step, 1, 2, 8, CONFIG.vocab_size)
            collectives = counted_step(compiled, tokens)
        assert collectives == counted_step(theirs, tokens)  # torch FSDP2's collectives and bytes, TP's included
        assert recompiles() == 0 and not counters["graph_break"]
    torch._dynamo.reset()
    (forward,), (backward,) = capture.forward_graphs, capture.backward_graphs
    groups = CONFIG.n_layers + 1
    forward_counts, backward_counts = op_counts(forward.graph), op_counts(backward.graph)
    assert forward_counts["all_gather"] == groups
    assert forward_counts["all_reduce"] == 2 * CONFIG.n_layers  # the row-parallel outputs: wo and w2
    assert backward_counts["all_gather"] == CONFIG.n_layers  # the resharded blocks again
    assert backward_counts["reduce_scatter"] == groups
    assert backward_counts["all_reduce"] == 5 * CONFIG.n_layers  # the inputs of the five column-parallel linears


def _equal_meshes_worker(rank, world_size, shape):
    """A second (dp, tp) mesh equal to the first, after another model trained on the first: FSDP2's parity.

    ``init_device_mesh`` makes a new root mesh object each time; FSDP2 accepts any TP
    mesh it can join to the data-parallel one, as test suites, notebooks and restarts
    inside one process make them.
    """
    first = _mesh(shape)
    earlier = build_tensor_parallel_llama(CONFIG, first)
    counted_step(earlier, global_batch(0, 1, 2, 8, CONFIG.vocab_size))
    replicated = distribute_tensor(torch.ones(4, 4), first["tp"], [Replicate()])
    assert torch.equal(replicated.redistribute(first["tp"], [Shard(0)]).full_tensor(), torch.ones(4, 4))
    second = _mesh(shape)
    assert second["tp"]._get_root_mesh() is not first["tp"]._get_root_mesh()
    theirs = build_tensor_parallel_llama(CONFIG, second, shard=torch_fully_shard)
    models = [build_tensor_parallel_llama(CONFIG, second) for _ in range(2)]
    data_parallel_rank = rank // shape[-1]

    def tokens_for_step(step):
        tokens = global_batch(step, world_size // shape[-1], 2, 8, CONFIG.vocab_size)
        return tokens[2 * data_parallel_rank : 2 * data_parallel_rank + 2]

    train_against_torch_fsdp2(theirs, models, (None, "aot_eager"), tokens_for_step)


@pytest.mark.parametrize("shape", [(1, 2), pytest.param((2, 2), marks=pytest.mark.slow)], ids=["1x2", "2x2"])
def test_a_second_equal_mesh_in_one_process_matches_torch_fsdp2(shape):
    run_gloo(_equal_meshes_worker, math.prod(shape), shape)


def _exchange_worker(rank, world_size, folder):
    """compile_shard at (1, 2) saves, torch FSDP2 at (2, 1) loads, and back: every parameter exact."""
    ours = build_tensor_parallel_llama(CONFIG, _mesh((1, 2)), seed=0)
    theirs, other = (
        build_tensor_parallel_llama(CONFIG, _mesh((2, 1)), seed=seed, shard=torch_fully_shard) for seed in (1, 2)
    )
    dcp_exchange_both_ways(ours, theirs, other, folder)


def test_dcp_exchange_with_torch_fsdp2_on_another_mesh(tmp_path):
    pytest.importorskip("numpy", reason="torch 2.13's DCP plans through object collectives, which need numpy")
    run_gloo(_exchange_worker, 2, str(tmp_path))


def test_unsupported_tensor_parallel_placements_name_the_parameter_and_the_fix():
    with FakeProcessGroup(4):
        mesh = _mesh((2, 2))
        partial = torch.nn.Linear(4, 4)
        partial.weight = torch.nn.Parameter(DTensor.from_local(partial.weight.detach(), mesh["tp"], [Partial()]))
        with pytest.raises(NotImplementedError, match=r"fully_shard\(Linear\): parameter 'weight' .*Partial"):
            fully_shard(partial, mesh=mesh["dp"])
        # A TP mesh over all four ranks overlaps the data-parallel dim: FSDP2's DeviceMesh._concatenate refuses it.
        overlapping = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        elsewhere = torch.nn.Linear(4, 4)
        replicated = distribute_tensor(elsewhere.weight.detach(), overlapping, [Replicate()])
        elsewhere.weight = torch.nn.Parameter(replicated)
        with pytest.raises(ValueError, match=r"parameter 'weight' is a DTensor on the mesh \('tp',\).*Slice both"):
            fully_shard(elsewhere, mesh=mesh["dp"])


class _SPMDBlock(torch.nn.Module):
    """Two linears, column- then row-parallel, written for DTensor activations on the full mesh."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = torch.nn.Linear(dim, hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


class _SPMDModel(torch.nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 12):
        super().__init__()
        # Three blocks: the first takes the input, which needs no gradient, and runs inlined, the first of
        # its key; the later two share a region ([Note: the first block of each key runs inlined]).
        self.blocks = torch.nn.ModuleList(_SPMDBlock(dim, hidden) for _ in range(3))
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def _spmd_model(mesh, shard, dp_mesh_dims):
    """Every parameter a DTensor on the full mesh: replicated on the data-parallel dims, Megatron's plan on "tp"."""
    torch.manual_seed(0)
    model = _SPMDModel()
    data_parallel = [Replicate()] * (mesh.ndim - 1)
    for block in model.blocks:
        for linear, placement in ((block.w1, Shard(0)), (block.w2, Shard(1))):
            weight = distribute_tensor(linear.weight.detach(), mesh, [*data_parallel, placement])
            linear.weight = torch.nn.Parameter(weight)
    for name in ("weight", "bias"):
        value = getattr(model.norm, name).detach()
        setattr(model.norm, name, torch.nn.Parameter(distribute_tensor(value, mesh, [*data_parallel, Replicate()])))
    for module in (*model.blocks, model):
        shard(module, mesh=mesh, dp_mesh_dims=dp_mesh_dims)
    return model


def _spmd_worker(rank, world_size, shape, backends, compile_regions=False):
    """dp_mesh_dims on a full SPMD mesh: torch FSDP2's placements, gradients and parameters bitwise."""
    from torch.distributed.fsdp import DataParallelMeshDims

    settings.compile_regions = compile_regions

    names = ("dp", "tp") if len(shape) == 2 else ("replicate", "dp", "tp")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_mesh_dims = DataParallelMeshDims(shard="dp", replicate=None if len(shape) == 2 else "replicate")
    theirs = _spmd_model(mesh, torch_fully_shard, dp_mesh_dims)
    models = [_spmd_model(mesh, fully_shard, dp_mesh_dims) for _ in backends]
    runs = [m if backend is None else torch.compile(m, backend=backend) for m, backend in zip(models, backends)]
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in (theirs, *models)]
    clear_compilation_metrics()
    counters.clear()
    data_parallel_rank = rank // shape[-1]
    batch_placements = [Shard(0) if name != "tp" else Replicate() for name in names]
    for step in range(STEPS):
        inputs = torch.randn(4 * (world_size // shape[-1]), 8, generator=torch.Generator().manual_seed(step))
        local = inputs[4 * data_parallel_rank : 4 * data_parallel_rank + 4]
        for run in (theirs, *runs):
            (run(DTensor.from_local(local, mesh, batch_placements)) ** 2).sum().backward()
        for model in models:
            assert_gradients_match(model, theirs)
        step_optimizers_and_compare(optimizers, models, theirs)
    assert models[0].blocks[0].w1.weight.placements[-2:] == (_StridedShard(0, split_factor=2), Shard(0))
    if any(backends):
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"] and recompiles() == 0
    # The blocks ran as compile regions, their tensor-parallel parameters the regions' DTensors.
    assert bool(compilation_time_metrics.get("invoke_subgraph_trace")) == compile_regions


@pytest.mark.skipif(
    not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"), reason="dp_mesh_dims is new in torch 2.12"
)
@pytest.mark.parametrize(
    "shape, backends, compile_regions",
    [((2, 2), (None, "aot_eager"), False), ((2, 2), ("aot_eager",), True), ((2, 1, 2), (None,), False)],
    ids=["fsdp_2x2", "fsdp_2x2_compile_regions", "hsdp_2x1x2"],
)
def test_dp_mesh_dims_on_a_full_spmd_mesh_matches_torch_fsdp2(shape, backends, compile_regions):
    run_gloo(_spmd_worker, math.prod(shape), shape, backends, compile_regions)


@pytest.mark.skipif(
    not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"), reason="dp_mesh_dims is new in torch 2.12"
)
def test_dp_mesh_dims_errors_name_the_parameter_and_the_fix():
    from torch.distributed.fsdp import DataParallelMeshDims

    with FakeProcessGroup(4):
        mesh = _mesh((2, 2))
        plain = r"fully_shard\(Linear\): with dp_mesh_dims every parameter .*'weight' is a plain"
        with pytest.raises(ValueError, match=plain):
            fully_shard(torch.nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
        sharded_on_dp = torch.nn.Linear(4, 4, bias=False)
        weight = distribute_tensor(sharded_on_dp.weight.detach(), mesh, [Shard(0), Replicate()])
        sharded_on_dp.weight = torch.nn.Parameter(weight)
        with pytest.raises(ValueError, match=r"parameter 'weight' has Shard\(dim=0\) on the data-parallel dim 'dp'"):
            fully_shard(sharded_on_dp, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
        with pytest.raises(NotImplementedError, match=r"dp_mesh_dims.shard=\('dp', 'tp'\) names several mesh dims"):
            fully_shard(torch.nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard=("dp", "tp")))


def test_resharding_tensor_parallel_parameters_to_a_smaller_group_is_torch_fsdp2s_not_implemented():
    with FakeProcessGroup(8):
        mesh = _mesh((4, 2))
        column = torch.nn.Linear(4, 4)
        column.weight = torch.nn.Parameter(distribute_tensor(column.weight.detach(), mesh["tp"], [Shard(0)]))
        with pytest.raises(NotImplementedError, match=r"resharding to a smaller group .* not supported for DTensor"):
            fully_shard(column, mesh=mesh["dp"], reshard_after_forward=2)
