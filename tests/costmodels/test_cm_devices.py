"""Device table and host CPU: every figure present, positive, sourced and self-consistent."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest

from costmodels import (
    DEVICES,
    DeviceSpec,
    UnknownDevice,
    device_table_rows,
    get_device,
    host_cpu,
    probes,
)
from costmodels.devices import CPU_LAUNCH_OVERHEAD_S, KIB, MIB
from costmodels.errors import InvalidSpec
from costmodels.probes import (
    LAUNCH_MAX_S,
    measure_copy_bandwidth,
    measure_fma_peak,
    measure_launch_overhead,
)

REQUIRED = ("v100-sxm2", "t4", "a10", "l4", "a100-40gb", "a100-80gb", "l40s", "h100-pcie",
            "h100-sxm", "h200", "rtx-3090", "rtx-4090")
# FP32 lanes per SM by arch (whitepapers: GV100 / TU104 / GA100 64, GA102 / AD10x / GH100 128).
FP32_LANES_PER_SM = {"sm_70": 64, "sm_75": 64, "sm_80": 64, "sm_86": 128, "sm_89": 128,
                     "sm_90": 128}
POSITIVE = ("sm_count", "clock_hz", "fp32_flops_per_s", "dram_bytes_per_s", "l2_bytes",
            "smem_per_sm_bytes", "smem_per_block_max_bytes", "regs_per_sm",
            "regs_per_thread_max", "max_threads_per_sm", "max_blocks_per_sm",
            "max_threads_per_block", "warp_size", "launch_overhead_s")


def test_table_has_the_required_devices():
    """Table contents: every GPU the design names is present."""
    assert set(REQUIRED) <= set(DEVICES)


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_every_device_has_positive_figures_and_sources(name):
    """Table sanity: positive rates and limits, tensor-core rates >= 0, sources cited."""
    d = DEVICES[name]
    for field in POSITIVE:
        assert getattr(d, field) > 0, field
    for field in ("tf32_flops_per_s", "fp16_flops_per_s", "bf16_flops_per_s"):
        assert getattr(d, field) >= 0
    assert d.fp16_flops_per_s > d.fp32_flops_per_s  # every listed GPU has FP16 tensor cores
    assert d.kind == "gpu" and d.vendor == "nvidia"
    assert any("whitepaper" in s for s in d.sources)
    assert any("Compute Capability" in s for s in d.sources)
    assert d.smem_per_block_max_bytes <= d.smem_per_sm_bytes
    assert (d.regs_per_thread_max, d.max_threads_per_block, d.warp_size) == (255, 1024, 32)


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_names_are_lowercase_hyphen(name):
    """Naming: table keys are lowercase-hyphen and equal the spec's own name."""
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name)
    assert DEVICES[name].name == name


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_fp32_peak_matches_sms_times_lanes_times_clock(name):
    """Consistency of sourced figures: FP32 peak = SMs x lanes x 2 (FMA) x boost clock (2%)."""
    d = DEVICES[name]
    derived = d.sm_count * FP32_LANES_PER_SM[d.arch] * 2 * d.clock_hz
    assert d.fp32_flops_per_s == pytest.approx(derived, rel=0.02)


def test_tensor_core_gaps_are_zero():
    """Hardware gaps: V100 and T4 have no TF32 / BF16 tensor cores."""
    for name in ("v100-sxm2", "t4"):
        assert DEVICES[name].tf32_flops_per_s == 0
        assert DEVICES[name].bf16_flops_per_s == 0
    assert DEVICES["a100-80gb"].tf32_flops_per_s == pytest.approx(156e12)
    assert DEVICES["h100-sxm"].fp16_flops_per_s == pytest.approx(989.4e12)  # dense, not sparse


@pytest.mark.parametrize(("name", "kib"), [("h100-sxm", 227), ("h200", 227), ("a100-80gb", 163),
                                           ("a10", 99), ("l4", 99), ("rtx-4090", 99), ("t4", 64),
                                           ("v100-sxm2", 96)])
