"""resnet18's 3x3 64->64 conv at 56x56 + ReLU (`fs_conv_band`): per block of output rows the input
computed once into a zero-bordered band, then per chunk of pixels their taps packed 12 pixels
per 16-float copy into panels for our micro-kernel over the filters packed once, each tile
stored transposed into the block's channels x pixels, then the epilogue's pass. What the parts
cost, each taken out (bounds): the taps' packing (loads and stores, then each alone), the
transposed stores of the tiles and the epilogue's stores; and one change measured and not kept:
12-float masked stores instead of 16-float ones that run into the next row."""
import re

MODEL = "resnet18"
NODES = ("conv_1", "relu_1")

_COPY = re.escape("for (long long k = 0; k < K; ++k) _mm512_storeu_ps(dst + k * FS_AP, _mm512_loadu_ps(src + off[k]));")
_STORE = re.escape("for (long long i = 0; i < mr; ++i) c[j * ldc + i] = tile[i * FS_PANELS * FS_NR + j];")
_OUT = re.escape("out0[(co)*3136LL + ((p0 + q))] = v5;")

VARIANTS = {
    "no tap packing": [(_COPY, "(void)src;")],
    "tap loads only": [(_COPY, "__m512 acc_ = _mm512_setzero_ps(); for (long long k = 0; k < K; ++k) "
                               "acc_ = _mm512_add_ps(acc_, _mm512_loadu_ps(src + off[k])); _mm512_storeu_ps(dst, acc_);")],
    "tap stores only": [(_COPY, "for (long long k = 0; k < K; ++k) _mm512_storeu_ps(dst + k * FS_AP, _mm512_loadu_ps(src));")],
    "no transposed tile stores": [(_STORE, "(void)tile;")],
    "no epilogue stores": [(_OUT, "if (v5 == 12345.f) out0[(co)*3136LL + ((p0 + q))] = v5;")],
    "masked 12-float tap stores": [(_COPY, "for (long long k = 0; k < K; ++k) "
                                           "_mm512_mask_storeu_ps(dst + k * FS_AP, 0x0FFF, _mm512_loadu_ps(src + off[k]));")],
}
BOUNDS = ("no tap packing", "tap loads only", "tap stores only", "no transposed tile stores", "no epilogue stores")
