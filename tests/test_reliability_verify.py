"""Verification that does not lie and output paths that lose nothing.

The reference of every verification is the original model held in memory (so a model at an IR
version ONNX Runtime does not read still verifies, and an overwritten file cannot be compared
with itself); a model ONNX Runtime cannot load or run exits 2 with one line; `--input-value`
gives inputs their values; a fused model is written only once verified; output paths are
checked together (not the model, not twice the same, not a folder); a verification that cannot
fit in memory is refused before anything is allocated.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusesearch import verify
from fusesearch.cli import main as cli_main
from fusesearch.pipeline import prepare
from tests.conftest import make_model, save

PLAN = ("--device", "t4", "--strategy", "greedy")


def _relu_neg(**kwargs) -> onnx.ModelProto:
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"), helper.make_node("Neg", ["a"], ["y"], name="neg")]
    return make_model(nodes, [("x", [2, 3])], [("y", [2, 3])], **kwargs)


def _with_op(op: str, domain: str = "") -> onnx.ModelProto:
    """Relu → OP → Neg, where ONNX Runtime has no kernel for OP."""
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node(op, ["a"], ["b"], name="odd", domain=domain),
             helper.make_node("Neg", ["b"], ["y"], name="neg")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                              value_info=[helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 3])])
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _branch_on_rate() -> onnx.ModelProto:
    """y = -(sr == 16000 ? relu(x) : x[[5, 0]]): the else branch gathers out of bounds, as a
    voice model's branch for an unsupported sample rate fails."""
    vi = helper.make_tensor_value_info
    then = helper.make_graph([helper.make_node("Relu", ["x"], ["t"], name="then_relu")], "then", [],
                             [vi("t", TensorProto.FLOAT, [2, 3])])
    other = helper.make_graph([helper.make_node("Gather", ["x", "rows"], ["e"], name="else_gather")], "else", [],
                              [vi("e", TensorProto.FLOAT, [2, 3])])
    nodes = [helper.make_node("Equal", ["sr", "rate"], ["is_rate"], name="eq"),
             helper.make_node("If", ["is_rate"], ["o"], name="branch", then_branch=then, else_branch=other),
             helper.make_node("Neg", ["o"], ["y"], name="neg")]
    graph = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, [2, 3]), vi("sr", TensorProto.INT64, [])],
                              [vi("y", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor("rate", TensorProto.INT64, [], [16000]),
                               helper.make_tensor("rows", TensorProto.INT64, [2], [5, 0])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _ill_conditioned_bn() -> onnx.ModelProto:
    """Conv (bias 1e6) → BatchNorm (mean 1e6, var 1e-10): folding the BatchNorm into the Conv
    loses the cancellation in float32, so the fused model really differs from the original."""
    f32 = lambda a, n: (n, np.asarray(a, np.float32))  # noqa: E731
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv"),
             helper.make_node("BatchNormalization", ["c", "g", "be", "m", "v"], ["y"], name="bn", epsilon=1e-12)]
    return make_model(nodes, [("x", [1, 1, 4, 4])], [("y", [1, 1, 4, 4])],
                      [f32(np.ones((1, 1, 1, 1)), "w"), f32([1e6], "b"), f32([1.0], "g"), f32([0.0], "be"),
                       f32([1e6], "m"), f32([1e-10], "v")])


# -- one row per kind of bad input --------------------------------------------------------------

def _case(tmp_path, kind):
    """(CLI args, needles in the one stderr line, a path that must not exist afterwards)."""
    m = save(_relu_neg(), tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    if kind == "unknown op":
        m = save(_with_op("FooBar"), tmp_path / "u.onnx")
        return ("plan", m, *PLAN, "--emit", out), ["no kernel for op FooBar", "node odd", "--no-verify"], out
    if kind == "custom domain":
        m = save(_with_op("MyOp", "com.acme"), tmp_path / "c.onnx")
        return ("plan", m, *PLAN, "--emit", out), ["op MyOp (domain com.acme)", "node odd", "--no-verify"], out
    if kind == "no CPU kernel for the dtype":
        nodes = [helper.make_node("Neg", ["x"], ["a"], name="neg"), helper.make_node("Erf", ["a"], ["y"], name="erf")]
        m = save(make_model(nodes, [("x", [2, 3], TensorProto.DOUBLE)], [("y", [2, 3], TensorProto.DOUBLE)]),
                 tmp_path / "d.onnx")
        return ("plan", m, *PLAN, "--emit", out), ["no CPU kernel for op Erf", "node erf", "--no-verify"], out
    if kind == "emit over the model through a link":
        link = tmp_path / "link.onnx"
        link.symlink_to(tmp_path / "m.onnx")
        return ("plan", m, *PLAN, "--emit", link, "--force"), ["--emit", "link.onnx", "(the model)"], None
    if kind == "original fails on generated inputs":
        m = save(_branch_on_rate(), tmp_path / "b.onnx")
        return (("plan", m, *PLAN, "--emit", out),
                ["original model itself fails", "else_gather", "--input-value sr=V", "--no-verify"], out)
    if kind == "original fails on the given value":
        m = save(_branch_on_rate(), tmp_path / "b.onnx")
        return (("export", _plan_json(tmp_path, m), m, "--emit", out, "--input-value", "sr=8000"),
                ["the --input-value values", "else_gather"], out)
    if kind == "verify: original fails":
        m = save(_branch_on_rate(), tmp_path / "b.onnx")
        return ("verify", m, _copy(m)), ["original model itself fails", "--input-value"], None
    if kind == "measure: model fails":
        m = save(_branch_on_rate(), tmp_path / "b.onnx")
        return (("measure", m, "--strategy", "none", "--budget", "0.001"),
                ["the model fails in ONNX Runtime", "--input-value sr=V"], None)
    if kind == "emit over the model":
        return ("plan", m, *PLAN, "--emit", m, "--force"), ["--emit", "m.onnx", "(the model)"], None
    if kind == "emit over the model, another spelling":
        return ("plan", m, *PLAN, "--emit", tmp_path / "sub" / ".." / "m.onnx"), ["(the model)"], None
    if kind == "canonical over the model":
        return ("inspect", m, "--canonical", m, "--force"), ["--canonical", "(the model)"], None
    if kind == "export over its plan":
        plan = _plan_json(tmp_path, m)
        return ("export", plan, m, "--emit", plan, "--force"), ["--emit", "(the plan)"], None
    if kind == "measure -o over the model":
        return ("measure", m, "-o", m, "--force"), ["-o", "(the model)"], None
    if kind == "-o and --emit on one path":
        same = tmp_path / "same.out"
        return ("plan", m, *PLAN, "-o", same, "--emit", same), ["--emit", "-o writes to the same path"], same
    if kind == "--svg and --html on one path":
        same = tmp_path / "x"
        return ("plan", m, *PLAN, "--svg", same, "--html", same), ["--html", "--svg writes to the same path"], same
    if kind == "calibrate -o beside itself":
        same = tmp_path / "measurements.parquet"
        return (("calibrate", "--backend", "cpu", "-o", same),
                ["measurements.parquet", "writes to the same path"], same)
    if kind == "-o is a folder":
        return ("plan", m, *PLAN, "-o", tmp_path, "--force"), ["-o", "is a folder", "file path"], None
    if kind == "--emit is a folder":
        return ("plan", m, *PLAN, "--emit", tmp_path), ["--emit", "is a folder"], None
    if kind == "verify: the same file twice":
        return ("verify", m, m), ["is ORIGINAL itself"], None
    if kind == "huge dim":
        big = save(make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [("x", ["batch", 1024])],
                              [("y", ["batch", 1024])]), tmp_path / "d.onnx")
        return (("plan", big, *PLAN, "--dim", "batch=10000000000", "--emit", out),
                ["cannot verify", "needs", "GiB available", "--no-verify or a smaller --dim"], out)
    if kind == "verify: huge dim":
        big = save(make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [("x", ["batch", 1024])],
                              [("y", ["batch", 1024])]), tmp_path / "d.onnx")
        return (("verify", big, _copy(big), "--dim", "batch=10000000000"),
                ["needs", "GiB available", "smaller --dim"], None)
    if kind == "measure: huge dim":
        big = save(make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [("x", ["batch", 1024])],
                              [("y", ["batch", 1024])]), tmp_path / "d.onnx")
        return (("measure", big, "--strategy", "none", "--dim", "batch=10000000000"),
                ["cannot measure", "needs", "GiB available", "smaller --dim"], None)
    flag_cases = {  # --input-value rows: (flag, needles)
        "value without =": ("x", ["--input-value x:", "NAME=VALUE"]),
        "value of no input": ("sr=16000", ["--input-value sr=16000", "no input 'sr'", "inputs are x"]),
        "value not a number": ("x=abc", ["--input-value x=abc", "not a number"]),
        "value of the wrong size": ("x=[1,2,3]", ["--input-value x=[1,2,3]", "3 values", "shape 2x3"]),
    }
    if kind in flag_cases:
        flag, needles = flag_cases[kind]
        return ("plan", m, *PLAN, "--emit", out, "--input-value", flag), needles, out
    b = save(_branch_on_rate(), tmp_path / "b.onnx")
    branch_cases = {
        "value: a fraction for an int": ("sr=16000.5", ["--input-value sr=16000.5", "int64", "whole numbers"]),
        "value: out of range": ("sr=1e30", ["--input-value sr=1e30", "out of range"]),
        "value: a list for a scalar": ("sr=[1,2]", ["2 values", "is a scalar"]),
    }
    if kind in branch_cases:
        flag, needles = branch_cases[kind]
        return ("verify", b, _copy(b), "--input-value", flag), needles, None
    if kind == "value given twice":
        return (("export", _plan_json(tmp_path, b), b, "--emit", out, "--input-value", "sr=16000",
                 "--input-value", "sr=8000"), ["--input-value sr=8000", "given twice"], out)
    raise AssertionError(kind)


