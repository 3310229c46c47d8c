"""The packed GEMM of the C runtime that kernels with packed weights call, and the tile epilogue.

Problem: a GEMM or conv group on the CPU must run its product near the core's FMA peak with its
prologue and epilogue fused, its weights (constants) packed once.
Approach: C source compiled once into the shared runtime (`c_runtime`; kernels see `_C_GEMM_DECLS`):
`fs_pack_b` (FS_NR-wide panels, transposed B by 8 x 8 AVX2 transposes), the FS_MR x FS_NR
micro-kernel `fs_micro` (AVX-512, AVX2 + FMA or portable loops) and `fs_micro_x2` (AVX-512),
`fs_gemm_rows` (A by rows in place, B's columns blocked in L2: MatMul/Gemm), `fs_gemm_packed`
(C transposed: conv), the band and 1x1 convs. `tile_epilogue` turns a scalar epilogue into a
function on the micro-kernel's registers, compiled with the tile kernels (`_C_TILE_GEMM`,
`_C_GEMM_ROWS`) into a unit per distinct epilogue (`c_runtime.tile_kernels`).
Invariants: imports only `c_prelude`; FS_NR and FS_MR are the one definition of the panel width
and tile height that the emitters size buffers by."""

from __future__ import annotations

import re

from fusesearch.backends.codegen.c_prelude import SCRATCH_SLOTS, _erf_avx512, gelu_avx512

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
# tile needs a broadcast per FMA and is bound by the load ports): `fs_gemm_packed` runs 12 x 32
# over two A panels, `fs_conv_band` up to 12 x 32 with the pixels broadcast from its band in place
# (`fs_micro_taps`, the same loop with a tap offset per k), `fs_gemm_rows` 12 x 32 down to the last M % 12
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

# C: what a kernel sees of the packed GEMM: the runtime's functions (their comments at their
# definitions below), declared in every kernel's header (`c_runtime.C_HEADER`)
_C_GEMM_DECLS = ("void fs_pack_b(long long K, long long N, const float* B, long long sk, long long sn, float scale, float* Bp);\n"
                 "void fs_pack_b_rows(long long K, long long N, const float* B, long long sk, float* Bp);\n"
                 "void fs_gemm_rows(long long M, long long N, long long K, const float* A, long long lda, const float* Bp, "
                 "float* C, long long ldc, const float* C0, long long ldc0, const float* R0);\n"
                 "void fs_gemm_packed(long long M, long long N, long long K, const float* A, long long am, long long ak, "
                 "const float* Bp, float* C, long long ldc);\n"
                 "long long fs_band_chunk(void);\n"
                 "void fs_conv_band(long long M, long long N, long long K, long long ow, long long rs, long long cs, "
                 "const float* band, const int* off, const float* Bp, float* C, long long ldc);\n"
                 "void fs_conv_1x1(long long M, long long N, long long K, const float* F, long long lda, const float* X, "
                 "long long ldx, float* C, long long ldc, int in_place);\n")

# C: the tile kernels behind `fs_gemm_rows` (C row-major, A read by rows in place): compiled into
# the runtime (`c_runtime`) and, where a kernel has a tile epilogue (`tile_epilogue`), into that
# kernel too, since the epilogue is inlined on the registers of every tile (`fs_gemm_rows_epi`).
# Every function here is static: the runtime exports only what C_GEMM_DECLS declares.
_C_GEMM_ROWS = f"""#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
enum {{ FS_MR = {FS_MR}, FS_NR = {FS_NR} }};
typedef float fs_v8 __attribute__((vector_size(32)));
_Static_assert(FS_NR == 16, "fs_micro_rows holds a tile row in two 8-float vectors");
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
/* the last R < FS_MR rows of A by rows (row stride as) times a packed B micro-panel: R x FS_NR
   sums into tile (row stride FS_NR), R FMAs per k pair rather than a zero-padded full tile's FS_MR
   (a GNU C vector type: the compiler's widest registers; R a constant where it is inlined) */
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
"""

