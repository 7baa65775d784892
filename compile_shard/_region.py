"""Compiles a sharded block once for every block like it: a nested compile region whose
arguments are the block's unsharded parameters.

[Note: sharded blocks as nested compile regions]
``torch.compile`` of a whole model inlines every block, so Inductor lowers, schedules
and generates code for each of them although they are the same computation.
``torch.compiler.nested_compile_region`` traces a function once and stamps the same
subgraph out for later calls. A block cannot simply be marked: it reads its unsharded
parameters as attributes, and those are all-gather outputs inside the outer graph,
which a reused region cannot re-map from one block to the next (Dynamo: "Freevar has
no source"). So the block's forward wrapper passes the gathered tensors as region
arguments and shows them to the block's modules inside the region
(``FSDPParam.to_unsharded``); the collectives stay in the outer graph, where the pass
suite schedules them.

Showing the tensors writes Python state, which turns off Dynamo's guard-based reuse,
so the region carries its own reuse key (``reuse_hash_fn``): the block's signature
(see ``block_signature``, read when the call is traced), its modules' plain
attributes (``training`` among them) read where Dynamo guards on them, autocast, and
the metadata of the call's arguments. Blocks with equal keys share one compiled
subgraph, traced from the first of them. The key sees the modules' own state; it
cannot see what a forward reads outside them (a global, a closure) or inside a
shared object that changes between the blocks' calls. Such models keep regions off
(``settings.compile_regions = False``, the default).

[Note: region keys are guarded]
Dynamo guards on what the outer trace reads, and on nothing read inside
``reuse_hash_fn`` or an ``assume_constant_result`` function: a block's ``eval()``, or
``blocks[2].scale = 3.0``, after the first compile would not recompile, and block 2
would go on running block 0's subgraph. So ``call_in_region`` reads every plain
attribute of the block's modules (``training``, ``eps``, ``in_features``, a user's
``scale``: 42 per Llama block) in the outer trace, where each read is a guard on its
value, and passes their hash to the region; a change recompiles and the new trace
keys that block apart. Which attributes to read is found per trace
(``_plain_attributes``). Not guarded: attributes added after the first compile,
and attributes that are objects (keyed by identity when the trace runs).

A number that changed is not always a new constant: Dynamo recompiles with it as a
symbolic input (automatic dynamic; measured on torch 2.13 for a float attribute),
which a region body cannot take from its caller ("Freevar has no source"). That
block then runs inlined, like a call with symbolic sizes (``accepts_region_call``).

[Note: a reused region replays no Python side effects]
A reused call stamps out the traced subgraph: it runs the tensor computation of the
first block and none of its Python. A forward that stores something on its modules
(an auxiliary loss, a cached tensor) would store it for the first block only, so the
traced region compares its modules' attributes before and after the forward and
raises ``RegionSideEffectError`` for a write, which Dynamo passes on inside its
``UncapturedHigherOrderOpError`` (with or without ``fullgraph``). A block whose
submodules run module hooks is inlined instead (``runs_hooks_inside``): a hook
appending each block's output to a list appended once for three blocks. Writes the
forward itself makes elsewhere (a global, a shared list) are not seen. A subgraph
also returns only tensors: a forward returning anything else (``None`` in a tuple)
raises the same error instead of failing inside Dynamo.

Backward must still gather again for resharded groups; [Note: region parameters are
saved as inputs] in ``compile_shard.passes.regions`` explains how the partitioned
region keeps from saving the parameters.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
import torch.nn as nn

#: ``torch.fx.traceback.annotate`` key on the view through which a region reads each
#: unsharded parameter argument; ``compile_shard.passes.regions`` finds them by it.
REGION_PARAM_ANNOTATION = "compile_shard_region_param"

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)


def _nested_region_takes_reuse_key() -> bool:
    region = getattr(torch.compiler, "nested_compile_region", None)
    return region is not None and "reuse_hash_fn" in inspect.signature(region).parameters


#: Whether this torch's ``nested_compile_region`` takes a ``reuse_hash_fn`` (2.13 does,
#: 2.11 does not); without it sharded blocks are inlined as before.
REGIONS_SUPPORTED = _nested_region_takes_reuse_key()


def _plain_value(value: Any) -> Any:
    """``value`` itself if plain, containers item by item (a hook dict by its hooks), else its identity."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_plain_value(item) for item in value)
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(repr(_plain_value(item)) for item in value))
    if isinstance(value, dict):
        return tuple(_plain_value(item) for item in value.values())
    return ("object", id(value))


def _base_class(module: nn.Module) -> type:
    cls = type(module)
    while getattr(cls, "_compile_shard_base", None) is not None and cls is not cls._compile_shard_base:
        cls = cls._compile_shard_base
    return cls


