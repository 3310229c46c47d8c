"""The command line contract: `inspect` (text, --json, --canonical), `zoo list|export`; bad command
lines (outputs over inputs, counts beyond the CPUs, unreadable profiles, unwritable outputs) exit 2
with one line; `export --json`; Ctrl-C exits 130."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import onnx
import pytest

from fusesearch.verify import compare, random_feeds, run


def test_inspect_json_keys_and_resnet50_counts(run_cli):
    code, out, err = run_cli("inspect", "zoo:resnet50", "--json")
    assert code == 0, err
    doc = json.loads(out)
    for key in ("model", "nodes", "canonical_nodes", "ops", "kinds", "flops", "weight_bytes",
                "activation_bytes", "inputs", "outputs", "passes"):
        assert key in doc
    assert doc["nodes"] == 175 and doc["canonical_nodes"] == 122
    assert doc["passes"]["batchnorm_folding"] == 53
    assert "BatchNormalization" not in doc["ops"] and doc["ops"]["Conv"] == 53
    assert doc["inputs"][0]["shape"] == [1, 3, 224, 224]
    assert 7.5e9 < doc["flops"] < 8.5e9  # ResNet-50 is ~4.1 GMACs at 224x224


def _table_rows(text: str, title: str) -> list[list[str]]:
    """The body rows of the rich table printed under `title` (cells stripped)."""
    lines = text.splitlines()
    rows = []
    for line in lines[lines.index(title) + 1:]:
        if line.startswith("└"):
            break
        if line.startswith("│"):
            rows.append([cell.strip() for cell in line.strip("│").split("│")])
    return rows


def test_inspect_text_output_states_what_the_json_holds(run_cli):
    code, out, err = run_cli("inspect", "zoo:resnet18", "--json")
    assert code == 0, err
    doc = json.loads(out)
    code, text, err = run_cli("inspect", "zoo:resnet18")
    assert code == 0, err
    lines = text.splitlines()
    assert lines[0] == f"resnet18  (zoo:resnet18, opset {doc['opset']} → {doc['canonical_opset']})"
    assert lines[1].startswith("nodes 69 → 49 after canonicalization   FLOPs 3.64 G   weights 44.6 MiB   "
                               "activations 21.9 MiB")
    assert (doc["nodes"], doc["canonical_nodes"], doc["flops"]) == (69, 49, 3635523560)
    assert _table_rows(text, "inputs / outputs") == [["input", "input", "1x3x224x224", "float32"],
                                                     ["output", "logits", "1x1000", "float32"]]
    ops = {op: int(count) for op, count in _table_rows(text, "ops (canonical)")}
    assert ops == doc["ops"] == {"Conv": 20, "Relu": 17, "Sum": 8, "Flatten": 1, "Gemm": 1, "GlobalAveragePool": 1,
                                 "MaxPool": 1}
    assert sum(ops.values()) == doc["canonical_nodes"]
    assert "kinds: " + ", ".join(f"{k} {v}" for k, v in doc["kinds"].items()) in lines
    assert "passes: " + ", ".join(f"{k} {v}" for k, v in doc["passes"].items()) in lines
    assert doc["passes"]["batchnorm_folding"] == 20  # one BatchNormalization after each Conv, folded into it


def test_inspect_canonical_runs_in_ort_and_refuses_overwrite(run_cli, tmp_path):
    path = tmp_path / "canon.onnx"
    code, out, err = run_cli("inspect", "zoo:mobilenetv2", "--canonical", path, "--json")
    assert code == 0, err
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    assert len(model.graph.node) == json.loads(out)["canonical_nodes"]
    feeds = random_feeds(model, seed=0)
    assert run(str(path), feeds)
    code, _, err = run_cli("inspect", "zoo:mobilenetv2", "--canonical", path)
    assert code == 2 and "exists" in err
    code, _, err = run_cli("inspect", "zoo:mobilenetv2", "--canonical", path, "--force")
    assert code == 0


def test_devices_lists_the_table_and_the_host_figures_measured_once(run_cli):
    """`devices`: every GPU of the table and the host, whose measured figures (FP32 peak, DRAM,
    cache curve) are stated below the table and carried in full by --json."""
    from costmodels import DEVICES, host_cpu

    code, out, _ = run_cli("devices")
    assert code == 0
    assert all(name in out for name in DEVICES)
    host = host_cpu()
    line = next(x for x in out.splitlines() if x.startswith("host, measured once"))
    assert f"FP32 {host.fp32_flops_per_s / 1e9:.1f} GFLOP/s" in line
    assert f"DRAM {host.dram_bytes_per_s / 1e9:.1f} GB/s" in line
    assert ("no cache faster than DRAM" in line) == (host.cache_curve == ())
    assert all(f"{rate / 1e9:.1f} GB/s at {size / 2**20:g} MiB" in line for size, rate in host.cache_curve)
    code, out, _ = run_cli("devices", "--json")
    listed = {d["name"]: d for d in json.loads(out)["devices"]}
    assert [tuple(point) for point in listed["host"]["cache_curve"]] == list(host.cache_curve)
    assert listed["h100-sxm"]["cache_curve"] == []  # GPU timings flush L2: every byte at DRAM's rate


def test_zoo_list_and_export_round_trip(run_cli, tmp_path):
    code, out, _ = run_cli("zoo", "list", "--json")
    names = [m["name"] for m in json.loads(out)["models"]]
    assert {"resnet18", "resnet50", "mobilenetv2", "bert-base", "gpt2", "unet"} <= set(names)
    path = tmp_path / "bert.onnx"
    code, _, err = run_cli("zoo", "export", "bert-small", "-o", path)
    assert code == 0, err
    model = onnx.load(str(path))
    assert err.startswith(f"wrote {path} ({len(model.graph.node)} nodes, ") and err.count("\n") == 1  # one line
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "seq"]
    code, _, err = run_cli("inspect", path)
    assert code == 2 and "--dim" in err  # exported models keep their dynamic dims
    code, out, err = run_cli("inspect", path, "--dim", "batch=2", "--dim", "seq=16", "--json")
    assert code == 0, err
    assert json.loads(out)["inputs"][0]["shape"] == [2, 16]
    code, _, err = run_cli("zoo", "export", "bert-small", "-o", path)
    assert code == 2 and "exists" in err


def test_json_stdout_is_one_document_and_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "fusesearch", "inspect", "zoo:resnet18", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["model"]
    bad = subprocess.run([sys.executable, "-m", "fusesearch", "inspect", "missing.onnx"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1


def test_canonicalization_keeps_results_for_a_model_file(tmp_path):
    """The end-to-end path on a file: export, inspect --canonical, ORT on both."""
    from fusesearch import zoo

    src = tmp_path / "r18.onnx"
    src.write_bytes(zoo.build_model("resnet18").SerializeToString())
    out = tmp_path / "r18c.onnx"
    proc = subprocess.run([sys.executable, "-m", "fusesearch", "inspect", str(src), "--dim", "batch=2",
                           "--canonical", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    canonical = onnx.load(str(out))
    feeds = random_feeds(canonical, seed=5)
    assert all(d.ok for d in compare(run(str(src), feeds), run(str(out), feeds)))


# -- bad input on the command line: exit 2, one line, nothing the user had is touched -------------

def _relu(tmp_path) -> str:
    from onnx import helper

    from tests.conftest import make_model, save

    return save(make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [("x", [2, 3])], [("y", [2, 3])]),
                tmp_path / "m.onnx")


def _profile(tmp_path, name="t4.json", edit=None) -> str:
    """A device profile of the t4 (as `calibrate` writes one), `edit` applied to its JSON."""
    from costmodels import DEVICES
    from costmodels.profile import Profile, save_profile

    path = save_profile(Profile(DEVICES["t4"]), tmp_path / name)
    if edit is not None:
        doc = json.loads(path.read_text())
        edit(doc)
        path.write_text(json.dumps(doc))
    return str(path)


def _plan_file(tmp_path) -> str:
    from fusesearch.cli import main

    path = tmp_path / "plan.json"
    assert main(["plan", _relu(tmp_path), "--device", "t4", "--strategy", "none", "-o", str(path)]) == 0
    return str(path)


def _pipe(tmp_path) -> str:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return str(path)


def _binary(tmp_path) -> str:
    path = tmp_path / "profile.json"
    path.write_bytes(bytes(range(256)) * 4)
    return str(path)


def _drop_params(doc):
    del doc["params"]


def _arch(doc):
    doc["device"]["arch"] = "sm_1000"


READS = "is a file this command reads"
CPUS = "(the CPUs this machine lets fusesearch use)"
# (id, args from tmp_path, needles of the one stderr line)
CLI_BAD = [
    ("plan -o over its device profile", lambda t: ("plan", _relu(t), "--device", (p := _profile(t)), "-o", p, "--force"),
     ["-o", "t4.json", READS, "(the device profile)"]),
    ("inspect --canonical over a profile of its list",
     lambda t: ("inspect", _relu(t), "--device", f"h100-sxm,{(p := _profile(t))}", "--canonical", p, "--force"),
     ["--canonical", READS, "(the device profile)"]),
    ("run -o over its device profile",
     lambda t: ("run", _relu(t), "--device", (p := _profile(t)), "-o", p, "--force"), [READS, "(the device profile)"]),
    ("calibrate -o over its model", lambda t: ("calibrate", "--backend", "cpu", "--models", (m := _relu(t)), "-o", m,
                                               "--force"), ["-o", "m.onnx", READS, "(the model)"]),
    ("calibrate -o over its device profile",
     lambda t: ("calibrate", "--backend", "cpu", "--device", (p := _profile(t)), "-o", p, "--force"),
     ["-o", READS, "(the device profile)"]),
    ("calibrate --models names none", lambda t: ("calibrate", "--backend", "cpu", "--models", ",", "-o", t / "p.json"),
     ["--models ','", "names no model"]),
    ("run --threads beyond the CPUs", lambda t: ("run", _relu(t), "--threads", "100000"), ["--threads 100000", CPUS]),
    ("plan --workers beyond the CPUs", lambda t: ("plan", _relu(t), "--device", "t4", "--workers", "5000"),
     ["--workers 5000", CPUS]),
    ("sweep --workers beyond the CPUs", lambda t: ("sweep", t / "none.toml", "--workers", "100000"),
     ["--workers 100000", CPUS]),
    ("device profile of binary data", lambda t: ("plan", _relu(t), "--device", _binary(t)),
     ["--device", "profile.json", "not a text file"]),
    ("device profile without params", lambda t: ("plan", _relu(t), "--device", _profile(t, edit=_drop_params)),
     ["t4.json", "missing 'params'"]),
    ("device profile of arch sm_1000", lambda t: ("plan", _relu(t), "--device", _profile(t, edit=_arch)),
     ["t4.json", "arch 'sm_1000'", "sm_90"]),
    ("measure --plan a folder", lambda t: ("measure", _relu(t), "--plan", t), ["--plan", "is a folder", "plan.json"]),
    ("run --plan a folder", lambda t: ("run", _relu(t), "--plan", t), ["--plan", "is a folder", "plan.json"]),
    ("export of a folder", lambda t: ("export", t, _relu(t), "--emit", t / "f.onnx"), ["is a folder", "plan.json"]),
    ("-o in /proc", lambda t: ("plan", _relu(t), "--device", "t4", "-o", "/proc/x.json"),
     ["-o /proc/x.json: cannot write it"]),
    ("--emit in /proc", lambda t: ("export", _plan_file(t), _relu(t), "--emit", "/proc/x.onnx"),
     ["--emit /proc/x.onnx: cannot write it"]),
    ("zoo export in /proc", lambda t: ("zoo", "export", "resnet18", "-o", "/proc/x.onnx"),
     ["-o /proc/x.onnx: cannot write it"]),
    ("--svg onto /dev/full", lambda t: ("plan", _relu(t), "--device", "t4", "--svg", "/dev/full", "--force"),
     ["--svg /dev/full", "not a plain file"]),
    ("--emit onto a pipe", lambda t: ("plan", _relu(t), "--device", "t4", "--emit", _pipe(t), "--force"),
     ["--emit", "pipe", "not a plain file"]),
]


@pytest.mark.parametrize("build, needles", [row[1:] for row in CLI_BAD], ids=[row[0] for row in CLI_BAD])
def test_bad_command_lines_exit_2_with_one_line_and_touch_nothing(run_cli, tmp_path, build, needles):
    args = build(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    code, out, err = run_cli(*args)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("fusesearch: error: ") and "internal error" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert ".tmp" not in err and "/." not in err  # the user's path, never a staged name
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_a_cache_variable_naming_a_file_is_bad_input(run_cli, tmp_path, monkeypatch):
    """$FUSESEARCH_CACHE on a file (or under one): exit 2 naming the variable, in a command that
    compiles kernels and in one that reads the host's figures."""
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    for value in (blocker, blocker / "sub"):
        monkeypatch.setenv("FUSESEARCH_CACHE", str(value))
        for args in (("run", _relu(tmp_path), "--strategy", "none"), ("devices",)):
            code, _, err = run_cli(*args)
            assert code == 2 and len(err.strip().splitlines()) == 1, err
            assert f"FUSESEARCH_CACHE={value}: {blocker} is a file, not a folder" in err and "--device" not in err
    assert blocker.read_text() == "not a folder"


