"""The frozen Graph view: order, producers/consumers, reachability and convexity."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from fusesearch.ir._from_ir import graph_from_ir
from fusesearch.ir.canonicalize import canonicalize
from fusesearch.ir.graph import Graph, Node, TensorInfo
from fusesearch.ir.op_kind import OpKind
from tests.conftest import make_model
from tests.ir.test_load import load_model_proto


def diamond() -> Graph:
    """x → a → {b, c} → d (Add) → y, plus a side chain a → e."""
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="a"), helper.make_node("Neg", ["a"], ["b"], name="b"),
             helper.make_node("Abs", ["a"], ["c"], name="c"), helper.make_node("Add", ["b", "c"], ["d"], name="d"),
             helper.make_node("Exp", ["a"], ["e"], name="e")]
    model = make_model(nodes, [("x", [2, 3])], [("d", None), ("e", None)])
    canonical, _ = canonicalize(load_model_proto(model).model)
    return graph_from_ir(canonical)


def test_nodes_are_topological_with_kinds_and_shapes():
    g = diamond()
    assert [n.name for n in g.nodes] == ["a", "b", "c", "d", "e"]
    assert [n.id for n in g.nodes] == [0, 1, 2, 3, 4]
    assert g.node("d").kind == OpKind.BROADCAST and g.node("a").kind == OpKind.ELEMWISE
    assert g.tensors["d"].shape == (2, 3) and g.tensors["d"].dtype == "float32"
    assert g.producer("a") == 0 and g.producer("x") is None
    assert g.consumers("a") == (1, 2, 4)
    assert g.successors(0) == (1, 2, 4) and g.predecessors(3) == (1, 2)
    assert g.is_output("e") and not g.is_output("a")


def test_reachability():
    g = diamond()
    assert g.reaches(0, 3) and g.reaches(1, 3) and not g.reaches(3, 0)
    assert not g.reaches(1, 2) and not g.reaches(4, 3) and not g.reaches(0, 0)


@pytest.mark.parametrize(("group", "convex"), [
    ({0, 1, 2, 3}, True), ({1, 2, 3}, True), ({0, 3}, False), ({0, 1, 3}, False), ({0, 4}, True), ({2}, True),
])
def test_convexity(group, convex):
    assert diamond().is_convex(group) is convex


def test_control_flow_captures_are_edges():
    """An If body reading an outer value makes the If depend on that value's producer."""
    from onnx import TensorProto

    then_g = helper.make_graph([helper.make_node("Neg", ["h"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, [4])])
    else_g = helper.make_graph([helper.make_node("Softmax", ["h"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, [4])])
    nodes = [helper.make_node("Relu", ["x"], ["h"], name="h"), helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "z"], ["cond"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g, name="if")]
    model = make_model(nodes, [("x", [4])], [("y", [4])], [("z", np.array(0.0, np.float32))], opset=13)
    g = graph_from_ir(canonicalize(load_model_proto(model).model)[0])
    assert g.reaches(g.node("h").id, g.node("if").id)
    assert g.node("if").kind == OpKind.OPAQUE


def test_large_chain_reachability_is_consistent():
    n = 2000
    nodes = [Node(i, f"n{i}", "Relu", "", OpKind.ELEMWISE, (f"t{i - 1}" if i else "x",), (f"t{i}",), {})
             for i in range(n)]
    tensors = {f"t{i}": TensorInfo(f"t{i}", (4,), "float32") for i in range(n)}
    g = Graph.build("chain", nodes, tensors, ["x"], [f"t{n - 1}"])
    assert g.reaches(0, n - 1) and not g.reaches(n - 1, 0)
    assert g.descendants(0).bit_count() == n - 1
    assert g.is_convex(range(10, 20)) and not g.is_convex([10, 12])


def test_tensor_info_sizes():
    assert TensorInfo("t", (2, 3), "float16").nbytes == 12
    assert TensorInfo("t", None, "float32").nbytes == 0
    assert TensorInfo("t", (0, 3), "float32").size == 0
