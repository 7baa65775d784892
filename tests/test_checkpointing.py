"""The recipes of docs/checkpointing.md: torch's own checkpoint APIs on compile_shard models.

compile_shard adds nothing for checkpoints. Its parameters are ``nn.Parameter(DTensor)``
with ``Shard(0)``, so torch.distributed.checkpoint (DCP) and
torch.distributed.checkpoint.state_dict handle a compile_shard model as they handle a
torch FSDP2 one. These tests run each recipe as the document shows it.

One training run at world size 2 (the ``trained`` fixture) writes every checkpoint:
compile_shard's DCP checkpoint, torch FSDP2's DCP checkpoint of the same model trained
on the same data, the full model state dict and the full optimizer state dict. It also
writes what a loader must find (``expected.pt``: full parameters and optimizer state
read from the model and the optimizer themselves, not through the functions under
test), then takes one more step and records that step's gradients, the parameters
after it, and a loss.

[Note: an exact resumed step]
A real training step at another world size cannot be bitwise the original's: the
gradient is summed over another number of ranks, in another order. So the resumed
step gives the loaded optimizer the original step's averaged gradient (``.grad`` set
to it, sharded the loader's way) and compares the parameters after
``optimizer.step()`` bitwise. AdamW is elementwise: equal parameters, gradients and
state (``exp_avg``, ``exp_avg_sq``, ``step``) and equal hyperparameters give equal
results however the tensors are sharded, so any difference comes from the checkpoint.
The loader's optimizer starts with another learning rate, so the step is exact only if
the checkpoint restored the hyperparameters too. A forward on a fixed batch after the
step, the same batch on every rank, then reproduces the original run's loss bitwise:
every rank computes it with the same gathered parameters.

[Note: DCP needs numpy]
In torch 2.13, DCP's save and load plan through object collectives
(``dist.gather_object``, ``dist.scatter_object_list``, ``dist.broadcast_object_list``),
and ``broadcast_from_rank0`` sends the state dict's layout with
``dist.broadcast_object_list``. Each rank that receives an object decodes it with
``Tensor.numpy()`` (``_tensor_to_object`` in torch/distributed/distributed_c10d.py),
which raises "RuntimeError: Numpy is not available" without numpy. compile_shard does
not depend on numpy; the ``test`` extra installs it, and those tests skip where it is
missing. Full state dicts that every rank reads need no numpy.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from compile_shard import fully_shard
from compile_shard.models import Llama, LlamaConfig
from dist_utils import build_sharded_llama, dcp_exchange_both_ways, global_batch, lm_loss, run_gloo
from test_fsdp_module import _dim_1_model

CONFIG = LlamaConfig(dim=32, n_layers=2, n_heads=4, ffn_hidden=64, max_seq_len=16)
SEQ = 8
BATCH_PER_RANK = 2
STEPS = 2  # before the checkpoint
LR = 1e-2
SAVED_AT = 2  # the world size of the run that writes the checkpoints
SHARD = {"compile_shard": fully_shard, "torch_fsdp2": torch_fully_shard}
FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
HAS_NUMPY = importlib.util.find_spec("numpy") is not None
needs_numpy = pytest.mark.skipif(
    not HAS_NUMPY, reason="torch 2.13's object collectives decode with Tensor.numpy(); see [Note: DCP needs numpy]"
)


def _probe_loss(model) -> torch.Tensor:
    """The loss on a fixed batch, the same on every rank (see [Note: an exact resumed step])."""
    with torch.no_grad():
        return lm_loss(model, global_batch(STEPS + 1, 1, BATCH_PER_RANK, SEQ, CONFIG.vocab_size))


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()


def _full_params(model) -> dict[str, torch.Tensor]:
    return {name: _full(param) for name, param in model.named_parameters()}


def _full_optimizer_state(model, optimizer) -> dict:
    """AdamW's state by parameter name and its hyperparameters, read from the optimizer itself."""
    return {
        "state": {
            name: {key: _full(value) for key, value in optimizer.state[param].items()}
            for name, param in model.named_parameters()
        },
        "hyperparameters": [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
    }


def _assert_equal(actual, expected, where: str = "") -> None:
    """Bitwise equality of nested dicts and lists of tensors and plain values."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), (
            f"{where}: keys {sorted(actual) if isinstance(actual, dict) else actual} != {sorted(expected)}"
        )
        for key in expected:
            _assert_equal(actual[key], expected[key], f"{where}.{key}" if where else str(key))
    elif isinstance(expected, (list, tuple)):
        # Either: a full optimizer state dict loads AdamW's ``betas`` back as a list (torch
        # flattens and rebuilds the state dict), which AdamW reads the same way.
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{where}: {actual!r}"
        for index, (a, e) in enumerate(zip(actual, expected)):
            _assert_equal(a, e, f"{where}[{index}]")
    elif isinstance(expected, torch.Tensor):
        actual = _full(actual)
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), (
            f"{where}: {actual.dtype} {tuple(actual.shape)} != {expected.dtype} {tuple(expected.shape)}"
        )
        assert torch.equal(actual, expected), f"{where}: max |diff| {(actual - expected).abs().max().item()}"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def _backward(model, rank: int, world_size: int, step: int) -> None:
    tokens = global_batch(step, world_size, BATCH_PER_RANK, SEQ, CONFIG.vocab_size)
    lm_loss(model, tokens[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]).backward()


def _train_and_save_worker(rank, world_size, folder):
    expected = {}
    for impl, shard in SHARD.items():
        model, _ = build_sharded_llama(CONFIG, shard=shard)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        for step in range(STEPS):
            _backward(model, rank, world_size, step)
            optimizer.step()
            optimizer.zero_grad()

        # Recipes 1 and 5: a DCP checkpoint, each rank writing its own shards.
        state_dict = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        if HAS_NUMPY:
            dcp.save(state_dict, checkpoint_id=os.path.join(folder, f"dcp_{impl}"))
        saved = {"optim_keys": [list(state_dict["optim"]["state"]), state_dict["optim"]["param_groups"][0]["params"]]}

        if impl == "compile_shard":
            # Recipes 2 and 3: full state dicts, on rank 0 only (cpu_offload=True).
            model_state = get_model_state_dict(model, options=FULL_ON_RANK0)
            optim_state = get_optimizer_state_dict(model, optimizer, options=FULL_ON_RANK0)
            if rank == 0:
                torch.save(model_state, os.path.join(folder, "model.pt"))
                torch.save(optim_state, os.path.join(folder, "optim.pt"))
            else:
                assert model_state == {} and optim_state == {}

        saved.update(params=_full_params(model), optim=_full_optimizer_state(model, optimizer))
        # The step after the checkpoint, for [Note: an exact resumed step].
        _backward(model, rank, world_size, STEPS)
        saved["grads"] = {name: _full(param.grad) for name, param in model.named_parameters()}
        optimizer.step()
        saved["params_after_step"] = _full_params(model)
        saved["probe_loss"] = _probe_loss(model)
        expected[impl] = saved
    if rank == 0:
        torch.save(expected, os.path.join(folder, "expected.pt"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("checkpoints"))
    run_gloo(_train_and_save_worker, SAVED_AT, folder)
    return folder


def _expected(folder: str, impl: str) -> dict:
    return torch.load(os.path.join(folder, "expected.pt"))[impl]


def _fresh(shard, parameter_order=list):
    """A sharded model with other initial values than the saved one's, and an AdamW with another
    learning rate (see [Note: an exact resumed step])."""
    model, _ = build_sharded_llama(CONFIG, seed=1, shard=shard)
    return model, torch.optim.AdamW(parameter_order(model.parameters()), lr=10 * LR)


def _check_resumes(model, optimizer, expected) -> None:
    """The loaded state is the saved one, and a step from it is the original run's step."""
    _assert_equal(_full_params(model), expected["params"])
    _assert_equal(_full_optimizer_state(model, optimizer), expected["optim"])
    for name, param in model.named_parameters():
        param.grad = distribute_tensor(expected["grads"][name], param.device_mesh, param.placements)
    optimizer.step()
    optimizer.zero_grad()
    _assert_equal(_full_params(model), expected["params_after_step"])
    _assert_equal(_probe_loss(model), expected["probe_loss"], "probe_loss")


def _dcp_load_worker(rank, world_size, folder, saved_by, loaded_by):
    model, optimizer = _fresh(SHARD[loaded_by])
    # The state dict gives DCP the loader's own shards to read into (it loads in place), so
    # the optimizer state must exist: get_optimizer_state_dict creates it for a fresh one.
    state_dict = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state_dict, checkpoint_id=os.path.join(folder, f"dcp_{saved_by}"))
    set_model_state_dict(model, state_dict["model"])
    set_optimizer_state_dict(model, optimizer, state_dict["optim"])
    _check_resumes(model, optimizer, _expected(folder, saved_by))


