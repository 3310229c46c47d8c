"""OpKind table coverage, kind lookup and per-node cost figures (FLOPs, transcendentals, bytes)."""

from __future__ import annotations

import logging

import onnx.defs
import pytest

from fusesearch.ir.graph import TensorInfo
from fusesearch.ir.op_kind import (
    OP_KINDS,
    TENSOR_CORE_OPS,
    OpKind,
    kind_of,
    node_bytes,
    node_flops,
    node_transcendentals,
)


def t(name: str, *shape: int, dtype: str = "float32") -> TensorInfo:
    return TensorInfo(name, tuple(shape), dtype)


def unknown(name: str) -> TensorInfo:
    return TensorInfo(name, None, "float32")


# --- the table ---------------------------------------------------------------------------------

def _onnx_ops(max_opset: int = 21) -> set[str]:
    return {
        s.name for s in onnx.defs.get_all_schemas_with_history()
        if s.domain in ("", "ai.onnx") and s.since_version <= max_opset
    }


def test_every_standard_op_of_opsets_7_to_21_has_an_explicit_entry() -> None:
    missing = _onnx_ops() - set(OP_KINDS)
    assert not missing, f"add these ops to OP_KINDS: {sorted(missing)}"


def test_newer_ops_known_to_onnx_are_covered_too() -> None:
    missing = _onnx_ops(max_opset=10_000) - set(OP_KINDS)
    assert not missing, f"add these ops to OP_KINDS: {sorted(missing)}"


def test_table_is_immutable() -> None:
    with pytest.raises(TypeError):
        OP_KINDS["Relu"] = OpKind.OPAQUE  # type: ignore[index]


def test_kind_order_reads_as_legality() -> None:
    order = [OpKind.ELEMWISE, OpKind.BROADCAST, OpKind.INJECTIVE, OpKind.REDUCE,
             OpKind.ANCHOR, OpKind.OPAQUE]
    assert order == sorted(order)
    assert [int(k) for k in order] == [0, 1, 2, 3, 4, 8]


@pytest.mark.parametrize(("op", "kind"), [
    ("Relu", OpKind.ELEMWISE), ("Erf", OpKind.ELEMWISE), ("Gelu", OpKind.ELEMWISE),
    ("Cast", OpKind.ELEMWISE), ("IsNaN", OpKind.ELEMWISE),
    ("Add", OpKind.BROADCAST), ("Where", OpKind.BROADCAST), ("Clip", OpKind.BROADCAST),
    ("PRelu", OpKind.BROADCAST), ("BatchNormalization", OpKind.BROADCAST),
    ("DequantizeLinear", OpKind.BROADCAST),
    ("Reshape", OpKind.INJECTIVE), ("Transpose", OpKind.INJECTIVE), ("Gather", OpKind.INJECTIVE),
    ("Resize", OpKind.INJECTIVE), ("Upsample", OpKind.INJECTIVE), ("MaxPool", OpKind.INJECTIVE),
    ("AveragePool", OpKind.INJECTIVE),
    ("Softmax", OpKind.REDUCE), ("LayerNormalization", OpKind.REDUCE),
    ("ReduceMean", OpKind.REDUCE), ("GlobalAveragePool", OpKind.REDUCE),
    ("RMSNormalization", OpKind.REDUCE),
    ("Conv", OpKind.ANCHOR), ("ConvTranspose", OpKind.ANCHOR), ("MatMul", OpKind.ANCHOR),
    ("Gemm", OpKind.ANCHOR),
    ("If", OpKind.OPAQUE), ("Loop", OpKind.OPAQUE), ("TopK", OpKind.OPAQUE),
    ("NonMaxSuppression", OpKind.OPAQUE), ("LpPool", OpKind.OPAQUE), ("LSTM", OpKind.OPAQUE),
    ("Einsum", OpKind.OPAQUE), ("QLinearMatMul", OpKind.OPAQUE), ("Shape", OpKind.OPAQUE),
    ("Scatter", OpKind.OPAQUE), ("CumSum", OpKind.OPAQUE),
])
def test_kind_of_standard_ops(op: str, kind: OpKind) -> None:
    assert kind_of(op) is kind
    assert kind_of(op, "ai.onnx") is kind


def test_tensor_core_ops_are_the_anchors() -> None:
    assert TENSOR_CORE_OPS == {"Conv", "ConvTranspose", "MatMul", "Gemm"}
    assert {op for op, k in OP_KINDS.items() if k is OpKind.ANCHOR} == TENSOR_CORE_OPS


@pytest.mark.parametrize(("op", "domain"), [
    ("FusedMatMul", "com.microsoft"), ("Relu", "my.custom"), ("LabelEncoder", "ai.onnx.ml"),
    ("NoSuchOpXyz", ""),
])
def test_other_domains_and_unknown_ops_are_opaque_and_logged_once(
    op: str, domain: str, caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="fusesearch.ir.op_kind"):
        assert kind_of(op, domain) is OpKind.OPAQUE
        assert kind_of(op, domain) is OpKind.OPAQUE
    hits = [r for r in caplog.records if op in r.getMessage()]
    assert len(hits) == 1 and hits[0].levelno == logging.INFO


