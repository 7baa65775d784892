"""What compile_shard adds to torch's invoke_subgraph: the memo of a region's schema.

The Conjugate kernel is tested end to end in test_regions
(``test_a_complex_product_in_the_blocks_trains_through_their_region``).
"""

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._dynamo.source import LocalSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from compile_shard._regions import _invoke_subgraph

pytestmark = [
    pytest.mark.usefixtures("fresh_dynamo"),
]


def _body(scale: float) -> fx.GraphModule:
    return fx.symbolic_trace(lambda x: x * scale)


class _CountingGenSchema:
    """Stands in for torch's ``gen_schema``: one distinct result per call."""

    def __init__(self):
        self.calls = 0

    def __call__(self, subgraph, identifier, *operands):
        self.calls += 1
        return ("schema", self.calls)


def _under_autocast(memoized, *args):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return memoized(*args)


def _without_grad(memoized, *args):
    with torch.no_grad():
        return memoized(*args)


def test_a_schema_is_derived_once_per_body_code_identifier_operands_and_dispatch_state():
    gen_schema = _CountingGenSchema()
    memoized = _invoke_subgraph._memoized_gen_schema(gen_schema)
    body, other_body = _body(2.0), _body(2.0)
    x = torch.ones(2, 3)
    first = memoized(body, "region", x, 1.0)
    assert memoized(body, "region", torch.zeros(2, 3), 1.0) == first  # values do not matter, metadata does
    assert gen_schema.calls == 1
    for call in (
        lambda: memoized(body, "region", torch.ones(3, 3), 1.0),  # another shape
        lambda: memoized(body, "region", x.t(), 1.0),  # other strides
        lambda: memoized(body, "region", x.double(), 1.0),  # another dtype
        lambda: memoized(body, "region", x.requires_grad_(), 1.0),  # requires grad
        lambda: memoized(body, "region", x, 2.0),  # another plain operand
        lambda: memoized(body, "other", x, 1.0),  # another identifier
        lambda: memoized(other_body, "region", x, 1.0),  # another body with the same code
        lambda: _under_autocast(memoized, body, "region", x, 1.0),
        lambda: _without_grad(memoized, body, "region", x, 1.0),
    ):
        calls = gen_schema.calls
        call()
        assert gen_schema.calls == calls + 1


def test_a_body_whose_code_a_pass_rewrote_is_derived_again():
    gen_schema = _CountingGenSchema()
    memoized = _invoke_subgraph._memoized_gen_schema(gen_schema)
    body = _body(2.0)
    x = torch.ones(2, 3)
    memoized(body, "region", x)
    (mul,) = body.graph.find_nodes(op="call_function", target=operator.mul)
    mul.target = operator.add
    body.recompile()
    memoized(body, "region", x)
    assert gen_schema.calls == 2
    nested = nn.Module()
    nested.inner = _body(3.0)
    graph = fx.Graph()
    graph.output(graph.call_module("inner", (graph.placeholder("x"),)))
    outer = fx.GraphModule(nested, graph)
    memoized(outer, "region", x)
    (mul,) = outer.inner.graph.find_nodes(op="call_function", target=operator.mul)
    mul.target = operator.add
    outer.inner.recompile()
    memoized(outer, "region", x)
    assert gen_schema.calls == 4  # the nested module's code is part of the key


def test_symbolic_sizes_are_keyed_by_their_expressions():
    gen_schema = _CountingGenSchema()
    memoized = _invoke_subgraph._memoized_gen_schema(gen_schema)
    body = _body(2.0)
    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=False)
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    x = mode.from_tensor(torch.ones(4, 3), source=LocalSource("x"), symbolic_context=context)
    y = mode.from_tensor(torch.ones(5, 3), source=LocalSource("y"), symbolic_context=context)
    assert x.shape[0].__class__ is y.shape[0].__class__ is torch.SymInt and str(x.shape[0]) != str(y.shape[0])
    for operands in ((x,), (x,), (y,), (x, x.shape[0]), (x, x.shape[0]), (x, y.shape[0])):
        memoized(body, "region", *operands)
    assert gen_schema.calls == 4  # x; y, another symbol; x with its size; x with another symbol


def test_operands_that_cannot_be_keyed_exactly_derive_the_schema_every_time():
    gen_schema = _CountingGenSchema()
    memoized = _invoke_subgraph._memoized_gen_schema(gen_schema)
    body = _body(2.0)
    for operands in ((object(),), (torch.ones(2, 3).to_sparse(),)):
        for _ in range(2):
            memoized(body, "region", *operands)
    memoized(lambda x: x, "region", torch.ones(2))  # not a graph module
    memoized(lambda x: x, "region", torch.ones(2))
    assert gen_schema.calls == 6


def _body_retraces(monkeypatch, calls: int) -> int:
    """How often torch's ``gen_schema`` traced a region's body again, compiling a step that calls it ``calls`` times.

    ``gen_schema`` traces the body with ``materialize_as_graph``.
    """
    from torch._higher_order_ops import utils

    retraces = []
    materialize_as_graph = utils.materialize_as_graph

    def counting(subgraph, *args, **kwargs):
        retraces.append(subgraph)
        return materialize_as_graph(subgraph, *args, **kwargs)

    region = torch.compiler.nested_compile_region(lambda x: torch.sin(x) * 2)

    def step(x):
        for _ in range(calls):
            x = region(x)
        return x

    torch._dynamo.reset()
    with monkeypatch.context() as patch:
        patch.setattr(utils, "materialize_as_graph", counting)
        x = torch.ones(4, 4, requires_grad=True)
        torch.compile(step, backend="aot_eager", fullgraph=True)(x).sum().backward()
    return sum(isinstance(subgraph, fx.GraphModule) for subgraph in retraces)


def test_a_regions_body_is_retraced_for_its_schema_as_often_for_six_call_sites_as_for_two(monkeypatch):
    """Once under autograd, and twice under functionalization: the body, and the graph torch wraps it in.

    torch 2.13 without the memo: twice per call site under autograd (AOTAutograd traces
    the step twice), and the two under functionalization: 6 for two call sites, 14 for six.
    """
    assert _body_retraces(monkeypatch, 2) == 3
    assert _body_retraces(monkeypatch, 6) == 3


def test_training_through_a_region_that_writes_its_input_is_still_refused_at_every_compile():
    """A schema that marks a write is memoized too: torch refuses the region as without the memo."""

    @torch.compiler.nested_compile_region
    def region(x, count):
        count.add_(1)
        return x * 2

    def step(x, count):
        return region(x, count) + region(x, count)

    for _ in range(2):
        torch._dynamo.reset()
        x, count = torch.ones(4, requires_grad=True), torch.zeros(())
        with pytest.raises(Exception, match="does not currently support training with in-place input"):
            torch.compile(step, backend="aot_eager", fullgraph=True)(x, count).sum().backward()
