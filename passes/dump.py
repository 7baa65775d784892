"""Graph dumps: the joint graph before and after each pass, the scheduled graphs, the simulated schedule.

``compile_shard.debug`` re-exports ``dump_graphs`` and ``format_graph`` for users;
the suite (``install``) writes through ``GraphDump``.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from compile_shard._annotation import group_annotation

from .cost_model import get_profile
from .schedule_report import GRAPH_NAMES, index_html, schedule_table, timeline_svg
from .simulate import simulate_step


def format_graph(graph: torch.fx.Graph) -> str:
    """A stable, readable listing of ``graph``: one line per node with its shape,
    its fully_shard group and its partitioner tag; no file paths, line numbers or
    addresses, so the same graph prints the same on every machine.

    A graph that calls compile regions (``invoke_subgraph``) lists each region's
    body after its own nodes, indented under the region's name.

    Opaque inputs (the ``DeviceMesh`` every DTensor brings along) are left out:
    how many of them a trace has depends on object identities left over from
    earlier compilations, not on the program. Placeholders are renumbered among
    the others (``primals_3`` is the third non-opaque ``primals`` input), so the
    listing does not shift with them either.
    """
    names = _stable_names(graph)
    lines = []
    for node in graph.nodes:
        if _is_opaque(node):
            continue
        value = node.meta.get("val")
        shape = f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}" if isinstance(value, torch.Tensor) else ""
        if node.op == "placeholder":
            text = f"{names[node]}: {shape or 'input'}"
        elif node.op == "output":
            text = f"return {_format_arg(node.args[0], names)}"
        elif node.op == "get_attr":
            text = f"{names[node]} = get_attr({node.target!r})"
        else:
            typed_name = f"{names[node]}: {shape}" if shape else names[node]
            arguments = [_format_arg(arg, names) for arg in node.args]
            arguments += [f"{key}={_format_arg(value, names)}" for key, value in node.kwargs.items()]
            text = f"{typed_name} = {_target_name(node.target)}({', '.join(arguments)})"
        notes = []
        annotation = group_annotation(node)
        if annotation is not None:
            notes.append(f"group={annotation.name}")
        if "recompute" in node.meta:
            notes.append(f"{node.meta['recompute'].name}")
        lines.append(text + (f"  # {' '.join(notes)}" if notes else ""))
    for name, region in _called_regions(graph):
        lines.append(f"{name}:")
        lines.extend(f"    {line}" for line in format_graph(region.graph).splitlines())
    return "\n".join(lines) + "\n"


def _called_regions(graph: torch.fx.Graph) -> list[tuple[str, torch.fx.GraphModule]]:
    calls = graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
    names = sorted({node.args[0].target for node in calls})
    return [(name, getattr(graph.owning_module, name)) for name in names]


def _stable_names(graph: torch.fx.Graph) -> dict[torch.fx.Node, str]:
    names, counts = {}, Counter()
    for node in graph.nodes:
        prefix = re.fullmatch(r"(primals|tangents)_\d+", node.name)
        if node.op == "placeholder" and prefix and not _is_opaque(node):
            counts[prefix.group(1)] += 1
            names[node] = f"{prefix.group(1)}_{counts[prefix.group(1)]}"
        else:
            names[node] = node.name
    return names


def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[1]}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def _is_opaque(node: torch.fx.Node) -> bool:
    """An opaque object input, such as the DeviceMesh a DTensor brings into the graph."""
    value = node.meta.get("val")
    return node.op == "placeholder" and value is not None and not isinstance(value, (torch.Tensor, torch.SymInt, int))


def _format_arg(arg, names: dict[torch.fx.Node, str]) -> str:
    if isinstance(arg, torch.fx.Node):
        return "<opaque>" if _is_opaque(arg) else names[arg]
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_format_arg(a, names) for a in arg if not (isinstance(a, torch.fx.Node) and _is_opaque(a)))
        return f"[{inner}]" if isinstance(arg, list) else f"({inner})"
    if isinstance(arg, torch.dtype):
        return str(arg).removeprefix("torch.")
    return repr(arg)


_dump_dir: Path | None = None


@contextlib.contextmanager
def dump_graphs(path: str | os.PathLike) -> Iterator[Path]:
    """Writes what the pass suite did to every sharded model compiled inside, and the schedule it chose.

    Same as setting ``COMPILE_SHARD_DUMP_DIR=path``. Layout, one folder per compiled
    graph, ``path/rank<r>/graph_<k>/``:

    - ``<i>_<stage>.txt``: the joint graph before the suite (``joint``) and after each
      pass that ran, then the scheduled ``forward`` and ``backward`` graphs, each
      written by :func:`format_graph`;
    - ``schedule.txt``: per collective, its group, bytes, where it is issued and
      waited, the compute it overlaps and its simulated exposed time;
    - ``timeline.svg``: the simulated compute and communication lanes, by group;
    - ``index.html``: the timeline, the schedule and links to every file.

    The simulation uses ``compile_shard.passes.settings.cost_profile`` (by default
    ``h100_nvlink`` for CUDA graphs, ``cpu_gloo`` otherwise). The forward and backward
    files need a backend with the post-partition hook (Inductor, or one that calls
    ``run_partitioned_suite``). Inductor's and AOTAutograd's caches are off inside:
    a cache hit skips the passes, and with them the dump.
    """
    global _dump_dir
    previous, _dump_dir = _dump_dir, Path(path)
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(
            enable_autograd_cache=False
        ):
            yield _dump_dir
    finally:
        _dump_dir = previous


def turn_off_caches_when_dumping_from_environment() -> None:
    """With ``COMPILE_SHARD_DUMP_DIR`` set, turns Inductor's and AOTAutograd's caches off for the process.

    A cache hit skips the passes, and with them the dump (see :func:`dump_graphs`).
    """
    if os.environ.get("COMPILE_SHARD_DUMP_DIR"):
        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False


class GraphDump:
    """The dump folder of one compiled joint graph and its partitioned graphs (see :func:`dump_graphs`)."""

    #: The folder of the joint graph compiled last: its forward and backward follow it.
    latest: GraphDump | None = None

    def __init__(self, folder: Path):
        self.folder = folder
        self.stages = 0
        self.partitioned: dict[str, torch.fx.Graph] = {}
        self._last_written: tuple[str, str] | None = None  # (file name, listing) of the last stage
        #: ``bucket.describe_buckets`` of the joint graph, for the end of ``schedule.txt``.
        self.buckets = ""

    @classmethod
    def start(cls) -> GraphDump | None:
        """A new folder for the next compiled graph, or ``None`` when not dumping."""
        from_environment = os.environ.get("COMPILE_SHARD_DUMP_DIR")
        root = _dump_dir or (Path(from_environment) if from_environment else None)
        if root is None:
            cls.latest = None
            return None
        rank_dir = root / f"rank{dist.get_rank() if dist.is_initialized() else 0}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        folder = rank_dir / f"graph_{len(list(rank_dir.glob('graph_*'))):03d}"
        folder.mkdir()
        print(f"compile_shard: writing the pass dump of a compiled graph to {folder}", file=sys.stderr, flush=True)
        cls.latest = cls(folder)
        return cls.latest

    def write(self, stage: str, graph: torch.fx.Graph) -> None:
        """Writes ``graph`` as stage ``stage``; a stage that left the graph as it was says so instead."""
        name = f"{self.stages:02d}_{stage}.txt"
        listing = format_graph(graph)
        if self._last_written is not None and self._last_written[1] == listing:
            (self.folder / name).write_text(f"unchanged by {stage}: the graph of {self._last_written[0]}\n")
        else:
            (self.folder / name).write_text(listing)
            self._last_written = (name, listing)
        self.stages += 1

    def write_partitioned(self, kind: str, graph: torch.fx.Graph, profile_name: str) -> None:
        """Writes a scheduled forward or backward graph, then the schedule of the graphs seen so far."""
        self.write(kind, graph)
        self.partitioned[kind] = graph
        graphs = [self.partitioned[name] for name in GRAPH_NAMES if name in self.partitioned]
        simulation = simulate_step(graphs, get_profile(profile_name))
        buckets = f"\nbuckets (each forward all-gather):\n{self.buckets}" if self.buckets else ""
        (self.folder / "schedule.txt").write_text(schedule_table(simulation) + buckets)
        (self.folder / "timeline.svg").write_text(timeline_svg(simulation))
        (self.folder / "index.html").write_text(index_html(self.folder, profile_name))
