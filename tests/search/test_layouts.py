"""Layouts chosen by the exact search: a group runs in channel blocks (NCHWc) where its blocked
form and the reorders it needs cost less than NCHW, priced once per tensor; plan.json records each
group's layout and every reorder, `--explain` says which tensors changed layout and why, the other
strategies and `--layouts nchw` keep NCHW, and the fused ONNX export stays NCHW."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import numpy as np
import pytest
from onnx import helper

from costmodels import RooflineModel
from costmodels.devices import get_device
from costmodels.profile import Profile, save_profile
from costmodels.roofline import host_params
from fusesearch.layout import NCHW, NHWC, Layout
from fusesearch.lowering import reorders
from fusesearch.pipeline import prepare
from fusesearch.plans import plan_schema
from fusesearch.search import search
from fusesearch.search.problem import SearchConfig, SearchProblem, plan_layout
from tests.conftest import make_model, save

BLOCK = Layout(16)
# the NCHW depthwise loop at 0.3 of the blocked one's rate, about what bench_nchwc measured (0.41x
# the time in geometric mean, 0.12-0.68): where the blocked layout pays
DEPTHWISE_SLOW = {"product_efficiency": {"depthwise": 0.3}}


def _w(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.3


def depthwise_chain(tmp_path, convs: int = 3, channels: int = 32, stem: bool = False) -> str:
    """[an image's 3x3 stem conv + Relu ->] convs x (depthwise 3x3 conv + bias + Relu), NCHW in and out."""
    nodes, inits, last = [], [], "x"
    if stem:
        nodes += [helper.make_node("Conv", ["x", "ws", "bs"], ["s"], kernel_shape=[3, 3], pads=[1] * 4),
                  helper.make_node("Relu", ["s"], ["r"])]
        inits += [("ws", _w([channels, 3, 3, 3], 9)), ("bs", _w([channels], 8))]
        last = "r"
    for i in range(convs):
        nodes += [helper.make_node("Conv", [last, f"w{i}", f"b{i}"], [f"c{i}"], kernel_shape=[3, 3], pads=[1] * 4,
                                   group=channels),
                  helper.make_node("Relu", [f"c{i}"], [f"a{i}"])]
        inits += [(f"w{i}", _w([channels, 1, 3, 3], i)), (f"b{i}", _w([channels], 10 + i))]
        last = f"a{i}"
    x = [1, 3 if stem else channels, 14, 14]
    return save(make_model(nodes, [("x", x)], [(last, None)], inits), tmp_path / "dw.onnx")


def pointwise_chain(tmp_path) -> str:
    """Two 1x1 convs with Relu: dense convs the blocked layout does not make cheaper."""
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], kernel_shape=[1, 1]),
             helper.make_node("Relu", ["c0"], ["a0"]),
             helper.make_node("Conv", ["a0", "w1"], ["c1"], kernel_shape=[1, 1]),
             helper.make_node("Relu", ["c1"], ["y"])]
    inits = [("w0", _w([48, 32, 1, 1])), ("w1", _w([32, 48, 1, 1], 1))]
    return save(make_model(nodes, [("x", [1, 32, 14, 14])], [("y", None)], inits), tmp_path / "pw.onnx")


def dense_chain(tmp_path, channels: int, convs: int = 3) -> str:
    """convs x (3x3 conv + bias + Relu) of `channels` to `channels` at 28 x 28, NCHW in and out."""
    nodes, inits, last = [], [], "x"
    for i in range(convs):
        nodes += [helper.make_node("Conv", [last, f"w{i}", f"b{i}"], [f"c{i}"], kernel_shape=[3, 3], pads=[1] * 4),
                  helper.make_node("Relu", [f"c{i}"], [f"a{i}"])]
        inits += [(f"w{i}", _w([channels, channels, 3, 3], i)), (f"b{i}", _w([channels], 10 + i))]
        last = f"a{i}"
    return save(make_model(nodes, [("x", [1, channels, 28, 28])], [(last, None)], inits),
                tmp_path / f"dense{channels}.onnx")


