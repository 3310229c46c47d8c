"""fusesearch.backends.nvrtc: cubins and ptxas resources with NVRTC and nvcc, no GPU needed.

The log fixtures are verbatim `-Xptxas=-v` output of CUDA 13.0.88 (nvcc and the
nvidia-cuda-nvrtc 13.0.88 wheel) compiling `SOURCE` / `HEAVY` below (only `Compile time` lines
dropped from the nvcc ones). Compile tests skip, with the reason, only where no compiler is usable.
"""

from __future__ import annotations

import pickle
import struct

import pytest

from fusesearch.backends.nvrtc import (
    ARCHES,
    CompileError,
    CompileResult,
    KernelResources,
    compile_cuda,
    parse_ptxas_log,
    toolchain_available,
)
from fusesearch.errors import BadInput, FusesearchError

SOURCE = r"""
extern "C" __global__ void saxpy(int n, float a, const float* x, float* y) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
extern "C" __global__ void tiled(const float* x, float* y) {
  __shared__ float tile[1024];
  int t = threadIdx.x;
  tile[t] = x[blockIdx.x * 1024 + t];
  __syncthreads();
  y[blockIdx.x * 1024 + t] = tile[1023 - t];
}
__global__ void spill(const float* x, float* y, int k) {
  float loc[256];
  for (int j = 0; j < 256; ++j) loc[j] = x[j * blockDim.x + threadIdx.x];
  float s = 0.f;
  for (int j = 0; j < 256; ++j) s += loc[(j * k) & 255];
  y[threadIdx.x] = s;
}
template <int N> __global__ void tmpl(float* y) { y[threadIdx.x] = N; }
template __global__ void tmpl<3>(float*);
"""

HEAVY = r"""
extern "C" __global__ void heavy(const float* x, float* y) {
  float acc[32];
  #pragma unroll
  for (int j = 0; j < 32; ++j) acc[j] = x[j * 256 + threadIdx.x];
  #pragma unroll
  for (int r = 0; r < 8; ++r) {
    #pragma unroll
    for (int j = 0; j < 32; ++j) acc[j] = acc[j] * acc[(j + r + 1) & 31] + 1.0f;
  }
  float s = 0.f;
  #pragma unroll
  for (int j = 0; j < 32; ++j) s += acc[j];
  y[threadIdx.x] = s;
}
"""

SYNTAX_ERROR = 'extern "C" __global__ void k(float* y) { y[0] = 1.0f }\n'

NVRTC_LOG_SM90 = (  # SOURCE, NVRTC, sm_90
    "ptxas info    : 0 bytes gmem\n"
    "ptxas info    : Compiling entry function '_Z4tmplILi3EEvPf' for 'sm_90'\n"
    "ptxas info    : Function properties for _Z4tmplILi3EEvPf\n"
    "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Used 10 registers, used 0 barriers\n"
    "ptxas info    : Compile time = 1.564 ms\n"
    "ptxas info    : Compiling entry function '_Z5spillPKfPfi' for 'sm_90'\n"
    "ptxas info    : Function properties for _Z5spillPKfPfi\n"
    "ptxas         .     1024 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Used 40 registers, used 0 barriers, 1024 bytes cumulative stack size\n"
    "ptxas info    : Compile time = 92.178 ms\n"
    "ptxas info    : Compiling entry function 'tiled' for 'sm_90'\n"
    "ptxas info    : Function properties for tiled\n"
    "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Used 14 registers, used 1 barriers, 4096 bytes smem\n"
    "ptxas info    : Compile time = 2.068 ms\n"
    "ptxas info    : Compiling entry function 'saxpy' for 'sm_90'\n"
    "ptxas info    : Function properties for saxpy\n"
    "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Used 10 registers, used 0 barriers\n"
    "ptxas info    : Compile time = 1.378 ms\n"
)

