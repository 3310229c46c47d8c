"""On a GPU (skipped without one): every generated kernel of zoo plans runs through CuPy, matches
ONNX Runtime within verify's tolerance (the tensor-core kernels within theirs, `mma.TOLERANCE`)
and times sanely (finite, positive, p20 <= median <= p80);
only opaque groups (the library path) may be refused by codegen; `measure --backend cupy` gives a
report that holds everything a CPU report holds (`test_measure.assert_measure_report`)."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from fusesearch.api import plan as make_plan
from fusesearch.backends.codegen import CodegenRefused, generate
from fusesearch.backends.codegen.mma import TOLERANCE
from fusesearch.ir.canonicalize import to_proto
from fusesearch.measure import max_rel_err
from fusesearch.pipeline import prepare
from fusesearch.verify import all_values, random_feeds
from tests.backends.test_measure import VERIFY_RTOL, assert_measure_report

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["bert-small", "resnet18", "yolo-neck"])
def test_every_generated_kernel_matches_ort_on_the_gpu(name):
    from fusesearch.backends import cupy as gpu
    from fusesearch.backends.timing import measure

    prep = prepare(f"zoo:{name}")
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    clock = gpu.CudaEventClock()
    checked: set = set()
    skeletons: set = set()
    for strategy in ("none", "cpsat"):
        for g in make_plan(f"zoo:{name}", device="h200", strategy=strategy, prepared=prep).groups:
            if g.kernel.alias:
                continue
            what = f"{name} {strategy} g{g.id} {'+'.join(g.kernel.ops)}"
            try:
                gk = generate(prep.graph, g.kernel, name=f"g{g.id}")
            except CodegenRefused as exc:
                assert g.kernel.template == "opaque", f"{what}: refused by codegen: {exc}"
                continue
            key = (gk.source_hash, tuple(a.shape for a in gk.inputs))
            if key in checked:
                continue
            checked.add(key)
            skeletons.add(gk.skeleton)
            launch, fetch = gpu.kernel_runner(gk, {a.tensor: values[a.tensor] for a in gk.inputs})
            launch()
            outputs = fetch()
            assert set(outputs) == {a.tensor for a in gk.outputs}, what
            err = max_rel_err(outputs, values)
            tolerance = TOLERANCE.get(gk.skeleton, VERIFY_RTOL)  # tensor cores round their operands
            assert math.isfinite(err) and err < tolerance, f"{what} ({gk.skeleton}): max rel err {err:.3g} vs ONNX Runtime"
            t = measure(launch, clock=clock, budget_s=0.005, warmup_s=0.001, min_samples=5)
            assert t.clock == "cuda_event" and t.n >= 5, what
            assert all(math.isfinite(x) and x > 0 for x in (t.p20_s, t.median_s, t.p80_s)), (what, t)
            assert t.p20_s <= t.median_s <= t.p80_s, (what, t)
    assert len(checked) > 10
    assert any(s.startswith("mma") for s in skeletons), skeletons  # TF32 tensor cores ran


def test_measure_on_the_gpu(run_cli, tmp_path):
    out = tmp_path / "m.parquet"
    code, stdout, err = run_cli("measure", "zoo:bert-small", "--backend", "cupy", "--device", "h200",
                                "--budget", "0.05", "-o", out, "--json")
    assert code == 0, err
    doc, table = json.loads(stdout), pd.read_parquet(out)
    assert doc["backend"] == "cupy" and doc["device"]
    assert_measure_report(doc, table, "zoo:bert-small")
    assert {g["how"] for g in doc["groups"]} >= {"generated"}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_kernels_match_ort_on_the_gpu(dtype):
    """`--dtype`: every generated kernel of bert-small's greedy plan in half precision (cvt PTX for
    float16, bit manipulation for bfloat16) within the dtype's tolerance of ONNX Runtime."""
    from fusesearch.backends import cupy as gpu
    from fusesearch.ir.precision import tolerance
    from fusesearch.ir.shapes import ShapeBindings

    prep = prepare("zoo:bert-small", ShapeBindings.parse(dims=["seq=32"]), dtype=dtype)
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    ran = 0
    for g in make_plan("zoo:bert-small", device="h200", strategy="greedy", prepared=prep).groups:
        if g.kernel.alias or g.kernel.template == "opaque":
            continue
        gk = generate(prep.graph, g.kernel, name=f"g{g.id}")
        launch, fetch = gpu.kernel_runner(gk, {a.tensor: values[a.tensor] for a in gk.inputs})
        launch()
        err = max_rel_err(fetch(), values)
        assert math.isfinite(err) and err <= tolerance(dtype), f"g{g.id} {'+'.join(g.kernel.ops)}: {err:.3g}"
        ran += 1
    assert ran > 10
