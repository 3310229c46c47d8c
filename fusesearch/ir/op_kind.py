"""Operator kinds and per-node cost figures (FLOPs, transcendentals, DRAM bytes).

Problem: legality and the cost model need, for every ONNX op, how outputs depend on inputs (its
kind) and how much work a node does; an unknown op must be safe, not an error.
Approach: `OpKind` is ordered like TVM's `OpPatternKind`: ELEMWISE(0) < BROADCAST(1) <
INJECTIVE(2) < REDUCE(3) < ANCHOR(4) < OPAQUE(8), so legality reads as comparisons. `OP_KINDS`
lists every default-domain op of opsets 7-21 (and onnx 1.23's newer ones) explicitly; `kind_of`
looks it up, another domain or unknown op is OPAQUE (logged once). `node_flops`,
`node_transcendentals`, `node_bytes` are pure functions of op, attributes and `TensorInfo`s.
Counting (as XLA's HloCostAnalysis): a multiply-add is 2 FLOPs; a math-library function is 1 FLOP
and 1 transcendental; comparisons, selects and casts 1.
Invariants: the table is immutable, built once at import; every cost function returns a
non-negative int and never raises (an unknown shape gives 0)."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from enum import IntEnum
from types import MappingProxyType
from typing import Any

import numpy as np

from fusesearch.ir.tensor import TensorInfo

log = logging.getLogger(__name__)

__all__ = [
    "OP_KINDS", "TENSOR_CORE_OPS", "OpKind", "kind_of", "node_bytes", "node_flops",
    "node_transcendentals",
]


class OpKind(IntEnum):
    """How output elements depend on inputs; ordered so legality reads as comparisons."""

    ELEMWISE = 0  # out[i] = f(in[i]) for every input, all of one shape
    BROADCAST = 1  # out[i] = f(in_k[broadcast_k(i)]): the index maps are fixed broadcasts
    INJECTIVE = 2  # out[i] = in[g(i)]: one place (data movement), or a small fixed stencil (pools)
    REDUCE = 3  # rows of the input are reduced along inner axes (Softmax, LayerNorm, Reduce*)
    ANCHOR = 4  # a contraction with its own tiled template (Conv, MatMul, Gemm)
    OPAQUE = 8  # cannot fuse: control flow, data-dependent shapes, library ops, unknown ops


_E, _B, _I, _R, _A, _O = (OpKind.ELEMWISE, OpKind.BROADCAST, OpKind.INJECTIVE, OpKind.REDUCE,
                          OpKind.ANCHOR, OpKind.OPAQUE)

OP_KINDS: Mapping[str, OpKind] = MappingProxyType({
    # ELEMWISE - unary math: one input, same shape out, element i from element i.
    "Abs": _E, "Acos": _E, "Acosh": _E, "Asin": _E, "Asinh": _E, "Atan": _E, "Atanh": _E,
    "Ceil": _E, "Cos": _E, "Cosh": _E, "Erf": _E, "Exp": _E, "Floor": _E, "Log": _E, "Neg": _E,
    "Reciprocal": _E, "Round": _E, "Sign": _E, "Sin": _E, "Sinh": _E, "Sqrt": _E, "Tan": _E,
    "Tanh": _E,
    # ELEMWISE - activations (parameters are attributes, not tensors). Swish is opset 24.
    "Celu": _E, "Elu": _E, "Gelu": _E, "HardSigmoid": _E, "HardSwish": _E, "LeakyRelu": _E,
    "Mish": _E, "Relu": _E, "Selu": _E, "Shrink": _E, "Sigmoid": _E, "Softplus": _E,
    "Softsign": _E, "Swish": _E, "ThresholdedRelu": _E,
    # ELEMWISE - type and logic. CastLike's second input supplies only a dtype; BitCast (opset
    # 26) keeps the shape; SwiGLU (opset 28) takes two inputs of identical shape, no broadcast.
    "BitCast": _E, "BitwiseNot": _E, "Cast": _E, "CastLike": _E, "IsInf": _E, "IsNaN": _E,
    "Not": _E, "SwiGLU": _E,
    # BROADCAST - multi-input arithmetic, comparison and logic with numpy broadcasting.
    "Add": _B, "And": _B, "BitShift": _B, "BitwiseAnd": _B, "BitwiseOr": _B, "BitwiseXor": _B,
    "Div": _B, "Equal": _B, "Greater": _B, "GreaterOrEqual": _B, "Less": _B, "LessOrEqual": _B,
    "Max": _B, "Mean": _B, "Min": _B, "Mod": _B, "Mul": _B, "Or": _B, "Pow": _B, "Sub": _B,
    "Sum": _B, "Where": _B, "Xor": _B,
    # BROADCAST - ops whose extra inputs are broadcast parameters: Clip's min/max scalars,
    # PRelu's slope, BatchNormalization (inference only: a per-channel scale/shift; the
    # training mode is a reduction, and canonicalize folds BN into its producer where it can),
    # Quantize/DequantizeLinear's per-tensor / per-axis / per-block scale and zero point.
    "BatchNormalization": _B, "Clip": _B, "DequantizeLinear": _B, "PRelu": _B,
    "QuantizeLinear": _B,
    # INJECTIVE - views and no-ops (canonicalize removes Identity and inference Dropout).
    "Dropout": _I, "Flatten": _I, "Identity": _I, "Reshape": _I, "Squeeze": _I, "Unsqueeze": _I,
    # INJECTIVE - permutations, copies, crops and pads: out[i] = in[g(i)] or a constant.
    "CenterCropPad": _I, "Concat": _I, "DepthToSpace": _I, "Expand": _I, "Pad": _I,
    "ReverseSequence": _I, "Slice": _I, "SpaceToDepth": _I, "Split": _I, "Tile": _I,
    "Transpose": _I, "Trilu": _I,
    # INJECTIVE - gathers: the read index is data-dependent but each output element still reads
    # one place and the output shape is static (TVM's `take` is injective too).
    "Gather": _I, "GatherElements": _I, "GatherND": _I, "OneHot": _I,
    # INJECTIVE - resampling: a fixed index map plus a small interpolation stencil per output
    # element (TVM's resize is injective). Upsample is the deprecated form of Resize.
    "Resize": _I, "Upsample": _I,
    # INJECTIVE - RotaryEmbedding (opset 23): each output element reads its element, its rotation
    # partner and one cos/sin cache entry at the token's position: a gather plus 3 FLOPs.
    "RotaryEmbedding": _I,
    # INJECTIVE - generators with no data input: out[i] is a function of i alone. Their output
    # shape comes from a value (a shape tensor, Range's bounds); legality separately requires
    # static shapes, so one whose shape shape-inference could not fix never joins a group.
    "ConstantOfShape": _I, "EyeLike": _I, "Range": _I,
    # INJECTIVE - windowed pools: each output element reduces a small fixed window of its input (a
    # stencil, as Resize linear's neighbours): generated as an unrolled window when 2-D with at
    # most 64 taps (`fusesearch.ir.pool`; lowering refuses the rest, which then run alone as library
    # calls). It reads several positions per output element, so it is never a same-position
    # epilogue of a tiled product (the generator's `direct` / materialized paths take it).
    "AveragePool": _I, "MaxPool": _I,
    # REDUCE - reductions over axes, each row reduced to one value (keepdims or not).
    "ArgMax": _R, "ArgMin": _R, "ReduceL1": _R, "ReduceL2": _R, "ReduceLogSum": _R,
    "ReduceLogSumExp": _R, "ReduceMax": _R, "ReduceMean": _R, "ReduceMin": _R, "ReduceProd": _R,
    "ReduceSum": _R, "ReduceSumSquare": _R,
    # REDUCE - row-wise normalizations: reduce a row, then an elementwise pass over the same row.
    "GroupNormalization": _R, "Hardmax": _R, "InstanceNormalization": _R,
    "LayerNormalization": _R, "LogSoftmax": _R, "LpNormalization": _R,
    "MeanVarianceNormalization": _R, "RMSNormalization": _R, "Softmax": _R,
    # REDUCE - global pools reduce all spatial positions of a (N, C) row.
    "GlobalAveragePool": _R, "GlobalLpPool": _R, "GlobalMaxPool": _R,
    # ANCHOR - float contractions with a tiled (tensor-core) template.
    "Conv": _A, "ConvTranspose": _A, "Gemm": _A, "MatMul": _A,
    # OPAQUE - control flow: subgraphs are carried through untouched.
    "If": _O, "Loop": _O, "Scan": _O, "SequenceMap": _O,
    # OPAQUE - data-dependent output shape, or a sort.
    "Compress": _O, "NonMaxSuppression": _O, "NonZero": _O, "TopK": _O, "Unique": _O,
    # OPAQUE - random number generators (stateful seeds, not reproducible inside a fused kernel).
    "Bernoulli": _O, "Multinomial": _O, "RandomNormal": _O, "RandomNormalLike": _O,
    "RandomUniform": _O, "RandomUniformLike": _O,
    # OPAQUE - sequence and optional values are not tensors.
    "ConcatFromSequence": _O, "Optional": _O, "OptionalGetElement": _O,
    "OptionalHasElement": _O, "SequenceAt": _O, "SequenceConstruct": _O, "SequenceEmpty": _O,
    "SequenceErase": _O, "SequenceInsert": _O, "SequenceLength": _O, "SplitToSequence": _O,
    # OPAQUE - recurrent layers: a sequential loop of small GEMMs, run by a library.
    "GRU": _O, "LSTM": _O, "RNN": _O,
    # OPAQUE - other windowed and sampling ops, run by a library (cuDNN): LpPool and LRN are not
    # generated; Col2Im and MaxUnpool scatter-add; GridSample reads a data-dependent stencil;
    # AffineGrid only feeds GridSample; the RoI pools read data-dependent boxes.
    "AffineGrid": _O, "Col2Im": _O, "GridSample": _O, "LpPool": _O,
    "LRN": _O, "MaxRoiPool": _O, "MaxUnpool": _O, "RoiAlign": _O,
    # OPAQUE - contractions without a float template: integer / quantized (int32 accumulators
    # and requantization), deformable conv, Einsum (arbitrary index algebra: canonicalize may
    # rewrite simple ones to MatMul), Det (LU), and the fused attention / stateful conv ops of
    # opsets 23-27 (library kernels with KV-cache state).
    "Attention": _O, "CausalConvWithState": _O, "ConvInteger": _O, "DeformConv": _O,
    "Det": _O, "Einsum": _O, "LinearAttention": _O, "MatMulInteger": _O, "QLinearConv": _O,
    "QLinearMatMul": _O,
    # OPAQUE - DynamicQuantizeLinear needs the min/max of the whole tensor before its first
    # output element: a grid-wide reduction, not a row reduction.
    "DynamicQuantizeLinear": _O,
    # OPAQUE - prefix scans and scatters: sequential dependence or write conflicts. TensorScatter
    # (opset 24) models an in-place KV-cache update that fusion must not copy.
    "CumProd": _O, "CumSum": _O, "Scatter": _O, "ScatterElements": _O, "ScatterND": _O,
    "TensorScatter": _O,
    # OPAQUE - signal processing: FFTs and window generators (constant-folded when static).
    "BlackmanWindow": _O, "DFT": _O, "HammingWindow": _O, "HannWindow": _O,
    "MelWeightMatrix": _O, "STFT": _O,
    # OPAQUE - strings, images, text features.
    "ImageDecoder": _O, "RegexFullMatch": _O, "StringConcat": _O, "StringNormalizer": _O,
    "StringSplit": _O, "TfIdfVectorizer": _O,
    # OPAQUE - metadata and constants: no kernel at all (canonicalize folds them).
    "Constant": _O, "Shape": _O, "Size": _O,
    # OPAQUE - training losses: a label gather plus a whole-tensor reduction.
    "NegativeLogLikelihoodLoss": _O, "SoftmaxCrossEntropyLoss": _O,
})

TENSOR_CORE_OPS: frozenset[str] = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})
"""Ops whose FLOPs are tensor-core eligible (all other FLOPs run on the CUDA cores)."""

_DEFAULT_DOMAINS = frozenset({"", "ai.onnx"})


def kind_of(op_type: str, domain: str = "") -> OpKind:
    """The OpKind of an op; any other domain or an unknown op is OPAQUE (logged once)."""
    kind = OP_KINDS.get(op_type) if domain in _DEFAULT_DOMAINS else None
    if kind is None:
        _note_opaque(domain, op_type)
        return OpKind.OPAQUE
    return kind


@functools.cache
def _note_opaque(domain: str, op_type: str) -> None:
    where = "the default ONNX domain" if domain in _DEFAULT_DOMAINS else f"domain {domain!r}"
    log.info("op %s of %s has no OpKind entry: treated as OPAQUE (it stays alone)",
             op_type, where)


# ---------------------------------------------------------------------------------------------
# Shape helpers: every one returns None / 0 rather than raising on an unknown or odd shape.

Tensors = Sequence[TensorInfo | None]
Attrs = Mapping[str, Any]


def _at(tensors: Tensors, index: int) -> TensorInfo | None:
    return tensors[index] if 0 <= index < len(tensors) else None


def _shape(tensor: TensorInfo | None) -> tuple[int, ...] | None:
    if tensor is None or tensor.shape is None or any(int(d) < 0 for d in tensor.shape):
        return None
    return tuple(int(d) for d in tensor.shape)


def _size(tensor: TensorInfo | None) -> int:
    shape = _shape(tensor)
    return math.prod(shape) if shape is not None else 0


def _axis(shape: tuple[int, ...], axis: Any) -> int | None:
    axis = int(axis)
    return axis % len(shape) if -len(shape) <= axis < len(shape) else None


def _rows(shape: tuple[int, ...] | None, axis: Any) -> int:
    """Row count when the axes from `axis` on are reduced: prod(shape[:axis])."""
    at = _axis(shape, axis) if shape else None
    return math.prod(shape[:at]) if at is not None else 0


def _text(attrs: Attrs, key: str, default: str) -> str:
    value = attrs.get(key, default)
    return value.decode() if isinstance(value, bytes) else str(value)


def _present(tensors: Tensors) -> int:
    return sum(t is not None for t in tensors)


# ---------------------------------------------------------------------------------------------
# FLOPs per output element of ELEMWISE / BROADCAST ops; an op not listed costs 1 (Add, Relu,
# Cast, comparisons, logic, Where, Div, Reciprocal, Sqrt, Exp, Erf, Tanh, ...). A library
# function counts 1 here and is also counted by node_transcendentals.
_ELEMENT_FLOPS: Mapping[str, int] = MappingProxyType({
    "BatchNormalization": 2,  # x*s + t with s, t precomputed per channel (see _per_channel)
    "Celu": 6,  # max(0,x) + min(0, a*(exp(x/a) - 1))
    "Clip": 2,  # max then min
    "DequantizeLinear": 2,  # (x - zero_point) * scale
    "Elu": 4,  # select(x > 0, x, a*(exp(x) - 1))
    "HardSigmoid": 4,  # clamp(a*x + b, 0, 1)
    "HardSwish": 5,  # x * HardSigmoid(x)
    "LeakyRelu": 2,  # select(x > 0, x, a*x)
    "Mish": 5,  # x * tanh(log(1 + exp(x)))
    "Mod": 3,  # fmod: divide, truncate, multiply-subtract
    "PRelu": 2,  # select(x > 0, x, slope*x)
    "QuantizeLinear": 5,  # divide, round, add zero point, saturate (2)
    "Selu": 5,  # g * select(x > 0, x, a*(exp(x) - 1))
    "Shrink": 3,  # two compares and an add
    "Sigmoid": 4,  # 1 / (1 + exp(-x))
    "Softplus": 3,  # log(1 + exp(x))
    "Softsign": 3,  # x / (1 + |x|)
    "Swish": 6,  # x * sigmoid(a*x)
    "SwiGLU": 6,  # swish(a) * b
})
_GELU_FLOPS = MappingProxyType({"none": 5, "tanh": 9})  # 0.5x(1+erf(x/√2)) / tanh form
_VARIADIC = frozenset({"Max", "Min", "Sum", "Mean"})  # n inputs: n-1 ops (+1 divide for Mean)

# Transcendental evaluations per output element of ELEMWISE / BROADCAST ops (0 if not listed).
_ELEMENT_TRANSCENDENTALS: Mapping[str, int] = MappingProxyType({
    **dict.fromkeys(("Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Cos", "Cosh", "Erf",
                     "Exp", "Log", "Sin", "Sinh", "Sqrt", "Tan", "Tanh"), 1),
    **dict.fromkeys(("Celu", "Elu", "Gelu", "Selu", "Sigmoid", "Swish", "SwiGLU"), 1),
    "Softplus": 2,  # exp, log
    "Mish": 3,  # exp, log, tanh
})

# FLOPs per *input* element of REDUCE ops (a row pass plus, for normalizations, the second
# elementwise pass over the row).
_REDUCE_FLOPS: Mapping[str, int] = MappingProxyType({
    "ArgMax": 1, "ArgMin": 1, "ReduceMax": 1, "ReduceMin": 1, "ReduceProd": 1, "ReduceSum": 1,
    "ReduceMean": 1, "ReduceLogSum": 1,  # + 1 per output (divide / log), added below
    "ReduceL1": 2, "ReduceL2": 2, "ReduceSumSquare": 2,  # abs or square, add
    "ReduceLogSumExp": 4,  # max, subtract, exp, add
    "GlobalAveragePool": 1, "GlobalMaxPool": 1, "GlobalLpPool": 2,  # |x|^p, add
    "Hardmax": 2,  # argmax pass, one-hot write
    "Softmax": 5, "LogSoftmax": 5,  # max, subtract, exp, sum, divide (or subtract the log)
    "LpNormalization": 3,  # |x| or x², add, divide
    "RMSNormalization": 4,  # square, add, multiply by 1/rms, multiply by scale
    "MeanVarianceNormalization": 6,  # mean, subtract, square, add, subtract, divide
    # mean, then (x-mean)² summed (3), then (x-mean)*rstd*scale + bias (4)
    "LayerNormalization": 8, "GroupNormalization": 8, "InstanceNormalization": 8,
})
_REDUCE_PER_OUTPUT = frozenset({"ReduceMean", "ReduceLogSum", "ReduceLogSumExp"})


# ---------------------------------------------------------------------------------------------
# FLOPs of ops with a formula of their own.

def _conv_flops(ins: Tensors, outs: Tensors, w_at: int, b_at: int | None) -> int:
    """2*N*Cout*prod(out spatial)*(Cin/group)*prod(kernel) (+ out size for a bias)."""
    w, y = _shape(_at(ins, w_at)), _shape(_at(outs, 0))
    if w is None or y is None or len(w) < 2:
        return 0
    bias = _size(_at(outs, 0)) if b_at is not None and _at(ins, b_at) is not None else 0
    return 2 * math.prod(y) * math.prod(w[1:]) + bias  # w[1] = Cin/group, w[2:] = kernel


def _conv_transpose_flops(ins: Tensors, outs: Tensors) -> int:
    """2*N*Cin*prod(in spatial)*(Cout/group)*prod(kernel) (+ out size for a bias)."""
    x, w = _shape(_at(ins, 0)), _shape(_at(ins, 1))
    if x is None or w is None or len(w) < 2:
        return 0
    bias = _size(_at(outs, 0)) if _at(ins, 2) is not None else 0
    return 2 * math.prod(x) * math.prod(w[1:]) + bias  # w[1] = Cout/group


def _matmul_flops(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> int:
    """2*batch*M*N*K with numpy rules: 1-D operands promoted, batch dims broadcast."""
    if not a or not b:
        return 0
    a2 = (1, *a) if len(a) == 1 else a
    b2 = (*b, 1) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        return 0
    try:
        batch = np.broadcast_shapes(a2[:-2], b2[:-2])
    except ValueError:
        return 0
    return 2 * math.prod(batch) * a2[-2] * b2[-1] * a2[-1]


def _gemm_flops(attrs: Attrs, ins: Tensors) -> int:
    """2*M*N*K, + M*N to scale by alpha != 1, + M*N to add C (+ M*N more if beta != 1)."""
    a, b = _shape(_at(ins, 0)), _shape(_at(ins, 1))
    if a is None or b is None or len(a) != 2 or len(b) != 2:
        return 0
    m, k = (a[1], a[0]) if attrs.get("transA", 0) else a
    n = b[0] if attrs.get("transB", 0) else b[1]
    alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
    with_c = _at(ins, 2) is not None and beta != 0.0
    terms = (alpha != 1.0) + with_c + (with_c and beta != 1.0)
    return 2 * m * n * k + terms * m * n


def _einsum_labels(term: str, shape: tuple[int, ...]) -> list[Any] | None:
    before, dots, after = term.partition("...")
    n = len(shape) - len(before) - len(after)
    if n < 0 or (n and not dots):
        return None
    return [*before, *(("...", n - i) for i in range(n)), *after]  # ellipsis right-aligned


def _einsum_flops(attrs: Attrs, ins: Tensors) -> int:
    """Iteration-space size times the operand count (2x for a two-operand contraction)."""
    terms = _text(attrs, "equation", "").replace(" ", "").split("->")[0].split(",")
    sizes: dict[Any, int] = {}
    for term, tensor in zip(terms, ins, strict=False):
        shape = _shape(tensor)
        labels = _einsum_labels(term, shape) if shape is not None else None
        if labels is None:
            return 0
        for label, dim in zip(labels, shape, strict=True):
            sizes[label] = max(sizes.get(label, 1), dim)
    return math.prod(sizes.values()) * len(terms) if len(ins) >= len(terms) else 0


def _window_flops(attrs: Attrs, outs: Tensors, per_tap: int = 1) -> int:
    """Windowed pool: output size * window size (* per_tap)."""
    return _size(_at(outs, 0)) * math.prod(attrs.get("kernel_shape", ())) * per_tap


def _interp_taps(mode: str, axes: int) -> int:
    """FLOPs per output element of an interpolation over `axes` resampled axes."""
    if "linear" in mode:  # linear / bilinear / trilinear: 2^axes taps, a multiply-add each
        return 2 * 2**axes
    if mode in ("cubic", "bicubic"):
        return 2 * 4**axes
    return 1  # nearest: the coordinate transform only


def _resize_flops(attrs: Attrs, ins: Tensors, outs: Tensors) -> int:
    x, y = _shape(_at(ins, 0)), _shape(_at(outs, 0))
    if x is None or y is None or len(x) != len(y):
        return 0
    axes = sum(a != b for a, b in zip(x, y, strict=True))
    return math.prod(y) * _interp_taps(_text(attrs, "mode", "nearest"), axes)


def _grid_sample_flops(attrs: Attrs, outs: Tensors) -> int:
    y = _shape(_at(outs, 0))
    axes = len(y) - 2 if y is not None else 0
    return _size(_at(outs, 0)) * _interp_taps(_text(attrs, "mode", "linear"), axes)


def _roi_align_flops(attrs: Attrs, outs: Tensors) -> int:
    """Output size * samples per bin (adaptive ratio 0 taken as 2x2) * 4 bilinear taps."""
    ratio = int(attrs.get("sampling_ratio", 0)) or 2
    return _size(_at(outs, 0)) * ratio * ratio * 4


def _max_roi_pool_flops(attrs: Attrs, ins: Tensors, outs: Tensors) -> int:
    """Output size * the mean bin (input spatial / pooled shape)."""
    x, pooled = _shape(_at(ins, 0)), tuple(attrs.get("pooled_shape", ()))
    if x is None or len(x) != 4 or len(pooled) != 2 or 0 in pooled:
        return 0
    return _size(_at(outs, 0)) * math.ceil(x[2] / pooled[0]) * math.ceil(x[3] / pooled[1])


_RNN_GATES = MappingProxyType({"RNN": 1, "GRU": 3, "LSTM": 4})
_RNN_TRANSCENDENTALS = MappingProxyType({"RNN": 1, "GRU": 3, "LSTM": 5})  # per hidden unit


def _rnn_dims(op_type: str, ins: Tensors) -> tuple[int, int, int] | None:
    """(steps = seq * batch * directions, input size, hidden size) from X and W."""
    x, w = _shape(_at(ins, 0)), _shape(_at(ins, 1))
    if x is None or w is None or len(x) != 3 or len(w) != 3:
        return None
    # X is (seq, batch, I) or (batch, seq, I) by `layout`; W is (dirs, gates * H, I)
    return x[0] * x[1] * w[0], w[2], w[1] // _RNN_GATES[op_type]


def _rnn_flops(op_type: str, ins: Tensors) -> int:
    """Per step and gate row: input and recurrent GEMVs (2*(I+H)) + ~4 pointwise ops."""
    dims = _rnn_dims(op_type, ins)
    if dims is None:
        return 0
    steps, inputs, hidden = dims
    return steps * _RNN_GATES[op_type] * hidden * (2 * (inputs + hidden) + 4)


def _per_channel(ins: Tensors) -> int:
    """Size of BatchNormalization's per-channel scale (4 FLOPs + 1 rsqrt per channel)."""
    return _size(_at(ins, 1))


