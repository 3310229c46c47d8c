"""The packed CPU skeleton for gemm/conv (C only): blocks of output rows, each multiplied by our
own micro-kernel over weights packed once or by a BLAS call, with the prologue packed into the
activation panel and the epilogue on the tile in cache; k x k convs over a zero-bordered band of
their input, 1x1 convs through im2col panels or in place; the depthwise loop; and the per-row
fallback without a BLAS (`#else`).

Our own micro-kernel or a BLAS call per block: `benchmarks/bench_cpu.py --sections 1b` times our
micro-kernel (the C prelude's `fs_micro`, 6x16 with AVX2/FMA; with AVX-512 6 or 12 x 32 over two
B panels, `fs_micro_x2`) over B packed once by `fs_pack_b`, against scipy-openblas32's sgemm
(which packs B inside every call), at the zoo's GEMM shapes. The choices and figures below were
made and measured on one Zen 3 core (AVX2); on an Ice Lake Xeon core (AVX-512) the same choices
hold with a wider margin (`fs_gemm_rows` 1.15-1.25x the BLAS, the band convs 1.2-1.5x im2col +
BLAS, the packed 1x1 convs 1.2-1.4x); the thresholds that leave the other 1x1 convs and the
K = 3072 down-projections on the BLAS were not measured again there. MatMul/Gemm whose B is a constant float32 (packed
once per plan) or a view of an input (attention's values along N and its keys along K, packed
per block) use ours
(`fs_gemm_rows`: A read by rows in place, each tile stored straight into the output, at the merged
heads' stride, plus a bias row and a residual read in place where the epilogue adds them, or
added onto an output prefilled with other terms): in 1b's
loop 0.98-1.06x the BLAS at bert-small's and vit-small's shapes (two runs) and 1.02x at bert-base's
768x768; inside the generated kernels, interleaved with the same kernels through the BLAS, 1.04x
over bert-small's gemm groups and 1.08x over vit-small's, and 1.06-1.10x at attention's context
products with the values packed per head (against
ONNX Runtime's MLAS with its weights pre-packed, as in the whole model, the fused groups are
within a few percent of library + rest: the README's benchmark table). It had no K or N blocking
then (blocks of B's columns kept in L2 measured no faster inside the kernels on Zen 3; they
took 1b's bert-base shapes from 0.67x to 0.88x the BLAS on Ice Lake, so they are in); at gpt2's 768x2304
QKV (B of 1.8M floats) it ran 1.03-1.04x the BLAS, at its 768x3072 up-projection 0.91-1.05x
(as wide as an A/A pair's spread on this machine: no measured gain or loss), at K = 3072
(the down-projections, GELU prologue) 0.90-0.97x (with GELU's x 0.5 folded and the activation
read in place, within noise of the BLAS inside bert-base's kernel; on an Ice Lake core, with
the AVX-512 tiles and B's columns blocked in L2, 1.28x faster than the BLAS, so `ROWS_MAX_K` is
now 4096). The BLAS stays beyond `ROWS_MAX_K` and `ROWS_MAX_B_FLOATS`, below one full tile (FS_MR rows, FS_NR columns: it would compute padding)
and for B computed in the group. Attention's keys (B transposed by strides) ran 0.98-1.01x the
BLAS with the k loop rolled; unrolled, the score groups (scale, mask and Softmax on the product)
run 1.11-1.17x faster than through the BLAS at bert-small's, bert-base's, vit-small's and gpt2's
shapes (interleaved medians), so they are packed per head too.
Every k x k conv with constant float32 filters (not depthwise-like: `schedule.conv_reads_band`)
uses ours over a band: per block of output rows its input, prologue applied once per element,
into a zero-bordered band, its taps packed per chunk of pixels straight from there into 6-pixel
panels and multiplied by the filters packed once (`fs_conv_band`, `_band_fill`): against the
im2col panel through the BLAS (written, then packed again by every sgemm), interleaved,
1.07-1.15x at resnet's and U-Net's 3x3 stride-1 convs, 1.03-1.10x strided (the even floats of
16 per tap), 0.91x at a 3-channel stem (27 taps: the transposed tile stores dominate). A 1x1
stride-1 conv over blocks of at least 14 x 14 pixels, or over few input channels read in place
(`rows_1x1`), packs its pixels per chunk (the input read in place or the prologue's panel) and
runs `fs_gemm_rows` over the filters in place, each tile stored straight into the block's
channels x pixels (`fs_conv_1x1`): 0.76-0.98x the BLAS's time at 20 x 20 and above (yolo-neck,
resnet50, mobilenetv2), 0.87-0.96x the packed filters' at mobilenetv2's 14 x 14.
1x1 convs whose filters dwarf their activations also use ours: with the filters packed once per plan
(`PackedWeight`, packed by the kernel's `_pack` function before its first call) and the product
computed as pixels x filters, each tile stored transposed into the channels x pixels block the
epilogue reads (`fs_gemm_packed`), the convs of resnet's last stages (3x3 over 512 filters at
7x7, the strided 3x3 to 512, resnet50's 1x1 512<->2048 at 7x7) ran 1.14-1.35x faster than through
the BLAS, which packs up to 9 MiB of filters again per block; below PACK_FILTER_FLOATS, or with
fewer than twice as many filters as a block has pixels, the two were within noise (0.86-1.05x;
U-Net's 16x16 Concat+Conv over 256 filters 0.92x packed), so the BLAS stayed there; on an Ice
Lake core, convs over at least 96 taps with blocks of at most 14 x 14 pixels ran 0.66-1.02x the
BLAS's time packed (0.85-0.87x summed per model), so they are packed too (`packs_filters`),
except the 1x1 convs over at most 384 taps at 14 x 14, which `fs_conv_1x1` runs faster still.
A scalar scale on a MatMul's activation (GELU's x 0.5 before a down-projection:
`schedule.folded_scale`) is folded into the product, the weights scaled as they are packed or the
BLAS's alpha, and the activation read in place: 194 -> 179 us at bert-small's 128x512x128.
Operands go to the BLAS by strides wherever a view allows (found by probing the views' index maps
at generation time: `_b_source`, `_view_strides`): attention's keys are read in place, a product
that heads merge into is stored at the output's row stride; computed panels are packed in the
order their source runs, and a conv's prologue fills only the image interior, one tap loop per
piece of a channel Concat.
Invariants: every BLAS path sits under `#ifdef FS_BLAS_SGEMM` with a loop fallback, so the same
source compiles with and without a BLAS (a product over packed weights needs none: its path is
unconditional); only float32 constants (initializers) are packed, once per runner or program,
never per call; blocks run in parallel (OpenMP), each BLAS call alone;
scratch comes from the per-thread arena (`base.scratch`), never a malloc per call.
"""

