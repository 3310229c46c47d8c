"""Measured costs (`--costs measured|hybrid`, `fusesearch.autotune`): the search picks by measured
times where they differ from the model's, hybrid measures only the choices of the groups its
plans use (within its band), the timing database is read back, and a bad or impossible `--costs`
is one line, exit 2. Samples are fixed (an injected sampler): no assertion depends on the
machine's speed."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from onnx import helper

from costmodels import RooflineModel, load_device
from fusesearch.autotune import build_problem
from fusesearch.backends.registry import CPU
from fusesearch.backends.timing import Timing, TimingCache
from fusesearch.pipeline import prepare
from fusesearch.search import search
from fusesearch.search.problem import SearchConfig, SearchProblem
from tests.conftest import make_model, save

pytestmark = pytest.mark.skipif(not CPU.available(), reason="needs a C compiler")

SLOW_S, FAST_S = 1e-3, 1e-5


def _matmul(tmp_path) -> str:
    """A lone MatMul with a constant B: on the host our C (predicted the faster) or the library."""
    w = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    model = make_model([helper.make_node("MatMul", ["a", "w"], ["y"], name="mm")],
                       [("a", [128, 256])], [("y", [128, 256])], [("w", w)])
    return save(model, tmp_path / "mm.onnx")


def _library_fastest(calls: list):
    """A sampler whose fixed samples make the library call the fastest choice (null runs: 0 s);
    `calls` collects the runs it was given."""
    def sampler(runs, **_):
        calls.append(list(runs))
        return [Timing((0.0,) * 3, 1, "fixed") if not hasattr(r, "how")
                else Timing(((FAST_S if r.how == "library" else SLOW_S),) * 3, 1, "fixed") for r in runs]
    return sampler


def _choices(prep) -> list:
    """The lone MatMul's choices priced by the model (our C products, then the library call)."""
    spec, params = load_device("host", 1)
    plain = SearchProblem.build(prep.graph, spec, RooflineModel(params)).legality
    return plain.priced(plain.options(frozenset({0}), plain.check({0}).kernel))


def _problem(path, cache, sampler, costs="measured"):
    prep = prepare(path)
    spec, params = load_device("host", 1)
    problem, tuner = build_problem(prep, spec, RooflineModel(params), SearchConfig(workers=1), costs,
                                   cache=cache, sampler=sampler)
    return prep, spec, problem, tuner


def test_measured_costs_choose_the_measured_fastest_choice(tmp_path):
    path = _matmul(tmp_path)
    prep, spec, problem, tuner = _problem(path, TimingCache(tmp_path / "db"), _library_fastest([]))
    predicted = search(prep.graph, spec, problem.legality.model, "greedy")
    measured = search(prep.graph, spec, problem.legality.model, "greedy", problem=problem)
    assert [g.kernel.impl for g in predicted.groups] == ["generated"]  # the model's choice: our C
    assert [g.kernel.impl for g in measured.groups] == ["library"]  # the measured fastest
    assert measured.groups[0].cost.time_s == pytest.approx(FAST_S)
    doc = measured.to_dict()
    assert doc["costs"] == "measured" and doc["groups"][0]["cost_source"] == "measured"
    assert "costs" not in predicted.to_dict() and "cost_source" not in predicted.to_dict()["groups"][0]
    assert tuner.stats.measured == len(_choices(prep)) >= 2 and tuner.stats.cached == 0


def test_the_timing_database_is_read_back(tmp_path):
    path, cache = _matmul(tmp_path), TimingCache(tmp_path / "db")
    prep, _, _, first = _problem(path, cache, _library_fastest([]))
    calls: list = []
    _, spec, problem, second = _problem(path, cache, _library_fastest(calls))
    plan = search(problem.graph, spec, problem.legality.model, "greedy", problem=problem)
    n = len(_choices(prep))
    assert first.stats.measured == n
    assert (second.stats.measured, second.stats.cached) == (0, n) and calls == []
    assert plan.groups[0].kernel.impl == "library"  # the same database, the same plan


