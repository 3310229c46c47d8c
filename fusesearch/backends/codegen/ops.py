"""The op tables: for each ONNX op, the C expression of its output at an index, given its inputs'
values (elementwise templates, index remapping of the injective ops, guarded reads of Pad/Trilu,
Resize's weighted neighbours, and the anchors' inline dot products used by the `direct` skeleton).
A nearest Resize axis scaled by an integer at asymmetric coordinates with floor (PyTorch's
nearest upsampling) reads its source at i / s in integers, checked at generation time against the
float coordinate it replaces: a float floor, clamp and conversion per element kept the loop
scalar (yolo-neck's 128x10x10 -> 20x20 upsample took 76 us, now 9).

Invariants: a handler emits only through the emitter it is given (temporaries and loads) and
returns one expression; an op without a handler is refused with its name.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

import numpy as np

from fusesearch.backends.codegen.base import (
    CodegenRefused,
    _lit,
    compute_dtype,
    load_expr,
    round_expr,
)
from fusesearch.ir.graph import Node
from fusesearch.ir.pool import pool_window

if TYPE_CHECKING:
    from fusesearch.backends.codegen.emitter import _Emitter


# -- ops --------------------------------------------------------------------------------------

_UNARY = {
    "Relu": "FS_FMAX({0}, 0.0f)", "Neg": "(-{0})", "Abs": "fabsf({0})", "Exp": "fs_expf({0})", "Log": "logf({0})",
    "Sqrt": "sqrtf({0})", "Erf": "fs_erff({0})", "Tanh": "tanhf({0})", "Sigmoid": "(1.0f / (1.0f + fs_expf(-{0})))",
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
    if op == "Mul" and node.id in e.gelus:  # GELU's four ops as one call (`schedule.gelu_chains`)
        return f"fs_gelu2f({e.value(e.gelus[node.id].x, idx)})"
    if op in _UNARY:
        return _UNARY[op].format(e.input_at(node, 0, idx))
    if op in ("Sum", "Mean") or (op in ("Max", "Min") and len(node.inputs) != 2):
        return _variadic(e, node, idx)
    if op in ("Pow", "Div") and compute_dtype(e.info(tensor).dtype) == "float32":
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
    return f"({x} >= 0.0f ? {x} : {_lit(n.attrs.get('alpha', 1.0))} * (fs_expf({x}) - 1.0f))"


def _gelu(e, n, t, idx):
    x = e.input_at(n, 0, idx)
    if n.attrs.get("approximate", "none") == "tanh":
        return f"(0.5f * {x} * (1.0f + tanhf(0.7978845608f * ({x} + 0.044715f * {x} * {x} * {x}))))"
    return f"(0.5f * fs_gelu2f({x}))"


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
    return round_expr(e.info(t).dtype, f"({e.ctype(t)})({e.input_at(n, 0, idx)})")


def _where(e, n, t, idx):
    return f"({e.input_at(n, 0, idx)} ? {e.input_at(n, 1, idx)} : {e.input_at(n, 2, idx)})"


def reshape_blocks(out_shape, src_shape) -> list[tuple[slice, slice]] | None:
    """The runs of dimensions that a reshape maps onto each other: pairs (output dims, source dims)
    with equal products, as short as possible, in order ([1,128,12,64] from [1,128,768]: [1]↔[1],
    [128]↔[128], [12,64]↔[768]). None for an empty tensor (`_Emitter.view_index` uses them)."""
    if 0 in out_shape or 0 in src_shape:
        return None
    blocks, i, j = [], 0, 0
    while i < len(out_shape) or j < len(src_shape):
        i0, j0, po, ps = i, j, 1, 1
        if i < len(out_shape):
            po, i = out_shape[i], i + 1
        if j < len(src_shape):
            ps, j = src_shape[j], j + 1
        while po != ps:  # grow the smaller side until the products meet
            if po < ps and i < len(out_shape):
                po, i = po * out_shape[i], i + 1
            elif ps < po and j < len(src_shape):
                ps, j = ps * src_shape[j], j + 1
            else:
                return None  # the shapes hold different element counts
        blocks.append((slice(i0, i), slice(j0, j)))
    return blocks


def _reshape(e, n, t, idx):
    src = n.inputs[0]
    return e.value(src, e.view_index(idx, e.info(t).shape, e.info(src).shape))


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
    if t in e.pinned:  # the caller's loop covers one piece only (a conv's taps over its channels)
        k = e.pinned[t]
        return e.value(parts[k], idx[:axis] + (f"({idx[axis]} - {offsets[k]}LL)",) + idx[axis + 1:])
    result = e.tmp(e.ctype(t), "0")
    blocks = _concat_blocks(e, idx[axis], axis, offsets)
    for k, (x, off) in enumerate(zip(parts, offsets, strict=True)):
        hi = off + e.info(x).shape[axis]
        cond = f"{blocks[0]} < {hi // blocks[2]}LL" if blocks else f"{idx[axis]} < {hi}LL"
        e.lines.append(("if" if k == 0 else "else if") + f" ({cond}) {{" if k < len(parts) - 1 else "else {")
        e.push()
        local = idx[:axis] + (f"({idx[axis]} - {off}LL)",) + idx[axis + 1:]
        if blocks:  # the input's own block and the same lane: no division per lane
            e.channel_split[local[axis]] = (f"({blocks[0]} - {off // blocks[2]}LL)", blocks[1])
        e.lines.append(f"{result} = {e.value(x, local)};")
        e.pop()
        e.lines.append("}")
    return result


def _concat_blocks(e, c: str, axis: int, offsets: list[int]) -> tuple[str, str, int] | None:
    """(block index, lane, block) of a channel concat in an NCHWc loop whose channel index `c` the
    loop holds as a block and a lane (`_Emitter.channel_split`), every input starting on a
    boundary of the kernel's block (`schedule.nchwc_pointwise`): the choice of input is then the
    block's, invariant over the lanes (a branch GCC takes out of the vector loop); else None."""
    blocks = {lt.block for lt in e.layouts.values() if lt.blocked}
    if axis != 1 or c not in e.channel_split or len(blocks) != 1:
        return None
    (b,) = blocks
    if any(off % b for off in offsets):
        return None
    return (*e.channel_split[c], b)


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
        step = _integer_upscale(n, din, dout, scale, rounding)
        if step:  # i / step in integers: the same index, and a loop that vectorizes
            src_idx.append(e.tmp("long long", f"({i}) / {step}LL"))
            continue
        x = _resize_coordinate(n, i, din, dout, scale)
        r = {"floor": f"floorf({x})", "ceil": f"ceilf({x})", "round_prefer_floor": f"ceilf({x} - 0.5f)",
             "round_prefer_ceil": f"floorf({x} + 0.5f)"}[rounding]
        src_idx.append(e.tmp("long long", f"(long long)FS_FMIN(FS_FMAX({r}, 0.0f), {din - 1}.0f)"))
    return e.value(src, tuple(src_idx))


