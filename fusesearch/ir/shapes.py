"""Dynamic-dim bindings from `--input-shape NAME=1x3x224x224` and `--dim NAME=V`.

Problem: exported models carry dynamic dims — named (`batch`, `p2o.DynamicDimension.0`) or unnamed
(`?`, -1, 0) — and everything downstream (costs, kernels) needs static shapes.
Approach: parse the flags into a frozen `ShapeBindings`; `bind_inputs` rewrites the graph inputs'
shapes of a ModelProto in place before shape inference. `--input-shape` sets a whole input;
`--dim` sets every occurrence of a named dim.
Messages name the bindings as the user wrote them: command-line flags by default, or a config
file's keys (`Spelling`, which `fusesearch sweep` sets to its TOML keys).
Invariants: after binding, every graph input dim is a positive int, or a `ShapeBindingError` names
the input, the dim and the flag (or key) that fixes it. Bindings that name nothing in the model are
errors too, and so are two bindings that give one named dim two values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import onnx

from fusesearch.errors import ShapeBindingError


@dataclass(frozen=True)
class Spelling:
    """How the user wrote the bindings, for messages ({name}: an input's or a dim's name)."""

    shape_key: str = "--input-shape {name}"  # the binding of one input's whole shape
    shape_fix: str = "--input-shape {name}=D1xD2x..."
    dim_key: str = "--dim {name}"  # the binding of one named dim
    dim_fix: str = "--dim {name}=V"
    both: str = "--input-shape/--dim values"  # all of them, in a hint


FLAGS = Spelling()


@dataclass(frozen=True)
class ShapeBindings:
    input_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    dims: Mapping[str, int] = field(default_factory=dict)
    defaults: Mapping[str, int] = field(default_factory=dict)  # a zoo model's; never "unknown"
    spelling: Spelling = field(default=FLAGS, compare=False)

    @classmethod
    def parse(cls, input_shapes: Iterable[str] = (), dims: Iterable[str] = ()) -> ShapeBindings:
        shapes = dict(_parse_input_shape(flag) for flag in input_shapes)
        named = dict(_parse_dim(flag) for flag in dims)
        return cls(MappingProxyType(shapes), MappingProxyType(named))

    def with_defaults(self, defaults: Mapping[str, int]) -> ShapeBindings:
        """Defaults (a zoo model's) for dims the user did not bind."""
        return replace(self, defaults=MappingProxyType(dict(defaults)))

    def value_of(self, dim_name: str) -> int | None:
        return self.dims.get(dim_name, self.defaults.get(dim_name))

    def to_flags(self) -> list[str]:
        flags = [f"--input-shape {k}={'x'.join(map(str, v))}" for k, v in self.input_shapes.items()]
        return flags + [f"--dim {k}={v}" for k, v in self.dims.items()]


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


def _is_dynamic(dim: onnx.TensorShapeProto.Dimension) -> bool:
    return not dim.HasField("dim_value") or dim.dim_value <= 0


def _dim_label(dim: onnx.TensorShapeProto.Dimension, index: int) -> str:
    if dim.HasField("dim_param") and dim.dim_param:
        return f"dim {index} '{dim.dim_param}'"
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
    known = sorted({d.dim_param for vi in inputs for d in vi.type.tensor_type.shape.dim if d.dim_param})
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
    source: dict[str, str] = {k: bindings.spelling.dim_key.format(name=k) + f"={v}" for k, v in bindings.dims.items()}
    for vi in inputs:
        shape = bindings.input_shapes.get(vi.name)
        if shape is None or not vi.type.tensor_type.HasField("shape"):
            continue
        flag = bindings.spelling.shape_key.format(name=vi.name) + f"={'x'.join(map(str, shape))}"
        for i, (dim, value) in enumerate(zip(vi.type.tensor_type.shape.dim, shape, strict=False)):
            if not dim.dim_param:
                continue
            bound = bindings.dims.get(dim.dim_param, implied.get(dim.dim_param))
            if bound is not None and bound != value:
                raise ShapeBindingError(
                    f"{flag} gives dim {i} '{dim.dim_param}' of input '{vi.name}' the value {value}, "
                    f"{source[dim.dim_param]} gives {bound}; make the two agree")
            if dim.dim_param not in bindings.dims:
                implied[dim.dim_param] = value
                source.setdefault(dim.dim_param, flag)
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
    used = set()
    for i, dim in enumerate(tensor_type.shape.dim):
        if not _is_dynamic(dim):
            continue
        value = bindings.value_of(dim.dim_param) if dim.dim_param else None
        if value is not None:
            used.add(dim.dim_param)
            dim.Clear()
            dim.dim_value = value
            continue
        fix = (spell.dim_fix.format(name=dim.dim_param) if dim.dim_param
               else spell.shape_fix.format(name=vi.name))
        raise ShapeBindingError(
            f"input '{vi.name}' has unbound dynamic {_dim_label(dim, i)}; bind it with {fix}")
    return used


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
    used = {d.dim_param for d in tensor_type.shape.dim if d.dim_param}
    tensor_type.ClearField("shape")
    for value in shape:
        tensor_type.shape.dim.add().dim_value = value
    return used
