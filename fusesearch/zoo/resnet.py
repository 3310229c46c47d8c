"""ResNet-18 and ResNet-50 (He et al., "Deep Residual Learning for Image Recognition", CVPR 2016).

Idioms: Conv without bias + explicit BatchNormalization + Relu everywhere (training exporters
do not fold BN), MaxPool stem, GlobalAveragePool → Flatten → Gemm head.
- `resnet18` is opset 9 in the classic ONNX model-zoo style: basic blocks, residual adds written
  as `Sum` (as opset-8/9 exporters emitted them), Gemm with its (then required) C input.
- `resnet50` is opset 13: bottleneck blocks [3, 4, 6, 3] with the stride on the 3x3 conv
  (torchvision's v1.5) and `Add` residuals; exactly 175 nodes (53 Conv, 53 BN, 49 Relu, 16 Add,
  MaxPool, GlobalAveragePool, Flatten, Gemm).
"""

from __future__ import annotations

import onnx

from ._builder import GraphBuilder, conv_bn, gemm

IMAGE = ["batch", 3, 224, 224]
STAGE_WIDTHS = (64, 128, 256, 512)
BRANCH_GAIN = 0.5  # damps each residual branch so the sum stays O(1) over 16 blocks


def _stem(b: GraphBuilder, x: str) -> str:
    y = conv_bn(b, x, 3, 64, 7, stride=2)
    return b.op("MaxPool", [y], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])


def _head(b: GraphBuilder, x: str, channels: int) -> str:
    y = b.op("Flatten", [b.op("GlobalAveragePool", [x])], axis=1)
    return b.output(gemm(b, y, channels, 1000), "logits", ["batch", 1000])


def _shortcut(b: GraphBuilder, x: str, cin: int, cout: int, stride: int) -> str:
    if stride == 1 and cin == cout:
        return x
    return conv_bn(b, x, cin, cout, 1, stride=stride, act=None)


def _basic_block(b: GraphBuilder, x: str, cin: int, cout: int, stride: int) -> str:
    y = conv_bn(b, x, cin, cout, 3, stride=stride)
    y = conv_bn(b, y, cout, cout, 3, act=None, gain=BRANCH_GAIN)
    return b.op("Relu", [b.op("Sum", [y, _shortcut(b, x, cin, cout, stride)])])


def _bottleneck(b: GraphBuilder, x: str, cin: int, width: int, stride: int) -> str:
    cout = width * 4
    y = conv_bn(b, x, cin, width, 1)
    y = conv_bn(b, y, width, width, 3, stride=stride)
    y = conv_bn(b, y, width, cout, 1, act=None, gain=BRANCH_GAIN)
    return b.op("Relu", [b.op("Add", [y, _shortcut(b, x, cin, cout, stride)])])


def _resnet(name: str, opset: int, seed: int, block, depths: tuple[int, ...], expansion: int,
            doc: str) -> onnx.ModelProto:
    b = GraphBuilder(name, seed, opset)
    x = _stem(b, b.input("input", IMAGE))
    cin = 64
    for stage, (width, depth) in enumerate(zip(STAGE_WIDTHS, depths, strict=True)):
        for i in range(depth):
            stride = 2 if stage > 0 and i == 0 else 1
            x = block(b, x, cin, width, stride)
            cin = width * expansion
    _head(b, x, cin)
    return b.model(doc)


def resnet18() -> onnx.ModelProto:
    """ResNet-18, opset 9, residual `Sum` nodes."""
    return _resnet("resnet18", 9, 18, _basic_block, (2, 2, 2, 2), 1,
                   "ResNet-18 (He et al. 2016), opset 9 model-zoo style with Sum residuals.")


def resnet50() -> onnx.ModelProto:
    """ResNet-50 v1.5, opset 13, 175 nodes before canonicalization."""
    return _resnet("resnet50", 13, 50, _bottleneck, (3, 4, 6, 3), 4,
                   "ResNet-50 v1.5 (He et al. 2016), opset 13, explicit BatchNormalization.")
