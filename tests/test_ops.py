"""The ``fsdp`` op library: opcheck, real gloo kernels, and functionalization."""

import re

import pytest
import torch
import torch.distributed as dist
from torch.library import opcheck

import compile_shard.passes
from compile_shard import ops
from dist_utils import FakeProcessGroup, run_gloo


@pytest.fixture(autouse=True, scope="module")
def installed_pass_suite():
    """opcheck's aot_dispatch tests then also run the joint-graph suite, as fully_shard would."""
    compile_shard.passes.install()


@pytest.fixture
def fake_pg():
    with FakeProcessGroup(2):
        yield dist.group.WORLD.group_name


def _uneven_shards():
    return [torch.randn(3, 4, requires_grad=True), torch.randn(2, requires_grad=True)]


def test_opcheck_all_gather_into(fake_pg):
    opcheck(torch.ops.fsdp.all_gather_into.default, (_uneven_shards(), [16, 3], 2, fake_pg))


def test_opcheck_all_gather_into_with_mixed_precision(fake_pg):
    """A bf16 all-gather of an fp32 and a bf16 shard, reduced in fp32: gradients in each shard's dtype."""
    shards = [torch.randn(3, 4, requires_grad=True), torch.randn(2, dtype=torch.bfloat16, requires_grad=True)]
    kwargs = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    opcheck(torch.ops.fsdp.all_gather_into.default, (shards, [16, 3], 2, fake_pg), kwargs)
    output = torch.ops.fsdp.all_gather_into(shards, [16, 3], 2, fake_pg, **kwargs)
    assert output.dtype == torch.bfloat16
    output.float().sum().backward()
    assert [shard.grad.dtype for shard in shards] == [torch.float32, torch.bfloat16]


def test_all_gather_into_needs_a_param_dtype_for_shards_of_several_dtypes(fake_pg):
    shards = [torch.randn(3, 4), torch.randn(2, dtype=torch.bfloat16)]
    with pytest.raises(RuntimeError, match="fsdp::all_gather_into needs one dtype or a param_dtype"):
        torch.ops.fsdp.all_gather_into(shards, [16, 3], 2, fake_pg)


@pytest.mark.parametrize("reduce_op", ["avg", "sum"])
def test_opcheck_reduce_scatter_grad(fake_pg, reduce_op):
    opcheck(torch.ops.fsdp.reduce_scatter_grad.default, (torch.randn(10, requires_grad=True), 2, fake_pg, reduce_op))


@pytest.mark.parametrize("reduce_op", ["avg", "sum"])
def test_opcheck_sum_shards(reduce_op):
    opcheck(torch.ops.fsdp.sum_shards.default, (torch.randn(12), 3, reduce_op))


@pytest.mark.parametrize("reduce_op, divisor", [("avg", 3.0), ("sum", 1.0)])
def test_sum_shards_adds_equal_shards_in_rank_order(reduce_op, divisor):
    received = torch.randn(12)
    shards = received.view(3, 4)
    expected = (shards[0] + shards[1] + shards[2]) / divisor  # rank 0 first: bitwise, not just close
    assert torch.equal(torch.ops.fsdp.sum_shards(received, 3, reduce_op), expected)


def test_sum_shards_rejects_uneven_buffers_and_unknown_reductions():
    with pytest.raises(RuntimeError, match="fsdp::sum_shards: numel 10 is not divisible by world size 3"):
        torch.ops.fsdp.sum_shards(torch.randn(10), 3)
    with pytest.raises(RuntimeError, match="fsdp::sum_shards: reduce_op must be one of"):
        torch.ops.fsdp.sum_shards(torch.randn(9), 3, "max")


def _uneven_gradients():
    # A transposed weight gradient (as matmul backward returns it) and a bias: 3 and 1 padded rows per rank.
    return [torch.randn(4, 5).t(), torch.randn(2)]


