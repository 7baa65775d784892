"""FSDP2's own behaviour beyond the patterns the clients use, against torch's ``fully_shard``.

Each test makes the same calls on torch's ``fully_shard`` and on compile_shard's, on the
same model and data, and compares what FSDP2 promises: losses, gradients and parameters
(bitwise in eager at two ranks), the parameters registered on the modules at each point
of a step, and the exception type for bad input. Where compile_shard knowingly differs,
the test says so and docs/api.md's table of differences lists it.
"""

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_distributed import MultiThreadedTestCase

from compile_shard import fully_shard
from dist_utils import FakeProcessGroup, run_gloo


SHARDS = {"torch": torch_fully_shard, "ours": fully_shard}


@pytest.fixture
def fake_pg():
    with FakeProcessGroup(2):
        yield


def _raised(call) -> BaseException | None:
    try:
        call()
    except Exception as error:  # noqa: BLE001: the test compares the type
        return error
    return None


def _sharded_pair(base, shard_model, backend=None):
    """Copies of ``base`` sharded by ``shard_model(model, shard)`` with torch's and compile_shard's ``fully_shard``;
    and what runs each: compile_shard's compiled with ``backend``, where one is given, torch's eager (the oracle)."""
    models, runs = {}, {}
    for name, shard in SHARDS.items():
        model = copy.deepcopy(base)
        shard_model(model, shard)
        models[name] = model
        runs[name] = model if backend is None or name == "torch" else torch.compile(model, backend=backend)
    return models, runs


def _assert_gradients_like_torch(models, atol=0.0) -> None:
    """Every local gradient of compile_shard's model equals torch FSDP2's (within ``atol``: 0 in eager)."""
    for (fqn, ours), theirs in zip(models["ours"].named_parameters(), models["torch"].parameters(), strict=True):
        assert ours.grad.dtype == theirs.grad.dtype, (fqn, ours.grad.dtype, theirs.grad.dtype)
        torch.testing.assert_close(ours.grad.to_local(), theirs.grad.to_local(), rtol=0, atol=atol, msg=fqn)


def _step(optimizers) -> None:
    for optimizer in optimizers.values():
        optimizer.step()
        optimizer.zero_grad()



# A weight tied between groups ---------------------------------------------------------


