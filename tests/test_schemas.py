"""The JSON Schemas shipped in fusesearch/schemas: one per command with --json, each holding the
command's real output on a tiny graph."""

from __future__ import annotations

import json
from importlib import resources

import jsonschema
import pytest
import typer

from fusesearch.backends import cpu, emulate
from fusesearch.cli import app
from tests.conftest import save
from tests.test_dump_trace import chain

needs_cc = pytest.mark.skipif(not cpu.available(), reason="no C compiler")
FOLDER = resources.files("fusesearch").joinpath("schemas")


def schema(name: str) -> dict:
    return json.loads(FOLDER.joinpath(f"{name}.schema.json").read_text())


def valid(name: str, doc: dict) -> dict:
    jsonschema.Draft202012Validator(schema(name)).validate(doc)
    return doc


def _json(run_cli, *args) -> dict:
    code, stdout, err = run_cli(*args, "--json")
    assert code == 0, err
    return json.loads(stdout)


def _commands_with_json() -> set[str]:
    """Every command (a sub-app's as 'zoo list') that has a --json flag."""
    found = set()
    for name, command in typer.main.get_command(app).commands.items():
        subs = getattr(command, "commands", None)
        for sub, c in (subs.items() if subs else [("", command)]):
            if any(p.name == "json_out" for p in c.params):
                found.add(f"{name} {sub}".strip())
    return found


def test_every_json_command_has_a_valid_schema_named_for_it():
    names = {p.name.removesuffix(".schema.json") for p in FOLDER.iterdir() if p.name.endswith(".schema.json")}
    assert {c.split()[0] for c in _commands_with_json()} == names
    for name in names:
        s = schema(name)
        jsonschema.Draft202012Validator.check_schema(s)
        assert s["$id"] == f"fusesearch.{name}/1" and s["title"] and s["description"]


@pytest.fixture
def model(tmp_path):
    return save(chain(), tmp_path / "m.onnx")


def test_inspect_plan_and_compare(run_cli, model, tmp_path):
    doc = valid("inspect", _json(run_cli, "inspect", model, "--device", "t4,host", "--canonical", tmp_path / "c.onnx"))
    assert [d["device"] for d in doc["devices"]] == ["t4", "host"] and doc["canonical_path"]
    doc = valid("plan", _json(run_cli, "plan", model, "--device", "t4", "--strategy", "greedy", "--emit",
                              tmp_path / "f.onnx", "-o", tmp_path / "p.json"))
    assert doc["run"]["verified"]["ok"] and doc["run"]["output"] == str(tmp_path / "p.json")
    doc = valid("compare", _json(run_cli, "compare", model, "--device", "t4,host", "--strategies", "none,greedy"))
    assert len(doc["results"]) == 4 and len(doc["differences"]) == 2
    doc = valid("export", _json(run_cli, "export", tmp_path / "p.json", model, "--emit", tmp_path / "g.onnx"))
    assert doc["verified"]["ok"]
    assert valid("verify", _json(run_cli, "verify", model, tmp_path / "g.onnx"))["ok"]
    assert len(valid("devices", _json(run_cli, "devices"))["devices"]) > 1
    assert "bert-base" in {m["name"] for m in valid("zoo", _json(run_cli, "zoo", "list"))["models"]}


@needs_cc
def test_measure_run_and_regret(run_cli, model):
    doc = valid("measure", _json(run_cli, "measure", model, "--strategy", "greedy", "--budget", "0.01",
                                 "--end-to-end"))
    valid("run", doc["end_to_end"])
    assert doc["groups"] and doc["totals"]["measured_s"] > 0
    doc = valid("run", _json(run_cli, "run", model, "--strategy", "greedy", "--repeat", "2", "--warmup", "0"))
    assert doc["plan"]["n"] == 2
    doc = valid("regret", _json(run_cli, "regret", model, "--repeat", "2", "--strategy", "greedy"))
    assert set(doc["plans"]) == {"predicted", "measured"}


@needs_cc
def test_a_run_over_buckets(run_cli, tmp_path):
    from tests.test_buckets import rows_model

    doc = valid("run", _json(run_cli, "run", rows_model(tmp_path), "--dim", "n=8,32", "--repeat", "2", "--warmup",
                             "0"))
    assert [r["n"] for r in doc["runs"]] == [8, 32]
    doc = valid("plan", _json(run_cli, "plan", rows_model(tmp_path), "--device", "host", "--dim", "n=8,32",
                              "--strategy", "greedy"))
    assert doc["buckets"]["values"] == [8, 32]
    code, _, err = run_cli("run", rows_model(tmp_path), "--dim", "n=8,32", "--dump", tmp_path / "d")
    assert code == 2 and "--dump with --dim n over several values" in err


