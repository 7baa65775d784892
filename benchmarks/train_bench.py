"""Training-step benchmark: compile_shard against torch FSDP2, FSDP2 with per-block compile, and DDP.

    python benchmarks/train_bench.py --config A                        # 2 gloo processes per mode, all modes
    python benchmarks/train_bench.py --config A --world-size 4
    python benchmarks/train_bench.py --config smoke --modes cs_eager,fsdp2_eager,reference --json out.json
    python benchmarks/train_bench.py --config B --modes cs_compiled,fsdp2_eager --against c895265
    python benchmarks/train_bench.py --config B --modes cs_compiled,floor --rounds 3  # alternated
    python benchmarks/train_bench.py --config B --device cuda          # one GPU, fake process group of 8 ranks
    python benchmarks/train_bench.py --config smoke --device cpu --fake-world-size 8
    torchrun --nproc-per-node 2 benchmarks/train_bench.py --config A

Trains the Llama-style decoder of ``compile_shard.models`` (vocab 1001, so dim 0 shards
unevenly) with AdamW on seeded random tokens, once per mode, every mode on the same
batches, each mode in its own fresh processes, one mode after the other:

- ``cs_eager``: compile_shard's ``fully_shard`` per block, then the root.
- ``cs_compiled``: the same model under ``torch.compile`` with the default settings:
  the full pass suite, each block traced as a nested compile region that the blocks
  like it reuse (``settings.compile_regions``).
- ``cs_compiled_no_overlap``: the same with the overlap passes (``bucket``, ``reorder``
  in ``compile_shard.passes.settings``) switched off, those that exist in this checkout.
- ``cs_compiled_inlined``: ``cs_compiled`` with ``settings.compile_regions`` off: every
  block inlined into the step's graph, the default until 2026-11-27 (results before
  then call this mode ``cs_compiled`` and the regions ``cs_compiled_regions``).
- ``cs_compiled_no_rank_check``: ``cs_compiled`` with ``settings.rank_check`` off (the
  check's cost: docs/benchmarks.md, "Rank check").
- ``cs_block_compiled``: torchtitan's recipe with compile_shard: ``block.compile(fullgraph=True)``
  for each block, then ``fully_shard`` per block and the root; the sharding runs eagerly
  around the compiled blocks, as FSDP2's hooks do.
- ``fsdp2_eager``: ``torch.distributed.fsdp.fully_shard`` per block, then the root.
- ``fsdp2_block_compiled``: torchtitan's recipe, ``block.compile(fullgraph=True)`` for
  each block, then FSDP2's ``fully_shard`` per block and the root.
- ``ddp``, ``ddp_compiled``: ``DistributedDataParallel``, eager and under ``torch.compile``.
- ``reference``: the unsharded model in one process on the global batch, one rank-sized
  micro-batch after the other (the mean of their losses): the loss reference.
- ``floor``: the unsharded model under ``torch.compile`` with the run's backend, its
  parameters (and buffers) in the policy's ``param_dtype`` (bf16 with ``--mp bf16``),
  on one rank's batch in one process with one rank's threads, alone: the step a rank
  would take if sharding cost nothing. Its losses are one rank's rows', not compared.

Measured per mode (docs/benchmarks.md explains each method):

- Step times: the cold first step (compilation included), then the median and minimum
  of the timed steps after warm-up. Every step starts after a barrier; a step's time is
  its slowest rank's. With ``--rounds N`` the modes run N times, alternating, and each
  mode's timed steps are pooled (its cold step: the median of its rounds', each from an
  empty Inductor cache; its memory: the largest round's).
- Memory: glibc's ``M_MMAP_THRESHOLD`` is fixed with ``mallopt`` at process start, so
  freed large tensors go back to the OS and the resident set follows live tensors
  (``--cpu-allocator``, below, times steps with glibc configured otherwise).
  ``peak``: the peak RSS of the whole run (``ru_maxrss``, compilation included) minus
  the RSS right after building the model. ``step``: the peak RSS of the timed steps
  (``VmHWM``, reset through ``/proc/self/clear_refs`` after warm-up) minus the RSS
  before them, what a step allocates and frees again. On CUDA the same with
  ``torch.cuda.max_memory_allocated`` and ``memory_allocated``.
- Collectives per step by kind: eager modes, and the compiled modes whose collectives
  torch issues outside the compiled graphs (FSDP2's hooks, DDP's reducer), are counted
  with ``CollectiveCounter`` on one extra step after the timed ones, run eagerly
  (Dynamo does not compile under a dispatch mode), which for those modes issues the
  same collectives; compile_shard's compiled modes are counted in the forward and
  backward graphs the backend compiles.
- Compiled modes: Dynamo's graph count and graph breaks (``torch._dynamo.utils.counters``)
  and recompiles (Dynamo's compilation metrics: torch 2.13 no longer fills
  ``counters["recompiles"]``).
- CPU per timed step, per rank: user and system seconds and minor page faults of the
  whole process (``getrusage``: gloo's threads included), to tell a step's compute
  from the kernel's share and from idle waiting.
- The largest difference of the per-step global loss from the reference.
- Per rank, the seconds compile_shard's rank check spent comparing new graphs across
  the ranks (``rank_check_s``), waiting for the other ranks to reach it included.

Figures are printed with their ratio to ``fsdp2_eager``, and when ``floor`` ran, each
mode's median step with its ratio to the floor's (``ratios_to_floor`` in the JSON: every
ratio field); ``--json`` writes everything. On the fake process group that ratio is a
mode's own overhead beyond the model's compute (copies in and out, casts, padding, extra
kernels), as no communication happens there.
``--no-reshard-after-forward`` keeps the FSDP modes' blocks gathered from forward to
backward (FSDP2's ``reshard_after_forward=False``): one all-gather per block and step
instead of two, DDP's bytes per step.
``--cpu-allocator`` chooses how glibc's allocator serves the tensors on a CPU, set with
``mallopt`` at each process's start. ``fixed`` (the default) fixes the mmap threshold:
every tensor over 128 KiB is a fresh mapping, unmapped when it dies, so the resident set
follows the live tensors, and every large tensor's first write page-faults. ``adaptive``
leaves glibc as a user's process has it: a freed block up to 32 MiB raises the threshold
and is reused, larger ones are still fresh mappings. ``caching`` maps nothing and trims
nothing: freed memory is reused for the next tensor, as a GPU's caching allocator
reuses it, so the step times leave out the page faults of fresh memory, which grow with
the number of large tensors a mode creates rather than with its compute. With
``adaptive`` and ``caching`` the memory figures include freed heap memory and compare
only within their run.
``--mp bf16`` trains every mode in FSDP2's usual mixed precision, bf16 parameters and
compute with fp32 reductions: ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32)`` on every ``fully_shard`` call of both FSDP
implementations, DDP's own ``mixed_precision`` with the same dtypes (its buffers too;
on a CPU, where that cannot run, fp32 DDP with its forward under bf16 autocast).
The reference stays fp32, so the loss difference shows the policy's deviation.
With ``--device cuda`` (or ``--fake-world-size``) one process per mode runs rank 0 of a
fake process group: steps then measure compute, copies and launch overhead without
communication, losses are not compared (the fake group moves no data), the reference
runs one rank's batch (the compute of a step without sharding), and for
compile_shard's compiled modes ``compile_shard.passes.simulate`` replays the compiled
graphs on a hardware profile (``--cost-profile``, default ``h100_nvlink``): its exposed
communication is added to the measured step for a projected step time.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import math
import os
import pickle
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _MixedPrecision as _DDPMixedPrecision

import compile_shard.passes
from against import checkout, environment, mode_of, named
from compile_shard._collectives import KINDS, node_collective
from compile_shard import fully_shard
from compile_shard.debug import CollectiveCounter
from compile_shard.ops.rank_check import _state as rank_check_state
from compile_shard.models import Llama, LlamaConfig

SCHEMA_VERSION = 1
COLLECTIVE_KINDS = KINDS
OVERLAP_SETTINGS = ("bucket", "reorder")
# glibc's mallopt parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's initial value, frozen: it no longer grows after frees
NEVER_TRIM_BYTES = 2**31 - 1  # mallopt's largest value: the heap's free top is kept
MB = 2**20


@dataclasses.dataclass(frozen=True)
class CpuAllocator:
    """A ``--cpu-allocator`` choice: glibc's settings at process start, and what the memory figures then measure."""

    #: ``(parameter, value)`` pairs for ``mallopt``; none leaves glibc as it comes.
    mallopt_calls: tuple[tuple[int, int], ...]
    memory_method: str


