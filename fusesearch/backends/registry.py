"""The backends kernels run on, by name: one registry of `Backend` objects.

Problem: `measure`, `calibrate`, `run` and `sweep` all run kernels and library calls, time them
and name the device; the choice of runner, clock, null call and library is made here once.
Approach: a `Backend` offers `available()` (with the reason; `require` makes it a BadInput),
`compile(kernel)`, `runner(kernel, x)` and `library_call(...)` (run, fetch pairs; ONNX Runtime on
the CPU, `arraylib` with CuPy or numpy elsewhere), `clock()`, `flusher()`, `sample(runs, ...)`
(`timing.measure_interleaved` on the host, `timing.graph_timing` on a GPU), `null_calls(...)`
(what the calling path adds: `NullCalls.costs` → `CallCosts`, taken off by `CallCosts.net`) and
`program_device(n)`. `get_backend(name)` is the one check of a backend's name for every
--backend and the sweep file's `backend` key (BadInput, exit 2, naming the choices); timing
commands take the backends that time, `run` also `emulate`.
Invariants: importing this module imports neither CuPy nor a compiler; each backend's module
(`cpu`, `cupy`, `emulate`, `library`) is imported when a method needs it, so `cupy` stays the one
module importing cupy; an unknown name is bad input, never a KeyError."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fusesearch.backends.timing import Clock, PerfCounterClock, Timing, measure_interleaved
from fusesearch.errors import BadInput
from fusesearch.groups import FusionDecision

CALL_FLOOR_S = 1e-8  # a generated kernel's sample net of the null call: at least a C call

Run = Callable[[], None]
Call = tuple[Run, Callable[[], dict]]  # (run, fetch the outputs by tensor name)


@dataclass(frozen=True)
class CallCosts:
    """Seconds the calling path adds to each sample that a plan's program never pays per kernel:
    a null C call (`call_s`, per generated kernel), ONNX Runtime's fixed cost of one Run and one
    trivial node's share of a Run (`run_s`, `node_s`, per library call)."""

    call_s: float = 0.0
    run_s: float = 0.0
    node_s: float = 0.0

    def net(self, how: str, timing: Timing, calls: int = 1) -> Timing:
        """`timing` of a kernel that ran as `how` ("generated", else `calls` library calls) less
        what its calls added: a generated sample at least CALL_FLOOR_S, a library sample at least
        its nodes' share. Unchanged where nothing was timed apart (a GPU's events time the
        device's work alone)."""
        if self == CallCosts():
            return timing
        if how == "generated":
            return timing.less(self.call_s, CALL_FLOOR_S)
        return timing.less(self.run_s * calls, self.node_s * calls)


@dataclass(frozen=True)
class NullCalls:
    """Runs that compute nothing, to be timed among a backend's kernels: ONNX Runtime's two null
    Runs (`library`: one Identity, a chain of them) then a null C call (`generated`)."""

    runs: tuple[Run, ...] = ()
    library: bool = False
    generated: bool = False

    def costs(self, medians_s: Sequence[float]) -> CallCosts:
        """The CallCosts of the runs' medians, in `runs`' order."""
        from fusesearch.backends.library import run_costs

        medians_s = list(medians_s)
        if len(medians_s) != len(self.runs):
            raise ValueError(f"need one median per null run ({len(self.runs)}), got {len(medians_s)}")
        run_s, node_s = run_costs(*medians_s[:2]) if self.library else (0.0, 0.0)
        return CallCosts(medians_s[-1] if self.generated else 0.0, run_s, node_s)


