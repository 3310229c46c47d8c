"""cuDNN convolutions on a GPU: which route plans price and programs run, and each route's runner.

Problem: a GPU user's conv is cuDNN's, and cuDNN's conv + bias + activation graph ("library, fused
epilogue", as ONNX Runtime's FusedConv) is one more choice a fused kernel must beat; CuPy 14 has
no cuDNN bindings, and CI has no GPU.
Approach: routes, preferred first: the cuDNN Frontend package (takes CuPy's device pointers, builds
conv_fprop + bias + activation as one graph), PyTorch's conv over DLPack-shared buffers (the
epilogue as further launches), the named fallback im2col + cuBLAS through CuPy (no fused choice;
the lone conv priced with its panel's round trip, `lowering.conv_routed`). Plans price cuDNN
unless `FUSESEARCH_CONV_LIBRARY` names a route (`conv_route`: the GPU's library, not what the
planning machine has); programs run by the installed route (`run_route`), refusing a cuDNN plan
where none is installed. `conv_runner` runs a conv group's call on device arrays.
Invariants: no import of cupy here (the caller passes it); cudnn is imported only in its runner,
torch through `torch_baseline.load_torch`; packages are looked up without importing them."""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fusesearch.errors import BadInput

ROUTES = ("cudnn-frontend", "torch", "im2col")  # preferred first
ROUTE_ENV = "FUSESEARCH_CONV_LIBRARY"
INSTALL_HINT = "pip install 'fusesearch[gpu]' (nvidia-cudnn-frontend)"
_MODULES = {"cudnn-frontend": "cudnn", "torch": "torch"}


@dataclass(frozen=True)
class ConvRoute:
    """How a GPU conv's library call runs (`ROUTES`), and why (a fallback names what is missing)."""

    name: str
    reason: str

    @property
    def cudnn(self) -> bool:
        return self.name != "im2col"


@functools.cache
def conv_route() -> ConvRoute:
    """The route plans price: `ROUTE_ENV` where set, else cuDNN's Frontend, whatever this machine
    has installed (a plan is priced for the GPU, which is often not the machine that plans)."""
    named = os.environ.get(ROUTE_ENV, "").strip()
    if named:
        if named not in ROUTES:
            raise BadInput(f"{ROUTE_ENV}={named!r}: expected one of {', '.join(ROUTES)}; unset it to plan with cuDNN")
        if named == "im2col":
            return ConvRoute(named, f"{ROUTE_ENV}=im2col: convs run as im2col + cuBLAS through CuPy")
        return ConvRoute(named, f"{ROUTE_ENV}={named}")
    return ConvRoute(ROUTES[0], f"a GPU's cuDNN (set {ROUTE_ENV}=im2col to plan without it)")


@functools.cache
def installed_route() -> ConvRoute:
    """The first of ROUTES whose package this machine has (looked up, not imported)."""
    for name in ROUTES[:-1]:
        if importlib.util.find_spec(_MODULES[name]) is not None:
            return ConvRoute(name, f"the {_MODULES[name]} package is installed")
    return ConvRoute("im2col", f"neither nvidia-cudnn-frontend nor torch is installed; {INSTALL_HINT}")


def run_route() -> str:
    """The route this process runs a planned conv call by: the im2col fallback where plans price
    it, else the installed cuDNN route; a plan priced with cuDNN on a machine without one is a
    BadInput (running it as im2col would not be the kernel the plan priced)."""
    planned, here = conv_route(), installed_route()
    if not planned.cudnn:
        return planned.name
    if not here.cudnn:
        raise BadInput(f"the plan runs its convs as cuDNN calls, but {here.reason}; "
                       f"or plan with {ROUTE_ENV}=im2col")
    return here.name


@dataclass(frozen=True)
class ConvCall:
    """One conv group's library call, in array terms: the Conv's attributes, its x, w and bias
    (a Conv's B or the epilogue's Add constant, as a 1-D per-channel vector; None for none), the
    activation ("" for none)."""

    attrs: Mapping[str, Any]
    activation: str = ""


def conv_call(graph, kernel) -> tuple[ConvCall, str, str, str | None, str] | None:
    """(the call, x, w, bias or None, y: tensor names) of a conv group a plan runs as a library
    call (`Schedule.library`: cuDNN's conv, its fused graph, the im2col fallback); None for any
    other kernel."""
    from fusesearch.schedule import cudnn_epilogue

    if not kernel.schedule.library:
        return None
    node = graph.nodes[kernel.anchor]
    epilogue = cudnn_epilogue(graph, kernel.nodes, node)
    return ConvCall(node.attrs, epilogue.activation), node.inputs[0], node.inputs[1], epilogue.bias or None, epilogue.output


def _spatial(attrs: Mapping[str, Any], x_shape: Sequence[int], w_shape: Sequence[int]):
    from fusesearch.backends.arraylib import _spatial_attrs

    return _spatial_attrs(attrs, x_shape[2:], w_shape[2:])


