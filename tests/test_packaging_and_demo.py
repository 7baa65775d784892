"""The README's promises: an installable wheel with no generic top-level name, and a demo that runs."""

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_runtime_and_passes_under_one_name(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("*.whl")
    top_level = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"compile_shard"}
    names = zipfile.ZipFile(wheel).namelist()
    assert "compile_shard/passes/__init__.py" in names and "compile_shard/ops/__init__.py" in names


def _run_demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "compile_shard.demo", *args], capture_output=True, text=True, timeout=300
    )


def _output(result: subprocess.CompletedProcess) -> str:
    return f"exit status {result.returncode}\nstdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"


@pytest.mark.slow  # the README's demo command, which CI also runs as written
def test_demo_prints_losses_next_to_the_reference():
    result = _run_demo("--nproc", "3", "--steps", "2", "--layers", "1", "--dim", "64", "--backend", "aot_eager")
    assert result.returncode == 0, _output(result)
    number = r"\s+([0-9.]+)"
    row = rf"^\s+\d+{number}{number}{number} ms{number}{number} ms\s+(\d+)\s+(\d+)$"
    rows = re.findall(row, result.stdout, re.MULTILINE)
    assert len(rows) == 2, result.stdout
    for reference, eager, _, compiled, _, all_gathers, reduce_scatters in rows:
        assert abs(float(eager) - float(reference)) <= 1e-6
        assert abs(float(compiled) - float(reference)) <= 1e-6
        assert (int(all_gathers), int(reduce_scatters)) == (3, 2)  # 1 block + root; the block re-gathers in backward
    assert "3 gloo ranks" in result.stdout and "rank 2:" in result.stdout


def test_demo_shows_the_error_of_the_rank_that_raised_it():
    # Only rank 0 runs the unsharded reference, so a head size that is not an integer
    # fails there first; rank 1 then sees its peer's connection close.
    result = _run_demo("--steps", "1", "--layers", "1", "--dim", "70", "--backend", "")
    assert result.returncode != 0, _output(result)
    assert "rank 0 failed" in result.stderr, _output(result)
    assert "unflatten: Provided sizes" in result.stderr and "don't multiply up" in result.stderr, _output(result)
