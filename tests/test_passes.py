"""Each pass on small hand-built graphs, including graphs where it must do nothing."""

import importlib
import operator
import warnings

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from compile_shard._annotation import GroupAnnotation, group_annotation, write_group_annotation
from compile_shard.passes import (
    GraphInvariantError,
    lower,
    refunctionalize,
    reshard,
    unused_params,
    verify,
    verify_forward,
)
from compile_shard.passes.patterns import only_user
from graph_utils import annotate_group, c10d, fsdp, make_annotation, op_counts, trace

aten = torch.ops.aten
invoke_subgraph = torch.ops.higher_order.invoke_subgraph
WORLD, GROUP = 2, "0"


def _gather_and_use(shard_w, shard_b, x):
    """A group of two parameters: all-gather, copy-out, compute."""
    gathered = torch.ops.fsdp.all_gather_into([shard_w, shard_b], [12, 2], WORLD, GROUP)
    per_rank_w, per_rank_b = gathered.view(WORLD, -1).split([12, 2], dim=1)
    weight = per_rank_w.reshape(-1, 4)[:5]
    bias = per_rank_b.reshape(-1)[:3]
    return x @ weight.t()[:, :3] + bias


def _shards():
    """This rank's uneven shards: 2 of 3 padded rows of the weight, 1 of 2 bias entries."""
    return torch.randn(2, 4), torch.randn(1), torch.randn(2, 4)


def _code(graph_module):
    graph_module.recompile()
    return graph_module.code


# refunctionalize -------------------------------------------------------------------


def test_refunctionalize_removes_resize_and_copy_into_resized_storage():
    def fn(unsharded, gathered, x):
        torch.ops.fsdp.resize_storage_(unsharded, 64)
        unsharded.copy_(gathered)
        out = x @ unsharded
        torch.ops.fsdp.resize_storage_(unsharded, 0)
        return out

    graph_module = trace(fn, torch.randn(4, 4), torch.randn(4, 4), torch.randn(2, 4))
    assert refunctionalize(graph_module.graph) == 3
    unsharded, gathered, x = graph_module.graph.find_nodes(op="placeholder")
    (matmul,) = [n for n in graph_module.graph.nodes if n.target is aten.mm.default]
    assert matmul.args == (x, gathered)
    assert not unsharded.users
    verify(graph_module.graph)


def test_refunctionalize_rewrites_readers_after_set_():
    def fn(param, gathered):
        before = param.sum()
        torch.ops.fsdp.set_(param, gathered)
        return before, param * 2

    graph_module = trace(fn, torch.randn(4), torch.randn(4))
    assert refunctionalize(graph_module.graph) == 1
    param, gathered = graph_module.graph.find_nodes(op="placeholder")
    (total,) = [n for n in graph_module.graph.nodes if n.target is aten.sum.default]
    (double,) = [n for n in graph_module.graph.nodes if n.target is aten.mul.Tensor]
    assert total.args[0] is param and double.args[0] is gathered


def test_refunctionalize_leaves_functional_graphs_and_plain_copies_alone():
    def fn(buffer, update):
        buffer.copy_(update)  # an input mutation AOTAutograd keeps: not ours to remove
        return buffer + 1

    graph_module = trace(fn, torch.randn(4), torch.randn(4))
    before = _code(graph_module)
    assert refunctionalize(graph_module.graph) == 0
    assert _code(graph_module) == before


# reshard ---------------------------------------------------------------------------


def _chain_targets():
    return {
        fsdp.all_gather_into.default,
        aten.view.default,
        aten.split_with_sizes.default,
        operator.getitem,
        aten.clone.default,
        aten._unsafe_view.default,
        aten.slice.Tensor,
        aten.t.default,  # a view of the unsharded parameter, e.g. in F.linear
    }


def test_reshard_true_tags_gather_and_copy_out_chain_for_recompute():
    graph_module = trace(_gather_and_use, *_shards())
    annotate_group(graph_module.graph, "blocks.0", reshard_after_forward=True)
    assert reshard(graph_module.graph) == 1
    tagged = {n for n in graph_module.graph.nodes if n.meta.get("recompute") is CheckpointPolicy.MUST_RECOMPUTE}
    assert {n.target for n in tagged} <= _chain_targets()
    assert any(n.target is fsdp.all_gather_into.default for n in tagged)
    assert any(n.target is aten.slice.Tensor for n in tagged)  # the end of the copy-out chain
    compute = [n for n in graph_module.graph.nodes if n.target in (aten.mm.default, aten.add.Tensor)]
    assert compute and not any("recompute" in n.meta for n in compute)
    assert len({n.meta["ac_graph_id"] for n in tagged}) == 1


def test_reshard_false_saves_the_gather_and_drops_checkpoint_tags():
    graph_module = trace(_gather_and_use, *_shards())
    annotate_group(graph_module.graph, "root", reshard_after_forward=False)
    for node in graph_module.graph.nodes:
        node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE  # as inside a checkpoint region
    reshard(graph_module.graph)
    (gather,) = graph_module.graph.find_nodes(op="call_function", target=fsdp.all_gather_into.default)
    assert gather.meta["recompute"] is CheckpointPolicy.MUST_SAVE
    chain = [n for n in graph_module.graph.nodes if n.target is aten.slice.Tensor]
    assert chain and not any("recompute" in n.meta for n in chain)


def test_reshard_ignores_unannotated_gathers():
    graph_module = trace(_gather_and_use, *_shards())
    assert reshard(graph_module.graph) == 0
    assert not any("recompute" in n.meta for n in graph_module.graph.nodes)


def _gather_use_and_differentiate(shard_w, shard_b, x, tangents_1):
    """``_gather_and_use`` and the input's gradient, which reads the weight again: a joint graph's two halves."""
    gathered = torch.ops.fsdp.all_gather_into([shard_w, shard_b], [12, 2], WORLD, GROUP)
    per_rank_w, per_rank_b = gathered.view(WORLD, -1).split([12, 2], dim=1)
    weight = per_rank_w.reshape(-1, 4)[:5]
    bias = per_rank_b.reshape(-1)[:3]
    return x @ weight.t()[:, :3] + bias, tangents_1 @ weight[:3]


def _smaller_group_joint(prefer_recompute=False):
    graph_module = trace(_gather_use_and_differentiate, *_shards(), torch.randn(2, 3))
    annotation = GroupAnnotation("blocks.0", True, ("blocks.0",), ("blocks.0",), reshard_group=(2, 1, "7"))
    (gather,) = graph_module.graph.find_nodes(op="call_function", target=fsdp.all_gather_into.default)
    write_group_annotation(gather, annotation)
    if prefer_recompute:  # as inside an activation checkpoint region
        for node in graph_module.graph.nodes:
            if node.target is aten.mm.default:
                node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    return graph_module


def test_reshard_to_a_smaller_group_gathers_a_saved_chunk_in_backward():
    """[Note: resharding to a smaller group]: forward keeps a chunk, backward gathers it over 2 ranks."""
    graph_module = _smaller_group_joint()
    graph = graph_module.graph
    assert reshard(graph) == 1
    verify(graph)
    forward_gather, backward_gather = graph.find_nodes(op="call_function", target=fsdp.all_gather_into.default)
    (chunk,) = backward_gather.args[0]
    assert chunk.target is fsdp.post_forward_chunk.default and chunk.args == (forward_gather, 2, 1)
    assert chunk.meta["recompute"] is CheckpointPolicy.MUST_SAVE
    assert backward_gather.args[1:4] == ([14], 2, "7")  # half of the 28 gathered elements, over 2 ranks
    assert backward_gather.meta["recompute"] is CheckpointPolicy.MUST_RECOMPUTE
    forward_mm, backward_mm = [n for n in graph.nodes if n.target is aten.mm.default]
    assert forward_mm.meta["recompute"] is CheckpointPolicy.MUST_SAVE  # saved, not recomputed from a whole gather
    with_chunk = next(user for user in forward_gather.users if user.target is aten.slice_scatter.default)
    assert with_chunk.args[1] is chunk  # the forward reads the chunk, so the partitioner saves it
    assert backward_gather in _ancestors(backward_mm) and backward_gather not in _ancestors(forward_mm)


