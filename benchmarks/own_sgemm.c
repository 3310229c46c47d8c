/* A packed, register-blocked single-precision GEMM (AVX2 + FMA), measured against the BLAS the CPU
 * backend calls per block (benchmarks/bench_cpu.py, section 1b).
 *
 * C[M, N] = A[M, K] * B[K, N], row-major. B is a constant (a weight): it is packed once, before the
 * timing, into panels of NR = 16 columns (K x 16, zero-padded), the layout the micro-kernel reads
 * with two aligned 8-float loads per k. A is packed per KC x MC block into panels of MR = 6 rows
 * (KC x 6). The micro-kernel keeps a 6 x 16 tile of C in 12 ymm accumulators and does 12 FMAs per
 * k against 2 loads and 6 broadcasts. K is blocked by KC (the A panel and a B panel stay in L1/L2),
 * M by MC. Partial tiles (M % 6, N % 16) go through a stack tile.
 */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

enum { MR = 6, NR = 16, KC = 256, MC = 96 };

/* Bp: ceil(N / 16) panels of K x 16 floats. */
long long own_packed_b_floats(int K, int N) { return (long long)((N + NR - 1) / NR) * K * NR; }

void own_pack_b(int K, int N, const float* B, float* Bp) {
    for (int n0 = 0; n0 < N; n0 += NR) {
        float* dst = Bp + (long long)(n0 / NR) * K * NR;
        int nr = N - n0 < NR ? N - n0 : NR;
        for (int k = 0; k < K; ++k) {
            const float* src = B + (long long)k * N + n0;
            int j = 0;
            for (; j < nr; ++j) dst[k * NR + j] = src[j];
            for (; j < NR; ++j) dst[k * NR + j] = 0.0f;
        }
    }
}

static void pack_a(int mc, int kc, const float* A, int lda, float* Ap) {
    for (int m0 = 0; m0 < mc; m0 += MR) {
        int mr = mc - m0 < MR ? mc - m0 : MR;
        float* dst = Ap + (long long)(m0 / MR) * kc * MR;
        for (int k = 0; k < kc; ++k) {
            int i = 0;
            for (; i < mr; ++i) dst[k * MR + i] = A[(long long)(m0 + i) * lda + k];
            for (; i < MR; ++i) dst[k * MR + i] = 0.0f;
        }
    }
}

/* c (ldc) += or = a_panel (kc x 6) * b_panel (kc x 16), first block overwrites. */
static void micro_6x16(int kc, const float* a, const float* b, float* c, int ldc, int accumulate) {
    __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps(), c10 = _mm256_setzero_ps(),
           c11 = _mm256_setzero_ps(), c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps(),
           c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps(), c40 = _mm256_setzero_ps(),
           c41 = _mm256_setzero_ps(), c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
    for (int k = 0; k < kc; ++k) {
        __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8), x;
        x = _mm256_broadcast_ss(a + 0); c00 = _mm256_fmadd_ps(x, b0, c00); c01 = _mm256_fmadd_ps(x, b1, c01);
        x = _mm256_broadcast_ss(a + 1); c10 = _mm256_fmadd_ps(x, b0, c10); c11 = _mm256_fmadd_ps(x, b1, c11);
        x = _mm256_broadcast_ss(a + 2); c20 = _mm256_fmadd_ps(x, b0, c20); c21 = _mm256_fmadd_ps(x, b1, c21);
        x = _mm256_broadcast_ss(a + 3); c30 = _mm256_fmadd_ps(x, b0, c30); c31 = _mm256_fmadd_ps(x, b1, c31);
        x = _mm256_broadcast_ss(a + 4); c40 = _mm256_fmadd_ps(x, b0, c40); c41 = _mm256_fmadd_ps(x, b1, c41);
        x = _mm256_broadcast_ss(a + 5); c50 = _mm256_fmadd_ps(x, b0, c50); c51 = _mm256_fmadd_ps(x, b1, c51);
        a += MR;
        b += NR;
    }
    __m256 acc[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
    for (int i = 0; i < MR; ++i) {
        float* row = c + (long long)i * ldc;
        if (accumulate) {
            acc[2 * i] = _mm256_add_ps(acc[2 * i], _mm256_loadu_ps(row));
            acc[2 * i + 1] = _mm256_add_ps(acc[2 * i + 1], _mm256_loadu_ps(row + 8));
        }
        _mm256_storeu_ps(row, acc[2 * i]);
        _mm256_storeu_ps(row + 8, acc[2 * i + 1]);
    }
}

/* C = A * B with B packed by own_pack_b; one thread. */
void own_sgemm(int M, int N, int K, const float* A, const float* Bp, float* C) {
    float* Ap = (float*)aligned_alloc(64, sizeof(float) * MC * KC);
    float tile[MR * NR];
    for (int k0 = 0; k0 < K; k0 += KC) {
        int kc = K - k0 < KC ? K - k0 : KC;
        for (int m0 = 0; m0 < M; m0 += MC) {
            int mc = M - m0 < MC ? M - m0 : MC;
            pack_a(mc, kc, A + (long long)m0 * K + k0, K, Ap);
            for (int n0 = 0; n0 < N; n0 += NR) {
                const float* bp = Bp + (long long)(n0 / NR) * K * NR + (long long)k0 * NR;
                int nr = N - n0 < NR ? N - n0 : NR;
                for (int i0 = 0; i0 < mc; i0 += MR) {
                    int mr = mc - i0 < MR ? mc - i0 : MR;
                    float* c = C + (long long)(m0 + i0) * N + n0;
                    const float* ap = Ap + (long long)(i0 / MR) * kc * MR;
                    if (mr == MR && nr == NR) {
                        micro_6x16(kc, ap, bp, c, N, k0 > 0);
                    } else {  /* a partial tile through the stack */
                        for (int i = 0; i < mr; ++i) memcpy(tile + i * NR, c + (long long)i * N, sizeof(float) * nr);
                        micro_6x16(kc, ap, bp, tile, NR, k0 > 0);
                        for (int i = 0; i < mr; ++i) memcpy(c + (long long)i * N, tile + i * NR, sizeof(float) * nr);
                    }
                }
            }
        }
    }
    free(Ap);
}

/* The BLAS the CPU backend links, called the same way (row-major, no transposes). */
#ifdef FS_BLAS_SGEMM
void FS_BLAS_SGEMM(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
void blas_sgemm(int M, int N, int K, const float* A, const float* B, float* C) {
    FS_BLAS_SGEMM(101, 111, 111, M, N, K, 1.0f, A, K, B, N, 0.0f, C, N);
}
#endif
