"""torch.distributed.fsdp's API on compile_shard's modules: the FSDPModule type, its methods, fully_shard's arguments.

Each implemented name makes the same calls on torch's ``fully_shard`` and on
compile_shard's, on the same model and data, and compares gradients and parameters
(bitwise in eager at world size 2). Each name that is not implemented raises
``NotImplementedError`` (docs/api.md has the table).
"""

import copy
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, UnshardHandle
from torch.distributed.fsdp import register_fsdp_forward_method, share_comm_ctx
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from compile_shard import fully_shard
from compile_shard._param import _sharded_dtensor
from compile_shard.debug import CollectiveCounter
from compile_shard.models import Llama, LlamaConfig
from dist_utils import (
    FakeProcessGroup,
    assert_gradients_match,
    build_sharded_llama,
    global_batch,
    lm_loss,
    run_gloo,
)
from graph_utils import CapturingBackend, op_counts


@pytest.fixture
def fake_pg():
    with FakeProcessGroup(2):
        yield


# The FSDPModule type ---------------------------------------------------------------------


def test_modules_are_torch_fsdp_modules(fake_pg):
    model, _ = build_sharded_llama(LlamaConfig())
    found = [name for name, module in model.named_modules() if isinstance(module, TorchFSDPModule)]
    assert found == ["", "layers.0", "layers.1"]


def test_slicing_a_sharded_container_builds_the_users_class(fake_pg):
    blocks = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(blocks)
    head = blocks[:1]
    assert type(head) is nn.Sequential and not isinstance(head, TorchFSDPModule)


def test_deepcopy_keeps_a_sharded_model(fake_pg):
    model, _ = build_sharded_llama(LlamaConfig())
    copied = copy.deepcopy(model)
    assert type(copied) is type(model) and isinstance(copied.layers[0], TorchFSDPModule)
    tokens = torch.randint(0, 1001, (1, 9))
    torch.testing.assert_close(lm_loss(copied, tokens), lm_loss(model, tokens), rtol=0, atol=0)


# Gradient reduction: a framework that averages over the global token count itself -------


