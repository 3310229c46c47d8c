"""CPU backend: compile a generated kernel's C source with the system compiler and run it.

Problem: generated kernels must run and be checked on machines without a GPU — the same kernel
bodies as the CUDA version, inside a C/OpenMP loop nest.
Approach: `cc -O3 -march=native -fopenmp -shared -fPIC` into a cache folder keyed by the source's
hash (compiled once per machine), loaded with ctypes; `run` allocates the outputs, passes every
array as a contiguous pointer of its C type, and returns the outputs as numpy arrays.
Invariants: a missing compiler is a `FusionDecision`, not a crash; inputs are never written.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np

from fusesearch.backends.codegen import NP_DTYPES, GeneratedKernel
from fusesearch.candidates.rules import FusionDecision
from fusesearch.errors import FusesearchError

CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-lm")


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def available() -> FusionDecision:
    if compiler() is None:
        return FusionDecision.refuse("no C compiler found (install gcc or set CC)")
    return FusionDecision.accept(compiler())


def cache_dir() -> Path:
    root = Path(os.environ.get("FUSESEARCH_CACHE", Path.home() / ".cache" / "fusesearch"))
    folder = root / "cpu"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def compile_kernel(kernel: GeneratedKernel) -> ctypes.CDLL:
    return _load(kernel.c_source, kernel.source_hash)


@lru_cache(maxsize=512)
def _load(source: str, digest: str) -> ctypes.CDLL:
    target = cache_dir() / f"{digest[:24]}.so"
    if not target.exists():
        _build(source, target)
    return ctypes.CDLL(str(target))


def _build(source: str, target: Path) -> None:
    cc = compiler()
    if cc is None:
        raise FusesearchError("no C compiler found (install gcc or set CC)")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.c"
        src.write_text(source)
        out = Path(tmp) / "kernel.so"
        done = subprocess.run([cc, *CFLAGS[:-1], str(src), "-o", str(out), CFLAGS[-1]],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr[:200])
            raise FusesearchError(f"the C compiler rejected a generated kernel: {first}")
        os.replace(out, target)  # atomic: concurrent builders of the same source agree


def run(kernel: GeneratedKernel, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run on host arrays keyed by tensor name; returns the outputs keyed by tensor name."""
    go = runner(kernel, inputs)
    go()
    return dict(zip((a.tensor for a in kernel.outputs), go.buffers[len(kernel.inputs):], strict=True))


def runner(kernel: GeneratedKernel, inputs: dict[str, np.ndarray]):
    """A zero-argument callable that runs the kernel on fixed buffers (for timing); `.buffers`
    holds the inputs then the outputs."""
    fn = getattr(compile_kernel(kernel), kernel.name)
    arrays = [np.ascontiguousarray(inputs[a.tensor], dtype=NP_DTYPES[a.dtype]).reshape(a.shape) for a in kernel.inputs]
    arrays += [np.empty(a.shape, dtype=NP_DTYPES[a.dtype]) for a in kernel.outputs]
    pointers = [x.ctypes.data_as(ctypes.c_void_p) for x in arrays]
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * len(pointers)

    def go() -> None:
        fn(*pointers)

    go.buffers = arrays  # keep them alive
    return go
