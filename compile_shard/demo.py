"""Demo: shard a small Llama over N CPU processes (gloo) and train a few AdamW steps.

    python -m compile_shard.demo                # spawns 2 processes
    python -m compile_shard.demo --nproc 3
    torchrun --nproc-per-node 2 -m compile_shard.demo

Trains the same model twice, eager and ``torch.compile``d, and prints per step the
losses next to an unsharded single-process reference on the same global batch, both
step times, the collectives issued, and each rank's peak resident memory.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import resource
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.multiprocessing.spawn import ProcessException

from . import fully_shard, passes
from ._compile_counts import graph_breaks, unique_graphs
from .debug import CollectiveCounter, recompiles
from .models import Llama, LlamaConfig


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument(
        "--backend", default="inductor", help="torch.compile backend for the compiled run; '' skips it"
    )
    parser.add_argument(
        "--cost-profile",
        help="hardware profile of the simulated schedule in graph dumps (COMPILE_SHARD_DUMP_DIR), e.g. h100_nvlink; "
        "default: this machine (cpu_gloo); the cost model's buckets follow it",
    )
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        help="compile_shard.passes.settings.bucket_cap_mb: 0 keeps one all-gather and one reduce-scatter per group "
        "(FSDP2's); default: the cost model's cap",
    )
    return parser.parse_args(argv)


def _lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _build(config: LlamaConfig) -> Llama:
    torch.manual_seed(0)
    model = Llama(config)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def _batches(args: argparse.Namespace, config: LlamaConfig, world_size: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shape = (world_size * args.batch_per_rank, args.seq + 1)
    return [torch.randint(0, config.vocab_size, shape, generator=generator) for _ in range(args.steps)]


def _run_sharded(model, batches, args, count_collectives: bool) -> list[tuple[float, float, dict, float]]:
    """Per step: global loss, step time of the slowest rank, collectives issued, forward+backward time.

    Collectives are counted with a dispatch mode, in eager mode only: torch.compile
    does not compile under an active dispatch mode.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = []
    for tokens in batches:
        local = tokens[rank * args.batch_per_rank : (rank + 1) * args.batch_per_rank]
        dist.barrier()
        start = time.perf_counter()
        counter = CollectiveCounter()
        with counter if count_collectives else contextlib.nullcontext():
            loss = _lm_loss(model, local)
            loss.backward()
            forward_backward = time.perf_counter() - start
            optimizer.step()
            optimizer.zero_grad()
        elapsed = torch.tensor([time.perf_counter() - start, forward_backward])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        loss = loss.detach()
        dist.all_reduce(loss)
        rows.append((loss.item() / world_size, elapsed[0].item(), dict(counter.counts), elapsed[1].item()))
    return rows


def _predicted_forward_backward(model, tokens: torch.Tensor) -> float:
    """The cost model's forward+backward time for the compiled graphs on this machine (``cpu_gloo``)."""
    from .dry_run import capture_step
    from .passes.cost_model import get_profile
    from .passes.simulate import simulate_step

    graphs = capture_step(model, lambda compiled: _lm_loss(compiled, tokens))
    return simulate_step([graph_module.graph for graph_module in graphs], get_profile("cpu_gloo")).step_seconds