def _ancestors(node):
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        ancestor = stack.pop()
        if ancestor not in seen:
            seen.add(ancestor)
            stack.extend(ancestor.all_input_nodes)
    return seen


@pytest.mark.parametrize("case", ["checkpointed", "no_backward_reader"])
def test_reshard_to_a_smaller_group_leaves_graphs_that_gather_over_the_whole_group_anyway(case):
    if case == "checkpointed":
        graph_module = _smaller_group_joint(prefer_recompute=True)
    else:
        graph_module = trace(_gather_and_use, *_shards())
        (gather,) = graph_module.graph.find_nodes(op="call_function", target=fsdp.all_gather_into.default)
        write_group_annotation(gather, GroupAnnotation("b", True, ("b",), ("b",), reshard_group=(2, 1, "7")))
    assert reshard(graph_module.graph) == 1
    assert len(graph_module.graph.find_nodes(op="call_function", target=fsdp.all_gather_into.default)) == 1
    assert not graph_module.graph.find_nodes(op="call_function", target=fsdp.post_forward_chunk.default)


# lower -----------------------------------------------------------------------------


def test_lower_all_gather_into_c10d_with_copy_in():
    graph_module = trace(_gather_and_use, *_shards())
    annotate_group(graph_module.graph, "blocks.0", reshard_after_forward=True)
    reshard(graph_module.graph)
    assert lower(graph_module.graph) == 1
    assert op_counts(graph_module.graph) == {"all_gather": 1, "wait": 1}
    (gather,) = graph_module.graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default)
    (copy_in,) = gather.args[:1]
    # [Note: the copy-in as one op]: the shards and their padded numels (the uneven bias shard is padded).
    assert copy_in.target is fsdp.copy_in.default and gather.args[1:] == (WORLD, GROUP)
    shard_w, shard_b, _ = graph_module.graph.find_nodes(op="placeholder")
    assert copy_in.args == ([shard_w, shard_b], [12, 2], None)
    assert not graph_module.graph.find_nodes(op="call_function", target=aten.cat.default)
    # The lowered chain keeps the group's annotation and recompute tag.
    for node in (gather, copy_in, next(iter(gather.users))):
        assert node.meta["recompute"] is CheckpointPolicy.MUST_RECOMPUTE
        assert group_annotation(node).name == "blocks.0"
    verify(graph_module.graph)


def test_lower_saved_gather_saves_only_the_wait():
    graph_module = trace(_gather_and_use, *_shards())
    annotate_group(graph_module.graph, "root", reshard_after_forward=False)
    reshard(graph_module.graph)
    lower(graph_module.graph)
    (gather,) = graph_module.graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default)
    (wait,) = gather.users
    assert wait.meta["recompute"] is CheckpointPolicy.MUST_SAVE
    assert "recompute" not in gather.meta and "recompute" not in gather.args[0].meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_a_single_shard_that_needs_no_copy_to_its_flat_view(dtype):
    """No copy-in for a group of one even shard in its own dtype; mixed precision's cast is one."""

    def fn(shard, x):
        gathered = torch.ops.fsdp.all_gather_into([shard], [8], WORLD, GROUP, param_dtype=dtype)
        return x @ gathered.view(-1, 4).to(x.dtype).t()

    graph_module = trace(fn, torch.randn(2, 4), torch.randn(3, 4))
    annotate_group(graph_module.graph, "blocks.0", reshard_after_forward=True)
    assert lower(graph_module.graph) == 1
    (gather,) = graph_module.graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default)
    (shard, _) = graph_module.graph.find_nodes(op="placeholder")
    if dtype == torch.float32:
        assert gather.args[0].target is aten.reshape.default and gather.args[0].args == (shard, [-1])
    else:
        assert gather.args[0].target is fsdp.copy_in.default and gather.args[0].args == ([shard], [8], dtype)
    verify(graph_module.graph)


def test_lower_a_group_of_one_rank_to_its_copy_in_without_a_collective():
    """[Note: a group of one rank]: the gathered parameters are the copy-in, saved when the group keeps them."""

    def fn(shard_w, shard_b, x):
        gathered = torch.ops.fsdp.all_gather_into([shard_w, shard_b], [12, 2], 1, GROUP)
        weight, bias = gathered.split([12, 2])
        return x @ weight.reshape(3, 4)[:, :3].t() + bias[:1]

    graph_module = trace(fn, torch.randn(2, 4), torch.randn(1), torch.randn(2, 3))
    annotate_group(graph_module.graph, "root", reshard_after_forward=False)
    reshard(graph_module.graph)
    assert lower(graph_module.graph) == 1
    assert op_counts(graph_module.graph) == {}
    (copy_in,) = graph_module.graph.find_nodes(op="call_function", target=fsdp.copy_in.default)
    assert copy_in.meta["recompute"] is CheckpointPolicy.MUST_SAVE
    shards = (torch.randn(2, 4), torch.randn(1), torch.randn(2, 3))
    torch.testing.assert_close(graph_module(*shards), fn(*shards), rtol=0, atol=0)
    verify(graph_module.graph)


@pytest.mark.parametrize("reduce_op", ["avg", "sum"])
def test_lower_reduce_scatter_over_one_rank_to_its_input(reduce_op):
    def fn(grad):
        return torch.ops.fsdp.reduce_scatter_grad(grad, 1, GROUP, reduce_op)

    graph_module = trace(fn, torch.randn(2, 4))
    assert lower(graph_module.graph) == 1
    assert op_counts(graph_module.graph) == {}
    (output,) = graph_module.graph.find_nodes(op="output")[0].all_input_nodes
    assert output.target is aten.reshape.default and output.args[1] == [-1]
    grad = torch.randn(2, 4)
    torch.testing.assert_close(graph_module(grad), grad.reshape(-1), rtol=0, atol=0)


@pytest.mark.parametrize("reduce_op", ["avg", "sum"])
def test_lower_reduce_scatter_reduces_with_fsdp2s_op_and_divides_nothing_after(reduce_op):
    def fn(grad):
        return torch.ops.fsdp.reduce_scatter_grad(grad, WORLD, GROUP, reduce_op)

    graph_module = trace(fn, torch.randn(8))
    assert lower(graph_module.graph) == 1
    assert op_counts(graph_module.graph) == {"reduce_scatter": 1, "wait": 1}
    (scatter,) = graph_module.graph.find_nodes(op="call_function", target=c10d.reduce_scatter_tensor.default)
    assert scatter.args[1:] == (reduce_op, WORLD, GROUP)
    (wait,) = scatter.users
    assert graph_module.graph.find_nodes(op="output")[0].all_input_nodes == [wait]


