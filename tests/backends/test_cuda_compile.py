"""Every generated CUDA kernel of every zoo plan (all strategies) compiles for sm_90 (EVERY_ARCH's
models' for sm_80 too) with NVRTC (or nvcc), without a GPU, and ptxas's report is parsed: registers, shared memory, no spills.
The price is the kernel: for every distinct kernel, the skeleton, block and grid written are the
schedule's (lowering's), split-K is 1 but on mma.sync tiles, the main loop is on tensor cores exactly for the `mma-*`
skeletons, the grid the cost model counts is the grid launched, and ptxas's shared memory equals
the schedule's bytes (for the mma.sync kernels, whose stages pass the 48 KiB of static shared
memory, ptxas reports none and the launch's dynamic shared memory is the schedule's); a tiled or
wmma kernel's shared memory is within the per-block limit of static shared memory (48 KiB) and the
tensor-core kernels' registers are reported. Plans are
made with TF32 allowed (the default: fused gemm and conv groups on tensor cores wherever the cost
model prices them faster than on CUDA cores, which the test re-prices), for the CUDA-core skeleton
without (NO_TF32's models), for HALF's models in float16 (FP16 tensor cores), and for the T4
(sm_75, compiled for sm_75), where the tensor-core skeleton (sm_80+) is never planned.
For bert-small every choice of every group of its cpsat plan is compiled (each tile configuration, tensor
or CUDA cores, our forms of a lone anchor: `lowering.choices`; those no plan chose for sm_90, the
priced device's arch, alone, one group's per launch configuration), and every planned kernel is its group's cheapest choice. Distinct kernels (by source hash) are compiled once, several to an NVRTC program (each kernel in
its own namespace, its `#include` lines first: `cuda_module`)."""

from __future__ import annotations

import math

import pytest

from costmodels import RooflineModel
from costmodels.resources import grid_blocks
from fusesearch.api import for_device, resolve_device
from fusesearch.api import plan as make_plan
from fusesearch.backends.codegen import cuda_module, generate
from fusesearch.costing import kernel_cost, priced_kernel
from fusesearch.groups import FusionGroup
from fusesearch.lowering import choices, lower
from fusesearch.pipeline import prepare
from fusesearch.search import STRATEGIES
from fusesearch.zoo import ZOO
from tests.conftest import SCALED_TWINS

nvrtc = pytest.importorskip("fusesearch.backends.nvrtc")
pytestmark = pytest.mark.skipif(not nvrtc.toolchain_available(), reason="no CUDA compiler (NVRTC or nvcc)")


BUNDLE = 8  # kernels per NVRTC program (each in its own namespace): fewer front-end runs


STATIC_SMEM_LIMIT = 48 * 1024  # bytes of static __shared__ per block, every arch


NO_TF32 = ("resnet18", "bert-small", "unet")  # the CUDA-core skeleton's kernels, a conv net and a transformer


HALF = tuple(ZOO)  # every zoo model converted to float16: FP16 tensor-core kernels


FAST_HALF = ("resnet18", "mobilenetv2")  # float16 by default; the other models' under -m slow (bert-small's FP16
# tensor-core GEMMs by default in test_half_precision_tensor_core_kernels_compile)


EVERY_CHOICE = ("bert-small",)  # every choice of every group of its cpsat plan compiled (each tile, tensor or CUDA
# cores, our forms of a lone anchor; those no plan chose for CHOICE_ARCH alone); the other plans' and models'
# planned kernels (the choices of every strategy's groups: 238 kernels, 2 minutes; cpsat's 54)


CHOICE_ARCH = "sm_90"  # the h100-sxm's, which priced them


EVERY_ARCH = NO_TF32  # these models' planned kernels (every skeleton, both conv forms, the CUDA-core and the
# tensor-core GEMMs) compile for every arch in nvrtc.ARCHES; the other models' for CHOICE_ARCH, the same
# skeletons at other extents (both arches for every model took 3.5 of CI's 20 minutes)


REGISTER_BAND = (0.35, 4.5)  # ptxas registers over the cost model's per-thread estimate, every kernel here.
# The estimate is a proxy (a tile's accumulators and operand fragments, 2 per fused op); measured
# over this test's kernels, sm_80 and sm_90: vectorized 1.23-1.74x, grid-stride 0.36-1.58x (0.36:
# llama-decode's one-op copy, 8 registers), tiled
# 0.80-3.88x, block-per-row 0.67-2.09x, mma-tf32 1.11-3.29x, mma-f16 1.43-2.44x, direct 0.82-1.54x,
# mma-sync-tf32 / -f16 (a GEMM + bias + ReLU) 1.2-1.9x