class TiedHead(nn.Module):
    """An embedding whose weight the output projection shares, as language models tie them."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(17, 16)
        self.mid = nn.Linear(16, 16)
        self.output = nn.Linear(16, 17, bias=False)
        self.output.weight = self.embed.weight

    def forward(self, tokens):
        return self.output(torch.relu(self.mid(self.embed(tokens))))


def _untie(model: TiedHead) -> None:
    model.output.weight = nn.Parameter(model.output.weight.detach().clone())


def _shard_each_then_root(model, shard):
    shard(model.embed)
    shard(model.output)
    shard(model)


def _shard_each_reversed_then_root(model, shard):
    shard(model.output)
    shard(model.embed)
    shard(model)


def _shard_embedding_then_root(model, shard):
    shard(model.embed)
    shard(model)


def _shard_output_then_root(model, shard):
    shard(model.output)
    shard(model)


def _tie_between_calls(model, shard):
    _untie(model)
    shard(model.embed)
    model.output.weight = model.embed.weight  # the sharded parameter
    shard(model.output)
    shard(model)


def _tie_after_every_call(model, shard):
    _untie(model)
    _shard_each_then_root(model, shard)
    model.output.weight = model.embed.weight


TYINGS = {
    "two_children": _shard_each_then_root,
    "two_children_reversed": _shard_each_reversed_then_root,
    "child_and_root": _shard_embedding_then_root,
    "root_and_child": _shard_output_then_root,
    "tied_between_calls": _tie_between_calls,
    "tied_after_every_call": _tie_after_every_call,
}


def _tied_step(tying, shard, backend):
    torch.manual_seed(0)
    model = TiedHead()
    TYINGS[tying](model, shard)
    runnable = model if backend is None else torch.compile(model, backend=backend)
    runnable(torch.randint(0, 17, (4, 5))).sum().backward()


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
@pytest.mark.parametrize("tying", TYINGS)
def test_a_weight_tied_between_groups_raises_naming_both_modules(fake_pg, tying, backend):
    """FSDP2 raises ValueError at its first forward where two groups shard one parameter; so does compile_shard,
    at fully_shard where it can, else before the step.

    A tie made after every fully_shard call is the exception: FSDP2's two groups then
    gather and reduce into the same sharded parameter and train it right, which
    compile_shard cannot (docs/api.md, "Where compile_shard differs").
    """
    theirs = _raised(lambda: _tied_step(tying, torch_fully_shard, None))
    ours = _raised(lambda: _tied_step(tying, fully_shard, backend))
    if tying == "tied_between_calls":
        assert theirs is not None  # an internal error of FSDP2's (TypeError) where compile_shard names the tie
    elif tying != "tied_after_every_call":
        assert isinstance(theirs, ValueError), theirs
    assert isinstance(ours, ValueError), ours
    message = str(ours)
    assert "Embedding" in message and ("Linear" in message or "TiedHead" in message), message
    assert "fully_shard([module_a, module_b])" in message


def _tied_in_one_group_worker(rank, world_size, backend):
    torch.manual_seed(0)
    base = TiedHead()
    reference = copy.deepcopy(base)
    models = {}
    for name, shard in SHARDS.items():
        model = copy.deepcopy(base)
        shard([model.embed, model.output])
        shard(model)
        models[name] = model
    runnable = models["ours"] if backend is None else torch.compile(models["ours"], backend=backend)
    tokens = torch.randint(0, 17, (2 * world_size, 5), generator=torch.Generator().manual_seed(1))
    local = tokens.chunk(world_size)[rank]
    models["torch"](local).sum().backward()
    runnable(local).sum().backward()
    (reference(tokens).sum() / world_size).backward()
    for (name, ours), theirs, ref in zip(
        models["ours"].named_parameters(), models["torch"].parameters(), reference.parameters()
    ):
        atol = 0 if backend is None else 1e-6
        torch.testing.assert_close(ours.grad.to_local(), theirs.grad.to_local(), rtol=0, atol=atol, msg=name)
        torch.testing.assert_close(ours.grad.full_tensor(), ref.grad, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_a_weight_tied_within_one_group_trains_as_torch_fsdp2(backend):
    """The fix the error names: the tying modules in one group, one gradient with both contributions."""
    run_gloo(_tied_in_one_group_worker, 2, backend)


# Bad input: FSDP2's exception types ---------------------------------------------------


def _module_list(shard):
    shard(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))


def _module_dict(shard):
    shard(nn.ModuleDict({"proj": nn.Linear(4, 4)}))


def _channels_last(shard):
    shard(nn.Conv2d(4, 8, 3).to(memory_format=torch.channels_last))


def _transposed_weight(shard):
    linear = nn.Linear(4, 6)
    linear.weight = nn.Parameter(torch.randn(4, 6).t())
    shard(linear)


def _twice(shard):
    linear = nn.Linear(4, 4)
    shard(linear)
    shard(linear)


def _same_module_twice_in_a_list(shard):
    linear = nn.Linear(4, 4)
    shard([linear, linear])


class _AllGather:
    """FSDP2's custom all-gather protocol, over torch's collective."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def _allocation_after_a_custom_all_gather(shard):
    linear = nn.Linear(4, 4)
    shard(linear)
    linear.set_custom_all_gather(_AllGather())
    linear.set_allocate_memory_from_process_group_for_comm(True)


BAD_INPUT = {
    "module_list": (_module_list, ValueError),
    "module_dict": (_module_dict, ValueError),
    "channels_last": (_channels_last, NotImplementedError),
    "transposed_weight": (_transposed_weight, NotImplementedError),
    "twice": (_twice, AssertionError),
    "same_module_twice_in_a_list": (_same_module_twice_in_a_list, AssertionError),
    "allocation_after_a_custom_all_gather": (_allocation_after_a_custom_all_gather, AssertionError),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_raises_torch_fsdp2s_exception_type(fake_pg, case):
    call, expected = BAD_INPUT[case]
    for shard in SHARDS.values():
        assert type(_raised(lambda: call(shard))) is expected


def test_an_empty_list_is_a_type_error_where_torch_fsdp2_fails_indexing_it(fake_pg):
    """A documented difference (docs/api.md): FSDP2 fails inside, compile_shard names the argument."""
    assert type(_raised(lambda: torch_fully_shard([]))) is IndexError
    assert type(_raised(lambda: fully_shard([]))) is TypeError


def test_a_2d_mesh_without_dim_names_raises_torch_fsdp2s_exception_type():
    with FakeProcessGroup(4):
        mesh = init_device_mesh("cpu", (2, 2))
        for shard in SHARDS.values():
            assert type(_raised(lambda: shard(nn.Linear(4, 4), mesh=mesh))) is AssertionError


def test_fully_shard_state_is_the_composable_apis_accessor(fake_pg):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard([model[0], model[1]])
    assert fully_shard.state(model[0]) is fully_shard.state(model[1]) is model[0]._get_fsdp_state()
    assert fully_shard.state(model) is None
    assert torch_fully_shard.state(model[0]) is None  # torch's accessor knows torch's states only


# The parameters registered on the modules ----------------------------------------------


def _registered(model) -> list[str]:
    """Each parameter as FSDP2's tests see it: a DTensor or a plain nn.Parameter, with its shape."""
    return [
        ("DTensor" if isinstance(param, DTensor) else type(param).__name__) + str(tuple(param.shape))
        for param in model.parameters()
    ]


def _registration_worker(rank, world_size, reshard_after_forward):
    seen = {}
    for name, shard in SHARDS.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Sequential(nn.Linear(5, 3)))
        shard(model[2], reshard_after_forward=reshard_after_forward)
        shard(model, reshard_after_forward=reshard_after_forward)
        points = [_registered(model)]
        output = model(torch.randn(2, 3))
        points += [_registered(model), type(model[0].weight).__name__]
        output.sum().backward()
        points.append(_registered(model))
        model.unshard()
        points += [_registered(model), type(model[0].weight).__name__]
        model.reshard()
        points.append(_registered(model))
        model.unshard()
        points += [sorted(type(value).__name__ for value in model.state_dict().values()), _registered(model)]
        seen[name] = points
    assert seen["ours"] == seen["torch"]
    if reshard_after_forward is False:  # it saw unsharded parameters
        assert seen["ours"][1] == ["Parameter(5, 3)", "Parameter(5,)", "Parameter(3, 5)", "Parameter(3,)"]


