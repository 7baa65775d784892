"""benchmarks/train_bench.py on its smoke configuration: the JSON report's schema, losses, collectives and ratios.

Two runs of the script, shared by the tests: six modes on 2 gloo processes, and four
modes on rank 0 of a fake process group of 8, in mixed precision (``--mp bf16``) and
with glibc's allocator reusing freed memory (``--cpu-allocator caching``); both with
the floor, against which every mode's ratios are reported too.
Compiled modes use ``aot_eager`` so that no Inductor compilation makes the file slow.
"""

import dataclasses
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from dist_utils import FakeProcessGroup, run_gloo

# Runs the benchmark script (minutes of Inductor compilation): CI's slow tier.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "train_bench.py"
GLOO_MODES = ["cs_eager", "cs_compiled", "fsdp2_eager", "ddp", "reference", "floor"]
FAKE_MODES = ["cs_compiled", "cs_compiled_inlined", "fsdp2_eager", "floor"]
TIME_FIELDS = {"cold_step_s", "median_step_s", "min_step_s"}
RATIO_FIELDS = TIME_FIELDS | {"peak_memory_mb", "step_peak_memory_mb"}
MODE_FIELDS = {
    "processes",
    "batch_shape",
    "cold_step_s",
    "median_step_s",
    "min_step_s",
    "step_times_s",
    "cpu_per_step",
    "peak_memory_mb",
    "step_peak_memory_mb",
    "param_memory_mb",
    "memory_method",
    "mallopt_applied",
    "collectives",
    "collectives_equal_on_all_ranks",
    "collectives_method",
    "graph_collectives",
    "compile",
    "losses",
    "simulation",
    "simulated_comm_s",
    "projected_step_s",
    "overlap_settings_off",
    "max_loss_diff",
    "ratios",
    "ratios_to_floor",
    "rank_check_s",
}
SMOKE_STEPS, SMOKE_WARMUP = 3, 1


