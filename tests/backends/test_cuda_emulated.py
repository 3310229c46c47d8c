"""The generated CUDA kernels, run as written on host threads (`backends.emulate`), equal ONNX
Runtime: every skeleton — shared-memory tiled gemm and conv (implicit GEMM) with prologues and
epilogues on CUDA cores (TF32 off) and on tensor cores (`mma-tf32`, and `mma-f16` / `mma-bf16`
with the float32 operands converted while staged), vectorized pointwise, block-per-row reductions
with warp shuffles — on tiny graphs whose shapes leave partial tiles, and on groups of zoo plans
with small dims.

Tolerance: |emulated - ONNX Runtime| <= tol x max(1, max |reference|), tol = 1e-4 on CUDA cores
(float32 throughout); on tensor cores the operands keep 10 (TF32, FP16) or 7 (BF16) mantissa bits,
a relative error of 2^-11 / 2^-8 per operand, so tol = 2e-3 for TF32 and FP16 and 1.6e-2 for BF16
(K <= 4096 here: the float32 accumulation adds far less)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from onnx import helper

from fusesearch.backends import emulate
from fusesearch.backends.codegen import generate
from fusesearch.backends.codegen.base import Arg, GeneratedKernel
from fusesearch.backends.codegen.mma import TOLERANCE  # else 1e-4 (see above)
from fusesearch.groups import FusionGroup
from fusesearch.ir.canonicalize import to_proto
from fusesearch.lowering import choices, lower
from fusesearch.pipeline import prepare
from fusesearch.verify import all_values, random_feeds
from fusesearch.zoo import ZOO
from tests.conftest import SCALED_TWINS, make_model, save

pytestmark = pytest.mark.skipif(not emulate.available(), reason="no C++ compiler")




def check(prep, values, node_ids, skeleton: str | None = None, schedule=None):
    """Lower (the group's first generated choice: a lone anchor's default is the library call),
    generate (with `schedule` instead of lowering's, e.g. another tile), emulate, and compare every
    output with ONNX Runtime's."""
    kernel = next(k for k in choices(prep.graph, FusionGroup(frozenset(node_ids))) if k.impl == "generated")
    gk = generate(prep.graph, replace(kernel, schedule=schedule) if schedule else kernel)
    if skeleton:
        assert gk.skeleton == skeleton, (gk.skeleton, gk.cuda_source)
    out = emulate.run(gk, {a.tensor: values[a.tensor] for a in gk.inputs})
    for a in gk.outputs:
        ref = values[a.tensor]
        scale = max(1.0, float(np.max(np.abs(ref)))) if ref.size else 1.0
        np.testing.assert_allclose(out[a.tensor].astype(np.float64), ref.astype(np.float64), rtol=0,
                                   atol=TOLERANCE.get(gk.skeleton, 1e-4) * scale, err_msg=f"{gk.name}: {a.tensor}")
    return gk


def one_group(tmp_path, nodes, inputs, outputs, inits=(), skeleton=None, tf32=False, schedule=None):
    """One group of the whole graph; TF32 off unless asked (the CUDA-core skeletons)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = save(make_model(nodes, inputs, outputs, inits), tmp_path / "m.onnx")
    prep = prepare(path, tf32=tf32)
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    return check(prep, values, range(len(prep.graph)), skeleton, schedule)


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def hand_kernel(body: str, block: int = 64, grid: int = 2) -> GeneratedKernel:
    """A hand-written CUDA kernel over one float input and output of block x grid elements."""
    n = block * grid
    src = f"extern \"C\" __global__ void k(const float* __restrict__ in0, float* __restrict__ out0) {{\n{body}\n}}\n"
    return GeneratedKernel(name="k", template="pointwise", inputs=(Arg("in0", "x", (n,), "float32"),),
                           outputs=(Arg("out0", "y", (n,), "float32"),), c_source="", cuda_source=src,
                           grid=(grid, 1, 1), block=(block, 1, 1), skeleton="hand")


def test_emulated_threads_meet_at_barriers_and_shuffles():
    """Every thread writes shared memory before the barrier and reads a neighbour's after it; a
    warp sums its lanes by xor shuffles: the emulated block behaves as a CUDA block."""
    kernel = hand_kernel("""
    __shared__ float tile[64];
    unsigned t = threadIdx.x, i = blockIdx.x * blockDim.x + t;
    tile[t] = in0[i];
    __syncthreads();
    float v = tile[(t + 1) % 64];
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    out0[i] = v;""")
    x = np.arange(128, dtype=np.float32)
    y = emulate.run(kernel, {"x": x})["y"]
    blocks = x.reshape(2, 64)
    want = np.concatenate([np.repeat([np.roll(b, -1)[:32].sum(), np.roll(b, -1)[32:].sum()], 32) for b in blocks])
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("body", [
    "if (threadIdx.x < 32) __syncthreads(); out0[threadIdx.x] = in0[threadIdx.x];",
    "float v = in0[threadIdx.x]; if (threadIdx.x % 32 < 16) v = __shfl_xor_sync(0xffffffffu, v, 1); out0[threadIdx.x] = v;",
], ids=["block-barrier", "warp-shuffle"])
def test_a_divergent_barrier_fails_the_launch(body):
    """A barrier or shuffle that some threads skip can never complete: the launch fails at once
    with the reason (on a GPU it would hang or be undefined)."""
    from fusesearch.errors import FusesearchError

    with pytest.raises(FusesearchError, match="never reached by all its threads"):
        emulate.run(hand_kernel(body, grid=1), {"x": np.zeros(64, np.float32)})


def test_batched_matmul_with_prologue_and_epilogue(tmp_path):
    """[2,3,37,45] @ [3,45,70] (broadcast batch), GELU-free prologue (a scale), bias + ReLU +
    residual epilogue; 37 and 70 leave partial tiles, 45 a partial K step."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node("MatMul", ["xs", "w"], ["y"]),
             helper.make_node("Add", ["y", "b"], ["yb"]), helper.make_node("Relu", ["yb"], ["r"]),
             helper.make_node("Add", ["r", "res"], ["out"])]
    inits = [("s", np.float32(0.5)), ("w", rand(3, 45, 70)), ("b", rand(70, seed=1))]
    gk = one_group(tmp_path, nodes, [("x", [2, 3, 37, 45]), ("res", [2, 3, 37, 70])], [("out", None)], inits,
                   skeleton="tiled")
    assert gk.grid[2] == 6 and "__shared__ float As" in gk.cuda_source