def _token_mean_worker(rank, world_size, backend):
    """Plays torchtitan: loss summed over tokens / global token count, divide factor 1.0 on every FSDP module."""
    config = LlamaConfig()
    ours, reference = build_sharded_llama(config)
    theirs, _ = build_sharded_llama(config, shard=torch_fully_shard)
    for model in (ours, theirs):
        for module in model.modules():
            if isinstance(module, TorchFSDPModule):
                module.set_gradient_divide_factor(1.0)
                if model is theirs:
                    # gloo has no PREMUL_SUM: torch FSDP2 needs a plain sum there; the numbers are the same.
                    module.set_force_sum_reduction_for_comms(True)
    runnable = ours if backend is None else torch.compile(ours, backend=backend)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs, reference)]
    for step in range(3):
        tokens = global_batch(step, world_size, 2, 8, config.vocab_size)
        local = tokens[2 * rank : 2 * rank + 2]
        global_tokens = tokens[:, 1:].numel()
        for model, optimizer in zip((runnable, theirs), optimizers):
            _token_sum_loss(model, local, global_tokens).backward()
        _token_sum_loss(reference, tokens, global_tokens).backward()
        for (name, param), theirs_param, ref in zip(ours.named_parameters(), theirs.parameters(), reference.parameters()):
            atol = 0.0 if backend is None else 1e-6
            torch.testing.assert_close(param.grad.full_tensor(), theirs_param.grad.full_tensor(), rtol=0, atol=atol, msg=name)
            torch.testing.assert_close(param.grad.full_tensor(), ref.grad, rtol=0, atol=1e-6, msg=name)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def _token_sum_loss(model, tokens, global_tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum") / global_tokens


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_framework_dividing_by_global_tokens_gets_torch_fsdp2_gradients(backend):
    run_gloo(_token_mean_worker, 2, backend)


def _divide_factor_worker(rank, world_size, backend):
    """Each setting FSDP2 runs on gloo, bitwise; the PREMUL_SUM factor gloo lacks, against the reference.

    Compiled: a pre-multiplied average and a forced sum with a post-division.
    """
    settings = [(None, False), (2.0, False), (None, True), (1.0, True), (4.0, True), (3.0, False)]
    atol = 0.0
    if backend is not None:
        settings, atol = [(3.0, False), (4.0, True)], 1e-6
    for factor, force_sum in settings:
        ours, reference = build_sharded_llama(LlamaConfig())
        theirs, _ = build_sharded_llama(LlamaConfig(), shard=torch_fully_shard)
        for model in (ours, theirs):
            for module in model.modules():
                if isinstance(module, TorchFSDPModule):
                    if factor is not None:
                        module.set_gradient_divide_factor(factor)
                    module.set_force_sum_reduction_for_comms(force_sum)
        tokens = global_batch(0, world_size, 2, 8, 1001)
        models = (ours, theirs) if factor in (None, 1.0, 2.0, 4.0) else (ours,)
        for model in models:
            runnable = model if model is theirs or backend is None else torch.compile(model, backend=backend)
            lm_loss(runnable, tokens[2 * rank : 2 * rank + 2]).backward()
        sum(lm_loss(reference, tokens[2 * r : 2 * r + 2]) for r in range(world_size)).backward()
        divisor = world_size if factor is None else factor
        for (name, param), ref in zip(ours.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad.full_tensor(), ref.grad / divisor, rtol=1e-5, atol=1e-7, msg=name)
        if len(models) == 2:
            for (name, param), other in zip(ours.named_parameters(), theirs.parameters()):
                torch.testing.assert_close(param.grad.full_tensor(), other.grad.full_tensor(), rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_gradient_divide_factor_and_force_sum_match_torch_fsdp2(backend):
    run_gloo(_divide_factor_worker, 2, backend)


def test_a_new_divide_factor_recompiles(fake_pg):
    model, _ = build_sharded_llama(LlamaConfig(n_layers=1))
    compiled = torch.compile(model, backend="aot_eager")
    tokens = torch.randint(0, 1001, (1, 9))
    lm_loss(compiled, tokens).backward()
    before = model.layers[0].attention.wq.weight.grad.to_local().clone()
    for module in model.modules():
        if isinstance(module, TorchFSDPModule):
            module.set_gradient_divide_factor(0.5)
    for param in model.parameters():
        param.grad = None
    lm_loss(compiled, tokens).backward()
    # The fake process group's reduce-scatter returns the input's rows whatever its op:
    # averaging (in the collective) leaves them as they are, a factor of 0.5 multiplies
    # them by 2 before the sum.
    torch.testing.assert_close(model.layers[0].attention.wq.weight.grad.to_local(), 2 * before)


# Forward methods, async unshard, recovery -------------------------------------------------


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.encode(x))

    def encode(self, x):
        return torch.tanh(self.proj(x))


def _forward_method_worker(rank, world_size, backend):
    torch.manual_seed(0)
    models = [Encoder() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    for model, shard in zip(models, (fully_shard, torch_fully_shard)):
        shard(model)
        register_fsdp_forward_method(model, "encode")
    encode = models[0].encode if backend is None else torch.compile(models[0].encode, backend=backend)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    for step in range(2):
        encode(x).square().sum().backward()
        models[1].encode(x).square().sum().backward()
    atol = 0.0 if backend is None else 1e-6
    for (name, ours), theirs in zip(models[0].named_parameters(), models[1].parameters()):
        if name.startswith("proj"):
            torch.testing.assert_close(ours.grad.full_tensor(), theirs.grad.full_tensor(), rtol=0, atol=atol, msg=name)
        else:  # unused by ``encode``
            assert theirs.grad is None and ours.grad is None, name


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_register_fsdp_forward_method_matches_torch_fsdp2(backend):
    run_gloo(_forward_method_worker, 2, backend)


def test_async_unshard_returns_a_handle_and_forward_gathers_no_more(fake_pg):
    model, _ = build_sharded_llama(LlamaConfig())
    tokens = torch.randint(0, 1001, (1, 9))
    with CollectiveCounter() as baseline:
        lm_loss(model, tokens).backward()
    handle = model.layers[0].unshard(async_op=True)
    assert isinstance(handle, UnshardHandle)
    handle.wait()
    assert not isinstance(model.layers[0].attention.wq.weight, DTensor)
    with CollectiveCounter() as counter:
        lm_loss(model, tokens).backward()
    assert counter.counts["all_gather"] == baseline.counts["all_gather"] - 1
    assert model.layers[0].unshard(async_op=False) is None


def test_reset_iter_state_recovers_after_a_failed_forward(fake_pg):
    model, _ = build_sharded_llama(LlamaConfig())
    tokens = torch.randint(0, 1001, (1, 9))

    def fail(module, args):
        raise RuntimeError("injected")

    hook = model.layers[1].attention.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="injected"):
        lm_loss(model, tokens)
    assert not isinstance(model.layers[1].attention.wq.weight, DTensor)  # left unsharded mid-forward
    with pytest.raises(RuntimeError, match="not the root"):
        model.layers[0].reset_iter_state()
    model.reset_iter_state()
    assert all(isinstance(param, DTensor) for param in model.parameters())
    assert isinstance(model.layers[1].attention.wq.weight, DTensor)
    hook.remove()
    with CollectiveCounter() as counter:
        lm_loss(model, tokens).backward()
    assert counter.counts["all_gather"] > 0 and counter.counts["reduce_scatter"] == 3


def _accepted_knobs_worker(rank, world_size, backend):
    """FSDP2's stream and buffer knobs change nothing compile_shard computes: the same calls on both, bitwise.

    Each is FSDP2's control of its CUDA streams or buffers (compile_shard's eager
    reductions complete inside each backward, and Inductor plans compiled buffers), or
    of HSDP's all-reduce, which a 1-D mesh does not run; set on both, gradients and
    collectives stay torch FSDP2's.
    """
    config = LlamaConfig(n_layers=2)
    models = [build_sharded_llama(config, shard=shard)[0] for shard in (fully_shard, torch_fully_shard)]
    runnables = [models[0] if backend is None else torch.compile(models[0], backend=backend), models[1]]
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in models]
    for model in models:
        share_comm_ctx(list(model.layers))
        model.set_requires_all_reduce(False)
        model.set_reduce_scatter_max_input_buffers(2)
    for step in range(3):
        tokens = global_batch(step, world_size, 2, 8, config.vocab_size)[2 * rank : 2 * rank + 2]
        counts, grads = [], []
        for model, runnable, optimizer in zip(models, runnables, optimizers):
            model.set_is_last_backward(step == 2)
            with CollectiveCounter() as counter:
                lm_loss(runnable, tokens).backward()
            counts.append(dict(counter.counts))
            grads.append([param.grad.full_tensor() for param in model.parameters()])
            optimizer.step()
            optimizer.zero_grad()
            model.set_post_optim_event(torch.Event("cpu"))
        if backend is None:
            assert counts[0] == counts[1], (step, counts)
        for ours, theirs in zip(*grads):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0 if backend is None else 1e-6)


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_share_comm_ctx_and_accepted_knobs_leave_torch_fsdp2s_gradients(backend):
    run_gloo(_accepted_knobs_worker, 2, backend)


