"""`fusesearch measure` on the CPU backend: every kernel runs on real data and matches ONNX
Runtime; JSON and Parquet outputs; a GPU run is refused with a reason on a machine without one."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from onnx import helper

from fusesearch.backends import cpu
from tests.conftest import make_model, save

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler")


@pytest.fixture
def small_model(tmp_path):
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             helper.make_node("Add", ["m", "b"], ["a"], name="bias"),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r4"], ["p"], kernel_shape=[2], name="pool"),
             helper.make_node("Softmax", ["r"], ["y"], axis=-1, name="sm"),
             helper.make_node("Unsqueeze", ["r", "ax"], ["r4"], name="unsq")]
    inits = [("w", rng.standard_normal((32, 64)).astype(np.float32)), ("b", np.zeros(64, np.float32)),
             ("ax", np.int64([1]))]
    nodes = [nodes[0], nodes[1], nodes[2], nodes[5], nodes[3], nodes[4]]
    return save(make_model(nodes, [("x", [16, 32])], [("y", None), ("p", None)], inits), tmp_path / "m.onnx")


def test_measure_json_and_parquet(run_cli, tmp_path, small_model):
    out = tmp_path / "m.parquet"
    code, stdout, err = run_cli("measure", small_model, "--backend", "cpu", "--strategy", "greedy",
                                "--budget", "0.01", "-o", out, "--json")
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["backend"] == "cpu" and doc["groups"]
    for g in doc["groups"]:
        assert g["measured_s"] >= 0 and g["max_rel_err"] < 1e-4
        assert g["p20_s"] <= g["measured_s"] <= g["p80_s"]
    hows = {g["how"] for g in doc["groups"]}
    assert "generated" in hows and "library" in hows  # MaxPool runs as a library call
    totals = doc["totals"]
    assert totals["measured_s"] > 0 and totals["unfused_measured_s"] > 0 and totals["speedup"] > 0
    table = pd.read_parquet(out)
    assert set(table["plan"]) == {"plan", "unfused"}
    assert {"template", "tc_flops", "dram_read_bytes", "predicted_s", "median_s", "p20_s", "p80_s"} <= set(table.columns)
    assert (table["max_rel_err"] < 1e-4).all()


def test_ptxas_resources_beside_the_estimate_and_cached_timings(run_cli, tmp_path, small_model, monkeypatch):
    from fusesearch.backends import nvrtc

    if not nvrtc.toolchain_available():
        pytest.skip("no CUDA compiler")
    monkeypatch.setenv("FUSESEARCH_CACHE", str(tmp_path / "cache"))
    tables = []
    for k in range(2):
        out = tmp_path / f"m{k}.parquet"
        code, _, err = run_cli("measure", small_model, "--device", "h100-sxm", "--strategy", "greedy", "--ptxas",
                               "--budget", "0.01", "-o", out)
        assert code == 0, err
        tables.append(pd.read_parquet(out))
    generated = tables[0][tables[0]["how"] == "generated"]
    assert (generated["ptxas_registers"] > 0).all() and (generated["ptxas_arch"] == "sm_90").all()
    assert {"predicted_regs_per_thread", "ptxas_spill_bytes", "ptxas_smem_bytes"} <= set(generated.columns)
    second = tables[1][tables[1]["how"] == "generated"]
    assert list(second["median_s"]) == list(generated["median_s"])  # the second run read the cache


def test_measure_text_summary_and_plan_file(run_cli, tmp_path, small_model):
    plan_path = tmp_path / "plan.json"
    assert run_cli("plan", small_model, "--device", "host", "--strategy", "greedy", "-o", plan_path)[0] == 0
    code, stdout, err = run_cli("measure", small_model, "--plan", plan_path, "--budget", "0.01")
    assert code == 0, err
    assert "measured speedup" in stdout


def test_measure_on_gpu_without_one_is_bad_input(run_cli, small_model):
    from fusesearch.backends import cupy as gpu

    if gpu.available():
        pytest.skip("a GPU is present")
    code, _, err = run_cli("measure", small_model, "--backend", "cupy", "--budget", "0.01")
    assert code == 2 and "--backend cupy" in err and len(err.strip().splitlines()) == 1
