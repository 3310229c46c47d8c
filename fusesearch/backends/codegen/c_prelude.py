"""The C and CUDA text every generated kernel starts with (a leaf of the generator).

Problem: every C kernel needs the same helpers (vectorizable exp and erf, a per-thread scratch
arena, streamed stores for outputs beyond the last-level cache, the fold of a row reduction's
partial results) and every CUDA kernel the same few macros; written once, so each skeleton and the
packed GEMM read one definition.
Approach: the helpers are C source strings joined into `_C_PRELUDE` / `_CU_PRELUDE`; in C, those
that must inline into a kernel's loops (exp, erf, GELU, the scratch arena, the folds, prefetches)
are defined there, inline and without <immintrin.h>, the rest (streamed stores, the split by column
parity) only declared, defined in `_C_STREAM_DEFS`, which the shared C runtime compiles once
(`c_runtime`); their parameters (the scratch slots, the streaming thresholds, the fold width, erf's fit) are Python
constants the emitters read too, so the C and the code that calls it cannot disagree.
Invariants: this module imports nothing of the generator; the text is a pure function of these
constants (it is part of every kernel's source hash).
"""

from __future__ import annotations

import math

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
# subnormal), inf above 88.72283, NaN kept; fs_erff within 1e-6 relative (4.2e-7 measured), odd,
# never beyond +-1, exactly +-1 from |x| = 3.5793 on (where the fit first rounds to 1), NaN kept;
# fs_gelu2f (GELU's x (1 + erf(x / sqrt 2)), below) within 1e-6 relative for x >= 0 and 1e-6 |x|
# below, exactly 0 where erf is -1.
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
#   fs_erff: x P(x^2) / Q(x^2), P of degree 4 and Q of degree 5 (a relative minimax fit of erf on
#   [0, 3.7], P(0) = 2 / sqrt(pi) rounded, so erf of a subnormal rounds as libm's), x clamped first
#   to +-3.5793: one FMA fewer than the degree-5 P it replaced (3.6e-7 measured).
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
ERF_CLAMP = "3.5792792f"
ERF_P = ("0.00023883834364823997f", "0.006414496339857578f", "0.060321010649204254f", "0.26567381620407104f",
         "1.128379225730896f")
ERF_Q = ("1.4691066098748706e-05f", "0.001615046989172697f", "0.020268240943551064f", "0.1430678516626358f",
         "0.5687780380249023f", "1.0f")


def _horner(coefficients, fma, wrap: str = "") -> str:
    """c0 s^n + ... + cn by nested FMAs (`fma(a, b, c)` = a b + c), `wrap` around each constant."""
    expr = wrap.format(coefficients[0]) if wrap else coefficients[0]
    for c in coefficients[1:]:
        expr = fma(expr, "s", wrap.format(c) if wrap else c)
    return expr


def _gelu_coefficients(coefficients, scale: float) -> tuple[str, ...]:
    """erf's P or Q (highest degree first) for erf(x / sqrt 2) as a function of x: the coefficient
    of s^d times 2^-d, all times `scale` (P's 1/sqrt 2, for its one x; Q's 1)."""
    n = len(coefficients) - 1
    return tuple(f"{float(c.rstrip('f')) * 2.0 ** -(n - i) * scale!r}f" for i, c in enumerate(coefficients))


# GELU's x (1 + erf(x / sqrt 2)) in one function (`fs_gelu2f`, and `fs_gelu2_16` over 16 floats):
# erf's fit with 1/sqrt 2 taken into its coefficients and the 1 + and the product by x taken into
# one FMA, x + x erf: two vector operations fewer than the four ops (x / sqrt 2, erf, + 1, times x:
# bert-small's FFN-up group, product included, 1.4% faster, `benchmarks/variants/gelu_epilogue.py`;
# with erf's lower degree, `bench_cpu.py`'s GELU over 4096 x 3072 4.77 -> 4.27 ms); x erf
# and x cancel exactly where erf is -1, as 1 + erf does. Its clamp is the first float at which that
# fit rounds to 1 (found by evaluating it in C, so it stays exactly +-1 beyond). `schedule.gelu_chains`
# finds the four ops in a group, for the generator and the cost model alike.
GELU_CLAMP = "5.07561827f"
GELU_P, GELU_Q = _gelu_coefficients(ERF_P, 1 / math.sqrt(2)), _gelu_coefficients(ERF_Q, 1.0)


