"""The baselines a run is set against, and the noise of every figure.

ONNX Runtime is timed on the model as the user gave it (dynamic dims bound by the feeds; a zoo
model as its builder exports it) and on the canonical one; every ratio is against the faster of
the two, the text output says which, and the model as given must compute what its canonical form
does before it is timed. Each program's threads are kept from spinning while another is timed:
every ONNX Runtime session stops spinning when its Run returns, and libgomp is loaded with
passive waiting. A comparison of two figures whose p20-p80 ranges overlap is "not
distinguishable" (one function decides it for run, measure, regret and the sweep report); a busy
machine is said before timing. Ratio and noise logic run on fixed samples."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from onnx import helper

from costmodels.probes import IDLE_BUSY_CPUS, OPENMP_PASSIVE, OPENMP_WAIT, busy_cpus, openmp_wait
from fusesearch.backends import cpu
from fusesearch.backends.timing import (
    NOT_DISTINGUISHABLE,
    Paired,
    Timing,
    binding_warning,
    compared,
    distinguishable,
    load_warning,
    openmp_spins,
    paired,
    spread,
)
from fusesearch.regret import Regret
from fusesearch.report import rank_correlations, rank_sentence
from fusesearch.run import Mismatch, RunReport, check_original
from fusesearch.verify import NO_SPINNING_AFTER_RUN, session
from tests.conftest import make_model, save

needs_cc = pytest.mark.skipif(not cpu.available(), reason="no C compiler")


def dynamic(path) -> str:
    """x[batch, 32] -> MatMul+Add -> Relu -> Softmax, the batch a named dynamic dim."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Add", ["h", "b"], ["hb"], name="add"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu"),
             helper.make_node("Softmax", ["r"], ["y"], name="softmax", axis=-1)]
    inits = [("w", rng.standard_normal((32, 16)).astype(np.float32)), ("b", rng.standard_normal(16).astype(np.float32))]
    return save(make_model(nodes, [("x", ["batch", 32])], [("y", ["batch", 16])], inits), path / "dynamic.onnx")


def timing(*samples: float) -> Timing:
    return Timing(tuple(samples), 0, "fixed")


def report(**medians) -> RunReport:
    """A RunReport over fixed samples: each program's samples spread ±10% around its median."""
    timings = {k: timing(0.9 * m, m, 1.1 * m) for k, m in medians.items()}
    return RunReport("m", "greedy", 1, 3, 0, 1e-4, timings, 0, 0, 0, 0.0, 0.0, {}, {}, 0, 0)


@needs_cc
def test_run_times_onnx_runtime_on_the_model_as_given_and_on_the_canonical_one(run_cli, tmp_path):
    code, stdout, stderr = run_cli("run", dynamic(tmp_path), "--dim", "batch=8", "--strategy", "greedy",
                                   "--repeat", "3", "--warmup", "0", "--json")
    assert code == 0, stderr
    doc = json.loads(stdout)
    given, canonical = doc["ort_enable_all"], doc["ort_enable_all_canonical"]
    extended = doc["ort_enable_extended"]
    assert given["n"] == canonical["n"] == extended["n"] == doc["ort_disable_all"]["n"] == 3 and given["median_s"] > 0
    faster = min(("ort_enable_all", "ort_enable_all_canonical"), key=lambda k: doc[k]["median_s"])
    assert doc["ort_baseline"] == faster
    assert doc["ratios"]["plan_vs_ort_enable_all"] == pytest.approx(doc["plan"]["median_s"] / doc[faster]["median_s"])
    assert doc["ratios"]["plan_vs_ort_enable_extended"] == pytest.approx(doc["plan"]["median_s"] / extended["median_s"])
    code, stdout, stderr = run_cli("run", dynamic(tmp_path), "--dim", "batch=8", "--strategy", "greedy",
                                   "--repeat", "3", "--warmup", "0")
    assert code == 0, stderr
    assert "ONNX Runtime ENABLE_ALL, model as given" in stdout and "ONNX Runtime ENABLE_ALL, canonical model" in stdout
    assert "ONNX Runtime ENABLE_EXTENDED, model as given" in stdout
    assert re.search(r"plan vs ORT ENABLE_EXTENDED \d+\.\d\dx", stdout)
    which = "model as given" if "the model as given's" in stdout else "canonical model"
    assert f"vs ORT ENABLE_ALL: against ONNX Runtime's faster ENABLE_ALL figure, the {which}'s" in stdout