NVRTC_SPILL_LOG_SM90 = (  # HEAVY, NVRTC, sm_90, -maxrregcount=24
    "ptxas info    : Overriding maximum register limit 256 for 'heavy' with  24 of maxrregcount option\n"
    "ptxas info    : 0 bytes gmem\n"
    "ptxas info    : Compiling entry function 'heavy' for 'sm_90'\n"
    "ptxas info    : Function properties for heavy\n"
    "ptxas         .     296 bytes stack frame, 620 bytes spill stores, 640 bytes spill loads\n"
    "ptxas info    : Used 24 registers, used 0 barriers, 296 bytes cumulative stack size\n"
    "ptxas info    : Compile time = 21.926 ms\n"
)

NVCC_LOG_SM80 = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z4tmplILi3EEvPf' for 'sm_80'
ptxas info    : Function properties for _Z4tmplILi3EEvPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers, 360 bytes cmem[0]
ptxas info    : Compiling entry function '_Z5spillPKfPfi' for 'sm_80'
ptxas info    : Function properties for _Z5spillPKfPfi
    1024 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 1024 bytes cumulative stack size, 372 bytes cmem[0]
ptxas info    : Compiling entry function 'tiled' for 'sm_80'
ptxas info    : Function properties for tiled
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 1 barriers, 4096 bytes smem, 368 bytes cmem[0]
ptxas info    : Compiling entry function 'saxpy' for 'sm_80'
ptxas info    : Function properties for saxpy
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers, 376 bytes cmem[0]
"""

NVCC_SPILL_LOG_SM80 = """\
ptxas warning : For profile sm_80 adjusting per thread register count of 16 to lower bound of 24
ptxas info    : Overriding maximum register limit 256 for 'heavy' with  24 of maxrregcount option
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'heavy' for 'sm_80'
ptxas info    : Function properties for heavy
    296 bytes stack frame, 620 bytes spill stores, 640 bytes spill loads
ptxas info    : Used 24 registers, used 0 barriers, 296 bytes cumulative stack size, 368 bytes cmem[0]
ptxas info    : Compile time = 22.839 ms
"""

NVCC_RDC_LOG_SM90 = """\
ptxas info    : 0 bytes gmem
ptxas info    : Function properties for _Z5twicef
    40 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compile time = 7.402 ms