_FlopsFn = Callable[[Attrs, Tensors, Tensors], int]
_FLOPS_FORMULAS: Mapping[str, _FlopsFn] = MappingProxyType({
    "Conv": lambda a, i, o: _conv_flops(i, o, w_at=1, b_at=2),
    "ConvInteger": lambda a, i, o: _conv_flops(i, o, w_at=1, b_at=None),
    "QLinearConv": lambda a, i, o: _conv_flops(i, o, w_at=3, b_at=8),
    "DeformConv": lambda a, i, o: _conv_flops(i, o, w_at=1, b_at=3),  # sampling not counted
    "ConvTranspose": lambda a, i, o: _conv_transpose_flops(i, o),
    "MatMul": lambda a, i, o: _matmul_flops(_shape(_at(i, 0)), _shape(_at(i, 1))),
    "MatMulInteger": lambda a, i, o: _matmul_flops(_shape(_at(i, 0)), _shape(_at(i, 1))),
    "QLinearMatMul": lambda a, i, o: _matmul_flops(_shape(_at(i, 0)), _shape(_at(i, 3))),
    "Gemm": lambda a, i, o: _gemm_flops(a, i),
    "Einsum": lambda a, i, o: _einsum_flops(a, i),
    "MaxPool": lambda a, i, o: _window_flops(a, o),
    "AveragePool": lambda a, i, o: _window_flops(a, o) + _size(_at(o, 0)),  # + the divide
    "LpPool": lambda a, i, o: _window_flops(a, o, per_tap=2),  # |x|^p, add
    "LRN": lambda a, i, o: _size(_at(o, 0)) * (2 * int(a.get("size", 1)) + 4),
    "RoiAlign": lambda a, i, o: _roi_align_flops(a, o),
    "MaxRoiPool": _max_roi_pool_flops,
    "Resize": _resize_flops,
    "Upsample": _resize_flops,
    "GridSample": lambda a, i, o: _grid_sample_flops(a, o),
    "RotaryEmbedding": lambda a, i, o: 3 * _size(_at(o, 0)),  # x*cos ± x'*sin
    "BatchNormalization": lambda a, i, o: 2 * _size(_at(o, 0)) + 4 * _per_channel(i),
    "Gelu": lambda a, i, o: _GELU_FLOPS.get(_text(a, "approximate", "none"), 5)
    * _size(_at(o, 0)),
    "RNN": lambda a, i, o: _rnn_flops("RNN", i),
    "GRU": lambda a, i, o: _rnn_flops("GRU", i),
    "LSTM": lambda a, i, o: _rnn_flops("LSTM", i),
    "CumSum": lambda a, i, o: _size(_at(i, 0)),
    "CumProd": lambda a, i, o: _size(_at(i, 0)),
    "TopK": lambda a, i, o: _size(_at(i, 0)),  # one compare per element (selection)
})


