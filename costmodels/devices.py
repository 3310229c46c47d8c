"""Hardware descriptions: `DeviceSpec`, the built-in GPU table and `host_cpu()`.

Problem: a cost model needs a device's peak rates and limits, each traceable to a public source, so
a plan for "h100-sxm" means the same thing to every reader.
Approach: per-SM limits from one table keyed by compute capability (CUDA C++ Programming Guide);
per-product figures from NVIDIA whitepapers and datasheets, cited per entry; tensor-core figures
DENSE (not the 2:4-sparse ones), 0 where a type has no tensor-core path. `host_cpu()` fills the
same fields for this machine from /proc and /sys and `probes`, measured once per (CPU model,
OpenMP threads, probe size) and kept as JSON in the user cache folder, so `host` gives the same
plan.json on every run.
Invariants: specs are frozen; every rate and size is positive (tensor-core rates and the cache
regime may be 0); names are lowercase-hyphen; the table never changes at run time."""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import math
import os
import platform
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from costmodels import probes
from costmodels.errors import CacheFolderError, InvalidSpec, UnknownDevice

KIB = 1024
MIB = 1024 * KIB
MHZ = 1e6
TERA = 1e12
GB_PER_S = 1e9  # datasheets use decimal gigabytes

KINDS = ("gpu", "cpu")
GPU_CAPABILITIES = (30, 129)  # compute capability x 10 of a GPU's arch: Kepler 3.0 to Blackwell's 12.x
HOST_NAMES = ("host", "cpu")
_NAME_RE = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")

# Kernel launch overhead, GPU. Not published by NVIDIA; XLA's gpu_performance_model uses
# kKernelLaunchOverhead = 1 us (gpu_performance_model_base.h; 5 us in older releases), and an
# empty kernel timed back to back with CUDA events takes ~2-3 us. Calibration rescales it
# (RooflineParams.launch_overhead_scale).
GPU_LAUNCH_OVERHEAD_S = 2e-6

# Sources, cited by key in each entry.
SRC_CUDA_GUIDE = (
    "CUDA C++ Programming Guide (v12.x), table 'Technical Specifications per Compute "
    "Capability' (per-SM threads, blocks, registers, shared memory)"
)
SRC_VOLTA = "NVIDIA Tesla V100 GPU Architecture whitepaper (WP-08608-001_v1.1), table 1"
SRC_V100_DS = "NVIDIA Tesla V100 datasheet (2020): SXM2 125 TFLOPS tensor, 15.7 FP32, 900 GB/s"
SRC_TURING = "NVIDIA Turing GPU Architecture whitepaper (WP-09183-001_v01), TU104 / Tesla T4"
SRC_T4_DS = "NVIDIA T4 datasheet: 8.1 TFLOPS FP32, 65 TFLOPS FP16 mixed, 320 GB/s GDDR6"
SRC_GA100 = "NVIDIA A100 Tensor Core GPU Architecture whitepaper (V1.0), tables 1 and 3"
SRC_A100_DS = (
    "NVIDIA A100 datasheet (2021): FP32 19.5, TF32 156, BF16/FP16 312 TFLOPS dense; "
    "1,555 GB/s (40GB), 2,039 GB/s (80GB SXM), 1,935 GB/s (80GB PCIe)"
)
SRC_GA102 = (
    "NVIDIA Ampere GA102 GPU Architecture whitepaper (V2.0), appendix A (RTX 3090) and A10 "
    "column; 6,144 KB L2"
)
SRC_A10_DS = "NVIDIA A10 datasheet: FP32 31.2, TF32 62.5, BF16/FP16 125 TFLOPS dense, 600 GB/s"
SRC_ADA = "NVIDIA Ada GPU Architecture whitepaper (V2.02), appendix (RTX 4090, L40/AD102, AD104)"
SRC_L4_DS = "NVIDIA L4 datasheet: FP32 30.3, TF32 120*, FP16/BF16 242* TFLOPS (*sparse), 300 GB/s"
SRC_L40S_DS = (
    "NVIDIA L40S datasheet: FP32 91.6, TF32 366*, BF16/FP16 733* TFLOPS (*sparse), 864 GB/s"
)
SRC_HOPPER = "NVIDIA H100 Tensor Core GPU Architecture whitepaper (V1.04), table 3; 50 MB L2"
SRC_H100_DS = (
    "NVIDIA H100 datasheet: SXM FP32 67, TF32 989*, BF16/FP16 1,979* TFLOPS, 3.35 TB/s; "
    "PCIe FP32 51, TF32 756*, FP16 1,513*, 2 TB/s (*sparse)"
)
SRC_H200_DS = "NVIDIA H200 datasheet: SXM FP32 67, TF32 989*, FP16 1,979* TFLOPS, 4.8 TB/s HBM3e"
SRC_LAUNCH = (
    "launch overhead: estimate (XLA gpu_performance_model kKernelLaunchOverhead = 1 us; "
    "CUDA-event timing of an empty kernel ~2-3 us)"
)

