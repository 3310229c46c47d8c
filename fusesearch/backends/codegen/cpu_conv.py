"""The packed CPU skeleton for Conv (C only), built on `cpu_gemm`'s pieces.

Problem: a fused conv on a CPU must beat im2col + BLAS with its prologue computed once per element
and its epilogue on the tile in cache.
Approach: k x k convs with constant float32 filters read a zero-bordered band of their input
(`fs_conv_band`, `_band_fill`; taps read in place with AVX-512, else packed per chunk); 1x1 convs
pack pixels per chunk and read filters in place (`fs_conv_1x1`), or take filters packed once
(`PackedWeight`, the kernel's `_pack`, `fs_gemm_packed`) where they dwarf the activations, else
im2col panels through the BLAS; depthwise convs run their own loop over zero-bordered planes. A
prologue fills only the image interior, one tap loop per piece of a channel Concat; blocks are
whole output rows within CONV_PATCH_FLOATS, fewer where filters are small (`CONV_FIT_SHARE`).
The path is the schedule's product (`schedule.conv_products`: `conv_reads_band`, `rows_1x1`,
`packs_filters`); this module writes the one named.
Invariants: as `cpu_gemm`'s: im2col's BLAS path under `#ifdef FS_BLAS_SGEMM` beside a loop fallback,
float32 constant filters packed once per runner or program, blocks in parallel, per-thread scratch."""

from __future__ import annotations

import math

from fusesearch.backends.codegen.base import (
    OMP_FOR,
    Arg,
    CodegenRefused,
    _flat_loop,
    _indent,
    compute_dtype,
    load_expr,
    scratch,
)
from fusesearch.backends.codegen.c_prelude import SCRATCH_SLOTS
from fusesearch.backends.codegen.cpu_conv_nchwc import nchwc_loops
from fusesearch.backends.codegen.cpu_gemm import MAX_HOIST, _packed, _split_outputs, _write
from fusesearch.backends.codegen.emitter import _Emitter
from fusesearch.backends.codegen.ops import _conv_geometry, _conv_input
from fusesearch.backends.codegen.pointwise import _pointwise_loops
from fusesearch.ir.graph import Graph, Node
from fusesearch.ir.op_kind import OpKind, kind_of
from fusesearch.lowering import Kernel
from fusesearch.schedule import conv_block_rows, conv_products


def conv_product(graph: Graph, kernel: Kernel, anchor: Node) -> str:
    """The product the kernel's schedule names (`Schedule.product`); a kernel lowered for a GPU
    names none, and its C form takes the CPU's default, the first of `schedule.conv_products`."""
    return kernel.schedule.product or conv_products(graph, kernel.nodes, anchor)[0]


def _conv_loops(graph: Graph, kernel: Kernel, args, outs, anchor: Node, packs: dict) -> list[str] | None:
    """C conv as the schedule's product names it (`conv_product`): the depthwise loop, the
    per-pixel row loops ("loops"), or blocks of output rows (`_conv_blas_blocks`): over a band,
    packed filters or a 1x1's pixels by our own micro-kernel, which need no BLAS, or im2col panels
    through the BLAS, with the row loops under `#else` for a build without one."""
    product = conv_product(graph, kernel, anchor)
    if product == "nchwc":
        return nchwc_loops(graph, kernel, args, outs, anchor, packs)
    if product == "depthwise":
        return _depthwise_loops(graph, kernel, args, outs, anchor)
    hoisted = _conv_row_loops(graph, kernel, args, outs, anchor)
    if product == "loops":
        return hoisted
    blocks = _conv_blas_blocks(graph, kernel, args, outs, anchor, packs, product)
    if product != "im2col":
        return blocks
    fallback = hoisted if hoisted is not None else _pointwise_loops(graph, kernel, args, outs)[0]  # a patch too long
    return ["#ifdef FS_BLAS_SGEMM", *blocks, "#else", *fallback, "#endif"]  # to hoist: the generic loops


