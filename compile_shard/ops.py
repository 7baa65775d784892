"""The ``fsdp`` op library: every collective and storage operation of the runtime.

The runtime (eager and traced) calls these ops and nothing else for sharding, so
Dynamo records them by name and the pass suite (``compile_shard.passes``) can find,
rewrite and lower them. Each op has CPU, CUDA and Meta kernels; the differentiable
ones have autograd formulas, the mutating ones a Functionalize kernel that keeps
AOTAutograd's functional-graph check satisfied.

[Note: op signatures are rank independent]
No op takes a rank. A rank argument would make every rank's graph different; the
collectives take ``world_size`` and a process-group name instead, like
``_c10d_functional``. Padding is expressed as the per-parameter *padded* shard numel,
which is the same on every rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.library import Library

__all__ = [
    "all_gather_into",
    "all_gather_params_",
    "all_gather_send_recv_",
    "all_to_all_grads_",
    "all_to_all_into_",
    "reduce_scatter_grad",
    "reduce_scatter_input",
    "reduce_scatter_input_into_",
    "sum_shards",
    "set_",
    "resize_storage_",
]

_lib = Library("fsdp", "FRAGMENT")  # torch.distributed.fsdp owns other fsdp:: names

_lib.define(
    "all_gather_into(Tensor[] shards, SymInt[] padded_numels, SymInt world_size, "
    "str group_name) -> Tensor"
)
_lib.define(
    "all_gather_send_recv_(Tensor(a!) output, Tensor all_gather_input, SymInt world_size, "
    "str group_name) -> ()"
)
_lib.define(
    "all_gather_params_(Tensor(a!) unsharded_params, Tensor[] shards, SymInt[] padded_numels, "
    "SymInt world_size, str group_name) -> ()"
)
_lib.define(
    "all_to_all_grads_(Tensor(a!) received, Tensor[] unsharded_grads, SymInt world_size, str group_name) -> ()"
)
_lib.define(
    "reduce_scatter_grad(Tensor unsharded_grad, SymInt world_size, str group_name, "
    "str reduce_op='avg') -> Tensor"
)
_lib.define("reduce_scatter_input(Tensor[] unsharded_grads, SymInt world_size) -> Tensor")
_lib.define("reduce_scatter_input_into_(Tensor(a!) output, Tensor[] unsharded_grads, SymInt world_size) -> ()")
_lib.define("all_to_all_into_(Tensor(a!) output, Tensor input, SymInt world_size, str group_name) -> ()")
_lib.define("sum_shards(Tensor received, SymInt world_size, str reduce_op='avg') -> Tensor")
_lib.define("set_(Tensor(a!) tensor, Tensor source) -> ()")
# [Note: resize_storage_ schema]
# The schema carries no alias annotation on purpose. A storage resize has no
# functional equivalent, and AOTAutograd asserts a functional joint graph before any
# pass runs; an annotated mutation whose Functionalize kernel re-dispatches fails that
# assert. torch's own ``inductor::resize_storage_bytes_`` uses the same trick. The op
# is marked side-effectful below so dead-code elimination keeps it, and the passes
# remove every occurrence before lowering, so no alias analysis ever relies on it.
_lib.define("resize_storage_(Tensor tensor, SymInt nbytes) -> ()")
torch.fx.node.has_side_effect(torch.ops.fsdp.resize_storage_.default)

_BACKEND_KEYS = ("CPU", "CUDA")
_REDUCE_OPS = ("avg", "sum")


def _copy_in(shards: Sequence[torch.Tensor], padded_numels: Sequence[int]) -> torch.Tensor:
    """Flattens, pads and concatenates one rank's shards: the all-gather input."""
    return torch.cat(
        [F.pad(shard.reshape(-1), (0, numel - shard.numel())) for shard, numel in zip(shards, padded_numels)]
    )


def _check_shards(shards: Sequence[torch.Tensor], padded_numels: Sequence[int]) -> None:
    torch._check(len(shards) > 0, lambda: "fsdp::all_gather_into needs at least one shard")
    torch._check(
        len(shards) == len(padded_numels),
        lambda: f"fsdp::all_gather_into got {len(shards)} shards but {len(padded_numels)} padded numels",
    )
    dtypes = {shard.dtype for shard in shards}
    torch._check(len(dtypes) == 1, lambda: f"fsdp::all_gather_into needs one dtype, got {sorted(map(str, dtypes))}")


