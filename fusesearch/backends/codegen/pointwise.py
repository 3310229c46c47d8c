"""The pointwise skeleton: one loop per output, O[i] = value(O, unflatten(i)). C: a loop nest
parallel over the leading dims and vectorized over the trailing ones (`omp simd`; the row index
hoisted; trailing dims merged into one loop where no load divides its index; a pool's output in
separable row passes, under another pool the last dim split into border and interior columns;
an output past STREAM_MIN_BYTES written with streaming stores); CUDA: a grid-stride loop.
"""

from __future__ import annotations

import math

from fusesearch.backends.codegen.base import (
    Arg,
    _flat_loop,
    _indent,
    c_function,
    cuda_entry,
    minmax_kernel,
    parallel_rows,
    store,
    streamed_loop,
    streams,
    wide_kernel,
)
from fusesearch.backends.codegen.c_prelude import _CU_PRELUDE
from fusesearch.backends.codegen.emitter import _Emitter
from fusesearch.backends.codegen.pool_rows import _pool_rows
from fusesearch.ir.pool import POOL_OPS, pool_window
from fusesearch.schedule import CPU_SKELETONS


def _pointwise(graph, kernel, name, ins, outs, args, c_body: list[str] | None = None, packed=(), defs: str = ""):
    """C and CUDA sources of the pointwise skeleton; `c_body` replaces the C loops (the packed CPU
    skeleton of an anchor group, reading the `packed` weights, calling the file-scope `defs`); a CPU
    schedule's, or one whose tensors lie blocked (`Schedule.layout_out`), has no CUDA (its rows may
    hold what only the C writes: a row prologue's reductions)."""
    cpu_only = c_body is not None and (kernel.schedule.skeleton in CPU_SKELETONS or kernel.schedule.layout_out.block)
    c_loops, cu_loops = (c_body, []) if cpu_only else _pointwise_loops(graph, kernel, args, outs)
    if c_body is not None:
        c_loops = c_body
    c_src = c_function(name, ins, outs, packed, "\n".join(c_loops) + "\n", defs if c_body is not None else "",
                       wide=wide_kernel(kernel.ops, outs), threads=kernel.schedule.cpu_threads,
                       minmax=minmax_kernel(kernel.ops, c_body is not None and bool(kernel.schedule.layout_out.block)))
    cu_src = "" if cpu_only else (f"{_CU_PRELUDE}\n{cuda_entry(name, ins, outs)} {{\n"
                                  + "\n".join(cu_loops) + "\n}\n")
    return c_src, cu_src, 0, 0


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
        e.lines.append(store(out, "i", v))
        blocks.append((out, e.lines))
        c_loops.append(_c_nest(graph, kernel, args, out, materialized))
    cu_loops = []
    for out, lines in blocks:
        cu_loops.append(f"    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < {out.size}LL;"
                        f" i += (long long)blockDim.x * gridDim.x) {{\n{_indent(lines, 2)}\n    }}")
    return c_loops, cu_loops