def _run(tmp_path_factory, name: str, *args: str) -> dict:
    path = tmp_path_factory.mktemp(name) / "report.json"
    command = [sys.executable, str(SCRIPT), "--config", "smoke", "--backend", "aot_eager", "--json", str(path), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "max |dloss|" in result.stdout and "vs floor" in result.stdout  # the table was printed
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def gloo_report(tmp_path_factory):
    return _run(tmp_path_factory, "gloo", "--modes", ",".join(GLOO_MODES))


@pytest.fixture(scope="module")
def fake_report(tmp_path_factory):
    return _run(
        tmp_path_factory,
        "fake",
        # 3 layers: the first block runs inlined, and a region called once is inlined too.
        *("--device", "cpu", "--fake-world-size", "8", "--layers", "3", "--mp", "bf16"),
        *("--modes", ",".join(FAKE_MODES)),
        *("--cpu-allocator", "caching"),
    )


def _check_schema(report: dict, modes: list[str], world_size: int) -> None:
    assert report["schema_version"] == 1
    assert report["world_size"] == report["config"]["world_size"] == world_size
    assert report["config"]["vocab_size"] == 1001
    assert (report["config"]["steps"], report["config"]["warmup"]) == (SMOKE_STEPS, SMOKE_WARMUP)
    assert list(report["modes"]) == modes
    for name, result in report["modes"].items():
        assert set(result) == MODE_FIELDS, name
        assert len(result["step_times_s"]) == SMOKE_STEPS
        # The summaries are of the timed steps (after the cold step and the warm-up), the slowest rank's each.
        assert result["min_step_s"] == min(result["step_times_s"]) > 0, name
        assert result["median_step_s"] == statistics.median(result["step_times_s"]), name
        assert result["cold_step_s"] > 0, name
        assert len(result["losses"]) == 1 + SMOKE_WARMUP + SMOKE_STEPS + 1  # cold, warm-up, timed, counting step
        assert len(result["peak_memory_mb"]) == len(result["param_memory_mb"]) == result["processes"]
        assert len(result["cpu_per_step"]) == result["processes"]
        for cpu in result["cpu_per_step"]:
            assert set(cpu) == {"user_s", "system_s", "minor_faults"}, name
            assert cpu["user_s"] > 0 and cpu["system_s"] >= 0 and cpu["minor_faults"] >= 0, (name, cpu)
        assert all(isinstance(mb, float) for mb in result["peak_memory_mb"] + result["step_peak_memory_mb"]), name
        assert set(result["collectives"]) == {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"}
        assert result["collectives_equal_on_all_ranks"]
        _check_ratios(name, result, "ratios", report["modes"]["fsdp2_eager"])
        _check_ratios(name, result, "ratios_to_floor", report["modes"]["floor"])


def _check_ratios(name: str, result: dict, key: str, base: dict) -> None:
    """``result[key]``: each of its figures over ``base``'s."""
    assert set(result[key]) == RATIO_FIELDS
    for field in TIME_FIELDS:
        assert result[key][field] == pytest.approx(result[field] / base[field]), (name, key, field)
    for field in RATIO_FIELDS - TIME_FIELDS:  # None when the base's figure is 0 (nothing new became resident)
        largest = max(base[field])
        expected = max(result[field]) / largest if largest else None
        assert result[key][field] == pytest.approx(expected), (name, key, field)


def test_gloo_report_schema_and_ratios(gloo_report):
    _check_schema(gloo_report, GLOO_MODES, world_size=2)
    assert gloo_report["process_group"] == "gloo"
    assert gloo_report["reshard_after_forward"] is True
    assert gloo_report["cpu_allocator"] == "fixed"
    assert all(result["mallopt_applied"] for result in gloo_report["modes"].values())  # glibc on this machine
    processes = {name: result["processes"] for name, result in gloo_report["modes"].items()}
    assert processes == {"cs_eager": 2, "cs_compiled": 2, "fsdp2_eager": 2, "ddp": 2, "reference": 1, "floor": 1}
    # aot_eager has no post-partition hook, so no rank check runs: every rank reports 0 s.
    assert {name: result["rank_check_s"] for name, result in gloo_report["modes"].items()} == {
        name: [0.0] * count for name, count in processes.items()
    }


def test_gloo_losses_match_the_reference(gloo_report):
    """Eager modes within 1e-6, the compiled one (aot_eager here) within 1e-5; the floor trains other rows."""
    modes = dict(gloo_report["modes"])
    assert modes.pop("floor")["max_loss_diff"] is None
    assert modes["reference"]["max_loss_diff"] == 0.0
    for name, result in modes.items():
        bound = 1e-5 if name == "cs_compiled" else 1e-6
        assert result["max_loss_diff"] <= bound, (name, result["max_loss_diff"])


@pytest.mark.parametrize("group, bytes_per_parameter", [("gloo", 4), ("fake", 2)])
def test_the_floor_is_one_rank_batch_compiled_in_the_policy_dtype(gloo_report, fake_report, group, bytes_per_parameter):
    """One process with one rank's rows, compiled into one graph, its parameters fp32 or bf16 (``--mp bf16``)."""
    report = gloo_report if group == "gloo" else fake_report
    config, modes = report["config"], report["modes"]
    one_rank = [config["batch_per_rank"], config["seq"] + 1]
    assert modes["floor"]["batch_shape"] == modes["fsdp2_eager"]["batch_shape"] == one_rank
    assert modes["floor"]["processes"] == 1
    assert modes["floor"]["param_memory_mb"] == [pytest.approx(report["parameters"] * bytes_per_parameter / 2**20)]
    stats = modes["floor"]["compile"]
    assert (stats["unique_graphs"], stats["graph_breaks"], stats["recompiles"], stats["backend_graphs"]) == (1, 0, 0, 2)
    assert not any(modes["floor"]["collectives"].values())
    assert modes["floor"]["ratios_to_floor"]["median_step_s"] == 1.0
    if group == "gloo":  # the reference steps through every rank's rows, one rank's batch at a time
        assert modes["reference"]["batch_shape"] == [config["world_size"] * config["batch_per_rank"], config["seq"] + 1]


def test_without_the_floor_no_mode_has_ratios_to_it(monkeypatch):
    """A run without ``floor`` reports as before it existed: no ``ratios_to_floor``, no column."""
    train_bench = _import_train_bench(monkeypatch)
    figures = {field: [1.0] for field in RATIO_FIELDS - TIME_FIELDS} | {field: 1.0 for field in TIME_FIELDS}
    result = {**figures, "losses": [2.0], "param_memory_mb": [1.0], "compile": None}
    result["collectives"] = dict.fromkeys(train_bench.COLLECTIVE_KINDS, 0)
    results = {name: dict(result) for name in ("cs_compiled", "fsdp2_eager", "reference")}
    train_bench._add_comparisons(results, fake=False)
    assert all("ratios" in result and "ratios_to_floor" not in result for result in results.values())
    table = train_bench.format_table({"process_group": "gloo", "modes": results})
    assert "median s" in table and "vs floor" not in table


def _import_train_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # its own modules (against.py)
    spec = importlib.util.spec_from_file_location("train_bench", SCRIPT)
    train_bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "train_bench", train_bench)  # its dataclasses resolve annotations there
    spec.loader.exec_module(train_bench)
    return train_bench


def test_the_reference_steps_on_one_micro_batch_per_rank(monkeypatch):
    """Its loss is the mean of rank-sized micro-batches' losses: the ranks' matmul shapes."""
    train_bench = _import_train_bench(monkeypatch)
    smoke = train_bench.CONFIGS["smoke"]
    reference = train_bench.Plan("reference", smoke, False, "cpu", "aot_eager", "h100_nvlink", 1, "", 0, "")

    def micro_batches(plan):
        return train_bench._micro_batches(plan, train_bench._rows(plan, 0))

    assert micro_batches(reference) == smoke.world_size == 2
    assert micro_batches(dataclasses.replace(reference, mode="cs_eager")) == 1
    assert micro_batches(dataclasses.replace(reference, fake=True)) == 1  # one rank's rows under the fake group
    floor = dataclasses.replace(reference, mode="floor")
    assert train_bench._rows(floor, 0) == slice(0, smoke.batch_per_rank) and micro_batches(floor) == 1


def test_gloo_collectives_per_step(gloo_report):
    modes = gloo_report["modes"]
    assert modes["cs_eager"]["collectives"] == modes["fsdp2_eager"]["collectives"]
    # 2 blocks and the root gather in forward, the blocks again in backward; one reduce-scatter per group.
    expected = {"all_gather": 5, "reduce_scatter": 3, "all_reduce": 0, "all_to_all": 0}
    assert modes["fsdp2_eager"]["collectives"] == expected
    compiled = modes["cs_compiled"]
    assert compiled["collectives"] == compiled["graph_collectives"]
    # The cost model puts the two small blocks in one bucket ([Note: the cost model's buckets]
    # in passes/bucket.py): the root and the bucket gather in forward, the bucket again in
    # backward; on gloo each reduce-scatter is lowered as an all-to-all ([Note: gloo
    # reduce-scatter] in compile_shard/ops/).
    assert compiled["collectives"] == {"all_gather": 3, "reduce_scatter": 0, "all_reduce": 0, "all_to_all": 2}
    assert modes["ddp"]["collectives"]["all_reduce"] >= 1
    assert modes["ddp"]["collectives"]["all_gather"] == modes["ddp"]["collectives"]["reduce_scatter"] == 0
    assert not any(modes["reference"]["collectives"].values())


def test_gloo_compiled_mode_is_one_graph(gloo_report):
    stats = gloo_report["modes"]["cs_compiled"]["compile"]
    assert (stats["unique_graphs"], stats["graph_breaks"], stats["recompiles"]) == (1, 0, 0)
    assert stats["backend_graphs"] == 2  # forward and backward
    assert gloo_report["modes"]["cs_eager"]["compile"] is None


def test_fake_process_group_report(fake_report):
    _check_schema(fake_report, FAKE_MODES, world_size=8)
    assert fake_report["process_group"] == "fake" and fake_report["mixed_precision"] == "bf16"
    assert fake_report["cpu_allocator"] == "caching"
    for result in fake_report["modes"].values():
        assert result["mallopt_applied"] and result["memory_method"].startswith("mallopt(M_MMAP_MAX, 0)")
    compiled, eager = fake_report["modes"]["cs_compiled"], fake_report["modes"]["fsdp2_eager"]
    assert compiled["processes"] == eager["processes"] == 1
    assert compiled["max_loss_diff"] is None and eager["max_loss_diff"] is None
    # 3 blocks and the root gather in forward, the blocks again in backward.
    assert eager["collectives"] == {"all_gather": 7, "reduce_scatter": 4, "all_reduce": 0, "all_to_all": 0}
    simulation = compiled["simulation"]
    assert simulation["profile"] == fake_report["cost_profile"] == "h100_nvlink"
    assert simulation["communication_s"] > 0
    assert 0 <= simulation["exposed_communication_s"] <= simulation["communication_s"] * (1 + 1e-9)
    assert compiled["simulated_comm_s"] == simulation["exposed_communication_s"]
    assert compiled["projected_step_s"] == pytest.approx(compiled["median_step_s"] + compiled["simulated_comm_s"])
    assert eager["simulation"] is None and eager["projected_step_s"] is None


def test_regions_mode_is_one_graph_with_the_same_collectives(fake_report):
    regions, inlined = fake_report["modes"]["cs_compiled"], fake_report["modes"]["cs_compiled_inlined"]
    stats = regions["compile"]
    assert (stats["unique_graphs"], stats["graph_breaks"], stats["recompiles"]) == (1, 0, 0)
    # Blocks 2 and 3 call one region, in forward and in backward.
    assert (stats["region_calls"], inlined["compile"]["region_calls"]) == (4, 0)
    assert regions["graph_collectives"] == inlined["graph_collectives"]  # backward still gathers again
    # The same compute: both copy out with one fsdp.copy_out per gather, the regions' inside them
    # (the copy_out pass makes the inlined graph's clones one too; before it, the inlined graph's
    # clone per parameter cost 7% more).
    assert regions["simulation"]["compute_s"] == pytest.approx(inlined["simulation"]["compute_s"], rel=0.02)


def _step_collectives(build, train_bench, param_dtype):
    from compile_shard.debug import CollectiveCounter
    from compile_shard.models import Llama

    llama = train_bench.CONFIGS["smoke"].llama()
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,))
    model = build(Llama(llama), train_bench.BuildContext(mesh, None, False, param_dtype))
    tokens = torch.randint(0, llama.vocab_size, (2, 9))
    with CollectiveCounter() as counter:
        train_bench._lm_loss(model, tokens).backward()
    return dict(counter.counts), dict(counter.bytes)


