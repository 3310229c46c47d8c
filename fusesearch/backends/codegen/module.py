"""One CUDA module for many kernels: a whole program's generated kernels as one translation unit.

Invariants: kernel names are unique in a module; each kernel's source is unchanged inside its own
namespace but for its `#include` lines (the tensor-core kernels' mma.h, cuda_fp16.h), which come
first, once, outside every namespace; so device helpers that several kernels define
(`block_reduce`, `warp_reduce`) do not collide; the kernels stay `extern "C"`, found by their
plain names.
"""

from __future__ import annotations

import re

from fusesearch.backends.codegen.base import GeneratedKernel, require_cuda


def module_namespace(kernel: GeneratedKernel) -> str:
    """The C++ namespace a kernel's source sits in inside a module (`cuda_module`)."""
    return f"fs_ns_{kernel.name}"


def cuda_module(kernels) -> str:
    """One CUDA translation unit holding every kernel (names must be unique): the kernels'
    `#include` lines once, then each kernel's `cuda_source` inside its own namespace, each macro it
    defines undefined first (two kernels may define one differently). The kernels are `extern "C"`, so NVRTC and the emulator
    find them by their plain names."""
    names = [k.name for k in kernels]
    if len(set(names)) != len(names):
        raise ValueError(f"kernel names repeat in one module: {sorted({n for n in names if names.count(n) > 1})}")
    includes: dict[str, None] = {}
    parts = []
    for k in kernels:
        lines = require_cuda(k).splitlines(keepends=True)
        includes.update(dict.fromkeys(ln.strip() for ln in lines if _INCLUDE.match(ln)))
        body = "".join(ln for ln in lines if not _INCLUDE.match(ln))
        macros = dict.fromkeys(re.findall(r"^\s*#\s*define\s+(\w+)", body, flags=re.M))
        parts.append("".join(f"#undef {m}\n" for m in macros)
                     + f"namespace {module_namespace(k)} {{\n{body}\n}}  // namespace {module_namespace(k)}\n")
    return "".join(f"{line}\n" for line in includes) + "\n".join(parts)


_INCLUDE = re.compile(r"\s*#\s*include\b")