def test_accepted_knobs_refuse_what_torch_fsdp2_refuses(fake_pg):
    model, _ = build_sharded_llama(LlamaConfig())
    for bad, error in ((True, TypeError), (0, ValueError)):
        with pytest.raises(error):
            model.set_reduce_scatter_max_input_buffers(bad)
    with pytest.raises(ValueError, match="should be a bool"):
        model.set_reshard_after_forward(1)


def _lifecycle_worker(rank, world_size, backend):
    """unshard, reshard, prefetch lists and set_reshard_after_forward: the same calls on both, step by step.

    Compiled, the collectives are the graphs' (lowered, and gathered in graph whatever
    was gathered before), so only the gradients are compared.
    """
    config = LlamaConfig(n_layers=3)
    models = [build_sharded_llama(config, shard=shard)[0] for shard in (fully_shard, torch_fully_shard)]
    runnables = [models[0] if backend is None else torch.compile(models[0], backend=backend), models[1]]
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in models]
    for model in models:
        layers = list(model.layers)
        for block, following in zip(layers, layers[1:]):
            block.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([block])
    for step in range(4):
        tokens = global_batch(step, world_size, 2, 8, config.vocab_size)[2 * rank : 2 * rank + 2]
        counts, grads = [], []
        for model, runnable, optimizer in zip(models, runnables, optimizers):
            if step == 2:
                model.set_reshard_after_forward(False)
            with CollectiveCounter() as counter:
                if step == 1:
                    model.unshard()  # the root, gathered ahead of its forward
                with torch.no_grad():
                    lm_loss(runnable, tokens)  # an evaluation forward...
                for module in model.modules():
                    if isinstance(module, TorchFSDPModule):
                        module.reshard()  # ...whose gathered parameters are freed by hand
                lm_loss(runnable, tokens).backward()
            counts.append((dict(counter.counts), dict(counter.bytes)))
            grads.append([param.grad.full_tensor() for param in model.parameters()])
            optimizer.step()
            optimizer.zero_grad()
        if backend is None:
            assert counts[0] == counts[1], (step, counts)
        for ours, theirs in zip(*grads):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0 if backend is None else 1e-6)


