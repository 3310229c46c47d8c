"""Canonicalization passes on tiny graphs: structure after, and ONNX Runtime equality."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from fusesearch.ir.canonicalize import canonicalize, to_proto
from fusesearch.verify import compare, random_feeds, run
from tests.conftest import make_model
from tests.ir.test_load import load_model_proto

rng = np.random.default_rng(7)


def f32(*shape, lo=None, hi=None):
    if lo is not None:
        return rng.uniform(lo, hi, shape).astype(np.float32)
    return rng.standard_normal(shape).astype(np.float32)


def bn_inits(c, prefix="bn"):
    return [(f"{prefix}_g", f32(c, lo=0.5, hi=1.5)), (f"{prefix}_b", f32(c)), (f"{prefix}_m", f32(c)),
            (f"{prefix}_v", f32(c, lo=0.5, hi=1.5))]


def bn(x, y, prefix="bn", **kw):
    return helper.make_node("BatchNormalization", [x, f"{prefix}_g", f"{prefix}_b", f"{prefix}_m", f"{prefix}_v"],
                            [y], name=prefix, **kw)


def canon(model, bindings=None):
    """Canonicalize and check ORT equality on seeded inputs; return (ops, counts, proto)."""
    loaded = load_model_proto(model, bindings)
    canonical, counts = canonicalize(loaded.model)
    proto = to_proto(canonical)
    feeds = random_feeds(to_proto(load_model_proto(model, bindings).model), seed=3)
    diffs = compare(run(model, feeds), run(proto, feeds))
    assert all(d.ok for d in diffs), diffs
    return [n.op_type for n in proto.graph.node], counts, proto


def test_conv_bn_relu_folds_bn_in_float64():
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1], name="conv"), bn("c", "b"),
             helper.make_node("Relu", ["b"], ["y"], name="relu")]
    model = make_model(nodes, [("x", [1, 3, 8, 8])], [("y", None)], [("W", f32(8, 3, 3, 3))] + bn_inits(8))
    ops, counts, proto = canon(model)
    assert ops == ["Conv", "Relu"]
    assert counts["batchnorm_folding"] == 1
    assert proto.graph.node[0].name == "conv"


def test_bn_not_folded_when_conv_output_has_another_consumer():
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"]), bn("c", "b"),
             helper.make_node("Add", ["b", "c"], ["y"])]
    model = make_model(nodes, [("x", [1, 3, 8, 8])], [("y", None)], [("W", f32(4, 3, 1, 1))] + bn_inits(4))
    ops, counts, _ = canon(model)
    assert "BatchNormalization" in ops and counts["batchnorm_folding"] == 0


@pytest.mark.parametrize("group", [1, 2])
def test_convtranspose_bn_folds(group):
    nodes = [helper.make_node("ConvTranspose", ["x", "W"], ["c"], strides=[2, 2], group=group), bn("c", "y")]
    model = make_model(nodes, [("x", [1, 4, 5, 5])], [("y", None)],
                       [("W", f32(4, 6 // group * 1 if group == 1 else 3, 2, 2))] + bn_inits(6 if group == 1 else 6))
    ops, counts, _ = canon(model)
    assert counts["batchnorm_folding"] == 1
    # kernel = stride 2: a 1x1 Conv and a DepthToSpace where it has one group (conv_transpose_to_conv)
    assert ops == (["Conv", "DepthToSpace"] if group == 1 else ["ConvTranspose"])


@pytest.mark.parametrize("bias", [True, False])
def test_convtranspose_kernel_equal_to_stride_becomes_a_1x1_conv_and_a_shuffle(bias):
    """U-Net's 2x2 stride-2 upsampling (and a 3x3 stride 3): a 1x1 Conv to s*s*O channels ordered
    (a, b, o), its bias repeated per phase, then DepthToSpace (DCR); equal to ONNX Runtime."""
    for s, cin, cout in ((2, 6, 4), (3, 5, 2)):
        inputs = ["x", "W"] + (["B"] if bias else [])
        nodes = [helper.make_node("ConvTranspose", inputs, ["y"], name="up", strides=[s, s], kernel_shape=[s, s])]
        inits = [("W", f32(cin, cout, s, s))] + ([("B", f32(cout))] if bias else [])
        ops, counts, proto = canon(make_model(nodes, [("x", [1, cin, 5, 7])], [("y", None)], inits))
        assert ops == ["Conv", "DepthToSpace"] and counts["conv_transpose_to_conv"] == 1
        conv, shuffle = proto.graph.node
        assert conv.name == "up" and len(conv.input) == 2 + bias
        assert [(a.name, a.i) for a in shuffle.attribute] == [("blocksize", s)]
        weights = {t.name: t for t in proto.graph.initializer}
        assert list(weights[conv.input[1]].dims) == [s * s * cout, cin, 1, 1]
        assert proto.graph.output[0].name == "y"


@pytest.mark.parametrize("attrs", [{"strides": [2, 2], "pads": [1, 1, 0, 0]}, {"strides": [2, 2], "group": 2},
                                   {"strides": [2, 2], "output_padding": [1, 1]}, {"strides": [1, 1]},
                                   {"strides": [2, 2], "dilations": [2, 2]}])
def test_convtranspose_that_is_no_shuffle_stays(attrs):
    """Padding, groups, output padding, a stride other than the kernel, dilation: the output
    pixels overlap or skip, no 1x1 Conv writes them; the ConvTranspose stays."""
    nodes = [helper.make_node("ConvTranspose", ["x", "W"], ["y"], **attrs)]
    ops, counts, _ = canon(make_model(nodes, [("x", [1, 4, 5, 5])], [("y", None)], [("W", f32(4, 2, 2, 2))]))
    assert ops == ["ConvTranspose"] and counts["conv_transpose_to_conv"] == 0


@pytest.mark.parametrize(("trans_b", "with_c"), [(0, True), (1, True), (1, False)])
def test_gemm_bn_folds(trans_b, with_c):
    b = f32(5, 6) if trans_b else f32(6, 5)
    inputs = ["x", "B"] + (["C"] if with_c else [])
    nodes = [helper.make_node("Gemm", inputs, ["g"], transB=trans_b, alpha=0.5, beta=2.0), bn("g", "y")]
    inits = [("B", b)] + ([("C", f32(5))] if with_c else []) + bn_inits(5)
    model = make_model(nodes, [("x", [3, 6])], [("y", None)], inits)
    ops, counts, _ = canon(model)
    assert ops == ["Gemm"] and counts["batchnorm_folding"] == 1


def test_matmul_bn_becomes_gemm():
    nodes = [helper.make_node("MatMul", ["x", "B"], ["m"]), bn("m", "y")]
    model = make_model(nodes, [("x", [3, 6])], [("y", None)], [("B", f32(6, 5))] + bn_inits(5))
    ops, counts, _ = canon(model)
    assert ops == ["Gemm"]
    assert counts["batchnorm_folding"] == 1 and counts["matmul_add_to_gemm"] == 1


def test_matmul_add_to_gemm_only_for_2d():
    nodes = [helper.make_node("MatMul", ["x", "B"], ["m"]), helper.make_node("Add", ["m", "c"], ["y"]),
             helper.make_node("MatMul", ["x3", "B"], ["m3"]), helper.make_node("Add", ["m3", "c"], ["y3"])]
    model = make_model(nodes, [("x", [3, 6]), ("x3", [2, 3, 6])], [("y", None), ("y3", None)],
                       [("B", f32(6, 5)), ("c", f32(5))])
    ops, counts, proto = canon(model)
    assert sorted(ops) == ["Add", "Gemm", "MatMul"]
    assert [o.name for o in proto.graph.output] == ["y", "y3"]


def test_identity_dropout_noop_cast_reshape_removed_and_output_names_kept():
    nodes = [helper.make_node("Identity", ["x"], ["a"]), helper.make_node("Dropout", ["a"], ["b"], name="drop"),
             helper.make_node("Cast", ["b"], ["c"], to=TensorProto.FLOAT),
             helper.make_node("Reshape", ["c", "shape"], ["d"]), helper.make_node("Relu", ["d"], ["e"]),
             helper.make_node("Identity", ["e"], ["y"])]
    model = make_model(nodes, [("x", [2, 3])], [("y", None)], [("shape", np.array([2, 3], np.int64))], opset=12)
    ops, counts, proto = canon(model)
    assert ops == ["Relu"]
    assert [o.name for o in proto.graph.output] == ["y"]
    assert counts["identity"] == 2 and counts["dropout"] == 1
    assert counts["noop_cast"] == 1 and counts["noop_reshape"] == 1


def test_dropout_with_used_mask_stays():
    nodes = [helper.make_node("Dropout", ["x"], ["y", "mask"])]
    model = make_model(nodes, [("x", [4])], [("y", None), ("mask", None, TensorProto.BOOL)], opset=12)
    loaded = load_model_proto(model)
    canonical, counts = canonicalize(loaded.model)
    assert counts["dropout"] == 0


def test_shape_chain_folds_to_a_static_reshape():
    """PyTorch's head split: Shape→Gather→Unsqueeze→Concat→Reshape, folded once shapes are static."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "i0"], ["b"], axis=0),
             helper.make_node("Unsqueeze", ["b", "ax0"], ["bu"]),
             helper.make_node("Concat", ["bu", "rest"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["r"]),
             helper.make_node("Transpose", ["r"], ["y"], perm=[0, 2, 1, 3])]
    inits = [("i0", np.array(0, np.int64)), ("ax0", np.array([0], np.int64)), ("rest", np.array([-1, 2, 4], np.int64))]
    model = make_model(nodes, [("x", ["batch", 6, 8])], [("y", None)], inits, opset=13)
    from fusesearch.ir.shapes import ShapeBindings

    ops, counts, proto = canon(model, ShapeBindings.parse([], ["batch=3"]))
    assert ops == ["Reshape", "Transpose"]
    assert counts["constant_folding"] >= 4


