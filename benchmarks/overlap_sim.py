"""Simulated overlap of the pass suite's schedule: an 8-layer Llama at fake world size 8 on a hardware profile.

    python benchmarks/overlap_sim.py                        # H100 over 400 Gb/s InfiniBand
    python benchmarks/overlap_sim.py --profile h100_nvlink --batch 4

Captures one training step's forward and backward graphs with ``compile_shard.dry_run``
(nothing is computed, so the sizes need not fit this machine) once, in the
partitioner's order, schedules a copy of them for each schedule (the schedules differ
only in what ``run_partitioned_suite`` does to the partitioned graphs) and replays
them with ``compile_shard.passes.simulate``:

- ``partitioner``: ``settings.reorder`` off: the order the partitioner leaves
  (gathers right before use, reduce-scatters at the end of backward);
- ``synchronous``: ``reorder`` with ``prefetch_depth=0`` and ``reduce_scatter_depth=0``:
  every collective waited right after it is issued;
- ``no_prefetch``: ``prefetch_depth=0``, reductions as in ``suite``: the memory
  baseline the prefetch is measured against (an overlapped reduce-scatter keeps its
  input alive until it completes, prefetch or not);
- ``suite``: the default settings (prefetch one group ahead, one reduction in flight).

It prints step time, total and exposed communication (also without the first
all-gather and the last reduce-scatter, which nothing can hide) and peak memory.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

from compile_shard import fully_shard
from compile_shard.dry_run import capture_step
from compile_shard.models import Llama, LlamaConfig
from compile_shard.passes import overridden, run_partitioned_suite
from compile_shard.passes.cost_model import get_profile
from compile_shard.passes.simulate import simulate_step

SCHEDULES = {
    "partitioner": {"reorder": False},
    "synchronous": {"prefetch_depth": 0, "reduce_scatter_depth": 0},
    "no_prefetch": {"prefetch_depth": 0},
    "suite": {},
}

#: The settings ``run_partitioned_suite`` reads: a schedule may override only these,
#: since the joint-graph passes run once, when the step is captured.
PARTITIONED_SETTINGS = frozenset({"reorder", "prefetch_depth", "reduce_scatter_depth", "memory_budget_mb"})


@dataclass
class ScheduleReport:
    schedule: str
    step_ms: float
    communication_ms: float
    exposed_ms: float
    exposed_beyond_first_and_last_ms: float
    exposed_beyond_first_and_last_pct: float
    peak_memory_bytes: int


def group_unsharded_bytes(config: LlamaConfig) -> int:
    """One block's unsharded parameter bytes (fp32): the largest group a prefetch keeps alive."""
    block = Llama(LlamaConfig(**{**asdict(config), "n_layers": 1})).layers[0]
    return sum(param.numel() * param.element_size() for param in block.parameters())


def _scheduled_copy(graph_module: fx.GraphModule) -> fx.Graph:
    """A copy of a captured graph, scheduled by ``run_partitioned_suite`` under the current settings."""
    graph = fx.GraphModule(graph_module, copy.deepcopy(graph_module.graph)).graph
    run_partitioned_suite(graph)
    return graph


def simulate_schedules(
    config: LlamaConfig, world_size: int, batch: int, seq: int, profile_name: str, schedules=tuple(SCHEDULES)
) -> list[ScheduleReport]:
    """Captures the step once (fake process group), schedules it as each of ``schedules``, replays it on ``profile_name``."""
    for name in schedules:
        if not SCHEDULES[name].keys() <= PARTITIONED_SETTINGS:
            raise ValueError(
                f"schedule {name!r} overrides {sorted(SCHEDULES[name].keys() - PARTITIONED_SETTINGS)}, which the "
                f"joint-graph passes read: only {sorted(PARTITIONED_SETTINGS)} can differ between schedules"
            )
    profile = get_profile(profile_name)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = Llama(config)
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        tokens = torch.randint(0, config.vocab_size, (batch, seq + 1))

        def loss_fn(compiled):
            logits = compiled(tokens[:, :-1])
            return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

        with overridden(cost_profile=profile_name, reorder=False):
            captured = capture_step(model, loss_fn)
        reports = []
        for name in schedules:
            with overridden(cost_profile=profile_name, **SCHEDULES[name]):
                graphs = [_scheduled_copy(graph_module) for graph_module in captured]
            simulation = simulate_step(graphs, profile)
            beyond = simulation.exposed_beyond_first_and_last()
            reports.append(
                ScheduleReport(
                    schedule=name,
                    step_ms=simulation.step_seconds * 1e3,
                    communication_ms=simulation.communication_seconds * 1e3,
                    exposed_ms=simulation.exposed_communication_seconds * 1e3,
                    exposed_beyond_first_and_last_ms=beyond * 1e3,
                    exposed_beyond_first_and_last_pct=100 * beyond / simulation.communication_seconds,
                    peak_memory_bytes=simulation.peak_memory_bytes,
                )
            )
        return reports
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="h100_ib400")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--json", help="also write the reports here")
    args = parser.parse_args(argv)
    config = LlamaConfig(
        dim=args.dim, n_layers=args.layers, n_heads=args.heads, ffn_hidden=args.dim * 11 // 4, max_seq_len=args.seq
    )
    reports = simulate_schedules(config, args.world_size, args.batch, args.seq, args.profile)
    group_mib = group_unsharded_bytes(config) / 2**20
    print(f"{args.layers}-layer Llama dim {args.dim}, {args.batch}x{args.seq} tokens per rank, "
          f"world size {args.world_size}, profile {args.profile}; one block unsharded: {group_mib:.1f} MiB")
    print(f"{'schedule':<12} {'step ms':>9} {'comm ms':>9} {'exposed ms':>11} {'beyond 1st/last':>16} {'peak MiB':>10}")
    for report in reports:
        print(f"{report.schedule:<12} {report.step_ms:9.2f} {report.communication_ms:9.2f} {report.exposed_ms:11.2f} "
              f"{report.exposed_beyond_first_and_last_ms:9.2f} ({report.exposed_beyond_first_and_last_pct:4.1f}%) "
              f"{report.peak_memory_bytes / 2**20:10.1f}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump([asdict(report) for report in reports], file, indent=2)


if __name__ == "__main__":
    main()
