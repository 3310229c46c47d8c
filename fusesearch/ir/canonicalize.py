"""Canonicalize a loaded model to a fixed point, counting what each pass did.

Problem: exporters leave work no kernel should do (Identity, inference Dropout, static Shape
chains, BatchNormalization after a conv, weights computed at run time, a small loop); fusion and
costs must see the graph a good compiler would run.
Approach: loop over an `onnx_ir.Model`'s main graph until nothing changes: loop_unrolling and
if_conversion (a Loop of a small constant trip count, an If of a few elementwise ops, inlined),
identity, dropout, noop_cast, noop_reshape, constant_folding, common_subexpressions,
batchnorm_folding, conv_transpose_to_conv (kernel = stride: a 1x1 Conv + DepthToSpace),
einsum_to_matmul, matmul_add_to_gemm, dead_nodes, then shape inference and shape completion
(running a node once on zeros). onnx's reference evaluator folds constants; the passes are ours:
BN folding in float64 where the producer has no other consumer, MatMul+Add→Gemm only where exact.
Invariants: results never change (tests compare ONNX Runtime outputs on every zoo model); graph
input and output names are kept; an If/Loop/Scan body is copied whole or left whole, never
rewritten inside; node names stay unique."""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from collections.abc import Callable, Mapping

import numpy as np
import onnx
import onnx_ir as ir
from onnx.reference import ReferenceEvaluator
from onnx_ir.passes.common import ShapeInferencePass

from fusesearch.ir.shapes import broadcasts_to, static_shape

log = logging.getLogger(__name__)

MAX_ITERATIONS = 16
FOLD_LIMIT_BYTES = 1 << 30  # never materialize a folded constant above 1 GiB
COMPLETE_LIMIT_ELEMENTS = 1 << 24  # shape completion runs a node on zeros only when small
NEVER_FOLD = frozenset({
    "If", "Loop", "Scan", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
    "Multinomial", "Bernoulli", "SequenceEmpty", "SequenceConstruct", "SplitToSequence",
    "Optional", "OptionalGetElement", "OptionalHasElement",
})
CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})
ANCHORS_FOR_BN = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})

Counts = Counter


def canonicalize(model: ir.Model) -> tuple[ir.Model, dict[str, int]]:
    """Rewrite `model` in place to a fixed point; return it and the per-pass counts."""
    counts: Counts = Counter()
    opset = model.opset_imports.get("", 21)
    passes: list[Callable[[ir.Graph, int], int]] = [
        unroll_loops, if_to_where, remove_identity, remove_dropout, remove_noop_cast, remove_noop_reshape,
        fold_constants, merge_duplicates, fold_batchnorm, conv_transpose_to_conv, einsum_to_matmul,
        matmul_add_to_gemm, remove_dead_nodes,
    ]
    counts["shapes_completed"] += complete_shapes(model.graph, opset)
    for iteration in range(MAX_ITERATIONS):
        changed = 0
        for run in passes:
            done = run(model.graph, opset)
            counts[_pass_name(run)] += done
            changed += done
        if not changed:
            break
        _infer_shapes(model)
        counts["shapes_completed"] += complete_shapes(model.graph, opset)
        log.debug("canonicalize iteration %d: %d rewrites", iteration, changed)
    counts["unused_weights"] += remove_unused_initializers(model.graph)
    return model, {k: int(v) for k, v in sorted(counts.items())}


def _pass_name(run: Callable) -> str:
    return {
        "remove_identity": "identity", "remove_dropout": "dropout", "remove_noop_cast": "noop_cast",
        "remove_noop_reshape": "noop_reshape", "fold_constants": "constant_folding",
        "fold_batchnorm": "batchnorm_folding", "conv_transpose_to_conv": "conv_transpose_to_conv",
        "einsum_to_matmul": "einsum_to_matmul",
        "matmul_add_to_gemm": "matmul_add_to_gemm",
        "remove_dead_nodes": "dead_nodes", "unroll_loops": "loop_unrolling", "if_to_where": "if_conversion",
        "merge_duplicates": "common_subexpressions",
    }[run.__name__]


def _infer_shapes(model: ir.Model) -> None:
    ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)


# -- helpers ----------------------------------------------------------------------------------

def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None:
        return None
    return value.const_value.numpy()


def _attr(node: ir.Node, name: str, default=None):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _only_use_is(value: ir.Value, node: ir.Node) -> bool:
    users = {id(u.node) for u in value.uses()}
    return users == {id(node)} and not value.is_graph_output()


def _new_initializer(graph: ir.Graph, base: str, array: np.ndarray) -> ir.Value:
    name, k = base, 1
    while name in graph.initializers:
        name, k = f"{base}_{k}", k + 1
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                     const_value=ir.tensor(array, name=name))
    graph.register_initializer(value)
    return value


def _bypass(graph: ir.Graph, old: ir.Value, new: ir.Value) -> bool:
    """Make every user of `old` read `new`; keep graph output names. False if impossible."""
    if old.is_graph_output():
        if new.is_graph_input() or new.is_graph_output() or new.is_initializer() or new.producer() is None:
            return False
        name = old.name
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        old.name = None
        new.name = name
        return True
    old.replace_all_uses_with(new)
    return True


