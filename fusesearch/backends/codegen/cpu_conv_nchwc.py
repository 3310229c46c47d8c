"""The NCHWc CPU conv (C only): a conv group whose activations lie in channel blocks (`fusesearch.layout`).

Problem: in NCHW a conv's lanes run along short pixel rows and a depthwise conv has no long
contiguous axis; NCHWc keeps a block of output channels in each vector register instead.
Approach (a direct conv as MLAS's and oneDNN's NCHWc kernels): filters packed once in the order the
tile reads them (`base.NchwcFilter`); work items of images x blocks of output rows (at least
NCHWC_RUN_PIXELS pixels) x tiles of `schedule.nchwc_tile` output blocks in parallel; per item the
input blocks in passes of `schedule.nchwc_chunk` (the filter slice stays in L1; partial sums in
cbuf), register tiles of output blocks x `nchwc_pixels` pixels (4 x 6 zmm at block 16, 2 x 6 ymm at
8), one FMA per filter vector and broadcast input (`FS_VB_FMA`: C11 contracts none). Dense convs
read a zero-bordered copy; depthwise and image-input convs run row by row, edges over valid taps.
The epilogue (bias, activations, residual) runs over the item's lanes before the one store.
Invariants: `Schedule.product` "nchwc", `layout_out` blocked, `layout_in` as `schedule.nchwc_input`
says; padded lanes store zeros. Anchorless groups (`nchwc_pointwise_loops`) and reorders
(`reorder_kernel`: block x block squares transposed in registers) live here too."""

from __future__ import annotations

import math

from fusesearch.backends.codegen.base import (
    OMP_FOR,
    Arg,
    CodegenRefused,
    GeneratedKernel,
    NchwcFilter,
    _indent,
    c_function,
    scratch,
    shared_scratch,
    source_digest,
    store,
)
from fusesearch.backends.codegen.cpu_gemm import _split_outputs
from fusesearch.backends.codegen.emitter import _Emitter
from fusesearch.backends.codegen.ops import _conv_geometry
from fusesearch.ir.graph import Graph, Node
from fusesearch.layout import Layout, copy_name
from fusesearch.lowering import Kernel
from fusesearch.schedule import nchwc_chunk, nchwc_pixels, nchwc_tile, tensor_layouts

# pixels a block of output rows holds at least (whole output rows): several tiles per block, so
# each slice of filters a tile streams serves them all
NCHWC_RUN_PIXELS = 48


