"""settings.compile_regions: each sharded block traced once as a nested compile region, reused by every block."""

import contextlib
import copy
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import compilation_time_metrics, counters
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy

from compile_shard import RegionInlinedWarning, fully_shard
from compile_shard._annotation import write_group_annotation
from compile_shard._regions._attribute_writes import _OWNERS_ATTR
from compile_shard._regions import _dynamo, block_signature, flat_arguments
from compile_shard._regions._registry import RegionRegistry
from compile_shard.debug import dump_graphs, recompiles
from compile_shard.dry_run import capture_step
from compile_shard.models import Llama, LlamaConfig, TransformerBlock
from compile_shard.passes import ShardedGraphBreakWarning, settings
from compile_shard.passes.cost_model import compute_seconds, get_profile
from compile_shard.passes.compile_regions import compile_regions
from compile_shard.passes.simulate import simulate_step
from dist_utils import (
    FakeProcessGroup,
    build_sharded_llama,
    copy_out_in_regions,
    global_batch,
    lm_loss,
    run_gloo,
    step_optimizers_and_compare,
)
from graph_utils import CapturingBackend, make_annotation, op_counts, pass_settings
from test_compile import _compiled_matches_eager
from test_parity import _reused_block_worker

pytestmark = [
    pytest.mark.usefixtures("fresh_dynamo", "per_group_collectives"),
]

N_LAYERS = 3
# The first block of each key runs inlined ([Note: the first block of each key runs inlined]).
REGION_BLOCKS = N_LAYERS - 1
invoke_subgraph = torch.ops.higher_order.invoke_subgraph


def _compile_with_regions(world_size, block_reshard=None, checkpoint_blocks=False):
    capture = CapturingBackend(min_cut=True)
    with FakeProcessGroup(world_size), pass_settings(compile_regions=True):
        config = LlamaConfig(n_layers=N_LAYERS, checkpoint_blocks=checkpoint_blocks)
        model, _ = build_sharded_llama(config, block_reshard=block_reshard)
        compiled = torch.compile(model, backend=capture.backend, fullgraph=True)
        tokens = torch.randint(0, 1001, (2, 9))
        for _ in range(2):
            lm_loss(compiled, tokens).backward()
    return model, capture


def _shard_blocks_and_root(model: nn.Module) -> None:
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def _region_calls(graph: fx.Graph) -> list[fx.Node]:
    return graph.find_nodes(op="call_function", target=invoke_subgraph)


def _region_body_traces() -> int:
    """How many region bodies Dynamo traced; a reused one is stamped out instead.

    Dynamo merges equal bodies into one subgraph even where their keys differ, so the
    graph's subgraph names cannot tell a reused region from one traced again.
    """
    return len(compilation_time_metrics.get("invoke_subgraph_trace", []))


@pytest.mark.parametrize("world_size", [2, 8])
def test_every_block_calls_one_region_and_backward_gathers_again(world_size):
    model, capture = _compile_with_regions(world_size)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"] and recompiles() == 0
    (forward,), (backward,) = capture.forward_graphs, capture.backward_graphs
    forward_regions = _region_calls(forward.graph)
    assert len(forward_regions) == REGION_BLOCKS
    assert len({node.args[1] for node in forward_regions}) == 1  # one subgraph, stamped out per block
    assert _region_body_traces() == 1
    assert len(_region_calls(backward.graph)) == REGION_BLOCKS
    # The cost model charges a region what its nodes cost (the block's matmuls), not its bytes.
    profile = get_profile("h100_nvlink")
    region = getattr(forward, forward_regions[0].args[0].target)
    inner = sum(compute_seconds(node, profile) for node in region.graph.nodes)
    assert inner > 0 and compute_seconds(forward_regions[0], profile) == inner
    _assert_reshards(model, forward, backward)


@pytest.mark.parametrize(
    "reuse_first_blocks, cost_profile, reused",
    [(True, "h100_nvlink", True), (False, None, False), (None, None, True), (None, "h100_nvlink", False)],
    ids=["on", "off", "default_on_cpu", "default_where_communication_overlaps"],
)
def test_inductors_pre_grad_hook_makes_the_first_block_call_its_region_too(reuse_first_blocks, cost_profile, reused):
    """[Note: the first block calls its region after Dynamo]. By default only where the cost profile overlaps
    no communication: elsewhere the inlined first block hides its reduce-scatter (``reuses_first_blocks``)."""
    capture = CapturingBackend(min_cut=True, pre_grad=True)
    overrides = {"reuse_first_blocks": reuse_first_blocks, "cost_profile": cost_profile}
    with FakeProcessGroup(2), pass_settings(compile_regions=True, **overrides):
        model, _ = build_sharded_llama(LlamaConfig(n_layers=N_LAYERS))
        compiled = torch.compile(model, backend=capture.backend, fullgraph=True)
        tokens = torch.randint(0, 1001, (2, 9))
        for _ in range(2):
            lm_loss(compiled, tokens).backward()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"] and recompiles() == 0
    (forward,), (backward,) = capture.forward_graphs, capture.backward_graphs
    forward_regions = _region_calls(forward.graph)
    blocks_in_regions = N_LAYERS if reused else REGION_BLOCKS
    assert len(forward_regions) == len(_region_calls(backward.graph)) == blocks_in_regions
    assert len({node.args[1] for node in forward_regions}) == 1 and _region_body_traces() == 1
    _assert_reshards(model, forward, backward)


def test_a_traced_forward_mutates_two_lists_per_group_and_no_parameter(monkeypatch):
    """Dynamo replays, and formats a stack for, every object a trace mutates ([Note: one mutated list per group])."""
    side_effects = torch._dynamo.side_effects.SideEffects
    if not hasattr(side_effects, "_format_side_effect_message"):
        pytest.skip("this torch formats no message per mutated object")
    mutated = []
    original = side_effects._format_side_effect_message

    def recording(self, var):
        mutated.append(var.python_type_name())
        return original(self, var)

    monkeypatch.setattr(side_effects, "_format_side_effect_message", recording)
    _compile_with_regions(2)
    groups = N_LAYERS + 1
    assert "FSDPParam" not in mutated
    assert 0 < mutated.count("list") <= 2 * groups, mutated


def test_the_registry_hides_what_an_earlier_attempt_of_the_same_compile_learned(monkeypatch):
    """[Note: a restarted trace learns again]: an attempt replays the one before it, so it must not see
    what that one learned; another compile does, and ``reset()`` forgets everything."""
    attempt = [("compile 1", 0)]
    monkeypatch.setattr(_dynamo, "current_attempt", lambda: attempt[0])
    registry = RegionRegistry()
    registry.inline(7)
    registry.add_read_names(7, {"eps"})
    assert registry.runs_inlined(7) and registry.read_names(7) == {"eps"}
    attempt[0] = ("compile 1", 1)  # Dynamo restarted the trace
    assert not registry.runs_inlined(7) and registry.read_names(7) == frozenset()
    registry.add_read_names(7, {"scale"})  # a write drops what the failed attempt learned
    attempt[0] = ("compile 2", 0)
    assert not registry.runs_inlined(7) and registry.read_names(7) == {"scale"}
    registry.inline(7)
    attempt[0] = ("compile 3", 0)
    assert registry.runs_inlined(7)
    registry.reset()
    assert not registry.runs_inlined(7) and registry.read_names(7) == frozenset()