def _remove(graph: ir.Graph, node: ir.Node) -> None:
    graph.remove(node, safe=True)


# -- passes -----------------------------------------------------------------------------------

def _main_nodes(graph: ir.Graph, op_type: str | None = None) -> list[ir.Node]:
    return [n for n in graph if n.domain in ("", "ai.onnx") and (op_type is None or n.op_type == op_type)]


def _remove_passthrough(graph: ir.Graph, node: ir.Node) -> int:
    if node.inputs[0] is None or not _bypass(graph, node.outputs[0], node.inputs[0]):
        return 0
    _remove(graph, node)
    return 1


def remove_identity(graph: ir.Graph, opset: int) -> int:
    return sum(_remove_passthrough(graph, n) for n in _main_nodes(graph, "Identity"))


def remove_dropout(graph: ir.Graph, opset: int) -> int:
    done = 0
    for node in _main_nodes(graph, "Dropout"):
        training = _const(node.inputs[2]) if len(node.inputs) > 2 else None
        if len(node.inputs) > 2 and node.inputs[2] is not None and (training is None or bool(training)):
            continue  # training mode, or not known to be off
        if len(node.outputs) > 1 and node.outputs[1].uses() or any(o.is_graph_output() for o in node.outputs[1:]):
            continue  # the mask is used
        done += _remove_passthrough(graph, node)
    return done


def remove_noop_cast(graph: ir.Graph, opset: int) -> int:
    done = 0
    for node in _main_nodes(graph, "Cast"):
        src = node.inputs[0]
        if src is not None and src.dtype is not None and src.dtype.value == _attr(node, "to"):
            done += _remove_passthrough(graph, node)
    return done


def remove_noop_reshape(graph: ir.Graph, opset: int) -> int:
    done = 0
    for node in _main_nodes(graph, "Reshape") + _main_nodes(graph, "Flatten") + _main_nodes(graph, "Squeeze") \
            + _main_nodes(graph, "Unsqueeze") + _main_nodes(graph, "Expand"):
        src_shape, out_shape = static_shape(node.inputs[0]), static_shape(node.outputs[0])
        if src_shape is not None and src_shape == out_shape:
            done += _remove_passthrough(graph, node)
    return done


def remove_dead_nodes(graph: ir.Graph, opset: int) -> int:
    done = 0
    for node in reversed(list(graph)):
        if any(o.uses() or o.is_graph_output() for o in node.outputs):
            continue
        _remove(graph, node)
        done += 1
    return done


def remove_unused_initializers(graph: ir.Graph) -> int:
    unused = [name for name, v in graph.initializers.items() if not v.uses() and not v.is_graph_output()]
    for name in unused:
        graph.initializers.pop(name)
    return len(unused)


# -- constant folding -------------------------------------------------------------------------

def fold_constants(graph: ir.Graph, opset: int) -> int:
    done = 0
    for node in list(graph):
        if node.domain not in ("", "ai.onnx") or node.op_type in NEVER_FOLD:
            continue
        if any(o.is_graph_output() for o in node.outputs):
            continue
        arrays = _shape_query(node) if node.op_type in ("Shape", "Size") else _evaluate(node, opset)
        if arrays is None:
            continue
        for out, array in zip(node.outputs, arrays, strict=True):
            name, out.name = out.name or f"{node.name}_out", None
            out.replace_all_uses_with(_new_initializer(graph, name, np.asarray(array)))
        _remove(graph, node)
        done += 1
    return done


def _shape_query(node: ir.Node) -> list[np.ndarray] | None:
    shape = static_shape(node.inputs[0])
    if shape is None:
        return None
    if node.op_type == "Size":
        return [np.array(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)]
    rank = len(shape)
    start = _attr(node, "start", 0)
    end = _attr(node, "end", rank)
    return [np.array(shape[slice(start, end)], dtype=np.int64)]


def _evaluate(node: ir.Node, opset: int) -> list[np.ndarray] | None:
    inputs = [_const(v) if v is not None else None for v in node.inputs]
    if any(v is not None and a is None for v, a in zip(node.inputs, inputs, strict=True)):
        return None
    if not any(out.uses() for out in node.outputs):
        return None  # dead: left to remove_dead_nodes
    if _estimated_bytes(node) > FOLD_LIMIT_BYTES:
        return None
    proto = ir.serde.serialize_node(node)
    names = [f"in{i}" if v is not None else "" for i, v in enumerate(node.inputs)]
    del proto.input[:]
    proto.input.extend(names)
    del proto.output[:]
    proto.output.extend(f"out{i}" for i in range(len(node.outputs)))
    try:
        results = ReferenceEvaluator(proto, opsets={"": opset}).run(
            None, {n: a for n, a in zip(names, inputs, strict=True) if n})
    except Exception as exc:  # an op the evaluator cannot run stays as it is
        log.debug("not folded %s (%s): %s", node.name, node.op_type, exc)
        return None
    return [np.asarray(r) for r in results]


def _estimated_bytes(node: ir.Node) -> int:
    total = 0
    for out in node.outputs:
        shape = static_shape(out)
        if shape is None:
            return 0  # unknown: evaluate and see
        itemsize = out.dtype.itemsize if out.dtype is not None else 8
        total += int(np.prod(shape, dtype=np.int64)) * int(itemsize)
    return total


