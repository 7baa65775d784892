"""The ``fsdp`` library object every op module registers into, and the dispatch keys of the real kernels."""

from torch.library import Library

_lib = Library("fsdp", "FRAGMENT")  # torch.distributed.fsdp owns other fsdp:: names

_BACKEND_KEYS = ("CPU", "CUDA")