def test_opcheck_reduce_scatter_input():
    opcheck(torch.ops.fsdp.reduce_scatter_input.default, (_uneven_gradients(), 2))
    opcheck(torch.ops.fsdp.reduce_scatter_input.default, (_uneven_gradients(), 2, torch.float64))
    opcheck(torch.ops.fsdp.reduce_scatter_input_into_.default, (torch.empty(26), _uneven_gradients(), 2))


def test_reduce_scatter_input_pads_each_gradient_and_lays_the_ranks_out_in_order():
    weight_grad, bias_grad = _uneven_gradients()
    padded_weight = torch.cat([weight_grad, weight_grad.new_zeros(1, 4)]).view(2, 12)
    expected = torch.cat([padded_weight, bias_grad.view(2, 1)], 1).view(-1)  # [rank 0: w, b, rank 1: w, b]
    assert torch.equal(torch.ops.fsdp.reduce_scatter_input([weight_grad, bias_grad], 2), expected)
    output = torch.full((26,), float("nan"))
    torch.ops.fsdp.reduce_scatter_input_into_(output, [weight_grad, bias_grad], 2)
    assert torch.equal(output, expected)


def test_reduce_scatter_input_rejects_mixed_dtypes_and_a_wrong_output():
    with pytest.raises(RuntimeError, match="fsdp::reduce_scatter_input needs one dtype"):
        torch.ops.fsdp.reduce_scatter_input([torch.randn(2), torch.randn(2, dtype=torch.float64)], 2)
    with pytest.raises(RuntimeError, match="fsdp::reduce_scatter_input_into_: needs a contiguous 1-D output of 26"):
        torch.ops.fsdp.reduce_scatter_input_into_(torch.empty(24), _uneven_gradients(), 2)


def test_opcheck_copy_in():
    shards = [torch.randn(3, 4), torch.randn(2)]
    opcheck(torch.ops.fsdp.copy_in.default, (shards, [16, 3]))
    opcheck(torch.ops.fsdp.copy_in.default, ([shards[0], shards[1].double()], [16, 3], torch.bfloat16))


def test_copy_in_flattens_casts_and_zero_pads_each_shard():
    """FSDP2's copy-in: the shards flat, each padded with zeros to its padded numel, in ``dtype``."""
    weight, bias = torch.randn(3, 4), torch.randn(2, dtype=torch.float64)
    all_gather_input = ops.copy_in([weight, bias], [16, 3], torch.bfloat16)
    expected = torch.cat([weight.reshape(-1), torch.zeros(4), bias.float(), torch.zeros(1)]).bfloat16()
    assert all_gather_input.dtype == torch.bfloat16 and torch.equal(all_gather_input, expected)
    torch.testing.assert_close(ops.copy_in([weight], [12]), weight.reshape(-1), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="fsdp::copy_in needs one dtype or a param_dtype"):
        ops.copy_in([weight, bias], [16, 3])


def test_opcheck_copy_out():
    opcheck(torch.ops.fsdp.copy_out.default, (torch.randn(2 * 19, requires_grad=True), 2, [16, 3]))


def test_copy_out_takes_each_parameters_columns_rank_by_rank_and_its_backward_lays_them_out_again():
    """FSDP2's ``split_with_sizes_copy`` of a rank-major all-gather output; an unused copy's gradient is zeros."""
    world_size, padded_numels = 3, [4, 2]
    all_gather_output = torch.arange(18.0).requires_grad_(True)
    first, second = ops.copy_out(all_gather_output, world_size, padded_numels)
    rows = all_gather_output.detach().view(world_size, 6)
    assert torch.equal(first, rows[:, :4].reshape(-1)) and torch.equal(second, rows[:, 4:].reshape(-1))
    (grad,) = torch.autograd.grad(first, all_gather_output, torch.ones_like(first))  # ``second`` unused
    assert torch.equal(grad.view(world_size, 6), torch.tensor([[1.0] * 4 + [0.0] * 2] * world_size))


def test_copy_out_rejects_an_output_of_another_size():
    with pytest.raises(RuntimeError, match=r"fsdp::copy_out: needs a 1-D all-gather output of .* = 18 elements"):
        ops.copy_out(torch.randn(17), 3, [4, 2])