# -- control flow inlined ---------------------------------------------------------------------

UNROLL_MAX_TRIPS = 16  # a Loop of at most this many iterations, known when the model loads, is unrolled
UNROLL_MAX_NODES = 512  # ... where its body's nodes times its iterations stay within this
IF_MAX_NODES = 8  # an If whose branches hold at most this many elementwise nodes each ...
IF_MAX_ELEMENTS = 1 << 16  # ... and whose outputs hold at most this many elements computes both and selects
IF_OPS = frozenset({  # floating-point elementwise ops that cannot fail on any input: both branches run
    "Abs", "Add", "Ceil", "Clip", "Cos", "Div", "Elu", "Erf", "Exp", "Floor", "HardSigmoid", "HardSwish",
    "Identity", "LeakyRelu", "Log", "Max", "Min", "Mul", "Neg", "Pow", "Reciprocal", "Relu", "Round",
    "Selu", "Sigmoid", "Sign", "Sin", "Softplus", "Softsign", "Sqrt", "Sub", "Tanh",
})
FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


def _has_subgraph(node: ir.Node) -> bool:
    return any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())


def _inline(graph: ir.Graph, at: ir.Node, body: ir.Graph, mapping: dict, prefix: str) -> None:
    """Copies of `body`'s nodes inserted before `at`, each input read through `mapping` (a body
    value to the main graph's; an outer-scope value is read as it is), named `prefix` + the
    body's name; `mapping` then holds each body output's copy too. The body's weights become
    weights of the main graph (`mapping` says where one already is)."""
    for name, value in body.initializers.items():
        if value not in mapping:
            mapping[value] = _new_initializer(graph, f"{prefix}{name}", value.const_value.numpy())
    copies = []
    for i, node in enumerate(body):
        attrs = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
        copy = ir.Node(node.domain, node.op_type, [mapping.get(v, v) for v in node.inputs], attributes=attrs,
                       num_outputs=len(node.outputs), name=f"{prefix}{node.name or f'{node.op_type}{i}'}",
                       version=node.version)
        for j, (old, new) in enumerate(zip(node.outputs, copy.outputs, strict=True)):
            new.name, new.type = f"{prefix}{old.name or f'{i}_{j}'}", old.type
            mapping[old] = new
        copies.append(copy)
    graph.insert_before(at, copies)


def _prefix(graph: ir.Graph, node: ir.Node, kind: str) -> str:
    """A prefix for the copies of `node`'s bodies no name in `graph` starts with."""
    base = node.name or kind
    names = {n.name for n in graph} | {v.name for n in graph for v in n.outputs} | set(graph.initializers)
    k, prefix = 0, f"{base}/"
    while any(name and name.startswith(prefix) for name in names):
        k, prefix = k + 1, f"{base}_{k + 1}/"
    return prefix


def _take_over(graph: ir.Graph, at: ir.Node, old: ir.Value, new: ir.Value) -> None:
    """`old` (an output of `at`, about to go) replaced by `new` through an Identity (its own
    output keeps a graph output's name; `remove_identity` removes it where it can)."""
    identity = ir.Node("", "Identity", [new], num_outputs=1, name=f"{at.name or at.op_type}/{old.name}")
    graph.insert_before(at, identity)
    _bypass(graph, old, identity.outputs[0])


def unroll_loops(graph: ir.Graph, opset: int) -> int:
    """A Loop whose trip count is a constant of 1..UNROLL_MAX_TRIPS, whose condition is absent or
    a constant true and stays true (the body passes it through or sets it true), with no
    subgraph in its body, becomes its body's copies, one per iteration (the iteration number a
    constant, the carried values threaded through; scan outputs stacked by Unsqueeze + Concat)."""
    return sum(_unroll(graph, node, opset) for node in _main_nodes(graph, "Loop"))


def _stays_true(cond_out: ir.Value, cond_in: ir.Value) -> bool:
    producer = cond_out.producer()
    constant = _const(cond_out)
    if constant is not None:
        return constant.size == 1 and bool(constant.reshape(()))
    return cond_out is cond_in or (producer is not None and producer.op_type == "Identity"
                                   and producer.inputs[0] is cond_in)


