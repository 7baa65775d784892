"""Eager memory semantics like FSDP2: unsharded storage freed after forward
(when resharding) and after backward, and nothing a step or a dropped model leaves behind."""

import gc
import weakref

import pytest
import torch

from compile_shard import fully_shard
from compile_shard._group import FSDPParamGroup, UnshardedParams
from compile_shard.debug import unsharded_bytes
from compile_shard.models import LlamaConfig
from dist_utils import FakeProcessGroup, build_sharded_llama, lm_loss

CONFIG = LlamaConfig(n_layers=3)
WORLD_SIZE = 2


def _unsharded_storage_bytes(param) -> int:
    """The copy-out of an all-gather: world_size padded shards of the parameter."""
    padded_rows = -(-param.shape[0] // WORLD_SIZE)
    return WORLD_SIZE * padded_rows * param[0].numel() * param.element_size()


class SavedTensorBytes:
    """Bytes of distinct storages autograd saved for backward, read when asked."""

    def __init__(self):
        self.saved = []
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor):
        self.saved.append(tensor)
        return tensor

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    def live_bytes(self) -> int:
        storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in self.saved}
        return sum(storages.values())


def _forward_then_backward(reshard):
    model, _ = build_sharded_llama(CONFIG, block_reshard=reshard, root_reshard=reshard)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 9))
    with SavedTensorBytes() as saved:
        loss = lm_loss(model, tokens)
    between = unsharded_bytes(model), saved.live_bytes()
    loss.backward()
    after = unsharded_bytes(model)
    return model, between, after


@pytest.fixture(autouse=True)
def fake_pg():
    with FakeProcessGroup(WORLD_SIZE):
        yield


def test_reshard_after_forward_frees_unsharded_storage():
    model, (live_resharded, saved_resharded), after = _forward_then_backward(reshard=True)
    _, (live_kept, saved_kept), _ = _forward_then_backward(reshard=False)
    all_unsharded = sum(_unsharded_storage_bytes(p) for p in model.parameters())
    assert live_resharded == 0
    assert live_kept == all_unsharded
    # Measured independently of the runtime's bookkeeping: autograd's saved tensors.
    assert saved_kept - saved_resharded == all_unsharded
    assert after == 0


def test_default_keeps_only_root_between_forward_and_backward():
    model, (live, _), after = _forward_then_backward(reshard=None)
    root_params = [model.tok_embeddings.weight, model.norm.weight]
    assert live == sum(_unsharded_storage_bytes(p) for p in root_params)
    assert after == 0


def test_no_reshard_frees_everything_after_backward():
    _, (live, _), after = _forward_then_backward(reshard=False)
    assert live > 0 and after == 0


def test_unsharded_storage_is_regathered_for_backward():
    """Backward reads the freed storages (a 0-byte storage raises): they were refilled."""
    model, _, _ = _forward_then_backward(reshard=True)
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def _reshard_all(model):
    for module in model.modules():
        if hasattr(module, "_get_fsdp_state"):
            module.reshard()


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_parameters_kept_after_backward_are_freed_by_reshard_and_never_under_a_pending_backward(backend):
    """``set_reshard_after_backward(False)``: ``reshard()`` frees what backward kept, as in FSDP2.

    A compiled forward keeps what it gathered, which its own backward may still read:
    ``reshard()`` between the two must leave that backward its values ([Note: unsharded
    parameters kept after backward] in compile_shard._group).
    """
    model, _ = build_sharded_llama(CONFIG)
    reference, _ = build_sharded_llama(CONFIG)
    runnable = model if backend is None else torch.compile(model, backend=backend)
    model.set_reshard_after_backward(False)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    lm_loss(runnable, tokens).backward()
    assert unsharded_bytes(model) == sum(_unsharded_storage_bytes(p) for p in model.parameters())
    _reshard_all(model)
    assert unsharded_bytes(model) == 0
    loss = lm_loss(runnable, tokens)
    _reshard_all(model)
    loss.backward()
    for _ in range(2):
        lm_loss(reference, tokens).backward()
    for (name, param), other in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad.to_local(), other.grad.to_local(), rtol=0, atol=1e-6, msg=name)


def _alive(cls) -> int:
    gc.collect()
    return sum(isinstance(obj, cls) for obj in gc.get_objects())


def _freezing_layers_1(module, **kwargs):
    """``fully_shard`` that first freezes the Llama's second block: its group ends backward on its inputs."""
    if module.__class__.__name__ == "Llama":
        module.layers[1].requires_grad_(False)
    return fully_shard(module, **kwargs)


@pytest.mark.parametrize(
    "shard, reshard",
    [(fully_shard, None), (fully_shard, False), (_freezing_layers_1, None)],
    ids=["default", "reshard_false", "frozen_block"],
)
def test_steps_leave_no_unsharded_parameters_and_a_dropped_model_is_freed(shard, reshard):
    """No reference cycle through an autograd node outlives a step or the model.

    Python's garbage collector does not look into autograd's C++ nodes and hook lists:
    a hook holding what holds its node leaked every step's unsharded parameters, and
    the model with them ([Note: no reference cycle through an autograd node] in
    compile_shard._group).
    """
    # What earlier tests of this process keep alive (a compiled model in Dynamo's caches) is held
    # here, so that the counts below change with this test's objects only: a cache that lets
    # one go in the middle of the test would otherwise read as fewer objects than before.
    gc.collect()
    earlier = [obj for obj in gc.get_objects() if isinstance(obj, (FSDPParamGroup, UnshardedParams))]
    groups_before, unsharded_before = _alive(FSDPParamGroup), _alive(UnshardedParams)
    model, _ = build_sharded_llama(CONFIG, block_reshard=reshard, root_reshard=reshard, shard=shard)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        optimizer.zero_grad()
        lm_loss(model, tokens).backward()
        optimizer.step()
        assert _alive(UnshardedParams) == unsharded_before
    model_ref = weakref.ref(model)
    del model, optimizer
    gc.collect()
    assert model_ref() is None
    assert _alive(FSDPParamGroup) == groups_before
    del earlier


class _Trainer:
    """A framework object whose hooks are its bound methods, and which holds the model."""

    def __init__(self, model):
        self.model = model

    def all_reduce_hook(self, reduced: torch.Tensor) -> None:
        reduced.mul_(1.0)


def test_a_hook_that_reaches_its_model_does_not_keep_it_alive():
    """[Note: Python objects named in op arguments]: the registry of hooks and comms refers to them weakly."""
    model, _ = build_sharded_llama(CONFIG)
    trainer = _Trainer(model)
    for module in model.modules():
        if hasattr(module, "set_all_reduce_hook"):
            module.set_all_reduce_hook(trainer.all_reduce_hook)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    lm_loss(model, tokens).backward()
    model_ref = weakref.ref(model)
    del model, trainer
    gc.collect()
    assert model_ref() is None
