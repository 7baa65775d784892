"""The ``fsdp`` op library: every collective and storage operation of the runtime.

The runtime (eager and traced) calls these ops and nothing else for sharding, so
Dynamo records them by name and the pass suite (``compile_shard.passes``) can find,
rewrite and lower them. Each op has CPU, CUDA and Meta kernels; the differentiable
ones have autograd formulas, the mutating ones a Functionalize kernel that keeps
AOTAutograd's functional-graph check satisfied.

One module per job; importing this package registers every op:

- ``library``: the ``fsdp`` ``Library`` object, ``define`` (an op from its schema) and the
  decorators that register a function as an op's kernel, Meta kernel or backward;
- ``all_gather``: ``all_gather_into``, ``all_gather_send_recv_``, ``all_gather_params_``,
  ``post_forward_chunk``, ``as_gathered`` (``all_gather_into``'s autograd for unsharded
  parameters gathered another way), ``call_all_reduce_hook_`` (a group's all-reduce
  hook), ``all_gather_with_comm`` (a custom all-gather) and, eager only,
  ``as_gathered_views`` (``as_gathered`` for tensor subclasses);
- ``reduce_scatter``: ``reduce_scatter_grad``, ``reduce_scatter_input``,
  ``reduce_scatter_input_into_``, ``all_to_all_into_``, ``all_to_all_grads_``, ``sum_shards``,
  ``reduce_scatter_with_comm`` (a custom reduce-scatter);
- ``names``: the Python objects (hooks, custom comms) op arguments name;
- ``storage``: ``set_``, ``resize_storage_``;
- ``rank_check``: ``rank_check``, the check that a group's ranks run the same
  collectives, which the pass of that name puts first in each compiled graph;
- ``transport``: the gloo point-to-point exchange the gloo ops share;
- ``backend``: whether a group uses a ``_c10d_functional`` collective or that exchange;
- ``checks``: checks several op families share.

An op module holds its ops' schemas, real and Meta kernels and autograd formulas; it
imports ``transport``, ``backend``, ``checks`` and ``library``, which import no op
module. Ops of different modules call each other only through ``torch.ops.fsdp``.

[Note: op signatures are rank independent]
No op takes a rank. A rank argument would make every rank's graph different; the
collectives take ``world_size`` and a process-group name instead, like
``_c10d_functional``. Padding is expressed as the per-parameter *padded* shard numel,
which is the same on every rank.

[Note: a group of one rank]
A group of one rank (the shard dimension of a (N, 1) HSDP mesh, FSDP2's NO_SHARD, or
a world of one) gathers and reduce-scatters nothing: the all-gather output is the
all-gather input and the sharded gradient is the reduce-scatter input, a sum or an
average of one. The kernels and ``lower`` issue no collective for it, as FSDP2 issues
none; on HSDP the replicate dimension's all-reduce is then the group's only one.
"""

from . import transport
from .all_gather import (
    all_gather_into,
    all_gather_params_,
    all_gather_send_recv_,
    all_gather_with_comm,
    as_gathered,
    as_gathered_views,
    call_all_reduce_hook_,
    copy_in,
    copy_out,
    post_forward_chunk,
    reduce_accumulated_grad,
    ReductionOptions,
)
from .backend import allocates_comm_tensors, gathers_as_bytes, gathers_by_send_recv, reduces_by_all_to_all
from .reduce_scatter import (
    all_to_all_grads_,
    all_to_all_into_,
    reduce_scatter_grad,
    reduce_scatter_input,
    reduce_scatter_input_into_,
    reduce_scatter_with_comm,
    sum_shards,
)
from .names import bind, new_name
from .rank_check import RankMismatchError
from .storage import resize_storage_, set_

__all__ = [
    "allocates_comm_tensors",
    "all_gather_into",
    "all_gather_params_",
    "all_gather_send_recv_",
    "all_gather_with_comm",
    "as_gathered",
    "as_gathered_views",
    "bind",
    "RankMismatchError",
    "call_all_reduce_hook_",
    "copy_in",
    "copy_out",
    "new_name",
    "post_forward_chunk",
    "all_to_all_grads_",
    "all_to_all_into_",
    "gathers_as_bytes",
    "gathers_by_send_recv",
    "reduce_accumulated_grad",
    "ReductionOptions",
    "reduce_scatter_grad",
    "reduce_scatter_input",
    "reduce_scatter_input_into_",
    "reduce_scatter_with_comm",
    "reduces_by_all_to_all",
    "sum_shards",
    "set_",
    "resize_storage_",
]

_PACK_BELOW_BYTES = transport._PACK_BELOW_BYTES  # tests/test_ops.py reads it here
