"""Read an ONNX model (a file or `zoo:NAME`), check it, and make it static and current.

Problem: models in the wild are old, unsorted, carry unnamed nodes, dynamic dims, external data,
even cycles or dangling inputs; downstream passes need one well-formed shape.
Approach, in order, each step raising a one-line `BadInput` naming file/node/option and the fix:
read without external data; check external data locations; check the graph (distinct inputs, one
producer per tensor, no cycle), sort it, name nodes `<op>_<index>`, type-check attributes against
their schemas before any onnx C++ pass (the version converter crashes on a mistyped one); drop
initializers listed as inputs (IR raised to 4); upgrade to `TARGET_OPSET` (kept with a warning
where no adapter exists); bind dims, run strict shape inference with data propagation and check
what ONNX Runtime would refuse (negative dims, Reshape counts, Conv groups, broadcasts, random
Dropout); return an `onnx_ir.Model` with external tensors embedded up to `EMBED_EXTERNAL_BYTES`,
memory-mapped above.
Invariants: the user's file is only read; the result has static input shapes, unique node names,
topological order, and opset >= TARGET_OPSET where the converter allowed it."""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from fusesearch.errors import ModelLoadError, ShapeBindingError, UnsupportedModel
from fusesearch.ir.shapes import ShapeBindings, bind_inputs, broadcasts_to

log = logging.getLogger(__name__)

MIN_OPSET = 7
TARGET_OPSET = 21
ZOO_PREFIX = "zoo:"
CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})
# external data up to this size is read into memory as the model loads: every proto made from the
# model (for ONNX Runtime, a fused or canonical file) then holds its weights, wherever it is run
# or written; above it, the weights stay memory-mapped from the model's folder (`to_proto` names
# that file absolutely; `export.save_model` copies them into the written model's own data file)
EMBED_EXTERNAL_BYTES = 1 << 30


@dataclass(frozen=True)
class LoadedModel:
    """A checked, static model ready for canonicalization."""

    model: ir.Model
    name: str
    source: str  # the MODEL argument as given
    sha256: str  # of the file's bytes (or the zoo model's serialization)
    nodes: int  # main-graph node count as read (before canonicalization)
    opset: int  # the default-domain opset as read
    bindings: ShapeBindings


def load_model(model: str, bindings: ShapeBindings | None = None) -> LoadedModel:
    bindings = bindings or ShapeBindings()
    proto, sha, base_dir, bindings = _read(model, bindings)
    label = model
    opset = _default_opset(proto, label)
    _check_external_data(proto, base_dir, label)
    nodes = len(proto.graph.node)
    _check_and_sort(proto.graph, label)
    _name_nodes(proto.graph)
    _check_attributes(proto, label)
    _check_tensor_sizes(proto.graph, label)
    _check_inputs_match_weights(proto.graph, label)
    _weights_out_of_inputs(proto, bindings)
    _check_input_types(proto.graph, label)
    stash = _strip_weights(proto)
    proto = _upgrade(proto, opset, label)
    _make_static(proto, bindings, label)
    proto = _infer_shapes(proto, label, bindings.spelling.both)
    _restore_weights(proto, stash, label)
    _check_nodes(proto.graph, label)
    ir_model = ir.serde.deserialize_model(proto)
    if base_dir is not None:
        ir.external_data.set_base_dir(ir_model.graph, base_dir)
        if _external_bytes(proto) <= EMBED_EXTERNAL_BYTES:  # self-contained, whatever the working folder
            ir.external_data.load_to_model(ir_model)
    name = proto.graph.name or Path(model.removeprefix(ZOO_PREFIX)).stem
    return LoadedModel(ir_model, name, model, sha, nodes, opset, bindings)


# -- 1. reading -------------------------------------------------------------------------------

