"""The README's promises: an installable wheel with no generic top-level name, and a demo that runs."""

import re
import subprocess
import sys
import zipfile
from pathlib import Path

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
    assert "compile_shard/passes/__init__.py" in names and "compile_shard/ops.py" in names


def test_demo_prints_losses_next_to_the_reference():
    result = subprocess.run(
        [sys.executable, "-m", "compile_shard.demo", "--nproc", "3", "--steps", "2", "--dim", "64", "--backend", "aot_eager"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    number = r"\s+([0-9.]+)"
    row = rf"^\s+\d+{number}{number}{number} ms{number}{number} ms\s+(\d+)\s+(\d+)$"
    rows = re.findall(row, result.stdout, re.MULTILINE)
    assert len(rows) == 2, result.stdout
    for reference, eager, _, compiled, _, all_gathers, reduce_scatters in rows:
        assert abs(float(eager) - float(reference)) <= 1e-6
        assert abs(float(compiled) - float(reference)) <= 1e-6
        assert (int(all_gathers), int(reduce_scatters)) == (5, 3)  # 2 blocks + root; blocks re-gather in backward
    assert "3 gloo ranks" in result.stdout and "rank 2:" in result.stdout