# --- FLOPs -------------------------------------------------------------------------------------

def test_conv_flops() -> None:  # ResNet stage-1 3x3 conv: 2*1*64*56*56*64*9
    ins = [t("x", 1, 64, 56, 56), t("w", 64, 64, 3, 3)]
    out = [t("y", 1, 64, 56, 56)]
    assert node_flops("Conv", {"pads": [1, 1, 1, 1]}, ins, out) == 231_211_008
    with_bias = [*ins, t("b", 64)]
    assert node_flops("Conv", {"pads": [1, 1, 1, 1]}, with_bias, out) == 231_211_008 + 200_704


def test_depthwise_conv_flops() -> None:  # group = C: each output reads Cin/group = 1 channel
    ins = [t("x", 1, 32, 112, 112), t("w", 32, 1, 3, 3), None]
    out = [t("y", 1, 32, 112, 112)]
    assert node_flops("Conv", {"group": 32, "pads": [1, 1, 1, 1]}, ins, out) == 2 * 32 * 112**2 * 9


def test_grouped_conv_flops() -> None:
    ins = [t("x", 2, 64, 8, 8), t("w", 128, 16, 3, 3)]  # group 4: 64/4 = 16 channels per output
    out = [t("y", 2, 128, 8, 8)]
    assert node_flops("Conv", {"group": 4}, ins, out) == 2 * 2 * 128 * 64 * 16 * 9


def test_conv_transpose_flops() -> None:
    ins = [t("x", 1, 16, 8, 8), t("w", 16, 8, 4, 4)]
    out = [t("y", 1, 8, 16, 16)]
    assert node_flops("ConvTranspose", {"strides": [2, 2]}, ins, out) == 2 * 16 * 64 * 8 * 16


@pytest.mark.parametrize(("a", "b", "expected"), [
    ((2, 1, 4, 8), (3, 8, 5), 2 * (2 * 3) * 4 * 5 * 8),  # batch dims broadcast to (2, 3)
    ((4, 8), (8, 5), 2 * 4 * 5 * 8),
    ((8,), (2, 8, 5), 2 * 2 * 5 * 8),  # 1-D left operand: a row vector
    ((4, 8), (8,), 2 * 4 * 8),  # 1-D right operand: a column vector
    ((8,), (8,), 2 * 8),  # dot product
    ((4, 8), (7, 5), 0),  # inconsistent K: no figure, no exception
    ((2, 4, 8), (3, 8, 5), 0),  # batch dims that do not broadcast
])
def test_matmul_flops(a: tuple[int, ...], b: tuple[int, ...], expected: int) -> None:
    assert node_flops("MatMul", {}, [t("a", *a), t("b", *b)], [unknown("y")]) == expected


def test_gemm_flops() -> None:
    a, b, c, y = t("a", 32, 128), t("b", 64, 128), t("c", 64), t("y", 32, 64)
    mnk = 2 * 32 * 64 * 128
    assert node_flops("Gemm", {"transB": 1}, [a, b, c], [y]) == mnk + 32 * 64  # + C
    assert node_flops("Gemm", {"transB": 1}, [a, b], [y]) == mnk
    assert node_flops("Gemm", {"transB": 1, "alpha": 0.5, "beta": 2.0}, [a, b, c], [y]) == (
        mnk + 3 * 32 * 64)  # alpha scale, beta scale, add
    assert node_flops("Gemm", {"transB": 1, "beta": 0.0}, [a, b, c], [y]) == mnk
    at = t("a", 128, 32)
    assert node_flops("Gemm", {"transA": 1, "transB": 1}, [at, b], [y]) == mnk


def test_elementwise_flops_use_per_op_weights() -> None:
    x, y = t("x", 2, 3, 4), t("y", 2, 3, 4)
    assert node_flops("Relu", {}, [x], [y]) == 24
    assert node_flops("Add", {}, [x, t("b", 4)], [y]) == 24
    assert node_flops("Clip", {}, [x, None, None], [y]) == 48
    assert node_flops("Sum", {}, [x, x, x], [y]) == 48  # 3 inputs: 2 adds
    assert node_flops("Gelu", {}, [x], [y]) == 5 * 24
    assert node_flops("Gelu", {"approximate": "tanh"}, [x], [y]) > 5 * 24


def test_reduce_flops() -> None:
    x, y = t("x", 2, 10), t("y", 2, 10)
    assert node_flops("Softmax", {"axis": -1}, [x], [y]) == 5 * 20
    assert node_flops("ReduceSum", {}, [x, t("axes", 1, dtype="int64")], [t("s", 2, 1)]) == 20
    ln = [t("x", 2, 5, 8), t("scale", 8), t("bias", 8)]
    assert node_flops("LayerNormalization", {"axis": -1}, ln, [t("y", 2, 5, 8)]) == 8 * 80


