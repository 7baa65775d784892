"""The storage ops: ``set_`` and ``resize_storage_``, with the Functionalize kernels AOTAutograd needs."""

from __future__ import annotations

import torch

from .library import _lib, define, kernel, meta

set_ = define("set_(Tensor(a!) tensor, Tensor source) -> ()")
# [Note: resize_storage_ schema]
# The schema carries no alias annotation on purpose. A storage resize has no
# functional equivalent, and AOTAutograd asserts a functional joint graph before any
# pass runs; an annotated mutation whose Functionalize kernel re-dispatches fails that
# assert. torch's own ``inductor::resize_storage_bytes_`` uses the same trick. The op
# is marked side-effectful below so dead-code elimination keeps it, and the passes
# remove every occurrence before lowering, so no alias analysis ever relies on it.
resize_storage_ = define("resize_storage_(Tensor tensor, SymInt nbytes) -> ()")
torch.fx.node.has_side_effect(resize_storage_)


# set_ --------------------------------------------------------------------------------


@kernel("set_")
@meta("set_")  # on Meta tensors too: it changes no data, only what the tensor refers to
def _set_kernel(tensor, source):
    with torch.no_grad():
        tensor.set_(source)


def _set_functionalize(tensor, source):
    # aten.set_ on functional tensors is one of the mutations AOTAutograd accepts on
    # graph inputs, so the op is expressed as exactly that.
    torch.ops.aten.set_.source_Tensor(tensor, source)


_lib.impl("set_", _set_functionalize, "Functionalize")


# resize_storage_ ---------------------------------------------------------------------


@kernel("resize_storage_")
def _resize_storage_kernel(tensor, nbytes):
    storage = tensor.untyped_storage()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


@meta("resize_storage_")
def _resize_storage_meta(tensor, nbytes):
    return None


def _resize_storage_functionalize(tensor, nbytes):
    torch._sync(tensor)
    inner = torch._from_functional_tensor(tensor)
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)):
        resize_storage_(inner, nbytes)


_lib.impl("resize_storage_", _resize_storage_functionalize, "Functionalize")