@pytest.mark.parametrize("reduce_op", ["avg", "sum"])
def test_lower_reduce_scatter_on_gloo_exchanges_shards_and_sums_them(reduce_op, monkeypatch):
    monkeypatch.setattr(importlib.import_module("compile_shard.passes.lower"), "reduces_by_all_to_all", lambda *_: True)

    def fn(grad):
        return torch.ops.fsdp.reduce_scatter_grad(grad, 3, GROUP, reduce_op)

    graph_module = trace(fn, torch.randn(2, 6))
    assert lower(graph_module.graph) == 1
    assert op_counts(graph_module.graph) == {"all_to_all": 1, "wait": 1, "fsdp.sum_shards": 1}
    (exchange,) = graph_module.graph.find_nodes(op="call_function", target=c10d.all_to_all_single.default)
    assert exchange.args[0].target is aten.reshape.default  # a 2-D gradient is flattened first
    assert exchange.args[1:] == ([4, 4, 4], [4, 4, 4], GROUP)
    (wait,) = exchange.users
    (total,) = wait.users
    # One opaque op after the wait, the division included: see [Note: gloo reduce-scatter].
    assert total.target is fsdp.sum_shards.default and total.args == (wait, 3, reduce_op)
    assert total.meta["val"].shape == (4,)
    assert graph_module.graph.find_nodes(op="output")[0].all_input_nodes == [total]
    verify(graph_module.graph)


def _autograd_padding(gradient, rows, value=0.0):
    return aten.slice_backward(gradient, [rows, *gradient.shape[1:]], 0, 0, gradient.size(0), 1)


def _decomposed_padding(gradient, rows, value=0.0):
    """``slice_backward`` as Inductor's decompositions trace it."""
    return aten.slice_scatter(aten.full([rows, *gradient.shape[1:]], value), gradient, 0, 0, gradient.size(0))


def _reduction_input(padded, world_size=WORLD, pad=_autograd_padding):
    """What autograd builds for a group's reduction input: each gradient padded, viewed rank-major, concatenated."""
    pieces = []
    for gradient, rows in padded:
        if rows != gradient.size(0):
            gradient = pad(gradient, rows)
        pieces.append(gradient.view(world_size, -1))
    return torch.cat(pieces, 1).view(-1)


def _uneven_group_input(weight_grad, bias_grad, pad=_autograd_padding):
    """The uneven group of ``_gather_and_use``: a [5, 4] weight padded to 6 rows, a [3] bias padded to 4."""
    return _reduction_input([(weight_grad, 6), (bias_grad, 4)], pad=pad)


def _bucket_input(weight_grad, bias_grad, other_grad, pad=_autograd_padding):
    """``bucket``'s merged input: two groups' reduction inputs, concatenated rank-major once more."""
    first = _uneven_group_input(weight_grad, bias_grad, pad=pad)
    second = _reduction_input([(other_grad, 4)], pad=pad)
    return torch.cat([first.view(WORLD, -1), second.view(WORLD, -1)], 1).view(-1)


@pytest.mark.parametrize("pad", [_autograd_padding, _decomposed_padding], ids=["autograd", "decomposed"])
@pytest.mark.parametrize(
    "reduction_input, shapes",
    [(_uneven_group_input, [(5, 4), (3,)]), (_bucket_input, [(5, 4), (3,), (4, 2)])],
    ids=["group", "bucket"],
)
def test_lower_replaces_autograds_padding_and_concatenation_with_one_reduction_input(reduction_input, shapes, pad):
    def fn(*gradients):
        return torch.ops.fsdp.reduce_scatter_grad(reduction_input(*gradients, pad=pad), WORLD, GROUP)

    gradients = [torch.randn(shape) for shape in shapes]
    graph_module = trace(fn, *gradients)
    lower(graph_module.graph)
    (replacement,) = graph_module.graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_input.default)
    assert replacement.args == (graph_module.graph.find_nodes(op="placeholder"), WORLD)
    (scatter,) = graph_module.graph.find_nodes(op="call_function", target=c10d.reduce_scatter_tensor.default)
    assert scatter.args[0] is replacement
    # Autograd's padding, views and concatenations are gone: no kernel will fuse their pieces.
    padding = (aten.cat.default, aten.slice_backward.default, aten.slice_scatter.default, aten.full.default)
    assert not [n for n in graph_module.graph.nodes if n.target in padding]
    assert torch.equal(torch.ops.fsdp.reduce_scatter_input(gradients, WORLD), reduction_input(*gradients))
    verify(graph_module.graph)


def test_lower_casts_the_shards_in_the_copy_in_under_mixed_precision():
    def fn(shard_w, shard_b, x):
        gathered = torch.ops.fsdp.all_gather_into(
            [shard_w, shard_b], [12, 2], WORLD, GROUP, param_dtype=torch.bfloat16
        )
        return gathered.float().sum() + x.sum()

    graph_module = trace(fn, *_shards())
    lower(graph_module.graph)
    (gather,) = graph_module.graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default)
    assert gather.meta["val"].dtype == torch.bfloat16
    shards = graph_module.graph.find_nodes(op="placeholder")[:2]
    assert gather.args[0].target is fsdp.copy_in.default
    assert gather.args[0].args == (shards, [12, 2], torch.bfloat16)
    verify(graph_module.graph)


def test_lower_lays_out_a_cast_reduction_input_in_the_reduction_dtype():
    """A bf16 group reduced in fp32: the cast moves into the reduction input ([Note: mixed-precision reduction])."""

    def fn(weight_grad, bias_grad):
        flat = _uneven_group_input(weight_grad, bias_grad).to(torch.float32)
        return torch.ops.fsdp.reduce_scatter_grad(flat, WORLD, GROUP)

    gradients = [torch.randn(5, 4, dtype=torch.bfloat16), torch.randn(3, dtype=torch.bfloat16)]
    graph_module = trace(fn, *gradients)
    lower(graph_module.graph)
    (replacement,) = graph_module.graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_input.default)
    assert replacement.args == (graph_module.graph.find_nodes(op="placeholder"), WORLD, torch.float32)
    assert replacement.meta["val"].dtype == torch.float32
    assert not [n for n in graph_module.graph.nodes if n.target in (aten._to_copy.default, aten.cat.default)]
    expected = _uneven_group_input(*gradients).to(torch.float32)
    assert torch.equal(torch.ops.fsdp.reduce_scatter_input(gradients, WORLD, torch.float32), expected)
    verify(graph_module.graph)


def test_lower_keeps_a_reduction_input_that_is_not_rank_major_padding():
    def fn(weight_grad, bias_grad):
        # Rows padded in front, not at the end: not the copy-out's layout.
        padded = aten.slice_backward(weight_grad, [6, 4], 0, 1, 6, 1)
        flat = torch.cat([padded.view(WORLD, -1), bias_grad.view(WORLD, -1)], 1).view(-1)
        return torch.ops.fsdp.reduce_scatter_grad(flat, WORLD, GROUP)

    graph_module = trace(fn, torch.randn(5, 4), torch.randn(4))
    lower(graph_module.graph)
    assert not graph_module.graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_input.default)
    (scatter,) = graph_module.graph.find_nodes(op="call_function", target=c10d.reduce_scatter_tensor.default)
    assert scatter.args[0].target is aten.view.default and scatter.args[0].args[0].target is aten.cat.default


def test_lower_keeps_a_slice_scatter_into_nonzero_rows_as_the_gradient():
    def fn(weight_grad, bias_grad):
        padded = _decomposed_padding(weight_grad, 6, value=1.0)  # not padding: the extra row holds ones
        flat = torch.cat([padded.view(WORLD, -1), bias_grad.view(WORLD, -1)], 1).view(-1)
        return torch.ops.fsdp.reduce_scatter_grad(flat, WORLD, GROUP)

    graph_module = trace(fn, torch.randn(5, 4), torch.randn(4))
    lower(graph_module.graph)
    (replacement,) = graph_module.graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_input.default)
    (padded, bias_grad) = replacement.args[0]
    assert padded.target is aten.slice_scatter.default and bias_grad.op == "placeholder"


