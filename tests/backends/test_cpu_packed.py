"""The CPU's packed GEMM and conv skeletons equal ONNX Runtime at their edges: a BLAS sgemm per
block of rows (MatMul/Gemm) or of output rows (conv as implicit GEMM over an im2col panel), the
depthwise loop, and the same kernels without a BLAS (the row loops they fall back to), plus the
vector math the C kernels call under `omp simd`."""

from __future__ import annotations

import ctypes
import subprocess

import numpy as np
import pytest
from onnx import helper

from fusesearch import schedule
from fusesearch.backends import cpu
from fusesearch.backends.codegen import generate
from fusesearch.groups import FusionGroup
from fusesearch.ir.canonicalize import to_proto
from fusesearch.lowering import choices, lower, try_lower
from fusesearch.pipeline import prepare
from fusesearch.verify import all_values, random_feeds
from tests.conftest import make_model, save

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler")
AVX512 = schedule.CpuTarget(lanes=schedule.TILE_EPILOGUE_LANES)  # a target with the tile epilogue


@pytest.fixture(params=["blas", "no-blas"])
def blas(request, monkeypatch):
    """Run each case with the BLAS path and with the row loops the kernel falls back to."""
    if request.param == "no-blas":
        monkeypatch.setenv("FUSESEARCH_NO_BLAS", "1")
    elif not cpu.blas_flags.__wrapped__():
        pytest.fail("scipy-openblas32 is a dependency: the BLAS path must be available")
    cpu.blas_flags.cache_clear()
    cpu._load.cache_clear()
    yield request.param
    cpu.blas_flags.cache_clear()
    cpu._load.cache_clear()


def one_kernel(tmp_path, nodes, inputs, outputs, inits=(), expect=None, product=None):
    """The whole graph as one group, generated, run on the CPU and compared with ONNX Runtime: its
    default choice on a CPU (one with AVX-512's vectors: the tile epilogue's source compiles and
    runs anywhere, its block epilogue under `#else`), or the choice whose schedule names `product`."""
    prep = prepare(save(make_model(nodes, inputs, outputs, inits), tmp_path / "m.onnx"))
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    options = choices(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))), host=AVX512)
    gk = generate(prep.graph, next(k for k in options if k.schedule.product == product) if product else options[0])
    if expect is not None:
        assert expect in _body(gk), f"the {expect} skeleton was not chosen"
    out = cpu.run(gk, {a.tensor: values[a.tensor] for a in gk.inputs})
    for a in gk.outputs:
        ref = values[a.tensor].astype(np.float64)
        scale = max(1.0, float(np.max(np.abs(ref)))) if ref.size else 1.0
        np.testing.assert_allclose(out[a.tensor], ref, rtol=0, atol=1e-4 * scale, err_msg=a.tensor)
    return gk


def _body(gk) -> str:
    """A generated kernel's own function: the calls it makes, not the prelude's definitions."""
    return gk.c_source[gk.c_source.index(f"void {gk.name}("):]


