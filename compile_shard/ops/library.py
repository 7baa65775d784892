"""The ``fsdp`` library object every op module registers into, and the dispatch keys of the real kernels."""

from collections.abc import Callable

from torch.library import Library

_lib = Library("fsdp", "FRAGMENT")  # torch.distributed.fsdp owns other fsdp:: names

_BACKEND_KEYS = ("CPU", "CUDA")


def register_kernels(name: str, kernel: Callable, meta: Callable) -> None:
    """``kernel`` for every backend key, and ``meta``, which FakeTensor mode runs as the fake kernel."""
    for key in _BACKEND_KEYS:
        _lib.impl(name, kernel, key)
    _lib.impl(name, meta, "Meta")
