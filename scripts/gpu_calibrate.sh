#!/usr/bin/env bash
# Calibrate the cost model on an H200 (issue "Calibration"): at least 300 sampled candidate groups
# of the default GPU models, generated CUDA kernels and library calls timed per launch from CUDA-graph
# replays bracketed by CUDA events (an L2 flush kernel before each launch in the graph, a graph of as
# many flushes alone taken off; the rows' timer, cache and launch_s say so), fitted and reported on held-out groups; ptxas registers compared with the model's.
# Outputs in $OUT (default ./gpu_out): h200.json (the profile, with its fit report),
# measurements.parquet, calibration.png, calibrate.log. Commit the profile afterwards with
#   cp gpu_out/h200.json costmodels/profiles/h200.json
# Packages missing on the GPU machine travel as wheels in .whl/ (see scripts/gpu_check.sh).
# Usage: bash scripts/gpu_calibrate.sh   (about 5 minutes on an H200)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
SAMPLES=${SAMPLES:-320}
mkdir -p "$OUT"
source scripts/gpu_env.sh
$PY -m fusesearch calibrate --backend cupy --device h200 --samples "$SAMPLES" --seed 0 \
  -o "$OUT/h200.json" --force 2>&1 | tee "$OUT/calibrate.log"
exit "${PIPESTATUS[0]}"
