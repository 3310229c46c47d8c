"""Sweeps: config errors (exit 2, one line), grid expansion, a 2-worker LocalCluster run, resume,
failed cells, and crash safety (a killed worker, a killed sweep) — no row lost, none duplicated."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from costmodels import RooflineParams
from fusesearch.errors import BadInput
from fusesearch.sweep import SweepStore, expand, load_config, read_cells, run_sweep

# a mark, not a module-level importorskip: `-m gpu` deselects these tests rather than skipping the module
pytestmark = pytest.mark.skipif(importlib.util.find_spec("distributed") is None, reason="dask.distributed is not installed")

TINY = """
name = "tiny"
models = ["zoo:rnn-control", "zoo:unet"]
devices = ["t4", "h200"]
strategies = ["none", "greedy", "cpsat"]
[params]
time_limit_s = [5, 10]
"""

# big enough that a kill lands mid-run (each cpsat cell of bert-small takes ~0.3-1 s here)
KILL = """
name = "kill"
devices = ["t4", "h200"]
strategies = ["greedy", "cpsat"]
models = ["zoo:rnn-control", "zoo:unet", {model = "zoo:bert-small", zoo = {layers = [1, 2]}}]
[params]
time_limit_s = 5
"""


def _config(tmp_path: Path, text: str, name: str = "sweep.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _rows(out: Path) -> pd.DataFrame:
    return pd.read_parquet(out / "results.parquet")


# -- config -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, needle", [
    ("models = []\ndevices = ['t4']", "'models' is missing or empty"),
    ("models = ['zoo:nope']\ndevices = ['t4']", "unknown zoo model 'nope'"),
    ("models = ['zoo:unet']\ndevices = ['t5']", "devices: t5"),
    ("models = ['zoo:unet']\ndevices = ['t4']\nstrategies = ['fast']", "strategies = ['fast']"),
    ("models = ['zoo:unet']\ndevices = ['t4']\nmodle = 1", "unknown key 'modle'"),
    ("models = [{model = 'zoo:unet', zoo = {layers = [1]}}]\ndevices = ['t4']", "has no parameter 'layers'"),
    ("models = ['zoo:unet']\ndevices = ['t4']\n[params]\ntime_limit_s = -1", "params.time_limit_s"),
    ("models = ['missing.onnx']\ndevices = ['t4']", "missing.onnx: no such file"),
    ("models = [{model = 'zoo:bert-small', dims = {seqq = 8}}]\ndevices = ['t4']", "models[0].dims.seqq"),
    ("models = ['zoo:unet'\n", "not valid TOML"),
    ("models = ['zoo:unet']\ndevices = ['t4']\nmeasure = ['end_to_end']", "measure only applies to a sweep that "
     "measures; add backend = \"cpu\""),
    ("models = ['zoo:unet']\ndevices = ['t4']\nrepeat = 5", "repeat only applies"),
    ("models = ['zoo:unet']\ndevices = ['t4']\nbackend = 'cpu'\nmeasure = ['fast']", "measure = ['fast']; give a "
     "list drawn from kernels, end_to_end"),
    ("models = ['zoo:unet']\ndevices = ['t4']\nbackend = 'cupy'\nmeasure = ['end_to_end']",
     "end to end on backend = \"cpu\" only"),
    ("models = ['zoo:unet']\ndevices = ['t4']\nbackend = 'cpu'\nthreads = 0", "threads = 0; give a whole number from 1 to"),
    ("models = ['zoo:unet']\ndevices = ['t4']\n[params]\ndecompose = ['never', 'sometimes']",
     "params.decompose = 'sometimes': choose one of auto, always, never"),
])
def test_bad_configs_name_the_file_and_key(tmp_path, text, needle):
    path = _config(tmp_path, text)
    with pytest.raises(BadInput) as err:
        load_config(path)
    assert needle in str(err.value) and str(path) in str(err.value)


def test_bad_config_on_the_command_line_is_exit_2_one_line(tmp_path, run_cli):
    path = _config(tmp_path, "models = ['zoo:unet']\ndevices = ['t5']")
    code, out, err = run_cli("sweep", path, "--workers", "2")
    assert code == 2 and err.count("\n") == 1 and "t5" in err and "Traceback" not in err
    code, _, err = run_cli("sweep", tmp_path / "none.toml")
    assert code == 2 and "no such sweep config" in err


def test_expand_is_stable_and_runs_time_limits_only_for_cpsat(tmp_path):
    cfg = load_config(_config(tmp_path, TINY))
    cells = expand(cfg)
    # 2 models x 2 devices x (none + greedy + cpsat at 2 time limits)
    assert len(cells) == 2 * 2 * 4
    assert len({c.cell_id for c in cells}) == len(cells)
    assert [c.cell_id for c in cells] == [c.cell_id for c in expand(load_config(tmp_path / "sweep.toml"))]
    assert {c.time_limit_s for c in cells if c.strategy != "cpsat"} == {None}
    assert [c.index for c in cells] == list(range(len(cells)))


def test_decompose_expands_cpsat_cells_only_and_auto_keeps_the_ids_of_sweeps_without_it(tmp_path):
    plain = expand(load_config(_config(tmp_path, TINY)))
    auto = expand(load_config(_config(tmp_path, TINY + 'decompose = "auto"\n')))
    both = expand(load_config(_config(tmp_path, TINY + 'decompose = ["auto", "never"]\n')))
    assert [c.cell_id for c in auto] == [c.cell_id for c in plain]
    assert {c.decompose for c in plain if c.strategy != "cpsat"} == {None}
    exact = [c for c in both if c.strategy == "cpsat"]
    assert len(both) == len(plain) + len(exact) // 2 and {c.decompose for c in exact} == {"auto", "never"}
    assert len({c.cell_id for c in both}) == len(both)


def test_cell_ids_follow_a_profiles_content_and_the_results_version(tmp_path, monkeypatch):
    """A profile recalibrated in place, or a change that alters results (RESULTS_VERSION), gives
    new cell ids, so a rerun recomputes instead of keeping stale rows; the path alone does not."""
    import importlib

    from costmodels import DEVICES
    from costmodels.profile import Profile, save_profile

    sweep_module = importlib.import_module("fusesearch.sweep")

    profile = tmp_path / "p.json"
    save_profile(Profile(DEVICES["t4"]), profile)
    path = _config(tmp_path, 'models = ["zoo:rnn-control"]\ndevices = ["p.json"]\nstrategies = ["none"]\n')
    first = [c.cell_id for c in expand(load_config(path))]
    assert first == [c.cell_id for c in expand(load_config(path))]
    save_profile(Profile(DEVICES["t4"], RooflineParams().with_updates(overlap=0.5)), profile)
    second = [c.cell_id for c in expand(load_config(path))]
    assert second != first
    monkeypatch.setattr(sweep_module, "RESULTS_VERSION", sweep_module.RESULTS_VERSION + 1)
    assert [c.cell_id for c in expand(load_config(path))] != second


def test_a_rerun_after_recalibrating_holds_only_the_new_grids_rows(tmp_path):
    """The profile changes in place: every cell reruns under a new id, and the results (and so
    `report`) hold the new grid only; the earlier grid's cell files stay on disk, unread."""
    from costmodels import DEVICES
    from costmodels.profile import Profile, save_profile
    from fusesearch.sweep import load_results

    profile = tmp_path / "p.json"
    save_profile(Profile(DEVICES["t4"]), profile)
    path = _config(tmp_path, 'models = ["zoo:rnn-control"]\ndevices = ["p.json"]\nstrategies = ["none", "greedy"]\n')
    out = tmp_path / "out"
    first = run_sweep(load_config(path), out, workers=1)
    old = set(load_results(out)["cell_id"])
    save_profile(Profile(DEVICES["t4"], RooflineParams().with_updates(overlap=0.5)), profile)
    second = run_sweep(load_config(path), out, workers=1)
    assert first.ran == second.ran == 2 and len(list((out / "cells").glob("*.json"))) == 4
    rows = load_results(out)
    assert len(rows) == 2 and not set(rows["cell_id"]) & old
    assert set(pd.read_parquet(out / "results.parquet")["cell_id"]) == set(rows["cell_id"])