def _copy(path: str) -> str:
    """A byte copy of a model, standing for a fused model of it."""
    copy = path.replace(".onnx", "_copy.onnx")
    with open(path, "rb") as src, open(copy, "wb") as dst:
        dst.write(src.read())
    return copy


def _plan_json(tmp_path, model: str):
    path = tmp_path / "plan.json"
    assert cli_main(["plan", model, "--device", "t4", "--strategy", "none", "-o", str(path)]) == 0
    return path


BAD = ["unknown op", "custom domain", "no CPU kernel for the dtype", "emit over the model through a link",
       "original fails on generated inputs", "original fails on the given value",
       "verify: original fails", "measure: model fails", "emit over the model",
       "emit over the model, another spelling", "canonical over the model", "export over its plan",
       "measure -o over the model", "-o and --emit on one path", "--svg and --html on one path",
       "calibrate -o beside itself", "-o is a folder", "--emit is a folder", "verify: the same file twice",
       "huge dim", "verify: huge dim", "measure: huge dim", "value without =", "value of no input", "value not a number",
       "value of the wrong size", "value: a fraction for an int", "value: out of range",
       "value: a list for a scalar", "value given twice"]


@pytest.mark.parametrize("kind", BAD)
def test_bad_input_exits_2_with_one_line(run_cli, tmp_path, kind):
    args, needles, absent = _case(tmp_path, kind)
    before = {p: p.read_bytes() for p in tmp_path.glob("*.onnx")}
    code, _, err = run_cli(*args)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.strip().startswith("fusesearch: error: ") and "internal error" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert absent is None or not absent.exists()
    assert not list(tmp_path.glob(".*")), "a staged file was left behind"
    for path, data in before.items():  # nothing the user had is touched
        assert path.read_bytes() == data