def _run_reference(model, batches) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for tokens in batches:
        loss = _lm_loss(model, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _train(args: argparse.Namespace) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    passes.settings.cost_profile = args.cost_profile
    passes.settings.bucket_cap_mb = args.bucket_cap_mb
    config = LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=4, ffn_hidden=args.dim * 3, max_seq_len=args.seq)
    batches = _batches(args, config, world_size)
    torch.manual_seed(0)
    reference_losses = _run_reference(Llama(config), batches) if rank == 0 else None
    eager = _run_sharded(_build(config), batches, args, count_collectives=True)
    compiled = predicted = None
    if args.backend:
        compiled_model = _build(config)
        compiled = _run_sharded(torch.compile(compiled_model, backend=args.backend), batches, args, False)
        compile_summary = (
            f"compiled ({args.backend}): {unique_graphs()} graph(s), "
            f"{graph_breaks()} graph break(s), {recompiles()} recompile(s); "
            "step 1 includes compilation"
        )
        if rank == 0:  # after training and counting: the dry run compiles again, leaving garbage gradients
            predicted = _predicted_forward_backward(compiled_model, batches[0][: args.batch_per_rank])

    peak_rss_mb = [torch.zeros(()) for _ in range(world_size)]
    dist.all_gather(peak_rss_mb, torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    if rank != 0:
        return
    n_params = sum(p.numel() for p in Llama(config).parameters())
    print(
        f"compile_shard demo: Llama ({config.n_layers} layers, dim {config.dim}, vocab {config.vocab_size}, "
        f"{n_params / 1e6:.2f}M params), {world_size} gloo ranks, {args.steps} AdamW steps"
    )
    header = f"{'step':>4}  {'reference':>10}  {'eager':>10}  {'eager time':>10}"
    if compiled:
        header += f"  {'compiled':>10}  {'compiled time':>13}"
    print(header + f"  {'all-gathers':>11}  {'reduce-scatters':>15}")
    for step, reference_loss in enumerate(reference_losses):
        loss, elapsed, counts, _ = eager[step]
        line = f"{step + 1:>4}  {reference_loss:>10.6f}  {loss:>10.6f}  {elapsed * 1e3:>7.1f} ms"
        if compiled:
            line += f"  {compiled[step][0]:>10.6f}  {compiled[step][1] * 1e3:>10.1f} ms"
        print(line + f"  {counts.get('all_gather', 0):>11}  {counts.get('reduce_scatter', 0):>15}")
    worst = max(abs(row[0] - ref) for rows in (eager, compiled or []) for row, ref in zip(rows, reference_losses))
    print(f"max |loss - reference|: {worst:.1e}  (collectives counted in eager mode)")
    if compiled:
        print(compile_summary)
        measured = statistics.median(row[3] for row in compiled[1:]) if len(compiled) > 1 else compiled[0][3]
        print(
            f"forward+backward of a compiled step: cost model for this machine (cpu_gloo profile, whatever "
            f"--cost-profile says) {predicted * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms "
            f"(median after step 1; ratio {predicted / measured:.2f})"
        )
    print("peak resident memory per rank: " + ", ".join(f"rank {r}: {mb.item():.0f} MB" for r, mb in enumerate(peak_rss_mb)))


def _worker(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        _train(args)
        gc.collect()  # collective work handles in reference cycles go while the group is alive
        dist.barrier()  # no rank tears its gloo pairs down while a peer still runs a collective
    except BaseException:
        _report_failure(rank)
        raise
    finally:
        dist.destroy_process_group()
    # The demo is done and printed. Leave without the interpreter's teardown: a gloo
    # thread still joinable at static destruction aborts the process now and then
    # ("terminate called without an active exception", SIGABRT), and the launcher would
    # report a finished demo as failed. tests/dist_utils.py leaves its workers the same way.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _report_failure(rank: int) -> None:
    """Prints this rank's own traceback now.

    A rank that raises closes its gloo pairs, so its peers fail next with "Connection
    closed by peer"; the launcher re-raises whichever failure it notices first, often
    a peer's. Printed here, the error that started it is on the screen first.
    """
    print(f"compile_shard demo: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)


def main(argv=None) -> None:
    args = _parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo")
        try:
            _train(args)
        finally:
            dist.destroy_process_group()
        return
    # The ranks' rendezvous store lives here, on a port the OS picks as it binds it: no
    # other process can take the port between its choice and its use.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        # Forked from a server that has imported this module once, not spawned: each
        # rank skips importing torch again (seconds per rank).
        mp.start_processes(
            _worker, args=(args.nproc, store.port, args), nprocs=args.nproc, join=True, start_method="forkserver"
        )
    except ProcessException:
        raise SystemExit("compile_shard demo failed: each failed rank's error is printed above") from None


if __name__ == "__main__":
    main()
