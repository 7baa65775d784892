"""profile_ranges: name each group's collectives for the profiler, as FSDP2 names them.

[Note: profiler ranges in compiled graphs]
An eager step records ``FSDP::all_gather (layers.0)`` and FSDP2's other ranges around
each group's phases (``compile_shard._group``). A compiled step runs the same
collectives as calls of one graph, and a ``torch.profiler.record_function`` that
Dynamo traces does not reach them: Inductor erases profiler ops in its post-grad
passes, before the hook this pass runs from, so that they do not split fusions. This
pass writes the ranges into the partitioned graph after that, as the profiler's own
ops (``_record_function_enter_new`` and ``_record_function_exit`` of its handle), which
Inductor keeps as calls in the graph's order (``keep_order``):

- a group's all-gather, from its copy-in: ``FSDP::all_gather (<group>)``, as FSDP2's;
- a group's reduction (reduce-scatter, gloo's all-to-all, HSDP's all-reduce), from its
  copy-in: ``FSDP::post_backward_reduce (<group>)``, the range FSDP2 issues it in.

``<group>`` is the group annotation's name (a bucket's joins its groups' with ``+``).
A range opens before the collective's copy-in, the nodes right before it that it
reads, so a scheduler that moves collectives earlier (torch 2.15's ``simple_overlap``)
cannot move the collective out past its copy-in. Inductor may still run a copy-in
ahead of its range: ``keep_order`` places an extern call at its earliest FX origin,
which for a copy-in of gradients can be an early gradient's view; the collective then
stays in its range on torch 2.13 and 2.14, and torch 2.15 can issue it before. A wait
gets no range: FSDP2 waits inside the phase that reads the result, and a range around
a wait is what such a scheduler moves (it moves waits later). Collectives without a group annotation (a
user's own, tensor parallelism's) get no range. With the profiler off, a range is two
op calls that record nothing.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from compile_shard._annotation import group_annotation
from compile_shard._collectives import node_collective

from ._graph import VIEWS, aten, fsdp

_ENTER = torch.ops.profiler._record_function_enter_new.default
_EXIT = torch.ops.profiler._record_function_exit._RecordFunction

# What a lowered copy-in is made of (``lower``, ``gather_buffers``): the ops a range may open before.
_COPY_IN = (
    *VIEWS,
    aten.new_empty.default,
    fsdp.copy_in.default,
    fsdp.reduce_scatter_input.default,
    fsdp.reduce_scatter_input_into_.default,
)

# A collective's kind -> the name of the range it runs in.
_RANGE_NAMES = {
    "all_gather": "FSDP::all_gather",
    "reduce_scatter": "FSDP::post_backward_reduce",
    "all_to_all": "FSDP::post_backward_reduce",
    "all_reduce": "FSDP::post_backward_reduce",
}


def _copy_in_start(collective: fx.Node) -> fx.Node:
    """The first node of the run of copy-in ops right before ``collective`` that it reads, directly or
    through a buffer filled in place; ``collective`` itself where the node before it is something else.
    What the copy-in reads (a block's gradients, a region's outputs) stays outside."""
    start, read = collective, set(collective.all_input_nodes)
    while (
        (before := start.prev).op == "call_function"
        and before.target in _COPY_IN
        and (before in read or any(arg in read for arg in before.all_input_nodes[:1]))
    ):
        start = before
        read |= set(before.all_input_nodes)
    return start


def profile_ranges(graph: fx.Graph) -> int:
    """Puts each of a group's collectives, from its copy-in, inside its profiler range; returns how many."""
    collectives = [
        node for node in graph.nodes if node_collective(node) is not None and group_annotation(node) is not None
    ]
    for collective in collectives:
        name = f"{_RANGE_NAMES[node_collective(collective).kind]} ({group_annotation(collective).name})"
        with graph.inserting_before(_copy_in_start(collective)):
            profiler_range = graph.call_function(_ENTER, (name, None))
        with graph.inserting_after(collective):
            graph.call_function(_EXIT, (profiler_range,))
    return len(collectives)