def _fixed(seconds, calls: list):
    """A sampler whose fixed samples are `seconds(run)` for each choice's run (null runs: 0 s);
    `calls` collects the choices (node set, impl, product) it was given, one list per call."""
    def sampler(runs, **_):
        calls.append([(r.kernel.nodes, r.how, r.kernel.schedule.product) for r in runs if hasattr(r, "how")])
        return [Timing((seconds(r) if hasattr(r, "how") else 0.0,) * 3, 1, "fixed") for r in runs]
    return sampler


def _hybrid(path, sampler, band=None):
    """(plan, its problem, the tuner): `cpsat` with hybrid costs over fixed samples; `band`: the
    held-out error factor of a calibrated profile (None: no profile)."""
    from pathlib import Path

    from fusesearch.autotune import tuned_search

    folder, profile = Path(path).parent, None
    if band is not None:
        profile = folder / "profile.json"
        profile.write_text(json.dumps({"fit": {"heldout": {"after": {"error_factor": band}}}}))
    spec, params = load_device("host", 1)
    plan, problem = tuned_search(prepare(path), spec, RooflineModel(params), "cpsat", SearchConfig(workers=1),
                                 "hybrid", profile and str(profile), cache=TimingCache(folder / "db"),
                                 sampler=sampler)
    return plan, problem, problem.legality.measurer


def _matmul_relu(tmp_path):
    """MatMul (constant B) then Relu: the model fuses them; the lone MatMul has three choices
    (our C with its own product or BLAS, the library call), the lone Relu one."""
    w = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    model = make_model([helper.make_node("MatMul", ["a", "w"], ["y"], name="mm"),
                        helper.make_node("Relu", ["y"], ["r"], name="relu")],
                       [("a", [128, 256])], [("r", [128, 256])], [("w", w)])
    return save(model, tmp_path / "mmr.onnx")


def test_hybrid_measures_only_the_groups_its_plans_use(tmp_path):
    """The model's plan is one fused kernel: hybrid times its two choices and nothing else (not
    the lone MatMul's three, not the single-choice Relu): measured 2x the model, the lone ops,
    priced on the measured clock over a 1.001x band (the Relu's own traffic is more than the band
    leaves, on any machine's figures), cannot beat it, so the second search keeps
    the plan; what was not measured is priced on the measured clock, optimistically (`optimism`)."""
    from fusesearch.autotune import optimism

    calls: list = []
    plan, problem, tuner = _hybrid(_matmul_relu(tmp_path), _fixed(lambda r: 2e-4, calls), band=1.001)
    assert [g.nodes for g in plan.groups] == [(0, 1)] and plan.groups[0].source == "measured"
    assert calls == [[((0, 1), "generated", "own"), ((0, 1), "generated", "blas")]]
    s = tuner.stats
    assert (s.choices, s.measured, s.cached, s.predicted, s.rounds) == (6, 2, 0, 4, 2)
    fused = [c.time_s for _, c in _choices_of(problem.legality, {0, 1})]
    assert tuner.scales == {None: pytest.approx(2e-4 / fused[0])}  # measured / predicted (too few for gemm's own)
    relu = problem.legality.check({1})
    predicted_relu = _choices_of(problem.legality, {1})[0][1].time_s
    assert relu.source == "predicted" and "no plan used" in relu.note
    assert relu.time_s == pytest.approx(predicted_relu * tuner.scales[None] / optimism(1.001))
    doc = plan.to_dict()
    assert doc["tuning"]["choices"] == 6 and doc["tuning"]["measured"] == 2 and doc["tuning"]["rounds"] == 2
    assert doc["tuning"]["timed_fraction"] == pytest.approx(2 / 6, abs=1e-4)


