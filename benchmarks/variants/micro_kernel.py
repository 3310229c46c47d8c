"""bert-small's products with their weights packed once (GROUPS: the 128x128x128 key projection
with its bias, the FFN up-projection with bias + GELU, the down-projection with the residual): the
AVX-512 micro-kernel `fs_micro_x2` (12 rows x two 16-float B panels, its k loop unrolled 8 times) inside
`fs_gemm_rows` (B's columns in blocks of FS_ROWS_B_BLOCK floats, kept in L2). Changes measured and
not kept: B blocks sized for L1, B's panel pairs outer (each pair kept in L1 while every row block
of A runs over it, A's rows read from L2: the loop order of a BLAS that packs A), the k loop
unrolled 4 or 16 times, and the next pair of B panels prefetched into L1 while the current one
runs (for a first row block that finds B in L3)."""
import re

GROUPS = [("bert-small", ("matmul_1", "add_5")),
          ("bert-small", ("matmul_14", "add_26", "div_7", "erf_1", "add_27", "mul_7")),
          ("bert-small", ("mul_8", "matmul_15", "add_28", "add_29"))]

_LOOP = "#pragma GCC unroll 8\n    for (long long k = 0; k < K; ++k, a += ak"
_LOADS = "__m512 u = _mm512_loadu_ps(b), v = _mm512_loadu_ps(b2);"
_AHEAD = (_LOADS + " _mm_prefetch((const char*)(b + 2 * FS_NR * K), _MM_HINT_T0);"
          " _mm_prefetch((const char*)(b2 + 2 * FS_NR * K), _MM_HINT_T0);")

VARIANTS = {
    "B blocks of 12K floats (L1)": [(r"FS_ROWS_B_BLOCK = \d+", "FS_ROWS_B_BLOCK = 12288")],
    "B panel pairs outer": [(r"FS_ROWS_B_BLOCK = \d+", "FS_ROWS_B_BLOCK = 1")],
    "k loop unrolled 4 times": [(re.escape(_LOOP), _LOOP.replace("unroll 8", "unroll 4"))],
    "k loop unrolled 16 times": [(re.escape(_LOOP), _LOOP.replace("unroll 8", "unroll 16"))],
    "next B panels prefetched": [(re.escape(_LOADS), _AHEAD)],
}