# ... and fewer rows where the filters are small (at most 1/CONV_FIT_SHARE of the budget): the
# block's panel and product within 1/CONV_FIT_SHARE of `fs_band_chunk()` floats (half the core's
# L2, read at run time), so the prologue's panel, the product and the epilogue's pass over it stay
# in L2; every block streams all the filters again, hence the condition. yolo-neck's Add+SiLU+Concat
# + 1x1 conv 32->32 at 80x80 (one block of 800 KiB panel + 800 KiB product before): 204 -> 173 us;
# `bench_cpu.py --sections 3` over resnet18, resnet50, mobilenetv2, yolo-neck and U-Net: 165 of 170
# fused groups ahead of library + rest, none behind by more than 10% (159 and 3 before). Without
# the condition, resnet50's 14x14 1x1 convs to 1024 channels fell 12-16% behind (blocks of 3 rows,
# each streaming 1 MiB of filters).
CONV_FIT_SHARE = 4

def _pixel_wise(kern, strides, pads) -> bool:
    """Whether a conv's geometry is 1x1, stride 1, unpadded: output pixel p reads input pixel p."""
    return tuple(kern) == (1, 1) and tuple(strides) == (1, 1) and not any(pads)


def _conv_blas_blocks(graph: Graph, kernel: Kernel, args, outs, anchor: Node, packs: dict, product: str) -> list[str]:
    """C conv as implicit GEMM through a BLAS sgemm per block of whole output rows of one image
    and group (as many rows as give every OpenMP thread a block, the panel within CONV_PATCH_FLOATS
    or the filters' size, blocks of even size): the block's input patches (prologue applied, zero
    padding) are packed into an im2col panel (taps x pixels; a 1x1 stride-1 unpadded conv reads its
    input in place, as it does an input the kernel wrote first as a side output, and most run
    `fs_conv_1x1` over its filters in place: `rows_1x1`), one sgemm
    multiplies the group's filters (C_out/g x taps, a constant read in place) by it, or, where
    `packs_filters` says so, our own micro-kernel multiplies it by the filters packed once into
    `packs`, and the epilogue runs over the block's product while it is in cache, before the one
    store. None for
    depthwise-like groups (one input and under 8 output channels per group), non-2-D convs and
    computed filters; a conv with few output channels over many input channels (a segmentation
    head's 1x1 to 2 classes) stays here: its row loop was 3-8x slower than ONNX Runtime."""
    found = _conv_2d(graph, kernel, args, outs, anchor)
    if found is None:  # `schedule.conv_products` lists "loops" alone
        raise CodegenRefused(f"{anchor.name}(Conv): no {product} blocks for its filters or outputs")
    x, w, xs, ws, ys, group, main, side = found
    cin_g, cout_g = xs[1] // group, ys[1] // group
    e = _Emitter(graph, kernel, args)
    spatial, kern, strides, dilations, pads = _conv_geometry(e, anchor, xs, ws, ys, False)
    taps = [cin_g, *kern]
    kt = math.prod(taps)
    ho, wo = ys[2], ys[3]
    pixels = ho * wo
    cap = conv_block_rows(cout_g, kt, wo)
    # the conv's input as stored: a kernel input, or a side output this kernel writes first (a
    # Concat another kernel reads too), read back rather than computed again per tap
    stored = (args[x] if x in args and graph.producer(x) not in kernel.nodes
              else next((o for o in side if o.tensor == x), None))
    stored = stored if stored is not None and stored.dtype == "float32" else None
    one_by_one = _pixel_wise(kern, strides, pads)
    direct = stored is not None and one_by_one
    idx = ("nb", "co", "oh", "ow")
    band = product == "band"  # constant float32 filters: `_packed` below packs them
    if band:
        fill, band_size = _band_fill(e, x, stored, xs, cin_g, (kern, strides, pads, dilations), wo)
        panel = ldb = None
    elif direct:
        fill, panel, ldb = [], f"{stored.name} + nb * {xs[1] * pixels}LL + gq * {cin_g * pixels}LL + p0", pixels
    elif stored is not None:
        fill = _im2col_rows(stored.name, xs, cin_g, kern, strides, pads, dilations, wo)
        panel, ldb = "patch", "(int)pn"
    else:
        fill = _im2col_prologue(e, x, xs, cin_g, (kern, strides, pads, dilations), wo)
        panel, ldb = "patch", "(int)pn"
    filters, widen = f"{args[w].name} + gq * {cout_g * kt}LL", []
    rows = product == "rows"
    packed = (_packed(packs, graph, args, w, (kt, cout_g, 1, kt), group, cout_g * kt)
              if product in ("band", "packed") else None)
    if args[w].dtype != "float32":  # half filters: the group's widened into a float panel per block
        filters = "wbuf"
        widen = [scratch("wbuf", f"{cout_g * kt}LL"),
                 f"for (long long q = 0; q < {cout_g * kt}LL; ++q) "
                 f"wbuf[q] = {load_expr(args[w].dtype, f'{args[w].name}[gq * {cout_g * kt}LL + q]')};"]
    flat = _flat_epilogue(e, main, ys)
    e.lines = []
    e.push()
    e.acc_value = f"cbuf[col * pn + (oh - oh0) * {wo}LL + ow]"
    writes = [_write(e, o, idx, ys) for o in main]
    body = e.lines + writes
    e.pop()
    e.acc_value = ""
    if flat is not None:  # the block's pixels as one loop
        epilogue = [*(["        #pragma omp simd"] if _flat_loop(flat) else []),
                    "        for (long long q = 0; q < pn; ++q) {", *["            " + x_ for x_ in flat], "        }"]
    else:
        epilogue = ["        for (long long oh = oh0; oh < oh1; ++oh) {",
                    *(["            #pragma omp simd"] if _flat_loop(body) else []),
                    f"            for (long long ow = 0; ow < {wo}LL; ++ow) {{", *["                " + x_ for x_ in body],
                    "            }", "        }"]
    block = [f"for (long long blk = 0; blk < {xs[0] * group}LL * blocks; ++blk) {{",
             f"    long long nb = blk / ({group}LL * blocks), gq = blk / blocks % {group}LL;",
             "    long long oh0 = blk % blocks * rb;",
             f"    long long oh1 = oh0 + rb < {ho}LL ? oh0 + rb : {ho}LL;",
             f"    long long p0 = oh0 * {wo}LL, pn = (oh1 - oh0) * {wo}LL;",
             *(["    " + scratch("patch", band_size if band else f"{kt}LL * pn")] if not direct else []),
             "    " + scratch("cbuf", f"{cout_g}LL * pn"),
             *["    " + x_ for x_ in fill + widen],
             f"    fs_conv_band(pn, {cout_g}LL, {kt}LL, {wo}LL, {strides[0]}LL * bw, {strides[1]}LL, patch, offs, "
             f"{packed} + gq * {packs[w].group_floats if packed else 0}LL, cbuf, pn);" if band else
             f"    fs_gemm_packed(pn, {cout_g}LL, {kt}LL, {panel}, 1, {ldb}, {packed} + gq * {packs[w].group_floats if packed else 0}LL, "
             f"cbuf, pn);" if packed else
             f"    fs_conv_1x1({cout_g}LL, pn, {kt}LL, {filters}, {kt}LL, {panel}, {ldb}, cbuf, pn, {int(direct)});" if rows else
             f"    FS_BLAS_SGEMM(101, 111, 111, {cout_g}, (int)pn, {kt}, 1.0f, {filters}, "
             f"{kt}, {panel}, {ldb}, 0.0f, cbuf, (int)pn);",
             f"    for (long long col = 0; col < {cout_g}LL; ++col) {{", f"        long long co = gq * {cout_g}LL + col;",
             *epilogue, "    }",
             "}"]
    c_side, _ = _pointwise_loops(graph, kernel, args, side)
    held = (0 if direct else kt) + cout_g  # floats per pixel a block holds: its panel and its product
    fit = ([] if band else
           [f"{{ long long budget = fs_band_chunk() / {CONV_FIT_SHARE}LL, fit = budget / {held * wo}LL;",
            f"  if ({cout_g * kt * CONV_FIT_SHARE}LL <= budget && rb > fit) rb = fit > 0 ? fit : 1; }}"])
    split = (f"long long split = (fs_threads() + {xs[0] * group}LL - 1) / {xs[0] * group}LL;",  # blocks per image
             f"long long rb = ({ho}LL + split - 1) / split;", f"if (rb > {cap}LL) rb = {cap}LL;", *fit,
             f"long long blocks = ({ho}LL + rb - 1) / rb;",
             f"rb = ({ho}LL + blocks - 1) / blocks;")  # even blocks: a short last one costs a whole filter packing
    return c_side + ["    {", *["    " + x for x in split], f"    {OMP_FOR}\n"
                     + _indent(block, 1), "    }"]


