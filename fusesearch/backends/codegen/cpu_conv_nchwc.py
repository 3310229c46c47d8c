"""The NCHWc CPU conv (C only): a conv group whose activations lie in channel blocks (`fusesearch.layout`).

Problem: in NCHW a conv's lanes run along short pixel rows and a depthwise conv has no long
contiguous axis; NCHWc keeps a block of output channels in each vector register instead.
Approach (a direct conv as MLAS's and oneDNN's NCHWc kernels): filters packed once in the order the
tile reads them (`base.NchwcFilter`); work items (`schedule.NchwcItems`: images x blocks of output
rows, a multiple of the threads, x tiles of output blocks) in contiguous shares; per item the
input blocks in passes of `schedule.nchwc_chunk` (the filter slice in L1; partial sums in cbuf),
register tiles of output blocks x up to `nchwc_pixels` pixels (a span's tiles of sizes one apart),
one FMA per filter vector (held in a register: `FS_VB_REG`) and broadcast input (`FS_VB_FMA`); a
tile's last pass runs the epilogue on its sums in registers, one store per output. Padded inputs are read where they lie
(border columns in tiles down their rows, each pixel over its valid taps: no zero-bordered copy).
Invariants: `Schedule.product` "nchwc", `layout_out` blocked, `layout_in` as `schedule.nchwc_input`
says; padded lanes store zeros. Anchorless groups (`nchwc_pointwise_loops`) and reorders
(`reorder_kernel`: block x block squares transposed in registers) live here too."""

from __future__ import annotations

from fusesearch.backends.codegen.base import (
    OMP_FOR,
    Arg,
    CodegenRefused,
    GeneratedKernel,
    NchwcFilter,
    _indent,
    c_function,
    scratch,
    source_digest,
    store,
)
from fusesearch.backends.codegen.cpu_gemm import _split_outputs
from fusesearch.backends.codegen.emitter import _Emitter
from fusesearch.backends.codegen.ops import _conv_geometry
from fusesearch.ir.graph import Graph, Node
from fusesearch.layout import Layout, copy_name
from fusesearch.lowering import Kernel
from fusesearch.schedule import (
    nchwc_chains,
    nchwc_chunk,
    nchwc_compacts,
    nchwc_interior,
    nchwc_items,
    nchwc_pixels,
    tensor_layouts,
)


