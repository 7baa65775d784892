"""How the time to capture one training step grows with depth, inlined and with compile regions.

    python benchmarks/capture_time.py                          # 8, 16, 32 and 64 layers
    python benchmarks/capture_time.py --layers 8,16 --rounds 2 --json capture.json
    python benchmarks/capture_time.py --layers 8,32 --symbolic   # the sequence length symbolic
    python benchmarks/capture_time.py --modes regions --against c895265   # this tree against a commit

A Llama (dim 64) sharded per block on rank 0 of a fake process group of 8, captured by
``compile_shard.dry_run.capture_step``: Dynamo, AOTAutograd with the min-cut
partitioner and the pass suite, as Inductor would see them, without Inductor's code
generation (``cold_start.py`` measures a whole cold step). Each depth and mode runs in
a fresh process, so no capture reuses another's caches; the rounds alternate them, as
this machine's speed drifts within an hour, and the table holds the median per depth
and mode: the capture's seconds; the parts of them Dynamo's own work took (its compile
of the frame, the trace and the guards, less the backend's) and its backend's
(AOTAutograd's joint trace, the partition and the forward's compile; the backward
compiles at its first call, outside both); the part the pass suite took; the region
calls in the captured graphs; and the ratio to the smallest depth of the same mode.
``--symbolic`` marks the sequence length dynamic, as Dynamo's recompile after a length
changed does.

The mode ``unsharded_regions`` is torch's own floor for the one-graph design: the same
Llama without sharding, every block a ``torch.compiler.nested_compile_region``, captured
the same way. What a sharded mode's capture adds to it per block is compile_shard's.
The mode ``gathered_regions`` measures a design compile_shard does not have yet: each
block's parameters sharded by hand as one flat shard (FSDP2's layout: every parameter
padded and split by rows), all-gathered by ``funcol`` in the outer graph, and every
block a region whose one argument is the all-gather output, copying the parameters
out inside with one op (``copy_out``), recomputed in backward. Against ``regions`` it
shows what a block's capture would cost with no per-parameter work in the outer graph.

``--against COMMIT`` runs each capture at ``COMMIT`` too, right after the same capture
here (``against.py``); its rows are named ``<mode> at <COMMIT>``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from against import checkout, environment, named

MODES = ("inlined", "regions", "unsharded_regions", "gathered_regions")


@torch.library.custom_op("capture_time::copy_out", mutates_args=())
def copy_out(all_gather_output: torch.Tensor, world_size: int, shard_numels: list[int]) -> list[torch.Tensor]:
    """Each parameter's columns of the all-gather output, as one fixed kernel (FSDP2's ``split_with_sizes_copy``).

    An op Inductor does not decompose: generated, the copy fuses into its readers in a
    kernel variant per reader (docs/benchmarks.md, "The cold step").
    """
    per_rank = all_gather_output.view(world_size, -1).split(shard_numels, dim=1)
    return [chunk.clone(memory_format=torch.contiguous_format).view(-1) for chunk in per_rank]


@copy_out.register_fake
def _(all_gather_output, world_size, shard_numels):
    return [all_gather_output.new_empty(world_size * numel) for numel in shard_numels]


def _copy_out_backward(ctx, grads):
    columns = [
        grad.view(ctx.world_size, -1)
        if grad is not None
        else torch.zeros(ctx.world_size, numel, dtype=ctx.dtype, device=ctx.device)
        for grad, numel in zip(grads, ctx.shard_numels)
    ]
    return torch.cat(columns, dim=1).view(-1), None, None


def _save_sizes(ctx, inputs, output):
    all_gather_output, ctx.world_size, ctx.shard_numels = inputs
    ctx.dtype, ctx.device = all_gather_output.dtype, all_gather_output.device


copy_out.register_autograd(_copy_out_backward, setup_context=_save_sizes)


def _recompute(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_RECOMPUTE


def _recomputed_in_backward():
    """``context_fn`` for the copy-out: Dynamo takes a module-level function, not a lambda."""
    return create_selective_checkpoint_contexts(_recompute)


def _unsharded_params(block, all_gather_output):
    """The block's unsharded parameters from its all-gather output: one column block per parameter."""
    padded = copy_out(all_gather_output, block.world_size, block.shard_numels)
    return [
        flat.view(padded_shape)[: shape[0]]
        for flat, padded_shape, shape in zip(padded, block.padded_shapes, block.shapes)
    ]


