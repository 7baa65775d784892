"""Compiles a sharded block once for every block like it: a nested compile region whose
arguments are its group's all-gather outputs (or its unsharded parameters).

[Note: sharded blocks as nested compile regions]
``torch.compile`` of a whole model inlines every block, so Inductor lowers, schedules
and generates code for each of them although they are the same computation.
``torch.compiler.nested_compile_region`` traces a function once and stamps the same
subgraph out for later calls. A block cannot simply be marked: it reads its unsharded
parameters as attributes, and those are all-gather outputs inside the outer graph,
which a reused region cannot re-map from one block to the next (Dynamo: "Freevar has
no source"). So the block's forward wrapper passes the gathered tensors as region
arguments (its all-gather outputs where it can: [Note: a region copies out its block's
parameters]) and shows them to the block's modules inside the region
(``FSDPParam.show_unsharded``); the collectives stay in the outer graph, where the pass
suite schedules them.

Showing the tensors writes Python state, which turns off Dynamo's guard-based reuse,
so the region carries its own reuse key (``reuse_hash_fn``): the block's signature
(see ``block_signature``, read when the call is traced), its modules' plain
attributes that the body reads, read where Dynamo guards on them, autocast, and
the metadata of the call's arguments (symbolic sizes by their expressions: [Note:
symbolic sizes in a reuse key]). Blocks with equal keys share one compiled
subgraph, traced from the first of them. What a body reads outside the modules (a
global, a shared object) is a constant of that first trace: a write to it between
the blocks' calls keys the later blocks apart ([Note: writes between blocks key them
apart]), and a change between steps fails the guards and recompiles. A number
changed that way comes back symbolic (automatic dynamic), which torch 2.13 cannot
pass to a reused region body; the blocks then run inlined (a global:
``_symbolic_numbers``; a module attribute or an argument: below and
``accepts_region_call``).

[Note: region keys are guarded]
Dynamo guards on what the outer trace reads, and on nothing read inside
``reuse_hash_fn`` or an ``assume_constant_result`` function: a block's ``eval()``, or
``blocks[2].scale = 3.0``, after the first compile would not recompile, and block 2
would go on running block 0's subgraph. So ``call_in_region`` reads the plain
attributes of the block's modules that the body reads (a dropout's ``training``, a
norm's ``eps``, a user's ``scale``) in the outer trace, where each read is a guard on
its value, and passes their hash to the region; a change recompiles and the new trace
keys that block apart. Keying on every plain attribute would key apart blocks that
differ only in what no body reads (torchtitan's ``layer_id``, Hugging Face's
``layer_idx`` without a cache), each block traced anew. Which names the body reads is
learned from its trace (``_learn_reads``): each read is a guard whose source names the
attribute. The first block of each key runs inlined ([Note: the first block of each
key runs inlined]) and shows what the forward reads on its path; the names are kept
per signature. Which attributes to read is found per trace (``_plain_attributes``);
the key reads the block's count of the writes these reads miss too (an attribute added
or deleted, an object or a submodule replaced), [Note: a block's attribute writes are
counted] in ``_attribute_writes``.

A number that changed is not always a new constant: Dynamo recompiles with it as a
symbolic input (automatic dynamic; measured on torch 2.13 for a float attribute),
which a region body cannot take from its caller ("Freevar has no source"). That
block then runs inlined, like a call with a symbolic number as an argument
(``accepts_region_call``).

[Note: the first block of each key runs inlined]
In each trace, the first block of each reuse key runs its forward inlined, and only
the later ones with that key call the shared region (``_first_of_its_key``), so a
region body is traced only on a path an inlined block took before it. Three things
follow. What the inlined forward read tells the later blocks' keys what to read, so
one body is traced per key, and a body never reads what its key does not: a block
that reads other attributes on its path has another key, and runs inlined first. A
graph break in any block's forward happens where Dynamo can split the graph, as
without regions: inside a region torch 2.13 raises ``UncapturedHigherOrderOpError``
instead, and without nested graph breaks Dynamo resumes after the block's call, where
the next block is the first of the new trace. Blocks whose keys all differ (a
``scale`` per layer that the forward reads) all run inlined, as without regions. A
symbolic number the inlined block read would reach the later bodies from the caller's
graph, which torch 2.13 cannot take: those blocks run inlined
(``_learn_from_first_block``).

Past Dynamo the inlined block is one block's ops per key that Inductor lowers and
compiles apart from the body. Its backward is ordinary ops too: its weight gradients,
and so its reduce-scatter, come before the matmuls for its input gradient, which hide
that reduce-scatter, where a region returns both gradients together and leaves only
the root's backward to hide it, as in FSDP2's eager step (the simulated schedules are
in docs/benchmarks.md). Where nothing overlaps communication anyway (the ``cpu_gloo``
cost profile, by default) ``passes.reuse_first_blocks`` makes the block call the body
its later blocks call once Dynamo is done ([Note: the first block calls its region
after Dynamo]), from what ``_record_first_block`` and ``_record_body`` note while
Dynamo traces ([Note: what the trace records for reuse_first_blocks] in
``_annotation``).

[Note: a reused region replays no Python side effects]
A reused call stamps out the traced subgraph: it runs the tensor computation of the
block its body was traced from and none of its Python. A forward that writes state
outside the region (an auxiliary loss stored on its module, a global counter, a list
it appends to) would write it for one block only; torch 2.13 does not refuse such a region
when a ``reuse_hash_fn`` keys it (a global incremented in the body ran once for three
calls, measured). A region body is traced only after the first block of its key ran
inlined ([Note: the first block of each key runs inlined]), so that block shows
whether a region could replay the forward: where it wrote state it did not create
(``_writes_so_far()`` changed across its forward), returned anything but tensors
(which a subgraph cannot return), read a symbolic number, or wrote in place to a
tensor it did not create (a buffer; torch 2.13 refuses to train through a region
that does, ``_written_in_place``), its signature is added
to ``_INLINED_SIGNATURES``, a ``RegionInlinedWarning`` names the module and the
reason at the forward's first line, and every later block with that signature runs
inlined, its Python run for each block, as without regions. The later blocks of the
key take the same path, so they write nothing either.

[Note: writes between blocks key them apart]
A body reads state outside the block (a global, a shared dict) as a constant of the
first block's trace. A caller that changes it between the blocks' calls (``SCALE = i``
before calling block ``i``) would leave every later block with the first one's value.
So each call's reuse key holds ``_writes_so_far()``: what the trace has written until
then to objects that existed before it, other than compile_shard's own (the
``FSDPParam`` attributes that show the gathered parameters), and to the objects the
trace created and stored in those (a dict the forward creates, stores in a global and
changes before each block). Between two calls with no such write the keys stay equal;
after one they differ, and the later block is traced anew.

A block whose submodules run module hooks is inlined without tracing it first
(``runs_hooks_inside``): hooks are Python the signature holds by identity only.

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
group's last slot of ``shown_params`` (``gather_traced``); the region takes those outputs
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
import functools
import itertools
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch._dynamo.comptime import comptime
from torch._dynamo.symbolic_convert import InstructionTranslator
from torch._dynamo.variables.base import (
    AttributeMutationExisting,
    AttributeMutationNew,
    ValueMutationExisting,
    ValueMutationNew,
)
from torch._dynamo.variables.tensor import TensorVariable

from . import _invoke_subgraph
from ._annotation import InlinedFirstBlock, note_inlined_first_block, note_region_body
from ._attribute_writes import PLAIN
from ._param import FSDPParam
from ._classes import user_class
from ._versions import SYMBOLIC_NUMBERS_LOOK_PLAIN


def _plain_value(value: Any) -> Any:
    """``value`` itself if plain, containers item by item (a hook dict by its hooks), else its identity.

    A ``functools.partial`` by its function and arguments: ``checkpoint_wrapper`` gives
    each block its own ``partial(checkpoint, use_reentrant=False, ...)``, which calls
    the same function with the same arguments in every block.
    """
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, functools.partial):
        keywords = tuple((name, _plain_value(item)) for name, item in value.keywords.items())
        return ("partial", _plain_value(value.func), _plain_value(value.args), keywords)
    if isinstance(value, (tuple, list)):
        return tuple(_plain_value(item) for item in value)
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(repr(_plain_value(item)) for item in value))
    if isinstance(value, dict):
        return tuple(_plain_value(item) for item in value.values())
    return ("object", id(value))


# Left out of a block's signature: the tensors and submodules, which it lists itself,
# and the state-dict hooks, which no forward runs (``checkpoint_wrapper`` registers
# a bound method of each wrapper).
_NOT_SIGNED = frozenset(
    {
        "_parameters",
        "_buffers",
        "_modules",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    }
)


def block_signature(module: nn.Module) -> tuple:
    """What must be equal for two blocks to share one compiled region (``_signature_hash`` hashes it).

    Per submodule: its user class, its parameters' and buffers' names, shapes, dtypes
    and ``requires_grad``, its hooks, and its other attributes that are not plain
    values (containers item by item, objects by identity). Plain values (``training``,
    ``eps``, a ``layer_id``) are left out: ``call_in_region`` reads those the body's
    traces read, where Dynamo guards on them ([Note: region keys are guarded]).
    """
    signature = []
    for name, submodule in module.named_modules():
        cls = user_class(type(submodule))
        tensors = tuple(
            (kind, tensor_name, tuple(tensor.shape), tensor.dtype, tensor.requires_grad)
            for kind, tensors in (("param", submodule._parameters), ("buffer", submodule._buffers))
            for tensor_name, tensor in tensors.items()
            if tensor is not None
        )
        attributes = tuple(
            (key, _plain_value(value))
            for key, value in sorted(submodule.__dict__.items())
            if key not in _NOT_SIGNED and not key.startswith("_compile_shard") and not isinstance(value, PLAIN)
        )
        signature.append((name, cls.__module__, cls.__qualname__, tensors, attributes))
    return tuple(signature)


#: What ``_read_while_tracing`` found last, for ``_found_while_tracing`` to hand to the trace.
_found: Any = None


def _read_while_tracing(ctx: Any) -> None:
    """Run by Dynamo at trace time (``comptime``): the caller's ``read`` of the proxies of its ``values``."""
    global _found
    _found = ctx.get_local("read").as_python_constant()(ctx.get_local("values").as_proxy())


