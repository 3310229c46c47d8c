"""Generated kernels on the CPU backend equal ONNX Runtime: tiny graphs per op family (every group
of every zoo plan: test_zoo_groups_cpu.py; CUDA compile checks: test_cuda_compile.py)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from onnx import TensorProto, helper

from fusesearch.backends import cpu
from fusesearch.backends.codegen import CodegenRefused, generate, try_generate
from fusesearch.groups import FusionDecision, FusionGroup
from fusesearch.ir.canonicalize import to_proto
from fusesearch.ir.op_kind import node_flops
from fusesearch.lowering import lower, try_lower
from fusesearch.pipeline import prepare
from fusesearch.verify import all_values, random_feeds
from tests.conftest import make_model, save

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler")


def check_group(prep, values, node_ids) -> None:
    kernel = try_lower(prep.graph, FusionGroup(frozenset(node_ids)), host=True)  # as the CPU runs it
    gk = generate(prep.graph, kernel)
    out = cpu.run(gk, {a.tensor: values[a.tensor] for a in gk.inputs})
    for a in gk.outputs:
        ref = values[a.tensor]
        scale = max(1.0, float(np.max(np.abs(ref)))) if ref.size else 1.0
        np.testing.assert_allclose(out[a.tensor].astype(np.float64), ref.astype(np.float64), rtol=0,
                                   atol=1e-4 * scale, err_msg=f"{gk.name}: {a.tensor}")


@pytest.fixture
def one_row_at_a_time(monkeypatch):
    """Row kernels one row per iteration (no pairs): tests that count a row body's passes."""
    from fusesearch.backends.codegen import rowwise

    monkeypatch.setattr(rowwise, "PAIR_MAX_LENGTH", 0)


def whole_graph_as_one_group(tmp_path, nodes, inputs, outputs, inits=(), opset=17):
    path = save(make_model(nodes, inputs, outputs, inits, opset=opset), tmp_path / "m.onnx")
    prep = prepare(path)
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    check_group(prep, values, range(len(prep.graph)))
    return prep


def test_pointwise_broadcast_chain(tmp_path):
    nodes = [helper.make_node("Add", ["x", "b"], ["a"]), helper.make_node("Mul", ["a", "s"], ["m"]),
             helper.make_node("Sigmoid", ["m"], ["g"]), helper.make_node("Mul", ["m", "g"], ["silu"]),
             helper.make_node("Clip", ["silu", "lo", "hi"], ["y"])]
    inits = [("b", np.arange(8, dtype=np.float32)), ("s", np.float32([[0.5]])), ("lo", np.float32(-1.0)),
             ("hi", np.float32(2.0))]
    whole_graph_as_one_group(tmp_path, nodes, [("x", [3, 4, 8])], [("y", None)], inits)


def test_injective_ops(tmp_path):
    """Transpose, Reshape, Slice, Concat, Split, Gather and Expand as index remapping."""
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
             helper.make_node("Reshape", ["t", "shape"], ["r"]),
             helper.make_node("Slice", ["r", "starts", "ends", "axes", "steps"], ["s"]),
             helper.make_node("Split", ["s", "split"], ["s0", "s1"], axis=1),
             helper.make_node("Concat", ["s1", "s0"], ["c"], axis=1),
             helper.make_node("Gather", ["c", "idx"], ["g"], axis=1),
             helper.make_node("Expand", ["g", "eshape"], ["y"])]
    inits = [("shape", np.int64([4, 12])), ("starts", np.int64([1])), ("ends", np.int64([11])),
             ("axes", np.int64([1])), ("steps", np.int64([2])), ("split", np.int64([2, 3])),
             ("idx", np.int64([[4, 0], [-1, 2]])), ("eshape", np.int64([3, 4, 2, 2]))]
    whole_graph_as_one_group(tmp_path, nodes, [("x", [4, 3, 4])], [("y", None)], inits)


def test_where_cast_and_resize_nearest(tmp_path):
    nodes = [helper.make_node("Greater", ["x", "zero"], ["m"]),
             helper.make_node("Cast", ["m"], ["mf"], to=TensorProto.FLOAT),
             helper.make_node("Where", ["m", "x", "mf"], ["w"]),
             helper.make_node("Resize", ["w", "", "scales"], ["y"], mode="nearest",
                              coordinate_transformation_mode="asymmetric", nearest_mode="floor")]
    inits = [("zero", np.float32(0.0)), ("scales", np.float32([1, 1, 2, 2]))]
    whole_graph_as_one_group(tmp_path, nodes, [("x", [1, 2, 3, 5])], [("y", None)], inits, opset=13)


def test_rowwise_softmax_layernorm_and_reductions(tmp_path):
    nodes = [helper.make_node("Softmax", ["x"], ["p"], axis=-1),
             helper.make_node("Add", ["p", "x"], ["a"]),
             helper.make_node("LayerNormalization", ["a", "gamma", "beta"], ["n"], axis=-1, epsilon=1e-5),
             helper.make_node("ReduceMean", ["n", "axes"], ["mean"], keepdims=1),
             helper.make_node("Sub", ["n", "mean"], ["y"])]
    inits = [("gamma", np.linspace(0.5, 1.5, 16, dtype=np.float32)), ("beta", np.float32(np.arange(16) / 10)),
             ("axes", np.int64([-1]))]
    whole_graph_as_one_group(tmp_path, nodes, [("x", [2, 3, 16])], [("y", None), ("mean", None)], inits, opset=18)