def test_smem_per_block_opt_in_maximum(name, kib):
    """Per-block shared-memory limit (CUDA guide, opt-in maximum) by compute capability."""
    assert DEVICES[name].smem_per_block_max_bytes == kib * KIB


def test_get_device_is_case_insensitive_and_resolves_host():
    """Lookup: names ignore case and spaces; 'host' and 'cpu' mean this machine."""
    assert get_device(" H100-SXM ") is DEVICES["h100-sxm"]
    assert get_device("host") is host_cpu()
    assert get_device("cpu") is host_cpu()


def test_unknown_device_lists_names_and_the_fix():
    """Bad input: an unknown name is a ValueError listing the known names and `fusesearch devices`."""
    with pytest.raises(UnknownDevice) as info:
        get_device("h100-sxm6")
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "h100-sxm6" in message and "fusesearch devices" in message
    assert all(name in message for name in REQUIRED)
    assert "did you mean 'h100-sxm'" in message
    assert "\n" not in message


def test_a_family_name_suggests_every_device_of_the_family():
    """`h100` is a prefix of h100-pcie and h100-sxm, not a typo of h200."""
    with pytest.raises(UnknownDevice) as info:
        get_device("h100")
    assert "did you mean 'h100-pcie' or 'h100-sxm'?" in str(info.value)
    with pytest.raises(UnknownDevice) as info:
        get_device("A100")
    assert "did you mean 'a100-40gb' or 'a100-40gb-pcie' or 'a100-80gb' or 'a100-80gb-pcie'?" in str(info.value)


def test_device_table_rows_for_the_cli():
    """CLI table: one row per device with human units."""
    rows = device_table_rows()
    assert [r["name"] for r in rows] == list(DEVICES)
    h100 = next(r for r in rows if r["name"] == "h100-sxm")
    assert h100 == {"name": "h100-sxm", "arch": "sm_90", "sms": 132, "fp32_tflops": 66.9,
                    "fp16_tc_tflops": 989.4, "dram_gb_per_s": 3350, "l2_mib": 50.0,
                    "smem_per_block_kib": 227.0, "launch_us": 2.0}


def test_device_spec_round_trips_and_validates():
    """Serialization: to_dict / from_dict round-trip; bad figures and fields are refused."""
    d = DEVICES["l4"]
    assert DeviceSpec.from_dict(d.to_dict()) == d
    with pytest.raises(InvalidSpec, match="dram_bytes_per_s"):
        dataclasses.replace(d, dram_bytes_per_s=0)
    with pytest.raises(InvalidSpec, match="lowercase-hyphen"):
        dataclasses.replace(d, name="L4_GPU")
    with pytest.raises(InvalidSpec, match="unknown"):
        DeviceSpec.from_dict({**d.to_dict(), "hbm_stacks": 4})


def test_host_cpu_is_measured_on_a_new_machine(tmp_path, monkeypatch):
    """Host CPU: positive cores and clock, measured DRAM and cache bandwidths and FMA peak, on a
    machine seen for the first time (an empty cache folder). How long the probes take is a
    benchmark's figure (benchmarks/bench_load.py), not a test's."""
    monkeypatch.setenv("FUSESEARCH_CACHE", str(tmp_path))
    host_cpu.cache_clear()
    measure_copy_bandwidth.cache_clear()
    measure_fma_peak.cache_clear()
    host = host_cpu()
    host_cpu.cache_clear()
    assert host.kind == "cpu" and host.name == "host"
    assert host.sm_count >= 1 and host.clock_hz > 0
    assert math.isfinite(host.dram_bytes_per_s) and host.dram_bytes_per_s > 0
    # the cache curve: none, or rates above DRAM's at footprints up to the last-level cache
    assert all(rate > host.dram_bytes_per_s and 0 < size <= host.l2_bytes for size, rate in host.cache_curve)
    assert host.fp32_flops_per_s > 0 and host.warp_size in (4, 8, 16)
    assert host.tf32_flops_per_s == host.fp16_flops_per_s == 0
    assert host.smem_per_block_max_bytes > 0 and host.l2_bytes >= host.smem_per_sm_bytes
    # the kernels' OpenMP region as measured with their threads; the estimate only where the
    # probe reported 0 (on a machine too busy for the team to run together), and then said so
    measured = any(s.startswith("launch_overhead_s: measured") for s in host.sources)
    assert 0 < host.launch_overhead_s <= LAUNCH_MAX_S if measured else host.launch_overhead_s == CPU_LAUNCH_OVERHEAD_S
    assert measured or any("the probe could not run" in s for s in host.sources)


