"""Simulated overlap of the pass suite's schedule: an 8-layer Llama at fake world size 8 on a hardware profile.

    python benchmarks/overlap_sim.py                        # H100 over 400 Gb/s InfiniBand
    python benchmarks/overlap_sim.py --profile h100_nvlink --batch 4
    python benchmarks/overlap_sim.py --world-size 16 --mesh 2,8 --profile h100_nvlink_ib400  # HSDP, 2 nodes

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
all-gather and the last reduction, which nothing can hide) and peak memory; with an
HSDP ``--mesh`` (replicate, shard), also the replicate all-reduces' time, exposed
time, and the groups whose all-reduce is exposed.
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
from torch.distributed.device_mesh import init_device_mesh
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
    all_reduce_ms: float
    all_reduce_exposed_ms: float
    #: The groups whose all-reduce the schedule leaves (partly) exposed, in backward order.
    exposed_all_reduces: list[str]


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
    config: LlamaConfig,
    world_size: int,
    batch: int,
    seq: int,
    profile_name: str,
    schedules=tuple(SCHEDULES),
    mesh_shape: tuple[int, int] | None = None,
) -> list[ScheduleReport]:
    """Captures the step once (fake process group), schedules it as each of ``schedules``, replays it on ``profile_name``.

    ``mesh_shape``: an HSDP (replicate, shard) mesh over the world instead of a 1-D one.
    """
    for name in schedules:
        if not SCHEDULES[name].keys() <= PARTITIONED_SETTINGS:
            raise ValueError(
                f"schedule {name!r} overrides {sorted(SCHEDULES[name].keys() - PARTITIONED_SETTINGS)}, which the "
                f"joint-graph passes read: only {sorted(PARTITIONED_SETTINGS)} can differ between schedules"
            )
    profile = get_profile(profile_name)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = None
        if mesh_shape is not None:
            mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = Llama(config)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
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
            all_reduces = [record for record in simulation.collectives if record.kind == "all_reduce"]
            reports.append(
                ScheduleReport(
                    schedule=name,
                    step_ms=simulation.step_seconds * 1e3,
                    communication_ms=simulation.communication_seconds * 1e3,
                    exposed_ms=simulation.exposed_communication_seconds * 1e3,
                    exposed_beyond_first_and_last_ms=beyond * 1e3,
                    exposed_beyond_first_and_last_pct=100 * beyond / simulation.communication_seconds,
                    peak_memory_bytes=simulation.peak_memory_bytes,
                    all_reduce_ms=sum(record.end - record.start for record in all_reduces) * 1e3,
                    all_reduce_exposed_ms=sum(record.exposed_seconds for record in all_reduces) * 1e3,
                    exposed_all_reduces=[record.group for record in all_reduces if record.exposed_seconds > 1e-9],
                )
            )
        return reports
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="h100_ib400")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--mesh", help="HSDP: REPLICATE,SHARD, their product the world size (default: a 1-D mesh)")
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
    mesh_shape = None
    if args.mesh:
        mesh_shape = tuple(int(size) for size in args.mesh.split(","))
        if len(mesh_shape) != 2 or mesh_shape[0] * mesh_shape[1] != args.world_size:
            parser.error(f"--mesh {args.mesh}: expected REPLICATE,SHARD whose product is --world-size {args.world_size}")
    reports = simulate_schedules(config, args.world_size, args.batch, args.seq, args.profile, mesh_shape=mesh_shape)
    group_mib = group_unsharded_bytes(config) / 2**20
    mesh = f"HSDP mesh {mesh_shape}" if mesh_shape else "1-D mesh"
    print(f"{args.layers}-layer Llama dim {args.dim}, {args.batch}x{args.seq} tokens per rank, "
          f"world size {args.world_size} ({mesh}), profile {args.profile}; one block unsharded: {group_mib:.1f} MiB")
    header = f"{'schedule':<12} {'step ms':>9} {'comm ms':>9} {'exposed ms':>11} {'beyond 1st/last':>16} {'peak MiB':>10}"
    print(header + (f" {'AR ms':>8} {'AR exposed':>11}  exposed all-reduces" if mesh_shape else ""))
    for report in reports:
        row = (f"{report.schedule:<12} {report.step_ms:9.2f} {report.communication_ms:9.2f} {report.exposed_ms:11.2f} "
               f"{report.exposed_beyond_first_and_last_ms:9.2f} ({report.exposed_beyond_first_and_last_pct:4.1f}%) "
               f"{report.peak_memory_bytes / 2**20:10.1f}")
        if mesh_shape:
            row += f" {report.all_reduce_ms:8.2f} {report.all_reduce_exposed_ms:11.2f}  {', '.join(report.exposed_all_reduces)}"
        print(row)
    if args.json:
        with open(args.json, "w") as file:
            json.dump([asdict(report) for report in reports], file, indent=2)


if __name__ == "__main__":
    main()
