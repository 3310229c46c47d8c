"""What the band conv's transposed tile stores cost (`fs_conv_band` with AVX-512: each 12-pixel x
32-filter tile stored into the block's channels x pixels, 384 scalar stores) where the taps are
few: resnet18's 7x7 stem (147 taps) and mobilenetv2's 3x3 stem (27 taps), both 3 channels at
stride 2, against resnet18's 3x3 at 56x56 (576 taps). The bound: one vector of each tile's sums
stored instead (the tile still computed)."""
import re

GROUPS = [
    ("resnet18", ("conv_0", "relu_0")),
    ("mobilenetv2", ("conv_0", "clip_0")),
    ("resnet18", ("conv_1", "relu_1")),
]
_STORE = re.escape("for (long long i = 0; i < mr; ++i) c[j * ldc + i] = tile[i * 2 * FS_NR + j];")
VARIANTS = {"one vector stored per tile": [(_STORE, "{ __m512 t_ = _mm512_setzero_ps(); for (long long i = 0; i < mr; ++i) "
                                           "t_ = _mm512_add_ps(t_, _mm512_add_ps(_mm512_loadu_ps(tile + i * 2 * FS_NR), "
                                           "_mm512_loadu_ps(tile + i * 2 * FS_NR + FS_NR))); _mm512_storeu_ps(c, t_); break; }")]}
BOUNDS = ("one vector stored per tile",)