from __future__ import annotations

import math

import numpy as np

from fusesearch.backends.codegen.base import (
    FS_MR,
    FS_NR,
    SCRATCH_SLOTS,
    Arg,
    PackedWeight,
    _flat_loop,
    _indent,
    _lit,
    compute_dtype,
    load_expr,
    scratch,
    store,
)
from fusesearch.backends.codegen.emitter import _Emitter
from fusesearch.backends.codegen.ops import _conv_geometry, _conv_input
from fusesearch.backends.codegen.pointwise import _pointwise_loops
from fusesearch.ir.graph import Graph, Node
from fusesearch.ir.op_kind import OpKind, kind_of
from fusesearch.lowering import Kernel
from fusesearch.schedule import anchor_derived, conv_reads_band, depthwise_like, folded_scale

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


def _anchor_row_loops(graph: Graph, kernel: Kernel, args, outs, packs: dict) -> list[str] | None:
    """C skeleton for gemm/conv with a prologue on the activation operand: per output row (all
    output dims but the one the weights span), the operand's row (MatMul/Gemm: A[m, :]; Conv: the
    input patch of one output pixel and group) is computed once into a buffer, then reused for
    every output column — the CPU analogue of a tile load. None when there is nothing to hoist."""
    if kernel.anchor is None:
        return None
    anchor = graph.nodes[kernel.anchor]
    if anchor_derived(graph, kernel.nodes, anchor) is None:  # the epilogue moves elements
        return _materialized_loops(graph, kernel, args, outs, anchor, packs)
    if anchor.op_type in ("MatMul", "Gemm"):
        return _matmul_row_loops(graph, kernel, args, outs, anchor, packs=packs)
    if anchor.op_type != "Conv":
        return None
    return _conv_loops(graph, kernel, args, outs, anchor, packs)