def _flat_epilogue(e: _Emitter, main, ys) -> list[str] | None:
    """The conv epilogue's statements at pixel q of a block (whole output rows: the output's flat
    pixel p0 + q), or None where one needs the pixel's row or column apart (a bias along the
    width): a block of 14x14 pixels is then one loop of 196, not 14 of 14."""
    e.acc_value = "cbuf[col * pn + q]"
    found = e.over_flat("(p0 + q)", ys[2:], lambda pixel: [_write(e, o, ("nb", "co", *pixel), ys) for o in main])
    e.acc_value = ""
    return None if found is None else [*found[0], *found[1]]


def _band_fill(e: _Emitter, x: str, stored: Arg | None, xs, cin_g: int, geometry, wo: int) -> tuple[list[str], str]:
    """(the lines, the size in floats) of the zero-bordered band of the input (prologue applied,
    or a half input widened) that output rows oh0..oh1 of group gq read, and the tap offsets
    `offs` in it (`fs_conv_band`): per channel `bh` rows of `bw` columns (the band of the
    longest block, so one table serves every block), each element computed once; rows and columns
    outside the image zeros, the interior with no bounds test; a Concat along the channels
    (`_channel_concat`) one channel loop per piece, each computing its own piece only."""
    (kh_n, kw_n), (sh, sw), (ph, pw), (dh, dw) = geometry
    h, w = xs[2], xs[3]
    khd = (kh_n - 1) * dh + 1
    bw = max(pw + w, (wo - 1) * sw + (kw_n - 1) * dw + 1)
    kt = cin_g * kh_n * kw_n
    lines = [f"long long ih0 = oh0 * {sh}LL - {ph}LL, br = (oh1 - oh0 - 1) * {sh}LL + {khd}LL, "
             f"bh = (rb - 1) * {sh}LL + {khd}LL, bw = {bw}LL;",
             f"int* offs = (int*)fs_scratch({SCRATCH_SLOTS.index('offs')}, sizeof(int) * {kt}LL);",
             f"for (long long kq = 0; kq < {kt}LL; ++kq) offs[kq] = (int)(((kq / {kh_n * kw_n}LL) * bh + kq / {kw_n}LL "
             f"% {kh_n}LL * {dh}LL) * bw + kq % {kw_n}LL * {dw}LL);"]
    found = None if stored is not None else _channel_concat(e.graph, e.members, x, xs)
    pieces = [(None, 0, 0, xs[1])] if found is None else [(found[0], k, lo, hi) for k, (lo, hi) in enumerate(found[1])]
    for concat, k, lo, hi in pieces:
        if stored is not None:
            body, v = [], f"{stored.name}[((nb * {xs[1]}LL + gq * {cin_g}LL + ci) * {h}LL + ih) * {w}LL + iw]"
        else:
            e.pinned = {} if concat is None else {concat: k}
            e.lines = []
            e.push()
            v = e.value(x, ("nb", f"(gq * {cin_g}LL + ci)", "ih", "iw"))
            e.pop()
            body = e.lines
        lines += [f"for (long long ci = {lo}LL - gq * {cin_g}LL < 0 ? 0 : {lo}LL - gq * {cin_g}LL; "
                  f"ci < {cin_g}LL && ci < {hi}LL - gq * {cin_g}LL; ++ci) {{",
                  "    for (long long r = 0; r < br; ++r) {",
                  "        float* dst = patch + (ci * bh + r) * bw;",
                  "        long long ih = ih0 + r;",
                  f"        if (ih < 0 || ih >= {h}LL) {{ for (long long q = 0; q < bw; ++q) dst[q] = 0.0f; continue; }}",
                  f"        for (long long q = 0; q < {pw}LL; ++q) dst[q] = 0.0f;",
                  f"        for (long long q = {pw + w}LL; q < bw; ++q) dst[q] = 0.0f;",
                  *(["        #pragma omp simd"] if _flat_loop(body) else []),
                  f"        for (long long iw = 0; iw < {w}LL; ++iw) {{", *["            " + x_ for x_ in body],
                  f"            dst[{pw}LL + iw] = {v};", "        }", "    }", "}"]
    e.pinned = {}
    return lines, f"{cin_g}LL * ((rb - 1) * {sh}LL + {khd}LL) * {bw}LL + 16"


