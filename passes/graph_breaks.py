"""Warn when torch.compile captured only part of a sharded model (a graph break).

A graph break splits the forward into several graphs. The unsharded parameters the
first graph gathered then leave it as outputs and stay alive until the graphs after
the break have used them, and no all-gather can be scheduled against compute on the
other side of the break. Nothing fails, it is just slower and uses more memory, so
the suite says so once per split, naming the groups and Dynamo's reasons. A graph
is split when gathered parameters are among its outputs, or when it gathers only
some of its model's groups. A graph whose gathered parameters leave it is marked,
so its partitioned forward and backward say they hold part of a model
(``holds_part_of_a_model``, which the rank check compares). One that gathers only some
groups is not: the others may be unused (the rank check compares its collectives).
"""

from __future__ import annotations

import warnings

import torch.fx as fx

from compile_shard._annotation import group_annotation
from compile_shard._compile_counts import graph_break_reasons

from .patterns import all_gather_outputs, copy_out_chain

_warned: set[tuple[str, ...]] = set()
# The key of ``node.meta["custom"]`` that marks a node of a graph holding part of a
# sharded model; "custom" metadata follows a node through the partitioner and the passes.
_PART_OF_A_MODEL = "compile_shard_part_of_a_model"


class ShardedGraphBreakWarning(UserWarning):
    """A compiled sharded model was split across several graphs."""


def _leaked_groups(graph: fx.Graph) -> set[str]:
    """Groups whose unsharded parameters are graph outputs, except the ones a group keeps on purpose."""
    (output,) = graph.find_nodes(op="output")
    outputs = set(output.all_input_nodes)
    return {
        group_annotation(all_gather_output).name
        for all_gather_output in all_gather_outputs(graph)
        if outputs.intersection(copy_out_chain(all_gather_output))
        and not group_annotation(all_gather_output).kept_after_backward
    }


def warn_if_partial(graph: fx.Graph) -> bool:
    """Warns (once per split) if ``graph`` holds only part of a sharded model."""
    annotations = [a for node in graph.nodes if (a := group_annotation(node)) is not None]
    if not annotations:
        return False
    present = {a.name for a in annotations}
    missing = sorted(set(annotations[0].model_groups) - present)
    leaked = sorted(_leaked_groups(graph))
    if not missing and not leaked:
        return False
    if leaked:
        _mark_part_of_a_model(graph)
    key = (*missing, "|", *leaked)
    if key not in _warned:
        _warned.add(key)
        details = []
        if leaked:
            details.append(f"the unsharded parameters of {leaked} leave this graph as outputs")
        if missing:
            details.append(
                f"this graph holds the all-gathers of {sorted(present)} but not of {missing} (a graph break, or "
                f"{missing} gathered before the compiled forward by FSDPModule.unshard(): their collectives then "
                "run eagerly, outside the graphs; compiled graphs prefetch by themselves, so call unshard() in "
                "eager mode only)"
            )
        reasons = "; ".join(graph_break_reasons()) or "see TORCH_LOGS=graph_breaks"
        warnings.warn(
            f"compile_shard: torch.compile split the sharded model across graphs: {'; '.join(details)}. "
            f"Unsharded parameters stay alive across the break and communication cannot overlap with "
            f"compute on the other side. Dynamo's graph-break reasons: {reasons}. Compile with "
            f"fullgraph=True to get the exact location as an error.",
            ShardedGraphBreakWarning,
            stacklevel=2,
        )
    return True


def _mark_part_of_a_model(graph: fx.Graph) -> None:
    for node in graph.nodes:
        if group_annotation(node) is not None:
            node.meta["custom"] = {**node.meta["custom"], _PART_OF_A_MODEL: True}


def holds_part_of_a_model(graph: fx.Graph) -> bool:
    """Whether ``graph`` came from a joint graph whose gathered parameters leave it (``warn_if_partial``)."""
    return any(node.meta.get("custom", {}).get(_PART_OF_A_MODEL) for node in graph.nodes)
