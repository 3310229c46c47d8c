"""RooflineModel on analytic cases; each test names its regime and pins its device."""

from __future__ import annotations

import dataclasses
import math

import pytest

from costmodels import DEVICES, InvalidSpec, KernelSpec, RooflineModel, RooflineParams
from costmodels.roofline import DERIVED_TEMPLATES, scalar_peak_flops_per_s, tensor_peak_flops_per_s

MODEL = RooflineModel()
PARAMS = MODEL.params


def elementwise_chain(n: int, dtype: str = "float32", ops: int = 4, live: int = 4) -> KernelSpec:
    """A fused unary chain: read n, write n, `ops` flops per element."""
    size = {"float32": 4, "float16": 2}[dtype]
    return KernelSpec("pointwise", dtype, scalar_flops=ops * n, dram_read_bytes=size * n,
                      dram_write_bytes=size * n, iteration_size=n, live_values_per_thread=live,
                      num_ops=ops)


def square_gemm(n: int, dtype: str = "float16") -> KernelSpec:
    """C = A @ B, n x n x n, 128x128x32 tiles, 3-stage pipeline in shared memory."""
    size = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    stage_bytes = (128 * 32 + 32 * 128) * size
    return KernelSpec("gemm", dtype, tc_flops=2 * n**3, dram_read_bytes=2 * size * n * n,
                      dram_write_bytes=size * n * n, iteration_size=n * n, reduction_length=n,
                      tile=(128, 128, 32), smem_bytes=3 * stage_bytes, live_values_per_thread=96)


def test_large_fp32_elementwise_chain_is_memory_bound_on_h100():
    """Memory-bound regime (h100-sxm): 64M fp32 elements take bytes / (bandwidth x efficiency)."""
    spec = elementwise_chain(64 * 2**20)
    device = DEVICES["h100-sxm"]
    cost = MODEL.cost(spec, device)
    bytes_over_bw_s = spec.dram_bytes / device.dram_bytes_per_s
    assert cost.bound == "memory" and cost.feasible and cost.reason == ""
    assert cost.occupancy == 1.0 and cost.spill_bytes == 0
    assert cost.memory_s == pytest.approx(
        bytes_over_bw_s / PARAMS.get("memory_efficiency", "pointwise"), rel=1e-12)
    assert cost.time_s == pytest.approx(
        cost.launch_s + cost.memory_s + (1 - PARAMS.overlap) * cost.compute_s, rel=1e-12)
    assert abs(cost.time_s / bytes_over_bw_s - 1) < 0.15


def test_a_cpu_kernel_that_fits_the_measured_cache_is_priced_at_the_cache_rate():
    """Cache regime (a pinned CPU: DRAM 10 GB/s, a cache curve of one point, 40 GB/s up to 8 MiB):
    a chain moving 8 MiB takes a quarter of the time per byte of one moving 16 MiB."""
    device = dataclasses.replace(DEVICES["t4"], name="pinned-cpu", kind="cpu", dram_bytes_per_s=10e9,
                                 cache_curve=((8 * 2**20, 40e9),))
    eff = PARAMS.get("memory_efficiency", "pointwise")
    fits, spills = (MODEL.cost(elementwise_chain(n), device) for n in (2**20, 2**21))
    assert fits.dram_bytes == 8 * 2**20 and spills.dram_bytes == 16 * 2**20
    assert fits.memory_s == pytest.approx(8 * 2**20 / (40e9 * eff), rel=1e-12)
    assert spills.memory_s == pytest.approx(16 * 2**20 / (10e9 * eff), rel=1e-12)


def test_large_fp16_gemm_is_tensor_core_bound_on_a100():
    """Compute-bound regime (a100-80gb): an 8192^3 fp16 GEMM through the library (cuBLAS) takes
    2n^3 / (312 TFLOP/s x library efficiency)."""
    n = 8192
    cost = MODEL.cost(dataclasses.replace(square_gemm(n), impl="library"), DEVICES["a100-80gb"])
    expected_s = 2 * n**3 / (312e12 * PARAMS.get("library_efficiency", "gemm"))
    assert cost.compute_unit == "fp16-tensor-core"
    assert cost.bound == "compute" and cost.feasible
    assert cost.occupancy >= PARAMS.get("occupancy_knee", "gemm")
    assert cost.compute_s == pytest.approx(expected_s, rel=1e-12)
    assert cost.time_s == pytest.approx(expected_s, rel=0.02)


