"""The first block of each key: run inlined, it shows what later blocks' keys read and whether a shared
region could replay its forward.

[Note: the first block of each key runs inlined]
In each trace, the first block of each reuse key runs its forward inlined, and only
the later ones with that key call the shared region (``registry.claim``), so a
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
graph, which torch 2.13 cannot take: those blocks run inlined (``_learn``).

Past Dynamo the inlined block is one block's ops per key that Inductor lowers and
compiles apart from the body. Its backward is ordinary ops too: its weight gradients,
and so its reduce-scatter, come before the matmuls for its input gradient, which hide
that reduce-scatter, where a region returns both gradients together and leaves only
the root's backward to hide it, as in FSDP2's eager step (the simulated schedules are
in docs/benchmarks.md). Where nothing overlaps communication anyway (the ``cpu_gloo``
cost profile, by default) ``passes.reuse_first_blocks`` makes the block call the body
its later blocks call once Dynamo is done ([Note: the first block calls its region
after Dynamo]), from what ``record_first_block`` and ``record_body`` note while
Dynamo traces ([Note: what the trace records for reuse_first_blocks] in
``_annotation``).

[Note: a reused region replays no Python side effects]
A reused call stamps out the traced subgraph: it runs the tensor computation of the
block its body was traced from and none of its Python. A forward that writes state
outside the region (an auxiliary loss stored on its module, a global counter, a list
it appends to) would write it for one block only; torch 2.13 does not refuse such a
region when a ``reuse_hash_fn`` keys it (a global incremented in the body ran once for
three calls, measured). A region body is traced only after the first block of its key
ran inlined, so that block shows whether a region could replay the forward: where it
wrote state it did not create (``writes_so_far()`` changed across its forward),
returned anything but tensors (which a subgraph cannot return), read a symbolic
number, or wrote in place to a tensor it did not create (a buffer; torch 2.13 refuses
to train through a region that does, ``_written_in_place``), the registry keeps its
signature as inlined, a ``RegionInlinedWarning`` names the module and the reason at
the forward's first line, and every later block with that signature runs inlined,
its Python run for each block, as without regions. The later blocks of the key take
the same path, so they write nothing either.
"""

from __future__ import annotations

import warnings

import torch
import torch.fx as fx
import torch.nn as nn

from .._annotation import InlinedFirstBlock, note_inlined_first_block, note_region_body
from .._classes import user_class
from . import _dynamo
from ._attribute_writes import PLAIN
from ._registry import registry
from ._signature import signature_hash


class RegionInlinedWarning(UserWarning):
    """A sharded block runs inlined instead of in a shared compile region.

    See [Note: a reused region replays no Python side effects].
    """


@torch.compiler.assume_constant_result
def runs_inlined(module: nn.Module) -> bool:
    """Whether blocks like ``module`` run inlined: a region cannot replay their forward."""
    return registry.runs_inlined(signature_hash(module))


def _start(proxies: list) -> int:
    graph = _dynamo.current_graph()
    versions = {node: value._version for node, value in _dynamo.example_tensors(graph)}
    return registry.start_block(graph, _dynamo.last_node(graph), versions)


def start_first_block() -> int:
    """Notes the graph being traced before a first block's forward, for ``learn_from_first_block``."""
    return _dynamo.at_trace_time(_start, ())


@torch.compiler.assume_constant_result
def _block_facts(module: nn.Module) -> tuple:
    """What learning from a block's forward needs of its module, as constants of the trace: its signature,
    the names of its modules' plain attributes, its name, where the user's forward starts ([Note: the
    classes of a sharded module]), and its buffers by ``id``."""
    state = module._compile_shard_state
    plain = {
        name for submodule in state.region_modules for name, value in submodule.__dict__.items() if isinstance(value, PLAIN)
    }
    code = user_class(type(module)).forward.__code__
    buffers = tuple((id(buffer), name) for name, buffer in module.named_buffers())
    name = state.group.settings.module_name
    return signature_hash(module), tuple(sorted(plain)), name, code.co_filename, code.co_firstlineno, buffers


