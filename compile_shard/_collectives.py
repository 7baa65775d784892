"""The one table of collective ops: compile_shard's ``fsdp`` ops and torch's c10d ops.

The runtime's ``CollectiveCounter`` counts them in eager mode, torch FSDP2's included;
the passes find, verify, time and simulate them in graphs. Each reads this table, so
a new collective op is added in one place.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    #: Index of the argument that is the group size, or a list as long as the group;
    #: ``None`` where the op names no size (``all_reduce``) or is not in compiled graphs.
    size_arg: int | None = None
    #: Fills its first argument and returns nothing: its ``wait_tensor`` reads that argument.
    in_place: bool = False
    #: Waits inside the op (the ``fsdp`` ops autograd sees); the others return before the data is there.
    synchronous: bool = False
    #: Index of the argument that names the process group (``None``: not in compiled graphs).
    group_arg: int | None = None
    #: Index of the argument that holds the data sent (a tensor or a list of them); an
    #: op that fills its first argument sends its second.
    data_arg: int = 0


# (namespace, op name) -> what it is. Ops a torch build lacks are left out of COLLECTIVES.
_TABLE = {
    # compile_shard's ops (compile_shard.ops).
    ("fsdp", "all_gather_into"): Collective("all_gather", size_arg=2, synchronous=True, group_arg=3),
    ("fsdp", "reduce_scatter_grad"): Collective("reduce_scatter", size_arg=1, synchronous=True, group_arg=2),
    ("fsdp", "all_gather_send_recv_"): Collective("all_gather", size_arg=2, in_place=True, group_arg=3, data_arg=1),
    ("fsdp", "all_gather_params_"): Collective("all_gather", size_arg=3, in_place=True, group_arg=4, data_arg=1),
    ("fsdp", "all_to_all_into_"): Collective("all_to_all", size_arg=2, in_place=True, group_arg=3, data_arg=1),
    ("fsdp", "all_to_all_grads_"): Collective("all_to_all", size_arg=2, in_place=True, group_arg=3, data_arg=1),
    # A custom comm's collectives, waited by a wait_tensor ([Note: custom collectives] in compile_shard.ops).
    ("fsdp", "all_gather_with_comm"): Collective("all_gather", size_arg=1, group_arg=2),
    ("fsdp", "reduce_scatter_with_comm"): Collective("reduce_scatter", size_arg=1, group_arg=2),
    # torch's functional collectives: what compiled graphs hold after lowering.
    ("_c10d_functional", "all_gather_into_tensor"): Collective("all_gather", size_arg=1, group_arg=2),
    ("_c10d_functional", "all_gather_into_tensor_out"): Collective("all_gather", size_arg=1, group_arg=2),
    ("_c10d_functional", "all_gather_into_tensor_coalesced"): Collective("all_gather"),
    ("_c10d_functional", "reduce_scatter_tensor"): Collective("reduce_scatter", size_arg=2, group_arg=3),
    ("_c10d_functional", "reduce_scatter_tensor_coalesced"): Collective("reduce_scatter"),
    ("_c10d_functional", "all_reduce"): Collective("all_reduce", group_arg=2),
    ("_c10d_functional", "all_reduce_"): Collective("all_reduce", in_place=True, group_arg=2),  # what Inductor emits
    ("_c10d_functional", "all_reduce_coalesced"): Collective("all_reduce"),
    ("_c10d_functional", "all_to_all_single"): Collective("all_to_all", size_arg=1, group_arg=3),
    # torch's process-group ops: what eager torch FSDP2 and DDP dispatch.
    ("c10d", "_allgather_base_"): Collective("all_gather"),
    ("c10d", "allgather_"): Collective("all_gather"),
    ("c10d", "allgather_into_tensor_coalesced_"): Collective("all_gather"),
    ("c10d", "_reduce_scatter_base_"): Collective("reduce_scatter"),
    ("c10d", "reduce_scatter_"): Collective("reduce_scatter"),
    ("c10d", "reduce_scatter_tensor_coalesced_"): Collective("reduce_scatter"),
    ("c10d", "allreduce_"): Collective("all_reduce"),
    ("c10d", "allreduce_coalesced_"): Collective("all_reduce"),
    ("c10d", "alltoall_base_"): Collective("all_to_all"),
    ("c10d", "alltoall_"): Collective("all_to_all"),
}


def _packets() -> dict[torch._ops.OpOverloadPacket, Collective]:
    found = {}
    for (namespace, name), collective in _TABLE.items():
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None:
            found[packet] = collective
    return found


#: Every collective op this torch build has, by overload packet (``func.overloadpacket``).
COLLECTIVES: dict[torch._ops.OpOverloadPacket, Collective] = _packets()


def collective(target: object) -> Collective | None:
    """What ``target`` (an op overload, its packet, or a node's target) is, if a collective."""
    packet = getattr(target, "overloadpacket", target)
    return COLLECTIVES.get(packet) if isinstance(packet, torch._ops.OpOverloadPacket) else None


def node_collective(node: fx.Node) -> Collective | None:
    """``collective(node.target)`` for a ``call_function`` node, else ``None``."""
    return collective(node.target) if node.op == "call_function" else None
