"""The packed CPU skeleton for MatMul/Gemm (C only): blocks of output rows, each by our micro-kernel.

Problem: a fused gemm on a CPU must run at the BLAS's rate or better, with the prologue packed into
the activation panel and the epilogue on the tile in cache. Shared pieces (packed weights, the split
of a group's outputs, one output's store) live here too; convs build on them in `cpu_conv`.
Approach: our micro-kernel (`fs_micro`, `fs_micro_x2` with AVX-512) over B packed once
(`fs_pack_b`, which also multiplies in `schedule.scaled_product`'s scale) or per block, through
`fs_gemm_rows` (A read by rows in place, bias/residual in the epilogue); else a BLAS sgemm per block,
kept beyond `ROWS_MAX_K` / `ROWS_MAX_B_FLOATS`, below one FS_MR x FS_NR tile and for a computed B.
`schedule.folded_scale` scales the weights or alpha; `_b_source`/`_view_strides` pass views by
strides; `_tile_epilogue` runs a bias+GELU epilogue on registers (AVX-512). The schedule's product
(`schedule.gemm_products`) is written as named, never inferred from the text written.
Invariants: every BLAS path is under `#ifdef FS_BLAS_SGEMM` with a loop fallback (packed products
need none); only float32 initializers are packed, once per runner or program; blocks run in
parallel, each BLAS call alone; scratch from `base.scratch`, never a malloc per call."""

from __future__ import annotations

import math

import numpy as np

from fusesearch.backends.codegen.base import (
    OMP_FOR,
    Arg,
    CodegenRefused,
    PackedWeight,
    _flat_loop,
    _indent,
    _lit,
    compute_dtype,
    scratch,
    store,
)
from fusesearch.backends.codegen.c_gemm import FS_NR, tile_epilogue
from fusesearch.backends.codegen.emitter import _Emitter
from fusesearch.backends.codegen.pointwise import _pointwise_loops
from fusesearch.ir.graph import Graph, Node
from fusesearch.ir.op_kind import OpKind, kind_of
from fusesearch.lowering import Kernel
from fusesearch.schedule import (
    CPU_SPLITS,
    SPLIT_COL_ALIGN,
    anchor_derived,
    folded_scale,
    gemm_products,
    row_prologue,
    split_row_limit,
)

MAX_HOIST = 16384  # floats of the activation operand kept per row (64 KiB of stack)


