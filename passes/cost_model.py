"""cost_model: estimated seconds per FX node (roofline compute, ring collectives) on a chosen hardware profile.

Scheduling passes (bucketing, reordering) compare candidate orders of the
partitioned forward and backward graphs without running them, and this project is
developed and tested on CPU-only machines. Torch's own estimator
(``torch._inductor.fx_passes.overlap_scheduling``) needs Triton and a GPU, so this
model reads only the fake tensors in ``meta["val"]``:

- compute: a roofline per node, ``max(flops / peak, bytes moved / memory bandwidth)``
  plus a fixed launch/dispatch overhead. FLOPs come from torch's formulas
  (``torch.utils.flop_counter``) for matmuls, attention and convolutions; every other
  op is charged for the bytes it reads and writes. Views and metadata ops cost 0.
- collectives: the ring model NCCL's bus bandwidth is defined by: ``(W-1)/W`` of the
  buffer over the per-rank bus bandwidth, plus one latency per ring step. A profile
  of several nodes charges a group that spans nodes the slower network's bandwidth
  and latency (HSDP's replicate all-reduce crosses it).

The numbers are for comparing schedules on one profile, not wall-time predictions:
fusion, caches and link contention are ignored. ``PROFILES`` holds an H100 node
(NVLink), H100s over InfiniBand, nodes of 8 H100s (NVLink inside, InfiniBand
across), and this CPU machine as the gloo demo uses it
(measured by ``benchmarks/calibrate_cpu.py``, stored in ``cpu_gloo.json``).
Symbolic sizes use their hints (``optimization_hint``; unbacked sizes get its fallback).
"""

from __future__ import annotations

import dataclasses
import json
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # torch < 2.13
    from torch.fx.experimental.symbolic_shapes import size_hint as optimization_hint
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import flop_registry

from compile_shard._collectives import node_collective

from ._graph import c10d, fsdp, invoke_subgraph, region_module
from .patterns import waited_node
from .settings import settings

aten = torch.ops.aten

#: Where ``benchmarks/calibrate_cpu.py --write`` stores the measured "cpu_gloo" profile.
CPU_GLOO_PATH = Path(__file__).with_name("cpu_gloo.json")