# -- focused tests --------------------------------------------------------------------------------

def test_newest_ir_version_plans_emits_and_verifies(run_cli, tmp_path):
    """onnx's make_model writes its newest IR version, which ONNX Runtime may not read yet."""
    graph = _relu_neg().graph
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert model.ir_version == onnx.IR_VERSION
    path = save(model, tmp_path / "new.onnx")
    fused = tmp_path / "fused.onnx"
    code, out, err = run_cli("plan", path, *PLAN, "--emit", fused)
    assert code == 0 and "1 outputs equal" in out, err
    code, out, err = run_cli("verify", path, fused)
    assert code == 0 and "1 outputs equal" in out, err


@pytest.mark.parametrize("kind", ["duplicate node names", "string input"])
def test_models_that_load_verify(run_cli, tmp_path, kind):
    if kind == "duplicate node names":
        nodes = [helper.make_node("Relu", ["x"], ["a"], name="same"), helper.make_node("Neg", ["a"], ["y"], name="same")]
        model = make_model(nodes, [("x", [2, 3])], [("y", [2, 3])])
    else:
        nodes = [helper.make_node("Identity", ["s"], ["t"], name="pass"), helper.make_node("Relu", ["x"], ["y"], name="relu")]
        model = make_model(nodes, [("x", [2, 3]), ("s", [2], TensorProto.STRING)],
                           [("y", [2, 3]), ("t", [2], TensorProto.STRING)])
    path = save(model, tmp_path / "m.onnx")
    code, out, err = run_cli("plan", path, *PLAN, "--emit", tmp_path / "f.onnx")
    assert code == 0, err
    assert "verified in ONNX Runtime" in out and "equal" in out and "DIFFERENT" not in out


