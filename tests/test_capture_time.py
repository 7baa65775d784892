"""benchmarks/capture_time.py at 3 layers: one fresh process per mode, and the region calls each mode captured."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "capture_time.py"


@pytest.mark.slow
def test_each_mode_captures_its_own_region_calls(tmp_path):
    """Inlined blocks call no region; compile_shard, torch's floor and the blocks sharded by hand make every block
    one (compile_shard's first block after Dynamo, as Inductor gets the graph: ``reuse_first_blocks``)."""
    path = tmp_path / "capture.json"
    command = [sys.executable, str(SCRIPT), "--layers", "3", "--json", str(path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| unsharded_regions | 3 |" in result.stdout  # the table was printed
    rows = {row["mode"]: row for row in json.loads(path.read_text())["rows"]}
    # Forward and backward: all three blocks.
    assert {mode: row["region_calls"] for mode, row in rows.items()} == {
        "inlined": 0,
        "regions": 6,
        "unsharded_regions": 6,
        "gathered_regions": 6,
    }
    # Nothing sharded by fully_shard: the pass suite never ran.
    assert rows["unsharded_regions"]["passes_s"] == rows["gathered_regions"]["passes_s"] == 0
    assert all(row["capture_s"] > 0 and row["vs_smallest"] == 1.0 for row in rows.values())
    for row in rows.values():  # Dynamo's own work and its backend's are parts of the capture; the suite, of the backend's size at most
        assert 0 < row["dynamo_s"] and row["passes_s"] < row["backend_s"]
        assert row["dynamo_s"] + row["backend_s"] <= row["capture_s"]


def test_unknown_modes_are_refused():
    command = [sys.executable, str(SCRIPT), "--modes", "regions,per_block"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 2 and "unknown mode(s) ['per_block']" in result.stderr
