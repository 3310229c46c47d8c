"""mobilenetv2's strided depthwise conv (3x3, stride 2, 96 channels at 112x112, a Clip before and
after): per channel each input row, the Clip applied, into a contiguous buffer that `fs_split2`
splits by column parity into two zero-bordered planes (the fill), then every output row is one
vector loop over them. What each part costs,
taken out (bounds): the fill (its row loop skipped; the planes keep the previous call's values)
and the output rows after the first."""
MODEL = "mobilenetv2"
NODES = ("clip_2", "conv_4", "clip_3")
VARIANTS = {
    "no fill": [(r"        for \(long long ih = 0; ih < 112LL; \+\+ih\) \{", "        for (long long ih = 0; ih < 0LL; ++ih) {")],
    "one output row": [(r"        for \(long long oh = 0; oh < 56LL; \+\+oh\) \{", "        for (long long oh = 0; oh < 1LL; ++oh) {")],
}
BOUNDS = ("no fill", "one output row")