def _im2col_tap(geometry, xs, wo: int, interior: list[str]) -> list[str]:
    """The body of tap `kq`'s loop of an im2col panel over output rows oh0..oh1: the tap's channel
    and offsets, zero rows above and below the image and zero columns beside it, and `interior`
    (lines filling dst[lo..hi) of one row, `ih` and `off` known) in between."""
    (kh_n, kw_n), (sh, sw), (ph, pw), (dh, dw) = geometry
    h, w = xs[2], xs[3]
    return [f"    long long ci = kq / {kh_n * kw_n}LL, kh = kq / {kw_n}LL % {kh_n}LL, kw = kq % {kw_n}LL;",
            f"    long long off = kw * {dw}LL - {pw}LL;",
            f"    long long lo = off >= 0 ? 0 : (-off + {sw}LL - 1) / {sw}LL;",
            f"    long long hi = {w}LL - off > 0 ? ({w}LL - off + {sw}LL - 1) / {sw}LL : 0;",
            f"    if (hi > {wo}LL) hi = {wo}LL;", "    if (lo > hi) lo = hi;",
            "    for (long long oh = oh0; oh < oh1; ++oh) {",
            f"        float* dst = patch + kq * pn + (oh - oh0) * {wo}LL;",
            f"        long long ih = oh * {sh}LL - {ph}LL + kh * {dh}LL;",
            f"        if (ih < 0 || ih >= {h}LL) {{ for (long long ow = 0; ow < {wo}LL; ++ow) dst[ow] = 0.0f; continue; }}",
            "        for (long long ow = 0; ow < lo; ++ow) dst[ow] = 0.0f;",
            *["        " + x for x in interior],
            f"        for (long long ow = hi; ow < {wo}LL; ++ow) dst[ow] = 0.0f;", "    }"]


