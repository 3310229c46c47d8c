"""CuPy: the project's one door to an NVIDIA GPU (availability, event timing, L2 flush, NVRTC).

Problem: kernels must be compiled and timed on a real GPU, yet `import fusesearch` must work
without CuPy or a GPU, and a missing GPU must read as a reason, not a traceback.
Approach: cupy is imported only here, lazily. `available()` answers with a `FusionDecision`, never
raises; `gpu_count()` is 0 on any failure. `CudaEventClock` times with CUDA events; `l2_flusher`
overwrites a 2×L2 buffer; `GraphTimer` (`graph_timer()`, one per process) is the device of
`timing.graph_timing`; `compile_module` builds an NVRTC `cupy.RawModule`; `kernel_runner` and
`library_runner` (`backends.arraylib` with `xp = cupy`) run kernels and lone nodes. `Device` is
`run.CudaProgram`'s device: memory, one RawModule, launches and graph capture on one non-default
stream, library steps through ONNX Runtime's CUDA provider on that stream (`user_compute_stream`,
IO binding) when present, else on the CPU with host copies.
Invariants: importing this module never imports cupy; every function that needs cupy raises a
`FusesearchError` naming the fix when it is missing."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from fusesearch.backends.codegen.base import require_cuda
from fusesearch.backends.library import taken_inputs
from fusesearch.errors import FusesearchError
from fusesearch.groups import FusionDecision

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
    """Device time between two CUDA events recorded on `stream` (default: the current stream)
    (Clock protocol)."""

    name = "cuda_event"

    def __init__(self, stream: object = None) -> None:
        self.stream = stream

    def start(self) -> object:
        cupy = _import_cupy()
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        begin.record(self.stream)
        return begin, end

    def stop(self, token: object) -> float:
        cupy = _import_cupy()
        begin, end = token  # type: ignore[misc]
        end.record(self.stream)
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
    """A `cupy.RawModule` compiled by NVRTC (lazily, at the first `get_function`), with the CUDA
    headers the tensor-core kernels include on its path (`nvrtc.include_flags`)."""
    from fusesearch.backends.nvrtc import include_flags

    cupy = _import_cupy()
    names = tuple(name_expressions)
    return cupy.RawModule(code=source, options=(*options, *include_flags()), backend="nvrtc",
                          name_expressions=names or None)


def raw_launch(fn, kernel) -> Callable[[tuple], None]:
    """A launch of the RawKernel `fn` with the generated kernel's grid, block and dynamic shared
    memory (`GeneratedKernel.dynamic_smem`; past 48 KiB the function is opted in first, once)."""
    grid, block, smem = tuple(kernel.grid), tuple(kernel.block), int(kernel.dynamic_smem)
    if smem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem

    def go(params: tuple) -> None:
        fn(grid, block, params, shared_mem=smem)

    return go


def kernel_runner(generated, inputs: dict) -> tuple[Callable[[], None], Callable[[], dict]]:
    """(launch, fetch) for a GeneratedKernel on the GPU: inputs copied once to device buffers;
    `launch` runs the kernel (asynchronously), `fetch` copies the outputs back as numpy arrays.
    The launch geometry is the generated kernel's own (`grid`, `block`), as the emulator uses it."""
    import numpy as np

    from fusesearch.backends.codegen import NP_DTYPES as dtypes

    cupy = _import_cupy()
    module = compile_module(require_cuda(generated), options=("--std=c++17",))
    fn = module.get_function(generated.name)
    def bits(dtype: str):  # CuPy has no bfloat16: its 16 bits cross as uint16 (the kernel's storage type)
        return np.uint16 if dtype == "bfloat16" else dtypes[dtype]

    args = [cupy.asarray(np.ascontiguousarray(inputs[a.tensor], dtype=dtypes[a.dtype]).reshape(a.shape).view(bits(a.dtype)))
            for a in generated.inputs]
    outs = [cupy.empty(a.shape, dtype=bits(a.dtype)) for a in generated.outputs]
    params = tuple(args + outs)

    go = raw_launch(fn, generated)

    def launch() -> None:
        go(params)

    def fetch() -> dict:
        cupy.cuda.get_current_stream().synchronize()
        return {a.tensor: cupy.asnumpy(o).view(dtypes[a.dtype]) for a, o in zip(generated.outputs, outs, strict=True)}

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