def test_zoo_parameters_expand_into_models(tmp_path):
    cfg = load_config(_config(tmp_path, KILL))
    labels = [m.label for m in cfg.models]
    assert labels[-2:] == ["bert-small/layers=1", "bert-small/layers=2"]
    assert len(expand(cfg)) == 4 * 2 * 2


def test_a_cpu_sweep_measures_kernels_and_the_whole_plan_unless_told(tmp_path):
    """backend = "cpu" times each kernel and the whole plan; measure = [...] picks; the end to end
    settings are part of each cell's identity."""
    base = 'models = ["zoo:rnn-control"]\ndevices = ["host"]\nstrategies = ["none"]\nbackend = "cpu"\n'
    cpu = load_config(_config(tmp_path, base))
    assert cpu.measure == ("kernels", "end_to_end") and (cpu.threads, cpu.repeat) == (1, 20)
    only = load_config(_config(tmp_path, base + 'measure = ["end_to_end"]\nrepeat = 3\n', "e2e.toml"))
    cell = expand(only)[0]
    assert (cell.measure, cell.repeat, cell.threads, cell.measure_budget_s) == (("end_to_end",), 3, 1, None)
    assert cell.cell_id != expand(cpu)[0].cell_id
    assert load_config(_config(tmp_path, base.replace("cpu", "cupy"), "gpu.toml")).measure == ("kernels",)
    plain = load_config(_config(tmp_path, base.replace('backend = "cpu"\n', ""), "plain.toml"))
    assert plain.measure == () and expand(plain)[0].repeat is None