def _rational(name: str, clamp: str, p_coefficients, q_coefficients, result: str, *, wide: bool) -> str:
    """`name`(x): t = x clamped to +-clamp, s = t^2, p = P(s), q = Q(s), then `result` of them, as
    a scalar `omp declare simd` function (C, FMAs by FS_FMA) or over 16 floats (AVX-512, the same
    operations in the same order; the clamp a max and a min with x their second operand, which
    vmaxps/vminps return where it is NaN: NaN kept, as in the scalar form)."""
    if wide:
        def fma(a, b, c):
            return f"_mm512_fmadd_ps({a}, {b}, {c})"

        p, q = (_horner(c, fma, "_mm512_set1_ps({})") for c in (p_coefficients, q_coefficients))
        return (f"static inline __m512 {name}(__m512 x) {{\n"
                f"    __m512 t = _mm512_min_ps(_mm512_set1_ps({clamp}), _mm512_max_ps(_mm512_set1_ps(-{clamp}), x));\n"
                f"    __m512 s = _mm512_mul_ps(t, t);\n    __m512 p = {p};\n    __m512 q = {q};\n    return {result};\n}}\n")

    def fma(a, b, c):
        return f"FS_FMA({a}, {b}, {c})"

    p, q = (_horner(c, fma) for c in (p_coefficients, q_coefficients))
    return (f"#pragma omp declare simd notinbranch\nstatic inline float {name}(float x) {{\n"
            f"    float t = fabsf(x) > {clamp} ? copysignf({clamp}, x) : x;\n    float s = t * t;\n"
            f"    float p = {p};\n    float q = {q};\n    return {result};\n}}\n")


def _erf_avx512() -> str:
    """`fs_erff` over 16 floats (`fs_erf16`, a tile epilogue's)."""
    return _rational("fs_erf16", ERF_CLAMP, ERF_P, ERF_Q, "_mm512_div_ps(_mm512_mul_ps(t, p), q)", wide=True)


def gelu_avx512() -> str:
    """`fs_gelu2f` over 16 floats (`fs_gelu2_16`, a tile epilogue's)."""
    return _rational("fs_gelu2_16", GELU_CLAMP, GELU_P, GELU_Q,
                     "_mm512_fmadd_ps(x, _mm512_div_ps(_mm512_mul_ps(t, p), q), x)", wide=True)


_C_MATH += (_rational("fs_erff", ERF_CLAMP, ERF_P, ERF_Q, "t * p / q", wide=False) + "/* x (1 + erf(x / sqrt 2)) */\n"
            + _rational("fs_gelu2f", GELU_CLAMP, GELU_P, GELU_Q, "FS_FMA(x, t * p / q, x)", wide=False))
# C: scratch buffers (a product's tile, a packed panel, an im2col patch) come from a per-thread
# arena kept between calls: one slot per buffer name, grown to the largest size asked, never
# freed. A malloc/free per call costs a page fault per 4 KiB each time glibc hands the memory back
# to the system (which MALLOC_TRIM_THRESHOLD_ or a large block makes it do); the arena costs
# nothing after the first call. Per thread, so OpenMP blocks never share one; a buffer the whole
# kernel shares (the materialized product) is taken by the calling thread before its parallel loops.
SCRATCH_SLOTS = ("ybuf", "wbuf", "patch", "cbuf", "abuf", "bbuf", "apk", "offs", "bpk", "xq")
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
_C_STREAM = f"""enum {{ FS_STREAM_CHUNK = {STREAM_CHUNK}, FS_STREAM_AHEAD = {STREAM_AHEAD} }};
/* the n floats at p + FS_STREAM_AHEAD into the cache, a prefetch per 64-byte line */
static inline void fs_prefetch_ahead(const float* p, long long n) {{
    for (long long i = 0; i < n; i += 16) __builtin_prefetch(p + FS_STREAM_AHEAD + i);
}}
void fs_stream(float* restrict dst, const float* restrict src, long long n);
void fs_stream_fence(void);
void fs_split2(const float* restrict src, float* restrict even, float* restrict odd, long long ne, long long no);
"""
# the runtime's definitions of the three functions declared above (`c_runtime`: compiled once, not
# per kernel: a call per chunk of FS_STREAM_CHUNK floats, per thread, per row)
_C_STREAM_DEFS = """#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif
/* dst[0, n) = src[0, n): whole 64-byte lines of dst non-temporal, its partial first and last plain */
void fs_stream(float* restrict dst, const float* restrict src, long long n) {
    long long i = 0;
#if defined(__AVX512F__) || defined(__AVX__)
    long long head = (long long)(((64 - ((uintptr_t)dst & 63)) & 63) / sizeof(float));
    for (; i < head && i < n; ++i) dst[i] = src[i];
    if (((uintptr_t)(dst + i) & 63) == 0)
        for (; i + 16 <= n; i += 16) {
#if defined(__AVX512F__)
            _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
#else
            _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
            _mm256_stream_ps(dst + i + 8, _mm256_loadu_ps(src + i + 8));
#endif
        }
#endif
    for (; i < n; ++i) dst[i] = src[i];
}
void fs_stream_fence(void) {
#if defined(__AVX512F__) || defined(__AVX__)
    _mm_sfence();
#endif
}
/* even[j] = src[2 j] for j < ne, odd[j] = src[2 j + 1] for j < no (no <= ne <= no + 1): a stride-2
   depthwise conv's input row, its prologue applied, split by column parity into its two planes;
   with AVX-512 two permutes per 32 floats and a masked last step */
void fs_split2(const float* restrict src, float* restrict even, float* restrict odd, long long ne, long long no) {
    long long j = 0;
#if defined(__AVX512F__)
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (; j + 16 <= no; j += 16) {
        __m512 a = _mm512_loadu_ps(src + 2 * j), b = _mm512_loadu_ps(src + 2 * j + 16);
        _mm512_storeu_ps(even + j, _mm512_permutex2var_ps(a, ie, b));
        _mm512_storeu_ps(odd + j, _mm512_permutex2var_ps(a, io, b));
    }
    if (j < no) {
        unsigned long long m = (1ULL << (2 * (no - j))) - 1;  /* the 2 (no - j) floats left */
        __m512 a = _mm512_maskz_loadu_ps((__mmask16)m, src + 2 * j), b = _mm512_maskz_loadu_ps((__mmask16)(m >> 16), src + 2 * j + 16);
        __mmask16 s = (__mmask16)((1u << (no - j)) - 1);
        _mm512_mask_storeu_ps(even + j, s, _mm512_permutex2var_ps(a, ie, b));
        _mm512_mask_storeu_ps(odd + j, s, _mm512_permutex2var_ps(a, io, b));
        j = no;
    }
#endif
    for (long long k = j; k < no; ++k) odd[k] = src[2 * k + 1];
    for (long long k = j; k < ne; ++k) even[k] = src[2 * k];
}
"""


