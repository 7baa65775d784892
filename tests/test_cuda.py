"""The CUDA path on one GPU: the runtime and the compiled graphs train like the unsharded model and torch FSDP2.

One GPU holds one rank, so the group is NCCL with world size 1. A group of one rank
issues no collective, as in FSDP2 ([Note: a group of one rank] in compile_shard.ops):
these run the ``fsdp`` ops' CUDA kernels (copy-in with its casts, the reductions'
arithmetic) and, compiled, Inductor's Triton kernels for them. The other tests cover
sharding across ranks on CPU; these are skipped where torch sees no GPU.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from compile_shard import fully_shard
from compile_shard.models import Llama, LlamaConfig
from dist_utils import global_batch, lm_loss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def nccl_world_of_one():
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    yield device
    dist.destroy_process_group()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_training_on_one_gpu_matches_the_unsharded_model(nccl_world_of_one, fresh_dynamo, compiled):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layers=2)).to(nccl_world_of_one)
    reference = copy.deepcopy(model)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    run = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for step in range(3):
        tokens = global_batch(step, 1, 2, 16, 1001).to(nccl_world_of_one)
        loss = lm_loss(run, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected = lm_loss(reference, tokens)
        expected.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        # Inductor's fused kernels reduce in another order than eager aten: fp32 rounding.
        torch.testing.assert_close(loss, expected, rtol=0, atol=2e-5 if compiled else 1e-6)
    if compiled:
        assert counters["stats"]["unique_graphs"] == 1
        assert sum(counters["graph_break"].values()) == 0
    else:  # AdamW's normalized steps amplify last-bit gradient differences: parameters compared eagerly only
        sharded = dict(model.named_parameters())
        for name, parameter in reference.named_parameters():
            torch.testing.assert_close(sharded[name].full_tensor(), parameter, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_bf16_mixed_precision_on_one_gpu_matches_torch_fsdp2(nccl_world_of_one, fresh_dynamo, compiled):
    """The CUDA copy-in casts to bf16 and the reduction runs in fp32, as in torch FSDP2 with the same policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layers=2)).to(nccl_world_of_one)
    torch_model = copy.deepcopy(model)
    for shard, sharded in ((fully_shard, model), (torch_fully_shard, torch_model)):
        for block in sharded.layers:
            shard(block, mp_policy=policy)
        shard(sharded, mp_policy=policy)
    run = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch_optimizer = torch.optim.AdamW(torch_model.parameters(), lr=1e-3)
    for step in range(3):
        tokens = global_batch(step, 1, 2, 16, 1001).to(nccl_world_of_one)
        losses = []
        for forward, opt in ((run, optimizer), (torch_model, torch_optimizer)):
            loss = lm_loss(forward, tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        loss, expected = losses
        print(f"step {step}: loss {loss.item():.6f}, torch FSDP2 {expected.item():.6f}")
        # Inductor fuses the bf16 casts into its kernels and rounds bf16 intermediates differently from eager.
        torch.testing.assert_close(loss, expected, rtol=0, atol=2e-2 if compiled else 0)
    if compiled:
        assert counters["stats"]["unique_graphs"] == 1
        assert sum(counters["graph_break"].values()) == 0
    else:
        theirs = dict(torch_model.named_parameters())
        for name, parameter in model.named_parameters():
            assert parameter.dtype == torch.float32
            torch.testing.assert_close(parameter.full_tensor(), theirs[name].full_tensor(), rtol=0, atol=0, msg=name)


def test_a_model_built_on_the_cpu_moves_to_the_mesh_device_as_in_torch_fsdp2(nccl_world_of_one, fresh_dynamo):
    """FSDP2's usual initialization: build on the CPU, and fully_shard moves parameters and buffers to the GPU."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layers=2))
    torch_model = copy.deepcopy(model)
    for shard, sharded in ((fully_shard, model), (torch_fully_shard, torch_model)):
        for block in sharded.layers:
            shard(block)
        shard(sharded)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert tensor.device == nccl_world_of_one, name
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch_optimizer = torch.optim.AdamW(torch_model.parameters(), lr=1e-3)
    for step in range(3):
        tokens = global_batch(step, 1, 2, 16, 1001).to(nccl_world_of_one)
        for forward, opt in ((model, optimizer), (torch_model, torch_optimizer)):
            lm_loss(forward, tokens).backward()
            opt.step()
            opt.zero_grad()
    theirs = dict(torch_model.named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.full_tensor(), theirs[name].full_tensor(), rtol=0, atol=0, msg=name)


def test_cpu_offload_on_a_cuda_mesh_is_not_implemented(nccl_world_of_one):
    from torch.distributed.fsdp import CPUOffloadPolicy

    with pytest.raises(NotImplementedError, match=r"fully_shard\(Linear\): CPUOffloadPolicy on a cuda mesh"):
        fully_shard(torch.nn.Linear(4, 4), offload_policy=CPUOffloadPolicy())