def host16():
    """This machine's CPU figures with 16 float32 lanes (AVX-512's block, whatever the machine)."""
    return dataclasses.replace(get_device("host", 1), warp_size=16)


def _plan(path, strategy="cpsat", layouts="auto", params=None):
    prep = prepare(path)
    params = host_params().with_updates(**(params or {}))
    return search(prep.graph, host16(), RooflineModel(params), strategy,
                  config=SearchConfig(workers=1, time_limit_s=30, layouts=layouts))


def _blocked(plan):
    return [g for g in plan.groups if g.kernel.schedule.layout_out.blocked]


def test_a_depthwise_chain_where_blocks_pay_runs_blocked_with_one_reorder_each_way(tmp_path):
    """Every depthwise group blocked; the input copied into blocks once before the first, the
    output back to NCHW once after the last; the plan's price is its groups' and reorders', the
    optimum CP-SAT proved, and below the NCHW plan's."""
    path = depthwise_chain(tmp_path)
    plan = _plan(path, params=DEPTHWISE_SLOW)
    convs = [g for g in plan.groups if "Conv" in [plan.graph.nodes[i].op_type for i in g.nodes]]
    assert len(convs) == 3 and _blocked(plan) == convs
    assert all(g.kernel.schedule.product == "nchwc" and g.kernel.schedule.layout_in == BLOCK for g in convs)
    last = plan.graph.outputs[0]
    assert [(r.tensor, r.source, r.target, r.after) for r in plan.reorders] == [
        ("x", NCHW, BLOCK, -1), (last, BLOCK, NCHW, convs[-1].id)]
    assert plan.time_s == pytest.approx(sum(g.cost.time_s for g in plan.groups) + sum(r.cost.time_s for r in plan.reorders))
    assert plan.solver.status == "OPTIMAL" and plan.solver.objective_s == pytest.approx(plan.time_s, rel=1e-6)
    nchw = _plan(path, layouts="nchw", params=DEPTHWISE_SLOW)
    assert not _blocked(nchw) and not nchw.reorders and plan.time_s < nchw.time_s
    assert nchw.layouts == {"choice": "nchw", "block": 16} and plan.layouts == {"choice": "auto", "block": 16}


def test_a_blocked_stem_reads_the_image_where_it_lies(tmp_path):
    """A dense conv over the image's 3 channels reads them in NCHW: no reorder of the input, only
    the output's back to NCHW."""
    plan = _plan(depthwise_chain(tmp_path, convs=2, stem=True), params=DEPTHWISE_SLOW)
    stem = plan.groups[0]
    assert (stem.kernel.schedule.layout_in, stem.kernel.schedule.layout_out) == (NCHW, BLOCK)
    assert len(_blocked(plan)) == 3
    assert [(r.tensor, r.source, r.target) for r in plan.reorders] == [(plan.graph.outputs[0], BLOCK, NCHW)]


def test_where_blocks_do_not_pay_the_plan_stays_nchw(tmp_path):
    """1x1 convs priced alike in both layouts: the reorders (and no saving) keep NCHW; the plan
    records that layouts were open to it."""
    plan = _plan(pointwise_chain(tmp_path))
    assert not _blocked(plan) and not plan.reorders
    assert plan.layouts == {"choice": "auto", "block": 16}
    assert all(g.kernel.schedule.layout_in == NCHW for g in plan.groups)


def test_padding_that_does_not_pay_keeps_nchw(tmp_path):
    """Dense 3x3 convs whose NCHW loops run at 0.8 of the blocked rate: 32 channels fill two
    blocks of 16 and run blocked; 24 channels would compute 32 (a third more multiply-adds on
    zero lanes, a third more bytes), which costs more than the blocked rate gains: NCHW."""
    slow = {"product_efficiency": {**dict.fromkeys(("band", "packed", "rows", "im2col", "loops"), 0.8), "nchwc": 1.0}}
    full, padded = (_plan(dense_chain(tmp_path, c), params=slow) for c in (32, 24))
    assert len(_blocked(full)) == 3 and len(full.reorders) == 2
    assert not _blocked(padded) and not padded.reorders