# C: the rest of the packed GEMM, in the runtime only (`c_runtime`): B packing, the packed-A and
# band convs, `fs_gemm_rows` itself and the 1x1 conv.
_C_PACKED_GEMM = f"""#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif
#if defined(__AVX2__)
/* dst[k * FS_NR + j] = scale src[j * sn + k] for an 8 x 8 block: eight rows of B^T in, eight panel rows out */
static inline void fs_transpose8(const float* src, long long sn, float scale, float* dst) {{
    __m256 s = _mm256_set1_ps(scale);
    __m256 r0 = _mm256_mul_ps(_mm256_loadu_ps(src), s), r1 = _mm256_mul_ps(_mm256_loadu_ps(src + sn), s);
    __m256 r2 = _mm256_mul_ps(_mm256_loadu_ps(src + 2 * sn), s), r3 = _mm256_mul_ps(_mm256_loadu_ps(src + 3 * sn), s);
    __m256 r4 = _mm256_mul_ps(_mm256_loadu_ps(src + 4 * sn), s), r5 = _mm256_mul_ps(_mm256_loadu_ps(src + 5 * sn), s);
    __m256 r6 = _mm256_mul_ps(_mm256_loadu_ps(src + 6 * sn), s), r7 = _mm256_mul_ps(_mm256_loadu_ps(src + 7 * sn), s);
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
void fs_pack_b(long long K, long long N, const float* B, long long sk, long long sn, float scale, float* Bp) {{
    for (long long n0 = 0; n0 < N; n0 += FS_NR) {{
        float* dst = Bp + n0 * K;
        long long nr = N - n0 < FS_NR ? N - n0 : FS_NR;
        long long k0 = 0;
#if defined(__AVX2__)
        if (sk == 1 && nr == FS_NR)  /* B stored transposed (attention's keys): 8 x 8 blocks */
            for (; k0 + 8 <= K; k0 += 8)
                for (long long j0 = 0; j0 < FS_NR; j0 += 8) fs_transpose8(B + k0 + (n0 + j0) * sn, sn, scale, dst + k0 * FS_NR + j0);
#endif
        for (long long k = k0; k < K; ++k) {{
            long long j = 0;
            for (; j < nr; ++j) dst[k * FS_NR + j] = scale * B[k * sk + (n0 + j) * sn];
            for (; j < FS_NR; ++j) dst[k * FS_NR + j] = 0.0f;
        }}
    }}
}}
/* fs_pack_b for a B with contiguous columns read in place from memory (a 1x1 conv's input): per
   FS_PACK_ROWS rows, every whole panel's part of them in turn, so B is read as that many streams in
   order, not down a column of rows a stride apart, each read on a new page (a 1x1 conv's rows are
   a feature map apart), which no prefetcher follows: mobilenetv2's 1x1 144->24 conv at 56x56 + Add
   1.5x faster (`benchmarks/variants/pack_rows.py`); a panel the kernel wrote itself (in cache)
   packs faster column by column (`fs_pack_b`: 1.01-1.04x) */
enum {{ FS_PACK_ROWS = 8 }};
/* panels of w adjacent floats per row (w a constant where inlined): panel p's row k, at
   dst + (p * K + k) * w, is src + p * w + k * sk, copied FS_PACK_ROWS rows of every panel in turn */
static inline __attribute__((always_inline)) void fs_pack_rows(long long K, long long panels, long long w,
                                                               const float* src, long long sk, float* dst) {{
    for (long long k0 = 0; k0 < K; k0 += FS_PACK_ROWS) {{
        long long k1 = k0 + FS_PACK_ROWS < K ? k0 + FS_PACK_ROWS : K;
        for (long long p = 0; p < panels; ++p)
            for (long long k = k0; k < k1; ++k) memcpy(dst + (p * K + k) * w, src + p * w + k * sk, sizeof(float) * w);
    }}
}}
void fs_pack_b_rows(long long K, long long N, const float* B, long long sk, float* Bp) {{
    long long whole = N / FS_NR * FS_NR;
    fs_pack_rows(K, whole / FS_NR, FS_NR, B, sk, Bp);
    if (whole < N) fs_pack_b(K, N - whole, B + whole, sk, 1, 1.0f, Bp + whole * K);
}}
#if defined(__AVX512F__)
/* rows (1 to 12, a constant where inlined) pixels of a conv's band, pixel i of tap k at
   x[off[k] + i * cs] (read in place: no packed copy of the taps), times one B micro-panel b or,
   where `pair` is set, two (b, b + bs; row k at k * FS_NR) over K taps: the rows x 16 or 32 sums
   stored at tile (row stride 2 FS_NR), added to what it holds where acc is set (the sums of the
   taps before); the k loop unrolled 8 times */
static inline __attribute__((always_inline)) void fs_micro_taps(int rows, int pair, long long K, const float* x,
        long long cs, const int* off, const float* b, long long bs, float* tile, int acc) {{
    const float* b2 = b + bs;
    __m512 u[FS_AP], v[FS_AP];
#pragma GCC unroll 12
    for (int i = 0; i < rows; ++i) {{
        u[i] = acc ? _mm512_loadu_ps(tile + i * 2 * FS_NR) : _mm512_setzero_ps();
        v[i] = acc && pair ? _mm512_loadu_ps(tile + i * 2 * FS_NR + FS_NR) : _mm512_setzero_ps();
    }}
#pragma GCC unroll 8
    for (long long k = 0; k < K; ++k, b += FS_NR, b2 += FS_NR) {{
        const float* p = x + off[k];
        __m512 e = _mm512_loadu_ps(b), o = pair ? _mm512_loadu_ps(b2) : e;
#pragma GCC unroll 12
        for (int i = 0; i < rows; ++i) {{
            __m512 s = _mm512_set1_ps(p[i * cs]);
            u[i] = _mm512_fmadd_ps(s, e, u[i]);
            if (pair) v[i] = _mm512_fmadd_ps(s, o, v[i]);
        }}
    }}
#pragma GCC unroll 12
    for (int i = 0; i < rows; ++i) {{
        _mm512_storeu_ps(tile + i * 2 * FS_NR, u[i]);
        if (pair) _mm512_storeu_ps(tile + i * 2 * FS_NR + FS_NR, v[i]);
    }}
}}
/* `fs_micro_taps` with its row count and panels chosen at run time (FS_TAPS_CASES: the 12 row
   counts with `pair` the constant P) */
#define FS_TAPS_CASES(P) \
    case 1: fs_micro_taps(1, P, K, x, cs, off, b, bs, tile, acc); break; \
    case 2: fs_micro_taps(2, P, K, x, cs, off, b, bs, tile, acc); break; \
    case 3: fs_micro_taps(3, P, K, x, cs, off, b, bs, tile, acc); break; \
    case 4: fs_micro_taps(4, P, K, x, cs, off, b, bs, tile, acc); break; \
    case 5: fs_micro_taps(5, P, K, x, cs, off, b, bs, tile, acc); break; \
    case 6: fs_micro_taps(6, P, K, x, cs, off, b, bs, tile, acc); break; \
    case 7: fs_micro_taps(7, P, K, x, cs, off, b, bs, tile, acc); break; \
    case 8: fs_micro_taps(8, P, K, x, cs, off, b, bs, tile, acc); break; \
    case 9: fs_micro_taps(9, P, K, x, cs, off, b, bs, tile, acc); break; \
    case 10: fs_micro_taps(10, P, K, x, cs, off, b, bs, tile, acc); break; \
    case 11: fs_micro_taps(11, P, K, x, cs, off, b, bs, tile, acc); break; \
    default: fs_micro_taps(12, P, K, x, cs, off, b, bs, tile, acc); break;
static void fs_micro_taps_rows(int rows, int pair, long long K, const float* x, long long cs, const int* off,
                               const float* b, long long bs, float* tile, int acc) {{
    if (pair) {{
        switch (rows) {{ FS_TAPS_CASES(1) }}
    }} else {{
        switch (rows) {{ FS_TAPS_CASES(0) }}
    }}
}}
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
void fs_gemm_packed(long long M, long long N, long long K, const float* A, long long am, long long ak,
                           const float* Bp, float* C, long long ldc) {{
    float* ap = fs_scratch({SCRATCH_SLOTS.index("apk")}, sizeof(float) * ((M + FS_AP - 1) / FS_AP * FS_AP) * K);
    /* rows of A adjacent (a conv's pixels): FS_PACK_ROWS taps of every whole panel in turn, one
       FS_AP-float copy each (`fs_pack_rows`, as fs_pack_b_rows: A read as that many streams in
       order; 0.91x the time of panel after panel with a copy loop per tap on mobilenetv2's 1x1
       576->96 conv at 14x14, 0.97x on resnet50's 1024->256) */
    long long whole = am == 1 ? M / FS_AP * FS_AP : 0;
    fs_pack_rows(K, whole / FS_AP, FS_AP, A, ak, ap);
    for (long long i0 = whole; i0 < M; i0 += FS_AP) {{
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
   C[n * ldc + p] = sum_k band[px(p) + off[k]] * B[k][n] for the M output pixels p of a block (M /
   ow whole rows of ow pixels; pixel p at px(p) = (p / ow) * rs + (p % ow) * cs in the band, tap k
   at off[k]) and the N filters packed once (fs_pack_b).
   With AVX-512 the taps are read in place: each output row in panels of at most 12 pixels, of
   balanced widths (56 as 11 + 11 + 11 + 11 + 12, 14 as 7 + 7), every panel's tile a broadcast per
   pixel from band + off[k] (`fs_micro_taps`) times one or two filter panels; the taps in blocks
   of FS_TAP_BLOCK (192 taps of a filter-panel pair, 24 KiB, stay in L1 while FS_TAP_GROUP panels
   run over them; those panels' tiles carry the sums from block to block in L1), each tile stored
   transposed after the last block. Against copying the taps first into packed 12-pixel panels
   (16 floats a tap), interleaved on one Sapphire Rapids core (`benchmarks/variants/band_convs.py`
   at the commit that made this change; 13 k x k convs of resnet18, U-Net, yolo-neck, mobilenetv2):
   1.06-1.25x faster at 28x28 and wider, 1.00-1.12x at 14x14 and below, 1.07-1.15x at the
   3-channel stems, 1.44x over 16 filters (one panel, no padded second one).
   Without AVX-512: per chunk of pixels (its taps within
   `fs_band_chunk()` floats, in L2) the taps are packed into FS_AP-pixel panels: per FS_MR pixels one
   8-float copy where they are adjacent, the even floats of 16
   where they are every other one, single floats otherwise (the band has 16 floats of slack,
   `apk` 16: a copy writes past its FS_MR pixels, into floats the next copy writes again); then
   every filter panel runs over the chunk, each tile stored transposed (a partial one its part;
   the last panel repeats its last pixel). Every chunk streams all the filters, so a chunk's taps
   may take what of 7/8 of the L2 one pair of filter panels streaming past them leaves, when that
   is more than `fs_band_chunk()`: resnet's 3x3 convs at 7x7 (4608 taps, 9 MiB of filters) then
   take their 49 pixels in one chunk, not two */
enum {{ FS_BAND_CHUNK = 65536, FS_TAP_BLOCK = 192, FS_TAP_GROUP = 8 }};
/* this core's L2 in floats (sysconf, read once per thread), and the floats of packed taps per
   chunk: half of it (at least FS_BAND_CHUNK, which is half a 512 KiB L2), so a chunk and the filter panels streaming past it
   stay there; resnet's 3x3 convs at 14x14 and 7x7 (2304-4608 taps) ran 1.13-1.22x faster with
   half of a 2 MiB L2 than with 256 KiB, which split their pixels into chunks of 12-24 that each
   streamed every filter panel again; per thread, so OpenMP blocks never race on it */
static long long fs_l2_floats(void) {{
    static _Thread_local long long floats;
    if (!floats) {{
        long long l2 = 0;
#ifdef _SC_LEVEL2_CACHE_SIZE
        l2 = (long long)sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
        floats = l2 > 0 ? l2 / 4 : 2 * FS_BAND_CHUNK;
    }}
    return floats;
}}
long long fs_band_chunk(void) {{
    long long share = fs_l2_floats() / 2;
    return share > FS_BAND_CHUNK ? share : FS_BAND_CHUNK;
}}
void fs_conv_band(long long M, long long N, long long K, long long ow, long long rs, long long cs,
                         const float* band, const int* off, const float* Bp, float* C, long long ldc) {{
#if defined(__AVX512F__)
    long long per = (ow + FS_AP - 1) / FS_AP, panels = M / ow * per, base = ow / per, longer = per - ow % per;
    /* the taps in blocks of FS_TAP_BLOCK (their B rows in L1), every block over FS_TAP_GROUP panels at
       a time (their tiles, carrying the sums between blocks, in L1 too) */
    float tiles[FS_TAP_GROUP * FS_AP * 2 * FS_NR];
    for (long long n0 = 0; n0 < N; n0 += 2 * FS_NR) {{
        long long nr = N - n0 < 2 * FS_NR ? N - n0 : 2 * FS_NR;
        for (long long t0 = 0; t0 < panels; t0 += FS_TAP_GROUP) {{
            long long tn = panels - t0 < FS_TAP_GROUP ? panels - t0 : FS_TAP_GROUP;
            for (long long k0 = 0; k0 < K; k0 += FS_TAP_BLOCK) {{
                long long kc = K - k0 < FS_TAP_BLOCK ? K - k0 : FS_TAP_BLOCK;
                for (long long t = 0; t < tn; ++t) {{
                    long long r = (t0 + t) / per, q = (t0 + t) % per;
                    long long c0 = q * base + (q > longer ? q - longer : 0), mr = base + (q >= longer);
                    float* tile = tiles + t * FS_AP * 2 * FS_NR;
                    fs_micro_taps_rows((int)mr, nr > FS_NR, kc, band + r * rs + c0 * cs, cs, off + k0,
                                       Bp + n0 * K + k0 * FS_NR, FS_NR * K, tile, k0 > 0);
                    if (k0 + kc == K) {{
                        float* c = C + n0 * ldc + r * ow + c0;
                        for (long long j = 0; j < nr; ++j)
                            for (long long i = 0; i < mr; ++i) c[j * ldc + i] = tile[i * 2 * FS_NR + j];
                    }}
                }}
            }}
        }}
    }}
#else
    long long budget = fs_l2_floats() * 7 / 8 - K * FS_PANELS * FS_NR;
    budget = budget > fs_band_chunk() ? budget : fs_band_chunk();
    long long mc = budget / K / FS_AP * FS_AP;
    mc = mc < FS_AP ? FS_AP : mc > 16 * FS_MR ? 16 * FS_MR : mc;
    long long chunks = (M + mc - 1) / mc;  /* chunks of even size: a short last one streams all filters again */
    mc = ((M + chunks - 1) / chunks + FS_AP - 1) / FS_AP * FS_AP;
    float* ap = fs_scratch({SCRATCH_SLOTS.index("apk")}, sizeof(float) * (mc * K + 16));
    for (long long m0 = 0; m0 < M; m0 += mc) {{
        long long mn = M - m0 < mc ? M - m0 : mc;
        for (long long t0 = 0; t0 < mn; t0 += FS_AP) {{
            float* dst = ap + t0 * K;
            long long px[FS_AP], mr = mn - t0 < FS_AP ? mn - t0 : FS_AP;
            int mode[FS_AP / FS_MR];  /* per FS_MR pixels: 1 adjacent, 2 every other one, 0 neither */
            for (long long i = 0; i < FS_AP; ++i) {{
                long long p = m0 + t0 + (i < mr ? i : mr - 1);
                px[i] = p / ow * rs + p % ow * cs;
            }}
            for (long long h = 0; h < FS_AP; h += FS_MR) {{
                int adj = 1, every2 = 1;
                for (long long i = 1; i < FS_MR; ++i) {{
                    adj &= px[h + i] == px[h] + i;
                    every2 &= px[h + i] == px[h] + 2 * i;
                }}
                mode[h / FS_MR] = adj ? 1 : every2 ? 2 : 0;
            }}
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
#endif
}}
void fs_gemm_rows(long long M, long long N, long long K, const float* A, long long lda,
                         const float* Bp, float* C, long long ldc, const float* C0, long long ldc0, const float* R0) {{
    fs_gemm_rows_at(M, N, K, A, lda, Bp, C, ldc, C0, ldc0, R0, 0);
}}
/* a 1x1 conv's product C[M x N] (row stride ldc) = F[M x K] (filters, row stride lda, read in
   place) x X[K x N] (the input's pixels, row stride ldx): per chunk of pixels (its K x chunk
   panel within FS_BAND_CHUNK floats, in L2) X packed into FS_NR-wide panels (`bbuf`: by
   `fs_pack_b_rows` where X is the kernel's input read `in_place`, else, a prologue's panel in
   cache, by `fs_pack_b`), then `fs_gemm_rows` stores every tile straight into C's rows */
void fs_conv_1x1(long long M, long long N, long long K, const float* F, long long lda, const float* X,
                        long long ldx, float* C, long long ldc, int in_place) {{
    long long nc = FS_BAND_CHUNK / K / FS_NR * FS_NR;
    nc = nc < FS_NR ? FS_NR : nc;
    float* xp = fs_scratch({SCRATCH_SLOTS.index("bbuf")}, sizeof(float) * nc * K);
    for (long long n0 = 0; n0 < N; n0 += nc) {{
        long long nn = N - n0 < nc ? N - n0 : nc;
        if (in_place)
            fs_pack_b_rows(K, nn, X + n0, ldx, xp);
        else
            fs_pack_b(K, nn, X + n0, ldx, 1, 1.0f, xp);
        fs_gemm_rows(M, nn, K, F, lda, xp, C + n0, ldc, 0, 0, 0);
    }}
}}
"""

