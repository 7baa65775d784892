"""Golden graphs: the joint graph before the suite, after each pass, and the final
forward and backward graphs, for small models at fake world sizes 2 and 8.

A diff here is a review item: regenerate with ``EXPECTTEST_ACCEPT=1 python -m pytest
tests/test_golden_graphs.py`` and explain the change in the commit message. The
graphs belong to torch 2.13 (op decompositions and node names change between torch
versions); on another version these tests skip.
"""

import difflib
from pathlib import Path

import expecttest
import pytest
import torch
import torch._dynamo
import torch.nn as nn
from torch._functorch.partitioners import default_partition

from compile_shard import fully_shard
from compile_shard.debug import format_graph
from compile_shard.models import Llama, LlamaConfig
from compile_shard.passes import lower, refunctionalize, reshard, verify
from dist_utils import FakeProcessGroup
from graph_utils import pass_settings

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "graphs"
GOLDEN_TORCH = "2.13"

pytestmark = pytest.mark.skipif(
    not torch.__version__.startswith(GOLDEN_TORCH),
    reason=f"golden graphs are recorded with torch {GOLDEN_TORCH}, this is torch {torch.__version__}",
)


def _mlp(reshard_after_forward):
    model = nn.Sequential(nn.Linear(13, 7), nn.ReLU(), nn.Linear(7, 11), nn.ReLU(), nn.Linear(11, 5))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model, torch.randn(4, 13)


def _llama(reshard_after_forward):
    config = LlamaConfig(vocab_size=37, dim=16, n_layers=2, n_heads=2, ffn_hidden=24, max_seq_len=8)
    model = Llama(config)
    for block in model.layers:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model, torch.randint(0, config.vocab_size, (2, 8))


MODELS = {"mlp3_uneven": _mlp, "llama2_tied": _llama}


def _staged_graphs(build, world_size, reshard_after_forward) -> str:
    """Runs the suite one pass at a time inside the partitioner hook, printing each stage."""
    sections = []

    def partition_fn(joint, joint_inputs, **kwargs):
        graph = joint.graph
        sections.append(("joint graph before the suite", format_graph(graph)))
        for name, graph_pass in (("refunctionalize", refunctionalize), ("reshard", reshard), ("lower", lower)):
            graph_pass(graph)
            verify(graph)
            sections.append((f"after {name}", format_graph(graph)))
        joint.recompile()
        forward, backward = default_partition(joint, joint_inputs, **kwargs)
        sections.append(("forward graph", format_graph(forward.graph)))
        sections.append(("backward graph", format_graph(backward.graph)))
        return forward, backward

    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    with FakeProcessGroup(world_size), pass_settings(refunctionalize=False, reshard=False, lower=False, verify=False):
        torch.manual_seed(0)
        model, example = build(reshard_after_forward)
        compiled = torch.compile(model, backend=aot_autograd(fw_compiler=_boxed, partition_fn=partition_fn), fullgraph=True)
        compiled(example).float().sum().backward()
    torch._dynamo.reset()
    return "".join(f"===== {title}\n{text}" for title, text in sections)


def _boxed(graph_module, example_inputs):
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(graph_module.forward)


def _assert_golden(name: str, actual: str) -> None:
    path = GOLDEN_DIR / f"{name}.txt"
    if expecttest.ACCEPT:
        path.write_text(actual)
        return
    assert path.exists(), f"no golden graph {path.name}; record it with EXPECTTEST_ACCEPT=1"
    expected = path.read_text()
    if actual != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True), path.name, "actual"))
        pytest.fail(f"{path.name} changed (EXPECTTEST_ACCEPT=1 regenerates):\n{diff[:20000]}")


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["reshard", "no_reshard"])
@pytest.mark.parametrize("world_size", [2, 8])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_golden_graphs(model, world_size, reshard_after_forward):
    name = f"{model}_ws{world_size}_{'reshard' if reshard_after_forward else 'no_reshard'}"
    _assert_golden(name, _staged_graphs(MODELS[model], world_size, reshard_after_forward))