def _written_in_place(buffers: dict[int, str], graph: fx.Graph, versions: dict[fx.Node, int]) -> str | None:
    """What the forward wrote in place that it did not create: a buffer by name, or "an input"; else None.

    Dynamo runs each op on its fake example values, so an in-place op bumps the
    version of the fake tensor it writes (and of its view's base). An input the
    forward lifted into the graph (a buffer it read first) starts at version 0.
    """
    for node, value in _dynamo.example_tensors(graph):
        before = versions.get(node, 0 if node.op == "placeholder" else None)
        if before is not None and value._version != before:
            real = _dynamo.lifted_object(node)
            return f"its buffer `{buffers[id(real)]}`" if id(real) in buffers else "an input"
    return None


def _learn(proxies: list) -> None:
    """Run at trace time after a first block's forward: see ``learn_from_first_block``."""
    (signature, plain, module_name, filename, lineno, buffers), start, wrote, returns_tensors_only = proxies
    # A body's read of a module's plain attribute is a guard on it, so the guards' sources
    # name every attribute the body read, and more (the caller's reads): keying on those
    # too only keys apart blocks that could share.
    registry.add_read_names(signature, set(plain) & _dynamo.guarded_names())
    _, last_before, versions = registry.block_start(start)
    numbers = _dynamo.symbolic_numbers()
    nodes = _dynamo.nodes_after(last_before)
    name = next((numbers[arg] for node in nodes for arg in node.all_input_nodes if arg in numbers), None)
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
    elif (written := _written_in_place(dict(buffers), _dynamo.current_graph(), versions)) is not None:
        reason = (
            f"writes in place to {written}, a tensor it did not create, which torch 2.13 cannot train through a "
            f"shared compile region"
        )
    elif not returns_tensors_only:
        reason = "returns something other than a tensor or a tuple or list of tensors, which a compile region cannot"
    else:
        return
    registry.inline(signature)
    warnings.warn_explicit(
        f"compile_regions: the forward of {module_name} {reason}; blocks like it run inlined",
        RegionInlinedWarning,
        filename,
        lineno,
    )


def learn_from_first_block(module: nn.Module, start: int, wrote: bool, returns_tensors_only: bool) -> None:
    """After the inlined first block of its key: what later keys read, and whether a region can replay its forward.

    It cannot ([Note: a reused region replays no Python side effects]) where the forward
    wrote state it did not create (``wrote``), returned anything but tensors, or read a
    symbolic number (a node made since ``start`` reads one), which would reach the
    later blocks' region bodies from the caller's graph, which torch 2.13 cannot take
    ([Note: region keys are guarded] in ``_key``); nor where it wrote in place to a
    tensor it did not create (a buffer it updates, batch norm's running statistics),
    which torch 2.13 refuses to train through a region. Blocks like it then run inlined.
    """
    _dynamo.at_trace_time(_learn, (_block_facts(module), start, wrote, returns_tensors_only))


def _record_first_block(proxies: list) -> None:
    start, key, num_leaves = proxies[:3]
    graph, last_before, _ = registry.end_block(start)
    if key is None:
        return
    leaves, outputs = proxies[3 : 3 + num_leaves], proxies[3 + num_leaves :]
    inputs = [leaf.node if isinstance(leaf, fx.Proxy) else leaf for leaf in leaves]
    block = InlinedFirstBlock(key, inputs, [output.node for output in outputs], list(_dynamo.nodes_after(last_before)))
    note_inlined_first_block(graph, block)


def record_first_block(start: int, key: int | None, leaves: tuple, outputs: tuple) -> None:
    """Notes a first block's nodes for ``passes.reuse_first_blocks``: its argument leaves, its outputs and the
    key later blocks like it use (None: none shares its region, and nothing is noted)."""
    _dynamo.at_trace_time(_record_first_block, (start, key, len(leaves), *leaves, *outputs))


def _record_body(proxies: list) -> None:
    key, *leaves = proxies
    leaf_nodes = [leaf.node if isinstance(leaf, fx.Proxy) else None for leaf in leaves]
    note_region_body(_dynamo.current_graph(), key, leaf_nodes)


def record_body(key: int, flat: tuple) -> None:
    """Notes, at a region body's start, its key and the caller's nodes of its argument leaves."""
    _dynamo.at_trace_time(_record_body, (key, *flat))
