"""One plan over several values of a dim (`fusesearch.buckets`): parsing, the joint legality and
costs, each bucket's price beside its own optimum, and the command line."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from onnx import helper

from fusesearch.backends import emulate
from fusesearch.buckets import Buckets, split_dims
from fusesearch.errors import BadInput
from tests.conftest import make_model, save


def rows_model(tmp_path) -> str:
    """x (n x 64) @ W, + b, GELU-ish tail and a row Softmax: rows grow with the dynamic dim n."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["r"]), helper.make_node("MatMul", ["r", "W2"], ["m2"]),
             helper.make_node("Softmax", ["m2"], ["y"], axis=-1)]
    inits = [("W", rng.standard_normal((64, 64)).astype(np.float32)), ("b", np.zeros(64, np.float32)),
             ("W2", rng.standard_normal((64, 256)).astype(np.float32))]
    return save(make_model(nodes, [("x", ["n", 64])], [("y", None)], inits), tmp_path / "rows.onnx")


@pytest.mark.parametrize(("flags", "values"), [
    (["n=16..512"], (16, 32, 64, 128, 256, 512)),
    (["n=10..100"], (10, 16, 32, 64, 100)),
    (["n=32,128,512"], (32, 128, 512)),
])
def test_ranges_and_lists_give_buckets(flags, values):
    fixed, buckets = split_dims([*flags, "batch=2"])
    assert fixed == ["batch=2"] and buckets.dim == "n" and buckets.values == values
    assert buckets.weights == pytest.approx([1 / len(values)] * len(values))


def test_weights_are_normalised_and_the_heaviest_bucket_is_named():
    _, buckets = split_dims(["seq=32,128,512"], ["seq=2,5,3"])
    assert buckets.weights == pytest.approx((0.2, 0.5, 0.3)) and buckets.heaviest == 1


@pytest.mark.parametrize(("dims", "weights", "says"), [
    (["seq=512..16"], [], "--dim seq=512..16: the range must go up"),
    (["seq=0..16"], [], "--dim seq=0..16: the range must go up from a positive value"),
    (["seq=a..b"], [], "--dim seq=a..b: not a range or a list of integers"),
    (["seq=64,32"], [], "--dim seq=64,32: values must be positive, distinct and ascending"),
    (["seq=1..1000000"], [], "--dim seq=1..1000000: 21 buckets, at most 16"),
    (["seq=16..64", "batch=1,2"], [], "--dim seq and --dim batch both give several values"),
    (["seq=16..64"], ["seq=1,2"], "--dim-weights seq=1,2: give 3 non-negative numbers"),
    (["seq=16..64"], ["seq=0,0,0"], "not all 0"),
    (["seq=16"], ["seq=1"], "--dim-weights seq: 'seq' is not a dim given as a range or list"),
])
def test_bad_ranges_name_the_dim(dims, weights, says):
    with pytest.raises(BadInput, match=re.escape(says)):
        split_dims(dims, weights)


def test_one_plan_prices_every_bucket_and_the_served_one_pays_nothing(tmp_path, run_cli):
    path = rows_model(tmp_path)
    code, out, err = run_cli("plan", path, "--device", "h100-sxm", "--dim", "n=16,4096", "--dim-weights", "n=0,1",
                             "--json")
    assert code == 0, err
    doc = json.loads(out)
    b = doc["buckets"]
    assert b["dim"] == "n" and b["values"] == [16, 4096] and b["weights"] == [0.0, 1.0]
    small, large = b["figures"]
    assert large["price"] == pytest.approx(1.0, abs=1e-6)  # all the weight: its own optimum
    assert small["price"] >= 1.0 - 1e-6  # the one plan never beats a bucket's own optimum
    # the plan's time is the weighted sum of the buckets' times
    assert doc["totals"]["time_s"] == pytest.approx(sum(w * f["time_s"] for w, f in zip(b["weights"], b["figures"],
                                                                                       strict=True)), rel=1e-5)


