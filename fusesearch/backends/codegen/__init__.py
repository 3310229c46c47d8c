"""Code generation: one C-like kernel body per Kernel, wrapped by a C/OpenMP or a CUDA skeleton.

Problem: every chosen group must become one real kernel that runs on real data, on a GPU (CUDA)
and, so that everything but the launch skeleton is exercised without one, on the CPU (C).
Approach (as TVM's compute inlining): the value of a tensor at a multi-index is an expression
built from its producer inside the group — `value(t, idx)` recurses through elementwise and
broadcast ops (same / broadcast index), injective ops (index remapping: Reshape via the flat
index, Transpose, Slice, Gather/GatherND/GatherElements, Concat, Split, Expand, Tile,
DepthToSpace/SpaceToDepth, ReverseSequence; guarded reads: Pad (constant / edge / reflect /
wrap; negative pads crop), CenterCropPad, Trilu; Resize nearest, and linear as the weighted sum of
its 2^axes neighbours; MaxPool / AveragePool as an unrolled reduction over their window's taps)
down to loads of the kernel's inputs. Temporaries are memoized per
(tensor, index) inside a scope, so a diamond computes its shared value once. `GENERATED_OPS` names
every op with code (a test holds it to every op OpKind calls fusible, less a listed few). The
emitted statements are the same text in both languages; only the skeleton around them differs:

    pointwise  for every output O: for i in [0, |O|): O[i] = value(O, unflatten(i))
               C: `#pragma omp for`, a worksharing loop of the kernel's one OpenMP region
               (`base.c_function`; a pool's output in separable row passes,
               `pool_rows`; under another pool, the columns split into the border, with
               clamped taps, and the branch-free interior) · CUDA: a grid-stride loop, or, when every op is
               elementwise/broadcast over float32 outputs of one shape with |S| % 4 == 0, four
               elements per thread with float4 loads and stores (`vectorized`)
    rowwise    for every row r: per-row scalars (sums / maxima over the row, each a loop over
               j in [0, L)), then the outputs (row-sized ones once, full ones over j)
               C: parallel over rows, plain j loops · CUDA: a block per row, j strided by
               threads, block reductions (warp shuffles + shared memory); a computed row read by
               several passes (a GEMM's output under a Softmax) is cached on its first pass (C: a
               local buffer, CUDA: shared memory), so its dot products run once
    gemm/conv  C, with a BLAS (`FS_BLAS_SGEMM`, scipy-openblas32; measured faster than our own
               loops and within noise of ONNX Runtime's MLAS, benchmarks/bench_cpu.py): MatMul/Gemm
               per block of output rows of one batch (a block per thread) — the A rows with the prologue
               applied packed into a panel; B read in place by its strides when it is a view of an
               input (the transposed keys of attention), else, when the group computes it, packed
               in the order its source runs; one sgemm into a block tile, the epilogue over the
               tile while it is in cache, before the one store (an epilogue that only adds terms
               without the product is written first and the sgemm adds into it, beta 1); Conv as implicit GEMM per block of whole output
               rows of one image and group — the im2col panel (prologue and zero padding applied;
               a 1x1 stride-1 conv reads its input in place) times the group's filters, then the
               epilogue; depthwise convs (template `depthwise`, skeleton `depthwise` when fused on
               a CPU) in their own loop (each channel into zero-bordered planes, then a vectorized
               row of output pixels, taps unrolled, no bounds checks); a conv whose filters dwarf its
               activations reads them packed once (`PackedWeight`, the kernel's `<name>_pack`)
               through our own micro-kernel instead of the BLAS. Which of these a kernel runs is its
               schedule's product (`Schedule.product`, listed by `schedule.cpu_products`), and
               where its epilogue runs its `epilogue`: written as named, never inferred from the
               text written. Without a BLAS (`#else`, under the "blas" / "im2col" products): per output
               row, the activation operand's row (prologue applied) into a buffer, then i-k-j
               accumulation and the epilogue per column. Blocks run in parallel (OpenMP), the BLAS
               single-threaded inside each; panels and tiles live in a per-thread scratch arena
               kept between calls (`base.scratch`), never a malloc per call · CUDA (`tiled`): the anchor as
               z independent GEMMs (MatMul batch, Conv group; Conv as implicit GEMM), a block per
               BM×BN output tile, A and B staged per K step in shared memory with the prologue
               applied in the tile loads, a register micro-tile per thread, the epilogue applied
               to the registers before the one store; on tensor cores (`mma-tf32` for float32
               while TF32 is allowed, `mma-f16`, `mma-bf16`: lowering's choice) the same tiles
               staged as the fragments' type (cp.async double buffering for plain copies), wmma
               fragments multiplied per warp, the accumulators through shared memory to the
               epilogue and the one store; or (`mma-sync-*`) as a performance engineer writes
               them: warp tiles of `mma.sync` fed by `ldmatrix` from XOR-swizzled shared memory,
               a cp.async pipeline of 3+ stages, the epilogue on the accumulator registers. Epilogues that move elements (a Transpose
               after the product), ConvTranspose and 1-D operands use the `direct` skeleton: a
               thread per output element with its dot product inline. (A Softmax epilogue makes
               the group a row kernel, above.)

The opaque template is not generated (`generate` refuses it with a reason: a library call).
What may be fused at all is asked before a group is priced, through `CAPABILITIES` (the value
legality receives): `generatable` (every op has code here, every tensor a C type) and, on a CPU,
`cpu_fusable` (what the C backend writes too slowly to be
worth fusing: a ConvTranspose, a pool in front of an anchor).
C loops carry `omp simd` (with reduction clauses for row reductions and dot products) and, where
the C library has vector math (FS_VECTOR_MATH: glibc's libmvec), call log/tanh's vector variants
(exp and erf are the C prelude's own inline polynomials, `fs_expf` / `fs_erff`, and GELU's
x (1 + erf(x / sqrt 2)) one call, `fs_gelu2f`, wherever a group holds those four ops); one-element constants are literals in the source (Pow by 2, 3, 0.5 become products or a
square root; division by a constant a multiplication by its reciprocal); the index of a row
element is the row's (hoisted by the compiler) and the column's, with no per-element division.
Invariants: the source is a pure function of (graph, kernel), so its hash keys every cache (the
backend's flags select between its `#ifdef` paths and key its binary cache);
arguments are the kernel's external inputs then outputs, in the Kernel's order (then, in C, its
packed weights); compute is
float32 (float tensors, half ones included: loads widen, stores round to nearest even, see
`base.load_expr`/`store`), int64 (indices) or uint8 (bool).
"""

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
from fusesearch.schedule import CPU_SKELETONS, Skeleton, grid_stride

