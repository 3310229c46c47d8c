"""`fusesearch measure` on the CPU backend: every kernel runs on real data and matches ONNX
Runtime within verify's tolerance, with sane timings and totals that add up (`assert_measure_report`,
also used by the GPU tests); JSON and Parquet outputs; lone anchors through the library
(--baseline) and each fused anchor group against library anchor + separate kernels; a GPU run is
refused with a reason on a machine without one (and, marked gpu, runs the CuPy library path on one)."""

from __future__ import annotations

import inspect
import json
import math

import numpy as np
import pandas as pd
import pytest
from onnx import helper

from fusesearch.backends import cpu
from fusesearch.backends.codegen.mma import TOLERANCE
from fusesearch.verify import compare
from tests.conftest import make_model, save

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler")

VERIFY_RTOL = inspect.signature(compare).parameters["rtol"].default  # what `verify` calls equal


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


def _canonical_nodes(model: str) -> list[str]:
    from fusesearch.pipeline import prepare

    return [n.name for n in prepare(model).graph.nodes]


def _assert_sane_timing(what: str, measured: float, p20: float, p80: float) -> None:
    assert all(math.isfinite(x) and x > 0 for x in (measured, p20, p80)), (what, measured, p20, p80)
    assert p20 <= measured <= p80, (what, p20, measured, p80)


def _tolerance(skeleton: str | None) -> float:
    """verify's tolerance; a tensor-core kernel's own (it rounds its operands to TF32 or half)."""
    return TOLERANCE.get(skeleton, VERIFY_RTOL) if isinstance(skeleton, str) else VERIFY_RTOL


def assert_measure_report(doc: dict, table: pd.DataFrame, model: str) -> None:
    """What every measure report holds, whatever the backend: one kernel per plan group, the groups
    partitioning the model's canonical nodes, one kernel per node unfused; every kernel measured
    (a view runs nothing: 0 s, predicted 0) with finite positive timings, p20 <= median <= p80,
    predicted > 0 and outputs equal to ONNX Runtime's within verify's tolerance (a tensor-core
    kernel's within its own); totals that add up."""
    plan, unfused = table[table["plan"] == "plan"], table[table["plan"] == "unfused"]
    assert [g["id"] for g in doc["groups"]] == list(range(len(doc["groups"]))) == list(plan["group"])
    names = sorted(n for nodes in plan["nodes"] for n in nodes.split("+"))
    assert names == sorted(unfused["nodes"]) == sorted(_canonical_nodes(model))
    tolerance = dict(zip(plan["group"], (_tolerance(s) for s in plan["skeleton"]), strict=True))
    for g in doc["groups"]:
        if g["how"] == "alias":  # a view: no kernel runs, none is predicted
            assert g["median_s"] == g["p20_s"] == g["p80_s"] == g["predicted_s"] == g["max_rel_err"] == 0
            continue
        _assert_sane_timing(f"g{g['id']}", g["median_s"], g["p20_s"], g["p80_s"])
        assert 0 <= g["max_rel_err"] < tolerance[g["id"]] and g["predicted_s"] > 0, g
    for _, row in unfused[unfused["how"] != "alias"].iterrows():
        _assert_sane_timing(row["nodes"], row["median_s"], row["p20_s"], row["p80_s"])
        assert row["predicted_s"] > 0, row["nodes"]
    assert ((table["max_rel_err"] >= 0) & (table["max_rel_err"] < [_tolerance(s) for s in table["skeleton"]])).all()
    # the JSON names each figure as the Parquet does
    assert list(plan["median_s"]) == [g["median_s"] for g in doc["groups"]]
    assert list(plan["n"]) == [g["n"] for g in doc["groups"]]
    totals = doc["totals"]
    assert totals["not_measured"] == 0
    assert totals["measured_s"] == pytest.approx(math.fsum(g["median_s"] for g in doc["groups"]), rel=1e-12)
    assert totals["predicted_s"] == pytest.approx(math.fsum(g["predicted_s"] for g in doc["groups"]), rel=1e-12)
    assert totals["unfused_measured_s"] == pytest.approx(math.fsum(unfused["median_s"]), rel=1e-12)
    assert totals["unfused_predicted_s"] == pytest.approx(math.fsum(unfused["predicted_s"]), rel=1e-12)
    assert totals["speedup"] == pytest.approx(totals["unfused_measured_s"] / totals["measured_s"], rel=1e-12)


