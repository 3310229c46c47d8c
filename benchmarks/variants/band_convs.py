"""Every k x k conv shape of resnet18, U-Net, yolo-neck and mobilenetv2's stem (`fs_conv_band`),
each group as the host plans it: the taps read in place from the band by the micro-kernel (with
AVX-512) against the taps copied first into packed panels, as the path without AVX-512 does (8
floats per 6 adjacent pixels). The change itself was measured against 16-float copies of 12
adjacent pixels, a branch since deleted (figures in docs/benchmarks.md, from this file at the commit
that added it)."""
GROUPS = [
    ("resnet18", ("conv_1", "relu_1")),  # 64->64 at 56x56
    ("resnet18", ("conv_5", "relu_5")),  # 64->128, stride 2, to 28x28
    ("resnet18", ("conv_8", "relu_7")),  # 128->128 at 28x28
    ("resnet18", ("conv_13", "relu_11")),  # 256->256 at 14x14
    ("resnet18", ("conv_15", "relu_13")),  # 256->512, stride 2, to 7x7
    ("resnet18", ("conv_18", "relu_15")),  # 512->512 at 7x7
    ("resnet18", ("conv_0", "relu_0", "max_pool_0")),  # the 7x7 stem, stride 2, 3 channels
    ("unet", ("conv_1", "relu_1", "max_pool_0")),  # 32->32 at 128x128
    ("unet", ("conv_9", "relu_9")),  # 512->512 at 8x8
    ("unet", ("conv_0", "relu_0")),  # 3->32 at 128x128
    ("yolo-neck", ("sigmoid_3", "mul_3", "conv_4", "sigmoid_4", "mul_4", "add_0")),  # 16->16 at 80x80
    ("yolo-neck", ("conv_46", "sigmoid_46", "mul_46")),  # 128->128 at 10x10
    ("mobilenetv2", ("conv_0", "clip_0")),  # 3->32, stride 2, to 112x112
]
VARIANTS = {"taps packed first": [(r"#if defined\(__AVX512F__\)\n    long long per = ", "#if 0\n    long long per = ")]}