@needs_numpy
@pytest.mark.parametrize("world_size", [3, 1])
def test_dcp_resharding(trained, world_size):
    """Recipe 1: a DCP checkpoint saved at world size 2 resumes at 3 and at 1."""
    run_gloo(_dcp_load_worker, world_size, trained, "compile_shard", "compile_shard")


def test_full_model_state_dict_into_plain_model(trained):
    """Recipe 2: rank 0's full model state dict loads into the unsharded model."""
    plain = Llama(CONFIG)
    plain.load_state_dict(torch.load(os.path.join(trained, "model.pt")))
    _assert_equal(dict(plain.named_parameters()), _expected(trained, "compile_shard")["params"])


def _full_optimizer_load_worker(rank, world_size, folder):
    for broadcast_from_rank0 in (False, True) if HAS_NUMPY else (False,):
        # Keyed by parameter name (recipe 4), the state loads into an optimizer that lists the
        # parameters in another order than the saving one did.
        model, optimizer = _fresh(fully_shard, parameter_order=lambda params: list(params)[::-1])
        reads = rank == 0 or not broadcast_from_rank0
        model_state = torch.load(os.path.join(folder, "model.pt")) if reads else {}
        optim_state = torch.load(os.path.join(folder, "optim.pt")) if reads else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast_from_rank0)
        set_model_state_dict(model, model_state, options=options)
        set_optimizer_state_dict(model, optimizer, optim_state, options=options)
        _check_resumes(model, optimizer, _expected(folder, "compile_shard"))


