"""Where the cold first step's time goes: compile_shard against torch.compile of the same model, sharded or not.

    python benchmarks/cold_start.py --config B --rounds 2
    python benchmarks/cold_start.py --config B --modes fsdp2_block_compiled,cs_compiled --json cold.json
    python benchmarks/cold_start.py --config B --modes cs_compiled,cs_compiled_inlined --symbolic
    python benchmarks/cold_start.py --config B --modes fsdp2_block_compiled,cs_compiled --warm  # a restarted job
    python benchmarks/cold_start.py --config B --modes fsdp2_block_compiled,cs_compiled_saved --warm  # one that loads its step

The cold-step target holds compile_shard's cold first step (compilation included) to 1.5x that of
FSDP2 with per-block compile. This script separates what that ratio is made of: the
cost of compiling the whole model instead of one block (``unsharded_compiled`` and
``unsharded_regions`` compile the model without any sharding) and what compile_shard
adds on top of that (``cs_compiled``, ``cs_compiled_inlined``; ``cs_block_compiled`` is
FSDP2's per-block recipe with compile_shard's ``fully_shard``). ``gathered_regions`` is
``capture_time.py``'s: the blocks sharded by hand, each a region over its all-gather
output, a design compile_shard does not have yet.

Every mode runs in a fresh Python process with an empty Inductor cache directory, so
each one pays Inductor's CPU ISA probe and compiles every kernel, on rank 0 of a fake
process group (one process: no gloo, no second rank competing for the cores). The
rounds alternate the modes, as this machine's speed drifts by 20 to 30% within an
hour. Per mode, the median over the rounds of: the cold step (forward, backward and
optimizer step of the first batch), the compile phases torch records
(``torch._dynamo.utils.compile_times``: Dynamo's bytecode trace, AOTAutograd's joint
trace, Inductor's forward and backward compiles), the C++ kernels the step built
(``*.main.so`` files in the cache directory; Inductor builds one per distinct kernel
source), and the median of five steps after the second: the compiled step's
computation, with no communication to wait for. ``--warm`` measures a restarted job
instead: Inductor's and AOTAutograd's caches on, and each mode's step measured in a
second process that starts from the cache directory the first one filled;
``cs_compiled_saved`` is ``cs_compiled`` with ``compile_shard.load_cache_artifacts``
before ``torch.compile`` and ``save_cache_artifacts`` after the first step, so that the
second process loads Dynamo's trace too (its first step includes the load).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch._inductor.compile_fx  # noqa: F401  (what torch.compile imports: before any mode's timer)
import torch._inductor.config
import torch._inductor.runtime.cache_dir_utils
import torch.nn as nn

import compile_shard.passes

sys.path.insert(0, str(Path(__file__).resolve().parent))
import capture_time  # noqa: E402  (its blocks sharded by hand)
import train_bench  # noqa: E402  (its configurations and mode builders)

BASELINE_MODE = "fsdp2_block_compiled"
#: Steps after the second whose median the table reports: the compiled step without communication.
STEADY_STEPS = 5
#: ``compile_times`` entries reported per mode, by the name the table gives them.
PHASES = {
    "dynamo_s": "bytecode_tracing",
    "aot_trace_s": "aot_trace_joint_graph",
    "forward_compile_s": "compile_fx.<locals>.fw_compiler_base",
    "backward_compile_s": "compile_fx.<locals>.bw_compiler",
}


def _build_unsharded_regions(model: nn.Module, backend: str) -> nn.Module:
    """Every block traced once as a nested compile region (the class's forward, shared by all blocks)."""
    block_class = type(model.layers[0])
    block_class.forward = torch.compiler.nested_compile_region(block_class.forward)
    return torch.compile(model, backend=backend)


def _build_gathered_regions(model: nn.Module, backend: str) -> nn.Module:
    """``capture_time.py``'s ``gathered_regions``: every block a region over its all-gather output."""
    import torch.distributed as dist

    capture_time.shard_blocks_by_hand(model, dist.get_world_size())
    return torch.compile(model, backend=backend)


def _train_bench_mode(name: str) -> Callable[[nn.Module, str], nn.Module]:
    """``train_bench.py``'s builder for the mode, with its ``compile_regions`` setting, on the default mesh."""
    mode = train_bench.MODES[name]

    def build(model: nn.Module, backend: str) -> nn.Module:
        compile_shard.passes.settings.compile_regions = mode.compile_regions
        return mode.build(model, train_bench.BuildContext(mesh=None, backend=backend))

    return build


def _saved_step_folder() -> Path:
    """Where ``cs_compiled_saved`` keeps its saved step: the run's own Inductor cache directory."""
    return Path(torch._inductor.runtime.cache_dir_utils.cache_dir()) / "compile_shard_saved_step"


#: Seconds ``cs_compiled_saved`` spent loading its saved step before the first step, which its first step counts.
_load_s = 0.0


def _build_cs_compiled_saved(model: nn.Module, backend: str) -> nn.Module:
    """``cs_compiled`` that loads the step an earlier process saved (``compile_shard.load_cache_artifacts``).

    Loading the file and installing its trace (in ``torch.compile``) happen before the
    first step, where the other modes load their caches inside it: ``_load_s`` adds
    them to the first step. Not Inductor's import, which every mode's ``torch.compile``
    does before the timer.
    """
    global _load_s
    compile_shard.passes.settings.compile_regions = True
    sharded = train_bench._build_cs(model, train_bench.BuildContext(mesh=None, backend=backend))
    start = time.perf_counter()
    compile_shard.load_cache_artifacts(_saved_step_folder())
    compiled = torch.compile(sharded, backend=backend)
    _load_s = time.perf_counter() - start
    return compiled


MODES: dict[str, Callable[[nn.Module, str], nn.Module]] = {
    "fsdp2_block_compiled": _train_bench_mode("fsdp2_block_compiled"),
    "unsharded_block_compiled": train_bench.compile_blocks,
    "unsharded_compiled": lambda model, backend: torch.compile(model, backend=backend),
    "unsharded_regions": _build_unsharded_regions,
    "gathered_regions": _build_gathered_regions,
    "cs_compiled": _train_bench_mode("cs_compiled"),
    "cs_compiled_inlined": _train_bench_mode("cs_compiled_inlined"),
    "cs_block_compiled": _train_bench_mode("cs_block_compiled"),
    "cs_compiled_saved": _build_cs_compiled_saved,
}


# One mode, in its own process ---------------------------------------------------------------------------------------


def _measure(mode: str, config_name: str, world_size: int, backend: str, symbolic: bool, caches: bool) -> dict:
    """Builds the mode's model on a fake process group and times its first training step.

    ``symbolic``: the sequence length symbolic, as in the recompile after it changed
    (per-block compile, whose blocks do not see the marked input, stays static).
    ``caches``: Inductor's and AOTAutograd's caches on, as a restarted job has them.
    """
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from compile_shard.models import Llama

    torch.set_num_threads(1)
    torch._inductor.config.fx_graph_cache = caches  # off: compile everything, as in train_bench.py
    torch._functorch.config.enable_autograd_cache = caches
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        bench = train_bench.CONFIGS[config_name]
        torch.manual_seed(0)
        llama = bench.llama()
        model = MODES[mode](Llama(llama), backend)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, llama.vocab_size, (bench.batch_per_rank, bench.seq + 1))

        def step() -> float:
            start = time.perf_counter()
            inputs = tokens[:, :-1]
            if symbolic:
                torch._dynamo.mark_dynamic(inputs, 1)
            logits = model(inputs)
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()
            return time.perf_counter() - start

        cold_step_s = _load_s + step()
        if mode == "cs_compiled_saved":
            compile_shard.save_cache_artifacts(_saved_step_folder())
        second_step_s = step()
        steady_step_s = statistics.median(step() for _ in range(STEADY_STEPS))
    finally:
        dist.destroy_process_group()
    names, values = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    recorded = {name: float(value) for name, value in zip(names, values)}
    return {
        "cold_step_s": cold_step_s,
        "second_step_s": second_step_s,
        "steady_step_s": steady_step_s,
        **{field: recorded.get(name, 0.0) for field, name in PHASES.items()},
    }