CPU_ALLOCATORS = {
    "fixed": CpuAllocator(
        ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),),
        f"mallopt(M_MMAP_THRESHOLD, {MMAP_THRESHOLD_BYTES}) at process start",
    ),
    "adaptive": CpuAllocator((), "glibc's adaptive mmap threshold (the RSS keeps freed heap memory)"),
    "caching": CpuAllocator(
        ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER_TRIM_BYTES)),
        f"mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, {NEVER_TRIM_BYTES}) at process start (the RSS keeps "
        "freed heap memory)",
    ),
}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Model size, batch and schedule of one named configuration."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    seq: int
    batch_per_rank: int
    world_size: int
    steps: int
    warmup: int

    def llama(self) -> LlamaConfig:
        return LlamaConfig(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            ffn_hidden=_ffn_hidden(self.dim),
            max_seq_len=self.seq,
        )


def _ffn_hidden(dim: int) -> int:
    """SwiGLU width as in Llama: 8/3 of ``dim``, rounded up to a multiple of 64."""
    return 64 * math.ceil(8 * dim / 3 / 64)


CONFIGS = {
    "A": BenchConfig("A", dim=256, n_layers=4, n_heads=4, seq=128, batch_per_rank=4, world_size=2, steps=10, warmup=2),
    "B": BenchConfig("B", dim=1024, n_layers=8, n_heads=8, seq=64, batch_per_rank=2, world_size=2, steps=10, warmup=2),
    "smoke": BenchConfig(
        "smoke", dim=32, n_layers=2, n_heads=4, seq=16, batch_per_rank=2, world_size=2, steps=3, warmup=1
    ),
}


# Modes -----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BuildContext:
    """What a mode's builder needs besides the model: the mesh and the compile backend."""

    mesh: DeviceMesh | None
    backend: str | Callable | None
    #: For the blocks of the FSDP modes; the root keeps FSDP2's default (not resharded).
    reshard_after_forward: bool = True
    #: ``--mp``: the dtype of parameters and compute (reductions stay fp32); None: fp32 throughout.
    param_dtype: torch.dtype | None = None

    def mp_policy(self) -> MixedPrecisionPolicy:
        if self.param_dtype is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)


def _build_cs(model: Llama, ctx: BuildContext) -> nn.Module:
    for block in model.layers:
        fully_shard(block, mesh=ctx.mesh, reshard_after_forward=ctx.reshard_after_forward, mp_policy=ctx.mp_policy())
    return fully_shard(model, mesh=ctx.mesh, mp_policy=ctx.mp_policy())


def _build_cs_compiled(model: Llama, ctx: BuildContext) -> nn.Module:
    return torch.compile(_build_cs(model, ctx), backend=ctx.backend)


def _build_cs_block_compiled(model: Llama, ctx: BuildContext) -> nn.Module:
    """``fsdp2_block_compiled``'s recipe with compile_shard's ``fully_shard``."""
    return _build_cs(compile_blocks(model, ctx.backend), ctx)


def _build_fsdp2(model: Llama, ctx: BuildContext) -> nn.Module:
    for block in model.layers:
        torch_fully_shard(
            block, mesh=ctx.mesh, reshard_after_forward=ctx.reshard_after_forward, mp_policy=ctx.mp_policy()
        )
    return torch_fully_shard(model, mesh=ctx.mesh, mp_policy=ctx.mp_policy())


def compile_blocks(model: nn.Module, backend: str | Callable | None) -> nn.Module:
    """torchtitan's order: each block compiled first (then sharded, the sharding outside the graphs)."""
    for block in model.layers:
        block.compile(fullgraph=True, backend=backend)
    return model


def _build_fsdp2_block_compiled(model: Llama, ctx: BuildContext) -> nn.Module:
    return _build_fsdp2(compile_blocks(model, ctx.backend), ctx)