def test_a_cpu_sweep_records_the_plan_run_end_to_end_beside_onnx_runtime(tmp_path):
    """A model built in code, two strategies, measured end to end only: every end_to_end_* figure
    is there, positive, and the programs equal ONNX Runtime's outputs."""
    from onnx import helper

    from tests.conftest import make_model, save
    from tests.test_report import _sweep

    rng = np.random.default_rng(0)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
                        helper.make_node("Relu", ["y"], ["r"], name="relu"),
                        helper.make_node("Tanh", ["r"], ["z"], name="tanh")],
                       [("x", [8, 32])], [("z", [8, 16])], [("w", rng.standard_normal((32, 16)).astype("float32"))])
    save(model, tmp_path / "mm.onnx")
    out, _ = _sweep(tmp_path, 'models = ["mm.onnx"]\ndevices = ["host"]\nstrategies = ["none", "greedy"]\n'
                              'backend = "cpu"\nmeasure = ["end_to_end"]\nrepeat = 3\n')
    rows = _rows(out)
    assert (rows["status"] == "ok").all(), rows["error"].tolist()
    for program in ("plan", "unfused", "ort_enable_all", "ort_disable_all"):
        for stat in ("median_s", "p20_s", "p80_s"):
            assert (rows[f"end_to_end_{program}_{stat}"] > 0).all(), (program, stat)
        assert (rows[f"end_to_end_{program}_n"] == 3).all()
    assert (rows["end_to_end_max_rel_err"] < 1e-4).all() and (rows["end_to_end_threads"] == 1).all()
    assert (rows["end_to_end_arena_peak_bytes"] > 0).all() and (rows["end_to_end_segments_generated"] >= 1).all()
    assert rows["measured_on"].notna().all() and "measured_s" not in rows  # no kernel timed alone
    fused = rows[rows["strategy"] == "greedy"].iloc[0]
    assert fused["end_to_end_kernels"] < rows[rows["strategy"] == "none"].iloc[0]["end_to_end_kernels"]


# -- running --------------------------------------------------------------------------------------

def test_small_sweep_on_two_workers_then_resume_skips_everything(tmp_path, run_cli):
    path = _config(tmp_path, TINY)
    out = tmp_path / "out"
    code, stdout, err = run_cli("sweep", path, "--workers", "2", "--out", out, "--json")
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["cells"] == 16 and doc["ran"] == 16 and doc["failed"] == 0
    rows = _rows(out)
    assert len(rows) == 16 and rows["cell_id"].is_unique and (rows["status"] == "ok").all()
    assert list(rows["cell_index"]) == list(range(16))
    none = rows[rows["strategy"] == "none"]
    assert (none["kernels"] == none["canonical_nodes"]).all()
    fused = rows[rows["strategy"] == "cpsat"]
    assert (fused["kernels"] < fused["canonical_nodes"]).all() and (fused["candidates"] > 0).all()
    assert (rows["time_s"] <= rows["unfused_time_s"] * (1 + 1e-9)).all()
    for col in ("git_rev", "versions", "timestamp", "wall_s", "lower_bound_s", "gap", "solver_status"):
        assert col in rows
    before = {p.name: p.read_text() for p in (out / "cells").iterdir()}
    code, stdout, err = run_cli("sweep", path, "--workers", "2", "--out", out, "--json")
    assert code == 0, err
    again = json.loads(stdout)
    assert again["skipped"] == 16 and again["ran"] == 0
    assert {p.name: p.read_text() for p in (out / "cells").iterdir()} == before
    assert len(_rows(out)) == 16
    # results committed without their cell files: the cells come back from results.parquet
    for p in (out / "cells").iterdir():
        p.unlink()
    restored = run_sweep(load_config(path), out, workers=2)
    assert restored.skipped == 16 and restored.ran == 0 and len(_rows(out)) == 16


