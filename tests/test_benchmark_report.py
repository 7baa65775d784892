"""benchmarks/report.py: docs/benchmarks.md shows benchmarks/results/current/, each result with its meta.

Pure file work, a second or two: the script needs no torch.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "report.py"
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "benchmarks" / "results" / "current"
META_FIELDS = ("commit", "torch", "hardware", "command", "date")


def _check(doc: Path = DOC, results: Path = RESULTS) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), "--check", "--doc", str(doc), "--results", str(results)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_the_doc_shows_the_current_results():
    result = _check()
    assert result.returncode == 0, result.stderr + "\nrun: python benchmarks/report.py"


def test_every_current_result_records_what_was_measured():
    paths = sorted(RESULTS.glob("*.json"))
    assert paths, "no current results"
    for path in paths:
        meta = json.loads(path.read_text()).get("meta", {})
        for field in META_FIELDS:
            assert isinstance(meta.get(field), str) and meta[field].strip(), f"{path.name}: meta.{field}"
        assert "benchmarks/" in meta["command"], f"{path.name}: the command names no benchmark script"


def test_the_check_fails_on_an_altered_table_and_the_script_restores_it(tmp_path):
    doc = tmp_path / "benchmarks.md"
    original = DOC.read_text()
    # The first data row of the first generated table: its second cell gets another figure.
    block = re.search(r"<!-- table: (\S+) .*?-->\n.*?\n\|.*?\n\|.*?\n(\| [^|]+\| )([^|]+)", original, re.DOTALL)
    assert block is not None, "no generated table in docs/benchmarks.md"
    altered = original[: block.start(3)] + "999.9 " + original[block.end(3) :]
    doc.write_text(altered)

    result = _check(doc)
    assert result.returncode == 1
    assert block.group(1) in result.stderr

    subprocess.run([sys.executable, str(SCRIPT), "--doc", str(doc)], check=True, capture_output=True, cwd=ROOT)
    assert doc.read_text() == original


def test_a_result_without_a_table_or_without_its_meta_fails_the_check(tmp_path):
    results = tmp_path / "current"
    shutil.copytree(RESULTS, results)
    name = sorted(RESULTS.glob("*.json"))[0].stem

    (results / f"{name}_copy.json").write_text((results / f"{name}.json").read_text())
    result = _check(results=results)
    assert result.returncode == 1 and f"no block for {name}_copy" in result.stderr

    (results / f"{name}_copy.json").unlink()
    data = json.loads((results / f"{name}.json").read_text())
    del data["meta"]["hardware"]
    (results / f"{name}.json").write_text(json.dumps(data))
    result = _check(results=results)
    assert result.returncode == 1 and "hardware" in result.stderr
