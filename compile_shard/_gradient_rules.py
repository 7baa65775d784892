"""FSDP2's rules for one parameter's sharded gradient: which dtype it takes, and none where no forward used it.

A base of ``FSDPParam`` (``_param``), which gives it the sharded parameter, its
``shard``, its ``fqn``, the ``grad_dtype_policy`` it was sharded with, and the slot of
its use flag in its group's list (``_used``, ``_slot``: [Note: one mutated list per
group] in ``_param``). Both rules are settled outside the traced graphs: the dtype
before a step, as the group resolves its dtypes, and the use as an eager all-gather's
backward hands the reduced gradients on; the sharded gradient itself is written by
``FSDPParam`` ([Note: the shard autograd sees] in ``_param``).
"""

from __future__ import annotations

import torch


def grad_dtype_policy_of(param: torch.Tensor) -> tuple[bool, torch.dtype | None]:
    """``param``'s torch 2.15 ``Tensor.grad_dtype`` as FSDP2's sharded_grad_dtype policy: (explicit?, dtype or None)."""
    return (True, param.grad_dtype) if getattr(param, "_has_grad_dtype_override", False) else (False, None)


class GradientRules:
    """What the group asks of a parameter about its sharded gradient before ``FSDPParam`` writes it.

    Its dtype ([Note: grad_dtype]) and, eagerly, whether it gets one at all ([Note:
    unused parameters] in passes.unused_params).
    """

    @property
    def used_since_reduction(self) -> bool | None:
        """Eager only: whether backward reached the unsharded parameter since the last sharded gradient.

        ``None`` where nothing watches ([Note: unused parameters] in passes.unused_params).
        """
        return self._used[self._slot]

    @used_since_reduction.setter
    def used_since_reduction(self, value: bool | None) -> None:
        self._used[self._slot] = value

    def capture_grad_dtype_policy(self) -> None:
        """An explicit grad_dtype set on the sharded parameter since (FSDP2's _capture_grad_dtype_policy)."""
        explicit, dtype = grad_dtype_policy_of(self.sharded_param)
        if explicit:
            self.grad_dtype_policy = (explicit, dtype)

    def apply_grad_dtype_policy(self) -> None:
        """The sharded parameter and the shard (the leaf the reduction's gradient reaches) take an explicit grad_dtype."""
        explicit, dtype = self.grad_dtype_policy
        if explicit:
            self.sharded_param.grad_dtype = dtype
            self.shard.grad_dtype = dtype

    def sharded_grad_dtype(self, reduction_dtype: torch.dtype) -> torch.dtype:
        """The sharded gradient's dtype: an explicit grad_dtype (None: the reduction's), else the parameter's.

        [Note: grad_dtype]
        torch 2.15's ``Tensor.grad_dtype`` on a parameter asks for gradients of another
        dtype than its own (bf16 weights with fp32 gradients for a mixed-precision
        optimizer), and FSDP2 2.15 honours it: the reduction runs in ``reduce_dtype``,
        else in the promotion of the parameters' gradient dtypes, and each sharded
        gradient is cast to its parameter's ``grad_dtype`` (left in the reduction's dtype
        where it is None). Here the all-gather's backward casts to those dtypes
        (``AllGatherPart.grad_dtypes``), and the shard, the leaf the gradient reaches, and
        the sharded parameter carry the ``grad_dtype``, kept across ``_apply``. A compiled
        backward returns each input's gradient in the input's own dtype, so a
        ``grad_dtype`` wider than its parameter's would arrive rounded: compiling such a
        model raises instead (docs/api.md).
        """
        explicit, dtype = self.grad_dtype_policy
        if not explicit:
            return self.sharded_param.dtype
        return reduction_dtype if dtype is None else dtype

    def watch_use(self, unsharded_param: torch.Tensor) -> None:
        """Records whether backward reaches ``unsharded_param`` (eager: [Note: unused parameters])."""
        if self.used_since_reduction is None:
            self.used_since_reduction = False
        unsharded_param.register_hook(self._mark_used)

    def _mark_used(self, grad: torch.Tensor) -> None:
        self.used_since_reduction = True

    def reduced_gradient_if_used(self, shard_grad: torch.Tensor | None) -> torch.Tensor | None:
        """An eager all-gather's reduced gradient for this parameter: None where no forward used it since the last.

        ([Note: unused parameters] in passes.unused_params.) Called as the all-gather's
        backward hands it on, so that it judges that gather's reduction alone: a compiled
        backward's gradient for the same parameter (an eager call of a module beside a
        compiled forward) joins it later, in the shard's accumulation.
        """
        if shard_grad is None:  # accumulated without sync: nothing reduced yet
            return None
        used, self.used_since_reduction = self.used_since_reduction, None
        if used is not False:
            return shard_grad
        if shard_grad.any():
            raise RuntimeError(
                f"fully_shard: parameter {self.fqn!r} was not used by this rank's forward, yet its reduced "
                "gradient is not zero: another rank used it. As in FSDP2, every rank must use the same "
                "parameters, or call set_reduce_scatter_unused_params(True) on the module so that an "
                "unused parameter gets a zero gradient"
            )
        return None
