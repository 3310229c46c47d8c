"""A C row kernel's mean and variance in one pass over each row (`schedule.one_pass_moments`), and
a LayerNorm before its projection as the gemm kernel's row prologue (`schedule.row_prologue`): the
schedule that carries them, the price and the source that follow, equal to ONNX Runtime where the
rows' mean is large against their spread."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from fusesearch import schedule
from fusesearch.backends import cpu
from fusesearch.backends.codegen import generate
from fusesearch.groups import FusionGroup
from fusesearch.ir.canonicalize import to_proto
from fusesearch.lowering import choices
from fusesearch.pipeline import prepare
from fusesearch.verify import all_values
from tests.backends.test_cpu_packed import _body, _w, one_kernel
from tests.conftest import make_model, save

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler")

ROWS, LENGTH = 6, 96


def _layernorm(escaping_difference: bool):
    """LayerNorm as exported (ReduceMean, Sub, Pow, ReduceMean, +eps, Sqrt, Div, x gamma, + beta) over
    x + 1000 (a mean far above the spread); with `escaping_difference` only the statistics part,
    its x - mean and variance the group's outputs (the statistics kernel a plan splits off)."""
    stats = [helper.make_node("Add", ["x", "offset"], ["xs"]),
             helper.make_node("ReduceMean", ["xs"], ["mean"], axes=[-1]),
             helper.make_node("Sub", ["xs", "mean"], ["d"]), helper.make_node("Pow", ["d", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1])]
    inits = [("offset", np.float32(1000.0)), ("two", np.float32(2.0))]
    if escaping_difference:
        return stats, inits, [("d", None), ("var", None)]
    norm = [helper.make_node("Add", ["var", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["sd"]),
            helper.make_node("Div", ["d", "sd"], ["n"]), helper.make_node("Mul", ["n", "gamma"], ["ng"]),
            helper.make_node("Add", ["ng", "beta"], ["out"])]
    return (stats + norm, inits + [("eps", np.float32(1e-12)), ("gamma", _w([LENGTH], 1) + 1),
                                   ("beta", _w([LENGTH], 2))], [("out", None)])


def _passes(gk) -> int:
    """Chunked row reductions in the kernel (each a pass over a row; rows run in pairs)."""
    return _body(gk).count("for (long long j0 = 0;")


@pytest.mark.parametrize("escaping_difference", [False, True])
def test_decomposed_layernorm_statistics_take_one_pass(tmp_path, escaping_difference):
    """The exported LayerNorm's mean and variance are one pair (`schedule.variance_pairs`); on a CPU
    the row kernel's schedule says "one-pass" and its source sums the shifted row and its squares
    in the mean's pass (one chunked pass per row, two rows at a time: two, where the variance's
    own pass made four); a GPU's schedule keeps a pass each.
    Equal to ONNX Runtime on rows of mean 1000 and spread 1, where unshifted sums would cancel."""
    nodes, inits, outputs = _layernorm(escaping_difference)
    gk = one_kernel(tmp_path, nodes, [("x", [ROWS, LENGTH])], outputs, inits)
    graph = prepare(save(make_model(nodes, [("x", [ROWS, LENGTH])], outputs, inits), tmp_path / "m.onnx")).graph
    ids = list(range(len(graph)))
    by_op = {n.op_type: n.id for n in graph.nodes}
    means = [n.id for n in graph.nodes if n.op_type == "ReduceMean"]
    assert schedule.variance_pairs(graph, ids) == {means[0]: means[1]}
    assert schedule.variance_pairs(graph, [i for i in ids if i != by_op["Pow"]]) == {}
    group = FusionGroup(frozenset(ids))
    assert [k.schedule.moments for k in choices(graph, group, host=True)] == ["one-pass"]
    assert [k.schedule.moments for k in choices(graph, group)] == [""]
    assert _passes(gk) == 2, _body(gk)


def test_layernormalization_op_takes_one_pass(tmp_path):
    """The LayerNormalization op (opset 17) in a row kernel: its moments in one pass, equal to ONNX
    Runtime on rows of mean 1000."""
    nodes = [helper.make_node("Add", ["x", "offset"], ["xs"]),
             helper.make_node("LayerNormalization", ["xs", "gamma", "beta"], ["out"], axis=-1, epsilon=1e-5)]
    inits = [("offset", np.float32(1000.0)), ("gamma", _w([LENGTH], 1) + 1), ("beta", _w([LENGTH], 2))]
    gk = one_kernel(tmp_path, nodes, [("x", [ROWS, LENGTH])], [("out", None)], inits)
    assert _passes(gk) == 2, _body(gk)


def test_a_lone_mean_keeps_its_pass(tmp_path):
    """A row kernel without a variance (a mean and x - mean) is not one-pass: its schedule says so."""
    nodes = [helper.make_node("ReduceMean", ["x"], ["mean"], axes=[-1]), helper.make_node("Sub", ["x", "mean"], ["out"])]
    graph = prepare(save(make_model(nodes, [("x", [ROWS, LENGTH])], [("out", None)]), tmp_path / "m.onnx")).graph
    assert [k.schedule.moments for k in choices(graph, FusionGroup(frozenset(range(len(graph)))), host=True)] == [""]


def _layernorm_projection(tmp_path, *, normalised_out: bool = True):
    """The exported LayerNorm, then its projection (MatMul + bias); the normalised rows also an
    output (a residual reads them in a transformer) where `normalised_out`."""
    nodes, inits, _ = _layernorm(False)
    nodes = nodes + [helper.make_node("MatMul", ["out", "w"], ["p"]), helper.make_node("Add", ["p", "bias"], ["y"])]
    inits = inits + [("w", _w([LENGTH, 64], 3)), ("bias", _w([64], 4))]
    outputs = [("y", None)] + ([("out", None)] if normalised_out else [])
    return nodes, inits, outputs


def test_layernorm_is_the_row_prologue_of_its_projection(tmp_path):
    """LayerNorm + MatMul + bias as one C kernel (our micro-kernel's product): its rows take the
    statistics in one pass and store the normalised rows, then the blocks multiply them in place,
    in the kernel's one OpenMP region (its stored form; tests/backends/test_ln_pack.py has the packed
    one); priced as one kernel with every op once and the normalised rows not read back; its row
    and column splits agree, and equal ONNX Runtime (on rows of mean 1000 in
    tests/backends/test_ln_pack.py too)."""
    nodes, inits, outputs = _layernorm_projection(tmp_path)
    prep = prepare(save(make_model(nodes, [("x", [ROWS * 4, LENGTH])], outputs, inits), tmp_path / "m.onnx"))
    graph = prep.graph
    ids = list(range(len(graph)))
    options = [k for k in choices(graph, FusionGroup(frozenset(ids)), host=True) if k.schedule.prologue == "stored"]
    gk = generate(graph, options[0])
    body = _body(gk)
    assert gk.template == "gemm" and body.count("#pragma omp parallel") == 1, body
    assert _passes(gk) == 2 and body.index("for (long long j0 = 0;") < body.index("fs_gemm_rows"), body
    anchor = next(n for n in graph.nodes if n.op_type == "Gemm")  # the MatMul + bias, canonical
    rows = schedule.row_prologue(graph, ids, anchor)
    assert rows == tuple(i for i in ids if i < anchor.id)
    assert {k.schedule.product for k in options} == {"own"} and {k.schedule.moments for k in options} == {"one-pass"}
    split = [choices(graph, FusionGroup(frozenset(part)), host=True)[0] for part in (rows, ids[len(rows):])]
    assert options[0].scalar_flops == sum(k.scalar_flops for k in split)
    assert options[0].write_bytes == sum(k.write_bytes for k in split)  # the normalised rows and y
    assert options[0].read_bytes == sum(k.read_bytes for k in split) - graph.tensors["out"].nbytes  # not read back
    two = [k for k in choices(graph, FusionGroup(frozenset(ids)), host=schedule.CpuTarget(threads=2, lanes=16))
           if k.schedule.prologue == "stored"]
    assert {k.schedule.split for k in two} >= {"rows", "cols"}  # column blocks read the stored rows:
    assert {k.scalar_flops for k in two} == {options[0].scalar_flops}  # the rows run once, not per block
    cols = next(k for k in two if k.schedule.split == "cols")
    feeds = {"x": np.random.default_rng(5).standard_normal((ROWS * 4, LENGTH)).astype(np.float32)}
    values = all_values(to_proto(prep.canonical), feeds)  # ONNX Runtime's, the weights among them
    got = [cpu.run(g, {a.tensor: values[a.tensor] for a in g.inputs})
           for g in (generate(graph, options[0]), generate(graph, cols))]
    for t in ("out", "y"):
        np.testing.assert_allclose(got[1][t], got[0][t], rtol=0, atol=1e-5)
        np.testing.assert_allclose(got[0][t], values[t], rtol=0, atol=1e-4 * max(1.0, float(np.abs(values[t]).max())))


def test_row_prologue_refusals(tmp_path):
    """A row prologue runs on a CPU only, and only where the epilogue keeps the product's positions
    (a Transpose after it would need the product in scratch): otherwise the group is refused, with
    the reason. Normalised rows that are not an output of the group are packed, never stored."""
    nodes, inits, outputs = _layernorm_projection(tmp_path)
    graph = prepare(save(make_model(nodes, [("x", [ROWS * 4, LENGTH])], outputs, inits), tmp_path / "m.onnx")).graph
    whole = FusionGroup(frozenset(range(len(graph))))
    assert "on a CPU only" in choices(graph, whole).reason
    nodes, inits, outputs = _layernorm_projection(tmp_path, normalised_out=False)
    graph = prepare(save(make_model(nodes, [("x", [ROWS * 4, LENGTH])], outputs, inits), tmp_path / "n.onnx")).graph
    forms = choices(graph, FusionGroup(frozenset(range(len(graph)))), host=True)
    assert {k.schedule.prologue for k in forms} == {"packed"}
    nodes, inits, outputs = _layernorm_projection(tmp_path)
    nodes = nodes + [helper.make_node("Transpose", ["y"], ["yt"], perm=[1, 0])]
    outputs = [("yt", None), ("out", None)]
    graph = prepare(save(make_model(nodes, [("x", [ROWS * 4, LENGTH])], outputs, inits), tmp_path / "t.onnx")).graph
    assert "moves the product's elements" in choices(graph, FusionGroup(frozenset(range(len(graph)))), host=True).reason


def test_the_shift_of_a_concatenated_row_pairs_its_rows(tmp_path):
    """ViT's first LayerNorm: a class token concatenated before the patches, so the row's first
    element (the one-pass shift) is a branch per row (`if (r < 1) ... else ...`), outside any loop;
    two rows at a time keep each branch whole. Equal to ONNX Runtime."""
    nodes = [helper.make_node("Concat", ["cls", "x"], ["c"], axis=1),
             helper.make_node("LayerNormalization", ["c", "gamma", "beta"], ["out"], axis=-1)]
    inits = [("cls", _w([1, 1, 16], 1)), ("gamma", _w([16], 2) + 1), ("beta", _w([16], 3))]
    gk = one_kernel(tmp_path, nodes, [("x", [1, 5, 16])], [("out", None)], inits)
    assert "r_0 < 1LL" in _body(gk) and "r_1 < 1LL" in _body(gk)


def test_a_kernel_input_without_a_value_is_refused(tmp_path):
    """A caller that has no value for an input (a weight too large for the graph's view of small
    constants, `Graph.constant_value` None) gets an error naming it, not a run over an
    uninitialised buffer (whose garbage two kernels could even agree on)."""
    nodes, inits, outputs = _layernorm_projection(tmp_path)
    graph = prepare(save(make_model(nodes, [("x", [ROWS * 4, LENGTH])], outputs, inits), tmp_path / "m.onnx")).graph
    (kernel, *_) = choices(graph, FusionGroup(frozenset(range(len(graph)))), host=True)
    gk = generate(graph, kernel)
    assert graph.constant_value("w") is None and "w" in {a.tensor for a in gk.inputs}
    given = {a.tensor: graph.constant_value(a.tensor) for a in gk.inputs}
    given["x"] = np.zeros((ROWS * 4, LENGTH), np.float32)
    with pytest.raises(ValueError, match="no value for its input 'w'"):
        cpu.run(gk, given)
