"""torch.compile(sharded_model): one forward and one backward graph, collectives inside them."""

import importlib
import re
import warnings
from collections import Counter

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor

from compile_shard._collectives import node_collective
from compile_shard.debug import recompiles
from compile_shard.models import LlamaConfig
from compile_shard.passes import settings, verify, verify_forward
from dist_utils import FakeProcessGroup, build_sharded_llama, copy_out_in_regions, global_batch, lm_loss, run_gloo
from graph_utils import CapturingBackend, op_counts, pass_settings


def _lowered_counts(graph: torch.fx.Graph) -> Counter:
    """``op_counts``, plus the gradients that reach a gloo exchange as a zero-padded copy."""
    exchanges = graph.find_nodes(op="call_function", target=torch.ops.fsdp.all_to_all_grads_.default)
    padded = [g for n in exchanges for g in n.args[1] if g.target is torch.ops.aten.slice_scatter.default]
    return op_counts(graph) + Counter(padded_gradients=len(padded))


def _region_calls(graph: torch.fx.Graph) -> int:
    return len(graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph))


N_LAYERS = 2
GROUPS = N_LAYERS + 1

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "per_group_collectives")


def _compile_and_step(
    world_size, steps=2, min_cut=False, block_reshard=None, root_reshard=None, fullgraph=True, checkpoint_blocks=False
):
    capture = CapturingBackend(min_cut=min_cut)
    config = LlamaConfig(n_layers=N_LAYERS, checkpoint_blocks=checkpoint_blocks)
    with FakeProcessGroup(world_size):
        model, _ = build_sharded_llama(config, block_reshard=block_reshard, root_reshard=root_reshard)
        compiled = torch.compile(model, backend=capture.backend, fullgraph=fullgraph)
        tokens = torch.randint(0, 1001, (2, 9))
        for _ in range(steps):
            lm_loss(compiled, tokens).backward()
    return model, capture


