"""The value-at-index expression emitter: `value(t, idx)` is the C expression of tensor `t` at a
multi-index, built from its producer inside the group through the op tables (`ops._op`), down to
loads of the kernel's inputs.

Invariants: temporaries are memoized per (tensor, index) in the innermost scope that holds them,
so a diamond computes its shared value once; a one-element float/int64 constant is a literal;
temporaries have the compute type (float for half tensors) and loads of half arguments widen.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

from fusesearch.backends.codegen.base import (
    CTYPES,
    HALF_DTYPES,
    Arg,
    CodegenRefused,
    _lit,
    compute_ctype,
    load_expr,
)
from fusesearch.backends.codegen.ops import _op, reshape_blocks
from fusesearch.ir.graph import Graph, Node, TensorInfo
from fusesearch.layout import Layout
from fusesearch.lowering import Kernel
from fusesearch.schedule import gelu_chains, scaled_product

_TEMP = re.compile(r"\bv\d+\b")
_DECL = re.compile(r"^long long (v\d+) = ")


class _Emitter:
    def __init__(self, graph: Graph, kernel: Kernel, args: dict[str, Arg]) -> None:
        self.graph = graph
        self.members = set(kernel.nodes)
        self.gelus = gelu_chains(graph, self.members)  # the GELUs written as one call each
        anchor = graph.nodes[kernel.anchor] if kernel.anchor is not None else None
        # C: the product's scale packed into B, and the scaled tensor → the anchor's output, which holds it
        self.scaled = scaled_product(graph, self.members, anchor, kernel.schedule.product) if anchor is not None else None
        self.product_as = {self.scaled.tensor: anchor.outputs[0]} if self.scaled is not None else {}
        self.args = args
        self.lines: list[str] = []
        self.scopes: list[dict[tuple[str, tuple[str, ...]], str]] = [{}]
        self.count = 0
        self.row_scalars: dict[str, str] = {}  # rowwise: reduced tensor → per-row variable
        self.row_ops: dict[str, object] = {}  # rowwise: Softmax/LayerNorm output → f(idx[, x value]) -> expr
        self.row_sources: dict[str, str] = {}  # rowwise: Softmax/LayerNorm output → its input
        self.hoisted = ""  # C only: a buffer holding the anchor's activation operand for this row
        self.hoisted_acc = ""  # C only: MatMul/Gemm accumulators of this row, indexed by column
        self.acc_value = ""  # CUDA tiled: the anchor's value at the epilogue's element (a register)
        self.vec_loads: dict[str, str] = {}  # CUDA vectorized: tensor → this lane of its float4
        self.materialized: frozenset[str] = frozenset()  # C: computed tensors read from a buffer
        self.window_clamp = False  # C loop nests: a pool tap reads a clamped position and selects, no branch
        self.window_cols = ""  # C: the column loop variable ...
        self.window_interior: frozenset[int] = frozenset()  # ... inside these pools' interior (no column checks)
        self.pinned: dict[str, int] = {}  # C: Concat output → the one input the current loop reads
        # indices `unflatten` split (their temporaries' names) → (the flat index, the extents), so
        # that `flat` over the same extents reads the flat index back instead of re-linearising
        self.unflattened: dict[tuple[str, ...], tuple[str, tuple[int, ...]]] = {}
        # rowwise: tensor → (flat index of its element at the current (r, j), that element in the
        # row an earlier pass cached): read back instead of computed again
        self.row_cache: dict[str, tuple[str, str]] = {}
        # the kernel arguments stored in a layout other than the model's (`Arg.layout`: a GPU conv's
        # NHWC; the C NCHWc kernels set theirs), and channel indices the C NCHWc loops hold as
        # (block, lane) already, read as such, with no division
        self.layouts: dict[str, Layout] = {a.tensor: a.layout for a in args.values() if a.layout.channels_last}
        self.channel_split: dict[str, tuple[str, str]] = {}

    # scopes and temporaries
    def tmp(self, ctype: str, expr: str) -> str:
        self.count += 1
        name = f"v{self.count}"
        self.lines.append(f"{ctype} {name} = {expr};")
        return name

    def push(self) -> None:
        self.scopes.append({})

    def pop(self) -> None:
        self.scopes.pop()

    def _memo(self, key):
        for scope in reversed(self.scopes):
            if key in scope:
                return scope[key]
        return None

    def info(self, tensor: str) -> TensorInfo:
        return self.graph.tensors[tensor]

    def ctype(self, tensor: str) -> str:
        dtype = self.info(tensor).dtype
        if dtype not in CTYPES:
            raise CodegenRefused(f"dtype {dtype} of '{tensor}' has no C type here")
        return compute_ctype(dtype)

    # values
    def value(self, tensor: str, idx: tuple[str, ...]) -> str:
        tensor = self.product_as.get(tensor, tensor)
        if tensor in self.row_scalars:
            return self.row_scalars[tensor]
        cached = self.row_cache.get(tensor)
        if cached is not None and self.flat(idx, self.info(tensor).shape) == cached[0]:
            return cached[1]
        key = (tensor, idx)
        found = self._memo(key)
        if found is not None:
            return found
        producer = self.graph.producer(tensor)
        literal = self.scalar_literal(tensor)
        if literal is not None:
            return literal
        if tensor in self.row_ops:
            expr = self.row_ops[tensor](idx)
        elif producer is None or producer not in self.members or tensor in self.materialized:
            expr = self.load(tensor, idx)
        else:
            expr = _op(self, self.graph.nodes[producer], tensor, idx)
        name = self.tmp(self.ctype(tensor), expr)
        self.scopes[-1][key] = name
        return name

    def scalar_literal(self, tensor: str) -> str | None:
        """A one-element float32/int64 constant as a literal in the source (folded by the compiler)."""
        value = self.graph.constant_value(tensor)
        if value is None or value.size != 1 or self.info(tensor).dtype not in ("float32", "int64", *HALF_DTYPES):
            return None
        x = value.reshape(-1)[0]
        return f"{int(x)}LL" if self.info(tensor).dtype == "int64" else _lit(float(x))

    def load(self, tensor: str, idx: tuple[str, ...]) -> str:
        if tensor in self.vec_loads:
            return self.vec_loads[tensor]
        arg = self.args[tensor]
        return load_expr(arg.dtype, f"{arg.name}[{self.at(tensor, idx)}]")

    def at(self, tensor: str, idx: Sequence[str]) -> str:
        """The offset of `tensor`'s element at the logical index `idx` as its argument lies: the
        flat index, in a blocked layout ((n, c / b, h, w), c % b) over the padded channels, in
        NHWC ((n, h, w), c)."""
        shape, layout = self.info(tensor).shape, self.layouts.get(tensor)
        if layout is None or not layout.blocked:
            return self.flat(idx, shape)
        if layout.channels_last:  # ((n, h, w), c): a pixel's channels contiguous
            (n, c, h, w), (_, channels, height, width) = idx, shape
            return f"((({n}) * {height}LL + ({h})) * {width}LL + ({w})) * {channels}LL + ({c})"
        (n, c, h, w), (_, channels, height, width), b = idx, shape, layout.block
        blk, lane = self.channel_split.get(c, (f"({c}) / {b}LL", f"({c}) % {b}LL"))
        return (f"((({n}) * {layout.channels(channels) // b}LL + {blk}) * {height * width}LL + ({h}) * {width}LL + ({w}))"
                f" * {b}LL + {lane}")

    def flat(self, idx: Sequence[str], shape: Sequence[int]) -> str:
        if not shape:
            return "0"
        idx, shape = self._rejoin(tuple(idx), tuple(shape))
        terms, stride = [], 1
        for i, d in zip(reversed(idx), reversed(shape), strict=True):
            if d != 1:
                terms.append(i if stride == 1 else f"({i})*{stride}LL")
            stride *= d
        return " + ".join(reversed(terms)) or "0"

    def unflatten(self, flat: str, shape: Sequence[int]) -> tuple[str, ...]:
        if 0 in shape:  # an empty tensor: its loop never runs
            return ("0",) * len(shape)
        out, stride, outer = [], math.prod(shape), True  # flat < |shape|: the outermost index needs no modulo
        for d in shape:
            stride //= d
            if d == 1:
                out.append("0")
                continue
            div = f"({flat}) / {stride}LL" if stride > 1 else f"({flat})"
            out.append(flat if outer and stride == 1 else self.tmp("long long", div if outer else f"{div} % {d}LL"))
            outer = False
        if sum(d > 1 for d in shape) > 1:
            self.unflattened[tuple(out)] = (flat, tuple(shape))
        return tuple(out)

    def over_flat(self, flat: str, shape: Sequence[int], build) -> tuple[list[str], list[str]] | None:
        """(statements, values) of `build(idx)`, idx the split of the flat index `flat` over
        `shape` (`unflatten`), emitted from an empty statement list in a scope of their own; None
        where a statement or a value still reads a part of the split, so that a loop over `flat`
        would divide it. Otherwise every load re-linearised the split (`_rejoin`) and its
        temporaries are left out."""
        self.lines = []
        self.push()
        idx = self.unflatten(flat, shape)
        values = build(idx)
        self.pop()
        names = {x for x in idx if _TEMP.fullmatch(x)}
        kept = [x for x in self.lines if not ((m := _DECL.match(x)) and m.group(1) in names)]
        if names & set(_TEMP.findall(" ".join([*kept, *values]))):
            return None
        return kept, values

    def _rejoin(self, idx: tuple[str, ...], shape: tuple[int, ...]) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """`idx` over `shape` with each run that `unflatten` split over the same extents put back as
        its flat index over one merged extent: the same position (the outermost split index has
        no modulo, so the run re-linearises to the flat index exactly), with no division left for
        the compiler to keep (the split temporaries go unused and are dropped)."""
        for names, (flat, dims) in self.unflattened.items():
            k = len(names)
            for p in range(len(idx) - k + 1):
                if idx[p:p + k] == names and shape[p:p + k] == dims:
                    idx = idx[:p] + (f"({flat})",) + idx[p + k:]
                    shape = shape[:p] + (math.prod(dims),) + shape[p + k:]
                    break
        return idx, shape

    def view_index(self, idx: tuple[str, ...], shape: Sequence[int], view: Sequence[int]) -> tuple[str, ...]:
        """The multi-index into `view` of the element at `idx` in `shape` (same size, same flat
        position): each run of dimensions the two share (`ops.reshape_blocks`) linearised and split
        on its own, so a merge needs no division and a split divides one index, not the flat one."""
        shape, view = tuple(shape), tuple(view)
        if shape == view:
            return tuple(idx)
        blocks = reshape_blocks(view, shape)
        if blocks is None:
            return self.unflatten(self.flat(idx, shape), view)
        out: tuple[str, ...] = ()
        for v, s in blocks:
            out += self.unflatten(self.flat(idx[s], shape[s]), view[v])
        return out

    def broadcast(self, idx: tuple[str, ...], shape: Sequence[int]) -> tuple[str, ...]:
        """Index into an input of `shape` broadcast to the output's index (numpy rules)."""
        tail = idx[len(idx) - len(shape):] if shape else ()
        return tuple("0" if d == 1 else i for i, d in zip(tail, shape, strict=True))

    def input_at(self, node: Node, k: int, idx: tuple[str, ...]) -> str:
        t = node.inputs[k]
        return self.value(t, self.broadcast(idx, self.info(t).shape))

    def const(self, tensor: str) -> np.ndarray:
        value = self.graph.constant_value(tensor) if tensor else None
        if value is None:
            raise CodegenRefused(f"'{tensor}' must be a small constant to generate code")
        return value
