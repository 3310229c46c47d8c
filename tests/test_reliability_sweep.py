"""Sweeps on bad input: a config whose models cannot be made static fails when it is read (exit 2,
one line naming the TOML file and key, before any cell runs); a sweep whose every cell fails exits
1 and says so; a damaged results.parquet or sweep.json is named with its fix; config values follow
the CLI options' rules; nothing a sweep or a report reads is written over; one sweep at a time
writes a folder."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from onnx import TensorProto, helper

from fusesearch.errors import BadInput
from fusesearch.sweep import load_config
from tests.conftest import make_model, save

# a mark, not a module-level importorskip: `-m gpu` deselects these tests rather than skipping the module
pytestmark = pytest.mark.skipif(importlib.util.find_spec("distributed") is None, reason="dask.distributed is not installed")


def _dynamic(tmp_path: Path) -> str:
    """x: [batch, seq, 8] and mask: [batch, ?] → Relu(x) + ReduceSum(mask): named and unnamed dims."""
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu"),
             helper.make_node("ReduceSum", ["mask"], ["s"], keepdims=0, name="sum")]
    inputs = [("x", ["batch", "seq", 8]), ("mask", ["batch", None])]
    return save(make_model(nodes, inputs, [("y", None), ("s", None)]), tmp_path / "dyn.onnx")


def _unloadable(tmp_path: Path) -> str:
    """Static inputs that bind, but a MatMul of [2, 3] by [4, 5]: every cell fails when it loads."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 5], [0.0] * 20)
    model = make_model(nodes, [("x", [2, 3])], [("y", None)])
    model.graph.initializer.append(w)
    return save(model, tmp_path / "mismatch.onnx")


DYN_OK = "input_shapes = { mask = [1, 4] }, dims = { seq = 4 }"
# (models = ..., what the one line must hold besides the config's path)
BAD_BINDINGS = [
    ('["dyn.onnx"]', ["dyn.onnx", "input 'x' has unbound dynamic dim 0 'batch'", "dims = { batch = V } in models[0]"]),
    ('["zoo:unet", { model = "dyn.onnx", input_shapes = { mask = [1, 4] } }]',
     ["dyn.onnx", "input 'x' has unbound dynamic dim 1 'seq'", "dims = { seq = V } in models[1]"]),
    ('[{ model = "dyn.onnx", dims = { batch = 1, seq = 4 } }]',
     ["input 'mask' has unbound dynamic dim 1 (unnamed)", "input_shapes = { mask = [D1, D2, ...] } in models[0]"]),
    ('[{ model = "zoo:bert-small", dims = { seqq = 64 } }]',
     ["zoo:bert-small", "models[0].dims.seqq: unknown dim 'seqq'", "named dims are: batch, seq"]),
    ('[{ model = "zoo:bert-small", dims = { seqq = 64 }, zoo = { layers = [1, 2] } }]',
     ["models[0].dims.seqq: unknown dim 'seqq'"]),
    (f'[{{ model = "dyn.onnx", {DYN_OK.replace("[1, 4]", "[1, 4, 2]")} }}]',
     ["models[0].input_shapes.mask: the model's input has rank 2, this gives rank 3", "give 2 dims"]),
    ('[{ model = "dyn.onnx", input_shapes = { x = [1, 4, 9], mask = [1, 4] } }]',
     ["models[0].input_shapes.x: dim 2 is fixed to 8 in the model, this gives 9; use 8"]),
    ('[{ model = "dyn.onnx", input_shapes = { z = [1, 4] } }]',
     ["models[0].input_shapes.z: unknown input 'z'", "inputs are: x, mask"]),
    ('["broken.onnx"]', ["models[0]", "broken.onnx", "not a valid ONNX protobuf"]),
]


@pytest.mark.parametrize("models, needles", BAD_BINDINGS, ids=[
    "unbound-named-dim", "second-entry", "unbound-unnamed-dim", "dims-typo-zoo", "dims-typo-zoo-grid",
    "wrong-rank", "fixed-dim", "unknown-input", "not-onnx"])
