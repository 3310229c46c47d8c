"""Pool windows: the geometry of a 2-D MaxPool / AveragePool, decided once for lowering (legality,
recompute pricing) and the code generator (the unrolled window).

Problem: which input positions a window covers, which are padding and what an average divides by
depend on every pool attribute, and must agree with ONNX Runtime everywhere they are used.
Approach: `pool_window` gives one `PoolAxis` per spatial axis (kernel, stride, dilation, begin pad,
extents, the clip bound under count_include_pad) as ONNX Runtime's CPU pools compute them: SAME
pads split by UPPER/LOWER, window start o·stride - pad, taps at start + k·dilation, taps outside
the input not read (AveragePool counts them only under count_include_pad, up to input + tail pad).
Output extents are the graph's, never recomputed here.
Invariants: a pool that is not generated gets a reason (str) instead of a window (not 2-D NCHW
float32, Indices output, dilated AveragePool, over MAX_TAPS taps, a window wholly in padding,
unknown shapes); `reads` is exactly the number of in-bounds input reads of all windows."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

POOL_OPS = frozenset({"MaxPool", "AveragePool"})
MAX_TAPS = 64  # a larger window is not unrolled: it stays a library call


@dataclass(frozen=True)
class PoolAxis:
    kernel: int
    stride: int
    dilation: int
    pad: int  # head padding: window o starts at o·stride - pad
    extent: int  # input extent
    out: int  # output extent
    limit: int  # count_include_pad: a window is clipped to [-pad, limit) (input + tail pad)

    def start(self, o: int) -> int:
        return o * self.stride - self.pad

    def inside(self, o: int, k: int) -> bool:
        return 0 <= self.start(o) + k * self.dilation < self.extent

    def needs_low_check(self, k: int) -> bool:
        """Some window's tap k lies before the input."""
        return k * self.dilation - self.pad < 0

    def needs_high_check(self, k: int) -> bool:
        """Some window's tap k lies past the input."""
        return self.start(self.out - 1) + k * self.dilation >= self.extent

    def interior(self) -> tuple[int, int]:
        """[lo, hi): the outputs whose every tap lies inside the input (no bounds check needed)."""
        lo = -(-self.pad // self.stride)
        last = self.extent - 1 - (self.kernel - 1) * self.dilation + self.pad  # start + span <= extent - 1
        hi = min(self.out, last // self.stride + 1) if last >= 0 else 0
        return lo, max(lo, hi)

    def counts(self, include_pad: bool) -> list[int]:
        """AveragePool's divisor along this axis per output (undilated): the taps inside the input,
        or, counting padding, inside [-pad, limit) (a ceil_mode window past the tail is clipped)."""
        lo, hi = (-self.pad, self.limit) if include_pad else (0, self.extent)
        return [min(self.start(o) + self.kernel, hi) - max(self.start(o), lo) for o in range(self.out)]

    def valid_pairs(self) -> int:
        """(window, tap) pairs whose tap lies inside the input."""
        return sum(self.inside(o, k) for o in range(self.out) for k in range(self.kernel))


@dataclass(frozen=True)
class PoolWindow:
    op: str
    axes: tuple[PoolAxis, ...]  # (H, W)
    batch_channels: int  # N·C
    include_pad: bool  # AveragePool: padding counts in the divisor

    @property
    def taps(self) -> int:
        return math.prod(a.kernel for a in self.axes)

    @property
    def reads(self) -> int:
        """In-bounds input reads over all output elements (the windows are separable)."""
        return self.batch_channels * math.prod(a.valid_pairs() for a in self.axes)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def pool_window(op_type: str, attrs: Mapping[str, Any], in_shape: Sequence[int] | None,
                out_shape: Sequence[int] | None, dtype: str = "float32",
                n_outputs: int = 1) -> PoolWindow | str:
    """The window of a MaxPool/AveragePool node, or the reason it is not generated."""
    label = op_type
    if op_type not in POOL_OPS:
        return f"{label} is not a windowed pool"
    if n_outputs > 1:
        return f"{label}'s Indices output is not generated (runs as a library call)"
    if in_shape is None or out_shape is None or len(in_shape) != 4 or len(out_shape) != 4:
        return f"{label} is generated for 2-D NCHW inputs only"
    if dtype != "float32":
        return f"{label} over {dtype} is not generated"
    kernel = [int(k) for k in attrs.get("kernel_shape") or ()]
    if len(kernel) != 2:
        return f"{label} kernel_shape {kernel} is not 2-D"
    strides = [int(s) for s in attrs.get("strides") or (1, 1)]
    dilations = [int(d) for d in attrs.get("dilations") or (1, 1)]
    pads = [int(p) for p in attrs.get("pads") or (0, 0, 0, 0)]
    if op_type == "AveragePool" and dilations != [1, 1]:
        return f"{label} with dilations {dilations} is not generated"
    if math.prod(kernel) > MAX_TAPS:
        return f"{label} window of {math.prod(kernel)} taps > {MAX_TAPS} is not unrolled"
    if min(kernel + strides + dilations) < 1 or len(pads) != 4 or len(strides) != 2 or len(dilations) != 2:
        return f"{label} has malformed window attributes"
    auto = _text(attrs.get("auto_pad", "NOTSET"))
    axes = []
    for i in range(2):
        extent, out = int(in_shape[2 + i]), int(out_shape[2 + i])
        head, tail = pads[i], pads[i + 2]
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            target = -(-extent // strides[i])
            needed = (target - 1) * strides[i] + kernel[i] - extent
            head = (needed + 1) // 2 if auto == "SAME_LOWER" else needed // 2
            head = max(0, head)
            tail = max(0, needed - head)
        elif auto == "VALID":
            head = tail = 0
        axes.append(PoolAxis(kernel[i], strides[i], dilations[i], head, extent, out, extent + tail))
    for axis in axes:
        if any(not any(axis.inside(o, k) for k in range(axis.kernel)) for o in range(axis.out)):
            return f"{label} has a window wholly in the padding (pads of {axis.pad} or more)"
    include = op_type == "AveragePool" and bool(int(attrs.get("count_include_pad", 0)))
    return PoolWindow(op_type, tuple(axes), int(in_shape[0]) * int(in_shape[1]), include)
