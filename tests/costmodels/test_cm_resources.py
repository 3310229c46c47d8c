"""Registers, spills and occupancy against the CUDA Occupancy Calculator rules."""

from __future__ import annotations

import pytest

from costmodels import DEVICES, KernelSpec, achieved_occupancy, estimate_registers, grid_blocks
from costmodels import occupancy as occupancy_of

H100 = DEVICES["h100-sxm"]
T4 = DEVICES["t4"]


def test_register_estimate_and_spills():
    """Register model: base + live values (2 words for 8-byte types); spills above 255."""
    assert estimate_registers(4, 4, 255).regs_per_thread == 20
    assert estimate_registers(4, 8, 255).regs_per_thread == 24
    fits = estimate_registers(239, 4, 255)
    assert (fits.regs_per_thread, fits.spill_bytes_per_thread, fits.spills) == (255, 0, False)
    spills = estimate_registers(300, 4, 255)
    assert spills.estimated == 316 and spills.regs_per_thread == 255
    assert spills.spill_bytes_per_thread == (316 - 255) * 4 and spills.spills


def test_default_pointwise_block_is_thread_limited():
    """Occupancy, thread limit: 256-thread blocks at 20 regs fill all 64 warps of an H100 SM."""
    occ = occupancy_of(H100, 256, 20, 0)
    assert (occ.blocks_per_sm, occ.occupancy, occ.limiter) == (8, 1.0, "threads")


def test_occupancy_falls_as_registers_rise():
    """Occupancy, register limit: more live values per thread -> fewer resident warps."""
    values = [occupancy_of(H100, 256, regs, 0).occupancy for regs in (32, 64, 96, 128, 168, 255)]
    assert values == sorted(values, reverse=True)
    assert values[0] == 1.0 and values[-1] == pytest.approx(0.125)
    assert occupancy_of(H100, 256, 128, 0).limiter == "registers"
    # 128 regs x 32 = 4096 per warp -> 16 warps -> 2 blocks of 8 warps
    assert occupancy_of(H100, 256, 128, 0).blocks_per_sm == 2


def test_shared_memory_limits_blocks_including_the_system_reserve():
    """Occupancy, smem limit: 113 KiB + 1 KiB reserved per block -> 2 blocks on a 228 KiB SM."""
    occ = occupancy_of(H100, 128, 32, 113 * 1024)
    assert (occ.blocks_per_sm, occ.limiter) == (2, "smem")
    assert occupancy_of(H100, 128, 32, 114 * 1024).blocks_per_sm == 1
    assert occupancy_of(T4, 128, 32, 32 * 1024).blocks_per_sm == 2  # no reserve on sm_75


def test_small_blocks_hit_the_block_limit():
    """Occupancy, block limit: 32-thread blocks stop at 32 blocks = half of 64 warps."""
    occ = occupancy_of(H100, 32, 20, 0)
    assert (occ.blocks_per_sm, occ.occupancy, occ.limiter) == (32, 0.5, "blocks")


def test_oversized_blocks_do_not_fit():
    """Occupancy, no fit: 1024 threads x 255 regs exceeds 64 K registers; 2048 threads too many."""
    assert occupancy_of(H100, 1024, 255, 0).blocks_per_sm == 0
    assert occupancy_of(H100, 1024, 255, 0).limiter == "registers"
    assert occupancy_of(H100, 2048, 16, 0).blocks_per_sm == 0


def test_grid_blocks_and_achieved_occupancy():
    """Grid: tiles for gemm, threads for pointwise; a grid below one wave leaves SMs idle."""
    gemm = KernelSpec("gemm", "float16", iteration_size=4096 * 4096, tile=(128, 128, 32))
    assert grid_blocks(gemm) == 32 * 32
    pointwise = KernelSpec("pointwise", iteration_size=1000)
    assert grid_blocks(pointwise) == 4
    assert grid_blocks(KernelSpec("pointwise")) == 1
    occ = occupancy_of(H100, 256, 20, 0)
    assert achieved_occupancy(occ, 10_000, H100.sm_count) == 1.0
    assert achieved_occupancy(occ, 132, H100.sm_count) == pytest.approx(8 / 64)
