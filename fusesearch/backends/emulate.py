"""Run a generated CUDA kernel's own source on the CPU, every CUDA thread a coroutine.

Problem: the CUDA skeletons (tiles, barriers, shuffles, tensor-core fragments) are what the C
backend never exercises, and most machines that test this project have no GPU.
Approach: compile the unchanged `cuda_source` as C++ behind a header giving CUDA names a host
meaning; launch with the GPU's grid and block (`GeneratedKernel.grid`/`.block`). Blocks run in
turn, threads are ucontext coroutines switched at barriers; `__shared__` and `__device__` are
statics, atomics plain, fences no-ops; shuffles, `mma.sync` and `ldmatrix` (`codegen.ptx`) are
warp-collective through per-warp slots in the PTX per-lane layout; wmma fragments warp-replicated,
operands rounded as tensor cores read them; cp.async a copy. Correct, useless for timing.
`module` builds the CUDA program's one module; `HostDevice` is `run.CudaProgram`'s device on host
memory, with `cupy.Device`'s methods.
Invariants: the source is compiled byte for byte as sent to NVRTC (header prepended, launchers
appended); a barrier some thread never reaches fails the launch instead of hanging; an ldmatrix
row address off a 16-byte boundary fails it; inputs are never written."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

from fusesearch.backends.codegen import NP_DTYPES, GeneratedKernel, cuda_module, module_namespace
from fusesearch.backends.codegen.base import require_cuda
from fusesearch.errors import FusesearchError
from fusesearch.groups import FusionDecision

CXXFLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-w")

_HEADER = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <ucontext.h>
#include <sys/mman.h>
#include <type_traits>
struct dim3 { unsigned x, y, z; };
struct float4 { float x, y, z, w; } __attribute__((aligned(16)));
struct float2 { float x, y; } __attribute__((aligned(8)));
static dim3 threadIdx, blockIdx;  // the running thread's (set by the scheduler on every switch)
static dim3 blockDim, gridDim;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static
#define __launch_bounds__(...)
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
template <class T> static inline T __ldg(const T* p) { return *p; }
#define FS_HOST_HALF  /* float16 conversions on the host (the kernel's own use cvt PTX) */
static inline float fs_float16_load(unsigned short x) { _Float16 h; memcpy(&h, &x, 2); return (float)h; }
static inline unsigned short fs_float16_store(float x) { _Float16 h = (_Float16)x; unsigned short u; memcpy(&u, &h, 2); return u; }
static inline float4 make_float4(float x, float y, float z, float w) { float4 v = {x, y, z, w}; return v; }

// The threads of a block are coroutines (ucontext) on one host thread: a thread runs until it
// waits at a barrier or ends, then the scheduler runs the next runnable one. A barrier releases
// its waiters when the last of its `count` threads arrives; when no thread can run and some have
// not ended, a barrier can never complete (a thread skipped it): the launch fails.
enum { FS_MAX_THREADS = 1024, FS_STACK = 256 * 1024 };
struct fs_barrier { unsigned count, waiting; unsigned waiters[FS_MAX_THREADS]; };
static fs_barrier fs_block;
static fs_barrier fs_warps[FS_MAX_THREADS / 32];
static float fs_slots[FS_MAX_THREADS];
static ucontext_t fs_sched, fs_ctx[FS_MAX_THREADS];
static unsigned fs_cur, fs_queue[FS_MAX_THREADS], fs_head, fs_tail, fs_ended;
static char* fs_stacks;
static bool fs_misaligned;  // a lane gave ldmatrix a row address, or a 16-byte cp.async an address, not 16-byte aligned
static void fs_barrier_init(fs_barrier* b, unsigned count) { b->count = count; b->waiting = 0; }
static inline void fs_ready(unsigned t) { fs_queue[fs_tail++ % FS_MAX_THREADS] = t; }
static void fs_wait(fs_barrier* b) {
    if (++b->waiting == b->count) {  // the last to arrive releases the others and goes on
        for (unsigned i = 0; i + 1 < b->count; ++i) fs_ready(b->waiters[i]);
        b->waiting = 0;
        return;
    }
    b->waiters[b->waiting - 1] = fs_cur;
    swapcontext(&fs_ctx[fs_cur], &fs_sched);
}
static void (*fs_body)(void);
static void fs_entry(void) {
    fs_body();
    fs_wait(&fs_block);  // the end of the block is a barrier of all its threads
    ++fs_ended;
}
static int fs_run(void (*body)(void), unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz) {
    unsigned n = bx * by * bz;
    if (n == 0 || n > FS_MAX_THREADS || n % 32 != 0) return -1;
    if (!fs_stacks) {
        void* p = mmap(0, (size_t)FS_MAX_THREADS * FS_STACK, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) return -3;
        fs_stacks = (char*)p;
    }
    fs_misaligned = false;
    gridDim.x = gx; gridDim.y = gy; gridDim.z = gz; blockDim.x = bx; blockDim.y = by; blockDim.z = bz;
    fs_body = body;
    fs_barrier_init(&fs_block, n);
    for (unsigned w = 0; w < n / 32; ++w) fs_barrier_init(&fs_warps[w], 32);
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                blockIdx.x = x; blockIdx.y = y; blockIdx.z = z;
                fs_head = fs_tail = fs_ended = 0;
                for (unsigned t = 0; t < n; ++t) {
                    getcontext(&fs_ctx[t]);
                    fs_ctx[t].uc_stack.ss_sp = fs_stacks + (size_t)t * FS_STACK;
                    fs_ctx[t].uc_stack.ss_size = FS_STACK;
                    fs_ctx[t].uc_link = &fs_sched;
                    makecontext(&fs_ctx[t], fs_entry, 0);
                    fs_ready(t);
                }
                while (fs_head != fs_tail) {
                    unsigned t = fs_queue[fs_head++ % FS_MAX_THREADS];
                    fs_cur = t;
                    threadIdx.x = t % bx; threadIdx.y = (t / bx) % by; threadIdx.z = t / (bx * by);
                    swapcontext(&fs_sched, &fs_ctx[t]);
                }
                if (fs_misaligned) return -4;  // a GPU faults on it
                if (fs_ended != n) return -2;  // some barrier can never complete
            }
    return 0;
}
static inline unsigned fs_tid() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
static inline void __syncthreads() { fs_wait(&fs_block); }
static int fs_votes[FS_MAX_THREADS];
static inline int __syncthreads_or(int v) {  // a barrier that also ORs every thread's vote
    const unsigned t = fs_tid(), n = blockDim.x * blockDim.y * blockDim.z;
    fs_votes[t] = v != 0;
    fs_wait(&fs_block);
    int any = 0;
    for (unsigned i = 0; i < n; ++i) any |= fs_votes[i];
    fs_wait(&fs_block);
    return any;
}
static inline void __threadfence() {}  // one host thread: every write is already visible
static inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned old = *p; *p = old + v; return old; }
template <class T> static inline T __ldcg(const T* p) { return *p; }
static inline void __syncwarp(unsigned mask = 0xffffffffu) { (void)mask; fs_wait(&fs_warps[fs_tid() >> 5]); }
static inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask) {
    (void)mask;
    unsigned t = fs_tid();
    fs_slots[t] = v;
    fs_wait(&fs_warps[t >> 5]);
    float r = fs_slots[t ^ (unsigned)lane_mask];
    fs_wait(&fs_warps[t >> 5]);
    return r;
}
static inline float __shfl_down_sync(unsigned mask, float v, unsigned delta) {
    (void)mask;
    unsigned t = fs_tid();
    fs_slots[t] = v;
    fs_wait(&fs_warps[t >> 5]);
    unsigned lane = t & 31u;
    float r = lane + delta < 32u ? fs_slots[t + delta] : v;
    fs_wait(&fs_warps[t >> 5]);
    return r;
}

// Tensor cores (the `mma-*` skeletons). A wmma fragment is warp-wide: here every lane holds the
// whole tile (row-major in x[], num_elements = rows x cols), load_matrix_sync reads all of it on
// every lane, mma_sync computes the whole 16x16 product on every lane (float accumulate, the
// operands as the tensor core reads them: TF32 keeps 10 mantissa bits, half / bfloat16 exact),
// and store_matrix_sync writes it from lane 0; mma_sync and store_matrix_sync first wait on a
// warp barrier, so a lane that skips a collective op fails the launch as a divergent barrier.
// cp.async is a synchronous 4-byte copy (commit and wait are no-ops).
#define FS_EMULATED 1
#define __align__(n) __attribute__((aligned(n)))
struct __half { unsigned short x; };
struct __nv_bfloat16 { unsigned short x; };
static inline __half __float2half(float f) {
    _Float16 h = (_Float16)f; __half r; memcpy(&r.x, &h, 2); return r;  // round to nearest even
}
static inline float __half2float(__half h) { _Float16 v; memcpy(&v, &h.x, 2); return (float)v; }
static inline __nv_bfloat16 __float2bfloat16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    __nv_bfloat16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) { r.x = (unsigned short)((u >> 16) | 0x40u); return r; }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    r.x = (unsigned short)(u >> 16);
    return r;
}
static inline float __bfloat162float(__nv_bfloat16 b) { uint32_t u = (uint32_t)b.x << 16; float f; memcpy(&f, &u, 4); return f; }
static inline float fs_to_float(float v) { return v; }
static inline float fs_to_float(__half v) { return __half2float(v); }
static inline float fs_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
static inline void fs_cp_async4(void* dst, const void* src) { memcpy(dst, src, 4); }
static inline void fs_cp_async16(void* dst, const void* src) {  // both 16-byte aligned, as the GPU needs
    if ((uintptr_t)dst % 16 || (uintptr_t)src % 16) fs_misaligned = true;
    memcpy(dst, src, 16);
}
static inline void fs_cp_async_commit() {}
template <int N> static inline void fs_cp_async_wait() {}
static inline void fs_warp_collective() { fs_wait(&fs_warps[fs_tid() >> 5]); }
namespace nvcuda { namespace wmma {
struct matrix_a {}; struct matrix_b {}; struct accumulator {};
struct row_major {}; struct col_major {};
namespace precision { struct tf32 {}; }
enum layout_t { mem_row_major, mem_col_major };
template <class T> struct fs_element { typedef T type; };
template <> struct fs_element<precision::tf32> { typedef float type; };
template <class Use, int M, int N, int K, class T, class Layout = void> struct fragment {
    enum { rows = std::is_same<Use, matrix_b>::value ? K : M, cols = std::is_same<Use, matrix_a>::value ? K : N };
    enum { num_elements = rows * cols };
    typedef typename fs_element<T>::type element_type;
    element_type x[rows * cols];
};
static inline float __float_to_tf32(float f) {  // round to nearest (ties away), 10 mantissa bits
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
    memcpy(&f, &u, 4); return f;
}
template <class T> static inline float fs_operand(T v) { return fs_to_float(v); }
static inline float fs_operand_tf32(float v) {  // the tensor core reads a TF32 operand's top 19 bits
    uint32_t u; memcpy(&u, &v, 4); u &= 0xffffe000u; memcpy(&v, &u, 4); return v;
}
template <class Use, int M, int N, int K, class T, class L, class P>
static inline void load_matrix_sync(fragment<Use, M, N, K, T, L>& f, const P* p, unsigned ldm) {
    typedef fragment<Use, M, N, K, T, L> F;
    for (int r = 0; r < F::rows; ++r)
        for (int c = 0; c < F::cols; ++c)
            f.x[r * F::cols + c] = std::is_same<L, col_major>::value ? p[(size_t)c * ldm + r] : p[(size_t)r * ldm + c];
}
template <int M, int N, int K, class T>
static inline void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm, layout_t layout) {
    fs_warp_collective();
    if ((fs_tid() & 31u) == 0)
        for (int r = 0; r < M; ++r)
            for (int c = 0; c < N; ++c)
                p[layout == mem_row_major ? (size_t)r * ldm + c : (size_t)c * ldm + r] = f.x[r * N + c];
}
template <class Use, int M, int N, int K, class T, class L>
static inline void fill_fragment(fragment<Use, M, N, K, T, L>& f, typename fragment<Use, M, N, K, T, L>::element_type v) {
    for (int i = 0; i < fragment<Use, M, N, K, T, L>::num_elements; ++i) f.x[i] = v;
}
template <int M, int N, int K, class T, class LA, class LB>
static inline void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, T, LA>& a,
                            const fragment<matrix_b, M, N, K, T, LB>& b, const fragment<accumulator, M, N, K, float>& c) {

    const bool tf32 = std::is_same<T, precision::tf32>::value;
    float x[M * K], y[K * N], out[M * N];  // the operands as the tensor core reads them
    for (int i = 0; i < M * K; ++i) x[i] = tf32 ? fs_operand_tf32(fs_operand(a.x[i])) : fs_operand(a.x[i]);
    for (int i = 0; i < K * N; ++i) y[i] = tf32 ? fs_operand_tf32(fs_operand(b.x[i])) : fs_operand(b.x[i]);
    for (int i = 0; i < M; ++i) {
        for (int j = 0; j < N; ++j) out[i * N + j] = c.x[i * N + j];
        for (int k = 0; k < K; ++k)
            for (int j = 0; j < N; ++j) out[i * N + j] += x[i * K + k] * y[k * N + j];
    }
    for (int i = 0; i < M * N; ++i) d.x[i] = out[i];
}
} }

// mma.sync and ldmatrix (`codegen.ptx`: the GPU's inline PTX) as warp-collective operations: each
// lane publishes its registers (or its row address), a warp barrier, each lane reads what the
// instruction gives it in the PTX ISA's per-lane layout (g = lane >> 2, t = lane % 4), a second
// warp barrier before the published values may change. mma gathers the warp's A and B from every
// lane's fragments, with the operands as the tensor core reads them (a TF32 operand's top 19 bits,
// half / bfloat16 exact), and each lane computes its own four accumulators in float, in K order.
// An ldmatrix row address that is not 16-byte aligned (a GPU's misaligned-address fault) fails
// the launch.
static unsigned fs_lane_words[FS_MAX_THREADS][6];
static const void* fs_lane_rows[FS_MAX_THREADS];
static inline unsigned fs_tf32(float x) { return (unsigned)__float_as_int(nvcuda::wmma::__float_to_tf32(x)); }
enum fs_operand_kind { FS_TF32, FS_F16, FS_BF16 };
static inline float fs_mma_element(unsigned word, int half, fs_operand_kind kind) {
    if (kind == FS_TF32) return nvcuda::wmma::fs_operand_tf32(__int_as_float((int)word));
    unsigned short h = (unsigned short)(word >> (16 * half));
    return kind == FS_F16 ? fs_float16_load(h) : __int_as_float((int)((unsigned)h << 16));
}
template <int K, fs_operand_kind KIND>
static inline void fs_mma_m16n8(float* d, const unsigned* a, const unsigned* b, const float* c) {
    enum { E = K / 8 };  // elements per register: 1 (TF32), 2 (b16 pairs)
    const unsigned t = fs_tid(), w0 = t & ~31u, lane = t & 31u;
    for (int i = 0; i < 4; ++i) fs_lane_words[t][i] = a[i];
    fs_lane_words[t][4] = b[0]; fs_lane_words[t][5] = b[1];
    fs_wait(&fs_warps[t >> 5]);
    float A[16][K], B[K][8];
    for (unsigned l = 0; l < 32; ++l) {
        const unsigned g = l >> 2, q = l & 3u;
        const unsigned* w = fs_lane_words[w0 + l];
        for (int i = 0; i < 4; ++i)  // a[i]: rows +8 for odd i, columns +K/2 from i = 2
            for (int h = 0; h < E; ++h) A[g + 8 * (i & 1)][E * q + h + K / 2 * (i >> 1)] = fs_mma_element(w[i], h, KIND);
        for (int i = 0; i < 2; ++i)  // b[i]: rows (K) +K/2 for i = 1
            for (int h = 0; h < E; ++h) B[E * q + h + K / 2 * i][g] = fs_mma_element(w[4 + i], h, KIND);
    }
    float out[4];
    for (int i = 0; i < 4; ++i) {  // c[i], d[i]: row g (+8 from i = 2), column 2t + (i & 1)
        const unsigned row = (lane >> 2) + 8 * (i >> 1), col = 2 * (lane & 3u) + (i & 1);
        float s = c[i];
        for (int k = 0; k < K; ++k) s += A[row][k] * B[k][col];
        out[i] = s;
    }
    for (int i = 0; i < 4; ++i) d[i] = out[i];
    fs_wait(&fs_warps[t >> 5]);
}
static inline void fs_mma_m16n8k8_tf32(float* d, const unsigned* a, const unsigned* b, const float* c) { fs_mma_m16n8<8, FS_TF32>(d, a, b, c); }
static inline void fs_mma_m16n8k16_f16(float* d, const unsigned* a, const unsigned* b, const float* c) { fs_mma_m16n8<16, FS_F16>(d, a, b, c); }
static inline void fs_mma_m16n8k16_bf16(float* d, const unsigned* a, const unsigned* b, const float* c) { fs_mma_m16n8<16, FS_BF16>(d, a, b, c); }
template <int N, bool TRANS>
static inline void fs_ldmatrix(unsigned* r, const void* p) {
    const unsigned t = fs_tid(), w0 = t & ~31u, lane = t & 31u, g = lane >> 2, q = lane & 3u;
    if ((uintptr_t)p % 16) fs_misaligned = true;
    fs_lane_rows[t] = p;
    fs_wait(&fs_warps[t >> 5]);
    for (int j = 0; j < N; ++j) {  // matrix j's rows: the addresses of lanes 8j .. 8j + 7
        const unsigned short* const* rows = (const unsigned short* const*)&fs_lane_rows[w0 + 8 * j];
        unsigned lo = TRANS ? rows[2 * q][g] : rows[g][2 * q], hi = TRANS ? rows[2 * q + 1][g] : rows[g][2 * q + 1];
        r[j] = lo | hi << 16;
    }
    fs_wait(&fs_warps[t >> 5]);
}
static inline void fs_ldmatrix_x1(unsigned* r, const void* p) { fs_ldmatrix<1, false>(r, p); }
static inline void fs_ldmatrix_x2(unsigned* r, const void* p) { fs_ldmatrix<2, false>(r, p); }
static inline void fs_ldmatrix_x4(unsigned* r, const void* p) { fs_ldmatrix<4, false>(r, p); }
static inline void fs_ldmatrix_x1_trans(unsigned* r, const void* p) { fs_ldmatrix<1, true>(r, p); }
static inline void fs_ldmatrix_x2_trans(unsigned* r, const void* p) { fs_ldmatrix<2, true>(r, p); }
static inline void fs_ldmatrix_x4_trans(unsigned* r, const void* p) { fs_ldmatrix<4, true>(r, p); }
"""