def _im2col_rows(x: str, xs, cin_g: int, kern, strides, pads, dilations, wo: int) -> list[str]:
    """The im2col panel of output rows oh0..oh1 read from the input as it is (no prologue): per tap
    and output row, the zero rows and columns outside the image, a strided copy in between."""
    (kh_n, kw_n), (_, sw), h, w = kern, strides, xs[2], xs[3]
    copy = [f"const float* src = {x} + ((nb * {xs[1]}LL + gq * {cin_g}LL + ci) * {h}LL + ih) * {w}LL + off;",
            "#pragma omp simd", f"for (long long ow = lo; ow < hi; ++ow) dst[ow] = src[ow * {sw}LL];"]
    return [f"for (long long kq = 0; kq < {cin_g * kh_n * kw_n}LL; ++kq) {{",
            *_im2col_tap((kern, strides, pads, dilations), xs, wo, copy), "}"]


def _im2col_prologue(e: _Emitter, x: str, xs, cin_g: int, geometry, wo: int) -> list[str]:
    """The im2col panel of output rows oh0..oh1 with the prologue applied (or a half input
    widened): as `_im2col_rows`, the rows and columns outside the image are zeros and the prologue
    runs only on the interior, with no bounds test per element; a Concat along the channels the
    input is computed from (`_channel_concat`) becomes one tap loop per piece, each computing its
    own piece only: no branch per element (under `omp simd` both sides of one were computed)."""
    (kh_n, kw_n), (_, sw) = geometry[0], geometry[1]
    khkw, kt = kh_n * kw_n, cin_g * kh_n * kw_n
    found = _channel_concat(e.graph, e.members, x, xs)
    pieces = [(None, 0, 0, xs[1])] if found is None else [(found[0], k, lo, hi) for k, (lo, hi) in enumerate(found[1])]
    lines = []
    pointwise = _pixel_wise(*geometry[:3])
    for concat, k, lo, hi in pieces:
        e.pinned = {} if concat is None else {concat: k}
        if concat is None:
            head, tail = [f"for (long long kq = 0; kq < {kt}LL; ++kq) {{"], ["}"]
        else:  # the taps of this piece's channels within the group
            head = ["{", f"    long long klo = ({lo}LL - gq * {cin_g}LL) * {khkw}LL, khi = ({hi}LL - gq * {cin_g}LL) * {khkw}LL;",
                    "    if (klo < 0) klo = 0;", f"    if (khi > {kt}LL) khi = {kt}LL;",
                    "for (long long kq = klo; kq < khi; ++kq) {"]
            tail = ["}", "}"]
        # a 1x1 stride-1 unpadded tap: the block's pixels as one loop, where no load divides the pixel
        flat = (e.over_flat("(p0 + q)", xs[2:], lambda pixel: [e.value(x, ("nb", f"(gq * {cin_g}LL + ci)", *pixel))])
                if pointwise else None)
        if flat is not None:
            body, (v,) = flat
            lines += [*head, "    long long ci = kq;", "    float* dst = patch + kq * pn;",
                      *(["    #pragma omp simd"] if _flat_loop(body) else []), "    for (long long q = 0; q < pn; ++q) {",
                      *["        " + x_ for x_ in body], f"        dst[q] = {v};", "    }", *tail]
            continue
        e.lines = []
        e.push()
        v = e.value(x, ("nb", f"(gq * {cin_g}LL + ci)", "ih", f"(ow * {sw}LL + off)"))
        e.pop()
        body = e.lines
        fill = [*(["#pragma omp simd"] if _flat_loop(body) else []), "for (long long ow = lo; ow < hi; ++ow) {",
                *["    " + x_ for x_ in body], f"    dst[ow] = {v};", "}"]
        lines += [*head, *_im2col_tap(geometry, xs, wo, fill), *tail]
    e.pinned = {}
    return lines