def test_generated_gemm_is_priced_on_cuda_cores():
    """Compute-bound regime (h100-sxm), one kernel one price: the generated `tiled` skeleton
    accumulates with fmaf, so a generated float32 GEMM takes 2n^3 / (FP32 CUDA-core peak x eff),
    7x the library's TF32 tensor-core time; on the CPU both are `cpu-simd`."""
    n = 4096
    h100 = DEVICES["h100-sxm"]
    generated = MODEL.cost(square_gemm(n, "float32"), h100)
    library = MODEL.cost(dataclasses.replace(square_gemm(n, "float32"), impl="library"), h100)
    assert (generated.compute_unit, library.compute_unit) == ("fp32-cuda-core", "tf32-tensor-core")
    assert generated.compute_s == pytest.approx(
        2 * n**3 / (h100.fp32_flops_per_s * PARAMS.get("tc_efficiency", "gemm")), rel=1e-12)
    assert library.compute_s == pytest.approx(
        2 * n**3 / (h100.tf32_flops_per_s * PARAMS.get("library_efficiency", "gemm")), rel=1e-12)
    assert generated.time_s / library.time_s > 7
    assert MODEL.cost(square_gemm(n, "float16"), h100).compute_unit == "fp32-cuda-core"
    t4 = DEVICES["t4"]  # no TF32: cuBLAS runs float32 on the CUDA cores too
    assert MODEL.cost(dataclasses.replace(square_gemm(256, "float32"), impl="library",
                                          smem_bytes=0), t4).compute_unit == "fp32-cuda-core"


def test_tiny_kernel_is_launch_bound():
    """Launch-bound regime (h100-sxm): a 1 KiB kernel costs about one launch overhead."""
    spec = KernelSpec("pointwise", scalar_flops=128, dram_read_bytes=512, dram_write_bytes=512,
                      iteration_size=128)
    cost = MODEL.cost(spec, DEVICES["h100-sxm"])
    assert cost.bound == "launch"
    assert cost.launch_s <= cost.time_s < 1.1 * cost.launch_s


def test_fused_conv_relu_beats_conv_plus_relu():
    """Fusion benefit (a100-80gb, memory traffic + launches): conv+relu in one kernel skips a
    write and a read of the activation, so it is predicted faster than the two kernels."""
    device = DEVICES["a100-80gb"]
    n, c, hw = 32, 64, 56
    act_bytes = n * c * hw * hw * 2
    weight_bytes = c * c * 9 * 2
    conv_flops = 2 * n * c * hw * hw * c * 9
    relu_flops = n * c * hw * hw
    common = {"dtype": "float16", "iteration_size": n * c * hw * hw, "tile": (128, 64, 32),
              "smem_bytes": 48 * 1024, "live_values_per_thread": 64}
    conv = KernelSpec("conv", tc_flops=conv_flops, dram_read_bytes=act_bytes + weight_bytes,
                      dram_write_bytes=act_bytes, **common)
    relu = KernelSpec("pointwise", "float16", scalar_flops=relu_flops, dram_read_bytes=act_bytes,
                      dram_write_bytes=act_bytes, iteration_size=n * c * hw * hw)
    fused = dataclasses.replace(conv, scalar_flops=relu_flops, num_ops=2,
                                op_types=("Conv", "Relu"))
    assert fused.dram_bytes < conv.dram_bytes + relu.dram_bytes
    separate_s = MODEL.cost(conv, device).time_s + MODEL.cost(relu, device).time_s
    assert MODEL.cost(fused, device).time_s < separate_s


def test_smem_over_the_per_block_limit_is_infeasible():
    """Infeasible regime (t4): 72 KiB of shared memory > 64 KiB per block; the reason says both."""
    spec = KernelSpec("gemm", "float16", tc_flops=1e9, iteration_size=1 << 20,
                      tile=(128, 128, 32), smem_bytes=72 * 1024)
    cost = MODEL.cost(spec, DEVICES["t4"])
    assert not cost.feasible and math.isinf(cost.time_s)
    assert cost.reason == "smem 72.0 KiB > 64.0 KiB per block on t4"
    assert MODEL.cost(spec, DEVICES["a100-80gb"]).feasible  # 163 KiB there