@torch.compiler.assume_constant_result
def _found_while_tracing() -> Any:
    return _found


def _read_at_trace_time(read: Callable[[list], Any], values: tuple) -> Any:
    """``read`` of the proxies Dynamo traces ``values`` as, a constant of the trace.

    [Note: symbolic sizes in a reuse key]
    After an input's size changed, Dynamo recompiles with it symbolic (automatic
    dynamic), and the blocks' activations have symbolic sizes. A reused subgraph is
    stamped out with the symbols and output sizes of the call it was traced from, so
    two calls share one only where their sizes are the same expressions: a block
    called on ``x`` and on ``x[:, ::2]`` needs two. Those expressions, and whether a
    size or a number is symbolic at all, cannot be read in the traced code (``str``
    or ``hash`` of a symbolic size guards on its value, and ``__class__`` answers
    ``SymInt`` on torch 2.13 and ``int`` on 2.14 and later), so ``comptime`` reads them
    from the proxies and fake tensors while Dynamo traces, and an
    ``assume_constant_result`` function hands them back to the trace. The tensors'
    other metadata come the same way, one read per call instead of a traced read per
    tensor and attribute.
    """
    comptime(_read_while_tracing)
    return _found_while_tracing()


def _fake(proxy: Any) -> Any:
    """The fake value a proxy stands for; a plain value stands for itself."""
    return proxy.node.meta["example_value"] if isinstance(proxy, fx.Proxy) else proxy


