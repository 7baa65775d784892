"""FSDP2's gradient accumulation between reductions: the two switches and the buffers they fill."""

from __future__ import annotations

from collections.abc import Callable

import torch


class GradientBuffers:
    """A group's gradients accumulated between reductions, eager and compiled.

    FSDP2's ``set_requires_gradient_sync(False)``: backward adds the unsharded gradients
    into ``accumulated_grad`` (a buffer laid out like the all-gather output) instead of
    reducing them; and on HSDP ``set_requires_all_reduce(False)``: it adds the
    reduce-scattered gradients into ``partial_reduce_output`` (one rank's shards)
    instead of all-reducing them ([Note: gradient accumulation without sync], [Note:
    HSDP reduction] in compile_shard.ops). The buffers are allocated here, in eager
    Python, so that a trace only reads them; a gathering with gradients takes them
    with it (``take``), and the backward that receives them writes or reduces them.
    """

    def __init__(self, replicates: bool):
        #: Whether the group has HSDP's replicate dimension, over which reductions all-reduce.
        self.replicates = replicates
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.accumulated_grad: torch.Tensor | None = None
        self.partial_reduce_output: torch.Tensor | None = None

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, allocate: Callable[[bool], torch.Tensor | None]
    ) -> None:
        """``allocate(unsharded)``: a zeroed buffer of the unsharded (True) or one rank's (False) gradients."""
        self.requires_gradient_sync = requires_gradient_sync
        if not requires_gradient_sync and self.accumulated_grad is None:
            self.accumulated_grad = allocate(True)

    def set_requires_all_reduce(self, requires_all_reduce: bool, allocate: Callable[[bool], torch.Tensor | None]) -> None:
        self.requires_all_reduce = requires_all_reduce
        if not requires_all_reduce and self.replicates and self.partial_reduce_output is None:
            self.partial_reduce_output = allocate(False)

    def take(self, takes_gradients: bool) -> tuple[torch.Tensor | None, bool, bool, torch.Tensor | None]:
        """What a gathering passes its backward: ``accumulated_grad``, ``reduce_grads``, ``all_reduce_grads``,
        ``partial_reduce_output``.

        A gathering with gradients takes the buffers with it, and the group forgets those
        that the backward receiving them reduces; one without gradients (an evaluation
        forward, a refill) leaves them for the next.
        """
        accumulated_grad, reduce_grads = None, True
        if self.accumulated_grad is not None and takes_gradients:
            accumulated_grad, reduce_grads = self.accumulated_grad, self.requires_gradient_sync
            if reduce_grads:
                self.accumulated_grad = None
        partial_reduce_output, all_reduce_grads = None, True
        if self.partial_reduce_output is not None and takes_gradients and reduce_grads:
            partial_reduce_output, all_reduce_grads = self.partial_reduce_output, self.requires_all_reduce
            if all_reduce_grads:
                self.partial_reduce_output = None
        return accumulated_grad, reduce_grads, all_reduce_grads, partial_reduce_output

    def take_for_finalization(self) -> torch.Tensor | None:
        """The gradients accumulated without sync, for ``finalize_backward`` to reduce once sync is back on."""
        if self.accumulated_grad is None or not self.requires_gradient_sync:
            return None
        accumulated, self.accumulated_grad = self.accumulated_grad, None
        return accumulated

    def to(self, dtype: torch.dtype) -> None:
        """Pending gradients follow a new reduction dtype ([Note: dtypes settled before each step])."""
        if self.accumulated_grad is not None and self.accumulated_grad.dtype != dtype:
            self.accumulated_grad = self.accumulated_grad.to(dtype)
        if self.partial_reduce_output is not None and self.partial_reduce_output.dtype != dtype:
            self.partial_reduce_output = self.partial_reduce_output.to(dtype)
