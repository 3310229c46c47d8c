"""`mma.sync` and `ldmatrix` (`codegen.ptx`) in hand-written warp tiles: emulated (`backends.emulate`:
each lane's registers in the PTX ISA's per-lane layout, gathered by a warp-collective operation)
they equal a plain numpy matmul of the operands rounded as the hardware rounds them, and the same
source compiles with NVRTC for sm_80 and sm_90 without spills.

The tiles: two warps, each a 16x16 slice of D = A(32xK) B(Kx16) as two m16n8 accumulators, K in
steps of the instruction's K. A and B are staged in shared memory (converted from float32 to the
operand type); TF32 fragments are plain shared-memory loads rounded with `fs_tf32` (ldmatrix moves
b16 only); FP16 reads A with one ldmatrix.x4 and B (K x N, N contiguous) with ldmatrix.x2.trans;
BF16 reads A with four ldmatrix.x1 and B stored transposed (N x K) with one ldmatrix.x4 for both
accumulators."""

from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

from fusesearch.backends import emulate
from fusesearch.backends.codegen.base import Arg, GeneratedKernel
from fusesearch.backends.codegen.ptx import MMA_SYNC
from fusesearch.errors import FusesearchError
from tests.backends.test_cuda_emulated import tf32

pytestmark = pytest.mark.skipif(not emulate.available(), reason="no C++ compiler")

M, N, K = 32, 16, 32
_TILE = r"""#include <cuda_fp16.h>
#include <cuda_bf16.h>
{ptx}
extern "C" __global__ void __launch_bounds__(64) k(const float* __restrict__ in0, const float* __restrict__ in1,
                                                   float* __restrict__ out0) {{
    __shared__ __align__(16) {elem} As[{M} * {lda}];
    __shared__ __align__(16) {elem} Bs[{b_elems}];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4, m0 = warp * 16;
    for (int l = tid; l < {M} * {K}; l += 64) As[(l / {K}) * {lda} + l % {K}] = {convert}(in0[l]);
    for (int l = tid; l < {K} * {N}; l += 64) {{
        const int kk = l / {N}, nn = l % {N};
        Bs[{b_at}] = {convert}(in1[l]);
    }}
    __syncthreads();
    float acc[2][4] = {{}};
    for (int k0 = 0; k0 < {K}; k0 += {ks}) {{
        unsigned a[4], b[2][2];
{load}
        #pragma unroll
        for (int j = 0; j < 2; ++j) fs_mma_{shape}(acc[j], a, b[j], acc[j]);
    }}
    #pragma unroll
    for (int j = 0; j < 2; ++j)
        #pragma unroll
        for (int i = 0; i < 4; ++i) out0[(m0 + g + 8 * (i >> 1)) * {N} + j * 8 + 2 * q + (i & 1)] = acc[j][i];
}}
"""
# kind -> (element, convert, instruction, K step, A row pitch, B's layout (index, elements), fragment loads)
_KINDS = {
    "tf32": ("float", "", "m16n8k8_tf32", 8, K + 4, ("kk * 20 + nn", K * 20), """\
        #pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = fs_tf32(As[(m0 + g + 8 * (i & 1)) * 36 + k0 + q + 4 * (i >> 1)]);
        #pragma unroll
        for (int j = 0; j < 2; ++j)
            #pragma unroll
            for (int i = 0; i < 2; ++i) b[j][i] = fs_tf32(Bs[(k0 + q + 4 * i) * 20 + j * 8 + g]);"""),
    "f16": ("__half", "__float2half", "m16n8k16_f16", 16, K + 8, ("kk * 24 + nn", K * 24), """\
        fs_ldmatrix_x4(a, &As[(m0 + lane % 16) * 40 + k0 + 8 * (lane / 16)]);
        #pragma unroll
        for (int j = 0; j < 2; ++j) fs_ldmatrix_x2_trans(b[j], &Bs[(k0 + lane % 16) * 24 + j * 8]);"""),
    "bf16": ("__nv_bfloat16", "__float2bfloat16", "m16n8k16_bf16", 16, K + 8, ("nn * 40 + kk", N * 40), """\
        #pragma unroll
        for (int i = 0; i < 4; ++i) fs_ldmatrix_x1(&a[i], &As[(m0 + 8 * (i & 1) + lane % 8) * 40 + k0 + 8 * (i >> 1)]);
        fs_ldmatrix_x4(&b[0][0], &Bs[((lane / 16) * 8 + lane % 8) * 40 + k0 + 8 * ((lane / 8) % 2)]);"""),
}


