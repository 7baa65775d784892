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

from ._graph import fsdp
from .patterns import all_gather_outputs, chain_readers, copy_out_chain, gathers_saved_chunks

def _producers(node: fx.Node) -> list[fx.Node]:
    """``node``'s call_function ancestors: the collective and its copy-in, back to the shards."""
    seen, stack = [], list(node.all_input_nodes)
    while stack:
        producer = stack.pop()
        if producer.op == "call_function" and producer not in seen:
            seen.append(producer)
            stack.extend(producer.all_input_nodes)
    return seen


def place(graph: fx.Graph) -> int:
    """Moves every annotated gather chain next to its first reader; returns how many moved."""
    order = {node: index for index, node in enumerate(graph.nodes)}
    moved = 0
    for all_gather_output in all_gather_outputs(graph):
        chain = set(_producers(all_gather_output)) | set(copy_out_chain(all_gather_output))
        readers = chain_readers(list(chain))
        if not readers or any(reader.op == "output" for reader in readers):
            continue  # gathered parameters leave the graph (a graph break): leave them be
        if all_gather_output.target is fsdp.all_gather_into.default and gathers_saved_chunks(all_gather_output):
            continue  # backward's gather from a saved chunk
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