def test_pool_flops() -> None:  # output size * window (compares or adds), + a divide per average
    x, y = t("x", 1, 64, 112, 112), t("y", 1, 64, 56, 56)
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    assert node_flops("MaxPool", attrs, [x], [y]) == 64 * 56 * 56 * 9
    assert node_flops("AveragePool", attrs, [x], [y]) == 64 * 56 * 56 * 10
    assert node_flops("GlobalAveragePool", {}, [x], [t("g", 1, 64, 1, 1)]) == 64 * 112 * 112


def test_resize_flops_depend_on_mode() -> None:
    x, y = t("x", 1, 3, 8, 8), t("y", 1, 3, 16, 16)
    assert node_flops("Resize", {"mode": "nearest"}, [x], [y]) == 3 * 256
    assert node_flops("Resize", {"mode": "linear"}, [x], [y]) == 3 * 256 * 2 * 4  # 4 taps


@pytest.mark.parametrize("op", ["Reshape", "Transpose", "Concat", "Gather", "Identity", "Shape"])
def test_data_movement_has_no_flops(op: str) -> None:
    assert node_flops(op, {}, [t("x", 4, 4)], [t("y", 16)]) == 0


def test_unknown_shapes_give_zero_never_raise() -> None:
    x, y = unknown("x"), unknown("y")
    for op in ("Conv", "ConvTranspose", "MatMul", "Gemm", "Add", "Relu", "Softmax", "MaxPool",
               "LayerNormalization", "Resize", "Einsum", "LSTM", "NoSuchOp"):
        assert node_flops(op, {"kernel_shape": [3, 3], "equation": "ij,jk->ik"}, [x, x], [y]) == 0
        assert node_flops(op, {}, [], []) == 0
        assert node_transcendentals(op, {}, [x, x], [y]) == 0
    assert node_bytes([x, None], [y]) == 0


def test_malformed_attributes_give_zero() -> None:
    x, y = t("x", 1, 4, 8, 8), t("y", 1, 4, 8, 8)
    assert node_flops("LRN", {"size": "five"}, [x], [y]) == 0
    assert node_flops("MaxPool", {"kernel_shape": None}, [x], [y]) == 0


def test_einsum_flops() -> None:
    ins = [t("a", 2, 4, 8), t("b", 2, 8, 5)]
    assert node_flops("Einsum", {"equation": "bij,bjk->bik"}, ins, [t("y", 2, 4, 5)]) == (
        2 * 2 * 4 * 8 * 5)
    assert node_flops("Einsum", {"equation": "...ij,...jk"}, ins, [t("y", 2, 4, 5)]) == (
        2 * 2 * 4 * 8 * 5)


def test_lstm_flops_and_transcendentals() -> None:
    seq, batch, inp, hid = 5, 2, 16, 32
    ins = [t("x", seq, batch, inp), t("w", 1, 4 * hid, inp), t("r", 1, 4 * hid, hid)]
    steps = seq * batch
    flops = node_flops("LSTM", {"hidden_size": hid}, ins, [])
    assert flops == steps * 4 * hid * (2 * (inp + hid) + 4)
    assert node_transcendentals("LSTM", {"hidden_size": hid}, ins, []) == steps * hid * 5


# --- transcendentals ---------------------------------------------------------------------------

def test_transcendentals() -> None:
    x, y = t("x", 2, 10), t("y", 2, 10)
    assert node_transcendentals("Softmax", {}, [x], [y]) == 20  # one exp per element
    assert node_transcendentals("LogSoftmax", {}, [x], [y]) == 20 + 2  # + one log per row
    assert node_transcendentals("Erf", {}, [x], [y]) == 20
    assert node_transcendentals("Tanh", {}, [x], [y]) == 20
    assert node_transcendentals("Gelu", {}, [x], [y]) == 20
    assert node_transcendentals("Relu", {}, [x], [y]) == 0
    assert node_transcendentals("Add", {}, [x, x], [y]) == 0
    ln = [t("x", 2, 5, 8), t("scale", 8)]
    assert node_transcendentals("LayerNormalization", {}, ln, [t("y", 2, 5, 8)]) == 10  # rows
    assert node_transcendentals("LayerNormalization", {"axis": 1}, ln, [t("y", 2, 5, 8)]) == 2


def test_pow_transcendentals_depend_on_exponent_dtype() -> None:
    x, y = t("x", 2, 10), t("y", 2, 10)
    assert node_transcendentals("Pow", {}, [x, t("e", dtype="float32")], [y]) == 20
    assert node_transcendentals("Pow", {}, [x, t("e", dtype="int64")], [y]) == 0


# --- bytes -------------------------------------------------------------------------------------

def test_node_bytes_reads_a_duplicated_input_once() -> None:
    x, y = t("x", 2, 3), t("y", 2, 3)
    assert node_bytes([x, x], [y]) == 24 + 24
    assert node_bytes([x, None, t("b", 3, dtype="float16")], [y]) == 24 + 6 + 24
    assert node_bytes([x], [y, t("mask", 2, 3, dtype="bool")]) == 24 + 24 + 6