def nchwc_loops(graph: Graph, kernel: Kernel, args: dict[str, Arg], outs, anchor: Node, packs: dict) -> list[str]:
    """The C body of an NCHWc conv group (`schedule.nchwc_conv`, product "nchwc"): its input in
    `layout_in` (NCHWc, or NCHW for a dense conv over fewer channels than a block: an image),
    its outputs in `layout_out`. Work items (images x blocks of output rows x tiles of output
    blocks) in parallel; per item the input blocks in passes of `schedule.nchwc_chunk` (a slice of
    filters that stays in cache across the item's pixels), partial sums between passes in cbuf;
    each register tile's last pass runs the epilogue on its sums and stores the outputs once."""
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
    run = (kh_n, kw_n, sh, sw) == (1, 1, 1, 1) and not (ph or pw)  # pixels contiguous across rows
    items = nchwc_items(b, depthwise, xs, ys, (kh_n, kw_n, sh, sw), bool(ph or pw), layout.channels(ys[1]))
    o_tile, rows = items.o_tile, items.rows
    if w not in packs:
        floats = ocb * b * kh_n * kw_n * (1 if depthwise else icb * lanes_in)
        packs[w] = NchwcFilter(Arg(f"pk{len(packs)}", w, (floats,), "float32"), args[w].name, ys[1], ws[1],
                               kh_n * kw_n, b, depthwise, lanes_in, o_tile)
    pixels = (items.most_rows * ow_n, rows * ow_n)  # a block's at most (cbuf), its usual (its tiles)
    planes = source.size(tuple(xs)) // (xs[0] * h * wd * (b if source.blocked else 1))  # per image
    main, _ = _split_outputs(graph, kernel, outs, anchor)
    compact = nchwc_compacts(b, depthwise, xs, (kh_n, kw_n, sh, sw), bool(ph or pw))
    window = (items.most_rows, ow_n, 1, 1, 1) if compact else (h, wd, kh_n, kw_n, sw)
    geo = _Geometry(b, icb, lanes_in, source.blocked, window, depthwise, "xq" if compact else args[x].name,
                    packs[w].arg.name, pixels, xs[1], _Epilogue(e, main, ys[1], b))
    image = f"nb * {planes * h * wd * geo.xb}LL"
    # every window inside the input (no padding): tiles across the item's rows; else per row
    inside = (ph, pw) == (0, 0) and all(nchwc_interior(n, k, s, 0, o)[1] == o for n, k, s, o in
                                        ((h, kh_n, sh, oh_n), (wd, kw_n, sw, ow_n)))
    if compact:  # a stride-1 1x1 conv over the block's pixels, copied together
        def sums(o: int, ocb0: str) -> list[str]:
            return geo.span(o, ocb0, (1, 1), ow_n, "0", first="0")
    elif run or (inside and source.blocked and not depthwise):
        def sums(o: int, ocb0: str) -> list[str]:
            return geo.span(o, ocb0, (sh, sw), ow_n, image)
    else:
        def sums(o: int, ocb0: str) -> list[str]:
            return geo.rows(o, ocb0, image, (sh, sw), (ph, pw), (oh_n, ow_n), rows)
    full, rest, tiles = ocb // o_tile, items.rest, items.tiles

    def item(o: int, ocb0: str) -> list[str]:  # one work item's sums, in passes over the input blocks
        if depthwise:
            return ["long long ocb0 = 0;", f"for (long long d = 0; d < {o}LL; ++d) {{",
                    *["    " + x_ for x_ in sums(1, "d")], "}"]
        chunk = geo.chunk(o)
        passes = ([f"long long c0 = 0, c1 = {icb}LL;", *sums(o, ocb0)] if chunk >= icb else
                  [f"for (long long c0 = 0; c0 < {icb}LL; c0 += {chunk}LL) {{",
                   f"    long long c1 = c0 + {chunk}LL < {icb}LL ? c0 + {chunk}LL : {icb}LL;",
                   *["    " + x_ for x_ in sums(o, ocb0)], "}"])
        return [f"long long ocb0 = {ocb0};", *passes]
    # the row blocks cut to a multiple of the team at run time, their bounds (`NchwcItems.blocks`, `bounds`)
    share = [f"long long nt = fs_threads(), blocks = {items.c_blocks('nt')};", f"long long per = blocks * {tiles}LL;"]
    lo, hi = items.c_bounds("rb", "blocks")
    if compact:
        share += [scratch("xq", f"{icb * items.most_rows * ow_n * b}LL"), "long long copied = -1;"]
    body = [f"for (long long r = 0; r < {ys[0]}LL * per; ++r) {{",
            f"    long long nb = r / per, rb = r / {tiles}LL % blocks, ot = r % {tiles}LL;",
            f"    long long oh0 = {lo}, oh1 = {hi};",
            *(["    " + x_ for x_ in _compacted(args[x].name, image, (icb, h, wd, b), (sh, sw),
                                                 items.most_rows * ow_n, ow_n)] if compact else []),
            *(["    " + scratch("cbuf", f"{o_tile * geo.pixels * b}LL")] if geo.chunk(o_tile) < icb else []),
            *([f"    if (ot < {full}LL) {{"] if rest else ["    {"]),
            *["        " + x_ for x_ in item(o_tile, f"ot * {o_tile}LL")], "    }",
            *(["    else {", *["        " + x_ for x_ in item(rest, f"{full * o_tile}LL")], "    }"] if rest else []),
            "}"]
    return [f"    typedef float fs_vb __attribute__((vector_size({4 * b}), aligned(4), may_alias));",
            *_vector_fma(b), *["    " + x_ for x_ in share], f"    {OMP_FOR}\n" + _indent(body, 1)]


