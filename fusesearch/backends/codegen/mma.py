"""The CUDA tensor-core skeleton for gemm/conv (`mma-tf32`, `mma-f16`, `mma-bf16`; sm_80 and later).

Problem: a fused gemm/conv on a GPU should use the tensor cores with its prologue and epilogue
inside the one kernel.
Approach: the anchor as z GEMMs (`contraction`), a BM×BN tile per block of 4 warps (2×2), each warp
a grid of 16×16 `nvcuda::wmma` float accumulators. Per BK step A and B are staged in shared memory
as the fragment type, prologue applied (as `tiled`); plain float loads go by `cp.async` (TF32 only),
and with 2 `stages` the next step is staged during this one. A and B are row- or column-major so
neighbouring threads read neighbouring addresses; `load_matrix_sync` (TF32 rounded by
`__float_to_tf32`), `mma_sync` m16n16k8 (TF32) or m16n16k16 (FP16/BF16). The epilogue stores the
accumulators to shared memory (reusing staging bytes), each thread applies it and does the one store.
Invariants: tile, stages, threads, grid and shared memory are the schedule's (`schedule.mma`,
MMA_THREADS, `mma_smem_bytes`), exactly what the cost model prices; no split-K; the source runs
unchanged in the emulator (FS_EMULATED replaces the cp.async helpers)."""

from __future__ import annotations

import re

from fusesearch.backends.codegen.base import CodegenRefused, _indent, cuda_entry
from fusesearch.backends.codegen.c_prelude import _CU_PRELUDE
from fusesearch.backends.codegen.contraction import tile_parts
from fusesearch.backends.codegen.tiled import _side_loops
from fusesearch.ir.graph import Graph
from fusesearch.lowering import Kernel
from fusesearch.schedule import (
    MMA_ELEMENT_BYTES,
    MMA_SYNC_SKELETONS,
    MMA_THREADS,
    mma_pad,
    mma_smem_bytes,
)

# skeleton → (shared-memory element type, fragment element type, fragment K, float → element)
_PRECISION = {
    "mma-tf32": ("float", "nvcuda::wmma::precision::tf32", 8, "{}"),
    "mma-f16": ("__half", "__half", 16, "__float2half({})"),
    "mma-bf16": ("__nv_bfloat16", "__nv_bfloat16", 16, "__float2bfloat16({})"),
}
_HEADERS = {"mma-tf32": ("mma.h",), "mma-f16": ("mma.h", "cuda_fp16.h"), "mma-bf16": ("mma.h", "cuda_bf16.h")}
# |tensor-core result - float32 reference| / max(1, max |reference|) that counts as equal: the
# operands keep 10 (TF32, FP16) or 7 (BF16) mantissa bits, 2^-11 / 2^-8 relative each; float32
# accumulation adds far less for K <= 4096. Kernels on CUDA cores are held to verify's 1e-4.
TOLERANCE = {"mma-tf32": 2e-3, "mma-f16": 2e-3, "mma-bf16": 1.6e-2}
TOLERANCE |= {sync: TOLERANCE[s] for s, sync in MMA_SYNC_SKELETONS.items()}  # the same operands
WARPS_M, WARPS_N = 2, 2  # MMA_THREADS / 32 warps over the block tile
_CP_ASYNC = """#ifndef FS_EMULATED
__device__ __forceinline__ void fs_cp_async4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\\n" :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src));
}
__device__ __forceinline__ void fs_cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n" :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src));
}
__device__ __forceinline__ void fs_cp_async_commit() { asm volatile("cp.async.commit_group;\\n" ::); }
template <int N> __device__ __forceinline__ void fs_cp_async_wait() { asm volatile("cp.async.wait_group %0;\\n" :: "n"(N)); }
#endif
"""
_WMMA = {**{s: s for s in _PRECISION}, **{sync: s for s, sync in MMA_SYNC_SKELETONS.items()}}  # operand types
_PLAIN_LOAD = re.compile(r"float (v\d+) = (in\d+\[.*\]);")


def staged_element(skeleton: str, lines: list[str], value: str, dst: str) -> list[str]:
    """The statements that put one operand element at `dst` in shared memory (the prologue's
    `lines` and `value` from `tile_parts`): a 4-byte cp.async of a plain float load of a kernel
    input where the operand is staged as float (TF32), else the value converted to the operand
    type and stored."""
    last = _PLAIN_LOAD.fullmatch(lines[-1]) if lines else None
    if MMA_ELEMENT_BYTES[skeleton] == 4 and last and last[1] == value:
        return [*lines[:-1], f"fs_cp_async4(&{dst}, &{last[2]});"]
    return [*lines, f"{dst} = {_PRECISION[_WMMA[skeleton]][3].format(value)};"]


