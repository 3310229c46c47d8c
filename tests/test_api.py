"""The Python API beyond `plan`: `fusesearch.measure`, `run`, `compare`, `sweep` — the commands'
defaults, results with `to_pandas()`, and the same figures the commands print."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest
import typer

import fusesearch
from fusesearch import api
from fusesearch.backends import cpu
from fusesearch.cli import app
from fusesearch.errors import BadInput
from tests.conftest import save
from tests.test_dump_trace import chain

needs_cc = pytest.mark.skipif(not cpu.available(), reason="no C compiler")

# keyword -> the command's option (where the names differ)
OPTION = {"time_limit_s": "time_limit", "budget_s": "budget", "tf32": "no_tf32", "plan_file": "plan_json",
          "devices": "device"}


REQUIRED = object()  # a flag the command requires (plan's --device): no default to hold the function to


def _cli_defaults(command: str) -> dict:
    click = typer.main.get_command(app).commands[command]
    return {p.name: REQUIRED if p.required else p.default for p in click.params}


@pytest.mark.parametrize("name", ["plan", "measure", "run", "compare", "sweep"])
def test_each_function_has_its_commands_defaults(name):
    """Every keyword the command also has as an optional flag defaults to the flag's default."""
    cli = _cli_defaults(name)
    compared = 0
    for key, param in inspect.signature(getattr(api, name)).parameters.items():
        option = OPTION.get(key, key)
        if param.default is inspect.Parameter.empty or option not in cli or cli[option] is REQUIRED:
            continue
        want = cli[option]
        got = param.default
        if key == "tf32":  # --no-tf32 off is TF32 on
            want = not want
        if key == "strategies":
            got = ",".join(got)
        if want is None and got == ():  # a repeatable flag left out: none given
            want = ()
        assert got == want, (name, key)
        compared += 1
    assert compared >= {"plan": 8, "measure": 9, "run": 10, "compare": 4, "sweep": 3}[name]


def test_the_package_functions_load_lazily_and_survive_their_modules_import():
    """`import fusesearch` loads no ONNX Runtime, pandas or solver; `fusesearch.run` stays the
    function once the module fusesearch.run is imported."""
    code = ("import sys, fusesearch; heavy = [m for m in ('onnxruntime', 'pandas', 'ortools', 'cupy', 'fusesearch.api') "
            "if m in sys.modules]; import fusesearch.run, fusesearch.measure, fusesearch.sweep; "
            "from fusesearch.run import plan_steps; "
            "print(heavy, [callable(getattr(fusesearch, n)) and not hasattr(getattr(fusesearch, n), '__file__') "
            "for n in ('measure', 'run', 'compare', 'sweep')], type(sys.modules['fusesearch.run']).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("] ")
    assert out[0] == "[" and out[1] == "[True, True, True, True" and out[2].strip() == "module"


@needs_cc
def test_measure_returns_every_kernel_as_the_command_measures_it(tmp_path):
    path = save(chain(), tmp_path / "m.onnx")
    seen = []
    result = fusesearch.measure(path, strategy="greedy", budget_s=0.01, progress=lambda d, t: seen.append((d, t)))
    rows = result.to_pandas()
    total = len(result.plan.groups) + len(result.report.unfused)
    assert len(rows) == len(result.report.plan) + len(result.report.unfused) and set(rows["plan"]) == {"plan", "unfused"}
    assert seen[-1] == (len(seen), total) and result.end_to_end is None
    doc = result.to_dict()
    assert doc == json.loads(json.dumps(doc)) and "end_to_end" not in doc


@needs_cc
def test_run_returns_the_report_and_refuses_a_backend_that_does_not_time(tmp_path):
    path = save(chain(), tmp_path / "m.onnx")
    result = fusesearch.run(path, strategy="greedy", repeat=2, warmup=0, input_values={})
    rows = result.to_pandas()
    assert set(rows["program"]) >= {"plan", "unfused", "ort_enable_all", "ort_disable_all"}
    assert (rows["n"] == 2).all() and result.report.model == "t" and result.plan.strategy == "greedy"
    assert result.to_dict()["max_rel_err"] <= result.report.rtol
    with pytest.raises(BadInput, match="--backend emulate: choose one of"):
        fusesearch.run(path, backend="emulate", device="t4")


def test_compare_gives_the_commands_document(tmp_path, run_cli):
    path = save(chain(), tmp_path / "m.onnx")
    result = fusesearch.compare(path, devices=["t4", "h100-sxm"], strategies=["none", "greedy"])
    rows = result.to_pandas()
    assert list(zip(rows["device"], rows["strategy"], strict=True)) == [
        ("t4", "none"), ("t4", "greedy"), ("h100-sxm", "none"), ("h100-sxm", "greedy")]
    code, stdout, err = run_cli("compare", path, "--device", "t4,h100-sxm", "--strategies", "none,greedy", "--json")
    assert code == 0, err
    cli = json.loads(stdout)
    for doc in (cli, result.to_dict()):
        for row in doc["results"]:
            row.pop("wall_s")
    assert cli == json.loads(json.dumps(result.to_dict()))
    with pytest.raises(BadInput, match="--strategy none,nope: unknown nope"):
        fusesearch.compare(path, "t4", strategies="none,nope")


def test_sweep_returns_its_cells(tmp_path):
    config = tmp_path / "s.toml"
    config.write_text('models = ["zoo:rnn-control"]\ndevices = ["t4"]\nstrategies = ["none", "greedy"]\n')
    result = fusesearch.sweep(config, workers=1)
    assert result.to_dict()["cells"] == 2 and result.to_dict()["sweep"] == "s"
    rows = result.to_pandas()
    assert sorted(rows["strategy"]) == ["greedy", "none"] and result.summary.out == tmp_path / "s"