def _integer_upscale(n: Node, din: int, dout: int, scale: float, rounding: str) -> int:
    """The factor s of a nearest Resize axis whose source index is i / s in integers (PyTorch's
    nearest upsampling: asymmetric coordinates, floor, an integer scale), checked against the
    float expression the generic path computes (floorf((float)i / scale), float32 as in C) for
    every output index; 0 where that does not hold."""
    if (n.attrs.get("coordinate_transformation_mode", "half_pixel") != "asymmetric" or rounding != "floor"
            or dout % din or scale != dout // din):
        return 0
    step = dout // din
    i = np.arange(dout, dtype=np.int64)
    as_float = np.floor(i.astype(np.float32) / np.float32(scale)).astype(np.int64)
    return step if np.array_equal(np.minimum(as_float, din - 1), i // step) else 0


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
                    f"{acc} += {e.hoisted}[kq] * {load_expr(e.args[w].dtype, f'{e.args[w].name}[({co}) * {taps_n}LL + kq]')};"]
        return acc
    return _dot(e, math.prod(taps), term, init)


def _conv_input(e, n, x, xs, idx, k, taps, geometry, g, cin_g, channels_last: bool = False) -> str:
    """The (prologue-applied, zero-padded) input value under filter tap k of output idx; k over
    `taps` (c, r, s), or (r, s, c) `channels_last`."""
    spatial, strides, pads, dilations = geometry
    parts = e.unflatten(k, taps)
    ci, ks = (parts[-1], parts[:-1]) if channels_last else (parts[0], parts[1:])
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
    "Softplus": "(FS_FMAX({0}, 0.0f) + log1pf(fs_expf_le(-fabsf({0}))))",
    "Mish": "({0} * tanhf(FS_FMAX({0}, 0.0f) + log1pf(fs_expf_le(-fabsf({0})))))",  # x·tanh(softplus(x))
})
_BINARY.update({"BitwiseAnd": "({0} & {1})", "BitwiseOr": "({0} | {1})", "BitwiseXor": "({0} ^ {1})"})