def test_export_json_is_one_document(run_cli, tmp_path, capsys):
    plan = _plan_file(tmp_path)
    capsys.readouterr()
    code, out, err = run_cli("export", plan, tmp_path / "m.onnx", "--emit", tmp_path / "f.onnx", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["emit"] == str(tmp_path / "f.onnx") and doc["nodes"] == 1 and doc["verified"]["ok"] is True


def _interrupt(args: list[str], ready: str, tmp_path) -> subprocess.CompletedProcess:
    """Run `python -m fusesearch ARGS`, send SIGINT once READY (a path) exists, i.e. once the
    command is working, and return how it ended."""
    env = {**os.environ, "FUSESEARCH_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "fusesearch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    deadline = time.monotonic() + 240
    while not any(tmp_path.glob(ready)) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@pytest.mark.parametrize("command", ["run", "measure"])
def test_ctrl_c_exits_130_with_one_line(tmp_path, command):
    """SIGINT while the command compiles its kernels (a compiler child running, its cache
    folder just made): exit 130 and one stderr line, never a death by signal (-2)."""
    done = _interrupt([command, "zoo:resnet18", "--strategy", "greedy"], "cache/cpu", tmp_path)
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert done.stderr.strip() == "fusesearch: interrupted"



def test_version_prints_the_package_version(run_cli):
    import fusesearch

    assert run_cli("--version") == (0, f"fusesearch {fusesearch.__version__}\n", "")


@pytest.mark.parametrize("args", [["zoo", "list"], ["zoo", "list", "--json"]])
def test_a_reader_that_closes_stdout_ends_the_command_with_141_and_no_words(args):
    """`fusesearch ... | head -1`: the reader gone, the command stops as a shell command killed by
    SIGPIPE does (exit 141, nothing on stderr), not as an internal error (1); text and JSON alike."""
    proc = subprocess.Popen([sys.executable, "-m", "fusesearch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the command writes anything: its first write finds no reader
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141, err
    assert err == ""


def test_plan_says_each_slow_step_on_a_terminal_only(run_cli, tmp_path, monkeypatch):
    """Loading, planning and writing a verified --emit each show a passing line on a terminal's
    stderr; a pipe (here: captured) sees nothing."""
    import io

    from rich.console import Console

    from fusesearch import cli

    args = ["plan", "zoo:resnet18", "--device", "t4", "--strategy", "greedy", "--emit"]
    code, _, err = run_cli(*args, tmp_path / "a.onnx")
    assert code == 0 and err == "", err
    terminal = io.StringIO()
    monkeypatch.setattr(cli, "err", Console(file=terminal, force_terminal=True, width=200))
    code, _, err = run_cli(*args, tmp_path / "b.onnx")
    assert code == 0, err
    shown = terminal.getvalue()
    for step in ("loading zoo:resnet18", "planning 49 nodes for t4 (greedy)",
                 f"writing {tmp_path / 'b.onnx'}, verified in ONNX Runtime first"):
        assert step in shown, shown