def _conv_loops(graph: Graph, kernel: Kernel, args, outs, anchor: Node, packs: dict) -> list[str] | None:
    """C conv: the depthwise loop, or the BLAS blocks with the per-pixel row loops as fallback."""
    depthwise = _depthwise_loops(graph, kernel, args, outs, anchor)
    if depthwise is not None:
        return depthwise
    hoisted = _conv_row_loops(graph, kernel, args, outs, anchor)
    used: dict = {}  # the weights packed, kept only when this path is taken
    blas = _conv_blas_blocks(graph, kernel, args, outs, anchor, used)
    if used:  # our own packed GEMM: no BLAS needed
        packs.update(used)
        return blas
    if blas is None or hoisted is None:
        return hoisted
    return ["#ifdef FS_BLAS_SGEMM", *blas, "#else", *hoisted, "#endif"]


CONV_PATCH_FLOATS = 1 << 18  # C conv: im2col panel per block (1 MiB), whole output rows
# C conv: filters of at least this many floats (4 MiB), at least twice as many as a block has
# pixels, are packed once (`PackedWeight`) and multiplied by our own micro-kernel
# (`fs_gemm_packed`) instead of a BLAS call that packs them again per block (see the module note;
# the figures from `benchmarks/bench_cpu.py --sections 1b`)
PACK_FILTER_FLOATS = 1 << 20
# ... and so are those of a conv over at least PACK_MIN_TAPS taps whose blocks have at most
# PACK_MAX_PIXELS pixels (14 x 14): each activation element then meets many filters, and the
# filters packed again per BLAS call cost more than our panel of pixels packed per block. On one
# Ice Lake core (AVX-512), fused 1x1 convs generated both ways and timed interleaved, the time
# packed over the BLAS's: mobilenetv2's 0.66-0.91x at 7 x 7 (160 to 960 taps), 0.90-1.02x at
# 14 x 14 (96 to 576 taps; 0.87x summed over its 16), resnet50's 14 x 14 0.71-0.97x (0.85x
# summed), yolo-neck's 10 x 10 0.79-1.01x (0.86x); over 64 taps 1.13-1.39x and at 28 x 28
# 1.18-1.22x, where the BLAS stays (on Zen 3, below the first rule, the two were within noise:
# 0.86-1.05x)
PACK_MIN_TAPS = 96
PACK_MAX_PIXELS = 196
# C conv: a 1x1 stride-1 unpadded conv runs `fs_gemm_rows` over its filters in place, its pixels
# (the input read in place, or the prologue's panel) packed per chunk (`fs_conv_1x1`), each tile
# stored straight into the block's channels x pixels, where its blocks have at least
# ROWS_1X1_MIN_PIXELS pixels (14 x 14) and it has at least two row panels of filters (2 FS_MR),
# unless its filters would be packed (`packs_filters`) over more than ROWS_1X1_PACKED_TAPS taps;
# and, at any size, where it reads its input in place over at most ROWS_1X1_MAX_TAPS input
# channels with at least twice as many filters. On one Ice Lake core (AVX-512), fused 1x1 convs
# generated both ways and timed interleaved, its time over the BLAS's at 20 x 20 and above:
# yolo-neck's 0.77-0.93x (0.88x summed), resnet50's 0.76-0.89x at 28 x 28 and 56 x 56,
# mobilenetv2's 0.82-0.98x at 28 x 28 to 112 x 112 (one 1.14x), but 1.26x at U-Net's head (2
# filters); over the packed filters (`fs_gemm_packed`, which stores each pixels x filters tile
# transposed) at 14 x 14: mobilenetv2's 0.87-0.96x up to 384 taps, 1.02-1.09x at 576, resnet50's
# 0.98-1.03x at 256 taps, 0.98-1.09x at 1024 (a tile's 12 filter rows of 576 or more taps fill
# L1 beside the pixel panels); at 7 x 7 and 10 x 10 1.05-1.67x, where the packed filters stay.
# On Zen 3 the in-place rule measured 1.10-1.18x the BLAS at mobilenetv2's expansions.
ROWS_1X1_MIN_PIXELS = 196
ROWS_1X1_PACKED_TAPS = 384
ROWS_1X1_MAX_TAPS = 64


