"""gather_buffers: all-gathers, reduction inputs (and gloo's reduction all-to-alls) write into buffers Inductor allocates.

[Note: planned all-gather buffers]
A functional ``all_gather_into_tensor`` allocates its output inside the collective,
out of reach of Inductor's memory planner: every group's gather asks the allocator
for a fresh unsharded-size block. On CPU such a block is a fresh ``mmap`` whose
pages fault on first write, so a copy into it is several times slower than into
reused memory (docs/benchmarks.md). Rewritten as ``new_empty`` plus
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

On gloo, where a group's chain has the shape ``lower`` and ``copy_out`` give it, the
copies around the exchange go too ([Note: gloo exchange in place] in
``compile_shard.ops``): the copy-in, the all-gather and the copy-out become one
``fsdp.all_gather_params_`` from the shards into the buffer the copy-out's
concatenation was, and a reduction input with its all-to-all one
``fsdp.all_to_all_grads_`` from the gradients. Every shard and gradient gets a
second wait, as above: the transfers read them until the wait.

Runs on the partitioned graphs for Inductor only, after ``reorder``: other backends
run the graph eagerly and have no planner to hand buffers to.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from compile_shard.ops import gathers_by_send_recv, reduces_by_all_to_all

from ._graph import VIEWS, NodeInserter, c10d, fsdp
from .patterns import match_copy_out, only_user

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
        _keep_alive(graph, wait, [collective_input])


def _keep_alive(graph: fx.Graph, wait: fx.Node, inputs: list[fx.Node]) -> None:
    """A ``wait_tensor`` on each of ``inputs`` right after ``wait``: Inductor keeps them until the transfer is done."""
    anchor = wait.next
    for read in inputs:
        NodeInserter(graph, anchor, wait)(c10d.wait_tensor.default, read)


# What a lowered copy-in, copy-out or reduction input is made of: erased once nothing reads it.
_COPIES = (
    *VIEWS,
    aten.cat.default,
    fsdp.copy_in.default,
    aten.clone.default,
    aten.split_with_sizes.default,
    operator.getitem,
    fsdp.reduce_scatter_input.default,
)


def _erase_unused(graph: fx.Graph, replaced: list[fx.Node]) -> None:
    """Erases the ``replaced`` nodes, then every copy or view that only they read."""
    stack, erased = list(replaced), set()
    while stack:
        node = stack.pop()
        if node in erased or node.users or not (node in replaced or node.target in _COPIES):
            continue
        inputs = [arg for arg in node.all_input_nodes if arg.op == "call_function"]
        graph.erase_node(node)
        erased.add(node)
        stack.extend(inputs)


def _copied_in_shards(all_gather_input: fx.Node) -> tuple[list[fx.Node], list[int], torch.dtype] | None:
    """The shards a lowered copy-in copies (one ``fsdp.copy_in``, or one shard's flat view), their
    padded numels and the dtype it casts them to; or None."""
    dtype = all_gather_input.meta["val"].dtype
    if all_gather_input.target is fsdp.copy_in.default:
        shards, padded_numels = all_gather_input.args[:2]
    elif all_gather_input.target in VIEWS and all_gather_input.meta["val"].dim() == 1:
        shards, padded_numels = [all_gather_input.args[0]], [all_gather_input.meta["val"].numel()]
    else:
        return None
    if not all(is_concrete_int(numel) for numel in padded_numels):
        return None
    return list(shards), [int(numel) for numel in padded_numels], dtype


def _copied_out_params(wait: fx.Node, padded_numels: list[int], world_size: int) -> tuple[fx.Node, ...] | None:
    """Each parameter's copy in a lowered copy-out (the view of its clone), in gathered order; or None.

    The copy-out views the rank-major buffer ``[world_size, -1]``, splits it into the
    parameters' columns and clones each: parameter ``i``'s copy holds its padded rows
    rank by rank, the ``i``-th segment of what ``all_gather_params_`` fills.
    """
    copy_out = match_copy_out(wait)
    if copy_out is None or len(wait.users) != 1 or copy_out.split.target is not aten.split_with_sizes.default:
        return None
    if list(copy_out.rank_major.meta["val"].shape) != [world_size, sum(padded_numels)]:
        return None
    if list(copy_out.split.args[1]) != padded_numels or len(copy_out.columns) != len(padded_numels):
        return None
    return copy_out.copies


def _gather_params_in_place(graph: fx.Graph, gather: fx.Node) -> bool:
    """A gloo group's copy-in, all-gather and copy-out become ``fsdp.all_gather_params_``; False for another shape."""
    all_gather_input, world_size, group_name = gather.args
    wait = only_user(gather)
    copied_in = _copied_in_shards(all_gather_input)
    if wait is None or wait.target is not c10d.wait_tensor.default or copied_in is None:
        return False
    shards, padded_numels, dtype = copied_in
    copies = _copied_out_params(wait, padded_numels, world_size)
    if copies is None:
        return False
    insert = NodeInserter(graph, gather, gather)
    # Mixed precision: the exchange sends each shard cast to the all-gather's dtype.
    shards = [
        shard if shard.meta["val"].dtype == dtype else insert(torch.ops.prims.convert_element_type.default, shard, dtype)
        for shard in shards
    ]
    unsharded_params = insert(aten.new_empty.default, shards[0], [world_size * sum(padded_numels)])
    insert(fsdp.all_gather_params_.default, unsharded_params, shards, padded_numels, world_size, group_name)
    wait.replace_input_with(gather, unsharded_params)
    concatenated = only_user(copies[0])
    if concatenated is not None and concatenated.target is aten.cat.default and tuple(concatenated.args[0]) == copies:
        concatenated.replace_all_uses_with(wait)  # the copy_out pass's concatenation: the same layout
        replaced = [gather, concatenated]
    else:
        replaced = [gather, *copies]
        insert = NodeInserter(graph, wait.next, wait)
        offset = 0
        for copy, padded_numel in zip(copies, padded_numels):
            segment = insert(aten.slice.Tensor, wait, 0, offset, offset + world_size * padded_numel)
            copy.replace_all_uses_with(insert(aten.view.default, segment, list(copy.meta["val"].shape)))
            offset += world_size * padded_numel
    _keep_alive(graph, wait, shards)
    _erase_unused(graph, replaced)
    return True


def _exchange_grads_in_place(graph: fx.Graph, exchange: fx.Node) -> bool:
    """A gloo reduction input and its all-to-all become ``fsdp.all_to_all_grads_``; False for another shape."""
    unsharded_grad, _, _, group_name = exchange.args
    reduction_input = unsharded_grad
    if reduction_input.target in VIEWS and len(reduction_input.users) == 1:
        reduction_input = reduction_input.args[0]
    wait = only_user(exchange)
    if (
        reduction_input.target is not fsdp.reduce_scatter_input.default
        or len(reduction_input.users) != 1
        or wait is None
        or wait.target is not c10d.wait_tensor.default
    ):
        return False
    unsharded_grads, world_size = reduction_input.args[:2]
    if reduction_input.meta["val"].dtype != unsharded_grads[0].meta["val"].dtype:
        return False  # a mixed-precision reduction's cast: the exchange sends the cast buffer
    insert = NodeInserter(graph, exchange, exchange)
    received = insert(aten.new_empty.default, unsharded_grads[0], list(exchange.meta["val"].shape))
    insert(fsdp.all_to_all_grads_.default, received, unsharded_grads, world_size, group_name)
    wait.replace_input_with(exchange, received)
    _keep_alive(graph, wait, list(unsharded_grads))
    _erase_unused(graph, [exchange])
    return True


def gather_buffers(graph: fx.Graph) -> int:
    """Gives each all-gather, reduction input (and gloo all-to-all) a buffer Inductor allocates; returns how many it rewrote."""
    rewritten = 0
    for gather in list(graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default)):
        output = gather.meta["val"]
        if not all(is_concrete_int(size) for size in output.shape):
            continue  # dynamic shapes: no fixed-size buffer to plan
        if gathers_by_send_recv(gather.args[2], output.device):
            if not _gather_params_in_place(graph, gather):
                _rewrite(graph, gather, fsdp.all_gather_send_recv_.default, *gather.args)
        else:
            _rewrite(graph, gather, c10d.all_gather_into_tensor_out.default, *gather.args)
        rewritten += 1
    for exchange in list(graph.find_nodes(op="call_function", target=c10d.all_to_all_single.default)):
        unsharded_grad, output_split_sizes, _, group_name = exchange.args
        if not (_equal_splits(exchange) and reduces_by_all_to_all(group_name, exchange.meta["val"].device)):
            continue
        world_size = len(output_split_sizes)
        if not _exchange_grads_in_place(graph, exchange):
            _rewrite(graph, exchange, fsdp.all_to_all_into_.default, unsharded_grad, world_size, group_name)
        rewritten += 1
    for reduction_input in list(graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_input.default)):
        if not is_concrete_int(reduction_input.meta["val"].numel()):
            continue
        insert = NodeInserter(graph, reduction_input, reduction_input)
        unsharded_grads, world_size = reduction_input.args[:2]
        value = reduction_input.meta["val"]
        buffer = insert(aten.new_empty.default, unsharded_grads[0], [value.numel()], dtype=value.dtype)
        insert(fsdp.reduce_scatter_input_into_.default, buffer, unsharded_grads, world_size)
        reduction_input.replace_all_uses_with(buffer)
        graph.erase_node(reduction_input)
        rewritten += 1
    return rewritten