def nchwc_loops(graph: Graph, kernel: Kernel, args: dict[str, Arg], outs, anchor: Node, packs: dict) -> list[str]:
    """The C body of an NCHWc conv group (`schedule.nchwc_conv`, product "nchwc"): its input in
    `layout_in` (NCHWc, or NCHW for a dense conv over fewer channels than a block: an image),
    its outputs in `layout_out`. Work items (images x blocks of output rows x tiles of output
    blocks) in parallel; per item the input blocks in passes of `schedule.nchwc_chunk` (a slice of
    filters that stays in cache across the item's pixels), partial sums in cbuf, then the
    epilogue over the item's blocks."""
    x, w = anchor.inputs[0], anchor.inputs[1]
    xs, ws, ys = (graph.tensors[t].shape for t in (x, w, anchor.outputs[0]))
    layout, source = kernel.schedule.layout_out, kernel.schedule.layout_in
    b = layout.block
    depthwise = int(anchor.attrs.get("group", 1)) > 1
    e = _Emitter(graph, kernel, args)
    e.layouts = {t: lt for t, lt in tensor_layouts(graph, anchor, [*args, *(o.tensor for o in outs)], kernel.schedule).items()
                 if lt.blocked}
    _, (kh_n, kw_n), (sh, sw), _, (ph, pw) = _conv_geometry(e, anchor, xs, ws, ys, False)
    ocb = layout.channels(ys[1]) // b
    (h, wd), (oh_n, ow_n) = xs[2:], ys[2:]
    lanes_in = b if source.blocked else xs[1]  # input lanes per input block (NCHW: every channel, one block)
    icb = source.channels(xs[1]) // lanes_in
    # output blocks per work item: a dense tile's (its registers); a depthwise item holds them all,
    # one register tile per block in turn (a row's setup and epilogue shared by its blocks)
    o_tile = ocb if depthwise else min(nchwc_tile(b, depthwise), ocb)
    if w not in packs:
        floats = ocb * b * kh_n * kw_n * (1 if depthwise else icb * lanes_in)
        packs[w] = NchwcFilter(Arg(f"pk{len(packs)}", w, (floats,), "float32"), args[w].name, ys[1], ws[1],
                               kh_n * kw_n, b, depthwise, lanes_in, o_tile)
    run = (kh_n, kw_n, sh, sw) == (1, 1, 1, 1) and not (ph or pw)  # pixels contiguous across rows
    rows = min(oh_n, math.ceil(NCHWC_RUN_PIXELS / ow_n)) if run or not depthwise else 1
    pixels = rows * ow_n
    planes = source.size(tuple(xs)) // (xs[0] * h * wd * (b if source.blocked else 1))  # per image
    source_name, padded = args[x].name, []
    hp, wp = max(ph + h, (oh_n - 1) * sh + kh_n), max(pw + wd, (ow_n - 1) * sw + kw_n)
    # a dense conv over blocked channels reads a zero-bordered copy (every pixel in whole tiles); a
    # depthwise one, and one over an image's few channels, take their border pixels one by one
    # (mobilenetv2's stem: 0.30 ms so, 0.38 from the copy)
    if not depthwise and source.blocked and (hp, wp) != (h, wd):
        padded = _padded_copy(args[x].name, xs[0] * planes, (h, wd), (hp, wp), (ph, pw), b)
        source_name, (h, wd), (ph, pw) = "patch", (hp, wp), (0, 0)
    geo = _Geometry(b, icb, lanes_in, source.blocked, (h, wd, kh_n, kw_n, sw), depthwise, source_name,
                    packs[w].arg.name, pixels, xs[1])
    image = f"nb * {planes * h * wd * geo.xb}LL"
    if run or (source.blocked and not depthwise):  # every window inside the input (padded above)
        def sums(o: int, ocb0: str) -> list[str]:
            return geo.span(o, ocb0, (sh, sw), ow_n, image)
    else:
        lo = min(ow_n, -(-pw // sw))  # the interior: columns whose window lies inside the image
        hi = max(lo, min(ow_n, (wd - kw_n + pw) // sw + 1))

        def sums(o: int, ocb0: str) -> list[str]:
            return ["for (long long oh = oh0; oh < oh1; ++oh) {",
                    f"    long long ih0 = oh * {sh}LL - {ph}LL;",
                    f"    long long kh0 = ih0 < 0 ? -ih0 : 0, kh1 = {h}LL - ih0 < {kh_n}LL ? {h}LL - ih0 : {kh_n}LL;",
                    *["    " + x_ for x_ in geo.row(o, ocb0, (lo, hi, ow_n), pw, f"{image} + ih0 * {wd * geo.xb}LL")],
                    "}"]
    main, _ = _split_outputs(graph, kernel, outs, anchor)
    full, rest = divmod(ocb, o_tile)
    tiles = full + (rest > 0)

    def item(o: int, ocb0: str) -> list[str]:  # one work item's sums (in passes over the input blocks) and epilogue
        if depthwise:
            return ["long long ocb0 = 0;", f"for (long long d = 0; d < {o}LL; ++d) {{",
                    *["    " + x_ for x_ in sums(1, "d")], "}", *_epilogue(e, main, ys, o, b, ow_n, pixels)]
        chunk = min(icb, nchwc_chunk(b, o, lanes_in, kh_n * kw_n))
        passes = ([f"long long c0 = 0, c1 = {icb}LL;", *sums(o, ocb0)] if chunk >= icb else
                  [f"for (long long c0 = 0; c0 < {icb}LL; c0 += {chunk}LL) {{",
                   f"    long long c1 = c0 + {chunk}LL < {icb}LL ? c0 + {chunk}LL : {icb}LL;",
                   *["    " + x_ for x_ in sums(o, ocb0)], "}"])
        return [f"long long ocb0 = {ocb0};", *passes, *_epilogue(e, main, ys, o, b, ow_n, pixels)]
    blocks = -(-oh_n // rows)
    per = blocks * tiles
    body = [f"for (long long r = 0; r < {ys[0] * per}LL; ++r) {{",
            f"    long long nb = r / {per}LL, oh0 = r / {tiles}LL % {blocks}LL * {rows}LL, ot = r % {tiles}LL;",
            f"    long long oh1 = oh0 + {rows}LL < {oh_n}LL ? oh0 + {rows}LL : {oh_n}LL;",
            "    " + scratch("cbuf", f"{o_tile * pixels * b}LL"),
            *([f"    if (ot < {full}LL) {{"] if rest else ["    {"]),
            *["        " + x_ for x_ in item(o_tile, f"ot * {o_tile}LL")], "    }",
            *(["    else {", *["        " + x_ for x_ in item(rest, f"{full * o_tile}LL")], "    }"] if rest else []),
            "}"]
    return [f"    typedef float fs_vb __attribute__((vector_size({4 * b}), aligned(4), may_alias));",
            *_vector_fma(b), *padded, f"    {OMP_FOR}\n" + _indent(body, 1)]


def _vector_fma(b: int) -> list[str]:
    """The C macros of a block's vectors: FS_VB_FMA(w, x, a) = w x + a in one rounding where the
    core has the FMA at that width (C11 contracts no `a += w * x`: a multiply and an add, twice
    the instructions), else the two operations; FS_VB_SET(x) the float x in every lane."""
    fma = {16: ("defined(__AVX512F__)", "__builtin_ia32_vfmaddps512_mask((w), (x), (a), (unsigned short)-1, 4)"),
           8: ("defined(__FMA__)", "__builtin_ia32_vfmaddps256((w), (x), (a))")}.get(b)
    lines = ["#undef FS_VB_FMA", "#undef FS_VB_SET",
             f"#define FS_VB_SET(x) ((fs_vb){{{', '.join(['(x)'] * b)}}})"]
    if fma:
        lines += [f"#if {fma[0]} && !defined(__clang__)", f"#define FS_VB_FMA(w, x, a) {fma[1]}", "#else"]
    lines.append("#define FS_VB_FMA(w, x, a) ((w) * (x) + (a))")
    return lines + (["#endif"] if fma else [])


def _padded_copy(source: str, planes: int, size: tuple[int, int], padded: tuple[int, int], lead: tuple[int, int],
                 xb: int) -> list[str]:
    """C lines copying `planes` planes of `source` (rows of `size[1]` pixels of `xb` floats) into
    the shared scratch `patch` with a zero border (`lead` rows and columns before, the rest of
    `padded` after), rows in parallel, before the conv's loop (the worksharing loop's barrier)."""
    (h, w), (hp, wp), (ph, pw) = size, padded, lead
    row = wp * xb
    return ["    " + shared_scratch("patch", f"{planes * hp * row}LL"),
            f"    {OMP_FOR}",
            f"    for (long long r = 0; r < {planes * hp}LL; ++r) {{",
            f"        float* dst = patch + r * {row}LL;",
            f"        long long ih = r % {hp}LL - {ph}LL;",
            f"        if (ih < 0 || ih >= {h}LL) {{ memset(dst, 0, sizeof(float) * {row}LL); continue; }}",
            f"        memset(dst, 0, sizeof(float) * {pw * xb}LL);",
            f"        memcpy(dst + {pw * xb}LL, {source} + (r / {hp}LL * {h}LL + ih) * {w * xb}LL, sizeof(float) * {w * xb}LL);",
            f"        memset(dst + {(pw + w) * xb}LL, 0, sizeof(float) * {(wp - pw - w) * xb}LL);", "    }"]


class _Geometry:
    """The constants an NCHWc conv's tiles are written with: per input block `lanes_in` input
    lanes, `xb` floats per pixel and `xc` between two lanes of one pixel (NCHWc: b and 1; NCHW:
    1 and H x W); `pixels` the pixels of a work item's partial sums (cbuf) per output block;
    `channels` the input's (a dense tile skips the last block's zero lanes)."""

    def __init__(self, b, icb, lanes_in, blocked_in, window, depthwise, x, wp, pixels, channels) -> None:
        self.b, self.icb, self.lanes_in = b, icb, lanes_in
        self.h, self.wd, self.kh_n, self.kw_n, self.sw = window
        self.xb, self.xc = (b, 1) if blocked_in else (1, self.h * self.wd)
        self.depthwise, self.x, self.wp, self.pixels = depthwise, x, wp, pixels
        self.last_lanes = channels - (icb - 1) * lanes_in  # the last input block's channels (its other lanes zero)

    def tile(self, o: int, p: int, ocb0: str, at: str, xoff, kw: tuple[str, str]) -> list[str]:
        """The register tile: sums of `o` output blocks from `ocb0` x `p` pixels (pixel j's input
        offset at tap (0, 0) of input block 0: `xoff(j)`; their partial sums from pixel `at` of
        cbuf) over the taps kh0..kh1 x kw[0]..kw[1] and, dense, the input blocks c0..c1 of the
        pass (the sums of the passes before read back from cbuf), stored into cbuf. Dense: per
        input lane the tile's `o` filter vectors (contiguous) and `p` broadcast input values, o x
        p FMAs; depthwise: per tap one filter vector and `p` input vectors."""
        b, xb, hw = self.b, self.xb, self.h * self.wd
        acc = [[f"a{i}_{j}" for j in range(p)] for i in range(o)]
        first = f"{ocb0} * {self.pixels}LL" if self.depthwise else "0LL"  # a depthwise item holds every block
        slot = {(i, j): f"cbuf + ({first} + {i * self.pixels}LL + {at} + {j}LL) * {b}LL" for i in range(o) for j in range(p)}
        lines = [f"long long x{j} = {xoff(j)};" for j in range(p)]
        lines += [f"fs_vb {acc[i][j]} = " + ("(fs_vb){0};" if self.depthwise else
                                             f"c0 ? *(const fs_vb*)({slot[i, j]}) : (fs_vb){{0}};") for i, j in slot]
        taps = self.kh_n * self.kw_n
        tap = f"kh * {self.wd * xb}LL + kw * {xb}LL"
        if self.depthwise:
            lines += ["for (long long kh = kh0; kh < kh1; ++kh)",
                      f"for (long long kw = {kw[0]}; kw < {kw[1]}; ++kw) {{",
                      f"    const float* xp = {self.x} + {ocb0} * {hw * b}LL + {tap};",
                      f"    fs_vb wv = *(const fs_vb*)({self.wp} + ({ocb0} * {taps}LL + kh * {self.kw_n}LL + kw) * {b}LL);",
                      *[f"    {acc[0][j]} = FS_VB_FMA(wv, *(const fs_vb*)(xp + x{j}), {acc[0][j]});" for j in range(p)],
                      "}"]
        else:
            panel = self.lanes_in * o * b  # the tile's filters per input block and tap
            lines += ["for (long long icb = c0; icb < c1; ++icb)",
                      "for (long long kh = kh0; kh < kh1; ++kh)",
                      f"for (long long kw = {kw[0]}; kw < {kw[1]}; ++kw) {{",
                      f"    const float* xp = {self.x} + icb * {hw * self.lanes_in}LL + {tap};",
                      f"    const float* wp = {self.wp} + {ocb0} * {self.icb * taps * self.lanes_in * b}LL"
                      f" + (icb * {taps}LL + kh * {self.kw_n}LL + kw) * {panel}LL;",
                      # GCC's full unroll interleaves the lanes and spills the accumulators
                      "    #pragma GCC unroll 1", f"    for (int ic = 0; ic < {self._lanes('icb')}; ++ic) {{",
                      *[f"        fs_vb w{i} = *(const fs_vb*)(wp + ic * {o * b} + {i * b});" for i in range(o)],
                      *[line for j in range(p) for line in
                        (f"        fs_vb v{j} = FS_VB_SET(xp[x{j} + ic * {self.xc}LL]);",
                         *[f"        {acc[i][j]} = FS_VB_FMA(w{i}, v{j}, {acc[i][j]});" for i in range(o)])],
                      "    }", "}"]
        lines += [f"*(fs_vb*)({slot[i, j]}) = {acc[i][j]};" for i, j in slot]
        return ["{", *["    " + x_ for x_ in lines], "}"]

    def _lanes(self, icb: str) -> str:
        """The input lanes a dense tile reads of input block `icb`: all but the zero lanes past the
        channels in the last block (24 channels in blocks of 16: 8 of its 16)."""
        if self.last_lanes == self.lanes_in:
            return str(self.lanes_in)
        return f"({icb} < {self.icb - 1}LL ? {self.lanes_in} : {self.last_lanes})"

    def tiles(self, o: int, ocb0: str, span: tuple[str, str], count: int, at: str, xoff, kw: tuple[str, str]) -> list[str]:
        """Pixels q = span[0]..span[1] (every tap in `kw` valid for each; pixel q + j's input
        offset `xoff(j)`, its place in cbuf `at` + j) in tiles of `schedule.nchwc_pixels`; where
        the span has its usual `count` pixels, the rest one tile of the remainder, else one by
        one."""
        p = nchwc_pixels(self.b, o, self.depthwise)
        rest = count % p
        one = [f"    for (; q < {span[1]}; ++q)", *["    " + x_ for x_ in self.tile(o, 1, ocb0, at, xoff, kw)]]
        tail = ([f"    if ({span[1]} - q == {rest}LL)", *["    " + x_ for x_ in self.tile(o, rest, ocb0, at, xoff, kw)],
                 "    else", *one] if rest > 1 else one)
        return ["{", f"    long long q = {span[0]};",
                f"    for (; q + {p}LL <= {span[1]}; q += {p}LL)",
                *["    " + x_ for x_ in self.tile(o, p, ocb0, at, xoff, kw)], *tail, "}"]

    def row(self, o: int, ocb0: str, columns: tuple[int, int, int], pw: int, row_off: str) -> list[str]:
        """Output row `oh` of the item: the border columns one by one over their valid taps, the
        interior (columns lo..hi) in tiles."""
        lo, hi, ow_n = columns
        at = f"(oh - oh0) * {ow_n}LL + q"

        def xoff(j: int) -> str:
            return f"{row_off} + (q * {self.sw}LL - {pw}LL) * {self.xb}LL + {j * self.sw * self.xb}LL"

        def border(a: int, z: int) -> list[str]:
            if z <= a:
                return []
            return [f"for (long long q = {a}LL; q < {z}LL; ++q) {{",
                    f"    long long iw0 = q * {self.sw}LL - {pw}LL;",
                    f"    long long kw0 = iw0 < 0 ? -iw0 : 0, kw1 = {self.wd}LL - iw0 < {self.kw_n}LL ? {self.wd}LL - iw0 "
                    f": {self.kw_n}LL;",
                    *["    " + x_ for x_ in self.tile(o, 1, ocb0, at, xoff, ("kw0", "kw1"))], "}"]
        interior = (self.tiles(o, ocb0, (f"{lo}LL", f"{hi}LL"), hi - lo, at, xoff, ("0", str(self.kw_n)))
                    if hi > lo else [])
        return [*border(0, lo), *interior, *border(hi, ow_n)]

    def span(self, o: int, ocb0: str, strides: tuple[int, int], ow_n: int, image: str) -> list[str]:
        """The item's output pixels as one span (every window inside the input: a zero-bordered
        copy, or no padding), tiles across its rows: pixel q + j at output row oh0 + (q + j) / ow,
        column (q + j) % ow."""
        sh, sw = strides
        one_run = (sh, sw, self.wd) == (1, 1, ow_n)  # consecutive pixels consecutive in the input

        def xoff(j: int) -> str:
            if one_run:
                return f"{image} + (oh0 * {ow_n}LL + q + {j}LL) * {self.xb}LL"
            return (f"{image} + ((oh0 + (q + {j}LL) / {ow_n}LL) * {sh * self.wd}LL + (q + {j}LL) % {ow_n}LL * {sw}LL)"
                    f" * {self.xb}LL")
        return ["long long kh0 = 0, kh1 = " + f"{self.kh_n};",
                *self.tiles(o, ocb0, ("0", f"(oh1 - oh0) * {ow_n}LL"), self.pixels, "q", xoff, ("0", str(self.kw_n)))]


def _epilogue(e: _Emitter, main, ys, o: int, b: int, ow_n: int, pixels: int) -> list[str]:
    """Per output block of the item (`o` from ocb0) and pixel of its rows: the epilogue over the
    block's lanes from cbuf, stored where each output lies; the lanes past the channels store
    zeros."""
    e.channel_split = {"co": ("ocb", "l")}
    e.acc_value = f"cbuf[((ocb - ocb0) * {pixels}LL + (oh - oh0) * {ow_n}LL + ow) * {b}LL + l]"
    idx = ("nb", "co", "oh", "ow")
    e.lines = []
    e.push()
    writes = [store(o_, e.at(o_.tensor, idx), e.value(o_.tensor, idx)) for o_ in main]
    body = e.lines + writes
    e.pop()
    e.acc_value = ""
    full, rest = divmod(ys[1], b)
    zeros = [f"{o_.name}[{e.at(o_.tensor, idx)}] = 0.0f;" for o_ in main]

    def nest(head: str, lanes: int) -> list[str]:  # whole blocks: a constant count of lanes, one vector
        return [head, "for (long long oh = oh0; oh < oh1; ++oh)", f"for (long long ow = 0; ow < {ow_n}LL; ++ow) {{",
                "    #pragma omp simd", f"    for (long long l = 0; l < {lanes}LL; ++l) {{",
                f"        long long co = ocb * {b}LL + l;", *["        " + x_ for x_ in body], "    }",
                *([f"    for (long long l = {lanes}LL; l < {b}LL; ++l) {{", *["        " + z for z in zeros], "    }"]
                  if lanes < b else []), "}"]
    return [*(nest(f"for (long long ocb = ocb0; ocb < ocb0 + {o}LL && ocb < {full}LL; ++ocb)", b) if full else []),
            *([f"if (ocb0 + {o}LL > {full}LL) {{", *["    " + x_ for x_ in nest(f"long long ocb = {full}LL;", rest)], "}"]
              if rest else [])]


REORDER_PIXELS = 1024  # pixels of a plane a reorder's work item copies (a multiple of every block)


def reorder_kernel(tensor: str, shape: tuple[int, ...], source: Layout, target: Layout, name: str | None = None,
                   threads: int = 0) -> GeneratedKernel:
    """The C kernel copying float32 `tensor` of logical `shape` (N, C, H, W) from layout `source`
    to `target` (NCHW <-> NCHWc), named `name` (default by direction and block): its output named
    `layout.copy_name(tensor, target)`; into a blocked layout the
    padded channels are written zero. A block's plane is a (block x H W) matrix on the NCHW side
    and its transpose on the other, both contiguous: per image, channel block and run of
    REORDER_PIXELS pixels in parallel, squares of block x block transposed in vector registers
    (`_transpose`: whole vectors loaded and stored, contiguous), the pixels past the last square
    one by one. `threads`: the region's team (`Schedule.cpu_threads`: 0 all, 1 the one-thread
    form)."""
    if source.blocked == target.blocked or len(shape) != 4:
        raise CodegenRefused(f"reorder of '{tensor}': {source.name} -> {target.name} of shape {shape} "
                             "(one NCHW <-> NCHWc copy of a 4-D tensor)")
    n, c, h, w = shape
    blocked = target if target.blocked else source
    b, cb = blocked.block, blocked.channels(c) // blocked.block
    hw, runs = h * w, -(-h * w // REORDER_PIXELS)
    ins = (Arg("in0", tensor, source.shape(shape), "float32", source),)
    outs = (Arg("out0", copy_name(tensor, target), target.shape(shape), "float32", target),)
    plain, block = ("in0", "out0") if target.blocked else ("out0", "in0")
    lanes = f"cb < {c // b}LL ? {b}LL : {c % b}LL" if c % b else f"{b}LL"
    body = [f"for (long long r = 0; r < {n * cb * runs}LL; ++r) {{",
            f"    long long nb = r / {cb * runs}LL, cb = r / {runs}LL % {cb}LL, p = r % {runs}LL * {REORDER_PIXELS}LL;",
            f"    long long p1 = p + {REORDER_PIXELS}LL < {hw}LL ? p + {REORDER_PIXELS}LL : {hw}LL, lanes = {lanes};",
            f"    {'const ' if target.blocked else ''}float* pl = {plain} + (nb * {c}LL + cb * {b}LL) * {hw}LL;",
            f"    {'' if target.blocked else 'const '}float* bl = {block} + (nb * {cb}LL + cb) * {hw * b}LL;",
            *["    " + x for x in _transpose(b, hw, target.blocked)],
            "    for (; p < p1; ++p)", f"        for (long long l = 0; l < {b}LL; ++l)",
            ("            bl[p * {b}LL + l] = l < lanes ? pl[l * {hw}LL + p] : 0.0f;" if target.blocked else
             "            if (l < lanes) pl[l * {hw}LL + p] = bl[p * {b}LL + l];").format(b=b, hw=hw), "}"]
    name = name or f"k_reorder_{'blocked' if target.blocked else 'nchw'}_{b}"
    src = c_function(name, ins, outs, (), f"    typedef float fs_vb __attribute__((vector_size({4 * b}), aligned(4), "
                     f"may_alias));\n    {OMP_FOR}\n" + _indent(body, 1) + "\n", threads=threads)
    return GeneratedKernel(name, "pointwise", ins, outs, src, "", source_hash=source_digest(src, ""),
                           skeleton="packed")


def _transpose(b: int, hw: int, into_blocked: bool) -> list[str]:
    """C transposing the pixels p.. of a plane in squares of b x b while a whole square fits
    before p1: b vectors loaded (NCHW: a channel's b pixels, the lanes past `lanes` zero; NCHWc: a
    pixel's b channels), log2 b stages of two-vector shuffles (stage s swaps the s x s
    off-diagonal squares of each 2s x 2s one), b vectors stored (the NCHW side's lanes past
    `lanes` not written). Where the compiler has no `__builtin_shufflevector` (GCC before 12),
    none: the caller's pixel loop copies them all."""
    if into_blocked:
        loads = [f"fs_vb t{r} = {r}LL < lanes ? *(const fs_vb*)(pl + {r * hw}LL + p) : (fs_vb){{0}};" for r in range(b)]
    else:
        loads = [f"fs_vb t{r} = *(const fs_vb*)(bl + (p + {r}LL) * {b}LL);" for r in range(b)]
    stages, names, k = [], [f"t{r}" for r in range(b)], 0
    s = b // 2
    while s:
        new = list(names)
        for r in (r for r in range(b) if not r & s):
            lo = ", ".join(str(b + j - s if j & s else j) for j in range(b))
            hi = ", ".join(str(b + j if j & s else j + s) for j in range(b))
            new[r], new[r + s] = f"u{k}_{r}", f"u{k}_{r + s}"
            stages += [f"fs_vb u{k}_{r} = __builtin_shufflevector({names[r]}, {names[r + s]}, {lo});",
                       f"fs_vb u{k}_{r + s} = __builtin_shufflevector({names[r]}, {names[r + s]}, {hi});"]
        names, k, s = new, k + 1, s // 2
    if into_blocked:
        stores = [f"*(fs_vb*)(bl + (p + {r}LL) * {b}LL) = {names[r]};" for r in range(b)]
    else:
        stores = [f"if ({r}LL < lanes) *(fs_vb*)(pl + {r * hw}LL + p) = {names[r]};" for r in range(b)]
    return ["#if defined(__clang__) || __GNUC__ >= 12",
            f"for (; p + {b}LL <= p1; p += {b}LL) {{",
            *["    " + x for x in loads + stages + stores], "}", "#endif"]


def nchwc_pointwise_loops(graph: Graph, kernel: Kernel, args: dict[str, Arg], outs) -> list[str]:
    """The C body of an anchorless group in NCHWc (`schedule.nchwc_pointwise`: a pool, an
    activation, a residual Add): per output, its images, channel blocks and rows in parallel,
    each row's pixels in turn, the block's lanes one vector loop (a pool's taps and every
    operand at the same lane of their own blocks, contiguous); lanes past the channels zeros."""
    b = kernel.schedule.layout_out.block
    loops = []
    for o in outs:
        n, c, h, w = graph.tensors[o.tensor].shape
        e = _Emitter(graph, kernel, args)
        e.layouts = {t: lt for t, lt in tensor_layouts(graph, None, [*args, *(x.tensor for x in outs)],
                                                        kernel.schedule).items() if lt.blocked}
        e.channel_split = {"c": ("cb", "l")}
        e.window_clamp = True  # a pool's taps clamped, not branched: a guarded read stops the lane loop vectorizing
        idx = ("nb", "c", "oh", "ow")
        v = e.value(o.tensor, idx)
        body = [*e.lines, store(o, e.at(o.tensor, idx), v)]
        cb = -(-c // b)
        full, rest = divmod(c, b)
        lanes = f"(cb < {full}LL ? {b}LL : {rest}LL)" if rest else f"{b}LL"
        nest = [f"for (long long r = 0; r < {n * cb * h}LL; ++r) {{",
                f"    long long nb = r / {cb * h}LL, cb = r / {h}LL % {cb}LL, oh = r % {h}LL;",
                f"    long long lanes = {lanes};",
                f"    for (long long ow = 0; ow < {w}LL; ++ow) {{",
                "        #pragma omp simd", "        for (long long l = 0; l < lanes; ++l) {",
                f"            long long c = cb * {b}LL + l;", *["            " + x for x in body], "        }",
                *([f"        for (long long l = lanes; l < {b}LL; ++l) {o.name}[{e.at(o.tensor, idx)}] = 0.0f;"] if rest else []),
                "    }", "}"]
        loops.append(f"    {OMP_FOR}\n" + _indent(nest, 1))
    return loops