def test_gemm_transposed_operands_alpha_beta(tmp_path):
    nodes = [helper.make_node("Gemm", ["a", "b", "c"], ["y"], transA=1, transB=1, alpha=0.5, beta=2.0),
             helper.make_node("Tanh", ["y"], ["out"])]
    inits = [("b", rand(50, 33)), ("c", rand(50, seed=2))]
    one_group(tmp_path, nodes, [("a", [33, 40])], [("out", None)], inits, skeleton="tiled")


def test_matmul_output_also_used_outside_and_reshaped(tmp_path):
    """The anchor output is itself a kernel output, and a view of it feeds the epilogue."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Reshape", ["y", "shape"], ["v"]),
             helper.make_node("Sigmoid", ["v"], ["g"]), helper.make_node("Neg", ["y"], ["ny"])]
    inits = [("w", rand(24, 64)), ("shape", np.array([5, 4, 64], dtype=np.int64))]
    one_group(tmp_path, nodes, [("x", [20, 24])], [("g", None), ("ny", None)], inits, skeleton="tiled")


def test_conv_bias_relu_residual(tmp_path):
    """3x3 stride-2 padded conv (implicit GEMM), bias, ReLU and a residual add in the epilogue."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["y"], ["r"]), helper.make_node("Add", ["r", "res"], ["out"])]
    inits = [("w", rand(24, 5, 3, 3)), ("b", rand(24, seed=3))]
    one_group(tmp_path, nodes, [("x", [2, 5, 11, 9]), ("res", [2, 24, 6, 5])], [("out", None)], inits,
              skeleton="tiled")


