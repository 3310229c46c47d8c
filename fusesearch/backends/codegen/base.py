"""Shared leaf of the code generator: C types, kernel arguments, the result type, the refusal.

Problem: every skeleton needs the same types, argument lists, half-precision conversions and a C
function wrapper, written once.
Approach: `c_function` joins a C kernel's body to `c_runtime.C_HEADER` with loop invariants hoisted
(`hoist`). Half precision is storage only, arithmetic float32: `load_expr` widens, `store_expr` /
`store` round to nearest even; `half_prelude` defines the types and conversions (C: `_Float16`,
`uint16_t` bits for bfloat16; CUDA: `unsigned short` via `cvt` PTX or bit manipulation, as NVRTC's
pip package ships no cuda_fp16.h; FS_HOST_HALF in the emulator). Every skeleton calls these; a
float32-only kernel's source does not change.
Invariants: imports of the generator only its C text leaves (`c_prelude`, `c_gemm`, `c_runtime`,
`hoist`); a dtype has a C type here or is refused (`CodegenRefused`, carrying a `FusionDecision`)."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace

import ml_dtypes
import numpy as np

from fusesearch.backends.codegen import c_prelude
from fusesearch.backends.codegen.c_gemm import FS_NR
from fusesearch.backends.codegen.c_prelude import (
    _MINMAX_OFF,
    _MINMAX_ON,
    _WIDE_OFF,
    _WIDE_ON,
    MINMAX_OPS,
    SCRATCH_SLOTS,
    WIDE_OPS,
)
from fusesearch.backends.codegen.c_runtime import C_HEADER
from fusesearch.backends.codegen.hoist import hoist_loop_invariants
from fusesearch.groups import FusionDecision
from fusesearch.layout import NCHW, Layout

CTYPES = {"float32": "float", "int64": "long long", "int32": "int", "bool": "unsigned char",
          "float16": "fs_half", "bfloat16": "fs_bfloat16"}  # storage types (pointers, arguments)
NP_DTYPES = {"float32": np.float32, "int64": np.int64, "int32": np.int32, "bool": np.bool_,  # same keys
             "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
HALF_DTYPES = ("float16", "bfloat16")
SUPPORTED_TEMPLATES = ("pointwise", "rowwise", "gemm", "conv", "conv_disjoint", "depthwise")


class CodegenRefused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.decision = FusionDecision.refuse(reason)


@dataclass(frozen=True)
class Arg:
    name: str  # C identifier: in0, in1, ..., out0, ...
    tensor: str
    shape: tuple[int, ...]  # as it lies (`layout.shape` of the tensor's)
    dtype: str
    layout: Layout = NCHW  # how it lies (`schedule.tensor_layouts`): a program stores it so

    @property
    def ctype(self) -> str:
        return CTYPES[self.dtype]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GeneratedKernel:
    name: str
    template: str
    inputs: tuple[Arg, ...]
    outputs: tuple[Arg, ...]
    c_source: str
    cuda_source: str
    rows: int = 0  # rowwise: rows and row length
    row_length: int = 0
    source_hash: str = field(default="")
    grid: tuple[int, int, int] = (1, 1, 1)  # the CUDA launch (CuPy and the emulator use it as is)
    block: tuple[int, int, int] = (256, 1, 1)
    skeleton: str = ""  # CUDA: grid-stride | vectorized | block-per-row | tiled | mma[-sync]-tf32/f16/bf16 | direct;
    # CPU only (`cuda_source` empty): packed
    packed: tuple[PackedWeight, ...] = ()  # C: weights the kernel reads packed (after its outputs)
    # C: translation units the kernel links besides the runtime, each compiled once into a shared
    # library of its own whatever kernels link it (a tile epilogue's tile kernels: `c_runtime.tile_kernels`)
    c_units: tuple[str, ...] = ()
    # CUDA: bytes of dynamic shared memory the launch asks for (`extern __shared__`; the mma.sync
    # skeletons, whose stages pass the 48 KiB of static shared memory), 0 for the others
    dynamic_smem: int = 0
    # C: the OpenMP team its region runs with (`Schedule.cpu_threads`, as `c_function` writes it):
    # 0 the caller's, whose members a program's segment calls in one region (`<name>_team`); 1 one thread
    c_threads: int = 0

    def with_c_source(self, c_source: str, c_units: tuple[str, ...] | None = None) -> GeneratedKernel:
        """The same kernel with another C source, and other C units where given (an edit of this
        one: `benchmarks/ab_group.py`), hashed as `generate` hashes a source."""
        units = self.c_units if c_units is None else c_units
        return replace(self, c_source=c_source, c_units=units, source_hash=source_digest(c_source, self.cuda_source, units))


def source_digest(c_source: str, cuda_source: str, c_units: tuple[str, ...] = ()) -> str:
    """A generated kernel's `source_hash`: its sources and C units (the compile caches' key)."""
    return hashlib.sha256("\0".join((c_source, cuda_source, *c_units)).encode()).hexdigest()


@dataclass(frozen=True)
class PackedWeight:
    """A constant float32 operand (a weight) that a C kernel reads as B panels (`fs_pack_b`)
    made once, before its first call, by the kernel's `<name>_pack(inputs..., packed...)`; the
    kernel takes them after its outputs. `groups` matrices, each K x N, element (k, n) of group g
    at source[g * group_stride + k * sk + n * sn]."""
    arg: Arg  # pk<i>: tensor = the weight, shape = (floats,)
    source: str  # the weight's input argument (in<j>)
    k: int
    n: int
    sk: int
    sn: int
    groups: int = 1
    group_stride: int = 0
    scale: float = 1.0  # the product's scalar scale, multiplied in as it is packed (`schedule.folded_scale`)

    @property
    def group_floats(self) -> int:
        return -(-self.n // FS_NR) * FS_NR * self.k

    def pack_call(self) -> str:
        """The C statement packing every group (in `<name>_pack`), each element times the scale."""
        return (f"for (long long g = 0; g < {self.groups}LL; ++g) fs_pack_b({self.k}LL, {self.n}LL, "
                f"{self.source} + g * {self.group_stride}LL, {self.sk}LL, {self.sn}LL, {_lit(self.scale)}, "
                f"{self.arg.name} + g * {self.group_floats}LL);")


@dataclass(frozen=True)
class NchwcFilter:
    """A Conv's constant float32 filters (C_out, C_in/group, KH, KW) packed once for an NCHWc
    kernel (`cpu_conv_nchwc`), by its `<name>_pack` as `PackedWeight`s are, in the order its
    micro-kernel reads them: dense, per tile of `tile` output blocks (the last tile the blocks
    left), input block and tap a `lanes_in` x (tile x `block`) panel (input lane major, then the
    tile's output blocks, output lane contiguous: per input lane the tile's filter vectors side by
    side; `lanes_in` is the block, or every input channel where the input lies in NCHW);
    depthwise (`depthwise`), per channel block and tap one vector. Padded channels hold zero
    filters."""
    arg: Arg  # pk<i>: tensor = the filters, shape = (floats,)
    source: str  # the filters' input argument (in<j>)
    cout: int
    cin: int
    taps: int  # KH x KW
    block: int
    depthwise: bool
    lanes_in: int
    tile: int = 1  # output blocks per tile (dense)

    def pack_call(self) -> str:
        """The C loops packing the filters (padded channels zero)."""
        b, t, li = self.block, self.taps, self.lanes_in
        ob = -(-self.cout // b)
        if self.depthwise:
            return (f"for (long long q = 0; q < {ob * t * b}LL; ++q) {{ long long c = q / {t * b}LL * {b}LL + q % {b}LL, "
                    f"k = q / {b}LL % {t}LL; {self.arg.name}[q] = c < {self.cout}LL ? {self.source}[c * {t}LL + k] : 0.0f; }}")
        ib, step = -(-self.cin // li), self.tile
        return (f"for (long long q = 0; q < {ob * ib * t * li * b}LL; ++q) {{ "
                f"long long o0 = q / {ib * t * li * b * step}LL * {step}LL, "
                f"o = {ob}LL - o0 < {step}LL ? {ob}LL - o0 : {step}LL, r = q - o0 * {ib * t * li * b}LL, "
                f"co = (o0 + r / {b}LL % o) * {b}LL + q % {b}LL, "
                f"ci = r / (o * {t * li * b}LL) * {li}LL + r / (o * {b}LL) % {li}LL, k = r / (o * {li * b}LL) % {t}LL; "
                f"{self.arg.name}[q] = co < {self.cout}LL && ci < {self.cin}LL ? "
                f"{self.source}[(co * {self.cin}LL + ci) * {t}LL + k] : 0.0f; }}")


def require_cuda(kernel: GeneratedKernel) -> str:
    """The kernel's CUDA source; ValueError naming the kernel where its schedule is a CPU one."""
    if not kernel.cuda_source:
        raise ValueError(f"{kernel.name}: its schedule ({kernel.skeleton}) is the CPU's and has no CUDA form; "
                         "plan for a GPU device to run it on one")
    return kernel.cuda_source