def test_hybrid_tries_a_group_the_model_may_have_overpriced(tmp_path):
    """Measured, the fused kernel is 2x the model while the MatMul and Relu alone are faster: over
    the default 1.5x band the lone ops may beat it, so the second search picks them, hybrid
    measures them, and the third keeps them: the measured-cost plan, not the model's."""
    calls: list = []
    seconds = {(0, 1): 2e-4, (0,): 5e-5, (1,): 1e-6}
    plan, _, tuner = _hybrid(_matmul_relu(tmp_path), _fixed(lambda r: seconds[r.kernel.nodes], calls))
    assert [g.nodes for g in plan.groups] == [(0,), (1,)]
    assert {g.source for g in plan.groups} == {"measured"} and tuner.stats.rounds == 3
    assert [sorted({c[0] for c in call}) for call in calls] == [[(0, 1)], [(0,), (1,)]]
    assert (tuner.stats.choices, tuner.stats.measured) == (6, 6)


def test_hybrid_tries_an_untried_form_only_within_its_optimism(tmp_path):
    """The fused MatMul+Relu measured, the lone ops never: on the measured clock they cost r x the
    fused kernel's time. Over a band of r ** 1.2 (wider than r, so dividing by the whole band
    would try them) the optimism, the band's 20th percentile (r ** 0.79), leaves them dearer:
    hybrid times the fused kernel alone. Over a band of r ** 2 (optimism r ** 1.31) they may be
    cheaper: hybrid times them too, then keeps the fused kernel they do not beat."""
    from fusesearch.autotune import optimism

    (tmp_path / "probe").mkdir()
    _, problem, tuner = _hybrid(_matmul_relu(tmp_path / "probe"), _fixed(lambda r: 2e-4, []), band=1.0 + 1e-9)
    lone = min(c.time_s for _, c in _choices_of(problem.legality, {0})) + _choices_of(problem.legality, {1})[0][1].time_s
    r = lone * tuner.scales[None] / 2e-4
    assert r > 1.0  # the lone ops, as the model sees them on the measured clock, are dearer
    tried = {}
    for power in (1.2, 2.0):
        (tmp_path / str(power)).mkdir()
        calls: list = []
        plan, _, _ = _hybrid(_matmul_relu(tmp_path / str(power)), _fixed(lambda r: 2e-4, calls), band=r ** power)
        assert [g.nodes for g in plan.groups] == [(0, 1)]
        assert optimism(r ** power) == pytest.approx(r ** (power * 0.6567), rel=1e-3)
        # a band of two choices' difference (`group_band`) spans sqrt 2 times one form's error
        assert optimism(r ** power, pairwise=True) == pytest.approx(optimism(r ** power) ** (1 / math.sqrt(2)))
        tried[power] = sorted({c[0] for call in calls for c in call})
    assert tried == {1.2: [(0, 1)], 2.0: [(0,), (0, 1), (1,)]}


def test_hybrids_capped_last_search_prices_untried_forms_without_optimism(tmp_path, monkeypatch):
    """As above, but a cap of two searches: the second is the last, so the lone ops, never timed,
    are priced at their prediction on the measured clock (not divided by the band), which the
    measured fused kernel beats; the plan keeps only measured groups and says it was capped."""
    import fusesearch.autotune as autotune

    monkeypatch.setattr(autotune, "MAX_ROUNDS", 2)
    calls: list = []
    seconds = {(0, 1): 2e-4, (0,): 5e-5, (1,): 1e-6}
    plan, _, tuner = _hybrid(_matmul_relu(tmp_path), _fixed(lambda r: seconds[r.kernel.nodes], calls))
    assert [g.nodes for g in plan.groups] == [(0, 1)] and plan.groups[0].source == "measured"
    assert [sorted({c[0] for c in call}) for call in calls] == [[(0, 1)]]
    assert tuner.stats.rounds == 2 and tuner.stats.capped and plan.to_dict()["tuning"]["capped"] is True
    assert "(capped: the last without the band's optimism)" in tuner.stats.line()