# C: the tile kernels with a tile epilogue inlined on their registers, where FS_TILE_EPI is defined
# (with AVX-512, `_TILE_EPI_ON`): _C_GEMM_ROWS and `fs_gemm_rows_epi`, compiled once per distinct
# epilogue into a unit of its own (`c_runtime.tile_kernels`) after the epilogue's definitions
_TILE_EPI_ON = "#if defined(__AVX512F__)\n#define FS_TILE_EPI 1\n#endif\n"
_GEMM_ROWS_EPI = ("void fs_gemm_rows_epi(long long M, long long N, long long K, const float* A, long long lda, "
                  "const float* Bp, float* C, long long ldc, const float* R0)")
_C_TILE_GEMM = ("#ifdef FS_TILE_EPI\n" + _C_GEMM_ROWS
                + """/* fs_gemm_rows with the kernel's tile epilogue on the product plus R0 (a bias row) before the one
   store: no block of the product kept and no second pass (`tile_epilogue`) */
""" + _GEMM_ROWS_EPI + """ {
    fs_gemm_rows_at(M, N, K, A, lda, Bp, C, ldc, 0, 0, R0, 1);
}
#endif
""")


# a tile epilogue's statements (`tile_epilogue`): temporaries, the argument v, float literals, the
# four operators, erf and GELU's x (1 + erf(x / sqrt 2)); GCC's vector extensions run the same text
# on 16 floats (a float operand broadcast), erf there by `fs_erf16`, the GELU by `fs_gelu2_16`
_TILE_TOKEN = re.compile(r"\s*(?:(v\d*)|(-?\d+(?:\.\d*)?(?:e-?\d+)?f)|(fs_erff|fs_gelu2f)(?=\()|([-+*/(),]))")
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
    statements, erf by `fs_erf16`, the GELU by `fs_gelu2_16`), which `fs_gemm_rows_epi` applies to each tile before its one
    store; FS_TILE_EPI is defined only with AVX-512 (elsewhere the kernel keeps its block epilogue).
    The tile kernels are compiled after these definitions, once per distinct epilogue, in a unit the
    kernel links (`c_runtime.tile_kernels`): the epilogue is inlined on their registers.
    None when a statement holds anything else (a load, an index, a select, another call)."""
    statements = [_TILE_STATEMENT.fullmatch(line) for line in lines]
    if any(m is None or not _tile_expression(m.group(2)) for m in statements) or not _tile_expression(result):
        return None
    scalar = "".join(f"    {line}\n" for line in lines)
    vector = "".join(f"    __m512 {m.group(1)} = {m.group(2).replace('fs_erff(', 'fs_erf16(').replace('fs_gelu2f(', 'fs_gelu2_16(')};\n"
                     for m in statements)
    return (_TILE_EPI_ON + "#ifdef FS_TILE_EPI\n#include <immintrin.h>\n" + _erf_avx512() + gelu_avx512()
            + f"static inline float fs_tile_epi1(float v) {{\n{scalar}    return {result};\n}}\n"
            + f"static inline __m512 fs_tile_epi(__m512 v) {{\n{vector}    return {result};\n}}\n#endif\n")
