"""Half precision end to end (`--dtype float16|bfloat16`): the conversion's structure (sensitive
ops stay float32 between Casts), plan + verify of a tiny BERT-like model and a conv model in both
half dtypes, generated C and emulated CUDA kernels of half pointwise / rowwise / gemm / conv groups
against ONNX Runtime within the dtype's tolerance, the cost model's half rates, `run` and
`measure` on half models, bad --dtype values, and every zoo model planned in float16."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from costmodels import get_device
from costmodels.roofline import compute_unit
from fusesearch import zoo
from fusesearch.api import plan as make_plan
from fusesearch.backends import cpu, emulate
from fusesearch.backends.codegen import generate
from fusesearch.groups import FusionGroup
from fusesearch.ir.canonicalize import to_proto
from fusesearch.ir.precision import KEEP_FLOAT32, SUFFIX32, to_half, tolerance, widened
from fusesearch.ir.shapes import ShapeBindings
from fusesearch.lowering import lower
from fusesearch.pipeline import prepare
from fusesearch.verify import all_values, compare, random_feeds, run
from tests.conftest import make_model, save, zoo_params

HALVES = ("float16", "bfloat16")
F, H = TensorProto.FLOAT, TensorProto.FLOAT16
rng = np.random.default_rng(0)


def w(*shape, scale=0.2):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def bert_like(seq=8, hidden=16):
    """One attention block with a LayerNorm and a decomposed (ReduceMean) norm, GELU via Erf."""
    h = hidden
    nodes = [
        helper.make_node("MatMul", ["x", "Wq"], ["q"], name="q"),
        helper.make_node("MatMul", ["x", "Wk"], ["k"], name="k"),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="kt"),
        helper.make_node("MatMul", ["q", "kt"], ["s"], name="scores"),
        helper.make_node("Mul", ["s", "scale"], ["ss"], name="scale"),
        helper.make_node("Softmax", ["ss"], ["p"], axis=-1, name="softmax"),
        helper.make_node("MatMul", ["p", "x"], ["ctx"], name="ctx"),
        helper.make_node("Add", ["ctx", "x"], ["res"], name="residual"),
        helper.make_node("LayerNormalization", ["res", "gamma", "beta"], ["ln"], axis=-1, name="ln"),
        helper.make_node("MatMul", ["ln", "W1"], ["f"], name="ffn"),
        helper.make_node("Add", ["f", "b1"], ["fb"], name="bias"),
        helper.make_node("Div", ["fb", "sqrt2"], ["fd"], name="div"),
        helper.make_node("Erf", ["fd"], ["fe"], name="erf"),
        helper.make_node("Add", ["fe", "one"], ["fo"], name="plus1"),
        helper.make_node("Mul", ["fb", "fo"], ["g"], name="gelu"),
        helper.make_node("ReduceMean", ["g"], ["mu"], axes=[-1], name="mean"),
        helper.make_node("Sub", ["g", "mu"], ["y"], name="center"),
    ]
    inits = [("Wq", w(h, h)), ("Wk", w(h, h)), ("scale", np.float32(0.25)), ("gamma", 1 + w(h)),
             ("beta", w(h)), ("W1", w(h, h)), ("b1", w(h)), ("sqrt2", np.float32(np.sqrt(2))),
             ("one", np.float32(1.0))]
    return make_model(nodes, [("x", [1, seq, h])], [("y", None), ("p", None)], inits)


def conv_model(c=8, hw=10):
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "W2"], ["c2"], group=c, pads=[1, 1, 1, 1], name="dw"),
             helper.make_node("Add", ["c2", "x"], ["a"], name="residual"),
             helper.make_node("MaxPool", ["a"], ["m"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
             helper.make_node("GlobalAveragePool", ["m"], ["y"], name="gap")]
    inits = [("W", w(c, c, 3, 3)), ("B", w(c)), ("W2", w(c, 1, 3, 3))]
    return make_model(nodes, [("x", [1, c, hw, hw])], [("y", None)], inits)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("half")
    return {"bert": save(bert_like(), tmp / "bert.onnx"), "conv": save(conv_model(), tmp / "conv.onnx")}


# -- the conversion ---------------------------------------------------------------------------

def _types(model: onnx.ModelProto) -> dict[str, int]:
    g = model.graph
    types = {t.name: t.data_type for t in g.initializer}
    types |= {vi.name: vi.type.tensor_type.elem_type for vi in (*g.input, *g.value_info, *g.output)}
    return types


@pytest.mark.parametrize("dtype", HALVES)
def test_sensitive_ops_stay_float32_between_casts(models, dtype):
    half = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}[dtype]
    prep = prepare(models["bert"], dtype=dtype)
    model = to_proto(prep.canonical)
    types = _types(model)
    producer = {o: n for n in model.graph.node for o in n.output}
    kept = [n for n in model.graph.node if n.op_type in KEEP_FLOAT32]
    assert {n.op_type for n in kept} == {"Softmax", "LayerNormalization", "ReduceMean"}
    for n in kept:
        assert all(types[t] in (F, TensorProto.INT64) for t in n.input if t), (n.op_type, [types[t] for t in n.input])
        assert all(types[t] == F for t in n.output if t), n.op_type
        first = n.input[0]  # the activation arrives through a Cast from half
        assert producer[first].op_type == "Cast" and types[producer[first].input[0]] == half
    ln = next(n for n in kept if n.op_type == "LayerNormalization")
    assert {t.name: t.data_type for t in model.graph.initializer}[ln.input[1]] == F  # its scale stays float32
    for n in model.graph.node:  # every other float node computes in half
        if n.op_type not in KEEP_FLOAT32 and n.op_type != "Cast":
            assert all(types[t] in (half, TensorProto.INT64) for t in (*n.input, *n.output) if t), n.name
    assert {vi.name: vi.type.tensor_type.elem_type for vi in model.graph.output} == {"y": half, "p": half}
    assert producer["p"].op_type == "Cast" and producer["p"].input[0] == "p" + SUFFIX32  # the output keeps its name
    assert prep.graph.tensors["x"].dtype == dtype and prep.passes[f"{dtype}_casts"] == len(
        [n for n in model.graph.node if n.op_type == "Cast"])


def test_fixed_float_inputs_and_shared_weights():
    """Resize's scales are tensor(float) in every opset: they stay float32; a weight read by a
    half node and a float32 one is stored twice, never cast at run time; float32 finite values
    beyond float16's range are clamped to its largest finite value."""
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["r"], mode="nearest", name="resize"),
             helper.make_node("Add", ["r", "b"], ["a"], name="add"),
             helper.make_node("LayerNormalization", ["a", "b", "b"], ["y"], axis=-1, name="ln"),
             helper.make_node("Add", ["y", "big"], ["z"], name="mask")]
    inits = [("scales", np.array([1, 1, 2, 2], np.float32)), ("b", np.ones(8, np.float32)),
             ("big", np.full(8, -1e9, np.float32))]
    model = make_model(nodes, [("x", [1, 1, 4, 4])], [("z", None)], inits, opset=21)
    model = onnx.shape_inference.infer_shapes(model)
    converted, _ = to_half(model, "float16")
    inits = {t.name: t for t in converted.graph.initializer}
    assert inits["scales"].data_type == F
    assert inits["b"].data_type == H and inits["b" + SUFFIX32].data_type == F
    ln = next(n for n in converted.graph.node if n.op_type == "LayerNormalization")
    assert list(ln.input[1:]) == ["b" + SUFFIX32] * 2
    assert onnx.numpy_helper.to_array(inits["big"]).min() == np.float16(-65504)
    assert not any(n.op_type == "Cast" and n.input[0] in inits for n in converted.graph.node)
    assert to_half(model, "float32")[0] is model