# all_gather_into ---------------------------------------------------------------------


def _all_gather_into_kernel(shards, padded_numels, world_size, group_name):
    _check_shards(shards, padded_numels)
    all_gather_input = _copy_in(shards, padded_numels)
    funcol = torch.ops._c10d_functional
    if gathers_by_send_recv(group_name, all_gather_input.device):
        all_gather_output = all_gather_input.new_empty(world_size * all_gather_input.numel())
        torch.ops.fsdp.all_gather_send_recv_(all_gather_output, all_gather_input, world_size, group_name)
    else:
        all_gather_output = funcol.all_gather_into_tensor(all_gather_input, world_size, group_name)
    return funcol.wait_tensor(all_gather_output)


def _all_gather_into_meta(shards, padded_numels, world_size, group_name):
    _check_shards(shards, padded_numels)
    return shards[0].new_empty(world_size * sum(padded_numels))


def _all_gather_into_setup_context(ctx, inputs, output):
    shards, padded_numels, world_size, group_name = inputs
    ctx.shard_shapes = [shard.shape for shard in shards]
    ctx.padded_numels = padded_numels
    ctx.world_size = world_size
    ctx.group_name = group_name


def _all_gather_into_backward(ctx, all_gather_output_grad):
    """The gradient of an all-gather is a reduce-scatter: FSDP's gradient reduction."""
    sharded_grad = torch.ops.fsdp.reduce_scatter_grad(
        all_gather_output_grad.contiguous(), ctx.world_size, ctx.group_name, "avg"
    )
    shard_grads = [
        padded_grad[: shape.numel()].view(shape)
        for padded_grad, shape in zip(sharded_grad.split(list(ctx.padded_numels)), ctx.shard_shapes)
    ]
    return shard_grads, None, None, None


