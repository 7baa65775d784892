"""The torch versions compile_shard supports, and everything that differs between them.

compile_shard lives on torch internals (Dynamo's side-effect classes, the region
operator, the partitioner, FSDP2's own classes), so each supported minor release is
tested, and each difference between them is decided here, by name, instead of by
version checks spread through the code. On a torch newer than the tested range
compile_shard runs as on the newest one it knows and warns once at import; an older
one is refused.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed.fsdp

#: The minor releases the test suite runs on.
SUPPORTED = ((2, 13), (2, 14), (2, 15))

TORCH_VERSION: tuple[int, int] = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


class UntestedTorchWarning(UserWarning):
    """compile_shard is imported with a torch release its tests do not run on."""


def warn_if_untested() -> None:
    """Raises on a torch older than the tested range; warns once, naming the range, on a newer one.

    Before 2.13 ``nested_compile_region`` takes no ``reuse_hash_fn``, which the blocks'
    compile regions need ([Note: sharded blocks as nested compile regions]).
    """
    if TORCH_VERSION < SUPPORTED[0]:
        raise ImportError(
            f"compile_shard needs torch {SUPPORTED[0][0]}.{SUPPORTED[0][1]} or later (tested with "
            f"{SUPPORTED[0][0]}.{SUPPORTED[0][1]} to {SUPPORTED[-1][0]}.{SUPPORTED[-1][1]}); this is torch "
            f"{torch.__version__}. Install a supported torch, e.g. pip install torch==2.13.0"
        )
    if TORCH_VERSION not in SUPPORTED:
        first, last = SUPPORTED[0], SUPPORTED[-1]
        warnings.warn(
            f"compile_shard is tested with torch {first[0]}.{first[1]} to {last[0]}.{last[1]}; this is torch "
            f"{torch.__version__}. It may work, or fail in torch internals it relies on",
            UntestedTorchWarning,
            stacklevel=3,
        )


#: FSDP2's reduction dtype without a ``reduce_dtype``: up to 2.14 the dtype gradients
#: are computed in (``param_dtype``); from 2.15, where an unsharded parameter carries
#: a ``grad_dtype``, the sharded parameter's own dtype, which gradients accumulate in
#: ([Note: mixed-precision reduction] in compile_shard.ops).
REDUCES_IN_THE_PARAMETER_DTYPE = TORCH_VERSION >= (2, 15)

#: FSDP2 from 2.15 gives its unsharded parameter (an autograd leaf) the ``grad_dtype``
#: of the reduction, and autograd casts each gradient contribution to it before adding
#: them: a parameter read twice (tied weights) adds its contributions rounded to a
#: narrower ``reduce_dtype`` ([Note: gradient contributions] in compile_shard._param).
ROUNDS_EACH_GRADIENT_CONTRIBUTION = TORCH_VERSION >= (2, 15)

#: FSDP2's handle of an asynchronous ``finalize_backward`` (torch 2.15); ``object`` before.
GradientReductionHandle = getattr(torch.distributed.fsdp, "GradientReductionHandle", object)


class CompletedGradientReduction(GradientReductionHandle):
    """``finalize_backward(async_op=True)``'s handle: compile_shard's reductions are complete already."""

    def wait(self) -> None:
        return None


#: Dynamo keeps what it traced for another process (``caching_precompile``), and
#: compiles anew next to a loaded trace whose guards fail (a changed model, a new input
#: shape): from 2.15. Torch 2.13 and 2.14 load compile_shard's saved trace, but their
#: Dynamo then fails any new compile of the same function ("Name '__builtins_dict___0'
#: already exists in scope"), so their file holds AOTAutograd's and Inductor's output
#: only ([Note: a restarted job loads its compiled step] in compile_shard._cache_artifacts).
CACHES_DYNAMO_OUTPUT = TORCH_VERSION >= (2, 15)