# -- half precision: storage only ------------------------------------------------------------

def compute_dtype(dtype: str) -> str:
    """The dtype arithmetic on values of `dtype` runs in: float32 for half, else the dtype."""
    return "float32" if dtype in HALF_DTYPES else dtype


def compute_ctype(dtype: str) -> str:
    """The C type of a temporary holding a value of `dtype` (float for half)."""
    return CTYPES[compute_dtype(dtype)]


def load_expr(dtype: str, ref: str) -> str:
    """`ref` (an lvalue of storage type `dtype`, e.g. `in0[i]`) as a value to compute with."""
    return f"fs_{dtype}_load({ref})" if dtype in HALF_DTYPES else ref


def store_expr(dtype: str, value: str) -> str:
    """A computed `value` as the storage type `dtype` (rounded to nearest even for half)."""
    return f"fs_{dtype}_store({value})" if dtype in HALF_DTYPES else value


def store(arg: Arg, index: str, value: str) -> str:
    """The statement writing `value` to `arg[index]`."""
    return f"{arg.name}[{index}] = {store_expr(arg.dtype, value)};"


def round_expr(dtype: str, value: str) -> str:
    """`value` rounded to `dtype` and widened again (a Cast to half inside a kernel)."""
    return load_expr(dtype, store_expr(dtype, value)) if dtype in HALF_DTYPES else value


