"""Dynamic-dim bindings from `--input-shape NAME=1x3x224x224` and `--dim NAME=V`.

Problem: exported models carry dynamic dims, named or unnamed (`?`, -1, 0), and everything
downstream needs static shapes.
Approach: the flags parse into a frozen `ShapeBindings`; `bind_inputs` rewrites a ModelProto's
graph-input shapes in place before shape inference: `--input-shape` sets a whole input, `--dim`
every occurrence of a named dim; an anonymous dim (`?`, '') ties nothing. After canonicalization
`check_static_model` checks the model computes at the bound dims (strict inference, constant
Gather indices in range). Messages name bindings as the user wrote them (`Spelling`: flags, or the
sweep's TOML keys).
Invariants: after binding every graph-input dim is a positive int, or a `ShapeBindingError` names
input, dim and the fixing flag; bindings naming nothing, or giving one dim two values, are errors;
no tensor exceeds MAX_TENSOR_BYTES."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import onnx
import onnx_ir as ir

from fusesearch.errors import ModelLoadError, ShapeBindingError


def static_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    """The value's dims where every one is a known int >= 0, else None."""
    if value is None or value.shape is None:
        return None
    dims = tuple(value.shape)
    if all(isinstance(d, int) and d >= 0 for d in dims):
        return tuple(int(d) for d in dims)
    return None


def broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """`shape` broadcasts to `target` one way (numpy rules, `target` unchanged)."""
    return len(shape) <= len(target) and all(s in (1, t) for s, t in zip(reversed(shape), reversed(target), strict=False))


@dataclass(frozen=True)
class Spelling:
    """How the user wrote the bindings, for messages ({name}: an input's or a dim's name)."""

    shape_key: str = "--input-shape {name}"  # the binding of one input's whole shape
    shape_fix: str = "--input-shape {name}=D1xD2x..."
    dim_key: str = "--dim {name}"  # the binding of one named dim
    dim_fix: str = "--dim {name}=V"
    both: str = "--input-shape/--dim values"  # all of them, in a hint

    def dim(self, name: str, value: int) -> str:
        return f"{self.dim_key.format(name=name)}={value}"

    def shape(self, name: str, shape: tuple[int, ...]) -> str:
        return f"{self.shape_key.format(name=name)}={'x'.join(map(str, shape))}"


FLAGS = Spelling()


@dataclass(frozen=True)
class ShapeBindings:
    input_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    dims: Mapping[str, int] = field(default_factory=dict)
    defaults: Mapping[str, int] = field(default_factory=dict)  # a zoo model's; never "unknown"
    spelling: Spelling = field(default=FLAGS, compare=False)

    @classmethod
    def parse(cls, input_shapes: Iterable[str] = (), dims: Iterable[str] = ()) -> ShapeBindings:
        shapes = _once((_parse_input_shape(flag) for flag in input_shapes), FLAGS.shape)
        named = _once((_parse_dim(flag) for flag in dims), FLAGS.dim)
        return cls(MappingProxyType(shapes), MappingProxyType(named))

    def with_defaults(self, defaults: Mapping[str, int]) -> ShapeBindings:
        """Defaults (a zoo model's) for dims the user did not bind."""
        return replace(self, defaults=MappingProxyType(dict(defaults)))

    def value_of(self, dim_name: str) -> int | None:
        return self.dims.get(dim_name, self.defaults.get(dim_name))

    def to_flags(self) -> list[str]:
        flags = [f"--input-shape {k}={'x'.join(map(str, v))}" for k, v in self.input_shapes.items()]
        return flags + [f"--dim {k}={v}" for k, v in self.dims.items()]

    def given(self) -> str:
        """The user's bindings as they wrote them (flags or config keys), for messages; '' if none."""
        spell = self.spelling
        return ", ".join([spell.shape(k, v) for k, v in self.input_shapes.items()]
                         + [spell.dim(k, v) for k, v in self.dims.items()])