def test_lower_gives_a_custom_comm_its_own_collectives_each_with_a_wait():
    """[Note: custom collectives]: the comm's ops replace the c10d collectives; the comm averages, no division."""

    def fn(shard_w, shard_b, grad):
        gathered = torch.ops.fsdp.all_gather_into([shard_w, shard_b], [12, 2], WORLD, GROUP, all_gather_comm="ag")
        return gathered, torch.ops.fsdp.reduce_scatter_grad(grad, WORLD, GROUP, "avg", "rs")

    graph_module = trace(fn, torch.randn(2, 4), torch.randn(1), torch.randn(28))
    annotate_group(graph_module.graph, "blocks.0", reshard_after_forward=True)
    assert lower(graph_module.graph) == 2
    assert op_counts(graph_module.graph) == {
        "fsdp.all_gather_with_comm": 1,
        "fsdp.reduce_scatter_with_comm": 1,
        "wait": 2,
    }
    (gather,) = graph_module.graph.find_nodes(op="call_function", target=fsdp.all_gather_with_comm.default)
    assert gather.args[0].target is fsdp.copy_in.default and gather.args[1:] == (WORLD, GROUP, "ag")
    (scatter,) = graph_module.graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_with_comm.default)
    assert scatter.args[1:] == (WORLD, GROUP, "avg", "rs")
    assert not graph_module.graph.find_nodes(op="call_function", target=aten.div.Tensor)
    verify(graph_module.graph)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float32], ids=["float8", "float32"])
def test_lower_gathers_float8_as_bytes_where_gloo_refuses_float8(dtype, monkeypatch):
    """``gathers_as_bytes``: on gloo a float8 all-gather moves its bytes as uint8 views; other dtypes go as they are."""
    lower_module = importlib.import_module("compile_shard.passes.lower")
    monkeypatch.setattr(lower_module, "gathers_as_bytes", lambda dtype, *_: dtype == torch.float8_e4m3fn)

    def fn(shard):
        return torch.ops.fsdp.all_gather_into([shard], [8], WORLD, GROUP)

    graph_module = trace(fn, torch.randn(2, 4).to(dtype))
    annotate_group(graph_module.graph, "blocks.0", reshard_after_forward=True)
    assert lower(graph_module.graph) == 1
    (gather,) = graph_module.graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default)
    (output,) = graph_module.graph.find_nodes(op="output")[0].all_input_nodes
    as_bytes = dtype == torch.float8_e4m3fn
    assert (gather.args[0].target is aten.view.dtype) == as_bytes
    assert gather.meta["val"].dtype == (torch.uint8 if as_bytes else dtype) and output.meta["val"].dtype == dtype
    verify(graph_module.graph)


def test_lower_leaves_graphs_without_fsdp_ops_alone():
    graph_module = trace(lambda x: x.sin() + 1, torch.randn(4))
    before = _code(graph_module)
    assert lower(graph_module.graph) == 0
    assert _code(graph_module) == before


def _gloo_lowering_computes_the_same(rank, world_size):
    import torch.distributed as dist

    group_name = dist.group.WORLD.group_name

    def fn(shard, grad):
        gathered = torch.ops.fsdp.all_gather_into([shard], [6], world_size, group_name)
        return gathered, torch.ops.fsdp.reduce_scatter_grad(grad, world_size, group_name, "avg")

    shard, grad = torch.randn(min(rank + 1, 2), 3), torch.randn(world_size * 4) * (rank + 1)  # uneven shards
    graph_module = make_fx_real(fn, shard, grad)
    expected = graph_module(shard, grad)
    lower(graph_module.graph)
    graph_module.recompile()
    actual = graph_module(shard, grad)
    # gloo has no reduce-scatter of its own: the lowering exchanges shards and adds them ([Note: gloo reduce-scatter]).
    assert op_counts(graph_module.graph) == {"all_gather": 1, "all_to_all": 1, "wait": 2, "fsdp.sum_shards": 1}
    for a, e in zip(actual, expected):  # eager and lowered reductions share fsdp.sum_shards
        assert torch.equal(a, e)
    by_gloo = torch.empty(4)
    dist.reduce_scatter_tensor(by_gloo, grad)
    torch.testing.assert_close(actual[1], by_gloo / world_size, rtol=0, atol=1e-6)


def make_fx_real(fn, *args):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="real")(*args)


@pytest.mark.parametrize("world_size", [2, 3])
def test_lowered_graph_computes_what_the_fsdp_ops_compute(world_size):
    from dist_utils import run_gloo

    run_gloo(_gloo_lowering_computes_the_same, world_size)


# unused_params ---------------------------------------------------------------------


def _group_backward(weight_piece, bias_piece, accumulated_grad=None, partial_reduce_output=None):
    """What the all-gather's backward traces for ``_gather_and_use``'s group: reduce, split into shard gradients."""
    unsharded_grad = torch.cat([weight_piece, bias_piece], 1).view(-1)
    if accumulated_grad is not None:
        unsharded_grad = unsharded_grad + accumulated_grad
    sharded_grad = torch.ops.fsdp.reduce_scatter_grad(unsharded_grad, WORLD, GROUP)
    if partial_reduce_output is not None:  # HSDP's, accumulated without the all-reduce
        sharded_grad = sharded_grad + partial_reduce_output
    sharded_grad = sharded_grad / 2
    weight_grad, bias_grad = sharded_grad.split([12, 2])
    return weight_grad[:8].view(2, 4), bias_grad[:1].view(1)


def _unused_bias_joint(annotation=make_annotation("block"), accumulated=None):
    """The bias unused: autograd's zeros for its rank-major piece of the reduction input.

    ``accumulated``: the gradient an earlier backward left, ``"accumulated_grad"`` or ``"partial_reduce_output"``.
    """

    def fn(weight_grad, *earlier):
        bias_piece = torch.zeros(WORLD, 2)
        return _group_backward(weight_grad.view(WORLD, -1), bias_piece, **dict(zip([accumulated], earlier)))

    numel = {None: 0, "accumulated_grad": WORLD * 14, "partial_reduce_output": 14}[accumulated]
    inputs = (torch.randn(6, 4), *([torch.randn(numel)] if accumulated else []))
    graph_module = trace(fn, *inputs)
    if annotation is not None:
        (reduction,) = graph_module.graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_grad.default)
        write_group_annotation(reduction, annotation)
    return graph_module


def _every_parameter_used(weight_grad, bias_grad):
    return _group_backward(weight_grad.view(WORLD, -1), bias_grad.view(WORLD, -1))


def _outputs(graph_module):
    return graph_module.graph.output_node().args[0]


def test_unused_params_gives_an_unused_parameter_no_gradient():
    graph_module = _unused_bias_joint()
    weight_grad = _outputs(graph_module)[0]
    assert unused_params(graph_module.graph) == 1
    assert _outputs(graph_module) == (weight_grad, None)
    assert not graph_module.graph.find_nodes(op="call_function", target=aten.slice.Tensor)[1:]
    verify(graph_module.graph)


@pytest.mark.parametrize(
    "joint",
    [
        lambda: _unused_bias_joint(make_annotation("block", reduce_scatter_unused_params=True)),
        lambda: _unused_bias_joint(annotation=None),
        lambda: _unused_bias_joint(accumulated="accumulated_grad"),
        lambda: _unused_bias_joint(accumulated="partial_reduce_output"),
        lambda: trace(_every_parameter_used, torch.randn(6, 4), torch.randn(4)),
    ],
    ids=[
        "reduce_scatter_unused_params",
        "unannotated",
        "accumulated_without_sync",
        "accumulated_without_the_all_reduce",
        "every_parameter_used",
    ],
)
def test_unused_params_leaves_gradients_that_may_be_nonzero_or_were_asked_for(joint):
    graph_module = joint()
    before = _code(graph_module)
    assert unused_params(graph_module.graph) == 0
    assert _code(graph_module) == before and None not in _outputs(graph_module)