def test_blocks_kept_gathered_and_mixed_precision_reach_both_fsdp_modes():
    """``--no-reshard-after-forward`` and ``--mp bf16``: backward gathers nothing, all-gathers move bf16."""
    train_bench, args = _bench_and_args("--no-reshard-after-forward", "--mp", "bf16")
    assert (args.reshard_after_forward, args.mp) == (False, "bf16")
    with FakeProcessGroup(2):
        steps = {
            (build.__name__, dtype): _step_collectives(build, train_bench, dtype)
            for build in (train_bench._build_cs, train_bench._build_fsdp2)
            for dtype in (None, torch.bfloat16)
        }
    # 2 blocks and the root gather once, in forward; one reduce-scatter per group.
    for counts, _ in steps.values():
        assert counts == {"all_gather": 3, "reduce_scatter": 3}
    for build in ("_build_cs", "_build_fsdp2"):
        fp32_bytes, bf16_bytes = steps[build, None][1], steps[build, torch.bfloat16][1]
        assert bf16_bytes["all_gather"] * 2 == fp32_bytes["all_gather"]
        assert bf16_bytes["reduce_scatter"] == fp32_bytes["reduce_scatter"]  # fp32 reductions
    assert steps["_build_cs", torch.bfloat16] == steps["_build_fsdp2", torch.bfloat16]