def test_measure_json_and_parquet(run_cli, tmp_path, small_model):
    out = tmp_path / "m.parquet"
    code, stdout, err = run_cli("measure", small_model, "--backend", "cpu", "--strategy", "greedy",
                                "--budget", "0.01", "-o", out, "--json")
    assert code == 0, err
    doc, table = json.loads(stdout), pd.read_parquet(out)
    assert doc["backend"] == "cpu" and doc["device"] == "host" and doc["groups"]
    assert_measure_report(doc, table, small_model)
    hows = {g["how"] for g in doc["groups"]}
    assert "generated" in hows and "library" in hows  # the 1-D MaxPool runs as a library call
    assert {"template", "tc_flops", "dram_read_bytes", "predicted_s", "median_s", "p20_s", "p80_s"} <= set(table.columns)
    from costmodels import KernelSpec

    for _, row in table.iterrows():  # every row holds a KernelSpec that reads back
        spec = KernelSpec.from_row(row.to_dict())
        assert ",".join(spec.op_types) == row["op_types"] and all(op.isidentifier() for op in spec.op_types)
        assert row["tile"] == "x".join(map(str, spec.tile))
    generated = table[table["how"] == "generated"]
    assert set(generated["skeleton"]) <= {"grid-stride", "vectorized", "block-per-row", "packed"}
    # host rows: one run per sample, no GPU timer columns
    assert not {"timer", "cache", "launch_s"} & set(table.columns) and all("timer" not in g for g in doc["groups"])
    # on the host a fused gemm/conv is priced as the C backend writes it: no CUDA form
    assert (generated[generated["template"].isin(["gemm", "conv"])]["skeleton"] == "packed").all()


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
    """measure --plan runs exactly the file's groups, and its text states the table's figures."""
    from fusesearch.cli import _fmt_time

    plan_path, out = tmp_path / "plan.json", tmp_path / "m.parquet"
    assert run_cli("plan", small_model, "--device", "host", "--strategy", "greedy", "-o", plan_path)[0] == 0
    groups = json.loads(plan_path.read_text())["groups"]
    code, stdout, err = run_cli("measure", small_model, "--plan", plan_path, "--budget", "0.01", "-o", out)
    assert code == 0, err
    table = pd.read_parquet(out)
    plan, unfused = table[table["plan"] == "plan"], table[table["plan"] == "unfused"]
    assert list(plan["nodes"]) == ["+".join(g["nodes"]) for g in groups]
    assert sorted(unfused["nodes"]) == sorted(_canonical_nodes(small_model))
    lines = stdout.splitlines()
    rows = [line for line in lines if line.startswith("│")]
    assert [r.strip("│").split("│")[0].strip() for r in rows] == [f"g{g['id']}" for g in groups]
    measured, unfused_s = math.fsum(plan["median_s"]), math.fsum(unfused["median_s"])
    (summary,) = [line for line in lines if line.startswith("sums of kernels, each timed alone")]
    spread = [_fmt_time(math.fsum(frame[q])) for frame in (plan, unfused) for q in ("p20_s", "p80_s")]
    assert (f"sums of kernels, each timed alone (median; sums of p20-p80): plan predicted "
            f"{_fmt_time(math.fsum(plan['predicted_s']))}, measured {_fmt_time(measured)} ({spread[0]}-{spread[1]})   "
            f"unfused predicted {_fmt_time(math.fsum(unfused['predicted_s']))}, measured {_fmt_time(unfused_s)} "
            f"({spread[2]}-{spread[3]})   speedup of the sums {unfused_s / measured:.2f}x") == summary.removesuffix(
                ", not distinguishable")
    assert "`fusesearch run` (or measure --end-to-end) times the plan end to end" in stdout  # not a sum's figure
    assert f"measurements written to {out}" in lines