def _norm_rows_then(mover: list, inputs=(("x", [1, 8, 8]),)):
    """A LayerNorm over 8 rows of 8 (rows = row length, so a moved tensor still has one value per
    row or per element) followed by `mover`, whose output is the graph's."""
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["n"], axis=-1), *mover]
    inits = [("g", np.linspace(0.5, 1.5, 8, dtype=np.float32)), ("b", np.float32(np.arange(8) / 10)),
             ("zero", np.int64(0))]
    return nodes, list(inputs), inits


MOVES_ROWS = {  # graph → the node that reads a reduction's result at another row's position
    # BERT's pooler: the first token's 8 values after the final LayerNorm (8 = rows, by chance)
    "gather-first-token": (*_norm_rows_then([helper.make_node("Gather", ["n", "zero"], ["y"], axis=1)]), "Gather"),
    "transpose": (*_norm_rows_then([helper.make_node("Transpose", ["n"], ["y"], perm=[0, 2, 1])]), "Transpose"),
    # a per-row mean without its kept axis broadcasts along the row: y[r, j] = x[r, j] - mean[j]
    "mean-along-the-row": ([helper.make_node("ReduceMean", ["x", "axes"], ["m"], keepdims=0),
                            helper.make_node("Sub", ["x", "m"], ["y"])], [("x", [8, 8])],
                           [("axes", np.int64([-1]))], "Sub"),
}


@pytest.mark.parametrize("case", sorted(MOVES_ROWS))
def test_a_row_kernel_refuses_a_node_reading_another_rows_reduction(tmp_path, case):
    """A row kernel writes row r from row r's reduced scalars: a node after the reduction that
    reads another row's element (a Gather of the first token, a Transpose, a per-row value
    broadcast along the row) would mix rows, even where its output has one value per row or per
    element. Lowering refuses the group naming that node; the reduction fused without it and the
    node alone equal ONNX Runtime."""
    nodes, inputs, inits, op = MOVES_ROWS[case]
    path = save(make_model(nodes, inputs, [("y", None)], inits, opset=18), tmp_path / "m.onnx")
    prep = prepare(path)
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    mover = next(n for n in prep.graph.nodes if n.op_type == op)
    decision = try_lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))), host=True)
    assert isinstance(decision, FusionDecision), f"{case}: fused as {decision.template}"
    assert f"{mover.name}({op})" in decision.reason and "another row" in decision.reason, decision.reason
    check_group(prep, values, [n.id for n in prep.graph.nodes if n.id != mover.id])
    check_group(prep, values, [mover.id])


def test_a_row_kernel_keeps_values_read_at_their_own_row(tmp_path):
    """Per-row values reshaped (the flat position stays), broadcast along their own row, and an
    embedding Gather before the reduction all fuse into one row kernel equal to ONNX Runtime."""
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"]), helper.make_node("Add", ["e", "x"], ["h"]),
             helper.make_node("ReduceMean", ["h", "axes"], ["m"], keepdims=0),
             helper.make_node("Unsqueeze", ["m", "axes"], ["mu"]), helper.make_node("Sub", ["h", "mu"], ["d"]),
             helper.make_node("LayerNormalization", ["d", "g", "b"], ["y"], axis=-1),
             helper.make_node("Reshape", ["m", "flat"], ["mf"])]
    inits = [("table", np.random.default_rng(0).standard_normal((20, 8)).astype(np.float32)),
             ("ids", np.int64([3, 1, 4, 1, 5, 9, 2, 6])), ("axes", np.int64([-1])), ("flat", np.int64([8])),
             ("g", np.linspace(0.5, 1.5, 8, dtype=np.float32)), ("b", np.float32(np.arange(8) / 10))]
    prep = whole_graph_as_one_group(tmp_path, nodes, [("x", [8, 8])], [("y", None), ("mf", None)], inits, opset=18)
    assert try_lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))), host=True).template == "rowwise"


def test_global_average_pool(tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("GlobalAveragePool", ["r"], ["y"])]
    whole_graph_as_one_group(tmp_path, nodes, [("x", [2, 3, 5, 5])], [("y", None)])


def test_opaque_is_refused_with_a_reason_and_runs_as_a_library_call(tmp_path):
    """A MaxPool whose Indices output is used lowers alone to the opaque template (codegen refuses
    it with the reason) and runs as a library call through ONNX Runtime."""
    from fusesearch.backends.library import library_runner

    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["y", "i"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])]
    path = save(make_model(nodes, [("x", [1, 2, 7, 8])], [("y", None), ("i", None, TensorProto.INT64)]),
                tmp_path / "m.onnx")
    prep = prepare(path)
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    pool = next(n for n in prep.graph.nodes if n.op_type == "MaxPool")
    kernel = lower(prep.graph, FusionGroup.single(pool.id))
    decision = try_generate(prep.graph, kernel)
    assert kernel.template == "opaque"
    assert isinstance(decision, FusionDecision) and "opaque" in decision.reason
    with pytest.raises(CodegenRefused):
        generate(prep.graph, kernel)
    run, names = library_runner(canonical, prep.graph, kernel, values)
    for name in names:
        np.testing.assert_array_equal(run()[name], values[name])