DYNAMIC_SMEM = frozenset({Skeleton.MMA_SYNC_TF32, Skeleton.MMA_SYNC_F16, Skeleton.MMA_SYNC_BF16})
"""The skeletons whose shared memory is dynamic (their stages pass the 48 KiB a block may declare
statically): the launch asks for the schedule's bytes."""

__all__ = ["CAPABILITIES", "CTYPES", "GENERATED_OPS", "NP_DTYPES", "Arg", "CodegenRefused", "GeneratedKernel",
           "cpu_fusable", "cuda_module", "generate", "module_namespace", "try_generate"]


def _args(graph: Graph, kernel: Kernel) -> tuple[tuple[Arg, ...], tuple[Arg, ...]]:
    def arg(prefix, k, t):
        info = graph.tensors[t]
        if info.dtype not in CTYPES:
            raise CodegenRefused(f"dtype {info.dtype} of '{t}' is not generated yet")
        return Arg(f"{prefix}{k}", t, tuple(info.shape), info.dtype)

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
    row_epilogue = any(graph.nodes[i].kind == OpKind.REDUCE for i in kernel.nodes)
    packs: dict = {}  # weights the C kernel reads packed once (PackedWeight), by tensor
    defs: list[str] = []  # file-scope C the packed GEMM calls (a tile epilogue)
    units: tuple[str, ...] = ()  # C units the kernel links (the tile kernels with that epilogue)
    if skeleton is Skeleton.BLOCK_PER_ROW or (skeleton in CPU_SKELETONS and row_epilogue):
        c_src, cu_src, rows, length = _rowwise(graph, kernel, name, ins, outs, args, packs)
    else:
        c_body = _anchor_row_loops(graph, kernel, args, outs, packs, defs) if kernel.anchor is not None else None
        tiles = [tile_kernels(d) for d in defs]  # the kernel's declarations, the units it links
        units = tuple(unit for _, unit in tiles)
        c_src, cu_src, rows, length = _pointwise(graph, kernel, name, ins, outs, args, c_body, tuple(packs.values()),
                                                 "".join(declared for declared, _ in tiles))
        if skeleton in _CUDA_WRITERS:
            cu_src = _CUDA_WRITERS[skeleton](graph, kernel, name, ins, outs, args)
        elif skeleton is Skeleton.ALIAS:  # a lone view run as a kernel (a copy), where one is asked for
            skeleton, grid = Skeleton.GRID_STRIDE, grid_stride(max(a.size for a in outs)).grid
    if skeleton in CPU_SKELETONS:  # a CPU schedule: C only
        cu_src = ""
    members = (graph.nodes[i] for i in kernel.nodes)  # a Cast to half inside the group rounds too
    halves = {graph.tensors[t].dtype for n in members for t in (*n.inputs, *n.outputs) if t} & set(HALF_DTYPES)
    if halves:  # the half types and conversions, right after the prelude (float32 sources unchanged)
        c_src = _with_half(c_src, halves, False)
        cu_src = _with_half(cu_src, halves, True) if cu_src else cu_src
    digest = source_digest(c_src, cu_src, units)
    return GeneratedKernel(name, kernel.template, ins, outs, c_src, cu_src, rows=rows, row_length=length,
                           source_hash=digest, grid=tuple(grid), block=(schedule.threads, 1, 1), skeleton=skeleton,
                           dynamic_smem=schedule.smem_bytes if skeleton in DYNAMIC_SMEM else 0,
                           packed=tuple(packs.values()), c_units=units)


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
