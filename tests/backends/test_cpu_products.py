"""A CPU gemm's or conv's code path is a schedule choice: lowering lists every product that applies
(our micro-kernel, a BLAS call per block, the per-row loops; a conv's band, packed filters, a 1x1's
pixels, im2col through the BLAS, the depthwise loop), each choice's C contains exactly its path and
equals ONNX Runtime, and no code generator learns what it wrote by searching its output."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from fusesearch.backends import cpu
from fusesearch.backends.codegen import generate
from fusesearch.groups import FusionGroup
from fusesearch.ir.canonicalize import to_proto
from fusesearch.lowering import choices
from fusesearch.pipeline import prepare
from fusesearch.schedule import ROWS_MAX_K, CpuTarget
from fusesearch.verify import all_values, random_feeds
from tests.conftest import make_model, save

OWN, BLAS = "fs_gemm_rows(", "FS_BLAS_SGEMM("
CODEGEN = Path(__file__).resolve().parents[2] / "fusesearch" / "backends" / "codegen"

needs_cc = pytest.mark.skipif(not cpu.available(), reason="no C compiler")


def _graph(tmp_path, nodes, inputs, outputs, inits):
    prep = prepare(save(make_model(nodes, inputs, outputs, inits), tmp_path / "m.onnx"))
    canonical = to_proto(prep.canonical)
    return prep.graph, all_values(canonical, random_feeds(canonical, 0))


def _whole(graph) -> FusionGroup:
    return FusionGroup(frozenset(range(len(graph))))


def _body(gk) -> str:
    """A generated kernel's own function: the calls it makes, not the prelude's definitions."""
    return gk.c_source[gk.c_source.index(f"void {gk.name}("):]


def _runs_equal(graph, kernel, values) -> str:
    """The kernel generated, run on the CPU and compared with ONNX Runtime; its body."""
    gk = generate(graph, kernel)
    out = cpu.run(gk, {a.tensor: values[a.tensor] for a in gk.inputs})
    for a in gk.outputs:
        ref = values[a.tensor].astype(np.float64)
        scale = max(1.0, float(np.max(np.abs(ref)))) if ref.size else 1.0
        np.testing.assert_allclose(out[a.tensor], ref, rtol=0, atol=1e-4 * scale, err_msg=a.tensor)
    return _body(gk)


CALLS = {"own": OWN, "blas": BLAS, "band": "fs_conv_band(", "packed": "fs_gemm_packed(", "rows": "fs_conv_1x1(",
         "im2col": BLAS}


def _written_path(body: str, conv: bool = False) -> str:
    """Which product a kernel body runs, read from its calls (the test's view, never codegen's)."""
    found = [p for p, call in CALLS.items() if call in body and (p in ("band", "packed", "rows", "im2col")) == conv]
    assert len(found) <= 1, f"one product per kernel, found {found}"
    return found[0] if found else "depthwise" if conv and "nc = 0; nc <" in body else "loops"


def _w(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.3


@needs_cc
@pytest.mark.parametrize("k,listed", [(64, ("own", "blas")), (ROWS_MAX_K + 8, ("blas",))])
def test_a_fused_gemm_lists_its_products_and_each_writes_exactly_its_path(tmp_path, k, listed):
    """K within ROWS_MAX_K: our micro-kernel first (today's default), then the BLAS; beyond it the
    BLAS alone. Each choice's body calls its product and not the other, and equals ONNX Runtime."""
    graph, values = _graph(tmp_path, *_matmul_relu_parts(k))
    kernels = choices(graph, _whole(graph), host=True)
    assert tuple(kn.schedule.product for kn in kernels) == listed
    assert all(kn.schedule.skeleton == "packed" and kn.spec().product == kn.schedule.product for kn in kernels)
    for kernel in kernels:
        body = _runs_equal(graph, kernel, values)
        assert _written_path(body) == kernel.schedule.product
        assert ("#ifdef FS_BLAS_SGEMM" in body) == (kernel.schedule.product == "blas")  # the fallback: BLAS only


def _matmul_relu_parts(k: int):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"), helper.make_node("Relu", ["y"], ["out"], name="r")]
    return nodes, [("x", [13, k])], [("out", None)], [("w", _w([k, 20]))]


@needs_cc
@pytest.mark.parametrize("k,listed", [(64, ("own",)), (ROWS_MAX_K + 8, ("loops",))])
def test_without_a_blas_the_products_are_ours_or_the_loops(tmp_path, k, listed):
    """A target without a BLAS lists no "blas" product; where ours does not apply the per-row loops
    are the one choice, written with no BLAS call and no `#ifdef`."""
    graph, values = _graph(tmp_path, *_matmul_relu_parts(k))
    kernels = choices(graph, _whole(graph), host=CpuTarget(blas=False))
    assert tuple(kn.schedule.product for kn in kernels) == listed
    body = _runs_equal(graph, kernels[0], values)
    assert _written_path(body) == listed[0] and "FS_BLAS_SGEMM" not in body


@pytest.mark.parametrize("no_blas", ["", "1"])
def test_a_search_on_the_host_lists_the_blas_only_where_programs_link_one(tmp_path, monkeypatch, no_blas):
    """The search problem's capabilities say whether this machine's C programs link a BLAS
    (`cpu.blas_flags`: FUSESEARCH_NO_BLAS turns it off), and a group's choices follow them."""
    from costmodels import RooflineModel, load_device
    from fusesearch.search.problem import SearchProblem

    monkeypatch.setenv("FUSESEARCH_NO_BLAS", no_blas)
    cpu.blas_flags.cache_clear()
    try:
        graph, _ = _graph(tmp_path, *_matmul_relu_parts(64))
        spec, params = load_device("host")
        legality = SearchProblem.build(graph, spec, RooflineModel(params)).legality
        products = {k.schedule.product for k in legality.options(frozenset(range(len(graph))), None)}
        linked = bool(cpu.blas_flags())
        assert legality.capabilities.blas == linked and ("blas" in products) == linked
        assert not (no_blas and linked)  # with the variable set, never a BLAS
    finally:
        cpu.blas_flags.cache_clear()


@needs_cc
def test_a_lone_gemm_lists_ours_the_blas_and_the_library_call(tmp_path):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["out"], name="mm")]
    graph, values = _graph(tmp_path, nodes, [("x", [13, 64])], [("out", None)], [("w", _w([64, 20]))])
    kernels = choices(graph, _whole(graph), host=True)
    assert [(kn.impl, kn.schedule.product) for kn in kernels] == [("generated", "own"), ("generated", "blas"),
                                                                   ("library", "")]
    for kernel in kernels[:2]:
        assert _written_path(_runs_equal(graph, kernel, values)) == kernel.schedule.product