def tile_kernel(kind: str) -> GeneratedKernel:
    elem, convert, shape, ks, lda, (b_at, b_elems), load = _KINDS[kind]
    src = _TILE.format(ptx=MMA_SYNC, elem=elem, M=M, N=N, K=K, lda=lda, b_elems=b_elems, b_at=b_at, convert=convert,
                       ks=ks, load=load, shape=shape)
    return GeneratedKernel(name="k", template="gemm", inputs=(Arg("in0", "a", (M, K), "float32"), Arg("in1", "b", (K, N), "float32")),
                           outputs=(Arg("out0", "d", (M, N), "float32"),), c_source="", cuda_source=src,
                           grid=(1, 1, 1), block=(64, 1, 1), skeleton="hand")


def tile_smem_bytes(kind: str) -> int:
    elem, _, _, _, lda, (_, b_elems), _ = _KINDS[kind]
    return (M * lda + b_elems) * (4 if elem == "float" else 2)


ROUND = {"tf32": tf32, "f16": lambda x: x.astype(np.float16), "bf16": lambda x: x.astype(ml_dtypes.bfloat16)}


@pytest.mark.parametrize("kind", list(_KINDS))
def test_mma_sync_tile_equals_numpy_matmul_of_rounded_operands(kind):
    """D of every lane's accumulators, stored by the C/D layout, equals A @ B in float64 of the
    operands rounded as the hardware rounds them (within float32 accumulation), and differs from
    the unrounded product by more: the fragments' layouts and the rounding are both right."""
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)
    d = emulate.run(tile_kernel(kind), {"a": a, "b": b})["d"].astype(np.float64)
    rnd = ROUND[kind]
    rounded = rnd(a).astype(np.float64) @ rnd(b).astype(np.float64)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(exact).max()
    assert np.abs(d - rounded).max() <= 1e-5 * scale < np.abs(exact - rounded).max()


_LDMATRIX = r"""#include <cuda_fp16.h>
{ptx}
extern "C" __global__ void k(const float* __restrict__ in0, float* __restrict__ out0) {{
    __shared__ __align__(16) __half X[16 * 24];
    const int lane = threadIdx.x;
    for (int l = lane; l < 256; l += 32) X[(l / 16) * 24 + l % 16] = __float2half(in0[l]);
    __syncthreads();
    unsigned r[4] = {{0u, 0u, 0u, 0u}};
    fs_ldmatrix_x{n}{suffix}(r, &X[(lane % 16) * 24 + 8 * (lane / 16) + {offset}]);
    #pragma unroll
    for (int j = 0; j < 4; ++j) {{
        __half lo, hi;
        memcpy(&lo, &r[j], 2);
        memcpy(&hi, reinterpret_cast<const char*>(&r[j]) + 2, 2);
        out0[lane * 8 + 2 * j] = j < {n} ? __half2float(lo) : -1.0f;
        out0[lane * 8 + 2 * j + 1] = j < {n} ? __half2float(hi) : -1.0f;
    }}
}}
"""