def _run_one(mode: str, args: argparse.Namespace) -> dict:
    """Runs ``mode`` in a fresh interpreter with an empty Inductor cache; counts the kernels it built.

    ``--warm``: a first process fills the cache, and a second one, measured, starts from it.
    """
    with tempfile.TemporaryDirectory(prefix="cold_start_inductor_") as cache_dir:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "OMP_NUM_THREADS": "1"}
        command = [
            sys.executable, __file__, "--one", mode, "--modes", mode, "--config", args.config,
            "--world-size", str(args.world_size), "--backend", args.backend,
            *(["--symbolic"] if args.symbolic else []), *(["--warm"] if args.warm else []),
        ]  # fmt: skip
        for _ in range(2 if args.warm else 1):
            finished = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            if finished.returncode != 0:
                raise RuntimeError(f"cold_start.py: mode {mode} failed:\n{finished.stderr[-4000:]}")
        result = json.loads(finished.stdout.strip().splitlines()[-1])
        result["kernels"] = sum(1 for _ in Path(cache_dir).rglob("*.main.so"))
    return result


# Report -------------------------------------------------------------------------------------------------------------


FIELDS = (
    "cold_step_s", "dynamo_s", "aot_trace_s", "forward_compile_s", "backward_compile_s", "kernels", "steady_step_s",
)  # fmt: skip