def _assert_reshards(model, forward, backward):
    """Backward gathers every block again; forward saves no gathered parameter."""
    assert op_counts(forward.graph)["all_gather"] == N_LAYERS + 1
    assert op_counts(backward.graph)["all_gather"] == N_LAYERS
    (output,) = forward.graph.find_nodes(op="output")
    # The root is not resharded: shapes its parameters share with the blocks' say nothing.
    block_only = {tuple(param.shape) for block in model.layers for param in block.parameters()} - {
        tuple(param.shape) for name, param in model.named_parameters() if not name.startswith("layers.")
    }
    saved = {tuple(node.meta["val"].shape) for node in output.args[0] if isinstance(node, fx.Node)}
    assert block_only and not saved & block_only, saved & block_only


def test_checkpointed_blocks_share_one_region():
    """Tracing the checkpoints writes nothing that keys the blocks apart ([Note: writes between blocks key them apart]).

    Inside a checkpoint the first block runs in its region too, since only a region may
    show it its parameters ([Note: a region copies out its block's parameters]): its
    body is traced before the blocks' reads are learned, the later blocks share a second.
    """
    _, capture = _compile_with_regions(2, checkpoint_blocks=True)
    assert len(_region_calls(capture.forward_graphs[0].graph)) == N_LAYERS
    assert _region_body_traces() == 2


def test_graph_dumps_list_the_region_bodies(tmp_path):
    with dump_graphs(tmp_path):
        _compile_with_regions(2)
    (forward,) = (tmp_path / "rank0").glob("graph_*/*_forward.txt")
    listing = forward.read_text()
    main, _, body = listing.partition("partitioned_fw_subgraph_0_0:\n")
    assert "invoke_subgraph(partitioned_fw_subgraph_0_0, " in main
    # The first block's 7 and the output projection; the other blocks' matmuls are in the body.
    assert main.count("aten.mm.default") == 8
    assert body.startswith("    ") and body.count("aten.mm.default") == 7


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic_length"])
def test_dry_run_capture_partitions_regions_like_inductor(symbolic):
    """Also with the sequence length symbolic, as Dynamo recompiles after it changed (``mark_dynamic``).

    Like Inductor, every block calls its region, the first included ([Note: the first
    block calls its region after Dynamo]).
    """
    with FakeProcessGroup(8), pass_settings(compile_regions=True):
        model, _ = build_sharded_llama(LlamaConfig(n_layers=N_LAYERS))
        tokens = torch.randint(0, 1001, (2, 9))
        forward, backward = capture_step(model, lambda compiled: lm_loss(compiled, tokens, symbolic_length=symbolic))
    sizes = [node.meta["val"] for node in forward.graph.find_nodes(op="placeholder")]
    assert any(isinstance(size, torch.SymInt) for size in sizes) == symbolic
    assert len(_region_calls(forward.graph)) == len(_region_calls(backward.graph)) == N_LAYERS
    assert op_counts(backward.graph)["all_gather"] == N_LAYERS
    simulation = simulate_step([forward.graph, backward.graph], get_profile("h100_nvlink"), world_size=8)
    assert simulation.compute_seconds > 0


@pytest.mark.slow
def test_a_dynamic_true_compile_and_structured_arguments_run_the_block_inlined():
    """``dynamic=True`` makes every number symbolic, a norm's ``eps`` too (``compiles_every_size_symbolic``)."""
    capture = CapturingBackend(min_cut=True)
    with FakeProcessGroup(2), pass_settings(compile_regions=True):
        model, _ = build_sharded_llama(LlamaConfig(n_layers=N_LAYERS))
        compiled = torch.compile(model, backend=capture.backend, fullgraph=True, dynamic=True)
        lm_loss(compiled, torch.randint(0, 1001, (2, 9))).backward()
    assert not _region_calls(capture.forward_graphs[0].graph)
    assert op_counts(capture.backward_graphs[0].graph)["all_gather"] == N_LAYERS
    assert flat_arguments([], (torch.ones(2), 3, None, (torch.ones(2), 1.0), []), {"scale": 0.5})[2]
    assert not flat_arguments([], ([[torch.ones(2)]],), {})[2]  # two levels deep
    assert not flat_arguments([], (), {"rope": {"cos": torch.ones(2)}})[2]


class _DictionaryBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x, rope):
        return self.linear(x) * rope["cos"]


class _DictionaryModel(nn.Module):
    """Blocks called with a dictionary, which a region's flat arguments cannot hold."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.blocks = nn.ModuleList(_DictionaryBlock() for _ in range(3))

    def forward(self, x):
        x = self.proj(x)
        rope = {"cos": x.new_ones(6)}
        for block in self.blocks:
            x = block(x, rope=rope)
        return x


def test_blocks_called_with_a_dictionary_run_inlined():
    capture = CapturingBackend(min_cut=True)
    with FakeProcessGroup(2), pass_settings(compile_regions=True):
        model = _DictionaryModel()
        _shard_blocks_and_root(model)
        compiled = torch.compile(model, backend=capture.backend, fullgraph=True)
        compiled(torch.randn(4, 6)).sum().backward()
    assert not _region_calls(capture.forward_graphs[0].graph)
    assert op_counts(capture.forward_graphs[0].graph)["all_gather"] == 4


class _HalvingLlama(Llama):
    """Its later blocks run on every other position: one block class called at two symbolic lengths."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for index, layer in enumerate(self.layers):
            if index == len(self.layers) // 2:
                h = h[:, ::2].contiguous()
            seq = h.shape[1]
            h = layer(h, self.rope_cos[:seq, None, :], self.rope_sin[:seq, None, :])
        return self.output(self.norm(h))


def _next_token_loss(model, tokens, halved):
    logits = model(tokens[:, :-1])
    targets = tokens[:, 1:][:, ::2] if halved else tokens[:, 1:]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _changing_lengths_worker(rank, world_size, model_class, n_layers, region_calls):
    settings.compile_regions = True
    config = LlamaConfig(n_layers=n_layers)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = model_class(config)
        for block in model.layers:
            fully_shard(block)
        models.append(fully_shard(model))
    capture = CapturingBackend(min_cut=True)
    compiled = torch.compile(models[0], backend=capture.backend, fullgraph=True)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-3) for model in models]
    for step, seq in enumerate([16, 24, 32, 20]):
        tokens = global_batch(step, world_size, 2, seq, config.vocab_size)[2 * rank : 2 * rank + 2]
        losses = [_next_token_loss(run, tokens, model_class is _HalvingLlama) for run in (compiled, models[1])]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
        step_optimizers_and_compare(optimizers, models[:1], models[1])
    # The second length recompiles with the sequence symbolic, once; its graphs call the regions.
    assert recompiles() == 1 and not counters["graph_break"]
    static, symbolic = capture.forward_graphs
    assert len(_region_calls(static.graph)) == len(_region_calls(symbolic.graph)) == region_calls
    assert len(_region_calls(capture.backward_graphs[1].graph)) == region_calls


