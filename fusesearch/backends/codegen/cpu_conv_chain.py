"""The NCHWc chain (C only): a 1x1 conv, its activation and the depthwise conv after it in one
kernel (`schedule.nchwc_chain`, product "nchwc-chain").

Problem: an inverted residual block's expansion writes its widest tensor (MobileNetV2's 96 x
112 x 112 floats, 4.8 MB) only for the depthwise conv to read it back; as two kernels the
tensor goes to memory and returns.
Approach: work items of output rows (`schedule.ChainItems`); an item walks its depthwise output
rows in order, computing each expanded input row once, all channels, into a ring of KH rows
(the thread's scratch, a few hundred KiB at most: L2), then the output row from the ring. An
expanded row: register tiles of output blocks x pixels over the input blocks (as
`cpu_conv_nchwc`'s 1x1 tiles, its packed filters `base.NchwcFilter`), the middle ops (an
activation) on the sums in registers, stored into the ring between zero columns (the depthwise
conv's padding: a window reads no border test); a row above or below the input reads a zero
row. The output row: per channel block, tiles of pixels over the KH x KW taps, the epilogue
and the one store of each output (`cpu_conv_nchwc._Epilogue`).
Invariants: the middle tensor is no argument (it never leaves the ring); padded lanes store
zeros; each expanded row an item needs is computed once per item, in increasing order."""

from __future__ import annotations

from fusesearch.backends.codegen.base import OMP_FOR, Arg, NchwcFilter, _indent, scratch
from fusesearch.backends.codegen.cpu_conv_nchwc import _Epilogue, _vector_fma
from fusesearch.backends.codegen.emitter import _Emitter
from fusesearch.backends.codegen.ops import _conv_geometry
from fusesearch.ir.graph import Graph
from fusesearch.lowering import Kernel
from fusesearch.schedule import chain_items, nchwc_chain, nchwc_pixels, nchwc_tile, tensor_layouts


