"""examples/fsdp2_tutorial.py against torch FSDP2 running the same script (``--fully-shard torch``).

Each case trains 10 steps, saves, and resumes for 3 more from the checkpoint, under
torchrun with 2 gloo ranks, with each of the tutorial's options on in one case and off
in another. Eager: every step's loss and gradient norm, and the final checkpoint, are
bitwise torch FSDP2's. Compiled with Inductor: every step's loss and gradient norm are
within twice the largest distance torch FSDP2 compiled shows from its eager run
([Note: the compiled oracle] in tests/test_inductor_numerics.py).
"""

from __future__ import annotations

import re

import pytest
import torch

from test_examples import _torchrun

SMALL = ["--layers", "2", "--dim", "16", "--vocab-size", "128", "--seq-len", "16", "--batch-size", "8"]
FIRST_STEPS, RESUMED_STEPS = 10, 3
TOLERANCE_FACTOR = 2


def _train_and_resume(folder, *flags: str) -> dict[int, tuple[float, float]]:
    """Loss and gradient norm per step: 10 steps, saved, then 3 resumed from the checkpoint."""
    records = {}
    for steps in (FIRST_STEPS, RESUMED_STEPS):
        result = _torchrun("fsdp2_tutorial.py", *SMALL, *flags, "--steps", str(steps), "--checkpoint-dir", str(folder))
        for step, loss, grad_norm in re.findall(r"^step (\d+) loss (\S+) grad_norm (\S+)$", result.stdout, re.M):
            records[int(step)] = (float(loss), float(grad_norm))
    assert sorted(records) == list(range(FIRST_STEPS + RESUMED_STEPS)), records
    return records


def _final_checkpoint(folder, flags) -> dict:
    api = "dcp_api" if "--dcp-api" in flags else "dtensor_api"
    return torch.load(folder / api / str(FIRST_STEPS + RESUMED_STEPS) / "model_state_dict.pt", weights_only=True)


# The quick tier runs the bf16 recipe with explicit prefetching; the DCP variant is slow-tier
# (tests/test_checkpointing.py checks DCP against torch's FSDP2 in the quick tier).
@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(("--mixed-precision", "--explicit-prefetching"), id="bf16_prefetch_dtensor_api"),
        pytest.param(("--dcp-api",), id="fp32_dcp_api", marks=pytest.mark.slow),
    ],
)
def test_eager_tutorial_is_torch_fsdp2_bitwise(tmp_path, flags):
    if "--dcp-api" in flags:
        pytest.importorskip("numpy", reason="torch 2.13's broadcast_from_rank0 sends the layout as Python objects")
    ours = _train_and_resume(tmp_path / "ours", "--eager", *flags)
    theirs = _train_and_resume(tmp_path / "theirs", "--eager", "--fully-shard", "torch", *flags)
    assert ours == theirs
    ours_state, theirs_state = (_final_checkpoint(tmp_path / name, flags) for name in ("ours", "theirs"))
    assert ours_state.keys() == theirs_state.keys()
    for name, tensor in ours_state.items():
        assert torch.equal(tensor, theirs_state[name]), name


# Slow tier: six launches, each compiling with Inductor (the quick tier's Inductor
# numerics are tests/test_inductor_numerics.py's).
@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [("--mixed-precision", "--explicit-prefetching", "--dcp-api"), ()],
    ids=["bf16_prefetch_dcp_api", "fp32_dtensor_api"],
)
def test_compiled_tutorial_is_as_close_to_eager_as_torch_fsdp2_compiled(tmp_path, flags):
    if "--dcp-api" in flags:
        pytest.importorskip("numpy", reason="torch 2.13's broadcast_from_rank0 sends the layout as Python objects")
    ours = _train_and_resume(tmp_path / "ours", *flags)
    theirs = _train_and_resume(tmp_path / "theirs", "--fully-shard", "torch", *flags)
    theirs_eager = _train_and_resume(tmp_path / "theirs_eager", "--eager", "--fully-shard", "torch", *flags)
    for index, quantity in enumerate(("loss", "gradient norm")):
        def distance(run, step):
            return abs(run[step][index] - theirs_eager[step][index]) / abs(theirs_eager[step][index])

        scale = max(distance(theirs, step) for step in theirs_eager)
        for step in theirs_eager:
            assert distance(ours, step) <= TOLERANCE_FACTOR * scale, (quantity, step, ours, theirs, theirs_eager)