@needs_cc
def test_a_product_stored_through_a_head_merge_and_under_a_softmax_writes_its_path(tmp_path):
    """The product's other skeletons follow the schedule too: stored at a Transpose's strides
    (attention's head merge) and into a row kernel's buffer under a Softmax."""
    merge = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
             helper.make_node("Transpose", ["y"], ["out"], name="t", perm=[1, 0, 2])]
    softmax = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
               helper.make_node("Softmax", ["y"], ["out"], name="s", axis=-1)]
    for i, nodes in enumerate((merge, softmax)):
        (tmp_path / str(i)).mkdir()
        graph, values = _graph(tmp_path / str(i), nodes, [("x", [2, 12, 16])], [("out", None)], [("w", _w([16, 32]))])
        kernels = choices(graph, _whole(graph), host=True)
        assert tuple(kn.schedule.product for kn in kernels) == ("own", "blas")
        for kernel in kernels:
            assert _written_path(_runs_equal(graph, kernel, values)) == kernel.schedule.product


CONVS = {  # name: (x shape, filters shape, stride, products listed with a BLAS, without one)
    "3x3": ([1, 8, 10, 10], [24, 8, 3, 3], 1, ("band", "packed", "im2col"), ("band", "packed")),
    "1x1 in place": ([1, 16, 14, 14], [64, 16, 1, 1], 1, ("rows", "packed", "im2col"), ("rows", "packed")),
    "1x1 stride 2": ([1, 16, 8, 8], [24, 16, 1, 1], 2, ("im2col", "packed"), ("packed",)),
    "depthwise": ([1, 8, 9, 9], [8, 1, 3, 3], 1, ("depthwise",), ("depthwise",)),
}