def conv_library_runner(graph, kernel, values: dict) -> tuple[Callable[[], None], Callable[[], dict]]:
    """(launch, fetch) for a conv group's library call (`cudnn.conv_call`) by the process's route
    (`cudnn.run_route`) on its inputs copied once to the device."""
    import numpy as np

    from fusesearch.backends.cudnn import conv_call, conv_runner, run_route

    cupy = _import_cupy()
    call, x, w, bias, y = conv_call(graph, kernel)
    args = [cupy.asarray(values[t]) if t else None for t in (x, w, bias)]
    out = cupy.empty(graph.tensors[y].shape, dtype=np.dtype(graph.tensors[y].dtype))
    go = conv_runner(run_route(), cupy, call, *args, out)

    def fetch() -> dict:
        cupy.cuda.get_current_stream().synchronize()
        return {y: cupy.asnumpy(out)}

    return go, fetch


def device_name() -> str:
    cupy = _import_cupy()
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def l2_bytes() -> int:
    cupy = _import_cupy()
    return int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id).get("l2CacheSize", 0))


CUDA_EP = "CUDAExecutionProvider"


def ort_has_cuda() -> bool:
    """Whether the installed ONNX Runtime offers its CUDA execution provider (onnxruntime-gpu)."""
    try:
        import onnxruntime
    except ImportError:
        return False
    return CUDA_EP in onnxruntime.get_available_providers()


