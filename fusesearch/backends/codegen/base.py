"""Shared leaf of the code generator: C types, kernel arguments, the result type, the refusal, and
the C/CUDA preludes every skeleton starts with.

Invariants: this module imports nothing else of the generator; a dtype has a C type here or is
refused (`CodegenRefused`, carrying a `FusionDecision`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from fusesearch.candidates.decision import FusionDecision

CTYPES = {"float32": "float", "int64": "long long", "int32": "int", "bool": "unsigned char"}
NP_DTYPES = {"float32": np.float32, "int64": np.int64, "int32": np.int32, "bool": np.bool_}  # same keys
SUPPORTED_TEMPLATES = ("pointwise", "rowwise", "gemm", "conv")


class CodegenRefused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.decision = FusionDecision.refuse(reason)


@dataclass(frozen=True)
class Arg:
    name: str  # C identifier: in0, in1, ..., out0, ...
    tensor: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def ctype(self) -> str:
        return CTYPES[self.dtype]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GeneratedKernel:
    name: str
    template: str
    inputs: tuple[Arg, ...]
    outputs: tuple[Arg, ...]
    c_source: str
    cuda_source: str
    rows: int = 0  # rowwise: rows and row length
    row_length: int = 0
    source_hash: str = field(default="")
    grid: tuple[int, int, int] = (1, 1, 1)  # the CUDA launch (CuPy and the emulator use it as is)
    block: tuple[int, int, int] = (256, 1, 1)
    skeleton: str = ""  # CUDA: grid-stride | vectorized | block-per-row | tiled | mma-tf32 | mma-f16 | mma-bf16 | direct


# -- the expression emitter -------------------------------------------------------------------

def _lit(value: float) -> str:
    if value != value:
        return "NAN"
    if value in (float("inf"), float("-inf")):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    return f"{float(value)!r}f".replace("e+", "e")


def _signature(ins, outs, restrict: str) -> str:
    params = [f"const {a.ctype}* {restrict} {a.name}" for a in ins]
    params += [f"{a.ctype}* {restrict} {a.name}" for a in outs]
    return ", ".join(params)


# C: glibc's vector math (libmvec) under `omp simd` when the backend links it (FS_VECTOR_MATH), so
# loops with exp/log/tanh/erf vectorize; FS_SIMD_SUM marks a sum loop the compiler may reassociate;
# FS_FMAX/FS_FMIN are compare-selects in C (fmaxf does not vectorize; same result unless the second
# operand is NaN) and fmaxf/fminf in CUDA.
_VECTOR_MATH = ("expf", "logf", "tanhf", "erff", "log1pf", "sinf", "cosf")
_C_PRELUDE = ("#include <math.h>\n#include <stdint.h>\n#include <stdlib.h>\n#ifdef FS_VECTOR_MATH\n"
              + "".join(f"#pragma omp declare simd notinbranch\nfloat {f}(float);\n" for f in _VECTOR_MATH)
              + "#endif\n#ifdef FS_BLAS_SGEMM\nvoid FS_BLAS_SGEMM(int, int, int, int, int, int, float, const float*, int, "
              "const float*, int, float, float*, int);\n#endif\n#ifdef FS_BLAS_SGEMV\n"
              "void FS_BLAS_SGEMV(int, int, int, int, float, const float*, int, const float*, int, float, float*, int);\n"
              "#define FS_GEMV_OR(call) if (mc == 1) { call } else\n#else\n#define FS_GEMV_OR(call)\n#endif\n"
              "#define FS_FMAX(a, b) ((a) > (b) ? (a) : (b))\n"
              "#define FS_FMIN(a, b) ((a) < (b) ? (a) : (b))\n#ifdef _OPENMP\n#include <omp.h>\nstatic inline long long fs_threads(void) { return omp_get_max_threads(); }\n"
              "#else\nstatic inline long long fs_threads(void) { return 1; }\n#endif\n#define FS_PRAGMA(x) _Pragma(#x)\n#define FS_SIMD_SUM(a) FS_PRAGMA(omp simd reduction(+:a))\n")
_CU_PRELUDE = ("#ifndef INFINITY\n#define INFINITY __int_as_float(0x7f800000)\n#endif\n"
               "#ifndef NAN\n#define NAN __int_as_float(0x7fffffff)\n#endif\n#define FS_SIMD_SUM(a)\n"
               "#define FS_FMAX(a, b) fmaxf(a, b)\n#define FS_FMIN(a, b) fminf(a, b)\n")


def _indent(lines: list[str], depth: int) -> str:
    return "\n".join("    " * depth + line for line in lines)


def _flat_loop(body: list[str]) -> bool:
    """A loop body with no loop or OpenMP construct of its own (simd constructs do not nest)."""
    return not any(x.lstrip().startswith(("for ", "#pragma", "FS_SIMD")) for x in body)