def test_a_model_that_cannot_be_made_static_fails_when_the_config_is_read(tmp_path, run_cli, models, needles):
    """Exit 2, one line naming the config, the models entry's key and the fix in TOML terms (never
    a CLI flag); nothing runs, --out is not created."""
    _dynamic(tmp_path)
    (tmp_path / "broken.onnx").write_bytes(b"not an onnx model")
    config = tmp_path / "sweep.toml"
    config.write_text(f'models = {models}\ndevices = ["t4"]\nstrategies = ["greedy"]\n')
    out = tmp_path / "out"
    code, stdout, err = run_cli("sweep", config, "--workers", "1", "--out", out)
    assert code == 2 and err.count("\n") == 1 and err.startswith("fusesearch: error: "), err
    assert str(config) in err and "internal error" not in err
    assert "--dim" not in err and "--input-shape" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not out.exists() and stdout == ""


def test_a_sweep_whose_every_cell_fails_exits_1_and_says_so(tmp_path, run_cli):
    """Every cell failed: exit 1 (not 0), the summary still printed and the results written, one
    error line with the count and the first cell's error, whose hint names the config's keys."""
    _unloadable(tmp_path)
    config = tmp_path / "sweep.toml"
    config.write_text('models = ["mismatch.onnx"]\ndevices = ["t4", "h200"]\nstrategies = ["greedy"]\n')
    out = tmp_path / "out"
    code, stdout, err = run_cli("sweep", config, "--workers", "1", "--out", out, "--json")
    assert code == 1, err
    assert json.loads(stdout)["failed"] == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith("fusesearch: error: sweep sweep: every cell failed (2)") and "mismatch.onnx" in line
    assert "results.parquet" in line and "internal error" not in err
    assert "input_shapes and dims of models[0]" in line and "--dim" not in line  # the config's keys
    assert (out / "results.parquet").is_file()


def test_good_bindings_run_and_some_failed_cells_still_exit_0(tmp_path, run_cli):
    """The dynamic model with every dim bound passes the check and its cell plans with the bindings
    the check accepted; the other model's cell fails: exit 0, the failure counted, the retry hint."""
    _dynamic(tmp_path)
    _unloadable(tmp_path)
    config = tmp_path / "sweep.toml"
    config.write_text('models = ["mismatch.onnx", { model = "dyn.onnx", input_shapes = { mask = [2, 4] }, '
                      'dims = { batch = 2, seq = 4 } }]\ndevices = ["t4"]\nstrategies = ["none"]\n')
    code, stdout, err = run_cli("sweep", config, "--workers", "1", "--out", tmp_path / "out")
    assert code == 0, err
    assert "1 failed" in stdout and "run the same command again" in stdout
    rows = pd.read_parquet(tmp_path / "out" / "results.parquet").set_index("model")
    assert rows.loc["dyn", "status"] == "ok" and rows.loc["dyn", "shapes"] == "mask=2x4 batch=2 seq=4"
    assert rows.loc["mismatch", "status"] == "error"


@pytest.mark.parametrize("content", [b"PAR1 this is not parquet", b"", b"{}"], ids=["garbage", "empty", "json"])
def test_a_corrupt_results_parquet_names_the_file_and_the_fix(tmp_path, run_cli, content):
    """A damaged results.parquet with no cell files: sweep and report exit 2 with one line naming
    the file and saying to remove it (never "internal error: ArrowInvalid")."""
    config = tmp_path / "sweep.toml"
    config.write_text('models = ["zoo:rnn-control"]\ndevices = ["t4"]\nstrategies = ["none"]\n')
    out = tmp_path / "out"
    out.mkdir()
    results = out / "results.parquet"
    results.write_bytes(content)
    for args in (("sweep", config, "--workers", "1", "--out", out), ("report", out)):
        code, _, err = run_cli(*args)
        assert code == 2 and err.count("\n") == 1, (args, err)
        assert f"{results}: not a readable results file" in err and "remove it" in err
        assert "internal error" not in err
    assert results.read_bytes() == content  # the user's file is left as it was