class _Autocast(nn.Module):
    """``module``'s forward under autocast: DDP's mixed precision where its own cannot run."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.device_type = device_type
        self.dtype = dtype

    def forward(self, *args: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args)


def _build_ddp(model: Llama, ctx: BuildContext) -> nn.Module:
    if ctx.param_dtype is None:
        return DistributedDataParallel(model)
    if ctx.mesh is not None and ctx.mesh.device_type == "cpu":
        # DDP's own mixed precision records device events, which a CPU has none of
        # ("cpu backend doesn't support events"): fp32 parameters and reductions,
        # compute in param_dtype under autocast, as DDP users train on a CPU.
        return _Autocast(DistributedDataParallel(model), ctx.mesh.device_type, ctx.param_dtype)
    dtypes = _DDPMixedPrecision(param_dtype=ctx.param_dtype, reduce_dtype=torch.float32, buffer_dtype=ctx.param_dtype)
    return DistributedDataParallel(model, mixed_precision=dtypes)


def _build_ddp_compiled(model: Llama, ctx: BuildContext) -> nn.Module:
    return torch.compile(_build_ddp(model, ctx), backend=ctx.backend)


def _build_reference(model: Llama, ctx: BuildContext) -> nn.Module:
    return model


def _build_floor(model: Llama, ctx: BuildContext) -> nn.Module:
    """The unsharded model compiled, in the dtype the FSDP modes compute in.

    Its parameters are ``param_dtype`` themselves, so nothing is cast per step: the
    sharded modes' unsharded parameters are ``param_dtype`` too, and their blocks get
    RoPE's tables in it (``cast_forward_inputs``), hence the buffers are cast as well.
    The optimizer then steps the ``param_dtype`` parameters, the whole model's.
    """
    if ctx.param_dtype is not None:
        model.to(ctx.param_dtype)
    return torch.compile(model, backend=ctx.backend)


@dataclasses.dataclass(frozen=True)
class Mode:
    """How to build a mode, and where its collectives are counted.

    ``counted_in_graphs``: the mode's collectives live inside its compiled graphs, so
    they are counted there; every other mode issues them eagerly (even when compiled)
    and is counted with a dispatch mode.
    """

    build: Callable[[Llama, BuildContext], nn.Module]
    distributed: bool = True
    compiled: bool = False
    counted_in_graphs: bool = False
    overlap_off: bool = False
    compile_regions: bool = True
    rank_check: bool = True
    #: DDP's reducer reads its all-reduce's result, which the fake process group does not
    #: produce (torch 2.11 and 2.13 assert in ``c10d/comm.cpp`` at the first backward).
    runs_on_fake_group: bool = True
    #: Trains rank 0's rows alone (the floor): its losses are not the global batch's.
    one_rank_alone: bool = False


MODES = {
    "cs_eager": Mode(_build_cs),
    "cs_compiled": Mode(_build_cs_compiled, compiled=True, counted_in_graphs=True),
    "cs_compiled_no_overlap": Mode(_build_cs_compiled, compiled=True, counted_in_graphs=True, overlap_off=True),
    "cs_compiled_inlined": Mode(_build_cs_compiled, compiled=True, counted_in_graphs=True, compile_regions=False),
    "cs_compiled_no_rank_check": Mode(_build_cs_compiled, compiled=True, counted_in_graphs=True, rank_check=False),
    "cs_block_compiled": Mode(_build_cs_block_compiled, compiled=True),
    "fsdp2_eager": Mode(_build_fsdp2),
    "fsdp2_block_compiled": Mode(_build_fsdp2_block_compiled, compiled=True),
    "ddp": Mode(_build_ddp, runs_on_fake_group=False),
    "ddp_compiled": Mode(_build_ddp_compiled, compiled=True, runs_on_fake_group=False),
    "reference": Mode(_build_reference, distributed=False),
    "floor": Mode(_build_floor, distributed=False, compiled=True, one_rank_alone=True),
}
BASELINE_MODE = "fsdp2_eager"
FLOOR_MODE = "floor"


def _switch_off_overlap_passes() -> list[str]:
    """Turns off the overlap passes this checkout has; returns their names (the others do not exist yet)."""
    settings = compile_shard.passes.settings
    switched = [name for name in OVERLAP_SETTINGS if hasattr(settings, name)]
    for name in switched:
        setattr(settings, name, False)
    return switched


# Collectives in compiled graphs ----------------------------------------------------------------------------------


class GraphRecorder:
    """Counts the collectives in each forward and backward graph a backend compiles.

    Inductor: a ``post_grad_custom_post_pass`` appended after the one ``fully_shard``
    installs (which schedules the graph) sees each graph as Inductor lowers it:
    after compile_shard's joint-graph passes, bucketing and reordering included.
    Inductor's FX graph cache and AOTAutograd's cache are off, as a cache hit would
    skip the hook (each mode also starts from an empty Inductor cache directory, so the
    cold step is a real cold compile). ``aot_eager``: its forward and backward compilers
    count; like plain ``aot_eager``, they run the partitioner's order unscheduled.
    Graphs are kept only for the simulation (``keep_graphs``), as they hold memory.
    """

    def __init__(self, backend_name: str, keep_graphs: bool) -> None:
        self.backend_name = backend_name
        self.keep_graphs = keep_graphs
        self.counts: list[Counter] = []
        self.region_calls = 0
        self.graphs: list[fx.Graph] = []

    def backend(self) -> str | Callable:
        if self.backend_name == "inductor":
            return "inductor"
        if self.backend_name == "aot_eager":
            from torch._dynamo.backends.common import aot_autograd
            from torch._dynamo.backends.debugging import boxed_nop
            from torch._functorch.partitioners import min_cut_rematerialization_partition

            def compiler(graph_module: fx.GraphModule, example_inputs):
                self.record(graph_module.graph)
                return boxed_nop(graph_module, example_inputs)

            # aot_eager's own settings.
            return aot_autograd(
                fw_compiler=compiler,
                bw_compiler=compiler,
                partition_fn=min_cut_rematerialization_partition,
                keep_inference_input_mutations=True,
            )
        raise ValueError(f"unknown backend {self.backend_name!r}: expected 'inductor' or 'aot_eager'")

    def attach(self) -> None:
        """Hooks Inductor; call it after ``fully_shard``, whose ``install()`` must not wrap this hook."""
        if self.backend_name != "inductor":
            return
        config = torch._inductor.config
        installed = config.post_grad_custom_post_pass
        if installed is None:
            installed = []
        elif not isinstance(installed, (list, tuple)):
            installed = [installed]

        def record_after_installed(graph: fx.Graph) -> None:  # one callable: torch 2.11 takes no list
            for graph_pass in installed:
                graph_pass(graph)
            self.record(graph)

        config.post_grad_custom_post_pass = record_after_installed
        config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False

    def record(self, graph: fx.Graph) -> None:
        found = (node_collective(node) for node in graph.nodes)
        self.counts.append(Counter(collective.kind for collective in found if collective is not None))
        self.region_calls += len(graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph))
        if self.keep_graphs:
            self.graphs.append(graph)

    def collectives(self) -> dict[str, int]:
        """Collectives summed over every compiled graph: per step when each graph runs once per step."""
        return _all_kinds(sum(self.counts, Counter()))


def _all_kinds(counts) -> dict[str, int]:
    return {kind: counts.get(kind, 0) for kind in COLLECTIVE_KINDS}


def _simulate(graphs: list[fx.Graph], profile_name: str, world_size: int) -> dict[str, float | str]:
    """The communication a cost model projects for one step's forward and backward graphs.

    The fake process group measures everything but communication;
    ``exposed_communication_s`` is what the simulated schedule could not hide behind
    compute, the part to add to the measured step for a projection. Imported here, as
    only the fake process group needs the cost model.
    """
    from compile_shard.passes.cost_model import get_profile
    from compile_shard.passes.simulate import simulate_step

    simulation = simulate_step(graphs, get_profile(profile_name), world_size=world_size)
    return {
        "profile": profile_name,
        "communication_s": simulation.communication_seconds,
        "exposed_communication_s": simulation.exposed_communication_seconds,
        "compute_s": simulation.compute_seconds,
        "step_s": simulation.step_seconds,
    }


# Memory ----------------------------------------------------------------------------------------------------------


def configure_cpu_allocator(cpu_allocator: str) -> bool:
    """Applies ``--cpu-allocator``'s ``mallopt`` calls; False where none applied (none asked, or no glibc).

    ``fixed``: glibc raises its mmap threshold after a large block is freed, so later
    tensors of that size come from the heap and stay resident after they die; a fixed
    threshold keeps them on mmap, and RSS follows live tensors. ``caching``: no block is
    mmapped and the heap's free top is never returned, so each freed tensor's pages serve
    the next one without page faults.
    """
    calls = CPU_ALLOCATORS[cpu_allocator].mallopt_calls
    if not calls:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    return mallopt is not None and all(mallopt(parameter, value) for parameter, value in calls)


def _current_rss_bytes() -> int | None:
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    """``ru_maxrss`` in bytes (Linux reports kibibytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_rss_high_water_mark() -> bool:
    """Resets the kernel's peak RSS (``VmHWM``) so that later reads see only what follows."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _rss_high_water_mark_bytes() -> int:
    """``VmHWM``: unlike ``ru_maxrss`` it is not raised again by threads that exited before the reset."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class MemoryProbe:
    """Peak memory of the whole run above the built model, and of one step above what persists between steps.

    The second figure leaves out optimizer state and what compilation keeps (compiled
    code, graphs), which the first one counts: a step's activations, unsharded
    parameters and gradients, at their peak. CPU: resident memory; CUDA: the caching
    allocator's allocated bytes.
    """

    def __init__(self, device: torch.device, cpu_allocator: str = "fixed"):
        self.cuda = device.type == "cuda"
        self.cpu_allocator = cpu_allocator
        self.after_build_bytes: int | None = None
        self.before_steps_bytes: int | None = None
        self.peak_before_steps = 0

    def mark_built(self) -> None:
        self.after_build_bytes = self._current()

    def mark_timed_steps(self) -> None:
        """Keeps the peak so far and starts measuring the timed steps' own peak."""
        self.peak_before_steps = self._whole_run_peak()  # the reset lowers ru_maxrss as well
        if self._reset_peak():
            self.before_steps_bytes = self._current()

    def peaks_mb(self) -> tuple[float | None, float | None]:
        """(whole run above the built model, timed steps above their start) in MiB; ``None``: not measurable."""
        whole_run = step = None
        if self.after_build_bytes is not None:
            whole_run = (max(self.peak_before_steps, self._whole_run_peak()) - self.after_build_bytes) / MB
        if self.before_steps_bytes is not None:
            step = (self._timed_steps_peak() - self.before_steps_bytes) / MB
        return whole_run, step

    def _current(self) -> int | None:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()
        return _current_rss_bytes()

    def _whole_run_peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return _peak_rss_bytes()

    def _timed_steps_peak(self) -> int:
        return self._whole_run_peak() if self.cuda else _rss_high_water_mark_bytes()

    def _reset_peak(self) -> bool:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return True
        return _reset_rss_high_water_mark()

    def method(self) -> str:
        if self.cuda:
            return (
                "peak: torch.cuda.max_memory_allocated minus memory_allocated after building the model; "
                "step peak: the same over the timed steps minus memory_allocated before them"
            )
        return (
            f"{CPU_ALLOCATORS[self.cpu_allocator].memory_method}; peak: ru_maxrss minus the RSS after building the "
            "model; step peak: VmHWM over the timed steps (reset through /proc/self/clear_refs after warm-up) minus "
            "the RSS before them"
        )


def _local_param_mb(model: nn.Module) -> float:
    """Parameter storage this rank holds (its shards under FSDP): the part the memory baseline contains."""
    local = (p.to_local() if isinstance(p, torch.distributed.tensor.DTensor) else p for p in model.parameters())
    return sum(t.numel() * t.element_size() for t in local) / MB


# One mode on one rank --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything a mode's worker process needs; pickled into it."""

    mode: str
    config: BenchConfig
    fake: bool
    device: str
    backend: str
    cost_profile: str
    threads: int
    master_addr: str
    port: int
    result_path: str
    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None
    #: ``--cpu-allocator``: a key of ``CPU_ALLOCATORS``.
    cpu_allocator: str = "fixed"


def _lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _total_steps(config: BenchConfig) -> int:
    """Cold step, warm-up, timed steps, and the step that counts collectives."""
    return 1 + config.warmup + config.steps + 1


def _global_batches(config: BenchConfig) -> list[torch.Tensor]:
    """The same seeded token batches for every mode: one row block per rank."""
    generator = torch.Generator().manual_seed(0)
    shape = (config.world_size * config.batch_per_rank, config.seq + 1)
    vocab = config.llama().vocab_size
    return [torch.randint(0, vocab, shape, generator=generator) for _ in range(_total_steps(config))]


def _rows(plan: Plan, rank: int) -> slice:
    """This process's rows of the global batch: all of them for the reference, unless under the fake group.

    The floor's are rank 0's: it measures one rank's step, so it takes one rank's batch.
    """
    mode = MODES[plan.mode]
    if mode.distributed or mode.one_rank_alone or plan.fake:
        return slice(rank * plan.config.batch_per_rank, (rank + 1) * plan.config.batch_per_rank)
    return slice(None)


def _micro_batches(plan: Plan, rows: slice) -> int:
    """The reference takes the global batch as one rank-sized micro-batch per rank.

    The mean of their losses is the mean over the whole batch, with the ranks' matmul
    shapes: one matmul over the whole batch rounds differently wherever the CPU's
    kernels block the larger shape otherwise (on an AVX-512 Xeon every eager mode,
    DDP's included, was 1.6e-5 from such a reference on config B).
    """
    return plan.config.world_size if rows == slice(None) else 1


def _mesh(plan: Plan) -> DeviceMesh | None:
    return init_device_mesh(plan.device, (plan.config.world_size,)) if MODES[plan.mode].distributed else None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _barrier(distributed: bool) -> None:
    if distributed:
        dist.barrier()


def _train_step(runnable, optimizer, tokens: torch.Tensor, micro_batches: int = 1) -> torch.Tensor:
    """One step; the loss is the mean over ``micro_batches`` equal row blocks (see ``_micro_batches``)."""
    if micro_batches == 1:
        loss = _lm_loss(runnable, tokens)
    else:
        loss = sum(_lm_loss(runnable, chunk) for chunk in tokens.chunk(micro_batches)) / micro_batches
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def _compile_stats(recorder: GraphRecorder) -> dict:
    """Dynamo's graphs, graph breaks (with their reasons) and recompiles, and the graphs the backend compiled.

    Recompiles come from Dynamo's compilation metrics: torch 2.13 does not fill
    ``counters["recompiles"]``.
    """
    from torch._dynamo.utils import counters, get_compilation_metrics

    return {
        "unique_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "graph_break_reasons": sorted({" ".join(reason.splitlines()[:2]) for reason in counters["graph_break"]}),
        "recompiles": sum(1 for metrics in get_compilation_metrics() if metrics.recompile_reason),
        "backend_graphs": len(recorder.counts),
        # Calls of compile regions in those graphs, forward and backward: 0 when every block ran inlined.
        "region_calls": recorder.region_calls,
    }


def _counting_step(
    mode: Mode, recorder: GraphRecorder, runnable, optimizer, tokens, micro_batches: int
) -> tuple[torch.Tensor, dict]:
    """One more training step; returns its loss and the collectives per step.

    Modes counted with the dispatch mode run this step eagerly (``force_eager``): Dynamo
    does not compile under a dispatch mode, and a ``fullgraph`` block would raise
    instead of falling back. Their collectives are issued outside the compiled graphs,
    so the eager step issues the same ones.
    """
    if mode.counted_in_graphs:
        return _train_step(runnable, optimizer, tokens, micro_batches), recorder.collectives()
    counter = CollectiveCounter()
    with torch.compiler.set_stance("force_eager"), counter:
        loss = _train_step(runnable, optimizer, tokens, micro_batches)
    return loss, _all_kinds(counter.counts)


def _timed_steps(
    runnable,
    optimizer,
    batches,
    micro_batches: int,
    warmup: int,
    memory: MemoryProbe,
    distributed: bool,
    device: torch.device,
) -> tuple[list[torch.Tensor], list[float], dict]:
    """The cold step, the warm-up and the timed steps.

    Returns each step's loss and time on this rank, and this process's CPU time and
    page faults per timed step (``_cpu_per_step``).
    """
    losses, times = [], []
    for step, tokens in enumerate(batches):
        if step == 1 + warmup:
            memory.mark_timed_steps()
            cpu_before = resource.getrusage(resource.RUSAGE_SELF)
        _barrier(distributed)
        start = time.perf_counter()
        losses.append(_train_step(runnable, optimizer, tokens, micro_batches))
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return losses, times, _cpu_per_step(cpu_before, resource.getrusage(resource.RUSAGE_SELF), len(batches) - 1 - warmup)


def _cpu_per_step(before, after, steps: int) -> dict:
    """CPU seconds (user, system) and minor page faults of the whole process, its threads included, per step.

    Where a step's time goes beyond the profile of its main thread: gloo's own threads
    (DDP's all-reduces run there), the kernel's share (socket copies, page faults of
    fresh memory: with the fixed mmap threshold every large tensor is a fresh mapping)
    and idle time (a step's time minus its CPU time, on a core of its own).
    """
    return {
        "user_s": (after.ru_utime - before.ru_utime) / steps,
        "system_s": (after.ru_stime - before.ru_stime) / steps,
        "minor_faults": (after.ru_minflt - before.ru_minflt) / steps,
    }


def _run_rank(plan: Plan, rank: int) -> dict:
    """Trains one mode on this rank; returns this rank's raw measurements."""
    mode = MODES[plan.mode]
    device = torch.device(plan.device)
    distributed = mode.distributed and not plan.fake
    rows = _rows(plan, rank)
    batches = [batch[rows].to(device) for batch in _global_batches(plan.config)]
    micro_batches = _micro_batches(plan, rows)
    recorder = GraphRecorder(plan.backend, keep_graphs=plan.fake and mode.counted_in_graphs)
    overlap_off = _switch_off_overlap_passes() if mode.overlap_off else None
    compile_shard.passes.settings.compile_regions = mode.compile_regions
    compile_shard.passes.settings.rank_check = mode.rank_check
    ctx = BuildContext(
        _mesh(plan), recorder.backend() if mode.compiled else None, plan.reshard_after_forward, plan.param_dtype
    )
    torch.manual_seed(0)
    model = Llama(plan.config.llama()).to(device)
    runnable = mode.build(model, ctx)
    if mode.compiled:
        recorder.attach()
    memory = MemoryProbe(device, plan.cpu_allocator)
    memory.mark_built()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, times, cpu = _timed_steps(
        runnable, optimizer, batches[:-1], micro_batches, plan.config.warmup, memory, distributed, device
    )
    peak_mb, step_peak_mb = memory.peaks_mb()
    compile_stats = _compile_stats(recorder) if mode.compiled else None
    simulation = _simulate(recorder.graphs, plan.cost_profile, plan.config.world_size) if recorder.graphs else None

    count_loss, collectives = _counting_step(mode, recorder, runnable, optimizer, batches[-1], micro_batches)
    losses.append(count_loss)
    return {
        "batch_shape": list(batches[0].shape),
        "times": times,
        "cpu_per_step": cpu,
        "losses": [loss.item() for loss in losses],
        "peak_mb": peak_mb,
        "step_peak_mb": step_peak_mb,
        "param_mb": _local_param_mb(model),
        "collectives": collectives,
        "graph_collectives": recorder.collectives() if mode.compiled else None,
        "compile": compile_stats,
        "simulation": simulation,
        "overlap_settings_off": overlap_off,
        "memory_method": memory.method(),
        "rank_check_s": rank_check_state.seconds,
    }


def _merge_ranks(plan: Plan, per_rank: list[dict], mallopt_applied: bool) -> dict:
    """One mode's result: per step the slowest rank's time and the mean of the ranks' losses."""
    mode = MODES[plan.mode]
    first = per_rank[0]
    step_times = [max(column) for column in zip(*(r["times"] for r in per_rank))]
    timed = step_times[1 + plan.config.warmup :]
    median = statistics.median(timed)
    simulation = first["simulation"]
    return {
        "processes": len(per_rank),
        # One process's tokens per step, (rows, seq + 1): one rank's, but the reference's global batch on gloo.
        "batch_shape": first["batch_shape"],
        "cold_step_s": step_times[0],
        "median_step_s": median,
        # Per rank, the time in the rank check's exchanges (the first run of each new graph),
        # waiting for the other ranks to reach the check included.
        "rank_check_s": [r["rank_check_s"] for r in per_rank],
        "min_step_s": min(timed),
        "step_times_s": timed,
        "cpu_per_step": [r["cpu_per_step"] for r in per_rank],
        "peak_memory_mb": [r["peak_mb"] for r in per_rank],
        "step_peak_memory_mb": [r["step_peak_mb"] for r in per_rank],
        "param_memory_mb": [r["param_mb"] for r in per_rank],
        "memory_method": first["memory_method"],
        "mallopt_applied": mallopt_applied,
        "collectives": first["collectives"],
        "collectives_equal_on_all_ranks": all(r["collectives"] == first["collectives"] for r in per_rank),
        "collectives_method": (
            "_c10d_functional collectives in the compiled forward and backward graphs"
            if mode.counted_in_graphs
            else "CollectiveCounter dispatch mode on one extra eager step after the timed steps"
        ),
        "graph_collectives": first["graph_collectives"],
        "compile": first["compile"],
        "losses": [statistics.fmean(column) for column in zip(*(r["losses"] for r in per_rank))],
        "simulation": simulation,
        "simulated_comm_s": None if simulation is None else simulation["exposed_communication_s"],
        "projected_step_s": None if simulation is None else median + simulation["exposed_communication_s"],
        "overlap_settings_off": first["overlap_settings_off"],
    }


def _merge_rounds(rounds: list[dict]) -> dict:
    """One mode's result over ``--rounds``: the timed steps of every round pooled, the median cold step, the peaks.

    This machine's speed drifts by tens of percent between one mode's minutes and the
    next mode's; rounds that alternate the modes spread each mode over the same stretch
    of time, so that the ratios between modes hold. Everything but the times and the
    memory peaks is the first round's.
    """
    if len(rounds) == 1:
        return rounds[0]
    steps = [step for result in rounds for step in result["step_times_s"]]
    median = statistics.median(steps)
    merged = {
        **rounds[0],
        "rounds": len(rounds),
        "cold_step_s": statistics.median(result["cold_step_s"] for result in rounds),
        "median_step_s": median,
        "min_step_s": min(steps),
        "step_times_s": steps,
        "peak_memory_mb": _largest_per_rank(result["peak_memory_mb"] for result in rounds),
        "step_peak_memory_mb": _largest_per_rank(result["step_peak_memory_mb"] for result in rounds),
    }
    if merged["simulated_comm_s"] is not None:
        merged["projected_step_s"] = median + merged["simulated_comm_s"]
    return merged


def _largest_per_rank(per_round: Iterable[list[float | None]]) -> list[float | None]:
    """Each rank's largest figure over the rounds; ``None`` where a round could not measure it."""
    return [None if None in column else max(column) for column in zip(*per_round)]


def _init_process_group(plan: Plan, rank: int) -> dist.Store | None:
    """Joins this mode's process group and returns its store; ``None`` for the modes that run alone."""
    if plan.device == "cuda":
        torch.cuda.set_device(0)
    if not MODES[plan.mode].distributed:
        return None
    if plan.fake:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        store = FakeStore()
        dist.init_process_group("fake", store=store, rank=0, world_size=plan.config.world_size)
    else:
        # An explicit store: under torchrun, a tcp:// init method would join the launcher's store instead.
        store = dist.TCPStore(plan.master_addr, plan.port, plan.config.world_size, is_master=rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=plan.config.world_size)
    return store


def _gather_to_rank0(result: dict, plan: Plan, store: dist.Store | None) -> list[dict] | None:
    """All ranks' results on rank 0 (``None`` elsewhere); under the fake group only rank 0 exists.

    Through the store rather than ``gather_object``, which needs numpy to unpickle.
    """
    if plan.fake or store is None:
        return [result]
    rank = dist.get_rank()
    store.set(f"result/{rank}", pickle.dumps(result))
    if rank != 0:
        return None
    return [pickle.loads(store.get(f"result/{r}")) for r in range(dist.get_world_size())]


def _mode_worker(index: int, plan: Plan, first_rank: int) -> None:
    """Entry point of one fresh process: one rank of one mode."""
    mallopt_applied = configure_cpu_allocator(plan.cpu_allocator)
    torch.set_num_threads(plan.threads)
    with tempfile.TemporaryDirectory(prefix="train_bench_inductor_") as cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # an empty cache: the cold step compiles from scratch
        rank = first_rank + index
        store = _init_process_group(plan, rank)
        joined = store is not None
        try:
            gathered = _gather_to_rank0(_run_rank(plan, rank), plan, store)
            if gathered is not None:
                Path(plan.result_path).write_text(json.dumps(_merge_ranks(plan, gathered, mallopt_applied)))
            if joined and not plan.fake:
                dist.barrier()  # gloo aborts a peer whose partner tears down mid-collective
        finally:
            if joined:
                dist.destroy_process_group()


# Launching -------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_WORLD_SIZE" in os.environ


def _processes(plan: Plan) -> int:
    return plan.config.world_size if MODES[plan.mode].distributed and not plan.fake else 1


def _run_mode_spawned(plan: Plan) -> dict:
    """Runs one mode in fresh processes of its own (peak RSS only grows within a process).

    The processes are forked from a server that has imported this script and nothing
    else (multiprocessing's forkserver, which preloads ``__main__``): each starts where a
    spawned process would be once it has imported the script, without paying the
    imports again (several seconds a process).
    """
    mp.start_processes(_mode_worker, args=(plan, 0), nprocs=_processes(plan), join=True, start_method="forkserver")
    return json.loads(Path(plan.result_path).read_text())


def _run_mode_torchrun(plan: Plan) -> dict | None:
    """Under torchrun: every rank starts its own fresh process for the mode; rank 0 returns the result.

    The torchrun processes only coordinate (a port per mode; rank 0 keeps the result file); the
    mode's processes form a new gloo group of their own.
    """
    rank = dist.get_rank()
    port = torch.tensor(_free_port() if rank == 0 else 0)
    dist.broadcast(port, src=0)
    plan = dataclasses.replace(plan, port=port.item())  # only rank 0's worker writes plan.result_path
    if MODES[plan.mode].distributed or rank == 0:
        mp.start_processes(_mode_worker, args=(plan, rank), nprocs=1, join=True, start_method="forkserver")
    dist.barrier()
    return json.loads(Path(plan.result_path).read_text()) if rank == 0 else None


# Report ----------------------------------------------------------------------------------------------------------


RATIO_FIELDS = ("cold_step_s", "median_step_s", "min_step_s", "peak_memory_mb", "step_peak_memory_mb")


def _scalar(result: dict, field: str) -> float | None:
    """A field as one number: memory lists become their largest rank."""
    value = result[field]
    if isinstance(value, list):
        value = None if None in value else max(value)
    return value


def _add_comparisons(results: dict[str, dict], fake: bool) -> None:
    """Adds the loss difference from the reference, the ratios to fsdp2_eager, and to the floor where it ran.

    A row run at another commit (``--against``) is compared with that commit's rows.
    """
    for name, result in results.items():
        mode, at = mode_of(name)
        reference = results.get("reference" + at)
        baseline = results.get(BASELINE_MODE + at)
        floor = results.get(FLOOR_MODE + at)
        if fake or reference is None or MODES[mode].one_rank_alone:
            result["max_loss_diff"] = None
        else:
            result["max_loss_diff"] = max(abs(a - b) for a, b in zip(result["losses"], reference["losses"]))
        result["ratios"] = _ratios(result, baseline)
        if floor is not None:
            result["ratios_to_floor"] = _ratios(result, floor)


def _ratios(result: dict, base: dict | None) -> dict[str, float | None]:
    """Each of ``RATIO_FIELDS`` over ``base``'s; ``None`` where ``base`` did not run or its figure is 0."""
    return {
        field: _ratio(_scalar(result, field), _scalar(base, field)) if base else None for field in RATIO_FIELDS
    }


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def _cell(value: float | None, ratio: float | None, digits: int) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" + (f" ({ratio:.2f}x)" if ratio is not None else "")


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def format_table(report: dict) -> str:
    """The printed summary: one row per mode, ratios to fsdp2_eager in parentheses, the median's to the floor beside."""
    with_floor = FLOOR_MODE in report["modes"]
    header = ["mode", "cold s", "median s", *(["vs floor"] if with_floor else []), "min s", "peak MB", "step MB"]
    header += ["params MB", "AG", "RS", "AR", "A2A"]
    header += ["graphs/breaks/recompiles", "max |dloss|"]
    compile_fields = ("unique_graphs", "graph_breaks", "recompiles")
    if report["process_group"] == "fake":
        header += ["sim comm s", "projected s"]
    rows = [header]
    for name, r in report["modes"].items():
        ratios = r["ratios"]
        compiled = r["compile"]
        row = [
            name,
            _cell(r["cold_step_s"], ratios["cold_step_s"], 3),
            _cell(r["median_step_s"], ratios["median_step_s"], 4),
            *([_times(r["ratios_to_floor"]["median_step_s"])] if with_floor else []),
            _cell(r["min_step_s"], ratios["min_step_s"], 4),
            _cell(_scalar(r, "peak_memory_mb"), ratios["peak_memory_mb"], 1),
            _cell(_scalar(r, "step_peak_memory_mb"), ratios["step_peak_memory_mb"], 1),
            f"{max(r['param_memory_mb']):.1f}",
            *(str(r["collectives"][kind]) for kind in COLLECTIVE_KINDS),
            "-" if compiled is None else "/".join(str(compiled[field]) for field in compile_fields),
            "n/a" if r["max_loss_diff"] is None else f"{r['max_loss_diff']:.1e}",
        ]
        if report["process_group"] == "fake":
            row += [_cell(r["simulated_comm_s"], None, 4), _cell(r["projected_step_s"], None, 4)]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(_aligned(row, widths)) for row in rows)


