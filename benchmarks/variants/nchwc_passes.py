"""The NCHWc conv's passes over its input blocks, on resnet50's 1x1 convs over 512-2048 channels
in channel blocks (LAYOUT; measured with AVX2's block 8 and 2 x 6 tiles): passes of at most 8
input blocks (`schedule.NCHWC_PASS_BLOCKS`) against the 64 that the tile's filter slice alone
allows at block 8 (each input block is a stream of its own):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ab_group.py benchmarks/variants/nchwc_passes.py

Measured and kept: see docs/benchmarks.md, "Passes and rows of the NCHWc convs"."""
LAYOUT = "nchwc"
GROUPS = [("resnet50", ("conv_28", "relu_25")), ("resnet50", ("conv_43", "relu_40")),
          ("resnet50", ("conv_47", "relu_43")), ("resnet50", ("conv_27",)), ("resnet50", ("conv_46",))]
VARIANTS = {
    "passes of 64 input blocks": [(r"c0 \+= 8LL", "c0 += 64LL"),
                                  (r"c0 \+ 8LL < (\d+)LL \? c0 \+ 8LL", r"c0 + 64LL < \1LL ? c0 + 64LL")],
}
