"""Roofline cost of one kernel on one device: `RooflineModel.cost(spec, device) -> KernelCost`.

Problem: rank fusion choices by predicted time from counts alone, fast, every knob calibratable.
Approach (after XLA's gpu_performance_model):
    compute_s = tc_flops / (unit peak x eff[t, impl] x occ) + (scalar_flops + transcendentals x w + divisions x d
                + iteration_size x index_divisions x e + staged_loads x g) / (scalar peak x eff x occ)
    memory_s  = (read x r + write + spill) / (`DeviceSpec.bandwidth_for(read + write)` x mem_eff x occ)
    time_s    = launch_s + max(compute_s, memory_s) + (1 - overlap) x min(compute_s, memory_s)
d `division_flops`, r `read_traffic_factor`, e `index_division_flops`, g `staging_load_flops` (defaults
0, 1, 0, 0); occ = min(1, occupancy / knee[t]) on GPUs, 1 on CPUs. Tensor cores (float32 as TF32 under
`float32_uses_tf32`) price library calls and "tensor-core" units, other kernels the FP32 CUDA cores;
eff[t, impl] is `library_efficiency`, `mma_*` or `tc_efficiency`; a CPU kernel on one thread
(`cpu_threads`) gets its share of both rates and `serial_launch_overhead_s`.
Invariants: pure, deterministic; an unlaunchable kernel is infeasible (time_s = inf, both numbers
named); `bound` names the largest of compute, memory and launch."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from costmodels import resources
from costmodels.devices import KIB, DeviceSpec
from costmodels.errors import InvalidSpec
from costmodels.kernel import CPU_PRODUCTS, TEMPLATES, KernelSpec

PerTemplate = tuple[tuple[str, float], ...]
PerProduct = tuple[tuple[str, float], ...]


# A template whose values, where a table gives none for it, are another's: the defaults, and a
# profile written before the template existed, price depthwise convs and convs with disjoint
# windows as dense convs until a calibration fits them apart (on a CPU MLAS's depthwise convs run
# at 3-14 GFLOP/s against 110-160 for its dense convs, ours at 20-40; its overlapping windows,
# through im2col, below its 1x1 convs, ours above: `fusesearch.schedule.disjoint_windows`).
DERIVED_TEMPLATES = {"conv_disjoint": "conv", "depthwise": "conv"}


def with_derived(values: Mapping[str, float]) -> dict[str, float]:
    """`values` plus each derived template it lacks, at its source template's value."""
    return {**{t: values[s] for t, s in DERIVED_TEMPLATES.items() if t not in values and s in values}, **values}


def per_template(values: Mapping[str, float]) -> PerTemplate:
    """A frozen per-template table in TEMPLATES order (every template required but a derived one
    whose source is given: `DERIVED_TEMPLATES`)."""
    values = with_derived(values)
    missing = [t for t in TEMPLATES if t not in values]
    unknown = sorted(set(values) - set(TEMPLATES))
    if missing or unknown:
        raise InvalidSpec(f"per-template values: missing {missing}, unknown {unknown}")
    return tuple((t, _number(t, values[t])) for t in TEMPLATES)


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidSpec(f"RooflineParams {name} = {value!r}, expected a number")
    return float(value)


# Defaults are informed estimates; `fusesearch calibrate` fits them per device (a depthwise conv's
# are a dense conv's: `DERIVED_TEMPLATES`).
# Tensor-core efficiency: large cuBLAS GEMMs reach ~75-90% of dense peak; implicit-GEMM convs
# less (im2col gathers); the rest rarely use tensor cores.
DEFAULT_TC_EFFICIENCY = per_template(
    {"pointwise": 0.5, "rowwise": 0.5, "gemm": 0.75, "conv": 0.6, "opaque": 0.4})
