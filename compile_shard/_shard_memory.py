"""Where one parameter's shard lives: on the mesh's device, or with ``CPUOffloadPolicy`` in CPU memory.

A base of ``FSDPParam`` (``_param``), which gives it ``shard``, ``fqn``,
``padded_rows``, and the two answers of FSDP2's ``OffloadPolicy`` that
``_init.shard_memory`` reads at ``fully_shard``: ``pin_memory`` and
``compute_device``. Its padded shards are allocated here, the all-gather reads the
shard through here, and the forward checks here that it can gather it.
"""

from __future__ import annotations

import torch


class ShardMemory:
    """What ``CPUOffloadPolicy`` changes for a parameter ([Note: CPU offload]).

    Where its padded shard is allocated, what the all-gather reads of it, and which
    device the forward expects it on.
    """

    @property
    def offload_to_cpu(self) -> bool:
        """Whether the shard is kept in CPU memory while the mesh computes on an accelerator ([Note: CPU offload])."""
        return self.compute_device is not None

    def _new_padded_shard(self, like: torch.Tensor) -> torch.Tensor:
        """Zeroed padded storage: in CPU memory with ``CPUOffloadPolicy``, pinned with its ``pin_memory``."""
        in_cpu_memory = self.offload_to_cpu and not like.is_meta
        padded = like.new_zeros((self.padded_rows, *like.shape[1:]), device="cpu" if in_cpu_memory else None)
        return padded.pin_memory() if self.pin_memory and not padded.is_meta else padded

    def all_gather_shard(self, requires_grad: bool) -> torch.Tensor:
        """What the all-gather reads: ``shard``, detached for a parameter that takes no gradient, on the mesh's device.

        ``requires_grad``: the sharded parameter's, as the caller read it ([Note: settings
        a trace reads as constants] in compile_shard._group_gather).

        [Note: CPU offload]
        FSDP2's ``CPUOffloadPolicy`` on an accelerator's mesh: the padded shard, and with
        it the sharded parameter, its gradient and the optimizer's state, live in CPU
        memory (pinned with ``pin_memory=True``). The all-gather reads a copy of the
        shard on the mesh's device, made here at every gather (a non-blocking copy from
        pinned memory), and the gradient comes back to CPU memory through that copy's
        backward, so ``shard``'s hook receives it on the CPU like any other. In a trace
        the copy is one of the shard views feeding the all-gather
        (``passes.patterns.all_gather_chain``): the passes move it with the gather, and a
        resharded group's backward copies the shard again, as FSDP2's does, instead of
        keeping it on the device. FSDP2 copies the sharded gradient into pinned memory
        without blocking and waits for it at the end of backward; autograd's copy
        blocks at each: the same values, later.
        """
        shard = self.shard if requires_grad else self.shard.detach()
        return shard if self.compute_device is None else shard.to(self.compute_device, non_blocking=True)

    def validate_device(self, device_type: str) -> None:
        """Raises for a parameter the forward cannot gather: still on meta, or off the mesh's device.

        It reads ``shard``, which follows the local tensor's storage through
        ``reset_sharded_param`` (``to_empty``, ``to``) and is a graph input of every
        trace anyway: reading the DTensor's ``device`` costs Dynamo more per
        parameter, and reading ``_local_tensor`` would add each local tensor as an
        input beside its ``shard``.
        """
        device = self.shard.device
        home = "cpu" if self.offload_to_cpu else device_type
        if device.type == "meta":
            raise RuntimeError(
                f"fully_shard: parameter {self.fqn!r} is still on the meta device at the first forward. "
                f"Materialize it first, e.g. module.to_empty(device={home!r}) and then initialize "
                "the values (reset_parameters() or load a state dict)"
            )
        if device.type != home:
            raise RuntimeError(
                f"fully_shard: parameter {self.fqn!r} is on {device} but the mesh covers "
                f"{device_type!r} devices. Move the module with module.to({device_type!r}) before its forward"
            )
