"""Costs of lowered groups on pinned devices, each test naming its regime, and the graph-level
figures (unfused time, physical lower bound)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from onnx import TensorProto, helper

from costmodels import RooflineModel, get_device, host_cpu
from fusesearch.backends.codegen import CAPABILITIES
from fusesearch.candidates.rules import Legality
from fusesearch.costing import cheapest, graph_figures, kernel_cost, priced_kernel
from fusesearch.lowering import choices, lower
from fusesearch.pipeline import prepare
from tests.test_lowering import conv_relu_graph, gemm_softmax_graph, graph_of, group

MODEL = RooflineModel()
H100, T4, A100 = get_device("h100-sxm"), get_device("t4"), get_device("a100-80gb")


def chain_graph(n_elems: int, ops=("Relu", "Neg", "Abs"), dtype=TensorProto.FLOAT):
    nodes, prev = [], "x"
    for i, op in enumerate(ops):
        nodes.append(helper.make_node(op, [prev], [f"t{i}"], name=f"n{i}"))
        prev = f"t{i}"
    return graph_of(nodes, [("x", [n_elems], dtype)], [(prev, None, dtype)])


def test_memory_bound_elementwise_chain_on_h100():
    """Regime: DRAM-bound. 64M fp32 elements through Relu→Neg→Abs fused: time ≈ bytes / bandwidth."""
    n = 64 * 1024 * 1024
    g = chain_graph(n)
    k = lower(g, group(g, "n0", "n1", "n2"))
    cost = kernel_cost(k, H100, MODEL)
    assert cost.bound == "memory"
    ideal = 2 * 4 * n / H100.dram_bytes_per_s
    assert ideal < cost.time_s < ideal / 0.8  # within the pointwise memory efficiency (0.9) + launch


def test_large_fp16_gemm_is_tensor_core_compute_bound():
    """Regime: compute-bound on tensor cores (a100-80gb, fp16 8192³)."""
    n = 8192
    nodes = [helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")]
    g = graph_of(nodes, [("a", [n, n], TensorProto.FLOAT16), ("b", [n, n], TensorProto.FLOAT16)],
                 [("y", None, TensorProto.FLOAT16)])
    cost = kernel_cost(lower(g, group(g, "mm")), A100, MODEL)
    assert cost.bound == "compute"
    ideal = 2 * n**3 / A100.fp16_flops_per_s
    assert ideal < cost.time_s < ideal / 0.6


def test_tiny_kernel_is_launch_bound():
    """Regime: launch-bound. 16 floats through one Relu."""
    g = chain_graph(16, ops=("Relu",))
    cost = kernel_cost(lower(g, group(g, "n0")), H100, MODEL)
    assert cost.bound == "launch"
    assert cost.time_s < 2 * H100.launch_overhead_s


def test_conv_relu_fused_moves_fewer_bytes_and_is_faster():
    """Regime: memory-bound conv epilogue (16 channels, 64x64): fusing removes a round trip, on
    each device's skeleton (the T4, sm_75, has no TF32 and our tensor-core skeleton needs sm_80:
    the fused kernel runs on CUDA cores there)."""
    g = conv_relu_graph(c=16, hw=64)
    fused = lower(g, group(g, "conv", "relu"))
    apart = [lower(g, group(g, "conv")), lower(g, group(g, "relu"))]
    assert fused.read_bytes + fused.write_bytes < sum(k.read_bytes + k.write_bytes for k in apart)
    for device in (T4, A100, H100):
        kernel, cost = priced_kernel(g, fused, device, MODEL)
        assert kernel.schedule.unit == ("cuda-core" if device is T4 else "tensor-core"), device.name
        assert cost.time_s < sum(kernel_cost(k, device, MODEL).time_s for k in apart)


def test_tensor_core_skeleton_needs_sm80_and_the_search_prices_both_units():
    """Regime: compute-bound fused GEMM + ReLU in float16 (1024^3). Our tensor-core skeleton is
    refused on the T4 (sm_75: cp.async, wmma as written need sm_80) with the reason; the priced
    choice falls back to the CUDA-core skeleton there and keeps tensor cores on the A100 (the
    mma.sync skeleton: sm_80 too)."""
    nodes = [helper.make_node("MatMul", ["a", "b"], ["y"], name="mm"), helper.make_node("Relu", ["y"], ["r"], name="relu")]
    g = graph_of(nodes, [("a", [1024, 1024], TensorProto.FLOAT16), ("b", [1024, 1024], TensorProto.FLOAT16)],
                 [("r", None, TensorProto.FLOAT16)])
    fused = lower(g, group(g, "mm", "relu"))
    assert fused.schedule.skeleton == "mma-f16" and fused.schedule.min_arch == 80
    refused = kernel_cost(fused, T4, MODEL)
    assert not refused.feasible and "needs sm_80 or later; t4 is sm_75" in refused.reason
    on_t4, cost_t4 = priced_kernel(g, fused, T4, MODEL)
    assert on_t4.schedule.skeleton == "tiled" and cost_t4.feasible and cost_t4.compute_unit == "fp32-cuda-core"
    on_a100, cost_a100 = priced_kernel(g, fused, A100, MODEL)  # the mma.sync tiles, priced above wmma's
    assert on_a100.schedule.skeleton == "mma-sync-f16" and cost_a100.compute_unit == "fp16-tensor-core"


def test_softmax_epilogue_is_priced_as_the_row_kernel_generated():
    """Regime: shared memory as generated. A GEMM under a Softmax is generated as a block per row
    that caches the product's row and its exponentials in shared memory (the block reduction's
    partials beside them): 2 x 4 x 4096 + 128 bytes for a 4096-wide row, which fits a T4 block;
    a 6000-wide row caches only the product (its exponentials would pass 32 KiB)."""
    g = gemm_softmax_graph(4096)
    k = lower(g, group(g, "mm", "sm"))
    assert k.smem_bytes == 2 * 4 * 4096 + 128 and k.tile[:2] == (1, 4096)
    cost = kernel_cost(k, T4, MODEL)
    assert cost.feasible and cost.smem_bytes == k.smem_bytes
    wide = gemm_softmax_graph(6000)
    assert lower(wide, group(wide, "mm", "sm")).smem_bytes == 4 * 6000 + 128


def test_same_kernel_faster_on_h100_than_t4():
    """Regimes: memory-bound (chain) and compute-bound (conv) — both faster on h100-sxm."""
    g = chain_graph(1 << 22)
    k = lower(g, group(g, "n0", "n1", "n2"))
    assert kernel_cost(k, H100, MODEL).time_s < kernel_cost(k, T4, MODEL).time_s
    c = conv_relu_graph(c=64, hw=56)
    kc = lower(c, group(c, "conv", "relu"))
    assert kernel_cost(kc, H100, MODEL).time_s < kernel_cost(kc, T4, MODEL).time_s


def test_occupancy_falls_as_fused_ops_raise_registers():
    """Regime: register-limited occupancy. A 60-op chain keeps more values live than one op."""
    ops = tuple(["Relu", "Neg", "Abs", "Sigmoid"] * 15)
    g = chain_graph(1 << 20, ops=ops)
    short = kernel_cost(lower(g, group(g, "n0")), H100, MODEL)
    long = kernel_cost(lower(g, group(g, *[f"n{i}" for i in range(len(ops))])), H100, MODEL)
    assert long.regs_per_thread > short.regs_per_thread
    assert long.occupancy < short.occupancy


def test_graph_figures_resnet50_unfused_above_lower_bound():
    """Graph level: every node its own kernel vs the physics bound, on three devices."""
    prep = prepare("zoo:resnet50")
    for device in (T4, A100, H100):
        f = graph_figures(prep.graph, device, MODEL)
        assert f.unfused_kernels == 122  # one per node (Flatten is a zero-cost alias)
        assert 0 < f.lower_bound_s < f.unfused_time_s
        assert f.min_dram_bytes > 97 * 2**20  # weights are read at least once
    t4, h100 = (graph_figures(prep.graph, d, MODEL) for d in (T4, H100))
    assert h100.unfused_time_s < t4.unfused_time_s and h100.lower_bound_s < t4.lower_bound_s


def test_unfused_time_counts_every_node():
    g = chain_graph(1 << 16, ops=("Relu", "Neg"))
    f = graph_figures(g, H100, MODEL)
    singles = sum(kernel_cost(lower(g, group(g, n)), H100, MODEL).time_s for n in ("n0", "n1"))
    assert np.isclose(f.unfused_time_s, singles)
    assert f.unfused_kernels == 2


def test_legality_fuses_what_the_capabilities_it_is_given_say_the_generator_writes():
    """Legality reads the generator from the value it is bound to: the same Relu→Neg→Abs chain is
    a candidate under the generator's own capabilities, refused (naming the op, or the tensor's
    dtype) under ones without Neg or without float32, and each op alone stays a candidate."""
    g = chain_graph(1024)
    chain = frozenset(group(g, "n0", "n1", "n2").nodes)
    assert Legality(g, H100, MODEL, CAPABILITIES).check(chain).decision
    no_neg = Legality(g, H100, MODEL, dataclasses.replace(CAPABILITIES, ops=CAPABILITIES.ops - {"Neg"}))
    refused = no_neg.check(chain).decision
    assert not refused and "n1(Neg) has no code generator" in refused.reason
    assert all(no_neg.check({i}).decision for i in chain)
    no_float = dataclasses.replace(CAPABILITIES, dtypes=CAPABILITIES.dtypes - {"float32"})
    refused = Legality(g, host_cpu(), MODEL, no_float).check(chain).decision
    assert not refused and "dtype float32 of 'x' is not generated" in refused.reason


def test_a_fused_conv_transpose_is_refused_on_the_cpu_and_kept_on_a_gpu():
    """ConvTranspose + Relu: on a GPU a fusion candidate (the direct skeleton); on the CPU refused
    with the reason (the C backend writes it only as a per-output gather loop), so the host plan
    runs the ConvTranspose alone as a library call."""
    nodes = [helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="ct", strides=[2, 2]),
             helper.make_node("Relu", ["y"], ["r"], name="relu")]
    g = graph_of(nodes, [("x", [1, 16, 8, 8], TensorProto.FLOAT), ("w", [16, 8, 2, 2], TensorProto.FLOAT)],
                 [("r", None, TensorProto.FLOAT)])
    both = frozenset(group(g, "ct", "relu").nodes)
    assert Legality(g, H100, MODEL, CAPABILITIES).check(both).decision
    refused = Legality(g, host_cpu(), MODEL, CAPABILITIES).check(both).decision
    assert not refused and "no packed ConvTranspose" in refused.reason and "ct(ConvTranspose)" in refused.reason


def test_a_pool_in_front_of_a_conv_is_refused_on_the_cpu_and_kept_on_a_gpu():
    """MaxPool then a 1x1 Conv (resnet50's stem into its first block): a fusion candidate on a GPU;
    on the CPU refused with the reason (the packed conv would compute the pool tap by tap in its
    panel), while the pool after a conv (an epilogue) stays a candidate there."""
    nodes = [helper.make_node("MaxPool", ["x"], ["p"], name="pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4),
             helper.make_node("Conv", ["p", "w"], ["y"], name="conv"),
             helper.make_node("MaxPool", ["y"], ["z"], name="pool2", kernel_shape=[2, 2], strides=[2, 2])]
    g = graph_of(nodes, [("x", [1, 16, 16, 16], TensorProto.FLOAT), ("w", [16, 16, 1, 1], TensorProto.FLOAT)],
                 [("z", None, TensorProto.FLOAT)])
    before = frozenset(group(g, "pool", "conv").nodes)
    assert Legality(g, H100, MODEL, CAPABILITIES).check(before).decision
    refused = Legality(g, host_cpu(), MODEL, CAPABILITIES).check(before).decision
    assert not refused and "pool(MaxPool) before conv(Conv)" in refused.reason
    assert Legality(g, host_cpu(), MODEL, CAPABILITIES).check(frozenset(group(g, "conv", "pool2").nodes)).decision


def test_a_fused_gemm_on_the_cpu_is_priced_as_the_packed_c_skeleton():
    """Regime: the host. GELU-like prologue (Tanh) on A and a Transpose of B in the group, bias
    epilogue: on a GPU the tiled skeleton recomputes each prologue element once per tile that
    loads it; on the CPU the C backend packs A's rows and B's panel once, so the priced
    schedule is `packed` (C only) with every prologue element computed once."""
    nodes = [helper.make_node("Tanh", ["a"], ["at"], name="tanh"),
             helper.make_node("Transpose", ["b"], ["bt"], name="tr", perm=[1, 0]),
             helper.make_node("MatMul", ["at", "bt"], ["y"], name="mm"),
             helper.make_node("Relu", ["y"], ["z"], name="relu")]
    g = graph_of(nodes, [("a", [512, 256], TensorProto.FLOAT), ("b", [1024, 256], TensorProto.FLOAT)],
                 [("z", None, TensorProto.FLOAT)])
    ids = frozenset(group(g, "tanh", "tr", "mm", "relu").nodes)
    gpu_kernel, _ = priced_kernel(g, lower(g, group(g, "tanh", "tr", "mm", "relu")), H100, MODEL)
    host_kernel, cost = priced_kernel(g, lower(g, group(g, "tanh", "tr", "mm", "relu")), host_cpu(), MODEL)
    assert host_kernel.schedule.skeleton == "packed" and host_kernel.schedule.unit == "cpu-simd"
    assert cost.compute_unit == "cpu-simd" and cost.feasible
    assert host_kernel.transcendentals == 512 * 256  # each Tanh once
    assert host_kernel.scalar_flops == 512 * 1024 + 512 * 256  # the Relu, each Tanh once; a Transpose moves
    assert gpu_kernel.schedule.skeleton != "packed" and gpu_kernel.transcendentals > host_kernel.transcendentals
    assert Legality(g, host_cpu(), MODEL, CAPABILITIES).check(ids).kernel.schedule.skeleton == "packed"


def test_a_conv_prologue_on_the_cpu_counts_once_per_tap_and_a_pool_after_it_never_recomputes_the_conv():
    """Regime: the host. The im2col panel computes a prologue element once per filter tap that
    reads it (9 for a 3x3 conv, padding aside: counted as the tile's taps); a MaxPool after the conv
    reads the product materialized once, so the conv's MACs stay tensor (anchor) work, while
    the Relu between them is evaluated at every tap."""
    nodes = [helper.make_node("Sigmoid", ["x"], ["xs"], name="sig"),
             helper.make_node("Conv", ["xs", "w"], ["y"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["y"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], ["z"], name="pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4)]
    g = graph_of(nodes, [("x", [1, 8, 16, 16], TensorProto.FLOAT), ("w", [16, 8, 3, 3], TensorProto.FLOAT)],
                 [("z", None, TensorProto.FLOAT)])
    host, _ = priced_kernel(g, lower(g, group(g, "sig", "conv", "relu", "pool")), host_cpu(), MODEL)
    gpu = lower(g, group(g, "sig", "conv", "relu", "pool"))
    macs = 16 * 16 * 16 * 8 * 9
    assert host.schedule.skeleton == "packed" and host.tc_flops == 2 * macs
    assert host.transcendentals == 9 * 8 * 16 * 16  # the Sigmoid once per tap
    assert gpu.tc_flops == 0  # on a GPU the conv is recomputed at every window tap, on CUDA cores


def test_a_conv_prologue_on_the_cpu_counts_once_when_the_conv_reads_a_band():
    """Regime: the host. With constant float32 filters a 3x3 conv packs its taps from a band of its
    input computed once per element (`conv_reads_band`, `fs_conv_band`): its prologue is charged
    once, as the generated C evaluates it, not once per tap; a 1x1 conv's im2col panel has one tap."""
    from fusesearch.schedule import conv_reads_band

    for k in (3, 1):
        g = _sigmoid_conv_relu((16, 8, k, k), pads=[k // 2] * 4)
        host, _ = priced_kernel(g, lower(g, group(g, "sig", "conv", "relu")), host_cpu(), MODEL)
        assert conv_reads_band(g, g.nodes[g.node("conv").id]) == (k == 3)
        assert host.schedule.skeleton == "packed" and host.transcendentals == 8 * 16 * 16  # the Sigmoid once


def _sigmoid_conv_relu(weight_shape: tuple[int, ...], **conv_attrs):
    """Sigmoid -> Conv (filters of `weight_shape`, ones; `conv_attrs` its attributes) -> Relu over
    a 1 x 8 x 16 x 16 input."""
    nodes = [helper.make_node("Sigmoid", ["x"], ["xs"], name="sig"),
             helper.make_node("Conv", ["xs", "w"], ["y"], name="conv", **conv_attrs),
             helper.make_node("Relu", ["y"], ["z"], name="relu")]
    return graph_of(nodes, [("x", [1, 8, 16, 16], TensorProto.FLOAT)], [("z", None, TensorProto.FLOAT)],
                    [("w", np.ones(weight_shape, np.float32))])


def _depthwise_graph(channels_in_group: int = 1):
    """Sigmoid -> 3x3 Conv in groups of `channels_in_group` input channels (8 channels) -> Relu."""
    return _sigmoid_conv_relu((8, channels_in_group, 3, 3), pads=[1] * 4, group=8 // channels_in_group)


def test_a_depthwise_conv_is_its_own_template_priced_by_its_own_efficiencies():
    """Regime: compute-bound on the host's SIMD units. A conv in groups of one input channel is
    template "depthwise" everywhere (lone: the library's call; fused on the host: the C depthwise
    loop, skeleton `depthwise`, its prologue evaluated once per element of its zero-bordered planes,
    as that loop does, not once per tap): the depthwise efficiencies price it, a dense conv's do
    not; a grouped conv over two channels per group stays a conv."""
    from fusesearch.schedule import depthwise_conv

    g = _depthwise_graph()
    conv = g.nodes[g.node("conv").id]
    assert depthwise_conv(g, conv)
    fused = lower(g, group(g, "sig", "conv", "relu"))
    host, _ = priced_kernel(g, fused, host_cpu(), MODEL)
    lone = lower(g, group(g, "conv"))
    assert fused.template == host.template == lone.template == "depthwise"
    assert host.schedule.skeleton == "depthwise" and host.spec().unit == "cpu-simd"
    assert host.tc_flops == 2 * 8 * 16 * 16 * 9 and host.transcendentals == 8 * 16 * 16  # the Sigmoid once
    assert lone.schedule.impl == "library"
    slow = RooflineModel(MODEL.params.with_updates(**{"tc_efficiency.depthwise": 0.01, "library_efficiency.depthwise": 0.01}))
    for k in (host, lone):
        assert kernel_cost(k, host_cpu(), slow).compute_s > 10 * kernel_cost(k, host_cpu(), MODEL).compute_s
    dense = _depthwise_graph(2)
    assert not depthwise_conv(dense, dense.nodes[dense.node("conv").id])
    dense_host, _ = priced_kernel(dense, lower(dense, group(dense, "sig", "conv", "relu")), host_cpu(), MODEL)
    assert dense_host.template == "conv" and dense_host.schedule.skeleton == "packed"
    assert kernel_cost(dense_host, host_cpu(), slow).time_s == kernel_cost(dense_host, host_cpu(), MODEL).time_s


@pytest.mark.parametrize(("k", "stride", "dilation", "disjoint"), [
    (1, 1, 1, True), (1, 2, 1, True), (4, 4, 1, True), (2, 4, 1, True),  # 1x1, strided 1x1, patches
    (3, 1, 1, False), (3, 2, 1, False), (2, 2, 2, False), (4, 2, 1, False)])  # windows that overlap
def test_a_conv_with_disjoint_windows_is_its_own_template_priced_by_its_own_efficiencies(k, stride, dilation, disjoint):
    """Regime: compute-bound on the host's SIMD units. A conv whose windows do not overlap (each
    input element in one window per filter: 1x1 convs, a patch embedding) is template
    "conv_disjoint" lone (the library's call) and fused (host and GPU lowering alike), priced by its
    own efficiencies and not by a conv's; a window that overlaps its neighbours (a 3x3, a 4x4 at
    stride 2, a 2x2 dilated by 2) stays a conv, priced by the conv's."""
    from fusesearch.schedule import disjoint_windows

    g = _sigmoid_conv_relu((16, 8, k, k), strides=[stride] * 2, dilations=[dilation] * 2)
    assert disjoint_windows(g, g.nodes[g.node("conv").id]) == disjoint
    template = "conv_disjoint" if disjoint else "conv"
    fused = lower(g, group(g, "sig", "conv", "relu"))
    host, _ = priced_kernel(g, fused, host_cpu(), MODEL)
    lone = lower(g, group(g, "conv"))
    assert fused.template == host.template == lone.template == template
    assert host.schedule.skeleton == "packed" and lone.schedule.impl == "library"
    other = "conv" if disjoint else "conv_disjoint"
    slow_own = RooflineModel(MODEL.params.with_updates(**{f"tc_efficiency.{template}": 0.001,
                                                          f"library_efficiency.{template}": 0.001}))
    slow_other = RooflineModel(MODEL.params.with_updates(**{f"tc_efficiency.{other}": 0.001,
                                                            f"library_efficiency.{other}": 0.001}))
    for kernel in (host, lone):
        assert kernel_cost(kernel, host_cpu(), slow_own).compute_s > 10 * kernel_cost(kernel, host_cpu(), MODEL).compute_s
        assert kernel_cost(kernel, host_cpu(), slow_other).time_s == kernel_cost(kernel, host_cpu(), MODEL).time_s


def test_a_lone_anchor_on_the_cpu_is_our_c_unless_the_library_is_priced_faster():
    """Regime: the host, compute-bound products. A lone MatMul is priced both as the library call
    and as our C (`packed`); the default efficiencies price the two alike (ours no dearer: the
    library's call may split K) and the plan keeps ours (what the C program runs); a profile that prices the library's faster keeps the library call.
    A lone depthwise conv is ours too (skeleton `depthwise`); a lone padded ConvTranspose (no 1x1
    Conv and shuffle) stays the library's (the C backend writes none worth running); on a GPU a
    lone anchor is the library's."""
    nodes = [helper.make_node("MatMul", ["a", "w"], ["y"], name="mm"),
             helper.make_node("ConvTranspose", ["x", "wt"], ["ct"], name="ct", strides=[2, 2], pads=[1, 1, 1, 1])]
    g = graph_of(nodes, [("a", [256, 512], TensorProto.FLOAT), ("x", [1, 16, 8, 8], TensorProto.FLOAT)],
                 [("y", None, TensorProto.FLOAT), ("ct", None, TensorProto.FLOAT)],
                 [("w", np.ones((512, 512), np.float32)), ("wt", np.ones((16, 8, 2, 2), np.float32))])
    mm, ct = (frozenset(group(g, name).nodes) for name in ("mm", "ct"))
    ours = Legality(g, host_cpu(), MODEL, CAPABILITIES).check(mm)
    assert ours.kernel.impl == "generated" and ours.kernel.schedule.skeleton == "packed"
    library = lower(g, group(g, "mm"))
    assert library.impl == "library" and ours.cost.time_s <= kernel_cost(library, host_cpu(), MODEL).time_s
    fast = RooflineModel(MODEL.params.with_updates(**{"library_efficiency.gemm": 0.95, "tc_efficiency.gemm": 0.2}))
    called = Legality(g, host_cpu(), fast, CAPABILITIES).check(mm)
    assert called.kernel.impl == "library" and called.cost.time_s < kernel_cost(ours.kernel, host_cpu(), fast).time_s
    assert Legality(g, host_cpu(), MODEL, CAPABILITIES).check(ct).kernel.impl == "library"
    assert Legality(g, H100, MODEL, CAPABILITIES).check(mm).kernel.impl == "library"
    dw = _depthwise_graph()
    lone = Legality(dw, host_cpu(), MODEL, CAPABILITIES).check(frozenset(group(dw, "conv").nodes)).kernel
    assert lone.impl == "generated" and lone.schedule.skeleton == "depthwise"


def test_each_cpu_product_is_priced_at_its_own_efficiency():
    """A lone MatMul on a CPU: our micro-kernel and the BLAS per block are two choices. Under the
    default factors (1: the one efficiency every product had) they tie and the first, ours, is kept;
    a profile whose BLAS factor is 2 prices the BLAS's main loop at twice the rate and picks it.
    A GPU kernel has no product: the factors leave it alone."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")]
    g = graph_of(nodes, [("x", [64, 64])], [("y", None)], [("W", np.ones((64, 64), np.float32))])
    cpu = dataclasses.replace(T4, name="pinned-cpu", kind="cpu")
    own, blas = (k for k in choices(g, group(g, "mm"), host=True) if k.impl == "generated")
    assert (own.schedule.product, blas.schedule.product) == ("own", "blas") and blas.scalar_flops == 0
    assert kernel_cost(own, cpu, MODEL).time_s == kernel_cost(blas, cpu, MODEL).time_s
    assert cheapest((own, blas), cpu, MODEL)[0] is own
    faster = RooflineModel(MODEL.params.with_updates(**{"product_efficiency.blas": 2.0}))
    assert cheapest((own, blas), cpu, faster)[0] is blas
    assert kernel_cost(blas, cpu, faster).compute_s == pytest.approx(kernel_cost(blas, cpu, MODEL).compute_s / 2)
    gpu_kernel = lower(g, group(g, "mm"))
    assert gpu_kernel.schedule.product == "" and kernel_cost(gpu_kernel, H100, faster) == kernel_cost(gpu_kernel, H100, MODEL)


def _gpt2_mlp_piece(tmp_path, kind: str, m: int, k: int, n: int):
    """One GPT-2 MLP piece on m rows as its own model: `mm+add` (the projection and its bias:
    one Gemm, a lone anchor), `gelu+mm+add` (c_proj with the GELU before it, staged while A is
    loaded) or `mm+add+gelu` (c_fc with the GELU after it, on the accumulators)."""
    from tests.backends.test_cuda_emulated import GELU_CONSTANTS, gelu, rand
    from tests.conftest import make_model, save

    product = [helper.make_node("MatMul", ["gx" if kind.startswith("gelu") else "x", "w"], ["y"]),
               helper.make_node("Add", ["y", "bias"], ["z" if kind.endswith("gelu") else "out"])]
    nodes = [*(gelu("x", "gx") if kind.startswith("gelu") else []), *product,
             *(gelu("z", "out") if kind.endswith("gelu") else [])]
    inits = [("w", rand(k, n)), ("bias", rand(n, seed=6)), *(GELU_CONSTANTS if "gelu" in kind else [])]
    return save(make_model(nodes, [("x", [m, k])], [("out", None)], inits), tmp_path / f"{kind}-{m}x{k}x{n}.onnx")


def _priced_at_h100(path):
    """The group of the whole model priced as `plan --device h100-sxm` prices it: (kernel, cost)."""
    from fusesearch.api import for_device, resolve_device

    _, spec, params, _ = resolve_device("h100-sxm")
    prep, params = for_device(prepare(path, tf32=True), spec, params)
    whole = group(prep.graph, *(n.name for n in prep.graph.nodes))
    return priced_kernel(prep.graph, lower(prep.graph, whole), spec, RooflineModel(params))


@pytest.mark.parametrize("kind,k", [("mm+add", 768), ("mm+add", 3072), ("gelu+mm+add", 3072),
                                    ("mm+add+gelu", 3072)])
def test_a_gemm_with_fewer_rows_never_prices_above_one_with_more(tmp_path, kind, k):
    """Regime: h100-sxm, TF32, N = 768, M = 16, 32, 64, 128 rows (GPT-2 / BERT at small batch x
    seq): the fewer the rows, the faster and the fewer bytes the cheapest choice is priced at.
    At 16 rows the library's 16-row tile made too few blocks (its grid counted the real elements
    over the tile, not the tiles launched), the CUDA-core kernel had no tile but that one, and
    split-K partials were priced as whole padded tiles: 16 rows priced above 32."""
    priced = [_priced_at_h100(_gpt2_mlp_piece(tmp_path, kind, m, k, 768)) for m in (16, 32, 64, 128)]
    times = [cost.time_s for _, cost in priced]
    assert times == sorted(times), [(kn.schedule.skeleton.value, kn.tile, kn.split_k, c.time_s) for kn, c in priced]
    if k == 3072:  # the weight dominates the bytes: the cheapest choice keeps its split as M grows
        dram = [cost.dram_bytes for _, cost in priced]
        assert dram == sorted(dram), dram


def test_split_k_partials_are_priced_at_the_real_rows_on_a_gpu(tmp_path):
    """Regime: h100-sxm, TF32, a 16 x 768 x 3072 GELU + c_proj + bias group and the lone
    16 x 768 x 768 projection. Every split choice (ours on mma.sync tiles of 32 to 128 rows, the
    library's) carries split x 16 x 768 floats of partials (`Schedule.workspace_bytes`), written
    once and read back once, in its traffic, never its tiles' padded rows; every split is listed
    down to unsplit; the library's grid is the tiles it launches and its tiles include the one it
    runs at 32 rows."""
    for kind, k in (("gelu+mm+add", 3072), ("mm+add", 768)):
        prep = prepare(_gpt2_mlp_piece(tmp_path, kind, 16, k, 768), tf32=True)
        options = choices(prep.graph, group(prep.graph, *(n.name for n in prep.graph.nodes)))
        assert any(kn.split_k > 1 for kn in options)
        for kn in options:
            unsplit = next(u for u in options if u.split_k == 1 and u.schedule.impl == kn.schedule.impl
                           and u.tile == kn.tile and u.schedule.warp == kn.schedule.warp)
            extra = kn.split_k * 16 * 768 * 4 if kn.split_k > 1 else 0
            assert (kn.read_bytes, kn.write_bytes) == (unsplit.read_bytes + extra, unsplit.write_bytes + extra), kn
        assert all(kn.schedule.workspace_bytes == (kn.split_k * 16 * 768 * 4 if kn.split_k > 1 else 0) for kn in options)
        _check_split_listing(options, k)


def _check_split_listing(options, k: int) -> None:
    """Each configuration listed at every split of `split_choices` down to unsplit; a library
    call's grid its launched tiles, its tiles the skinny one and the one it has at 32 rows."""
    from fusesearch.schedule import SKINNY_M, gemm_tiles, mma_sync_split, split_choices, split_k

    listed: dict[tuple, list[int]] = {}
    for kn in options:
        s = kn.schedule
        listed.setdefault((s.impl, s.skeleton, s.tile, s.warp, s.stages), []).append(s.split_k)
    for (impl, skeleton, tile, _, _), splits in listed.items():
        rule = (mma_sync_split(16, 768, k, tile) if skeleton.value.startswith("mma-sync")
                else split_k(16, 768, k, tile) if impl == "library" else 1)
        assert splits == list(split_choices(rule)) and splits[-1] == 1, (skeleton, tile, splits)
    library = [kn for kn in options if kn.schedule.impl == "library"]
    for kn in library:
        s = kn.schedule
        assert s.grid == (-(-768 // s.tile[1]), -(-16 // s.tile[0]), s.split_k)
    if library:
        assert {kn.tile for kn in library} == set(gemm_tiles(16, 768)[:2])
        assert gemm_tiles(16, 768)[1:] == gemm_tiles(SKINNY_M, 768)