def test_conv_with_prologue_padding_and_epilogue(tmp_path):
    """A prologue (x+1) on a padded conv input must not leak into the padding; grouped, strided."""
    nodes = [helper.make_node("Add", ["x", "one"], ["p"]),
             helper.make_node("Conv", ["p", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[2, 1], group=2),
             helper.make_node("Relu", ["c"], ["y"])]
    rng = np.random.default_rng(0)
    inits = [("one", np.float32(1.0)), ("w", rng.standard_normal((4, 2, 3, 3)).astype(np.float32)),
             ("b", rng.standard_normal(4).astype(np.float32))]
    whole_graph_as_one_group(tmp_path, nodes, [("x", [2, 4, 7, 6])], [("y", None)], inits)


def test_conv_transpose_and_gemm_with_softmax_epilogue(tmp_path):
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[2, 2], pads=[1, 1, 0, 0])]
    whole_graph_as_one_group(tmp_path, nodes, [("x", [1, 3, 5, 4])], [("y", None)],
                             [("w", rng.standard_normal((3, 2, 3, 3)).astype(np.float32))])
    nodes = [helper.make_node("Gemm", ["a", "b", "c"], ["g"], transB=1, alpha=0.5, beta=2.0),
             helper.make_node("Softmax", ["g"], ["y"], axis=-1)]
    inits = [("b", rng.standard_normal((16, 8)).astype(np.float32)), ("c", rng.standard_normal(16).astype(np.float32))]
    (tmp_path / "g").mkdir()
    whole_graph_as_one_group(tmp_path / "g", nodes, [("a", [5, 8])], [("y", None)], inits)


# Every group of every zoo plan (all 11 models, all strategies) against ONNX Runtime:
# tests/backends/test_zoo_groups_cpu.py; their CUDA versions compile: tests/backends/test_cuda_compile.py.


def test_matmul_whose_epilogue_moves_elements(tmp_path):
    """MatMul + bias, then the head split (Reshape + Transpose) as in attention: the C kernel
    computes the product into a buffer with its row loops, then the moved outputs from it."""
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["yb"]),
             helper.make_node("Reshape", ["yb", "shape"], ["r"]),
             helper.make_node("Transpose", ["r"], ["out"], perm=[0, 2, 1, 3])]
    inits = [("w", rng.standard_normal((24, 32)).astype(np.float32)), ("b", rng.standard_normal(32).astype(np.float32)),
             ("shape", np.array([2, 5, 4, 8], dtype=np.int64))]
    prep = whole_graph_as_one_group(tmp_path, nodes, [("x", [2, 5, 24])], [("out", None)], inits)
    kernel = lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))))
    assert "ybuf" in generate(prep.graph, kernel).c_source


# -- the prelude's exp and erf against the C library's -------------------------------------------

_F32 = np.float32


def _math_sample() -> np.ndarray:
    """A dense sample of floats: the whole range of exp's finite results and beyond, erf's curve
    and tails (every float of 3.5 <= x < 3.7, where the fit nears 1), GELU's clamp, tiny and subnormal
    magnitudes of both signs, the cut-offs and their neighbours, and the special values (NaN with
    and without payload bits, infinities, signed zeros)."""
    tiny = _F32(10.0) ** np.linspace(-45, 1.7, 200_001, dtype=_F32)
    edges = np.array([-87.33654, -87.3365478515625, 88.72283, 3.5792792, -3.5792792, 3.92, 5.07561827, -5.07561827],
                     _F32)
    every = np.arange(_F32(3.5).view(np.uint32), _F32(3.7).view(np.uint32), dtype=np.uint32).view(_F32)
    near = np.concatenate([np.nextafter(edges, _F32(np.inf)), np.nextafter(edges, _F32(-np.inf)), edges])
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, np.finfo(_F32).max, -np.finfo(_F32).max,
                        np.finfo(_F32).tiny, 1e-45, -1e-45], _F32)
    payload = np.array([0x7FC001FF, 0xFFC00155, 0x7F800001], np.uint32).view(_F32)
    return np.concatenate([np.linspace(-110, 95, 2_000_001, dtype=_F32), np.linspace(-6, 6, 1_000_001, dtype=_F32),
                           tiny, -tiny, every, near, special, payload])


@functools.lru_cache(maxsize=1)
def _prelude_math():
    """(x, fs_expf(x), libm expf(x), fs_erff(x), libm erff(x), -fs_erff(-x), fs_expf_le(x),
    fs_gelu2f(x), x (1 + erf(x / sqrt 2)) in double through libm's erf, the compiler's report on
    the simd loop): ours through an `omp simd` loop compiled as kernels are, the C library's
    through a plain loop (scalar libm)."""
    import ctypes
    import subprocess
    import tempfile
    from pathlib import Path

    from fusesearch.backends.codegen.c_prelude import _C_PRELUDE

    src = (_C_PRELUDE + "void ours(const float* x, float* e, float* r, long long n) {\n#pragma omp simd\n"
           "for (long long i = 0; i < n; ++i) { e[i] = fs_expf(x[i]); r[i] = fs_erff(x[i]); }\n}\n"
           "void le(const float* x, float* e, long long n) {\n#pragma omp simd\n"
           "for (long long i = 0; i < n; ++i) e[i] = fs_expf_le(x[i]);\n}\n"
           "void gelu(const float* x, float* g, double* ref, long long n) {\n#pragma omp simd\n"
           "for (long long i = 0; i < n; ++i) g[i] = fs_gelu2f(x[i]);\n"
           "for (long long i = 0; i < n; ++i) ref[i] = x[i] * (1.0 + erf(x[i] * 0.70710678118654752));\n}\n"
           "void libm(const float* x, float* e, float* r, long long n) {\n"
           "for (long long i = 0; i < n; ++i) { e[i] = expf(x[i]); r[i] = erff(x[i]); }\n}\n")
    x = _math_sample()
    outs = [np.empty_like(x) for _ in range(6)]
    neg, scratch = -x, np.empty_like(x)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.c"
        path.write_text(src)
        lib = Path(tmp) / "m.so"
        done = subprocess.run([cpu.compiler(), *cpu.CFLAGS[:-1], "-fopt-info-vec-optimized", str(path), "-o", str(lib),
                               cpu.CFLAGS[-1]], check=True, capture_output=True, text=True)
        so = ctypes.CDLL(str(lib))
        ptr = [a.ctypes.data_as(ctypes.c_void_p) for a in (x, *outs)]
        so.ours(ptr[0], ptr[1], ptr[3], ctypes.c_longlong(x.size))
        so.libm(ptr[0], ptr[2], ptr[4], ctypes.c_longlong(x.size))
        so.ours(neg.ctypes.data_as(ctypes.c_void_p), scratch.ctypes.data_as(ctypes.c_void_p), ptr[5],
                ctypes.c_longlong(x.size))
        so.le(ptr[0], ptr[6], ctypes.c_longlong(x.size))
        gelu, ref = np.empty_like(x), np.empty(x.shape, np.float64)
        so.gelu(ptr[0], gelu.ctypes.data_as(ctypes.c_void_p), ref.ctypes.data_as(ctypes.c_void_p),
                ctypes.c_longlong(x.size))
    return (x, *outs[:4], -outs[4], outs[5], gelu, ref, done.stderr)