def test_cells_are_deterministic_apart_from_times(tmp_path):
    from fusesearch.sweep import run_cell

    cell = next(c for c in expand(load_config(_config(tmp_path, TINY))) if c.strategy == "cpsat")
    volatile = {"timestamp", "wall_s", "cell_wall_s", "prepare_s", "enumeration_s", "solve_s", "worker"}
    a, b = run_cell(cell), run_cell(cell)
    assert a["status"] == "ok"
    assert {k: v for k, v in a.items() if k not in volatile} == {k: v for k, v in b.items() if k not in volatile}


def test_a_different_config_in_out_is_refused_unless_forced(tmp_path, run_cli):
    out = tmp_path / "out"
    small = 'models = ["zoo:rnn-control"]\ndevices = [DEVICES]\nstrategies = ["none", "greedy"]\n'
    first = _config(tmp_path, small.replace("DEVICES", '"t4", "h200"'))
    code, _, err = run_cli("sweep", first, "--workers", "1", "--out", out)
    assert code == 0, err
    other = _config(tmp_path, small.replace("DEVICES", '"t4"'), "other.toml")
    code, _, err = run_cli("sweep", other, "--workers", "1", "--out", out)
    assert code == 2 and "different sweep" in err and "--force" in err and err.count("\n") == 1
    assert len(read_cells(out)) == 4  # untouched
    code, _, err = run_cli("sweep", other, "--workers", "1", "--out", out, "--force")
    assert code == 0, err
    assert len(_rows(out)) == 2 and set(_rows(out)["device"]) == {"t4"}


def test_a_manifest_from_before_a_setting_existed_is_the_same_sweep(tmp_path, run_cli):
    """An unchanged TOML after an upgrade that adds a setting (here `decompose`, whose default the
    old manifest never spelled) keeps its results; a changed setting is still another sweep."""
    out = tmp_path / "out"
    path = _config(tmp_path, 'models = ["zoo:rnn-control"]\ndevices = ["t4"]\nstrategies = ["greedy", "cpsat"]\n')
    code, _, err = run_cli("sweep", path, "--workers", "1", "--out", out)
    assert code == 0, err
    manifest = json.loads((out / "sweep.json").read_text())
    assert manifest["config"]["params"].pop("decompose") == ["auto"]
    manifest["config"]["models"][0].pop("zoo")
    manifest["config_sha256"] = "written by an older version"
    (out / "sweep.json").write_text(json.dumps(manifest))
    code, _, err = run_cli("sweep", path, "--workers", "1", "--out", out)
    assert code == 0, err  # the same sweep: its cells are kept, nothing reruns
    assert len(read_cells(out)) == 2
    never = _config(tmp_path, 'models = ["zoo:rnn-control"]\ndevices = ["t4"]\nstrategies = ["greedy", "cpsat"]\n'
                              '[params]\ndecompose = ["never"]\n', "never.toml")
    code, _, err = run_cli("sweep", never, "--workers", "1", "--out", out)
    assert code == 2 and "different sweep" in err


def test_a_failing_cell_is_recorded_and_retried_the_rest_go_on(tmp_path):
    from onnx import TensorProto, helper

    from tests.conftest import make_model, save

    # its input binds (so the config is accepted), but its MatMul of [2, 3] by [4, 5] fails to load
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", [2, 3])], [("y", None)])
    model.graph.initializer.append(helper.make_tensor("w", TensorProto.FLOAT, [4, 5], [0.0] * 20))
    save(model, tmp_path / "broken.onnx")
    path = _config(tmp_path, 'models = ["zoo:rnn-control", "broken.onnx"]\ndevices = ["t4"]\n'
                             'strategies = ["none", "greedy"]\n')
    out = tmp_path / "out"
    summary = run_sweep(load_config(path), out, workers=1)
    assert summary.cells == 4 and summary.failed == 2
    rows = _rows(out)
    bad = rows[rows["model"] == "broken"]
    assert (bad["status"] == "error").all() and bad["error"].str.contains("broken.onnx").all()
    assert (rows[rows["model"] == "rnn-control"]["status"] == "ok").all()
    again = run_sweep(load_config(path), out, workers=1)
    assert again.skipped == 2 and again.ran == 2 and again.failed == 2  # failed cells are retried
    assert len(_rows(out)) == 4