@pytest.mark.parametrize(
    "model_class, n_layers, region_calls",
    [pytest.param(Llama, 4, 3, marks=pytest.mark.slow), pytest.param(_HalvingLlama, 6, 4, marks=pytest.mark.slow)],
    ids=["one_length", "two_lengths"],
)
def test_blocks_at_symbolic_lengths_call_their_region_and_match_eager_on_gloo(model_class, n_layers, region_calls):
    """After the sequence length changed: one region per symbolic length, bitwise eager with ``aot_eager``.

    Each length's first block runs inlined ([Note: the first block of each key runs
    inlined]); the halved blocks' key differs by their sizes' expressions ([Note:
    symbolic sizes in a reuse key]).
    """
    run_gloo(_changing_lengths_worker, 2, model_class, n_layers, region_calls)


def test_a_group_of_one_rank_runs_inlined():
    """Nothing to gather: the unsharded parameters are views of one tensor, which a region refuses as arguments."""
    capture = CapturingBackend(min_cut=True)
    with FakeProcessGroup(1), pass_settings(compile_regions=True):
        model, _ = build_sharded_llama(LlamaConfig(n_layers=N_LAYERS))
        compiled = torch.compile(model, backend=capture.backend, fullgraph=True)
        lm_loss(compiled, torch.randint(0, 1001, (2, 9))).backward()
    assert not _region_calls(capture.forward_graphs[0].graph)


def test_without_resharding_backward_reuses_the_gathered_parameters():
    _, capture = _compile_with_regions(2, block_reshard=False)
    assert op_counts(capture.backward_graphs[0].graph)["all_gather"] == 0


@pytest.mark.parametrize(
    "world_size, checkpoint_blocks, region_copy_out",
    [
        pytest.param(2, False, False, marks=pytest.mark.slow),
        pytest.param(2, False, True, marks=pytest.mark.slow),
        pytest.param(3, True, True, marks=pytest.mark.slow),
    ],
    ids=["2-plain_blocks", "2-plain_blocks-region_copy_out", "3-checkpointed_blocks-region_copy_out"],
)
def test_compiled_regions_match_eager_on_gloo(world_size, checkpoint_blocks, region_copy_out):
    """Inductor with regions: losses within 1e-6 and parameters within 2e-5 of eager over 7 steps, one graph.

    ``region_copy_out``: the regions copy out as they do off gloo (``copy_out_in_regions``).
    """
    run_gloo(_compiled_matches_eager, world_size, "inductor", checkpoint_blocks, None, True, region_copy_out, N_LAYERS)


@pytest.mark.parametrize("region_copy_out", [False, True], ids=["gloo_copy_out", "region_copy_out"])
def test_regions_under_aot_eager_match_eager_on_gloo(region_copy_out):
    """aot_eager, whose partitioner no joint pre-pass precedes: parameters bitwise eager's over 7 steps, one graph."""
    run_gloo(_compiled_matches_eager, 3, "aot_eager", False, None, True, region_copy_out, N_LAYERS)


def _assert_parameters_equal(models):
    for param, eager_param in zip(*(model.parameters() for model in models)):
        torch.testing.assert_close(param.full_tensor(), eager_param.full_tensor(), rtol=0, atol=0)


def _regions_with_a_setting_match_eager(rank, world_size, setting):
    settings.compile_regions = True
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_kwargs = {"bf16_policy": {"mp_policy": policy}, "not_resharded": {"reshard_after_forward": False}}
    config = LlamaConfig(n_layers=N_LAYERS)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = Llama(config)
        if setting == "checkpoint_wrapper":  # torchtitan's recipe: each its own partial(checkpoint, ...)
            model.layers = nn.ModuleList(checkpoint_wrapper(block) for block in model.layers)
        for block in model.layers:
            fully_shard(block, **shard_kwargs.get(setting, {}))
        models.append(fully_shard(model, **shard_kwargs.get(setting, {})))
    compiled = torch.compile(copy_out_in_regions(models[0]), backend="aot_eager", fullgraph=True)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-3) for model in models]
    micro_batches = 2 if setting == "keeping_unsharded" else 1
    for step in range(3):
        tokens = global_batch(step, world_size, 2, 16, config.vocab_size)[2 * rank : 2 * rank + 2]
        losses = []
        for model, run, optimizer in zip(models, (compiled, models[1]), optimizers):
            for micro_batch in range(micro_batches):
                last = micro_batch == micro_batches - 1
                if setting == "keeping_unsharded":
                    model.set_requires_gradient_sync(last)
                    model.set_reshard_after_backward(last)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting == "autocast"):
                    loss = lm_loss(run, tokens)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    _assert_parameters_equal(models)
    assert counters["stats"]["unique_graphs"] <= 2 and not counters["graph_break"]
    assert _region_body_traces() >= 1  # the blocks ran as regions, not inlined


@pytest.mark.parametrize(
    "setting",
    [
        pytest.param("bf16_policy", marks=pytest.mark.slow),
        pytest.param("autocast", marks=pytest.mark.slow),
        "not_resharded",
        pytest.param("keeping_unsharded", marks=pytest.mark.slow),
        "checkpoint_wrapper",
    ],
)
def test_regions_with_fsdp2_settings_match_eager_on_gloo(setting):
    """Regions with a bf16 policy, under autocast (the region saves its weights' bf16 copies), blocks kept
    gathered, parameters kept over micro-batches, or blocks in ``checkpoint_wrapper``: bitwise eager.

    The regions copy out as they do off gloo (``copy_out_in_regions``) where the setting lets them.
    """
    run_gloo(_regions_with_a_setting_match_eager, 3, setting)


def _hugging_face_llama_worker(rank, world_size):
    """Hugging Face's decoder layers take ``position_embeddings=(cos, sin)``: a tuple argument.

    Compiled with regions, bitwise the model compiled inlined. Either differs from eager
    by a few 1e-9 after 3 steps (as Hugging Face's model does unsharded under aot_eager).
    """
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        use_cache=False,
    )
    models = []
    for _ in range(3):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        for layer in model.model.layers:
            fully_shard(layer)
        models.append(fully_shard(model))
    capture = CapturingBackend()  # runs the graphs as aot_eager does, after the pass suite
    runs = [
        (torch.compile(models[0], backend=capture.backend, fullgraph=True), True),
        (torch.compile(models[1], backend="aot_eager", fullgraph=True), False),
        (models[2], False),
    ]
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-3) for model in models]
    for step in range(3):
        tokens = global_batch(step, world_size, 2, 16, config.vocab_size)[2 * rank : 2 * rank + 2]
        losses = []
        for (run, with_regions), optimizer in zip(runs, optimizers):
            with pass_settings(compile_regions=with_regions):
                loss = run(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
        torch.testing.assert_close(losses[0], losses[2], rtol=0, atol=1e-6)
    for with_regions, inlined, eager in zip(*(model.parameters() for model in models)):
        torch.testing.assert_close(with_regions.full_tensor(), inlined.full_tensor(), rtol=0, atol=0)
        torch.testing.assert_close(with_regions.full_tensor(), eager.full_tensor(), rtol=0, atol=1e-6)
    assert len(_region_calls(capture.forward_graphs[0].graph)) == REGION_BLOCKS
    assert _region_body_traces() == 1
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]  # one per model