@dataclass(frozen=True)
class Backend:
    """The backend protocol: what the commands ask of a place to run kernels (module note). A
    subclass per backend implements the methods; the fields say what it can do."""

    name: str
    summary: str  # what it runs, for help texts
    timed: bool = True  # times kernels and programs (emulate: checks correctness only)
    cuda: bool = False  # runs the generated CUDA (a plan made for a GPU device)
    end_to_end: bool = False  # measure --end-to-end and sweeps time whole programs on it
    default_device: str = "host"  # the cost-model device a plan is made for by default
    library: str = ""  # what runs a lone node, for messages
    library_has_every_op: bool = False  # its library runs every op a model has (a refusal is the model's)
    unavailable: str = ""  # what a refusal means, before its reason
    use: str = ""  # how a user who cannot use another backend would use this one

    def available(self) -> FusionDecision:
        raise NotImplementedError

    def require(self, *, timing: bool = True) -> None:
        """BadInput (one line) naming --backend, why it cannot run here and the backends that
        can (`timing`: only those that time)."""
        decision = self.available()
        if decision:
            return
        why = f"{self.unavailable} ({decision.reason})" if self.unavailable else decision.reason
        others = [b.use for b in BACKENDS.values()
                  if b is not self and b.use and (b.timed or not timing) and b.available()]
        raise BadInput(f"--backend {self.name}: {why}" + (f"; use {', or '.join(others)}" if others else ""))

    def device_label(self) -> str:
        """The name of the device kernels run on here (checked available first)."""
        raise NotImplementedError

    def cost_device(self) -> str:
        """The cost model's name for the device measured here ('host', a GPU's table entry)."""
        raise NotImplementedError

    def versions(self) -> dict[str, str]:
        """The toolchain a profile measured on records (the C compiler, CuPy)."""
        return {}

    def compile(self, kernel):
        raise NotImplementedError

    def runner(self, kernel, inputs: dict) -> Call:
        raise NotImplementedError

    def library_call(self, canonical, graph, part, values: dict) -> tuple[Call | None, str]:
        raise NotImplementedError

    def clock(self) -> Clock:
        return PerfCounterClock()

    def flusher(self) -> Run | None:
        return None

    def null_calls(self, *, library: bool, generated: bool) -> NullCalls:
        return NullCalls()

    def sample(self, runs: Sequence[Run], *, budget_s: float, rounds: int = 5, warmup_s: float = 0.05,
               flush: bool = False, min_samples: int = 1, max_samples: int = 1000) -> list[Timing]:
        """One Timing per run, the runs sampled in `rounds` interleaved passes (`measure_interleaved`'s
        arguments), every run in the same cache state (`flush`: the flusher before each sample)."""
        return measure_interleaved(list(runs), clock=self.clock(), budget_s=budget_s, rounds=rounds,
                                   warmup_s=warmup_s, before_each=self.flusher() if flush else None,
                                   min_samples=min_samples, max_samples=max_samples)

    def timing_key(self) -> str:
        """What besides the source and shapes changes a kernel's time here (a timing cache key)."""
        return ""

    def program_device(self, threads: int):
        """The device a plan's CUDA program runs on; None where the plan runs as the host's C
        program (`run.Program`)."""
        return None


def _array_node(graph, part, where: str):
    """(the part's one node, its outputs, "") where `arraylib` has a kernel for it, else
    (None, None, why)."""
    from fusesearch.backends import arraylib

    node = graph.nodes[part.nodes[0]]
    outputs = [t for t in node.outputs if t]
    decision = arraylib.supports(node.op_type, node.attrs, len(outputs))
    if not decision:
        return None, None, f"no {where} library kernel for {node.name}({node.op_type}): {decision.reason}"
    return node, outputs, ""


@dataclass(frozen=True)
class _Cpu(Backend):
    """Generated C/OpenMP through ctypes; lone nodes through ONNX Runtime on one thread."""

    def available(self) -> FusionDecision:
        from fusesearch.backends import cpu

        return cpu.available()

    def device_label(self) -> str:
        from costmodels import host_cpu

        self.require()
        return host_cpu().name

    def cost_device(self) -> str:
        self.require()
        return "host"

    def versions(self) -> dict[str, str]:
        import subprocess

        from fusesearch.backends import cpu

        cc = cpu.compiler()
        if cc is None:
            return {"cc": "none"}
        try:
            done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=10)
        except OSError:
            return {"cc": cc}
        return {"cc": (done.stdout.splitlines() or [cc])[0]}

    def compile(self, kernel):
        from fusesearch.backends import cpu

        return cpu.compile_kernel(kernel)

    def runner(self, kernel, inputs: dict) -> Call:
        """`cpu.runner`'s call (its `.buffers` hold the inputs then the outputs)."""
        from fusesearch.backends import cpu

        go = cpu.runner(kernel, inputs)
        outputs = dict(zip((a.tensor for a in kernel.outputs), go.buffers[len(kernel.inputs):], strict=True))
        return go, lambda: outputs

    def library_call(self, canonical, graph, part, values: dict) -> tuple[Call | None, str]:
        """The node as ONNX Runtime runs it inside the model (`library.library_runner`); ONNX
        Runtime's refusal is raised (at the call or its first run)."""
        from fusesearch.backends.library import library_runner

        go, _ = library_runner(canonical, graph, part, {t: values[t] for t in part.inputs})
        state: dict = {}

        def run() -> None:
            state.update(go())

        return (run, lambda: state), ""

    def null_calls(self, *, library: bool, generated: bool) -> NullCalls:
        from fusesearch.backends import cpu
        from fusesearch.backends.library import null_runs
        from fusesearch.verify import omp_threads

        runs = (*(null_runs(omp_threads()) if library else ()), *((cpu.null_runner(),) if generated else ()))
        return NullCalls(runs, library, generated)

    def timing_key(self) -> str:
        return f";omp_threads={os.environ.get('OMP_NUM_THREADS', '')}"  # OpenMP's thread count changes a time


