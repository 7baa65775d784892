"""A block's reuse key: blocks with equal keys share one compiled region body.

[Note: region keys are guarded]
Dynamo guards on what the outer trace reads, and on nothing read inside
``reuse_hash_fn`` or an ``assume_constant_result`` function: a block's ``eval()``, or
``blocks[2].scale = 3.0``, after the first compile would not recompile, and block 2
would go on running block 0's subgraph. So ``claim_key`` reads the plain attributes
of the block's modules that the body reads (a dropout's ``training``, a norm's
``eps``, a user's ``scale``) in the outer trace, where each read is a guard on its
value, and passes their hash to the region; a change recompiles and the new trace
keys that block apart. Keying on every plain attribute would key apart blocks that
differ only in what no body reads (torchtitan's ``layer_id``, Hugging Face's
``layer_idx`` without a cache), each block traced anew. Which names the body reads is
learned from its trace (``_first_block.learn_from_first_block``): each read is a guard
whose source names the attribute. The first block of each key runs inlined ([Note: the
first block of each key runs inlined] in ``_first_block``) and shows what the forward
reads on its path; the names are kept per signature. Which attributes to read is found
per trace (``plain_attributes``); the key reads the block's count of the writes these
reads miss too (an attribute added or deleted, an object or a submodule replaced),
[Note: a block's attribute writes are counted] in ``_attribute_writes``.

A number that changed is not always a new constant: Dynamo recompiles with it as a
symbolic input (automatic dynamic; measured on torch 2.13 for a float attribute),
which a region body cannot take from its caller ("Freevar has no source"). That
block then runs inlined, like a call with a symbolic number as an argument: its key
is None.

[Note: symbolic sizes in a reuse key]
After an input's size changed, Dynamo recompiles with it symbolic (automatic
dynamic), and the blocks' activations have symbolic sizes. A reused subgraph is
stamped out with the symbols and output sizes of the call it was traced from, so
two calls share one only where their sizes are the same expressions: a block
called on ``x`` and on ``x[:, ::2]`` needs two. Those expressions, and whether a
size or a number is symbolic at all, cannot be read in the traced code (``str``
or ``hash`` of a symbolic size guards on its value, and ``__class__`` answers
``SymInt`` on torch 2.13 and ``int`` on 2.14 and later), so the key is computed at
trace time (``_dynamo.at_trace_time``) from the proxies and fake tensors, with the
tensors' other metadata: one call per block instead of a traced read per tensor
and attribute.

[Note: writes between blocks key them apart]
A body reads state outside the block (a global, a shared dict) as a constant of the
first block's trace. A caller that changes it between the blocks' calls (``SCALE = i``
before calling block ``i``) would leave every later block with the first one's value.
So each call's reuse key holds ``writes_so_far()``: what the trace has written until
then to objects that existed before it, other than compile_shard's own (the
``FSDPParam`` attributes that show the gathered parameters, a group and its lists
of slots), and to the objects the trace created and stored in those (a dict the forward
creates, stores in a global and changes before each block). Between two calls with
no such write the keys stay equal; after one they differ, and the later block is
traced anew. One the trace created and kept to itself (a list the forward collects
outputs in, the cells of the closures each call makes) is no state a block's body
reads, and counting it would trace every block anew.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .._param import FSDPParam
from . import _dynamo
from ._attribute_writes import PLAIN
from ._registry import registry
from ._signature import signature_hash

#: Per ``id`` of a group or one of its lists of slots, the group (``register_owned_state``).
_OWNERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def register_owned_state(group: Any, objects: tuple[Any, ...]) -> None:
    """Leaves the writes to a group and its lists of slots ([Note: one mutated list per group]) out of
    ``writes_so_far``: compile_shard's own state, which no block's body reads as a constant."""
    for owned in objects:
        _OWNERS[id(owned)] = group


def _owned(object_id: int, value: Any) -> bool:
    """Whether compile_shard owns the object: an ``FSDPParam``, a group or its lists of slots (the group
    confirms the ``id``, which a dead object's successor may reuse)."""
    if isinstance(value, FSDPParam):
        return True
    return object_id in _OWNERS and _OWNERS[object_id].owns(object_id)


@torch.compiler.assume_constant_result
def writes_so_far() -> int:
    """A hash of the writes this trace has made so far to state compile_shard does not own; 0 for none."""
    writes = _dynamo.writes_to_existing_state(_owned)
    return hash(writes) if writes else 0


@torch.compiler.assume_constant_result
def plain_attributes(module: nn.Module) -> tuple[tuple[int, str], ...]:
    """Where the block's modules hold the plain values its key reads, found per trace: those the bodies of
    blocks like it read, each as the position of its module in ``region_modules`` and its name."""
    read = registry.read_names(signature_hash(module))
    return tuple(
        (at, name)
        for at, submodule in enumerate(module._compile_shard_state.region_modules)
        for name, value in sorted(submodule.__dict__.items())
        if name in read and isinstance(value, PLAIN)
    )


def _tensor_metadata(fake: Any) -> tuple | None:
    """A tensor's sizes and strides (expressions where symbolic), dtype, device and ``requires_grad``."""
    if not isinstance(fake, torch.Tensor):
        return None
    sizes = tuple(str(size) for size in fake.shape)
    return sizes, tuple(str(stride) for stride in fake.stride()), fake.dtype, fake.device, fake.requires_grad


def _key_of_call(proxies: list) -> tuple[int | None, bool]:
    """Run at trace time: the call's key from its parts and argument leaves, and whether it is the first of
    its key in this trace (None, False: a number read is symbolic)."""
    parts, values, *leaves = proxies
    for value in (*values, *leaves):
        if isinstance(value, fx.Proxy) and not isinstance(_dynamo.example_value(value), torch.Tensor):
            return None, False
    tensor_keys = tuple(_tensor_metadata(_dynamo.example_value(leaf)) for leaf in leaves)
    # The plain leaves themselves: their values, read in the outer trace, are guarded.
    plain_leaves = tuple(leaf if key is None else None for leaf, key in zip(leaves, tensor_keys))
    key = hash((*parts, values, tensor_keys, plain_leaves))
    return key, registry.claim(key)


def claim_key(module: nn.Module, writes: int, layout: str, flat: tuple) -> tuple[int | None, bool]:
    """The call's reuse key, None where a number it reads is symbolic; and whether this trace runs the first
    block of that key now (``registry.claim``).

    ``writes``: ``writes_so_far()`` before the block's call. The plain attributes are
    read here, in the outer trace: each read is a guard on the value ([Note: region keys
    are guarded]).
    """
    state = module._compile_shard_state
    modules = state.region_modules
    values = tuple(getattr(modules[at], name) for at, name in plain_attributes(module))
    device_type = flat[0].device.type  # an unsharded parameter's
    autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
    parts = (signature_hash(module), state.region_writes, writes, autocast, layout)
    return _dynamo.at_trace_time(_key_of_call, (parts, values, *flat))