def node_flops(op_type: str, attrs: Attrs, inputs: Tensors, outputs: Tensors) -> int:
    """Arithmetic operations of one node (multiply-add = 2); 0 when a shape is unknown.

    ELEMWISE/BROADCAST: output size * a per-op weight; REDUCE: input size * a per-op weight;
    data movement (INJECTIVE except resampling) and ops without a formula: 0.
    """
    formula = _FLOPS_FORMULAS.get(op_type) or functools.partial(_kind_flops, op_type)
    return _guarded(op_type, formula, attrs, inputs, outputs)


def _kind_flops(op_type: str, attrs: Attrs, inputs: Tensors, outputs: Tensors) -> int:
    kind = OP_KINDS.get(op_type, OpKind.OPAQUE)
    if kind <= OpKind.BROADCAST:
        return _elementwise_flops(op_type, inputs, outputs)
    if kind == OpKind.REDUCE:
        extra = _size(_at(outputs, 0)) if op_type in _REDUCE_PER_OUTPUT else 0
        return _REDUCE_FLOPS.get(op_type, 1) * _size(_at(inputs, 0)) + extra
    return 0


def _guarded(op_type: str, formula: Callable[..., int], *args: Any) -> int:
    """A formula's value as a non-negative int; a malformed attribute gives 0, not a raise."""
    try:
        return max(0, int(formula(*args)))
    except (ArithmeticError, IndexError, KeyError, TypeError, ValueError) as err:
        log.debug("no cost figure for %s (malformed attribute or shape: %s)", op_type, err)
        return 0


