"""Calibration: sampling, split, metrics, the fit, the register model, profiles and their checks.

The end-to-end test runs `fusesearch calibrate --backend cpu` in a subprocess (OMP_NUM_THREADS=1,
so that the shared machine's load does not time the scheduler) on a small sample of bert-small
and checks that the profile it wrote predicts exactly what its report says. Whether fitting
lowers the held-out MAPE is checked on the same kind of sample with fixed times (made by known
parameters): measured times say how busy the machine was as much as how good the fit is.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from costmodels import (
    DEVICES,
    KernelSpec,
    Profile,
    RooflineModel,
    RooflineParams,
    host_cpu,
    load_device,
    load_profile,
    save_profile,
)
from costmodels import calibration as cmcal
from fusesearch import calibrate as cal
from fusesearch.backends.registry import get_backend
from fusesearch.pipeline import prepare
from tests.conftest import gpu_available

# -- metrics, split, sampling -------------------------------------------------------------------

def test_rank_correlations_match_their_definitions():
    """Metrics: Spearman / Kendall are 1 for the same order, -1 reversed; ties handled (tau-b)."""
    a = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert cal.spearman(a, [10, 20, 30, 40, 50]) == pytest.approx(1.0)
    assert cal.kendall(a, [5, 4, 3, 2, 1]) == pytest.approx(-1.0)
    # one discordant pair of 10: tau = (9 - 1) / 10
    assert cal.kendall(a, [1, 2, 3, 5, 4]) == pytest.approx(0.8)
    # Spearman of ranks 1,2,3,5,4: 1 - 6 * 2 / (5 * 24)
    assert cal.spearman(a, [1, 2, 3, 5, 4]) == pytest.approx(0.9)
    assert cal.kendall([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / math.sqrt(2 * 3))
    acc = cal.accuracy([1.5, 2.0, 2.0], [1.0, 2.0, 4.0])
    assert acc["mape"] == pytest.approx((0.5 + 0 + 0.5) / 3) and acc["median_ape"] == 0.5


def test_the_guard_error_is_a_factor_off_either_way():
    """`error_factor`, the guard's judge: 1 when exact, the same for 2x too slow and 2x too fast,
    so predictions 4x too fast every time are judged worse than 2x too slow every time (which the
    APE, capped at 100% for a fast prediction, judges the other way round)."""
    assert cmcal.error_factor([1.0, 3.0], [1.0, 3.0]) == 1.0
    assert cmcal.error_factor([2.0], [1.0]) == pytest.approx(2.0) == cmcal.error_factor([0.5], [1.0])
    measured = [1.0, 2.0, 4.0]
    fast, slow = [m / 4 for m in measured], [m * 2 for m in measured]
    assert cmcal.error_factor(fast, measured) == pytest.approx(4.0)
    assert cmcal.error_factor(slow, measured) == pytest.approx(2.0)
    assert cmcal.accuracy(fast, measured)["mape"] < cmcal.accuracy(slow, measured)["mape"]
    assert cmcal.accuracy(slow, measured)["error_factor"] == pytest.approx(2.0)


def test_split_is_by_group_seeded_and_covers_every_template():
    """Split: a group is never on both sides; the same seed gives the same split; each template
    with at least two groups has held-out rows."""
    groups = [f"g{i}" for i in range(20)] + ["g0", "g1"]
    templates = ["pointwise"] * 10 + ["rowwise"] * 10 + ["pointwise", "pointwise"]
    held = cal.split_groups(groups, templates, seed=3)
    for g in set(groups):
        assert len({bool(h) for gg, h in zip(groups, held, strict=True) if gg == g}) == 1
    assert np.array_equal(held, cal.split_groups(groups, templates, seed=3))
    assert not np.array_equal(held, cal.split_groups(groups, templates, seed=4))
    for t in ("pointwise", "rowwise"):
        assert any(h for h, tt in zip(held, templates, strict=True) if tt == t)


def test_cross_validation_folds_are_by_group_and_seeded():
    """Folds: a group's rows share a fold, every fold is used, the same seed gives the same folds."""
    from costmodels.calibration import group_folds

    groups = [f"g{i % 7}" for i in range(20)]
    folds = group_folds(groups, 3, seed=0)
    assert all(len({f for g, f in zip(groups, folds, strict=True) if g == key}) == 1 for key in set(groups))
    assert set(folds) == {0, 1, 2}
    assert np.array_equal(folds, group_folds(groups, 3, seed=0))
    assert any(not np.array_equal(folds, group_folds(groups, 3, seed=s)) for s in (1, 2, 3))


