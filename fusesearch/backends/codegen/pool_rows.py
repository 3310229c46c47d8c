"""The C pool-row skeleton: an output that is a MaxPool/AveragePool's, computed one output row at a
time as two separable passes (C only; CUDA keeps the unrolled window of `ops._pool`).

Problem: unrolled, a 3x3 stride-2 window reads nine strided taps per output element; the strided
loads and the border checks keep the column loop far from the memory bound.
Approach: per output row (n, c, oh), a vertical pass over the input's columns reduces the window's
rows (contiguous loads, `omp simd`; a row outside the input bounded by -INFINITY or scaled by 0,
decided once per row) into a row buffer padded with the reduction's identity on both sides; then a
horizontal pass reduces each output column's taps from the buffer (stride and dilation as
written) and scales an average by its count's inverse (a literal, or constant tables per output
row and column: the count is a product of the two). A producer in the group is inlined in the vertical
pass (`value(x, tap)`), so it runs once per window row that covers its element, not per tap.
Invariants: used only where the output written is the pool's own output and the padded row fits
MAX_ROW floats on the stack; the result equals `ops._pool`'s (same taps, same order of rows).
"""

from __future__ import annotations

from fusesearch.backends.codegen.base import OMP_FOR, Arg, _flat_loop, _indent, _lit
from fusesearch.backends.codegen.emitter import _Emitter
from fusesearch.ir.pool import POOL_OPS, pool_window

MAX_ROW = 16384  # floats of the padded row buffer (64 KiB of stack)


def _pool_rows(graph, kernel, args, out: Arg, materialized) -> str | None:
    """C loops computing `out` as pool rows, or None when `out` is not a generated pool's output."""
    p = graph.producer(out.tensor)
    if p is None or p not in kernel.nodes or graph.nodes[p].op_type not in POOL_OPS:
        return None
    n = graph.nodes[p]
    x = n.inputs[0]
    window = pool_window(n.op_type, n.attrs, graph.tensors[x].shape, out.shape, graph.tensors[x].dtype,
                         len([o for o in n.outputs if o]))
    if isinstance(window, str):
        return None
    ah, aw = window.axes
    length = max(aw.pad + aw.extent, (aw.out - 1) * aw.stride + (aw.kernel - 1) * aw.dilation + 1)
    if length > MAX_ROW:
        return None
    maximum = n.op_type == "MaxPool"
    fill = "(-INFINITY)" if maximum else "0.0f"
    e = _Emitter(graph, kernel, args)
    e.materialized = materialized
    e.window_clamp = True  # a pool feeding this one is unrolled branch-free
    nb, ch, oh = e.unflatten("o", out.shape[:-1])
    start = e.tmp("long long", f"({oh}) * {ah.stride}LL - {ah.pad}LL") if ah.pad or ah.stride > 1 else oh
    rows = []  # per window row: (position to read, bound / scale or "")
    for k in range(ah.kernel):
        pos = f"({start} + {k * ah.dilation}LL)" if k * ah.dilation else start
        low, high = ah.needs_low_check(k), ah.needs_high_check(k)
        if not (low or high):
            rows.append((pos, ""))
            continue
        inside = " && ".join(([f"{pos} >= 0"] if low else []) + ([f"{pos} < {ah.extent}LL"] if high else []))
        clamped = e.tmp("long long", f"{pos} < 0 ? 0 : ({pos} >= {ah.extent}LL ? {ah.extent - 1}LL : {pos})")
        bound = e.tmp("float", f"({inside}) ? INFINITY : (-INFINITY)" if maximum else f"({inside}) ? 1.0f : 0.0f")
        rows.append((clamped, bound))
    head, e.lines = e.lines, []
    e.push()
    acc = ""
    for pos, bound in rows:
        v = e.value(x, (nb, ch, pos, "c"))
        if bound:
            v = e.tmp("float", f"FS_FMIN({bound}, {v})" if maximum else f"{v} * {bound}")
        acc = e.tmp("float", (f"FS_FMAX({acc}, {v})" if maximum else f"{acc} + {v}") if acc else v)
    vertical = [*e.lines, f"rb[c + {aw.pad}LL] = {acc};"]
    e.pop()
    e.lines = []
    e.push()
    acc = ""
    for k in range(aw.kernel):
        tap = f"rb[j * {aw.stride}LL + {k * aw.dilation}LL]"
        acc = e.tmp("float", (f"FS_FMAX({acc}, {tap})" if maximum else f"{acc} + {tap}") if acc else tap)
    tables = []
    if not maximum:  # 1/count per output row and per output column: literals or constant tables
        factors = []
        for name, axis, i in (("fs_rh", ah, oh), ("fs_cw", aw, "j")):
            inverse = [1.0 / c for c in axis.counts(window.include_pad)]
            if len(set(inverse)) == 1:
                factors.append(_lit(inverse[0]))
                continue
            tables.append(f"static const float {name}[{len(inverse)}] = {{{', '.join(map(_lit, inverse))}}};")
            factors.append(f"{name}[{i}]")
        acc = e.tmp("float", f"{acc} * ({' * '.join(factors)})")
    horizontal = [*e.lines, f"{out.name}[o * {aw.out}LL + j] = {acc};"]
    e.pop()
    edges = []
    if aw.pad:
        edges.append(f"for (long long c = 0; c < {aw.pad}LL; ++c) rb[c] = {fill};")
    if length > aw.pad + aw.extent:
        edges.append(f"for (long long c = {aw.pad + aw.extent}LL; c < {length}LL; ++c) rb[c] = {fill};")
    loop = [f"for (long long o = 0; o < {out.size // aw.out}LL; ++o) {{", *["    " + s for s in head],
            f"    float rb[{length}];", *["    " + s for s in edges],
            *(["    #pragma omp simd"] if _flat_loop(vertical) else []),
            f"    for (long long c = 0; c < {aw.extent}LL; ++c) {{", *["        " + s for s in vertical], "    }",
            *(["    #pragma omp simd"] if _flat_loop(horizontal) else []),
            f"    for (long long j = 0; j < {aw.out}LL; ++j) {{", *["        " + s for s in horizontal], "    }", "}"]
    return "\n".join(["    " + t for t in tables] + [f"    {OMP_FOR}", _indent(loop, 1)])
