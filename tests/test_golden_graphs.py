"""Golden graphs: the joint graph before the suite and after each pass (the suite's
own graph dump), and the final forward and backward graphs (default partitioner,
then ``reorder``), for small models at fake world sizes 2 and 8, with resharding on
and off and with cross-group bucketing off (``bucket_cap_mb=0``: FSDP2's one collective
per group, also where the default cap would merge these small models' groups) and on.

A diff here is a review item: regenerate with ``EXPECTTEST_ACCEPT=1 python -m pytest
tests/test_golden_graphs.py`` and explain the change in the commit message.

[Note: golden graphs per torch version]
Op decompositions, node names and the partitioner's choices change between torch
releases. ``graphs/`` holds torch 2.13's graphs; ``graphs/torch-<major>.<minor>/``
holds another supported release's where they differ from those (graphs/README.md
says how each release's differ). A test compares with its release's file where one
exists, else with 2.13's; regenerating on a release writes its file only where it
differs from 2.13's, and removes one that no longer does. On a torch outside
``SUPPORTED`` the tests skip.
"""

import dataclasses
import difflib
import functools
from pathlib import Path

import expecttest
import pytest
import torch
import torch._dynamo
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from compile_shard import fully_shard
from compile_shard._versions import SUPPORTED, TORCH_VERSION
from compile_shard.debug import dump_graphs
from compile_shard.models import Llama, LlamaConfig
from dist_utils import FakeProcessGroup, ReusedBlockModel, build_tensor_parallel_llama
from graph_utils import CapturingBackend, pass_settings

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "graphs"
BASE_TORCH = (2, 13)
# This release's own graphs where they differ from BASE_TORCH's.
RELEASE_DIR = GOLDEN_DIR / f"torch-{TORCH_VERSION[0]}.{TORCH_VERSION[1]}"

pytestmark = pytest.mark.skipif(
    TORCH_VERSION not in SUPPORTED,
    reason=f"golden graphs are recorded for torch {SUPPORTED}, this is torch {torch.__version__}",
)


def _shard(modules, **kwargs):
    for module in modules:
        fully_shard(module, **kwargs)


def _mlp(**kwargs):
    model = nn.Sequential(nn.Linear(13, 7), nn.ReLU(), nn.Linear(7, 11), nn.ReLU(), nn.Linear(11, 5))
    _shard([model[0], model[2], model[4], model], **kwargs)
    return model, torch.randn(4, 13)


LLAMA_CONFIG = LlamaConfig(vocab_size=37, dim=16, n_layers=2, n_heads=2, ffn_hidden=24, max_seq_len=8)


def _llama(**kwargs):
    model = Llama(LLAMA_CONFIG)
    _shard([*model.layers, model], **kwargs)
    return model, torch.randint(0, LLAMA_CONFIG.vocab_size, (2, 8))


def _llama3(**kwargs):
    """Three blocks: with ``compile_regions`` the first runs inlined and the other two call one region."""
    config = dataclasses.replace(LLAMA_CONFIG, n_layers=3)
    model = Llama(config)
    _shard([*model.layers, model], **kwargs)
    return model, torch.randint(0, config.vocab_size, (2, 8))


def _llama_tensor_parallel(mesh, **kwargs):
    """The blocks tensor-parallel over ``mesh["tp"]``; every group sharded over ``mesh["dp"]``."""
    model = build_tensor_parallel_llama(LLAMA_CONFIG, mesh, shard=functools.partial(fully_shard, **kwargs))
    return model, torch.randint(0, LLAMA_CONFIG.vocab_size, (2, 8))


def _reused_block(**kwargs):
    torch.manual_seed(0)
    model = ReusedBlockModel()
    _shard([model.block, model], **kwargs)
    return model, torch.randn(4, 6)


def _mlp_bf16(**kwargs):
    """FSDP2's usual mixed precision: bf16 all-gathers and compute, fp32 reductions."""
    return _mlp(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), **kwargs)


MODELS = {"mlp3_uneven": _mlp, "llama2_tied": _llama, "reused_block": _reused_block}
# A cap that merges every pair of adjacent groups in these small models and no more.
BUCKET_CAP_MB = {"mlp3_uneven": 0.001, "llama2_tied": 0.012, "reused_block": 0.01}