# Per-SM limits by compute capability (SRC_CUDA_GUIDE). Every GPU here has 64 K 32-bit registers
# per SM, at most 255 registers per thread, 1,024 threads per block and 32-thread warps.
REGS_PER_SM = 64 * KIB
REGS_PER_THREAD_MAX = 255
MAX_THREADS_PER_BLOCK = 1024
WARP_SIZE = 32
ARCH_LIMITS: Mapping[str, Mapping[str, int]] = {
    # cc 7.0 (Volta): 96 KB smem per SM, 96 KB per block (opt-in), 2048 threads, 32 blocks.
    "sm_70": {"smem_per_sm_bytes": 96 * KIB, "smem_per_block_max_bytes": 96 * KIB,
              "max_threads_per_sm": 2048, "max_blocks_per_sm": 32},
    # cc 7.5 (Turing): 64 KB smem per SM and per block, 1024 threads, 16 blocks.
    "sm_75": {"smem_per_sm_bytes": 64 * KIB, "smem_per_block_max_bytes": 64 * KIB,
              "max_threads_per_sm": 1024, "max_blocks_per_sm": 16},
    # cc 8.0 (GA100): 164 KB smem per SM, 163 KB per block, 2048 threads, 32 blocks.
    "sm_80": {"smem_per_sm_bytes": 164 * KIB, "smem_per_block_max_bytes": 163 * KIB,
              "max_threads_per_sm": 2048, "max_blocks_per_sm": 32},
    # cc 8.6 (GA102...): 100 KB smem per SM, 99 KB per block, 1536 threads, 16 blocks.
    "sm_86": {"smem_per_sm_bytes": 100 * KIB, "smem_per_block_max_bytes": 99 * KIB,
              "max_threads_per_sm": 1536, "max_blocks_per_sm": 16},
    # cc 8.9 (Ada): 100 KB smem per SM, 99 KB per block, 1536 threads, 24 blocks.
    "sm_89": {"smem_per_sm_bytes": 100 * KIB, "smem_per_block_max_bytes": 99 * KIB,
              "max_threads_per_sm": 1536, "max_blocks_per_sm": 24},
    # cc 9.0 (Hopper): 228 KB smem per SM, 227 KB per block, 2048 threads, 32 blocks.
    "sm_90": {"smem_per_sm_bytes": 228 * KIB, "smem_per_block_max_bytes": 227 * KIB,
              "max_threads_per_sm": 2048, "max_blocks_per_sm": 32},
}


# Fields a profile written before they existed may lack (they take their defaults).
_OPTIONAL_FIELDS = ("cache_curve", "sources", "tuned_tiles", "serial_launch_overhead_s")
# The two fields the cache curve replaced: one point, (cache_fit_bytes, cache_bytes_per_s)
_OLD_CACHE_FIELDS = ("cache_bytes_per_s", "cache_fit_bytes")