def test_where_the_capped_search_picks_untried_forms_a_closing_search_keeps_measured_ones(tmp_path, monkeypatch):
    """With a cap of two searches the second is capped; where it picks forms never timed (the
    search here gives the unfused plan: the lone MatMul and Relu), they are timed and one closing
    search runs over timed forms only (an untried form priced UNTRIED times over), so the plan
    returned holds measured groups only: three searches in all, never a fourth."""
    import fusesearch.autotune as autotune
    import fusesearch.search as searches

    real = searches.search
    strategies: list = []

    def scripted(graph, spec, model, strategy, **kwargs):  # the model's plan, then the unfused one
        strategies.append("cpsat" if not strategies else "none")
        return real(graph, spec, model, strategies[-1], **kwargs)
    monkeypatch.setattr(searches, "search", scripted)
    monkeypatch.setattr(autotune, "MAX_ROUNDS", 2)
    calls: list = []
    plan, problem, tuner = _hybrid(_matmul_relu(tmp_path), _fixed(lambda r: 2e-4, calls))
    assert [g.nodes for g in plan.groups] == [(0,), (1,)]
    assert {g.source for g in plan.groups} == {"measured"}
    assert strategies == ["cpsat", "none", "none"] and tuner.stats.capped and tuner.closed
    assert [sorted({c[0] for c in call}) for call in calls] == [[(0, 1)], [(0,), (1,)]]
    kernel = _choices_of(problem.legality, {1})[0][0]
    tuner._wanted.discard(autotune._form(kernel))  # as if never timed: out of reach in the closing search
    assert tuner.scale(kernel) == pytest.approx(tuner.scales[None] * autotune.UNTRIED)


def test_hybrid_reports_its_share_the_band_and_the_lone_choices(tmp_path):
    """The share hybrid timed on a tiny graph with a known band, and why the rest was not: a lone
    MatMul (own, BLAS tied, the library call predicted beyond a band narrower than its gap) times
    2 of its 3 choices, the library call counted outside the band; MatMul then Relu over the
    default band times all 6, the Relu's one choice counted as its group's only one (timed to
    compare groups, not choices). In the plan's tuning and in the report's line."""
    path = _matmul(tmp_path)
    times = [c.time_s for _, c in _choices(prepare(path))]
    plan, _, tuner = _hybrid(path, _fixed(lambda r: SLOW_S, []), band=(1 + times[2] / times[0]) / 2)
    t = plan.to_dict()["tuning"]
    assert (t["choices"], t["measured"], t["outside_band"], t["lone_choices"]) == (3, 2, 1, 0)
    assert t["timed_fraction"] == pytest.approx(2 / 3, abs=1e-4)
    assert "67% of the choices timed, 0 of them their group's only one" in tuner.stats.line()
    assert "1 kept predicted (1 outside the band)" in tuner.stats.line()
    seconds = {(0, 1): 2e-4, (0,): 5e-5, (1,): 1e-6}
    (tmp_path / "two").mkdir()
    plan, _, tuner = _hybrid(_matmul_relu(tmp_path / "two"), _fixed(lambda r: seconds[r.kernel.nodes], []))
    t = plan.to_dict()["tuning"]
    assert (t["choices"], t["measured"], t["outside_band"], t["lone_choices"]) == (6, 6, 0, 1)


def _choices_of(legality, nodes):
    nodes = frozenset(nodes)
    return legality.priced(legality.options(nodes, legality.check(nodes).kernel))


