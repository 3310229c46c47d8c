"""Code generation: one C-like kernel body per Kernel, wrapped by a C/OpenMP or a CUDA skeleton.

Problem: every chosen group must become one real kernel that runs on real data, on a GPU (CUDA)
and, so that everything but the launch skeleton is exercised without one, on the CPU (C).
Approach (as TVM's compute inlining): the value of a tensor at a multi-index is an expression
built from its producer inside the group — `value(t, idx)` recurses through elementwise and
broadcast ops (same / broadcast index), injective ops (index remapping: Reshape via the flat
index, Transpose, Slice, Gather/GatherND/GatherElements, Concat, Split, Expand, Tile,
DepthToSpace/SpaceToDepth, ReverseSequence; guarded reads: Pad (constant / edge / reflect /
wrap; negative pads crop), CenterCropPad, Trilu; Resize nearest, and linear as the weighted sum of
its 2^axes neighbours) down to loads of the kernel's inputs. Temporaries are memoized per
(tensor, index) inside a scope, so a diamond computes its shared value once. `GENERATED_OPS` names
every op with code (a test holds it to every op OpKind calls fusible, less a listed few). The
emitted statements are the same text in both languages; only the skeleton around them differs:

    pointwise  for every output O: for i in [0, |O|): O[i] = value(O, unflatten(i))
               C: `#pragma omp parallel for` · CUDA: a grid-stride loop, or, when every op is
               elementwise/broadcast over float32 outputs of one shape with |S| % 4 == 0, four
               elements per thread with float4 loads and stores (`vectorized`)
    rowwise    for every row r: per-row scalars (sums / maxima over the row, each a loop over
               j in [0, L)), then the outputs (row-sized ones once, full ones over j)
               C: parallel over rows, plain j loops · CUDA: a block per row, j strided by
               threads, block reductions (warp shuffles + shared memory); a computed row read by
               several passes (a GEMM's output under a Softmax) is cached on its first pass (C: a
               local buffer, CUDA: shared memory), so its dot products run once
    gemm/conv  C, with a BLAS (`FS_BLAS_SGEMM`, scipy-openblas32; measured faster than our own
               loops and within noise of ONNX Runtime's MLAS, benchmarks/bench_cpu.py): MatMul/Gemm
               per block of output rows of one batch (a block per thread) — the A rows with the prologue
               applied packed into a panel (B too when the group computes it, e.g. the transposed
               keys of attention), one sgemm into a block tile, the epilogue over the tile while it
               is in cache, before the one store; Conv as implicit GEMM per block of whole output
               rows of one image and group — the im2col panel (prologue and zero padding applied;
               a 1x1 stride-1 conv reads its input in place) times the group's filters, then the
               epilogue; depthwise convs in their own loop (a vectorized row of output pixels, taps
               unrolled, bounds checks only at the borders). Without a BLAS (`#else`): per output
               row, the activation operand's row (prologue applied) into a buffer, then i-k-j
               accumulation and the epilogue per column. Blocks run in parallel (OpenMP), the BLAS
               single-threaded inside each · CUDA (`tiled`): the anchor as
               z independent GEMMs (MatMul batch, Conv group; Conv as implicit GEMM), a block per
               BM×BN output tile, A and B staged per K step in shared memory with the prologue
               applied in the tile loads, a register micro-tile per thread, the epilogue applied
               to the registers before the one store. Epilogues that move elements (a Transpose
               after the product), ConvTranspose and 1-D operands use the `direct` skeleton: a
               thread per output element with its dot product inline. (A Softmax epilogue makes
               the group a row kernel, above.)

The opaque template is not generated (`generate` refuses it with a reason: a library call).
C loops carry `omp simd` (with reduction clauses for row reductions and dot products) and, where
the C library has vector math (FS_VECTOR_MATH: glibc's libmvec), call exp/log/tanh/erf's vector
variants; one-element constants are literals in the source (Pow by 2, 3, 0.5 become products or a
square root; division by a constant a multiplication by its reciprocal); the index of a row
element is the row's (hoisted by the compiler) and the column's, with no per-element division.
Invariants: the source is a pure function of (graph, kernel), so its hash keys every cache (the
backend's flags select between its `#ifdef` paths and key its binary cache);
arguments are the kernel's external inputs then outputs, in the Kernel's order; compute is
float32 (float tensors), int64 (indices) or uint8 (bool).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from fusesearch.candidates.rules import FusionDecision
from fusesearch.ir.graph import Graph, Node, TensorInfo
from fusesearch.lowering import MAX_GRID_X, MAX_ROW_SMEM, Kernel

CTYPES = {"float32": "float", "int64": "long long", "int32": "int", "bool": "unsigned char"}
NP_DTYPES = {"float32": np.float32, "int64": np.int64, "int32": np.int32, "bool": np.bool_}  # same keys
SUPPORTED_TEMPLATES = ("pointwise", "rowwise", "gemm", "conv")
THREADS = 256  # CUDA threads per block, every skeleton
MAX_STRIDE_BLOCKS = 65535 * 8
MAX_GRID_YZ = 65535


class CodegenRefused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.decision = FusionDecision.refuse(reason)


@dataclass(frozen=True)
class Arg:
    name: str  # C identifier: in0, in1, ..., out0, ...
    tensor: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def ctype(self) -> str:
        return CTYPES[self.dtype]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GeneratedKernel:
    name: str
    template: str
    inputs: tuple[Arg, ...]
    outputs: tuple[Arg, ...]
    c_source: str
    cuda_source: str
    rows: int = 0  # rowwise: rows and row length
    row_length: int = 0
    source_hash: str = field(default="")
    grid: tuple[int, int, int] = (1, 1, 1)  # the CUDA launch (CuPy and the emulator use it as is)
    block: tuple[int, int, int] = (256, 1, 1)
    skeleton: str = ""  # CUDA: grid-stride | vectorized | block-per-row | tiled | direct


# -- the expression emitter -------------------------------------------------------------------

def _lit(value: float) -> str:
    if value != value:
        return "NAN"
    if value in (float("inf"), float("-inf")):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    return f"{float(value)!r}f".replace("e+", "e")


class _Emitter:
    def __init__(self, graph: Graph, kernel: Kernel, args: dict[str, Arg]) -> None:
        self.graph = graph
        self.members = set(kernel.nodes)
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
        return CTYPES[dtype]

    # values
    def value(self, tensor: str, idx: tuple[str, ...]) -> str:
        if tensor in self.row_scalars:
            return self.row_scalars[tensor]
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
        if value is None or value.size != 1 or self.info(tensor).dtype not in ("float32", "int64"):
            return None
        x = value.reshape(-1)[0]
        return _lit(float(x)) if self.info(tensor).dtype == "float32" else f"{int(x)}LL"

    def load(self, tensor: str, idx: tuple[str, ...]) -> str:
        if tensor in self.vec_loads:
            return self.vec_loads[tensor]
        shape = self.info(tensor).shape
        return f"{self.args[tensor].name}[{self.flat(idx, shape)}]"

    def flat(self, idx: Sequence[str], shape: Sequence[int]) -> str:
        if not shape:
            return "0"
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
        return tuple(out)

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


# -- ops --------------------------------------------------------------------------------------

_UNARY = {
    "Relu": "FS_FMAX({0}, 0.0f)", "Neg": "(-{0})", "Abs": "fabsf({0})", "Exp": "expf({0})", "Log": "logf({0})",
    "Sqrt": "sqrtf({0})", "Erf": "erff({0})", "Tanh": "tanhf({0})", "Sigmoid": "(1.0f / (1.0f + expf(-{0})))",
    "Reciprocal": "(1.0f / {0})", "Floor": "floorf({0})", "Ceil": "ceilf({0})", "Sin": "sinf({0})",
    "Cos": "cosf({0})", "Softsign": "({0} / (1.0f + fabsf({0})))",
    "HardSwish": "({0} * FS_FMIN(FS_FMAX({0} + 3.0f, 0.0f), 6.0f) / 6.0f)", "Not": "(!{0})",
    "Sign": "(float)(({0} > 0) - ({0} < 0))", "Round": "nearbyintf({0})",
}
_BINARY = {"Add": "({0} + {1})", "Sub": "({0} - {1})", "Mul": "({0} * {1})", "Div": "({0} / {1})",
           "Pow": "powf({0}, {1})", "Max": "FS_FMAX({0}, {1})", "Min": "FS_FMIN({0}, {1})",
           "Equal": "({0} == {1})", "Less": "({0} < {1})", "Greater": "({0} > {1})",
           "LessOrEqual": "({0} <= {1})", "GreaterOrEqual": "({0} >= {1})", "And": "({0} && {1})",
           "Or": "({0} || {1})", "Xor": "(!{0} != !{1})"}
_VARIADIC = {"Sum": "+", "Max": "FS_FMAX", "Min": "FS_FMIN", "Mean": "+"}


def _op(e: _Emitter, node: Node, tensor: str, idx: tuple[str, ...]) -> str:
    op = node.op_type
    if op in _UNARY:
        return _UNARY[op].format(e.input_at(node, 0, idx))
    if op in ("Sum", "Mean") or (op in ("Max", "Min") and len(node.inputs) != 2):
        return _variadic(e, node, idx)
    if op in ("Pow", "Div") and e.info(tensor).dtype == "float32":
        special = _by_constant(e, node, idx)
        if special is not None:
            return special
    if op in _BINARY:
        return _BINARY[op].format(e.input_at(node, 0, idx), e.input_at(node, 1, idx))
    handler = _HANDLERS.get(op)
    if handler is None:
        raise CodegenRefused(f"{node.name}({op}) has no code generator yet")
    return handler(e, node, tensor, idx)


def _by_constant(e: _Emitter, node: Node, idx) -> str | None:
    """Pow by a constant 1, 2, 3, 0.5 or -1 as multiplications / sqrtf; division by a constant as
    multiplication by its reciprocal (at most one rounding more: far inside verify's tolerance)."""
    c = e.graph.constant_value(node.inputs[1])
    if c is None or c.size != 1:
        return None
    c = float(c.reshape(-1)[0])
    if node.op_type == "Div":
        return f"({e.input_at(node, 0, idx)} * {_lit(1.0 / c)})" if c != 0 and math.isfinite(1.0 / c) else None
    forms = {1.0: "{0}", 2.0: "({0} * {0})", 3.0: "({0} * {0} * {0})", 0.5: "sqrtf({0})", -1.0: "(1.0f / {0})"}
    return forms[c].format(e.input_at(node, 0, idx)) if c in forms else None


def _variadic(e: _Emitter, node: Node, idx) -> str:
    vals = [e.input_at(node, k, idx) for k in range(len(node.inputs)) if node.inputs[k]]
    if node.op_type in ("Sum", "Mean"):
        expr = "(" + " + ".join(vals) + ")"
        return f"({expr} / {len(vals)}.0f)" if node.op_type == "Mean" else expr
    fn = _VARIADIC[node.op_type]
    expr = vals[0]
    for v in vals[1:]:
        expr = f"{fn}({expr}, {v})"
    return expr


def _leaky(e, n, t, idx):
    x = e.input_at(n, 0, idx)
    return f"({x} >= 0.0f ? {x} : {_lit(n.attrs.get('alpha', 0.01))} * {x})"


def _elu(e, n, t, idx):
    x = e.input_at(n, 0, idx)
    return f"({x} >= 0.0f ? {x} : {_lit(n.attrs.get('alpha', 1.0))} * (expf({x}) - 1.0f))"


def _gelu(e, n, t, idx):
    x = e.input_at(n, 0, idx)
    if n.attrs.get("approximate", "none") == "tanh":
        return f"(0.5f * {x} * (1.0f + tanhf(0.7978845608f * ({x} + 0.044715f * {x} * {x} * {x}))))"
    return f"(0.5f * {x} * (1.0f + erff({x} * 0.7071067811865476f)))"


def _clip(e, n, t, idx):
    x = e.input_at(n, 0, idx)
    lo = n.attrs.get("min") if "min" in n.attrs else None
    hi = n.attrs.get("max") if "max" in n.attrs else None
    if len(n.inputs) > 1 and n.inputs[1]:
        lo = float(e.const(n.inputs[1]).reshape(-1)[0])
    if len(n.inputs) > 2 and n.inputs[2]:
        hi = float(e.const(n.inputs[2]).reshape(-1)[0])
    expr = x
    if lo is not None:
        expr = f"FS_FMAX({expr}, {_lit(lo)})"
    if hi is not None:
        expr = f"FS_FMIN({expr}, {_lit(hi)})"
    return expr


def _cast(e, n, t, idx):
    return f"({e.ctype(t)})({e.input_at(n, 0, idx)})"


def _where(e, n, t, idx):
    return f"({e.input_at(n, 0, idx)} ? {e.input_at(n, 1, idx)} : {e.input_at(n, 2, idx)})"


def _reshape(e, n, t, idx):
    src = n.inputs[0]
    flat = e.flat(idx, e.info(t).shape)
    return e.value(src, e.unflatten(flat, e.info(src).shape))


def _transpose(e, n, t, idx):
    rank = len(idx)
    perm = n.attrs.get("perm") or tuple(reversed(range(rank)))
    src_idx = ["0"] * rank
    for out_axis, in_axis in enumerate(perm):
        src_idx[in_axis] = idx[out_axis]
    return e.value(n.inputs[0], tuple(src_idx))


def _slice(e, n, t, idx):
    src = n.inputs[0]
    shape = e.info(src).shape
    starts, ends = e.const(n.inputs[1]).reshape(-1), e.const(n.inputs[2]).reshape(-1)
    axes = e.const(n.inputs[3]).reshape(-1) if len(n.inputs) > 3 and n.inputs[3] else range(len(starts))
    steps = e.const(n.inputs[4]).reshape(-1) if len(n.inputs) > 4 and n.inputs[4] else [1] * len(starts)
    src_idx = list(idx)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        axis = int(axis) % len(shape)
        begin = slice(int(start), int(end), int(step)).indices(shape[axis])[0]
        src_idx[axis] = f"({begin}LL + ({idx[axis]}) * {int(step)}LL)"
    return e.value(src, tuple(src_idx))


def _gather(e, n, t, idx):
    data, indices = n.inputs[0], n.inputs[1]
    axis = int(n.attrs.get("axis", 0)) % len(e.info(data).shape)
    q = len(e.info(indices).shape)
    raw = e.value(indices, tuple(idx[axis:axis + q]))
    dim = e.info(data).shape[axis]
    pos = e.tmp("long long", f"({raw} < 0 ? {raw} + {dim}LL : (long long)({raw}))")
    return e.value(data, tuple(idx[:axis]) + (pos,) + tuple(idx[axis + q:]))


def _concat(e, n, t, idx):
    rank = len(idx)
    axis = int(n.attrs.get("axis", 0)) % rank
    parts = [x for x in n.inputs if x]
    offsets, offset = [], 0
    for x in parts:
        offsets.append(offset)
        offset += e.info(x).shape[axis]
    result = e.tmp(e.ctype(t), "0")
    for k, (x, off) in enumerate(zip(parts, offsets, strict=True)):
        hi = off + e.info(x).shape[axis]
        cond = f"{idx[axis]} < {hi}LL"
        e.lines.append(("if" if k == 0 else "else if") + f" ({cond}) {{" if k < len(parts) - 1 else "else {")
        e.push()
        local = idx[:axis] + (f"({idx[axis]} - {off}LL)",) + idx[axis + 1:]
        e.lines.append(f"{result} = {e.value(x, local)};")
        e.pop()
        e.lines.append("}")
    return result


def _split(e, n, t, idx):
    axis = int(n.attrs.get("axis", 0)) % len(idx)
    k = n.outputs.index(t)
    offset = sum(e.info(o).shape[axis] for o in n.outputs[:k])
    src_idx = idx[:axis] + (f"({idx[axis]} + {offset}LL)",) + idx[axis + 1:]
    return e.value(n.inputs[0], src_idx)


def _expand(e, n, t, idx):
    return e.input_at(n, 0, idx)


def _resize(e, n, t, idx):
    mode = n.attrs.get("mode", "nearest")
    if mode == "linear":
        return _resize_linear(e, n, t, idx)
    if mode != "nearest":
        raise CodegenRefused(f"{n.name}(Resize) mode {mode} has no code generator yet")
    src = n.inputs[0]
    in_shape, out_shape = e.info(src).shape, e.info(t).shape
    rounding = n.attrs.get("nearest_mode", "round_prefer_floor")
    src_idx = []
    for i, din, dout, scale in zip(idx, in_shape, out_shape, _resize_scales(e, n, in_shape, out_shape), strict=True):
        if din == dout and scale == 1.0:
            src_idx.append(i)
            continue
        x = _resize_coordinate(n, i, din, dout, scale)
        r = {"floor": f"floorf({x})", "ceil": f"ceilf({x})", "round_prefer_floor": f"ceilf({x} - 0.5f)",
             "round_prefer_ceil": f"floorf({x} + 0.5f)"}[rounding]
        src_idx.append(e.tmp("long long", f"(long long)FS_FMIN(FS_FMAX({r}, 0.0f), {din - 1}.0f)"))
    return e.value(src, tuple(src_idx))


def _dot(e: _Emitter, k_extent: int, term, init: str = "0.0f") -> str:
    """acc = init + Σ_k term(k): a loop emitted into the current statements."""
    acc = e.tmp("float", init)
    e.count += 1
    k = f"k{e.count}"
    outer = e.lines
    e.lines = []
    e.push()
    value = term(k)
    e.pop()
    body = e.lines
    e.lines = outer
    e.lines += [f"FS_SIMD_SUM({acc})", f"for (long long {k} = 0; {k} < {k_extent}LL; ++{k}) {{", *["    " + x for x in body],
                f"    {acc} += {value};", "}"]
    return acc


def _guarded(e: _Emitter, tensor: str, idx: tuple[str, ...], cond: str) -> str:
    """value(tensor, idx) where cond holds, else 0 (padding): never evaluated out of bounds."""
    result = e.tmp(e.ctype(tensor), "0")
    outer = e.lines
    e.lines = []
    e.push()
    v = e.value(tensor, idx)
    e.pop()
    body = e.lines
    e.lines = outer
    e.lines += [f"if ({cond}) {{", *["    " + x for x in body], f"    {result} = {v};", "}"]
    return result


def _matmul(e, n, t, idx):
    if e.acc_value:
        return e.acc_value
    if e.hoisted_acc:
        return f"{e.hoisted_acc}[{idx[-1]}]"
    a, b = n.inputs[0], n.inputs[1]
    sa, sb, so = e.info(a).shape, e.info(b).shape, e.info(t).shape
    k_extent = sa[-1]
    batch = idx[:-2] if len(sb) > 1 and len(sa) > 1 else idx[:-1]

    def term(k):
        if len(sa) == 1:
            ia = (k,)
        else:
            m = idx[-2] if len(sb) > 1 else idx[-1]
            ia = e.broadcast(batch, sa[:-2]) + (m, k)
        ib = (k,) if len(sb) == 1 else e.broadcast(batch, sb[:-2]) + (k, idx[-1])
        av = f"{e.hoisted}[{k}]" if e.hoisted else e.value(a, ia)
        return f"{av} * {e.value(b, ib)}"

    del so
    return _dot(e, k_extent, term)


def _gemm(e, n, t, idx):
    a, b = n.inputs[0], n.inputs[1]
    ta, tb = int(n.attrs.get("transA", 0)), int(n.attrs.get("transB", 0))
    alpha, beta = float(n.attrs.get("alpha", 1.0)), float(n.attrs.get("beta", 1.0))
    m, col = idx
    k_extent = e.info(a).shape[0 if ta else 1]
    def term(k):
        av = f"{e.hoisted}[{k}]" if e.hoisted else e.value(a, (k, m) if ta else (m, k))
        return f"{av} * {e.value(b, (col, k) if tb else (k, col))}"

    acc = e.acc_value or (f"{e.hoisted_acc}[{col}]" if e.hoisted_acc else _dot(e, k_extent, term))
    expr = acc if alpha == 1.0 else f"({_lit(alpha)} * {acc})"
    if len(n.inputs) > 2 and n.inputs[2]:
        c = e.input_at(n, 2, idx)
        expr = f"({expr} + {c})" if beta == 1.0 else f"({expr} + {_lit(beta)} * {c})"
    return expr


def _conv_geometry(e: _Emitter, n: Node, x_shape, w_shape, y_shape, transpose: bool):
    spatial = len(x_shape) - 2
    kernel = tuple(n.attrs.get("kernel_shape") or w_shape[2:])
    strides = tuple(n.attrs.get("strides") or (1,) * spatial)
    dilations = tuple(n.attrs.get("dilations") or (1,) * spatial)
    pads = tuple(n.attrs.get("pads") or (0,) * (2 * spatial))
    auto = n.attrs.get("auto_pad", "NOTSET")
    if isinstance(auto, bytes):
        auto = auto.decode()
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        if transpose:
            raise CodegenRefused(f"{n.name}(ConvTranspose) auto_pad {auto} is not generated yet")
        begin = []
        for i in range(spatial):
            total = max(0, (y_shape[2 + i] - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - x_shape[2 + i])
            begin.append(total // 2 if auto == "SAME_UPPER" else total - total // 2)
        pads = tuple(begin) + (0,) * spatial
    elif auto == "VALID":
        pads = (0,) * (2 * spatial)
    return spatial, kernel, strides, dilations, pads[:spatial]


def _conv(e, n, t, idx):
    x, w = n.inputs[0], n.inputs[1]
    xs, ws, ys = e.info(x).shape, e.info(w).shape, e.info(t).shape
    spatial, kernel, strides, dilations, pads = _conv_geometry(e, n, xs, ws, ys, False)
    group = int(n.attrs.get("group", 1))
    cin_g, cout_g = xs[1] // group, ys[1] // group
    taps = [cin_g, *kernel]
    co = idx[1]
    g = f"(({co}) / {cout_g}LL)"

    def term(k):
        parts = e.unflatten(k, taps)
        ci, ks = parts[0], parts[1:]
        if e.hoisted:
            return f"{e.hoisted}[{k}] * {e.value(w, (co, ci, *ks))}"
        xv = _conv_input(e, n, x, xs, idx, k, taps, (spatial, strides, pads, dilations), g, cin_g)
        return f"{xv} * {e.value(w, (co, ci, *ks))}"

    init = e.value(n.inputs[2], (co,)) if len(n.inputs) > 2 and n.inputs[2] else "0.0f"
    if e.acc_value:
        return f"({e.acc_value} + {init})"
    if e.hoisted and w in e.args:  # C: the patch is in a buffer, the filter row is contiguous
        taps_n = math.prod(taps)
        acc = e.tmp("float", init)
        e.lines += ["#pragma omp simd reduction(+:" + acc + ")",
                    f"for (long long kq = 0; kq < {taps_n}LL; ++kq) "
                    f"{acc} += {e.hoisted}[kq] * {e.args[w].name}[({co}) * {taps_n}LL + kq];"]
        return acc
    return _dot(e, math.prod(taps), term, init)


def _conv_input(e, n, x, xs, idx, k, taps, geometry, g, cin_g) -> str:
    """The (prologue-applied, zero-padded) input value under filter tap k of output idx."""
    spatial, strides, pads, dilations = geometry
    parts = e.unflatten(k, taps)
    ci, ks = parts[0], parts[1:]
    pos = [e.tmp("long long", f"({idx[2 + i]}) * {strides[i]}LL - {pads[i]}LL + ({ks[i]}) * {dilations[i]}LL")
           for i in range(spatial)]
    inside = " && ".join(f"{p} >= 0 && {p} < {xs[2 + i]}LL" for i, p in enumerate(pos))
    return _guarded(e, x, (idx[0], f"({g} * {cin_g}LL + {ci})", *pos), inside)


def _conv_transpose(e, n, t, idx):
    x, w = n.inputs[0], n.inputs[1]
    xs, ws, ys = e.info(x).shape, e.info(w).shape, e.info(t).shape
    spatial, kernel, strides, dilations, pads = _conv_geometry(e, n, xs, ws, ys, True)
    group = int(n.attrs.get("group", 1))
    cin_g, cout_g = xs[1] // group, ws[1]
    taps = [cin_g, *kernel]
    batch, co = idx[0], idx[1]
    g = f"(({co}) / {cout_g}LL)"

    def term(k):
        parts = e.unflatten(k, taps)
        ci, ks = parts[0], parts[1:]
        num = [e.tmp("long long", f"({idx[2 + i]}) + {pads[i]}LL - ({ks[i]}) * {dilations[i]}LL") for i in range(spatial)]
        pos = [e.tmp("long long", f"{num[i]} / {strides[i]}LL") for i in range(spatial)]
        inside = " && ".join(f"{num[i]} >= 0 && {num[i]} % {strides[i]}LL == 0 && {pos[i]} < {xs[2 + i]}LL"
                             for i in range(spatial))
        cin = f"({g} * {cin_g}LL + {ci})"
        xv = _guarded(e, x, (batch, cin, *pos), inside)
        return f"{xv} * {e.value(w, (cin, f'(({co}) % {cout_g}LL)', *ks))}"

    init = e.value(n.inputs[2], (co,)) if len(n.inputs) > 2 and n.inputs[2] else "0.0f"
    return _dot(e, math.prod(taps), term, init)


_HANDLERS = {"MatMul": _matmul, "Gemm": _gemm, "Conv": _conv, "ConvTranspose": _conv_transpose,
             "LeakyRelu": _leaky, "Elu": _elu, "Gelu": _gelu, "Clip": _clip, "Cast": _cast, "Where": _where,
             "Reshape": _reshape, "Flatten": _reshape, "Squeeze": _reshape, "Unsqueeze": _reshape,
             "Transpose": _transpose, "Slice": _slice, "Gather": _gather, "Concat": _concat, "Split": _split,
             "Expand": _expand, "Resize": _resize}


# -- more ops: the remaining activations, math, bitwise and integer ops, BatchNormalization
#    (inference), Pad, GatherND / GatherElements, Tile, DepthToSpace / SpaceToDepth, Trilu,
#    OneHot, ReverseSequence, CenterCropPad, Resize linear ------------------------------------

_UNARY.update({
    "Acos": "acosf({0})", "Acosh": "acoshf({0})", "Asin": "asinf({0})", "Asinh": "asinhf({0})",
    "Atan": "atanf({0})", "Atanh": "atanhf({0})", "Cosh": "coshf({0})", "Sinh": "sinhf({0})",
    "Tan": "tanf({0})", "IsNaN": "({0} != {0})", "BitwiseNot": "(~{0})", "Identity": "{0}",
    # softplus as max(x, 0) + log1p(exp(-|x|)): log1p(exp(x)) overflows to inf past x = 88
    "Softplus": "(FS_FMAX({0}, 0.0f) + log1pf(expf(-fabsf({0}))))",
    "Mish": "({0} * tanhf(FS_FMAX({0}, 0.0f) + log1pf(expf(-fabsf({0})))))",  # x·tanh(softplus(x))
})
_BINARY.update({"BitwiseAnd": "({0} & {1})", "BitwiseOr": "({0} | {1})", "BitwiseXor": "({0} ^ {1})"})


def _typed_lit(e: _Emitter, tensor: str, value: float) -> str:
    """A constant in the C type of `tensor`: a float literal, or an integer / bool one."""
    dtype = e.info(tensor).dtype
    if dtype == "float32":
        return _lit(float(value))
    if dtype == "bool":
        return "1" if value else "0"
    return f"{int(value)}LL"


def _hard_sigmoid(e, n, t, idx):
    x = e.input_at(n, 0, idx)
    a, b = _lit(n.attrs.get("alpha", 0.2)), _lit(n.attrs.get("beta", 0.5))
    return f"FS_FMAX(0.0f, FS_FMIN(1.0f, {a} * {x} + {b}))"


def _selu(e, n, t, idx):
    x = e.input_at(n, 0, idx)
    alpha = float(n.attrs.get("alpha", 1.67326319217681884765625))
    gamma = float(n.attrs.get("gamma", 1.05070102214813232421875))
    return f"({x} > 0.0f ? {_lit(gamma)} * {x} : {_lit(gamma * alpha)} * (expf({x}) - 1.0f))"


def _celu(e, n, t, idx):
    x = e.input_at(n, 0, idx)
    a = _lit(n.attrs.get("alpha", 1.0))
    return f"(FS_FMAX({x}, 0.0f) + FS_FMIN(0.0f, {a} * (expf({x} / {a}) - 1.0f)))"


def _thresholded_relu(e, n, t, idx):
    x = e.input_at(n, 0, idx)
    return f"({x} > {_lit(n.attrs.get('alpha', 1.0))} ? {x} : 0.0f)"


def _shrink(e, n, t, idx):
    x = e.input_at(n, 0, idx)
    lam, bias = float(n.attrs.get("lambd", 0.5)), float(n.attrs.get("bias", 0.0))
    lo, hi = _typed_lit(e, t, -lam), _typed_lit(e, t, lam)
    b, zero = _typed_lit(e, t, bias), _typed_lit(e, t, 0)
    return f"({x} < {lo} ? {x} + {b} : ({x} > {hi} ? {x} - {b} : {zero}))"


def _swish(e, n, t, idx):
    x = e.input_at(n, 0, idx)
    return f"({x} / (1.0f + expf({_lit(-float(n.attrs.get('alpha', 1.0)))} * {x})))"


def _is_inf(e, n, t, idx):
    x = e.input_at(n, 0, idx)
    terms = ([f"{x} == INFINITY"] if int(n.attrs.get("detect_positive", 1)) else []) + (
        [f"{x} == -INFINITY"] if int(n.attrs.get("detect_negative", 1)) else [])
    return f"({' || '.join(terms)})" if terms else "0"


def _prelu(e, n, t, idx):
    x, slope = e.input_at(n, 0, idx), e.input_at(n, 1, idx)
    return f"({x} < 0 ? {slope} * {x} : {x})"


def _mod(e, n, t, idx):
    a, b = e.input_at(n, 0, idx), e.input_at(n, 1, idx)
    rem = f"fmodf({a}, {b})" if e.info(t).dtype == "float32" else f"{a} % {b}"
    if int(n.attrs.get("fmod", 0)):
        return f"({rem})"  # C's remainder truncates: the sign of the dividend, as fmod
    r = e.tmp(e.ctype(t), rem)  # the sign of the divisor, as Python's %
    return f"(({r} != 0 && (({r} < 0) != ({b} < 0))) ? {r} + {b} : {r})"


def _identity_like(e, n, t, idx):
    """Dropout in inference (its output is its input, the optional mask all true)."""
    training = n.inputs[2] if len(n.inputs) > 2 else ""
    flag = e.graph.constant_value(training) if training else np.zeros(1, bool)
    if flag is None or bool(flag.reshape(-1)[0]):
        raise CodegenRefused(f"{n.name}({n.op_type}) in training mode is not generated (random)")
    return e.input_at(n, 0, idx) if t == n.outputs[0] else "1"


def _batch_norm(e, n, t, idx):
    """Inference: (x - mean) · scale / sqrt(var + eps) + bias per channel (axis 1)."""
    if int(n.attrs.get("training_mode", 0)) or t != n.outputs[0] or len(idx) < 2:
        raise CodegenRefused(f"{n.name}(BatchNormalization) in training mode is not generated")
    x = e.input_at(n, 0, idx)
    scale, bias, mean, var = (e.value(n.inputs[k], (idx[1],)) for k in (1, 2, 3, 4))
    eps = _lit(n.attrs.get("epsilon", 1e-5))
    return f"(({x} - {mean}) * ({scale} / sqrtf({var} + {eps})) + {bias})"


def _guarded_or(e: _Emitter, tensor: str, idx: tuple[str, ...], cond: str, default: str) -> str:
    """value(tensor, idx) where cond holds, else `default`: never evaluated out of bounds."""
    if not cond:
        return e.value(tensor, idx)
    result = e.tmp(e.ctype(tensor), default)
    outer = e.lines
    e.lines = []
    e.push()
    v = e.value(tensor, idx)
    e.pop()
    body = e.lines
    e.lines = outer
    e.lines += [f"if ({cond}) {{", *["    " + x for x in body], f"    {result} = {v};", "}"]
    return result


def _ints(e: _Emitter, node: Node, k: int) -> list[int] | None:
    """A constant integer input as a list; None when the input is omitted."""
    if len(node.inputs) <= k or not node.inputs[k]:
        return None
    return [int(v) for v in e.const(node.inputs[k]).reshape(-1)]


def _pad(e, n, t, idx):
    """Constant / edge / reflect / wrap padding; negative pads crop (index shifts only)."""
    src = n.inputs[0]
    shape = e.info(src).shape
    rank = len(shape)
    mode = n.attrs.get("mode", "constant")
    pads = _ints(e, n, 1)
    pads = pads if pads is not None else [int(p) for p in n.attrs.get("pads", ())]
    axes = [a % rank for a in (_ints(e, n, 3) or range(rank))]
    begin, end = [0] * rank, [0] * rank
    for k, a in enumerate(axes):
        begin[a], end[a] = pads[k], pads[k + len(axes)]
    if mode == "constant":
        fill = n.attrs.get("value", 0.0)
        if len(n.inputs) > 2 and n.inputs[2]:
            fill = e.const(n.inputs[2]).reshape(-1)[0]
        default = _typed_lit(e, t, fill)
    elif mode not in ("edge", "reflect", "wrap"):
        raise CodegenRefused(f"{n.name}(Pad) mode {mode} has no code generator yet")
    src_idx, checks = [], []
    for i, d, b, f in zip(idx, shape, begin, end, strict=True):
        if b == 0 and f == 0:
            src_idx.append(i)
            continue
        p = e.tmp("long long", f"({i}) - {b}LL") if b else i
        if mode == "constant":
            if b > 0 or f > 0:
                checks.append(f"{p} >= 0 && {p} < {d}LL")
        elif mode == "edge":
            p = e.tmp("long long", f"{p} < 0 ? 0 : ({p} >= {d}LL ? {d - 1}LL : {p})")
        elif mode == "reflect":
            if max(b, f) > d - 1:
                raise CodegenRefused(f"{n.name}(Pad) reflect pads {max(b, f)} >= dim {d}")
            p = e.tmp("long long", f"{p} < 0 ? -{p} : ({p} >= {d}LL ? {2 * (d - 1)}LL - {p} : {p})")
        else:
            p = e.tmp("long long", f"(({p}) % {d}LL + {d}LL) % {d}LL")
        src_idx.append(p)
    if mode == "constant":
        return _guarded_or(e, src, tuple(src_idx), " && ".join(checks), default)
    return e.value(src, tuple(src_idx))


def _center_crop_pad(e, n, t, idx):
    src = n.inputs[0]
    shape, out_shape = e.info(src).shape, e.info(t).shape
    src_idx, checks = [], []
    for i, d, dout in zip(idx, shape, out_shape, strict=True):
        if d >= dout:  # crop: start at (d - dout) / 2
            src_idx.append(f"({i} + {(d - dout) // 2}LL)" if d > dout else i)
            continue
        p = e.tmp("long long", f"({i}) - {(dout - d) // 2}LL")
        checks.append(f"{p} >= 0 && {p} < {d}LL")
        src_idx.append(p)
    return _guarded_or(e, src, tuple(src_idx), " && ".join(checks), _typed_lit(e, t, 0))


def _wrapped(e: _Emitter, raw: str, dim: int) -> str:
    """An index read from a tensor, negative values counted from the end."""
    return e.tmp("long long", f"({raw} < 0 ? (long long)({raw}) + {dim}LL : (long long)({raw}))")


def _gather_nd(e, n, t, idx):
    data, indices = n.inputs[0], n.inputs[1]
    ds, qs = e.info(data).shape, e.info(indices).shape
    b = int(n.attrs.get("batch_dims", 0))
    lead = tuple(idx[:len(qs) - 1])
    picked = [_wrapped(e, e.value(indices, lead + (str(m),)), ds[b + m]) for m in range(qs[-1])]
    return e.value(data, tuple(idx[:b]) + tuple(picked) + tuple(idx[len(qs) - 1:]))


def _gather_elements(e, n, t, idx):
    data, indices = n.inputs[0], n.inputs[1]
    ds = e.info(data).shape
    axis = int(n.attrs.get("axis", 0)) % len(ds)
    pos = _wrapped(e, e.value(indices, idx), ds[axis])
    return e.value(data, idx[:axis] + (pos,) + idx[axis + 1:])


def _tile(e, n, t, idx):
    shape, out_shape = e.info(n.inputs[0]).shape, e.info(t).shape
    return e.value(n.inputs[0], tuple(
        i if d == dout else ("0" if d == 1 else e.tmp("long long", f"({i}) % {d}LL"))
        for i, d, dout in zip(idx, shape, out_shape, strict=True)))


def _depth_to_space(e, n, t, idx):
    b = int(n.attrs["blocksize"])
    nb, c, y, x = idx
    channels = e.info(t).shape[1]
    h, w = e.tmp("long long", f"({y}) / {b}LL"), e.tmp("long long", f"({x}) / {b}LL")
    i, j = f"(({y}) % {b}LL)", f"(({x}) % {b}LL)"
    if n.attrs.get("mode", "DCR") == "CRD":
        ci = f"({c}) * {b * b}LL + {i} * {b}LL + {j}"
    else:
        ci = f"{i} * {b * channels}LL + {j} * {channels}LL + ({c})"
    return e.value(n.inputs[0], (nb, e.tmp("long long", ci), h, w))


def _space_to_depth(e, n, t, idx):
    b = int(n.attrs["blocksize"])
    nb, oc, y, x = idx
    channels = e.info(n.inputs[0]).shape[1]
    if n.attrs.get("mode", "DCR") == "CRD":  # oc = (c·b + i)·b + j
        c = e.tmp("long long", f"({oc}) / {b * b}LL")
        i = e.tmp("long long", f"({oc}) / {b}LL % {b}LL")
        j = e.tmp("long long", f"({oc}) % {b}LL")
    else:  # oc = (i·b + j)·C + c
        i = e.tmp("long long", f"({oc}) / {b * channels}LL")
        j = e.tmp("long long", f"({oc}) / {channels}LL % {b}LL")
        c = e.tmp("long long", f"({oc}) % {channels}LL")
    return e.value(n.inputs[0], (nb, c, f"({y}) * {b}LL + {i}", f"({x}) * {b}LL + {j}"))


def _trilu(e, n, t, idx):
    k = (_ints(e, n, 1) or [0])[0]
    keep = f"({idx[-1]}) - ({idx[-2]}) {'>=' if int(n.attrs.get('upper', 1)) else '<='} {k}LL"
    return _guarded_or(e, n.inputs[0], idx, keep, _typed_lit(e, t, 0))


def _eye_like(e, n, t, idx):
    k = int(n.attrs.get("k", 0))
    return f"(({idx[1]}) - ({idx[0]}) == {k}LL)"


def _one_hot(e, n, t, idx):
    indices, values = n.inputs[0], n.inputs[2]
    depth = int(e.const(n.inputs[1]).reshape(-1)[0])
    axis = int(n.attrs.get("axis", -1)) % len(idx)
    raw = e.value(indices, idx[:axis] + idx[axis + 1:])
    at = _wrapped(e, raw, depth)
    return f"({at} == ({idx[axis]}) ? {e.value(values, ('1',))} : {e.value(values, ('0',))})"


def _reverse_sequence(e, n, t, idx):
    batch, time = int(n.attrs.get("batch_axis", 1)), int(n.attrs.get("time_axis", 0))
    length = e.value(n.inputs[1], (idx[batch],))
    src_idx = list(idx)
    src_idx[time] = e.tmp("long long", f"{idx[time]} < {length} ? {length} - 1 - {idx[time]} : {idx[time]}")
    return e.value(n.inputs[0], tuple(src_idx))


def _resize_scales(e: _Emitter, n: Node, in_shape, out_shape) -> list[float]:
    """Per axis, the scale the coordinate transform divides by: the `scales` input where given
    (not out/in: a 0.6 scale of 4 gives 2 pixels), else out/in (one common ratio under a
    keep_aspect_ratio_policy other than stretch)."""
    rank = len(in_shape)
    axes = [int(a) % rank for a in n.attrs.get("axes", ())] or list(range(rank))
    scales = [dout / din for din, dout in zip(in_shape, out_shape, strict=True)]
    given = e.graph.constant_value(n.inputs[2]) if len(n.inputs) > 2 and n.inputs[2] else None
    if given is not None and given.size:
        for a, s in zip(axes, given.reshape(-1), strict=True):
            scales[a] = float(s)
    elif n.attrs.get("keep_aspect_ratio_policy", "stretch") != "stretch":
        sizes = _ints(e, n, 3) or [out_shape[a] for a in axes]
        ratios = [size / in_shape[a] for a, size in zip(axes, sizes, strict=True)]
        common = min(ratios) if n.attrs["keep_aspect_ratio_policy"] == "not_larger" else max(ratios)
        for a in axes:
            scales[a] = common
    return scales


def _resize_coordinate(n: Node, i: str, din: int, dout: int, scale: float) -> str:
    """The input coordinate (float) of output index i along one axis."""
    ctm = n.attrs.get("coordinate_transformation_mode", "half_pixel")
    centre = f"(((float)({i}) + 0.5f) / {_lit(scale)} - 0.5f)"
    if ctm == "asymmetric":
        return f"((float)({i}) / {_lit(scale)})"
    if ctm == "half_pixel":
        return centre
    if ctm == "pytorch_half_pixel":
        return centre if dout > 1 else "0.0f"
    if ctm == "align_corners":  # the output extent as scale · in, as ONNX's reference
        return "0.0f" if dout == 1 else f"((float)({i}) * {_lit((din - 1) / (scale * din - 1))})"
    if ctm == "half_pixel_symmetric":
        offset = din / 2 * (1 - dout / (scale * din))
        return f"({_lit(offset)} + {centre})"
    raise CodegenRefused(f"{n.name}({n.op_type}) coordinate mode {ctm} has no code generator yet")


def _resize_linear(e, n, t, idx):
    """(Bi/tri)linear: per resized axis the two neighbours of the input coordinate (clamped to the
    edge) and their weights; the value is the weighted sum over the 2^axes corners."""
    src = n.inputs[0]
    in_shape, out_shape = e.info(src).shape, e.info(t).shape
    scales = _resize_scales(e, n, in_shape, out_shape)
    if int(n.attrs.get("antialias", 0)) and min(scales) < 1.0:
        raise CodegenRefused(f"{n.name}(Resize) mode linear with antialias has no code generator yet")
    taps: list[list[tuple[str, str | None]]] = []
    for i, din, dout, scale in zip(idx, in_shape, out_shape, scales, strict=True):
        if din == dout and scale == 1.0:
            taps.append([(i, None)])
            continue
        x = e.tmp("float", _resize_coordinate(n, i, din, dout, scale))
        lo = e.tmp("float", f"floorf({x})")
        w1 = e.tmp("float", f"{x} - {lo}")
        k = e.tmp("long long", f"(long long){lo}")
        i0 = e.tmp("long long", f"{k} < 0 ? 0 : ({k} > {din - 1}LL ? {din - 1}LL : {k})")
        i1 = e.tmp("long long", f"{k} + 1 < 0 ? 0 : ({k} + 1 > {din - 1}LL ? {din - 1}LL : {k} + 1)")
        taps.append([(i0, f"(1.0f - {w1})"), (i1, w1)])
    terms = []
    for corner in itertools.product(*taps):
        weights = [w for _, w in corner if w is not None]
        v = e.value(src, tuple(i for i, _ in corner))
        terms.append(" * ".join([*weights, v]))
    return "(" + " + ".join(terms) + ")"


_HANDLERS.update({
    "HardSigmoid": _hard_sigmoid, "Selu": _selu, "Celu": _celu, "ThresholdedRelu": _thresholded_relu,
    "Shrink": _shrink, "Swish": _swish, "IsInf": _is_inf, "PRelu": _prelu, "Mod": _mod, "CastLike": _cast,
    "Dropout": _identity_like, "BatchNormalization": _batch_norm, "Pad": _pad, "CenterCropPad": _center_crop_pad,
    "GatherND": _gather_nd, "GatherElements": _gather_elements, "Tile": _tile, "DepthToSpace": _depth_to_space,
    "SpaceToDepth": _space_to_depth, "Trilu": _trilu, "EyeLike": _eye_like, "OneHot": _one_hot,
    "ReverseSequence": _reverse_sequence,
})


# -- kernels ----------------------------------------------------------------------------------

def _args(graph: Graph, kernel: Kernel) -> tuple[tuple[Arg, ...], tuple[Arg, ...]]:
    def arg(prefix, k, t):
        info = graph.tensors[t]
        if info.dtype not in CTYPES:
            raise CodegenRefused(f"dtype {info.dtype} of '{t}' is not generated yet")
        return Arg(f"{prefix}{k}", t, tuple(info.shape), info.dtype)

    return (tuple(arg("in", k, t) for k, t in enumerate(kernel.inputs)),
            tuple(arg("out", k, t) for k, t in enumerate(kernel.outputs)))


def generate(graph: Graph, kernel: Kernel, name: str = "") -> GeneratedKernel:
    """The kernel's C and CUDA sources; CodegenRefused (with a FusionDecision) if not generated."""
    if kernel.template not in SUPPORTED_TEMPLATES:
        raise CodegenRefused(f"template {kernel.template} is not generated yet (runs as a library call)")
    ins, outs = _args(graph, kernel)
    name = name or f"k_{kernel.template}_{'_'.join(map(str, kernel.nodes[:4]))}"
    args = {a.tensor: a for a in ins}
    has_rows = any(graph.nodes[i].kind.name == "REDUCE" for i in kernel.nodes)
    largest = max((a.size for a in outs), default=1)
    if has_rows:
        c_src, cu_src, rows, length = _rowwise(graph, kernel, name, ins, outs, args)
        grid, skeleton = (max(1, min(rows, MAX_GRID_X)), 1, 1), "block-per-row"
    else:
        c_src, cu_src, rows, length = _pointwise(graph, kernel, name, ins, outs, args)
        grid, skeleton = (_stride_blocks(largest), 1, 1), "grid-stride"
    block = (THREADS, 1, 1)
    special = None
    if kernel.anchor is not None and not has_rows:
        special = _tiled(graph, kernel, name, ins, outs, args)
    elif not has_rows:
        special = _vectorized(graph, kernel, name, ins, outs, args)
    if special is not None:
        cu_src, grid, block, skeleton = special
    elif kernel.anchor is not None and not has_rows:
        skeleton = "direct"  # one thread per output element, its dot product in a loop
    digest = hashlib.sha256((c_src + "\0" + cu_src).encode()).hexdigest()
    return GeneratedKernel(name, kernel.template, ins, outs, c_src, cu_src, rows=rows, row_length=length,
                           source_hash=digest, grid=grid, block=block, skeleton=skeleton)


def _stride_blocks(elements: int) -> int:
    """Blocks of a grid-stride loop: one element per thread, capped (the loop covers the rest)."""
    return max(1, min(-(-elements // THREADS), MAX_STRIDE_BLOCKS))


def try_generate(graph: Graph, kernel: Kernel, name: str = "") -> GeneratedKernel | FusionDecision:
    try:
        return generate(graph, kernel, name)
    except CodegenRefused as exc:
        return exc.decision


def _signature(ins, outs, restrict: str) -> str:
    params = [f"const {a.ctype}* {restrict} {a.name}" for a in ins]
    params += [f"{a.ctype}* {restrict} {a.name}" for a in outs]
    return ", ".join(params)


# C: glibc's vector math (libmvec) under `omp simd` when the backend links it (FS_VECTOR_MATH), so
# loops with exp/log/tanh/erf vectorize; FS_SIMD_SUM marks a sum loop the compiler may reassociate;
# FS_FMAX/FS_FMIN are compare-selects in C (fmaxf does not vectorize; same result unless the second
# operand is NaN) and fmaxf/fminf in CUDA.
_VECTOR_MATH = ("expf", "logf", "tanhf", "erff", "log1pf", "sinf", "cosf")
_C_PRELUDE = ("#include <math.h>\n#include <stdint.h>\n#include <stdlib.h>\n#ifdef FS_VECTOR_MATH\n"
              + "".join(f"#pragma omp declare simd notinbranch\nfloat {f}(float);\n" for f in _VECTOR_MATH)
              + "#endif\n#ifdef FS_BLAS_SGEMM\nvoid FS_BLAS_SGEMM(int, int, int, int, int, int, float, const float*, int, "
              "const float*, int, float, float*, int);\n#endif\n#ifdef FS_BLAS_SGEMV\n"
              "void FS_BLAS_SGEMV(int, int, int, int, float, const float*, int, const float*, int, float, float*, int);\n"
              "#define FS_GEMV_OR(call) if (mc == 1) { call } else\n#else\n#define FS_GEMV_OR(call)\n#endif\n"
              "#define FS_FMAX(a, b) ((a) > (b) ? (a) : (b))\n"
              "#define FS_FMIN(a, b) ((a) < (b) ? (a) : (b))\n#ifdef _OPENMP\n#include <omp.h>\nstatic inline long long fs_threads(void) { return omp_get_max_threads(); }\n"
              "#else\nstatic inline long long fs_threads(void) { return 1; }\n#endif\n#define FS_PRAGMA(x) _Pragma(#x)\n#define FS_SIMD_SUM(a) FS_PRAGMA(omp simd reduction(+:a))\n")
_CU_PRELUDE = ("#ifndef INFINITY\n#define INFINITY __int_as_float(0x7f800000)\n#endif\n"
               "#ifndef NAN\n#define NAN __int_as_float(0x7fffffff)\n#endif\n#define FS_SIMD_SUM(a)\n"
               "#define FS_FMAX(a, b) fmaxf(a, b)\n#define FS_FMIN(a, b) fminf(a, b)\n")


def _indent(lines: list[str], depth: int) -> str:
    return "\n".join("    " * depth + line for line in lines)


def _pointwise(graph, kernel, name, ins, outs, args):
    c_loops, cu_loops = _pointwise_loops(graph, kernel, args, outs)
    hoisted = _anchor_row_loops(graph, kernel, args, outs)
    if hoisted is not None:
        c_loops = hoisted
    c_src = (f"{_C_PRELUDE}\nvoid {name}({_signature(ins, outs, 'restrict')}) {{\n" + "\n".join(c_loops) + "\n}\n")
    cu_src = (f"{_CU_PRELUDE}\nextern \"C\" __global__ void {name}({_signature(ins, outs, '__restrict__')}) {{\n"
              + "\n".join(cu_loops) + "\n}\n")
    return c_src, cu_src, 0, 0


MAX_HOIST = 16384  # floats of the activation operand kept per row (64 KiB of stack)


def _anchor_row_loops(graph: Graph, kernel: Kernel, args, outs) -> list[str] | None:
    """C skeleton for gemm/conv with a prologue on the activation operand: per output row (all
    output dims but the one the weights span), the operand's row (MatMul/Gemm: A[m, :]; Conv: the
    input patch of one output pixel and group) is computed once into a buffer, then reused for
    every output column — the CPU analogue of a tile load. None when there is nothing to hoist."""
    if kernel.anchor is None:
        return None
    anchor = graph.nodes[kernel.anchor]
    if _anchor_derived(graph, kernel, anchor) is None:  # the epilogue moves elements
        return _materialized_loops(graph, kernel, args, outs, anchor)
    if anchor.op_type in ("MatMul", "Gemm"):
        return _matmul_row_loops(graph, kernel, args, outs, anchor)
    if anchor.op_type != "Conv":
        return None
    return _conv_loops(graph, kernel, args, outs, anchor)


def _conv_loops(graph: Graph, kernel: Kernel, args, outs, anchor: Node) -> list[str] | None:
    """C conv: the depthwise loop, or the BLAS blocks with the per-pixel row loops as fallback."""
    depthwise = _depthwise_loops(graph, kernel, args, outs, anchor)
    if depthwise is not None:
        return depthwise
    hoisted = _conv_row_loops(graph, kernel, args, outs, anchor)
    blas = _conv_blas_blocks(graph, kernel, args, outs, anchor)
    if blas is None or hoisted is None:
        return hoisted
    return ["#ifdef FS_BLAS_SGEMM", *blas, "#else", *hoisted, "#endif"]


CONV_PATCH_FLOATS = 1 << 18  # C conv: im2col panel per block (1 MiB), whole output rows


def _conv_blas_blocks(graph: Graph, kernel: Kernel, args, outs, anchor: Node) -> list[str] | None:
    """C conv as implicit GEMM through a BLAS sgemm per block of whole output rows of one image
    and group (as many rows as give every OpenMP thread a block, the panel within CONV_PATCH_FLOATS): the block's input patches (prologue applied, zero padding) are packed into an
    im2col panel (taps x pixels; a 1x1 stride-1 unpadded conv reads its input in place), one sgemm
    multiplies the group's filters (C_out/g x taps, a constant read in place) by it, and the
    epilogue runs over the block's product while it is in cache, before the one store. None for
    depthwise-like groups (under 8 output channels per group), non-2-D convs and computed filters."""
    found = _conv_2d(graph, kernel, args, outs, anchor)
    if found is None:
        return None
    x, w, xs, ws, ys, group, main, side = found
    cin_g, cout_g = xs[1] // group, ys[1] // group
    if cout_g < 8:
        return None
    e = _Emitter(graph, kernel, args)
    spatial, kern, strides, dilations, pads = _conv_geometry(e, anchor, xs, ws, ys, False)
    taps = [cin_g, *kern]
    kt = math.prod(taps)
    ho, wo = ys[2], ys[3]
    pixels = ho * wo
    cap = max(1, CONV_PATCH_FLOATS // max(1, kt * wo))  # output rows per block: its panel within the cap
    direct = (x in args and graph.producer(x) not in kernel.nodes and kern == (1, 1) and strides == (1, 1)
              and not any(pads) and graph.tensors[x].dtype == "float32")
    idx = ("nb", "co", "oh", "ow")
    if direct:
        fill, panel, ldb = [], f"{args[x].name} + nb * {xs[1] * pixels}LL + gq * {cin_g * pixels}LL + p0", pixels
    elif x in args and graph.producer(x) not in kernel.nodes and graph.tensors[x].dtype == "float32":
        fill = _im2col_rows(args[x].name, xs, cin_g, kern, strides, pads, dilations, wo)
        panel, ldb = "patch", "(int)pn"
    else:
        e.lines = []
        e.push()
        v = _conv_input(e, anchor, x, xs, idx, "kq", taps, (spatial, strides, pads, dilations), "gq", cin_g)
        e.pop()
        fill = [f"for (long long kq = 0; kq < {kt}LL; ++kq) {{", "    for (long long oh = oh0; oh < oh1; ++oh) {",
                *(["        #pragma omp simd"] if _flat_loop(e.lines) else []),
                f"        for (long long ow = 0; ow < {wo}LL; ++ow) {{", *["            " + x_ for x_ in e.lines],
                f"            patch[kq * pn + (oh - oh0) * {wo}LL + ow] = {v};", "        }", "    }", "}"]
        panel, ldb = "patch", "(int)pn"
    e.lines = []
    e.push()
    e.acc_value = f"cbuf[col * pn + (oh - oh0) * {wo}LL + ow]"
    writes = [f"{o.name}[{e.flat(idx, o.shape)}] = {e.value(o.tensor, idx)};" for o in main]
    body = e.lines + writes
    e.pop()
    e.acc_value = ""
    block = [f"for (long long blk = 0; blk < {xs[0] * group}LL * blocks; ++blk) {{",
             f"    long long nb = blk / ({group}LL * blocks), gq = blk / blocks % {group}LL;",
             "    long long oh0 = blk % blocks * rb;",
             f"    long long oh1 = oh0 + rb < {ho}LL ? oh0 + rb : {ho}LL;",
             f"    long long p0 = oh0 * {wo}LL, pn = (oh1 - oh0) * {wo}LL;",
             *([f"    float* patch = (float*)malloc(sizeof(float) * {kt}LL * pn);"] if not direct else []),
             f"    float* cbuf = (float*)malloc(sizeof(float) * {cout_g}LL * pn);",
             *["    " + x_ for x_ in fill],
             f"    FS_BLAS_SGEMM(101, 111, 111, {cout_g}, (int)pn, {kt}, 1.0f, {args[w].name} + gq * {cout_g * kt}LL, "
             f"{kt}, {panel}, {ldb}, 0.0f, cbuf, (int)pn);",
             f"    for (long long col = 0; col < {cout_g}LL; ++col) {{", f"        long long co = gq * {cout_g}LL + col;",
             "        for (long long oh = oh0; oh < oh1; ++oh) {",
             *(["            #pragma omp simd"] if _flat_loop(body) else []),
             f"            for (long long ow = 0; ow < {wo}LL; ++ow) {{", *["                " + x_ for x_ in body],
             "            }", "        }", "    }",
             *(["    free(patch);"] if not direct else []), "    free(cbuf);", "}"]
    c_side, _ = _pointwise_loops(graph, kernel, args, side)
    split = (f"long long split = (fs_threads() + {xs[0] * group}LL - 1) / {xs[0] * group}LL;",  # blocks per image
             f"long long rb = ({ho}LL + split - 1) / split;", f"if (rb > {cap}LL) rb = {cap}LL;",
             f"long long blocks = ({ho}LL + rb - 1) / rb;")
    return c_side + ["    {", *["    " + x for x in split], "    #pragma omp parallel for schedule(static)\n"
                     + _indent(block, 1), "    }"]


def _im2col_rows(x: str, xs, cin_g: int, kern, strides, pads, dilations, wo: int) -> list[str]:
    """The im2col panel of output rows oh0..oh1 read from the input as it is (no prologue): per tap
    and output row, the zero rows and columns outside the image, a strided copy in between."""
    (kh_n, kw_n), (sh, sw), (ph, pw), (dh, dw) = kern, strides, pads, dilations
    h, w = xs[2], xs[3]
    return [f"for (long long kq = 0; kq < {cin_g * kh_n * kw_n}LL; ++kq) {{",
            f"    long long ci = kq / {kh_n * kw_n}LL, kh = kq / {kw_n}LL % {kh_n}LL, kw = kq % {kw_n}LL;",
            f"    long long off = kw * {dw}LL - {pw}LL;",
            f"    long long lo = off >= 0 ? 0 : (-off + {sw}LL - 1) / {sw}LL;",
            f"    long long hi = {w}LL - off > 0 ? ({w}LL - off + {sw}LL - 1) / {sw}LL : 0;",
            f"    if (hi > {wo}LL) hi = {wo}LL;", "    if (lo > hi) lo = hi;",
            "    for (long long oh = oh0; oh < oh1; ++oh) {",
            f"        float* dst = patch + kq * pn + (oh - oh0) * {wo}LL;",
            f"        long long ih = oh * {sh}LL - {ph}LL + kh * {dh}LL;",
            f"        if (ih < 0 || ih >= {h}LL) {{ for (long long ow = 0; ow < {wo}LL; ++ow) dst[ow] = 0.0f; continue; }}",
            f"        const float* src = {x} + ((nb * {xs[1]}LL + gq * {cin_g}LL + ci) * {h}LL + ih) * {w}LL + off;",
            "        for (long long ow = 0; ow < lo; ++ow) dst[ow] = 0.0f;",
            "        #pragma omp simd",
            f"        for (long long ow = lo; ow < hi; ++ow) dst[ow] = src[ow * {sw}LL];",
            f"        for (long long ow = hi; ow < {wo}LL; ++ow) dst[ow] = 0.0f;", "    }", "}"]


def _conv_2d(graph: Graph, kernel: Kernel, args, outs, anchor: Node):
    """(x, w, shapes of x, w, y, group, outputs of y's shape, other outputs) of a 2-D conv whose
    filter is a float32 kernel input, or None."""
    x, w = anchor.inputs[0], anchor.inputs[1]
    xs, ws, ys = (graph.tensors[t].shape for t in (x, w, anchor.outputs[0]))
    if len(xs) != 4 or w not in args or graph.tensors[w].dtype != "float32" or graph.producer(w) in kernel.nodes:
        return None
    main = [o for o in outs if o.shape == ys]
    if not main:
        return None
    return x, w, xs, ws, ys, int(anchor.attrs.get("group", 1)), main, [o for o in outs if o.shape != ys]


def _depthwise_loops(graph: Graph, kernel: Kernel, args, outs, anchor: Node) -> list[str] | None:
    """C depthwise conv (one input channel per group): per image and channel, per output row, the
    output pixels of the row in a vectorized loop with the taps unrolled and the filter's taps in
    registers; output rows whose taps all fall inside the image run without bounds checks in the
    columns whose taps do too; the border pixels take the general padded path. None unless the
    conv is 2-D with one input channel per group and a constant filter."""
    found = _conv_2d(graph, kernel, args, outs, anchor)
    if found is None:
        return None
    x, w, xs, ws, ys, group, main, side = found
    if group == 1 or xs[1] != group:
        return None
    e = _Emitter(graph, kernel, args)
    _, (kh_n, kw_n), (sh, sw), (dh, dw), (ph, pw) = _conv_geometry(e, anchor, xs, ws, ys, False)
    cout_g = ys[1] // group
    idx = ("nb", "co", "oh", "ow")

    def body(fast: bool) -> list[str]:
        e.lines = []
        e.push()
        if fast:
            terms = []
            for kh in range(kh_n):
                for kw in range(kw_n):
                    iw = f"ow * {sw}LL + {kw * dw - pw}LL"
                    terms.append(f"w{kh}_{kw} * {e.value(x, ('nb', 'ci', f'ih{kh}', iw))}")
            e.acc_value = e.tmp("float", " + ".join(terms))  # _conv adds the bias
        writes = [f"{o.name}[{e.flat(idx, o.shape)}] = {e.value(o.tensor, idx)};" for o in main]
        e.acc_value = ""
        e.pop()
        lines, e.lines = e.lines + writes, []
        return lines

    fast, slow = body(True), body(False)
    lo = min(ys[3], -(-pw // sw))  # first column whose taps are all inside the row
    hi = max(lo, min(ys[3], (xs[3] - 1 + pw - (kw_n - 1) * dw) // sw + 1))
    rows_ok = " && ".join(f"ih{kh} >= 0 && ih{kh} < {xs[2]}LL" for kh in (0, kh_n - 1))

    def loop(start: str, stop: str, lines: list[str], simd: bool) -> list[str]:
        return [*(["#pragma omp simd"] if simd and _flat_loop(lines) else []),
                f"for (long long ow = {start}; ow < {stop}; ++ow) {{", *["    " + x_ for x_ in lines], "}"]

    taps = [f"const float w{kh}_{kw} = {args[w].name}[co * {kh_n * kw_n}LL + {kh * kw_n + kw}LL];"
            for kh in range(kh_n) for kw in range(kw_n)]
    rows = [f"long long ih{kh} = oh * {sh}LL + {kh * dh - ph}LL;" for kh in range(kh_n)]
    block = [f"for (long long nc = 0; nc < {xs[0] * ys[1]}LL; ++nc) {{",
             f"    long long nb = nc / {ys[1]}LL, co = nc % {ys[1]}LL, ci = co / {cout_g}LL;", *["    " + t for t in taps],
             f"    for (long long oh = 0; oh < {ys[2]}LL; ++oh) {{", *["        " + r for r in rows],
             f"        if ({rows_ok}) {{",
             *["            " + x_ for x_ in loop("0", f"{lo}LL", slow, False) + loop(f"{lo}LL", f"{hi}LL", fast, True)
               + loop(f"{hi}LL", f"{ys[3]}LL", slow, False)],
             "        } else {", *["            " + x_ for x_ in loop("0", f"{ys[3]}LL", slow, False)], "        }",
             "    }", "}"]
    c_side, _ = _pointwise_loops(graph, kernel, args, side)
    return c_side + ["    #pragma omp parallel for schedule(static)\n" + _indent(block, 1)]


def _conv_row_loops(graph: Graph, kernel: Kernel, args, outs, anchor: Node) -> list[str] | None:
    """C conv without a BLAS: per output pixel, the input patch (prologue applied) once into a
    buffer, dotted with each output channel's contiguous filter row."""
    y = anchor.outputs[0]
    yshape = graph.tensors[y].shape
    main = [o for o in outs if o.shape == yshape]
    side = [o for o in outs if o.shape != yshape]
    fill = _HOIST_FILL.get(anchor.op_type)
    plan = fill(graph, anchor) if fill else None
    if plan is None or not main:
        return None
    inner_axis, extent, fill_fn = plan
    if extent > MAX_HOIST:
        return None
    e = _Emitter(graph, kernel, args)
    outer_shape = tuple(d for i, d in enumerate(yshape) if i != inner_axis)
    row_idx = e.unflatten("row", outer_shape)
    col = "col"
    idx = row_idx[:inner_axis] + (col,) + row_idx[inner_axis:]
    pre = e.lines
    e.lines = []
    fill_fn(e, anchor, idx, "hbuf")
    fill_lines, e.lines = e.lines, []
    e.push()
    e.hoisted = "hbuf"
    writes = []  # conv: the patch buffer is refilled at each group's first output channel
    for o in main:
        v = e.value(o.tensor, idx)
        writes.append(f"{o.name}[{e.flat(idx, o.shape)}] = {v};")
    body = e.lines + writes
    e.pop()
    rows = math.prod(outer_shape)
    loop = [f"for (long long row = 0; row < {rows}LL; ++row) {{", *["    " + x for x in pre],
            f"    float hbuf[{extent}];"]
    loop += [f"    for (long long {col} = 0; {col} < {yshape[inner_axis]}LL; ++{col}) {{"]
    loop += ["        " + x for x in fill_lines + body] + ["    }", "}"]
    c_side, _ = _pointwise_loops(graph, kernel, args, side)
    return c_side + ["    #pragma omp parallel for schedule(static)\n" + _indent(loop, 1)]


def _matmul_row_loops(graph: Graph, kernel: Kernel, args, outs, anchor: Node) -> list[str] | None:
    """C skeleton for MatMul/Gemm (i-k-j order): per output row, the A row (prologue applied)
    into a buffer, acc[n] += a[k] * B[k, n] with n innermost (contiguous, vectorizable), then the
    epilogue per column reading acc[n]."""
    a, b = anchor.inputs[0], anchor.inputs[1]
    sa, sb = graph.tensors[a].shape, graph.tensors[b].shape
    y = anchor.outputs[0]
    yshape = graph.tensors[y].shape
    if len(sa) < 2 or len(sb) < 2:
        return None
    trans_a = anchor.op_type == "Gemm" and int(anchor.attrs.get("transA", 0))
    trans_b = anchor.op_type == "Gemm" and int(anchor.attrs.get("transB", 0))
    k_extent, n_extent = (sa[0] if trans_a else sa[-1]), yshape[-1]
    main = [o for o in outs if o.shape == yshape]
    if not main:
        return None
    e = _Emitter(graph, kernel, args)
    row_idx = e.unflatten("row", yshape[:-1])
    batch, m = row_idx[:-1], row_idx[-1]
    pre = e.lines
    e.lines = []
    e.push()
    av = e.value(a, (("kk", m) if trans_a else e.broadcast(batch, sa[:-2]) + (m, "kk")))
    e.pop()
    fill = [f"for (long long kk = 0; kk < {k_extent}LL; ++kk) {{", *["    " + x for x in e.lines], f"    hbuf[kk] = {av};", "}"]
    e.lines = []
    e.push()
    bv = e.value(b, (("nn", "kk") if trans_b else e.broadcast(batch, sb[:-2]) + ("kk", "nn")))
    e.pop()
    mac = [f"for (long long kk = 0; kk < {k_extent}LL; ++kk) {{", "    float ak = hbuf[kk];",
           f"    for (long long nn = 0; nn < {n_extent}LL; ++nn) {{", *["        " + x for x in e.lines],
           f"        acc[nn] += ak * {bv};", "    }", "}"]
    e.lines = []
    e.push()
    e.hoisted_acc = "acc"
    idx = row_idx + ("col",)
    writes = [f"{o.name}[{e.flat(idx, o.shape)}] = {e.value(o.tensor, idx)};" for o in main]
    body = e.lines + writes
    e.pop()
    loop = [f"for (long long row = 0; row < {math.prod(yshape[:-1])}LL; ++row) {{", *["    " + x for x in pre],
            f"    float hbuf[{k_extent}];", f"    float acc[{n_extent}];",
            f"    for (long long nn = 0; nn < {n_extent}LL; ++nn) acc[nn] = 0.0f;",
            *["    " + x for x in fill + mac],
            f"    for (long long col = 0; col < {n_extent}LL; ++col) {{", *["        " + x for x in body], "    }", "}"]
    c_side, _ = _pointwise_loops(graph, kernel, args, [o for o in outs if o.shape != yshape])
    rows_loop = c_side + ["    #pragma omp parallel for schedule(static)\n" + _indent(loop, 1)]
    if max(k_extent, n_extent) > MAX_HOIST:  # rows too long for the stack: generic loops without a BLAS
        rows_loop = _pointwise_loops(graph, kernel, args, outs)[0]
    blas = _blas_blocks(graph, e, anchor, yshape, (k_extent, n_extent, trans_b), pre, fill, body)
    if blas is None:
        return rows_loop if max(k_extent, n_extent) <= MAX_HOIST else None
    return ["#ifdef FS_BLAS_SGEMM", *c_side, *blas, "#else", *rows_loop, "#endif"]


BLAS_TILE_FLOATS = 1 << 18  # C gemm: at most this product tile (1 MiB) per BLAS call, so it stays in cache


def _blas_blocks(graph: Graph, e: _Emitter, anchor: Node, yshape, dims, pre, fill, body) -> list[str] | None:
    """C gemm through a BLAS sgemm per block of output rows of one batch — as many rows as give every
    OpenMP thread a block (one block per batch when the batches suffice), at most a BLAS_TILE_FLOATS
    tile, so B is packed as few times as the threads allow: the rows of A with the prologue
    applied are packed into a buffer, one sgemm multiplies them by B (a kernel input read in place,
    or, when the group computes it, packed per block) — an sgemv when the product has one row, which
    needs no packing — and the epilogue runs over the block's product while it is in cache, before
    the one store. None where B is not float32."""
    k_extent, n_extent, trans_b = dims
    b = anchor.inputs[1]
    if graph.tensors[b].dtype != "float32":
        return None
    packed_b = b not in e.args or graph.producer(b) in e.members  # computed in the group: packed per block
    sb = graph.tensors[b].shape
    m_extent = yshape[-2] if len(yshape) > 1 else 1
    batches = math.prod(yshape[:-2])
    cap = max(8, BLAS_TILE_FLOATS // max(1, n_extent))
    e.lines = []
    z_idx = e.unflatten("z", yshape[:-2])
    z_lines = e.lines
    e.lines = []
    if packed_b:  # B with its prologue (a Transpose of the keys, ...) as a K x N row-major panel
        e.push()
        bv = e.value(b, ("nn", "kk") if trans_b else e.broadcast(z_idx, sb[:-2]) + ("kk", "nn"))
        e.pop()
        z_lines += [f"float* bbuf = (float*)malloc(sizeof(float) * {k_extent * n_extent}LL);",
                    f"for (long long kk = 0; kk < {k_extent}LL; ++kk) {{",
                    *([] if e.lines else ["    #pragma omp simd"]),
                    f"    for (long long nn = 0; nn < {n_extent}LL; ++nn) {{", *["        " + x for x in e.lines],
                    f"        bbuf[kk * {n_extent}LL + nn] = {bv};", "    }", "}"]
        e.lines = []
        b_ptr, ldb, b_trans = "bbuf", n_extent, 111
    else:
        b_ptr = f"{e.args[b].name} + ({e.flat(e.broadcast(z_idx, sb[:-2]) + ('0', '0'), sb)})"
        ldb, b_trans = (k_extent if trans_b else n_extent), (112 if trans_b else 111)
    row = ["long long row = z * " + f"{m_extent}LL + m0 + i;", *pre]
    gemv = (f"FS_BLAS_SGEMV(101, 112, {k_extent}, {n_extent}, 1.0f, {b_ptr}, {ldb}, abuf, 1, 0.0f, cbuf, 1);"
            if b_trans == 111 else  # one row: y = B^T a (B is K x N), or y = B a (B is N x K)
            f"FS_BLAS_SGEMV(101, 111, {n_extent}, {k_extent}, 1.0f, {b_ptr}, {ldb}, abuf, 1, 0.0f, cbuf, 1);")
    sgemm = (f"FS_BLAS_SGEMM(101, 111, {b_trans}, (int)mc, {n_extent}, {k_extent}, 1.0f, abuf, "
             f"{k_extent}, {b_ptr}, {ldb}, 0.0f, cbuf, {n_extent});")
    sgemm = f"FS_GEMV_OR({gemv}) {sgemm}" if m_extent == 1 else sgemm
    block = [f"for (long long blk = 0; blk < {batches}LL * blocks; ++blk) {{",
             "    long long z = blk / blocks, m0 = (blk % blocks) * mb;",
             f"    long long mc = {m_extent}LL - m0 < mb ? {m_extent}LL - m0 : mb;",
             *["    " + x for x in z_lines],
             f"    float* abuf = (float*)malloc(sizeof(float) * mc * {k_extent}LL);",
             f"    float* cbuf = (float*)malloc(sizeof(float) * mc * {n_extent}LL);",
             "    for (long long i = 0; i < mc; ++i) {",
             *["        " + x for x in row], f"        float* hbuf = abuf + i * {k_extent}LL;",
             *["        " + x for x in fill], "    }",
             "    " + sgemm,
             "    for (long long i = 0; i < mc; ++i) {",
             *["        " + x for x in row], f"        const float* acc = cbuf + i * {n_extent}LL;",
             *(["        #pragma omp simd"] if _flat_loop(body) else []),
             f"        for (long long col = 0; col < {n_extent}LL; ++col) {{", *["            " + x for x in body], "        }",
             "    }", "    free(abuf);", "    free(cbuf);", *(["    free(bbuf);"] if packed_b else []), "}"]
    split = (f"long long split = (fs_threads() + {batches}LL - 1) / {batches}LL;",  # row blocks per batch
             f"long long mb = ({m_extent}LL + split - 1) / split;", f"if (mb > {cap}LL) mb = {cap}LL;",
             f"long long blocks = ({m_extent}LL + mb - 1) / mb;")
    return ["    {", *["    " + x for x in split], "    #pragma omp parallel for schedule(static)\n" + _indent(block, 1), "    }"]


def _fill_conv(graph: Graph, anchor: Node):
    x, w = anchor.inputs[0], anchor.inputs[1]
    xs, ws, ys = graph.tensors[x].shape, graph.tensors[w].shape, graph.tensors[anchor.outputs[0]].shape
    group = int(anchor.attrs.get("group", 1))
    cin_g, cout_g = xs[1] // group, ys[1] // group
    kernel = tuple(anchor.attrs.get("kernel_shape") or ws[2:])
    taps = [cin_g, *kernel]

    def fill(e, node, idx, buf) -> None:
        geometry = _conv_geometry(e, node, xs, ws, ys, False)
        spatial, _, strides, dilations, pads = geometry
        co = idx[1]
        g = f"(({co}) / {cout_g}LL)"
        kk = "kh"
        e.lines.append(f"if (({co}) % {cout_g}LL == 0) for (long long {kk} = 0; {kk} < {math.prod(taps)}LL; ++{kk}) {{")
        e.push()
        v = _conv_input(e, node, x, xs, idx, kk, taps, (spatial, strides, pads, dilations), g, cin_g)
        e.pop()
        e.lines.append(f"    {buf}[{kk}] = {v};")
        e.lines.append("}")
    return 1, math.prod(taps), fill


_HOIST_FILL = {"Conv": _fill_conv}


def _materialized_loops(graph: Graph, kernel: Kernel, args, outs, anchor: Node) -> list[str] | None:
    """C skeleton for a MatMul/Gemm/Conv whose epilogue reads the product at other positions than
    the one computed (a Transpose after a MatMul, a Reshape+Transpose or a Concat after a Conv):
    the product (prologue applied) into a heap buffer by the anchor's own loops (the BLAS blocks),
    then every output by pointwise loops that read the buffer. None for other anchors, 1-D
    operands, or a product that is not float32."""
    y = anchor.outputs[0]
    info = graph.tensors[y]
    if anchor.op_type not in ("MatMul", "Gemm", "Conv") or info.dtype != "float32":
        return None
    buffer = Arg("ybuf", y, tuple(info.shape), info.dtype)
    loops = _conv_loops if anchor.op_type == "Conv" else _matmul_row_loops
    product = loops(graph, kernel, args, [buffer], anchor)
    if product is None:
        return None
    c_loops, _ = _pointwise_loops(graph, kernel, {**args, y: buffer}, outs, materialized=frozenset({y}))
    return [f"    float* ybuf = (float*)malloc(sizeof(float) * {max(1, buffer.size)}LL);", *product, *c_loops,
            "    free(ybuf);"]


def _pointwise_loops(graph, kernel, args, outs, materialized=frozenset()) -> tuple[list[str], list[str]]:
    """One loop per output: O[i] = value(O, unflatten(i)) — CUDA: a grid-stride loop over i; C: a
    loop nest, parallel over the output's leading dims (their index computed once per row) and
    vectorized over its last dim (`omp simd`, no per-element division)."""
    blocks, c_loops = [], []
    for out in outs:
        e = _Emitter(graph, kernel, args)
        e.materialized = materialized
        idx = e.unflatten("i", out.shape)
        v = e.value(out.tensor, idx)
        e.lines.append(f"{out.name}[i] = {v};")
        blocks.append((out, e.lines))
        c_loops.append(_c_nest(graph, kernel, args, out, materialized))
    cu_loops = []
    for out, lines in blocks:
        cu_loops.append(f"    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < {out.size}LL;"
                        f" i += (long long)blockDim.x * gridDim.x) {{\n{_indent(lines, 2)}\n    }}")
    return c_loops, cu_loops


def _c_nest(graph, kernel, args, out: Arg, materialized) -> str:
    """C loops for one output: rows (all dims but the last) in parallel, the last dim innermost."""
    inner = out.shape[-1] if out.shape else 1
    rows = out.size // inner if inner else 0
    e = _Emitter(graph, kernel, args)
    e.materialized = materialized
    row_idx = e.unflatten("o", out.shape[:-1]) if out.shape else ()
    head, e.lines = e.lines, []
    e.push()
    idx = (*row_idx, "j") if out.shape else ()
    v = e.value(out.tensor, idx)
    body = [*e.lines, f"{out.name}[o * {inner}LL + j] = {v};"]
    e.pop()
    simd = ["#pragma omp simd"] if _flat_loop(body) else []
    loop = [f"for (long long o = 0; o < {rows}LL; ++o) {{", *["    " + x for x in head],
            *["    " + x for x in simd], f"    for (long long j = 0; j < {inner}LL; ++j) {{",
            *["        " + x for x in body], "    }", "}"]
    return "    #pragma omp parallel for schedule(static)\n" + _indent(loop, 1)


# -- rowwise ----------------------------------------------------------------------------------

_CU_BLOCK_REDUCE = """
__device__ __forceinline__ float warp_reduce(float v, int is_max) {
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, w) : v + w;
    }
    return v;
}
__device__ float block_reduce(float v, int is_max) {
    __shared__ float partial[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_reduce(v, is_max);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    v = threadIdx.x < warps ? partial[threadIdx.x] : (is_max ? -INFINITY : 0.0f);
    if (warp == 0) v = warp_reduce(v, is_max);
    if (threadIdx.x == 0) partial[0] = v;
    __syncthreads();
    v = partial[0];
    __syncthreads();
    return v;
}
"""


@dataclass
class _RowPlan:
    rows: int
    length: int
    c: list[str] = field(default_factory=list)
    cu: list[str] = field(default_factory=list)
    cached: dict[str, str] = field(default_factory=dict)  # C: tensor → its row, in a local buffer
    cu_cached: dict[str, str] = field(default_factory=dict)  # CUDA: tensor → its row, in shared memory
    c_target: bool = False  # emitting the C body or the CUDA one (each reads its own cached rows)

    def rows_cached(self) -> dict[str, str]:
        return self.cached if self.c_target else self.cu_cached


def _row_plan(graph, kernel, args, outs, materialized=frozenset()):
    """The row kernel's statements: (plan with its C and CUDA row bodies, side-output loops)."""
    nodes = [graph.nodes[i] for i in kernel.nodes]
    rows, length = _row_shape(graph, nodes)
    e = _Emitter(graph, kernel, args)
    e.materialized = materialized
    plan = _RowPlan(rows, length)
    side = _side_outputs(graph, kernel, outs, plan)
    for node in nodes:
        if node.kind.name == "REDUCE":
            _reduction(e, node, plan)
    for out in outs:
        if out not in side:
            _row_output(e, out, plan)
    return plan, _pointwise_loops(graph, kernel, args, side, materialized)


def _c_rows(plan: _RowPlan, c_side: list[str]) -> str:
    return ("".join(x + "\n" for x in c_side) + f"    #pragma omp parallel for schedule(static)\n"
            f"    for (long long r = 0; r < {plan.rows}LL; ++r) {{\n{_indent(plan.c, 2)}\n    }}\n")


def _rowwise(graph, kernel, name, ins, outs, args):
    plan, (c_side, cu_side) = _row_plan(graph, kernel, args, outs)
    rows, length = plan.rows, plan.length
    cu_body = _indent(plan.cu, 2)
    c_body = _c_rows(plan, c_side)
    product = _row_product(graph, kernel, args, outs)
    if product is not None:  # C with a BLAS: the product first (packed, blocked), then the rows read it
        c_body = f"#ifdef FS_BLAS_SGEMM\n{product}#else\n{c_body}#endif\n"
    c_src = f"{_C_PRELUDE}\nvoid {name}({_signature(ins, outs, 'restrict')}) {{\n{c_body}}}\n"
    arg = _CU_BLOCK_ARGBEST if "block_argbest(" in cu_body else ""
    cu_src = (f"{_CU_PRELUDE}{_CU_BLOCK_REDUCE}{arg}\nextern \"C\" __global__ void {name}({_signature(ins, outs, '__restrict__')}) {{\n"
              + "".join(x + "\n" for x in cu_side)
              + f"    for (long long r = blockIdx.x; r < {rows}LL; r += gridDim.x) {{\n{cu_body}\n    }}\n}}\n")
    return c_src, cu_src, rows, length


def _row_product(graph, kernel, args, outs) -> str | None:
    """C for a row kernel over a MatMul/Gemm (attention's scores under a Softmax): the product,
    prologue applied, into a heap buffer through the BLAS blocks, then the row loops reading it
    (each row's dot products are one BLAS tile instead of a dot per element). None without an
    anchor, or where the product is not float32 or not generated through the BLAS blocks."""
    if kernel.anchor is None or graph.nodes[kernel.anchor].op_type not in ("MatMul", "Gemm"):
        return None
    anchor = graph.nodes[kernel.anchor]
    y = anchor.outputs[0]
    info = graph.tensors[y]
    if info.dtype != "float32" or not info.shape:
        return None
    buffer = Arg("ybuf", y, tuple(info.shape), info.dtype)
    loops = _matmul_row_loops(graph, kernel, args, [buffer], anchor)
    if loops is None or "FS_BLAS_SGEMM(" not in "".join(loops):
        return None
    plan, (c_side, _) = _row_plan(graph, kernel, {**args, y: buffer}, outs, frozenset({y}))
    return (f"    float* ybuf = (float*)malloc(sizeof(float) * {max(1, buffer.size)}LL);\n"
            + "".join(x + "\n" for x in loops) + _c_rows(plan, c_side) + "    free(ybuf);\n")


def _row_shape(graph: Graph, nodes: list[Node]) -> tuple[int, int]:
    """(rows, row length) shared by the kernel's reductions (lowering checked they agree)."""
    from fusesearch.lowering import reduced_rows

    shapes = [reduced_rows(graph, n) for n in nodes if n.kind.name == "REDUCE"]
    shapes = [s for s in shapes if isinstance(s, tuple)]
    if not shapes:
        raise CodegenRefused("rowwise kernel without a row reduction")
    return max(shapes, key=lambda s: s[1])


def _full_index(e: _Emitter, tensor: str, plan: _RowPlan, j: str) -> tuple[str, ...]:
    """Index of `tensor` (rows x L elements, row-major) at row r, column j."""
    shape = e.info(tensor).shape
    if math.prod(shape) != plan.rows * plan.length:
        raise CodegenRefused(f"'{tensor}' is neither a row nor a full tensor of the rowwise kernel")
    inner, split = 1, len(shape)
    while split > 0 and inner < plan.length:
        split -= 1
        inner *= shape[split]
    if inner == plan.length:  # rows over the leading dims, the row over the trailing ones: the
        return e.unflatten("r", shape[:split]) + e.unflatten(j, shape[split:])  # row's index is j's alone
    return e.unflatten(f"r * {plan.length}LL + {j}", shape)


def _row_body(e: _Emitter, plan: _RowPlan, body, c_target: bool) -> tuple[list[str], str]:
    e.lines = []
    e.push()
    plan.c_target = c_target
    value = body("j")
    plan.c_target = False
    e.pop()
    lines, e.lines = e.lines, []
    return lines, value


def _row_loop(e: _Emitter, plan: _RowPlan, body, combine: str, init: str, acc: str, cache: str = "") -> None:
    """acc over j of body(j), into plan.c and plan.cu: the same statements in two skeletons. Each
    reads rows cached by earlier loops and caches `cache`'s row on its first pass — C in a local
    buffer, CUDA in shared memory (each thread writes and later reads its own j's) — so a row of
    a computed tensor (a GEMM's output under a Softmax) is computed once, not once per pass."""
    cu_lines, cu_value = _row_body(e, plan, body, False)
    c_lines, c_value = _row_body(e, plan, body, True)
    buffer = cu_buffer = ""
    if cache and cache not in plan.cached and plan.length <= MAX_HOIST:
        buffer = f"rb{len(plan.cached)}"
        c_lines.append(f"{buffer}[j] = {c_value};")
        c_value = f"{buffer}[j]"  # evaluated once: the reduction reads it back
    smem = 4 * plan.length * (len(plan.cu_cached) + 1)
    if cache and cache not in plan.cu_cached and smem <= MAX_ROW_SMEM:
        cu_buffer = f"rs{len(plan.cu_cached)}"
        cu_lines.append(f"{cu_buffer}[j] = {cu_value};")
        cu_value = f"{cu_buffer}[j]"
    head = [f"float {buffer}[{plan.length}];"] if buffer else []
    cu_head = [f"__shared__ float {cu_buffer}[{plan.length}];"] if cu_buffer else []
    is_max = "fmax" in combine  # C: a compare-select max vectorizes (fmaxf does not); acc is never NaN
    c_combine = f"({c_value} > {acc} ? {c_value} : {acc})" if is_max else combine.format(acc, c_value)
    simd = [f"#pragma omp simd reduction({'max' if is_max else '+'}:{acc})"] if _flat_loop(c_lines) else []
    plan.c += [*head, f"float {acc} = {init};", *simd,
               f"for (long long j = 0; j < {plan.length}LL; ++j) {{",
               *["    " + x for x in c_lines + [f"{acc} = {c_combine};"]], "}"]
    plan.cu += [*cu_head, f"float {acc} = {init};",
                f"for (long long j = threadIdx.x; j < {plan.length}LL; j += blockDim.x) {{",
                *["    " + x for x in cu_lines + [f"{acc} = {combine.format(acc, cu_value)};"]], "}",
                f"{acc} = block_reduce({acc}, {1 if 'fmax' in combine else 0});"]
    if buffer:
        plan.cached[cache] = buffer
    if cu_buffer:
        plan.cu_cached[cache] = cu_buffer


def _flat_loop(body: list[str]) -> bool:
    """A loop body with no loop or OpenMP construct of its own (simd constructs do not nest)."""
    return not any(x.lstrip().startswith(("for ", "#pragma", "FS_SIMD")) for x in body)


def _scalar(e: _Emitter, plan: _RowPlan, expr: str) -> str:
    e.count += 1
    name = f"s{e.count}"
    plan.c.append(f"float {name} = {expr};")
    plan.cu.append(f"float {name} = {expr};")
    return name


def _reduction(e: _Emitter, node: Node, plan: _RowPlan) -> None:
    x = node.inputs[0]
    op = node.op_type

    def at(j: str) -> str:
        if x in plan.rows_cached():
            return f"{plan.rows_cached()[x]}[{j}]"
        return e.value(x, _full_index(e, x, plan, j))

    computed = e.graph.producer(x) in e.members
    if op in ("ReduceMean", "ReduceSum", "ReduceMax", "GlobalAveragePool"):
        e.count += 1
        acc = f"s{e.count}"
        if op == "ReduceMax":
            _row_loop(e, plan, at, "fmaxf({0}, {1})", "-INFINITY", acc, x if computed else "")
        else:
            _row_loop(e, plan, at, "{0} + {1}", "0.0f", acc, x if computed else "")
        mean = op in ("ReduceMean", "GlobalAveragePool")
        e.row_scalars[node.outputs[0]] = _scalar(e, plan, f"{acc} / {plan.length}.0f") if mean else acc
        return
    if op in ("Softmax", "LogSoftmax"):
        _softmax(e, node, plan, at, x if computed else "")
        return
    if op == "LayerNormalization":
        _layernorm(e, node, plan, at, x if computed else "")
        return
    if op in _MORE_ROW_OPS:
        _row_reduction(e, node, plan, at, x if computed else "")
        return
    raise CodegenRefused(f"{node.name}({op}) has no row-wise code generator yet")


# more row reductions: (the term summed or maximized, "sum" | "max", the result from the total)
_ROW_REDUCTIONS = {
    "GlobalMaxPool": ("{0}", "max", "{0}"), "ReduceMin": ("(-{0})", "max", "(-{0})"),
    "ReduceL1": ("fabsf({0})", "sum", "{0}"), "ReduceL2": ("({0} * {0})", "sum", "sqrtf({0})"),
    "ReduceSumSquare": ("({0} * {0})", "sum", "{0}"), "ReduceLogSum": ("{0}", "sum", "logf({0})"),
}


def _row_reduction(e, node, plan, at, cache: str) -> None:
    """A reduction of the table above; ReduceLogSumExp (a max pass, then Σ exp(x - max));
    GlobalLpPool ((Σ |x|^p)^(1/p)); the normalizations of `_row_normalization` (row ops)."""
    if node.op_type in _ROW_NORMALIZATIONS:
        _row_normalization(e, node, plan, at, cache)
        return
    if node.op_type in ("ArgMax", "ArgMin"):
        e.row_scalars[node.outputs[0]] = _arg_reduction(e, node, plan, at)
        return
    if node.op_type == "Hardmax":  # one at the row's first maximum (the row is the last axis)
        best = _arg_reduction(e, node, plan, at)
        e.row_ops[node.outputs[0]] = lambda idx, xv=None: f"(({idx[-1]}) == {best} ? 1.0f : 0.0f)"
        e.row_sources[node.outputs[0]] = node.inputs[0]
        return
    e.count += 1
    acc = f"s{e.count}"
    if node.op_type == "GlobalLpPool":
        p = float(node.attrs.get("p", 2))
        term = {1.0: "fabsf({0})", 2.0: "({0} * {0})"}.get(p, f"powf(fabsf({{0}}), {_lit(p)})")
        result = {1.0: "{0}", 2.0: "sqrtf({0})"}.get(p, f"powf({{0}}, {_lit(1.0 / p)})")
        _row_loop(e, plan, lambda j: term.format(at(j)), "{0} + {1}", "0.0f", acc)
        e.row_scalars[node.outputs[0]] = acc if result == "{0}" else _scalar(e, plan, result.format(acc))
        return
    if node.op_type == "ReduceLogSumExp":
        _row_loop(e, plan, at, "fmaxf({0}, {1})", "-INFINITY", acc, cache)
        e.count += 1
        total = f"s{e.count}"
        _row_loop(e, plan, lambda j: f"expf({at(j)} - {acc})", "{0} + {1}", "0.0f", total)
        e.row_scalars[node.outputs[0]] = _scalar(e, plan, f"{acc} + logf({total})")
        return
    term, kind, result = _ROW_REDUCTIONS[node.op_type]
    body = at if term == "{0}" else (lambda j: term.format(at(j)))
    cached = cache if term == "{0}" else ""  # a row cache holds the input itself, not a term of it
    if kind == "max":
        _row_loop(e, plan, body, "fmaxf({0}, {1})", "-INFINITY", acc, cached)
    else:
        _row_loop(e, plan, body, "{0} + {1}", "0.0f", acc, cached)
    e.row_scalars[node.outputs[0]] = acc if result == "{0}" else _scalar(e, plan, result.format(acc))


_CU_BLOCK_ARGBEST = f"""
__device__ void block_argbest(float* v, long long* i, int is_min, int last) {{
    __shared__ float bv[{THREADS}];
    __shared__ long long bi[{THREADS}];
    __syncthreads();
    bv[threadIdx.x] = *v;
    bi[threadIdx.x] = *i;
    __syncthreads();
    for (int s = blockDim.x >> 1; s > 0; s >>= 1) {{
        if (threadIdx.x < s) {{
            float v1 = bv[threadIdx.x], v2 = bv[threadIdx.x + s];
            long long i1 = bi[threadIdx.x], i2 = bi[threadIdx.x + s];
            if (i2 >= 0 && (i1 < 0 || (is_min ? v2 < v1 : v2 > v1) || (v2 == v1 && (last ? i2 > i1 : i2 < i1)))) {{
                bv[threadIdx.x] = v2;
                bi[threadIdx.x] = i2;
            }}
        }}
        __syncthreads();
    }}
    *v = bv[0];
    *i = bi[0];
    __syncthreads();
}}
"""


def _arg_reduction(e, node, plan, at) -> str:
    """The row's ArgMax / ArgMin (Hardmax: ArgMax), a per-row variable: each thread (C: the one
    loop) keeps its best value and the index of its first (select_last_index: last) occurrence;
    CUDA then combines the threads' pairs in shared memory (`block_argbest`, a tree over THREADS
    slots; index -1 = no element)."""
    e.count += 1
    v, i = f"s{e.count}", f"a{e.count}"
    is_min = node.op_type == "ArgMin"
    last = int(node.attrs.get("select_last_index", 0))
    cmp = ("<" if is_min else ">") + ("=" if last else "")
    head = [f"float {v} = 0.0f;", f"long long {i} = -1;"]
    for c_target, loop, target in ((True, "for (long long j = 0; j < {n}LL; ++j) {{", plan.c),
                                   (False, "for (long long j = threadIdx.x; j < {n}LL; j += blockDim.x) {{", plan.cu)):
        lines, value = _row_body(e, plan, at, c_target)
        target += [*head, loop.format(n=plan.length), *["    " + x for x in lines],
                   f"    if ({i} < 0 || {value} {cmp} {v}) {{ {v} = {value}; {i} = j; }}", "}"]
    plan.cu.append(f"block_argbest(&{v}, &{i}, {int(is_min)}, {last});")
    return i


def _moments(e, plan, at, cache: str, epsilon: float) -> tuple[str, str]:
    """The row's mean and 1/sqrt(variance + epsilon): a sum pass, then a pass of squared deviations."""
    e.count += 1
    total = f"s{e.count}"
    _row_loop(e, plan, at, "{0} + {1}", "0.0f", total, cache)
    mean = _scalar(e, plan, f"{total} / {plan.length}.0f")
    e.count += 1
    sq = f"s{e.count}"
    _row_loop(e, plan, lambda j: f"(({at(j)} - {mean}) * ({at(j)} - {mean}))", "{0} + {1}", "0.0f", sq, cache)
    return mean, _scalar(e, plan, f"1.0f / sqrtf({sq} / {plan.length}.0f + {_lit(epsilon)})")


def _row_normalization(e, node, plan, at, cache: str) -> None:
    """InstanceNormalization: a row per (N, C) over the spatial positions, normalized, then the
    channel's scale and bias. MeanVarianceNormalization: normalized only (over inner axes).
    RMSNormalization: x / sqrt(mean(x²) + epsilon) · scale. LpNormalization (p = 1 or 2): the row
    divided by its p-norm."""
    x, out = node.inputs[0], node.outputs[0]
    if node.op_type == "MeanVarianceNormalization":  # ONNX: (x - mean) / (sqrt(var) + 1e-9)
        mean, inv = _moments(e, plan, at, cache, 1e-9)

        def normalized(idx, xv=None):
            return f"(({xv or e.value(x, idx)} - {mean}) * {inv})"
    elif node.op_type == "RMSNormalization":
        e.count += 1
        acc = f"s{e.count}"
        _row_loop(e, plan, lambda j: f"({at(j)} * {at(j)})", "{0} + {1}", "0.0f", acc)
        eps = _lit(node.attrs.get("epsilon", 1e-5))
        inv = _scalar(e, plan, f"1.0f / sqrtf({acc} / {plan.length}.0f + {eps})")

        def normalized(idx, xv=None):
            return f"({xv or e.value(x, idx)} * {inv} * {e.input_at(node, 1, idx)})"
    elif node.op_type == "InstanceNormalization":
        mean, inv = _moments(e, plan, at, cache, float(node.attrs.get("epsilon", 1e-5)))

        def normalized(idx, xv=None):
            c = (idx[1],)
            scale, bias = e.value(node.inputs[1], c), e.value(node.inputs[2], c)
            return f"((({xv or e.value(x, idx)} - {mean}) * {inv}) * {scale} + {bias})"
    else:
        p = int(node.attrs.get("p", 2))
        if p not in (1, 2):
            raise CodegenRefused(f"{node.name}(LpNormalization) p={p} is not a norm (p is 1 or 2)")
        e.count += 1
        acc = f"s{e.count}"
        _row_loop(e, plan, (lambda j: f"fabsf({at(j)})") if p == 1 else (lambda j: f"({at(j)} * {at(j)})"),
                  "{0} + {1}", "0.0f", acc)
        norm = acc if p == 1 else _scalar(e, plan, f"sqrtf({acc})")

        def normalized(idx, xv=None):
            return f"({xv or e.value(x, idx)} / {norm})"
    e.row_ops[out] = normalized
    e.row_sources[out] = x


_ROW_NORMALIZATIONS = frozenset({"InstanceNormalization", "LpNormalization", "MeanVarianceNormalization",
                                 "RMSNormalization"})
_MORE_ROW_OPS = frozenset({"ReduceLogSumExp", "GlobalLpPool", "ArgMax", "ArgMin", "Hardmax", *_ROW_NORMALIZATIONS,
                           *_ROW_REDUCTIONS})
ROW_OPS = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "GlobalAveragePool", "Softmax", "LogSoftmax",
                     "LayerNormalization", *_MORE_ROW_OPS})
"""The REDUCE ops `_reduction` generates (row by row)."""
GENERATED_OPS = frozenset(_UNARY) | frozenset(_BINARY) | frozenset(_VARIADIC) | frozenset(_HANDLERS) | ROW_OPS
"""Every op the generator has code for (its tables and handlers, and the row reductions)."""


def _softmax(e, node, plan, at, cache: str) -> None:
    e.count += 1
    mx = f"s{e.count}"
    _row_loop(e, plan, at, "fmaxf({0}, {1})", "-INFINITY", mx, cache)
    e.count += 1
    total = f"s{e.count}"
    softmax = node.op_type == "Softmax"
    # Softmax caches each exp on the sum's pass; a written output then costs one multiply per element
    _row_loop(e, plan, lambda j: f"expf({at(j)} - {mx})", "{0} + {1}", "0.0f", total,
              _exp_row(node.outputs[0]) if softmax else "")
    x = node.inputs[0]
    e.row_sources[node.outputs[0]] = x
    if softmax:
        e.row_scalars[_exp_row(node.outputs[0])] = _scalar(e, plan, f"1.0f / {total}")
        e.row_ops[node.outputs[0]] = lambda idx, xv=None: f"(expf({xv or e.value(x, idx)} - {mx}) / {total})"
    else:
        e.row_ops[node.outputs[0]] = lambda idx, xv=None: f"({xv or e.value(x, idx)} - {mx} - logf({total}))"


def _exp_row(softmax_output: str) -> str:
    """The key of a Softmax's cached row of exponentials (and of its 1/sum in row_scalars)."""
    return softmax_output + "#exp"


def _layernorm(e, node, plan, at, cache: str) -> None:
    mean, inv = _moments(e, plan, at, cache, float(node.attrs.get("epsilon", 1e-5)))
    x = node.inputs[0]

    def normalized(idx, xv=None):
        expr = f"(({xv or e.value(x, idx)} - {mean}) * {inv})"
        if len(node.inputs) > 1 and node.inputs[1]:
            expr = f"({expr} * {e.input_at(node, 1, idx)})"
        if len(node.inputs) > 2 and node.inputs[2]:
            expr = f"({expr} + {e.input_at(node, 2, idx)})"
        return expr

    e.row_ops[node.outputs[0]] = normalized
    e.row_sources[node.outputs[0]] = x
    for out, scalar in zip(node.outputs[1:3], (mean, inv), strict=False):  # optional Mean, InvStdDev
        if out:
            e.row_scalars[out] = scalar


def _row_output(e: _Emitter, out: Arg, plan: _RowPlan) -> None:
    if out.size == plan.rows:
        e.lines = []
        e.push()
        v = e.row_scalars.get(out.tensor) or e.value(out.tensor, e.unflatten("r", out.shape))
        e.pop()
        lines, e.lines = e.lines, []
        plan.c += [*lines, f"{out.name}[r] = {v};"]
        plan.cu += [*lines, f"if (threadIdx.x == 0) {out.name}[r] = {v};"]
        return
    def body(j: str) -> str:
        source = e.row_sources.get(out.tensor)
        cached = plan.rows_cached()
        if _exp_row(out.tensor) in cached:
            return f"({cached[_exp_row(out.tensor)]}[{j}] * {e.row_scalars[_exp_row(out.tensor)]})"
        if source in cached and e.info(source).shape == out.shape:
            return e.row_ops[out.tensor](_full_index(e, out.tensor, plan, j), f"{cached[source]}[{j}]")
        return e.value(out.tensor, _full_index(e, out.tensor, plan, j))

    store = f"{out.name}[r * {plan.length}LL + j] = "
    cu_lines, cu_value = _row_body(e, plan, body, False)
    c_lines, c_value = _row_body(e, plan, body, True)
    plan.c += [*(["#pragma omp simd"] if _flat_loop(c_lines) else []), f"for (long long j = 0; j < {plan.length}LL; ++j) {{",
               *["    " + x for x in c_lines + [store + c_value + ";"]], "}"]
    plan.cu += [f"for (long long j = threadIdx.x; j < {plan.length}LL; j += blockDim.x) {{",
                *["    " + x for x in cu_lines + [store + cu_value + ";"]], "}"]


def _side_outputs(graph: Graph, kernel: Kernel, outs, plan: _RowPlan) -> list[Arg]:
    """Outputs of a rowwise kernel of neither row nor full size: elementwise work that does not
    depend on a reduction (e.g. a mask computed beside a LayerNorm). Written by their own
    pointwise loop; anything else is refused."""
    reduce_ids = {i for i in kernel.nodes if graph.nodes[i].kind.name == "REDUCE"}
    side = []
    for out in outs:
        if out.size in (plan.rows, plan.rows * plan.length):
            continue
        producer = graph.producer(out.tensor)
        if any(graph.reaches(r, producer) or r == producer for r in reduce_ids):
            raise CodegenRefused(f"'{out.tensor}' is neither a row nor a full tensor of the rowwise kernel")
        side.append(out)
    return side


# -- CUDA: shared-memory tiled gemm / conv, vectorized pointwise ------------------------------

@dataclass(frozen=True)
class _Contraction:
    """An anchor seen as z independent GEMMs Y_z[m, n] = Σ_k A_z[m, k]·B_z[k, n] (z: batch of a
    MatMul, group of a Conv). Each callable emits into the emitter and returns an expression."""

    z: int
    m: int
    n: int
    k: int
    setup: object  # (e, z) -> None: per-block index variables
    a: object  # (e, m, k) -> value of A (prologue applied; 0 outside the padding)
    b: object  # (e, k, n) -> value of B
    y_index: object  # (e, m, n) -> index tuple of the anchor output
    a_m_contiguous: bool = False  # A's neighbours in memory are along M (Conv pixels, Gemm transA)


def _contraction(graph: Graph, anchor: Node) -> _Contraction | None:
    """The anchor as a batched GEMM, or None (1-D MatMul operands, ConvTranspose: direct kernel)."""
    x, w = anchor.inputs[0], anchor.inputs[1]
    sa, sb = graph.tensors[x].shape, graph.tensors[w].shape
    y = anchor.outputs[0]
    ys = graph.tensors[y].shape
    state: dict = {}
    if anchor.op_type == "MatMul":
        if len(sa) < 2 or len(sb) < 2:
            return None

        def setup(e, z):
            state["zb"] = e.unflatten(z, ys[:-2]) if len(ys) > 2 else ()

        return _Contraction(
            math.prod(ys[:-2]), ys[-2], ys[-1], sa[-1], setup,
            lambda e, m, k: e.value(x, e.broadcast(state["zb"], sa[:-2]) + (m, k)),
            lambda e, k, n: e.value(w, e.broadcast(state["zb"], sb[:-2]) + (k, n)),
            lambda e, m, n: state["zb"] + (m, n))
    if anchor.op_type == "Gemm":
        ta, tb = int(anchor.attrs.get("transA", 0)), int(anchor.attrs.get("transB", 0))
        return _Contraction(
            1, ys[0], ys[1], sa[0] if ta else sa[1], lambda e, z: None,
            lambda e, m, k: e.value(x, (k, m) if ta else (m, k)),
            lambda e, k, n: e.value(w, (n, k) if tb else (k, n)),
            lambda e, m, n: (m, n), bool(ta))
    if anchor.op_type != "Conv":
        return None
    group = int(anchor.attrs.get("group", 1))
    cin_g, cout_g = sa[1] // group, ys[1] // group
    kernel = tuple(anchor.attrs.get("kernel_shape") or sb[2:])
    taps = [cin_g, *kernel]
    pixels = (ys[0], *ys[2:])

    def conv_a(e, m, k):
        spatial, _, strides, dilations, pads = _conv_geometry(e, anchor, sa, sb, ys, False)
        p = e.unflatten(m, pixels)
        idx = (p[0], "0", *p[1:])
        return _conv_input(e, anchor, x, sa, idx, k, taps, (spatial, strides, pads, dilations), "gz", cin_g)

    def conv_b(e, k, n):
        parts = e.unflatten(k, taps)
        return e.value(w, (f"(gz * {cout_g}LL + {n})", *parts))

    def conv_y(e, m, n):
        p = e.unflatten(m, pixels)
        return (p[0], e.tmp("long long", f"gz * {cout_g}LL + {n}"), *p[1:])

    return _Contraction(group, math.prod(pixels), cout_g, math.prod(taps), lambda e, z: None,
                        conv_a, conv_b, conv_y, True)


def _anchor_derived(graph: Graph, kernel: Kernel, anchor: Node) -> set[str] | None:
    """Tensors of the group computed from the anchor's output at the same flat position (through
    elementwise/broadcast ops and views of equal size), or None when some epilogue op remaps
    positions (a Transpose, a Softmax...): the tiled skeleton then does not apply."""
    y = anchor.outputs[0]
    size = graph.tensors[y].size
    derived = {y}
    for i in kernel.nodes:
        n = graph.nodes[i]
        if i == anchor.id or not any(t in derived for t in n.inputs):
            continue
        same = all(graph.tensors[t].size == size for t in n.outputs if t) and all(
            graph.tensors[t].size == size for t in n.inputs if t in derived)
        if not same or not (n.kind.name in ("ELEMWISE", "BROADCAST") or n.op_type in _VIEW_OPS):
            return None
        derived.update(t for t in n.outputs if t)
    return derived


_VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze"})


def _threads(tm: int, tn: int) -> tuple[int, int]:
    """(RX, RY): threads along N and M; RX·RY = min(THREADS, tm·tn), both divide their tile."""
    total = min(THREADS, tm * tn)
    for rx in (16, 32, 64, 128, 256, 8, 4, 2, 1):
        if rx <= tn and total % rx == 0 and total // rx <= tm and tm % (total // rx) == 0 and tn % rx == 0:
            return rx, total // rx
    raise CodegenRefused(f"no thread layout for a {tm}x{tn} tile")


def _tiled(graph: Graph, kernel: Kernel, name: str, ins, outs, args):
    """CUDA for gemm/conv: a block computes a BM×BN tile of one z (batch or group); per K step the
    block stages A (BK×BM, prologue applied; threads read A along whichever of M or K is contiguous
    in memory) and B (BK×BN) in shared memory, each thread then
    accumulates a TM×TN register micro-tile (rows ty+i·RY, columns tx+j·RX: coalesced stores,
    conflict-free shared reads), and the epilogue runs on the registers before the one store.
    Split-K is not generated (the tile count decides the grid). None when not applicable."""
    anchor = graph.nodes[kernel.anchor]
    c = _contraction(graph, anchor)
    derived = _anchor_derived(graph, kernel, anchor)
    if c is None or derived is None or c.z > MAX_GRID_YZ:
        return None
    tm, tn, tk = (kernel.tile + (32, 32, 32))[:3]
    rx, ry = _threads(tm, tn)
    if -(-c.m // tm) > MAX_GRID_YZ:
        return None
    ti, tj = tm // ry, tn // rx
    nthreads = rx * ry
    e = _Emitter(graph, kernel, args)
    c.setup(e, "gz")
    setup = e.lines

    def section(fn) -> tuple[list[str], str]:
        e.lines = []
        e.push()
        v = fn()
        e.pop()
        lines, e.lines = e.lines, []
        return lines, v

    a_lines, a_val = section(lambda: c.a(e, "gm", "gk"))
    b_lines, b_val = section(lambda: c.b(e, "gk", "gn"))
    main = [o for o in outs if o.tensor in derived]
    side = [o for o in outs if o.tensor not in derived]
    y_shape = graph.tensors[anchor.outputs[0]].shape

    def epilogue():
        y_idx = c.y_index(e, "gm", "gn")
        flat = e.tmp("long long", e.flat(y_idx, y_shape))
        for o in main:
            idx = y_idx if o.shape == y_shape else e.unflatten(flat, o.shape)
            e.lines.append(f"{o.name}[{flat}] = {e.value(o.tensor, idx)};")

    e.acc_value = "acc[i][j]"
    epi_lines, _ = section(epilogue)
    e.acc_value = ""
    side_lines = _side_loops(graph, kernel, args, side)
    body = [
        f"__shared__ float As[{tk}][{tm}];",
        f"__shared__ float Bs[{tk}][{tn}];",
        f"const int tid = threadIdx.x, tx = tid % {rx}, ty = tid / {rx};",
        f"const long long m0 = (long long)blockIdx.y * {tm}, n0 = (long long)blockIdx.x * {tn}, gz = blockIdx.z;",
        *setup,
        f"float acc[{ti}][{tj}];",
        "#pragma unroll",
        f"for (int i = 0; i < {ti}; ++i)",
        "    #pragma unroll",
        f"    for (int j = 0; j < {tj}; ++j) acc[i][j] = 0.0f;",
        f"for (long long k0 = 0; k0 < {c.k}LL; k0 += {tk}) {{",
        f"    for (int l = tid; l < {tm * tk}; l += {nthreads}) {{",
        (f"        const int kk = l / {tm}, mm = l % {tm};" if c.a_m_contiguous else
         f"        const int mm = l / {tk}, kk = l % {tk};"),
        "        const long long gm = m0 + mm, gk = k0 + kk;",
        "        float v = 0.0f;",
        f"        if (gm < {c.m}LL && gk < {c.k}LL) {{",
        *["            " + x for x in a_lines],
        f"            v = {a_val};",
        "        }",
        "        As[kk][mm] = v;",
        "    }",
        f"    for (int l = tid; l < {tk * tn}; l += {nthreads}) {{",
        f"        const int kk = l / {tn}, nn = l % {tn};",
        "        const long long gk = k0 + kk, gn = n0 + nn;",
        "        float v = 0.0f;",
        f"        if (gk < {c.k}LL && gn < {c.n}LL) {{",
        *["            " + x for x in b_lines],
        f"            v = {b_val};",
        "        }",
        "        Bs[kk][nn] = v;",
        "    }",
        "    __syncthreads();",
        "    #pragma unroll 4",
        f"    for (int kk = 0; kk < {tk}; ++kk) {{",
        f"        float a[{ti}], b[{tj}];",
        "        #pragma unroll",
        f"        for (int i = 0; i < {ti}; ++i) a[i] = As[kk][ty + i * {ry}];",
        "        #pragma unroll",
        f"        for (int j = 0; j < {tj}; ++j) b[j] = Bs[kk][tx + j * {rx}];",
        "        #pragma unroll",
        f"        for (int i = 0; i < {ti}; ++i)",
        "            #pragma unroll",
        f"            for (int j = 0; j < {tj}; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);",
        "    }",
        "    __syncthreads();",
        "}",
        "#pragma unroll",
        f"for (int i = 0; i < {ti}; ++i) {{",
        "    #pragma unroll",
        f"    for (int j = 0; j < {tj}; ++j) {{",
        f"        const long long gm = m0 + ty + i * {ry}, gn = n0 + tx + j * {rx};",
        f"        if (gm < {c.m}LL && gn < {c.n}LL) {{",
        *["            " + x for x in epi_lines],
        "        }",
        "    }",
        "}",
        *side_lines,
    ]
    src = (f"{_CU_PRELUDE}\nextern \"C\" __global__ void "
           f"{name}({_signature(ins, outs, '__restrict__')}) {{\n{_indent(body, 1)}\n}}\n")
    grid = (-(-c.n // tn), -(-c.m // tm), c.z)
    return src, grid, (nthreads, 1, 1), "tiled"


def _side_loops(graph: Graph, kernel: Kernel, args, side) -> list[str]:
    """Outputs that do not depend on the anchor (a prologue value also used outside): a
    grid-stride loop over all blocks of the launch, after the tile's work."""
    lines = []
    for out in side:
        e = _Emitter(graph, kernel, args)
        idx = e.unflatten("i", out.shape)
        v = e.value(out.tensor, idx)
        lines += ["{",
                  "    const long long bid = blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);",
                  "    const long long blocks = (long long)gridDim.x * gridDim.y * gridDim.z;",
                  f"    for (long long i = bid * blockDim.x + threadIdx.x; i < {out.size}LL; i += blocks * blockDim.x) {{",
                  *["        " + x for x in e.lines + [f"{out.name}[i] = {v};"]], "    }", "}"]
    return lines


VECTOR = 4  # float4: one 16-byte load or store per tensor and thread


def _vectorized(graph: Graph, kernel: Kernel, name: str, ins, outs, args):
    """CUDA for a pointwise kernel of elementwise/broadcast ops whose outputs are float32 of one
    shape S with |S| % 4 == 0: each thread handles 4 consecutive elements, loading every float32
    input of shape S as one float4 (inputs of other shapes are broadcast, loaded one by one) and
    storing each output as one float4. None when not applicable (the grid-stride loop stays)."""
    shape = outs[0].shape if outs else ()
    size = math.prod(shape)
    nodes = [graph.nodes[i] for i in kernel.nodes]
    if (not outs or size % VECTOR or size == 0 or any(o.shape != shape or o.dtype != "float32" for o in outs)
            or any(n.kind.name not in ("ELEMWISE", "BROADCAST") for n in nodes)):
        return None
    full = [a for a in ins if a.shape == shape and a.dtype == "float32"]
    if not full:
        return None
    quads = size // VECTOR
    lines = [f"const float4 q{a.name} = reinterpret_cast<const float4*>({a.name})[q];" for a in full]
    results: dict[str, list[str]] = {o.name: [] for o in outs}
    count = 0
    for lane, comp in enumerate("xyzw"):  # four lanes, one emitter each (temporaries numbered on)
        e = _Emitter(graph, kernel, args)
        e.count = count
        e.vec_loads = {a.tensor: f"q{a.name}.{comp}" for a in full}
        idx = e.unflatten(f"(q * {VECTOR}LL + {lane})", shape)
        for o in outs:
            results[o.name].append(e.value(o.tensor, idx))
        lines += e.lines
        count = e.count
    body = [f"for (long long q = blockIdx.x * (long long)blockDim.x + threadIdx.x; q < {quads}LL;"
            " q += (long long)blockDim.x * gridDim.x) {"]
    body += ["    " + x for x in lines]
    for o in outs:
        vals = results[o.name]
        body.append(f"    reinterpret_cast<float4*>({o.name})[q] = make_float4({', '.join(vals)});")
    body.append("}")
    src = (f"{_CU_PRELUDE}\nextern \"C\" __global__ void {name}({_signature(ins, outs, '__restrict__')}) {{\n"
           f"{_indent(body, 1)}\n}}\n")
    return src, (_stride_blocks(quads), 1, 1), (THREADS, 1, 1), "vectorized"


# -- one CUDA module for many kernels ---------------------------------------------------------

def module_namespace(kernel: GeneratedKernel) -> str:
    """The C++ namespace a kernel's source sits in inside a module (`cuda_module`)."""
    return f"fs_ns_{kernel.name}"


def cuda_module(kernels) -> str:
    """One CUDA translation unit holding every kernel (names must be unique): each kernel's
    `cuda_source` unchanged inside its own namespace (its device helpers — `block_reduce`,
    `warp_reduce` — are defined once per kernel and would collide otherwise), each macro it
    defines undefined first (two kernels may define one differently). The kernels are
    `extern "C"`, so NVRTC and the emulator find them by their plain names."""
    names = [k.name for k in kernels]
    if len(set(names)) != len(names):
        raise ValueError(f"kernel names repeat in one module: {sorted({n for n in names if names.count(n) > 1})}")
    parts = []
    for k in kernels:
        macros = dict.fromkeys(re.findall(r"^\s*#\s*define\s+(\w+)", k.cuda_source, flags=re.M))
        parts.append("".join(f"#undef {m}\n" for m in macros)
                     + f"namespace {module_namespace(k)} {{\n{k.cuda_source}\n}}  // namespace {module_namespace(k)}\n")
    return "\n".join(parts)