def _packed(packs: dict, graph: Graph, args, w: str, layout: tuple[int, int, int, int], groups: int = 1,
            group_stride: int = 0, scale: float = 1.0) -> str | None:
    """The C name of weight `w` packed once as B panels (`PackedWeight`; layout (K, N, sk, sn)),
    times `scale` (a folded scale), registered in `packs`; None unless `w` is a float32 constant
    kernel input."""
    if w not in args or args[w].dtype != "float32" or not graph.tensors[w].constant:
        return None
    if w not in packs:
        k, n, sk, sn = layout
        floats = groups * -(-n // FS_NR) * FS_NR * k
        packs[w] = PackedWeight(Arg(f"pk{len(packs)}", w, (floats,), "float32"), args[w].name, k, n, sk, sn,
                                groups, group_stride, scale)
    return packs[w].arg.name


def _split_outputs(graph: Graph, kernel: Kernel, outs, anchor: Node):
    """(main, side): the outputs at the product's positions (computed from it element for element,
    a Reshape of it included: `anchor_derived`), written in the product's loop; the rest (a
    prologue's output) by loops of their own."""
    derived = anchor_derived(graph, kernel.nodes, anchor) or {anchor.outputs[0]}
    main = [o for o in outs if o.tensor in derived]
    return main, [o for o in outs if o not in main]


def _write(e: _Emitter, o: Arg, idx: tuple[str, ...], yshape) -> str:
    """The store of output `o` at the product's element `idx`: the same flat position, `o`'s value
    read at its own multi-index (`_Emitter.view_index`)."""
    return store(o, e.flat(idx, yshape), e.value(o.tensor, e.view_index(idx, yshape, o.shape)))


def _matmul_row_loops(graph: Graph, kernel: Kernel, args, outs, anchor: Node,
                      store: tuple[str, tuple[int, ...]] | None = None, packs: dict | None = None,
                      defs: list[str] | None = None) -> list[str] | None:
    """C skeleton for MatMul/Gemm (i-k-j order): per output row, the A row (prologue applied)
    into a buffer, acc[n] += a[k] * B[k, n] with n innermost (contiguous, vectorizable), then the
    epilogue per column reading acc[n]. The product the kernel's schedule names (`gemm_product`)
    is written as given: "loops" those loops alone; "own" blocks multiplied by our own
    micro-kernel (`fs_gemm_rows`: a constant B packed once into `packs`, or attention's values
    packed per block), which needs no BLAS; "blas" a BLAS call per block, the loops under `#else`
    for a build without one. `store` (the output's name and its strides per product axis): only
    the blocks, each storing its tile there (None for "loops"). `defs` (where the kernel can take file-scope definitions): an epilogue that is a function of
    the product plus a bias row alone becomes a tile epilogue there (`_tile_epilogue`), applied by
    the micro-kernel to each tile before its one store where the CPU has AVX-512."""
    a, b = anchor.inputs[0], anchor.inputs[1]
    sa, sb = graph.tensors[a].shape, graph.tensors[b].shape
    y = anchor.outputs[0]
    yshape = graph.tensors[y].shape
    if len(sa) < 2 or len(sb) < 2:
        return None
    trans_a = anchor.op_type == "Gemm" and int(anchor.attrs.get("transA", 0))
    trans_b = anchor.op_type == "Gemm" and int(anchor.attrs.get("transB", 0))
    k_extent, n_extent = (sa[0] if trans_a else sa[-1]), yshape[-1]
    main, side = _split_outputs(graph, kernel, outs, anchor)
    if not main:
        return None
    e = _Emitter(graph, kernel, args)
    rows = row_prologue(graph, kernel.nodes, anchor)
    stored_a = next((o for o in side if o.tensor == a), None)  # the activation is an output
    if rows:  # the rows store the activation (`rowwise`: first, or per block into its panel); all else reads it
        e.args = {**args, a: stored_a or Arg("abuf", a, tuple(sa), "float32")}
        e.materialized = frozenset({a})
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
    writes = [_write(e, o, idx, yshape) for o in main]
    body = e.lines + writes
    e.pop()
    loop = [f"for (long long row = 0; row < {math.prod(yshape[:-1])}LL; ++row) {{", *["    " + x for x in pre],
            f"    float hbuf[{k_extent}];", f"    float acc[{n_extent}];",
            f"    for (long long nn = 0; nn < {n_extent}LL; ++nn) acc[nn] = 0.0f;",
            *["    " + x for x in fill + mac],
            f"    for (long long col = 0; col < {n_extent}LL; ++col) {{", *["        " + x for x in body], "    }", "}"]
    block_rows = None  # a packed row prologue's statements per block (its rows into the block's A panel)
    if rows and kernel.schedule.prologue == "packed":
        c_side, block_rows = _row_prologue_block(graph, kernel, args, side, rows, None if stored_a else e.args[a])
    elif rows:
        c_side = [_row_prologue(graph, kernel, args, side, rows)]
    else:
        c_side = _pointwise_loops(graph, kernel, args, side)[0]
    rows_loop = c_side + [f"    {OMP_FOR}\n" + _indent(loop, 1)]
    if max(k_extent, n_extent) > MAX_HOIST and not rows:  # rows too long for the stack: generic loops without a BLAS
        rows_loop = _pointwise_loops(graph, kernel, args, outs)[0]
    # a Gemm's C operand is a term without the product (its alpha must be 1: the product is added as is)
    gemm_c = anchor.op_type == "Gemm" and len(anchor.inputs) > 2 and bool(anchor.inputs[2])
    alpha_one = anchor.op_type == "MatMul" or float(anchor.attrs.get("alpha", 1.0)) == 1.0
    held = e.scaled.tensor if e.scaled is not None else y  # what the product's store holds (its scale packed into B)
    terms = (_additive_terms(graph, kernel, held, main[0].tensor) if len(main) == 1 and (main[0].tensor != held or gemm_c)
             else None)
    additive = terms is not None
    direct = ((main[0].name, _row_major(yshape)) if len(main) == 1 and (main[0].tensor in (y, held) or additive)
              and main[0].dtype == "float32" and alpha_one else None)  # the BLAS stores the output
    prefill = init = None
    if direct and additive:  # the output is the product plus terms without it: those first, then the BLAS adds
        e.lines = []
        e.push()
        e.acc_value = "0.0f"
        prefill = e.lines + [_write(e, main[0], idx, yshape)]
        e.acc_value = ""
        e.pop()
        init = _terms_in_place(args, anchor, ([anchor.inputs[2]] if gemm_c else []) + terms, yshape,
                               cols=gemm_split(kernel) != "rows")
    product = gemm_product(graph, kernel, anchor)
    if product == "loops":  # the per-row loops alone (no store through strides: they write the outputs)
        return None if store is not None or max(k_extent, n_extent) > MAX_HOIST else rows_loop
    written = {o.tensor: o for o in side} if store is None else {}  # computed by c_side before the blocks
    tile = None
    if kernel.schedule.epilogue == "tile":  # on the registers (`schedule.tile_epilogue` said it can)
        tile = (_tile_epilogue(graph, kernel, args, anchor, main[0], yshape)
                if product == "own" and defs is not None and store is None and not direct and len(main) == 1 else None)
        if tile is None:
            raise CodegenRefused(f"{anchor.name}({anchor.op_type}): its epilogue has no tile form")
    blas = _blas_blocks(graph, e, anchor, yshape, (k_extent, n_extent, trans_b), pre, fill, body, store or direct, prefill,
                        packs, init, written, (main[0].name, tile[1]) if tile else None, own=product == "own",
                        split=gemm_split(kernel), rows=block_rows)
    if tile is not None:  # our micro-kernel applies it on the registers where FS_TILE_EPI is defined
        defs.append(tile[0])
    if product == "own":  # our micro-kernel over B packed: no BLAS needed
        return [*c_side, *blas] if store is None else blas
    if store is not None:  # only the BLAS blocks, storing through the given strides
        return blas
    return ["#ifdef FS_BLAS_SGEMM", *c_side, *blas, "#else", *rows_loop, "#endif"]


def _row_prologue(graph: Graph, kernel: Kernel, args, side, rows: tuple[int, ...]) -> str:
    """The C rows of a stored row prologue (`schedule.prologue_forms`), storing the side outputs
    (imported here: the row kernel's module builds on this one)."""
    from fusesearch.backends.codegen.rowwise import row_prologue_loops

    return row_prologue_loops(graph, kernel, args, side, rows)


def _row_prologue_block(graph: Graph, kernel: Kernel, args, side, rows: tuple[int, ...],
                        panel: Arg | None) -> tuple[list[str], list[str]]:
    """A packed row prologue (`schedule.prologue_forms`): (its side loops, the statements computing
    a block's `mc` rows from flat row `rbase` into its A panel: the stored activation, or `panel`,
    the block's scratch), as `rowwise.row_prologue_block` writes them."""
    from fusesearch.backends.codegen.rowwise import row_prologue_block

    return row_prologue_block(graph, kernel, args, side, rows, "rbase", "mc", panel)


# C gemm: at most this product tile (8 MiB, within the last-level cache) per BLAS call. Each call
# packs all of B again, so fewer, even calls win: at 128x2304x768 one call runs at 86 GFLOP/s,
# 113 + 15 rows (a 1 MiB cap) at 72 and 64 + 64 at 79 (one Zen 3 core, scipy-openblas32;
# `benchmarks/bench_cpu.py --sections 1b` times the three)
BLAS_TILE_FLOATS = 1 << 21
# C gemm with a constant B (or attention's values): our micro-kernel over B packed (`fs_gemm_rows`)
# is the "own" product where `schedule.gemm_products` lists it (its ROWS_MAX_K and ROWS_MAX_B_FLOATS;
# the later figures there). Zen 3 figures from before the AVX-512 tiles, generated both ways and
# timed interleaved (one Zen 3 core; the gpt2 figures each beside an A/A pair of the same two
# kernels): vit-small's 197x1536x384 FFN down-projection with its GELU prologue 1.08x faster than
# through the BLAS (which packs its 2.4 MiB B again per call), gpt2's 768x2304 QKV + Split
# 1.03-1.04x, its 768x3072 up-projection + bias 0.91-1.05x (within the A/A spread of a later, busier
# run); at K = 3072 (the 3072x768 down-projection with its GELU prologue) 0.90-0.97x, and within
# noise with GELU's x 0.5 folded (`schedule.folded_scale`, the activation read in place)


def gemm_product(graph: Graph, kernel: Kernel, anchor: Node) -> str:
    """The product the kernel's schedule names (`Schedule.product`); a kernel lowered for a GPU
    names none, and its C form (run where no GPU is) takes the CPU's default, the first of
    `schedule.gemm_products`."""
    return kernel.schedule.product or gemm_products(graph, anchor)[0]


def gemm_split(kernel: Kernel) -> str:
    """The thread split the kernel's schedule names (`Schedule.split`); a kernel lowered for a GPU
    names none, and its C form splits rows, as does a one-thread form (its one block)."""
    return kernel.schedule.split if kernel.schedule.split in CPU_SPLITS else "rows"


def _tile_epilogue(graph: Graph, kernel: Kernel, args, anchor: Node, out: Arg, yshape) -> tuple[str, str | None] | None:
    """(definitions, bias argument or None) of the group's epilogue as a tile epilogue
    (`base.tile_epilogue`): the one output `out` (float32, the product element for element)
    computed from the product plus at most a bias row (a float32 kernel input along N: a Gemm's C,
    or added first; the micro-kernel adds it) by constants, the four operators and erf (a GELU); None
    otherwise (a residual or any other tensor read per element, a view, another op).
    Measured on one Ice Lake core (`benchmarks/ab_group.py`, interleaved): bert-small's FFN-up
    group with its bias and GELU on the registers 0.94x the time of the same group through a
    product block and a second pass."""
    y = anchor.outputs[0]
    if out.dtype != "float32" or out.tensor == y:
        return None

    def row(t: str) -> bool:  # a float32 kernel input along N: a bias row
        shape = graph.tensors[t].shape
        return t in args and args[t].dtype == "float32" and shape[-1:] == (yshape[-1],) and math.prod(shape[:-1]) == 1

    start, bias = y, None
    if anchor.op_type == "Gemm" and float(anchor.attrs.get("alpha", 1.0)) != 1.0:
        return None
    if anchor.op_type == "Gemm" and len(anchor.inputs) > 2 and anchor.inputs[2]:  # y holds C: the bias row
        if not (row(anchor.inputs[2]) and float(anchor.attrs.get("beta", 1.0)) == 1.0):
            return None
        bias = args[anchor.inputs[2]].name
    users = [n for n in graph.consumers(y) if n in kernel.nodes]
    node = graph.nodes[users[0]] if len(users) == 1 else None
    other = [t for t in node.inputs if t != y] if node is not None else []
    if (bias is None and node is not None and node.op_type == "Add" and len(other) == 1 and node.inputs.count(y) == 1
            and row(other[0]) and tuple(graph.tensors[node.outputs[0]].shape) == tuple(yshape)):
        start, bias = node.outputs[0], args[other[0]].name
    e = _Emitter(graph, kernel, args)
    e.row_scalars[start] = "v"
    try:
        result = e.value(out.tensor, tuple(f"i{d}" for d in range(len(out.shape))))
    except (CodegenRefused, KeyError):  # a tensor the epilogue cannot compute from v alone
        return None
    text = tile_epilogue(e.lines, result)
    return (text, bias) if text is not None else None



_VIEWS = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity"})
PROBE_FLOATS = 1 << 22  # offsets probed per B operand at most (a 32 MiB int64 table at codegen)


def _b_source(graph: Graph, members, b: str) -> tuple[str, np.ndarray, bool] | None:
    """(source, offsets, pure) of a MatMul's B computed in the group: `offsets[i]` is the flat
    position in `source` (a tensor the group reads) of the element B's value at `i` is computed
    from, following views (Reshape, Transpose, ...) and each elementwise op's full-shape input;
    `pure` when the path has only views (B is `source` read by other strides). None when the path
    leaves that form (a broadcast, a Concat) or the source is too large to probe."""
    path, t = [], b
    while graph.producer(t) in members:
        node = graph.nodes[graph.producer(t)]
        shape = graph.tensors[t].shape
        if node.op_type in _VIEWS:
            nxt = node.inputs[0]
        elif kind_of(node.op_type, node.domain) == OpKind.ELEMWISE or node.op_type in ("Add", "Sub", "Mul", "Div"):
            nxt = next((i for i in node.inputs if i and graph.tensors[i].shape == shape), None)
            if nxt is None:
                return None
        else:
            return None
        path.append(node)
        t = nxt
    size = math.prod(graph.tensors[t].shape)
    if not path or size > PROBE_FLOATS:
        return None
    offsets = _through_views(graph, path[::-1], graph.tensors[t].shape)
    return t, offsets, all(node.op_type in _VIEWS for node in path)


def _through_views(graph: Graph, nodes, shape) -> np.ndarray:
    """Each element's flat position in a tensor of `shape`, carried through `nodes` in order (views
    move the positions; an elementwise op, its output the same shape, keeps them)."""
    positions = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    for node in nodes:
        if node.op_type == "Transpose":
            perm = node.attrs.get("perm")
            positions = positions.transpose(tuple(perm) if perm is not None else None)
        positions = np.ascontiguousarray(positions).reshape(graph.tensors[node.outputs[0]].shape)
    return positions


def _affine_strides(offsets: np.ndarray) -> tuple[int, ...] | None:
    """Per-axis strides when offsets[i] = offsets[0] + sum(i_d * stride_d) for every i, else None."""
    origin = offsets.reshape(-1)[0] if offsets.size else 0
    strides = tuple(int(np.take(offsets, 1, axis=d).reshape(-1)[0] - origin) if n > 1 else 0
                    for d, n in enumerate(offsets.shape))
    grid = origin + sum(np.arange(n, dtype=np.int64).reshape([-1 if i == d else 1 for i in range(offsets.ndim)]) * st
                        for d, (n, st) in enumerate(zip(offsets.shape, strides, strict=True)))
    return strides if np.array_equal(np.broadcast_to(grid, offsets.shape), offsets) else None


def _k_contiguous(offsets: np.ndarray) -> bool:
    """Whether B's source runs along K (B's second-to-last axis) rather than N at its origin."""
    first = offsets.reshape(-1, *offsets.shape[-2:])[0]
    step_k = int(first[1, 0] - first[0, 0]) if first.shape[0] > 1 else 0
    step_n = int(first[0, 1] - first[0, 0]) if first.shape[1] > 1 else 0
    return abs(step_k) == 1 and abs(step_n) != 1


def _strided_b(graph: Graph, e: _Emitter, source, z_idx, sb, k_extent: int, n_extent: int):
    """(pointer, ldb, transpose flag) reading B in place from its source, a float32 kernel input
    B is a view of, when every batch of B is a K x N matrix of it with unit stride along N
    (ldb >= N) or along K (transposed, ldb >= K); else None."""
    src, offsets, _ = source
    if src not in e.args or graph.tensors[src].dtype != "float32" or len(sb) < 2:
        return None
    strides = _affine_strides(offsets)
    if strides is None:
        return None
    s_k, s_n = strides[-2], strides[-1]
    if s_n == 1 and s_k >= n_extent:
        ldb, flag = s_k, 111
    elif s_k == 1 and s_n >= k_extent:
        ldb, flag = s_n, 112
    else:
        return None
    batch = e.broadcast(z_idx, sb[:-2])
    base = " + ".join([f"({i}) * {st}LL" for i, st in zip(batch, strides[:-2], strict=True) if st] + [f"{offsets.reshape(-1)[0]}LL"])
    return f"{e.args[src].name} + ({base})", ldb, flag


def _strided_a(graph: Graph, e: _Emitter, a: str, z_idx, sa, k_extent: int) -> tuple[str, int] | None:
    """(pointer at row m0 of the batch, lda) reading A in place from the float32 kernel input it is
    a view of (attention's queries split into heads), when every batch of A is an M x K matrix of
    it with unit stride along K; else None (A is packed with its prologue)."""
    source = _b_source(graph, e.members, a)
    if source is None or not source[2] or source[0] not in e.args or graph.tensors[source[0]].dtype != "float32":
        return None
    strides = _affine_strides(source[1])
    if strides is None or len(sa) < 2 or strides[-1] != 1 or (sa[-2] > 1 and strides[-2] < k_extent):
        return None
    lda = strides[-2] if sa[-2] > 1 else k_extent
    batch = e.broadcast(z_idx, sa[:-2])
    base = [f"({i}) * {st}LL" for i, st in zip(batch, strides[:-2], strict=True) if st]
    return f"{e.args[source[0]].name} + ({' + '.join([*base, f'{source[1].reshape(-1)[0]}LL', f'm0 * {lda}LL'])})", lda


def _blas_blocks(graph: Graph, e: _Emitter, anchor: Node, yshape, dims, pre, fill, body,
                 direct: tuple[str, tuple[int, ...]] | None = None, prefill: list[str] | None = None,
                 packs: dict | None = None, init: tuple[str, str] | None = None,
                 written: dict | None = None, tile: tuple[str, str | None] | None = None,
                 own: bool = False, split: str = "rows", rows: list[str] | None = None) -> list[str]:
    """C gemm through a BLAS sgemm per block of output rows of one batch — as many rows as give every
    OpenMP thread a block (one block per batch when the batches suffice), at most a BLAS_TILE_FLOATS
    tile, so B is packed as few times as the threads allow: the rows of A with the prologue
    applied are packed into a buffer (A read in place when it is a float32 kernel input with no
    prologue or a scalar scale the product folds, a view of one with unit stride along K:
    `_strided_a`, or an output the side loops wrote: `written`), one sgemm multiplies them by B (a kernel input read in place,
    or, when the group computes it, packed per block) — an sgemv when the product has one row, which
    needs no packing — and the epilogue runs over the block's product while it is in cache, before
    the one store; where the product is the group's one output or a view of it (`direct`: its
    float32 argument and the output's stride per product axis, unit along N) the
    BLAS stores the block there and there is no epilogue pass; with `prefill` (the output's value
    with the product taken as 0: a bias, a residual) the block is first filled with it and the
    BLAS adds the product (beta = 1), so a MatMul + Add keeps no tile and makes no second pass
    (bert-small's 128x128 projections 2-5% faster). With `own` (the schedule's product "own",
    which `schedule.gemm_products` lists within its bounds), a constant float32 B is packed once
    (registered in `packs`), or a B that is a view of an input along N (attention's values) is packed per block,
    or a B the group computes (the values with their bias) is packed per block from its panel
    (`bpk`), and each block multiplied by `fs_gemm_rows` instead of the BLAS (see the module note); there a
    prefill of terms read in place (`init`: a residual's and a bias row's arguments,
    `_terms_in_place`) is added by the micro-kernel at the store instead, with no prefill pass.
    A that is also a kernel output (`written`: outputs the kernel's side loops store before the
    blocks, as a LayerNorm's value that a residual reads later) is read back from there, its
    prologue not computed twice. With `tile` (the one output's argument and the bias row's, or None:
    `_tile_epilogue`) and our micro-kernel, the block runs `fs_gemm_rows_epi` straight into the
    output where the kernel defines FS_TILE_EPI (AVX-512), the block epilogue elsewhere.
    The threads share the blocks as the schedule's `split` names (`schedule.split_blocks` computes
    the same): "rows", blocks of rows alone; "tiles" and "cols", blocks of rows and of columns,
    block (z, m0, n0) multiplying its rows by B's columns [n0, n0 + nc) and storing those alone.
    With `rows` (a packed row prologue's statements for the block's `mc` rows from flat row
    `rbase`: `_row_prologue_block`) each block first computes its own rows of A, into its scratch
    panel `abuf` or the stored activation it then reads in place, in its own thread (no pass over
    all rows before the blocks, no barrier between them).
    Refused where B is not float32 or half (half B is widened into the packed panel)."""
    k_extent, n_extent, trans_b = dims
    cols = split != "rows"
    nx = "(int)nc" if cols else f"{n_extent}"  # the block's columns, as the BLAS takes them
    b = anchor.inputs[1]
    if compute_dtype(graph.tensors[b].dtype) != "float32":  # `schedule.gemm_products` lists "loops" alone
        raise CodegenRefused(f"{anchor.name}({anchor.op_type}): B of dtype {graph.tensors[b].dtype} has no GEMM blocks")
    packed_b = (b not in e.args or graph.producer(b) in e.members  # computed in the group: packed per block
                or graph.tensors[b].dtype != "float32")  # half: widened into the panel
    sb = graph.tensors[b].shape
    m_extent = yshape[-2] if len(yshape) > 1 else 1
    batches = math.prod(yshape[:-2])
    cap = m_extent if direct else max(8, BLAS_TILE_FLOATS // max(1, n_extent))  # direct: no tile to keep
    e.lines = []
    z_idx = e.unflatten("z", yshape[:-2])
    z_lines = e.lines
    e.lines = []
    fold = folded_scale(graph, e.members, anchor)  # A = scale x a tensor read in place: the scale folds
    a, sa = fold[0] if fold else anchor.inputs[0], graph.tensors[anchor.inputs[0]].shape
    by_rows = len(sa) >= 2 and not (anchor.op_type == "Gemm" and int(anchor.attrs.get("transA", 0)))
    a_in_place = by_rows and a in e.args and graph.producer(a) not in e.members and graph.tensors[a].dtype == "float32"
    scale = fold[1] if fold and a_in_place else 1.0  # the BLAS's alpha, or B scaled as it is packed
    scale *= e.scaled.scale if e.scaled is not None else 1.0  # the product's own scale, packed into B
    alpha = _lit(scale)
    stored_a = (written or {}).get(anchor.inputs[0])  # an output the side loops wrote before the blocks
    row_at = e.flat(e.broadcast(z_idx, sa[:-2]) + ("m0", "0"), sa)
    a_ptr, lda = "abuf", k_extent
    if a_in_place:
        a_ptr = f"{e.args[a].name} + ({row_at})"
    elif by_rows and stored_a is not None and stored_a.dtype == "float32":
        a_ptr, a_in_place = f"{stored_a.name} + ({row_at})", True
    elif by_rows and (viewed := _strided_a(graph, e, a, z_idx, sa, k_extent)) is not None:  # attention's queries
        (a_ptr, lda), a_in_place = viewed, True
    source = _b_source(graph, e.members, b) if packed_b and anchor.op_type == "MatMul" else None
    strided = _strided_b(graph, e, source, z_idx, sb, k_extent, n_extent) if source and source[2] else None
    if strided is not None:  # a view of a kernel input (the keys of attention): the BLAS reads it by strides
        b_ptr, ldb, b_trans = strided
        packed_b = False
    elif packed_b:  # B with its prologue as a panel, in the order its source is contiguous in
        e.push()
        bv = e.value(b, ("nn", "kk") if trans_b else e.broadcast(z_idx, sb[:-2]) + ("kk", "nn"))
        e.pop()
        k_inner = source is not None and source[1].ndim >= 2 and _k_contiguous(source[1])
        loops = (("nn", n_extent), ("kk", k_extent)) if k_inner else (("kk", k_extent), ("nn", n_extent))
        at = f"nn * {k_extent}LL + kk" if k_inner else f"kk * {n_extent}LL + nn"
        z_lines += [scratch("bbuf", f"{k_extent * n_extent}LL"),
                    f"for (long long {loops[0][0]} = 0; {loops[0][0]} < {loops[0][1]}LL; ++{loops[0][0]}) {{",
                    *([] if e.lines else ["    #pragma omp simd"]),
                    f"    for (long long {loops[1][0]} = 0; {loops[1][0]} < {loops[1][1]}LL; ++{loops[1][0]}) {{",
                    *["        " + x for x in e.lines], f"        bbuf[{at}] = {bv};", "    }", "}"]
        e.lines = []
        b_ptr, ldb, b_trans = "bbuf", (k_extent if k_inner else n_extent), (112 if k_inner else 111)
    else:
        b_ptr = f"{e.args[b].name} + ({e.flat(e.broadcast(z_idx, sb[:-2]) + ('0', '0'), sb)})"
        ldb, b_trans = (k_extent if trans_b else n_extent), (112 if trans_b else 111)
    row = ["long long row = z * " + f"{m_extent}LL + m0 + i;", *pre]
    c_ptr, ldc = "cbuf", n_extent
    if direct:  # the tile stored in place: a batch's rows at their strides (a head's columns of a merge)
        name, st = direct
        at = [f"({i}) * {s_}LL" for i, s_ in zip(z_idx, st[:-2], strict=True) if s_] + [f"m0 * {st[-2]}LL"]
        c_ptr, ldc = f"{name} + ({' + '.join(at)})", st[-2]
    if cols:  # the block's columns of C (of the block's scratch rows, or of the output)
        c_ptr = f"{c_ptr} + n0"
    beta = "1.0f" if prefill else "0.0f"  # prefilled: the BLAS adds the product to the block
    pk = None
    if own and packed_b:  # B computed in the group (attention's values with their bias): its panel
        # above, with the prologue applied, packed from there per block
        z_lines += _pack_per_block("bpk", "bbuf", k_extent, n_extent, ldb, b_trans, alpha)
        pk = "bpk"
    if own and pk is None and strided is None and len(sb) == 2:  # a constant B: packed once per plan
        pk = _packed(packs, graph, e.args, b, (k_extent, n_extent, 1, k_extent) if trans_b else (k_extent, n_extent, n_extent, 1),
                     scale=scale)
    if own and pk is None and (strided is not None or e.args[b].dtype == "float32"):
        # a view of an input along N (attention's values) or along K (its keys, read transposed), or
        # a float32 input read in place that is not a 2-D constant (an unfused graph's values and
        # transposed keys, a batched constant): packed per block
        z_lines += _pack_per_block("bbuf", b_ptr, k_extent, n_extent, ldb, b_trans, alpha)
        pk = "bbuf"
    if cols:  # the block's columns of B: along a row (K x N), or its rows (N x K)
        b_ptr = f"{b_ptr} + n0" if b_trans == 111 else f"{b_ptr} + n0 * {ldb}LL"
    gemv = (f"FS_BLAS_SGEMV(101, 112, {k_extent}, {nx}, {alpha}, {b_ptr}, {ldb}, {a_ptr}, 1, {beta}, {c_ptr}, 1);"
            if b_trans == 111 else  # one row: y = B^T a (B is K x N), or y = B a (B is N x K)
            f"FS_BLAS_SGEMV(101, 111, {nx}, {k_extent}, {alpha}, {b_ptr}, {ldb}, {a_ptr}, 1, {beta}, {c_ptr}, 1);")
    sgemm = (f"FS_BLAS_SGEMM(101, 111, {b_trans}, (int)mc, {nx}, {k_extent}, {alpha}, {a_ptr}, "
             f"{lda}, {b_ptr}, {ldb}, {beta}, {c_ptr}, {ldc});")
    sgemm = f"FS_GEMV_OR({gemv}) {sgemm}" if m_extent == 1 else sgemm
    if cols and pk is not None:  # the block's B panels (FS_NR columns each, K deep)
        pk = f"{pk} + n0 * {k_extent}LL"
    n_rows = "nc" if cols else f"{n_extent}LL"  # the block's columns, as our micro-kernel takes them
    if own:  # our micro-kernel over B packed (once per plan, or per block), A's rows read in place
        c0 = (f"{init[0]}, {init[1]}" if init is not None else f"{c_ptr}, {ldc}LL, 0" if prefill else "0, 0LL, 0")
        sgemm = f"fs_gemm_rows(mc, {n_rows}, {k_extent}LL, {a_ptr}, {lda}LL, {pk}, {c_ptr}, {ldc}LL, {c0});"
        prefill = None if init is not None else prefill  # the term is added at the store
    col_loop = ("for (long long col = n0; col < n0 + nc; ++col)" if cols
                else f"for (long long col = 0; col < {n_extent}LL; ++col)")
    epilogue = [] if direct else [
        "    " + scratch("cbuf", f"mc * {n_extent}LL"), "    " + sgemm,
        "    for (long long i = 0; i < mc; ++i) {",
        *["        " + x for x in row], f"        const float* acc = cbuf + i * {n_extent}LL;",
        *(["        #pragma omp simd"] if _flat_loop(body) else []),
        f"        {col_loop} {{", *["            " + x for x in body], "        }",
        "    }"]
    if tile is not None:  # the epilogue on the registers, with AVX-512
        at = f"{tile[0]} + (z * {m_extent * n_extent}LL + m0 * {n_extent}LL{' + n0' if cols else ''})"
        bias = f"{tile[1]}{' + n0' if cols else ''}" if tile[1] else "0"
        epilogue = ["#ifdef FS_TILE_EPI",
                    f"    fs_gemm_rows_epi(mc, {n_rows}, {k_extent}LL, {a_ptr}, {lda}LL, {pk}, {at}, {n_extent}LL, {bias});",
                    "#else", *epilogue, "#endif"]
    where = (["    long long z = blk / (blocks * cblocks), m0 = blk / cblocks % blocks * mb, n0 = blk % cblocks * nb;",
              f"    long long mc = {m_extent}LL - m0 < mb ? {m_extent}LL - m0 : mb;",
              f"    long long nc = {n_extent}LL - n0 < nb ? {n_extent}LL - n0 : nb;"] if cols else
             ["    long long z = blk / blocks, m0 = (blk % blocks) * mb;",
              f"    long long mc = {m_extent}LL - m0 < mb ? {m_extent}LL - m0 : mb;"])
    block = [f"for (long long blk = 0; blk < {batches}LL * blocks{' * cblocks' if cols else ''}; ++blk) {{",
             *where,
             *["    " + x for x in z_lines],
             *([] if a_in_place else ["    " + scratch("abuf", f"mc * {k_extent}LL")]),
             *(["    " + x for x in [f"long long rbase = ({row_at}) / {k_extent}LL;", *rows]] if rows is not None else
               [] if a_in_place else ["    for (long long i = 0; i < mc; ++i) {",
                                      *["        " + x for x in row], f"        float* hbuf = abuf + i * {k_extent}LL;",
                                      *["        " + x for x in fill], "    }"]),
             *(["    for (long long i = 0; i < mc; ++i) {", *["        " + x for x in row],
                *(["        #pragma omp simd"] if _flat_loop(prefill) else []),
                f"        {col_loop} {{", *["            " + x for x in prefill],
                "        }", "    }"] if prefill else []),
             *(["    " + sgemm] if direct else epilogue),
             "}"]
    return ["    {", *["    " + x for x in _split_lines(split, batches, m_extent, n_extent, cap)],
            f"    {OMP_FOR}\n" + _indent(block, 1), "    }"]


def _split_lines(split: str, batches: int, m: int, n: int, cap: int) -> list[str]:
    """C computing a gemm's blocks from the threads it runs with, as `schedule.split_blocks` does:
    p blocks per batch; "rows" p blocks of rows (`mb` rows, `blocks` of them); "tiles" and "cols"
    the largest divisor of p within the split's row limit as row blocks, the rest as blocks of
    `nb` columns (`cblocks` of them, a multiple of SPLIT_COL_ALIGN). Rows and columns evened out:
    a short last BLAS call costs a whole B packing."""
    lines = [f"long long split = (fs_threads() + {batches}LL - 1) / {batches}LL;"]  # blocks per batch
    rows = "split"
    if split != "rows":
        lines += [f"long long rsplit = split < {split_row_limit(split, m)}LL ? split : {split_row_limit(split, m)}LL;",
                  "while (split % rsplit) --rsplit;", "long long csplit = (split + rsplit - 1) / rsplit;"]
        rows = "rsplit"
    lines += [f"long long mb = ({m}LL + {rows} - 1) / {rows};", f"if (mb > {cap}LL) mb = {cap}LL;",
              f"long long blocks = ({m}LL + mb - 1) / mb;", f"mb = ({m}LL + blocks - 1) / blocks;"]
    if split != "rows":
        lines += [f"long long nb = ({n}LL + csplit - 1) / csplit;",
                  f"nb = (nb + {SPLIT_COL_ALIGN - 1}LL) / {SPLIT_COL_ALIGN}LL * {SPLIT_COL_ALIGN}LL;",
                  f"long long cblocks = ({n}LL + nb - 1) / nb;"]
    return lines


def _pack_per_block(dst: str, src: str, k: int, n: int, ldb, b_trans: int, alpha: str) -> list[str]:
    """C packing B into scratch `dst` for our micro-kernel, per block, from `src` (K x N with
    leading dimension `ldb`, or N x K where `b_trans` is 112), times `alpha` (the product's folded
    scale, 1 where none) as it is packed: no pass of its own."""
    floats = -(-n // FS_NR) * FS_NR * k
    strides = f"{ldb}LL, 1LL" if b_trans == 111 else f"1LL, {ldb}LL"
    return [scratch(dst, f"{floats}LL"), f"fs_pack_b({k}LL, {n}LL, {src}, {strides}, {alpha}, {dst});"]


def _additive_terms(graph: Graph, kernel: Kernel, y: str, out: str) -> list[str] | None:
    """The terms, in order, when `out` is product `y` plus terms that do not depend on it (a bias,
    a residual): a chain of Adds from y to out, each of y's shape, y read once, the other operands
    computed without y; else None. The BLAS can then add the product to an output prefilled with
    those terms."""
    anchor, t, terms = graph.producer(y), y, []
    while t != out:
        users = [n for n in graph.consumers(t) if n in kernel.nodes]
        if len(users) != 1:
            return None
        node = graph.nodes[users[0]]
        others = [i for i in node.inputs if i != t]
        source = graph.producer(others[0]) if len(others) == 1 else None
        if (node.op_type != "Add" or len(others) != 1 or node.inputs.count(t) != 1
                or graph.tensors[node.outputs[0]].shape != graph.tensors[y].shape
                or source is not None and (source == anchor or graph.reaches(anchor, source))):
            return None
        terms.append(others[0])
        t = node.outputs[0]
    return terms


def _terms_in_place(args, anchor: Node, terms: list[str], yshape, cols: bool = False) -> tuple[str, str] | None:
    """For an output that is the product plus `terms` (`_additive_terms`, a Gemm's C first): when
    every term is a float32 kernel input (a Gemm's C with beta 1), at most one of the product's
    shape (a residual) and at most one a row along N (a bias), `fs_gemm_rows`'s C0 and R0
    arguments for the block of rows at (z, m0) (and of columns at n0 where the blocks split
    columns: `cols`), each "0, 0LL" / "0" when absent; else None."""
    col = " + n0" if cols else ""
    if anchor.op_type == "Gemm" and float(anchor.attrs.get("beta", 1.0)) != 1.0:  # beta * C: the prefill scales it
        return None
    m_extent, n_extent = (yshape[-2] if len(yshape) > 1 else 1), yshape[-1]
    matrix, row = [], []
    for term in terms:
        if term not in args or args[term].dtype != "float32":  # computed in the kernel, or half
            return None
        shape = (1,) * (len(yshape) - len(args[term].shape)) + tuple(args[term].shape)
        if shape[-1] == n_extent and math.prod(shape[:-1]) == 1:
            row.append(f"{args[term].name}{col}")
        elif shape == tuple(yshape):
            matrix.append(f"{args[term].name} + (z * {m_extent * n_extent}LL + m0 * {n_extent}LL{col}), {n_extent}LL")
        else:
            return None
    if len(matrix) > 1 or len(row) > 1:
        return None
    return (matrix[0] if matrix else "0, 0LL"), (row[0] if row else "0")


def _view_strides(graph: Graph, kernel: Kernel, outs, y: str) -> tuple[int, ...] | None:
    """The stride in the kernel's one float32 output of each axis of product `y`, when the output is
    `y` moved by views only (a Transpose merging attention heads, a Reshape) and the product's rows
    land at a fixed stride with unit stride along N; else None."""
    if len(outs) != 1 or outs[0].dtype != "float32":
        return None
    path, t = [], y
    while t != outs[0].tensor:
        users = [n for n in graph.consumers(t) if n in kernel.nodes]
        if len(users) != 1 or graph.nodes[users[0]].op_type not in _VIEWS or graph.nodes[users[0]].inputs[0] != t:
            return None
        path.append(graph.nodes[users[0]])
        t = path[-1].outputs[0]
    yshape = graph.tensors[y].shape
    size = math.prod(yshape)
    if not path or size > PROBE_FLOATS or len(yshape) < 2:
        return None
    moved = _through_views(graph, path, yshape)  # at each output position: the product's element
    where = np.empty(size, dtype=np.int64)
    where[moved.reshape(-1)] = np.arange(size, dtype=np.int64)  # at each product element: its output position
    strides = _affine_strides(where.reshape(yshape))
    if strides is None or where[0] != 0 or strides[-1] != 1 or (yshape[-2] > 1 and strides[-2] < yshape[-1]):
        return None
    return strides if yshape[-2] > 1 else (*strides[:-2], yshape[-1], 1)


def _row_major(shape) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
