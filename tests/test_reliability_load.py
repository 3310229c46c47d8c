"""Loading real exports and refusing broken models: exit 0 where ONNX Runtime runs the model, exit 2
and one line naming the tensor, node, file or flag where it cannot; every --json is valid JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from tests.conftest import make_model, save

DEVICE = "h100-sxm"


def one_line_error(code, err, *needles):
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("fusesearch: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def strict_json(text: str):
    """json.loads that refuses Infinity/NaN, which are not JSON."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def ort_run(model: onnx.ModelProto | str, feeds: dict) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    source = model if isinstance(model, str) else model.SerializeToString()
    sess = ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


# -- classic model-zoo CNNs: opset 9, IR 3, weights also listed as inputs --------------------------

def zoo_cnn_opset9() -> onnx.ModelProto:
    """Conv -> Mul(Unsqueeze(scale)) -> Add(Unsqueeze(bias)) -> Relu, as DenseNet-121 and
    Inception-v2 ship: every initializer is a graph input too, Unsqueeze takes `axes` as attribute."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "W"),
               numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "scale"),
               numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "bias")]
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Unsqueeze", ["scale"], ["scale_u"], axes=[1, 2], name="unsq_scale"),
             helper.make_node("Mul", ["c", "scale_u"], ["m"], name="mul"),
             helper.make_node("Unsqueeze", ["bias"], ["bias_u"], axes=[1, 2], name="unsq_bias"),
             helper.make_node("Add", ["m", "bias_u"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["y"], name="relu")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])]
    inputs += [helper.make_tensor_value_info(w.name, TensorProto.FLOAT, list(w.dims)) for w in weights]
    graph = helper.make_graph(nodes, "zoo_cnn", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], ir_version=3)


def test_opset9_weights_listed_as_inputs_inspect_and_plan(run_cli, tmp_path):
    path = save(zoo_cnn_opset9(), tmp_path / "zoo_cnn.onnx")
    code, out, err = run_cli("inspect", path, "--json")
    assert code == 0, err
    doc = strict_json(out)
    assert [i["name"] for i in doc["inputs"]] == ["x"]  # the weights are weights, not inputs
    assert doc["opset"] == 9
    code, out, err = run_cli("plan", path, "--device", DEVICE, "--json")
    assert code == 0, err
    groups = strict_json(out)["groups"]
    assert any({"Conv", "Relu"} <= set(g["ops"]) for g in groups), groups


def test_opset9_canonical_model_runs_equal_to_the_original(run_cli, tmp_path):
    model = zoo_cnn_opset9()
    path = save(model, tmp_path / "zoo_cnn.onnx")
    canon = tmp_path / "canon.onnx"
    code, _, err = run_cli("inspect", path, "--canonical", canon)
    assert code == 0, err
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    (expected,) = ort_run(path, {"x": x})
    (got,) = ort_run(str(canon), {"x": x})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert [i.name for i in onnx.load(str(canon)).graph.input] == ["x"]


def test_a_weight_listed_as_input_that_the_user_binds_is_an_input(run_cli, tmp_path):
    """As in ONNX Runtime, an initializer listed as an input is a default the user may feed."""
    path = save(zoo_cnn_opset9(), tmp_path / "zoo_cnn.onnx")
    code, out, err = run_cli("inspect", path, "--input-shape", "scale=8", "--json")
    assert code == 0, err
    assert [i["name"] for i in strict_json(out)["inputs"]] == ["x", "scale"]


# -- broken models: exit 2 naming the tensor or node ---------------------------------------------

def _relu(**kw):
    return make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [("x", [4])], [("y", [4])], **kw)


def _initializer_size_mismatch():
    w = numpy_helper.from_array(np.ones(3, np.float32), "w")
    w.dims[:] = [1, 8]
    model = make_model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], [("x", [1, 8])], [("y", [1, 8])])
    model.graph.initializer.append(w)
    return model


def _typed_data_size_mismatch():
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[1, 8], float_data=[1.0, 2.0, 3.0])
    model = make_model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], [("x", [1, 8])], [("y", [1, 8])])
    model.graph.initializer.append(w)
    return model


def _constant_size_mismatch():
    value = numpy_helper.from_array(np.ones(3, np.float32))
    value.dims[:] = [4]
    nodes = [helper.make_node("Constant", [], ["c"], value=value, name="const"),
             helper.make_node("Add", ["x", "c"], ["y"], name="add")]
    return make_model(nodes, [("x", [4])], [("y", [4])])


def _two_producers():
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="first"), helper.make_node("Neg", ["x"], ["y"], name="second")]
    return make_model(nodes, [("x", [4])], [("y", [4])])


def _node_writes_an_input():
    nodes = [helper.make_node("Relu", ["x"], ["b"], name="clobber"), helper.make_node("Add", ["x", "b"], ["y"], name="a")]
    return make_model(nodes, [("x", [4]), ("b", [4])], [("y", [4])])


def _input_without_type():
    bare = onnx.ValueInfoProto(name="x")
    return make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [bare], [("y", [4])])


def _input_without_element_type():
    vi = helper.make_tensor_value_info("x", TensorProto.UNDEFINED, [4])
    return make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [vi], [("y", [4])])


def _conv_channel_mismatch():
    w = np.ones((4, 5, 3, 3), np.float32)
    return make_model([helper.make_node("Conv", ["x", "W"], ["y"], name="conv")], [("x", [1, 3, 8, 8])],
                      [("y", None)], [("W", w)])


def _conv_transpose_channel_mismatch():
    w = np.ones((5, 4, 2, 2), np.float32)
    return make_model([helper.make_node("ConvTranspose", ["x", "W"], ["y"], name="up")], [("x", [1, 3, 8, 8])],
                      [("y", None)], [("W", w)])


def _output_nothing_produces():
    return make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [("x", [4])], [("y", [4]), ("ghost", [4])])


def _empty_op_type():
    return make_model([helper.make_node("", ["x"], ["y"], name="blank")], [("x", [4])], [("y", [4])])


def _no_nodes():
    return make_model([], [("x", [4])], [("x", [4])])


def _opset(version):
    def build():
        model = _relu()
        model.opset_import[0].version = version
        return model
    return build


def _ir_version(version):
    def build():
        model = _relu()
        model.ir_version = version
        return model
    return build


def _one_node(op, inputs, shapes, weights=(), opset=17, **attrs):
    """One node `n` reading graph inputs `shapes` (name -> shape) and `weights`, writing 'y'."""
    node = helper.make_node(op, inputs, ["y"], name="n", **attrs)
    return lambda: make_model([node], list(shapes.items()), [("y", None)], weights, opset=opset)


def _duplicate_input():
    return make_model([helper.make_node("Add", ["x", "x"], ["y"], name="add")], [("x", [4]), ("x", [4])], [("y", None)])


def _input_declared_unlike_its_initializer():
    return make_model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], [("x", [8, 16]), ("w", [3, 3])],
                      [("y", None)], [("w", np.ones((8, 16), np.float32))])


def _sequence_input():
    seq = helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [4])
    return make_model([helper.make_node("SequenceAt", ["s", "i"], ["y"], name="at")], [seq], [("y", None)],
                      [("i", np.array(0, np.int64))])


def _dropout(ratio, training):
    return _one_node("Dropout", ["x", "r", "t"], {"x": [64]}, [("r", np.array(ratio, np.float32)),
                                                                 ("t", np.array(training))])


def _dropout_training_fed():
    node = helper.make_node("Dropout", ["x", "r", "t"], ["y"], name="n")
    return make_model([node], [("x", [64]), ("t", [], TensorProto.BOOL)], [("y", None)],
                      [("r", np.array(0.5, np.float32))])


_ONES = {n: np.ones(n, np.float32) for n in (3, 5)}
_BN = [("s", np.ones(2, np.float32)), ("b", np.zeros(2, np.float32)), ("m", np.zeros(2, np.float32)),
       ("v", np.array([1, -2], np.float32))]
# Models ONNX Runtime refuses on loading or on their first run (test_onnx_runtime_refuses_them_too)
ORT_REFUSES = [
    ("ir-version-15", _ir_version(15), ["IR version 15", "newer", "installed onnx"]),
    ("ir-version-99", _ir_version(99), ["IR version 99", "newer"]),
    ("duplicate-input", _duplicate_input, ["graph input 'x'", "declared twice"]),
    ("input-unlike-initializer", _input_declared_unlike_its_initializer,
     ["graph input 'w'", "[3, 3]", "initializer", "[8, 16]"]),
    ("reshape-16-to-25", _one_node("Reshape", ["x", "s"], {"x": [4, 4]}, [("s", np.array([5, 5], np.int64))]),
     ["'n' (Reshape)", "16 elements", "[5, 5]", "25 elements"]),
    ("conv-kernel-above-input", _one_node("Conv", ["x", "W"], {"x": [1, 1, 4, 4]},
                                          [("W", np.ones((1, 1, 7, 7), np.float32))]), ["'n' (Conv)", "-2", "kernel"]),
    ("conv-group-0", _one_node("Conv", ["x", "W"], {"x": [1, 2, 4, 4]}, [("W", np.ones((2, 2, 3, 3), np.float32))],
                               group=0), ["'n' (Conv)", "group 0", "positive"]),
    ("gather-index-out-of-range", _one_node("Gather", ["x", "i"], {"x": [4, 3]}, [("i", np.array([7], np.int64))]),
     ["'n' (Gather)", "index 7", "'i'", "axis 0", "-4..3"]),
    ("gemm-bias-length", _one_node("Gemm", ["x", "W", "b"], {"x": [2, 4]}, [("W", np.ones((4, 3), np.float32)),
                                                                            ("b", _ONES[5])]),
     ["'n' (Gemm)", "'b' [5]", "[2, 3]"]),
    ("layernorm-scale-shape", _one_node("LayerNormalization", ["x", "s"], {"x": [2, 4]}, [("s", _ONES[3])]),
     ["'n' (LayerNormalization)", "scale 's' [3]", "[4]"]),
    ("gemm-transA-string", _one_node("Gemm", ["x", "W"], {"x": [4, 4]}, [("W", np.ones((4, 3), np.float32))],
                                     transA="yes"), ["'n' (Gemm)", "'transA'", "STRING", "INT"]),
    ("clip-string-bounds", _one_node("Clip", ["x"], {"x": [4]}, opset=9, min="0", max="6"),
     ["'n' (Clip)", "STRING", "FLOAT"]),
    ("softmax-axis-string", _one_node("Softmax", ["x"], {"x": [2, 4]}, axis="last"),
     ["'n' (Softmax)", "'axis'", "STRING", "INT"]),
    ("softmax-axis-ints", _one_node("Softmax", ["x"], {"x": [2, 4]}, axis=[1]), ["'n' (Softmax)", "'axis'", "INTS"]),
    ("layernorm-axis-string", _one_node("LayerNormalization", ["x", "s"], {"x": [2, 4]}, [("s", np.ones(4, np.float32))],
                                        axis="last"), ["'n' (LayerNormalization)", "'axis'", "STRING", "INT"]),
    ("required-attribute-missing", _one_node("Unsqueeze", ["x"], {"x": [4]}, opset=11),
     ["'n' (Unsqueeze)", "required attribute 'axes'"]),
]
# Models ONNX Runtime runs, whose results no plan can match (test_onnx_runtime_runs_them_apart)
ORT_RUNS_APART = [
    ("batchnorm-negative-variance", _one_node("BatchNormalization", ["x", "s", "b", "m", "v"], {"x": [1, 2, 3, 3]}, _BN),
     ["'n' (BatchNormalization)", "variance 'v'", "-2", "NaN"]),
    ("dropout-training", _dropout(0.5, True), ["'n' (Dropout)", "training mode", "'t' is true", "model.eval()"]),
    ("dropout-training-fed", _dropout_training_fed, ["'n' (Dropout)", "training mode", "'t' is not a constant"]),
]
UNSUPPORTED = [
    ("sequence-input", _sequence_input, ["graph input 's'", "sequence", "only tensor inputs"]),
]


BROKEN = [
    ("initializer-size", _initializer_size_mismatch, ["initializer 'w'", "12 bytes", "[1, 8]", "32"]),
    ("initializer-typed-size", _typed_data_size_mismatch, ["initializer 'w'", "3 values", "[1, 8]", "8"]),
    ("constant-size", _constant_size_mismatch, ["node 'const'", "value", "[4]"]),
    ("two-producers", _two_producers, ["tensor 'y'", "two nodes", "'first'", "'second'"]),
    ("writes-an-input", _node_writes_an_input, ["'clobber'", "'b'", "graph input"]),
    ("input-no-type", _input_without_type, ["graph input 'x'", "no type"]),
    ("input-no-element-type", _input_without_element_type, ["graph input 'x'", "no type"]),
    ("conv-channels", _conv_channel_mismatch, ["'conv' (Conv)", "3 channels", "'x'", "'W'", "expects 5"]),
    ("conv-transpose-channels", _conv_transpose_channel_mismatch, ["'up' (ConvTranspose)", "3 channels", "5"]),
    ("output-not-produced", _output_nothing_produces, ["graph output 'ghost'", "produced by no node"]),
    ("empty-op-type", _empty_op_type, ["node 'blank'", "empty op_type"]),
    ("no-nodes", _no_nodes, ["no nodes", "nothing to fuse"]),
    ("opset-too-new", _opset(99), ["opset 99", "7..", "not supported"]),
    ("opset-too-old", _opset(6), ["opset 6", "7..", "not supported"]),
] + ORT_REFUSES + ORT_RUNS_APART + UNSUPPORTED


@pytest.mark.parametrize(("build", "needles"), [row[1:] for row in BROKEN], ids=[row[0] for row in BROKEN])
@pytest.mark.parametrize("command", [["inspect"], ["plan", "--device", DEVICE]], ids=["inspect", "plan"])
def test_broken_model_is_refused_with_one_line(run_cli, tmp_path, caplog, command, build, needles):
    path = save(build(), tmp_path / "broken.onnx")
    code, out, err = run_cli(command[0], path, *command[1:])
    one_line_error(code, err, "broken.onnx", *needles)
    assert out == ""
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")], caplog.text  # one line only


ORT_ERRORS = (ort_state.Fail, ort_state.InvalidGraph, ort_state.InvalidArgument, ort_state.RuntimeException)


def _ort_session(model: onnx.ModelProto):
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _ort_feeds(sess) -> dict:
    types = {"tensor(bool)": np.bool_, "tensor(float)": np.float32}
    return {i.name: np.ones(i.shape, types[i.type]) for i in sess.get_inputs()}


@pytest.mark.parametrize("build", [row[1] for row in ORT_REFUSES], ids=[row[0] for row in ORT_REFUSES])
def test_onnx_runtime_refuses_them_too(build):
    with pytest.raises(ORT_ERRORS):
        sess = _ort_session(build())
        sess.run(None, _ort_feeds(sess))


def test_onnx_runtime_runs_them_apart():
    """A negative variance gives NaN; a Dropout in training mode zeroes values at random."""
    bn = _one_node("BatchNormalization", ["x", "s", "b", "m", "v"], {"x": [1, 2, 3, 3]}, _BN)()
    (y,) = ort_run(bn, {"x": np.ones((1, 2, 3, 3), np.float32)})
    assert np.isnan(y[0, 1]).all() and not np.isnan(y[0, 0]).any()
    for sess, feeds in [(_ort_session(_dropout(0.5, True)()), {}),
                        (_ort_session(_dropout_training_fed()), {"t": np.array(True)})]:
        runs = [sess.run(None, {"x": np.ones(64, np.float32), **feeds})[0] for _ in range(2)]
        assert (runs[0] == 0).any() and (runs[0] != runs[1]).any()


def test_dropout_in_training_mode_at_ratio_0_plans_and_verifies_as_identity(run_cli, tmp_path):
    """ONNX Runtime keeps every value at ratio 0, training mode or not: nothing to refuse."""
    path = save(_dropout(0.0, True)(), tmp_path / "drop.onnx")
    x = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    np.testing.assert_array_equal(ort_run(path, {"x": x})[0], x)
    code, out, err = run_cli("plan", path, "--device", DEVICE, "--emit", tmp_path / "fused.onnx")
    assert code == 0, err
    assert "outputs equal" in out


def _save_string_attribute(op, attr, tmp_path):
    """Split `split` and ReduceMean `axes` as strings: onnx's version converter crashed the
    interpreter on them (a segmentation fault) before the schema check."""
    x = ("x", [4, 4])
    model = make_model([helper.make_node(op, ["x"], ["y"], name="n", **{attr: "1"})], [x], [("y", None)], opset=11)
    return save(model, tmp_path / "crash.onnx")


@pytest.mark.parametrize(("op", "attr"), [("Split", "split"), ("ReduceMean", "axes")])
@pytest.mark.parametrize("command", [["inspect"], ["plan", "--device", DEVICE]], ids=["inspect", "plan"])
def test_an_attribute_of_the_wrong_type_is_one_line_not_a_crash(tmp_path, op, attr, command):
    """In a child process: a crash there is a failed test, not a dead pytest."""
    path = _save_string_attribute(op, attr, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "fusesearch", command[0], path, *command[1:]],
                          capture_output=True, text=True, timeout=120)
    one_line_error(proc.returncode, proc.stderr, "crash.onnx", f"'n' ({op})", f"'{attr}'", "STRING", "INTS")


def test_opset_message_names_one_range_and_readme_agrees():
    from pathlib import Path

    from fusesearch.ir.load import MIN_OPSET, max_opset

    readme = " ".join((Path(__file__).parent.parent / "README.md").read_text().split())
    assert f"opset {MIN_OPSET} up to the newest the installed onnx defines" in readme
    assert max_opset() == onnx.defs.onnx_opset_version()


STORAGES = [(dtype, raw) for dtype in ("FLOAT", "FLOAT16", "BFLOAT16", "DOUBLE", "INT4", "UINT8", "INT64", "BOOL",
                                      "FLOAT8E4M3FN", "COMPLEX64") for raw in (False, True)] + [("STRING", False)]


@pytest.mark.parametrize(("dtype", "raw"), STORAGES, ids=[f"{d}-{'raw' if r else 'typed'}" for d, r in STORAGES])
def test_well_formed_tensors_of_every_storage_pass_the_size_check(dtype, raw):
    from fusesearch.ir.load import _check_tensor_sizes

    data_type = getattr(TensorProto, dtype)
    values = {"STRING": [b"a", b"b", b"c", b"d", b"e", b"f"], "COMPLEX64": [1 + 2j] * 6}.get(dtype, [1, 0, 1, 1, 0, 1])
    if raw:
        array = np.array(values).astype(helper.tensor_dtype_to_np_dtype(data_type)).reshape(2, 3)
        tensor = numpy_helper.from_array(array, "t")
    else:
        tensor = helper.make_tensor("t", data_type, [2, 3], values)
    empty = helper.make_tensor("e", data_type, [0, 3], [])
    _check_tensor_sizes(helper.make_graph([], "g", [], [], [tensor, empty]), "m.onnx")  # no error


def test_grouped_conv_with_matching_channels_loads(run_cli, tmp_path):
    model = make_model([helper.make_node("Conv", ["x", "W"], ["y"], group=4, name="dw")], [("x", [1, 4, 8, 8])],
                       [("y", None)], [("W", np.ones((4, 1, 3, 3), np.float32))])
    code, _, err = run_cli("inspect", save(model, tmp_path / "dw.onnx"))
    assert code == 0, err


# -- every --json is valid JSON ------------------------------------------------------------------

def test_json_of_a_plan_that_costs_nothing_is_valid(run_cli, tmp_path):
    """A graph of view ops only (fused and unfused both cost 0): speedup 1, never Infinity."""
    model = make_model([helper.make_node("Reshape", ["x", "s"], ["y"], name="view")], [("x", [4])], [("y", [2, 2])],
                       [("s", np.array([2, 2], np.int64))])
    path = save(model, tmp_path / "view.onnx")
    code, out, err = run_cli("compare", path, "--device", DEVICE, "--strategies", "none,greedy", "--json")
    assert code == 0, err
    rows = strict_json(out)["results"]
    assert [r["speedup"] for r in rows] == [1.0, 1.0]
    code, out, err = run_cli("plan", path, "--device", DEVICE)
    assert code == 0, err
    assert "speedup 1.00x" in out and "inf" not in out


def test_emit_json_writes_non_finite_numbers_as_null(capsys):
    from fusesearch.cli import _emit_json

    _emit_json({"a": float("inf"), "b": [float("nan"), 1.5], "c": {"d": float("-inf")}, "e": (2.0,)})
    assert strict_json(capsys.readouterr().out) == {"a": None, "b": [None, 1.5], "c": {"d": None}, "e": [2.0]}


# -- messages ------------------------------------------------------------------------------------

@pytest.mark.parametrize("device_file", ["/dev/null", "/dev/zero"])
def test_a_device_file_as_model_is_not_called_a_directory(run_cli, device_file):
    code, _, err = run_cli("inspect", device_file)
    one_line_error(code, err, device_file, "not a regular file")
    assert "directory" not in err


def test_a_directory_as_model_is_called_a_directory(run_cli, tmp_path):
    code, _, err = run_cli("inspect", tmp_path)
    one_line_error(code, err, str(tmp_path), "directory")


def _unknown_op_model(opset):
    nodes = [helper.make_node("FancyGelu", ["x"], ["t"], name="mystery"), helper.make_node("Relu", ["t"], ["y"], name="r")]
    return make_model(nodes, [("x", [4])], [("y", [4])], opset=opset)


def test_unknown_op_warning_is_one_clean_line(tmp_path):
    """In a real process: what the terminal shows on stderr, onnx's C++ messages included. Opset 9
    takes the opset upgrade, whose converter asserts on an op it does not know."""
    path = save(_unknown_op_model(9), tmp_path / "unknown.onnx")
    proc = subprocess.run([sys.executable, "-m", "fusesearch", "plan", path, "--device", DEVICE],
                          capture_output=True, text=True, timeout=120)
    err = proc.stderr
    assert proc.returncode == 0, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    for needle in ("'FancyGelu'", "ai.onnx", "'mystery'", "alone (opaque)"):
        assert needle in lines[0], lines[0]
    assert ".cc:" not in err and "Assertion" not in err and "%s" not in err


def test_unknown_op_is_warned_at_a_current_opset_too(run_cli, tmp_path, caplog):
    code, _, err = run_cli("inspect", save(_unknown_op_model(21), tmp_path / "unknown.onnx"))
    assert code == 0, err
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "'FancyGelu'" in warnings[0] and "'mystery'" in warnings[0], warnings
    assert "keeps opset" not in warnings[0]


def test_converter_failure_reason_drops_cpp_location():
    from fusesearch.ir.load import _reason

    exc = RuntimeError("/project/onnx/version_converter/convert.cc:101: convert_graph: Assertion `x != y` "
                       "failed: Op has no adapter\nmore")
    assert _reason(exc) == "Op has no adapter"


def _two_inputs_sharing_batch():
    nodes = [helper.make_node("Add", ["a", "b"], ["y"], name="add")]
    return make_model(nodes, [("a", ["batch", 4]), ("b", ["batch", 4])], [("y", None)])


@pytest.mark.parametrize(("flags", "needles"), [
    (["--input-shape", "a=2x4", "--dim", "batch=3"], ["--input-shape a=2x4", "--dim batch=3", "'batch'", "'a'"]),
    (["--input-shape", "a=2x4", "--input-shape", "b=3x4"], ["--input-shape a=2x4", "--input-shape b=3x4", "'batch'"]),
], ids=["input-shape-vs-dim", "input-shape-vs-input-shape"])
def test_conflicting_shape_flags_name_both(run_cli, tmp_path, flags, needles):
    code, _, err = run_cli("inspect", save(_two_inputs_sharing_batch(), tmp_path / "two.onnx"), *flags)
    one_line_error(code, err, *needles)
    assert "shape inference" not in err


def test_agreeing_shape_flags_load(run_cli, tmp_path):
    path = save(_two_inputs_sharing_batch(), tmp_path / "two.onnx")
    code, out, err = run_cli("inspect", path, "--input-shape", "a=2x4", "--dim", "batch=2", "--json")
    assert code == 0, err
    assert [i["shape"] for i in strict_json(out)["inputs"]] == [[2, 4], [2, 4]]


def test_external_data_length_not_matching_dims_is_refused(run_cli, tmp_path):
    weight = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "w.bin"), ("offset", "0"), ("length", "8")):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    model = make_model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], [("x", [4])], [("y", [4])])
    model.graph.initializer.append(weight)
    (tmp_path / "w.bin").write_bytes(b"\0" * 16)
    code, _, err = run_cli("inspect", save(model, tmp_path / "ext.onnx"))
    one_line_error(code, err, "ext.onnx", "initializer 'w'", "8 bytes of external data", "[4]", "16")


# -- dims: anonymous dims, dims the model cannot take, huge dims ----------------------------------

def _paddle_classifier() -> onnx.ModelProto:
    """A PaddleOCR-style classifier export: input x [-1, 3, '?', '?'], the exporter's "unknown"
    spelled -1 and '?' (Conv -> Relu -> GlobalAveragePool -> Flatten -> Gemm -> Softmax)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("GlobalAveragePool", ["r"], ["p"], name="gap"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "G", "GB"], ["g"], transB=1, name="fc"),
             helper.make_node("Softmax", ["g"], ["y"], axis=1, name="softmax")]
    weights = [("W", rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.1),
               ("B", rng.standard_normal(8).astype(np.float32) * 0.1),
               ("G", rng.standard_normal((2, 8)).astype(np.float32)), ("GB", rng.standard_normal(2).astype(np.float32))]
    return make_model(nodes, [("x", [-1, 3, "?", "?"])], [("y", [-1, 2])], weights)


