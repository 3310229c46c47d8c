"""CPU backend: compile a generated kernel's C source with the system compiler and run it.

Problem: generated kernels must run and be checked on machines without a GPU: the same kernel
bodies as the CUDA version, inside a C/OpenMP loop nest.
Approach: `cc -O3 -march=native -fopenmp -fno-math-errno -shared -fPIC` (plus glibc's vector math
where it links) into a cache keyed by source hash and flags, linked with the shared C runtime
(`runtime`, `libfsrt-<hash>.so`, found through $ORIGIN) and the kernel's C units (`libraries`),
loaded with ctypes. `run` allocates outputs and passes contiguous pointers of their C types;
buffers start on a cache line (`aligned_empty`), those of a page or more on a page (`PAGE`,
`alignment`); packed weights (`GeneratedKernel.packed`) are packed once by `<name>_pack` when the
runner is made and passed after the outputs.
Invariants: a missing compiler is a `FusionDecision`, not a crash; inputs are never written; every
cached library is moved into place whole and checked against its recorded sha256 (`cached_file`),
so a concurrent or interrupted build never leaves a file that loads wrong."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import numpy as np

from costmodels.devices import cache_root
from costmodels.probes import busy_cpus, openmp_wait
from fusesearch.backends.codegen import NP_DTYPES, GeneratedKernel
from fusesearch.backends.codegen.c_runtime import C_RUNTIME
from fusesearch.errors import FusesearchError
from fusesearch.groups import FusionDecision

ALIGN = 64  # bytes: every buffer a kernel reads or writes starts on a cache line
PAGE = 4096  # bytes: and one of at least this many on a page, so any two such start alike modulo 4 KiB


def alignment(nbytes: int) -> int:
    """Where a buffer of `nbytes` starts: on a page from a page up, else on a cache line."""
    return PAGE if nbytes >= PAGE else ALIGN


def aligned_empty(nbytes: int) -> np.ndarray:
    """`nbytes` uninitialised bytes starting on an `alignment(nbytes)` boundary (a view into a
    larger array)."""
    align = alignment(nbytes)
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes]


def aligned_array(shape, dtype, fill: np.ndarray | None = None) -> np.ndarray:
    """An array of `shape` and `dtype` aligned as `aligned_empty`, holding `fill` when given."""
    dtype = np.dtype(dtype)
    out = aligned_empty(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize).view(dtype).reshape(shape)
    if fill is not None:
        out[...] = np.asarray(fill, dtype=dtype).reshape(shape)
    return out


CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC",
          "-std=c11", "-lm")


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def available() -> FusionDecision:
    if compiler() is None:
        return FusionDecision.refuse("no C compiler found (install gcc or set CC)")
    return FusionDecision.accept(compiler())


def capabilities():
    """What the code generator writes (`codegen.CAPABILITIES`), with whether the C programs built
    here link a BLAS (`blas_flags`): without one no choice is a BLAS call."""
    from dataclasses import replace

    from fusesearch.backends.codegen import CAPABILITIES

    return replace(CAPABILITIES, blas=bool(blas_flags()))


@lru_cache(maxsize=1)
def blas_flags() -> tuple[str, ...]:
    """Compile and link flags for the BLAS that gemm kernels call per row block (scipy-openblas32,
    an OpenBLAS built for linking), or () without it: kernels then use their own row loops. The
    library runs single-threaded inside each call; kernels parallelize over blocks with OpenMP.
    FUSESEARCH_NO_BLAS=1 turns it off (the row loops are then compiled instead)."""
    if os.environ.get("FUSESEARCH_NO_BLAS"):
        return ()
    try:
        import scipy_openblas32 as blas
    except ImportError:
        return ()
    lib = Path(blas.get_lib_dir())
    try:
        handle = ctypes.CDLL(str(lib / blas.get_library(fullname=True)))
        handle.scipy_openblas_set_num_threads(1)
    except (OSError, AttributeError):
        return ()
    return ("-DFS_BLAS_SGEMM=scipy_cblas_sgemm", "-DFS_BLAS_SGEMV=scipy_cblas_sgemv", f"-L{lib}", f"-l{blas.get_library()}", f"-Wl,-rpath,{lib}")


def link_flags() -> tuple[str, ...]:
    return (*vector_math_flags(), *blas_flags())


@lru_cache(maxsize=1)
def vector_math_flags() -> tuple[str, ...]:
    """(-DFS_VECTOR_MATH, -lmvec) where the compiler links glibc's vector math library, else ():
    kernels then call the scalar libm functions (same results within a few ulp, slower)."""
    cc = compiler()
    if cc is None:
        return ()
    probe = ("#pragma omp declare simd notinbranch\nfloat expf(float);\n"
             "void f(float* x) {\n#pragma omp simd\nfor (int i = 0; i < 64; ++i) x[i] = expf(x[i]);\n}\n")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text(probe)
        done = subprocess.run([cc, *CFLAGS[:-1], str(src), "-o", str(Path(tmp) / "probe.so"), "-lmvec", "-lm"],
                              capture_output=True, text=True, timeout=120)
    return ("-DFS_VECTOR_MATH", "-lmvec") if done.returncode == 0 else ()


def cache_dir() -> Path:
    folder = cache_root() / "cpu"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def compile_kernel(kernel: GeneratedKernel) -> ctypes.CDLL:
    return _load(kernel.c_source, kernel.source_hash, kernel.c_units)


@lru_cache(maxsize=512)
def _load(source: str, digest: str, units: tuple[str, ...] = ()) -> ctypes.CDLL:
    flags = hashlib.sha256(" ".join((*CFLAGS, *link_flags(), runtime_name())).encode()).hexdigest()[:8]
    linked = libraries(units)  # built (or found intact) before any library that links them is loaded
    return load_cached(cache_dir() / f"{digest[:24]}-{flags}.so", lambda target: _build(source, target, linked))


def cached_file(target: Path, build) -> Path:
    """`target`, a file of the compile cache, built first by `build(target)` (which moves the
    finished file into place atomically) when it is missing or is not the file that was built:
    each build records the file's sha256 beside it, so a truncated or corrupt cached library or
    object is built again instead of failing (or crashing) every later run."""
    marker = target.with_name(target.name + ".sha256")
    try:
        intact = marker.read_text() == hashlib.sha256(target.read_bytes()).hexdigest()
    except OSError:
        intact = False
    if not intact:
        build(target)
        with tempfile.NamedTemporaryFile("w", dir=target.parent, delete=False) as tmp:
            tmp.write(hashlib.sha256(target.read_bytes()).hexdigest())
        os.replace(tmp.name, marker)
    return target


def _set_openmp_env(busy: Callable[[], float] = busy_cpus) -> None:
    """How libgomp's threads wait between regions (`probes.openmp_wait`: spinning briefly where the
    machine is idle, `busy` the CPUs others keep busy, else passively), unless the user said
    (OMP_WAIT_POLICY or GOMP_SPINCOUNT) or it was set before. libgomp reads its environment once,
    when it loads: with the first compiled library (`load_cached`)."""
    if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys():
        os.environ.update(openmp_wait(busy()))


@contextlib.contextmanager
def openmp_threads(threads: int):
    """Run the OpenMP kernels, and the ONNX Runtime sessions that default to their count
    (`verify.omp_threads`), with `threads` threads while inside, whatever libgomp read from the
    environment when it was first loaded; both restored afterwards. 0: leave them as they are."""
    if threads <= 0:
        yield
        return
    _set_openmp_env()
    try:
        gomp = ctypes.CDLL("libgomp.so.1")
    except OSError:  # another OpenMP runtime: it reads OMP_NUM_THREADS when it loads
        gomp = None
    before_env = os.environ.get("OMP_NUM_THREADS")
    before = gomp.omp_get_max_threads() if gomp is not None else 0
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if gomp is not None:
        gomp.omp_set_num_threads(threads)
    try:
        yield
    finally:
        if gomp is not None:
            gomp.omp_set_num_threads(before)
        if before_env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before_env


def load_cached(target: Path, build) -> ctypes.CDLL:
    """The shared library `cached_file` keeps at `target`, loaded (libgomp with it the first time,
    under `_set_openmp_env`'s wait)."""
    _set_openmp_env()
    return ctypes.CDLL(str(cached_file(target, build)))


def _build(source: str, target: Path, linked: tuple[Path, ...] = (), extra: tuple[str, ...] = ()) -> None:
    """`source` compiled into the shared library `target` (moved into place atomically), linked
    with the shared libraries `linked` (the runtime and units, `libraries`), `extra` flags after
    the sources."""
    cc = compiler()
    if cc is None:
        raise FusesearchError("no C compiler found (install gcc or set CC)")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.c"
        src.write_text(source)
        out = Path(tmp) / "kernel.so"
        done = subprocess.run([cc, *CFLAGS[:-1], str(src), "-o", str(out), *extra, *link_flags(),
                               *link_libraries(linked), CFLAGS[-1]],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr[:200])
            raise FusesearchError(f"the C compiler rejected a generated kernel: {first}")
        os.replace(out, target)  # atomic: concurrent builders of the same source agree


# -- the shared C runtime -----------------------------------------------------------------------

RUNTIME_PREFIX = "libfsrt-"  # the shared C runtime's file name
UNIT_PREFIX = "libfsunit-"  # a kernel's C unit's (`GeneratedKernel.c_units`)


@lru_cache(maxsize=8)
def _compiler_version(cc: str) -> str:
    done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60)
    return done.stdout.splitlines()[0] if done.stdout else ""


