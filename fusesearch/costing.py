"""Kernel and graph-level costs: a Kernel on a device, the unfused graph, the physical lower bound.

Problem: plans are compared against every node its own kernel (unfused) and against the physics
(inputs read once, outputs written once, every FLOP at peak, one launch).
Approach: `kernel_cost` hands `Kernel.spec()` to the roofline model (aliases cost nothing);
`cheapest` prices a group's `device_choices` and keeps the fastest that fits, ties the earlier
(tile, tensor or CUDA cores, ours or the library, a CPU's product and split); `unfused_time_s` sums
single-node kernels (lone anchors as library calls, as ONNX Runtime runs them); `lower_bound_s`
prices the whole graph as one kernel at 100% efficiency with full overlap.
Invariants: lower_bound_s <= the time of any valid plan under default efficiencies <= 1;
functions are pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from costmodels import DeviceSpec, KernelCost, RooflineModel
from costmodels.roofline import scalar_peak_flops_per_s, tensor_peak_flops_per_s
from fusesearch.groups import FusionDecision, FusionGroup
from fusesearch.ir.graph import Graph
from fusesearch.ir.structure import Structures
from fusesearch.layout import NHWC, Layout
from fusesearch.lowering import (
    Kernel,
    choices,
    conv_routed,
    lower,
    nchwc_choices,
    nhwc_choices,
    reorder,
    reorder_choices,
)
from fusesearch.schedule import CpuTarget


def kernel_cost(kernel: Kernel, device: DeviceSpec, model: RooflineModel) -> KernelCost:
    if kernel.alias:
        return KernelCost(time_s=0.0, compute_s=0.0, memory_s=0.0, launch_s=0.0, occupancy=0.0,
                          regs_per_thread=0, smem_bytes=0, spill_bytes=0, bound="launch", feasible=True,
                          reason="alias: a view, no kernel", flops=0.0, dram_bytes=0.0, compute_unit="none")
    return model.cost(kernel.spec(), device)


def cheapest(kernels: Sequence[Kernel], device: DeviceSpec, model: RooflineModel) -> tuple[Kernel, KernelCost]:
    """The choice that runs fastest on `device` among those that fit (all infeasible: the first,
    with its reason); ties keep the earlier (`lowering.choices` puts the default first)."""
    priced = [(k, kernel_cost(k, device, model)) for k in kernels]
    return min(priced, key=lambda kc: (not kc[1].feasible, kc[1].time_s if kc[1].feasible else 0.0))


def device_choices(graph: Graph, group: FusionGroup, device: DeviceSpec,
                   blas: bool = True) -> tuple[Kernel, ...] | FusionDecision:
    """`lowering.choices` as `device` runs the group (a CPU's C forms where it is not a GPU, for
    its vectors and threads: `CpuTarget.lanes` is the device's `warp_size`, its float32 lanes, and
    `CpuTarget.threads` its `sm_count`, the OpenMP threads its figures were measured with; on a
    GPU a conv's library calls by the route plans price, `lowering.conv_routed`, and its
    tuned tile table's configurations, `DeviceSpec.tuned_tiles`)."""
    if device.kind == "gpu":
        from fusesearch.backends.cudnn import conv_route

        options = choices(graph, group, tuned=device.tuned_tiles)
        return options if isinstance(options, FusionDecision) else conv_routed(graph, options, conv_route().cudnn)
    return choices(graph, group, host=host_target(device, blas))


def host_target(device: DeviceSpec, blas: bool = True) -> CpuTarget:
    """What a CPU device's kernels are written for: `CpuTarget.lanes` its `warp_size` (float32
    lanes), `CpuTarget.threads` its `sm_count` (the OpenMP threads its figures were measured with)."""
    return CpuTarget(blas=blas, lanes=device.warp_size, threads=max(1, device.sm_count))


def device_layout(device: DeviceSpec) -> Layout:
    """The layout other than the model's that `device`'s kernels may run in: a CPU's NCHWc of its
    channel block (`CpuTarget.channel_block`; NCHW where it has none), a GPU's NHWC (its
    tensor-core convs channels last)."""
    return NHWC if device.kind == "gpu" else Layout(host_target(device).channel_block)


def blocked_choices(graph: Graph, group: FusionGroup, device: DeviceSpec, blas: bool = True) -> tuple[Kernel, ...]:
    """The group's forms in the device's other layout (`device_layout`): a CPU's blocked ones
    (`lowering.nchwc_choices`), a GPU's channels-last convs (`lowering.nhwc_choices`, at its
    tuned tile table's configurations)."""
    if device.kind == "gpu":
        return nhwc_choices(graph, group, device.tuned_tiles)
    return nchwc_choices(graph, group, host_target(device, blas))


def reorder_options(graph: Graph, tensor: str, source: Layout, target: Layout, device: DeviceSpec,
                    blas: bool = True) -> tuple[Kernel, ...]:
    """A device's copies of `tensor` between layouts (`lowering.reorder_choices`: on a CPU above
    one thread also the one-thread form; on a GPU the one CUDA transpose, `lowering.reorder`)."""
    if device.kind == "gpu":
        return (reorder(graph, tensor, source, target),)
    return reorder_choices(graph, tensor, source, target, host_target(device, blas))


def priced_kernel(graph: Graph, kernel: Kernel, device: DeviceSpec, model: RooflineModel) -> tuple[Kernel, KernelCost]:
    """The cheapest choice on `device` of the group `kernel` was lowered from, every choice
    allowed (a search restricts a lone anchor's: `rules.FitsDevice`)."""
    options = device_choices(graph, FusionGroup(frozenset(kernel.nodes)), device)
    if isinstance(options, FusionDecision):
        return kernel, kernel_cost(kernel, device, model)
    return cheapest(options, device, model)


def unfused_kernels(graph: Graph) -> list[Kernel]:
    return [lower(graph, FusionGroup.single(n.id)) for n in graph.nodes]


def unfused_time_s(graph: Graph, device: DeviceSpec, model: RooflineModel) -> float:
    return sum(kernel_cost(k, device, model).time_s for k in unfused_kernels(graph))


@dataclass(frozen=True)
class GraphFigures:
    unfused_time_s: float
    unfused_kernels: int
    lower_bound_s: float
    min_dram_bytes: int
    tc_flops: int
    scalar_flops: int


def graph_figures(graph: Graph, device: DeviceSpec, model: RooflineModel) -> GraphFigures:
    """Nodes of one structure (`ir.structure`: a repeated block's) are lowered and priced once."""
    structures = Structures(graph)
    shared: dict[tuple, tuple[float, int, int, str]] = {}
    per_node = []
    for n in graph.nodes:
        key = structures((n.id,))
        if key not in shared:
            k = lower(graph, FusionGroup.single(n.id))
            shared[key] = (kernel_cost(k, device, model).time_s, k.tc_flops, k.scalar_flops, k.dtype)
        per_node.append(shared[key])
    unfused = sum(f[0] for f in per_node)
    tc = sum(f[1] for f in per_node)
    scalar = sum(f[2] for f in per_node)
    dtype = _dominant_dtype([(f[3], f[1] + f[2]) for f in per_node])
    min_bytes = _compulsory_bytes(graph)
    # the bound takes the fastest unit any implementation could use (tensor cores, where allowed)
    tc_peak = tensor_peak_flops_per_s(device, dtype, model.params.float32_uses_tf32)
    compute_s = tc / tc_peak + scalar / scalar_peak_flops_per_s(device, dtype)
    memory_s = min_bytes / device.bandwidth_for(min_bytes)
    # one call at the cheapest a kernel can start: a CPU's one-thread region where it is cheaper
    launch_s = min(s for s in (device.launch_overhead_s, device.serial_launch_overhead_s) if s > 0)
    bound = launch_s + max(compute_s, memory_s)
    return GraphFigures(unfused, len(per_node), bound, min_bytes, tc, scalar)


def _compulsory_bytes(graph: Graph) -> int:
    """Graph inputs and weights read once (an embedding table: the rows gathered), outputs written once."""
    used = {t for n in graph.nodes for t in n.inputs if t}
    read = sum(_input_bytes(graph, name) for name, info in graph.tensors.items()
               if name in used and (info.constant or name in graph.inputs))
    return read + sum(graph.tensors[t].nbytes for t in set(graph.outputs))


def _input_bytes(graph: Graph, tensor: str) -> int:
    users = [graph.nodes[i] for i in graph.consumers(tensor)]
    full = graph.tensors[tensor].nbytes
    if users and all(n.op_type == "Gather" and n.inputs[0] == tensor for n in users):
        return min(full, sum(graph.tensors[n.outputs[0]].nbytes for n in users))
    return full


def _dominant_dtype(flops_by_dtype: list[tuple[str, int]]) -> str:
    weights: dict[str, int] = {}
    for dtype, flops in flops_by_dtype:
        weights[dtype] = weights.get(dtype, 0) + flops
    return max(sorted(weights), key=weights.get) if weights else "float32"
