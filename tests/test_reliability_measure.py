"""`measure` on models the code generator cannot take whole, and the messages around it.

Exported models in their exporters' idioms (torch `.half()`, an ONNX Runtime QDQ quantization, a
torch `x.float() @ w` on int8 input, a product reduction): the plan fuses a group the generator refuses, and
measure times it node by node through ONNX Runtime ("library per node", the refusal kept as the
reason) — exit 0, valid JSON, every group timed or with its reason, every timed output equal to
ONNX Runtime's. The idioms it takes whole (torch hardswish at opset 13, paddle2onnx's explicit Pad
before a Conv, bilinear upsampling, a BatchNormalization that cannot fold, a gather_nd) run as one
generated kernel. A dtype ONNX Runtime cannot hand back, or a node that
cannot run alone, is exit 2 naming the group, the node, the op and the dtype. Then the messages:
calibrate's shape flags, one device for plan / measure, `report FILE`, no stray blank line."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from onnx import TensorProto, helper

from fusesearch.backends import cpu
from tests.conftest import make_model, save

needs_cc = pytest.mark.skipif(not cpu.available(), reason="no C compiler")
RNG = np.random.default_rng(0)


def _w(*shape, dtype=np.float32):
    return (RNG.standard_normal(shape) * 0.2).astype(dtype)


def torch_half_conv_relu():
    """torch: `model.half()` then torch.onnx.export — float16 input, weights and activations."""
    nodes = [helper.make_node("Conv", ["x", "conv.weight", "conv.bias"], ["/conv/Conv_output_0"], name="/conv/Conv",
                              kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["/conv/Conv_output_0"], ["y"], name="/relu/Relu")]
    inits = [("conv.weight", _w(8, 3, 3, 3, dtype=np.float16)), ("conv.bias", _w(8, dtype=np.float16))]
    return make_model(nodes, [("x", [1, 3, 16, 16], TensorProto.FLOAT16)], [("y", None, TensorProto.FLOAT16)], inits)


def ort_qdq_conv():
    """onnxruntime.quantization.quantize_static (QDQ format): activations Q -> DQ, int8 weights DQ."""
    nodes = [helper.make_node("QuantizeLinear", ["input", "input_scale", "input_zero_point"],
                              ["input_QuantizeLinear_Output"], name="input_QuantizeLinear"),
             helper.make_node("DequantizeLinear", ["input_QuantizeLinear_Output", "input_scale", "input_zero_point"],
                              ["input_DequantizeLinear_Output"], name="input_DequantizeLinear"),
             helper.make_node("DequantizeLinear", ["conv.weight_quantized", "conv.weight_scale",
                                                   "conv.weight_zero_point"],
                              ["conv.weight_DequantizeLinear_Output"], name="conv.weight_DequantizeLinear"),
             helper.make_node("Conv", ["input_DequantizeLinear_Output", "conv.weight_DequantizeLinear_Output"],
                              ["conv_output"], name="/conv/Conv", kernel_shape=[3, 3]),
             helper.make_node("Relu", ["conv_output"], ["output"], name="/relu/Relu")]
    inits = [("input_scale", np.float32(0.02)), ("input_zero_point", np.uint8(128)),
             ("conv.weight_quantized", RNG.integers(-127, 128, (8, 3, 3, 3)).astype(np.int8)),
             ("conv.weight_scale", np.float32(0.01)), ("conv.weight_zero_point", np.int8(0))]
    return make_model(nodes, [("input", [1, 3, 12, 12])], [("output", None)], inits, opset=13)


def torch_int8_matmul():
    """torch: `x.float() @ w + b` on an int8 input — a Cast from int8, then MatMul (+ Add: one Gemm)."""
    nodes = [helper.make_node("Cast", ["x"], ["/Cast_output_0"], name="/Cast", to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["/Cast_output_0", "onnx::MatMul_7"], ["/MatMul_output_0"], name="/MatMul"),
             helper.make_node("Add", ["/MatMul_output_0", "b"], ["y"], name="/Add")]
    inits = [("onnx::MatMul_7", _w(16, 8)), ("b", _w(8))]
    return make_model(nodes, [("x", [4, 16], TensorProto.INT8)], [("y", None)], inits)


def torch_hardswish():
    """torch.onnx.export of Conv + nn.Hardswish at opset 13: HardSigmoid(1/6, 0.5) then Mul."""
    nodes = [helper.make_node("Conv", ["input", "features.0.weight"], ["/features/features.0/Conv_output_0"],
                              name="/features/features.0/Conv", kernel_shape=[3, 3]),
             helper.make_node("HardSigmoid", ["/features/features.0/Conv_output_0"],
                              ["/features/features.2/HardSigmoid_output_0"], name="/features/features.2/HardSigmoid",
                              alpha=1.0 / 6, beta=0.5),
             helper.make_node("Mul", ["/features/features.0/Conv_output_0", "/features/features.2/HardSigmoid_output_0"],
                              ["output"], name="/features/features.2/Mul")]
    return make_model(nodes, [("input", [1, 3, 12, 12])], [("output", None)], [("features.0.weight", _w(8, 3, 3, 3))],
                      opset=13)


def paddle_pad_conv():
    """paddle2onnx: an explicit Pad (pads and value as initializers) before a Conv."""
    nodes = [helper.make_node("Pad", ["x", "pad2d_0.pads", "pad2d_0.value"], ["pad2d_0.tmp_0"], name="p2o.Pad.0",
                              mode="constant"),
             helper.make_node("Conv", ["pad2d_0.tmp_0", "conv2d_0.w_0"], ["conv2d_0.tmp_0"], name="p2o.Conv.0",
                              kernel_shape=[3, 3])]
    inits = [("pad2d_0.pads", np.int64([0, 0, 1, 1, 0, 0, 1, 1])), ("pad2d_0.value", np.float32(0)),
             ("conv2d_0.w_0", _w(8, 3, 3, 3))]
    return make_model(nodes, [("x", [1, 3, 12, 12])], [("conv2d_0.tmp_0", None)], inits, opset=11)


def paddle_conv_bilinear_resize():
    """paddle2onnx: Conv then a bilinear upsample (Resize mode linear, scales as an initializer)."""
    nodes = [helper.make_node("Conv", ["x", "conv2d_0.w_0"], ["conv2d_0.tmp_0"], name="p2o.Conv.0", kernel_shape=[1, 1]),
             helper.make_node("Resize", ["conv2d_0.tmp_0", "", "p2o.Resize.scales"], ["y"], name="p2o.Resize.0",
                              mode="linear", coordinate_transformation_mode="half_pixel")]
    inits = [("conv2d_0.w_0", _w(4, 3, 1, 1)), ("p2o.Resize.scales", np.float32([1, 1, 2, 2]))]
    return make_model(nodes, [("x", [1, 3, 8, 8])], [("y", None)], inits, opset=11)


def torch_relu_batchnorm():
    """A BatchNormalization after a ReLU (nothing to fold it into) behind a Conv."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="/conv/Conv", kernel_shape=[3, 3]),
             helper.make_node("Relu", ["c"], ["r"], name="/relu/Relu"),
             helper.make_node("BatchNormalization", ["r", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"],
                              ["y"], name="/bn/BatchNormalization", epsilon=1e-5)]
    inits = [("w", _w(4, 3, 3, 3)), ("bn.weight", _w(4) + 1), ("bn.bias", _w(4)), ("bn.running_mean", _w(4)),
             ("bn.running_var", np.abs(_w(4)) + 0.5)]
    return make_model(nodes, [("x", [1, 3, 10, 10])], [("y", None)], inits)