@pytest.mark.parametrize("backend", [None, pytest.param("aot_eager", marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_unshard_reshard_and_prefetch_match_torch_fsdp2_call_for_call(backend):
    run_gloo(_lifecycle_worker, 2, backend)


def _unshard_in_backward_worker(rank, world_size, backend):
    """An embedding whose backward reads no weight: no all-gather for it in backward, eager or compiled."""
    models, counts = [], []
    for shard in (fully_shard, torch_fully_shard):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
        shard(model[0])
        model[0].set_unshard_in_backward(False)
        shard(model)
        models.append(model)
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(rank))
    runnables = [models[0] if backend is None else torch.compile(models[0], backend=backend), models[1]]
    for model in runnables:
        with CollectiveCounter() as counter:
            model(tokens).square().mean().backward()
        counts.append(counter.counts)
    # Compiled on gloo, a reduce-scatter is an all-to-all ([Note: gloo reduce-scatter] in compile_shard.ops).
    reductions = "reduce_scatter" if backend is None else "all_to_all"
    assert counts[0] == {"all_gather": 2, reductions: 2} and counts[1] == {"all_gather": 2, "reduce_scatter": 2}, counts
    for (name, param), other in zip(models[0].named_parameters(), models[1].parameters()):
        atol = 0 if backend is None else 1e-6
        torch.testing.assert_close(param.grad.full_tensor(), other.grad.full_tensor(), rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_set_unshard_in_backward_false_gathers_nothing_in_backward_as_in_torch_fsdp2(backend):
    run_gloo(_unshard_in_backward_worker, 2, backend)


# fully_shard's arguments -----------------------------------------------------------------


class _Tower(nn.Module):
    """Blocks, then a norm and a head that frameworks shard as one group: ``fully_shard([norm, head])``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 10)
        self.blocks = nn.Sequential(nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 10))
        self.norm = nn.LayerNorm(10)
        self.head = nn.Linear(10, 5)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.embed(x))))


def _all_reduce_hook_worker(rank, world_size, backend, with_comms=False):
    """A hook that records and halves each group's reduced gradient: FSDP2's calls, inputs and gradients.

    Two steps, each with fresh records: a compiled backward calls the hook in every
    step. ``with_comms``: custom comms too, under a bf16 policy (bf16 gathers, fp32
    reductions), called as FSDP2 calls them.
    """
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if with_comms else None
    models, seen, comms = [], [], []
    for shard in (fully_shard, torch_fully_shard):
        torch.manual_seed(0)
        model = Llama(LlamaConfig())
        for block in [*model.layers, model]:
            shard(block, **({} if policy is None else {"mp_policy": policy}))
        calls, comm_pair = {}, (CountingAllGather(), CountingReduceScatter())

        def hook(reduced, calls=calls, name=""):
            calls[name] = reduced.clone()
            reduced.mul_(0.5)

        for name, module in model.named_modules():
            if isinstance(module, TorchFSDPModule):
                module.set_all_reduce_hook(lambda reduced, name=name, hook=hook: hook(reduced, name=name))
                if with_comms:
                    module.set_custom_all_gather(comm_pair[0])
                    module.set_custom_reduce_scatter(comm_pair[1])
        models.append(model)
        seen.append(calls)
        comms.append(comm_pair)
    runnables = [models[0] if backend is None else torch.compile(models[0], backend=backend), models[1]]
    for step in range(2):
        tokens = global_batch(step, world_size, 2, 8, LlamaConfig().vocab_size)[2 * rank : 2 * rank + 2]
        for runnable, calls in zip(runnables, seen):
            calls.clear()
            lm_loss(runnable, tokens).backward()
        assert seen[0].keys() == seen[1].keys() == {"", "layers.0", "layers.1"}, step
        for name, reduced in seen[0].items():
            assert reduced.dtype == torch.float32, name
            torch.testing.assert_close(reduced, seen[1][name], rtol=0, atol=0, msg=name)
        for (name, param), other in zip(models[0].named_parameters(), models[1].parameters()):
            torch.testing.assert_close(param.grad.to_local(), other.grad.to_local(), rtol=0, atol=0, msg=name)
            param.grad = other.grad = None
    for ours, theirs in zip(*comms):
        assert Counter(ours.calls) == Counter(theirs.calls), (ours.calls, theirs.calls)
    if with_comms:
        assert {dtype for kind, _, dtype in comms[0][0].calls if kind == "allocate"} == {torch.bfloat16}


@pytest.mark.parametrize(
    "backend, with_comms",
    [(None, False), ("aot_eager", False), (None, True), ("aot_eager", True)],
    ids=["eager", "compiled", "eager_with_comms_bf16", "compiled_with_comms_bf16"],
)
def test_all_reduce_hook_sees_and_changes_what_torch_fsdp2_hooks_see(backend, with_comms):
    run_gloo(_all_reduce_hook_worker, 2, backend, with_comms)


class CountingAllGather:
    """FSDP2's ``AllGather`` protocol around ``dist.all_gather_into_tensor``, counting its calls."""

    def __init__(self):
        self.calls = []

    def allocate(self, size, *, dtype, device):
        self.calls.append(("allocate", tuple(size), dtype))
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls.append(("all_gather", output_tensor.numel(), input_tensor.numel()))
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter(CountingAllGather):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls.append(("reduce_scatter", output_tensor.numel(), input_tensor.numel(), op))
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _custom_comms_worker(rank, world_size, backend):
    """Custom comms on every module: FSDP2's calls to them, its gradients and parameters, over two steps.

    Compiled, the calls are the same but their order is the schedule's.
    """
    models, comms = [], []
    for shard in (fully_shard, torch_fully_shard):
        model, _ = build_sharded_llama(LlamaConfig(), shard=shard)
        comm_pair = (CountingAllGather(), CountingReduceScatter())
        for module in model.modules():
            if isinstance(module, TorchFSDPModule):
                module.set_custom_all_gather(comm_pair[0])
                module.set_custom_reduce_scatter(comm_pair[1])
        models.append(model)
        comms.append(comm_pair)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in models]
    runnables = [models[0] if backend is None else torch.compile(models[0], backend=backend), models[1]]
    for step in range(2):
        tokens = global_batch(step, world_size, 2, 8, LlamaConfig().vocab_size)[2 * rank : 2 * rank + 2]
        for runnable in runnables:
            lm_loss(runnable, tokens).backward()
        for (name, param), other in zip(models[0].named_parameters(), models[1].parameters()):
            torch.testing.assert_close(param.grad.to_local(), other.grad.to_local(), rtol=0, atol=0, msg=name)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for ours, theirs in zip(*comms):
        assert theirs.calls, theirs.calls
        if backend is None:
            assert ours.calls == theirs.calls, (ours.calls, theirs.calls)
        else:
            assert Counter(ours.calls) == Counter(theirs.calls), (ours.calls, theirs.calls)
    for param, other in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(param.to_local(), other.to_local(), rtol=0, atol=0)


@pytest.mark.parametrize(
    "backend, world_size", [(None, 2), ("aot_eager", 2), ("aot_eager", 3)], ids=["eager", "compiled", "compiled_uneven"]
)
def test_custom_all_gather_and_reduce_scatter_are_called_as_torch_fsdp2_calls_them(backend, world_size):
    run_gloo(_custom_comms_worker, world_size, backend)


def _separate_reduce_scatter_group_worker(rank, world_size):
    """FSDP2's gradients eagerly; compiled, the backward reduces on the new group and equals eager."""
    graphs = CapturingBackend()
    models = []
    for shard in (torch_fully_shard, fully_shard, fully_shard):
        model, _ = build_sharded_llama(LlamaConfig(), shard=shard)
        model.set_separate_reduce_scatter_group()
        models.append(model)
    runs = (models[0], models[1], torch.compile(models[2], backend=graphs.backend))
    tokens = global_batch(0, world_size, 2, 8, LlamaConfig().vocab_size)[2 * rank : 2 * rank + 2]
    for run in runs:
        lm_loss(run, tokens).backward()
    for (name, param), *others in zip(models[1].named_parameters(), models[0].parameters(), models[2].parameters()):
        for other in others:
            torch.testing.assert_close(param.grad.to_local(), other.grad.to_local(), rtol=0, atol=0, msg=name)
    shard_group = models[1].layers[0]._get_fsdp_state().group.group_name
    (backward,) = graphs.backward_graphs
    all_to_all = torch.ops._c10d_functional.all_to_all_single.default
    reduction_groups = {node.args[-1] for node in backward.graph.find_nodes(op="call_function", target=all_to_all)}
    assert len(reduction_groups) == 1 and shard_group not in reduction_groups, (shard_group, reduction_groups)


@pytest.mark.skipif(
    not hasattr(TorchFSDPModule, "set_separate_reduce_scatter_group"),
    reason="this torch's FSDP2, the oracle, has no set_separate_reduce_scatter_group",
)
def test_separate_reduce_scatter_group_matches_torch_fsdp2_and_compiles_onto_that_group():
    run_gloo(_separate_reduce_scatter_group_worker, 2)


def _train_tower_against_torch_fsdp2(rank, backend, shard_tower):
    """A ``_Tower`` sharded by ``shard_tower(model, shard)`` with compile_shard's ``fully_shard`` and torch's.

    Three AdamW steps: gradients and parameters bitwise equal eagerly, within 1e-6
    compiled. Returns compile_shard's model and the collectives of the last step, each
    model's.
    """
    models = []
    for shard in (fully_shard, torch_fully_shard):
        torch.manual_seed(0)
        model = _Tower()
        shard_tower(model, shard)
        models.append(model)
    ours, theirs = models
    runnable = ours if backend is None else torch.compile(ours, backend=backend, fullgraph=True)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    atol = 0.0 if backend is None else 1e-6
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        counts = []
        for model in (runnable, theirs):
            with CollectiveCounter() as counter:
                model(x).square().mean().backward()
            counts.append(counter.counts)
        for (name, param), other in zip(ours.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(param.grad.full_tensor(), other.grad.full_tensor(), rtol=0, atol=atol, msg=name)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for (name, param), other in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(param.full_tensor(), other.full_tensor(), rtol=0, atol=atol, msg=name)
    return ours, counts


def _shard_as_a_list(model, shard):
    shard(model.blocks[0])
    shard(model.blocks[2])
    shard([model.norm, model.head])
    shard(model)


def _list_worker(rank, world_size, backend):
    ours, counts = _train_tower_against_torch_fsdp2(rank, backend, _shard_as_a_list)
    if backend is None:  # compiled gloo graphs lower reduce-scatters to all-to-alls
        assert counts[0] == counts[1], counts
    assert ours.norm._get_fsdp_state().group.settings.module_name == "norm+head"


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_a_list_of_modules_is_one_group_as_in_torch_fsdp2(backend):
    run_gloo(_list_worker, 2, backend)


def _ignored_params_worker(rank, world_size, backend):
    models = []
    for shard in (fully_shard, torch_fully_shard):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
        shard(model, ignored_params={model[2].bias})
        models.append(model)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    (ours, theirs) = models
    for model in (ours if backend is None else torch.compile(ours, backend=backend, fullgraph=True), theirs):
        model(x).square().sum().backward()
    assert not isinstance(ours[2].bias, DTensor) and not isinstance(theirs[2].bias, DTensor)
    for (name, param), other in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(_full(param.grad), _full(other.grad), rtol=0, atol=0, msg=name)


def _full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_ignored_params_stay_local_as_in_torch_fsdp2(backend):
    run_gloo(_ignored_params_worker, 2, backend)


def test_arguments_that_mean_what_compile_shard_does_are_accepted(fake_pg):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0], mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy())
    fully_shard(model[1], mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))
    fully_shard(model, shard_placement_fn=lambda param: Shard(0))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(shard_placement_fn=lambda param: Shard(1) if param.dim() == 2 else None), "must be even"),
        (dict(shard_placement_fn=lambda param: Replicate()), "return Shard"),
    ],
    ids=["uneven_shard_1", "replicate"],
)
def test_arguments_not_supported_yet_raise(fake_pg, kwargs, message):
    with pytest.raises(NotImplementedError, match=message):
        fully_shard(nn.Linear(3, 4), **kwargs)