@dataclass(frozen=True)
class _Cupy(Backend):
    """Generated CUDA compiled by NVRTC through CuPy on the visible GPU; lone nodes through
    `arraylib` with CuPy (cuBLAS); timed per launch from CUDA-graph replays (`sample`)."""

    def available(self) -> FusionDecision:
        from fusesearch.backends import cupy as gpu

        return gpu.available()

    def device_label(self) -> str:
        from fusesearch.backends import cupy as gpu

        self.require()
        return gpu.device_name()

    def cost_device(self) -> str:
        cuda_name = self.device_label()
        name = table_name_for_gpu(cuda_name)
        if name is None:
            raise BadInput(f"--backend {self.name}: the GPU '{cuda_name}' matches no built-in device; "
                           "pass --device NAME for the closest entry of `fusesearch devices`")
        return name

    def versions(self) -> dict[str, str]:
        from costmodels.profile import installed_versions

        version = installed_versions(("cupy-cuda13x",)).get("cupy-cuda13x")
        return {"cupy": version} if version else {}

    def compile(self, kernel):
        from fusesearch.backends import cupy as gpu
        from fusesearch.backends.codegen.base import require_cuda

        return gpu.compile_module(require_cuda(kernel), options=("--std=c++17",)).get_function(kernel.name)

    def runner(self, kernel, inputs: dict) -> Call:
        from fusesearch.backends import cupy as gpu

        return gpu.kernel_runner(kernel, inputs)

    def library_call(self, canonical, graph, part, values: dict) -> tuple[Call | None, str]:
        from fusesearch.backends import cupy as gpu

        if part.schedule.library:  # a conv group: cuDNN's call or fused graph, by the installed route
            return gpu.conv_library_runner(graph, part, values), ""
        node, outputs, why = _array_node(graph, part, "GPU")
        if node is None:
            return None, why
        return gpu.library_runner(node.op_type, node.attrs, [values[t] if t else None for t in node.inputs], outputs), ""

    def clock(self) -> Clock:
        from fusesearch.backends.cupy import CudaEventClock

        return CudaEventClock()

    def flusher(self) -> Run:
        from fusesearch.backends import cupy as gpu

        return gpu.l2_flusher(max(1, gpu.l2_bytes()))

    def sample(self, runs: Sequence[Run], *, budget_s: float, rounds: int = 5, warmup_s: float = 0.05,
               flush: bool = False, min_samples: int = 1, max_samples: int = 1000) -> list[Timing]:
        """Seconds per launch from CUDA-graph replays of N launches (`timing.graph_timing` on the
        process's `cupy.GraphTimer`): `flush` "flushed" (an L2 flush kernel before each launch in
        the graph, N flushes alone taken off), else "warm"; each Timing says its timer ("graph", or
        "events" where a call cannot be captured), cache state and an empty kernel's launch_s."""
        from fusesearch.backends import cupy as gpu
        from fusesearch.backends.timing import graph_timing

        return graph_timing(list(runs), gpu.graph_timer(), budget_s=budget_s, rounds=rounds, warmup_s=warmup_s,
                            flush=flush, min_samples=min_samples, max_samples=max_samples)

    def timing_key(self) -> str:
        return ";timer=graph"  # per launch from graph replays: never a one-launch sample cached before

    def program_device(self, threads: int):
        from fusesearch.backends import cupy as gpu

        return gpu.Device(threads)