def test_sampling_is_stratified_deterministic_and_distinct():
    """Sampling: every generated template of the model appears, across size bins; the same seed
    gives the same groups; no two sampled kernels have the same KernelSpec."""
    preps = {"bert-small": prepare("zoo:bert-small")}
    device = DEVICES["h100-sxm"]
    a = cal.sample_candidates(preps, device, RooflineParams(), 24, seed=1)
    b = cal.sample_candidates(preps, device, RooflineParams(), 24, seed=1)
    assert [c.key for c in a.candidates] == [c.key for c in b.candidates]
    assert len(a.candidates) == 24
    assert {c.template for c in a.candidates} == {"pointwise", "rowwise", "gemm"}
    assert len({c.size_bin for c in a.candidates if c.template == "gemm"}) == cal.SIZE_BINS
    specs = [json.dumps(c.kernel.spec().to_row(), sort_keys=True) for c in a.candidates]
    assert len(set(specs)) == len(specs)
    assert a.counts["enumerated"] > 100


# -- the fit ------------------------------------------------------------------------------------

def _synthetic(n: int, seed: int) -> list[KernelSpec]:
    rng = np.random.default_rng(seed)
    specs = []
    for i in range(n):
        template = ("pointwise", "rowwise", "gemm")[i % 3]
        size = float(10 ** rng.uniform(3, 7))
        specs.append(KernelSpec(template=template, scalar_flops=size * rng.uniform(1, 8),
                                tc_flops=size * 200 if template == "gemm" else 0.0,
                                transcendentals=size * rng.uniform(0, 1) if template == "rowwise" else 0,
                                dram_read_bytes=4 * size, dram_write_bytes=4 * size,
                                iteration_size=int(size), index_divisions=int(rng.integers(0, 5))))
    return specs


def test_fit_recovers_known_parameters_on_held_out_kernels():
    """Fit: times made by known parameters (x 5% noise) are fitted from the defaults; held-out
    error falls from tens of percent to about the noise."""
    device = host_cpu()
    truth = RooflineParams().with_updates(
        memory_efficiency={"pointwise": 0.3, "rowwise": 0.2, "gemm": 0.5},
        scalar_efficiency={"pointwise": 0.05, "rowwise": 0.03, "gemm": 0.1},
        tc_efficiency={"gemm": 0.08}, launch_overhead_scale=3.0, transcendental_flops=40.0,
        index_division_flops=2.0)
    rng = np.random.default_rng(0)
    train, held = _synthetic(60, 1), _synthetic(30, 2)
    noisy = lambda specs: cal.predict(specs, device, truth) * rng.lognormal(0, 0.05, len(specs))  # noqa: E731
    result = cal.fit(train, noisy(train), device)
    measured = noisy(held)
    before = cal.accuracy(cal.predict(held, device, RooflineParams()), measured)
    after = cal.accuracy(cal.predict(held, device, result.params), measured)
    assert before["mape"] > 0.5
    assert after["mape"] < 0.1 and after["spearman"] > 0.98
    assert result.train_loss_after < result.train_loss_before
    assert "occupancy_knee.gemm" not in result.fitted  # moves nothing on a CPU
    assert set(result.fitted) >= {"memory_efficiency.pointwise", "overlap", "launch_overhead_scale",
                                  "index_division_flops", "transcendental_flops"}


def test_register_fit_lowers_the_error_against_ptxas_figures():
    """Register model: regs = 30 + 0.5 x live values (ptxas-like, rounded) is recovered from
    defaults (16 + 1 x live) and the held-out error falls."""
    live = list(range(4, 64, 2))
    ptxas = [round(30 + 0.5 * v) for v in live]
    held = [i % 4 == 0 for i in range(len(live))]
    report = cal.fit_registers(live, [4] * len(live), ptxas, held, RooflineParams())
    assert report["params_after"]["regs_base"] == pytest.approx(30, abs=1)
    assert report["params_after"]["regs_per_live_value"] == pytest.approx(0.5, abs=0.05)
    assert report["heldout"]["after"]["mae"] < 1 < report["heldout"]["before"]["mae"]