def _elementwise_flops(op_type: str, inputs: Tensors, outputs: Tensors) -> int:
    if op_type in _VARIADIC:
        n = _present(inputs)
        weight = max(1, n - 1) + (op_type == "Mean" and n > 1)
    else:
        weight = _ELEMENT_FLOPS.get(op_type, 1)
    return weight * _size(_at(outputs, 0))


# ---------------------------------------------------------------------------------------------
# Transcendental evaluations (exp, log, tanh, erf, sqrt/rsqrt, sin/cos, non-integer pow, ...).

def _pow_transcendentals(ins: Tensors, outs: Tensors) -> int:
    """exp(y*log(x)) per element unless the exponent is an integer tensor."""
    exponent = _at(ins, 1)
    is_int = exponent is not None and exponent.dtype.startswith(("int", "uint"))
    return 0 if is_int else _size(_at(outs, 0))


def _log_softmax_transcendentals(attrs: Attrs, ins: Tensors) -> int:
    """An exp per element and a log per row."""
    x = _shape(_at(ins, 0))
    at = _axis(x, attrs.get("axis", -1)) if x else None
    if at is None:
        return 0
    return math.prod(x) + math.prod(x) // max(1, x[at])


def _mvn_rows(attrs: Attrs, ins: Tensors) -> int:
    """One rsqrt per normalized slice: size / prod(shape[axes]), axes default [0, 2, 3]."""
    x = _shape(_at(ins, 0))
    axes = [_axis(x, a) for a in attrs.get("axes", (0, 2, 3))] if x else [None]
    if None in axes:
        return 0
    return math.prod(x) // max(1, math.prod(x[a] for a in set(axes)))


