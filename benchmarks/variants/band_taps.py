"""resnet18's 3x3 64->64 conv at 56x56 + ReLU (`fs_conv_band`): per block of output rows the input
computed once into a zero-bordered band; with AVX-512 the micro-kernel reads each tap's pixels
from the band in place (a broadcast per pixel of a panel within an output row) over the filters
packed once, the taps in blocks whose filter rows stay in L1, each tile stored transposed into
the block's channels x pixels, then the epilogue's pass. As a variant, the path without
AVX-512: the taps copied first into packed panels (8 floats per 6 adjacent pixels) for the same
micro-kernel. What the parts cost, taken out (bounds): the tiles'
transposed stores (one vector of their sums stored instead) and the epilogue's stores."""
import re

MODEL = "resnet18"
NODES = ("conv_1", "relu_1")

_STORE = re.escape("for (long long i = 0; i < mr; ++i) c[j * ldc + i] = tile[i * 2 * FS_NR + j];")
_OUT = re.escape("out0[(co)*3136LL + ((p0 + q))] = v5;")

VARIANTS = {
    "taps packed first": [(r"#if defined\(__AVX512F__\)\n    long long per = ", "#if 0\n    long long per = ")],
    "one vector stored per tile": [(_STORE, "{ __m512 t_ = _mm512_setzero_ps(); for (long long i = 0; i < mr; ++i) "
                                           "t_ = _mm512_add_ps(t_, _mm512_add_ps(_mm512_loadu_ps(tile + i * 2 * FS_NR), "
                                           "_mm512_loadu_ps(tile + i * 2 * FS_NR + FS_NR))); _mm512_storeu_ps(c, t_); break; }")],
    "no epilogue stores": [(_OUT, "if (v5 == 12345.f) out0[(co)*3136LL + ((p0 + q))] = v5;")],
}
BOUNDS = ("one vector stored per tile", "no epilogue stores")
