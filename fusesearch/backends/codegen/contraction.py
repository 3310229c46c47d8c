"""The GEMM view of an anchor: MatMul, Gemm and Conv as z independent GEMMs
Y_z[m, n] = Σ_k A_z[m, k]·B_z[k, n], with the prologue applied where A and B are read, and the set
of epilogue tensors computed at the product's own position (which the tiled skeletons need).

Invariants: `contraction` is None exactly where no tiled skeleton applies (1-D MatMul operands,
ConvTranspose); `anchor_derived` is None when an epilogue op moves elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fusesearch.backends.codegen.base import CodegenRefused, store
from fusesearch.backends.codegen.emitter import _Emitter
from fusesearch.backends.codegen.ops import _conv_geometry, _conv_input
from fusesearch.ir.graph import Graph, Node
from fusesearch.schedule import MMA_ELEMENT_BYTES, a_load_elements, anchor_derived

# -- CUDA: shared-memory tiled gemm / conv, vectorized pointwise ------------------------------

@dataclass(frozen=True)
class _Contraction:
    """An anchor seen as z independent GEMMs Y_z[m, n] = Σ_k A_z[m, k]·B_z[k, n] (z: batch of a
    MatMul, group of a Conv). Each callable emits into the emitter and returns an expression."""

    z: int
    m: int
    n: int
    k: int
    setup: object  # (e, z) -> None: per-block index variables
    a: object  # (e, m, k) -> value of A (prologue applied; 0 outside the padding)
    b: object  # (e, k, n) -> value of B
    y_index: object  # (e, m, n) -> index tuple of the anchor output
    a_m_contiguous: bool = False  # A's neighbours in memory are along M (Conv pixels, Gemm transA)
    b_k_contiguous: bool = False  # B's neighbours in memory are along K (Conv filters, Gemm transB)
    # an NHWC conv's A in 16-byte chunks along K: (e, m, k, elements) -> (the chunk's first
    # element in the input, whether it lies inside), None where chunks are not whole or A is
    # computed (a prologue)
    a_chunk: object = None


def _contraction(graph: Graph, anchor: Node, channels_last: bool = False) -> _Contraction | None:
    """The anchor as a batched GEMM, or None (1-D MatMul operands, ConvTranspose: direct kernel).
    A conv whose input lies channels last (`layout.NHWC`) has K = (r, s, c), c innermost, so A's
    neighbours in memory are along K and a chunk of channels is one contiguous load (`a_chunk`)."""
    x, w = anchor.inputs[0], anchor.inputs[1]
    sa, sb = graph.tensors[x].shape, graph.tensors[w].shape
    y = anchor.outputs[0]
    ys = graph.tensors[y].shape
    state: dict = {}
    if anchor.op_type == "MatMul":
        if len(sa) < 2 or len(sb) < 2:
            return None

        def setup(e, z):
            state["zb"] = e.unflatten(z, ys[:-2]) if len(ys) > 2 else ()

        return _Contraction(
            math.prod(ys[:-2]), ys[-2], ys[-1], sa[-1], setup,
            lambda e, m, k: e.value(x, e.broadcast(state["zb"], sa[:-2]) + (m, k)),
            lambda e, k, n: e.value(w, e.broadcast(state["zb"], sb[:-2]) + (k, n)),
            lambda e, m, n: state["zb"] + (m, n))
    if anchor.op_type == "Gemm":
        ta, tb = int(anchor.attrs.get("transA", 0)), int(anchor.attrs.get("transB", 0))
        return _Contraction(
            1, ys[0], ys[1], sa[0] if ta else sa[1], lambda e, z: None,
            lambda e, m, k: e.value(x, (k, m) if ta else (m, k)),
            lambda e, k, n: e.value(w, (n, k) if tb else (k, n)),
            lambda e, m, n: (m, n), bool(ta), bool(tb))
    if anchor.op_type != "Conv":
        return None
    group = int(anchor.attrs.get("group", 1))
    cin_g, cout_g = sa[1] // group, ys[1] // group
    kernel = tuple(anchor.attrs.get("kernel_shape") or sb[2:])
    taps = [*kernel, cin_g] if channels_last else [cin_g, *kernel]
    pixels = (ys[0], *ys[2:])

    def conv_a(e, m, k):
        spatial, _, strides, dilations, pads = _conv_geometry(e, anchor, sa, sb, ys, False)
        p = e.unflatten(m, pixels)
        idx = (p[0], "0", *p[1:])
        return _conv_input(e, anchor, x, sa, idx, k, taps, (spatial, strides, pads, dilations), "gz", cin_g,
                           channels_last)

    def conv_b(e, k, n):
        parts = e.unflatten(k, taps)
        parts = (parts[-1], *parts[:-1]) if channels_last else parts
        return e.value(w, (f"(gz * {cout_g}LL + {n})", *parts))

    def chunk(e, m, k, elements):
        """A chunk of `elements` channels of one pixel and tap (`schedule.a_load_elements` says
        where they are whole: every chunk then starts on a multiple of `elements`, 16-byte aligned)."""
        if x not in e.args or graph.producer(x) in e.members:
            return None
        spatial, _, strides, dilations, pads = _conv_geometry(e, anchor, sa, sb, ys, False)
        p = e.unflatten(m, pixels)
        parts = e.unflatten(k, taps)
        pos = [e.tmp("long long", f"({p[1 + i]}) * {strides[i]}LL - {pads[i]}LL + ({parts[i]}) * {dilations[i]}LL")
               for i in range(spatial)]
        inside = " && ".join(f"{q} >= 0 && {q} < {sa[2 + i]}LL" for i, q in enumerate(pos))
        return f"{e.args[x].name}[{e.at(x, (p[0], f'(gz * {cin_g}LL + {parts[-1]})', *pos))}]", inside

    def conv_y(e, m, n):
        p = e.unflatten(m, pixels)
        return (p[0], e.tmp("long long", f"gz * {cout_g}LL + {n}"), *p[1:])

    return _Contraction(group, math.prod(pixels), cout_g, math.prod(taps), lambda e, z: None,
                        conv_a, conv_b, conv_y, not channels_last, True, chunk if channels_last else None)


@dataclass(frozen=True)
class TileParts:
    """What a tiled skeleton (CUDA cores or tensor cores) writes around its own main loop: the
    contraction, the per-block setup, the statements and value of A at (gm, gk) and of B at
    (gk, gn) (prologue applied), the epilogue's statements at (gm, gn) (reading the product as
    `acc`), and the outputs outside the epilogue (a prologue value also used elsewhere)."""

    c: _Contraction
    setup: list
    a_lines: list
    a_val: str
    b_lines: list
    b_val: str
    epilogue: list
    side: list
    # an NHWC conv's A as 16-byte chunks of a kernel input stored as staged (`_Contraction.a_chunk`):
    # (the statements at (gm, gk), the chunk's first element, whether it lies inside); None otherwise
    a_chunk: tuple | None = None


def tile_parts(graph: Graph, kernel, args, outs, skeleton: str, acc: str) -> TileParts:
    """The emitted parts of a tiled kernel, in one emitter (setup, A, B, then the epilogue, so
    temporaries are numbered the same way for every skeleton); CodegenRefused where the schedule
    chose a tile the anchor does not take."""
    anchor = graph.nodes[kernel.anchor]
    c = _contraction(graph, anchor, kernel.schedule.layout_in.channels_last)
    derived = anchor_derived(graph, kernel.nodes, anchor)
    if c is None or derived is None:
        raise CodegenRefused(f"{anchor.name}({anchor.op_type}): the {skeleton} skeleton does not apply here "
                             "(the schedule and the generator disagree)")
    e = _Emitter(graph, kernel, args)
    e.layouts.update({o.tensor: o.layout for o in outs if o.layout.channels_last})  # stored as they lie
    c.setup(e, "gz")
    setup = e.lines

    def section(fn) -> tuple[list[str], str]:
        e.lines = []
        e.push()
        v = fn()
        e.pop()
        lines, e.lines = e.lines, []
        return lines, v

    a_lines, a_val = section(lambda: c.a(e, "gm", "gk"))
    esize = MMA_ELEMENT_BYTES.get(skeleton, 0)
    elements = a_load_elements(graph, anchor, kernel.schedule.layout_in, esize) if esize and c.a_chunk else 1
    a_chunk = None
    if elements > 1:
        chunk_lines, found = section(lambda: c.a_chunk(e, "gm", "gk", elements))
        if found is None:
            raise CodegenRefused(f"{anchor.name}: A priced in chunks of {elements} channels has none "
                                 "(the schedule and the generator disagree)")
        a_chunk = (chunk_lines, *found)
    b_lines, b_val = section(lambda: c.b(e, "gk", "gn"))
    main = [o for o in outs if o.tensor in derived]
    y_shape = graph.tensors[anchor.outputs[0]].shape

    def epilogue():
        y_idx = c.y_index(e, "gm", "gn")
        flat = e.tmp("long long", e.flat(y_idx, y_shape))
        for o in main:
            if o.layout.channels_last:  # an output of the product's shape (`nhwc_conv`), at its own offset
                e.lines.append(store(o, e.tmp("long long", e.at(o.tensor, y_idx)), e.value(o.tensor, y_idx)))
                continue
            idx = y_idx if o.shape == y_shape else e.unflatten(flat, o.shape)
            e.lines.append(store(o, flat, e.value(o.tensor, idx)))

    e.acc_value = acc
    epi_lines, _ = section(epilogue)
    return TileParts(c, setup, a_lines, a_val, b_lines, b_val, epi_lines,
                     [o for o in outs if o.tensor not in derived], a_chunk)
