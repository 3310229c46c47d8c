"""Half precision: convert a float32 model to float16 or bfloat16 (`--dtype`), and run it in ONNX Runtime.

Problem: a plan must be made, priced, generated and checked for the half model; onnxconverter-common
is not a dependency and ONNX Runtime's CPU provider lacks bfloat16 kernels for most ops.
Approach: `to_half(model, dtype)` over the canonical float32 model (run by `pipeline.prepare`): a
node computes in half when its schema admits it and its op is not in `KEEP_FLOAT32` (normalizations,
Softmax, statistic reductions: Casts around them); schema-less, non-default-domain, subgraph and
`dtype`-attribute nodes stay float32; graph inputs/outputs become half; a weight read in both
precisions is stored twice (`<name>__float32`); each value is cast at most once per precision.
Kernels compute in float32. `tolerance`: float32 1e-4, float16 1e-2, bfloat16 5e-2 relative to
max(1, max|ref|). The reference: ONNX Runtime on the converted model, bfloat16 through `widened`
(float32 tensors rounded to bfloat16 at every node output).
Invariants: the input model is not modified; non-float32 tensors are untouched; the result passes
strict shape inference; `to_half(m, "float32")` is `m`."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fusesearch.errors import BadInput
from fusesearch.ir.canonicalize import weight_array
from fusesearch.ir.load import _outer_reads, _restore_weights, _strip_weights

DTYPES = ("float32", "float16", "bfloat16")
HALF_TYPES = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
TOLERANCES = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}  # rtol relative to max(1, max|ref|)
KEEP_FLOAT32 = frozenset({
    "LayerNormalization", "GroupNormalization", "InstanceNormalization", "BatchNormalization",
    "LpNormalization", "MeanVarianceNormalization", "RMSNormalization",
    "Softmax", "LogSoftmax",
    "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2", "ReduceLogSumExp",
})
FLOAT = TensorProto.FLOAT
SUFFIX32 = "__float32"
BFLOAT16_OPSET = 22  # the opset where Conv, ConvTranspose, pooling and more admit bfloat16


def check_dtype(dtype: str | None) -> str:
    """The --dtype value, checked (None: float32); BadInput naming the option otherwise."""
    if dtype is None:
        return "float32"
    if dtype not in DTYPES:
        raise BadInput(f"--dtype {dtype}: unknown; choose one of {', '.join(DTYPES)}")
    return dtype


def tolerance(dtype: str) -> float:
    """The rtol `verify.compare` applies to outputs of a model of `dtype` (float32 for others)."""
    return TOLERANCES.get(dtype, TOLERANCES["float32"])


def prepared_tolerance(prep) -> float:
    """The rtol every check of a prepared model applies (`verify`, `run`, `plan --emit`): that of
    the half type it was converted to (`--dtype`) or, unconverted, of the half type its own
    tensors hold (a float16 model), else float32's."""
    dtype = getattr(prep, "dtype", "float32")
    if dtype == "float32":
        held = {info.dtype for info in prep.graph.tensors.values()}
        dtype = next((d for d in ("bfloat16", "float16") if d in held), "float32")
    return tolerance(dtype)


def model_dtype(model: onnx.ModelProto) -> str:
    """'bfloat16' / 'float16' when the main graph holds tensors of that type (the first found,
    bfloat16 first), else 'float32'."""
    found = set()
    for vi in (*model.graph.input, *model.graph.output, *model.graph.value_info):
        found.add(vi.type.tensor_type.elem_type)
    found |= {t.data_type for t in model.graph.initializer}
    for name in ("bfloat16", "float16"):
        if HALF_TYPES[name] in found:
            return name
    return "float32"


# -- the conversion ---------------------------------------------------------------------------

def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    g = model.graph
    types = {t.name: t.data_type for t in g.initializer}
    for vi in (*g.input, *g.value_info, *g.output):
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type.tensor_type.elem_type
    produced = {o for n in g.node for o in n.output if o}
    if produced - types.keys():
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        for vi in (*inferred.graph.value_info, *inferred.graph.output):
            if vi.type.HasField("tensor_type"):
                types.setdefault(vi.name, vi.type.tensor_type.elem_type)
    return types


