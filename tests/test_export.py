"""Fused export, `verify`, `export` from plan.json (and its refusals), and the plan pictures."""

from __future__ import annotations

import json
import re
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


def _table_rows(text: str, title: str) -> list[list[str]]:
    """The body rows of the rich table printed under `title` (cells stripped)."""
    lines = text.splitlines()
    start = lines.index(title)
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("└"):
            break
        if line.startswith("│"):
            rows.append([cell.strip() for cell in line.strip("│").split("│")])
    return rows


VERIFIED = (r"verified in ONNX Runtime: 1 outputs equal \(max abs err [0-9.e+-]+, max rel err [0-9.e+-]+, "
            r"seed {seed}\)")


def _assert_fused_model_is_the_plan(path, doc: dict) -> None:
    """One node per plan group, in plan order: a lone node as itself, a fused group as a call of
    function g<id> holding exactly the group's nodes."""
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    groups = doc["groups"]
    assert len(model.graph.node) == doc["totals"]["kernels"] == len(groups)
    functions = {f.name: f for f in model.functions}
    assert len(functions) == sum(len(g["nodes"]) > 1 for g in groups)
    for node, g in zip(model.graph.node, groups, strict=True):
        if len(g["nodes"]) == 1:
            assert node.name == g["nodes"][0] and [node.op_type] == g["ops"]
        else:
            fn = functions[f"g{g['id']}"]
            assert node.op_type == fn.name and [n.name for n in fn.node] == g["nodes"]
            assert [n.op_type for n in fn.node] == g["ops"]
    assert sum(len(g["nodes"]) for g in groups) == doc["model"]["canonical_nodes"]


def test_plan_emit_verify_and_export_round_trip(run_cli, tmp_path, saved_plan):
    from fusesearch.cli import _fmt_time

    _, plan_path, doc = saved_plan
    fused, written = tmp_path / "fused.onnx", tmp_path / "plan.json"
    code, out, err = run_cli("plan", "zoo:resnet18", "--device", "t4", "--strategy", "greedy", "--emit", fused,
                             "-o", written)
    assert code == 0, err
    assert written.read_text() == plan_path.read_text()  # the CLI writes the plan the API makes, byte for byte
    t = doc["totals"]
    lines = out.splitlines()
    assert lines[0].startswith("resnet18 on t4, strategy greedy (HEURISTIC; ")
    for piece in (f"kernels {t['kernels']} (canonical nodes {doc['model']['canonical_nodes']})",
                  f"predicted {_fmt_time(t['time_s'])}", f"unfused {_fmt_time(t['unfused_time_s'])}",
                  f"speedup {t['unfused_time_s'] / t['time_s']:.2f}x", f"lower bound {_fmt_time(t['lower_bound_s'])}"):
        assert piece in lines[1], (piece, lines[1])
    assert t["kernels"] == 23 and doc["model"]["canonical_nodes"] == 49  # the convs absorb their Relus/Sums; on the T4 a lone 1x1 conv priced as our tile, not the library
    rows = _table_rows(out, "slowest kernels")
    by_id = {f"g{g['id']}": g for g in doc["groups"]}
    assert len(rows) == 10
    for group, template, ops, runs, time, bound, occupancy in rows:
        g = by_id[group]
        assert (template, ops, time, bound, occupancy) == (g["template"], "+".join(g["ops"]), _fmt_time(g["time_s"]),
                                                          g["bound"], f"{g['occupancy']:.2f}")
        assert runs == ("alias" if g["impl"] == "alias" else f"{g['impl']} ({g['compute_unit']})")
    listed = [by_id[r[0]]["time_s"] for r in rows]
    assert listed == sorted(listed, reverse=True)
    assert all(g["time_s"] <= listed[-1] for k, g in by_id.items() if k not in {r[0] for r in rows})
    assert f"plan written to {written}" in lines and f"fused model written to {fused}" in lines
    assert re.fullmatch(VERIFIED.format(seed=0), lines[-1]), lines[-1]
    _assert_fused_model_is_the_plan(fused, doc)

    code, out, err = run_cli("verify", "zoo:resnet18", fused, "--seed", "7")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2 and re.fullmatch(r"logits: max abs err [0-9.e+-]+, max rel err [0-9.e+-]+ ok", lines[0])
    assert re.fullmatch(VERIFIED.format(seed=7), lines[1]), lines[1]

    rebuilt = tmp_path / "rebuilt.onnx"
    code, out, err = run_cli("export", plan_path, "zoo:resnet18", "--emit", rebuilt)
    assert code == 0, err
    functions = sum(len(g["nodes"]) > 1 for g in doc["groups"])
    assert out.splitlines()[0] == f"fused model written to {rebuilt} ({t['kernels']} nodes, {functions} functions)"
    assert re.fullmatch(VERIFIED.format(seed=0), out.splitlines()[1])
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
    assert code == 1
    *per_output, verdict = out.splitlines()
    names = [vi.name for vi in model.graph.output]
    assert [line.split(":")[0] for line in per_output] == names
    bad = [line.split(":")[0] for line in per_output if line.endswith(" MISMATCH")]
    assert bad and all(line.endswith(" ok") for line in per_output if line.split(":")[0] not in bad)
    assert verdict.startswith(f"verified in ONNX Runtime: {len(names)} outputs DIFFERENT (")
    assert verdict.endswith(f"; differing: {', '.join(bad)}")


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


