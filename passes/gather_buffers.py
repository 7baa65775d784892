"""gather_buffers: all-gathers write into buffers Inductor allocates, so its memory planner reuses them.

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
``compile_shard.ops``); its input needs the same second wait, as its sends read it.

Runs on the partitioned graphs for Inductor only, after ``reorder``: other backends
run the graph eagerly and have no planner to hand buffers to.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from compile_shard.ops import gathers_by_send_recv

from ._graph import NodeInserter, c10d, fsdp

aten = torch.ops.aten


def gather_into_planned_buffers(graph: fx.Graph) -> int:
    """Rewrites each functional all-gather into ``new_empty`` + an out-variant gather; returns how many."""
    rewritten = 0
    for gather in list(graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default)):
        output = gather.meta["val"]
        if not all(is_concrete_int(size) for size in output.shape):
            continue  # dynamic shapes: no fixed-size buffer to plan
        insert = NodeInserter(graph, gather, gather)
        all_gather_input, _, group_name = gather.args
        buffer = insert(aten.new_empty.default, all_gather_input, list(output.shape))
        if gathers_by_send_recv(group_name, output.device):
            insert(fsdp.all_gather_send_recv_.default, buffer, *gather.args)
            waited = buffer
        else:
            waited = insert(c10d.all_gather_into_tensor_out.default, *gather.args, out=buffer)
        waits = list(gather.users)
        gather.replace_all_uses_with(waited)
        graph.erase_node(gather)
        for wait in waits:
            NodeInserter(graph, wait.next, wait)(c10d.wait_tensor.default, all_gather_input)
        rewritten += 1
    return rewritten