def _slot_types(node: onnx.NodeProto, opset: int) -> tuple[list[str], list[str], dict[str, list[str]]] | None:
    """(type string per input, per output, allowed types per parameter) from the node's schema."""
    if node.domain not in ("", "ai.onnx"):
        return None
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return None

    def expand(formals, count):
        if not formals:
            return [""] * count
        return [formals[min(i, len(formals) - 1)].type_str for i in range(count)]

    allowed = {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints}
    return expand(schema.inputs, len(node.input)), expand(schema.outputs, len(node.output)), allowed


def _half_slots(node: onnx.NodeProto, opset: int, types: dict[str, int], half: str) -> tuple[set[int], set[int]]:
    """(input indices, output indices) of float32 values the node reads/writes in half."""
    if (node.op_type in KEEP_FLOAT32 or any(a.name == "dtype" for a in node.attribute)
            or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)):
        return set(), set()
    slots = _slot_types(node, opset)
    if slots is None:
        return set(), set()
    ins, outs, allowed = slots
    wanted = f"tensor({half})"
    ok = {p for p, types_ in allowed.items() if wanted in types_}
    half_in = {i for i, (t, p) in enumerate(zip(node.input, ins, strict=True)) if t and p in ok and types.get(t) == FLOAT}
    half_out = {i for i, (t, p) in enumerate(zip(node.output, outs, strict=True)) if t and p in ok
                and (types.get(t) == FLOAT or (node.op_type == "Cast" and _cast_to(node) == FLOAT))}
    return half_in, half_out


def _cast_to(node: onnx.NodeProto) -> int | None:
    return next((a.i for a in node.attribute if a.name == "to"), None)


def _to_half_tensor(tensor: onnx.TensorProto, half: int, name: str | None = None) -> onnx.TensorProto:
    """The tensor in `half`; finite values beyond the half's range are clamped to its largest finite
    value (a -1e9 attention mask stays finite), as mixed-precision converters do."""
    array = weight_array(tensor).astype(np.float32, copy=False)
    limit = 65504.0 if half == TensorProto.FLOAT16 else 3.3895313892515355e38
    if array.size and max(-float(array.min()), float(array.max())) > limit:  # (inf and nan pass through)
        array = np.where(np.isfinite(array), np.clip(array, -limit, limit), array)
    return numpy_helper.from_array(array.astype(helper.tensor_dtype_to_np_dtype(half)),
                                   name if name is not None else tensor.name)


def _subgraph_reads(node: onnx.NodeProto) -> set[str]:
    reads: set[str] = set()
    for a in node.attribute:
        for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            reads |= _outer_reads(sub)
    return reads


def _rename_reads(graph: onnx.GraphProto, old: str, new: str) -> None:
    for node in graph.node:
        for i, t in enumerate(node.input):
            if t == old:
                node.input[i] = new
        for a in node.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                _rename_reads(sub, old, new)
    for vi in graph.output:  # a body output that is the outer value itself
        if vi.name == old:
            vi.name = new


