"""The CUDA path on one GPU: the runtime and the compiled graphs train like the unsharded model and torch FSDP2.

One GPU holds one rank, so the group is NCCL with world size 1. A group of one rank
issues no collective, as in FSDP2 ([Note: a group of one rank] in compile_shard.ops):
these run the ``fsdp`` ops' CUDA kernels (copy-in with its casts, the reductions'
arithmetic) and, compiled, Inductor's Triton kernels for them. CPU offload's
compiled collectives run over a fake process group of 2 on the GPU. The other tests
cover sharding across ranks on CPU; these are skipped where torch sees no GPU.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from compile_shard import fully_shard
from compile_shard.models import Llama, LlamaConfig
from dist_utils import (
    FakeProcessGroup,
    assert_gradients_match,
    counted_step,
    global_batch,
    lm_loss,
    step_optimizers_and_compare,
    train_against_torch_fsdp2,
)
from graph_utils import CapturingBackend

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


def _offloaded_llama(shard, mp_policy, pin_memory: bool = True):
    """The test Llama built on the CPU and sharded with CPUOffloadPolicy, blocks and root."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layers=2))
    offload_policy = CPUOffloadPolicy(pin_memory=pin_memory)
    for block in model.layers:
        shard(block, mp_policy=mp_policy, offload_policy=offload_policy)
    shard(model, mp_policy=mp_policy, offload_policy=offload_policy)
    return model


OFFLOAD_POLICIES = {
    "fp32": MixedPrecisionPolicy(),
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
}


@pytest.mark.parametrize("policy", list(OFFLOAD_POLICIES))
def test_cpu_offload_on_a_gpu_matches_torch_fsdp2(nccl_world_of_one, fresh_dynamo, policy):
    """Sharded parameters, gradients and the optimizer's state in pinned CPU memory, compute on the GPU.

    Eager and ``aot_eager`` against torch FSDP2 with the same policies, bitwise, every step
    (``assert_close`` also compares devices: the gradients are on the CPU, as FSDP2's).
    """
    mp_policy = OFFLOAD_POLICIES[policy]
    theirs = _offloaded_llama(torch_fully_shard, mp_policy)
    models = [_offloaded_llama(fully_shard, mp_policy) for _ in range(2)]
    for name, param in models[0].named_parameters():
        assert param.device.type == "cpu" and param.to_local().is_pinned(), name
    for name, buffer in models[0].named_buffers():
        assert buffer.device == nccl_world_of_one, name
    train_against_torch_fsdp2(
        theirs, models, [None, "aot_eager"], lambda step: global_batch(step, 1, 2, 16, 1001).to(nccl_world_of_one)
    )


def test_cpu_offload_of_a_model_built_on_meta_matches_torch_fsdp2(nccl_world_of_one, fresh_dynamo):
    """FSDP2's recipe for a model too large to build: on meta, sharded, ``to_empty(device="cpu")``, then loaded."""
    torch.manual_seed(0)
    reference = Llama(LlamaConfig(n_layers=2))
    models = []
    for shard in (fully_shard, torch_fully_shard):
        with torch.device("meta"):
            model = Llama(LlamaConfig(n_layers=2))
        for block in model.layers:
            shard(block, offload_policy=CPUOffloadPolicy())
        shard(model, offload_policy=CPUOffloadPolicy())
        model.to_empty(device="cpu")
        with torch.no_grad():  # one rank: each local tensor is the whole parameter
            for name, param in model.named_parameters():
                param.to_local().copy_(reference.get_parameter(name))
        model.rope_cos = reference.rope_cos.to(nccl_world_of_one)
        model.rope_sin = reference.rope_sin.to(nccl_world_of_one)
        models.append(model)
    ours, theirs = models
    for name, param in ours.named_parameters():
        assert param.device.type == "cpu" and param.to_local().is_pinned(), name
    train_against_torch_fsdp2(
        theirs, [ours], [None], lambda step: global_batch(step, 1, 2, 16, 1001).to(nccl_world_of_one)
    )


def test_cpu_offload_compiled_with_inductor_on_a_gpu(nccl_world_of_one, fresh_dynamo):
    """Inductor's graphs copy the CPU shards to the GPU and the sharded gradients back: one graph, no break.

    From pageable memory (``pin_memory=False``), where the other tests pin.
    """
    theirs = _offloaded_llama(torch_fully_shard, MixedPrecisionPolicy(), pin_memory=False)
    model = _offloaded_llama(fully_shard, MixedPrecisionPolicy(), pin_memory=False)
    run = torch.compile(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, theirs)]
    for step in range(3):
        tokens = global_batch(step, 1, 2, 16, 1001).to(nccl_world_of_one)
        losses = [lm_loss(forward, tokens) for forward in (run, theirs)]
        for loss, optimizer in zip(losses, optimizers):
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=2e-5)
    assert all(param.device.type == "cpu" for param in model.parameters())
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0


