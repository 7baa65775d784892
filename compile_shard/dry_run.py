"""Capture the forward and backward graphs torch.compile makes of a sharded model, without computing them.

The schedule the passes choose depends on sizes (tokens per rank, parameter bytes)
this machine cannot run, and on hardware it does not have. ``capture_step`` compiles
one training step through the suite's pre-grad pass, AOTAutograd with the min-cut
partitioner and the rest of the suite exactly as Inductor would see it, but its
compilers return *uninitialized* outputs (``torch.empty_strided``: the pages are never
touched, so even a large model costs little memory). The captured graphs go to ``compile_shard.passes.simulate`` with a
hardware profile. Use it under a fake process group (``backend="fake"``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from .passes import has_sharded_params, run_partitioned_suite, run_pre_grad_suite


def _dry_compiler(captured: list[fx.GraphModule]) -> Callable:
    def compiler(graph_module: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        if has_sharded_params(graph_module.graph):
            run_partitioned_suite(graph_module.graph)
            graph_module.recompile()
        captured.append(graph_module)
        placeholders = {node: index for index, node in enumerate(graph_module.graph.find_nodes(op="placeholder"))}
        (output,) = graph_module.graph.find_nodes(op="output")

        def run(args: list[Any]) -> list[Any]:
            symbols = _symbol_values(placeholders, args)
            results = []
            for node in output.args[0]:
                if node in placeholders:  # passed through, e.g. the DeviceMesh saved for backward
                    results.append(args[placeholders[node]])
                elif isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor):
                    value = node.meta["val"]
                    shape = [_concrete(size, symbols) for size in value.shape]
                    stride = [_concrete(size, symbols) for size in value.stride()]
                    results.append(torch.empty_strided(shape, stride, dtype=value.dtype))
                elif isinstance(node, fx.Node) and isinstance(node.meta.get("val"), (int, torch.SymInt)):
                    results.append(_concrete(node.meta["val"], symbols))  # a size saved for backward
                else:
                    results.append(None)
            args.clear()
            return results

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    return compiler


def _symbol_values(placeholders: dict[fx.Node, int], args: list[Any]) -> dict[Any, int]:
    """What each symbol of a dynamic-shape graph is in this call: read from the inputs that hold it."""
    symbols = {}
    for node, index in placeholders.items():
        value, arg = node.meta.get("val"), args[index]
        pairs = zip(value.shape, arg.shape) if isinstance(value, torch.Tensor) else [(value, arg)]
        for size, actual in pairs:
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                symbols[size.node.expr] = actual
    return symbols


def _concrete(size: int | torch.SymInt, symbols: dict[Any, int]) -> int:
    return int(size.node.expr.xreplace(symbols)) if isinstance(size, torch.SymInt) else size


def capture_step(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module], torch.Tensor]) -> list[fx.GraphModule]:
    """Compiles ``loss_fn(compiled model).backward()`` without computing; returns [forward, backward] graphs."""
    captured: list[fx.GraphModule] = []
    backend = aot_autograd(
        fw_compiler=_dry_compiler(captured),
        bw_compiler=_dry_compiler(captured),
        partition_fn=min_cut_rematerialization_partition,
    )

    def like_inductor(graph_module: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        if run_pre_grad_suite(graph_module.graph):  # Inductor's pre-grad hook
            graph_module.recompile()
        return backend(graph_module, example_inputs)

    torch._dynamo.reset()
    try:
        loss_fn(torch.compile(model, backend=like_inductor, fullgraph=True)).backward()
    finally:
        torch._dynamo.reset()
    return captured