def to_half(model: onnx.ModelProto, dtype: str) -> tuple[onnx.ModelProto, int]:
    """The model converted to `dtype` (float16 | bfloat16) by the rule of the module note, and the
    number of Cast nodes it added; float32 gives the model itself."""
    if dtype == "float32":
        return model, 0
    half = HALF_TYPES[dtype]
    out = onnx.ModelProto()
    out.CopyFrom(model)
    opset = next((o.version for o in out.opset_import if o.domain in ("", "ai.onnx")), 21)
    if dtype == "bfloat16" and opset < BFLOAT16_OPSET:
        out, opset = _upgrade(out, opset)
    g = out.graph
    types = _elem_types(out)
    inits = {t.name: t for t in g.initializer}
    plans = [_half_slots(n, opset, types, dtype) for n in g.node]

    # float32 graph outputs written in float32 get renamed, so that a Cast can write the name
    renamed: dict[str, str] = {}
    outputs = {vi.name for vi in g.output if types.get(vi.name) == FLOAT}
    taken = set(types) | {n.name for n in g.node}
    for node, (_, half_out) in zip(g.node, plans, strict=True):
        for i, t in enumerate(node.output):
            if t in outputs and i not in half_out:
                renamed[t] = _unique(t + SUFFIX32, taken)
                node.output[i] = renamed[t]
                types[renamed[t]] = FLOAT
    if renamed:
        for node in g.node:
            for i, t in enumerate(node.input):
                node.input[i] = renamed.get(t, t)

    # weights: converted where read in half, a float32 copy where also read in float32
    want: dict[str, set[int]] = {}
    for node, (half_in, _) in zip(g.node, plans, strict=True):
        for i, t in enumerate(node.input):
            if t in inits and types.get(t) == FLOAT:
                want.setdefault(t, set()).add(half if i in half_in else FLOAT)
        for t in _subgraph_reads(node):
            if t in inits and types.get(t) == FLOAT:
                want.setdefault(t, set()).add(FLOAT)
    weight_name: dict[tuple[str, int], str] = {}
    for name, kinds in want.items():
        if half in kinds:
            inits[name].CopyFrom(_to_half_tensor(inits[name], half))
            weight_name[(name, half)] = name
            if FLOAT in kinds:
                copy = _unique(name + SUFFIX32, taken)
                g.initializer.append(numpy_helper.from_array(
                    weight_array(model.graph.initializer[_index(model.graph.initializer, name)]), copy))
                weight_name[(name, FLOAT)] = copy
        else:
            weight_name[(name, FLOAT)] = name

    # values: each has the precision of its producer; readers wanting the other get one shared Cast
    now: dict[str, int] = {}
    for vi in g.input:
        if vi.type.tensor_type.elem_type == FLOAT:
            vi.type.tensor_type.elem_type = half
            now[vi.name] = half
    casts: dict[tuple[str, int], str] = {}
    nodes: list[onnx.NodeProto] = []

    def supply(t: str, kind: int) -> str:
        if (t, kind) in weight_name:
            return weight_name[(t, kind)]
        if now.get(t, kind) == kind:
            return t
        if (t, kind) not in casts:
            suffix = SUFFIX32 if kind == FLOAT else f"__{dtype}"
            name = _unique(t + suffix, taken)
            nodes.append(helper.make_node("Cast", [t], [name], name=_unique(f"cast_{name}", taken), to=kind))
            casts[(t, kind)] = name
        return casts[(t, kind)]

    for node, (half_in, half_out) in zip(list(g.node), plans, strict=True):
        for i, t in enumerate(node.input):
            if t and types.get(t) == FLOAT:
                node.input[i] = supply(t, half if i in half_in else FLOAT)
        for t in _subgraph_reads(node):
            if types.get(t) == FLOAT and (now.get(t) == half or (t, half) in weight_name):
                _rename_subgraphs(node, t, supply(t, FLOAT))
        for i, t in enumerate(node.output):
            if not t:
                continue
            if i in half_out:
                now[t] = half
            elif types.get(t) == FLOAT:
                now[t] = FLOAT
        if half_out:
            _retype_attributes(node, half)
        nodes.append(node)
    for original, inner in renamed.items():
        nodes.append(helper.make_node("Cast", [inner], [original], name=_unique(f"cast_{original}", taken), to=half))
    del g.node[:]
    g.node.extend(nodes)
    for vi in g.output:
        if vi.type.tensor_type.elem_type == FLOAT:
            vi.type.tensor_type.elem_type = half
    del g.value_info[:]
    stash = _strip_weights(out)
    try:
        out = onnx.shape_inference.infer_shapes(out, check_type=True, strict_mode=True, data_prop=True)
    except onnx.shape_inference.InferenceError as exc:
        raise BadInput(f"--dtype {dtype}: the converted model fails onnx's type check "
                       f"({str(exc).strip().splitlines()[0]}); use --dtype float32 for this model") from None
    _restore_weights(out, stash, f"--dtype {dtype}")
    return out, len(casts) + len(renamed)


def _upgrade(model: onnx.ModelProto, opset: int) -> tuple[onnx.ModelProto, int]:
    """The model at BFLOAT16_OPSET, where Conv, pooling and more admit bfloat16 (onnx's version
    converter, weights aside); the model as it was when the converter refuses."""
    stash = _strip_weights(model)
    try:
        upgraded = onnx.version_converter.convert_version(model, BFLOAT16_OPSET)
    except Exception:  # the converter raises bare RuntimeError/ConvertError: keep the opset
        _restore_weights(model, stash, "--dtype bfloat16")
        return model, opset
    _restore_weights(upgraded, stash, "--dtype bfloat16")
    return upgraded, BFLOAT16_OPSET


def _rename_subgraphs(node: onnx.NodeProto, old: str, new: str) -> None:
    for a in node.attribute:
        for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            _rename_reads(sub, old, new)


