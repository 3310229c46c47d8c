"""resnet18's 3x3 64->64 conv at 56x56 + ReLU (`fs_conv_band`): per block of output rows the input
computed once into a zero-bordered band; with AVX-512 the micro-kernel reads each tap's pixels
from the band in place (a broadcast per pixel of a panel within an output row) over the filters
packed once, the taps in blocks whose filter rows stay in L1, each tile stored transposed into
the block's channels x pixels, then the epilogue's pass. As a variant, the path without
AVX-512: the taps copied first into packed panels (8 floats per 6 adjacent pixels) for the same
micro-kernel. What the epilogue's stores cost, taken out (a bound; the tiles' transposed stores:
band_stores.py)."""
import re

MODEL = "resnet18"
NODES = ("conv_1", "relu_1")

_OUT = re.escape("out0[(co)*3136LL + ((p0 + q))] = v5;")

VARIANTS = {
    "taps packed first": [(r"#if defined\(__AVX512F__\)\n    long long per = ", "#if 0\n    long long per = ")],
    "no epilogue stores": [(_OUT, "if (v5 == 12345.f) out0[(co)*3136LL + ((p0 + q))] = v5;")],
}
BOUNDS = ("no epilogue stores",)