def test_opcheck_set_():
    opcheck(torch.ops.fsdp.set_.default, (torch.randn(4), torch.randn(2, 3)))


@pytest.mark.parametrize("nbytes", [16, 64])
def test_opcheck_resize_storage_(nbytes):
    opcheck(torch.ops.fsdp.resize_storage_.default, (torch.randn(4), nbytes))


def test_opcheck_resize_storage_to_zero():
    # test_schema reads the argument's data after the call, which a freed storage no
    # longer has (it crashes instead of failing); the schema hides this mutation by
    # design, see [Note: resize_storage_ schema].
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    opcheck(torch.ops.fsdp.resize_storage_.default, (torch.randn(4), 0), test_utils=utils)


def test_set_points_tensor_at_source_storage():
    tensor, source = torch.zeros(4), torch.arange(6.0).view(2, 3)
    torch.ops.fsdp.set_(tensor, source[1:])
    assert tensor.shape == (1, 3)
    assert tensor.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
    assert tensor.tolist() == [[3.0, 4.0, 5.0]]


def test_resize_storage_frees_and_regrows_same_storage():
    tensor = torch.randn(8)
    view = tensor.t()  # a view saved by autograd must see the regrown storage
    torch.ops.fsdp.resize_storage_(tensor, 0)
    assert tensor.untyped_storage().nbytes() == 0 and view.untyped_storage().nbytes() == 0
    torch.ops.fsdp.resize_storage_(tensor, 32)
    tensor.copy_(torch.arange(8.0))
    assert view.tolist() == list(map(float, range(8)))


