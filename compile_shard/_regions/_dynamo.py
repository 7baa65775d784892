"""The one module of compile_shard that reads Dynamo's private state, for compile regions.

[Note: what compile regions read from Dynamo]
A block's region is chosen while Dynamo traces its call: what its arguments are
(symbolic sizes by their expressions), what the trace wrote so far, what the first
block of each key read and wrote. Dynamo has two public ways to run Python there:
``torch.compiler.assume_constant_result`` (a function of constants; the trace keeps
its result and does not guard on it) and ``comptime`` (a function of the trace's
variables; the trace drops its result). ``at_trace_time`` joins them, and is the only
place where compile regions write what they learn: every ``assume_constant_result``
function in ``compile_shard._regions`` only reads.

Everything else below relies on Dynamo's internals, which torch does not promise to
keep; each function says what it reads. Tested on torch 2.13 and 2.15 (CI runs both);
the same reads passed the quick tier on 2.14.1 before they moved here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.comptime import comptime
from torch._dynamo.symbolic_convert import InstructionTranslator
from torch._dynamo.variables.base import (
    AttributeMutationExisting,
    AttributeMutationNew,
    ValueMutationExisting,
    ValueMutationNew,
)
from torch._dynamo.variables.tensor import TensorVariable

#: ``_run_while_tracing``'s result, until ``_handed_over`` gives it to the trace.
_hand_off: list[Any] = [None]


def _run_while_tracing(ctx: Any) -> None:
    """Run by Dynamo at trace time (``comptime``): ``at_trace_time``'s locals ``run`` and ``values``."""
    _hand_off[0] = ctx.get_local("run").as_python_constant()(ctx.get_local("values").as_proxy())


@torch.compiler.assume_constant_result
def _handed_over() -> Any:
    return _hand_off[0]


def at_trace_time(run: Callable[[list], Any], values: tuple) -> Any:
    """``run`` of the proxies Dynamo traces ``values`` as, called while it traces; a constant of the trace.

    ``comptime`` hands Dynamo's variables to ``run`` (a plain value as itself, a tensor or
    a symbolic number as its ``fx.Proxy``) but drops its result, so the result goes
    through ``_hand_off`` to an ``assume_constant_result`` read right after. Dynamo
    guards on nothing ``run`` reads.
    """
    comptime(_run_while_tracing)
    return _handed_over()


def example_value(value: Any) -> Any:
    """The fake value a proxy stands for (Dynamo's ``example_value`` meta); a plain value stands for itself."""
    return value.node.meta["example_value"] if isinstance(value, fx.Proxy) else value


def example_tensors(graph: fx.Graph) -> Iterator[tuple[fx.Node, torch.Tensor]]:
    """Each node of a graph Dynamo is tracing that holds a (fake) tensor, with it."""
    for node in graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            yield node, value


def lifted_object(node: fx.Node) -> Any:
    """The real object a placeholder Dynamo lifted stands for (its ``grapharg``'s ``example``); None if none."""
    return getattr(node.meta.get("grapharg"), "example", None)


def _tracer() -> Any:
    """The tracer of the graph Dynamo is tracing now (a region body's, a checkpoint's, or the frame's).

    ``InstructionTranslator.current_tx()`` is the frame Dynamo translates, ``output`` its
    ``OutputGraph``, ``current_tracer`` the innermost ``SubgraphTracer``.
    """
    return InstructionTranslator.current_tx().output.current_tracer


def current_graph() -> fx.Graph:
    return _tracer().graph


def current_trace() -> Any:
    """The trace running now: Dynamo's ``OutputGraph`` for this frame (not hashable; compare by identity)."""
    return InstructionTranslator.current_tx().output


def trace_position() -> int:
    """How many nodes the graph being traced holds: grows with every block a trace runs."""
    return len(_tracer().graph.nodes)


@torch.compiler.assume_constant_result
def traces_inside_another_op() -> bool:
    """Whether Dynamo traces the current call inside another operator's body (an activation checkpoint)."""
    return _tracer().parent is not None


def last_node(graph: fx.Graph) -> fx.Node:
    """The graph's last node; its sentinel (``fx.Graph._root``) where it is empty."""
    return graph._root.prev


def nodes_after(node: fx.Node) -> Iterator[fx.Node]:
    """The nodes appended after ``node``: a block's, where ``node`` was the graph's last before it.

    Dynamo appends a trace's nodes at the end and inserts the inputs it lifts among
    the placeholders at the start, so these are the block's own nodes, its inputs not included.
    """
    node = node.next
    while node.op != "root":
        yield node
        node = node.next


def current_attempt() -> tuple | None:
    """This trace's (compile id, attempt): Dynamo restarts a compile as a new attempt of the same id."""
    trace_id = torch._guards.CompileContext.current_trace_id()
    return None if trace_id is None else (trace_id.compile_id, trace_id.attempt)


