"""bucket, reorder (schedule), keep_order, gather_buffers and the priority sort, on small hand-built graphs."""

import dataclasses
import importlib
import operator
from types import SimpleNamespace

import pytest
import torch

from compile_shard._annotation import group_annotation, write_group_annotation
from compile_shard.passes import (
    bucket,
    copy_out,
    gather_buffers,
    keep_order,
    lower,
    place,
    reshard,
    reorder,
    verify,
)
from compile_shard.passes.bucket import describe_buckets
from compile_shard.passes.cost_model import PROFILES, get_profile
from compile_shard.passes.simulate import simulate
from compile_shard.passes._graph import reorder_by_priority
from compile_shard.passes.patterns import waited_node
from dist_utils import FakeProcessGroup, run_gloo
from graph_utils import c10d, fsdp, make_annotation, pass_settings, trace

aten = torch.ops.aten
WORLD, GROUP = 2, "0"
# Three groups, each a weight of 5 rows (3 padded rows per rank) and 4 columns.
NUMELS = [12]


def _layer(h, shard):
    gathered = torch.ops.fsdp.all_gather_into([shard], NUMELS, WORLD, GROUP)
    (per_rank,) = gathered.view(WORLD, -1).split(NUMELS, dim=1)
    weight = per_rank.reshape(-1, 4)[:5]
    return (h @ weight.t()).relu()[:, :4]


def _three_layers(s0, s1, s2, x):
    h = x
    for shard in (s0, s1, s2):
        h = _layer(h, shard)
    return h


def _inputs():
    return [torch.randn(3, 4) for _ in range(3)] + [torch.randn(2, 4)]


def _annotate(graph, groups, reshard_after_forward=True, **knobs):
    """Annotates the fsdp gathers (in graph order) and every node of their copy-out as the runtime would."""
    gathers = graph.find_nodes(op="call_function", target=fsdp.all_gather_into.default)
    for node, group in zip(gathers, groups):
        annotation = make_annotation(group, reshard_after_forward, **{k: tuple(v.get(group, ())) for k, v in knobs.items()})
        chain = [node, *node.users, *(u for user in node.users for u in user.users)]
        chain += [g for split in list(chain) for g in split.users if g.target is operator.getitem]
        for chain_node in chain:
            write_group_annotation(chain_node, annotation)


def _traced(fn=_three_layers, inputs=None, groups=("a", "b", "c"), **knobs):
    graph_module = trace(fn, *(inputs or _inputs()))
    _annotate(graph_module.graph, groups, **knobs)
    return graph_module


def _position(graph, predicate):
    return [index for index, node in enumerate(graph.nodes) if predicate(node)]


def _is(target):
    return lambda node: node.target is target


# reorder_by_priority ---------------------------------------------------------------


def test_reorder_by_priority_runs_urgent_work_first_but_never_before_its_inputs():
    graph_module = trace(lambda x, y: (x.sin(), y.cos().exp()), torch.randn(2), torch.randn(2))
    graph = graph_module.graph
    assert [n.name for n in graph.nodes if n.op == "call_function"] == ["sin", "cos", "exp"]
    exp = next(n for n in graph.nodes if n.target is aten.exp.default)
    assert reorder_by_priority(graph, {exp: -1.0}) > 0
    names = [n.name for n in graph.nodes]
    # exp is urgent, so its input cos inherits the urgency; both run before sin.
    assert names.index("cos") < names.index("exp") < names.index("sin")
    assert [n.op for n in graph.nodes][:2] == ["placeholder", "placeholder"]
    graph.lint()
    x, y = torch.randn(2), torch.randn(2)
    graph_module.recompile()
    torch.testing.assert_close(graph_module(x, y), (x.sin(), y.cos().exp()))


def test_reorder_by_priority_keeps_placeholders_in_calling_order():
    graph_module = trace(lambda x, y: y.exp() + x, torch.randn(2), torch.randn(2))
    placeholder_names = [n.name for n in graph_module.graph.find_nodes(op="placeholder")]
    x = graph_module.graph.find_nodes(op="placeholder")[0]
    reorder_by_priority(graph_module.graph, {x: 100.0})
    assert [n.name for n in graph_module.graph.find_nodes(op="placeholder")] == placeholder_names


# bucket --------------------------------------------------------------------------


def test_bucket_merges_adjacent_groups_within_the_cap():
    graph_module = _traced()
    graph = graph_module.graph
    group_bytes = WORLD * NUMELS[0] * 4
    assert bucket(graph, cap_mb=2.5 * group_bytes / 2**20) == 1  # a+b fit, c does not
    gathers = graph.find_nodes(op="call_function", target=fsdp.all_gather_into.default)
    assert len(gathers) == 2
    merged = next(n for n in gathers if len(n.args[0]) == 2)
    assert list(merged.args[1]) == NUMELS * 2
    annotation = group_annotation(merged)
    assert annotation.name == "a+b" and annotation.members == ("a", "b")
    graph.lint()
    # reshard and place see the bucket as one group.
    assert reshard(graph) == 2
    lower(graph)
    place(graph)
    verify(graph)


def test_bucket_does_nothing_without_a_cap_or_below_one_pair():
    graph_module = _traced()
    before = graph_module.print_readable(print_output=False)
    assert bucket(graph_module.graph, cap_mb=0) == 0
    assert bucket(graph_module.graph, cap_mb=1.5 * WORLD * NUMELS[0] * 4 / 2**20) == 0
    assert graph_module.print_readable(print_output=False) == before


def _profile_whose_latency_bound_size_is(monkeypatch, cap_bytes):
    """A profile under which a collective over ``WORLD`` ranks is latency-bound below ``cap_bytes``."""
    profile = dataclasses.replace(
        get_profile("h100_nvlink"), name="cap_test", link_bytes_per_s=1e9, link_latency_s=cap_bytes / WORLD / 1e9
    )
    monkeypatch.setitem(PROFILES, "cap_test", profile)


