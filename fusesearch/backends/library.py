"""Library calls: run one node through ONNX Runtime (the CPU "vendor path").

Problem: OPAQUE ops (If, Loop, TopK, LpPool, ...) have no generated kernel, and a lone anchor
(MatMul, Gemm, Conv) runs through a library in `measure`'s default baseline, so that the report
can say when a fused generated kernel loses to a library kernel plus a separate epilogue; a fused
group the generator refuses (float16, int8, an op without a generator) runs one node at a time
here. (The GPU's library path is `arraylib` with cupy; this module is the CPU's.)
Approach: cut the node out of the canonical model into a one-node model — its explicit inputs and
the outer-scope values its subgraphs capture become graph inputs (weights included), its outputs
the graph outputs, value types from the Graph — and run it in ONNX Runtime on one thread with
graph optimizations off.
Invariants: the node is copied unchanged (control-flow bodies included); onnxruntime is imported
only through fusesearch.verify.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper

from fusesearch.ir.graph import Graph
from fusesearch.lowering import Kernel


def _value_info(graph: Graph, name: str) -> onnx.ValueInfoProto:
    info = graph.tensors[name]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(info.dtype))
    return helper.make_tensor_value_info(name, elem, list(info.shape) if info.shape is not None else None)


def node_model(canonical: onnx.ModelProto, graph: Graph, kernel: Kernel) -> onnx.ModelProto:
    if len(kernel.nodes) != 1:
        raise ValueError("a library call runs exactly one node")
    (node_id,) = kernel.nodes
    node = canonical.graph.node[node_id]
    model_graph = helper.make_graph([node], f"lib_{node.name}", [_value_info(graph, t) for t in kernel.inputs],
                                    [_value_info(graph, t) for t in kernel.outputs])
    model = helper.make_model(model_graph, opset_imports=list(canonical.opset_import), ir_version=canonical.ir_version)
    model.functions.extend(canonical.functions)
    return model


def library_runner(canonical: onnx.ModelProto, graph: Graph, kernel: Kernel,
                   inputs: dict[str, np.ndarray]) -> tuple[Callable[[], dict[str, np.ndarray]], list[str]]:
    """A zero-argument callable running the node on fixed inputs, and its output names."""
    from fusesearch.verify import session, session_feeds

    sess = session(node_model(canonical, graph, kernel))
    feeds = session_feeds(sess, {t: np.ascontiguousarray(inputs[t]) for t in kernel.inputs})
    names = list(kernel.outputs)

    def go() -> dict[str, np.ndarray]:
        return dict(zip(names, sess.run(names, feeds), strict=True))

    return go, names