def block_signature(module: nn.Module) -> tuple:
    """What must be equal for two blocks to share one compiled region (``_signature_hash`` hashes it).

    Per submodule: its user class, its parameters' and buffers' names, shapes, dtypes
    and ``requires_grad``, its hooks, and its other attributes (plain values by
    value, anything else by identity). ``training`` is left out: ``call_in_region``
    reads it, with the other plain values, where Dynamo guards on them ([Note: region
    keys are guarded]).
    """
    skipped = {"_parameters", "_buffers", "_modules", "training"}
    signature = []
    for name, submodule in module.named_modules():
        cls = _base_class(submodule)
        tensors = tuple(
            (kind, tensor_name, tuple(tensor.shape), tensor.dtype, tensor.requires_grad)
            for kind, tensors in (("param", submodule._parameters), ("buffer", submodule._buffers))
            for tensor_name, tensor in tensors.items()
            if tensor is not None
        )
        attributes = tuple(
            (key, _plain_value(value))
            for key, value in sorted(submodule.__dict__.items())
            if key not in skipped and not key.startswith("_compile_shard")
        )
        signature.append((name, cls.__module__, cls.__qualname__, tensors, attributes))
    return tuple(signature)


def _tensor_key(value: Any) -> Any:
    """A tensor's metadata; a plain value (all else ``accepts_region_call`` rejects) as is."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.dtype, value.device, value.requires_grad)
    return value


def _region_arguments(num_params: int, num_args: int, flat: tuple) -> tuple[tuple, tuple, dict]:
    """Splits a region call's flat arguments back into unsharded parameters, args and kwargs.

    [Note: region arguments are flat]
    Dynamo flattens a region call's arguments with a traced ``pytree.tree_flatten``
    unless every argument is already a leaf (a tensor, a module or a constant); that and
    tracing the block's signature inside the key (``_signature_hash`` computes it
    untraced) cost about 40 ms per call site on config B. So ``call_in_region`` passes
    the unsharded parameters, the args, the kwargs' names and then their values one by one,
    led by the counts that split them here. The kwargs come sorted by name: a reused
    subgraph maps its tensor inputs by position, so blocks called with the same keywords
    in another order must line up.
    """
    params, rest = flat[:num_params], flat[num_params:]
    args, named = rest[:num_args], rest[num_args:]
    half = len(named) // 2
    return params, args, dict(zip(named[:half], named[half:]))


@torch.compiler.assume_constant_result
def _signature_hash(module: nn.Module) -> int:
    """``hash(block_signature(module))``, computed by plain Python while Dynamo traces the call.

    Traced, the signature costs Dynamo tens of milliseconds per call site (see [Note:
    region arguments are flat]); computed here, it is read when each trace runs, so
    hooks and attributes set after ``fully_shard`` count. Dynamo does not guard on it:
    of a change made after the first compile, only one to a plain value recompiles
    (``call_in_region`` reads those, [Note: region keys are guarded]); any other is
    seen by the next trace (``torch.compiler.reset()``).
    """
    return hash(block_signature(module))


def _reuse_key(module: nn.Module, attributes: int, num_params: int, num_args: int, *flat: Any) -> int:
    """Traced by Dynamo for every call; equal keys reuse one subgraph."""
    unsharded_params, args, kwargs = _region_arguments(num_params, num_args, flat)
    device_type = unsharded_params[0].device.type
    return hash(
        (
            _signature_hash(module),
            attributes,
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
            tuple(_tensor_key(tensor) for tensor in unsharded_params),
            tuple(_tensor_key(arg) for arg in args),
            tuple((name, _tensor_key(value)) for name, value in kwargs.items()),  # names come sorted
        )
    )


def _run_block(module: nn.Module, attributes: int, num_params: int, num_args: int, *flat: Any) -> Any:
    """The block's own forward, reading the unsharded parameters (the region's arguments) as its parameters.

    The caller had shown these same tensors; the region shows them again on the way
    out instead of the caller restoring them afterwards, because all of its Python
    state writes must happen inside the region: Dynamo allows them there, also when
    the block runs inside an activation-checkpoint region, which refuses any write.
    ``attributes`` (the modules' plain attributes, hashed) is there for the reuse key only.
    """
    state = module._compile_shard_state
    fsdp_params = state.group.fsdp_params
    unsharded_params, args, kwargs = _region_arguments(num_params, num_args, flat)
    with torch.fx.traceback.annotate({REGION_PARAM_ANNOTATION: True}):
        viewed = [tensor.view(tensor.shape) for tensor in unsharded_params]
    for fsdp_param, tensor in zip(fsdp_params, viewed):
        fsdp_param.to_unsharded(tensor)
    attributes_before = [dict(submodule.__dict__) for submodule in state.region_modules]
    with _ambient_autocast(unsharded_params[0].device.type):
        output = module._user_forward(*args, **kwargs)
    _check_no_attribute_writes(module, attributes_before)
    _check_tensor_output(module, output)
    for fsdp_param, tensor in zip(fsdp_params, unsharded_params):
        fsdp_param.to_unsharded(tensor)
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


class RegionSideEffectError(RuntimeError):
    """A sharded block cannot share a compile region; see [Note: a reused region replays no Python side effects]."""


_TURN_OFF = "set compile_shard.passes.settings.compile_regions = False for this model"


def _check_no_attribute_writes(module: nn.Module, attributes_before: list[dict]) -> None:
    state = module._compile_shard_state
    for submodule, before in zip(state.region_modules, attributes_before):
        for key, value in submodule.__dict__.items():
            if key not in before or before[key] is not value:
                name = next(name for name, candidate in module.named_modules() if candidate is submodule)
                where = f"{state.group.module_name}.{name}" if name else state.group.module_name
                raise RegionSideEffectError(
                    f"compile_regions: the forward of {where} sets attribute {key!r}; a shared compile "
                    f"region would set it for the first such block only. Keep the value out of the "
                    f"module (return it) or {_TURN_OFF}"
                )


def _check_tensor_output(module: nn.Module, output: Any) -> None:
    items = output if isinstance(output, (tuple, list)) else (output,)
    for item in items:
        if not isinstance(item, torch.Tensor):
            raise RegionSideEffectError(
                f"compile_regions: the forward of {module._compile_shard_state.group.module_name} returns "
                f"{type(item).__name__} in its output; a shared compile region returns a tensor or a "
                f"tuple or list of tensors. Return tensors only or {_TURN_OFF}"
            )


_block_region = (
    torch.compiler.nested_compile_region(_run_block, reuse_hash_fn=_reuse_key) if REGIONS_SUPPORTED else None
)


def accepts_region_call(args: tuple, kwargs: dict) -> bool:
    """Whether a region can take these arguments: plain values and tensors of static shape.

    Anything else runs the block inlined: a nested structure (the reuse key describes
    leaves only), or symbolic sizes (a ``dynamic=True`` trace, or a recompile that
    marked a size dynamic), where torch 2.13's region reuse fails inside Dynamo. The
    size test reads ``__class__``: Dynamo answers ``isinstance(size, torch.SymInt)``
    with False for symbolic sizes too.
    """
    for value in [*args, *kwargs.values()]:
        if isinstance(value, torch.Tensor):
            if any(size.__class__ is not int for size in value.shape):
                return False
        elif not isinstance(value, _PLAIN):
            return False
    return True


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
def updates_running_stats(module: nn.Module) -> bool:
    """Whether a submodule of ``module`` updates batch-norm running statistics, which then runs inlined.

    torch 2.13 refuses to train through a region that mutates a buffer in place
    ("invoke_subgraph ... does not currently support training with in-place input or
    buffer mutations"); inlined, the block trains as without regions. Read like
    ``_signature_hash``; a later ``train()`` or ``eval()`` recompiles, as the inlined
    trace or ``call_in_region`` reads ``training`` where Dynamo guards on it.
    """
    return any(
        isinstance(sub, nn.modules.batchnorm._NormBase) and sub.track_running_stats and sub.training
        for sub in module._compile_shard_state.region_modules
    )


@torch.compiler.assume_constant_result
def _plain_attributes(module: nn.Module) -> tuple[tuple[tuple[str, ...], ...], tuple[int, ...]]:
    """Where the block's modules hold plain values, found per trace.

    The names for each module of ``region_modules``, and the positions among all of
    them of the numbers (``int`` or ``float``, not ``bool``), which Dynamo may make
    symbolic.
    """
    values = [
        {name: value for name, value in sorted(submodule.__dict__.items()) if isinstance(value, _PLAIN)}
        for submodule in module._compile_shard_state.region_modules
    ]
    flat = [value for plain in values for value in plain.values()]
    numbers = tuple(position for position, value in enumerate(flat) if value.__class__ in (int, float))
    return tuple(tuple(plain) for plain in values), numbers


def call_in_region(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Runs the sharded ``module``'s forward inside the shared region, during a trace.

    Or inlined, where one of its modules' numbers has become symbolic ([Note: region
    keys are guarded]).
    """
    state = module._compile_shard_state
    unsharded_params = [fsdp_param.unsharded_param for fsdp_param in state.group.fsdp_params]
    names = tuple(sorted(kwargs))  # see [Note: region arguments are flat]
    flat = (*unsharded_params, *args, *names, *(kwargs[name] for name in names))
    attribute_names, numbers = _plain_attributes(module)
    # Each read is a guard on the value: [Note: region keys are guarded].
    values = tuple(
        getattr(submodule, name)
        for submodule, module_names in zip(state.region_modules, attribute_names)
        for name in module_names
    )
    if any(values[at].__class__ is not int and values[at].__class__ is not float for at in numbers):
        return module._user_forward(*args, **kwargs)
    return _block_region(module, hash(values), len(unsharded_params), len(args), *flat)