def _retype_attributes(node: onnx.NodeProto, half: int) -> None:
    """A node now writing half: Cast's `to`, and the value of Constant / ConstantOfShape."""
    for a in node.attribute:
        if node.op_type == "Cast" and a.name == "to" and a.i == FLOAT:
            a.i = half
        elif node.op_type in ("Constant", "ConstantOfShape") and a.name == "value" and a.t.data_type == FLOAT:
            a.t.CopyFrom(_to_half_tensor(a.t, half))
        elif node.op_type == "Constant" and a.name == "value_float":
            a.CopyFrom(helper.make_attribute("value", _to_half_tensor(
                numpy_helper.from_array(np.array(a.f, dtype=np.float32)), half, "")))
    if node.op_type == "ConstantOfShape" and not any(a.name == "value" for a in node.attribute):
        node.attribute.append(helper.make_attribute("value", _to_half_tensor(
            numpy_helper.from_array(np.zeros(1, dtype=np.float32)), half, "")))


def _index(tensors, name: str) -> int:
    return next(i for i, t in enumerate(tensors) if t.name == name)


def _unique(name: str, taken: set[str]) -> str:
    candidate, k = name, 1
    while candidate in taken:
        candidate, k = f"{name}_{k}", k + 1
    taken.add(candidate)
    return candidate


# -- running half models in ONNX Runtime ------------------------------------------------------

def widened(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, np.dtype]]:
    """A copy of a bfloat16 model that ONNX Runtime's CPU provider runs: every bfloat16 tensor
    held in float32, every main-graph node output that is bfloat16 in `model` rounded to bfloat16
    (Cast to bfloat16 then to float32), every Cast to bfloat16 inside a function followed by a Cast
    back; and {graph output: its numpy dtype in `model`}, to hand the outputs back in it."""
    bf16 = TensorProto.BFLOAT16
    try:
        typed = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except (onnx.shape_inference.InferenceError, RuntimeError, ValueError):
        typed = model
    types = {t.name: t.data_type for t in typed.graph.initializer}
    for vi in (*typed.graph.input, *typed.graph.value_info, *typed.graph.output):
        types[vi.name] = vi.type.tensor_type.elem_type
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    dtypes = {vi.name: helper.tensor_dtype_to_np_dtype(bf16) for vi in g.output
              if vi.type.tensor_type.elem_type == bf16}
    for t in g.initializer:
        if t.data_type == bf16:
            t.CopyFrom(numpy_helper.from_array(weight_array(t).astype(np.float32), t.name))
    for vi in (*g.input, *g.output, *g.value_info):
        if vi.type.tensor_type.elem_type == bf16:
            vi.type.tensor_type.elem_type = FLOAT
    taken = {t for n in g.node for t in n.output} | {n.name for n in g.node} | set(types)
    nodes: list[onnx.NodeProto] = []
    for node in g.node:
        _widen_node(node)
        if node.op_type == "Cast" and _cast_to(node) == bf16:  # the rounding pair below rounds
            next(a for a in node.attribute if a.name == "to").i = FLOAT
        nodes.append(node)
        for i, t in enumerate(node.output):
            if t and types.get(t) == bf16:
                raw = _unique(t + "__unrounded", taken)
                node.output[i] = raw
                nodes += _round_pair(raw, t, taken)
    del g.node[:]
    g.node.extend(nodes)
    for f in out.functions:
        body: list[onnx.NodeProto] = []
        for node in f.node:
            _widen_node(node)
            body.append(node)
        f.ClearField("node")
        f.node.extend(_round_casts(body, taken))
    return out, dtypes


def _widen_node(node: onnx.NodeProto) -> None:
    bf16 = TensorProto.BFLOAT16
    for a in node.attribute:
        if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == bf16:
            a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float32), a.t.name))


def _round_pair(src: str, dst: str, taken: set[str]) -> list[onnx.NodeProto]:
    mid = _unique(dst + "__bfloat16", taken)
    return [helper.make_node("Cast", [src], [mid], name=_unique(f"round_{dst}", taken), to=TensorProto.BFLOAT16),
            helper.make_node("Cast", [mid], [dst], name=_unique(f"widen_{dst}", taken), to=FLOAT)]


def _round_casts(nodes: list[onnx.NodeProto], taken: set[str]) -> list[onnx.NodeProto]:
    """Function bodies: a Cast to bfloat16 becomes the rounding pair (its output float32)."""
    result = []
    for node in nodes:
        if node.op_type == "Cast" and _cast_to(node) == TensorProto.BFLOAT16:
            dst = node.output[0]
            result += _round_pair(node.input[0], dst, taken)
        else:
            result.append(node)
    return result