@needs_cc
@pytest.mark.parametrize("name", sorted(CONVS))
def test_a_conv_lists_its_products_and_each_writes_exactly_its_path(tmp_path, name):
    """Conv + bias + Relu: the band first for a k x k conv, `fs_conv_1x1` first for a 1x1 over
    14 x 14 pixels (`rows_1x1`), im2col first where neither applies and the filters are small
    (`packs_filters`), the depthwise loop alone for a depthwise conv; without a BLAS no im2col. Each
    choice's body calls its product alone and equals ONNX Runtime."""
    xs, ws, stride, listed, no_blas = CONVS[name]
    k, group = ws[2], xs[1] // ws[1]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[k, k], strides=[stride] * 2,
                              pads=[k // 2] * 4, group=group),
             helper.make_node("Relu", ["y"], ["out"])]
    graph, values = _graph(tmp_path, nodes, [("x", xs)], [("out", None)], [("w", _w(ws)), ("b", _w([ws[0]], 1))])
    kernels = choices(graph, _whole(graph), host=True)
    assert tuple(kn.schedule.product for kn in kernels) == listed
    assert tuple(kn.schedule.product for kn in choices(graph, _whole(graph), host=CpuTarget(blas=False))) == no_blas
    for kernel in kernels:
        body = _runs_equal(graph, kernel, values)
        assert _written_path(body, conv=True) == kernel.schedule.product
        assert ("#ifdef FS_BLAS_SGEMM" in body) == (kernel.schedule.product == "im2col")


def test_the_schedule_knows_the_micro_kernels_tile():
    """The smallest tile our products need (`schedule.CPU_MICRO_TILE`) is the C micro-kernel's."""
    from fusesearch.backends.codegen import c_gemm
    from fusesearch.schedule import CPU_MICRO_TILE

    assert CPU_MICRO_TILE == (c_gemm.FS_MR, c_gemm.FS_NR)


def _gelu_parts():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["h"]),
             helper.make_node("Div", ["h", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["h", "e1"], ["g"]),
             helper.make_node("Mul", ["g", "half"], ["out"])]
    inits = [("w", _w([48, 64])), ("b", _w([64], 1)), ("sqrt2", np.float32(1.4142135)), ("one", np.float32(1.0)),
             ("half", np.float32(0.5))]
    return nodes, [("x", [30, 48])], [("out", None)], inits


@needs_cc
@pytest.mark.parametrize("lanes,listed", [(16, [("own", "tile"), ("own", "block"), ("blas", "")]),
                                          (8, [("own", ""), ("blas", "")])])
def test_the_epilogue_on_the_registers_is_a_choice_where_the_vectors_hold_16_floats(tmp_path, lanes, listed):
    """MatMul + bias + GELU: with AVX-512's 16 lanes our product is listed with its epilogue on the
    registers ("tile", `fs_gemm_rows_epi`) and with a block pass ("block"); with 8 lanes the tile
    epilogue is no choice. Each choice writes its own form and equals ONNX Runtime."""
    graph, values = _graph(tmp_path, *_gelu_parts())
    kernels = choices(graph, _whole(graph), host=CpuTarget(lanes=lanes))
    assert [(kn.schedule.product, kn.schedule.epilogue) for kn in kernels] == listed
    for kernel in kernels:
        body = _runs_equal(graph, kernel, values)
        assert _written_path(body) == kernel.schedule.product
        assert ("fs_gemm_rows_epi(" in body) == (kernel.schedule.epilogue == "tile")


def test_a_cpu_device_lists_the_tile_epilogue_by_its_lanes():
    """`costing.device_choices` reads the CPU's vector width from the device (`warp_size`: its
    float32 lanes) and lists the tile epilogue only from 16."""
    from dataclasses import replace as with_

    from costmodels import DEVICES
    from fusesearch.costing import device_choices
    from tests.test_lowering import graph_of

    graph = graph_of(*_gelu_parts())
    for lanes, tile in ((16, True), (8, False)):
        device = with_(DEVICES["t4"], name="pinned-cpu", kind="cpu", warp_size=lanes)
        assert any(k.schedule.epilogue == "tile" for k in device_choices(graph, _whole(graph), device)) == tile


