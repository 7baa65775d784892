"""Bad input gets a clear error naming the module or parameter and the fix."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch._dynamo.testing import CompileCounterWithBackend
from torch.distributed.tensor import Shard

from compile_shard import fully_shard
from compile_shard.models import Llama, LlamaConfig
from dist_utils import FakeProcessGroup


@pytest.fixture(autouse=True)
def fake_pg():
    with FakeProcessGroup(4):
        yield


def test_sharding_a_module_twice():
    block = nn.Linear(4, 4)
    fully_shard(block)
    with pytest.raises(AssertionError, match=r"already applied to this Linear; apply it once per module"):
        fully_shard(block)


def test_parameters_still_on_meta_at_first_forward():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    fully_shard(model)  # sharding on meta is fine: it is how large models are initialized
    with pytest.raises(RuntimeError, match=r"parameter '0.weight' is still on the meta device.*to_empty"):
        model(torch.randn(2, 4))


def test_parameters_still_on_meta_at_first_compiled_forward():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    fully_shard(model)
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(RuntimeError, match=r"parameter '0.weight' is still on the meta device.*to_empty"):
        compiled(torch.randn(2, 4))


def test_meta_init_then_to_empty_works():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4, bias=False))
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    out = model(torch.ones(2, 4))
    assert out.shape == (2, 4)
    model.reshard()  # the root keeps its unsharded parameters registered after forward, as FSDP2's does
    assert model[0].weight.full_tensor().shape == (4, 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda.py moves a CPU model onto a CUDA mesh")
def test_a_mesh_on_a_device_this_process_does_not_have():
    model = nn.Linear(4, 4)
    cuda_mesh = DeviceMesh("cuda", list(range(4)))
    with pytest.raises(ValueError, match=r"fully_shard\(Linear\): the mesh covers 'cuda' devices, which this process"):
        fully_shard(model, mesh=cuda_mesh)


def test_mesh_of_more_than_two_dims():
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "replicate", "shard"))
    message = r"expected a 1-D mesh \(FSDP\) or a 2-D .* got a 3-D mesh.*mesh\['dp_replicate'"
    with pytest.raises(ValueError, match=message):
        fully_shard(nn.Linear(4, 4), mesh=mesh)


@pytest.mark.parametrize("shape", [(4, 1), (2, 2)], ids=["shard_dim_of_1", "shard_dim_of_2"])
def test_a_shard_slice_of_an_hsdp_mesh_would_not_sync_replicas(shape):
    """A 1-D slice, mesh["shard"], would reduce within a replica only (or not at all): refused, naming HSDP's mesh."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    message = r"slice of the .* mesh \('replicate', 'shard'\).*never across \['replicate'\].*2-D \(replicate, shard\) mesh"
    with pytest.raises(ValueError, match=message):
        fully_shard(nn.Linear(4, 4), mesh=mesh["shard"])


def test_a_data_parallel_slice_beside_pipeline_stages_is_accepted():
    """A stage's parameters shard over its own ``dp`` slice only, as with FSDP2."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    linear = fully_shard(nn.Linear(4, 4), mesh=mesh["dp"])
    for name, param in linear.named_parameters():
        assert param.device_mesh == mesh["dp"] and param.placements == (Shard(0),), name
        assert param.to_local().shape[0] == 2, name  # 4 rows over the slice's 2 ranks, not the 4 of the mesh


def test_trainable_parameters_of_several_dtypes_in_one_group():
    """FSDP2's rule, checked where FSDP2 checks it (its lazy init): before the first step, AssertionError."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double())
    fully_shard(model)
    message = r"trainable parameters .* one dtype, but got 0.weight: torch.float32; 0.bias: torch.float32; 1.weight"
    with pytest.raises(AssertionError, match=message):
        model(torch.randn(2, 4))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double())
    fully_shard(model[1])  # the documented fix: shard the odd submodule first
    fully_shard(model)


def test_parameter_shared_across_groups():
    model = Llama(LlamaConfig(n_layers=1))
    model.layers[0].feed_forward.w1.weight = model.layers[0].feed_forward.w3.weight
    model.norm.weight = model.layers[0].ffn_norm.weight
    fully_shard(model.layers[0])
    with pytest.raises(ValueError, match=r"parameter 'norm.weight' of RMSNorm is shared with RMSNorm.*fully_shard\(\[module_a, module_b\]\)"):
        fully_shard(model)


@pytest.mark.parametrize(
    "value, message",
    [(3, "it should be a factor of 4, not 3"), (0, "factor of 4, not 0"), ("2", "should be a bool or an int")],
)
def test_invalid_reshard_after_forward_raises_torch_fsdp2s_error(value, message):
    for shard in (fully_shard, torch_fully_shard):
        with pytest.raises(ValueError, match=message):
            shard(nn.Linear(4, 4), reshard_after_forward=value)


def test_reshard_after_forward_ints_mean_what_they_mean_in_torch_fsdp2():
    """The world size is True, 1 is False (with FSDP2's warning), another factor a smaller group to reshard to."""
    assert fully_shard(nn.Linear(4, 4), reshard_after_forward=4)._get_fsdp_state().group.settings.reshard_after_forward
    with pytest.warns(UserWarning, match=r"reshard_after_forward=1 \(int\) means resharding parameters to world size 1"):
        module = fully_shard(nn.Linear(4, 4), reshard_after_forward=1)
    assert not module._get_fsdp_state().group.settings.reshard_after_forward
    group = fully_shard(nn.Linear(4, 4), reshard_after_forward=2)._get_fsdp_state().group
    assert group.settings.reshard_after_forward and group.settings.reshard_group.size == 2
    module = fully_shard(nn.Linear(4, 4), reshard_after_forward=2)
    module.set_reshard_after_forward(True)  # FSDP2: a bool reshards over the whole group again
    assert module._get_fsdp_state().group.settings.reshard_group is None


def test_fully_shard_without_process_group():
    import torch.distributed as dist

    dist.destroy_process_group()
    try:
        with pytest.raises(RuntimeError, match=r"torch.distributed is not initialized"):
            fully_shard(nn.Linear(4, 4))
    finally:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)


class _RaisingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[-1] != 4:
            raise ValueError("expected 4 features")
        return self.linear(x)


def _compile_one_that_raises(case: str) -> None:
    if case == "meta_parameters":
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 4))
        fully_shard(model)
        inputs, error = torch.randn(2, 4), RuntimeError
    else:
        model = nn.Sequential(_RaisingBlock(), nn.Linear(4, 4))
        fully_shard(model[0])
        fully_shard(model)
        inputs, error = torch.randn(2, 5), ValueError
    with pytest.raises(error):
        torch.compile(model, backend="aot_eager")(inputs)


@pytest.mark.parametrize("case", ["meta_parameters", "a_users_raise"])
def test_a_compiled_forward_that_raised_leaves_the_next_model_one_graph(case, fresh_dynamo):
    """[Note: a trace that raised] in compile_shard._api: Dynamo's skip of the root frame is undone."""
    _compile_one_that_raises(case)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layers=2))
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    graphs = CompileCounterWithBackend("aot_eager")
    torch.compile(model, backend=graphs)(torch.randint(0, 100, (2, 9))).sum().backward()
    assert graphs.frame_count == 1, f"{graphs.frame_count} graphs"
