"""The all-gather ops: ``all_gather_into`` (a group's unshard, differentiable) and its gloo forms.

``all_gather_send_recv_`` is ``all_gather_into``'s all-gather on gloo
([Note: gloo all-gather] in ``compile_shard.ops.backend``); ``all_gather_params_``
replaces a group's copy-in, all-gather and copy-out in gloo's compiled graphs
([Note: gloo exchange in place] in ``compile_shard.ops.transport``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from .backend import gathers_by_send_recv
from .checks import _check_same_dtype
from .library import autograd, define, kernel, meta
from .names import bound
from .transport import _Exchange, _padded_flat

@dataclass(frozen=True)
class ReductionOptions:
    """The optional arguments both differentiable gathers take: how the gradient is reduced, mixed precision's
    casts, and the group's Python objects by name.

    The one list of them: the ops' schema (``schema``) and the arguments a call passes
    (``arguments``) are derived from these fields, in this order, with these defaults.
    A group builds one per all-gather part from its settings (``_group_config``), and the ops
    read them back (``of``).
    """

    reduce_op: str = field(default="avg", metadata={"schema": "str"})
    premul_factor: float = field(default=1.0, metadata={"schema": "float"})
    postdivide_factor: float = field(default=1.0, metadata={"schema": "float"})
    accumulated_grad: torch.Tensor | None = field(default=None, metadata={"schema": "Tensor?"})
    reduce_grads: bool = field(default=True, metadata={"schema": "bool"})
    param_dtype: torch.dtype | None = field(default=None, metadata={"schema": "ScalarType?"})
    reduce_dtype: torch.dtype | None = field(default=None, metadata={"schema": "ScalarType?"})
    replicate_group_name: str | None = field(default=None, metadata={"schema": "str?"})
    all_reduce_grads: bool = field(default=True, metadata={"schema": "bool"})
    partial_reduce_output: torch.Tensor | None = field(default=None, metadata={"schema": "Tensor?"})
    reduce_scatter_group_name: str | None = field(default=None, metadata={"schema": "str?"})
    all_reduce_hook: str | None = field(default=None, metadata={"schema": "str?"})
    all_gather_comm: str | None = field(default=None, metadata={"schema": "str?"})
    reduce_scatter_comm: str | None = field(default=None, metadata={"schema": "str?"})
    grad_dtypes: str | None = field(default=None, metadata={"schema": "str?"})

    @classmethod
    def schema(cls) -> str:
        """The fields as the ops' schema declares them: ``str reduce_op='avg', float premul_factor=1.0, ...``."""

        def default(value: Any) -> str:
            return "None" if value is None else repr(value) if isinstance(value, str) else str(value)

        return ", ".join(f"{f.metadata['schema']} {f.name}={default(f.default)}" for f in fields(cls))

    @classmethod
    def of(cls, arguments: Sequence[Any]) -> ReductionOptions:
        """The options a call passed positionally (a leading part of the fields)."""
        return cls(*arguments)

    def arguments(self) -> tuple:
        """The values to pass, positionally, trailing defaults left out: a graph shows what differs."""
        values, given = self.positional()
        return values[:given]

    def positional(self) -> tuple[tuple, int]:
        """Every field's value in order, and how many of them a call passes (the trailing defaults left out)."""
        values = tuple(getattr(self, f.name) for f in fields(self))
        given = len(values)
        while given and _is_default(values[given - 1], _DEFAULTS[given - 1]):
            given -= 1
        return values, given

    @staticmethod
    def with_accumulation(
        values: tuple,
        given: int,
        accumulated_grad: torch.Tensor | None,
        reduce_grads: bool,
        all_reduce_grads: bool,
        partial_reduce_output: torch.Tensor | None,
    ) -> tuple:
        """The arguments of one gathering: ``positional()``'s values with this step's accumulation in place.

        Gradient accumulation changes these four from step to step; the rest are the
        group's settings, which a trace reads as a constant. Plain tuple work, which
        costs Dynamo little in every group of every trace.
        """
        if partial_reduce_output is not None:
            given = max(given, _PARTIAL_REDUCE_OUTPUT + 1)
        elif not all_reduce_grads:
            given = max(given, _ALL_REDUCE_GRADS + 1)
        elif not reduce_grads:
            given = max(given, _REDUCE_GRADS + 1)
        elif accumulated_grad is not None:
            given = max(given, _ACCUMULATED_GRAD + 1)
        if given <= _ACCUMULATED_GRAD:
            return values[:given]
        values = (
            *values[:_ACCUMULATED_GRAD],
            accumulated_grad,
            reduce_grads,
            *values[_REDUCE_GRADS + 1 : _ALL_REDUCE_GRADS],
            all_reduce_grads,
            partial_reduce_output,
            *values[_PARTIAL_REDUCE_OUTPUT + 1 :],
        )
        return values[:given]