def test_depthwise_conv_with_prologue(tmp_path):
    """group == channels: one GEMM per group (grid z); the prologue (ReLU6 via Clip) is applied in
    the tile loads, under the zero padding."""
    nodes = [helper.make_node("Clip", ["x", "lo", "hi"], ["c"]),
             helper.make_node("Conv", ["c", "w"], ["y"], pads=[1, 1, 1, 1], group=8),
             helper.make_node("Mul", ["y", "k"], ["out"])]
    inits = [("lo", np.float32(0.0)), ("hi", np.float32(6.0)), ("w", rand(8, 1, 3, 3)), ("k", rand(8, 1, 1, seed=4))]
    gk = one_group(tmp_path, nodes, [("x", [1, 8, 7, 7])], [("out", None)], inits, skeleton="tiled")
    assert gk.grid[2] == 8


def test_prologue_value_also_an_output(tmp_path):
    """A prologue tensor used outside the group is written by a grid-stride loop of the same launch."""
    nodes = [helper.make_node("Relu", ["x"], ["rx"]), helper.make_node("MatMul", ["rx", "w"], ["y"]),
             helper.make_node("Add", ["rx", "one"], ["side"])]
    inits = [("w", rand(16, 16)), ("one", np.float32(1.0))]
    one_group(tmp_path, nodes, [("x", [40, 16])], [("y", None), ("side", None)], inits, skeleton="tiled")


def test_epilogue_transpose_falls_back_to_the_direct_kernel(tmp_path):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Transpose", ["y"], ["out"], perm=[1, 0])]
    one_group(tmp_path, nodes, [("x", [12, 8])], [("out", None)], [("w", rand(8, 10))], skeleton="direct")


def test_vectorized_pointwise_with_broadcast_and_mask(tmp_path):
    nodes = [helper.make_node("Add", ["x", "b"], ["a"]), helper.make_node("Sigmoid", ["a"], ["s"]),
             helper.make_node("Mul", ["a", "s"], ["m"]), helper.make_node("Mul", ["m", "y"], ["out"])]
    gk = one_group(tmp_path, nodes, [("x", [3, 4, 12]), ("y", [3, 4, 12])], [("out", None)],
                   [("b", rand(12))], skeleton="vectorized")
    assert "float4" in gk.cuda_source


def test_odd_sizes_stay_grid_stride(tmp_path):
    one_group(tmp_path, [helper.make_node("Exp", ["x"], ["out"])], [("x", [3, 5])], [("out", None)],
              skeleton="grid-stride")


def test_rowwise_softmax_and_layernorm_use_block_reductions(tmp_path):
    nodes = [helper.make_node("Add", ["x", "r"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "g", "b"], ["n"], axis=-1, epsilon=1e-5)]
    one_group(tmp_path, nodes, [("x", [6, 300]), ("r", [6, 300])], [("n", None)],
              [("g", rand(300)), ("b", rand(300, seed=5))], skeleton="block-per-row")
    nodes = [helper.make_node("Mul", ["x", "k"], ["s"]), helper.make_node("Softmax", ["s"], ["out"], axis=-1)]
    one_group(tmp_path / "b", nodes, [("x", [5, 70])], [("out", None)], [("k", np.float32(0.125))],
              skeleton="block-per-row")