def _tensor_metadata(proxies: list) -> tuple:
    """Per leaf, a tensor's sizes and strides (expressions where symbolic), dtype, device and
    ``requires_grad``; None for anything else."""
    return tuple(
        (
            tuple(str(size) for size in fake.shape),
            tuple(str(stride) for stride in fake.stride()),
            fake.dtype,
            fake.device,
            fake.requires_grad,
        )
        if isinstance(fake, torch.Tensor)
        else None
        for fake in map(_fake, proxies)
    )


def _symbolic_values(proxies: list) -> tuple[bool, ...]:
    """Per plain value, whether Dynamo made it symbolic (a proxy, where a constant would be itself)."""
    return tuple(isinstance(proxy, fx.Proxy) for proxy in proxies)


def _flatten(values: list[Any]) -> tuple[str, list[Any]]:
    """``values`` as leaves, and a layout that rebuilds them: per value ``.`` (a leaf) or ``t``/``l`` and a count."""
    tokens, leaves = [], []
    for value in values:
        if isinstance(value, (tuple, list)):
            tokens.append(("t" if isinstance(value, tuple) else "l") + str(len(value)))
            leaves.extend(value)
        else:
            tokens.append(".")
            leaves.append(value)
    return ",".join(tokens), leaves


def _region_arguments_of(inputs: list[torch.Tensor], args: tuple, kwargs: dict) -> tuple[tuple, str]:
    """A region call's flat arguments (``inputs``, then the call's) and the layout that rebuilds the call's.

    See [Note: region arguments are flat]; ``_region_arguments`` takes them apart in the body.
    """
    names = tuple(sorted(kwargs))
    positional, arg_leaves = _flatten(list(args))
    named, value_leaves = _flatten([kwargs[name] for name in names])
    return (*inputs, *arg_leaves, *names, *value_leaves), f"{positional}|{named}"


def _unflatten(layout: str, leaves: tuple) -> tuple[list[Any], tuple]:
    """The values ``_flatten`` made ``layout`` and the first of ``leaves`` from, and the leaves left."""
    values, at = [], 0
    for token in layout.split(",") if layout else ():
        if token == ".":
            values.append(leaves[at])
            at += 1
        else:
            items = leaves[at : at + int(token[1:])]
            values.append(tuple(items) if token[0] == "t" else list(items))
            at += len(items)
    return values, leaves[at:]


def _region_arguments(num_params: int, layout: str, flat: tuple) -> tuple[tuple, list, dict]:
    """Splits a region call's flat arguments back into unsharded parameters, args and kwargs.

    [Note: region arguments are flat]
    Dynamo flattens a region call's arguments with a traced ``pytree.tree_flatten``
    unless every argument is already a leaf (a tensor, a module or a constant); that and
    tracing the block's signature inside the key (``_signature_hash`` computes it
    untraced) cost Dynamo time at every call site. So ``call_in_region`` passes
    the unsharded parameters, the args' leaves, the kwargs' names and then their
    values' leaves one by one, with the count of parameters and a layout string that
    rebuilds the args and kwargs (``_flatten``: a tuple or list of leaves, such as Hugging
    Face's ``position_embeddings``, is one level deep). The kwargs come sorted by name: a
    reused subgraph maps its tensor inputs by position, so blocks called with the same
    keywords in another order must line up. The key reads the leaves and the layout
    without rebuilding anything.
    """
    params = flat[:num_params]
    positional, named = layout.split("|")
    args, rest = _unflatten(positional, flat[num_params:])
    num_names = len(named.split(",")) if named else 0
    values, _ = _unflatten(named, rest[num_names:])
    return params, args, dict(zip(rest[:num_names], values))


