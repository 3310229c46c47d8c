"""Shared leaf of the code generator: C types, kernel arguments, the result type, the refusal, and
the C/CUDA preludes every skeleton starts with (the C one with its own vectorizable exp and erf),
and the packed GEMM a C kernel with packed weights includes: `fs_pack_b` (B in FS_NR-wide panels;
B stored transposed, as attention's keys are, by 8 x 8 AVX2 transposes: an element-wise gather
there cost 7% of a bert-small score kernel),
the FS_MR x FS_NR micro-kernel `fs_micro` (AVX-512, AVX2 + FMA or portable loops, by what the
compiler targets; A by two strides, the tile at a row stride, plus a tile or a row added at the
store where given) and, with AVX-512, the 6 or 12 x 32 tiles over two B panels (`fs_micro_x2`),
`fs_gemm_rows` (A by rows in place, C row-major, B's columns in blocks that stay in L2:
MatMul/Gemm) and `fs_gemm_packed` (A packed, C transposed: conv).

Half precision (float16, bfloat16) is a storage type only: arithmetic is float32. A half value is
widened where it is loaded (`load_expr`) and rounded to nearest even where it is stored
(`store_expr`, `store`); `half_prelude` defines the types and the four conversions a source uses:
C: `_Float16` for float16 (gcc's conversions), `uint16_t` bits for bfloat16; CUDA: 16-bit storage
(`unsigned short`; NVRTC's pip package ships no cuda_fp16.h) converted by `cvt` PTX for float16 and
by bit manipulation for bfloat16 (the CUDA emulator defines the float16 pair on the host, under
FS_HOST_HALF). Every skeleton (and any new one, such as a tensor-core tile loading half operands)
calls these; a float32-only kernel's source does not change.
Invariants: this module imports nothing else of the generator; a dtype has a C type here or is
refused (`CodegenRefused`, carrying a `FusionDecision`).
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field, replace

import ml_dtypes
import numpy as np

from fusesearch.candidates.decision import FusionDecision

CTYPES = {"float32": "float", "int64": "long long", "int32": "int", "bool": "unsigned char",
          "float16": "fs_half", "bfloat16": "fs_bfloat16"}  # storage types (pointers, arguments)
NP_DTYPES = {"float32": np.float32, "int64": np.int64, "int32": np.int32, "bool": np.bool_,  # same keys
             "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
HALF_DTYPES = ("float16", "bfloat16")
SUPPORTED_TEMPLATES = ("pointwise", "rowwise", "gemm", "conv")


class CodegenRefused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.decision = FusionDecision.refuse(reason)


@dataclass(frozen=True)
class Arg:
    name: str  # C identifier: in0, in1, ..., out0, ...
    tensor: str
    shape: tuple[int, ...]
    dtype: str

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
    skeleton: str = ""  # CUDA: grid-stride | vectorized | block-per-row | tiled | mma-tf32 | mma-f16 | mma-bf16 | direct;
    # CPU only (`cuda_source` empty): packed
    packed: tuple[PackedWeight, ...] = ()  # C: weights the kernel reads packed (after its outputs)

    def with_c_source(self, c_source: str) -> GeneratedKernel:
        """The same kernel with another C source (an edit of this one: `benchmarks/ab_group.py`),
        hashed as `generate` hashes a source."""
        return replace(self, c_source=c_source, source_hash=source_digest(c_source, self.cuda_source))


def source_digest(c_source: str, cuda_source: str) -> str:
    """A generated kernel's `source_hash`: its two sources (the compile caches' key)."""
    return hashlib.sha256((c_source + "\0" + cuda_source).encode()).hexdigest()


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
    scale: float = 1.0  # the product's scalar scale, folded in (`schedule.folded_scale`)

    @property
    def group_floats(self) -> int:
        return -(-self.n // FS_NR) * FS_NR * self.k

    def pack_call(self) -> str:
        """The C statement packing every group (in `<name>_pack`), scaled where a scale is folded."""
        call = (f"for (long long g = 0; g < {self.groups}LL; ++g) fs_pack_b({self.k}LL, {self.n}LL, "
                f"{self.source} + g * {self.group_stride}LL, {self.sk}LL, {self.sn}LL, {self.arg.name} + g * {self.group_floats}LL);")
        if self.scale == 1.0:
            return call
        return f"{call} for (long long i = 0; i < {self.arg.shape[0]}LL; ++i) {self.arg.name}[i] *= {_lit(self.scale)};"


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


# C: glibc's vector math (libmvec) under `omp simd` when the backend links it (FS_VECTOR_MATH), so
# loops with log/tanh/log1p/sin/cos vectorize; FS_SIMD_SUM marks a sum loop the compiler may
# reassociate; FS_FMAX/FS_FMIN are compare-selects in C (fmaxf does not vectorize; same result unless
# the second operand is NaN) and fmaxf/fminf in CUDA.
_VECTOR_MATH = ("logf", "tanhf", "log1pf", "sinf", "cosf")
# C: exp and erf are our own (`_C_MATH`), inline under `omp declare simd`, so a loop over them
# vectorizes with no call at all: libmvec's erff is table-driven and costs ~1 ns an element here (a
# GELU was compute-bound at 45% of the memory bandwidth) and its expf is a call per vector that
# spills every register of an unrolled row. CUDA keeps its own expf/erff. Against libm (a dense
# sample with tails, NaN and inf, test_codegen_cpu.py), with FMA: fs_expf within 1e-6 relative
# (4.2e-7 measured) for every normal result (x >= -87.33654), 0 below (libm's results there are
# subnormal), inf above 88.72283, NaN kept; fs_erff within 1e-6 relative (3.6e-7 measured), odd,
# never beyond +-1, exactly +-1 from |x| = 3.6174 on (where the fit first rounds to 1), NaN kept.
#   fs_expf: e^x = 2^n e^r, n = round(x log2 e) read from the bits of x log2 e + 1.5 * 2^23 (no
#   float-to-int conversion), r = x - n ln 2 in one FMA (ln 2 rounded to a float: at most
#   127 * 1.9e-9 off in r, 2.4e-7 relative in the result; the second, Cody-Waite step it replaces
#   cost 5-7% of a Softmax for 1.9e-7 instead of 4.2e-7 measured), e^r = 1 + r (1 + r p(r)), p a
#   cubic (a degree-5 minimax polynomial on [-ln2/2, ln2/2] in five FMAs), n added to the result's
#   exponent field; out-of-range inputs are selected afterwards, never clamped before (GCC threads
#   a clamp pair into many selects).
#   fs_expf_le: the same e^x for x <= 88 only (a Softmax's x - max(row), never above 0; Softplus's
#   -|x|): no overflow select, 2^n (a float while n <= 127) applied by a multiply instead of an
#   exponent add, its exponent field the low bits of x log2 e + 1.5 * 2^23 + 127 shifted into
#   place (n + 127: no add), so NaN of any payload stays NaN without a second select; equal to
#   fs_expf bit for bit there. Twelve vector operations per 16 floats where there were sixteen: a
#   scaled, masked Softmax 7-14% faster, a SiLU 5-19% (interleaved).
#   fs_erff: x P(x^2) / Q(x^2), P and Q of degree 5 (a relative minimax fit of erf on [0, 4]), x
#   clamped first to +-3.6174.
_C_MATH = """#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
#define FS_FMA(a, b, c) fmaf(a, b, c)
#else
#define FS_FMA(a, b, c) ((a) * (b) + (c))
#endif
static inline uint32_t fs_bits(float f) { union { float f; uint32_t i; } u = { .f = f }; return u.i; }
static inline float fs_float(uint32_t i) { union { uint32_t i; float f; } u = { .i = i }; return u.f; }
/* e^x's steps shared by fs_expf and fs_expf_le: t holds n = round(x log2 e) plus magic's low bits
   in its low bits, q = e^r for r = x - n ln 2 */
#define FS_EXP_STEPS(x, magic) \
    float t = FS_FMA(x, 1.4426950216293335f, (magic)); \
    float n = t - (magic); \
    float r = FS_FMA(n, -0.6931471824645996f, x); \
    float p = FS_FMA(FS_FMA(FS_FMA(0.008312525227665901f, r, 0.041890114545822144f), r, 0.16667114198207855f), r, \
                     0.499992311000824f); \
    float q = FS_FMA(FS_FMA(p, r, 1.0f), r, 1.0f)
