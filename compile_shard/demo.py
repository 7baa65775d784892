"""Demo: shard a small Llama over N CPU processes (gloo) and train a few AdamW steps.

    python -m compile_shard.demo                # spawns 2 processes
    python -m compile_shard.demo --nproc 3
    torchrun --nproc-per-node 2 -m compile_shard.demo

Prints, per step, the sharded loss next to an unsharded single-process reference on
the same global batch, the step time, the collectives issued, and each rank's peak
resident memory.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from . import fully_shard
from .debug import CollectiveCounter
from .models import Llama, LlamaConfig


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch-per-rank", type=int, default=4)
    return parser.parse_args(argv)


def _lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _train(args: argparse.Namespace) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    config = LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=4, ffn_hidden=args.dim * 3, max_seq_len=args.seq)
    torch.manual_seed(0)
    model = Llama(config)
    reference = copy.deepcopy(model) if rank == 0 else None
    n_params = sum(p.numel() for p in model.parameters())
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3) if reference else None

    rows = []
    generator = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        tokens = torch.randint(0, config.vocab_size, (world_size * args.batch_per_rank, args.seq + 1), generator=generator)
        local = tokens[rank * args.batch_per_rank : (rank + 1) * args.batch_per_rank]
        dist.barrier()
        start = time.perf_counter()
        with CollectiveCounter() as counter:
            loss = _lm_loss(model, local)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.SUM)
        if reference is not None:
            reference_loss = _lm_loss(reference, tokens)
            reference_loss.backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
            rows.append((step + 1, loss.item() / world_size, reference_loss.item(), elapsed.item(), dict(counter.counts)))

    peak_rss_mb = [None] * world_size
    dist.all_gather_object(peak_rss_mb, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if rank == 0:
        print(
            f"compile_shard demo: Llama ({config.n_layers} layers, dim {config.dim}, vocab {config.vocab_size}, "
            f"{n_params / 1e6:.2f}M params), {world_size} gloo ranks, {args.steps} AdamW steps, eager"
        )
        print(f"{'step':>4}  {'loss':>10}  {'reference':>10}  {'|diff|':>8}  {'step time':>10}  "
              f"{'all-gathers':>11}  {'reduce-scatters':>15}")
        for step, loss, reference_loss, elapsed, counts in rows:
            print(
                f"{step:>4}  {loss:>10.6f}  {reference_loss:>10.6f}  {abs(loss - reference_loss):>8.1e}  "
                f"{elapsed * 1e3:>7.1f} ms  {counts.get('all_gather', 0):>11}  {counts.get('reduce_scatter', 0):>15}"
            )
        print("peak resident memory per rank: " + ", ".join(f"rank {r}: {mb:.0f} MB" for r, mb in enumerate(peak_rss_mb)))


def _worker(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        _train(args)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv=None) -> None:
    args = _parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo")
        try:
            _train(args)
        finally:
            dist.destroy_process_group()
        return
    mp.spawn(_worker, args=(args.nproc, _free_port(), args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