@torch.compiler.assume_constant_result
def _signature_hash(module: nn.Module) -> int:
    """``hash(block_signature(module))``, computed by plain Python while Dynamo traces the call.

    Traced, the signature costs Dynamo time at each call site (see [Note: region
    arguments are flat]); computed here, it is read when each trace runs, so
    hooks and attributes set after ``fully_shard`` count. Dynamo does not guard on it:
    an attribute written after the first compile recompiles because ``call_in_region``
    reads the plain values and the count of the other writes ([Note: region keys are
    guarded]). A hook added after the first compile is not seen, as Dynamo does not
    guard on hooks by default (``skip_nnmodule_hook_guards``), with or without regions.
    """
    return hash(block_signature(module))


def _block_key(module: nn.Module, writes: int, layout: str, flat: tuple) -> int | None:
    """Traced by Dynamo for every call; equal keys reuse one subgraph. None where a number read is symbolic.

    ``writes``: ``_writes_so_far()`` before the block's call. The plain attributes
    are read here, in the outer trace: each read is a guard on the value ([Note:
    region keys are guarded]).
    """
    state = module._compile_shard_state
    tensor_keys = _read_at_trace_time(_tensor_metadata, flat)
    # The plain leaves themselves: their values, read here, are guarded.
    plain_leaves = tuple(leaf if key is None else None for leaf, key in zip(flat, tensor_keys))
    places, numbers = _plain_attributes(module)
    modules = state.region_modules
    values = tuple(getattr(modules[at], name) for at, name in places)
    if SYMBOLIC_NUMBERS_LOOK_PLAIN:
        if any(_read_at_trace_time(_symbolic_values, values)):
            return None
    elif any(values[at].__class__ is not int and values[at].__class__ is not float for at in numbers):
        return None
    device_type = tensor_keys[0][3].type  # an unsharded parameter's
    return hash(
        (
            _signature_hash(module),
            values,
            state.region_writes,
            writes,
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
            layout,
            tensor_keys,
            plain_leaves,
        )
    )


def _given_key(module: nn.Module, key: int, num_params: int, gathered: bool, layout: str, *flat: Any) -> int:
    """The region's ``reuse_hash_fn``: ``call_in_region`` computed the key (``_block_key``)."""
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
        _read_at_trace_time(_record_body, (key, *flat))
    inputs, args, kwargs = _region_arguments(num_params, layout, flat)
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


class RegionInlinedWarning(UserWarning):
    """A sharded block runs inlined instead of in a shared compile region.

    See [Note: a reused region replays no Python side effects].
    """


#: ``_signature_hash`` of the blocks whose forward a shared region cannot replay.
_INLINED_SIGNATURES: set[int] = set()


def _subgraph_tracer() -> Any:
    """The tracer of the graph Dynamo is tracing now (a region body's, a checkpoint's, or the frame's)."""
    return InstructionTranslator.current_tx().output.current_tracer


def _user_forward_line(module: nn.Module) -> tuple[str, int]:
    """Where the user's forward of a sharded block starts ([Note: the classes of a sharded module])."""
    code = user_class(type(module)).forward.__code__
    return code.co_filename, code.co_firstlineno


# [Note: a restarted trace learns again]
# Dynamo may trace a frame again from its start (torch 2.14 and later do, to make a
# float that changed a tensor: ``_tensorify_python_scalars``), replaying the first
# attempt's decisions, and it refuses a second attempt that takes another path
# (``SpeculationLogDivergence``). What a trace learns about blocks
# (``_INLINED_SIGNATURES``, ``_READ_NAMES``) sets the path of the traces after it,
# so a restarted attempt must not see what the attempt before it learned: each
# learning records how to undo it, and the first read of the next attempt of the
# same compile undoes them. Another compile keeps what the last attempt learned.
_attempt_learning: list = [None, []]  # [(compile id, attempt) the undos belong to, undo functions]


def _current_attempt() -> tuple | None:
    trace_id = torch._guards.CompileContext.current_trace_id()
    return None if trace_id is None else (trace_id.compile_id, trace_id.attempt)


def _forget_failed_attempts() -> None:
    """Undoes what an earlier attempt of this compile learned (see the note above)."""
    attempt = _current_attempt()
    learned_in, undos = _attempt_learning
    if learned_in is not None and attempt is not None and learned_in[0] == attempt[0] and learned_in[1] != attempt[1]:
        for undo in reversed(undos):
            undo()
    if learned_in != attempt:
        _attempt_learning[:] = [attempt, []]


def _learned(undo: Any) -> None:
    _forget_failed_attempts()
    _attempt_learning[1].append(undo)


