#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU and CuPy 14 (CUDA 13): the gpu-marked tests,
# `fusesearch measure --backend cupy` on two zoo models, `fusesearch run --backend cupy` (the
# whole plan as one CUDA program beside ONNX Runtime, PyTorch eager and torch.compile, default and
# max-autotune with CUDA graphs, over the same model) on bert-small, and the tensor-core kernels of
# a few zoo shapes (each group's wmma and mma.sync kernels) timed beside the CUDA-core skeleton and
# `cupy.matmul` (cuBLAS), TF32 allowed, in float32 and float16, and the tuned tile table's sweep
# (scripts/tune_tiles.py --quick: every wmma tile and mma.sync configuration per shape class, one
# shape each; $OUT/tiles.json, to be committed beside the device's profile.json). The gpu tests
# include each cuDNN conv route (the cuDNN Frontend graph, PyTorch over DLPack, im2col) against ONNX
# Runtime; the route the plans use is printed first (`backends.cudnn.conv_route`)
# (benchmarks/bench_gpu_mma.py; CUPY_TF32=1 throughout, so CuPy's library calls use TF32 as ONNX
# Runtime's CUDA provider does and as the cost model prices them). Every kernel figure of measure
# and the benchmark is per launch from CUDA-graph replays (the cupy backend's graph timer): each
# says its timer ("graph", or "events" where a call could not be captured), its cache state (warm
# here) and an empty kernel's launch cost in a graph, printed below. Figures and logs go to $OUT
# (default ./gpu_out). It installs nothing from the network: packages missing on the GPU machine travel
# as wheels in .whl/, installed into .gpusite/ (scripts/gpu_env.sh). Fetch them here first (Python
# 3.12, x86_64); on an image with CuPy 14, numpy, onnx, onnx-ir, onnxscript, onnxruntime, pandas,
# pyarrow, typer and rich (the H200 it has run on), these were what it lacked:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform any -d .whl \
#     'nvidia-cuda-runtime==13.0.*' 'nvidia-cuda-crt==13.0.*' 'ortools==9.15.*' 'protobuf>=6.33.1,<6.34' \
#     immutabledict jsonschema jsonschema-specifications referencing rpds-py scipy-openblas32 \
#     'nvidia-cudnn-frontend==1.32.0'
# (nvidia-cudnn-frontend: 12 MB; its CUTLASS DSL and TVM FFI requirements serve other graphs and are
# imported lazily, so they need not travel; the image's nvidia-cudnn-cu13 gives it libcudnn.)
# It fails (exit 1, one line on stderr) when no GPU is visible — checked first, before anything
# is installed — and when the gpu tests did not really run on the GPU: none selected, or any of
# them skipped (scripts/gpu_tests_ran.py reads pytest's JUnit report); when a measure or the
# run fails; and when a tensor-core kernel differs from the CUDA-core one beyond the TF32 tolerance.
# Usage: bash scripts/gpu_check.sh   (162 s on an H200 before the sweep and the cuDNN tests:
# experiments/h200-check/). Its own estimate, printed with the time each step took, is at most
# ESTIMATE_S (gpu tests 120 s, two measures 80 s, the run 60 s, two benchmarks 80 s, the sweep
# 120 s), under the 8 minutes it must fit; past LIMIT_S it says so and fails.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi > /dev/null 2>&1; then
  echo "gpu_check: no GPU visible: nvidia-smi not found (no NVIDIA driver here); run this on a GPU machine" >&2
  exit 1
fi
if ! gpus=$(nvidia-smi -L 2>&1) || ! grep -q '^GPU ' <<< "$gpus"; then
  echo "gpu_check: no GPU visible: nvidia-smi -L lists none (${gpus%%$'\n'*}); run this on a GPU machine" >&2
  exit 1
fi
ESTIMATE_S=460
LIMIT_S=480
step() { echo "gpu_check: $1 done at ${SECONDS} s (estimate for the whole check ${ESTIMATE_S} s)"; }
export CUPY_TF32=1
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
source scripts/gpu_env.sh
$PY - <<'PY' | tee "$OUT/gpu_env.txt"
import sys

from fusesearch.backends import cupy as gpu

decision = gpu.available()
if not decision:  # nvidia-smi sees a GPU but CuPy does not: a broken install or driver
    print(f"gpu_check: nvidia-smi lists a GPU but CuPy cannot use it: {decision.reason}", file=sys.stderr)
    sys.exit(1)
print("cupy available:", decision, "gpus:", gpu.gpu_count())
print("device:", gpu.device_name(), "L2 bytes:", gpu.l2_bytes())
from fusesearch.backends.cudnn import conv_route, installed_route

planned, here = conv_route(), installed_route()
print("conv library route: plans price", planned.name, f"({planned.reason}); runs by", here.name, f"({here.reason})")
PY
set +e
xdist=$($PY -c "import xdist" 2> /dev/null && echo "-n 4" || true)  # 16 cores: compiles run beside each other
$PY -m pytest -q -m gpu -rs $xdist --durations=10 --junitxml="$OUT/gpu_tests.xml" tests 2>&1 | tee "$OUT/gpu_tests.log"
status=${PIPESTATUS[0]}
ran=$($PY scripts/gpu_tests_ran.py "$OUT/gpu_tests.xml" 2>&1)
ran_status=$?
echo "$ran" | tee -a "$OUT/gpu_tests.log"
if [ "$ran_status" -ne 0 ] && [ "$status" -eq 0 ]; then
  status=1