def test_the_one_plan_is_the_weighted_optimum_and_deterministic(tmp_path, run_cli):
    path = rows_model(tmp_path)
    args = ("plan", path, "--device", "h100-sxm", "--dim", "n=16..4096", "--strategy", "cpsat")
    code, out, err = run_cli(*args, "-o", tmp_path / "a.json")
    assert code == 0, err
    assert "price of one plan" in out and "worst bucket n=" in out
    code, _, err = run_cli(*args, "-o", tmp_path / "b.json")
    assert code == 0, err
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    doc = json.loads((tmp_path / "a.json").read_text())
    figures = doc["buckets"]["figures"]
    assert [f["value"] for f in figures] == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert doc["solver"]["status"] == "OPTIMAL"
    assert doc["totals"]["time_s"] == pytest.approx(sum(f["weight"] * f["time_s"] for f in figures), rel=1e-5)
    # the one plan is the weighted optimum: no bucket's own plan, served at every bucket, beats it
    served = [f["own_weighted_s"] for f in figures if f["own_weighted_s"] is not None]
    assert served and all(s >= doc["totals"]["time_s"] * (1 - 1e-6) for s in served)


def test_the_plan_schema_takes_the_buckets(tmp_path, run_cli):
    import jsonschema

    from fusesearch.plans import plan_schema

    code, out, err = run_cli("plan", rows_model(tmp_path), "--device", "host", "--dim", "n=8,64", "--json")
    assert code == 0, err
    doc = json.loads(out)
    doc.pop("run")
    jsonschema.validate(doc, plan_schema())


@pytest.mark.parametrize(("extra", "says"), [
    (["--explain"], "--explain with --dim n over several values"),
    (["--costs", "measured"], "--costs measured with --dim n over several values"),
])
def test_what_a_bucketed_plan_cannot_do_exits_2(tmp_path, run_cli, extra, says):
    code, out, err = run_cli("plan", rows_model(tmp_path), "--device", "h100-sxm", "--dim", "n=8,64", *extra)
    assert code == 2 and err.startswith(f"fusesearch: error: {says}") and err.count("\n") == 1


def test_buckets_whose_graphs_differ_are_refused(tmp_path):
    from fusesearch.buckets import check_same_graph
    from fusesearch.pipeline import prepare

    graphs = [prepare(save(make_model([helper.make_node(op, ["x"], ["y"])], [("x", [4])], [("y", None)]),
                           tmp_path / f"{op}.onnx"), None).graph for op in ("Relu", "Sigmoid")]
    with pytest.raises(BadInput, match=r"^--dim n: at n=8 the canonical graph differs from n=1 \(node"):
        check_same_graph(graphs, Buckets("n", (1, 8), (0.5, 0.5)))


def test_buckets_type_reports_itself():
    assert Buckets("n", (8, 64), (0.5, 0.5)).to_dict() == {"dim": "n", "values": [8, 64], "weights": [0.5, 0.5]}


def shape_chain_model(tmp_path, scaled: bool = False) -> str:
    """x (n x 8): reshaped through targets read from its Shape, plus rows of a position table sliced
    to n (a folded constant per bucket); `scaled`: times 1/n, a constant no rule generalizes."""
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Slice", ["s", "zero", "one"], ["n1"]),
             helper.make_node("Concat", ["n1", "tail"], ["t"], axis=0),
             helper.make_node("Reshape", ["x", "t"], ["r"]),
             helper.make_node("Relu", ["r"], ["rr"]),
             helper.make_node("Reshape", ["rr", "s"], ["back"]),
             helper.make_node("Slice", ["table", "zero", "n1", "zero"], ["pos"]),
             helper.make_node("Add", ["back", "pos"], ["y0"])]
    if scaled:
        nodes += [helper.make_node("Cast", ["n1"], ["nf"], to=1), helper.make_node("Div", ["y0", "nf"], ["y"])]
    else:
        nodes += [helper.make_node("Sigmoid", ["y0"], ["y"])]
    table = np.random.default_rng(1).standard_normal((64, 8)).astype(np.float32)
    inits = [("zero", i64(0)), ("one", i64(1)), ("tail", i64(2, 4)), ("table", table)]
    return save(make_model(nodes, [("x", ["n", 8])], [("y", None)], inits), tmp_path / f"chain{int(scaled)}.onnx")


