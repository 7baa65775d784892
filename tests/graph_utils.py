"""Building small FX graphs with fake values, and capturing what torch.compile produces."""

from __future__ import annotations

from collections import Counter

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch.fx.experimental.proxy_tensor import make_fx

from compile_shard._annotation import GroupAnnotation, write_group_annotation
from compile_shard.passes import has_sharded_params, overridden, run_partitioned_suite, run_pre_grad_suite

c10d = torch.ops._c10d_functional
fsdp = torch.ops.fsdp


def trace(fn, *args) -> fx.GraphModule:
    """``make_fx`` with fake tensors: every node carries ``meta["val"]``."""
    return make_fx(fn, tracing_mode="fake")(*args)


def make_annotation(name: str, reshard_after_forward: bool = True, **knobs) -> GroupAnnotation:
    """The annotation the runtime gives group ``name`` of a model with no other group."""
    return GroupAnnotation(name, reshard_after_forward, members=(name,), model_groups=(name,), **knobs)


def annotate_group(graph: fx.Graph, name: str, reshard_after_forward: bool) -> None:
    """Marks every fsdp all-gather the way the runtime's trace does."""
    for node in graph.find_nodes(op="call_function", target=fsdp.all_gather_into.default):
        write_group_annotation(node, make_annotation(name, reshard_after_forward))


def op_counts(graph: fx.Graph) -> Counter:
    """Collective and storage ops in ``graph``, by short name."""
    names = {
        fsdp.all_gather_into.default: "fsdp.all_gather_into",
        fsdp.reduce_scatter_grad.default: "fsdp.reduce_scatter_grad",
        fsdp.sum_shards.default: "fsdp.sum_shards",
        fsdp.set_.default: "fsdp.set_",
        fsdp.resize_storage_.default: "fsdp.resize_storage_",
        c10d.all_gather_into_tensor.default: "all_gather",
        c10d.all_gather_into_tensor_out.default: "all_gather_out",
        fsdp.all_gather_send_recv_.default: "all_gather_send_recv_",
        fsdp.all_gather_params_.default: "all_gather_params_",
        c10d.reduce_scatter_tensor.default: "reduce_scatter",
        c10d.all_reduce.default: "all_reduce",
        c10d.all_to_all_single.default: "all_to_all",
        fsdp.all_to_all_into_.default: "all_to_all_into_",
        fsdp.all_to_all_grads_.default: "all_to_all_grads_",
        fsdp.all_gather_with_comm.default: "fsdp.all_gather_with_comm",
        fsdp.reduce_scatter_with_comm.default: "fsdp.reduce_scatter_with_comm",
        c10d.wait_tensor.default: "wait",
    }
    return Counter(names[node.target] for node in graph.nodes if node.target in names)


class CapturingBackend:
    """An AOT backend that records the joint, forward and backward graphs it compiles.

    Like Inductor's post-grad hook, its compilers schedule the partitioned graphs
    (``run_partitioned_suite``) before running them eagerly. ``pre_grad``: like
    Inductor's pre-grad hook, it runs ``run_pre_grad_suite`` on Dynamo's graph first.
    """

    def __init__(self, min_cut: bool = False, pre_grad: bool = False):
        self.joint_graphs: list[fx.GraphModule] = []
        self.forward_graphs: list[fx.GraphModule] = []
        self.backward_graphs: list[fx.GraphModule] = []
        partition = min_cut_rematerialization_partition if min_cut else default_partition

        def partition_fn(joint, joint_inputs, **kwargs):
            self.joint_graphs.append(joint)
            return partition(joint, joint_inputs, **kwargs)

        def keep(graphs):
            def compiler(graph_module, example_inputs):
                if has_sharded_params(graph_module.graph):
                    run_partitioned_suite(graph_module.graph)
                    graph_module.recompile()
                graphs.append(graph_module)
                return make_boxed_func(graph_module.forward)

            return compiler

        aot_backend = aot_autograd(
            fw_compiler=keep(self.forward_graphs), bw_compiler=keep(self.backward_graphs), partition_fn=partition_fn
        )

        def backend(graph_module, example_inputs):
            if pre_grad and run_pre_grad_suite(graph_module.graph):
                graph_module.recompile()
            return aot_backend(graph_module, example_inputs)

        self.backend = backend


# The tests' name for compile_shard.passes.overridden: settings for one block.
pass_settings = overridden