def _unsharded_shapes(model, world_size):
    """Shapes an unsharded parameter (or its padded copy-out) has."""
    shapes = set()
    for param in model.parameters():
        padded_rows = -(-param.shape[0] // world_size) * world_size
        shapes |= {tuple(param.shape), (padded_rows, *param.shape[1:]), (world_size * param.to_local().numel(),)}
    return shapes


@pytest.mark.parametrize("checkpoint_blocks", [False, True], ids=["plain", "checkpointed_blocks"])
@pytest.mark.parametrize("world_size", [2, 8])
@pytest.mark.parametrize("min_cut", [False, True], ids=["default_partitioner", "min_cut_partitioner"])
def test_one_forward_and_one_backward_graph_with_the_collectives(world_size, min_cut, checkpoint_blocks):
    _, capture = _compile_and_step(world_size, steps=3, min_cut=min_cut, checkpoint_blocks=checkpoint_blocks)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"] and recompiles() == 0
    assert len(capture.forward_graphs) == 1 and len(capture.backward_graphs) == 1
    forward, backward = capture.forward_graphs[0].graph, capture.backward_graphs[0].graph
    # Default wrapping: the blocks reshard after forward, the root does not.
    assert op_counts(forward) == {"all_gather": GROUPS, "wait": GROUPS}
    assert op_counts(backward) == {"all_gather": N_LAYERS, "reduce_scatter": GROUPS, "wait": N_LAYERS + GROUPS}
    verify_forward(forward)
    verify(backward)


@pytest.mark.parametrize("world_size", [2, 8])
def test_joint_graph_holds_fsdp_ops_before_the_suite_and_c10d_after(world_size):
    with pass_settings(refunctionalize=False, reshard=False, lower=False, verify=False):
        _, raw = _compile_and_step(world_size, steps=1)
    assert op_counts(raw.joint_graphs[0].graph) == {"fsdp.all_gather_into": GROUPS, "fsdp.reduce_scatter_grad": GROUPS}
    torch._dynamo.reset()
    _, lowered = _compile_and_step(world_size, steps=1)
    joint = lowered.joint_graphs[0].graph
    assert op_counts(joint) == {"all_gather": GROUPS, "reduce_scatter": GROUPS, "wait": 2 * GROUPS}


@pytest.mark.parametrize("checkpoint_blocks", [False, True], ids=["plain", "checkpointed_blocks"])
@pytest.mark.parametrize("min_cut", [False, True], ids=["default_partitioner", "min_cut_partitioner"])
def test_resharding_saves_no_unsharded_parameter(min_cut, checkpoint_blocks):
    world_size = 8
    model, capture = _compile_and_step(
        world_size, min_cut=min_cut, block_reshard=True, root_reshard=True, checkpoint_blocks=checkpoint_blocks
    )
    forward, backward = capture.forward_graphs[0].graph, capture.backward_graphs[0].graph
    (output,) = forward.find_nodes(op="output")
    saved_shapes = {tuple(node.meta["val"].shape) for node in output.all_input_nodes if "val" in node.meta}
    assert not saved_shapes & _unsharded_shapes(model, world_size)
    assert op_counts(backward)["all_gather"] == GROUPS  # every group re-gathers


@pytest.mark.parametrize("checkpoint_blocks", [False, True], ids=["plain", "checkpointed_blocks"])
@pytest.mark.parametrize("min_cut", [False, True], ids=["default_partitioner", "min_cut_partitioner"])
def test_no_resharding_saves_gathered_parameters_and_backward_does_not_regather(min_cut, checkpoint_blocks):
    _, capture = _compile_and_step(
        8, min_cut=min_cut, block_reshard=False, root_reshard=False, checkpoint_blocks=checkpoint_blocks
    )
    assert op_counts(capture.backward_graphs[0].graph) == {"reduce_scatter": GROUPS, "wait": GROUPS}


def test_fullgraph_false_gives_the_same_single_graph():
    _, capture = _compile_and_step(2, fullgraph=False)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert len(capture.forward_graphs) == 1


def test_dynamo_graph_takes_one_input_per_sharded_parameter():
    """Each parameter enters the graph once, as its shard; neither its DTensor nor its local tensor
    is lifted beside it (an extra input, a guard and an aliasing check per parameter, see
    ``FSDPParam.validate_device`` and [Note: the shard autograd sees])."""
    graph_inputs = []

    def backend(graph_module, example_inputs):
        graph_inputs.append([type(tensor) for tensor in example_inputs])
        return graph_module.forward

    with FakeProcessGroup(2):
        model, _ = build_sharded_llama(LlamaConfig(n_layers=N_LAYERS))
        torch.compile(model, backend=backend, fullgraph=True)(torch.randint(0, 1001, (2, 9)))
    buffers = len(list(model.buffers()))
    (types,) = graph_inputs
    assert len(types) == len(list(model.parameters())) + buffers + 1  # + the tokens
    assert DTensor not in types


def _compiled_matches_eager(
    rank,
    world_size,
    backend,
    checkpoint_blocks,
    bucket_cap_mb=None,
    compile_regions=False,
    region_copy_out=False,
    n_layers=N_LAYERS,
):
    """``n_layers``: at least 3 for regions, as Dynamo inlines a region only one block calls."""
    settings.bucket_cap_mb = bucket_cap_mb
    settings.compile_regions = compile_regions
    config = LlamaConfig(n_layers=n_layers, checkpoint_blocks=checkpoint_blocks)
    compiled_model, _ = build_sharded_llama(config)
    if region_copy_out:
        copy_out_in_regions(compiled_model)
    eager_model, _ = build_sharded_llama(config)
    # "scheduled": the pre-grad pass, aot_eager's min-cut partitioner, then the partitioned
    # suite (reorder), as Inductor's hooks run them; aot_eager itself has no such hooks.
    capture = CapturingBackend(min_cut=True, pre_grad=True)
    compiled_backend = capture.backend if backend == "scheduled" else backend
    lowered_graphs = []
    lowered_region_calls = []  # per outer graph Inductor lowers, forward first
    if backend == "inductor":  # a post-grad pass after the suite's sees the graphs Inductor lowers
        inductor_config = torch._inductor.config
        installed = inductor_config.post_grad_custom_post_pass

        def run_installed_then_record(graph):
            installed(graph)
            lowered_graphs.append(_lowered_counts(graph))
            if lowered_graphs[-1]["wait"]:
                lowered_region_calls.append(_region_calls(graph))

        inductor_config.post_grad_custom_post_pass = run_installed_then_record
        inductor_config.fx_graph_cache = False  # a cache hit would skip the pass
        torch._functorch.config.enable_autograd_cache = False
    compiled = torch.compile(compiled_model, backend=compiled_backend, fullgraph=True)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (compiled_model, eager_model)]
    # Inductor fuses and reorders fp32 arithmetic; AdamW turns last-bit differences of
    # near-zero gradients into ~1e-6 parameter differences (see tests/test_parity.py).
    param_atol = 2e-5 if backend == "inductor" else 0.0
    # Steps 0-4 compiled; then the same model alternates: eager, compiled.
    schedule = [compiled] * 5 + [compiled_model, compiled]
    for step, model in enumerate(schedule):
        tokens = global_batch(step, world_size, 2, 16, config.vocab_size)[2 * rank : 2 * rank + 2]
        losses = []
        for m, optimizer in zip((model, eager_model), optimizers):
            loss = lm_loss(m, tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=1e-6)
    for param, eager_param in zip(compiled_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(param.full_tensor(), eager_param.full_tensor(), rtol=0, atol=param_atol)
    assert counters["stats"]["unique_graphs"] == 1, counters["stats"]
    assert not counters["graph_break"] and recompiles() == 0
    # The outer forward and backward (compile regions' subgraphs hold no collective).
    outer_graphs = [counts for counts in lowered_graphs if counts["wait"]]
    assert len(outer_graphs) == (2 if backend == "inductor" else 0)
    if compile_regions and not checkpoint_blocks and backend in ("inductor", "scheduled"):
        # Every block calls its region, the first included ([Note: the first block calls its region after Dynamo]).
        forward_graph = capture.forward_graphs[0].graph if backend == "scheduled" else None
        assert (lowered_region_calls[0] if forward_graph is None else _region_calls(forward_graph)) == n_layers
    for counts in outer_graphs:
        # On gloo every all-gather and every reduction's exchange write into Inductor's
        # buffers ([Note: gloo all-gather], passes/gather_buffers.py), straight from the
        # shards and the gradients ([Note: gloo exchange in place]); a region that copies
        # out takes its group rank-major, received into a buffer too.
        if region_copy_out:
            assert counts["all_gather_send_recv_"] > 0, counts
        else:
            assert counts["all_gather_params_"] > 0, counts
            assert not counts["all_gather_send_recv_"] and not counts["all_to_all_into_"], counts
        assert not counts["all_gather"] and not counts["all_gather_out"] and not counts["all_to_all"], counts
    if outer_graphs:
        assert outer_graphs[1]["all_to_all_grads_"] > 0, outer_graphs[1]
        # The uneven embedding's gradient is sent as it is: the exchange pads its last
        # rows itself, so no kernel copies the whole gradient into padded rows first.
        assert not outer_graphs[1]["padded_gradients"], outer_graphs[1]
    if backend == "scheduled" and bucket_cap_mb:
        # The blocks share one bucket; the root (no resharding) cannot join them.
        assert op_counts(capture.forward_graphs[0].graph)["all_gather"] == 2
        # On gloo a reduction is an all-to-all ([Note: gloo reduce-scatter]).
        assert op_counts(capture.backward_graphs[0].graph)["all_to_all"] == 2


# Inductor on gloo runs with compile regions, the default, in test_regions (2 ranks;
# 3 ranks with checkpointed blocks; 3 ranks bucketed), where each model's first block
# runs inlined, and in test_mixed_precision (2 ranks, bf16); its graphs on a fake process
# group in test_graphs_given_to_inductor_hold_c10d_collectives_only. aot_eager's bitwise
# equality with eager is checked at 2 ranks by test_mixed_precision, test_frozen,
# test_gradient_sync and test_hsdp, and at 3 ranks with every block inlined and bucketed
# by the test below.
def test_bucketed_and_reordered_training_matches_eager_on_gloo():
    """A cap that merges every group into one bucket; reorder on (the default).

    With the scheduled partition (aot_eager); Inductor runs a bucket in
    tests/test_regions.py::test_bucketed_regions_match_eager_on_gloo.
    """
    run_gloo(_compiled_matches_eager, 3, "scheduled", False, 1000.0)


@pytest.mark.parametrize("region_copy_out", [False, True], ids=["gloo_copy_out", "region_copy_out"])
def test_regions_through_inductors_passes_match_eager_on_gloo(region_copy_out):
    """Every block in its region, the first included, with Inductor's passes and eager kernels: bitwise eager."""
    run_gloo(_compiled_matches_eager, 2, "scheduled", False, None, True, region_copy_out, 3)


@pytest.mark.slow
def test_graphs_given_to_inductor_hold_c10d_collectives_only():
    graphs = []

    def capture(graph):
        graphs.append(op_counts(graph))

    with torch._inductor.config.patch(post_grad_custom_pre_pass=capture), FakeProcessGroup(2):
        model, _ = build_sharded_llama(LlamaConfig(n_layers=N_LAYERS))
        compiled = torch.compile(model, fullgraph=True)  # the default backend: Inductor
        lm_loss(compiled, torch.randint(0, 1001, (2, 9))).backward()
    forward, backward = graphs
    assert forward == {"all_gather": GROUPS, "wait": GROUPS}
    assert backward == {"all_gather": N_LAYERS, "reduce_scatter": GROUPS, "wait": N_LAYERS + GROUPS}


def test_graph_break_inside_a_sharded_model_warns_once_naming_the_groups():
    from compile_shard.models import TransformerBlock
    from compile_shard.passes import ShardedGraphBreakWarning

    class BreakingBlock(TransformerBlock):
        def forward(self, x, cos, sin):
            torch._dynamo.graph_break()
            return super().forward(x, cos, sin)

    capture = CapturingBackend()
    with FakeProcessGroup(2):
        config = LlamaConfig(n_layers=N_LAYERS)
        torch.manual_seed(0)
        from compile_shard import fully_shard
        from compile_shard.models import Llama

        model = Llama(config)
        model.layers[1] = BreakingBlock(config)
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        compiled = torch.compile(model, backend=capture.backend)
        tokens = torch.randint(0, 1001, (2, 9))
        with pytest.warns(ShardedGraphBreakWarning) as first_step:
            lm_loss(compiled, tokens).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error", ShardedGraphBreakWarning)  # once per split, not per step
            lm_loss(compiled, tokens).backward()
    (message,) = [str(w.message) for w in first_step if issubclass(w.category, ShardedGraphBreakWarning)]
    # The root gathered every group in its first graph; the break in layers.1 makes
    # all of them cross into the graphs after it.
    assert "the unsharded parameters of ['Llama', 'layers.0', 'layers.1'] leave this graph as outputs" in message
    assert "torch._dynamo.graph_break()" in message


def test_fullgraph_error_names_what_broke():
    from compile_shard.models import TransformerBlock

    class BlockWithPrint(TransformerBlock):
        def forward(self, x, cos, sin):
            print_shapes_for_debugging(x)
            return super().forward(x, cos, sin)

    def print_shapes_for_debugging(x):
        torch._dynamo.graph_break()

    with FakeProcessGroup(2):
        from compile_shard import fully_shard
        from compile_shard.models import Llama

        torch.manual_seed(0)
        model = Llama(LlamaConfig(n_layers=1))
        model.layers[0] = BlockWithPrint(LlamaConfig(n_layers=1))
        fully_shard(model.layers[0])
        fully_shard(model)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        with pytest.raises(torch._dynamo.exc.Unsupported, match=r"(?s)graph_break.*print_shapes_for_debugging"):
            compiled(torch.randint(0, 1001, (2, 8)))


@pytest.mark.parametrize(
    "settings_, prefetch_depth",
    [
        ({"prefetch_depth": 0}, 0),
        ({"prefetch_depth": 1}, 1),
        ({}, 0),  # CPU graphs default to the cpu_gloo profile, which cannot overlap: no prefetch
        ({"cost_profile": "h100_nvlink"}, 1),  # a profile that overlaps: prefetch by default
    ],
    ids=["depth_0", "depth_1", "default_cpu_gloo", "default_h100"],
)
def test_each_block_is_gathered_prefetch_depth_blocks_ahead(settings_, prefetch_depth):
    """The trace gathers every group up front; `place` and `reorder` put each gather where the schedule wants it."""
    with pass_settings(**settings_):
        _, capture = _compile_and_step(2, steps=1)
    nodes = list(capture.forward_graphs[0].graph.nodes)
    gathers = [i for i, n in enumerate(nodes) if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default]
    waits = [i for i, n in enumerate(nodes) if n.target is torch.ops._c10d_functional.wait_tensor.default]
    matmuls = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default]
    assert len(gathers) == len(waits) == GROUPS
    # The blocks, in order: with prefetch, block 1 is issued before block 0 computes.
    computes_between = [any(a < m < b for m in matmuls) for a, b in zip(gathers[1:], gathers[2:])]
    assert computes_between == [prefetch_depth == 0] * (N_LAYERS - 1)
    # Either way a block's wait comes only after the previous block computed.
    for earlier, later in zip(waits[1:], waits[2:]):
        assert any(earlier < m < later for m in matmuls)


