"""The mma.sync skeletons (`mma-sync-tf32`, `mma-sync-f16`, `mma-sync-bf16`): every tile
configuration lowering lists (`schedule.MMA_SYNC_TILES`) is one schedule, written as given,
emulated equal to ONNX Runtime (GELU prologue staged, bias epilogue on the accumulators, M, N and
K not multiples of the tile, fewer K steps than stages; split-K for a small output), compiled by
NVRTC for sm_80 and sm_90 without spills and with the schedule's shared memory, its swizzle free of
bank conflicts, and chosen by the cost model for a large GEMM on an H100 (split-K for a skinny one)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from onnx import helper

from costmodels import RooflineModel
from fusesearch.api import for_device, resolve_device
from fusesearch.backends import emulate
from fusesearch.backends.codegen import cuda_module, generate
from fusesearch.backends.codegen.mma_sync import swizzled
from fusesearch.costing import priced_kernel
from fusesearch.groups import FusionGroup
from fusesearch.ir.canonicalize import to_proto
from fusesearch.lowering import choices, lower
from fusesearch.pipeline import prepare
from fusesearch.schedule import (
    MMA_ELEMENT_BYTES,
    MMA_SYNC_TILES,
    mma_sync,
    mma_sync_k,
    mma_sync_smem_bytes,
    mma_sync_split,
    mma_sync_threads,
    split_choices,
    split_k_workspace,
)
from fusesearch.verify import all_values, random_feeds
from tests.backends.test_cuda_emulated import GELU_CONSTANTS, check, gelu, one_group, rand
from tests.conftest import make_model, save

SKELETONS = ("mma-sync-tf32", "mma-sync-f16", "mma-sync-bf16")
CONFIGS = {f"{c[0]}x{c[1]}-w{c[2]}x{c[3]}-s{c[4]}": c for c in MMA_SYNC_TILES}

emulated = pytest.mark.skipif(not emulate.available(), reason="no C++ compiler")


def gelu_gemm_bias(tmp_path, m: int, n: int, k: int):
    """GELU(x) @ w + bias: the GELU computed while A is staged, the bias added to the accumulators."""
    nodes = [*gelu("x", "gx"), helper.make_node("MatMul", ["gx", "w"], ["y"]),
             helper.make_node("Add", ["y", "bias"], ["out"])]
    inits = [("w", rand(k, n)), ("bias", rand(n, seed=6)), *GELU_CONSTANTS]
    tmp_path.mkdir(parents=True, exist_ok=True)
    return save(make_model(nodes, [("x", [m, k])], [("out", None)], inits), tmp_path / "m.onnx")


def run_config(path, skeleton: str, config, split: int = 1, **prepare_args):
    prep = prepare(path, tf32=True, **prepare_args)
    values = all_values(to_proto(prep.canonical), random_feeds(to_proto(prep.canonical), 0))
    group = range(len(prep.graph))
    anchor = lower(prep.graph, FusionGroup(frozenset(group))).anchor
    out = prep.graph.tensors[prep.graph.nodes[anchor].outputs[0]].shape  # [M, N]: one GEMM
    schedule = mma_sync(skeleton, config, out[0], out[1], split=split)
    return check(prep, values, group, skeleton, schedule)


@emulated
@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
@pytest.mark.parametrize("skeleton", SKELETONS)
def test_every_configuration_equals_onnx_runtime_emulated(tmp_path, skeleton, config):
    """M = 67, N = 70, K = 100 (7 TF32 / 4 FP16 K steps, a partial last one): every block tile,
    warp tile and stage count, with FP16 / BF16 converting the float32 operands while staging,
    within the precision's tolerance of ONNX Runtime."""
    gk = run_config(gelu_gemm_bias(tmp_path, 67, 70, 100), skeleton, config)
    src = gk.cuda_source
    assert "fs_ldmatrix_x4(" in src and "nvcuda::wmma" not in src and f"fs_cp_async_wait<{config[4] - 2}>" in src
    assert gk.dynamic_smem == mma_sync_smem_bytes((config[0], config[1], mma_sync_k(MMA_ELEMENT_BYTES[skeleton])),
                                                  config[4], MMA_ELEMENT_BYTES[skeleton])