def conv_runner(route: str, cupy, call: ConvCall, x, w, bias, y, stream=None) -> Callable[[], None]:
    """A launch of the conv group's library call writing `y` (device arrays, NCHW) by `route`:
    one cuDNN graph (conv_fprop, add bias, activation) through the cuDNN Frontend, PyTorch's conv on
    the buffers shared by DLPack, or im2col + cuBLAS (`arraylib`) with the epilogue as CuPy ops."""
    if route == "cudnn-frontend":
        return _frontend_runner(cupy, call, x, w, bias, y, stream)
    if route == "torch":
        return _torch_runner(call, x, w, bias, y)
    return _im2col_runner(cupy, call, x, w, bias, y)


def _activate(xp, activation: str, v):
    if activation == "Relu":
        return xp.maximum(v, v.dtype.type(0))
    if activation == "Sigmoid":
        return 1 / (1 + xp.exp(-v))
    if activation == "Tanh":
        return xp.tanh(v)
    return v


def _im2col_runner(xp, call: ConvCall, x, w, bias, y) -> Callable[[], None]:
    from fusesearch.backends import arraylib

    def go() -> None:
        (out,) = arraylib.run(xp, "Conv", call.attrs, [x, w, None], 1)
        if bias is not None:
            out = out + bias.reshape(1, -1, *([1] * (out.ndim - 2)))
        y[...] = _activate(xp, call.activation, out).astype(y.dtype, copy=False)

    return go


def _torch_runner(call: ConvCall, x, w, bias, y) -> Callable[[], None]:
    from fusesearch.backends.torch_baseline import load_torch

    torch = load_torch()
    F = torch.nn.functional
    tx, tw, ty = (torch.from_dlpack(a) for a in (x, w, y))
    tb = torch.from_dlpack(bias).reshape(-1) if bias is not None else None
    strides, dilations, begin, end = _spatial(call.attrs, x.shape, w.shape)
    group = int(call.attrs.get("group", 1))
    symmetric = begin == end
    act = {"Relu": torch.relu, "Sigmoid": torch.sigmoid, "Tanh": torch.tanh}.get(call.activation)

    def go() -> None:
        xin = tx if symmetric else F.pad(tx, [p for b, e in zip(begin[::-1], end[::-1], strict=True) for p in (b, e)])
        out = F.conv2d(xin, tw, tb, stride=strides, padding=begin if symmetric else 0, dilation=dilations, groups=group)
        ty.copy_(act(out) if act else out)

    return go


_FRONTEND_TYPES = {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BFLOAT16"}


def _frontend_runner(cupy, call: ConvCall, x, w, bias, y, stream) -> Callable[[], None]:
    """One cuDNN Frontend graph over the device pointers: conv_fprop (float accumulation; TF32
    allowed for float32 as cuBLAS's calls are), + bias (broadcast per channel), the activation,
    its output strided as y (NCHW). Built once (heuristics A, then fallback); a workspace
    allocated once."""
    import cudnn

    dtype = str(y.dtype) if str(y.dtype) in _FRONTEND_TYPES else "bfloat16"
    io = getattr(cudnn.data_type, _FRONTEND_TYPES[dtype])
    handle = cudnn.create_handle()
    if stream is not None:
        cudnn.set_stream(handle=handle, stream=stream.ptr)
    graph = cudnn.pygraph(handle=handle, io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)

    def tensor(a, dims=None):
        dims = list(dims or a.shape)
        strides = [int(s) // a.itemsize for s in a.strides] if dims == list(a.shape) else _packed(dims)
        return graph.tensor(dim=dims, stride=strides, data_type=io)

    strides, dilations, begin, end = _spatial(call.attrs, x.shape, w.shape)
    if begin != end:
        raise ValueError("cuDNN Frontend conv: asymmetric padding")
    tx, tw = tensor(x), tensor(w)
    out = graph.conv_fprop(image=tx, weight=tw, padding=begin, stride=strides, dilation=dilations,
                           compute_data_type=cudnn.data_type.FLOAT)
    tb = None
    if bias is not None:
        tb = tensor(bias, [1, int(bias.size), 1, 1])
        out = graph.bias(input=out, bias=tb)
    if call.activation == "Relu":
        out = graph.relu(input=out)
    elif call.activation == "Sigmoid":
        out = graph.sigmoid(input=out)
    elif call.activation == "Tanh":
        out = graph.tanh(input=out)
    out.set_output(True).set_data_type(io).set_dim(list(y.shape)).set_stride(_packed(list(y.shape)))
    graph.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    workspace = cupy.empty(max(1, graph.get_workspace_size()), dtype=cupy.uint8)
    pack = {tx: x, tw: w, out: y, **({tb: bias} if tb is not None else {})}  # CuPy arrays, as they are

    def go() -> None:
        graph.execute(pack, workspace, handle=handle)

    return go


def _packed(dims: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for d in reversed(dims):
        strides.append(step)
        step *= int(d)
    return strides[::-1]
