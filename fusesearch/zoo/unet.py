"""U-Net (Ronneberger et al., "U-Net: Convolutional Networks for Biomedical Image Segmentation",
MICCAI 2015), with the now-usual padded convolutions and BatchNormalization.

Idioms (opset 13): encoder double convolutions (Conv + explicit BatchNormalization + Relu, twice),
MaxPool downsampling, decoder `ConvTranspose` (kernel 2, stride 2) upsampling, `Concat` skip
connections (each encoder output is used twice: by the next level and by the decoder), final
1x1 Conv with bias.
"""

from __future__ import annotations

import math

import onnx

from ._builder import GraphBuilder, conv, conv_bn

BASE_WIDTH = 32
LEVELS = 4
CLASSES = 2
SIZE = 128


def _double_conv(b: GraphBuilder, x: str, cin: int, cout: int) -> str:
    return conv_bn(b, conv_bn(b, x, cin, cout, 3), cout, cout, 3)


def _up(b: GraphBuilder, x: str, cin: int) -> str:
    name = b.fresh("convt")
    w = b.weight(f"{name}.weight", (cin, cin // 2, 2, 2), 1.0 / math.sqrt(cin))
    bias = b.weight(f"{name}.bias", (cin // 2,), 0.02)
    return b.op("ConvTranspose", [x, w, bias], name=name, kernel_shape=[2, 2], strides=[2, 2])


def _encoder(b: GraphBuilder, x: str) -> tuple[str, list[str]]:
    skips, cin = [], 3
    for level in range(LEVELS):
        width = BASE_WIDTH << level
        skip = _double_conv(b, x, cin, width)
        skips.append(skip)
        x = b.op("MaxPool", [skip], kernel_shape=[2, 2], strides=[2, 2])
        cin = width
    return x, skips


def _decoder(b: GraphBuilder, x: str, skips: list[str]) -> str:
    for level in reversed(range(LEVELS)):
        width = BASE_WIDTH << level
        y = b.op("Concat", [skips[level], _up(b, x, 2 * width)], axis=1)
        x = _double_conv(b, y, 2 * width, width)
    return x


def unet() -> onnx.ModelProto:
    """U-Net, 4 levels, base width 32, 128x128 RGB → 2-class logits."""
    b = GraphBuilder("unet", 15, 13)
    x, skips = _encoder(b, b.input("input", ["batch", 3, SIZE, SIZE]))
    x = _double_conv(b, x, BASE_WIDTH << (LEVELS - 1), BASE_WIDTH << LEVELS)
    x = conv(b, _decoder(b, x, skips), BASE_WIDTH, CLASSES, 1, bias=True, gain=1.0)
    b.output(x, "logits", ["batch", CLASSES, SIZE, SIZE])
    return b.model("U-Net (Ronneberger et al. 2015), 4 levels, base width 32, opset 13.")
