"""A sharded block's call during a trace: in its shared region, or inlined.

[Note: a region copies out its block's parameters]
Per parameter, the copy-out (a view of the all-gather output, split, cloned and
shaped) costs Dynamo traced calls and AOTAutograd and the passes nodes at every block,
and the region's arguments and gradients are one each per parameter. So where the
group's unshard is one all-gather per part and a plain copy-out
(``FSDPParamGroup.copies_out_in_region``: no all-gather extension, tensor parallelism,
other shard dimension, smaller reshard group or parameters kept after backward; not on
gloo, where ``passes.gather_buffers`` replaces the copy-in, all-gather and a copy-out in
the outer graph by one exchange into the parameters' rows, [Note: gloo exchange in place]
in ``compile_shard.ops.transport``, which a region's rank-major argument would undo), the
root's traced unshard all-gathers the block's group and leaves its outputs in the
group's ``traced_all_gather_outputs`` (``gather_traced``); the region takes those outputs
as its arguments and copies out inside its body (``_run_block``), once per body, with
one ``fsdp.copy_out`` per part (a fixed kernel: as generated clones, Inductor fused the
copy into every reader of a parameter), and leaves none of its copies in the slots. A
block that runs inlined copies out in the caller's graph first (``call_copied_out``),
except inside another operator's body (an activation checkpoint around the block),
where Dynamo refuses the write that shows the parameters: there it runs in a region
of its own, and the first block of each key calls its region too, traced before the
reads the later keys learn from it.

Backward must still gather again for resharded groups; [Note: region parameters are
saved as inputs] in ``compile_shard.passes.compile_regions`` explains how the partitioned
region keeps from saving the parameters.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
import torch.nn as nn

from . import _dynamo, _invoke_subgraph
from ._arguments import call_arguments, flat_arguments
from ._first_block import learn_from_first_block, record_body, record_first_block, runs_inlined, start_first_block
from ._key import claim_key, writes_so_far
from ._registry import registry


def _given_key(module: nn.Module, key: int, num_params: int, gathered: bool, layout: str, *flat: Any) -> int:
    """The region's ``reuse_hash_fn``: ``call_in_region`` computed the key (``claim_key``)."""
    return key


def _run_block(module: nn.Module, key: int, num_params: int, gathered: bool, layout: str, *flat: Any) -> Any:
    """The block's own forward, reading the unsharded parameters (the region's arguments) as its parameters.

    The caller had shown these same tensors; the region shows them again, as its own
    arguments, so that the body reads its parameters from its inputs and not from the
    caller's graph. That write happens inside the region: Dynamo allows writes there,
    also when the block runs inside an activation-checkpoint region, which refuses any
    write. ``gathered``: the arguments are the group's all-gather outputs, which the body
    copies out ([Note: a region copies out its block's parameters]).
    ``key`` is there for the reuse key only.
    """
    group = module._compile_shard_state.group
    if torch.compiler.is_compiling():
        record_body(key, flat)
    inputs, args, kwargs = call_arguments(num_params, layout, flat)
    unsharded_params = group.copy_out_in_region(list(inputs)) if gathered else inputs
    for fsdp_param, tensor in zip(group.fsdp_params, unsharded_params):
        fsdp_param.show_unsharded(tensor)
    with _ambient_autocast(unsharded_params[0].device.type):
        output = module._user_forward(*args, **kwargs)
    if gathered:  # the copies are the body's own: none may outlive it in the slots the caller reads
        for fsdp_param in group.fsdp_params:
            fsdp_param.show_sharded()
    return output


def _ambient_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """The caller's autocast, entered again inside the region.

    [Note: autocast inside a region]
    Autocast acts when AOTAutograd traces the ops, not in Dynamo's graph, so the body
    Dynamo traces for a block is the same with or without it, and Dynamo shares one
    body between equal bodies even where the reuse keys differ. A block called under
    autocast then ran another block's full-precision subgraph (measured on torch
    2.13: the output equal to the fp32 forward's). Entering the caller's autocast
    inside the body puts it in the graph, where it keeps the bodies apart and applies.
    """
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type))


_invoke_subgraph.install()


# torch caps the distinct keys of one function in a trace (8 by default) and raises past
# the cap, which is there to catch guards that fail at every call. A key here is what the
# block reads, which may differ from block to block (a ``scale`` per pair of layers read
# by its forward): each key that a second block uses traces a body of its own, as
# inlining traces each block.
_block_region = torch.compiler.nested_compile_region(
    _run_block, reuse_hash_fn=_given_key, max_reuse_entries=sys.maxsize
)


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOK_DICTS = tuple(f"_global{name}" for name in _HOOK_DICTS)


def _runs_hooks_inside(module: nn.Module) -> bool:
    """Whether calls inside ``module``'s forward run module hooks, which then runs inlined.

    A hook is Python a reused region would not replay (see [Note: a reused region
    replays no Python side effects] in ``_first_block``): one appending each block's
    output to a list would append the first block's only. Hooks on ``module`` itself run
    outside the region, around the wrapper that calls it.
    """
    hooks = nn.modules.module
    if any(getattr(hooks, name) for name in _GLOBAL_HOOK_DICTS):
        return True
    submodules = module._compile_shard_state.region_modules[1:]  # [0] is ``module``
    return any(getattr(sub, name) for sub in submodules for name in _HOOK_DICTS)