def _region_backward_joint(bias_used: bool):
    """A block's region returns the gradient of its all-gather output, laid out inside as ``fsdp.copy_out``'s
    backward does (an unused parameter's piece: zeros, viewed); the outer graph reduces it."""

    def body(weight_grad, bias_grad):
        bias_piece = bias_grad.view(WORLD, -1) if bias_used else torch.zeros(WORLD * 2).view(WORLD, 2)
        return (torch.cat([weight_grad.view(WORLD, -1), bias_piece], 1).view(-1),)

    def reduction(unsharded_grad):
        sharded_grad = torch.ops.fsdp.reduce_scatter_grad(unsharded_grad, WORLD, GROUP) / 2
        weight_grad, bias_grad = sharded_grad.split([12, 2])
        return weight_grad[:8].view(2, 4), bias_grad[:1].view(1)

    graph_module = trace(reduction, torch.randn(WORLD * 14))
    graph_module.region = trace(body, torch.randn(6, 4), torch.randn(4))
    graph = graph_module.graph
    (unsharded_grad,) = graph.find_nodes(op="placeholder")
    with graph.inserting_after(unsharded_grad):
        weight_grad, bias_grad = graph.placeholder("weight_grad"), graph.placeholder("bias_grad")
    with graph.inserting_before(next(iter(unsharded_grad.users))):
        call = graph.call_function(
            torch.ops.higher_order.invoke_subgraph, (graph.get_attr("region"), "region", weight_grad, bias_grad)
        )
        unsharded_grad.replace_all_uses_with(graph.call_function(operator.getitem, (call, 0)))
    graph.erase_node(unsharded_grad)
    (reduction_node,) = graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_grad.default)
    write_group_annotation(reduction_node, make_annotation("block"))
    return graph_module


@pytest.mark.parametrize("bias_used", [False, True])
def test_unused_params_reads_the_reduction_input_inside_a_regions_backward(bias_used):
    graph_module = _region_backward_joint(bias_used)
    weight_grad = _outputs(graph_module)[0]
    assert unused_params(graph_module.graph) == (0 if bias_used else 1)
    assert (_outputs(graph_module)[1] is None) != bias_used and _outputs(graph_module)[0] is weight_grad
    graph_module.graph.lint()


def _as_gathered_backward(weight_grad, bias_grad):
    """``fsdp.as_gathered``'s backward for the same group: the unsharded gradients into ``reduce_scatter_input``."""
    unsharded_grad = torch.ops.fsdp.reduce_scatter_input([weight_grad, bias_grad], WORLD)
    weight_shard_grad, bias_shard_grad = (torch.ops.fsdp.reduce_scatter_grad(unsharded_grad, WORLD, GROUP) / 2).split(
        [12, 2]
    )
    return weight_shard_grad[:8].view(2, 4), bias_shard_grad[:1].view(1)


@pytest.mark.parametrize("bias_used", [False, True])
def test_unused_params_reads_the_reduction_input_of_as_gathered(bias_used):
    def fn(weight_grad, bias_grad):
        return _as_gathered_backward(weight_grad, bias_grad if bias_used else torch.zeros(3))

    graph_module = trace(fn, torch.randn(5, 4), torch.randn(3))
    (reduction,) = graph_module.graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_grad.default)
    write_group_annotation(reduction, make_annotation("block"))
    weight_grad = _outputs(graph_module)[0]
    assert unused_params(graph_module.graph) == (0 if bias_used else 1)
    assert _outputs(graph_module)[0] is weight_grad and (_outputs(graph_module)[1] is None) != bias_used
    verify(graph_module.graph)


# copy_out --------------------------------------------------------------------------


def _on_gloo(monkeypatch, on_gloo=True):
    copy_out_module = importlib.import_module("compile_shard.passes.copy_out")
    monkeypatch.setattr(copy_out_module, "gathers_by_send_recv", lambda *_: on_gloo)


def test_copy_out_makes_the_copies_one_fsdp_copy_out():
    from compile_shard.passes import copy_out

    graph_module = _lowered_graph()
    (wait,) = graph_module.graph.find_nodes(op="call_function", target=c10d.wait_tensor.default)
    for clone in graph_module.graph.find_nodes(op="call_function", target=aten.clone.default):
        clone.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE  # as reshard tags the copy-out
    assert copy_out(graph_module.graph) == 1
    graph = graph_module.graph
    # No clone, split or concatenation is left for Inductor to generate ([Note: one copy-out per group]).
    for target in (aten.clone.default, aten.split_with_sizes.default, aten.cat.default, aten._unsafe_view.default):
        assert not graph.find_nodes(op="call_function", target=target), target
    (copied,) = graph.find_nodes(op="call_function", target=fsdp.copy_out.default)
    assert copied.args == (wait, WORLD, [12, 2])
    assert copied.meta["recompute"] is CheckpointPolicy.MUST_RECOMPUTE  # the clones' metadata
    # The parameters are views of its outputs, in their own shapes.
    outputs = sorted(copied.users, key=lambda item: item.args[1])
    assert [item.target for item in outputs] == [operator.getitem] * 2
    assert [tuple(only_user(item).meta["val"].shape) for item in outputs] == [(6, 4), (4,)]
    verify(graph)


def test_copy_out_on_gloo_concatenates_the_flattened_rank_major_clones(monkeypatch):
    from compile_shard.passes import copy_out

    _on_gloo(monkeypatch)
    graph_module = _lowered_graph()
    assert len(graph_module.graph.find_nodes(op="call_function", target=aten._unsafe_view.default)) == 2
    assert copy_out(graph_module.graph) == 1
    assert not graph_module.graph.find_nodes(op="call_function", target=fsdp.copy_out.default)
    (cat,) = graph_module.graph.find_nodes(op="call_function", target=aten.cat.default)
    # Each input flattens a [world_size, shard_numel] clone, not a parameter-shaped view
    # of it: Inductor's CPU backend vectorizes that index ([Note: one copy-out per group]).
    shapes = []
    for flat in cat.args[0]:
        (clone,) = flat.all_input_nodes
        assert flat.target is aten.view.default and clone.target is aten.clone.default
        shapes.append(tuple(clone.meta["val"].shape))
    assert shapes == [(WORLD, 12), (WORLD, 2)]
    assert not graph_module.graph.find_nodes(op="call_function", target=aten._unsafe_view.default)
    # The parameters read slices of the concatenation, in their own shapes.
    slices = [user for user in cat.users if user.target is aten.slice.Tensor]
    assert [tuple(next(iter(s.users)).meta["val"].shape) for s in slices] == [(6, 4), (4,)]
    verify(graph_module.graph)


def test_copy_out_reads_each_parameter_from_its_own_column_when_a_column_before_it_is_unread():
    """An unused parameter's column has no reader (its copy was never traced, or was dead): the parameters
    after it still read their own outputs of ``fsdp.copy_out``, which copies every column."""
    from compile_shard.passes import copy_out

    def fn(shard_w, shard_unused, shard_b, x):
        gathered = torch.ops.fsdp.all_gather_into([shard_w, shard_unused, shard_b], [12, 4, 2], WORLD, GROUP)
        per_rank_w, _, per_rank_b = gathered.view(WORLD, -1).split([12, 4, 2], dim=1)
        return x @ per_rank_w.clone().view(-1, 4)[:5].t() + per_rank_b.clone().view(-1)[:3].sum()

    graph_module = trace(fn, torch.randn(3, 4), torch.randn(4), torch.randn(2), torch.randn(3, 4))
    graph_module.graph.eliminate_dead_code()  # the unused column's ``getitem``, as in AOTAutograd's graphs
    annotate_group(graph_module.graph, "blocks.0", reshard_after_forward=True)
    lower(graph_module.graph)
    assert copy_out(graph_module.graph) == 1
    (copied,) = graph_module.graph.find_nodes(op="call_function", target=fsdp.copy_out.default)
    assert copied.args[2] == [12, 4, 2]
    read = sorted((item.args[1], tuple(only_user(item).meta["val"].shape)) for item in copied.users)
    assert read == [(0, (6, 4)), (2, (4,))]
    verify(graph_module.graph)


