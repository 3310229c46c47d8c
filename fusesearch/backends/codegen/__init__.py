"""Code generation: one C-like kernel body per Kernel, wrapped by a C/OpenMP or a CUDA skeleton.

Problem: every chosen group must become one real kernel that runs on real data, on a GPU (CUDA)
and, so that everything but the launch skeleton is exercised without one, on the CPU (C).
Approach (TVM's compute inlining): `value(t, idx)` builds a tensor's value at an index from its
producer in the group (elementwise, broadcast, injective remaps, guarded Pad/Resize/pool reads) down
to kernel-input loads, memoized per (tensor, index); `GENERATED_OPS` names every op with code. The
statements are one text in both languages; skeletons differ: pointwise (C `omp for`, CUDA
grid-stride or float4 `vectorized`), rowwise (C rows in parallel, CUDA a block per row), gemm/conv
(C: `Schedule.product`/`epilogue` over packed panels or a BLAS, `base.scratch`; CUDA: `tiled`,
`mma-*`, `mma-sync-*`, `direct`). `generate` refuses the opaque template (a library call);
`CAPABILITIES` (`generatable`, `cpu_fusable`) says what may be fused before a group is priced.
Invariants: the source is a pure function of (graph, kernel), its hash keys every cache; arguments
are external inputs, then outputs (then packed weights, in C); compute is float32 (half tensors
widen on load, round to nearest even on store), int64 (indices) or uint8 (bool)."""

from __future__ import annotations

from fusesearch.backends.codegen.base import (
    CTYPES,
    HALF_DTYPES,
    NP_DTYPES,
    SUPPORTED_TEMPLATES,
    Arg,
    CodegenRefused,
    GeneratedKernel,
    half_prelude,
    source_digest,
)
from fusesearch.backends.codegen.c_prelude import _CU_PRELUDE
from fusesearch.backends.codegen.c_runtime import C_HEADER, tile_kernels
from fusesearch.backends.codegen.cpu_anchor import _anchor_row_loops
from fusesearch.backends.codegen.cpu_conv_nchwc import nchwc_pointwise_loops
from fusesearch.backends.codegen.mma import _mma
from fusesearch.backends.codegen.mma_sync import _mma_sync
from fusesearch.backends.codegen.module import cuda_module, module_namespace
from fusesearch.backends.codegen.ops import _BINARY, _HANDLERS, _UNARY, _VARIADIC
from fusesearch.backends.codegen.pointwise import _pointwise
from fusesearch.backends.codegen.rowwise import ROW_OPS, _rowwise
from fusesearch.backends.codegen.tiled import _tiled
from fusesearch.backends.codegen.vectorized import _vectorized
from fusesearch.candidates.capabilities import Capabilities
from fusesearch.groups import FusionDecision
from fusesearch.ir.graph import Graph
from fusesearch.ir.op_kind import OpKind
from fusesearch.ir.pool import POOL_OPS
from fusesearch.lowering import Kernel
from fusesearch.schedule import (
    CPU_SKELETONS,
    Skeleton,
    channels_last,
    grid_stride,
    row_prologue,
    tensor_layouts,
)

DYNAMIC_SMEM = frozenset({Skeleton.MMA_SYNC_TF32, Skeleton.MMA_SYNC_F16, Skeleton.MMA_SYNC_BF16})
"""The skeletons whose shared memory is dynamic (their stages pass the 48 KiB a block may declare
statically): the launch asks for the schedule's bytes."""

__all__ = ["CAPABILITIES", "CTYPES", "GENERATED_OPS", "NP_DTYPES", "Arg", "CodegenRefused", "GeneratedKernel",
           "cpu_fusable", "cuda_module", "generate", "module_namespace", "try_generate"]


