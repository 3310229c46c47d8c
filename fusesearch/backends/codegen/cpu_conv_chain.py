"""The NCHWc chain (C only): a 1x1 conv, its activation and the depthwise conv after it in one
kernel (`schedule.anchor_chain`, product CHAIN).

Problem: an inverted residual block's expansion writes its widest tensor (MobileNetV2's 96 x 112
x 112 floats, 4.8 MB) only for the depthwise conv to read it back; as two kernels it goes to
memory and returns.
Approach: items of the expanded channel blocks (`schedule.ChainItems`: a channel of the chain
depends on its own expanded channel alone), each walking every output row in order: its blocks of
each expanded row computed once into a ring of KH rows between zero columns (the padding) by 1x1
register tiles (`_Pointwise`, the ops up to the depthwise conv on their sums: `_middle`,
`_lanes_store`); its blocks of the output row from the ring (`_DepthwiseRow`), their tiles running
the epilogue and the one store of each output (`cpu_conv_nchwc._Epilogue`).
Invariants: the tensors between the anchors are no arguments (they stay in the ring); padded
lanes store zeros; an item computes each expanded row once, in order."""

from __future__ import annotations

from fusesearch.backends.codegen.base import OMP_FOR, Arg, NchwcFilter, _indent, scratch
from fusesearch.backends.codegen.cpu_conv_nchwc import _Epilogue, _vector_fma
from fusesearch.backends.codegen.emitter import _Emitter
from fusesearch.backends.codegen.ops import _conv_geometry
from fusesearch.ir.graph import Graph
from fusesearch.lowering import Kernel
from fusesearch.schedule import anchor_chain, chain_items, nchwc_pixels, tensor_layouts