def test_a_row_kernel_never_reads_another_rows_reduction(tmp_path):
    """BERT's pooler after the final LayerNorm: the Gather of the first token has 8 values, one
    per row only by number (8 rows of 8). The block-per-row kernel would write block r's value
    from row r's moments but token 0's elements; lowering refuses the group naming the Gather,
    and the LayerNorm without it runs emulated equal to ONNX Runtime."""
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["n"], axis=-1),
             helper.make_node("Gather", ["n", "zero"], ["y"], axis=1)]
    path = save(make_model(nodes, [("x", [1, 8, 8])], [("y", None), ("n", None)],
                           [("g", rand(8)), ("b", rand(8, seed=5)), ("zero", np.int64(0))]), tmp_path / "m.onnx")
    prep = prepare(path)
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    gather = next(n for n in prep.graph.nodes if n.op_type == "Gather")
    decision = choices(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))))
    assert not isinstance(decision, tuple) and f"{gather.name}(Gather)" in decision.reason, decision
    check(prep, values, [n.id for n in prep.graph.nodes if n is not gather], skeleton="block-per-row")


def test_gemm_with_softmax_epilogue(tmp_path):
    """Scores = Q·Kᵀ / 8 with a Softmax over the row: a rowwise kernel whose row values come from
    the dot products."""
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Div", ["s", "d"], ["sd"]),
             helper.make_node("Softmax", ["sd"], ["out"], axis=-1)]
    one_group(tmp_path, nodes, [("q", [2, 9, 16]), ("kt", [2, 16, 9])], [("out", None)], [("d", np.float32(8.0))])


@pytest.mark.parametrize("name,dims,count,tf32,gemm_skeleton", [
    ("bert-small", ["batch=1", "seq=16"], 40, True, "tiled"), ("resnet18", ["batch=1"], 4, False, "tiled")])
def test_zoo_groups_run_emulated(name, dims, count, tf32, gemm_skeleton):
    """The `count` cheapest distinct generated kernels of the cpsat plan (small dims), and the
    cheapest gemm/conv when none is among them, run emulated and match ONNX Runtime (emulation runs
    every CUDA thread on the host: resnet18's big convs take minutes, so CI takes the cheapest; all
    of them pass when run by hand with count=100); bert's fused GEMMs at 16 rows on CUDA cores (the
    skinny tile priced below a tensor-core tile there; its tensor-core kernels are checked below at
    more rows), resnet's convs with TF32 off on CUDA cores."""
    from fusesearch.api import plan as make_plan
    from fusesearch.ir.shapes import ShapeBindings

    prep = prepare(f"zoo:{name}", ShapeBindings.parse(dims=dims), tf32=tf32)
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    p = make_plan(f"zoo:{name}", device="h100-sxm", strategy="cpsat", prepared=prep)
    distinct = {}
    for g in p.groups:
        if g.kernel.impl == "library" or g.kernel.alias:
            continue
        gk = generate(prep.graph, g.kernel, name=f"g{g.id}")
        distinct.setdefault(gk.source_hash, (g.kernel.iteration_size * max(1, g.kernel.reduction_length), g))
    ranked = sorted(distinct.values(), key=lambda x: (x[0], x[1].id))
    chosen = ranked[:count]
    if not any(g.kernel.template in ("gemm", "conv") for _, g in chosen):  # and the cheapest tiled one
        chosen.append(next(x for x in ranked if x[1].kernel.template in ("gemm", "conv")))
    for _, g in chosen:
        check(prep, values, g.nodes)
    skeletons = {generate(prep.graph, g.kernel).skeleton for _, g in chosen}
    assert gemm_skeleton in skeletons, skeletons


# float32 text models whose GEMMs at the default batch (128 rows, hidden 128-256) price cheaper on
# CUDA cores than on TF32 tensor cores: planned at this batch, where the plan fuses onto them
TENSOR_CORE_BATCH = {"bert-small": 2, "llama-prefill": 2}
FAST_HALF = ("bert-small", "resnet18")  # float16 by default (a transformer and a conv net); the other models' under -m slow