def _lp_norm_rows(attrs: Attrs, ins: Tensors) -> int:
    """p=2 takes a sqrt per row (a row = the `axis` dimension); p=1 none."""
    if int(attrs.get("p", 2)) != 2:
        return 0
    x = _shape(_at(ins, 0))
    at = _axis(x, attrs.get("axis", -1)) if x else None
    return math.prod(x) // max(1, x[at]) if at is not None else 0


def _global_lp_transcendentals(attrs: Attrs, ins: Tensors, outs: Tensors) -> int:
    """The p-th root per output; |x|^p per input too unless p is 1 or 2."""
    p = int(attrs.get("p", 2))
    roots = _size(_at(outs, 0)) if p != 1 else 0
    return roots + (_size(_at(ins, 0)) if p not in (1, 2) else 0)


def _group_norm_rows(attrs: Attrs, ins: Tensors) -> int:
    x = _shape(_at(ins, 0))
    return x[0] * int(attrs.get("num_groups", 1)) if x else 0


def _rnn_transcendentals(op_type: str, ins: Tensors) -> int:
    """Per step and hidden unit: RNN tanh; GRU 2 sigmoid + tanh; LSTM 3 sigmoid + 2 tanh."""
    dims = _rnn_dims(op_type, ins)
    return dims[0] * dims[2] * _RNN_TRANSCENDENTALS[op_type] if dims is not None else 0


