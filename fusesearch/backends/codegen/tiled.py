"""The CUDA tiled skeleton for gemm/conv: a BM×BN output tile per block, A and B staged per K step
in shared memory (prologue applied in the staging loads), a register micro-tile per thread, the
epilogue on the registers before the one store.

Invariants: the tile is the schedule's (lowering's); single-buffered float staging, no split-K —
exactly what the cost model prices.
"""

from __future__ import annotations

from fusesearch.backends.codegen.base import CodegenRefused, _indent, cuda_entry, store
from fusesearch.backends.codegen.c_prelude import _CU_PRELUDE
from fusesearch.backends.codegen.contraction import tile_parts
from fusesearch.backends.codegen.emitter import _Emitter
from fusesearch.ir.graph import Graph
from fusesearch.lowering import Kernel
from fusesearch.schedule import thread_layout


def _tiled(graph: Graph, kernel: Kernel, name: str, ins, outs, args):
    """CUDA for gemm/conv: a block computes a BM×BN tile of one z (batch or group); per K step the
    block stages A (BK×BM, prologue applied; threads read A along whichever of M or K is contiguous
    in memory) and B (BK×BN) in shared memory, each thread then
    accumulates a TM×TN register micro-tile (rows ty+i·RY, columns tx+j·RX: coalesced stores,
    conflict-free shared reads), and the epilogue runs on the registers before the one store.
    Tile, threads and grid are the schedule's (lowering checked that the skeleton applies); split-K
    is never generated."""
    schedule = kernel.schedule
    layout = thread_layout(*schedule.tile[:2])
    if layout is None:
        raise CodegenRefused(f"no thread layout for the tile {schedule.tile} (the schedule and the generator disagree)")
    tm, tn, tk = schedule.tile
    rx, ry = layout
    ti, tj = tm // ry, tn // rx
    nthreads = rx * ry
    parts = tile_parts(graph, kernel, args, outs, "tiled", "acc[i][j]")
    c, setup, side = parts.c, parts.setup, parts.side
    a_lines, a_val, b_lines, b_val, epi_lines = parts.a_lines, parts.a_val, parts.b_lines, parts.b_val, parts.epilogue
    side_lines = _side_loops(graph, kernel, args, side)
    body = [
        f"__shared__ float As[{tk}][{tm}];",
        f"__shared__ float Bs[{tk}][{tn}];",
        f"const int tid = threadIdx.x, tx = tid % {rx}, ty = tid / {rx};",
        f"const long long m0 = (long long)blockIdx.y * {tm}, n0 = (long long)blockIdx.x * {tn}, gz = blockIdx.z;",
        *setup,
        f"float acc[{ti}][{tj}];",
        "#pragma unroll",
        f"for (int i = 0; i < {ti}; ++i)",
        "    #pragma unroll",
        f"    for (int j = 0; j < {tj}; ++j) acc[i][j] = 0.0f;",
        f"for (long long k0 = 0; k0 < {c.k}LL; k0 += {tk}) {{",
        f"    for (int l = tid; l < {tm * tk}; l += {nthreads}) {{",
        (f"        const int kk = l / {tm}, mm = l % {tm};" if c.a_m_contiguous else
         f"        const int mm = l / {tk}, kk = l % {tk};"),
        "        const long long gm = m0 + mm, gk = k0 + kk;",
        "        float v = 0.0f;",
        f"        if (gm < {c.m}LL && gk < {c.k}LL) {{",
        *["            " + x for x in a_lines],
        f"            v = {a_val};",
        "        }",
        "        As[kk][mm] = v;",
        "    }",
        f"    for (int l = tid; l < {tk * tn}; l += {nthreads}) {{",
        f"        const int kk = l / {tn}, nn = l % {tn};",
        "        const long long gk = k0 + kk, gn = n0 + nn;",
        "        float v = 0.0f;",
        f"        if (gk < {c.k}LL && gn < {c.n}LL) {{",
        *["            " + x for x in b_lines],
        f"            v = {b_val};",
        "        }",
        "        Bs[kk][nn] = v;",
        "    }",
        "    __syncthreads();",
        "    #pragma unroll 4",
        f"    for (int kk = 0; kk < {tk}; ++kk) {{",
        f"        float a[{ti}], b[{tj}];",
        "        #pragma unroll",
        f"        for (int i = 0; i < {ti}; ++i) a[i] = As[kk][ty + i * {ry}];",
        "        #pragma unroll",
        f"        for (int j = 0; j < {tj}; ++j) b[j] = Bs[kk][tx + j * {rx}];",
        "        #pragma unroll",
        f"        for (int i = 0; i < {ti}; ++i)",
        "            #pragma unroll",
        f"            for (int j = 0; j < {tj}; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);",
        "    }",
        "    __syncthreads();",
        "}",
        "#pragma unroll",
        f"for (int i = 0; i < {ti}; ++i) {{",
        "    #pragma unroll",
        f"    for (int j = 0; j < {tj}; ++j) {{",
        f"        const long long gm = m0 + ty + i * {ry}, gn = n0 + tx + j * {rx};",
        f"        if (gm < {c.m}LL && gn < {c.n}LL) {{",
        *["            " + x for x in epi_lines],
        "        }",
        "    }",
        "}",
        *side_lines,
    ]
    src = f"{_CU_PRELUDE}\n{cuda_entry(name, ins, outs)} {{\n{_indent(body, 1)}\n}}\n"
    return src


def _side_loops(graph: Graph, kernel: Kernel, args, side) -> list[str]:
    """Outputs that do not depend on the anchor (a prologue value also used outside): a
    grid-stride loop over all blocks of the launch, after the tile's work."""
    lines = []
    for out in side:
        e = _Emitter(graph, kernel, args)
        idx = e.unflatten("i", out.shape)
        v = e.value(out.tensor, idx)
        lines += ["{",
                  "    const long long bid = blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);",
                  "    const long long blocks = (long long)gridDim.x * gridDim.y * gridDim.z;",
                  f"    for (long long i = bid * blockDim.x + threadIdx.x; i < {out.size}LL; i += blocks * blockDim.x) {{",
                  *["        " + x for x in [*e.lines, store(out, "i", v)]], "    }", "}"]
    return lines