fi
step "gpu tests"
for model in bert-small resnet18; do
  $PY -m fusesearch measure "zoo:$model" --backend cupy --device h200 --strategy cpsat --budget 0.1 \
    -o "$OUT/measure_$model.parquet" --force --json > "$OUT/measure_$model.json" 2> "$OUT/measure_$model.err"
  measured=$?
  echo "measure $model: exit $measured"
  if [ "$measured" -ne 0 ]; then
    echo "gpu_check: measure zoo:$model --backend cupy failed (exit $measured): $(head -1 "$OUT/measure_$model.err")" >&2
    status=1
  fi
  $PY - "$OUT/measure_$model.json" <<'PY'
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
    t = doc["totals"]
    how = {}
    for g in doc["groups"]:
        if "timer" in g:
            key = f"{g['timer']}/{g['cache']}"
            how[key] = how.get(key, 0) + 1
    launch = [g["launch_s"] for g in doc["groups"] if g.get("launch_s")]
    print(f"  timer/cache of the plan's figures: {how or 'none'}; empty kernel in a graph "
          f"{launch[0] * 1e6 if launch else float('nan'):.2f} us per launch (reported apart)")
    print(f"  plan measured {t['measured_s'] * 1e6:.1f} us (predicted {t['predicted_s'] * 1e6:.1f} us), "
          f"unfused measured {t['unfused_measured_s'] * 1e6:.1f} us, speedup {t['speedup']:.2f}x, "
          f"not measured {t['not_measured']}, fused loses to library+rest in {t.get('fused_loses')} of "
          f"{t.get('anchor_groups_compared')} anchor groups")
except Exception as exc:  # the .err file says why
    print("  no result:", exc)
PY
done
step "measure"
$PY -m fusesearch run zoo:bert-small --backend cupy --device h200 --json \
  > "$OUT/run_bert-small.json" 2> "$OUT/run_bert-small.err" \
  || { echo "gpu_check: run zoo:bert-small --backend cupy failed: $(head -1 "$OUT/run_bert-small.err")" >&2; status=1; }
$PY - "$OUT/run_bert-small.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
    print(f"run bert-small --backend cupy: plan {d['plan']['median_s'] * 1e6:.1f} us (cuda graph {d['cuda_graph']}), "
          f"unfused {d['unfused']['median_s'] * 1e6:.1f} us, ONNX Runtime ENABLE_ALL "
          f"{d['ort_enable_all']['median_s'] * 1e6:.1f} us on {d['ort_provider']}, max rel err {d['max_rel_err']:.2g}")
    torch = d.get("torch")  # PyTorch eager and torch.compile, each checked equal to ONNX Runtime first
    print("  torch:", torch if isinstance(torch, str) else
          {k: v for k, v in torch.items() if k in ("torch", "triton", "refused", "failed", "retried")})
    for key in ("torch_eager", "torch_compile", "torch_compile_max_autotune"):
        if key in d:
            print(f"  {key}: {d[key]['median_s'] * 1e6:.1f} us (p20 {d[key]['p20_s'] * 1e6:.1f}, "
                  f"p80 {d[key]['p80_s'] * 1e6:.1f}); plan / {key} {d['ratios']['plan_vs_' + key]:.2f}x")
except Exception as exc:  # the .err file says why
    print("run bert-small --backend cupy: no result:", exc)
PY
step "run"
for dtype in float32 float16; do
  bench="bench_gpu_mma_$dtype"
  $PY benchmarks/bench_gpu_mma.py --dtype "$dtype" --out "$OUT/$bench.json" 2>&1 | tee "$OUT/$bench.log"
  if [ "${PIPESTATUS[0]}" -ne 0 ]; then
    echo "gpu_check: benchmarks/bench_gpu_mma.py --dtype $dtype failed: $(grep -m1 -E 'NOT EQUAL|Error|error' "$OUT/$bench.log")" >&2
    status=1
  fi
done
step "bench_gpu_mma"
$PY scripts/tune_tiles.py --quick --out "$OUT/tiles.json" 2>&1 | tee "$OUT/tune_tiles.log"
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
  echo "gpu_check: scripts/tune_tiles.py failed: $(grep -m1 -E 'Error|error|differs' "$OUT/tune_tiles.log")" >&2
  status=1
fi
step "tuned tile sweep ($OUT/tiles.json: commit it beside the device's profile.json)"
if [ "$SECONDS" -gt "$LIMIT_S" ]; then
  echo "gpu_check: took ${SECONDS} s, past its ${LIMIT_S} s limit (estimate ${ESTIMATE_S} s)" >&2
  status=1
fi
if [ "$ran_status" -ne 0 ]; then
  echo "gpu_check: $ran" >&2
fi
exit $status
