"""Run a whole plan as one program and time it beside ONNX Runtime.

Problem: per-kernel times taken alone are not what a user runs; a plan is shown fast only once it
runs end to end, sharing memory, and gives ONNX Runtime's outputs.
Approach: groups become steps (alias: no code; generated: one C call; library: the node alone in
ONNX Runtime via IO binding). Runs of generated steps are segments: kernels compiled apart, linked
with a driver and the shared runtime (`cpu.runtime`) into one library, one ctypes call per segment.
`plan_arena` places tensors greedily by lifetime, page-aligned (`cpu.alignment`). `run_plan` checks
plan and unfused programs against ONNX Runtime (`verify.random_feeds`, `verify.compare`), names the
first differing step (or passes with `amplified_err`), then times them in interleaved rounds beside
ORT (ENABLE_ALL on `original_model` and canonical, `RunReport.ort_baseline`; ENABLE_EXTENDED, no
layout transformer, on `original_model`; DISABLE_ALL) and torch baselines. On a GPU a `CudaProgram` (device: `backends.cupy.Device` or `emulate.HostDevice`).
Invariants: overlapping lifetimes never share bytes; inputs and weights are never written; kernel
names are unique; a CUDA graph only when no library step runs between kernels; `--check-each` runs
without reuse; after `run_plan`, OpenMP's thread count is the caller's again."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from fusesearch.backends import cpu
from fusesearch.backends.codegen import CodegenRefused, GeneratedKernel, generate
from fusesearch.backends.cpu import aligned_array, aligned_empty, alignment
from fusesearch.backends.cupy import CUDA_EP
from fusesearch.backends.library import host_binding, node_model
from fusesearch.backends.registry import Backend, get_backend
from fusesearch.backends.timing import Timing, warn_if_loaded
from fusesearch.backends.torch_baseline import baselines, torch_threads
from fusesearch.errors import BadInput, FusesearchError

log = logging.getLogger(__name__)
TIMED = ("plan", "unfused", "ort_enable_all", "ort_enable_all_canonical", "ort_enable_extended", "ort_disable_all")
ORT_ENABLE_ALL = ("ort_enable_all", "ort_enable_all_canonical")  # the model given, the canonical one
TORCH_RUNS = ("torch_eager", "torch_compile", "torch_compile_max_autotune")  # `baselines=("torch",)`
BASELINES = ("torch",)
_THREADS: dict = {}  # "before": (a loaded program library, OpenMP's thread count before any program set it)


class Mismatch(FusesearchError):
    """A program's outputs differ from ONNX Runtime's (exit code 1); names the first step that differs."""


# -- steps ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    group: int  # the plan group it belongs to
    how: str  # "generated" | "library" | "alias"
    nodes: tuple[int, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    kernel: GeneratedKernel | None = None  # generated
    part: object = None  # library: the node's lowered Kernel
    reason: str = ""  # library: why the group is not generated
    reads: tuple[str, ...] = ()  # what it reads each input from where that is a copy in another layout

    @property
    def sources(self) -> tuple[str, ...]:
        """The stored tensor each input is read from: itself, or its copy in the layout the step
        reads it in (`layout.copy_name`, written by a reorder step)."""
        return self.reads or self.inputs


def plan_steps(graph, plan) -> list[Step]:
    """The plan's groups, in order, as steps (a group the generator refuses: a step per node; a
    lone group the plan runs as a library call, `impl` library — a GPU plan's lone anchor, a CPU
    plan's where the library is priced faster, a ConvTranspose on a CPU, an opaque op —: a
    library step, as the plan priced it)."""
    from fusesearch.groups import FusionGroup
    from fusesearch.lowering import lower_as_library

    steps: list[Step] = []
    for g in plan.groups:
        kernel = g.kernel
        if kernel.alias:
            steps.append(Step(g.id, "alias", tuple(g.nodes), (kernel.inputs[0],), tuple(kernel.outputs)))
            continue
        reason = ("the plan runs it as a library call" if kernel.impl == "library"
                  and (len(g.nodes) == 1 or kernel.schedule.library) else "")  # a conv group: one cuDNN graph
        if not reason:
            try:
                generated = generate(graph, kernel)
            except CodegenRefused as exc:
                reason = str(exc)
        if reason:
            parts = [kernel] if len(kernel.nodes) == 1 or kernel.impl == "library" else [
                lower_as_library(graph, FusionGroup.single(i)) for i in kernel.nodes]
            steps += [Step(g.id, "library", tuple(p.nodes), tuple(p.inputs), tuple(p.outputs), part=p,
                           reason=reason) for p in parts]
            continue
        steps.append(Step(g.id, "generated", tuple(g.nodes), tuple(a.tensor for a in generated.inputs),
                          tuple(a.tensor for a in generated.outputs), kernel=generated))
    names = [s.kernel.name for s in steps if s.kernel is not None]
    if len(set(names)) != len(names):  # the generator's default names collide: name them by group
        steps = [s if s.kernel is None else Step(s.group, s.how, s.nodes, s.inputs, s.outputs,
                                                 kernel=generate(graph, plan.groups[s.group].kernel,
                                                                 name=f"fs_g{s.group}_{s.kernel.name}"))
                 for s in steps]
    return _laid_out(graph, plan, steps)


def _laid_out(graph, plan, steps: list[Step]) -> list[Step]:
    """`steps` with the plan's reorders (`Plan.reorders`) as steps of their own (group -1, no
    nodes: `reorder_kernel`), each after the steps of its tensor's producer's group (first, for a
    graph input), and each step reading the copy of an input it reads in another layout than its
    producer writes it (`Step.reads`, its kernel's arguments pointing there). Layouts as
    `lowering.kernel_layouts` says of the plan's kernels: a library or alias step reads NCHW."""
    from fusesearch.backends.codegen.cpu_conv_nchwc import reorder_kernel
    from fusesearch.backends.codegen.nhwc import reorder_cuda_kernel
    from fusesearch.layout import NCHW, copy_name
    from fusesearch.lowering import kernel_layouts
    from fusesearch.schedule import channels_last

    if not plan.reorders:
        return steps
    blocked = [s for s in steps if s.how != "generated" and plan.groups[s.group].kernel.schedule.layout_out.blocked]
    if blocked:
        raise FusesearchError(f"group g{blocked[0].group} runs in a blocked layout but has no generated kernel: "
                              f"{blocked[0].reason}")

    def laid(s: Step, tensors) -> dict:
        kernel = plan.groups[s.group].kernel
        return kernel_layouts(graph, kernel, tensors) if s.how == "generated" else dict.fromkeys(tensors, NCHW)

    after: dict[int, list[Step]] = {}
    for i, r in enumerate(plan.reorders):
        shape = tuple(graph.tensors[r.tensor].shape)
        kernel = (reorder_cuda_kernel(r.tensor, shape, graph.tensors[r.tensor].dtype, r.source, r.target,
                                      name=f"fs_reorder{i}") if channels_last(r.kernel.schedule) else
                  reorder_kernel(r.tensor, shape, r.source, r.target, name=f"fs_reorder{i}",
                                 threads=r.kernel.schedule.cpu_threads))
        after.setdefault(r.after, []).append(Step(-1, "generated", (), (r.tensor,), (kernel.outputs[0].tensor,),
                                                  kernel=kernel))
    copies = {s.outputs[0] for run in after.values() for s in run}
    written = {t: lt for s in steps for t, lt in laid(s, s.outputs).items()}
    out = list(after.get(-1, ()))
    for k, s in enumerate(steps):
        sources = tuple(t if lt == written.get(t, NCHW) else copy_name(t, lt) for t, lt in laid(s, s.inputs).items())
        missing = [t for t in sources if t not in s.inputs and t not in copies]
        if missing:
            raise FusesearchError(f"group g{s.group} reads '{missing[0]}', a copy the plan's reorders do not make")
        if sources != s.inputs:
            named = dict(zip(s.inputs, sources, strict=True))
            kernel = s.kernel and replace(s.kernel, inputs=tuple(replace(a, tensor=named.get(a.tensor, a.tensor))
                                                                 for a in s.kernel.inputs))
            s = replace(s, reads=sources, kernel=kernel)
        out.append(s)
        if k + 1 == len(steps) or steps[k + 1].group != s.group:
            out += after.get(s.group, [])
    return out


def one_by_one(steps: Sequence[Step]) -> list[tuple[str, list[Step]]]:
    """Every step with code as a segment of its own (a program built so runs one call per step:
    a trace times each); aliases have no code and are in none."""
    return [(s.how, [s]) for s in steps if s.how != "alias"]


def segments(steps: Sequence[Step]) -> list[tuple[str, list[Step]]]:
    """Maximal runs of steps: ("generated", steps) for kernels, ("library", steps) for ONNX
    Runtime nodes. An alias has no code: it joins the run before it (one at the start is in
    none), so aliases never split a segment."""
    runs: list[tuple[str, list[Step]]] = []
    for s in steps:
        if s.how == "alias":
            if runs:
                runs[-1][1].append(s)
        elif runs and runs[-1][0] == s.how:
            runs[-1][1].append(s)
        else:
            runs.append((s.how, [s]))
    return runs


# -- the arena --------------------------------------------------------------------------------

def plan_arena(sizes: Mapping[str, int], lifetimes: Mapping[str, tuple[int, int]], *,
               reuse: bool = True) -> tuple[dict[str, int], int]:
    """Offsets of each tensor (greedy by size: largest first, each at the lowest offset aligned
    as `cpu.alignment` aligns a buffer of its size, a page from a page up, that overlaps no placed
    tensor whose lifetime [first, last] intersects its own) and the peak bytes. Without reuse,
    tensors are laid end to end, each aligned so."""
    def up(n: int, align: int) -> int:
        return -(-n // align) * align

    offsets: dict[str, int] = {}
    if not reuse:
        at = 0
        for t in sizes:
            align = alignment(max(sizes[t], 1))
            offsets[t] = at = up(at, align)
            at += up(max(sizes[t], 1), align)
        return offsets, at
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
    for t in sorted(sizes, key=lambda t: (-sizes[t], lifetimes[t][0], t)):
        first, last = lifetimes[t]
        align = alignment(max(sizes[t], 1))
        need = up(max(sizes[t], 1), align)
        at = 0
        for off, end, _, _ in sorted(p for p in placed if p[2] <= last and first <= p[3]):
            if off - at >= need:
                break
            at = max(at, up(end, align))
        offsets[t] = at
        placed.append((at, at + need, first, last))
    return offsets, max((p[1] for p in placed), default=0)


# -- compiling --------------------------------------------------------------------------------

def _flags() -> tuple[list[str], list[str]]:
    """(compile flags, link flags) from the CPU backend: its CFLAGS and its extra flags (a BLAS,
    vector math), split into defines and libraries."""
    extra = cpu.link_flags()
    base = [f for f in cpu.CFLAGS if f != "-shared" and not f.startswith("-l")]
    defines = [f for f in extra if f.startswith(("-D", "-I"))]
    libraries = [f for f in extra if not f.startswith(("-D", "-I"))] + [f for f in cpu.CFLAGS if f.startswith("-l")]
    return base + defines, libraries


def _cc(args: list[str], what: str) -> None:
    cc = cpu.compiler()
    if cc is None:
        raise BadInput("--backend cpu: no C compiler found; install gcc or set CC")
    done = subprocess.run([cc, *args], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr[:200])
        raise FusesearchError(f"the C compiler rejected {what}: {first}")


def _object(source: str, name: str, flags: list[str], folder: Path) -> Path:
    digest = hashlib.sha256("\0".join([source, *flags]).encode()).hexdigest()[:24]

    def build(target: Path) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / f"{name}.c"
            src.write_text(source)
            out = Path(tmp) / "k.o"
            _cc([*flags, "-c", str(src), "-o", str(out)], f"kernel {name}")
            os.replace(out, target)

    return cpu.cached_file(folder / f"{digest}.o", build)


def build_library(kernels: Sequence[GeneratedKernel], driver: str) -> ctypes.CDLL:
    """Compile every kernel (objects cached) and the driver, link them into one shared library
    with the shared C runtime and the kernels' units (`cpu.libraries`: each distinct unit once,
    built beside the kernels where missing)."""
    compile_flags, link_flags = _flags()
    folder = cpu.cache_dir()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        try:
            units = tuple(dict.fromkeys(u for k in kernels for u in k.c_units))  # each distinct one once
            linked = pool.submit(cpu.libraries, units)
            objects = list(pool.map(lambda k: _object(k.c_source, k.name, compile_flags, folder), kernels))
            link_flags += cpu.link_libraries(linked.result())
        except BaseException:  # Ctrl-C or a failed compile: start no further compiles
            pool.shutdown(cancel_futures=True)
            raise
    objects.append(_object(driver, "driver", compile_flags, folder))
    digest = hashlib.sha256("\0".join([*map(str, objects), *link_flags]).encode()).hexdigest()[:24]

    def link(target: Path) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "program.so"
            _cc([*compile_flags, "-shared", *map(str, objects), "-o", str(out), *link_flags], "the program")
            os.replace(out, target)

    return cpu.load_cached(folder / f"program-{digest}.so", link)


# -- the program ------------------------------------------------------------------------------

class Layout:
    """Where each tensor of a program lives: an alias shares its source's storage; weights and
    the model's inputs are external (`ext_index`: their slot in the pointer table); every other
    tensor has an arena offset (`offsets`, `peak_bytes` from `plan_arena` over its lifetime), its
    bytes as it lies (`laid`: a blocked tensor's padded channels; a reorder's copy, `logical`, of
    its tensor's shape in its own layout); `view` gives every tensor in NCHW.
    Subclasses allocate the memory (`_allocate` on the host; `CudaProgram` on its device) and
    `run` the steps; `__call__(feeds)` sets the inputs, runs, and returns copies of the model's
    outputs."""

    def __init__(self, graph, steps: Sequence[Step], weights: Mapping[str, np.ndarray], *, reuse: bool) -> None:
        from fusesearch.layout import NCHW, copy_name

        self.graph, self.steps = graph, list(steps)
        self.source: dict[str, str] = {}  # alias output → the tensor whose storage it shares
        self.logical: dict[str, str] = {}  # a reorder's copy → its tensor
        self.laid: dict[str, object] = {}  # a tensor stored in channel blocks → its `layout.Layout`
        for s in self.steps:
            if s.how == "alias":
                self.source[s.outputs[0]] = self.root(s.sources[0])
            if not s.nodes and s.how == "generated":  # a reorder
                self.logical[s.outputs[0]] = s.inputs[0]
            for a in s.kernel.outputs if s.kernel is not None else ():  # (N, C/c, H, W, c) or (N, H, W, C)
                if a.layout.blocked:
                    self.laid[a.tensor] = a.layout
        # the model's outputs are read from their NCHW copy where their producer writes them blocked
        self.out_name = {t: copy_name(t, NCHW) if copy_name(t, NCHW) in self.logical else t for t in graph.outputs}
        used = [t for s in self.steps for t in (*s.sources, *s.outputs)] + list(self.out_name.values())
        roots = list(dict.fromkeys(self.root(t) for t in used))
        self.ext_index = {t: i for i, t in enumerate(t for t in roots if t in weights or t in graph.inputs)}
        self.input_dtypes = {t: np.dtype(graph.tensors[t].dtype) for t in graph.inputs if t in self.ext_index}
        produced = [t for t in roots if t not in self.ext_index]
        for t in produced:
            if self.info(t).shape is None:
                writer = next((s for s in self.steps if t in s.outputs), None)
                node = graph.nodes[writer.nodes[0]].name if writer else "?"
                raise BadInput(f"tensor '{t}' (written by node '{node}') has no static shape; run needs every "
                               "shape known: bind the model's dynamic dims with --dim NAME=V or --input-shape")
        self.sizes = {t: self.nbytes(t) for t in produced}
        self.arena_views: dict[str, np.ndarray] = {}  # `view`'s of tensors in the arena
        self.offsets, self.peak_bytes = plan_arena(self.sizes, self._lifetimes(produced), reuse=reuse)

    def root(self, t: str) -> str:
        return self.source.get(t, t)

    def info(self, t: str):
        """The graph's description of `t` (of its tensor, for a reorder's copy)."""
        return self.graph.tensors[self.logical.get(t, t)]

    def nbytes(self, t: str) -> int:
        """The bytes `t` takes as it lies (a blocked tensor with its padded channels)."""
        info = self.info(t)
        layout = self.laid.get(t)
        return info.nbytes if layout is None else layout.nbytes(info.shape, info.nbytes // max(1, info.size))

    def _lifetimes(self, produced: list[str]) -> dict[str, tuple[int, int]]:
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        for i, s in enumerate(self.steps):
            for t in s.outputs:
                first.setdefault(self.root(t), i)
            for t in (*s.sources, *s.outputs):
                last[self.root(t)] = i
        end = len(self.steps)
        for t in self.out_name.values():
            last[self.root(t)] = end
        return {t: (first.get(t, 0), last.get(t, end)) for t in produced}

    def _allocate(self, weights: Mapping[str, np.ndarray]) -> None:
        """The arena (aligned host memory) and the external arrays known so far (the weights)."""
        self.ext_arrays: dict[str, np.ndarray] = {t: weights[t] for t in self.ext_index if t in weights}
        self.arena = aligned_empty(self.peak_bytes)
        self.arena[...] = 0

    def view(self, t: str) -> np.ndarray:
        """The tensor as a numpy array over the program's memory (no copy; made once for one in
        the arena, which never moves: a call after a run finds the interpreter's own memory
        evicted by the kernels, so each object it touches costs); one stored in channel blocks as
        a copy in NCHW (`layout.from_blocked`)."""
        from fusesearch.layout import from_blocked

        made = self.arena_views.get(t)
        if made is not None:
            return made
        r = self.root(t)
        info = self.info(t)
        if r in self.ext_index:
            return self.ext_arrays[r].reshape(info.shape)
        dtype = np.dtype(info.dtype)
        off = self.offsets[r]
        layout = self.laid.get(r)
        if layout is not None:
            stored = self.arena[off:off + self.nbytes(r)].view(dtype).reshape(layout.shape(info.shape))
            return from_blocked(stored, layout, info.shape[1])
        made = self.arena_views[t] = self.arena[off:off + info.nbytes].view(dtype).reshape(info.shape)
        return made

    def set_inputs(self, feeds: Mapping[str, np.ndarray]) -> None:
        for t, a in feeds.items():
            dtype = self.input_dtypes.get(t)
            if dtype is not None and a is not self.ext_arrays.get(t):  # the array bound last time: its pointer holds
                a = np.ascontiguousarray(a, dtype=dtype)
                self.ext_arrays[t] = a
                self._set_pointer(t, a)

    def outputs(self) -> dict[str, np.ndarray]:
        return {t: self.view(self.out_name[t]).copy() for t in self.graph.outputs}

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.set_inputs(feeds)
        self.run()
        return self.outputs()

    def _set_pointer(self, t: str, a: np.ndarray) -> None:
        """A program with a pointer table updates it here."""

    def run(self) -> None:
        raise NotImplementedError


def _teams(kernels: Sequence) -> list[list]:
    """A segment's kernels in the order they run, split where one runs on one thread: each run of
    kernels on the caller's team (`GeneratedKernel.c_threads` 0) shares one OpenMP region, its
    kernels apart by barriers instead of a fork and a join each (`benchmarks/bench_regions.py`); a one-thread
    kernel runs alone, its own region of one thread, so that no team waits on it."""
    teams: list[list] = []
    for k in kernels:
        if k.c_threads or not teams or teams[-1][0].c_threads:
            teams.append([k])
        else:
            teams[-1].append(k)
    return teams


class Program(Layout):
    """A plan compiled for the CPU: `__call__(feeds)` runs it and returns the model's outputs.
    `shared`: a segment's team kernels share one OpenMP region (`_teams`); False: a region each
    (`benchmarks/bench_regions.py`)."""

    def __init__(self, graph, canonical: onnx.ModelProto, steps: Sequence[Step], weights: Mapping[str, np.ndarray],
                 threads: int, *, reuse: bool = True, profile: bool = False, split=segments, shared: bool = True) -> None:
        super().__init__(graph, steps, weights, reuse=reuse)
        self.threads, self.profile, self.split, self.shared = threads, profile, split, shared
        self._allocate(weights)
        # the weights kernels read packed: a buffer each after the external arrays, packed once below
        self.packed = {(s.kernel.name, p.arg.name): aligned_array(p.arg.shape, np.float32)
                       for s in self.steps if s.kernel is not None for p in s.kernel.packed}
        self.pk_index = {key: len(self.ext_index) + i for i, key in enumerate(self.packed)}
        self.ext = (ctypes.c_void_p * max(1, len(self.ext_index) + len(self.packed)))()
        for t, a in self.ext_arrays.items():
            self.ext[self.ext_index[t]] = a.ctypes.data
        for key, a in self.packed.items():
            self.ext[self.pk_index[key]] = a.ctypes.data
        self.arena_ptr = ctypes.c_void_p(self.arena.ctypes.data)
        self.calls = self._calls(canonical)

    def _pointer(self, t: str, const: bool, ctype: str) -> str:
        r = self.root(t)
        q = "const " if const else ""
        if r in self.ext_index:
            return f"({q}{ctype}*)x[{self.ext_index[r]}]"
        return f"({q}{ctype}*)(a + {self.offsets[r]}ULL)"

    def driver(self, runs: list[list[Step]]) -> str:
        from fusesearch.backends.codegen.base import c_pack_params, c_params, half_prelude

        dtypes = {a.dtype for s in self.steps if s.kernel is not None for a in (*s.kernel.inputs, *s.kernel.outputs)}
        lines = ["#include <omp.h>", "#include <stddef.h>", "#include <stdint.h>",
                 half_prelude(dtypes, cuda=False).rstrip("\n"),  # the half storage types of the prototypes
                 "void fs_set_threads(int n) { omp_set_num_threads(n); }",
                 "int fs_get_threads(void) { return omp_get_max_threads(); }"]
        kernels = [s.kernel for run in runs for s in run if s.kernel is not None]
        if self.profile:  # each kernel call's seconds, summed over runs (omp_get_wtime: OpenMP's clock)
            lines.append(f"double fs_kernel_s[{max(1, len(kernels))}];")
        for k in kernels:
            params = ", ".join(c_params(k.inputs, k.outputs, k.packed, named=False))
            lines.append(f"void {k.name}({params});" + ("" if k.c_threads else f" void {k.name}_team({params});"))
            if k.packed:
                lines.append(f"void {k.name}_pack({', '.join(c_pack_params(k.inputs, k.packed, named=False))});")
        lines.append("void fs_pack(char* a, void** x) {")  # once, before the first run
        for k in (k for k in kernels if k.packed):
            pk = [f"(float*)x[{self.pk_index[(k.name, p.arg.name)]}]" for p in k.packed]
            lines.append(f"    {k.name}_pack({', '.join([self._pointer(a.tensor, True, a.ctype) for a in k.inputs] + pk)});")
        lines.append("}")
        called = 0
        for n, run in enumerate(runs):
            lines.append(f"void fs_segment_{n}(char* a, void** x) {{")
            ran = [s.kernel for s in run if s.kernel is not None]
            for team in _teams(ran) if self.shared else [[k] for k in ran]:
                calls = [self._call(k, called + i, member=len(team) > 1) for i, k in enumerate(team)]
                called += len(team)
                lines += (["    #pragma omp parallel", "    {", "\n    #pragma omp barrier\n".join(calls), "    }"]
                          if len(team) > 1 else calls)
            lines.append("}")
        return "\n".join(lines) + "\n"

    def _call(self, k, i: int, member: bool) -> str:
        """C calling kernel `k`, the program's i-th: on its own (its region), or `member`: its body
        by each member of the region the segment opened."""
        args = ([self._pointer(a.tensor, True, a.ctype) for a in k.inputs]
                + [self._pointer(a.tensor, False, a.ctype) for a in k.outputs]
                + [f"(const float*)x[{self.pk_index[(k.name, p.arg.name)]}]" for p in k.packed])
        call = f"{k.name}{'_team' if member else ''}({', '.join(args)});"
        if not self.profile:
            return f"    {call}"
        if not member:
            return f"    {{ double t0 = omp_get_wtime(); {call} fs_kernel_s[{i}] += omp_get_wtime() - t0; }}"
        return (f"    {{ double t0 = omp_get_wtime(); {call}\n    #pragma omp barrier\n"
                f"    if (omp_get_thread_num() == 0) fs_kernel_s[{i}] += omp_get_wtime() - t0; }}")

    def _calls(self, canonical: onnx.ModelProto) -> list[Callable[[], None]]:
        """A call per part of `split` (`segments`: maximal runs; `one_by_one`: a call per step)."""
        parts = self.split(self.steps)
        runs = [run for kind, run in parts if kind == "generated"]
        self.segment_counts = {"generated": len(runs), "library": sum(kind == "library" for kind, _ in parts)}
        kernels = [s.kernel for run in runs for s in run if s.kernel is not None]
        calls: list[Callable[[], None]] = []
        lib = build_library(kernels, self.driver(runs)) if kernels else None
        if lib is not None:
            lib.fs_set_threads.argtypes = [ctypes.c_int]
            lib.fs_get_threads.restype = ctypes.c_int
            _THREADS.setdefault("before", (lib, lib.fs_get_threads()))
            lib.fs_set_threads(self.threads)
            lib.fs_pack.argtypes, lib.fs_pack.restype = [ctypes.c_void_p, ctypes.c_void_p], None
            lib.fs_pack(self.arena_ptr, self.ext)  # the packed weights, from the weights (loaded once)
        n = 0
        for kind, run in parts:
            if kind == "generated":
                fn = getattr(lib, f"fs_segment_{n}")
                fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p], None
                calls.append(lambda fn=fn: fn(self.arena_ptr, self.ext))
                n += 1
            else:
                steps = [self._library_call(canonical, s) for s in run if s.how == "library"]
                calls.append(lambda steps=steps: [go() for go in steps] and None)
        self.library = lib  # keep it loaded
        return calls

    def _library_call(self, canonical: onnx.ModelProto, s: Step) -> Callable[[], None]:
        def value(r: str):  # an unblocked tensor in the arena never moves: bound once
            if self.root(r) in self.ext_index or self.root(r) in self.laid:
                return lambda: self.view(r)
            return self.view(r)

        return host_binding(library_session(canonical, self.graph, s, self.threads),
                            [(t, value(r)) for t, r in zip(s.inputs, s.sources, strict=True)],
                            [(t, self.view(t)) for t in s.outputs])

    def _set_pointer(self, t: str, a: np.ndarray) -> None:
        self.ext[self.ext_index[t]] = a.ctypes.data

    def run(self) -> None:
        for call in self.calls:
            call()

    def kernel_seconds(self, reset: bool = False) -> dict[int, float]:
        """A program built with `profile`: the seconds each plan group's kernel took inside the
        program, summed over the runs since it was built or last reset (`reset`: start again)."""
        if not self.profile:
            raise ValueError("kernel_seconds needs a Program built with profile=True")
        steps = [s for s in self.steps if s.kernel is not None]
        if not steps:
            return {}
        seconds = (ctypes.c_double * len(steps)).in_dll(self.library, "fs_kernel_s")
        found: dict[int, float] = {}  # the reorders' together under -1
        for i, s in enumerate(steps):
            found[s.group] = found.get(s.group, 0.0) + seconds[i]
        if reset:
            ctypes.memset(seconds, 0, ctypes.sizeof(seconds))
        return found


def library_session(canonical: onnx.ModelProto, graph, s: Step, threads: int, providers=None):
    """An ONNX Runtime session of a library step's one-node model (`providers`: ONNX Runtime's
    list, default the CPU); BadInput naming the node when ONNX Runtime refuses it."""
    from fusesearch.verify import session

    node = graph.nodes[s.nodes[0]]
    try:
        return session(node_model(canonical, graph, s.part), threads=threads, providers=providers)
    except Exception as exc:  # ONNX Runtime's refusal: the model has a node it cannot run alone
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise BadInput(f"group g{s.group}: node '{node.name}' ({node.op_type}) has no generated kernel and "
                       f"ONNX Runtime cannot run it alone ({first}); run cannot execute this model") from None


# -- checking ---------------------------------------------------------------------------------

def check_static_shapes(graph, reference: Mapping[str, np.ndarray]) -> None:
    """BadInput naming the node when ONNX Runtime's value of a tensor has another shape than the
    one it was given before running (an op whose output shape depends on the values, as NonZero's
    does): a program lays out every tensor before it runs."""
    from fusesearch.verify import shape_text

    for node in graph.nodes:
        for t in node.outputs:
            info = graph.tensors.get(t) if t else None
            if info is None or info.shape is None or t not in reference:
                continue
            got = tuple(np.shape(reference[t]))
            if got != tuple(info.shape):
                raise BadInput(f"node '{node.name}' ({node.op_type}) makes '{t}' of shape {shape_text(got)} on these "
                               f"inputs, not the {shape_text(info.shape)} known before running: its output shape depends "
                               "on the values, and run lays out every tensor beforehand; run cannot execute this "
                               "model (plan and verify can)")


def _reference(prep, plans: Mapping[str, object], seed: int, input_values):
    """(the canonical model, its weights, the seeded inputs, ONNX Runtime's value of every tensor)
    for running `plans` (label -> plan); BadInput, before anything is built, where a program
    cannot hold a tensor (`verify.check_reference_dtypes`) or lay it out (`check_static_shapes`)."""
    from fusesearch.verify import all_values, check_reference_dtypes

    for label, p in plans.items():
        check_reference_dtypes(prep.graph, label, p, "run")
    canonical, weights, feeds = program_inputs(prep, seed, input_values)
    reference = all_values(canonical, feeds, list(input_values or ()))
    check_static_shapes(prep.graph, reference)
    return canonical, weights, feeds, reference


def program_inputs(prep, seed: int, input_values):
    """(the canonical model, its weights, the seeded inputs) a program is built from and runs on."""
    from fusesearch.ir.canonicalize import to_proto, weight_array
    from fusesearch.verify import random_feeds

    canonical = to_proto(prep.canonical)
    weights = {t.name: weight_array(t) for t in canonical.graph.initializer}
    return canonical, weights, random_feeds(canonical, seed, input_values)


def first_difference(graph, canonical: onnx.ModelProto, label: str, steps: Sequence[Step], program: Layout,
                     reference: Mapping[str, np.ndarray], rtol: float) -> str | None:
    """'plan group g3 (...) writes ... given its own inputs', naming the first step whose outputs
    differ from ONNX Runtime's run of its nodes alone (`node_model`) on the values `program` (run,
    without reuse) gave its inputs: a step is judged on its own inputs, so float32 rounding made
    upstream and amplified downstream (a Softmax of large logits) blames no step; a step ONNX
    Runtime cannot run alone is compared with its whole-model value in `reference`."""
    from fusesearch.verify import _run_session, compare, session

    for s in steps:
        if s.how == "alias" or not s.nodes:  # no code: its output is its input's storage; a reorder
            continue
        try:
            sess = session(node_model(canonical, graph, s))
            wanted = _run_session(sess, {i.name: program.view(i.name) for i in sess.get_inputs()})
        except Exception:  # noqa: BLE001 - ONNX Runtime refuses the nodes alone: the whole model's values
            wanted = {t: reference[t] for t in s.outputs if t in reference}
        for d in compare(wanted, {t: program.view(t) for t in wanted}, rtol=rtol):
            if not d.ok:
                nodes = [graph.nodes[i] for i in s.nodes]
                ops = "+".join(n.op_type for n in nodes)
                names = ", ".join(f"'{n.name}'" for n in nodes[:4]) + (" ..." if len(nodes) > 4 else "")
                return (f"{label} group g{s.group} ({s.how} {s.kernel.name if s.kernel else ops}: {ops}, "
                        f"nodes {names}) writes '{d.name}' with max abs err {d.max_abs:.3g} "
                        f"(scale {d.scale:.3g}, rtol {rtol:g}) given its own inputs")
    return None


def checked(label: str, make: Callable[[bool], Layout], canonical: onnx.ModelProto, feeds, reference, rtol: float,
            check_each: bool):
    """(the program with arena reuse, its max relative error, the `verify.OutputDiff` of an output
    beyond `rtol` that every step explains, else None) once its outputs equal ONNX Runtime's
    (`make(reuse)` builds it). Where they differ, or with `check_each`, a program without reuse
    is run and every step checked on its own inputs (`first_difference`): Mismatch naming the
    first that differs; where none does, the outputs are float32 rounding the model amplifies,
    not a wrong kernel, and the program passes with a warning (unless it gives other outputs with
    its arena reused than without: Mismatch)."""
    from fusesearch.verify import compare, max_rel_err

    program = make(not check_each)
    got = program(feeds)
    wanted = {t: reference[t] for t in program.graph.outputs}
    bad = next((d for d in compare(wanted, got, rtol=rtol) if not d.ok), None)
    if check_each or bad is not None:
        full = program if check_each else make(False)
        alone = full(feeds)
        where = first_difference(program.graph, canonical, label, program.steps, full, reference, rtol)
        if where is not None:
            raise Mismatch(f"the {label} program differs from ONNX Runtime: {where}")
        if bad is not None:
            reused = next((d for d in compare(alone, got, rtol=rtol) if not d.ok), None)
            if reused is not None:
                raise Mismatch(f"the {label} program differs from ONNX Runtime at output '{bad.name}' (max abs err "
                               f"{bad.max_abs:.3g}) though every step equals ONNX Runtime given its own inputs: with "
                               f"its arena reused it writes another '{reused.name}' (max abs err "
                               f"{reused.max_abs:.3g}) than without")
            log.warning(f"the {label} program's output '{bad.name}' differs from ONNX Runtime's by max abs err "
                        f"{bad.max_abs:.3g} (scale {bad.scale:.3g}, rtol {rtol:g}), yet every step equals ONNX "
                        "Runtime given its own inputs: float32 rounding the model amplifies (e.g. a Softmax of "
                        "large logits), not a wrong kernel")
        if check_each:  # the program that runs (and is timed) reuses its arena
            program = make(True)
            program(feeds)
    return program, max_rel_err(got, wanted), bad


# -- the CUDA program --------------------------------------------------------------------------

def _array_library_call(graph, step: Step):
    """(op type, attributes, inputs, outputs) of a lone anchor the plan runs as a library call,
    where `arraylib` has it (cuBLAS through CuPy on a GPU: the library call the plan priced), else
    None (the step runs through ONNX Runtime)."""
    from fusesearch.backends import arraylib

    part = step.part
    if part is None or part.anchor is None or len(step.nodes) != 1:
        return None
    node = graph.nodes[part.anchor]
    outputs = [t for t in node.outputs if t]
    if not arraylib.supports(node.op_type, node.attrs, len(outputs)):
        return None
    return node.op_type, node.attrs, list(node.inputs), outputs


def conv_call(graph, part):
    """`cudnn.conv_call` of a library step's kernel (None for a step without one)."""
    from fusesearch.backends.cudnn import conv_call as call

    return call(graph, part) if part is not None else None


class CudaProgram(Layout):
    """The plan as one CUDA program on a `device` — `backends.cupy.Device` (a GPU) or
    `backends.emulate.HostDevice` (the CUDA emulator on host memory): one device allocation for the arena at
    `plan_arena`'s offsets, weights uploaded once, an input buffer per model input (so every
    pointer is fixed), every generated kernel in one module (`codegen.cuda_module`) launched in
    plan order with its own grid and block, a lone anchor the plan runs as a library call through
    the array library on the device's buffers (`device.array_library`: cuBLAS through CuPy on a
    GPU, as the plan priced it), other library steps through ONNX Runtime on them
    (`device.library`). When every segment is generated (`cuda_graph`), the launches are
    captured once into a CUDA graph and every run replays it; otherwise they are launched one by
    one. The orchestration is this class alone; the device only allocates, copies, launches and
    captures."""

    def __init__(self, graph, canonical: onnx.ModelProto, steps: Sequence[Step], weights: Mapping[str, np.ndarray],
                 device, threads: int, *, reuse: bool = True) -> None:
        super().__init__(graph, steps, weights, reuse=reuse)
        self.device, self.threads = device, threads
        parts = segments(self.steps)
        self.segment_counts = {kind: sum(k == kind for k, _ in parts) for kind in ("generated", "library")}
        kernels = [s.kernel for s in self.steps if s.how == "generated"]
        functions = device.module(kernels) if kernels else {}
        self.arena = device.alloc(self.peak_bytes)
        self.ext_arrays = {t: device.upload(weights[t]) if t in weights
                           else device.alloc(graph.tensors[t].nbytes) for t in self.ext_index}
        self.launches: list[Callable[[], None]] = []
        for s in self.steps:
            if s.how == "generated":
                args = [self.buffer(a.tensor) for a in (*s.kernel.inputs, *s.kernel.outputs)]
                self.launches.append(device.launcher(functions[s.kernel.name], s.kernel, args))
            elif s.how == "library" and (conv := conv_call(graph, s.part)) is not None:
                call, x, w, bias, y = conv
                self.launches.append(device.conv_library(call, *(self.buffer(t) if t else None for t in (x, w, bias, y))))
            elif s.how == "library" and (call := _array_library_call(graph, s)) is not None:
                op_type, attrs, ins, outs = call
                self.launches.append(device.array_library(op_type, attrs, [self.buffer(t) for t in ins],
                                                          [self.buffer(t) for t in outs]))
            elif s.how == "library":
                self.launches.append(device.library(
                    lambda providers, s=s: library_session(canonical, graph, s, threads, providers),
                    [(t, self.buffer(t)) for t in s.inputs], [(t, self.buffer(t)) for t in s.outputs]))
        self.cuda_graph = bool(kernels) and self.segment_counts["library"] == 0
        self.graph_exec = device.capture(self._launch_all) if self.cuda_graph else None

    def buffer(self, t: str | None):
        """The tensor as a device array over the program's memory (no copy); None for an omitted
        optional input."""
        if not t:
            return None
        info = self.info(t)
        r = self.root(t)
        base, offset = (self.ext_arrays[r], 0) if r in self.ext_index else (self.arena, self.offsets[r])
        layout = self.laid.get(r)
        shape = tuple(info.shape) if layout is None else layout.shape(tuple(info.shape))
        return self.device.view(base, offset, shape, np.dtype(info.dtype))

    def view(self, t: str) -> np.ndarray:
        """The tensor copied out in NCHW (one stored in another layout: `layout.from_blocked`)."""
        from fusesearch.layout import from_blocked

        stored = self.device.copy_out(self.buffer(t))
        layout = self.laid.get(self.root(t))
        return stored if layout is None else from_blocked(stored, layout, self.info(t).shape[1])

    def set_inputs(self, feeds: Mapping[str, np.ndarray]) -> None:
        for t, a in feeds.items():
            if t in self.ext_index and t in self.graph.inputs:
                self.device.copy_in(self.buffer(t), np.ascontiguousarray(a, dtype=np.dtype(self.graph.tensors[t].dtype)))

    def _launch_all(self) -> None:
        for launch in self.launches:
            launch()

    def run(self) -> None:
        if self.graph_exec is not None:
            self.device.replay(self.graph_exec)
        else:
            self._launch_all()


def run_emulated(prep, plan, *, seed: int = 0, rtol: float | None = None, check_each: bool = False,
                 input_values: Mapping[str, np.ndarray] | None = None) -> dict:
    """Check the plan's CUDA program, run through the emulator (`emulate.HostDevice`), against ONNX
    Runtime: {"max_rel_err", "amplified_err" (as `RunReport`'s), "segments", "arena_peak_bytes",
    "cuda_graph", "kernels", "library_steps"}; Mismatch naming the first step that differs. `rtol`: default the tolerance
    of the model's dtype (`ir.precision.prepared_tolerance`)."""
    from fusesearch.ir.precision import prepared_tolerance

    rtol = prepared_tolerance(prep) if rtol is None else rtol
    backend = get_backend("emulate", timing=False)
    backend.require(timing=False)
    check_args(1, 0, 1, rtol)
    canonical, weights, feeds, reference = _reference(prep, {"plan": plan}, seed, input_values)
    steps = plan_steps(prep.graph, plan)
    program, err, amplified = checked(
        "plan (CUDA, emulated)", lambda reuse: CudaProgram(prep.graph, canonical, steps, weights, backend.program_device(1), 1,
                                                           reuse=reuse),
        canonical, feeds, reference, rtol, check_each)
    return {"max_rel_err": err, "amplified_err": amplified.max_abs if amplified else None,
            "segments": program.segment_counts, "arena_peak_bytes": program.peak_bytes,
            "cuda_graph": program.cuda_graph, "kernels": sum(s.how == "generated" for s in steps),
            "library_steps": sum(s.how == "library" for s in steps)}


# -- the run ----------------------------------------------------------------------------------

@dataclass
class RunReport:
    model: str
    strategy: str
    threads: int
    repeat: int
    warmup: int
    rtol: float
    timings: dict[str, Timing]
    arena_peak_bytes: int
    unfused_arena_peak_bytes: int
    activation_bytes: int
    max_rel_err: float
    unfused_max_rel_err: float
    segments: dict[str, int]
    unfused_segments: dict[str, int]
    kernels: int
    library_steps: int
    backend: str = "cpu"
    cuda_graph: bool | None = None  # cupy: whether each program ran as one captured CUDA graph
    unfused_cuda_graph: bool | None = None
    ort_provider: str = "CPUExecutionProvider"  # the provider of the timed ONNX Runtime sessions
    # the max abs err of an output beyond rtol though every step equals ONNX Runtime given its own
    # inputs (float32 rounding the model amplifies: `checked`), else None
    amplified_err: float | None = None
    unfused_amplified_err: float | None = None
    # the PyTorch baselines (`run_plan(baselines=...)`): versions and converter, the reason a model
    # or a variant is left out; "not installed" without torch; None when not asked for
    torch: dict | str | None = None

    def ort_baseline(self) -> str:
        """The key of ONNX Runtime's faster ENABLE_ALL figure: the model as given
        ("ort_enable_all") or the canonical one ("ort_enable_all_canonical")."""
        known = [k for k in ORT_ENABLE_ALL if k in self.timings]
        return min(known, key=lambda k: self.timings[k].median_s) if known else "ort_enable_all"

    def ratio(self, a: str, b: str) -> float:
        """`a`'s median over `b`'s; b "ort_enable_all" is ONNX Runtime's faster ENABLE_ALL figure
        (`ort_baseline`), so every ratio against ONNX Runtime is against its best."""
        b = self.ort_baseline() if b == "ort_enable_all" else b
        if a not in self.timings or b not in self.timings or not self.timings[b].median_s:
            return math.nan
        return self.timings[a].median_s / self.timings[b].median_s

    def paired(self, a: str, b: str):
        """`timing.paired` of `a` over `b` (their samples round by round; b as `ratio` reads it),
        None where either is missing."""
        from fusesearch.backends.timing import paired

        b = self.ort_baseline() if b == "ort_enable_all" else b
        if a not in self.timings or b not in self.timings:
            return None
        return paired(self.timings[a], self.timings[b])

    def to_dict(self) -> dict:
        """The JSON document: timings per program, sizes, errors (`max_rel_err`; `amplified_err`:
        the max abs err of outputs beyond rtol that float32 rounding explains, else null), ratios
        (of medians) and the same ratios round by round (`paired`: median, p20, p80)."""
        stats = {k: {"median_s": t.median_s, "p20_s": t.p20_s, "p80_s": t.p80_s, "n": t.n}
                 for k, t in self.timings.items()}
        return {"model": self.model, "strategy": self.strategy, **stats, "threads": self.threads,
                "repeat": self.repeat, "warmup": self.warmup, "arena_peak_bytes": self.arena_peak_bytes,
                "unfused_arena_peak_bytes": self.unfused_arena_peak_bytes, "activation_bytes": self.activation_bytes,
                "max_rel_err": self.max_rel_err, "unfused_max_rel_err": self.unfused_max_rel_err, "rtol": self.rtol,
                "amplified_err": self.amplified_err, "unfused_amplified_err": self.unfused_amplified_err,
                "segments": self.segments, "unfused_segments": self.unfused_segments,
                "kernels": self.kernels, "library_steps": self.library_steps,
                "ratios": {"plan_vs_ort_enable_all": self.ratio("plan", "ort_enable_all"),
                           "plan_vs_ort_disable_all": self.ratio("plan", "ort_disable_all"),
                           "plan_vs_unfused": self.ratio("plan", "unfused"),
                           **{f"plan_vs_{k}": self.ratio("plan", k) for k in ("ort_enable_extended", *TORCH_RUNS)
                              if k in self.timings}},
                "paired": {f"plan_vs_{k}": p.to_dict() for k in ("ort_enable_all", "ort_disable_all", "unfused",
                                                                   "ort_enable_extended", *TORCH_RUNS)
                           if (p := self.paired("plan", k)) is not None},
                "ort_baseline": self.ort_baseline(), "backend": self.backend, "ort_provider": self.ort_provider,
                **({"torch": self.torch} if self.torch is not None else {}),
                **({"cuda_graph": self.cuda_graph, "unfused_cuda_graph": self.unfused_cuda_graph}
                   if self.cuda_graph is not None else {})}

    def columns(self, prefix: str = "end_to_end_") -> dict:
        """The JSON document (less model and strategy) as one row's scalar columns, each named by
        its key path joined with "_" after `prefix`: end_to_end_plan_median_s,
        end_to_end_max_rel_err, end_to_end_segments_generated, end_to_end_ratios_plan_vs_unfused.
        For tables that hold a run beside other figures: `measure --end-to-end -o`, sweeps."""
        out: dict = {}

        def walk(doc: dict, path: str) -> None:
            for k, v in doc.items():
                if isinstance(v, dict):
                    walk(v, f"{path}{k}_")
                else:
                    out[path + k] = v

        walk({k: v for k, v in self.to_dict().items() if k not in ("model", "strategy")}, prefix)
        return out

    def to_pandas(self):
        import pandas as pd

        rows = [{"model": self.model, "strategy": self.strategy, "program": k, "backend": self.backend,
                 "threads": self.threads,
                 "median_s": t.median_s, "p20_s": t.p20_s, "p80_s": t.p80_s, "n": t.n,
                 "arena_peak_bytes": {"plan": self.arena_peak_bytes, "unfused": self.unfused_arena_peak_bytes}.get(k),
                 "activation_bytes": self.activation_bytes,
                 "max_rel_err": {"plan": self.max_rel_err, "unfused": self.unfused_max_rel_err}.get(k, 0.0)}
                for k, t in self.timings.items()]
        return pd.DataFrame(rows)


def _timed(runs: Mapping[str, Callable[[], object]], warmup: int, repeat: int,
           clocks: Mapping[str, object] | None = None) -> dict[str, Timing]:
    """Each run's samples, taken in turn (one run of each per round), so that a change in the
    machine's load while timing falls on every program alike; each run's clock from `clocks`
    (CUDA events on the GPU), else the host's perf_counter."""
    from fusesearch.backends.timing import PerfCounterClock

    clock = {k: (clocks or {}).get(k) or PerfCounterClock() for k in runs}
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeat):
        for k, fn in runs.items():
            token = clock[k].start()
            fn()
            samples[k].append(clock[k].stop(token))
    return {k: Timing(tuple(v), warmup, clock[k].name) for k, v in samples.items()}


def original_model(prep) -> onnx.ModelProto | str | None:
    """The model the user gave, as ONNX Runtime would be handed it: the file (with its dynamic
    dims; the feeds bind them), for a zoo model the builder's export; None where the plan's model
    is another one (a --dtype conversion)."""
    from fusesearch.ir.load import ZOO_PREFIX

    if prep.dtype != "float32":
        return None
    source = prep.loaded.source
    if source.startswith(ZOO_PREFIX):
        from fusesearch import zoo

        return zoo.ZOO[source[len(ZOO_PREFIX):]].build()
    return source


def check_original(model, threads: int, feeds: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray],
                   rtol: float):
    """ONNX Runtime's ENABLE_ALL session of the model as given (on the CPU), once its outputs on
    `feeds` equal the canonical model's (`reference`); Mismatch naming the output where they
    differ, BadInput where the canonical model's inputs do not feed it."""
    from fusesearch.verify import _run_session, compare, session

    sess = session(model, threads=threads, optimize=True)
    missing = [i.name for i in sess.get_inputs() if i.name not in feeds]
    if missing:
        raise BadInput(f"the model as given reads input '{missing[0]}', which its canonical form does not have; "
                       "run cannot time ONNX Runtime on it with the same inputs")
    got = _run_session(sess, feeds)
    wanted = {t: reference[t] for t in got if t in reference}
    bad = next((d for d in compare(wanted, {t: got[t] for t in wanted}, rtol=rtol) if not d.ok), None)
    if bad is not None or not wanted:
        where = f"at output '{bad.name}' (max abs err {bad.max_abs:.3g}, rtol {rtol:g})" if bad else "(no output in common)"
        raise Mismatch(f"ONNX Runtime gives the model as given other outputs than its canonical form {where}")
    return sess