def test_mutating_ops_pass_aot_functional_check():
    """AOTAutograd asserts a functional graph: both mutations must survive it, and
    the storage resize must stay in the graph (it is side-effectful, DCE keeps it)."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module

    def fn(x, source):
        scratch = x * 2
        total = scratch.sum()
        torch.ops.fsdp.resize_storage_(scratch, 0)
        torch.ops.fsdp.set_(x, source)
        return total

    x, source = torch.randn(4), torch.randn(4)
    expected = (x * 2).sum()
    backend = aot_autograd(fw_compiler=capture, keep_inference_input_mutations=True)
    total = torch.compile(fn, backend=backend, fullgraph=True)(x, source)
    assert torch.equal(total, expected) and torch.equal(x, source)
    targets = {node.target for node in graphs[0].graph.nodes}
    assert torch.ops.fsdp.resize_storage_.default in targets
    assert torch.ops.aten.set_.source_Tensor in targets  # fsdp::set_ functionalizes to aten.set_


def _gloo_kernels(rank, world_size):
    group_name = dist.group.WORLD.group_name
    # Uneven shards: rank r's first shard has r + 1 rows of a padded 3-row shard.
    shards = [torch.full((rank + 1, 2), float(rank)), torch.full((1,), 10.0 + rank)]
    padded_numels = [6, 1]
    out = torch.ops.fsdp.all_gather_into(shards, padded_numels, world_size, group_name)
    per_rank = out.view(world_size, 7)
    for r in range(world_size):
        expected_rows = torch.cat([torch.full((r + 1, 2), float(r)), torch.zeros(2 - r, 2)]).flatten()
        assert torch.equal(per_rank[r, :6], expected_rows), (r, per_rank[r])
        assert per_rank[r, 6].item() == 10.0 + r

    grad = torch.arange(world_size * 4, dtype=torch.float32) * (rank + 1)
    summed = torch.ops.fsdp.reduce_scatter_grad(grad, world_size, group_name, "sum")
    total = sum(r + 1 for r in range(world_size))
    expected = torch.arange(world_size * 4, dtype=torch.float32).view(world_size, 4)[rank] * total
    assert torch.equal(summed, expected)
    averaged = torch.ops.fsdp.reduce_scatter_grad(grad, world_size, group_name, "avg")
    torch.testing.assert_close(averaged, expected / world_size)

    # The all-gather's backward is the averaging reduce-scatter, back into each shard.
    shards = [torch.randn(rank + 1, 2, requires_grad=True), torch.randn(1, requires_grad=True)]
    out = torch.ops.fsdp.all_gather_into(shards, padded_numels, world_size, group_name)
    weights = torch.arange(out.numel(), dtype=torch.float32)
    (out * weights * (rank + 1)).sum().backward()
    expected_grad = weights.view(world_size, 7)[rank] * total / world_size
    torch.testing.assert_close(shards[0].grad, expected_grad[: 2 * (rank + 1)].view(rank + 1, 2))
    torch.testing.assert_close(shards[1].grad, expected_grad[6:7])


@pytest.mark.parametrize("world_size", [2, 3])
def test_collective_kernels_on_gloo(world_size):
    run_gloo(_gloo_kernels, world_size)


def _gloo_in_place_collectives(rank, world_size):
    group_name = dist.group.WORLD.group_name
    funcol = torch.ops._c10d_functional
    inputs = [torch.randn(5) + rank, torch.randn(1000) - rank]
    outputs = [torch.full((world_size * x.numel(),), float("nan")) for x in inputs]
    # Both gathers in flight before either is waited on: each takes its own tag.
    for output, all_gather_input in zip(outputs, inputs):
        torch.ops.fsdp.all_gather_send_recv_(output, all_gather_input, world_size, group_name)
    for output in reversed(outputs):
        funcol.wait_tensor(output)
    assert torch._C._distributed_c10d._get_work_registry_size() == 0
    for output, all_gather_input in zip(outputs, inputs):
        expected = torch.empty_like(output)
        dist.all_gather_into_tensor(expected, all_gather_input)
        assert torch.equal(output, expected)

    unsharded_grad = torch.randn(world_size * 6) * (rank + 1)
    received = torch.full_like(unsharded_grad, float("nan"))
    torch.ops.fsdp.all_to_all_into_(received, unsharded_grad, world_size, group_name)
    funcol.wait_tensor(received)
    expected = torch.empty_like(received)
    dist.all_to_all_single(expected, unsharded_grad)
    assert torch.equal(received, expected)
    assert torch._C._distributed_c10d._get_work_registry_size() == 0

    # Per parameter, straight from the shards and the gradients ([Note: gloo exchange in place]):
    # a (5, 3) weight, a (1000, 256) one whose shards are large enough for messages of their
    # own (the small ones share one), and a (4,) bias; dim 0 uneven over 2 and 3 ranks (the
    # last rank's bias shard is empty with 3), a transposed (non-contiguous) gradient.
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(5, 3, generator=generator), torch.randn(1000, 256, generator=generator)]
    params.append(torch.randn(4, generator=generator))
    padded_rows = [-(-param.size(0) // world_size) for param in params]
    shards = [param[rank * rows : (rank + 1) * rows] for param, rows in zip(params, padded_rows)]
    padded_numels = [rows * param[0].numel() for param, rows in zip(params, padded_rows)]
    assert padded_numels[1] * 4 >= ops._PACK_BELOW_BYTES > padded_numels[0] * 4
    unsharded_params = torch.full((world_size * sum(padded_numels),), float("nan"))
    torch.ops.fsdp.all_gather_params_(unsharded_params, shards, padded_numels, world_size, group_name)
    gradients = [torch.randn(3, 5).t() * (rank + 1), torch.randn(1000, 256) + rank, torch.randn(4) - rank]
    received = torch.full((world_size * sum(padded_numels),), float("nan"))
    torch.ops.fsdp.all_to_all_grads_(received, gradients, world_size, group_name)
    funcol.wait_tensor(received)
    funcol.wait_tensor(unsharded_params)
    segments = unsharded_params.split([world_size * numel for numel in padded_numels])
    for segment, param in zip(segments, params):
        assert torch.equal(segment[: param.numel()].view_as(param), param)
    expected = torch.empty_like(received)
    dist.all_to_all_single(expected, torch.ops.fsdp.reduce_scatter_input(gradients, world_size))
    assert torch.equal(received, expected)
    assert torch._C._distributed_c10d._get_work_registry_size() == 0


@pytest.mark.parametrize("world_size", [2, 3])
def test_in_place_collectives_match_torch_distributed_on_gloo(world_size):
    run_gloo(_gloo_in_place_collectives, world_size)


def test_all_to_all_into_rejects_a_wrong_output():
    with pytest.raises(RuntimeError, match="fsdp::all_to_all_into_: needs a contiguous input and output of one shape"):
        torch.ops.fsdp.all_to_all_into_(torch.empty(4, device="meta"), torch.empty(6, device="meta"), 2, "0")
    with pytest.raises(RuntimeError, match="fsdp::all_to_all_into_: numel 6 is not divisible by world size 4"):
        torch.ops.fsdp.all_to_all_into_(torch.empty(6, device="meta"), torch.empty(6, device="meta"), 4, "0")


def test_all_gather_send_recv_rejects_a_wrong_output():
    with pytest.raises(RuntimeError, match="fsdp::all_gather_send_recv_: needs a contiguous input and a contiguous "):
        torch.ops.fsdp.all_gather_send_recv_(torch.empty(7, device="meta"), torch.empty(3, device="meta"), 2, "0")
    with pytest.raises(RuntimeError, match="output is torch.float16, the input torch.float32"):
        torch.ops.fsdp.all_gather_send_recv_(
            torch.empty(6, device="meta", dtype=torch.float16), torch.empty(3, device="meta"), 2, "0"
        )


def test_in_place_parameter_exchanges_reject_wrong_outputs():
    shards, meta = [torch.empty(2, 3, device="meta"), torch.empty(2, device="meta")], "meta"
    expected = r"fsdp::all_gather_params_: needs a contiguous 1-D output of world_size \* sum\(padded_numels\) = 16"
    with pytest.raises(RuntimeError, match=expected):
        torch.ops.fsdp.all_gather_params_(torch.empty(15, device=meta), shards, [6, 2], 2, "0")
    with pytest.raises(RuntimeError, match="fsdp::all_gather_params_: a shard of 6 elements exceeds its padded numel 4"):
        torch.ops.fsdp.all_gather_params_(torch.empty(12, device=meta), shards, [4, 2], 2, "0")
    with pytest.raises(RuntimeError, match="fsdp::all_to_all_grads_: needs a contiguous 1-D output of 12 elements"):
        torch.ops.fsdp.all_to_all_grads_(torch.empty(6, 2, device=meta), [torch.empty(3, 3, device=meta)], 2, "0")
    with pytest.raises(RuntimeError, match="fsdp::all_to_all_grads_: every gradient needs a dim 0 to split"):
        torch.ops.fsdp.all_to_all_grads_(torch.empty(2, device=meta), [torch.empty((), device=meta)], 2, "0")


def test_an_op_calling_a_python_object_by_name_finds_the_one_bound_now_and_names_what_is_missing():
    """[Note: Python objects named in op arguments]: the name is looked up when the op runs."""
    name = ops.new_name("block.all_reduce_hook")
    calls = []
    for factor in (2.0, 3.0):
        hook = lambda reduced, factor=factor: (calls.append(factor), reduced.mul_(factor))  # noqa: E731
        ops.bind(name, hook)  # weakly: the caller (a group) holds the hook
        reduced = torch.ones(3)
        torch.ops.fsdp.call_all_reduce_hook_(reduced, name)
        assert torch.equal(reduced, torch.full((3,), factor))
    assert calls == [2.0, 3.0]
    replaced = lambda reduced: reduced  # noqa: E731
    ops.bind(name, replaced)
    del hook  # the hook bound before dies: the one bound since stays
    torch.ops.fsdp.call_all_reduce_hook_(torch.ones(3), name)
    del replaced  # the last holder lets go: the name is free
    missing = f"fsdp::call_all_reduce_hook_: no object is registered under the name '{name}'"
    with pytest.raises(RuntimeError, match=re.escape(missing)):
        torch.ops.fsdp.call_all_reduce_hook_(torch.ones(3), name)