def test_measure_on_gpu_without_one_is_bad_input(run_cli, small_model):
    from fusesearch.backends import cupy as gpu

    if gpu.available():
        pytest.skip("a GPU is present")
    code, _, err = run_cli("measure", small_model, "--backend", "cupy", "--budget", "0.01")
    assert code == 2 and "--backend cupy" in err and len(err.strip().splitlines()) == 1


def _parquet_and_json(run_cli, tmp_path, model, *extra):
    out = tmp_path / "m.parquet"
    code, stdout, err = run_cli("measure", model, "--strategy", "greedy", "--budget", "0.01", "-o", out, "--force",
                                "--json", *extra)
    assert code == 0, err
    doc, table = json.loads(stdout), pd.read_parquet(out)
    assert_measure_report(doc, table, model)
    return doc, table


def test_library_baseline_runs_lone_anchors_through_the_library_and_compares_fused_groups(run_cli, tmp_path,
                                                                                          small_model):
    """Default --baseline library: the unfused MatMul is a library call (ONNX Runtime), and the fused
    MatMul+Relu+Softmax group is set beside library MatMul + Relu + Softmax as separate kernels."""
    doc, table = _parquet_and_json(run_cli, tmp_path, small_model)
    assert doc["baseline"] == "library"
    unfused = table[table["plan"] == "unfused"].set_index("nodes")
    assert unfused.loc["mm", "how"] == "library" and unfused.loc["mm", "max_rel_err"] < 1e-4
    assert unfused.loc["relu", "how"] == "generated"
    plan = table[table["plan"] == "plan"]
    fused = plan[plan["library_baseline_s"].notna()]
    assert len(fused) == 1 and fused.iloc[0]["nodes"] == "mm+relu+sm"
    row = fused.iloc[0]
    expected = sum(unfused.loc[n, "median_s"] for n in row["nodes"].split("+"))
    assert row["library_baseline_s"] == pytest.approx(expected, rel=1e-12)
    assert bool(row["fused_loses"]) == (row["median_s"] > row["library_baseline_s"])
    (group,) = [g for g in doc["groups"] if g["library_baseline_s"] is not None]
    assert group["library_baseline_s"] == pytest.approx(expected, rel=1e-12)
    assert group["fused_loses"] == bool(row["fused_loses"])
    assert doc["totals"]["anchor_groups"] == doc["totals"]["anchor_groups_compared"] == 1
    assert doc["totals"]["fused_loses"] == int(group["fused_loses"])
    assert plan[plan["library_baseline_s"].isna()]["fused_loses"].isna().all()  # only anchor groups compare


@pytest.fixture
def pinned_host(monkeypatch):
    """The host with fixed figures (what the probes measured on a quiet 2-core EPYC VM) instead of
    figures measured now: a busy machine measures half the FMA rate, and a test of which way a
    price goes would depend on the load."""
    from costmodels import devices
    from costmodels.devices import MIB

    figures = devices.HostFigures(dram_bytes_per_s=23.2e9, fma_flops_per_s_per_thread=56.3e9, launch_s=1.24e-6,
                                  cache_curve=((1 * MIB, 89.2e9), (4 * MIB, 89.2e9), (8 * MIB, 87.4e9),
                                               (16 * MIB, 64.1e9), (32 * MIB, 38.2e9)))
    monkeypatch.setattr(devices, "host_figures", lambda *args, **kwargs: figures)
    devices.host_cpu.cache_clear()
    yield
    devices.host_cpu.cache_clear()


