"""Compile CUDA C++ to a cubin and read the kernels' ptxas resources, without a GPU.

Problem: a generated CUDA kernel must be checked (compiles? registers, static shared memory,
spills?) on machines with no GPU, with figures that match what the GPU will load; a missing
compiler is a decision the caller reports, not a crash.
Approach: `compile_cuda(source, arch, options, compiler)`, cached by (sha256(source), arch,
options, compiler): "nvrtc" (libnvrtc through ctypes, the pip wheel then the system CUDA; the
cubin sized by nvrtcGetCUBINSize, as CuPy 14.2's getCUBIN drops the last byte), "nvcc"
(`nvcc -cubin -Xptxas=-v` with a timeout) or "auto" (nvrtc, else nvcc when nvrtc is missing).
`parse_ptxas_log(log)` reads ptxas `-v` by name, not position: the frame line belongs to the last
`Function properties for X`, the `Used` line to the last `Compiling entry function`; device
functions get no row.
Invariants: a `CompileResult` holds the cubin as the compiler sized it and one `KernelResources`
per entry function in log order; a failed compile raises a one-line `CompileError` (compiler, arch,
first error); a missing compiler raises `ToolchainMissing` (`toolchain_available` refuses)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fusesearch.errors import BadInput, FusesearchError
from fusesearch.groups import FusionDecision

logger = logging.getLogger(__name__)

ARCHES = ("sm_80", "sm_90")
COMPILERS = ("nvrtc", "nvcc")
NVCC_TIMEOUT_S = 120.0
NVRTC_OPTIONS = ("--ptxas-options=-v", "-default-device", "--std=c++17")
NVCC_OPTIONS = ("-Xptxas=-v", "-std=c++17")
SOURCE_NAME = "kernel.cu"  # the file name both compilers print in their diagnostics

_ARCH_RE = re.compile(r"sm_\d+[af]?")
_NVRTC_SUCCESS = 0
_NVRTC_ERROR_BUILTIN_OPERATION_FAILURE = 7  # libnvrtc-builtins could not be loaded
_NVRTC_SONAME_RE = re.compile(r"libnvrtc\.so(\.\d+)*")  # not .alt, not -builtins
_PROBE_SOURCE = 'extern "C" __global__ void fusesearch_probe(float* y) { y[threadIdx.x] = 1.0f; }\n'


# ----------------------------------------------------------------------------- values


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one entry function on one arch (bytes per thread unless smem)."""

    kernel: str  # as the log names it: mangled, or the extern "C" name
    arch: str
    registers: int
    smem_bytes: int = 0  # static shared memory per block
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0
    stack_bytes: int = 0
    cmem_bytes: int = 0  # constant bank 0 (kernel parameters) when reported, else 0

    def to_row(self) -> dict[str, int | str]:
        return asdict(self)


@dataclass(frozen=True)
class CompileResult:
    arch: str
    cubin: bytes = field(repr=False)
    log: str = field(repr=False)
    resources: tuple[KernelResources, ...]
    compiler: str  # "nvrtc" | "nvcc"

    def resource(self, kernel_name: str) -> KernelResources:
        """The resources of `kernel_name`: its exact (mangled) name, or an unambiguous C++ name."""
        for r in self.resources:
            if r.kernel == kernel_name:
                return r
        prefix = f"_Z{len(kernel_name)}{kernel_name}"  # Itanium mangling of a global function
        mangled = [r for r in self.resources if r.kernel.startswith(prefix)]
        if len(mangled) == 1:
            return mangled[0]
        names = ", ".join(r.kernel for r in self.resources) or "none"
        raise FusesearchError(f"no single kernel named {kernel_name!r} in the {self.arch} cubin; "
                              f"kernels: {names}")


class CompileError(FusesearchError):
    """The compiler rejected the source (or timed out); `.log` holds its whole output."""

    def __init__(self, arch: str, log: str, compiler: str) -> None:
        self.arch, self.log, self.compiler = arch, log, compiler
        super().__init__(f"{compiler} could not compile the kernel for {arch}: "
                         f"{first_error_line(log)} (full compiler log in CompileError.log)")

    def __reduce__(self):  # picklable across Dask workers despite the custom __init__
        return (type(self), (self.arch, self.log, self.compiler))