def test_weights_from_constant_of_shape_fold_before_bn():
    """A conv weight computed at run time (ConstantOfShape + Mul) becomes an initializer, then BN folds."""
    shape = helper.make_tensor("shape", TensorProto.INT64, [4], [4, 3, 1, 1])
    nodes = [helper.make_node("Constant", [], ["wshape"], value=shape),
             helper.make_node("ConstantOfShape", ["wshape"], ["ones"],
                              value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.5])),
             helper.make_node("Mul", ["ones", "k"], ["W"]),
             helper.make_node("Conv", ["x", "W"], ["c"], name="conv"), bn("c", "y")]
    model = make_model(nodes, [("x", [1, 3, 4, 4])], [("y", None)], [("k", f32(4, 1, 1, 1))] + bn_inits(4))
    ops, counts, _ = canon(model)
    assert ops == ["Conv"]
    assert counts["constant_folding"] == 3 and counts["batchnorm_folding"] == 1


def test_control_flow_bodies_untouched():
    """An If whose branches hold an Identity and a Dropout: the bodies keep them."""
    then_g = helper.make_graph([helper.make_node("Identity", ["x"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, [4])])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["e0"]), helper.make_node("Dropout", ["e0"], ["e"])],
                               "else", [], [helper.make_tensor_value_info("e", TensorProto.FLOAT, [4])])
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["cond"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g, name="branch")]
    model = make_model(nodes, [("x", [4])], [("y", [4])], [("zero", np.array(0.0, np.float32))], opset=13)
    ops, counts, proto = canon(model)
    assert ops == ["ReduceSum", "Greater", "If"]
    branch = proto.graph.node[2]
    bodies = {a.name: [n.op_type for n in a.g.node] for a in branch.attribute}
    assert bodies == {"then_branch": ["Identity"], "else_branch": ["Neg", "Dropout"]}


