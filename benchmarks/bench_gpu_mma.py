"""Tensor-core kernels on a GPU: for each fused gemm/conv group of a few zoo plans on tensor cores,
its wmma kernel (`mma-*`) and its mma.sync kernel (`mma-sync-*`: ldmatrix, swizzled shared memory,
a cp.async pipeline), each the family's cheapest configuration as the cost model prices it on the
plan's device, beside the CUDA-core `tiled` kernel of the same group (TF32 off) and beside
`cupy.matmul` (cuBLAS) of the same M×N×K in the operands' dtype, TF32 allowed for float32
(CUPY_TF32=1, set here before CuPy is imported), in TFLOP/s of the anchor's FLOPs. The four are
timed together, interleaved, by the cupy backend's graph timer (`registry.CUPY.sample`: per launch
from CUDA-graph replays of N launches, no host launch cost, in one cache state: warm, or L2 flushed
before each launch with --flush), and each row says the timer ("graph", or "events" where a call
could not be captured), the cache state and an empty kernel's launch cost in a graph
(`launch_us`, reported apart). Both tensor-core kernels' outputs are compared with the CUDA-core
kernel's (tolerance: 2e-3 of the larger of the largest output and sqrt(K), the spread of a product
of standard normal operands, which a saturating epilogue such as Tanh hides from the outputs).
--dtype float16 converts the models first (FP16 tensor cores). Figures are printed and written as
JSON (--out); the exit code is 1 when a kernel differs.

    python benchmarks/bench_gpu_mma.py [--models bert-base,resnet50] [--per-model 4] [--dtype float32]
        [--budget 0.2] [--flush] [--out mma.json]
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

from costmodels import RooflineModel  # noqa: E402
from fusesearch.api import plan as make_plan  # noqa: E402
from fusesearch.api import resolve_device  # noqa: E402
from fusesearch.backends import cupy as gpu  # noqa: E402
from fusesearch.backends.codegen import generate  # noqa: E402
from fusesearch.backends.registry import CUPY  # noqa: E402
from fusesearch.costing import kernel_cost  # noqa: E402
from fusesearch.groups import FusionGroup  # noqa: E402
from fusesearch.lowering import _gemm_dims, choices, lower  # noqa: E402
from fusesearch.pipeline import prepare  # noqa: E402

TOLERANCE = 2e-3


DEVICE = "h200"  # the plans' device, whose cost model picks each family's configuration


def groups_on_tensor_cores(model: str, per_model: int, dtype: str):
    """(prepared model, its TF32-off twin, [kernel]) for the distinct fused tensor-core groups of
    the greedy plan on DEVICE, largest first."""
    prep = prepare(f"zoo:{model}", dtype=dtype)
    plan = make_plan(f"zoo:{model}", device=DEVICE, strategy="greedy", prepared=prep)
    seen, chosen = set(), []
    for g in sorted(plan.groups, key=lambda g: -g.kernel.tc_flops):
        k = g.kernel
        key = (k.ops, _gemm_dims(prep.graph, prep.graph.nodes[k.anchor])) if k.anchor is not None else None
        if not k.schedule.skeleton.startswith("mma") or key in seen:
            continue
        if any(prep.graph.tensors[t].dtype != dtype for t in k.inputs):
            continue  # random float inputs only
        seen.add(key)
        chosen.append(k)
    off = replace(prep, graph=replace(prep.graph, allow_tf32=False))
    return prep, off, chosen[:per_model]


def tensor_core_forms(graph, kernel) -> dict[str, object]:
    """The group's cheapest wmma and mma.sync kernels on DEVICE, by family ("wmma", "mma_sync")."""
    _, spec, params, _ = resolve_device(DEVICE)
    model = RooflineModel(params)
    forms: dict[str, list] = {}
    for k in choices(graph, FusionGroup(frozenset(kernel.nodes))):
        family = "mma_sync" if k.schedule.skeleton.startswith("mma-sync") else "wmma" if k.schedule.skeleton.startswith(
            "mma") else None
        if family and k.impl == "generated":
            forms.setdefault(family, []).append(k)
    return {family: min(ks, key=lambda k: kernel_cost(k, spec, model).time_s) for family, ks in forms.items()}


