"""bert-small's 128x128x128 key projection (MatMul + bias, weights packed once): the AVX-512
micro-kernel `fs_micro_x2` (12 rows x two 16-float B panels, its k loop unrolled 8 times) inside
`fs_gemm_rows` (B's columns in blocks of FS_ROWS_B_BLOCK floats, kept in L2). Changes measured and
not kept: B blocks sized for L1, the k loop unrolled 4 or 16 times, and the next pair of B panels
prefetched into L1 while the current one runs (for a first row block that finds B in L3)."""
import re

MODEL = "bert-small"
NODES = ("matmul_1", "add_5")

_LOOP = "#pragma GCC unroll 8\n    for (long long k = 0; k < K; ++k, a += ak"
_LOADS = "__m512 u = _mm512_loadu_ps(b), v = _mm512_loadu_ps(b2);"
_AHEAD = (_LOADS + " _mm_prefetch((const char*)(b + 2 * FS_NR * K), _MM_HINT_T0);"
          " _mm_prefetch((const char*)(b2 + 2 * FS_NR * K), _MM_HINT_T0);")

VARIANTS = {
    "B blocks of 12K floats (L1)": [(r"FS_ROWS_B_BLOCK = \d+", "FS_ROWS_B_BLOCK = 12288")],
    "k loop unrolled 4 times": [(re.escape(_LOOP), _LOOP.replace("unroll 8", "unroll 4"))],
    "k loop unrolled 16 times": [(re.escape(_LOOP), _LOOP.replace("unroll 8", "unroll 16"))],
    "next B panels prefetched": [(re.escape(_LOADS), _AHEAD)],
}
