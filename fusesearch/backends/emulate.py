"""Run a generated CUDA kernel's own source on the CPU, one host thread per CUDA thread.

Problem: the CUDA skeletons (shared-memory tiles, barriers, warp shuffles) are the part of a
generated kernel that the C/OpenMP backend never exercises, and most machines that build and
test this project have no GPU. A kernel that compiles (NVRTC) may still index a tile wrongly.
Approach: compile the unchanged `cuda_source` as C++ with a small header that gives the CUDA
names a host meaning — `threadIdx`/`blockIdx` are thread-local, `__shared__` variables are
statics (one copy per block, as blocks run one after another), `__syncthreads()` is a barrier of
the block's threads, `__shfl_xor_sync` exchanges values through a per-warp slot array between two
warp barriers, half storage converts on the host (`FS_HOST_HALF`: float16 through
`_Float16`; bfloat16's bit manipulation is the kernel's own), the wmma subset of the tensor-core
skeletons works on warp-replicated fragments (each lane holds and computes the warp's whole 16x16
tile; lane 0 stores it), with the operands rounded as a tensor core reads them (TF32: 10 mantissa
bits), cp.async is a synchronous copy, and `#include <mma.h>` / `<cuda_fp16.h>` / `<cuda_bf16.h>`
find empty stand-ins — and launch it with exactly the grid and block the GPU launch uses
(`GeneratedKernel.grid`/`.block`): blockDim host threads loop over the blocks in order, with a
block barrier between blocks. This is an executable model of the CUDA programming model, good
for correctness (every thread, barrier and shuffle happens), useless for timing.
`module` does the same for many kernels at once: the CUDA program's one module
(`codegen.cuda_module`), one launcher per kernel.
Invariants: the source is compiled byte for byte as `kernel_runner` (or the CUDA program's
module) would send it to NVRTC (only the header is prepended, the launchers appended); a barrier that waits more than TIMEOUT_S (a thread missed a
`__syncthreads`, as a divergent barrier would on a GPU) fails the launch instead of hanging;
inputs are never written.
"""

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
from fusesearch.candidates.decision import FusionDecision
from fusesearch.errors import FusesearchError

TIMEOUT_S = 20
CXXFLAGS = ("-O1", "-std=c++17", "-pthread", "-shared", "-fPIC", "-w")

_HEADER = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <pthread.h>
#include <time.h>
#include <errno.h>
#include <type_traits>
struct dim3 { unsigned x, y, z; };
struct float4 { float x, y, z, w; } __attribute__((aligned(16)));
struct float2 { float x, y; } __attribute__((aligned(8)));
static thread_local dim3 threadIdx, blockIdx;
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