#pragma omp declare simd notinbranch
static inline float fs_expf(float x) {
    FS_EXP_STEPS(x, 12582912.0f);
    float y = fs_float(fs_bits(q) + (fs_bits(t) << 23));
    y = x < -87.33654f ? 0.0f : y;
    return x <= 88.72283f ? y : x + INFINITY;
}
#pragma omp declare simd notinbranch
static inline float fs_expf_le(float x) {
    FS_EXP_STEPS(x, 12582912.0f + 127.0f);
    float y = q * fs_float(fs_bits(t) << 23);
    return x < -87.33654f ? 0.0f : y;
}
"""
# erf's fit (`fs_erff` above): the clamp and P's and Q's coefficients, highest degree first, in one
# place for the scalar function every C kernel may call and the AVX-512 one a tile epilogue calls
# (`fs_erf16`): the same operations in the same order, so the two agree bit for bit
ERF_CLAMP = "3.6173997f"
ERF_P = ("1.986772758755251e-06f", "0.00028456433210521936f", "0.0038833203725516796f", "0.05310166999697685f",
         "0.1935446709394455f", "1.1283791065216064f")
ERF_Q = ("3.7419991713250056e-05f", "0.0011855633929371834f", "0.015207204967737198f", "0.11534981429576874f",
         "0.504857063293457f", "1.0f")


def _horner(coefficients, fma, wrap: str = "") -> str:
    """c0 s^n + ... + cn by nested FMAs (`fma(a, b, c)` = a b + c), `wrap` around each constant."""
    expr = wrap.format(coefficients[0]) if wrap else coefficients[0]
    for c in coefficients[1:]:
        expr = fma(expr, "s", wrap.format(c) if wrap else c)
    return expr


def _erf_scalar() -> str:
    def fma(a, b, c):
        return f"FS_FMA({a}, {b}, {c})"

    p, q = _horner(ERF_P, fma), _horner(ERF_Q, fma)
    return ("#pragma omp declare simd notinbranch\nstatic inline float fs_erff(float x) {\n"
            f"    float t = fabsf(x) > {ERF_CLAMP} ? copysignf({ERF_CLAMP}, x) : x;\n    float s = t * t;\n"
            f"    float p = {p};\n    float q = {q};\n    return t * p / q;\n}}\n")


def _erf_avx512() -> str:
    def fma(a, b, c):
        return f"_mm512_fmadd_ps({a}, {b}, {c})"

    p, q = _horner(ERF_P, fma, "_mm512_set1_ps({})"), _horner(ERF_Q, fma, "_mm512_set1_ps({})")
    return ("/* fs_erff over 16 floats: x clamped by a max and a min, x their second operand, the one\n"
            "   vmaxps/vminps return where it is NaN (NaN kept, as in fs_erff) */\n"
            "static inline __m512 fs_erf16(__m512 x) {\n"
            f"    __m512 t = _mm512_min_ps(_mm512_set1_ps({ERF_CLAMP}), _mm512_max_ps(_mm512_set1_ps(-{ERF_CLAMP}), x));\n"
            "    __m512 s = _mm512_mul_ps(t, t);\n"
            f"    __m512 p = {p};\n    __m512 q = {q};\n"
            "    return _mm512_div_ps(_mm512_mul_ps(t, p), q);\n}\n")


_C_MATH += _erf_scalar()
# C: scratch buffers (a product's tile, a packed panel, an im2col patch) come from a per-thread
# arena kept between calls: one slot per buffer name, grown to the largest size asked, never
# freed. A malloc/free per call costs a page fault per 4 KiB each time glibc hands the memory back
# to the system (which MALLOC_TRIM_THRESHOLD_ or a large block makes it do); the arena costs
# nothing after the first call. Per thread, so OpenMP blocks never share one; a buffer the whole
# kernel shares (the materialized product) is taken by the calling thread before its parallel loops.
SCRATCH_SLOTS = ("ybuf", "wbuf", "patch", "cbuf", "abuf", "bbuf", "apk", "offs")
_C_SCRATCH = (f"static _Thread_local void* fs_slot[{len(SCRATCH_SLOTS)}];\n"
              f"static _Thread_local size_t fs_slot_bytes[{len(SCRATCH_SLOTS)}];\n"
              "static inline float* fs_scratch(int slot, size_t bytes) {\n"
              "    if (bytes > fs_slot_bytes[slot]) {\n"
              "        free(fs_slot[slot]);\n"
              "        size_t padded = (bytes + 63) / 64 * 64;\n"
              "        fs_slot[slot] = aligned_alloc(64, padded);\n"
              "        fs_slot_bytes[slot] = fs_slot[slot] ? padded : 0;\n"
              "        if (!fs_slot[slot]) abort();\n"
              "    }\n"
              "    return (float*)fs_slot[slot];\n"
              "}\n")


# C: streaming (non-temporal) stores for an output of at least STREAM_MIN_BYTES, beyond what a
# last-level cache holds for its consumer: a plain store reads each line before writing it (a
# third more traffic for an Add), so the loop computes STREAM_CHUNK floats into a buffer in L1 and
# `fs_stream` writes its whole 64-byte lines with `_mm512_stream_ps` / `_mm256_stream_ps` (the
# rest plain), prefetching the inputs read at the same flat index STREAM_AHEAD floats ahead
# (`__builtin_prefetch`). Each thread fences its streamed stores (`fs_stream_fence`) before the
# loop's barrier. On one Ice Lake core, a GELU over 48 MiB: 1.3x faster with 256-float chunks and
# the prefetch (72% of a memcpy's bandwidth against 55%), no faster with a whole 3072-float row
# buffered or without the prefetch. The host's DRAM figure is a copy through glibc's memcpy,
# which streams too, so such a kernel now moves what the roofline prices.
STREAM_MIN_BYTES = 16 * 2**20
STREAM_CHUNK = 256
STREAM_AHEAD = 1024
_C_STREAM = f"""#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif
enum {{ FS_STREAM_CHUNK = {STREAM_CHUNK}, FS_STREAM_AHEAD = {STREAM_AHEAD} }};
/* dst[0, n) = src[0, n): whole 64-byte lines of dst non-temporal, its partial first and last plain */
static inline void fs_stream(float* restrict dst, const float* restrict src, long long n) {{
    long long i = 0;
#if defined(__AVX512F__) || defined(__AVX__)
    long long head = (long long)(((64 - ((uintptr_t)dst & 63)) & 63) / sizeof(float));
    for (; i < head && i < n; ++i) dst[i] = src[i];
    if (((uintptr_t)(dst + i) & 63) == 0)
        for (; i + 16 <= n; i += 16) {{
#if defined(__AVX512F__)
            _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
#else
            _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
            _mm256_stream_ps(dst + i + 8, _mm256_loadu_ps(src + i + 8));
#endif
        }}
#endif
    for (; i < n; ++i) dst[i] = src[i];
}}
/* the n floats at p + FS_STREAM_AHEAD into the cache, a prefetch per 64-byte line */
static inline void fs_prefetch_ahead(const float* p, long long n) {{
    for (long long i = 0; i < n; i += 16) __builtin_prefetch(p + FS_STREAM_AHEAD + i);
}}
static inline void fs_stream_fence(void) {{
#if defined(__AVX512F__) || defined(__AVX__)
    _mm_sfence();
#endif
}}
"""


# C: a row reduction's last step folds its C_PARTIALS (32) partial results into one; under
# `omp simd reduction` GCC adds the last vector's lanes one after another without -ffast-math (16
# dependent adds a row at 512 bits), so the fold is a 256-bit tree (`fs_fold_sum`/`fs_fold_max`:
# the partials' four ymm, then halves): a Softmax over 128-float rows 17% faster in cache, a
# LayerNorm 3-7%. 256 bits at either vector width: a 512-bit load of partials the loop stored as two
# ymm waits for the stores to reach the cache (a LayerNorm 35% slower).
FOLDED = 32  # the partial results the fold takes (the C helpers' FS_FOLDED; a multiple of 8)


def _c_fold(name: str, op: str, init: str, step: str) -> str:
    """The C helper folding FS_FOLDED partials by `op` (`add`/`max`): four ymm then halves, or a
    plain loop of `step` (acc `s`, partial `p[q]`) without AVX."""
    return f"""static inline float {name}(const float* p) {{
#if defined(__AVX__)
    __m256 v = _mm256_loadu_ps(p);
    for (int q = 8; q < FS_FOLDED; q += 8) v = _mm256_{op}_ps(v, _mm256_loadu_ps(p + q));
    __m128 h = _mm_{op}_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_{op}_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_{op}_ss(h, _mm_movehdup_ps(h)));
#else
    float s = {init};
    for (int q = 0; q < FS_FOLDED; ++q) {step};
    return s;
#endif
}}
"""


_C_FOLD = (f"enum {{ FS_FOLDED = {FOLDED} }};  /* a multiple of 8 */\n"
           + _c_fold("fs_fold_sum", "add", "0.0f", "s += p[q]")
           + _c_fold("fs_fold_max", "max", "-INFINITY", "s = p[q] > s ? p[q] : s"))


# A kernel that streams, or whose loops evaluate erf, exp or a vector-math function, is compiled for
# 512-bit vectors where the core has them (GCC prefers 256 on Ice Lake): those loops are bound by
# the FMA ports, which do twice the work per instruction at 512 (a GELU over 48 MiB from 55% to 72%
# of a memcpy's bandwidth with the streamed stores; a GEMM's GELU epilogue over bert-small's 128x512
# 137 -> 127 us, erf alone over 128x512 31 -> 21 us). Light loops in cache stay at 256: an Add or a
# LayerNorm over 128 rows of 128 was 20-25% slower at 512 (measured; the halved instruction count
# does not pay for the core's 512-bit power level there).
_WIDE_ON = ('#if defined(__AVX512F__) && !defined(__clang__)\n#pragma GCC push_options\n'
            '#pragma GCC target("prefer-vector-width=512")\n#endif\n')
WIDE_CALLS = ("fs_erff", "fs_expf", "fs_expf_le", *_VECTOR_MATH)  # the calls that make a C kernel wide
_WIDE_OFF = "#if defined(__AVX512F__) && !defined(__clang__)\n#pragma GCC pop_options\n#endif\n"


def streams(out: Arg) -> bool:
    """Whether the C loop writing `out` streams its stores (`fs_stream`)."""
    return out.dtype == "float32" and out.size * 4 >= STREAM_MIN_BYTES


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


def parallel_rows(var: str, rows: int, body: list[str], fence: bool) -> str:
    """`for (var in [0, rows)) body` parallel over OpenMP threads (static); `fence`: each thread
    fences its streamed stores once, after its last row (`fs_stream_fence`)."""
    loop = [f"for (long long {var} = 0; {var} < {rows}LL; ++{var}) {{", *["    " + x for x in body], "}"]
    if not fence:
        return "    #pragma omp parallel for schedule(static)\n" + _indent(loop, 1)
    return ("    #pragma omp parallel\n    {\n        #pragma omp for schedule(static) nowait\n" + _indent(loop, 2)
            + "\n        fs_stream_fence();\n    }")


# C: the packed GEMM of a kernel whose weights are packed once (`PackedWeight`): C^T = (A B)^T with
# B a constant. `fs_pack_b` lays B (K x N, by strides) out as ceil(N/16) panels of K x 16 floats,
# zero padded, once, before the kernel's first call; `fs_gemm_packed` packs A (by strides: an
# im2col panel read transposed, pixels x taps) into panels of 6 rows, runs a 6 x 16 register tile
# per panel pair over all of K and stores each tile once, transposed (a conv's output channels x
# pixels, the layout the epilogue reads contiguously); partial tiles (M % 6, N % 16) store their
# part. The tile's branches, chosen by what the compiler targets (`-march=native`): AVX2 + FMA,
# twelve ymm accumulators, 12 FMAs per k against 2 loads and 6 broadcasts (the BLAS's own shape),
# the k loop unrolled 4 times (`#pragma GCC unroll`): the same best time, but medians on this
# shared VM 7-12% lower at every zoo GEMM shape (vit-small's 197x384x384 from 5% behind ONNX
# Runtime's MLAS to 3-5% ahead; `benchmarks/bench_cpu.py --sections 1b`);
# AVX-512, the same 6 x 16 tile (a row per zmm, two accumulator sets over even and odd k) where one
# B panel remains, and otherwise two B panels at once (`fs_micro_x2`: 6 or 12 rows x 32 columns,
# a zmm accumulator per row and panel, two loads and a broadcast per row for two FMAs; the 6 x 16
# tile needs a broadcast per FMA and is bound by the load ports): `fs_gemm_packed` and
# `fs_conv_band` run 12 x 32 over two A panels, `fs_gemm_rows` 12 x 32 down to the last M % 12
# rows in a tile of their own height (`fs_micro_rows2`), its k loop unrolled 8 times (4 left the
# loop at 60-70% of the FMA peak, 8 at about 93%, 12 x 32 in L1). On one Ice Lake Xeon core
# (AVX-512, 185 GFLOP/s FMA peak) this took `fs_gemm_rows` from 0.59x the BLAS (the 6 x 16 tile)
# to 1.15-1.31x (`--sections 1b`, geometric mean over the zoo's shapes, four runs), the band
# convs from 0.98-1.19x im2col + BLAS to 1.2-1.6x. Elsewhere the 6 x 16 tile in plain loops the compiler
# vectorizes. The AVX2 and AVX-512 branches have both run on hardware (a Zen 3 and an Ice Lake
# core); tests/backends/test_cpu_packed.py also runs the AVX-512 one with its intrinsics replaced
# by plain C, so that its indexing is checked on a CPU without AVX-512.

FS_NR = 16  # B panel width: packed floats = ceil(N / FS_NR) * FS_NR * K
FS_MR = 6  # rows of A per micro-kernel tile (FS_MR x FS_NR accumulators in registers)
_C_PACKED_GEMM = f"""#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif
enum {{ FS_MR = {FS_MR}, FS_NR = {FS_NR} }};
#if defined(__AVX2__)
/* dst[k * FS_NR + j] = src[j * sn + k] for an 8 x 8 block: eight rows of B^T in, eight panel rows out */
static inline void fs_transpose8(const float* src, long long sn, float* dst) {{
    __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + sn), r2 = _mm256_loadu_ps(src + 2 * sn);
    __m256 r3 = _mm256_loadu_ps(src + 3 * sn), r4 = _mm256_loadu_ps(src + 4 * sn), r5 = _mm256_loadu_ps(src + 5 * sn);
    __m256 r6 = _mm256_loadu_ps(src + 6 * sn), r7 = _mm256_loadu_ps(src + 7 * sn);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3);
    __m256 t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(dst, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(dst + FS_NR, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(dst + 2 * FS_NR, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(dst + 3 * FS_NR, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(dst + 4 * FS_NR, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(dst + 5 * FS_NR, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(dst + 6 * FS_NR, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(dst + 7 * FS_NR, _mm256_permute2f128_ps(u3, u7, 0x31));
}}
#endif
static void fs_pack_b(long long K, long long N, const float* B, long long sk, long long sn, float* Bp) {{
    for (long long n0 = 0; n0 < N; n0 += FS_NR) {{
        float* dst = Bp + n0 * K;
        long long nr = N - n0 < FS_NR ? N - n0 : FS_NR;
        long long k0 = 0;
#if defined(__AVX2__)
        if (sk == 1 && nr == FS_NR)  /* B stored transposed (attention's keys): 8 x 8 blocks */
            for (; k0 + 8 <= K; k0 += 8)
                for (long long j0 = 0; j0 < FS_NR; j0 += 8) fs_transpose8(B + k0 + (n0 + j0) * sn, sn, dst + k0 * FS_NR + j0);
#endif
        for (long long k = k0; k < K; ++k) {{
            long long j = 0;
            for (; j < nr; ++j) dst[k * FS_NR + j] = B[k * sk + (n0 + j) * sn];
            for (; j < FS_NR; ++j) dst[k * FS_NR + j] = 0.0f;
        }}
    }}
}}
/* tile[i * ldt + j] = sum_k a[i * as + k * ak] * b[k * FS_NR + j] over a FS_MR x FS_NR tile, plus
   r0[j] where r0 is given (a bias row), then plus c0[i * ldc0 + j] where c0 is given (the tile
   itself, a residual): A packed (as 1, ak FS_AP) or read in place by rows (as lda, ak 1) */
static inline void fs_micro(long long K, const float* a, long long as, long long ak, const float* b, float* tile,
                            long long ldt, const float* c0, long long ldc0, const float* r0) {{
    const float *a0 = a, *a1 = a + as, *a2 = a + 2 * as, *a3 = a + 3 * as, *a4 = a + 4 * as, *a5 = a + 5 * as;
#if defined(__AVX512F__)
    __m512 e0 = _mm512_setzero_ps(), e1 = _mm512_setzero_ps(), e2 = _mm512_setzero_ps(), e3 = _mm512_setzero_ps();
    __m512 e4 = _mm512_setzero_ps(), e5 = _mm512_setzero_ps(), o0 = _mm512_setzero_ps(), o1 = _mm512_setzero_ps();
    __m512 o2 = _mm512_setzero_ps(), o3 = _mm512_setzero_ps(), o4 = _mm512_setzero_ps(), o5 = _mm512_setzero_ps();
    long long k = 0, q = 0;
    for (; k + 1 < K; k += 2, q += 2 * ak, b += 2 * FS_NR) {{
        __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + FS_NR);
        long long r = q + ak;
        e0 = _mm512_fmadd_ps(_mm512_set1_ps(a0[q]), b0, e0); o0 = _mm512_fmadd_ps(_mm512_set1_ps(a0[r]), b1, o0);
        e1 = _mm512_fmadd_ps(_mm512_set1_ps(a1[q]), b0, e1); o1 = _mm512_fmadd_ps(_mm512_set1_ps(a1[r]), b1, o1);
        e2 = _mm512_fmadd_ps(_mm512_set1_ps(a2[q]), b0, e2); o2 = _mm512_fmadd_ps(_mm512_set1_ps(a2[r]), b1, o2);
        e3 = _mm512_fmadd_ps(_mm512_set1_ps(a3[q]), b0, e3); o3 = _mm512_fmadd_ps(_mm512_set1_ps(a3[r]), b1, o3);
        e4 = _mm512_fmadd_ps(_mm512_set1_ps(a4[q]), b0, e4); o4 = _mm512_fmadd_ps(_mm512_set1_ps(a4[r]), b1, o4);
        e5 = _mm512_fmadd_ps(_mm512_set1_ps(a5[q]), b0, e5); o5 = _mm512_fmadd_ps(_mm512_set1_ps(a5[r]), b1, o5);
    }}
    if (k < K) {{
        __m512 b0 = _mm512_loadu_ps(b);
        e0 = _mm512_fmadd_ps(_mm512_set1_ps(a0[q]), b0, e0); e1 = _mm512_fmadd_ps(_mm512_set1_ps(a1[q]), b0, e1);
        e2 = _mm512_fmadd_ps(_mm512_set1_ps(a2[q]), b0, e2); e3 = _mm512_fmadd_ps(_mm512_set1_ps(a3[q]), b0, e3);
        e4 = _mm512_fmadd_ps(_mm512_set1_ps(a4[q]), b0, e4); e5 = _mm512_fmadd_ps(_mm512_set1_ps(a5[q]), b0, e5);
    }}
    e0 = _mm512_add_ps(e0, o0); e1 = _mm512_add_ps(e1, o1); e2 = _mm512_add_ps(e2, o2);
    e3 = _mm512_add_ps(e3, o3); e4 = _mm512_add_ps(e4, o4); e5 = _mm512_add_ps(e5, o5);
    if (r0) {{
        __m512 r = _mm512_loadu_ps(r0);
        e0 = _mm512_add_ps(e0, r); e1 = _mm512_add_ps(e1, r); e2 = _mm512_add_ps(e2, r);
        e3 = _mm512_add_ps(e3, r); e4 = _mm512_add_ps(e4, r); e5 = _mm512_add_ps(e5, r);
    }}
    if (c0) {{
        e0 = _mm512_add_ps(e0, _mm512_loadu_ps(c0)); e1 = _mm512_add_ps(e1, _mm512_loadu_ps(c0 + ldc0));
        e2 = _mm512_add_ps(e2, _mm512_loadu_ps(c0 + 2 * ldc0)); e3 = _mm512_add_ps(e3, _mm512_loadu_ps(c0 + 3 * ldc0));
        e4 = _mm512_add_ps(e4, _mm512_loadu_ps(c0 + 4 * ldc0)); e5 = _mm512_add_ps(e5, _mm512_loadu_ps(c0 + 5 * ldc0));
    }}
    _mm512_storeu_ps(tile, e0); _mm512_storeu_ps(tile + ldt, e1); _mm512_storeu_ps(tile + 2 * ldt, e2);
    _mm512_storeu_ps(tile + 3 * ldt, e3); _mm512_storeu_ps(tile + 4 * ldt, e4); _mm512_storeu_ps(tile + 5 * ldt, e5);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps(), c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
    __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps(), c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
    __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps(), c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (long long k = 0, q = 0; k < K; ++k, q += ak, b += FS_NR) {{
        __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8), x;
        x = _mm256_broadcast_ss(a0 + q); c00 = _mm256_fmadd_ps(x, b0, c00); c01 = _mm256_fmadd_ps(x, b1, c01);
        x = _mm256_broadcast_ss(a1 + q); c10 = _mm256_fmadd_ps(x, b0, c10); c11 = _mm256_fmadd_ps(x, b1, c11);
        x = _mm256_broadcast_ss(a2 + q); c20 = _mm256_fmadd_ps(x, b0, c20); c21 = _mm256_fmadd_ps(x, b1, c21);
        x = _mm256_broadcast_ss(a3 + q); c30 = _mm256_fmadd_ps(x, b0, c30); c31 = _mm256_fmadd_ps(x, b1, c31);
        x = _mm256_broadcast_ss(a4 + q); c40 = _mm256_fmadd_ps(x, b0, c40); c41 = _mm256_fmadd_ps(x, b1, c41);
        x = _mm256_broadcast_ss(a5 + q); c50 = _mm256_fmadd_ps(x, b0, c50); c51 = _mm256_fmadd_ps(x, b1, c51);
    }}
    if (r0) {{
        __m256 r = _mm256_loadu_ps(r0), s = _mm256_loadu_ps(r0 + 8);
        c00 = _mm256_add_ps(c00, r); c01 = _mm256_add_ps(c01, s); c10 = _mm256_add_ps(c10, r); c11 = _mm256_add_ps(c11, s);
        c20 = _mm256_add_ps(c20, r); c21 = _mm256_add_ps(c21, s); c30 = _mm256_add_ps(c30, r); c31 = _mm256_add_ps(c31, s);
        c40 = _mm256_add_ps(c40, r); c41 = _mm256_add_ps(c41, s); c50 = _mm256_add_ps(c50, r); c51 = _mm256_add_ps(c51, s);
    }}
    if (c0) {{
        c00 = _mm256_add_ps(c00, _mm256_loadu_ps(c0)); c01 = _mm256_add_ps(c01, _mm256_loadu_ps(c0 + 8));
        c10 = _mm256_add_ps(c10, _mm256_loadu_ps(c0 + ldc0)); c11 = _mm256_add_ps(c11, _mm256_loadu_ps(c0 + ldc0 + 8));
        c20 = _mm256_add_ps(c20, _mm256_loadu_ps(c0 + 2 * ldc0)); c21 = _mm256_add_ps(c21, _mm256_loadu_ps(c0 + 2 * ldc0 + 8));
        c30 = _mm256_add_ps(c30, _mm256_loadu_ps(c0 + 3 * ldc0)); c31 = _mm256_add_ps(c31, _mm256_loadu_ps(c0 + 3 * ldc0 + 8));
        c40 = _mm256_add_ps(c40, _mm256_loadu_ps(c0 + 4 * ldc0)); c41 = _mm256_add_ps(c41, _mm256_loadu_ps(c0 + 4 * ldc0 + 8));
        c50 = _mm256_add_ps(c50, _mm256_loadu_ps(c0 + 5 * ldc0)); c51 = _mm256_add_ps(c51, _mm256_loadu_ps(c0 + 5 * ldc0 + 8));
    }}
    _mm256_storeu_ps(tile, c00); _mm256_storeu_ps(tile + 8, c01); _mm256_storeu_ps(tile + ldt, c10);
    _mm256_storeu_ps(tile + ldt + 8, c11); _mm256_storeu_ps(tile + 2 * ldt, c20); _mm256_storeu_ps(tile + 2 * ldt + 8, c21);
    _mm256_storeu_ps(tile + 3 * ldt, c30); _mm256_storeu_ps(tile + 3 * ldt + 8, c31); _mm256_storeu_ps(tile + 4 * ldt, c40);
    _mm256_storeu_ps(tile + 4 * ldt + 8, c41); _mm256_storeu_ps(tile + 5 * ldt, c50); _mm256_storeu_ps(tile + 5 * ldt + 8, c51);
#else
    const float* rows[FS_MR] = {{a0, a1, a2, a3, a4, a5}};
    float sum[FS_MR * FS_NR] = {{0.0f}};
    for (long long k = 0; k < K; ++k, b += FS_NR)
        for (int i = 0; i < FS_MR; ++i)
            for (int j = 0; j < FS_NR; ++j) sum[i * FS_NR + j] += rows[i][k * ak] * b[j];
    for (int i = 0; i < FS_MR; ++i)
        for (int j = 0; j < FS_NR; ++j)
            tile[i * ldt + j] = (sum[i * FS_NR + j] + (r0 ? r0[j] : 0.0f)) + (c0 ? c0[i * ldc0 + j] : 0.0f);
#endif
}}
/* FS_PANELS adjacent B micro-panels (b, b + FS_NR * K, ...) per tile. AVX-512: two, against 1 to
   2 FS_MR rows of A (`fs_micro_x2`, `fs_micro_rows2`): a zmm accumulator per row and panel (up to
   24), per k two loads and a broadcast per row for two FMAs (a single 16-wide panel needs a
   broadcast per FMA and is bound by the load ports); elsewhere one: `fs_micro` */
#if defined(__AVX512F__)
enum {{ FS_PANELS = 2, FS_AP = 2 * FS_MR }};
/* rows (1 to 2 FS_MR, a constant where inlined) of A, row i at a + i * as (ahi + (i - FS_MR)
   * as past FS_MR), moving by ak per k; the k loop unrolled 8 times: 4 left the inner loop at
   60-70% of the FMA peak, 8 at 93% (12 x 32 in L1, one Ice Lake core) */
static inline __attribute__((always_inline)) void fs_micro_x2(int rows, long long K, const float* a, const float* ahi,
        long long as, long long ak, const float* b, float* tile, long long ldt, const float* c0, long long ldc0,
        const float* r0, int epi) {{
    const float* b2 = b + FS_NR * K;
    __m512 x[2 * FS_MR], y[2 * FS_MR];
#pragma GCC unroll 12
    for (int i = 0; i < rows; ++i) x[i] = y[i] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (long long k = 0; k < K; ++k, a += ak, ahi += ak, b += FS_NR, b2 += FS_NR) {{
        __m512 u = _mm512_loadu_ps(b), v = _mm512_loadu_ps(b2);
#pragma GCC unroll 12
        for (int i = 0; i < rows; ++i) {{
            __m512 s = _mm512_set1_ps(i < FS_MR ? a[i * as] : ahi[(i - FS_MR) * as]);
            x[i] = _mm512_fmadd_ps(s, u, x[i]);
            y[i] = _mm512_fmadd_ps(s, v, y[i]);
        }}
    }}
    if (r0) {{
        __m512 r = _mm512_loadu_ps(r0), t = _mm512_loadu_ps(r0 + FS_NR);
#pragma GCC unroll 12
        for (int i = 0; i < rows; ++i) {{
            x[i] = _mm512_add_ps(x[i], r);
            y[i] = _mm512_add_ps(y[i], t);
        }}
    }}
    if (c0) {{
#pragma GCC unroll 12
        for (int i = 0; i < rows; ++i) {{
            x[i] = _mm512_add_ps(x[i], _mm512_loadu_ps(c0 + i * ldc0));
            y[i] = _mm512_add_ps(y[i], _mm512_loadu_ps(c0 + i * ldc0 + FS_NR));
        }}
    }}
#pragma GCC unroll 12
    for (int i = 0; i < rows; ++i) {{
#ifdef FS_TILE_EPI
        if (epi) {{
            x[i] = fs_tile_epi(x[i]);
            y[i] = fs_tile_epi(y[i]);
        }}
#endif
        _mm512_storeu_ps(tile + i * ldt, x[i]);
        _mm512_storeu_ps(tile + i * ldt + FS_NR, y[i]);
    }}
    (void)epi;
}}
/* any 1 to 2 FS_MR rows of A (row i at a + i * as, past FS_MR at ahi + (i - FS_MR) * as, moving by
   ak per k) times two B micro-panels, stored at tile (row stride ldt) plus r0 and c0: the
   constant row count `fs_micro_x2` is inlined with, chosen at run time (fs_gemm_rows' last
   M % (2 FS_MR) rows; a packed panel's 1 to 12 rows in fs_packed_panels) */
static void fs_micro_rows2(int rows, long long K, const float* a, const float* ahi, long long as, long long ak,
                           const float* b, float* tile, long long ldt, const float* c0, long long ldc0, const float* r0,
                           int epi) {{
    switch (rows) {{
    case 1: fs_micro_x2(1, K, a, ahi, as, ak, b, tile, ldt, c0, ldc0, r0, epi); break;
    case 2: fs_micro_x2(2, K, a, ahi, as, ak, b, tile, ldt, c0, ldc0, r0, epi); break;
    case 3: fs_micro_x2(3, K, a, ahi, as, ak, b, tile, ldt, c0, ldc0, r0, epi); break;
    case 4: fs_micro_x2(4, K, a, ahi, as, ak, b, tile, ldt, c0, ldc0, r0, epi); break;
    case 5: fs_micro_x2(5, K, a, ahi, as, ak, b, tile, ldt, c0, ldc0, r0, epi); break;
    case 6: fs_micro_x2(6, K, a, ahi, as, ak, b, tile, ldt, c0, ldc0, r0, epi); break;
    case 7: fs_micro_x2(7, K, a, ahi, as, ak, b, tile, ldt, c0, ldc0, r0, epi); break;
    case 8: fs_micro_x2(8, K, a, ahi, as, ak, b, tile, ldt, c0, ldc0, r0, epi); break;
    case 9: fs_micro_x2(9, K, a, ahi, as, ak, b, tile, ldt, c0, ldc0, r0, epi); break;
    case 10: fs_micro_x2(10, K, a, ahi, as, ak, b, tile, ldt, c0, ldc0, r0, epi); break;
    case 11: fs_micro_x2(11, K, a, ahi, as, ak, b, tile, ldt, c0, ldc0, r0, epi); break;
    default: fs_micro_x2(12, K, a, ahi, as, ak, b, tile, ldt, c0, ldc0, r0, epi); break;
    }}
}}
#else
enum {{ FS_PANELS = 1, FS_AP = FS_MR }};
#endif
/* C[n * ldc + i] = sum_k A[i][k] B[k][n] for M rows of A packed in FS_AP-row panels (ap: panel p
   at ap + p * FS_AP * K, its row i at k * FS_AP + i, zero padded or repeating its last row; 12
   rows with AVX-512, as many as a tile has, so packing a panel copies 12 floats per k, not 6
   twice) and N columns of B packed by fs_pack_b: per FS_PANELS B micro-panels (a last one past N
   zero padded), per A panel, one tile of its rows (a partial panel only its rows), stored
   transposed (a partial one its part) */
static void fs_packed_panels(long long M, long long N, long long K, const float* ap, const float* Bp, float* C,
                             long long ldc) {{
    float tile[FS_AP * FS_PANELS * FS_NR];
    for (long long n0 = 0; n0 < N; ) {{
        int panels = N - n0 > (FS_PANELS - 1) * FS_NR ? FS_PANELS : 1;
        long long nr = N - n0 < panels * FS_NR ? N - n0 : panels * FS_NR;
        for (long long i0 = 0; i0 < M; i0 += FS_AP) {{
            const float *a = ap + i0 * K, *b = Bp + n0 * K;
            long long mr = M - i0 < FS_AP ? M - i0 : FS_AP;
#if defined(__AVX512F__)
            if (panels == FS_PANELS) {{
                fs_micro_rows2((int)mr, K, a, a + FS_MR, 1, FS_AP, b, tile, FS_PANELS * FS_NR, 0, 0, 0, 0);
            }} else {{
                fs_micro(K, a, 1, FS_AP, b, tile, FS_PANELS * FS_NR, 0, 0, 0);
                if (mr > FS_MR) fs_micro(K, a + FS_MR, 1, FS_AP, b, tile + FS_MR * FS_PANELS * FS_NR, FS_PANELS * FS_NR, 0, 0, 0);
            }}
#else
            fs_micro(K, a, 1, FS_AP, b, tile, FS_PANELS * FS_NR, 0, 0, 0);
#endif
            float* c = C + n0 * ldc + i0;
            for (long long j = 0; j < nr; ++j)
                for (long long i = 0; i < mr; ++i) c[j * ldc + i] = tile[i * FS_PANELS * FS_NR + j];
        }}
        n0 += panels * FS_NR;
    }}
}}
/* the last R < FS_MR rows of A by rows (row stride as) times a packed B micro-panel: R x FS_NR
   sums into tile (row stride FS_NR), R FMAs per k pair rather than a zero-padded full tile's FS_MR
   (a GNU C vector type: the compiler's widest registers; R a constant where it is inlined) */
typedef float fs_v8 __attribute__((vector_size(32)));
_Static_assert(FS_NR == 16, "fs_micro_rows holds a tile row in two 8-float vectors");
static inline __attribute__((always_inline)) void fs_micro_rows(int R, long long K, const float* a, long long as,
                                                                const float* b, float* tile) {{
    fs_v8 lo[FS_MR - 1], hi[FS_MR - 1];
    for (int i = 0; i < R; ++i) lo[i] = hi[i] = (fs_v8){{0}};
    for (long long k = 0; k < K; ++k, b += FS_NR) {{
        fs_v8 b0, b1;
        memcpy(&b0, b, sizeof b0);
        memcpy(&b1, b + 8, sizeof b1);
        for (int i = 0; i < R; ++i) {{
            float x = a[i * as + k];
            lo[i] += x * b0;
            hi[i] += x * b1;
        }}
    }}
    for (int i = 0; i < R; ++i) {{
        memcpy(tile + i * FS_NR, &lo[i], sizeof lo[i]);
        memcpy(tile + i * FS_NR + 8, &hi[i], sizeof hi[i]);
    }}
}}
static void fs_micro_tail(int R, long long K, const float* a, long long as, const float* b, float* tile) {{
    switch (R) {{
    case 1: fs_micro_rows(1, K, a, as, b, tile); break;
    case 2: fs_micro_rows(2, K, a, as, b, tile); break;
    case 3: fs_micro_rows(3, K, a, as, b, tile); break;
    case 4: fs_micro_rows(4, K, a, as, b, tile); break;
    default: fs_micro_rows(5, K, a, as, b, tile); break;
    }}
}}
static void fs_gemm_packed(long long M, long long N, long long K, const float* A, long long am, long long ak,
                           const float* Bp, float* C, long long ldc) {{
    float* ap = fs_scratch({SCRATCH_SLOTS.index("apk")}, sizeof(float) * ((M + FS_AP - 1) / FS_AP * FS_AP) * K);
    for (long long i0 = 0; i0 < M; i0 += FS_AP) {{
        float* dst = ap + i0 * K;
        long long mr = M - i0 < FS_AP ? M - i0 : FS_AP;
        const float* src = A + i0 * am;
        if (mr < FS_AP)
            for (long long q = 0; q < K * FS_AP; ++q) dst[q] = 0.0f;
        if (am == 1) {{
            for (long long k = 0; k < K; ++k)
                for (long long i = 0; i < mr; ++i) dst[k * FS_AP + i] = src[k * ak + i];
        }} else {{
            for (long long i = 0; i < mr; ++i)
                for (long long k = 0; k < K; ++k) dst[k * FS_AP + i] = src[i * am + k * ak];
        }}
    }}
    fs_packed_panels(M, N, K, ap, Bp, C, ldc);
}}
/* a conv over a zero-bordered band of its input (channels x rows x columns, prologue applied):
   C[n * ldc + p] = sum_k band[px(p) + off[k]] * B[k][n] for the M output pixels p of a block (rows
   of ow pixels; pixel p at px(p) = (p / ow) * rs + (p % ow) * cs in the band, tap k at off[k])
   and the N filters packed once (fs_pack_b). Per chunk of pixels (its taps within
   `fs_band_chunk()` floats, in L2) the taps are packed into FS_AP-pixel panels: with AVX-512
   one 16-float copy per tap where the panel's 12 pixels are adjacent; else per FS_MR pixels one
   8-float copy where they are adjacent (outputs narrower than 12 pixels), the even floats of 16
   where they are every other one, single floats otherwise (the band has 16 floats of slack,
   `apk` 16: a copy writes past its FS_MR pixels, into floats the next copy writes again); then
   every filter panel runs over the chunk, each tile stored transposed (a partial one its part;
   the last panel repeats its last pixel) */
enum {{ FS_BAND_CHUNK = 65536 }};
/* the floats of packed taps per chunk: half this core's L2 (sysconf, read once; at least
   FS_BAND_CHUNK, which is half a 512 KiB L2), so a chunk and the filter panels streaming past it
   stay there; resnet's 3x3 convs at 14x14 and 7x7 (2304-4608 taps) ran 1.13-1.22x faster with
   half of a 2 MiB L2 than with 256 KiB, which split their pixels into chunks of 12-24 that each
   streamed every filter panel again; per thread, so OpenMP blocks never race on it */
static long long fs_band_chunk(void) {{
    static _Thread_local long long floats;
    if (!floats) {{
        long long l2 = 0;
#ifdef _SC_LEVEL2_CACHE_SIZE
        l2 = (long long)sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
        long long share = l2 / 4 / 2;
        floats = share > FS_BAND_CHUNK ? share : FS_BAND_CHUNK;
    }}
    return floats;
}}
static void fs_conv_band(long long M, long long N, long long K, long long ow, long long rs, long long cs,
                         const float* band, const int* off, const float* Bp, float* C, long long ldc) {{
    long long mc = fs_band_chunk() / K / FS_AP * FS_AP;
    mc = mc < FS_AP ? FS_AP : mc > 16 * FS_MR ? 16 * FS_MR : mc;
    long long chunks = (M + mc - 1) / mc;  /* chunks of even size: a short last one streams all filters again */
    mc = ((M + chunks - 1) / chunks + FS_AP - 1) / FS_AP * FS_AP;
    float* ap = fs_scratch({SCRATCH_SLOTS.index("apk")}, sizeof(float) * (mc * K + 16));
    for (long long m0 = 0; m0 < M; m0 += mc) {{
        long long mn = M - m0 < mc ? M - m0 : mc;
        for (long long t0 = 0; t0 < mn; t0 += FS_AP) {{
            float* dst = ap + t0 * K;
            long long px[FS_AP], mr = mn - t0 < FS_AP ? mn - t0 : FS_AP, adjacent = 1;
            int mode[FS_AP / FS_MR];  /* per FS_MR pixels: 1 adjacent, 2 every other one, 0 neither */
            for (long long i = 0; i < FS_AP; ++i) {{
                long long p = m0 + t0 + (i < mr ? i : mr - 1);
                px[i] = p / ow * rs + p % ow * cs;
                adjacent &= px[i] == px[0] + i;
            }}
            for (long long h = 0; h < FS_AP; h += FS_MR) {{
                int adj = 1, every2 = 1;
                for (long long i = 1; i < FS_MR; ++i) {{
                    adj &= px[h + i] == px[h] + i;
                    every2 &= px[h + i] == px[h] + 2 * i;
                }}
                mode[h / FS_MR] = adj ? 1 : every2 ? 2 : 0;
            }}
#if defined(__AVX512F__)
            if (adjacent) {{
                const float* src = band + px[0];
                for (long long k = 0; k < K; ++k) _mm512_storeu_ps(dst + k * FS_AP, _mm512_loadu_ps(src + off[k]));
                continue;
            }}
#endif
            for (long long k = 0; k < K; ++k)  /* k outer: a copy's floats past its FS_MR are written again next */
                for (long long h = 0; h < FS_AP; h += FS_MR) {{
                    const float* s = band + px[h] + off[k];
                    float* d = dst + k * FS_AP + h;
                    if (mode[h / FS_MR] == 1) {{
                        fs_v8 v;
                        memcpy(&v, s, sizeof v);
                        memcpy(d, &v, sizeof v);
#if defined(__AVX2__)
                    }} else if (mode[h / FS_MR] == 2) {{  /* stride 2: the even floats of 16 */
                        __m256 lo = _mm256_loadu_ps(s), hi = _mm256_loadu_ps(s + 8);
                        __m256 even = _mm256_shuffle_ps(lo, hi, 0x88);
                        _mm256_storeu_ps(d, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xD8)));
#endif
                    }} else {{
                        for (long long i = 0; i < FS_MR; ++i) d[i] = band[px[h + i] + off[k]];
                    }}
                }}
        }}
        fs_packed_panels(mn, N, K, ap, Bp, C + m0, ldc);
    }}
}}
/* fs_gemm_rows' tile of mr <= FS_MR rows (a, row stride lda) by one B micro-panel b, nr <= FS_NR of
   its columns stored at c (plus r0 and c0 where given, then through the tile epilogue where epi is
   set): a full tile with no epilogue straight into C, the others through `tile` (the last
   M % FS_MR rows by `fs_micro_tail`, which computes only them) */
static inline void fs_rows_tile(long long mr, long long nr, long long K, const float* a, long long lda, const float* b,
                                float* c, long long ldc, const float* c0, long long ldc0, const float* r0, int epi) {{
    float tile[FS_MR * FS_NR];
    if (mr == FS_MR && nr == FS_NR && !epi) {{
        fs_micro(K, a, lda, 1, b, c, ldc, c0, ldc0, r0);
        return;
    }}
    if (mr == FS_MR)
        fs_micro(K, a, lda, 1, b, tile, FS_NR, 0, 0, 0);
    else
        fs_micro_tail((int)mr, K, a, lda, b, tile);
    for (long long i = 0; i < mr; ++i)
        for (long long j = 0; j < nr; ++j) {{
            float v = (tile[i * FS_NR + j] + (r0 ? r0[j] : 0.0f)) + (c0 ? c0[i * ldc0 + j] : 0.0f);
#ifdef FS_TILE_EPI
            if (epi) v = fs_tile_epi1(v);
#endif
            c[i * ldc + j] = v;
        }}
}}
/* C[M x N] (row stride ldc) = A[M x K] (row stride lda, read in place) x B packed once (fs_pack_b),
   plus the row R0[N] where given (a bias), then plus C0[M x N] at row stride ldc0 where given (C
   itself: the product added onto it; a residual): per block of B's columns (their micro-panels
   within FS_ROWS_B_BLOCK floats, in L2), per FS_PANELS panels of FS_MR rows of A (in L1; the last
   M % (FS_PANELS FS_MR) rows together), every B micro-panel of the block in turn: with AVX-512 two
   at a time where whole ones remain (`fs_micro_rows2`, the tile stored straight into C), else
   one (`fs_rows_tile`, per FS_MR rows); with `epi` every tile goes through the kernel's tile
   epilogue after R0 and C0 (`fs_tile_epi` on the registers, `fs_tile_epi1` on a partial tile) */
enum {{ FS_ROWS_B_BLOCK = 65536 }};
static inline __attribute__((always_inline)) void fs_gemm_rows_at(long long M, long long N, long long K, const float* A,
        long long lda, const float* Bp, float* C, long long ldc, const float* C0, long long ldc0, const float* R0, int epi) {{
    long long nc = FS_ROWS_B_BLOCK / K / (FS_PANELS * FS_NR) * (FS_PANELS * FS_NR);
    nc = nc < FS_PANELS * FS_NR ? FS_PANELS * FS_NR : nc;
    for (long long nb = 0; nb < N; nb += nc) {{
        long long ne = N - nb < nc ? N : nb + nc;
        for (long long i0 = 0; i0 < M; ) {{
            long long rows = M - i0 < FS_PANELS * FS_MR ? M - i0 : FS_PANELS * FS_MR;  /* 12 rows with AVX-512 */
            const float* a = A + i0 * lda;
            for (long long n0 = nb; n0 < ne; ) {{
                float* c = C + i0 * ldc + n0;
                const float *c0 = C0 ? C0 + i0 * ldc0 + n0 : 0, *r0 = R0 ? R0 + n0 : 0;
#if defined(__AVX512F__)
                if (ne - n0 >= FS_PANELS * FS_NR) {{
                    fs_micro_rows2((int)rows, K, a, rows > FS_MR ? a + FS_MR * lda : a, lda, 1, Bp + n0 * K, c, ldc, c0, ldc0, r0,
                                   epi);
                    n0 += FS_PANELS * FS_NR;
                    continue;
                }}
#endif
                long long nr = ne - n0 < FS_NR ? ne - n0 : FS_NR;
                for (long long h = 0; h < rows; h += FS_MR)
                    fs_rows_tile(rows - h < FS_MR ? rows - h : FS_MR, nr, K, a + h * lda, lda, Bp + n0 * K, c + h * ldc, ldc,
                                 c0 ? c0 + h * ldc0 : 0, ldc0, r0, epi);
                n0 += FS_NR;
            }}
            i0 += rows;
        }}
    }}
}}
static void fs_gemm_rows(long long M, long long N, long long K, const float* A, long long lda,
                         const float* Bp, float* C, long long ldc, const float* C0, long long ldc0, const float* R0) {{
    fs_gemm_rows_at(M, N, K, A, lda, Bp, C, ldc, C0, ldc0, R0, 0);
}}
#ifdef FS_TILE_EPI
/* fs_gemm_rows with the kernel's tile epilogue on the product plus R0 (a bias row) before the one
   store: no block of the product kept and no second pass (`tile_epilogue`) */
static void fs_gemm_rows_epi(long long M, long long N, long long K, const float* A, long long lda,
                             const float* Bp, float* C, long long ldc, const float* R0) {{
    fs_gemm_rows_at(M, N, K, A, lda, Bp, C, ldc, 0, 0, R0, 1);
}}
#endif
/* a 1x1 conv's product C[M x N] (row stride ldc) = F[M x K] (filters, row stride lda, read in
   place) x X[K x N] (the input's pixels, row stride ldx): per chunk of pixels (its K x chunk
   panel within FS_BAND_CHUNK floats, in L2) X packed into FS_NR-wide panels (`bbuf`), then
   `fs_gemm_rows` stores every tile straight into C's rows */
static void fs_conv_1x1(long long M, long long N, long long K, const float* F, long long lda, const float* X,
                        long long ldx, float* C, long long ldc) {{
    long long nc = FS_BAND_CHUNK / K / FS_NR * FS_NR;
    nc = nc < FS_NR ? FS_NR : nc;
    float* xp = fs_scratch({SCRATCH_SLOTS.index("bbuf")}, sizeof(float) * nc * K);
    for (long long n0 = 0; n0 < N; n0 += nc) {{
        long long nn = N - n0 < nc ? N - n0 : nc;
        fs_pack_b(K, nn, X + n0, ldx, 1, xp);
        fs_gemm_rows(M, nn, K, F, lda, xp, C + n0, ldc, 0, 0, 0);
    }}
}}
"""


def scratch(name: str, floats: str) -> str:
    """The C declaration of scratch buffer `name` (one of SCRATCH_SLOTS) of `floats` floats."""
    return f"float* {name} = fs_scratch({SCRATCH_SLOTS.index(name)}, sizeof(float) * ({floats}));"


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


def c_function(name: str, ins, outs, packed, body: str, defs: str = "") -> str:
    """A C kernel's source: the prelude, `defs` (file-scope definitions the packed GEMM calls: a tile
    epilogue, `tile_epilogue`), the packed GEMM where weights are packed or the body packs an
    operand per call, the kernel `name(inputs, outputs, packed weights)` running `body` (its loops'
    invariant temporaries hoisted: `hoist_loop_invariants`), and its `<name>_pack`."""
    gemm = packed or any(f in body for f in ("fs_pack_b(", "fs_conv_1x1(", "fs_band_chunk("))
    body = hoist_loop_invariants(body)
    wide = "fs_stream(" in body or any(f"{f}(" in body for f in WIDE_CALLS)
    src = (f"{_C_PRELUDE}{defs}{_C_PACKED_GEMM if gemm else ''}{_WIDE_ON if wide else ''}\n"
           f"void {name}({', '.join(c_params(ins, outs, packed))}) {{\n{body}}}\n{_WIDE_OFF if wide else ''}")
    if packed:
        src += (f"void {name}_pack({', '.join(c_pack_params(ins, packed))}) {{\n"
                + "".join(f"    {p.pack_call()}\n" for p in packed) + "}\n")
    return src



# a tile epilogue's statements (`tile_epilogue`): temporaries, the argument v, float literals, the
# four operators and erf; GCC's vector extensions run the same text on 16 floats (a float operand
# broadcast), erf there by `fs_erf16`
_TILE_TOKEN = re.compile(r"\s*(?:(v\d*)|(-?\d+(?:\.\d*)?(?:e-?\d+)?f)|(fs_erff)(?=\()|([-+*/(),]))")
_TILE_STATEMENT = re.compile(r"float (v\d+) = (.*);")


def _tile_expression(text: str) -> bool:
    at = 0
    while at < len(text):
        m = _TILE_TOKEN.match(text, at)
        if m is None or m.end() == at:
            return False
        at = m.end()
    return True


def tile_epilogue(lines: list[str], result: str) -> str | None:
    """The C definitions of a tile epilogue: one output element as a function of `v` (the product
    plus its bias row), from the scalar emitter's `lines` (`float vN = expr;`) and `result`, as
    `fs_tile_epi1` (a float) and, with AVX-512, `fs_tile_epi` (16 floats in a zmm: the same
    statements, erf by `fs_erf16`), which `fs_gemm_rows_epi` applies to each tile before its one
    store; FS_TILE_EPI is defined only with AVX-512 (elsewhere the kernel keeps its block epilogue).
    None when a statement holds anything else (a load, an index, a select, another call)."""
    statements = [_TILE_STATEMENT.fullmatch(line) for line in lines]
    if any(m is None or not _tile_expression(m.group(2)) for m in statements) or not _tile_expression(result):
        return None
    scalar = "".join(f"    {line}\n" for line in lines)
    vector = "".join(f"    __m512 {m.group(1)} = {m.group(2).replace('fs_erff(', 'fs_erf16(')};\n" for m in statements)
    return ("#if defined(__AVX512F__)\n#include <immintrin.h>\n#define FS_TILE_EPI 1\n" + _erf_avx512()
            + f"static inline float fs_tile_epi1(float v) {{\n{scalar}    return {result};\n}}\n"
            + f"static inline __m512 fs_tile_epi(__m512 v) {{\n{vector}    return {result};\n}}\n#endif\n")


_C_PRELUDE = ("#include <math.h>\n#include <stdint.h>\n#include <stdlib.h>\n#include <string.h>\n#ifdef FS_VECTOR_MATH\n"
              + "".join(f"#pragma omp declare simd notinbranch\nfloat {f}(float);\n" for f in _VECTOR_MATH)
              + "#endif\n#ifdef FS_BLAS_SGEMM\nvoid FS_BLAS_SGEMM(int, int, int, int, int, int, float, const float*, int, "
              "const float*, int, float, float*, int);\n#endif\n#ifdef FS_BLAS_SGEMV\n"
              "void FS_BLAS_SGEMV(int, int, int, int, float, const float*, int, const float*, int, float, float*, int);\n"
              "#define FS_GEMV_OR(call) if (mc == 1) { call } else\n#else\n#define FS_GEMV_OR(call)\n#endif\n"
              "#define FS_FMAX(a, b) ((a) > (b) ? (a) : (b))\n"
              "#define FS_FMIN(a, b) ((a) < (b) ? (a) : (b))\n" + _C_MATH + _C_SCRATCH + _C_STREAM + _C_FOLD + "#ifdef _OPENMP\n#include <omp.h>\nstatic inline long long fs_threads(void) { return omp_get_max_threads(); }\n"
              "#else\nstatic inline long long fs_threads(void) { return 1; }\n#endif\n#define FS_PRAGMA(x) _Pragma(#x)\n#define FS_SIMD_SUM(a) FS_PRAGMA(omp simd reduction(+:a))\n")
_CU_PRELUDE = ("#define fs_expf(x) expf(x)\n#define fs_expf_le(x) expf(x)\n#define fs_erff(x) erff(x)\n#ifndef INFINITY\n#define INFINITY __int_as_float(0x7f800000)\n#endif\n"
               "#ifndef NAN\n#define NAN __int_as_float(0x7fffffff)\n#endif\n#define FS_SIMD_SUM(a)\n"
               "#define FS_FMAX(a, b) fmaxf(a, b)\n#define FS_FMIN(a, b) fminf(a, b)\n")


def _indent(lines: list[str], depth: int) -> str:
    return "\n".join("    " * depth + line for line in lines)


def _flat_loop(body: list[str]) -> bool:
    """A loop body with no loop or OpenMP construct of its own (simd constructs do not nest)."""
    return not any(x.lstrip().startswith(("for ", "#pragma", "FS_SIMD")) for x in body)



# C loop-invariant code motion over a generated body (`hoist_loop_invariants`): one pass over every
# skeleton's source, so no skeleton decides it on its own
_DECLARATION = re.compile(r"^(\w[\w ]*?) (v\d+r?) = (.+);$")  # a temporary, or a hoisted one's reciprocal
_ASSIGNMENT = re.compile(r"^(\w+)(\[.+\])? [-+*]?= .+;$")  # a store into an array, an accumulator's update
_DIVISION = re.compile(r"^\((v\d+) / (v\d+)\)$")
_READ_ONLY = re.compile(r"^(in|pk)\d+$")  # a kernel's inputs and packed weights: never written
_LOOP = re.compile(r"^(\s*)for \(long long (\w+) = [^;]+;[^;]+;[^)]+\) \{$")
_IDENT = re.compile(r"[A-Za-z_]\w*")


def hoist_invariants(lines: list[str], var: str) -> tuple[list[str], list[str]] | None:
    """(before, inside) for a flat C loop body over `var`: the temporaries whose value does not
    depend on `var` (a row's gather index, a per-row scale), to run once before the loop, and the
    rest, where a division by a hoisted float temporary becomes a multiplication by its reciprocal
    (computed once before the loop: at most one rounding apart; a divisor below 2^-126 would give
    an infinity where the quotient of a tiny numerator is finite). A temporary is invariant when
    its expression names neither `var`, a variant temporary nor anything the body assigns, and
    reads only kernel inputs and packed weights. None for a body with any statement other than a
    temporary's declaration, a store into an array or an accumulator's update."""
    assigned = {var}
    for line in lines:
        if _DECLARATION.match(line):
            continue
        written = _ASSIGNMENT.match(line)
        if written is None:
            return None
        assigned.add(written.group(1))
    before: list[str] = []
    inside: list[str] = []
    variant, floats, reciprocals = set(assigned), set(), {}
    for line in lines:
        declared = _DECLARATION.match(line)
        if declared is None:
            inside.append(line)
            continue
        ctype, name, expr = declared.groups()
        arrays = re.findall(r"(\w+)\[", expr)
        if set(_IDENT.findall(expr)) & variant or not all(_READ_ONLY.match(a) for a in arrays):
            variant.add(name)
            division = _DIVISION.match(expr)
            if ctype == "float" and division and division.group(2) in floats:
                divisor = division.group(2)
                if divisor not in reciprocals:
                    reciprocals[divisor] = f"{divisor}r"
                    before.append(f"float {divisor}r = 1.0f / {divisor};")
                line = f"{ctype} {name} = ({division.group(1)} * {reciprocals[divisor]});"
            inside.append(line)
        else:
            before.append(line)
            if ctype == "float":
                floats.add(name)
    return before, inside


def hoist_loop_invariants(body: str) -> str:
    """`body` (C statements) with each innermost `for (long long x ...)` loop's invariant
    temporaries (`hoist_invariants`) moved before it, and before the OpenMP pragmas that must stay
    on its line; hoisted names get a kernel-wide prefix (`h<n>_`), so two loops of one block
    hoisting the same temporary's name do not collide."""
    lines = body.split("\n")
    out: list[str] = []
    hoisted = 0
    i = 0
    while i < len(lines):
        loop = _LOOP.match(lines[i])
        end = None
        if loop:
            close = f"{loop.group(1)}}}"
            end = next((j for j in range(i + 1, len(lines)) if lines[j] == close), None)
        split = None
        if end is not None:
            inner = [x.strip() for x in lines[i + 1:end]]
            if not any(x.startswith(("for ", "#", "FS_", "if ", "{", "}")) for x in inner):
                split = hoist_invariants(inner, loop.group(2))
        if not split or not split[0]:
            out.append(lines[i])
            i += 1
            continue
        before, inside = split
        hoisted += 1
        names = [_DECLARATION.match(x).group(2) for x in before]
        rename = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
        prefix = f"h{hoisted}_"

        def fix(text: str, rename=rename, prefix=prefix) -> str:
            return rename.sub(lambda found: prefix + found.group(1), text)

        head = []
        while out and out[-1].strip().startswith(("#pragma", "FS_SIMD")):
            head.insert(0, out.pop())
        indent = loop.group(1)
        inner_indent = lines[i + 1][:len(lines[i + 1]) - len(lines[i + 1].lstrip())]
        out += [indent + fix(x) for x in before] + head + [lines[i]] + [inner_indent + fix(x) for x in inside]
        out.append(lines[end])
        i = end + 1
    return "\n".join(out)
