"""Train a Hugging Face transformers Llama with compile_shard's ``fully_shard`` and ``torch.compile``.

    pip install transformers
    torchrun --nproc-per-node 2 examples/train_hf_llama.py --steps 10

A small ``LlamaForCausalLM`` with random weights: no download, no tokenizer (the data
is synthetic token ids). The same steps as ``train_llama.py``: the model built on the
meta device, ``fully_shard`` per decoder layer then the root, ``to_empty`` and rank 0's
initial weights sent to every rank, per-rank data, AdamW, ``torch.compile``. For a
pretrained model, load its weights on rank 0 in ``build_full_model``.

Rank 0 prints one line per step, ``step <n> loss <repr(float)>``: the mean loss over
the global batch.
"""

from __future__ import annotations

import argparse
import os

# Never reach the Hugging Face Hub: the model is built from a config, not downloaded.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402
from torch.distributed.tensor import distribute_tensor  # noqa: E402

from compile_shard import fully_shard  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2, help="fewer than --heads: grouped-query attention")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch, split evenly over the ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend; 'none' trains eagerly")
    return parser.parse_args(argv)


def model_config(args: argparse.Namespace) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq,
        use_cache=False,  # training: no key/value cache
    )


def build_full_model(args: argparse.Namespace) -> transformers.LlamaForCausalLM:
    """The unsharded model with its initial weights (rank 0 only; the tests' reference)."""
    torch.manual_seed(args.seed)
    return transformers.LlamaForCausalLM(model_config(args))


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
    and the same full weights: the model *is* the concatenation of their shards (see
    train_llama.py for what goes wrong otherwise). Rank 0 builds the full model; each
    parameter is scattered from it, each buffer (the rotary embedding's ``inv_freq``,
    in no state dict) broadcast.
    """
    model.to_empty(device=device)
    full = build_full_model() if dist.get_rank() == 0 else None
    with torch.no_grad():
        for name, param in model.named_parameters():
            source = full.get_parameter(name) if full is not None else torch.empty(param.shape, dtype=param.dtype)
            param.copy_(distribute_tensor(source.to(device), param.device_mesh, param.placements, src_data_rank=0))
        for name, buffer in model.named_buffers():
            if full is not None:
                buffer.copy_(full.get_buffer(name))
            dist.broadcast(buffer, src=0)


def global_batch(step: int, args: argparse.Namespace) -> torch.Tensor:
    """Step ``step``'s whole batch, the same on every rank: rows counting up from a random start."""
    generator = torch.Generator().manual_seed(args.seed * 100_003 + step)
    start = torch.randint(0, args.vocab, (args.batch_size, 1), generator=generator)
    return (start + torch.arange(args.seq)) % args.vocab


@record  # if this rank raises, torchrun prints this rank's traceback as the root cause
def main(argv=None) -> None:
    args = parse_args(argv)
    device, mesh = setup_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world_size:
        raise ValueError(f"--batch-size {args.batch_size} does not split evenly over {world_size} ranks")

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(model_config(args))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)  # one all-gather and one reduce-scatter per decoder layer
    fully_shard(model, mesh=mesh)  # the rest: embedding, final norm, lm_head
    materialize(model, lambda: build_full_model(args), device)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    compiled = model if args.backend == "none" else torch.compile(model, backend=args.backend)
    per_rank = args.batch_size // world_size
    for step in range(1, args.steps + 1):
        tokens = global_batch(step, args)[rank * per_rank : (rank + 1) * per_rank].to(device)
        # With labels, the model computes the next-token loss itself (it shifts them).
        loss = compiled(input_ids=tokens, labels=tokens).loss
        loss.backward()  # gradients are reduce-scattered and averaged over the ranks
        optimizer.step()
        optimizer.zero_grad()

        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # every rank's batch has the same size: the mean of means
        if rank == 0:
            print(f"step {step} loss {mean_loss.item() / world_size!r}", flush=True)

    dist.barrier()  # no rank tears down the process group while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