def _staged_graphs(
    build,
    world_size,
    reshard_after_forward,
    dump_dir,
    bucket_cap_mb=0,
    compile_regions=False,
    mesh_shape=None,
    mesh_dim_names=None,
) -> str:
    """The suite's own dump of each stage, then the partitioned forward and backward graphs.

    Every block inlined unless ``compile_regions``: each pass's work then shows op by op
    in every block (``test_golden_graphs_with_compile_regions`` holds the default layout).
    """
    capture = CapturingBackend()
    torch._dynamo.reset()
    # The schedule of a machine that overlaps communication (prefetch and reductions in
    # flight); on CPU the suite would default to none (``scheduled_depths``). Profiler
    # ranges would frame each collective and wait in the golden files without changing
    # what runs: tests/test_profile_ranges.py holds them.
    schedule_for = pass_settings(
        bucket_cap_mb=bucket_cap_mb,
        cost_profile="h100_nvlink",
        compile_regions=compile_regions,
        profile_ranges=False,
    )
    with FakeProcessGroup(world_size), dump_graphs(dump_dir), schedule_for:
        torch.manual_seed(0)
        # One mesh object for the whole model: DTensor brings its DeviceMesh into the
        # graph as an opaque input, and separate-but-equal meshes would make the graph
        # depend on object identities left over from earlier tests.
        mesh = init_device_mesh("cpu", mesh_shape or (world_size,), mesh_dim_names=mesh_dim_names)
        model, example = build(mesh=mesh, reshard_after_forward=reshard_after_forward)
        compiled = torch.compile(model, backend=capture.backend, fullgraph=True)
        compiled(example).float().sum().backward()
    torch._dynamo.reset()
    (graph_dir,) = (dump_dir / "rank0").iterdir()
    # The numbered stages end with the scheduled forward and backward graphs; the
    # simulated schedule (timings) is not part of the golden files.
    sections = [(path.stem, path.read_text()) for path in sorted(graph_dir.glob("[0-9][0-9]_*.txt"))]
    expected_titles = [f"{len(sections) - 2:02d}_forward", f"{len(sections) - 1:02d}_backward"]
    assert [title for title, _ in sections[-2:]] == expected_titles
    return "".join(f"===== {title}\n{text}" for title, text in sections)


def _assert_golden(name: str, actual: str) -> None:
    """See [Note: golden graphs per torch version]."""
    base, own = GOLDEN_DIR / f"{name}.txt", RELEASE_DIR / f"{name}.txt"
    if expecttest.ACCEPT:
        if TORCH_VERSION == BASE_TORCH:
            base.write_text(actual)
        elif base.exists() and base.read_text() == actual:
            own.unlink(missing_ok=True)
        else:
            own.parent.mkdir(exist_ok=True)
            own.write_text(actual)
        return
    path = own if TORCH_VERSION != BASE_TORCH and own.exists() else base
    assert path.exists(), f"no golden graph {path.name}; record it with EXPECTTEST_ACCEPT=1"
    expected = path.read_text()
    if actual != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True), path.name, "actual"))
        pytest.fail(f"{path.name} changed (EXPECTTEST_ACCEPT=1 regenerates):\n{diff[:20000]}")


@pytest.mark.parametrize("bucketed", [False, True], ids=["", "bucketed"])
@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["reshard", "no_reshard"])
@pytest.mark.parametrize("world_size", [2, 8])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_golden_graphs(model, world_size, reshard_after_forward, bucketed, tmp_path):
    name = f"{model}_ws{world_size}_{'reshard' if reshard_after_forward else 'no_reshard'}"
    name += "_bucketed" if bucketed else ""
    cap = BUCKET_CAP_MB[model] if bucketed else 0
    _assert_golden(name, _staged_graphs(MODELS[model], world_size, reshard_after_forward, tmp_path, cap))


@pytest.mark.parametrize("world_size", [2, 8])
def test_golden_graphs_with_compile_regions(world_size, tmp_path):
    """settings.compile_regions: the last two blocks call one region, whose body follows each graph."""
    name = f"llama3_tied_ws{world_size}_reshard_regions"
    _assert_golden(name, _staged_graphs(_llama3, world_size, True, tmp_path, compile_regions=True))


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["reshard", "no_reshard"])
@pytest.mark.parametrize("world_size", [2, 8])
def test_golden_graphs_with_mixed_precision(world_size, reshard_after_forward, tmp_path):
    """bf16 parameters, fp32 reductions: the copy-in casts, the reduction input casts while it lays out."""
    name = f"mlp3_uneven_bf16_ws{world_size}_{'reshard' if reshard_after_forward else 'no_reshard'}"
    _assert_golden(name, _staged_graphs(_mlp_bf16, world_size, reshard_after_forward, tmp_path))


@pytest.mark.parametrize("mesh_shape", [(2, 4)], ids=["2x4"])
def test_golden_graphs_with_hsdp(mesh_shape, tmp_path):
    """HSDP: each reduce-scatter over the shard dimension, then an all-reduce over the replicate dimension."""
    world_size = mesh_shape[0] * mesh_shape[1]
    name = f"mlp3_uneven_hsdp_{mesh_shape[0]}x{mesh_shape[1]}_reshard"
    graphs = _staged_graphs(
        _mlp, world_size, True, tmp_path, mesh_shape=mesh_shape, mesh_dim_names=("replicate", "shard")
    )
    _assert_golden(name, graphs)


def test_golden_graphs_with_tensor_parallel_blocks(tmp_path):
    """TP + FSDP on a (4, 2) mesh: the blocks' row-parallel all-reduces beside each group's all-gather and reduce-scatter."""
    graphs = _staged_graphs(
        _llama_tensor_parallel, 8, True, tmp_path, mesh_shape=(4, 2), mesh_dim_names=("dp", "tp")
    )
    _assert_golden("llama2_tied_tp_4x2_reshard", graphs)