class Device:
    """The CUDA program's device on the GPU (`run.CudaProgram` calls only these methods; the
    emulator's `emulate.HostDevice` has the same ones). Every copy, launch, capture and ONNX Runtime
    call is ordered on one non-default stream, so a program needs no synchronization but the
    copy of its outputs back to the host."""

    name = "cupy"

    def __init__(self, threads: int = 1) -> None:
        cupy = _import_cupy()
        self.cupy, self.threads = cupy, threads
        self.device_id = int(cupy.cuda.Device().id)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.ort_cuda = ort_has_cuda()

    def _providers(self) -> list | None:
        """ONNX Runtime's providers for this device: CUDA on the program's stream, else the CPU."""
        if not self.ort_cuda:
            return None
        return [(CUDA_EP, {"device_id": str(self.device_id), "user_compute_stream": str(self.stream.ptr)}),
                "CPUExecutionProvider"]

    def module(self, kernels) -> dict:
        """Every kernel in one RawModule (`codegen.cuda_module`), compiled by NVRTC once; the
        functions by kernel name, loaded now (never during a graph capture)."""
        from fusesearch.backends.codegen import cuda_module

        module = compile_module(cuda_module(kernels), options=("--std=c++17",))
        return {k.name: module.get_function(k.name) for k in kernels}

    def alloc(self, nbytes: int):
        with self.stream:
            return self.cupy.empty(max(int(nbytes), 1), dtype=self.cupy.uint8)

    def upload(self, array):
        with self.stream:
            return self.cupy.asarray(array)

    def view(self, base, offset: int, shape: tuple[int, ...], dtype):
        return self.cupy.ndarray(shape, dtype=dtype, memptr=base.data + int(offset))

    def copy_in(self, buffer, array) -> None:
        buffer.set(array.reshape(buffer.shape), stream=self.stream)

    def copy_out(self, buffer):
        return buffer.get(stream=self.stream)  # blocking: the stream's work before it is done

    def launcher(self, fn, kernel, args) -> Callable[[], None]:
        go, params = raw_launch(fn, kernel), tuple(args)
        stream = self.stream

        def launch() -> None:
            with stream:  # RawKernel launches on the current stream
                go(params)

        return launch

    def library(self, make_session, inputs, outputs) -> Callable[[], None]:
        """A library step: ONNX Runtime's CUDA provider on the program's stream reading and
        writing the device buffers in place; else (no onnxruntime-gpu, or the session fell back
        to the CPU) a CPU session on host copies of the inputs, its outputs copied back."""
        import numpy as np

        providers = self._providers()
        sess = make_session(providers)
        inputs = taken_inputs(sess, inputs)
        binding = sess.io_binding()
        if providers is not None and CUDA_EP in sess.get_providers():
            for t, b in inputs:
                binding.bind_input(t, "cuda", self.device_id, b.dtype, list(b.shape), b.data.ptr)
            for t, b in outputs:
                binding.bind_output(t, "cuda", self.device_id, b.dtype, list(b.shape), b.data.ptr)
            return lambda: sess.run_with_iobinding(binding)
        host_in = {t: np.empty(b.shape, b.dtype) for t, b in inputs}
        host_out = {t: np.empty(b.shape, b.dtype) for t, b in outputs}
        for t, h in host_out.items():
            binding.bind_output(t, "cpu", 0, h.dtype, list(h.shape), h.ctypes.data)

        def go() -> None:
            for t, b in inputs:
                b.get(stream=self.stream, out=host_in[t])  # blocking: the producing kernels are done
                binding.bind_cpu_input(t, host_in[t])
            sess.run_with_iobinding(binding)
            for t, b in outputs:
                b.set(host_out[t], stream=self.stream)

        return go

    def array_library(self, op_type: str, attrs, inputs, outputs) -> Callable[[], None]:
        """A lone anchor's library call: `arraylib`'s function for the node with cupy (cuBLAS
        for MatMul and Gemm, im2col + cuBLAS for Conv) on the device buffers, on the program's
        stream, its results copied into the outputs' buffers (None: an omitted optional input)."""
        from fusesearch.backends import arraylib

        cupy, stream = self.cupy, self.stream

        def launch() -> None:
            with stream:
                arraylib.run_into(cupy, op_type, attrs, inputs, outputs)

        return launch

    def conv_library(self, call, x, w, bias, y) -> Callable[[], None]:
        """A conv group's library call on the device buffers, on the program's stream, by the
        process's route (`cudnn.run_route`: one cuDNN Frontend graph, PyTorch's conv over the
        buffers shared by DLPack, or the im2col fallback)."""
        from fusesearch.backends.cudnn import conv_runner, run_route

        cupy, stream = self.cupy, self.stream
        with stream:
            go = conv_runner(run_route(), cupy, call, x, w, bias, y, stream)

        def launch() -> None:
            with stream:
                go()

        return launch

    def capture(self, launch_all: Callable[[], None]):
        """The launches of `launch_all` captured on the stream as one CUDA graph."""
        with self.stream:
            self.stream.begin_capture()
            try:
                launch_all()
            finally:
                graph = self.stream.end_capture()
        return graph

    def replay(self, graph) -> None:
        graph.launch(stream=self.stream)

    def clock(self) -> CudaEventClock:
        return CudaEventClock(self.stream)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def enqueue(self, fn: Callable[[], None]) -> None:
        """`fn`'s launches (kernels and library calls on the current stream) on this stream."""
        with self.stream:
            fn()

    def ort_runner(self, model, feeds: dict, *, optimize: bool | str) -> tuple[Callable[[], object], str]:
        """(one run of the whole model in ONNX Runtime, the provider that runs it): on the GPU
        with the inputs in device memory and the outputs left there (IO binding) when the CUDA
        provider is there, else on the CPU with host inputs."""
        from fusesearch.verify import session

        providers = self._providers()
        sess = session(model, threads=self.threads, optimize=optimize, providers=providers)
        names = [o.name for o in sess.get_outputs()]
        host = {i.name: feeds[i.name] for i in sess.get_inputs()}
        if providers is None or CUDA_EP not in sess.get_providers():
            return (lambda: sess.run(names, host)), "CPUExecutionProvider"
        binding = sess.io_binding()
        resident = {t: self.upload(a) for t, a in host.items()}
        for t, b in resident.items():
            binding.bind_input(t, "cuda", self.device_id, b.dtype, list(b.shape), b.data.ptr)
        for t in names:
            binding.bind_output(t, "cuda", self.device_id)
        self.synchronize()

        def go(resident=resident) -> None:  # the bound device inputs live as long as the runner
            sess.run_with_iobinding(binding)

        return go, CUDA_EP