def test_widened_bfloat16_rounds_what_the_model_stores():
    """The bfloat16 reference: ONNX Runtime runs a float32 copy that rounds each stored value to
    bfloat16 (round to nearest even, as ml_dtypes) — equal to the rounded float32 result here."""
    import ml_dtypes

    nodes = [helper.make_node("Mul", ["x", "x"], ["y"], name="sq")]
    model = make_model(nodes, [("x", [64], TensorProto.BFLOAT16)], [("y", None, TensorProto.BFLOAT16)], opset=21)
    x = np.random.default_rng(1).standard_normal(64).astype(ml_dtypes.bfloat16)
    got = run(model, {"x": x})["y"]
    assert got.dtype == ml_dtypes.bfloat16
    want = (x.astype(np.float32) ** 2).astype(ml_dtypes.bfloat16)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    assert widened(model)[1] == {"y": np.dtype(ml_dtypes.bfloat16)}


# -- plan and verify --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("kind", ["bert", "conv"])
def test_plan_emit_and_verify_half_models(run_cli, models, tmp_path, kind, dtype):
    fused = tmp_path / "fused.onnx"
    code, out, err = run_cli("plan", models[kind], "--device", "h100-sxm", "--strategy", "greedy", "--dtype", dtype,
                             "--emit", fused, "--json")
    assert code == 0, err
    import json

    doc = json.loads(out)
    assert doc["run"]["verified"]["ok"] and doc["run"]["verified"]["rtol"] == tolerance(dtype)
    fused_model = onnx.load(str(fused))
    assert fused_model.graph.input[0].type.tensor_type.elem_type == (H if dtype == "float16" else TensorProto.BFLOAT16)
    code, out, err = run_cli("verify", models[kind], fused, "--dtype", dtype, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["ok"] and report["rtol"] == tolerance(dtype)


def test_verify_against_a_float32_fused_model_with_half_dtype_fails_clearly(run_cli, models, tmp_path):
    """A float32 fused model checked as float16: ONNX Runtime refuses its float32 inputs — exit 2."""
    fused = tmp_path / "fused32.onnx"
    assert run_cli("plan", models["bert"], "--device", "h100-sxm", "--strategy", "rules", "--emit", fused)[0] == 0
    code, _, err = run_cli("verify", models["bert"], fused, "--dtype", "float16")
    assert code == 2 and err.count("\n") == 1 and str(fused) in err, err


def test_api_plan_takes_dtype(models):
    p16 = make_plan(models["bert"], device="h100-sxm", strategy="greedy", dtype="float16")
    assert {g.kernel.dtype for g in p16.groups if g.kernel.template in ("gemm", "rowwise")} == {"float16"}
    lone = {}
    for dtype in ("float32", "float16"):
        p = make_plan(models["bert"], device="h100-sxm", strategy="none", dtype=dtype)
        lone[dtype] = next(g.kernel for g in p.groups if [p.graph.nodes[i].name for i in g.nodes] == ["ffn"])
    assert lone["float16"].read_bytes * 2 == lone["float32"].read_bytes  # half the bytes


# -- generated kernels ------------------------------------------------------------------------

def _group_check(path, dtype, names, run_kernel, skeleton=None):
    """The group of the nodes `names` (and the Casts the conversion put after them) generated and
    run on ONNX Runtime's values of its inputs; its outputs equal ONNX Runtime's within the
    dtype's tolerance."""
    prep = prepare(path, dtype=dtype)
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    g = prep.graph
    named = {n.id for n in g.nodes if n.name in names}
    casts = {n.id for n in g.nodes if n.op_type == "Cast" and g.producer(n.inputs[0]) in named}
    nodes = frozenset(named | casts)
    kernel = lower(prep.graph, FusionGroup(nodes))
    assert kernel.dtype == dtype
    gk = generate(prep.graph, kernel)
    if skeleton:
        assert gk.skeleton == skeleton
    assert any(a.dtype == dtype for a in gk.inputs) and "fs_" + dtype + "_store(" in gk.c_source
    got = run_kernel(gk, {a.tensor: values[a.tensor] for a in gk.inputs})
    diffs = compare({a.tensor: values[a.tensor] for a in gk.outputs}, got, rtol=tolerance(dtype))
    assert diffs and all(d.ok for d in diffs), diffs
    assert all(got[a.tensor].dtype == values[a.tensor].dtype for a in gk.outputs)
    return gk


GROUPS = {  # (model, node names in the group, CUDA skeleton)
    "pointwise": ("bert", ("div", "erf", "plus1", "gelu"), "grid-stride"),
    "rowwise": ("bert", ("residual", "ln"), "block-per-row"),  # LayerNorm in float32 between Casts
    "gemm": ("bert", ("ffn", "bias"), "mma"),  # CUDA: the tensor-core skeleton of the dtype
    "conv": ("conv", ("conv", "relu"), "mma"),  # C: the BLAS blocks over widened filters
    "depthwise": ("conv", ("dw", "residual"), None),  # C: the depthwise loop, taps widened
}


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("group", list(GROUPS))
def test_generated_c_half_kernels_equal_onnx_runtime(models, group, dtype):
    if not cpu.available():
        pytest.skip("no C compiler")
    kind, ops, _ = GROUPS[group]
    _group_check(models[kind], dtype, ops, cpu.run)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("group", list(GROUPS))
def test_emulated_cuda_half_kernels_equal_onnx_runtime(models, group, dtype):
    if not emulate.available():
        pytest.skip("no C++ compiler")
    kind, ops, skeleton = GROUPS[group]
    if skeleton == "mma":
        skeleton = {"float16": "mma-f16", "bfloat16": "mma-bf16"}[dtype]
    _group_check(models[kind], dtype, ops, emulate.run, skeleton)


# -- run, measure, cost -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("kind", ["bert", "conv"])
def test_run_half_model_end_to_end(run_cli, models, kind, dtype):
    """The C program against ONNX Runtime at the dtype's tolerance; the conv model's MaxPool runs as
    an ONNX Runtime node between generated segments (widened for bfloat16)."""
    if not cpu.available():
        pytest.skip("no C compiler")
    import json

    code, out, err = run_cli("run", models[kind], "--dtype", dtype, "--strategy", "greedy", "--repeat", "1",
                             "--warmup", "0", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["rtol"] == tolerance(dtype) and doc["max_rel_err"] <= tolerance(dtype)


@pytest.mark.parametrize("command", ["run", "verify"])
def test_a_model_stored_in_float16_is_checked_at_float16s_tolerance(run_cli, tmp_path, command):
    """No --dtype, but the model's own tensors are float16: its outputs are compared with float16's
    rtol, the same one `--dtype float16` gives (decided once, `prepared_tolerance`)."""
    if command == "run" and not cpu.available():
        pytest.skip("no C compiler")
    import json

    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"), helper.make_node("Tanh", ["a"], ["y"], name="tanh")]
    path = save(make_model(nodes, [("x", [4, 8], H)], [("y", [4, 8], H)]), tmp_path / "h.onnx")
    args = (("--strategy", "greedy", "--repeat", "1", "--warmup", "0") if command == "run"
            else (save(onnx.load(path), tmp_path / "copy.onnx"),))
    code, out, err = run_cli(command, path, *args, "--json")
    assert code == 0, err
    assert json.loads(out)["rtol"] == tolerance("float16")


def test_measure_half_model_checks_each_kernel(run_cli, models):
    if not cpu.available():
        pytest.skip("no C compiler")
    import json

    code, out, err = run_cli("measure", models["bert"], "--dtype", "float16", "--strategy", "greedy",
                             "--budget", "0.01", "--no-cache", "--json")
    assert code == 0, err
    rows = json.loads(out)["groups"]
    measured = [r for r in rows if r["max_rel_err"] is not None]
    assert measured and max(r["max_rel_err"] for r in measured) <= tolerance("float16")


def test_half_library_anchors_priced_at_half_tensor_core_rates(models):
    h100 = get_device("h100-sxm")
    for dtype, unit in (("float16", "fp16-tensor-core"), ("bfloat16", "bf16-tensor-core")):
        p = make_plan(models["bert"], device="h100-sxm", strategy="none", dtype=dtype)
        anchors = [g for g in p.groups if g.kernel.impl == "library" and g.kernel.tc_flops]
        assert anchors and all(g.kernel.dtype == dtype for g in anchors)
        assert {compute_unit(g.kernel.spec(), h100) for g in anchors} == {unit}
        assert {g.cost.compute_unit for g in anchors} == {unit}


# -- bad values, zoo --------------------------------------------------------------------------

@pytest.mark.parametrize("command", [
    ["plan", "MODEL", "--device", "h100-sxm"],
    ["measure", "MODEL"],
    ["run", "MODEL"],
    ["verify", "MODEL", "MODEL"],
    ["export", "plan.json", "MODEL", "--emit", "out.onnx"],
])
@pytest.mark.parametrize("value", ["half", "fp16", "float64", ""])
def test_bad_dtype_exits_2_naming_the_option(run_cli, models, command, value):
    args = [models["bert"] if a == "MODEL" else a for a in command]
    code, out, err = run_cli(*args, "--dtype", value)
    assert code == 2 and err.startswith(f"fusesearch: error: --dtype {value}: unknown; choose one of float32, "
                                        "float16, bfloat16") and err.count("\n") == 1, err


def test_plan_zoo_bert_small_float16_on_h100(run_cli):
    import json

    code, out, err = run_cli("plan", "zoo:bert-small", "--dtype", "float16", "--device", "h100-sxm", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["totals"]["kernels"] < 120 and doc["solver"]["status"] in ("OPTIMAL", "FEASIBLE")


@functools.lru_cache(maxsize=1)
def _zoo_half(name: str):
    dims = {"seq": 16} if "seq" in zoo.ZOO[name].default_dims else {}
    prep = prepare(f"zoo:{name}", ShapeBindings.parse(dims=[f"{k}={v}" for k, v in dims.items()]), dtype="float16")
    return prep, make_plan(f"zoo:{name}", device="h100-sxm", strategy="rules", prepared=prep)


@pytest.mark.parametrize("name", zoo_params())
def test_every_zoo_model_plans_in_float16(name):
    """Structural: every float activation is float16 except the inputs and outputs of ops kept in
    float32 (and their Casts; weights typed tensor(float), Resize's scales, stay float32); every
    kernel that writes float16 is a float16 kernel."""
    prep, p = _zoo_half(name)
    g = prep.graph
    for node in g.nodes:
        floats = {g.tensors[t].dtype for t in (*node.inputs, *node.outputs)
                  if t and g.tensors[t].dtype in ("float32", "float16") and not g.tensors[t].constant}
        if node.op_type in KEEP_FLOAT32 or node.op_type in ("Loop", "If", "Scan"):
            assert "float16" not in {g.tensors[t].dtype for t in node.outputs if t}, node.name
        elif node.op_type != "Cast":
            assert floats <= {"float16"}, (node.name, node.op_type, floats)
    assert sum(len(grp.nodes) for grp in p.groups) == len(g)
    for grp in p.groups:
        outs = {g.tensors[t].dtype for t in grp.kernel.outputs}
        if "float16" in outs:
            assert grp.kernel.dtype == "float16", grp.kernel.ops


@pytest.mark.parametrize("name, dtype, dims", [("bert-small", "float16", ["--dim", "seq=16"]),
                                               ("mobilenetv2", "bfloat16", [])])
def test_small_zoo_models_plan_and_verify_in_half(run_cli, tmp_path, name, dtype, dims):
    """Numerics on two zoo models: the fused half model equals the converted one in ONNX Runtime."""
    import json

    code, out, err = run_cli("plan", f"zoo:{name}", "--device", "h100-sxm", "--strategy", "greedy", "--dtype", dtype,
                             *dims, "--emit", tmp_path / "fused.onnx", "--json")
    assert code == 0, err
    verified = json.loads(out)["run"]["verified"]
    assert verified["ok"] and verified["rtol"] == tolerance(dtype)


def custom_op_model():
    """A node ONNX Runtime has no kernel for (a custom domain): kept float32 by the conversion."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("FancyOp", ["r"], ["y"], domain="com.example", name="fancy")]
    model = make_model(nodes, [("x", [4, 8])], [("y", [4, 8])])
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    return model


@pytest.mark.parametrize("command, says", [
    (["run", "MODEL", "--dtype", "float16"], "cannot compute the reference values: "),
    (["plan", "MODEL", "--device", "h100-sxm", "--dtype", "bfloat16", "--emit", "OUT"], "cannot verify: "),
])
def test_a_converted_model_onnx_runtime_cannot_run_exits_2_naming_the_op(run_cli, tmp_path, command, says):
    path = save(custom_op_model(), tmp_path / "custom.onnx")
    args = [path if a == "MODEL" else tmp_path / "out.onnx" if a == "OUT" else a for a in command]
    code, _, err = run_cli(*args)
    assert code == 2 and err.count("\n") == 1, err
    assert says + "ONNX Runtime has no kernel for op FancyOp (domain com.example) at node fancy" in err
    assert not (tmp_path / "out.onnx").exists()