@pytest.mark.parametrize("name,dtype", [pytest.param(name, "float32", marks=pytest.mark.slow if name in SCALED_TWINS else ())
                                        for name in ZOO] + [
    pytest.param(name, "float16", marks=() if name in FAST_HALF else pytest.mark.slow) for name in ZOO])
def test_every_zoo_model_tensor_core_kernels_run_emulated(tmp_path, name, dtype):
    """Every zoo model, float32 (TF32 tensor cores) and converted to float16 (FP16 tensor cores):
    its cpsat plan on the H100 has fused gemm/conv groups on tensor cores, and the cheapest
    distinct one of each template (gemm, conv) runs emulated, equal to ONNX Runtime within the
    tolerance of its operands' precision. The transformers are built with one layer (every layer's
    kernels are the same); the models' default dims (TENSOR_CORE_BATCH's batch where named)."""
    from fusesearch.api import plan as make_plan
    from fusesearch.ir.shapes import ShapeBindings
    from fusesearch.zoo import build_model

    entry = ZOO[name]
    sizes = {"layers": 1} if "layers" in entry.params() else {}
    if "kv_heads" in entry.params():  # the LLaMA-style decoders: at their CI default (hidden 64) every
        sizes.update(hidden=256, intermediate=512)  # product is cheaper on CUDA cores
    path = save(build_model(name, **sizes), tmp_path / f"{name}.onnx")
    batch = {"batch": TENSOR_CORE_BATCH[name]} if dtype == "float32" and name in TENSOR_CORE_BATCH else {}
    dims = ShapeBindings.parse(dims=[f"{k}={v}" for k, v in {**entry.default_dims, **batch}.items()])
    prep = prepare(str(path), dims, dtype=dtype)
    p = make_plan(str(path), device="h100-sxm", strategy="cpsat", prepared=prep, time_limit_s=20)
    cheapest = {}
    for g in sorted(p.groups, key=lambda g: (g.kernel.iteration_size * max(1, g.kernel.reduction_length), g.id)):
        if g.kernel.schedule.skeleton.startswith("mma") and not g.kernel.alias:
            cheapest.setdefault(g.kernel.template, g)
    assert cheapest, f"{name} {dtype}: no fused group on tensor cores"
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    want = "mma-tf32" if dtype == "float32" else "mma-f16"
    for g in cheapest.values():
        check(prep, values, g.nodes, skeleton=want)


# -- tensor cores ---------------------------------------------------------------------------------

def gelu(x: str, out: str) -> list:
    """GELU as exported (erf form): x * 0.5 * (1 + erf(x / sqrt 2))."""
    return [helper.make_node("Div", [x, "sqrt2"], [f"{out}_d"]), helper.make_node("Erf", [f"{out}_d"], [f"{out}_e"]),
            helper.make_node("Add", [f"{out}_e", "one"], [f"{out}_p"]), helper.make_node("Mul", [x, f"{out}_p"], [f"{out}_m"]),
            helper.make_node("Mul", [f"{out}_m", "half"], [out])]


GELU_CONSTANTS = [("sqrt2", np.float32(np.sqrt(2))), ("one", np.float32(1)), ("half", np.float32(0.5))]