def _once(pairs: Iterable[tuple[str, Any]], spell: Callable[[str, Any], str]) -> dict[str, Any]:
    """A name given twice must get one value (`--dim batch=1 --dim batch=2` is refused)."""
    out: dict[str, Any] = {}
    for name, value in pairs:
        if out.get(name, value) != value:
            raise ShapeBindingError(f"{spell(name, value)} conflicts with {spell(name, out[name])}; "
                                    f"give '{name}' one value")
        out[name] = value
    return out


def _parse_input_shape(flag: str) -> tuple[str, tuple[int, ...]]:
    name, sep, dims = flag.rpartition("=")
    if not sep or not name or not dims:
        raise ShapeBindingError(
            f"--input-shape '{flag}': expected NAME=D1xD2x..., e.g. --input-shape input=1x3x224x224")
    try:
        shape = tuple(int(d) for d in dims.lower().split("x"))
    except ValueError:
        raise ShapeBindingError(
            f"--input-shape '{flag}': dims must be integers separated by 'x', e.g. 1x3x224x224"
        ) from None
    if any(d <= 0 for d in shape):
        raise ShapeBindingError(
            f"--input-shape '{flag}': every dim must be a positive integer (got {dims})")
    return name, shape


def _parse_dim(flag: str) -> tuple[str, int]:
    name, sep, value = flag.rpartition("=")
    try:
        size = int(value)
    except ValueError:
        size = 0
    if not sep or not name or size <= 0:
        raise ShapeBindingError(f"--dim '{flag}': expected NAME=V with V a positive integer, e.g. --dim batch=1")
    return name, size


ANONYMOUS = frozenset({"", "?"})  # dim_params exporters write for "unknown": they tie no two dims


def _is_dynamic(dim: onnx.TensorShapeProto.Dimension) -> bool:
    return not dim.HasField("dim_value") or dim.dim_value <= 0


def _name(dim: onnx.TensorShapeProto.Dimension) -> str | None:
    """The dim's name if it has a real one (shared by every dim of that name), else None."""
    return dim.dim_param if dim.HasField("dim_param") and dim.dim_param.strip() not in ANONYMOUS else None


def _dim_label(dim: onnx.TensorShapeProto.Dimension, index: int) -> str:
    name = _name(dim)
    if name:
        return f"dim {index} '{name}'"
    if dim.HasField("dim_value"):  # -1 or 0: exporters' "unknown"; no tensor here is zero-size
        return f"dim {index} (given as {dim.dim_value}: read as unknown, zero-size tensors are not supported)"
    return f"dim {index} (unnamed)"


def bind_inputs(graph: onnx.GraphProto, bindings: ShapeBindings, inputs: list[onnx.ValueInfoProto]) -> None:
    """Set static shapes on `inputs` (the graph's real inputs) in place, or raise ShapeBindingError."""
    names = [vi.name for vi in inputs]
    spell = bindings.spelling
    for name in bindings.input_shapes:
        if name not in names:
            raise ShapeBindingError(f"{spell.shape_key.format(name=name)}: unknown input '{name}'; "
                                    f"the model's inputs are: {', '.join(names)}")
    bindings = _with_implied_dims(bindings, inputs)
    known = sorted({_name(d) for vi in inputs for d in vi.type.tensor_type.shape.dim if _name(d)})
    used_dims = set()
    for vi in inputs:
        if not vi.type.HasField("tensor_type"):
            continue
        used_dims |= _bind_one(vi, bindings)
    unknown = sorted(set(bindings.dims) - used_dims)
    if unknown:
        _raise_unknown_dim(unknown, known, spell)


def _with_implied_dims(bindings: ShapeBindings, inputs: list[onnx.ValueInfoProto]) -> ShapeBindings:
    """`--input-shape ids=1x64` on dims (batch, seq) also binds batch=1, seq=64 for other inputs;
    a flag that gives a named dim another value than `--dim` or another `--input-shape` is an error."""
    implied: dict[str, int] = {}
    source: dict[str, str] = {k: bindings.spelling.dim(k, v) for k, v in bindings.dims.items()}
    for vi in inputs:
        shape = bindings.input_shapes.get(vi.name)
        if shape is None or not vi.type.tensor_type.HasField("shape"):
            continue
        flag = bindings.spelling.shape(vi.name, shape)
        for i, (dim, value) in enumerate(zip(vi.type.tensor_type.shape.dim, shape, strict=False)):
            name = _name(dim)
            if name is None:
                continue
            bound = bindings.dims.get(name, implied.get(name))
            if bound is not None and bound != value:
                raise ShapeBindingError(
                    f"{flag} gives dim {i} '{name}' of input '{vi.name}' the value {value}, "
                    f"{source[name]} gives {bound}; make the two agree")
            if name not in bindings.dims:
                implied[name] = value
                source.setdefault(name, flag)
    return replace(bindings, defaults=MappingProxyType({**bindings.defaults, **implied}))


