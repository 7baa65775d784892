"""save_cache_artifacts and load_cache_artifacts: a restarted job loads its compiled step from one file per rank."""

import json
import os
import pickle
import warnings
from pathlib import Path

import pytest

import torch
import torch._dynamo

import compile_shard
from compile_shard import _cache_artifacts
from compile_shard._versions import CACHES_DYNAMO_OUTPUT
from compile_shard.models import LlamaConfig
from compile_shard.passes import settings
from dist_utils import FakeProcessGroup, build_sharded_llama

def test_every_class_fully_shard_makes_is_rebuilt_from_its_recipe():
    """The three run-time class families (FSDP, managed attributes, counted writes) each pickle by recipe."""
    torch._dynamo.reset()
    with FakeProcessGroup(2):
        model, _ = build_sharded_llama(LlamaConfig(n_layers=2))
        torch.compile(model, backend="aot_eager")(torch.randint(0, 1001, (2, 8))).sum().backward()
    torch._dynamo.reset()
    kinds = set()
    for module in model.modules():
        cls = type(module)
        recipe = _cache_artifacts.class_recipe(cls)
        if recipe[0] != "user":  # the user's own classes pickle by module and name
            kinds.add(recipe[0])
            assert _cache_artifacts.rebuild_class(pickle.loads(pickle.dumps(recipe))) is cls
    assert kinds == {"fsdp", "managed_attributes", "counts_writes"}


def test_a_class_this_process_did_not_make_is_refused_by_name():
    with pytest.raises(RuntimeError, match="no module of this process has the class"):
        _cache_artifacts.rebuild_class(("fsdp", ("user", "my_models", "Block")))


def test_a_file_from_another_setup_is_not_loaded_and_the_warning_names_what_differs(tmp_path):
    header = {**_cache_artifacts._header(), "pass_settings": "other", "world_size": 8}
    (tmp_path / "rank0.bin").write_bytes(json.dumps(header).encode() + b"\nnot torch's bytes")
    with torch._dynamo.config.patch(caching_precompile=False):
        with pytest.warns(UserWarning, match=r"pass_settings: saved 'other', now '\w+'; world_size: saved 8, now 1"):
            assert not compile_shard.load_cache_artifacts(tmp_path)


def test_the_file_is_keyed_on_the_pass_settings():
    before = _cache_artifacts._header()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(settings, "bucket", not settings.bucket)
        assert _cache_artifacts._header()["pass_settings"] != before["pass_settings"]


def test_saving_when_torch_has_nothing_to_save_says_when_to_call_it(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    with torch._dynamo.config.patch(caching_precompile=True), pytest.raises(RuntimeError, match="first compiled step"):
        compile_shard.save_cache_artifacts(tmp_path)
    assert not (tmp_path / "rank0.bin").exists()


def _two_steps(model, runnable, rank, world_size) -> list[torch.Tensor]:
    """The losses of two AdamW steps of ``runnable`` (``model`` or its compiled form) on this rank's batches."""
    from dist_utils import global_batch, lm_loss

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(2):
        loss = lm_loss(runnable, global_batch(step, world_size, 2, 16, 1001)[2 * rank : 2 * rank + 2])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def _train_and_save_or_load(rank, world_size, folder, phase):
    """Two compiled steps of a Llama under Inductor; ``phase`` "first" saves, the others load.

    "restarted" builds the same 2-layer model, from an empty Inductor cache directory
    of its own, as a job restarted on other machines does: all it has is the folder of
    saved files. "deeper" builds a 3-layer one, which the saved trace's guards must
    turn away, on the first's machine (its cache directory).
    """
    from torch._dynamo.utils import counters

    directory = "restarted" if phase == "restarted" else "first"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, f"inductor_{directory}_rank{rank}")
    model, _ = build_sharded_llama(LlamaConfig(n_layers=3 if phase == "deeper" else 2))
    artifacts = os.path.join(folder, "compiled")
    assert compile_shard.load_cache_artifacts(artifacts) == (phase != "first")
    compiled = torch.compile(model)
    losses = _two_steps(model, compiled, rank, world_size)
    losses_path = os.path.join(folder, f"losses_{phase}_rank{rank}.pt")
    torch.save(losses, losses_path)
    rank_file = Path(artifacts) / f"rank{rank}.bin"
    loaded = None if phase == "first" else rank_file.read_bytes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert compile_shard.save_cache_artifacts(artifacts) == rank_file
    kept = [w for w in caught if "is kept as this run loaded it" in str(w.message)]
    assert len(kept) == (phase == "deeper")  # the deeper run compiled what the file lacks
    if phase == "first":
        assert counters["stats"]["unique_graphs"] == 1
        return
    assert rank_file.read_bytes() == loaded  # a run that loaded the file keeps it
    if phase == "deeper":  # traced anew: the saved trace's guards turned it away
        assert counters["stats"]["unique_graphs"] == 1
        return
    # No joint trace, pass suite or Inductor compile, no Dynamo trace either from torch 2.15, and the same numbers.
    assert counters["stats"]["unique_graphs"] == (0 if CACHES_DYNAMO_OUTPUT else 1)
    assert not counters["aot_autograd"]["autograd_cache_miss"]
    first = torch.load(os.path.join(folder, f"losses_first_rank{rank}.pt"))
    torch.testing.assert_close(torch.stack(losses), torch.stack(first), rtol=0, atol=0)


def _train_eagerly(rank, world_size, folder):
    model, _ = build_sharded_llama(LlamaConfig(n_layers=3))
    losses = _two_steps(model, model, rank, world_size)
    deeper = torch.load(os.path.join(folder, f"losses_deeper_rank{rank}.pt"))
    torch.testing.assert_close(torch.stack(deeper), torch.stack(losses), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_restarted_job_loads_its_compiled_step_and_traces_nothing():
    """The same model loads the saved step; a deeper one, which the saved guards reject, compiles its own.

    Before torch 2.15 the file holds no Dynamo trace (``CACHES_DYNAMO_OUTPUT``), and the
    restarted job traces again: the test shows the rest of its step is loaded.
    """
    from dist_utils import run_gloo, tmp_path_for_workers

    folder = tmp_path_for_workers()
    for phase in ("first", "restarted", "deeper"):
        run_gloo(_train_and_save_or_load, 2, folder, phase)
    run_gloo(_train_eagerly, 2, folder)
