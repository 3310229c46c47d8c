"""On a GPU (skipped without one): every generated kernel of zoo plans runs through CuPy and
matches ONNX Runtime, and `measure --backend cupy` works."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fusesearch.api import plan as make_plan
from fusesearch.backends.codegen import CodegenRefused, generate
from fusesearch.ir.canonicalize import to_proto
from fusesearch.pipeline import prepare
from fusesearch.verify import all_values, random_feeds

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["bert-small", "resnet18", "yolo-neck"])
def test_every_generated_kernel_matches_ort_on_the_gpu(name):
    from fusesearch.backends import cupy as gpu

    prep = prepare(f"zoo:{name}")
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    checked = 0
    for strategy in ("none", "cpsat"):
        for g in make_plan(f"zoo:{name}", device="h200", strategy=strategy, prepared=prep).groups:
            try:
                gk = generate(prep.graph, g.kernel, name=f"g{g.id}")
            except CodegenRefused:
                continue
            launch, fetch = gpu.kernel_runner(gk, {a.tensor: values[a.tensor] for a in gk.inputs})
            launch()
            for tensor, got in fetch().items():
                ref = values[tensor]
                scale = max(1.0, float(np.max(np.abs(ref)))) if ref.size else 1.0
                np.testing.assert_allclose(got.astype(np.float64), ref.astype(np.float64), rtol=0,
                                           atol=1e-4 * scale, err_msg=f"{name} {strategy} g{g.id}")
            checked += 1
    assert checked > 10


def test_measure_on_the_gpu(run_cli, tmp_path):
    code, out, err = run_cli("measure", "zoo:bert-small", "--backend", "cupy", "--device", "h200",
                             "--budget", "0.05", "-o", tmp_path / "m.parquet", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["totals"]["measured_s"] > 0
    assert all(g["max_rel_err"] < 1e-4 for g in doc["groups"] if g["how"] == "generated")