def chain_loops(graph: Graph, kernel: Kernel, args: dict[str, Arg], outs, packs: dict) -> list[str]:
    """The C body of an NCHWc chain (module docstring)."""
    chain = anchor_chain(graph, kernel.nodes)
    expand, dw = chain.expand, chain.dw
    b = kernel.schedule.layout_out.block
    x, mid = expand.inputs[0], dw.inputs[0]
    (n_img, cin, h, wd), ms = graph.tensors[x].shape, graph.tensors[mid].shape
    ws, ys = graph.tensors[dw.inputs[1]].shape, graph.tensors[dw.outputs[0]].shape
    layouts = {t: lt for t, lt in tensor_layouts(graph, expand, [*args, *(o.tensor for o in outs)],
                                                 kernel.schedule).items() if lt.blocked}
    e = _Emitter(graph, kernel, args)
    _, (kh_n, kw_n), (sh, sw), _, (ph, pw) = _conv_geometry(e, dw, ms, ws, ys, False)
    icb, ecb = -(-cin // b), -(-ms[1] // b)
    ow_n = ys[3]
    cols = (ow_n - 1) * sw + kw_n  # the ring's columns: every window's, the padding zero
    valid = min(wd, cols - pw)  # expanded columns a window reads
    row = ecb * cols * b  # floats of one ring row (every channel block's columns)
    items = chain_items(graph, chain, b)
    o_tile = items.o_tile
    w1, w2 = expand.inputs[1], dw.inputs[1]
    packs.setdefault(w1, NchwcFilter(Arg(f"pk{len(packs)}", w1, (ecb * b * icb * b,), "float32"), args[w1].name,
                                     ms[1], cin, 1, b, False, b, o_tile))
    packs.setdefault(w2, NchwcFilter(Arg(f"pk{len(packs)}", w2, (ecb * b * kh_n * kw_n,), "float32"), args[w2].name,
                                     ys[1], 1, kh_n * kw_n, b, True, 1))
    ring = f"ring + (ocb * {cols}LL + {pw}LL + q + tj) * {b}LL"
    expand_row = _Pointwise(b, icb, ecb, o_tile, packs[w1].arg.name, valid,
                            (f"{args[x].name} + nb * {icb * h * wd * b}LL + ih * {wd * b}LL", h * wd * b),
                            _lanes_store(_middle(graph, kernel, args, mid), ms[1], b, ring))
    e.layouts = layouts
    final = _Epilogue(e, outs, ys[1], b)

    def dw_store(acc: list[str], p: int) -> list[str]:
        return final.tile(acc, 1, p, "cb", "long long ow = q + tj;")
    dw_row = _DepthwiseRow(b, (kh_n, kw_n, sw, ow_n, cols), packs[w2].arg.name, dw_store)
    lo, hi = items.c_bounds("g", "groups")
    body = [f"for (long long r = 0; r < {n_img}LL * groups; ++r) {{",
            "    long long nb = r / groups, g = r % groups;",
            f"    long long t0 = {lo}, t1 = {hi};  /* the item's tiles of expanded blocks */",
            f"    long long c0 = t0 * {o_tile}LL, c1 = t1 * {o_tile}LL < {ecb}LL ? t1 * {o_tile}LL : {ecb}LL;",
            "    " + scratch("cbuf", f"{(kh_n + 1) * row}LL"),
            f"    float* zero = cbuf + {kh_n * row}LL;  /* the rows above and below the input */",
            f"    for (long long q = 0; q < {row}LL; ++q) zero[q] = 0.0f;",
            f"    for (long long s = 0; s < {kh_n}LL; ++s)",
            "        for (long long c = c0; c < c1; ++c) {",
            f"            float* rr = cbuf + s * {row}LL + c * {cols * b}LL;",
            f"            for (long long q = 0; q < {pw * b}LL; ++q) rr[q] = 0.0f;",
            f"            for (long long q = {(pw + valid) * b}LL; q < {cols * b}LL; ++q) rr[q] = 0.0f;",
            "        }",
            f"    long long done = -{ph}LL - 1;  /* the last expanded row in the ring */",
            f"    for (long long oh = 0; oh < {ys[2]}LL; ++oh) {{",
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
            *["        " + line for line in dw_row.lines()],
            "    }",
            "}"]
    return [f"    typedef float fs_vb __attribute__((vector_size({4 * b}), aligned(4), may_alias));",
            *_vector_fma(b), f"    long long nt = fs_threads(), groups = {items.c_groups('nt')};",
            f"    {OMP_FOR}\n" + _indent(body, 1)]


def _middle(graph: Graph, kernel: Kernel, args, tensor: str) -> list[str]:
    """C of lane `l` of the value of `tensor` (what the depthwise conv reads) at block `ocb`, row
    `ih`, pixel q + tj of image nb, from the 1x1 conv's sum `fs_a[l]` through the ops between
    them, stored at rp[l]."""
    e = _Emitter(graph, kernel, args)
    e.channel_split = {"co": ("ocb", "l")}
    e.acc_value = "fs_a[l]"
    e.push()
    v = e.value(tensor, ("nb", "co", "ih", "q + tj"))
    body = [f"long long co = ocb * {kernel.schedule.layout_out.block}LL + l;", *e.lines, f"rp[l] = {v};"]
    e.pop()
    return body


def _lanes_store(body: list[str], channels: int, b: int, at: str):
    """A tile's store(acc, o, p, ocb0): the sums set aside, then per pixel tj and block ocb one
    loop over the lanes running `body` (reads fs_a[l], writes rp[l]; rp = `at`), the lanes past
    `channels` zero."""
    full, rest = divmod(channels, b)
    lanes = ["#pragma omp simd", f"for (long long l = 0; l < {b}LL; ++l) {{", *["    " + x_ for x_ in body], "}"]
    if rest:
        lanes = [f"if (ocb < {full}LL) {{", *["    " + x_ for x_ in lanes], "} else {",
                 "    #pragma omp simd", f"    for (long long l = 0; l < {rest}LL; ++l) {{",
                 *["        " + x_ for x_ in body], "    }",
                 f"    for (long long l = {rest}LL; l < {b}LL; ++l) rp[l] = 0.0f;", "}"]

    def store(acc: list[str], o: int, p: int, ocb0: str) -> list[str]:
        return [f"float fs_t[{len(acc) * b}] __attribute__((aligned(64)));",
                *[f"*(fs_vb*)(fs_t + {k * b}) = {a};" for k, a in enumerate(acc)],
                f"for (long long tj = 0; tj < {p}LL; ++tj)", f"    for (long long ti = 0; ti < {o}LL; ++ti) {{",
                f"        long long ocb = {ocb0} + ti;", f"        const float* fs_a = fs_t + (ti * {p}LL + tj) * {b}LL;",
                f"        float* rp = {at};", *["        " + x_ for x_ in lanes], "    }"]
    return store


class _Pointwise:
    """C of a 1x1 conv over one row of `count` pixels: tiles of `nchwc_tile` output blocks x
    `nchwc_pixels` pixels (`spans`) over `icb` input blocks of the row `src` = (C of its block 0,
    pixel 0; floats between two of its blocks), each input lane one broadcast against the tile's
    filter vectors (`wp`, packed as `base.NchwcFilter` with the tiles of `o_tile`); `store(acc, o, p, ocb0)`
    the C storing a tile's sums (block ocb0 + i, pixel q + j at acc[i * p + j])."""

    def __init__(self, b: int, icb: int, ocb: int, o_tile: int, wp: str, count: int, src: tuple[str, int],
                 store) -> None:
        self.b, self.icb, self.ocb, self.o_tile, self.wp, self.count, (self.src, self.stride), self.store = (
            b, icb, ocb, o_tile, wp, count, src, store)

    def lines(self) -> list[str]:
        """The tiles t0..t1 of output blocks (C expressions in scope), the last one the blocks left."""
        full, rest = divmod(self.ocb, self.o_tile)
        out = [f"const float* xr = {self.src};",
               f"for (long long ot = t0; ot < (t1 < {full}LL ? t1 : {full}LL); ++ot) {{",
               *["    " + x_ for x_ in self._blocks(self.o_tile, f"ot * {self.o_tile}LL")], "}"]
        if rest:
            out += [f"if (t1 > {full}LL) {{", *["    " + x_ for x_ in self._blocks(rest, f"{full * self.o_tile}LL")], "}"]
        return ["{", *["    " + x_ for x_ in out], "}"]

    def _blocks(self, o: int, ocb0: str) -> list[str]:
        return [f"long long ocb0 = {ocb0};", f"const float* wt = {self.wp} + ocb0 * {self.icb * self.b * self.b}LL;",
                *spans(self.count, nchwc_pixels(self.b, o, False), lambda p: self._tile(o, p))]

    def _tile(self, o: int, p: int) -> list[str]:
        b = self.b
        acc = [[f"a{i}_{j}" for j in range(p)] for i in range(o)]
        lines = [f"fs_vb {acc[i][j]} = (fs_vb){{0}};" for i in range(o) for j in range(p)]
        lines += [f"for (long long c = 0; c < {self.icb}LL; ++c) {{",
                  f"    const float* xp = xr + c * {self.stride}LL + q * {b}LL;",
                  f"    const float* wq = wt + c * {b * o * b}LL;",
                  "    #pragma GCC unroll 1",
                  f"    for (int ic = 0; ic < {b}; ++ic) {{",
                  *[f"        fs_vb w{i} = *(const fs_vb*)(wq + ic * {o * b} + {i * b}); FS_VB_REG(w{i});" for i in range(o)],
                  *[line for j in range(p) for line in (
                      f"        fs_vb x{j} = FS_VB_SET(xp[{j * b} + ic]);",
                      *[f"        {acc[i][j]} = FS_VB_FMA(w{i}, x{j}, {acc[i][j]});" for i in range(o)])],
                  "    }", "}"]
        lines += self.store([acc[i][j] for i in range(o) for j in range(p)], o, p, "ocb0")
        return ["{", *["    " + x_ for x_ in lines], "}"]


class _DepthwiseRow:
    """C computing the depthwise conv's output row `oh` of image `nb` from the ring rows
    `rows[kh]`: per channel block `cb` of the item's c0..c1, tiles of its pixels (`nchwc_pixels`) over its taps, a
    filter vector per tap against each pixel's input vector; `store(acc, p)` the C storing a
    tile's sums (the epilogue and the outputs)."""

    def __init__(self, b: int, geometry, wp: str, store) -> None:
        self.b, self.wp, self.store = b, wp, store
        self.kh_n, self.kw_n, self.sw, self.ow_n, self.cols = geometry

    def lines(self) -> list[str]:
        return ["for (long long cb = c0; cb < c1; ++cb) {",
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
        lines += self.store([f"d{j}" for j in range(p)], p)
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
