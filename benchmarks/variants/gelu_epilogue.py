"""bert-small's FFN up-projection group: LayerNorm's apply as the prologue (written out, a later
residual reads it), the product over weights packed once, then bias and GELU (erf): with AVX-512
on the micro-kernel's registers before the one store (`fs_gemm_rows_epi`, the tile epilogue),
elsewhere on a block of the product in a second pass. What the erf costs (taken out, and without
its division: bounds), the block epilogue the tile epilogue replaced, and one change measured and
not kept: the LayerNorm's statistics computed in the prologue (here recomputed from the centered
rows it reads: the same values, and the cost of computing them there, against the separate
statistics kernel the plan runs before this group)."""
import re

MODEL = "bert-small"
NODES = ("add_10", "sqrt_1", "div_2", "mul_2", "add_11", "matmul_6", "add_12", "div_3", "erf_0", "add_13", "mul_3")

_APPLY = """        float h1_v2 = in0[o];
        float h1_v3 = (h1_v2 + 9.999999960041972e-13f);"""
_STATS = """        float sm = 0.0f, sq = 0.0f;
        #pragma omp simd reduction(+:sm)
        for (long long j = 0; j < 128LL; ++j) sm += in2[(o)*128LL + j];
        float mean = sm * 0.0078125f;
        #pragma omp simd reduction(+:sq)
        for (long long j = 0; j < 128LL; ++j) { float d = in2[(o)*128LL + j] - mean; sq += d * d; }
        float h1_v3 = (sq * 0.0078125f + 9.999999960041972e-13f);"""

VARIANTS = {
    "erf taken out": [(r"= fs_erff\(", "= ("), (r"= fs_erf16\(", "= (")],
    "erf without its division": [(r"return t \* p / q;", "return t * p * q;"),
                                 (re.escape("return _mm512_div_ps(_mm512_mul_ps(t, p), q);"),
                                  "return _mm512_mul_ps(_mm512_mul_ps(t, p), q);")],
    "block epilogue (no tile epilogue)": [(r"#define FS_TILE_EPI 1\n", "")],
    "LayerNorm statistics in the prologue": [(re.escape(_APPLY), _STATS)],
}
BOUNDS = ("erf taken out", "erf without its division")