def _aligned(row: list[str], widths: list[int]) -> list[str]:
    """The mode name left-aligned, the figures right-aligned."""
    return [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]


def _describe(report: dict) -> str:
    c = report["config"]
    group = "fake process group" if report["process_group"] == "fake" else "gloo processes"
    return (
        f"train_bench config {c['name']}: Llama dim {c['dim']}, {c['n_layers']} layers, {c['n_heads']} heads, "
        f"ffn {c['ffn_hidden']}, vocab {c['vocab_size']} ({report['parameters'] / 1e6:.2f}M params), seq {c['seq']}, "
        f"batch {c['batch_per_rank']}/rank; W={report['world_size']} {group} on {report['device']}, "
        f"backend {report['backend']}, {report['threads_per_process']} thread(s)/process; "
        f"{c['warmup']} warm-up + {c['steps']} timed steps"
        + (f" in each of {report['rounds']} alternated rounds, pooled" if report["rounds"] > 1 else "")
        + f"; times: slowest rank; (x): ratio to {BASELINE_MODE}"
        + (f"; vs floor: median step over {FLOOR_MODE}'s" if FLOOR_MODE in report["modes"] else "")
        + ("" if report["reshard_after_forward"] else "; FSDP blocks not resharded after forward")
        + ("; bf16 parameters and compute, fp32 reductions (--mp bf16)" if report["mixed_precision"] == "bf16" else "")
    )


