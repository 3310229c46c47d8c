"""A conv whose filters pass NCHWC_GROUP_FILTERS_BYTES over several blocks of rows, in groups of
tiles outermost (each group's filters read once over all rows: the default) against one group
(every block of rows streaming all the filters, the order before); resnet50's 1024 -> 2048
downsampling conv (8 MiB of filters, 7 blocks of one row) in channel blocks, cold (`--flush`:
its filters come from memory, as in the program) and warm:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ab_group.py benchmarks/variants/nchwc_filter_groups.py --flush 256
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/ab_group.py benchmarks/variants/nchwc_filter_groups.py --flush 256

Measured and kept: see docs/benchmarks.md, "Passes and rows of the NCHWc convs"."""
LAYOUT = "nchwc"
GROUPS = [("resnet50", ("conv_46",))]
CONSTANTS = {
    "one group": {"NCHWC_GROUP_FILTERS_BYTES": 1 << 40},
    "groups of 64 KiB (one tile)": {"NCHWC_GROUP_BYTES": 64 << 10},
}