def test_a_corrupt_results_parquet_beside_its_cell_files_is_rebuilt(tmp_path, run_cli):
    """What the message promises: with the cell files present, the next sweep rebuilds
    results.parquet from them (running nothing) and report reads the cells."""
    config = tmp_path / "sweep.toml"
    config.write_text('models = ["zoo:rnn-control"]\ndevices = ["t4"]\nstrategies = ["none", "greedy"]\n')
    out = tmp_path / "out"
    code, _, err = run_cli("sweep", config, "--workers", "1", "--out", out)
    assert code == 0, err
    (out / "results.parquet").write_bytes(b"PAR1 damaged")
    code, _, err = run_cli("report", out)
    assert code == 0, err
    code, stdout, err = run_cli("sweep", config, "--workers", "1", "--out", out, "--json")
    assert code == 0 and json.loads(stdout)["ran"] == 0, err
    assert len(pd.read_parquet(out / "results.parquet")) == 2


def test_the_load_config_api_raises_bad_input_for_the_same_configs(tmp_path):
    """The check is part of reading the config (load_config), not only of the command."""
    _dynamic(tmp_path)
    config = tmp_path / "sweep.toml"
    config.write_text('models = ["dyn.onnx"]\ndevices = ["t4"]\n')
    with pytest.raises(BadInput, match=r"sweep\.toml: .*dyn\.onnx: input 'x' has unbound"):
        load_config(config)


# -- values the CLI refuses are refused in the config too (one rule each: fusesearch.values) -----

CPUS = "(the CPUs this machine lets fusesearch use)"
BAD_VALUES = [  # (id, TOML lines after models/devices, needles)
    ("seed above CP-SAT's", "[params]\nseed = 4294967296", ["params.seed = 4294967296", "from 0 to 2147483647"]),
    ("time limit nan", "[params]\ntime_limit_s = nan", ["params.time_limit_s = nan", "positive, finite"]),
    ("time limit inf", "[params]\ntime_limit_s = [5, inf]", ["params.time_limit_s = inf", "positive, finite"]),
    ("threads beyond the CPUs", 'backend = "cpu"\nthreads = 100000', ["threads = 100000", CPUS]),
    ("solver workers beyond the CPUs", "solver_workers = 5000", ["solver_workers = 5000", CPUS]),
    ("budget inf", 'backend = "cpu"\nmeasure_budget_s = inf', ["measure_budget_s = inf", "positive, finite"]),
]


@pytest.mark.parametrize("lines, needles", [row[1:] for row in BAD_VALUES], ids=[row[0] for row in BAD_VALUES])
def test_config_values_follow_the_cli_options_rules(tmp_path, run_cli, lines, needles):
    config = tmp_path / "sweep.toml"
    config.write_text(f'models = ["zoo:rnn-control"]\ndevices = ["t4"]\nstrategies = ["cpsat"]\n{lines}\n')
    out = tmp_path / "out"
    code, stdout, err = run_cli("sweep", config, "--workers", "1", "--out", out)
    assert code == 2 and err.count("\n") == 1 and err.startswith("fusesearch: error: "), err
    for needle in [str(config), *needles]:
        assert needle in err, (needle, err)
    assert not out.exists() and stdout == ""


def test_a_scheduler_address_that_is_none_is_bad_input(tmp_path, run_cli):
    config = tmp_path / "sweep.toml"
    config.write_text('models = ["zoo:rnn-control"]\ndevices = ["t4"]\nstrategies = ["none"]\n')
    for address, needle in (("not a url", "missing port"), ("tcp://host:99999", "port"), ("foo://host:1", "scheme")):
        code, _, err = run_cli("sweep", config, "--scheduler", address, "--out", tmp_path / "out")
        assert code == 2 and err.count("\n") == 1, err
        assert f"--scheduler {address}: not a scheduler address" in err and needle in err and "tcp://HOST:8786" in err
    assert not (tmp_path / "out").exists()


