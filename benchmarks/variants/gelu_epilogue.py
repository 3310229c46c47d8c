"""bert-small's FFN up-projection group: LayerNorm's apply as the prologue (written out, a later
residual reads it), the product over weights packed once, then bias and GELU (erf) on the product
block. What the erf costs (taken out, and without its division: bounds), and three changes
measured and not kept: erf clamped by a min and a max, the epilogue run per block of 12 rows (the
product block in L1 rather than L2), and the LayerNorm's statistics computed in the prologue
(here recomputed from the centered rows it reads: the same values, and the cost of computing
them there, against the separate
statistics kernel the plan runs before this group)."""
import re

MODEL = "bert-small"
GROUP = "Add+Sqrt+Div+Mul+Add+MatMul+Add+Div+Erf+Add+Mul"

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
    "erf taken out": [(r"= fs_erff\(", "= (")],
    "erf without its division": [(r"return t \* p / q;", "return t * p * q;")],
    "erf clamped by min and max": [
        (re.escape("float t = fabsf(x) > 3.6173997f ? copysignf(3.6173997f, x) : x;"),
         "float t = x > 3.6173997f ? 3.6173997f : x; t = t < -3.6173997f ? -3.6173997f : t;")],
    "epilogue per 12 rows": [(r"if \(mb > \d+LL\) mb = \d+LL;", "if (mb > 12LL) mb = 12LL;")],
    "LayerNorm statistics in the prologue": [(re.escape(_APPLY), _STATS)],
}
BOUNDS = ("erf taken out", "erf without its division")