@dataclass(frozen=True)
class _Emulate(Backend):
    """The generated CUDA compiled as C++ and run on the CPU, every CUDA thread a coroutine
    (`backends.emulate`): correctness only, never timed."""

    def available(self) -> FusionDecision:
        from fusesearch.backends import emulate

        return emulate.available()

    def device_label(self) -> str:
        from fusesearch.backends import emulate

        self.require(timing=False)
        return f"CUDA emulator ({emulate.compiler()})"

    def compile(self, kernel):
        from fusesearch.backends import emulate

        return emulate.compile_kernel(kernel)

    def runner(self, kernel, inputs: dict) -> Call:
        from fusesearch.backends import emulate

        state: dict = {}

        def run() -> None:
            state.update(emulate.run(kernel, inputs))

        return run, lambda: state

    def library_call(self, canonical, graph, part, values: dict) -> tuple[Call | None, str]:
        import numpy as np

        from fusesearch.backends import arraylib

        node, outputs, why = _array_node(graph, part, "emulated GPU")
        if node is None:
            return None, why
        args = [np.asarray(values[t]) if t else None for t in node.inputs]
        state: dict = {}

        def run() -> None:
            state.update(zip(outputs, arraylib.run(np, node.op_type, node.attrs, args, len(outputs)), strict=True))

        return (run, lambda: state), ""

    def program_device(self, threads: int):
        from fusesearch.backends.emulate import HostDevice

        return HostDevice()


CPU = _Cpu("cpu", "generated C/OpenMP on this machine", end_to_end=True, library="ONNX Runtime",
           library_has_every_op=True, use="--backend cpu to run here")
CUPY = _Cupy("cupy", "generated CUDA on the visible GPU", cuda=True, default_device="h200",
             library="the array library with CuPy (cuBLAS)", unavailable="no GPU/CuPy available")
EMULATE = _Emulate("emulate", "the generated CUDA program on the CPU through the CUDA emulator (correctness "
                   "only)", timed=False, cuda=True, default_device="h200", library="the array library with numpy",
                   use="--backend emulate to check the CUDA program without a GPU")
BACKENDS: dict[str, Backend] = {b.name: b for b in (CPU, CUPY, EMULATE)}


def backend_names(*, timing: bool = True) -> tuple[str, ...]:
    """The registered names (`timing`: only the backends that time)."""
    return tuple(n for n, b in BACKENDS.items() if b.timed or not timing)


def get_backend(name: str | Backend, *, timing: bool = True, named: str | None = None,
                optional: bool = False) -> Backend:
    """The backend called `name` (a Backend is returned as it is). BadInput (exit 2, one line)
    for a name not registered, or one that does not time where `timing` asks for it: `named`
    says where the name was given (default `--backend NAME`), `optional` that it may be left
    out. Whether it runs here is `Backend.require`'s to say."""
    if isinstance(name, Backend):
        name = name.name
    backend = BACKENDS.get(name) if isinstance(name, str) else None
    if backend is None or (timing and not backend.timed):
        choices = ", ".join(backend_names(timing=timing))
        raise BadInput(f"{named or f'--backend {name}'}: choose one of {choices}"
                       + (" or leave it out" if optional else ""))
    return backend


def table_name_for_gpu(cuda_name: str) -> str | None:
    """The DEVICES entry for a CUDA device name ('NVIDIA H200' -> 'h200'), None if unknown."""
    text = cuda_name.lower().replace("geforce", "").replace("nvidia", "").replace("tesla", "")
    tokens = text.replace("-", " ").split()
    joined = "".join(tokens)
    if "h200" in joined:
        return "h200"
    if "h100" in joined:
        return "h100-pcie" if "pcie" in joined else "h100-sxm"
    if "a100" in joined:
        big = "80gb" in joined
        pcie = "pcie" in joined
        return ("a100-80gb" if big else "a100-40gb") + ("-pcie" if pcie else "")
    for name in ("l40s", "l4", "a10", "t4", "v100"):
        if name in tokens or joined.startswith(name):
            return "v100-sxm2" if name == "v100" else name
    for name in ("rtx3090", "rtx4090"):
        if name in joined:
            return name[:3] + "-" + name[3:]
    return None
