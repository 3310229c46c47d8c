"""A strided 1x1 conv's blocks of output rows (`schedule.NCHWC_SKIP_ROWS_BYTES`: the input rows a
block reads within 128 KiB, one output row here) against all its rows in one block, what its
filters outweighing its input chose before (the whole input, more than the L2 holds, streamed
once per tile), and against blocks of 2 rows (within 256 KiB); resnet50's downsampling 1x1 convs (512 -> 1024 at
28 -> 14 pixels a side, 1024 -> 2048 at 14 -> 7) in channel blocks (LAYOUT; measured with AVX2's
block 8), each variant generated afresh with the constant set otherwise (CONSTANTS):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ab_group.py benchmarks/variants/nchwc_strided_rows.py

Measured and kept: see docs/benchmarks.md, "Passes and rows of the NCHWc convs"."""
LAYOUT = "nchwc"
GROUPS = [("resnet50", ("conv_27",)), ("resnet50", ("conv_46",))]
CONSTANTS = {
    "all rows in one block": {"NCHWC_SKIP_ROWS_BYTES": 1 << 40},
    "blocks of 2 rows": {"NCHWC_SKIP_ROWS_BYTES": 256 << 10},
}