@pytest.mark.parametrize("reshard_after_forward", [True, False, None])
def test_unsharded_parameters_are_registered_when_torch_fsdp2_registers_them(reshard_after_forward):
    """After a forward that keeps them (the root's by default) and after unshard(), until reshard; never in a
    state dict."""
    run_gloo(_registration_worker, 2, reshard_after_forward)


# torch's threaded test process group ----------------------------------------------------


class TestThreadedProcessGroup(MultiThreadedTestCase):
    """What many users' own unit tests run on: ranks as threads of one process (backend "threaded")."""

    @property
    def world_size(self) -> int:
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_threads()

    def test_training_is_torch_fsdp2s_eager_and_compiled(self):
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
        models = {}
        for name, shard in SHARDS.items():
            model = copy.deepcopy(base)
            shard(model[0])
            shard(model)
            models[name] = model
        runs = {"torch": models["torch"], "ours": models["ours"]}
        compiled = torch.compile(models["ours"], backend="aot_eager")
        for step in range(2):
            inputs = torch.randn(2, 4, generator=torch.Generator().manual_seed(step + 10 * dist.get_rank()))
            for run in (runs["torch"], runs["ours"] if step == 0 else compiled):
                run(inputs).sum().backward()
            for ours, theirs in zip(models["ours"].parameters(), models["torch"].parameters()):
                torch.testing.assert_close(ours.grad.to_local(), theirs.grad.to_local(), rtol=0, atol=0)
            for model in models.values():
                model.zero_grad()


# Composing with replicate() --------------------------------------------------------------


class _Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.right = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.left(x) + self.right(x))


