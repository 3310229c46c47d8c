"""Library calls: run one node through ONNX Runtime (the CPU "vendor path").

Problem: OPAQUE ops have no generated kernel, `measure`'s default baseline runs lone anchors
through a library, and a fused group the generator refuses runs node by node here (the GPU's path
is `arraylib`); a node timed alone must cost what it costs inside ONNX Runtime's whole-model run.
Approach: cut the node into a one-node model (its inputs and captured outer values as graph inputs,
the model's weights kept as initializers so ONNX Runtime pre-packs them), run on one thread with
optimizations off through IO binding into arrays allocated once (`host_binding`). ONNX Runtime's
fixed cost of one Run is timed by `measure` on Identity models (`null_runs`, `run_costs`) and taken
off each sample, never below one trivial node's share.
Invariants: the node is copied unchanged (control-flow bodies included); a weight is never bound
as an input; onnxruntime is imported only through fusesearch.verify."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import helper

from fusesearch.backends.cpu import aligned_array
from fusesearch.ir.graph import Graph
from fusesearch.lowering import Kernel


def _value_info(graph: Graph, name: str) -> onnx.ValueInfoProto:
    info = graph.tensors[name]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(info.dtype))
    return helper.make_tensor_value_info(name, elem, list(info.shape) if info.shape is not None else None)


def node_model(canonical: onnx.ModelProto, graph: Graph, kernel: Kernel) -> onnx.ModelProto:
    """The kernel's nodes (one for a library call; a plan group's, in canonical order, for `run`'s
    check of one step) as a model: the canonical model's weights they read as initializers, their
    other inputs (the outer-scope values their subgraphs read included) as graph inputs, the
    kernel's outputs as its outputs. `kernel`: anything with `nodes` and `outputs` (a run's step)."""
    from fusesearch.lowering import external_inputs

    ids = sorted(kernel.nodes)
    inputs = external_inputs(graph, [graph.nodes[i] for i in ids])
    nodes = [canonical.graph.node[i] for i in ids]
    weights = {t.name: t for t in canonical.graph.initializer if t.name in inputs}
    model_graph = helper.make_graph(nodes, f"lib_{nodes[0].name}",
                                    [_value_info(graph, t) for t in inputs if t not in weights],
                                    [_value_info(graph, t) for t in kernel.outputs],
                                    [weights[t] for t in inputs if t in weights])
    model = helper.make_model(model_graph, opset_imports=list(canonical.opset_import), ir_version=canonical.ir_version)
    model.functions.extend(canonical.functions)
    return model


def taken_inputs(sess, inputs: Sequence[tuple[str, object]]) -> list[tuple[str, object]]:
    """The (name, value) pairs of `inputs` that `sess` takes as inputs: a step's weights and
    the outer-scope values its subgraphs read are initializers of its one-node model."""
    taken = {i.name for i in sess.get_inputs()}
    return [(t, v) for t, v in inputs if t in taken]


def host_binding(sess, inputs: Sequence[tuple[str, Callable[[], np.ndarray] | np.ndarray]],
                 outputs: Sequence[tuple[str, np.ndarray]]) -> Callable[[], None]:
    """A run of `sess` reading `inputs` (each array as its function gives it at the call, or, given
    as an array, one that never moves, bound once here; names the session does not take, its
    weights, are skipped) and writing `outputs` in place (host arrays, IO binding; a bfloat16
    node runs widened, its values crossing as float32 copies)."""
    inputs = taken_inputs(sess, inputs)
    if getattr(sess, "fusesearch_dtypes", None):
        from fusesearch.verify import _run_session

        def widened() -> None:
            got = _run_session(sess, {t: get() if callable(get) else get for t, get in inputs})
            for t, view in outputs:
                view[...] = got[t]

        return widened
    binding = sess.io_binding()
    for t, view in outputs:
        binding.bind_output(t, "cpu", 0, view.dtype, list(view.shape), view.ctypes.data)
    # the binding holds the outputs' addresses, not the arrays: the run keeps them (and the inputs
    # bound once) alive, so a caller that lets go of its arrays never has ONNX Runtime write freed memory
    held = [view for _, view in outputs]
    for t, get in inputs:
        if not callable(get):
            held.append(get)
            binding.bind_cpu_input(t, get)
    inputs = [(t, get) for t, get in inputs if callable(get)]

    def go() -> None:
        for t, get in inputs:
            binding.bind_cpu_input(t, get())
        sess.run_with_iobinding(binding)

    go.held = held
    return go


def library_runner(canonical: onnx.ModelProto, graph: Graph, kernel: Kernel,
                   inputs: dict[str, np.ndarray]) -> tuple[Callable[[], dict[str, np.ndarray]], list[str]]:
    """A zero-argument callable running the node on fixed inputs into outputs allocated once (the
    same arrays every call), and its output names."""
    from fusesearch.verify import session, session_feeds

    sess = session(node_model(canonical, graph, kernel))
    # aligned as our kernels' buffers are (`cpu.aligned_array`), so both are timed on like memory
    values = {t: np.asarray(inputs[t]) for t in kernel.inputs}
    arrays = {t: aligned_array(a.shape, a.dtype, a) for t, a in values.items()}
    names = list(kernel.outputs)
    if any(graph.tensors[t].shape is None for t in names):  # a dynamic output: ONNX Runtime allocates it
        given = session_feeds(sess, arrays)
        return (lambda: dict(zip(names, sess.run(names, given), strict=True))), names
    outs = {t: aligned_array(graph.tensors[t].shape, graph.tensors[t].dtype) for t in names}
    run = host_binding(sess, list(arrays.items()), list(outs.items()))

    def go() -> dict[str, np.ndarray]:
        run()
        return outs

    return go, names


CHAIN = 64  # Identity nodes in the chain whose runs give one node's share of a Run


def null_runs(threads: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """Two runs through IO binding with `threads` intra-op threads that compute nothing: a
    one-element Identity, and a chain of CHAIN + 1 of them (`run_costs` reads their times)."""
    from fusesearch.verify import session

    def model(n: int) -> onnx.ModelProto:
        names = ["x", *(f"v{i}" for i in range(n - 1)), "y"]
        nodes = [helper.make_node("Identity", [a], [b]) for a, b in zip(names, names[1:], strict=False)]
        vi = [helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, [1]) for t in ("x", "y")]
        return helper.make_model(helper.make_graph(nodes, "null", vi[:1], vi[1:]), opset_imports=[helper.make_opsetid("", 17)])

    a, b = np.zeros(1, np.float32), np.zeros(1, np.float32)
    one, chain = (host_binding(session(model(n), threads=threads), [("x", a)], [("y", b)])
                  for n in (1, CHAIN + 1))
    return one, chain


def run_costs(one_s: float, chain_s: float) -> tuple[float, float]:
    """(Run, node) seconds from the times of `null_runs`: ONNX Runtime's fixed cost of one Run
    through IO binding beyond its nodes, and what one trivial node costs inside a run (its
    dispatch): node = (chain - one) / CHAIN, Run = one - node."""
    node = max((chain_s - one_s) / CHAIN, 1e-9)
    return max(one_s - node, 0.0), node
