"""One plan over several values of a dim (`fusesearch.buckets`): parsing, the joint legality and
costs, each bucket's price beside its own optimum, and the command line."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from onnx import helper

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
    code, out, err = run_cli("run", rows_model(tmp_path), "--dim", "n=8,32", "--backend", "emulate")
    assert code == 2 and "--backend emulate with --dim n over several values" in err and err.count("\n") == 1