def _replicate_worker(rank, world_size, nesting):
    from torch.distributed._composable import replicate

    torch.manual_seed(0)
    base = _Branches()
    losses = {}
    params = {}
    for name, shard in SHARDS.items():
        model = copy.deepcopy(base)
        if nesting == "sharded_inside_replicated":
            shard(model.left)
            shard(model.right[0])
            replicate(model)
        else:
            replicate(model.left)
            shard(model.right)
            shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses[name] = []
        for step in range(3):
            inputs = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))
            loss = model(inputs).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.detach())
        params[name] = [p.to_local() if isinstance(p, DTensor) else p.detach() for p in model.parameters()]
    assert torch.equal(torch.stack(losses["ours"]), torch.stack(losses["torch"]))
    for ours, theirs in zip(params["ours"], params["torch"], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("nesting", ["sharded_inside_replicated", "replicated_inside_sharded"])
def test_replicate_composes_with_fully_shard_as_with_torch_fsdp2(nesting):
    """replicate() leaves sharded subtrees alone, and fully_shard leaves replicated ones (torch's registry)."""
    run_gloo(_replicate_worker, 2, nesting)


# Parameters assigned after fully_shard -----------------------------------------------------


class _Scaled(nn.Module):
    """Two layers and a root parameter that the user computes after sharding, as from other parameters."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.second(torch.relu(self.first(x))) * self.scale


def _assigned_worker(rank, world_size, backend):
    from torch.distributed.tensor import Shard, distribute_tensor

    results = {}
    for name, shard in SHARDS.items():
        with torch.device("meta"):
            model = _Scaled()
        shard(model.first)
        shard(model.second)
        shard(model)
        model.to_empty(device="cpu")
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(distribute_tensor(torch.randn(param.shape, generator=generator), param.device_mesh, [Shard(0)]))
            # Assigned after fully_shard: FSDP2's lazy init takes it as the sharded parameter.
            scale = (model.first.weight.norm(dim=1) + model.second.weight.norm(dim=1)) / 4
        model.scale = nn.Parameter(scale)
        runnable = model if backend is None or name == "torch" else torch.compile(model, backend=backend)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = runnable(inputs).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        results[name] = (torch.stack(losses), [param.to_local() for param in model.parameters()])
    atol = 0 if backend is None else 1e-6
    torch.testing.assert_close(results["ours"][0], results["torch"][0], rtol=0, atol=atol)
    for ours, theirs in zip(results["ours"][1], results["torch"][1], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=atol)


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_a_parameter_assigned_after_fully_shard_on_meta_is_sharded_at_the_first_forward(backend):
    run_gloo(_assigned_worker, 2, backend)


def _two_tensor_worker(rank, world_size, patched_after_fully_shard, mesh_shape):
    """TwoTensor parameters built on meta, materialized with to_empty; an all-gather extension on the class, or set
    on each local tensor after fully_shard (FSDP2 reads it again at its lazy init)."""
    from torch.testing._internal.two_tensor import TwoTensor

    calls = {"pre": 0, "post": 0}

    def pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        calls["pre"] += 1
        return (self.a, self.b), None

    def post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        calls["post"] += 1
        return TwoTensor(*all_gather_outputs), all_gather_outputs

    results = {}
    for name, shard in SHARDS.items():
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.ReLU(), nn.Linear(8, 4, bias=False))
            for layer in (model[0], model[2]):
                layer.weight = nn.Parameter(TwoTensor(layer.weight, layer.weight.clone()))
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")[-len(mesh_shape) :])
        shard(model[0], mesh=mesh)
        shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        generator = torch.Generator().manual_seed(0)
        shards, shard_rank = mesh.size(-1), mesh.get_local_rank(mesh.ndim - 1)
        with torch.no_grad():
            for param in model.parameters():
                rows = torch.randn(param.shape, generator=generator).chunk(shards)[shard_rank] * 0.3
                param.to_local().a.copy_(rows)
                param.to_local().b.copy_(rows)
        for param in model.parameters():
            local = param._local_tensor  # the object itself: to_local() returns a view
            if patched_after_fully_shard:
                local.fsdp_pre_all_gather = pre_all_gather.__get__(local)
                local.fsdp_post_all_gather = post_all_gather.__get__(local)
        calls.update(pre=0, post=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(2):
            loss = model(torch.randn(2, 8, generator=torch.Generator().manual_seed(step + rank))).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        locals_ = [tensor for param in model.parameters() for tensor in (param.to_local().a, param.to_local().b)]
        results[name] = (torch.stack(losses), locals_, dict(calls))
    assert results["ours"][2] == results["torch"][2]
    if patched_after_fully_shard:
        assert results["ours"][2]["pre"] > 0
    torch.testing.assert_close(results["ours"][0], results["torch"][0], rtol=0, atol=0)
    for ours, theirs in zip(results["ours"][1], results["torch"][1], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("patched_after_fully_shard", [False, True], ids=["plain", "extension_set_after"])
def test_tensor_subclass_parameters_initialized_on_meta_train_as_with_torch_fsdp2(patched_after_fully_shard):
    run_gloo(_two_tensor_worker, 2, patched_after_fully_shard, (2,))


def _one_rank_shard_group_worker(rank, world_size):
    from torch.testing._internal.two_tensor import TwoTensor

    def pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self.a, self.b), None

    def post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return TwoTensor(*all_gather_outputs), all_gather_outputs  # TwoTensor needs equal storage offsets

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    linear = nn.Linear(4, 4, bias=False)
    linear.weight = nn.Parameter(TwoTensor(linear.weight.detach(), linear.weight.detach().clone()))
    fully_shard(linear, mesh=mesh)
    local = linear.weight._local_tensor
    local.fsdp_pre_all_gather = pre_all_gather.__get__(local)
    local.fsdp_post_all_gather = post_all_gather.__get__(local)
    linear(torch.randn(2, 4)).sum().backward()


def test_an_extensions_inputs_come_back_as_tensors_of_their_own_where_a_shard_group_has_one_rank():
    """FSDP2 hands fsdp_post_all_gather one tensor per input (a subclass may require equal storage offsets)."""
    run_gloo(_one_rank_shard_group_worker, 2)


# Several forwards before one backward, activation checkpointing ---------------------------


class _FeedForward(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, 2 * dim)
        self.w2 = nn.Linear(2 * dim, dim)
        self.w3 = nn.Linear(dim, 2 * dim)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class _Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.attention = nn.Linear(dim, dim)
        self.feed_forward = _FeedForward(dim)

    def forward(self, x):
        h = x + self.attention(x)
        return h + self.feed_forward(h)


class _Stack(nn.Module):
    """Blocks between an input and an output projection; ``checkpointed`` wraps each block's call."""

    def __init__(self, dim: int = 8, blocks: int = 3, checkpointed: bool = False):
        super().__init__()
        self.input = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(_Block(dim) for _ in range(blocks))
        self.output = nn.Linear(dim, 4)
        self.checkpointed = checkpointed

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = self.input(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.output(x)


def _shard_stack(model: _Stack, shard, recipe: str, reshard_after_forward: bool) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for index, block in enumerate(model.blocks):
        if "nested" in recipe:
            shard(block.feed_forward.w1, reshard_after_forward=reshard_after_forward)
        if "wrapper" in recipe:
            block = model.blocks[index] = checkpoint_wrapper(block)
        shard(block, reshard_after_forward=reshard_after_forward)
    shard(model)
    if "prefetch" in recipe:
        blocks = list(model.blocks)
        for block, previous in zip(blocks[1:], blocks):
            block.set_modules_to_backward_prefetch([previous])
        for block in blocks:  # inside the checkpointed block: its nested group
            inner = block._checkpoint_wrapped_module if "wrapper" in recipe else block
            if "nested" in recipe:
                block.set_modules_to_backward_prefetch([inner.feed_forward.w1])


def _two_forwards_worker(rank, world_size, recipe, reshard_after_forward, backend):
    torch.manual_seed(0)
    base = _Stack(checkpointed="checkpoint" in recipe)
    models, runs = _sharded_pair(
        base, lambda model, shard: _shard_stack(model, shard, recipe, reshard_after_forward), backend
    )
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-2) for name, model in models.items()}
    counters.clear()
    for step in range(2):
        generator = torch.Generator().manual_seed(10 * step + rank)
        chosen, rejected = torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)
        losses = {}
        for name, run in runs.items():
            # Two forwards, one backward through both (DPO's chosen and rejected answers).
            loss = torch.nn.functional.logsigmoid(run(chosen).sum(-1) - run(rejected).sum(-1)).mean()
            loss.backward()
            losses[name] = loss.detach()
        atol = 0 if backend is None else 1e-6
        torch.testing.assert_close(losses["ours"], losses["torch"], rtol=0, atol=atol)
        _assert_gradients_like_torch(models, atol)
        _step(optimizers)
    if backend is not None:  # one graph, reused by both forwards of every step
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["stats"])