# C: a row reduction's last step folds its C_PARTIALS (32) partial results into one; under
# `omp simd reduction` GCC adds the last vector's lanes one after another without -ffast-math (16
# dependent adds a row at 512 bits), so the fold is a 256-bit tree (`fs_fold_sum`/`fs_fold_max`:
# the partials' four ymm, then halves): a Softmax over 128-float rows 17% faster in cache, a
# LayerNorm 3-7%. 256 bits at either vector width: a 512-bit load of partials the loop stored as two
# ymm waits for the stores to reach the cache (a LayerNorm 35% slower).
FOLDED = 32  # the partial results the fold takes (the C helpers' FS_FOLDED; a multiple of 8)


def _c_fold(name: str, wide: str, half: str, pair: str, init: str, step: str) -> str:
    """The C helper folding FS_FOLDED partials: with AVX, four 8-float vectors by `wide`, their
    halves by `half`, then the four lanes by `pair` (each a format of `{a}` and `{b}`), paired as
    _mm_movehl_ps and _mm_movehdup_ps pair them; GCC's vector types and x86 builtins, so the
    header needs no <immintrin.h> (whose parsing was a third of a row kernel's compile time); a
    plain loop of `step` (acc `s`, partial `p[q]`) without AVX."""
    return f"""static inline float {name}(const float* p) {{
#if defined(__AVX__)
    union {{ fs_f32x8 v; fs_f32x4 h[2]; }} u;
    fs_f32x8 w;
    memcpy(&u.v, p, sizeof u.v);
    for (int q = 8; q < FS_FOLDED; q += 8) {{
        memcpy(&w, p + q, sizeof w);
        u.v = {wide.format(a="u.v", b="w")};
    }}
    fs_f32x4 h = {half.format(a="u.h[0]", b="u.h[1]")};
    float lo = {pair.format(a="h[0]", b="h[2]")}, hi = {pair.format(a="h[1]", b="h[3]")};
    return {pair.format(a="lo", b="hi")};
#else
    float s = {init};
    for (int q = 0; q < FS_FOLDED; ++q) {step};
    return s;
#endif
}}
"""


_C_FOLD = (f"enum {{ FS_FOLDED = {FOLDED} }};  /* a multiple of 8 */\n"
           "typedef float fs_f32x8 __attribute__((vector_size(32)));\n"
           "typedef float fs_f32x4 __attribute__((vector_size(16)));\n"
           + _c_fold("fs_fold_sum", "{a} + {b}", "{a} + {b}", "{a} + {b}", "0.0f", "s += p[q]")
           + _c_fold("fs_fold_max", "__builtin_ia32_maxps256({a}, {b})", "__builtin_ia32_maxps({a}, {b})",
                     "{a} > {b} ? {a} : {b}", "-INFINITY", "s = p[q] > s ? p[q] : s"))