@dataclass(frozen=True)
class HardwareProfile:
    """One device and the network its collectives run on, as the cost model sees them."""

    name: str
    #: Dense matmul peak per dtype; a dtype without an entry gets the slowest one listed.
    flops_per_s: dict[torch.dtype, float]
    memory_bytes_per_s: float
    #: Fixed cost of every compute node that runs a kernel (launch, dispatch).
    kernel_overhead_s: float
    #: Per-rank bus bandwidth of the collective network (NCCL's "busbw").
    link_bytes_per_s: float
    #: Latency of one ring step.
    link_latency_s: float
    description: str
    #: False where collectives need the cores compute runs on (gloo with every core
    #: busy computing): nothing overlaps, every collective is exposed in full.
    overlaps_communication: bool = True
    #: Ranks per node where a second, slower network joins the nodes (HSDP's replicate
    #: groups cross it); ``None``: every collective runs on ``link_bytes_per_s``.
    ranks_per_node: int | None = None
    #: Bus bandwidth and ring-step latency of a collective whose group spans nodes.
    inter_node_bytes_per_s: float | None = None
    inter_node_latency_s: float | None = None

    def link(self, ranks: list[int] | None) -> tuple[float, float]:
        """Bus bandwidth and ring-step latency for a group of these global ranks (``None``: unknown, one node)."""
        if self.ranks_per_node is None or ranks is None or len({rank // self.ranks_per_node for rank in ranks}) < 2:
            return self.link_bytes_per_s, self.link_latency_s
        return self.inter_node_bytes_per_s, self.inter_node_latency_s

    def peak_flops(self, dtype: torch.dtype | None) -> float:
        return self.flops_per_s.get(dtype, min(self.flops_per_s.values()))

    def to_json(self) -> dict[str, Any]:
        """The profile as JSON-ready data; dtypes by name (``"float32"``)."""
        return {
            "name": self.name,
            "flops_per_s": {str(dtype).removeprefix("torch."): rate for dtype, rate in self.flops_per_s.items()},
            "memory_bytes_per_s": self.memory_bytes_per_s,
            "kernel_overhead_s": self.kernel_overhead_s,
            "link_bytes_per_s": self.link_bytes_per_s,
            "link_latency_s": self.link_latency_s,
            "description": self.description,
            "overlaps_communication": self.overlaps_communication,
            "ranks_per_node": self.ranks_per_node,
            "inter_node_bytes_per_s": self.inter_node_bytes_per_s,
            "inter_node_latency_s": self.inter_node_latency_s,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HardwareProfile:
        """Reads ``to_json``'s format; other keys (e.g. raw measurements) are ignored."""
        return cls(
            name=data["name"],
            flops_per_s={getattr(torch, dtype): float(rate) for dtype, rate in data["flops_per_s"].items()},
            memory_bytes_per_s=float(data["memory_bytes_per_s"]),
            kernel_overhead_s=float(data["kernel_overhead_s"]),
            link_bytes_per_s=float(data["link_bytes_per_s"]),
            link_latency_s=float(data["link_latency_s"]),
            description=data["description"],
            overlaps_communication=bool(data.get("overlaps_communication", True)),
            ranks_per_node=data.get("ranks_per_node"),
            inter_node_bytes_per_s=data.get("inter_node_bytes_per_s"),
            inter_node_latency_s=data.get("inter_node_latency_s"),
        )


# H100 SXM datasheet peaks (dense); float32 matmuls are assumed to run as TF32.
_H100_FLOPS = {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 494e12}



def _h100(name: str, link_bytes_per_s: float, link_latency_s: float, description: str) -> HardwareProfile:
    """An H100 SXM (datasheet compute and memory) whose collectives run over the given link."""
    return HardwareProfile(
        name=name,
        flops_per_s=_H100_FLOPS,
        memory_bytes_per_s=3.35e12,
        kernel_overhead_s=5e-6,
        link_bytes_per_s=link_bytes_per_s,
        link_latency_s=link_latency_s,
        description=description,
    )


PROFILES: dict[str, HardwareProfile] = {
    "h100_nvlink": _h100(
        "h100_nvlink", 370e9, 10e-6, "8x H100 SXM in one node, collectives over NVLink (effective NCCL bus bandwidth)"
    ),
    "h100_ib400": _h100(
        "h100_ib400", 45e9, 20e-6, "H100 SXM, collectives across nodes over 400 Gb/s InfiniBand (effective bus bandwidth)"
    ),
    # HSDP's machine: shard groups inside a node, replicate groups across nodes.
    "h100_nvlink_ib400": dataclasses.replace(
        _h100(
            "h100_nvlink_ib400",
            370e9,
            10e-6,
            "nodes of 8 H100 SXM: collectives inside a node over NVLink, across nodes over 400 Gb/s InfiniBand",
        ),
        ranks_per_node=8,
        inter_node_bytes_per_s=45e9,
        inter_node_latency_s=20e-6,
    ),
    "cpu_gloo": HardwareProfile.from_json(json.loads(CPU_GLOO_PATH.read_text())),
}


def get_profile(name: str) -> HardwareProfile:
    """The profile called ``name``; raises ``ValueError`` listing the known names."""
    if name not in PROFILES:
        raise ValueError(f"unknown hardware profile {name!r}; known profiles: {', '.join(sorted(PROFILES))}")
    return PROFILES[name]


def profile_for_device(on_cuda: bool) -> str:
    """``settings.cost_profile``, or the profile for a graph on CUDA (an H100 node) or on the CPU (``cpu_gloo``)."""
    if settings.cost_profile is not None:
        return settings.cost_profile
    return "h100_nvlink" if on_cuda else "cpu_gloo"


def cost_profile(graph: fx.Graph) -> str:
    """``profile_for_device`` for the device ``graph``'s inputs are on."""
    # ``val`` in AOTAutograd's graphs, ``example_value`` in Dynamo's.
    values = [node.meta.get("val", node.meta.get("example_value")) for node in graph.find_nodes(op="placeholder")]
    return profile_for_device(any(isinstance(value, torch.Tensor) and value.is_cuda for value in values))


# Sizes ---------------------------------------------------------------------------------


def _int(value: Any) -> int:
    """A concrete int for an int, a SymInt (its hint) or an FX node holding one."""
    if isinstance(value, fx.Node):
        value = value.meta["val"]
    if isinstance(value, torch.SymInt):
        return optimization_hint(value)
    return int(value)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a value, a list/tuple/dict of values, and so on (a plain walk: pytree is slow here)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    return []


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in ``value`` (a tensor or a nested list/tuple of them, anything else counts 0)."""
    return sum(_int(tensor.numel()) * tensor.element_size() for tensor in _tensors(value))


def _input_values(node: fx.Node) -> tuple[tuple, dict]:
    return fx.node.map_arg((node.args, node.kwargs), lambda arg: arg.meta.get("val"))


# Views -------------------------------------------------------------------------------

# Declared without an alias, but the output is the input's memory (the copy-out's ``clone`` + ``_unsafe_view``).
_UNDECLARED_VIEWS = {aten._unsafe_view.default}
# Ops that only allocate: memory, but no kernel.
_ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default}
# Synchronous copies into their first argument, returning nothing: they cost what they move.
_FILLS = {fsdp.reduce_scatter_input_into_.default}
# Declared as views, but they copy a non-contiguous input.
_VIEWS_IF_CONTIGUOUS = {aten.reshape.default, aten.contiguous.default}


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` only re-describes memory it reads: no kernel runs and nothing is allocated.

    Covers ``getitem`` and every op whose schema returns an alias of an input without
    writing it (``view``, ``t``, ``slice``, ``split_with_sizes``, ``expand``, ``detach``,
    ``as_strided``...), plus ``_unsafe_view``. ``reshape`` and ``contiguous`` count
    as views when their fake output aliases the input or the input is contiguous.
    """
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem or target in _UNDECLARED_VIEWS:
        return True
    if not isinstance(target, torch._ops.OpOverload) or not target.is_view:
        return False
    if target not in _VIEWS_IF_CONTIGUOUS:
        return True
    output, source = node.meta.get("val"), node.args[0].meta.get("val")
    if not isinstance(output, torch.Tensor) or not isinstance(source, torch.Tensor):
        return False
    return torch._C._is_alias_of(output, source) or source.is_contiguous()


# Compute -------------------------------------------------------------------------------


def _shape_formulas() -> dict[torch._ops.OpOverloadPacket, Any]:
    """torch's FLOP formulas that take shapes, by op, plus the CPU flash-attention ops (same math)."""
    packets = [
        aten.mm,
        aten.addmm,
        aten.bmm,
        aten.baddbmm,
        aten.convolution,
        aten._convolution,
        aten.convolution_backward,
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_flash_attention_backward,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_efficient_attention_backward,
        aten._scaled_dot_product_cudnn_attention,
        aten._scaled_dot_product_cudnn_attention_backward,
    ]
    formulas = {packet: flop_registry[packet] for packet in packets}
    formulas[aten._scaled_dot_product_flash_attention_for_cpu] = formulas[aten._scaled_dot_product_flash_attention]
    formulas[aten._scaled_dot_product_flash_attention_for_cpu_backward] = formulas[
        aten._scaled_dot_product_flash_attention_backward
    ]
    return formulas


_FLOP_FORMULAS = _shape_formulas()


def _concrete_shapes(value: Any) -> Any:
    """``value`` with every tensor replaced by its (hinted) shape and every SymInt by its hint."""

    def concrete(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return tuple(_int(size) for size in leaf.shape)
        if isinstance(leaf, torch.SymInt):
            return _int(leaf)
        return leaf

    return tree_map(concrete, value)


def node_flops(node: fx.Node) -> int:
    """Floating-point operations of a matmul, attention or convolution node; 0 for any other node."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.overloadpacket not in _FLOP_FORMULAS:
        return 0
    args, kwargs = _concrete_shapes(_input_values(node))
    out_val = _concrete_shapes(node.meta.get("val"))
    return int(_FLOP_FORMULAS[target.overloadpacket](*args, **kwargs, out_val=out_val))


def compute_seconds(node: fx.Node, profile: HardwareProfile) -> float:
    """Seconds ``node`` occupies the compute lane: ``max(flops / peak, bytes / bandwidth) + kernel overhead``.

    0 for placeholders and outputs, views, allocations (``empty``), nodes that produce
    no tensor (size arithmetic, storage ops) other than copies into a given buffer, collectives (issuing costs nothing, see
    ``simulate``) and ``wait_tensor``. The matmul peak is the one of the first tensor
    input's dtype. A compile region (``invoke_subgraph``) costs what its nodes cost.
    """
    if node.target is invoke_subgraph:
        return sum(compute_seconds(inner, profile) for inner in region_module(node).graph.nodes)
    if (
        node.op != "call_function"
        or is_view(node)
        or node.target in _ALLOCATIONS
        or node.target is c10d.wait_tensor.default
        or is_collective(node)
        or not (_tensors(node.meta.get("val")) or node.target in _FILLS)
    ):
        return 0.0
    inputs = _input_values(node)
    moved = tensor_bytes(inputs) + tensor_bytes(node.meta["val"])
    dtype = (_tensors(inputs) + _tensors(node.meta["val"]))[0].dtype
    roofline = max(node_flops(node) / profile.peak_flops(dtype), moved / profile.memory_bytes_per_s)
    return roofline + profile.kernel_overhead_s


# Collectives -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CollectiveInfo:
    """What the ring model needs to know about one collective node."""

    kind: str  # "all_gather", "reduce_scatter", "all_reduce" or "all_to_all"
    world_size: int
    #: The group's global ranks, where its process group is live here (the profile's
    #: network for them: ``HardwareProfile.link``).
    ranks: list[int] | None
    #: The buffer the ring moves: an all-gather's output, any other collective's input.
    bytes: int
    #: ``fsdp`` ops wait inside the op; ``_c10d_functional`` ones return before the data is there.
    synchronous: bool


def is_collective(node: fx.Node) -> bool:
    """Whether ``node`` is one of the collectives the cost model times (``collective_info``)."""
    return node_collective(node) is not None


def _group_size(group_name: str) -> int | None:
    """The size of a live process group registered as ``group_name``, if there is one."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_group_size_by_name(group_name)
    except RuntimeError:  # no group of that name in this process
        return None


def group_ranks(group_name: object) -> list[int] | None:
    """The global ranks of a live process group registered as ``group_name``, if there is one."""
    if not isinstance(group_name, str) or not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(group_name))
    except (RuntimeError, ValueError):  # no group of that name in this process
        return None


def collective_info(node: fx.Node, world_size: int | None = None) -> CollectiveInfo | None:
    """Kind, world size and bytes of a collective node; None for any other node.

    ``all_reduce`` names no group size: it comes from the live process group of that
    name, else from ``world_size``, else this raises ``ValueError``.
    """
    found = node_collective(node)
    if found is None:
        return None
    kind, size_index, synchronous = found.kind, found.size_arg, found.synchronous
    if size_index is not None:
        size_arg = node.args[size_index]
        size = len(size_arg) if isinstance(size_arg, (list, tuple)) else _int(size_arg)
    else:
        size = _group_size(node.args[2]) or world_size
        if size is None:
            raise ValueError(
                f"{node.name}: no process group {node.args[2]!r} in this process to take the all_reduce's "
                f"world size from; pass world_size"
            )
    # The first argument of fsdp.all_to_all_into_ / all_to_all_grads_ is their output, of the input's size.
    buffer = waited_node(node).meta.get("val") if kind == "all_gather" else node.args[0].meta.get("val")
    ranks = None if found.group_arg is None else group_ranks(node.args[found.group_arg])
    return CollectiveInfo(kind, size, ranks, tensor_bytes(buffer), synchronous)


def latency_bound_bytes(profile: HardwareProfile, world_size: int, ranks: Sequence[int] | None = None) -> float:
    """The buffer size below which a ring collective over ``world_size`` ranks costs more latency than transfer.

    A ring moves ``(W-1)/W * bytes`` at the bus bandwidth and waits ``W-1`` ring-step
    latencies (``collective_seconds``); the two are equal at ``W * latency * bandwidth``
    bytes. ``ranks`` (global) pick the slower link of a group that spans nodes.
    """
    bytes_per_s, latency_s = profile.link(None if ranks is None else list(ranks))
    return world_size * latency_s * bytes_per_s


def collective_seconds(node: fx.Node, profile: HardwareProfile, world_size: int | None = None) -> float:
    """Ring time of a collective: ``(W-1)/W * bytes / bus bandwidth + (W-1) * latency``, twice for all_reduce.

    An all-to-all of equal splits moves what a reduce-scatter of the same input moves.

    Accepts the ``_c10d_functional`` collectives and, for joint graphs before
    ``lower``, ``fsdp.all_gather_into`` / ``fsdp.reduce_scatter_grad`` (their copy-in
    and division are not counted). ``world_size``: see ``collective_info``.
    """
    info = collective_info(node, world_size)
    if info is None:
        raise ValueError(f"{node.name} ({node.target}) is not a collective the cost model knows")
    steps = info.world_size - 1
    bytes_per_s, latency_s = profile.link(info.ranks)
    ring = steps / info.world_size * info.bytes / bytes_per_s + steps * latency_s
    return 2 * ring if info.kind == "all_reduce" else ring
