"""benchmarks/report.py: every measured number of README.md and docs/ is generated from benchmarks/results/current/.

Pure file work, a second or two: the script needs no torch. A test that changes a
document or a result changes a copy of what the script reads (``repo``), which passes
the check before the change, so each failure below is the change's.
"""

import copy
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "report.py"
RESULTS = ROOT / "benchmarks" / "results" / "current"
META_FIELDS = ("commit", "torch", "hardware", "command", "date")


def _report(*args: str, root: Path = ROOT) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), *args, "--root", str(root)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of README.md, docs/*.md and the current results, which passes the check."""
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "README.md", tmp_path)
    for path in (ROOT / "docs").glob("*.md"):
        shutil.copy(path, tmp_path / "docs")
    shutil.copytree(RESULTS, tmp_path / "benchmarks" / "results" / "current")
    result = _report("--check", root=tmp_path)
    assert result.returncode == 0, result.stderr
    return tmp_path


def _append(path: Path, text: str) -> int:
    """Appends a paragraph to a document; its line number."""
    old = path.read_text()
    path.write_text(old + "\n" + text + "\n")
    return old.count("\n") + 2


def test_the_docs_show_the_current_results():
    result = _report("--check")
    assert result.returncode == 0, result.stderr + "\nrun: python benchmarks/report.py"


def test_every_current_result_records_what_was_measured():
    paths = sorted(RESULTS.glob("*.json"))
    assert paths, "no current results"
    for path in paths:
        meta = json.loads(path.read_text()).get("meta", {})
        for field in META_FIELDS:
            assert isinstance(meta.get(field), str) and meta[field].strip(), f"{path.name}: meta.{field}"
        assert "benchmarks/" in meta["command"], f"{path.name}: the command names no benchmark script"


@pytest.mark.parametrize(
    "document, number",
    [("README.md", "0.47x"), ("docs/benchmarks.md", "2.8 s"), ("docs/design.md", "24 ms"), ("docs/api.md", "12%"),
     ("docs/benchmarks.md", "761 MB"), ("docs/debugging.md", "49 MiB"), ("README.md", "23 µs")],
)
def test_a_measured_number_written_by_hand_fails_the_check(repo, document, number):
    line = _append(repo / document, f"The compiled step takes {number} against FSDP2 eager's.")
    result = _report("--check", root=repo)
    assert result.returncode == 1
    assert f"{document}:{line}: {number!r} is a measured number written by hand" in result.stderr


def test_the_same_number_generated_passes_the_check(repo):
    readme = repo / "README.md"
    _append(readme, "The compiled step takes <!-- value: step_fp32 --><!-- end of value --> FSDP2 eager's.")
    result = _report("--check", root=repo)
    assert result.returncode == 1 and "README.md: the value step_fp32 is out of date" in result.stderr

    assert _report(root=repo).returncode == 0
    modes = json.loads((RESULTS / "config_B_W2_fp32.json").read_text())["modes"]
    ratio = modes["cs_compiled"]["median_step_s"] / modes["fsdp2_eager"]["median_step_s"]
    assert f"<!-- value: step_fp32 -->{ratio:.2f}x<!-- end of value -->" in readme.read_text()
    result = _report("--check", root=repo)
    assert result.returncode == 0, result.stderr


def test_numbers_that_are_not_measurements_pass_the_check(repo):
    _append(
        repo / "docs" / "benchmarks.md",
        "On x86_64 with fp32, 8 layers and 3 steps of `hsdp_2x2` (`--timeout 60 s`, `0.5x`):\n\n"
        "```bash\npython benchmarks/train_bench.py  # 2.8 s, 0.48x\n```",
    )
    result = _report("--check", root=repo)
    assert result.returncode == 0, result.stderr


def test_a_value_that_names_no_figure_fails_the_check(repo):
    _append(repo / "README.md", "It takes <!-- value: no_such_figure -->1.00x<!-- end of value --> of it.")
    result = _report("--check", root=repo)
    assert result.returncode == 1 and "no figure named no_such_figure" in result.stderr


@pytest.mark.parametrize("document", ["README.md", "docs/benchmarks.md"])
def test_the_check_fails_on_an_altered_table_and_the_script_restores_it(repo, document):
    path = repo / document
    original = path.read_text()
    # The first data row of the document's first generated table: its second cell gets another figure.
    block = re.search(r"<!-- table: (\S+) .*?-->\n.*?\n\|.*?\n\|.*?\n(\| [^|]+\| )([^|]+)", original, re.DOTALL)
    assert block is not None, f"no generated table in {document}"
    path.write_text(original[: block.start(3)] + "999.9 " + original[block.end(3) :])

    result = _report("--check", root=repo)
    assert result.returncode == 1
    assert f"{document}: the table of {block.group(1)} is out of date" in result.stderr

    assert _report(root=repo).returncode == 0
    assert path.read_text() == original


def test_a_result_without_a_table_or_without_its_meta_fails_the_check(repo):
    results = repo / "benchmarks" / "results" / "current"
    name = sorted(results.glob("*.json"))[0].stem
    (results / f"{name}_copy.json").write_text((results / f"{name}.json").read_text())
    result = _report("--check", root=repo)
    assert result.returncode == 1 and f"no block for {name}_copy" in result.stderr

    (results / f"{name}_copy.json").unlink()
    data = json.loads((results / f"{name}.json").read_text())
    del data["meta"]["hardware"]
    (results / f"{name}.json").write_text(json.dumps(data))
    result = _report("--check", root=repo)
    assert result.returncode == 1 and "hardware" in result.stderr


def test_a_figure_whose_result_is_gone_fails_the_check(repo):
    (repo / "benchmarks" / "results" / "current" / "config_B_W2_fp32.json").unlink()
    result = _report("--check", root=repo)
    assert result.returncode == 1
    assert "the figure step_fp32 reads config_B_W2_fp32, which has no file" in result.stderr


def test_the_commands_rerun_every_current_result():
    result = _report("--commands")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    paths = sorted(RESULTS.glob("*.json"))
    assert [line.split(":")[0] for line in lines[0::2]] == [f"# {path.name}" for path in paths]
    assert lines[1::2] == [json.loads(path.read_text())["meta"]["command"] for path in paths]


def _report_module(monkeypatch):
    spec = importlib.util.spec_from_file_location("benchmark_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses resolve annotations there
    spec.loader.exec_module(module)
    return module


def _cells(table: str) -> list[list[str]]:
    return [line.strip("| ").split(" | ") for line in table.splitlines()]


def test_a_train_bench_table_shows_the_ratio_to_the_floor_when_the_result_has_it(monkeypatch):
    """A column beside the median; a result from before the floor renders as it did."""
    report = _report_module(monkeypatch)
    old = json.loads((RESULTS / "config_B_W2_fp32.json").read_text())
    old["modes"].pop("floor", None)  # as a result from before the floor was measured
    for result in old["modes"].values():
        result.pop("ratios_to_floor", None)
    assert "vs floor" not in report._train_bench(old)
    new = copy.deepcopy(old)
    floor_median = old["modes"]["reference"]["median_step_s"] / 2
    new["modes"]["floor"] = {**copy.deepcopy(old["modes"]["reference"]), "median_step_s": floor_median}
    for result in new["modes"].values():
        result["ratios_to_floor"] = {"median_step_s": result["median_step_s"] / floor_median}

    rows = _cells(report._train_bench(new))
    median = rows[0].index("median s")
    assert rows[0][median + 1] == "vs floor"
    for row, (mode, result) in zip(rows[2:], new["modes"].items()):
        assert row[0] == mode and row[median + 1] == f"{result['median_step_s'] / floor_median:.2f}x"
    # Without the new column and the floor's row, the table is the old one.
    assert [row[: median + 1] + row[median + 2 :] for row in rows[:-1]] == _cells(report._train_bench(old))