def _w(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.3


ROWS, BLAS = "fs_gemm_rows(", "FS_BLAS_SGEMM(101"


@pytest.mark.parametrize("m,k,n,path", [(1, 1, 1, BLAS), (5, 1, 7, BLAS), (70, 33, 1, BLAS), (130, 17, 65, ROWS),
                                        (64, 64, 64, ROWS), (6, 1, 16, ROWS), (13, 1030, 20, ROWS),
                                        (13, 3078, 20, ROWS), (13, 4102, 20, BLAS), (8, 9, 18, ROWS), (9, 9, 18, ROWS), (10, 9, 18, ROWS),
                                        (11, 9, 18, ROWS), (7, 1100, 1000, ROWS), (7, 2000, 2100, ROWS)])
def test_matmul_bias_act_edges(tmp_path, blas, m, k, n, path):
    """M, N, K off the block size (the last M % FS_MR rows, 1 to 5, by `fs_micro_tail`); K = 1;
    N = 1; prologue (Relu) and epilogue (bias, Tanh). A constant B goes to our micro-kernel packed
    once (`fs_gemm_rows`, no BLAS needed) from one full tile (FS_MR rows, FS_NR columns), up to
    ROWS_MAX_K and ROWS_MAX_B_FLOATS; below, or beyond (`test_a_weight_beyond_the_packing_cap...`),
    to the BLAS."""
    nodes = [helper.make_node("Relu", ["x"], ["xr"]), helper.make_node("MatMul", ["xr", "w"], ["y"]),
             helper.make_node("Add", ["y", "b"], ["z"]), helper.make_node("Tanh", ["z"], ["out"])]
    gk = one_kernel(tmp_path, nodes, [("x", [2, m, k])], [("out", None)], [("w", _w([k, n])), ("b", _w([n], 1))],
                    expect=path)
    assert bool(gk.packed) == (path == ROWS)


def test_a_weight_beyond_the_packing_cap_goes_to_the_blas(tmp_path, blas, monkeypatch):
    """A constant B above ROWS_MAX_B_FLOATS (the packed copy a plan may keep) is not packed: the
    BLAS reads it per call; at the cap it is ours."""
    from fusesearch import schedule

    nodes = [helper.make_node("MatMul", ["x", "w"], ["out"])]
    monkeypatch.setattr(schedule, "ROWS_MAX_B_FLOATS", 40 * 48)
    one_kernel(tmp_path, nodes, [("x", [7, 40])], [("out", None)], [("w", _w([40, 48]))], expect=ROWS)
    monkeypatch.setattr(schedule, "ROWS_MAX_B_FLOATS", 40 * 48 - 1)
    assert not one_kernel(tmp_path, nodes, [("x", [7, 40])], [("out", None)], [("w", _w([40, 48]))], expect=BLAS).packed


@pytest.mark.parametrize("m", [6, 37, 130])
def test_packed_b_product_adds_onto_its_bias_in_place(tmp_path, blas, m):
    """MatMul + bias + residual (the product plus terms without it) over a constant B:
    `fs_gemm_rows` reads both in place and adds them at the store (R0 the bias row, C0 the
    residual), with no product buffer and no prefill pass; also when the group has a second output
    (its prologue's value, as a LayerNorm feeding both the residual and the product), with the
    bias alone, A then read back from that output."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["z"]),
             helper.make_node("Add", ["z", "r"], ["out"])]
    gk = one_kernel(tmp_path, nodes, [("x", [m, 40]), ("r", [m, 33])], [("out", None)], [("w", _w([40, 33])), ("b", _w([33], 1))])
    named = {a.tensor: a.name for a in gk.inputs}
    assert "cbuf" not in gk.c_source and "col < 33LL" not in gk.c_source  # no prefill loop
    assert f"pk0, out0 + (m0 * 33LL), 33LL, {named['r']} + (z * {m * 33}LL + m0 * 33LL), 33LL, {named['b']});" in gk.c_source
    side = [helper.make_node("Sigmoid", ["x"], ["xs"]), helper.make_node("MatMul", ["xs", "w"], ["y"]),
            helper.make_node("Add", ["y", "b"], ["out"])]
    gk = one_kernel(tmp_path, side, [("x", [m, 40])], [("out", None), ("xs", None)], [("w", _w([40, 33])), ("b", _w([33], 1))])
    xs = next(a.name for a in gk.outputs if a.tensor == "xs")  # A read back from the output it is, not computed twice
    assert "cbuf" not in gk.c_source and "abuf" not in gk.c_source
    assert f"fs_gemm_rows(mc, 33LL, 40LL, {xs} + ((m0)*40LL + 0), 40LL, pk0, out" in gk.c_source
    bias = next(a.name for a in gk.inputs if a.tensor == "b")
    assert f"33LL, 0, 0LL, {bias});" in gk.c_source and "col < 33LL" not in gk.c_source


@pytest.mark.parametrize("m", [1, 37, 130])
def test_a_product_without_epilogue_is_stored_by_the_blas(tmp_path, blas, m):
    """A prologue-only group (Sigmoid + MatMul, batched) and a MatMul whose product a Transpose
    reorders: our micro-kernel over B packed once (or the sgemm, for one row or fewer than FS_NR
    columns) writes the output (or the product's buffer) itself, no epilogue pass."""
    nodes = [helper.make_node("Sigmoid", ["x"], ["xs"]), helper.make_node("MatMul", ["xs", "w"], ["out"])]
    gk = one_kernel(tmp_path, nodes, [("x", [3, m, 24])], [("out", None)], [("w", _w([24, 19]))])
    moved = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Transpose", ["y"], ["out"], perm=[0, 2, 1])]
    gk2 = one_kernel(tmp_path, moved, [("x", [3, m, 24])], [("out", None)], [("w", _w([24, 19]))])
    call = "0.0f, {} + ((z) * " if m == 1 else "pk0, {} + ((z) * "  # the sgemm, or fs_gemm_rows
    assert call.format("out0") in gk.c_source and call.format("ybuf") in gk2.c_source
    assert "cbuf" not in gk.c_source + gk2.c_source
    fewer = one_kernel(tmp_path, nodes, [("x", [3, m, 24])], [("out", None)], [("w", _w([24, 7]))])  # N < FS_NR: the BLAS
    assert "0.0f, out0 + ((z) * " in fewer.c_source and "cbuf" not in fewer.c_source


@pytest.mark.parametrize("m", [5, 70])
def test_matmul_batch_broadcast_and_computed_b(tmp_path, blas, m):
    """Batched activations against a broadcast batch of B that is a view of an input (a Transpose
    of the keys, as attention's score product): the keys are packed per batch from the input by
    their strides (transposed: unit stride along K) and multiplied by our micro-kernel; below one
    full tile of rows the BLAS reads them in place, transposed; then a division by a constant."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Div", ["s", "c"], ["out"])]
    gk = one_kernel(tmp_path, nodes, [("q", [2, 3, m, 16]), ("k", [1, 3, 70, 16])], [("out", None)],
                    [("c", np.float32(4.0))])
    body = gk.c_source[gk.c_source.index(f"\nvoid {gk.name}("):]
    if m >= 6:
        # the division by 4, a multiplication by 0.25 packed into the keys: no op on the product
        assert "fs_pack_b(16LL, 70LL, in" in body and "1LL, 16LL, 0.25f, bbuf);" in body and "FS_BLAS_SGEMM(" not in body
        assert "cbuf" not in body and body.count("0.25f") == 1
    else:
        assert "FS_BLAS_SGEMM(101, 111, 112, (int)mc, 70, 16" in body and "bbuf" not in body
        assert "* 0.25f" in body  # the division by 4 became a multiplication


@pytest.mark.parametrize("m", [5, 37])
def test_attention_values_read_by_strides_are_packed_per_block(tmp_path, blas, m):
    """The context product of attention (probabilities x the values, split into heads by a Reshape
    and a Transpose of an input, the heads merged back by a Transpose): the values are packed per
    head from the input by their strides and multiplied by our micro-kernel, which stores each head
    at the output's row stride; below one full tile of rows the BLAS reads them in place."""
    nodes = [helper.make_node("Reshape", ["v", "shape"], ["v4"]), helper.make_node("Transpose", ["v4"], ["vt"], perm=[0, 2, 1, 3]),
             helper.make_node("MatMul", ["p", "vt"], ["c"]), helper.make_node("Transpose", ["c"], ["out"], perm=[0, 2, 1, 3])]
    gk = one_kernel(tmp_path, nodes, [("p", [1, 3, m, 70]), ("v", [1, 70, 48])], [("out", None)],
                    [("shape", np.int64([1, 70, 3, 16]))])
    body = gk.c_source[gk.c_source.index(f"\nvoid {gk.name}("):]
    if m >= 6:
        assert "fs_pack_b(70LL, 16LL, in" in body and "48LL, 1LL, 1.0f, bbuf);" in body and "bbuf, out0 + (" in body
        assert "FS_BLAS_SGEMM(" not in body and not gk.packed
    else:
        assert "FS_BLAS_SGEMM(101, 111, 111, (int)mc, 16, 70, 1.0f" in body and "fs_pack_b(" not in body


@pytest.mark.parametrize("case", ["batched input", "broadcast input", "batched constant", "gemm transB input"])
def test_b_read_in_place_is_packed_per_block(tmp_path, blas, case):
    """B a kernel input read in place but not a 2-D constant (an unfused graph's values or
    transposed keys, a broadcast batch, a batched constant, a Gemm's transposed B computed
    elsewhere): packed per block from the input (along K when transposed) and multiplied by our
    micro-kernel, with a bias and an activation on the tile; no BLAS call."""
    relu = helper.make_node("Relu", ["y"], ["out"])
    if case == "gemm transB input":
        nodes = [helper.make_node("Gemm", ["a", "b", "c"], ["y"], transB=1, alpha=0.5), relu]
        gk = one_kernel(tmp_path, nodes, [("a", [37, 24]), ("b", [40, 24])], [("out", None)], [("c", _w([40], 2))])
        packing = "1LL, 24LL, 1.0f, bbuf);"  # B is N x K: unit stride along K
    else:
        b_shape = {"batched input": [3, 24, 40], "broadcast input": [24, 40], "batched constant": [3, 24, 40]}[case]
        nodes = [helper.make_node("MatMul", ["a", "b"], ["y"]), relu]
        b = [("b", b_shape)] if case != "batched constant" else []
        gk = one_kernel(tmp_path, nodes, [("a", [3, 37, 24]), *b], [("out", None)],
                        [("b", _w(b_shape))] if case == "batched constant" else [])
        packing = "40LL, 1LL, 1.0f, bbuf);"
    body = gk.c_source[gk.c_source.index(f"\nvoid {gk.name}("):]
    assert "fs_pack_b(24LL, 40LL, in" in body and packing in body and ROWS in body, body
    assert "FS_BLAS_SGEMM(" not in body and not gk.packed


@pytest.mark.parametrize("perm,packed", [([0, 2, 3, 1], "bbuf[nn * 16LL + kk]"), ([0, 2, 1, 3], "bbuf[kk * 16LL + nn]")])
def test_computed_b_is_packed_along_its_source(tmp_path, blas, perm, packed):
    """Keys or values with a bias in the group (Add, Reshape into heads, Transpose): B is computed
    per batch in the order its source runs (K x N, or N x K passed transposed when the source is
    contiguous along K), then packed from there for our micro-kernel (no BLAS call: the schedule
    priced is the packed one)."""
    nodes = [helper.make_node("Add", ["k", "bias"], ["kb"]), helper.make_node("Reshape", ["kb", "shape"], ["k4"]),
             helper.make_node("Transpose", ["k4"], ["kt"], perm=perm), helper.make_node("MatMul", ["q", "kt"], ["out"])]
    q_shape = [1, 3, 70, 16] if perm[-1] == 1 else [1, 3, 16, 70]
    gk = one_kernel(tmp_path, nodes, [("q", q_shape), ("k", [1, 70, 48])], [("out", None)],
                    [("bias", _w([48], 2)), ("shape", np.int64([1, 70, 3, 16]))], expect=packed if blas == "blas" else None)
    body = gk.c_source[gk.c_source.index(f"\nvoid {gk.name}("):]
    n, k = (70, 16) if perm[-1] == 1 else (16, 70)
    assert f"fs_pack_b({k}LL, {n}LL, bbuf, " in body and ROWS in body and "FS_BLAS_SGEMM(" not in body, body


@pytest.mark.parametrize("n,alpha,path", [(11, 0.5, BLAS), (21, 0.5, ROWS), (21, 1.0, ROWS)])
@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gemm_transposed_operands(tmp_path, blas, trans_a, trans_b, n, alpha, path):
    """Gemm with either operand transposed, through the BLAS (fewer than FS_NR columns) and our
    micro-kernel (B packed once along its strides); with alpha 1 and nothing after it, the output
    is prefilled with beta * C and the product added there."""
    a_shape = [9, 13] if trans_a else [13, 9]
    b_shape = [n, 9] if trans_b else [9, n]
    nodes = [helper.make_node("Gemm", ["a", "b", "c"], ["y" if alpha != 1.0 else "out"], transA=trans_a, transB=trans_b,
                              alpha=alpha, beta=2.0)]
    if alpha != 1.0:
        nodes.append(helper.make_node("Relu", ["y"], ["out"]))
    gk = one_kernel(tmp_path, nodes, [("a", a_shape)], [("out", None)], [("b", _w(b_shape)), ("c", _w([n], 2))], expect=path)
    assert ("cbuf" not in gk.c_source) == (alpha == 1.0 and path == ROWS)


@pytest.mark.parametrize("trans_b", [0, 1])
def test_one_row_products_are_matrix_vector_calls(tmp_path, blas, trans_b):
    """A classifier head (Flatten + Gemm with one row) runs as an sgemv, B as stored."""
    nodes = [helper.make_node("Flatten", ["x"], ["f"]),
             helper.make_node("Gemm", ["f", "w", "b"], ["out"], transB=trans_b)]
    gk = one_kernel(tmp_path, nodes, [("x", [1, 24, 1, 1])], [("out", None)],
                    [("w", _w([37, 24] if trans_b else [24, 37])), ("b", _w([37], 4))])
    assert "FS_BLAS_SGEMV(101" in gk.c_source


@pytest.mark.parametrize("m,k,path", [(37, 40, ROWS), (37, 4200, BLAS), (1, 40, "FS_BLAS_SGEMV(")])
def test_a_scalar_scale_on_the_activation_folds_into_the_product(tmp_path, blas, m, k, path):
    """GELU's x 0.5 (and a Div by a constant) in front of a down-projection: the activation is read
    in place (no panel of A) and the scale is folded into the product — into the weights as they
    are packed once (our micro-kernel), or as the BLAS's alpha — and priced as no op on the host;
    with the scaled value also a kernel output, nothing folds."""
    nodes = [helper.make_node("Mul", ["x", "half"], ["xh"]), helper.make_node("Div", ["xh", "four"], ["xs"]),
             helper.make_node("MatMul", ["xs", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["z"]),
             helper.make_node("Add", ["z", "r"], ["out"])]
    inits = [("half", np.float32(0.5)), ("four", np.float32(4.0)), ("w", _w([k, 21])), ("b", _w([21], 1))]
    gk = one_kernel(tmp_path, nodes, [("x", [m, k]), ("r", [m, 21])], [("out", None)], inits,
                    expect=path if blas == "blas" else None)
    body = gk.c_source[gk.c_source.index(f"\nvoid {gk.name}("):]
    if blas == "blas":
        assert "abuf" not in body
        folded = ((gk.packed[0].scale == 0.125 and "1LL, 0.125f, pk0 + g" in gk.c_source and "*=" not in gk.c_source)
                  if path == ROWS else ", 0.125f, " in body)
        assert folded
    prep = prepare(str(tmp_path / "m.onnx"))
    host = try_lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))), host=True)
    assert host.scalar_flops == m * 21  # the residual (the bias is the canonical Gemm's C): the scale costs nothing
    side = one_kernel(tmp_path, nodes, [("x", [m, k]), ("r", [m, 21])], [("out", None), ("xs", None)], inits)
    assert not any(p.scale != 1.0 for p in side.packed) and ", 0.125f, " not in side.c_source