def staging_headers(skeleton: str) -> str:
    """The kernel's includes (the operand types' headers) and the cp.async helpers."""
    return "".join(f"#include <{h}>\n" for h in _HEADERS[_WMMA[skeleton]]) + _CP_ASYNC


def _mma(graph: Graph, kernel: Kernel, name: str, ins, outs, args) -> str:
    """CUDA for a gemm/conv group whose schedule is `mma-*`: its tile, stages, threads and grid as
    the schedule gives them (lowering checked that a tile applies)."""
    schedule = kernel.schedule
    skeleton = schedule.skeleton
    if skeleton not in _PRECISION:
        raise CodegenRefused(f"{skeleton}: not a tensor-core skeleton (the schedule and the generator disagree)")
    tm, tn, tk = schedule.tile
    stages = schedule.stages
    elem, frag_t, k8, convert = _PRECISION[skeleton]
    esize = MMA_ELEMENT_BYTES[skeleton]
    pad = mma_pad(esize)
    wm, wn = tm // WARPS_M, tn // WARPS_N
    fm, fn = wm // 16, wn // 16
    if wm % 16 or wn % 16 or tk % k8:
        raise CodegenRefused(f"tile {schedule.tile} is not a whole number of 16x16x{k8} fragments per warp")
    ldc = tn + mma_pad(4)
    parts = tile_parts(graph, kernel, args, outs, skeleton, f"Cs[mm * {ldc} + nn]")
    c, setup, side = parts.c, parts.setup, parts.side
    a_lines, a_val, b_lines, b_val, epi_lines = parts.a_lines, parts.a_val, parts.b_lines, parts.b_val, parts.epilogue
    a_col, b_col = c.a_m_contiguous, c.b_k_contiguous
    lda = tm + pad if a_col else tk + pad
    ldb = tk + pad if b_col else tn + pad
    a_stage, b_stage = (tm + pad) * (tk + pad), (tk + pad) * (tn + pad)  # as `mma_smem_bytes` counts
    smem = mma_smem_bytes(schedule.tile, stages, esize)

    def staged(lines: list[str], value: str, dst: str) -> list[str]:
        return staged_element(skeleton, lines, value, dst)

    side_lines = _side_loops(graph, kernel, args, side)
    zero = convert.format("0.0f")

    a_dst = f"a_dst[kk * {lda} + mm]" if a_col else f"a_dst[mm * {lda} + kk]"
    b_dst = f"b_dst[nn * {ldb} + kk]" if b_col else f"b_dst[kk * {ldb} + nn]"
    stage_fn = [
        "auto stage = [&](long long k0, int s) {",
        f"    {elem}* a_dst = As + s * {a_stage};",
        f"    {elem}* b_dst = Bs + s * {b_stage};",
        f"    for (int l = tid; l < {tm * tk}; l += {MMA_THREADS}) {{",
        (f"        const int kk = l / {tm}, mm = l % {tm};" if a_col else
         f"        const int mm = l / {tk}, kk = l % {tk};"),
        "        const long long gm = m0 + mm, gk = k0 + kk;",
        f"        if (gm < {c.m}LL && gk < {c.k}LL) {{",
        *["            " + x for x in staged(a_lines, a_val, a_dst)],
        f"        }} else {a_dst} = {zero};",
        "    }",
        f"    for (int l = tid; l < {tk * tn}; l += {MMA_THREADS}) {{",
        (f"        const int nn = l / {tk}, kk = l % {tk};" if b_col else
         f"        const int kk = l / {tn}, nn = l % {tn};"),
        "        const long long gk = k0 + kk, gn = n0 + nn;",
        f"        if (gk < {c.k}LL && gn < {c.n}LL) {{",
        *["            " + x for x in staged(b_lines, b_val, b_dst)],
        f"        }} else {b_dst} = {zero};",
        "    }",
        "    fs_cp_async_commit();",
        "};",
    ]
    a_layout = "nvcuda::wmma::col_major" if a_col else "nvcuda::wmma::row_major"
    b_layout = "nvcuda::wmma::col_major" if b_col else "nvcuda::wmma::row_major"
    a_at = f"a_s + kk * {lda} + (wm * {wm} + i * 16)" if a_col else f"a_s + (wm * {wm} + i * 16) * {lda} + kk"
    b_at = f"b_s + (wn * {wn} + j * 16) * {ldb} + kk" if b_col else f"b_s + kk * {ldb} + (wn * {wn} + j * 16)"
    tf32 = skeleton == "mma-tf32"
    multiply = [
        "auto multiply = [&](int s) {",
        f"    const {elem}* a_s = As + s * {a_stage};",
        f"    const {elem}* b_s = Bs + s * {b_stage};",
        "    #pragma unroll",
        f"    for (int kk = 0; kk < {tk}; kk += {k8}) {{",
        f"        nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, {k8}, {frag_t}, {a_layout}> a[{fm}];",
        f"        nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, {k8}, {frag_t}, {b_layout}> b[{fn}];",
        "        #pragma unroll",
        f"        for (int i = 0; i < {fm}; ++i) {{",
        f"            nvcuda::wmma::load_matrix_sync(a[i], {a_at}, {lda});",
        *(["            #pragma unroll",
           "            for (int t = 0; t < a[i].num_elements; ++t) a[i].x[t] = nvcuda::wmma::__float_to_tf32(a[i].x[t]);"]
          if tf32 else []),
        "        }",
        "        #pragma unroll",
        f"        for (int j = 0; j < {fn}; ++j) {{",
        f"            nvcuda::wmma::load_matrix_sync(b[j], {b_at}, {ldb});",
        *(["            #pragma unroll",
           "            for (int t = 0; t < b[j].num_elements; ++t) b[j].x[t] = nvcuda::wmma::__float_to_tf32(b[j].x[t]);"]
          if tf32 else []),
        "        }",
        "        #pragma unroll",
        f"        for (int i = 0; i < {fm}; ++i)",
        "            #pragma unroll",
        f"            for (int j = 0; j < {fn}; ++j) nvcuda::wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);",
        "    }",
        "};",
    ]
    steps = f"{-(-c.k // tk)}LL"
    if stages == 2:
        loop = [
            "stage(0, 0);",
            f"for (long long kt = 0; kt < {steps}; ++kt) {{",
            f"    if (kt + 1 < {steps}) {{",
            f"        stage((kt + 1) * {tk}, (int)((kt + 1) & 1));",
            "        fs_cp_async_wait<1>();",
            "    } else {",
            "        fs_cp_async_wait<0>();",
            "    }",
            "    __syncthreads();",
            "    multiply((int)(kt & 1));",
            "    __syncthreads();",
            "}",
        ]
    else:
        loop = [
            f"for (long long kt = 0; kt < {steps}; ++kt) {{",
            f"    stage(kt * {tk}, 0);",
            "    fs_cp_async_wait<0>();",
            "    __syncthreads();",
            "    multiply(0);",
            "    __syncthreads();",
            "}",
        ]
    body = [
        f"__shared__ __align__(128) unsigned char fs_smem[{smem}];",
        f"{elem}* const As = reinterpret_cast<{elem}*>(fs_smem);",
        f"{elem}* const Bs = As + {stages * a_stage};",
        "float* const Cs = reinterpret_cast<float*>(fs_smem);  // after the main loop",
        f"const int tid = threadIdx.x, warp = tid / 32, wm = warp / {WARPS_N}, wn = warp % {WARPS_N};",
        f"const long long m0 = (long long)blockIdx.y * {tm}, n0 = (long long)blockIdx.x * {tn}, gz = blockIdx.z;",
        *setup,
        f"nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, {k8}, float> acc[{fm}][{fn}];",
        "#pragma unroll",
        f"for (int i = 0; i < {fm}; ++i)",
        "    #pragma unroll",
        f"    for (int j = 0; j < {fn}; ++j) nvcuda::wmma::fill_fragment(acc[i][j], 0.0f);",
        *stage_fn,
        *multiply,
        *loop,
        "#pragma unroll",
        f"for (int i = 0; i < {fm}; ++i)",
        "    #pragma unroll",
        f"    for (int j = 0; j < {fn}; ++j)",
        f"        nvcuda::wmma::store_matrix_sync(Cs + (wm * {wm} + i * 16) * {ldc} + wn * {wn} + j * 16, acc[i][j], "
        f"{ldc}, nvcuda::wmma::mem_row_major);",
        "__syncthreads();",
        f"for (int l = tid; l < {tm * tn}; l += {MMA_THREADS}) {{",
        f"    const int mm = l / {tn}, nn = l % {tn};",
        "    const long long gm = m0 + mm, gn = n0 + nn;",
        f"    if (gm < {c.m}LL && gn < {c.n}LL) {{",
        *["        " + x for x in epi_lines],
        "    }",
        "}",
        *side_lines,
    ]
    src = f"{_CU_PRELUDE}{staging_headers(skeleton)}\n{cuda_entry(name, ins, outs)} {{\n{_indent(body, 1)}\n}}\n"
    return src