def _unroll(graph: ir.Graph, loop: ir.Node, opset: int) -> int:
    trips = _const(loop.inputs[0]) if loop.inputs and loop.inputs[0] is not None else None
    cond = _const(loop.inputs[1]) if len(loop.inputs) > 1 and loop.inputs[1] is not None else np.array(True)
    body = loop.attributes["body"].value
    if trips is None or trips.size != 1 or cond is None or cond.size != 1 or not bool(cond.reshape(())):
        return 0
    count, carried = int(trips.reshape(())), len(loop.inputs) - 2
    if (not 1 <= count <= UNROLL_MAX_TRIPS or count * len(body) > UNROLL_MAX_NODES or any(map(_has_subgraph, body))
            or len(body.inputs) != carried + 2 or len(loop.outputs) != len(body.outputs) - 1
            or not _stays_true(body.outputs[0], body.inputs[1])):
        return 0  # also a Loop whose outputs or body inputs do not match its carried values (left to ONNX Runtime)
    state, scans = list(loop.inputs[2:]), [[] for _ in body.outputs[1 + carried:]]
    prefix = _prefix(graph, loop, "loop")
    mapping: dict = {body.inputs[1]: _new_initializer(graph, f"{prefix}cond", np.array(True))}
    for it in range(count):
        mapping.update({body.inputs[0]: _new_initializer(graph, f"{prefix}iteration{it}", np.array(it, np.int64))})
        mapping.update(zip(body.inputs[2:], state, strict=True))
        _inline(graph, loop, body, mapping, f"{prefix}{it}/")
        state = [mapping.get(v, v) for v in body.outputs[1:1 + carried]]
        for k, v in enumerate(body.outputs[1 + carried:]):
            scans[k].append(mapping.get(v, v))
    for old, new in zip(loop.outputs[:carried], state, strict=True):
        _take_over(graph, loop, old, new)
    axes = _new_initializer(graph, f"{prefix}axes", np.array([0], np.int64)) if opset >= 13 else None
    for k, (old, values) in enumerate(zip(loop.outputs[carried:], scans, strict=True)):
        rows = [ir.Node("", "Unsqueeze", [v, axes] if axes is not None else [v], num_outputs=1, name=f"{prefix}scan{k}/{i}",
                        attributes=[] if axes is not None else [ir.AttrInt64s("axes", [0])])
                for i, v in enumerate(values)]
        stack = ir.Node("", "Concat", [r.outputs[0] for r in rows], attributes=[ir.AttrInt64("axis", 0)],
                        num_outputs=1, name=f"{prefix}scan{k}")
        graph.insert_before(loop, [*rows, stack])
        _take_over(graph, loop, old, stack.outputs[0])
    _remove(graph, loop)
    return 1


def if_to_where(graph: ir.Graph, opset: int) -> int:
    """An If whose condition holds one value and whose branches are at most IF_MAX_NODES nodes of
    IF_OPS each, with floating-point outputs of the If's static shape and at most
    IF_MAX_ELEMENTS elements, becomes both branches' copies and a Where per output (what a
    compiler's if-conversion does: no call into control flow, both sides computed; neither can
    fail, and Where takes only the chosen side's values, a NaN on the other included)."""
    return sum(_if_to_where(graph, node) for node in _main_nodes(graph, "If")) if opset >= 9 else 0  # Where: opset 9


def _convertible(node: ir.Node) -> bool:
    cond_shape = static_shape(node.inputs[0])
    if cond_shape is None or math.prod(cond_shape) != 1:
        return False
    for key in ("then_branch", "else_branch"):
        branch = node.attributes[key].value
        if (len(branch) > IF_MAX_NODES or branch.inputs or len(branch.outputs) != len(node.outputs)
                or any(n.domain not in ("", "ai.onnx") or n.op_type not in IF_OPS for n in branch)):
            return False
        for out, mine in zip(branch.outputs, node.outputs, strict=True):
            shape = static_shape(mine)
            if (shape is None or static_shape(out) != shape or math.prod(shape) > IF_MAX_ELEMENTS
                    or mine.dtype not in FLOAT_TYPES or out.dtype != mine.dtype):
                return False
    return True


def _if_to_where(graph: ir.Graph, node: ir.Node) -> int:
    if not _convertible(node):
        return 0
    sides, prefix = [], _prefix(graph, node, "if")
    for key in ("then_branch", "else_branch"):
        branch, mapping = node.attributes[key].value, {}
        _inline(graph, node, branch, mapping, f"{prefix}{key}/")
        sides.append([mapping.get(v, v) for v in branch.outputs])
    cond = node.inputs[0]
    if static_shape(cond) != ():  # one value of another rank: a scalar, so Where keeps the outputs' shapes
        scalar = _new_initializer(graph, f"{prefix}scalar", np.zeros(0, np.int64))
        reshape = ir.Node("", "Reshape", [cond, scalar], num_outputs=1, name=f"{prefix}cond")
        graph.insert_before(node, reshape)
        cond = reshape.outputs[0]
    for k, (old, then, other) in enumerate(zip(node.outputs, *sides, strict=True)):
        where = ir.Node("", "Where", [cond, then, other], num_outputs=1, name=f"{prefix}where{k}")
        graph.insert_before(node, where)
        _take_over(graph, node, old, where.outputs[0])
    _remove(graph, node)
    return 1


_PLAIN_ATTRS = frozenset({ir.AttributeType.INT, ir.AttributeType.FLOAT, ir.AttributeType.STRING,
                          ir.AttributeType.INTS, ir.AttributeType.FLOATS, ir.AttributeType.STRINGS})