def _shard_with_cpu_offload(model, shard):
    shard(model.blocks, offload_policy=CPUOffloadPolicy(pin_memory=False))
    shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))


def _cpu_offload_worker(rank, world_size, backend):
    _train_tower_against_torch_fsdp2(rank, backend, _shard_with_cpu_offload)


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_cpu_offload_on_a_cpu_mesh_matches_torch_fsdp2(backend):
    """On a CPU mesh everything already lives in CPU memory: CPUOffloadPolicy trains as FSDP2 trains with it."""
    run_gloo(_cpu_offload_worker, 2, backend)


def test_a_shard_in_cpu_memory_stays_there_on_an_accelerator_mesh(fake_pg):
    """[Note: CPU offload]: ``DTensor.from_local`` would copy an offloaded shard or gradient to the mesh's device.

    The offload itself runs on a GPU (``tests/test_cuda.py``); a CUDA mesh is only metadata here.
    """
    local = torch.randn(3, 4)
    sharded = _sharded_dtensor(local, DeviceMesh("cuda", [0, 1]), (Shard(0),), torch.Size((6, 4)), (4, 1))
    assert sharded._local_tensor is local
    assert sharded.device_mesh.device_type == "cuda" and sharded.shape == (6, 4) and sharded.placements == (Shard(0),)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="pins memory where an accelerator is available")