def _typed_lit(e: _Emitter, tensor: str, value: float) -> str:
    """A constant in the C type of `tensor`: a float literal, or an integer / bool one."""
    dtype = compute_dtype(e.info(tensor).dtype)
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
    return f"({x} > 0.0f ? {_lit(gamma)} * {x} : {_lit(gamma * alpha)} * (fs_expf({x}) - 1.0f))"


def _celu(e, n, t, idx):
    x = e.input_at(n, 0, idx)
    a = _lit(n.attrs.get("alpha", 1.0))
    return f"(FS_FMAX({x}, 0.0f) + FS_FMIN(0.0f, {a} * (fs_expf({x} / {a}) - 1.0f)))"


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
    return f"({x} / (1.0f + fs_expf({_lit(-float(n.attrs.get('alpha', 1.0)))} * {x})))"


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
    rem = f"fmodf({a}, {b})" if compute_dtype(e.info(t).dtype) == "float32" else f"{a} % {b}"
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
    ci = e.tmp("long long", ci)
    blocks = _concat_blocks(e, c, 1, [channels])
    if blocks and n.attrs.get("mode", "DCR") == "DCR":  # whole channel blocks move: the block's lane is the output's
        per = channels // blocks[2]
        e.channel_split[ci] = (e.tmp("long long", f"({i} * {b}LL + {j}) * {per}LL + {blocks[0]}"), blocks[1])
    return e.value(n.inputs[0], (nb, ci, h, w))


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


# -- windowed pools: MaxPool / AveragePool (2-D, NCHW) -----------------------------------------