def _args(graph: Graph, kernel: Kernel) -> tuple[tuple[Arg, ...], tuple[Arg, ...]]:
    """The kernel's arguments, each shaped as it lies in memory under the schedule
    (`schedule.tensor_layouts`: a blocked tensor's physical shape, padded channels included)."""
    anchor = graph.nodes[kernel.anchor] if kernel.anchor is not None else None
    layouts = tensor_layouts(graph, anchor, (*kernel.inputs, *kernel.outputs), kernel.schedule)

    def arg(prefix, k, t):
        info = graph.tensors[t]
        if info.dtype not in CTYPES:
            raise CodegenRefused(f"dtype {info.dtype} of '{t}' is not generated yet")
        return Arg(f"{prefix}{k}", t, layouts[t].shape(tuple(info.shape)), info.dtype, layouts[t])

    return (tuple(arg("in", k, t) for k, t in enumerate(kernel.inputs)),
            tuple(arg("out", k, t) for k, t in enumerate(kernel.outputs)))


def generate(graph: Graph, kernel: Kernel, name: str = "") -> GeneratedKernel:
    """The kernel's C and CUDA sources; CodegenRefused (with a FusionDecision) if not generated.
    The skeleton, tile, block, grid and shared memory are the kernel's schedule: decided by
    lowering, written here as given. A library call has none (its generated forms are other
    choices of the same group: `lowering.choices`). A CPU schedule (`packed`, `depthwise`) has C
    only: its `cuda_source` is empty."""
    schedule = kernel.schedule
    if kernel.template not in SUPPORTED_TEMPLATES:
        raise CodegenRefused(f"template {kernel.template} is not generated yet (runs as a library call)")
    if schedule.impl == "library":
        raise CodegenRefused(f"{kernel.template}: a library call is not generated (its generated forms are the "
                             "group's other choices)")
    ins, outs = _args(graph, kernel)
    name = name or f"k_{kernel.template}_{'_'.join(map(str, kernel.nodes[:4]))}"
    args = {a.tensor: a for a in ins}
    skeleton, grid = schedule.skeleton, schedule.grid
    row_epilogue = any(graph.nodes[i].kind == OpKind.REDUCE for i in kernel.nodes) and not (
        kernel.anchor is not None and row_prologue(graph, kernel.nodes, graph.nodes[kernel.anchor]))
    packs: dict = {}  # weights the C kernel reads packed once (PackedWeight), by tensor
    defs: list[str] = []  # file-scope C the packed GEMM calls (a tile epilogue)
    units: tuple[str, ...] = ()  # C units the kernel links (the tile kernels with that epilogue)
    if channels_last(schedule):  # a GPU schedule: CUDA only
        if skeleton not in _CUDA_WRITERS:
            raise CodegenRefused(f"{skeleton}: channels last is generated for tiled and tensor-core convs only")
        c_src, cu_src, rows, length = "", _CUDA_WRITERS[skeleton](graph, kernel, name, ins, outs, args), 0, 0
    elif skeleton is Skeleton.BLOCK_PER_ROW or (skeleton in CPU_SKELETONS and row_epilogue):
        c_src, cu_src, rows, length = _rowwise(graph, kernel, name, ins, outs, args, packs)
    else:
        c_body = (_anchor_row_loops(graph, kernel, args, outs, packs, defs) if kernel.anchor is not None
                  else nchwc_pointwise_loops(graph, kernel, args, outs) if schedule.layout_out.block else None)
        tiles = [tile_kernels(d) for d in defs]  # the kernel's declarations, the units it links
        units = tuple(unit for _, unit in tiles)
        c_src, cu_src, rows, length = _pointwise(graph, kernel, name, ins, outs, args, c_body, tuple(packs.values()),
                                                 "".join(declared for declared, _ in tiles))
        if skeleton in _CUDA_WRITERS:
            cu_src = _CUDA_WRITERS[skeleton](graph, kernel, name, ins, outs, args)
        elif skeleton is Skeleton.ALIAS:  # a lone view run as a kernel (a copy), where one is asked for
            skeleton, grid = Skeleton.GRID_STRIDE, grid_stride(max(a.size for a in outs)).grid
    if skeleton in CPU_SKELETONS or schedule.layout_out.block:  # a CPU schedule (NCHWc included): C only
        cu_src = ""
    members = (graph.nodes[i] for i in kernel.nodes)  # a Cast to half inside the group rounds too
    halves = {graph.tensors[t].dtype for n in members for t in (*n.inputs, *n.outputs) if t} & set(HALF_DTYPES)
    if halves:  # the half types and conversions, right after the prelude (float32 sources unchanged)
        c_src = _with_half(c_src, halves, False) if c_src else c_src
        cu_src = _with_half(cu_src, halves, True) if cu_src else cu_src
    digest = source_digest(c_src, cu_src, units)
    return GeneratedKernel(name, kernel.template, ins, outs, c_src, cu_src, rows=rows, row_length=length,
                           source_hash=digest, grid=tuple(grid), block=(schedule.threads, 1, 1), skeleton=skeleton,
                           dynamic_smem=schedule.smem_bytes if skeleton in DYNAMIC_SMEM else 0,
                           packed=tuple(packs.values()), c_units=units, c_threads=schedule.cpu_threads)