def test_anonymous_dims_bind_from_the_input_shape_in_every_command(run_cli, tmp_path):
    """Two '?' dims of one input tie nothing: --input-shape gives them 48 and 192, and the model
    inspects, plans and verifies (--emit), measures and runs equal to ONNX Runtime."""
    path = save(_paddle_classifier(), tmp_path / "cls.onnx")
    shape = ["--input-shape", "x=1x3x48x192"]
    code, out, err = run_cli("inspect", path, *shape, "--json")
    assert code == 0, err
    doc = strict_json(out)
    assert [i["shape"] for i in doc["inputs"]] == [[1, 3, 48, 192]] and doc["outputs"][0]["shape"] == [1, 2]
    code, out, err = run_cli("plan", path, *shape, "--device", "host", "--emit", tmp_path / "fused.onnx")
    assert code == 0 and "verified in ONNX Runtime" in out, err
    code, _, err = run_cli("measure", path, *shape, "--backend", "cpu", "--strategy", "greedy", "--budget", "0.01")
    assert code == 0, err
    code, out, err = run_cli("run", path, *shape, "--strategy", "greedy", "--repeat", "1", "--warmup", "0")
    assert code == 0 and "equal to ONNX Runtime" in out, err


def _two_anonymous_inputs():
    nodes = [helper.make_node("ReduceSum", ["a"], ["s"], keepdims=0, name="sa"),
             helper.make_node("ReduceSum", ["b"], ["t"], keepdims=0, name="sb")]
    return make_model(nodes, [("a", ["?", 4]), ("b", ["?", 4])], [("s", None), ("t", None)])