def test_the_cost_model_merges_groups_while_a_bucket_stays_latency_bound(monkeypatch):
    """[Note: the cost model's buckets]: no cap set, the profile's latency-bound size decides, and says so."""
    _profile_whose_latency_bound_size_is(monkeypatch, 2.5 * WORLD * NUMELS[0] * 4)
    graph = _traced().graph
    with pass_settings(cost_profile="cap_test", bucket_cap_mb=None):
        assert bucket(graph) == 1  # a+b fit, c does not
        lines = describe_buckets(graph).splitlines()
    assert [line.split(",")[0] for line in lines] == ["a+b: 2 groups", "c: alone"]
    assert all(line.endswith("costs more latency than transfer on cap_test)") for line in lines), lines
    verify(graph)


def test_the_cost_model_leaves_groups_too_large_to_share_a_latency_bound_bucket(monkeypatch):
    _profile_whose_latency_bound_size_is(monkeypatch, 1.5 * WORLD * NUMELS[0] * 4)
    graph_module = _traced()
    before = graph_module.print_readable(print_output=False)
    with pass_settings(cost_profile="cap_test", bucket_cap_mb=None):
        assert bucket(graph_module.graph) == 0
        lines = describe_buckets(graph_module.graph).splitlines()
    assert graph_module.print_readable(print_output=False) == before
    assert [line.split(",")[0] for line in lines] == ["a: alone", "b: alone", "c: alone"]


def test_bucket_keeps_groups_with_different_resharding_apart():
    graph_module = trace(_three_layers, *_inputs())
    graph = graph_module.graph
    _annotate(graph, ["a", "b", "c"])
    gathers = graph.find_nodes(op="call_function", target=fsdp.all_gather_into.default)
    write_group_annotation(gathers[1], make_annotation("b", reshard_after_forward=False))
    assert bucket(graph, cap_mb=100.0) == 0  # a | b | c: no two neighbors agree


def _layer_with_a_custom_all_gather(h, shard):
    gathered = torch.ops.fsdp.all_gather_into([shard], NUMELS, WORLD, GROUP, all_gather_comm="comm")
    (per_rank,) = gathered.view(WORLD, -1).split(NUMELS, dim=1)
    return (h @ per_rank.reshape(-1, 4)[:5].t()).relu()[:, :4]


def test_bucket_keeps_a_group_with_a_custom_comm_apart():
    """A custom comm gathers its own group's buffer, as in FSDP2 ([Note: custom collectives])."""

    def fn(s0, s1, s2, x):
        return _layer(_layer_with_a_custom_all_gather(_layer(x, s0), s1), s2)

    graph_module = _traced(fn)
    assert bucket(graph_module.graph, cap_mb=100.0) == 0  # a | b | c: b gathers alone, so a and c are not adjacent


def _bf16_layer(h, shard):
    gathered = torch.ops.fsdp.all_gather_into([shard], NUMELS, WORLD, GROUP, param_dtype=torch.bfloat16)
    (per_rank,) = gathered.view(WORLD, -1).split(NUMELS, dim=1)
    return (h @ per_rank.reshape(-1, 4)[:5].t().float()).relu()[:, :4]


def test_bucket_merges_mixed_precision_gathers_with_their_cast_and_keeps_other_wire_dtypes_apart():
    def fn(s0, s1, s2, x):
        return _layer(_bf16_layer(_bf16_layer(x, s0), s1), s2)  # bf16, bf16, then fp32 on the wire

    graph = _traced(fn).graph
    assert bucket(graph, cap_mb=100.0) == 1  # a+b; c gathers fp32
    gathers = graph.find_nodes(op="call_function", target=fsdp.all_gather_into.default)
    merged = next(n for n in gathers if len(n.args[0]) == 2)
    assert merged.kwargs == {"param_dtype": torch.bfloat16} and merged.meta["val"].dtype == torch.bfloat16
    lower(graph)
    verify(graph)
    lowered = graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default)
    assert sorted(str(node.meta["val"].dtype) for node in lowered) == ["torch.bfloat16", "torch.float32"]
    copy_ins = graph.find_nodes(op="call_function", target=fsdp.copy_in.default)
    # The bucket's two fp32 shards, cast in one copy-in; the fp32 group's one shard needs no copy.
    assert [[shard.op for shard in node.args[0]] for node in copy_ins] == [["placeholder", "placeholder"]]
    assert copy_ins[0].args[2] == torch.bfloat16


def _two_gathers(s0, s1, x):
    outputs = []
    for shard in (s0, s1):
        gathered = torch.ops.fsdp.all_gather_into([shard], NUMELS, WORLD, GROUP)
        (per_rank,) = gathered.view(WORLD, -1).split(NUMELS, dim=1)
        outputs.append(x @ per_rank.reshape(-1, 4)[:5].t())
    return outputs


def _reduce(g0, g1):
    """A backward's two reduce-scatters, in reverse group order."""
    return [torch.ops.fsdp.reduce_scatter_grad(g.reshape(-1) * 2, WORLD, GROUP, "avg") for g in (g1, g0)]


def _gather_and_reduce(s0, s1, g0, g1, x):
    """A forward's two gathers and a backward's two reduce-scatters, as in a joint graph."""
    return _two_gathers(s0, s1, x), _reduce(g0, g1)


def _a_whole_read_then_a_copied_out_gather(s0, s1, x):
    """The first group's output read whole, as a region's argument is, by ``fsdp.copy_out``; the second's
    copied out in the graph."""
    outputs = []
    gathered = torch.ops.fsdp.all_gather_into([s0], NUMELS, WORLD, GROUP)
    (padded,) = torch.ops.fsdp.copy_out(gathered, WORLD, NUMELS)
    outputs.append(x @ padded.reshape(-1, 4)[:5].t())
    gathered = torch.ops.fsdp.all_gather_into([s1], NUMELS, WORLD, GROUP)
    (per_rank,) = gathered.view(WORLD, -1).split(NUMELS, dim=1)
    outputs.append(x @ per_rank.reshape(-1, 4)[:5].t())
    return outputs


def _whole_read_gather_and_reduce(s0, s1, g0, g1, x):
    return _a_whole_read_then_a_copied_out_gather(s0, s1, x), _reduce(g0, g1)


def _all_reduced(grads):
    return [c10d.wait_tensor(c10d.all_reduce(grad, "avg", GROUP)) for grad in grads]


