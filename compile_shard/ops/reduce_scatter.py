"""The gradient reduction ops: ``reduce_scatter_grad`` (differentiable), its input and its gloo forms.

``reduce_scatter_input`` and ``reduce_scatter_input_into_`` build a group's reduction
input ([Note: one reduction input per group]); on gloo a reduce-scatter is an
all-to-all (``all_to_all_into_``, or ``all_to_all_grads_`` straight from the gradients,
[Note: gloo exchange in place] in ``compile_shard.ops.transport``) followed by
``sum_shards`` ([Note: gloo reduce-scatter] in ``compile_shard.ops.backend``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from .._layout import padded_rows
from .backend import reduces_by_all_to_all
from .checks import _check_same_dtype
from .library import autograd, define, kernel, meta
from .names import bound
from .transport import _Exchange, _padded_flat

all_to_all_grads_ = define(
    "all_to_all_grads_(Tensor(a!) received, Tensor[] unsharded_grads, SymInt world_size, str group_name) -> ()"
)
reduce_scatter_grad = define(
    "reduce_scatter_grad(Tensor unsharded_grad, SymInt world_size, str group_name, "
    "str reduce_op='avg', str? comm=None) -> Tensor"
)
reduce_scatter_with_comm = define(
    "reduce_scatter_with_comm(Tensor reduce_scatter_input, SymInt world_size, str group_name, str reduce_op, "
    "str comm) -> Tensor"
)
reduce_scatter_input = define(
    "reduce_scatter_input(Tensor[] unsharded_grads, SymInt world_size, ScalarType? dtype=None) -> Tensor"
)
reduce_scatter_input_into_ = define(
    "reduce_scatter_input_into_(Tensor(a!) output, Tensor[] unsharded_grads, SymInt world_size) -> ()"
)
all_to_all_into_ = define("all_to_all_into_(Tensor(a!) output, Tensor input, SymInt world_size, str group_name) -> ()")
sum_shards = define("sum_shards(Tensor received, SymInt world_size, str reduce_op='avg') -> Tensor")

_REDUCE_OPS = ("avg", "sum")


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


@kernel("reduce_scatter_grad")
def _reduce_scatter_grad_kernel(unsharded_grad, world_size, group_name, reduce_op="avg", comm=None):
    _check_reduce_op("reduce_scatter_grad", reduce_op)
    if world_size == 1:  # [Note: a group of one rank]: a sum or an average of one
        return unsharded_grad.reshape(-1).clone()
    funcol = torch.ops._c10d_functional
    if comm is not None:  # [Note: custom collectives] in compile_shard.ops.all_gather
        flat = unsharded_grad.reshape(-1)
        reduced = torch.ops.fsdp.reduce_scatter_with_comm(flat, world_size, group_name, reduce_op, comm)
        return funcol.wait_tensor(reduced)
    if reduces_by_all_to_all(group_name, unsharded_grad.device):
        split_sizes = [unsharded_grad.numel() // world_size] * world_size
        received = funcol.all_to_all_single(unsharded_grad.reshape(-1), split_sizes, split_sizes, group_name)
        return torch.ops.fsdp.sum_shards(funcol.wait_tensor(received), world_size, reduce_op)
    # FSDP2's own call: the backend averages ("avg", which GradientReduction picks for
    # fp32 and bf16), so no division runs after the collective.
    return funcol.wait_tensor(funcol.reduce_scatter_tensor(unsharded_grad, reduce_op, world_size, group_name))


@meta("reduce_scatter_grad")
def _reduce_scatter_grad_meta(unsharded_grad, world_size, group_name, reduce_op="avg", comm=None):
    _check_reduce_op("reduce_scatter_grad", reduce_op)
    _check_divisible("reduce_scatter_grad", unsharded_grad, world_size)
    return unsharded_grad.new_empty(unsharded_grad.numel() // world_size)


def _reduce_scatter_grad_setup_context(ctx, inputs, output):
    _, ctx.world_size, ctx.group_name, ctx.reduce_op = inputs[:4]


@autograd("reduce_scatter_grad", setup_context=_reduce_scatter_grad_setup_context)
def _reduce_scatter_grad_backward(ctx, sharded_grad_grad):
    gathered = torch.ops.fsdp.all_gather_into(
        [sharded_grad_grad], [sharded_grad_grad.numel()], ctx.world_size, ctx.group_name
    )
    if ctx.reduce_op == "avg":
        gathered = gathered / ctx.world_size
    return gathered, *[None] * (len(ctx.needs_input_grad) - 1)


@kernel("reduce_scatter_with_comm")
def _reduce_scatter_with_comm_kernel(reduce_scatter_input, world_size, group_name, reduce_op, comm):
    """The custom reduce-scatter's call, as FSDP2 makes it ([Note: custom collectives] in ops.all_gather)."""
    _check_reduce_op("reduce_scatter_with_comm", reduce_op)
    reduce_scatter = bound("reduce_scatter_with_comm", comm)
    numel, dtype, device = reduce_scatter_input.numel(), reduce_scatter_input.dtype, reduce_scatter_input.device
    comm_input = reduce_scatter.allocate((numel,), dtype=dtype, device=device)
    comm_input.copy_(reduce_scatter_input.view(-1))
    output = reduce_scatter.allocate((numel // world_size,), dtype=dtype, device=device)
    op = dist.ReduceOp.AVG if reduce_op == "avg" else dist.ReduceOp.SUM
    process_group = _resolve_process_group(group_name)
    work = reduce_scatter(output_tensor=output, input_tensor=comm_input, group=process_group, op=op)
    if work is not None:
        work.wait()
    return output


@meta("reduce_scatter_with_comm")
def _reduce_scatter_with_comm_meta(reduce_scatter_input, world_size, group_name, reduce_op, comm):
    _check_divisible("reduce_scatter_with_comm", reduce_scatter_input, world_size)
    return reduce_scatter_input.new_empty(reduce_scatter_input.numel() // world_size)


# reduce_scatter_input ----------------------------------------------------------------
# [Note: one reduction input per group]
# A group's reduction input is every unsharded gradient padded on dim 0 to a multiple
# of world_size and laid out rank-major, ``[rank 0: g0 g1 ..., rank 1: g0 g1 ...]``:
# the layout the all-gather's copy-out reads, and what FSDP2 builds with
# ``torch._chunk_cat``, casting to the reduction's dtype when it differs from the
# gradients' (``dtype``; [Note: mixed-precision reduction]). Autograd spells it as the backward of the copy-out's views
# (zero padding, ``view(world_size, -1)``, ``cat`` on dim 1); the ``lower`` pass
# replaces that with this op. Left as aten ops, Inductor fuses each gradient's piece
# into whichever kernel produced the gradient, differently in each block position
# (the norms' weight gradients, the attention backward, pairs of weight gradients),
# and compiles every variant: the sharded backward had many more distinct C++ kernels
# than the unsharded model's. As one opaque op per group, the gradient kernels no
# longer depend on the reduction (fewer distinct kernels and a shorter cold step,
# docs/benchmarks.md), and the copy is one ``_chunk_cat`` per group, the
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
    return world_size * sum(padded_rows(grad.size(0), world_size) * grad[0].numel() for grad in unsharded_grads)


@kernel("reduce_scatter_input")
def _reduce_scatter_input_kernel(unsharded_grads, world_size, dtype=None):
    _check_grads("reduce_scatter_input", unsharded_grads)
    if dtype is None or dtype == unsharded_grads[0].dtype:
        return torch._chunk_cat(unsharded_grads, 0, world_size).view(-1)
    output = unsharded_grads[0].new_empty(_reduce_scatter_input_numel(unsharded_grads, world_size), dtype=dtype)
    torch._chunk_cat(unsharded_grads, 0, world_size, out=output.view(world_size, -1))
    return output


@meta("reduce_scatter_input")
def _reduce_scatter_input_meta(unsharded_grads, world_size, dtype=None):
    _check_grads("reduce_scatter_input", unsharded_grads)
    return unsharded_grads[0].new_empty(_reduce_scatter_input_numel(unsharded_grads, world_size), dtype=dtype)


def _check_rank_major_output(op_name: str, output, unsharded_grads, world_size, *, casts: bool = False) -> None:
    """``output`` can hold ``reduce_scatter_input(unsharded_grads, world_size)``, in their dtype unless ``casts``."""
    _check_grads(op_name, unsharded_grads)
    numel = _reduce_scatter_input_numel(unsharded_grads, world_size)
    torch._check(
        output.dim() == 1 and output.numel() == numel and output.is_contiguous(),
        lambda: (
            f"fsdp::{op_name}: needs a contiguous 1-D output of {numel} elements, got shape {tuple(output.shape)}"
        ),
    )
    if not casts:
        _check_same_dtype(op_name, output, unsharded_grads[0])


@kernel("reduce_scatter_input_into_")
def _reduce_scatter_input_into_kernel(output, unsharded_grads, world_size):
    _check_rank_major_output("reduce_scatter_input_into_", output, unsharded_grads, world_size, casts=True)
    torch._chunk_cat(unsharded_grads, 0, world_size, out=output.view(world_size, -1))


@meta("reduce_scatter_input_into_")
def _reduce_scatter_input_into_meta(output, unsharded_grads, world_size):
    _check_rank_major_output("reduce_scatter_input_into_", output, unsharded_grads, world_size, casts=True)


# all_to_all_into_ --------------------------------------------------------------------
# An all-to-all of equal splits into a given output, asynchronous like
# all_gather_send_recv_: the gloo reduction's exchange in Inductor's planned buffers
# (gather_buffers). A functional all_to_all_single allocates its output for every
# call, whose pages fault on first write; a reused output's do not (timings in
# docs/benchmarks.md).


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


@kernel("all_to_all_into_")
def _all_to_all_into_kernel(output, input, world_size, group_name):
    _check_all_to_all_into(output, input, world_size)
    work = _resolve_process_group(group_name).alltoall_base(output, input, [], [])  # [] []: equal splits
    torch._C._distributed_c10d._register_work(output, work)


@meta("all_to_all_into_")
def _all_to_all_into_meta(output, input, world_size, group_name):
    _check_all_to_all_into(output, input, world_size)


# all_to_all_grads_ -------------------------------------------------------------------
# What an all-to-all of reduce_scatter_input(unsharded_grads) receives, sent straight from
# the gradients ([Note: gloo exchange in place]).


@kernel("all_to_all_grads_")
def _all_to_all_grads_kernel(received, unsharded_grads, world_size, group_name):
    _check_rank_major_output("all_to_all_grads_", received, unsharded_grads, world_size)
    transfers = _Exchange(group_name)
    slots = received.view(world_size, -1)
    offset = 0
    for grad in unsharded_grads:
        rows_per_rank = padded_rows(grad.size(0), world_size)
        padded_numel = rows_per_rank * grad[0].numel()
        chunks = [_padded_flat(rows, padded_numel) for rows in grad.split(max(rows_per_rank, 1))]
        chunks += [grad.new_zeros(padded_numel)] * (world_size - len(chunks))  # ranks past the last row
        transfers.exchange(chunks, slots[:, offset : offset + padded_numel])
        offset += padded_numel
    transfers.register(received)


@meta("all_to_all_grads_")
def _all_to_all_grads_meta(received, unsharded_grads, world_size, group_name):
    _check_rank_major_output("all_to_all_grads_", received, unsharded_grads, world_size)


# sum_shards --------------------------------------------------------------------------
# Adds the world_size equal shards of a flat buffer in rank order ([Note: gloo reduce-scatter]).


@kernel("sum_shards")
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


@meta("sum_shards")
def _sum_shards_meta(received, world_size, reduce_op="avg"):
    _check_reduce_op("sum_shards", reduce_op)
    _check_divisible("sum_shards", received, world_size)
    return received.new_empty(received.numel() // world_size)