def _channel_concat(graph: Graph, members, x: str, xs) -> tuple[str, list[tuple[int, int]]] | None:
    """(the Concat's output, each input's channel range) when a conv input `x` is computed in the
    group from one Concat along the channels of x's own shape through same-shape elementwise or
    broadcast ops only (every path from the Concat to x keeps the channel index), else None."""
    seen, stack = set(), [x]
    while stack:
        p = graph.producer(stack.pop())
        if p is not None and p in members and p not in seen:
            seen.add(p)
            stack += [i for i in graph.nodes[p].inputs if i]
    concats = [p for p in seen if graph.nodes[p].op_type == "Concat"
               and int(graph.nodes[p].attrs.get("axis", 0)) % len(xs) == 1 and graph.tensors[graph.nodes[p].outputs[0]].shape == tuple(xs)]
    if len(concats) != 1:
        return None
    node = graph.nodes[concats[0]]
    derived = {node.outputs[0]}
    for p in sorted(seen):  # topological: ids are positions
        n = graph.nodes[p]
        if p == concats[0] or not any(i in derived for i in n.inputs):
            continue
        if (kind_of(n.op_type, n.domain) > OpKind.BROADCAST or graph.tensors[n.outputs[0]].shape != tuple(xs)
                or any(i in derived and graph.tensors[i].shape != tuple(xs) for i in n.inputs)):
            return None
        derived.update(n.outputs)
    if x not in derived:
        return None
    ranges, at = [], 0
    for i in (i for i in node.inputs if i):
        ranges.append((at, at + graph.tensors[i].shape[1]))
        at += graph.tensors[i].shape[1]
    return node.outputs[0], ranges


def _conv_2d(graph: Graph, kernel: Kernel, args, outs, anchor: Node):
    """(x, w, shapes of x, w, y, group, outputs of y's shape, other outputs) of a 2-D conv whose
    filter is a float32 (or half) kernel input, or None."""
    x, w = anchor.inputs[0], anchor.inputs[1]
    xs, ws, ys = (graph.tensors[t].shape for t in (x, w, anchor.outputs[0]))
    if (len(xs) != 4 or w not in args or compute_dtype(graph.tensors[w].dtype) != "float32"
            or graph.producer(w) in kernel.nodes):
        return None
    main, side = _split_outputs(graph, kernel, outs, anchor)
    if not main:
        return None
    return x, w, xs, ws, ys, int(anchor.attrs.get("group", 1)), main, side


DEPTHWISE_LANES = 8  # floats per vector the depthwise loop is written for (AVX2)