def test_input_value_picks_the_branch_in_every_command(run_cli, tmp_path):
    path = save(_branch_on_rate(), tmp_path / "b.onnx")
    fused = tmp_path / "f.onnx"
    code, out, err = run_cli("plan", path, *PLAN, "--emit", fused, "--input-value", "sr=16000")
    assert code == 0 and "1 outputs equal" in out, err
    code, out, err = run_cli("verify", path, fused, "--input-value", "sr=16000")
    assert code == 0 and "1 outputs equal" in out, err
    code, out, err = run_cli("export", _plan_json(tmp_path, path), path, "--emit", tmp_path / "e.onnx",
                             "--input-value", " sr = 16000 ")
    assert code == 0 and "1 outputs equal" in out, err
    code, out, err = run_cli("measure", path, "--strategy", "none", "--budget", "0.001", "--no-cache", "--json",
                             "--input-value", "sr=16000")
    assert code == 0, err


def test_input_values_take_the_inputs_dtype_and_shape(tmp_path):
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("Identity", [n], [f"{n}_out"], name=f"id_{n}") for n in ("x", "k", "flag", "word")]
    graph = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, [2, 2]), vi("k", TensorProto.INT32, [1]),
                                           vi("flag", TensorProto.BOOL, []), vi("word", TensorProto.STRING, [1])],
                              [vi(f"{n}_out", t, None) for n, t in (("x", 1), ("k", 6), ("flag", 9), ("word", 8))])
    path = save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
                tmp_path / "m.onnx")
    graph_ = prepare(path).graph
    values = verify.parse_input_values(["x=[[1, 2], [3, 4.5]]", "k=7", "flag=true", "word=hello"], graph_)
    assert values["x"].dtype == np.float32 and values["x"].tolist() == [[1, 2], [3, 4.5]]
    assert values["k"].dtype == np.int32 and values["k"].shape == (1,) and values["k"][0] == 7
    assert values["flag"].dtype == np.bool_ and values["flag"].shape == () and bool(values["flag"])
    assert values["word"].tolist() == ["hello"]
    feeds = verify.random_feeds(prepare(path, keep_original=True).original, 3, values)
    assert feeds["k"][0] == 7 and feeds["x"][1, 1] == np.float32(4.5)
    with pytest.raises(verify.BadInput, match="flag=2: input 'flag' is bool"):
        verify.parse_input_values(["flag=2"], graph_)


def test_onnx_runtime_log_lines_never_reach_the_terminal(tmp_path, capfd):
    """The original fails inside ONNX Runtime: fd 2 carries our one line and nothing of ORT's."""
    path = save(_branch_on_rate(), tmp_path / "b.onnx")
    assert cli_main(["plan", path, *PLAN, "--emit", str(tmp_path / "f.onnx")]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fusesearch: error: cannot verify"), err
    assert "onnxruntime" not in err.lower().replace("onnx runtime", ""), err


def test_emit_over_the_model_is_refused_and_the_model_kept(run_cli, tmp_path):
    """The one way a fused model could be compared with itself is writing it over the model."""
    path = save(_relu_neg(), tmp_path / "m.onnx")
    data = (tmp_path / "m.onnx").read_bytes()
    code, out, err = run_cli("plan", path, *PLAN, "--emit", path, "--force")
    assert code == 2 and "(the model)" in err and "verified" not in out
    assert (tmp_path / "m.onnx").read_bytes() == data


def test_a_fused_model_that_failed_verification_is_not_left_behind(run_cli, tmp_path):
    path = save(_ill_conditioned_bn(), tmp_path / "bn.onnx")
    fused = tmp_path / "f.onnx"
    code, out, err = run_cli("plan", path, *PLAN, "--emit", fused)
    assert code == 1 and "differs from the original, so it was not written" in err and "y" in err, err
    assert not fused.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bn.onnx"]
    code, out, err = run_cli("plan", path, *PLAN, "--emit", fused, "--no-verify")  # no "file exists"
    assert code == 0 and fused.exists(), err


def test_models_above_protobufs_limit_pass_weights_beside_the_proto(monkeypatch):
    w = np.arange(1024, dtype=np.float32).reshape(32, 32)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [("x", [2, 32])],
                       [("y", [2, 32])], [("w", w)])
    feeds = verify.random_feeds(model, 0)
    small = verify.run(model, feeds)
    monkeypatch.setattr(verify, "PROTO_LIMIT", 0)
    monkeypatch.setattr(verify, "ASIDE_MIN_BYTES", 16)
    assert np.array_equal(verify.run(model, feeds)["y"], small["y"])
    assert numpy_helper.to_array(model.graph.initializer[0]).shape == (32, 32)  # the caller's model untouched