def _read(model: str, bindings: ShapeBindings) -> tuple[onnx.ModelProto, str, str | None, ShapeBindings]:
    if model.startswith(ZOO_PREFIX):
        from fusesearch import zoo

        entry = zoo.ZOO.get(model[len(ZOO_PREFIX):])
        if entry is None:
            raise ModelLoadError(f"{model}: unknown zoo model; available: {', '.join(zoo.ZOO)} "
                                 "(see `fusesearch zoo list`)")
        proto = entry.build()
        sha = hashlib.sha256(proto.SerializeToString(deterministic=True)).hexdigest()
        return proto, sha, None, bindings.with_defaults(entry.default_dims)
    path = Path(model)
    if not path.exists():
        raise ModelLoadError(f"{model}: no such file; give a path to an .onnx file or zoo:NAME "
                             "(see `fusesearch zoo list`)")
    if path.is_dir():
        raise ModelLoadError(f"{model}: is a directory, not an .onnx file; give the model file inside it")
    if not path.is_file():
        raise ModelLoadError(f"{model}: is not a regular file (a device, pipe or socket); give the path "
                             "of an .onnx file")
    return _parse_file(path, model), _sha256_file(path), str(path.resolve().parent), bindings


def _parse_file(path: Path, label: str) -> onnx.ModelProto:
    try:
        proto = onnx.load_model(str(path), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(f"{label}: not a valid ONNX protobuf ({reason}); the file may be truncated "
                             "or not an ONNX model: re-export or re-download it") from None
    if not proto.HasField("graph") or not proto.opset_import:
        raise ModelLoadError(f"{label}: not an ONNX model (no graph or no opset_import); give an .onnx "
                             "file exported by onnx/torch.onnx/tf2onnx")
    if proto.ir_version > onnx.IR_VERSION:
        raise UnsupportedModel(f"{label}: IR version {proto.ir_version} is newer than the installed onnx "
                               f"knows ({onnx.IR_VERSION}); re-export the model with IR version "
                               f"{onnx.IR_VERSION} or lower")
    return proto


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _default_opset(proto: onnx.ModelProto, label: str) -> int:
    versions = [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")]
    span = f"{MIN_OPSET}..{max_opset()}"
    if not versions:
        raise UnsupportedModel(f"{label}: no default-domain (ai.onnx) opset import; "
                               f"export the model with a standard ONNX opset ({span})")
    version = versions[0]
    if not MIN_OPSET <= version <= max_opset():
        raise UnsupportedModel(f"{label}: opset {version} is not supported; re-export the model with an "
                               f"opset in {span}")
    return version


def max_opset() -> int:
    """The newest default-domain opset the installed onnx package defines (models above
    TARGET_OPSET are kept at their own opset)."""
    return onnx.defs.onnx_opset_version()


# -- 2. external data -------------------------------------------------------------------------

def _all_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _all_tensors(attr.g)
            for sub in attr.graphs:
                yield from _all_tensors(sub)


def _check_external_data(proto: onnx.ModelProto, base_dir: str | None, label: str) -> None:
    for tensor in _all_tensors(proto.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        where = f"{label}: initializer '{tensor.name}' external data location '{location}'"
        if base_dir is None:
            raise ModelLoadError(f"{where}: external data needs a model file on disk")
        _check_location(location, base_dir, where)
        target = os.path.join(base_dir, location)
        if not os.path.isfile(target):
            raise ModelLoadError(f"{where}: file not found next to the model; copy it into {base_dir}")
        try:
            needed = int(info.get("offset", 0)) + int(info.get("length", 0))
        except ValueError:
            raise ModelLoadError(f"{where}: offset '{info.get('offset')}' or length '{info.get('length')}' "
                                 "is not an integer; re-save the model") from None
        if os.path.getsize(target) < needed:
            raise ModelLoadError(f"{where}: file is {os.path.getsize(target)} bytes, the tensor needs "
                                 f"{needed}; the data file is truncated: copy it again")


def _external_bytes(proto: onnx.ModelProto) -> int:
    """The bytes the model's tensors keep in external data files."""
    return sum(int(next((e.value for e in t.external_data if e.key == "length"), 0) or 0)
               for t in _all_tensors(proto.graph) if t.data_location == onnx.TensorProto.EXTERNAL)


def _check_location(location: str, base_dir: str, where: str) -> None:
    if not location or os.path.isabs(location) or location.startswith(("/", "\\")):
        raise ModelLoadError(f"{where}: must be a relative path inside the model's folder; "
                             "re-save the model with its data next to it")
    parts = Path(location.replace("\\", "/")).parts
    inside = os.path.realpath(os.path.join(base_dir, location))
    root = os.path.realpath(base_dir)
    if ".." in parts or os.path.commonpath([inside, root]) != root:
        raise ModelLoadError(f"{where}: escapes the model's folder; move the data file next to the "
                             "model and re-save it with a relative location")


# -- 3. structure -----------------------------------------------------------------------------

def _node_label(node: onnx.NodeProto, index: int) -> str:
    return f"'{node.name or (node.op_type or 'node') + '#' + str(index)}' ({node.op_type or 'no op type'})"


def _check_and_sort(graph: onnx.GraphProto, label: str) -> None:
    """Every node has an op type, every tensor one producer, every input and output is produced,
    no cycle; reorder the nodes topologically (stable)."""
    declared: set[str] = set()
    for vi in graph.input:
        if vi.name in declared:
            raise ModelLoadError(f"{label}: graph input '{vi.name}' is declared twice; each input needs its "
                                 "own name: fix the export")
        declared.add(vi.name)
    available = {vi.name for vi in graph.input} | {t.name for t in graph.initializer} | {""}
    producer: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        if not node.op_type:
            raise ModelLoadError(f"{label}: node {_node_label(node, i)} has an empty op_type; every node "
                                 "needs an operator: fix the export")
        for out in node.output:
            if out in producer:
                first = _node_label(graph.node[producer[out]], producer[out])
                raise ModelLoadError(f"{label}: tensor '{out}' is produced by two nodes, {first} and "
                                     f"{_node_label(node, i)}; a tensor has one producer: fix the export")
            if out in available - {""}:
                raise ModelLoadError(f"{label}: node {_node_label(node, i)} writes '{out}', which is also a "
                                     "graph input or initializer; a tensor has one producer: fix the export")
            if out:
                producer[out] = i
    for vi in graph.output:
        if vi.name not in producer and vi.name not in available:
            raise ModelLoadError(f"{label}: graph output '{vi.name}' is produced by no node, input or "
                                 "initializer; remove it from the outputs or fix the export")
    deps: list[set[int]] = []
    for i, node in enumerate(graph.node):
        needed = set()
        for name in _node_reads(node):
            if name in producer:
                needed.add(producer[name])
            elif name not in available:
                raise ModelLoadError(
                    f"{label}: node {_node_label(node, i)} reads "
                    f"'{name}', which no node, input or initializer produces; fix the export")
        deps.append(needed)
    order = _stable_toposort(deps, graph, label)
    if order != list(range(len(order))):
        nodes = [graph.node[i] for i in order]
        del graph.node[:]
        graph.node.extend(nodes)


def _node_reads(node: onnx.NodeProto) -> set[str]:
    """Inputs of the node and outer-scope names its subgraphs read."""
    names = set(node.input)
    for attr in node.attribute:
        for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            names |= _outer_reads(sub)
    return names


def _outer_reads(graph: onnx.GraphProto) -> set[str]:
    local = {vi.name for vi in graph.input} | {t.name for t in graph.initializer}
    reads: set[str] = set()
    for node in graph.node:
        reads |= {n for n in _node_reads(node) if n not in local}
        local |= set(node.output)
    return reads - {""}


def _stable_toposort(deps: list[set[int]], graph: onnx.GraphProto, label: str) -> list[int]:
    import heapq

    users: list[list[int]] = [[] for _ in deps]
    missing = [len(d) for d in deps]
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    ready = [i for i, m in enumerate(missing) if m == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            missing[u] -= 1
            if missing[u] == 0:
                heapq.heappush(ready, u)
    if len(order) < len(deps):
        stuck = next(i for i, m in enumerate(missing) if m > 0)
        node = graph.node[stuck]
        raise ModelLoadError(f"{label}: the graph has a cycle through node '{node.name or node.op_type}' "
                             f"({node.op_type}); an ONNX graph must be acyclic: fix the export")
    return order


def _name_nodes(graph: onnx.GraphProto) -> None:
    """Unique node names: keep good ones, name the rest `<op>_<index>`."""
    seen: set[str] = set()
    taken = {n.name for n in graph.node if n.name}
    for i, node in enumerate(graph.node):
        if node.name and node.name not in seen:
            seen.add(node.name)
            continue
        base = f"{node.op_type.lower()}_{i}"
        name, k = base, 1
        while name in seen or name in taken:
            name, k = f"{base}_{k}", k + 1
        node.name = name
        seen.add(name)


def _all_nodes(graph: onnx.GraphProto) -> Iterator[tuple[onnx.NodeProto, int]]:
    """Every node of the graph and of its subgraphs, with its index in its own graph."""
    for i, node in enumerate(graph.node):
        yield node, i
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _all_nodes(sub)


def _check_attributes(proto: onnx.ModelProto, label: str) -> None:
    """Every attribute of an operator with a schema has the schema's type, and every required one
    is there, as ONNX Runtime checks on loading. This runs before any onnx C++ pass: the version
    converter reads an attribute as the type its schema gives and crashes the interpreter on
    another (a Split `split` or ReduceMean `axes` given as a string is a segmentation fault)."""
    versions = {o.domain or "": o.version for o in proto.opset_import}
    versions.setdefault("", versions.get("ai.onnx", 0))
    schemas: dict[tuple[str, str], onnx.defs.OpSchema | None] = {}
    for node, i in _all_nodes(proto.graph):
        domain = "" if node.domain == "ai.onnx" else node.domain
        if (node.op_type, domain) not in schemas:
            try:
                schemas[node.op_type, domain] = onnx.defs.get_schema(node.op_type, versions.get(domain, 0), domain)
            except onnx.defs.SchemaError:  # not an ONNX operator (warned about later) or no such opset
                schemas[node.op_type, domain] = None
        schema = schemas[node.op_type, domain]
        if schema is None:
            continue
        for attr in node.attribute:
            spec = schema.attributes.get(attr.name)
            if spec is not None and not attr.ref_attr_name and attr.type != int(spec.type):
                given = onnx.AttributeProto.AttributeType.Name(attr.type)
                raise ModelLoadError(f"{label}: node {_node_label(node, i)} attribute '{attr.name}' has type "
                                     f"{given}, {node.op_type}-{schema.since_version} takes {spec.type.name}; "
                                     "fix the export")
        given = {attr.name for attr in node.attribute}
        missing = [name for name, spec in schema.attributes.items() if spec.required and name not in given]
        if missing:
            raise ModelLoadError(f"{label}: node {_node_label(node, i)} lacks its required attribute "
                                 f"'{missing[0]}'; fix the export")


# -- 3. tensors and types, 5. node checks ---------------------------------------------------

_SUB_BYTE_BITS = {onnx.TensorProto.INT4: 4, onnx.TensorProto.UINT4: 4}
for _name, _bits in (("FLOAT4E2M1", 4), ("INT2", 2), ("UINT2", 2)):  # newer onnx only
    if hasattr(onnx.TensorProto, _name):
        _SUB_BYTE_BITS[getattr(onnx.TensorProto, _name)] = _bits


def _owned_tensors(graph: onnx.GraphProto) -> Iterator[tuple[onnx.TensorProto, str]]:
    """Every tensor stored in the graph (subgraphs included), with words naming where it is."""
    for tensor in graph.initializer:
        yield tensor, f"initializer '{tensor.name}'"
    for node in graph.node:
        for attr in node.attribute:
            where = f"attribute '{attr.name}' of node '{node.name}' ({node.op_type})"
            if attr.HasField("t"):
                yield attr.t, where
            for tensor in attr.tensors:
                yield tensor, where
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _owned_tensors(sub)


def _check_tensor_sizes(graph: onnx.GraphProto, label: str) -> None:
    """The data each stored tensor holds matches its dims (counted, never decoded)."""
    for tensor, where in _owned_tensors(graph):
        elements = 1
        for d in tensor.dims:
            elements *= d
        if tensor.data_type == onnx.TensorProto.UNDEFINED or any(d < 0 for d in tensor.dims):
            raise ModelLoadError(f"{label}: {where} has no data type or a negative dim "
                                 f"({list(tensor.dims)}); fix the export")
        if tensor.data_type == onnx.TensorProto.STRING:
            have, need, unit = len(tensor.string_data), elements, "strings"
        else:
            bits = _SUB_BYTE_BITS.get(tensor.data_type)
            if bits is None:
                try:
                    bits = 8 * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
                except (KeyError, TypeError, ValueError):
                    raise ModelLoadError(f"{label}: {where} has unknown data type {tensor.data_type}; "
                                         "fix the export") from None
            need_bytes = (elements * bits + 7) // 8
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                info = {e.key: e.value for e in tensor.external_data}
                if "length" not in info:
                    continue
                have, need, unit = int(info["length"]), need_bytes, "bytes of external data"
            elif raw_bytes := len(tensor.raw_data):  # read once: the field is copied on access
                have, need, unit = raw_bytes, need_bytes, "bytes"
            elif bits < 8:  # packed, one byte per int32_data entry
                have, need, unit = len(tensor.int32_data), need_bytes, "packed values"
            else:
                field = onnx.helper.tensor_dtype_to_field(tensor.data_type)
                per = 2 if tensor.data_type in (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128) else 1
                have, need, unit = len(getattr(tensor, field)), per * elements, "values"
        if have != need:
            raise ModelLoadError(f"{label}: {where} holds {have} {unit} but its dims {list(tensor.dims)} "
                                 f"need {need}; the tensor is corrupt: re-export the model")


def _check_input_types(graph: onnx.GraphProto, label: str) -> None:
    for vi in graph.input:
        kind = vi.type.WhichOneof("value")
        if kind is None or (kind == "tensor_type" and vi.type.tensor_type.elem_type == onnx.TensorProto.UNDEFINED):
            raise ModelLoadError(f"{label}: graph input '{vi.name}' has no type; give it a tensor type "
                                 "(element type and shape) in the export")
        if kind != "tensor_type":
            raise UnsupportedModel(f"{label}: graph input '{vi.name}' is a {kind.removesuffix('_type')}; only "
                                   "tensor inputs are supported: export the model with tensor inputs")


def _check_nodes(graph: onnx.GraphProto, label: str) -> None:
    """Each main-graph node fits its inputs where onnx's shape inference does not check it and
    ONNX Runtime refuses the model on loading or on its first run, and no node draws random values
    (a Dropout in training mode): no plan could reproduce ONNX Runtime's results."""
    shapes: dict[str, list[int]] = {t.name: list(t.dims) for t in graph.initializer}
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        dims = vi.type.tensor_type.shape.dim if vi.type.tensor_type.HasField("shape") else None
        if dims is not None and all(d.HasField("dim_value") for d in dims):
            shapes[vi.name] = [d.dim_value for d in dims]
    constants = {t.name: t for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = node.attribute[0].t
    for i, node in enumerate(graph.node):
        check = _NODE_CHECKS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        problem = (check(node, shapes, constants) if check else None) or _negative_dim(node, shapes)
        if problem:
            raise ModelLoadError(f"{label}: node {_node_label(node, i)} {problem}")


Shapes = dict[str, list[int]]
Constants = dict[str, onnx.TensorProto]
SMALL_CONSTANT = 1 << 20  # elements: larger constants are not decoded to be checked


def _constant(name: str, constants: Constants) -> np.ndarray | None:
    tensor = constants.get(name)
    if tensor is None or np.prod(tensor.dims, dtype=np.int64) > SMALL_CONSTANT:
        return None
    return onnx.numpy_helper.to_array(tensor)


def _attr(node: onnx.NodeProto, name: str, default):
    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _input(node: onnx.NodeProto, index: int) -> str:
    return node.input[index] if len(node.input) > index else ""


def _negative_dim(node: onnx.NodeProto, shapes: Shapes) -> str | None:
    out = next((o for o in node.output if any(d < 0 for d in shapes.get(o, ()))), None)
    if out is None:
        return None
    return (f"gives '{out}' the shape {shapes[out]}: its inputs do not fit its attributes (e.g. a kernel larger "
            "than the padded input); fix the export or the input shape")


def _check_conv(node: onnx.NodeProto, shapes: Shapes, constants: Constants) -> str | None:
    """A positive group, and as many channels read as the weight expects."""
    group = _attr(node, "group", 1)
    if group <= 0:
        return f"has group {group}; group is a positive divisor of the input channels: fix the export"
    x, w = shapes.get(_input(node, 0)), shapes.get(_input(node, 1))
    if not x or not w or len(x) < 2 or len(w) < 2 or x[1] <= 0 or min(w[:2]) <= 0:
        return None
    expected = w[1] * group if node.op_type == "Conv" else w[0]
    if x[1] == expected:
        return None
    how = f"{w[1]} x group {group}" if node.op_type == "Conv" else "its dim 0"
    return (f"reads {x[1]} channels from '{node.input[0]}' but its weight '{node.input[1]}' {w} expects "
            f"{expected} ({how}); fix the export or the input shape")


def _check_reshape(node: onnx.NodeProto, shapes: Shapes, constants: Constants) -> str | None:
    x, y = shapes.get(_input(node, 0)), shapes.get(node.output[0])
    if x is None or y is None or np.prod(x, dtype=np.int64) == np.prod(y, dtype=np.int64):
        return None
    return (f"reshapes '{node.input[0]}' {x} ({np.prod(x, dtype=np.int64)} elements) to {y} "
            f"({np.prod(y, dtype=np.int64)} elements); a reshape keeps the element count: fix its shape "
            "input or the input shape")


def _check_gemm(node: onnx.NodeProto, shapes: Shapes, constants: Constants) -> str | None:
    a, b, c = (shapes.get(_input(node, k)) for k in range(3))
    if a is None or b is None or c is None or len(a) != 2 or len(b) != 2:
        return None
    out = [a[1] if _attr(node, "transA", 0) else a[0], b[0] if _attr(node, "transB", 0) else b[1]]
    if broadcasts_to(c, out):
        return None
    return f"adds '{node.input[2]}' {c}, which does not broadcast to its output {out}; fix the bias"


def _check_layer_norm(node: onnx.NodeProto, shapes: Shapes, constants: Constants) -> str | None:
    x = shapes.get(_input(node, 0))
    axis = _attr(node, "axis", -1)
    if x is None or not -len(x) <= axis < len(x):
        return None
    target = x[axis:]
    for k, role in ((1, "scale"), (2, "bias")):
        given = shapes.get(_input(node, k))
        if given is not None and not broadcasts_to(given, target):
            return (f"has {role} '{node.input[k]}' {given}, which does not broadcast to {target} (the dims of "
                    f"'{node.input[0]}' {x} from axis {axis}); fix the export")
    return None


def _check_batch_norm(node: onnx.NodeProto, shapes: Shapes, constants: Constants) -> str | None:
    var = _constant(_input(node, 4), constants)
    epsilon = _attr(node, "epsilon", 1e-5)
    if var is None or not (var + epsilon < 0).any():
        return None
    return (f"has variance '{node.input[4]}' as low as {var.min():g}, below -epsilon ({epsilon:g}): its outputs "
            "would be NaN; fix the weights (a variance is never negative)")


def _check_dropout(node: onnx.NodeProto, shapes: Shapes, constants: Constants) -> str | None:
    """A training mode that is true, or not a constant, zeroes values at random in ONNX Runtime
    unless the ratio is a constant 0."""
    mode = _input(node, 2)
    training = _constant(mode, constants)
    ratio = _constant(_input(node, 1), constants) if _input(node, 1) else np.float32(0.5)
    if not mode or (training is not None and not training.any()) or (ratio is not None and not ratio.any()):
        return None
    how = f"runs in training mode ('{mode}' is true)" if training is not None else \
        f"may run in training mode ('{mode}' is not a constant)"
    return (f"{how}: ONNX Runtime then zeroes values at random, which no plan "
            f"reproduces; export the model in inference mode (model.eval()) or make '{mode}' a constant false")


_NODE_CHECKS = {
    "Conv": _check_conv, "ConvTranspose": _check_conv, "Reshape": _check_reshape,
    "Gemm": _check_gemm, "LayerNormalization": _check_layer_norm, "BatchNormalization": _check_batch_norm,
    "Dropout": _check_dropout,
}


# -- 4. weights listed as inputs ---------------------------------------------------------------

WEIGHTS_APART_IR = 4  # from IR 4 on an initializer need not be a graph input


def _check_inputs_match_weights(graph: onnx.GraphProto, label: str) -> None:
    """A graph input that is also an initializer is declared with the initializer's element type
    and dims (a symbolic dim matches any), as ONNX Runtime checks on loading."""
    weights = {t.name: t for t in graph.initializer}
    for vi in graph.input:
        weight = weights.get(vi.name)
        if weight is None or not vi.type.HasField("tensor_type"):
            continue
        declared = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in declared.shape.dim]
        type_differs = declared.elem_type not in (onnx.TensorProto.UNDEFINED, weight.data_type)
        shape_differs = declared.HasField("shape") and (
            len(dims) != len(weight.dims) or any(d not in (None, w) for d, w in zip(dims, weight.dims, strict=True)))
        if type_differs or shape_differs:
            shown = [d if d is not None else "?" for d in dims] if declared.HasField("shape") else "any shape"
            raise ModelLoadError(
                f"{label}: graph input '{vi.name}' is declared {onnx.TensorProto.DataType.Name(declared.elem_type)} "
                f"{shown} but its initializer is {onnx.TensorProto.DataType.Name(weight.data_type)} "
                f"{list(weight.dims)}; make the input's declaration match its initializer: fix the export")


def _weights_out_of_inputs(proto: onnx.ModelProto, bindings: ShapeBindings) -> None:
    """IR < 4 exporters list every initializer as a graph input too. Like ONNX Runtime, take such
    an input as the weight (drop it from the inputs) unless `--input-shape` binds it (then drop the
    initializer: the user feeds it). Raise the IR version to 4, where shape inference reads the
    types of initializers that are not inputs."""
    graph = proto.graph
    inputs = {vi.name for vi in graph.input}
    fed = {t.name for t in graph.initializer if t.name in inputs and t.name in bindings.input_shapes}
    if fed:
        kept = [t for t in graph.initializer if t.name not in fed]
        del graph.initializer[:]
        graph.initializer.extend(kept)
    weights = {t.name for t in graph.initializer}
    real_inputs = [vi for vi in graph.input if vi.name not in weights]
    if len(real_inputs) != len(graph.input):
        del graph.input[:]
        graph.input.extend(real_inputs)
    proto.ir_version = max(proto.ir_version, WEIGHTS_APART_IR)


# -- weights aside ----------------------------------------------------------------------------

STRIP_BYTES = 4096  # initializers above this leave the proto while onnx's C++ passes run
_STRIPPED = "__fusesearch_stripped__"


def _strip_weights(proto: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    """Take large inline weights out of the main graph (onnx's converter and shape inference
    serialize the whole model; they need dims and dtypes, not values). Put back by name."""
    stash: dict[str, onnx.TensorProto] = {}
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL or tensor.ByteSize() < STRIP_BYTES:
            continue
        stash[tensor.name] = onnx.TensorProto()
        stash[tensor.name].CopyFrom(tensor)
        for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
            tensor.ClearField(field)
        tensor.data_location = onnx.TensorProto.EXTERNAL
        entry = tensor.external_data.add()
        entry.key, entry.value = "location", _STRIPPED
    return stash


def _restore_weights(proto: onnx.ModelProto, stash: dict[str, onnx.TensorProto], label: str) -> None:
    restored = 0
    for tensor in proto.graph.initializer:
        original = stash.get(tensor.name)
        if original is not None and any(e.value == _STRIPPED for e in tensor.external_data):
            tensor.CopyFrom(original)
            restored += 1
    if restored != len(stash):
        raise ModelLoadError(f"{label}: {len(stash) - restored} weights were lost while upgrading the "
                             "opset; re-export the model at opset 21 and load that")


# -- 5. opset ---------------------------------------------------------------------------------

def _upgrade(proto: onnx.ModelProto, opset: int, label: str) -> onnx.ModelProto:
    unknown = _warn_unknown_ops(proto.graph, opset, label)
    if opset >= TARGET_OPSET or unknown:  # the converter cannot convert an op it does not know
        return proto
    try:
        upgraded = onnx.version_converter.convert_version(proto, TARGET_OPSET)
    except Exception as exc:  # the converter raises bare RuntimeError/ConvertError
        log.warning("%s: kept opset %d, the version converter failed: %s", label, opset, _reason(exc))
        return proto
    _name_nodes(upgraded.graph)
    if opset < RESIZE_COORDINATES_OPSET:
        _keep_asymmetric_linear(upgraded.graph)
    return upgraded


RESIZE_COORDINATES_OPSET = 11  # Resize's coordinate_transformation_mode (default half_pixel) is new in 11


def _keep_asymmetric_linear(graph: onnx.GraphProto) -> None:
    """Upsample (opsets 7-9) and Resize-10 interpolate linearly at asymmetric coordinates (x / scale);
    the version converter writes a Resize-11 without the attribute, which then means half_pixel.
    Nearest keeps the converter's form (half_pixel rounded half down picks floor(x / scale) too
    when upsampling)."""
    for node in graph.node:
        attrs = {a.name: a for a in node.attribute}
        mode = onnx.helper.get_attribute_value(attrs["mode"]) if "mode" in attrs else b"nearest"
        if node.op_type == "Resize" and mode == b"linear" and "coordinate_transformation_mode" not in attrs:
            node.attribute.append(onnx.helper.make_attribute("coordinate_transformation_mode", "asymmetric"))


def _warn_unknown_ops(graph: onnx.GraphProto, opset: int, label: str) -> bool:
    """One warning line per default-domain op type ONNX does not define; True if any."""
    unknown: dict[str, list[str]] = {}
    for node in graph.node:
        if node.domain in ("", "ai.onnx") and not onnx.defs.has(node.op_type):
            unknown.setdefault(node.op_type, []).append(node.name)
    kept = f"; the model keeps opset {opset}" if opset < TARGET_OPSET else ""
    for op, names in unknown.items():
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        log.warning("%s: node '%s'%s: op '%s' (domain ai.onnx) is not an ONNX operator; it will stay "
                    "alone (opaque) in every plan%s", label, names[0], more, op, kept)
    return bool(unknown)


def _reason(exc: Exception) -> str:
    """The first line of an onnx C++ error, without its source location and assertion text."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\S+\.cc:\d+: \w+: (Assertion `.*?` failed: )?", "", first)


# -- 5. static shapes -------------------------------------------------------------------------

def _make_static(proto: onnx.ModelProto, bindings: ShapeBindings, label: str) -> None:
    graph = proto.graph
    try:
        bind_inputs(graph, bindings, list(graph.input))
    except ShapeBindingError as exc:
        raise ShapeBindingError(f"{label}: {exc}") from None
    del graph.value_info[:]
    for out in graph.output:
        if out.type.HasField("tensor_type"):
            out.type.tensor_type.ClearField("shape")


def check_bindings(model: str, bindings: ShapeBindings, *, proto: onnx.ModelProto | None = None) -> None:
    """Raise the error `load_model(model, bindings)` would raise on reading the model or binding its
    inputs, cheaply: only the graph inputs are bound (no weights copied, no opset upgrade, no shape
    inference). `proto`: the model already built (a zoo model with other parameters)."""
    if proto is None:
        proto, _, _, bindings = _read(model, bindings)
    skeleton = onnx.GraphProto(input=proto.graph.input,
                               initializer=[onnx.TensorProto(name=t.name) for t in proto.graph.initializer])
    _make_static(onnx.ModelProto(graph=skeleton), bindings, model)


def _infer_shapes(proto: onnx.ModelProto, label: str, bindings: str) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True, data_prop=True)
    except onnx.shape_inference.InferenceError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ModelLoadError(f"{label}: shape inference failed ({first}); check the {bindings} "
                             "against the model's inputs, or fix the export") from None
    except (ValueError, RuntimeError) as exc:  # e.g. a model >2 GB serialized inline
        log.warning("%s: onnx shape inference skipped: %s", label, str(exc).splitlines()[0])
        return proto