def test_cpu_offload_pinning_memory_without_an_accelerator_fails_as_in_torch_fsdp2(fake_pg):
    errors = []
    for shard in (fully_shard, torch_fully_shard):
        with pytest.raises(RuntimeError) as error:
            shard(nn.Linear(4, 4), offload_policy=CPUOffloadPolicy())
        errors.append(str(error.value))
    assert errors[0] == errors[1], errors


def test_a_shard_dim_out_of_range_is_refused(fake_pg):
    for shard in (fully_shard, torch_fully_shard):  # FSDP2's exception type
        with pytest.raises(AssertionError):
            shard(nn.Linear(4, 4), shard_placement_fn=lambda param: Shard(2))
    with pytest.raises(AssertionError, match=r"gave Shard\(dim=2\) for 'weight', a 2-D parameter"):
        fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda param: Shard(2))


def _shard_on_dim_1(param):
    """Shard(1) for the weights whose columns every world size of the test divides (and Shard(-1), which is 1)."""
    if param.dim() == 2 and param.size(1) % 6 == 0:
        return Shard(1) if param.size(0) % 2 else Shard(-1)
    return None


def _dim_1_model(shard):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 7), nn.Tanh(), nn.Linear(7, 4))
    for module in (model[0], model[2], model):
        shard(module, shard_placement_fn=_shard_on_dim_1)
    return model