def _is_default(value: Any, default: Any) -> bool:
    return value is None if default is None else not isinstance(value, torch.Tensor) and value == default


_DEFAULTS = tuple(f.default for f in fields(ReductionOptions))
_INDEX = {f.name: index for index, f in enumerate(fields(ReductionOptions))}
_ACCUMULATED_GRAD, _REDUCE_GRADS = _INDEX["accumulated_grad"], _INDEX["reduce_grads"]
_ALL_REDUCE_GRADS, _PARTIAL_REDUCE_OUTPUT = _INDEX["all_reduce_grads"], _INDEX["partial_reduce_output"]
# ``with_accumulation`` writes each pair in one place.
assert _REDUCE_GRADS == _ACCUMULATED_GRAD + 1 and _PARTIAL_REDUCE_OUTPUT == _ALL_REDUCE_GRADS + 1


_REDUCTION_OPTIONS = ReductionOptions.schema()
all_gather_into = define(
    f"all_gather_into(Tensor[] shards, SymInt[] padded_numels, SymInt world_size, str group_name, "
    f"{_REDUCTION_OPTIONS}) -> Tensor"
)
as_gathered = define(
    f"as_gathered(Tensor[] unsharded, Tensor[] shards, SymInt[] padded_numels, SymInt world_size, str group_name, "
    f"{_REDUCTION_OPTIONS}) -> Tensor[]"
)
all_gather_send_recv_ = define(
    "all_gather_send_recv_(Tensor(a!) output, Tensor all_gather_input, SymInt world_size, "
    "str group_name) -> ()"
)
call_all_reduce_hook_ = define("call_all_reduce_hook_(Tensor(a!) reduced, str hook) -> ()")
all_gather_with_comm = define(
    "all_gather_with_comm(Tensor all_gather_input, SymInt world_size, str group_name, str comm) -> Tensor"
)
post_forward_chunk = define("post_forward_chunk(Tensor all_gather_output, SymInt size, SymInt rank) -> Tensor")
copy_out = define("copy_out(Tensor all_gather_output, SymInt world_size, SymInt[] padded_numels) -> Tensor[]")
copy_in = define("copy_in(Tensor[] shards, SymInt[] padded_numels, ScalarType? dtype=None) -> Tensor")
all_gather_params_ = define(
    "all_gather_params_(Tensor(a!) unsharded_params, Tensor[] shards, SymInt[] padded_numels, "
    "SymInt world_size, str group_name) -> ()"
)


def _check_shards(
    shards: Sequence[torch.Tensor],
    padded_numels: Sequence[int],
    param_dtype: torch.dtype | None = None,
    op_name: str = "all_gather_into",
) -> None:
    """Shards of one dtype, or of any with a ``param_dtype`` to cast them all to."""
    torch._check(len(shards) > 0, lambda: f"fsdp::{op_name} needs at least one shard")
    torch._check(
        len(shards) == len(padded_numels),
        lambda: f"fsdp::{op_name} got {len(shards)} shards but {len(padded_numels)} padded numels",
    )
    dtypes = {shard.dtype for shard in shards}
    torch._check(
        len(dtypes) == 1 or param_dtype is not None,
        lambda: f"fsdp::{op_name} needs one dtype or a param_dtype, got {sorted(map(str, dtypes))}",
    )