def _rel(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return np.abs(got.astype(np.float64) - ref.astype(np.float64)) / np.abs(ref.astype(np.float64))


def test_prelude_exp_matches_libm():
    """fs_expf within 1e-6 relative of libm's expf for every normal result; 0 where libm's result
    is subnormal or 0 (below FLT_MIN); inf where it overflows; NaN for NaN (payload bits or not)."""
    x, ours, ref = _prelude_math()[:3]
    normal = np.isfinite(ref) & (ref >= np.finfo(_F32).tiny)
    assert normal.sum() > 2_000_000
    assert _rel(ours[normal], ref[normal]).max() < 1e-6
    below = ~np.isnan(x) & (ref < np.finfo(_F32).tiny)
    assert (ours[below] == 0).all() and below.sum() > 100_000
    assert (ours[np.isinf(ref)] == np.inf).all() and np.isinf(ref).sum() > 50_000
    assert np.isnan(ours[np.isnan(x)]).all() and np.isnan(x).sum() == 4
    assert (ours[x == 0] == 1).all()


def test_prelude_bounded_exp_is_the_exp_below_its_overflow():
    """fs_expf_le (a Softmax's exp of x - max(row)) equals fs_expf bit for bit wherever x <= 88
    (where 2^round(x log2 e) is a float), 0 included below FLT_MIN; NaN for NaN of any payload."""
    x, ours = _prelude_math()[:2]
    le = _prelude_math()[6]
    below = ~np.isnan(x) & (x <= 88)
    assert below.sum() > 2_500_000 and (ours[below] == 0).sum() > 100_000
    np.testing.assert_array_equal(le[below].view(np.uint32), ours[below].view(np.uint32))
    assert np.isnan(le[np.isnan(x)]).all() and np.isnan(x).sum() == 4


def test_prelude_erf_matches_libm():
    """fs_erff within 1e-6 relative of libm's erff wherever that is a normal float; within one
    subnormal step below; odd (signed zeros kept), never beyond +-1, +-1 at the infinities, NaN
    for NaN."""
    x, _, _, ours, ref, odd = _prelude_math()[:6]
    normal = np.abs(ref) >= np.finfo(_F32).tiny
    assert _rel(ours[normal], ref[normal]).max() < 1e-6
    sub = ~normal & ~np.isnan(x)
    assert np.abs(ours[sub].astype(np.float64) - ref[sub]).max() <= 1.5e-45
    zeros = x == 0
    assert (np.signbit(ours[zeros]) == np.signbit(x[zeros])).all() and np.signbit(x[zeros]).any()
    number = ~np.isnan(x)
    np.testing.assert_array_equal(odd[number], ours[number])
    assert np.abs(ours[number]).max() == 1.0
    assert ours[x == np.inf].tolist() == [1.0] and ours[x == -np.inf].tolist() == [-1.0]
    assert np.isnan(ours[np.isnan(x)]).all()


def test_prelude_gelu_matches_libm():
    """fs_gelu2f(x), GELU's x (1 + erf(x / sqrt 2)) in one call: within 1e-6 relative of the same
    through libm's erf in double for x >= 0 (where 1 + erf >= 1); within 1e-6 |x| below, where
    1 + erf cancels as it does in float through four ops; exactly 0 from its clamp down (erf is -1
    there), as the four ops give; inf at inf and where 2x passes the largest float, NaN for NaN
    and at -inf (inf times 0, as the ops)."""
    from fusesearch.backends.codegen.c_prelude import GELU_CLAMP

    x, gelu, ref = _prelude_math()[0], *_prelude_math()[7:9]
    number = np.isfinite(x)
    up = number & (x > 0) & (ref <= np.finfo(_F32).max)  # 2x beyond the largest float: inf, as x (1 + 1)
    assert _rel(gelu[up], ref[up]).max() < 1e-6 and up.sum() > 1_500_000
    assert (gelu[number & (x > 0) & (ref > np.finfo(_F32).max)] == np.inf).all()
    down = number & (x < 0)
    assert (np.abs(gelu[down] - ref[down]) <= 1e-6 * np.abs(x[down])).all() and down.sum() > 1_500_000
    tail = number & (x <= -float(GELU_CLAMP.rstrip("f")))
    assert (gelu[tail] == 0).all() and tail.sum() > 500_000
    assert (gelu[x == 0] == 0).all() and gelu[x == np.inf].tolist() == [np.inf]
    assert np.isnan(gelu[np.isnan(x) | (x == -np.inf)]).all()


def test_prelude_math_vectorizes():
    """The `omp simd` loop over fs_expf and fs_erff vectorizes (GCC's own report; other compilers
    are not asked)."""
    import subprocess

    version = subprocess.run([cpu.compiler(), "--version"], capture_output=True, text=True).stdout
    if "Free Software Foundation" not in version:
        pytest.skip("the vectorizer report is GCC's (-fopt-info-vec)")
    assert "loop vectorized" in _prelude_math()[-1]


def test_gelu_and_softmax_use_the_inline_math(tmp_path):
    """GELU's erf and Softmax's exp are the prelude's (no call to the C library's), Softmax takes
    one exp per element (the cached row) and one division per row (its reciprocal; the rows run in
    pairs, so two of each per pair's body); both equal
    ONNX Runtime on inputs reaching erf's and exp's tails."""
    nodes = [helper.make_node("Mul", ["x", "rs2"], ["a"]), helper.make_node("Erf", ["a"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["b"]), helper.make_node("Mul", ["x", "b"], ["c"]),
             helper.make_node("Mul", ["c", "s"], ["g"]), helper.make_node("Softmax", ["g"], ["y"], axis=-1)]
    inits = [("rs2", np.float32(2.5)), ("one", np.float32(1.0)), ("s", np.float32(30.0))]  # erf up to ~10
    prep = whole_graph_as_one_group(tmp_path, nodes, [("x", [6, 40])], [("y", None), ("g", None)], inits)
    gk = generate(prep.graph, try_lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))), host=True))
    body = gk.c_source[gk.c_source.index(f"void {gk.name}("):]
    assert "erff(" not in body.replace("fs_erff(", "") and "expf(" not in body.replace("fs_expf(", "")
    rows = 2 if "r_1 = r_0 + 1" in body else 1  # the rows of 40 run in pairs: each statement per row
    assert body.count("fs_expf_le(") == rows and body.count("fs_erff(") >= 1 and body.count(" / ") == rows