@pytest.mark.parametrize(
    "recipe, reshard_after_forward, backend",
    [
        ("plain", True, None),
        ("checkpoint", True, None),
        ("checkpoint+nested", True, None),
        ("wrapper+nested", True, None),
        ("wrapper+nested+prefetch", True, None),
        ("checkpoint+nested", False, None),
        ("checkpoint+nested", True, "aot_eager"),
    ],
)
def test_two_forwards_before_one_backward_with_checkpointing_train_as_torch_fsdp2(
    recipe, reshard_after_forward, backend
):
    """FSDP2 reduces the sum of both forwards' gradients once per group; a group nested in a checkpointed block
    recomputes with the parameters its forward gathered. Bitwise in eager; compiled within the reduction's rounding.
    """
    run_gloo(_two_forwards_worker, 2, recipe, reshard_after_forward, backend)


# A chunked loss: a list's member called on its own --------------------------------------------


class _ChunkedHead(nn.Module):
    """A language model whose forward stops at the final norm: the output layer runs per chunk of the loss
    (torchtitan's chunked cross-entropy), or, with ``full``, inside the forward too."""

    def __init__(self, vocab: int = 16, dim: int = 8, full: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.full = full

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        h = self.norm(h)
        return self.output(h) if self.full else h


def _chunked_step(model, run, tokens, targets, pattern):
    cross_entropy = torch.nn.functional.cross_entropy
    chunks = 2
    if pattern == "grouped_then_member":
        logits = run(tokens)
        loss = cross_entropy(logits.flatten(0, 1), targets.flatten())
        auxiliary = model.output(torch.ones(2, 8)).square().mean()  # the list's member on its own
        (loss + auxiliary).backward()
        return loss.detach()
    hidden = run(tokens)
    total = torch.zeros(())
    if pattern == "detached_chunks":  # torchtitan's: a backward per chunk through the head, then the trunk
        detached = hidden.detach().requires_grad_()
        for h, t in zip(detached.chunk(chunks, dim=1), targets.chunk(chunks, dim=1)):
            loss = cross_entropy(model.output(h).flatten(0, 1), t.flatten(), reduction="sum") / targets.numel()
            loss.backward()
            total += loss.detach()
        hidden.backward(detached.grad)
    else:  # a backward per chunk through everything, the graph retained
        for index, (h, t) in enumerate(zip(hidden.chunk(chunks, dim=1), targets.chunk(chunks, dim=1))):
            loss = cross_entropy(model.output(h).flatten(0, 1), t.flatten(), reduction="sum") / targets.numel()
            loss.backward(retain_graph=index < chunks - 1)
            total += loss.detach()
    return total


def _chunked_worker(rank, world_size, pattern, reshard_after_forward, backend):
    torch.manual_seed(0)

    def shard_model(model, shard):
        for block in model.blocks:
            shard(block)
        shard([model.norm, model.output], reshard_after_forward=reshard_after_forward)
        shard(model)

    models, runs = _sharded_pair(_ChunkedHead(full=pattern == "grouped_then_member"), shard_model, backend)
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-2) for name, model in models.items()}
    atol = 0 if backend is None else 1e-6
    counters.clear()
    for step in range(3):
        generator = torch.Generator().manual_seed(10 * step + rank)
        tokens, targets = torch.randint(0, 16, (2, 8), generator=generator), torch.randint(0, 16, (2, 8), generator=generator)
        losses = {name: _chunked_step(models[name], runs[name], tokens, targets, pattern) for name in SHARDS}
        torch.testing.assert_close(losses["ours"], losses["torch"], rtol=0, atol=atol)
        _assert_gradients_like_torch(models, atol)
        _step(optimizers)
    if backend is not None:  # the model's forward in one graph; the member's own calls run eagerly
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["stats"])