def test_a_model_above_the_limit_is_written_with_its_weights_beside_it_and_verifies(run_cli, tmp_path, monkeypatch):
    """The > 2 GiB path, with the limit lowered: weights go beside the proto both for ONNX Runtime
    and on disk (staged and moved into place like the model)."""
    w = np.arange(1024, dtype=np.float32).reshape(32, 32) / 1024
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"), helper.make_node("Relu", ["a"], ["y"], name="relu")]
    path = save(make_model(nodes, [("x", [2, 32])], [("y", [2, 32])], [("w", w)]), tmp_path / "m.onnx")
    monkeypatch.setattr(verify, "PROTO_LIMIT", 0)
    monkeypatch.setattr(verify, "ASIDE_MIN_BYTES", 16)
    fused = tmp_path / "f.onnx"
    code, out, err = run_cli("plan", path, *PLAN, "--emit", fused)
    assert code == 0 and "1 outputs equal" in out, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.onnx", "f.onnx.data", "m.onnx"]
    code, out, err = run_cli("verify", path, fused)
    assert code == 0 and "1 outputs equal" in out, err


# -- NaN and infinities: one comparison for verify, run and measure -------------------------------

INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("ref,got,equal", [
    ([NAN, 1.0], [NAN, 1.0], True),  # NaN where ONNX Runtime has NaN
    ([INF, -INF, 2.0], [INF, -INF, 2.0], True),
    ([NAN, 1.0], [0.0, 1.0], False),  # NaN against a number, either way
    ([0.0, 1.0], [NAN, 1.0], False),
    ([INF, 1.0], [-INF, 1.0], False),
    ([INF, 1.0], [1e30, 1.0], False),
    ([INF, 1.0], [INF, 2.0], False),  # an infinity in the reference is no licence elsewhere
    ([NAN, 1.0], [NAN, 2.0], False),
])
def test_nan_equals_nan_and_nothing_else_in_every_comparison(ref, got, equal):
    ref, got = np.array(ref, np.float32), np.array(got, np.float32)
    (diff,) = verify.compare({"y": ref}, {"y": got})  # verify's, and run's per output and per step
    assert diff.ok is equal and (diff.max_abs == 0.0) is equal and (diff.max_rel == 0.0) is equal
    worst = verify.max_rel_err({"y": got}, {"y": ref})  # run's and measure's error figure
    assert (worst == 0.0) is equal and not np.isnan(worst)


def _nan_model() -> onnx.ModelProto:
    """y = sqrt(-(|x| + 1)): NaN everywhere; z = -log(0 * x): +inf everywhere."""
    nodes = [helper.make_node("Abs", ["x"], ["a"], name="abs"), helper.make_node("Add", ["a", "one"], ["b"], name="add"),
             helper.make_node("Neg", ["b"], ["c"], name="neg"), helper.make_node("Sqrt", ["c"], ["y"], name="sqrt"),
             helper.make_node("Mul", ["x", "zero"], ["m"], name="mul"), helper.make_node("Log", ["m"], ["l"], name="log"),
             helper.make_node("Neg", ["l"], ["z"], name="neg2")]
    return make_model(nodes, [("x", [2, 3])], [("y", [2, 3]), ("z", [2, 3])],
                      [("one", np.float32(1)), ("zero", np.float32(0))])


