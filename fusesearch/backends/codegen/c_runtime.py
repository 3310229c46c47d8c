"""The C runtime: the header every C kernel starts with, and the one translation unit, compiled once
per machine, compiler and flags, that defines the functions the header declares.

Problem: the prelude and packed GEMM pasted into every kernel made compile time grow far beyond
the kernels' own code.
Approach: `C_HEADER` holds includes, declarations and only the small helpers that must inline into
a kernel's loops (exp, erf, GELU, the scratch arena, row folds, prefetches), none needing
<immintrin.h>; `C_RUNTIME` adds the definitions of `RUNTIME_FUNCTIONS` (streamed stores, B
packing, packed GEMMs and convs with their micro-kernels). The CPU backend compiles it once into
`libfsrt-<hash>.so` (`backends.cpu.runtime`), which every kernel and program links. A tile
epilogue makes a unit with its tile kernels (`tile_kernels`, `GeneratedKernel.c_units`).
Invariants: imports only the C text leaves (`c_prelude`, `c_gemm`); a kernel's source is `C_HEADER`
plus its own code and defines no RUNTIME_FUNCTIONS nor tile kernel; undeclared runtime helpers stay
static, so only RUNTIME_FUNCTIONS are exported."""

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
