"""A small YOLO-style detector: CSP backbone (Wang et al., "CSPNet", CVPRW 2020) with a
FPN + PAN neck (Lin et al., "Feature Pyramid Networks", CVPR 2017; Liu et al., "PANet", CVPR 2018)
and three detection heads, in the layout of YOLOv4/v5 (Bochkovskiy et al. 2020).

Idioms (opset 11): SiLU written as `Sigmoid` + `Mul` (two consumers of one tensor), Conv +
explicit BatchNormalization, CSP blocks with residual `Add`, opset-11 `Resize` (nearest, with
`roi` and `scales` inputs), `Concat`, fan-out (lateral and bottom-up tensors feed several
branches), and three detection-head Convs → three graph outputs.
"""

from __future__ import annotations

import onnx

from ._builder import RELU_GAIN, GraphBuilder, conv, conv_bn

SIZE = 320
ANCHORS = 3
CLASSES = 80
HEAD_CHANNELS = ANCHORS * (5 + CLASSES)
SHORTCUT_GAIN = 0.5  # damps the residual branch of each CSP bottleneck


def _cbs(b: GraphBuilder, x: str, cin: int, cout: int, k: int, stride: int = 1,
         gain: float = RELU_GAIN) -> str:
    """Conv + BN + SiLU, SiLU as x · sigmoid(x)."""
    y = conv_bn(b, x, cin, cout, k, stride=stride, act=None, gain=gain)
    return b.op("Mul", [y, b.op("Sigmoid", [y])])


def _csp(b: GraphBuilder, x: str, cin: int, cout: int, shortcut: bool = True) -> str:
    """C3 block: two 1x1 branches, one through a bottleneck, concatenated and fused by 1x1."""
    half = cout // 2
    main = _cbs(b, x, cin, half, 1)
    y = _cbs(b, _cbs(b, main, half, half, 1), half, half, 3,
             gain=SHORTCUT_GAIN if shortcut else RELU_GAIN)
    main = b.op("Add", [main, y]) if shortcut else y
    side = _cbs(b, x, cin, half, 1)
    return _cbs(b, b.op("Concat", [main, side], axis=1), cout, cout, 1)


def _upsample(b: GraphBuilder, x: str) -> str:
    roi, scales = b.floats([]), b.floats([1.0, 1.0, 2.0, 2.0])
    return b.op("Resize", [x, roi, scales], mode="nearest",
                coordinate_transformation_mode="asymmetric", nearest_mode="floor")


def _backbone(b: GraphBuilder, x: str) -> tuple[str, str, str]:
    x = _cbs(b, _cbs(b, x, 3, 16, 3, 2), 16, 32, 3, 2)          # /4
    p3 = _csp(b, _cbs(b, _csp(b, x, 32, 32), 32, 64, 3, 2), 64, 64)  # /8
    p4 = _csp(b, _cbs(b, p3, 64, 128, 3, 2), 128, 128)               # /16
    p5 = _csp(b, _cbs(b, p4, 128, 256, 3, 2), 256, 256)             # /32
    return p3, p4, p5


def _neck(b: GraphBuilder, p3: str, p4: str, p5: str) -> tuple[str, str, str]:
    lat5 = _cbs(b, p5, 256, 128, 1)
    n4 = _csp(b, b.op("Concat", [_upsample(b, lat5), p4], axis=1), 256, 128, shortcut=False)
    lat4 = _cbs(b, n4, 128, 64, 1)
    out3 = _csp(b, b.op("Concat", [_upsample(b, lat4), p3], axis=1), 128, 64, shortcut=False)
    down = b.op("Concat", [_cbs(b, out3, 64, 64, 3, 2), lat4], axis=1)
    out4 = _csp(b, down, 128, 128, shortcut=False)
    down = b.op("Concat", [_cbs(b, out4, 128, 128, 3, 2), lat5], axis=1)
    return out3, out4, _csp(b, down, 256, 256, shortcut=False)


def yolo_neck() -> onnx.ModelProto:
    """CSP backbone + FPN/PAN neck + three heads at strides 8, 16, 32 on a 320x320 input."""
    b = GraphBuilder("yolo-neck", 11, 11)
    features = _neck(b, *_backbone(b, b.input("images", ["batch", 3, SIZE, SIZE])))
    for i, (x, channels) in enumerate(zip(features, (64, 128, 256), strict=True)):
        head = conv(b, x, channels, HEAD_CHANNELS, 1, bias=True, gain=1.0)
        side = SIZE // (8 << i)
        b.output(head, f"det_stride{8 << i}", ["batch", HEAD_CHANNELS, side, side])
    return b.model("YOLO-style CSP backbone + FPN/PAN neck + 3 heads, opset 11, SiLU as x·σ(x).")