def test_dead_nodes_removed_and_fixed_point_reached():
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Neg", ["x"], ["unused"]),
             helper.make_node("Abs", ["unused"], ["unused2"])]
    model = make_model(nodes, [("x", [4])], [("y", None)])
    ops, counts, _ = canon(model)
    assert ops == ["Relu"] and counts["dead_nodes"] == 2
    loaded = load_model_proto(model)
    once, _ = canonicalize(loaded.model)
    _, again = canonicalize(once)
    assert sum(v for k, v in again.items() if k != "shapes_completed") == 0


EINSUMS = [  # equation, shapes, the ops it becomes
    ("ij,jk->ik", [[3, 4], [4, 5]], ["MatMul"]),
    ("bij,bjk->bik", [[2, 3, 4], [2, 4, 5]], ["MatMul"]),
    ("bhqd,bhkd->bhqk", [[1, 2, 3, 4], [1, 2, 5, 4]], ["Transpose", "MatMul"]),  # attention scores: K^T
    ("bhqk,bkhd->bqhd", [[1, 2, 3, 5], [1, 5, 2, 4]], ["Transpose", "MatMul", "Transpose"]),
    ("jk,ij->ki", [[4, 5], [3, 4]], ["Transpose", "Transpose", "MatMul"]),  # (BA)^T as A^T B^T
]