def _ddp_in_bf16_worker(rank, world_size):
    from compile_shard.models import Llama

    train_bench, _ = _bench_and_args()
    llama = train_bench.CONFIGS["smoke"].llama()
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,))
    model = train_bench._build_ddp(Llama(llama), train_bench.BuildContext(mesh, None, True, torch.bfloat16))
    tokens = torch.randint(0, llama.vocab_size, (2, 9), generator=torch.Generator().manual_seed(rank))
    assert model(tokens).dtype == torch.bfloat16
    train_bench._lm_loss(model, tokens).backward()
    grads = [param.grad for param in model.parameters()]
    assert all(grad.dtype == torch.float32 for grad in grads)
    gathered = [torch.empty_like(grads[0]) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, grads[0])
    assert torch.equal(gathered[0], gathered[1])  # reduced over the ranks


def test_ddp_in_bf16_on_a_cpu_computes_under_autocast():
    """DDP's own mixed precision records device events, which a CPU lacks: ``--mp bf16`` runs it under autocast."""
    run_gloo(_ddp_in_bf16_worker, 2)


def _bench_and_args(*argv: str):
    """The script's module and its parsed command line."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import train_bench
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return train_bench, train_bench._parse_args(list(argv))


def test_fake_process_group_leaves_out_ddp_by_default_and_refuses_it_by_name(capsys):
    train_bench, args = _bench_and_args("--fake-world-size", "8")
    assert args.modes.split(",") == [name for name in train_bench.MODES if not name.startswith("ddp")]
    _, args = _bench_and_args()  # gloo: every mode
    assert args.modes.split(",") == list(train_bench.MODES)
    with pytest.raises(SystemExit):
        _bench_and_args("--device", "cuda", "--modes", "cs_compiled,ddp")
    assert "['ddp'] cannot run on the fake process group" in capsys.readouterr().err


def test_the_adaptive_cpu_allocator_leaves_glibc_as_it_comes(monkeypatch):
    train_bench = _import_train_bench(monkeypatch)

    def no_libc(*args, **kwargs):
        raise AssertionError("--cpu-allocator adaptive loaded libc to call mallopt")

    monkeypatch.setattr(train_bench.ctypes, "CDLL", no_libc)
    assert train_bench.configure_cpu_allocator("adaptive") is False


@pytest.mark.parametrize(
    "argv, allocator",
    [
        (["--mode", "cs_compiled", "--fake-world-size", "2"], "fixed"),
        (["--mode", "floor", "--cpu-allocator", "caching"], "caching"),
    ],
)
def test_profile_step_profiles_a_fake_group_rank_and_the_floor_in_one_process(argv, allocator):
    script = SCRIPT.parent / "profile_step.py"
    finished = subprocess.run(
        [sys.executable, str(script), "--config", "smoke", "--top", "3", *argv],
        capture_output=True,
        text=True,
        check=False,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert f"{argv[1]}: 3 profiled steps" in finished.stdout
    assert f"(--cpu-allocator {allocator})" in finished.stdout
    shares = [line for line in finished.stdout.splitlines() if line.strip().startswith(("collectives", "optimizer"))]
    assert len(shares) == 2, finished.stdout


def test_a_run_against_another_commit_passes_on_every_option_but_the_modes_output_and_commit(monkeypatch):
    train_bench = _import_train_bench(monkeypatch)
    argv = ["--config", "B", "--modes", "cs_compiled", "--json=out.json", "--mp", "bf16", "--against", "c895265"]
    argv += ["--rounds", "2"]  # the rounds are this run's: the other commit runs one mode once per round
    assert train_bench.options_passed_on(argv) == ["--config", "B", "--mp", "bf16"]
    assert train_bench._parse_args(argv).argv == argv


def test_rounds_pool_the_steps_and_keep_each_ranks_largest_peak(monkeypatch):
    """Alternated rounds: one median over every round's steps, the median cold step, the worst memory per rank."""
    train_bench = _import_train_bench(monkeypatch)
    first = {"cold_step_s": 9.0, "step_times_s": [1.0, 1.2, 1.4], "peak_memory_mb": [10.0, 12.0]}
    first |= {"step_peak_memory_mb": [5.0, None], "simulated_comm_s": 0.5, "losses": [2.0]}
    second = first | {"cold_step_s": 7.0, "step_times_s": [2.0, 2.2, 2.4], "peak_memory_mb": [11.0, 11.0]}
    third = first | {"cold_step_s": 8.0, "step_times_s": [1.6], "step_peak_memory_mb": [4.0, 6.0]}
    merged = train_bench._merge_rounds([first, second, third])
    assert merged["step_times_s"] == [1.0, 1.2, 1.4, 2.0, 2.2, 2.4, 1.6]
    assert (merged["median_step_s"], merged["min_step_s"], merged["cold_step_s"]) == (1.6, 1.0, 8.0)
    assert merged["peak_memory_mb"] == [11.0, 12.0] and merged["step_peak_memory_mb"] == [5.0, None]
    assert merged["projected_step_s"] == 1.6 + 0.5 and merged["rounds"] == 3 and merged["losses"] == [2.0]
    assert train_bench._merge_rounds([first]) is first
    assert train_bench._parse_args(["--rounds", "3"]).rounds == 3