_LAUNCHER = r"""
static void* fs_args[{nargs}];
static void fs_thread(void) {{ {call} }}
extern "C" int fs_launch(void** args, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz) {{
    for (int i = 0; i < {nargs}; ++i) fs_args[i] = args[i];
    return fs_run(fs_thread, gx, gy, gz, bx, by, bz);
}}
"""


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def available() -> FusionDecision:
    if compiler() is None:
        return FusionDecision.refuse("no C++ compiler found (install g++ or set CXX)")
    return FusionDecision.accept(compiler())


def source(kernel: GeneratedKernel) -> str:
    """The translation unit: header, the kernel's CUDA source unchanged, then the launcher."""
    params = [*kernel.inputs, *kernel.outputs]
    casts = ", ".join(f"({'const ' if k < len(kernel.inputs) else ''}{a.ctype}*)fs_args[{k}]"
                      for k, a in enumerate(params))
    return (_HEADER + "\n" + require_cuda(kernel) + "\n"
            + _LAUNCHER.format(nargs=max(1, len(params)), call=f"{kernel.name}({casts});"))


STUB_HEADERS = ("mma.h", "cuda_fp16.h", "cuda_bf16.h")  # what the header above defines


def _stub_headers(tmp: Path) -> Path:
    """A folder of empty CUDA headers, so the kernel's own `#include <mma.h>` lines compile."""
    folder = tmp / "include"
    folder.mkdir(exist_ok=True)
    for name in STUB_HEADERS:
        (folder / name).write_text("/* defined by the emulator's header */\n")
    return folder