def test_a_bucketed_plan_emits_one_fused_model_that_keeps_the_dim(tmp_path, run_cli):
    import onnx
    import onnxruntime as ort

    path = shape_chain_model(tmp_path)
    code, out, err = run_cli("plan", path, "--device", "h100-sxm", "--dim", "n=4..32", "--emit", tmp_path / "f.onnx",
                             "--json")
    assert code == 0, err
    checked = [r["at"] for r in json.loads(out)["run"]["verified"]]
    assert {4, 32} <= set(checked) and len(checked) == 4 and all(r["ok"] for r in json.loads(out)["run"]["verified"])
    fused = onnx.load(str(tmp_path / "f.onnx"))
    assert fused.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "n"
    assert any(f.domain == "fusesearch" for f in fused.functions)
    sess = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"])
    table = onnx.numpy_helper.to_array(next(t for t in onnx.load(path).graph.initializer if t.name == "table"))
    for n in (5, 17, 32):  # values that are no bucket too
        x = np.random.default_rng(n).standard_normal((n, 8)).astype(np.float32)
        want = 1 / (1 + np.exp(-(np.maximum(x, 0) + table[:n])))
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6)


def test_a_constant_no_rule_keeps_dynamic_is_refused_by_name(tmp_path, run_cli):
    code, out, err = run_cli("plan", shape_chain_model(tmp_path, scaled=True), "--device", "h100-sxm",
                             "--dim", "n=4..32", "--emit", tmp_path / "f.onnx")
    assert code == 2 and err.count("\n") == 1, err
    assert "--dim n: constant 'nf' (read by Div" in err and "give --dim n one value" in err
    assert not (tmp_path / "f.onnx").exists()