def assert_source_follows_schedule(gk, schedule) -> None:
    """The written kernel assumes the schedule's launch: a tile's block offsets step by the tile's
    sides, its staging loops by the block's threads, a CUDA-core tile's K loop by the tile's K; a
    row kernel's rows by the grid, a grid-stride loop by the whole grid."""
    src = gk.cuda_source
    if schedule.skeleton == "block-per-row":
        assert "r += gridDim.x)" in src, (gk.name, schedule)
    if schedule.skeleton == "tiled" or schedule.skeleton.startswith("mma"):
        tm, tn, tk = schedule.tile
        assert f"blockIdx.y * {tm}," in src and f"blockIdx.x * {tn}," in src, (gk.name, schedule)
        assert f"; l += {schedule.threads})" in src, (gk.name, schedule)
    if schedule.skeleton == "tiled":
        assert f"k0 += {schedule.tile[2]})" in src, (gk.name, schedule)


# vit-small's kernels are bert-small's (LayerNorm, the GEMMs with their GELU, attention) at other
# extents and a patch conv (the conv skeletons compile for the conv nets): under -m slow, as its twin
SLOW_COMPILES = (*SCALED_TWINS, "vit-small")


@pytest.mark.parametrize("name,tf32,dtype", [pytest.param(name, True, "float32", marks=pytest.mark.slow if name in SLOW_COMPILES else ())
                                              for name in ZOO]
                         + [(name, False, "float32") for name in NO_TF32]
                         + [pytest.param(name, True, "float16", marks=() if name in FAST_HALF else pytest.mark.slow)
                            for name in HALF],
                         ids=[*ZOO, *(f"{name}-no-tf32" for name in NO_TF32), *(f"{name}-float16" for name in HALF)])