def test_copy_out_leaves_a_group_of_one_parameter_alone():
    from compile_shard.passes import copy_out

    def fn(shard_w, x):
        gathered = torch.ops.fsdp.all_gather_into([shard_w], [12], WORLD, GROUP)
        return x @ gathered.view(WORLD, -1).split([12], dim=1)[0].clone().view(-1, 4)[:6].t()

    graph_module = trace(fn, torch.randn(3, 4), torch.randn(3, 4))
    annotate_group(graph_module.graph, "blocks.0", reshard_after_forward=True)
    lower(graph_module.graph)
    before = graph_module.print_readable(print_output=False)
    assert copy_out(graph_module.graph) == 0
    assert graph_module.print_readable(print_output=False) == before


def _gloo_copy_out_computes_the_same(rank, world_size, on_gloo):
    import torch.distributed as dist

    from compile_shard.passes import copy_out

    copy_out_module = importlib.import_module("compile_shard.passes.copy_out")
    copy_out_module.gathers_by_send_recv = lambda *_: on_gloo  # this process's own module: the other form
    group_name = dist.group.WORLD.group_name

    def fn(shard_w, shard_b, x):
        gathered = torch.ops.fsdp.all_gather_into([shard_w, shard_b], [12, 2], world_size, group_name)
        per_rank_w, per_rank_b = gathered.view(world_size, -1).split([12, 2], dim=1)
        return x @ per_rank_w.reshape(-1, 4)[:5].t() + per_rank_b.reshape(-1)[:5].sum()

    torch.manual_seed(rank)
    inputs = (torch.randn(3 - rank, 4), torch.randn(2 - rank), torch.randn(3, 4))
    graph_module = trace(fn, *inputs)  # fake tensors in meta, real collectives when run
    annotate_group(graph_module.graph, "blocks.0", reshard_after_forward=True)
    lower(graph_module.graph)
    graph_module.recompile()
    expected = graph_module(*inputs)
    assert copy_out(graph_module.graph) == 1
    rewritten_as = aten.cat.default if on_gloo else fsdp.copy_out.default
    assert graph_module.graph.find_nodes(op="call_function", target=rewritten_as)
    graph_module.recompile()
    assert torch.equal(graph_module(*inputs), expected)


@pytest.mark.parametrize("on_gloo", [True, False], ids=["concatenation", "fsdp_copy_out"])
def test_copy_out_computes_what_the_per_parameter_copies_compute(on_gloo):
    from dist_utils import run_gloo

    run_gloo(_gloo_copy_out_computes_the_same, 2, on_gloo)


# reuse_first_blocks ------------------------------------------------------------------

_KEY = 7


def _dynamo_like_graph(*, read_outside=False, in_place=False, later_blocks=2, bias="shared", returns_input=False):
    """Dynamo's graph of a model of blocks, as ``compile_shard`` traces it: block 0 inlined (``relu(x @ w0 + b)``),
    the later ones calling the region body traced for block 1, with what ``compile_shard._regions`` records while tracing.

    ``bias``: what the body lifted itself, "shared" by every call or one "per_block"; None for none.
    """
    from compile_shard import _annotation

    if bias is None:
        body = torch.fx.symbolic_trace(lambda x, w: (torch.relu(x @ w),))
    else:
        body = torch.fx.symbolic_trace(lambda x, w, b: (torch.relu(x @ w + b),))
    root = torch.nn.Module()
    root.subgraph_0 = body
    graph = torch.fx.Graph()
    x, w0, w1, w2, b0, b1 = (graph.placeholder(name) for name in ("x", "w0", "w1", "w2", "b0", "b1"))
    product = graph.call_function(operator.matmul, (x, w0))
    block = [product]
    if bias is not None:
        product = graph.call_function(operator.add, (product, b0))
        block.append(product)
    hidden = graph.call_function(torch.relu, (product,))
    block.append(hidden)
    if in_place:
        block.append(graph.call_method("add_", (hidden, 1.0)))
    output = hidden
    for later, w in enumerate((w1, w2)[:later_blocks]):
        lifted = () if bias is None else (b0 if bias == "shared" or later == 0 else b1,)
        call = graph.call_function(invoke_subgraph, (graph.get_attr("subgraph_0"), "subgraph_0", output, w, *lifted))
        output = graph.call_function(operator.getitem, (call, 0))
    graph.output((output, block[0]) if read_outside else (output,))
    graph_module = torch.fx.GraphModule(root, graph)
    _annotation.note_region_body(body.graph, _KEY, [hidden, w1])  # what block 1's call passed for the leaves
    block_outputs = [x] if returns_input else [hidden]
    _annotation.note_inlined_first_block(graph, _annotation.InlinedFirstBlock(_KEY, [x, w0], block_outputs, block))
    return graph_module


def _dynamo_like_inputs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, generator=generator)
    return x, *(torch.randn(3, 3, generator=generator) for _ in range(3)), torch.randn(3), torch.randn(3)


@pytest.mark.parametrize("bias", [None, "shared"])
def test_reuse_first_blocks_makes_the_inlined_first_block_call_its_region(bias):
    from compile_shard.passes import reuse_first_blocks

    graph_module = _dynamo_like_graph(bias=bias)
    inputs = _dynamo_like_inputs()
    expected = graph_module(*inputs)
    assert reuse_first_blocks(graph_module.graph) == 1
    graph = graph_module.graph
    graph.lint()
    calls = graph.find_nodes(op="call_function", target=invoke_subgraph)
    x, w0, *_, b0, _ = graph.find_nodes(op="placeholder")
    assert len(calls) == 3 and calls[0].args[1:] == ("subgraph_0", x, w0, *(() if bias is None else (b0,)))
    assert calls[1].args[2].args[0] is calls[0]  # block 1 reads what block 0's region returns
    assert not graph.find_nodes(op="call_function", target=torch.relu)  # the inlined block is gone
    graph_module.recompile()
    torch.testing.assert_close(graph_module(*inputs), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "variant",
    [
        {"read_outside": True},  # a node of the block read past its outputs
        {"in_place": True},
        {"later_blocks": 0},  # no region of its key
        {"bias": "per_block", "later_blocks": 2},  # a lifted input the calls pass differently
        {"bias": "shared", "later_blocks": 1},  # a lifted input only one call shows
        {"returns_input": True},  # an output that is not the block's own node
    ],
    ids=["read_outside", "in_place", "no_region", "lifted_per_block", "lifted_by_one_call", "returns_input"],
)
def test_reuse_first_blocks_leaves_a_block_inlined_where_the_swap_could_change_the_graph(variant):
    from compile_shard.passes import reuse_first_blocks

    graph_module = _dynamo_like_graph(**variant)
    before = graph_module.print_readable(print_output=False)
    assert reuse_first_blocks(graph_module.graph) == 0
    assert graph_module.print_readable(print_output=False) == before


# verify ----------------------------------------------------------------------------