struct fs_barrier { pthread_mutex_t m; pthread_cond_t c; unsigned count, waiting, generation; };
static fs_barrier fs_block;
static fs_barrier fs_warps[32];
static volatile int fs_failed = 0;
static float fs_slots[1024];
static void fs_barrier_init(fs_barrier* b, unsigned count) {
    pthread_mutex_init(&b->m, 0); pthread_cond_init(&b->c, 0);
    b->count = count; b->waiting = 0; b->generation = 0;
}
static void fs_wait(fs_barrier* b) {
    pthread_mutex_lock(&b->m);
    unsigned gen = b->generation;
    if (++b->waiting == b->count) {
        b->waiting = 0; b->generation++; pthread_cond_broadcast(&b->c);
    } else {
        struct timespec until; clock_gettime(CLOCK_REALTIME, &until); until.tv_sec += FS_TIMEOUT_S;
        while (gen == b->generation && !fs_failed) {
            if (pthread_cond_timedwait(&b->c, &b->m, &until) == ETIMEDOUT) { fs_failed = 1; break; }
        }
        if (fs_failed) pthread_cond_broadcast(&b->c);
    }
    pthread_mutex_unlock(&b->m);
}
static inline unsigned fs_tid() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
static inline void __syncthreads() { fs_wait(&fs_block); }
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
    fs_warp_collective();
    const bool tf32 = std::is_same<T, precision::tf32>::value;
    float out[M * N];
    for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) {
            float s = c.x[i * N + j];
            for (int k = 0; k < K; ++k) {
                float x = fs_operand(a.x[i * K + k]), y = fs_operand(b.x[k * N + j]);
                if (tf32) { x = fs_operand_tf32(x); y = fs_operand_tf32(y); }
                s += x * y;
            }
            out[i * N + j] = s;
        }
    for (int i = 0; i < M * N; ++i) d.x[i] = out[i];
}
} }
"""

_LAUNCHER = r"""
static void* fs_args[{nargs}];
static void* fs_thread(void* p) {{
    unsigned t = (unsigned)(uintptr_t)p;
    threadIdx.x = t % blockDim.x; threadIdx.y = (t / blockDim.x) % blockDim.y;
    threadIdx.z = t / (blockDim.x * blockDim.y);
    for (unsigned z = 0; z < gridDim.z; ++z)
        for (unsigned y = 0; y < gridDim.y; ++y)
            for (unsigned x = 0; x < gridDim.x; ++x) {{
                blockIdx.x = x; blockIdx.y = y; blockIdx.z = z;
                {call}
                fs_wait(&fs_block);
                if (fs_failed) return 0;
            }}
    return 0;
}}
extern "C" int fs_launch(void** args, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz) {{
    for (int i = 0; i < {nargs}; ++i) fs_args[i] = args[i];
    gridDim.x = gx; gridDim.y = gy; gridDim.z = gz; blockDim.x = bx; blockDim.y = by; blockDim.z = bz;
    unsigned n = bx * by * bz;
    if (n == 0 || n > 1024 || n % 32 != 0) return -1;
    fs_failed = 0;
    fs_barrier_init(&fs_block, n);
    for (unsigned w = 0; w < n / 32; ++w) fs_barrier_init(&fs_warps[w], 32);
    pthread_t threads[1024];
    for (unsigned t = 0; t < n; ++t) pthread_create(&threads[t], 0, fs_thread, (void*)(uintptr_t)t);
    for (unsigned t = 0; t < n; ++t) pthread_join(threads[t], 0);
    return fs_failed ? -2 : 0;
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
    return (f"#define FS_TIMEOUT_S {TIMEOUT_S}\n" + _HEADER + "\n" + kernel.cuda_source + "\n"
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
    from fusesearch.backends.cpu import cache_dir

    digest = hashlib.sha256(text.encode()).hexdigest()
    target = cache_dir().parent / "emulate" / f"{digest[:24]}.so"
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
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
    lib = ctypes.CDLL(str(target))
    for name in [f"fs_launch_{n}" for n in range(entries)] or ["fs_launch"]:
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(ctypes.c_void_p)] + [ctypes.c_uint] * 6
    return lib


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
    _launch(kernel, _load(source(kernel)).fs_launch, pointers)


def module(kernels: Sequence[GeneratedKernel]) -> dict[str, Callable[[Sequence[int]], None]]:
    """The kernels as one module, as the CUDA program loads them: `codegen.cuda_module`'s text
    (the one NVRTC compiles) compiled once with one launcher per kernel; a launch function per
    kernel name, taking the kernel's argument pointers."""
    text = f"#define FS_TIMEOUT_S {TIMEOUT_S}\n" + _HEADER + "\n" + cuda_module(kernels) + "\n"
    for n, k in enumerate(kernels):
        params = [*k.inputs, *k.outputs]
        casts = ", ".join(f"({'const ' if i < len(k.inputs) else ''}{a.ctype}*)fs_args_{n}[{i}]"
                          for i, a in enumerate(params))
        text += (_LAUNCHER.replace("fs_args", f"fs_args_{n}").replace("fs_thread", f"fs_thread_{n}")
                 .replace("fs_launch", f"fs_launch_{n}")
                 .format(nargs=max(1, len(params)), call=f"{module_namespace(k)}::{k.name}({casts});"))
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
    if rc != 0:
        raise FusesearchError(f"{kernel.name}: a barrier waited over {TIMEOUT_S} s "
                              "(a thread missed __syncthreads: divergent barrier)")
