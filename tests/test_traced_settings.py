"""[Note: settings a trace reads as constants]: one guarded version per group stands for its settings in a trace."""

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import clear_compilation_metrics

from compile_shard.debug import recompiles
from compile_shard.models import LlamaConfig
from dist_utils import FakeProcessGroup, build_sharded_llama, lm_loss


@pytest.fixture
def fake_pg():
    with FakeProcessGroup(2):
        torch._dynamo.reset()
        clear_compilation_metrics()
        yield


class _Around(nn.Module):
    """A frame compiled around the sharded root: the root's forward is traced, not run eagerly first."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)


@pytest.mark.parametrize("compiled", ["root", "around_root"])
def test_freezing_after_compiling_recompiles_and_unfreezing_finds_the_first_graph(fake_pg, compiled):
    model, _ = build_sharded_llama(LlamaConfig(n_layers=2))
    runnable = torch.compile(model if compiled == "root" else _Around(model), backend="aot_eager")
    tokens = torch.randint(0, 1001, (1, 9))
    frozen, trained = model.layers[0].attention.wq.weight, model.layers[0].attention.wk.weight
    lm_loss(runnable, tokens).backward()
    assert frozen.grad is not None and recompiles() == 0

    frozen.requires_grad_(False)
    model.zero_grad(set_to_none=True)
    lm_loss(runnable, tokens).backward()
    assert frozen.grad is None and trained.grad is not None
    assert recompiles() == 1

    frozen.requires_grad_(True)
    lm_loss(runnable, tokens).backward()
    assert frozen.grad is not None and recompiles() == 1


def _set_and_reset(model: nn.Module) -> dict:
    """Per setting: a setter call that changes it from its default, and one that sets the default back."""
    block, other = model.layers[0], model.layers[1]

    def hook(gradient: torch.Tensor) -> None:
        pass

    return {
        "reshard_after_forward": (
            lambda: block.set_reshard_after_forward(False),
            lambda: block.set_reshard_after_forward(True),
        ),
        "reshard_after_backward": (
            lambda: block.set_reshard_after_backward(False),
            lambda: block.set_reshard_after_backward(True),
        ),
        "forward_prefetch": (
            lambda: block.set_modules_to_forward_prefetch([other]),
            lambda: block.set_modules_to_forward_prefetch([]),
        ),
        "backward_prefetch": (
            lambda: block.set_modules_to_backward_prefetch([other]),
            lambda: block.set_modules_to_backward_prefetch([]),
        ),
        "reduce_scatter_unused_params": (
            lambda: block.set_reduce_scatter_unused_params(True),
            lambda: block.set_reduce_scatter_unused_params(False),
        ),
        # The world size (2) is the default divisor: the same reduction, so the same version.
        "gradient_divide_factor": (
            lambda: block.set_gradient_divide_factor(4.0),
            lambda: block.set_gradient_divide_factor(2.0),
        ),
        "force_sum_reduction_for_comms": (
            lambda: block.set_force_sum_reduction_for_comms(True),
            lambda: block.set_force_sum_reduction_for_comms(False),
        ),
        "all_reduce_hook": (lambda: block.set_all_reduce_hook(hook), lambda: block.set_all_reduce_hook(None)),
        "requires_grad": (
            lambda: block.attention.wq.weight.requires_grad_(False),
            lambda: block.attention.wq.weight.requires_grad_(True),
        ),
    }


_SETTINGS = (
    "reshard_after_forward",
    "reshard_after_backward",
    "forward_prefetch",
    "backward_prefetch",
    "reduce_scatter_unused_params",
    "gradient_divide_factor",
    "force_sum_reduction_for_comms",
    "all_reduce_hook",
    "requires_grad",
)


@pytest.mark.parametrize("setting", _SETTINGS)
def test_each_setting_has_a_version_of_its_own_and_the_default_gets_its_version_back(fake_pg, setting):
    model, _ = build_sharded_llama(LlamaConfig(n_layers=2))
    group = model.layers[0]._get_fsdp_state().group
    setters = _set_and_reset(model)
    assert tuple(setters) == _SETTINGS
    change, reset = setters[setting]
    default = group.settings_version
    change()
    group.note_requires_grad()  # the root's forward does it before each step
    assert group.settings_version != default
    reset()
    group.note_requires_grad()
    assert group.settings_version == default