_C_HALF = {
    "float16": ("typedef _Float16 fs_half;\n"
                "static inline float fs_float16_load(fs_half x) { return (float)x; }\n"
                "static inline fs_half fs_float16_store(float x) { return (fs_half)x; }\n"),
    "bfloat16": ("typedef uint16_t fs_bfloat16;\n"
                 "static inline float fs_bfloat16_load(fs_bfloat16 x) { union { uint32_t u; float f; } v; "
                 "v.u = (uint32_t)x << 16; return v.f; }\n"
                 "static inline fs_bfloat16 fs_bfloat16_store(float x) { union { float f; uint32_t u; } v; v.f = x;\n"
                 "    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (fs_bfloat16)((v.u >> 16) | 0x40u);\n"
                 "    v.u += 0x7fffu + ((v.u >> 16) & 1u); return (fs_bfloat16)(v.u >> 16); }\n"),
}
_CU_HALF = {
    "float16": ("typedef unsigned short fs_half;\n#ifndef FS_HOST_HALF\n"
                "__device__ __forceinline__ float fs_float16_load(fs_half x) { float f; "
                "asm(\"cvt.f32.f16 %0, %1;\" : \"=f\"(f) : \"h\"(x)); return f; }\n"
                "__device__ __forceinline__ fs_half fs_float16_store(float x) { fs_half h; "
                "asm(\"cvt.rn.f16.f32 %0, %1;\" : \"=h\"(h) : \"f\"(x)); return h; }\n#endif\n"),
    "bfloat16": ("typedef unsigned short fs_bfloat16;\n"
                 "__device__ __forceinline__ float fs_bfloat16_load(fs_bfloat16 x) { "
                 "return __int_as_float((int)((unsigned)x << 16)); }\n"
                 "__device__ __forceinline__ fs_bfloat16 fs_bfloat16_store(float x) { unsigned u = (unsigned)__float_as_int(x);\n"
                 "    if ((u & 0x7fffffffu) > 0x7f800000u) return (fs_bfloat16)((u >> 16) | 0x40u);\n"
                 "    u += 0x7fffu + ((u >> 16) & 1u); return (fs_bfloat16)(u >> 16); }\n"),
}


def half_prelude(dtypes, cuda: bool) -> str:
    """Definitions of the half storage types among `dtypes` and their load/store conversions
    ("" when there is none: float32 sources stay as they were)."""
    table = _CU_HALF if cuda else _C_HALF
    return "".join(table[d] for d in HALF_DTYPES if d in set(dtypes))