# a generated line searched for a call name: `x in "".join(lines)`, `"CALL(" in text`, `... not in text`,
# any call's name, literal or formatted, tested for membership (`"fs_stream(" in body`, `f"{f}(" in body`)
_SEARCHES_OUTPUT = re.compile(r'\bin\s+"[^"]*"\.join\(|\bnot\s+in\s+(text|src|source|body|c_src|loops)\b'
                              r'|"(FS_BLAS_SGEMM|fs_gemm_rows|fs_gemm_rows_epi|fs_conv_band|fs_gemm_packed|fs_conv_1x1)\(?"'
                              r'\s+(not\s+)?in\b|\bf?"[^"]*\("\s+(not\s+)?in\b')


def _searches_output(text: str) -> list[str]:
    return [f"{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if _SEARCHES_OUTPUT.search(line)]


def test_no_code_generator_decides_by_searching_its_own_output():
    """The generator writes the product its schedule names, and compiles a kernel for wide vectors
    where its caller says so (`base.wide_kernel`, from the kernel's ops); none of its modules learns
    what it wrote by searching the generated text for a call name."""
    found = [f"{path.name}:{hit}" for path in sorted(CODEGEN.glob("*.py")) for hit in _searches_output(path.read_text())]
    assert not found, found


def test_the_output_search_check_finds_the_searches_it_forbids():
    searches = ('wide = "fs_stream(" in body or any(f"{f}(" in body for f in WIDE_CALLS)\n'
                'if _OWN in "".join(blas):\n'
                'if "FS_BLAS_SGEMM" not in text:\n')
    assert [hit.split(":")[0] for hit in _searches_output(searches)] == ["1", "2", "3"]
    assert not _searches_output('call = f"fs_gemm_rows(mc, {n}LL);"\nif op in WIDE_OPS:\n')


WIDE_CASES = {  # op: (attributes, wide): the ops whose C evaluates erf, exp or vector math, and some that do not
    **{op: ({}, True) for op in ("Exp", "Log", "Erf", "Tanh", "Sigmoid", "Sin", "Cos", "Elu", "Selu", "Celu", "Softplus",
                                 "Mish", "Softmax", "LogSoftmax")},
    "Gelu": ({}, True), "ReduceLogSumExp": ({"axes": [1]}, True), "ReduceLogSum": ({"axes": [1]}, True),
    **{op: ({}, False) for op in ("Relu", "Sqrt", "Abs", "Asin", "Atanh", "Acos", "HardSigmoid")},
    "ReduceSum": ({"keepdims": 1}, False), "LayerNormalization": ({}, False),
}


@pytest.mark.parametrize("op", sorted(WIDE_CASES))
def test_a_kernel_is_wide_where_its_ops_evaluate_erf_exp_or_vector_math(tmp_path, op):
    """The 512-bit pragma is decided from the kernel's ops (`base.wide_kernel`): a kernel gets it
    where its body calls erf, exp or a vector-math function (`c_prelude.WIDE_CALLS`, read here from
    the source as a token: asinf is no sinf, as a search of the text once took it), and not elsewhere."""
    from fusesearch.backends.codegen.c_prelude import _WIDE_ON, WIDE_CALLS

    attrs, wide = WIDE_CASES[op]
    extra = [("scale", np.ones(64, np.float32))] if op == "LayerNormalization" else []
    inputs = ["x", "scale"] if extra else ["x"]
    node = helper.make_node(op, inputs, ["out"], **attrs)
    prep = prepare(save(make_model([node], [("x", [4, 64])], [("out", None)], extra, opset=20 if op == "Gelu" else 17),
                        tmp_path / "m.onnx"))
    gk = generate(prep.graph, choices(prep.graph, _whole(prep.graph), host=True)[0])
    head, body = gk.c_source.split(f"\nvoid {gk.name}(", 1)
    calls = re.findall(r"\b(" + "|".join(WIDE_CALLS) + r")\(", body)
    assert (_WIDE_ON in head) == bool(calls) == wide, (op, calls)
