"""What compile_shard adds to torch 2.13's ``invoke_subgraph``, the operator of a nested compile region.

Each addition acts only where torch would raise or repeat work, and returns what torch
computes: a kernel for the Conjugate dispatch key, which torch lacks, and a memo of the
schema torch re-derives at every call site of a region. ``install`` is called once, by
``_regions._call`` on a torch whose regions compile_shard uses.

[Note: conjugate views across a region's boundary]
Autograd's formula for a product of complex tensors saves the other factor's
conjugate, a lazy view with the conjugate bit (``aten._conj``). Inside a region, the
region's forward returns that view for its backward, and torch 2.13's
``invoke_subgraph`` has no kernel for the Conjugate dispatch key: the compiled
backward (or Inductor lowering it) raises "could not find kernel for
HigherOrderOperator invoke_subgraph at dispatch key DispatchKey.Conjugate". Rotary
embeddings in complex form (torchtitan's Llama, ``freqs_cis``) take this path. This
kernel materializes the conjugate operands and calls the region again: the values
are the same, and a region's ops read only the values.

[Note: a region's schema is derived once per body and operands]
Under autograd, torch 2.13 checks each ``invoke_subgraph`` call for in-place writes to
its operands before training through it (``HigherOrderOperator.py_autograd_impl``):
``gen_schema`` traces the region's body again on the call's operands and analyses the
trace. Every sharded block after the first calls the same body, so AOTAutograd traced
it once per block: a sixth of a 64-layer capture. The schema depends only on the code
of the body's graph modules, on the operands' types and metadata, and on the state
the body is traced under (the thread's included and excluded dispatch keys, autocast
among them, and grad mode), so ``_memoized_gen_schema`` keeps it per body module
(weakly: it goes with the compiled graph) under those, and derives it anew when any
differs: another body, a body whose code a pass rewrote (``recompile`` gives it new
code), other shapes, autocast entered. A symbolic size (the sequence length after it
changed, a symbol the call passes) is keyed by its expression, as a region's reuse
key is ([Note: symbolic sizes in a reuse key] in ``_regions._key``). Operands it cannot key
exactly (an object, a sparse tensor) are derived every time, as by torch.
A schema that marks a write is kept like any other, so torch refuses the training at
every call as before.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.fx as fx
from torch._C import DispatchKey

from ._attribute_writes import PLAIN

#: Body module -> {(codes, identifier, operands' key, dispatch state): schema}; see ``_memoized_gen_schema``.
_SCHEMAS: weakref.WeakKeyDictionary[fx.GraphModule, dict[tuple, Any]] = weakref.WeakKeyDictionary()


def _call_with_conjugates_resolved(subgraph: Any, identifier: Any, *operands: Any) -> Any:
    """See [Note: conjugate views across a region's boundary]."""
    resolved = (operand.resolve_conj() if isinstance(operand, torch.Tensor) else operand for operand in operands)
    return torch.ops.higher_order.invoke_subgraph(subgraph, identifier, *resolved)


def _size_key(size: int | torch.SymInt) -> int | str:
    """A size, or a symbolic one's expression (``s0``): the same symbol within one trace."""
    return size if size.__class__ is int else str(size)


def _operand_key(operand: Any) -> tuple | None:
    """What of an operand the schema can depend on; None where that is not exactly hashable."""
    if isinstance(operand, torch.Tensor):
        if operand.layout is not torch.strided:
            return None
        sizes = tuple(_size_key(size) for size in (*operand.shape, *operand.stride(), operand.storage_offset()))
        return (type(operand), operand.dtype, operand.device, sizes, operand.requires_grad, operand.is_conj())
    if isinstance(operand, torch.SymInt):
        return (torch.SymInt, _size_key(operand))
    if isinstance(operand, PLAIN):
        return (type(operand), operand)
    return None


def _schema_key(subgraph: Any, identifier: Any, operands: tuple) -> tuple | None:
    if not isinstance(subgraph, fx.GraphModule) or not isinstance(identifier, PLAIN):
        return None
    operand_keys = tuple(_operand_key(operand) for operand in operands)
    if None in operand_keys:
        return None
    codes = tuple(module.code for module in subgraph.modules() if isinstance(module, fx.GraphModule))
    dispatch_state = (
        torch._C._dispatch_tls_local_include_set().raw_repr(),
        torch._C._dispatch_tls_local_exclude_set().raw_repr(),
        torch.is_grad_enabled(),
    )
    return (codes, identifier, operand_keys, dispatch_state)


def _memoized_gen_schema(gen_schema: Any) -> Any:
    """Torch's bound ``gen_schema``, memoized ([Note: a region's schema is derived once per body and operands])."""

    def memoized(subgraph: Any, identifier: Any, *operands: Any) -> Any:
        key = _schema_key(subgraph, identifier, operands)
        if key is None:
            return gen_schema(subgraph, identifier, *operands)
        schemas = _SCHEMAS.setdefault(subgraph, {})
        if key not in schemas:
            schemas[key] = gen_schema(subgraph, identifier, *operands)
        return schemas[key]

    return memoized


def install() -> None:
    """Adds the Conjugate kernel and the schema memo to torch's ``invoke_subgraph``, each where it has none."""
    invoke_subgraph = torch.ops.higher_order.invoke_subgraph
    if DispatchKey.Conjugate not in invoke_subgraph.py_kernels:
        invoke_subgraph.py_impl(DispatchKey.Conjugate)(_call_with_conjugates_resolved)
    if "gen_schema" not in vars(invoke_subgraph):  # the class's method, not yet memoized on the instance
        invoke_subgraph.gen_schema = _memoized_gen_schema(invoke_subgraph.gen_schema)
