"""Tune the tensor-core tiles on a GPU: every wmma tile and every mma.sync configuration of each
skeleton timed on a few GEMM + bias + ReLU shapes per shape class, the fastest per (skeleton, class)
written as the tuned tile table (tiles.json, beside the device's profile.json), which `--device
PROFILE` then gives lowering (`DeviceSpec.tuned_tiles`: that configuration alone for the class).

Shapes (M x N x K) per class (`schedule.shape_class`), from the zoo's projections and convs:
skinny: bert-base decode / batch 8 rows; small: bert-small and gpt2 at batch 1; large: bert-base
at 8 x 512 tokens, resnet50's 3x3 convs as implicit GEMMs. Each configuration's figure for a class is
the geometric mean of its per-launch medians over the class's shapes (the cupy backend's graph
timer, warm: `registry.CUPY.sample`, every configuration of one shape interleaved); a configuration
whose kernel differs from the first one's output beyond the precision's tolerance fails the run.

    python scripts/tune_tiles.py --out experiments/h100-profile/tiles.json [--dtypes float32,float16]
        [--budget 0.05] [--quick]

Exit 1 (one line on stderr) without a GPU."""

from __future__ import annotations

import os

os.environ.setdefault("CUPY_TF32", "1")

import argparse  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

SHAPES = {  # (M, N, K) per shape class
    "skinny": ((8, 768, 3072), (32, 3072, 768)),
    "small": ((128, 512, 2048), (128, 2304, 768), (1024, 768, 768)),
    "large": ((4096, 3072, 768), (4096, 768, 3072), (3136, 64, 576)),
}
QUICK = {cls: shapes[:1] for cls, shapes in SHAPES.items()}  # one shape per class: the gpu check's sweep
TOLERANCE = {"float32": 2e-3, "float16": 1e-2}


def pick(times: Mapping[tuple[str, str, tuple[int, ...]], Sequence[float]]) -> list[dict]:
    """The tuned table's rows from per-launch seconds {(skeleton, class, config): [one per shape]}:
    per (skeleton, class) the configuration of the least geometric mean (ties: the first given),
    with its figure and every configuration's, in seconds."""
    best: dict[tuple[str, str], dict] = {}
    for (skeleton, cls, config), seconds in times.items():
        mean = math.exp(sum(math.log(s) for s in seconds) / len(seconds))
        row = best.setdefault((skeleton, cls), {"skeleton": skeleton, "class": cls, "config": list(config),
                                                "geomean_s": mean, "timed": []})
        row["timed"].append({"config": list(config), "geomean_s": mean, "per_shape_s": list(seconds)})
        if mean < row["geomean_s"]:
            row |= {"config": list(config), "geomean_s": mean}
    return list(best.values())


def gemm_model(m: int, n: int, k: int, folder: Path) -> Path:
    """x @ w + bias, ReLU, as an ONNX file (float32; the half dtypes by `prepare`)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["z"]),
             helper.make_node("Relu", ["z"], ["out"])]
    graph = helper.make_graph(nodes, "gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [m, n])],
                              [numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "w"),
                               numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "b")])
    path = folder / f"gemm_{m}x{n}x{k}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def configurations(graph, kernel) -> dict[tuple[str, tuple[int, ...]], object]:
    """{(skeleton, configuration): Kernel} of every tensor-core choice of the group, unsplit."""
    from fusesearch.groups import FusionGroup
    from fusesearch.lowering import choices

    found = {}
    for k in choices(graph, FusionGroup(frozenset(kernel.nodes))):
        s = k.schedule
        if k.impl != "generated" or not s.skeleton.startswith("mma") or s.split_k != 1:
            continue
        config = (*s.tile[:2], *s.warp, s.stages) if s.skeleton.startswith("mma-sync") else tuple(s.tile[:2])
        found[(s.skeleton.value, config)] = k
    return found


def time_shape(path: Path, dtype: str, budget: float) -> dict[tuple[str, tuple[int, ...]], float]:
    """Per-launch seconds of every tensor-core configuration of the shape's group; AssertionError
    naming one that differs from the first."""
    from fusesearch.backends import cupy as gpu
    from fusesearch.backends.codegen import generate
    from fusesearch.backends.registry import CUPY
    from fusesearch.groups import FusionGroup
    from fusesearch.lowering import lower
    from fusesearch.pipeline import prepare

    prep = prepare(str(path), tf32=True, dtype=dtype)
    graph = prep.graph
    kernel = lower(graph, FusionGroup(frozenset(range(len(graph)))))
    forms = configurations(graph, kernel)
    rng = np.random.default_rng(1)
    generated = {key: generate(graph, k, name=f"k{i}") for i, (key, k) in enumerate(forms.items())}
    first = next(iter(generated.values()))
    values = {a.tensor: rng.standard_normal(a.shape).astype(np.float32) for a in first.inputs}
    runners = {key: gpu.kernel_runner(gk, values) for key, gk in generated.items()}
    times = CUPY.sample([r[0] for r in runners.values()], budget_s=budget)
    reference = next(iter(runners.values()))[1]()
    for key, (_, fetch) in runners.items():
        out = fetch()
        for t, ref in reference.items():
            scale = max(1.0, float(np.max(np.abs(ref.astype(np.float64)))))
            err = float(np.max(np.abs(out[t].astype(np.float64) - ref.astype(np.float64)))) / scale
            assert err <= TOLERANCE[dtype], f"{path.name} {dtype} {key}: differs by {err:.2e} of the output's scale"
    return {key: t.median_s for key, t in zip(runners, times, strict=True)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the tiles.json to write (beside the device's profile.json)")
    ap.add_argument("--dtypes", default="float32,float16")
    ap.add_argument("--budget", type=float, default=0.05)
    ap.add_argument("--quick", action="store_true", help="one shape per class")
    args = ap.parse_args(argv)
    from costmodels.profile import save_tuned_tiles
    from fusesearch.backends import cupy as gpu

    decision = gpu.available()
    if not decision:
        print(f"tune_tiles: no GPU: {decision.reason}", file=sys.stderr)
        return 1
    times: dict[tuple[str, str, tuple[int, ...]], list[float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for dtype in args.dtypes.split(","):
            for cls, shapes in (QUICK if args.quick else SHAPES).items():
                for m, n, k in shapes:
                    measured = time_shape(gemm_model(m, n, k, Path(folder)), dtype, args.budget)
                    for (skeleton, config), seconds in measured.items():
                        times.setdefault((skeleton, cls, config), []).append(seconds)
                    fastest = min(measured, key=measured.get)
                    print(f"{dtype:8} {cls:6} {m:>5}x{n:<5}x{k:<5} {len(measured)} configurations, fastest "
                          f"{fastest[0]} {list(fastest[1])} {measured[fastest] * 1e6:.1f} us", flush=True)
    rows = pick(times)
    save_tuned_tiles(rows, gpu.device_name(), args.out)
    for row in rows:
        print(f"{row['skeleton']:14} {row['class']:6} {row['config']} {row['geomean_s'] * 1e6:.1f} us (geomean)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
