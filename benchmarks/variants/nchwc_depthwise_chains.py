"""A depthwise NCHWc tile of 5-7 pixels (`schedule.nchwc_chains`): its filter rows in two chains
(rows 0 and 2 into one, row 1 into the other: 10-12 accumulators) against chains for tiles of 4
pixels at most (FMA_CHAINS = 5, the rule before: a 7 x 7 row's 5 interior pixels, a 14 x 14
row's tiles of 6 and a 28 x 28 row's in one chain). mobilenetv2's depthwise convs at 28, 14 and
7 pixels a side, in channel blocks (LAYOUT):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ab_group.py benchmarks/variants/nchwc_depthwise_chains.py

Measured: see docs/benchmarks.md, "Chains of sums in a border pixel's tile"."""
LAYOUT = "nchwc"
GROUPS = [("mobilenetv2", ("conv_13", "clip_9")),
          ("mobilenetv2", ("conv_22", "clip_15")), ("mobilenetv2", ("conv_43", "clip_29")),
          ("mobilenetv2", ("conv_49", "clip_33"))]
CONSTANTS = {"chains for 4 pixels at most": {"FMA_CHAINS": 5}}