def chain_loops(graph: Graph, kernel: Kernel, args: dict[str, Arg], outs, packs: dict) -> list[str]:
    """The C body of an NCHWc chain (module docstring)."""
    expand, dw = nchwc_chain(graph, kernel.nodes)
    b = kernel.schedule.layout_out.block
    x, w1, w2 = expand.inputs[0], expand.inputs[1], dw.inputs[1]
    (n_img, cin, h, wd), mid = graph.tensors[x].shape, dw.inputs[0]
    ms, ws, ys = graph.tensors[mid].shape, graph.tensors[w2].shape, graph.tensors[dw.outputs[0]].shape
    e = _Emitter(graph, kernel, args)
    e.layouts = {t: lt for t, lt in tensor_layouts(graph, expand, [*args, *(o.tensor for o in outs)],
                                                   kernel.schedule).items() if lt.blocked}
    _, (kh_n, kw_n), (sh, sw), _, (ph, pw) = _conv_geometry(e, dw, ms, ws, ys, False)
    icb, ecb = -(-cin // b), -(-ms[1] // b)
    oh_n, ow_n = ys[2:]
    cols = (ow_n - 1) * sw + kw_n  # the ring's columns: every window's, the padding zero
    valid = min(wd, cols - pw)  # expanded columns a window reads
    o_tile = min(nchwc_tile(b, False, ecb), ecb)
    packs.setdefault(w1, NchwcFilter(Arg(f"pk{len(packs)}", w1, (ecb * b * icb * b,), "float32"), args[w1].name,
                                     ms[1], cin, 1, b, False, b, o_tile))
    packs.setdefault(w2, NchwcFilter(Arg(f"pk{len(packs)}", w2, (ecb * b * kh_n * kw_n,), "float32"), args[w2].name,
                                     ys[1], 1, kh_n * kw_n, b, True, 1))
    row = ecb * cols * b  # floats of one ring row (every channel block's columns)
    items = chain_items(graph, dw)
    lo, hi = items.c_bounds("rb", "blocks")
    expand_row = _ExpandRow(e, graph, kernel, mid, b, (icb, ecb, o_tile), (h, wd, valid, cols, pw),
                            (args[x].name, packs[w1].arg.name))
    out_row = _DepthwiseRow(_Emitter(graph, kernel, args), outs, ys[1], b, ecb, (kh_n, kw_n, sw, ow_n, cols),
                            packs[w2].arg.name, e.layouts)
    body = [f"for (long long r = 0; r < {n_img}LL * blocks; ++r) {{",
            "    long long nb = r / blocks, rb = r % blocks;",
            f"    long long oh0 = {lo}, oh1 = {hi};",
            "    " + scratch("cbuf", f"{(kh_n + 1) * row}LL"),
            f"    float* zero = cbuf + {kh_n * row}LL;  /* the rows above and below the input */",
            f"    for (long long q = 0; q < {row}LL; ++q) zero[q] = 0.0f;",
            f"    for (long long s = 0; s < {kh_n}LL; ++s)",
            f"        for (long long c = 0; c < {ecb}LL; ++c) {{",
            f"            float* rr = cbuf + s * {row}LL + c * {cols * b}LL;",
            f"            for (long long q = 0; q < {pw * b}LL; ++q) rr[q] = 0.0f;",
            f"            for (long long q = {(pw + valid) * b}LL; q < {cols * b}LL; ++q) rr[q] = 0.0f;",
            "        }",
            f"    long long done = oh0 * {sh}LL - {ph}LL - 1;  /* the last expanded row in the ring */",
            "    for (long long oh = oh0; oh < oh1; ++oh) {",
            f"        const float* rows[{kh_n}];",
            f"        for (long long kh = 0; kh < {kh_n}LL; ++kh) {{",
            f"            long long ih = oh * {sh}LL - {ph}LL + kh;",
            f"            if (ih < 0 || ih >= {h}LL) {{ rows[kh] = zero; continue; }}",
            f"            float* ring = cbuf + ih % {kh_n}LL * {row}LL;",
            "            rows[kh] = ring;",
            "            if (ih <= done) continue;",
            "            done = ih;",
            *["            " + line for line in expand_row.lines()],
            "        }",
            *["        " + line for line in out_row.lines()],
            "    }",
            "}"]
    return [f"    typedef float fs_vb __attribute__((vector_size({4 * b}), aligned(4), may_alias));",
            *_vector_fma(b), f"    long long nt = fs_threads(), blocks = {items.c_blocks('nt')};",
            f"    {OMP_FOR}\n" + _indent(body, 1)]


class _ExpandRow:
    """C computing expanded row `ih` of image `nb` into `ring` (every channel block's `cols`
    columns, the row's pixel iw at column pw + iw): tiles of `o_tile` output blocks x
    `nchwc_pixels` pixels, each input block's lanes one broadcast each against the tile's filter
    vectors, then the middle ops on the sums (the emitter's values of the depthwise conv's input
    with the 1x1 conv's sum in `fs_a[l]`), lanes past the channels zero."""

    def __init__(self, e: _Emitter, graph: Graph, kernel: Kernel, mid: str, b: int, blocks, geometry, names) -> None:
        self.b, (self.icb, self.ecb, self.o_tile) = b, blocks
        self.h, self.wd, self.valid, self.cols, self.pw = geometry
        self.x, self.wp = names
        channels = graph.tensors[mid].shape[1]
        e.channel_split = {"co": ("ocb", "l")}
        e.acc_value = "fs_a[l]"
        e.lines = []
        e.push()
        v = e.value(mid, ("nb", "co", "ih", "iw"))
        self.body = ["long long co = ocb * " + f"{b}LL + l;", *e.lines, "rp[l] = " + v + ";"]
        e.pop()
        e.acc_value = ""
        self.full, self.rest = divmod(channels, b)

    def lines(self) -> list[str]:
        pixels = nchwc_pixels(self.b, self.o_tile, False)
        full, rest = divmod(self.ecb, self.o_tile)
        out = [f"const float* xr = {self.x} + nb * {self.icb * self.h * self.wd * self.b}LL + ih * {self.wd * self.b}LL;",
               f"for (long long ot = 0; ot < {full}LL; ++ot) {{",
               *["    " + x_ for x_ in self._blocks(self.o_tile, f"ot * {self.o_tile}LL", pixels)], "}"]
        if rest:
            out += ["{", *["    " + x_ for x_ in self._blocks(rest, f"{full * self.o_tile}LL",
                                                             nchwc_pixels(self.b, rest, False))], "}"]
        return out

    def _blocks(self, o: int, ocb0: str, pixels: int) -> list[str]:
        return [f"long long ocb0 = {ocb0};", f"const float* wt = {self.wp} + ocb0 * {self.icb * self.b * self.b}LL;",
                *spans(self.valid, pixels, lambda p: self._tile(o, p))]

    def _tile(self, o: int, p: int) -> list[str]:
        b = self.b
        acc = [[f"a{i}_{j}" for j in range(p)] for i in range(o)]
        lines = [f"fs_vb {acc[i][j]} = (fs_vb){{0}};" for i in range(o) for j in range(p)]
        lines += [f"for (long long c = 0; c < {self.icb}LL; ++c) {{",
                  f"    const float* xp = xr + c * {self.h * self.wd * b}LL + q * {b}LL;",
                  f"    const float* wq = wt + c * {b * o * b}LL;",
                  "    #pragma GCC unroll 1",
                  f"    for (int ic = 0; ic < {b}; ++ic) {{",
                  *[f"        fs_vb w{i} = *(const fs_vb*)(wq + ic * {o * b} + {i * b}); FS_VB_REG(w{i});" for i in range(o)],
                  *[line for j in range(p) for line in (
                      f"        fs_vb x{j} = FS_VB_SET(xp[{j * b} + ic]);",
                      *[f"        {acc[i][j]} = FS_VB_FMA(w{i}, x{j}, {acc[i][j]});" for i in range(o)])],
                  "    }", "}"]
        flat = [acc[i][j] for i in range(o) for j in range(p)]
        lanes = ["#pragma omp simd", f"for (long long l = 0; l < {b}LL; ++l) {{", *["    " + x_ for x_ in self.body], "}"]
        if self.rest:
            lanes = [f"if (ocb < {self.full}LL) {{", *["    " + x_ for x_ in lanes], "} else {",
                     "    #pragma omp simd", f"    for (long long l = 0; l < {self.rest}LL; ++l) {{",
                     *["        " + x_ for x_ in self.body], "    }",
                     f"    for (long long l = {self.rest}LL; l < {b}LL; ++l) rp[l] = 0.0f;", "}"]
        lines += [f"float fs_t[{len(flat) * b}] __attribute__((aligned(64)));",
                  *[f"*(fs_vb*)(fs_t + {k * b}) = {a};" for k, a in enumerate(flat)],
                  f"for (long long tj = 0; tj < {p}LL; ++tj) {{", "    long long iw = q + tj;",
                  f"    for (long long ti = 0; ti < {o}LL; ++ti) {{",
                  "        long long ocb = ocb0 + ti;",
                  f"        const float* fs_a = fs_t + (ti * {p}LL + tj) * {b}LL;",
                  f"        float* rp = ring + (ocb * {self.cols}LL + {self.pw}LL + iw) * {b}LL;",
                  *["        " + x_ for x_ in lanes], "    }", "}"]
        return ["{", *["    " + x_ for x_ in lines], "}"]


class _DepthwiseRow:
    """C computing output row `oh` of image `nb` from the ring rows `rows[kh]`: per channel
    block, tiles of the depthwise conv's pixels (`nchwc_pixels`) over its taps, a filter vector
    per tap against each pixel's input vector, then the epilogue and the store
    (`cpu_conv_nchwc._Epilogue`)."""

    def __init__(self, e: _Emitter, outs, channels: int, b: int, ecb: int, geometry, wp: str, layouts) -> None:
        e.layouts = layouts
        self.epilogue = _Epilogue(e, outs, channels, b)
        self.b, self.ecb, self.wp = b, ecb, wp
        self.kh_n, self.kw_n, self.sw, self.ow_n, self.cols = geometry

    def lines(self) -> list[str]:
        return [f"for (long long cb = 0; cb < {self.ecb}LL; ++cb) {{",
                f"    const float* wq = {self.wp} + cb * {self.kh_n * self.kw_n * self.b}LL;",
                *["    " + x_ for x_ in spans(self.ow_n, nchwc_pixels(self.b, 1, True), self._tile)], "}"]

    def _tile(self, p: int) -> list[str]:
        b = self.b
        lines = [f"fs_vb d{j} = (fs_vb){{0}};" for j in range(p)]
        for kh in range(self.kh_n):
            lines += [f"{{ const float* rr = rows[{kh}] + (cb * {self.cols}LL + q * {self.sw}LL) * {b}LL;",
                      *[line for kw in range(self.kw_n) for line in (
                          f"  {{ fs_vb wv = *(const fs_vb*)(wq + {(kh * self.kw_n + kw) * b}); FS_VB_REG(wv);",
                          *[f"    d{j} = FS_VB_FMA(wv, *(const fs_vb*)(rr + {(j * self.sw + kw) * b}), d{j});"
                            for j in range(p)], "  }")], "}"]
        where = "long long ow = q + tj;"
        lines += self.epilogue.tile([f"d{j}" for j in range(p)], 1, p, "cb", where)
        return ["{", *["    " + x_ for x_ in lines], "}"]


def spans(count: int, pixels: int, tile) -> list[str]:
    """C walking `count` pixels (q from 0) in tiles of `pixels` and, where the rest is under half
    a tile, the last whole tile and the rest as two tiles of sizes one apart (7 at 6: 4 and 3,
    not 6 and a tile of one pixel, whose few sums wait on the FMA latency): `tile(p)` the C of a
    tile of p pixels from q. (Every tile of sizes one apart, 56 at 6 as 6 x 6 and 4 x 5, measured
    1.0-1.2x the time of 9 x 6 and 2 on MobileNetV2's 56 x 56 chain: not taken.)"""
    full, rest = divmod(count, pixels)
    if rest and 2 * rest < pixels and full:
        full, rest = full - 1, rest + pixels
    lines = [f"for (long long q = 0; q < {full * pixels}LL; q += {pixels}LL)", *tile(pixels)] if full else []
    at = full * pixels
    for size in ((rest + 1) // 2, rest // 2) if rest > pixels else (rest,):
        if size:
            lines += ["{", f"    long long q = {at}LL;", *tile(size), "}"]
            at += size
    return lines