def merge_duplicates(graph: ir.Graph, opset: int) -> int:
    """Common subexpressions: a standard-domain node with the op, inputs and attributes (numbers,
    strings and their lists, compared exactly; a node with a tensor or a subgraph attribute is
    left alone, as is a random op or a Dropout, random when training) of an earlier one reads that one's outputs instead (an unrolled
    loop's iterations repeat what does not depend on the iteration)."""
    seen: dict[tuple, ir.Node] = {}
    done = 0
    for node in list(graph):
        if (node.domain not in ("", "ai.onnx") or node.op_type in NEVER_FOLD or node.op_type == "Dropout"
                or any(a.type not in _PLAIN_ATTRS for a in node.attributes.values())):
            continue
        attrs = tuple(sorted((a.name, repr(a.value)) for a in node.attributes.values()))
        key = (node.domain, node.op_type, node.overload, tuple(id(v) for v in node.inputs), attrs, len(node.outputs))
        first = seen.setdefault(key, node)
        if first is node or not all(_bypass(graph, old, new) for old, new in zip(node.outputs, first.outputs, strict=True)):
            continue
        _remove(graph, node)
        done += 1
    return done


# -- BatchNormalization folding ---------------------------------------------------------------

def fold_batchnorm(graph: ir.Graph, opset: int) -> int:
    done = 0
    for bn in _main_nodes(graph, "BatchNormalization"):
        folded = _fold_one_bn(graph, bn)
        done += folded
    return done


def _bn_scale_shift(bn: ir.Node) -> tuple[np.ndarray, np.ndarray] | None:
    params = [_const(v) for v in bn.inputs[1:5]]
    if any(p is None for p in params) or _attr(bn, "training_mode", 0) or not _attr(bn, "spatial", 1):
        return None
    if any(o.uses() or o.is_graph_output() for o in bn.outputs[1:]):
        return None
    gamma, beta, mean, var = (p.astype(np.float64).reshape(-1) for p in params)
    scale = gamma / np.sqrt(var + float(_attr(bn, "epsilon", 1e-5)))
    return scale, beta - mean * scale


def _fold_one_bn(graph: ir.Graph, bn: ir.Node) -> int:
    x = bn.inputs[0]
    producer = x.producer() if x is not None else None
    if producer is None or producer.op_type not in ANCHORS_FOR_BN or producer.domain not in ("", "ai.onnx"):
        return 0
    if not _only_use_is(x, bn):
        return 0
    st = _bn_scale_shift(bn)
    if st is None:
        return 0
    fold = {"Conv": _fold_into_conv, "ConvTranspose": _fold_into_conv_transpose,
            "Gemm": _fold_into_gemm, "MatMul": _fold_into_matmul}[producer.op_type]
    new_out = fold(graph, producer, bn, *st)
    if new_out is None or not _bypass(graph, bn.outputs[0], new_out):
        return 0
    _remove(graph, bn)
    return 1


def _set_input(node: ir.Node, index: int, value: ir.Value) -> None:
    if len(node.inputs) <= index:
        node.resize_inputs(index + 1)
    node.replace_input_with(index, value)


def _fold_into_conv(graph, conv, bn, scale, shift) -> ir.Value | None:
    w = _const(conv.inputs[1])
    bias = _const(conv.inputs[2]) if len(conv.inputs) > 2 and conv.inputs[2] is not None else None
    if w is None or (len(conv.inputs) > 2 and conv.inputs[2] is not None and bias is None) or w.shape[0] != scale.size:
        return None
    w64 = w.astype(np.float64) * scale.reshape((-1,) + (1,) * (w.ndim - 1))
    b64 = (bias.astype(np.float64) if bias is not None else 0.0) * scale + shift
    _set_input(conv, 1, _new_initializer(graph, f"{conv.name}.W_bn", w64.astype(w.dtype)))
    _set_input(conv, 2, _new_initializer(graph, f"{conv.name}.B_bn", b64.astype(w.dtype)))
    return conv.outputs[0]