@pytest.mark.parametrize("form", ["divide", "multiply, operands swapped", "divide, erf also an output"])
def test_gelu_ops_are_one_call(tmp_path, form):
    """x (1 + erf(x / sqrt 2)) as four ops (x divided by sqrt 2, or times sqrt(1/2), any operand
    order), then GELU's 0.5: one `fs_gelu2f` call and no erf of its own, unless a value inside it is
    read elsewhere (here erf's, an output), which keeps the four ops; the kernel priced as written
    (`schedule.gelu_chains`: the folded scale and + 1 cost nothing). Equal to ONNX Runtime on
    inputs reaching erf's tails."""
    if form.startswith("divide"):
        scale = helper.make_node("Div", ["x", "r2"], ["a"])
        tail = [helper.make_node("Add", ["e", "one"], ["b"]), helper.make_node("Mul", ["x", "b"], ["c"])]
    else:
        scale = helper.make_node("Mul", ["rs2", "x"], ["a"])
        tail = [helper.make_node("Add", ["one", "e"], ["b"]), helper.make_node("Mul", ["b", "x"], ["c"])]
    nodes = [helper.make_node("Mul", ["x0", "wide"], ["x"]), scale, helper.make_node("Erf", ["a"], ["e"]), *tail,
             helper.make_node("Mul", ["c", "half"], ["y"])]
    inits = [("wide", np.float32(6.0)), ("r2", np.float32(np.sqrt(2))), ("rs2", np.float32(np.sqrt(0.5))),
             ("one", np.float32(1.0)), ("half", np.float32(0.5))]
    folded = not form.endswith("also an output")
    outputs = [("y", None)] if folded else [("y", None), ("e", None)]
    prep = whole_graph_as_one_group(tmp_path, nodes, [("x0", [4, 40])], outputs, inits)
    kernel = lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))))
    gk = generate(prep.graph, kernel)
    body = gk.c_source[gk.c_source.index(f"void {gk.name}("):]
    assert body.count("fs_gelu2f(") == folded and (body.count("fs_erff(") == 0) == folded
    # priced as written: the scale and the + 1 run no op there (and no division), the rest as ops
    g = prep.graph
    silent = {n.id for n in g.nodes if n.outputs[0] in ("a", "b")} if folded else set()
    assert kernel.scalar_flops == sum(node_flops(n.op_type, n.attrs, g.node_inputs(n), g.node_outputs(n))
                                      for n in g.nodes if n.id not in silent)
    assert kernel.divisions == (0 if folded else 4 * 40)


def test_a_cached_row_is_read_back_by_every_later_pass(tmp_path, one_row_at_a_time):
    """An embedding + LayerNorm row (Gather, Add, the moments pass, the output pass: mean and
    variance in one pass, `schedule.one_pass_moments`): the Gather and the Add run in the first pass
    only (and once for the row's first element, the shift); the later pass reads the row it cached.
    Equal to ONNX Runtime."""
    nodes = [helper.make_node("Gather", ["table", "ids"], ["g"]), helper.make_node("Add", ["g", "pos"], ["x"]),
             helper.make_node("ReduceMean", ["x"], ["m"], axes=[-1]), helper.make_node("Sub", ["x", "m"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["d2"]), helper.make_node("ReduceMean", ["d2"], ["v"], axes=[-1]),
             helper.make_node("Add", ["v", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["sd"]),
             helper.make_node("Div", ["d", "sd"], ["y"])]
    inits = [("table", np.random.default_rng(0).standard_normal((50, 24)).astype(np.float32)),
             ("pos", np.random.default_rng(1).standard_normal((6, 24)).astype(np.float32)),
             ("eps", np.float32(1e-5))]
    prep = whole_graph_as_one_group(tmp_path, nodes, [("ids", [6], TensorProto.INT64)], [("y", None)], inits)
    gk = generate(prep.graph, try_lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))), host=True))
    body = gk.c_source[gk.c_source.index(f"void {gk.name}("):]
    passes = body.split("for (long long j = 0;")[1:]
    assert len(passes) == 2 and "rb0[j] = " in passes[0]
    assert all("rb0[j]" in p and "in0[" not in p and "in1[" not in p for p in passes[1:])