def _gathered_block(block, all_gather_output, *args):
    unsharded = checkpoint(
        _unsharded_params, block, all_gather_output, use_reentrant=False, context_fn=_recomputed_in_backward
    )
    return torch.func.functional_call(block.inner, dict(zip(block.names, unsharded)), args)


def _block_shapes(block, all_gather_output, *args) -> int:
    """The region's reuse key: the blocks' parameter shapes. A key skips Dynamo's guard-based reuse check, which
    ``functional_call``'s writes to the block fail; ``call_in_region``'s key stands for the same in compile_shard."""
    return hash(tuple(block.shapes))


def _gathered_forward(self, *args):
    from torch.distributed import _functional_collectives as funcol

    all_gather_output = funcol.all_gather_tensor_autograd(self.shard, 0, self.group_name)
    return self.region(self, all_gather_output, *args)


def shard_blocks_by_hand(model, world_size: int) -> None:
    """Each block of ``model``: its parameters as this rank's one flat shard, gathered and copied out as in ``gathered_regions``."""
    import torch.distributed as dist
    from torch import nn

    from compile_shard._layout import padded_rows

    region = torch.compiler.nested_compile_region(_gathered_block, reuse_hash_fn=_block_shapes)
    rank = dist.get_rank()
    for index, block in enumerate(model.layers):
        holder = nn.Module()
        holder.inner = block
        holder.names, holder.shapes, holder.padded_shapes, shards = [], [], [], []
        for name, param in block.named_parameters():
            rows = padded_rows(param.shape[0], world_size)
            padded = param.detach().new_zeros(rows * world_size, *param.shape[1:])
            padded[: param.shape[0]] = param.detach()
            holder.names.append(name)
            holder.shapes.append(tuple(param.shape))
            holder.padded_shapes.append(tuple(padded.shape))
            shards.append(padded[rank * rows : (rank + 1) * rows].flatten())
        holder.shard_numels = [shard.numel() for shard in shards]
        holder.shard = nn.Parameter(torch.cat(shards))
        holder.world_size, holder.group_name, holder.region = world_size, dist.group.WORLD.group_name, region
        holder.forward = _gathered_forward.__get__(holder)
        model.layers[index] = holder


def capture_seconds(layers: int, mode: str, symbolic: bool = False) -> dict[str, float]:
    """One capture in this process: its seconds, the parts Dynamo, its backend and the pass suite took, its region calls.

    ``symbolic``: the sequence length symbolic, as in the recompile after it changed.
    """
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from compile_shard import dry_run, fully_shard, passes
    from compile_shard.models import Llama, LlamaConfig

    seconds_in = {"suite": 0.0, "frame": 0.0, "backend": 0.0}

    def timed(function, part):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds_in[part] += time.perf_counter() - start

        return call

    # The joint-graph suite, as the installed hook calls it, and the partitioned one, as the capture calls it.
    install = importlib.import_module("compile_shard.passes.install")  # the module, not passes.install()
    install.run_suite = timed(install.run_suite, "suite")
    dry_run.run_partitioned_suite = timed(dry_run.run_partitioned_suite, "suite")
    # Dynamo's compile of the frame, and within it the backend's: AOTAutograd's joint trace,
    # the partition, and the forward's compile; the backward compiles at its first call.
    convert_frame = importlib.import_module("torch._dynamo.convert_frame")
    convert_frame._compile = timed(convert_frame._compile, "frame")
    make_backend = dry_run.aot_autograd
    dry_run.aot_autograd = lambda *args, **kwargs: timed(make_backend(*args, **kwargs), "backend")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        config = LlamaConfig(n_layers=layers)
        torch.manual_seed(0)
        model = Llama(config)
        if mode == "unsharded_regions":
            block_class = type(model.layers[0])
            block_class.forward = torch.compiler.nested_compile_region(block_class.forward)
        elif mode == "gathered_regions":
            shard_blocks_by_hand(model, world_size=8)
        else:
            for block in model.layers:
                fully_shard(block)
            fully_shard(model)
        tokens = torch.randint(0, config.vocab_size, (2, 17))

        def loss_fn(compiled):
            inputs = tokens[:, :-1]
            if symbolic:
                torch._dynamo.mark_dynamic(inputs, 1)
            logits = compiled(inputs)
            return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

        with passes.overridden(compile_regions=mode == "regions"):
            start = time.perf_counter()
            graphs = dry_run.capture_step(model, loss_fn)
            seconds = time.perf_counter() - start
    finally:
        dist.destroy_process_group()
    region_calls = sum(
        node.target is torch.ops.higher_order.invoke_subgraph for graph in graphs for node in graph.graph.nodes
    )
    return {
        "capture_s": seconds,
        "dynamo_s": seconds_in["frame"] - seconds_in["backend"],
        "backend_s": seconds_in["backend"],
        "passes_s": seconds_in["suite"],
        "region_calls": region_calls,
    }