def library_name(source: str, prefix: str) -> str:
    """`<prefix><hash>.so`: the file name of C `source` compiled once into a shared library, the
    hash of the source, the compiler (path and version) and every flag it and the kernels are
    compiled with (-march=native included, so a machine's cache holds its own CPU's), so a change
    of any one builds another library, and the kernels (whose cache keys hold the runtime's name
    and their units' sources) link that one."""
    cc = compiler() or ""
    key = "\0".join([source, cc, _compiler_version(cc) if cc else "", *CFLAGS, *link_flags()])
    return f"{prefix}{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def runtime_name() -> str:
    """The shared C runtime's file name (`library_name` of `codegen.c_runtime.C_RUNTIME`)."""
    return library_name(C_RUNTIME, RUNTIME_PREFIX)


def shared_library(source: str, prefix: str) -> Path:
    """C `source` compiled once per machine, compiler and flags, with the kernels' flags, into the
    shared library `library_name(source, prefix)` in the cache folder (its soname its file name),
    built first when missing, or when its file is not the one that was built (`cached_file`'s
    sha256, as for every cached library); concurrent builders each move a finished file into place."""
    name = library_name(source, prefix)
    return cached_file(cache_dir() / name, lambda target: _build(source, target, extra=(f"-Wl,-soname,{name}",)))