@pytest.mark.parametrize(("equation", "shapes", "ops"), EINSUMS, ids=[e[0] for e in EINSUMS])
def test_einsum_matrix_products_become_matmul(equation, shapes, ops):
    nodes = [helper.make_node("Einsum", ["a", "b"], ["y"], equation=equation)]
    model = make_model(nodes, [("a", shapes[0]), ("b", shapes[1])], [("y", None)])
    got, counts, proto = canon(model)
    assert got == ops and counts["einsum_to_matmul"] == 1
    assert [o.name for o in proto.graph.output] == ["y"]


@pytest.mark.parametrize(("equation", "shapes"), [
    ("ii->i", [[3, 3]]),  # a diagonal
    ("ij,ij->ij", [[3, 4], [3, 4]]),  # elementwise: nothing summed
    ("ibh,hnd->ibnd", [[3, 2, 4], [4, 2, 5]]),  # two free indices on each side
    ("ij,jk,kl->il", [[2, 3], [3, 4], [4, 5]]),  # three operands
    ("...ij,...jk->...ik", [[2, 3, 4], [2, 4, 5]]),  # an ellipsis
    ("ij,jk", [[3, 4], [4, 5]]),  # an implicit output
])
def test_other_einsums_stay_opaque(equation, shapes):
    names = "abc"[:len(shapes)]
    nodes = [helper.make_node("Einsum", list(names), ["y"], equation=equation)]
    model = make_model(nodes, [(n, s) for n, s in zip(names, shapes, strict=True)], [("y", None)])
    got, counts, _ = canon(model)
    assert got == ["Einsum"] and counts["einsum_to_matmul"] == 0


@pytest.mark.parametrize(("equation", "opaque"), [("ibh,hnd->ibnd", True), ("bij,bjk->bik", False)])
def test_plan_names_the_opaque_ops_it_prices_as_library_calls(tmp_path, run_cli, equation, opaque):
    import json

    from tests.conftest import save

    shapes = {"ibh,hnd->ibnd": ([3, 2, 4], [4, 2, 5]), "bij,bjk->bik": ([2, 3, 4], [2, 4, 5])}[equation]
    nodes = [helper.make_node("Einsum", ["a", "b"], ["e"], equation=equation, name="mix"),
             helper.make_node("Relu", ["e"], ["y"])]
    path = save(make_model(nodes, [("a", shapes[0]), ("b", shapes[1])], [("y", None)]), tmp_path / "m.onnx")
    code, out, err = run_cli("plan", path, "--device", "h100-sxm")
    assert code == 0, err
    assert ("1 opaque op priced as library calls: Einsum 'mix'" in out) == opaque
    code, out, err = run_cli("plan", path, "--device", "h100-sxm", "--json")
    assert json.loads(out)["run"]["opaque_ops"] == (["mix"] if opaque else [])


