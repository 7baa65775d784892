"""Measure this machine for the cost model's "cpu_gloo" profile: matmul, memory, per-op overhead, gloo collectives.

    python benchmarks/calibrate_cpu.py            # measure and print
    python benchmarks/calibrate_cpu.py --write    # and store the profile in passes/cpu_gloo.json

The simulator's CPU numbers should describe the setting the demo and the tests run
in: two gloo processes on 127.0.0.1 with one thread each, sharing this machine. So
everything is measured inside two such processes, at the same time (they compete
for memory bandwidth and cores as the demo's ranks do), and the ranks' compute
numbers are averaged:

- matmul FLOP/s: a 512x512 float32 ``mm`` (2 * 512**3 FLOPs), best of several runs;
- memory bandwidth: ``copy_`` of a 64 MiB tensor, counted as read + write;
- per-op overhead: a 1-element ``aten.add.Tensor`` called through its OpOverload, as
  an FX graph calls it;
- collectives as compile_shard's compiled graphs run them on gloo: the all-gather
  ``fsdp.all_gather_send_recv_`` and the reduce-scatter's exchange
  ``fsdp.all_to_all_into_`` (see [Note: gloo all-gather] and [Note: gloo
  reduce-scatter] in ``compile_shard/ops/``), each into a reused output, +
  ``wait_tensor``, at several sizes (4 KiB to 16 MiB), the median call on rank 0,
  then one fit of the cost model's ring formula
  ``t = (W-1) * latency + (W-1)/W * bytes / bandwidth`` over both, weighted by 1/t so
  that the small sizes pin the latency and the large ones the bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from compile_shard.passes.cost_model import CPU_GLOO_PATH, HardwareProfile

WORLD_SIZE = 2
MATMUL_N = 512
COPY_BYTES = 64 * 2**20
COLLECTIVE_BYTES = [4 * 2**10, 64 * 2**10, 2**20, 4 * 2**20, 16 * 2**20]


def _best_seconds(fn: Callable[[], object], repeats: int, calls: int) -> float:
    """Seconds per call, the best of ``repeats`` timings of ``calls`` calls each, after a warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _measure_compute() -> dict[str, float]:
    a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)
    matmul_s = _best_seconds(lambda: torch.mm(a, b), repeats=5, calls=5)
    source, destination = torch.ones(COPY_BYTES // 4), torch.empty(COPY_BYTES // 4)
    copy_s = _best_seconds(lambda: destination.copy_(source), repeats=5, calls=3)
    x, y = torch.ones(1), torch.ones(1)
    add = torch.ops.aten.add.Tensor
    overhead_s = _best_seconds(lambda: add(x, y), repeats=5, calls=5000)
    return {
        "matmul_flops_per_s": 2 * MATMUL_N**3 / matmul_s,
        "memory_bytes_per_s": 2 * COPY_BYTES / copy_s,
        "kernel_overhead_s": overhead_s,
    }


def _time_collective(kind: str, nbytes: int, group_name: str) -> float:
    """Seconds per collective of ``nbytes`` (all-gather output / reduce-scatter input): the median call.

    The median, not the mean, so that a rank descheduled now and then by another
    process does not skew the fit.
    """
    funcol = torch.ops._c10d_functional
    output = torch.empty(nbytes // 4)
    if kind == "all_gather":
        shard = torch.ones(output.numel() // WORLD_SIZE)

        def run():
            torch.ops.fsdp.all_gather_send_recv_(output, shard, WORLD_SIZE, group_name)
            funcol.wait_tensor(output)

    else:
        full = torch.ones(output.numel())

        def run():
            torch.ops.fsdp.all_to_all_into_(output, full, WORLD_SIZE, group_name)
            funcol.wait_tensor(output)

    calls = max(5, min(100, 2**24 // nbytes))
    run()
    dist.barrier()
    timings = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        timings.append(time.perf_counter() - start)
    return statistics.median(timings)


def _rank(rank: int, port: int, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        dist.barrier()
        result = _measure_compute()
        dist.barrier()
        group_name = dist.group.WORLD.group_name
        result["collectives"] = [
            (kind, nbytes, _time_collective(kind, nbytes, group_name))
            for kind in ("all_gather", "reduce_scatter")
            for nbytes in COLLECTIVE_BYTES
        ]
        results.put((rank, result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _fit_ring(points: list[tuple[str, int, float]]) -> tuple[float, float]:
    """(latency per ring step, bus bytes/s) fitting ``t = (W-1) * lat + (W-1)/W * bytes / bw``, weighted by 1/t."""
    steps = WORLD_SIZE - 1
    rows = torch.tensor([[steps / t, steps / WORLD_SIZE * nbytes / t] for _, nbytes, t in points], dtype=torch.float64)
    ones = torch.ones(len(points), 1, dtype=torch.float64)
    latency, seconds_per_byte = torch.linalg.lstsq(rows, ones).solution.flatten().tolist()
    return latency, 1 / seconds_per_byte


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def calibrate() -> tuple[HardwareProfile, dict]:
    """Runs the measurements on two gloo processes; returns the profile and the raw numbers."""
    load_before = os.getloadavg()[0]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(_free_port(), results), nprocs=WORLD_SIZE, join=True)
    per_rank = dict(results.get() for _ in range(WORLD_SIZE))

    def mean(key: str) -> float:
        return statistics.fmean(result[key] for result in per_rank.values())

    points = per_rank[0]["collectives"]
    latency, bandwidth = _fit_ring(points)
    per_kind = {kind: _fit_ring([p for p in points if p[0] == kind]) for kind in ("all_gather", "reduce_scatter")}
    today = datetime.date.today().isoformat()
    profile = HardwareProfile(
        name="cpu_gloo",
        flops_per_s={torch.float32: mean("matmul_flops_per_s")},
        memory_bytes_per_s=mean("memory_bytes_per_s"),
        kernel_overhead_s=mean("kernel_overhead_s"),
        link_bytes_per_s=bandwidth,
        link_latency_s=latency,
        description=(
            f"{os.cpu_count()}-core {_cpu_model()}, {WORLD_SIZE} gloo ranks on 127.0.0.1 with 1 thread each; "
            f"measured by benchmarks/calibrate_cpu.py on {today} (torch {torch.__version__})"
        ),
        # Every core runs a rank's compute: gloo's transfers compete for the same cores.
        overlaps_communication=False,
    )
    raw = {
        "measured_on": today,
        # Other processes on the machine skew every number; a quiet machine reads below ~0.3.
        "load_average_1min_before": load_before,
        "per_rank_compute": {
            rank: {key: value for key, value in result.items() if key != "collectives"}
            for rank, result in sorted(per_rank.items())
        },
        "collective_seconds_rank0": [{"kind": k, "bytes": b, "seconds": t} for k, b, t in points],
        "ring_fit_per_kind": {
            kind: {"link_latency_s": lat, "link_bytes_per_s": bw} for kind, (lat, bw) in per_kind.items()
        },
    }
    return profile, raw


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"store the profile in {CPU_GLOO_PATH}")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    profile, raw = calibrate()
    print(profile.description)
    print(f"  (1-minute load average before measuring: {raw['load_average_1min_before']:.2f})")
    print(f"  matmul float32      {profile.flops_per_s[torch.float32] / 1e9:8.2f} GFLOP/s")
    print(f"  memory bandwidth    {profile.memory_bytes_per_s / 1e9:8.2f} GB/s")
    print(f"  per-op overhead     {profile.kernel_overhead_s * 1e6:8.2f} us")
    print(f"  link bus bandwidth  {profile.link_bytes_per_s / 1e9:8.2f} GB/s   (both kinds)")
    print(f"  link latency        {profile.link_latency_s * 1e6:8.2f} us/step (both kinds)")
    for kind, fit in raw["ring_fit_per_kind"].items():
        print(f"    {kind:15s} {fit['link_bytes_per_s'] / 1e9:6.2f} GB/s, {fit['link_latency_s'] * 1e6:7.2f} us/step")
    for point in raw["collective_seconds_rank0"]:
        print(f"    {point['kind']:15s} {point['bytes']:>9d} B  {point['seconds'] * 1e6:9.1f} us")
    print(f"  ({time.perf_counter() - started:.1f} s)")
    if args.write:
        CPU_GLOO_PATH.write_text(json.dumps({**profile.to_json(), "measurements": raw}, indent=2) + "\n")
        print(f"wrote {CPU_GLOO_PATH}")


if __name__ == "__main__":
    main()