def ldmatrix_kernel(n: int, trans: bool, offset: int = 0) -> GeneratedKernel:
    """Lane l gives the address of row l % 16, column 8 (l / 16) of a 16x16 half matrix X, so
    matrix j is X's 8x8 block (j % 2, j / 2); each lane writes its n registers as half pairs."""
    src = _LDMATRIX.format(ptx=MMA_SYNC, n=n, suffix="_trans" if trans else "", offset=offset)
    return GeneratedKernel(name="k", template="pointwise", inputs=(Arg("in0", "x", (16, 16), "float32"),),
                           outputs=(Arg("out0", "y", (32, 8), "float32"),), c_source="", cuda_source=src,
                           grid=(1, 1, 1), block=(32, 1, 1), skeleton="hand")


def ldmatrix_expected(x: np.ndarray, n: int, trans: bool) -> np.ndarray:
    """The PTX ISA's ldmatrix: lanes 8j .. 8j+7 give matrix j's rows; lane l receives in r[j]
    M_j[l / 4][2 (l % 4) + h] (h = 0 the low half), transposed M_j[2 (l % 4) + h][l / 4]."""
    def row(lane: int) -> np.ndarray:  # the 8 elements at lane's address
        return x[lane % 16, 8 * (lane // 16):8 * (lane // 16) + 8]

    out = np.full((32, 8), -1.0, np.float32)
    for lane in range(32):
        g, q = lane // 4, lane % 4
        for j in range(n):
            for h in range(2):
                out[lane, 2 * j + h] = row(8 * j + 2 * q + h)[g] if trans else row(8 * j + g)[2 * q + h]
    return out


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True], ids=["plain", "trans"])
def test_ldmatrix_gives_each_lane_the_ptx_layout(n, trans):
    x = np.arange(256, dtype=np.float32).reshape(16, 16)  # exact in half, every element distinct
    y = emulate.run(ldmatrix_kernel(n, trans), {"x": x})["y"]
    np.testing.assert_array_equal(y, ldmatrix_expected(x, n, trans))


def test_misaligned_ldmatrix_row_fails_the_launch():
    """A row address off a 16-byte boundary faults on the GPU; emulated, the launch fails saying so."""
    with pytest.raises(FusesearchError, match="not 16-byte aligned"):
        emulate.run(ldmatrix_kernel(4, False, offset=1), {"x": np.zeros((16, 16), np.float32)})


def test_mma_sync_skipped_by_some_lanes_fails_the_launch():
    """mma.sync is warp-collective: lanes that skip it leave the others at a barrier that never completes."""
    tile = tile_kernel("tf32")
    kernel = replace(tile, cuda_source=tile.cuda_source.replace(") fs_mma_", ") if (lane < 16) fs_mma_"))
    assert kernel.cuda_source != tile.cuda_source
    with pytest.raises(FusesearchError, match="never reached by all its threads"):
        emulate.run(kernel, {"a": np.zeros((M, K), np.float32), "b": np.zeros((K, N), np.float32)})


def test_the_tiles_compile_for_sm80_and_sm90_without_spills():
    """The same sources as the GPU would load them: every instruction and variant assembles, no
    spills, and the static shared memory is the tile's."""
    nvrtc = pytest.importorskip("fusesearch.backends.nvrtc")
    if not nvrtc.toolchain_available():
        pytest.skip("no CUDA compiler (NVRTC or nvcc)")
    kernels = {kind: (tile_kernel(kind).cuda_source, tile_smem_bytes(kind)) for kind in _KINDS}
    kernels |= {f"ldmatrix-x{n}{'-trans' if t else ''}": (ldmatrix_kernel(n, t).cuda_source, 16 * 24 * 2)
                for n in (1, 2, 4) for t in (False, True)}
    for arch in nvrtc.ARCHES:
        for what, (source, smem) in kernels.items():
            res = nvrtc.compile_cuda(source, arch=arch).resource("k")
            assert res.registers > 0 and res.spill_store_bytes == res.spill_load_bytes == 0, (what, arch, res)
            assert res.smem_bytes == smem, (what, arch, res)