def test_prologue_output_also_a_kernel_output(tmp_path, blas):
    """The activation's prologue value is also used outside the group: written by the same kernel."""
    nodes = [helper.make_node("Sigmoid", ["x"], ["xs"]), helper.make_node("MatMul", ["xs", "w"], ["y"]),
             helper.make_node("Relu", ["y"], ["out"])]
    gk = one_kernel(tmp_path, nodes, [("x", [37, 24])], [("out", None), ("xs", None)], [("w", _w([24, 19]))])
    assert len(gk.outputs) == 2


CONVS = {  # name: (x shape, C_out, kernel, stride, pad, group, dilation)
    "3x3 padded": ([1, 8, 9, 7], 16, 3, 1, 1, 1, 1),
    "1x1 in place": ([2, 16, 10, 10], 32, 1, 1, 0, 1, 1),
    "1x1 in place partial tiles": ([1, 10, 7, 9], 25, 1, 1, 0, 1, 1),  # 63 pixels, 25 filters: fs_conv_1x1's edges
    "1x1 over many channels": ([1, 80, 6, 6], 24, 1, 1, 0, 1, 1),  # the BLAS
    "1x1 at 14x14": ([1, 24, 14, 14], 40, 1, 1, 0, 1, 1),  # 196 pixels: fs_conv_1x1, a prologue's panel or in place
    "strided 5x5": ([1, 3, 17, 17], 8, 5, 2, 2, 1, 1),
    "strided 3x3 odd": ([1, 16, 11, 13], 24, 3, 2, 1, 1, 1),
    "dilated grouped": ([1, 32, 9, 9], 32, 3, 1, 2, 2, 2),
    "depthwise": ([2, 8, 9, 11], 8, 3, 1, 1, 8, 1),
    "depthwise strided x2 multiplier": ([1, 8, 12, 12], 16, 3, 2, 1, 8, 1),
    "depthwise 5x5 dilated": ([1, 8, 12, 12], 8, 5, 1, 4, 8, 2),
    "depthwise strided wide rows": ([1, 4, 36, 35], 4, 3, 2, 1, 4, 1),  # row loops (17 pixels), not the flat one
    "depthwise strided 5x5 unpadded": ([1, 4, 23, 40], 4, 5, 3, 0, 4, 1),  # 3 planes, 12 pixels a row
    "1x1 to 2 channels": ([1, 32, 12, 12], 2, 1, 1, 0, 1, 1),  # a segmentation head: few outputs, many inputs
    "3x3 to 3 channels strided": ([1, 16, 11, 9], 3, 3, 2, 1, 1, 1),
}


@pytest.mark.parametrize("prologue", [True, False], ids=["prologue", "input-as-is"])
@pytest.mark.parametrize("name", sorted(CONVS))
def test_conv_prologue_bias_residual(tmp_path, blas, name, prologue):
    """With a prologue the band (k x k) or im2col panel (1 x 1) is filled through the expression
    emitter; without one, by row copies between the zero borders."""
    xs, cout, k, stride, pad, group, dil = CONVS[name]
    ho = (xs[2] + 2 * pad - dil * (k - 1) - 1) // stride + 1
    wo = (xs[3] + 2 * pad - dil * (k - 1) - 1) // stride + 1
    nodes = [helper.make_node("Relu" if prologue else "Identity", ["x"], ["xr"]),
             helper.make_node("Conv", ["xr", "w", "b"], ["y"], kernel_shape=[k, k], strides=[stride] * 2,
                              pads=[pad] * 4, group=group, dilations=[dil] * 2),
             helper.make_node("Add", ["y", "r"], ["ya"]), helper.make_node("Relu", ["ya"], ["out"])]
    gk = one_kernel(tmp_path, nodes, [("x", xs), ("r", [xs[0], cout, ho, wo])], [("out", None)],
                    [("w", _w([cout, xs[1] // group, k, k])), ("b", _w([cout], 3))])
    if group == xs[1]:  # the depthwise loop: bounds-free over zero-bordered planes, flat where rows are short
        body = _body(gk)
        assert "nc = 0; nc <" in body and "FS_SIMD_SUM" not in body and " >= 0 && " not in body
        assert ("cbuf[p] = " in body) == (stride == 1 or wo < 16)
    elif k > 1:  # taps packed from the zero-bordered band, each input element computed once
        body = _body(gk)
        assert "fs_conv_band(" in body and "FS_BLAS_SGEMM(101" not in body and body.count("float* dst = patch") == 1
    else:  # a 1x1 over many pixels, or over few input channels read in place: its pixels packed, our
        # micro-kernel over the filters; else implicit GEMM through the BLAS
        rows = stride == 1 and schedule.rows_1x1(cout, xs[1], ho * wo, not prologue)
        body = _body(gk)
        assert ("fs_conv_1x1(" in body) == rows and ("FS_BLAS_SGEMM(101" in body) != rows


def test_conv_1x1_reads_its_input_in_place(tmp_path):
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[1, 1])]
    gk = one_kernel(tmp_path, nodes, [("x", [1, 16, 6, 6])], [("y", None)], [("w", _w([32, 16, 1, 1]))])
    assert "patch" not in gk.c_source


def test_pow_and_scalar_constants_fold_into_the_source(tmp_path):
    nodes = [helper.make_node("Pow", ["x", "two"], ["p"]), helper.make_node("Pow", ["p", "half"], ["q"]),
             helper.make_node("Mul", ["q", "s"], ["out"])]
    gk = one_kernel(tmp_path, nodes, [("x", [4, 33])], [("out", None)],
                    [("two", np.float32(2.0)), ("half", np.float32(0.5)), ("s", np.float32(3.0))])
    assert "powf" not in gk.c_source and "3.0f" in gk.c_source


def test_vector_math_is_linked_and_accurate(tmp_path):
    """glibc's vector exp/log/tanh/erf under `omp simd`, within 1e-6 relative (or 1e-7 absolute)
    of float64 math over a wide range."""
    flags = cpu.vector_math_flags()
    if not flags:
        pytest.skip("this C library has no vector math (libmvec); kernels use scalar libm")
    src = tmp_path / "vm.c"
    src.write_text("#include <math.h>\n#pragma omp declare simd notinbranch\nfloat expf(float);\n"
                   "#pragma omp declare simd notinbranch\nfloat tanhf(float);\n"
                   "#pragma omp declare simd notinbranch\nfloat erff(float);\n"
                   "#pragma omp declare simd notinbranch\nfloat logf(float);\n"
                   "void f(const float* x, float* e, float* t, float* r, float* l, long long n) {\n"
                   "#pragma omp simd\nfor (long long i = 0; i < n; ++i) { e[i] = expf(x[i]); t[i] = tanhf(x[i]);"
                   " r[i] = erff(x[i]); l[i] = logf(fabsf(x[i]) + 1e-3f); }\n}\n")
    lib = tmp_path / "vm.so"
    cmd = [cpu.compiler(), *cpu.CFLAGS[:-1], str(src), "-o", str(lib), *flags, cpu.CFLAGS[-1]]
    subprocess.run(cmd, check=True, capture_output=True)
    asm = subprocess.run([cpu.compiler(), *cpu.CFLAGS[:2], "-fopenmp", "-fno-math-errno", "-S", str(src), "-o", "-"],
                         check=True, capture_output=True, text=True).stdout
    assert "_ZGV" in asm, "the loop did not call the vector variants"
    x = np.linspace(-20, 20, 100_003, dtype=np.float32)
    outs = [np.empty_like(x) for _ in range(4)]
    fn = ctypes.CDLL(str(lib)).f
    fn(*[a.ctypes.data_as(ctypes.c_void_p) for a in (x, *outs)], ctypes.c_longlong(x.size))
    from math import erf

    x64 = x.astype(np.float64)
    refs = [np.exp(x64), np.tanh(x64), np.vectorize(erf)(x64), np.log(np.abs(x64) + np.float64(np.float32(1e-3)))]
    for got, ref in zip(outs, refs, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


def test_attention_scores_under_a_softmax(tmp_path, blas):
    """Q x K^T (the keys transposed in the group), scaled, masked, under a Softmax: a row kernel
    whose product goes through the GEMM blocks first, the keys packed per head by their strides
    for our micro-kernel, which needs no BLAS: the same path with and without one."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Div", ["s", "c"], ["d"]),
             helper.make_node("Add", ["d", "mask"], ["a"]), helper.make_node("Softmax", ["a"], ["out"], axis=-1)]
    gk = one_kernel(tmp_path, nodes, [("q", [1, 2, 67, 16]), ("k", [1, 2, 67, 16]), ("mask", [1, 1, 1, 67])],
                    [("out", None)], [("c", np.float32(4.0))], expect="ybuf")
    assert gk.rows == 2 * 67
    body = gk.c_source[gk.c_source.index(f"\nvoid {gk.name}("):]
    assert "1LL, 16LL, 0.25f, bbuf);" in body and "fs_gemm_rows(" in body and "FS_BLAS_SGEMM" not in body


@pytest.mark.parametrize("m", [6, 70])
def test_a_softmax_over_constant_weights_reads_them_packed_once(tmp_path, blas, m):
    """A classifier head (MatMul by constant weights, bias, Softmax): the row kernel's product runs
    on our micro-kernel over the weights packed once (the kernel's `_pack`), with or without a BLAS,
    from one full tile of rows (6) and with a last partial one (70: `fs_micro_tail`)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["z"]),
             helper.make_node("Softmax", ["z"], ["out"], axis=-1)]
    gk = one_kernel(tmp_path, nodes, [("x", [m, 40])], [("out", None)], [("w", _w([40, 37])), ("b", _w([37], 1))],
                    expect="ybuf")
    assert gk.rows == m and [p.arg.tensor for p in gk.packed] == ["w"]
    body = gk.c_source[gk.c_source.index(f"\nvoid {gk.name}("):]
    assert "fs_gemm_rows(" in body and "FS_BLAS_SGEMM" not in body and f"void {gk.name}_pack(" in gk.c_source
    # planned for a CPU the group is priced as `packed`, and that schedule writes the same product
    prep = prepare(str(tmp_path / "m.onnx"))
    host = try_lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))), host=True)
    assert host.schedule.skeleton == "packed"
    hk = generate(prep.graph, host, gk.name)
    assert [p.arg.tensor for p in hk.packed] == ["w"] and hk.cuda_source == ""
    assert "fs_gemm_rows(" in hk.c_source and "FS_BLAS_SGEMM(" not in hk.c_source[hk.c_source.index(f"\nvoid {gk.name}("):]