@torch.compiler.assume_constant_result
def runs_outside_regions(state: Any) -> bool:
    """Whether the block of ``state`` (its ``FSDPState``) runs inlined whatever its key: a ``dynamic=True``
    compile, hooks inside it, or a forward a region cannot replay.

    A ``dynamic=True`` trace's numbers (a norm's ``eps``) are symbolic from the first
    trace on, which a region body cannot take ([Note: region keys are guarded] in
    ``_key``), and Dynamo restarts such a trace to make a number static again, after its
    first block learned to run the blocks inlined: the second attempt takes another
    path, which Dynamo refuses. One call where three would each cost Dynamo a call, and
    on the state, which the trace holds already, where the module would cost it a
    variable. Read when each trace runs, like ``signature_hash``.
    """
    module = state.module
    return _dynamo.compiles_every_size_symbolic() or _runs_hooks_inside(module) or runs_inlined(module)


@torch.compiler.assume_constant_result
def enters_gathered_as_views(module: nn.Module) -> bool:
    """Whether ``module``'s unsharded parameters enter the traced frame as views of one tensor; then it runs inlined.

    The outermost sharded module gathers every group below it ([Note: traced unshard]);
    where a graph break splits its forward, that gather runs in the graph before the
    break, and the frame after it reads the unsharded parameters as its inputs: views
    of one all-gather output, which torch 2.13 refuses as region arguments
    ("Encountered aliasing during higher order op tracing"). Gathered inside the trace
    they are outputs of its own ops, and kept from an earlier graph
    (``set_reshard_after_backward(False)``) or by ``unshard()`` tensors of their own.
    Read when each trace runs: the objects' real attributes, which the trace's own
    gather does not set until its graph runs.
    """
    fsdp_params = module._compile_shard_state.group.fsdp_params
    if fsdp_params[0].unsharded_param is None:
        return False
    storages = {fsdp_param.unsharded_local().untyped_storage().data_ptr() for fsdp_param in fsdp_params}
    return len(storages) < len(fsdp_params)


def call_in_region(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Runs the sharded ``module``'s forward inside the shared region, during a trace.

    Or inlined: the first block of its key in this trace ([Note: the first block of
    each key runs inlined] in ``_first_block``), where one of its modules' numbers
    has become symbolic ([Note: region keys are guarded] in ``_key``), or where a region
    cannot take its arguments (``flat_arguments``).
    """
    group = module._compile_shard_state.group
    all_gather_outputs = group.traced_all_gather_outputs
    gathered = all_gather_outputs is not None
    # The region shows its arguments to the modules itself (``_run_block``), a
    # tensor-parallel parameter as a DTensor again: it takes the local tensors.
    inputs = all_gather_outputs if gathered else [fsdp_param.unsharded_local() for fsdp_param in group.fsdp_params]
    flat, layout, accepted = flat_arguments(inputs, args, kwargs)
    writes = writes_so_far()
    key, first = claim_key(module, writes, layout, flat) if accepted else (None, False)
    if key is None:
        return call_copied_out(module, args, kwargs) if gathered else module._user_forward(*args, **kwargs)
    if not first:
        return _block_region(module, key, len(inputs), gathered, layout, *flat)
    start = start_first_block()
    if gathered and _dynamo.traces_inside_another_op():
        output = _block_region(module, key, len(inputs), gathered, layout, *flat)
    else:
        if gathered:
            group.copy_out_traced(all_gather_outputs)
        output = module._user_forward(*args, **kwargs)
    if torch.compiler.is_compiling():  # not where a graph break in the forward resumed uncompiled
        items = output if isinstance(output, (tuple, list)) else (output,)
        returns_tensors_only = all(isinstance(item, torch.Tensor) for item in items)
        learn_from_first_block(module, start, writes_so_far() != writes, returns_tensors_only)
        # The key of a later block like this one reads what this forward read: claimed, not first either.
        learned, _ = claim_key(module, writes, layout, flat)
        if returns_tensors_only:
            record_first_block(start, learned, flat, tuple(items))
        else:
            record_first_block(start, None, (), ())
    return output


def compiling_gathered(group: Any) -> bool:
    """Whether a trace gathered ``group`` for its region and has not copied it out ([Note: a region copies out
    its block's parameters])."""
    return group is not None and group.shown_params[0] is None and group.traced_all_gather_outputs is not None


def _fresh_key(proxies: list) -> int:
    return registry.fresh_key()


def call_copied_out(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Runs inlined a block whose group was gathered for its region: copies out first.

    Inside another operator's body, where Dynamo refuses to show the parameters (a
    Python write), it runs in a region of its own instead, traced for this call (its
    key is fresh, never reused).
    """
    group = module._compile_shard_state.group
    all_gather_outputs = group.traced_all_gather_outputs
    if _dynamo.traces_inside_another_op():
        flat, layout, _ = flat_arguments(all_gather_outputs, args, kwargs)
        key = _dynamo.at_trace_time(_fresh_key, ())
        return _block_region(module, key, len(all_gather_outputs), True, layout, *flat)
    group.copy_out_traced(all_gather_outputs)
    return module._user_forward(*args, **kwargs)