@pytest.mark.skipif(not emulate.available(), reason="no C++ compiler for the CUDA emulator")
def test_an_emulated_run(run_cli, model):
    doc = valid("run", _json(run_cli, "run", model, "--backend", "emulate", "--device", "t4", "--strategy", "greedy"))
    assert doc["backend"] == "emulate"
    with pytest.raises(jsonschema.ValidationError):  # alone, an emulated check holds its own keys only
        valid("run", {**doc, "n": 8})


@pytest.mark.skipif(not emulate.available(), reason="no C++ compiler for the CUDA emulator")
def test_an_emulated_run_over_buckets(run_cli, tmp_path):
    from tests.test_buckets import rows_model

    doc = valid("run", _json(run_cli, "run", rows_model(tmp_path), "--dim", "n=4,8", "--backend", "emulate",
                             "--strategy", "greedy"))
    assert [(r["n"], r["backend"]) for r in doc["runs"]] == [(4, "emulate"), (8, "emulate")]
    doc["runs"][0]["n"] = "4"  # the bucket's value is a positive integer
    with pytest.raises(jsonschema.ValidationError):
        valid("run", doc)


@needs_cc
def test_calibrate(run_cli, model, tmp_path):
    doc = valid("calibrate", _json(run_cli, "calibrate", "--backend", "cpu", "--models", model, "--samples", "4",
                                   "-o", tmp_path / "profile.json"))
    assert doc["fit"]["measured"] >= 1 and doc["profile"] == str(tmp_path / "profile.json")


def test_sweep(run_cli, tmp_path):
    config = tmp_path / "s.toml"
    config.write_text('models = ["zoo:rnn-control"]\ndevices = ["t4"]\nstrategies = ["none"]\n')
    assert valid("sweep", _json(run_cli, "sweep", config, "--workers", "1"))["cells"] == 1


@pytest.mark.parametrize("name, doc, change", [
    ("run", "timed", lambda d: d.pop("plan")),
    ("run", "timed", lambda d: d["plan"].update(n=0)),
    ("measure", "measure", lambda d: d["groups"][0].pop("median_s")),
    ("compare", "compare", lambda d: d["results"][0].update(strategy="fastest")),
])
def test_the_schemas_refuse_a_broken_document(name, doc, change):
    """A schema that accepted anything would hold nothing: a document with a key missing or a
    value out of range fails."""
    timing = {"median_s": 1e-3, "p20_s": 1e-3, "p80_s": 2e-3, "n": 3}
    docs = {
        "timed": {"model": "m", "strategy": "greedy", **{k: dict(timing) for k in
                                                           ("plan", "unfused", "ort_enable_all", "ort_enable_extended",
                                                            "ort_disable_all")},
                  "threads": 1, "repeat": 3, "warmup": 0, "arena_peak_bytes": 0, "activation_bytes": 0,
                  "max_rel_err": 0.0, "unfused_max_rel_err": 0.0, "rtol": 1e-4, "segments": {"generated": 1,
                                                                                             "library": 0},
                  "kernels": 1, "library_steps": 0, "backend": "cpu",
                  "ratios": {"plan_vs_ort_enable_all": 1.0, "plan_vs_ort_enable_extended": 1.0,
                             "plan_vs_ort_disable_all": 1.0, "plan_vs_unfused": 1.0}},
        "measure": {"backend": "cpu", "device": "host", "baseline": "library", "totals": {
                        "predicted_s": 0.0, "measured_s": 0.0, "unfused_predicted_s": 0.0, "unfused_measured_s": 0.0,
                        "speedup": None, "not_measured": 0, "anchor_groups": 0, "anchor_groups_compared": 0,
                        "fused_loses": 0, "lone_anchors_compared": 0, "lone_ours_loses": 0},
                    "groups": [{"id": 0, "template": "rowwise", "how": "generated", "predicted_s": 1e-6,
                                "median_s": 1e-6, "p20_s": 1e-6, "p80_s": 1e-6, "n": 3, "max_rel_err": 0.0,
                                "library_baseline_s": None, "fused_loses": None}]},
        "compare": {"model": "m", "canonical_nodes": 1, "differences": [], "results": [{
            "device": "t4", "strategy": "none", "kernels": 1, "time_s": 1e-6, "unfused_time_s": 1e-6,
            "lower_bound_s": 1e-6, "speedup": 1.0, "status": "BASELINE", "wall_s": 0.0}]},
    }
    document = docs[doc]
    valid(name, document)
    change(document)
    with pytest.raises(jsonschema.ValidationError):
        valid(name, document)
