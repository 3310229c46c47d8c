"""Loading: every bad input gets exit code 2 and one line; good but odd models load."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusesearch.errors import ModelLoadError, ShapeBindingError
from fusesearch.ir.load import load_model
from fusesearch.ir.shapes import ShapeBindings
from tests.conftest import make_model, save


def relu_model(shape=("batch", 4), opset=17):
    return make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [("x", list(shape))], [("y", None)],
                      opset=opset)


def assert_one_line_error(code, err, *needles):
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


# -- bad input: one test per case --------------------------------------------------------------

def test_missing_file(run_cli, tmp_path):
    code, _, err = run_cli("inspect", tmp_path / "nope.onnx")
    assert_one_line_error(code, err, "nope.onnx", "no such file")


def test_not_an_onnx_file(run_cli, tmp_path):
    path = tmp_path / "notes.onnx"
    path.write_text("this is not a model\n" * 20)
    code, _, err = run_cli("inspect", path)
    assert_one_line_error(code, err, "notes.onnx", "ONNX")


def test_truncated_protobuf(run_cli, tmp_path):
    data = relu_model().SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    code, _, err = run_cli("inspect", path)
    assert_one_line_error(code, err, "cut.onnx", "truncated")


def test_graph_with_a_cycle(run_cli, tmp_path):
    nodes = [helper.make_node("Add", ["x", "b"], ["a"], name="n1"),
             helper.make_node("Relu", ["a"], ["b"], name="n2"),
             helper.make_node("Relu", ["a"], ["y"], name="n3")]
    path = save(make_model(nodes, [("x", [4])], [("y", [4])]), tmp_path / "cycle.onnx")
    code, _, err = run_cli("inspect", path)
    assert_one_line_error(code, err, "cycle", "n1")


def test_input_nothing_produces(run_cli, tmp_path):
    nodes = [helper.make_node("Add", ["x", "ghost"], ["y"], name="adder")]
    path = save(make_model(nodes, [("x", [4])], [("y", [4])]), tmp_path / "dangling.onnx")
    code, _, err = run_cli("inspect", path)
    assert_one_line_error(code, err, "adder", "ghost")


def test_unbound_named_dim(run_cli, tmp_path):
    path = save(relu_model(("p2o.DynamicDimension.0", 4)), tmp_path / "dyn.onnx")
    code, _, err = run_cli("inspect", path)
    assert_one_line_error(code, err, "'x'", "p2o.DynamicDimension.0", "--dim p2o.DynamicDimension.0=")


@pytest.mark.parametrize("dim", [None, -1, 0, "?"])
def test_unbound_unnamed_dim(run_cli, tmp_path, dim):
    vi = helper.make_tensor_value_info("x", TensorProto.FLOAT, [dim, 4])
    if dim == "?":
        vi.type.tensor_type.shape.dim[0].Clear()
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [vi], [("y", None)])
    path = save(model, tmp_path / "unnamed.onnx")
    code, _, err = run_cli("inspect", path)
    assert_one_line_error(code, err, "'x'", "dim 0", "--input-shape x=")
    code, out, err = run_cli("inspect", path, "--input-shape", "x=3x4", "--json")
    assert code == 0, err


def _external_model(tmp_path, location: str):
    weight = numpy_helper.from_array(np.ones(4, np.float32), "w")
    weight.data_location = TensorProto.EXTERNAL
    del weight.external_data[:]
    for k, v in (("location", location), ("offset", "0"), ("length", "16")):
        entry = weight.external_data.add()
        entry.key, entry.value = k, v
    weight.ClearField("raw_data")
    model = make_model([helper.make_node("Add", ["x", "w"], ["y"])], [("x", [4])], [("y", [4])])
    model.graph.initializer.append(weight)
    folder = tmp_path / "m"
    folder.mkdir()
    return save(model, folder / "model.onnx")


@pytest.mark.parametrize("location", ["../secret.bin", "/etc/passwd", "sub/../../x.bin"])
def test_external_data_escaping_the_folder(run_cli, tmp_path, location):
    (tmp_path / "secret.bin").write_bytes(b"\0" * 16)
    path = _external_model(tmp_path, location)
    code, _, err = run_cli("inspect", path)
    assert_one_line_error(code, err, "'w'", location)


def test_external_data_inside_the_folder_loads(tmp_path):
    path = _external_model(tmp_path, "w.bin")
    np.full(4, 2.0, np.float32).tofile(os.path.join(os.path.dirname(path), "w.bin"))
    loaded = load_model(path)
    assert loaded.model.graph.initializers["w"].const_value.numpy().tolist() == [2.0] * 4


@pytest.mark.parametrize(("flag", "needle"), [
    ("nope=1x4", "unknown input 'nope'"),
    ("x=1x2x4", "rank"),
    ("x=0x4", "positive"),
    ("x=-1x4", "positive"),
    ("x=axb", "integers"),
])
def test_bad_input_shape(run_cli, tmp_path, flag, needle):
    path = save(relu_model(), tmp_path / "m.onnx")
    code, _, err = run_cli("inspect", path, "--input-shape", flag)
    assert_one_line_error(code, err, "--input-shape", needle)


def test_unknown_dim_flag(run_cli, tmp_path):
    path = save(relu_model(), tmp_path / "m.onnx")
    code, _, err = run_cli("inspect", path, "--dim", "batch=1", "--dim", "sequence=3")
    assert_one_line_error(code, err, "sequence", "batch")


def test_unknown_zoo_model(run_cli):
    code, _, err = run_cli("inspect", "zoo:resnet5000")
    assert_one_line_error(code, err, "resnet5000", "resnet50")


def test_unknown_option(run_cli):
    code, _, err = run_cli("inspect", "zoo:resnet18", "--frobnicate")
    assert_one_line_error(code, err, "--frobnicate")


# -- odd but valid models --------------------------------------------------------------------

def test_zero_size_tensors_load():
    nodes = [helper.make_node("Concat", ["x", "e"], ["y"], axis=0, name="cat")]
    model = make_model(nodes, [("x", [2, 3])], [("y", None)], [("e", np.zeros((0, 3), np.float32))])
    loaded = load_model_proto(model)
    assert loaded.model.graph.initializers["e"].const_value.numpy().shape == (0, 3)


def load_model_proto(model, bindings=None, tmp=None):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.onnx")
        onnx.save(model, path)
        return load_model(path, bindings)


def test_old_opset_is_upgraded_and_softmax_coercion_kept():
    """Opset-9 Softmax coerces to 2-D (axis=1 over the flattened tail); after the upgrade the
    canonical model must compute the same thing."""
    from fusesearch.ir.canonicalize import canonicalize, to_proto
    from fusesearch.verify import compare, random_feeds, run

    model = make_model([helper.make_node("Softmax", ["x"], ["y"], axis=1)], [("x", [2, 3, 4])],
                       [("y", [2, 3, 4])], opset=9)
    loaded = load_model_proto(model)
    assert loaded.opset == 9
    assert loaded.model.opset_imports[""] == 21
    canonical, _ = canonicalize(loaded.model)
    feeds = random_feeds(model, seed=1)
    assert all(d.ok for d in compare(run(model, feeds), run(to_proto(canonical), feeds)))


def test_unsorted_graph_is_sorted_and_unnamed_nodes_named():
    nodes = [helper.make_node("Relu", ["a"], ["y"]), helper.make_node("Neg", ["x"], ["a"]),
             helper.make_node("Abs", ["y"], ["z"], name="dup"), helper.make_node("Abs", ["z"], ["w"], name="dup")]
    model = make_model(nodes, [("x", [4])], [("w", [4])])
    loaded = load_model_proto(model)
    ops = [n.op_type for n in loaded.model.graph]
    names = [n.name for n in loaded.model.graph]
    assert ops == ["Neg", "Relu", "Abs", "Abs"]
    assert len(set(names)) == 4 and all(names)


def test_input_shape_binds_named_dims_of_other_inputs():
    nodes = [helper.make_node("Add", ["a", "b"], ["y"])]
    model = make_model(nodes, [("a", ["batch", "seq"]), ("b", ["batch", "seq"])], [("y", None)])
    loaded = load_model_proto(model, ShapeBindings.parse(["a=2x5"]))
    assert [tuple(v.shape) for v in loaded.model.graph.inputs] == [(2, 5), (2, 5)]


def test_initializers_listed_as_inputs_are_weights():
    """IR<4 exporters list every weight as a graph input too."""
    model = make_model([helper.make_node("Add", ["x", "w"], ["y"])], [("x", [4]), ("w", [4])], [("y", [4])],
                       [("w", np.ones(4, np.float32))])
    loaded = load_model_proto(model)
    assert [v.name for v in loaded.model.graph.inputs] == ["x"]


def test_shape_mismatch_is_bad_input(tmp_path):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    model = make_model(nodes, [("x", ["batch", "k"])], [("y", None)], [("w", np.ones((4, 3), np.float32))])
    path = save(model, tmp_path / "mm.onnx")
    with pytest.raises(ModelLoadError, match="--input-shape"):
        load_model(str(path), ShapeBindings.parse(["x=2x5"]))
    with pytest.raises(ShapeBindingError):
        load_model(str(path), ShapeBindings.parse(["x=2x5x1"]))


def test_model_over_2gb_with_external_data_loads(tmp_path):
    """A 2.1 GB weight in a sparse external file: load, canonicalize and build the Graph without
    reading it (weights are memory-mapped)."""
    from fusesearch.pipeline import prepare

    n = 540_000_000  # float32 → 2.16 GB
    weight = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[n])
    weight.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "big.bin"), ("offset", "0"), ("length", str(4 * n))):
        entry = weight.external_data.add()
        entry.key, entry.value = k, v
    model = make_model([helper.make_node("Mul", ["x", "w"], ["y"], name="scale")], [("x", [1])], [("y", None)])
    model.graph.initializer.append(weight)
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(4 * n)  # sparse: no disk used
    path = save(model, tmp_path / "big.onnx")
    prep = prepare(path)
    assert prep.graph.tensors["w"].nbytes == 4 * n
    assert prep.graph.tensors["y"].shape == (n,)
