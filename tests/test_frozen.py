"""Frozen parameters: every layout FSDP2 trains, eager against torch FSDP2 and compiled against eager.

A block whose parameters are all frozen still runs backward (its inputs need
gradients), so its unsharded parameters must be refilled and freed around that
backward without an all-gather gradient to hook ([Note: post-backward of a frozen
group] in compile_shard/_group.py).
"""

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from compile_shard import fully_shard
from compile_shard.models import LlamaConfig
from dist_utils import build_sharded_llama, global_batch, lm_loss, run_gloo

STEPS = 3
CONFIG = LlamaConfig(n_layers=3)
# Parameters frozen before fully_shard, by layout: a whole block first, in the middle
# and last, and part of the root's own group.
LAYOUTS = {
    "first_block": ("layers.0.",),
    "middle_block": ("layers.1.",),
    "last_block": ("layers.2.",),
    "part_of_root": ("tok_embeddings.",),
}


def _train(layout, shard, rank, world_size, reshard, backend=None):
    """Losses, gradients of the last step (None where none) and final parameters, all full tensors."""
    model, _ = build_sharded_llama(
        CONFIG, shard=_freezing(shard, LAYOUTS[layout]), block_reshard=reshard, root_reshard=reshard
    )
    runnable = model if backend is None else torch.compile(model, backend=backend)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        tokens = global_batch(step, world_size, 2, 8, CONFIG.vocab_size)[2 * rank : 2 * rank + 2]
        optimizer.zero_grad()
        loss = lm_loss(runnable, tokens)
        loss.backward()
        grads = {name: None if p.grad is None else p.grad.full_tensor() for name, p in model.named_parameters()}
        optimizer.step()
        losses.append(loss.detach())
    params = {name: p.full_tensor() for name, p in model.named_parameters()}
    return losses, grads, params


def _freezing(shard, prefixes):
    """``shard`` that first freezes the parameters of the module's own group under ``prefixes``."""

    def freeze_then_shard(module, **kwargs):
        if module.__class__.__name__ == "Llama":
            for name, param in module.named_parameters():
                if name.startswith(prefixes):
                    param.requires_grad_(False)
        return shard(module, **kwargs)

    return freeze_then_shard


def _assert_same(actual, expected, atol=0.0):
    losses, grads, params = actual
    expected_losses, expected_grads, expected_params = expected
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected_losses), rtol=0, atol=atol)
    assert {n for n, g in grads.items() if g is None} == {n for n, g in expected_grads.items() if g is None}
    for name, grad in grads.items():
        if grad is not None:
            torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=atol, msg=name)
    for name, param in params.items():
        torch.testing.assert_close(param, expected_params[name], rtol=0, atol=atol, msg=name)


def _eager_worker(rank, world_size, reshard):
    for layout, prefixes in LAYOUTS.items():
        ours = _train(layout, fully_shard, rank, world_size, reshard)
        theirs = _train(layout, torch_fully_shard, rank, world_size, reshard)
        _assert_same(ours, theirs)
        frozen = {name for name, grad in ours[1].items() if grad is None}
        assert frozen and all(name.startswith(prefixes) for name in frozen), layout


def _compiled_worker(rank, world_size):
    # A whole block frozen and part of the root's group, resharding on and off in turn:
    # the compiled graphs treat every frozen parameter alike, and each compile costs seconds.
    for layout, reshard in (("middle_block", None), ("part_of_root", False)):
        torch._dynamo.reset()
        eager = _train(layout, fully_shard, rank, world_size, reshard)
        compiled = _train(layout, fully_shard, rank, world_size, reshard, backend="aot_eager")
        _assert_same(compiled, eager)


@pytest.mark.parametrize("reshard", [None, False], ids=["reshard_default", "reshard_false"])
def test_frozen_layouts_match_torch_fsdp2(reshard):
    run_gloo(_eager_worker, 2, reshard)


@pytest.mark.slow
def test_frozen_layouts_compiled_match_eager():
    run_gloo(_compiled_worker, 2)


class AdaptedBlock(torch.nn.Module):
    """A frozen bf16 base layer beside a trainable fp32 adapter, in one group."""

    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(16, 16).to(torch.bfloat16).requires_grad_(False)
        self.adapter = torch.nn.Linear(16, 16)

    def forward(self, x):
        return x + self.base(x.to(torch.bfloat16)).to(x.dtype) + self.adapter(x)


def _adapted(shard, mp_policy, reshard, backend=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(AdaptedBlock(), AdaptedBlock(), torch.nn.Linear(16, 4))
    for block in model[:2]:
        shard(block, mp_policy=mp_policy, reshard_after_forward=reshard)
    shard(model, mp_policy=mp_policy)
    return model, (model if backend is None else torch.compile(model, backend=backend, fullgraph=True))


def _mixed_dtypes_worker(rank, world_size, mp_policy, reshard):
    (ours, _), (theirs, _), (compiled_model, compiled) = (
        _adapted(fully_shard, mp_policy, reshard),
        _adapted(torch_fully_shard, mp_policy, reshard),
        _adapted(fully_shard, mp_policy, reshard, backend="aot_eager"),
    )
    models = (ours, theirs, compiled_model)
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in models]
    for step in range(STEPS):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        outputs = [run(x) for run in (ours, theirs, compiled)]
        for output in outputs:
            output.float().square().mean().backward()
        for name, param in ours.named_parameters():
            others = [dict(m.named_parameters())[name] for m in (theirs, compiled_model)]
            assert all((p.grad is None) == (param.grad is None) for p in others), name
            assert (param.grad is None) == name.endswith(("base.weight", "base.bias")), name
            if param.grad is not None:
                for other in others:
                    torch.testing.assert_close(param.grad.full_tensor(), other.grad.full_tensor(), rtol=0, atol=0)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
        torch.testing.assert_close(outputs[0], outputs[2], rtol=0, atol=0)


def _mixed_dtypes_layouts_worker(rank, world_size):
    bf16_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for mp_policy in (MixedPrecisionPolicy(), bf16_policy):
        for reshard in (True, False):
            torch._dynamo.reset()
            _mixed_dtypes_worker(rank, world_size, mp_policy, reshard)


def test_frozen_bf16_beside_trainable_fp32_matches_torch_fsdp2():
    """[Note: one all-gather per wire dtype]: torch FSDP2's gradients and outputs, eager and compiled.

    With the blocks' own dtypes and with a bf16 policy, resharding on and off.
    """
    run_gloo(_mixed_dtypes_layouts_worker, 2)