# a fixed CPU (no bandwidth probe), so the synthetic fits below do not depend on the machine
_CPU = replace(DEVICES["t4"], name="host", kind="cpu", sm_count=1, dram_bytes_per_s=20e9,
               fp32_flops_per_s=80e9, tf32_flops_per_s=0.0, fp16_flops_per_s=0.0, bf16_flops_per_s=0.0,
               launch_overhead_s=3e-6)
_EFFICIENCIES = ("tc_efficiency", "scalar_efficiency", "memory_efficiency")


def test_fitted_efficiencies_never_exceed_their_peak():
    """Bounds: kernels measured 3x faster than the peak allows (compute-bound and memory-bound)
    fit an efficiency of at most 1, not the 3 that would match them."""
    compute = [KernelSpec(template="pointwise", scalar_flops=1e7 * (i + 1), dram_read_bytes=64,
                          dram_write_bytes=64, iteration_size=1000) for i in range(8)]
    memory = [KernelSpec(template="rowwise", scalar_flops=10, dram_read_bytes=1e7 * (i + 1),
                         dram_write_bytes=1e6, iteration_size=1000) for i in range(8)]
    peak = RooflineParams().with_updates(scalar_efficiency={"pointwise": 1.0}, memory_efficiency={"rowwise": 1.0},
                                         launch_overhead_scale=1e-3)
    specs = compute + memory
    measured = cal.predict(specs, _CPU, peak) / 3
    names = ["scalar_efficiency.pointwise", "memory_efficiency.rowwise"]
    result = cal.fit(specs, measured, _CPU, names=names)
    assert result.params.get("scalar_efficiency", "pointwise") == pytest.approx(1.0, rel=1e-3)
    assert result.params.get("memory_efficiency", "rowwise") == pytest.approx(1.0, rel=1e-3)
    assert max(v for table in _EFFICIENCIES for _, v in getattr(result.params, table)) <= 1.0


def _rows(noise: str, seed: int = 0) -> list[dict]:
    """Measured rows (as `measure_candidates` returns them) of pointwise and gemm kernels: the
    pointwise times follow known parameters (x 5% noise); the gemm times follow the default
    parameters, in every row but one training kernel timed 1000x slow ("outlier": a fit that
    trains on it is worse on the kernels left out, which cross-validation sees), or in the held-out
    rows only ("heldout": the training gemm kernels follow the known parameters, which the held-out
    ones do not)."""
    rng = np.random.default_rng(seed)
    truth = RooflineParams().with_updates(memory_efficiency={"pointwise": 0.3, "gemm": 0.5},
                                          scalar_efficiency={"pointwise": 0.05}, tc_efficiency={"gemm": 0.1},
                                          launch_overhead_scale=3.0)
    specs, groups = [], []
    for i in range(26):
        size = float(10 ** rng.uniform(3, 7))
        template = "pointwise" if i % 2 else "gemm"
        flops = {"scalar_flops": 2 * size} if template == "pointwise" else {"tc_flops": 2000 * size}
        specs.append(KernelSpec(template=template, dram_read_bytes=8 * size, dram_write_bytes=4 * size,
                                iteration_size=int(size), **flops))
        groups.append(f"m:{template}{i}")
    templates = [s.template for s in specs]
    held = cal.split_groups(groups, templates, seed=0)  # the split `analyse` makes with seed 0
    measured = cal.predict(specs, _CPU, truth) * rng.lognormal(0, 0.05, len(specs))
    defaults = cal.predict(specs, _CPU, RooflineParams())
    for i, (t, h) in enumerate(zip(templates, held, strict=True)):
        if t == "gemm" and (noise == "outlier" or h):
            measured[i] = defaults[i]
    if noise == "outlier":
        measured[next(i for i, (t, h) in enumerate(zip(templates, held, strict=True)) if t == "gemm" and not h)] *= 1000
    return [{**s.to_row(), "model": "m", "group": g, "measured_s": float(m)}
            for s, g, m in zip(specs, groups, measured, strict=True)]