@pytest.mark.parametrize("strategy", ["greedy", "rules", "none"])
def test_the_heuristics_keep_nchw(tmp_path, strategy):
    plan = _plan(depthwise_chain(tmp_path), strategy=strategy, params=DEPTHWISE_SLOW)
    assert not _blocked(plan) and not plan.reorders


def test_layouts_are_open_only_to_a_cnn_on_a_cpu_with_a_block_or_a_gpu(tmp_path):
    graph = prepare(depthwise_chain(tmp_path)).graph
    mlp = prepare(save(make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", [4, 8])], [("y", None)],
                                  [("w", _w([8, 8]))]), tmp_path / "mlp.onnx")).graph
    avx2 = dataclasses.replace(host16(), warp_size=8)
    sse = dataclasses.replace(host16(), warp_size=4)
    assert [plan_layout(graph, d, "auto") for d in (host16(), avx2, sse)] == [Layout(16), Layout(8), NCHW]
    assert plan_layout(graph, host16(), "nchw") == NCHW
    assert plan_layout(graph, get_device("h100-sxm"), "auto") == NHWC  # its tensor-core convs
    assert plan_layout(graph, get_device("h100-sxm"), "nchw") == NCHW
    assert plan_layout(mlp, host16(), "auto") == NCHW


def test_the_search_prices_reorders_as_plans_record_them(tmp_path):
    """`SearchProblem.plan_time_s` of the chosen groups equals the plan's time: the reorders the
    model priced are `lowering.reorders` of the kernels the plan holds."""
    prep = prepare(depthwise_chain(tmp_path))
    model = RooflineModel(host_params().with_updates(**DEPTHWISE_SLOW))
    problem = SearchProblem.build(prep.graph, host16(), model, SearchConfig(workers=1))
    plan = search(prep.graph, host16(), model, "cpsat", problem=problem)
    blocked = {frozenset(g.nodes) for g in _blocked(plan)}
    assert problem.plan_time_s(plan.partition(), blocked) == pytest.approx(plan.time_s)
    assert [(t, s, d) for t, s, d in reorders(prep.graph, [g.kernel for g in plan.groups])] == [
        (r.tensor, r.source, r.target) for r in plan.reorders]


@pytest.fixture
def blocks_pay(tmp_path):
    """A profile of this machine with 16 lanes on which the NCHW depthwise loop is slow."""
    profile = Profile(host16(), host_params().with_updates(**DEPTHWISE_SLOW), backend="cpu")
    return str(save_profile(profile, tmp_path / "profile.json"))


def test_plan_json_records_layouts_and_reorders_and_explain_says_why(tmp_path, run_cli, blocks_pay):
    path, out = depthwise_chain(tmp_path), tmp_path / "plan.json"
    code, stdout, err = run_cli("plan", path, "--device", blocks_pay, "-o", out, "--explain", "--workers", "1")
    assert code == 0, err
    assert "layouts (--layouts auto): 3 groups in NCHW16c, 2 reorders" in stdout
    doc = json.loads(out.read_text())
    jsonschema.Draft202012Validator(plan_schema()).validate(doc)
    convs = [g for g in doc["groups"] if "Conv" in g["ops"]]
    assert [g["layout"] for g in convs] == [{"in": "NCHW16c", "out": "NCHW16c"}] * 3
    assert doc["layouts"]["choice"] == "auto" and doc["layouts"]["block"] == 16
    assert [(r["tensor"], r["from"], r["to"], r["after"]) for r in doc["layouts"]["reorders"]] == [
        ("x", "NCHW", "NCHW16c", -1), ("a2", "NCHW16c", "NCHW", convs[-1]["id"])]
    assert doc["totals"]["time_s"] == pytest.approx(sum(g["time_s"] for g in doc["groups"])
                                                    + sum(r["time_s"] for r in doc["layouts"]["reorders"]), rel=1e-5)
    layout_lines = [line for line in err.splitlines() if "[layout]" in line]
    assert len(layout_lines) == 3 and all("vs NCHW" in line and ": -" in line for line in layout_lines)
    assert sum("[reorder] 'x' NCHW -> NCHW16c before the first group" in line for line in err.splitlines()) == 1
    code, stdout, err = run_cli("plan", path, "--device", blocks_pay, "-o", tmp_path / "nchw.json", "--layouts",
                                "nchw", "--workers", "1")
    assert code == 0, err
    assert "layouts (--layouts nchw): 0 groups in NCHW16c, 0 reorders" in stdout
    nchw = json.loads((tmp_path / "nchw.json").read_text())
    assert nchw["layouts"] == {"choice": "nchw", "block": 16, "reorders": []}
    assert {g["layout"]["out"] for g in nchw["groups"]} == {"NCHW"}