def test_the_plan_runs_its_lone_anchor_as_priced_and_the_unfused_graph_as_the_baseline_says(run_cli, tmp_path,
                                                                                           pinned_host):
    """Regime: the host (fixed figures). A lone MatMul is planned as our C
    (`costing.priced_kernel`: the library call, priced with the partial sums of its split K, is
    dearer), so the plan's group runs as our kernel and is predicted as one, while the unfused
    graph's (--baseline library) runs through ONNX Runtime, predicted at the library call's price
    (its plan made with `lone_anchors="library"`)."""
    from costmodels import RooflineModel, host_cpu, host_params
    from fusesearch.costing import kernel_cost
    from fusesearch.groups import FusionGroup
    from fusesearch.lowering import lower, try_lower
    from fusesearch.pipeline import prepare

    w = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
    model = save(make_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [("x", [256, 512])],
                            [("y", None)], [("w", w)]), tmp_path / "mm.onnx")
    doc, table = _parquet_and_json(run_cli, tmp_path, model)
    rows = table.set_index("plan")
    assert rows.loc["plan", "how"] == "generated" and rows.loc["unfused", "how"] == "library"
    graph, mm = prepare(model).graph, FusionGroup(frozenset({0}))
    ours, library = (kernel_cost(k, host_cpu(), RooflineModel(host_params())).time_s
                     for k in (try_lower(graph, mm, host=True), lower(graph, mm)))
    assert rows.loc["plan", "predicted_s"] == pytest.approx(ours, rel=1e-9)
    assert rows.loc["unfused", "predicted_s"] == pytest.approx(library, rel=1e-9) and library > ours
    assert max(rows["max_rel_err"]) < VERIFY_RTOL
    # set beside the same call through the library, measured in the same rounds
    (group,) = doc["groups"]
    assert group["library_baseline_s"] == pytest.approx(rows.loc["unfused", "median_s"], rel=1e-12)
    assert group["fused_loses"] is None
    totals = doc["totals"]
    assert totals["anchor_groups"] == 0 and totals["lone_anchors_compared"] == 1
    assert totals["lone_ours_loses"] == int(rows.loc["plan", "median_s"] > rows.loc["unfused", "median_s"])
    code, stdout, err = run_cli("measure", model, "--strategy", "greedy", "--budget", "0.01")
    assert code == 0, err
    assert "lone anchors the plan runs as our kernel vs the same call through the library: ours is slower in" in stdout


def test_generated_baseline_runs_lone_anchors_as_generated_kernels(run_cli, tmp_path, small_model):
    doc, table = _parquet_and_json(run_cli, tmp_path, small_model, "--baseline", "generated")
    assert doc["baseline"] == "generated"
    unfused = table[table["plan"] == "unfused"].set_index("nodes")
    assert unfused.loc["mm", "how"] == "generated" and unfused.loc["pool", "how"] == "library"
    assert all(g["library_baseline_s"] is None and g["fused_loses"] is None for g in doc["groups"])
    assert doc["totals"]["anchor_groups"] == 1 and doc["totals"]["anchor_groups_compared"] == 0
    code, stdout, err = run_cli("measure", small_model, "--strategy", "greedy", "--budget", "0.01",
                                "--baseline", "generated")
    assert code == 0, err
    assert "none compared with the library" in stdout


def test_measure_text_flags_the_fused_groups_that_lose(run_cli, small_model):
    code, stdout, err = run_cli("measure", small_model, "--strategy", "greedy", "--budget", "0.01")
    assert code == 0, err
    assert "library+rest" in stdout and "lone anchors: library" in stdout
    assert "fused anchor groups vs library anchor + the rest as separate kernels: the fused kernel loses in" in stdout


def test_bad_baseline_is_bad_input(run_cli, small_model):
    code, _, err = run_cli("measure", small_model, "--baseline", "cublas", "--budget", "0.01")
    assert code == 2 and "--baseline cublas" in err and len(err.strip().splitlines()) == 1


def test_library_comparison_flags_losers_and_leaves_unknowns_open():
    """The comparison's arithmetic on real Timing values: fused 3 us vs anchor 1 us + rest 1.5 us
    loses; a missing part (not measured) gives None, never a guess."""
    from fusesearch.backends.timing import Timing
    from fusesearch.measure import KernelMeasurement, MeasureReport

    def km(plan, group, nodes, anchor, how, seconds):
        timing = Timing((seconds,), 0, "perf_counter") if seconds is not None else None
        return KernelMeasurement(plan, group, "gemm", how, 0.0, timing, 0.0, {}, tuple(nodes), anchor)

    unfused = (km("unfused", 0, [0], 0, "library", 1e-6), km("unfused", 1, [1], None, "generated", 0.5e-6),
               km("unfused", 2, [2], None, "generated", 1e-6), km("unfused", 3, [3], 3, "library", 2e-6),
               km("unfused", 4, [4], None, "not measured", None))
    plan = (km("plan", 0, [0, 1, 2], 0, "generated", 3e-6), km("plan", 1, [3, 4], 3, "generated", 1e-6))
    versus = MeasureReport("cpu", "host", plan, unfused).library_comparison()
    assert versus[0]["library_baseline_s"] == pytest.approx(2.5e-6) and versus[0]["fused_loses"] is True
    assert versus[1]["fused_loses"] is None and np.isnan(versus[1]["library_baseline_s"])
    faster = (km("plan", 0, [0, 1, 2], 0, "generated", 2e-6),)
    assert MeasureReport("cpu", "host", faster, unfused).library_comparison()[0]["fused_loses"] is False


