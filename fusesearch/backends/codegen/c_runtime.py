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
and program links it. A kernel with a tile epilogue also compiles the tile kernels itself
(`c_gemm._C_TILE_GEMM`, static there), as the epilogue is inlined on their registers.
Invariants: this module imports only the C text leaves (`c_prelude`, `c_gemm`); a kernel's source
is `C_HEADER` plus its own code and never defines a function of RUNTIME_FUNCTIONS; the runtime's
helpers that are not declared in the header stay static (the runtime exports RUNTIME_FUNCTIONS
only, so a kernel's static helpers never collide with it).
"""

from __future__ import annotations

import re

from fusesearch.backends.codegen.c_gemm import _C_GEMM_DECLS, _C_GEMM_ROWS, _C_PACKED_GEMM
from fusesearch.backends.codegen.c_prelude import _C_PRELUDE, _C_STREAM_DEFS

C_HEADER = _C_PRELUDE + _C_GEMM_DECLS
"""The text every C kernel's source starts with."""

C_RUNTIME = C_HEADER + _C_STREAM_DEFS + _C_GEMM_ROWS + _C_PACKED_GEMM
"""The runtime's translation unit: the header, then the definitions of what it declares."""

RUNTIME_FUNCTIONS = tuple(re.findall(r"^(?:void|long long) (fs_\w+)\(.*\);$", C_HEADER, flags=re.M))
"""The functions the runtime defines and kernels call (declared in the header)."""