def test_a_row_over_several_dims_is_indexed_without_division(tmp_path):
    """Relu + GlobalAveragePool over 5x7 windows: the row's two dims are read back as the flat
    column, so the loop holds no division or modulo the compiler must keep. Equal to ONNX Runtime."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("GlobalAveragePool", ["r"], ["y"])]
    prep = whole_graph_as_one_group(tmp_path, nodes, [("x", [2, 3, 5, 7])], [("y", None)])
    gk = generate(prep.graph, try_lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))), host=True))
    body = gk.c_source[gk.c_source.index(f"void {gk.name}("):]
    loads = [line for line in body.splitlines() if "in0[" in line]
    assert loads and all("/" not in x and "%" not in x for x in loads)
    assert "*35LL + (j)]" in loads[0]


def _loop_bodies(body: str, var: str) -> list[str]:
    """The text of each `for (long long var ...)` loop of a generated body, up to its closing brace."""
    lines, out = body.splitlines(), []
    for i, line in enumerate(lines):
        if line.lstrip().startswith(f"for (long long {var} = "):
            close = line[:len(line) - len(line.lstrip())] + "}"
            end = next(k for k in range(i + 1, len(lines)) if lines[k] == close)
            out.append("\n".join(lines[i + 1:end]))
    return out


def test_per_row_values_are_hoisted_out_of_the_element_loops(tmp_path, one_row_at_a_time):
    """Embedding + LayerNorm written out (Gather, Add, ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt,
    Div, Mul, Add): the Gather's row index is read once per row, before the element loop (inside,
    the compiler vectorizes the table read as a hardware gather, 2.5x slower at bert-small's
    128x128), and the Div by the row's deviation is a multiply by its reciprocal, taken once per
    row. Equal to ONNX Runtime."""
    nodes = [helper.make_node("Gather", ["table", "ids"], ["g"]), helper.make_node("Add", ["g", "pos"], ["x"]),
             helper.make_node("ReduceMean", ["x"], ["m"], axes=[-1]), helper.make_node("Sub", ["x", "m"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["d2"]), helper.make_node("ReduceMean", ["d2"], ["v"], axes=[-1]),
             helper.make_node("Add", ["v", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["sd"]),
             helper.make_node("Div", ["d", "sd"], ["n"]), helper.make_node("Mul", ["n", "gamma"], ["s"]),
             helper.make_node("Add", ["s", "beta"], ["y"])]
    rng = np.random.default_rng(0)
    inits = [("table", rng.standard_normal((50, 24)).astype(np.float32)),
             ("pos", rng.standard_normal((6, 24)).astype(np.float32)), ("two", np.float32(2.0)),
             ("eps", np.float32(1e-5)), ("gamma", rng.standard_normal(24).astype(np.float32)),
             ("beta", rng.standard_normal(24).astype(np.float32))]
    prep = whole_graph_as_one_group(tmp_path, nodes, [("ids", [6], TensorProto.INT64)], [("y", None)], inits)
    gk = generate(prep.graph, try_lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))), host=True))
    body = gk.c_source[gk.c_source.index(f"void {gk.name}("):]
    ids = next(a.name for a in gk.inputs if a.tensor == "ids")
    loops = _loop_bodies(body, "j")
    assert len(loops) == 2 and f"{ids}[r]" in body  # the moments' pass and the output's
    assert all(f"{ids}[" not in loop and " / " not in loop and "sqrtf" not in loop for loop in loops)


def test_hoist_invariants_keeps_what_depends_on_the_loop():
    """The split itself: a temporary reading the loop variable, a variant temporary, an array the
    body writes or an accumulator it updates stays inside; a division by a hoisted temporary
    becomes a multiply by its reciprocal; a body with a branch is left whole."""
    from fusesearch.backends.codegen.hoist import hoist_invariants

    body = ["float v1 = in0[r];", "float v2 = sqrtf(v1);", "float v3 = in1[r * 8LL + j];",
            "float v4 = (v3 / v2);", "float v5 = (s0 * 2.0f);", "float v6 = buf[r];", "float v7 = in2[j] + v5;",
            "out0[r * 8LL + j] = v4;", "s0 = s0 + v4;"]
    before, inside = hoist_invariants(body, "j")
    assert before == ["float v1 = in0[r];", "float v2 = sqrtf(v1);", "float v2r = 1.0f / v2;"]
    assert inside == ["float v3 = in1[r * 8LL + j];", "float v4 = (v3 * v2r);", "float v5 = (s0 * 2.0f);",
                      "float v6 = buf[r];", "float v7 = in2[j] + v5;", "out0[r * 8LL + j] = v4;", "s0 = s0 + v4;"]
    assert hoist_invariants(["float v1 = in0[r];", "if (j) out0[j] = v1;"], "j") is None


def test_long_row_reductions_keep_partial_results(tmp_path, one_row_at_a_time):
    """Rows of 100 (three whole chunks of C_PARTIALS and a tail of 4): the LayerNorm's sums and the
    Softmax's max and sum each run as C_PARTIALS partial results folded at the end (`fs_fold_sum`,
    `fs_fold_max`), the tail in a plain loop (the LayerNorm's two sums share one pass and its
    tail: `schedule.one_pass_moments`); a row of 40 (under two chunks) keeps the one-accumulator loop. Equal to ONNX
    Runtime, a row max included (inputs with large negative and positive values)."""
    from fusesearch.backends.codegen.rowwise import C_PARTIALS

    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["n"], axis=-1),
             helper.make_node("Mul", ["n", "s"], ["m"]), helper.make_node("Softmax", ["m"], ["y"], axis=-1)]
    rng = np.random.default_rng(0)
    for length, partial in ((100, True), (40, False)):
        inits = [("g", rng.standard_normal(length).astype(np.float32)),
                 ("b", rng.standard_normal(length).astype(np.float32)), ("s", np.float32(8.0))]
        prep = whole_graph_as_one_group(tmp_path, nodes, [("x", [5, length])], [("y", None)], inits)
        gk = generate(prep.graph, try_lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))), host=True))
        body = gk.c_source[gk.c_source.index(f"void {gk.name}("):]
        assert body.count(f"[{C_PARTIALS}];") == (4 if partial else 0)  # mean, variance, max, sum
        if partial:  # the tail, then each reduction's partials folded by the prelude's tree
            assert body.count("for (long long j = 96LL; j < 100LL; ++j)") == 3
            assert body.count("= fs_fold_sum(p") == 3 and body.count("= fs_fold_max(p") == 1


def _source(prep) -> str:
    return generate(prep.graph, try_lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))), host=True)).c_source


def _body(prep) -> str:
    source = _source(prep)
    return source[source.index("\nvoid k_") + 1:]


def test_trailing_dims_merge_into_one_loop_where_no_load_divides(tmp_path):
    """Add + Relu over 4x8x5x6: with a per-channel bias (8x1x1) the 5x6 plane is one loop of 30
    (rows 4 x 8 = 32, at least MERGE_MIN_ROWS), the bias read per row and the element loads at the
    flat column, no division; a bias along the last dim (6) would need j % 6, so that loop stays
    over the last dim. Both equal ONNX Runtime."""
    from fusesearch.backends.codegen.pointwise import MERGE_MIN_ROWS

    assert 4 < MERGE_MIN_ROWS <= 32
    rng = np.random.default_rng(0)
    for bias, inner in (((8, 1, 1), 30), ((6,), 6)):
        nodes = [helper.make_node("Add", ["x", "b"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
        prep = whole_graph_as_one_group(tmp_path, nodes, [("x", [4, 8, 5, 6])], [("y", None)],
                                        [("b", rng.standard_normal(bias).astype(np.float32))])
        loops = _loop_bodies(_body(prep), "j")
        assert len(loops) == 1 and f"j < {inner}LL" in _body(prep)
        assert "/" not in loops[0] and "%" not in loops[0]


def test_outputs_past_the_threshold_stream_their_stores(tmp_path, monkeypatch):
    """With STREAM_MIN_BYTES at 0 every float32 output streams (`fs_stream`, a fence per thread):
    a pointwise group over rows of 111 floats (lines split at both ends), a LayerNorm over rows of
    300 (a whole chunk of STREAM_CHUNK and a partial one) and a Softmax over rows of 40, with a
    side output; all equal ONNX Runtime. At the real threshold a 1 MiB output stores plainly and a
    16 MiB one streams."""
    from fusesearch.backends.codegen import c_prelude

    assert c_prelude.STREAM_CHUNK < 300
    rng = np.random.default_rng(0)
    cases = [([helper.make_node("Add", ["x", "b"], ["a"]), helper.make_node("Sigmoid", ["a"], ["y"])],
              [20, 37, 3], [("b", rng.standard_normal((20, 1, 1)).astype(np.float32))]),
             ([helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1)], [7, 300],
              [("g", rng.standard_normal(300).astype(np.float32)), ("b", rng.standard_normal(300).astype(np.float32))]),
             ([helper.make_node("Mul", ["x", "s"], ["m"]), helper.make_node("Softmax", ["m"], ["y"], axis=-1)], [9, 40],
              [("s", np.float32(4.0))])]
    with monkeypatch.context() as patch:
        patch.setattr(c_prelude, "STREAM_MIN_BYTES", 0)
        for nodes, shape, inits in cases:
            outputs = [("y", None), ("m", None)] if any(n.op_type == "Softmax" for n in nodes) else [("y", None)]
            body = _body(whole_graph_as_one_group(tmp_path, nodes, [("x", shape)], outputs, inits))
            assert "fs_stream(out" in body and body.count("fs_stream_fence();") == 1
            assert shape[0] != 20 or "j0 < 111LL" in body
    add = [helper.make_node("Add", ["x", "x"], ["y"])]
    wide = 'target("prefer-vector-width=512")'
    small = _source(whole_graph_as_one_group(tmp_path, add, [("x", [256, 1024])], [("y", None)]))
    assert "fs_stream(out" not in small and wide not in small
    big = _source(whole_graph_as_one_group(tmp_path, add, [("x", [16, 256, 1024])], [("y", None)]))
    assert "fs_stream(out0" in big and "fs_prefetch_ahead(in0" in big and wide in big


def test_conv_prologue_and_epilogue_run_over_the_blocks_pixels_as_one_loop(tmp_path):
    """Clip + 1x1 Conv (48 -> 16 filters at 7x9) + Add: the Clip while packing the panel and the Add
    after the product each run over a block's pixels as one loop (a block is whole output rows),
    with no division; an Add of a bias along the width (9) needs the pixel's column, so that
    epilogue keeps its loops over rows and columns. Both equal ONNX Runtime."""
    rng = np.random.default_rng(0)
    for bias, flat in (((1, 16, 7, 9), True), ((9,), False)):
        nodes = [helper.make_node("Clip", ["x", "lo", "hi"], ["c"]),
                 helper.make_node("Conv", ["c", "w"], ["y0"], kernel_shape=[1, 1]),
                 helper.make_node("Add", ["y0", "r"], ["y"])]
        inits = [("lo", np.float32(0.0)), ("hi", np.float32(1.0)),
                 ("w", rng.standard_normal((16, 48, 1, 1)).astype(np.float32)),
                 ("r", rng.standard_normal(bias).astype(np.float32))]
        body = _body(whole_graph_as_one_group(tmp_path, nodes, [("x", [1, 48, 7, 9])], [("y", None)], inits))
        pixel_loops = _loop_bodies(body, "q")
        assert len(pixel_loops) == (2 if flat else 1)
        assert all("/" not in loop and "%" not in loop for loop in pixel_loops)
        assert ("for (long long ow = 0; ow < 9LL; ++ow)" in body) != flat


def test_short_rows_run_in_pairs_and_math_loops_compile_wide(tmp_path):
    """Rows up to PAIR_MAX_LENGTH run two at a time, statement by statement (`r_0`, `r_1`, each
    top-level name suffixed by its row): a scaled Softmax over 7 rows of 40 (odd: the last row is
    its own pair), an Add + LayerNorm over 4 rows of 300 and ReduceMax over rows of 3 (the tail
    past the partial sums); a LayerNorm over rows of 600 runs one row at a time. All equal ONNX
    Runtime. A kernel calling erf or exp is compiled for 512-bit vectors (`WIDE_CALLS`); an Add or a
    LayerNorm is not."""
    from fusesearch.backends.codegen import rowwise

    assert 300 < rowwise.PAIR_MAX_LENGTH < 600
    rng = np.random.default_rng(0)
    wide = 'target("prefer-vector-width=512")'

    def norm(n):
        return [("g", rng.standard_normal(n).astype(np.float32)), ("b", rng.standard_normal(n).astype(np.float32))]

    cases = [([helper.make_node("Mul", ["x", "s"], ["m"]), helper.make_node("Softmax", ["m"], ["y"], axis=-1)],
              [7, 40], [("s", np.float32(4.0))], True, True),
             ([helper.make_node("Add", ["x", "x"], ["a"]), helper.make_node("LayerNormalization", ["a", "g", "b"], ["y"], axis=-1)],
              [4, 300], norm(300), True, False),
             ([helper.make_node("ReduceMax", ["x"], ["y"], axes=[1], keepdims=1)], [5, 3], [], True, False),
             ([helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1)], [3, 600], norm(600), False, False)]
    for nodes, shape, inits, paired, is_wide in cases:
        source = _source(whole_graph_as_one_group(tmp_path, nodes, [("x", shape)], [("y", None)], inits, opset=13))
        body = source[source.index("\nvoid k_") + 1:]
        assert ("long long r_0 = 2 * rp, r_1 = r_0 + 1 < " in body) == paired
        assert (wide in source) == is_wide
        if paired:
            assert "r_0)" in body and "r_1)" in body and "[r]" not in body


def test_paired_rows_keep_each_pragma_on_its_own_rows_loop():
    """`_paired` splits a row body into top-level statements: a pragma line (`#pragma`, the
    `FS_SIMD_SUM` macro) stays with the loop after it, so each row's copy of the loop keeps its
    own; every top-level name (and `r`) is suffixed by its row, names declared inside a block are
    not; the second row of an odd count is the first again."""
    from fusesearch.backends.codegen.rowwise import _paired

    body = ["float s1 = 0.0f;", "FS_SIMD_SUM(s1)", "for (long long k = 0; k < 4LL; ++k) {",
            "    float v2 = in0[r * 4LL + k];", "    s1 += v2;", "}", "#pragma omp simd",
            "for (long long j = 0; j < 4LL; ++j) out0[r * 4LL + j] = s1;"]
    out = _paired(body, 3)
    assert out[0] == "long long r_0 = 2 * rp, r_1 = r_0 + 1 < 3LL ? r_0 + 1 : r_0;"
    assert out[1:3] == ["float s1_0 = 0.0f;", "float s1_1 = 0.0f;"]
    for u in (0, 1):
        at = out.index(f"FS_SIMD_SUM(s1_{u})")
        assert out[at + 1].startswith("for (long long k = 0;") and f"in0[r_{u} * 4LL + k]" in out[at + 2]
        assert out[at + 2].strip().startswith("float v2 = ")  # block-local: not renamed
        store = out.index(f"for (long long j = 0; j < 4LL; ++j) out0[r_{u} * 4LL + j] = s1_{u};")
        assert out[store - 1] == "#pragma omp simd"


def test_a_kernel_runs_its_loops_in_one_parallel_region(tmp_path):
    """Attention's scores: the product into a buffer, then the scaled, masked Softmax rows over it.
    The kernel opens one OpenMP region, its loops are worksharing loops of it (the barrier between
    the product and the rows that read it is the first loop's own), and the product's buffer is one
    that every thread of the region shares (one thread takes it, the others get its pointer)."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("MatMul", ["q", "k"], ["s"]), helper.make_node("Mul", ["s", "c"], ["sc"]),
             helper.make_node("Add", ["sc", "m"], ["sm"]), helper.make_node("Softmax", ["sm"], ["y"], axis=-1)]
    inits = [("c", np.array(0.125, dtype=np.float32)), ("m", rng.standard_normal((1, 1, 1, 32)).astype(np.float32))]
    prep = whole_graph_as_one_group(tmp_path, nodes, [("q", [1, 2, 32, 16]), ("k", [1, 2, 16, 32])],
                                    [("y", None)], inits)
    kernel = try_lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))), host=True)
    source = generate(prep.graph, kernel).c_source
    assert source.count("#pragma omp parallel") == 1
    assert "#pragma omp parallel for" not in source
    assert source.count("#pragma omp for") >= 2
    assert "#pragma omp single copyprivate(ybuf)" in source