@pytest.mark.gpu
def test_gpu_library_baseline_runs_anchors_through_cupy(run_cli, tmp_path):
    """On a GPU: resnet18's lone convs and Gemm run through arraylib with cupy (cuBLAS) and match
    ONNX Runtime; fused conv groups are compared with them; its MaxPool is a generated kernel."""
    out = tmp_path / "m.parquet"
    code, stdout, err = run_cli("measure", "zoo:resnet18", "--backend", "cupy", "--device", "h200", "--no-ptxas",
                                "--budget", "0.02", "-o", out, "--json")
    assert code == 0, err
    doc, table = json.loads(stdout), pd.read_parquet(out)
    assert doc["backend"] == "cupy"
    assert_measure_report(doc, table, "zoo:resnet18")
    library = table[table["how"] == "library"]
    assert {"Conv", "Gemm"} <= set(library["op_types"]) and "MaxPool" not in set(library["op_types"])
    assert any("MaxPool" in ops.split(",") for ops in table[table["how"] == "generated"]["op_types"])
    assert doc["totals"]["anchor_groups_compared"] == doc["totals"]["anchor_groups"] > 0
    timed = table[table["how"].isin(["generated", "library"])]
    assert set(timed["timer"]) <= {"graph", "events"} and set(timed["cache"]) == {"warm"}  # no --flush-l2
    assert (timed["launch_s"] > 0).all() and (timed["launches"] >= 1).all()
    assert all(g["cache"] == "warm" for g in doc["groups"] if g["how"] in ("generated", "library"))


def test_gpu_timer_fields_reach_the_json_and_the_table_and_one_cache_state_for_all(small_model):
    """What the GPU timer says of each figure (timer, cache state, an empty kernel's launch_s, N)
    goes to the JSON groups and the table rows; every run of plan and unfused graph is sampled in
    one call with one cache state (--flush-l2's)."""
    import fusesearch
    from fusesearch.backends.timing import Timing
    from fusesearch.measure import measure_plan
    from fusesearch.pipeline import prepare

    prep = prepare(small_model)
    plan = fusesearch.plan(small_model, device="host", strategy="greedy", prepared=prep)
    unfused = fusesearch.plan(small_model, device="host", strategy="none", prepared=prep)
    calls = []

    def sampler(runs, *, flush, **_):
        calls.append(flush)
        return [Timing((2e-6,) * 3, 1, "cuda_event", timer="graph", cache="flushed" if flush else "warm",
                       launch_s=1.5e-6, launches=400) for _ in runs]

    report = measure_plan(prep, plan, unfused, "cpu", budget_s=0.01, flush_l2=True, sampler=sampler)
    assert calls == [True]
    doc, table = report.to_dict(), report.to_pandas()
    timed = [g for g in doc["groups"] if g["how"] != "alias"]
    assert timed and all((g["timer"], g["cache"], g["launch_s"]) == ("graph", "flushed", 1.5e-6) for g in timed)
    rows = table[table["how"] != "alias"]
    assert set(rows["cache"]) == {"flushed"} and set(rows["launches"]) == {400}