@pytest.mark.parametrize("noise, by, what", [
    ("outlier", "cross-validation", "cross-validated (training folds) error factor would rise"),
    ("heldout", "held-out", "held-out error factor would rise"),
])
def test_a_template_the_fit_would_make_worse_keeps_its_defaults(noise, by, what):
    """Keep defaults: gemm times that a fit would predict worse than the defaults — the defaults'
    times with one training kernel 1000x slow (cross-validation on the training kernels sees it),
    or the defaults' times on the held-out kernels only (the held-out check sees it) — leave gemm's
    parameters at their defaults, the report says so with both error factors, and
    held-out gemm is not worse than the defaults; pointwise is fitted; no efficiency exceeds 1."""
    start = RooflineParams()
    result = cal.analyse(_rows(noise), _CPU, start, "cpu", 0)
    kept = result.report["kept_defaults"]
    assert set(kept) == {"gemm"} and kept["gemm"]["by"] == by
    assert kept["gemm"]["fitted_error"] > kept["gemm"]["kept_error"] >= 1
    params = result.profile.params
    for table in ("tc_efficiency", "scalar_efficiency", "memory_efficiency"):
        assert params.get(table, "gemm") == start.get(table, "gemm")
    assert params.get("memory_efficiency", "pointwise") != start.get("memory_efficiency", "pointwise")
    assert max(v for table in _EFFICIENCIES for _, v in getattr(params, table)) <= 1.0
    gemm = result.report["heldout"]["per_template"]["gemm"]  # defaults kept: the held-out kernels follow them
    assert gemm["before"]["error_factor"] == pytest.approx(1.0) and gemm["after"]["error_factor"] < 1.05
    pointwise = result.report["heldout"]["per_template"]["pointwise"]
    assert pointwise["after"]["mape"] < 0.2 < pointwise["before"]["mape"]
    line = next(x for x in cal.report_lines(result.report) if "kept defaults" in x)
    assert line.split()[0] == "gemm" and what in line
    assert f"{kept['gemm']['kept_error']:.3f}x" in line and f"{kept['gemm']['fitted_error']:.3f}x" in line
    assert json.loads(json.dumps(result.profile.to_dict()))["fit"]["kept_defaults"]["gemm"]["by"] == by


def test_a_first_stage_the_fit_would_make_worse_keeps_its_defaults():
    """Keep the first stage: anchor-free kernels whose times are noise about the defaults'
    predictions (a tenth to 10x; the gemm kernels follow known parameters) leave the shared terms
    and the anchor-free templates' own parameters at their defaults, by cross-validation over every
    kernel, and the report says so."""
    start = RooflineParams()
    rows = _rows("none")
    noise = np.random.default_rng(10)
    for row in rows:
        if row["template"] == "pointwise":
            row["measured_s"] = float(cal.predict([KernelSpec.from_row(row)], _CPU, start)[0] * 10 ** noise.uniform(-1, 1))
    result = cal.analyse(rows, _CPU, start, "cpu", 0)
    kept = result.report["kept_defaults"]["shared terms"]
    assert kept["by"] == "cross-validation" and kept["fitted_error"] > kept["kept_error"]
    params = result.profile.params
    for name in ("overlap", "launch_overhead_scale", "index_division_flops", "read_traffic_factor"):
        assert getattr(params, name) == getattr(start, name)
    for table in ("scalar_efficiency", "memory_efficiency"):
        assert params.get(table, "pointwise") == start.get(table, "pointwise")
    assert any(line.split()[:2] == ["shared", "terms"] for line in cal.report_lines(result.report))


# -- end to end on the CPU ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory):
    """`fusesearch calibrate --backend cpu` on 28 groups of bert-small (about 30-60 s)."""
    folder = tmp_path_factory.mktemp("calibration")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "fusesearch", "calibrate", "--backend", "cpu", "--models", "bert-small",
            "--samples", "28", "--seed", "0", "--rounds", "2", "--budget", "0.01",
            "-o", str(folder / "profile.json")]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return folder, done.stdout