def _gather_reduce_and_all_reduce(s0, s1, g0, g1, x):
    """The same on HSDP: each reduce-scattered gradient is then all-reduced."""
    outputs, grads = _gather_and_reduce(s0, s1, g0, g1, x)
    return outputs, _all_reduced(grads)


def _gather_reduce_add_partial_and_all_reduce(s0, s1, g0, g1, x, partial):
    """HSDP where the first reduction adds an earlier partial reduction before its all-reduce (``set_requires_all_reduce``)."""
    outputs, grads = _gather_and_reduce(s0, s1, g0, g1, x)
    return outputs, _all_reduced([grads[0] + partial, grads[1]])


def _annotate_reductions(graph, groups):
    for node, group in zip(graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_grad.default), groups):
        write_group_annotation(node, make_annotation(group))


def test_bucket_merges_the_matching_reduce_scatters():
    inputs = [torch.randn(3, 4), torch.randn(3, 4), torch.randn(6, 4), torch.randn(6, 4), torch.randn(2, 4)]
    graph_module = trace(_gather_and_reduce, *inputs)
    graph = graph_module.graph
    _annotate(graph, ["a", "b"])
    _annotate_reductions(graph, ["b", "a"])  # backward runs in reverse
    assert bucket(graph, cap_mb=1.0) == 2
    (reduction,) = graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_grad.default)
    assert group_annotation(reduction).name == "a+b"
    assert reduction.meta["val"].shape == (2 * NUMELS[0],)
    graph.lint()


def _gather_and_reduce_in_fp32(s0, s1, g0, g1, x):
    """``_gather_and_reduce`` under a reduce dtype: bf16 gradients, each cast to fp32 for its reduce-scatter."""
    outputs = _two_gathers(s0, s1, x)
    grads = [g.to(torch.bfloat16).reshape(-1) * 2 for g in (g1, g0)]
    return outputs, [torch.ops.fsdp.reduce_scatter_grad(g.to(torch.float32), WORLD, GROUP, "avg") for g in grads]


def test_a_bucket_casts_its_gradients_to_the_reduce_dtype_once_after_concatenating_them():
    """[Note: a bucket's mixed-precision reduction]: lower lays out bf16 gradients and casts, as for one group."""
    inputs = [torch.randn(3, 4), torch.randn(3, 4), torch.randn(6, 4), torch.randn(6, 4), torch.randn(2, 4)]
    graph = trace(_gather_and_reduce_in_fp32, *inputs).graph
    _annotate(graph, ["a", "b"])
    _annotate_reductions(graph, ["b", "a"])
    assert bucket(graph, cap_mb=1.0) == 2
    casts = [node for node in graph.nodes if node.target is torch.ops.prims.convert_element_type.default]
    assert [cast.args[1] for cast in casts] == [torch.float32]
    assert casts[0].args[0].args[0].target is torch.ops.aten.cat.default
    lower(graph)
    (reduction_input,) = graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_input.default)
    assert {gradient.meta["val"].dtype for gradient in reduction_input.args[0]} == {torch.bfloat16}
    assert reduction_input.args[2] == torch.float32
    graph.lint()


def test_a_bucket_gives_a_group_read_whole_its_own_rank_major_buffer():
    """[Note: a bucket of regions' groups]: the group's chunk of the merged split, copied contiguous and flat,
    replaces its all-gather output; ``copy_out`` then copies the whole bucket out in one op."""
    inputs = [torch.randn(3, 4), torch.randn(3, 4), torch.randn(6, 4), torch.randn(6, 4), torch.randn(2, 4)]
    graph = trace(_whole_read_gather_and_reduce, *inputs).graph
    _annotate(graph, ["a", "b"])
    _annotate_reductions(graph, ["b", "a"])
    region_copy_out = graph.find_nodes(op="call_function", target=fsdp.copy_out.default)[0]
    assert bucket(graph, cap_mb=1.0) == 2
    (merged,) = graph.find_nodes(op="call_function", target=fsdp.all_gather_into.default)
    whole = region_copy_out.args[0]
    assert whole.target is aten.view.default and whole.meta["val"].shape == (WORLD * NUMELS[0],)
    assert whole.args[0].target is aten.clone.default
    (split,) = [node for node in graph.nodes if node.target is aten.split_with_sizes.default and node.args[2:] == (1,)]
    assert split.args[0].args[0] is merged and list(split.args[1]) == NUMELS * 2
    lower(graph)
    copy_out(graph)
    verify(graph)
    graph.lint()


def test_bucket_leaves_groups_whose_gradients_it_cannot_merge():
    inputs = [torch.randn(3, 4), torch.randn(3, 4), torch.randn(6, 4), torch.randn(6, 4), torch.randn(2, 4)]
    graph_module = trace(_gather_and_reduce, *inputs)
    _annotate(graph_module.graph, ["a", "b"])
    _annotate_reductions(graph_module.graph, ["b", "other"])
    assert bucket(graph_module.graph, cap_mb=1.0) == 0


def _annotate_all_reduces(graph):
    """Each all-reduce and its wait, as the group of the reduce-scatter it reduces further."""
    for node in graph.find_nodes(op="call_function", target=c10d.all_reduce.default):
        source = node.args[0] if node.args[0].target is not aten.add.Tensor else node.args[0].args[0]
        for annotated in (node, *node.users):
            write_group_annotation(annotated, group_annotation(source))


def _hsdp_reductions(fn=_gather_reduce_and_all_reduce, *extra_inputs):
    inputs = [torch.randn(3, 4), torch.randn(3, 4), torch.randn(6, 4), torch.randn(6, 4), torch.randn(2, 4)]
    graph = trace(fn, *inputs, *extra_inputs).graph
    _annotate(graph, ["a", "b"])
    _annotate_reductions(graph, ["b", "a"])
    _annotate_all_reduces(graph)
    return graph


def test_bucket_merges_hsdp_all_reduces_with_their_reduce_scatters():
    """[Note: bucketed HSDP all-reduce]: one reduce-scatter, then one all-reduce of the bucket, then the split."""
    graph = _hsdp_reductions()
    assert bucket(graph, cap_mb=1.0) == 2
    graph.lint()
    (reduction,) = graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_grad.default)
    (all_reduce,) = graph.find_nodes(op="call_function", target=c10d.all_reduce.default)
    assert all_reduce.args[0] is reduction and group_annotation(all_reduce).name == "a+b"
    (wait,) = all_reduce.users
    assert [user.target for user in wait.users] == [aten.split_with_sizes.default]


