"""A fused ONNX model that keeps a dynamic dim: one model for every bucket of a plan over buckets.

Problem: canonicalization binds every dim, so a fused model is specialized to one shape; a plan
over `--dim seq=16..512` needs one fused model ONNX Runtime runs at any seq in the range.
Approach: the buckets' canonical models have the same nodes (`buckets.check_same_graph`). Fuse the
largest bucket's, then generalize what differs: a Reshape target's one differing entry becomes -1;
a constant that is the largest's leading slice along the varying axes (position embeddings, a
causal mask) is sliced at run time to the dim read from its graph input. Graph inputs and outputs
get the dim back by name; main-graph value_info is dropped. Anything else that varies is refused,
naming the node and the tensor.
Invariants: the dynamic model equals the original at every bucket and any value between smallest
and largest (checked by ONNX Runtime: `verify_dynamic`); values above the largest are out of range."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fusesearch.errors import BadInput


def dynamic_model(fused: onnx.ModelProto, canonicals: Sequence[onnx.ModelProto], values: Sequence[int],
                  dim: str) -> onnx.ModelProto:
    """`fused`: the plan's fused model made from `canonicals[-1]` (the largest bucket); every
    canonical model is one bucket's, in the order of `values` (ascending)."""
    model = onnx.ModelProto()
    model.CopyFrom(fused)
    graph = model.graph
    _check_attributes(canonicals, dim)
    source = _dim_source(canonicals, values, dim)
    consumers = _consumers(canonicals[-1])
    per_bucket = _bucket_constants(canonicals, dim)
    new_nodes: list[onnx.NodeProto] = []
    for index, tensor in list(enumerate(graph.initializer)):  # _sliced appends: walk the model's own
        arrays = per_bucket.get(tensor.name)
        if arrays is None or all(a.shape == arrays[-1].shape and np.array_equal(a, arrays[-1]) for a in arrays):
            continue
        users = consumers.get(tensor.name, [])
        target = _reshape_target(arrays, values, users)
        if target is not None:
            graph.initializer[index].CopyFrom(numpy_helper.from_array(target, tensor.name))
            continue
        axes = _prefix_axes(arrays, values)
        if axes is None:
            where = ", ".join(f"{op} '{name}'" for op, name in users[:2]) or "no node"
            raise BadInput(f"--dim {dim}: constant '{tensor.name}' (read by {where}) changes with {dim} in a way "
                           f"a fused model cannot keep dynamic; give --dim {dim} one value to emit it")
        new_nodes += _sliced(graph, index, tensor.name, axes, source)
    if new_nodes:
        nodes = list(graph.node)
        del graph.node[:]
        graph.node.extend([*new_nodes, *nodes])
    _symbolic_io(graph, canonicals, dim)
    del graph.value_info[:]
    return model


def _bucket_constants(canonicals: Sequence[onnx.ModelProto], dim: str) -> dict[str, list[np.ndarray]]:
    """Each constant the largest bucket's nodes read, as every bucket's node reads it at the same
    input (a bucket may name its folded constant otherwise); a bucket that reads a computed tensor
    where the largest reads a constant is refused, naming the node."""
    tables = [{t.name: t for t in c.graph.initializer} for c in canonicals]
    found: dict[str, list[np.ndarray]] = {}
    for position, node in enumerate(canonicals[-1].graph.node):
        for slot, name in enumerate(node.input):
            if name not in tables[-1] or name in found:
                continue
            arrays = []
            for canonical, table in zip(canonicals, tables, strict=True):
                other = canonical.graph.node[position].input
                if slot >= len(other) or other[slot] not in table:
                    raise BadInput(f"--dim {dim}: node '{node.name}' ({node.op_type}) reads a constant at one {dim} "
                                   f"and a computed tensor at another; give --dim {dim} one value to emit it")
                arrays.append(numpy_helper.to_array(table[other[slot]]))
            found[name] = arrays
    return found


def _consumers(model: onnx.ModelProto) -> dict[str, list[tuple[str, str]]]:
    found: dict[str, list[tuple[str, str]]] = {}
    for node in model.graph.node:
        for name in node.input:
            found.setdefault(name, []).append((node.op_type, node.name))
    return found