class ToolchainMissing(FusesearchError):
    """No usable compiler of the kind asked for; the message says what was searched and the fix."""


def first_error_line(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\berror\b", line, re.IGNORECASE)]
    return (errors or lines or ["the compiler printed nothing"])[0]


# ----------------------------------------------------------------------------- ptxas log

_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPS_RE = re.compile(r"Function properties for (\S+)")
_FRAME_RE = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers?")
_SMEM_RE = re.compile(r"(\d+)(?:\+\d+)? bytes smem")  # old ptxas wrote static+dynamic
_CMEM0_RE = re.compile(r"(\d+) bytes cmem\[0\]")
_CUMULATIVE_STACK_RE = re.compile(r"(\d+) bytes cumulative stack size")


def _used_fields(line: str) -> dict[str, int]:
    """The figures of one `Used N registers, ...` line."""
    def grab(pattern: re.Pattern[str]) -> int:
        m = pattern.search(line)
        return int(m[1]) if m else 0

    return {"registers": grab(_USED_RE), "smem_bytes": grab(_SMEM_RE),
            "cmem_bytes": grab(_CMEM0_RE), "cumulative_stack_bytes": grab(_CUMULATIVE_STACK_RE)}


def _kernel_resources(name: str, arch: str, used: dict[str, int],
                      frame: tuple[int, int, int] | None) -> KernelResources:
    no_frame_line = (used.get("cumulative_stack_bytes", 0), 0, 0)
    stack_bytes, spill_store_bytes, spill_load_bytes = frame or no_frame_line
    return KernelResources(kernel=name, arch=arch, registers=used.get("registers", 0),
                           smem_bytes=used.get("smem_bytes", 0),
                           spill_store_bytes=spill_store_bytes, spill_load_bytes=spill_load_bytes,
                           stack_bytes=stack_bytes,
                           cmem_bytes=used.get("cmem_bytes", 0))


def parse_ptxas_log(log: str, arch: str) -> tuple[KernelResources, ...]:
    """One `KernelResources` per entry function of an nvcc or NVRTC `ptxas -v` log, in log order.

    `arch` is used where the log does not name one (it does on `Compiling entry function` lines).
    """
    used: dict[str, dict[str, int]] = {}  # entry -> figures of its `Used` line ({} if none yet)
    frames: dict[str, tuple[int, int, int]] = {}
    arches: dict[str, str] = {}
    entry = props = None
    for line in log.splitlines():
        if m := _ENTRY_RE.search(line):
            entry, arches[m[1]] = m[1], m[2]
            used.setdefault(entry, {})
        elif m := _PROPS_RE.search(line):
            props = m[1]
        elif (m := _FRAME_RE.search(line)) and props is not None:
            frames[props] = (int(m[1]), int(m[2]), int(m[3]))
        elif _USED_RE.search(line) and (owner := entry or props) is not None:
            used[owner] = _used_fields(line)
            entry = None  # a later `Used` without a new entry line belongs to `props`
    return tuple(_kernel_resources(name, arches.get(name, arch), figures, frames.get(name))
                 for name, figures in used.items())


# ----------------------------------------------------------------------------- locating compilers


def _nvidia_roots() -> list[str]:
    """The `nvidia` namespace folders of the installed nvidia-* wheels, in sys.path order."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec else []


def _pip_nvrtc_paths() -> list[Path]:
    """libnvrtc.so.N from the nvidia-cuda-nvrtc wheels (nvidia/cu13/lib, nvidia/cuda_nvrtc/lib)."""
    found = [p for root in _nvidia_roots() for p in Path(root).glob("*/lib/libnvrtc.so*")
             if _NVRTC_SONAME_RE.fullmatch(p.name)]
    return sorted(found, key=lambda p: p.name, reverse=True)  # newest major first


def _cuda_homes() -> list[Path]:
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    return [Path(h) for h in dict.fromkeys(homes) if h]


def _system_nvrtc_paths() -> list[str]:
    paths = [str(p) for home in _cuda_homes() for p in sorted((home / "lib64").glob("libnvrtc.so*"))
             if _NVRTC_SONAME_RE.fullmatch(p.name)]
    soname = ctypes.util.find_library("nvrtc")  # ldconfig's cache
    return paths + ([soname] if soname else [])


@dataclass(frozen=True)
class _Nvrtc:
    lib: ctypes.CDLL
    path: str

    def version(self) -> str:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        return f"{major.value}.{minor.value}"

    def check(self, status: int, call: str) -> None:
        if status != _NVRTC_SUCCESS:
            text = self.lib.nvrtcGetErrorString(status).decode(errors="replace")
            raise FusesearchError(f"{call} failed with {text} ({self.path})")


def _bind(lib: ctypes.CDLL) -> None:
    """Declare the signatures of the NVRTC calls this module makes."""
    ptr, size_p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)
    char_pp = ctypes.POINTER(ctypes.c_char_p)
    signatures = {
        "nvrtcVersion": [ctypes.POINTER(ctypes.c_int)] * 2,
        "nvrtcCreateProgram": [ctypes.POINTER(ptr), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                               char_pp, char_pp],
        "nvrtcCompileProgram": [ptr, ctypes.c_int, char_pp],
        "nvrtcGetProgramLogSize": [ptr, size_p],
        "nvrtcGetProgramLog": [ptr, ctypes.c_char_p],
        "nvrtcGetCUBINSize": [ptr, size_p],
        "nvrtcGetCUBIN": [ptr, ctypes.c_char_p],
        "nvrtcDestroyProgram": [ctypes.POINTER(ptr)],
    }
    for name, argtypes in signatures.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, ctypes.c_int
    lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p


def _open_nvrtc(path: str) -> _Nvrtc:
    """Load libnvrtc; its builtins library, when beside it, first and global, so NVRTC finds it."""
    here = Path(path).parent  # "." for a bare soname from ldconfig: the loader finds builtins
    builtins = [p for p in sorted(here.glob("libnvrtc-builtins.so*")) if ".alt." not in p.name]
    for lib_path in builtins if here.parts else []:
        ctypes.CDLL(str(lib_path), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(path)
    _bind(lib)
    return _Nvrtc(lib, path)


@functools.cache
def _find_nvrtc() -> _Nvrtc | str:
    """The first libnvrtc that loads, or why none did."""
    tried = []
    for path in [*map(str, _pip_nvrtc_paths()), *_system_nvrtc_paths()]:
        try:
            return _open_nvrtc(path)
        except (OSError, AttributeError) as exc:
            tried.append(f"{path}: {exc}")
    searched = "; ".join(tried) or (
        "not in the nvidia-cuda-nvrtc wheel, CUDA_HOME, CUDA_PATH, /usr/local/cuda or ldconfig")
    return f"libnvrtc not usable ({searched}); fix: pip install 'nvidia-cuda-nvrtc==13.0.*'"


def _load_nvrtc() -> _Nvrtc:
    found = _find_nvrtc()
    if isinstance(found, str):
        raise ToolchainMissing(found)
    return found


def _find_nvcc() -> str:
    candidates = [shutil.which("nvcc"), *(str(home / "bin" / "nvcc") for home in _cuda_homes())]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    raise ToolchainMissing("nvcc not found on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin; "
                           "fix: install the CUDA toolkit or use compiler='nvrtc'")


# ----------------------------------------------------------------------------- compiling


def _nvrtc_log(nv: _Nvrtc, prog: ctypes.c_void_p) -> str:
    size = ctypes.c_size_t()
    nv.check(nv.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
    buffer = ctypes.create_string_buffer(max(size.value, 1))
    nv.check(nv.lib.nvrtcGetProgramLog(prog, buffer), "nvrtcGetProgramLog")
    return buffer.value.decode(errors="replace")


def _nvrtc_cubin(nv: _Nvrtc, prog: ctypes.c_void_p) -> bytes:
    size = ctypes.c_size_t()
    nv.check(nv.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
    buffer = ctypes.create_string_buffer(size.value)
    nv.check(nv.lib.nvrtcGetCUBIN(prog, buffer), "nvrtcGetCUBIN")
    return buffer.raw[: size.value]  # .raw: a cubin holds NUL bytes


def _has_cuda_headers(home: Path) -> bool:
    """`home/include` holds mma.h and the crt/ headers it includes (the nvidia-cuda-runtime and
    nvidia-cuda-crt wheels fill one include/ together; a folder with only the first is unusable)."""
    return (home / "include" / "mma.h").is_file() and (home / "include" / "crt" / "mma.h").is_file()


def _wheel_homes() -> list[Path]:
    """Every nvidia/<name> folder of the installed nvidia wheels, across all site folders."""
    return [p for root in _nvidia_roots() for p in sorted(Path(root).iterdir()) if p.is_dir()]


def _include_flag(homes) -> tuple[str, ...]:
    """`--include-path` of the first of `homes` that holds the CUDA headers; () when none does."""
    home = next((h for h in dict.fromkeys(homes) if _has_cuda_headers(h)), None)
    return (f"--include-path={home / 'include'}",) if home else ()


@functools.cache
def _nvrtc_include_flags(path: str) -> tuple[str, ...]:
    """`--include-path` of the CUDA headers (mma.h, cuda_fp16.h) beside libnvrtc, in another
    nvidia wheel folder, or in a CUDA home: NVRTC searches no directory of its own."""
    return _include_flag((Path(path).parent.parent, *_wheel_homes(), *_cuda_homes()))


def include_flags() -> tuple[str, ...]:
    """NVRTC options that find the CUDA headers (mma.h, cuda_fp16.h) the tensor-core kernels
    include, for any NVRTC front end (CuPy's too); () when none is found."""
    found = _find_nvrtc()
    if not isinstance(found, str):
        return _nvrtc_include_flags(found.path)
    return _include_flag((*_wheel_homes(), *_cuda_homes()))


def _nvrtc_compile_program(nv: _Nvrtc, prog: ctypes.c_void_p, arch: str,
                           options: tuple[str, ...]) -> tuple[bytes, str]:
    flags = (f"--gpu-architecture={arch}", *NVRTC_OPTIONS, *_nvrtc_include_flags(nv.path), *options)
    argv = (ctypes.c_char_p * len(flags))(*(f.encode() for f in flags))
    status = nv.lib.nvrtcCompileProgram(prog, len(flags), argv)
    log = _nvrtc_log(nv, prog)
    if status == _NVRTC_ERROR_BUILTIN_OPERATION_FAILURE:
        raise ToolchainMissing(f"libnvrtc at {nv.path} cannot run: {first_error_line(log)}")
    if status != _NVRTC_SUCCESS:
        raise CompileError(arch, log or nv.lib.nvrtcGetErrorString(status).decode(), "nvrtc")
    return _nvrtc_cubin(nv, prog), log


def _compile_nvrtc(source: str, arch: str, options: tuple[str, ...]) -> CompileResult:
    nv = _load_nvrtc()
    prog = ctypes.c_void_p()
    nv.check(nv.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), SOURCE_NAME.encode(),
                                       0, None, None), "nvrtcCreateProgram")
    try:
        cubin, log = _nvrtc_compile_program(nv, prog, arch, options)
    finally:
        nv.lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return CompileResult(arch, cubin, log, parse_ptxas_log(log, arch), "nvrtc")


