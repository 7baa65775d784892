"""Spawning gloo process groups and building the parity setups shared by tests."""

from __future__ import annotations

import copy
import datetime
import faulthandler
import gc
import multiprocessing
import multiprocessing.forkserver
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch._dynamo.utils import clear_compilation_metrics, counters
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

from compile_shard import FSDPModule, fully_shard
from compile_shard.debug import CollectiveCounter, recompiles
from compile_shard.models import Llama, LlamaConfig, tensor_parallel_plan

# [Note: ranks forked from a preloaded server]
# Each rank of a gloo test is a fresh process, so no rank sees another test's Dynamo
# caches, settings or process group. Spawned, each one imported torch, Inductor and
# compile_shard again: about 4 s of CPU per rank, most of the suite's time on two cores.
# A fork server imports them once per test process, and each rank is forked from it:
# still a process that has run no test (the server never runs one), without the
# imports. The server keeps the environment it started with: a test that needs another
# environment variable in its ranks sets it inside the rank function.
multiprocessing.set_forkserver_preload(
    ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "compile_shard", "dist_utils"]
)


def _entry(rank: int, world_size: int, port: int, stacks: str, fn, args, timeout: datetime.timedelta | None) -> None:
    # A rank killed by a signal (a crash in native code) writes every thread's Python
    # stack to stacks/rank<r>, which run_gloo shows, where the test would only say which
    # signal. Not to stderr: a test that passes on its rerun ([Note: gloo's aborts]) would
    # discard it with the rest of its captured output.
    faulthandler.enable(open(os.path.join(stacks, f"rank{rank}"), "w"), all_threads=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        fn(rank, world_size, *args)
        # Release what the test built (FSDP2 keeps collective work handles in reference
        # cycles) while the group is alive, and let no rank tear down its gloo pairs while
        # a peer still runs a collective.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The test passed. Leave without the interpreter's teardown: a gloo thread still
    # joinable at static destruction aborts the process ("terminate called without an
    # active exception"), seen now and then in CI after every assertion had passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start_fork_server_without_gpus() -> None:
    """Starts the fork server (once) with no GPU visible: the ranks are CPU processes.

    On a machine with a GPU, a rank forked from a server that has touched CUDA cannot
    initialize CUDA again, and Dynamo reads the CUDA RNG state whenever CUDA is
    available; without a visible GPU neither happens.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if visible is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible


# [Note: gloo's aborts]
# Torch 2.13's gloo now and then aborts a rank from C++ with no Python error before it:
# "terminate called without an active exception" at interpreter teardown (which the
# ranks skip with os._exit); in CI, once a rank of torch FSDP2's own run of
# examples/fsdp2_tutorial.py died of SIGABRT while gathering the full state dict, and
# once a rank of a test died of SIGABRT with "malloc(): unaligned tcache chunk
# detected" inside a compiled backward's wait for a gloo all-to-all. Neither reproduced:
# over 70 launches of the first; 65 runs of the second, two tests at a time, and one
# under valgrind's memcheck, which found no invalid read or write
# (docs/torch-2.13-findings.md). A test's own failure, raised in Python, ends its rank
# with exit code 1, not a signal. So a launch (tests/test_examples.py) or a run_gloo
# call in which a rank died of SIGABRT runs again, once, with a warning that says so
# and, from run_gloo, holds the rank's Python stacks: a failure that repeats still
# fails, and one that does not leaves its stacks in the test report's warnings.


def run_gloo(fn, world_size: int, *args, timeout: datetime.timedelta | None = None) -> None:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; re-raises failures.

    ``timeout``: the process group's (gloo's default, 30 minutes, if ``None``). A run in
    which a rank died of SIGABRT runs once more ([Note: gloo's aborts]).
    """
    try:
        _run_gloo_once(fn, world_size, args, timeout)
    except mp.ProcessExitedException as error:
        if error.signal_name != "SIGABRT":
            raise
        warnings.warn(
            f"{error}; ran again ([Note: gloo's aborts] in tests/dist_utils.py). Its stacks:\n{error.stacks}",
            stacklevel=2,
        )
        _run_gloo_once(fn, world_size, args, timeout)


def _run_gloo_once(fn, world_size: int, args: tuple, timeout: datetime.timedelta | None) -> None:
    """One run; a rank killed by a signal raises ``ProcessExitedException`` with its threads' ``stacks``."""
    _start_fork_server_without_gpus()
    # The launcher holds the ranks' rendezvous store, on a port the OS picks as it binds:
    # a free port picked first and bound later by rank 0 can be taken in between, by
    # another test's gloo connections (EADDRINUSE, seen in CI).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="compile_shard_stacks_") as stacks:
        try:
            mp.start_processes(
                _entry,
                args=(world_size, store.port, stacks, fn, args, timeout),
                nprocs=world_size,
                join=True,
                start_method="forkserver",
            )
        except mp.ProcessExitedException as error:
            written = Path(stacks, f"rank{error.error_index}")
            error.stacks = written.read_text() if written.exists() else "(none written)"
            print(f"rank {error.error_index}, {error.signal_name or error.exit_code}:\n{error.stacks}", file=sys.stderr)
            raise


class FakeProcessGroup:
    """Context manager: a single-process fake process group of any world size."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def __enter__(self):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.world_size)
        return self

    def __exit__(self, *exc):
        dist.destroy_process_group()


def tmp_path_for_workers() -> str:
    return tempfile.mkdtemp(prefix="compile_shard_test_")


def build_sharded_llama(config: LlamaConfig, *, seed: int = 0, block_reshard=None, root_reshard=None, shard=fully_shard):
    """Returns (sharded model, unsharded reference) initialized identically."""
    torch.manual_seed(seed)
    model = Llama(config)
    reference = copy.deepcopy(model)
    for block in model.layers:
        shard(block, reshard_after_forward=block_reshard)
    shard(model, reshard_after_forward=root_reshard)
    return model, reference


def copy_out_in_regions(model: torch.nn.Module) -> torch.nn.Module:
    """Leaves the copy-out of ``model``'s plain groups to their blocks' regions on gloo too.

    On gloo the runtime keeps the copy-out in the outer graph for the exchange in place
    ([Note: gloo exchange in place] in compile_shard.ops.transport); elsewhere a region
    copies out ([Note: a region copies out its block's parameters] in compile_shard._regions._call).
    This runs the second path on gloo, the only real process group these tests have;
    the cost model may still merge these small groups' collectives ([Note: a bucket of
    regions' groups] in passes.bucket).
    """
    for module in model.modules():
        if isinstance(module, FSDPModule) and (group := module._get_fsdp_state().group) is not None:
            group.copies_out_in_region = group.has_plain_copy_out
    return model


def build_tensor_parallel_llama(config: LlamaConfig, mesh, *, seed: int = 0, shard=fully_shard):
    """A Llama, its blocks tensor-parallel over ``mesh["tp"]`` (``tensor_parallel_plan``), sharded over ``mesh["dp"]``.

    ``mesh``: a mesh with dims named "dp" and "tp", or a dict of those two meshes.

    The embedding, shared with the output projection, and the norms stay plain.
    """
    torch.manual_seed(seed)
    model = Llama(config)
    for block in model.layers:
        parallelize_module(block, mesh["tp"], tensor_parallel_plan())
        shard(block, mesh=mesh["dp"])
    shard(model, mesh=mesh["dp"])
    return model


def counted_step(runnable, tokens: torch.Tensor) -> tuple[dict, dict]:
    """One forward and backward of ``lm_loss``; the collectives it ran, counts and bytes by kind."""
    with CollectiveCounter() as counter:
        lm_loss(runnable, tokens).backward()
    return dict(counter.counts), dict(counter.bytes)


def assert_gradients_match(model, theirs) -> None:
    """Placements, meshes and local gradients of ``model``'s parameters equal ``theirs``' (torch FSDP2's), bitwise."""
    for (name, param), other in zip(model.named_parameters(), theirs.parameters()):
        assert param.placements == other.placements and param.device_mesh == other.device_mesh, name
        assert param.grad.placements == other.grad.placements, name
        torch.testing.assert_close(param.grad.to_local(), other.grad.to_local(), rtol=0, atol=0, msg=name)


def step_optimizers_and_compare(optimizers, models, theirs) -> None:
    """``optimizer.step()`` and ``zero_grad()`` on each; then every model's parameters equal ``theirs``', bitwise."""
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()
    for model in models:
        for param, other in zip(model.parameters(), theirs.parameters()):
            torch.testing.assert_close(param.to_local(), other.to_local(), rtol=0, atol=0)


def train_against_torch_fsdp2(theirs, models, backends, tokens_for_step, steps: int = 3) -> None:
    """Trains torch FSDP2's ``theirs`` and compile_shard's ``models`` (each run by its backend, None: eagerly) alike.

    AdamW on the batches ``tokens_for_step(step)``; every step, eager runs issue torch
    FSDP2's collectives (counts and bytes), and every model's placements, gradients and
    parameters equal FSDP2's bitwise; compiled runs make one graph, no break and no
    recompile.
    """
    runs = [
        model if backend is None else torch.compile(model, backend=backend) for model, backend in zip(models, backends)
    ]
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in (theirs, *models)]
    clear_compilation_metrics()
    counters.clear()
    for step in range(steps):
        tokens = tokens_for_step(step)
        torch_collectives = counted_step(theirs, tokens)
        for model, run, backend in zip(models, runs, backends):
            collectives = counted_step(run, tokens)
            if backend is None:
                assert collectives == torch_collectives, (collectives, torch_collectives)
            assert_gradients_match(model, theirs)
        step_optimizers_and_compare(optimizers, models, theirs)
    if any(backends):
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"] and recompiles() == 0


def dcp_exchange_both_ways(ours, theirs, other_theirs, folder: str) -> None:
    """DCP: ``ours`` saves and ``theirs`` loads, then ``other_theirs`` saves and ``ours`` loads; every parameter exact.

    ``other_theirs`` is doubled first, so the second direction saves values neither
    model started from.
    """
    with torch.no_grad():
        for param in other_theirs.parameters():
            param.mul_(2)
    for saver, loader, name in ((ours, theirs, "ours"), (other_theirs, ours, "theirs")):
        path = os.path.join(folder, name)
        dcp.save(get_model_state_dict(saver), checkpoint_id=path)
        state_dict = get_model_state_dict(loader)
        dcp.load(state_dict, checkpoint_id=path)
        set_model_state_dict(loader, state_dict)
        expected = {param_name: param.full_tensor() for param_name, param in saver.named_parameters()}
        for param_name, param in loader.named_parameters():
            torch.testing.assert_close(param.full_tensor(), expected[param_name], rtol=0, atol=0, msg=param_name)


def global_batch(step: int, world_size: int, batch_per_rank: int, seq: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (world_size * batch_per_rank, seq + 1), generator=generator)


def lm_loss(model, tokens: torch.Tensor, *, symbolic_length: bool = False) -> torch.Tensor:
    """Next-token cross entropy; ``symbolic_length`` marks the length dynamic, as a recompile after it changed does."""
    inputs = tokens[:, :-1]
    if symbolic_length:
        torch._dynamo.mark_dynamic(inputs, 1)
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


class ReusedBlockModel(torch.nn.Module):
    """A nested model that calls one (sharded) block twice per forward."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(6, 10)
        self.block = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Tanh())
        self.out = torch.nn.Linear(10, 3)

    def forward(self, x):
        return self.out(self.block(self.block(self.inp(x))))
