"""CPU kernels beside ONNX Runtime, timed in the same run (figures printed, never asserted).

1. Lone GEMM and conv at zoo shapes: our generated kernel vs ONNX Runtime's MatMul / Conv (MLAS),
   both on one thread. Target: >= 0.8x ONNX Runtime's throughput (geometric mean), none < 0.5x.
2. Pointwise and rowwise groups over >= 1 MiB (here beyond the last-level cache, so DRAM-bound):
   achieved bandwidth (bytes in + out / time) as a share of the memory bandwidth of a 128 MiB copy
   timed interleaved with each group (the shared host's bandwidth drifts between minutes, so a
   copy timed once before would set the bar at another moment): the faster of numpy's copy and a
   generated one whose stores stream as our large outputs' do (numpy's reads each line before it
   writes it, a cost our kernels do not pay, so it alone would set the bar too low). Target: >= 60%.
3. Fused anchor groups of zoo plans (cpsat on host): fused kernel vs library anchor + the rest as
   separate kernels (measure's `fused_loses`). Target: fused wins in >= 90% of groups. The groups
   lost by less than TIE (2%, within a shared core's swing between rounds) are counted apart.
4. Whole plans (cpsat on host): measured plan vs unfused (targets 1.3x bert-small, 1.1x
   resnet18), `--plan-runs` times each (every speedup and their median), and the sum of kernel
   times beside ONNX Runtime's whole-model time (ENABLE_ALL, one thread; target within 1.5x).
   Beside them two limits on the speedup: the ceiling (the unfused graph's GEMMs and convs at
   the library's measured speed, everything else free) and the bound (their FLOPs at this core's
   FMA peak, everything else free; the peak is the best of the FMA probe's readings taken beside
   each run, since a reading taken while a neighbour shares the core is low), the same for the
   micro-kernel's loop alone (its loads and FMAs from L1: what a product's main loop can reach
   here), what the target leaves beside the bound's time for all the rest, and where the
   plan's time goes: its product groups (products with their fused prologues and epilogues, and
   the rate they run the products' FLOPs at) against its other kernels.
5. Threads: a conv, a GEMM and a row kernel with 1 and 2 OpenMP threads (faster with 2, equal).
1b. The GEMM main loop: our own packed, register-blocked micro-kernel (the C prelude's
   fs_gemm_rows / fs_gemm_packed, weights packed once) against the BLAS the backend calls per
   block, and generated convs as generated (taps from the band, filters packed, a 1x1's pixels
   packed for the filters in place) against im2col through the BLAS, to decide which the
   generated code uses where.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_cpu.py [--sections 1,1b,2,3,4,5] [--repeats 5]
        [--budget 0.2] [--models bert-small,resnet18] [--plan-runs 3]
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from costmodels.probes import c_program_output, measure_fma_peak
from fusesearch.backends import cpu
from fusesearch.backends.codegen import generate
from fusesearch.backends.library import host_binding, null_runs, run_costs
from fusesearch.backends.timing import measure, measure_interleaved
from fusesearch.groups import FusionGroup
from fusesearch.lowering import choices, lower
from fusesearch.pipeline import prepare

RNG = np.random.default_rng(0)
# section 3: a fused group slower than library + rest by at most this fraction lost within what
# one shared core's speed swings between interleaved rounds (printed apart, still counted as lost)
TIE = 0.02

# (label, M, K, N, batch, transposed B): bert-small's and bert-base's projections and FFN (bert-small's
# decide its plan's section-4 ratio: both graphs run them, the unfused one through the library),
# attention score and context
GEMMS = [("bert-small qkv/out 128x128x128", 128, 128, 128, 1, False),
         ("bert-small ffn-up 128x128x512", 128, 128, 512, 1, False),
         ("bert-small ffn-down 128x512x128", 128, 512, 128, 1, False),
         ("bert-base qkv/out 128x768x768", 128, 768, 768, 1, False),
         ("bert-base ffn-up 128x768x3072", 128, 768, 3072, 1, False),
         ("bert-base ffn-down 128x3072x768", 128, 3072, 768, 1, False),
         ("attention score 12x128x64x128 (B^T)", 128, 64, 128, 12, True),
         ("attention context 12x128x128x64", 128, 128, 64, 12, False)]
# (label, C_in, H, C_out, kernel, stride, group): resnet50 stages, a mobilenetv2 depthwise conv
CONVS = [("resnet50 1x1 64->256 @56", 64, 56, 256, 1, 1, 1),
         ("resnet50 3x3 64->64 @56", 64, 56, 64, 3, 1, 1),
         ("resnet50 1x1 128->512 @28", 128, 28, 512, 1, 1, 1),
         ("resnet50 3x3 128->128 @28", 128, 28, 128, 3, 1, 1),
         ("resnet50 1x1 256->1024 @14", 256, 14, 1024, 1, 1, 1),
         ("resnet50 3x3 256->256 @14", 256, 14, 256, 3, 1, 1),
         ("resnet50 1x1 512->2048 @7", 512, 7, 2048, 1, 1, 1),
         ("resnet50 3x3 512->512 @7", 512, 7, 512, 3, 1, 1),
         ("mobilenetv2 depthwise 3x3 144 @56", 144, 56, 144, 3, 1, 144),
         ("mobilenetv2 1x1 24->144 @56", 24, 56, 144, 1, 1, 1)]
# (label, C_in, H, C_out, kernel, stride): 1b's convs with filters packed once or through the BLAS
PACK_CONVS = [("resnet 3x3 64->64 @56", 64, 56, 64, 3, 1),
              ("resnet 3x3 128->128 @28", 128, 28, 128, 3, 1),
              ("resnet 3x3 256->256 @14", 256, 14, 256, 3, 1),
              ("resnet50 1x1 64->256 @56", 64, 56, 256, 1, 1),
              ("resnet50 1x1 512->128 @28", 512, 28, 128, 1, 1),
              ("resnet50 1x1 256->1024 @14", 256, 14, 1024, 1, 1),
              ("resnet50 1x1 1024->256 @14", 1024, 14, 256, 1, 1),
              ("vit patch 16x16/16 3->384 @224", 3, 224, 384, 16, 16),
              ("resnet 3x3 256->512 /2 @14", 256, 14, 512, 3, 2),
              ("resnet 3x3 512->512 @7", 512, 7, 512, 3, 1),
              ("resnet50 1x1 512->2048 @7", 512, 7, 2048, 1, 1),
              ("resnet50 1x1 2048->512 @7", 2048, 7, 512, 1, 1)]


def ort_session(model: onnx.ModelProto, level: str = "all"):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if level == "all"
                                     else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
             "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


def ort_call(sess, feeds: dict) -> tuple[object, dict]:
    """(a run of `sess` on `feeds` through IO binding into outputs allocated once, the outputs):
    no output allocation or conversion per call, as inside a whole-model run."""
    outs = {o.name: np.empty(o.shape, ORT_TYPES[o.type]) for o in sess.get_outputs()}
    run = host_binding(sess, [(i.name, feeds[i.name]) for i in sess.get_inputs()], list(outs.items()))
    return run, outs


def _model(nodes, inputs, outputs, inits) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "bench", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def _ours_vs_ort(model: onnx.ModelProto, feeds: dict, budget: float, repeats: int) -> tuple[float, float, float]:
    """(our median s, ORT median s, max abs err): the whole model as one generated kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.onnx"
        onnx.save(model, str(path))
        prep = prepare(str(path))
    g = prep.graph
    kernel = generate(g, lower(g, FusionGroup(frozenset(range(len(g))))))  # the whole graph, one kernel
    values = {**feeds, **{t.name: numpy_helper.to_array(t) for t in model.graph.initializer}}
    ours = cpu.runner(kernel, {a.tensor: values[a.tensor] for a in kernel.inputs})
    theirs, outs = ort_call(ort_session(model), feeds)
    ours()
    theirs()
    err = float(np.max(np.abs(ours.buffers[-1] - next(iter(outs.values())))))
    runs = [ours, theirs, *null_runs(int(os.environ.get("OMP_NUM_THREADS", "1")))]  # ONNX Runtime's fixed Run cost
    timed = [[t.median_s for t in measure_interleaved(runs, budget_s=budget)] for _ in range(repeats)]
    ort = [t[1] - run_costs(t[2], t[3])[0] for t in timed]
    return statistics.median(t[0] for t in timed), statistics.median(ort), err


