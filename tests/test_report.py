"""`fusesearch report`: tables and plots from real sweep rows (cells run in-process, no cluster)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from onnx import TensorProto, helper

from fusesearch.errors import BadInput
from fusesearch.report import fmt_time, plan_distance, write_report
from fusesearch.sweep import SweepStore, expand, load_config, run_cell
from tests.conftest import make_model, save

PNG = b"\x89PNG\r\n\x1a\n"


def _sweep(tmp_path, text: str):
    """Run every cell of `text` in this process and store the rows as `fusesearch sweep` would."""
    path = tmp_path / "s.toml"
    path.write_text(text)
    cfg = load_config(path)
    store = SweepStore(tmp_path / "out")
    store.open(cfg)
    cells = expand(cfg)
    for cell in cells:
        store.write(run_cell(cell))
    store.rebuild(cells)
    return tmp_path / "out", cells


GRID = """
name = "mini"
models = ["zoo:rnn-control", "zoo:unet"]
devices = ["t4", "h200"]
strategies = ["none", "rules", "greedy", "cpsat"]
[params]
time_limit_s = 5
"""


def test_report_tables_and_plots_from_a_sweep(tmp_path, run_cli):
    out, cells = _sweep(tmp_path, GRID)
    code, stdout, err = run_cli("report", out)
    assert code == 0, err
    text = (out / "report.md").read_text()
    assert text.startswith("# Sweep `mini`") and "16 cells: 16 ok, 0 failed" in text
    rows = pd.read_parquet(out / "results.parquet")
    # the per model x device table: one line per pair, one column per strategy, in strategy order
    table = [line for line in text.splitlines() if line.startswith("| unet | h200 |")]
    assert len(table) == 3  # the per-model, solver and devices tables
    head = next(line for line in text.splitlines() if line.startswith("| model | device | nodes | unfused"))
    assert head.endswith("| none | rules | greedy | cpsat |")
    cp = rows[(rows.model == "unet") & (rows.device == "h200") & (rows.strategy == "cpsat")].iloc[0]
    assert f"{int(cp['kernels'])} · " in table[0] and f"{cp['speedup']:.2f}x" in table[0]
    assert "## The exact solver (cpsat)" in text and "## How the plan changes across devices" in text
    assert "## Predicted against measured" not in text  # nothing was measured
    for name in ("speedup", "solver_time", "devices"):
        assert (out / f"{name}.png").read_bytes().startswith(PNG)
        assert f"![{name}]({name}.png)" in text
    assert not (out / "measured.png").exists()
    code, _, err = run_cli("report", out)  # refuses to overwrite, naming the file and no -o it was not given
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"fusesearch: error: report {out / 'report.md'}: file exists") and "--force" in err, err
    code, _, err = run_cli("report", out, "-o", out / "report.md")
    assert code == 2 and err.startswith(f"fusesearch: error: -o {out / 'report.md'}: file exists"), err
    code, _, err = run_cli("report", out, "--force", "-o", tmp_path / "again.md")
    assert code == 0, err
    assert (tmp_path / "again.md").is_file() and (tmp_path / "devices.png").read_bytes().startswith(PNG)


def test_devices_section_counts_groups_that_moved(tmp_path):
    out, _ = _sweep(tmp_path, GRID.replace('["none", "rules", "greedy", "cpsat"]', '["cpsat"]'))
    rows = pd.read_parquet(out / "results.parquet").set_index(["model", "device"])
    a = set(json.loads(rows.loc[("unet", "t4"), "fused_groups"]))
    b = set(json.loads(rows.loc[("unet", "h200"), "fused_groups"]))
    write_report(out, out / "r.md")
    text = (out / "r.md").read_text()
    devices = text[text.index("## How the plan changes across devices"):]
    line = next(x for x in devices.splitlines() if x.startswith("| unet | h200 |"))
    assert f"+{len(b - a)} / -{len(a - b)} ({plan_distance(a, b):.0%})" in line
    assert "## Summary by strategy" in text and "| cpsat | 4 |" in text


def test_plan_distance():
    assert plan_distance(set(), set()) == 0.0
    assert plan_distance({"a+b"}, {"a+b"}) == 0.0
    assert plan_distance({"a+b", "c+d"}, {"a+b", "c+e"}) == pytest.approx(2 / 3)


def test_failed_cells_and_measured_cells_are_reported(tmp_path):
    rng = np.random.default_rng(0)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
                        helper.make_node("Relu", ["y"], ["z"], name="relu")],
                       [("x", [4, 16])], [("z", [4, 8])], [("w", rng.standard_normal((16, 8)).astype("float32"))])
    save(model, tmp_path / "mm.onnx")
    # its input binds (so the config is accepted), but its MatMul of [2, 3] by [4, 5] fails to load
    broken = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", [2, 3])], [("y", None)])
    broken.graph.initializer.append(helper.make_tensor("w", TensorProto.FLOAT, [4, 5], [0.0] * 20))
    save(broken, tmp_path / "broken.onnx")
    out, _ = _sweep(tmp_path, 'models = ["mm.onnx", "broken.onnx"]\ndevices = ["host"]\n'
                              'strategies = ["none", "greedy"]\nbackend = "cpu"\nmeasure_budget_s = 0.01\n')
    rows = pd.read_parquet(out / "results.parquet")
    ok = rows[rows.status == "ok"]
    assert len(ok) == 2 and (ok["measured_s"] > 0).all() and (ok["unfused_measured_s"] > 0).all()
    written = write_report(out, out / "report.md")
    text = (out / "report.md").read_text()
    assert "## Predicted against measured" in text and "## Failed cells" in text
    assert "## End to end against ONNX Runtime" in text  # a cpu sweep also runs each plan whole
    assert text.count("| broken |") == 2 and "broken.onnx" in text
    assert out / "measured.png" in written and (out / "measured.png").read_bytes().startswith(PNG)


def _chain(hidden: int):
    """x -> MatMul -> Relu -> Tanh -> MatMul -> Sigmoid: a plan fuses, the unfused graph does not."""
    rng = np.random.default_rng(hidden)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Tanh", ["r"], ["t"], name="tanh"),
             helper.make_node("MatMul", ["t", "w2"], ["u"], name="mm2"),
             helper.make_node("Sigmoid", ["u"], ["y"], name="sigmoid")]
    inits = [("w1", rng.standard_normal((32, hidden)).astype("float32") * 0.2),
             ("w2", rng.standard_normal((hidden, 16)).astype("float32") * 0.2)]
    return make_model(nodes, [("x", [16, 32])], [("y", [16, 16])], inits)


def _spearman(a, b) -> float:
    """Rank correlation from pandas' average ranks (an implementation apart from the report's)."""
    return float(np.corrcoef(pd.Series(list(a)).rank(), pd.Series(list(b)).rank())[0, 1])


def test_an_end_to_end_sweep_reports_plans_against_onnx_runtime_and_the_rank_correlation(tmp_path, run_cli):
    save(_chain(24), tmp_path / "small.onnx")
    save(_chain(96), tmp_path / "wide.onnx")
    out, cells = _sweep(tmp_path, 'models = ["small.onnx", "wide.onnx"]\ndevices = ["host"]\n'
                                  'strategies = ["none", "greedy"]\nbackend = "cpu"\nmeasure = ["end_to_end"]\n'
                                  'repeat = 3\n')
    rows = pd.read_parquet(out / "results.parquet")
    assert (rows.status == "ok").all() and len(rows) == 4
    code, stdout, err = run_cli("report", out)
    assert code == 0, err
    measured = rows["end_to_end_plan_median_s"]
    times = _spearman(rows["time_s"], measured)
    speedups = _spearman(rows["speedup"], rows["end_to_end_unfused_median_s"] / measured)
    # every correlation with its sample size; per model, never a mean of correlations
    within = {m: _spearman(part["time_s"], part["end_to_end_plan_median_s"]) for m, part in rows.groupby("model")}
    sentence = (f"plan times across the 4 cells ρ = {times:.2f} (n = 4); speedups over strategy none across cells "
                f"ρ = {speedups:.2f} (n = 4); the strategies' plan times within each model: "
                f"small ρ = {within['small']:.2f} (n = 2); wide ρ = {within['wide']:.2f} (n = 2).")
    assert sentence in stdout and "mean over" not in stdout  # printed ...
    none = rows[rows.strategy == "none"]
    gaps = (none["end_to_end_plan_median_s"] / none["end_to_end_unfused_median_s"] - 1).abs()
    noise = f"differ by up to {gaps.max():.1%} (median {gaps.median():.1%}, n = 2 cells)"
    assert noise in stdout  # the noise floor from the cells running the same program twice
    text = (out / "report.md").read_text()
    assert "## End to end against ONNX Runtime" in text and sentence in text and noise in text  # ... and in the report
    assert "## Predicted against measured\n" not in text  # no kernel was timed alone
    c = rows[(rows.model == "wide") & (rows.strategy == "greedy")].iloc[0]
    line = next(x for x in text.splitlines() if x.startswith("| wide | greedy |"))
    # ONNX Runtime's faster ENABLE_ALL figure: the model as given or its canonical form
    ort = min(c["end_to_end_ort_enable_all_median_s"], c["end_to_end_ort_enable_all_canonical_median_s"])
    for figure in (fmt_time(c["time_s"]), fmt_time(c["end_to_end_plan_median_s"]), fmt_time(ort),
                   f"{c['speedup']:.2f}x", f"{c['end_to_end_plan_median_s'] / ort:.2f}x", str(c["end_to_end_plan_n"])):
        assert f" {figure} |" in line, (figure, line)
    assert f" {c['end_to_end_unfused_median_s'] / c['end_to_end_plan_median_s']:.2f}x" in line
    assert (out / "measured.png").read_bytes().startswith(PNG)  # predicted against end-to-end times


def test_report_of_an_empty_folder_is_bad_input(tmp_path, run_cli):
    with pytest.raises(BadInput, match="holds no sweep results"):
        write_report(tmp_path, tmp_path / "r.md")
    code, _, err = run_cli("report", tmp_path / "missing")
    assert code == 2 and "no such folder" in err


DEPTHS = """
name = "depths"
models = [{ model = "zoo:llama-decode", label = "llama-decode", zoo = { layers = [1, 2] } }]
devices = ["h100-sxm"]
strategies = ["greedy", "cpsat"]
[params]
time_limit_s = 20
decompose = ["always", "never"]
"""


def test_a_sweep_over_decompose_reports_solve_time_against_depth_both_ways(tmp_path):
    out, cells = _sweep(tmp_path, DEPTHS)
    assert len(cells) == 2 * 3  # per depth: greedy, cpsat decomposed, cpsat whole
    rows = pd.read_parquet(out / "results.parquet")
    exact = rows[rows.strategy == "cpsat"].set_index(["model", "decompose"])
    assert (exact["pieces"].xs("always", level="decompose") > 1).all()
    assert exact["pieces"].xs("never", level="decompose").isna().all()
    write_report(out, out / "report.md")
    text = (out / "report.md").read_text()
    depth = text[text.index("## Solve time against depth, with and without decomposition"):]
    head = next(line for line in depth.splitlines() if line.startswith("| model |"))
    assert head == "| model | device | nodes | always | never |"
    for model in ("llama-decode/layers=1", "llama-decode/layers=2"):
        line = next(x for x in depth.splitlines() if x.startswith(f"| {model} | h100-sxm |"))
        for way in ("always", "never"):
            c = exact.loc[(model, way)]
            assert f"{c['wall_s']:.2f} s · {c['solver_status']}" in line
    assert "| cpsat, decompose always | 2 |" in text and "| cpsat, decompose never | 2 |" in text
    solver = text[text.index("## The exact solver (cpsat)"):]
    assert "| model | device | decompose | nodes | candidates | pieces |" in solver
    c = exact.loc[("llama-decode/layers=2", "always")]
    assert f"| {int(c['pieces'])} ({int(c['distinct'])}) |" in solver