@pytest.mark.parametrize("command", ["plan --emit", "verify", "run", "run emulate", "measure"])
def test_outputs_that_are_nan_where_onnx_runtimes_are_equal(run_cli, tmp_path, command):
    import json
    import warnings

    path = save(_nan_model(), tmp_path / "nan.onnx")
    fused = tmp_path / "f.onnx"
    args = {"plan --emit": ("plan", path, *PLAN, "--emit", fused),
            "verify": ("verify", path, _copy(path)),
            "run": ("run", path, "--strategy", "greedy", "--repeat", "1", "--warmup", "0"),
            "run emulate": ("run", path, *PLAN, "--backend", "emulate"),
            "measure": ("measure", path, "--strategy", "greedy", "--budget", "0.001", "--no-cache")}[command]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "invalid value" warnings would be stray stderr lines
        code, out, err = run_cli(*args, "--json")
    assert code == 0 and not err, err
    doc = json.loads(out)
    found = [v for k, v in _walk(doc) if k in ("max_abs", "max_rel", "max_rel_err", "unfused_max_rel_err")]
    assert found and all(v == 0.0 for v in found), found


def _walk(doc):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from ([(k, v)] if not isinstance(v, dict | list) else _walk(v))
    elif isinstance(doc, list):
        for v in doc:
            yield from _walk(v)


def test_verify_names_both_shapes_of_an_output_that_differs_in_shape(run_cli, tmp_path):
    path = save(_relu_neg(), tmp_path / "m.onnx")
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"), helper.make_node("Reshape", ["a", "s"], ["y"], name="r")]
    other = save(make_model(nodes, [("x", [2, 3])], [("y", [3, 2])], [("s", np.array([3, 2], np.int64))]),
                 tmp_path / "other.onnx")
    code, out, err = run_cli("verify", path, other)
    assert code == 1, err
    assert "y: shape 3x2, expected 2x3 MISMATCH" in out and "differing: y (shape 3x2, expected 2x3)" in out, out


# -- models with external data, run from another folder -------------------------------------------

def _external_model(folder) -> str:
    """MatMul + Relu whose weight lives in m.onnx.data beside m.onnx, in `folder`."""
    folder.mkdir()
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"), helper.make_node("Relu", ["a"], ["y"], name="relu")]
    w = np.random.default_rng(0).standard_normal((32, 32)).astype(np.float32) / 8
    model = make_model(nodes, [("x", [2, 32])], [("y", [2, 32])], [("w", w)])
    onnx.save_model(model, str(folder / "m.onnx"), save_as_external_data=True, location="m.onnx.data",
                    size_threshold=0)
    assert (folder / "m.onnx.data").is_file()
    return str(folder / "m.onnx")


def _ort_outputs(path: str) -> list[np.ndarray]:
    """ONNX Runtime's outputs of the model file at `path` (its data files read beside it), on seeded x."""
    import onnxruntime as ort

    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    dtype = np.float16 if sess.get_inputs()[0].type == "tensor(float16)" else np.float32
    x = np.random.default_rng(1).standard_normal((2, 32)).astype(dtype)
    return [y.astype(np.float32) for y in sess.run(None, {"x": x})]


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.INT4], ids=["float", "int4 packed"])
def test_a_weight_left_in_its_data_file_is_read_from_it(tmp_path, dtype):
    """A weight that names its data file absolutely (as `to_proto` leaves a memory-mapped one) is
    mapped from it, or read where its bytes are packed, and equals the weight held in the proto."""
    from fusesearch.ir.canonicalize import weight_array

    values = np.arange(-4, 4).reshape(2, 4).astype(helper.tensor_dtype_to_np_dtype(dtype))
    tensor = numpy_helper.from_array(values, "w")
    model = make_model([helper.make_node("Identity", ["w"], ["y"], name="i")], [], [("y", [2, 4])], [])
    model.graph.initializer.append(tensor)
    onnx.save_model(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.onnx.data",
                    size_threshold=0)
    stored = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False).graph.initializer[0]
    location = next(e for e in stored.external_data if e.key == "location")
    location.value = str(tmp_path / location.value)
    got = weight_array(stored)
    assert isinstance(got, np.memmap) == (dtype == TensorProto.FLOAT)
    np.testing.assert_array_equal(got, numpy_helper.to_array(tensor))


@pytest.mark.parametrize("mapped", [False, True], ids=["in-memory", "memory-mapped"])
@pytest.mark.parametrize("command", ["plan --emit", "plan --emit --dtype float16", "inspect --canonical",
                                     "inspect --canonical large", "verify", "run", "run emulate"])
