#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU and CuPy 14 (CUDA 13): the gpu-marked tests and
# `fusesearch measure --backend cupy` on two zoo models. Figures and logs go to $OUT (default
# ./gpu_out). It installs nothing from the network: packages missing on the GPU machine travel
# as wheels in .whl/ — fetch them here first (Python 3.12, x86_64), for example:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform any -d .whl \
#     'ortools==9.15.*' 'protobuf>=6.33.1,<6.34' onnx-ir onnxscript typer rich jsonschema \
#     jsonschema-specifications referencing rpds-py attrs absl-py immutabledict ml-dtypes \
#     shellingham click typing-extensions pyarrow hypothesis sortedcontainers
# Usage: bash scripts/gpu_check.sh   (about 5 minutes on an H200)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
python3 -m venv --system-site-packages .gpuvenv
PY=.gpuvenv/bin/python
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install --quiet --no-index --no-deps .whl/*.whl
fi
$PY -m pip install --quiet --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -2 || true
$PY - <<'PY' | tee "$OUT/gpu_env.txt"
from fusesearch.backends import cupy as gpu
print("cupy available:", gpu.available(), "gpus:", gpu.gpu_count())
if gpu.gpu_count():
    print("device:", gpu.device_name(), "L2 bytes:", gpu.l2_bytes())
PY
set +e
$PY -m pytest -q -m gpu -rs tests 2>&1 | tee "$OUT/gpu_tests.log"
status=${PIPESTATUS[0]}
for model in bert-small resnet18; do
  $PY -m fusesearch measure "zoo:$model" --backend cupy --device h200 --strategy cpsat --budget 0.1 \
    -o "$OUT/measure_$model.parquet" --force --json > "$OUT/measure_$model.json" 2> "$OUT/measure_$model.err"
  echo "measure $model: exit $?"
  $PY - "$OUT/measure_$model.json" <<'PY'
import json, sys
try:
    t = json.load(open(sys.argv[1]))["totals"]
    print(f"  plan measured {t['measured_s'] * 1e6:.1f} us (predicted {t['predicted_s'] * 1e6:.1f} us), "
          f"unfused measured {t['unfused_measured_s'] * 1e6:.1f} us, speedup {t['speedup']:.2f}x, "
          f"not measured {t['not_measured']}, fused loses to library+rest in {t.get('fused_loses')} of "
          f"{t.get('anchor_groups_compared')} anchor groups")
except Exception as exc:  # the .err file says why
    print("  no result:", exc)
PY
done
exit $status