def test_calibration_on_the_cpu_writes_a_profile_that_predicts_what_its_report_says(cpu_profile):
    """Calibration end to end: the held-out and training kernels are split as reported, and the
    written profile predicts exactly the held-out figures its report gives; where the shared terms
    kept their defaults, the anchor-free kernels are predicted exactly as before the fit. How good
    the fit is on measured times depends on the machine's load: checked on fixed times below."""
    folder, stdout = cpu_profile
    assert "held-out" in stdout and "profile written to" in stdout
    profile = load_profile(folder / "profile.json")
    held = profile.fit["heldout"]
    assert profile.fit["n_heldout"] >= 6 and profile.fit["n_train"] >= 14
    frame = pd.read_parquet(folder / "measurements.parquet")
    rows = frame[frame["split"] == "heldout"]
    assert len(rows) == profile.fit["n_heldout"] and (frame["split"] == "train").sum() == profile.fit["n_train"]
    specs = [KernelSpec.from_row(r) for r in rows.to_dict("records")]
    model = RooflineModel(profile.params)
    predicted = np.array([model.cost(s, profile.device).time_s for s in specs])
    assert cal.accuracy(predicted, rows["measured_s"])["mape"] == pytest.approx(held["after"]["mape"])
    free = rows["template"].isin(["pointwise", "rowwise"]).to_numpy()
    assert free.sum() >= 4
    if cal.SHARED_TERMS in profile.fit["kept_defaults"]:  # the whole first stage at its defaults, said so
        assert predicted[free] == pytest.approx(rows["predicted_before_s"].to_numpy()[free], rel=1e-12)
        assert any("kept defaults" in line for line in stdout.splitlines())
    assert (folder / "calibration.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert profile.backend == "cpu" and profile.device.name == "host" and profile.device.sm_count == 1
    assert {"fusesearch", "numpy", "onnxruntime", "cc"} <= set(profile.versions)


def test_calibration_lowers_held_out_mape_on_bert_small_kernels_timed_by_known_parameters():
    """The fit on the kernels the CPU calibration samples from bert-small (28, seed 0), with times
    made by known parameters (x 5% noise, seeded) in place of measured ones: the held-out MAPE
    falls, overall and for each anchor-free template to about the noise."""
    start = RooflineParams()
    sample = cal.sample_candidates({"bert-small": prepare("zoo:bert-small")}, _CPU, start, 28, seed=0)
    truth = start.with_updates(memory_efficiency={"pointwise": 0.3, "rowwise": 0.2, "gemm": 0.5},
                               scalar_efficiency={"pointwise": 0.05, "rowwise": 0.03}, library_efficiency={"gemm": 0.3},
                               launch_overhead_scale=3.0, transcendental_flops=40.0)
    specs = [c.kernel.spec() for c in sample.candidates]
    measured = cal.predict(specs, _CPU, truth) * np.random.default_rng(0).lognormal(0, 0.05, len(specs))
    rows = [{**s.to_row(), "model": c.model, "group": c.key, "measured_s": float(m)}
            for s, c, m in zip(specs, sample.candidates, measured, strict=True)]
    result = cal.analyse(rows, _CPU, start, "cpu", 0)
    held = result.report["heldout"]
    assert result.report["n_heldout"] >= 6 and {"pointwise", "rowwise"} <= set(held["per_template"])
    assert held["after"]["mape"] < 0.5 * held["before"]["mape"]
    for template in ("pointwise", "rowwise"):
        figures = held["per_template"][template]
        assert figures["after"]["mape"] < 0.15 < figures["before"]["mape"], (template, figures)


def test_library_calls_are_timed_through_the_library(cpu_profile):
    """A lone MatMul is a library call in a plan (priced with `library_efficiency`): calibration
    samples such calls as a kind of their own and times ONNX Runtime's kernel for them, checked
    against its own values, never the generated fallback; every generated row is generated code."""
    folder, _ = cpu_profile
    frame = pd.read_parquet(folder / "measurements.parquet")
    library = frame[frame["impl"] == "library"]
    assert len(library) >= 2, frame[["group", "impl"]]
    assert set(library["how"]) == {"library"}
    assert library["source_hash"].str.startswith("library:MatMul:").any()
    assert (library["max_rel_err"] < 1e-4).all()
    assert set(frame.loc[frame["impl"] == "generated", "how"]) == {"generated"}
    profile = load_profile(folder / "profile.json")
    assert any(key.startswith("pool.gemm/library.") for key in profile.fit["sampling"])


def test_the_library_runs_what_the_generated_fallback_would_compute():
    """The calibration runner on the cpu backend, on a lone anchor, runs ONNX Runtime's node (no generated source) and
    hands back the same values as the model; a fused group runs its generated kernel."""
    prep = prepare("zoo:bert-small")
    md = cal._model_data(prep, 0)
    sample = cal.sample_candidates({"bert-small": prep}, host_cpu(), RooflineParams(), 40, seed=0)
    lone = [c for c in sample.candidates if cal.runs_through_library(c.kernel)]
    fused = [c for c in sample.candidates if not cal.runs_through_library(c.kernel)]
    assert lone and fused
    for cand, how in ((lone[0], "library"), (fused[0], "generated")):
        call = cal._Runner(get_backend("cpu")).prepare(cand, md)
        assert call.how == how and call.source_hash.startswith("library:") == (how == "library")
        call.run()
        got = call.fetch()
        assert set(got) == set(cand.kernel.outputs)
        for t, y in got.items():
            np.testing.assert_allclose(y, md.values[t], rtol=1e-4, atol=1e-4)


def test_profile_round_trips_through_json(cpu_profile, tmp_path):
    """Serialization: the calibrated profile saves and loads to the same device, params and fit."""
    folder, _ = cpu_profile
    profile = load_profile(folder / "profile.json")
    again = load_profile(save_profile(profile, tmp_path / "again.json"))
    assert again.device == profile.device and again.params == profile.params
    assert again.fit == profile.fit and again.backend == "cpu"
    assert (tmp_path / "again.json").read_text() == (folder / "profile.json").read_text()
    assert load_device(str(folder / "profile.json")) == (profile.device, profile.params)


def test_plan_and_compare_accept_a_profile_and_record_it(cpu_profile, run_cli, tmp_path):
    """Using a profile: plan writes which profile it used into plan.json; compare accepts it."""
    folder, _ = cpu_profile
    path = str(folder / "profile.json")
    code, _, err = run_cli("plan", "zoo:bert-small", "--device", path, "--strategy", "greedy",
                           "-o", tmp_path / "plan.json")
    assert code == 0, err
    doc = json.loads((tmp_path / "plan.json").read_text())
    device = doc["device"]
    assert (device["name"], device["profile"], device["threads"]) == ("host", path, 1)  # calibrated at 1 thread
    assert device["profile_sha256"] == hashlib.sha256(Path(path).read_bytes()).hexdigest()
    assert "figures_file" not in device  # the profile's figures, not this machine's cache
    code, out, err = run_cli("compare", "zoo:bert-small", "--device", f"h100-sxm,{path}",
                             "--strategies", "none,greedy", "--json")
    assert code == 0, err
    assert {r["device"] for r in json.loads(out)["results"]} == {"h100-sxm", path}


# -- a profile cannot silently be used as another device ----------------------------------------

def _host_profile(tmp_path, **changes) -> str:
    device = replace(host_cpu(1), **changes)
    return str(save_profile(Profile(device, RooflineParams(), backend="cpu"), tmp_path / "host.json"))


def test_measure_refuses_a_profile_of_another_device(run_cli, tmp_path):
    """Name check: a GPU profile on the cpu backend, and a cpu profile on the cupy backend, exit 2
    with one line naming both devices."""
    gpu = str(save_profile(Profile(DEVICES["h200"], RooflineParams(), backend="cupy"), tmp_path / "h200.json"))
    code, _, err = run_cli("measure", "zoo:bert-small", "--backend", "cpu", "--device", gpu)
    assert code == 2 and "calibrated with --backend cupy on 'h200'" in err and err.count("\n") == 1
    code, _, err = run_cli("measure", "zoo:bert-small", "--backend", "cupy", "--device", _host_profile(tmp_path))
    assert code == 2 and "--backend cpu on 'host'" in err and "Traceback" not in err
    renamed = str(save_profile(Profile(DEVICES["h200"], RooflineParams(), backend="cpu"), tmp_path / "x.json"))
    code, _, err = run_cli("measure", "zoo:bert-small", "--backend", "cpu", "--device", renamed)
    assert code == 2 and "is for device 'h200'" in err and "measures 'host'" in err


def test_measure_uses_a_profile_of_this_host(run_cli, tmp_path):
    """Using a profile: `measure --device profile.json` on the device it describes runs, and its
    predictions are the profile's (a scaled launch overhead shows in every predicted time)."""
    from onnx import helper

    from tests.conftest import make_model, save

    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Softmax", ["r"], ["y"], axis=-1, name="sm")]
    model = save(make_model(nodes, [("x", [8, 64])], [("y", None)]), tmp_path / "m.onnx")
    slow = RooflineParams().with_updates(launch_overhead_scale=1000.0)
    path = str(save_profile(Profile(host_cpu(1), slow, backend="cpu"), tmp_path / "host.json"))
    code, out, err = run_cli("measure", model, "--backend", "cpu", "--device", path, "--strategy", "none",
                             "--budget", "0.005", "--no-cache", "--json")
    assert code == 0, err
    launch = host_cpu(1).launch_overhead_s * 1000.0
    assert all(g["predicted_s"] >= launch for g in json.loads(out)["groups"])


def test_a_host_profile_needs_the_same_thread_count(run_cli, tmp_path):
    """Name check, host: a profile calibrated with another OpenMP thread count is refused."""
    path = _host_profile(tmp_path, sm_count=host_cpu(1).sm_count + 3)
    code, _, err = run_cli("measure", "zoo:bert-small", "--backend", "cpu", "--device", path)
    assert code == 2 and "--threads 4" in err and "this run uses 1" in err  # --threads: 1 by default


def test_calibrate_refuses_bad_input_with_one_line(run_cli, tmp_path):
    """Bad input: a GPU name on the cpu backend, an unknown backend, too few samples, an existing
    output file: exit 2, one line, no traceback."""
    out = tmp_path / "p.json"
    cases = [(("--backend", "cpu", "--device", "h100-sxm"), "measures 'host', not 'h100-sxm'"),
             (("--backend", "tpu"), "choose one of cpu, cupy"),
             (("--backend", "cpu", "--samples", "2"), "--samples 2"),
             (("--backend", "cpu", "--models", "no-such-model", "--samples", "8"), "no-such-model")]
    for args, message in cases:
        code, _, err = run_cli("calibrate", *args, "-o", out)
        assert code == 2 and message in err and err.count("\n") == 1, (args, err)
    out.write_text("{}")
    code, _, err = run_cli("calibrate", "--backend", "cpu", "-o", out)
    assert code == 2 and "--force" in err


@pytest.mark.skipif(gpu_available(), reason="a GPU is present: the cupy path runs")
def test_calibrate_on_cupy_without_a_gpu_exits_2(run_cli, tmp_path):
    """No GPU: `calibrate --backend cupy` says why in one line and exits 2."""
    code, _, err = run_cli("calibrate", "--backend", "cupy", "-o", tmp_path / "p.json")
    assert code == 2 and "--backend cupy" in err and "use --backend cpu" in err


def test_gpu_names_map_to_the_device_table():
    """Device names: CUDA's names map to table entries (the profile's device)."""
    assert cal.table_name_for_gpu("NVIDIA H200") == "h200"
    assert cal.table_name_for_gpu("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert cal.table_name_for_gpu("NVIDIA H100 PCIe") == "h100-pcie"
    assert cal.table_name_for_gpu("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert cal.table_name_for_gpu("Tesla T4") == "t4"
    assert cal.table_name_for_gpu("NVIDIA GeForce RTX 4090") == "rtx-4090"
    assert cal.table_name_for_gpu("NVIDIA L4") == "l4" and cal.table_name_for_gpu("NVIDIA L40S") == "l40s"
    assert cal.table_name_for_gpu("Some Future GPU") is None


def test_a_templates_library_calls_keep_their_defaults_apart():
    """Parts: a template's library calls (`conv/library`) are judged apart from its generated
    kernels; keeping one part's defaults restores only its own parameters."""
    assert cal.part_of(KernelSpec(template="conv", impl="library", tc_flops=1e6)) == "conv/library"
    assert cal.part_of(KernelSpec(template="conv", tc_flops=1e6)) == "conv"
    start = RooflineParams()
    fitted = start.with_updates(library_efficiency={"conv": 0.3}, tc_efficiency={"conv": 0.9},
                                memory_efficiency={"conv": 0.4})
    library = cal.keep_start(fitted, start, "conv/library")
    assert library.get("library_efficiency", "conv") == start.get("library_efficiency", "conv")
    assert library.get("tc_efficiency", "conv") == 0.9 and library.get("memory_efficiency", "conv") == 0.4
    generated = cal.keep_start(fitted, start, "conv")
    assert generated.get("library_efficiency", "conv") == 0.3
    assert generated.get("tc_efficiency", "conv") == start.get("tc_efficiency", "conv")
    assert generated.get("memory_efficiency", "conv") == start.get("memory_efficiency", "conv")


def test_the_fit_separates_two_products_of_one_template():
    """Gemm kernels timed on a CPU through our micro-kernel and through the BLAS, the BLAS at 0.6x
    our rate: the fit keeps the most sampled product's factor at 1 (the template's efficiency
    carries it) and recovers the other's."""
    device = replace(DEVICES["t4"], name="pinned-cpu", kind="cpu")
    truth = RooflineParams().with_updates(**{"tc_efficiency.gemm": 0.3, "product_efficiency.blas": 0.6})
    specs = [KernelSpec("gemm", tc_flops=2.0 * n ** 3, dram_read_bytes=8.0 * n * n, dram_write_bytes=4.0 * n * n,
                        iteration_size=n * n, reduction_length=n, product=product)
             for n in (256, 384, 512, 768, 1024) for product in ("own", "own", "blas")]
    names = cmcal.free_parameters(specs, device)
    assert "product_efficiency.blas" in names and "product_efficiency.own" not in names
    result = cmcal.fit(specs, cmcal.predict(specs, device, truth), device)
    assert result.params.get("product_efficiency", "own") == 1.0
    assert result.params.get("product_efficiency", "blas") == pytest.approx(0.6, rel=0.05)
    assert result.params.get("tc_efficiency", "gemm") == pytest.approx(0.3, rel=0.05)


def test_on_a_cpu_each_gemm_product_is_in_the_sampling_pool():
    """On a CPU a fused gemm group is in the pool once per C product it can run as: bert-small's
    sample holds gemm kernels through our micro-kernel and through the BLAS."""
    preps = {"bert-small": prepare("zoo:bert-small")}
    device = replace(DEVICES["t4"], name="pinned-cpu", kind="cpu")
    sample = cal.sample_candidates(preps, device, RooflineParams(), 24, seed=1)
    assert {c.kernel.schedule.product for c in sample.candidates if c.kernel.impl == "generated"
            and c.template == "gemm"} == {"own", "blas"}
    pool = cal.enumerate_pool(preps, device, RooflineParams(), ("gemm",))
    products: dict[frozenset, set] = {}
    for _, nodes, kernel in pool:
        products.setdefault(nodes, set()).add(kernel.schedule.product)
    assert any(p == {"own", "blas"} for p in products.values())
    assert all(len(p) == 1 for nodes, p in products.items() if len(nodes) == 1)  # a lone anchor: its library call


def test_a_part_kept_at_its_start_keeps_its_products_factors_too():
    start = RooflineParams()
    fitted = start.with_updates(**{"tc_efficiency.gemm": 0.2, "product_efficiency.blas": 0.5,
                                   "product_efficiency.band": 0.7})
    kept = cmcal.keep_start(fitted, start, "gemm")
    assert kept.get("tc_efficiency", "gemm") == start.get("tc_efficiency", "gemm")
    assert kept.get("product_efficiency", "blas") == 1.0 and kept.get("product_efficiency", "band") == 0.7