def section_anchors(budget: float, repeats: int) -> None:
    print("1. lone GEMM / conv, generated kernel vs ONNX Runtime (MLAS), one thread, medians of", repeats)
    ratios = []
    for label, m, k, n, batch, trans in GEMMS:
        a_shape = (batch, m, k) if batch > 1 else (m, k)
        b_shape = ((batch, n, k) if trans else (batch, k, n)) if batch > 1 else (k, n)
        nodes, inits = [], []
        if trans:  # the score product: B arrives as (batch, n, k) and is transposed by the MatMul's input
            nodes.append(helper.make_node("Transpose", ["bt"], ["b"], perm=[0, 2, 1]))
        nodes.append(helper.make_node("MatMul", ["a", "b"], ["y"]))
        y_shape = (batch, m, n) if batch > 1 else (m, n)
        inputs = [_vi("a", a_shape)] + ([_vi("bt", b_shape)] if trans else [])
        feeds = {"a": RNG.standard_normal(a_shape).astype(np.float32)}
        if trans:
            feeds["bt"] = RNG.standard_normal(b_shape).astype(np.float32)
        else:
            inits.append(numpy_helper.from_array(RNG.standard_normal(b_shape).astype(np.float32), "b"))
        model = _model(nodes[-1:] if not trans else nodes, inputs, [_vi("y", y_shape)], inits)
        ours, ort, err = _ours_vs_ort(model, feeds, budget, repeats)
        ratios.append(_line(label, 2.0 * batch * m * n * k, ours, ort, err))
    for label, cin, h, cout, kk, stride, group in CONVS:
        w = RNG.standard_normal((cout, cin // group, kk, kk)).astype(np.float32) * 0.1
        pad = kk // 2
        ho = (h + 2 * pad - kk) // stride + 1
        node = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[kk, kk], strides=[stride, stride],
                                pads=[pad] * 4, group=group)
        model = _model([node], [_vi("x", (1, cin, h, h))], [_vi("y", (1, cout, ho, ho))],
                       [numpy_helper.from_array(w, "w")])
        feeds = {"x": RNG.standard_normal((1, cin, h, h)).astype(np.float32)}
        ours, ort, err = _ours_vs_ort(model, feeds, budget, repeats)
        ratios.append(_line(label, 2.0 * cout * ho * ho * (cin // group) * kk * kk, ours, ort, err))
    geo = math.exp(statistics.fmean(math.log(r) for r in ratios))
    print(f"   geometric mean {geo:.2f}x of ONNX Runtime's throughput (target >= 0.8x), lowest {min(ratios):.2f}x "
          f"(target >= 0.5x)")


def section_micro_kernel(budget: float, repeats: int) -> None:
    """1b. Our own packed 6x16 micro-kernel (the C prelude's `fs_gemm_packed`, B packed once by
    `fs_pack_b` before timing, as a constant weight is) against the BLAS the CPU backend calls per
    block (scipy-openblas32, which packs B inside every call), same shapes, same call path
    (ctypes); then generated convs with their filters packed once against the same convs through
    the BLAS (schedule.PACK_FILTER_FLOATS, the threshold this decides), timed interleaved."""
    import ctypes

    from fusesearch.backends.codegen import c_gemm, c_runtime

    flags = cpu.blas_flags()
    if not flags:
        print("1b. skipped: no BLAS to compare with (pip install scipy-openblas32)")
        return
    driver = (c_runtime.C_RUNTIME
              + "void own_pack_b(int K, int N, const float* B, float* Bp) { fs_pack_b(K, N, B, N, 1, Bp); }\n"
              "void own_rows(int M, int N, int K, const float* A, const float* Bp, float* C) "
              "{ fs_gemm_rows(M, N, K, A, K, Bp, C, N, 0, 0, 0); }\n"
              "void own_packed(int M, int N, int K, const float* A, const float* Bp, float* C) "
              "{ fs_gemm_packed(M, N, K, A, K, 1, Bp, C, M); }\n"
              "void blas_sgemm(int M, int N, int K, const float* A, const float* B, float* C) "
              "{ FS_BLAS_SGEMM(101, 111, 111, M, N, K, 1.0f, A, K, B, N, 0.0f, C, N); }\n")
    with tempfile.TemporaryDirectory() as tmp:
        src, so = Path(tmp) / "own_sgemm.c", Path(tmp) / "own_sgemm.so"
        src.write_text(driver)
        subprocess.run([cpu.compiler(), *cpu.CFLAGS[:-1], str(src), "-o", str(so), *cpu.link_flags(), "-lm"], check=True)
        lib = ctypes.CDLL(str(so))
    ptr = ctypes.c_void_p
    print("1b. GEMM main loop, one thread, interleaved, medians of", repeats, "rounds: our micro-kernel over B packed once,")
    print("    A read by rows and C stored in place (`fs_gemm_rows`: MatMul/Gemm with a constant B) or A packed and")
    print("    C stored transposed (`fs_gemm_packed`: a conv's pixels x filters), vs the BLAS (packs B in every call)")
    cases = []
    # the last-stage resnet conv as pixels x taps x filters: the filters (9 MiB) are the constant operand
    for label, m, k, n in [(g[0], g[1], g[2], g[3]) for g in GEMMS if g[4] == 1] + [("bert-small qkv 128x128x128", 128, 128, 128),
                                                                                      ("bert-small q|k|v as one 128x128x384", 128, 128, 384),
                                                                                      ("bert-small ffn-up 128x128x512", 128, 128, 512),
                                                                                      ("bert-small ffn-down 128x512x128", 128, 512, 128),
                                                                                      ("vit-small qkv 197x384x384", 197, 384, 384),
                                                                                      ("vit-small ffn-up 197x384x1536", 197, 384, 1536),
                                                                                      ("resnet 3x3 512 @7 49x4608x512", 49, 4608, 512),
                                                                                      ("odd 37x45x70", 37, 45, 70)]:
        a = RNG.standard_normal((m, k)).astype(np.float32)
        b = RNG.standard_normal((k, n)).astype(np.float32)
        bp = np.zeros(-(-n // c_gemm.FS_NR) * c_gemm.FS_NR * k, np.float32)
        lib.own_pack_b(k, n, b.ctypes.data_as(ptr), bp.ctypes.data_as(ptr))
        outs = [np.zeros((m, n), np.float32), np.zeros((n, m), np.float32), np.zeros((m, n), np.float32)]
        # the arguments converted once: a ctypes conversion per call costs microseconds, a tenth of a small product
        arguments = [(f, (m, n, k, a.ctypes.data_as(ptr), x.ctypes.data_as(ptr), c.ctypes.data_as(ptr)))
                     for f, x, c in ((lib.own_rows, bp, outs[0]), (lib.own_packed, bp, outs[1]), (lib.blas_sgemm, b, outs[2]))]
        calls = [functools.partial(f, *args) for f, args in arguments]
        for call in calls:
            call()
        ref = a.astype(np.float64) @ b.astype(np.float64)
        err = max(float(np.max(np.abs(c - ref)) / np.max(np.abs(ref))) for c in (outs[0], outs[1].T, outs[2]))
        cases.append((label, 2.0 * m * n * k, calls, err))
    times = measure_interleaved([c for _, _, calls, _ in cases for c in calls], budget_s=budget * repeats, rounds=repeats)
    ratios = []
    for i, (label, flops, _, err) in enumerate(cases):
        rows, packed, blas = (times[3 * i + j].median_s for j in range(3))
        ratios.append(blas / rows)
        print(f"   {label:38s} rows {flops / rows / 1e9:6.1f}  packed {flops / packed / 1e9:6.1f}  BLAS {flops / blas / 1e9:6.1f} "
              f"GFLOP/s   rows {blas / rows:5.2f}x the BLAS   max rel err {err:.1e}")
    geo = math.exp(statistics.fmean(math.log(r) for r in ratios))
    print(f"   geometric mean: fs_gemm_rows at {geo:.2f}x the BLAS's throughput")
    print("   generated Conv+Relu as generated (k x k: taps read from the band, `fs_conv_band`; 1x1: pixels packed for the "
          "filters in place, `fs_conv_1x1` (rows), filters packed once, `fs_gemm_packed`, or the BLAS) vs im2col through the "
          "BLAS, interleaved:")
    pairs = []
    for label, cin, h, cout, kk, stride in PACK_CONVS:
        pad = kk // 2 if kk < stride * 2 else 0  # "same" for 1x1 and 3x3, none for a patch embedding
        ho = (h + 2 * pad - kk) // stride + 1
        nodes = [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[kk, kk], strides=[stride] * 2, pads=[pad] * 4),
                 helper.make_node("Relu", ["y"], ["out"])]
        w = RNG.standard_normal((cout, cin, kk, kk)).astype(np.float32) * 0.1
        model = _model(nodes, [_vi("x", (1, cin, h, h))], [_vi("out", (1, cout, ho, ho))], [numpy_helper.from_array(w, "w")])
        with tempfile.TemporaryDirectory() as tmp:
            onnx.save(model, str(Path(tmp) / "m.onnx"))
            g = prepare(str(Path(tmp) / "m.onnx")).graph
        options = choices(g, FusionGroup(frozenset(range(len(g)))), host=True)  # the default first
        chosen = options[0].schedule.product
        kernel = generate(g, options[0])
        im2col = generate(g, next(k for k in options if k.schedule.product == "im2col"))
        x = RNG.standard_normal((1, cin, h, h)).astype(np.float32)
        pairs.append((label, 2.0 * cout * ho * ho * cin * kk * kk, [cpu.runner(k, {"x": x, "w": w}) for k in (kernel, im2col)],
                      chosen))
    times = measure_interleaved([r for _, _, runs, _ in pairs for r in runs], budget_s=budget * repeats, rounds=repeats)
    for i, (label, flops, runs, chosen) in enumerate(pairs):
        ours, blas = times[2 * i].median_s, times[2 * i + 1].median_s
        same = np.allclose(runs[0].buffers[-1], runs[1].buffers[-1], rtol=1e-4, atol=1e-4)
        print(f"   {label:38s} generated ({chosen:6s}) {flops / ours / 1e9:6.1f} GFLOP/s   im2col + BLAS {flops / blas / 1e9:6.1f} "
              f"GFLOP/s   {blas / ours:5.2f}x   outputs equal: {same}")
    # how the generated GEMM splits a product into BLAS calls (cpu_gemm.BLAS_TILE_FLOATS): each
    # call packs all of B, so a short last block costs a whole packing
    m, k, n = 128, 768, 2304
    a, b = RNG.standard_normal((m, k)).astype(np.float32), RNG.standard_normal((k, n)).astype(np.float32)
    c = np.zeros((m, n), np.float32)
    print(f"   one {m}x{n}x{k} product (gpt2's QKV) as BLAS calls over row blocks:")
    for rows in ((128,), (64, 64), (113, 15)):
        def split(rows=rows) -> None:
            m0 = 0
            for r in rows:
                lib.blas_sgemm(r, n, k, ptr(a.ctypes.data + 4 * m0 * k), b.ctypes.data_as(ptr), ptr(c.ctypes.data + 4 * m0 * n))
                m0 += r
        t = statistics.median(measure(split, budget_s=budget).median_s for _ in range(repeats))
        print(f"   {' + '.join(map(str, rows)):10s} rows  {2.0 * m * n * k / t / 1e9:6.1f} GFLOP/s")


def _line(label, flops, ours, ort, err) -> float:
    ratio = ort / ours
    print(f"   {label:38s} ours {ours * 1e3:8.3f} ms {flops / ours / 1e9:6.1f} GFLOP/s   ONNX Runtime {ort * 1e3:8.3f} ms "
          f"{flops / ort / 1e9:6.1f} GFLOP/s   {ratio:5.2f}x   max abs err {err:.1e}")
    return ratio


def _group(nodes, inputs, outputs, inits=()) -> tuple[object, dict]:
    """(generated kernel of the whole graph as one group, its input values)."""
    model = _model(nodes, [_vi(n, sh) for n, sh in inputs], [_vi(n, sh) for n, sh in outputs],
                   [numpy_helper.from_array(np.asarray(v, np.float32), n) for n, v in inits])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.onnx"
        onnx.save(model, str(path))
        prep = prepare(str(path))
    g = prep.graph
    kernel = generate(g, lower(g, FusionGroup(frozenset(range(len(g))))))
    values = {n: RNG.standard_normal(sh).astype(np.float32) for n, sh in inputs}
    values.update({n: np.asarray(v, np.float32) for n, v in inits})
    return kernel, {a.tensor: values[a.tensor] for a in kernel.inputs}, model


def section_bandwidth(budget: float, repeats: int) -> None:
    from costmodels import host_cpu

    src = np.ones(1 << 25, np.float32)  # 128 MiB, far beyond the last-level cache
    dst = np.empty_like(src)

    def copy() -> None:
        np.copyto(dst, src)

    # the same 128 MiB copied as our kernels write a large output: a generated Relu, its stores
    # streamed (`fs_stream`: no read of each line before it is written, which numpy's copy pays)
    relu, relu_feeds, _ = _group([helper.make_node("Relu", ["x"], ["y"])], [("x", src.shape)], [("y", src.shape)])
    streamed = cpu.runner(relu, relu_feeds)
    print(f"2. pointwise / rowwise groups beyond the last-level cache: bytes read + written / time vs the memory "
          f"bandwidth of a 128 MiB copy timed interleaved with each group, the faster of numpy's copy and a "
          f"generated one with streaming stores (this shared host's bandwidth drifts by a third over minutes; the "
          f"cost model's host figure: {host_cpu().dram_bytes_per_s / 1e9:.1f} GB/s); ONNX Runtime ENABLE_ALL on "
          f"the same graph beside it; medians over {repeats} interleaved rounds")
    half = np.float32(0.5)
    cases = {
        "residual Add+Relu 8x256x56x56": ([helper.make_node("Add", ["x", "r"], ["a"]), helper.make_node("Relu", ["a"], ["y"])],
                                        [("x", (8, 256, 56, 56)), ("r", (8, 256, 56, 56))], [("y", (8, 256, 56, 56))], []),
        "GELU (erf) 4096x3072": ([helper.make_node("Mul", ["x", "rs2"], ["a"]), helper.make_node("Erf", ["a"], ["e"]),
                                 helper.make_node("Add", ["e", "one"], ["b"]), helper.make_node("Mul", ["x", "b"], ["c"]),
                                 helper.make_node("Mul", ["c", "half"], ["y"])],
                                [("x", (4096, 3072))], [("y", (4096, 3072))],
                                [("rs2", np.float32(0.70710678)), ("one", np.float32(1.0)), ("half", half)]),
        "Add+LayerNorm 8192x768": ([helper.make_node("Add", ["x", "r"], ["a"]),
                                   helper.make_node("LayerNormalization", ["a", "g", "b"], ["y"], axis=-1, epsilon=1e-12)],
                                  [("x", (8192, 768)), ("r", (8192, 768))], [("y", (8192, 768))],
                                  [("g", RNG.standard_normal(768)), ("b", RNG.standard_normal(768))]),
        "scale+mask+Softmax 32x12x128x128": ([helper.make_node("Mul", ["x", "s"], ["a"]), helper.make_node("Add", ["a", "m"], ["b"]),
                                           helper.make_node("Softmax", ["b"], ["y"], axis=-1)],
                                          [("x", (32, 12, 128, 128)), ("m", (32, 1, 1, 128))], [("y", (32, 12, 128, 128))],
                                          [("s", np.float32(0.125))]),
        # resnet's stem pool, generated vs ONNX Runtime's MaxPool (its 3.1 MiB input may sit in a large
        # last-level cache, so it can run above the DRAM figure)
        "stem MaxPool 3x3/2 1x64x112x112": ([helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3],
                                                               strides=[2, 2], pads=[1, 1, 1, 1])],
                                            [("x", (1, 64, 112, 112))], [("y", (1, 64, 56, 56))], []),
    }
    for label, (nodes, inputs, outputs, inits) in cases.items():
        kernel, feeds, model = _group(nodes, inputs, outputs, inits)
        run = cpu.runner(kernel, feeds)
        nbytes = sum(v.nbytes for v in feeds.values()) + sum(a.size * 4 for a in kernel.outputs)
        ort, outs = ort_call(ort_session(model), feeds)
        run()
        ort()
        err = float(np.max(np.abs(run.buffers[-1] - next(iter(outs.values())))))
        copy_s, stream_s, mine, theirs = (t.median_s for t in measure_interleaved(
            [copy, streamed, run, ort], budget_s=budget * repeats, rounds=repeats))
        bw = 2 * src.nbytes / min(copy_s, stream_s) / 1e9
        print(f"   {label:32s} {nbytes / 2**20:6.1f} MiB  ours {mine * 1e3:7.3f} ms {nbytes / mine / 1e9:6.1f} GB/s "
              f"({nbytes / mine / 1e9 / bw:4.0%} of the copy's {bw:4.1f} GB/s; numpy {2 * src.nbytes / copy_s / 1e9:4.1f}, "
              f"streamed {2 * src.nbytes / stream_s / 1e9:4.1f})   ONNX Runtime {theirs * 1e3:7.3f} ms "
              f"({theirs / mine:4.2f}x ours)   max abs err {err:.1e}")


# section 4's targets (issue 14): the measured plan over the unfused graph
TARGETS = {"bert-small": 1.3, "resnet18": 1.1}
LIMITS_SHARE = 0.25  # section 4 quotes a ceiling and a bound where the products take this much of the unfused time


def fma_reading() -> float:
    """One fresh reading of the FMA probe in flop/s (`measure_fma_peak` keeps its first reading for
    the process, as the cost model wants; a bound read beside each run wants each run's)."""
    return measure_fma_peak.__wrapped__()[0]


# The loop our micro-kernel runs (`fs_micro_x2` with AVX-512: per k, two vector loads of B, twelve
# broadcasts of A and 24 FMAs; `fs_micro` with AVX2: two loads, six broadcasts, twelve FMAs), its
# operands in L1 and its accumulators independent: what a product's main loop can reach on this
# core, below the FMA probe's peak by what the loads cost.
_TILE_LOOP = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#if defined(__AVX512F__)
#define ROWS 12
typedef __m512 vec;
#define LOAD _mm512_loadu_ps
#define BCAST _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define ZERO _mm512_setzero_ps
#define LANES 16
#elif defined(__AVX2__) && defined(__FMA__)
#define ROWS 6
typedef __m256 vec;
#define LOAD _mm256_loadu_ps
#define BCAST _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define ZERO _mm256_setzero_ps
#define LANES 8
#endif
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char** argv) {
#if defined(LANES)
    long steps = atol(argv[1]);
    static float buf[2 * LANES + ROWS] __attribute__((aligned(64)));
    for (int i = 0; i < 2 * LANES + ROWS; ++i) buf[i] = 1.0f / (float)(argc + i);
    vec x[ROWS], y[ROWS];
    for (int i = 0; i < ROWS; ++i) x[i] = y[i] = ZERO();
    double best = 1e30;
    for (int pass = 0; pass < 5; ++pass) {
        double t0 = now();
        for (long k = 0; k < steps; ++k) {
            const float* p = buf;
            __asm__("" : "+r"(p));
            vec u = LOAD(p), v = LOAD(p + LANES);
#pragma GCC unroll 16
            for (int i = 0; i < ROWS; ++i) {
                vec s = BCAST(p[2 * LANES + i]);
                x[i] = FMA(s, u, x[i]);
                y[i] = FMA(s, v, y[i]);
            }
        }
        double t = now() - t0;
        if (t < best) best = t;
    }
    float sum = 0.0f;
    for (int i = 0; i < ROWS; ++i) { float* a = (float*)&x[i]; float* b = (float*)&y[i]; sum += a[0] + b[LANES - 1]; }
    printf("%.6e %g\n", 4.0 * ROWS * LANES * (double)steps / best, (double)sum);
#else
    printf("0 0\n");
#endif
    return 0;
}
"""


def tile_loop_reading(steps: int = 2_000_000) -> float:
    """One reading of `_TILE_LOOP` in flop/s (0 where the core has neither AVX-512 nor AVX2 + FMA,
    or no C compiler builds it)."""
    out = c_program_output(_TILE_LOOP, ["-O2", "-march=native"], [steps])
    return float(out.split()[0]) if out else 0.0


def section_plans(models: list[str], budget: float, sections: set[str], runs: int = 1) -> None:
    """Sections 3 and 4 from one `measure` run per model (cpsat on host, lone anchors through the
    library), with ONNX Runtime's whole-model time in the same run; section 4 then measures the
    plan against the unfused graph `runs` - 1 more times and prints every run's speedup and their
    median (one run's ratio moves by several percent with what the shared host does meanwhile)."""
    from fusesearch.api import plan as make_plan
    from fusesearch.ir.canonicalize import to_proto
    from fusesearch.measure import measure_plan
    from fusesearch.verify import random_feeds

    wins = total = far = close = 0
    losers: list[str] = []
    for name in models:
        prep = prepare(f"zoo:{name}")
        p = make_plan(f"zoo:{name}", device="host", strategy="cpsat", prepared=prep)
        none = make_plan(f"zoo:{name}", device="host", strategy="none", prepared=prep,
                         lone_anchors="library")  # the unfused graph as ONNX Runtime runs it
        report = measure_plan(prep, p, none, "cpu", budget_s=budget)
        t = report.totals()
        versus = {g: v for g, v in report.library_comparison().items() if v["fused_loses"] is not None}
        lost = sorted(g for g, v in versus.items() if v["fused_loses"])
        ratio = {g: v["measured_s"] / v["library_baseline_s"] for g, v in versus.items()}
        losers += [f"{name} g{m.group} {_anchor_label(prep.graph, m.anchor)} "  # its anchor, shapes, ops, ratio
                   f"{'+'.join(prep.graph.nodes[i].op_type for i in m.nodes)}: {ratio[m.group]:.2f}"
                   for m in report.plan if m.group in lost]
        by_far = sorted(g for g, r in ratio.items() if r > 1.1)
        near = sum(1 for g in lost if ratio[g] <= 1 + TIE)  # lost by less than the machine's noise
        wins += len(versus) - len(lost)
        total += len(versus)
        far += len(by_far)
        close += near
        canonical = to_proto(prep.canonical)
        feeds = random_feeds(canonical, 0)
        ort, _ = ort_call(ort_session(canonical), feeds)
        ort_s = measure(ort, budget_s=max(budget * 5, 1.0)).median_s
        if "3" in sections:
            worst = max(ratio, key=ratio.get) if ratio else None
            print(f"3. {name}: fused anchor groups beating library anchor + the rest: {len(versus) - len(lost)} of "
                  f"{len(versus)}" + (f" (losing: {', '.join(f'g{g}' for g in lost)})" if lost else "")
                  + (f"; losing by < {TIE:.0%}: {near}; by > 10%: {len(by_far)}; fused / (library + rest) median "
                     f"{statistics.median(ratio.values()):.2f}, worst {ratio[worst]:.2f} (g{worst})" if ratio else ""))
        if "4" in sections:
            print(f"4. {name}: plan {p.kernels} kernels {t['measured_s'] * 1e3:.2f} ms, unfused {none.kernels} kernels "
                  f"{t['unfused_measured_s'] * 1e3:.2f} ms -> {t['speedup']:.2f}x (predicted {none.time_s / p.time_s:.2f}x); "
                  f"ONNX Runtime ENABLE_ALL whole model {ort_s * 1e3:.2f} ms: sum of our kernels "
                  f"{t['measured_s'] / ort_s:.2f}x of it (target <= 1.5x)")
            anchors = math.fsum(m.measured_s for m in report.unfused if m.anchor is not None and m.timing is not None)
            limits = 0 < anchors and anchors >= LIMITS_SHARE * t["unfused_measured_s"]
            if 0 < anchors and not limits:  # a graph of other ops (a loop, a scan)
                print(f"4. {name}: no ceiling or bound: its GEMMs/convs take {anchors / t['unfused_measured_s']:.0%} "
                      f"of the unfused time")
            elif limits:  # the most any fusion could gain: every op but the GEMMs/convs free
                print(f"4. {name}: ceiling: the unfused graph's {sum(m.anchor is not None for m in report.unfused)} "
                      f"GEMMs/convs alone take {anchors * 1e3:.2f} ms, so a plan that ran them at the library's "
                      f"speed and everything else at no cost would be {t['unfused_measured_s'] / anchors:.2f}x unfused")
            # the FMA probe, read beside every run: the core's peak is the best reading (a reading
            # taken while a neighbour shares the core is low, by up to a fifth on the shared host)
            peaks = [fma_reading()] if limits else []
            loops = [tile_loop_reading()] if limits else []
            if runs > 1:
                speedups = [t["speedup"]]
                for _ in range(runs - 1):
                    speedups.append(measure_plan(prep, p, none, "cpu", budget_s=budget).totals()["speedup"])
                    peaks += [fma_reading()] if limits else []
                    loops += [tile_loop_reading()] if limits else []
                print(f"4. {name}: plan vs unfused over {runs} runs: "
                      f"{', '.join(f'{x:.2f}x' for x in speedups)}; median {statistics.median(speedups):.2f}x")
            if limits and max(peaks) > 0:  # the bound no kernel can pass: the products' FLOPs at one core's FMA peak
                flops = {g.id: g.cost.flops for g in none.groups}
                product_flops = math.fsum(flops[m.group] for m in report.unfused if m.anchor is not None)
                peak = max(peaks)
                print(f"4. {name}: bound: those products' {product_flops / 1e6:.0f} MFLOP at this core's FMA peak "
                      f"({peak / 1e9:.0f} GFLOP/s, the best of {len(peaks)} probe readings "
                      f"({min(peaks) / 1e9:.0f}-{peak / 1e9:.0f}) taken beside the runs) take "
                      f"{product_flops / peak * 1e3:.2f} ms: a plan running them at the peak and everything else "
                      f"at no cost would be {t['unfused_measured_s'] * peak / product_flops:.2f}x unfused (ours takes "
                      f"{t['measured_s'] * 1e3:.2f} ms; the bound is {product_flops / peak / t['measured_s']:.0%} of it)")
                if name in TARGETS:  # what the target leaves for all but the products' FMAs at the peak
                    need = t["unfused_measured_s"] / TARGETS[name]
                    spare = need - product_flops / peak
                    spent = t["measured_s"] - product_flops / peak
                    print(f"4. {name}: the target {TARGETS[name]:.2f}x needs the plan in <= {need * 1e3:.3f} ms: "
                          + (f"{spare * 1e3:.3f} ms ({spare / need:.1%}) beside its products at the FMA peak for "
                             f"everything else (the products' packing and edges, every fused prologue and "
                             f"epilogue, the other kernels); this plan spends {spent * 1e3:.3f} ms on it"
                             if spare > 0 else "less than its products take at the FMA peak: out of reach here"))
                if max(loops) > 0:
                    loop = max(loops)
                    print(f"4. {name}: the micro-kernel's loop alone (per step two vector loads, a broadcast per row, "
                          f"two FMAs per broadcast, all in L1; the best of {len(loops)} readings beside the runs, "
                          f"{min(loops) / 1e9:.0f}-{loop / 1e9:.0f} GFLOP/s, {loop / peak:.0%} of the peak) runs those "
                          f"products in {product_flops / loop * 1e3:.2f} ms: at that rate, everything else at no cost, "
                          f"a plan would be {t['unfused_measured_s'] * loop / product_flops:.2f}x unfused")
                plan_flops = {g.id: g.cost.flops for g in p.groups}
                fused = [m for m in report.plan if m.anchor is not None and m.timing is not None]
                fused_s = math.fsum(m.measured_s for m in fused)
                print(f"4. {name}: where the plan's time goes: its {len(fused)} product groups take "
                      f"{fused_s * 1e3:.2f} ms (their FLOPs, products and fused work, at "
                      f"{math.fsum(plan_flops[m.group] for m in fused) / fused_s / 1e9:.0f} GFLOP/s), its "
                      f"{sum(1 for m in report.plan if m.anchor is None and m.measured_s > 0)} other kernels "
                      f"{(t['measured_s'] - fused_s) * 1e3:.2f} ms")
            print(f"4. {name}: predicted / measured by template: "
                  + "; ".join(f"{label} {_over(items)}" for label, items in (("plan", report.plan), ("unfused", report.unfused))))
    if "3" in sections and total:
        print(f"3. all models: the fused kernel wins in {wins} of {total} fused anchor groups ({wins / total:.1%}; "
              f"target >= 90%); it loses by less than {TIE:.0%} in {close}, by more than 10% in {far}")
        if losers:
            print("3. the losers (anchor, its input shapes, the group's ops: fused / (library + rest)):\n   "
                  + "\n   ".join(losers))


def _over(items) -> str:
    """Per template, the kernels' summed prediction over their summed measurement ('gemm 1.33x (17)')."""
    timed: dict[str, list] = {}
    for m in items:
        if m.timing is not None and m.measured_s > 0:  # aliases take no time
            timed.setdefault(m.template, []).append(m)
    return ", ".join(f"{k} {math.fsum(m.predicted_s for m in ms) / math.fsum(m.measured_s for m in ms):.2f}x ({len(ms)})"
                     for k, ms in sorted(timed.items()))


def _anchor_label(graph, anchor: int) -> str:
    """An anchor as 'MatMul 1x128x768 @ 768x3072': its op and its first two inputs' shapes."""
    node = graph.nodes[anchor]
    shapes = [graph.tensors[t].shape for t in node.inputs[:2] if t]
    return f"{node.op_type} " + " @ ".join("x".join(map(str, sh)) for sh in shapes if sh is not None)


def section_threads(budget: float, repeats: int) -> None:
    """The same generated kernels with 1 and 2 OpenMP threads (set through libgomp at run time)."""
    import ctypes

    gomp = ctypes.CDLL("libgomp.so.1")
    print("5. OpenMP threads: the same kernels with 1 and 2 threads (medians), outputs equal")
    conv = ([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Relu", ["y"], ["z"])], [("x", (1, 64, 56, 56))], [("z", (1, 64, 56, 56))],
            [("w", RNG.standard_normal((64, 64, 3, 3)) * 0.1)])
    gemm = ([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
            [("x", (128, 768))], [("z", (128, 3072))], [("w", RNG.standard_normal((768, 3072)) * 0.1)])
    ln = ([helper.make_node("LayerNormalization", ["x", "g"], ["y"], axis=-1)], [("x", (4096, 768))],
          [("y", (4096, 768))], [("g", np.ones(768))])
    for label, case in (("conv 3x3 64->64 @56 + Relu", conv), ("MatMul 128x768x3072 + Relu", gemm),
                        ("LayerNorm 4096x768", ln)):
        kernel, feeds, _ = _group(*case)
        run = cpu.runner(kernel, feeds)
        times, outs = [], []
        for threads in (1, 2):
            gomp.omp_set_num_threads(threads)
            run()
            outs.append(run.buffers[-1].copy())
            times.append(statistics.median(measure(run, budget_s=budget).median_s for _ in range(repeats)))
        gomp.omp_set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        same = np.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)
        print(f"   {label:30s} 1 thread {times[0] * 1e3:7.3f} ms   2 threads {times[1] * 1e3:7.3f} ms   "
              f"{times[0] / times[1]:4.2f}x   outputs equal: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="1,1b,2,3,4,5")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--models", default="bert-small,resnet18")
    parser.add_argument("--plan-runs", type=int, default=3, help="section 4: measure runs per model")
    args = parser.parse_args()
    if not cpu.available():
        raise SystemExit(f"no C compiler: {cpu.available().reason}")
    print(f"OpenMP threads {os.environ.get('OMP_NUM_THREADS', 'default')}; BLAS: {' '.join(cpu.blas_flags()[:1]) or 'none'}")
    sections = {s.strip() for s in args.sections.split(",")}
    if "1" in sections:
        section_anchors(args.budget, args.repeats)
    if "1b" in sections:
        section_micro_kernel(args.budget, args.repeats)
    if "2" in sections:
        section_bandwidth(args.budget, args.repeats)
    if "5" in sections:
        section_threads(args.budget, args.repeats)
    if sections & {"3", "4"}:
        section_plans([m for m in args.models.split(",") if m], args.budget, sections, args.plan_runs)


if __name__ == "__main__":
    main()