# all_gather_send_recv_ ---------------------------------------------------------------


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
    return group._get_backend(device).name() == "gloo"


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
    buffers are, see [Note: planned all-gather buffers]). Measured with 2 gloo ranks on
    the 2-core CI machine, 6.3M floats per rank into a reused output: 21 ms against
    57 ms for ``all_gather_into_tensor``; with 3 ranks 43 against 127 ms.

    The op is asynchronous like a ``_c10d_functional`` collective: it registers its
    sends and receives as one work on ``output``, and ``_c10d_functional.wait_tensor(output)``
    waits for them, so the passes schedule it like the all-gather it replaces. Each
    call takes the group's next tag, in the same order on every rank, so gathers in
    flight together cannot take each other's messages. It fills ``output`` and returns
    nothing: Inductor lowers a mutating custom op as a fallback kernel only if it is
    auto-functionalizable, which an op returning an alias of its argument is not.
    """
    return _on_gloo(group_name, device)


_send_recv_tags: dict[str, itertools.count] = {}
_MAX_TAG = 1 << 30
# A work that runs a Python callable on wait (not in every torch: the op then waits itself).
_CALLBACK_WORK = getattr(torch._C._distributed_c10d, "PythonCallbackWork", None)


def _check_same_dtype(op_name: str, output: torch.Tensor, input: torch.Tensor) -> None:
    torch._check(
        output.dtype == input.dtype,
        lambda: f"fsdp::{op_name}: output is {output.dtype}, the input {input.dtype}",
    )


# A message per piece costs the calling thread about 0.1 ms on gloo over loopback
# (benchmarks: 20 exchanges of 64 floats took 3.3 to 3.7 ms, one of their concatenation
# 1.6 to 2.6 ms), the time of copying a few hundred KiB: smaller pieces share one.
_PACK_BELOW_BYTES = 256 * 2**10


def _waiter(works, unpacks):
    """``fn(timeout) -> bool`` for ``PythonCallbackWork``: waits for ``works``, then copies received packs out."""

    def wait(timeout=None) -> bool:
        if not all(work.wait() if timeout is None else work.wait(timeout) for work in works):
            return False
        while unpacks:
            packed, pieces = unpacks.pop()
            for piece, received in zip(pieces, packed.split([piece.numel() for piece in pieces])):
                piece.copy_(received.view_as(piece))
        return True

    return wait


class _Exchange:
    """Point-to-point transfers of one op call on a gloo group, waited for together through its output.

    Each message takes the group's next tag, in the same order on every rank, so
    transfers in flight together never take each other's messages.
    """

    def __init__(self, group_name: str):
        self.group_name = group_name
        self.group = _resolve_process_group(group_name)
        self.rank = self.group.rank()
        self.peers = [peer for peer in range(self.group.size()) if peer != self.rank]
        self.works = []
        self.unpacks = []
        self.small_sends = [[] for _ in range(self.group.size())]
        self.small_receives = [[] for _ in range(self.group.size())]

    def exchange(self, sends: Sequence[torch.Tensor], receives: Sequence[torch.Tensor]) -> None:
        """Sends ``sends[peer]`` to every peer and receives ``receives[peer]`` from it; copies this rank's own.

        Pieces under ``_PACK_BELOW_BYTES`` wait for ``register``, which sends them together.
        Every rank passes pieces of the same sizes, so all ranks agree on what is packed.
        """
        if sends[self.rank].numel() * sends[self.rank].element_size() < _PACK_BELOW_BYTES:
            for peer, (send, receive) in enumerate(zip(sends, receives)):
                self.small_sends[peer].append(send)
                self.small_receives[peer].append(receive)
            return
        self._post([[send] for send in sends], [[receive] for receive in receives])

    def _post(self, sends: Sequence[list[torch.Tensor]], receives: Sequence[list[torch.Tensor]]) -> None:
        """One message per peer; a peer's several pieces travel concatenated and are copied out on wait."""
        tag = next(_send_recv_tags.setdefault(self.group_name, itertools.count())) % _MAX_TAG
        for peer in self.peers:
            if len(receives[peer]) == 1:
                self.works.append(self.group.recv(receives[peer], peer, tag))
            else:
                packed = receives[peer][0].new_empty(sum(piece.numel() for piece in receives[peer]))
                self.works.append(self.group.recv([packed], peer, tag))
                self.unpacks.append((packed, receives[peer]))
        for peer in self.peers:
            pieces = sends[peer]
            self.works.append(self.group.send([pieces[0] if len(pieces) == 1 else torch.cat(pieces)], peer, tag))
        for send, receive in zip(sends[self.rank], receives[self.rank]):
            receive.copy_(send.view_as(receive))

    def register(self, output: torch.Tensor) -> None:
        """Sends the small pieces; ``_c10d_functional.wait_tensor(output)`` then waits for every transfer.

        Where ``PythonCallbackWork`` is missing, waits now instead.
        """
        if self.small_sends[self.rank]:
            self._post(self.small_sends, self.small_receives)
        wait = _waiter(self.works, self.unpacks)
        if _CALLBACK_WORK is None:
            wait()
        else:
            torch._C._distributed_c10d._register_work(output, _CALLBACK_WORK(wait))


def _all_gather_send_recv_kernel(output, all_gather_input, world_size, group_name):
    _check_send_recv(all_gather_input, world_size, output)
    transfers = _Exchange(group_name)
    transfers.exchange([all_gather_input] * world_size, output.view(world_size, -1))
    transfers.register(output)


def _check_send_recv(all_gather_input, world_size, output) -> None:
    torch._check(
        output.numel() == world_size * all_gather_input.numel()
        and output.is_contiguous()
        and all_gather_input.is_contiguous(),
        lambda: (
            f"fsdp::all_gather_send_recv_: needs a contiguous input and a contiguous output of world_size * "
            f"{all_gather_input.numel()} elements, got output shape {tuple(output.shape)}"
        ),
    )
    _check_same_dtype("all_gather_send_recv_", output, all_gather_input)


def _all_gather_send_recv_meta(output, all_gather_input, world_size, group_name):
    _check_send_recv(all_gather_input, world_size, output)