def _inductor_code(bucket_cap_mb=0):
    from torch._inductor.utils import run_and_get_code

    # Depth 1 explicitly: on CPU (the cpu_gloo profile, no overlap) the default is 0.
    with FakeProcessGroup(2), pass_settings(bucket_cap_mb=bucket_cap_mb, prefetch_depth=1, reduce_scatter_depth=1):
        model, _ = build_sharded_llama(LlamaConfig(n_layers=N_LAYERS))
        compiled = torch.compile(model, fullgraph=True)
        tokens = torch.randint(0, 1001, (2, 9))
        _, (forward, backward) = run_and_get_code(lambda: lm_loss(compiled, tokens).backward())
    return forward, backward


def _calls(code: str) -> list[str]:
    return [line.strip() for line in code.splitlines() if "(" in line and not line.strip().startswith(("def ", "#"))]


_GATHER_OUT = re.compile(r"all_gather_into_tensor_out\.default\(.*out=(buf\d+)\)")


@pytest.mark.xfail(
    (2, 14) <= torch.__version__ < (2, 15),
    reason="Inductor 2.14 spreads a copy-out over two kernels (docs/torch-2.13-findings.md)",
    strict=True,
)
@pytest.mark.slow
@pytest.mark.parametrize("bucket_cap_mb", [0, 1000.0], ids=["per_group", "bucketed"])
def test_inductor_emits_one_copy_out_kernel_per_gather_and_keeps_the_schedule(bucket_cap_mb):
    forward, backward = _inductor_code(bucket_cap_mb)
    calls = _calls(forward)
    assert not any("all_gather_into_tensor.default(" in line for line in calls)  # gather_buffers rewrote them
    gathers = [match.group(1) for line in calls if (match := _GATHER_OUT.search(line))]
    assert len(gathers) == (2 if bucket_cap_mb else GROUPS)
    for buffer in gathers:
        # A block whose region copies out reads its gather with one fsdp.copy_out ([Note: a region copies out
        # its block's parameters]); the others with a generated kernel.
        readers = [
            line
            for line in calls
            if re.search(rf"\b{buffer}\b", line) and ("cpp_fused" in line or "fsdp.copy_out.default(" in line)
        ]
        assert len(readers) == 1, f"the copy-out of {buffer} is spread over {len(readers)} kernels: {readers}"
    # Prefetch survives Inductor's scheduler: a gather is issued while the previous one is still unwaited.
    order = [("issue" if _GATHER_OUT.search(line) else "wait", line)
             for line in calls if _GATHER_OUT.search(line) or "wait_tensor.default(" in line]
    issued_before_previous_wait = any(
        kind == "issue" and later_kind == "issue" for (kind, _), (later_kind, _) in zip(order, order[1:])
    )
    assert issued_before_previous_wait, order
    # The gathered buffers are Inductor's: its planner hands one to a later allocation
    # (per group; one bucket for all blocks leaves nothing of its size to reuse it for).
    # torch 2.11's planner frees each one (`del bufN`) instead.
    reused = [
        buffer
        for code in (forward, backward)
        for buffer in _GATHER_OUT.findall(code)
        if re.search(rf"; del {buffer}  # reuse", code)
    ]
    planner_reuses_gathers = torch.__version__ >= (2, 13)
    assert reused or bucket_cap_mb or not planner_reuses_gathers, "no all-gather buffer was reused"
    # A reduce-scatter overlaps compute: kernels run between its issue and its wait. Only
    # the embedding's backward follows block 0's gradients, so the last two reductions
    # (block 0's, the root's) have nothing to hide behind; with one bucket for all
    # blocks, neither has any.
    calls = _calls(backward)
    issues = [index for index, line in enumerate(calls) if "reduce_scatter_tensor.default(" in line]
    assert len(issues) == (2 if bucket_cap_mb else GROUPS)
    for index in [] if bucket_cap_mb else issues[:-2]:
        buffer = calls[index].split(" = ")[0]
        wait = next(i for i, later in enumerate(calls) if f"wait_tensor.default({buffer})" in later)
        assert any("extern_kernels" in between or "cpp_fused" in between for between in calls[index + 1 : wait])


