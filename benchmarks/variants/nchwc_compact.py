"""A strided 1x1 conv read in place (its tiles' pixels a stride apart, every other input row
skipped, rows by its filters against its whole input) against its blocks' pixels copied
together first and read without a stride (`schedule.NCHWC_COMPACT`, `nchwc_compacts`: rows by
its filters against the pixels it copies); resnet18's and resnet50's downsampling 1x1 convs in
channel blocks (LAYOUT; measured with AVX2's block 8), each variant generated afresh with the
constant set otherwise (CONSTANTS):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ab_group.py benchmarks/variants/nchwc_compact.py

Measured and kept: see docs/benchmarks.md, "Strided 1x1 convs over their pixels copied together"."""
LAYOUT = "nchwc"
GROUPS = [("resnet18", ("conv_7",)), ("resnet18", ("conv_17",)), ("resnet50", ("conv_14",)),
          ("resnet50", ("conv_27",)), ("resnet50", ("conv_46",))]
CONSTANTS = {"read in place": {"NCHWC_COMPACT": False}}