def test_killing_a_worker_mid_run_loses_and_duplicates_nothing(tmp_path):
    cfg = load_config(_config(tmp_path, KILL))
    out = tmp_path / "out"
    state: dict = {}

    def on_client(client):
        state["pids"] = client.run(os.getpid)  # worker address -> pid

    def progress(done, total, row):
        if row is None or "killed" in state:
            return
        mine = int(row["worker"].rsplit(":", 1)[1])
        victim = next((p for p in state["pids"].values() if p != mine), mine)
        os.kill(victim, signal.SIGKILL)
        state["killed"] = victim

    summary = run_sweep(cfg, out, workers=2, progress=progress, on_client=on_client)
    assert "killed" in state
    with pytest.raises(ProcessLookupError):
        os.kill(state["killed"], 0)
    rows = _rows(out)
    cells = expand(cfg)
    assert len(rows) == len(cells) == summary.cells and rows["cell_id"].is_unique
    assert set(rows["cell_id"]) == {c.cell_id for c in cells}
    assert (rows["status"] == "ok").all(), rows[rows["status"] != "ok"]["error"].tolist()
    resumed = run_sweep(cfg, out, workers=2)
    assert resumed.ran == 0 and len(_rows(out)) == len(cells)


def test_killing_the_whole_sweep_then_resuming_keeps_every_finished_row(tmp_path):
    path = _config(tmp_path, KILL)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "fusesearch", "sweep", str(path), "--workers", "2",
                             "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600  # only a hung sweep's bound: a busy machine writes cells later
        while proc.poll() is None and time.monotonic() < deadline and len(list((out / "cells").glob("*.json"))) < 3:
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # client, scheduler and workers: the whole session
        proc.wait()
    finished = {p.stem: p.read_text() for p in (out / "cells").glob("*.json")}
    total = len(expand(load_config(path)))
    assert 3 <= len(finished) < total, "the sweep was not cut short; make the grid bigger"
    summary = run_sweep(load_config(path), out, workers=2)
    assert summary.skipped == len(finished) and summary.ran == total - len(finished)
    rows = _rows(out)
    assert len(rows) == total and rows["cell_id"].is_unique and (rows["status"] == "ok").all()
    for stem, text in finished.items():  # rows written before the kill are kept as they were
        assert (out / "cells" / f"{stem}.json").read_text() == text
    assert not list((out / "cells").glob(".*.tmp"))


def test_store_writes_cells_atomically(tmp_path):
    cfg = load_config(_config(tmp_path, TINY))
    store = SweepStore(tmp_path / "out")
    store.open(cfg)
    store.write({"cell_id": "abc", "status": "ok"})
    assert json.loads((tmp_path / "out" / "cells" / "abc.json").read_text())["status"] == "ok"
    assert [p.name for p in (tmp_path / "out" / "cells").iterdir()] == ["abc.json"]


def test_an_existing_scheduler_runs_the_cells(tmp_path, run_cli):
    from distributed import LocalCluster

    path = _config(tmp_path, 'models = ["zoo:rnn-control"]\ndevices = ["t4", "h200"]\nstrategies = ["greedy"]\n')
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        code, stdout, err = run_cli("sweep", path, "--scheduler", cluster.scheduler_address,
                                    "--out", tmp_path / "out", "--json")
    assert code == 0, err
    assert json.loads(stdout)["ran"] == 2 and len(_rows(tmp_path / "out")) == 2
    code, _, err = run_cli("sweep", path, "--scheduler", "tcp://x:1", "--workers", "2")
    assert code == 2 and "give one" in err


def test_local_workers_keep_glibcs_adaptive_malloc(tmp_path):
    """Dask's default MALLOC_TRIM_THRESHOLD_ would make every large scratch buffer of a generated
    C kernel a fresh mapping on each call; the sweep's local workers start without it."""
    seen = []
    path = _config(tmp_path, 'models = ["zoo:rnn-control"]\ndevices = ["t4"]\nstrategies = ["none"]\n')
    run_sweep(load_config(path), tmp_path / "out", workers=1,
              on_client=lambda c: seen.extend(c.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_")).values()))
    assert seen == [None]