@emulated
@pytest.mark.parametrize("skeleton", SKELETONS)
def test_tiny_shape_fewer_k_steps_than_stages(tmp_path, skeleton):
    """M = 5, N = 7, K = 9: one partial K step where the pipeline keeps three or four in flight
    (the empty commit groups past the end), one partial tile per block."""
    run_config(gelu_gemm_bias(tmp_path, 5, 7, 9), skeleton, MMA_SYNC_TILES[0])


@emulated
def test_plain_copies_are_cp_async_and_the_transposed_layouts_stage_right(tmp_path):
    """TF32 Gemm with transB (B K-contiguous in global memory) and bias + ReLU: both operands are
    plain copies of inputs, staged by 4-byte cp.async into the swizzled K-contiguous buffers."""
    nodes = [helper.make_node("Gemm", ["a", "b", "c"], ["y"], transB=1), helper.make_node("Relu", ["y"], ["out"])]
    inits = [("b", rand(50, 40)), ("c", rand(50, seed=2))]
    gk = one_group(tmp_path, nodes, [("a", [33, 40])], [("out", None)], inits, tf32=True,
                   schedule=mma_sync("mma-sync-tf32", MMA_SYNC_TILES[-1], 33, 50), skeleton="mma-sync-tf32")
    assert gk.cuda_source.count("fs_cp_async4(&") == 2


@emulated
@pytest.mark.parametrize("skeleton", ["mma-sync-tf32", "mma-sync-f16"])
def test_conv_implicit_gemm(tmp_path, skeleton):
    """A 3x3 padded conv with bias and ReLU (A gathered M-contiguous with its zero padding)."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["y"], ["out"])]
    inits = [("w", rand(20, 6, 3, 3)), ("b", rand(20, seed=4))]
    one_group(tmp_path, nodes, [("x", [2, 6, 9, 7])], [("out", None)], inits, tf32=True, skeleton=skeleton,
              schedule=mma_sync(skeleton, MMA_SYNC_TILES[-1], 126, 20))


@emulated
@pytest.mark.parametrize("dtype,skeleton", [("float16", "mma-sync-f16"), ("bfloat16", "mma-sync-bf16")])
def test_half_model_every_configuration(tmp_path, dtype, skeleton):
    """The model converted to half: each configuration reads half operands, multiplies them on
    FP16 / BF16 tensor cores and stores half, equal to ONNX Runtime's half model."""
    path = gelu_gemm_bias(tmp_path, 37, 45, 70)
    for config in MMA_SYNC_TILES:
        gk = run_config(path, skeleton, config, dtype=dtype)
        assert {a.dtype for a in (*gk.inputs, *gk.outputs)} == {dtype}


@emulated
@pytest.mark.parametrize("skeleton", SKELETONS)
def test_split_k_sums_the_partials_in_one_kernel(tmp_path, skeleton):
    """M = 37, N = 70, K = 300 split 4 ways (19 or 10 K steps, the last split shorter): the last
    block of each tile sums the partials and applies the epilogue, equal to ONNX Runtime; a second
    launch of the same module (its arrival counters reset by the first) gives identical bits."""
    path = gelu_gemm_bias(tmp_path, 37, 70, 300)
    gk = run_config(path, skeleton, MMA_SYNC_TILES[-1], split=4)
    assert "atomicAdd(&fs_arrivals[tile], 1u) == 3u" in gk.cuda_source and gk.grid[2] == 4
    feeds = {a.tensor: rand(*a.shape, seed=9) for a in gk.inputs}
    first, second = (emulate.run(gk, feeds)[gk.outputs[0].tensor] for _ in range(2))
    assert np.array_equal(first, second) and np.isfinite(first).all()


