"""PyTorch eager and torch.compile beside the plan (`backends.torch_baseline`, `run --baselines`).

The converter is checked against ONNX Runtime (the oracle) on tiny graphs built in code covering
every op family of the zoo (conv / pools / Gemm, attention pieces, shape ops), and on the
canonical bert-small and resnet18; a node with no converter is named; torch.compile runs and
equals on a tiny model; `run --baselines torch --json` gives the three timings with torch, and
says "not installed" where importing torch fails (that test runs without torch)."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fusesearch.backends import cpu, torch_baseline
from fusesearch.backends.torch_baseline import Unconvertible, baselines, convert
from tests.conftest import make_model, save

RNG = np.random.default_rng(0)
FAST = ("--strategy", "greedy", "--repeat", "2", "--warmup", "0")


def _w(name, *shape, dtype=np.float32):
    return name, (RNG.standard_normal(shape) * 0.3).astype(dtype)


def _i(name, values):
    return name, np.asarray(values, dtype=np.int64)


def convnet():
    """Conv (asymmetric pads) -> BatchNorm -> Clip -> MaxPool -> Conv (groups) -> Sum -> AveragePool ->
    GlobalAveragePool -> Flatten -> Gemm (transB)."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 0, 2, 1], strides=[2, 1]),
             helper.make_node("BatchNormalization", ["c1", "s", "bb", "m", "v"], ["bn"], name="bn", epsilon=1e-3),
             helper.make_node("Clip", ["bn", "lo", "hi"], ["r"], name="clip"),
             helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[3, 3], strides=[2, 2],
                              pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["p", "w2"], ["c2"], name="dw", pads=[1, 1, 1, 1], group=4),
             helper.make_node("Sum", ["c2", "p"], ["s2"], name="sum"),
             helper.make_node("AveragePool", ["s2"], ["ap"], name="avg", kernel_shape=[2, 2], strides=[1, 1]),
             helper.make_node("GlobalAveragePool", ["ap"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], name="fc", transB=1, alpha=0.5)]
    inits = [_w("w1", 4, 3, 3, 3), _w("b1", 4), _w("s", 4), _w("bb", 4), _w("m", 4),
             ("v", np.abs(RNG.standard_normal(4)).astype(np.float32) + 0.5),
             ("lo", np.float32(0.0)), ("hi", np.float32(6.0)),
             _w("w2", 4, 1, 3, 3), _w("wf", 5, 4), _w("bf", 5)]
    return make_model(nodes, [("x", [1, 3, 16, 12])], [("y", [1, 5])], inits, opset=21)


def attention():
    """Gather (embedding) -> LayerNorm -> MatMul -> Split -> Reshape / Transpose -> MatMul -> Div ->
    Where -> Softmax -> ReduceMean -> Erf -> Pow -> Sqrt; Slice (negative end, step 2) -> Concat ->
    Unsqueeze -> Squeeze -> Sub from a scalar; Cast of the ids -> Unsqueeze."""
    mk = helper.make_node
    nodes = [mk("Gather", ["emb", "ids"], ["e"], name="embed"),
             mk("LayerNormalization", ["e", "g", "b"], ["ln"], name="ln", axis=-1, epsilon=1e-5),
             mk("MatMul", ["ln", "wqkv"], ["qkv"], name="qkv"),
             mk("Split", ["qkv"], ["q", "k", "v"], name="split", axis=-1, num_outputs=3),
             mk("Reshape", ["q", "heads"], ["qh"], name="rq"),
             mk("Transpose", ["qh"], ["qt"], name="tq", perm=[0, 2, 1, 3]),
             mk("Reshape", ["k", "heads"], ["kh"], name="rk"),
             mk("Transpose", ["kh"], ["kt"], name="tk", perm=[0, 2, 3, 1]),
             mk("MatMul", ["qt", "kt"], ["sc"], name="scores"), mk("Div", ["sc", "scale"], ["sd"], name="div"),
             mk("Where", ["mask", "sd", "neg"], ["sm"], name="where"),
             mk("Softmax", ["sm"], ["p"], name="softmax", axis=-1),
             mk("ReduceMean", ["p", "ax"], ["pm"], name="mean", keepdims=0),
             mk("Erf", ["pm"], ["er"], name="erf"), mk("Pow", ["er", "two"], ["pw"], name="pow"),
             mk("Sqrt", ["pw"], ["sq"], name="sqrt"),
             mk("Slice", ["v", "st", "en", "sax", "stp"], ["vs"], name="slice"),
             mk("Concat", ["vs", "vs"], ["vc"], name="concat", axis=-1),
             mk("Unsqueeze", ["vc", "uax"], ["vu"], name="unsq"), mk("Squeeze", ["vu", "uax"], ["vq"], name="squeeze"),
             mk("Sub", ["two", "vq"], ["y2"], name="rsub"),
             mk("Cast", ["ids"], ["idf"], name="cast", to=TensorProto.FLOAT),
             mk("Unsqueeze", ["idf", "lastax"], ["idu"], name="unsq2")]
    inits = [_w("emb", 20, 8), _w("g", 8), _w("b", 8), _w("wqkv", 8, 24), _i("heads", [1, 6, 2, 4]),
             ("scale", np.float32(2.0)),
             ("mask", np.tril(np.ones((6, 6), dtype=bool))),
             ("neg", np.float32(-1e4)), _i("ax", [3]),
             ("two", np.float32(2.0)), _i("st", [1, 0]), _i("en", [100, -1]),
             _i("sax", [1, 2]), _i("stp", [2, 1]), _i("uax", [0]), _i("lastax", [-1])]
    return make_model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 6])],
                      [("sq", [1, 2, 6]), ("y2", [1, 3, 14]),
                       helper.make_tensor_value_info("idu", TensorProto.FLOAT, [1, 6, 1])], inits, opset=21)