def _lowered_graph(fn=_gather_and_use):
    graph_module = trace(fn, *_shards())
    annotate_group(graph_module.graph, "blocks.0", reshard_after_forward=True)
    lower(graph_module.graph)
    return graph_module


def test_verify_accepts_a_lowered_graph():
    verify(_lowered_graph().graph)


def test_verify_rejects_a_collective_read_before_its_wait():
    graph_module = _lowered_graph()
    graph = graph_module.graph
    (gather,) = graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default)
    (wait,) = gather.users
    for user in list(wait.users):
        user.replace_input_with(wait, gather)
    with pytest.raises(GraphInvariantError, match="exactly one wait_tensor"):
        verify(graph)


def test_verify_rejects_a_left_over_mutation():
    graph_module = trace(lambda x: torch.ops.fsdp.resize_storage_(x, 0), torch.randn(4))
    with pytest.raises(GraphInvariantError, match="storage mutation left"):
        verify(graph_module.graph)


def test_verify_rejects_out_of_order_nodes():
    graph_module = trace(lambda x: (x + 1) * 2, torch.randn(4))
    add, mul = [n for n in graph_module.graph.nodes if n.op == "call_function"]
    add.prepend(mul)
    with pytest.raises(GraphInvariantError, match="malformed graph"):
        verify(graph_module.graph)


# A bf16 policy with fp32 reduction, as the runtime annotates its groups.
_BF16_POLICY = {
    "all_gather_dtypes": ("torch.bfloat16",),
    "gradient_dtype": "torch.bfloat16",
    "reduction_dtype": "torch.float32",
}


def _laid_out_reduction_input(grad_dtype, input_dtype, **dtypes):
    """A group's reduction input laid out from two unsharded gradients, annotated with ``dtypes``."""
    graph_module = trace(
        lambda grad_w, grad_b: torch.ops.fsdp.reduce_scatter_input([grad_w, grad_b], WORLD, input_dtype),
        torch.randn(6, 4, dtype=grad_dtype),
        torch.randn(4, dtype=grad_dtype),
    )
    (node,) = graph_module.graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_input.default)
    write_group_annotation(node, make_annotation("blocks.0", **dtypes))
    return graph_module.graph


def test_verify_accepts_the_policy_dtypes():
    verify(_laid_out_reduction_input(torch.bfloat16, torch.float32, **_BF16_POLICY))


@pytest.mark.parametrize(
    "grad_dtype, input_dtype, message",
    [
        (torch.float32, torch.float32, r"unsharded gradients in \['torch.float32'\], the policy's torch.bfloat16"),
        (torch.bfloat16, torch.bfloat16, "reduction input in torch.bfloat16, the policy's torch.float32"),
    ],
    ids=["gradient_computed_in_fp32", "reduced_in_bf16"],
)
def test_verify_rejects_a_reduction_off_the_policy_dtypes(grad_dtype, input_dtype, message):
    with pytest.raises(GraphInvariantError, match=f"group 'blocks.0': {message}"):
        verify(_laid_out_reduction_input(grad_dtype, input_dtype, **_BF16_POLICY))


def test_verify_rejects_an_all_gather_off_the_policy_dtype():
    graph_module = trace(_gather_and_use, *_shards())  # fp32 shards, gathered uncast
    (gather,) = graph_module.graph.find_nodes(op="call_function", target=fsdp.all_gather_into.default)
    write_group_annotation(gather, make_annotation("blocks.0", **_BF16_POLICY))
    with pytest.raises(GraphInvariantError, match=r"all-gather output in torch.float32, the policy's \('torch.bfloat16',\)"):
        verify(graph_module.graph)


def test_verify_leaves_groups_without_policy_dtypes_alone():
    """All-gather extensions decide their own dtypes: the runtime annotates none."""
    verify(_laid_out_reduction_input(torch.float32, torch.bfloat16))


def test_the_suite_verifies_after_each_pass_and_blames_the_one_that_broke_an_invariant(monkeypatch):
    install = importlib.import_module("compile_shard.passes.install")  # the package's ``install`` is the function

    def copy_out(graph):  # stands in for the real pass of that name: reads a collective before its wait
        (gather,) = graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default)
        (wait,) = gather.users
        for user in list(wait.users):
            user.replace_input_with(wait, gather)
        return 1

    passes = tuple(copy_out if p.__name__ == "copy_out" else p for p in install.JOINT_PASSES)
    monkeypatch.setattr(install, "JOINT_PASSES", passes)
    graph_module = trace(_gather_and_use, *_shards())
    annotate_group(graph_module.graph, "blocks.0", reshard_after_forward=True)
    with pytest.raises(GraphInvariantError, match="^after copy_out: collective"):
        install.run_suite(graph_module.graph)


def test_each_pass_is_named_once_by_its_function_module_and_switch():
    import compile_shard.passes as passes

    for graph_pass in (*passes.JOINT_PASSES, passes.reorder, passes.gather_buffers, passes.rank_check):
        name = graph_pass.__name__
        assert graph_pass.__module__ == f"compile_shard.passes.{name}"
        assert isinstance(getattr(passes.settings, name), bool), name


def test_verify_forward_rejects_saving_a_resharded_gather():
    def forward(shard_w, shard_b, x):
        gathered = torch.ops.fsdp.all_gather_into([shard_w, shard_b], [12, 2], WORLD, GROUP)
        weight = gathered.view(WORLD, -1).split([12, 2], dim=1)[0].reshape(-1, 4)[:5]
        return x @ weight.t(), weight  # the second output is a "saved for backward" tensor

    graph_module = trace(forward, *_shards())
    annotate_group(graph_module.graph, "blocks.0", reshard_after_forward=True)
    with pytest.raises(GraphInvariantError, match="'blocks.0' reshards after forward"):
        verify_forward(graph_module.graph)
    annotate_group(graph_module.graph, "blocks.0", reshard_after_forward=False)
    verify_forward(graph_module.graph)


# graph_breaks ----------------------------------------------------------------------


def _annotated_gather(model_groups):
    graph_module = trace(_gather_and_use, *_shards())
    for node in graph_module.graph.find_nodes(op="call_function", target=fsdp.all_gather_into.default):
        write_group_annotation(node, GroupAnnotation("blocks.0", True, members=("blocks.0",), model_groups=model_groups))
    return graph_module.graph


def test_warn_if_partial_warns_once_for_a_graph_missing_groups():
    from compile_shard.passes import ShardedGraphBreakWarning, warn_if_partial

    graph = _annotated_gather(("root", "blocks.0", "blocks.1", "blocks.2"))
    with pytest.warns(ShardedGraphBreakWarning, match=r"holds the all-gathers of \['blocks.0'\] but not of \['blocks.1', 'blocks.2', 'root'\]"):
        assert warn_if_partial(graph)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_partial(graph)  # the same split again: no second warning


def test_warn_if_partial_is_silent_for_whole_models_and_foreign_graphs():
    from compile_shard.passes import warn_if_partial

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_if_partial(_annotated_gather(("blocks.0",)))
        assert not warn_if_partial(trace(lambda x: x + 1, torch.randn(2)).graph)


