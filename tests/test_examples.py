"""The examples run as a user runs them, under torchrun with 2 gloo ranks.

Each run compiles with ``aot_eager`` (compile_shard's joint-graph passes run; Inductor
would add minutes of C++ compilation per run on a 2-core machine). Losses are checked
against an unsharded eager reference built from the example's own functions, and a
resumed run against the uninterrupted one, digit for digit.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BACKEND = "aot_eager"
STEPS = 4
SMALL = ["--layers", "1", "--seq", "16", "--batch-size", "4", "--lr", "1e-2", "--backend", BACKEND]
LLAMA_ARGS = [*SMALL, "--dim", "32"]
HF_ARGS = [*SMALL, "--hidden", "32"]


def _torchrun(script: str, *args: str, expect_success: bool = True) -> subprocess.CompletedProcess:
    """Runs ``examples/<script>`` on 2 processes; a failure's message carries each rank's tail.

    A launch in which a rank died of SIGABRT runs once more ([Note: gloo's aborts]).
    """
    # --standalone: torchrun's rendezvous store binds a port the OS picks. A port picked
    # here and passed in could be taken (by another test's gloo connections, say) before
    # torchrun binds it.
    # --tee 2: each rank's stderr comes back prefixed with its rank ("[default1]:").
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--tee", "2"]
    command += [str(EXAMPLES / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = _launch(command, env)
    if expect_success and result.returncode != 0 and _GLOO_ABORT in result.stderr:
        warnings.warn(f"a rank aborted (SIGABRT); ran again:\n{_tails(result)}")
        result = _launch(command, env)
    if (result.returncode == 0) != expect_success:
        pytest.fail(f"{' '.join(command)} exited with {result.returncode}\n{_tails(result)}")
    return result


# A rank's SIGABRT, as torchrun reports it ([Note: gloo's aborts] in tests/dist_utils.py).
_GLOO_ABORT = "Signal 6 (SIGABRT)"


def _launch(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as error:
        parts = (error.stdout, error.stderr)
        output = "".join(part.decode() if isinstance(part, bytes) else part or "" for part in parts)
        pytest.fail(f"{' '.join(command)} timed out; output's tail:\n{output[-8000:]}")


def _tails(result: subprocess.CompletedProcess) -> str:
    """The tail of stdout and of each rank's stderr: one rank's traceback can fill the whole tail."""
    by_source: dict[str, list[str]] = {}
    for line in result.stderr.splitlines():
        match = re.match(r"\[default(\d+)\]:", line)
        by_source.setdefault(f"rank {match.group(1)}" if match else "torchrun", []).append(line)
    parts = [f"--- stdout (tail) ---\n{result.stdout[-3000:]}"]
    for source, lines in sorted(by_source.items()):
        tail = "\n".join(lines)[-4000:]
        parts.append(f"--- stderr of {source} (tail) ---\n{tail}")
    return "\n".join(parts)


def _losses(stdout: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in re.findall(r"^step (\d+) loss (\S+)$", stdout, re.MULTILINE)}


def _load_example(name: str):
    """The example as a module, for its model, data and loss (its ``main`` does not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference_losses(model, loss_fn, batches, lr: float) -> list[float]:
    """Unsharded, eager, one process, the whole global batch per step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for tokens in batches:
        loss = loss_fn(model, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _assert_close_to_reference(losses: dict[int, float], reference: list[float], output: str) -> None:
    assert sorted(losses) == list(range(1, len(reference) + 1)), output
    # Step 1 is a forward on the same weights; later steps add the rounding of the
    # averaged, reduce-scattered gradients (here about 1e-6).
    for step, expected in enumerate(reference, start=1):
        assert abs(losses[step] - expected) <= 1e-5, (step, losses, reference)
    assert losses[len(reference)] < losses[1] - 0.05, losses  # it learns


def _has_numpy() -> bool:
    return importlib.util.find_spec("numpy") is not None


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """The uninterrupted run, checkpointing after step 2 (and the last) where DCP can (numpy)."""
    checkpoints = tmp_path_factory.mktemp("checkpoints")
    args = ["--steps", str(STEPS), *LLAMA_ARGS]
    if _has_numpy():
        args += ["--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2"]
    return _torchrun("train_llama.py", *args), checkpoints


@pytest.mark.slow
def test_train_llama_matches_an_unsharded_reference(llama_run):
    result, _ = llama_run
    example = _load_example("train_llama")
    args = example.parse_args(["--steps", str(STEPS), *LLAMA_ARGS])
    batches = [example.global_batch(step, args) for step in range(1, STEPS + 1)]
    reference = _reference_losses(example.build_full_model(args), example.lm_loss, batches, args.lr)
    _assert_close_to_reference(_losses(result.stdout), reference, result.stdout)


@pytest.mark.slow
@pytest.mark.skipif(
    not _has_numpy(),
    reason="torch.distributed.checkpoint plans through object collectives, which torch 2.13 decodes with numpy",
)
def test_train_llama_resumes_exactly_from_a_checkpoint(llama_run):
    first, checkpoints = llama_run
    assert (checkpoints / "step_2" / ".metadata").is_file(), first.stdout
    resumed = _torchrun("train_llama.py", "--steps", str(STEPS), *LLAMA_ARGS, "--resume", str(checkpoints / "step_2"))
    uninterrupted = _losses(first.stdout)
    # The same float, to the last digit (printed with repr): model, AdamW state and step restored.
    assert _losses(resumed.stdout) == {step: uninterrupted[step] for step in range(3, STEPS + 1)}, (
        first.stdout,
        resumed.stdout,
    )


def test_a_failing_rank_shows_its_own_error():
    """A dim the heads do not divide fails in every rank's first forward; torchrun's report names it."""
    bad_dim = ["--dim", "34", "--backend", "none"]
    result = _torchrun("train_llama.py", "--steps", "1", *LLAMA_ARGS, *bad_dim, expect_success=False)
    root_cause = result.stderr.rpartition("Root Cause")[2]
    assert "don't multiply up to the size of dim" in root_cause, result.stderr[-8000:]
    assert "train_llama.py" in root_cause and "Connection closed by peer" not in root_cause, result.stderr[-8000:]


@pytest.mark.slow
def test_train_hf_llama_matches_an_unsharded_reference():
    pytest.importorskip("transformers")
    result = _torchrun("train_hf_llama.py", "--steps", str(STEPS), *HF_ARGS)
    example = _load_example("train_hf_llama")
    args = example.parse_args(["--steps", str(STEPS), *HF_ARGS])
    batches = [example.global_batch(step, args) for step in range(1, STEPS + 1)]
    def loss_fn(model, tokens):
        return model(input_ids=tokens, labels=tokens).loss

    reference = _reference_losses(example.build_full_model(args), loss_fn, batches, args.lr)
    _assert_close_to_reference(_losses(result.stdout), reference, result.stdout)