def test_every_cuda_kernel_of_every_zoo_plan_compiles(name, tf32, dtype):
    prep = prepare(f"zoo:{name}", tf32=tf32, dtype=dtype)
    distinct, refused, planned, chosen = {}, 0, [], set()
    for strategy in STRATEGIES:
        p = make_plan(f"zoo:{name}", device="h100-sxm", strategy=strategy, prepared=prep, time_limit_s=20)
        planned += p.groups
        for g in p.groups:
            if g.kernel.alias:
                continue
            if g.kernel.impl == "library" and g.kernel.template == "opaque":
                refused += 1
                continue
            if g.kernel.impl == "generated":
                chosen.add(generate(prep.graph, g.kernel, name="k").source_hash)  # one name: equal kernels hash equal
            every = name in EVERY_CHOICE and strategy == "cpsat"
            options = choices(prep.graph, FusionGroup(frozenset(g.nodes))) if every else (g.kernel,)
            for kernel in [k for k in options if k.impl == "generated"]:
                distinct.setdefault(generate(prep.graph, kernel, name="k").source_hash, kernel)
    # the kernels a plan chose first, then the other choices (compiled for CHOICE_ARCH only), one
    # per launch configuration (the first group's: the configuration decides registers and shared memory)
    distinct = dict(sorted(distinct.items(), key=lambda item: item[0] not in chosen))
    configurations = set()
    for h, k in list(distinct.items()):
        s = k.schedule
        key = (s.skeleton, s.tile, s.warp, s.stages, s.split_k, s.threads, s.smem_bytes)
        if h not in chosen and key in configurations:
            del distinct[h]
        configurations.add(key)
    first_choice = sum(h in chosen for h in distinct)
    assert first_choice == len(chosen) and CHOICE_ARCH in nvrtc.ARCHES, name  # each planned kernel one of its choices
    kernels = [generate(prep.graph, k, name=f"k{i}") for i, k in enumerate(distinct.values())]
    by_name = {f"k{i}": k for i, k in enumerate(distinct.values())}
    planned_names = {f"k{i}" for i in range(first_choice)}
    planned_arches = nvrtc.ARCHES if name in EVERY_ARCH else (CHOICE_ARCH,)
    for gk in kernels:  # the launch the cost model priced is the launch written
        kernel = by_name[gk.name]
        schedule = kernel.schedule
        assert gk.skeleton == schedule.skeleton, (name, gk.name)
        assert gk.block == (schedule.threads, 1, 1) and gk.grid == schedule.grid, (name, gk.name, gk.skeleton)
        tensor_cores = schedule.skeleton.startswith("mma")
        assert schedule.split_k == 1 or schedule.skeleton.startswith("mma-sync"), (name, gk.name, schedule)
        assert schedule.unit == ("tensor-core" if tensor_cores else "cuda-core"), (name, gk.name, schedule)
        assert not tensor_cores or tf32 or dtype != "float32", (name, gk.name)  # float32 needs TF32
        assert gk.skeleton not in ("mma-tf32", "mma-bf16") or dtype == "float32", (name, gk.name)
        assert math.prod(gk.grid) == grid_blocks(kernel.spec()), (name, gk.name, gk.skeleton, gk.grid)
        assert_source_follows_schedule(gk, schedule)
    _, spec, params, _ = resolve_device("h100-sxm")
    device_prep, params = for_device(prep, spec, params)
    estimate = {gk.name: kernel_cost(by_name[gk.name], spec, RooflineModel(params)).regs_per_thread for gk in kernels}
    skeletons: dict[str, int] = {}
    registers: dict[str, list[int]] = {}
    bundles = [kernels[a:min(a + BUNDLE, first_choice)] for a in range(0, first_choice, BUNDLE)]
    bundles += [kernels[a:a + BUNDLE] for a in range(first_choice, len(kernels), BUNDLE)]
    assert sum(map(len, bundles)) == len(kernels)
    for chunk in bundles:
        source = cuda_module(chunk)
        for arch in (planned_arches if chunk[0].name in planned_names else (CHOICE_ARCH,)):
            result = nvrtc.compile_cuda(source, arch=arch)
            for gk in chunk:
                res = result.resource(gk.name)
                assert res.registers > 0, (name, gk.name, arch)
                assert res.spill_store_bytes == 0, (name, gk.name, gk.skeleton, arch, res)
                if gk.skeleton == "tiled" or gk.skeleton.startswith("mma"):  # static, or dynamic (mma.sync)
                    assert 0 < res.smem_bytes + gk.dynamic_smem and res.smem_bytes <= STATIC_SMEM_LIMIT, (
                        name, gk.name, arch, res)
                if gk.skeleton.startswith("mma"):
                    registers.setdefault(arch, []).append(res.registers)
                low, high = REGISTER_BAND
                assert low <= res.registers / estimate[gk.name] <= high, (
                    name, gk.name, gk.skeleton, arch, res.registers, estimate[gk.name])
                schedule = by_name[gk.name].schedule
                # the priced bytes are ptxas's in any module, one with dynamic shared memory too
                assert res.smem_bytes == schedule.smem_bytes - gk.dynamic_smem, (
                    name, gk.name, gk.skeleton, arch, res, schedule)
                assert not gk.dynamic_smem or (res.smem_bytes == 0 and gk.skeleton.startswith("mma-sync")), (
                    name, gk.name, arch, res)
        for gk in chunk:
            skeletons[gk.skeleton] = skeletons.get(gk.skeleton, 0) + 1
    assert kernels, name
    print(f"{name}: {first_choice} planned kernels compiled for {', '.join(planned_arches)}, "
          f"{len(kernels) - first_choice} other choices for {CHOICE_ARCH} "
          f"({skeletons}); {refused} opaque groups run as library calls; tensor-core kernels' registers "
          f"{ {arch: (min(r), max(r)) for arch, r in registers.items()} }")
    # every plan's kernel is its group's cheapest choice on this device (the tile, tensor or CUDA
    # cores, ours or the library's): pricing the choices again gives the same
    graph = device_prep.graph
    for g in planned:
        if g.kernel.anchor is not None and g.kernel.impl == "generated":
            chosen, _ = priced_kernel(graph, lower(graph, FusionGroup(frozenset(g.nodes))), spec, RooflineModel(params))
            assert chosen.schedule == g.kernel.schedule, (name, g.id)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_t4_plans_have_no_tensor_core_kernels_and_compile_for_sm75(dtype):
    """On the T4 (sm_75) our tensor-core skeleton (cp.async, TF32/BF16 wmma: sm_80+) is refused by
    the cost model, so the fused gemm/conv groups of a float32 or float16 plan are on CUDA cores,
    and every kernel compiles for sm_75 without spills."""
    kernels, skeletons = {}, set()
    for model in ("bert-small", "resnet18"):
        prep = prepare(f"zoo:{model}", dtype=dtype)
        p = make_plan(f"zoo:{model}", device="t4", strategy="greedy", prepared=prep)
        for g in p.groups:
            if g.kernel.impl == "generated" and not g.kernel.alias:
                gk = generate(prep.graph, g.kernel, name="k")
                kernels.setdefault(gk.source_hash, (prep, g))
                skeletons.add(gk.skeleton)
    assert "tiled" in skeletons and not any(s.startswith("mma") for s in skeletons), skeletons
    chunk = [generate(prep.graph, g.kernel, name=f"k{i}") for i, (prep, g) in enumerate(kernels.values())]
    for start in range(0, len(chunk), BUNDLE):
        result = nvrtc.compile_cuda(cuda_module(chunk[start:start + BUNDLE]), arch="sm_75")
        for gk in chunk[start:start + BUNDLE]:
            res = result.resource(gk.name)
            assert res.registers > 0 and res.spill_store_bytes == 0, (gk.name, gk.skeleton, res)