@pytest.mark.slow
def test_hugging_face_llama_layers_share_one_region_and_match_eager_on_gloo():
    """Each layer holds its own ``layer_idx``, which its forward reads only with a cache: one body for all."""
    pytest.importorskip("transformers")
    run_gloo(_hugging_face_llama_worker, 2)


@pytest.mark.slow
def test_bucketed_regions_match_eager_on_gloo():
    """One bucket for all blocks (gathered and reduced once), each block still its region: plain blocks."""
    run_gloo(_compiled_matches_eager, 3, "inductor", False, 1000.0, True, False, N_LAYERS)


def test_bucketed_regions_that_copy_out_match_eager_on_gloo():
    """One bucket for all blocks, each block's region copying out its own chunk of it ([Note: a bucket of
    regions' groups]): two forward all-gathers, two reductions, parameters bitwise eager's (scheduled aot_eager)."""
    run_gloo(_compiled_matches_eager, 3, "scheduled", False, 1000.0, True, True, N_LAYERS)


def _reused_block_with_regions(rank, world_size):
    settings.compile_regions = True
    capture = CapturingBackend(min_cut=True)
    _reused_block_worker(rank, world_size, capture.backend)
    # The first call runs inlined, the first of its kind; the second calls a region used once, which
    # is inlined after its trace.
    assert _region_body_traces() == 1


def test_a_block_called_twice_per_forward_traces_its_region_once_and_matches_the_reference():
    run_gloo(_reused_block_with_regions, 2)


class _KeywordBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x, *, shift, gate, scale=1.0):
        return self.linear(x) * gate * scale + shift


class _KeywordModel(nn.Module):
    """Blocks called with tensor and plain keyword arguments, in different orders.

    The inputs come through ``proj``, so every block sees an input that requires
    grad; Dynamo inlines a region whose subgraph is used only once.
    """

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.blocks = nn.ModuleList(_KeywordBlock() for _ in range(5))
        self.shift, self.gate = nn.Parameter(torch.randn(6)), nn.Parameter(torch.randn(6))

    def forward(self, x):
        x = self.proj(x)
        for block, scale in zip(self.blocks[:3], (2.0, 0.5, 0.5)):
            x = block(x, shift=self.shift, gate=self.gate, scale=scale)
        for block in self.blocks[3:]:
            x = block(x, scale=0.5, gate=self.gate, shift=self.shift)
        return x


def _keyword_arguments_worker(rank, world_size):
    settings.compile_regions = True
    torch.manual_seed(0)
    model = _KeywordModel()
    reference = copy.deepcopy(model)
    _shard_blocks_and_root(model)
    capture = CapturingBackend(min_cut=True)
    compiled = torch.compile(model, backend=capture.backend, fullgraph=True)
    inputs = torch.randn(world_size * 4, 6, generator=torch.Generator().manual_seed(1))
    loss = compiled(inputs[4 * rank : 4 * rank + 4]).pow(2).sum() * world_size
    loss.backward()
    reference(inputs).pow(2).sum().backward()
    # Blocks 0 (scale=2.0) and 1 (scale=0.5) run inlined, each the first of its key; blocks 2 to 4
    # (scale=0.5, keywords in either order) share one subgraph.
    regions = _region_calls(capture.forward_graphs[0].graph)
    assert len(regions) == 3 and len({node.args[1] for node in regions}) == 1
    for param, reference_param in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad.full_tensor(), reference_param.grad, rtol=1e-5, atol=1e-5)


def test_keyword_arguments_reach_the_region_by_name_in_any_order():
    run_gloo(_keyword_arguments_worker, 2)


