"""Where a training step's time goes: torch.profiler over a few steps of one benchmark mode.

    python benchmarks/profile_step.py --mode cs_compiled      # config B, 2 gloo ranks
    python benchmarks/profile_step.py --mode fsdp2_eager
    python benchmarks/profile_step.py --mode ddp_compiled --config A
    python benchmarks/profile_step.py --mode cs_compiled_inlined   # settings.compile_regions off
    python benchmarks/profile_step.py --mode cs_compiled_no_rank_check   # settings.rank_check off
    python benchmarks/profile_step.py --mode cs_compiled --op rank_check  # that operator's calls and time
    python benchmarks/profile_step.py --mode cs_compiled --config A --no-reshard-after-forward
    python benchmarks/profile_step.py --mode cs_compiled --mp bf16   # bf16 parameters, fp32 reductions
    python benchmarks/profile_step.py --mode cs_compiled --fake-world-size 8   # rank 0 of a fake group
    python benchmarks/profile_step.py --mode floor     # the unsharded model compiled, one rank's batch
    python benchmarks/profile_step.py --mode cs_compiled --cpu-allocator caching   # glibc reusing freed memory

Builds the configuration's model (``train_bench.CONFIGS``, default B) the way
``train_bench.py`` builds the mode (its ``MODES``), runs two warm-up steps (compilation
included) and profiles three steps on every rank, each on one rank's batch and one
thread, with glibc's allocator set as ``train_bench.py --cpu-allocator`` sets it (the
same default). A mode that runs alone (``floor``, ``reference``) and any mode under
``--fake-world-size`` run one process. Rank 0 prints the operators with the most self
CPU time and the share of the profiled time spent in collectives (waits included),
computing, and in the optimizer.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

import compile_shard.passes
from compile_shard.models import Llama
from train_bench import CONFIGS, CPU_ALLOCATORS, MODES, BuildContext, configure_cpu_allocator

COMMUNICATION = (
    "c10d", "gloo", "all_gather", "reduce_scatter", "wait_tensor", "allreduce", "all_reduce", "alltoall", "all_to_all"
)


def _step(model, optimizer, tokens) -> None:
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def _worker(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    configure_cpu_allocator(args.cpu_allocator)
    torch.set_num_threads(1)
    mode = MODES[args.mode]
    if args.fake_world_size is not None and mode.distributed:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world_size)
    elif mode.distributed:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        bench = CONFIGS[args.config]
        config = bench.llama()
        compile_shard.passes.settings.compile_regions = mode.compile_regions
        compile_shard.passes.settings.rank_check = mode.rank_check
        mesh = init_device_mesh("cpu", (dist.get_world_size(),)) if mode.distributed else None
        param_dtype = torch.bfloat16 if args.mp == "bf16" else None
        ctx = BuildContext(mesh, "inductor" if mode.compiled else None, args.reshard_after_forward, param_dtype)
        torch.manual_seed(0)
        model = Llama(config)
        runnable = mode.build(model, ctx)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(rank)
        tokens = torch.randint(0, config.vocab_size, (bench.batch_per_rank, bench.seq + 1), generator=generator)
        for _ in range(2):
            _step(runnable, optimizer, tokens)
        if world_size > 1:
            dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            for _ in range(3):
                _step(runnable, optimizer, tokens)
        if world_size > 1:
            dist.barrier()
        if rank == 0:
            _report(profiler, args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _report(profiler, args: argparse.Namespace) -> None:
    events = profiler.key_averages()
    total = sum(event.self_cpu_time_total for event in events)
    communication = sum(e.self_cpu_time_total for e in events if any(k in e.key.lower() for k in COMMUNICATION))
    optimizer = sum(e.self_cpu_time_total for e in events if "optimizer" in e.key.lower() or "_foreach" in e.key)
    print(
        f"{args.mode}: 3 profiled steps, {total / 3e3:.0f} ms of self CPU time per step on rank 0 "
        f"(--cpu-allocator {args.cpu_allocator})"
    )
    print(f"  collectives (incl. waits): {100 * communication / total:5.1f}%")
    print(f"  optimizer (foreach ops):   {100 * optimizer / total:5.1f}%")
    print(f"  everything else (compute): {100 * (total - communication - optimizer) / total:5.1f}%")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
    if args.op is not None:
        matching = [f"{e.key}: {e.count} calls, {e.cpu_time_total:.1f} us in all" for e in events if args.op in e.key]
        print(f"operators named *{args.op}*: {'; '.join(matching) or 'none ran'}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=sorted(MODES), default="cs_compiled")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="B")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--fake-world-size", type=int, help="one process, rank 0 of a fake process group of this size")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--op", help="also print the calls and CPU time of the operators whose name contains this")
    parser.add_argument(
        "--no-reshard-after-forward",
        dest="reshard_after_forward",
        action="store_false",
        help="FSDP blocks keep their parameters gathered from forward to backward",
    )
    parser.add_argument(
        "--mp", choices=("fp32", "bf16"), default="fp32", help="bf16: FSDP2's bf16 parameters, fp32 reductions"
    )
    parser.add_argument(
        "--cpu-allocator",
        choices=tuple(CPU_ALLOCATORS),
        default="fixed",
        help="how glibc serves tensors, as in train_bench.py (caching: freed memory is reused)",
    )
    args = parser.parse_args(argv)
    if args.fake_world_size is not None and not MODES[args.mode].runs_on_fake_group:
        parser.error(f"{args.mode} cannot run on the fake process group (see train_bench.py)")
    alone = args.fake_world_size is not None or not MODES[args.mode].distributed
    world_size = 1 if alone else args.world_size
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(world_size, port, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