def test_bucket_keeps_hsdp_all_reduces_apart_when_one_adds_a_partial_reduction_first():
    graph = _hsdp_reductions(_gather_reduce_add_partial_and_all_reduce, torch.randn(NUMELS[0]))
    assert bucket(graph, cap_mb=1.0) == 2  # the gathers and the reduce-scatters still merge
    graph.lint()
    assert len(graph.find_nodes(op="call_function", target=c10d.all_reduce.default)) == 2


def _bucketed_graph_computes_the_same(rank, world_size, kind):
    inputs = [torch.full((3, 4), float(rank + 1)), torch.full((3, 4), 10.0 * (rank + 1))]
    gradient = torch.arange(24.0).view(6, 4) * (rank + 1)
    inputs += [gradient, -gradient, torch.randn(2, 4, generator=torch.Generator().manual_seed(0))]
    fn = {
        "fsdp": _gather_and_reduce,
        "hsdp": _gather_reduce_and_all_reduce,
        "read_whole": _whole_read_gather_and_reduce,
    }[kind]
    expected = fn(*inputs)
    graph_module = trace(fn, *inputs)
    _annotate(graph_module.graph, ["a", "b"])
    _annotate_reductions(graph_module.graph, ["b", "a"])
    _annotate_all_reduces(graph_module.graph)
    assert bucket(graph_module.graph, cap_mb=1.0) == 2
    assert len(graph_module.graph.find_nodes(op="call_function", target=c10d.all_reduce.default)) == (kind == "hsdp")
    graph_module.recompile()
    torch.testing.assert_close(graph_module(*inputs), expected, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["fsdp", "hsdp", "read_whole"])
def test_bucketed_graph_computes_what_separate_collectives_compute(kind):
    """``read_whole``: one group read whole, as a region reads it ([Note: a bucket of regions' groups])."""
    run_gloo(_bucketed_graph_computes_the_same, WORLD, kind)


# reorder (schedule) ---------------------------------------------------------------


def _lowered(**knobs):
    graph_module = _traced(**knobs)
    for graph_pass in (reshard, lower, place):
        graph_pass(graph_module.graph)
    return graph_module


def _issue_and_wait_positions(graph):
    gathers = _position(graph, _is(c10d.all_gather_into_tensor.default))
    waits = _position(graph, _is(c10d.wait_tensor.default))
    return gathers, waits


def test_schedule_issues_each_gather_before_the_previous_groups_wait():
    graph_module = _lowered()
    graph = graph_module.graph
    gathers, waits = _issue_and_wait_positions(graph)
    assert all(wait < gather for wait, gather in zip(waits, gathers[1:]))  # place: one group at a time
    assert reorder(graph, prefetch_depth=1) > 0
    verify(graph)
    gathers, waits = _issue_and_wait_positions(graph)
    matmuls = _position(graph, _is(aten.mm.default))
    # Group k+1 is issued before group k is waited on; group k computes before k+1 is waited on.
    assert all(gather < wait for gather, wait in zip(gathers[1:], waits))
    assert all(wait < mm < next_wait for wait, mm, next_wait in zip(waits, matmuls, waits[1:]))
    assert reorder(graph, prefetch_depth=1) == 0  # already scheduled


def test_schedule_with_depth_two_issues_two_groups_ahead_and_depth_zero_none():
    graph_module = _lowered()
    reorder(graph_module.graph, prefetch_depth=2)
    gathers, waits = _issue_and_wait_positions(graph_module.graph)
    assert gathers[2] < waits[0]
    reorder(graph_module.graph, prefetch_depth=0)
    gathers, waits = _issue_and_wait_positions(graph_module.graph)
    assert all(wait < gather for wait, gather in zip(waits, gathers[1:]))


def test_memory_budget_lowers_the_prefetch_depth_until_the_peak_fits():
    from compile_shard.passes import reorder_within_budget
    from compile_shard.passes.simulate import simulate

    def peak(graph):
        return simulate(graph, get_profile("h100_nvlink")).peak_memory_bytes

    unbounded, bounded = _lowered(), _lowered()
    reorder(unbounded.graph, prefetch_depth=2)
    no_prefetch = _lowered()
    reorder(no_prefetch.graph, prefetch_depth=0)
    assert peak(no_prefetch.graph) < peak(unbounded.graph)
    # A budget between the two: the depth drops until it fits, without a warning.
    budget = (peak(no_prefetch.graph) + peak(unbounded.graph)) / 2
    reorder_within_budget(bounded.graph, 2, 1, budget, peak)
    assert peak(bounded.graph) <= budget
    # Below what the graph needs without prefetch: depth 0, and a warning that says so.
    starved = _lowered()
    with pytest.warns(UserWarning, match=r"even without prefetch, over settings.memory_budget_mb"):
        reorder_within_budget(starved.graph, 2, 1, 1.0, peak)
    assert _issue_and_wait_positions(starved.graph) == _issue_and_wait_positions(no_prefetch.graph)


def test_schedule_honours_explicit_forward_prefetch():
    graph_module = _lowered(forward_prefetch={"a": ["c"]})
    reorder(graph_module.graph, prefetch_depth=0)
    position = {group_annotation(n).name + "." + n.target.__name__.split(".")[0]: i
                for i, n in enumerate(graph_module.graph.nodes)
                if n.target in (c10d.all_gather_into_tensor.default, c10d.wait_tensor.default)}
    # With no implicit prefetch, c is still issued before a is waited on; b is not.
    assert position["c.all_gather_into_tensor"] < position["a.wait_tensor"] < position["b.all_gather_into_tensor"]


def _reduced_one_after_another(g_a, g_b, g_c, x, reduce):
    grads, h = [], x
    for g in (g_c, g_b, g_a):
        h = (h @ g.t()).tanh() @ g
        grads.append(reduce((g * h.sum()).reshape(-1)))
    return grads