def test_hybrid_picks_the_measured_best_within_its_band(tmp_path):
    """A lone MatMul: the model's best is our C with its own product (BLAS ties it, the library
    call is predicted slightly slower). Measured, BLAS is 10x faster: hybrid picks it; the library
    call, outside a band narrower than its predicted gap, is never timed."""
    path = _matmul(tmp_path)
    times = [c.time_s for _, c in _choices(prepare(path))]
    assert times[0] == times[1] < times[2]  # own, blas, library
    calls: list = []
    plan, problem, tuner = _hybrid(path, _fixed(lambda r: FAST_S if r.kernel.schedule.product == "blas" else SLOW_S,
                                                calls), band=(1 + times[2] / times[0]) / 2)
    predicted = search(problem.graph, load_device("host", 1)[0], problem.legality.model, "cpsat")
    assert predicted.groups[0].kernel.schedule.product == "own"
    g = plan.groups[0]
    assert (g.kernel.impl, g.kernel.schedule.product, g.source) == ("generated", "blas", "measured")
    assert g.cost.time_s == pytest.approx(FAST_S)
    assert calls == [[((0,), "generated", "own"), ((0,), "generated", "blas")]]
    library = [v for v in _verdicts(problem.legality, {0}) if v[0] == "library"]
    assert library and "outside hybrid's" in library[0][1]
    assert (tuner.stats.choices, tuner.stats.measured, tuner.stats.predicted) == (3, 2, 1)


def _verdicts(legality, nodes):
    """(impl, why) of each choice the measurer priced for `nodes` (read back from it)."""
    fits = _choices_of(legality, nodes)
    rows = legality.measurer.times([k for k, _ in fits], [c for _, c in fits])
    return [(k.impl, why) for (k, _), (_, why) in zip(fits, rows, strict=True)]


def test_sample_times_choices_afresh_interleaved_and_stores_nothing(tmp_path):
    """An A/B of a group's choices: one sampling call, each net of the null calls, the timing
    database untouched."""
    from fusesearch.autotune import Autotuner

    prep, calls = prepare(_matmul(tmp_path)), []
    tuner = Autotuner(prep, CPU, "measured", cache=TimingCache(tmp_path / "db"),
                      sampler=_fixed(lambda r: FAST_S if r.how == "library" else SLOW_S, calls))
    kernels = [k for k, _ in _choices(prep)]
    timings = tuner.sample(kernels, budget_s=0.5, rounds=7)
    assert [t.median_s for t in timings] == [SLOW_S, SLOW_S, FAST_S]
    assert len(calls) == 1 and [c[1] for c in calls[0]] == ["generated", "generated", "library"]
    assert not (tmp_path / "db").exists() and tuner.stats.measured == 0


def test_hybrids_clock_and_band_come_from_the_measurements():
    """Unmeasured choices go on the measured clock by their template's median measured/predicted
    ratio (all templates' while one has too few), and the band is the model's 80th-percentile
    error left after that."""
    from fusesearch.autotune import DEFAULT_BAND, MIN_PAIRS, clock_scales, data_band, measured_scale

    pairs = [("gemm", 1.0, 2.0 * math.exp(e)) for e in (-0.4, -0.2, -0.1, 0.0, 0.0, 0.1, 0.2, 0.3, 0.5, 0.6)]
    pairs += [("rowwise", 1.0, 0.5), ("rowwise", 2.0, 1.0)]
    assert measured_scale([(p, m) for _, p, m in pairs[:10]]) == pytest.approx(1.0 + math.exp(0.1))  # of ten: two
    scales = clock_scales(pairs)
    assert set(scales) == {None, "gemm"}  # rowwise: two pairs, all templates' scale
    assert scales["gemm"] == pytest.approx(1.0 + math.exp(0.1)) and scales[None] == pytest.approx(2.0)
    logs = [abs(math.log(m / (scales.get(t, scales[None]) * p))) for t, p, m in pairs]
    assert data_band(pairs, scales) == pytest.approx(math.exp(np.percentile(logs, 80)))
    assert data_band(pairs[:MIN_PAIRS - 1], scales) == DEFAULT_BAND and measured_scale([]) == 1.0