def check_args(repeat: int, warmup: int, threads: int, rtol: float) -> None:
    if repeat < 1:
        raise BadInput(f"--repeat {repeat}: give at least 1 timed run")
    if warmup < 0:
        raise BadInput(f"--warmup {warmup}: give 0 or more warm-up runs")
    if threads < 1:
        raise BadInput(f"--threads {threads}: give at least 1 thread")
    if not rtol >= 0:
        raise BadInput(f"--rtol {rtol}: give a tolerance >= 0")


def check_baselines(names: Sequence[str]) -> None:
    """BadInput naming the first of `names` (`run --baselines`) that is not a baseline."""
    for b in names:
        if b not in BASELINES:
            raise BadInput(f"--baselines {b}: choose among {', '.join(BASELINES)}")


def run_plan(prep, plan, unfused, *, threads: int = 1, repeat: int = 20, warmup: int = 3, seed: int = 0,
             rtol: float | None = None, check_each: bool = False, time_it: bool = True,
             input_values: Mapping[str, np.ndarray] | None = None,
             progress: Callable[[str], None] | None = None, backend: Backend | str = "cpu",
             baselines: Sequence[str] = (), names: Mapping[str, str] | None = None) -> RunReport:
    """Check the plan's and the unfused graph's programs against ONNX Runtime on seeded valid
    inputs (`input_values`: those the user gives, from `verify.parse_input_values`), then time
    them and ONNX Runtime (ENABLE_ALL, ENABLE_EXTENDED, DISABLE_ALL); Mismatch (exit 1) naming the first differing
    step. `backend` (a registered one that times, or its name) with a `program_device` (cupy):
    the programs are `CudaProgram`s on it, timed with its clock (CUDA events); else the host's C
    programs. `rtol`: default the tolerance of the model's dtype (`ir.precision.prepared_tolerance`).
    `baselines` ("torch"; always on a CUDA backend): PyTorch eager and torch.compile over the same
    model, checked equal to ONNX Runtime and timed in the same rounds (`backends.torch_baseline`).
    `names`: what errors call the two programs ("plan", "unfused" by default)."""
    from fusesearch.ir.precision import prepared_tolerance

    backend = get_backend(backend)
    backend.require()
    check_baselines(baselines)
    rtol = prepared_tolerance(prep) if rtol is None else rtol
    try:
        return _run_plan(prep, plan, unfused, threads, repeat, warmup, seed, rtol, check_each, time_it,
                         input_values, progress, backend, "torch" in baselines or backend.cuda,
                         {"plan": "plan", "unfused": "unfused", **(names or {})})
    finally:
        restore_threads()