@dataclass(frozen=True)
class DeviceSpec:
    """One device's peak rates and per-SM limits (a CPU fills the same fields by analogy).

    Rates are peaks at the boost clock: `fp32_flops_per_s` on CUDA cores (FMA = 2 flops),
    `fp16_simt_flops_per_s` for half2 math on CUDA cores (0: use the FP32 rate), and dense
    tensor-core rates `tf32_flops_per_s` / `fp16_flops_per_s` / `bf16_flops_per_s` (FP32
    accumulate; 0 where the device has none). `smem_per_block_max_bytes` is the opt-in maximum
    (above the default 48 KiB).
    """

    name: str
    vendor: str
    kind: str
    arch: str
    sm_count: int
    clock_hz: float
    fp32_flops_per_s: float
    tf32_flops_per_s: float
    fp16_flops_per_s: float
    bf16_flops_per_s: float
    fp16_simt_flops_per_s: float
    dram_bytes_per_s: float
    l2_bytes: int
    smem_per_sm_bytes: int
    smem_per_block_max_bytes: int
    regs_per_sm: int
    regs_per_thread_max: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    max_threads_per_block: int
    warp_size: int
    launch_overhead_s: float
    # ((footprint bytes, bytes/s), ...), footprints ascending and rates non-increasing, all above
    # DRAM's: what a copy of that many bytes (read + written) moves per second on a CPU, whose
    # caches keep a timed loop's or a chain's tensors (`bandwidth_for` reads it); (): every byte
    # at `dram_bytes_per_s` (the GPU table: GPU timings flush L2).
    cache_curve: tuple[tuple[int, float], ...] = ()
    sources: tuple[str, ...] = ()
    # ((skeleton, shape class, configuration), ...): the tensor-core tile configuration measured
    # fastest on this device per shape class (a tiles.json beside its profile: `profile.load_tuned_tiles`),
    # which lowering offers alone for that class; (): the cost model chooses among them all.
    # Not part of the device's JSON (the table is its own file)
    tuned_tiles: tuple[tuple[str, str, tuple[int, ...]], ...] = ()
    # A CPU of more than one thread: what a kernel whose OpenMP region runs on one thread pays per
    # call instead of `launch_overhead_s` (no fork, no barrier; `KernelSpec.cpu_threads`); 0 where
    # unknown (a GPU, a one-thread CPU): such a kernel pays `launch_overhead_s`
    serial_launch_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", tuple(str(s) for s in self.sources))
        object.__setattr__(self, "cache_curve", _curve(self.name, self.cache_curve, self.dram_bytes_per_s))
        if not self.name or not _NAME_RE.match(self.name):
            raise InvalidSpec(f"device name {self.name!r} must be lowercase-hyphen, e.g. 'h100-sxm'")
        if self.kind not in KINDS:
            raise InvalidSpec(f"device {self.name}: kind {self.kind!r} must be one of {KINDS}")
        if self.kind == "gpu" and not GPU_CAPABILITIES[0] <= self.compute_capability <= GPU_CAPABILITIES[1]:
            raise InvalidSpec(f"device {self.name}: arch {self.arch!r} is not an NVIDIA GPU arch; expected sm_XY, "
                              f"compute capability X.Y from {GPU_CAPABILITIES[0] / 10:.1f} to "
                              f"{GPU_CAPABILITIES[1] / 10:.1f} (e.g. sm_90)")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "vendor", "kind", "arch", "sources", "cache_curve", "tuned_tiles"):
                continue
            may_be_zero = (f.name.endswith("_flops_per_s") and f.name != "fp32_flops_per_s"
                           or f.name == "serial_launch_overhead_s")
            if not _finite_number(value) or value < 0 or (value == 0 and not may_be_zero):
                raise InvalidSpec(f"device {self.name}: {f.name} = {value!r}, expected > 0")
        if self.smem_per_block_max_bytes > self.smem_per_sm_bytes:
            raise InvalidSpec(
                f"device {self.name}: smem_per_block_max_bytes {self.smem_per_block_max_bytes} "
                f"> smem_per_sm_bytes {self.smem_per_sm_bytes}"
            )

    def bandwidth_for(self, footprint_bytes: float) -> float:
        """Bytes/s for a kernel that reads and writes `footprint_bytes` in all, read off
        `cache_curve`: the first point's rate up to its footprint, between two points the straight
        line between them in log footprint and log rate, DRAM's beyond the last point (and with no
        curve)."""
        curve = self.cache_curve
        if not curve or footprint_bytes > curve[-1][0]:
            return self.dram_bytes_per_s
        i = next(i for i, (size, _) in enumerate(curve) if footprint_bytes <= size)
        if i == 0:
            return curve[0][1]
        (f0, r0), (f1, r1) = curve[i - 1], curve[i]
        return r0 * (r1 / r0) ** (math.log(footprint_bytes / f0) / math.log(f1 / f0))

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // self.warp_size

    @property
    def compute_capability(self) -> int:
        """An NVIDIA GPU's compute capability x 10 from `arch` ("sm_86" -> 86); 0 otherwise."""
        match = re.fullmatch(r"sm_(\d+)[a-z]?", self.arch)
        return int(match.group(1)) if self.kind == "gpu" and match else 0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (sources and the cache curve as lists)."""
        out = asdict(self)
        del out["tuned_tiles"]
        out["sources"] = list(self.sources)
        out["cache_curve"] = [list(point) for point in self.cache_curve]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceSpec:
        """Inverse of `to_dict`; raises InvalidSpec naming missing or unknown fields. A profile
        written with the two fields the cache curve replaced loads as that curve's one point."""
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data and n not in _OPTIONAL_FIELDS]
        unknown = sorted(set(data) - set(names) - set(_OLD_CACHE_FIELDS))
        if missing or unknown:
            raise InvalidSpec(f"device fields: missing {missing}, unknown {unknown}")
        kwargs = {k: v for k, v in data.items() if k not in _OLD_CACHE_FIELDS}
        rate, fit = data.get("cache_bytes_per_s", 0), data.get("cache_fit_bytes", 0)
        if "cache_curve" not in data and _finite_number(rate) and _finite_number(fit) and rate > 0 and fit > 0:
            kwargs["cache_curve"] = ((int(fit), float(rate)),)
        kwargs["sources"] = tuple(kwargs.get("sources", ()))
        return cls(**kwargs)


def _curve(name: str, curve: object, dram_bytes_per_s: float) -> tuple[tuple[int, float], ...]:
    """`curve` as a tuple of (int footprint, float rate), checked: footprints > 0 ascending, rates
    non-increasing and above DRAM's; raises InvalidSpec naming the device and the point."""
    try:
        points = tuple((int(size), float(rate)) for size, rate in curve)
    except (TypeError, ValueError):
        raise InvalidSpec(f"device {name}: cache_curve must be (footprint bytes, bytes/s) pairs, got {curve!r}") from None
    for i, (size, rate) in enumerate(points):
        previous = points[i - 1] if i else (0, math.inf)
        if not (math.isfinite(rate) and size > previous[0] and previous[1] >= rate > dram_bytes_per_s):
            raise InvalidSpec(f"device {name}: cache_curve point {i} ({size}, {rate:g}) must have a larger "
                              "footprint than the one before, a rate no higher than its, and above dram_bytes_per_s")
    return points