def test_each_plan_group_is_timed_beside_the_unfused_kernels_it_replaces(small_model):
    """measure_plan's interleaved order: every plan group, then the unfused kernels of its nodes
    not yet placed; every kernel of both exactly once."""
    import fusesearch
    from fusesearch.measure import _Item, _paired_order

    plan = fusesearch.plan(small_model, device="host", strategy="greedy")
    unfused = fusesearch.plan(small_model, device="host", strategy="none")
    items = {(label, g.id): _Item(label, g, "generated") for label, p in (("plan", plan), ("unfused", unfused))
             for g in p.groups}
    order = _paired_order(plan, unfused, items)
    assert sorted(id(it) for it in order) == sorted(id(it) for it in items.values())
    fused = next(g for g in plan.groups if len(g.nodes) > 1)
    at = order.index(items["plan", fused.id])
    after = [it.group.nodes[0] for it in order[at + 1:at + 1 + len(fused.nodes)]]
    assert after == list(fused.nodes)


# fixed samples (seconds) that `_measure_with_fixed_samples` hands measure_plan for every kernel and
# for the runs that time the calling path: ONNX Runtime's null Runs (`library.null_runs`: one
# Identity; a chain of CHAIN + 1) and a C call that does nothing (`cpu.null_runner`)
KERNEL_SAMPLES = (1e-6, 20e-6, 40e-6)
NULL_ONE_S, NODE_S = 5e-6, 0.25e-6  # the chain: NULL_ONE_S + CHAIN x NODE_S; the Run: NULL_ONE_S - NODE_S
CALL_SAMPLES = (1e-6, 1.5e-6, 9e-6)  # median 1.5 us


def _measure_with_fixed_samples(model: str, monkeypatch, baseline: str = "library"):
    """measure_plan on `model` (greedy plan, unfused graph), every run prepared for real, each run
    once, then timed by fixed samples instead of the clock: (report, the runs the sampler got by
    role)."""
    import fusesearch
    from fusesearch.backends import cpu, library
    from fusesearch.backends.timing import Timing
    from fusesearch.measure import measure_plan
    from fusesearch.pipeline import prepare

    prep = prepare(model)
    plan = fusesearch.plan(model, device="host", strategy="greedy", prepared=prep)
    unfused = fusesearch.plan(model, device="host", strategy="none", prepared=prep)
    made: dict = {}
    real_null_runs, real_null_runner = library.null_runs, cpu.null_runner

    def null_runs(threads):
        made["one"], made["chain"] = real_null_runs(threads)
        return made["one"], made["chain"]

    def null_runner():
        made["call"] = real_null_runner()
        return made["call"]

    monkeypatch.setattr(library, "null_runs", null_runs)
    monkeypatch.setattr(cpu, "null_runner", null_runner)
    samples = {"one": (NULL_ONE_S,), "chain": (NULL_ONE_S + library.CHAIN * NODE_S,), "call": CALL_SAMPLES}
    got: dict = {}

    def sampler(runs, **_):
        roles = {id(r): role for role, r in made.items()}
        got.update({"kernels": [r for r in runs if id(r) not in roles], **{roles[id(r)]: r for r in runs if id(r) in roles}})
        for run in runs:
            run()
        return [Timing(samples.get(roles.get(id(r)), KERNEL_SAMPLES), 1, "fixed") for r in runs]

    report = measure_plan(prep, plan, unfused, "cpu", budget_s=0.01, baseline=baseline, sampler=sampler)
    return report, got


def test_library_samples_are_taken_off_onnx_runtimes_fixed_run_cost(small_model, monkeypatch):
    """A library call's samples lose ONNX Runtime's fixed cost of a Run (`library.run_costs` of the
    null runs timed among the kernels: paid once per model inside a whole-model run), never below
    one trivial node's share; generated kernels lose only the null C call's median. Under baseline
    "generated" the unfused MatMul runs as our kernel and the 1-D MaxPool alone pays the Run."""
    from fusesearch.backends.library import CHAIN, run_costs
    from fusesearch.backends.registry import CALL_FLOOR_S

    run_s, node_s = run_costs(NULL_ONE_S, NULL_ONE_S + CHAIN * NODE_S)
    assert (run_s, node_s) == pytest.approx((NULL_ONE_S - NODE_S, NODE_S), rel=1e-9)
    for baseline in ("library", "generated"):
        report, got = _measure_with_fixed_samples(small_model, monkeypatch, baseline)
        assert {"one", "chain", "call"} <= set(got)
        rows = (*report.plan, *report.unfused)
        lib = [m for m in rows if m.how == "library"]
        assert lib and all(len(m.nodes) == 1 for m in lib)
        for m in lib:  # the 1 us sample sits at the node's share, the rest lose the Run
            assert m.timing.samples_s == pytest.approx((node_s, 20e-6 - run_s, 40e-6 - run_s), rel=1e-9), m
        gen = [m for m in rows if m.how == "generated"]
        assert gen and all(m.timing.samples_s == pytest.approx((CALL_FLOOR_S, 18.5e-6, 38.5e-6), rel=1e-9)
                           for m in gen)
        assert len(got["kernels"]) == len(lib) + len(gen)


