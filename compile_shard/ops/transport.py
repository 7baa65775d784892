"""The gloo point-to-point transport of the ``fsdp`` ops: one call's sends and receives, waited for as one work.

Used by the ops that replace gloo's collectives (``all_gather_send_recv_``,
``all_gather_params_``, ``all_to_all_grads_``); ``compile_shard.ops.backend`` decides
when they run.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.distributed.distributed_c10d import _resolve_process_group

# [Note: gloo exchange in place]
# On gloo, the compiled graphs move parameters and gradients where they lie. The
# general path copies a group's shards into one flat input (copy-in), gathers it
# rank-major, and copies every parameter's rows back out of the rank-major buffer
# (copy-out); a reduction copies the gradients rank-major (``reduce_scatter_input``)
# before its all-to-all. Each of those copies is a kernel of the compiled graph that
# moves the whole unsharded group on the cores the compute runs on, and a kernel
# Inductor compiles. Point-to-point transfers need no common layout: each message
# carries one parameter's shard from the sharded parameter into its rows of every
# peer's unsharded parameter (``all_gather_params_``), or one gradient's rows to the
# rank that owns them (``all_to_all_grads_``). Only this rank's own piece is copied,
# and a piece shorter than its padded size (dim 0 not divisible by the world size)
# is padded first, so that every receiver knows the size it receives. Pieces under
# ``_PACK_BELOW_BYTES`` (norm weights, biases) share one message per peer instead,
# concatenated on the way out and copied into place on the wait: a message costs more
# than copying them.
#
# ``all_gather_params_`` fills a group's unsharded parameters one after another, each
# ``[world_size * padded_numel]`` (its padded rows, rank by rank): the layout the
# ``copy_out`` pass's concatenation produces, whose readers it replaces
# (``gather_buffers``). ``all_to_all_grads_`` fills the rank-major buffer an all-to-all
# of the group's reduction input (``reduce_scatter_input``) would have received, which
# ``sum_shards`` adds. Both are asynchronous like ``all_gather_send_recv_``.

_send_recv_tags: dict[str, itertools.count] = {}
_MAX_TAG = 1 << 30
# A work that runs a Python callable on wait (not in every torch: the op then waits itself).
_CALLBACK_WORK = getattr(torch._C._distributed_c10d, "PythonCallbackWork", None)

# A message per piece costs the calling thread a fixed time on gloo over loopback, about
# that of copying a few hundred KiB (timings in docs/torch-2.13-findings.md): smaller
# pieces share one.
_PACK_BELOW_BYTES = 256 * 2**10


def _padded_flat(tensor: torch.Tensor, numel: int) -> torch.Tensor:
    """``tensor`` flattened and zero-padded to ``numel`` elements, contiguous; a view where it can be."""
    flat = tensor.reshape(-1)
    return flat if flat.numel() == numel else F.pad(flat, (0, numel - flat.numel()))


def _waiter(works, unpacks):
    """``fn(timeout) -> bool`` for ``PythonCallbackWork``: waits for ``works``, then copies received packs out."""

    def wait(timeout=None) -> bool:
        if not all(work.wait() if timeout is None else work.wait(timeout) for work in works):
            return False
        while unpacks:
            packed, pieces = unpacks.pop()
            for piece, received in zip(pieces, packed.split([piece.numel() for piece in pieces])):
                piece.copy_(received.view_as(piece))
        return True

    return wait


class _Exchange:
    """Point-to-point transfers of one op call on a gloo group, waited for together through its output.

    Each message takes the group's next tag, in the same order on every rank, so
    transfers in flight together never take each other's messages.
    """

    def __init__(self, group_name: str):
        self.group_name = group_name
        self.group = _resolve_process_group(group_name)
        self.rank = self.group.rank()
        self.peers = [peer for peer in range(self.group.size()) if peer != self.rank]
        self.works = []
        self.unpacks = []
        self.small_sends = [[] for _ in range(self.group.size())]
        self.small_receives = [[] for _ in range(self.group.size())]

    def exchange(self, sends: Sequence[torch.Tensor], receives: Sequence[torch.Tensor]) -> None:
        """Sends ``sends[peer]`` to every peer and receives ``receives[peer]`` from it; copies this rank's own.

        Pieces under ``_PACK_BELOW_BYTES`` wait for ``register``, which sends them together.
        Every rank passes pieces of the same sizes, so all ranks agree on what is packed.
        """
        if sends[self.rank].numel() * sends[self.rank].element_size() < _PACK_BELOW_BYTES:
            for peer, (send, receive) in enumerate(zip(sends, receives)):
                self.small_sends[peer].append(send)
                self.small_receives[peer].append(receive)
            return
        self._post([[send] for send in sends], [[receive] for receive in receives])

    def _post(self, sends: Sequence[list[torch.Tensor]], receives: Sequence[list[torch.Tensor]]) -> None:
        """One message per peer; a peer's several pieces travel concatenated and are copied out on wait."""
        tag = next(_send_recv_tags.setdefault(self.group_name, itertools.count())) % _MAX_TAG
        for peer in self.peers:
            if len(receives[peer]) == 1:
                self.works.append(self.group.recv(receives[peer], peer, tag))
            else:
                packed = receives[peer][0].new_empty(sum(piece.numel() for piece in receives[peer]))
                self.works.append(self.group.recv([packed], peer, tag))
                self.unpacks.append((packed, receives[peer]))
        for peer in self.peers:
            pieces = sends[peer]
            self.works.append(self.group.send([pieces[0] if len(pieces) == 1 else torch.cat(pieces)], peer, tag))
        for send, receive in zip(sends[self.rank], receives[self.rank]):
            receive.copy_(send.view_as(receive))

    def register(self, output: torch.Tensor) -> None:
        """Sends the small pieces; ``_c10d_functional.wait_tensor(output)`` then waits for every transfer.

        Where ``PythonCallbackWork`` is missing, waits now instead.
        """
        if self.small_sends[self.rank]:
            self._post(self.small_sends, self.small_receives)
        wait = _waiter(self.works, self.unpacks)
        if _CALLBACK_WORK is None:
            wait()
        else:
            torch._C._distributed_c10d._register_work(output, _CALLBACK_WORK(wait))