def _compile_nvcc(source: str, arch: str, options: tuple[str, ...]) -> CompileResult:
    nvcc = _find_nvcc()
    with tempfile.TemporaryDirectory(prefix="fusesearch-nvcc-") as tmp:
        Path(tmp, SOURCE_NAME).write_text(source)
        cmd = [nvcc, "-cubin", f"-arch={arch}", *NVCC_OPTIONS, *options,
               "-o", "kernel.cubin", SOURCE_NAME]
        try:
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, errors="replace",
                                  timeout=NVCC_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            timed_out = f"error: nvcc timed out after {NVCC_TIMEOUT_S:g} s"
            raise CompileError(arch, timed_out, "nvcc") from None
        except OSError as exc:
            raise ToolchainMissing(f"nvcc at {nvcc} cannot run: {exc}") from None
        log = proc.stderr + proc.stdout
        cubin_path = Path(tmp, "kernel.cubin")
        if proc.returncode != 0 or not cubin_path.is_file():
            raise CompileError(arch, log or f"error: nvcc exited with {proc.returncode}", "nvcc")
        cubin = cubin_path.read_bytes()
    return CompileResult(arch, cubin, log, parse_ptxas_log(log, arch), "nvcc")


def _compile_auto(source: str, arch: str, options: tuple[str, ...]) -> CompileResult:
    try:
        return _compile_nvrtc(source, arch, options)
    except ToolchainMissing as nvrtc_missing:
        logger.info("nvrtc unavailable, trying nvcc: %s", nvrtc_missing)
        try:
            return _compile_nvcc(source, arch, options)
        except ToolchainMissing as nvcc_missing:
            raise ToolchainMissing(f"{nvrtc_missing}; {nvcc_missing}") from None