def _loop_model(trips=3, cond_out="cond_in", scan=True, opset=13):
    """h <- tanh(h W + x + i) for a constant number of iterations i (the body reads the outer x
    and the iteration number), h stacked per iteration as a scan output; `cond_out`: the body's
    condition (its input passed through, or computed from h)."""
    body_nodes = [helper.make_node("MatMul", ["h_in", "W"], ["hw"], name="mm"),
                  helper.make_node("Cast", ["i"], ["fi"], to=TensorProto.FLOAT, name="cast"),
                  helper.make_node("Add", ["hw", "x"], ["hx"], name="add_x"),
                  helper.make_node("Add", ["hx", "fi"], ["hi"], name="add_i"),
                  helper.make_node("Tanh", ["hi"], ["h_out"], name="tanh"),
                  helper.make_node("Identity", ["h_out"], ["h_scan"], name="scan")]
    if cond_out == "cond_in":
        body_nodes.append(helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep"))
    else:
        body_nodes += [helper.make_node("ReduceSum", ["h_out"], ["s"], keepdims=0, name="sum"),
                       helper.make_node("Greater", ["s", "zero"], ["cond_out"], name="more")]
    outs = [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [2, 4])]
    if scan:
        outs.append(helper.make_tensor_value_info("h_scan", TensorProto.FLOAT, [2, 4]))
    body = helper.make_graph(body_nodes, "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                                                  helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                                                  helper.make_tensor_value_info("h_in", TensorProto.FLOAT, [2, 4])],
                             outs)
    nodes = [helper.make_node("Loop", ["M", "go", "h0"], ["h", *(["hs"] if scan else [])], body=body, name="loop"),
             helper.make_node("Relu", ["h"], ["y"], name="relu")]
    outputs = [("y", [2, 4])] + ([("hs", [trips, 2, 4])] if scan else [])
    inits = [("W", f32(4, 4)), ("M", np.array(trips, np.int64)), ("go", np.array(True)),
             ("zero", np.array(-100.0, np.float32))]
    return make_model(nodes, [("x", [2, 4]), ("h0", [2, 4])], outputs, inits, opset=opset)


def test_a_constant_loop_is_unrolled_and_equals_onnx_runtime():
    """Three iterations of a body that reads an outer value and the iteration number, its state
    carried and stacked: the Loop becomes three copies of its body (the iteration a constant
    folded into each), the stack an Unsqueeze per iteration and a Concat; ONNX Runtime's values."""
    ops, counts, proto = canon(_loop_model())
    assert "Loop" not in ops and counts["loop_unrolling"] == 1
    assert ops.count("Gemm") == 3 and ops.count("Tanh") == 3 and ops.count("Concat") == 1  # MatMul + Add: a Gemm
    assert [o.name for o in proto.graph.output] == ["y", "hs"]


def test_an_unrolled_loop_at_opset_11_stacks_with_unsqueezes_axes_attribute():
    """Below opset 13 Unsqueeze takes its axes as an attribute: a model left at opset 11 (as when
    the version converter fails) unrolls to a model ONNX Runtime runs, with its values."""
    import onnx_ir as ir

    model = _loop_model(opset=11)
    canonical, counts = canonicalize(ir.serde.deserialize_model(model))
    proto = to_proto(canonical)
    assert counts["loop_unrolling"] == 1 and proto.opset_import[0].version == 11
    unsqueeze = next(n for n in proto.graph.node if n.op_type == "Unsqueeze")
    assert [a.name for a in unsqueeze.attribute] == ["axes"] and len(unsqueeze.input) == 1
    feeds = random_feeds(model, seed=3)
    assert all(d.ok for d in compare(run(model, feeds), run(proto, feeds)))


def test_loops_that_cannot_be_unrolled_stay_loops():
    """A condition computed from the data (the trip count then a bound, not a count), and more
    iterations than UNROLL_MAX_TRIPS: each Loop stays, its body untouched."""
    from fusesearch.ir.canonicalize import UNROLL_MAX_TRIPS

    for model in (_loop_model(cond_out="data"), _loop_model(trips=UNROLL_MAX_TRIPS + 1)):
        ops, counts, proto = canon(model)
        assert "Loop" in ops and counts["loop_unrolling"] == 0
        loop = next(n for n in proto.graph.node if n.op_type == "Loop")
        assert [n.op_type for n in loop.attribute[0].g.node][:2] == ["MatMul", "Cast"]


