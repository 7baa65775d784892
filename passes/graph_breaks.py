"""Warn when torch.compile captured only part of a sharded model (a graph break).

A graph break splits the forward into several graphs: each side's all-gathers can no
longer be scheduled against the other side's compute, and unsharded parameters cross
the graph boundary as graph outputs (held in memory). Nothing fails, it is just
slower, so the suite says so once per split, naming the groups on each side and
Dynamo's reasons.
"""

from __future__ import annotations

import warnings

import torch.fx as fx
from torch._dynamo.utils import counters

from ._graph import group_annotation

_warned: set[tuple[str, ...]] = set()


class ShardedGraphBreakWarning(UserWarning):
    """A compiled sharded model was split across several graphs."""


def warn_if_partial(graph: fx.Graph) -> bool:
    """Warns (once per split) if ``graph`` holds some but not all groups of its model."""
    annotations = [a for node in graph.nodes if (a := group_annotation(node)) is not None]
    if not annotations:
        return False
    present = {a["group"] for a in annotations}
    expected = set(annotations[0]["root_groups"])
    missing = tuple(sorted(expected - present))
    if not missing:
        return False
    if missing not in _warned:
        _warned.add(missing)
        reasons = "; ".join(reason.split("\n")[0] for reason in counters["graph_break"]) or "see TORCH_LOGS=graph_breaks"
        warnings.warn(
            f"compile_shard: torch.compile split the sharded model across graphs. This graph holds the "
            f"all-gathers of {sorted(present)} but not of {list(missing)}: communication cannot overlap "
            f"across the break and unsharded parameters stay alive between graphs. Dynamo's graph-break "
            f"reasons: {reasons}. Compile with fullgraph=True to get the exact location as an error.",
            ShardedGraphBreakWarning,
            stacklevel=2,
        )
    return True