def _shard_placement_worker(rank, world_size):
    """Shard(1) beside Shard(0) (uneven at 3 ranks): FSDP2's placements, gradients, parameters; compiled equals eager.

    Bitwise against FSDP2 at 2 ranks. At 3, gloo's reduce-scatter, which FSDP2 calls,
    sums the ranks in an order that depends on where an element lies in the buffer,
    and a Shard(1) gradient lies there transposed ([Note: sharding on another dim]): its
    last bits may differ, as for 4 ranks in [Note: gloo reduce-scatter].
    """
    theirs, ours, compiled_model = _dim_1_model(torch_fully_shard), _dim_1_model(fully_shard), _dim_1_model(fully_shard)
    models = (theirs, ours, compiled_model)
    runs = (theirs, ours, torch.compile(compiled_model, backend="aot_eager"))
    assert [p.placements for p in ours.parameters()] == [p.placements for p in theirs.parameters()]
    assert {p.placements[0] for p in ours.parameters()} == {Shard(0), Shard(1)}
    grad_atol, param_atol = (0.0, 0.0) if world_size == 2 else (1e-6, 1e-5)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in models]
    for step in range(3):
        x = torch.randn(5, 12, generator=torch.Generator().manual_seed(10 * step + rank))
        for run in runs:
            run(x).square().mean().backward()
        others = zip(theirs.parameters(), compiled_model.parameters())
        for (name, param), (other, compiled) in zip(ours.named_parameters(), others):
            grad = param.grad.to_local()
            torch.testing.assert_close(grad, other.grad.to_local(), rtol=0, atol=grad_atol, msg=name)
            torch.testing.assert_close(compiled.grad.to_local(), grad, rtol=0, atol=0, msg=name)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for param, other, compiled in zip(ours.parameters(), theirs.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(param.full_tensor(), other.full_tensor(), rtol=0, atol=param_atol)
        torch.testing.assert_close(compiled.full_tensor(), param.full_tensor(), rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharding_on_dim_1_matches_torch_fsdp2(world_size):
    run_gloo(_shard_placement_worker, world_size)


def test_a_dim_1_sharded_group_is_regathered_in_backward_like_any_other(fake_pg):
    """The transposed copy-out is part of the gather chain that ``reshard`` recomputes: backward gathers again."""
    counts = []
    for placement_fn in (None, _shard_on_dim_1):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 6), nn.Tanh(), nn.Linear(6, 4))
        for module in (model[0], model[2], model):
            fully_shard(module, shard_placement_fn=placement_fn)
        capture = CapturingBackend()
        torch.compile(model, backend=capture.backend)(torch.randn(5, 12)).sum().backward()
        assert len(capture.forward_graphs) == len(capture.backward_graphs) == 1
        counts.append(op_counts(capture.backward_graphs[0].graph)["all_gather"])
    assert counts[0] == counts[1] > 0, counts