ptxas info    : Compiling entry function 'use' for 'sm_90'
ptxas info    : Function properties for use
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 24 registers, used 0 barriers
ptxas info    : Compile time = 2.977 ms
"""

# ----------------------------------------------------------------------------- parsing (pure)


def test_parse_nvrtc_log():
    assert parse_ptxas_log(NVRTC_LOG_SM90, "sm_90") == (
        KernelResources("_Z4tmplILi3EEvPf", "sm_90", registers=10),
        KernelResources("_Z5spillPKfPfi", "sm_90", registers=40, stack_bytes=1024),
        KernelResources("tiled", "sm_90", registers=14, smem_bytes=4096),
        KernelResources("saxpy", "sm_90", registers=10),
    )


def test_parse_nvcc_log_with_cmem():
    assert parse_ptxas_log(NVCC_LOG_SM80, "sm_80") == (
        KernelResources("_Z4tmplILi3EEvPf", "sm_80", registers=8, cmem_bytes=360),
        KernelResources("_Z5spillPKfPfi", "sm_80", registers=32, stack_bytes=1024, cmem_bytes=372),
        KernelResources("tiled", "sm_80", registers=12, smem_bytes=4096, cmem_bytes=368),
        KernelResources("saxpy", "sm_80", registers=10, cmem_bytes=376),
    )


@pytest.mark.parametrize("log, arch", [(NVRTC_SPILL_LOG_SM90, "sm_90"),
                                       (NVCC_SPILL_LOG_SM80, "sm_80")])
def test_parse_spills_in_both_formats(log, arch):
    (heavy,) = parse_ptxas_log(log, arch)
    assert (heavy.kernel, heavy.arch, heavy.registers) == ("heavy", arch, 24)
    assert (heavy.stack_bytes, heavy.spill_store_bytes, heavy.spill_load_bytes) == (296, 620, 640)


def test_parse_skips_device_functions():
    use = KernelResources("use", "sm_90", registers=24)  # not _Z5twicef, a device function
    assert parse_ptxas_log(NVCC_RDC_LOG_SM90, "sm_90") == (use,)


def _blocks(log: str) -> list[list[str]]:
    """The log cut at each `Compiling entry function` line."""
    blocks: list[list[str]] = [[]]
    for line in log.splitlines():
        if "Compiling entry function" in line:
            blocks.append([])
        blocks[-1].append(line)
    return blocks


def test_parse_is_robust_to_ordering():
    """Kernels reversed, and each `Function properties` block moved before its entry line."""
    head, *kernels = _blocks(NVCC_LOG_SM80)
    shuffled = head + [line for b in reversed(kernels) for line in (b[1], b[2], b[0], *b[3:])]
    expected = parse_ptxas_log(NVCC_LOG_SM80, "sm_80")
    got = parse_ptxas_log("\n".join(shuffled), "sm_80")
    assert sorted(got, key=lambda r: r.kernel) == sorted(expected, key=lambda r: r.kernel)


def test_parse_old_format_without_entry_lines():
    """Older ptxas: no `Compiling entry function` line, smem as static+dynamic, more cmem banks."""
    log = ("ptxas info    : Function properties for k\n"
           "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 1 register, 4096+0 bytes smem, 44 bytes cmem[0], 4 bytes cmem[2]\n")
    assert parse_ptxas_log(log, "sm_80") == (KernelResources(
        "k", "sm_80", registers=1, smem_bytes=4096, spill_store_bytes=4, spill_load_bytes=4,
        stack_bytes=8, cmem_bytes=44),)


def test_parse_empty_log_and_row():
    assert parse_ptxas_log("", "sm_90") == ()
    row = KernelResources("k", "sm_90", registers=10, smem_bytes=4096).to_row()
    assert row == {"kernel": "k", "arch": "sm_90", "registers": 10, "smem_bytes": 4096,
                   "spill_store_bytes": 0, "spill_load_bytes": 0, "stack_bytes": 0, "cmem_bytes": 0}


def test_compile_error_is_one_line_and_picklable():
    log = '\nkernel.cu(1): warning: x\nkernel.cu(3): error: expected a ";"\n'
    err = CompileError("sm_90", log, "nvcc")
    message = str(err)
    assert "\n" not in message and "sm_90" in message
    assert 'kernel.cu(3): error: expected a ";"' in message
    again = pickle.loads(pickle.dumps(err))
    assert (str(again), again.arch, again.log, again.compiler) == (message, "sm_90", log, "nvcc")


def test_bad_requests_are_bad_input():
    with pytest.raises(BadInput, match="sm_XY"):
        compile_cuda(SOURCE, arch="volta")
    with pytest.raises(BadInput, match="tuple of strings"):
        compile_cuda(SOURCE, options="-maxrregcount=24")
    with pytest.raises(BadInput, match="not one of"):
        compile_cuda(SOURCE, compiler="clang")
    with pytest.raises(BadInput, match="not one of"):
        toolchain_available("clang")


# ----------------------------------------------------------------------------- compiling

TOOLCHAIN = toolchain_available()
needs_compiler = pytest.mark.skipif(not TOOLCHAIN, reason=f"no CUDA compiler: {TOOLCHAIN.reason}")


def _compiler(name: str):
    decision = toolchain_available(name)
    return pytest.param(name, marks=pytest.mark.skipif(not decision, reason=decision.reason))


COMPILERS = [_compiler("nvrtc"), _compiler("nvcc")]


def test_toolchain_decision_names_a_compiler():
    assert not TOOLCHAIN or "nvrtc" in TOOLCHAIN.reason or "nvcc" in TOOLCHAIN.reason
    assert TOOLCHAIN or TOOLCHAIN.reason.startswith("no CUDA compiler")


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("arch", ARCHES)
def test_saxpy_small_registers_no_spill(compiler, arch):
    result = compile_cuda(SOURCE, arch=arch, compiler=compiler)
    saxpy = result.resource("saxpy")
    assert (result.compiler, result.arch, saxpy.arch) == (compiler, arch, arch)
    assert 0 < saxpy.registers <= 32
    assert saxpy.spill_store_bytes == saxpy.spill_load_bytes == saxpy.stack_bytes == 0
    assert saxpy.smem_bytes == 0
    kernels = {r.kernel for r in result.resources}
    assert kernels == {"saxpy", "tiled", "_Z5spillPKfPfi", "_Z4tmplILi3EEvPf"}


@needs_compiler
@pytest.mark.parametrize("arch", ARCHES)
def test_static_shared_memory(arch):
    assert compile_cuda(SOURCE, arch=arch).resource("tiled").smem_bytes == 4096


@needs_compiler
def test_dynamically_indexed_local_array_lives_on_the_stack():
    spill = compile_cuda(SOURCE, arch="sm_90").resource("spill")  # found by its C++ name
    assert spill.kernel == "_Z5spillPKfPfi" and spill.stack_bytes >= 256 * 4


@needs_compiler
def test_register_cap_forces_spills():
    heavy = compile_cuda(HEAVY, arch="sm_90", options=("-maxrregcount=24",)).resource("heavy")
    assert heavy.registers <= 24
    assert heavy.spill_store_bytes > 0 and heavy.spill_load_bytes > 0 and heavy.stack_bytes > 0
    assert compile_cuda(HEAVY, arch="sm_90").resource("heavy").spill_store_bytes == 0


@pytest.mark.parametrize("compiler", COMPILERS)
def test_syntax_error_raises_one_line_compile_error(compiler):
    with pytest.raises(CompileError) as info:
        compile_cuda(SYNTAX_ERROR, arch="sm_90", compiler=compiler)
    message = str(info.value)
    assert "\n" not in message and "sm_90" in message and compiler in message
    assert 'kernel.cu(1): error: expected a ";"' in message
    assert info.value.arch == "sm_90" and "1 error detected" in info.value.log


def test_unsupported_arch_is_a_compile_error():
    if not toolchain_available("nvrtc"):
        pytest.skip("needs nvrtc")
    with pytest.raises(CompileError, match="sm_70.*gpu-architecture"):
        compile_cuda(SOURCE, arch="sm_70", compiler="nvrtc")  # CUDA 13 dropped Volta


@pytest.mark.parametrize("arch", ARCHES)
def test_nvrtc_and_nvcc_agree(arch):
    if not (toolchain_available("nvrtc") and toolchain_available("nvcc")):
        pytest.skip("needs both nvrtc and nvcc")
    by_nvrtc = compile_cuda(SOURCE, arch=arch, compiler="nvrtc")
    by_nvcc = compile_cuda(SOURCE, arch=arch, compiler="nvcc")
    assert by_nvrtc.resource("saxpy").registers == by_nvcc.resource("saxpy").registers
    assert by_nvrtc.resource("tiled").smem_bytes == by_nvcc.resource("tiled").smem_bytes == 4096


def _elf_end(cubin: bytes) -> int:
    """Where an ELF64 file ends: past its section or program header table, whichever is last."""
    assert cubin[:4] == b"\x7fELF" and cubin[4] == 2 and cubin[5] == 1  # ELF64, little-endian
    (phoff,) = struct.unpack_from("<Q", cubin, 0x20)
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    return max(phoff + phentsize * phnum, shoff + shentsize * shnum)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_cubin_is_a_whole_elf_file(compiler):
    """Not one byte short (CuPy 14.2's getCUBIN is): the header tables end exactly at EOF."""
    cubin = compile_cuda(SOURCE, arch="sm_90", compiler=compiler).cubin
    assert _elf_end(cubin) == len(cubin)


def test_nvrtc_cubin_has_the_size_nvrtc_reports():
    if not toolchain_available("nvrtc"):
        pytest.skip("needs nvrtc")
    import ctypes

    from fusesearch.backends import nvrtc

    nv = nvrtc._load_nvrtc()
    prog, size = ctypes.c_void_p(), ctypes.c_size_t()
    created = nv.lib.nvrtcCreateProgram(ctypes.byref(prog), SOURCE.encode(), b"kernel.cu",
                                        0, None, None)
    nv.check(created, "create")
    try:
        flags = [b"--gpu-architecture=sm_90", *(o.encode() for o in nvrtc.NVRTC_OPTIONS)]
        argv = (ctypes.c_char_p * len(flags))(*flags)
        nv.check(nv.lib.nvrtcCompileProgram(prog, len(flags), argv), "compile")
        nv.check(nv.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "size")
    finally:
        nv.lib.nvrtcDestroyProgram(ctypes.byref(prog))
    assert len(compile_cuda(SOURCE, arch="sm_90", compiler="nvrtc").cubin) == size.value


@needs_compiler
def test_results_are_cached_and_lookups_explain_misses():
    first = compile_cuda(SOURCE, arch="sm_80")
    assert isinstance(first, CompileResult) and compile_cuda(SOURCE, arch="sm_80") is first
    assert compile_cuda(SOURCE, arch="sm_80", options=("-lineinfo",)) is not first
    assert first.resource("tmpl").kernel == "_Z4tmplILi3EEvPf"
    with pytest.raises(FusesearchError, match="kernels: .*saxpy"):
        first.resource("missing")
    assert "cubin" not in repr(first) and "saxpy" in repr(first)


@pytest.fixture
def without_nvrtc(monkeypatch):
    """The module as on a machine where no libnvrtc loads (probe cache cleared around the test)."""
    from fusesearch.backends import nvrtc

    monkeypatch.setattr(nvrtc, "_find_nvrtc", lambda: "libnvrtc not usable (none found)")
    nvrtc._probe.cache_clear()
    yield nvrtc
    nvrtc._probe.cache_clear()


def test_auto_falls_back_to_nvcc(without_nvrtc):
    if not toolchain_available("nvcc"):
        pytest.skip("needs nvcc")
    result = compile_cuda(SOURCE + "// fallback\n", arch="sm_90")
    assert result.compiler == "nvcc" and result.resource("saxpy").registers > 0


def test_missing_compilers_are_a_refusal_not_a_crash(without_nvrtc, monkeypatch):
    def no_nvcc():
        raise without_nvrtc.ToolchainMissing("nvcc not found on PATH")

    monkeypatch.setattr(without_nvrtc, "_find_nvcc", no_nvcc)
    decision = toolchain_available()
    assert not decision
    assert "libnvrtc not usable" in decision.reason and "nvcc not found" in decision.reason
    with pytest.raises(without_nvrtc.ToolchainMissing, match="libnvrtc not usable.*nvcc not found"):
        compile_cuda(SOURCE + "// nothing\n")


def test_cuda_headers_come_from_a_folder_that_holds_crt_too(tmp_path, monkeypatch):
    """A wheel folder with mma.h but not the crt/ headers it includes (nvidia-cuda-runtime without
    nvidia-cuda-crt, as a GPU image can have) is passed over for one that has both."""
    from fusesearch.backends import nvrtc

    half, whole = tmp_path / "half", tmp_path / "whole"
    for home in (half, whole):
        (home / "include").mkdir(parents=True)
        (home / "include" / "mma.h").write_text("#include \"crt/mma.h\"\n")
    (whole / "include" / "crt").mkdir()
    (whole / "include" / "crt" / "mma.h").write_text("\n")
    monkeypatch.setattr(nvrtc, "_wheel_homes", lambda: [half, whole])
    monkeypatch.setattr(nvrtc, "_cuda_homes", lambda: [])
    nvrtc._nvrtc_include_flags.cache_clear()
    try:
        assert nvrtc._nvrtc_include_flags(str(half / "lib" / "libnvrtc.so.13")) == (f"--include-path={whole / 'include'}",)
        monkeypatch.setattr(nvrtc, "_wheel_homes", lambda: [half])
        nvrtc._nvrtc_include_flags.cache_clear()
        assert nvrtc._nvrtc_include_flags(str(half / "lib" / "libnvrtc.so.13")) == ()
    finally:
        nvrtc._nvrtc_include_flags.cache_clear()