@pytest.mark.parametrize("given, canonical, base", [(2e-3, 3e-3, "ort_enable_all"),
                                                     (3e-3, 2e-3, "ort_enable_all_canonical")])
def test_every_ratio_is_against_onnx_runtimes_faster_figure(given, canonical, base):
    r = report(plan=1e-3, unfused=4e-3, ort_enable_all=given, ort_enable_all_canonical=canonical, ort_disable_all=5e-3)
    assert r.ort_baseline() == base
    assert r.ratio("plan", "ort_enable_all") == pytest.approx(1e-3 / 2e-3)
    assert r.to_dict()["ratios"]["plan_vs_ort_enable_all"] == pytest.approx(0.5)
    assert r.to_dict()["ort_baseline"] == base
    assert r.ratio("plan", "ort_disable_all") == pytest.approx(0.2)  # other baselines as they are
    alone = report(plan=1e-3, ort_enable_all=4e-3)  # a --dtype run: the canonical model only
    assert alone.ort_baseline() == "ort_enable_all" and alone.ratio("plan", "ort_enable_all") == pytest.approx(0.25)


def test_the_model_as_given_must_compute_what_its_canonical_form_does(tmp_path):
    path = dynamic(tmp_path)
    feeds = {"x": np.random.default_rng(1).standard_normal((8, 32)).astype(np.float32)}
    right = session(path, threads=1).run(["y"], feeds)[0]
    sess = check_original(path, 1, feeds, {"y": right}, 1e-4)
    assert sess.get_session_options().graph_optimization_level.name == "ORT_ENABLE_ALL"
    with pytest.raises(Mismatch, match="at output 'y'"):
        check_original(path, 1, feeds, {"y": right + 0.5}, 1e-4)


@pytest.mark.parametrize("optimize, level", [(False, "ORT_DISABLE_ALL"), ("none", "ORT_DISABLE_ALL"),
                                             ("extended", "ORT_ENABLE_EXTENDED"), (True, "ORT_ENABLE_ALL"),
                                             ("all", "ORT_ENABLE_ALL")])
def test_a_session_runs_at_the_optimization_level_asked(tmp_path, optimize, level):
    options = session(dynamic(tmp_path), threads=1, optimize=optimize).get_session_options()
    assert options.graph_optimization_level.name == level


def test_every_session_stops_spinning_when_its_run_returns(tmp_path):
    options = session(dynamic(tmp_path), threads=2, optimize=True).get_session_options()
    assert NO_SPINNING_AFTER_RUN == {"session.force_spinning_stop": "1"}
    for key, value in NO_SPINNING_AFTER_RUN.items():
        assert options.get_session_config_entry(key) == value