# A library call's main loop (cuBLAS / cuDNN / MLAS) against the peak of the unit it runs on;
# the generated kernels' is `tc_efficiency` against theirs. Fitted apart by calibration.
DEFAULT_LIBRARY_EFFICIENCY = per_template(
    {"pointwise": 0.5, "rowwise": 0.5, "gemm": 0.75, "conv": 0.6, "opaque": 0.4})
# On a CPU the library is MLAS through ONNX Runtime, and calibration on two CPUs (a Sapphire
# Rapids-class Xeon, a Zen 4-class EPYC: docs/calibration.md) agreed where the defaults above do
# not: its convs over overlapping windows (im2col) run at 1/1.2 of our C's rate (fitted 0.785
# against our 0.944; 0.74 ours against the kept 0.6 on the Xeon), its depthwise convs (NCHWc
# reorders around each) at 0.03-0.06 of the peak; its GEMMs and disjoint-window convs within 2%
# of ours. So `host` starts from these (`host_params`), until a profile of the machine replaces them.
HOST_LIBRARY_EFFICIENCY = per_template(
    {**dict(DEFAULT_LIBRARY_EFFICIENCY), "conv": 0.5, "conv_disjoint": 0.6, "depthwise": 0.04})
# A generated tensor-core kernel (wmma 16x16 fragments, 64x64 block tiles, 4 warps) against the
# tensor-core peak: well below cuBLAS's hand-tuned kernels (no ldmatrix swizzles, small tiles).
DEFAULT_MMA_EFFICIENCY = per_template(
    {"pointwise": 0.3, "rowwise": 0.3, "gemm": 0.4, "conv": 0.3, "opaque": 0.3})
# A generated mma.sync kernel (`mma-sync-*`: ldmatrix from swizzled shared memory, a 3-4 stage
# cp.async pipeline, up to 64x64 warp and 128x256 block tiles), as CUTLASS's multistage kernels are
# written: priced just under the library's (its staging is per element, prologue included, where
# a library moves 16-byte vectors), until a GPU profile fits it.
DEFAULT_MMA_SYNC_EFFICIENCY = per_template(
    {"pointwise": 0.3, "rowwise": 0.3, "gemm": 0.6, "conv": 0.45, "opaque": 0.3})
# Scalar efficiency: peaks count an FMA as 2 flops, while most elementwise ops issue one
# 1-flop instruction per slot, so ~0.5 of peak is the practical ceiling.
DEFAULT_SCALAR_EFFICIENCY = per_template(
    {"pointwise": 0.5, "rowwise": 0.4, "gemm": 0.5, "conv": 0.5, "opaque": 0.3})
# Memory efficiency: STREAM-like copies reach ~85-92% of datasheet DRAM bandwidth on
# V100/A100/H100 (BabelStream results); strided or tiled access patterns less.
DEFAULT_MEMORY_EFFICIENCY = per_template(
    {"pointwise": 0.9, "rowwise": 0.85, "gemm": 0.8, "conv": 0.75, "opaque": 0.6})
# Occupancy knee: streaming kernels saturate DRAM from ~25% occupancy; tensor-core GEMMs run
# near peak with one 8-warp block per SM (12.5% on a 64-warp SM), as cuBLAS kernels do.
DEFAULT_OCCUPANCY_KNEE = per_template(
    {"pointwise": 0.25, "rowwise": 0.25, "gemm": 0.125, "conv": 0.125, "opaque": 0.25})