def _inline_blocks_like(module: nn.Module, reason: str, filename: str, lineno: int) -> None:
    """From now on blocks with ``module``'s signature run inlined; warned at the user's line, not Dynamo's."""
    signature = _signature_hash(module)
    if signature not in _INLINED_SIGNATURES:
        _INLINED_SIGNATURES.add(signature)
        _learned(lambda: _INLINED_SIGNATURES.discard(signature))
    warnings.warn_explicit(
        f"compile_regions: the forward of {module._compile_shard_state.group.settings.module_name} {reason}; blocks like "
        f"it run inlined",
        RegionInlinedWarning,
        filename,
        lineno,
    )


#: Per ``_signature_hash``: the names of the plain attributes the key reads, those its bodies' traces read.
_READ_NAMES: dict[int, frozenset[str]] = {}


def _guarded_names(guards: Any) -> set[str]:
    """Every attribute name and string key on the way to what ``guards`` check."""
    names = set()
    for guard in guards:
        source = guard.originating_source
        while source is not None:
            for name in (getattr(source, "member", None), getattr(source, "index", None)):
                if isinstance(name, str):
                    names.add(name)
            source = getattr(source, "base", None)
    return names


def _learn_reads(module: nn.Module) -> None:
    """Adds the plain attributes read so far to what the keys of blocks like ``module`` read.

    See [Note: region keys are guarded]. A body's read of a module's plain attribute is
    a guard on it, so the guards' sources name every attribute the body read, and more
    (the caller's reads): keying on those too only keys apart blocks that could share.
    """
    plain = {
        name
        for submodule in module._compile_shard_state.region_modules
        for name, value in submodule.__dict__.items()
        if isinstance(value, PLAIN)
    }
    signature = _signature_hash(module)
    guarded = _guarded_names(InstructionTranslator.current_tx().output.guards)
    before = _READ_NAMES.get(signature)
    _READ_NAMES[signature] = (before or frozenset()) | (plain & guarded)
    _learned(lambda: _READ_NAMES.pop(signature, None) if before is None else _READ_NAMES.update({signature: before}))


#: The trace (Dynamo's output graph, which is not hashable) and the keys whose first block it has run.
_traced_keys: tuple[weakref.ref | None, set[int]] = (None, set())


@torch.compiler.assume_constant_result
def _first_of_its_key(key: int) -> bool:
    """Whether this trace has not run a block with this key yet; from now on it has."""
    global _traced_keys
    output = InstructionTranslator.current_tx().output
    trace, seen = _traced_keys
    if trace is None or trace() is not output:
        _traced_keys = trace, seen = weakref.ref(output), set()
    if key in seen:
        return False
    seen.add(key)
    return True


def _symbolic_numbers(tracer: Any) -> dict[Any, str]:
    """The nodes of ``tracer``'s graph that hold a number Dynamo made symbolic, each with the number's name.

    A number that changed between steps comes back symbolic (automatic dynamic), as a
    0-d tensor input of the root graph and the ``item()`` that reads it; a nested
    tracer lifts either as an input of its own. torch 2.13 cannot pass such a number
    to a reused region body: lifting the root's input fails to reuse the body
    ("Argument 'item' ... does not belong to this Graph"), lifting its ``item()``
    fails the trace ("Freevar has no source"), measured for a global float.
    """
    if tracer.parent is None:
        numbers = {}
        for node in tracer.graph.find_nodes(op="placeholder"):
            graph_arg = node.meta.get("grapharg")
            if graph_arg is not None and graph_arg.pass_arg_as_tensor:
                source = graph_arg.source  # the global's name, not Dynamo's G['__import_<module>'].<name>
                numbers[node] = getattr(source, "member", None) or getattr(source, "global_name", None) or source.name
    else:
        outer = _symbolic_numbers(tracer.parent)
        lifted = tracer.lifted_freevars.items()
        numbers = {inner.node: outer[proxy.node] for proxy, inner in lifted if proxy.node in outer}
    for node, name in list(numbers.items()):
        numbers.update({user: name for user in node.users if user.op == "call_method" and user.target == "item"})
    return numbers


#: Per ``_start_first_block``: the graph, its last node then, and every tensor's version.
_block_starts: dict[int, tuple[fx.Graph, fx.Node, dict[fx.Node, int]]] = {}
_start_numbers = itertools.count()


def _nodes_after(node: fx.Node) -> Iterator[fx.Node]:
    """The nodes appended after ``node``: a block's, where ``node`` was the graph's last before it.

    Dynamo appends a trace's nodes at the end and inserts the inputs it lifts among
    the placeholders at the start, so these are the block's own nodes, its inputs not included.
    """
    node = node.next
    while node.op != "root":
        yield node
        node = node.next


@torch.compiler.assume_constant_result
def _start_first_block() -> int:
    """Notes the graph being traced before a first block's forward, for ``_learn_from_first_block``."""
    graph = _subgraph_tracer().graph
    # An entry of another graph belongs to a forward that a graph break ended before
    # ``_learn_from_first_block``: the trace went on in a new graph.
    for stale in [number for number, (other, _, _) in _block_starts.items() if other is not graph]:
        del _block_starts[stale]
    versions = {node: value._version for node, value in _example_tensors(graph)}
    start = next(_start_numbers)
    _block_starts[start] = (graph, graph._root.prev, versions)  # the sentinel itself for an empty graph
    return start


