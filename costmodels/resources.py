"""Per-kernel resource estimates: registers, spills, occupancy, grid size.

Problem: fusing more ops into one kernel keeps more values live per thread (registers) and may
ask for more shared memory; both cut how many warps an SM keeps resident (occupancy), and past
255 registers the compiler spills to local memory. The model needs these effects without a
compiler.
Approach: registers = base + per_value x live values x (32-bit words per value), rounded to whole
registers; what exceeds the per-thread maximum spills (4 bytes per register). Occupancy follows
the CUDA Occupancy Calculator: resident blocks per SM = the least of the thread, register (256
registers per warp allocation unit), shared-memory (per-arch allocation unit plus the 1 KiB the
system reserves per block on cc 8.0+) and block-count limits; occupancy = resident warps /
maximum warps. Simplification: register allocation is per SM, not per SM sub-partition.
Invariants: pure functions of plain numbers; results are small frozen dataclasses; a kernel that
cannot place one block on an SM gets blocks_per_sm = 0 and says which limit stopped it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from costmodels.devices import DeviceSpec
from costmodels.kernel import KernelSpec

# Registers are allocated per warp in units of 256 (CUDA Occupancy Calculator, cc 5.0-9.0).
REG_ALLOC_UNIT_PER_WARP = 256
REG_BYTES = 4
# Register-estimate defaults (RooflineParams carries the tunable copies): a minimal elementwise
# kernel (index math, pointers, bounds predicate) compiles to ~10-16 registers with ptxas;
# each live 32-bit value then takes one register.
DEFAULT_REGS_BASE = 16.0
DEFAULT_REGS_PER_LIVE_VALUE = 1.0
# Shared-memory allocation unit and per-block system reservation by arch (CUDA Occupancy
# Calculator; CUDA C++ Programming Guide: "1 KB of shared memory is reserved for system use"
# per block on cc 8.x and 9.0). Unknown arches (CPUs) use (1, 0).
SMEM_ALLOC: dict[str, tuple[int, int]] = {
    "sm_70": (256, 0),
    "sm_75": (256, 0),
    "sm_80": (128, 1024),
    "sm_86": (128, 1024),
    "sm_89": (128, 1024),
    "sm_90": (128, 1024),
}
LIMITERS = ("threads", "registers", "smem", "blocks")


@dataclass(frozen=True)
class RegisterEstimate:
    """`estimated`: registers the kernel wants; `regs_per_thread`: what it gets (capped)."""

    estimated: int
    regs_per_thread: int
    spill_bytes_per_thread: int

    @property
    def spills(self) -> bool:
        return self.spill_bytes_per_thread > 0


@dataclass(frozen=True)
class Occupancy:
    """Resident blocks and warps per SM and what limits them (`limits`: blocks allowed by each)."""

    blocks_per_sm: int
    warps_per_block: int
    active_warps: int
    max_warps: int
    occupancy: float
    limiter: str
    limits: tuple[tuple[str, int], ...]


def estimate_registers(
    live_values: int,
    dtype_bytes: int,
    regs_per_thread_max: int,
    *,
    base: float = DEFAULT_REGS_BASE,
    per_value: float = DEFAULT_REGS_PER_LIVE_VALUE,
) -> RegisterEstimate:
    """Registers per thread from live values; the excess over the maximum spills."""
    words_per_value = max(1, math.ceil(dtype_bytes / REG_BYTES))
    estimated = math.ceil(base + per_value * live_values * words_per_value)
    allocated = min(estimated, regs_per_thread_max)
    return RegisterEstimate(estimated, allocated, (estimated - allocated) * REG_BYTES)


def smem_allocated_bytes(smem_bytes: int, arch: str) -> int:
    """Shared memory one block really takes: request + system reserve, rounded to the unit."""
    unit, reserved = SMEM_ALLOC.get(arch, (1, 0))
    return math.ceil((smem_bytes + reserved) / unit) * unit


def occupancy(
    device: DeviceSpec, threads_per_block: int, regs_per_thread: int, smem_bytes: int
) -> Occupancy:
    """Theoretical occupancy of one SM (CUDA Occupancy Calculator rules, see module note)."""
    warps_per_block = math.ceil(threads_per_block / device.warp_size)
    max_warps = device.max_warps_per_sm
    regs_per_warp = _round_up(regs_per_thread * device.warp_size, REG_ALLOC_UNIT_PER_WARP)
    smem_per_block = smem_allocated_bytes(smem_bytes, device.arch)
    unbounded = device.max_blocks_per_sm
    by_threads = max_warps // warps_per_block
    if threads_per_block > device.max_threads_per_block:
        by_threads = 0
    by_regs = (device.regs_per_sm // regs_per_warp) // warps_per_block if regs_per_warp else unbounded
    by_smem = device.smem_per_sm_bytes // smem_per_block if smem_per_block else unbounded
    limits = (("threads", by_threads), ("registers", by_regs), ("smem", by_smem),
              ("blocks", device.max_blocks_per_sm))
    limiter, blocks = min(limits, key=lambda item: item[1])  # first of equals wins
    active_warps = blocks * warps_per_block
    return Occupancy(blocks, warps_per_block, active_warps, max_warps,
                     active_warps / max_warps, limiter, limits)


def grid_blocks(spec: KernelSpec) -> int:
    """Blocks in the launch grid: output tiles for gemm / conv with an (M, N, ...) tile, else one
    thread per element of the iteration space (`spec.blocks` where the lowering set the grid it
    generates). At least 1."""
    if spec.blocks:
        return spec.blocks
    per_block = spec.tile[0] * spec.tile[1] if len(spec.tile) >= 2 else spec.threads_per_block
    return max(1, math.ceil(spec.iteration_size / per_block))


def achieved_occupancy(occ: Occupancy, blocks_in_grid: int, sm_count: int) -> float:
    """Occupancy the grid can reach: a grid smaller than one full wave leaves SMs (or warp
    slots) empty, so resident warps = min(blocks_per_sm, grid / SMs) x warps per block."""
    if occ.blocks_per_sm == 0:
        return 0.0
    blocks_per_sm = min(float(occ.blocks_per_sm), blocks_in_grid / sm_count)
    return blocks_per_sm * occ.warps_per_block / occ.max_warps


def _round_up(value: int, unit: int) -> int:
    return math.ceil(value / unit) * unit