def _eager(model, feeds):
    torch = pytest.importorskip("torch")
    module = convert(model)
    with torch.inference_mode():
        got = module(*[torch.from_numpy(feeds[n]) for n in module.inputs])
    return [g.numpy() for g in got]


def _check_equal(model, feeds, rtol=1e-5):
    pytest.importorskip("torch")
    expected = ort.InferenceSession(model.SerializeToString()).run(None, feeds)
    got = _eager(model, feeds)
    for e, g in zip(expected, got, strict=True):
        assert g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=rtol, atol=rtol * max(1.0, float(np.abs(e).max())))


def test_a_convnet_equals_onnx_runtime():
    _check_equal(convnet(), {"x": RNG.standard_normal((1, 3, 16, 12)).astype(np.float32)})


def test_attention_pieces_equal_onnx_runtime():
    _check_equal(attention(), {"ids": RNG.integers(0, 20, (1, 6)).astype(np.int64)})


def test_a_node_without_converter_is_named():
    pytest.importorskip("torch")
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Hardmax", ["r"], ["y"], name="hard")]
    model = make_model(nodes, [("x", [1, 2, 4, 4])], [("y", [1, 2, 4, 4])], opset=21)
    with pytest.raises(Unconvertible, match=r"node 'hard' \(Hardmax\): no converter"):
        convert(model)
    nodes[1] = helper.make_node("Resize", ["r", "", "sc"], ["y"], name="up", mode="cubic")
    model = make_model(nodes, [("x", [1, 2, 4, 4])], [("y", [1, 2, 8, 8])],
                       [("sc", np.array([1, 1, 2, 2], np.float32))], opset=21)
    with pytest.raises(Unconvertible, match=r"node 'up' \(Resize\): mode cubic .*not converted"):
        convert(model)


def test_upsampling_equals_onnx_runtime():
    """ConvTranspose (stride 2, pads, output_padding), Resize nearest (asymmetric, floor) by
    scales and Resize linear (half_pixel) to sizes."""
    mk = helper.make_node
    nodes = [mk("ConvTranspose", ["x", "w"], ["t"], name="up", strides=[2, 2], pads=[1, 1, 1, 1],
                output_padding=[1, 1]),
             mk("Resize", ["t", "", "sc"], ["n"], name="nearest", mode="nearest",
                coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
             mk("Resize", ["n", "", "", "sz"], ["y"], name="linear", mode="linear")]
    model = make_model(nodes, [("x", [1, 3, 5, 4])], [("y", [1, 2, 15, 13])],
                       [_w("w", 3, 2, 3, 3), ("sc", np.array([1, 1, 2, 2], np.float32)), _i("sz", [1, 2, 15, 13])],
                       opset=21)
    _check_equal(model, {"x": RNG.standard_normal((1, 3, 5, 4)).astype(np.float32)})


def test_a_computed_shape_input_is_refused_by_name():
    pytest.importorskip("torch")
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("Reshape", ["x", "s"], ["y"], name="rs")]
    with pytest.raises(Unconvertible, match="no converter|is computed"):
        convert(make_model(nodes, [("x", [2, 3])], [("y", [2, 3])], opset=21))


