"""Lowering: templates, refusals with reasons, and the counts handed to the cost model."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from fusesearch.groups import FusionDecision, FusionGroup
from fusesearch.ir._from_ir import graph_from_ir
from fusesearch.ir.canonicalize import canonicalize
from fusesearch.ir.graph import Graph
from fusesearch.lowering import CannotLower, choices, lower, try_lower
from tests.conftest import make_model
from tests.ir.test_load import load_model_proto

rng = np.random.default_rng(3)


def graph_of(nodes, inputs, outputs, inits=(), opset=17) -> Graph:
    model = make_model(nodes, inputs, outputs, inits, opset=opset)
    return graph_from_ir(canonicalize(load_model_proto(model).model)[0])


def group(g: Graph, *names) -> FusionGroup:
    return FusionGroup(frozenset(g.node(n).id for n in names))


def conv_relu_graph(c=16, hw=32) -> Graph:
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    inits = [("W", rng.standard_normal((c, c, 3, 3)).astype(np.float32)), ("B", np.zeros(c, np.float32))]
    return graph_of(nodes, [("x", [1, c, hw, hw])], [("y", None)], inits)


def test_conv_relu_is_one_conv_kernel_with_compulsory_bytes():
    g = conv_relu_graph()
    k = lower(g, group(g, "conv", "relu"))
    assert k.template == "conv" and k.ops == ("Conv", "Relu") and k.anchor == g.node("conv").id
    assert k.inputs == ("x", "W", "B") and k.outputs == ("y",)
    act = 16 * 32 * 32 * 4
    assert k.read_bytes == act + 16 * 16 * 9 * 4 + 16 * 4 and k.write_bytes == act
    assert k.tc_flops == 2 * 16 * 32 * 32 * 16 * 9 + 16 * 32 * 32  # MACs x 2 + bias
    assert k.tile[2] == 32 and k.smem_bytes > 0
    spec = k.spec()
    assert spec.template == "conv" and spec.num_ops == 2


def test_intermediate_used_outside_is_written():
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="a"), helper.make_node("Neg", ["a"], ["b"], name="b"),
             helper.make_node("Abs", ["a"], ["c"], name="c")]
    g = graph_of(nodes, [("x", [8, 8])], [("b", None), ("c", None)])
    k = lower(g, group(g, "a", "b"))
    assert k.template == "pointwise" and k.outputs == ("a", "b")
    assert k.write_bytes == 2 * 8 * 8 * 4 and k.read_bytes == 8 * 8 * 4


def test_duplicated_input_read_once():
    nodes = [helper.make_node("Mul", ["x", "x"], ["y"], name="sq")]
    g = graph_of(nodes, [("x", [1024])], [("y", None)])
    assert lower(g, group(g, "sq")).read_bytes == 4096


def test_decomposed_layernorm_is_one_rowwise_kernel():
    """The opset-12 export of LayerNorm: 2 ReduceMeans over the last axis, one row count."""
    names = ["m1", "sub", "pow", "m2", "add", "sqrt", "div", "mul", "add2"]
    nodes = [helper.make_node("ReduceMean", ["x"], ["mu"], axes=[-1], name="m1"),
             helper.make_node("Sub", ["x", "mu"], ["d"], name="sub"),
             helper.make_node("Pow", ["d", "two"], ["d2"], name="pow"),
             helper.make_node("ReduceMean", ["d2"], ["var"], axes=[-1], name="m2"),
             helper.make_node("Add", ["var", "eps"], ["ve"], name="add"),
             helper.make_node("Sqrt", ["ve"], ["sd"], name="sqrt"),
             helper.make_node("Div", ["d", "sd"], ["n"], name="div"),
             helper.make_node("Mul", ["n", "gamma"], ["ng"], name="mul"),
             helper.make_node("Add", ["ng", "beta"], ["y"], name="add2")]
    inits = [("two", np.array(2.0, np.float32)), ("eps", np.array(1e-5, np.float32)),
             ("gamma", np.ones(64, np.float32)), ("beta", np.zeros(64, np.float32))]
    g = graph_of(nodes, [("x", [2, 8, 64])], [("y", None)], inits, opset=12)
    k = lower(g, group(g, *names))
    assert k.template == "rowwise" and k.reduction_length == 64 and len(k.ops) == 9
    assert k.transcendentals >= 16  # one sqrt per row (and the Pow)


def test_softmax_alone_is_rowwise_and_over_an_outer_axis_is_refused():
    nodes = [helper.make_node("Softmax", ["x"], ["y"], axis=-1, name="sm"),
             helper.make_node("ReduceSum", ["y"], ["s"], axes=[0], keepdims=0, name="rs"),
             helper.make_node("Relu", ["s"], ["z"], name="relu")]
    g = graph_of(nodes, [("x", [4, 16])], [("z", None)], opset=12)
    assert lower(g, group(g, "sm")).template == "rowwise"
    refused = try_lower(g, group(g, "rs", "relu"))
    assert isinstance(refused, FusionDecision) and "innermost" in refused.reason
    assert lower(g, group(g, "rs")).template == "opaque"  # alone, a library call


def gemm_softmax_graph(n: int) -> Graph:
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
             helper.make_node("Softmax", ["m"], ["y"], axis=-1, name="sm")]
    return graph_of(nodes, [("x", [2, 64, 64])], [("y", None)], [("W", rng.standard_normal((64, n)).astype(np.float32))])


def test_gemm_with_softmax_epilogue_tiles_the_row():
    g = gemm_softmax_graph(128)
    k = lower(g, group(g, "mm", "sm"))
    assert k.template == "gemm" and k.tile[1] >= 128


@pytest.mark.parametrize(("nodes_names", "needle"), [
    (("a", "c"), "not connected"),
    (("mm1", "mm2"), "two anchors"),
    (("a", "loop"), "opaque"),
])
def test_refusals_carry_reasons(nodes_names, needle):
    from fusesearch.ir.canonicalize import UNROLL_MAX_TRIPS

    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Neg", ["v_in"], ["v_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [4, 4])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [4, 4])])
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="a"),
             helper.make_node("MatMul", ["a", "W"], ["b"], name="mm1"),
             helper.make_node("MatMul", ["b", "W"], ["c0"], name="mm2"),
             helper.make_node("Abs", ["c0"], ["c"], name="c"),
             helper.make_node("Loop", ["trip", "", "a"], ["l"], body=body, name="loop")]
    inits = [("W", np.eye(4, dtype=np.float32)), ("trip", np.array(UNROLL_MAX_TRIPS + 1, np.int64))]  # not unrolled
    g = graph_of(nodes, [("x", [4, 4])], [("c", None), ("l", None)], inits, opset=13)
    decision = try_lower(g, group(g, *nodes_names))
    assert isinstance(decision, FusionDecision) and needle in decision.reason
    with pytest.raises(CannotLower, match=needle):
        lower(g, group(g, *nodes_names))


def test_non_convex_group_refused():
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="a"), helper.make_node("Neg", ["a"], ["b"], name="b"),
             helper.make_node("Add", ["a", "b"], ["y"], name="c")]
    g = graph_of(nodes, [("x", [4])], [("y", None)])
    decision = try_lower(g, group(g, "a", "c"))
    assert not decision and "convex" in decision.reason


def test_float32_joins_one_half_dtype_but_not_two_or_float64():
    """Generated code computes in float32 and half is storage only: float32 ops (a LayerNorm kept in
    float32 by --dtype) fuse with half ones and the kernel is a half kernel; float16 with
    bfloat16, or float64 with anything, stays apart."""
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="a"),
             helper.make_node("Cast", ["a"], ["h"], to=TensorProto.FLOAT16, name="cast"),
             helper.make_node("Neg", ["h"], ["y"], name="neg")]
    g = graph_of(nodes, [("x", [4])], [("y", None, TensorProto.FLOAT16)])
    assert lower(g, group(g, "a", "cast", "neg")).dtype == "float16"
    assert lower(g, group(g, "cast", "neg")).dtype == "float16"
    for other in (TensorProto.BFLOAT16, TensorProto.DOUBLE):
        nodes = [helper.make_node("Relu", ["x"], ["a"], name="a"),
                 helper.make_node("Cast", ["a"], ["h"], to=other, name="cast"),
                 helper.make_node("Neg", ["h"], ["y"], name="neg")]
        g = graph_of(nodes, [("x", [4], TensorProto.FLOAT16)], [("y", None, other)])
        decision = try_lower(g, group(g, "a", "cast", "neg"))
        assert not decision and "mixed dtypes" in decision.reason


def test_lone_view_op_is_an_alias():
    nodes = [helper.make_node("Flatten", ["x"], ["f"], name="flat"), helper.make_node("Relu", ["f"], ["y"], name="r")]
    g = graph_of(nodes, [("x", [2, 3, 4])], [("y", None)])
    assert lower(g, group(g, "flat")).alias
    assert not lower(g, group(g, "flat", "r")).alias


def test_gemm_skeleton_tensor_cores_when_tf32_is_allowed():
    """A fused float32 conv runs on TF32 tensor cores by default: `mma-tf32`, 4 warps, its tile
    from MMA_TILES, double-buffered (the input is a plain copy), the declared shared memory a
    function of tile and stages, priced at the TF32 rate with `mma_efficiency`; with TF32 off
    (`--no-tf32`) the CUDA-core `tiled` skeleton and the FP32 rate; a lone conv (a library call)
    keeps the library's tile either way."""
    from dataclasses import replace

    from costmodels import DEVICES, RooflineModel, RooflineParams
    from fusesearch.schedule import MMA_THREADS, MMA_TILES, mma_smem_bytes

    g = conv_relu_graph(c=64, hw=64)
    k = lower(g, group(g, "conv", "relu"))
    assert (k.schedule.skeleton, k.schedule.unit, k.threads_per_block, k.schedule.stages) == (
        "mma-tf32", "tensor-core", MMA_THREADS, 2)
    assert k.tile[:2] in MMA_TILES and k.smem_bytes == mma_smem_bytes(k.tile, 2, 4) <= 48 * 1024
    h100, params = DEVICES["h100-sxm"], RooflineParams()
    cost = RooflineModel(params).cost(k.spec(), h100)
    assert k.spec().unit == "tensor-core" and cost.compute_unit == "tf32-tensor-core"
    tc_s = k.tc_flops / (h100.tf32_flops_per_s * params.get("mma_efficiency", "conv"))
    assert cost.compute_s >= tc_s and cost.compute_s == pytest.approx(tc_s, rel=0.05)

    off = replace(g, allow_tf32=False)
    k_off = lower(off, group(off, "conv", "relu"))
    assert (k_off.schedule.skeleton, k_off.threads_per_block, k_off.schedule.stages) == ("tiled", 256, 1)
    assert k_off.spec().unit == "cuda-core"
    no_tf32 = RooflineModel(params.with_updates(float32_uses_tf32=False))
    assert no_tf32.cost(k_off.spec(), h100).compute_unit == "fp32-cuda-core"
    assert no_tf32.cost(k.spec(), h100).compute_unit == "fp32-cuda-core"  # no TF32 rate without TF32
    lone = choices(g, group(g, "conv"))  # the library call first, then our kernels, each its own choice
    assert lone[0].impl == "library" and {k.impl for k in lone[1:]} == {"generated"}
    assert {k.schedule.skeleton for k in lone[1:]} == {"mma-tf32", "mma-sync-tf32", "tiled"}


def test_gemm_skeleton_keeps_cuda_cores_where_no_tile_applies():
    """An epilogue that moves elements (a Transpose after the product) has no tile: not `mma`."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
             helper.make_node("Transpose", ["y"], ["out"], perm=[1, 0], name="t")]
    g = graph_of(nodes, [("x", [40, 24])], [("out", None)], [("w", rng.standard_normal((24, 64)).astype(np.float32))])
    assert lower(g, group(g, "mm", "t")).schedule.skeleton == "direct"
