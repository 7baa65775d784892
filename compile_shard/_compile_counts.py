"""What Dynamo and AOTAutograd counted in this process: the one module that reads their counters.

``torch._dynamo.utils.counters`` and the compilation metrics are Dynamo's own
bookkeeping, not an API; reading them here keeps a change of their keys to one place.
"""

from __future__ import annotations

from torch._dynamo.utils import counters, get_compilation_metrics


def unique_graphs() -> int:
    """Graphs Dynamo compiled since its counters were last cleared."""
    return counters["stats"]["unique_graphs"]


def graph_break_reasons() -> list[str]:
    """Each distinct reason Dynamo gave for a graph break, first line only."""
    return [reason.split("\n")[0] for reason in counters["graph_break"]]


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def recompiles() -> int:
    """Dynamo recompilations since ``torch._dynamo.utils.clear_compilation_metrics()``.

    torch 2.13 no longer counts them in ``counters["recompiles"]``; its compilation
    metrics still record each recompilation's reason.
    """
    return sum(1 for metrics in get_compilation_metrics() if metrics.recompile_reason)


def autograd_cache_misses() -> int:
    """Graphs AOTAutograd compiled in this process without finding them in its cache."""
    return counters["aot_autograd"]["autograd_cache_miss"]