@pytest.mark.parametrize(
    "pattern, reshard_after_forward, backend",
    [
        ("detached_chunks", True, None),
        ("retained_chunks", True, None),
        ("grouped_then_member", True, None),
        ("grouped_then_member", False, None),
        ("detached_chunks", True, "aot_eager"),
        ("retained_chunks", True, "aot_eager"),
        ("grouped_then_member", True, "aot_eager"),
    ],
)
def test_a_lists_member_called_on_its_own_trains_as_torch_fsdp2(pattern, reshard_after_forward, backend):
    """fully_shard([norm, output]): a forward that runs only the norm, then the output per chunk of the loss
    with a backward each; or the whole forward, then the output once more. Eager bitwise; compiled (the
    trunk compiled, the member's calls eager) within the reduction's rounding."""
    run_gloo(_chunked_worker, 2, pattern, reshard_after_forward, backend)


# Dtypes settled at the first forward ---------------------------------------------------------


def _dtype_worker(rank, world_size, case):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    built, trained, policy = {
        "bf16_built_fp32_trained": (torch.bfloat16, torch.float32, MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
        "bf16_built_fp32_trained_fp32_reduce": (
            torch.bfloat16,
            torch.float32,
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        ),
        "reduce_dtype_clamped": (
            torch.bfloat16,
            torch.float32,
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
        ),
        "fp32_built_bf16_trained": (torch.float32, torch.bfloat16, MixedPrecisionPolicy()),
    }[case]
    torch.manual_seed(0)

    def shard_model(model, shard):
        shard(model[2], mp_policy=policy)
        shard(model, mp_policy=policy)
        model.to(trained)  # after fully_shard, before the first forward: FSDP2's lazy init sees it

    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).to(built)
    models, _ = _sharded_pair(base, shard_model)
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.1) for name, model in models.items()}
    for step in range(2):
        for micro_batch in range(2):  # accumulated without sync, then reduced with it
            inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + 10 * micro_batch + rank))
            for model in models.values():
                model.set_requires_gradient_sync(micro_batch == 1)
                model(inputs.to(trained)).float().square().mean().backward()
        assert all(param.grad.dtype == trained for param in models["ours"].parameters())
        _assert_gradients_like_torch(models)
        _step(optimizers)


@pytest.mark.parametrize(
    "case",
    ["bf16_built_fp32_trained", "bf16_built_fp32_trained_fp32_reduce", "reduce_dtype_clamped", "fp32_built_bf16_trained"],
)
def test_a_dtype_changed_after_fully_shard_trains_as_torch_fsdp2(case):
    """FSDP2 settles its dtypes at the first forward: a model cast after fully_shard trains in the new dtype, its
    policy clamped against it, gradients accumulated without sync in the reduction's dtype."""
    run_gloo(_dtype_worker, 2, case)


# torch 2.15's manual backward finalization --------------------------------------------------

needs_torch_2_15 = pytest.mark.skipif(
    not hasattr(torch.distributed.fsdp.FSDPModule, "finalize_backward"),
    reason=f"FSDP2's manual backward finalization is torch 2.15's; this is torch {torch.__version__}",
)


def _manual_finalization_worker(rank, world_size, backend, mixed_precision):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mixed_precision else MixedPrecisionPolicy()
    torch.manual_seed(0)

    def shard_model(model, shard):
        for block in model.blocks:
            shard(block, mp_policy=policy)
        shard(model, mp_policy=policy)
        model.set_manual_backward_finalization(True)

    models, runs = _sharded_pair(_Stack(), shard_model, backend)
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-2) for name, model in models.items()}
    atol = 0 if backend is None else 1e-6
    for step in range(2):
        for name, model in models.items():
            model.set_requires_gradient_sync(False)
            for micro_batch in range(3):  # every backward accumulates; the reduction waits for finalize_backward
                inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + 10 * micro_batch + rank))
                runs[name](inputs).float().square().mean().backward()
            assert all(param.grad is None for param in model.parameters())
            model.set_requires_gradient_sync(True)
            model.finalize_backward(async_op=True).wait()
        _assert_gradients_like_torch(models, atol)
        _step(optimizers)