def _finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _nvidia(
    name: str,
    *,
    arch: str,
    sm_count: int,
    boost_mhz: float,
    fp32_tflops: float,
    fp16_simt_tflops: float,
    tf32_tc_tflops: float,
    fp16_tc_tflops: float,
    bf16_tc_tflops: float,
    dram_gb_per_s: float,
    l2_mib: float,
    sources: tuple[str, ...],
) -> DeviceSpec:
    """One NVIDIA GPU: product figures as given, per-SM limits from ARCH_LIMITS[arch]."""
    return DeviceSpec(
        name=name,
        vendor="nvidia",
        kind="gpu",
        arch=arch,
        sm_count=sm_count,
        clock_hz=boost_mhz * MHZ,
        fp32_flops_per_s=fp32_tflops * TERA,
        tf32_flops_per_s=tf32_tc_tflops * TERA,
        fp16_flops_per_s=fp16_tc_tflops * TERA,
        bf16_flops_per_s=bf16_tc_tflops * TERA,
        fp16_simt_flops_per_s=fp16_simt_tflops * TERA,
        dram_bytes_per_s=dram_gb_per_s * GB_PER_S,
        l2_bytes=int(l2_mib * MIB),
        regs_per_sm=REGS_PER_SM,
        regs_per_thread_max=REGS_PER_THREAD_MAX,
        max_threads_per_block=MAX_THREADS_PER_BLOCK,
        warp_size=WARP_SIZE,
        launch_overhead_s=GPU_LAUNCH_OVERHEAD_S,
        sources=(*sources, SRC_CUDA_GUIDE, SRC_LAUNCH),
        **ARCH_LIMITS[arch],
    )