# all_gather_params_, all_to_all_grads_ ------------------------------------------------
# [Note: gloo exchange in place]
# On gloo, the compiled graphs move parameters and gradients where they lie. The
# general path copies a group's shards into one flat input (copy-in), gathers it
# rank-major, and copies every parameter's rows back out of the rank-major buffer
# (copy-out); a reduction copies the gradients rank-major (``reduce_scatter_input``)
# before its all-to-all. Each of those copies is a kernel of the compiled graph that
# moves the whole unsharded group on the cores the compute runs on, and a kernel
# Inductor compiles. Point-to-point transfers need no common layout: each message
# carries one parameter's shard from the sharded parameter into its rows of every
# peer's unsharded parameter (``all_gather_params_``), or one gradient's rows to the
# rank that owns them (``all_to_all_grads_``). Only this rank's own piece is copied,
# and a piece shorter than its padded size (dim 0 not divisible by the world size)
# is padded first, so that every receiver knows the size it receives. Pieces under
# ``_PACK_BELOW_BYTES`` (norm weights, biases) share one message per peer instead,
# concatenated on the way out and copied into place on the wait: a message costs more
# than copying them.
#
# ``all_gather_params_`` fills a group's unsharded parameters one after another, each
# ``[world_size * padded_numel]`` (its padded rows, rank by rank): the layout the
# ``copy_out`` pass's concatenation produces, whose readers it replaces
# (``gather_buffers``). ``all_to_all_grads_`` fills the rank-major buffer an all-to-all
# of the group's reduction input (``reduce_scatter_input``) would have received, which
# ``sum_shards`` adds. Both are asynchronous like ``all_gather_send_recv_``.


def _padded_flat(tensor: torch.Tensor, numel: int) -> torch.Tensor:
    """``tensor`` flattened and zero-padded to ``numel`` elements, contiguous; a view where it can be."""
    flat = tensor.reshape(-1)
    return flat if flat.numel() == numel else F.pad(flat, (0, numel - flat.numel()))


def _check_all_gather_params(unsharded_params, shards, padded_numels, world_size) -> None:
    _check_shards(shards, padded_numels)
    numel = world_size * sum(padded_numels)
    torch._check(
        unsharded_params.dim() == 1 and unsharded_params.numel() == numel and unsharded_params.is_contiguous(),
        lambda: (
            f"fsdp::all_gather_params_: needs a contiguous 1-D output of world_size * sum(padded_numels) = "
            f"{numel} elements, got shape {tuple(unsharded_params.shape)}"
        ),
    )
    for shard, padded_numel in zip(shards, padded_numels):
        torch._check(
            shard.numel() <= padded_numel,
            lambda: (
                f"fsdp::all_gather_params_: a shard of {shard.numel()} elements exceeds its padded numel "
                f"{padded_numel}"
            ),
        )
    _check_same_dtype("all_gather_params_", unsharded_params, shards[0])


def _all_gather_params_kernel(unsharded_params, shards, padded_numels, world_size, group_name):
    _check_all_gather_params(unsharded_params, shards, padded_numels, world_size)
    transfers = _Exchange(group_name)
    unsharded = unsharded_params.split([world_size * padded_numel for padded_numel in padded_numels])
    for shard, padded_numel, unsharded_param in zip(shards, padded_numels, unsharded):
        transfers.exchange([_padded_flat(shard, padded_numel)] * world_size, unsharded_param.view(world_size, -1))
    transfers.register(unsharded_params)


def _all_gather_params_meta(unsharded_params, shards, padded_numels, world_size, group_name):
    _check_all_gather_params(unsharded_params, shards, padded_numels, world_size)


