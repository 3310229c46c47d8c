"""The CUDA reorder between NCHW and NHWC (channels last) that a GPU plan runs where a conv group
reads or writes channels last and its neighbour the model's layout.

Problem: per image an NCHW tensor is a C x HW matrix and its NHWC copy that matrix's transpose; a
copy that reads one side along rows writes the other across them, a 32-byte sector per element.
Approach: the classic shared-memory transpose: a block of 256 threads per 32 x 32 square of
(channels, pixels) of one image (`schedule.reorder_grid`), read along the source's contiguous
axis, stored through a padded tile (33 columns: no bank conflicts) along the target's, so both
sides move whole sectors; the edge squares guarded. Priced as the copy it is (`lowering.reorder`).
Invariants: the launch is the schedule's; the element is copied as stored (no conversion)."""

from __future__ import annotations

from fusesearch.backends.codegen.base import (
    Arg,
    CodegenRefused,
    GeneratedKernel,
    _indent,
    cuda_entry,
    half_prelude,
    source_digest,
)
from fusesearch.backends.codegen.c_prelude import _CU_PRELUDE
from fusesearch.layout import Layout, copy_name
from fusesearch.schedule import REORDER_SQUARE, reorder_grid


def reorder_cuda_kernel(tensor: str, shape: tuple[int, ...], dtype: str, source: Layout, target: Layout,
                        name: str | None = None) -> GeneratedKernel:
    """The CUDA kernel copying `tensor` of logical `shape` (N, C, H, W) from `source` to `target`
    (NCHW <-> NHWC), its output named `layout.copy_name(tensor, target)` (module docstring)."""
    if {source.name, target.name} != {"NCHW", "NHWC"} or len(shape) != 4:
        raise CodegenRefused(f"reorder of '{tensor}': {source.name} -> {target.name} of shape {shape} "
                             "(one NCHW <-> NHWC copy of a 4-D tensor)")
    n, c, h, w = shape
    hw, s = h * w, REORDER_SQUARE
    ins = (Arg("in0", tensor, source.shape(shape), dtype, source),)
    outs = (Arg("out0", copy_name(tensor, target), target.shape(shape), dtype, target),)
    nchw = f"(n * {c}LL + c) * {hw}LL + p"
    nhwc = f"(n * {hw}LL + p) * {c}LL + c"
    read, write = (nchw, nhwc) if target.channels_last else (nhwc, nchw)
    # the source's contiguous axis along the lanes: pixels (NCHW) or channels (NHWC); the target's likewise
    lanes_in, lanes_out = ("p", "c") if target.channels_last else ("c", "p")
    rows_in, rows_out = ("c", "p") if target.channels_last else ("p", "c")
    body = [
        f"__shared__ {ins[0].ctype} tile[{s}][{s + 1}];",
        f"const int tx = threadIdx.x % {s}, ty = threadIdx.x / {s};",
        f"const long long n = blockIdx.z, c0 = (long long)blockIdx.y * {s}, p0 = (long long)blockIdx.x * {s};",
        f"for (int r = ty; r < {s}; r += {256 // s}) {{",
        f"    const long long {rows_in} = {rows_in}0 + r, {lanes_in} = {lanes_in}0 + tx;",
        f"    if (c < {c}LL && p < {hw}LL) tile[r][tx] = in0[{read}];",
        "}",
        "__syncthreads();",
        f"for (int r = ty; r < {s}; r += {256 // s}) {{",
        f"    const long long {rows_out} = {rows_out}0 + r, {lanes_out} = {lanes_out}0 + tx;",
        f"    if (c < {c}LL && p < {hw}LL) out0[{write}] = tile[tx][r];",
        "}",
    ]
    name = name or f"k_reorder_{target.name.lower()}"
    src = (f"{_CU_PRELUDE}{half_prelude((dtype,), True)}\n"
           f"{cuda_entry(name, ins, outs)} {{\n{_indent(body, 1)}\n}}\n")
    return GeneratedKernel(name, "pointwise", ins, outs, "", src, source_hash=source_digest("", src),
                           grid=reorder_grid(shape), block=(256, 1, 1), skeleton="grid-stride")