_COMPILE = {"nvrtc": _compile_nvrtc, "nvcc": _compile_nvcc, "auto": _compile_auto}
_CACHE: dict[tuple[str, str, tuple[str, ...], str], CompileResult] = {}
_CACHE_LOCK = threading.Lock()


def _check_request(arch: str, options: tuple[str, ...], compiler: str) -> None:
    if not _ARCH_RE.fullmatch(arch):
        raise BadInput(f"arch {arch!r} is not a CUDA SM architecture; "
                       f"expected sm_XY, e.g. {', '.join(ARCHES)}")
    if isinstance(options, str) or not all(isinstance(o, str) for o in options):
        raise BadInput(f"options must be a tuple of strings, got {options!r}; "
                       "e.g. ('-maxrregcount=32',)")
    if compiler not in _COMPILE:
        raise BadInput(f"compiler {compiler!r} is not one of {', '.join(_COMPILE)}")


def compile_cuda(source: str, *, arch: str = "sm_90", options: tuple[str, ...] = (),
                 compiler: str = "auto") -> CompileResult:
    """Compile `source` to a cubin for `arch` and read its kernels' resources (cached in-process).

    Raises CompileError when the source does not compile, ToolchainMissing when no compiler of
    the kind asked for is usable, BadInput for a malformed arch, option list or compiler name.
    """
    _check_request(arch, options, compiler)
    options = tuple(options)
    key = (hashlib.sha256(source.encode()).hexdigest(), arch, options)
    reuse = (compiler, "nvrtc") if compiler == "auto" else (compiler,)  # auto prefers nvrtc
    with _CACHE_LOCK:
        for name in reuse:
            if (*key, name) in _CACHE:
                return _CACHE[(*key, name)]
    result = _COMPILE[compiler](source, arch, options)
    with _CACHE_LOCK:
        _CACHE.setdefault((*key, result.compiler), result)
        return _CACHE.setdefault((*key, compiler), result)