@pytest.mark.parametrize("m", [3, 67])
def test_queries_split_into_heads_are_read_in_place_by_their_strides(tmp_path, blas, m):
    """Attention's queries as the projection left them (sequence x heads·dims, split into heads by
    a Reshape and a Transpose in the group): A is read in place, its row stride the projection's
    width, with no panel of A — by our micro-kernel from one full tile, else by the BLAS."""
    nodes = [helper.make_node("Reshape", ["q", "shape"], ["q4"]), helper.make_node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["qh", "kt"], ["s"]), helper.make_node("Div", ["s", "c"], ["d"]),
             helper.make_node("Softmax", ["d"], ["out"], axis=-1)]
    gk = one_kernel(tmp_path, nodes, [("q", [1, m, 32]), ("k", [1, 2, 19, 16])], [("out", None)],
                    [("c", np.float32(4.0)), ("shape", np.int64([1, m, 2, 16]))])
    body = gk.c_source[gk.c_source.index(f"\nvoid {gk.name}("):]
    if blas == "blas":
        q = next(a.name for a in gk.inputs if a.tensor == "q")
        assert "abuf" not in body and f"{q} + ((z) * 16LL + 0LL + m0 * 32LL)" in body
        assert ("fs_gemm_rows(" in body) == (m >= 6) and ("m0 * 32LL), 32" in body)


def _gelu_nodes(bias: bool, residual: bool = False):
    """MatMul (+ bias row) then GELU written out as ONNX exports it (x / sqrt 2, Erf, + 1, x *, x 0.5)
    (+ a residual read per element)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y0"])]
    nodes += [helper.make_node("Add", ["y0", "b"], ["y"])] if bias else [helper.make_node("Identity", ["y0"], ["y"])]
    nodes += [helper.make_node("Div", ["y", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
              helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["y", "e1"], ["g"]),
              helper.make_node("Mul", ["g", "half"], ["out" if not residual else "g2"])]
    return nodes + ([helper.make_node("Add", ["g2", "r"], ["out"])] if residual else [])


def _without_tile_epilogue(gk):
    """The same kernel with its block epilogue (the source without FS_TILE_EPI)."""
    source = gk.c_source.replace("#define FS_TILE_EPI 1\n", "")
    assert source != gk.c_source
    return gk.with_c_source(source)


@pytest.mark.parametrize("m,n,bias", [(70, 64, True), (13, 40, True), (128, 96, False), (5, 32, True)])
def test_a_gelu_epilogue_runs_on_the_registers(tmp_path, m, n, bias):
    """A MatMul by constant weights with its bias row and GELU: with AVX-512 the micro-kernel adds
    the bias and applies the GELU to each tile in its registers before the one store
    (`fs_gemm_rows_epi`, the tile epilogue `fs_tile_epi`; a partial tile of N % 32 columns or
    M % 12 rows through `fs_tile_epi1`), with no product block and no second pass; elsewhere the
    block epilogue. Both equal ONNX Runtime and each other bit for bit (the same operations in the
    same order), M and N off the tile included (5 rows: under one FS_MR tile, the BLAS's)."""
    inits = [("w", _w([48, n])), ("sqrt2", np.float32(1.4142135)), ("one", np.float32(1.0)), ("half", np.float32(0.5))]
    inits += [("b", _w([n], 1))] if bias else []
    gk = one_kernel(tmp_path, _gelu_nodes(bias), [("x", [m, 48])], [("out", None)], inits)
    body = gk.c_source[gk.c_source.index(f"\nvoid {gk.name}("):]
    if m < 6:  # below one full tile the product goes to the BLAS or the row loops: no tile epilogue
        assert "fs_gemm_rows_epi(" not in body and "FS_TILE_EPI" not in gk.c_source
        return
    b = next((a.name for a in gk.inputs if a.tensor == "b"), "0")
    assert "fs_gemm_rows_epi(" in body and f", {n}LL, {b});" in body
    assert "static inline __m512 fs_tile_epi(" in gk.c_units[0]  # the tile kernels' unit, with the epilogue
    prep = prepare(str(tmp_path / "m.onnx"))
    values = all_values(to_proto(prep.canonical), random_feeds(to_proto(prep.canonical), 0))
    feeds = {a.tensor: values[a.tensor] for a in gk.inputs}
    tiles, block = cpu.run(gk, feeds)["out"], cpu.run(_without_tile_epilogue(gk), feeds)["out"]
    np.testing.assert_array_equal(tiles, block)
    # planned for a CPU the group is priced `packed` (outputs written once, no block round trip), and
    # that schedule writes the tile epilogue
    host = try_lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))), host=AVX512)
    assert host.schedule.skeleton == "packed" and host.schedule.epilogue == "tile"
    assert host.write_bytes == m * n * 4 and "fs_gemm_rows_epi(" in generate(prep.graph, host, gk.name).c_source


@pytest.mark.parametrize("epilogue", ["residual", "tanh"])
def test_an_epilogue_that_is_not_a_function_of_the_tile_keeps_its_block(tmp_path, epilogue):
    """A tile epilogue is a function of the product plus a bias row alone, over constants, the four
    operators and erf: a residual read per element, or Tanh (libmvec's), keeps the block epilogue."""
    if epilogue == "residual":
        nodes = _gelu_nodes(True, residual=True)
        inputs = [("x", [30, 48]), ("r", [30, 64])]
    else:
        nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["z"]),
                 helper.make_node("Tanh", ["z"], ["out"])]
        inputs = [("x", [30, 48])]
    inits = [("w", _w([48, 64])), ("b", _w([64], 1)), ("sqrt2", np.float32(1.4142135)), ("one", np.float32(1.0)),
             ("half", np.float32(0.5))]
    gk = one_kernel(tmp_path, nodes, inputs, [("out", None)], inits if epilogue == "residual" else inits[:2])
    body = gk.c_source[gk.c_source.index(f"\nvoid {gk.name}("):]
    assert "fs_gemm_rows(" in body and "fs_gemm_rows_epi(" not in body and "#define FS_TILE_EPI" not in gk.c_source