def _vector_fma(b: int) -> list[str]:
    """The C macros of a block's vectors: FS_VB_FMA(w, x, a) = w x + a in one rounding where the
    core has the FMA at that width (C11 contracts no `a += w * x`: a multiply and an add, twice
    the instructions), else the two operations; FS_VB_SET(x) the float x in every lane;
    FS_VB_REG(v) v held in a register there (an empty asm: GCC folds the load of a filter vector
    that few pixels use into each of their FMAs, a load per FMA: a 4 x 4 tile 7% slower)."""
    fma = {16: ("defined(__AVX512F__)", "__builtin_ia32_vfmaddps512_mask((w), (x), (a), (unsigned short)-1, 4)"),
           8: ("defined(__FMA__)", "__builtin_ia32_vfmaddps256((w), (x), (a))")}.get(b)
    lines = ["#undef FS_VB_FMA", "#undef FS_VB_SET", "#undef FS_VB_REG",
             f"#define FS_VB_SET(x) ((fs_vb){{{', '.join(['(x)'] * b)}}})"]
    if fma:
        lines += [f"#if {fma[0]} && !defined(__clang__)", f"#define FS_VB_FMA(w, x, a) {fma[1]}",
                  '#define FS_VB_REG(v) __asm__("" : "+v"(v))', "#else"]
    lines += ["#define FS_VB_FMA(w, x, a) ((w) * (x) + (a))", "#define FS_VB_REG(v) (void)0"]
    return lines + (["#endif"] if fma else [])


def _compacted(x: str, image: str, dims: tuple[int, int, int, int], strides: tuple[int, int], plane: int,
               ow_n: int) -> list[str]:
    """C copying the input pixels a strided 1x1 conv's block of rows oh0..oh1 reads (every
    stride-th row and column of image nb of NCHWc `x`: `dims` its blocks, rows, columns, block)
    together into the thread's scratch xq (`plane` pixels a block, a row of `ow_n` after
    another), where the thread's last copy was of another block (`copied`): a thread takes a
    block's tiles one after another."""
    icb, h, wd, b = dims
    sh, sw = strides
    return ["if (nb * blocks + rb != copied) {",
            "    copied = nb * blocks + rb;",
            f"    for (long long c = 0; c < {icb}LL; ++c)",
            "        for (long long oh = oh0; oh < oh1; ++oh) {",
            f"            const float* src = {x} + {image} + (c * {h}LL + oh * {sh}LL) * {wd * b}LL;",
            f"            float* dst = xq + (c * {plane}LL + (oh - oh0) * {ow_n}LL) * {b}LL;",
            f"            for (long long ow = 0; ow < {ow_n}LL; ++ow)",
            f"                *(fs_vb*)(dst + ow * {b}LL) = *(const fs_vb*)(src + ow * {sw * b}LL);",
            "        }",
            "}"]