_COLLECTIVE_CALL = re.compile(r"_c10d_functional\.(all_gather_into_tensor_out|reduce_scatter_tensor|all_to_all_single)\.default\(")


def test_inductor_issues_the_collectives_in_the_scheduled_order():
    """[Note: Inductor's own collective passes] in passes/install.py: the order ``reorder`` chose is the one emitted.

    torch 2.15 moves waits later and collectives earlier after the scheduler
    (``aten_distributed_optimizations.enable_simple_overlap``, on by default); it must
    not issue one collective before another that the scheduled graph issues first.
    """
    install = importlib.import_module("compile_shard.passes.install")  # the package's ``install`` is the function
    scheduled = []
    run = install.run_partitioned_suite

    def recording(graph, **kwargs):
        moved = run(graph, **kwargs)
        scheduled.append([found.kind for node in graph.nodes if (found := node_collective(node)) is not None])
        return moved

    install.run_partitioned_suite = recording
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
            codes = _inductor_code()
    finally:
        install.run_partitioned_suite = run
    kinds = {"all_gather_into_tensor_out": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}
    emitted = [[kinds[match.group(1)] for match in _COLLECTIVE_CALL.finditer(code)] for code in codes]
    assert emitted == scheduled and all(emitted), (emitted, scheduled)