def _notes(report: dict) -> list[str]:
    notes = ["AG/RS/AR/A2A: all-gathers, reduce-scatters, all-reduces, all-to-alls per step"]
    if FLOOR_MODE in report["modes"]:
        notes.append(
            f"{FLOOR_MODE}: the unsharded model compiled, in the policy's parameter dtype, on one rank's batch "
            "with one rank's threads, alone; its loss (one rank's rows) is not compared"
        )
    if report["process_group"] == "fake":
        notes.append("losses not compared: the fake process group moves no data")
        notes.append(
            f"sim comm s: exposed communication that compile_shard.passes.simulate projects on the "
            f"{report['cost_profile']} profile for the compiled graphs (compile_shard modes only); "
            "projected s = median s + sim comm s"
        )
    no_overlap = report["modes"].get("cs_compiled_no_overlap")
    if no_overlap is not None:
        off = no_overlap["overlap_settings_off"]
        notes.append(
            f"cs_compiled_no_overlap switched off: {', '.join(off)}"
            if off
            else "cs_compiled_no_overlap: no overlap passes (settings.bucket, .reorder) in this checkout"
        )
    return notes


# Command line ----------------------------------------------------------------------------------------------------


def _uses_fake_group(args: argparse.Namespace) -> bool:
    """One process as rank 0 of a fake process group: ``--device cuda`` or ``--fake-world-size``."""
    return args.device == "cuda" or args.fake_world_size is not None


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="A")
    parser.add_argument(
        "--modes", help="comma-separated subset of: " + ", ".join(MODES) + " (default: all that can run)"
    )
    parser.add_argument("--world-size", type=_at_least(1), help="gloo processes per mode (default: the config's)")
    parser.add_argument("--layers", type=_at_least(1), help="transformer blocks (default: the config's)")
    parser.add_argument("--steps", type=_at_least(1), help="timed steps after warm-up (default: the config's)")
    parser.add_argument("--warmup", type=_at_least(0), help="untimed steps after the cold step (default: the config's)")
    parser.add_argument("--backend", choices=("inductor", "aot_eager"), default="inductor", help="for compiled modes")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU, fake process group")
    parser.add_argument("--fake-world-size", type=_at_least(1), help="run rank 0 of a fake process group of this size")
    parser.add_argument(
        "--cost-profile", default="h100_nvlink", help="fake process group: compile_shard.passes.cost_model profile"
    )
    parser.add_argument(
        "--no-reshard-after-forward",
        dest="reshard_after_forward",
        action="store_false",
        help="the FSDP modes' blocks keep their parameters gathered from forward to backward (default: resharded)",
    )
    parser.add_argument(
        "--mp",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: FSDP2's mixed precision (bf16 parameters and compute, fp32 reductions) in every mode",
    )
    parser.add_argument(
        "--cpu-allocator",
        choices=tuple(CPU_ALLOCATORS),
        default="fixed",
        help="CPU: how glibc serves tensors. fixed: the resident set follows live tensors, each large tensor "
        "page-faults; adaptive: glibc's default; caching: freed memory is reused, as a GPU's caching allocator "
        "reuses it (memory figures then include freed heap memory)",
    )
    parser.add_argument(
        "--rounds",
        type=_at_least(1),
        default=1,
        help="run the modes this many times, alternating them; each mode's steps pooled over the rounds (default 1)",
    )
    parser.add_argument("--json", type=Path, help="write the full report here")
    parser.add_argument(
        "--against",
        metavar="COMMIT",
        help="run each mode at COMMIT too, right after it runs here (rows '<mode> at COMMIT'; not under torchrun)",
    )
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    fake = _uses_fake_group(args)
    if args.modes is None:
        args.modes = ",".join(name for name, mode in MODES.items() if mode.runs_on_fake_group or not fake)
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    refused = [m for m in args.modes.split(",") if fake and not MODES[m].runs_on_fake_group]
    if refused:
        parser.error(
            f"{refused} cannot run on the fake process group (--device cuda or --fake-world-size): DDP's reducer "
            "reads its all-reduce's result, which the fake group does not produce; leave them out"
        )
    return args


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``, with an error that says so."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _bench_config(args: argparse.Namespace) -> BenchConfig:
    """The named configuration with the command line's overrides; ``world_size`` is the one that runs."""
    config = CONFIGS[args.config]
    if _uses_fake_group(args):
        world_size = args.fake_world_size or 8
    elif _under_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
        if args.world_size not in (None, world_size):
            raise SystemExit(f"--world-size {args.world_size} contradicts torchrun's WORLD_SIZE={world_size}")
    else:
        world_size = args.world_size or config.world_size
    overrides = {"n_layers": args.layers, "steps": args.steps, "warmup": args.warmup}
    return dataclasses.replace(
        config, world_size=world_size, **{name: value for name, value in overrides.items() if value is not None}
    )


