"""Library kernels written once for any array module: `xp` is numpy (CPU tests) or cupy (GPU).

Problem: on a GPU the unfused baseline of an anchor and the opaque ops without a generated kernel
run through vendor libraries (cuBLAS via `cupy.matmul`), so `measure` can compare a fused kernel
with library + epilogue; CI has no GPU, yet that math must be checked there.
Approach: each op is a short function of `xp` and the node's attributes using only calls numpy and
cupy share: MatMul/Gemm (`xp.matmul`), Conv (im2col, one batched matmul per group), ConvTranspose
(as the equivalent Conv), MaxPool/AveragePool (a strided slice per tap, ONNX Runtime's counts and
ceil_mode), the global pools. No cuDNN (CuPy 14 removed its bindings): the GPU Conv baseline is
im2col + cuBLAS, weaker than cuDNN, reported as what it is. `supports(op_type, attrs, n_outputs)`
answers with a `FusionDecision` saying why not; `run(xp, op_type, attrs, inputs, n_outputs)`
returns the outputs.
Invariants: no import of cupy (the caller passes `xp`); inputs are never written; outputs keep the
input's dtype; an omitted optional input is None."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fusesearch.groups import FusionDecision

Attrs = Mapping[str, Any]


# -- attributes -------------------------------------------------------------------------------

def _spatial_attrs(attrs: Attrs, spatial: Sequence[int], kernel: Sequence[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """(strides, dilations, pads begin, pads end) with auto_pad resolved (Conv / pooling)."""
    rank = len(spatial)
    strides = list(attrs.get("strides") or [1] * rank)
    dilations = list(attrs.get("dilations") or [1] * rank)
    pads = list(attrs.get("pads") or [0] * (2 * rank))
    auto_pad = attrs.get("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad == "VALID":
        pads = [0] * (2 * rank)
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        pads = [0] * (2 * rank)
        for i, (size, k, s, d) in enumerate(zip(spatial, kernel, strides, dilations, strict=True)):
            out = -(-size // s)
            total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
            small, big = total // 2, total - total // 2
            pads[i], pads[rank + i] = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
    return strides, dilations, pads[:rank], pads[rank:]


def _taps(xp, x, begin: Sequence[int], end: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
          dilations: Sequence[int], out: Sequence[int], fill: float):
    """Every kernel tap's strided view of x padded by (begin, end) with `fill`: a list of arrays
    of shape (N, C, *out), taps in row-major kernel order."""
    rank = len(kernel)
    padding = [(0, 0), (0, 0)] + [(b, e) for b, e in zip(begin, end, strict=True)]
    padded = xp.pad(x, padding, mode="constant", constant_values=fill) if any(begin) or any(end) else x
    views = []
    for tap in itertools.product(*(range(k) for k in kernel)):
        index = [slice(None), slice(None)]
        for i in range(rank):
            start = tap[i] * dilations[i]
            index.append(slice(start, start + (out[i] - 1) * strides[i] + 1, strides[i]))
        views.append(padded[tuple(index)])
    return views


# -- contractions -----------------------------------------------------------------------------

def matmul(xp, attrs: Attrs, a, b):
    return xp.matmul(a, b)


def gemm(xp, attrs: Attrs, a, b, c=None):
    a = a.T if attrs.get("transA", 0) else a
    b = b.T if attrs.get("transB", 0) else b
    y = xp.matmul(a, b)
    alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
    if alpha != 1.0:
        y = y * y.dtype.type(alpha)
    if c is not None and beta != 0.0:
        y = y + (c * c.dtype.type(beta) if beta != 1.0 else c)
    return y


def conv(xp, attrs: Attrs, x, w, b=None):
    """Conv (any spatial rank) as im2col + one batched matmul over the groups."""
    n, c = x.shape[:2]
    m, cg = w.shape[:2]
    kernel = list(w.shape[2:])
    groups = int(attrs.get("group", 1))
    strides, dilations, begin, end = _spatial_attrs(attrs, x.shape[2:], kernel)
    out = [(size + pb + pe - ((k - 1) * d + 1)) // s + 1
           for size, pb, pe, k, s, d in zip(x.shape[2:], begin, end, kernel, strides, dilations, strict=True)]
    taps = _taps(xp, x, begin, end, kernel, strides, dilations, out, 0.0)
    positions = math.prod(out)
    cols = xp.stack(taps, axis=2).reshape(n, groups, cg * len(taps), positions)  # (N, g, C/g·taps, P)
    weights = w.reshape(groups, m // groups, cg * len(taps))  # (g, M/g, C/g·taps)
    y = xp.matmul(weights[None], cols).reshape(n, m, *out)
    if b is not None:
        y = y + b.reshape(1, m, *([1] * len(out)))
    return y


def conv_transpose(xp, attrs: Attrs, x, w, b=None):
    """ConvTranspose as the Conv of the stride-dilated input with the flipped, swapped kernel."""
    n, c = x.shape[:2]
    groups = int(attrs.get("group", 1))
    kernel = list(w.shape[2:])
    rank = len(kernel)
    strides = list(attrs.get("strides") or [1] * rank)
    dilations = list(attrs.get("dilations") or [1] * rank)
    pads = list(attrs.get("pads") or [0] * (2 * rank))
    extra = list(attrs.get("output_padding") or [0] * rank)
    spread = [(size - 1) * s + 1 for size, s in zip(x.shape[2:], strides, strict=True)]
    dilated = xp.zeros((n, c, *spread), dtype=x.dtype)
    dilated[(slice(None), slice(None), *(slice(None, None, s) for s in strides))] = x
    begin = [d * (k - 1) - p for d, k, p in zip(dilations, kernel, pads[:rank], strict=True)]
    end = [d * (k - 1) - p + e for d, k, p, e in zip(dilations, kernel, pads[rank:], extra, strict=True)]
    crop = tuple(slice(max(0, -bg), size - max(0, -en)) for bg, en, size in zip(begin, end, spread, strict=True))
    dilated = dilated[(slice(None), slice(None), *crop)]  # a pad larger than d·(k-1) crops the input
    mg = w.shape[1]
    flipped = w[(slice(None), slice(None), *([slice(None, None, -1)] * rank))]
    swapped = flipped.reshape(groups, c // groups, mg, *kernel).swapaxes(1, 2).reshape(groups * mg, c // groups, *kernel)
    return conv(xp, {"group": groups, "dilations": dilations,
                     "pads": [max(0, v) for v in begin] + [max(0, v) for v in end]},
                xp.ascontiguousarray(dilated), xp.ascontiguousarray(swapped), b)


# -- pooling ----------------------------------------------------------------------------------

def _pool_geometry(attrs: Attrs, x) -> tuple[list[int], list[int], list[int], list[int], list[int], list[int]]:
    """(kernel, strides, dilations, begin, end, out) with ceil_mode applied (ONNX Runtime's rule:
    a last window that would start inside the end padding is dropped)."""
    kernel = list(attrs["kernel_shape"])
    strides, dilations, begin, end = _spatial_attrs(attrs, x.shape[2:], kernel)
    ceil = bool(attrs.get("ceil_mode", 0))
    out = []
    for size, pb, pe, k, s, d in zip(x.shape[2:], begin, end, kernel, strides, dilations, strict=True):
        span = size + pb + pe - ((k - 1) * d + 1)
        o = (-(-span // s) if ceil else span // s) + 1
        if ceil and (o - 1) * s >= size + pb:
            o -= 1
        out.append(o)
    return kernel, strides, dilations, begin, end, out


def _ceil_tail(size: int, pb: int, pe: int, k: int, s: int, d: int, o: int) -> int:
    """How far the last window reaches past the end padding (ceil_mode), >= 0."""
    return max(0, (o - 1) * s + (k - 1) * d + 1 - (size + pb + pe))


def max_pool(xp, attrs: Attrs, x):
    kernel, strides, dilations, begin, end, out = _pool_geometry(attrs, x)
    tails = [e + _ceil_tail(size, b, e, k, s, d, o) for size, b, e, k, s, d, o
             in zip(x.shape[2:], begin, end, kernel, strides, dilations, out, strict=True)]
    views = _taps(xp, x, begin, tails, kernel, strides, dilations, out, -math.inf)
    y = views[0]
    for v in views[1:]:
        y = xp.maximum(y, v)
    return y


def average_pool(xp, attrs: Attrs, x):
    kernel, strides, dilations, begin, end, out = _pool_geometry(attrs, x)
    tails = [_ceil_tail(size, b, e, k, s, d, o) for size, b, e, k, s, d, o
             in zip(x.shape[2:], begin, end, kernel, strides, dilations, out, strict=True)]
    views = _taps(xp, x, begin, [e + t for e, t in zip(end, tails, strict=True)], kernel, strides, dilations, out, 0.0)
    total = views[0]
    for v in views[1:]:
        total = total + v
    # the divisor: how many taps of each window fall on counted positions
    ones = xp.ones((1, 1, *x.shape[2:]), dtype=x.dtype)
    if attrs.get("count_include_pad", 0):  # explicit padding counts, the ceil tail does not
        ones = xp.pad(ones, [(0, 0), (0, 0)] + list(zip(begin, end, strict=True)), mode="constant", constant_values=1.0)
        counted = _taps(xp, ones, [0] * len(kernel), tails, kernel, strides, dilations, out, 0.0)
    else:
        counted = _taps(xp, ones, begin, [e + t for e, t in zip(end, tails, strict=True)], kernel, strides,
                        dilations, out, 0.0)
    count = counted[0]
    for v in counted[1:]:
        count = count + v
    return total / count


def global_average_pool(xp, attrs: Attrs, x):
    return xp.mean(x, axis=tuple(range(2, x.ndim)), keepdims=True, dtype=x.dtype)


def global_max_pool(xp, attrs: Attrs, x):
    return xp.max(x, axis=tuple(range(2, x.ndim)), keepdims=True)


# -- the table --------------------------------------------------------------------------------

OPS: dict[str, Callable[..., Any]] = {
    "MatMul": matmul, "Gemm": gemm, "Conv": conv, "ConvTranspose": conv_transpose,
    "MaxPool": max_pool, "AveragePool": average_pool,
    "GlobalAveragePool": global_average_pool, "GlobalMaxPool": global_max_pool,
}


def supports(op_type: str, attrs: Attrs, n_outputs: int = 1) -> FusionDecision:
    """Whether `run` implements this node, and why not."""
    if op_type not in OPS:
        return FusionDecision.refuse(f"{op_type} has no array-library implementation "
                                     f"(implemented: {', '.join(OPS)})")
    if n_outputs != 1:
        return FusionDecision.refuse(f"{op_type} with {n_outputs} outputs (MaxPool's Indices) "
                                     "has no array-library implementation")
    if op_type == "ConvTranspose" and attrs.get("output_shape"):
        return FusionDecision.refuse("ConvTranspose with output_shape has no array-library implementation")
    if op_type == "ConvTranspose" and attrs.get("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET"):
        return FusionDecision.refuse("ConvTranspose with auto_pad has no array-library implementation")
    if op_type == "MaxPool" and attrs.get("storage_order", 0):
        return FusionDecision.refuse("MaxPool storage_order only affects Indices; not implemented")
    return FusionDecision.accept(op_type)


def run(xp, op_type: str, attrs: Attrs, inputs: Sequence[Any], n_outputs: int = 1) -> list[Any]:
    """The node's outputs; `inputs` in the node's order, None for an omitted optional input."""
    decision = supports(op_type, attrs, n_outputs)
    if not decision:
        raise ValueError(decision.reason)
    args = list(inputs)
    while args and args[-1] is None:
        args.pop()
    return [OPS[op_type](xp, attrs, *args)]


def run_into(xp, op_type: str, attrs: Attrs, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
    """`run`, its results copied into the given output arrays (a program's buffers)."""
    for buffer, y in zip(outputs, run(xp, op_type, attrs, inputs, len(outputs)), strict=True):
        buffer[...] = y
