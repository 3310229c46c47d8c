"""The CUDA tensor-core skeleton for gemm/conv as a performance engineer writes it (`mma-sync-*`).

Problem: wmma leaves tensor-core throughput unused; sm_80+ needs `mma.sync` fed well.
Approach: the anchor as z GEMMs (`contraction`), a BM x BN tile per block, WM x WN per warp,
`mma.sync` m16n8k8 (TF32) or m16n8k16 (FP16/BF16) into float registers. Staging: A and B
K-contiguous per BK step, prologue applied (`tile_parts`, `mma.staged_element`), plain float loads
by 4-byte cp.async, a half operand read as it is and K-contiguous by 16-byte cp.async per thread
(`vector_source`), an NHWC conv's A by 16-byte cp.async of channels (`TileParts.a_chunk`). Shared memory unpadded, 16-byte chunks XOR-swizzled by row (no bank conflicts);
`stages` buffers with stages - 1 steps in flight; `ldmatrix.x4` for every operand (TF32 as b16
pairs, rounded by `fs_tf32`); the epilogue on the accumulators (`ptx` layout), one store. Split-K
(`mma_sync_split`): each split writes its partial of the real output (`Schedule.workspace_bytes`,
as priced); the last block on the tile's counter sums them in split order and runs the epilogue.
Invariants: tile, warp, stages, threads, grid and dynamic shared memory are the schedule's
(`schedule.mma_sync`, `mma_sync_smem_bytes`, `GeneratedKernel.dynamic_smem`); split-K launches run
in order on one stream, counters back at 0; the same text runs in the emulator (FS_EMULATED)."""

from __future__ import annotations

import math
import re

from fusesearch.backends.codegen.base import CodegenRefused, _indent, cuda_entry
from fusesearch.backends.codegen.c_prelude import _CU_PRELUDE
from fusesearch.backends.codegen.contraction import tile_parts
from fusesearch.backends.codegen.mma import staged_element, staging_headers
from fusesearch.backends.codegen.ptx import MMA_SYNC
from fusesearch.backends.codegen.tiled import _side_loops
from fusesearch.ir.graph import Graph
from fusesearch.lowering import Kernel
from fusesearch.schedule import MMA_ELEMENT_BYTES, mma_sync_smem_bytes

# skeleton -> (shared-memory element type, the mma.sync function, its K, zero)
_INSTRUCTION = {
    "mma-sync-tf32": ("float", "fs_mma_m16n8k8_tf32", 8, "0.0f"),
    "mma-sync-f16": ("__half", "fs_mma_m16n8k16_f16", 16, "__float2half(0.0f)"),
    "mma-sync-bf16": ("__nv_bfloat16", "fs_mma_m16n8k16_bf16", 16, "__float2bfloat16(0.0f)"),
}
CHUNK = 16  # bytes: an ldmatrix row, the unit the swizzle permutes


