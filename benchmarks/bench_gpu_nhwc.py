"""Channels last on a GPU: each CNN's plan with layouts chosen (`--layouts auto`: tensor-core conv
groups may run NHWC, with CUDA reorders at the edges) beside its plan kept in NCHW (`--layouts
nchw`), both run as one CUDA program each (`run.CudaProgram` on the cupy backend, checked against
ONNX Runtime first) and timed in the same interleaved rounds (`run.run_plan`, CUDA events), beside
PyTorch eager over the same model in NCHW and in channels_last (cuDNN's NHWC convs: the module's
4-D weights and the input converted with `torch.channels_last`, timed apart by CUDA events, median
of --repeat after --warmup). The conv route plans price is the environment's (`cudnn.ROUTE_ENV`;
im2col where cuDNN is not installed); --device is a device name or a profile (the datasheet model
leaves a conv's staging loads in its efficiencies, `staging_load_flops` 0: a profile that fits it
prices NHWC's 16-byte loads). Each row says how many groups the auto plan runs NHWC and its
reorders, and both plans' predicted times beside the measured ones. Figures are printed and written as JSON (--out); without a GPU it says why and
exits 1 before planning anything.

    python benchmarks/bench_gpu_nhwc.py [--models resnet18,resnet50] [--device h100-sxm]
        [--dtype float32|float16] [--repeat 50] [--warmup 10] [--out nhwc.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusesearch.api import plan as make_plan  # noqa: E402
from fusesearch.backends import cupy as gpu  # noqa: E402
from fusesearch.pipeline import prepare  # noqa: E402
from fusesearch.run import program_inputs, run_plan  # noqa: E402

NAMES = {"plan": "layouts auto", "unfused": "layouts nchw"}  # what run_plan's two programs are here


def torch_channels_last(prep, seed: int, repeat: int, warmup: int) -> dict:
    """PyTorch eager over the model on the GPU in NCHW and in channels_last (cuDNN's NHWC convs),
    each a median of `repeat` CUDA-event timings (ms); {"refused": why} where the model does not
    convert, {"not installed": ...} without torch."""
    from fusesearch.backends import torch_baseline as tb

    try:
        torch = tb.load_torch()
    except ImportError as exc:
        return {"not installed": str(exc)}
    canonical, weights, feeds = program_inputs(prep, seed, None)
    try:
        module = tb.convert(canonical, weights).to("cuda").eval()
    except tb.Unconvertible as exc:
        return {"refused": str(exc)}
    args = [torch.from_numpy(feeds[n]).to("cuda") for n in module.inputs]
    times = {}
    for name, memory_format in (("torch_nchw", torch.contiguous_format), ("torch_channels_last", torch.channels_last)):
        module = module.to(memory_format=memory_format)
        laid = [a.to(memory_format=memory_format) if a.dim() == 4 else a for a in args]
        with torch.inference_mode():
            for _ in range(warmup):
                module(*laid)
            samples = []
            for _ in range(repeat):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                module(*laid)
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
        times[name] = statistics.median(samples)
    return times


def bench(model: str, device: str, dtype: str, repeat: int, warmup: int) -> dict:
    prep = prepare(f"zoo:{model}", keep_original=True, dtype=dtype)
    auto = make_plan(f"zoo:{model}", device=device, prepared=prep, dtype=dtype, layouts="auto")
    nchw = make_plan(f"zoo:{model}", device=device, prepared=prep, dtype=dtype, layouts="nchw")
    report = run_plan(prep, auto, nchw, repeat=repeat, warmup=warmup, backend="cupy", names=NAMES)
    ms = {NAMES.get(k, k): t.median_s * 1e3 for k, t in report.timings.items()}
    return {"model": model, "dtype": dtype, "device": device,
            "nhwc_groups": sum(g.kernel.schedule.layout_out.channels_last for g in auto.groups),
            "groups": len(auto.groups), "reorders": len(auto.reorders),
            "predicted_ms": {"layouts auto": auto.time_s * 1e3, "layouts nchw": nchw.time_s * 1e3},
            "ms": ms, "max_rel_err": report.max_rel_err, **torch_channels_last(prep, 0, repeat, warmup)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet18,resnet50")
    ap.add_argument("--device", default="h100-sxm", help="the device (or profile) the plans are priced for")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    decision = gpu.available()
    if not decision:
        print(f"bench_gpu_nhwc: no GPU: {decision.reason}", file=sys.stderr)
        return 1
    rows = []
    for model in args.models.split(","):
        row = bench(model, args.device, args.dtype, args.repeat, args.warmup)
        rows.append(row)
        ms = row["ms"]
        torch_part = " ".join(f"{k} {row[k]:.3f} ms" for k in ("torch_nchw", "torch_channels_last") if k in row)
        print(f"{model:10} {args.dtype}: auto {ms['layouts auto']:.3f} ms ({row['nhwc_groups']}/{row['groups']} groups "
              f"NHWC, {row['reorders']} reorders) | nchw {ms['layouts nchw']:.3f} ms | "
              f"ORT {ms.get('ort_enable_all', float('nan')):.3f} ms | {torch_part}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": gpu.device_name(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
