"""PyTorch eager and torch.compile over the same ONNX model: the baselines a PyTorch user has.

Problem: a plan is only shown fast beside what its user would run instead (PyTorch eager or
`torch.compile`); off-the-shelf converters lack opset 21 and build shapes Dynamo cannot trace.
Approach: our converter from the canonical model to an `nn.Module`: each node one closure over torch
ops, shape-like inputs read at conversion time as ints, constants buffers; `forward` runs them in
topological order (one straight-line graph for Dynamo). `compiled` wraps it in `torch.compile`
(Inductor, `freezing`, `inference_mode`; default or `max-autotune`); a failing compile is retried
with `RETRIES` and reported. The caller checks every variant against ONNX Runtime before timing.
torch is optional (the `torch` extra), imported only here, lazily (`load_torch`); a node without a
converter raises `Unconvertible` naming it (rnn-control's Loop, If).
Invariants: the module never changes a constant; a converter reads only the node's attributes,
its constant inputs and its tensor inputs."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from contextlib import contextmanager

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fusesearch.errors import FusesearchError

MODES = {"torch_compile": "default", "torch_compile_max_autotune": "max-autotune"}
NOT_INSTALLED = "not installed"


class Unconvertible(FusesearchError):
    """A node the converter has no torch equivalent for (names the node and why)."""


def load_torch():
    """The torch module; ImportError where it is not installed (the optional `torch` extra)."""
    import torch

    return torch


def versions() -> dict:
    """torch's version, and Triton's where it is installed (Inductor's GPU code)."""
    torch = load_torch()
    found = {"torch": torch.__version__}
    try:
        import triton

        found["triton"] = triton.__version__
    except ImportError:
        pass
    return found


# -- the converter ----------------------------------------------------------------------------

def _ints(value) -> list[int]:
    return [int(v) for v in np.asarray(value).reshape(-1)]


class _Node:
    """One node's view for its converter: attributes, and inputs as constants where they are."""

    def __init__(self, node: onnx.NodeProto, consts: Mapping[str, np.ndarray], shapes: Mapping[str, tuple]):
        self.node = node
        self.attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        self._consts = consts
        self._shapes = shapes

    def attr(self, name: str, default=None):
        value = self.attrs.get(name, default)
        return value.decode() if isinstance(value, bytes) else value

    def const(self, i: int):
        """Input i's value where it is a constant, None where omitted; Unconvertible where it is
        computed (a shape-like input must be known before running)."""
        if i >= len(self.node.input) or not self.node.input[i]:
            return None
        name = self.node.input[i]
        if name not in self._consts:
            raise self.refuse(f"input '{name}' is computed, and it must be a constant")
        return self._consts[name]

    def shape(self, i: int) -> tuple:
        return self._shapes[self.node.input[i]]

    def refuse(self, why: str) -> Unconvertible:
        return Unconvertible(f"node '{self.node.name}' ({self.node.op_type}): {why}")


def _converters(torch) -> dict[str, Callable[[_Node], Callable]]:
    """op_type -> (node view -> the function of the node's tensor inputs, returning its outputs)."""
    F = torch.nn.functional

    def binary(fn):
        return lambda n: fn

    def arithmetic(fn):
        """A float constant of one element that broadcasting does not widen is a Python number,
        as a PyTorch user writes `x / math.sqrt(d)` (Inductor's attention patterns match it)."""
        def make(n):
            for i in (1, 0):
                value = n._consts.get(n.node.input[i])
                if (value is not None and value.size == 1 and value.dtype.kind == "f"
                        and value.ndim <= len(n.shape(1 - i))):
                    number = float(value.reshape(()))
                    return ((lambda a, _b, c=number: fn(a, c)) if i == 1 else (lambda _a, b, c=number: fn(c, b)))
            return fn
        return make

    def truncating(a, b):
        integer = not (a if isinstance(a, torch.Tensor) else b).is_floating_point()
        return torch.div(a, b, rounding_mode="trunc") if integer else a / b

    def unary(fn):
        return lambda n: fn

    def cast(n):
        dtype = _dtype(torch, n.attr("to"))
        return lambda x: x.to(dtype)

    def gemm(n):
        alpha, beta = n.attr("alpha", 1.0), n.attr("beta", 1.0)
        ta, tb = n.attr("transA", 0), n.attr("transB", 0)

        def run(a, b, c=None):
            y = (a.t() if ta else a) @ (b.t() if tb else b)
            y = y * alpha if alpha != 1.0 else y
            return y if c is None else y + (c * beta if beta != 1.0 else c)
        return run

    def pads_of(n, spatial: int):
        if n.attr("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
            raise n.refuse(f"auto_pad {n.attr('auto_pad')}: only explicit pads convert")
        pads = list(n.attr("pads", [0] * 2 * spatial))
        begin, end = pads[:spatial], pads[spatial:]
        # F.pad takes the last dim first: (begin_last, end_last, begin_last-1, ...)
        flat = [p for b, e in zip(reversed(begin), reversed(end), strict=True) for p in (b, e)]
        return begin, end, flat

    def conv(n):
        spatial = len(n.shape(1)) - 2
        begin, end, flat = pads_of(n, spatial)
        fn = (F.conv1d, F.conv2d, F.conv3d)[spatial - 1]
        kw = {"stride": n.attr("strides", [1] * spatial), "dilation": n.attr("dilations", [1] * spatial),
              "groups": n.attr("group", 1)}
        if begin == end:
            return lambda x, w, b=None: fn(x, w, b, padding=begin, **kw)
        return lambda x, w, b=None: fn(F.pad(x, flat), w, b, **kw)

    def conv_transpose(n):
        spatial = len(n.shape(1)) - 2
        begin, end, _ = pads_of(n, spatial)
        if begin != end or n.attr("output_shape") is not None:
            raise n.refuse("asymmetric pads or output_shape: not converted")
        fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[spatial - 1]
        kw = {"stride": n.attr("strides", [1] * spatial), "dilation": n.attr("dilations", [1] * spatial),
              "groups": n.attr("group", 1), "padding": begin,
              "output_padding": n.attr("output_padding", [0] * spatial)}
        return lambda x, w, b=None: fn(x, w, b, **kw)

    def resize(n):
        """The two forms torch's interpolate has: nearest (asymmetric, floor) and (bi)linear
        (half_pixel, or align_corners), to the output's static size."""
        mode, where = n.attr("mode", "nearest"), n.attr("coordinate_transformation_mode", "half_pixel")
        size = tuple(n._shapes[n.node.output[0]][2:])
        if mode == "nearest" and where == "asymmetric" and n.attr("nearest_mode", "round_prefer_floor") == "floor":
            return lambda x, *_: F.interpolate(x, size=size, mode="nearest")
        if mode == "linear" and where in ("half_pixel", "pytorch_half_pixel", "align_corners") and len(size) == 2:
            return lambda x, *_: F.interpolate(x, size=size, mode="bilinear",
                                               align_corners=where == "align_corners")
        raise n.refuse(f"mode {mode} with coordinate_transformation_mode {where}: not converted")

    def pool(n, kind: str):
        kernel = n.attr("kernel_shape")
        spatial = len(kernel)
        begin, end, flat = pads_of(n, spatial)
        strides = n.attr("strides", [1] * spatial)
        ceil = bool(n.attr("ceil_mode", 0))
        if kind == "max":
            if n.attr("dilations", [1] * spatial) != [1] * spatial or len(n.node.output) > 1:
                raise n.refuse("dilations or indices: not converted")
            fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[spatial - 1]
            if begin == end and all(2 * p <= k for p, k in zip(begin, kernel, strict=True)):
                return lambda x: fn(x, kernel, strides, begin, ceil_mode=ceil)
            return lambda x: fn(F.pad(x, flat, value=-math.inf), kernel, strides, 0, ceil_mode=ceil)
        fn = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[spatial - 1]
        include = bool(n.attr("count_include_pad", 0))
        if begin != end or any(2 * p > k for p, k in zip(begin, kernel, strict=True)):
            if not include and any(begin + end):
                raise n.refuse("asymmetric pads without count_include_pad: not converted")
            return lambda x: fn(F.pad(x, flat), kernel, strides, 0, ceil_mode=ceil)
        return lambda x: fn(x, kernel, strides, begin, ceil_mode=ceil, count_include_pad=include)

    def global_pool(n, kind: str):
        def run(x):
            dims = tuple(range(2, x.dim()))
            return x.mean(dims, keepdim=True) if kind == "avg" else x.amax(dims, keepdim=True)
        return run

    def reshape(n):
        shape = _ints(n.const(1))
        source = n.shape(0)
        if not n.attr("allowzero", 0):
            shape = [source[i] if s == 0 else s for i, s in enumerate(shape)]
        return lambda x, _s=None: x.reshape(shape)

    def flatten(n):
        axis = n.attr("axis", 1) % max(len(n.shape(0)), 1) if n.attr("axis", 1) < 0 else n.attr("axis", 1)
        lead = int(np.prod(n.shape(0)[:axis], dtype=np.int64))
        return lambda x: x.reshape(lead, -1)

    def transpose(n):
        perm = n.attr("perm") or list(range(len(n.shape(0))))[::-1]
        return lambda x: x.permute(*perm)

    def gather(n):
        axis = n.attr("axis", 0)
        indices = n.const(1) if n.node.input[1] in n._consts else None
        size = n.shape(0)[axis]
        if indices is not None:  # a constant index: folded into the module
            index = torch.as_tensor(np.where(indices < 0, indices + size, indices).astype(np.int64))
            return lambda x, _i: _take(x, index, axis)
        return lambda x, i: _take(x, torch.where(i < 0, i + size, i).long(), axis)

    def _take(x, index, axis):
        ax = axis % x.dim()
        picked = torch.index_select(x, ax, index.reshape(-1).to(x.device))
        return picked.reshape(tuple(x.shape[:ax]) + tuple(index.shape) + tuple(x.shape[ax + 1:]))

    def concat(n):
        axis = n.attr("axis")
        return lambda *xs: torch.cat(xs, axis)

    def slice_(n):
        rank = len(n.shape(0))
        starts, ends = _ints(n.const(1)), _ints(n.const(2))
        axes = _ints(n.const(3)) if n.const(3) is not None else list(range(len(starts)))
        steps = _ints(n.const(4)) if n.const(4) is not None else [1] * len(starts)
        index = [slice(None)] * rank
        for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
            if st < 1:
                raise n.refuse(f"step {st}: only positive steps convert")
            dim = n.shape(0)[a]
            index[a % rank] = slice(*slice(s, e, st).indices(dim))
        index = tuple(index)
        return lambda x, *_: x[index]

    def axes_of(n, default=None):
        axes = n.const(1) if len(n.node.input) > 1 else None
        axes = n.attr("axes", default) if axes is None else _ints(axes)
        return axes

    def unsqueeze(n):
        rank = len(n.shape(0)) + len(axes_of(n))
        axes = sorted(a % rank for a in axes_of(n))

        def run(x, *_):
            for a in axes:
                x = x.unsqueeze(a)
            return x
        return run

    def squeeze(n):
        axes = axes_of(n)
        shape = n.shape(0)
        axes = [i for i, d in enumerate(shape) if d == 1] if axes is None else [a % len(shape) for a in axes]
        kept = [d for i, d in enumerate(shape) if i not in axes]
        return lambda x, *_: x.reshape(kept)

    def split(n):
        axis = n.attr("axis", 0)
        size = n.shape(0)[axis]
        parts = n.const(1)
        if parts is None:
            parts = n.attr("split")
        if parts is None:
            count = n.attr("num_outputs", len(n.node.output))
            each = -(-size // count)
            parts = [each] * (size // each) + ([size % each] if size % each else [])
        parts = _ints(parts)
        return lambda x, *_: tuple(torch.split(x, parts, axis))

    def softmax(n):
        axis = n.attr("axis", -1)
        return lambda x: torch.softmax(x, axis)

    def layer_norm(n):
        if len([o for o in n.node.output if o]) > 1:
            raise n.refuse("Mean / InvStdDev outputs: not converted")
        axis = n.attr("axis", -1) % len(n.shape(0))
        shape = tuple(n.shape(0)[axis:])
        eps = n.attr("epsilon", 1e-5)
        return lambda x, w, b=None: F.layer_norm(x, shape, w, b, eps)

    def reduce(fn):
        def make(n):
            axes = axes_of(n)
            keep = bool(n.attr("keepdims", 1))
            if not axes:
                if n.attr("noop_with_empty_axes", 0):
                    return lambda x, *_: x
                axes = list(range(len(n.shape(0))))
            return lambda x, *_: fn(x, axes, keep)
        return make

    def clip(n):
        lo, hi = n.const(1), n.const(2)
        lo = n.attr("min") if lo is None else float(lo)
        hi = n.attr("max") if hi is None else float(hi)
        return lambda x, *_: torch.clamp(x, lo, hi)

    def batch_norm(n):
        eps = n.attr("epsilon", 1e-5)
        return lambda x, s, b, m, v: F.batch_norm(x, m, v, s, b, False, 0.0, eps)

    def expand(n):
        shape = tuple(np.broadcast_shapes(tuple(n.shape(0)), tuple(_ints(n.const(1)))))
        return lambda x, _s: x.expand(shape)

    def where(n):
        return lambda c, a, b: torch.where(c, a, b)

    def sum_(n):
        def run(*xs):
            y = xs[0]
            for x in xs[1:]:
                y = y + x
            return y
        return run

    def identity(n):
        return lambda x: x

    def leaky(n):
        alpha = n.attr("alpha", 0.01)
        return lambda x: F.leaky_relu(x, alpha)

    def hard_sigmoid(n):
        alpha, beta = n.attr("alpha", 0.2), n.attr("beta", 0.5)
        return lambda x: torch.clamp(x * alpha + beta, 0, 1)

    return {
        "Add": arithmetic(operator.add), "Sub": arithmetic(operator.sub), "Mul": arithmetic(operator.mul),
        "Div": arithmetic(truncating), "Pow": arithmetic(operator.pow), "Max": binary(torch.maximum), "Min": binary(torch.minimum),
        "Equal": binary(torch.eq), "Less": binary(torch.lt), "Greater": binary(torch.gt),
        "And": binary(torch.logical_and), "Or": binary(torch.logical_or), "Not": unary(torch.logical_not),
        "Sqrt": unary(torch.sqrt), "Erf": unary(torch.erf), "Tanh": unary(torch.tanh), "Relu": unary(torch.relu),
        "Sigmoid": unary(torch.sigmoid), "Exp": unary(torch.exp), "Log": unary(torch.log), "Neg": unary(torch.neg),
        "Abs": unary(torch.abs), "Reciprocal": unary(torch.reciprocal), "Floor": unary(torch.floor),
        "Ceil": unary(torch.ceil), "Sin": unary(torch.sin), "Cos": unary(torch.cos),
        "Softplus": unary(F.softplus), "HardSwish": unary(F.hardswish), "LeakyRelu": leaky,
        "HardSigmoid": hard_sigmoid, "Identity": identity, "Cast": cast, "MatMul": binary(torch.matmul),
        "Gemm": gemm, "Conv": conv, "ConvTranspose": conv_transpose, "Resize": resize, "MaxPool": lambda n: pool(n, "max"), "AveragePool": lambda n: pool(n, "avg"),
        "GlobalAveragePool": lambda n: global_pool(n, "avg"), "GlobalMaxPool": lambda n: global_pool(n, "max"),
        "Reshape": reshape, "Flatten": flatten, "Transpose": transpose, "Gather": gather, "Concat": concat,
        "Slice": slice_, "Unsqueeze": unsqueeze, "Squeeze": squeeze, "Split": split, "Softmax": softmax,
        "LayerNormalization": layer_norm, "BatchNormalization": batch_norm, "Clip": clip, "Expand": expand,
        "Where": where, "Sum": sum_,
        "ReduceMean": reduce(lambda x, a, k: x.mean(a, keepdim=k)),
        "ReduceSum": reduce(lambda x, a, k: x.sum(a, keepdim=k)),
        "ReduceMax": reduce(lambda x, a, k: x.amax(a, keepdim=k)),
    }


def _dtype(torch, onnx_type: int):
    return {onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.FLOAT16: torch.float16,
            onnx.TensorProto.BFLOAT16: torch.bfloat16, onnx.TensorProto.DOUBLE: torch.float64,
            onnx.TensorProto.INT64: torch.int64, onnx.TensorProto.INT32: torch.int32,
            onnx.TensorProto.INT8: torch.int8, onnx.TensorProto.UINT8: torch.uint8,
            onnx.TensorProto.BOOL: torch.bool}[onnx_type]


def _shapes(model: onnx.ModelProto) -> dict[str, tuple]:
    """The static shape of every value (the canonical model knows them all)."""
    shapes = {}
    graph = model.graph
    for v in list(graph.input) + list(graph.value_info) + list(graph.output):
        dims = v.type.tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            shapes[v.name] = tuple(d.dim_value for d in dims)
    for t in graph.initializer:
        shapes[t.name] = tuple(t.dims)
    return shapes


def convert(model: onnx.ModelProto, weights: Mapping[str, np.ndarray] | None = None):
    """The model as an `nn.Module` (eval mode, float weights as buffers) whose forward takes the
    graph inputs in order and returns the graph outputs as a tuple; Unconvertible naming the
    first node it cannot take."""
    torch = load_torch()
    graph = model.graph
    weights = weights or {}
    consts = {}
    for t in graph.initializer:  # at the initializer's own shape (a scalar may come as one element)
        consts[t.name] = (np.asarray(weights[t.name]).reshape(tuple(t.dims)) if t.name in weights
                          else numpy_helper.to_array(t))
    shapes = _shapes(onnx.shape_inference.infer_shapes(model) if not graph.value_info else model)
    table = _converters(torch)
    steps = []
    for node in graph.node:
        if node.op_type == "Constant":
            consts[node.output[0]] = numpy_helper.to_array(helper.get_attribute_value(node.attribute[0]))
            shapes[node.output[0]] = consts[node.output[0]].shape
            continue
        if node.domain not in ("", "ai.onnx"):
            raise Unconvertible(f"node '{node.name}' ({node.domain}.{node.op_type}): no converter for this domain")
        make = table.get(node.op_type)
        if make is None:
            raise Unconvertible(f"node '{node.name}' ({node.op_type}): no converter")
        steps.append((make(_Node(node, consts, shapes)), tuple(node.input), tuple(node.output)))
    return _Module(torch, steps, consts, [i.name for i in graph.input if i.name not in consts],
                   [o.name for o in graph.output])


def _tensor(torch, value: np.ndarray, what: str):
    """`value` as a tensor sharing its memory; Unconvertible for a dtype torch cannot take from
    numpy (bfloat16 has no numpy dtype of its own)."""
    try:
        return torch.from_numpy(np.asarray(value))
    except TypeError as exc:
        raise Unconvertible(f"{what} of dtype {np.asarray(value).dtype}: torch cannot take it ({exc})") from None


def _module_class(torch):
    class Module(torch.nn.Module):
        """The converted graph: `forward` runs each node's function in topological order."""

        def __init__(self, steps, consts, inputs, outputs):
            super().__init__()
            self.steps, self.inputs, self.outputs = steps, inputs, outputs
            read = {t for _, ins, _ in steps for t in ins if t in consts}
            self.names = {}
            for i, t in enumerate(sorted(read)):
                self.names[t] = f"c{i}"
                self.register_buffer(f"c{i}", _tensor(torch, np.array(consts[t], copy=True), f"constant '{t}'"))

        def forward(self, *args):
            values = {t: getattr(self, b) for t, b in self.names.items()}
            values.update(zip(self.inputs, args, strict=True))
            for fn, ins, outs in self.steps:
                got = fn(*[values[t] if t else None for t in ins])
                if isinstance(got, tuple):
                    values.update(zip(outs, got, strict=True))
                else:
                    values[outs[0]] = got
            return tuple(values[t] for t in self.outputs)

    return Module


def _Module(torch, steps, consts, inputs, outputs):
    return _module_class(torch)(steps, consts, inputs, outputs).eval()


def compiled(module, mode: str):
    """`module` through torch.compile with Inductor's inference settings: frozen weights
    (`freezing`), `mode` "default" or "max-autotune" (CUDA graphs on a GPU). Call it under
    `torch.inference_mode()`; it compiles on its first call."""
    torch = load_torch()
    import torch._inductor.config as inductor

    inductor.freezing = True
    return torch.compile(module, mode=mode, fullgraph=True)


# Inductor's options a compile that fails is tried again with, the first that compiles wins:
# its attention rewrite (fuse_attention, in the pattern matcher) fails on some masked attention
# graphs ("Attempting to broadcast a dimension") where the rest of Inductor compiles them
RETRIES = ({}, {"pattern_matcher": False})


def _first_compile(module, mode: str, args, say_retry: Callable[[str], None]):
    """(the compiled module, its first outputs), trying `RETRIES` in order; the last error raises.
    `say_retry` hears each error that a retry follows."""
    torch = load_torch()
    import torch._inductor.config as inductor

    for i, options in enumerate(RETRIES):
        fn = compiled(module, mode)
        if options:  # every call under the options it compiled with: Dynamo recompiles otherwise
            def fn(*a, fn=fn, options=options):
                with inductor.patch(options):
                    return fn(*a)
        try:
            with torch.inference_mode():
                return fn, fn(*args)
        except Exception as exc:  # noqa: BLE001 -- the compiler's own errors, retried then reported
            if i == len(RETRIES) - 1:
                raise
            say_retry(f"{_first_line(exc)}; compiled with {options_text(RETRIES[i + 1])}")
            torch._dynamo.reset()


def options_text(options: Mapping[str, object]) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items())


def _first_line(exc: Exception) -> str:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    text = next((ln for ln in lines if "Error:" in ln), lines[0] if lines else "")
    return f"{type(exc).__name__}: {text.strip()}"


# -- the baselines in a run -------------------------------------------------------------------

class CudaEventClock:
    """Device time of one run on torch's current stream, between two CUDA events."""

    name = "cuda_event"

    def __init__(self, torch):
        self._torch = torch

    def start(self) -> object:
        begin, end = (self._torch.cuda.Event(enable_timing=True) for _ in range(2))
        begin.record()
        return begin, end

    def stop(self, token: object) -> float:
        begin, end = token
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) * 1e-3


def baselines(model: onnx.ModelProto, weights: Mapping[str, np.ndarray], feeds: Mapping[str, np.ndarray],
              reference: Mapping[str, np.ndarray], rtol: float, *, cuda: bool = False,
              tf32: bool = True, modes: Mapping[str, str] = MODES):
    """(runs, clocks, info) for `run`: PyTorch eager and torch.compile (each of `modes`) over
    the converted model, each checked equal to ONNX Runtime's outputs (`reference`) before it is
    timed (call it inside `torch_threads`). `runs`: name -> one inference on inputs already on the device; `clocks`: CUDA events
    on a GPU, else none (the caller's host clock); `info`: the JSON's "torch" entry — the
    versions, the converter, and per variant left out the reason ("refused": the model cannot be
    converted; "not installed" where torch is absent)."""
    try:
        torch = load_torch()
    except ImportError:
        return {}, {}, NOT_INSTALLED
    info: dict = {**versions(), "converter": "fusesearch (canonical ONNX, static shapes, constants folded)",
                  "inductor": {"freezing": True, "inference_mode": True}, "device": "cuda" if cuda else "cpu"}
    device = "cuda" if cuda else "cpu"
    try:
        module = convert(model, weights).to(device)
        args = [_tensor(torch, feeds[n], f"input '{n}'").to(device) for n in module.inputs]
    except Unconvertible as exc:
        return {}, {}, {**info, "refused": str(exc)}
    from fusesearch.verify import compare

    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    expected = {t: reference[t] for t in module.outputs}
    runs, failed, notes = {}, {}, {}
    for name, mode in {"torch_eager": None, **modes}.items():
        try:
            if mode is None:
                fn = module
                with torch.inference_mode():
                    got = fn(*args)
            else:
                fn, got = _first_compile(module, mode, args, lambda why, name=name: notes.setdefault(name, why))
        except Exception as exc:  # noqa: BLE001 -- a compiler's failure is reported, never raised
            failed[name] = _first_line(exc)
            continue
        diffs = compare(expected, {t: v.detach().float().cpu().numpy() if v.is_floating_point()
                                   else v.cpu().numpy() for t, v in zip(module.outputs, got, strict=True)},
                        rtol=rtol)
        bad = [d for d in diffs if not d.ok]
        if bad:
            failed[name] = f"differs from ONNX Runtime: output '{bad[0].name}' max rel err {bad[0].max_rel:.3g}"
            continue

        def once(fn=fn):
            with torch.inference_mode():
                return fn(*args)
        runs[name] = once
    if notes:
        info["retried"] = notes
    if failed:
        info["failed"] = failed
    clocks = {name: CudaEventClock(torch) for name in runs} if cuda else {}
    return runs, clocks, info


@contextmanager
def torch_threads(threads: int):
    """torch's intra-op thread count is `threads` inside, the caller's again after (nothing where
    torch is not installed)."""
    try:
        torch = load_torch()
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