def test_hybrids_band_is_the_error_on_a_groups_order():
    """Four groups whose two choices the model errs on alike (0.6 apart from group to group in log,
    their difference 0.05): the band from the pairs of one group's choices is exp(0.05), far
    narrower than the choices' own errors' (`data_band`); with fewer than MIN_PAIRS pairs there
    is none (the band falls back to data_band)."""
    from fusesearch.autotune import BAND_QUANTILE, MIN_PAIRS, clock_scales, data_band, group_band

    pairs, group_of = {}, {}
    for g, shared in enumerate((-0.9, -0.3, 0.3, 0.9, -0.6, 0.0, 0.6, 1.2)):
        for c, own in enumerate((0.0, 0.05)):
            key = f"g{g}c{c}"
            pairs[key], group_of[key] = ("conv/nchwc", 1.0, math.exp(shared + own)), frozenset({g})
    scales = clock_scales(list(pairs.values()))
    assert group_band(pairs, group_of, scales) == pytest.approx(math.exp(0.05))
    assert data_band(list(pairs.values()), scales) > math.exp(0.5)
    few = {k: v for k, v in pairs.items() if group_of[k] in {frozenset({g}) for g in range(MIN_PAIRS - 1)}}
    assert group_band(few, group_of, scales) is None and BAND_QUANTILE == 80.0


def test_a_cost_class_is_a_template_and_its_code_path(tmp_path):
    """The model errs alike on one template's kernels of one code path: a conv + Relu group's four
    CPU products (band, packed panels, im2col, blocked) each have a class, and a scale, of their
    own."""
    from fusesearch.autotune import cost_class
    from fusesearch.lowering import choices, nchwc_choices
    from tests.backends.test_cpu_nchwc import AVX2, _conv_group, _whole

    graph, _ = _conv_group(tmp_path, [1, 16, 8, 8], 16, 3, 1)
    group = _whole(graph)
    classes = {cost_class(k) for k in (*choices(graph, group, host=AVX2), *nchwc_choices(graph, group, AVX2))}
    assert classes == {"conv/band", "conv/packed", "conv/im2col", "conv/nchwc"}


@pytest.mark.parametrize("command", ["plan", "measure", "run"])
def test_a_bad_costs_value_is_one_line_exit_2(tmp_path, run_cli, command):
    code, _, err = run_cli(command, _matmul(tmp_path), *(["--device", "host"] if command == "plan" else []),
                           "--costs", "fastest")
    assert code == 2
    assert err.strip().splitlines() == ["fusesearch: error: --costs fastest: choose one of predicted, measured, "
                                        "hybrid"]


def test_measured_costs_for_a_gpu_without_one_is_one_line_exit_2(tmp_path, run_cli):
    from tests.conftest import gpu_state

    if gpu_state()[0] == "ready":
        pytest.skip("a GPU is here: measured costs run on it")
    code, _, err = run_cli("plan", _matmul(tmp_path), "--device", "h100-sxm", "--costs", "measured")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fusesearch: error: --costs measured: ")
    assert "--device h100-sxm" in lines[0] and "GPU" in lines[0]


def test_a_measured_plan_runs_equal_to_onnx_runtime(tmp_path, run_cli):
    """Real timings, no assertion on them: the plan is valid, says what priced it, and runs."""
    from jsonschema import validate

    from fusesearch.plans import plan_schema

    a = np.random.default_rng(1).standard_normal((32, 32)).astype(np.float32)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
                        helper.make_node("Relu", ["y"], ["r"], name="relu"),
                        helper.make_node("Add", ["r", "x"], ["z"], name="add")],
                       [("x", [32, 32])], [("z", [32, 32])], [("w", a)])
    path, out = save(model, tmp_path / "m.onnx"), tmp_path / "plan.json"
    code, stdout, err = run_cli("plan", path, "--device", "host", "--costs", "measured", "-o", out)
    assert code == 0, err
    assert "choices" in err and "measured" in err
    # the summary names its source and does not set measured times against the model's bound
    assert "measured (sum of kernels)" in stdout and "predicted" not in stdout and "above it" not in stdout
    doc = json.loads(out.read_text())
    validate(doc, plan_schema())
    assert doc["costs"] == "measured" and {g["cost_source"] for g in doc["groups"]} <= {"measured", "predicted"}
    tuning = doc["tuning"]  # what measuring cost, kept with the plan
    assert tuning["costs"] == "measured" and tuning["measured"] + tuning["from_database"] <= tuning["choices"]
    code, stdout, err = run_cli("run", path, "--plan", out, "--costs", "measured", "--repeat", 1, "--warmup", 0,
                                "--json")
    assert code == 0, err
    assert json.loads(stdout)["max_rel_err"] <= 1e-4