def test_anonymous_dims_of_two_inputs_take_two_values(run_cli, tmp_path):
    path = save(_two_anonymous_inputs(), tmp_path / "two.onnx")
    code, out, err = run_cli("inspect", path, "--input-shape", "a=2x4", "--input-shape", "b=3x4", "--json")
    assert code == 0, err
    assert [i["shape"] for i in strict_json(out)["inputs"]] == [[2, 4], [3, 4]]


@pytest.mark.parametrize("given", [0, -1])
def test_a_dim_given_as_zero_or_minus_one_is_named_as_given(run_cli, tmp_path, given):
    """Exporters write 0 or -1 for "unknown"; fusesearch holds no zero-size tensor, and says so."""
    model = make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [("x", [given, 4])], [("y", None)])
    code, _, err = run_cli("inspect", save(model, tmp_path / "zero.onnx"))
    one_line_error(code, err, "input 'x'", f"dim 0 (given as {given}", "zero-size tensors are not supported",
                   "--input-shape x=")
    code, out, err = run_cli("inspect", save(model, tmp_path / "zero.onnx"), "--input-shape", "x=2x4", "--json")
    assert code == 0, err
    assert strict_json(out)["inputs"][0]["shape"] == [2, 4]


def _positions_past_the_table():
    """ids [batch, seq] -> word embeddings + position embeddings of Range(0, seq) from a 512-row
    table: at seq > 512 the position Gather reads past the table."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Shape", ["ids"], ["shape"], name="shape"),
             helper.make_node("Gather", ["shape", "one"], ["seq"], axis=0, name="seq_len"),
             helper.make_node("Range", ["zero", "seq", "one"], ["positions"], name="positions"),
             helper.make_node("Gather", ["pos_table", "positions"], ["pe"], name="pos_embed"),
             helper.make_node("Gather", ["word_table", "ids"], ["we"], name="word_embed"),
             helper.make_node("Add", ["we", "pe"], ["y"], name="add")]
    return make_model(nodes, [("ids", ["batch", "seq"], TensorProto.INT64)], [("y", None)],
                      [("pos_table", rng.standard_normal((512, 16)).astype(np.float32)),
                       ("word_table", rng.standard_normal((100, 16)).astype(np.float32)),
                       ("zero", np.array(0, np.int64)), ("one", np.array(1, np.int64))])


def _gather_constant_index_out_of_range():
    nodes = [helper.make_node("Gather", ["table", "idx"], ["g"], name="lookup"),
             helper.make_node("Add", ["x", "g"], ["y"], name="add")]
    return make_model(nodes, [("x", [2, 4])], [("y", None)],
                      [("table", np.ones((3, 4), np.float32)), ("idx", np.array([0, 7], np.int64))])


def _matmul(m, k, n):
    nodes = [helper.make_node("MatMul", ["a", "b"], ["c"], name="mm"), helper.make_node("Relu", ["c"], ["y"], name="relu")]
    return make_model(nodes, [("a", [m, k]), ("b", [k, n])], [("y", None)])


def _relu_batch():
    return make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [("x", ["batch", 1024])], [("y", None)])


# (id, model: a builder or zoo:NAME, flags, needles of the one line)
CANNOT_TAKE = [
    ("bert-seq-past-positions", "zoo:bert-small", ["--dim", "seq=1000"],
     ["at --dim seq=1000", "node 'add_0' (Add)", "1x1000x128, 1x512x128", "cannot take these dims"]),
    ("gather-past-the-table", _positions_past_the_table, ["--dim", "batch=1", "--dim", "seq=1000"],
     ["--dim seq=1000", "node 'pos_embed' (Gather)", "index 999 of 'pos_table'", "512 entries"]),
    ("gather-constant-index", _gather_constant_index_out_of_range, [],
     ["node 'lookup' (Gather)", "index 7 of 'table'", "3 entries", "fix the export"]),
    ("dim-given-twice", _relu_batch, ["--dim", "batch=1", "--dim", "batch=2"],
     ["--dim batch=2 conflicts with --dim batch=1", "one value"]),
    ("input-shape-given-twice", _relu_batch, ["--input-shape", "x=1x1024", "--input-shape", "x=2x1024"],
     ["--input-shape x=2x1024 conflicts with --input-shape x=1x1024"]),
    ("huge-input", _relu_batch, ["--dim", "batch=1000000000000"],
     ["--dim batch=1000000000000 makes input 'x'", "1000000000000x1024 float32", "3,725 TiB", "256 TiB"]),
    ("dim-past-int64", _relu_batch, ["--dim", "batch=100000000000000000000"],
     ["--dim batch=100000000000000000000 makes input 'x'", "256 TiB"]),
    ("huge-intermediate", lambda: _matmul("m", 1, "n"), ["--dim", "m=16777216", "--dim", "n=16777216"],
     ["at --dim m=16777216, --dim n=16777216", "tensor 'c' of node 'mm' (MatMul)", "16777216x16777216 float32",
      "1,024 TiB"]),
]


@pytest.mark.parametrize(("model", "flags", "needles"), [row[1:] for row in CANNOT_TAKE],
                         ids=[row[0] for row in CANNOT_TAKE])
@pytest.mark.parametrize("command", [["inspect"], ["plan", "--device", DEVICE]], ids=["inspect", "plan"])
def test_dims_the_model_cannot_take_are_refused_naming_dim_and_node(run_cli, tmp_path, command, model, flags,
                                                                    needles):
    path = model if isinstance(model, str) else save(model(), tmp_path / "m.onnx")
    code, out, err = run_cli(command[0], path, *command[1:], *flags)
    one_line_error(code, err, *needles)
    assert out == ""


def test_a_sweep_cell_at_dims_the_model_cannot_take_fails_with_that_line(tmp_path):
    from fusesearch.sweep import expand, load_config, run_cell

    config = tmp_path / "sweep.toml"
    config.write_text('models = [{ model = "zoo:bert-small", dims = { seq = 1000 } }]\ndevices = ["t4"]\n'
                      'strategies = ["greedy"]\n')
    (cell,) = expand(load_config(config))
    row = run_cell(cell)
    assert row["status"] == "error", row
    assert "at models[0].dims.seq=1000, node 'add_0' (Add)" in row["error"], row["error"]
    assert "input_shapes and dims of models[0]" in row["error"] and "--dim" not in row["error"]


def test_shape_completion_counts_elements_before_allocating(run_cli):
    """rnn-control's Loop at batch 10^9 reads a 119 GiB state: shape completion (which runs a node
    on zeros when its inputs are small) refused it only after allocating the zeros (MemoryError)."""
    code, out, err = run_cli("inspect", "zoo:rnn-control", "--dim", "batch=1000000000", "--json")
    assert code == 0, err
    assert strict_json(out)["inputs"][0]["shape"][0] == 1000000000
