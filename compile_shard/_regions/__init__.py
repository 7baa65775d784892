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
parameters] in ``_call``) and shows them to the block's modules inside the region
(``FSDPParam.show_unsharded``); the collectives stay in the outer graph, where the pass
suite schedules them.

Showing the tensors writes Python state, which turns off Dynamo's guard-based reuse,
so the region carries its own reuse key (``reuse_hash_fn``, ``_key``): the block's
signature (``_signature``), its modules' plain attributes that the body reads, read
where Dynamo guards on them, autocast, what the trace wrote so far, and the metadata
of the call's arguments. Blocks with equal keys share one compiled subgraph, traced
from the first of them, which runs inlined and teaches the later ones' keys what to
read (``_first_block``). What a body reads outside the modules is a constant of that
first trace: a write to it between the blocks' calls keys the later blocks apart, and
a change between steps fails the guards and recompiles.

The modules, each with one job:

- ``_call``: a block's call during a trace, in its region or inlined;
- ``_key``: the reuse key, and which writes of the trace it counts;
- ``_first_block``: what the first block of each key teaches the later ones;
- ``_signature``: what must be equal besides the key; ``_arguments``: the flat call;
- ``_registry``: what the traces learned, kept between traces (``registry.reset()``);
- ``_dynamo``: the only module that reads Dynamo's private state;
- ``_attribute_writes``: the writes to a block's modules that Dynamo does not guard;
- ``_invoke_subgraph``: what compile_shard adds to torch's region operator.
"""

from ._arguments import flat_arguments
from ._attribute_writes import CountsWrites, count_writes
from ._call import call_copied_out, call_in_region, compiling_gathered, enters_gathered_as_views, runs_outside_regions
from ._first_block import RegionInlinedWarning
from ._key import register_owned_state
from ._registry import registry
from ._signature import block_signature

__all__ = [
    "CountsWrites",
    "RegionInlinedWarning",
    "block_signature",
    "call_copied_out",
    "call_in_region",
    "compiling_gathered",
    "count_writes",
    "enters_gathered_as_views",
    "flat_arguments",
    "register_owned_state",
    "registry",
    "runs_outside_regions",
]
