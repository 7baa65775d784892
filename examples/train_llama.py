"""Train a small Llama with compile_shard's ``fully_shard`` and ``torch.compile``, with checkpoints.

    torchrun --nproc-per-node 2 examples/train_llama.py --steps 20 --checkpoint-dir ckpt --checkpoint-every 10
    torchrun --nproc-per-node 2 examples/train_llama.py --steps 20 --checkpoint-dir ckpt --resume ckpt/step_10

The steps a real training script takes: a process group and a 1-D DeviceMesh; the model
built on the meta device (only rank 0 ever holds all its weights, once, to initialize
them); ``fully_shard`` per block, then the root; ``to_empty`` and an initialization that is the
same on every rank; a per-rank slice of each global batch; AdamW over the sharded
(DTensor) parameters; ``torch.compile``; and distributed checkpoints (DCP) that a
``--resume`` run loads to continue exactly where the first run stopped.

Rank 0 prints one line per step, ``step <n> loss <repr(float)>``: the mean loss over
the global batch, with every digit, so two runs can be compared exactly.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import distribute_tensor

from compile_shard import fully_shard
from compile_shard.models import Llama, LlamaConfig


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="train until this step (a resumed run too)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch, split evenly over the ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend; 'none' trains eagerly")
    parser.add_argument("--checkpoint-dir", type=Path, help="save checkpoints to <dir>/step_<n>")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="also save every N steps (0: last step only)")
    parser.add_argument("--resume", type=Path, help="a checkpoint folder (<dir>/step_<n>) to continue from")
    return parser.parse_args(argv)


def model_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        ffn_hidden=args.dim * 8 // 3,
        max_seq_len=args.seq,
    )


def build_full_model(args: argparse.Namespace) -> Llama:
    """The unsharded model with its initial weights (rank 0 only; the tests' reference)."""
    torch.manual_seed(args.seed)
    return Llama(model_config(args))


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: predict ``tokens[:, 1:]`` from ``tokens[:, :-1]``."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def setup_distributed() -> tuple[torch.device, DeviceMesh]:
    """One process per device: NCCL on GPUs, gloo on CPU. torchrun sets RANK, WORLD_SIZE, LOCAL_RANK."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device, init_device_mesh(device.type, (dist.get_world_size(),))


def materialize(model: torch.nn.Module, build_full_model, device: torch.device) -> None:
    """Gives the sharded meta-device ``model`` real storage and rank 0's initial weights.

    Every rank keeps only its own rows of each weight, so all ranks must start from one
    and the same full weights: the model *is* the concatenation of their shards. A
    per-rank random init is wrong in a quiet way: with one seed every rank draws the same
    rows (rank 1's shard repeats rank 0's, so those neurons stay identical copies); with
    different seeds the model matches no unsharded model, and changing the number of
    ranks changes it. Initializing on rank 0 and sending each rank its rows avoids both
    and needs no DTensor-aware random numbers. Rank 0 builds the full model (small here;
    for a large one, load pretrained weights there instead); the other ranks allocate one
    full tensor at a time, whose shape ``distribute_tensor`` reads.
    """
    model.to_empty(device=device)  # uninitialized storage in place of the meta tensors
    full = build_full_model() if dist.get_rank() == 0 else None
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied weight comes once
            source = full.get_parameter(name) if full is not None else torch.empty(param.shape, dtype=param.dtype)
            # Scatters rank 0's tensor: each rank receives the rows its Shard(0) holds.
            param.copy_(distribute_tensor(source.to(device), param.device_mesh, param.placements, src_data_rank=0))
        # Buffers are not sharded. Non-persistent ones (Llama's RoPE tables) come from no
        # state dict, and to_empty left them uninitialized as well: send rank 0's.
        for name, buffer in model.named_buffers():
            if full is not None:
                buffer.copy_(full.get_buffer(name))
            dist.broadcast(buffer, src=0)


def global_batch(step: int, args: argparse.Namespace) -> torch.Tensor:
    """The whole batch of ``step``, identical on every rank and in a resumed run.

    A learnable toy task: each row counts up by one from a random start (mod vocab),
    so the loss falls within a few steps. Seeding by step means a resumed run sees the
    same data without saving any data-loader state.
    """
    generator = torch.Generator().manual_seed(args.seed * 100_003 + step)
    start = torch.randint(0, args.vocab, (args.batch_size, 1), generator=generator)
    return (start + torch.arange(args.seq + 1)) % args.vocab


def save_checkpoint(path: Path, model, optimizer, step: int) -> None:
    """Every rank writes its own shards (``get_state_dict`` returns DTensors); no gathering."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state, "step": step}, checkpoint_id=path)


def load_checkpoint(path: Path, model, optimizer) -> int:
    """Loads in place: the state dicts from ``get_state_dict`` say which shards this rank reads."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": 0}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return state["step"]


@record  # if this rank raises, torchrun prints this rank's traceback as the root cause
def main(argv=None) -> None:
    args = parse_args(argv)
    device, mesh = setup_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world_size:
        raise ValueError(f"--batch-size {args.batch_size} does not split evenly over {world_size} ranks")
    if (args.checkpoint_dir or args.resume) and importlib.util.find_spec("numpy") is None:
        # DCP agrees on a plan through object collectives, which torch 2.13 decodes with numpy.
        raise RuntimeError("checkpointing (torch.distributed.checkpoint) needs numpy: pip install numpy")

    with torch.device("meta"):
        model = Llama(model_config(args))
    for block in model.layers:
        fully_shard(block, mesh=mesh)  # one all-gather and one reduce-scatter per block
    fully_shard(model, mesh=mesh)  # the rest: embedding (tied with the output), final norm

    materialize(model, lambda: build_full_model(args), device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    first_step = 1
    if args.resume:
        first_step = load_checkpoint(args.resume, model, optimizer) + 1
    # Checkpoints use ``model``: the compiled wrapper shares its parameters but would
    # prefix their names with ``_orig_mod.``.
    compiled = model if args.backend == "none" else torch.compile(model, backend=args.backend)

    per_rank = args.batch_size // world_size
    for step in range(first_step, args.steps + 1):
        tokens = global_batch(step, args)[rank * per_rank : (rank + 1) * per_rank].to(device)
        loss = lm_loss(compiled, tokens)
        loss.backward()  # gradients are reduce-scattered and averaged over the ranks
        optimizer.step()
        optimizer.zero_grad()

        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # every rank's batch has the same size: the mean of means
        if rank == 0:
            print(f"step {step} loss {mean_loss.item() / world_size!r}", flush=True)
        periodic = args.checkpoint_every and step % args.checkpoint_every == 0
        if args.checkpoint_dir and (periodic or step == args.steps):
            path = args.checkpoint_dir / f"step_{step}"
            save_checkpoint(path, model, optimizer, step)
            if rank == 0:
                print(f"saved {path}", flush=True)

    dist.barrier()  # no rank tears down the process group while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
