"""The shared C runtime: a kernel's source holds the header and its own code, the runtime (the packed
GEMM, streamed stores) is compiled once per cache folder and flags, and a corrupt one is rebuilt."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from fusesearch.backends import cpu
from fusesearch.backends.codegen import generate
from fusesearch.backends.codegen.c_runtime import C_HEADER, C_RUNTIME, RUNTIME_FUNCTIONS
from fusesearch.groups import FusionGroup
from fusesearch.ir.canonicalize import to_proto
from fusesearch.lowering import try_lower
from fusesearch.pipeline import prepare
from fusesearch.schedule import CpuTarget
from fusesearch.verify import all_values, random_feeds
from tests.conftest import make_model, save

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler")

ROOT = Path(__file__).resolve().parents[2]


def _w(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.3


def _matmul(act: str, n: int = 64) -> tuple[list, list]:
    """x[70, 48] times constant weights, then `act`: our packed GEMM (`fs_gemm_rows`) with a block
    epilogue (Tanh), or, as ONNX writes GELU, a tile epilogue (`fs_gemm_rows_epi` with AVX-512)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    inits = [("w", _w([48, n]))]
    if act == "gelu":
        nodes += [helper.make_node("Div", ["y", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                  helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["y", "e1"], ["g"]),
                  helper.make_node("Mul", ["g", "half"], ["out"])]
        inits += [("sqrt2", np.float32(1.4142135)), ("one", np.float32(1.0)), ("half", np.float32(0.5))]
    else:
        nodes.append(helper.make_node(act, ["y"], ["out"]))
    return nodes, inits


def _kernel(tmp_path, act: str, n: int = 64):
    """The graph as one generated kernel, and its inputs' and output's values from ONNX Runtime."""
    nodes, inits = _matmul(act, n)
    path = save(make_model(nodes, [("x", [70, 48])], [("out", None)], inits), tmp_path / f"{act}-{n}.onnx")
    prep = prepare(path)
    values = all_values(to_proto(prep.canonical), random_feeds(to_proto(prep.canonical), 0))
    # as a CPU with 16 float lanes runs it: the first choice, the tile epilogue where one applies
    kernel = try_lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))), host=CpuTarget(lanes=16))
    return generate(prep.graph, kernel), values


def _runs_right(gk, values) -> None:
    out = cpu.run(gk, {a.tensor: values[a.tensor] for a in gk.inputs})["out"]
    np.testing.assert_allclose(out, values["out"], rtol=0, atol=1e-4 * max(1.0, float(np.abs(values["out"]).max())))