@needs_cc
def test_openmp_is_loaded_with_our_wait_unless_the_user_says_otherwise():
    """libgomp reads its wait settings once, when it loads after the first compiled library: asked
    to show them, it spins OPENMP_WAIT's count (an idle machine) or 0 (passive, a busy one), never
    its default 300000; a policy or count the user set is kept."""
    # a compiled library loaded, then libgomp (the linker drops it from a library that makes no OpenMP call)
    script = "import ctypes\nimport fusesearch.backends.cpu as cpu\ncpu.null_runner()\nctypes.CDLL('libgomp.so.1')\n"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(OMP_DISPLAY_ENV="verbose", PYTHONPATH=os.getcwd())

    def spins(extra: dict) -> str:
        done = subprocess.run([sys.executable, "-c", script], env={**env, **extra}, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
        return next(line for line in done.stderr.splitlines() if "GOMP_SPINCOUNT" in line).split("=")[1].strip()

    bounded = int(OPENMP_WAIT["GOMP_SPINCOUNT"])
    assert 0 < bounded < 300000  # awake between a program's regions, asleep soon after it
    assert spins({}) in (f"'{bounded}'", "'0'")
    assert spins({"OMP_WAIT_POLICY": "passive"}) == "'0'"
    assert spins({"OMP_WAIT_POLICY": "active"}) not in ("'0'", f"'{bounded}'")
    assert spins({"GOMP_SPINCOUNT": "5"}) == "'5'"


def test_openmp_threads_spin_on_an_idle_machine_and_wait_passively_on_a_busy_one(monkeypatch):
    """The wait is decided once, from the CPUs other processes keep busy as libgomp loads: under
    half a CPU the bounded spin, else passive (a spinning team beside a busy process loses a time
    slice per barrier); a setting already there (the user's, or ours) is kept."""
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(key, raising=False)
    cpu._set_openmp_env(busy=lambda: 0.1)
    assert os.environ.get("GOMP_SPINCOUNT") == OPENMP_WAIT["GOMP_SPINCOUNT"] and "OMP_WAIT_POLICY" not in os.environ
    cpu._set_openmp_env(busy=lambda: 1.5)  # decided already
    assert os.environ.get("GOMP_SPINCOUNT") == OPENMP_WAIT["GOMP_SPINCOUNT"]
    monkeypatch.delenv("GOMP_SPINCOUNT")
    cpu._set_openmp_env(busy=lambda: 0.8)
    assert os.environ.get("OMP_WAIT_POLICY") == "PASSIVE" and "GOMP_SPINCOUNT" not in os.environ
    assert openmp_wait(IDLE_BUSY_CPUS - 0.01) == OPENMP_WAIT and openmp_wait(IDLE_BUSY_CPUS) == OPENMP_PASSIVE


def test_busy_cpus_is_a_share_of_the_machine():
    busy = busy_cpus(0.02)
    assert 0.0 <= busy <= os.cpu_count()


def test_figures_whose_ranges_overlap_are_not_distinguishable():
    assert not distinguishable((1.0, 2.0), (1.9, 3.0)) and distinguishable((1.0, 2.0), (2.1, 3.0))
    assert compared((1.0, 2.0), (1.5, 2.5), "a", "b") == NOT_DISTINGUISHABLE
    assert compared((1.0, 2.0), (2.5, 3.0), "a", "b") == "a" and compared((2.5, 3.0), (1.0, 2.0), "a", "b") == "b"
    # regret decides with the same function
    plans = {"predicted": {"median_s": 2.0, "p20_s": 1.9, "p80_s": 2.1}, "measured": {"median_s": 1.0, "p20_s": 0.9,
                                                                                        "p80_s": 1.1}}
    assert Regret("m", "host", "greedy", 1, 3, plans, False, {}).verdict == "measured plan faster"
    plans["measured"]["p80_s"] = 1.95
    assert Regret("m", "host", "greedy", 1, 3, plans, False, {}).verdict == NOT_DISTINGUISHABLE
    # with the ratio round by round (predicted over measured), that decides
    rounds = {"median": 1.05, "p20": 1.02, "p80": 1.08, "n": 3}
    assert Regret("m", "host", "greedy", 1, 3, plans, False, {}, rounds).verdict == "measured plan faster"
    rounds.update(p20=0.9, p80=0.95)
    assert Regret("m", "host", "greedy", 1, 3, plans, False, {}, rounds).verdict == "predicted plan faster"
    rounds.update(p20=0.9, p80=1.1)
    assert Regret("m", "host", "greedy", 1, 3, plans, False, {}, rounds).verdict == NOT_DISTINGUISHABLE


def test_a_busy_machine_is_said_before_timing():
    line = load_warning(load=1.6, cpus=2)
    assert line.startswith("load average 1.60 over the last minute on 2 CPUs, 1 of them timing here") and "\n" not in line


def test_the_load_warning_discounts_the_threads_of_the_timing_itself():
    # 1 thread on 2 CPUs: the timing's own thread is a load of about 1; the other CPU half busy is fine
    assert load_warning(load=1.4, cpus=2, threads=1) is None
    assert load_warning(load=1.6, cpus=2, threads=1) is not None
    # every CPU timing here: half a CPU of anything else is still allowed, more is said
    assert load_warning(load=2.4, cpus=2, threads=2) is None
    assert load_warning(load=2.6, cpus=2, threads=2) is not None
    # many CPUs, 4 timing: half of the 12 others
    assert load_warning(load=9.9, cpus=16, threads=4) is None
    assert "on 16 CPUs, 4 of them timing here" in load_warning(load=10.1, cpus=16, threads=4)


def test_the_load_warning_says_spinning_threads_degrade_and_how_to_stop_them():
    """Several spinning threads on a machine whose other work takes more than the CPUs they leave:
    the line says so and names the way out; one thread, a passive policy or a lighter load: not."""
    line = load_warning(load=3.4, cpus=2, threads=2, spinning=True)
    assert line.endswith("its 2 OpenMP threads spin between kernels: set OMP_WAIT_POLICY=PASSIVE for figures that degrade less")
    assert "\n" not in line
    assert "OMP_WAIT_POLICY" not in load_warning(load=3.4, cpus=2, threads=2, spinning=False)
    assert "OMP_WAIT_POLICY" not in load_warning(load=3.4, cpus=2, threads=1, spinning=True)
    assert "OMP_WAIT_POLICY" not in load_warning(load=10.1, cpus=16, threads=4, spinning=True)  # 6 others, 12 free


def test_a_thread_binding_that_confines_onnx_runtime_to_one_core_is_said(monkeypatch, caplog):
    """OMP_PROC_BIND (or OMP_PLACES, GOMP_CPU_AFFINITY) binds the first thread, whose mask ONNX
    Runtime's threads inherit: at 2 threads the line names the variable and the way out; at one
    thread, unset, or OMP_PROC_BIND=false: nothing. `warn_if_loaded` logs it before timing."""
    from fusesearch.backends.timing import warn_if_loaded

    line = binding_warning(2, {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"})
    assert line.startswith("OMP_PROC_BIND=close binds this process's first thread to one CPU, and ONNX Runtime's 2")
    assert line.endswith("unset OMP_PROC_BIND/OMP_PLACES/GOMP_CPU_AFFINITY to compare") and "\n" not in line
    assert binding_warning(2, {"GOMP_CPU_AFFINITY": "0-1"}).startswith("GOMP_CPU_AFFINITY=0-1 binds")
    assert binding_warning(1, {"OMP_PROC_BIND": "close"}) is None
    assert binding_warning(2, {}) is None and binding_warning(2, {"OMP_PROC_BIND": "false"}) is None
    for name in ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_PLACES", "cores")
    with caplog.at_level("WARNING"):
        warn_if_loaded(2)
    assert any(r.getMessage().startswith("OMP_PLACES=cores binds") for r in caplog.records)


def test_openmp_spins_unless_passive_or_a_zero_count(monkeypatch):
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(key, raising=False)
    assert openmp_spins()
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert not openmp_spins()
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    assert not openmp_spins()


def test_run_compares_two_programs_round_by_round():
    """A shared machine's drift stretches both samples of a round: the plan faster in every round
    is faster though the two programs' p20-p80 ranges overlap; ratios on both sides of 1 are not
    distinguishable; samples not taken in the same rounds give no per-round figure."""
    from fusesearch.cli import _versus

    drift = (1.0, 2.0, 3.0, 4.0, 5.0)
    r = RunReport("m", "greedy", 1, 5, 0, 1e-4, {
        "plan": timing(*(1e-3 * d for d in drift)), "unfused": timing(*(1.1e-3 * d for d in drift)),
        "ort_enable_all": timing(*(1e-3 * d * f for d, f in zip(drift, (0.9, 1.1, 0.93, 1.07, 0.98), strict=True))),
        "ort_disable_all": timing(3e-3, 3e-3)}, 0, 0, 0, 0.0, 0.0, {}, {}, 0, 0)
    assert distinguishable(spread(r.timings["plan"]), spread(r.timings["unfused"])) is False
    pair = r.paired("plan", "unfused")
    assert (pair.median, pair.p20, pair.p80, pair.n) == pytest.approx((1 / 1.1, 1 / 1.1, 1 / 1.1, 5))
    assert pair.distinguishable and _versus(r, "plan", "unfused") == "0.91x (per round 0.91x, 0.91-0.91)"
    ort = r.paired("plan", "ort_enable_all")
    assert ort.p20 < 1.0 < ort.p80 and not ort.distinguishable
    assert _versus(r, "plan", "ort_enable_all").endswith(", not distinguishable")
    assert r.paired("plan", "ort_disable_all") is None and _versus(r, "plan", "ort_disable_all") == "1.00x"
    assert paired(timing(1.0, 2.0), timing(2.0, 2.0)) == Paired(0.75, 0.6, 0.9, 2)
    assert r.to_dict()["paired"]["plan_vs_unfused"]["median"] == pytest.approx(1 / 1.1)
    assert "plan_vs_ort_disable_all" not in r.to_dict()["paired"]


def _e2e_rows() -> pd.DataFrame:
    """Two models, strategies none and greedy: model a's predictions rank its plans as measured
    (ρ = +1), model b's the other way round (ρ = -1); none's plan and unfused medians differ by
    2% and 4% (the same program timed twice)."""
    rows = []
    for model, times, measured, none_unfused in (("a", (2.0, 1.0), (2.0, 1.0), 2.0 / 1.02), ("b", (2.0, 1.0), (1.0, 2.0), 1.0 / 0.96)):
        for i, (strategy, t, m) in enumerate(zip(("none", "greedy"), times, measured, strict=True)):
            unfused = none_unfused if strategy == "none" else 2.0
            rows.append({"model": model, "strategy": strategy, "status": "ok", "cell_index": len(rows), "kernels": 2 - i,
                         "time_s": t, "speedup": 2.0 / t, "end_to_end_plan_median_s": m,
                         "end_to_end_plan_p20_s": 0.99 * m, "end_to_end_plan_p80_s": 1.01 * m, "end_to_end_plan_n": 5,
                         "end_to_end_unfused_median_s": unfused, "end_to_end_unfused_p20_s": 0.99 * unfused,
                         "end_to_end_unfused_p80_s": 1.01 * unfused, "end_to_end_ort_enable_all_median_s": 3.0,
                         "end_to_end_ort_enable_all_canonical_median_s": 4.0, "end_to_end_ort_disable_all_median_s": 5.0,
                         "end_to_end_max_rel_err": 0.0, "end_to_end_threads": 1})
    return pd.DataFrame(rows)


def test_the_report_gives_each_correlation_its_n_and_the_noise_floor():
    r = rank_correlations(_e2e_rows())
    assert r["within_models"] == [("a", pytest.approx(1.0), 2), ("b", pytest.approx(-1.0), 2)]  # never their mean, 0
    assert r["noise"] == {"n": 2, "max": pytest.approx(0.04, rel=1e-6), "median": pytest.approx(0.03, rel=1e-6)}
    sentence = rank_sentence(r)
    assert "a ρ = 1.00 (n = 2); b ρ = -1.00 (n = 2)" in sentence and "(n = 4)" in sentence
    assert "differ by up to 4.0% (median 3.0%, n = 2 cells)" in sentence and "mean over" not in sentence


def test_measure_sums_its_kernels_ranges_and_says_when_the_sums_overlap():
    from fusesearch.measure import KernelMeasurement, MeasureReport

    def kernel(label: str, group: int, *samples: float) -> KernelMeasurement:
        return KernelMeasurement(label, group, "pointwise", "generated", 1e-6, timing(*samples), 0.0)

    plan = (kernel("plan", 0, 1.0, 2.0, 3.0),)
    close = MeasureReport("cpu", "host", plan, (kernel("unfused", 0, 1.0, 1.0, 2.0), kernel("unfused", 1, 1.0, 1.0, 2.0)))
    t = close.totals()
    assert (t["measured_p20_s"], t["measured_p80_s"]) == pytest.approx((1.4, 2.6))
    assert (t["unfused_measured_p20_s"], t["unfused_measured_p80_s"]) == pytest.approx((2.0, 3.2))
    assert t["speedup_verdict"] == NOT_DISTINGUISHABLE and t["speedup"] == pytest.approx(1.0)
    far = MeasureReport("cpu", "host", plan, (kernel("unfused", 0, 5.0, 5.0, 5.0),)).totals()
    assert far["speedup_verdict"] == "plan faster"