def test_a_wide_product_goes_through_the_blas(tmp_path, blas):
    """An LM head's N (here 20000) is past what the row loops keep on the stack: the BLAS blocks
    with it, the generic loops without."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["out"])]
    one_kernel(tmp_path, nodes, [("x", [1, 3, 8])], [("out", None)], [("w", _w([8, 20000])), ("b", _w([20000], 5))],
               expect="FS_BLAS_SGEMM(101")


@pytest.mark.parametrize("epilogue", ["patch-embedding", "concat"])
def test_conv_whose_epilogue_moves_elements(tmp_path, blas, epilogue):
    """A ViT patch embedding (Conv, Reshape, Transpose) and a YOLO block (Conv, SiLU, Concat): the
    conv's output into a buffer through the conv loops first, then the outputs read it."""
    if epilogue == "patch-embedding":
        nodes = [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[4, 4], strides=[4, 4]),
                 helper.make_node("Reshape", ["y", "shape"], ["r"]),
                 helper.make_node("Transpose", ["r"], ["out"], perm=[0, 2, 1])]
        inputs, inits = [("x", [1, 3, 16, 16])], [("w", _w([24, 3, 4, 4])), ("shape", np.array([1, 24, 16]))]
    else:
        nodes = [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1] * 4),
                 helper.make_node("Sigmoid", ["y"], ["s"]), helper.make_node("Mul", ["y", "s"], ["m"]),
                 helper.make_node("Concat", ["m", "skip"], ["out"], axis=1)]
        inputs, inits = [("x", [1, 8, 10, 10]), ("skip", [1, 5, 10, 10])], [("w", _w([16, 8, 3, 3]))]
    gk = one_kernel(tmp_path, nodes, inputs, [("out", None)], inits, expect="ybuf")
    assert "fs_conv_band(" in _body(gk)  # a k x k window: taps packed from the band


def test_a_packed_schedule_is_c_only_and_the_cuda_side_refuses_it_by_name(tmp_path):
    """Priced for the host, a fused MatMul+Relu is `packed`: its C runs, it has no CUDA source,
    and the CUDA module builder (the emulator's and CuPy's) names the kernel and what to do."""
    from costmodels import RooflineModel, host_cpu
    from fusesearch.backends.codegen import cuda_module
    from fusesearch.costing import priced_kernel

    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["out"])]
    prep = prepare(save(make_model(nodes, [("x", [5, 8])], [("out", None)], [("w", _w([8, 3]))]), tmp_path / "m.onnx"))
    kernel, _ = priced_kernel(prep.graph, lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph))))),
                              host_cpu(), RooflineModel())
    gk = generate(prep.graph, kernel, "k_host")
    assert kernel.schedule.skeleton == gk.skeleton == "packed" and gk.cuda_source == "" and "FS_BLAS_SGEMM" in gk.c_source
    with pytest.raises(ValueError, match="k_host: its schedule \\(packed\\) is the CPU's"):
        cuda_module([gk])


def test_scratch_arena_is_reused_across_calls_and_sizes(tmp_path, blas):
    """Panels and tiles come from a per-thread arena kept between calls (no malloc per call): a
    conv kernel runs again on new inputs, and a larger one after it; every result equals ONNX
    Runtime's (a stale value left in a reused panel would show)."""
    conv = [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["y"], ["out"])]
    for h in (9, 23):  # the second kernel's panels are larger than the first's
        prep = prepare(save(make_model(conv, [("x", [1, 5, h, 11])], [("out", None)], [("w", _w([12, 5, 3, 3]))]),
                            tmp_path / f"c{h}.onnx"))
        canonical = to_proto(prep.canonical)
        gk = generate(prep.graph, lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph))))))
        assert "malloc(" not in gk.c_source and "fs_scratch(" in gk.c_source
        for seed in (0, 1, 2):  # the same loaded library each time: its arena is reused
            values = all_values(canonical, random_feeds(canonical, seed))
            out = cpu.run(gk, {a.tensor: values[a.tensor] for a in gk.inputs})["out"]
            np.testing.assert_allclose(out, values["out"], rtol=0, atol=1e-4 * max(1.0, np.abs(values["out"]).max()))


@pytest.mark.parametrize("kernel,stride,pad,group", [(1, 1, 0, 1), (3, 2, 1, 1), (3, 1, 1, 3), (3, 1, 2, 2)])
def test_conv_over_a_channel_concat_computes_each_piece_in_its_own_loop(tmp_path, blas, kernel, stride, pad, group):
    """A C2f/U-Net-style conv input: SiLU(a) + b and SiLU(c) concatenated along the channels (5 + 7,
    so the pieces straddle the conv's groups), through a per-channel scale, into a conv with a
    SiLU epilogue; the band (k x k) or the im2col panel (1 x 1) fills one loop per piece (no
    branch per element) and zeros the padding outside the interior."""
    nodes = [helper.make_node("Sigmoid", ["a"], ["sa"]), helper.make_node("Mul", ["a", "sa"], ["ya"]),
             helper.make_node("Add", ["ya", "b"], ["pa"]), helper.make_node("Sigmoid", ["c"], ["sc"]),
             helper.make_node("Mul", ["c", "sc"], ["pc"]), helper.make_node("Concat", ["pa", "pc"], ["cat"], axis=1),
             helper.make_node("Mul", ["cat", "scale"], ["x"]),
             helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[kernel] * 2, strides=[stride] * 2,
                              pads=[pad] * 4, group=group),
             helper.make_node("Sigmoid", ["y"], ["sy"]), helper.make_node("Mul", ["y", "sy"], ["out"])]
    gk = one_kernel(tmp_path, nodes, [("a", [1, 5, 13, 11]), ("b", [1, 5, 13, 11]), ("c", [1, 7, 13, 11])],
                    [("out", None)], [("scale", _w([1, 12, 1, 1], 3)), ("w", _w([12, 12 // group, kernel, kernel]))])
    if kernel > 1:
        assert gk.c_source.count("float* dst = patch + (ci * bh + r) * bw;") == 2
    elif blas == "blas":
        assert gk.c_source.count("for (long long kq = klo; kq < khi; ++kq)") == 2


@pytest.mark.parametrize("perm,shape", [([0, 2, 1, 3], [1, 70, 60]), ([0, 1, 2, 3], [1, 3, 1400])])
def test_a_product_moved_by_views_is_stored_at_its_strides(tmp_path, blas, perm, shape):
    """Attention's context product merged into heads (Transpose + Reshape): each head's tile is
    stored at the output's row stride (ldc = heads x N) by our micro-kernel over the values packed
    per block, no buffer and no copy pass."""
    nodes = [helper.make_node("MatMul", ["p", "v"], ["y"]), helper.make_node("Transpose", ["y"], ["yt"], perm=perm),
             helper.make_node("Reshape", ["yt", "shape"], ["out"])]
    gk = one_kernel(tmp_path, nodes, [("p", [1, 3, 70, 16]), ("v", [1, 3, 16, 20])], [("out", None)],
                    [("shape", np.int64(shape))])
    if blas == "blas":
        blas_part = _body(gk).split("#else")[0]
        assert "ybuf" not in blas_part and "fs_gemm_rows(" in blas_part
        assert f", {60 if perm[1] == 2 else 20}LL, 0, 0LL, 0);" in blas_part  # C's pointer and row stride


def test_scores_read_the_mask_their_kernel_wrote_once(tmp_path, blas):
    """Attention scores with an int64 mask turned into an additive float mask that is also an
    output: the side loop writes the mask once, and the Softmax rows over the BLAS product read it
    back instead of casting and scaling it again per score element."""
    nodes = [helper.make_node("Cast", ["mask"], ["mf"], to=1), helper.make_node("Sub", ["one", "mf"], ["inv"]),
             helper.make_node("Mul", ["inv", "big"], ["ext"]), helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Div", ["s", "scale"], ["sd"]),
             helper.make_node("Add", ["sd", "ext"], ["sm"]), helper.make_node("Softmax", ["sm"], ["out"], axis=-1)]
    from onnx import TensorProto

    model = make_model(nodes, [("q", [1, 2, 37, 16]), ("k", [1, 2, 37, 16])], [("out", None), ("ext", None)],
                       [("one", np.float32(1.0)), ("big", np.float32(-10000.0)), ("scale", np.float32(4.0))])
    model.graph.input.append(helper.make_tensor_value_info("mask", TensorProto.INT64, [1, 1, 1, 37]))
    prep = prepare(save(model, tmp_path / "m.onnx"))
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    gk = generate(prep.graph, lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph))))))
    out = cpu.run(gk, {a.tensor: values[a.tensor] for a in gk.inputs})
    for name in ("out", "ext"):
        np.testing.assert_allclose(out[name], values[name], rtol=0, atol=1e-4 * max(1.0, np.abs(values[name]).max()))
    if blas == "blas":
        body = _body(gk)
        rows = body[body.index("for (long long rp = 0;"):].split("#else")[0]  # the BLAS path's rows (in pairs)
        assert "out0[j]" in rows and "(float)(" not in rows  # the rows read the mask back, cast nowhere per element