def paddle_relu_gather_nd():
    """paddle2onnx: relu then gather_nd (GatherND with int64 indices as an initializer)."""
    nodes = [helper.make_node("Relu", ["x"], ["relu_0.tmp_0"], name="p2o.Relu.0"),
             helper.make_node("GatherND", ["relu_0.tmp_0", "gather_nd_0.index"], ["y"], name="p2o.GatherND.0")]
    return make_model(nodes, [("x", [4, 8])], [("y", None)], [("gather_nd_0.index", np.int64([[0], [2]]))], opset=11)


def torch_relu_prod():
    """torch: `x.relu().prod(-1)` at opset 18 — a product reduction, which the generator has no code for."""
    nodes = [helper.make_node("Relu", ["x"], ["/Relu_output_0"], name="/Relu"),
             helper.make_node("ReduceProd", ["/Relu_output_0", "axes"], ["y"], name="/ReduceProd", keepdims=0)]
    return make_model(nodes, [("x", [64, 16])], [("y", None)], [("axes", np.int64([-1]))], opset=18)


def torch_relu_cubic_resize():
    """torch: `F.interpolate(x.relu(), scale_factor=2, mode="bicubic")` at opset 17 — a Resize mode
    the generator has no code for, which only its attributes say (the op itself is generated)."""
    nodes = [helper.make_node("Relu", ["x"], ["/Relu_output_0"], name="/Relu"),
             helper.make_node("Resize", ["/Relu_output_0", "", "scales"], ["y"], name="/Resize", mode="cubic",
                              coordinate_transformation_mode="pytorch_half_pixel", cubic_coeff_a=-0.75)]
    return make_model(nodes, [("x", [1, 2, 8, 8])], [("y", None)], [("scales", np.float32([1, 1, 2, 2]))], opset=17)