def cupy_matmul(m: int, n: int, k: int, dtype: str):
    """A run of `cupy.matmul` (cuBLAS) of M×K by K×N standard normal operands of `dtype`."""
    import cupy

    a = cupy.random.standard_normal((m, k), dtype=cupy.float32).astype(dtype)
    b = cupy.random.standard_normal((k, n), dtype=cupy.float32).astype(dtype)
    state = {}

    def run() -> None:
        state["y"] = cupy.matmul(a, b)

    return run


def relative_diff(out: dict, reference: dict, k: int) -> float:
    """The largest |out - reference| over the outputs, relative to the product's scale (module docstring)."""
    return max(float(np.max(np.abs(out[t].astype(np.float64) - reference[t].astype(np.float64))))
               / max(1.0, math.sqrt(k), float(np.max(np.abs(reference[t].astype(np.float64))))) for t in out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert-base,resnet50")
    ap.add_argument("--per-model", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16"))
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
        prep, off, kernels = groups_on_tensor_cores(model, args.per_model, args.dtype)
        for kernel in kernels:
            g = prep.graph
            forms = tensor_core_forms(g, kernel)
            generated = {family: generate(g, k, name=f"k_{family}") for family, k in forms.items()}
            generated["tiled"] = generate(off.graph, lower(off.graph, FusionGroup(frozenset(kernel.nodes))), name="k_tiled")
            values = {a.tensor: rng.standard_normal(a.shape).astype(np.float32) for a in generated["tiled"].inputs}
            runners = {family: gpu.kernel_runner(gk, values) for family, gk in generated.items()}
            m, n, k = _gemm_dims(g, g.nodes[kernel.anchor])
            names = list(runners)
            times = CUPY.sample([runners[f][0] for f in names] + [cupy_matmul(m, n, k, args.dtype)],
                                budget_s=args.budget, flush=args.flush)
            seconds = {f: t.median_s for f, t in zip([*names, "cupy"], times, strict=True)}
            reference = runners["tiled"][1]()
            flops = float(kernel.tc_flops)
            row = {"model": model, "dtype": args.dtype, "ops": "+".join(kernel.ops), "m": m, "n": n, "k": k,
                   "planned": kernel.schedule.skeleton.value, "cupy_matmul_us": seconds["cupy"] * 1e6,
                   "cupy_tflops": 2.0 * m * n * k / seconds["cupy"] / 1e12, "tiled_us": seconds["tiled"] * 1e6,
                   "tiled_tflops": flops / seconds["tiled"] / 1e12, "timer": "/".join(t.timer for t in times),
                   "cache": times[0].cache, "launch_us": times[0].launch_s * 1e6,
                   "launches": "/".join(str(t.launches) for t in times)}
            for family in forms:
                schedule = forms[family].schedule
                err = relative_diff(runners[family][1](), reference, k)
                failed += err > TOLERANCE
                row |= {f"{family}_skeleton": schedule.skeleton.value, f"{family}_us": seconds[family] * 1e6,
                        f"{family}_tile": "x".join(map(str, (*schedule.tile, *schedule.warp))) + f"/s{schedule.stages}",
                        f"{family}_tflops": flops / seconds[family] / 1e12, f"{family}_max_rel_diff": err,
                        f"{family}_equal": err <= TOLERANCE, f"{family}_vs_cupy": seconds["cupy"] / seconds[family]}
            rows.append(row)
            tc = " | ".join(f"{f} {row[f + '_tile']} {row[f + '_us']:8.1f} us {row[f + '_tflops']:6.1f} TF/s "
                            f"({row[f + '_vs_cupy']:.2f}x cuBLAS, diff {row[f + '_max_rel_diff']:.1e}"
                            f"{'' if row[f + '_equal'] else ' NOT EQUAL'})" for f in forms)
            print(f"{model:10} {row['ops'][:38]:38} {m:>6}x{n:<5}x{k:<5} {tc} | tiled {row['tiled_us']:8.1f} us "
                  f"{row['tiled_tflops']:6.1f} | cupy.matmul({args.dtype}) {row['cupy_matmul_us']:8.1f} us "
                  f"{row['cupy_tflops']:6.1f} | {row['timer']} {row['cache']} launch {row['launch_us']:.2f} us", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": gpu.device_name(), "cupy_tf32": os.environ.get("CUPY_TF32"), "dtype": args.dtype,
                       "cache": "flushed" if args.flush else "warm", "rows": rows}, f, indent=1)
    if not rows:
        print("bench_gpu_mma: no tensor-core kernel in the plans", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