class Ticks:
    """A clock that moves STEP seconds each time it is read: every timed pass takes one STEP."""

    STEP = 2.0 ** -10

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.reads * self.STEP


def test_the_copy_probe_counts_read_and_write_bytes_of_its_best_pass_within_its_budget():
    """A pass copies two 1 MiB arrays' worth PASS_BYTES / 2 MiB = 8 times: 16 MiB read and written
    per pass of one STEP; the passes stop at the first check past the budget (three clock reads
    per pass), at most 20."""
    clock = Ticks()
    rate = measure_copy_bandwidth.__wrapped__(MIB, 1, 10 * Ticks.STEP, clock)
    assert rate == 2 * MIB * (probes.PASS_BYTES // (2 * MIB)) / Ticks.STEP
    assert clock.reads == 1 + 3 * 4  # 4 passes: after the 4th, 12 steps have passed (> 10)
    clock = Ticks()
    measure_copy_bandwidth.__wrapped__(MIB, 1, 1e9, clock)
    assert clock.reads == 1 + 3 * 20


@pytest.mark.parametrize("output, expected", [
    ("8 2.5e-02 123\n", (probes.FMA_ITERATIONS * probes.FMA_ACCUMULATORS * 8 * 2 / 2.5e-2, 8)),
    ("16 1.0e-02 -1\n", (probes.FMA_ITERATIONS * probes.FMA_ACCUMULATORS * 16 * 2 / 1e-2, 16)),
    ("8 0 1\n", (0.0, 0)), ("Segmentation fault", (0.0, 0)), (None, (0.0, 0)),
])
def test_the_fma_probe_reads_its_programs_best_pass(monkeypatch, output, expected):
    """lanes x 2 flops x accumulators x iterations over the best pass's seconds, from what the
    program prints; (0, 0) when it prints nothing usable or does not build."""
    measure_fma_peak.cache_clear()
    try:
        monkeypatch.setattr(probes, "c_program_output", lambda *a, **k: output)
        assert measure_fma_peak() == pytest.approx(expected, rel=1e-12)
    finally:
        measure_fma_peak.cache_clear()


def test_the_fma_probe_builds_and_runs_here():
    """The probe's program builds with the C compiler the CPU backend needs and reports its lanes."""
    flops, lanes = measure_fma_peak()
    assert lanes in (4, 8, 16) and math.isfinite(flops) and flops > 0


@pytest.mark.parametrize("output, expected", [
    ("5.0e-07 63\n", 5e-7), (f"{LAUNCH_MAX_S:.9e} 63\n", LAUNCH_MAX_S),
    ("2.0e-04 63\n", 0.0),  # slower than a believable region: a team that never ran together
    ("0 63\n", 0.0), ("nan 63\n", 0.0), ("oops\n", 0.0), (None, 0.0),
])
def test_the_launch_probe_reports_its_best_batch_or_0(monkeypatch, output, expected):
    """A parallel region's call as the program's best batch says; beyond LAUNCH_MAX_S (a machine
    too busy for the team to run together), unusable output or no usable compiler: 0 (the
    estimate is used), never a guess."""
    measure_launch_overhead.cache_clear()
    try:
        monkeypatch.setattr(probes, "c_program_output", lambda *a, **k: output)
        assert measure_launch_overhead(1) == pytest.approx(expected, rel=1e-9)
    finally:
        measure_launch_overhead.cache_clear()


def test_the_launch_probe_runs_here_and_reports_0_without_a_compiler(monkeypatch):
    """Here: a believable region's time, or 0 on a machine too busy to say; no compiler: 0."""
    measure_launch_overhead.cache_clear()
    try:
        one = measure_launch_overhead(1)
        assert one == 0.0 or 0 < one <= LAUNCH_MAX_S
        measure_launch_overhead.cache_clear()
        monkeypatch.setenv("CC", "/nonexistent/cc")
        assert measure_launch_overhead(1) == 0.0
    finally:
        measure_launch_overhead.cache_clear()


def test_bandwidth_for_reads_the_cache_curve_at_a_kernels_footprint():
    """GPUs (no curve) price every footprint at DRAM; a CPU reads its curve: the first point's
    rate up to its footprint, log-log between points (a footprint halfway in log between 2 and 8
    MiB gets the geometric mean of their rates), DRAM's beyond the last point. A profile written
    with the two fields the curve replaced loads as its one point, one with neither as no curve;
    a curve that rises, or falls to DRAM's rate, is refused naming its point."""
    gpu = DEVICES["h100-sxm"]
    assert gpu.cache_curve == ()
    assert gpu.bandwidth_for(1) == gpu.bandwidth_for(10**12) == gpu.dram_bytes_per_s
    cpu = dataclasses.replace(gpu, kind="cpu", dram_bytes_per_s=10e9,
                              cache_curve=((2 * MIB, 80e9), (8 * MIB, 20e9), (64 * MIB, 20e9)))
    assert cpu.bandwidth_for(1) == cpu.bandwidth_for(2 * MIB) == 80e9
    assert cpu.bandwidth_for(4 * MIB) == pytest.approx(40e9)
    assert cpu.bandwidth_for(8 * MIB) == pytest.approx(20e9) == cpu.bandwidth_for(64 * MIB)
    assert cpu.bandwidth_for(64 * MIB + 1) == 10e9
    assert DeviceSpec.from_dict(json.loads(json.dumps(cpu.to_dict()))) == cpu
    old = {k: v for k, v in cpu.to_dict().items() if k != "cache_curve"}
    assert DeviceSpec.from_dict(old) == dataclasses.replace(cpu, cache_curve=())
    two_fields = {**old, "cache_bytes_per_s": 40e9, "cache_fit_bytes": 8 * MIB}
    assert DeviceSpec.from_dict(two_fields).cache_curve == ((8 * MIB, 40e9),)
    with pytest.raises(InvalidSpec, match="cache_curve point 1"):
        dataclasses.replace(cpu, cache_curve=((2 * MIB, 40e9), (4 * MIB, 80e9)))
    with pytest.raises(InvalidSpec, match="cache_curve point 0"):
        dataclasses.replace(cpu, cache_curve=((2 * MIB, 10e9),))


def test_the_cache_curve_is_made_monotone_and_cut_where_it_meets_dram():
    """A slower pass at a small footprint (another tenant) is credited a larger footprint's rate;
    the points no faster than CACHE_MIN_SPEEDUP x DRAM's rate are dropped from the end."""
    points = [(1 * MIB, 70e9), (2 * MIB, 30e9), (4 * MIB, 49e9), (8 * MIB, 26e9), (16 * MIB, 12e9)]
    assert probes.monotone_curve(points, 10e9) == ((1 * MIB, 70e9), (2 * MIB, 49e9), (4 * MIB, 49e9),
                                                   (8 * MIB, 26e9))
    assert probes.monotone_curve(points, 50e9) == ((1 * MIB, 70e9),)
    assert probes.monotone_curve(points, 100e9) == ()