# copy_in -----------------------------------------------------------------------------
# [Note: the copy-in as one op]
# One rank's all-gather input: each shard flattened, cast to the all-gather's dtype
# (``dtype``; mixed precision's ``param_dtype``), zero-padded to its padded numel and
# concatenated (FSDP2's ``foreach_all_gather`` copy-in). The ``lower`` pass writes it as
# this op rather than as casts, pads and a ``cat``: left as aten ops, Inductor generated
# a C++ kernel per copy-in shape and position, fused with whatever kernel ran next to
# it (the root's embedding, the last op of an inlined block), several distinct
# kernels per step to compile for a copy that runs at memory speed either way
# (docs/benchmarks.md, "The cold step"). As one op it is one extern call per group, as
# ``fsdp.copy_out`` and ``fsdp.reduce_scatter_input`` are.


@kernel("copy_in")
def _copy_in_kernel(shards, padded_numels, dtype=None):
    _check_shards(shards, padded_numels, dtype, op_name="copy_in")
    output = shards[0].new_empty(sum(padded_numels), dtype=dtype or shards[0].dtype)
    for shard, padded in zip(shards, output.split(list(padded_numels))):
        numel = shard.numel()
        padded[:numel].copy_(shard.reshape(-1))
        padded[numel:].zero_()
    return output


@meta("copy_in")
def _copy_in_meta(shards, padded_numels, dtype=None):
    _check_shards(shards, padded_numels, dtype, op_name="copy_in")
    return shards[0].new_empty(sum(padded_numels), dtype=dtype or shards[0].dtype)


# all_gather_into ---------------------------------------------------------------------


@kernel("all_gather_into")
def _all_gather_into_kernel(shards, padded_numels, world_size, group_name, *options):
    options = ReductionOptions.of(options)
    _check_shards(shards, padded_numels, options.param_dtype)
    all_gather_input = _copy_in_kernel(shards, padded_numels, options.param_dtype)
    funcol = torch.ops._c10d_functional
    if options.all_gather_comm is not None:  # [Note: custom collectives]
        all_gather_output = torch.ops.fsdp.all_gather_with_comm(
            all_gather_input, world_size, group_name, options.all_gather_comm
        )
        return funcol.wait_tensor(all_gather_output)
    if world_size == 1:  # [Note: a group of one rank]
        return all_gather_input
    if gathers_by_send_recv(group_name, all_gather_input.device):
        all_gather_output = all_gather_input.new_empty(world_size * all_gather_input.numel())
        torch.ops.fsdp.all_gather_send_recv_(all_gather_output, all_gather_input, world_size, group_name)
    else:
        all_gather_output = funcol.all_gather_into_tensor(all_gather_input, world_size, group_name)
    return funcol.wait_tensor(all_gather_output)


@meta("all_gather_into")
def _all_gather_into_meta(shards, padded_numels, world_size, group_name, *options):
    param_dtype = ReductionOptions.of(options).param_dtype
    _check_shards(shards, padded_numels, param_dtype)
    return shards[0].new_empty(world_size * sum(padded_numels), dtype=param_dtype)


def _all_gather_into_setup_context(ctx, inputs, output):
    shards, padded_numels, world_size, group_name, *options = inputs
    ctx.shard_shapes = [shard.shape for shard in shards]
    ctx.padded_numels = padded_numels
    ctx.world_size = world_size
    ctx.group_name = group_name
    ctx.options = ReductionOptions.of(options)
    # torch 2.15's grad_dtype: the sharded gradients' dtypes, named (``grad_dtypes``), else the shards'.
    ctx.shard_dtypes = (
        [shard.dtype for shard in shards]
        if ctx.options.grad_dtypes is None
        else [getattr(torch, name) for name in ctx.options.grad_dtypes.split(",")]
    )


def _plus_once(ctx: Any, done: str, grad: torch.Tensor, addend: torch.Tensor | None) -> torch.Tensor:
    """``grad + addend`` in the first backward that runs for ``ctx``, ``grad`` in a later one (``done``, set
    on ``ctx``, says which) and where there is no ``addend``."""
    if addend is None or getattr(ctx, done, False):
        return grad
    setattr(ctx, done, True)
    return grad + addend