# A kernel that streams, or whose loops evaluate erf, exp or a vector-math function, is compiled for
# 512-bit vectors where the core has them (GCC prefers 256 on Ice Lake): those loops are bound by
# the FMA ports, which do twice the work per instruction at 512 (a GELU over 48 MiB from 55% to 72%
# of a memcpy's bandwidth with the streamed stores; a GEMM's GELU epilogue over bert-small's 128x512
# 137 -> 127 us, erf alone over 128x512 31 -> 21 us). Light loops in cache stay at 256: an Add or a
# LayerNorm over 128 rows of 128 was 20-25% slower at 512 (measured; the halved instruction count
# does not pay for the core's 512-bit power level there).
_WIDE_ON = ('#if defined(__AVX512F__) && !defined(__clang__)\n#pragma GCC push_options\n'
            '#pragma GCC target("prefer-vector-width=512")\n#endif\n')
WIDE_CALLS = ("fs_erff", "fs_gelu2f", "fs_expf", "fs_expf_le", *_VECTOR_MATH)  # the calls that make a C kernel wide
# the ops whose C evaluates one of WIDE_CALLS (`ops`' forms, `rowwise`'s Softmax and log-sum-exp): a
# kernel holding one is wide (`base.wide_kernel`), decided from its ops, never from its text
WIDE_OPS = frozenset({"Exp", "Log", "Erf", "Tanh", "Sigmoid", "Sin", "Cos", "Elu", "Selu", "Celu", "Gelu", "Swish",
                      "Softplus", "Mish", "Softmax", "LogSoftmax", "ReduceLogSumExp", "ReduceLogSum"})
_WIDE_OFF = "#if defined(__AVX512F__) && !defined(__clang__)\n#pragma GCC pop_options\n#endif\n"
# GCC vectorizes FS_FMAX/FS_FMIN (`a > b ? a : b`, exactly x86's maxps) as a compare and a blend
# unless it may assume finite values without signed zeros; then one vmaxps/vminps. A blocked conv's
# Relu or Clip epilogue on a short K (MobileNetV2's 16 -> 96 expansion and its depthwise conv as one
# chain) measured 0.78x the time so (`ab_group.py`, 2026-12-07). Only for kernels whose ops give
# the same values on finite inputs either way (`MINMAX_OPS`: products, adds, Relu, Clip; no pool's
# -INFINITY, no division, no exp); what a NaN input becomes there (NaN or the bound) is the compiler's.
_MINMAX_ON = '#if !defined(__clang__)\n#pragma GCC push_options\n#pragma GCC optimize("finite-math-only", "no-signed-zeros")\n#endif\n'
_MINMAX_OFF = "#if !defined(__clang__)\n#pragma GCC pop_options\n#endif\n"
MINMAX_OPS = frozenset({"Conv", "Add", "Sub", "Mul", "Relu", "Clip", "LeakyRelu", "Identity"})


_C_PRELUDE = ("#include <math.h>\n#include <stdint.h>\n#include <stdlib.h>\n#include <string.h>\n#ifdef FS_VECTOR_MATH\n"
              + "".join(f"#pragma omp declare simd notinbranch\nfloat {f}(float);\n" for f in _VECTOR_MATH)
              + "#endif\n#ifdef FS_BLAS_SGEMM\nvoid FS_BLAS_SGEMM(int, int, int, int, int, int, float, const float*, int, "
              "const float*, int, float, float*, int);\n#endif\n#ifdef FS_BLAS_SGEMV\n"
              "void FS_BLAS_SGEMV(int, int, int, int, float, const float*, int, const float*, int, float, float*, int);\n"
              "#define FS_GEMV_OR(call) if (mc == 1) { call } else\n#else\n#define FS_GEMV_OR(call)\n#endif\n"
              "#define FS_FMAX(a, b) ((a) > (b) ? (a) : (b))\n"
              "#define FS_FMIN(a, b) ((a) < (b) ? (a) : (b))\n" + _C_MATH + _C_SCRATCH + _C_STREAM + _C_FOLD + "#ifdef _OPENMP\n#include <omp.h>\nstatic inline long long fs_threads(void) { return omp_get_level() ? omp_get_num_threads() : omp_get_max_threads(); }\n"
              "#else\nstatic inline long long fs_threads(void) { return 1; }\n#endif\n#define FS_PRAGMA(x) _Pragma(#x)\n#define FS_SIMD_SUM(a) FS_PRAGMA(omp simd reduction(+:a))\n")
_CU_PRELUDE = ("#define fs_expf(x) expf(x)\n#define fs_expf_le(x) expf(x)\n#define fs_erff(x) erff(x)\n"
               "#define fs_gelu2f(x) fmaf((x), erff((x) * 0.7071067811865476f), (x))\n#ifndef INFINITY\n#define INFINITY __int_as_float(0x7f800000)\n#endif\n"
               "#ifndef NAN\n#define NAN __int_as_float(0x7fffffff)\n#endif\n#define FS_SIMD_SUM(a)\n"
               "#define FS_FMAX(a, b) fmaxf(a, b)\n#define FS_FMIN(a, b) fminf(a, b)\n")