def tf32(x: np.ndarray) -> np.ndarray:
    """Round float32 to TF32 as cvt.rna.tf32.f32 does: nearest, ties away, 10 mantissa bits."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


@pytest.mark.parametrize("tf32", [True, False])
def test_every_choice_of_a_fused_gemm_runs_emulated(tmp_path, tf32):
    """Each choice lowering lists for a fused GEMM + bias + ReLU (every tensor-core
    tile with TF32, wmma and mma.sync, split-K or not, every CUDA-core tile, partial tiles along M,
    N and K) is written as its
    schedule says and matches ONNX Runtime emulated: the search may pick any of them."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["q"]),
             helper.make_node("Relu", ["q"], ["y"])]
    path = save(make_model(nodes, [("x", [70, 45])], [("y", None)], [("w", rand(45, 130)), ("b", rand(130, seed=1))]),
                tmp_path / "m.onnx")
    prep = prepare(path, tf32=tf32)
    values = all_values(to_proto(prep.canonical), random_feeds(to_proto(prep.canonical), 0))
    group = range(len(prep.graph))
    options = choices(prep.graph, FusionGroup(frozenset(group)))
    assert {k.schedule.skeleton for k in options} == ({"mma-tf32", "mma-sync-tf32", "tiled"} if tf32 else {"tiled"})
    assert len({(k.schedule.skeleton, k.tile, k.schedule.warp, k.schedule.stages, k.schedule.split_k)
                for k in options}) == len(options) >= 4
    for kernel in options:
        check(prep, values, group, kernel.schedule.skeleton, kernel.schedule)


def test_mma_tf32_batched_matmul_rounds_operands_as_a_tensor_core(tmp_path):
    """Relu([2,3,37,45] @ [3,45,70]) (broadcast batch) on TF32 tensor cores, 37/70/45 partial tiles
    and K step: within the TF32 tolerance of ONNX Runtime, and within float32 accumulation error of the
    product of the TF32-rounded operands (so the emulator rounds as the hardware does)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Relu", ["p"], ["y"])]
    w = rand(3, 45, 70)
    path = save(make_model(nodes, [("x", [2, 3, 37, 45])], [("y", None)], [("w", w)]), tmp_path / "m.onnx")
    prep = prepare(path)
    kernel = lower(prep.graph, FusionGroup(frozenset({0, 1})))  # fused: a lone MatMul is a library call
    assert (kernel.schedule.skeleton, kernel.threads_per_block, kernel.schedule.stages) == ("mma-tf32", 128, 2)
    x = rand(2, 3, 37, 45, seed=3)
    gk = generate(prep.graph, kernel)
    assert "fs_cp_async4(" in gk.cuda_source and "__float_to_tf32" in gk.cuda_source
    y = emulate.run(gk, {"x": x, "w": w})["y"].astype(np.float64)
    exact = np.maximum(x.astype(np.float64) @ w.astype(np.float64), 0)
    rounded = np.maximum(tf32(x).astype(np.float64) @ tf32(w).astype(np.float64), 0)
    scale = np.abs(exact).max()
    assert np.abs(y - exact).max() <= TOLERANCE["mma-tf32"] * scale
    assert np.abs(y - rounded).max() <= 1e-5 * scale < np.abs(exact - rounded).max()


def test_mma_gemm_transb_bias_relu(tmp_path):
    """Gemm with transB (B staged column-major), bias and ReLU epilogue on the accumulators."""
    nodes = [helper.make_node("Gemm", ["a", "b", "c"], ["y"], transB=1), helper.make_node("Relu", ["y"], ["out"])]
    inits = [("b", rand(50, 40)), ("c", rand(50, seed=2))]
    gk = one_group(tmp_path, nodes, [("a", [33, 40])], [("out", None)], inits, skeleton="mma-tf32", tf32=True)
    assert "nvcuda::wmma::col_major> b" in gk.cuda_source


def test_mma_conv3x3_relu_implicit_gemm(tmp_path):
    """3x3 padded stride-1 conv with bias and ReLU: implicit GEMM on TF32 tensor cores (A gathered
    with its zero padding, B = the filters column-major by cp.async)."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["y"], ["out"])]
    inits = [("w", rand(20, 6, 3, 3)), ("b", rand(20, seed=4))]
    one_group(tmp_path, nodes, [("x", [2, 6, 9, 7])], [("out", None)], inits, skeleton="mma-tf32", tf32=True)