@needs_torch_2_15
@pytest.mark.parametrize(
    "backend, mixed_precision", [(None, False), (None, True), ("aot_eager", False)], ids=["eager", "bf16", "compiled"]
)
def test_manual_backward_finalization_reduces_a_micro_batch_loop_as_torch_fsdp2(backend, mixed_precision):
    run_gloo(_manual_finalization_worker, 2, backend, mixed_precision)


@needs_torch_2_15
def test_finalize_backward_refuses_what_torch_fsdp2_refuses(fake_pg):
    for shard in SHARDS.values():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        shard(model[0])
        shard(model)
        model.finalize_backward()  # before the first forward: nothing to do
        model(torch.randn(2, 4)).sum().backward()
        assert type(_raised(lambda: model[0].set_manual_backward_finalization(True))) is RuntimeError  # not the root
        assert type(_raised(lambda: model.finalize_backward())) is RuntimeError  # automatic finalization


# torch 2.15's grad_dtype ------------------------------------------------------------------------

needs_grad_dtype = pytest.mark.skipif(
    not hasattr(torch.Tensor, "_has_grad_dtype_override"),
    reason=f"a parameter's grad_dtype is torch 2.15's (FSDP2 reads it from then); this is torch {torch.__version__}",
)


GRAD_DTYPES = {
    # name: (parameter dtype, grad_dtype, policy's param_dtype, policy's reduce_dtype)
    "bf16_parameters_fp32_gradients": (torch.bfloat16, torch.float32, None, None),
    "fp32_parameters_bf16_gradients": (torch.float32, torch.bfloat16, None, None),
    "gradients_in_the_reduction_dtype": (torch.bfloat16, None, None, torch.float32),
    "bf16_compute_fp32_gradients": (torch.float32, torch.float32, torch.bfloat16, None),
}


def _grad_dtype_worker(rank, world_size, case, backend):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype, grad_dtype, param_dtype, reduce_dtype = GRAD_DTYPES[case]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    torch.manual_seed(0)

    def shard_model(model, shard):
        for param in model.parameters():
            param.grad_dtype = grad_dtype
        shard(model[2], mp_policy=policy)
        shard(model, mp_policy=policy)

    models, runs = _sharded_pair(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype), shard_model, backend)
    for step in range(2):
        for micro_batch in range(2):
            inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + micro_batch + rank))
            for name, model in models.items():
                model.set_requires_gradient_sync(micro_batch == 1)
                runs[name](inputs.to(dtype)).float().square().mean().backward()
        _assert_gradients_like_torch(models)
        for model in models.values():
            model.zero_grad()


@needs_grad_dtype
@pytest.mark.parametrize("case", GRAD_DTYPES)
def test_a_parameters_grad_dtype_is_honoured_as_torch_fsdp2_honours_it(case):
    run_gloo(_grad_dtype_worker, 2, case, None)


@needs_grad_dtype
def test_a_narrower_grad_dtype_compiles_as_torch_fsdp2_trains_it():
    run_gloo(_grad_dtype_worker, 2, "fp32_parameters_bf16_gradients", "aot_eager")


@needs_grad_dtype
def test_compiling_a_grad_dtype_wider_than_its_parameter_raises_naming_it(fake_pg):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(torch.bfloat16)
    model[1].weight.grad_dtype = torch.float32
    fully_shard(model)
    model(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()  # eagerly it trains
    with pytest.raises(RuntimeError, match=r"'1.weight' of fully_shard\('Sequential'\) take gradients wider"):
        torch.compile(model, backend="aot_eager")(torch.randn(2, 4, dtype=torch.bfloat16))


# torch 2.15's unsharded storage kept across reshards -----------------------------------------


def _unsharded_storage(model) -> list[tuple[int, int]]:
    """Each registered unsharded parameter's storage address and size, after unshard()."""
    model.unshard()
    for module in model.modules():
        if module is not model and isinstance(module, torch.distributed.fsdp.FSDPModule):
            module.unshard()
    return [(param.untyped_storage().data_ptr(), param.untyped_storage().nbytes()) for param in model.parameters()]


def _kept_storage_worker(rank, world_size, keep):
    torch.manual_seed(0)
    base = _Stack(blocks=2)
    models, addresses, registered = {}, {}, {}
    for name, shard in SHARDS.items():
        model = copy.deepcopy(base)
        for block in model.blocks:
            shard(block)
        shard(model)
        model.set_keep_unsharded_storage(keep)
        models[name] = model
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-2) for name, model in models.items()}
    for step in range(3):
        inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(step + rank))
        for name, model in models.items():
            model(inputs).square().mean().backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
            addresses.setdefault(name, []).append(_unsharded_storage(model))
            registered[name] = list(model.parameters())
            for module in model.modules():
                if isinstance(module, torch.distributed.fsdp.FSDPModule):
                    module.reshard()
            # What a reshard leaves of the unsharded parameters' storage: all of it where it is kept.
            assert all((param.untyped_storage().nbytes() > 0) is keep for param in registered[name]), name
    if keep:  # the same storage at every step
        for name in SHARDS:
            assert all(step == addresses[name][0] for step in addresses[name]), name
    for ours, theirs in zip(models["ours"].parameters(), models["torch"].parameters(), strict=True):
        torch.testing.assert_close(ours.to_local(), theirs.to_local(), rtol=0, atol=0)