def _example_tensors(graph: fx.Graph) -> Iterator[tuple[fx.Node, torch.Tensor]]:
    for node in graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            yield node, value


def _written_in_place(module: nn.Module, graph: fx.Graph, versions: dict[fx.Node, int]) -> str | None:
    """What ``module``'s forward wrote in place that it did not create: its buffer by name, or "an input"; else None.

    Dynamo runs each op on its fake example values, so an in-place op bumps the
    version of the fake tensor it writes (and of its view's base). An input the
    forward lifted into the graph (a buffer it read first) starts at version 0.
    """
    buffers = {id(buffer): name for name, buffer in module.named_buffers()}
    for node, value in _example_tensors(graph):
        before = versions.get(node, 0 if node.op == "placeholder" else None)
        if before is not None and value._version != before:
            real = getattr(node.meta.get("grapharg"), "example", None)
            return f"its buffer `{buffers[id(real)]}`" if id(real) in buffers else "an input"
    return None


@torch.compiler.assume_constant_result
def _learn_from_first_block(module: nn.Module, start: int, wrote: bool, returns_tensors_only: bool) -> int:
    """After the inlined first block of its key: what later keys read, and whether a region can replay its forward.

    It cannot ([Note: a reused region replays no Python side effects]) where the forward
    wrote state it did not create (``wrote``), returned anything but tensors, or read a
    symbolic number (a node made since ``start`` reads one), which would reach the
    later blocks' region bodies from the caller's graph, which torch 2.13 cannot take
    ([Note: region keys are guarded]); nor where it wrote in place to a tensor it did
    not create (a buffer it updates, batch norm's running statistics), which torch
    2.13 refuses to train through a region. Blocks like it then run inlined.
    """
    _learn_reads(module)
    tracer = _subgraph_tracer()
    _, last_before, versions = _block_starts[start]
    numbers = _symbolic_numbers(tracer)
    symbolic = (numbers[arg] for node in _nodes_after(last_before) for arg in node.all_input_nodes if arg in numbers)
    name = next(symbolic, None)
    if name is not None:
        reason = (
            f"reads {name}, a number Dynamo made symbolic after it changed, which torch 2.13 cannot pass to a "
            f"shared compile region; pass it to the block as a tensor to keep the region"
        )
    elif wrote:
        reason = (
            "writes state it did not create (an attribute of an existing object, a global, a container), which "
            "a shared compile region would write for the first such block only"
        )
    elif (written := _written_in_place(module, tracer.graph, versions)) is not None:
        reason = (
            f"writes in place to {written}, a tensor it did not create, which torch 2.13 cannot train through a "
            f"shared compile region"
        )
    elif not returns_tensors_only:
        reason = "returns something other than a tensor or a tuple or list of tensors, which a compile region cannot"
    else:
        return 0
    _inline_blocks_like(module, reason, *_user_forward_line(module))
    return 0


def _record_first_block(proxies: list) -> None:
    """Run at trace time (``_read_at_trace_time``) after a first block's inlined forward and what it taught.

    ``proxies``: the start (``_start_first_block``), the key later blocks like it use
    (None: none shares its region), the number of argument leaves, the leaves, the
    forward's tensors.
    """
    start, key, num_leaves = proxies[:3]
    graph, last_before, _ = _block_starts.pop(start)
    if key is None:
        return
    leaves, outputs = proxies[3 : 3 + num_leaves], proxies[3 + num_leaves :]
    inputs = [leaf.node if isinstance(leaf, fx.Proxy) else leaf for leaf in leaves]
    block = InlinedFirstBlock(key, inputs, [output.node for output in outputs], list(_nodes_after(last_before)))
    note_inlined_first_block(graph, block)


def _record_body(proxies: list) -> None:
    """Run at trace time at a region body's start: its key, and the caller's nodes of its argument leaves."""
    key, *leaves = proxies
    leaf_nodes = [leaf.node if isinstance(leaf, fx.Proxy) else None for leaf in leaves]
    note_region_body(_subgraph_tracer().graph, key, leaf_nodes)


_untracked_writes = itertools.count(1)


def _contents(side_effects: Any, item: Any) -> list[Any] | None:
    """What Dynamo holds for what ``item`` contains: its items, or the attributes the trace wrote; None if unknown."""
    contents = list(side_effects.store_attr_mutations.get(item, {}).values())
    items = getattr(item, "items", None)
    if isinstance(items, dict):
        return contents + list(items.values())
    if isinstance(items, list):
        return contents + items
    return contents if item in side_effects.store_attr_mutations else None


def _written(side_effects: Any, contents: list[Any] | None, seen: set[int]) -> Any:
    """What the key holds for ``contents``: each variable, followed into the objects the trace created.

    Dynamo holds a new variable for each value written, so the key changes with each
    write, also a write into an object the trace created and stored in existing state.
    A tensor holds no Python state a body reads: its variable is enough.
    """
    if contents is None:
        return next(_untracked_writes)
    key = []
    for value in contents:
        key.append(id(value))
        created = isinstance(getattr(value, "mutation_type", None), (ValueMutationNew, AttributeMutationNew))
        if created and not isinstance(value, TensorVariable) and id(value) not in seen:
            seen.add(id(value))
            key.append(_written(side_effects, _contents(side_effects, value), seen))
    return tuple(key)