def test_mma_gelu_prologue_single_stage(tmp_path):
    """GELU before the MatMul (applied while A is staged) and GELU on the weights too: neither
    operand is a plain copy, so lowering stages once (no double buffer) and no cp.async is issued."""
    nodes = [*gelu("x", "gx"), *gelu("w", "gw"), helper.make_node("MatMul", ["gx", "gw"], ["out"])]
    gk = one_group(tmp_path, nodes, [("x", [19, 33]), ("w", [33, 21])], [("out", None)], GELU_CONSTANTS,
                   skeleton="mma-tf32", tf32=True)
    assert "fs_cp_async4(&" not in gk.cuda_source and "multiply(0);" in gk.cuda_source


@pytest.mark.parametrize("skeleton", ["mma-tf32", "mma-f16", "mma-bf16"])
def test_mma_64x64_tile_several_k_steps(tmp_path, skeleton):
    """A 64x64 block tile (2x2 fragments per warp), K = 100 (four K steps, double-buffered, a
    partial last one), M and N not multiples of the tile, GELU prologue on A; FP16 and BF16 convert
    the float32 operands while staging them."""
    from fusesearch.schedule import mma

    nodes = [*gelu("x", "gx"), helper.make_node("MatMul", ["gx", "w"], ["y"]),
             helper.make_node("Add", ["y", "bias"], ["out"])]
    inits = [("w", rand(100, 70)), ("bias", rand(70, seed=6)), *GELU_CONSTANTS]
    one_group(tmp_path, nodes, [("x", [67, 100])], [("out", None)], inits, skeleton=skeleton, tf32=True,
              schedule=mma(skeleton, (64, 64, 32), 2, (2, 2, 1)))


@pytest.mark.parametrize("dtype,skeleton", [("float16", "mma-f16"), ("bfloat16", "mma-bf16")])
def test_mma_half_model_gemm_bias_relu(tmp_path, dtype, skeleton):
    """The model converted to half (`--dtype`): the fused Gemm + bias + ReLU reads half operands,
    multiplies them on FP16/BF16 tensor cores with float accumulation and stores half, equal to
    ONNX Runtime's half model within the tolerance of the operands' precision."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["yb"]),
             helper.make_node("Relu", ["yb"], ["out"])]
    path = save(make_model(nodes, [("x", [37, 45])], [("out", None)], [("w", rand(45, 70)), ("b", rand(70, seed=1))]),
                tmp_path / "m.onnx")
    prep = prepare(path, dtype=dtype)
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    gk = check(prep, values, range(len(prep.graph)), skeleton)
    assert {a.dtype for a in (*gk.inputs, *gk.outputs)} == {dtype}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "native float16"])
def test_half_models_cuda_program_compiles_as_cpp_and_equals_onnx_runtime(tmp_path, run_cli, dtype):
    """The CUDA program of a half model is one module of namespaced kernels whose launchers cast
    to the kernels' own storage types: it compiles as C++ (the emulator) and equals ONNX Runtime
    within the dtype's tolerance, whether the model was converted (`--dtype`) or is half itself."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"), helper.make_node("Add", ["y", "b"], ["yb"], name="add"),
             helper.make_node("Relu", ["yb"], ["r"], name="relu"), helper.make_node("Tanh", ["r"], ["out"], name="tanh")]
    half = dtype == "native float16"
    cast = (lambda a: a.astype(np.float16)) if half else (lambda a: a)
    elem = 10 if half else 1  # TensorProto.FLOAT16 / FLOAT
    path = save(make_model(nodes, [("x", [8, 16], elem)], [("out", [8, 32], elem)],
                           [("w", cast(rand(16, 32) * 0.3)), ("b", cast(rand(32, seed=1)))]), tmp_path / "m.onnx")
    flags = () if half else ("--dtype", dtype)
    code, out, err = run_cli("run", path, "--device", "t4", "--strategy", "greedy", "--backend", "emulate", *flags)
    assert code == 0 and "equal to ONNX Runtime" in out, err
    assert f"rtol {0.05 if dtype == 'bfloat16' else 0.01:g}" in out, out