@pytest.mark.parametrize("name", ["bert-small", "resnet18"])
def test_zoo_models_equal_onnx_runtime_eager(name):
    pytest.importorskip("torch")
    from fusesearch.pipeline import prepare
    from fusesearch.run import _reference

    # the model, weights (a scalar among them as one element), inputs and outputs `run` has
    canonical, weights, feeds, reference = _reference(prepare(f"zoo:{name}"), {}, 0, None)
    runs, clocks, info = baselines(canonical, weights, feeds, reference, 1e-4, modes={})
    assert list(runs) == ["torch_eager"] and clocks == {} and "failed" not in info
    assert info["device"] == "cpu" and info["torch"]


def test_torch_compile_of_a_tiny_model_equals_onnx_runtime():
    torch = pytest.importorskip("torch")
    model = convnet()
    x = RNG.standard_normal((1, 3, 16, 12)).astype(np.float32)
    expected = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    with torch.inference_mode():
        got = torch_baseline.compiled(convert(model), "default")(torch.from_numpy(x))[0].numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def _run_json(run_cli, path, *extra):
    code, stdout, stderr = run_cli("run", path, *FAST, "--json", *extra)
    assert code == 0, stderr
    return json.loads(stdout)


def _tiny():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Relu", ["h"], ["y"], name="relu")]
    return make_model(nodes, [("x", [4, 8])], [("y", [4, 6])], [_w("w", 8, 6)], opset=21)


@pytest.mark.skipif(not cpu.available(), reason="no C compiler")
def test_run_says_torch_is_not_installed_where_importing_it_fails(run_cli, tmp_path, monkeypatch):
    def absent():
        raise ImportError("No module named 'torch'")

    monkeypatch.setattr(torch_baseline, "load_torch", absent)
    doc = _run_json(run_cli, save(_tiny(), tmp_path / "t.onnx"), "--baselines", "torch")
    assert doc["torch"] == "not installed"
    assert not {"torch_eager", "torch_compile", "torch_compile_max_autotune"} & doc.keys()
    assert "plan" in doc and "ort_enable_all" in doc


@pytest.mark.skipif(not cpu.available(), reason="no C compiler")
def test_run_without_baselines_has_no_torch_entry(run_cli, tmp_path):
    assert "torch" not in _run_json(run_cli, save(_tiny(), tmp_path / "t.onnx"))


def test_an_unknown_baseline_is_bad_input(run_cli, tmp_path):
    code, _, stderr = run_cli("run", save(_tiny(), tmp_path / "t.onnx"), "--baselines", "tvm")
    assert code == 2
    assert stderr.strip().splitlines() == ["fusesearch: error: --baselines tvm: choose among torch"]


@pytest.mark.slow
@pytest.mark.skipif(not cpu.available(), reason="no C compiler")
def test_run_times_torch_eager_and_compile_beside_the_plan(run_cli, tmp_path):
    pytest.importorskip("torch")
    doc = _run_json(run_cli, save(_tiny(), tmp_path / "t.onnx"), "--baselines", "torch")
    for key in ("torch_eager", "torch_compile", "torch_compile_max_autotune"):
        assert {"median_s", "p20_s", "p80_s"} <= doc[key].keys() and doc[key]["n"] == 2
        assert doc["ratios"][f"plan_vs_{key}"] > 0
    assert doc["torch"]["torch"] and doc["torch"]["inductor"] == {"freezing": True, "inference_mode": True}
    assert "failed" not in doc["torch"]


def test_a_failed_compile_is_retried_and_keeps_its_options(monkeypatch):
    """A compiler that fails with the pattern matcher on (as Inductor's attention rewrite does on
    some masked attention) is tried again without it, and every later call runs without it too."""
    pytest.importorskip("torch")
    import torch._inductor.config as inductor

    def fake_compiled(module, mode):
        def run(*args):
            if inductor.pattern_matcher:
                raise RuntimeError("Attempting to broadcast a dimension of length 128")
            return module(*args)
        return run

    monkeypatch.setattr(torch_baseline, "compiled", fake_compiled)
    heard = []
    fn, got = torch_baseline._first_compile(lambda x: x + 1, "default", [1], heard.append)
    assert got == 2 and fn(2) == 3 and inductor.pattern_matcher
    assert heard == ["RuntimeError: Attempting to broadcast a dimension of length 128; "
                     "compiled with pattern_matcher=False"]