def _c_nest(graph, kernel, args, out: Arg, materialized) -> str:
    """C loops for one output: rows in parallel, the innermost loop over the output's trailing
    dims merged (`_merged_body`), else its last dim. A pool's own output is computed in separable
    row passes (`pool_rows`); under other pools of the output's width in the group, the column loop
    is split into the border columns (taps clamped and bounded) and the interior, where no window
    crosses the input's edge and the taps are plain strided loads. A float32 output of
    STREAM_MIN_BYTES or more streams its stores (`streamed_loop`)."""
    pool_rows = _pool_rows(graph, kernel, args, out, materialized)
    if pool_rows is not None:
        return pool_rows
    inner = out.shape[-1] if out.shape else 1
    pools, lo, hi = _pool_interior(graph, kernel, inner)
    merged = None if pools else _merged_body(graph, kernel, args, out, materialized)
    if merged is not None:
        rows, inner, head, body, v = merged
        if streams(out) and _flat_loop(body):
            ahead = [a.name for a in kernel_inputs(args, out)]
            loop = streamed_loop(out, f"o * {inner}LL", inner, body, v, ahead)
            return parallel_rows("o", rows, [*head, *loop], fence=True)
        simd = ["#pragma omp simd"] if _flat_loop(body) else []
        loop = [*simd, f"for (long long j = 0; j < {inner}LL; ++j) {{",
                *["    " + x for x in [*body, store(out, f"o * {inner}LL + j", v)]], "}"]
        return parallel_rows("o", rows, [*head, *loop], fence=False)
    rows = out.size // inner if inner else 0
    e = _Emitter(graph, kernel, args)
    e.materialized = materialized
    e.window_clamp = True
    row_idx = e.unflatten("o", out.shape[:-1]) if out.shape else ()
    head, e.lines = e.lines, []
    ranges = [(0, lo, False), (lo, hi, True), (hi, inner, False)] if pools else [(0, inner, False)]
    loops = []
    for begin, end, interior in ranges:
        if begin >= end:
            continue
        e.window_cols, e.window_interior = ("j", pools) if interior else ("", frozenset())
        e.push()
        idx = (*row_idx, "j") if out.shape else ()
        v = e.value(out.tensor, idx)
        body = [*e.lines, store(out, f"o * {inner}LL + j", v)]
        e.lines = []
        e.pop()
        simd = ["#pragma omp simd"] if _flat_loop(body) else []
        first = f"{begin}LL" if begin else "0"
        loops += [*simd, f"for (long long j = {first}; j < {end}LL; ++j) {{", *["    " + x for x in body], "}"]
    return parallel_rows("o", rows, [*head, *loops], fence=False)


# The merged inner loop keeps at least this many rows for the threads to share.
MERGE_MIN_ROWS = 16


def _merged_body(graph, kernel, args, out: Arg, materialized):
    """(rows, inner extent, row statements, element statements, value) of `out` with the widest
    run of trailing dims whose flat index j every load reads without dividing it (each input
    either spans those dims or is broadcast over all of them: `_Emitter` re-linearises a split
    index it reads back whole), leaving at least MERGE_MIN_ROWS rows; the last dim alone where no
    wider run qualifies; None for a scalar output."""
    dims = len(out.shape)
    if dims == 0:
        return None
    for k in range(dims - 1):
        rows = math.prod(out.shape[:k])
        if rows < MERGE_MIN_ROWS or math.prod(out.shape[k:]) == out.shape[-1]:
            continue
        found = _body_over(graph, kernel, args, out, materialized, k)
        if found is not None:
            return found
    return _body_over(graph, kernel, args, out, materialized, dims - 1)  # one dim: no split to read


def _body_over(graph, kernel, args, out, materialized, k: int):
    """`_merged_body`'s statements with the inner loop over dims k.. of `out` (None where an
    element statement still reads a part of the split flat index)."""
    e = _Emitter(graph, kernel, args)
    e.materialized = materialized
    e.window_clamp = True
    row_idx = e.unflatten("o", out.shape[:k])
    head = e.lines
    found = e.over_flat("j", out.shape[k:], lambda col: [e.value(out.tensor, (*row_idx, *col))])
    if found is None:
        return None
    body, (v,) = found
    return math.prod(out.shape[:k]), math.prod(out.shape[k:]), head, body, v


def kernel_inputs(args, out: Arg) -> list[Arg]:
    """The kernel's inputs of `out`'s size (read at its flat index where the loops merge: what a
    streamed loop prefetches)."""
    return [a for a in args.values() if a.name.startswith("in") and a.size == out.size]


def _pool_interior(graph, kernel, width: int) -> tuple[frozenset[int], int, int]:
    """The group's generated pools whose output is `width` wide, and the output columns [lo, hi)
    inside all their interiors (every tap inside the input); no pools: (empty, 0, width)."""
    pools, lo, hi = set(), 0, width
    for i in kernel.nodes:
        n = graph.nodes[i]
        if n.op_type not in POOL_OPS:
            continue
        shape = graph.tensors[n.outputs[0]].shape
        window = pool_window(n.op_type, n.attrs, graph.tensors[n.inputs[0]].shape, shape,
                             graph.tensors[n.inputs[0]].dtype, len([o for o in n.outputs if o]))
        if isinstance(window, str) or shape[-1] != width:
            continue
        pools.add(i)
        a, b = window.axes[1].interior()
        lo, hi = max(lo, a), min(hi, b)
    return frozenset(pools), lo, max(lo, hi)
