"""keep_order: make Inductor's scheduler emit a sharded graph's kernels in the order ``reorder`` chose.

Inductor's scheduler reorders nodes for peak memory after fusion, which on a
sharded graph sinks prefetched all-gathers back to their first use and pulls waits
up to their collectives: the overlap is gone. Inductor's documented hook for
collective scheduling, ``reorder_for_compute_comm_overlap_passes``, runs after that;
``keep_order`` sits there and restores the order of the FX graph (each fused
node at the position of its earliest FX origin), respecting every dependency the
scheduler knows. Graphs without compile_shard annotations pass through unchanged.
"""

from __future__ import annotations

from compile_shard._annotation import group_annotation

from ._graph import topological_order


def _origins(snode) -> list:
    return [origin for node in snode.get_nodes() if node.node is not None for origin in node.node.get_origins()]


def keep_order(snodes: list) -> list:
    """Scheduler nodes sorted topologically by the FX position of their origins."""
    origins = {snode: _origins(snode) for snode in snodes}
    annotated = [o for found in origins.values() for o in found if group_annotation(o) is not None]
    if not annotated:
        return snodes
    position = {node: index for index, node in enumerate(annotated[0].graph.nodes)}
    key = {}
    for index, snode in enumerate(snodes):
        placed = [position[origin] for origin in origins[snode] if origin in position]
        key[snode] = (min(placed) if placed else float("inf"), index)
    owner = {name: snode for snode in snodes for name in snode.get_operation_names()}
    order = topological_order(
        snodes, lambda snode: [owner[name] for name in snode.ancestors if name in owner], key.__getitem__
    )
    return snodes if order is None else order