def test_regret_runs_both_plans_and_reports_the_difference(tmp_path, run_cli):
    """Real runs: the structure of the table and the document, no assertion on the times."""
    path = _matmul(tmp_path)
    code, stdout, err = run_cli("regret", path, "--strategy", "greedy", "--repeat", 2, "--json")
    assert code == 0, err
    doc = json.loads(stdout)
    assert set(doc["plans"]) == {"predicted", "measured"}
    for p in doc["plans"].values():
        assert p["kernels"] == 1 and p["p20_s"] <= p["median_s"] <= p["p80_s"]
    assert doc["regret_s"] == pytest.approx(doc["plans"]["predicted"]["median_s"] - doc["plans"]["measured"]["median_s"])
    assert doc["verdict"] in ("not distinguishable", "measured plan faster", "predicted plan faster")
    assert doc["tuning"]["costs"] == "measured" and doc["tuning"]["choices"] == len(_choices(prepare(path)))
    code, stdout, _ = run_cli("regret", path, "--strategy", "greedy", "--repeat", 2)
    assert code == 0 and "regret (predicted - measured)" in stdout and "noise" in stdout


def test_regret_refuses_a_gpu_device(tmp_path, run_cli):
    code, _, err = run_cli("regret", _matmul(tmp_path), "--device", "h100-sxm")
    assert code == 2 and err.strip().startswith("fusesearch: error: --device h100-sxm: regret runs")


def test_a_sweep_file_takes_costs_and_checks_it(tmp_path):
    from fusesearch.sweep import expand, parse_config

    base = {"models": [{"model": "zoo:bert-small"}], "devices": ["host"], "strategies": ["greedy"]}
    predicted = expand(parse_config(base, tmp_path / "s.toml"))[0]
    measured = expand(parse_config({**base, "costs": "measured"}, tmp_path / "s.toml"))[0]
    assert predicted.costs == "predicted" and "costs" not in predicted.params()  # ids as before
    assert measured.costs == "measured" and measured.cell_id != predicted.cell_id
    from fusesearch.errors import BadInput

    with pytest.raises(BadInput, match=r"costs = fastest: choose one of predicted, measured, hybrid"):
        parse_config({**base, "costs": "fastest"}, tmp_path / "s.toml")


class _Wrong:
    """A measurer that finds every generated choice computing wrongly (as a kernel whose outputs
    differ from ONNX Runtime's is reported) and times the library's."""

    mode = "measured"

    def scale(self, kernel):
        return 1.0

    def times(self, kernels, costs):
        import math

        return [(math.inf, "refused: wrong outputs") if k.impl == "generated" else (FAST_S, "") for k in kernels]


def test_a_choice_that_computes_wrongly_is_refused_not_priced(tmp_path):
    w = np.ones((16, 16), np.float32)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
                        helper.make_node("Relu", ["y"], ["r"], name="relu")],
                       [("x", [16, 16])], [("r", [16, 16])], [("w", w)])
    prep = prepare(save(model, tmp_path / "m.onnx"))
    spec, params = load_device("host", 1)
    legality = SearchProblem.build(prep.graph, spec, RooflineModel(params), measurer=_Wrong()).legality
    fused, lone = legality.check({0, 1}), legality.check({0})
    assert not fused.decision and "wrong outputs" in fused.decision.reason  # no other choice: not a candidate
    assert lone.decision and lone.kernel.impl == "library" and lone.time_s == FAST_S