@pytest.mark.parametrize("kept", [False, True], ids=["split", "kept_after_backward"])
def test_warn_if_partial_tells_parameters_kept_after_backward_from_a_split(kept):
    """Gathered parameters among the outputs: a graph break's, unless the group keeps them for the next forward."""
    from compile_shard.passes import ShardedGraphBreakWarning, warn_if_partial

    def fn(shard_w, shard_b, x):
        gathered = torch.ops.fsdp.all_gather_into([shard_w, shard_b], [12, 2], WORLD, GROUP)
        weight = gathered.view(WORLD, -1).split([12, 2], dim=1)[0].reshape(-1, 4)[:5]
        return x @ weight.t(), weight

    graph = trace(fn, *_shards()).graph
    name = f"blocks.{kept}"
    annotation = GroupAnnotation(name, False, members=(name,), model_groups=(name,), kept_after_backward=kept)
    for node in graph.find_nodes(op="call_function", target=fsdp.all_gather_into.default):
        write_group_annotation(node, annotation)
    if kept:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not warn_if_partial(graph)
    else:
        with pytest.warns(ShardedGraphBreakWarning, match=rf"the unsharded parameters of \['{name}'\] leave this graph"):
            assert warn_if_partial(graph)


# save_attention --------------------------------------------------------------------


def _attention(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def _tag_everything(graph, policy):
    for node in graph.nodes:
        if node.op == "call_function":
            node.meta["recompute"] = policy


def _seeded_nodes(graph):
    return [n for n in graph.nodes if isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags]


def test_save_attention_saves_zero_dropout_attention_in_checkpoint_regions():
    from compile_shard.passes import save_attention

    graph = trace(_attention, *(torch.randn(1, 2, 4, 8) for _ in range(3))).graph
    _tag_everything(graph, CheckpointPolicy.PREFER_RECOMPUTE)
    (attention,) = _seeded_nodes(graph)
    assert save_attention(graph) == 1
    assert "recompute" not in attention.meta
    assert {user.meta["recompute"] for user in attention.users} == {CheckpointPolicy.MUST_SAVE}


def test_save_attention_leaves_dropout_and_untagged_attention_alone():
    from compile_shard.passes import save_attention

    def with_dropout(q, k, v):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.1, True)[0].sum()

    inputs = [torch.randn(1, 2, 4, 8) for _ in range(3)]
    dropout_graph = trace(with_dropout, *inputs).graph
    _tag_everything(dropout_graph, CheckpointPolicy.PREFER_RECOMPUTE)
    assert save_attention(dropout_graph) == 0
    untagged = trace(_attention, *inputs).graph
    assert save_attention(untagged) == 0
    assert not any("recompute" in n.meta for n in untagged.nodes)


# place -----------------------------------------------------------------------------


def _gather_early(shard_w, shard_b, x):
    """The shape a trace has: the root gathers first, compute comes later."""
    gathered = torch.ops.fsdp.all_gather_into([shard_w, shard_b], [12, 2], WORLD, GROUP)
    h = (x * 2).relu()
    weight = gathered.view(WORLD, -1).split([12, 2], dim=1)[0].reshape(-1, 4)[:5]
    return h @ weight.t()


def test_place_moves_the_gather_chain_next_to_its_first_reader():
    from compile_shard.passes import place

    graph_module = _lowered_graph(_gather_early)
    nodes = list(graph_module.graph.nodes)
    relu = next(n for n in nodes if n.target is aten.relu.default)
    gather = next(n for n in nodes if n.target is c10d.all_gather_into_tensor.default)
    assert nodes.index(gather) < nodes.index(relu)
    assert place(graph_module.graph) == 1
    nodes = list(graph_module.graph.nodes)
    matmul = next(n for n in nodes if n.target is aten.mm.default)
    assert nodes.index(relu) < nodes.index(gather) < nodes.index(matmul)
    # Between the compute before and the first reader: only the chain (copy-in, collective, copy-out).
    chain = nodes[nodes.index(relu) + 1 : nodes.index(matmul)]
    copy_in = {fsdp.copy_in.default}
    collective = {c10d.all_gather_into_tensor.default, c10d.wait_tensor.default}
    assert {n.target for n in chain} <= copy_in | collective | _chain_targets()
    verify(graph_module.graph)
    assert place(graph_module.graph) == 0  # already in place: nothing to do


def _gather_extension(shard, bias, x):
    """A group whose weight has an all-gather extension, traced as the runtime traces it.

    ``fsdp_pre_all_gather`` makes int8 rows and a scale per row of the shard, each dtype
    is gathered apart (the scale with the bias), ``fsdp_post_all_gather`` joins the two
    outputs, and ``fsdp.as_gathered`` gives the results the all-gather's backward.
    """
    scale = shard.abs().amax(dim=1, keepdim=True) / 127
    rows = torch.round(shard / scale).to(torch.int8)
    h = (x * 2).relu()
    gathered_rows = torch.ops.fsdp.all_gather_into([rows], [8], WORLD, GROUP)
    gathered_scales = torch.ops.fsdp.all_gather_into([scale, bias], [2, 2], WORLD, GROUP)
    scales, gathered_bias = gathered_scales.view(WORLD, -1).split([2, 2], dim=1)
    weight = gathered_rows.view(WORLD, -1).reshape(-1, 4).to(torch.float32) * scales.reshape(-1, 1)
    weight, bias = torch.ops.fsdp.as_gathered([weight, gathered_bias.reshape(-1)], [shard, bias], [8, 2], WORLD, GROUP)
    return h @ weight.t() + bias


_COMPUTE = {aten.mul.Tensor, aten.relu.default, aten.t.default, aten.mm.default, aten.add.Tensor}


def _extension_graph():
    """``_gather_extension``, each node of the unshard annotated with the group (the compute is not)."""
    graph_module = trace(_gather_extension, torch.randn(2, 4), torch.randn(2), torch.randn(3, 4))
    nodes = list(graph_module.graph.nodes)
    h = next(node for node in nodes if node.target is aten.relu.default)
    joined = next(node for node in nodes if node.target is aten.mul.Tensor and node is not h.args[0])
    for node in nodes:
        if node.op == "call_function" and (node.target not in _COMPUTE or node is joined):
            write_group_annotation(node, make_annotation("blocks.0"))
    return graph_module, joined


def test_reshard_recomputes_an_all_gather_extensions_transforms():
    graph_module, joined = _extension_graph()
    assert reshard(graph_module.graph) == 2
    tagged = {n for n in graph_module.graph.nodes if n.meta.get("recompute") is CheckpointPolicy.MUST_RECOMPUTE}
    unshard = {n for n in graph_module.graph.nodes if group_annotation(n) is not None}
    assert tagged == unshard and joined in tagged
    assert {n.target for n in tagged} >= {aten.amax.default, fsdp.as_gathered.default, aten._to_copy.default}


def test_place_moves_a_groups_gathers_and_transforms_together():
    from compile_shard.passes import place

    graph_module, joined = _extension_graph()
    lower(graph_module.graph)
    assert place(graph_module.graph) == 1
    nodes = list(graph_module.graph.nodes)
    relu = next(n for n in nodes if n.target is aten.relu.default)
    matmul = next(n for n in nodes if n.target is aten.mm.default)
    gathers = [n for n in nodes if n.target is c10d.all_gather_into_tensor.default]
    (as_gathered,) = [n for n in nodes if n.target is fsdp.as_gathered.default]
    assert len(gathers) == 2
    assert all(nodes.index(relu) < nodes.index(n) < nodes.index(matmul) for n in (*gathers, joined, as_gathered))
    verify(graph_module.graph)
    assert place(graph_module.graph) == 0


def test_place_leaves_gathers_that_leave_the_graph():
    from compile_shard.passes import place

    def leaked(shard_w, shard_b):
        gathered = torch.ops.fsdp.all_gather_into([shard_w, shard_b], [12, 2], WORLD, GROUP)
        return gathered.view(WORLD, -1)

    graph_module = trace(leaked, *_shards()[:2])
    annotate_group(graph_module.graph, "blocks.0", reshard_after_forward=True)
    before = _code(graph_module)
    assert place(graph_module.graph) == 0 and reshard(graph_module.graph) == 0
    assert _code(graph_module) == before
