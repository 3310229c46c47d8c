"""The C runtime: the header every C kernel starts with, and the one translation unit, compiled once
per machine, compiler and flags, that defines the functions the header declares.

Problem: the prelude (exp, erf, the scratch arena, streamed stores, folds) and the packed GEMM
(about 750 lines, with <immintrin.h>) were pasted into every kernel's source and compiled with each:
0.4-0.8 s a GEMM kernel, 0.2 s a row kernel (a third of it parsing <immintrin.h>), so a plan's
compile time grew with its kernels by far more than their own code.
Approach: `C_HEADER` holds the includes, the declarations and only the small helpers that must
inline into a kernel's loops (exp, erf, GELU, the scratch arena, the folds of a row reduction's
partials, prefetches), none of them needing <immintrin.h>; `C_RUNTIME` is that header followed by
the definitions of what it declares (`RUNTIME_FUNCTIONS`: streamed stores, the split of a row by
column parity, B packing, the packed GEMMs and convs with their micro-kernels, all per call or per
tile). The CPU backend compiles `C_RUNTIME` once with the kernels' own flags (-march included)
into `libfsrt-<hash>.so` in the kernel cache (`backends.cpu.runtime`), and every kernel library
and program links it. A tile epilogue, inlined on the registers of the tile kernels, makes a unit
of its own with them (`tile_kernels`), compiled once per distinct epilogue, which the kernels
with that epilogue link (`GeneratedKernel.c_units`).
Invariants: this module imports only the C text leaves (`c_prelude`, `c_gemm`); a kernel's source
is `C_HEADER` plus its own code and declarations, and defines no function of RUNTIME_FUNCTIONS nor
any tile kernel; the runtime's
helpers that are not declared in the header stay static (the runtime exports RUNTIME_FUNCTIONS
only, so a kernel's static helpers never collide with it).
"""

from __future__ import annotations

import hashlib
import re

from fusesearch.backends.codegen.c_gemm import (
    _C_GEMM_DECLS,
    _C_GEMM_ROWS,
    _C_PACKED_GEMM,
    _C_TILE_GEMM,
    _GEMM_ROWS_EPI,
    _TILE_EPI_ON,
)
from fusesearch.backends.codegen.c_prelude import _C_PRELUDE, _C_STREAM_DEFS

C_HEADER = _C_PRELUDE + _C_GEMM_DECLS
"""The text every C kernel's source starts with."""

C_RUNTIME = C_HEADER + _C_STREAM_DEFS + _C_GEMM_ROWS + _C_PACKED_GEMM
"""The runtime's translation unit: the header, then the definitions of what it declares."""

RUNTIME_FUNCTIONS = tuple(re.findall(r"^(?:void|long long) (fs_\w+)\(.*\);$", C_HEADER, flags=re.M))
"""The functions the runtime defines and kernels call (declared in the header)."""


def tile_kernels(defs: str) -> tuple[str, str]:
    """(what a kernel's source holds, the unit it links) for its tile epilogue's definitions `defs`
    (`c_gemm.tile_epilogue`): the unit is the header, `defs` and the tile kernels with the
    epilogue inlined (`fs_gemm_rows_epi`, named by the hash of `defs`), compiled once per distinct
    epilogue whatever kernels call it (bert-base's twelve FFN-up groups share one GELU); the
    kernel holds FS_TILE_EPI (where the epilogue exists: AVX-512) and the declaration."""
    name = f"fs_gemm_rows_epi_{hashlib.sha256(defs.encode()).hexdigest()[:16]}"
    rename = f"#define fs_gemm_rows_epi {name}\n"
    declaration = f"#ifdef FS_TILE_EPI\n{rename}{_GEMM_ROWS_EPI};\n#endif\n"
    return _TILE_EPI_ON + declaration, C_HEADER + defs + rename + _C_TILE_GEMM
