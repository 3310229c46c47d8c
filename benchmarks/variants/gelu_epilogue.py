"""bert-small's FFN up-projection group: LayerNorm's apply as the prologue (written out, a later
residual reads it), the product over weights packed once, then bias and GELU: with AVX-512 on the
micro-kernel's registers before the one store (`fs_gemm_rows_epi`, the tile epilogue), elsewhere on
a block of the product in a second pass. The GELU's x (1 + erf(x / sqrt 2)) is one call
(`fs_gelu2_16`: erf's fit with 1/sqrt 2 in its coefficients, the 1 + and the product by x one FMA).
What it costs (taken out, and without its division: bounds), the four ops it replaced (x / sqrt 2,
erf, + 1, times x, erf the same fit: what folding them gained), the block epilogue the tile
epilogue replaced, and changes measured and not kept: the LayerNorm's statistics computed in the
prologue (here recomputed from the centered rows it reads: the same values, and the cost of
computing them there, against the separate statistics kernel the plan runs before this group);
the division replaced by rcp14 and a Newton step."""
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

_GELU = re.escape("""    __m512 v1 = fs_gelu2_16(v);""")
_FOUR_OPS = """    __m512 a = (v * 0.7071067811865476f);
    __m512 v1 = (v * (fs_erf16(a) + 1.0f));"""
_DIVISION = re.escape("return _mm512_fmadd_ps(x, _mm512_div_ps(_mm512_mul_ps(t, p), q), x);")
_NEWTON = """__m512 r = _mm512_rcp14_ps(q);
    r = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, r, _mm512_set1_ps(1.0f)), r, r);
    return _mm512_fmadd_ps(x, _mm512_mul_ps(_mm512_mul_ps(t, p), r), x);"""

VARIANTS = {
    "GELU taken out": [(r"= fs_gelu2f\(", "= ("), (r"= fs_gelu2_16\(", "= (")],
    "GELU without its division": [(r"return FS_FMA\(x, t \* p / q, x\);", "return FS_FMA(x, t * p * q, x);"),
                                  (_DIVISION, "return _mm512_fmadd_ps(x, _mm512_mul_ps(_mm512_mul_ps(t, p), q), x);")],
    "GELU as four ops": [(_GELU, _FOUR_OPS)],
    "block epilogue (no tile epilogue)": [(r"#define FS_TILE_EPI 1\n", "")],
    "LayerNorm statistics in the prologue": [(re.escape(_APPLY), _STATS)],
    "GELU division by rcp14 + Newton": [(_DIVISION, _NEWTON)],
}
BOUNDS = ("GELU taken out", "GELU without its division")
