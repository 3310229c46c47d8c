"""Kernel and graph-level costs: a Kernel on a device, the unfused graph, the physical lower bound.

Problem: plans are compared against two references — every node its own kernel (unfused), and
the physics (nothing can beat reading the inputs and weights once, writing the outputs once and
running every FLOP at peak in one launch).
Approach: `kernel_cost` hands `Kernel.spec()` to the roofline model (aliases cost nothing);
`priced_kernel` picks, for a fused anchor group, the faster of its tensor-core and CUDA-core
schedules on a GPU (the search's choice), its `packed` C form on a CPU, and for a lone anchor on
a CPU the faster of that C and the library call (ties ours);
`unfused_time_s` sums single-node kernels (lone anchors as library calls: the unfused graph as
ONNX Runtime runs it; a plan's own reference is strategy none's time, `search.search`);
`lower_bound_s` applies the roofline at 100% efficiency to the whole graph as one kernel with
full overlap.
Invariants: lower_bound_s <= the time of any valid plan under default efficiencies <= 1;
functions are pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodels import DeviceSpec, KernelCost, RooflineModel
from costmodels.roofline import scalar_peak_flops_per_s, tensor_peak_flops_per_s
from fusesearch.groups import FusionGroup
from fusesearch.ir.graph import Graph
from fusesearch.lowering import Kernel, lower, try_lower


def kernel_cost(kernel: Kernel, device: DeviceSpec, model: RooflineModel) -> KernelCost:
    if kernel.alias:
        return KernelCost(time_s=0.0, compute_s=0.0, memory_s=0.0, launch_s=0.0, occupancy=0.0,
                          regs_per_thread=0, smem_bytes=0, spill_bytes=0, bound="launch", feasible=True,
                          reason="alias: a view, no kernel", flops=0.0, dram_bytes=0.0, compute_unit="none")
    return model.cost(kernel.spec(), device)


def priced_kernel(graph: Graph, kernel: Kernel, device: DeviceSpec, model: RooflineModel, *,
                  ours_alone: bool = False) -> tuple[Kernel, KernelCost]:
    """The kernel as it runs on `device`: on a CPU, a fused gemm/conv is the C backend's `packed`
    form (`try_lower(..., host=True)`), and a lone one whose C the backend writes (`ours_alone`:
    the caller asks the generator) is priced both as that C and as the library call, the faster
    kept, ties ours (our C measured at or above MLAS's at the zoo's shapes, a depthwise conv far
    above: so a CPU plan calls the library only where a profile prices it faster, and `run`
    executes what the plan prices); on a GPU, a fused group that lowering put on tensor cores
    is also priced on the CUDA-core skeleton (`try_lower(..., tensor_cores=False)`), and the
    faster of the two that fits is kept (ties keep the tensor cores); the tensor-core skeleton
    needs sm_80, and TF32 is no faster than FP32 on some parts. Other kernels have one schedule."""
    alone = ours_alone and kernel.impl == "library" and len(kernel.nodes) == 1
    if device.kind != "gpu" and kernel.anchor is not None and (alone or kernel.impl == "generated" and len(kernel.nodes) > 1):
        host = try_lower(graph, FusionGroup(frozenset(kernel.nodes)), host=True)
        if not isinstance(host, Kernel):
            return kernel, kernel_cost(kernel, device, model)
        ours = kernel_cost(host, device, model)
        if alone:
            library = kernel_cost(kernel, device, model)
            if library.feasible and (not ours.feasible or library.time_s < ours.time_s):
                return kernel, library
        return host, ours
    options = [kernel]
    if kernel.impl == "generated" and kernel.schedule.unit == "tensor-core":
        cuda_cores = try_lower(graph, FusionGroup(frozenset(kernel.nodes)), tensor_cores=False)
        if isinstance(cuda_cores, Kernel):
            options.append(cuda_cores)
    priced = [(k, kernel_cost(k, device, model)) for k in options]
    return min(priced, key=lambda kc: (not kc[1].feasible, kc[1].time_s if kc[1].feasible else 0.0))


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
    kernels = unfused_kernels(graph)
    unfused = sum(kernel_cost(k, device, model).time_s for k in kernels)
    tc = sum(k.tc_flops for k in kernels)
    scalar = sum(k.scalar_flops for k in kernels)
    dtype = _dominant_dtype(kernels)
    min_bytes = _compulsory_bytes(graph)
    # the bound takes the fastest unit any implementation could use (tensor cores, where allowed)
    tc_peak = tensor_peak_flops_per_s(device, dtype, model.params.float32_uses_tf32)
    compute_s = tc / tc_peak + scalar / scalar_peak_flops_per_s(device, dtype)
    memory_s = min_bytes / device.bandwidth_for(min_bytes)
    bound = device.launch_overhead_s + max(compute_s, memory_s)
    return GraphFigures(unfused, len(kernels), bound, min_bytes, tc, scalar)


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


def _dominant_dtype(kernels: list[Kernel]) -> str:
    weights: dict[str, int] = {}
    for k in kernels:
        weights[k.dtype] = weights.get(k.dtype, 0) + k.tc_flops + k.scalar_flops
    return max(sorted(weights), key=weights.get) if weights else "float32"