@emulated
@pytest.mark.parametrize("skeleton", ["mma-sync-tf32", "mma-sync-f16"])
def test_split_k_at_16_rows_moves_only_the_real_rows(tmp_path, skeleton):
    """M = 16 on a 64 x 64 tile (48 rows of padding), N = 96 (a partial column tile), K = 384 split
    the rule's way (`mma_sync_split`: 6 TF32 / 3 FP16 ways, 4 K steps each): equal to ONNX Runtime; the workspace the kernel declares
    is the schedule's `workspace_bytes`, split x 16 x 96 floats (not split x 2 tiles x 64 x 64),
    each split's store guarded to the output's rows and columns, the sum read row-major."""
    config = next(c for c in MMA_SYNC_TILES if c[:2] == (64, 64))
    split = mma_sync_split(16, 96, 384, mma_sync(skeleton, config, 16, 96).tile)
    gk = run_config(gelu_gemm_bias(tmp_path, 16, 96, 384), skeleton, config, split=split)
    schedule = mma_sync(skeleton, config, 16, 96, split=split)
    assert split == {"mma-sync-tf32": 6, "mma-sync-f16": 3}[skeleton] and schedule.workspace_bytes == split * 16 * 96 * 4 == split_k_workspace(split, 16 * 96)
    assert f"__device__ float fs_partials[{split * 16 * 96}];" in gk.cuda_source
    assert "if (dm < rows && dn < cols) fs_partials[" in gk.cuda_source


def test_split_k_is_a_priced_choice_for_a_skinny_gemm(tmp_path):
    """A skinny fused GEMM (8 x 768 x 3072, FP16) has fewer output tiles than TARGET_BLOCKS: each
    mma.sync configuration is listed at the rule's split (`mma_sync_split`) and every power of two
    below it down to unsplit (`split_choices`), each split one with its partials' round trip in
    its traffic: split x 8 x 768 floats written and read back (the real rows, not the 32 to 128
    rows of its padded tiles), its `workspace_bytes`; on h100-sxm a split mma.sync kernel is the
    cheapest."""
    path = gelu_gemm_bias(tmp_path, 8, 768, 3072)
    _, spec, params, _ = resolve_device("h100-sxm")
    prep, params = for_device(prepare(path, tf32=True, dtype="float16"), spec, params)
    group = FusionGroup(frozenset(range(len(prep.graph))))
    sync = [k for k in choices(prep.graph, group) if k.schedule.skeleton == "mma-sync-f16"]

    def config(k):
        return k.tile, k.schedule.warp, k.schedule.stages

    unsplit = {config(k): k for k in sync if k.schedule.split_k == 1}
    assert len(unsplit) == len(MMA_SYNC_TILES)
    for key, alone in unsplit.items():
        rule = mma_sync_split(8, 768, 3072, alone.tile)
        assert rule > 1 and [k.schedule.split_k for k in sync if config(k) == key] == list(split_choices(rule))
    for k in sync:
        s = k.schedule
        assert s.grid[2] == s.split_k and 4 * s.split_k * s.tile[2] <= 3072
        extra = s.split_k * 8 * 768 * 4 if s.split_k > 1 else 0
        alone = unsplit[config(k)]
        assert s.workspace_bytes == extra == split_k_workspace(s.split_k, 8 * 768)
        assert k.write_bytes == alone.write_bytes + extra and k.read_bytes == alone.read_bytes + extra
    chosen, _ = priced_kernel(prep.graph, lower(prep.graph, group), spec, RooflineModel(params))
    assert chosen.schedule.skeleton == "mma-sync-f16" and chosen.schedule.split_k > 1, chosen.schedule