class _Geometry:
    """The constants an NCHWc conv's tiles are written with: per input block `lanes_in` input
    lanes, `xb` floats per pixel and `xc` between two lanes of one pixel (NCHWc: b and 1; NCHW:
    1 and H x W); `pixels` the pixels of a work item's partial sums (cbuf) per output block
    (carried there between passes) at most, and a block's usual pixels (`count`, which its span's
    tiles are sized for); `channels` the input's (a dense tile skips the last block's
    zero lanes); `epilogue` what a tile's last pass stores (`_Epilogue`)."""

    def __init__(self, b, icb, lanes_in, blocked_in, window, depthwise, x, wp, pixels, channels, epilogue) -> None:
        self.b, self.icb, self.lanes_in = b, icb, lanes_in
        self.h, self.wd, self.kh_n, self.kw_n, self.sw = window
        self.xb, self.xc = (b, 1) if blocked_in else (1, self.h * self.wd)
        self.depthwise, self.x, self.wp, (self.pixels, self.count) = depthwise, x, wp, pixels
        self.last_lanes = channels - (icb - 1) * lanes_in  # the last input block's channels (its other lanes zero)
        self.epilogue = epilogue

    def chunk(self, o: int) -> int:
        """Input blocks of a pass of a tile of `o` output blocks (`schedule.nchwc_chunk`); a
        depthwise tile reads one block, all its input, in one pass."""
        if self.depthwise:
            return self.icb
        return min(self.icb, nchwc_chunk(self.b, o, self.lanes_in, self.kh_n * self.kw_n))

    def tile(self, o: int, p: int, ocb0: str, at: tuple[str, int], xoff, kw: tuple[str, str], where: str) -> list[str]:
        """The register tile: sums of `o` output blocks from `ocb0` x `p` pixels (pixel j's input
        offset at tap (0, 0) of input block 0: `xoff(j)`; its partial sums at pixel at[0] + j at[1]
        of cbuf; `where` declares the output pixel `tj` of the tile: its `oh` and `ow`) over the taps
        kh0..kh1 x kw[0]..kw[1] and, dense, the input blocks c0..c1 of the pass (the sums of the
        passes before read back from cbuf); stored into cbuf but at the last pass, where the
        epilogue runs on them. Dense: per input lane the tile's `o` filter vectors (contiguous)
        and `p` broadcast input values, o x p FMAs; depthwise: per tap one filter vector and `p`
        input vectors. A tile of fewer sums than the FMA units keep busy sums in chains
        (`schedule.nchwc_chains`: dense by input lanes, `_lane`; depthwise by filter rows,
        `_depthwise_chains`), added after its taps."""
        b, xb, hw, passes = self.b, self.xb, self.h * self.wd, self.chunk(o) < self.icb
        acc = [[f"a{i}_{j}" for j in range(p)] for i in range(o)]
        slot = {(i, j): f"cbuf + ({i * self.pixels}LL + {at[0]} + {j * at[1]}LL) * {b}LL" for i in range(o) for j in range(p)}
        lines = [f"long long x{j} = {xoff(j)};" for j in range(p)]
        lines += [f"fs_vb {acc[i][j]} = " + (f"c0 ? *(const fs_vb*)({slot[i, j]}) : (fs_vb){{0}};" if passes
                                             else "(fs_vb){0};") for i, j in slot]
        taps = self.kh_n * self.kw_n
        tap = f"kh * {self.wd * xb}LL + kw * {xb}LL"
        k_n = nchwc_chains(p, self.kh_n, self.kh_n, depthwise=True) if self.depthwise else 1
        if k_n > 1:
            lines += self._depthwise_chains(p, k_n, acc[0], ocb0, kw)
        elif self.depthwise:
            lines += ["for (long long kh = kh0; kh < kh1; ++kh)",
                      f"for (long long kw = {kw[0]}; kw < {kw[1]}; ++kw) {{",
                      f"    const float* xp = {self.x} + {ocb0} * {hw * b}LL + {tap};",
                      f"    fs_vb wv = *(const fs_vb*)({self.wp} + ({ocb0} * {taps}LL + kh * {self.kw_n}LL + kw) * {b}LL);",
                      *[f"    {acc[0][j]} = FS_VB_FMA(wv, *(const fs_vb*)(xp + x{j}), {acc[0][j]});" for j in range(p)],
                      "}"]
        else:
            panel = self.lanes_in * o * b  # the tile's filters per input block and tap
            k_n = nchwc_chains(o * p, self.lanes_in, self.last_lanes)
            chain = [[[f"{acc[i][j]}_{k}" if k else acc[i][j] for j in range(p)] for i in range(o)]
                     for k in range(k_n)]
            lines += [f"fs_vb {chain[k][i][j]} = (fs_vb){{0}};" for k in range(1, k_n) for i in range(o) for j in range(p)]
            lines += ["for (long long icb = c0; icb < c1; ++icb)",
                      "for (long long kh = kh0; kh < kh1; ++kh)",
                      f"for (long long kw = {kw[0]}; kw < {kw[1]}; ++kw) {{",
                      f"    const float* xp = {self.x} + icb * {hw * self.lanes_in}LL + {tap};",
                      f"    const float* wp = {self.wp} + {ocb0} * {self.icb * taps * self.lanes_in * b}LL"
                      f" + (icb * {taps}LL + kh * {self.kw_n}LL + kw) * {panel}LL;",
                      # GCC's full unroll interleaves the lanes and spills the accumulators
                      "    #pragma GCC unroll 1",
                      f"    for (int ic = 0; ic < {self._lanes('icb')}; ic += {k_n}) {{",
                      *[line for k in range(k_n) for line in self._lane(o, p, k, chain[k])],
                      "    }", "}"]
            lines += [f"{acc[i][j]} = {' + '.join(chain[k][i][j] for k in range(k_n))};"
                      for i in range(o) for j in range(p) if k_n > 1]
        last = self.epilogue.tile([acc[i][j] for i in range(o) for j in range(p)], o, p, ocb0, where)
        if passes:
            lines += [f"if (c1 < {self.icb}LL) {{", *[f"    *(fs_vb*)({slot[i, j]}) = {acc[i][j]};" for i, j in slot],
                      "} else {", *["    " + x_ for x_ in last], "}"]
        else:
            lines += last
        return ["{", *["    " + x_ for x_ in lines], "}"]

    def _depthwise_chains(self, p: int, k_n: int, acc: list[str], ocb0: str, kw: tuple[str, str]) -> list[str]:
        """C of a depthwise tile's taps (`p` pixels' sums `acc`) in `k_n` chains: down each
        column of taps, filter row kh (kh0..kh1, each row a branch) adds into chain kh mod k_n;
        the chains summed into `acc` after the last column."""
        b, xb, taps = self.b, self.xb, self.kh_n * self.kw_n
        chain = [[f"{acc[j]}_{k}" if k else acc[j] for j in range(p)] for k in range(k_n)]
        rows = [line for k in range(self.kh_n) for line in (
            f"    if (kh0 <= {k} && {k} < kh1) {{",
            f"        fs_vb wv{k} = *(const fs_vb*)(wq + {k * self.kw_n * b}LL);",
            *[f"        {chain[k % k_n][j]} = FS_VB_FMA(wv{k}, *(const fs_vb*)(xp + {k * self.wd * xb}LL + x{j}),"
              f" {chain[k % k_n][j]});" for j in range(p)], "    }")]
        return [*[f"fs_vb {chain[k][j]} = (fs_vb){{0}};" for k in range(1, k_n) for j in range(p)],
                f"for (long long kw = {kw[0]}; kw < {kw[1]}; ++kw) {{",
                f"    const float* xp = {self.x} + {ocb0} * {self.h * self.wd * b}LL + kw * {xb}LL;",
                f"    const float* wq = {self.wp} + ({ocb0} * {taps}LL + kw) * {b}LL;", *rows, "}",
                *[f"{acc[j]} = {' + '.join(chain[k][j] for k in range(k_n))};" for j in range(p)]]

    def _lane(self, o: int, p: int, k: int, acc: list[list[str]]) -> list[str]:
        """C of input lane ic + `k` of a dense tile (`o` blocks x `p` pixels): its `o` filter
        vectors, then per pixel its broadcast input and `o` FMAs into the sums `acc` (chain k's)."""
        b, ic = self.b, f"(ic + {k})" if k else "ic"
        return [*[f"        fs_vb w{i}_{k} = *(const fs_vb*)(wp + {ic} * {o * b} + {i * b}); FS_VB_REG(w{i}_{k});"
                  for i in range(o)],
                *[line for j in range(p) for line in
                  (f"        fs_vb v{j}_{k} = FS_VB_SET(xp[x{j} + {ic} * {self.xc}LL]);",
                   *[f"        {acc[i][j]} = FS_VB_FMA(w{i}_{k}, v{j}_{k}, {acc[i][j]});" for i in range(o)])]]

    def _lanes(self, icb: str) -> str:
        """The input lanes a dense tile reads of input block `icb`: all but the zero lanes past the
        channels in the last block (24 channels in blocks of 16: 8 of its 16)."""
        if self.last_lanes == self.lanes_in:
            return str(self.lanes_in)
        return f"({icb} < {self.icb - 1}LL ? {self.lanes_in} : {self.last_lanes})"

    def tiles(self, o: int, ocb0: str, span: tuple[str, str], count: int, at: tuple[str, int], xoff,
              kw: tuple[str, str], where: str) -> list[str]:
        """Pixels q = span[0]..span[1] (every tap in `kw` valid for each; pixel q + j's input
        offset `xoff(j)`, its place in cbuf at[0] + j at[1], `where` its output pixel) in tiles of
        at most `schedule.nchwc_pixels`: a span of its usual `count` pixels (at most) in as few
        tiles as that allows, of sizes one apart (13 pixels at 6: 5, 4, 4; not 6, 6 and a tile of
        one pixel, whose few sums wait on the FMA latency); a shorter span's last pixels one by
        one."""
        tiles = max(1, -(-count // nchwc_pixels(self.b, o, self.depthwise)))
        small, wide = divmod(count, tiles)  # `wide` tiles of small + 1 pixels, then tiles of small

        def tile(n: int) -> list[str]:
            return ["    " + x_ for x_ in self.tile(o, n, ocb0, at, xoff, kw, where)]
        lines = ["{", f"    long long q = {span[0]};"]
        if wide:
            lines += [f"    for (; q + {small + 1}LL <= {span[1]} && q < {span[0]} + {wide * (small + 1)}LL; "
                      f"q += {small + 1}LL)", *tile(small + 1)]
        if small > 1:
            lines += [f"    for (; q + {small}LL <= {span[1]}; q += {small}LL)", *tile(small)]
        return [*lines, f"    for (; q < {span[1]}; ++q)", *tile(1), "}"]

    def rows(self, o: int, ocb0: str, image: str, strides: tuple[int, int], pads: tuple[int, int],
             out: tuple[int, int], rows: int) -> list[str]:
        """The item's output rows oh0..oh1 read where the input lies (no zero border): per row the
        interior columns (`schedule.nchwc_interior`) in tiles over the row's valid kh; per border
        column, its pixels in the rows whose window lies inside the input vertically in tiles
        down the column over the column's valid kw, the others one by one over their valid taps."""
        (sh, sw), (ph, pw), (oh_n, ow_n), xb = strides, pads, out, self.xb
        lo, hi = nchwc_interior(self.wd, self.kw_n, sw, pw, ow_n)
        top, bottom = nchwc_interior(self.h, self.kh_n, sh, ph, oh_n)

        def valid_kh(row: str) -> list[str]:
            return [f"long long ih0 = {row} * {sh}LL - {ph}LL;",
                    f"long long kh0 = ih0 < 0 ? -ih0 : 0, kh1 = {self.h}LL - ih0 < {self.kh_n}LL ? {self.h}LL - ih0 "
                    f": {self.kh_n}LL;"]

        def at(row: str, column: str) -> str:  # a pixel's input offset at tap (0, 0)
            return f"{image} + (({row} * {sh}LL - {ph}LL) * {self.wd}LL + {column} * {sw}LL - {pw}LL) * {xb}LL"
        lines = []
        if hi > lo:
            lines += ["for (long long oh = oh0; oh < oh1; ++oh) {", *["    " + x_ for x_ in valid_kh("oh")],
                      *["    " + x_ for x_ in self.tiles(
                          o, ocb0, (f"{lo}LL", f"{hi}LL"), hi - lo, (f"(oh - oh0) * {ow_n}LL + q", 1),
                          lambda j: f"x0 + {j * sw * xb}LL" if j else at("oh", "q"), ("0", str(self.kw_n)),
                          "long long ow = q + tj;")], "}"]
        for c in [*range(lo), *range(hi, ow_n)]:
            iw0 = c * sw - pw
            kw, place = (str(max(0, -iw0)), str(min(self.kw_n, self.wd - iw0))), (f"(q - oh0) * {ow_n}LL + {c}LL", ow_n)
            where = f"long long oh = q + tj, ow = {c}LL;"
            lines += ["{", f"    long long ra = oh0 < {top}LL ? {top}LL : oh0, rb = oh1 < {bottom}LL ? oh1 : {bottom}LL;",
                      f"    long long kh0 = 0, kh1 = {self.kh_n}LL;",
                      *["    " + x_ for x_ in self.tiles(
                          o, ocb0, ("ra", "rb"), min(rows, bottom - top), place,
                          lambda j, c=c: f"x0 + {j * sh * self.wd * xb}LL" if j else at("q", f"{c}LL"), kw, where)],
                      "    for (long long q = oh0; q < oh1; ++q) {", "        if (q >= ra && q < rb) continue;",
                      *["        " + x_ for x_ in valid_kh("q")],
                      *["        " + x_ for x_ in self.tile(o, 1, ocb0, place, lambda j, c=c: at("q", f"{c}LL"), kw,
                                                            where)],
                      "    }", "}"]
        return lines

    def span(self, o: int, ocb0: str, strides: tuple[int, int], ow_n: int, image: str, first: str = "oh0") -> list[str]:
        """The item's output pixels as one span (every window inside the input: no padding),
        tiles across its rows: pixel q + j at output row oh0 + (q + j) / ow,
        column (q + j) % ow; `first`: the input row of output row oh0 (0 where the block's input
        was copied together, `_compacted`)."""
        sh, sw = strides
        one_run = (sh, sw, self.wd) == (1, 1, ow_n)  # consecutive pixels consecutive in the input

        def xoff(j: int) -> str:
            if one_run:
                return f"x0 + {j * self.xb}LL" if j else f"{image} + ({first} * {ow_n}LL + q) * {self.xb}LL"
            return (f"{image} + ((oh0 + (q + {j}LL) / {ow_n}LL) * {sh * self.wd}LL + (q + {j}LL) % {ow_n}LL * {sw}LL)"
                    f" * {self.xb}LL")
        where = "long long oh = oh0, ow = q + tj;"  # the pixel index oh * ow_n + ow is linear in q
        return ["long long kh0 = 0, kh1 = " + f"{self.kh_n};",
                *self.tiles(o, ocb0, ("0", f"(oh1 - oh0) * {ow_n}LL"), self.count, ("q", 1), xoff,
                            ("0", str(self.kw_n)), where)]


class _Epilogue:
    """The group's epilogue (bias, activations, a residual) on a register tile's final sums, and
    the one store of each output: the tile's vectors set aside in order, then per pixel `tj` and
    output block `ti` one loop over the block's lanes reading them; the lanes past the channels
    store zeros. Its C is written once (`_Emitter`, lane `l` of block `ocb` at (nb, oh, ow), the
    sum `fs_a[l]`) and repeated in each tile."""

    def __init__(self, e: _Emitter, main, channels: int, b: int) -> None:
        e.channel_split = {"co": ("ocb", "l")}
        e.acc_value = "fs_a[l]"
        idx = ("nb", "co", "oh", "ow")
        e.lines = []
        e.push()
        writes = [store(o_, e.at(o_.tensor, idx), e.value(o_.tensor, idx)) for o_ in main]
        self.body = [f"long long co = ocb * {b}LL + l;", *e.lines, *writes]
        e.pop()
        e.acc_value = ""
        self.zeros = [f"{o_.name}[{e.at(o_.tensor, idx)}] = 0.0f;" for o_ in main]
        self.b, (self.full, self.rest) = b, divmod(channels, b)

    def tile(self, acc: list[str], o: int, p: int, ocb0: str, where: str) -> list[str]:
        """C storing the epilogue of the sums `acc` (block i's pixel j at i * p + j) of `o` output
        blocks from `ocb0` x `p` pixels, `where` declaring pixel `tj`'s `oh` and `ow`."""
        b = self.b

        def lanes(n: int) -> list[str]:
            return ["#pragma omp simd", f"for (long long l = 0; l < {n}LL; ++l) {{", *["    " + x_ for x_ in self.body], "}"]
        block = lanes(b)
        if self.rest:
            block = [f"if (ocb < {self.full}LL) {{", *["    " + x_ for x_ in block], "} else {",
                     *["    " + x_ for x_ in lanes(self.rest)],
                     f"    for (long long l = {self.rest}LL; l < {b}LL; ++l) {{", *["        " + z for z in self.zeros],
                     "    }", "}"]
        return [f"float fs_t[{len(acc) * b}] __attribute__((aligned(64)));",
                *[f"*(fs_vb*)(fs_t + {k * b}) = {a};" for k, a in enumerate(acc)],
                f"for (long long tj = 0; tj < {p}LL; ++tj) {{", f"    {where}",
                f"    for (long long ti = 0; ti < {o}LL; ++ti) {{",  # a constant count: unrolled
                f"        long long ocb = {ocb0} + ti;", f"        const float* fs_a = fs_t + (ti * {p}LL + tj) * {b}LL;",
                *["        " + x_ for x_ in block], "    }", "}"]


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
                           skeleton="packed", c_threads=threads)


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