def _backward_like(g_a, g_b, g_c, x):
    """Three gradients computed one after another, each reduce-scattered."""
    return _reduced_one_after_another(
        g_a, g_b, g_c, x, lambda grad: torch.ops.fsdp.reduce_scatter_grad(grad, WORLD, GROUP, "avg")
    )


def _backward_like_dividing_after(g_a, g_b, g_c, x):
    """``_backward_like`` summing each gradient and dividing after, as ``set_force_sum_reduction_for_comms``."""
    return _reduced_one_after_another(
        g_a, g_b, g_c, x, lambda grad: torch.ops.fsdp.reduce_scatter_grad(grad, WORLD, GROUP, "sum") / WORLD
    )


@pytest.mark.parametrize("by_all_to_all", [False, True], ids=["reduce_scatter", "all_to_all"])
def test_schedule_issues_reduce_scatters_early_and_waits_one_reduction_later(by_all_to_all, monkeypatch):
    # On gloo, lower reduces gradients with an all-to-all (see [Note: gloo reduce-scatter]).
    lower_module = importlib.import_module("compile_shard.passes.lower")
    monkeypatch.setattr(lower_module, "reduces_by_all_to_all", lambda *_: by_all_to_all)
    reduction = c10d.all_to_all_single.default if by_all_to_all else c10d.reduce_scatter_tensor.default
    backward_like = _backward_like if by_all_to_all else _backward_like_dividing_after
    graph_module = trace(backward_like, *[torch.randn(6, 4) for _ in range(3)], torch.randn(2, 4))
    graph = graph_module.graph
    _annotate_reductions(graph, ["c", "b", "a"])
    for node in graph.nodes:  # the gradient copy-in and the division belong to their group
        if node.target is aten.view.default and next(iter(node.users)).target is fsdp.reduce_scatter_grad.default:
            node.meta["custom"] = next(iter(node.users)).meta["custom"]
        if node.target is aten.div.Tensor:
            node.meta["custom"] = node.args[0].meta["custom"]
    lower(graph)
    # Move every reduction to the end, as the partitioner leaves them.
    output = graph.find_nodes(op="output")[0]
    for node in [n for n in graph.nodes if n.meta.get("custom")]:
        output.prepend(node)
    for node in [n for n in graph.nodes if n.target is aten.div.Tensor]:
        output.prepend(node)
    assert reorder(graph, reduce_scatter_depth=1) > 0
    verify(graph)
    issues = _position(graph, _is(reduction))
    assert len(issues) == 3
    waits = _position(graph, _is(c10d.wait_tensor.default))
    tanhs = _position(graph, _is(aten.tanh.default))
    # Reduction k is issued before the next gradient's compute; it is waited on after reduction k+1 is issued.
    assert issues[0] < tanhs[1] and issues[1] < tanhs[2]
    assert issues[1] < waits[0] < issues[2] < waits[1]
    assert waits[2] > tanhs[2]
    # The division (gloo: fsdp.sum_shards) follows its wait at once and frees the reduction's buffer.
    for wait in graph.find_nodes(op="call_function", target=c10d.wait_tensor.default):
        (reduced,) = wait.users
        assert reduced.target is (fsdp.sum_shards.default if by_all_to_all else aten.div.Tensor)
        assert reduced.prev is wait, (wait.name, reduced.name)


def _hsdp_backward_like(g_a, g_b, g_c, x):
    """``_backward_like`` on HSDP: each reduce-scattered gradient is all-reduced over the replicate group."""
    funcol = torch.ops._c10d_functional
    return [funcol.wait_tensor(funcol.all_reduce(grad, "avg", GROUP)) for grad in _backward_like(g_a, g_b, g_c, x)]


def test_schedule_overlaps_hsdp_all_reduces_like_the_reduce_scatters():
    graph_module = trace(_hsdp_backward_like, *[torch.randn(6, 4) for _ in range(3)], torch.randn(2, 4))
    graph = graph_module.graph
    _annotate_reductions(graph, ["c", "b", "a"])
    lower(graph)
    for all_reduce in graph.find_nodes(op="call_function", target=c10d.all_reduce.default):
        # the runtime's trace annotates them with the group, as every node of its reduction
        write_group_annotation(all_reduce, group_annotation(all_reduce.args[0]))
    output = graph.find_nodes(op="output")[0]
    for node in [n for n in graph.nodes if n.meta.get("custom") or n.target is aten.div.Tensor]:
        output.prepend(node)  # where the partitioner leaves them
    for all_reduce in graph.find_nodes(op="call_function", target=c10d.all_reduce.default):
        output.prepend(all_reduce)
        output.prepend(next(iter(all_reduce.users)))
    reorder(graph, reduce_scatter_depth=1)
    verify(graph)
    all_reduces = _position(graph, _is(c10d.all_reduce.default))
    reduce_scatters = _position(graph, _is(c10d.reduce_scatter_tensor.default))
    tanhs = _position(graph, _is(aten.tanh.default))
    waits = [
        (index, node.args[0].target) for index, node in enumerate(graph.nodes)
        if node.target is c10d.wait_tensor.default
    ]  # fmt: skip
    reduce_scatter_waits = [index for index, waited in waits if waited is c10d.reduce_scatter_tensor.default]
    all_reduce_waits = [index for index, waited in waits if waited is c10d.all_reduce.default]
    # All-reduce k follows its reduce-scatter's wait at once (the last one, with nothing left to hide behind,
    # at the end) and is waited after reduce-scatter k+2 is issued: the first runs behind the last gradient's
    # compute.
    assert [index - 1 for index in all_reduces[:2]] == reduce_scatter_waits[:2]
    assert all_reduces[2] > reduce_scatter_waits[2]
    assert all_reduces[0] < tanhs[2] < all_reduce_waits[0]
    assert reduce_scatters[2] < all_reduce_waits[0]
    reorder(graph, reduce_scatter_depth=0)
    all_reduces = _position(graph, _is(c10d.all_reduce.default))
    for index in all_reduces:  # depth 0: each is waited at once
        assert list(graph.nodes)[index + 1].args[0] is list(graph.nodes)[index]