def _in_fresh_process(layers: int, mode: str, symbolic: bool, tree: Path | None = None) -> dict[str, float]:
    """One capture in a new process, of this tree's compile_shard or, given ``tree``, of that checkout's."""
    script = Path(__file__) if tree is None else tree / "benchmarks" / "capture_time.py"
    command = [sys.executable, str(script), "--one", str(layers), "--mode", mode]
    command += ["--symbolic"] if symbolic else []
    env = None if tree is None else environment(tree)
    finished = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if finished.returncode != 0:
        raise RuntimeError(f"capturing {layers} layers failed:\n{finished.stderr[-4000:]}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="8,16,32,64", help="comma-separated depths")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)}")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", help="also write the table here")
    parser.add_argument(
        "--symbolic", action="store_true", help="the sequence length symbolic, as in the recompile after it changed"
    )
    parser.add_argument("--against", metavar="COMMIT", help="also capture at COMMIT, alternated with this tree")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a worker: one capture, JSON on stdout
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(capture_seconds(args.one, args.mode, args.symbolic)))
        return
    depths = [int(layers) for layers in args.layers.split(",")]
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    with checkout(args.against) as other:
        for _ in range(args.rounds):
            for layers in depths:
                for mode in modes:
                    runs.setdefault((mode, layers), []).append(_in_fresh_process(layers, mode, args.symbolic))
                    if other is not None:
                        capture = _in_fresh_process(layers, mode, args.symbolic, other)
                        runs.setdefault((named(mode, args.against), layers), []).append(capture)
    rows = []
    for mode in dict.fromkeys(mode for mode, _ in runs):
        smallest = None
        for layers in depths:
            capture = statistics.median(run["capture_s"] for run in runs[mode, layers])
            smallest = smallest or capture
            rows.append(
                {
                    "mode": mode,
                    "layers": layers,
                    "capture_s": round(capture, 2),
                    "dynamo_s": round(statistics.median(run["dynamo_s"] for run in runs[mode, layers]), 2),
                    "backend_s": round(statistics.median(run["backend_s"] for run in runs[mode, layers]), 2),
                    "passes_s": round(statistics.median(run["passes_s"] for run in runs[mode, layers]), 2),
                    "region_calls": runs[mode, layers][0]["region_calls"],
                    "vs_smallest": round(capture / smallest, 2),
                }
            )
    print("| mode | layers | capture (s) | Dynamo (s) | backend (s) | pass suite (s) | region calls | vs the smallest depth |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        cells = [row["mode"], row["layers"], row["capture_s"], row["dynamo_s"], row["backend_s"], row["passes_s"]]
        cells.append(row["region_calls"])
        print("| " + " | ".join(str(cell) for cell in cells) + f" | {row['vs_smallest']}x |")
    if args.json:
        with open(args.json, "w") as file:
            table = {"world_size": 8, "dim": 64, "rounds": args.rounds, "symbolic": args.symbolic, "rows": rows}
            json.dump(table, file, indent=2)


if __name__ == "__main__":
    main()