def test_blocks_that_cannot_fit_are_infeasible():
    """Infeasible regime (h100-sxm): too many threads, or registers for one block > 64 K."""
    too_many_threads = KernelSpec("pointwise", iteration_size=4096, threads_per_block=2048)
    reason = MODEL.cost(too_many_threads, DEVICES["h100-sxm"]).reason
    assert reason == "threads 2048 per block > 1024 max on h100-sxm"
    fat = KernelSpec("pointwise", iteration_size=4096, threads_per_block=1024,
                     live_values_per_thread=200)
    cost = MODEL.cost(fat, DEVICES["h100-sxm"])
    assert not cost.feasible and "registers 216 x 1024 threads" in cost.reason
    assert "65536 per SM" in cost.reason


@pytest.mark.parametrize("spec", [elementwise_chain(16 * 2**20), square_gemm(4096)],
                         ids=["memory-bound-pointwise", "compute-bound-gemm"])
def test_same_kernel_is_faster_on_h100_than_t4(spec):
    """Device ordering (memory- and compute-bound): h100-sxm beats t4 on the same kernel."""
    assert MODEL.cost(spec, DEVICES["h100-sxm"]).time_s < MODEL.cost(spec, DEVICES["t4"]).time_s


def test_register_pressure_lowers_occupancy_and_slows_streaming():
    """Occupancy regime (h100-sxm): more live values -> more registers -> lower occupancy;
    below the knee a memory-bound kernel slows down."""
    device = DEVICES["h100-sxm"]
    costs = [MODEL.cost(elementwise_chain(2**24, live=v), device) for v in (4, 48, 96, 160)]
    occupancies = [c.occupancy for c in costs]
    assert occupancies == sorted(occupancies, reverse=True) and occupancies[-1] < occupancies[0]
    assert [c.regs_per_thread for c in costs] == [20, 64, 112, 176]
    assert costs[-1].limiter == "registers"
    assert costs[-1].occupancy < PARAMS.get("occupancy_knee", "pointwise")
    assert costs[-1].memory_s > costs[0].memory_s


def test_spills_above_255_registers_add_memory_time():
    """Spill regime (h100-sxm): past 255 registers the excess spills and adds DRAM traffic."""
    device = DEVICES["h100-sxm"]
    no_spill = MODEL.cost(elementwise_chain(2**24, live=230), device)
    spill = MODEL.cost(elementwise_chain(2**24, live=300), device)
    assert no_spill.spill_bytes == 0 and no_spill.regs_per_thread == 246
    assert spill.regs_per_thread == 255 and spill.spill_bytes == (316 - 255) * 4
    assert spill.dram_bytes > no_spill.dram_bytes and spill.memory_s > no_spill.memory_s
    free_spills = RooflineModel(PARAMS.with_updates(spill_traffic_factor=0.0))
    assert free_spills.cost(elementwise_chain(2**24, live=300), device).memory_s == no_spill.memory_s


def test_tensor_peak_choice_by_dtype():
    """Compute peaks: fp32 uses TF32 where present (a100) else CUDA cores (v100); bf16 without
    tensor cores (v100) falls back to FP32; fp16 scalar math uses half2."""
    a100, v100 = DEVICES["a100-80gb"], DEVICES["v100-sxm2"]
    assert tensor_peak_flops_per_s(a100, "float32") == a100.tf32_flops_per_s
    assert tensor_peak_flops_per_s(a100, "float32", False) == a100.fp32_flops_per_s
    assert tensor_peak_flops_per_s(v100, "float32") == v100.fp32_flops_per_s
    assert tensor_peak_flops_per_s(v100, "bfloat16") == v100.fp32_flops_per_s
    assert tensor_peak_flops_per_s(a100, "bfloat16") == a100.bf16_flops_per_s
    assert scalar_peak_flops_per_s(a100, "float16") == a100.fp16_simt_flops_per_s
    assert scalar_peak_flops_per_s(a100, "float32") == a100.fp32_flops_per_s