def swizzled(row: str, col: str, row_elems: int, esize: int) -> str:
    """The element offset of (row, col) in a staged operand of `row_elems` elements per row: the
    row's 16-byte chunks XOR-permuted (module docstring)."""
    per_chunk = CHUNK // esize
    chunks = row_elems // per_chunk
    rows_per_line = max(1, 128 // (row_elems * esize))
    spread = min(chunks, 8)
    line = f"(({row}) >> {rows_per_line.bit_length() - 1})" if rows_per_line > 1 else f"({row})"
    chunk = f"(((({col}) >> {per_chunk.bit_length() - 1}) ^ ({line} & {spread - 1})) << {per_chunk.bit_length() - 1})"
    return f"({row}) * {row_elems} + {chunk} + (({col}) & {per_chunk - 1})"


_HALF_LOAD = re.compile(r"float (v\d+) = fs_(float16|bfloat16)_load\((in\d+\[(?:.* \+ )?gk\])\);")
_OPERAND_DTYPE = {"mma-sync-f16": "float16", "mma-sync-bf16": "bfloat16"}


def vector_source(skeleton: str, lines, value: str, k_contiguous: bool, k: int) -> str:
    """The global element a 16-byte cp.async of an operand's chunk starts at (`in0[...]`, at the
    chunk's gk), or '' where the operand is not copied so: it must be a kernel input of the
    operand's half type read as it is (no prologue), contiguous along K (A row-major, B
    K-contiguous), K a whole number of 16-byte chunks (every row, and so every chunk, 16-byte
    aligned: the buffers are), its index ending in `+ gk`."""
    per_chunk = CHUNK // MMA_ELEMENT_BYTES[skeleton]
    load = _HALF_LOAD.fullmatch(lines[0]) if len(lines) == 1 else None
    if (skeleton not in _OPERAND_DTYPE or not k_contiguous or k % per_chunk or load is None or load[1] != value
            or load[2] != _OPERAND_DTYPE[skeleton]):
        return ""
    return load[3]


def _mma_sync(graph: Graph, kernel: Kernel, name: str, ins, outs, args) -> str:
    """CUDA for a gemm/conv group whose schedule is `mma-sync-*`: its block tile, warp tile,
    stages, threads and grid as the schedule gives them."""
    schedule = kernel.schedule
    skeleton = schedule.skeleton
    if skeleton not in _INSTRUCTION:
        raise CodegenRefused(f"{skeleton}: not an mma.sync skeleton (the schedule and the generator disagree)")
    elem, instruction, ks, zero = _INSTRUCTION[skeleton]
    esize = MMA_ELEMENT_BYTES[skeleton]
    tm, tn, tk = schedule.tile
    wm, wn = schedule.warp
    stages, threads = schedule.stages, schedule.threads
    fm, fn = wm // 16, wn // 8
    per_chunk = CHUNK // esize
    if (tm % wm or tn % wn or wm % 16 or wn % 16 or tk % ks or (tk * esize) % CHUNK or stages < 3
            or threads != (tm // wm) * (tn // wn) * 32):
        raise CodegenRefused(f"tile {schedule.tile} / warp {schedule.warp} / {stages} stages is not an mma.sync tiling")
    parts = tile_parts(graph, kernel, args, outs, skeleton, "value")  # the epilogue on one product element
    c = parts.c
    a_col, b_col = c.a_m_contiguous, c.b_k_contiguous
    a_stage, b_stage = tm * tk, tn * tk
    smem = mma_sync_smem_bytes(schedule.tile, stages, esize)

    def at(row: str, col: str) -> str:
        return swizzled(row, col, tk, esize)

    def operand(dst: str, row: str, rows: int, extent: int, outer: str, lines, value, k_contiguous: bool,
                chunk=None) -> list[str]:
        """The staging loop of one operand (`rows` x BK of it into `dst`): 16-byte cp.async chunks
        where `vector_source` allows or an NHWC conv's A has whole chunks of channels (`chunk`:
        a chunk in the padding is zeros), else an element per iteration."""
        g = "g" + row[0]
        source = vector_source(skeleton, lines, value, k_contiguous, c.k)
        inside = f"{g} < {extent}LL && gk < {c.k}LL"
        if chunk is not None:  # a pixel's channels at one tap: all inside the image, or all padding
            chunk_lines, first, within = chunk
            return [f"for (int l = tid; l < {rows * tk // per_chunk}; l += {threads}) {{",
                    f"    const int {row} = l / {tk // per_chunk}, kk = l % {tk // per_chunk} * {per_chunk};",
                    f"    const long long {g} = {outer} + {row}, gk = k0 + kk;",
                    "    bool copied = false;",
                    f"    if ({inside}) {{",
                    *["        " + x for x in chunk_lines],
                    f"        if ({within}) {{ fs_cp_async16(&{dst}[{at(row, 'kk')}], &{first}); copied = true; }}",
                    "    }",
                    f"    if (!copied) for (int e = 0; e < {per_chunk}; ++e) {dst}[{at(row, 'kk')} + e] = {zero};",
                    "}"]
        if source:  # a chunk of per_chunk elements along K per iteration: all in, or all past K's end
            return [f"for (int l = tid; l < {rows * tk // per_chunk}; l += {threads}) {{",
                    f"    const int {row} = l / {tk // per_chunk}, kk = l % {tk // per_chunk} * {per_chunk};",
                    f"    const long long {g} = {outer} + {row}, gk = k0 + kk;",
                    f"    if ({inside}) fs_cp_async16(&{dst}[{at(row, 'kk')}], &{source});",
                    f"    else for (int e = 0; e < {per_chunk}; ++e) {dst}[{at(row, 'kk')} + e] = {zero};",
                    "}"]
        return [f"for (int l = tid; l < {rows * tk}; l += {threads}) {{",
                (f"    const int {row} = l / {tk}, kk = l % {tk};" if k_contiguous else
                 f"    const int kk = l / {rows}, {row} = l % {rows};"),
                f"    const long long {g} = {outer} + {row}, gk = k0 + kk;",
                f"    if ({inside}) {{",
                *["        " + x for x in staged_element(skeleton, lines, value, f"{dst}[{at(row, 'kk')}]")],
                f"    }} else {dst}[{at(row, 'kk')}] = {zero};",
                "}"]

    stage_fn = [
        "auto stage = [&](long long k0, int s) {",
        f"    {elem}* a_dst = As + s * {a_stage};",
        f"    {elem}* b_dst = Bs + s * {b_stage};",
        *["    " + x for x in operand("a_dst", "mm", tm, c.m, "m0", parts.a_lines, parts.a_val, not a_col,
                                   parts.a_chunk)],
        *["    " + x for x in operand("b_dst", "nn", tn, c.n, "n0", parts.b_lines, parts.b_val, b_col)],
        "};",
    ]
    tf32 = skeleton == "mma-sync-tf32"
    rounded = ["            #pragma unroll",
               "            for (int r = 0; r < {n}; ++r) {v}[r] = fs_tf32(__int_as_float((int){v}[r]));"]
    multiply = [
        "auto multiply = [&](int s) {",
        f"    const {elem}* a_s = As + s * {a_stage};",
        f"    const {elem}* b_s = Bs + s * {b_stage};",
        "    #pragma unroll",
        f"    for (int kk = 0; kk < {tk}; kk += {ks}) {{",
        f"        unsigned a[{fm}][4], b[{fn}][2];",
        "        #pragma unroll",
        f"        for (int i = 0; i < {fm}; ++i) {{",
        f"            fs_ldmatrix_x4(a[i], a_s + {at(f'wy * {wm} + i * 16 + (lane & 15)', f'kk + (lane >> 4) * {per_chunk}')});",
        *([x.format(n=4, v="a[i]") for x in rounded] if tf32 else []),
        "        }",
        "        #pragma unroll",
        f"        for (int j = 0; j < {fn}; j += 2) {{",
        f"            fs_ldmatrix_x4(&b[j][0], b_s + "
        f"{at(f'wx * {wn} + j * 8 + (lane & 7) + ((lane >> 4) << 3)', f'kk + ((lane >> 3) & 1) * {per_chunk}')});",
        *([x.format(n=4, v="(&b[j][0])") for x in rounded] if tf32 else []),
        "        }",
        "        #pragma unroll",
        f"        for (int i = 0; i < {fm}; ++i)",
        "            #pragma unroll",
        f"            for (int j = 0; j < {fn}; ++j) {instruction}(acc[i][j], a[i], b[j], acc[i][j]);",
        "    }",
        "};",
    ]
    steps = -(-c.k // tk)
    split = schedule.split_k
    per_split = -(-steps // split)  # K steps of each split (the last may have fewer)
    loop = [
        f"const long long kt0 = (long long)ks * {per_split}, kt1 = kt0 + {per_split} < {steps}LL ? kt0 + {per_split} "
        f": {steps}LL;",
        "#pragma unroll",
        f"for (int s = 0; s < {stages - 1}; ++s) {{  // the first stages - 1 K steps in flight",
        f"    if (kt0 + s < kt1) stage((kt0 + s) * {tk}, s);",
        "    fs_cp_async_commit();",
        "}",
        "for (long long kt = kt0; kt < kt1; ++kt) {",
        f"    fs_cp_async_wait<{stages - 2}>();  // step kt has landed (this thread's copies)",
        "    __syncthreads();  // everyone's copies and stores; the buffer of step kt - 1 is free",
        f"    const long long next = kt + {stages - 1};",
        f"    if (next < kt1) stage(next * {tk}, (int)((next - kt0) % {stages}));",
        "    fs_cp_async_commit();",
        f"    multiply((int)((kt - kt0) % {stages}));",
        "}",
    ]
    each = ["#pragma unroll",
            f"for (int i = 0; i < {fm}; ++i)",
            "    #pragma unroll",
            f"    for (int j = 0; j < {fn}; ++j)",
            "        #pragma unroll",
            "        for (int r = 0; r < 4; ++r)"]
    epilogue = [
        "const int g = lane >> 2, q = lane & 3;",
        *each[:-1],
        "        for (int r = 0; r < 4; ++r) {",
        f"            const int mm = wy * {wm} + i * 16 + g + 8 * (r >> 1), nn = wx * {wn} + j * 8 + 2 * q + (r & 1);",
        "            const long long gm = m0 + mm, gn = n0 + nn;",
        f"            if (gm < {c.m}LL && gn < {c.n}LL) {{",
        "                const float value = acc[i][j][r];",
        *["                " + x for x in parts.epilogue],
        "            }",
        "        }",
    ]
    workspace, tiles = [], math.prod(schedule.grid) // split
    if split > 1:  # serial split-K: every split's partial to the workspace; the last block to arrive sums them
        plane = c.m * c.n  # one split's partial of one of the z outputs: its real rows and columns only
        stride = schedule.grid[2] // split * plane  # one split's partials
        if split * stride >= 2 ** 31:  # the store's indices are ints (one register each)
            raise CodegenRefused(f"split-K workspace of {split * stride} floats: over 2^31, not indexed by an int")
        if 4 * split * stride != schedule.workspace_bytes:
            raise CodegenRefused(f"split-K workspace of {4 * split * stride} bytes, the schedule prices "
                                 f"{schedule.workspace_bytes} (the schedule and the generator disagree)")
        workspace = [f"__device__ float fs_partials[{split * stride}];  // per split, z, row, column: as priced",
                     f"__device__ unsigned fs_arrivals[{tiles}];  // per tile: splits done (0 between launches)"]
        # the lane's accumulators inside the output, at constant offsets from its first element (row0, col0)
        store = [*each[:-1], "        for (int r = 0; r < 4; ++r) {",
                 "            const int dm = i * 16 + 8 * (r >> 1), dn = j * 8 + (r & 1);",
                 f"            if (dm < rows && dn < cols) fs_partials[mine + dm * {c.n} + dn] = acc[i][j][r];",
                 "        }"]
        epilogue = [
            "{",
            f"    const int row0 = (int)m0 + wy * {wm} + (lane >> 2), col0 = (int)n0 + wx * {wn} + 2 * (lane & 3);",
            f"    const int rows = {c.m} - row0, cols = {c.n} - col0;  // of the output, from the lane's first element",
            f"    const int mine = ks * {stride} + (int)gz * {plane} + row0 * {c.n} + col0;  // an index: one register",
            *["    " + x for x in store],
            "    __threadfence();  // the partial is visible device-wide before this block counts itself",
            "    __syncthreads();",
            f"    const bool last = __syncthreads_or(tid == 0 && atomicAdd(&fs_arrivals[tile], 1u) == {split - 1}u);",
            "    if (!last) return;",
            "    __threadfence();",
            "    if (tid == 0) fs_arrivals[tile] = 0u;  // every split has arrived: ready for the next launch",
            "}",
            # the last block sums the tile's elements from the workspace, row-major across its threads
            # (coalesced, its accumulators no longer live), each in split order, and stores them
            f"for (int e = tid; e < {tm * tn}; e += {threads}) {{",
            f"    const long long gm = m0 + e / {tn}, gn = n0 + e % {tn};",
            f"    if (gm < {c.m}LL && gn < {c.n}LL) {{",
            f"        const long long at = gz * {plane}LL + gm * {c.n} + gn;",
            "        float value = 0.0f;",
            "        #pragma unroll",
            f"        for (int o = 0; o < {split}; ++o) value += __ldcg(fs_partials + o * {stride}LL + at);",
            *["        " + x for x in parts.epilogue],
            "    }",
            "}",
        ]
    # the dynamic region without __align__: an aligned extern array rounds the static shared memory of
    # every kernel in the module up to its alignment; it starts at 0 here (this kernel has no static)
    body = [
        "#ifdef FS_EMULATED",
        f"static __align__(128) unsigned char fs_smem[{smem}];",
        "#else",
        f"extern __shared__ unsigned char fs_smem[];  // the launch's dynamic shared memory: {smem} bytes",
        "#endif",
        f"{elem}* const As = reinterpret_cast<{elem}*>(fs_smem);",
        f"{elem}* const Bs = As + {stages * a_stage};",
        f"const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wy = warp / {tn // wn}, wx = warp % {tn // wn};",
        f"const long long m0 = (long long)blockIdx.y * {tm}, n0 = (long long)blockIdx.x * {tn}, "
        f"gz = blockIdx.z / {split};",
        f"const int ks = blockIdx.z % {split};  // this block's share of K",
        *([f"const unsigned tile = blockIdx.x + {schedule.grid[0]}u * (blockIdx.y + {schedule.grid[1]}u * (unsigned)gz);"]
          if split > 1 else []),
        *parts.setup,
        f"float acc[{fm}][{fn}][4];",
        "#pragma unroll",
        f"for (int i = 0; i < {fm}; ++i)",
        "    #pragma unroll",
        f"    for (int j = 0; j < {fn}; ++j)",
        "        #pragma unroll",
        "        for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.0f;",
        *stage_fn,
        *multiply,
        *loop,
        *_side_loops(graph, kernel, args, parts.side),  # every block, before the non-last splits leave
        *epilogue,
    ]
    return (f"{_CU_PRELUDE}{staging_headers(skeleton)}{MMA_SYNC}{''.join(x + chr(10) for x in workspace)}\n"
            f"{cuda_entry(name, ins, outs)} {{\n{_indent(body, 1)}\n}}\n")