def test_schedule_leaves_graphs_without_annotated_collectives_alone():
    graph_module = trace(_three_layers, *_inputs())
    lower(graph_module.graph)
    before = graph_module.print_readable(print_output=False)
    assert reorder(graph_module.graph) == 0
    assert graph_module.print_readable(print_output=False) == before


# keep_order ------------------------------------------------------------------------


class _SchedulerNode:
    """A stand-in for an Inductor scheduler node: the attributes keep_order reads."""

    def __init__(self, name, origins, ancestors=()):
        self.name = name
        self.node = SimpleNamespace(get_origins=lambda: origins)
        self.ancestors = set(ancestors)

    def get_nodes(self):
        return [self]

    def get_operation_names(self):
        return {self.name}


def test_keep_fx_order_restores_the_fx_order_within_dependencies():
    graph_module = _lowered()
    reorder(graph_module.graph)
    nodes = list(graph_module.graph.nodes)
    gather = next(n for n in nodes if n.target is c10d.all_gather_into_tensor.default)
    mm = next(n for n in nodes if n.target is aten.mm.default)
    late_gather = [n for n in nodes if n.target is c10d.all_gather_into_tensor.default][1]
    first, second = _SchedulerNode("g0", [gather]), _SchedulerNode("mm", [mm], ["g0"])
    third = _SchedulerNode("g1", [late_gather])
    # Inductor put the prefetch (g1) after the matmul; the FX schedule has it before.
    assert [s.name for s in keep_order([first, second, third])] == ["g0", "g1", "mm"]
    # A dependency wins over the FX order.
    dependent = _SchedulerNode("g1", [late_gather], ["mm"])
    assert [s.name for s in keep_order([first, second, dependent])] == ["g0", "mm", "g1"]


def test_keep_fx_order_leaves_unannotated_graphs_alone():
    graph_module = trace(lambda x: x.sin().cos(), torch.randn(2))
    sin, cos = [n for n in graph_module.graph.nodes if n.op == "call_function"]
    snodes = [_SchedulerNode("cos", [cos]), _SchedulerNode("sin", [sin])]
    assert keep_order(snodes) is snodes


@pytest.fixture(autouse=True)
def fake_group():
    with FakeProcessGroup(WORLD):
        yield


# gather_buffers ----------------------------------------------------------------------


def _plan_buffers_keeping_the_simulated_step(graph, rewrites):
    """gather_buffers, then verify; the simulator sees the same schedule and memory: a rewritten result is its buffer."""
    before = simulate(graph, get_profile("h100_nvlink"))
    assert gather_buffers(graph) == rewrites
    verify(graph)
    after = simulate(graph, get_profile("h100_nvlink"))
    assert after.peak_memory_bytes == before.peak_memory_bytes
    assert after.step_seconds == pytest.approx(before.step_seconds)


@pytest.mark.parametrize("send_recv", [False, True], ids=["all_gather_out", "gloo_send_recv"])
def test_gather_buffers_gives_each_gather_an_allocated_output_kept_input_and_the_same_memory(monkeypatch, send_recv):
    gather_buffers_module = importlib.import_module("compile_shard.passes.gather_buffers")
    monkeypatch.setattr(gather_buffers_module, "gathers_by_send_recv", lambda *_: send_recv)
    graph_module = _traced()
    graph = graph_module.graph
    lower(graph)
    reorder(graph, prefetch_depth=1)
    _plan_buffers_keeping_the_simulated_step(graph, rewrites=3)
    assert not graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default)
    if send_recv:  # gloo ([Note: gloo all-gather]): fills its first argument, returns nothing
        gathers = graph.find_nodes(op="call_function", target=fsdp.all_gather_send_recv_.default)
        buffers = [gather.args[0] for gather in gathers]
        inputs = [gather.args[1] for gather in gathers]
        assert not graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor_out.default)
    else:
        gathers = graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor_out.default)
        buffers = [gather.kwargs["out"] for gather in gathers]
        inputs = [gather.args[0] for gather in gathers]
    assert len(gathers) == 3
    for gather, buffer, all_gather_input in zip(gathers, buffers, inputs):
        assert buffer.target is aten.new_empty.default
        assert list(buffer.meta["val"].shape) == [WORLD * all_gather_input.meta["val"].numel()]
        (wait,) = [user for user in waited_node(gather).users if user is not gather]
        assert wait.target is c10d.wait_tensor.default
        # Right after the real wait, a wait on the copy-in keeps it alive for Inductor's planner.
        assert wait.next.target is c10d.wait_tensor.default and wait.next.args == (all_gather_input,)


def test_gather_buffers_gives_gloo_reductions_an_allocated_exchange_buffer_and_the_same_memory(monkeypatch):
    for name in ("lower", "gather_buffers"):  # a gloo group ([Note: gloo reduce-scatter])
        pass_module = importlib.import_module(f"compile_shard.passes.{name}")
        monkeypatch.setattr(pass_module, "reduces_by_all_to_all", lambda *_: True)
    graph_module = trace(_backward_like, *[torch.randn(6, 4) for _ in range(3)], torch.randn(2, 4))
    graph = graph_module.graph
    _annotate_reductions(graph, ["c", "b", "a"])
    lower(graph)
    reorder(graph, reduce_scatter_depth=1)
    _plan_buffers_keeping_the_simulated_step(graph, rewrites=3)
    assert not graph.find_nodes(op="call_function", target=c10d.all_to_all_single.default)
    exchanges = graph.find_nodes(op="call_function", target=fsdp.all_to_all_into_.default)
    assert len(exchanges) == 3
    for exchange in exchanges:
        buffer, unsharded_grad, world_size, _ = exchange.args
        assert buffer.target is aten.new_empty.default and world_size == WORLD
        assert buffer.meta["val"].shape == unsharded_grad.meta["val"].shape
        (wait,) = [user for user in buffer.users if user is not exchange]
        (summed,) = wait.users
        assert summed.target is fsdp.sum_shards.default
        # The gradient's sends read it until the exchange is waited on.
        assert wait.next.target is c10d.wait_tensor.default and wait.next.args == (unsharded_grad,)