# groups the legality rules refuse at plan time (an op or dtype without a generator): the
# model, the ops that would be fused, the largest relative error allowed
NOT_CANDIDATES = [
    pytest.param(ort_qdq_conv, ("QuantizeLinear", "DequantizeLinear"), 1e-4, id="qdq"),
    pytest.param(torch_int8_matmul, ("Cast", "Gemm"), 1e-4, id="int8-input"),
    pytest.param(torch_relu_prod, ("Relu", "ReduceProd"), 1e-4, id="reduce-prod"),
]

# model, the fused group's ops, what the refusal names, the largest relative error allowed
REFUSED_GROUPS = [
    pytest.param(torch_relu_cubic_resize, "Relu,Resize", "cubic", 1e-4, id="resize-cubic"),
]

# exported idioms the generator takes whole: model, the fused group's ops
GENERATED_GROUPS = [
    pytest.param(torch_half_conv_relu, "Conv,Relu", id="float16"),
    pytest.param(lambda: bfloat16_round_trip(), "Cast,Cast,Relu", id="bfloat16-round-trip"),
    pytest.param(torch_hardswish, "Conv,HardSigmoid,Mul", id="hardswish"),
    pytest.param(paddle_pad_conv, "Pad,Conv", id="pad-conv"),
    pytest.param(paddle_conv_bilinear_resize, "Conv,Resize", id="resize-linear"),
    pytest.param(torch_relu_batchnorm, "BatchNormalization", id="batchnorm"),
    pytest.param(paddle_relu_gather_nd, "Relu,GatherND", id="gather-nd"),
]


@needs_cc
@pytest.mark.parametrize(("build", "ops", "tol"), NOT_CANDIDATES)
def test_a_group_the_generator_cannot_write_is_never_planned(run_cli, tmp_path, build, ops, tol):
    """The plan keeps such ops apart (each alone: a library call or its own kernel), and measure
    times every group."""
    model = save(build(), tmp_path / "m.onnx")
    out = tmp_path / "m.parquet"
    code, stdout, err = run_cli("measure", model, "--backend", "cpu", "--strategy", "greedy", "--budget", "0.01",
                                "--no-cache", "-o", out, "--json")
    assert code == 0 and err == "", err
    doc = json.loads(stdout)
    for g in doc["groups"]:
        assert g["median_s"] > 0 and g["max_rel_err"] <= tol, g
        assert g["how"] != "library per node", g
    rows = pd.read_parquet(out)
    for op_types in rows[rows["plan"] == "plan"]["op_types"]:
        assert not set(ops) <= set(op_types.split(",")), op_types
    assert doc["totals"]["not_measured"] == 0