# XLA gpu_performance_model: kMemoryComputeParallelism = 0.95.
DEFAULT_OVERLAP = 0.95
# SFU throughput is 16 results/clock/SM vs 128 FP32 FMA = 256 flops/clock/SM (CUDA C++
# Programming Guide, "Arithmetic Instructions" throughput table, cc 5.x-9.0): 16 flop-equivalents.
DEFAULT_TRANSCENDENTAL_FLOPS = 16.0
# DRAM-equivalent bytes per spilled byte: a spilled register is stored once and reloaded once
# (2 accesses), and local memory is cached, so about 1 access in 8 reaches DRAM (XLA's
# gpu_performance_model takes L1 as kL1CacheSpeedup = 8x faster than DRAM): 2 / 8 = 0.25.
DEFAULT_SPILL_TRAFFIC_FACTOR = 0.25
# Index arithmetic: one integer division / modulo by a non-power-of-two constant, in flop
# equivalents on the scalar units. 0: the datasheet model ignores it; calibration fits it (it
# dominates small generated loops on a CPU, where time follows elements, not bytes).
DEFAULT_INDEX_DIVISION_FLOPS = 0.0
# A generated conv's A staging, per load (`KernelSpec.staged_loads`): its pixel's and tap's decode
# (four divisions by constants), bounds, address and copy, in flop equivalents. 0: the datasheet
# model leaves it in the generated kernels' efficiencies (set for NCHW's element-by-element
# staging); about 16 instructions a load, which calibration fits against an NHWC conv's chunks.
DEFAULT_STAGING_LOAD_FLOPS = 0.0
# The share of compulsory read bytes that reach DRAM: 1 for the datasheet model (and for GPU
# timings with an L2 flush); a CPU timing loop whose inputs stay in its last-level cache between
# runs reads most of them from cache, which calibration fits.
DEFAULT_READ_TRAFFIC_FACTOR = 1.0
# Extra cost of a floating-point division or square root over a multiply, in flop equivalents:
# 0 for the datasheet model (OpKind counts them as one flop); calibration fits it.
DEFAULT_DIVISION_FLOPS = 0.0

# A generated CPU gemm/conv's product path (`KernelSpec.product`: our micro-kernel, a BLAS call per
# block, a conv's band...) runs at its template's `tc_efficiency` times its own factor here: 1 for
# every path until a calibration that timed the paths apart fits them (then the paths of one
# template rank by their measured rates, not by one shared "packed" efficiency).
DEFAULT_PRODUCT_EFFICIENCY: PerProduct = tuple((p, 1.0) for p in CPU_PRODUCTS)


def per_product(values: Mapping[str, float]) -> PerProduct:
    """A frozen per-product table in CPU_PRODUCTS order, a missing product at 1."""
    unknown = sorted(set(values) - set(CPU_PRODUCTS))
    if unknown:
        raise InvalidSpec(f"product_efficiency: unknown products {unknown}; known: {', '.join(CPU_PRODUCTS)}")
    return tuple((p, _number(f"product_efficiency.{p}", values.get(p, 1.0))) for p in CPU_PRODUCTS)


_TABLE_FIELDS = ("tc_efficiency", "library_efficiency", "mma_efficiency", "mma_sync_efficiency", "scalar_efficiency",
                 "memory_efficiency", "occupancy_knee")