# GeForce parts (RTX 3090/4090) run FP16/BF16 tensor-core math with FP32 accumulate at half the
# FP16-accumulate rate; the table uses the FP32-accumulate figure (what cuBLAS / ORT use for
# inference GEMMs). Ampere GA102 and Ada run FP16 on CUDA cores at the FP32 rate (1:1); GV100,
# TU104, GA100 and GH100 at 2x (GA100: 4x).
_TABLE: tuple[DeviceSpec, ...] = (
    # V100 SXM2 16/32 GB: 80 SMs, 1530 MHz boost, 15.7 FP32, 31.4 FP16, 125 FP16 tensor TFLOPS,
    # no TF32/BF16; 900 GB/s HBM2; 6 MB L2 (SRC_VOLTA, SRC_V100_DS).
    _nvidia("v100-sxm2", arch="sm_70", sm_count=80, boost_mhz=1530, fp32_tflops=15.7,
            fp16_simt_tflops=31.4, tf32_tc_tflops=0, fp16_tc_tflops=125, bf16_tc_tflops=0,
            dram_gb_per_s=900, l2_mib=6, sources=(SRC_VOLTA, SRC_V100_DS)),
    # T4: 40 SMs, 1590 MHz, 8.1 FP32, 16.2 FP16 (2x), 65 FP16 tensor, no TF32/BF16; 320 GB/s
    # GDDR6; 4 MB L2 (SRC_TURING, SRC_T4_DS).
    _nvidia("t4", arch="sm_75", sm_count=40, boost_mhz=1590, fp32_tflops=8.1,
            fp16_simt_tflops=16.2, tf32_tc_tflops=0, fp16_tc_tflops=65, bf16_tc_tflops=0,
            dram_gb_per_s=320, l2_mib=4, sources=(SRC_TURING, SRC_T4_DS)),
    # A10: 72 SMs, 1695 MHz, 31.2 FP32, TF32 62.5, FP16/BF16 125 dense; 600 GB/s; 6 MB L2.
    _nvidia("a10", arch="sm_86", sm_count=72, boost_mhz=1695, fp32_tflops=31.2,
            fp16_simt_tflops=31.2, tf32_tc_tflops=62.5, fp16_tc_tflops=125, bf16_tc_tflops=125,
            dram_gb_per_s=600, l2_mib=6, sources=(SRC_GA102, SRC_A10_DS)),
    # L4: 58 SMs, 2040 MHz, 30.3 FP32, TF32 60, FP16/BF16 121 dense; 300 GB/s; 48 MB L2.
    _nvidia("l4", arch="sm_89", sm_count=58, boost_mhz=2040, fp32_tflops=30.3,
            fp16_simt_tflops=30.3, tf32_tc_tflops=60, fp16_tc_tflops=121, bf16_tc_tflops=121,
            dram_gb_per_s=300, l2_mib=48, sources=(SRC_ADA, SRC_L4_DS)),
    # A100 SXM4 40 GB: 108 SMs, 1410 MHz, 19.5 FP32, 78 FP16 (non-tensor), TF32 156,
    # FP16/BF16 312 dense; 1,555 GB/s HBM2; 40 MB L2 (SRC_GA100, SRC_A100_DS).
    _nvidia("a100-40gb", arch="sm_80", sm_count=108, boost_mhz=1410, fp32_tflops=19.5,
            fp16_simt_tflops=78, tf32_tc_tflops=156, fp16_tc_tflops=312, bf16_tc_tflops=312,
            dram_gb_per_s=1555, l2_mib=40, sources=(SRC_GA100, SRC_A100_DS)),
    # A100 PCIe 40 GB: same GA100 configuration and clocks, 1,555 GB/s.
    _nvidia("a100-40gb-pcie", arch="sm_80", sm_count=108, boost_mhz=1410, fp32_tflops=19.5,
            fp16_simt_tflops=78, tf32_tc_tflops=156, fp16_tc_tflops=312, bf16_tc_tflops=312,
            dram_gb_per_s=1555, l2_mib=40, sources=(SRC_GA100, SRC_A100_DS)),
    # A100 SXM4 80 GB: as the 40 GB part with 2,039 GB/s HBM2e.
    _nvidia("a100-80gb", arch="sm_80", sm_count=108, boost_mhz=1410, fp32_tflops=19.5,
            fp16_simt_tflops=78, tf32_tc_tflops=156, fp16_tc_tflops=312, bf16_tc_tflops=312,
            dram_gb_per_s=2039, l2_mib=40, sources=(SRC_GA100, SRC_A100_DS)),
    # A100 PCIe 80 GB: 1,935 GB/s HBM2e.
    _nvidia("a100-80gb-pcie", arch="sm_80", sm_count=108, boost_mhz=1410, fp32_tflops=19.5,
            fp16_simt_tflops=78, tf32_tc_tflops=156, fp16_tc_tflops=312, bf16_tc_tflops=312,
            dram_gb_per_s=1935, l2_mib=40, sources=(SRC_GA100, SRC_A100_DS)),
    # L40S: 142 SMs, 2520 MHz, 91.6 FP32, TF32 183, FP16/BF16 362 dense; 864 GB/s; 96 MB L2.
    _nvidia("l40s", arch="sm_89", sm_count=142, boost_mhz=2520, fp32_tflops=91.6,
            fp16_simt_tflops=91.6, tf32_tc_tflops=183, fp16_tc_tflops=362, bf16_tc_tflops=362,
            dram_gb_per_s=864, l2_mib=96, sources=(SRC_ADA, SRC_L40S_DS)),
    # H100 PCIe: 114 SMs, 1755 MHz, 51.2 FP32, 102.4 FP16, TF32 378, FP16/BF16 756 dense;
    # 2,000 GB/s HBM2e; 50 MB L2 (SRC_HOPPER, SRC_H100_DS).
    _nvidia("h100-pcie", arch="sm_90", sm_count=114, boost_mhz=1755, fp32_tflops=51.2,
            fp16_simt_tflops=102.4, tf32_tc_tflops=378, fp16_tc_tflops=756, bf16_tc_tflops=756,
            dram_gb_per_s=2000, l2_mib=50, sources=(SRC_HOPPER, SRC_H100_DS)),
    # H100 SXM5: 132 SMs, 1980 MHz, 66.9 FP32, 133.8 FP16, TF32 494.7, FP16/BF16 989.4 dense;
    # 3,350 GB/s HBM3; 50 MB L2.
    _nvidia("h100-sxm", arch="sm_90", sm_count=132, boost_mhz=1980, fp32_tflops=66.9,
            fp16_simt_tflops=133.8, tf32_tc_tflops=494.7, fp16_tc_tflops=989.4,
            bf16_tc_tflops=989.4, dram_gb_per_s=3350, l2_mib=50,
            sources=(SRC_HOPPER, SRC_H100_DS)),
    # H200 SXM: the H100 SXM5 GH100 configuration with 141 GB HBM3e at 4,800 GB/s.
    _nvidia("h200", arch="sm_90", sm_count=132, boost_mhz=1980, fp32_tflops=66.9,
            fp16_simt_tflops=133.8, tf32_tc_tflops=494.7, fp16_tc_tflops=989.4,
            bf16_tc_tflops=989.4, dram_gb_per_s=4800, l2_mib=50,
            sources=(SRC_HOPPER, SRC_H200_DS)),
    # RTX 3090: 82 SMs, 1695 MHz, 35.6 FP32, TF32 35.6, FP16/BF16 71 dense (FP32 accumulate);
    # 936 GB/s GDDR6X; 6 MB L2 (SRC_GA102).
    _nvidia("rtx-3090", arch="sm_86", sm_count=82, boost_mhz=1695, fp32_tflops=35.6,
            fp16_simt_tflops=35.6, tf32_tc_tflops=35.6, fp16_tc_tflops=71, bf16_tc_tflops=71,
            dram_gb_per_s=936, l2_mib=6, sources=(SRC_GA102,)),
    # RTX 4090: 128 SMs, 2520 MHz, 82.6 FP32, TF32 82.6, FP16/BF16 165.2 dense (FP32 accumulate);
    # 1,008 GB/s GDDR6X; 72 MB L2 (SRC_ADA).
    _nvidia("rtx-4090", arch="sm_89", sm_count=128, boost_mhz=2520, fp32_tflops=82.6,
            fp16_simt_tflops=82.6, tf32_tc_tflops=82.6, fp16_tc_tflops=165.2,
            bf16_tc_tflops=165.2, dram_gb_per_s=1008, l2_mib=72, sources=(SRC_ADA,)),
)

DEVICES: Mapping[str, DeviceSpec] = {d.name: d for d in _TABLE}


