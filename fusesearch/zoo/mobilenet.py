"""MobileNetV2 (Sandler et al., "MobileNetV2: Inverted Residuals and Linear Bottlenecks",
CVPR 2018).

Idioms (opset 10, a pre-opset-11 export): ReLU6 as `Clip` with min/max ATTRIBUTES, depthwise
convolutions (`group` = channels), Conv + explicit BatchNormalization, linear bottlenecks,
inverted-residual `Add`s, GlobalAveragePool → Reshape([0, -1]) → `Dropout` (ratio attribute) →
Gemm classifier.
"""

from __future__ import annotations

import onnx

from ._builder import GraphBuilder, conv_bn, gemm

# (expansion t, output channels c, repeats n, first stride s) — Table 2 of the paper.
INVERTED_RESIDUALS = (
    (1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
    (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1),
)
LAST_CHANNELS = 1280
PROJECT_GAIN = 0.5  # the linear bottleneck's gain: residual sums stay O(1)


def _conv_relu6(b: GraphBuilder, x: str, cin: int, cout: int, k: int, *, stride: int = 1,
                group: int = 1) -> str:
    y = conv_bn(b, x, cin, cout, k, stride=stride, group=group, act=None)
    return b.op("Clip", [y], min=0.0, max=6.0)


def _inverted_residual(b: GraphBuilder, x: str, cin: int, cout: int, t: int, stride: int) -> str:
    hidden = cin * t
    y = _conv_relu6(b, x, cin, hidden, 1) if t != 1 else x
    y = _conv_relu6(b, y, hidden, hidden, 3, stride=stride, group=hidden)
    y = conv_bn(b, y, hidden, cout, 1, act=None, gain=PROJECT_GAIN)
    return b.op("Add", [x, y]) if stride == 1 and cin == cout else y


def _classifier(b: GraphBuilder, x: str) -> str:
    y = b.op("GlobalAveragePool", [x])
    y = b.op("Reshape", [y, b.ints([0, -1])])
    y = b.op("Dropout", [y], ratio=0.2)
    return b.output(gemm(b, y, LAST_CHANNELS, 1000), "logits", ["batch", 1000])


def mobilenetv2() -> onnx.ModelProto:
    """MobileNetV2 1.0x at 224x224, opset 10."""
    b = GraphBuilder("mobilenetv2", 2, 10)
    x = _conv_relu6(b, b.input("input", ["batch", 3, 224, 224]), 3, 32, 3, stride=2)
    cin = 32
    for t, c, n, s in INVERTED_RESIDUALS:
        for i in range(n):
            x = _inverted_residual(b, x, cin, c, t, s if i == 0 else 1)
            cin = c
    x = _conv_relu6(b, x, cin, LAST_CHANNELS, 1)
    _classifier(b, x)
    return b.model("MobileNetV2 1.0 (Sandler et al. 2018), opset 10: Clip-attribute ReLU6.")