def _fold_into_conv_transpose(graph, conv, bn, scale, shift) -> ir.Value | None:
    w = _const(conv.inputs[1])
    bias = _const(conv.inputs[2]) if len(conv.inputs) > 2 and conv.inputs[2] is not None else None
    if w is None or (len(conv.inputs) > 2 and conv.inputs[2] is not None and bias is None):
        return None
    group = int(_attr(conv, "group", 1))
    cin, cout_g = w.shape[0], w.shape[1]
    if cout_g * group != scale.size:
        return None
    grouped = w.astype(np.float64).reshape((group, cin // group, cout_g) + w.shape[2:])
    grouped = grouped * scale.reshape((group, 1, cout_g) + (1,) * (w.ndim - 2))
    b64 = (bias.astype(np.float64) if bias is not None else 0.0) * scale + shift
    _set_input(conv, 1, _new_initializer(graph, f"{conv.name}.W_bn", grouped.reshape(w.shape).astype(w.dtype)))
    _set_input(conv, 2, _new_initializer(graph, f"{conv.name}.B_bn", b64.astype(w.dtype)))
    return conv.outputs[0]


def _fold_into_gemm(graph, gemm, bn, scale, shift) -> ir.Value | None:
    b = _const(gemm.inputs[1])
    has_c = len(gemm.inputs) > 2 and gemm.inputs[2] is not None
    c = _const(gemm.inputs[2]) if has_c else None
    out_shape = static_shape(gemm.outputs[0])
    if b is None or (has_c and c is None) or out_shape is None or out_shape[1] != scale.size:
        return None
    trans_b = int(_attr(gemm, "transB", 0))
    beta = float(_attr(gemm, "beta", 1.0)) if has_c else 1.0
    if beta == 0.0:
        return None
    b64 = b.astype(np.float64) * (scale[:, None] if trans_b else scale[None, :])
    c64 = (c.astype(np.float64) * scale if c is not None else 0.0) + shift / beta
    c64 = np.broadcast_to(c64, np.broadcast_shapes(np.shape(c64), (scale.size,))).copy()
    _set_input(gemm, 1, _new_initializer(graph, f"{gemm.name}.B_bn", b64.astype(b.dtype)))
    _set_input(gemm, 2, _new_initializer(graph, f"{gemm.name}.C_bn", c64.astype(b.dtype)))
    if not has_c:
        gemm.attributes["beta"] = ir.AttrFloat32("beta", 1.0)
    return gemm.outputs[0]


def _fold_into_matmul(graph, matmul, bn, scale, shift) -> ir.Value | None:
    """Y = A @ B with a 2-D output: BN's channel axis is N, so B's columns take the scale and an
    Add of the shift follows (matmul_add_to_gemm may then make a Gemm of it)."""
    b = _const(matmul.inputs[1])
    out_shape = static_shape(matmul.outputs[0])
    if b is None or b.ndim != 2 or out_shape is None or len(out_shape) != 2 or out_shape[1] != scale.size:
        return None
    b64 = b.astype(np.float64) * scale[None, :]
    matmul.replace_input_with(1, _new_initializer(graph, f"{matmul.name}.B_bn", b64.astype(b.dtype)))
    shift_value = _new_initializer(graph, f"{bn.name}.shift", shift.astype(b.dtype))
    add = ir.Node("", "Add", [matmul.outputs[0], shift_value], name=bn.name + "_shift")
    add.outputs[0].name = f"{bn.name}_shift_out"
    add.outputs[0].shape = ir.Shape(out_shape)
    add.outputs[0].type = ir.TensorType(ir.DataType.from_numpy(b.dtype))
    graph.insert_after(matmul, add)
    return add.outputs[0]


# -- ConvTranspose with kernel = stride -> 1x1 Conv + DepthToSpace ------------------------------

def conv_transpose_to_conv(graph: ir.Graph, opset: int) -> int:
    """A 2-D ConvTranspose whose kernel equals its stride (s x s, no padding, dilation, groups or
    output padding: U-Net's 2x2 stride-2 upsampling) writes each input pixel's s*s output pixels
    from that pixel alone: y[o, s*i + a, s*j + b] = sum_c x[c, i, j] w[c, o, a, b] + B[o], a 1x1
    Conv to s*s*O channels ordered (a, b, o) followed by DepthToSpace (DCR, blocksize s). The
    same sums in the same order; the Conv is then a GEMM every backend writes well (packed on
    a CPU, blocked channels where the plan chooses them, tensor cores on a GPU) and the shuffle
    moves whole channel blocks."""
    done = 0
    for node in _main_nodes(graph, "ConvTranspose"):
        done += _conv_from_transpose(graph, node)
    return done


def _conv_from_transpose(graph: ir.Graph, node: ir.Node) -> int:
    w = _const(node.inputs[1]) if len(node.inputs) > 1 else None
    has_bias = len(node.inputs) > 2 and node.inputs[2] is not None
    bias = _const(node.inputs[2]) if has_bias else None
    x = node.inputs[0]
    if w is None or w.ndim != 4 or (has_bias and bias is None) or x is None or x.shape is None or len(x.shape) != 4:
        return 0
    s, cout = w.shape[2], w.shape[1]
    plain = {"kernel_shape": [s, s], "strides": [1, 1], "group": 1, "dilations": [1, 1], "pads": [0, 0, 0, 0],
             "output_padding": [0, 0], "output_shape": None}
    attrs = {k: _attr(node, k, v) for k, v in plain.items()}
    if (w.shape[3] != s or s < 2 or list(attrs["kernel_shape"]) != [s, s] or list(attrs["strides"]) != [s, s]
            or int(attrs["group"]) != 1 or list(attrs["dilations"]) != [1, 1] or any(attrs["pads"])
            or any(attrs["output_padding"]) or attrs["output_shape"] is not None
            or _attr(node, "auto_pad", "NOTSET") not in ("NOTSET", "VALID")):
        return 0
    w1 = np.ascontiguousarray(w.transpose(2, 3, 1, 0)).reshape(s * s * cout, w.shape[0], 1, 1)
    inputs = [x, _new_initializer(graph, f"{node.name}.W_1x1", w1)]
    if bias is not None:
        inputs.append(_new_initializer(graph, f"{node.name}.B_1x1", np.tile(bias.reshape(-1), s * s)))
    n, _, h, wd = tuple(x.shape)
    names = {m.name for m in graph}
    conv = ir.Node("", "Conv", inputs, attributes=[ir.AttrInt64s("kernel_shape", [1, 1])], name=node.name)
    conv.outputs[0].name = f"{node.name}_1x1_out"
    conv.outputs[0].shape = ir.Shape([n, s * s * cout, h, wd])
    conv.outputs[0].type = node.outputs[0].type
    shuffle_name, k = f"{node.name}_shuffle", 1
    while shuffle_name in names:
        shuffle_name, k = f"{node.name}_shuffle_{k}", k + 1
    shuffle = ir.Node("", "DepthToSpace", [conv.outputs[0]], attributes=[ir.AttrInt64("blocksize", s)],
                      name=shuffle_name)
    shuffle.outputs[0].name = f"{shuffle_name}_out"
    shuffle.outputs[0].shape = node.outputs[0].shape
    shuffle.outputs[0].type = node.outputs[0].type
    graph.insert_after(node, [conv, shuffle])
    if not _bypass(graph, node.outputs[0], shuffle.outputs[0]):
        graph.remove([conv, shuffle])
        return 0
    _remove(graph, node)
    return 1


# -- MatMul + Add -> Gemm ---------------------------------------------------------------------

def matmul_add_to_gemm(graph: ir.Graph, opset: int) -> int:
    done = 0
    for matmul in _main_nodes(graph, "MatMul"):
        done += _gemm_from(graph, matmul)
    return done


def _gemm_from(graph: ir.Graph, matmul: ir.Node) -> int:
    out = matmul.outputs[0]
    users = [u.node for u in out.uses()]
    if len(users) != 1 or out.is_graph_output() or users[0].op_type != "Add" or users[0].domain not in ("", "ai.onnx"):
        return 0
    add = users[0]
    a_shape, b_shape = static_shape(matmul.inputs[0]), static_shape(matmul.inputs[1])
    if a_shape is None or b_shape is None or len(a_shape) != 2 or len(b_shape) != 2:
        return 0
    bias = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
    c_shape, mn = static_shape(bias), (a_shape[0], b_shape[1])
    if bias is out or c_shape is None or static_shape(add.outputs[0]) != mn or not broadcasts_to(c_shape, mn):
        return 0
    if out.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.BFLOAT16):
        return 0
    gemm = ir.Node("", "Gemm", [matmul.inputs[0], matmul.inputs[1], bias], name=matmul.name)
    gemm.outputs[0].name = f"{matmul.name}_gemm_out"
    gemm.outputs[0].shape = ir.Shape(mn)
    gemm.outputs[0].type = out.type
    graph.insert_after(add, gemm)
    if not _bypass(graph, add.outputs[0], gemm.outputs[0]):
        graph.remove(gemm)
        return 0
    _remove(graph, add)
    _remove(graph, matmul)
    return 1


def einsum_to_matmul(graph: ir.Graph, opset: int) -> int:
    """An Einsum of two operands that is a (batched) matrix product becomes Transposes around a
    MatMul, which the cost model prices and the generators write; any other Einsum stays opaque."""
    return sum(_matmul_from(graph, n) for n in _main_nodes(graph, "Einsum"))


def einsum_as_matmul(equation: str, ranks: tuple[int, int]) -> tuple[list[int], list[int], list[int]] | None:
    """For a two-operand `equation` that is a batched matrix product (each index once per operand,
    exactly one summed index, at most one index of each operand's own, batch indices in both
    operands and the output), the permutations that bring A to (batch..., M, K) and B to
    (batch..., K, N), and the one that brings MatMul's (batch..., M, N) to the output's order;
    else None."""
    spec = equation.replace(" ", "")
    if "->" not in spec or "." in spec:
        return None
    lhs, out = spec.split("->")
    operands = lhs.split(",")
    if len(operands) != 2 or tuple(len(o) for o in operands) != ranks:
        return None
    a, b = operands
    if any(len(set(x)) != len(x) for x in (a, b, out)) or not set(out) <= set(a) | set(b):
        return None
    batch = [c for c in out if c in a and c in b]
    summed = [c for c in a if c in b and c not in out]
    m = [c for c in a if c not in b]
    n = [c for c in b if c not in a]
    if len(summed) != 1 or len(m) != 1 or len(n) != 1 or not set(m + n) <= set(out):
        return None
    a_order, b_order, mm = batch + m + summed, batch + summed + n, batch + m + n
    return ([a.index(c) for c in a_order], [b.index(c) for c in b_order], [mm.index(c) for c in out])


def _matmul_from(graph: ir.Graph, einsum: ir.Node) -> int:
    if len(einsum.inputs) != 2 or any(v is None or static_shape(v) is None for v in einsum.inputs):
        return 0
    x, y = einsum.inputs
    perms = einsum_as_matmul(str(_attr(einsum, "equation", "")), (len(static_shape(x)), len(static_shape(y))))
    if perms is None:
        return 0
    a_perm, b_perm, out_perm = perms
    name, out = einsum.name, einsum.outputs[0]
    made: list[ir.Node] = []

    def transpose(value: ir.Value, perm: list[int], label: str) -> ir.Value:
        if perm == sorted(perm):
            return value
        node = ir.Node("", "Transpose", [value], attributes=[ir.AttrInt64s("perm", perm)], name=f"{name}_{label}")
        node.outputs[0].name = f"{name}_{label}_out"
        node.outputs[0].type = value.type
        made.append(node)
        return node.outputs[0]

    matmul = ir.Node("", "MatMul", [transpose(x, a_perm, "a"), transpose(y, b_perm, "b")], name=f"{name}_matmul")
    matmul.outputs[0].name = f"{name}_matmul_out"
    matmul.outputs[0].type = out.type
    made.append(matmul)
    result = transpose(matmul.outputs[0], out_perm, "out")
    graph.insert_before(einsum, made)
    if not _bypass(graph, out, result):
        for node in reversed(made):
            graph.remove(node)
        return 0
    _remove(graph, einsum)
    return 1


# -- shape completion -------------------------------------------------------------------------

def complete_shapes(graph: ir.Graph, opset: int) -> int:
    """Run, on zeros, each node whose inputs are known but outputs unknown to onnx's inference."""
    done = 0
    for node in graph:
        if node.domain not in ("", "ai.onnx") or node.op_type in NEVER_FOLD - CONTROL_FLOW:
            continue
        if all(static_shape(o) is not None for o in node.outputs):
            continue
        done += _complete_one(node, opset)
    return done


def _complete_one(node: ir.Node, opset: int) -> int:
    from fusesearch.ir._from_ir import captured_values

    values = {v.name: v for v in list(node.inputs) + captured_values(node) if v is not None}
    consts = {name: _const(v) for name, v in values.items()}
    shapes = {name: static_shape(v) for name, v in values.items() if consts[name] is None}
    if any(shape is None or values[name].dtype is None for name, shape in shapes.items()):
        return 0
    size = sum(math.prod(s) for s in shapes.values()) + sum(c.size for c in consts.values() if c is not None)
    if size > COMPLETE_LIMIT_ELEMENTS:  # counted before the zeros are allocated
        return 0
    feeds = {name: np.zeros(shapes[name], dtype=v.dtype.numpy()) if name in shapes else consts[name]
             for name, v in values.items()}
    proto = ir.serde.serialize_node(node)
    try:
        results = ReferenceEvaluator(proto, opsets={"": opset}).run(None, feeds)
    except Exception:  # still unknown; costs treat the node as opaque
        return 0
    for out, res in zip(node.outputs, results, strict=True):
        res = np.asarray(res)
        out.shape = ir.Shape(res.shape)
        if out.dtype is None:
            out.type = ir.TensorType(ir.DataType.from_numpy(res.dtype))
    return 1


def lowest_ir_version(model: ir.Model) -> int:
    """The lowest IR version the model's opsets allow (runtimes lag onnx's newest)."""
    return ir_version_for(model.opset_imports, bool(model.functions))


def ir_version_for(opset_imports: Mapping[str, int], functions: bool = False) -> int:
    """The lowest IR version for these opsets: at least 7 (initializers need not be graph
    inputs), 8 with model-local functions."""
    opsets = [onnx.helper.make_opsetid(domain, version) for domain, version in opset_imports.items()]
    return max(onnx.helper.find_min_ir_version_for(opsets, ignore_unknown=True), 8 if functions else 7)


def to_proto(model: ir.Model) -> onnx.ModelProto:
    """The model as a proto. A weight left memory-mapped in its model's data file (too large to
    read into memory) stays external there, named by its file's absolute path: whoever reads the
    proto (ONNX Runtime through `verify.session`, `export.save_model`) finds it from any working
    folder, and none takes it for a file beside itself."""
    proto = ir.serde.serialize_model(model)
    proto.ir_version = lowest_ir_version(model)
    files = {str(t.location): os.path.abspath(t.path)
             for t in ir.external_data._all_tensors(model.graph, include_attributes=True)
             if isinstance(t, ir.ExternalTensor)}
    if files:
        from onnx.external_data_helper import _get_all_tensors

        for tensor in _get_all_tensors(proto):
            for entry in tensor.external_data:
                if entry.key == "location" and entry.value in files:
                    entry.value = files[entry.value]
    return proto


def data_file(tensor: onnx.TensorProto) -> str | None:
    """The data file of a weight `to_proto` left in it (an absolute location of a readable file)."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    location = next((e.value for e in tensor.external_data if e.key == "location"), "")
    return location if os.path.isabs(location) and os.path.isfile(location) else None


def weight_array(tensor: onnx.TensorProto) -> np.ndarray:
    """A weight of a `to_proto` model as an array: memory-mapped from its data file, not copied,
    when it is there (read from it when its bytes do not map one to one, as packed 4-bit types),
    else decoded from the proto."""
    file = data_file(tensor)
    if file is None:
        return np.ascontiguousarray(onnx.numpy_helper.to_array(tensor))
    info = {e.key: e.value for e in tensor.external_data}
    offset, length = int(info.get("offset", 0)), int(info["length"]) if "length" in info else -1
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
    if length > 0 and length == math.prod(tensor.dims) * dtype.itemsize:
        return np.memmap(file, dtype=dtype, mode="r", offset=offset, shape=tuple(tensor.dims))
    inline = onnx.TensorProto()
    inline.CopyFrom(tensor)
    del inline.external_data[:]
    inline.data_location = onnx.TensorProto.DEFAULT
    with open(file, "rb") as f:
        f.seek(offset)
        inline.raw_data = f.read(length)
    return np.ascontiguousarray(onnx.numpy_helper.to_array(inline))