# -- the expression emitter -------------------------------------------------------------------

def _lit(value: float) -> str:
    if value != value:
        return "NAN"
    if value in (float("inf"), float("-inf")):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    return f"{float(value)!r}f".replace("e+", "e")


def _signature(ins, outs, restrict: str) -> str:
    params = [f"const {a.ctype}* {restrict} {a.name}" for a in ins]
    params += [f"{a.ctype}* {restrict} {a.name}" for a in outs]
    return ", ".join(params)


def cuda_entry(name: str, ins, outs) -> str:
    """A CUDA kernel's declaration, C linkage. No `__launch_bounds__`: with the block's threads as
    its bound ptxas capped registers and spilled in 7 zoo tiles (sm_80/sm_90), and with a minimum
    of one block it allocated up to 1.2x more registers than without; the launch the kernel assumes
    is checked in its strides instead (tests/backends/test_cuda_compile.py)."""
    return f'extern "C" __global__ void {name}({_signature(ins, outs, "__restrict__")})'


def streams(out: Arg) -> bool:
    """Whether the C loop writing `out` streams its stores (`fs_stream`)."""
    return out.dtype == "float32" and out.size * 4 >= c_prelude.STREAM_MIN_BYTES


def streamed_loop(out: Arg, base: str, extent: int, body: list[str], value: str, ahead: list[str]) -> list[str]:
    """`for j in [0, extent): out[base + j] = value` (after `body`) as STREAM_CHUNK-float chunks
    computed into an L1 buffer and streamed out (`fs_stream`), prefetching `ahead[k] + base + j`
    STREAM_AHEAD floats on; the enclosing parallel loop fences (`parallel_rows`)."""
    return ["{", "float fs_sbuf[FS_STREAM_CHUNK] __attribute__((aligned(64)));",
            f"for (long long j0 = 0; j0 < {extent}LL; j0 += FS_STREAM_CHUNK) {{",
            f"    long long jn = {extent}LL - j0 < FS_STREAM_CHUNK ? {extent}LL - j0 : FS_STREAM_CHUNK;",
            *[f"    fs_prefetch_ahead({p} + {base} + j0, jn);" for p in ahead],
            "    #pragma omp simd",
            "    for (long long jj = 0; jj < jn; ++jj) {",
            "        long long j = j0 + jj;",
            *["        " + x for x in body],
            f"        fs_sbuf[jj] = {value};",
            "    }",
            f"    fs_stream({out.name} + {base} + j0, fs_sbuf, jn);",
            "}", "}"]


# C: every loop a kernel shares among threads is a worksharing loop of the one parallel region the
# kernel's body runs in (`c_function`): one team per kernel call, not one per loop, with the loop's
# implicit barrier between a loop and the next that reads what it wrote.
OMP_FOR = "#pragma omp for schedule(static)"


def parallel_rows(var: str, rows: int, body: list[str], fence: bool) -> str:
    """`for (var in [0, rows)) body` shared among the kernel's OpenMP threads (static); `fence`:
    each thread fences its streamed stores once, after its last row (`fs_stream_fence`), before
    the barrier."""
    loop = [f"for (long long {var} = 0; {var} < {rows}LL; ++{var}) {{", *["    " + x for x in body], "}"]
    if not fence:
        return f"    {OMP_FOR}\n" + _indent(loop, 1)
    return (f"    {OMP_FOR} nowait\n" + _indent(loop, 1)
            + "\n    fs_stream_fence();\n    #pragma omp barrier")


def scratch(name: str, floats: str) -> str:
    """The C declaration of scratch buffer `name` (one of SCRATCH_SLOTS) of `floats` floats, the
    calling thread's own."""
    return f"float* {name} = fs_scratch({SCRATCH_SLOTS.index(name)}, sizeof(float) * ({floats}));"


def shared_scratch(name: str, floats: str) -> str:
    """The C declaration of scratch buffer `name` that every thread of the kernel's region shares
    (a materialized product: written by one loop, read by the next): one thread's buffer, its
    pointer copied to the others."""
    return (f"float* {name};\n    #pragma omp single copyprivate({name})\n    "
            f"{name} = fs_scratch({SCRATCH_SLOTS.index(name)}, sizeof(float) * ({floats}));")


def _c_param(ctype: str, a: Arg, named: bool) -> str:
    return f"{ctype}* restrict {a.name}" if named else f"{ctype}*"