@autograd("all_gather_into", setup_context=_all_gather_into_setup_context)
def _all_gather_into_backward(ctx, all_gather_output_grad):
    """The gradient of an all-gather is a reduce-scatter: FSDP's gradient reduction.

    ``reduce_op``, ``premul_factor`` and ``postdivide_factor`` spell FSDP2's choice of
    reduce op and divide factors (``compile_shard._group_settings.GradientReduction``): the
    gradient is multiplied by ``premul_factor`` before the reduction (NCCL's
    ``PREMUL_SUM``) and divided by ``postdivide_factor`` after it.

    [Note: gradient accumulation without sync]
    With ``reduce_grads=False`` the backward reduces nothing: it adds the unsharded
    gradient into ``accumulated_grad`` (a buffer laid out like the all-gather output,
    owned by the group) and gives the shards no gradient. The next call with
    ``reduce_grads=True`` and that buffer as ``accumulated_grad`` adds it to its own
    gradient before the reduction, FSDP2's ``set_requires_gradient_sync(False)``.
    The buffer is a forward input that only the backward writes: AOTAutograd keeps
    such a write in the compiled backward graph.

    [Note: HSDP reduction]
    On HSDP's (replicate, shard) mesh the op gathers and reduce-scatters over the shard
    dimension's group, and ``replicate_group_name`` names the replicate dimension's: the
    reduce-scattered gradient is all-reduced over it with the same reduce op, FSDP2's
    order (an average over both when the divide factor is the data-parallel size, else
    sums between the pre-multiplication and the post-division). With
    ``all_reduce_grads=False`` (FSDP2's ``set_requires_all_reduce(False)``) the backward
    adds the reduce-scattered gradient into ``partial_reduce_output`` (a buffer the size
    of one rank's shards, owned by the group, written only here like
    ``accumulated_grad``) and gives the shards no gradient; the next backward that
    all-reduces adds that buffer to its reduce-scattered gradient first.

    [Note: mixed-precision reduction]
    FSDP2's ``MixedPrecisionPolicy``: the copy-in casts the shards to ``param_dtype``,
    so the all-gather output and its gradient are in ``param_dtype``. The backward
    casts that gradient to ``reduce_dtype`` (accumulating without sync in it too),
    reduces, and casts the sharded gradient back to the shards' dtype, in FSDP2's
    order. Casting up to ``reduce_dtype`` is exact, so casting before the rank-major
    layout (as here) or while building it (``reduce_scatter_input``'s ``dtype``, what
    ``lower`` emits) gives the same bits.
    """
    shard_grads = reduce_unsharded_grad(ctx, all_gather_output_grad.contiguous())
    # One None per other argument the call gave (the reduction's are optional).
    return shard_grads, *[None] * (len(ctx.needs_input_grad) - 1)


def reduce_unsharded_grad(ctx, unsharded_grad: torch.Tensor) -> list[torch.Tensor | None]:
    """The shards' gradients from the gradient of an all-gather output: the reduction the notes above describe.

    ``ctx`` holds what ``_all_gather_into_setup_context`` records.
    """
    options = ctx.options
    no_gradients = [None] * len(ctx.shard_shapes)
    if options.reduce_dtype is not None:
        unsharded_grad = unsharded_grad.to(options.reduce_dtype)
    if not options.reduce_grads:
        options.accumulated_grad.add_(unsharded_grad)
        return no_gradients
    # A backward that runs again (a backward per chunk of a loss) reduces its own gradient only:
    # what earlier steps accumulated is reduced once, by the first.
    unsharded_grad = _plus_once(ctx, "reduced_accumulated_grad", unsharded_grad, options.accumulated_grad)
    if options.premul_factor != 1.0:
        unsharded_grad = unsharded_grad * options.premul_factor
    # FSDP2's set_separate_reduce_scatter_group: another process group over the same ranks.
    group_name = options.reduce_scatter_group_name or ctx.group_name
    comm = () if options.reduce_scatter_comm is None else (options.reduce_scatter_comm,)  # [Note: custom collectives]
    sharded_grad = torch.ops.fsdp.reduce_scatter_grad(
        unsharded_grad, ctx.world_size, group_name, options.reduce_op, *comm
    )
    if options.replicate_group_name is not None:  # HSDP: [Note: HSDP reduction]
        if not options.all_reduce_grads:
            options.partial_reduce_output.add_(sharded_grad)
            return no_gradients
        sharded_grad = _plus_once(ctx, "reduced_partial_output", sharded_grad, options.partial_reduce_output)
        funcol = torch.ops._c10d_functional
        reduced = funcol.all_reduce(sharded_grad, options.reduce_op, options.replicate_group_name)
        sharded_grad = funcol.wait_tensor(reduced)
    if options.all_reduce_hook is not None:  # [Note: the all-reduce hook]
        torch.ops.fsdp.call_all_reduce_hook_(sharded_grad, options.all_reduce_hook)
    if options.postdivide_factor != 1.0:
        sharded_grad = sharded_grad / options.postdivide_factor
    if len(set(ctx.shard_dtypes)) == 1 and ctx.shard_dtypes[0] is not None:
        sharded_grad = sharded_grad.to(ctx.shard_dtypes[0])
    return [
        _shard_grad(padded_grad, shape, dtype)
        for padded_grad, shape, dtype in zip(
            sharded_grad.split(list(ctx.padded_numels)), ctx.shard_shapes, ctx.shard_dtypes
        )
    ]


