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
        return (("plan", big, *PLAN, "--dim", "batch=1000000000000", "--emit", out),
                ["cannot verify", "needs", "GiB available", "--no-verify or a smaller --dim"], out)
    if kind == "verify: huge dim":
        big = save(make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [("x", ["batch", 1024])],
                              [("y", ["batch", 1024])]), tmp_path / "d.onnx")
        return (("verify", big, _copy(big), "--dim", "batch=1000000000000"),
                ["needs", "GiB available", "smaller --dim"], None)
    if kind == "measure: huge dim":
        big = save(make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [("x", ["batch", 1024])],
                              [("y", ["batch", 1024])]), tmp_path / "d.onnx")
        return (("measure", big, "--strategy", "none", "--dim", "batch=1000000000000"),
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
