"""mobilenetv2's 1x1 576->96 conv at 14x14 behind a Clip: the Clip written into a panel (the
block's channels x pixels), then `fs_gemm_packed` packs that panel into 12-pixel panels of A and
runs the 96 filters, packed once, over them. With the pixels adjacent, A is packed FS_PACK_ROWS
taps at a time, every whole panel's part of them in turn, one 12-float copy each; measured
against panel after panel with a copy loop per tap, as it was (`whole` 0: every panel through
the general loop)."""
import re

MODEL = "mobilenetv2"
NODES = ("clip_25", "conv_38")

VARIANTS = {
    "panel after panel": [(re.escape("long long whole = am == 1 ? M / FS_AP * FS_AP : 0;"), "long long whole = 0;")],
}