#: Per ``id`` of a group's list of slots, the group (``register_slot_lists``).
_SLOT_LISTS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def register_slot_lists(group: Any, lists: tuple[list, ...]) -> None:
    """Leaves the writes to a group's lists of slots out of ``_writes_so_far``: compile_shard's own state."""
    for slots in lists:
        _SLOT_LISTS[id(slots)] = group


@torch.compiler.assume_constant_result
def _writes_so_far() -> int:
    """A hash of the writes this trace has made so far to state compile_shard does not own; 0 for none.

    See [Note: writes between blocks key them apart]. The writes count to objects that
    existed before the trace, and to the objects the trace created and stored in them
    (a dict the forward creates, stores in a global the blocks read, and changes
    between their calls), followed from those. One the trace created and kept to
    itself (a list the forward collects outputs in, the cells of the closures each
    call makes) is no state a block's body reads, and counting it would trace every
    block anew. A container whose contents cannot be read here gives every later call
    a key of its own.
    """
    side_effects = InstructionTranslator.current_tx().output.side_effects
    seen: set[int] = set()
    writes = [
        (id(item), _written(side_effects, list(attributes.values()), seen))
        for item, attributes in side_effects.store_attr_mutations.items()
        if isinstance(item.mutation_type, AttributeMutationExisting)
        and not isinstance(getattr(item, "value", None), FSDPParam)
    ]
    for object_id, item in side_effects.id_to_variable.items():
        if object_id in _SLOT_LISTS and _SLOT_LISTS[object_id].owns_slot_list(object_id):
            continue  # compile_shard's own: a group's shown parameters ([Note: one mutated list per group])
        if isinstance(item.mutation_type, ValueMutationExisting) and side_effects.is_modified(item):
            writes.append((id(item), _written(side_effects, _contents(side_effects, item), seen)))
    return hash(tuple(writes)) if writes else 0


@torch.compiler.assume_constant_result
def compiles_every_size_symbolic() -> bool:
    """Whether this is a ``torch.compile(dynamic=True)`` trace, which runs every block inlined.

    Its numbers (a norm's ``eps``) are symbolic from the first trace on, which a region
    body cannot take ([Note: region keys are guarded]), and Dynamo restarts such a
    trace to make a number static again, after its first block learned to run the
    blocks inlined: the second attempt takes another path, which Dynamo refuses.
    """
    return not torch._dynamo.config.assume_static_by_default


@torch.compiler.assume_constant_result
def runs_inlined(module: nn.Module) -> bool:
    """Whether blocks like ``module`` run inlined: a region cannot replay their forward (``_inline_blocks_like``).

    Read like ``_signature_hash``.
    """
    _forget_failed_attempts()
    return _signature_hash(module) in _INLINED_SIGNATURES


_invoke_subgraph.install()


# torch caps the distinct keys of one function in a trace (8 by default) and raises past
# the cap, which is there to catch guards that fail at every call. A key here is what the
# block reads, which may differ from block to block (a ``scale`` per pair of layers read
# by its forward): each key that a second block uses traces a body of its own, as
# inlining traces each block.
_block_region = torch.compiler.nested_compile_region(
    _run_block, reuse_hash_fn=_given_key, max_reuse_entries=sys.maxsize
)


def accepts_region_call(args: tuple, kwargs: dict) -> bool:
    """Whether a region can take these arguments: tensors and plain values, and tuples and lists of those.

    Anything else runs the block inlined: a deeper structure or an object (the layout
    describes one level, [Note: region arguments are flat]).
    """
    accepted = (torch.Tensor, *PLAIN)
    for value in [*args, *kwargs.values()]:
        # Loops, not ``all()``: Dynamo traces this at every block, and a generator costs it more.
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if not isinstance(item, accepted):
                return False
    return True


@torch.compiler.assume_constant_result
def runs_outside_regions(state: Any) -> bool:
    """Whether the block of ``state`` (its ``FSDPState``) runs inlined whatever its key: a ``dynamic=True``
    compile, hooks inside it, or a forward a region cannot replay.

    One call where three would each cost Dynamo a call, and on the state, which the trace
    holds already, where the module would cost it a variable.
    """
    module = state.module
    return compiles_every_size_symbolic() or runs_hooks_inside(module) or runs_inlined(module)


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOK_DICTS = tuple(f"_global{name}" for name in _HOOK_DICTS)