class _Rows(HTMLParser):
    """Every element id, and the cell texts of each table row that has an id."""

    def __init__(self):
        super().__init__()
        self.ids, self.rows, self._row, self._cell = set(), {}, None, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "tr" and "id" in attrs:
            self._row = self.rows.setdefault(attrs["id"], [])
        elif tag == "td" and self._row is not None:
            self._cell = ""

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self._row.append(self._cell)
            self._cell = None
        elif tag == "tr":
            self._row = None


@pytest.mark.parametrize("model", ["zoo:resnet50", "zoo:bert-base"])
def test_svg_and_html_are_well_formed_and_name_every_group(model):
    from fusesearch.pictures import MAX_OPS_CHARS

    p = make_plan(model, device="h100-sxm", strategy="greedy")
    svg = plan_svg(p, engine="python")
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    boxes = {el.get("id"): el for el in root.iter(f"{ns}g") if (el.get("class") or "").startswith("group ")}
    assert set(boxes) == {f"g{g.id}" for g in p.groups}
    for g in p.groups:
        template = "alias" if g.kernel.alias else g.kernel.template
        ops = "+".join(p.graph.nodes[i].op_type for i in g.nodes)
        box = boxes[f"g{g.id}"]
        assert box.get("class") == f"group {template}"
        head, label, _badge = (t.text for t in box.iter(f"{ns}text"))
        assert head.startswith(f"g{g.id} · {template} · ")
        assert label == ops if len(ops) <= MAX_OPS_CHARS else label == ops[:MAX_OPS_CHARS - 1] + "…"
    page = plan_html(p, engine="python")
    parser = _Rows()
    parser.feed(page)
    assert {f"g{g.id}" for g in p.groups} <= parser.ids and set(parser.rows) == {f"row-g{g.id}" for g in p.groups}
    seen = []
    for g in p.groups:
        cells = parser.rows[f"row-g{g.id}"]
        names = [p.graph.nodes[i].name for i in g.nodes]
        assert cells[0] == f"g{g.id}" and cells[5] == "+".join(p.graph.nodes[i].op_type for i in g.nodes)
        assert cells[6] == ", ".join(names)
        seen += names
    assert sorted(seen) == sorted(n.name for n in p.graph.nodes)  # the table lists every node exactly once
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page


def test_the_legend_fits_inside_a_narrow_picture(tmp_path):
    """A plan one box wide: the picture widens to its legend, so the bound key is not cut off
    (each character counted at 0.6 em of the 11 px font, wider than the average glyph)."""
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("MatMul", ["a", "w"], ["y"])]
    model = make_model(nodes, [("x", [4, 4])], [("y", None)], [("w", np.eye(4, dtype=np.float32))])
    p = make_plan(save(model, tmp_path / "m.onnx"), device="t4", strategy="none")
    root = ET.fromstring(plan_svg(p, engine="python"))
    ns = "{http://www.w3.org/2000/svg}"
    width = float(root.get("width"))
    (legend,) = [g for g in root.iter(f"{ns}g") if g.get("id") == "legend"]
    texts = list(legend.iter(f"{ns}text"))
    assert texts[-1].text.startswith("bound: ")
    assert all(float(t.get("x")) + len(t.text) * 0.6 * 11 <= width for t in texts), width
    assert root.get("viewBox") == f"0 0 {root.get('width')} {root.get('height')}"