def runtime() -> Path:
    """The shared C runtime (`codegen.c_runtime.C_RUNTIME`: the helpers and packed GEMM that every
    kernel's header declares), built once per machine, compiler and flags (`shared_library`)."""
    return shared_library(C_RUNTIME, RUNTIME_PREFIX)


def libraries(units: tuple[str, ...] = ()) -> tuple[Path, ...]:
    """The shared libraries a kernel with C `units` links: each unit's, then the runtime, in that
    order, so a unit that defines a runtime function (an edited runtime, `benchmarks/ab_group.py`)
    is the one the kernel calls."""
    return (*(shared_library(u, UNIT_PREFIX) for u in units), runtime())


def link_libraries(linked) -> tuple[str, ...]:
    """The flags that link a kernel library or program in the cache folder with the shared
    libraries `linked` (beside it, `libraries`): each found again through its soname in the
    linking library's own folder ($ORIGIN), wherever the cache folder is."""
    return (*map(str, linked), "-Wl,-rpath,$ORIGIN") if linked else ()


NULL_ARGS = 8  # the null kernel's pointer arguments (a generated kernel's typical count)


def null_runner():
    """A zero-argument callable that calls, as `runner`'s do, a C function of NULL_ARGS pointers
    that does nothing: what timing a kernel through ctypes adds to each sample (about 1.5 us
    here), which a plan's program (one C call per segment of kernels) never pays per kernel."""
    source = "void fs_null(" + ", ".join(f"void* a{i}" for i in range(NULL_ARGS)) + ") {}\n"
    fn = _load(source, hashlib.sha256(source.encode()).hexdigest()).fs_null
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * NULL_ARGS
    buffer = aligned_array((16,), np.float32)
    pointers = [buffer.ctypes.data_as(ctypes.c_void_p)] * NULL_ARGS

    def go() -> None:
        fn(*pointers)

    go.buffers = [buffer]
    return go


def run(kernel: GeneratedKernel, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run on host arrays keyed by tensor name; returns the outputs keyed by tensor name."""
    go = runner(kernel, inputs)
    go()
    return dict(zip((a.tensor for a in kernel.outputs), go.buffers[len(kernel.inputs):], strict=True))


def runner(kernel: GeneratedKernel, inputs: dict[str, np.ndarray]):
    """A zero-argument callable that runs the kernel on fixed buffers (for timing); `.buffers`
    holds the inputs then the outputs. Weights the kernel reads packed (`kernel.packed`) are
    packed here, once, by the kernel's `<name>_pack`: not part of a call (they are constants)."""
    missing = [a.tensor for a in kernel.inputs if inputs.get(a.tensor) is None]
    if missing:  # an input left unset would be read uninitialised: garbage, not an answer
        raise ValueError(f"kernel {kernel.name}: no value for its input '{missing[0]}'")
    lib = compile_kernel(kernel)
    fn = getattr(lib, kernel.name)
    arrays = [aligned_array(a.shape, NP_DTYPES[a.dtype], inputs[a.tensor]) for a in kernel.inputs]
    arrays += [aligned_array(a.shape, NP_DTYPES[a.dtype]) for a in kernel.outputs]
    packed = [aligned_array(p.arg.shape, np.float32) for p in kernel.packed]
    pointers = [x.ctypes.data_as(ctypes.c_void_p) for x in arrays + packed]
    if packed:
        pack = getattr(lib, f"{kernel.name}_pack")
        pack.restype = None
        pack.argtypes = [ctypes.c_void_p] * (len(kernel.inputs) + len(packed))
        pack(*pointers[:len(kernel.inputs)], *pointers[len(arrays):])
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * len(pointers)

    def go() -> None:
        fn(*pointers)

    go.buffers = arrays  # keep them alive
    go.packed = packed
    return go