def _depthwise_loops(graph: Graph, kernel: Kernel, args, outs, anchor: Node) -> list[str] | None:
    """C depthwise conv (one input channel per group): per image and output channel, its input
    channel (prologue applied once per element, not once per tap) into zero-bordered planes (the
    per-thread `patch` scratch), then every output row as one vectorized loop over its pixels with
    the taps unrolled, the filter's taps in registers and no bounds check (the border is the
    planes' zeros), the epilogue on each pixel before its one store. A column stride s splits the
    padded columns into s planes by column modulo s (for s = 2 each input row, prologue applied,
    contiguous into a row buffer, then split by parity with `fs_split2`), so every tap reads unit-stride (a strided
    read vectorizes as a gather). At mobilenetv2's 7x7 and 14x14 planes, where most pixels touch
    the border, the earlier per-pixel bounds-checked border path ran 5-10x slower than priced.
    For a depthwise conv (`schedule.depthwise_conv`: 2-D, one input channel per group); None
    where its filter is computed in the kernel (the row loops then run it)."""
    found = _conv_2d(graph, kernel, args, outs, anchor)
    if found is None:
        return None
    x, w, xs, ws, ys, group, main, side = found
    e = _Emitter(graph, kernel, args)
    _, (kh_n, kw_n), (sh, sw), (dh, dw), (ph, pw) = _conv_geometry(e, anchor, xs, ws, ys, False)
    cout_g = ys[1] // group
    h, wd, oh_n, ow_n = xs[2], xs[3], ys[2], ys[3]
    hp = max(ph + h, (oh_n - 1) * sh + (kh_n - 1) * dh + 1)  # the padded plane's rows and columns
    wp = max(pw + wd, (ow_n - 1) * sw + (kw_n - 1) * dw + 1)
    wq = -(-wp // sw)  # columns of each of the sw planes: padded column c sits in plane c % sw at c // sw

    def at(row: str, column: int, col0: str) -> str:  # padded (row, col0 * sw + column) in its plane
        return f"patch[({column % sw * hp}LL + {row}) * {wq}LL + {col0} + {column // sw}LL]"

    spans = []  # per plane, the columns j holding image values: [lo, hi); the rest are zeros
    for f in range(sw):  # plane f: padded columns j * sw + f, input column j * sw + f - pw
        lo = max(0, -(-(pw - f) // sw))
        spans.append((lo, max(lo, min(wq, (wd - 1 + pw - f) // sw + 1))))
    both = (max(a for a, _ in spans), min(b for _, b in spans))  # one loop fills every plane here

    def simd_loop(var: str, lo: int, hi: int, stores) -> list[str]:
        """for var in [lo, hi): the input values `stores` reads (its (target, input column) pairs)
        computed, prologue applied, and stored; under `omp simd` where the body allows."""
        if hi <= lo:
            return []
        e.lines = []
        e.push()
        assigned = [f"{target} = {e.value(x, ('nb', 'ci', 'ih', column))};" for target, column in stores]
        body, e.lines = [*e.lines, *assigned], []
        e.pop()
        return [*(["#pragma omp simd"] if _flat_loop(body) else []), f"for (long long {var} = {lo}LL; {var} < {hi}LL; ++{var}) {{",
                *["    " + x_ for x_ in body], "}"]

    def fill_loop(planes, lo: int, hi: int) -> list[str]:
        return simd_loop("j", lo, hi, [(at(f"ih + {ph}LL", f, "j"), f"(j * {sw}LL + {f - pw}LL)") for f in planes])

    fill = []
    for f, (lo, hi) in enumerate(spans):
        row = f"({f * hp}LL + ih + {ph}LL) * {wq}LL"
        fill += [f"for (long long j = {a}LL; j < {b}LL; ++j) patch[{row} + j] = 0.0f;" for a, b in ((0, lo), (hi, wq)) if b > a]
        if sw != 2:
            fill += fill_loop([f], lo, min(hi, both[0])) + fill_loop([f], max(lo, both[1]), hi)
    if sw == 2:  # the input row, prologue applied, contiguous into `rowb`, then split by parity
        # (`fs_split2`): input column c = 2 m + r is padded column c + pw, plane (r + pw) % 2,
        # column m + (r + pw) // 2; read at stride 2 the planes' loop ran in permutes and a
        # scalar remainder, 70% of mobilenetv2's 112x112 strided depthwise conv
        fill += simd_loop("c", 0, wd, [("rowb[c]", "c")])
        dest = [f"patch + ({(r + pw) % 2 * hp}LL + ih + {ph}LL) * {wq}LL + {(r + pw) // 2}LL" for r in (0, 1)]
        fill.append(f"fs_split2(rowb, {dest[0]}, {dest[1]}, {(wd + 1) // 2}LL, {wd // 2}LL);")
    else:
        fill += fill_loop(range(sw), *both)  # a column stride's planes from one pass over the input row
    # flat: the sums over every plane position p = oh * sh * wq + ow (a tap at a fixed offset from
    # p, so one long vector loop), columns past the output's computed and dropped, then the
    # epilogue per row from that buffer; where rows are narrow (a row loop of 7 or 14 pixels runs
    # mostly in its scalar remainder) or the waste is only the filter's overhang (stride 1)
    flat = sh == 1 or ow_n < 2 * DEPTHWISE_LANES
    pos = "p" if flat else "ow"
    e.lines = []
    e.push()
    rows = [" + ".join(f"w{kh}_{kw} * {at(str(kh * dh) + 'LL' if flat else f'oh * {sh}LL + {kh * dh}LL', kw * dw, pos)}"
                       for kw in range(kw_n)) for kh in range(kh_n)]  # an FMA chain per filter row, then summed
    total = " + ".join(f"({r})" for r in rows)  # _conv adds the bias
    if flat:
        sums = [f"for (long long p = 0; p < {(oh_n - 1) * sh * wq + ow_n}LL; ++p) cbuf[p] = {total};"]
        e.acc_value = f"cbuf[oh * {sh * wq}LL + ow]"
    else:
        sums = []
        e.acc_value = e.tmp("float", total)
    writes = [_write(e, o, ("nb", "co", "oh", "ow"), ys) for o in main]
    e.acc_value = ""
    body, e.lines = e.lines + writes, []
    e.pop()
    taps = [f"const float w{kh}_{kw} = {load_expr(args[w].dtype, f'{args[w].name}[co * {kh_n * kw_n}LL + {kh * kw_n + kw}LL]')};"
            for kh in range(kh_n) for kw in range(kw_n)]
    zero = [f"for (long long q = {a}LL; q < {b}LL; ++q) patch[q] = 0.0f;"  # the rows above and below the image
            for f in range(sw) for a, b in ((f * hp * wq, (f * hp + ph) * wq), ((f * hp + ph + h) * wq, (f + 1) * hp * wq))
            if b > a]
    block = [f"for (long long nc = 0; nc < {xs[0] * ys[1]}LL; ++nc) {{",
             f"    long long nb = nc / {ys[1]}LL, co = nc % {ys[1]}LL, ci = co / {cout_g}LL;",
             "    " + scratch("patch", f"{sw * hp * wq}LL"), *["    " + z for z in zero],
             *(["    " + scratch("cbuf", f"{oh_n * sh * wq}LL")] if flat else []),
             *([f"    float rowb[{wd}];"] if sw == 2 else []),
             f"    for (long long ih = 0; ih < {h}LL; ++ih) {{", *["        " + x_ for x_ in fill], "    }",
             *["    " + t for t in taps], *(["    #pragma omp simd"] if sums else []), *["    " + x_ for x_ in sums],
             f"    for (long long oh = 0; oh < {oh_n}LL; ++oh) {{",
             *(["        #pragma omp simd"] if _flat_loop(body) else []),
             f"        for (long long ow = 0; ow < {ow_n}LL; ++ow) {{", *["            " + x_ for x_ in body], "        }",
             "    }", "}"]
    c_side, _ = _pointwise_loops(graph, kernel, args, side)
    return c_side + [f"    {OMP_FOR}\n" + _indent(block, 1)]


def _conv_row_loops(graph: Graph, kernel: Kernel, args, outs, anchor: Node) -> list[str] | None:
    """C conv without a BLAS: per output pixel, the input patch (prologue applied) once into a
    buffer, dotted with each output channel's contiguous filter row."""
    y = anchor.outputs[0]
    yshape = graph.tensors[y].shape
    main, side = _split_outputs(graph, kernel, outs, anchor)
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
        writes.append(_write(e, o, idx, yshape))
    body = e.lines + writes
    e.pop()
    rows = math.prod(outer_shape)
    loop = [f"for (long long row = 0; row < {rows}LL; ++row) {{", *["    " + x for x in pre],
            f"    float hbuf[{extent}];"]
    loop += [f"    for (long long {col} = 0; {col} < {yshape[inner_axis]}LL; ++{col}) {{"]
    loop += ["        " + x for x in fill_lines + body] + ["    }", "}"]
    c_side, _ = _pointwise_loops(graph, kernel, args, side)
    return c_side + [f"    {OMP_FOR}\n" + _indent(loop, 1)]


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