def test_transcendentals_cost_flop_equivalents():
    """Compute regime (a100-80gb): each transcendental costs `transcendental_flops` scalar flops."""
    device = DEVICES["a100-80gb"]
    base = KernelSpec("pointwise", iteration_size=2**20, scalar_flops=1e9)
    with_exp = dataclasses.replace(base, scalar_flops=0, transcendentals=1e9 / 16)
    assert MODEL.cost(with_exp, device).compute_s == pytest.approx(MODEL.cost(base, device).compute_s)


def test_overlap_combines_compute_and_memory():
    """Overlap (h100-sxm): 1 -> max(compute, memory); 0 -> their sum (plus launch either way)."""
    spec = dataclasses.replace(elementwise_chain(2**24), scalar_flops=2**24 * 200)
    device = DEVICES["h100-sxm"]
    full = RooflineModel(PARAMS.with_updates(overlap=1.0)).cost(spec, device)
    none = RooflineModel(PARAMS.with_updates(overlap=0.0)).cost(spec, device)
    assert full.time_s == pytest.approx(full.launch_s + max(full.compute_s, full.memory_s))
    assert none.time_s == pytest.approx(none.launch_s + full.compute_s + full.memory_s)


def test_cpu_devices_skip_the_occupancy_penalty():
    """CPU regime: no resident-warp penalty, so register pressure below spilling costs nothing."""
    cpu = dataclasses.replace(DEVICES["t4"], name="fake-cpu", kind="cpu")
    light = MODEL.cost(elementwise_chain(2**22, live=4), cpu)
    heavy = MODEL.cost(elementwise_chain(2**22, live=160), cpu)
    assert heavy.occupancy < light.occupancy and heavy.memory_s == light.memory_s


def test_cost_is_deterministic_and_a_flat_row():
    """Determinism: the same spec and device give equal costs; to_row is flat."""
    spec, device = square_gemm(2048), DEVICES["l4"]
    assert MODEL.cost(spec, device) == RooflineModel().cost(spec, device)
    row = MODEL.cost(spec, device).to_row()
    assert set(row) >= {"time_s", "compute_s", "memory_s", "launch_s", "occupancy",
                        "regs_per_thread", "smem_bytes", "spill_bytes", "bound", "feasible",
                        "reason", "flops", "dram_bytes"}


def test_params_updates_and_dict_round_trip():
    """Parameters: with_updates merges tables and dotted keys; to_dict / from_dict round-trip."""
    p = PARAMS.with_updates(overlap=0.5, memory_efficiency={"gemm": 0.7},
                            **{"tc_efficiency.conv": 0.55})
    assert p.overlap == 0.5 and p.get("memory_efficiency", "gemm") == 0.7
    assert p.get("memory_efficiency", "pointwise") == PARAMS.get("memory_efficiency", "pointwise")
    assert p.get("tc_efficiency", "conv") == 0.55
    assert RooflineParams.from_dict(p.to_dict()) == p
    assert RooflineParams.from_dict({}) == RooflineParams()
    assert p.flat()["memory_efficiency.gemm"] == 0.7 and "float32_uses_tf32" not in p.flat()
    with pytest.raises(InvalidSpec, match="no parameter"):
        PARAMS.with_updates(bandwidth_fudge=2.0)
    with pytest.raises(InvalidSpec, match="overlap"):
        PARAMS.with_updates(overlap=1.5)
    with pytest.raises(InvalidSpec, match="occupancy_knee"):
        PARAMS.with_updates(occupancy_knee={"gemm": 0.0})
    with pytest.raises(InvalidSpec, match="unknown"):
        RooflineParams.from_dict({"overlapp": 0.9})


