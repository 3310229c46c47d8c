"""One CUDA module for many kernels: a whole program's generated kernels as one translation unit.

Invariants: kernel names are unique in a module; each kernel's source is unchanged inside its own
namespace, so device helpers that several kernels define (`block_reduce`, `warp_reduce`) do not
collide; the kernels stay `extern "C"`, found by their plain names.
"""

from __future__ import annotations

import re

from fusesearch.backends.codegen.base import GeneratedKernel


def module_namespace(kernel: GeneratedKernel) -> str:
    """The C++ namespace a kernel's source sits in inside a module (`cuda_module`)."""
    return f"fs_ns_{kernel.name}"


def cuda_module(kernels) -> str:
    """One CUDA translation unit holding every kernel (names must be unique): each kernel's
    `cuda_source` unchanged inside its own namespace, each macro it defines undefined first (two
    kernels may define one differently). The kernels are `extern "C"`, so NVRTC and the emulator
    find them by their plain names."""
    names = [k.name for k in kernels]
    if len(set(names)) != len(names):
        raise ValueError(f"kernel names repeat in one module: {sorted({n for n in names if names.count(n) > 1})}")
    parts = []
    for k in kernels:
        macros = dict.fromkeys(re.findall(r"^\s*#\s*define\s+(\w+)", k.cuda_source, flags=re.M))
        parts.append("".join(f"#undef {m}\n" for m in macros)
                     + f"namespace {module_namespace(k)} {{\n{k.cuda_source}\n}}  // namespace {module_namespace(k)}\n")
    return "\n".join(parts)