@needs_cc
@pytest.mark.parametrize(("build", "ops", "names", "tol"), REFUSED_GROUPS)
def test_a_group_the_generator_refuses_is_measured_node_by_node(run_cli, tmp_path, build, ops, names, tol):
    model = save(build(), tmp_path / "m.onnx")
    out = tmp_path / "m.parquet"
    code, stdout, err = run_cli("measure", model, "--backend", "cpu", "--strategy", "greedy", "--budget", "0.01",
                                "--no-cache", "-o", out, "--json")
    assert code == 0, err
    assert err == ""  # no ONNX Runtime log lines, no progress residue
    doc = json.loads(stdout)
    for g in doc["groups"]:  # every group timed, or says why not
        assert g["median_s"] > 0 or g.get("reason"), g
        if g["median_s"] > 0:
            assert g["max_rel_err"] <= tol, g
    (per_node,) = [g for g in doc["groups"] if g["how"] == "library per node"]
    assert names in per_node["reason"] and per_node["median_s"] > 0 and per_node["max_rel_err"] <= tol
    assert per_node["fused_loses"] is None  # no fused kernel ran: nothing to set beside the library
    table = pd.read_parquet(out)
    row = table[(table["plan"] == "plan") & (table["group"] == per_node["id"])].iloc[0]
    assert ops in row["op_types"] and row["how"] == "library per node" and row["reason"] == per_node["reason"]
    assert row["median_s"] == per_node["median_s"]
    unfused = table[table["plan"] == "unfused"]
    assert (unfused["median_s"] > 0).all() and (unfused["max_rel_err"] <= tol).all()
    assert doc["totals"]["not_measured"] == 0


@needs_cc
@pytest.mark.parametrize(("build", "ops"), GENERATED_GROUPS)
def test_exported_idioms_run_as_one_generated_kernel(run_cli, tmp_path, build, ops):
    model = save(build(), tmp_path / "m.onnx")
    out = tmp_path / "m.parquet"
    code, stdout, err = run_cli("measure", model, "--backend", "cpu", "--strategy", "greedy", "--budget", "0.01",
                                "--no-cache", "-o", out, "--json")
    assert code == 0, err
    assert err == ""
    doc = json.loads(stdout)
    assert not [g for g in doc["groups"] if g["how"] == "library per node"], doc["groups"]
    table = pd.read_parquet(out)
    (row,) = [r for _, r in table[table["plan"] == "plan"].iterrows() if ops in r["op_types"]]
    assert row["how"] == "generated" and row["median_s"] > 0 and row["max_rel_err"] <= 1e-4, row.to_dict()
    assert doc["totals"]["not_measured"] == 0


@needs_cc
def test_node_by_node_text_says_how_and_why_and_prints_no_blank_line(run_cli, tmp_path):
    model = save(torch_relu_cubic_resize(), tmp_path / "m.onnx")
    code, stdout, err = run_cli("measure", model, "--strategy", "greedy", "--budget", "0.01", "--no-cache")
    assert code == 0, err
    assert err == ""  # the progress bar only on a terminal: no blank line first
    assert stdout.startswith("measured on cpu")
    assert "library per node: plan g0 (Relu,Resize): /Resize(Resize) mode cubic has no code generator yet" in stdout
    assert "not measured:" not in stdout and "kernels not measured" not in stdout
    assert "--baseline library" not in stdout


def bfloat16_round_trip():
    """A mixed-precision export's round trip through bfloat16 (ONNX Runtime runs it widened)."""
    nodes = [helper.make_node("Cast", ["x"], ["/Cast_output_0"], name="/Cast", to=TensorProto.BFLOAT16),
             helper.make_node("Cast", ["/Cast_output_0"], ["/Cast_1_output_0"], name="/Cast_1", to=TensorProto.FLOAT),
             helper.make_node("Relu", ["/Cast_1_output_0"], ["y"], name="/Relu")]
    return make_model(nodes, [("x", [4, 8])], [("y", None)])


def test_a_dtype_onnx_runtime_cannot_hand_back_is_bad_input(run_cli, tmp_path):
    """A round trip through float8: no reference values to check a kernel against, so exit 2
    naming the group, the node, the op and the dtype."""
    nodes = [helper.make_node("Cast", ["x"], ["/Cast_output_0"], name="/Cast", to=TensorProto.FLOAT8E4M3FN),
             helper.make_node("Cast", ["/Cast_output_0"], ["/Cast_1_output_0"], name="/Cast_1", to=TensorProto.FLOAT),
             helper.make_node("Relu", ["/Cast_1_output_0"], ["y"], name="/Relu")]
    model = save(make_model(nodes, [("x", [4, 8])], [("y", None)], opset=19), tmp_path / "f8.onnx")
    code, stdout, err = run_cli("measure", model, "--strategy", "greedy", "--budget", "0.01", "--no-cache")
    assert code == 2 and stdout == ""
    assert len(err.strip().splitlines()) == 1 and "internal error" not in err
    assert "plan group g0: node '/Cast' (Cast) makes '/Cast_output_0' of dtype float8_e4m3fn" in err