def test_full_optimizer_state_dict_to_other_world_size(trained):
    """Recipe 3: rank 0's full optimizer state, saved at world size 2, loads at world size 3: read by
    every rank, then (with numpy, [Note: DCP needs numpy]) read by rank 0 and broadcast."""
    run_gloo(_full_optimizer_load_worker, 3, trained)


def test_optimizer_state_keyed_by_parameter_name(trained):
    """Recipe 4: the optimizer state dicts are keyed by the parameters' names, sharded and full."""
    names = [name for name, _ in Llama(CONFIG).named_parameters()]
    assert _expected(trained, "compile_shard")["optim_keys"] == [names, names]
    optim_state = torch.load(os.path.join(trained, "optim.pt"))
    assert [list(optim_state["state"]), optim_state["param_groups"][0]["params"]] == [names, names]


@needs_numpy
def test_dcp_checkpoint_keys_are_parameter_names(trained):
    """Recipe 4: the DCP checkpoint stores the optimizer state under the same names."""
    names = [name for name, _ in Llama(CONFIG).named_parameters()]
    metadata = dcp.FileSystemReader(os.path.join(trained, "dcp_compile_shard")).read_metadata()
    saved = {key for key in metadata.state_dict_metadata if key.startswith("optim.state.")}
    assert saved == {f"optim.state.{name}.{key}" for name in names for key in ("step", "exp_avg", "exp_avg_sq")}


def _exchange_worker(rank, world_size, folder):
    _dcp_load_worker(rank, world_size, folder, "compile_shard", "torch_fsdp2")
    _dcp_load_worker(rank, world_size, folder, "torch_fsdp2", "compile_shard")


@needs_numpy
def test_dcp_exchange_with_torch_fsdp2(trained):
    """Recipe 5: DCP checkpoints move between compile_shard and torch FSDP2 both ways (saved at world
    size 2, loaded at 1: the two need not shard alike either)."""
    run_gloo(_exchange_worker, 1, trained)


def _hsdp_exchange_worker(rank, world_size, folder):
    def build(shard, shape, seed):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        return build_sharded_llama(CONFIG, seed=seed, shard=functools.partial(shard, mesh=mesh))[0]

    hsdp, fsdp2 = build(fully_shard, (2, 1), seed=0), build(torch_fully_shard, (1, 2), seed=1)
    dcp_exchange_both_ways(hsdp, fsdp2, build(torch_fully_shard, (1, 2), seed=2), folder)
    for model in (hsdp, fsdp2):
        assert all(param.placements == (Replicate(), Shard(0)) for param in model.parameters())
    assert tuple(next(hsdp.parameters()).device_mesh.shape) == (2, 1)


@needs_numpy
def test_dcp_exchange_between_hsdp_and_torch_fsdp2_on_another_mesh(tmp_path):
    """Recipe 5 on 2-D meshes: compile_shard HSDP at (2, 1) saves, torch FSDP2 at (1, 2) loads, and back."""
    run_gloo(_hsdp_exchange_worker, 2, str(tmp_path))


