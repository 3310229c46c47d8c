"""Every generated CUDA kernel of every zoo plan (all strategies) compiles for sm_80 and sm_90 with
NVRTC (or nvcc), without a GPU, and ptxas's report is parsed: registers, shared memory, no spills.
The price is the kernel: for every generated tiled, tensor-core (`mma-*`) or anchored row kernel,
ptxas's shared memory equals the bytes the lowering priced and the block written is the block
priced; a tensor-core kernel's shared memory is within the per-block limit of static shared memory
(48 KiB) and its registers are reported. Plans are made with TF32 allowed (the default: gemm and
conv groups on tensor cores) and, for the CUDA-core skeleton, without (NO_TF32's models).
Distinct kernels (by source hash) are compiled once, several to an NVRTC program (each kernel in
its own namespace, its `#include` lines hoisted to the top)."""

from __future__ import annotations

import math

import pytest

from costmodels.resources import grid_blocks
from fusesearch.api import plan as make_plan
from fusesearch.backends.codegen import CodegenRefused, generate
from fusesearch.pipeline import prepare
from fusesearch.search import STRATEGIES
from fusesearch.zoo import ZOO

nvrtc = pytest.importorskip("fusesearch.backends.nvrtc")
pytestmark = pytest.mark.skipif(not nvrtc.toolchain_available(), reason="no CUDA compiler (NVRTC or nvcc)")


BUNDLE = 8  # kernels per NVRTC program (each in its own namespace): fewer front-end runs


STATIC_SMEM_LIMIT = 48 * 1024  # bytes of static __shared__ per block, every arch
PRICED = ("tiled", "block-per-row", "mma-tf32", "mma-f16", "mma-bf16")  # launch and shared memory are lowering's


def bundle(chunk) -> str:
    """Kernels in one program: each in its namespace, their #include lines first (once)."""
    includes = dict.fromkeys(ln for k in chunk for ln in k.cuda_source.splitlines() if ln.startswith("#include"))
    bodies = ["\n".join(ln for ln in k.cuda_source.splitlines() if not ln.startswith("#include")) for k in chunk]
    return "\n".join([*includes, *(f"namespace n{k.name} {{\n{b}\n}}" for k, b in zip(chunk, bodies, strict=True))])


NO_TF32 = ("resnet18", "bert-small", "unet")  # the CUDA-core skeleton's kernels, a conv net and a transformer


@pytest.mark.parametrize("name,tf32", [(name, True) for name in ZOO] + [(name, False) for name in NO_TF32],
                         ids=[*ZOO, *(f"{name}-no-tf32" for name in NO_TF32)])
def test_every_cuda_kernel_of_every_zoo_plan_compiles(name, tf32):
    prep = prepare(f"zoo:{name}", tf32=tf32)
    distinct, refused = {}, 0
    for strategy in STRATEGIES:
        p = make_plan(f"zoo:{name}", device="h100-sxm", strategy=strategy, prepared=prep, time_limit_s=20)
        for g in p.groups:
            if g.kernel.alias:
                continue
            try:
                gk = generate(prep.graph, g.kernel, name="k")  # one name: equal kernels hash equal
            except CodegenRefused:
                refused += 1
                assert g.kernel.template == "opaque", (name, strategy, g.id)
                continue
            distinct.setdefault(gk.source_hash, g)
    kernels = [generate(prep.graph, g.kernel, name=f"k{i}") for i, g in enumerate(distinct.values())]
    by_name = {f"k{i}": g.kernel for i, g in enumerate(distinct.values())}
    for gk in kernels:  # the launch the cost model priced is the launch written
        kernel = by_name[gk.name]
        assert gk.skeleton.startswith("mma") == (tf32 and kernel.skeleton.startswith("mma")), (name, gk.name)
        if kernel.impl == "generated" and gk.skeleton in PRICED:
            assert gk.block[0] == kernel.threads_per_block, (name, gk.name, gk.skeleton)
            if kernel.anchor is not None:
                assert math.prod(gk.grid) == grid_blocks(kernel.spec()), (name, gk.name, gk.skeleton, gk.grid)
    skeletons: dict[str, int] = {}
    registers: dict[str, list[int]] = {}
    for start in range(0, len(kernels), BUNDLE):
        chunk = kernels[start:start + BUNDLE]
        source = bundle(chunk)
        for arch in nvrtc.ARCHES:
            result = nvrtc.compile_cuda(source, arch=arch)
            for gk in chunk:
                res = result.resource(gk.name)
                assert res.registers > 0, (name, gk.name, arch)
                assert res.spill_store_bytes == 0, (name, gk.name, gk.skeleton, arch, res)
                if gk.skeleton == "tiled" or gk.skeleton.startswith("mma"):
                    assert 0 < res.smem_bytes <= STATIC_SMEM_LIMIT, (name, gk.name, arch, res)
                if gk.skeleton.startswith("mma"):
                    registers.setdefault(arch, []).append(res.registers)
                kernel = by_name[gk.name]
                # priced = written (the `direct` fallback, for epilogues that move elements, is
                # still priced as a tile: that choice is not yet the lowering's)
                if kernel.impl == "generated" and gk.skeleton in PRICED and kernel.anchor is not None:
                    assert res.smem_bytes == kernel.smem_bytes, (name, gk.name, gk.skeleton, arch, res, kernel.tile)
        for gk in chunk:
            skeletons[gk.skeleton] = skeletons.get(gk.skeleton, 0) + 1
    assert kernels, name
    print(f"{name}: {len(kernels)} distinct kernels compiled for {', '.join(nvrtc.ARCHES)} "
          f"({skeletons}); {refused} opaque groups run as library calls; tensor-core kernels' registers "
          f"{ {arch: (min(r), max(r)) for arch, r in registers.items()} }")
    if tf32 and any(g.kernel.template in ("gemm", "conv") and len(g.kernel.nodes) > 1 for g in distinct.values()):
        assert registers, (name, skeletons)  # fused gemm/conv groups run on tensor cores
