"""A C row kernel's mean and variance in one pass over each row (`schedule.one_pass_moments`):
the schedule that carries it, the source that follows from it, equal to ONNX Runtime where the
rows' mean is large against their spread."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from fusesearch import schedule
from fusesearch.backends import cpu
from fusesearch.groups import FusionGroup
from fusesearch.lowering import choices
from fusesearch.pipeline import prepare
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