# ----------------------------------------------------------------------------- availability


def _probe_nvrtc() -> str:
    nv = _load_nvrtc()
    _compile_nvrtc(_PROBE_SOURCE, ARCHES[0], ())
    return f"nvrtc {nv.version()} ({nv.path})"


def _probe_nvcc() -> str:
    nvcc = _find_nvcc()
    _compile_nvcc(_PROBE_SOURCE, ARCHES[0], ())
    return f"nvcc ({nvcc})"


@functools.cache
def _probe(compiler: str) -> tuple[bool, str]:
    """Whether `compiler` builds a trivial kernel here, and what it is or why not (cached)."""
    try:
        return True, {"nvrtc": _probe_nvrtc, "nvcc": _probe_nvcc}[compiler]()
    except (FusesearchError, OSError) as exc:
        return False, f"{compiler}: {exc}"


def toolchain_available(compiler: str = "auto") -> FusionDecision:
    """Accept (naming each usable compiler) when `compiler` ("auto": either) can build a cubin."""
    if compiler not in _COMPILE:
        raise BadInput(f"compiler {compiler!r} is not one of {', '.join(_COMPILE)}")
    probes = [_probe(name) for name in (COMPILERS if compiler == "auto" else (compiler,))]
    usable = [text for ok, text in probes if ok]
    if usable:
        return FusionDecision.accept("; ".join(usable))
    return FusionDecision.refuse("no CUDA compiler: " + "; ".join(text for _, text in probes))
