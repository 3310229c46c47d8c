"""The CPU kernels' hot path: a constant scale of the product packed into B (no op on the product),
equal to ONNX Runtime, the schedule that decides it and the price that follows from it."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from fusesearch import schedule
from fusesearch.backends import cpu
from fusesearch.groups import FusionGroup
from fusesearch.lowering import choices
from fusesearch.pipeline import prepare
from tests.backends.test_cpu_packed import AVX512, _w, one_kernel
from tests.conftest import make_model, save

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler")


def _body(gk) -> str:
    """The kernel's own function, without the prelude and its packing function."""
    return gk.c_source[gk.c_source.index(f"void {gk.name}("):].split(f"void {gk.name}_pack(")[0]


def _scores(scale_op: str, constant: float):
    """Q x K^T (keys transposed in the group), scaled by a constant, masked, under a Softmax."""
    return [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
            helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node(scale_op, ["s", "c"], ["d"]),
            helper.make_node("Add", ["d", "mask"], ["a"]), helper.make_node("Softmax", ["a"], ["out"], axis=-1)], \
        [("c", np.float32(constant))]


@pytest.mark.parametrize("scale_op,constant,packed", [("Mul", 0.125, "0.125f"), ("Div", 8.0, "0.125f"),
                                                      ("Mul", 0.3, "0.30000001192092896f")])
def test_score_scale_is_packed_into_the_keys(tmp_path, scale_op, constant, packed):
    """Attention's score x 0.125 (or / 8, or any constant) after Q x K^T under a Softmax: the keys
    are packed per head times the scale (`fs_pack_b`'s scale), so the Softmax's passes read the
    product as stored: the scale appears once in the kernel, in the packing call, no pass over
    the product or the panel multiplies by it. Equal to ONNX Runtime."""
    nodes, inits = _scores(scale_op, constant)
    gk = one_kernel(tmp_path, nodes, [("q", [1, 2, 40, 16]), ("k", [1, 2, 40, 16]), ("mask", [1, 1, 1, 40])],
                    [("out", None)], inits, expect="ybuf", product="own")
    body = _body(gk)
    assert f"1LL, 16LL, {packed}, bbuf);" in body and body.count(packed) == 1, body
    assert "*=" not in body


def test_score_scale_is_priced_as_no_op_with_our_product_only(tmp_path):
    """The schedule decides the fold (`schedule.scaled_product`): our micro-kernel's choice runs no
    op for the scale (priced one multiply per score less than the BLAS's choice, whose loops
    without a BLAS compute the product unscaled and so keep the multiply, written in the
    Softmax's first pass)."""
    nodes, inits = _scores("Mul", 0.125)
    prep = prepare(save(make_model(nodes, [("q", [1, 2, 40, 16]), ("k", [1, 2, 40, 16]), ("mask", [1, 1, 1, 40])],
                                   [("out", None)], inits), tmp_path / "m.onnx"))
    graph = prep.graph
    options = {k.schedule.product: k for k in choices(graph, FusionGroup(frozenset(range(len(graph)))), host=AVX512)}
    anchor = next(n for n in graph.nodes if n.op_type == "MatMul")
    scale = next(n for n in graph.nodes if n.op_type == "Mul")
    members = frozenset(range(len(graph)))
    assert schedule.scaled_product(graph, members, anchor, "own") == schedule.ScaledProduct(
        scale.outputs[0], 0.125, frozenset({scale.id}))
    assert schedule.scaled_product(graph, members, anchor, "blas") is None
    assert options["blas"].scalar_flops - options["own"].scalar_flops == 2 * 40 * 40
    from fusesearch.backends.codegen import generate

    assert "* 0.125f)" in _body(generate(graph, options["blas"]))


def test_scale_read_elsewhere_is_not_folded(tmp_path):
    """The product itself also an output of the group: the scale is not folded (the output holds
    the product unscaled), and the kernel still equals ONNX Runtime."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Mul", ["y", "c"], ["out"])]
    gk = one_kernel(tmp_path, nodes, [("x", [40, 24])], [("out", None), ("y", None)],
                    [("w", _w([24, 32])), ("c", np.float32(0.125))], product="own")
    assert gk.packed[0].scale == 1.0 and "0.125f" in _body(gk)


def test_product_scale_with_a_bias_is_stored_with_no_pass(tmp_path):
    """A constant-weight MatMul scaled then biased: the weights are packed once times the scale
    (no pass of their own after packing), and the micro-kernel stores the product plus the bias
    row straight into the output: no block buffer, no epilogue loop. Equal to ONNX Runtime."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Div", ["y", "c"], ["d"]),
             helper.make_node("Add", ["d", "b"], ["out"])]
    gk = one_kernel(tmp_path, nodes, [("x", [40, 24])], [("out", None)],
                    [("w", _w([24, 32])), ("c", np.float32(4.0)), ("b", _w([32], 1))], product="own")
    assert gk.packed[0].scale == 0.25 and "0.25f, pk0 + g" in gk.c_source and "*=" not in gk.c_source
    body = _body(gk)
    assert "fs_gemm_rows(mc, 32LL, 24LL, in0 + (" in body and "cbuf" not in body and "0.25f" not in body