def test_swizzle_is_a_permutation_without_bank_conflicts():
    """In a staged buffer (64-byte rows: BK = 16 floats or 32 halves) each row's elements stay in
    the row, and for every 16-byte column chunk the 8 rows an ldmatrix phase (or a TF32 fragment's
    8 lane groups) reads start in 8 distinct 16-byte bank groups of the 128-byte bank line."""
    for esize in (4, 2):
        bk = mma_sync_k(esize)
        expr = swizzled("row", "col", bk, esize)
        at = {(r, c): eval(expr, {}, {"row": r, "col": c}) for r in range(64) for c in range(bk)}  # C and Python agree
        for r in range(64):
            assert sorted(at[r, c] for c in range(bk)) == list(range(r * bk, (r + 1) * bk))
        per_chunk = 16 // esize
        for r0 in range(0, 64, 8):
            for c in range(0, bk, per_chunk):
                groups = {(at[r0 + i, c] * esize // 16) % 8 for i in range(8)}
                assert len(groups) == 8, (esize, r0, c, groups)


def test_lowering_lists_every_configuration_as_one_schedule(tmp_path):
    """A fused GEMM group's choices hold one `mma-sync-tf32` kernel per configuration: its block
    tile, warp tile, stages, a warp per warp tile, the shared memory `mma_sync_smem_bytes` gives;
    the default first is the largest tile that still fills TARGET_BLOCKS tiles (those that leave
    fewer are listed split-K too: `test_split_k_is_a_priced_choice_for_a_skinny_gemm`)."""
    prep = prepare(gelu_gemm_bias(tmp_path, 2048, 1024, 256), tf32=True)
    options = [k for k in choices(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))))
               if k.schedule.skeleton == "mma-sync-tf32" and k.schedule.split_k == 1]
    got = [(*k.tile[:2], *k.schedule.warp, k.schedule.stages) for k in options]
    assert sorted(got) == sorted(MMA_SYNC_TILES) and got[0] == (64, 128, 32, 64, 4)  # 32 x 8 = 256 tiles
    for k in options:
        s = k.schedule
        assert s.tile[2] == 16 and s.threads == mma_sync_threads(s.tile, s.warp) and s.min_arch == 80
        assert s.smem_bytes == s.stages * (s.tile[0] + s.tile[1]) * 16 * 4 and k.spec().mma_sync
        assert s.grid == (math.ceil(1024 / s.tile[1]), math.ceil(2048 / s.tile[0]), 1)


@pytest.mark.parametrize("dtype,skeleton", [("float32", "mma-sync-tf32"), ("float16", "mma-sync-f16")])
def test_a_large_fused_gemm_on_h100_runs_mma_sync(tmp_path, dtype, skeleton):
    """bert-base's FFN up-projection at batch 8 x 512 tokens (4096 x 3072 x 768) with bias and
    ReLU on h100-sxm: the cheapest choice is an mma.sync tile (priced at `mma_sync_efficiency`,
    above the wmma tiles' `mma_efficiency`)."""
    path = gelu_gemm_bias(tmp_path, 4096, 3072, 768)
    _, spec, params, _ = resolve_device("h100-sxm")
    prep, params = for_device(prepare(path, tf32=True, dtype=dtype), spec, params)
    group = FusionGroup(frozenset(range(len(prep.graph))))
    chosen, cost = priced_kernel(prep.graph, lower(prep.graph, group), spec, RooflineModel(params))
    assert chosen.schedule.skeleton == skeleton, chosen.schedule
    assert math.isfinite(cost.time_s)


def test_every_configuration_compiles_for_sm80_and_sm90_without_spills(tmp_path):
    """Every configuration in every precision, unsplit and split-K, NVRTC for sm_80 and sm_90: no spills, no static
    shared memory, and the dynamic shared memory the launch asks for is the schedule's."""
    nvrtc = pytest.importorskip("fusesearch.backends.nvrtc")
    if not nvrtc.toolchain_available():
        pytest.skip("no CUDA compiler (NVRTC or nvcc)")
    prep = prepare(gelu_gemm_bias(tmp_path, 300, 500, 200), tf32=True)
    kernel = lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))))
    kernels, schedules = [], {}
    for skeleton in SKELETONS:
        for config in MMA_SYNC_TILES:
            for split in (1, 3):
                _add_configuration(prep.graph, kernel, skeleton, config, split, kernels, schedules)
    _compile_without_spills(nvrtc, kernels, schedules)