def reduce_accumulated_grad(
    accumulated_grad: torch.Tensor,
    shards: Sequence[torch.Tensor],
    padded_numels: Sequence[int],
    world_size: int,
    group_name: str,
    options: ReductionOptions,
) -> list[torch.Tensor | None]:
    """The shards' gradients from a buffer of gradients accumulated without sync, reduced outside any backward.

    FSDP2's ``finalize_backward`` (torch 2.15) with sync turned back on: what ``all_gather_into``'s
    backward would reduce with ``accumulated_grad`` and no gradient of its own, in the same ops
    (``options``: the group's; the accumulation ones are ignored).
    """
    ctx = _ReductionContext(
        shard_shapes=[shard.shape for shard in shards],
        shard_dtypes=[shard.dtype for shard in shards],
        padded_numels=padded_numels,
        world_size=world_size,
        group_name=group_name,
        options=dataclasses.replace(options, accumulated_grad=None, reduce_grads=True),
    )
    return reduce_unsharded_grad(ctx, accumulated_grad)


@dataclass
class _ReductionContext:
    """What ``reduce_unsharded_grad`` reads of an autograd context, for a reduction outside autograd."""

    shard_shapes: list[torch.Size]
    shard_dtypes: list[torch.dtype]
    padded_numels: Sequence[int]
    world_size: int
    group_name: str
    options: ReductionOptions