def compiles_every_size_symbolic() -> bool:
    """Whether this is a ``torch.compile(dynamic=True)`` trace (Dynamo's ``assume_static_by_default`` off)."""
    return not torch._dynamo.config.assume_static_by_default


def guarded_names() -> set[str]:
    """Every attribute name and string key on the way to what this trace's guards check so far.

    Reads the guards Dynamo has collected (``OutputGraph.guards``) and walks each one's
    ``originating_source`` through its ``base`` chain, reading ``member`` (an attribute)
    and ``index`` (a key).
    """
    names = set()
    for guard in InstructionTranslator.current_tx().output.guards:
        source = guard.originating_source
        while source is not None:
            for name in (getattr(source, "member", None), getattr(source, "index", None)):
                if isinstance(name, str):
                    names.add(name)
            source = getattr(source, "base", None)
    return names


def symbolic_numbers() -> dict[fx.Node, str]:
    """The nodes of the graph being traced that hold a number Dynamo made symbolic, each with the number's name."""
    return _symbolic_numbers(_tracer())


def _symbolic_numbers(tracer: Any) -> dict[fx.Node, str]:
    """A number that changed between steps comes back symbolic (automatic dynamic), as a
    0-d tensor input of the root graph (a placeholder whose ``grapharg`` has
    ``pass_arg_as_tensor``) and the ``item()`` that reads it; a nested tracer lifts
    either as an input of its own (``lifted_freevars``: the outer proxy to the inner).
    """
    if tracer.parent is None:
        numbers = {}
        for node in tracer.graph.find_nodes(op="placeholder"):
            graph_arg = node.meta.get("grapharg")
            if graph_arg is not None and graph_arg.pass_arg_as_tensor:
                source = graph_arg.source  # the global's name, not Dynamo's G['__import_<module>'].<name>
                numbers[node] = getattr(source, "member", None) or getattr(source, "global_name", None) or source.name
    else:
        outer = _symbolic_numbers(tracer.parent)
        lifted = tracer.lifted_freevars.items()
        numbers = {inner.node: outer[proxy.node] for proxy, inner in lifted if proxy.node in outer}
    for node, name in list(numbers.items()):
        numbers.update({user: name for user in node.users if user.op == "call_method" and user.target == "item"})
    return numbers


def writes_to_existing_state(owned: Callable[[int, Any], bool]) -> tuple:
    """What this trace has written so far to objects that existed before it, followed into the objects the
    trace created and stored in them; ``owned(id, object)`` leaves an object's writes out.

    Reads Dynamo's pending side effects (``OutputGraph.side_effects``): attribute writes
    (``store_attr_mutations``, by variable) and changed containers (``id_to_variable``,
    ``is_modified``), each variable's ``mutation_type`` saying whether its object existed
    before the trace. Dynamo holds a new variable for each value written, so the result
    changes with each write. A container whose contents cannot be read here counts as
    written at this point of the trace (``trace_position``).
    """
    side_effects = InstructionTranslator.current_tx().output.side_effects
    seen: set[int] = set()
    writes = [
        (id(item), _written(side_effects, list(attributes.values()), seen))
        for item, attributes in side_effects.store_attr_mutations.items()
        if isinstance(item.mutation_type, AttributeMutationExisting)
        and not owned(id(getattr(item, "value", None)), getattr(item, "value", None))
    ]
    for object_id, item in side_effects.id_to_variable.items():
        if owned(object_id, None):
            continue
        if isinstance(item.mutation_type, ValueMutationExisting) and side_effects.is_modified(item):
            writes.append((id(item), _written(side_effects, _contents(side_effects, item), seen)))
    return tuple(writes)


def _contents(side_effects: Any, item: Any) -> list[Any] | None:
    """What Dynamo holds for what ``item`` contains: its items, or the attributes the trace wrote; None if unknown."""
    contents = list(side_effects.store_attr_mutations.get(item, {}).values())
    items = getattr(item, "items", None)
    if isinstance(items, dict):
        return contents + list(items.values())
    if isinstance(items, list):
        return contents + items
    return contents if item in side_effects.store_attr_mutations else None


def _written(side_effects: Any, contents: list[Any] | None, seen: set[int]) -> Any:
    """Each variable of ``contents``, followed into the objects the trace created; a tensor's variable is enough
    (a tensor holds no Python state a block reads)."""
    if contents is None:
        return ("untracked", trace_position())
    key = []
    for value in contents:
        key.append(id(value))
        created = isinstance(getattr(value, "mutation_type", None), (ValueMutationNew, AttributeMutationNew))
        if created and not isinstance(value, TensorVariable) and id(value) not in seen:
            seen.add(id(value))
            key.append(_written(side_effects, _contents(side_effects, value), seen))
    return tuple(key)