def packs_filters(filters: int, taps: int, block_pixels: int) -> bool:
    """Whether a conv's filters (filters x taps floats, a block of `block_pixels` output pixels)
    are packed once and multiplied by our own micro-kernel rather than through the BLAS."""
    return ((filters * taps >= PACK_FILTER_FLOATS and filters >= 2 * block_pixels)
            or (taps >= PACK_MIN_TAPS and block_pixels <= PACK_MAX_PIXELS))


def rows_1x1(filters: int, taps: int, block_pixels: int, in_place: bool) -> bool:
    """Whether a 1x1 stride-1 unpadded conv (its input read `in_place`, else a prologue's panel)
    runs through `fs_conv_1x1`."""
    if block_pixels >= ROWS_1X1_MIN_PIXELS and filters >= 2 * FS_MR:
        return taps <= ROWS_1X1_PACKED_TAPS or not packs_filters(filters, taps, block_pixels)
    return in_place and taps <= ROWS_1X1_MAX_TAPS and filters >= 2 * taps


def _pixel_wise(kern, strides, pads) -> bool:
    """Whether a conv's geometry is 1x1, stride 1, unpadded: output pixel p reads input pixel p."""
    return tuple(kern) == (1, 1) and tuple(strides) == (1, 1) and not any(pads)