@pytest.mark.parametrize("blocked_faster", [True, False])
def test_measured_costs_choose_layouts_by_the_measured_forms(tmp_path, blocked_faster):
    """With measured costs a CNN's groups' forms in channel blocks are timed beside their NCHW
    ones (each run once on its inputs as they lie and checked against ONNX Runtime first): blocks
    measured faster make the plan run the chain blocked, measured slower keep it NCHW, whatever
    the model predicts."""
    from tests.search.test_layouts import depthwise_chain, host16

    prep = prepare(depthwise_chain(tmp_path))
    spec, params = host16(), load_device("host", 1)[1]
    fast, slow = (FAST_S, SLOW_S) if blocked_faster else (SLOW_S, FAST_S)
    calls: list = []
    sampler = _fixed(lambda r: fast if r.kernel.schedule.layout_out.blocked else slow, calls)
    problem, tuner = build_problem(prep, spec, RooflineModel(params), SearchConfig(workers=1), "measured",
                                   cache=TimingCache(tmp_path / "db"), sampler=sampler)
    plan = search(prep.graph, spec, problem.legality.model, "cpsat", problem=problem)
    blocked = [g for g in plan.groups if g.kernel.schedule.layout_out.blocked]
    timed_blocked = sum(1 for batch in calls for r in batch if r[2] == "nchwc")
    assert timed_blocked >= 1 and tuner.stats.refused == 0  # the same source, shapes and device: timed once
    assert len(blocked) == (3 if blocked_faster else 0)
    assert all(g.cost.time_s == pytest.approx(fast) for g in blocked)
    assert (plan.to_dict()["layouts"]["reorders"] != []) == blocked_faster


def test_hybrid_times_a_group_in_the_layout_its_plan_runs_it(tmp_path):
    """A depthwise chain where channel blocks pay (16 lanes, the NCHW depthwise loop priced slow):
    the model's plan runs every conv blocked, so hybrid's first batch times the conv groups' blocked
    forms only, not their NCHW forms; a form no plan used stays predicted, on the measured clock
    and optimistic by the band. Every sample is the same, so the measured costs keep the plan."""
    from costmodels.roofline import host_params
    from fusesearch.autotune import _form, tuned_search
    from tests.search.test_layouts import DEPTHWISE_SLOW, depthwise_chain, host16

    path, calls = depthwise_chain(tmp_path), []
    model = RooflineModel(host_params().with_updates(**DEPTHWISE_SLOW))
    config = SearchConfig(workers=1, time_limit_s=30, layouts="auto")
    prep, spec = prepare(path), host16()
    predicted = search(prep.graph, spec, model, "cpsat", config=config)
    convs = [frozenset(g.nodes) for g in predicted.groups if g.kernel.schedule.layout_out.blocked]
    assert len(convs) == 3  # the model's plan: every conv group blocked
    plan, problem = tuned_search(prep, spec, model, "cpsat", config, "hybrid", cache=TimingCache(tmp_path / "db"),
                                 sampler=_fixed(lambda r: 1e-4, calls))
    tuner = problem.legality.measurer
    first = [(frozenset(nodes), product) for nodes, _, product in calls[0]]  # equal kernels timed once
    assert first and {nodes for nodes, _ in first} <= set(convs)
    assert {product for _, product in first} == {"nchwc"}  # never their NCHW form
    nchw = [k for k in problem.legality.options(convs[0], problem.legality.check(convs[0]).kernel)]
    assert nchw and all(k.schedule.product != "nchwc" for k in nchw)
    assert all(_form(k) not in tuner._wanted for k in nchw)  # no plan ran the group in NCHW
    assert tuner.stats.measured < tuner.stats.choices
    assert [frozenset(g.nodes) for g in plan.groups if g.kernel.schedule.layout_out.blocked] == convs