_TranscFn = Callable[[Attrs, Tensors, Tensors], int]
_TRANSCENDENTAL_FORMULAS: Mapping[str, _TranscFn] = MappingProxyType({
    "Pow": lambda a, i, o: _pow_transcendentals(i, o),
    "BatchNormalization": lambda a, i, o: _per_channel(i),  # rsqrt(var + eps) per channel
    "Softmax": lambda a, i, o: _size(_at(i, 0)),  # one exp per element
    "LogSoftmax": lambda a, i, o: _log_softmax_transcendentals(a, i),
    "ReduceL2": lambda a, i, o: _size(_at(o, 0)),  # sqrt per output
    "ReduceLogSum": lambda a, i, o: _size(_at(o, 0)),  # log per output
    "ReduceLogSumExp": lambda a, i, o: _size(_at(i, 0)) + _size(_at(o, 0)),
    "LayerNormalization": lambda a, i, o: _rows(_shape(_at(i, 0)), a.get("axis", -1)),
    "RMSNormalization": lambda a, i, o: _rows(_shape(_at(i, 0)), a.get("axis", -1)),
    "InstanceNormalization": lambda a, i, o: _rows(_shape(_at(i, 0)), 2),  # per (N, C)
    "GroupNormalization": lambda a, i, o: _group_norm_rows(a, i),
    "MeanVarianceNormalization": lambda a, i, o: _mvn_rows(a, i),
    "LpNormalization": lambda a, i, o: _lp_norm_rows(a, i),
    "GlobalLpPool": _global_lp_transcendentals,
    "LpPool": lambda a, i, o: _size(_at(o, 0)) if int(a.get("p", 2)) != 1 else 0,
    "LRN": lambda a, i, o: _size(_at(o, 0)),  # (bias + alpha/size * sum)^beta
    "RNN": lambda a, i, o: _rnn_transcendentals("RNN", i),
    "GRU": lambda a, i, o: _rnn_transcendentals("GRU", i),
    "LSTM": lambda a, i, o: _rnn_transcendentals("LSTM", i),
})


def node_transcendentals(op_type: str, attrs: Attrs, inputs: Tensors, outputs: Tensors) -> int:
    """Transcendental evaluations of one node; 0 when a shape is unknown."""
    formula = _TRANSCENDENTAL_FORMULAS.get(op_type) or functools.partial(_element_transc, op_type)
    return _guarded(op_type, formula, attrs, inputs, outputs)


def _element_transc(op_type: str, attrs: Attrs, inputs: Tensors, outputs: Tensors) -> int:
    return _ELEMENT_TRANSCENDENTALS.get(op_type, 0) * _size(_at(outputs, 0))


def node_bytes(inputs: Tensors, outputs: Tensors) -> int:
    """DRAM bytes of the node run alone: each distinct input read once, each output written once.

    A tensor passed twice (Mul(x, x)) is read once; None entries (omitted optional inputs) are
    skipped; a tensor of unknown shape counts 0.
    """
    reads = {t.name: t for t in inputs if t is not None}
    writes = {t.name: t for t in outputs if t is not None}
    return sum(_nbytes(t) for t in (*reads.values(), *writes.values()))


def _nbytes(tensor: TensorInfo) -> int:
    return tensor.nbytes if _shape(tensor) is not None else 0