def _summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    summary = {
        mode: {field: statistics.median(run[field] for run in results) for field in FIELDS}
        for mode, results in runs.items()
    }
    baseline = summary.get(BASELINE_MODE)
    for values in summary.values():
        values["cold_ratio"] = None if baseline is None else values["cold_step_s"] / baseline["cold_step_s"]
    return summary


def _table(summary: dict[str, dict]) -> str:
    header = (
        "mode", "cold s", f"x {BASELINE_MODE}", "Dynamo s", "AOT trace s", "fwd compile s", "bwd compile s", "kernels",
        "steady s",
    )  # fmt: skip
    rows = [header]
    for mode, values in summary.items():
        ratio = "-" if values["cold_ratio"] is None else f"{values['cold_ratio']:.2f}x"
        rows.append(
            (mode, f"{values['cold_step_s']:.1f}", ratio, f"{values['dynamo_s']:.2f}", f"{values['aot_trace_s']:.2f}",
             f"{values['forward_compile_s']:.1f}", f"{values['backward_compile_s']:.1f}", f"{values['kernels']:.0f}",
             f"{values['steady_step_s']:.3f}")
        )  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in rows)


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(train_bench.CONFIGS), default="B", help="a train_bench.py config")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES))
    parser.add_argument("--rounds", type=int, default=1, help="runs per mode, alternating the modes (default 1)")
    parser.add_argument("--world-size", type=int, default=2, help="size of the fake process group (default 2)")
    parser.add_argument("--backend", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--json", type=Path, help="write every run and the medians here")
    parser.add_argument(
        "--symbolic", action="store_true", help="the sequence length symbolic, as in the recompile after it changed"
    )
    parser.add_argument(
        "--warm", action="store_true", help="caches on, each mode measured in a second process: a restarted job"
    )
    parser.add_argument("--one", choices=sorted(MODES), help=argparse.SUPPRESS)  # the per-mode child process
    args = parser.parse_args(argv)
    unknown = [mode for mode in args.modes.split(",") if mode not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    return args


def main(argv=None) -> dict[str, dict] | None:
    args = _parse_args(argv)
    if args.one is not None:
        print(json.dumps(_measure(args.one, args.config, args.world_size, args.backend, args.symbolic, args.warm)))
        return None
    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            runs[mode].append(_run_one(mode, args))
    summary = _summarize(runs)
    print(
        f"cold_start config {args.config}: one process, fake group of {args.world_size}, backend {args.backend}, "
        f"empty Inductor cache per run; medians of {args.rounds} round(s), torch {torch.__version__}"
        + (", sequence length symbolic" if args.symbolic else "")
        + (", warm: caches on, measured in a second process" if args.warm else "")
    )
    print(_table(summary))
    if args.json is not None:
        report = {"config": args.config, "world_size": args.world_size, "backend": args.backend,
                  "symbolic": args.symbolic, "warm": args.warm, "rounds": args.rounds, "torch": torch.__version__,
                  "runs": runs, "medians": summary}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=1))
    return summary


if __name__ == "__main__":
    main()