def _shard_grad(padded_grad: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A shard's gradient from its padded part of the sharded gradient.

    Only the ops that change something: each call is an op AOTAutograd traces per
    parameter of every group (docs/benchmarks.md, "Capture time by depth").
    """
    if padded_grad.numel() != shape.numel():
        padded_grad = padded_grad[: shape.numel()]
    grad = padded_grad.view(shape)
    return grad if dtype is None or grad.dtype == dtype else grad.to(dtype)


# The all-reduce hook -----------------------------------------------------------------
# [Note: the all-reduce hook]
# FSDP2's set_all_reduce_hook: a Python callable on the reduced gradient (the
# reduce-scatter's output, after HSDP's all-reduce), in place, before the
# post-division. The group passes the hook's name as ``all_reduce_hook``, and the
# reduction calls ``fsdp::call_all_reduce_hook_(reduced, name)``, which AOTAutograd
# functionalizes and a compiled backward calls in every step ([Note: Python objects
# named in op arguments] in ``compile_shard.ops.names``).


@kernel("call_all_reduce_hook_")
def _call_all_reduce_hook_kernel(reduced, hook):
    bound("call_all_reduce_hook_", hook)(reduced)


@meta("call_all_reduce_hook_")
def _call_all_reduce_hook_meta(reduced, hook):
    return None


# Custom collectives ------------------------------------------------------------------
# [Note: custom collectives]
# FSDP2's set_custom_all_gather / set_custom_reduce_scatter: objects whose ``allocate``
# makes the collectives' buffers and whose call runs the collective, called as FSDP2
# calls them: the all-gather's input is this rank's slice of the output, and the
# reduce-scatter's input is allocated and copied into. The group passes their names as
# ``all_gather_comm`` and ``reduce_scatter_comm`` ([Note: Python objects named in op
# arguments] in ``compile_shard.ops.names``): ``all_gather_into`` then gathers with
# ``all_gather_with_comm``, and its backward's ``reduce_scatter_grad`` reduces with
# ``reduce_scatter_with_comm``. ``lower`` puts the same two ops in the compiled graphs
# in place of the c10d collectives, each followed by a ``wait_tensor``: the all-gather
# asks the comm for an asynchronous collective and registers its work for that wait
# (FSDP2 passes ``async_op``), so ``reorder`` overlaps it like any other; the
# reduce-scatter is called without ``async_op``, as FSDP2 calls it, so it is done
# when the op returns.


@kernel("all_gather_with_comm")
def _all_gather_with_comm_kernel(all_gather_input, world_size, group_name, comm):
    process_group, all_gather = _resolve_process_group(group_name), bound("all_gather_with_comm", comm)
    output = all_gather.allocate(
        (world_size * all_gather_input.numel(),), dtype=all_gather_input.dtype, device=all_gather_input.device
    )
    own_slice = output.view(world_size, -1)[process_group.rank()]
    own_slice.copy_(all_gather_input)
    work = all_gather(output_tensor=output, input_tensor=own_slice, group=process_group, async_op=True)
    if work is not None:
        torch._C._distributed_c10d._register_work(output, work)
    return output


@meta("all_gather_with_comm")
def _all_gather_with_comm_meta(all_gather_input, world_size, group_name, comm):
    return all_gather_input.new_empty(world_size * all_gather_input.numel())


# as_gathered -------------------------------------------------------------------------
# [Note: unsharded parameters gathered outside all_gather_into]
# Some unsharded parameters do not come out of ``all_gather_into``, yet their gradients
# must be reduced as its backward reduces them:
# - FSDP2's ``set_reshard_after_backward(False)`` keeps a group's unsharded parameters
#   after backward, and the next forward computes with them instead of all-gathering.
#   Their autograd node belongs to the forward that gathered them, whose backward has
#   run, with that forward's reduction options.
# - An all-gather extension ([Note: all-gather extensions] in compile_shard._extension)
#   gathers what ``fsdp_pre_all_gather`` made of the shard, not the shard, and its
#   ``fsdp_post_all_gather`` builds the unsharded parameter: FSDP2 gives that tensor's
#   gradient to the sharded parameter, straight through the two transforms.
# ``as_gathered(unsharded, shards, ...)`` returns copies of ``unsharded`` (detached, as
# rows) with a node of this forward, whose backward lays their gradients out as the
# all-gather output's and reduces them as ``all_gather_into``'s backward does
# (``reduce_unsharded_grad``), with the options of now, into ``shards``' gradients. The
# copies cost one memory copy of the parameters (an op cannot return its input), less
# than an all-gather. As a registered op it traces like ``all_gather_into``: the
# compiled backward holds the same reduction, which the passes lower. Eager mode calls
# ``as_gathered_views`` instead: an autograd function with the same backward that
# returns views, so no copy, and that takes tensor subclasses (torchao's float8
# weights), which an op's kernel cannot; a trace calls it for those too ([Note: an
# unsharded tensor subclass in a trace]).


def _check_as_gathered(unsharded, shards, padded_numels) -> None:
    _check_shards(shards, padded_numels)
    torch._check(
        len(unsharded) == len(shards),
        lambda: f"fsdp::as_gathered got {len(unsharded)} unsharded tensors but {len(shards)} shards",
    )


@kernel("as_gathered")
def _as_gathered_kernel(unsharded, shards, padded_numels, world_size, group_name, *options):
    _check_as_gathered(unsharded, shards, padded_numels)
    return [tensor.clone(memory_format=torch.contiguous_format) for tensor in unsharded]


@meta("as_gathered")
def _as_gathered_meta(unsharded, shards, padded_numels, world_size, group_name, *options):
    _check_as_gathered(unsharded, shards, padded_numels)
    return [torch.empty_like(tensor, memory_format=torch.contiguous_format) for tensor in unsharded]


def _as_gathered_setup_context(ctx, inputs, output):
    ctx.unsharded = [(tensor.shape, tensor.dtype, tensor.device) for tensor in inputs[0]]
    _all_gather_into_setup_context(ctx, inputs[1:], output)


@autograd("as_gathered", setup_context=_as_gathered_setup_context)
def _as_gathered_backward(ctx, unsharded_grads):
    unsharded_grads = [
        torch.zeros(shape, dtype=dtype, device=device) if grad is None else grad
        for grad, (shape, dtype, device) in zip(unsharded_grads, ctx.unsharded)
    ]
    unsharded_grad = torch.ops.fsdp.reduce_scatter_input(unsharded_grads, ctx.world_size)
    shard_grads = reduce_unsharded_grad(ctx, unsharded_grad)
    return [None] * len(unsharded_grads), shard_grads, *[None] * (len(ctx.needs_input_grad) - 2)


class _AsGatheredViews(torch.autograd.Function):
    """``as_gathered`` in eager mode: views, not copies, also of tensor subclasses, which an op's kernel cannot take."""

    @staticmethod
    def forward(ctx, layout, *unsharded_and_shards):
        count = len(unsharded_and_shards) // 2
        unsharded, shards = unsharded_and_shards[:count], unsharded_and_shards[count:]
        _as_gathered_setup_context(ctx, (unsharded, shards, *layout), None)
        return tuple(tensor.view_as(tensor) for tensor in unsharded)

    @staticmethod
    def backward(ctx, *unsharded_grads):
        _, shard_grads, *_ = _as_gathered_backward(ctx, list(unsharded_grads))
        return None, *[None] * len(unsharded_grads), *shard_grads


# [Note: an unsharded tensor subclass in a trace]
# An all-gather extension's ``fsdp_post_all_gather`` may return a tensor subclass
# (torchao's ``Float8TrainingTensor``), which an op's kernel cannot take, so a trace
# gives it the all-gather's backward with ``as_gathered_views`` too. Dynamo would trace
# that autograd function's backward with gradients of its outputs' type, a subclass,
# where the real gradient is a plain tensor (torchao's matmul computes the weight's
# gradient in high precision), and the reduction cannot take the subclass. Marked
# ``allow_in_graph``, the function is one node of Dynamo's graph that AOTAutograd
# traces with autograd itself: the backward receives the gradient the matmul's
# backward returns, and the reduction lands in the joint graph like
# ``all_gather_into``'s.


@torch._dynamo.allow_in_graph
def as_gathered_views(unsharded, shards, padded_numels, world_size, group_name, *options) -> tuple[torch.Tensor, ...]:
    """``as_gathered`` as views of ``unsharded``: eager mode, and tensor subclasses in a trace."""
    return _AsGatheredViews.apply((padded_numels, world_size, group_name, *options), *unsharded, *shards)


# post_forward_chunk ------------------------------------------------------------------
# A copy of chunk ``rank`` of ``size`` equal chunks of an all-gather output: what a rank
# keeps after forward when it reshards to a smaller group ([Note: resharding to a
# smaller group] in compile_shard._group_settings). An op of its own, not a slice and a clone:
# Inductor removes the clone, and the partitioner would then recompute the slice (a
# view) in backward from a gather over the whole group instead of saving it.


def _chunk_numel(all_gather_output, size, rank) -> int:
    """The numel of each of ``size`` equal chunks of ``all_gather_output``, once checked that it has a chunk ``rank``."""
    torch._check(
        all_gather_output.dim() == 1 and all_gather_output.numel() % size == 0 and 0 <= rank < size,
        lambda: (
            f"fsdp::post_forward_chunk: needs a 1-D output divisible into {size} chunks and a rank below {size}, got "
            f"shape {tuple(all_gather_output.shape)} and rank {rank}"
        ),
    )
    return all_gather_output.numel() // size


@kernel("post_forward_chunk")
def _post_forward_chunk_kernel(all_gather_output, size, rank):
    numel = _chunk_numel(all_gather_output, size, rank)
    return all_gather_output[rank * numel : (rank + 1) * numel].clone()


@meta("post_forward_chunk")
def _post_forward_chunk_meta(all_gather_output, size, rank):
    return all_gather_output.new_empty(_chunk_numel(all_gather_output, size, rank))


# copy_out ----------------------------------------------------------------------------
# Each parameter's columns of a rank-major all-gather output, contiguous: its padded rows,
# rank by rank (FSDP2's ``split_with_sizes_copy``). An op of its own where a region
# copies out ([Note: a region copies out its block's parameters] in compile_shard._regions._call):
# as a ``clone`` per parameter, Inductor fuses the copy into every kernel that reads the
# parameter, a kernel variant per reader (docs/benchmarks.md, "The cold step").


def _check_copy_out(all_gather_output, world_size, padded_numels) -> None:
    torch._check(
        all_gather_output.dim() == 1 and all_gather_output.numel() == world_size * sum(padded_numels),
        lambda: (
            f"fsdp::copy_out: needs a 1-D all-gather output of world_size * sum(padded_numels) = "
            f"{world_size * sum(padded_numels)} elements, got shape {tuple(all_gather_output.shape)}"
        ),
    )


@kernel("copy_out")
def _copy_out_kernel(all_gather_output, world_size, padded_numels):
    _check_copy_out(all_gather_output, world_size, padded_numels)
    outputs = [all_gather_output.new_empty(world_size * numel) for numel in padded_numels]
    torch.split_with_sizes_copy(  # one kernel for all columns on CUDA, as in FSDP2
        all_gather_output.view(world_size, -1),
        list(padded_numels),
        dim=1,
        out=[output.view(world_size, numel) for output, numel in zip(outputs, padded_numels)],
    )
    return outputs


@meta("copy_out")
def _copy_out_meta(all_gather_output, world_size, padded_numels):
    _check_copy_out(all_gather_output, world_size, padded_numels)
    return [all_gather_output.new_empty(world_size * numel) for numel in padded_numels]


def _copy_out_setup_context(ctx, inputs, output) -> None:
    all_gather_output, ctx.world_size, ctx.padded_numels = inputs
    ctx.dtype, ctx.device = all_gather_output.dtype, all_gather_output.device


@autograd("copy_out", setup_context=_copy_out_setup_context)
def _copy_out_backward(ctx, grads):
    """The gradients laid out rank-major again; a parameter without one gives zeros (``passes.unused_params``).

    As one ``fsdp.reduce_scatter_input``, the reduction input's own op ([Note: one
    reduction input per group] in ``compile_shard.ops.reduce_scatter``): this backward
    runs inside a region's backward, where the ``lower`` pass does not replace a ``cat``,
    and Inductor fused its pieces into the gradient kernels there (a kernel variant more
    than the unsharded model's; docs/benchmarks.md, "The cold step"). Each gradient is
    ``world_size`` chunks of its padded numel, so chunking it by rank lays it out as the
    copy-out read it.
    """
    flat = [
        torch.zeros(ctx.world_size * numel, dtype=ctx.dtype, device=ctx.device) if grad is None else grad
        for grad, numel in zip(grads, ctx.padded_numels)
    ]
    return torch.ops.fsdp.reduce_scatter_input.default(flat, ctx.world_size), None, None


# all_gather_send_recv_ ---------------------------------------------------------------


@kernel("all_gather_send_recv_")
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


@meta("all_gather_send_recv_")
def _all_gather_send_recv_meta(output, all_gather_input, world_size, group_name):
    _check_send_recv(all_gather_input, world_size, output)


# all_gather_params_ ------------------------------------------------------------------
# A group's copy-in, all-gather and copy-out as point-to-point transfers between the
# sharded and the unsharded parameters ([Note: gloo exchange in place]).


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


@kernel("all_gather_params_")
def _all_gather_params_kernel(unsharded_params, shards, padded_numels, world_size, group_name):
    _check_all_gather_params(unsharded_params, shards, padded_numels, world_size)
    transfers = _Exchange(group_name)
    unsharded = unsharded_params.split([world_size * padded_numel for padded_numel in padded_numels])
    for shard, padded_numel, unsharded_param in zip(shards, padded_numels, unsharded):
        transfers.exchange([_padded_flat(shard, padded_numel)] * world_size, unsharded_param.view(world_size, -1))
    transfers.register(unsharded_params)


@meta("all_gather_params_")
def _all_gather_params_meta(unsharded_params, shards, padded_numels, world_size, group_name):
    _check_all_gather_params(unsharded_params, shards, padded_numels, world_size)
