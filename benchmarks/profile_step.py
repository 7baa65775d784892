"""Where a training step's time goes: torch.profiler over a few steps of one benchmark mode.

    python benchmarks/profile_step.py --mode cs_compiled      # config B, 2 gloo ranks
    python benchmarks/profile_step.py --mode fsdp2_eager
    python benchmarks/profile_step.py --mode ddp_compiled --config A
    python benchmarks/profile_step.py --mode cs_compiled_inlined   # settings.compile_regions off
    python benchmarks/profile_step.py --mode cs_compiled_no_rank_check   # settings.rank_check off
    python benchmarks/profile_step.py --mode cs_compiled --op rank_check  # that operator's calls and time
    python benchmarks/profile_step.py --mode cs_compiled --config A --no-reshard-after-forward
    python benchmarks/profile_step.py --mode cs_compiled --mp bf16   # bf16 parameters, fp32 reductions

Builds the configuration's model (``train_bench.CONFIGS``, default B), shards or wraps
it like ``train_bench.py`` does for the mode, runs two warm-up steps (compilation included) and profiles three
steps on every rank. Rank 0 prints the operators with the most self CPU time and the
share of the profiled time spent in collectives (waits included), computing, and in
the optimizer.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

import compile_shard.passes
from compile_shard import fully_shard
from compile_shard.models import Llama
from train_bench import CONFIGS

COMMUNICATION = (
    "c10d", "gloo", "all_gather", "reduce_scatter", "wait_tensor", "allreduce", "all_reduce", "alltoall", "all_to_all"
)


def _build(mode: str, config, reshard_after_forward: bool, mp: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Llama(config)
    if mode == "ddp_compiled":
        return torch.compile(DistributedDataParallel(model))
    shard = torch_fully_shard if mode.startswith("fsdp2") else fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp == "bf16" else None
    for block in model.layers:
        shard(block, reshard_after_forward=reshard_after_forward, mp_policy=policy or MixedPrecisionPolicy())
    shard(model, mp_policy=policy or MixedPrecisionPolicy())
    compile_shard.passes.settings.compile_regions = mode != "cs_compiled_inlined"
    compile_shard.passes.settings.rank_check = mode != "cs_compiled_no_rank_check"
    return torch.compile(model) if mode.startswith("cs_compiled") else model


def _step(model, optimizer, tokens) -> None:
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def _worker(
    rank: int, world_size: int, port: int, mode: str, top: int, config_name: str, reshard: bool, mp: str, op: str | None
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        bench = CONFIGS[config_name]
        config = bench.llama()
        model = _build(mode, config, reshard, mp)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(rank)
        tokens = torch.randint(0, config.vocab_size, (bench.batch_per_rank, bench.seq + 1), generator=generator)
        for _ in range(2):
            _step(model, optimizer, tokens)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            for _ in range(3):
                _step(model, optimizer, tokens)
        dist.barrier()
        if rank == 0:
            _report(profiler, mode, top, op)
    finally:
        dist.destroy_process_group()


def _report(profiler, mode: str, top: int, op: str | None) -> None:
    events = profiler.key_averages()
    total = sum(event.self_cpu_time_total for event in events)
    communication = sum(e.self_cpu_time_total for e in events if any(k in e.key.lower() for k in COMMUNICATION))
    optimizer = sum(e.self_cpu_time_total for e in events if "optimizer" in e.key.lower() or "_foreach" in e.key)
    print(f"{mode}: 3 profiled steps, {total / 3e3:.0f} ms of self CPU time per step on rank 0")
    print(f"  collectives (incl. waits): {100 * communication / total:5.1f}%")
    print(f"  optimizer (foreach ops):   {100 * optimizer / total:5.1f}%")
    print(f"  everything else (compute): {100 * (total - communication - optimizer) / total:5.1f}%")
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))
    if op is not None:
        matching = [f"{e.key}: {e.count} calls, {e.cpu_time_total:.1f} us in all" for e in events if op in e.key]
        print(f"operators named *{op}*: {'; '.join(matching) or 'none ran'}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = ("cs_compiled", "cs_compiled_inlined", "cs_compiled_no_rank_check", "cs_eager", "fsdp2_eager", "ddp_compiled")
    parser.add_argument("--mode", choices=modes, default="cs_compiled")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="B")
    parser.add_argument("--world-size", type=int, default=2)
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
    args = parser.parse_args(argv)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spawn_args = (args.world_size, port, args.mode, args.top, args.config, args.reshard_after_forward, args.mp, args.op)
    mp.spawn(_worker, args=spawn_args, nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
