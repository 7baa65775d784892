"""The public API: FSDP2-compatible module methods and what the user sees."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from compile_shard import FSDPModule
from compile_shard.debug import CollectiveCounter, unsharded_bytes
from compile_shard.models import LlamaConfig
from dist_utils import FakeProcessGroup, build_sharded_llama, global_batch, lm_loss, run_gloo


@pytest.fixture
def fake_pg():
    with FakeProcessGroup(2):
        yield


def test_parameters_are_dim0_sharded_dtensors(fake_pg):
    model, reference = build_sharded_llama(LlamaConfig())
    assert isinstance(model, FSDPModule) and all(isinstance(block, FSDPModule) for block in model.layers)
    for (name, param), (_, full) in zip(model.named_parameters(), reference.named_parameters()):
        assert isinstance(param, nn.Parameter) and isinstance(param, DTensor), name
        assert param.placements == (Shard(0),) and param.shape == full.shape, name
    # The vocab (1001 rows) shards unevenly: padding never shows.
    assert model.tok_embeddings.weight.to_local().shape == (501, 64)


def test_tied_parameter_is_sharded_once(fake_pg):
    model, _ = build_sharded_llama(LlamaConfig())
    assert model.output.weight is model.tok_embeddings.weight
    names = [name for name, _ in model.named_parameters()]
    assert "output.weight" not in names and "tok_embeddings.weight" in names
    root_group = model._get_fsdp_state().group
    tied = [p for p in root_group.fsdp_params if p.fqn == "tok_embeddings.weight"]
    assert len(tied) == 1 and len(tied[0].usages) == 2


def test_state_dict_holds_the_sharded_dtensors(fake_pg):
    model, reference = build_sharded_llama(LlamaConfig())
    state_dict = model.state_dict()
    assert state_dict.keys() == reference.state_dict().keys()
    assert all(isinstance(value, DTensor) for value in state_dict.values())


def test_unshard_then_forward_does_not_gather_again(fake_pg):
    model, _ = build_sharded_llama(LlamaConfig())
    tokens = torch.randint(0, 1001, (1, 8))
    lm_loss(model, tokens).backward()
    block = model.layers[0]
    block.unshard()
    assert unsharded_bytes(block) > 0
    assert not isinstance(block.attention.wq.weight, DTensor)
    with CollectiveCounter() as counter:
        lm_loss(model, tokens).backward()
    with CollectiveCounter() as baseline:
        lm_loss(model, tokens).backward()
    assert counter.counts["all_gather"] == baseline.counts["all_gather"] - 1


def test_reshard_frees_and_restores_sharded_parameters(fake_pg):
    model, _ = build_sharded_llama(LlamaConfig())
    block = model.layers[0]
    block.unshard()
    block.reshard()
    assert unsharded_bytes(block) == 0
    assert isinstance(block.attention.wq.weight, DTensor)


def test_set_reshard_after_forward(fake_pg):
    model, _ = build_sharded_llama(LlamaConfig())
    model.set_reshard_after_forward(False)
    with CollectiveCounter() as counter:
        lm_loss(model, torch.randint(0, 1001, (1, 8))).backward()
    assert counter.counts == {"all_gather": 3, "reduce_scatter": 3}


def _optimizer_and_norm_worker(rank, world_size):
    config = LlamaConfig()
    model, reference = build_sharded_llama(config)
    tokens = global_batch(0, world_size, 2, 16, config.vocab_size)
    lm_loss(model, tokens[2 * rank : 2 * rank + 2]).backward()
    lm_loss(reference, tokens).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
    reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.1)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    torch.testing.assert_close(norm, reference_norm, rtol=1e-5, atol=0)
    for (name, value), reference_value in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(value.full_tensor(), reference_value), name  # no step yet: exact
    for param, reference_param in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad.full_tensor(), reference_param.grad, rtol=0, atol=1e-7)


def test_clip_grad_norm_and_state_dict_on_gloo():
    run_gloo(_optimizer_and_norm_worker, 3)


def test_forward_prefetch_gathers_the_listed_blocks_when_the_first_starts(fake_pg):
    model, _ = build_sharded_llama(LlamaConfig(n_layers=3))
    model.layers[0].set_modules_to_forward_prefetch([model.layers[2]])
    unsharded_while_block0_runs = {}

    def record(module, args):
        for index, block in enumerate(model.layers):
            unsharded_while_block0_runs[index] = block._get_fsdp_state().group.unsharded is not None

    model.layers[0].attention_norm.register_forward_pre_hook(record)
    with CollectiveCounter() as counter:
        lm_loss(model, torch.randint(0, 1001, (2, 9))).backward()
    assert unsharded_while_block0_runs == {0: True, 1: False, 2: True}
    assert counter.counts["all_gather"] == 4 + 3  # no extra all-gather: block 2 reuses the prefetched one


def test_backward_prefetch_refills_the_listed_block_when_the_first_starts_backward(fake_pg):
    model, _ = build_sharded_llama(LlamaConfig(n_layers=3))
    model.layers[2].set_modules_to_backward_prefetch([model.layers[0]])
    block0 = model.layers[0]._get_fsdp_state().group
    seen = []

    def record(grad):
        live = [ref() for ref in block0._live if ref() is not None]
        seen.append(not live[-1].is_freed)
        return grad

    loss = lm_loss(model, torch.randint(0, 1001, (2, 9)))
    # Runs when block 2's gradients are reduced, after its pre-backward: block 0 is refilled by then.
    model.layers[2]._get_fsdp_state().group.fsdp_params[0].shard.register_hook(record)
    with CollectiveCounter() as counter:
        loss.backward()
    assert seen == [True]
    assert counter.counts["all_gather"] == 3  # each resharded block once, block 0 early
    assert unsharded_bytes(model) == 0


def test_prefetch_knobs_reject_modules_that_are_not_sharded(fake_pg):
    model, _ = build_sharded_llama(LlamaConfig(n_layers=2))
    with pytest.raises(ValueError, match=r"set_modules_to_forward_prefetch: Linear is not a module with parameters"):
        model.layers[0].set_modules_to_forward_prefetch([nn.Linear(2, 2)])


def test_the_package_exports_fully_shard_and_torchs_own_fsdp2_names():
    """Users import the rest of FSDP2 from torch; compile_shard's aliases are the same objects (docs/api.md)."""
    import torch.distributed.fsdp as torch_fsdp

    import compile_shard

    own = {
        "fully_shard", "FSDPModule", "as_torch_fully_shard", "RegionInlinedWarning", "RankMismatchError",
        "load_cache_artifacts", "save_cache_artifacts",
    }  # fmt: skip
    assert own <= set(compile_shard.__all__) and "ops" not in compile_shard.__all__
    for name in set(compile_shard.__all__) - own:
        assert getattr(compile_shard, name) is getattr(torch_fsdp, name), name
    assert issubclass(compile_shard.FSDPModule, torch_fsdp.FSDPModule)