def conv_block_rows(filters: int, taps: int, width: int) -> int:
    """Output rows per conv block at most: the im2col panel within CONV_PATCH_FLOATS, or within
    the filters' size when they are larger (a BLAS call packs all the filters again per block: a
    512x4608 filter set is 9 MiB)."""
    return max(1, max(CONV_PATCH_FLOATS, filters * taps) // max(1, taps * width))


def _conv_blas_blocks(graph: Graph, kernel: Kernel, args, outs, anchor: Node, packs: dict) -> list[str] | None:
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
    if found is None:
        return None
    x, w, xs, ws, ys, group, main, side = found
    cin_g, cout_g = xs[1] // group, ys[1] // group
    if depthwise_like(cin_g, cout_g):  # its own loop
        return None
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
    band = conv_reads_band(graph, anchor)  # constant float32 filters: `_packed` below packs them
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
    block_pixels = min(pixels, cap * wo)  # one thread's block
    rows = one_by_one and rows_1x1(cout_g, kt, block_pixels, direct)
    packed = (_packed(packs, graph, args, w, (kt, cout_g, 1, kt), group, cout_g * kt)
              if band or (not rows and packs_filters(cout_g, kt, block_pixels)) else None)
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
             f"    fs_conv_1x1({cout_g}LL, pn, {kt}LL, {filters}, {kt}LL, {panel}, {ldb}, cbuf, pn);" if rows else
             f"    FS_BLAS_SGEMM(101, 111, 111, {cout_g}, (int)pn, {kt}, 1.0f, {filters}, "
             f"{kt}, {panel}, {ldb}, 0.0f, cbuf, (int)pn);",
             f"    for (long long col = 0; col < {cout_g}LL; ++col) {{", f"        long long co = gq * {cout_g}LL + col;",
             *epilogue, "    }",
             "}"]
    c_side, _ = _pointwise_loops(graph, kernel, args, side)
    split = (f"long long split = (fs_threads() + {xs[0] * group}LL - 1) / {xs[0] * group}LL;",  # blocks per image
             f"long long rb = ({ho}LL + split - 1) / split;", f"if (rb > {cap}LL) rb = {cap}LL;",
             f"long long blocks = ({ho}LL + rb - 1) / rb;",
             f"rb = ({ho}LL + blocks - 1) / blocks;")  # even blocks: a short last one costs a whole filter packing
    return c_side + ["    {", *["    " + x for x in split], "    #pragma omp parallel for schedule(static)\n"
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
    padded columns into s planes by column modulo s, so every tap reads unit-stride (a strided
    read vectorizes as a gather). At mobilenetv2's 7x7 and 14x14 planes, where most pixels touch
    the border, the earlier per-pixel bounds-checked border path ran 5-10x slower than priced.
    None unless the conv is 2-D with one input channel per group and a constant filter."""
    found = _conv_2d(graph, kernel, args, outs, anchor)
    if found is None:
        return None
    x, w, xs, ws, ys, group, main, side = found
    if group == 1 or xs[1] != group:
        return None
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

    def fill_loop(planes, lo: int, hi: int) -> list[str]:
        if hi <= lo:
            return []
        e.lines = []
        e.push()
        stores = [f"{at(f'ih + {ph}LL', f, 'j')} = {e.value(x, ('nb', 'ci', 'ih', f'(j * {sw}LL + {f - pw}LL)'))};"
                  for f in planes]
        body, e.lines = [*e.lines, *stores], []
        e.pop()
        return [*(["#pragma omp simd"] if _flat_loop(body) else []), f"for (long long j = {lo}LL; j < {hi}LL; ++j) {{",
                *["    " + x_ for x_ in body], "}"]

    fill = []
    for f, (lo, hi) in enumerate(spans):
        row = f"({f * hp}LL + ih + {ph}LL) * {wq}LL"
        fill += [f"for (long long j = {a}LL; j < {b}LL; ++j) patch[{row} + j] = 0.0f;" for a, b in ((0, lo), (hi, wq)) if b > a]
        fill += fill_loop([f], lo, min(hi, both[0])) + fill_loop([f], max(lo, both[1]), hi)
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
             f"    for (long long ih = 0; ih < {h}LL; ++ih) {{", *["        " + x_ for x_ in fill], "    }",
             *["    " + t for t in taps], *(["    #pragma omp simd"] if sums else []), *["    " + x_ for x_ in sums],
             f"    for (long long oh = 0; oh < {oh_n}LL; ++oh) {{",
             *(["        #pragma omp simd"] if _flat_loop(body) else []),
             f"        for (long long ow = 0; ow < {ow_n}LL; ++ow) {{", *["            " + x_ for x_ in body], "        }",
             "    }", "}"]
    c_side, _ = _pointwise_loops(graph, kernel, args, side)
    return c_side + ["    #pragma omp parallel for schedule(static)\n" + _indent(block, 1)]


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
    return c_side + ["    #pragma omp parallel for schedule(static)\n" + _indent(loop, 1)]


def _matmul_row_loops(graph: Graph, kernel: Kernel, args, outs, anchor: Node,
                      store: tuple[str, tuple[int, ...]] | None = None, packs: dict | None = None) -> list[str] | None:
    """C skeleton for MatMul/Gemm (i-k-j order): per output row, the A row (prologue applied)
    into a buffer, acc[n] += a[k] * B[k, n] with n innermost (contiguous, vectorizable), then the
    epilogue per column reading acc[n]. `store` (the output's name and its strides per product
    axis): only the BLAS blocks, each storing its tile there (None without a BLAS path). `packs`
    (where the kernel can take packed weights): a constant B packed once, or attention's values
    packed per block, multiplied by our own micro-kernel (`fs_gemm_rows`), which needs no BLAS."""
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
    c_side, _ = _pointwise_loops(graph, kernel, args, side)
    rows_loop = c_side + ["    #pragma omp parallel for schedule(static)\n" + _indent(loop, 1)]
    if max(k_extent, n_extent) > MAX_HOIST:  # rows too long for the stack: generic loops without a BLAS
        rows_loop = _pointwise_loops(graph, kernel, args, outs)[0]
    # a Gemm's C operand is a term without the product (its alpha must be 1: the product is added as is)
    gemm_c = anchor.op_type == "Gemm" and len(anchor.inputs) > 2 and bool(anchor.inputs[2])
    alpha_one = anchor.op_type == "MatMul" or float(anchor.attrs.get("alpha", 1.0)) == 1.0
    terms = _additive_terms(graph, kernel, y, main[0].tensor) if len(main) == 1 and (main[0].tensor != y or gemm_c) else None
    additive = terms is not None
    direct = ((main[0].name, _row_major(yshape)) if len(main) == 1 and (main[0].tensor == y or additive)
              and main[0].dtype == "float32" and alpha_one else None)  # the BLAS stores the output
    prefill = init = None
    if direct and additive:  # the output is the product plus terms without it: those first, then the BLAS adds
        e.lines = []
        e.push()
        e.acc_value = "0.0f"
        prefill = e.lines + [_write(e, main[0], idx, yshape)]
        e.acc_value = ""
        e.pop()
        init = _terms_in_place(args, anchor, ([anchor.inputs[2]] if gemm_c else []) + terms, yshape)
    written = {o.tensor: o for o in side} if store is None else {}  # computed by c_side before the blocks
    blas = _blas_blocks(graph, e, anchor, yshape, (k_extent, n_extent, trans_b), pre, fill, body, store or direct, prefill,
                        packs, init, written)
    if blas is not None and _OWN in "".join(blas):  # our micro-kernel over B packed once: no BLAS needed
        return [*c_side, *blas] if store is None else blas
    if store is not None:  # only the BLAS blocks, storing through the given strides
        return blas
    if blas is None:
        return rows_loop if max(k_extent, n_extent) <= MAX_HOIST else None
    return ["#ifdef FS_BLAS_SGEMM", *c_side, *blas, "#else", *rows_loop, "#endif"]


# C gemm: at most this product tile (8 MiB, within the last-level cache) per BLAS call. Each call
# packs all of B again, so fewer, even calls win: at 128x2304x768 one call runs at 86 GFLOP/s,
# 113 + 15 rows (a 1 MiB cap) at 72 and 64 + 64 at 79 (one Zen 3 core, scipy-openblas32;
# `benchmarks/bench_cpu.py --sections 1b` times the three)
BLAS_TILE_FLOATS = 1 << 21
# C gemm with a constant B (or attention's values): our micro-kernel over B packed (`fs_gemm_rows`,
# B's columns in blocks kept in L2) where K <= ROWS_MAX_K (a pair of B micro-panels, 2 x FS_NR x K
# floats, 512 KiB at most, stays in L2 while the row panels of A run over it) and B has at most
# ROWS_MAX_B_FLOATS. ROWS_MAX_K was 2048 until the AVX-512 tiles and the column blocks: on one
# Ice Lake core bert-base's 128x3072x768 down-projection group (GELU prologue, bias, residual) ran
# 1.28x faster through ours than through the BLAS (6.37 against 8.31 ms, 5.32 against 6.80,
# interleaved medians, `bench_cpu.py` section 3 had listed it losing to ONNX Runtime's MLAS by
# more than 10% in every layer), so it is 4096; the Zen 3 figures below are from before. Generated both ways and timed interleaved (one Zen 3 core; the
# gpt2 figures each beside an A/A pair of the same two kernels): vit-small's 197x1536x384 FFN down-projection with its
# GELU prologue 1.08x faster than through the BLAS (which packs its 2.4 MiB B again per call),
# gpt2's 768x2304 QKV + Split 1.03-1.04x, its 768x3072 up-projection + bias 0.91-1.05x (within
# the A/A spread of a later, busier run); at K = 3072
# (the 3072x768 down-projection with its GELU prologue) 0.90-0.97x, and within noise with GELU's
# x 0.5 folded (`schedule.folded_scale`, the activation read in place)
ROWS_MAX_K = 4096
ROWS_MAX_B_FLOATS = 1 << 22
_OWN = "fs_gemm_rows("  # the call of our micro-kernel in generated blocks



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
                 written: dict | None = None) -> list[str] | None:
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
    (bert-small's 128x128 projections 2-5% faster). With `packs`, within ROWS_MAX_K and
    ROWS_MAX_B_FLOATS and from one full tile, a constant float32 B is packed once (registered
    there), or a B that is a view of an input along N (attention's values) is packed per block,
    and each block multiplied by `fs_gemm_rows` instead of the BLAS (see the module note); there a
    prefill of terms read in place (`init`: a residual's and a bias row's arguments,
    `_terms_in_place`) is added by the micro-kernel at the store instead, with no prefill pass.
    A that is also a kernel output (`written`: outputs the kernel's side loops store before the
    blocks, as a LayerNorm's value that a residual reads later) is read back from there, its
    prologue not computed twice.
    None where B is not float32 or half (half B is widened into the packed panel)."""
    k_extent, n_extent, trans_b = dims
    b = anchor.inputs[1]
    if compute_dtype(graph.tensors[b].dtype) != "float32":
        return None
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
    beta = "1.0f" if prefill else "0.0f"  # prefilled: the BLAS adds the product to the block
    own = (packs is not None and not packed_b and k_extent <= ROWS_MAX_K and k_extent * n_extent <= ROWS_MAX_B_FLOATS
           and m_extent >= FS_MR and n_extent >= FS_NR and anchor.op_type in ("MatMul", "Gemm"))
    pk = None
    if own and strided is None and len(sb) == 2:  # a constant B: packed once per plan
        pk = _packed(packs, graph, e.args, b, (k_extent, n_extent, 1, k_extent) if trans_b else (k_extent, n_extent, n_extent, 1),
                     scale=scale)
    elif own and strided is not None:  # a view of an input along N (attention's values) or along K
        # (its keys, read transposed): packed per block
        z_lines += [scratch("bbuf", f"{-(-n_extent // FS_NR) * FS_NR * k_extent}LL"),
                    f"fs_pack_b({k_extent}LL, {n_extent}LL, {b_ptr}, "
                    + (f"{ldb}LL, 1LL, bbuf);" if b_trans == 111 else f"1LL, {ldb}LL, bbuf);")]
        if scale != 1.0:
            z_lines += [f"for (long long i = 0; i < {-(-n_extent // FS_NR) * FS_NR * k_extent}LL; ++i) bbuf[i] *= {alpha};"]
        pk = "bbuf"
    gemv = (f"FS_BLAS_SGEMV(101, 112, {k_extent}, {n_extent}, {alpha}, {b_ptr}, {ldb}, {a_ptr}, 1, {beta}, {c_ptr}, 1);"
            if b_trans == 111 else  # one row: y = B^T a (B is K x N), or y = B a (B is N x K)
            f"FS_BLAS_SGEMV(101, 111, {n_extent}, {k_extent}, {alpha}, {b_ptr}, {ldb}, {a_ptr}, 1, {beta}, {c_ptr}, 1);")
    sgemm = (f"FS_BLAS_SGEMM(101, 111, {b_trans}, (int)mc, {n_extent}, {k_extent}, {alpha}, {a_ptr}, "
             f"{lda}, {b_ptr}, {ldb}, {beta}, {c_ptr}, {ldc});")
    sgemm = f"FS_GEMV_OR({gemv}) {sgemm}" if m_extent == 1 else sgemm
    if pk is not None:  # our micro-kernel over B packed (once per plan, or per block), A's rows read in place
        c0 = (f"{init[0]}, {init[1]}" if init is not None else f"{c_ptr}, {ldc}LL, 0" if prefill else "0, 0LL, 0")
        sgemm = f"{_OWN}mc, {n_extent}LL, {k_extent}LL, {a_ptr}, {lda}LL, {pk}, {c_ptr}, {ldc}LL, {c0});"
        prefill = None if init is not None else prefill  # the term is added at the store
    epilogue = [] if direct else [
        "    " + scratch("cbuf", f"mc * {n_extent}LL"), "    " + sgemm,
        "    for (long long i = 0; i < mc; ++i) {",
        *["        " + x for x in row], f"        const float* acc = cbuf + i * {n_extent}LL;",
        *(["        #pragma omp simd"] if _flat_loop(body) else []),
        f"        for (long long col = 0; col < {n_extent}LL; ++col) {{", *["            " + x for x in body], "        }",
        "    }"]
    block = [f"for (long long blk = 0; blk < {batches}LL * blocks; ++blk) {{",
             "    long long z = blk / blocks, m0 = (blk % blocks) * mb;",
             f"    long long mc = {m_extent}LL - m0 < mb ? {m_extent}LL - m0 : mb;",
             *["    " + x for x in z_lines],
             *([] if a_in_place else ["    " + scratch("abuf", f"mc * {k_extent}LL")]),
             *([] if a_in_place else ["    for (long long i = 0; i < mc; ++i) {",
                                      *["        " + x for x in row], f"        float* hbuf = abuf + i * {k_extent}LL;",
                                      *["        " + x for x in fill], "    }"]),
             *(["    for (long long i = 0; i < mc; ++i) {", *["        " + x for x in row],
                *(["        #pragma omp simd"] if _flat_loop(prefill) else []),
                f"        for (long long col = 0; col < {n_extent}LL; ++col) {{", *["            " + x for x in prefill],
                "        }", "    }"] if prefill else []),
             *(["    " + sgemm] if direct else epilogue),
             "}"]
    split = (f"long long split = (fs_threads() + {batches}LL - 1) / {batches}LL;",  # row blocks per batch
             f"long long mb = ({m_extent}LL + split - 1) / split;", f"if (mb > {cap}LL) mb = {cap}LL;",
             f"long long blocks = ({m_extent}LL + mb - 1) / mb;",
             f"mb = ({m_extent}LL + blocks - 1) / blocks;")  # even blocks: a short last call costs a whole B packing
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


def _materialized_loops(graph: Graph, kernel: Kernel, args, outs, anchor: Node, packs: dict) -> list[str] | None:
    """C skeleton for a MatMul/Gemm/Conv whose epilogue reads the product at other positions than
    the one computed (a Transpose after a MatMul, a Reshape+Transpose or a Concat after a Conv):
    the product (prologue applied) into a scratch buffer by the anchor's own loops (the BLAS blocks),
    then every output by pointwise loops that read the buffer. None for other anchors, 1-D
    operands, or a product that is not float32."""
    y = anchor.outputs[0]
    info = graph.tensors[y]
    if anchor.op_type not in ("MatMul", "Gemm", "Conv") or compute_dtype(info.dtype) != "float32":
        return None
    buffer = Arg("ybuf", y, tuple(info.shape), "float32")  # the product as computed (float)
    strides = _view_strides(graph, kernel, outs, y) if anchor.op_type == "MatMul" else None
    stored = (_matmul_row_loops(graph, kernel, args, [buffer], anchor, store=(outs[0].name, strides), packs=packs)
              if strides else None)
    if stored and _OWN in "".join(stored):  # our micro-kernel stores the product in place: no BLAS needed
        return stored
    product = (_conv_loops(graph, kernel, args, [buffer], anchor, packs) if anchor.op_type == "Conv"
               else _matmul_row_loops(graph, kernel, args, [buffer], anchor, packs=packs))
    if product is None:
        return None
    c_loops, _ = _pointwise_loops(graph, kernel, {**args, y: buffer}, outs, materialized=frozenset({y}))
    whole = ["    " + scratch("ybuf", f"{max(1, buffer.size)}LL"), *product, *c_loops]
    return ["#ifdef FS_BLAS_SGEMM", *stored, "#else", *whole, "#endif"] if stored else whole


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


def _terms_in_place(args, anchor: Node, terms: list[str], yshape) -> tuple[str, str] | None:
    """For an output that is the product plus `terms` (`_additive_terms`, a Gemm's C first): when
    every term is a float32 kernel input (a Gemm's C with beta 1), at most one of the product's
    shape (a residual) and at most one a row along N (a bias), `fs_gemm_rows`'s C0 and R0
    arguments for the block of rows at (z, m0), each "0, 0LL" / "0" when absent; else None."""
    if anchor.op_type == "Gemm" and float(anchor.attrs.get("beta", 1.0)) != 1.0:  # beta * C: the prefill scales it
        return None
    m_extent, n_extent = (yshape[-2] if len(yshape) > 1 else 1), yshape[-1]
    matrix, row = [], []
    for term in terms:
        if term not in args or args[term].dtype != "float32":  # computed in the kernel, or half
            return None
        shape = (1,) * (len(yshape) - len(args[term].shape)) + tuple(args[term].shape)
        if shape[-1] == n_extent and math.prod(shape[:-1]) == 1:
            row.append(args[term].name)
        elif shape == tuple(yshape):
            matrix.append(f"{args[term].name} + (z * {m_extent * n_extent}LL + m0 * {n_extent}LL), {n_extent}LL")
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
