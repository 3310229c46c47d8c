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


def _equal_at(gk, prep, threads):
    """`gk` run at each thread count equals ONNX Runtime on every output."""
    from fusesearch.backends.cpu import openmp_threads
    from fusesearch.ir.canonicalize import to_proto
    from fusesearch.verify import all_values, random_feeds

    values = all_values(to_proto(prep.canonical), random_feeds(to_proto(prep.canonical), 0))
    for t in threads:
        with openmp_threads(t):
            out = cpu.run(gk, {a.tensor: values[a.tensor] for a in gk.inputs})
        for a in gk.outputs:
            ref = values[a.tensor].astype(np.float64)
            np.testing.assert_allclose(out[a.tensor], ref, rtol=0, atol=1e-4 * max(1.0, float(np.abs(ref).max())),
                                       err_msg=f"{a.tensor} at {t} threads")


@pytest.mark.parametrize("seq,strips", [(40, True), (100, False)])  # K x N = 16 x seq; 64 x 1100 past one L2 block
def test_a_block_finishes_its_scores_rows_while_they_are_in_cache(tmp_path, seq, strips):
    """Attention's scores under a Softmax: each block of rows computes its scores (the keys packed
    once per block) and then runs the Softmax over those rows, in strips of PANEL_ROWS rows where
    the keys stay in L2 (`schedule.row_strips`): a strip's scores are read back from L1, not the
    whole heads' matrix from L2 after every block; the mask's side loop runs once before the blocks.
    Equal to ONNX Runtime at 1 and 2 threads."""
    from fusesearch.backends.codegen import generate

    nodes, inits = _scores("Mul", 0.125)
    nodes = [helper.make_node("Mul", ["m", "big"], ["mask"])] + nodes  # the mask computed in the group
    d = 16 if strips else 1100
    prep = prepare(save(make_model(nodes, [("q", [1, 2, seq, d]), ("k", [1, 2, seq, d]), ("m", [1, 1, 1, seq])],
                                   [("out", None), ("mask", None)], inits + [("big", np.float32(-100.0))]),
                        tmp_path / "m.onnx"))
    graph = prep.graph
    own = next(k for k in choices(graph, FusionGroup(frozenset(range(len(graph)))), host=AVX512)
               if k.schedule.product == "own")
    gk = generate(graph, own)
    body = _body(gk)
    block = body[body.index("for (long long blk = 0;"):]
    product, rows = block.index("fs_gemm_rows("), block.index("long long ybase = z * ")
    assert product < rows < block.index("for (long long rp = 0; rp < (mc + 1) / 2; ++rp)"), block
    mask = next(a.name for a in gk.outputs if a.tensor == "mask")
    assert body.index(f"{mask}[") < body.index("for (long long blk = 0;") and body.count("#pragma omp for") == 2, body
    assert (f"for (long long s0 = 0; s0 < mcb; s0 += {schedule.PANEL_ROWS}LL)" in block) == strips, block
    _equal_at(gk, prep, (1, 2))


def test_a_block_epilogue_runs_in_strips_that_stay_in_l1(tmp_path):
    """Bias + GELU after a product whose B stays in L2, without the tile epilogue (the block
    epilogue, as on a CPU without AVX-512): each block's product and its epilogue run per strip of
    PANEL_ROWS rows, so the strip's product buffer is read back from L1 (12 x N floats, not the
    block's rows x N). Equal to ONNX Runtime at 1 and 2 threads."""
    from fusesearch.backends.codegen import generate
    from tests.backends.test_cpu_split import _gelu

    nodes, inputs, outputs, inits = _gelu(70)
    prep = prepare(save(make_model(nodes, inputs, outputs, inits), tmp_path / "m.onnx"))
    graph = prep.graph
    block = next(k for k in choices(graph, FusionGroup(frozenset(range(len(graph)))), host=schedule.CpuTarget(lanes=8))
                 if k.schedule.product == "own")
    gk = generate(graph, block)
    body = _body(gk)
    loop = body[body.index(f"for (long long s0 = 0; s0 < mcb; s0 += {schedule.PANEL_ROWS}LL)"):]
    assert loop.index("cbuf = fs_scratch(") < loop.index("fs_gemm_rows(mc,") < loop.index("fs_gelu"), body
    _equal_at(gk, prep, (1, 2))