def test_external_data_is_read_beside_the_model_from_any_folder(run_cli, tmp_path, monkeypatch, command, mapped):
    """The weights are read from the model's folder, not the working one, whether read into memory
    or left memory-mapped in the model's data file (`mapped`: the path of models too large to read);
    the models written elsewhere hold them or carry their own data file beside them, and run from
    a third folder with ONNX Runtime's outputs on the original."""
    from fusesearch import pipeline
    from fusesearch.ir import load

    if mapped:
        monkeypatch.setattr(load, "EMBED_EXTERNAL_BYTES", 0)
    if command.endswith("large"):
        monkeypatch.setattr(pipeline, "LARGE_MODEL_BYTES", 0)
    path = _external_model(tmp_path / "model")
    for folder in ("here", "there"):
        (tmp_path / folder).mkdir()
    monkeypatch.chdir(tmp_path / "here")
    if not command.startswith("run"):
        (tmp_path / "here" / "m.onnx.data").write_bytes(b"\0" * 8192)  # an unrelated file of that name
        args = ("inspect", path, "--canonical", "out.onnx") if command.startswith("inspect") else \
            ("plan", path, *PLAN, "--emit", "out.onnx", *command.split()[2:])
        code, out, err = run_cli(*args)
        assert code == 0, err
        written = onnx.load("out.onnx", load_external_data=False)
        locations = {e.value for t in written.graph.initializer for e in t.external_data if e.key == "location"}
        assert locations <= {"out.onnx.data"}, locations  # its own data file, beside it
        if command == "verify":
            code, out, err = run_cli("verify", path, "out.onnx")
            assert code == 0 and "1 outputs equal" in out, err
        monkeypatch.chdir(tmp_path / "there")
        got, want = _ort_outputs(str(tmp_path / "here" / "out.onnx")), _ort_outputs(path)
        tol = 2e-2 if "float16" in command else 1e-5
        np.testing.assert_allclose(got[0], want[0], rtol=tol, atol=tol)
        return
    flags = ("--backend", "emulate", *PLAN) if command == "run emulate" else ("--strategy", "greedy", "--repeat",
                                                                                "1", "--warmup", "0")
    code, out, err = run_cli("run", path, *flags)
    assert code == 0 and "equal to ONNX Runtime" in out, err


@pytest.mark.parametrize("command", ["plan --emit", "inspect --canonical large"])
def test_a_data_file_in_the_way_of_the_written_weights_is_kept_unless_forced(run_cli, tmp_path, monkeypatch, command):
    """The written model's own data file is checked like the model: an existing one is overwritten
    only with --force."""
    from fusesearch import pipeline
    from fusesearch.ir import load

    monkeypatch.setattr(load, "EMBED_EXTERNAL_BYTES", 0)
    monkeypatch.setattr(pipeline, "LARGE_MODEL_BYTES", 0)
    path = _external_model(tmp_path / "model")
    out = tmp_path / "out.onnx"
    (tmp_path / "out.onnx.data").write_bytes(b"keep")
    args = ("plan", path, *PLAN, "--emit", out) if command == "plan --emit" else ("inspect", path, "--canonical", out)
    code, _, err = run_cli(*args)
    line, = err.strip().splitlines()
    assert code == 2 and not out.exists() and (tmp_path / "out.onnx.data").read_bytes() == b"keep", err
    assert line.startswith("fusesearch: error: ") and "(its weights)" in line and "--force" in line, line
    code, _, err = run_cli(*args, "--force")
    assert code == 0, err
    np.testing.assert_allclose(_ort_outputs(str(out))[0], _ort_outputs(path)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("command", ["run", "measure", "plan --emit", "inspect"])
def test_a_failing_command_prints_one_line_and_no_loader_warning_before_it(tmp_path, command):
    """The loader warns that an op is not an ONNX operator; a command that then fails prints its
    one error line only, one that succeeds prints the warning (a real process: the CLI's logging)."""
    import os
    import subprocess
    import sys

    path = save(_with_op("FooBar"), tmp_path / "u.onnx")
    args = {"run": ("run", path, "--repeat", "1", "--warmup", "0"), "measure": ("measure", path, "--no-cache"),
            "plan --emit": ("plan", path, *PLAN, "--emit", tmp_path / "f.onnx"), "inspect": ("inspect", path)}[command]
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "FUSESEARCH_CACHE": str(tmp_path / "cache")}
    env.pop("FUSESEARCH_LOG", None)
    done = subprocess.run([sys.executable, "-m", "fusesearch", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    if command == "inspect":
        assert done.returncode == 0 and len(lines) == 1 and "is not an ONNX operator" in lines[0], done.stderr
    else:
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert lines[0].startswith("fusesearch: error: ") and "odd" in lines[0], done.stderr
