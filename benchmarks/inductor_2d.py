"""How far Inductor's gradients are from eager's on 2-D meshes, against the unsharded model's own distance.

    python benchmarks/inductor_2d.py                       # every layout (~10 min here)
    python benchmarks/inductor_2d.py --layouts tp_2x2

For each layout, gloo processes build the test Llama sharded that way twice, with
compile_shard and with torch FSDP2, and take one training step on the same batch:
compile_shard compiled with Inductor, torch FSDP2 eagerly. The figure is the largest
gradient difference relative to that gradient's largest entry, over the parameters.
The reference is the unsharded model, compiled with Inductor and run eagerly on the
global batch in one process: Inductor's own fusion and reduction orders move its
gradients that far. The eager and ``aot_eager`` runs are bitwise torch FSDP2's
(``tests/test_hsdp.py``, ``tests/test_tensor_parallel.py``), so the whole difference is
Inductor's.

Layouts: HSDP ``(replicate, shard)`` and tensor parallelism ``(dp, tp)`` with
``compile_shard.models.tensor_parallel_plan``, at (1, 2), (2, 1) and (2, 2).
Writes ``benchmarks/results/inductor_2d.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from compile_shard import fully_shard
from compile_shard.models import Llama, LlamaConfig, tensor_parallel_plan

CONFIG = LlamaConfig()
LAYOUTS = {
    f"{kind}_{shape[0]}x{shape[1]}": (kind, shape)
    for kind in ("hsdp", "tp")
    for shape in ((1, 2), (2, 1), (2, 2))
}
RESULTS = Path(__file__).resolve().parent / "results" / "inductor_2d.json"


def _batch(data_parallel_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, CONFIG.vocab_size, (2 * data_parallel_size, 9), generator=generator)


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _relative_difference(grads, reference_grads) -> float:
    return max(
        ((grad - reference).abs().max() / reference.abs().max()).item()
        for grad, reference in zip(grads, reference_grads)
    )


def _build(kind: str, mesh, shard):
    torch.manual_seed(0)
    model = Llama(CONFIG)
    for block in model.layers:
        if kind == "tp":
            parallelize_module(block, mesh["tp"], tensor_parallel_plan())
        shard(block, mesh=mesh["dp"] if kind == "tp" else mesh)
    shard(model, mesh=mesh["dp"] if kind == "tp" else mesh)
    return model


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _worker(rank: int, world_size: int, port: int, kind: str, shape: tuple[int, int], output: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    names = ("dp", "tp") if kind == "tp" else ("replicate", "shard")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    ours, theirs = _build(kind, mesh, fully_shard), _build(kind, mesh, torch_fully_shard)
    data_parallel_rank = rank // shape[1] if kind == "tp" else rank
    data_parallel_size = shape[0] if kind == "tp" else world_size
    tokens = _batch(data_parallel_size)[2 * data_parallel_rank : 2 * data_parallel_rank + 2]
    _loss(torch.compile(ours, fullgraph=True), tokens).backward()
    _loss(theirs, tokens).backward()
    difference = _relative_difference(
        [_local(p.grad) for p in ours.parameters()], [_local(p.grad) for p in theirs.parameters()]
    )
    differences = [None] * world_size
    dist.all_gather_object(differences, difference)
    if rank == 0:
        Path(output).write_text(json.dumps(max(differences)))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _sharded_difference(kind: str, shape: tuple[int, int]) -> float:
    with tempfile.TemporaryDirectory() as folder:
        output = os.path.join(folder, "difference.json")
        mp.start_processes(
            _worker,
            args=(math.prod(shape), _free_port(), kind, shape, output),
            nprocs=math.prod(shape),
            join=True,
            start_method="spawn",
        )
        return json.loads(Path(output).read_text())


def _unsharded_difference(data_parallel_size: int) -> float:
    torch.manual_seed(0)
    compiled = Llama(CONFIG)
    eager = copy.deepcopy(compiled)
    tokens = _batch(data_parallel_size)
    _loss(torch.compile(compiled, fullgraph=True), tokens).backward()
    _loss(eager, tokens).backward()
    return _relative_difference([p.grad for p in compiled.parameters()], [p.grad for p in eager.parameters()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    args = parser.parse_args()
    rows = []
    for name in args.layouts:
        kind, shape = LAYOUTS[name]
        data_parallel_size = shape[0] if kind == "tp" else math.prod(shape)
        row = {
            "layout": name,
            "sharded_inductor_vs_torch_fsdp2_eager": _sharded_difference(kind, shape),
            "unsharded_inductor_vs_eager": _unsharded_difference(data_parallel_size),
        }
        rows.append(row)
        print(
            f"{name:10s} sharded {row['sharded_inductor_vs_torch_fsdp2_eager']:.2e}   "
            f"unsharded {row['unsharded_inductor_vs_eager']:.2e}",
            flush=True,
        )
    RESULTS.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