def test_a_node_that_cannot_run_alone_is_bad_input(run_cli, tmp_path):
    """A sequence value between two nodes (torch's `torch.split` + `torch.cat` through sequences):
    SplitToSequence has no kernel and its one-node model cannot run: exit 2 naming group, node, op
    and dtype, and what ONNX Runtime said."""
    nodes = [helper.make_node("SplitToSequence", ["x"], ["seq"], name="/SplitToSequence", axis=1),
             helper.make_node("ConcatFromSequence", ["seq"], ["cat"], name="/ConcatFromSequence", axis=1),
             helper.make_node("Relu", ["cat"], ["y"], name="/Relu")]
    model = save(make_model(nodes, [("x", [4, 8])], [("y", None)]), tmp_path / "seq.onnx")
    code, _, err = run_cli("measure", model, "--strategy", "greedy", "--budget", "0.01", "--no-cache")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "internal error" not in err
    assert "plan group g0: node '/SplitToSequence' (SplitToSequence, float32 -> float32)" in err
    assert "cannot run alone through ONNX Runtime" in err and "seq(tensor(float))" in err


# -- messages ---------------------------------------------------------------------------------

@pytest.fixture
def dynamic_model(tmp_path):
    nodes = [helper.make_node("Relu", ["input"], ["output"], name="/relu/Relu")]
    return save(make_model(nodes, [("input", ["batch", 8])], [("output", None)]), tmp_path / "dyn.onnx")


def test_calibrate_takes_the_shape_flags_its_hint_names(run_cli, tmp_path, dynamic_model):
    out = tmp_path / "profile.json"
    code, _, err = run_cli("calibrate", "--backend", "cpu", "--models", dynamic_model, "-o", out, "--samples", "4")
    assert code == 2 and "bind it with --dim batch=V" in err
    code, _, err = run_cli("calibrate", "--backend", "cpu", "--models", dynamic_model, "-o", out, "--samples", "4",
                           "--dim", "batch=2", "--dim", "seqq=3")
    assert code == 2 and f"{dynamic_model}: --dim seqq: unknown dim 'seqq'" in err  # applied to the model
    code, _, err = run_cli("calibrate", "--backend", "cpu", "--models", dynamic_model, "-o", out, "--samples", "4",
                           "--input-shape", "input=2x3x8")
    assert code == 2 and "--input-shape input: the model's input has rank 2" in err
    code, _, err = run_cli("calibrate", "--backend", "cpu", "--models", dynamic_model, "-o", out, "--samples", "4",
                           "--input-shape", "input=2x8", "--rounds", "1", "--budget", "0.005")
    assert code == 2 and "only 1 kernels were measured" in err  # bound, loaded and measured; too few to fit
    assert not out.exists()


@pytest.mark.parametrize("command", ["plan", "measure"])
def test_plan_and_measure_take_one_device(run_cli, dynamic_model, command):
    code, _, err = run_cli(command, dynamic_model, "--dim", "batch=2", "--device", "host,h100-sxm")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--device host,h100-sxm: give one device here" in err
    assert "fusesearch compare MODEL --device host,h100-sxm" in err


def test_report_on_a_file_says_it_is_a_file(run_cli, tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    results = sweep / "results.parquet"
    pd.DataFrame({"model": ["m"]}).to_parquet(results)
    code, _, err = run_cli("report", results)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{results}: is a file, not a folder" in err and f"({sweep})" in err and "no such folder" not in err
    other = tmp_path / "notes.txt"
    other.write_text("x")
    code, _, err = run_cli("report", other)
    assert code == 2 and f"{other}: is a file, not a folder; give the --out folder" in err
    code, _, err = run_cli("report", tmp_path / "missing")
    assert code == 2 and "no such folder" in err