@lru_cache(maxsize=256)
def _load(text: str, entries: int = 0) -> ctypes.CDLL:
    """The compiled text (cached by hash); its launchers: `fs_launch`, or `fs_launch_0` ..
    `fs_launch_{entries - 1}` for a module."""
    from fusesearch.backends.cpu import cache_dir, load_cached

    digest = hashlib.sha256(text.encode()).hexdigest()
    target = cache_dir().parent / "emulate" / f"{digest[:24]}.so"
    target.parent.mkdir(parents=True, exist_ok=True)
    lib = load_cached(target, lambda target: _build(text, target))
    for name in [f"fs_launch_{n}" for n in range(entries)] or ["fs_launch"]:
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(ctypes.c_void_p)] + [ctypes.c_uint] * 6
    return lib


def _build(text: str, target: Path) -> None:
    cxx = compiler()
    if cxx is None:
        raise FusesearchError("no C++ compiler found (install g++ or set CXX)")
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "kernel.cpp", Path(tmp) / "kernel.so"
        src.write_text(text)
        done = subprocess.run([cxx, *CXXFLAGS, f"-I{_stub_headers(Path(tmp))}", str(src), "-o", str(out)],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            first = next((ln for ln in done.stderr.splitlines() if "error" in ln), done.stderr[:300])
            raise FusesearchError(f"the emulated CUDA kernel does not compile as C++: {first}")
        os.replace(out, target)


def compile_kernel(kernel: GeneratedKernel) -> ctypes.CDLL:
    """The kernel's translation unit (`source`) compiled and loaded (cached by hash); its
    launcher is `fs_launch`."""
    return _load(source(kernel))


def run(kernel: GeneratedKernel, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run the CUDA source on host threads with the kernel's launch geometry; outputs by tensor."""
    arrays = [np.ascontiguousarray(inputs[a.tensor], dtype=NP_DTYPES[a.dtype]).reshape(a.shape)
              for a in kernel.inputs]
    outs = [np.full(a.shape, np.nan if a.dtype in ("float32", "float16", "bfloat16") else 0, dtype=NP_DTYPES[a.dtype])
            for a in kernel.outputs]
    launch(kernel, [x.ctypes.data for x in arrays + outs])
    return {a.tensor: o for a, o in zip(kernel.outputs, outs, strict=True)}


def launch(kernel: GeneratedKernel, pointers: list[int]) -> None:
    """One launch on host memory: `pointers` are the kernel's arguments (inputs, then outputs)."""
    _launch(kernel, compile_kernel(kernel).fs_launch, pointers)


def module(kernels: Sequence[GeneratedKernel]) -> dict[str, Callable[[Sequence[int]], None]]:
    """The kernels as one module, as the CUDA program loads them: `codegen.cuda_module`'s text
    (the one NVRTC compiles) compiled once with one launcher per kernel; a launch function per
    kernel name, taking the kernel's argument pointers."""
    text = _HEADER + "\n" + cuda_module(kernels) + "\n"
    for n, k in enumerate(kernels):
        params = [*k.inputs, *k.outputs]
        casts = ", ".join(f"({'const ' if i < len(k.inputs) else ''}{a.ctype}*)fs_args_{n}[{i}]"
                          for i, a in enumerate(params))
        text += (_LAUNCHER.replace("fs_args", f"fs_args_{n}").replace("fs_thread", f"fs_thread_{n}")
                 .replace("fs_launch", f"fs_launch_{n}")
                 .format(nargs=max(1, len(params)),  # the casts name the kernel's own storage types (fs_half)
                         call=f"using namespace {module_namespace(k)}; {k.name}({casts});"))
    lib = _load(text, entries=len(kernels))
    entries = [getattr(lib, f"fs_launch_{n}") for n in range(len(kernels))]
    return {k.name: (lambda pointers, k=k, fn=fn: _launch(k, fn, pointers)) for k, fn in zip(kernels, entries, strict=True)}


def _launch(kernel: GeneratedKernel, fn, pointers: Sequence[int]) -> None:
    table = (ctypes.c_void_p * max(1, len(pointers)))(*pointers)
    grid = tuple(kernel.grid) + (1,) * (3 - len(kernel.grid))
    block = tuple(kernel.block) + (1,) * (3 - len(kernel.block))
    rc = fn(table, *grid, *block)
    if rc == -1:
        raise FusesearchError(f"{kernel.name}: block {block} is not a whole number of warps (<= 1024 threads)")
    if rc == -3:
        raise FusesearchError(f"{kernel.name}: no memory for the emulated threads' stacks")
    if rc == -4:
        raise FusesearchError(f"{kernel.name}: an ldmatrix row address or a 16-byte cp.async address is not 16-byte "
                              "aligned (a misaligned-address fault on the GPU)")
    if rc != 0:
        raise FusesearchError(f"{kernel.name}: a barrier was never reached by all its threads "
                              "(a thread skipped __syncthreads or a warp-collective operation: divergent barrier)")


class HostDevice:
    """The CUDA program's device, emulated on the host (correctness only, never timing): memory
    is numpy, the module is `emulate.module` (the same concatenated CUDA source, compiled as
    C++), a launch runs every CUDA thread of the kernel's grid on host threads, a library step
    runs in ONNX Runtime on the CPU bound to the host buffers, and a capture records the launches
    in order for `replay` (as a CUDA graph replays its kernels)."""

    name = "emulate"

    def __init__(self) -> None:
        self._recording: list[Callable[[], None]] | None = None

    def module(self, kernels):
        return module(kernels)

    def alloc(self, nbytes: int) -> np.ndarray:
        from fusesearch.backends.cpu import aligned_empty

        out = aligned_empty(nbytes)
        out[...] = 0
        return out

    def upload(self, array: np.ndarray) -> np.ndarray:
        return np.array(array, copy=True, order="C")

    @staticmethod
    def view(base: np.ndarray, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return base.reshape(-1).view(np.uint8)[offset:offset + nbytes].view(dtype).reshape(shape)

    @staticmethod
    def copy_in(buffer: np.ndarray, array: np.ndarray) -> None:
        buffer[...] = array.reshape(buffer.shape)

    @staticmethod
    def copy_out(buffer: np.ndarray) -> np.ndarray:
        return buffer.copy()

    def launcher(self, fn, kernel, args) -> Callable[[], None]:
        pointers = [a.ctypes.data for a in args]
        return self._recorded(lambda: fn(pointers))

    def library(self, make_session, inputs, outputs) -> Callable[[], None]:
        from fusesearch.backends.library import host_binding

        return self._recorded(host_binding(make_session(None), [(t, lambda b=b: b) for t, b in inputs], outputs))

    def array_library(self, op_type: str, attrs, inputs, outputs) -> Callable[[], None]:
        """`arraylib`'s function for the node with numpy over the host buffers (None: an omitted
        optional input), its results copied into the outputs' buffers."""
        from fusesearch.backends import arraylib

        return self._recorded(lambda: arraylib.run_into(np, op_type, attrs, inputs, outputs))

    def conv_library(self, call, x, w, bias, y) -> Callable[[], None]:
        """A conv group's library call with numpy over the host buffers: im2col, the bias, the
        activation (`cudnn.conv_runner`'s fallback route; the emulator has no cuDNN)."""
        from fusesearch.backends.cudnn import conv_runner

        return self._recorded(conv_runner("im2col", np, call, x, w, bias, y))

    def _recorded(self, go: Callable[[], None]) -> Callable[[], None]:
        def launch() -> None:
            if self._recording is not None:
                self._recording.append(go)
            else:
                go()
        return launch

    def capture(self, launch_all: Callable[[], None]) -> list[Callable[[], None]]:
        self._recording = []
        try:
            launch_all()
            return self._recording
        finally:
            self._recording = None

    @staticmethod
    def replay(graph: list[Callable[[], None]]) -> None:
        for go in graph:
            go()