@needs_torch_2_15
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "freed"])
def test_unsharded_storage_kept_across_reshards_keeps_its_addresses_as_in_torch_fsdp2(keep):
    run_gloo(_kept_storage_worker, 2, keep)


@needs_torch_2_15
def test_compiling_with_unsharded_storage_kept_raises(fake_pg):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model)
    model.set_keep_unsharded_storage(True)
    with pytest.raises(RuntimeError, match=r"keeps its unsharded storage across reshards"):
        torch.compile(model, backend="aot_eager")(torch.randn(2, 4))


# Profiler ranges ----------------------------------------------------------------------------


def _profiled_phases(model) -> dict[str, set[str]]:
    """The FSDP2 ranges an eager step records: each phase with the groups it was recorded for."""
    from torch.profiler import profile

    with profile() as profiler:
        model(torch.randn(2, 4)).sum().backward()
    phases: dict[str, set[str]] = {}
    for event in profiler.events():
        if event.name.startswith("FSDP::"):
            phase, _, group = event.name.removeprefix("FSDP::").partition(" ")
            phases.setdefault(phase, set()).add(group)
    return phases


def _profiler_worker(rank, world_size):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8)), nn.Linear(8, 2))
    phases = {}
    for name, shard in SHARDS.items():
        model = copy.deepcopy(base)
        shard(model[2])
        shard(model)
        phases[name] = _profiled_phases(model)
    core = {"root_pre_forward", "pre_forward", "all_gather", "post_forward", "pre_backward", "post_backward_reduce"}
    core |= {"post_backward_reshard", "root_post_backward_callback"}
    assert core <= set(phases["ours"]) <= set(phases["torch"]), (phases["ours"], phases["torch"])
    assert phases["ours"]["post_backward_reduce"] == {"(2)", "(Sequential)"}  # each group's reduction, named


def test_an_eager_step_records_torch_fsdp2s_profiler_ranges():
    """A profile of an eager step reads like FSDP2's: its range names around the same phases, per group."""
    run_gloo(_profiler_worker, 2)


# Structured activations, tensor parallelism under activation checkpointing -------------------


@dataclasses.dataclass
class _Pair:
    first: torch.Tensor
    second: torch.Tensor


class _PairBlock(nn.Module):
    """A block that hands the next its activations in a dataclass."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, pair: _Pair) -> _Pair:
        return _Pair(torch.tanh(self.linear(pair.first)), self.linear(pair.second))


class _PairModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_PairBlock() for _ in range(2))

    def forward(self, x):
        pair = _Pair(x, x * 2)
        for block in self.blocks:
            pair = block(pair)
        return pair.first + pair.second


def _dataclass_worker(rank, world_size):
    torch.manual_seed(0)

    def shard_model(model, shard):
        for block in model.blocks:
            shard(block)
        shard(model)

    models, _ = _sharded_pair(_PairModel(), shard_model)
    for step in range(2):
        inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(step + rank))
        for model in models.values():
            model(inputs).square().mean().backward()
        _assert_gradients_like_torch(models)
        for model in models.values():
            model.zero_grad()


def test_activations_in_a_dataclass_train_as_with_torch_fsdp2():
    """FSDP2 finds a module's output tensors in dataclasses too: each gets the pre-backward unshard."""
    run_gloo(_dataclass_worker, 2)


class _TensorParallelBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _tensor_parallel_checkpoint_worker(rank, world_size, reshard_after_forward):
    from torch.distributed._composable import checkpoint
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    base = nn.Sequential(_TensorParallelBlock(), _TensorParallelBlock())

    def shard_model(model, shard):
        for block in model:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            checkpoint(block)  # composable activation checkpointing, as torch's tests apply it
            shard(block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        shard(model, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)

    models, _ = _sharded_pair(base, shard_model)
    for step in range(2):
        inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(step + mesh["dp"].get_local_rank()))
        for model in models.values():
            model(inputs).square().mean().backward()
        _assert_gradients_like_torch(models)
        for model in models.values():
            model.zero_grad()


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_tensor_parallel_blocks_under_composable_checkpointing_train_as_with_torch_fsdp2(reshard_after_forward):
    """The recompute saves what the forward saved: a tensor-parallel parameter is shown as a new DTensor again."""
    run_gloo(_tensor_parallel_checkpoint_worker, 4, reshard_after_forward)
