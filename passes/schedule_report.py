"""Human-readable views of a simulated schedule: a table, an SVG timeline and the dump's index page.

A dump folder (``compile_shard.debug.dump_graphs``) answers "what did the passes do
to my graph and does communication overlap compute?". The FX text files answer the
first part; these views answer the second from ``compile_shard.passes.simulate``:
which collective of which group is issued where, waited where, what compute hides it,
and what is left exposed, drawn as two lanes (compute, communication) colored by group.
"""

from __future__ import annotations

import html
from pathlib import Path

from .simulate import Simulation

GRAPH_NAMES = ("forward", "backward")
# Colors for fully_shard groups, assigned in order of first appearance.
_PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f", "#e15759")
_UNGROUPED = "#c8c8c8"
_EXPOSED = "#d62728"


def _graph_name(index: int) -> str:
    return GRAPH_NAMES[index] if index < len(GRAPH_NAMES) else str(index)


def schedule_table(simulation: Simulation) -> str:
    """One line per collective: where it is issued and waited, what it overlaps, what stays exposed."""
    name_width = max([34, *(len(record.name) for record in simulation.collectives)])
    header = (
        f"{'graph':<9} {'collective':<{name_width}} {'kind':<15} {'group':<22} {'MiB':>8} {'issued after':<28} "
        f"{'waited at':<28} {'start ms':>9} {'end ms':>9} {'exposed ms':>10}  overlaps"
    )
    lines = [header, "-" * len(header)]
    for record in simulation.collectives:
        overlaps = ", ".join(record.overlapped_compute) or "-"
        lines.append(
            f"{_graph_name(record.graph):<9} {record.name:<{name_width}} "
            f"{record.kind:<15} {record.group or '-':<22} {record.bytes / 2**20:8.3f} "
            f"{record.issued_after or '(start)':<28} {record.waited_at or '(output)':<28} "
            f"{record.start * 1e3:9.3f} {record.end * 1e3:9.3f} {record.exposed_seconds * 1e3:10.3f}  {overlaps}"
        )
    beyond = simulation.exposed_beyond_first_and_last()
    lines += [
        "",
        f"step {simulation.step_seconds * 1e3:.3f} ms = compute {simulation.compute_seconds * 1e3:.3f} ms "
        f"+ exposed communication {simulation.exposed_communication_seconds * 1e3:.3f} ms",
        f"communication {simulation.communication_seconds * 1e3:.3f} ms, exposed beyond the first all-gather and "
        f"the last reduce-scatter {beyond * 1e3:.3f} ms",
        f"peak memory {simulation.peak_memory_bytes / 2**20:.1f} MiB",
    ]
    return "\n".join(lines) + "\n"


def _group_colors(simulation: Simulation) -> dict[str, str]:
    groups = dict.fromkeys(interval.group for interval in simulation.intervals if interval.group)
    return {group: _PALETTE[index % len(_PALETTE)] for index, group in enumerate(groups)}


def timeline_svg(simulation: Simulation, width: int = 1400) -> str:
    """Compute and communication lanes over the step; red marks the compute lane waiting on a collective."""
    colors = _group_colors(simulation)
    left, lane_height, top = 110, 34, 30
    scale = (width - left - 20) / max(simulation.step_seconds, 1e-12)
    lanes = {"compute": top, "communication": top + lane_height + 12}
    height = top + 2 * lane_height + 40 + 18 * (len(colors) // 4 + 1)

    def x(seconds: float) -> float:
        return left + seconds * scale

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="monospace" font-size="11">',
        f'<text x="{left}" y="16">step {simulation.step_seconds * 1e3:.3f} ms, exposed communication '
        f"{simulation.exposed_communication_seconds * 1e3:.3f} ms of {simulation.communication_seconds * 1e3:.3f} ms"
        "</text>",
    ]
    for lane, y in lanes.items():
        parts.append(f'<text x="4" y="{y + lane_height / 2 + 4}">{lane}</text>')
    for interval in simulation.intervals:
        if interval.end <= interval.start:
            continue
        color = colors.get(interval.group, _UNGROUPED)
        title = html.escape(f"{_graph_name(interval.graph)}: {interval.node}"
                            f" ({interval.group or 'no group'}) {interval.start * 1e3:.3f}-{interval.end * 1e3:.3f} ms")
        y, box_width = lanes[interval.lane], max((interval.end - interval.start) * scale, 0.5)
        parts.append(
            f'<rect x="{x(interval.start):.2f}" y="{y}" width="{box_width:.2f}" '
            f'height="{lane_height}" fill="{color}" stroke="white" stroke-width="0.3"><title>{title}</title></rect>'
        )
    for record in simulation.collectives:
        if record.exposed_seconds > 0:
            stall_start = record.end - record.exposed_seconds
            parts.append(
                f'<rect x="{x(stall_start):.2f}" y="{lanes["compute"]}" '
                f'width="{max(record.exposed_seconds * scale, 0.5):.2f}" height="{lane_height}" fill="{_EXPOSED}" '
                f'opacity="0.8"><title>{html.escape(f"waiting for {record.name} ({record.group})")}</title></rect>'
            )
    if simulation.collectives and len({record.graph for record in simulation.collectives}) > 1:
        backward_start = min(i.start for i in simulation.intervals if i.graph == 1)
        parts.append(
            f'<line x1="{x(backward_start):.2f}" y1="{top - 6}" x2="{x(backward_start):.2f}" '
            f'y2="{top + 2 * lane_height + 18}" stroke="black" stroke-dasharray="4 3"/>'
            f'<text x="{x(backward_start) + 3:.2f}" y="{top - 8}">backward</text>'
        )
    legend_y = top + 2 * lane_height + 34
    for index, (group, color) in enumerate([*colors.items(), ("exposed wait", _EXPOSED)]):
        lx, ly = left + (index % 4) * 300, legend_y + 18 * (index // 4)
        parts.append(f'<rect x="{lx}" y="{ly - 10}" width="12" height="12" fill="{color}"/>')
        parts.append(f'<text x="{lx + 16}" y="{ly}">{html.escape(group)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def index_html(folder: Path, profile_name: str) -> str:
    """The dump folder's front page: the timeline inline, then links to every file."""
    links = "\n".join(
        f'<li><a href="{html.escape(path.name)}">{html.escape(path.name)}</a></li>'
        for path in sorted(folder.iterdir())
        if path.name != "index.html"
    )
    svg = (folder / "timeline.svg").read_text() if (folder / "timeline.svg").exists() else ""
    schedule = (folder / "schedule.txt").read_text() if (folder / "schedule.txt").exists() else ""
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>compile_shard dump: "
        f"{html.escape(folder.name)}</title></head>\n<body style='font-family: sans-serif'>\n"
        f"<h1>{html.escape(folder.name)}</h1>\n"
        f"<p>Simulated on hardware profile <code>{html.escape(profile_name)}</code> "
        "(<code>compile_shard.passes.settings.cost_profile</code>). Hover a box for its node.</p>\n"
        f"{svg}\n<h2>Schedule</h2>\n<pre>{html.escape(schedule)}</pre>\n"
        f"<h2>Files</h2>\n<ul>\n{links}\n</ul>\n</body></html>\n"
    )