def test_generated_samples_are_taken_off_the_cost_of_a_ctypes_call(small_model, tmp_path, monkeypatch):
    """A generated CPU kernel's samples lose the median of a C call that does nothing
    (`cpu.null_runner`, timed in the same rounds): a program calls its kernels from C, never
    through ctypes one by one; a sample below it sits at CALL_FLOOR_S. Library rows lose the Run,
    never the call. A plan whose every kernel is generated times no null Run."""
    from fusesearch.backends.registry import CALL_FLOOR_S

    report, got = _measure_with_fixed_samples(small_model, monkeypatch)
    call_s = float(np.median(CALL_SAMPLES))
    for m in (*report.plan, *report.unfused):
        if m.how == "generated":
            assert m.timing.samples_s == pytest.approx(tuple(max(CALL_FLOOR_S, s - call_s) for s in KERNEL_SAMPLES),
                                                       rel=1e-9), m
            assert m.timing.samples_s[0] == CALL_FLOOR_S
        elif m.how == "library":
            assert m.timing.samples_s[1] == pytest.approx(20e-6 - (NULL_ONE_S - NODE_S), rel=1e-9), m
    model = save(make_model([helper.make_node("Relu", ["x"], ["r"], name="relu"),
                             helper.make_node("Softmax", ["r"], ["y"], axis=-1, name="sm")],
                            [("x", [8, 64])], [("y", None)]), tmp_path / "g.onnx")
    report, got = _measure_with_fixed_samples(model, monkeypatch)
    assert set(got) == {"kernels", "call"}  # nothing runs through ONNX Runtime: no null Run is timed
    assert all(m.how == "generated" and m.timing.samples_s[1] == pytest.approx(18.5e-6, rel=1e-9)
               for m in (*report.plan, *report.unfused))


def test_a_library_node_reads_the_models_weights_as_initializers(tmp_path):
    """The one-node model keeps the weights it reads as initializers (ONNX Runtime pre-packs them
    once, as in the whole model) and takes only the activations as inputs; the runner writes into
    the same arrays every call, equal to ONNX Runtime's run of the whole model."""
    from fusesearch.backends.library import library_runner, node_model
    from fusesearch.groups import FusionGroup
    from fusesearch.ir.canonicalize import to_proto
    from fusesearch.lowering import lower_as_library
    from fusesearch.pipeline import prepare
    from fusesearch.verify import all_values, random_feeds

    rng = np.random.default_rng(0)
    model = make_model([helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1, name="fc")], [("x", [4, 8])],
                       [("y", None)], [("w", rng.standard_normal((6, 8)).astype(np.float32)),
                                        ("b", rng.standard_normal(6).astype(np.float32))])
    prep = prepare(save(model, tmp_path / "m.onnx"))
    canonical = to_proto(prep.canonical)
    kernel = lower_as_library(prep.graph, FusionGroup.single(0))
    one = node_model(canonical, prep.graph, kernel)
    assert [i.name for i in one.graph.input] == ["x"]
    assert sorted(t.name for t in one.graph.initializer) == ["b", "w"]
    values = all_values(canonical, random_feeds(canonical, 0))
    go, names = library_runner(canonical, prep.graph, kernel, {t: values[t] for t in kernel.inputs})
    first = go()
    again = go()
    assert names == ["y"] and first["y"] is again["y"]
    np.testing.assert_allclose(again["y"], values["y"], rtol=1e-6, atol=1e-6)