# -- a finished sweep's folder: what report and sweep read is never written over ----------------

@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A folder with one finished sweep (two cells), its config beside it."""
    from fusesearch.cli import main

    base = tmp_path_factory.mktemp("finished")
    config = base / "sweep.toml"
    config.write_text('models = ["zoo:rnn-control"]\ndevices = ["t4"]\nstrategies = ["none", "greedy"]\n')
    assert main(["sweep", str(config), "--workers", "1", "--out", str(base / "out")]) == 0
    return config, base / "out"


def _snapshot(folder: Path) -> dict:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("target, what", [("results.parquet", "sweep's results"), ("sweep.json", "sweep manifest"),
                                          ("cells/FIRST", "sweep's cell files")], ids=["results", "manifest", "cell"])
def test_report_never_writes_over_what_it_reads(finished, run_cli, target, what):
    _, out = finished
    first = sorted((out / "cells").glob("*.json"))[0].name
    path = out / target.replace("FIRST", first)
    before = _snapshot(out)
    code, _, err = run_cli("report", out, "-o", path, "--force")
    assert code == 2 and err.count("\n") == 1, err
    assert f"-o {path}: is a file this command reads (the {what})" in err
    assert _snapshot(out) == before


def test_a_sweep_never_writes_over_its_own_config(finished, run_cli, tmp_path):
    """A config (or a model, a profile) inside --out where the sweep writes: exit 2, kept."""
    config, _ = finished
    out = tmp_path / "out"
    out.mkdir()
    inside = out / "config.toml"
    inside.write_text(config.read_text())
    code, _, err = run_cli("sweep", inside, "--workers", "1", "--out", out, "--force")
    assert code == 2 and err.count("\n") == 1, err
    assert f"--out {inside}: is a file this command reads (the sweep config)" in err
    assert inside.read_text() == config.read_text() and not (out / "sweep.json").exists()


def test_a_corrupt_manifest_is_named_and_force_starts_afresh(finished, run_cli, tmp_path):
    config, done = finished
    out = tmp_path / "out"
    shutil.copytree(done, out)
    manifest = out / "sweep.json"
    manifest.write_text("{not json")
    for args in (("sweep", config, "--workers", "1", "--out", out), ("report", out)):
        code, _, err = run_cli(*args)
        assert code == 2 and err.count("\n") == 1, (args, err)
        assert f"{manifest}: not a readable sweep manifest" in err and "--force" in err and "internal" not in err
    assert manifest.read_text() == "{not json"
    code, stdout, err = run_cli("sweep", config, "--workers", "1", "--out", out, "--force", "--json")
    assert code == 0 and json.loads(stdout)["ran"] == 2, err
    assert json.loads(manifest.read_text())["name"] == "sweep"


def test_a_second_sweep_into_a_folder_in_use_is_refused(tmp_path, run_cli):
    """Two sweeps into one folder at once: the second exits 2 at once naming the folder (it would
    compute every cell again, or discard the first one's); once the first is done it runs, with
    nothing left to compute."""
    config = tmp_path / "sweep.toml"
    config.write_text('models = ["zoo:rnn-control", "zoo:yolo-neck"]\ndevices = ["t4", "h200"]\n'
                      'strategies = ["none", "greedy"]\n')
    out = tmp_path / "out"
    first = subprocess.Popen([sys.executable, "-m", "fusesearch", "sweep", str(config), "--workers", "1",
                              "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "sweep.json").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the manifest is written under the lock
        assert first.poll() is None, first.stderr.read()
        code, _, err = run_cli("sweep", config, "--workers", "1", "--out", out)
        assert code == 2 and err.count("\n") == 1, err
        assert f"--out {out}: is in use by another sweep running now" in err
    finally:
        _, first_err = first.communicate(timeout=600)
    assert first.returncode == 0, first_err
    code, stdout, err = run_cli("sweep", config, "--workers", "1", "--out", out, "--json")
    assert code == 0 and json.loads(stdout)["ran"] == 0 and json.loads(stdout)["skipped"] == 8, err
