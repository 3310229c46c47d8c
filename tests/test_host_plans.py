"""Host plans are reproducible: plan.json records what priced a CPU plan (the OpenMP threads it
was priced for, the machine's measured figures with their sha256 and cache file, a profile's
sha256), `--threads` (default 1) picks the count whatever OMP_NUM_THREADS says, the same flags
give a byte-identical plan, and `run` warns in one line when a plan.json was priced for another
thread count than it runs with, or a CPU profile has other float lanes than this machine."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from importlib import resources

import jsonschema
import numpy as np
import pytest
from onnx import helper

from costmodels import get_device, host_params
from costmodels.devices import host_lanes
from costmodels.profile import Profile, priced_by, save_profile
from fusesearch.backends import cpu
from fusesearch.values import usable_cpus
from tests.conftest import make_model, save

SCHEMA = json.loads(resources.files("fusesearch").joinpath("schemas/plan.schema.json").read_text())
GREEDY = ("--device", "host", "--strategy", "greedy")


def chain(path) -> str:
    """x[batch, 32] -> MatMul+Add -> Relu: one fused kernel, a dynamic batch bound with --dim."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Add", ["h", "b"], ["hb"], name="add"),
             helper.make_node("Relu", ["hb"], ["y"], name="relu")]
    inits = [("w", rng.standard_normal((32, 16)).astype(np.float32)), ("b", rng.standard_normal(16).astype(np.float32))]
    return save(make_model(nodes, [("x", ["batch", 32])], [("y", ["batch", 16])], inits), path / "chain.onnx")


def _plan(run_cli, model, out, *flags) -> dict:
    code, stdout, stderr = run_cli("plan", model, "--dim", "batch=8", *GREEDY, "-o", out, *flags)
    assert code == 0, stderr
    return stdout, json.loads(out.read_text())


def test_the_same_flags_give_a_byte_identical_plan_that_records_what_priced_it(run_cli, tmp_path, monkeypatch):
    model = chain(tmp_path)
    first, doc = _plan(run_cli, model, tmp_path / "a.json")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the environment no longer changes a host plan
    _plan(run_cli, model, tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    jsonschema.validate(doc, SCHEMA)
    device = doc["device"]
    assert device["name"] == "host" and device["profile"] is None and device["threads"] == 1  # the default
    assert "at 1 thread (--threads)" in first.splitlines()[0]
    figures = json.dumps(device["figures"], sort_keys=True).encode()
    assert device["figures_sha256"] == hashlib.sha256(figures).hexdigest()
    assert device["figures"]["dram_bytes_per_s"] > 0 and device["figures"]["fp32_flops_per_s"] > 0
    assert device["figures_file"].endswith("measured.json")


@pytest.mark.skipif(usable_cpus() < 2, reason="needs two usable CPUs")
def test_threads_price_the_plan_and_are_recorded(run_cli, tmp_path):
    model = chain(tmp_path)
    one = _plan(run_cli, model, tmp_path / "1.json", "--threads", "1")[1]["device"]
    stdout, doc = _plan(run_cli, model, tmp_path / "2.json", "--threads", "2")
    two = doc["device"]
    jsonschema.validate(doc, SCHEMA)
    assert (one["threads"], two["threads"]) == (1, 2) and "at 2 threads" in stdout.splitlines()[0]
    assert one["figures"]["fp32_flops_per_s"] != two["figures"]["fp32_flops_per_s"]  # two cores' peak


def test_a_gpu_plan_records_nothing_more_and_a_profile_its_sha256(tmp_path):
    assert priced_by(get_device("h100-sxm"), None) == {}
    profile = tmp_path / "profile.json"
    profile.write_text('{"stand-in": "the bytes are what is hashed"}')
    record = priced_by(get_device("host", 1), profile)
    assert record["profile_sha256"] == hashlib.sha256(profile.read_bytes()).hexdigest()
    assert record["threads"] == 1 and "figures_file" not in record  # the profile's figures, not the cache's


@pytest.mark.skipif(not cpu.available() or usable_cpus() < 2, reason="needs a C compiler and two CPUs")
def test_run_warns_once_when_the_plan_was_priced_for_another_thread_count(run_cli, tmp_path, caplog):
    model = chain(tmp_path)
    _plan(run_cli, model, tmp_path / "p2.json", "--threads", "2")
    fast = ("--dim", "batch=8", "--repeat", "2", "--warmup", "0", "--json")

    def warned(threads: str) -> list[str]:
        caplog.clear()
        code, stdout, stderr = run_cli("run", model, "--plan", tmp_path / "p2.json", "--threads", threads, *fast)
        assert code == 0 and json.loads(stdout)["threads"] == int(threads), stderr
        return [r.getMessage() for r in caplog.records if "priced for" in r.getMessage()]

    lines = warned("1")
    assert len(lines) == 1 and "priced for 2 threads" in lines[0] and "--threads 1" in lines[0], lines
    assert "\n" not in lines[0]
    assert warned("2") == []


@pytest.mark.skipif(not cpu.available(), reason="needs a C compiler")
def test_run_warns_once_when_a_cpu_profile_has_other_lanes_than_this_machine(run_cli, tmp_path, caplog):
    """A host profile calibrated on a CPU with twice this machine's float lanes (AVX-512 beside AVX2):
    `run` executes its plan here, in that CPU's vectors and blocks, and says so in one line; the
    same profile with this machine's lanes gives no warning."""
    model = chain(tmp_path)
    here = host_lanes()
    fast = ("--dim", "batch=8", "--repeat", "2", "--warmup", "0", "--json")

    def warned(lanes: int) -> list[str]:
        path = save_profile(Profile(dataclasses.replace(get_device("host", 1), warp_size=lanes), host_params()),
                            tmp_path / f"host{lanes}" / "profile.json")
        caplog.clear()
        code, stdout, stderr = run_cli("run", model, "--device", path, *fast)
        assert code == 0 and json.loads(stdout)["max_rel_err"] <= 1e-4, stderr
        return [r.getMessage() for r in caplog.records if "float32 lanes" in r.getMessage()]

    lines = warned(2 * here)
    assert len(lines) == 1 and f"a CPU with {2 * here} float32 lanes, this machine has {here}" in lines[0], lines
    assert "\n" not in lines[0] and "--device host" in lines[0]
    assert warned(here) == []


def test_a_sweeps_cpu_cells_are_priced_for_its_threads(tmp_path):
    """A host cell carries the sweep's threads (its plans are priced for them, so they are part of
    its identity) with or without a backend; a GPU cell none; `sweep --threads` replaces them."""
    import dataclasses

    from fusesearch.sweep import expand, load_config

    path = tmp_path / "s.toml"
    path.write_text('models = ["zoo:rnn-control"]\ndevices = ["host", "t4"]\nstrategies = ["none"]\nthreads = 2\n')
    cfg = load_config(path)
    host, gpu = expand(cfg)
    assert (host.device, host.threads, gpu.device, gpu.threads) == ("host", 2, "t4", None)
    again = expand(dataclasses.replace(cfg, threads=1))[0]
    assert again.threads == 1 and again.cell_id != host.cell_id
    assert cfg.normalized()["threads"] == 2


@pytest.mark.parametrize("command", ["plan", "measure", "run"])
def test_a_bad_thread_count_exits_2_with_one_line_naming_the_option(run_cli, tmp_path, command):
    code, _, stderr = run_cli(command, chain(tmp_path), "--dim", "batch=8", "--device", "host", "--threads", "0")
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("fusesearch: error: ") and "--threads" in lines[0]
