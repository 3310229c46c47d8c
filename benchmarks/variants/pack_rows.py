"""mobilenetv2's 1x1 144->24 conv at 56x56 with the residual Add after it: `fs_conv_1x1` packs
its input, read in place (1.7 MiB, the feature map's channels a page or more apart), into
16-pixel panels per chunk, then our micro-kernel runs the 24 filters over them. The pack reads
FS_PACK_ROWS rows at a time, every panel's part of them in turn (`fs_pack_b_rows`); measured
against packing column by column (each panel down all its rows: `fs_pack_b`, which a prologue's
panel, already in cache, packs faster with) and against 1 and 16 rows at a time."""
import re

MODEL = "mobilenetv2"
NODES = ("conv_8", "add_0")

_CALL = re.escape("fs_pack_b_rows(K, nn, X + n0, ldx, xp);")

VARIANTS = {
    "column by column (fs_pack_b)": [(_CALL, "fs_pack_b(K, nn, X + n0, ldx, 1, xp);")],
    "row by row": [(r"FS_PACK_ROWS = 8 \}", "FS_PACK_ROWS = 1 }")],
    "16 rows at a time": [(r"FS_PACK_ROWS = 8 \}", "FS_PACK_ROWS = 16 }")],
}