def _pool(e, n, t, idx):
    """A pool output element as an unrolled reduction over its window (geometry: `ir.pool`): an
    FS_FMAX chain over the taps (-INFINITY for one outside the input), or their sum divided by the
    window's count (a multiplication by its reciprocal when every window has the same count). Each
    tap reads `value(x, tap)`, so a producer in the group is inlined and recomputed per tap. A tap
    is bounds-checked only on the sides some window crosses: by a guarded read, or, in C loop nests
    (`window_clamp`), by reading a clamped position and bounding it by -INFINITY (max) or scaling
    it by 0 (sum) outside the input (no branch: the column loop vectorizes); an undilated max
    takes the clamped read as it is (the input's edge element, inside the same window: the max
    is unchanged, and no per-pixel bound is built); columns of the nest's interior loop
    (`window_cols`) are not checked at all."""
    x = n.inputs[0]
    window = pool_window(n.op_type, n.attrs, e.info(x).shape, e.info(t).shape, e.info(x).dtype,
                         len([o for o in n.outputs if o]))
    if isinstance(window, str):
        raise CodegenRefused(f"{n.name}({n.op_type}): {window}")
    nb, c, oh, ow = idx
    cols_unchecked = n.id in e.window_interior and ow == e.window_cols
    positions = []  # per axis: (position, clamped position, bounds check or "") per tap
    for axis, o, unchecked in zip(window.axes, (oh, ow), (False, cols_unchecked), strict=True):
        start = e.tmp("long long", f"({o}) * {axis.stride}LL - {axis.pad}LL") if axis.pad or axis.stride > 1 else o
        taps = []
        for k in range(axis.kernel):
            pos = f"({start} + {k * axis.dilation}LL)" if k * axis.dilation else start
            low = axis.needs_low_check(k) and not unchecked
            high = axis.needs_high_check(k) and not unchecked
            checks = " && ".join(([f"{pos} >= 0"] if low else []) + ([f"{pos} < {axis.extent}LL"] if high else []))
            clamped = pos
            if checks and e.window_clamp:
                clamped = e.tmp("long long", f"{pos} < 0 ? 0 : {pos}" if low and not high else
                                f"{pos} >= {axis.extent}LL ? {axis.extent - 1}LL : {pos}" if high and not low else
                                f"{pos} < 0 ? 0 : ({pos} >= {axis.extent}LL ? {axis.extent - 1}LL : {pos})")
            taps.append((pos, clamped, checks))
        positions.append(taps)
    maximum = n.op_type == "MaxPool"
    fill = "(-INFINITY)" if maximum else "0.0f"
    acc = ""
    for (ph, qh, ch), (pw, qw, cw) in itertools.product(*positions):
        cond = " && ".join(c_ for c_ in (ch, cw) if c_)
        if not cond:
            v = e.value(x, (nb, c, ph, pw))
        elif e.window_clamp and maximum and all(axis.dilation == 1 for axis in window.axes):
            v = e.value(x, (nb, c, qh, qw))  # the clamped position is the window's own edge: max unchanged
        elif e.window_clamp:  # a bound or a 0/1 factor, not a select: GCC masks selected loads and gives up
            bound = e.tmp("float", f"({cond}) ? INFINITY : (-INFINITY)" if maximum else f"({cond}) ? 1.0f : 0.0f")
            loaded = e.value(x, (nb, c, qh, qw))
            v = e.tmp("float", f"FS_FMIN({bound}, {loaded})" if maximum else f"{loaded} * {bound}")
        else:
            v = _guarded_or(e, x, (nb, c, ph, pw), cond, fill)
        acc = e.tmp("float", (f"FS_FMAX({acc}, {v})" if maximum else f"{acc} + {v}") if acc else v)
    if maximum:
        return acc
    count = _pool_count(e, window, (oh, ow))
    return f"({acc} * {_lit(1.0 / count)})" if isinstance(count, int) else f"({acc} / (float)({count}))"


def _pool_count(e, window, outs) -> int | str:
    """AveragePool's divisor: the window's taps inside the input (count_include_pad=0) or inside
    the padded input (=1; a ceil_mode window past the tail pad is clipped), as an int when every
    window has the same count, else a per-element expression (`PoolAxis.counts` at run time)."""
    factors, constant = [], 1
    for axis, o in zip(window.axes, outs, strict=True):
        lo, hi = (-axis.pad, axis.limit) if window.include_pad else (0, axis.extent)
        counts = set(axis.counts(window.include_pad))
        if len(counts) == 1:
            constant *= counts.pop()
            continue
        s = e.tmp("long long", f"({o}) * {axis.stride}LL - {axis.pad}LL")
        end = e.tmp("long long", f"{s} + {axis.kernel}LL < {hi}LL ? {s} + {axis.kernel}LL : {hi}LL")
        factors.append(e.tmp("long long", f"{end} - ({s} > {lo}LL ? {s} : {lo}LL)"))
    if not factors:
        return constant
    return " * ".join(([str(constant)] if constant != 1 else []) + factors)


_HANDLERS.update({"MaxPool": _pool, "AveragePool": _pool})
