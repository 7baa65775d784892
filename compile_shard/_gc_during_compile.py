"""Full garbage collections deferred while Dynamo compiles, as torch does from 2.15.

[Note: full collections during a compile]
A full (generation-2) collection walks every object the collector tracks, and a
compile creates them by the hundred thousand (Dynamo's variables and guards, FX nodes,
fake tensors, sympy expressions), so with CPython's default threshold the collector
rescans a heap that is still growing, again and again. A sharded step pays for it per
block: on torch 2.13 capturing config B's Llama at 64 layers ran 11 full collections
(3.9 s) against 6 at 8 layers (docs/benchmarks.md). torch 2.15 raises the threshold
for the duration of each compile itself (``torch._dynamo.config.
gc_gen2_threshold_during_compile``, default 1000, environment variable
``TORCH_DYNAMO_GC_GEN2_THRESHOLD_DURING_COMPILE``, 0 for off); on a torch without that
setting, the root's traced forward installs the same behaviour, under the same
variable, through Dynamo's compile callbacks. The collections are deferred, not skipped: the younger
generations keep collecting, and once the threshold is restored the next full
collection comes soon after the compile. The cost is peak memory: cyclic garbage that
reached the oldest generation waits longer (torch measured +1.3% on one model).
"""

from __future__ import annotations

import gc
import os

import torch

from ._compile_events import call_around_each_compile

_ENVIRONMENT_VARIABLE = "TORCH_DYNAMO_GC_GEN2_THRESHOLD_DURING_COMPILE"
_DEFAULT_THRESHOLD = 1000

_saved_thresholds: tuple[int, int, int] | None = None


def _threshold() -> int:
    """The generation-2 threshold to compile with; 0: leave CPython's alone."""
    return int(os.environ.get(_ENVIRONMENT_VARIABLE, _DEFAULT_THRESHOLD))


def _raise_threshold(_args: object) -> None:
    global _saved_thresholds
    threshold = _threshold()
    if threshold == 0:
        return
    _saved_thresholds = gc.get_threshold()
    youngest, middle, oldest = _saved_thresholds
    gc.set_threshold(youngest, middle, max(oldest, threshold))  # never below what the program set


def _restore_threshold(_args: object) -> None:
    global _saved_thresholds
    if _saved_thresholds is not None:
        gc.set_threshold(*_saved_thresholds)
        _saved_thresholds = None


@torch.compiler.assume_constant_result
def defer_full_collections_while_compiling() -> bool:
    """Defers them in this compile and the later ones, where torch does not itself.

    Called by the root's traced forward: Dynamo runs it (a constant result) once per
    trace, so it installs the deferral again after ``torch._dynamo.reset()``, which
    removes Dynamo's compile callbacks. Returns True.
    """
    if hasattr(torch._dynamo.config, "gc_gen2_threshold_during_compile"):
        return True
    if call_around_each_compile(_raise_threshold, _restore_threshold):
        _raise_threshold(None)  # Dynamo runs them when the outermost compile starts and ends; this one has started
    return True