@dataclass(frozen=True)
class RooflineParams:
    """Every tunable number of the model (per-template tables are tuples of (template, value))."""

    tc_efficiency: PerTemplate = DEFAULT_TC_EFFICIENCY
    library_efficiency: PerTemplate = DEFAULT_LIBRARY_EFFICIENCY
    mma_efficiency: PerTemplate = DEFAULT_MMA_EFFICIENCY
    mma_sync_efficiency: PerTemplate = DEFAULT_MMA_SYNC_EFFICIENCY
    scalar_efficiency: PerTemplate = DEFAULT_SCALAR_EFFICIENCY
    memory_efficiency: PerTemplate = DEFAULT_MEMORY_EFFICIENCY
    occupancy_knee: PerTemplate = DEFAULT_OCCUPANCY_KNEE
    overlap: float = DEFAULT_OVERLAP
    launch_overhead_scale: float = 1.0
    transcendental_flops: float = DEFAULT_TRANSCENDENTAL_FLOPS
    spill_traffic_factor: float = DEFAULT_SPILL_TRAFFIC_FACTOR
    index_division_flops: float = DEFAULT_INDEX_DIVISION_FLOPS
    staging_load_flops: float = DEFAULT_STAGING_LOAD_FLOPS
    read_traffic_factor: float = DEFAULT_READ_TRAFFIC_FACTOR
    division_flops: float = DEFAULT_DIVISION_FLOPS
    regs_base: float = resources.DEFAULT_REGS_BASE
    regs_per_live_value: float = resources.DEFAULT_REGS_PER_LIVE_VALUE
    float32_uses_tf32: bool = True
    product_efficiency: PerProduct = DEFAULT_PRODUCT_EFFICIENCY

    def __post_init__(self) -> None:
        try:
            products = per_product(dict(self.product_efficiency))
        except (TypeError, ValueError) as exc:
            raise InvalidSpec("RooflineParams.product_efficiency: expected {product: factor}") from exc
        object.__setattr__(self, "product_efficiency", products)
        for product, value in products:
            if not (value > 0 and math.isfinite(value)):
                raise InvalidSpec(f"RooflineParams.product_efficiency[{product}] = {value}, out of range")
        for name in _TABLE_FIELDS:
            try:
                table = dict(getattr(self, name))
            except (TypeError, ValueError) as exc:
                raise InvalidSpec(f"RooflineParams.{name}: expected {{template: value}}") from exc
            object.__setattr__(self, name, per_template(table))
            for template, value in getattr(self, name):
                low_ok = value > 0
                high_ok = value <= 1 if name == "occupancy_knee" else math.isfinite(value)
                if not (low_ok and high_ok):
                    raise InvalidSpec(f"RooflineParams.{name}[{template}] = {value}, out of range")
        for name in ("overlap", "launch_overhead_scale", "transcendental_flops",
                     "spill_traffic_factor", "index_division_flops", "staging_load_flops", "read_traffic_factor",
                     "division_flops",
                     "regs_base",
                     "regs_per_live_value"):
            value = _number(name, getattr(self, name))
            object.__setattr__(self, name, value)
            if not (math.isfinite(value) and value >= 0):
                raise InvalidSpec(f"RooflineParams.{name} = {value}, expected a finite value >= 0")
        if self.overlap > 1.0:
            raise InvalidSpec(f"RooflineParams.overlap = {self.overlap}, expected in [0, 1]")
        if not isinstance(self.float32_uses_tf32, bool):
            raise InvalidSpec(
                f"RooflineParams.float32_uses_tf32 = {self.float32_uses_tf32!r}, expected a bool")

    def get(self, table: str, template: str) -> float:
        """One per-template value, e.g. get('memory_efficiency', 'pointwise')."""
        return dict(getattr(self, table))[template]

    def with_updates(self, **updates: Any) -> RooflineParams:
        """A copy with some values changed. Tables take a partial dict (merged) or dotted keys:
        `with_updates(overlap=0.8, memory_efficiency={"gemm": 0.7})` or
        `with_updates(**{"memory_efficiency.gemm": 0.7})`."""
        tables = {name: dict(getattr(self, name)) for name in _TABLE_FIELDS}
        products = dict(self.product_efficiency)
        scalars: dict[str, Any] = {}
        known = {f.name for f in fields(self)}
        for key, value in updates.items():
            table, _, template = key.partition(".")
            if template and table in tables and template in TEMPLATES:
                tables[table][template] = value
            elif table == "product_efficiency" and (template in CPU_PRODUCTS or not template and isinstance(value, Mapping)):
                products.update({template: value} if template else value)
            elif key in tables and isinstance(value, Mapping):
                tables[key].update(value)
            elif key in known and not template:
                scalars[key] = value
            else:
                raise InvalidSpec(
                    f"RooflineParams has no parameter {key!r}; known: {', '.join(self.flat())}, "
                    "float32_uses_tf32")
        merged = {name: per_template(tables[name]) for name in _TABLE_FIELDS}
        merged.update(scalars)
        merged["product_efficiency"] = per_product(products)
        return replace(self, **merged)

    def flat(self) -> dict[str, float]:
        """Every numeric parameter under a dotted name ('memory_efficiency.gemm'), for fitting."""
        out: dict[str, float] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in (*_TABLE_FIELDS, "product_efficiency"):
                out.update({f"{f.name}.{t}": v for t, v in value})
            elif not isinstance(value, bool):
                out[f.name] = float(value)
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; tables become {template: value}."""
        out = asdict(self)
        for name in (*_TABLE_FIELDS, "product_efficiency"):
            out[name] = dict(getattr(self, name))
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RooflineParams:
        """Inverse of `to_dict`. Missing keys take defaults (older profiles; a table written before
        a derived template existed gives it its source's value: `DERIVED_TEMPLATES`); unknown keys
        fail."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidSpec(f"unknown RooflineParams keys {unknown}; known: {sorted(known)}")
        data = {k: with_derived(v) if k in _TABLE_FIELDS and isinstance(v, Mapping) else v for k, v in data.items()}
        default = cls()
        return default.with_updates(**data)


@dataclass(frozen=True)
class KernelCost:
    """Predicted time of one kernel and the numbers behind it.

    `regs_per_thread` is the allocated count (capped at the device maximum), `spill_bytes` the
    spilled bytes per thread (as ptxas reports them), `dram_bytes` the modeled DRAM traffic
    including spill traffic, `occupancy` the achieved occupancy (resident warps / max warps).
    """

    time_s: float
    compute_s: float
    memory_s: float
    launch_s: float
    occupancy: float
    regs_per_thread: int
    smem_bytes: int
    spill_bytes: int
    bound: str
    feasible: bool
    reason: str
    flops: float
    dram_bytes: float
    limiter: str = ""
    compute_unit: str = ""  # where the main loop runs: see `compute_unit`

    def to_row(self) -> dict[str, Any]:
        return asdict(self)


def compute_unit(spec: KernelSpec, device: DeviceSpec, float32_uses_tf32: bool = True) -> str:
    """The unit a kernel's main loop runs on, named for the device: `none` for an alias,
    `cpu-simd` on a CPU; on a GPU, a tensor-core schedule (a library call's GEMM/conv) on the
    tensor cores of its dtype (`tf32-tensor-core` for float32 where the device has TF32 and it is
    allowed, `fp16-` / `bf16-tensor-core`) — a library call's GEMM/conv or a generated `mma-*`
    kernel —, a CUDA-core one (every other generated kernel: the `tiled` skeleton accumulates with
    fmaf) on `fp32-cuda-core`."""
    if spec.main_unit == "none":
        return "none"
    if device.kind != "gpu":
        return "cpu-simd"
    if spec.main_unit != "tensor-core" or spec.tc_flops == 0:
        return "fp32-cuda-core"
    if spec.dtype == "float16" and device.fp16_flops_per_s > 0:
        return "fp16-tensor-core"
    if spec.dtype == "bfloat16" and device.bf16_flops_per_s > 0:
        return "bf16-tensor-core"
    if spec.dtype == "float32" and float32_uses_tf32 and device.tf32_flops_per_s > 0:
        return "tf32-tensor-core"
    if spec.dtype.startswith(("int8", "uint8", "float8")) and device.fp16_flops_per_s > 0:
        return "fp16-tensor-core"  # int8 / fp8 rates are not tabulated: the FP16 rate
    return "fp32-cuda-core"


def tensor_peak_flops_per_s(device: DeviceSpec, dtype: str, float32_uses_tf32: bool = True) -> float:
    """Peak rate for tensor-core-eligible FLOPs of `dtype` (see module note for the rules)."""
    by_dtype = {"float16": device.fp16_flops_per_s, "bfloat16": device.bf16_flops_per_s}
    if float32_uses_tf32:
        by_dtype["float32"] = device.tf32_flops_per_s
    # int8 / fp8 tensor-core rates (2x FP16 where present) are not tabulated: FP16 rate.
    if dtype.startswith(("int8", "uint8", "float8")):
        by_dtype[dtype] = device.fp16_flops_per_s
    return by_dtype.get(dtype) or device.fp32_flops_per_s


def scalar_peak_flops_per_s(device: DeviceSpec, dtype: str) -> float:
    """Peak rate for CUDA-core FLOPs: half2 for float16 where listed, else FP32."""
    if dtype == "float16" and device.fp16_simt_flops_per_s > 0:
        return device.fp16_simt_flops_per_s
    return device.fp32_flops_per_s


def _thread_share(spec: KernelSpec, device: DeviceSpec) -> float:
    """The share of a CPU's compute and bandwidth a kernel gets: its `cpu_threads` of the device's
    `sm_count` (conservative: one thread's copy often reaches more than its share of DRAM), 1 for
    a kernel on all of them and on a GPU."""
    if device.kind != "cpu" or not 0 < spec.cpu_threads < device.sm_count:
        return 1.0
    return spec.cpu_threads / device.sm_count


def _region_s(spec: KernelSpec, device: DeviceSpec) -> float:
    """What one call costs before any work: a CPU kernel on one thread its one-thread region
    (`DeviceSpec.serial_launch_overhead_s`, where known), any other the device's launch."""
    if _thread_share(spec, device) < 1.0 and spec.cpu_threads == 1 and device.serial_launch_overhead_s > 0:
        return device.serial_launch_overhead_s
    return device.launch_overhead_s


@dataclass(frozen=True)
class RooflineModel:
    """Scores a KernelSpec on a DeviceSpec. Holds only its parameters."""

    params: RooflineParams = field(default_factory=RooflineParams)

    def cost(self, spec: KernelSpec, device: DeviceSpec) -> KernelCost:
        p = self.params
        regs = resources.estimate_registers(
            spec.live_values_per_thread, spec.dtype_bytes, device.regs_per_thread_max,
            base=p.regs_base, per_value=p.regs_per_live_value)
        occ = resources.occupancy(device, spec.threads_per_block, regs.regs_per_thread,
                                  spec.smem_bytes)
        grid = resources.grid_blocks(spec)
        achieved = resources.achieved_occupancy(occ, grid, device.sm_count)
        reason = _infeasible_reason(spec, device, regs.regs_per_thread, occ)
        scale = self._occupancy_scale(spec, device, achieved) if not reason else 1.0

        share = _thread_share(spec, device)
        compute_s = self._compute_s(spec, device) / scale / share
        spill_traffic = (regs.spill_bytes_per_thread * grid * spec.threads_per_block
                         * p.spill_traffic_factor)
        dram_bytes = (spec.dram_read_bytes * p.read_traffic_factor + spec.dram_write_bytes
                      + spill_traffic)
        memory_s = dram_bytes / (device.bandwidth_for(spec.dram_bytes)
                                 * p.get("memory_efficiency", spec.template) * scale * share)
        launch_s = _region_s(spec, device) * p.launch_overhead_scale
        overlapped = max(compute_s, memory_s) + (1.0 - p.overlap) * min(compute_s, memory_s)
        parts = (("compute", compute_s), ("memory", memory_s), ("launch", launch_s))
        return KernelCost(
            time_s=math.inf if reason else launch_s + overlapped,
            compute_s=compute_s,
            memory_s=memory_s,
            launch_s=launch_s,
            occupancy=achieved,
            regs_per_thread=regs.regs_per_thread,
            smem_bytes=spec.smem_bytes,
            spill_bytes=regs.spill_bytes_per_thread,
            bound=max(parts, key=lambda item: item[1])[0],
            feasible=not reason,
            reason=reason,
            flops=spec.flops,
            dram_bytes=dram_bytes,
            limiter=occ.limiter,
            compute_unit=compute_unit(spec, device, p.float32_uses_tf32),
        )

    def _compute_s(self, spec: KernelSpec, device: DeviceSpec) -> float:
        """Compute time at full occupancy: tensor-core part + scalar part (they share issue)."""
        p = self.params
        unit = compute_unit(spec, device, p.float32_uses_tf32)
        peak = (tensor_peak_flops_per_s(device, spec.dtype, p.float32_uses_tf32) if unit.endswith("tensor-core")
                else scalar_peak_flops_per_s(device, "float32"))
        table = ("library_efficiency" if spec.impl == "library" else
                 ("mma_sync_efficiency" if spec.mma_sync else "mma_efficiency") if unit.endswith("tensor-core")
                 else "tc_efficiency")
        tc_rate = (peak * p.get(table, spec.template) * (p.get("product_efficiency", spec.product) if spec.product else 1.0)
                   / spec.imbalance)
        scalar_rate = (scalar_peak_flops_per_s(device, spec.dtype)
                       * p.get("scalar_efficiency", spec.template))
        scalar_flops = (spec.scalar_flops + spec.transcendentals * p.transcendental_flops
                        + spec.divisions * p.division_flops
                        + spec.iteration_size * spec.index_divisions * p.index_division_flops
                        + spec.staged_loads * p.staging_load_flops)
        return spec.tc_flops / tc_rate + scalar_flops / scalar_rate

    def _occupancy_scale(self, spec: KernelSpec, device: DeviceSpec, achieved: float) -> float:
        """Efficiency multiplier: linear below the template's knee, 1 above; 1 on CPUs."""
        if device.kind != "gpu":
            return 1.0
        return min(1.0, achieved / self.params.get("occupancy_knee", spec.template))


def _infeasible_reason(
    spec: KernelSpec, device: DeviceSpec, regs_per_thread: int, occ: resources.Occupancy
) -> str:
    """Why the kernel cannot launch on the device ('' when it can)."""
    if device.kind == "gpu" and spec.min_arch > device.compute_capability:
        return (f"the kernel's code needs sm_{spec.min_arch} or later; {device.name} is {device.arch}")
    if spec.threads_per_block > device.max_threads_per_block:
        return (f"threads {spec.threads_per_block} per block > {device.max_threads_per_block} "
                f"max on {device.name}")
    if spec.smem_bytes > device.smem_per_block_max_bytes:
        return (f"smem {spec.smem_bytes / KIB:.1f} KiB > "
                f"{device.smem_per_block_max_bytes / KIB:.1f} KiB per block on {device.name}")
    if occ.blocks_per_sm == 0 and occ.limiter == "registers":
        need = regs_per_thread * spec.threads_per_block
        return (f"registers {regs_per_thread} x {spec.threads_per_block} threads = {need} > "
                f"{device.regs_per_sm} per SM on {device.name}")
    if occ.blocks_per_sm == 0:
        return f"one block does not fit an SM of {device.name} (limited by {occ.limiter})"
    return ""


# Our products against each other, measured on one Zen 4 core at block 16 (benchmarks/bench_nchwc.md):
# the blocked dense convs 0.86-0.89x the time of our NCHW ones (resnet18's stem, 3x3 and 1x1
# classes, geometric means, after the epilogue moved onto the tile's registers): "nchwc" 1.12; the
# NCHW depthwise loop (vectors along a row of pixels, a filter tap broadcast) 0.39x the rate of
# the blocked one (a block of channels per vector, one FMA per tap; callgrind instructions 0.41x):
# "depthwise" 0.44, 0.39 of the blocked rate; a chain of a 1x1 conv and a depthwise conv in one
# blocked kernel ("nchwc-chain") at the blocked convs' rate, as the two it replaces, less their
# middle tensor's traffic. The rest price alike until a profile fits them.
HOST_PRODUCT_EFFICIENCY = {"depthwise": 0.44, "nchwc": 1.12, "nchwc-chain": 1.12}


def host_params() -> RooflineParams:
    """The defaults for a CPU device (`host`): a CPU library's own efficiencies
    (HOST_LIBRARY_EFFICIENCY) and our products' (HOST_PRODUCT_EFFICIENCY), everything else as for
    any device."""
    return RooflineParams(library_efficiency=HOST_LIBRARY_EFFICIENCY, product_efficiency=HOST_PRODUCT_EFFICIENCY)