def test_gather_buffers_gives_each_reduction_input_a_planned_buffer_with_the_same_values():
    def fn(weight_grad, bias_grad):
        return torch.ops.fsdp.reduce_scatter_input([weight_grad, bias_grad], 3) * 2

    gradients = [torch.randn(5, 4), torch.randn(4)]
    graph_module = trace(fn, *gradients)
    expected = graph_module(*gradients)
    _plan_buffers_keeping_the_simulated_step(graph_module.graph, rewrites=1)
    assert not graph_module.graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_input.default)
    (fill,) = graph_module.graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_input_into_.default)
    buffer, unsharded_grads, world_size = fill.args
    # 2 padded rows of 4 and 2 padded entries per rank: [3 * 10] ([Note: one reduction input per group]).
    assert buffer.target is aten.new_empty.default and buffer.meta["val"].shape == (30,) and world_size == 3
    assert unsharded_grads == graph_module.graph.find_nodes(op="placeholder")
    graph_module.recompile()
    assert torch.equal(graph_module(*gradients), expected)


def test_gather_buffers_plans_a_cast_reduction_input_in_the_reduction_dtype(monkeypatch):
    """Mixed precision: bf16 gradients laid out in fp32; on gloo the exchange sends that buffer, not the gradients."""
    for name in ("lower", "gather_buffers"):  # a gloo group
        pass_module = importlib.import_module(f"compile_shard.passes.{name}")
        monkeypatch.setattr(pass_module, "reduces_by_all_to_all", lambda *_: True)

    def fn(weight_grad, bias_grad):
        reduction_input = torch.ops.fsdp.reduce_scatter_input([weight_grad, bias_grad], WORLD, torch.float32)
        return torch.ops.fsdp.reduce_scatter_grad(reduction_input, WORLD, GROUP)

    gradients = [torch.randn(5, 4, dtype=torch.bfloat16), torch.randn(4, dtype=torch.bfloat16)]
    graph_module = trace(fn, *gradients)
    lower(graph_module.graph)
    assert gather_buffers(graph_module.graph) == 2  # the exchange and the reduction input
    verify(graph_module.graph)
    assert not graph_module.graph.find_nodes(op="call_function", target=fsdp.all_to_all_grads_.default)
    (fill,) = graph_module.graph.find_nodes(op="call_function", target=fsdp.reduce_scatter_input_into_.default)
    buffer = fill.args[0]
    assert buffer.meta["val"].dtype == torch.float32 and buffer.meta["val"].shape == (2 * (12 + 2),)
    (exchange,) = graph_module.graph.find_nodes(op="call_function", target=fsdp.all_to_all_into_.default)
    assert exchange.args[1] is buffer
    expected = torch.empty(28)
    torch.ops.fsdp.reduce_scatter_input_into_(expected, gradients, WORLD)
    assert torch.equal(expected, torch.ops.fsdp.reduce_scatter_input(gradients, WORLD).float())