_CUDA_WRITERS = {Skeleton.TILED: _tiled, Skeleton.VECTORIZED: _vectorized,
                 **dict.fromkeys((Skeleton.MMA_TF32, Skeleton.MMA_F16, Skeleton.MMA_BF16), _mma),
                 **dict.fromkeys((Skeleton.MMA_SYNC_TF32, Skeleton.MMA_SYNC_F16, Skeleton.MMA_SYNC_BF16), _mma_sync)}
"""The skeletons whose CUDA has its own writer; the others' is the pointwise or row kernel's."""


def _with_half(src: str, dtypes, cuda: bool) -> str:
    prelude = _CU_PRELUDE if cuda else C_HEADER
    if not src.startswith(prelude):
        raise CodegenRefused("a skeleton without the common header cannot take half tensors")
    return prelude + half_prelude(dtypes, cuda) + src[len(prelude):]


def try_generate(graph: Graph, kernel: Kernel, name: str = "") -> GeneratedKernel | FusionDecision:
    try:
        return generate(graph, kernel, name)
    except CodegenRefused as exc:
        return exc.decision


# Anchors the C backend writes only as a per-output gather loop (no packed or BLAS path), so a
# fused group holding one loses to the library by far more than any fusion saves: on a CPU they
# stay alone, library calls (legality refuses them fused; `run` runs them in ONNX Runtime)
# (measured: U-Net's ConvTranspose + Concat, 2x2 stride 2 over 512 channels at 8x8, took 247 ms
# as generated against about 1 ms in ONNX Runtime).
CPU_LIBRARY_ONLY = {"ConvTranspose": "the C backend has no packed ConvTranspose (a per-output gather loop, "
                                     "far slower than the library's); on a CPU it runs alone as a library call"}


def cpu_fusable(graph: Graph, kernel: Kernel) -> FusionDecision:
    """Whether the C backend writes the fused group well enough to be worth fusing on a CPU: not
    around a CPU_LIBRARY_ONLY anchor, and no MaxPool/AveragePool before the anchor (the packed
    conv/GEMM fills its panel element by element, so a pool there is computed tap by tap with
    strided gathers: resnet50's stem pool in front of a 1x1 conv took 2.0 ms against 0.47 ms for
    the conv and our separable pool kernel apart)."""
    if kernel.anchor is None:
        return FusionDecision.accept()
    anchor = graph.nodes[kernel.anchor]
    if anchor.op_type in CPU_LIBRARY_ONLY:
        return FusionDecision.refuse(f"{anchor.name}({anchor.op_type}): {CPU_LIBRARY_ONLY[anchor.op_type]}")
    for i in kernel.nodes:
        n = graph.nodes[i]
        if n.op_type in POOL_OPS and graph.reaches(n.id, anchor.id):
            return FusionDecision.refuse(
                f"{n.name}({n.op_type}) before {anchor.name}({anchor.op_type}): the C backend would compute the pool "
                "tap by tap inside the anchor's panel; on a CPU the pool runs as its own kernel")
    return FusionDecision.accept()


GENERATED_OPS = frozenset(_UNARY) | frozenset(_BINARY) | frozenset(_VARIADIC) | frozenset(_HANDLERS) | ROW_OPS
"""Every op the generator has code for (its tables and handlers, and the row reductions)."""

CAPABILITIES = Capabilities(GENERATED_OPS, frozenset(CTYPES), cpu_fusable)
"""What this generator writes, as legality reads it (`Legality.capabilities`)."""
