"""Zoo models: they build, pass the full ONNX checker, are deterministic, run in ONNX Runtime with
finite outputs, and contain the exporter idioms the loader and canonicalizer are tested against.

Big models are built and serialized once per module (the `zoo` fixture) and freed afterwards.
"""

from __future__ import annotations

import collections
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from fusesearch.errors import BadInput
from fusesearch.zoo import ZOO, ZooEntry, build_model, list_models
from tests.conftest import zoo_params

NAMES = list(ZOO)
SMALL_GPT2 = {"layers": 2, "hidden": 64, "heads": 2, "vocab": 1000}


class Built:
    """A model built once, its serialized bytes, and its ops (subgraphs included)."""

    def __init__(self, name: str) -> None:
        self.model = build_model(name)
        self.data = self.model.SerializeToString()
        self.nodes = list(_all_nodes(self.model.graph))
        self.ops = collections.Counter(n.op_type for n in self.nodes)


def _all_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attr.g)


@pytest.fixture(scope="module")
def zoo():
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            cache[name] = Built(name)
        return cache[name]

    yield get
    cache.clear()


def _feeds(session: ort.InferenceSession, dims: dict[str, int], seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {}
    for arg in session.get_inputs():
        shape = [dims[d] if isinstance(d, str) else d for d in arg.shape]
        if arg.type == "tensor(int64)" and "mask" in arg.name:
            feeds[arg.name] = np.ones(shape, np.int64)
        elif arg.type == "tensor(int64)":
            feeds[arg.name] = rng.integers(0, 1000, shape, dtype=np.int64)  # below every vocab
        else:
            feeds[arg.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _session(data: bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return _session(model.SerializeToString()).run(None, feeds)


# ---- registry ---------------------------------------------------------------------------------
def test_listing_order_and_entries():
    assert [e.name for e in list_models()] == NAMES
    assert NAMES[:2] == ["resnet18", "resnet50"]
    for entry in list_models():
        assert isinstance(entry, ZooEntry)
        assert entry.description and "\n" not in entry.description
        assert entry.default_dims["batch"] == 1


def test_unknown_name_raises_bad_input():
    with pytest.raises(BadInput, match=r"unknown zoo model 'nope'; available: resnet18, "
                       r"resnet50, .*rnn-control \(see `fusesearch zoo list`\)"):
        build_model("nope")


def test_bad_params_raise_bad_input():
    with pytest.raises(BadInput, match="resnet50.*no parameter layers"):
        build_model("resnet50", layers=2)
    with pytest.raises(BadInput, match="multiple of heads"):
        build_model("bert-small", hidden=100, heads=3)


# ---- every model ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", zoo_params())
def test_builds_and_passes_full_check(zoo, name):
    built = zoo(name)
    onnx.checker.check_model(built.data, full_check=True)
    model = built.model
    assert model.producer_name == "fusesearch.zoo"
    assert model.graph.name == name
    assert model.doc_string
    names = [n.name for n in built.nodes]
    assert all(names) and len(names) == len(set(names))


@pytest.mark.parametrize("name", zoo_params())
def test_rebuild_is_byte_identical(zoo, name):
    assert build_model(name).SerializeToString() == zoo(name).data


@pytest.mark.parametrize("name", NAMES)
def test_inputs_have_symbolic_dims(zoo, name):
    entry = ZOO[name]
    for value in zoo(name).model.graph.input:
        params = [d.dim_param for d in value.type.tensor_type.shape.dim if d.dim_param]
        assert params and params[0] == "batch"
        assert set(params) <= set(entry.default_dims)


@pytest.mark.parametrize("name", NAMES)
def test_runs_in_onnxruntime_with_finite_outputs(zoo, name):
    dims = dict(ZOO[name].default_dims)
    if "past" in dims:  # a decode step's present keys and values hold the past and the new position
        dims["total"] = dims["past"] + 1
    session = _session(zoo(name).data)
    outputs = session.run(None, _feeds(session, dims))
    for arg, value in zip(session.get_outputs(), outputs, strict=True):
        assert list(value.shape) == [dims.get(d, d) for d in arg.shape], arg.name
        assert np.isfinite(value).all(), arg.name
        assert np.abs(value).max() < 1e3, arg.name  # activations stay O(1)


@pytest.mark.parametrize("name", ["resnet18", "mobilenetv2", "vit-small", "bert-small",
                                  "yolo-neck", "rnn-control"])
def test_symbolic_dims_bind_to_other_values(zoo, name):
    dims = {"batch": 2, "seq": 9}
    session = _session(zoo(name).data)
    outputs = session.run(None, _feeds(session, dims))
    for arg, value in zip(session.get_outputs(), outputs, strict=True):
        assert list(value.shape) == [dims.get(d, d) for d in arg.shape], arg.name


def test_small_gpt2_binds_other_dims():
    session = _session(build_model("gpt2", **SMALL_GPT2).SerializeToString())
    (logits,) = session.run(None, _feeds(session, {"batch": 3, "seq": 5}))
    assert logits.shape == (3, 5, 1000) and np.isfinite(logits).all()


# ---- idioms each model must exercise ----------------------------------------------------------
def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _opset(built: Built) -> int:
    return next(o.version for o in built.model.opset_import if o.domain in ("", "ai.onnx"))


REQUIRED_OPS = {
    "resnet18": {"Sum", "Conv", "BatchNormalization", "Relu", "MaxPool", "GlobalAveragePool",
                 "Flatten", "Gemm"},
    "resnet50": {"Add", "Conv", "BatchNormalization", "Relu", "MaxPool", "GlobalAveragePool",
                 "Flatten", "Gemm"},
    "mobilenetv2": {"Clip", "Conv", "BatchNormalization", "Add", "Dropout", "GlobalAveragePool",
                    "Reshape", "Gemm"},
    "vit-small": {"Conv", "Reshape", "Transpose", "Concat", "LayerNormalization", "MatMul",
                  "Softmax", "Erf", "Gather", "Gemm"},
    "bert-small": {"Gather", "Constant", "ConstantOfShape", "ReduceMean", "Sub", "Pow", "Sqrt",
                   "Div", "Shape", "Unsqueeze", "Concat", "Reshape", "Transpose", "Cast",
                   "Softmax", "Dropout", "Identity", "Erf", "Gemm", "Tanh", "MatMul", "Add"},
    "gpt2": {"LayerNormalization", "Trilu", "ConstantOfShape", "Where", "Split", "Pow", "Tanh",
             "Transpose", "MatMul", "Softmax"},
    "llama-prefill": {"Gather", "Pow", "ReduceMean", "Sqrt", "Reciprocal", "Slice", "Neg", "Concat",
                      "Expand", "Trilu", "Where", "Sigmoid", "Softmax", "MatMul", "Range"},
    "llama-decode": {"Gather", "Pow", "ReduceMean", "Sqrt", "Reciprocal", "Slice", "Neg", "Concat",
                     "Expand", "Sigmoid", "Softmax", "MatMul", "Shape"},
    "unet": {"Conv", "BatchNormalization", "Relu", "MaxPool", "ConvTranspose", "Concat"},
    "yolo-neck": {"Sigmoid", "Mul", "Resize", "Concat", "Conv", "BatchNormalization"},
    "rnn-control": {"Loop", "If", "MatMul", "Add", "Tanh", "ReduceSum", "Greater"},
}
REQUIRED_OPS["vit-base"] = REQUIRED_OPS["vit-small"]
REQUIRED_OPS["bert-base"] = REQUIRED_OPS["bert-small"]
OPSETS = {"resnet18": 9, "resnet50": 13, "mobilenetv2": 10, "vit-small": 17, "vit-base": 17,
          "bert-base": 12, "bert-small": 12, "gpt2": 17, "llama-prefill": 17,
          "llama-decode": 17, "unet": 13, "yolo-neck": 11,
          "rnn-control": 13}


@pytest.mark.parametrize("name", NAMES)
def test_required_ops_and_opset(zoo, name):
    built = zoo(name)
    assert REQUIRED_OPS[name] <= set(built.ops), REQUIRED_OPS[name] - set(built.ops)
    assert _opset(built) == OPSETS[name]


def test_resnet50_has_175_nodes(zoo):
    ops = zoo("resnet50").ops
    assert sum(ops.values()) == 175
    assert ops == {"Conv": 53, "BatchNormalization": 53, "Relu": 49, "Add": 16, "MaxPool": 1,
                   "GlobalAveragePool": 1, "Flatten": 1, "Gemm": 1}


def test_conv_models_keep_batchnorm_explicit(zoo):
    for name in ("resnet18", "resnet50", "mobilenetv2", "unet", "yolo-neck"):
        built = zoo(name)
        convs = {n.output[0] for n in built.nodes if n.op_type == "Conv" and len(n.input) == 2}
        bns = [n for n in built.nodes if n.op_type == "BatchNormalization"]
        assert bns and all(n.input[0] in convs for n in bns), name


def test_resnet18_sums_are_residuals(zoo):
    sums = [n for n in zoo("resnet18").nodes if n.op_type == "Sum"]
    assert len(sums) == 8 and all(len(n.input) == 2 for n in sums)


def test_mobilenetv2_opset10_idioms(zoo):
    built = zoo("mobilenetv2")
    clips = [n for n in built.nodes if n.op_type == "Clip"]
    assert clips and all(len(n.input) == 1 and _attrs(n) == {"min": 0.0, "max": 6.0}
                         for n in clips)
    depthwise = [n for n in built.nodes if n.op_type == "Conv" and _attrs(n)["group"] > 1]
    assert len(depthwise) == 17
    (dropout,) = [n for n in built.nodes if n.op_type == "Dropout"]
    assert len(dropout.input) == 1 and _attrs(dropout)["ratio"] == pytest.approx(0.2)


def test_vit_idioms(zoo):
    built = zoo("vit-small")
    patch = next(n for n in built.nodes if n.op_type == "Conv")
    assert _attrs(patch)["kernel_shape"] == [16, 16] and _attrs(patch)["strides"] == [16, 16]
    assert built.ops["LayerNormalization"] == 25 and built.ops["Softmax"] == 12
    assert all(_attrs(n)["axis"] == -1 for n in built.nodes if n.op_type == "Softmax")
    head_input = next(n for n in built.nodes if n.op_type == "Gemm").input[0]
    gather = next(n for n in built.nodes if n.output[0] == head_input)
    assert gather.op_type == "Gather" and _attrs(gather)["axis"] == 1


def test_bert_idioms(zoo):
    built = zoo("bert-small")
    assert {i.name for i in built.model.graph.input} == {"input_ids", "attention_mask"}
    assert all(i.type.tensor_type.elem_type == onnx.TensorProto.INT64
               for i in built.model.graph.input)
    means = [n for n in built.nodes if n.op_type == "ReduceMean"]
    assert len(means) == 2 * 5 and all(_attrs(n)["axes"] == [-1] for n in means)
    assert built.ops["Dropout"] == 1 + 3 * 2 and built.ops["Identity"] >= 1
    assert not any(n.op_type == "LayerNormalization" for n in built.nodes)
    assert built.ops["Shape"] >= 1 + 4 * 2  # the embedding, then 3 splits + 1 merge per layer
    reshape_targets = {n.input[1] for n in built.nodes if n.op_type == "Reshape"}
    initializers = {t.name for t in built.model.graph.initializer}
    assert reshape_targets and not reshape_targets & initializers  # all computed by Concat
    # the token-type table is a Constant node's output, not an initializer
    gathers = [n for n in built.nodes if n.op_type == "Gather" and n.input[0] not in initializers]
    assert any(next(p for p in built.nodes if n.input[0] in p.output).op_type == "Constant"
               for n in gathers)


def test_bert_base_sizes(zoo):
    built = zoo("bert-base")
    shapes = {t.name: list(t.dims) for t in built.model.graph.initializer}
    assert shapes["word_embeddings"] == [30522, 768]
    assert built.ops["Softmax"] == 12 and built.ops["Erf"] == 12


def test_bert_small_params():
    model = build_model("bert-small", layers=3, hidden=64, heads=4, intermediate=128, vocab=500)
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert ops["Softmax"] == 3
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    assert shapes["word_embeddings"] == [500, 64]


def test_gpt2_idioms_and_sizes(zoo):
    built = zoo("gpt2")
    shapes = {t.name: list(t.dims) for t in built.model.graph.initializer}
    assert shapes["wte"] == [50257, 768] and shapes["wpe"] == [1024, 768]
    assert built.ops["Split"] == 12 and built.ops["Where"] == 12
    head = next(n for n in built.nodes if n.output[0] == "logits")
    tied = next(n for n in built.nodes if n.output[0] == head.input[1])
    assert head.op_type == "MatMul" and tied.op_type == "Transpose" and tied.input[0] == "wte"


def test_yolo_fan_out_and_resize(zoo):
    built = zoo("yolo-neck")
    assert len(built.model.graph.output) == 3
    resizes = [n for n in built.nodes if n.op_type == "Resize"]
    assert resizes and all(len(n.input) == 3 and _attrs(n)["mode"] == b"nearest"
                           for n in resizes)
    uses = collections.Counter(i for n in built.nodes for i in n.input)
    fan_out = [n for n in built.nodes if n.op_type == "Mul" and uses[n.output[0]] >= 2]
    assert len(fan_out) >= 3


def test_rnn_control_subgraphs(zoo):
    built = zoo("rnn-control")
    loop = next(n for n in built.model.graph.node if n.op_type == "Loop")
    body_ops = {n.op_type for n in _attrs(loop)["body"].node}
    assert {"MatMul", "Add", "Tanh"} <= body_ops
    gate = next(n for n in built.model.graph.node if n.op_type == "If")
    branches = _attrs(gate)
    then_ops = [n.op_type for n in branches["then_branch"].node]
    else_ops = [n.op_type for n in branches["else_branch"].node]
    assert then_ops != else_ops


# ---- numerics of the semantic idioms ----------------------------------------------------------
def test_gpt2_mask_is_causal():
    model = build_model("gpt2", **SMALL_GPT2)
    ids = np.random.default_rng(1).integers(0, 1000, (1, 16), dtype=np.int64)
    changed = ids.copy()
    changed[0, 10:] = (changed[0, 10:] + 7) % 1000
    session = _session(model.SerializeToString())
    a, b = (session.run(None, {"input_ids": x})[0] for x in (ids, changed))
    np.testing.assert_allclose(a[:, :10], b[:, :10], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[:, 10:], b[:, 10:])


def _llama_io(model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    return [v.name for v in model.graph.input], [v.name for v in model.graph.output]


def test_llama_gqa_shapes_and_cache_interface():
    sizes = {"layers": 3, "hidden": 96, "heads": 6, "kv_heads": 2, "intermediate": 128}
    prefill, decode = build_model("llama-prefill", **sizes), build_model("llama-decode", **sizes)
    caches = [f"{i}.{kv}" for i in range(3) for kv in ("key", "value")]
    assert _llama_io(prefill) == (["input_ids"], [f"present.{c}" for c in caches] + ["logits"])
    assert _llama_io(decode) == (["input_ids"] + [f"past_key_values.{c}" for c in caches],
                                 [f"present.{c}" for c in caches] + ["logits"])
    past = decode.graph.input[1].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in past] == ["batch", 2, "past", 16]  # kv_heads, head_dim
    ops = collections.Counter(n.op_type for n in decode.graph.node)
    assert ops["Expand"] == 2 * 3 and ops["Neg"] == 2 * 3 and ops["Trilu"] == 0  # 3 query heads per kv head
    assert collections.Counter(n.op_type for n in prefill.graph.node)["Trilu"] == 1
    weights = {t.name: t.dims for t in prefill.graph.initializer}
    assert weights["matmul_1.weight"] == [96, 32]  # k_proj: kv_heads · head_dim


def test_llama_decode_step_continues_the_prefill():
    """Prefill of n tokens ends with the same logits as prefill of n-1 tokens followed by one decode
    step fed its present keys and values: rotary positions, the cache and GQA agree."""
    ids = np.random.default_rng(3).integers(0, 1000, (2, 9), dtype=np.int64)
    prefill = _session(build_model("llama-prefill").SerializeToString())
    decode = _session(build_model("llama-decode").SerializeToString())
    names = [o.name for o in prefill.get_outputs()]
    full = prefill.run(None, {"input_ids": ids})[-1]
    cache = dict(zip(names, prefill.run(None, {"input_ids": ids[:, :-1]}), strict=True))
    feeds = {"input_ids": ids[:, -1:]}
    feeds.update({i.name: cache[i.name.replace("past_key_values", "present")]
                  for i in decode.get_inputs() if i.name != "input_ids"})
    step = dict(zip(names, decode.run(None, feeds), strict=True))
    np.testing.assert_allclose(step["logits"][:, 0], full[:, -1], rtol=1e-4, atol=1e-4)
    assert step["present.1.value"].shape == (2, 2, 9, 16)


def test_llama_mask_is_causal():
    session = _session(build_model("llama-prefill").SerializeToString())
    ids = np.random.default_rng(4).integers(0, 1000, (1, 12), dtype=np.int64)
    changed = ids.copy()
    changed[0, 6:] = (changed[0, 6:] + 5) % 1000
    a, b = (session.run(None, {"input_ids": x})[-1] for x in (ids, changed))
    np.testing.assert_allclose(a[:, :6], b[:, :6], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[:, 6:], b[:, 6:])


def test_llama_full_size_is_shapes_only_unless_asked():
    """7B-class shapes: no weight is drawn or stored (each is an input of its static shape)."""
    from fusesearch.zoo.llama import LLAMA_8B

    model = build_model("llama-decode", **{**LLAMA_8B, "layers": 1})
    assert model.ByteSize() < 10_000_000  # the rotary tables (8 MB) only; the weights would be 32 GB
    inputs = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input}
    assert inputs["matmul_0.weight"] == [4096, 4096] and inputs["embed_tokens"] == [128256, 4096]
    assert all(t.name.startswith(("rope.", "scalar", "ints")) for t in model.graph.initializer)
    drawn = build_model("llama-decode", layers=1, weights=1)
    assert "matmul_0.weight" in {t.name for t in drawn.graph.initializer}
    assert {v.name for v in build_model("llama-decode", layers=1, weights=0).graph.input} >= {"matmul_0.weight"}
    with pytest.raises(BadInput, match="weights=2"):
        build_model("llama-decode", weights=2)
    with pytest.raises(BadInput, match="multiple of kv_heads"):
        build_model("llama-prefill", heads=4, kv_heads=3)


def test_bert_attention_mask_hides_padding():
    model = build_model("bert-small")
    session = _session(model.SerializeToString())
    ids = np.random.default_rng(2).integers(0, 1000, (1, 12), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[0, 8:] = 0
    changed = ids.copy()
    changed[0, 8:] = (changed[0, 8:] + 3) % 1000
    a, b = (session.run(None, {"input_ids": x, "attention_mask": mask})[0] for x in (ids, changed))
    np.testing.assert_allclose(a[:, :8], b[:, :8], rtol=1e-4, atol=1e-4)


def _rnn_hidden(model: onnx.ModelProto, x: np.ndarray) -> tuple[np.ndarray, dict]:
    """The Loop's final hidden state, computed in numpy from the model's initializers."""
    w = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    encoder = next(n for n in model.graph.node if n.op_type == "MatMul").input[1]
    bias = next(n for n in model.graph.node if n.op_type == "Add").input[1]
    h = np.tanh(x @ w[encoder] + w[bias])
    for _ in range(int(w["loop.trip_count"])):
        h = np.tanh(h @ w["rnn.w_hh"] + x @ w["rnn.w_xh"] + w["rnn.bias"])
    return h, w


def _rnn_reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    h, w = _rnn_hidden(model, x)
    h = np.maximum(h * 2, 0) if h.sum() > 0 else -1 / (1 + np.exp(-(h + 1)))
    head = [n for n in model.graph.node if n.op_type in ("MatMul", "Add")][-2:]
    logits = h @ w[head[0].input[1]] + w[head[1].input[1]]
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_rnn_control_matches_reference_on_both_branches():
    model = build_model("rnn-control")
    session = _session(model.SerializeToString())
    taken = set()
    for seed in range(8):
        x = np.random.default_rng(seed).standard_normal((2, 16)).astype(np.float32) * 3
        got = session.run(None, {"features": x})[0]
        np.testing.assert_allclose(got, _rnn_reference(model, x), rtol=1e-4, atol=1e-6)
        taken.add(bool(_rnn_hidden(model, x)[0].sum() > 0))
    assert taken == {True, False}


def test_weights_are_scaled():
    model = build_model("resnet18")
    conv = next(t for t in model.graph.initializer if t.name == "conv_1.weight")
    values = onnx.numpy_helper.to_array(conv)
    fan_in = math.prod(values.shape[1:])
    assert 0.5 < values.std() * math.sqrt(fan_in) < 2.0