def _threads(world_size: int, fake: bool) -> int:
    """Cores per process: the processes of a mode on one machine share its cores."""
    local_processes = 1 if fake else int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return max(1, (os.cpu_count() or 1) // local_processes)


def _parameter_count(config: LlamaConfig) -> int:
    with torch.device("meta"):  # sizes only: config B would otherwise allocate 400 MB here
        return sum(p.numel() for p in Llama(config).parameters())


def _report_header(args: argparse.Namespace, config: BenchConfig, fake: bool, threads: int) -> dict:
    llama = config.llama()
    return {
        "schema_version": SCHEMA_VERSION,
        "config": {**dataclasses.asdict(config), "ffn_hidden": llama.ffn_hidden, "vocab_size": llama.vocab_size},
        "parameters": _parameter_count(llama),
        "world_size": config.world_size,
        "process_group": "fake" if fake else "gloo",
        "device": args.device,
        "backend": args.backend,
        "cost_profile": args.cost_profile if fake else None,
        "reshard_after_forward": args.reshard_after_forward,
        "mixed_precision": args.mp,
        "cpu_allocator": args.cpu_allocator,
        "threads_per_process": threads,
        "rounds": args.rounds,
        "torch": torch.__version__,
        # False: every compiled mode inlines its blocks, cs_compiled as cs_compiled_inlined.
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
        "loss_reference": "n/a: the fake process group moves no data" if fake else "reference",
        "collective_kinds": list(COLLECTIVE_KINDS),
    }


def _run_modes(args: argparse.Namespace, config: BenchConfig, fake: bool, threads: int) -> dict[str, dict | None]:
    """Each selected mode in fresh processes, one after the other, ``--rounds`` times; results on the printing process."""
    torchrun = _under_torchrun()
    rounds: dict[str, list[dict | None]] = {}
    with tempfile.TemporaryDirectory(prefix="train_bench_") as scratch, checkout(args.against) as other:
        for name in args.modes.split(",") * args.rounds:
            plan = Plan(
                mode=name,
                config=config,
                fake=fake,
                device=args.device,
                backend=args.backend,
                cost_profile=args.cost_profile,
                threads=threads,
                master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                port=_free_port(),
                result_path=str(Path(scratch) / f"{name}.json"),
                reshard_after_forward=args.reshard_after_forward,
                param_dtype=torch.bfloat16 if args.mp == "bf16" else None,
                cpu_allocator=args.cpu_allocator,
            )
            start = time.perf_counter()
            result = _run_mode_torchrun(plan) if torchrun else _run_mode_spawned(plan)
            rounds.setdefault(name, []).append(result)
            if result is not None:
                print(f"train_bench: {name} done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
            if other is not None:
                against = _run_at(other, args, name, Path(scratch) / "against.json")
                rounds.setdefault(named(name, args.against), []).append(against)
    return {name: None if None in results else _merge_rounds(results) for name, results in rounds.items()}


def options_passed_on(argv: list[str]) -> list[str]:
    """The command line without what names this run's modes, output and other commit."""
    passed_on, skip = [], False
    for argument in argv:
        option = argument.split("=")[0]
        if skip or option in ("--modes", "--json", "--against", "--rounds"):
            skip = not skip and "=" not in argument
            continue
        passed_on.append(argument)
    return passed_on


def _run_at(tree: Path, args: argparse.Namespace, mode: str, path: Path) -> dict:
    """``mode``'s result from ``tree``'s checkout, run with this command line's other options."""
    command = [sys.executable, str(tree / "benchmarks" / "train_bench.py"), *options_passed_on(args.argv)]
    command += ["--modes", mode]
    command += ["--json", str(path)]
    finished = subprocess.run(command, capture_output=True, text=True, check=False, env=environment(tree))
    if finished.returncode != 0:
        raise RuntimeError(f"{mode} at {args.against} failed:\n{finished.stderr[-4000:]}")
    print(f"train_bench: {mode} at {args.against} done", file=sys.stderr, flush=True)
    return json.loads(path.read_text())["modes"][mode]


def _check_cost_profile(name: str) -> None:
    """Fails now, naming the known profiles, rather than in every compiled mode after its compilation."""
    from compile_shard.passes.cost_model import get_profile

    try:
        get_profile(name)
    except ValueError as error:
        raise SystemExit(f"--cost-profile: {error}") from None


def main(argv=None) -> dict | None:
    """Runs the benchmark; returns the report on the process that prints it (``None`` on other torchrun ranks)."""
    args = _parse_args(argv)
    fake = _uses_fake_group(args)
    if fake and _under_torchrun():
        raise SystemExit("the fake process group runs in one process: start it without torchrun")
    if args.against and _under_torchrun():
        raise SystemExit("--against runs the other commit's script itself: start it without torchrun")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if fake:
        _check_cost_profile(args.cost_profile)
    config = _bench_config(args)
    threads = _threads(config.world_size, fake)
    load_before = os.getloadavg()
    if not _under_torchrun():
        results = _run_modes(args, config, fake, threads)
    else:
        dist.init_process_group("gloo")
        try:
            results = _run_modes(args, config, fake, threads)
            if dist.get_rank() != 0:
                return None
        finally:
            dist.destroy_process_group()
    _add_comparisons(results, fake)
    report = {**_report_header(args, config, fake, threads), "modes": results}
    report["machine"]["load_average_1_5_15_min"] = {"before": load_before, "after": os.getloadavg()}
    print(_describe(report))
    print(format_table(report))
    print("\n".join(_notes(report)))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