def test_cpu_offload_accumulating_without_sync_matches_torch_fsdp2(nccl_world_of_one, fresh_dynamo):
    """The unsharded gradients accumulate on the GPU while sync is off; the sync micro-batch brings them to the CPU."""
    theirs = _offloaded_llama(torch_fully_shard, MixedPrecisionPolicy())
    models = [_offloaded_llama(fully_shard, MixedPrecisionPolicy()) for _ in range(2)]
    runs = [models[0], torch.compile(models[1], backend="aot_eager")]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (theirs, *models)]
    for step in range(2):
        tokens = global_batch(step, 1, 4, 16, 1001).to(nccl_world_of_one)
        for model, run in ((theirs, theirs), *zip(models, runs)):
            for index, micro_batch in enumerate(tokens.chunk(2)):
                model.set_requires_gradient_sync(index == 1)
                (lm_loss(run, micro_batch) / 2).backward()
        for model in models:
            assert_gradients_match(model, theirs)
        step_optimizers_and_compare(optimizers, models, theirs)
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] <= 2


def test_cpu_offload_compiled_over_a_fake_group_of_two_issues_the_same_collectives(fresh_dynamo):
    """Compiled over a fake group of 2 on the GPU, offloaded shards issue the collectives and bytes of kept ones."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with FakeProcessGroup(2):
        collectives = []
        for offload in (False, True):
            torch.manual_seed(0)
            model = Llama(LlamaConfig(n_layers=2)).to(device)
            policy = CPUOffloadPolicy() if offload else OffloadPolicy()
            for block in model.layers:
                fully_shard(block, offload_policy=policy)
            fully_shard(model, offload_policy=policy)
            run = torch.compile(model)
            for step in range(2):
                collectives.append(counted_step(run, global_batch(step, 1, 2, 16, 1001).to(device)))
            grads = [param.grad for param in model.parameters()]
            assert all(grad.device.type == ("cpu" if offload else "cuda") for grad in grads)
            torch._dynamo.reset()
        assert collectives[:2] == collectives[2:], collectives
        assert collectives[0][0]["all_gather"] > 0 and collectives[0][0]["reduce_scatter"] > 0, collectives


def _copies(graph, source: str, target: str) -> list:
    """The nodes of ``graph`` that copy a tensor on ``source`` to ``target`` (device types)."""

    def device(node) -> str | None:
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        return value.device.type if isinstance(value, torch.Tensor) else None

    return [
        node
        for node in graph.nodes
        if node.op == "call_function" and node.args and device(node.args[0]) == source and device(node) == target
    ]


def test_a_compiled_backward_copies_offloaded_shards_to_the_gpu_again(fresh_dynamo):
    """A resharded group's backward copies its CPU shards to the GPU again, as FSDP2's does, instead of keeping them."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with FakeProcessGroup(2):
        torch.manual_seed(0)
        model = Llama(LlamaConfig(n_layers=2)).to(device)
        for block in model.layers:
            fully_shard(block, offload_policy=CPUOffloadPolicy())
        fully_shard(model, offload_policy=CPUOffloadPolicy())
        backend = CapturingBackend()
        lm_loss(torch.compile(model, backend=backend.backend), global_batch(0, 1, 2, 16, 1001).to(device)).backward()
    (forward,), (backward,) = backend.forward_graphs, backend.backward_graphs
    shards = len(list(model.parameters()))
    resharded = sum(len(list(block.parameters())) for block in model.layers)  # the root keeps its parameters
    copies = ((forward, "cpu", "cuda"), (backward, "cpu", "cuda"), (backward, "cuda", "cpu"))
    counts = [len(_copies(graph.graph, source, target)) for graph, source, target in copies]
    # Host-to-device copies in forward and in backward, device-to-host copies in backward.
    assert counts == [shards, resharded, shards], (counts, shards, resharded)


def test_cpu_offload_of_an_all_gather_extension_is_refused(nccl_world_of_one):
    class Extended(torch.Tensor):
        def fsdp_pre_all_gather(self, mesh):
            return (self,), None

        def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
            return outputs[0], outputs

    linear = torch.nn.Linear(4, 4)
    linear.weight = torch.nn.Parameter(linear.weight.detach().as_subclass(Extended))
    with pytest.raises(NotImplementedError, match=r"'weight' has an all-gather extension .* does not offload"):
        fully_shard(linear, offload_policy=CPUOffloadPolicy())


def test_moving_an_offloaded_module_to_the_gpu_is_refused(nccl_world_of_one):
    linear = fully_shard(torch.nn.Linear(4, 4), offload_policy=CPUOffloadPolicy())
    with pytest.raises(RuntimeError, match=r"'weight' was moved to cuda:0, but CPUOffloadPolicy keeps"):
        linear.to(nccl_world_of_one)