def _add_configuration(graph, kernel, skeleton, config, split, kernels, schedules) -> None:
    """The 300 x 500 group generated with one mma.sync configuration, appended by its name."""
    schedule = mma_sync(skeleton, config, 300, 500, split=split)
    name = f"k{len(kernels)}"
    kernels.append(generate(graph, replace(kernel, schedule=schedule), name=name))
    schedules[name] = schedule


def _compile_without_spills(nvrtc, kernels, schedules) -> None:
    """One module per arch: every kernel has registers, no spills, no static shared memory, and
    asks for its schedule's dynamic shared memory."""
    for arch in nvrtc.ARCHES:
        result = nvrtc.compile_cuda(cuda_module(kernels), arch=arch)
        for gk in kernels:
            res = result.resource(gk.name)
            assert res.registers > 0 and res.spill_store_bytes == res.spill_load_bytes == 0, (gk.name, arch, res)
            assert res.smem_bytes == 0 and gk.dynamic_smem == schedules[gk.name].smem_bytes, (gk.name, arch, res)


def gemm_trans_b(tmp_path, m: int, n: int, k: int):
    """Gemm(a, b^T) + bias, ReLU: A row-major and B K-contiguous (transB), both plain inputs."""
    nodes = [helper.make_node("Gemm", ["a", "b", "c"], ["y"], transB=1), helper.make_node("Relu", ["y"], ["out"])]
    tmp_path.mkdir(parents=True, exist_ok=True)
    return save(make_model(nodes, [("a", [m, k])], [("out", None)], [("b", rand(n, k)), ("c", rand(n, seed=2))]),
                tmp_path / "g.onnx")


@emulated
@pytest.mark.parametrize("dtype,skeleton", [("float16", "mma-sync-f16"), ("bfloat16", "mma-sync-bf16")])
def test_half_operands_are_staged_by_16_byte_cp_async(tmp_path, dtype, skeleton):
    """The half model's Gemm (M = 37, N = 45, K = 72: nine 16-byte chunks per row, partial tiles
    in M, N and K): both operands K-contiguous half inputs, so each thread copies 16-byte chunks
    (8 halves) by cp.async, zero-filling the chunks past M, N or K (the emulator faults a chunk
    that is not 16-byte aligned); every configuration equal to ONNX Runtime. With K = 70 (rows
    not whole chunks) the element-wise staging stays."""
    path = gemm_trans_b(tmp_path / "k72", 37, 45, 72)
    for config in MMA_SYNC_TILES:
        gk = run_config(path, skeleton, config, dtype=dtype)
        assert gk.cuda_source.count("fs_cp_async16(&") == 2 and "fs_cp_async4(&" not in gk.cuda_source
    gk = run_config(gemm_trans_b(tmp_path / "k70", 37, 45, 70), skeleton, MMA_SYNC_TILES[-1], dtype=dtype)
    assert "fs_cp_async16(&" not in gk.cuda_source


def test_16_byte_staging_compiles_for_sm80_and_sm90_without_spills(tmp_path):
    """Every configuration with 16-byte staging (FP16 and BF16, unsplit and split-K) compiles by
    NVRTC for sm_80 and sm_90 with no spills and the schedule's dynamic shared memory."""
    nvrtc = pytest.importorskip("fusesearch.backends.nvrtc")
    if not nvrtc.toolchain_available():
        pytest.skip("no CUDA compiler (NVRTC or nvcc)")
    kernels, schedules = [], {}
    for dtype, skeleton in (("float16", "mma-sync-f16"), ("bfloat16", "mma-sync-bf16")):
        prep = prepare(gemm_trans_b(tmp_path / dtype, 300, 500, 256), tf32=True, dtype=dtype)
        kernel = lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))))
        for config in MMA_SYNC_TILES:
            for split in (1, 2):
                _add_configuration(prep.graph, kernel, skeleton, config, split, kernels, schedules)
    assert all(gk.cuda_source.count("fs_cp_async16(&") == 2 for gk in kernels)
    _compile_without_spills(nvrtc, kernels, schedules)
