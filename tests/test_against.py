"""benchmarks/against.py: a run "at COMMIT" imports that commit's code, all of it."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_a_checkout_of_another_commit_imports_its_own_runtime_and_passes(monkeypatch, tmp_path):
    """[Note: a checkout imports its own passes]: without the link, the passes would be this tree's."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    against = pytest.importorskip("against")
    probe = "import compile_shard, compile_shard.passes as p; print(compile_shard.__file__); print(p.__file__)"
    with against.checkout("HEAD") as tree:
        finished = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=against.environment(tree), cwd=tmp_path
        )
        files = [Path(line).resolve() for line in finished.stdout.split()]
        assert [file.is_relative_to(tree.resolve()) for file in files] == [True, True], files