def _raise_unknown_dim(unknown: list[str], known: list[str], spell: Spelling) -> None:
    hint = f"the model's named dims are: {', '.join(known)}" if known else "the model has no named dims"
    raise ShapeBindingError(f"{spell.dim_key.format(name=unknown[0])}: unknown dim '{unknown[0]}'; {hint}")


def _bind_one(vi: onnx.ValueInfoProto, bindings: ShapeBindings) -> set[str]:
    tensor_type = vi.type.tensor_type
    spell = bindings.spelling
    if vi.name in bindings.input_shapes:
        return _set_whole_shape(vi, bindings.input_shapes[vi.name], spell)
    if not tensor_type.HasField("shape"):
        raise ShapeBindingError(f"input '{vi.name}' has no shape in the model; bind it with "
                                f"{spell.shape_fix.format(name=vi.name)}")
    shape, used = [], {}
    for i, dim in enumerate(tensor_type.shape.dim):
        name = _name(dim)
        value = dim.dim_value if not _is_dynamic(dim) else bindings.value_of(name) if name else None
        if value is None:
            fix = spell.dim_fix.format(name=name) if name else spell.shape_fix.format(name=vi.name)
            raise ShapeBindingError(
                f"input '{vi.name}' has unbound dynamic {_dim_label(dim, i)}; bind it with {fix}")
        if _is_dynamic(dim):
            used[name] = value
        shape.append(value)
    _write_shape(vi, shape, ", ".join(spell.dim(k, v) for k, v in used.items()))
    return set(used)


def _set_whole_shape(vi: onnx.ValueInfoProto, shape: tuple[int, ...], spell: Spelling) -> set[str]:
    tensor_type = vi.type.tensor_type
    key = spell.shape_key.format(name=vi.name)
    if tensor_type.HasField("shape"):
        dims = tensor_type.shape.dim
        if len(dims) != len(shape):
            raise ShapeBindingError(
                f"{key}: the model's input has rank {len(dims)}, this gives rank {len(shape)} "
                f"({'x'.join(map(str, shape))}); give {len(dims)} dims")
        for i, (dim, value) in enumerate(zip(dims, shape, strict=True)):
            if not _is_dynamic(dim) and dim.dim_value != value:
                raise ShapeBindingError(
                    f"{key}: dim {i} is fixed to {dim.dim_value} in the model, this gives {value}; "
                    f"use {dim.dim_value}")
    used = {_name(d) for d in tensor_type.shape.dim if _name(d)}
    _write_shape(vi, shape, spell.shape(vi.name, shape))
    return used


def _write_shape(vi: onnx.ValueInfoProto, shape: list[int] | tuple[int, ...], why: str) -> None:
    """Give the input its static shape; `why`: the bindings that set it (for the size check)."""
    tensor_type = vi.type.tensor_type
    too_large = _oversize(shape, tensor_type.elem_type)
    if too_large:
        cause = f"{why} makes input '{vi.name}'" if why else f"input '{vi.name}' is"
        raise ShapeBindingError(f"{cause} {too_large}; give smaller dims")
    tensor_type.ClearField("shape")
    tensor_type.shape.SetInParent()  # a scalar's shape is present with no dims, not unknown
    for value in shape:
        tensor_type.shape.dim.add().dim_value = value


MAX_TENSOR_BYTES = 1 << 48  # 256 TiB: the virtual address space of x86-64 CPUs and of NVIDIA GPUs


