"""``as_torch_fully_shard``: code written for torch's FSDP2 runs compile_shard's ``fully_shard``, then nothing stays patched.

The trainers are stand-ins written the way frameworks write them (torchtitan's
``apply_fsdp``): ``fully_shard`` imported from torch at module level, blocks and then the
root sharded with a ``MixedPrecisionPolicy``, ``isinstance(module, FSDPModule)`` before
``set_gradient_divide_factor``.
"""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch._dynamo.utils import counters
from torch.distributed.fsdp._fully_shard import _fully_shard as torch_fully_shard_module

import compile_shard
from compile_shard.models import Llama, LlamaConfig
from dist_utils import FakeProcessGroup, global_batch, lm_loss
from graph_utils import CapturingBackend, op_counts

TORCH_FULLY_SHARD = torch_fully_shard_module.fully_shard

TRAINER = textwrap.dedent(
    """
    import torch
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


    def apply_fsdp(model):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(2.0)
        return model
    """
)


@pytest.fixture
def trainer_modules(tmp_path, monkeypatch):
    """Imports a trainer module now (before the block); ``import_later`` imports another one inside it."""
    for name in ("early_trainer", "late_trainer"):
        (tmp_path / f"{name}.py").write_text(TRAINER)
    monkeypatch.syspath_prepend(str(tmp_path))
    early = importlib.import_module("early_trainer")
    yield early, lambda: importlib.import_module("late_trainer")
    for name in ("early_trainer", "late_trainer"):
        sys.modules.pop(name, None)


def _is_compile_shards(module) -> bool:
    return isinstance(module, compile_shard.FSDPModule)


def test_a_trainer_imported_before_the_block_shards_with_compile_shard(
    fresh_dynamo, per_group_collectives, trainer_modules
):
    early, import_later = trainer_modules
    capture = CapturingBackend()
    with FakeProcessGroup(2):
        torch.manual_seed(0)
        with compile_shard.as_torch_fully_shard():
            model = early.apply_fsdp(Llama(LlamaConfig()))
            late = import_later()
            assert late.fully_shard is torch_fsdp.fully_shard is not TORCH_FULLY_SHARD
        assert _is_compile_shards(model) and all(_is_compile_shards(block) for block in model.layers)
        compiled = torch.compile(model, backend=capture.backend)
        lm_loss(compiled, global_batch(0, 1, 2, 8, LlamaConfig().vocab_size)).backward()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    (forward,), (backward,) = capture.forward_graphs, capture.backward_graphs
    assert op_counts(forward.graph)["all_gather"] == LlamaConfig().n_layers + 1
    assert op_counts(backward.graph)["reduce_scatter"] == LlamaConfig().n_layers + 1
    # Nothing stays patched: torch's names, the early trainer's and the one imported inside.
    assert torch_fsdp.fully_shard is TORCH_FULLY_SHARD and torch_fully_shard_module.fully_shard is TORCH_FULLY_SHARD
    assert early.fully_shard is TORCH_FULLY_SHARD and late.fully_shard is TORCH_FULLY_SHARD
    assert compile_shard.fully_shard is not TORCH_FULLY_SHARD


def test_an_error_inside_the_block_restores_torch(trainer_modules):
    early, _ = trainer_modules
    with pytest.raises(RuntimeError, match="inside"):
        with compile_shard.as_torch_fully_shard():
            assert early.fully_shard is torch_fsdp.fully_shard is not TORCH_FULLY_SHARD
            raise RuntimeError("inside")
    assert early.fully_shard is TORCH_FULLY_SHARD and torch_fsdp.fully_shard is TORCH_FULLY_SHARD


def test_outside_the_block_the_trainer_shards_with_torch(trainer_modules):
    early, _ = trainer_modules
    with FakeProcessGroup(2):
        model = early.apply_fsdp(Llama(LlamaConfig()))
    assert isinstance(model, torch_fsdp.FSDPModule) and not _is_compile_shards(model)
