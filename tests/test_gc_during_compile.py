"""Full garbage collections wait while a sharded model compiles ([Note: full collections during a compile])."""

import gc

import pytest
import torch

from compile_shard._gc_during_compile import _ENVIRONMENT_VARIABLE
from compile_shard.models import LlamaConfig
from dist_utils import FakeProcessGroup, build_sharded_llama

TORCH_DEFERS_THEM = hasattr(torch._dynamo.config, "gc_gen2_threshold_during_compile")


def _thresholds_while_compiling() -> tuple[tuple[int, int, int], list[tuple[int, int, int]]]:
    """Compiles a sharded Llama's forward; the thresholds before, and those its backend saw."""
    seen = []

    def backend(graph_module, example_inputs):
        seen.append(gc.get_threshold())
        return graph_module.forward

    with FakeProcessGroup(2):
        model, _ = build_sharded_llama(LlamaConfig(n_layers=2))
        before = gc.get_threshold()
        torch.compile(model, backend=backend, fullgraph=True)(torch.randint(0, 1001, (2, 9)))
    assert gc.get_threshold() == before  # restored once the compile ended
    return before, seen


@pytest.fixture
def default_thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's
    yield
    gc.set_threshold(*saved)


def test_a_compile_defers_full_collections_and_restores_the_threshold(default_thresholds):
    before, seen = _thresholds_while_compiling()
    assert before == (700, 10, 10)
    assert seen == [(700, 10, 1000)]


def test_after_dynamos_reset_the_next_compile_defers_them_again(default_thresholds):
    """``torch._dynamo.reset()`` removes Dynamo's compile callbacks; the next trace installs them again."""
    _thresholds_while_compiling()
    torch._dynamo.reset()
    _, seen = _thresholds_while_compiling()
    assert seen == [(700, 10, 1000)]


def test_a_threshold_the_program_raised_further_is_kept(default_thresholds):
    gc.set_threshold(700, 10, 5000)
    _, seen = _thresholds_while_compiling()
    assert seen == [(700, 10, 5000)]


@pytest.mark.skipif(TORCH_DEFERS_THEM, reason="this torch defers them itself and reads the variable at its import")
def test_the_environment_variable_at_zero_turns_it_off(default_thresholds, monkeypatch):
    monkeypatch.setenv(_ENVIRONMENT_VARIABLE, "0")
    _, seen = _thresholds_while_compiling()
    assert seen == [(700, 10, 10)]
