"""benchmarks/cold_start.py on the smoke configuration: one fresh process per mode, its phases and its report.

``aot_eager`` keeps the file fast: it builds no C++ kernels, so the kernel count is 0
and Inductor's forward and backward compile phases are absent.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

# Runs the benchmark script (minutes of Inductor compilation): CI's slow tier.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "cold_start.py"
MODES = ["fsdp2_block_compiled", "cs_compiled", "cs_compiled_inlined", "gathered_regions"]


def _load_script():
    spec = importlib.util.spec_from_file_location("cold_start", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("cold_start") / "report.json"
    command = [
        sys.executable, str(SCRIPT), "--config", "smoke", "--backend", "aot_eager",
        "--modes", ",".join(MODES), "--json", str(path),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "x fsdp2_block_compiled" in result.stdout  # the table was printed
    return json.loads(path.read_text())


def test_every_mode_ran_once_in_a_process_of_its_own(report):
    assert report["rounds"] == 1 and report["backend"] == "aot_eager"
    assert list(report["runs"]) == list(report["medians"]) == MODES
    for mode, runs in report["runs"].items():
        (run,) = runs
        assert run["cold_step_s"] > 0 and run["second_step_s"] > 0 and run["steady_step_s"] > 0, mode
        assert run["kernels"] == 0, mode  # aot_eager compiles no C++


def test_torch_recorded_the_dynamo_and_aot_phases(report):
    """The phase names are torch's ``compile_times`` keys: a rename would read as 0 s here."""
    for mode, medians in report["medians"].items():
        assert medians["dynamo_s"] > 0 and medians["aot_trace_s"] > 0, mode
        assert medians["dynamo_s"] + medians["aot_trace_s"] < medians["cold_step_s"], mode


def test_ratios_are_against_fsdp2_with_per_block_compile(report):
    medians = report["medians"]
    baseline = medians["fsdp2_block_compiled"]["cold_step_s"]
    assert medians["fsdp2_block_compiled"]["cold_ratio"] == 1.0
    assert medians["cs_compiled"]["cold_ratio"] == pytest.approx(medians["cs_compiled"]["cold_step_s"] / baseline)


def test_unknown_modes_are_refused(capsys):
    cold_start = _load_script()
    with pytest.raises(SystemExit):
        cold_start._parse_args(["--modes", "cs_compiled,ddp"])
    assert "unknown mode(s) ['ddp']" in capsys.readouterr().err


def test_inductor_kernels_are_counted(tmp_path):
    """With Inductor every distinct kernel is one ``*.main.so`` in the run's fresh cache directory."""
    path = tmp_path / "report.json"
    command = [
        sys.executable, str(SCRIPT), "--config", "smoke", "--modes", "unsharded_block_compiled", "--json", str(path),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    (run,) = json.loads(path.read_text())["runs"]["unsharded_block_compiled"]
    assert run["kernels"] > 0
    assert run["forward_compile_s"] > 0 and run["backward_compile_s"] > 0
