"""The price of one plan: for each model and device, one plan over a range of one dim (`plan --dim
seq=16..512`) beside each bucket's own optimal plan, predicted by the cost model (no timing, so the
figures are the same on any machine for the same flags).

    .venv/bin/python benchmarks/bench_buckets.py                       # bert-base, gpt2, vit-base
    .venv/bin/python benchmarks/bench_buckets.py --models bert-small --devices h100-sxm --strategy greedy
    .venv/bin/python benchmarks/bench_buckets.py --emit       # every zoo model's dynamic fused ONNX, verified

Prints one row per bucket: its weight, its time under the one plan and under its own plan, the
price (one plan / own plan) and, where a bucket pays more than the target, the refusals that kept
its own groups out of the one plan. With `--emit`, each zoo model with a dynamic dim is planned
(greedy, h100-sxm) over a range of it and its one fused model, keeping the dim dynamic, is verified in
ONNX Runtime at 4 shapes in the range (`plan --dim ... --emit`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusesearch.buckets import plan_buckets, split_dims  # noqa: E402
from fusesearch.ir.shapes import ShapeBindings  # noqa: E402
from fusesearch.pipeline import prepare  # noqa: E402
from fusesearch.search import SearchConfig  # noqa: E402

DIMS = {"bert-base": "seq=16..512", "gpt2": "seq=16..512", "vit-base": "batch=1..32", "bert-small": "seq=16..512"}
EMIT_DIMS = {"resnet18": "batch=1..8", "resnet50": "batch=1..8", "mobilenetv2": "batch=1..8", "vit-small": "batch=1..8",
             "vit-base": "batch=1..8", "bert-base": "seq=16..512", "bert-small": "seq=16..512", "gpt2": "seq=16..512",
             "unet": "batch=1..4", "yolo-neck": "batch=1..4", "rnn-control": "batch=1..4"}
TARGET = 1.05


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="bert-base,gpt2,vit-base")
    parser.add_argument("--devices", default="h100-sxm,h200,host")
    parser.add_argument("--strategy", default="cpsat")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--emit", action="store_true", help="verify every zoo model's dynamic fused ONNX instead")
    args = parser.parse_args(argv)
    if args.emit:
        return emit_all()
    config = SearchConfig(time_limit_s=args.time_limit, workers=1)
    print(f"{'model':<11} {'device':<9} {'bucket':>12} {'weight':>6} {'one plan':>10} {'own plan':>10} {'price':>7}")
    for name in args.models.split(","):
        _, buckets = split_dims([DIMS[name]])
        preps = [prepare(f"zoo:{name}", ShapeBindings.parse([], [f"{buckets.dim}={v}"])) for v in buckets.values]
        for device in args.devices.split(","):
            start = time.perf_counter()
            plan, figures, _ = plan_buckets(preps, buckets, device, args.strategy, config)
            wall = time.perf_counter() - start
            for f in figures:
                flag = "" if f.price <= TARGET else "  over target"
                print(f"{name:<11} {device:<9} {buckets.dim + '=' + str(f.value):>12} {f.weight:6.3f} "
                      f"{f.time_s * 1e6:8.1f}us {f.own_time_s * 1e6:8.1f}us {f.price:6.3f}x{flag}")
                for why in f.why[:3] if f.price > TARGET else ():
                    print(f"{'':<34}own groups refused {why}")
                if f.price > TARGET and f.own_weighted_s is not None:
                    print(f"{'':<34}its own plan served at every bucket: {f.own_weighted_s * 1e6:.1f}us weighted, "
                          f"the one plan {plan.time_s * 1e6:.1f}us")
            worst = max(figures, key=lambda f: f.price)
            print(f"{name:<11} {device:<9} one plan: {plan.kernels} kernels, solver {plan.solver.status}, "
                  f"worst {buckets.dim}={worst.value} {worst.price:.3f}x, {wall:.0f} s")
    return 0


def emit_all() -> int:
    """Each zoo model with a dynamic dim: its one fused model over a range, verified at 4 shapes."""
    import json
    import subprocess
    import tempfile

    failed = 0
    for name, dim in EMIT_DIMS.items():
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "fusesearch", "plan", f"zoo:{name}", "--device", "h100-sxm", "--strategy",
                   "greedy", "--dim", dim, "--emit", f"{tmp}/fused.onnx", "--json"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            failed += 1
            print(f"{name:<12} {dim:<14} not emitted: {proc.stderr.strip().splitlines()[-1]}")
            continue
        verified = json.loads(proc.stdout)["run"]["verified"]
        shapes = ", ".join(f"{r['at']}{'' if r['ok'] else ' DIFFERS'}" for r in verified)
        print(f"{name:<12} {dim:<14} verified at {dim.split('=')[0]} = {shapes}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