def _all_to_all_grads_kernel(received, unsharded_grads, world_size, group_name):
    _check_rank_major_output("all_to_all_grads_", received, unsharded_grads, world_size)
    transfers = _Exchange(group_name)
    slots = received.view(world_size, -1)
    offset = 0
    for grad in unsharded_grads:
        padded_rows = -(-grad.size(0) // world_size)
        padded_numel = padded_rows * grad[0].numel()
        chunks = [_padded_flat(rows, padded_numel) for rows in grad.split(max(padded_rows, 1))]
        chunks += [grad.new_zeros(padded_numel)] * (world_size - len(chunks))  # ranks past the last row
        transfers.exchange(chunks, slots[:, offset : offset + padded_numel])
        offset += padded_numel
    transfers.register(received)


def _all_to_all_grads_meta(received, unsharded_grads, world_size, group_name):
    _check_rank_major_output("all_to_all_grads_", received, unsharded_grads, world_size)


# reduce_scatter_grad -----------------------------------------------------------------


def _check_reduce_op(op_name: str, reduce_op: str) -> None:
    torch._check(
        reduce_op in _REDUCE_OPS,
        lambda: f"fsdp::{op_name}: reduce_op must be one of {_REDUCE_OPS}, got {reduce_op!r}",
    )


def _check_divisible(op_name: str, tensor: torch.Tensor, world_size) -> None:
    torch._check(
        tensor.numel() % world_size == 0,
        lambda: f"fsdp::{op_name}: numel {tensor.numel()} is not divisible by world size {world_size}",
    )


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
    real reduce-scatter, and ``fsdp::sum_shards`` adds them. Measured with 2 gloo ranks
    on the 2-core CI machine: 3.0 ms against 10.0 ms (reduce-scatter) and 6.3 ms
    (all-reduce) for 0.8M floats, 66 against 155 and 70 ms for 12.6M floats.

    The sum is an op of its own, opaque to Inductor, on purpose: written as aten adds
    (which the partitioner places where the gradients are returned), Inductor fused
    every group's sum into one kernel at the end of the backward and kept every group's
    received buffer alive until then (config B: 589 instead of 304 MiB per step). As an
    op it is never fused with another group's, ``reorder`` runs it right after its wait,
    and eager and compiled runs share its kernel, so their sums are bitwise equal.
    gloo's ring all-reduce (under torch FSDP2's reduce-scatter) adds in another order,
    which for W >= 3 can differ in the last bit.
    """
    return _on_gloo(group_name, device)


def _reduce_scatter_grad_kernel(unsharded_grad, world_size, group_name, reduce_op="avg"):
    _check_reduce_op("reduce_scatter_grad", reduce_op)
    funcol = torch.ops._c10d_functional
    if reduces_by_all_to_all(group_name, unsharded_grad.device):
        split_sizes = [unsharded_grad.numel() // world_size] * world_size
        received = funcol.all_to_all_single(unsharded_grad.reshape(-1), split_sizes, split_sizes, group_name)
        return torch.ops.fsdp.sum_shards(funcol.wait_tensor(received), world_size, reduce_op)
    # Reduce with a sum and divide after: gloo has no AVG, and NCCL's pre/post-divide
    # choice belongs to the reduce-dtype work of mixed precision.
    sharded_grad = funcol.wait_tensor(funcol.reduce_scatter_tensor(unsharded_grad, "sum", world_size, group_name))
    if reduce_op == "avg":
        sharded_grad = sharded_grad.div_(world_size)
    return sharded_grad


def _reduce_scatter_grad_meta(unsharded_grad, world_size, group_name, reduce_op="avg"):
    _check_reduce_op("reduce_scatter_grad", reduce_op)
    _check_divisible("reduce_scatter_grad", unsharded_grad, world_size)
    return unsharded_grad.new_empty(unsharded_grad.numel() // world_size)


def _reduce_scatter_grad_setup_context(ctx, inputs, output):
    _, ctx.world_size, ctx.group_name, ctx.reduce_op = inputs


def _reduce_scatter_grad_backward(ctx, sharded_grad_grad):
    gathered = torch.ops.fsdp.all_gather_into(
        [sharded_grad_grad], [sharded_grad_grad.numel()], ctx.world_size, ctx.group_name
    )
    if ctx.reduce_op == "avg":
        gathered = gathered / ctx.world_size
    return gathered, None, None, None


# reduce_scatter_input ----------------------------------------------------------------
# [Note: one reduction input per group]
# A group's reduction input is every unsharded gradient padded on dim 0 to a multiple
# of world_size and laid out rank-major, ``[rank 0: g0 g1 ..., rank 1: g0 g1 ...]``:
# the layout the all-gather's copy-out reads, and what FSDP2 builds with
# ``torch._chunk_cat``. Autograd spells it as the backward of the copy-out's views
# (zero padding, ``view(world_size, -1)``, ``cat`` on dim 1); the ``lower`` pass
# replaces that with this op. Left as aten ops, Inductor fuses each gradient's piece
# into whichever kernel produced the gradient, differently in each block position
# (the norms' weight gradients, the attention backward, pairs of weight gradients),
# and compiles every variant: config B's backward had 20 distinct C++ kernels where
# the unsharded model's has 7. As one opaque op per group, the gradient kernels no
# longer depend on the reduction (17 distinct kernels; the cold step about 1.5 s
# shorter, docs/benchmarks.md), and the copy is one ``_chunk_cat`` per group, the
# kernel FSDP2 runs. ``gather_buffers`` turns it into ``reduce_scatter_input_into_`` on a
# buffer Inductor plans, for the reason in [Note: planned all-gather buffers].


def _check_grads(op_name: str, unsharded_grads: Sequence[torch.Tensor]) -> None:
    torch._check(len(unsharded_grads) > 0, lambda: f"fsdp::{op_name} needs at least one gradient")
    dtypes = {grad.dtype for grad in unsharded_grads}
    torch._check(len(dtypes) == 1, lambda: f"fsdp::{op_name} needs one dtype, got {sorted(map(str, dtypes))}")
    torch._check(
        all(grad.dim() > 0 for grad in unsharded_grads),
        lambda: f"fsdp::{op_name}: every gradient needs a dim 0 to split",
    )


def _reduce_scatter_input_numel(unsharded_grads: Sequence[torch.Tensor], world_size) -> int:
    padded_rows = [(grad.size(0) + world_size - 1) // world_size for grad in unsharded_grads]
    return world_size * sum(rows * grad[0].numel() for rows, grad in zip(padded_rows, unsharded_grads))


def _reduce_scatter_input_kernel(unsharded_grads, world_size):
    _check_grads("reduce_scatter_input", unsharded_grads)
    return torch._chunk_cat(unsharded_grads, 0, world_size).view(-1)


def _reduce_scatter_input_meta(unsharded_grads, world_size):
    _check_grads("reduce_scatter_input", unsharded_grads)
    return unsharded_grads[0].new_empty(_reduce_scatter_input_numel(unsharded_grads, world_size))


def _check_rank_major_output(op_name: str, output, unsharded_grads, world_size) -> None:
    """``output`` can hold ``reduce_scatter_input(unsharded_grads, world_size)``."""
    _check_grads(op_name, unsharded_grads)
    numel = _reduce_scatter_input_numel(unsharded_grads, world_size)
    torch._check(
        output.dim() == 1 and output.numel() == numel and output.is_contiguous(),
        lambda: (
            f"fsdp::{op_name}: needs a contiguous 1-D output of {numel} elements, got shape {tuple(output.shape)}"
        ),
    )
    _check_same_dtype(op_name, output, unsharded_grads[0])


def _reduce_scatter_input_into_kernel(output, unsharded_grads, world_size):
    _check_rank_major_output("reduce_scatter_input_into_", output, unsharded_grads, world_size)
    torch._chunk_cat(unsharded_grads, 0, world_size, out=output.view(world_size, -1))


def _reduce_scatter_input_into_meta(output, unsharded_grads, world_size):
    _check_rank_major_output("reduce_scatter_input_into_", output, unsharded_grads, world_size)


# all_to_all_into_ --------------------------------------------------------------------
# An all-to-all of equal splits into a given output, asynchronous like
# all_gather_send_recv_: the gloo reduction's exchange in Inductor's planned buffers
# (gather_buffers). A functional all_to_all_single allocates its output for every
# call: on the CI machine 59 ms for 12.6M floats against 18 ms into a reused output.


def _check_all_to_all_into(output, input, world_size) -> None:
    torch._check(
        output.shape == input.shape and output.is_contiguous() and input.is_contiguous(),
        lambda: (
            f"fsdp::all_to_all_into_: needs a contiguous input and output of one shape, got "
            f"{tuple(input.shape)} and {tuple(output.shape)}"
        ),
    )
    _check_same_dtype("all_to_all_into_", output, input)
    _check_divisible("all_to_all_into_", input, world_size)


def _all_to_all_into_kernel(output, input, world_size, group_name):
    _check_all_to_all_into(output, input, world_size)
    work = _resolve_process_group(group_name).alltoall_base(output, input, [], [])  # [] []: equal splits
    torch._C._distributed_c10d._register_work(output, work)


def _all_to_all_into_meta(output, input, world_size, group_name):
    _check_all_to_all_into(output, input, world_size)


# sum_shards --------------------------------------------------------------------------
# Adds the world_size equal shards of a flat buffer in rank order ([Note: gloo reduce-scatter]).


def _sum_shards_kernel(received, world_size, reduce_op="avg"):
    _check_reduce_op("sum_shards", reduce_op)
    _check_divisible("sum_shards", received, world_size)
    shards = received.view(world_size, -1)
    # The first sum allocates the result (no separate copy pass); ranks are added in order.
    sharded_grad = shards[0] + shards[1] if world_size > 1 else shards[0].clone()
    for rank in range(2, world_size):
        sharded_grad += shards[rank]
    if reduce_op == "avg":
        sharded_grad.div_(world_size)
    return sharded_grad


def _sum_shards_meta(received, world_size, reduce_op="avg"):
    _check_reduce_op("sum_shards", reduce_op)
    _check_divisible("sum_shards", received, world_size)
    return received.new_empty(received.numel() // world_size)


# set_ --------------------------------------------------------------------------------


def _set_kernel(tensor, source):
    with torch.no_grad():
        tensor.set_(source)


def _set_functionalize(tensor, source):
    # aten.set_ on functional tensors is one of the mutations AOTAutograd accepts on
    # graph inputs, so the op is expressed as exactly that.
    torch.ops.aten.set_.source_Tensor(tensor, source)


# resize_storage_ ---------------------------------------------------------------------


def _resize_storage_kernel(tensor, nbytes):
    storage = tensor.untyped_storage()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


def _resize_storage_meta(tensor, nbytes):
    return None


def _resize_storage_functionalize(tensor, nbytes):
    torch._sync(tensor)
    inner = torch._from_functional_tensor(tensor)
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)):
        torch.ops.fsdp.resize_storage_.default(inner, nbytes)


for _key in _BACKEND_KEYS:
    _lib.impl("all_gather_into", _all_gather_into_kernel, _key)
    _lib.impl("all_gather_params_", _all_gather_params_kernel, _key)
    _lib.impl("all_gather_send_recv_", _all_gather_send_recv_kernel, _key)
    _lib.impl("all_to_all_grads_", _all_to_all_grads_kernel, _key)
    _lib.impl("all_to_all_into_", _all_to_all_into_kernel, _key)
    _lib.impl("reduce_scatter_grad", _reduce_scatter_grad_kernel, _key)
    _lib.impl("reduce_scatter_input", _reduce_scatter_input_kernel, _key)
    _lib.impl("reduce_scatter_input_into_", _reduce_scatter_input_into_kernel, _key)
    _lib.impl("sum_shards", _sum_shards_kernel, _key)
    _lib.impl("set_", _set_kernel, _key)
    _lib.impl("resize_storage_", _resize_storage_kernel, _key)
_lib.impl("all_gather_into", _all_gather_into_meta, "Meta")
_lib.impl("all_gather_params_", _all_gather_params_meta, "Meta")
_lib.impl("all_gather_send_recv_", _all_gather_send_recv_meta, "Meta")
_lib.impl("all_to_all_grads_", _all_to_all_grads_meta, "Meta")
_lib.impl("all_to_all_into_", _all_to_all_into_meta, "Meta")
_lib.impl("reduce_scatter_grad", _reduce_scatter_grad_meta, "Meta")
_lib.impl("reduce_scatter_input", _reduce_scatter_input_meta, "Meta")
_lib.impl("reduce_scatter_input_into_", _reduce_scatter_input_into_meta, "Meta")
_lib.impl("sum_shards", _sum_shards_meta, "Meta")
_lib.impl("set_", _set_kernel, "Meta")
_lib.impl("resize_storage_", _resize_storage_meta, "Meta")
_lib.impl("set_", _set_functionalize, "Functionalize")
_lib.impl("resize_storage_", _resize_storage_functionalize, "Functionalize")

torch.library.register_autograd(
    "fsdp::all_gather_into", _all_gather_into_backward, setup_context=_all_gather_into_setup_context, lib=_lib
)
torch.library.register_autograd(
    "fsdp::reduce_scatter_grad",
    _reduce_scatter_grad_backward,
    setup_context=_reduce_scatter_grad_setup_context,
    lib=_lib,
)

all_gather_into = torch.ops.fsdp.all_gather_into.default
all_gather_params_ = torch.ops.fsdp.all_gather_params_.default
all_gather_send_recv_ = torch.ops.fsdp.all_gather_send_recv_.default
all_to_all_grads_ = torch.ops.fsdp.all_to_all_grads_.default
all_to_all_into_ = torch.ops.fsdp.all_to_all_into_.default
reduce_scatter_grad = torch.ops.fsdp.reduce_scatter_grad.default
reduce_scatter_input = torch.ops.fsdp.reduce_scatter_input.default
reduce_scatter_input_into_ = torch.ops.fsdp.reduce_scatter_input_into_.default
sum_shards = torch.ops.fsdp.sum_shards.default
set_ = torch.ops.fsdp.set_.default
resize_storage_ = torch.ops.fsdp.resize_storage_.default