def _gather_use_and_reduce(world_size=WORLD, group_name=GROUP):
    """A group of a (5, 4) weight and a (5,) bias gathered and copied out as the runtime traces it, and a reduction."""
    padded_rows = -(-5 // world_size)
    padded_numels = [4 * padded_rows, padded_rows]

    def fn(shard_w, shard_b, x, grad_w, grad_b):
        gathered = torch.ops.fsdp.all_gather_into([shard_w, shard_b], padded_numels, world_size, group_name)
        per_rank_w, per_rank_b = gathered.view(world_size, -1).split(padded_numels, dim=1)
        weight = per_rank_w.clone().view(-1, 4)[:5]
        bias = per_rank_b.clone().view(-1)[:5]
        reduction_input = torch.ops.fsdp.reduce_scatter_input([grad_w * 2, grad_b * 2], world_size)
        return x @ weight.t() + bias, torch.ops.fsdp.reduce_scatter_grad(reduction_input, world_size, group_name)

    return fn


def _in_place_inputs(rank, world_size):
    padded_rows = -(-5 // world_size)
    rows = slice(rank * padded_rows, (rank + 1) * padded_rows)  # uneven: the last ranks hold fewer rows
    generator = torch.Generator().manual_seed(0)
    weight, bias, x = torch.randn(5, 4, generator=generator), torch.randn(5, generator=generator), torch.randn(3, 4)
    return weight[rows], bias[rows], x, torch.randn(5, 4) * (rank + 1), torch.randn(5) * (rank + 1)


def _lowered_with_copy_out(fn, inputs):
    graph_module = trace(fn, *inputs)
    _annotate(graph_module.graph, ["a"])
    lower(graph_module.graph)
    copy_out(graph_module.graph)
    return graph_module


def _gather_on_gloo(monkeypatch):
    for name in ("copy_out", "gather_buffers"):  # copy_out leaves a gloo group's concatenation to gather_buffers
        pass_module = importlib.import_module(f"compile_shard.passes.{name}")
        monkeypatch.setattr(pass_module, "gathers_by_send_recv", lambda *_: True)


def test_gather_buffers_on_gloo_exchanges_shards_and_gradients_in_place(monkeypatch):
    for name in ("lower", "gather_buffers"):  # a gloo group
        pass_module = importlib.import_module(f"compile_shard.passes.{name}")
        monkeypatch.setattr(pass_module, "reduces_by_all_to_all", lambda *_: True)
    _gather_on_gloo(monkeypatch)
    graph_module = _lowered_with_copy_out(_gather_use_and_reduce(), _in_place_inputs(1, WORLD))
    graph = graph_module.graph
    before = simulate(graph, get_profile("cpu_gloo"))
    assert gather_buffers(graph) == 2
    verify(graph)
    shard_w, shard_b, _, grad_w, grad_b = graph.find_nodes(op="placeholder")
    # No copy-in, copy-out or reduction input is left: [Note: gloo exchange in place].
    copies = (aten.clone.default, aten.cat.default, fsdp.copy_in.default, fsdp.reduce_scatter_input.default)
    for target in copies:
        assert not graph.find_nodes(op="call_function", target=target), target
    (gather,) = graph.find_nodes(op="call_function", target=fsdp.all_gather_params_.default)
    unsharded_params, shards, padded_numels, world_size, _ = gather.args
    assert shards == [shard_w, shard_b] and padded_numels == [12, 3] and world_size == WORLD
    assert unsharded_params.target is aten.new_empty.default and unsharded_params.meta["val"].shape == (30,)
    (wait,) = [user for user in unsharded_params.users if user is not gather]
    # The parameters read their segments of the filled buffer: 2 ranks x 12 weight, then 2 x 3 bias elements.
    segments = sorted(user.args[2:] for user in wait.users if user.target is aten.slice.Tensor)
    assert segments == [(0, 24), (24, 30)]
    (exchange,) = graph.find_nodes(op="call_function", target=fsdp.all_to_all_grads_.default)
    received, gradients, world_size, _ = exchange.args
    assert [g.target for g in gradients] == [aten.mul.Tensor] * 2 and gradients[0].args[0] is grad_w
    (exchange_wait,) = [user for user in received.users if user is not exchange]
    assert [user.target for user in exchange_wait.users] == [fsdp.sum_shards.default]
    # The transfers read the shards and gradients until their waits: one more wait on each.
    for wait_node, read in ((wait, [shard_w, shard_b]), (exchange_wait, gradients)):
        kept = [wait_node.next, wait_node.next.next]
        assert [node.target for node in kept] == [c10d.wait_tensor.default] * 2
        assert [node.args[0] for node in kept] == read
    after = simulate(graph, get_profile("cpu_gloo"))
    assert after.peak_memory_bytes < before.peak_memory_bytes
    assert after.step_seconds < before.step_seconds


def test_gather_buffers_on_gloo_exchanges_mixed_precision_shards_cast(monkeypatch):
    """The copy-in casts to bf16 (``param_dtype``): the exchange sends each shard cast, and only what it casts."""
    _gather_on_gloo(monkeypatch)

    def fn(shard_w, shard_b, x):
        gathered = torch.ops.fsdp.all_gather_into([shard_w, shard_b], [12, 3], WORLD, GROUP, param_dtype=torch.bfloat16)
        per_rank_w, per_rank_b = gathered.view(WORLD, -1).split([12, 3], dim=1)
        weight = per_rank_w.clone().view(-1, 4)[:5]
        bias = per_rank_b.clone().view(-1)[:5]
        return x @ weight.t().float() + bias.float()

    shard_w, _, x = _in_place_inputs(0, WORLD)[:3]
    graph_module = _lowered_with_copy_out(fn, (shard_w, torch.randn(3, dtype=torch.bfloat16), x))
    graph = graph_module.graph
    assert gather_buffers(graph) == 1
    verify(graph)
    assert not graph.find_nodes(op="call_function", target=fsdp.copy_in.default)
    (gather,) = graph.find_nodes(op="call_function", target=fsdp.all_gather_params_.default)
    (cast, bf16_shard) = gather.args[1]
    shard_w_node, shard_b_node, _ = graph.find_nodes(op="placeholder")
    assert cast.target is torch.ops.prims.convert_element_type.default and cast.args == (shard_w_node, torch.bfloat16)
    assert bf16_shard is shard_b_node
    assert gather.args[0].meta["val"].dtype == torch.bfloat16


def test_gather_buffers_keeps_the_copies_of_a_gather_whose_buffer_is_saved(monkeypatch):
    _gather_on_gloo(monkeypatch)

    def gather_and_save(shard_w, shard_b, x, grad_w, grad_b):
        gathered = torch.ops.fsdp.all_gather_into([shard_w, shard_b], [12, 3], WORLD, GROUP)
        per_rank_w, _ = gathered.view(WORLD, -1).split([12, 3], dim=1)
        return x @ per_rank_w.clone().view(-1, 4)[:5].t(), gathered  # the buffer leaves the graph

    graph_module = _lowered_with_copy_out(gather_and_save, _in_place_inputs(0, WORLD))
    assert gather_buffers(graph_module.graph) == 1
    verify(graph_module.graph)
    assert graph_module.graph.find_nodes(op="call_function", target=fsdp.all_gather_send_recv_.default)
    assert not graph_module.graph.find_nodes(op="call_function", target=fsdp.all_gather_params_.default)


def _in_place_exchange_computes_the_same(rank, world_size):
    import torch.distributed as dist

    group_name = dist.group.WORLD.group_name
    padded_rows = -(-5 // world_size)

    def one_parameter(shard_w, shard_b, x, grad_w, grad_b):
        """A group of the weight alone: copy_out leaves its clone, so its readers get a slice of the buffer."""
        gathered = torch.ops.fsdp.all_gather_into([shard_w], [4 * padded_rows], world_size, group_name)
        weight = gathered.view(world_size, -1).split([4 * padded_rows], dim=1)[0].clone().view(-1, 4)[:5]
        return x @ weight.t() + shard_b.sum()

    inputs = _in_place_inputs(rank, world_size)
    for fn, rewrites in ((_gather_use_and_reduce(world_size, group_name), 2), (one_parameter, 1)):
        graph_module = _lowered_with_copy_out(fn, inputs)  # fake tensors in meta, real collectives when run
        graph_module.recompile()
        expected = graph_module(*inputs)
        assert gather_buffers(graph_module.graph) == rewrites
        assert graph_module.graph.find_nodes(op="call_function", target=fsdp.all_gather_params_.default)
        assert not graph_module.graph.find_nodes(op="call_function", target=aten.clone.default)
        if rewrites == 2:
            assert graph_module.graph.find_nodes(op="call_function", target=fsdp.all_to_all_grads_.default)
        graph_module.recompile()
        for _ in range(2):  # the second call reuses the tags' order on every rank
            for value, expected_value in zip(graph_module(*inputs), expected):
                assert torch.equal(value, expected_value)


@pytest.mark.parametrize("world_size", [2, 3])
def test_in_place_gloo_exchange_computes_what_the_copies_compute(world_size):
    run_gloo(_in_place_exchange_computes_the_same, world_size)


def test_gather_buffers_leaves_graphs_without_gathers_alone():
    graph_module = trace(lambda x: x.sin() + 1, torch.randn(4))
    before = graph_module.print_readable(print_output=False)
    assert gather_buffers(graph_module.graph) == 0
    assert graph_module.print_readable(print_output=False) == before