def restore_threads() -> None:
    """The caller's OpenMP thread count again, as before the first program set it."""
    if "before" in _THREADS:
        lib, before = _THREADS.pop("before")
        lib.fs_set_threads(before)


def _run_plan(prep, plan, unfused, threads, repeat, warmup, seed, rtol, check_each, time_it, input_values,
              progress, backend, with_torch: bool, names: Mapping[str, str]) -> RunReport:
    from fusesearch.pipeline import activation_bytes
    from fusesearch.verify import session, session_feeds

    check_args(repeat, warmup, threads, rtol)
    say = progress or (lambda _: None)
    graph = prep.graph
    say("reference")
    canonical, weights, feeds, reference = _reference(prep, {"plan": plan, "unfused": unfused}, seed, input_values)
    device = backend.program_device(threads)
    programs: dict[str, Layout] = {}
    errors: dict[str, float] = {}
    amplified: dict[str, float | None] = {}
    for label, p in (("plan", plan), ("unfused", unfused)):
        say(f"compiling {label}")
        steps = plan_steps(graph, p)
        programs[label], errors[label], bad = checked(
            names[label], lambda reuse, steps=steps: (
                Program(graph, canonical, steps, weights, threads, reuse=reuse) if device is None
                else CudaProgram(graph, canonical, steps, weights, device, threads, reuse=reuse)),
            canonical, feeds, reference, rtol, check_each)
        amplified[label] = bad.max_abs if bad else None
    timings: dict[str, Timing] = {}
    ort_provider = "CPUExecutionProvider"
    torch_info = None
    if time_it:
        say("checking ONNX Runtime on the model as given")
        original = original_model(prep)
        checked_original = None if original is None else check_original(original, threads, feeds, reference, rtol)
        ort_models = ([("ort_enable_all", canonical, "all")] if original is None else
                      [("ort_enable_all", original, "all"), ("ort_enable_all_canonical", canonical, "all")])
        ort_models += [("ort_enable_extended", canonical if original is None else original, "extended"),
                       ("ort_disable_all", canonical, "none")]
        if device is not None:  # the programs on their inputs, resident since the check
            runs = {label: programs[label].run for label in ("plan", "unfused")}
            clocks = {label: device.clock() for label in runs}
            for key, model, level in ort_models:
                runs[key], ort_provider = device.ort_runner(model, feeds, optimize=level)
                if ort_provider == CUDA_EP:
                    clocks[key] = device.clock()
        else:
            runs, clocks = {}, {}
            for label in ("plan", "unfused"):
                runs[label] = lambda program=programs[label]: program(feeds)
            for key, model, level in ort_models:
                sess = (checked_original if key == "ort_enable_all" and checked_original is not None
                        else session(model, threads=threads, optimize=level))
                names = [o.name for o in sess.get_outputs()]
                ort_feeds = session_feeds(sess, feeds)
                runs[key] = lambda s=sess, n=names, f=ort_feeds: s.run(n, f)
        if with_torch:  # PyTorch eager and torch.compile, each checked equal to ONNX Runtime first
            say("converting to PyTorch and compiling")
            with torch_threads(threads):
                more, more_clocks, torch_info = baselines(canonical, weights, feeds, reference, rtol,
                                                          cuda=device is not None, tf32=graph.allow_tf32)
            runs.update(more)
            clocks.update(more_clocks)
        say("timing")
        for program in programs.values():  # OpenMP's thread count, for the kernels of both libraries
            if isinstance(program, Program) and program.library is not None:
                program.library.fs_set_threads(threads)
        warn_if_loaded(threads)
        with torch_threads(threads):
            timings = _timed(runs, warmup, repeat, clocks)
    steps = programs["plan"].steps
    return RunReport(
        model=getattr(plan.model, "name", ""), strategy=plan.strategy, threads=threads, repeat=repeat, warmup=warmup,
        rtol=rtol, timings=timings, arena_peak_bytes=programs["plan"].peak_bytes,
        unfused_arena_peak_bytes=programs["unfused"].peak_bytes, activation_bytes=activation_bytes(graph),
        max_rel_err=errors["plan"], unfused_max_rel_err=errors["unfused"], segments=programs["plan"].segment_counts,
        unfused_segments=programs["unfused"].segment_counts, kernels=sum(s.how == "generated" for s in steps),
        library_steps=sum(s.how == "library" for s in steps), backend=backend.name,
        cuda_graph=getattr(programs["plan"], "cuda_graph", None),
        unfused_cuda_graph=getattr(programs["unfused"], "cuda_graph", None), ort_provider=ort_provider,
        amplified_err=amplified["plan"], unfused_amplified_err=amplified["unfused"], torch=torch_info)