def get_device(name: str, threads: int | None = None) -> DeviceSpec:
    """The built-in spec for `name` ('host' / 'cpu': this machine, run with `threads` OpenMP
    threads: `host_cpu`); UnknownDevice otherwise."""
    key = name.strip().lower()
    if key in HOST_NAMES:
        return host_cpu() if threads is None else host_cpu(threads)  # one cached spec per call form
    if key in DEVICES:
        return DEVICES[key]
    close = [d for d in DEVICES if d.startswith(key)] or difflib.get_close_matches(key, list(DEVICES), n=1)
    hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""  # every variant of a family
    raise UnknownDevice(
        f"unknown device {name!r}; {hint}known devices: {', '.join(DEVICES)}, host; "
        "run `fusesearch devices` to list them, or pass a profile.json from `fusesearch calibrate`"
    )


def device_table_rows(devices: Mapping[str, DeviceSpec] | None = None) -> list[dict[str, Any]]:
    """One dict per device for a CLI table, in table order, with human units."""
    rows = []
    for d in (devices or DEVICES).values():
        rows.append({
            "name": d.name,
            "arch": d.arch,
            "sms": d.sm_count,
            "fp32_tflops": round(d.fp32_flops_per_s / TERA, 1),
            "fp16_tc_tflops": round(d.fp16_flops_per_s / TERA, 1),
            "dram_gb_per_s": round(d.dram_bytes_per_s / GB_PER_S),
            "l2_mib": round(d.l2_bytes / MIB, 1),
            "smem_per_block_kib": round(d.smem_per_block_max_bytes / KIB, 1),
            "launch_us": round(d.launch_overhead_s * 1e6, 2),
        })
    return rows


# ---------------------------------------------------------------------------------------------
# The host CPU
# ---------------------------------------------------------------------------------------------

# FP32 peak estimate per core and cycle = SIMD lanes x 2 (FMA) x 2 (FMA ports), used only where
# the FMA probe cannot run (no C compiler). Two FMA ports is true of Intel Haswell..Sapphire
# Rapids server parts and AMD Zen 2+; an estimate elsewhere.
CPU_FMA_PORTS = 2
CPU_DEFAULT_CLOCK_HZ = 2.5e9  # used only where neither /sys nor /proc reports a frequency
# Fork/join of an OpenMP parallel region: measured on the machine (`probes.measure_launch_overhead`,
# with the kernels' threads); this estimate only where the probe cannot run (EPCC's OpenMP
# micro-benchmarks report ~1-2 us per PARALLEL region on a few cores). Not the ctypes call:
# `measure` and `calibrate` take that off every sample, as a plan's program calls its kernels from C.
CPU_LAUNCH_OVERHEAD_S = 1.5e-6
_SYS_CPU = Path("/sys/devices/system/cpu")
# The CPU backend's kernels are OpenMP loops: the host is described as the CPUs they use.
OMP_THREADS_ENV = "OMP_NUM_THREADS"
# The measured figures are kept per machine in $FUSESEARCH_CACHE (else ~/.cache/fusesearch), the
# folder of the CPU backend's compiled kernels: delete the file to measure again.
CACHE_ENV = "FUSESEARCH_CACHE"
HOST_CACHE_FILE = Path("host") / "measured.json"


@dataclass(frozen=True)
class HostFigures:
    """What `costmodels.probes` measured on this machine, as kept in the cache file."""

    dram_bytes_per_s: float
    cache_curve: tuple[tuple[int, float], ...]  # `probes.measure_cache_curve`; () where no cache beats DRAM
    fma_flops_per_s_per_thread: float  # 0: the probe could not run; the peak is estimated
    launch_s: float  # an OpenMP parallel region's fork and join; 0: the probe could not run (estimated)

    @classmethod
    def from_dict(cls, data: object) -> HostFigures | None:
        """The figures an entry holds; None for an entry of another shape (measured again)."""
        names = [f.name for f in fields(cls)]
        if not isinstance(data, Mapping) or sorted(data) != sorted(names):
            return None
        numbers = [data[n] for n in names if n != "cache_curve"]
        if not all(_finite_number(v) and v >= 0 for v in numbers) or numbers[0] <= 0:
            return None
        try:
            curve = _curve("host", data["cache_curve"], float(numbers[0]))
        except InvalidSpec:
            return None
        return cls(float(numbers[0]), curve, float(numbers[1]), float(numbers[2]))


