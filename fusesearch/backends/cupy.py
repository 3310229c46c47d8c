"""CuPy: the project's one door to an NVIDIA GPU (availability, event timing, L2 flush, NVRTC).

Problem: generated kernels must be compiled and timed on a real GPU, yet `import fusesearch`
must work on machines with neither CuPy nor a GPU, and a missing GPU must read as a reason,
not a traceback.
Approach: this is the only module that imports cupy, and only lazily inside functions.
`available()` answers with a `FusionDecision` ("cupy is not installed: ..." / "no CUDA device:
...") and never raises; `gpu_count()` is 0 whenever CuPy or the CUDA runtime fails.
`CudaEventClock` times device work with a pair of CUDA events on the current stream;
`l2_flusher` overwrites a 2×L2 device buffer between samples; `compile_module` builds an NVRTC
`cupy.RawModule`; `kernel_runner` launches a generated kernel; `library_runner` runs one node
through `backends.arraylib` with `xp = cupy` (cuBLAS via `cupy.matmul`: the GPU vendor path for
lone anchors and pooling).
Invariants: importing this module never imports cupy; every function that needs cupy raises a
`FusesearchError` naming the fix when it is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from fusesearch.candidates.rules import FusionDecision
from fusesearch.errors import FusesearchError

INSTALL_HINT = "cupy is not installed: pip install 'fusesearch[gpu]'"
MS_PER_S = 1e3


def _import_cupy() -> Any:
    """The cupy module, or a FusesearchError with the install hint."""
    try:
        import cupy
    except ImportError as exc:
        raise FusesearchError(f"{INSTALL_HINT} ({exc})") from exc
    return cupy


def _device_count() -> tuple[int, str]:
    """(visible CUDA devices, why zero); never raises."""
    try:
        cupy = _import_cupy()
    except FusesearchError:
        return 0, INSTALL_HINT
    except Exception as exc:  # a broken install can fail with anything at import
        return 0, f"cupy failed to import: {type(exc).__name__}: {exc}"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CUDARuntimeError: no driver, no device, bad CUDA_VISIBLE_DEVICES
        return 0, f"no CUDA device: {type(exc).__name__}: {exc}"
    return count, "" if count > 0 else "no CUDA device: the CUDA runtime sees 0 GPUs"


def available() -> FusionDecision:
    """Accepted when cupy imports and at least one GPU is visible; else refused with why."""
    count, why = _device_count()
    if count == 0:
        return FusionDecision.refuse(why)
    return FusionDecision.accept(f"{count} CUDA device(s)")


def gpu_count() -> int:
    """Visible CUDA devices; 0 when cupy is missing or the CUDA runtime fails."""
    return _device_count()[0]


class CudaEventClock:
    """Device time between two CUDA events recorded on the current stream (Clock protocol)."""

    name = "cuda_event"

    def start(self) -> object:
        cupy = _import_cupy()
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        begin.record()
        return begin, end

    def stop(self, token: object) -> float:
        cupy = _import_cupy()
        begin, end = token  # type: ignore[misc]
        end.record()
        end.synchronize()
        return float(cupy.cuda.get_elapsed_time(begin, end)) / MS_PER_S


def l2_flusher(l2_bytes: int) -> Callable[[], None]:
    """A function that overwrites a 2×`l2_bytes` device buffer (allocated once) to evict L2.

    It enqueues a memset on the current stream, so the next sample's start event follows it.
    """
    if l2_bytes <= 0:
        raise ValueError(f"l2_bytes must be > 0, got {l2_bytes}")
    cupy = _import_cupy()
    buffer = cupy.empty(2 * int(l2_bytes), dtype=cupy.uint8)

    def flush() -> None:
        buffer.fill(0)

    return flush


def compile_module(source: str, *, options: tuple[str, ...] = (),
                   name_expressions: Iterable[str] = ()) -> object:
    """A `cupy.RawModule` compiled by NVRTC (lazily, at the first `get_function`)."""
    cupy = _import_cupy()
    names = tuple(name_expressions)
    return cupy.RawModule(code=source, options=tuple(options), backend="nvrtc",
                          name_expressions=names or None)


def kernel_runner(generated, inputs: dict) -> tuple[Callable[[], None], Callable[[], dict]]:
    """(launch, fetch) for a GeneratedKernel on the GPU: inputs copied once to device buffers;
    `launch` runs the kernel (asynchronously), `fetch` copies the outputs back as numpy arrays.
    The launch geometry is the generated kernel's own (`grid`, `block`), as the emulator uses it."""
    import numpy as np

    from fusesearch.backends.codegen import NP_DTYPES as dtypes

    from fusesearch.backends.nvrtc import include_flags

    cupy = _import_cupy()
    module = compile_module(generated.cuda_source, options=("--std=c++17", *include_flags()))
    fn = module.get_function(generated.name)
    args = [cupy.asarray(np.ascontiguousarray(inputs[a.tensor], dtype=dtypes[a.dtype]).reshape(a.shape))
            for a in generated.inputs]
    outs = [cupy.empty(a.shape, dtype=dtypes[a.dtype]) for a in generated.outputs]
    params = tuple(args + outs)

    def launch() -> None:
        fn(generated.grid, generated.block, params)

    def fetch() -> dict:
        cupy.cuda.get_current_stream().synchronize()
        return {a.tensor: cupy.asnumpy(o) for a, o in zip(generated.outputs, outs, strict=True)}

    return launch, fetch


def library_runner(op_type: str, attrs, inputs: list, outputs: list[str]) -> tuple[Callable[[], None], Callable[[], dict]]:
    """(launch, fetch) for one node run through the array library with cupy (cuBLAS for MatMul,
    Gemm and Conv's im2col product; CuPy element/reduction kernels for pooling): inputs (None
    for an omitted optional input) copied once to the device; `launch` enqueues the library
    calls, `fetch` copies the outputs back as numpy arrays. Callers check
    `arraylib.supports` first."""
    from fusesearch.backends import arraylib

    cupy = _import_cupy()
    args = [cupy.asarray(x) if x is not None else None for x in inputs]
    state: dict = {}

    def launch() -> None:
        state["out"] = arraylib.run(cupy, op_type, attrs, args, len(outputs))

    def fetch() -> dict:
        cupy.cuda.get_current_stream().synchronize()
        return {name: cupy.asnumpy(y) for name, y in zip(outputs, state["out"], strict=True)}

    return launch, fetch


def device_name() -> str:
    cupy = _import_cupy()
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def l2_bytes() -> int:
    cupy = _import_cupy()
    return int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id).get("l2CacheSize", 0))