def _defines(source: str, function: str) -> bool:
    """Whether `source` holds a definition (not a declaration) of the C function `function`."""
    return re.search(rf"^(?:static )?(?:inline )?(?:void|long long) {function}\([^;{{]*\)\s*\{{", source, flags=re.M) is not None


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder for the compiled kernels and runtime of one test."""
    monkeypatch.setenv("FUSESEARCH_CACHE", str(tmp_path / "cache"))
    cpu._load.cache_clear()
    yield tmp_path / "cache" / "cpu"
    cpu._load.cache_clear()


@pytest.mark.parametrize("act", ["Tanh", "gelu"])
def test_a_kernels_source_holds_the_header_and_its_own_code_only(tmp_path, act):
    """A GEMM kernel with packed weights calls the runtime's packed GEMM (`fs_gemm_rows`, `fs_pack_b`)
    and defines none of the runtime's functions nor any micro-kernel: its source is the header
    (declarations and the inline math, no <immintrin.h>) and its own code. With a tile epilogue
    (GELU) the tile kernels with the epilogue inlined are a unit it links (`c_units`), which
    defines the `fs_gemm_rows_epi` its source declares. The runtime defines every function the
    header declares."""
    gk, _ = _kernel(tmp_path, act)
    assert gk.c_source.startswith(C_HEADER) and "fs_gemm_rows" in gk.c_source[len(C_HEADER):]
    assert RUNTIME_FUNCTIONS and all(_defines(C_RUNTIME, f) and not _defines(gk.c_source, f) for f in RUNTIME_FUNCTIONS)
    assert "immintrin" not in gk.c_source and "fs_micro" not in gk.c_source and not _defines(gk.c_source, "fs_gemm_rows_epi")
    assert len(gk.c_units) == (act == "gelu")
    if act == "gelu":
        assert "fs_gemm_rows_epi(" in gk.c_source[gk.c_source.index(f"void {gk.name}("):]
        assert _defines(gk.c_units[0], "fs_gemm_rows_epi") and "fs_micro_x2(" in gk.c_units[0]


def test_the_runtime_is_built_once_for_two_kernels_and_a_unit_once_for_its_epilogue(tmp_path, cache):
    """Three kernels compiled into an empty cache: the first builds the runtime (`libfsrt-<hash>.so`,
    its sha256 beside it), the others link the same file without building it again; the two with
    the same GELU tile epilogue (different shapes) share one unit library, which both link where
    the compiler targets AVX-512; each kernel library finds what it links through its soname; all
    equal ONNX Runtime."""
    gk, values = _kernel(tmp_path, "Tanh")
    _runs_right(gk, values)
    runtime = cache / cpu.runtime_name()
    first = runtime.stat()
    gelus = [_kernel(tmp_path, "gelu", n) for n in (64, 96)]
    assert gelus[0][0].c_units == gelus[1][0].c_units and gelus[0][0].c_source != gelus[1][0].c_source
    for other, other_values in gelus:
        _runs_right(other, other_values)
    again = runtime.stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    assert sorted(p.name for p in cache.glob(f"{cpu.RUNTIME_PREFIX}*")) == [runtime.name, runtime.name + ".sha256"]
    unit = cpu.library_name(gelus[0][0].c_units[0], cpu.UNIT_PREFIX)
    assert sorted(p.name for p in cache.glob(f"{cpu.UNIT_PREFIX}*")) == [unit, unit + ".sha256"]
    kernels = [str(p) for p in cache.glob("*.so") if not p.name.startswith((cpu.RUNTIME_PREFIX, cpu.UNIT_PREFIX))]
    needed = subprocess.run(["readelf", "-d", *kernels], capture_output=True, text=True).stdout
    assert len(kernels) == 3 and needed.count(f"Shared library: [{runtime.name}]") == 3
    # the call to the tile epilogue's kernels is compiled only with AVX-512 (`FS_TILE_EPI`); elsewhere
    # the unit holds nothing the kernels call and the linker (--as-needed, as Debian's GCC passes it)
    # may leave it out
    macros = subprocess.run([cpu.compiler(), "-march=native", "-dM", "-E", "-"], input="", capture_output=True,
                            text=True).stdout
    assert needed.count(f"Shared library: [{unit}]") in ((2,) if "__AVX512F__" in macros else (0, 2))


def test_a_corrupt_runtime_is_built_again(tmp_path, cache):
    """A runtime file cut short (as a copy interrupted leaves it) does not match the sha256 recorded
    when it was built: the next kernel builds the runtime again and links it."""
    gk, values = _kernel(tmp_path, "Tanh")
    _runs_right(gk, values)
    runtime = cache / cpu.runtime_name()
    cut = runtime.with_name("cut")
    cut.write_bytes(runtime.read_bytes()[:4096])
    os.replace(cut, runtime)  # a new file: the one this process has loaded stays mapped intact
    cpu._load.cache_clear()
    other, other_values = _kernel(tmp_path, "Relu", 40)
    _runs_right(other, other_values)
    built = runtime.read_bytes()
    assert len(built) > 4096 and built[:4] == b"\x7fELF"
    assert (runtime.parent / (runtime.name + ".sha256")).read_text() == hashlib.sha256(built).hexdigest()


def test_two_processes_building_the_runtime_at_once_both_get_it(tmp_path):
    """Two processes asking for the runtime of an empty cache folder at the same time each build it
    and move their finished file into place: both get the library, and the file left is intact."""
    env = {**os.environ, "FUSESEARCH_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    code = "from fusesearch.backends import cpu; import ctypes; ctypes.CDLL(str(cpu.runtime())); print(cpu.runtime())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    paths = {p.communicate(timeout=600)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(paths) == 1
    runtime = Path(paths.pop())
    assert (runtime.parent / (runtime.name + ".sha256")).read_text() == hashlib.sha256(runtime.read_bytes()).hexdigest()


def test_a_unit_that_defines_a_runtime_function_is_the_one_the_kernel_calls(tmp_path, cache):
    """A kernel's units are linked ahead of the runtime (`cpu.libraries`): a unit holding an edited
    runtime (as `benchmarks/ab_group.py` links a variant's) replaces the shared one's functions for
    that kernel only: here a `fs_gemm_rows` that writes a zero product, so Tanh gives zeros, while
    the same kernel without the unit still equals ONNX Runtime."""
    gk, values = _kernel(tmp_path, "Tanh")
    call = "fs_gemm_rows_at(M, N, K, A, lda, Bp, C, ldc, C0, ldc0, R0, 0);"
    zero = "for (long long i = 0; i < M; ++i) for (long long j = 0; j < N; ++j) C[i * ldc + j] = 0.0f;"
    assert C_RUNTIME.count(call) == 1
    zeroed = gk.with_c_source(gk.c_source, (C_RUNTIME.replace(call, zero),))
    out = cpu.run(zeroed, {a.tensor: values[a.tensor] for a in gk.inputs})["out"]
    assert not out.any() and values["out"].any()
    _runs_right(gk, values)