def test_process_group_allocation_is_accepted_where_torch_fsdp2_falls_back_and_symmetric_memory_raises(fake_pg):
    """A backend that allocates no tensors (the fake one here, gloo alike): both accept the knob."""
    config = LlamaConfig(n_layers=1)
    models = [build_sharded_llama(config, shard=shard)[0] for shard in (fully_shard, torch_fully_shard)]
    for model in models:
        model.set_allocate_memory_from_process_group_for_comm(True)
        lm_loss(model, torch.randint(0, config.vocab_size, (2, 9))).backward()
    with pytest.raises(NotImplementedError, match="symmetric-memory all-gathers need NCCL on CUDA"):
        models[0].set_symm_mem_for_comm()


def test_a_copied_model_calls_its_own_copies_of_the_hook_and_comms(fake_pg):
    """FSDP2 deep-copies a group's comm objects with the model; the names ops call them by follow."""
    model, _ = build_sharded_llama(LlamaConfig(n_layers=1))
    seen, comm = [], CountingReduceScatter()
    model.set_custom_reduce_scatter(comm)
    model.set_all_reduce_hook(lambda reduced: seen.append("original"))
    copied = copy.deepcopy(model)
    copied.set_all_reduce_hook(lambda reduced: seen.append("copy"))
    tokens = torch.randint(0, 1001, (1, 9))
    lm_loss(model, tokens).backward()
    assert seen == ["original"] and comm.calls
    calls = len(comm.calls)
    lm_loss(copied, tokens).backward()
    assert seen == ["original", "copy"] and len(comm.calls) == calls  # the copy called its own comm


# torch 2.15's FSDPModule names: implemented where compile_shard's behaviour is theirs,
# refused where a setting would be ignored.
needs_torch_2_15_fsdp2 = pytest.mark.skipif(
    not hasattr(TorchFSDPModule, "finalize_backward"), reason="torch FSDP2 has finalize_backward from torch 2.15"
)


def test_manual_backward_finalization_is_set_on_the_root(fake_pg):
    model, _ = build_sharded_llama(LlamaConfig())
    with pytest.raises(RuntimeError, match="must be called on the root fully_shard module, not on TransformerBlock"):
        model.layers[0].set_manual_backward_finalization(False)


def _finalize_worker(rank, world_size):
    """Both finalize by hand after a backward with sync: the same gradients after ``finalize_backward``."""
    ours, _ = build_sharded_llama(LlamaConfig())
    theirs, _ = build_sharded_llama(LlamaConfig(), shard=torch_fully_shard)
    for model in (ours, theirs):
        model.set_manual_backward_finalization(True)
    tokens = global_batch(0, world_size, 2, 8, LlamaConfig().vocab_size)[2 * rank : 2 * rank + 2]
    for model in (ours, theirs):
        lm_loss(model, tokens).backward()
    assert ours.finalize_backward() is None
    handle = ours.finalize_backward(async_op=True)
    assert isinstance(handle, torch.distributed.fsdp.GradientReductionHandle) and handle.wait() is None
    theirs.finalize_backward()
    assert_gradients_match(ours, theirs)


@needs_torch_2_15_fsdp2
def test_finalize_backward_leaves_torch_fsdp2s_gradients():
    run_gloo(_finalize_worker, 2)