def _read(path: Path | str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _cpuinfo() -> dict[str, str]:
    """First processor block of /proc/cpuinfo as key -> value ({} off Linux)."""
    info: dict[str, str] = {}
    for line in _read("/proc/cpuinfo").splitlines():
        if not line.strip():
            if info:
                break
            continue
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    return info


def _openmp_threads(cpus: int, threads: int | None = None) -> int:
    """Threads the generated OpenMP kernels run with: `threads` when given (at most `cpus`), else
    OMP_NUM_THREADS (its first level) when set and smaller, else every usable CPU (libgomp's
    default)."""
    if threads is not None:
        return max(1, min(cpus, threads))
    text = os.environ.get(OMP_THREADS_ENV, "").split(",")[0].strip()
    if text.isdigit() and int(text) > 0:
        return min(cpus, int(text))
    return cpus


def _threads_per_core() -> int:
    """SMT width from cpu0's thread siblings ('0,64' or '0-1' -> 2); 1 when unknown."""
    text = _read(_SYS_CPU / "cpu0/topology/thread_siblings_list").strip()
    if not text:
        return 1
    count = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        count += int(hi) - int(lo) + 1 if hi else 1
    return max(1, count)


def host_lanes() -> int:
    """This machine's float32 lanes per vector, read from its CPU flags (`_simd_fp32_lanes`): what
    the C backend's blocked kernels run with here, whatever device priced them."""
    info = _cpuinfo()
    return _simd_fp32_lanes(set(info.get("flags", info.get("Features", "")).split()))


def _simd_fp32_lanes(flags: set[str]) -> int:
    """FP32 lanes per vector register: AVX-512 16, AVX/AVX2 8, SSE/NEON 4."""
    if "avx512f" in flags:
        return 16
    if "avx2" in flags or "avx" in flags:
        return 8
    return 4


def _cpu_clock_hz(cpuinfo: Mapping[str, str]) -> float:
    """Max frequency from cpufreq (kHz), else 'cpu MHz' from /proc/cpuinfo, else a default."""
    khz = _read(_SYS_CPU / "cpu0/cpufreq/cpuinfo_max_freq").strip()
    if khz.isdigit() and int(khz) > 0:
        return int(khz) * 1e3
    try:
        mhz = float(cpuinfo.get("cpu MHz", ""))
    except ValueError:
        mhz = 0.0
    return mhz * MHZ if mhz > 0 else CPU_DEFAULT_CLOCK_HZ


def _parse_size(text: str) -> int:
    """'32K' / '1024K' / '32M' -> bytes (0 when unreadable)."""
    m = re.fullmatch(r"(\d+)\s*([KMG]?)B?", text.strip(), flags=re.IGNORECASE)
    if not m:
        return 0
    scale = {"": 1, "K": KIB, "M": MIB, "G": 1024 * MIB}[m.group(2).upper()]
    return int(m.group(1)) * scale


def _cache_bytes_by_level() -> dict[int, int]:
    """Data/unified cache size per level for cpu0 (e.g. {1: 32 KiB, 2: 1 MiB, 3: 32 MiB})."""
    sizes: dict[int, int] = {}
    for index in sorted((_SYS_CPU / "cpu0/cache").glob("index*")):
        if _read(index / "type").strip() == "Instruction":
            continue
        level = _read(index / "level").strip()
        if level.isdigit():
            sizes[int(level)] = max(sizes.get(int(level), 0), _parse_size(_read(index / "size")))
    return {k: v for k, v in sizes.items() if v > 0}


@functools.lru_cache(maxsize=8)
def host_cpu(threads: int | None = None) -> DeviceSpec:
    """This machine as a DeviceSpec (measured once per machine, ~1-2 s, then read from the cache
    file; cached in the process).

    Analogies for GPU-only fields: an SM is a usable logical CPU; a warp is one SIMD vector
    (`warp_size` = FP32 lanes); "shared memory" per SM and per block is the per-core L2 (what a
    tile must fit to stay on-core); `l2_bytes` is the last-level cache as the OS reports it, and
    `cache_curve` what a copy measures at footprints up to it; there are no tensor cores
    (tensor-core rates 0, so the model uses the FP32 rate); registers and thread limits keep GPU
    nominal values (64 K regs, 255 per thread, 2048 threads, 32 blocks) so the shared register
    model only flags gross pressure. "Usable CPUs" are those the OpenMP kernels use: the affinity
    mask, capped by `threads` when given (the commands' --threads), else by OMP_NUM_THREADS when set
    (read at the first call). FP32 peak = physical cores x
    the FMA probe's rate on one thread (each core runs its own; an SMT sibling shares the core's
    FMA units); where the probe cannot run, physical cores x clock x lanes x 2 (FMA) x
    CPU_FMA_PORTS, an estimate.
    """
    info = _cpuinfo()
    flags = set(info.get("flags", info.get("Features", "")).split())
    cpus = _openmp_threads(probes.usable_cpus(), threads)
    cores = max(1, cpus // _threads_per_core())
    lanes = _simd_fp32_lanes(flags)
    fma = 2 if ("fma" in flags or "asimd" in flags or platform.machine() == "arm64") else 1
    clock_hz = _cpu_clock_hz(info)
    caches = _cache_bytes_by_level()
    llc_bytes = caches[max(caches)] if caches else 8 * MIB
    core_cache_bytes = caches.get(2, caches.get(1, 256 * KIB))
    probe_bytes = min(probes.BANDWIDTH_PROBE_BYTES, max(probes.BANDWIDTH_PROBE_MIN_BYTES, 2 * llc_bytes))
    key = (f"{info.get('model name', 'unknown model')}; {cpus} threads; {probe_bytes // MIB} MiB; "
           f"probes v{probes.PROBES_VERSION}")
    measured = host_figures(key, probe_bytes, llc_bytes, core_cache_bytes, cpus)
    if measured.fma_flops_per_s_per_thread > 0:
        peak = cores * measured.fma_flops_per_s_per_thread
        peak_source = ("fp32_flops_per_s: measured, physical cores x one thread's rate of independent "
                       "vector FMAs (C probe, -march=native)")
    else:
        peak = cores * clock_hz * lanes * fma * CPU_FMA_PORTS
        peak_source = "fp32_flops_per_s: estimate = cores x clock x lanes x 2 (FMA) x 2 (ports); no C compiler for the probe"
    return DeviceSpec(
        name="host",
        vendor=(info.get("vendor_id") or platform.processor() or "unknown").lower(),
        kind="cpu",
        arch=platform.machine() or "unknown",
        sm_count=cpus,
        clock_hz=clock_hz,
        fp32_flops_per_s=peak,
        tf32_flops_per_s=0.0,
        fp16_flops_per_s=0.0,
        bf16_flops_per_s=0.0,
        fp16_simt_flops_per_s=0.0,
        dram_bytes_per_s=measured.dram_bytes_per_s,
        l2_bytes=llc_bytes,
        smem_per_sm_bytes=core_cache_bytes,
        smem_per_block_max_bytes=core_cache_bytes,
        regs_per_sm=REGS_PER_SM,
        regs_per_thread_max=REGS_PER_THREAD_MAX,
        max_threads_per_sm=2048,
        max_blocks_per_sm=32,
        max_threads_per_block=MAX_THREADS_PER_BLOCK,
        warp_size=lanes,
        launch_overhead_s=measured.launch_s if measured.launch_s > 0 else CPU_LAUNCH_OVERHEAD_S,
        serial_launch_overhead_s=host_cpu(1).launch_overhead_s if cpus > 1 else 0.0,
        cache_curve=measured.cache_curve,
        sources=(
            f"/proc/cpuinfo: {info.get('model name', 'unknown model')}; {cpus} usable CPUs, "
            f"{cores} physical cores, {lanes} fp32 lanes",
            f"{cpus} OpenMP threads (usable CPUs, capped by {OMP_THREADS_ENV} when set)",
            "/sys/devices/system/cpu/cpu0/cache (L2 per core, last-level cache)",
            f"dram_bytes_per_s: measured once on this machine, best multi-threaded numpy copy of "
            f"{probe_bytes // MIB} MiB (read + write bytes), kept in the cache folder's {HOST_CACHE_FILE}",
            "cache_curve: measured with it, the same copy at doubling footprints up to the last-level "
            "cache (costmodels.probes.measure_cache_curve)",
            peak_source,
            ("launch_overhead_s: measured, a C call of an OpenMP parallel region over a few floats with "
             f"{cpus} OpenMP thread{'s' if cpus > 1 else ''} (costmodels.probes.measure_launch_overhead)" if measured.launch_s > 0 else
             "launch_overhead_s: estimate for an OpenMP parallel region (the probe could not run)"),
            *(("serial_launch_overhead_s: the host at one thread's launch_overhead_s (host_cpu(1)), what a "
               "kernel whose region runs on one thread pays",) if cpus > 1 else ()),
        ),
    )


def cache_root() -> Path:
    """The user cache folder: `$FUSESEARCH_CACHE` when set, else ~/.cache/fusesearch. A variable
    naming a file (or a path under one) is a CacheFolderError naming the variable: every cache
    (compiled kernels, timings, host figures) would fail on it."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        return Path.home() / ".cache" / "fusesearch"
    path = Path(root)
    blocker = next((p for p in (path, *path.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise CacheFolderError(f"{CACHE_ENV}={root}: {blocker} is a file, not a folder; point {CACHE_ENV} at a "
                               "folder (it is created if missing), or unset it to use ~/.cache/fusesearch")
    return path


def host_record(spec: DeviceSpec) -> dict[str, Any]:
    """What priced a plan for a CPU, for its plan.json: the OpenMP threads, the measured figures
    the cost model read (bandwidths, cache curve, FMA peak, a parallel region's cost, above one
    thread also a one-thread region's), their
    sha256, and the file `host_cpu` keeps them in (delete it to measure again)."""
    figures = {"dram_bytes_per_s": spec.dram_bytes_per_s, "cache_curve": [list(p) for p in spec.cache_curve],
               "fp32_flops_per_s": spec.fp32_flops_per_s, "launch_overhead_s": spec.launch_overhead_s}
    if spec.serial_launch_overhead_s:  # read where the plan's choices include one-thread forms
        figures["serial_launch_overhead_s"] = spec.serial_launch_overhead_s
    text = json.dumps(figures, sort_keys=True)
    return {"threads": spec.sm_count, "figures": figures, "figures_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "figures_file": str(host_cache_path())}


def host_cache_path() -> Path:
    """The JSON file of this machine's measured figures: {key: HostFigures as a dict}."""
    return cache_root() / HOST_CACHE_FILE


def host_figures(key: str, probe_bytes: int, llc_bytes: int, core_cache_bytes: int,
                 workers: int) -> HostFigures:
    """This machine's figures for `key` (CPU model, threads, probe size): read from the cache
    file, else measured and written there (atomically). An unreadable or foreign entry is
    measured again; a cache that cannot be written only costs a measurement per run."""
    path = host_cache_path()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    kept = HostFigures.from_dict(known.get(key))
    if kept is not None:
        return kept
    dram = probes.measure_copy_bandwidth(probe_bytes, workers)
    curve = probes.measure_cache_curve(llc_bytes, core_cache_bytes, dram, workers)
    measured = HostFigures(dram, curve, probes.measure_fma_peak()[0], probes.measure_launch_overhead(workers))
    known[key] = asdict(measured)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass
    return measured