def _dim_1_exchange_worker(rank, world_size, folder):
    models = [_dim_1_model(shard) for shard in (fully_shard, torch_fully_shard, torch_fully_shard)]
    dcp_exchange_both_ways(*models, folder)


@needs_numpy
def test_dcp_exchange_of_parameters_sharded_on_dim_1_with_torch_fsdp2(tmp_path):
    """Recipe 5 with Shard(1) parameters: transposed local tensors here ([Note: sharding on another dim])."""
    run_gloo(_dim_1_exchange_worker, 2, str(tmp_path))


# Every path FSDP2 loads a model state dict through, eager and into a model already
# compiled and stepped, against torch FSDP2 making the same calls.


def _load_full(model, full: dict, how: str, rank: int) -> None:
    """Loads the full state dict ``full`` into the sharded ``model`` the way ``how`` names."""
    if how == "set_model_state_dict":
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
    elif how == "broadcast_from_rank0":
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full if rank == 0 else {}, options=options)
    else:  # DTensors of the sharded parameters' layout, copied in or assigned (FSDP2's tutorial)
        sharded = {
            name: distribute_tensor(full[name], param.device_mesh, param.placements)
            for name, param in model.state_dict().items()
        }
        assign = how == "load_state_dict_assign"
        if assign:
            sharded = {name: torch.nn.Parameter(tensor) for name, tensor in sharded.items()}
        model.load_state_dict(sharded, strict=False, assign=assign)


def _state_dict_load_worker(rank, world_size, how, backend):
    """Ours (run by ``backend``) and torch FSDP2 (eager) train, load the same full state dict, train on: bitwise."""
    from dist_utils import assert_gradients_match, counted_step

    models = {impl: build_sharded_llama(CONFIG, shard=SHARD[impl])[0] for impl in SHARD}
    runs = dict(models)
    if backend is not None:
        runs["compile_shard"] = torch.compile(models["compile_shard"], backend=backend)
    full = {name: 2 * tensor for name, tensor in Llama(CONFIG).state_dict().items()}  # values neither trained to

    def train(steps: range, optimizers) -> None:
        for step in steps:
            tokens = global_batch(step, world_size, BATCH_PER_RANK, SEQ, CONFIG.vocab_size)
            tokens = tokens[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]
            for run in runs.values():
                counted_step(run, tokens)
            assert_gradients_match(models["compile_shard"], models["torch_fsdp2"])
            for optimizer in optimizers.values():
                optimizer.step()
                optimizer.zero_grad()

    optimizers = {impl: torch.optim.AdamW(model.parameters(), lr=LR) for impl, model in models.items()}
    train(range(2), optimizers)
    for model in models.values():
        _load_full(model, dict(full), how, rank)  # set_model_state_dict writes into the dict it gets
    for impl, model in models.items():
        for name, param in model.named_parameters():
            assert isinstance(param, torch.nn.Parameter) and isinstance(param, DTensor), (impl, name, type(param))
            assert torch.equal(param.full_tensor(), full[name]), (impl, name)
    if how == "load_state_dict_assign":  # the parameters were replaced: a new optimizer, as with FSDP2
        optimizers = {impl: torch.optim.AdamW(model.parameters(), lr=LR) for impl, model in models.items()}
    train(range(2, 4), optimizers)
    for name, param in models["compile_shard"].named_parameters():
        other = dict(models["torch_fsdp2"].named_parameters())[name]
        assert torch.equal(param.full_tensor(), other.full_tensor()), name


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    "how",
    [
        "set_model_state_dict",
        pytest.param("broadcast_from_rank0", marks=needs_numpy),
        "load_state_dict_copy",
        "load_state_dict_assign",
    ],
)
def test_loading_a_full_state_dict_into_a_trained_model_matches_torch_fsdp2(how, backend):
    run_gloo(_state_dict_load_worker, 2, how, backend)


def test_assigning_a_plain_tensor_to_a_sharded_parameter_names_it_and_the_fix():
    from dist_utils import FakeProcessGroup

    with FakeProcessGroup(2):
        model = fully_shard(torch.nn.Linear(4, 4))
        with pytest.raises(ValueError, match=r"parameter 'weight' must be a torch.float32 DTensor .* distribute_tensor"):
            model.load_state_dict({"weight": torch.zeros(4, 4)}, strict=False, assign=True)