class _RotatingBlock(nn.Module):
    """Rotates pairs of features by complex factors, as torchtitan's Llama applies rotary embeddings."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x, freqs_cis):
        pairs = torch.view_as_complex(self.linear(x).unflatten(-1, (3, 2)))
        return x + torch.view_as_real(pairs * freqs_cis).flatten(-2)


class _RotatingModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.blocks = nn.ModuleList(_RotatingBlock() for _ in range(3))
        self.register_buffer("freqs_cis", torch.polar(torch.ones(3), torch.arange(3.0)), persistent=False)

    def forward(self, x):
        x = self.proj(x)
        for block in self.blocks:
            x = block(x, self.freqs_cis)
        return x


def _complex_rotation_worker(rank, world_size):
    settings.compile_regions = True
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(_RotatingModel())
        _shard_blocks_and_root(models[-1])
    compiled = torch.compile(models[0], backend="aot_eager", fullgraph=True)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in models]
    for step in range(3):
        inputs = torch.randn(world_size * 4, 6, generator=torch.Generator().manual_seed(step))[4 * rank : 4 * rank + 4]
        losses = [run(inputs).pow(2).sum() for run in (compiled, models[1])]
        for loss, optimizer in zip(losses, optimizers):
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.testing.assert_close(losses[0].detach(), losses[1].detach(), rtol=0, atol=0)
    _assert_parameters_equal(models)
    assert _region_body_traces() == 1


def test_a_complex_product_in_the_blocks_trains_through_their_region():
    """Its backward reads a conjugate view the region saved ([Note: conjugate views across a region's boundary]):
    bitwise eager over 3 steps."""
    run_gloo(_complex_rotation_worker, 2)


class _ScaledBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.scale = 1.0

    def forward(self, x):
        return self.linear(x) * self.scale


class _ScaledModel(nn.Module):
    """Alike blocks; ``autocast_block`` runs under bfloat16 autocast. ``proj`` as in ``_KeywordModel``."""

    def __init__(self, autocast_block=None, n_blocks=3):
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.blocks = nn.ModuleList(_ScaledBlock() for _ in range(n_blocks))
        self.autocast_block = autocast_block

    def forward(self, x):
        x = self.proj(x)
        for index, block in enumerate(self.blocks):
            if index == self.autocast_block:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    x = block(x).float()
            else:
                x = block(x)
        return x


def _state_outside_the_signature_worker(rank, world_size, case):
    settings.compile_regions = True
    torch.manual_seed(0)
    model = _ScaledModel(autocast_block=2 if case == "autocast" else None, n_blocks=4)
    _shard_blocks_and_root(model)
    if case == "attribute_after_fully_shard":
        model.blocks[2].scale = 3.0
    reference = copy.deepcopy(model)  # sharded, run eagerly
    capture = CapturingBackend(min_cut=True)
    compiled = torch.compile(model, backend=capture.backend, fullgraph=True)
    inputs = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    torch.testing.assert_close(compiled(inputs), reference(inputs), rtol=0, atol=1e-6)
    regions = _region_calls(capture.forward_graphs[0].graph)
    # Block 0 runs inlined, the first of its kind; blocks 1 and 3 share one subgraph; block 2's own is
    # used once, so it is inlined.
    assert len(regions) == 2 and len({node.args[1] for node in regions}) == 1


@pytest.mark.parametrize("case", ["autocast", "attribute_after_fully_shard"])
def test_a_block_that_differs_outside_its_parameters_gets_its_own_region(case):
    """Autocast around one block, or an attribute changed after ``fully_shard``: that block is not stamped out."""
    run_gloo(_state_outside_the_signature_worker, 2, case)


def _attribute_changed_after_compiling_worker(rank, world_size):
    settings.compile_regions = True
    torch.manual_seed(0)
    model = _ScaledModel(n_blocks=4)
    _shard_blocks_and_root(model)
    reference = copy.deepcopy(model)  # sharded, run eagerly
    capture = CapturingBackend(min_cut=True)
    compiled = torch.compile(model, backend=capture.backend, fullgraph=True)
    inputs = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    compiled(inputs)
    for module in (model, reference):
        module.blocks[2].scale = 3.0
    torch.testing.assert_close(compiled(inputs), reference(inputs), rtol=0, atol=1e-6)
    assert recompiles() == 1
    # Block 0 runs inlined; blocks 1 and 3 still share one subgraph; block 2's own is used once, so it
    # is inlined.
    assert len(_region_calls(capture.forward_graphs[-1].graph)) == 2


def test_an_attribute_changed_after_compiling_recompiles():
    """[Note: region keys are guarded]: block 2 must not go on running block 0's subgraph."""
    run_gloo(_attribute_changed_after_compiling_worker, 2)


def _blocks_with_per_layer_attributes(n_layers, attribute, blocks_per_value=1):
    """``n_layers`` of ``_ScaledModel``'s blocks, block ``i`` holding ``i // blocks_per_value`` in ``attribute``."""
    with FakeProcessGroup(2), pass_settings(compile_regions=True):
        model = _ScaledModel()
        model.blocks = nn.ModuleList(_ScaledBlock() for _ in range(n_layers))
        for layer_id, block in enumerate(model.blocks):
            setattr(block, attribute, float(layer_id // blocks_per_value))
        _shard_blocks_and_root(model)
        reference = copy.deepcopy(model)  # sharded, run eagerly
        capture = CapturingBackend(min_cut=True)
        inputs = torch.randn(4, 6)
        output = torch.compile(model, backend=capture.backend, fullgraph=True)(inputs)
        torch.testing.assert_close(output, reference(inputs), rtol=0, atol=1e-6)
    return capture


def test_a_plain_attribute_no_body_reads_keys_no_block_apart():
    """torchtitan's blocks hold a ``layer_id`` their forward never reads: ten blocks share one body."""
    capture = _blocks_with_per_layer_attributes(10, "layer_id")
    assert len(_region_calls(capture.forward_graphs[0].graph)) == 9  # the first block runs inlined
    assert _region_body_traces() == 1


def test_a_plain_attribute_each_body_reads_keys_blocks_apart_past_torchs_reuse_cap():
    """A ``scale`` per pair of blocks that the forward reads: ten keys, more than torch's default cap of 8."""
    capture = _blocks_with_per_layer_attributes(20, "scale", blocks_per_value=2)
    # The first block of each key runs inlined; the second traces the key's body and is its only
    # user, so Dynamo inlines the body after its trace.
    assert _region_body_traces() == 10 and not _region_calls(capture.forward_graphs[0].graph)


def test_blocks_whose_keys_all_differ_run_inlined():
    """A ``scale`` per block: each block is the first of its key, so none traces a region body."""
    capture = _blocks_with_per_layer_attributes(4, "scale")
    assert _region_body_traces() == 0 and not _region_calls(capture.forward_graphs[0].graph)


def test_an_attribute_read_on_a_later_blocks_path_keys_the_blocks_after_it():
    """Block 0 skips the branch that reads ``extra``; blocks 1 to 3 take it, and block 3 holds another value."""

    class BranchingBlock(_ScaledBlock):
        def forward(self, x):
            x = self.linear(x)
            return x * self.extra if self.use_extra else x

    with FakeProcessGroup(2), pass_settings(compile_regions=True):
        model = _ScaledModel(n_blocks=4)
        model.blocks = nn.ModuleList(BranchingBlock() for _ in range(4))
        for block, (use_extra, extra) in zip(model.blocks, [(False, 1.0), (True, 2.0), (True, 2.0), (True, 3.0)]):
            block.use_extra, block.extra = use_extra, extra
        _shard_blocks_and_root(model)
        inputs = torch.randn(4, 6)
        output = torch.compile(model, backend=CapturingBackend(min_cut=True).backend, fullgraph=True)(inputs)
        torch.testing.assert_close(output, model(inputs), rtol=0, atol=0)


class _Scale:
    def __init__(self, value):
        self.value = value


_SHARED_SCALE_OBJECT = _Scale(1.0)


class _AttributeReadingBlock(nn.Module):
    """Reads an attribute that only some blocks may have, and one that holds an object shared by all blocks."""

    def __init__(self):
        super().__init__()
        self.linear, self.activation = nn.Linear(6, 6), nn.Identity()
        self.shared = _SHARED_SCALE_OBJECT

    def forward(self, x):
        extra = getattr(self, "extra", 1.0)
        scale = (extra.value if isinstance(extra, _Scale) else extra) * self.shared.value
        return self.activation(self.linear(x)) * scale


@pytest.mark.parametrize("write", ["added", "deleted", "object_replaced", "submodule_replaced"])
def test_a_write_to_a_later_block_after_compiling_recompiles(write):
    """[Note: a block's attribute writes are counted]: no guard of the first block's body sees these writes."""
    with FakeProcessGroup(2), pass_settings(compile_regions=True):
        model = _ScaledModel()
        model.blocks = nn.ModuleList(_AttributeReadingBlock() for _ in range(3))
        if write == "deleted":
            for block in model.blocks:
                block.extra = _Scale(2.0) if block is model.blocks[0] else model.blocks[0].extra
        _shard_blocks_and_root(model)
        compiled = torch.compile(model, backend=CapturingBackend(min_cut=True).backend, fullgraph=True)
        inputs = torch.randn(4, 6)
        compiled(inputs)
        if write == "added":
            model.blocks[2].extra = 3.0
        elif write == "deleted":
            del model.blocks[2].extra
        elif write == "object_replaced":
            model.blocks[2].shared = _Scale(3.0)
        else:
            model.blocks[2].activation = nn.Tanh()
        torch.testing.assert_close(compiled(inputs), model(inputs), rtol=0, atol=0)
        compiled(inputs)
    assert recompiles() == 1


def test_writes_the_guards_see_are_not_counted():
    """A plain value or a tensor replaced by another costs no recompile: Dynamo guards on them already."""
    with FakeProcessGroup(2):
        model = _ScaledModel()
        _shard_blocks_and_root(model)
    block, linear = model.blocks[2], model.blocks[2].linear
    assert _OWNERS_ATTR not in model.__dict__ and _OWNERS_ATTR not in model.proj.__dict__  # not region modules
    state = block._compile_shard_state
    counts = []
    for write in (
        lambda: setattr(block, "scale", 2.0),
        lambda: setattr(linear, "mask", torch.ones(6)),  # added
        lambda: setattr(linear, "mask", torch.zeros(6)),
        lambda: setattr(linear, "mask", _Scale(1.0)),
        lambda: setattr(block, "training", False),
        lambda: delattr(linear, "mask"),
        lambda: setattr(block, "activation", nn.Tanh()),  # a submodule added
    ):
        before = state.region_writes
        write()
        counts.append(state.region_writes - before)
    assert counts == [0, 1, 0, 1, 0, 1, 1]
    # The new submodule is one of the block's modules, counting its own writes.
    assert block.activation in block._compile_shard_state.region_modules
    before = state.region_writes
    block.activation.extra = object()
    assert state.region_writes == before + 1


class _BreakingBlock(_ScaledBlock):
    def forward(self, x):
        x = self.linear(x)
        if self.breaks:
            torch._dynamo.graph_break()
        return x * self.scale


class _ModelBreakingAfterTheBlocks(_ScaledModel):
    def forward(self, x):
        x = super().forward(x)
        torch._dynamo.graph_break()
        return x * 2


def _model_with_a_graph_break(where: str) -> nn.Module:
    if where == "after_the_blocks":
        return _ModelBreakingAfterTheBlocks(n_blocks=4)
    model = _ScaledModel()
    breaks = [True] * 3 if where == "in_every_block" else [False, False, False, True, True]
    model.blocks = nn.ModuleList(_BreakingBlock() for _ in breaks)
    for block, value in zip(model.blocks, breaks):
        block.breaks = value
    return model


@pytest.mark.parametrize(
    "where, region_bodies",
    [("in_every_block", 0), ("on_a_later_blocks_path", 3), ("after_the_blocks", None)],
)
def test_a_graph_break_splits_the_step_as_without_regions(where, region_bodies):
    """Each break happens where Dynamo can split the step, never inside a region.

    torch 2.13 cannot break a graph inside a region (``UncapturedHigherOrderOpError``).
    ``in_every_block``: the first block runs inlined and breaks, as does every later
    one. ``on_a_later_blocks_path``: blocks 0 to 2 skip the branch that breaks, blocks 3
    and 4 take it; block 3 has a key of its own, so it runs inlined, the first of its
    key ([Note: the first block of each key runs inlined]), and blocks 1 and 2 share a
    region. ``after_the_blocks``: the break splits the root's forward, and the frame
    after its gather reads the unsharded parameters as inputs, which alias each other
    and so cannot be region arguments (``enters_gathered_as_views``): the blocks run
    inlined there.
    """
    with FakeProcessGroup(2), pass_settings(compile_regions=True):
        model = _model_with_a_graph_break(where)
        _shard_blocks_and_root(model)
        inputs = torch.randn(4, 6)
        expected = model(inputs)
        with pytest.warns(ShardedGraphBreakWarning):
            output = torch.compile(model, backend="aot_eager")(inputs)
    torch.testing.assert_close(output, expected, rtol=0, atol=0)
    assert counters["graph_break"]
    if region_bodies is not None:
        assert _region_body_traces() == region_bodies


def test_a_block_whose_submodules_run_hooks_is_inlined():
    """A hook appending each block's output runs for every block, as in eager."""
    outputs = []

    def save_output(module, args, output):  # one function for all blocks: their signatures stay equal
        outputs.append(output)

    with FakeProcessGroup(2), pass_settings(compile_regions=True):
        model = _ScaledModel()
        for block in model.blocks:
            block.linear.register_forward_hook(save_output)
            fully_shard(block)
        fully_shard(model)
        capture = CapturingBackend(min_cut=True)
        output = torch.compile(model, backend=capture.backend, fullgraph=True)(torch.randn(4, 6))
    assert len(outputs) == 3 and torch.equal(outputs[-1], output)
    assert not _region_calls(capture.forward_graphs[0].graph)


def test_one_blocks_eval_after_compiling_recompiles():
    """The region key's ``training`` flags are read where Dynamo guards on them."""

    class DropoutBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.dropout = nn.Linear(6, 6), nn.Dropout(0.5)

        def forward(self, x):
            return self.dropout(self.linear(x))

    with FakeProcessGroup(2), pass_settings(compile_regions=True):
        model = _ScaledModel()
        model.blocks = nn.ModuleList(DropoutBlock() for _ in range(3))
        _shard_blocks_and_root(model)
        compiled = torch.compile(model, backend=CapturingBackend(min_cut=True).backend, fullgraph=True)
        compiled(torch.randn(4, 6))
        model.blocks[2].eval()
        compiled(torch.randn(4, 6))
    assert recompiles() == 1


class _InPlaceBlock(nn.Module):
    """A block whose forward writes in place to a tensor it did not create: ``write`` says which."""

    def __init__(self, write):
        super().__init__()
        self.linear, self.write = nn.Linear(6, 6), write
        self.norm = nn.BatchNorm1d(6) if write == "batch_norm" else nn.Identity()
        self.register_buffer("tokens_seen", torch.zeros(6))

    def forward(self, x):
        if self.write == "buffer":  # torchtitan's MoE counts the tokens each expert got this way
            with torch.no_grad():
                self.tokens_seen.add_((x > 0).float().sum(0))
        elif self.write == "input":
            x.mul_(2)
        return self.norm(self.linear(x))


_IN_PLACE_FORWARD_LINE = _InPlaceBlock.forward.__code__.co_firstlineno


@pytest.mark.parametrize("write", ["batch_norm", "buffer", "input"])
def test_a_block_writing_in_place_to_a_tensor_it_did_not_create_is_inlined(write):
    """torch 2.13 refuses to train through a region that writes its inputs or buffers in place; inlined, the
    blocks train, each updating its own state."""
    with FakeProcessGroup(2), pass_settings(compile_regions=True):
        model = _ScaledModel()
        model.blocks = nn.ModuleList(_InPlaceBlock(write) for _ in range(3))
        _shard_blocks_and_root(model)
        capture = CapturingBackend(min_cut=True)
        with pytest.warns(RegionInlinedWarning, match="blocks.0 writes in place to") as warned:
            torch.compile(model, backend=capture.backend, fullgraph=True)(torch.randn(4, 6)).sum().backward()
    assert not _region_calls(capture.forward_graphs[0].graph)
    (warning,) = warned
    assert warning.lineno == _IN_PLACE_FORWARD_LINE
    if write == "batch_norm":
        assert "its buffer `norm.num_batches_tracked`" in str(warning.message)
        assert all(block.norm.num_batches_tracked.item() == 1 for block in model.blocks)
    if write == "buffer":
        assert "its buffer `tokens_seen`" in str(warning.message)
        assert all(block.tokens_seen.sum() > 0 for block in model.blocks)


_WRITES = {"global": 0, "list": []}


class _WritingBlock(nn.Module):
    """A block whose forward runs Python a reused region would run once: ``write`` says which."""

    def __init__(self, write):
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.write = write

    def forward(self, x):
        out = self.linear(x)
        if self.write == "attribute":
            self.aux_loss = out.pow(2).mean()
        elif self.write == "global":
            _WRITES["global"] += 1
        elif self.write == "list":
            _WRITES["list"].append(out.sum())
        elif self.write == "returns_none":
            return out, None
        return out


_WRITING_FORWARD_LINE = _WritingBlock.forward.__code__.co_firstlineno


def _writes_seen(model, write):
    if write == "attribute":
        return sum(hasattr(block, "aux_loss") for block in model.blocks)
    if write == "global":
        return _WRITES["global"]
    if write == "list":
        return len(_WRITES["list"])
    return 3  # returns_none: only the output's equality below checks it


@pytest.mark.parametrize(
    "write, message",
    [
        ("attribute", r"forward of blocks\.0 writes state it did not create"),
        ("global", r"forward of blocks\.0 writes state it did not create"),
        ("list", r"forward of blocks\.0 writes state it did not create"),
        ("returns_none", r"forward of blocks\.0 returns something other than a tensor"),
    ],
)
def test_a_block_whose_python_a_region_cannot_replay_runs_inlined(write, message):
    """See [Note: a reused region replays no Python side effects]: each block's Python runs, as in eager."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(6, 6)
            self.blocks = nn.ModuleList(_WritingBlock(write) for _ in range(3))

        def forward(self, x):
            x = self.proj(x)
            for block in self.blocks:
                x = block(x)[0] if write == "returns_none" else block(x)
            return x

    with FakeProcessGroup(2), pass_settings(compile_regions=True):
        model = Model()
        _shard_blocks_and_root(model)
        inputs = torch.randn(4, 6)
        expected = model(inputs)
        for block in model.blocks:
            block.__dict__.pop("aux_loss", None)
        _WRITES["global"], _WRITES["list"] = 0, []
        capture = CapturingBackend(min_cut=True)
        with pytest.warns(RegionInlinedWarning, match=message) as warned:
            output = torch.compile(model, backend=capture.backend, fullgraph=True)(inputs)
    assert [(warning.filename, warning.lineno) for warning in warned] == [(__file__, _WRITING_FORWARD_LINE)]
    assert not _region_calls(capture.forward_graphs[0].graph)
    assert _writes_seen(model, write) == 3
    torch.testing.assert_close(output, expected)


_SHARED_SCALE = 0.0
_SHARED_STATE = {"scale": 0.0, "context": {"scale": 0.0}}


class _ReadingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x):
        return self.linear(x) * (1.0 + _SHARED_SCALE + _SHARED_STATE["scale"] + _SHARED_STATE["context"]["scale"])


@pytest.mark.parametrize("written", ["global", "dict", "created_dict"])
def test_state_the_caller_writes_between_blocks_keys_them_apart(written):
    """[Note: writes between blocks key them apart]: each block reads the value set before its call.

    ``created_dict``: a dict the forward creates, stores where the blocks read it, and changes between their calls.
    """

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(6, 6)
            self.blocks = nn.ModuleList(_ReadingBlock() for _ in range(3))

        def forward(self, x):
            global _SHARED_SCALE
            x, context = self.proj(x), {"scale": 0.0}
            if written == "created_dict":
                _SHARED_STATE["context"] = context
            for index, block in enumerate(self.blocks):
                if written == "global":
                    _SHARED_SCALE = float(index)
                elif written == "dict":
                    _SHARED_STATE["scale"] = float(index)
                else:
                    context["scale"] = float(index)
                x = block(x)
            return x

    global _SHARED_SCALE
    with FakeProcessGroup(2), pass_settings(compile_regions=True):
        model = Model()
        _shard_blocks_and_root(model)
        inputs = torch.randn(4, 6)
        try:
            output = torch.compile(model, backend=CapturingBackend(min_cut=True).backend, fullgraph=True)(inputs)
            torch.testing.assert_close(output, model(inputs))
        finally:
            _SHARED_SCALE = 0.0
            _SHARED_STATE.update(scale=0.0, context={"scale": 0.0})


def test_a_global_number_changed_between_steps_runs_the_blocks_inlined():
    """Dynamo makes it symbolic when it changes, which torch 2.13 cannot pass to a reused region."""
    global _SHARED_SCALE

    class Model(_ScaledModel):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(_ReadingBlock() for _ in range(3))

    with FakeProcessGroup(2), pass_settings(compile_regions=True):
        model = Model()
        _shard_blocks_and_root(model)
        capture = CapturingBackend(min_cut=True)
        compiled = torch.compile(model, backend=capture.backend, fullgraph=True)
        inputs = torch.randn(4, 6)
        message = r"blocks\.0 reads _SHARED_SCALE, a number Dynamo made symbolic"
        warned = pytest.warns(RegionInlinedWarning, match=message)
        try:
            for step, scale in enumerate([0.0, 1.0, 2.0]):
                _SHARED_SCALE = scale
                with warned if step == 1 else contextlib.nullcontext():
                    torch.testing.assert_close(compiled(inputs), model(inputs), rtol=0, atol=0)
        finally:
            _SHARED_SCALE = 0.0
    assert recompiles() == 1
    assert len(_region_calls(capture.forward_graphs[0].graph)) == REGION_BLOCKS
    assert not _region_calls(capture.forward_graphs[-1].graph)


def test_a_tensor_the_caller_stores_before_the_blocks_keys_none_apart():
    """A tensor written to existing state (FSDP2's kept parameters, a stored input) is a value, not a container."""

    class StoringModel(_ScaledModel):
        def forward(self, x):
            self.last_input = x.detach()
            return super().forward(x)

    with FakeProcessGroup(2), pass_settings(compile_regions=True):
        model = StoringModel(n_blocks=4)
        _shard_blocks_and_root(model)
        inputs = torch.randn(4, 6)
        expected = model(inputs)
        output = torch.compile(model, backend="aot_eager", fullgraph=True)(inputs)
    torch.testing.assert_close(output, expected, rtol=0, atol=0)
    assert _region_body_traces() == 1


def test_a_list_the_forward_creates_and_appends_to_does_not_key_blocks_apart():
    """Only state that existed before the trace counts as a write between blocks."""

    class Model(_ScaledModel):
        def forward(self, x):
            x, outputs = self.proj(x), []
            for block in self.blocks:
                x = block(x)
                outputs.append(x)
            return torch.stack(outputs).sum(0)

    with FakeProcessGroup(2), pass_settings(compile_regions=True):
        model = Model()
        _shard_blocks_and_root(model)
        torch.compile(model, backend=CapturingBackend(min_cut=True).backend, fullgraph=True)(torch.randn(4, 6))
    assert _region_body_traces() == 1


# Hand-built graphs ---------------------------------------------------------------------------


def _outer_graph_gathering(region_graph: fx.Graph, padded_numel: int) -> tuple[nn.Module, fx.Graph, fx.Node, fx.Node]:
    """A module holding ``region_graph`` as ``region``, and an outer graph that all-gathers one annotated
    shard of ``padded_numel`` over 2 ranks; returns the module, the graph, the all-gather output and ``x``."""
    root = nn.Module()
    root.region = fx.GraphModule(nn.Module(), region_graph)
    graph = fx.Graph()
    shard, x = graph.placeholder("shard"), graph.placeholder("x")
    all_gather_output = graph.call_function(torch.ops.fsdp.all_gather_into.default, ([shard], [padded_numel], 2, "0"))
    write_group_annotation(all_gather_output, make_annotation("block"))
    return root, graph, all_gather_output, x


def _outer_graph_with_region(returns: str) -> tuple[fx.GraphModule, fx.Node, fx.Node]:
    """forward region (weight, x) -> (x @ weight.t(), saved), a backward op reading ``saved``.

    ``weight`` is a group's unsharded parameter (an annotated all-gather's copy-out);
    ``returns`` names what the region saves: ``weight``, ``weight_view`` (its
    transpose) or ``x_view`` (a view of the activation).
    """
    region_graph = fx.Graph()
    weight, x = region_graph.placeholder("weight"), region_graph.placeholder("x")
    viewed = region_graph.call_function(torch.ops.aten.view.default, (weight, [4, 4]))
    transposed = region_graph.call_function(torch.ops.aten.t.default, (viewed,))
    out = region_graph.call_function(torch.ops.aten.mm.default, (x, transposed))
    x_view = region_graph.call_function(torch.ops.aten.view.default, (x, [4, 2]))
    region_graph.output((out, {"weight": weight, "weight_view": transposed, "x_view": x_view}[returns]))
    root, graph, gathered, x = _outer_graph_gathering(region_graph, 8)
    weight = graph.call_function(torch.ops.aten.view.default, (gathered, [4, 4]))
    body = graph.get_attr("region")
    call = graph.call_function(invoke_subgraph, (body, "region", weight, x))
    out = graph.call_function(operator.getitem, (call, 0))
    saved = graph.call_function(operator.getitem, (call, 1))
    backward_read = graph.call_function(torch.ops.aten.mm.default, (out, saved))
    graph.output((out, backward_read))
    return fx.GraphModule(root, graph), weight, backward_read


def test_compile_regions_reads_the_argument_instead_of_the_returned_input():
    module, weight, backward_read = _outer_graph_with_region("weight")
    assert compile_regions(module.graph) == 1
    assert backward_read.args[1] is weight
    module.graph.lint()


def test_compile_regions_reads_a_copy_of_a_returned_parameter_view():
    module, weight, backward_read = _outer_graph_with_region("weight_view")
    assert compile_regions(module.graph) == 1
    transposed = backward_read.args[1]
    assert transposed.target is torch.ops.aten.t.default and transposed.graph is module.graph
    (viewed,) = transposed.args
    assert viewed.target is torch.ops.aten.view.default and viewed.args[0] is weight
    module.graph.lint()


def test_compile_regions_copies_a_regions_copy_out_once_for_the_views_it_returns():
    """A region that copies out ([Note: a region copies out its block's parameters]) returns views of two
    copied-out parameters: the outer graph reads copies of both chains, sharing one ``fsdp.copy_out``."""
    region_graph = fx.Graph()
    gathered, x = region_graph.placeholder("all_gather_output"), region_graph.placeholder("x")
    copied = region_graph.call_function(torch.ops.fsdp.copy_out.default, (gathered, 2, [8, 2]))
    weight = region_graph.call_function(
        torch.ops.aten.view.default, (region_graph.call_function(operator.getitem, (copied, 0)), [4, 4])
    )
    bias = region_graph.call_function(
        torch.ops.aten.view.default, (region_graph.call_function(operator.getitem, (copied, 1)), [4])
    )
    transposed = region_graph.call_function(torch.ops.aten.t.default, (weight,))
    out = region_graph.call_function(torch.ops.aten.mm.default, (x, transposed))
    region_graph.output((out, transposed, bias))
    root, graph, all_gather_output, x = _outer_graph_gathering(region_graph, 10)
    call = graph.call_function(invoke_subgraph, (graph.get_attr("region"), "region", all_gather_output, x))
    out, saved_weight, saved_bias = (graph.call_function(operator.getitem, (call, index)) for index in range(3))
    weight_read = graph.call_function(torch.ops.aten.mm.default, (out, saved_weight))
    bias_read = graph.call_function(torch.ops.aten.add.Tensor, (weight_read, saved_bias))
    graph.output((out, bias_read))
    module = fx.GraphModule(root, graph)
    assert compile_regions(module.graph) == 2
    (copy_out,) = module.graph.find_nodes(op="call_function", target=torch.ops.fsdp.copy_out.default)
    assert copy_out.args[0] is all_gather_output
    for read, at in ((weight_read.args[1], 0), (bias_read.args[1], 1)):
        while read.target is not operator.getitem:
            (read,) = read.all_input_nodes
        assert read.args == (copy_out, at)
    module.graph.lint()


@pytest.mark.parametrize("saved", ["activation", "activation_view"])
def test_compile_regions_leaves_what_is_no_parameter_alone(saved):
    """An activation the region computes, or a view of its activation argument, stays the region's output."""
    module, _, backward_read = _outer_graph_with_region("x_view")
    (call,) = module.graph.find_nodes(op="call_function", target=invoke_subgraph)
    out, region_saved = sorted(call.users, key=lambda user: user.args[1])
    if saved == "activation":
        backward_read.replace_input_with(region_saved, out)
    before = backward_read.args
    assert compile_regions(module.graph) == 0
    assert backward_read.args == before


# Reuse keys ----------------------------------------------------------------------------------


def test_block_signature_equal_for_alike_blocks_and_different_otherwise():
    config = LlamaConfig()
    first, second = TransformerBlock(config), TransformerBlock(config)
    assert block_signature(first) == block_signature(second)
    wider = TransformerBlock(LlamaConfig(dim=128))
    assert block_signature(wider) != block_signature(first)
    second.attention.layer_id = 1  # a plain value: keyed only where a body reads it
    assert block_signature(second) == block_signature(first)
    second.attention.rope = object()  # an object: by identity
    assert block_signature(second) != block_signature(first)
    third = TransformerBlock(config)
    third.feed_forward.register_forward_hook(lambda *_: None)
    assert block_signature(third) != block_signature(first)