@pytest.mark.parametrize("derived", ["depthwise", "conv_disjoint"])
def test_a_profile_from_before_a_conv_template_prices_those_convs_as_its_convs(derived):
    """A table written without "depthwise" or "conv_disjoint" (a profile fitted before the template
    existed) gives those convs its conv value; one that has it keeps its own."""
    assert DERIVED_TEMPLATES[derived] == "conv"
    old = {name: {t: v for t, v in table.items() if t != derived}
           for name, table in PARAMS.with_updates(**{"tc_efficiency.conv": 0.55, "library_efficiency.conv": 0.45,
                                                     f"tc_efficiency.{derived}": 0.1}).to_dict().items()
           if isinstance(table, dict)}
    loaded = RooflineParams.from_dict(old)
    assert loaded.get("tc_efficiency", derived) == 0.55 and loaded.get("library_efficiency", derived) == 0.45
    own = PARAMS.with_updates(**{f"tc_efficiency.{derived}": 0.1})
    assert RooflineParams.from_dict(own.to_dict()).get("tc_efficiency", derived) == 0.1


def test_generated_tensor_core_gemm_is_priced_at_tensor_core_rates():
    """A generated kernel on tensor cores (unit "tensor-core": the mma skeletons) takes 2n^3 / (the
    tensor-core peak of its dtype x mma_efficiency); without TF32, a float32 one falls back to the
    FP32 CUDA cores and `tc_efficiency`."""
    n = 4096
    h100 = DEVICES["h100-sxm"]
    for dtype, peak, unit in (("float32", h100.tf32_flops_per_s, "tf32-tensor-core"),
                              ("float16", h100.fp16_flops_per_s, "fp16-tensor-core"),
                              ("bfloat16", h100.bf16_flops_per_s, "bf16-tensor-core")):
        cost = MODEL.cost(dataclasses.replace(square_gemm(n, dtype), unit="tensor-core"), h100)
        assert cost.compute_unit == unit
        assert cost.compute_s == pytest.approx(2 * n**3 / (peak * PARAMS.get("mma_efficiency", "gemm")), rel=1e-12)
    no_tf32 = RooflineModel(PARAMS.with_updates(float32_uses_tf32=False))
    cost = no_tf32.cost(dataclasses.replace(square_gemm(n, "float32"), unit="tensor-core"), h100)
    assert cost.compute_unit == "fp32-cuda-core"
    assert cost.compute_s == pytest.approx(2 * n**3 / (h100.fp32_flops_per_s * PARAMS.get("tc_efficiency", "gemm")),
                                           rel=1e-12)


def test_each_cpu_product_has_its_own_factor_default_one():
    """`product_efficiency`: one factor per CPU product on its template's efficiency, 1 unless a
    profile sets it (a profile written before the table loads at 1); dotted and table updates
    round-trip; an unknown product or a factor out of range is refused; the factor prices a CPU
    gemm's main loop (`KernelSpec.product`), nothing else."""
    assert dict(PARAMS.product_efficiency) == dict.fromkeys(dict(PARAMS.product_efficiency), 1.0)
    p = PARAMS.with_updates(**{"product_efficiency.blas": 0.8}, product_efficiency={"band": 1.2})
    assert p.get("product_efficiency", "blas") == 0.8 and p.get("product_efficiency", "band") == 1.2
    assert p.flat()["product_efficiency.blas"] == 0.8
    assert RooflineParams.from_dict(p.to_dict()) == p
    old = {k: v for k, v in p.to_dict().items() if k != "product_efficiency"}
    assert RooflineParams.from_dict(old).get("product_efficiency", "blas") == 1.0
    with pytest.raises(InvalidSpec, match="unknown products"):
        PARAMS.with_updates(product_efficiency={"cublas": 1.0})
    with pytest.raises(InvalidSpec, match="product_efficiency"):
        PARAMS.with_updates(**{"product_efficiency.own": 0.0})
    with pytest.raises(InvalidSpec, match="product"):
        KernelSpec("gemm", product="cublas")
    cpu = dataclasses.replace(DEVICES["t4"], name="pinned-cpu", kind="cpu")
    own, blas = (dataclasses.replace(square_gemm(512, "float32"), product=q) for q in ("own", "blas"))
    model = RooflineModel(p)
    assert model.cost(blas, cpu).compute_s == pytest.approx(MODEL.cost(blas, cpu).compute_s / 0.8)
    assert model.cost(own, cpu).compute_s == MODEL.cost(own, cpu).compute_s