def test_half_precision_tensor_core_kernels_compile():
    """The FP16 and BF16 forms of bert-small's (at batch 8, where its products fill tensor-core
    tiles) and resnet18's fused tensor-core kernels (their float32 operands converted to __half /
    __nv_bfloat16 while staged) compile for sm_80 and sm_90 without spills, with the shared memory
    their schedule gives."""
    from dataclasses import replace

    from fusesearch.ir.shapes import ShapeBindings
    from fusesearch.schedule import mma

    kernels, schedules = [], {}
    for model, dims in (("bert-small", ["batch=8"]), ("resnet18", [])):
        prep = prepare(f"zoo:{model}", ShapeBindings.parse([], dims))
        p = make_plan(f"zoo:{model}", device="h100-sxm", strategy="greedy", prepared=prep)
        tf32 = [g.kernel for g in p.groups if g.kernel.schedule.skeleton == "mma-tf32"][:3]
        assert tf32, model
        for kernel in tf32:
            s = kernel.schedule
            for skeleton in ("mma-f16", "mma-bf16"):
                half = mma(skeleton, s.tile, s.stages, s.grid)
                name = f"k{len(kernels)}"
                kernels.append(generate(prep.graph, replace(kernel, schedule=half), name=name))
                schedules[name] = half
    for arch in nvrtc.ARCHES:
        result = nvrtc.compile_cuda(cuda_module(kernels), arch=arch)
        for gk in kernels:
            res = result.resource(gk.name)
            assert res.registers > 0 and res.spill_store_bytes == 0, (gk.name, gk.skeleton, arch, res)
            assert res.smem_bytes == schedules[gk.name].smem_bytes <= STATIC_SMEM_LIMIT, (gk.name, arch, res)


def test_row_kernel_beside_mma_sync_has_the_priced_shared_memory(tmp_path):
    """A Softmax over rows of 7 computed values (its input row and its exponentials cached in shared
    memory: 7 floats each, 28 bytes, with the block reduction's 128 not a multiple of 16) compiled in one module with an mma.sync kernel (dynamic shared
    memory, which makes ptxas round every other kernel's static shared memory up to 16 bytes): the
    schedule prices the row rounded up (`schedule.row_floats`), so ptxas's bytes are the schedule's;
    alone in its module, the same."""
    from dataclasses import replace

    from onnx import helper

    from fusesearch.schedule import MMA_SYNC_TILES, SMEM_ALIGN, mma_sync
    from tests.backends.test_cuda_emulated import rand
    from tests.conftest import make_model, save

    rows = make_model([helper.make_node("Add", ["x", "c"], ["s"]), helper.make_node("Softmax", ["s"], ["y"], axis=-1)],
                      [("x", [6, 7])], [("y", None)], [("c", rand(7))])
    gemm = make_model([helper.make_node("MatMul", ["a", "w"], ["y"])], [("a", [40, 48])], [("y", None)],
                      [("w", rand(48, 40))])
    row_prep = prepare(save(rows, tmp_path / "rows.onnx"))
    row = lower(row_prep.graph, FusionGroup(frozenset(range(len(row_prep.graph)))))
    assert row.schedule.skeleton == "block-per-row" and row.schedule.row_cache, row.schedule
    assert row.schedule.smem_bytes % SMEM_ALIGN == 0 and row.schedule.smem_bytes >= 2 * 7 * 4 + 32 * 4
    gemm_prep = prepare(save(gemm, tmp_path / "gemm.onnx"), tf32=True)
    anchor = lower(gemm_prep.graph, FusionGroup(frozenset(range(len(gemm_prep.graph)))))
    sync = replace(anchor, schedule=mma_sync("mma-sync-tf32", MMA_SYNC_TILES[-1], 40, 40))
    kernels = [generate(row_prep.graph, row, name="rows"), generate(gemm_prep.graph, sync, name="sync")]
    assert kernels[1].dynamic_smem
    for module in (kernels, kernels[:1]):
        result = nvrtc.compile_cuda(cuda_module(module), arch="sm_80")
        assert result.resource("rows").smem_bytes == row.schedule.smem_bytes, result.resource("rows")
