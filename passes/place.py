"""place: issue each group's all-gather right before the forward first reads its parameters.

A trace gathers every group of the model at the start of the root's forward (see
[Note: traced unshard]), which would keep all unsharded parameters alive through the
whole forward. This pass moves each group's chain (copy-in, all-gather, wait and
copy-out) to just before the first node that uses a gathered parameter, so at most
one group is unsharded at a time, as in FSDP2's eager forward. Issuing gathers
earlier, to overlap them with compute, is a scheduling decision for later passes.
"""

from __future__ import annotations

import torch.fx as fx

from compile_shard._annotation import group_annotation

from ._graph import fsdp
from .patterns import all_gather_outputs, chain_readers, gathers_saved_chunks, unshard_nodes

def _producers(node: fx.Node) -> list[fx.Node]:
    """``node``'s call_function ancestors: the collective and its copy-in, back to the shards."""
    seen, stack = [], list(node.all_input_nodes)
    while stack:
        producer = stack.pop()
        if producer.op == "call_function" and producer not in seen:
            seen.append(producer)
            stack.extend(producer.all_input_nodes)
    return seen


def _gathers_by_group(graph: fx.Graph) -> list[list[fx.Node]]:
    """The annotated all-gather outputs, those of one group (one per dtype, [Note: one all-gather per wire
    dtype]) together, less backward's gathers from saved chunks."""
    by_group: dict[str, list[fx.Node]] = {}
    for all_gather_output in all_gather_outputs(graph):
        if all_gather_output.target is fsdp.all_gather_into.default and gathers_saved_chunks(all_gather_output):
            continue
        by_group.setdefault(group_annotation(all_gather_output).name, []).append(all_gather_output)
    return list(by_group.values())


def place(graph: fx.Graph) -> int:
    """Moves every group's annotated gather chains next to their first reader; returns how many moved.

    A group's all-gathers move together: an all-gather extension's transform may read
    the outputs of several ([Note: all-gather extensions] in ``compile_shard._param``).
    """
    order = {node: index for index, node in enumerate(graph.nodes)}
    moved = 0
    for group_outputs in _gathers_by_group(graph):
        chain = set()
        for all_gather_output in group_outputs:
            chain |= set(_producers(all_gather_output)) | set(unshard_nodes(all_gather_output))
        readers = chain_readers(list(chain))
        if not readers or any(reader.op == "output" for reader in readers):
            continue  # gathered parameters leave the graph (a graph break): leave them be
        first_reader = min(readers, key=order.__getitem__)
        ordered_chain = sorted(chain, key=order.__getitem__)
        if order[ordered_chain[-1]] + 1 == order[first_reader] and all(
            order[b] == order[a] + 1 for a, b in zip(ordered_chain, ordered_chain[1:])
        ):
            continue
        for node in ordered_chain:
            first_reader.prepend(node)
        order = {node: index for index, node in enumerate(graph.nodes)}
        moved += 1
    return moved
