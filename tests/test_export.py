"""Fused export, `verify`, `export` from plan.json (and its refusals), and the plan pictures."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from fusesearch.api import plan as make_plan
from fusesearch.export import fused_model
from fusesearch.ir.canonicalize import to_proto
from fusesearch.pictures import plan_html, plan_svg
from fusesearch.pipeline import prepare
from fusesearch.verify import compare, random_feeds, run
from tests.conftest import make_model, save


def test_multi_output_group_becomes_a_multi_output_function(tmp_path):
    """a = Relu(x) is used inside the group and outside it: the function returns both."""
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"), helper.make_node("Neg", ["a"], ["b"], name="neg"),
             helper.make_node("MatMul", ["a", "w"], ["c"], name="mm")]
    model = make_model(nodes, [("x", [4, 4])], [("b", None), ("c", None)], [("w", np.eye(4, dtype=np.float32))])
    path = save(model, tmp_path / "m.onnx")
    prep = prepare(path)
    ids = {n.name: n.id for n in prep.graph.nodes}
    fused = fused_model(to_proto(prep.canonical), prep.graph, [[ids["relu"], ids["neg"]], [ids["mm"]]])
    onnx.checker.check_model(fused, full_check=True)
    (fn,) = fused.functions
    assert list(fn.output) == ["a", "b"] and list(fn.input) == ["x"]
    feeds = random_feeds(fused, 1)
    assert all(d.ok for d in compare(run(model, feeds), run(fused, feeds)))


@pytest.fixture(scope="module")
def saved_plan(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan")
    p = make_plan("zoo:resnet18", device="t4", strategy="greedy")
    path = folder / "plan.json"
    path.write_text(p.to_json())
    return folder, path, json.loads(path.read_text())


def test_plan_emit_verify_and_export_round_trip(run_cli, tmp_path, saved_plan):
    _, plan_path, _ = saved_plan
    fused = tmp_path / "fused.onnx"
    code, out, err = run_cli("plan", "zoo:resnet18", "--device", "t4", "--strategy", "greedy", "--emit", fused)
    assert code == 0, err
    assert "outputs equal" in out
    code, out, err = run_cli("verify", "zoo:resnet18", fused, "--seed", "7")
    assert code == 0 and "equal" in out
    rebuilt = tmp_path / "rebuilt.onnx"
    code, out, err = run_cli("export", plan_path, "zoo:resnet18", "--emit", rebuilt)
    assert code == 0, err
    assert fused.read_bytes() == rebuilt.read_bytes()


def test_verify_exits_1_on_a_mismatch(run_cli, tmp_path):
    fused = tmp_path / "fused.onnx"
    assert run_cli("plan", "zoo:bert-small", "--device", "t4", "--strategy", "rules", "--emit", fused)[0] == 0
    model = onnx.load(str(fused))
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")  # the pooler, right before an output
    target = next(t for t in model.graph.initializer if t.name == gemm.input[1])
    array = numpy_helper.to_array(target) * 1.5
    target.CopyFrom(numpy_helper.from_array(array, target.name))
    broken = tmp_path / "broken.onnx"
    onnx.save(model, str(broken))
    code, out, _ = run_cli("verify", "zoo:bert-small", broken)
    assert code == 1 and "MISMATCH" in out


def _corrupt(doc: dict, how: str) -> dict:
    doc = json.loads(json.dumps(doc))
    groups = doc["groups"]
    multi = next(g for g in groups if len(g["nodes"]) >= 2)
    if how == "unknown node":
        multi["nodes"][0] = "no_such_node"
    elif how == "node in two groups":
        groups[-1]["nodes"].append(multi["nodes"][0])
    elif how == "missing node":
        multi["nodes"].pop()
    elif how == "non-convex group":
        merged = groups[0]["nodes"] + groups[2]["nodes"]  # skips the group between them
        doc["groups"] = [{**groups[0], "nodes": merged}] + [groups[1]] + groups[3:]
    elif how == "schema":
        del doc["totals"]
    return doc


@pytest.mark.parametrize(("how", "needle"), [
    ("unknown node", "no_such_node"),
    ("node in two groups", "is in groups"),
    ("missing node", "in no group"),
    ("non-convex group", "group g0"),
    ("schema", "not a fusesearch.plan/1 document"),
])
def test_corrupted_plans_are_refused(run_cli, tmp_path, saved_plan, how, needle):
    _, _, doc = saved_plan
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_corrupt(doc, how)))
    code, _, err = run_cli("export", bad, "zoo:resnet18", "--emit", tmp_path / "f.onnx")
    assert code == 2, err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "f.onnx").exists()


def test_plan_making_a_cycle_is_refused(run_cli, tmp_path):
    """p→q, r→s, p→s, r→q: groups {p, s} and {r, q} are convex but form a cycle."""
    nodes = [helper.make_node("Relu", ["x"], ["p"], name="p"), helper.make_node("Neg", ["x"], ["r"], name="r"),
             helper.make_node("Add", ["p", "r"], ["q"], name="q"), helper.make_node("Mul", ["p", "r"], ["s"], name="s")]
    path = save(make_model(nodes, [("x", [4])], [("q", None), ("s", None)]), tmp_path / "c.onnx")
    doc = json.loads(make_plan(path, device="t4", strategy="none").to_json())
    base = doc["groups"][0]
    doc["groups"] = [{**base, "id": 0, "nodes": ["p", "s"], "ops": ["Relu", "Mul"]},
                     {**base, "id": 1, "nodes": ["r", "q"], "ops": ["Neg", "Add"]}]
    bad = tmp_path / "cycle.json"
    bad.write_text(json.dumps(doc))
    code, _, err = run_cli("export", bad, path, "--emit", tmp_path / "f.onnx")
    assert code == 2 and "cycle" in err, err


class _Ids(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids = set()

    def handle_starttag(self, tag, attrs):
        self.ids.update(v for k, v in attrs if k == "id")


@pytest.mark.parametrize("model", ["zoo:resnet50", "zoo:bert-base"])
def test_svg_and_html_are_well_formed_and_name_every_group(model):
    p = make_plan(model, device="h100-sxm", strategy="greedy")
    svg = plan_svg(p, engine="python")
    root = ET.fromstring(svg)
    ids = {el.get("id") for el in root.iter() if el.get("id")}
    assert {f"g{g.id}" for g in p.groups} <= ids
    texts = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    assert "Conv" in texts or "MatMul" in texts
    page = plan_html(p, engine="python")
    parser = _Ids()
    parser.feed(page)
    assert {f"g{g.id}" for g in p.groups} <= parser.ids and {f"row-g{g.id}" for g in p.groups} <= parser.ids
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page
