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

import heapq

from compile_shard._annotation import group_annotation


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
    waiting = {}
    dependents = {snode: [] for snode in snodes}
    for snode in snodes:
        producers = {owner[name] for name in snode.ancestors if name in owner} - {snode}
        waiting[snode] = len(producers)
        for producer in producers:
            dependents[producer].append(snode)
    ready = [(key[snode], snode) for snode in snodes if waiting[snode] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, snode = heapq.heappop(ready)
        order.append(snode)
        for dependent in dependents[snode]:
            waiting[dependent] -= 1
            if waiting[dependent] == 0:
                heapq.heappush(ready, (key[dependent], dependent))
    return order if len(order) == len(snodes) else snodes