TIMER_SOURCE = r"""
extern "C" __global__ void fs_empty() {}

extern "C" __global__ void fs_flush(unsigned int* buf, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        buf[i] += 1u;
}
"""
FLUSH_BLOCK = 256
FLUSH_GRID = 4096  # blocks of the grid-stride flush: enough to fill any GPU's SMs
CUBLAS_WORKSPACE_BYTES = 32 << 20  # cuBLAS's own advice for Hopper; a set workspace lets its calls be captured


class GraphTimer(Device):
    """The GPU as `timing.graph_timing` times it (`GraphDevice`): launches captured on the
    device's stream (kernels and cuBLAS calls on the current stream) into one CUDA graph, each
    capture with its own memory pool, kept with the graph, so a buffer a captured call allocates
    is never handed to another array while the graph can still write it; an empty kernel and an
    L2 flush kernel (read and write a 2×L2 buffer: every line of L2 is evicted), compiled once."""

    def __init__(self) -> None:
        super().__init__(1)
        cupy = self.cupy
        module = compile_module(TIMER_SOURCE)
        self._empty, self._flush = module.get_function("fs_empty"), module.get_function("fs_flush")
        words = max(1, 2 * l2_bytes()) // 4 + 1
        with self.stream:
            self._buffer = cupy.zeros(words, dtype=cupy.uint32)
        self._flush_args = (self._buffer, cupy.uint64(words))
        self.workspace = _cublas_workspace(cupy, self.stream)

    def empty(self) -> None:
        self._empty((1,), (1,), ())

    def flush(self) -> None:
        self._flush((FLUSH_GRID,), (FLUSH_BLOCK,), self._flush_args)

    def capture(self, launches: Callable[[], None]):
        """`launches` as one graph: run twice first on a fresh pool (its buffers then cached in
        that pool, so the capture allocates nothing new), then captured with that pool."""
        cupy = self.cupy
        pool = cupy.cuda.MemoryPool()
        with cupy.cuda.using_allocator(pool.malloc):
            self.enqueue(launches)
            self.enqueue(launches)
            graph = Device.capture(self, launches)
        return _Captured(graph, pool)

    def replay(self, graph) -> None:
        graph.graph.launch(stream=self.stream)


class _Captured:
    """A captured graph and the memory pool its launches' buffers came from (alive with it)."""

    def __init__(self, graph, pool) -> None:
        self.graph, self.pool = graph, pool


def _cublas_workspace(cupy, stream):
    """A cuBLAS workspace for the current device's handle, so cuBLAS calls can be captured
    (without one cuBLAS allocates inside the call); None where this CuPy cannot set one (its
    calls then may not capture: `graph_timing` times them between events)."""
    try:
        from cupy_backends.cuda.libs import cublas

        handle = cupy.cuda.device.get_cublas_handle()
        with stream:
            workspace = cupy.empty(CUBLAS_WORKSPACE_BYTES, dtype=cupy.uint8)
        cublas.setWorkspace(handle, workspace.data.ptr, CUBLAS_WORKSPACE_BYTES)
    except Exception:  # an older binding without setWorkspace: calls are still timed, marked "events"
        return None
    return workspace


_TIMER: list[GraphTimer] = []


def graph_timer() -> GraphTimer:
    """The process's GraphTimer (made at the first call: kernels compiled, buffers allocated)."""
    if not _TIMER:
        _TIMER.append(GraphTimer())
    return _TIMER[0]
