"""The rowwise skeleton: per row, the reductions (sums, maxima, moments) as scalars, then the
outputs. C: parallel over rows; CUDA: a block per row with block reductions; a computed row read by
several passes is cached on its first pass (C: a local buffer; CUDA: shared memory, for exactly the
rows the schedule lists in `row_cache` — lowering decided them and priced their bytes). A C
reduction over a long row keeps C_PARTIALS partial results (`_partial_sums`), its invariant
temporaries hoisted before the chunk loop. A full-size output past STREAM_MIN_BYTES streams its
row (`base.streamed_loop`), the first reduction prefetching the inputs it reads. C rows of at most
PAIR_MAX_LENGTH run two at a time, interleaved statement by statement (`_paired`); the row body is
emitted for one row `r` and renamed per row, so both rows run the same statements.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from fusesearch.backends.codegen.base import (
    Arg,
    CodegenRefused,
    _flat_loop,
    _indent,
    _lit,
    c_function,
    compute_dtype,
    cuda_entry,
    parallel_rows,
    shared_scratch,
    store,
    streamed_loop,
    streams,
    wide_kernel,
)
from fusesearch.backends.codegen.c_prelude import _CU_PRELUDE, FOLDED
from fusesearch.backends.codegen.cpu_gemm import MAX_HOIST, _matmul_row_loops, gemm_product
from fusesearch.backends.codegen.emitter import _Emitter
from fusesearch.backends.codegen.hoist import hoist_invariants
from fusesearch.backends.codegen.pointwise import _pointwise_loops
from fusesearch.ir.graph import Graph, Node
from fusesearch.lowering import Kernel, reduced_rows
from fusesearch.schedule import ARG_OPS, ONE_PASS, THREADS, exp_row, row_floats, variance_pairs

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
    cached_at: dict[str, str] = field(default_factory=dict)  # cached tensor → flat index of its (r, j) element
    smem_rows: tuple[str, ...] = ()  # CUDA: the rows the schedule keeps in shared memory
    streamed: bool = False  # C: an output row is written with streaming stores (`streamed_loop`)
    ahead: list[str] = field(default_factory=list)  # C: row bases the first reduction prefetches
    variances: dict[int, int] = field(default_factory=dict)  # one pass: mean node → its variance node
    one_pass: bool = False  # the schedule's moments are "one-pass" (`schedule.one_pass_moments`)
    panel: tuple[str, str] = ()  # C: (scratch or "", first row) a gemm block's rows; its A panel's row r at (r - first) * length

    def row_index(self, out: Arg) -> str:
        """The flat index of `out`'s element (r, j): a block's panel counts its rows from its first."""
        if self.panel and self.panel[0] and out.name == self.panel[0]:
            return f"(r - {self.panel[1]}) * {self.length}LL + j"
        return f"r * {self.length}LL + j"

    def rows_cached(self) -> dict[str, str]:
        return self.cached if self.c_target else self.cu_cached


def _row_plan(graph, kernel, args, outs, materialized=frozenset(), read_side=False, panel: tuple[str, str] = ()):
    """The row kernel's statements: (plan with its C and CUDA row bodies, side-output loops).
    `read_side` (C only: the side loops run first in the same thread's program order): the rows
    read the side outputs back instead of computing them again (an int64 attention mask cast
    and scaled per score element costs more than the scores' Softmax). `panel` (C only: a gemm
    block's rows, `_RowPlan.panel`): the output so named is that block's A panel, and no output
    streams (the product reads the rows back at once)."""
    nodes = [graph.nodes[i] for i in kernel.nodes]
    rows, length = _row_shape(graph, nodes)
    plan = _RowPlan(rows, length, smem_rows=kernel.schedule.row_cache, one_pass=kernel.schedule.moments == ONE_PASS,
                    panel=panel)
    if plan.one_pass:
        plan.variances = variance_pairs(graph, kernel.nodes)
    if not panel and any(streams(o) for o in outs if o.size == rows * length):
        # the first reduction, reading the inputs, prefetches them: the hardware's prefetcher no
        # longer sees the lines a plain store would have read (a LayerNorm over 8192x768: 15%
        # faster; a prefetch of the whole row at its start was no faster than none)
        plan.ahead = [f"{a.name} + r * {length}LL" for a in args.values()
                      if a.name.startswith("in") and a.size == rows * length]
    side = _side_outputs(graph, kernel, outs, plan)
    e = _Emitter(graph, kernel, {**args, **{o.tensor: o for o in side}} if read_side else args)
    e.materialized = materialized | {o.tensor for o in side} if read_side else materialized
    for node in nodes:
        if node.kind.name == "REDUCE":
            _reduction(e, node, plan)
    for out in outs:
        if out not in side:
            _row_output(e, out, plan)
    return plan, _pointwise_loops(graph, kernel, args, side, materialized)


PAIR_MAX_LENGTH = 512  # C: rows up to this long run two at a time (`_paired`)


def _c_rows(plan: _RowPlan, c_side: list[str]) -> str:
    side = "".join(x + "\n" for x in c_side)
    if plan.rows >= 2 and plan.length <= PAIR_MAX_LENGTH:
        body = _paired(plan.c, plan.rows)
        return side + parallel_rows("rp", (plan.rows + 1) // 2, body, fence=plan.streamed) + "\n"
    return side + parallel_rows("r", plan.rows, plan.c, fence=plan.streamed) + "\n"


_TOP_NAME = re.compile(r"^(?:const )?(?:float|double|int|long long|int64_t|int32_t|uint8_t|_Bool)\*? \**(\w+)\s*[\[=;]")


def _paired(body: list[str], rows: int, first: str = "", end: str = "") -> list[str]:
    """The row body `body` (over row `r`) for rows r_0 = 2 rp and r_1 = r_0 + 1 (r_0 again past the
    last row: an odd count computes its last row twice, storing the same values), statement by
    statement: each top-level statement (an if with its else: one) for r_0, then for r_1, every
    name it declares at the top suffixed by its row (rows from `first` to `end`, by default 0 and
    `rows`; a gemm block's rows otherwise). A short row's reductions are chains of dependent steps (the last partial
    sums folded, a reciprocal) that the other row's independent work now fills: a scaled, masked
    Softmax over 128-float rows 25% faster beyond the cache, an Add + LayerNorm 17%."""
    statements: list[list[str]] = []
    current: list[str] = []
    depth = 0
    for line in body:
        if not current and statements and line.lstrip().startswith("else"):  # an if's else: the same statement
            current = statements.pop()
        current.append(line)
        depth += line.count("{") - line.count("}")
        if depth == 0 and not line.lstrip().startswith(("#", "FS_SIMD")):  # a pragma stays on its loop
            statements.append(current)
            current = []
    if current or depth:
        raise CodegenRefused("row body with an unbalanced statement")
    names = {"r"} | {m.group(1) for st in statements if (m := _TOP_NAME.match(st[0].strip()))}
    rename = re.compile(r"\b(" + "|".join(sorted(map(re.escape, names))) + r")\b")
    end = end or f"{rows}LL"
    out = [f"long long r_0 = {first + ' + ' if first else ''}2 * rp, r_1 = r_0 + 1 < {end} ? r_0 + 1 : r_0;"]
    for st in statements:
        for u in (0, 1):
            out += [rename.sub(lambda m, u=u: f"{m.group(1)}_{u}", line) for line in st]
    return out


def _rowwise(graph, kernel, name, ins, outs, args, packs: dict):
    """C and CUDA sources of the row kernel (and its rows and row length); `packs` receives the
    weights its C product reads packed once (a classifier head's constant B under its Softmax)."""
    plan, (c_side, cu_side) = _row_plan(graph, kernel, args, outs)
    rows, length = plan.rows, plan.length
    cu_body = _indent(plan.cu, 2)
    c_body = _c_rows(plan, c_side)
    product = _row_product(graph, kernel, args, outs, packs)
    if product is not None:  # the product first (packed, blocked), then the rows read it
        loops, own = product
        c_body = loops if own else f"#ifdef FS_BLAS_SGEMM\n{loops}#else\n{c_body}#endif\n"
    c_src = c_function(name, ins, outs, tuple(packs.values()), c_body, wide=wide_kernel(kernel.ops, outs),
                       threads=kernel.schedule.cpu_threads)
    arg = _CU_BLOCK_ARGBEST if any(graph.nodes[i].op_type in ARG_OPS for i in kernel.nodes) else ""
    cu_src = (f"{_CU_PRELUDE}{_CU_BLOCK_REDUCE}{arg}\n{cuda_entry(name, ins, outs)} {{\n"
              + "".join(x + "\n" for x in cu_side)
              + f"    for (long long r = blockIdx.x; r < {rows}LL; r += gridDim.x) {{\n{cu_body}\n    }}\n}}\n")
    return c_src, cu_src, rows, length


def row_prologue_loops(graph, kernel, args, outs, rows: tuple[int, ...]) -> str:
    """C of a gemm kernel's row prologue (`schedule.row_prologue`: the group's nodes before its
    anchor, `rows`): those nodes as a row kernel of their own (the gemm's schedule carries their
    `moments`) storing `outs`, the activation among them, in the kernel's one OpenMP region,
    before the product's blocks read it."""
    plan, (c_side, _) = _row_plan(graph, replace(kernel, nodes=rows, anchor=None), args, outs)
    return _c_rows(plan, c_side)


def row_prologue_block(graph, kernel, args, outs, rows: tuple[int, ...], first: str, count: str,
                       panel: Arg | None) -> tuple[list[str], list[str]]:
    """C of a packed row prologue (`Schedule.prologue` "packed"): (the side loops, which run before
    the blocks; the statements of one gemm block computing its `count` rows from flat row `first`,
    two at a time where short, storing `outs`, and the activation into `panel`, the block's
    scratch A panel, where it is not among them; no store streams). Each row's moments take one
    pass, then its normalised values go straight to the panel the product reads next, in the
    block's thread."""
    name = (panel.name if panel is not None else "", first)  # no output streams: the product reads the rows next
    plan, (c_side, _) = _row_plan(graph, replace(kernel, nodes=rows, anchor=None), args,
                                  [*outs, *([panel] if panel is not None else [])], panel=name)
    return c_side, _block_rows(plan, first, count)


def _block_rows(plan: _RowPlan, first: str, count: str) -> list[str]:
    """The row body over a gemm block's `count` rows from flat row `first`, two at a time where
    short (`_paired`), in the block's thread."""
    if plan.length <= PAIR_MAX_LENGTH:
        body = _paired(plan.c, plan.rows, first, f"{first} + {count}")
        return [f"for (long long rp = 0; rp < ({count} + 1) / 2; ++rp) {{", *["    " + x for x in body], "}"]
    return [f"for (long long r = {first}; r < {first} + {count}; ++r) {{", *["    " + x for x in plan.c], "}"]


def _row_product(graph, kernel, args, outs, packs: dict) -> tuple[str, bool] | None:
    """C for a row kernel over a MatMul/Gemm (attention's scores or a classifier head under a
    Softmax): the product, prologue applied, into a scratch buffer through the GEMM
    blocks (our micro-kernel over weights packed once into `packs` or keys packed per head, else
    the BLAS), then the row loops reading it (each row's dot products are one tile instead of a
    dot per element); with whether it runs without a BLAS (the schedule's product is "own", our
    micro-kernel: no `#ifdef`). None without an anchor, where the product is not float32, or where
    the schedule's product is "loops" (the row loops compute it inline)."""
    if kernel.anchor is None or graph.nodes[kernel.anchor].op_type not in ("MatMul", "Gemm"):
        return None
    anchor = graph.nodes[kernel.anchor]
    y = anchor.outputs[0]
    info = graph.tensors[y]
    if compute_dtype(info.dtype) != "float32" or not info.shape:
        return None
    product = gemm_product(graph, kernel, anchor)
    if product == "loops":  # the row loops compute the product inline
        return None
    buffer = Arg("ybuf", y, tuple(info.shape), "float32")  # the product as computed (float)
    loops = _matmul_row_loops(graph, kernel, args, [buffer], anchor, packs=packs)
    plan, (c_side, _) = _row_plan(graph, kernel, {**args, y: buffer}, outs, frozenset({y}), read_side=True)
    return ("    " + shared_scratch("ybuf", f"{max(1, buffer.size)}LL") + "\n"
            + "".join(x + "\n" for x in loops) + _c_rows(plan, c_side)), product == "own"


def _row_shape(graph: Graph, nodes: list[Node]) -> tuple[int, int]:
    """(rows, row length) shared by the kernel's reductions (lowering checked they agree)."""
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
    """One pass's statements and value at column j. Every row an earlier pass cached is read back
    wherever the pass needs that tensor at (r, j), not only as a reduction's input (LayerNorm's
    variance pass and its output pass read the row its mean pass cached)."""
    e.lines = []
    e.push()
    plan.c_target = c_target
    e.row_cache = {t: (plan.cached_at[t], f"{buffer}[j]") for t, buffer in plan.rows_cached().items()
                   if t in plan.cached_at}
    value = body("j")
    e.row_cache = {}
    plan.c_target = False
    e.pop()
    lines, e.lines = e.lines, []
    return lines, value


def _cache_row(e: _Emitter, plan: _RowPlan, tensor: str) -> None:
    """Note where `tensor`'s element (r, j) sits, for later passes to find it in its cached row
    (a graph tensor; not a Softmax's row of exponentials, which only its own passes read)."""
    if tensor not in plan.cached_at and tensor in e.graph.tensors:
        kept, e.lines = e.lines, []
        plan.cached_at[tensor] = e.flat(_full_index(e, tensor, plan, "j"), e.info(tensor).shape)
        e.lines = kept


def _row_loop(e: _Emitter, plan: _RowPlan, body, combine: str, init: str, acc: str, cache: str = "",
              square: tuple[str, str] | None = None) -> None:
    """acc over j of body(j), into plan.c and plan.cu: the same statements in two skeletons. Each
    reads rows cached by earlier loops and caches `cache`'s row on its first pass — C in a local
    buffer, CUDA in shared memory (each thread writes and later reads its own j's) — so a row of
    a computed tensor (a GEMM's output under a Softmax) is computed once, not once per pass.
    `square` (a sum only: its accumulator, a shift): the same loop also sums (body(j) - shift)^2,
    and acc then sums body(j) - shift (a row's moments in one pass: `_one_pass_moments`)."""
    cu_lines, cu_value = _row_body(e, plan, body, False)
    c_lines, c_value = _row_body(e, plan, body, True)
    buffer = cu_buffer = ""
    if cache and cache not in plan.cached and plan.length <= MAX_HOIST:
        buffer = f"rb{len(plan.cached)}"
        c_lines.append(f"{buffer}[j] = {c_value};")
        c_value = f"{buffer}[j]"  # evaluated once: the reduction reads it back
    if cache and cache not in plan.cu_cached and cache in plan.smem_rows:
        cu_buffer = f"rs{len(plan.cu_cached)}"
        cu_lines.append(f"{cu_buffer}[j] = {cu_value};")
        cu_value = f"{cu_buffer}[j]"
    head = [f"float {buffer}[{plan.length}];"] if buffer else []
    cu_head = [f"__shared__ float {cu_buffer}[{row_floats(plan.length)}];"] if cu_buffer else []
    is_max = "fmax" in combine

    def merge(target: str, value: str) -> str:  # C: a compare-select max vectorizes (fmaxf does not); never NaN
        return f"({value} > {target} ? {value} : {target})" if is_max else combine.format(target, value)

    sums = _sums(acc, c_value, square)  # (accumulator, the term it adds), the squares' last
    simd = [_simd_reduction(", ".join(a for a, _ in sums), is_max)] if _flat_loop(c_lines) else []
    split = hoist_invariants(c_lines, "j") if simd and plan.length >= 2 * C_PARTIALS else None
    starts = [f"float {a} = {init};" for a, _ in sums]
    if split is None:
        plan.c += [*head, *starts, *simd, f"for (long long j = 0; j < {plan.length}LL; ++j) {{",
                   *["    " + x for x in c_lines + [f"{a} = {merge(a, v)};" for a, v in sums]], "}"]
    else:
        plan.c += [*head, *starts, *split[0],
                   *_partial_sums(plan.length, split[1], sums, init, merge, is_max, plan.ahead)]
        plan.ahead = []
    cu_sums = _sums(acc, cu_value, square)
    plan.cu += [*cu_head, *starts, f"for (long long j = threadIdx.x; j < {plan.length}LL; j += blockDim.x) {{",
                *["    " + x for x in cu_lines + [f"{a} = {combine.format(a, v)};" for a, v in cu_sums]], "}",
                *[f"{a} = block_reduce({a}, {1 if 'fmax' in combine else 0});" for a, _ in cu_sums]]
    if buffer or cu_buffer:
        _cache_row(e, plan, cache)
    if buffer:
        plan.cached[cache] = buffer
    if cu_buffer:
        plan.cu_cached[cache] = cu_buffer


def _sums(acc: str, value: str, square: tuple[str, str] | None) -> list[tuple[str, str]]:
    """A row loop's (accumulator, term) pairs: `acc` of the value, or, with `square` (its
    accumulator, a shift), of the shifted value and of its square."""
    if square is None:
        return [(acc, value)]
    d = f"({value} - {square[1]})"
    return [(acc, d), (square[0], f"({d} * {d})")]


C_PARTIALS = FOLDED  # C row reductions: independent partial results per row (4 AVX2 vectors, 2 AVX-512)


def _simd_reduction(acc: str, is_max: bool) -> str:
    """The `omp simd` pragma of a C row reduction into `acc`: a max or a sum."""
    return f"#pragma omp simd reduction({'max' if is_max else '+'}:{acc})"


def _partial_sums(length: int, lines: list[str], sums: list[tuple[str, str]], init: str, merge, is_max: bool,
                  ahead=()) -> list[str]:
    """A C row reduction over `length` >= 2 x C_PARTIALS columns as C_PARTIALS partial results
    (`p<acc>`), folded into `acc` at the end by a tree (`fs_fold_sum`/`fs_fold_max`): one vector
    accumulator makes the loop wait on the add's (or the compare's) latency each step, C_PARTIALS
    of them keep the FMA units busy (a LayerNorm over vit-small's 197x384 rows 40 -> 26 us); the
    columns past the last whole chunk in the plain loop. `lines`: the body's statements at column j, its invariants already hoisted;
    `sums`: (accumulator, its term at column j), each with its own partials (a row's moments: two);
    `merge(target, value)`: the reduction's C expression of one step (a max where `is_max`, else a
    sum); `ahead`: row bases whose
    columns each chunk prefetches STREAM_AHEAD floats on (`fs_prefetch_ahead`)."""
    whole = length - length % C_PARTIALS
    out = ["{", *[f"    float p{a}[{C_PARTIALS}];" for a, _ in sums],
           *[f"    for (int q = 0; q < {C_PARTIALS}; ++q) p{a}[q] = {init};" for a, _ in sums],
           f"    for (long long j0 = 0; j0 < {whole}LL; j0 += {C_PARTIALS}LL) {{",
           *[f"        fs_prefetch_ahead({p} + j0, {C_PARTIALS}LL);" for p in ahead], "        #pragma omp simd",
           f"        for (long long jj = 0; jj < {C_PARTIALS}LL; ++jj) {{", "            long long j = j0 + jj;",
           *["            " + x for x in lines], *[f"            p{a}[jj] = {merge(f'p{a}[jj]', v)};" for a, v in sums],
           "        }", "    }"]
    if whole < length:
        out += ["    " + _simd_reduction(", ".join(a for a, _ in sums), is_max),
                f"    for (long long j = {whole}LL; j < {length}LL; ++j) {{",
                *["        " + x for x in lines], *[f"        {a} = {merge(a, v)};" for a, v in sums], "    }"]
    fold = "fs_fold_max" if is_max else "fs_fold_sum"  # the partials' tree (base._C_FOLD)
    return out + [line for a, _ in sums for line in (f"    float {a}_fold = {fold}(p{a});",
                                                      f"    {a} = {merge(a, f'{a}_fold')};")] + ["}"]


def _scalar(e: _Emitter, plan: _RowPlan, expr: str) -> str:
    e.count += 1
    name = f"s{e.count}"
    plan.c.append(f"float {name} = {expr};")
    plan.cu.append(f"float {name} = {expr};")
    return name


def _reduction(e: _Emitter, node: Node, plan: _RowPlan) -> None:
    x = node.inputs[0]
    op = node.op_type
    if node.outputs[0] in e.row_scalars:  # a variance its mean's pass computed (`_one_pass_moments`)
        return

    def at(j: str) -> str:
        if x in plan.rows_cached():
            return f"{plan.rows_cached()[x]}[{j}]"
        return e.value(x, _full_index(e, x, plan, j))

    computed = e.graph.producer(x) in e.members
    if node.id in plan.variances:  # the mean and, in the same pass, its variance
        variance = e.graph.nodes[plan.variances[node.id]].outputs[0]
        e.row_scalars[node.outputs[0]], e.row_scalars[variance] = _one_pass_moments(e, plan, at, x if computed else "")
        return
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
        _row_loop(e, plan, lambda j: f"fs_expf_le({at(j)} - {acc})", "{0} + {1}", "0.0f", total)
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


def _one_pass_moments(e, plan, at, cache: str) -> tuple[str, str]:
    """The row's mean and variance in one pass: the sums of d = x - x[0] and of d^2 (shifted by the
    row's first element so E[d^2] - E[d]^2 does not cancel where the mean is large against the
    spread), the variance clamped at 0 against rounding."""
    shift = _scalar(e, plan, _first_element(e, plan, at))
    e.count += 1
    total, sq = f"s{e.count}", f"s{e.count}q"
    _row_loop(e, plan, at, "{0} + {1}", "0.0f", total, cache, square=(sq, shift))
    step = _scalar(e, plan, f"{total} / {plan.length}.0f")
    mean = _scalar(e, plan, f"{shift} + {step}")
    variance = _scalar(e, plan, f"{sq} / {plan.length}.0f - {step} * {step}")
    return mean, _scalar(e, plan, f"({variance} > 0.0f ? {variance} : 0.0f)")


def _first_element(e, plan, at) -> str:
    """The value of the row's element 0, as an expression of row scalars (its statements, the same
    in C and CUDA, appended to both bodies)."""
    lines, value = _row_body(e, plan, lambda j: at("0LL"), True)
    cu_lines, _ = _row_body(e, plan, lambda j: at("0LL"), False)
    plan.c += lines
    plan.cu += cu_lines
    return value


def _moments(e, plan, at, cache: str, epsilon: float) -> tuple[str, str]:
    """The row's mean and 1/sqrt(variance + epsilon): one pass where the schedule says so
    (`_one_pass_moments`), else a sum pass, then a pass of squared deviations."""
    if plan.one_pass:
        mean, variance = _one_pass_moments(e, plan, at, cache)
        return mean, _scalar(e, plan, f"1.0f / sqrtf({variance} + {_lit(epsilon)})")
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


def _softmax(e, node, plan, at, cache: str) -> None:
    e.count += 1
    mx = f"s{e.count}"
    _row_loop(e, plan, at, "fmaxf({0}, {1})", "-INFINITY", mx, cache)
    e.count += 1
    total = f"s{e.count}"
    softmax = node.op_type == "Softmax"
    # Softmax caches each exp on the sum's pass; a written output then costs one multiply per element
    _row_loop(e, plan, lambda j: f"fs_expf_le({at(j)} - {mx})", "{0} + {1}", "0.0f", total,
              exp_row(node.outputs[0]) if softmax else "")
    x = node.inputs[0]
    e.row_sources[node.outputs[0]] = x
    if softmax:  # one reciprocal per row, a multiply per element (its exp recomputed where uncached)
        inv = e.row_scalars[exp_row(node.outputs[0])] = _scalar(e, plan, f"1.0f / {total}")
        e.row_ops[node.outputs[0]] = lambda idx, xv=None: f"(fs_expf_le({xv or e.value(x, idx)} - {mx}) * {inv})"
    else:
        log_total = _scalar(e, plan, f"logf({total})")
        e.row_ops[node.outputs[0]] = lambda idx, xv=None: f"({xv or e.value(x, idx)} - {mx} - {log_total})"


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
        plan.c += [*lines, store(out, "r", v)]
        plan.cu += [*lines, f"if (threadIdx.x == 0) {store(out, 'r', v)}"]
        return
    def body(j: str) -> str:
        source = e.row_sources.get(out.tensor)
        cached = plan.rows_cached()
        if exp_row(out.tensor) in cached:
            return f"({cached[exp_row(out.tensor)]}[{j}] * {e.row_scalars[exp_row(out.tensor)]})"
        if source in cached and e.info(source).shape == out.shape:
            return e.row_ops[out.tensor](_full_index(e, out.tensor, plan, j), f"{cached[source]}[{j}]")
        return e.value(out.tensor, _full_index(e, out.tensor, plan, j))

    index = plan.row_index(out)
    cu_lines, cu_value = _row_body(e, plan, body, False)
    c_lines, c_value = _row_body(e, plan, body, True)
    if streams(out) and _flat_loop(c_lines) and not plan.panel:
        plan.c += streamed_loop(out, f"r * {plan.length}LL", plan.length, c_lines, c_value, [])
        plan.streamed = True
    else:
        plan.c += [*(["#pragma omp simd"] if _flat_loop(c_lines) else []), f"for (long long j = 0; j < {plan.length}LL; ++j) {{",
                   *["    " + x for x in [*c_lines, store(out, index, c_value)]], "}"]
    plan.cu += [f"for (long long j = threadIdx.x; j < {plan.length}LL; j += blockDim.x) {{",
                *["    " + x for x in [*cu_lines, store(out, index, cu_value)]], "}"]


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
