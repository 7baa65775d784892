"""gather_buffers: all-gathers, reduction inputs (and gloo's reduction all-to-alls) write into buffers Inductor allocates.

[Note: planned all-gather buffers]
A functional ``all_gather_into_tensor`` allocates its output inside the collective,
out of reach of Inductor's memory planner: every group's gather asks the allocator
for a fresh unsharded-size block. On CPU such a block is a fresh ``mmap`` whose
pages fault on first write (measured on torch 2.13: a 25 MB copy into fresh memory
takes about four times as long as into reused memory). Rewritten as ``new_empty`` plus
``all_gather_into_tensor_out(input, ..., out=new_empty)``, the output is an ordinary
Inductor buffer, and the wrapper hands a finished group's buffer to the next group
of the same size.

Inductor (torch 2.13) models an ``out=`` collective as an in-place one and then
considers its *input* dead once the collective is issued: without help it reuses
the copy-in buffer for the next group while the transfer still reads it (measured:
wrong losses). So each rewritten gather gets a second ``wait_tensor`` on its input
right after the real wait. At run time it waits on nothing (no collective produced
that tensor); to Inductor it is a read that keeps the input alive until the
transfer is complete.

On gloo the gather is ``fsdp.all_gather_send_recv_(buffer, input, ...)`` instead,
which receives straight into the planned buffer ([Note: gloo all-gather] in
``compile_shard.ops``), and a reduction's all-to-all of equal splits ([Note: gloo
reduce-scatter]) becomes ``fsdp.all_to_all_into_(buffer, gradient, ...)``: the same
page faults, once per group in backward. Both fill their first argument and return
nothing, so their waits read the buffer (``waited_node``); their inputs get the
same second wait.

A group's reduction input (``fsdp.reduce_scatter_input``, [Note: one reduction input
per group] in ``compile_shard.ops``) is an opaque op too, and as large as the gathered
group: it becomes ``fsdp.reduce_scatter_input_into_`` on a planned buffer. It is
synchronous, so it needs no wait.

Runs on the partitioned graphs for Inductor only, after ``reorder``: other backends
run the graph eagerly and have no planner to hand buffers to.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from compile_shard.ops import gathers_by_send_recv, reduces_by_all_to_all

from ._graph import NodeInserter, c10d, fsdp

aten = torch.ops.aten


def _equal_splits(exchange: fx.Node) -> bool:
    _, output_split_sizes, input_split_sizes, _ = exchange.args
    sizes = [*output_split_sizes, *input_split_sizes]
    return all(is_concrete_int(size) for size in sizes) and len(set(sizes)) == 1


def _rewrite(graph: fx.Graph, collective: fx.Node, out_variant, *args) -> None:
    """Replaces ``collective`` by ``new_empty`` and ``out_variant(*args)`` into it.

    ``args[0]`` is the collective's input: a second wait keeps it alive.
    """
    insert = NodeInserter(graph, collective, collective)
    collective_input = args[0]
    buffer = insert(aten.new_empty.default, collective_input, list(collective.meta["val"].shape))
    if out_variant is c10d.all_gather_into_tensor_out.default:
        waited = insert(out_variant, *args, out=buffer)
    else:  # the fsdp ops fill their first argument and return nothing
        insert(out_variant, buffer, *args)
        waited = buffer
    waits = list(collective.users)
    collective.replace_all_uses_with(waited)
    graph.erase_node(collective)
    for wait in waits:
        NodeInserter(graph, wait.next, wait)(c10d.wait_tensor.default, collective_input)


def gather_into_planned_buffers(graph: fx.Graph) -> int:
    """Gives each all-gather, reduction input (and gloo all-to-all) a buffer Inductor allocates; returns how many it rewrote."""
    rewritten = 0
    for gather in list(graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default)):
        output = gather.meta["val"]
        if not all(is_concrete_int(size) for size in output.shape):
            continue  # dynamic shapes: no fixed-size buffer to plan
        if gathers_by_send_recv(gather.args[2], output.device):
            _rewrite(graph, gather, fsdp.all_gather_send_recv_.default, *gather.args)
        else:
            _rewrite(graph, gather, c10d.all_gather_into_tensor_out.default, *gather.args)
        rewritten += 1
    for exchange in list(graph.find_nodes(op="call_function", target=c10d.all_to_all_single.default)):
        unsharded_grad, output_split_sizes, _, group_name = exchange.args
        if not (_equal_splits(exchange) and reduces_by_all_to_all(group_name, exchange.meta["val"].device)):
            continue
        world_size = len(output_split_sizes)
        _rewrite(graph, exchange, fsdp.all_to_all_into_.default, unsharded_grad, world_size, group_name)
        rewritten += 1
    for reduction_input in list(graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_input.default)):
        if not is_concrete_int(reduction_input.meta["val"].numel()):
            continue
        insert = NodeInserter(graph, reduction_input, reduction_input)
        unsharded_grads, world_size = reduction_input.args
        buffer = insert(aten.new_empty.default, unsharded_grads[0], [reduction_input.meta["val"].numel()])
        insert(fsdp.reduce_scatter_input_into_.default, buffer, unsharded_grads, world_size)
        reduction_input.replace_all_uses_with(buffer)
        graph.erase_node(reduction_input)
        rewritten += 1
    return rewritten