def test_run_over_buckets_runs_each_buckets_program_beside_onnx_runtime(tmp_path, run_cli):
    code, out, err = run_cli("run", rows_model(tmp_path), "--dim", "n=8,32", "--repeat", "2", "--warmup", "0", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [r["n"] for r in doc["runs"]] == [8, 32] and doc["buckets"]["values"] == [8, 32]
    for run in doc["runs"]:
        assert run["max_rel_err"] <= 1e-4
        assert {"plan", "unfused", "ort_enable_all"} <= set(run) and run["ratios"]["plan_vs_ort_enable_all"] > 0
    # one grouping: every bucket's program has the plan's kernels
    assert len({r["kernels"] for r in doc["runs"]}) == 1


def test_run_over_buckets_refuses_what_it_cannot_do(tmp_path, run_cli):
    code, out, err = run_cli("run", rows_model(tmp_path), "--dim", "n=8,32", "--backend", "emulate", "--input-value",
                             "x=1")
    assert code == 2 and "--input-value with --dim n over several values" in err and err.count("\n") == 1


# -- how the best plan changes across buckets: plan.json, the CLI table, sweeps and their report --

def test_plan_changes_between_neighbouring_buckets_name_the_groups_and_their_worth():
    from fusesearch.buckets import BucketFigure, plan_changes

    figures = [BucketFigure(1, 0.5, 2.0, 1.0, 3, own_groups=("a+b", "c+d")),
               BucketFigure(2, 0.25, 2.0, 2.0, 2, own_groups=("a+b", "c+d+e"), previous_price=1.25),
               BucketFigure(4, 0.25, 2.0, 2.0, 2, own_groups=("a+b", "c+d+e"), previous_price=1.0)]
    first, second = plan_changes(figures)
    assert (first.low, first.high, first.gone, first.new, first.kept) == (1, 2, ("c+d",), ("c+d+e",), 1)
    assert first.price == 1.25 and first.distance == pytest.approx(2 / 3)
    assert (second.gone, second.new, second.distance, second.price) == ((), (), 0.0, 1.0)


def test_a_ranged_plan_says_where_each_buckets_own_plan_changes_and_by_how_much(tmp_path, run_cli):
    """On an H100 the rows model's best grouping at n=1 differs from n=2's (a GEMM too small to pay
    for fusing past it), and is the same from n=2 to n=4: the change names the groups, and n=1's
    plan served at n=2 costs more than n=2's own; no change costs nothing."""
    code, out, err = run_cli("plan", rows_model(tmp_path), "--device", "h100-sxm", "--dim", "n=1,2,4", "--json")
    assert code == 0, err
    b = json.loads(out)["buckets"]
    figures, changes = b["figures"], b["changes"]
    assert [(c["low"], c["high"]) for c in changes] == [(1, 2), (2, 4)]
    for low, high, change in zip(figures, figures[1:], changes, strict=False):
        assert set(change["gone"]) == set(low["own_groups"]) - set(high["own_groups"])
        assert set(change["new"]) == set(high["own_groups"]) - set(low["own_groups"])
        assert change["price"] == high["previous_price"]
    moved, kept = changes
    assert moved["gone"] and moved["new"] and moved["price"] > 1.01  # each own plan is its bucket's optimum
    assert not kept["gone"] and not kept["new"] and kept["price"] == 1.0 and kept["distance"] == 0.0
    assert figures[0]["previous_price"] is None
    code, text, err = run_cli("plan", rows_model(tmp_path), "--device", "h100-sxm", "--dim", "n=1,2,4")
    assert code == 0, err
    assert "own plan vs the one below" in text and f"+{len(moved['new'])} / -{len(moved['gone'])} groups" in text
    assert "same groups" in text


BUCKET_SWEEP = """
name = "buckets"
devices = ["h100-sxm", "host"]
strategies = ["greedy", "cpsat"]
[[models]]
model = "rows.onnx"
buckets = {{ n = {buckets} }}
{extra}
[params]
time_limit_s = 5
"""


def _bucket_config(tmp_path, buckets='"1..4"', extra=""):
    rows_model(tmp_path)
    path = tmp_path / "sweep.toml"
    path.write_text(BUCKET_SWEEP.format(buckets=buckets, extra=extra))
    return path


def test_a_bucket_axis_expands_into_one_model_per_range(tmp_path):
    from fusesearch.sweep import expand, load_config

    cfg = load_config(_bucket_config(tmp_path, '["1..4", "2,3,4"]', "bucket_weights = { n = [1, 1, 2] }"))
    assert [(m.label, m.buckets.values) for m in cfg.models] == [("rows/n=1,2,4", (1, 2, 4)),
                                                                  ("rows/n=2,3,4", (2, 3, 4))]
    assert cfg.models[0].buckets.weights == pytest.approx((0.25, 0.25, 0.5))
    cells = expand(cfg)
    assert len(cells) == 2 * 2 * 2 and len({c.cell_id for c in cells}) == len(cells)
    assert cells[0].model.key()["buckets"] == {"dim": "n", "values": [1, 2, 4], "weights": [0.25, 0.25, 0.5]}


@pytest.mark.parametrize(("buckets", "extra", "says"), [
    ('"4..1"', "", 'models[0]: buckets.n = "4..1": the range must go up from a positive value; give '
                   'buckets.n = "LO..HI"'),
    ('"4"', "", 'buckets.n = "4" is one value; give a range "LO..HI"'),
    ('["1..4", "1..4"]', "", "buckets.n lists the same values twice"),
    ('"1..4"', "bucket_weights = { n = [1, 2] }", "bucket_weights.n = [1,2]: give 3 non-negative numbers, one per "
                                                  "bucket of buckets.n"),
    ('"1..4"', "bucket_weights = { m = [1, 2, 3] }", "bucket_weights = {'m': [1, 2, 3]}; give bucket_weights = "
                                                     "{ n = [W1, W2, ...] }"),
    ('"1..4"', "dims = { n = 2 }", "dims.n and buckets.n both bind n"),
    ('"1..4"', "label = \"r\"\n[[models]]\nmodel = \"rows.onnx\"\nbuckets = { m = \"1..4\" }",
     "rows.onnx: input 'x' has unbound dynamic dim 0 'n'; bind it with dims = { n = V } in models[1]"),
])
def test_bad_bucket_axes_name_the_file_and_key(tmp_path, buckets, extra, says):
    from fusesearch.sweep import load_config

    path = _bucket_config(tmp_path, buckets, extra)
    with pytest.raises(BadInput) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: ") and says in str(err.value), str(err.value)


@pytest.mark.parametrize(("top", "says"), [
    ('backend = "cpu"', "models[0].buckets with backend = 'cpu': a sweep over buckets plans with predicted costs "
                        "only; remove backend"),
    ('costs = "measured"', "models[0].buckets with costs = 'measured'"),
])
def test_what_a_sweep_over_buckets_cannot_do_is_refused_by_key(tmp_path, top, says):
    from fusesearch.sweep import load_config

    path = _bucket_config(tmp_path)
    path.write_text(top + "\n" + path.read_text())
    with pytest.raises(BadInput, match=re.escape(says)):
        load_config(path)


def test_a_bucket_cell_records_each_buckets_figures_and_the_changes(tmp_path):
    from fusesearch.sweep import expand, load_config, run_cell

    cells = expand(load_config(_bucket_config(tmp_path, '"1..4"')))
    row = run_cell(next(c for c in cells if c.device_label == "h100-sxm" and c.strategy == "cpsat"))
    assert row["status"] == "ok", row["error"]
    figures, changes = json.loads(row["bucket_figures"]), json.loads(row["bucket_changes"])
    assert row["bucket_dim"] == "n" and json.loads(row["bucket_values"]) == [1, 2, 4]
    assert row["time_s"] == pytest.approx(sum(f["weight"] * f["time_s"] for f in figures), rel=1e-5)
    assert [(c["low"], c["high"]) for c in changes] == [(1, 2), (2, 4)] and changes[0]["new"]
    worst = max(figures, key=lambda f: f["price"])
    assert row["worst_bucket"] == worst["value"] and row["worst_bucket_price"] == pytest.approx(worst["price"], rel=1e-5)
    assert row["shapes"] == "n=1,2,4"


def test_a_sweep_over_buckets_reports_where_the_best_plan_changes(tmp_path, run_cli):
    path = _bucket_config(tmp_path, '"1..4"')
    code, out, err = run_cli("sweep", path, "--workers", "1", "--out", tmp_path / "out", "--json")
    assert code == 0, err
    assert json.loads(out)["failed"] == 0
    code, out, err = run_cli("report", tmp_path / "out")
    assert code == 0, err
    report = (tmp_path / "out" / "report.md").read_text()
    section = report.split("## How the best plan changes across buckets")[1]
    assert "### rows/n=1,2,4 on h100-sxm, cpsat" in section and "### rows/n=1,2,4 on host, greedy" in section
    assert "| n=1 |" in section and "| n=4 |" in section and "same groups" in section
    assert "- n 1 → 2: new `" in section and "Worst bucket n=" in section


def test_the_joint_search_leaves_each_bucket_its_twins_for_its_own_search(tmp_path):
    """Pricing a group at every bucket fills each bucket's memo of twins, so each bucket's own
    search (the price of one plan) lowers few groups anew: none at the heaviest bucket (asked
    first), at another only those the heaviest refused (or that grow from them)."""
    from costmodels import RooflineModel
    from fusesearch import zoo
    from fusesearch.api import for_device, resolve_device
    from fusesearch.buckets import BucketLegality
    from fusesearch.candidates.enumerate import enumerate_candidates
    from fusesearch.ir.shapes import ShapeBindings
    from fusesearch.pipeline import prepare
    from fusesearch.search import SearchConfig, SearchProblem

    path = save(zoo.build_model("bert-small", layers=2), tmp_path / "bert.onnx")
    _, spec, params, _ = resolve_device("h100-sxm", 1)
    buckets = Buckets("seq", (8, 64), (0.5, 0.5))

    def problems():
        out = []
        for v in buckets.values:
            prep, p = for_device(prepare(path, ShapeBindings.parse([], [f"seq={v}", "batch=1"])), spec, params)
            out.append(SearchProblem.build(prep.graph, spec, RooflineModel(p), SearchConfig(workers=1)))
        return out

    fresh = problems()
    alone = [len(enumerate_candidates(p.legality).groups) for p in fresh]
    fresh_lowered = [p.legality.evaluated for p in fresh]
    shared = problems()
    enumerate_candidates(BucketLegality.over([p.legality for p in shared], buckets))
    before = [p.legality.evaluated for p in shared]
    after = [len(enumerate_candidates(p.legality).groups) for p in shared]
    anew = [p.legality.evaluated - b for p, b in zip(shared, before, strict=True)]
    assert after == alone  # the same candidates as a search of that bucket alone
    assert anew[0] == 0 and anew[1] * 2 < fresh_lowered[1], (anew, fresh_lowered)


@pytest.mark.parametrize("device", ["host", "h100-sxm", "h200"])
def test_a_ranged_plan_on_every_kind_of_device(tmp_path, run_cli, device):
    code, out, err = run_cli("plan", rows_model(tmp_path), "--device", device, "--dim", "n=8..64", "--strategy",
                             "greedy", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["device"]["name"] == device
    b = doc["buckets"]
    assert [f["value"] for f in b["figures"]] == [8, 16, 32, 64] and len(b["changes"]) == 3
    assert doc["totals"]["time_s"] == pytest.approx(sum(w * f["time_s"] for w, f in zip(b["weights"], b["figures"],
                                                                                       strict=True)), rel=1e-5)


def _bench_buckets():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_buckets.py"
    spec = importlib.util.spec_from_file_location("bench_buckets", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _bucket_kernels(path: str, values) -> list[list]:
    """Each bucket's generated kernels of one host plan over `values` of n, in plan order."""
    from fusesearch.buckets import bucket_programs, plan_buckets
    from fusesearch.ir.shapes import ShapeBindings
    from fusesearch.pipeline import prepare
    from fusesearch.run import plan_steps
    from fusesearch.search import SearchConfig

    buckets = Buckets("n", tuple(values), tuple(1 / len(values) for _ in values))
    preps = [prepare(path, ShapeBindings.parse([], [f"n={v}"])) for v in values]
    plan, _, problems = plan_buckets(preps, buckets, "host", "greedy", SearchConfig(workers=1))
    return [[s.kernel for s in plan_steps(prep.graph, ours) if s.kernel is not None]
            for prep, ours, _ in bucket_programs(problems, plan, "host")]


def test_a_rows_kernel_differs_between_buckets_only_in_its_row_count_and_runs_it_read_at_run_time(tmp_path):
    """bench_buckets' measure of what a dynamic row count costs: a pointwise-and-rowwise group's
    sources at two buckets differ only in the row count, a GEMM group's do not; with the count read
    from a global at run time the kernel computes the same outputs."""
    from fusesearch.backends import cpu

    bench = _bench_buckets()
    nodes = [helper.make_node("Add", ["x", "b"], ["a"]), helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Softmax", ["r"], ["y"], axis=-1)]
    path = save(make_model(nodes, [("x", ["n", 64])], [("y", None)], [("b", np.ones(64, np.float32))]),
                tmp_path / "softmax.onnx")
    low, high = _bucket_kernels(path, (8, 64))
    assert bench.row_bound_only([k.c_source for k in low], [k.c_source for k in high]) == list(range(len(high)))
    kernel = high[0]
    dynamic = kernel.with_c_source(bench.rows_at_run_time(kernel.c_source))
    assert "fs_rows_0" in dynamic.c_source and dynamic.source_hash != kernel.source_hash
    x = {"x": np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), "b": np.ones(64, np.float32)}
    feeds = {a.tensor: x[a.tensor] for a in kernel.inputs}
    assert all(np.array_equal(cpu.run(kernel, feeds)[t], v) for t, v in cpu.run(dynamic, feeds).items())
    gemm_low, gemm_high = _bucket_kernels(rows_model(tmp_path), (8, 64))
    assert bench.row_bound_only([k.c_source for k in gemm_low], [k.c_source for k in gemm_high]) == []


# -- each bucket's CUDA program: through the emulator here, on the GPU with cupy --------------------

needs_emulator = pytest.mark.skipif(not emulate.available(), reason="no C++ compiler for the CUDA emulator")


@needs_emulator
def test_run_over_buckets_checks_each_buckets_cuda_program_through_the_emulator(tmp_path, run_cli):
    code, out, err = run_cli("run", rows_model(tmp_path), "--dim", "n=4,8,16", "--backend", "emulate", "--strategy",
                             "greedy", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["buckets"]["values"] == [4, 8, 16] and [r["n"] for r in doc["runs"]] == [4, 8, 16]
    for run in doc["runs"]:
        assert run["backend"] == "emulate" and run["max_rel_err"] <= run["rtol"] == 1e-4
        assert "plan" not in run and "median_s" not in json.dumps(run)  # checked, not timed
    assert len({r["kernels"] for r in doc["runs"]}) == 1  # one grouping
    # the arena grows with the rows: each bucket's program is specialized to its own shapes
    assert [r["arena_peak_bytes"] for r in doc["runs"]] == sorted({r["arena_peak_bytes"] for r in doc["runs"]})
    code, text, err = run_cli("run", rows_model(tmp_path), "--dim", "n=4,8,16", "--backend", "emulate", "--strategy",
                              "greedy")
    assert code == 0, err
    assert "through the CUDA emulator" in text and "correctness only, not timed" in text and "median" not in text
    assert "every bucket's CUDA program equals ONNX Runtime" in text


@needs_emulator
def test_a_bucket_run_with_another_buckets_kernels_is_caught_and_named(tmp_path, run_cli, monkeypatch):
    """The dispatcher's failure: the bucket n=16 given the kernels specialized to n=4 computes only
    4 rows; the check against ONNX Runtime refuses it (exit 1) and names the bucket."""
    import dataclasses
    import importlib

    run_module = importlib.import_module("fusesearch.run")  # the module, not the package's `run`
    real, first = run_module.plan_steps, []

    def steps_of_the_first_bucket(graph, plan):
        steps = real(graph, plan)
        first.append(first[0] if first else steps)
        return [dataclasses.replace(s, kernel=t.kernel) if s.kernel is not None else s
                for s, t in zip(steps, first[0], strict=True)]

    monkeypatch.setattr(run_module, "plan_steps", steps_of_the_first_bucket)
    code, out, err = run_cli("run", rows_model(tmp_path), "--dim", "n=4,16", "--backend", "emulate", "--strategy",
                             "greedy")
    assert code == 1 and out == ""
    line, = err.strip().splitlines()
    assert line.startswith("fusesearch: error: at n=16: the plan (CUDA, emulated) program differs from ONNX Runtime")


@pytest.mark.gpu
def test_run_over_buckets_times_each_buckets_cuda_program_on_the_gpu(tmp_path, run_cli):
    code, out, err = run_cli("run", rows_model(tmp_path), "--dim", "n=8,32", "--backend", "cupy", "--strategy",
                             "greedy", "--repeat", "3", "--warmup", "1", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [r["n"] for r in doc["runs"]] == [8, 32]
    for run in doc["runs"]:
        assert run["backend"] == "cupy" and run["max_rel_err"] <= run["rtol"]
        for key in ("plan", "unfused", "ort_enable_all"):
            assert 0 < run[key]["p20_s"] <= run[key]["median_s"] <= run[key]["p80_s"], (key, run[key])