def test_plans_without_a_layout_choice_write_no_layout_keys(tmp_path, run_cli):
    """A model without convs (and any GPU plan): plan.json as before."""
    path = save(make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", [4, 8])], [("y", None)]), tmp_path / "r.onnx")
    out = tmp_path / "plan.json"
    code, _, err = run_cli("plan", path, "--device", "host", "-o", out)
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert "layouts" not in doc and all("layout" not in g for g in doc["groups"])


def test_a_bad_layouts_value_is_refused(tmp_path, run_cli):
    code, _, err = run_cli("plan", pointwise_chain(tmp_path), "--device", "host", "--layouts", "nhwc")
    assert code == 2 and err.strip().splitlines() == ["fusesearch: error: --layouts 'nhwc': choose one of auto, nchw"]


def test_the_fused_export_of_a_plan_with_layouts_stays_nchw(tmp_path, run_cli, blocks_pay):
    """The export reads the groups only: the fused model's tensors keep the model's NCHW shapes
    (no channel blocks, no reorder nodes) and ONNX Runtime runs it equal to the model."""
    import onnx

    path, out, emit = depthwise_chain(tmp_path), tmp_path / "plan.json", tmp_path / "fused.onnx"
    code, _, err = run_cli("plan", path, "--device", blocks_pay, "-o", out, "--workers", "1")
    assert code == 0, err
    assert json.loads(out.read_text())["layouts"]["reorders"]
    code, stdout, err = run_cli("export", out, path, "--emit", emit)
    assert code == 0, err
    fused = onnx.load(str(emit))
    assert [n.op_type for n in fused.graph.node] == ["g0", "g1", "g2"]
    assert [d.dim_value for d in fused.graph.output[0].type.tensor_type.shape.dim] == [1, 32, 14, 14]
    ops = {n.op_type for f in fused.functions for n in f.node}
    assert ops == {"Conv", "Relu"}


def test_a_plan_with_layouts_is_the_same_file_every_time(tmp_path, run_cli, blocks_pay):
    """Several CP-SAT workers, the layouts chosen: the one-worker re-solve keeps plan.json
    byte-identical across runs."""
    path = depthwise_chain(tmp_path, stem=True)
    texts = []
    for i in range(2):
        out = tmp_path / f"p{i}.json"
        code, _, err = run_cli("plan", path, "--device", blocks_pay, "-o", out, "--workers", "2")
        assert code == 0, err
        texts.append(out.read_text())
    assert texts[0] == texts[1] and '"NCHW16c"' in texts[0]


def test_a_decomposed_graph_keeps_nchw(tmp_path):
    """Pieces of a decomposed graph are solved in NCHW (a cut tensor's layout would couple them):
    the same chain blocked whole stays NCHW cut into pieces."""
    prep = prepare(depthwise_chain(tmp_path, convs=12))
    model = RooflineModel(host_params().with_updates(**DEPTHWISE_SLOW))
    plans = {how: search(prep.graph, host16(), model, "cpsat", config=SearchConfig(workers=1, decompose=how))
             for how in ("never", "always")}
    assert plans["always"].solver.stats["decomposition"]["pieces"] > 1
    assert len(_blocked(plans["never"])) == 12 and not _blocked(plans["always"]) and not plans["always"].reorders
