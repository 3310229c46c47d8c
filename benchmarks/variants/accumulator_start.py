"""bert-small's 128x128x128 value projection with its bias, and its output projection with bias and
residual: the AVX-512 micro-kernel (`fs_micro_x2`, 12 rows x two B panels) starts its accumulators
at zero and adds the bias row and the residual at the store. Change measured and not kept (one
Sapphire Rapids core, 5 interleaved rounds): the accumulators started at bias + residual, so no
add follows the k loop: 1.006x and 1.018x the base's time (the adds at the store overlap the
stores; starting from them rounds differently from ONNX Runtime's MatMul then Add, 2e-7 and 6e-7
relative here)."""
GROUPS = [("bert-small", ("matmul_1", "add_5")), ("bert-small", ("matmul_13", "add_22", "add_23"))]
_START = r"for \(int i = 0; i < rows; \+\+i\) x\[i\] = y\[i\] = _mm512_setzero_ps\(\);"
_FROM_TERMS = ("for (int i = 0; i < rows; ++i) { x[i] = r0 ? _mm512_loadu_ps(r0) : _mm512_setzero_ps();"
               " y[i] = r0 ? _mm512_loadu_ps(r0 + FS_NR) : _mm512_setzero_ps();"
               " if (c0) { x[i] = _mm512_add_ps(x[i], _mm512_loadu_ps(c0 + i * ldc0));"
               " y[i] = _mm512_add_ps(y[i], _mm512_loadu_ps(c0 + i * ldc0 + FS_NR)); } }")
VARIANTS = {
    "accumulators start at bias + residual": [
        (_START, _FROM_TERMS),
        (r"    if \(r0\) \{\n        __m512 r = _mm512_loadu_ps\(r0\), t = _mm512_loadu_ps\(r0 \+ FS_NR\);",
         "    if (0) {\n        __m512 r = _mm512_loadu_ps(r0), t = _mm512_loadu_ps(r0 + FS_NR);"),
        (r"    if \(c0\) \{\n#pragma GCC unroll 12\n        for \(int i = 0; i < rows; \+\+i\) \{\n            x\[i\] = _mm512_add_ps",
         "    if (0) {\n#pragma GCC unroll 12\n        for (int i = 0; i < rows; ++i) {\n            x[i] = _mm512_add_ps"),
    ],
}
