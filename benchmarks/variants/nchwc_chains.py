"""An NCHWc tile of fewer sums than the FMA units keep busy (`schedule.nchwc_chains`) split into
chains of sums added once at the end, against one chain (FMA_CHAINS = 1): a dense conv's border
pixel (2 output blocks x 1 pixel at block 8: two sums, each FMA waiting on the one before) by
its input lanes; a depthwise conv's border pixels and short rows by the filter's rows.
resnet18's 3x3 convs at 7 x 7 pixels (4 of 49 pixels are corners, each a tile of one pixel) and
14 x 14, resnet50's 3x3 at 7 x 7, mobilenetv2's depthwise convs at 112, 56, 28, 14 and 7 pixels a
side, in channel blocks (LAYOUT):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ab_group.py benchmarks/variants/nchwc_chains.py

(The depthwise rule for rows of 5-7 pixels: `nchwc_depthwise_chains.py`.) Measured: see
docs/benchmarks.md, "Chains of sums in a border pixel's tile"."""
LAYOUT = "nchwc"
GROUPS = [("resnet18", ("conv_18", "relu_15")), ("resnet18", ("conv_13", "relu_11")),
          ("resnet50", ("conv_48", "relu_44")), ("mobilenetv2", ("conv_1", "clip_1")),
          ("mobilenetv2", ("conv_7", "clip_5")), ("mobilenetv2", ("conv_13", "clip_9")),
          ("mobilenetv2", ("conv_22", "clip_15")), ("mobilenetv2", ("conv_49", "clip_33"))]
CONSTANTS = {"one chain": {"FMA_CHAINS": 1}}
