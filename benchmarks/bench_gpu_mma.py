"""Tensor-core kernels on a GPU: each generated `mma-*` gemm/conv kernel of a few zoo plans beside
the CUDA-core `tiled` kernel of the same group (TF32 off) and beside `cupy.matmul` of the same
M×N×K with TF32 allowed (CUPY_TF32=1, set here before CuPy is imported), in TFLOP/s of the
anchor's FLOPs. The three are timed together, interleaved, by the cupy backend's graph timer
(`registry.CUPY.sample`: per launch from CUDA-graph replays of N launches, no host launch cost, in
one cache state: warm, or L2 flushed before each launch with --flush), and each row says the timer
("graph", or "events" where a call could not be captured), the cache state and an empty
kernel's launch cost in a graph (`launch_us`, reported apart). The two generated kernels' outputs are compared (TF32 tolerance: 2e-3 of the
larger of the largest output and sqrt(K), the spread of a product of standard normal operands,
which a saturating epilogue such as Tanh hides from the outputs). Figures are printed and written
as JSON (--out); the exit code is 1 when a pair differs.

    python benchmarks/bench_gpu_mma.py [--models bert-base,resnet50] [--per-model 4] [--budget 0.2] [--flush] [--out mma.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("CUPY_TF32", "1")  # cuBLAS may use TF32 for float32, as ONNX Runtime's CUDA EP does

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from dataclasses import replace  # noqa: E402

import numpy as np  # noqa: E402

from fusesearch.api import plan as make_plan  # noqa: E402
from fusesearch.backends import cupy as gpu  # noqa: E402
from fusesearch.backends.codegen import generate  # noqa: E402
from fusesearch.backends.registry import CUPY  # noqa: E402
from fusesearch.groups import FusionGroup  # noqa: E402
from fusesearch.lowering import _gemm_dims, lower  # noqa: E402
from fusesearch.pipeline import prepare  # noqa: E402

TOLERANCE = 2e-3


def groups_on_tensor_cores(model: str, per_model: int):
    """(prepared model, its TF32-off twin, [kernel]) for the distinct fused mma groups of the
    greedy plan on an H200, largest first."""
    prep = prepare(f"zoo:{model}")
    plan = make_plan(f"zoo:{model}", device="h200", strategy="greedy", prepared=prep)
    seen, chosen = set(), []
    for g in sorted(plan.groups, key=lambda g: -g.kernel.tc_flops):
        k = g.kernel
        key = (k.ops, _gemm_dims(prep.graph, prep.graph.nodes[k.anchor])) if k.anchor is not None else None
        if not k.schedule.skeleton.startswith("mma") or key in seen:
            continue
        if any(prep.graph.tensors[t].dtype != "float32" for t in k.inputs):
            continue  # random float inputs only
        seen.add(key)
        chosen.append(k)
    off = replace(prep, graph=replace(prep.graph, allow_tf32=False))
    return prep, off, chosen[:per_model]


def cupy_matmul(m: int, n: int, k: int):
    """A run of `cupy.matmul` (cuBLAS) of M×K by K×N standard normal float32 operands."""
    import cupy

    a = cupy.random.standard_normal((m, k), dtype=cupy.float32)
    b = cupy.random.standard_normal((k, n), dtype=cupy.float32)
    state = {}

    def run() -> None:
        state["y"] = cupy.matmul(a, b)

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert-base,resnet50")
    ap.add_argument("--per-model", type=int, default=4)
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--flush", action="store_true", help="flush L2 before every launch (else warm)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    decision = gpu.available()
    if not decision:
        print(f"bench_gpu_mma: no GPU: {decision.reason}", file=sys.stderr)
        return 1
    rows, failed = [], 0
    rng = np.random.default_rng(0)
    for model in args.models.split(","):
        prep, off, kernels = groups_on_tensor_cores(model, args.per_model)
        for kernel in kernels:
            g = prep.graph
            tensor_core = generate(g, kernel, name="k_mma")
            cuda_core = generate(off.graph, lower(off.graph, FusionGroup(frozenset(kernel.nodes))), name="k_tiled")
            values = {a.tensor: rng.standard_normal(a.shape).astype(np.float32) for a in tensor_core.inputs}
            (mma, mma_fetch), (tiled, tiled_fetch) = (gpu.kernel_runner(x, values) for x in (tensor_core, cuda_core))
            m, n, k = _gemm_dims(g, g.nodes[kernel.anchor])
            times = CUPY.sample([mma, tiled, cupy_matmul(m, n, k)], budget_s=args.budget, flush=args.flush)
            mma_s, tiled_s, library_s = (t.median_s for t in times)
            mma_out, tiled_out = mma_fetch(), tiled_fetch()
            # the scale of the difference is the product's, before a saturating epilogue (Tanh) squeezes
            # the outputs: with standard normal operands its spread is sqrt(K)
            err = max(float(np.max(np.abs(mma_out[t] - tiled_out[t])))
                      / max(1.0, math.sqrt(k), float(np.max(np.abs(tiled_out[t])))) for t in mma_out)
            ok = err <= TOLERANCE
            failed += not ok
            flops = float(kernel.tc_flops)
            row = {"model": model, "ops": "+".join(kernel.ops), "skeleton": tensor_core.skeleton, "m": m, "n": n,
                   "k": k, "tile": "x".join(map(str, kernel.tile)), "mma_us": mma_s * 1e6,
                   "tiled_us": tiled_s * 1e6, "cupy_matmul_tf32_us": library_s * 1e6,
                   "mma_tflops": flops / mma_s / 1e12, "tiled_tflops": flops / tiled_s / 1e12,
                   "cupy_tflops": 2.0 * m * n * k / library_s / 1e12, "max_rel_diff": err, "equal": ok,
                   "timer": "/".join(t.timer for t in times), "cache": times[0].cache,
                   "launch_us": times[0].launch_s * 1e6, "launches": "/".join(str(t.launches) for t in times)}
            rows.append(row)
            print(f"{model:10} {row['ops'][:38]:38} {m:>6}x{n:<5}x{k:<5} {row['tile']:9} "
                  f"mma {row['mma_us']:8.1f} us {row['mma_tflops']:6.1f} TF/s | tiled {row['tiled_us']:8.1f} us "
                  f"{row['tiled_tflops']:6.1f} | cupy.matmul(TF32) {row['cupy_matmul_tf32_us']:8.1f} us "
                  f"{row['cupy_tflops']:6.1f} | diff {err:.1e}{'' if ok else ' NOT EQUAL'} | {row['timer']} "
                  f"{row['cache']} launch {row['launch_us']:.2f} us", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": gpu.device_name(), "cupy_tf32": os.environ.get("CUPY_TF32"),
                       "cache": "flushed" if args.flush else "warm", "rows": rows}, f, indent=1)
    if not rows:
        print("bench_gpu_mma: no tensor-core kernel in the plans", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