def c_params(ins, outs, packed, named: bool = True) -> list[str]:
    """A C kernel's parameters: its inputs, outputs, then packed weights; `named`: with `restrict`
    and the argument names (the definition), else the types alone (a prototype)."""
    return ([_c_param(f"const {a.ctype}", a, named) for a in ins] + [_c_param(a.ctype, a, named) for a in outs]
            + [_c_param("const float", p.arg, named) for p in packed])


def c_pack_params(ins, packed, named: bool = True) -> list[str]:
    """The parameters of a C kernel's `<name>_pack`: its inputs, then the packed buffers it fills."""
    return [_c_param(f"const {a.ctype}", a, named) for a in ins] + [_c_param("float", p.arg, named) for p in packed]


def wide_kernel(ops, outs) -> bool:
    """Whether a C kernel is compiled for 512-bit vectors (`c_prelude._WIDE_ON`, where the core has
    them), decided from what it computes: one of its `ops` (the kernel's op types) evaluates erf,
    exp or vector math (`c_prelude.WIDE_OPS`), or one of its outputs `outs` is large enough to
    stream its stores (`streams`)."""
    return any(op in WIDE_OPS for op in ops) or any(streams(o) for o in outs)


def minmax_kernel(ops, blocked: bool) -> bool:
    """Whether a C kernel's Relu and Clip compile to vector min/max (`c_prelude._MINMAX_ON`):
    a blocked conv (`blocked`: its epilogue runs lane by lane over a tile's sums) whose `ops` are
    all in MINMAX_OPS, decided from its ops, never from its text."""
    return blocked and "Conv" in ops and all(op in MINMAX_OPS for op in ops)


def c_function(name: str, ins, outs, packed, body: str, defs: str = "", wide: bool = False, threads: int = 0,
               minmax: bool = False) -> str:
    """A C kernel's source: the runtime's header (`c_runtime.C_HEADER`: the inline helpers and the
    declarations of what the shared runtime defines, the packed GEMM included), `defs` (file-scope
    definitions of the kernel's own: a tile epilogue with the tile kernels it is inlined into,
    `tile_epilogue`), the kernel `name(inputs, outputs, packed weights)` running `body` (its loops'
    invariant temporaries hoisted: `hoist_loop_invariants`) in one OpenMP parallel region, whose
    worksharing loops (`OMP_FOR`) share the work — one team per call, as the cost model prices a
    host kernel's launch — and its `<name>_pack`. `wide` (the caller's decision, `wide_kernel`):
    the kernel compiled for 512-bit vectors. `threads`: the region's team as the schedule says
    (`Schedule.cpu_threads`): 0 the caller's threads, and the body is also `<name>_team`, run by
    every member of a region the caller opened (a program's segment: `run.Program.driver`), else
    `num_threads(threads)`. `minmax` (`minmax_kernel`): its min and max compiled as vector min/max."""
    body = hoist_loop_invariants(body)
    params = ", ".join(c_params(ins, outs, packed))
    args = ", ".join(a.name for a in (*ins, *outs, *(p.arg for p in packed)))
    team = f" num_threads({threads})" if threads else ""
    # a team kernel's body also runs as a member of its caller's team (`<name>_team`)
    member = "" if threads else f"void {name}_team({params}) {{\n    {name}_body({args});\n}}\n"
    src = (f"{C_HEADER}{defs}{_WIDE_ON if wide else ''}{_MINMAX_ON if minmax else ''}\n"
           f"static void {name}_body({params});\n"
           f"void {name}({params}) {{\n    #pragma omp parallel{team}\n    {name}_body({args});\n}}\n"
           f"{member}static void {name}_body({params}) {{\n{body}}}\n"
           f"{_MINMAX_OFF if minmax else ''}{_WIDE_OFF if wide else ''}")
    if packed:
        src += (f"void {name}_pack({', '.join(c_pack_params(ins, packed))}) {{\n"
                + "".join(f"    {p.pack_call()}\n" for p in packed) + "}\n")
    return src



def _indent(lines: list[str], depth: int) -> str:
    return "\n".join("    " * depth + line for line in lines)


def _flat_loop(body: list[str]) -> bool:
    """A loop body with no loop or OpenMP construct of its own (simd constructs do not nest)."""
    return not any(x.lstrip().startswith(("for ", "#pragma", "FS_SIMD")) for x in body)