PACKED_CONVS = {  # name: (x shape, C_out, kernel, stride, pad, group, dilation)
    "3x3 padded, partial tiles": ([1, 8, 5, 5], 30, 3, 1, 1, 1, 1),  # 25 pixels (M % 6), 30 filters (N % 16)
    "long K, many pixels": ([1, 40, 10, 10], 112, 3, 1, 1, 1, 1),  # K = 360, 100 pixels (17 row panels)
    "1x1 read in place": ([2, 24, 4, 4], 40, 1, 1, 0, 1, 1),  # under twice as many filters as taps: not rows_1x1
    "strided dilated grouped": ([1, 16, 9, 9], 64, 3, 2, 2, 2, 2),
}


@pytest.mark.parametrize("name", sorted(PACKED_CONVS))
def test_conv_with_its_filters_packed_once(tmp_path, blas, name):
    """Filters packed once by the kernel's `_pack` function (the "packed" product, chosen here so the
    cases stay small; a k x k conv's default, its band, packs them too) and multiplied by our own
    micro-kernel, product transposed: equal to ONNX Runtime at partial tiles, a long K over many
    pixels, a 1x1 input read in place, groups, strides and dilations, with a prologue and a residual
    epilogue; with or without a BLAS (it needs none)."""
    xs, cout, k, stride, pad, group, dil = PACKED_CONVS[name]
    ho = (xs[2] + 2 * pad - dil * (k - 1) - 1) // stride + 1
    wo = (xs[3] + 2 * pad - dil * (k - 1) - 1) // stride + 1
    prologue = "Identity" if k == 1 else "Relu"
    nodes = [helper.make_node(prologue, ["x"], ["xr"]),
             helper.make_node("Conv", ["xr", "w", "b"], ["y"], kernel_shape=[k, k], strides=[stride] * 2,
                              pads=[pad] * 4, group=group, dilations=[dil] * 2),
             helper.make_node("Add", ["y", "r"], ["out"])]
    gk = one_kernel(tmp_path, nodes, [("x", xs), ("r", [xs[0], cout, ho, wo])], [("out", None)],
                    [("w", _w([cout, xs[1] // group, k, k])), ("b", _w([cout], 3))],
                    expect="fs_conv_band(" if k > 1 else "fs_gemm_packed(", product="band" if k > 1 else "packed")
    (packed,) = gk.packed
    assert packed.arg.tensor == "w" and packed.groups == group and "FS_BLAS_SGEMM(101" not in gk.c_source
    assert packed.arg.size == group * -(-(cout // group) // 16) * 16 * (xs[1] // group) * k * k


BAND_CONVS = {  # name: (x shape, C_out, kernel, stride): every k x k conv runs `fs_conv_band`
    "rows of 26": ([1, 8, 26, 26], 20, 3, 1),  # AVX-512: 9 + 9 + 8 pixels a row; else 6-pixel panels across rows
    "rows of 7": ([1, 16, 7, 7], 40, 3, 1),  # a row one panel; 40 filters: a pair, then one panel
    "stride 2: every other pixel": ([1, 8, 30, 30], 24, 3, 2),  # broadcasts 2 apart; else the even floats
    "many taps": ([1, 256, 14, 14], 48, 3, 1),  # 2304 taps: 12 blocks of 192; else chunks of pixels
}


@pytest.mark.parametrize("name", sorted(BAND_CONVS))
def test_band_conv_reads_its_taps_from_the_band(tmp_path, name):
    """A k x k conv's taps come from its zero-bordered band: with AVX-512 read in place by the
    micro-kernel (panels within each output row, the taps in blocks), elsewhere packed into panels
    of a tile's rows in chunks within half the L2: equal to ONNX Runtime over narrow and wide rows,
    stride 2, one and two filter panels and many taps, with a bias and a ReLU."""
    xs, cout, k, stride = BAND_CONVS[name]
    ho = (xs[2] + 2 * (k // 2) - k) // stride + 1
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[k, k], strides=[stride] * 2,
                              pads=[k // 2] * 4),
             helper.make_node("Relu", ["y"], ["out"])]
    one_kernel(tmp_path, nodes, [("x", xs)], [("out", [xs[0], cout, ho, ho])],
               [("w", _w([cout, xs[1], k, k])), ("b", _w([cout], 3))], expect="fs_conv_band(")


def test_packed_filters_are_packed_once_per_runner_not_per_call(tmp_path):
    """The runner packs the weights when it is made: a call reads the packed copy, so changing the
    weight's buffer afterwards changes nothing (it is a constant), while a new runner sees it."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Relu", ["y"], ["out"])]
    gk = one_kernel(tmp_path, nodes, [("x", [1, 4, 3, 3])], [("out", None)], [("w", _w([20, 4, 3, 3]))])
    assert gk.packed
    inputs = {"x": _w([1, 4, 3, 3], 1), "w": _w([20, 4, 3, 3])}
    go = cpu.runner(gk, inputs)
    go()
    first = go.buffers[-1].copy()
    go.buffers[1][...] = 0.0  # the weight, after packing
    go()
    np.testing.assert_array_equal(go.buffers[-1], first)
    again = cpu.runner(gk, {"x": inputs["x"], "w": np.zeros_like(inputs["w"])})
    again()
    assert not again.buffers[-1].any()


def test_large_filters_are_packed_and_small_ones_go_to_the_blas(tmp_path):
    """At the default thresholds: resnet50's last-stage 1x1 conv (2048 filters of 512 taps, 49
    pixels) packs its filters, and so does mobilenetv2's 160 -> 96 at 7x7 (many taps, few
    pixels); a 1x1 conv over 64 taps at 56x56 and one over 192 taps at 28x28 run `fs_conv_1x1`
    (at least ROWS_1X1_MIN_PIXELS pixels), one over 64 taps to 64 filters at 10x10 calls the BLAS;
    every 3x3 conv packs them (its taps come from the band), large or small."""
    def conv(xs, ws, k):
        nodes = [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[k, k], pads=[k // 2] * 4),
                 helper.make_node("Relu", ["y"], ["out"])]
        prep = prepare(save(make_model(nodes, [("x", xs)], [("out", None)], [("w", _w(ws))]), tmp_path / "m.onnx"))
        return generate(prep.graph, lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph))))))

    gk = conv([1, 512, 7, 7], [2048, 512, 1, 1], 1)
    assert gk.packed and "fs_gemm_packed(" in _body(gk)
    gk = conv([1, 64, 56, 56], [64, 64, 1, 1], 1)
    assert not gk.packed and "fs_conv_1x1(" in _body(gk) and "FS_BLAS_SGEMM(101" not in _body(gk)
    gk = conv([1, 64, 10, 10], [64, 64, 1, 1], 1)
    assert not gk.packed and "FS_BLAS_SGEMM(101" in _body(gk)
    # many taps over few pixels: packed however few the filters (PACK_MIN_TAPS, PACK_MAX_PIXELS)
    gk = conv([1, 160, 7, 7], [96, 160, 1, 1], 1)
    assert gk.packed and "fs_gemm_packed(" in _body(gk)
    gk = conv([1, 192, 28, 28], [32, 192, 1, 1], 1)
    assert not gk.packed and "fs_conv_1x1(" in _body(gk) and "FS_BLAS_SGEMM(101" not in _body(gk)
    for xs, ws in (([1, 512, 7, 7], [512, 512, 3, 3]), ([1, 64, 56, 56], [64, 64, 3, 3])):
        gk = conv(xs, ws, 3)
        assert gk.packed and "fs_conv_band(" in _body(gk) and "FS_BLAS_SGEMM(101" not in _body(gk)


def test_a_small_packed_1x1_conv_with_clip_and_residual(tmp_path, blas):
    """A 1x1 conv over 160 taps at 7x7 to 40 filters (packed: PACK_MIN_TAPS), Clip, plus a
    residual: equal to ONNX Runtime with and without a BLAS."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[1, 1]),
             helper.make_node("Clip", ["y", "lo", "hi"], ["c"]), helper.make_node("Add", ["c", "r"], ["out"])]
    inits = [("w", _w([40, 160, 1, 1])), ("lo", np.array(0.0, np.float32)), ("hi", np.array(6.0, np.float32))]
    gk = one_kernel(tmp_path, nodes, [("x", [1, 160, 7, 7]), ("r", [1, 40, 7, 7])], [("out", None)], inits,
                    expect="fs_gemm_packed(")
    assert gk.packed


@pytest.mark.parametrize("epilogue,additive", [("bias", True), ("residual", True), ("bias+residual", True), ("residual first", True),
                                               ("plus its own relu", False), ("bias then relu", False)])
def test_a_product_plus_terms_without_it_is_prefilled_and_added_by_the_blas(tmp_path, blas, epilogue, additive):
    """MatMul + Add(s) whose other operands do not read the product: the output block is filled
    with them first and the BLAS adds the product (beta 1), no tile kept, or, through our
    micro-kernel, a bias and a residual are read in place and added at the store; an epilogue
    that reads the product twice or applies anything after the adds keeps the tile and its second
    pass."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    if epilogue == "bias":
        nodes.append(helper.make_node("Add", ["y", "bias"], ["out"]))
    elif epilogue == "residual":
        nodes.append(helper.make_node("Add", ["r", "y"], ["out"]))
    elif epilogue == "bias+residual":
        nodes += [helper.make_node("Add", ["y", "bias"], ["yb"]), helper.make_node("Add", ["yb", "r"], ["out"])]
    elif epilogue == "residual first":
        nodes += [helper.make_node("Add", ["r", "y"], ["yr"]), helper.make_node("Add", ["bias", "yr"], ["out"])]
    elif epilogue == "plus its own relu":
        nodes += [helper.make_node("Relu", ["y"], ["ry"]), helper.make_node("Add", ["y", "ry"], ["out"])]
    else:
        nodes += [helper.make_node("Add", ["y", "bias"], ["yb"]), helper.make_node("Relu", ["yb"], ["out"])]
    gk = one_kernel(tmp_path, nodes, [("x", [2, 37, 24]), ("r", [2, 37, 40])], [("out", None)],
                    [("w", _w([24, 40])), ("bias", _w([40], 1))])
    if additive:  # fs_gemm_rows's C0 (the residual) and R0 (the bias row), read in place
        named = {a.tensor: a.name for a in gk.inputs}
        c0 = f"{named['r']} + (z * 1480LL + m0 * 40LL), 40LL" if "residual" in epilogue else "0, 0LL"
        r0 = named["bias"] if epilogue != "residual" else "0"
        assert f", out0 + ((z) * 1480LL + m0 * 40LL), 40LL, {c0}, {r0});" in gk.c_source
    assert ("cbuf" not in gk.c_source) == additive


@pytest.mark.parametrize("kernel", [1, 3])
def test_a_conv_reads_back_its_input_when_the_kernel_writes_it_as_an_output(tmp_path, blas, kernel):
    """A Concat that is also a kernel output (another kernel reads it) is written once by the
    kernel's own loop and the conv reads it back from there (a 1x1 conv in place, a 3x3 into its
    band), rather than computing every piece again per tap."""
    nodes = [helper.make_node("Resize", ["a", "", "scales"], ["up"], mode="nearest"),
             helper.make_node("Concat", ["up", "b"], ["cat"], axis=1),
             helper.make_node("Conv", ["cat", "w"], ["y"], kernel_shape=[kernel] * 2, pads=[kernel // 2] * 4),
             helper.make_node("Sigmoid", ["y"], ["s"]), helper.make_node("Mul", ["y", "s"], ["out"])]
    gk = one_kernel(tmp_path, nodes, [("a", [1, 8, 5, 5]), ("b", [1, 8, 10, 10])], [("out", None), ("cat", None)],
                    [("scales", np.float32([1, 1, 2, 2])), ("w", _w([16, 16, kernel, kernel]))])
    if blas == "blas":
        cat = next(a.name for a in gk.outputs if a.tensor == "cat")
        body = gk.c_source[gk.c_source.index(f"\nvoid {gk.name}("):].split("\n#else")[0]  # the BLAS path
        blocks = body[body.index("for (long long blk"):]
        assert (f"{cat} + nb *" in blocks) if kernel == 1 else (f"= {cat}[((nb *" in blocks)
        assert "ceilf" not in blocks and "floorf" not in blocks  # no Resize index math in the conv's blocks


# the AVX-512 micro-kernel's six intrinsics as plain C over 16 floats, counting its calls: its
# branch of `fs_micro` then compiles and runs on any CPU, checking its indexing (two accumulator
# sets over even and odd k, the odd-K tail, the six row stores)
_AVX512_STAND_IN = """#define __AVX512F__ 1
typedef struct { float v[16]; } fs_v16;
#define __m512 fs_v16
long long fs_stand_in_calls = 0;
static inline fs_v16 _mm512_setzero_ps(void) { fs_v16 r; ++fs_stand_in_calls; for (int i = 0; i < 16; ++i) r.v[i] = 0.0f; return r; }
static inline fs_v16 _mm512_loadu_ps(const float* p) { fs_v16 r; for (int i = 0; i < 16; ++i) r.v[i] = p[i]; return r; }
static inline fs_v16 _mm512_set1_ps(float x) { fs_v16 r; for (int i = 0; i < 16; ++i) r.v[i] = x; return r; }
static inline fs_v16 _mm512_fmadd_ps(fs_v16 a, fs_v16 b, fs_v16 c) { for (int i = 0; i < 16; ++i) c.v[i] += a.v[i] * b.v[i]; return c; }
static inline fs_v16 _mm512_add_ps(fs_v16 a, fs_v16 b) { for (int i = 0; i < 16; ++i) a.v[i] += b.v[i]; return a; }
static inline void _mm512_storeu_ps(float* p, fs_v16 a) { for (int i = 0; i < 16; ++i) p[i] = a.v[i]; }
typedef struct { int v[16]; } fs_i16;
#define __m512i fs_i16
typedef unsigned short __mmask16;
static inline fs_i16 _mm512_setr_epi32(int a0, int a1, int a2, int a3, int a4, int a5, int a6, int a7, int a8, int a9,
                                       int a10, int a11, int a12, int a13, int a14, int a15) {
    fs_i16 r = {{a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15}}; return r; }
static inline fs_v16 _mm512_permutex2var_ps(fs_v16 a, fs_i16 idx, fs_v16 b) {
    fs_v16 r; for (int i = 0; i < 16; ++i) r.v[i] = idx.v[i] & 16 ? b.v[idx.v[i] & 15] : a.v[idx.v[i] & 15]; return r; }
static inline fs_v16 _mm512_maskz_loadu_ps(__mmask16 m, const float* p) {
    fs_v16 r; for (int i = 0; i < 16; ++i) r.v[i] = m >> i & 1 ? p[i] : 0.0f; return r; }
static inline void _mm512_mask_storeu_ps(float* p, __mmask16 m, fs_v16 a) { for (int i = 0; i < 16; ++i) if (m >> i & 1) p[i] = a.v[i]; }
static inline void _mm512_stream_ps(float* p, fs_v16 a) { _mm512_storeu_ps(p, a); }
static inline void _mm_sfence(void) {}
"""


def _shared_library(tmp_path, sources: list[str], flags: list[str], stand_in: bool) -> ctypes.CDLL:
    """`sources` (translation units: the runtime's, a kernel's) compiled with `flags` into one shared
    library, as a kernel and the runtime it links are; `stand_in`: each with the AVX-512 intrinsics
    replaced by plain C (`_AVX512_STAND_IN`, its call counter defined in the first) and compiled
    unoptimized (its loops over structs take gcc -O2 about 10 s a unit to unroll)."""
    if stand_in:
        flags = [f for f in flags if not f.startswith("-O")] + ["-O0"]
    paths = []
    for i, source in enumerate(sources):
        if stand_in:
            head = _AVX512_STAND_IN if i == 0 else _AVX512_STAND_IN.replace("long long fs_stand_in_calls = 0;",
                                                                            "extern long long fs_stand_in_calls;")
            source = head + source.replace("#include <immintrin.h>\n", "")
        paths.append(tmp_path / f"unit{i}.c")
        paths[-1].write_text(source)
    lib = tmp_path / "units.so"
    subprocess.run([cpu.compiler(), *flags, *map(str, paths), "-o", str(lib), "-lm"], check=True, capture_output=True)
    return ctypes.CDLL(str(lib))


@pytest.mark.parametrize("branch", ["native", "portable", "avx512"])
def test_every_micro_kernel_branch_multiplies_exactly(tmp_path, branch):
    """The packed GEMMs through each branch of their micro-kernel equal a float64 product at partial
    tiles and an odd K (`fs_gemm_packed`: A packed, C stored transposed; `fs_gemm_rows`: A read by
    rows, added onto C in place, or stored plus a bias row and a residual, or plus a bias row through
    a tile epilogue, `fs_gemm_rows_epi`: here 2v + 1, on the registers with AVX-512, per element
    elsewhere; M of 6, 9, 13, 23
    and 25 rows: tiles of 6 and 12 and last ones of 1, 9 and 11; N with a 32-wide pair, a partial
    pair and a single 16-wide panel left): as this CPU compiles it (`-march=native`: AVX2 + FMA or
    AVX-512, whichever it has), the portable loops (no vector ISA named), and the
    AVX-512 branch with its intrinsics replaced by plain C (`_AVX512_STAND_IN`), so its indexing is
    checked on a CPU without AVX-512 (and compiled with the real ones to zmm FMAs)."""
    from fusesearch.backends.codegen import c_gemm, c_runtime

    driver = ("void run(long long M, long long N, long long K, const float* A, const float* B, float* Bp, float* C,\n"
              "         float* R, float* S, const float* T, const float* bias, float* E) {\n    fs_pack_b(K, N, B, N, 1, 1.0f, Bp);\n"
              "    fs_gemm_packed(M, N, K, A, K, 1, Bp, C, M);\n    fs_gemm_rows(M, N, K, A, K, Bp, R, N, R, N, 0);\n"
              "    fs_gemm_rows(M, N, K, A, K, Bp, S, N, T, N, bias);\n    fs_gemm_rows_epi(M, N, K, A, K, Bp, E, N, bias);\n}\n"
              "void band(long long M, long long N, long long K, long long ow, long long rs, long long cs, const float* X,\n"
              "          const int* off, const float* B, float* Bp, float* C) {\n    fs_pack_b(K, N, B, N, 1, 1.0f, Bp);\n"
              "    fs_conv_band(M, N, K, ow, rs, cs, X, off, Bp, C, M);\n}\n")
    epilogue = ("#define FS_TILE_EPI 1\nstatic inline float fs_tile_epi1(float v) { return (v + v) + 1.0f; }\n"
                "#if defined(__AVX512F__)\n#include <immintrin.h>\nstatic inline __m512 fs_tile_epi(__m512 v) {\n"
                "    return _mm512_add_ps(_mm512_add_ps(v, v), _mm512_set1_ps(1.0f));\n}\n#endif\n")
    # the runtime, and a kernel with a tile epilogue (the tile kernels compiled into it) calling it
    sources = [c_runtime.C_RUNTIME, c_runtime.C_HEADER + epilogue + c_gemm._C_TILE_GEMM + driver]
    flags = ["-O2", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
    if branch == "native":
        flags = list(cpu.CFLAGS[:-1])
    elif branch == "avx512":  # the real intrinsics compile (to zmm FMAs); the stand-in runs
        for source in sources:
            asm = subprocess.run([cpu.compiler(), "-O2", "-mavx512f", "-mfma", "-std=c11", "-x", "c", "-S", "-", "-o", "-"],
                                 input=source, check=True, capture_output=True, text=True).stdout
            assert "vfmadd" in asm and "zmm" in asm
    fn = _shared_library(tmp_path, sources, flags, branch == "avx512")
    rng = np.random.default_rng(1)
    for m, n, k in [(25, 30, 37), (6, 16, 1), (13, 40, 64), (9, 33, 5), (23, 64, 19)]:
        a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
        bp, c = np.zeros(-(-n // c_gemm.FS_NR) * c_gemm.FS_NR * k, np.float32), np.zeros((n, m), np.float32)
        r = rng.standard_normal((m, n)).astype(np.float32)  # fs_gemm_rows adds the product onto it
        bias, out = rng.standard_normal(n).astype(np.float32), np.zeros((m, n), np.float32)  # plus a bias row
        residual = rng.standard_normal((m, n)).astype(np.float32)  # and a residual read in place
        tiles = np.zeros((m, n), np.float32)  # through the tile epilogue
        expect = a.astype(np.float64) @ b.astype(np.float64)
        prior = r.astype(np.float64)
        fn.run(*(ctypes.c_longlong(v) for v in (m, n, k)),
               *(x.ctypes.data_as(ctypes.c_void_p) for x in (a, b, bp, c, r, out, residual, bias, tiles)))
        np.testing.assert_allclose(tiles, 2 * (expect + bias) + 1, rtol=1e-5, atol=2e-5,
                                   err_msg=f"{branch} tile epilogue {m}x{n}x{k}")
        np.testing.assert_allclose(out, expect + bias + residual, rtol=1e-5, atol=1e-5,
                                   err_msg=f"{branch} bias and residual {m}x{n}x{k}")
        np.testing.assert_allclose(c.T, expect, rtol=1e-5, atol=1e-5, err_msg=f"{branch} packed {m}x{n}x{k}")
        np.testing.assert_allclose(r, prior + expect, rtol=1e-5, atol=1e-5, err_msg=f"{branch} rows {m}x{n}x{k}")
    # fs_conv_band: rows of ow pixels (pixel (r, c) at r * rs + c * cs of the band, tap k at off[k]):
    # panels within a row of balanced widths, the taps in blocks (K over FS_TAP_BLOCK), more panels
    # than a group, stride 2, a last single filter panel and a partial pair
    for rows, ow, cs, n, k in [(3, 26, 1, 20, 72), (2, 7, 1, 40, 400), (4, 15, 2, 24, 27), (1, 56, 1, 16, 200),
                               (10, 5, 1, 33, 193)]:
        rs, m = ow * cs + 3, rows * ow
        off = rng.choice(4 * k, size=k, replace=False).astype(np.int32)
        x = rng.standard_normal(rows * rs + 4 * k + 64).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        bp, c = np.zeros(-(-n // c_gemm.FS_NR) * c_gemm.FS_NR * k, np.float32), np.zeros((n, m), np.float32)
        px = np.array([r * rs + q * cs for r in range(rows) for q in range(ow)])
        taps = x[px[:, None] + off[None, :]].astype(np.float64)  # pixels x taps
        fn.band(*(ctypes.c_longlong(v) for v in (m, n, k, ow, rs, cs)),
                *(v.ctypes.data_as(ctypes.c_void_p) for v in (x, off, b, bp, c)))
        np.testing.assert_allclose(c.T, taps @ b.astype(np.float64), rtol=1e-5, atol=2e-5,
                                   err_msg=f"{branch} band {rows}x{ow} stride {cs}, {n} filters, {k} taps")
    if branch == "avx512":
        assert ctypes.c_longlong.in_dll(fn, "fs_stand_in_calls").value > 0, "the AVX-512 branch did not run"


@pytest.mark.parametrize("hw", [96, 30])
def test_a_conv_with_small_filters_runs_in_blocks_that_stay_in_the_cache(tmp_path, hw):
    """A 1x1 conv over a computed panel (an Add, then a Concat: yolo's CSP merge) whose filters are
    small takes blocks of rows whose panel and product fit a share of the core's L2 (read at run
    time): at 96x96 several blocks, the last one shorter; at 30x30 one. Equal to ONNX Runtime with
    the bias."""
    nodes = [helper.make_node("Add", ["x1", "x2"], ["a"]),
             helper.make_node("Concat", ["a", "x3"], ["c"], axis=1),
             helper.make_node("Conv", ["c", "w", "b"], ["y"])]
    xs = [1, 16, hw, hw]
    gk = one_kernel(tmp_path, nodes, [("x1", xs), ("x2", xs), ("x3", xs)], [("y", [1, 32, hw, hw])],
                    [("w", _w([32, 32, 1, 1])), ("b", _w([32], 3))])
    body = _body(gk)
    assert "fs_band_chunk()" in body  # the blocks' rows fit the cache, as the host's L2 allows


@pytest.mark.parametrize("branch", ["native", "portable", "avx512"])
def test_split2_splits_a_row_by_column_parity_at_every_length(tmp_path, branch):
    """`fs_split2` (a stride-2 depthwise conv's input row into its two planes): even and odd
    columns exactly, for every row length up to 81 (whole 32-float steps, the masked last step
    with AVX-512, an odd length's one more even column), never writing past either plane: as this
    CPU compiles it, as the portable loop, and the AVX-512 branch with its intrinsics replaced by
    plain C (`_AVX512_STAND_IN`: its permutes and masks checked on a CPU without AVX-512)."""
    from fusesearch.backends.codegen import c_runtime

    sources = [c_runtime.C_RUNTIME, c_runtime.C_HEADER + ("void split(const float* src, float* even, float* odd, long long ne, "
                                                          "long long no) {\n    fs_split2(src, even, odd, ne, no);\n}\n")]
    flags = list(cpu.CFLAGS[:-1]) if branch == "native" else ["-O2", "-shared", "-fPIC", "-std=c11"]
    fn = _shared_library(tmp_path, sources, flags, branch == "avx512")
    ptr = ctypes.c_void_p
    for width in range(82):
        row = np.arange(1, width + 1, dtype=np.float32)
        ne, no = (width + 1) // 2, width // 2
        even, odd = np.full(ne + 16, -1.0, np.float32), np.full(no + 16, -1.0, np.float32)
        fn.split(row.ctypes.data_as(ptr), even.ctypes.data_as(ptr), odd.ctypes.data_as(ptr), ctypes.c_longlong(ne),
                 ctypes.c_longlong(no))
        assert np.array_equal(even[:ne], row[0::2]) and np.array_equal(odd[:no], row[1::2]), (branch, width)
        assert (even[ne:] == -1).all() and (odd[no:] == -1).all(), (branch, width)