def _oversize(shape, elem_type: int) -> str | None:
    """Words saying how a tensor is larger than any machine holds, or None if it is not. Such
    sizes also overflow ONNX's int64 dims and the search's integer costs."""
    try:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
        itemsize, dtype_name = dtype.itemsize, dtype.name
    except (KeyError, TypeError, ValueError):
        itemsize, dtype_name = 1, "tensor"
    size = math.prod(shape) * itemsize
    if size <= MAX_TENSOR_BYTES:
        return None
    return (f"{'x'.join(map(str, shape))} {dtype_name} ({size / 2**40:,.0f} TiB), above the "
            f"{MAX_TENSOR_BYTES / 2**40:.0f} TiB a tensor can have on any machine")


# -- the model at the bound dims ---------------------------------------------------------------

_INFERENCE_ERROR = re.compile(r"\(op_type:([^,]*), node name: ([^)]*)\): (?:\[\w+\] )?(.*)")


def check_static_model(model: ir.Model, label: str, bindings: ShapeBindings) -> None:
    """The canonical model (constants folded) computes at the bound dims: no tensor is larger than
    any machine holds, no Gather reads past the end of a constant table, and onnx's strict shape
    inference finds no node whose input shapes disagree (a 512-position table added to 1000
    positions). Else a one-line BadInput naming the bindings, the node and the shapes."""
    for node in model.graph:
        for value in node.outputs:
            shape = static_shape(value)
            too_large = _oversize(shape, value.dtype.value) if shape and value.dtype is not None else None
            if too_large:
                _refuse(label, bindings, f"tensor '{value.name}' of node '{node.name}' ({node.op_type}) "
                                         f"would be {too_large}")
    for node in model.graph:
        if node.op_type == "Gather" and node.domain in ("", "ai.onnx"):
            _check_gather(node, label, bindings)
    conflict = _strict_inference(model)
    if conflict is not None:
        _refuse(label, bindings, conflict)


def _refuse(label: str, bindings: ShapeBindings, problem: str) -> None:
    given = bindings.given()
    if given:
        raise ShapeBindingError(f"{label}: at {given}, {problem}; the model cannot take these dims: "
                                f"give other {bindings.spelling.both}")
    raise ModelLoadError(f"{label}: {problem}; fix the export")


def _shape_text(value: ir.Value | None) -> str:
    shape = static_shape(value)
    return "none" if value is None else "x".join(map(str, shape)) if shape is not None else "?"


def _strict_inference(model: ir.Model) -> str | None:
    """Words naming the first node onnx's strict shape inference refuses, and its input shapes.
    Without data propagation: the constants are folded by now, and it allocates for a large weight
    that the call below turns into an input."""
    from onnx_ir.passes.common import _c_api_utils  # takes large weights out for the C++ call

    def infer(proto: onnx.ModelProto) -> None:
        onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=True, data_prop=False)

    try:
        _c_api_utils.call_onnx_api(infer, model)
    except onnx.shape_inference.InferenceError as exc:
        found = _INFERENCE_ERROR.search(str(exc))
        if found is None:
            return f"onnx's shape inference fails ({str(exc).strip().splitlines()[0]})"
        op, name, why = found.group(1), found.group(2), found.group(3).strip()
        node = next((n for n in model.graph if n.name == name), None)
        shapes = ", ".join(_shape_text(v) for v in node.inputs) if node is not None else "?"
        return f"node '{name}' ({op}) cannot take inputs of shapes {shapes} ({why})"
    return None


def _check_gather(node: ir.Node, label: str, bindings: ShapeBindings) -> None:
    """A Gather with constant indices reads inside its data's axis (ONNX Runtime refuses the model)."""
    data, indices = (list(node.inputs) + [None, None])[:2]
    shape = static_shape(data)
    if shape is None or indices is None or indices.const_value is None:
        return
    axis = node.attributes.get_int("axis", 0)
    if not -len(shape) <= axis < len(shape):
        return
    count = shape[axis]
    values = indices.const_value.numpy()
    if values.size == 0:
        return
    bad = int(values.max()) if values.max() >= count else int(values.min())
    if -count <= bad < count:
        return
    _refuse(label, bindings, f"node '{node.name}' (Gather) reads index {bad} of '{data.name}' (indices "
                             f"'{indices.name}') along axis {axis}, which has {count} entries (-{count}..{count - 1})")
