"""The choice of transport: ``_c10d_functional`` collectives, or on gloo the ``fsdp`` ops that avoid its copies."""

from __future__ import annotations

import torch
from torch.distributed.distributed_c10d import _resolve_process_group


def backend_name(group: torch.distributed.ProcessGroup, device: torch.device) -> str | None:
    """The name of ``group``'s backend for ``device`` ("gloo", "nccl", "fake", "threaded"), None where it has none.

    Read from the public ``get_backend_config`` ("cpu:gloo,cuda:nccl"): torch's
    threaded test process group (``MultiThreadedTestCase``) has no backend object to
    ask for a device, and answers there.
    """
    config = torch.distributed.get_backend_config(group)
    by_device = dict(entry.split(":", 1) for entry in config.split(",") if ":" in entry)
    return by_device.get(device.type)


def allocates_comm_tensors(group: torch.distributed.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group``'s backend allocates the collectives' buffers itself (NCCL with a memory allocator).

    gloo and the fake and threaded test groups do not: FSDP2 falls back to torch's
    allocator on them. Only the others are asked, through the backend object.
    """
    if backend_name(group, device) in (None, "gloo", "fake", "threaded"):
        return False
    backend = group._get_backend(device)
    # A backend without the method (older torch) allocates no tensors either.
    return getattr(backend, "supports_tensor_alloc", lambda device: False)(device)


def _on_gloo(group_name: str, device: torch.device) -> bool:
    """Whether ``group_name`` is a live group in this process whose backend for ``device`` is gloo.

    ``False`` for a group that is not live here, as in graphs built by hand.
    """
    if not torch.distributed.is_initialized():
        return False
    try:
        group = _resolve_process_group(group_name)
    except RuntimeError:  # a graph built by hand, or for another process: no live group to ask
        return False
    return backend_name(group, device) == "gloo"


def gathers_by_send_recv(group_name: str, device: torch.device) -> bool:
    """Whether the group all-gathers with ``fsdp::all_gather_send_recv_`` (gloo).

    [Note: gloo all-gather]
    gloo's ``all_gather_into_tensor`` gathers into a buffer of its own, allocated for
    every call, and copies that into the output (torch 2.13): even into a reused
    output, every call writes a whole unsharded group into fresh memory, whose pages
    fault on first write (a 50 MB gather faults its 12k pages), and copies it once
    more. ``fsdp::all_gather_send_recv_`` sends the input to every other rank,
    receives each rank's shard straight into its slot of ``output`` and copies its own:
    no buffer of gloo's, no page faults when ``output`` is reused (as Inductor's planned
    buffers are, see [Note: planned all-gather buffers]), so into a reused output it
    saves ``all_gather_into_tensor``'s allocation, page faults and second copy on every
    call (timings in docs/benchmarks.md).

    The op is asynchronous like a ``_c10d_functional`` collective: it registers its
    sends and receives as one work on ``output``, and ``_c10d_functional.wait_tensor(output)``
    waits for them, so the passes schedule it like the all-gather it replaces. Each
    call takes the group's next tag, in the same order on every rank, so gathers in
    flight together cannot take each other's messages. It fills ``output`` and returns
    nothing: Inductor lowers a mutating custom op as a fallback kernel only if it is
    auto-functionalizable, which an op returning an alias of its argument is not.
    """
    return _on_gloo(group_name, device)


def reduces_by_all_to_all(group_name: str, device: torch.device) -> bool:
    """Whether the group reduce-scatters gradients as an all-to-all and ``fsdp::sum_shards`` (gloo).

    ``False`` also for a group that is not live in this process, as in graphs built by
    hand: those keep ``reduce_scatter_tensor``.

    [Note: gloo reduce-scatter]
    gloo has no reduce-scatter of its own: ``reduce_scatter_tensor`` clones the whole
    unsharded gradient, all-reduces the clone and copies the local shard out of it
    (torch 2.13), so it moves twice a reduce-scatter's bytes and copies the gradient
    twice. On gloo the runtime and the ``lower`` pass reduce-scatter as an all-to-all
    instead: rank r receives every rank's r-th shard, (W-1)/W of the gradient like a
    real reduce-scatter, and ``fsdp::sum_shards`` adds them: half the bytes of
    ``reduce_scatter_tensor`` and none of its copies, which makes it faster than both
    ``reduce_scatter_tensor`` and an all-reduce (timings in docs/benchmarks.md).

    The sum is an op of its own, opaque to Inductor, on purpose: written as aten adds
    (which the partitioner places where the gradients are returned), Inductor fused
    every group's sum into one kernel at the end of the backward and kept every group's
    received buffer alive until then, so the step's peak held all of them. As an
    op it is never fused with another group's, ``reorder`` runs it right after its wait,
    and eager and compiled runs share its kernel, so their sums are bitwise equal.
    gloo's ring all-reduce (under torch FSDP2's reduce-scatter) adds in another order,
    which for W >= 3 can differ in the last bit.
    """
    return _on_gloo(group_name, device)


# The float8 dtypes: one byte each, which gloo's collectives do not take.
_FLOAT8 = {getattr(torch, name) for name in dir(torch) if name.startswith("float8_")}


def gathers_as_bytes(dtype: torch.dtype, group_name: str, device: torch.device) -> bool:
    """Whether a ``dtype`` all-gather travels as ``uint8`` views: float8 (torchao's float8 weights) on gloo.

    gloo's ``all_gather_into_tensor`` refuses float8 ("Invalid scalar type"); an
    all-gather moves bytes, so a view of the same bytes as ``uint8`` gathers the same
    values. The runtime's gloo all-gather sends and receives bytes already (``fsdp::
    all_gather_send_recv_``); this is for the graphs ``lower`` writes.
    """
    return dtype in _FLOAT8 and _on_gloo(group_name, device)