def _check_attributes(canonicals: Sequence[onnx.ModelProto], dim: str) -> None:
    first = canonicals[-1].graph.node
    for other in canonicals[:-1]:
        for a, b in zip(first, other.graph.node, strict=True):
            if list(a.attribute) != list(b.attribute):
                raise BadInput(f"--dim {dim}: node '{a.name}' ({a.op_type}) has attributes that change with {dim}; "
                               f"give --dim {dim} one value to emit a fused model")


def _dim_source(canonicals, values, dim) -> tuple[str, int]:
    """(graph input, axis) whose size is the bucket's value in every bucket: where the dim is read."""
    for position, vi in enumerate(canonicals[-1].graph.input):
        sizes = [[d.dim_value for d in c.graph.input[position].type.tensor_type.shape.dim] for c in canonicals]
        for axis in range(len(sizes[-1])):
            if [s[axis] for s in sizes] == list(values):
                return vi.name, axis
    raise BadInput(f"--dim {dim}: no graph input has a dim equal to {dim} at every bucket; "
                   f"give --dim {dim} one value to emit a fused model")


def _reshape_target(arrays, values, users) -> np.ndarray | None:
    """A Reshape target with one entry that is the bucket's value: that entry as -1."""
    last = arrays[-1]
    if not users or any(op != "Reshape" for op, _ in users) or last.ndim != 1 or -1 in last:
        return None
    if any(a.shape != last.shape for a in arrays):
        return None
    varying = [i for i in range(last.size) if len({int(a[i]) for a in arrays}) > 1]
    if len(varying) != 1 or [int(a[varying[0]]) for a in arrays] != list(values):
        return None
    target = last.copy()
    target[varying[0]] = -1
    return target


def _prefix_axes(arrays, values) -> list[int] | None:
    """The axes along which each bucket's constant is the largest's leading slice, each sized as
    the bucket's value; None when the buckets differ otherwise."""
    last = arrays[-1]
    if any(a.ndim != last.ndim or a.dtype != last.dtype for a in arrays):
        return None
    axes = [ax for ax in range(last.ndim) if len({a.shape[ax] for a in arrays}) > 1]
    if not axes:
        return None
    for a, value in zip(arrays, values, strict=True):
        if any(a.shape[ax] != value for ax in axes):
            return None
        if not np.array_equal(a, last[tuple(slice(0, value) if ax in axes else slice(None)
                                             for ax in range(last.ndim))]):
            return None
    return axes


def _sliced(graph: onnx.GraphProto, index: int, name: str, axes: list[int],
            source: tuple[str, int]) -> list[onnx.NodeProto]:
    """Rename the largest bucket's constant and compute `name` as its slice to the run's dim."""
    full = f"{name}__full"
    graph.initializer[index].name = full
    size = f"{name}__dim"
    starts = f"{name}__starts"
    axes_name = f"{name}__axes"
    graph.initializer.extend([numpy_helper.from_array(np.zeros(len(axes), np.int64), starts),
                              numpy_helper.from_array(np.array(axes, np.int64), axes_name)])
    input_name, axis = source
    ends = f"{name}__ends"
    return [
        helper.make_node("Shape", [input_name], [size], name=f"{name}__shape", start=axis, end=axis + 1),
        helper.make_node("Concat", [size] * len(axes), [ends], name=f"{name}__concat", axis=0),
        helper.make_node("Slice", [full, starts, ends, axes_name], [name], name=f"{name}__slice"),
    ]


def _symbolic_io(graph: onnx.GraphProto, canonicals, dim: str) -> None:
    for field in ("input", "output"):
        for position, vi in enumerate(getattr(graph, field)):
            sizes = [[d.dim_value for d in getattr(c.graph, field)[position].type.tensor_type.shape.dim]
                     for c in canonicals]
            for axis, d in enumerate(vi.type.tensor_type.shape.dim):
                if len({s[axis] for s in sizes}) > 1:
                    d.ClearField("dim_value")
                    d.dim_param = dim


def check_values(values: Sequence[int], seed: int) -> list[int]:
    """Where a dynamic model is verified: the smallest, a middle and the largest bucket, and one
    value between buckets drawn by `seed` (none where the buckets leave no gap)."""
    lo, hi = values[0], values[-1]
    between = sorted(set(range(lo + 1, hi)) - set(values))
    drawn = [int(np.random.default_rng(seed).choice(between))] if between else []
    return sorted({lo, values[len(values) // 2], hi, *drawn})