def _if_model(then_op="Relu", elements=(4, 8)):
    then = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["t0"], name="then_mul"),
                              helper.make_node(then_op, ["t0"], ["t"], name="then_op")], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, list(elements))])
    other = helper.make_graph([helper.make_node("Sigmoid", ["x"], ["e0"], name="else_sigmoid"),
                               helper.make_node("Neg", ["e0"], ["e"], name="else_neg")], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, list(elements))])
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0, name="sum"),
             helper.make_node("Greater", ["s", "zero"], ["c"], name="positive"),
             helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other, name="choose")]
    return make_model(nodes, [("x", list(elements))], [("y", list(elements))],
                      [("two", np.array(2.0, np.float32)), ("zero", np.array(0.0, np.float32))], opset=13)


def test_an_if_of_small_elementwise_branches_computes_both_and_selects():
    """Branches of Mul + Relu and Sigmoid + Neg: both computed, a Where picks one by the
    condition; equal to ONNX Runtime whichever branch the data takes."""
    model = _if_model()
    ops, counts, proto = canon(model)
    assert "If" not in ops and counts["if_conversion"] == 1 and ops.count("Where") == 1
    for sign in (1.0, -1.0):
        feeds = {"x": np.abs(f32(4, 8)) * sign}
        assert all(d.ok for d in compare(run(model, feeds), run(proto, feeds)))


def test_an_if_with_other_work_or_large_outputs_stays_an_if():
    """A Softmax in a branch (not an IF_OPS op), and outputs past IF_MAX_ELEMENTS: the If stays
    (run through ONNX Runtime), its branches untouched."""
    from fusesearch.ir.canonicalize import IF_MAX_ELEMENTS

    for model in (_if_model("Softmax"), _if_model(elements=(2, IF_MAX_ELEMENTS))):
        ops, counts, _ = canon(model)
        assert ops == ["ReduceSum", "Greater", "If"] and counts["if_conversion"] == 0


def test_duplicate_nodes_are_computed_once():
    """Two MatMuls of the same inputs (and two Softmaxes with different axes, which differ):
    one MatMul is left, both Softmaxes stay."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"], name="a"),
             helper.make_node("MatMul", ["x", "W"], ["b"], name="b"),
             helper.make_node("Add", ["a", "b"], ["s"], name="add"),
             helper.make_node("Softmax", ["s"], ["p"], axis=0, name="p"),
             helper.make_node("Softmax", ["s"], ["q"], axis=1, name="q"),
             helper.make_node("Add", ["p", "q"], ["y"], name="out")]
    ops, counts, _ = canon(make_model(nodes, [("x", [3, 4])], [("y", None)], [("W", f32(4, 5))]))
    assert ops.count("MatMul") + ops.count("Gemm") == 1 and ops.count("Softmax") == 2
    assert counts["common_subexpressions"] == 1


def test_unnamed_ifs_of_a_one_element_condition_inline_under_unique_names():
    """Two unnamed Ifs on a condition of shape [1] (Reshaped to a scalar, so Where keeps the [4]
    outputs), the second reading the first: both inlined, every node and value name unique, equal
    to ONNX Runtime either way."""
    def branches(src, dst):
        then = helper.make_graph([helper.make_node("Relu", [src], [f"{dst}_t"])], "then", [],
                                 [helper.make_tensor_value_info(f"{dst}_t", TensorProto.FLOAT, [4])])
        other = helper.make_graph([helper.make_node("Neg", [src], [f"{dst}_e"])], "else", [],
                                  [helper.make_tensor_value_info(f"{dst}_e", TensorProto.FLOAT, [4])])
        return {"then_branch": then, "else_branch": other}
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=1),
             helper.make_node("Greater", ["s", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["a"], **branches("x", "a")),
             helper.make_node("If", ["c"], ["y"], **branches("a", "y"))]
    model = make_model(nodes, [("x", [4])], [("y", [4])], [("zero", np.array([0.0], np.float32))], opset=13)
    ops, counts, proto = canon(model)
    assert "If" not in ops and counts["if_conversion"] == 2 and ops.count("Where") == 2
    names = [n.name for n in proto.graph.node]
    values = [o for n in proto.graph.node for o in n.output]
    assert len(set(names)) == len(names) and len(set(values)) == len(values)
    for sign in (1.0, -1.0):
        feeds = {"x": np.abs(f32(4)) * sign}
        assert all(d.ok for d in compare(run(model, feeds), run(proto, feeds)))
