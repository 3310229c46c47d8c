"""The schedule: everything about how one kernel runs, decided once by lowering.

Problem: a cost model pricing one kernel while the generator writes another ranks plans by fiction.
Approach: `lowering` builds a frozen `Schedule` per Kernel from this module's predicates (skeleton,
row cache, `folded_scale`, `scaled_product`, `gelu_chains`, `conv_reads_band`); the cost model
prices `Kernel.spec()`; the generator dispatches on `skeleton` and writes the rest as given. Fields:
`impl` (library | generated | alias), `skeleton` (CUDA: grid-stride, vectorized, block-per-row,
tiled, direct, mma-*, mma-sync-*; CPU only: packed, depthwise), `unit`, `tile`, `warp`, `stages`,
`split_k` (its partials `workspace_bytes`), `threads`/`grid`/`smem_bytes`, `row_cache`, a GPU
conv's `library`, on a CPU `product` (`CPU_PRODUCTS`, default first), `split` (`CPU_SPLITS`, or
ONE_THREAD: one thread), `moments`, `prologue` (stored | packed), `epilogue` (tile | block),
`layout_in`/`layout_out`.
Invariants: imports only graph types, numpy and the cost model's units/products; a CPU schedule is a
pure function of graph facts and the `CpuTarget`; the generated launch equals the schedule's
(tests/backends/test_cuda_compile.py checks it against ptxas for every zoo kernel)."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from costmodels.kernel import CPU_PRODUCTS, UNITS
from fusesearch.ir.graph import Graph, Node
from fusesearch.ir.op_kind import OpKind
from fusesearch.layout import NCHW, Layout, channel_block

THREADS = 256  # CUDA threads per block of every skeleton but small tiles
VECTOR = 4  # float4: one 16-byte load or store per tensor and thread
VECTOR_BYTES = 16  # a cp.async chunk: an NHWC conv stages A in 16-byte runs of channels
MAX_GRID_X = 65535  # a row kernel's blocks (rows beyond it are strided)
MAX_GRID_YZ = 65535
MAX_STRIDE_BLOCKS = 65535 * 8  # a grid-stride loop's blocks (the loop covers the rest)
MAX_ROW_SMEM = 32768  # bytes of shared memory a CUDA row kernel may use to cache computed rows
SMEM_ALIGN = 16  # every schedule's shared memory is a multiple of it (`Schedule`): a module that holds a
# kernel with dynamic shared memory (mma.sync) has ptxas start it 16-byte aligned after every other
# kernel's static shared memory, rounded up to 16; a multiple of 16 rounds to itself, so the bytes
# priced are the bytes ptxas reports in any module
ROW_REDUCE_SMEM = 32 * 4  # the block reduction's per-warp partials
ARGBEST_SMEM = THREADS * (4 + 8)  # ArgMax/ArgMin's block combine: a value and an index per thread
VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze"})
# tensor cores: the skeleton per operand dtype (float32 as TF32 only while `Graph.allow_tf32`), the
# element size its tiles are staged in, 4 warps (2x2 over the block tile, each a grid of 16x16
# accumulator fragments), the tiles lowering picks from, each staged row's padding (wmma's leading
# dimension must be a multiple of 16 bytes; the padding also spreads shared-memory banks)
MMA_SKELETONS = {"float32": "mma-tf32", "float16": "mma-f16", "bfloat16": "mma-bf16"}
MMA_ELEMENT_BYTES = {"mma-tf32": 4, "mma-f16": 2, "mma-bf16": 2, "mma-sync-tf32": 4, "mma-sync-f16": 2,
                     "mma-sync-bf16": 2}
MMA_THREADS = 128
MMA_TILES = ((64, 64), (64, 32), (32, 64), (32, 32))
MMA_PAD_BYTES = 16
MMA_MIN_ARCH = 80  # cp.async staging and TF32 / BF16 wmma fragments: sm_80 and later
# mma.sync tiles: the skeleton per wmma skeleton (same operand dtypes), the block tiles (BM, BN),
# warp tiles (WM, WN) and pipeline stages lowering picks from, largest first; each staged row of
# A (BM x BK) and B (BN x BK, both K-contiguous in shared memory) is MMA_SYNC_ROW_BYTES, so BK is
# 32 halves or 16 floats (two mma K steps of FP16/BF16 m16n8k16, two of TF32 m16n8k8)
MMA_SYNC_SKELETONS = {"mma-tf32": "mma-sync-tf32", "mma-f16": "mma-sync-f16", "mma-bf16": "mma-sync-bf16"}
MMA_SYNC_TILES = (  # (BM, BN, WM, WN, stages)
    (128, 256, 64, 64, 3),
    (128, 128, 64, 64, 4),
    (128, 128, 64, 32, 3),
    (64, 128, 32, 64, 4),
    (64, 64, 32, 32, 4),
    (32, 64, 32, 32, 3),
)
MMA_SYNC_ROW_BYTES = 64


class Skeleton(StrEnum):
    """The code shape a schedule names; the generator dispatches on it (a table, never a string
    test). Members compare equal to their names as strings, which plan.json records."""

    LIBRARY = "library"
    ALIAS = "alias"
    GRID_STRIDE = "grid-stride"
    VECTORIZED = "vectorized"
    BLOCK_PER_ROW = "block-per-row"
    TILED = "tiled"
    DIRECT = "direct"
    MMA_TF32 = "mma-tf32"
    MMA_F16 = "mma-f16"
    MMA_BF16 = "mma-bf16"
    MMA_SYNC_TF32 = "mma-sync-tf32"
    MMA_SYNC_F16 = "mma-sync-f16"
    MMA_SYNC_BF16 = "mma-sync-bf16"
    PACKED = "packed"
    DEPTHWISE = "depthwise"


SKELETONS = tuple(s.value for s in Skeleton)
CPU_SKELETONS = frozenset({Skeleton.PACKED, Skeleton.DEPTHWISE})  # C only: no CUDA source, launch or shared memory


TILE_K = 32  # K step of every GEMM tile
TARGET_BLOCKS = 256  # output tiles for two waves on the largest GPUs (132 SMs): the library-style default
TILE_CHOICES = ((128, 128), (128, 64), (64, 128), (64, 64), (64, 32), (32, 64), (32, 32))  # CUDA-core tiles
SKINNY_M = 32  # below it a GEMM is GEMV-like: one tile, M rounded up to a power of two
CPU_SPLITS = ("rows", "cols", "tiles")  # how a CPU gemm's threads share its output (`Schedule.split`)
ONE_THREAD = "one"  # `Schedule.split` of a CPU kernel whose OpenMP region runs on one thread (`one_thread_forms`)
# The library a GPU conv's library call is (`Schedule.library`): cuDNN's convolution, cuDNN's
# conv + bias + activation as one graph ("library, fused epilogue", as ONNX Runtime's FusedConv),
# or the named fallback where no cuDNN route is installed: im2col + cuBLAS through CuPy
LIBRARY_CALLS = ("cudnn", "cudnn-fused", "im2col")
CUDNN_ACTIVATIONS = ("Relu", "Sigmoid", "Tanh")  # the epilogues a cuDNN conv graph fuses here
ONE_PASS = "one-pass"  # `Schedule.moments` of a row kernel whose statistics take one pass (`one_pass_moments`)
PROLOGUES = ("stored", "packed")  # how a CPU gemm's row prologue reaches its product (`Schedule.prologue`)


@dataclass(frozen=True)
class Schedule:
    impl: str
    skeleton: Skeleton  # a name is taken too (coerced)
    unit: str
    tile: tuple[int, ...] = ()
    warp: tuple[int, ...] = ()
    stages: int = 1
    split_k: int = 1
    threads: int = THREADS
    grid: tuple[int, ...] = ()
    smem_bytes: int = 0
    row_cache: tuple[str, ...] = ()
    product: str = ""
    epilogue: str = ""
    split: str = ""
    library: str = ""  # a GPU conv's library call (LIBRARY_CALLS); "" for any other
    layout_in: Layout = NCHW  # a CPU conv: how its activation input lies (`tensor_layouts`)
    layout_out: Layout = NCHW  # ... and its outputs and the inputs of their shape (a residual)
    moments: str = ""  # a row kernel's mean and variance: "one-pass" (`one_pass_moments`), else a pass each
    prologue: str = ""  # a CPU gemm's row prologue (PROLOGUES, `prologue_forms`); "" where it has none
    workspace_bytes: int = 0  # split-K's fp32 partial sums (`split_k_workspace`): priced twice, declared by the kernel

    def __post_init__(self) -> None:
        if (self.skeleton not in SKELETONS or self.unit not in UNITS or (self.product and self.product not in CPU_PRODUCTS)
                or self.epilogue not in ("", "tile", "block") or (self.split and self.split not in (*CPU_SPLITS, ONE_THREAD))
                or (self.library and (self.library not in LIBRARY_CALLS or self.impl != "library"))
                or self.moments not in ("", ONE_PASS) or self.prologue not in ("", *PROLOGUES)):
            raise ValueError(f"schedule: skeleton {self.skeleton!r} / unit {self.unit!r} / product {self.product!r}"
                             f" / split {self.split!r} / library {self.library!r} / moments {self.moments!r}"
                             f" / prologue {self.prologue!r}")
        if self.smem_bytes % SMEM_ALIGN:
            raise ValueError(f"schedule: {self.smem_bytes} bytes of shared memory, not a multiple of {SMEM_ALIGN}")
        object.__setattr__(self, "skeleton", Skeleton(self.skeleton))

    def to_dict(self) -> dict[str, object]:
        """The schedule as plan.json records it (every field but the row cache's keys: its count)."""
        return {"skeleton": self.skeleton.value, "unit": self.unit, "tile": list(self.tile), "warp": list(self.warp),
                "stages": self.stages,
                "split_k": self.split_k, "threads": self.threads, "grid": list(self.grid),
                "smem_bytes": self.smem_bytes, "cached_rows": len(self.row_cache), "product": self.product,
                "epilogue": self.epilogue, "split": self.split, "library": self.library, "moments": self.moments,
                "prologue": self.prologue, "workspace_bytes": self.workspace_bytes}

    @property
    def cpu_threads(self) -> int:
        """The OpenMP threads a CPU kernel's region runs with: 1 for the one-thread form
        (ONE_THREAD), else 0, all of the target's."""
        return 1 if self.split == ONE_THREAD else 0

    @property
    def blocks(self) -> int:
        """Blocks in the launch grid; 0 when the grid is the library's (from the iteration space)."""
        return math.prod(self.grid) if self.grid else 0

    @property
    def min_arch(self) -> int:
        return MMA_MIN_ARCH if self.impl == "generated" and self.skeleton in MMA_ELEMENT_BYTES else 0


LIBRARY = Schedule("library", "library", "cuda-core")  # an opaque op: a library call, not generated
ALIAS = Schedule("alias", "alias", "none")
PACKED = Schedule("generated", "packed", "cpu-simd", threads=1)  # a fused gemm/conv on a CPU
DEPTHWISE = Schedule("generated", "depthwise", "cpu-simd", threads=1)  # a fused depthwise conv on a CPU


def depthwise_like(in_per_group: int, out_per_group: int) -> bool:
    """A C conv with one input channel and under 8 output channels per group: its own loop (the
    depthwise loop, or per-pixel rows), never a GEMM over packed panels."""
    return in_per_group == 1 and out_per_group < 8


def depthwise_conv(graph: Graph, anchor: Node) -> bool:
    """Whether a Conv is depthwise: 2-D, in groups of one input channel each (any number of
    output channels per group). Its own template ("depthwise"), priced by its own efficiencies
    apart from dense convs (a library's depthwise kernel and ours are loop nests over each
    channel's plane, running at a fraction of a dense conv's rate), and on a CPU its own
    skeleton (`DEPTHWISE`, the C depthwise loop)."""
    if anchor.op_type != "Conv":
        return False
    x = graph.tensors[anchor.inputs[0]]
    group = int(anchor.attrs.get("group", 1))
    return x.shape is not None and len(x.shape) == 4 and group > 1 and x.shape[1] == group


def disjoint_windows(graph: Graph, anchor: Node) -> bool:
    """Whether a Conv, not depthwise (`depthwise_conv`), has windows that do not overlap: along
    every spatial axis the window's extent (dilation (k - 1) + 1) is at most the stride, so each
    input element feeds one output position per filter (a 1x1 conv, a ViT patch embedding). Its
    own template ("conv_disjoint"), priced by its own efficiencies: its product is a GEMM over the
    input as it lies (or subsampled, or unfolded without duplicating an element), where an
    overlapping window's im2col (the library's path) copies each element up to k x k times and
    ours reads its taps from a band instead (on one Sapphire Rapids core, calibration sample:
    ONNX Runtime's 3x3 and 7x7 convs at 105-124 GFLOP/s, its 1x1 and patch convs at 116-141; ours
    at 157-168 and 91-128)."""
    if anchor.op_type != "Conv" or depthwise_conv(graph, anchor):
        return False
    w = graph.tensors[anchor.inputs[1]]
    if w.shape is None or len(w.shape) < 3:
        return False
    spatial = tuple(w.shape[2:])
    strides = tuple(anchor.attrs.get("strides", (1,) * len(spatial)))
    dilations = tuple(anchor.attrs.get("dilations", (1,) * len(spatial)))
    return all(d * (k - 1) + 1 <= s for k, s, d in zip(spatial, strides, dilations, strict=True))


def conv_reads_band(graph: Graph, anchor: Node) -> bool:
    """Whether a fused 2-D conv with a k x k window (not 1 x 1) and float32 constant filters, neither
    depthwise (`depthwise_conv`) nor depthwise-like, is written (`packed`, C) over a zero-bordered band of its input: each input
    element, prologue included, computed once per block of output rows, its taps read from there
    (`fs_conv_band`: in place with AVX-512, else packed); other convs read im2col panels, a
    prologue element once per tap."""
    if anchor.op_type != "Conv":
        return False
    x, w = graph.tensors[anchor.inputs[0]], graph.tensors[anchor.inputs[1]]
    if x.shape is None or w.shape is None or len(x.shape) != 4 or not w.constant or w.dtype != "float32":
        return False
    group = int(anchor.attrs.get("group", 1))
    return (not depthwise_like(x.shape[1] // group, w.shape[0] // group) and not depthwise_conv(graph, anchor)
            and tuple(w.shape[2:]) != (1, 1))


@dataclass(frozen=True)
class CudnnEpilogue:
    """A 2-D Conv's epilogue as one cuDNN graph takes it (`cudnn_epilogue`): `bias` the
    per-channel constant added (the Conv's own B, or an Add of a [C, 1, 1] / [1, C, 1, 1]
    constant after it; "" for none), `activation` one of CUDNN_ACTIVATIONS ("" for none), `output`
    the tensor the graph writes."""

    bias: str
    activation: str
    output: str


def cudnn_epilogue(graph: Graph, nodes: Collection[int], anchor: Node) -> CudnnEpilogue | None:
    """Where the group is exactly a 2-D Conv (float32, float16 or bfloat16), at most one Add of a
    per-channel constant bias (and only where the Conv has none) and at most one activation of
    CUDNN_ACTIVATIONS after it, each value read by the next op alone and not an output: the
    epilogue, so the group runs as one cuDNN graph (conv_fprop, add, pointwise); else None."""
    x = graph.tensors[anchor.inputs[0]]
    if (anchor.op_type != "Conv" or x.shape is None or len(x.shape) != 4
            or x.dtype not in ("float32", "float16", "bfloat16")):
        return None
    bias = anchor.inputs[2] if len(anchor.inputs) > 2 and anchor.inputs[2] else ""
    rest, t, activation = set(nodes) - {anchor.id}, anchor.outputs[0], ""
    channels = graph.tensors[t].shape[1] if graph.tensors[t].shape else 0
    while rest:
        users = graph.consumers(t)
        if len(users) != 1 or users[0] not in rest or graph.is_output(t):
            return None
        n = graph.nodes[users[0]]
        if n.op_type == "Add" and not bias and not activation and len(n.inputs) == 2:
            c = n.inputs[1] if n.inputs[0] == t else n.inputs[0]
            info = graph.tensors[c]
            if not info.constant or info.shape is None or tuple(info.shape) not in ((channels, 1, 1), (1, channels, 1, 1)):
                return None
            bias = c
        elif n.op_type in CUDNN_ACTIVATIONS and not activation:
            activation = n.op_type
        else:
            return None
        rest.discard(n.id)
        t = n.outputs[0]
    return CudnnEpilogue(bias, activation, t) if bias or activation or len(nodes) == 1 else None


def folded_scale(graph: Graph, nodes: Collection[int], anchor: Node) -> tuple[str, float, frozenset[int]] | None:
    """Where a fused MatMul/Gemm's activation operand is a float32 tensor read in place times
    scalar constants (Mul by one, Div by one: GELU's x 0.5 in front of a down-projection), the C
    product (`packed`) folds the scale into itself — the BLAS's alpha, or the weights scaled as
    they are packed — and reads the tensor in place, with no panel of A: (the tensor, the scale,
    the folded nodes), charged nothing. None where a folded value is used elsewhere (another op
    of the group, outside it) or the operand is anything else."""
    if anchor.op_type not in ("MatMul", "Gemm") or (anchor.op_type == "Gemm" and (
            int(anchor.attrs.get("transA", 0)) or float(anchor.attrs.get("alpha", 1.0)) != 1.0)):
        return None
    t, scale, folded, user = anchor.inputs[0], 1.0, [], anchor.id
    while (p := graph.producer(t)) is not None and p in nodes:
        n = graph.nodes[p]
        if (n.op_type not in ("Mul", "Div") or len(n.inputs) != 2 or graph.is_output(t)
                or graph.consumers(t) != (user,)):
            return None
        sides = (1,) if n.op_type == "Div" else (1, 0)
        c = next((i for i in sides if (v := graph.constant_value(n.inputs[i])) is not None and v.size == 1), None)
        other = n.inputs[1 - c] if c is not None else None
        if other is None or graph.tensors[other].shape != graph.tensors[t].shape:
            return None
        v = float(graph.constant_value(n.inputs[c]).reshape(()))
        if not math.isfinite(v) or v == 0.0:
            return None
        scale = scale / v if n.op_type == "Div" else scale * v
        folded.append(p)
        t, user = other, p
    if not folded or graph.tensors[t].dtype != "float32" or not math.isfinite(scale) or scale == 0.0:
        return None
    return t, scale, frozenset(folded)


@dataclass(frozen=True)
class ScaledProduct:
    """A fused MatMul's product read only as `tensor`, the product times `scale` (attention's
    scores over sqrt(d)); `nodes` the Mul/Div ops that scale it (`scaled_product`)."""

    tensor: str
    scale: float
    nodes: frozenset[int]


def scaled_product(graph: Graph, nodes: Collection[int], anchor: Node, product: str) -> ScaledProduct | None:
    """Where a fused float32 MatMul's product, with our micro-kernel ("own": B always packed by
    us, per block or once), is read by one chain of Mul by / Div by finite nonzero scalar
    constants (attention's score x 0.125 or / 8), each value before the last read by the next op
    alone and not an output: the scale is multiplied into B as it is packed and the product
    stored is the scaled tensor, so no op runs on it (the scores' Softmax reads them as they
    are). None elsewhere (another product: the BLAS's `#else` loops would compute the product
    unscaled; a Gemm, whose C term the scale must not touch)."""
    if product != "own" or anchor.op_type != "MatMul":
        return None
    t, scale, folded = anchor.outputs[0], 1.0, []
    while (len(users := graph.consumers(t)) == 1 and users[0] in nodes and not graph.is_output(t)
           and graph.tensors[t].dtype == "float32"):
        n = graph.nodes[users[0]]
        c = next((i for i in ((1,) if n.op_type == "Div" else (1, 0)) if n.op_type in ("Mul", "Div")
                  and len(n.inputs) == 2 and n.inputs[1 - i] == t
                  and (v := graph.constant_value(n.inputs[i])) is not None and v.size == 1), None)
        if c is None or graph.tensors[n.outputs[0]].shape != graph.tensors[t].shape:
            break
        v = float(graph.constant_value(n.inputs[c]).reshape(()))
        if not math.isfinite(v) or v == 0.0 or not math.isfinite(step := scale / v if n.op_type == "Div" else scale * v):
            break
        scale, t = step, n.outputs[0]
        folded.append(n.id)
    if not folded or graph.tensors[t].dtype != "float32":
        return None
    return ScaledProduct(t, scale, frozenset(folded))


# -- the CPU product: which code path a gemm/conv's C runs ----------------------------------------

CPU_MICRO_TILE = (6, 16)  # rows x columns of the C micro-kernel's smallest tile (`c_gemm.FS_MR`, `FS_NR`)
# Our micro-kernel over B packed (`fs_gemm_rows`, B's columns in blocks kept in L2) applies where
# K <= ROWS_MAX_K (a pair of B micro-panels, 2 x FS_NR x K floats, 512 KiB at most, stays in L2
# while the row panels of A run over it), B has at most ROWS_MAX_B_FLOATS and the product at least
# one full tile (below it the kernel would compute padding). ROWS_MAX_K was 2048 until the AVX-512
# tiles and the column blocks: on one Ice Lake core bert-base's 128x3072x768 down-projection group
# (GELU prologue, bias, residual) ran 1.28x faster through ours than through the BLAS (6.37 against
# 8.31 ms, 5.32 against 6.80, interleaved medians); `codegen.cpu_gemm`'s note has the other figures.
ROWS_MAX_K = 4096
# ROWS_MAX_B_FLOATS bounds the packed copy a plan keeps of a weight (256 MiB): 4M until gpt2's LM head
# (768 x 50257) was seen on the BLAS, 1.26x the time of ours at 128 x 768 x 8192 on one Zen 4 core
# (scipy-openblas32 20.2 ms, ours 16.0, ONNX Runtime's MLAS 16.3; best of the interleaved samples).
ROWS_MAX_B_FLOATS = 1 << 26
_C_FLOATS = frozenset({"float32", "float16", "bfloat16"})  # computed in float32 by the C product


def gemm_products(graph: Graph, anchor: Node, blas: bool = True) -> tuple[str, ...]:
    """The C products a MatMul/Gemm can run as (`Schedule.product`), the default first: "own"
    (our micro-kernel: within ROWS_MAX_K and ROWS_MAX_B_FLOATS, from one full CPU_MICRO_TILE),
    then "blas" where the backend has a BLAS (`blas`); "loops" alone where neither applies (a
    1-D operand, a product or B not computed in float32)."""
    a, b, y = (graph.tensors[t] for t in (*anchor.inputs[:2], anchor.outputs[0]))
    if (anchor.op_type not in ("MatMul", "Gemm") or len(a.shape) < 2 or len(b.shape) < 2
            or b.dtype not in _C_FLOATS or y.dtype not in _C_FLOATS):
        return ("loops",)
    trans_a = anchor.op_type == "Gemm" and int(anchor.attrs.get("transA", 0))
    k, m, n = a.shape[0] if trans_a else a.shape[-1], y.shape[-2], y.shape[-1]
    own = k <= ROWS_MAX_K and k * n <= ROWS_MAX_B_FLOATS and m >= CPU_MICRO_TILE[0] and n >= CPU_MICRO_TILE[1]
    return (*(("own",) if own else ()), *(("blas",) if blas else ())) or ("loops",)


# C conv (the products of `conv_products`): the im2col panel per block (1 MiB), whole output rows
CONV_PATCH_FLOATS = 1 << 18  # C conv: im2col panel per block (1 MiB), whole output rows

# C conv: filters of at least this many floats (4 MiB), at least twice as many as a block has
# pixels, are packed once (`PackedWeight`) and multiplied by our own micro-kernel
# (`fs_gemm_packed`) instead of a BLAS call that packs them again per block (see the module note;
# the figures from `benchmarks/bench_cpu.py --sections 1b`)
PACK_FILTER_FLOATS = 1 << 20

# ... and so are those of a conv over at least PACK_MIN_TAPS taps whose blocks have at most
# PACK_MAX_PIXELS pixels (14 x 14): each activation element then meets many filters, and the
# filters packed again per BLAS call cost more than our panel of pixels packed per block. On one
# Ice Lake core (AVX-512), fused 1x1 convs generated both ways and timed interleaved, the time
# packed over the BLAS's: mobilenetv2's 0.66-0.91x at 7 x 7 (160 to 960 taps), 0.90-1.02x at
# 14 x 14 (96 to 576 taps; 0.87x summed over its 16), resnet50's 14 x 14 0.71-0.97x (0.85x
# summed), yolo-neck's 10 x 10 0.79-1.01x (0.86x); over 64 taps 1.13-1.39x and at 28 x 28
# 1.18-1.22x, where the BLAS stays (on Zen 3, below the first rule, the two were within noise:
# 0.86-1.05x)
PACK_MIN_TAPS = 96

PACK_MAX_PIXELS = 196

# C conv: a 1x1 stride-1 unpadded conv runs `fs_gemm_rows` over its filters in place, its pixels
# (the input read in place, or the prologue's panel) packed per chunk (`fs_conv_1x1`), each tile
# stored straight into the block's channels x pixels, where its blocks have at least
# ROWS_1X1_MIN_PIXELS pixels (14 x 14) and it has at least two row panels of filters (2 FS_MR),
# unless its filters would be packed (`packs_filters`) over more than ROWS_1X1_PACKED_TAPS taps;
# and, at any size, where it reads its input in place over at most ROWS_1X1_MAX_TAPS input
# channels with at least twice as many filters. On one Ice Lake core (AVX-512), fused 1x1 convs
# generated both ways and timed interleaved, its time over the BLAS's at 20 x 20 and above:
# yolo-neck's 0.77-0.93x (0.88x summed), resnet50's 0.76-0.89x at 28 x 28 and 56 x 56,
# mobilenetv2's 0.82-0.98x at 28 x 28 to 112 x 112 (one 1.14x), but 1.26x at U-Net's head (2
# filters); over the packed filters (`fs_gemm_packed`, which stores each pixels x filters tile
# transposed) at 14 x 14: mobilenetv2's 0.87-0.96x up to 384 taps, 1.02-1.09x at 576, resnet50's
# 0.98-1.03x at 256 taps, 0.98-1.09x at 1024 (a tile's 12 filter rows of 576 or more taps fill
# L1 beside the pixel panels); at 7 x 7 and 10 x 10 1.05-1.67x, where the packed filters stay.
# On Zen 3 the in-place rule measured 1.10-1.18x the BLAS at mobilenetv2's expansions.
ROWS_1X1_MIN_PIXELS = 196

ROWS_1X1_PACKED_TAPS = 384

ROWS_1X1_MAX_TAPS = 64


def packs_filters(filters: int, taps: int, block_pixels: int) -> bool:
    """Whether a conv's filters (filters x taps floats, a block of `block_pixels` output pixels)
    are packed once and multiplied by our own micro-kernel rather than through the BLAS."""
    return ((filters * taps >= PACK_FILTER_FLOATS and filters >= 2 * block_pixels)
            or (taps >= PACK_MIN_TAPS and block_pixels <= PACK_MAX_PIXELS))


def rows_1x1(filters: int, taps: int, block_pixels: int, in_place: bool) -> bool:
    """Whether a 1x1 stride-1 unpadded conv (its input read `in_place`, else a prologue's panel)
    runs through `fs_conv_1x1`."""
    if block_pixels >= ROWS_1X1_MIN_PIXELS and filters >= 2 * CPU_MICRO_TILE[0]:
        return taps <= ROWS_1X1_PACKED_TAPS or not packs_filters(filters, taps, block_pixels)
    return in_place and taps <= ROWS_1X1_MAX_TAPS and filters >= 2 * taps


def conv_block_rows(filters: int, taps: int, width: int) -> int:
    """Output rows per conv block at most: the im2col panel within CONV_PATCH_FLOATS, or within
    the filters' size when they are larger (a BLAS call packs all the filters again per block: a
    512x4608 filter set is 9 MiB)."""
    return max(1, max(CONV_PATCH_FLOATS, filters * taps) // max(1, taps * width))


def _conv_pixel_wise(anchor: Node, kern: tuple[int, ...]) -> bool:
    """Whether a 2-D conv is 1x1, stride 1, with no leading padding: output pixel p reads input pixel p."""
    strides = tuple(anchor.attrs.get("strides") or (1, 1))
    pads = tuple(anchor.attrs.get("pads") or (0, 0, 0, 0))[:2]
    return kern == (1, 1) and strides == (1, 1) and not any(pads)


def _read_as_stored(graph: Graph, nodes: Collection[int], x: str) -> bool:
    """Whether a float32 conv input is read as it lies in memory: a kernel input, or an output the
    kernel writes first (computed in the group, used outside it)."""
    if graph.tensors[x].dtype != "float32":
        return False
    return (graph.producer(x) not in nodes or graph.is_output(x)
            or any(c not in nodes for c in graph.consumers(x)))


def conv_products(graph: Graph, nodes: Collection[int], anchor: Node, blas: bool = True) -> tuple[str, ...]:
    """The C products a Conv can run as (`Schedule.product`), the measured default first (the
    module notes of `codegen.cpu_conv` have the figures): a depthwise conv's loop ("depthwise"); for
    a 2-D conv with filters read as a kernel input, not depthwise-like: "band" where it reads a
    band (`conv_reads_band`), "rows" for a 1x1 stride-1 conv (the first where `rows_1x1`), "packed"
    where its filters are a float32 constant (the first where `packs_filters`), "im2col" where the
    backend has a BLAS (the first where nothing else is); "loops" alone where none applies."""
    x, w = (graph.tensors[t] for t in anchor.inputs[:2])
    computed_w = graph.producer(anchor.inputs[1]) in nodes or w.dtype not in _C_FLOATS
    if depthwise_conv(graph, anchor):
        return ("loops",) if computed_w else ("depthwise",)
    if computed_w or len(x.shape) != 4 or anchor.op_type != "Conv":
        return ("loops",)
    group = int(anchor.attrs.get("group", 1))
    y = graph.tensors[anchor.outputs[0]]
    cout_g = y.shape[1] // group
    if depthwise_like(x.shape[1] // group, cout_g):
        return ("loops",)
    kern = tuple(anchor.attrs.get("kernel_shape") or w.shape[2:])
    taps, (ho, wo) = x.shape[1] // group * math.prod(kern), y.shape[2:]
    block_pixels = min(ho * wo, conv_block_rows(cout_g, taps, wo) * wo)
    pixel_wise = _conv_pixel_wise(anchor, kern)
    rows = pixel_wise and rows_1x1(cout_g, taps, block_pixels, _read_as_stored(graph, nodes, anchor.inputs[0]))
    packable = w.constant and w.dtype == "float32"
    band = conv_reads_band(graph, anchor)
    default = ("band" if band else "rows" if rows else
               "packed" if packable and packs_filters(cout_g, taps, block_pixels) else "im2col")
    applicable = {"band": band, "rows": pixel_wise, "packed": packable, "im2col": blas}
    ordered = (default, *(p for p in applicable if p != default))
    return tuple(p for p in ordered if applicable[p]) or ("loops",)


# -- blocked channel layouts (NCHWc, `fusesearch.layout`): which convs run in them ------------------

def nchwc_conv(graph: Graph, nodes: Collection[int], anchor: Node) -> bool:
    """Whether a conv group has an NCHWc form (product "nchwc", `codegen.cpu_conv_nchwc`): a 2-D
    float32 Conv with float32 constant filters, dense (one group) or depthwise with one filter per
    channel, undilated, its input a kernel input (no prologue: in a blocked chain the producer's
    epilogue holds the activation); the rest of the group an epilogue of elementwise or broadcast
    ops on tensors of the conv's output shape, whose other operands are of that shape (a
    residual) or per channel (a bias: every dim but the channels 1), and every output of the group
    of that shape."""
    if anchor.op_type != "Conv" or len(anchor.inputs) < 2:
        return False
    x, w, y = (graph.tensors[t] for t in (*anchor.inputs[:2], anchor.outputs[0]))
    group = int(anchor.attrs.get("group", 1))
    if (x.shape is None or len(x.shape) != 4 or not w.constant or {x.dtype, w.dtype, y.dtype} != {"float32"}
            or any(d != 1 for d in anchor.attrs.get("dilations") or ())
            or not (group == 1 or (group == x.shape[1] == y.shape[1]))):
        return False
    return _laid_conv_group(graph, nodes, anchor, "float32")


def _laid_conv_group(graph: Graph, nodes: Collection[int], anchor: Node, dtype: str) -> bool:
    """A conv group a layout other than the model's can run (`nchwc_conv`, `nhwc_conv`): its input
    a kernel input (no prologue: in a laid-out chain the producer's epilogue holds the
    activation); the rest of the group an epilogue of elementwise or broadcast ops on tensors of
    the conv's output shape, whose other operands, of `dtype`, are of that shape (a residual) or
    per channel (a bias), and every output of the group of that shape."""
    y = graph.tensors[anchor.outputs[0]]
    if graph.producer(anchor.inputs[0]) in nodes:
        return False
    derived = {anchor.outputs[0]}
    for n in (graph.nodes[i] for i in sorted(nodes) if i != anchor.id):
        if n.kind not in (OpKind.ELEMWISE, OpKind.BROADCAST) or not any(t in derived for t in n.inputs):
            return False
        for t in n.inputs:
            info = graph.tensors[t] if t else None
            if t in derived or info is None:
                continue
            if info.dtype != dtype or not (info.shape == y.shape or per_channel(info.shape)):
                return False
        if any(graph.tensors[t].shape != y.shape for t in n.outputs):
            return False
        derived.update(n.outputs)
    return all(t in derived for i in nodes for t in graph.nodes[i].outputs
               if graph.is_output(t) or any(c not in nodes for c in graph.consumers(t)))


CHAIN = "nchwc-chain"  # the product of a chain of anchors (`anchor_chain`), which has no NCHW form
# a chain's 1x1 filters at most (256 KiB, half a 512 KiB L2): each expanded row reads them all again,
# so larger ones stream from L3 once per row (MobileNetV2's 160 -> 960 at 7 x 7, 614 KiB: 1.0-1.36x
# the time of its two kernels; 96 -> 576, 221 KiB: 0.93-1.04x; 64 -> 384: 0.95-0.99x)
CHAIN_FILTER_FLOATS = 1 << 16


@dataclass(frozen=True)
class Chain:
    """An NCHWc chain's anchors (`anchor_chain`): the 1x1 expansion and the depthwise conv."""

    expand: Node
    dw: Node

    @property
    def anchors(self) -> tuple[Node, Node]:
        return self.expand, self.dw


def anchor_chain(graph: Graph, nodes: Collection[int]) -> Chain | None:
    """The anchors where a group is an NCHWc chain (product CHAIN, `codegen.cpu_conv_chain`): a
    dense 1x1 Conv (the expansion: stride 1, unpadded, its float32 constant filters at most
    CHAIN_FILTER_FLOATS, its input a kernel input, blocked), elementwise or per-channel ops on its
    output (an activation), a depthwise Conv reading them, and an epilogue as `nchwc_conv` allows;
    no tensor between the anchors leaves the group (it never reaches memory: that is the point).
    An inverted residual block's expansion and depthwise conv (MobileNetV2's 96 x 112 x 112
    activation, 4.8 MB, written and read back between the two as separate kernels). None for any
    other group. (The block's 1x1 projection in the same kernel, from a row buffer of the
    depthwise conv's output, measured 1.0-1.3x the time of this chain and the projection's own
    kernel: not taken, `benchmarks/bench_chains.md`.)"""
    anchors = [graph.nodes[i] for i in sorted(nodes) if graph.nodes[i].kind == OpKind.ANCHOR]
    if len(anchors) != 2 or any(a.op_type != "Conv" or len(a.inputs) < 2 or not _plain_conv(graph, a)
                                for a in anchors):
        return None
    expand, dw = anchors
    if not _pointwise_conv(graph, expand) or graph.producer(expand.inputs[0]) in nodes:
        return None
    channels = graph.tensors[expand.outputs[0]].shape[1]
    if not int(dw.attrs.get("group", 1)) == channels == graph.tensors[dw.outputs[0]].shape[1]:
        return None
    inside = set(nodes)
    middle = _between(graph, inside, expand, dw)
    if middle is None:
        return None
    rest = inside - middle - {expand.id}
    return Chain(expand, dw) if _laid_conv_group(graph, rest, dw, "float32") else None


def _pointwise_conv(graph: Graph, conv: Node) -> bool:
    """A dense 1x1 conv of stride 1, unpadded, its filters within CHAIN_FILTER_FLOATS."""
    w = graph.tensors[conv.inputs[1]]
    return (int(conv.attrs.get("group", 1)) == 1 and tuple(w.shape[2:]) == (1, 1) and w.size <= CHAIN_FILTER_FLOATS
            and not any(conv.attrs.get("pads") or ()) and tuple(conv.attrs.get("strides") or (1, 1)) == (1, 1))


def _between(graph: Graph, inside: set[int], a: Node, b: Node) -> set[int] | None:
    """The ops of a chain between anchor `a` and the next, `b` (b reads what they compute from
    a's output, elementwise or per channel, none of it leaving the group), or None."""
    if not graph.reaches(a.id, b.id):
        return None
    shape = graph.tensors[a.outputs[0]].shape
    middle = [graph.nodes[i] for i in sorted(inside) if graph.reaches(a.id, i) and graph.reaches(i, b.id)]
    derived = {a.outputs[0]}
    for n in middle:
        if n.kind not in (OpKind.ELEMWISE, OpKind.BROADCAST) or not any(t in derived for t in n.inputs):
            return None
        others = [graph.tensors[t] for t in n.inputs if t and t not in derived]
        if any(o.dtype != "float32" or not per_channel(o.shape) for o in others):
            return None
        if any(graph.tensors[t].shape != shape for t in n.outputs if t):
            return None
        derived.update(t for t in n.outputs if t)
    if b.inputs[0] not in derived or any(graph.is_output(t) or any(c not in inside for c in graph.consumers(t))
                                         for t in derived):
        return None
    return {n.id for n in middle}


def _plain_conv(graph: Graph, conv: Node) -> bool:
    """A 2-D float32 Conv over constant float32 filters, undilated, its pads explicit (no
    auto_pad: `_pointwise_conv` reads them)."""
    x, w, y = (graph.tensors[t] for t in (*conv.inputs[:2], conv.outputs[0]))
    auto = conv.attrs.get("auto_pad", "NOTSET")
    return (x.shape is not None and len(x.shape) == 4 and w.constant and {x.dtype, w.dtype, y.dtype} == {"float32"}
            and all(d == 1 for d in conv.attrs.get("dilations") or ())
            and (auto.decode() if isinstance(auto, bytes) else auto) == "NOTSET")


@dataclass(frozen=True)
class ChainItems:
    """The work items of an NCHWc chain (`anchor_chain`, `codegen.cpu_conv_chain`): images x
    `groups(T)` groups of the expanded channel blocks (whole tiles of `o_tile` blocks, the 1x1
    conv's register tile), in contiguous shares; an item walks every output row, computing its
    blocks of each expanded row once into its ring. A channel block of the chain depends on its
    own expanded block alone (the depthwise conv is per channel), so the groups share no work:
    each reads its image's input again (the thin side of the block) instead of recomputing rows
    at the edges of row blocks. One group per image at one thread, as many as the threads need
    (at most one tile each) otherwise."""

    images: int
    channel_blocks: int
    o_tile: int

    @property
    def tiles(self) -> int:
        return -(-self.channel_blocks // self.o_tile)

    def groups(self, threads: int) -> int:
        return max(1, min(self.tiles, -(-threads // self.images))) if threads > 1 else 1

    def c_groups(self, threads: str) -> str:
        """`groups` as the C computes it from the team's size at run time (the C expression `threads`)."""
        want = f"({threads} + {self.images - 1}LL) / {self.images}LL"
        return f"({threads} > 1 ? ({want} < {self.tiles}LL ? {want} : {self.tiles}LL) : 1LL)"

    def bounds(self, g: int, groups: int) -> tuple[int, int]:
        """Group g's tiles [t0, t1) of `groups`."""
        return g * self.tiles // groups, (g + 1) * self.tiles // groups

    def c_bounds(self, g: str, groups: str) -> tuple[str, str]:
        return f"{g} * {self.tiles}LL / {groups}", f"({g} + 1) * {self.tiles}LL / {groups}"

    def blocks(self, g: int, groups: int) -> int:
        """Channel blocks of group g (the last tile holds the blocks left)."""
        t0, t1 = self.bounds(g, groups)
        return min(t1 * self.o_tile, self.channel_blocks) - t0 * self.o_tile

    def imbalance(self, threads: int) -> float:
        """The busiest thread's blocks over an even share (`static_imbalance`)."""
        if threads <= 1:
            return 1.0
        groups = self.groups(threads)
        return static_imbalance([self.blocks(r % groups, groups) for r in range(self.images * groups)], threads)


def chain_items(graph: Graph, chain: Chain, block: int) -> ChainItems:
    """An NCHWc chain's items (`ChainItems`) at channel blocks of `block`: its expanded blocks in
    tiles of `nchwc_tile` (the 1x1 conv's)."""
    n, c = graph.tensors[chain.expand.outputs[0]].shape[:2]
    blocks = -(-c // block)
    return ChainItems(n, blocks, min(nchwc_tile(block, False, blocks), blocks))


def nchwc_input(graph: Graph, anchor: Node, blocked: Layout) -> Layout:
    """The layout an NCHWc conv reads its input in: NCHW for a dense conv over fewer channels
    than a block (an image's 3: padded to a block it would multiply 13 zero channels of 16, and
    each pixel's channels are one broadcast each where they lie), else `blocked`."""
    x = graph.tensors[anchor.inputs[0]]
    return NCHW if int(anchor.attrs.get("group", 1)) == 1 and x.shape[1] < blocked.block else blocked


def nhwc_conv(graph: Graph, nodes: Collection[int], anchor: Node) -> bool:
    """Whether a conv group has a channels-last form on a GPU (`layout.NHWC`, K of its implicit
    GEMM ordered (r, s, c): `codegen.contraction`): a dense 2-D Conv with a tensor-core skeleton
    (`tensor_core_skeleton`), its epilogue as `_laid_conv_group` says."""
    if anchor.op_type != "Conv" or len(anchor.inputs) < 2 or int(anchor.attrs.get("group", 1)) != 1:
        return False
    x = graph.tensors[anchor.inputs[0]]
    return (x.shape is not None and len(x.shape) == 4 and tensor_core_skeleton(graph, anchor) is not None
            and _laid_conv_group(graph, nodes, anchor, graph.tensors[anchor.outputs[0]].dtype))


def channels_last(schedule: Schedule) -> bool:
    """Whether a schedule reads or writes a tensor channels last (a GPU conv's NHWC form: CUDA only)."""
    return schedule.layout_in.channels_last or schedule.layout_out.channels_last


REORDER_SQUARE = 32  # a GPU reorder's square of (channels, pixels) per block (`codegen.nhwc`)


def reorder_grid(shape: Sequence[int]) -> tuple[int, int, int]:
    """The launch of a GPU reorder of an (N, C, H, W) tensor: a block per REORDER_SQUARE^2 square
    of pixels (x) and channels (y) of each image (z)."""
    n, c, h, w = shape
    return -(-h * w // REORDER_SQUARE), -(-c // REORDER_SQUARE), n


SECTOR_BYTES = 32  # the unit a GPU's L2 and DRAM move: a warp's load costs the 32-byte sectors it touches
def a_load_elements(graph: Graph, anchor: Node, layout: Layout, element_bytes: int) -> int:
    """Elements of a conv's A tile one staging load moves: a chunk of VECTOR_BYTES of channels
    (a 16-byte cp.async, `codegen.mma_sync`) where the input lies channels last, is stored as the
    tile is staged (float32 under TF32, the half type under FP16/BF16) and its channels (of a
    group, and all) are whole chunks; else one element per load."""
    x = graph.tensors[anchor.inputs[0]]
    elements = VECTOR_BYTES // element_bytes
    cin_g = x.shape[1] // int(anchor.attrs.get("group", 1))
    whole = layout.channels_last and x.nbytes // max(1, x.size) == element_bytes and not (cin_g % elements
                                                                                          or x.shape[1] % elements)
    return elements if whole else 1


def activation_sectors(graph: Graph, anchor: Node, layout: Layout, element_bytes: int) -> float:
    """The bytes of 32-byte sectors an implicit-GEMM conv's A staging moves per byte of its
    activation it uses, as the activation lies. NCHW (K = (c, r, s)): a warp's lanes run along M,
    a row of W_out output pixels at the conv's stride, so each row's run of ((W_out - 1) x
    stride + 1) elements costs its whole sectors: a stride of 2 moves about twice the bytes it
    uses, a row of 7 or 14 floats 1.14x.
    NHWC (K = (r, s, c)): a pixel's channels are one contiguous run, its sectors rounded up once
    per pixel and tap (c x element bytes a multiple of 32: 1.0)."""
    x, y = graph.tensors[anchor.inputs[0]].shape, graph.tensors[anchor.outputs[0]].shape
    if layout.channels_last:
        run = x[1] // int(anchor.attrs.get("group", 1)) * element_bytes
        return -(-run // SECTOR_BYTES) * SECTOR_BYTES / run
    stride = (anchor.attrs.get("strides") or (1, 1))[-1]
    span = ((y[-1] - 1) * stride + 1) * element_bytes
    return -(-span // SECTOR_BYTES) * SECTOR_BYTES / (y[-1] * element_bytes)


def per_channel(shape: Sequence[int] | None) -> bool:
    """A shape that broadcasts along the channels of an NCHW tensor alone (every dim but the
    channels 1, counted from the last: (C, 1, 1), (1, C, 1, 1), a scalar): a bias, a scale; such a
    tensor lies as in the model in every layout."""
    return shape is not None and len(shape) <= 4 and all(d == 1 for k, d in enumerate(shape[::-1]) if k != 2)


def nchwc_pointwise(graph: Graph, nodes: Collection[int], block: int) -> bool:
    """Whether an anchorless group has an NCHWc form in blocks of `block` (`Schedule.layout_out`
    blocked, written by `codegen.cpu_conv_nchwc.nchwc_pointwise_loops`): over float32 4-D tensors,
    elementwise or broadcast ops whose operands are of their output's shape or per channel
    (`per_channel`), 2-D MaxPool/AveragePool, nearest Resize of the pixels, Concat along the
    channels where every input but the last fills whole blocks, and DepthToSpace (DCR) to whole
    blocks (each output block then comes from one input block, lane for lane): a pool, an
    activation, a residual Add + Relu, a YOLO neck's upsample and concat, a U-Net's upsampling
    shuffle (`canonicalize.conv_transpose_to_conv`) and concat between blocked convs."""
    members = [graph.nodes[i] for i in sorted(nodes)]
    outs = [graph.tensors[t] for n in members for t in n.outputs if t]
    if not outs or any(o.shape is None or len(o.shape) != 4 or o.dtype != "float32" or per_channel(o.shape)
                       for o in outs):
        return False
    return all(_nchwc_member(graph, n, block) for n in members)


def _nchwc_member(graph: Graph, n: Node, block: int) -> bool:
    """One node of `nchwc_pointwise`'s group (its outputs already checked 4-D float32)."""
    data = [graph.tensors[t] for t in (n.inputs[:1] if n.op_type == "Resize" else n.inputs) if t]
    if any(i.dtype != "float32" or i.shape is None for i in data):
        return False
    out = graph.tensors[n.outputs[0]].shape
    if n.op_type in ("MaxPool", "AveragePool"):
        return len(data[0].shape) == 4 and data[0].shape[:2] == out[:2]
    if n.op_type == "Resize":
        return n.attrs.get("mode", "nearest") == "nearest" and data[0].shape[:2] == out[:2]
    if n.op_type == "DepthToSpace":  # DCR: each output block is one input block, lane for lane
        return n.attrs.get("mode", "DCR") == "DCR" and out[1] % block == 0
    if n.op_type == "Concat":
        return (int(n.attrs.get("axis", 0)) % 4 == 1 and all(len(i.shape) == 4 for i in data)
                and all(i.shape[1] % block == 0 for i in data[:-1]))
    return (n.kind in (OpKind.ELEMWISE, OpKind.BROADCAST)
            and all(per_channel(i.shape) or tuple(i.shape) == tuple(out) for i in data))


def tensor_layouts(graph: Graph, anchor: Node | None, tensors: Collection[str], schedule: Schedule) -> dict[str, Layout]:
    """How each of a kernel's `tensors` lies in memory under its schedule: a conv's activation
    input in `layout_in`, its filters (and any anchor's: a chain's second conv, `anchor_chain`)
    as in the model; every other 4-D tensor that is not per channel (`per_channel`: a bias lies
    as in the model) in `layout_out`."""
    x = anchor.inputs[0] if anchor is not None else None

    def filters(t: str) -> bool:
        return any(graph.nodes[c].kind == OpKind.ANCHOR and t in graph.nodes[c].inputs[1:] for c in graph.consumers(t))

    def laid(t: str) -> Layout:
        shape = graph.tensors[t].shape
        if t == x:
            return schedule.layout_in
        return (schedule.layout_out if shape is not None and len(shape) == 4 and not per_channel(shape)
                and not filters(t) else NCHW)
    return {t: laid(t) for t in tensors}


NCHWC_MAX_PIXELS = 14  # pixels of a tile at most (one filter vector's loads shared by as many FMAs)


def nchwc_pixels(block: int, blocks_out: int, depthwise: bool) -> int:
    """Output pixels an NCHWc conv's tile of `blocks_out` output-channel blocks holds in vector
    registers: up to 24 accumulators of AVX-512's 32 registers (block 16), 12 of AVX2's 16
    (block 8), the rest for filter vectors and inputs, at most NCHWC_MAX_PIXELS: 4 blocks x 6
    pixels, 2 x 12, 1 x 14 with block 16; 2 x 6 with block 8; a depthwise conv 8 (a filter vector
    and an input vector per pixel)."""
    if depthwise:
        return 8
    accumulators = 24 if block >= 16 else 12  # of 32 or 16 registers: the rest for filters and inputs
    return max(1, min(NCHWC_MAX_PIXELS, accumulators // blocks_out))


FMA_CHAINS = 8  # independent sums that keep a core's FMA units busy: latency 4 cycles x 2 units (x86 since Haswell)


def nchwc_chains(sums: int, lanes_in: int, last_lanes: int, depthwise: bool = False) -> int:
    """Chains of partial sums an NCHWc tile of `sums` accumulators (blocks x pixels) splits its
    work into (`codegen.cpu_conv_nchwc`), the chains summed once after the tile's taps. A tile
    of fewer sums than FMA_CHAINS waits on each FMA's latency (a border pixel's tile of 2 blocks
    x 1 pixel: two sums, a quarter of the units' rate). Dense: input lane ic + k adds into
    chain k, the most chains, a power of two, that keeps chains x sums within FMA_CHAINS and
    divides the lanes of every input block (`lanes_in`, the last block's `last_lanes`).
    Depthwise (`lanes_in` = `last_lanes` = the filter's rows): filter row kh adds into chain
    kh mod k, as many chains as rows but within AVX2's 12 accumulators (3 x 1-4 pixels, 2 x 5-6:
    a 7 x 7 conv's 5 interior pixels, 14 x 14's tiles of 6). 1 for a tile of FMA_CHAINS sums or
    more (the usual tiles)."""
    if depthwise:
        return max(1, min(lanes_in, 12 // sums)) if sums < FMA_CHAINS else 1
    k = 1
    while 2 * k * sums <= FMA_CHAINS and lanes_in % (2 * k) == 0 and last_lanes % (2 * k) == 0:
        k *= 2
    return k


NCHWC_SLICE_FLOATS = 8192  # filters a tile's pass over the input blocks streams at most (32 KiB: an L1 data cache)
NCHWC_PASS_BLOCKS = 8  # input blocks a pass reads at most: each a stream of its own (a block's pixels lie
# together, blocks a plane apart), so a tile's loads follow at most 8 streams at a time


def nchwc_chunk(block: int, blocks_out: int, lanes_in: int, taps: int) -> int:
    """Input blocks of a dense NCHWc conv's pass (`codegen.cpu_conv_nchwc`): the tile's filters
    for them (`blocks_out` x `block` outputs x `lanes_in` lanes x `taps` each) within
    NCHWC_SLICE_FLOATS and at most NCHWC_PASS_BLOCKS of them, at least one: the slice stays in
    the L1 cache across the work item's pixel tiles, the partial sums carried between passes in
    the item's buffer (a 3x3 conv at block 16 and 4 output blocks: one input block a pass, 36 KiB;
    a 1x1: 8, as at block 8 and 2 output blocks, whose slice alone would allow 64). A slice of 512
    KiB (L2: a 3x3 conv's whole K in one pass up to 64 channels) measured 0.97-1.04x: not taken;
    a 1x1 conv's passes of 64 blocks at block 8 measured 1.07-1.25x those of 8 on four of
    resnet50's 1x1 convs over 512-2048 channels, 0.98x (not distinguishable) on the fifth
    (`benchmarks/variants/nchwc_passes.py`)."""
    return max(1, min(NCHWC_PASS_BLOCKS, NCHWC_SLICE_FLOATS // (blocks_out * block * lanes_in * taps)))


def nchwc_interior(size: int, kernel: int, stride: int, pad: int, out: int) -> tuple[int, int]:
    """Along one axis of a conv (input `size`, `pad` before it, `out` outputs): the outputs lo..hi
    whose window lies inside the input; the others read the zero border."""
    lo = min(out, -(-pad // stride))
    return lo, max(lo, min(out, (size - kernel + pad) // stride + 1))


def nchwc_tile(block: int, depthwise: bool, blocks: int) -> int:
    """Output-channel blocks of an NCHWc conv's widest tile, of its `blocks` output blocks: 4 with
    block 16, 2 with 8 (3 x 4 pixels where the blocks are an odd multiple of 3: no tile of one
    block left over, mobilenetv2's 24-channel 1x1 convs 0.87x and 0.94x the time of 2 + 1; 3 on
    even counts measured 1.00-1.07x: not taken), 1 depthwise."""
    if depthwise:
        return 1
    if block >= 16:
        return 4
    return 3 if blocks % 2 and blocks % 3 == 0 else 2


NCHWC_COMPACT = True  # a strided 1x1 conv copies its blocks' pixels together first (`nchwc_compacts`)
NCHWC_RUN_PIXELS = 48  # pixels a block of output rows holds at least (whole rows): several tiles per block,
# so each slice of filters a tile streams serves them all


@dataclass(frozen=True)
class NchwcItems:
    """The work items an NCHWc conv's OpenMP loop shares among its threads
    (`codegen.cpu_conv_nchwc.nchwc_loops`): images x `blocks(T)` blocks of output rows x `tiles`
    tiles of `o_tile` output-channel blocks (the last tile `rest` blocks where they do not
    divide), item r = ((image, row block), tile) in that order, in contiguous shares (OpenMP's
    static schedule: each thread's rows stay together, its input rows read by it alone). The
    row blocks: `rows` rows each at least (a block's pixels serve each filter slice a tile
    streams), their count cut to a multiple of the T threads where there are T or more, their
    bounds OH - (count - k) x OH / count (sizes one apart, the larger first: the first thread,
    which opens the region, takes a row more where rows are left over, not the threads that wake
    to it): each thread's rows then differ by one at most (14 rows in blocks of 4 on two
    threads: 4, 3 | 4, 3, not 4, 4 | 4, 2)."""

    images: int
    out_rows: int
    row_pixels: int
    rows: int
    o_tile: int
    channel_blocks: int

    @property
    def least_blocks(self) -> int:
        """Row blocks of `rows` rows: the count before it is cut to the threads."""
        return -(-self.out_rows // self.rows)

    def blocks(self, threads: int) -> int:
        b0 = self.least_blocks
        return b0 - b0 % threads if b0 >= threads else b0

    def c_blocks(self, threads: str) -> str:
        """`blocks` as the C computes it from the team's size at run time (the C expression `threads`)."""
        b0 = self.least_blocks
        return f"{b0}LL >= {threads} ? {b0}LL - {b0}LL % {threads} : {b0}LL"

    def bounds(self, rb: int, blocks: int) -> tuple[int, int]:
        """Row block rb's output rows [lo, hi) of `blocks`: the larger blocks first."""
        oh = self.out_rows
        return oh - (blocks - rb) * oh // blocks, oh - (blocks - rb - 1) * oh // blocks

    def c_bounds(self, rb: str, blocks: str) -> tuple[str, str]:
        """`bounds` as C expressions of the row block `rb` and the count `blocks`."""
        oh = f"{self.out_rows}LL"
        return f"{oh} - ({blocks} - {rb}) * {oh} / {blocks}", f"{oh} - ({blocks} - {rb} - 1) * {oh} / {blocks}"

    @property
    def most_rows(self) -> int:
        """Rows of a block at most, at any thread count (a cut count keeps over half the blocks)."""
        return min(self.out_rows, 2 * self.rows) if self.least_blocks > 1 else self.out_rows

    @property
    def tiles(self) -> int:
        return -(-self.channel_blocks // self.o_tile)

    @property
    def rest(self) -> int:
        return self.channel_blocks % self.o_tile

    def count(self, threads: int) -> int:
        return self.images * self.blocks(threads) * self.tiles

    def work(self, r: int, threads: int) -> int:
        """Item r's output pixels x output-channel blocks at `threads` threads."""
        blocks = self.blocks(threads)
        rb, t = r // self.tiles % blocks, r % self.tiles
        lo, hi = self.bounds(rb, blocks)
        return (hi - lo) * self.row_pixels * (self.rest if self.rest and t == self.tiles - 1 else self.o_tile)

    def imbalance(self, threads: int) -> float:
        """The busiest thread's work over an even share (>= 1, `KernelSpec.imbalance`,
        `static_imbalance`); 1 at one thread."""
        if threads <= 1:
            return 1.0
        return static_imbalance([self.work(i, threads) for i in range(self.count(threads))], threads)


def static_imbalance(work: Sequence[float], threads: int) -> float:
    """The busiest thread's share of the items' `work` over an even share (>= 1): thread k of T
    takes the k-th contiguous share of the items, the first n mod T one item more, as OpenMP's
    static schedule deals them."""
    q, extra = divmod(len(work), threads)
    loads, r = [], 0
    for k in range(threads):
        take = q + (k < extra)
        loads.append(sum(work[r:r + take]))
        r += take
    return max(1.0, max(loads) * threads / sum(work))


def nchwc_compacts(block: int, depthwise: bool, in_shape: Sequence[int], window: tuple[int, int, int, int],
                   padded: bool) -> bool:
    """Whether an NCHWc conv copies each block of rows' input pixels together first (a thread's
    scratch, once per block of rows it takes; `codegen.cpu_conv_nchwc`) and runs as a 1x1 conv
    without a stride over them: a dense unpadded 1x1 conv with a stride over a blocked input
    (`nchwc_input`). Read in place, its tiles' pixels lie a stride apart, every other row skipped:
    half of each cache line used, the rows too far apart for the L2 to hold a block's input
    across its tiles (resnet18's three downsampling convs 0.41, 0.38 and 0.35 ms in its program,
    0.21, 0.19 and 0.18 ms over their input sliced first; `benchmarks/variants/nchwc_compact.py`)."""
    kh, kw, sh, sw = window
    return (NCHWC_COMPACT and not depthwise and not padded and (kh, kw) == (1, 1) and (sh, sw) != (1, 1)
            and in_shape[1] >= block)


def nchwc_items(block: int, depthwise: bool, in_shape: Sequence[int], out_shape: Sequence[int],
                window: tuple[int, int, int, int], padded: bool, channels: int | None = None) -> NchwcItems:
    """An NCHWc conv's work items (`NchwcItems`) from its input shape (N, C, H, W), output shape
    (N, O, OH, OW), window (kh, kw, sh, sw) and whether it pads: a dense tile holds `nchwc_tile`
    output blocks, a depthwise item all of them (one register tile per block in turn). A block
    of rows holds NCHWC_RUN_PIXELS pixels at least where a 1x1 unpadded conv's pixels run on
    across rows or the conv is dense, else one row (a depthwise window's rows); a dense conv
    whose filters outweigh an image's input (deep layers: 512 x 512 x 3 x 3 over 8 x 8 pixels)
    takes all its rows in one block, so each tile streams its filters once, not once per
    block (U-Net's 8 x 8 convs 0.75x the time); a strided 1x1 conv (`nchwc_compacts`) weighs
    the input it copies, its output's pixels. `channels`: the output channels padded to whole
    blocks (default: O rounded up)."""
    n, c, oh, ow = out_shape
    ocb = (channels if channels is not None else -(-c // block) * block) // block
    run = tuple(window) == (1, 1, 1, 1) and not padded
    rows = min(oh, -(-NCHWC_RUN_PIXELS // ow)) if run or not depthwise else 1
    filters = ocb * block * in_shape[1] * window[0] * window[1]
    read = in_shape[1] * oh * ow if nchwc_compacts(block, depthwise, in_shape, window, padded) else math.prod(in_shape[1:])
    if not depthwise and filters >= read:
        rows = oh
    o_tile = ocb if depthwise else min(nchwc_tile(block, depthwise, ocb), ocb)
    return NchwcItems(n, oh, ow, rows, o_tile, ocb)


TILE_EPILOGUE_LANES = 16  # the tile epilogue is written for AVX-512's 16 floats a vector (FS_TILE_EPI)
_TILE_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Erf", "Identity"})  # and views


def tile_epilogue(graph: Graph, nodes: Collection[int], anchor: Node, folded: Collection[int] = ()) -> bool:
    """Whether a MatMul/Gemm group's epilogue can run on our micro-kernel's registers before the one
    store (`fs_gemm_rows_epi`, the "own" product): the group's one output at the product's
    positions is computed from the product, plus at most a float32 bias row read as an input (a
    Gemm's C with beta 1, or the first Add), by Add, Sub, Mul, Div (with finite scalar constants or
    values so computed), Erf (a GELU), Identity and views (VIEW_OPS), at least one of them not an
    Add; no other output
    of the group is at the product's positions, and no row reduction runs after the anchor (one
    before it, a `row_prologue`, has computed the activation). (The product
    alone, or plus a bias, is stored in place instead.) `folded`: ops packed into the product
    (`scaled_product`), which run nothing: read through as views."""
    if anchor.op_type not in ("MatMul", "Gemm") or any(
            graph.nodes[i].kind == OpKind.REDUCE and graph.reaches(anchor.id, i) for i in nodes):
        return False
    y = anchor.outputs[0]
    yshape = graph.tensors[y].shape

    def row(t: str) -> bool:  # a float32 input along N: a bias row
        info = graph.tensors[t]
        return (graph.producer(t) not in nodes and info.dtype == "float32" and info.shape is not None
                and tuple(info.shape[-1:]) == tuple(yshape[-1:]) and math.prod(info.shape[:-1]) == 1)

    def scalar(t: str) -> bool:
        c = graph.constant_value(t)
        return c is not None and c.size == 1 and bool(np.isfinite(c).all())

    bias = anchor.op_type == "Gemm" and len(anchor.inputs) > 2 and bool(anchor.inputs[2])
    if anchor.op_type == "Gemm" and (float(anchor.attrs.get("alpha", 1.0)) != 1.0 or bias and not (
            row(anchor.inputs[2]) and float(anchor.attrs.get("beta", 1.0)) == 1.0)):
        return False
    computed, after_bias, outs = {y}, False, []  # after_bias: an op that is not an Add (the product
    # plus terms alone is stored in place)
    for n in (graph.nodes[i] for i in sorted(nodes)):
        if not any(t in computed for t in n.inputs):
            continue
        view = n.op_type in VIEW_OPS or n.id in folded  # the same elements in the same order
        if not (view or n.op_type in _TILE_OPS) or any(
                graph.tensors[t].dtype != "float32" or (graph.tensors[t].size if view else graph.tensors[t].shape)
                != (graph.tensors[y].size if view else yshape) for t in n.outputs):
            return False
        others = [t for t in n.inputs[1:] if t not in computed] if view else [t for t in n.inputs if t not in computed]
        if (not bias and not after_bias and n.op_type == "Add" and n.inputs.count(y) == 1 and len(others) == 1
                and row(others[0])):
            bias = True  # the bias row, added by the micro-kernel
        elif view or all(scalar(t) for t in others):
            after_bias = after_bias or (n.op_type != "Add" and n.id not in folded)
        else:
            return False
        computed.update(n.outputs)
        outs += [t for t in n.outputs if graph.is_output(t) or any(c not in nodes for c in graph.consumers(t))]
    return after_bias and len(outs) == 1 and not (graph.is_output(y) or any(c not in nodes for c in graph.consumers(y)))


def epilogues(graph: Graph, nodes: Collection[int], anchor: Node, product: str, lanes: int) -> tuple[str, ...]:
    """Where a group's epilogue runs (`Schedule.epilogue`), the default first: "tile" (on the
    micro-kernel's registers, `tile_epilogue`, where the target's vectors hold TILE_EPILOGUE_LANES
    floats) then "block" (a pass over the block's product in cache); "" where there is no choice
    (another product, or an epilogue the registers cannot run)."""
    scaled = scaled_product(graph, nodes, anchor, product)
    if product != "own" or lanes < TILE_EPILOGUE_LANES or not tile_epilogue(
            graph, nodes, anchor, scaled.nodes if scaled is not None else ()):
        return ("",)
    return ("tile", "block")


@dataclass(frozen=True)
class CpuTarget:
    """What the C backend builds a CPU kernel with, as lowering lists its products: `blas`, whether
    it links a BLAS (the "blas" and "im2col" products exist only then; the C backend links
    scipy-openblas32, a dependency, unless FUSESEARCH_NO_BLAS turns it off, so a source that
    calls the BLAS still carries its per-row loops under `#else`); `lanes`, the float32 lanes of
    the machine's vectors (the device's `warp_size` on a CPU, read from its flags: 16 with
    AVX-512, where the tile epilogue exists; 0 where unknown); `threads`, the OpenMP threads the
    plan is priced for (the device's `sm_count` on a CPU: its usable CPUs, capped by
    OMP_NUM_THREADS), which `cpu_splits` and `split_imbalance` share the work among."""

    blas: bool = True
    lanes: int = 0
    threads: int = 1

    @property
    def channel_block(self) -> int:
        """The NCHWc block this target's kernels use (`layout.channel_block` of its lanes; 0: none)."""
        return channel_block(self.lanes)


def cpu_products(graph: Graph, nodes: Collection[int], anchor: Node, target: CpuTarget = CpuTarget(),
                 row_epilogue: bool = False) -> tuple[str, ...]:
    """The C products of a gemm/conv group on a CPU, the default first: a MatMul/Gemm's
    (`gemm_products`), a conv's (`conv_products`); under a row epilogue (a Softmax) a conv is
    computed inline by the row loops ("loops"); any other anchor (a ConvTranspose) by loops."""
    if anchor.op_type in ("MatMul", "Gemm"):
        return gemm_products(graph, anchor, target.blas)
    if anchor.op_type != "Conv" or row_epilogue:
        return ("loops",)
    return conv_products(graph, nodes, anchor, target.blas)


# -- the thread split: how a CPU gemm's OpenMP threads share its output ---------------------------

SPLIT_TILE_ROWS = 12  # "tiles" keeps a row block at least this tall: 2 FS_MR, the AVX-512 tile's rows
SPLIT_COL_ALIGN = 32  # a column block starts at a multiple of 2 FS_NR (a pair of packed B panels)


def gemm_blocks_dims(graph: Graph, anchor: Node) -> tuple[int, int, int]:
    """(batches, M, N) of a MatMul/Gemm's output as the C blocks it: its leading dims, the rows of
    one batch, the columns."""
    y = graph.tensors[anchor.outputs[0]].shape
    return math.prod(y[:-2]), (y[-2] if len(y) > 1 else 1), y[-1]


def split_row_limit(split: str, m: int) -> int:
    """The most row blocks per batch a split makes of M rows ("rows": M, "tiles": one per
    SPLIT_TILE_ROWS rows, "cols": 1); the C writes it as a constant."""
    return {"rows": m, "tiles": max(1, m // SPLIT_TILE_ROWS), "cols": 1}[split]


def split_blocks(split: str, batches: int, m: int, n: int, threads: int) -> tuple[int, int, int, int]:
    """(row blocks per batch, rows per block, column blocks, columns per block) of a gemm's C at
    `threads` threads, as its C computes them at run time (`codegen.cpu_gemm._blas_blocks`): each
    batch gets p = ceil(threads / batches) blocks; "rows" makes them all row blocks (p, at most M);
    "tiles" and "cols" take r row blocks, the largest divisor of p within `split_row_limit`, and
    ceil(p / r) column blocks, each a multiple of SPLIT_COL_ALIGN columns; rows then columns are
    evened out (a short last block costs as much as a full one). The BLAS's cap on a block's
    product (`cpu_gemm.BLAS_TILE_FLOATS`, which adds row blocks past 8 MiB) is left out."""
    p = math.ceil(threads / max(1, batches))
    rows, cols = p, 1
    if split != "rows":
        rows = min(p, split_row_limit(split, m))
        while p % rows:
            rows -= 1
        cols = math.ceil(p / rows)
    mb = math.ceil(m / rows)
    rows = math.ceil(m / mb)
    mb = math.ceil(m / rows)
    nb = n if split == "rows" else math.ceil(math.ceil(n / cols) / SPLIT_COL_ALIGN) * SPLIT_COL_ALIGN
    return rows, mb, math.ceil(n / nb), min(nb, n)


def cpu_tile(lanes: int) -> tuple[int, int]:
    """The rows x columns our micro-kernel computes at once: 12 x 32 with AVX-512 (two FS_MR-row
    panels times two FS_NR-column B panels), else CPU_MICRO_TILE."""
    return (2 * CPU_MICRO_TILE[0], 2 * CPU_MICRO_TILE[1]) if lanes >= TILE_EPILOGUE_LANES else CPU_MICRO_TILE


def split_imbalance(split: str, batches: int, m: int, n: int, target: CpuTarget) -> float:
    """How much longer a gemm's product runs than its work shared evenly among the target's
    threads (>= 1; the cost model divides the product's rate by it, `KernelSpec.imbalance`). With
    (R, mb, C, nb) = `split_blocks`, T threads, the micro-kernel's tile (tr, tc) = `cpu_tile`, and a
    block's work counted in whole tiles, w(r, c) = ceil(r / tr) tr x ceil(c / tc) tc:

        busiest = ceil(batches R C / T) x w(mb, nb)      (OpenMP's static schedule: whole blocks)
        even    = batches x w(M, N) / T
        imbalance = max(1, busiest / even)

    so fewer blocks than threads, blocks below the tile (16 threads over 96 rows: blocks of 6, half
    a 12-row tile) and uneven block counts all pay; at one thread it is 1."""
    threads = max(1, target.threads)
    rows, mb, cols, nb = split_blocks(split, batches, m, n, threads)
    tr, tc = cpu_tile(target.lanes)

    def work(r: int, c: int) -> int:
        return math.ceil(r / tr) * tr * math.ceil(c / tc) * tc

    busiest = math.ceil(batches * rows * cols / threads) * work(mb, nb)
    return max(1.0, busiest * threads / (batches * work(m, n)))


def cpu_splits(graph: Graph, nodes: Collection[int], anchor: Node, product: str, target: CpuTarget,
               row_epilogue: bool = False) -> tuple[str, ...]:
    """The thread splits of a gemm/conv group's C (`Schedule.split`), "rows" (the default) first:
    a MatMul/Gemm whose product is ours or the BLAS's, with no row epilogue and a 2-D float32
    constant B (packed once, or read in place: a column block reads its slice), also "tiles" and
    "cols" where they make other blocks than the earlier ones at the target's threads; every
    other group "rows" alone (its blocks of rows, or of output rows of a conv). A split that makes
    the blocks of an earlier one is left out (over fewer than 24 rows "tiles" is "cols")."""
    b = graph.tensors[anchor.inputs[1]] if len(anchor.inputs) > 1 else None
    if (product not in ("own", "blas") or anchor.op_type not in ("MatMul", "Gemm") or row_epilogue or b is None
            or not b.constant or b.dtype != "float32" or b.shape is None or len(b.shape) != 2
            or graph.producer(anchor.inputs[1]) in nodes):
        return ("rows",)
    batches, m, n = gemm_blocks_dims(graph, anchor)
    seen: dict[tuple[int, int], str] = {}
    for split in CPU_SPLITS:
        rows, _, cols, _ = split_blocks(split, batches, m, n, max(1, target.threads))
        seen.setdefault((rows, cols), split)
    return tuple(seen.values())


def one_thread_forms(schedules: Sequence[Schedule], target: CpuTarget) -> tuple[int, ...]:
    """Which of a group's CPU choices also run as their one-thread form (split ONE_THREAD, the
    kernel's region `num_threads(1)`), by index: at a target of more than one thread, each
    generated choice of the default split ("" or "rows": at one thread every split is one block, so
    one form per product and epilogue). Priced as such (`KernelSpec.cpu_threads`: one thread's
    share of the rates, the region's cost at one thread), it wins where a kernel's work is below
    what a parallel region's fork and barrier cost; at one thread there are none (nothing changes)."""
    if target.threads <= 1:
        return ()
    return tuple(i for i, s in enumerate(schedules) if s.impl == "generated" and s.split in ("", "rows"))


@dataclass(frozen=True)
class GeluChain:
    """GELU before its 0.5 as four ops of a group, x (1 + erf(x / sqrt 2)): `x`, and the ids of
    the scale (x times sqrt(1/2), or divided by sqrt 2), the Erf and the + 1."""

    x: str
    scale: int
    erf: int
    add: int


def gelu_chains(graph: Graph, nodes: Collection[int]) -> dict[int, GeluChain]:
    """Each GELU's four ops in the group, by the id of its last Mul (x times 1 + erf): float32, one
    shape, any operand order, every inner value read by the next op alone (no output). The
    generator writes each as one call (C `fs_gelu2f`: erf's fit with the scale in its
    coefficients, the + 1 and the product one FMA; CUDA the same FMA over erff) and lowering prices
    it so: the scale and the + 1 run no op, the Erf its transcendental, the Mul one op."""
    return {i: chain for i in sorted(nodes) if (chain := _gelu_at(graph, nodes, graph.nodes[i])) is not None}


def _gelu_at(graph: Graph, nodes: Collection[int], node: Node) -> GeluChain | None:
    """The GELU chain `node` ends (`gelu_chains`), or None."""
    out = graph.tensors[node.outputs[0]] if node.outputs else None
    if node.op_type != "Mul" or len(node.inputs) != 2 or out is None or out.dtype != "float32":
        return None

    def inner(t: str, *ops: str) -> Node | None:  # t's producer, one of ops, read by the next op alone
        p = graph.producer(t)
        if (p is None or p not in nodes or len(graph.consumers(t)) != 1 or graph.is_output(t)
                or graph.tensors[t].shape != out.shape or graph.nodes[p].op_type not in ops):
            return None
        return graph.nodes[p]

    def constant(t: str, value: float) -> bool:
        c = graph.constant_value(t)
        return c is not None and c.size == 1 and math.isclose(float(c.reshape(-1)[0]), value, rel_tol=1e-6)

    for x, b in (node.inputs, node.inputs[::-1]):
        add = inner(b, "Add")
        for y, one in (add.inputs, add.inputs[::-1]) if add is not None and len(add.inputs) == 2 else ():
            erf = inner(y, "Erf") if constant(one, 1.0) else None
            scale = inner(erf.inputs[0], "Mul", "Div") if erf is not None else None
            if scale is None or len(scale.inputs) != 2 or x not in scale.inputs:
                continue
            if (scale.inputs[0] == x and constant(scale.inputs[1], math.sqrt(2)) if scale.op_type == "Div"
                    else constant(scale.inputs[1 - scale.inputs.index(x)], math.sqrt(0.5))):
                return GeluChain(x, scale.id, erf.id, add.id)
    return None


def stride_blocks(elements: int) -> int:
    """Blocks of a grid-stride loop: one element per thread, capped (the loop covers the rest)."""
    return max(1, min(-(-elements // THREADS), MAX_STRIDE_BLOCKS))


def grid_stride(elements: int) -> Schedule:
    return Schedule("generated", "grid-stride", "cuda-core", grid=(stride_blocks(elements), 1, 1))


def thread_layout(tm: int, tn: int) -> tuple[int, int] | None:
    """(RX, RY) threads along N and M of a tiled kernel: RX·RY = min(THREADS, tm·tn), each
    dividing its side of the tile; None when no layout exists."""
    total = min(THREADS, tm * tn)
    for rx in (16, 32, 64, 128, 256, 8, 4, 2, 1):
        if rx <= tn and total % rx == 0 and total // rx <= tm and tm % (total // rx) == 0 and tn % rx == 0:
            return rx, total // rx
    return None


# -- which skeleton applies --------------------------------------------------------------------

def has_gemm_view(graph: Graph, anchor: Node) -> bool:
    """The anchor is z independent GEMMs the tiled skeleton can stage (MatMul with both operands
    at least 2-D, Gemm, Conv); ConvTranspose and 1-D MatMul operands are not."""
    if anchor.op_type == "MatMul":
        return all(len(graph.tensors[t].shape) >= 2 for t in anchor.inputs[:2])
    return anchor.op_type in ("Gemm", "Conv")


def anchor_derived(graph: Graph, nodes: Sequence[int], anchor: Node) -> set[str] | None:
    """Tensors of the group computed from the anchor's output at the same flat position (through
    elementwise/broadcast ops and views of equal size), or None when some epilogue op remaps
    positions (a Transpose, a Softmax...): the tiled skeleton then does not apply."""
    y = anchor.outputs[0]
    size = graph.tensors[y].size
    derived = {y}
    for i in nodes:
        n = graph.nodes[i]
        if i == anchor.id or not any(t in derived for t in n.inputs):
            continue
        same = all(graph.tensors[t].size == size for t in n.outputs if t) and all(
            graph.tensors[t].size == size for t in n.inputs if t in derived)
        if not same or not (n.kind in (OpKind.ELEMWISE, OpKind.BROADCAST) or n.op_type in VIEW_OPS):
            return None
        derived.update(t for t in n.outputs if t)
    return derived


def tensor_core_skeleton(graph: Graph, anchor: Node) -> str | None:
    """The tensor-core skeleton for the anchor's operands (`mma-tf32` for float32 while the graph
    allows TF32, `mma-f16`, `mma-bf16`), None when their dtype has none; whether a tile applies at
    all (`has_gemm_view`, `anchor_derived`) is asked apart."""
    dtypes = {graph.tensors[t].dtype for t in anchor.inputs[:2]}
    skeleton = MMA_SKELETONS.get(dtypes.pop()) if len(dtypes) == 1 else None
    return None if skeleton == "mma-tf32" and not graph.allow_tf32 else skeleton


# -- tiles: every configuration a GEMM view can run as, the library-style default first --------

def _default_first(tiles: Sequence[tuple[int, int]], m: int, n: int) -> tuple[tuple[int, int, int], ...]:
    """The tiles as (BM, BN, TILE_K), the default first: the largest that still gives TARGET_BLOCKS
    output tiles (as a library's heuristic picks), else the smallest; the rest in table order."""
    default = next((t for t in tiles if math.ceil(m / t[0]) * math.ceil(n / t[1]) >= TARGET_BLOCKS), tiles[-1])
    return tuple((tm, tn, TILE_K) for tm, tn in (default, *(t for t in tiles if t != default)))


def gemm_tiles(m: int, n: int) -> tuple[tuple[int, int, int], ...]:
    """CUDA-core block tiles (BM, BN, BK) for an M x N output, the default first (`_default_first`);
    a skinny M (GEMV-like, under SKINNY_M) first has its own tile, M rounded up to a power of two,
    and then every tile it has at SKINNY_M rows (a skinny GEMM can always run as a taller one, so
    none prices above the same GEMM at SKINNY_M rows)."""
    if m < SKINNY_M:
        tm = 1 << max(0, (m - 1).bit_length())
        skinny = (tm, 128 if n >= 128 else max(32, 1 << max(0, (n - 1).bit_length())), TILE_K)
        return (skinny, *_default_first(TILE_CHOICES, SKINNY_M, n))
    return _default_first(TILE_CHOICES, m, n)


def library_tiles(m: int, n: int) -> tuple[tuple[int, int, int], ...]:
    """The tiles a GPU library call (its heuristic's kernel) is priced at, the cheaper taken:
    `gemm_tiles`'s default, and at a skinny M also the default at SKINNY_M rows (the kernel the
    library runs for a taller GEMM serves a skinnier one too)."""
    tiles = gemm_tiles(m, n)
    return tiles[:2] if m < SKINNY_M else tiles[:1]


def mma_tiles(m: int, n: int) -> tuple[tuple[int, int, int], ...]:
    """Tensor-core block tiles (BM, BN, BK) of MMA_TILES, the default first (`_default_first`)."""
    return _default_first(MMA_TILES, m, n)


def split_k(m: int, n: int, k: int, tile: tuple[int, ...]) -> int:
    """K split across blocks (as cuBLAS / CUTLASS split-K) when the output has fewer tiles than
    TARGET_BLOCKS, keeping at least 4 K-steps per block; the library's (a generated kernel splits
    K only on mma.sync tiles: `mma_sync_split`)."""
    tm, tn, tk = tile
    return _split(math.ceil(m / tm) * math.ceil(n / tn), k, tk)


def split_choices(split: int) -> tuple[int, ...]:
    """The K splits priced for a GEMM whose rule (`split_k`, `mma_sync_split`) gives `split`: it,
    then every power of two below it down to 1 (unsplit), so the cost model weighs the partials'
    round trip against the blocks each split adds; powers of two, so the output of half the rows
    can run as many blocks at twice the split (it never prices above the taller one for want
    of a split)."""
    return (split, *(1 << i for i in reversed(range((split - 1).bit_length())) if 1 << i < split))


def split_k_workspace(split: int, outputs: int) -> int:
    """Bytes of split-K's fp32 partial sums for `outputs` real output elements (z x M x N, no
    tile padding): each of `split` splits writes its partial of every element once, the reduction
    reads each back once (the price counts both); 0 unsplit. The mma.sync kernel's workspace is
    exactly this (its splits store only the rows and columns inside the output); a library call's
    split-K is assumed to keep its partials at the real extent too."""
    return split * outputs * 4 if split > 1 else 0


def _split(tiles: int, k: int, tk: int) -> int:
    """Splits of K for an output of `tiles` tiles: enough for TARGET_BLOCKS blocks, at least 4
    K steps of `tk` each; 1 where the tiles alone reach TARGET_BLOCKS."""
    tiles = max(1, tiles)
    if tiles >= TARGET_BLOCKS:
        return 1
    return max(1, min(math.ceil(TARGET_BLOCKS / tiles), k // (4 * tk)))


def mma_pad(element_bytes: int) -> int:
    """Elements of padding after each staged row (MMA_PAD_BYTES)."""
    return MMA_PAD_BYTES // element_bytes


def mma_smem_bytes(tile: tuple[int, ...], stages: int, element_bytes: int) -> int:
    """Shared memory of the tensor-core skeleton, exactly what it declares: per stage an A and a B
    buffer of (rows + pad) x (columns + pad) elements (either operand layout fits), and the float
    accumulator tile (BM x (BN + pad)) the epilogue reads, in the same bytes after the main loop."""
    tm, tn, tk = tile
    pad = mma_pad(element_bytes)
    staged = stages * ((tm + pad) * (tk + pad) + (tk + pad) * (tn + pad)) * element_bytes
    return max(staged, tm * (tn + mma_pad(4)) * 4)


def mma(skeleton: str, tile: tuple[int, int, int], stages: int, grid: tuple[int, ...]) -> Schedule:
    return Schedule("generated", skeleton, "tensor-core", tile, stages=stages, threads=MMA_THREADS, grid=grid,
                    smem_bytes=mma_smem_bytes(tile, stages, MMA_ELEMENT_BYTES[skeleton]))


def mma_sync_k(element_bytes: int) -> int:
    """BK of an mma.sync tile: MMA_SYNC_ROW_BYTES of K per staged row (32 halves, 16 floats)."""
    return MMA_SYNC_ROW_BYTES // element_bytes


def mma_sync_tiles(m: int, n: int) -> tuple[tuple[int, ...], ...]:
    """The mma.sync configurations (BM, BN, WM, WN, stages) for an M x N output, the default first:
    the largest block tile that still gives TARGET_BLOCKS output tiles (`_default_first`'s rule),
    else the smallest; the rest in table order."""
    default = next((t for t in MMA_SYNC_TILES if math.ceil(m / t[0]) * math.ceil(n / t[1]) >= TARGET_BLOCKS),
                   MMA_SYNC_TILES[-1])
    return (default, *(t for t in MMA_SYNC_TILES if t != default))


def shape_class(m: int, n: int) -> str:
    """The shape class of an M x N output (per batch or group) in the tuned tile table
    (`costmodels.kernel.SHAPE_CLASSES`): "skinny" under 2 x SKINNY_M rows, "small" under TARGET_BLOCKS output tiles
    of 128 x 128, else "large"."""
    if m < 2 * SKINNY_M:
        return "skinny"
    return "small" if math.ceil(m / 128) * math.ceil(n / 128) < TARGET_BLOCKS else "large"


def tuned_configurations(skeleton: str) -> tuple[tuple[int, ...], ...]:
    """Every configuration a tensor-core skeleton can be tuned to: the wmma tiles (BM, BN) of
    MMA_TILES, the mma.sync configurations (BM, BN, WM, WN, stages) of MMA_SYNC_TILES."""
    if skeleton in MMA_SYNC_SKELETONS.values():
        return MMA_SYNC_TILES
    return MMA_TILES if skeleton in MMA_SKELETONS.values() else ()


def tuned_table_problem(rows: Sequence[tuple[str, str, tuple[int, ...]]]) -> str:
    """Why a tuned tile table cannot be used ('' when it can): a row whose skeleton is not a
    tensor-core skeleton, or whose configuration is not one of its skeleton's."""
    for skeleton, cls, config in rows:
        if tuple(config) not in tuned_configurations(skeleton):
            known = ", ".join(str(list(c)) for c in tuned_configurations(skeleton)) or "none: not a tensor-core skeleton"
            return f"{skeleton} / {cls}: configuration {list(config)} is not one of {skeleton}'s ({known})"
    return ""


def tuned_choice(rows: Sequence[tuple[str, str, tuple[int, ...]]], skeleton: str, m: int, n: int) -> tuple[int, ...] | None:
    """The tuned table's configuration for the skeleton at an M x N output's shape class, or None
    (no row: the cost model chooses among them all)."""
    cls = shape_class(m, n)
    return next((tuple(config) for s, c, config in rows if s == skeleton and c == cls), None)


def mma_sync_threads(tile: Sequence[int], warp: Sequence[int]) -> int:
    """Threads of an mma.sync block: a warp per WM x WN share of the BM x BN tile."""
    return (tile[0] // warp[0]) * (tile[1] // warp[1]) * 32


def mma_sync_smem_bytes(tile: Sequence[int], stages: int, element_bytes: int) -> int:
    """Shared memory of an mma.sync kernel, exactly what it asks for: per stage A (BM x BK) and B
    (BN x BK) as the operand type, XOR-swizzled in place (no padding); the epilogue runs on the
    accumulators, so nothing more."""
    tm, tn, tk = tile
    return stages * (tm + tn) * tk * element_bytes


def mma_sync(skeleton: str, config: Sequence[int], m: int, n: int, z: int = 1, split: int = 1) -> Schedule:
    """The schedule of an mma.sync configuration (BM, BN, WM, WN, stages) of MMA_SYNC_TILES over z
    M x N outputs (grid: output tiles along N, M, z), K split `split` ways (grid z times `split`,
    the partials `split_k_workspace`)."""
    tm, tn, wm, wn, stages = config
    tile = (tm, tn, mma_sync_k(MMA_ELEMENT_BYTES[skeleton]))
    return Schedule("generated", skeleton, "tensor-core", tile, warp=(wm, wn), stages=stages, split_k=split,
                    threads=mma_sync_threads(tile, (wm, wn)), grid=(math.ceil(n / tn), math.ceil(m / tm), z * split),
                    smem_bytes=mma_sync_smem_bytes(tile, stages, MMA_ELEMENT_BYTES[skeleton]),
                    workspace_bytes=split_k_workspace(split, z * m * n))


def mma_sync_split(m: int, n: int, k: int, tile: Sequence[int], z: int = 1) -> int:
    """K split of an mma.sync tile where its z x M x N output has fewer tiles than TARGET_BLOCKS
    (`split_k`'s rule: up to TARGET_BLOCKS blocks, at least 4 K steps per split); 1 elsewhere."""
    tm, tn, tk = tile
    return _split(z * math.ceil(m / tm) * math.ceil(n / tn), k, tk)


def vectorizable(graph: Graph, nodes: Sequence[int], inputs: Sequence[str], outputs: Sequence[str]) -> bool:
    """float4 applies: elementwise/broadcast ops only, float32 outputs of one shape S with
    |S| % 4 == 0, and at least one float32 input of shape S (loaded as float4)."""
    if not outputs:
        return False
    shape = graph.tensors[outputs[0]].shape
    size = math.prod(shape)
    if size == 0 or size % VECTOR:
        return False
    if any(graph.tensors[t].shape != shape or graph.tensors[t].dtype != "float32" for t in outputs):
        return False
    if any(graph.nodes[i].kind not in (OpKind.ELEMWISE, OpKind.BROADCAST) for i in nodes):
        return False
    return any(graph.tensors[t].shape == shape and graph.tensors[t].dtype == "float32" for t in inputs)


# -- row kernels ------------------------------------------------------------------------------

_CACHES_INPUT = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "GlobalAveragePool", "Softmax", "LogSoftmax",
                           "LayerNormalization", "MeanVarianceNormalization", "InstanceNormalization",
                           "ReduceLogSumExp", "GlobalMaxPool", "ReduceLogSum"})
"""Row ops whose first pass reads the input row itself (not a term of it), so a computed input's
row can be kept for the later passes."""
_TWO_PASSES = frozenset({"Softmax", "LogSoftmax", "LayerNormalization", "MeanVarianceNormalization",
                         "InstanceNormalization", "ReduceLogSumExp"})
ARG_OPS = frozenset({"ArgMax", "ArgMin", "Hardmax"})  # a row kernel combines their (value, index) pairs


def exp_row(softmax_output: str) -> str:
    """The key of a Softmax's cached row of exponentials."""
    return softmax_output + "#exp"


def row_cache(graph: Graph, nodes: Sequence[int], length: int) -> tuple[str, ...]:
    """The rows a CUDA row kernel keeps in shared memory, in order, while all of them fit in
    MAX_ROW_SMEM: a computed reduction input (its producer is in the group) that two or more
    passes read, cached on the first; a Softmax's exponentials where the Softmax's output is
    written (its store then reads them back)."""
    members = set(nodes)
    reduces = [graph.nodes[i] for i in nodes if graph.nodes[i].kind == OpKind.REDUCE]
    passes: dict[str, int] = {}
    for n in reduces:
        if n.op_type in _CACHES_INPUT and graph.producer(n.inputs[0]) in members:
            passes[n.inputs[0]] = passes.get(n.inputs[0], 0) + (2 if n.op_type in _TWO_PASSES else 1)
    cached: list[str] = []
    for n in reduces:
        keys = [n.inputs[0]] if passes.get(n.inputs[0], 0) >= 2 else []
        y = n.outputs[0]
        if n.op_type == "Softmax" and (graph.is_output(y) or any(c not in members for c in graph.consumers(y))):
            keys.append(exp_row(y))
        for key in keys:
            if key not in cached and 4 * row_floats(length) * (len(cached) + 1) <= MAX_ROW_SMEM:
                cached.append(key)
    return tuple(cached)


def row_floats(length: int) -> int:
    """Floats of one row cached in shared memory: the row's length rounded up to SMEM_ALIGN bytes,
    so the kernel's shared memory stays a multiple of it (the generator declares this many)."""
    return -(-length // (SMEM_ALIGN // 4)) * (SMEM_ALIGN // 4)


def row_smem(graph: Graph, nodes: Sequence[int], cache: Sequence[str], length: int) -> int:
    """Shared memory of a row kernel: its cached rows (`row_floats` each), the block reduction's
    partials (any pass that sums or maximizes), ArgMax/ArgMin's block combine."""
    ops = {graph.nodes[i].op_type for i in nodes if graph.nodes[i].kind == OpKind.REDUCE}
    return (4 * row_floats(length) * len(cache) + (ROW_REDUCE_SMEM if ops - ARG_OPS else 0)
            + (ARGBEST_SMEM if ops & ARG_OPS else 0))


def block_per_row(graph: Graph, nodes: Sequence[int], rows: int, length: int,
                  tile: tuple[int, ...] = ()) -> Schedule:
    cache = row_cache(graph, nodes, length)
    return Schedule("generated", "block-per-row", "cuda-core", tile, grid=(max(1, min(rows, MAX_GRID_X)), 1, 1),
                    smem_bytes=row_smem(graph, nodes, cache, length), row_cache=cache)


_MOMENT_OPS = frozenset({"LayerNormalization", "MeanVarianceNormalization", "InstanceNormalization"})
"""Row ops whose mean and variance the C row kernel computes (`rowwise._moments`)."""


def variance_pairs(graph: Graph, nodes: Sequence[int]) -> dict[int, int]:
    """Mean node -> variance node of each decomposed row variance in `nodes` (LayerNorm as exported:
    M = ReduceMean(X), D = Sub(X, M), P = Pow(D, 2) or Mul(D, D), V = ReduceMean(P)), all four in
    the group, D and P of X's shape and V of M's (the same rows)."""
    members = set(nodes)
    pairs: dict[int, int] = {}
    for i in nodes:
        v = graph.nodes[i]
        p = graph.producer(v.inputs[0]) if v.op_type == "ReduceMean" and v.inputs else None
        if p not in members:
            continue
        square = graph.nodes[p]
        d = square.inputs[0]
        if square.op_type == "Pow":
            exponent = graph.constant_value(square.inputs[1])
            if exponent is None or exponent.size != 1 or float(exponent.reshape(-1)[0]) != 2.0:
                continue
        elif square.op_type != "Mul" or square.inputs[1] != d:
            continue
        sub = graph.producer(d)
        if sub not in members or graph.nodes[sub].op_type != "Sub":
            continue
        x, m = graph.nodes[sub].inputs[:2]
        mean = graph.producer(m)
        if mean not in members or graph.nodes[mean].op_type != "ReduceMean" or graph.nodes[mean].inputs[0] != x:
            continue
        shape = graph.tensors[x].shape
        if (graph.tensors[d].shape == shape and graph.tensors[square.outputs[0]].shape == shape
                and graph.tensors[m].shape == graph.tensors[v.outputs[0]].shape and mean not in pairs):
            pairs[mean] = v.id
    return pairs


def one_pass_moments(graph: Graph, nodes: Sequence[int]) -> bool:
    """A C row kernel computes its rows' statistics in one pass over each row: where the group holds
    a row variance (`variance_pairs`, or a LayerNormalization, MeanVarianceNormalization or
    InstanceNormalization), the mean's pass also sums the squares, both about the row's first
    element (a shift that keeps E[d^2] - E[d]^2 from cancelling where the mean is large against
    the spread; ONNX Runtime's CPU LayerNorm sums x and x^2 unshifted), so the variance needs no
    second pass over the row and x - mean is never stored for it."""
    return bool(variance_pairs(graph, nodes)) or any(graph.nodes[i].op_type in _MOMENT_OPS for i in nodes)


def row_prologue(graph: Graph, nodes: Sequence[int], anchor: Node) -> tuple[int, ...]:
    """The nodes of a C gemm group's row prologue: where a row reduction runs before the anchor (a
    LayerNorm in front of a projection), every node of the group but the anchor and the nodes it
    reaches, in order: a row kernel (`rowwise`) over them computes the activation the product's
    blocks read, stored first or per block (`prologue_forms`; `lowering` checks the rows are the
    activation's); () where no reduction runs before the anchor."""
    before = tuple(i for i in nodes if i != anchor.id and not graph.reaches(anchor.id, i))
    return before if any(graph.nodes[i].kind == OpKind.REDUCE for i in before) else ()


def _escapes(graph: Graph, nodes: Collection[int], t: str) -> bool:
    return graph.is_output(t) or any(c not in nodes for c in graph.consumers(t))


def prologue_forms(graph: Graph, nodes: Sequence[int], anchor: Node) -> tuple[str, ...]:
    """How a C gemm group's row prologue (`row_prologue`) reaches its product (`Schedule.prologue`),
    the default first; () without one. "stored" where the activation is also an output of the
    group (a residual reads BERT's normalised rows): the rows, all of them, are normalised and
    stored first, then the product's blocks read them back. "packed": each block of output rows
    computes its own rows (moments in one pass, then normalised) into its A panel, in its own
    thread, no pass over all rows and no barrier before the blocks: the output's rows where the
    activation is an output (one store, read back at once), else the block's scratch, never
    stored (GPT-2's and ViT's pre-LN projections: the normalised rows' write and read and a
    kernel saved). Both move the same bytes at one block of rows (priced alike: the stored form,
    the measured default, first); a packed prologue that stores an output runs with the "rows"
    split alone (`prologue_splits`), and recomputes its rows per column block otherwise."""
    if not row_prologue(graph, nodes, anchor):
        return ()
    return ("stored", "packed") if _escapes(graph, nodes, anchor.inputs[0]) else ("packed",)


def prologue_splits(graph: Graph, nodes: Sequence[int], anchor: Node, form: str, splits: Sequence[str]) -> tuple[str, ...]:
    """The thread splits a row prologue's form runs with: a packed one recomputes its rows per
    column block (lowering prices it), so where its rows store an output (the activation, or any
    other tensor the prologue computes) only "rows" (one column block: each row stored by one
    thread); every other form all of `splits`."""
    stores = any(_escapes(graph, nodes, t) for i in row_prologue(graph, nodes, anchor) for t in graph.nodes[i].outputs if t)
    return tuple(s for s in splits if form != "packed" or s == "rows" or not stores)