@torch.compiler.assume_constant_result
def runs_hooks_inside(module: nn.Module) -> bool:
    """Whether calls inside ``module``'s forward run module hooks, which then runs inlined.

    A hook is Python a reused region would not replay (see [Note: a reused region
    replays no Python side effects]): one appending each block's output to a list
    would append the first block's only. Hooks on ``module`` itself run outside the
    region, around the wrapper that calls it. Read like ``_signature_hash``.
    """
    hooks = nn.modules.module
    if any(getattr(hooks, name) for name in _GLOBAL_HOOK_DICTS):
        return True
    submodules = module._compile_shard_state.region_modules[1:]  # [0] is ``module``
    return any(getattr(sub, name) for sub in submodules for name in _HOOK_DICTS)


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
    Read like ``_signature_hash``: the objects' real attributes, which the trace's own
    gather does not set until its graph runs.
    """
    fsdp_params = module._compile_shard_state.group.fsdp_params
    if fsdp_params[0].unsharded_param is None:
        return False
    storages = {fsdp_param.unsharded_local().untyped_storage().data_ptr() for fsdp_param in fsdp_params}
    return len(storages) < len(fsdp_params)


@torch.compiler.assume_constant_result
def _plain_attributes(module: nn.Module) -> tuple[tuple[tuple[int, str], ...], tuple[int, ...]]:
    """Where the block's modules hold the plain values its key reads, found per trace.

    Those the bodies of blocks like it read (``_READ_NAMES``): each as the position of
    its module in ``region_modules`` and its name, and the positions among them of the
    numbers (``int`` or ``float``, not ``bool``), which Dynamo may make symbolic.
    """
    _forget_failed_attempts()
    read = _READ_NAMES.get(_signature_hash(module), frozenset())
    places, values = [], []
    for at, submodule in enumerate(module._compile_shard_state.region_modules):
        for name, value in sorted(submodule.__dict__.items()):
            if name in read and isinstance(value, PLAIN):
                places.append((at, name))
                values.append(value)
    numbers = tuple(position for position, value in enumerate(values) if value.__class__ in (int, float))
    return tuple(places), numbers


def call_in_region(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Runs the sharded ``module``'s forward inside the shared region, during a trace.

    Or inlined: the first block of its key in this trace ([Note: the first block of
    each key runs inlined]), or where one of its modules' numbers has become symbolic
    ([Note: region keys are guarded]).
    """
    group = module._compile_shard_state.group
    all_gather_outputs = group.shown_params[-1]
    gathered = all_gather_outputs is not None
    # The region shows its arguments to the modules itself (``_run_block``), a
    # tensor-parallel parameter as a DTensor again: it takes the local tensors.
    inputs = all_gather_outputs if gathered else [fsdp_param.unsharded_local() for fsdp_param in group.fsdp_params]
    flat, layout = _region_arguments_of(inputs, args, kwargs)
    writes = _writes_so_far()
    key = _block_key(module, writes, layout, flat)
    if key is None:
        return call_copied_out(module, args, kwargs) if gathered else module._user_forward(*args, **kwargs)
    if _first_of_its_key(key):
        start = _start_first_block()
        if gathered and traces_inside_another_op():
            output = _block_region(module, key, len(inputs), gathered, layout, *flat)
        else:
            if gathered:
                group.copy_out_traced(all_gather_outputs)
            output = module._user_forward(*args, **kwargs)
        if torch.compiler.is_compiling():  # not where a graph break in the forward resumed uncompiled
            items = output if isinstance(output, (tuple, list)) else (output,)
            returns_tensors_only = all(isinstance(item, torch.Tensor) for item in items)
            _learn_from_first_block(module, start, _writes_so_far() != writes, returns_tensors_only)
            # The key of a later block like this one reads what this forward read: not first either.
            learned = _block_key(module, writes, layout, flat)
            if learned is not None:
                _first_of_its_key(learned)
            recorded = (learned, len(flat), *flat, *items) if returns_tensors_only else (None, 0)
            _read_at_trace_time(_record_first_block, (start, *recorded))
        return output
    return _block_region(module, key, len(inputs), gathered, layout, *flat)


def compiling_gathered(group: Any) -> bool:
    """Whether a trace gathered ``group`` for its region and has not copied it out ([Note: a region copies out
    its block's parameters])."""
    return group is not None and group.shown_params[0] is None and group.shown_params[-1] is not None


_fresh_keys = itertools.count(-1, -1)


@torch.compiler.assume_constant_result
def _fresh_key() -> int:
    """The key of a region traced for one call, never reused ([Note: a region copies out its block's parameters])."""
    return next(_fresh_keys)


@torch.compiler.assume_constant_result
def traces_inside_another_op() -> bool:
    """Whether Dynamo traces the current call inside another operator's body (an activation checkpoint)."""
    return _subgraph_tracer().parent is not None


def call_copied_out(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Runs inlined a block whose group was gathered for its region: copies out first.

    Inside another operator's body, where Dynamo refuses to show the parameters (a
    Python write), it runs in a region of its own instead, traced for this call.
    """
    group = module._compile_shard_state.group
    all_gather_outputs = group.shown_params[-1]
    if traces_inside_another_op():
        flat, layout = _region_arguments_of(all_gather_outputs, args, kwargs)
        return _block_region(module, _fresh_key(), len(all_gather_outputs), True, layout, *flat)
    group.copy_out_traced(all_gather_outputs)
    return module._user_forward(*args, **kwargs)
