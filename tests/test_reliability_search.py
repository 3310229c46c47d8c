"""Options, plan files and the search behave the same everywhere, on every run.

- Every numeric option is checked by one validator per kind of value (positive finite seconds,
  a finite tolerance >= 0, a positive count, a seed), in every command that has it: one table of
  command × option × bad value, each exit 2 with one line naming the option.
- A plan.json group that cannot be one kernel (two MatMuls) is refused by `export` and by
  `measure --plan` alike: exit 2 naming the file, the group and the reason.
- The CP-SAT deterministic re-solve never comes back INFEASIBLE on small problems, and plan.json
  is byte-identical across runs, on `host` (its measured bandwidth is cached per machine) and on a
  GPU, for a tiny model and a zoo BERT.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from costmodels import host_cpu, load_device
from costmodels.devices import CPU_LAUNCH_OVERHEAD_S, host_cache_path
from costmodels.probes import measure_copy_bandwidth
from fusesearch.values import usable_cpus
from tests.conftest import make_model, save

# -- option validators ------------------------------------------------------------------------

SECONDS = ("a positive, finite number of seconds", ["0", "-1", "nan", "inf", "-inf"])
TOLERANCE = ("a finite number >= 0", ["-1", "nan", "inf"])
COUNT = ("a positive whole number", ["0", "-1"])
SEED = ("a whole number from 0 to 2147483647", ["-1", "2147483648"])
CPUS = (f"a whole number from 1 to {usable_cpus()} (the CPUs this machine lets fusesearch use)",
        ["0", "-1", str(usable_cpus() + 1)])
SAMPLES = ("at least 4 (a few hundred for a useful fit)", ["3", "0"])

# command (its required arguments; {m} a model, {o} an output path) -> option -> kind
COMMANDS = {
    "plan": (["plan", "{m}", "--device", "h100-sxm"],
             {"--time-limit": SECONDS, "--max-group-size": COUNT, "--workers": CPUS, "--seed": SEED}),
    "compare": (["compare", "{m}", "--device", "h100-sxm,t4"],
                {"--time-limit": SECONDS, "--max-group-size": COUNT, "--workers": CPUS, "--seed": SEED}),
    "measure": (["measure", "{m}"], {"--time-limit": SECONDS, "--budget": SECONDS, "--seed": SEED}),
    "verify": (["verify", "{m}", "{m}"], {"--rtol": TOLERANCE, "--atol": TOLERANCE, "--seed": SEED}),
    "calibrate": (["calibrate", "--backend", "cpu", "-o", "{o}"],
                  {"--budget": SECONDS, "--rounds": COUNT, "--samples": SAMPLES, "--seed": SEED}),
    "sweep": (["sweep", "{o}"], {"--workers": CPUS}),
}
BAD_OPTIONS = [(cmd, option, value, kind[0]) for cmd, (_, options) in COMMANDS.items()
               for option, kind in options.items() for value in kind[1]]


@pytest.fixture
def two_node(tmp_path):
    """x → Relu → Neg → y, 2x8 float."""
    model = make_model([helper.make_node("Relu", ["x"], ["a"], name="relu"),
                        helper.make_node("Neg", ["a"], ["y"], name="neg")], [("x", [2, 8])], [("y", [2, 8])])
    return save(model, tmp_path / "two.onnx")


@pytest.mark.parametrize(("command", "option", "value", "expected"), BAD_OPTIONS,
                         ids=[f"{c}{o}={v}" for c, o, v, _ in BAD_OPTIONS])
def test_every_command_refuses_a_bad_option_value_the_same_way(run_cli, two_node, tmp_path, command, option,
                                                              value, expected):
    """Bad input: the same option and value give the same one-line message in every command."""
    out = tmp_path / "out.json"
    args = [a.format(m=two_node, o=out) for a in COMMANDS[command][0]]
    code, stdout, err = run_cli(*args, option, value)
    assert code == 2, (stdout, err)
    assert err == f"fusesearch: error: {option} {value}: give {expected}\n"
    assert not out.exists()


@pytest.mark.parametrize("args", [
    ["plan", "{m}", "--device", "h100-sxm", "--time-limit", "0.5", "--workers", "1", "--seed", "2147483647"],
    ["verify", "{m}", "{c}", "--rtol", "0", "--atol", "0"],
])
def test_good_option_values_still_run(run_cli, two_node, tmp_path, args):
    copy = tmp_path / "copy.onnx"  # verify refuses ORIGINAL itself as FUSED
    copy.write_bytes(Path(two_node).read_bytes())
    code, _, err = run_cli(*[a.format(m=two_node, c=copy) for a in args])
    assert code == 0, err


# -- plan files: one legality check for export and measure ------------------------------------

def _two_matmuls(tmp_path):
    weights = [("w1", np.full((8, 8), 0.1, np.float32)), ("w2", np.full((8, 8), 0.2, np.float32))]
    model = make_model([helper.make_node("MatMul", ["x", "w1"], ["a"], name="mm1"),
                        helper.make_node("MatMul", ["a", "w2"], ["y"], name="mm2")],
                       [("x", [4, 8])], [("y", [4, 8])], initializers=weights)
    return save(model, tmp_path / "mm.onnx")


def _plan_doc(groups: list[list[str]]) -> dict:
    """A hand-written fusesearch.plan/1 document; each group's figures are placeholders."""
    return {
        "schema": "fusesearch.plan/1",
        "model": {"name": "t", "sha256": "", "nodes": 2, "canonical_nodes": 2},
        "device": {"name": "host", "profile": None},
        "strategy": "cpsat",
        "solver": {"status": "OPTIMAL", "objective_s": 1e-6, "bound_s": None},
        "groups": [{"id": i, "nodes": nodes, "ops": ["MatMul"] * len(nodes), "template": "gemm", "time_s": 1e-6,
                    "flops": 1024, "dram_bytes": 1024, "smem_bytes": 0, "regs_per_thread": 0, "occupancy": 1.0,
                    "bound": "launch"} for i, nodes in enumerate(groups)],
        "totals": {"kernels": len(groups), "time_s": 1e-6, "unfused_time_s": 1e-6, "lower_bound_s": 1e-6,
                   "dram_bytes": 2048, "flops": 2048},
    }


@pytest.mark.parametrize("command", ["export", "measure"])
def test_a_plan_group_with_two_anchors_is_refused_by_export_and_measure(run_cli, tmp_path, command):
    """Bad input: two MatMuls in one group cannot be one kernel; both commands say so the same way."""
    model = _two_matmuls(tmp_path)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(_plan_doc([["mm1", "mm2"]])))
    emit = tmp_path / "fused.onnx"
    args = {"export": ["export", plan, model, "--emit", emit], "measure": ["measure", model, "--plan", plan]}
    code, stdout, err = run_cli(*args[command])
    assert code == 2, (stdout, err)
    assert err == (f"fusesearch: error: {plan}: group g0 (mm1, mm2) cannot be one kernel: two anchors: "
                   "mm1(MatMul) and mm2(MatMul); split it, or write the plan again with `fusesearch plan -o`\n")
    assert not emit.exists()


def test_the_same_plan_split_in_two_is_exported(run_cli, tmp_path):
    model = _two_matmuls(tmp_path)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(_plan_doc([["mm1"], ["mm2"]])))
    code, stdout, err = run_cli("export", plan, model, "--emit", tmp_path / "fused.onnx")
    assert code == 0, err
    assert "outputs equal" in stdout


# -- the deterministic re-solve ---------------------------------------------------------------

CHAINS = {  # 2- and 3-node graphs: (op, extra input or None) per node, each reading the previous
    "relu-neg": [("Relu", None), ("Neg", None)],
    "add-mul": [("Add", "x"), ("Mul", "x")],
    "matmul-relu": [("MatMul", "w"), ("Relu", None)],
    "relu-neg-abs": [("Relu", None), ("Neg", None), ("Abs", None)],
    "matmul-add-relu": [("MatMul", "w"), ("Add", "x"), ("Relu", None)],
}


def _chain(tmp_path, name: str, n: int):
    nodes, prev = [], "x"
    for i, (op, extra) in enumerate(CHAINS[name]):
        out = "y" if i == len(CHAINS[name]) - 1 else f"t{i}"
        nodes.append(helper.make_node(op, [prev] + ([extra] if extra else []), [out], name=f"{op.lower()}{i}"))
        prev = out
    model = make_model(nodes, [("x", [n, n])], [("y", [n, n])], initializers=[("w", np.eye(n, dtype=np.float32))])
    return save(model, tmp_path / f"{name}-{n}.onnx")


@pytest.mark.parametrize("name", list(CHAINS))
def test_the_deterministic_resolve_is_never_infeasible(run_cli, tmp_path, caplog, monkeypatch, name):
    """Determinism: on 2- and 3-node problems the one-worker re-solve under the first solve's optimum
    finds a plan every time. It used to bound the objective by CP-SAT's float objective truncated
    to an integer (2179528.9999999995 -> 2179528 ps, one below the optimum): INFEASIBLE on about
    a third of these instances (the GPU devices' figures are fixed, so which ones is too). One
    worker would prove these first: turned off, so the many-worker path and its re-solve run."""
    from fusesearch.search import cpsat

    monkeypatch.setattr(cpsat, "ONE_WORKER_FIRST", 0.0)
    for n in (8, 64, 256):
        model = _chain(tmp_path, name, n)
        for device in ("h100-sxm", "t4", "host"):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="fusesearch.search.cpsat"):
                code, stdout, err = run_cli("plan", model, "--device", device, "--json", "--workers", "2")
            assert code == 0, err
            doc = json.loads(stdout)
            stats = doc["run"]["stats"]
            assert doc["solver"]["status"] == "OPTIMAL"
            assert stats["resolve_status"] == "OPTIMAL", (name, n, device, stats)
            assert not [r for r in caplog.records if "re-solve" in r.getMessage()]


def test_several_workers_keep_the_one_worker_plan_where_one_worker_proves_it(run_cli, tmp_path):
    """With several workers one worker tries first: where it proves the optimum, plan.json is the
    one `--workers 1` writes, and the run says so; no re-solve is needed."""
    model = _chain(tmp_path, next(iter(CHAINS)), 64)
    docs = []
    for workers in ("1", "2"):
        code, stdout, err = run_cli("plan", model, "--device", "h100-sxm", "--json", "--workers", workers)
        assert code == 0, err
        doc = json.loads(stdout)
        docs.append(doc)
    assert docs[1]["run"]["stats"]["resolve_status"] == "one worker proved it first"
    assert docs[0]["run"]["stats"]["resolve_status"] is None
    assert docs[0]["groups"] == docs[1]["groups"] and docs[0]["totals"] == docs[1]["totals"]


def test_cpsat_solves_costs_past_int64_picoseconds(run_cli, tmp_path, caplog):
    """A MatMul of 2^20 x 2^24 by 2^24 x 2^20 costs about 6e18 ps on a T4; its candidates' costs sum
    past int64. CP-SAT called that model invalid and the greedy plan came back as after a time-out;
    the costs now take a coarser unit and CP-SAT proves the optimum."""
    nodes = [helper.make_node("MatMul", ["a", "b"], ["c"], name="mm"), helper.make_node("Relu", ["c"], ["y"], name="relu")]
    model = save(make_model(nodes, [("a", ["m", "k"]), ("b", ["k", "n"])], [("y", None)]), tmp_path / "mm.onnx")
    with caplog.at_level(logging.WARNING, logger="fusesearch.search.cpsat"):
        code, stdout, err = run_cli("plan", model, "--device", "t4", "--dim", "m=1048576", "--dim", "k=16777216",
                                    "--dim", "n=1048576", "--json")
    assert code == 0, err
    doc = json.loads(stdout)
    stats = doc["run"]["stats"]
    assert doc["solver"]["status"] == stats["solver_status"] == "OPTIMAL" and "fallback" not in stats, stats
    assert stats["objective_ps"] > 2**53 and not caplog.records  # beyond 1 ps resolution
    assert [g["ops"] for g in doc["groups"]] == [["MatMul", "Relu"]]


# -- byte-identical plan.json, host included --------------------------------------------------

@pytest.fixture
def fresh_host(tmp_path, monkeypatch):
    """Each run describes the host anew, as a new process would; the cache folder is the test's."""
    monkeypatch.setenv("FUSESEARCH_CACHE", str(tmp_path / "cache"))

    def forget():
        host_cpu.cache_clear()
        measure_copy_bandwidth.cache_clear()

    forget()
    yield forget
    forget()


@pytest.mark.parametrize("device", ["host", "h100-sxm"])
@pytest.mark.parametrize("model", ["tiny", "zoo:bert-small"])
def test_plan_json_is_byte_identical_across_runs(run_cli, tmp_path, fresh_host, device, model):
    source = _chain(tmp_path, "matmul-add-relu", 64) if model == "tiny" else model
    dims = ["--dim", "seq=16"] if model.startswith("zoo:") else []
    texts = []
    for i in range(5):
        fresh_host()
        out = tmp_path / f"plan{i}.json"
        code, _, err = run_cli("plan", source, "--device", device, *dims, "-o", out)
        assert code == 0, err
        texts.append(out.read_bytes())
    assert all(t == texts[0] for t in texts[1:])
    assert json.loads(texts[0])["solver"]["status"] == "OPTIMAL"


def _entry_key(entries, threads):
    """The cache key of the entry measured with `threads` OpenMP threads (keys read 'model; N threads; ...')."""
    [key] = [k for k in entries if f"; {threads} threads;" in k]
    return key


def test_host_figures_are_measured_once_and_read_back(fresh_host):
    """The cache file holds one entry per machine and thread count; host_cpu() reads it instead of
    measuring. Above one thread the one-thread entry is there too: the serial launch reads it."""
    first = host_cpu()
    path = host_cache_path()
    entries = json.loads(path.read_text())
    key = _entry_key(entries, first.sm_count)
    figures = entries[key]
    if first.sm_count > 1:
        assert len(entries) == 2
        serial = entries[_entry_key(entries, 1)]["launch_s"]
        assert first.serial_launch_overhead_s == (serial if serial > 0 else CPU_LAUNCH_OVERHEAD_S)
    else:
        assert len(entries) == 1 and first.serial_launch_overhead_s == 0.0
    assert figures["dram_bytes_per_s"] == first.dram_bytes_per_s
    assert [tuple(point) for point in figures["cache_curve"]] == list(first.cache_curve)
    assert f"{first.sm_count} threads" in key
    # what an earlier run on this machine would have left
    # the measured launch, or 0 kept (a machine too busy to say) and the estimate used
    assert figures["launch_s"] == first.launch_overhead_s > 0 or (
        figures["launch_s"] == 0.0 and first.launch_overhead_s == CPU_LAUNCH_OVERHEAD_S)
    kept = {"dram_bytes_per_s": 12.5e9, "cache_curve": [[2 << 20, 70e9], [4 << 20, 50e9]],
            "fma_flops_per_s_per_thread": 1e11, "launch_s": 2.5e-7}
    path.write_text(json.dumps({key: kept}))
    fresh_host()
    host = host_cpu()
    assert (host.dram_bytes_per_s, host.cache_curve) == (12.5e9, ((2 << 20, 70e9), (4 << 20, 50e9)))
    assert (host.fp32_flops_per_s / 1e11).is_integer()  # physical cores x the kept FMA rate
    assert host.launch_overhead_s == 2.5e-7
    # a launch probe that could not run (0) leaves the estimate
    path.write_text(json.dumps({key: {**kept, "launch_s": 0.0}}))
    fresh_host()
    assert host_cpu().launch_overhead_s == CPU_LAUNCH_OVERHEAD_S
    # an entry an older version kept (no launch figure) is measured again, not misread
    path.write_text(json.dumps({key: {k: v for k, v in kept.items() if k != "launch_s"}}))
    fresh_host()
    again = host_cpu()
    assert again.dram_bytes_per_s != 12.5e9 and again.launch_overhead_s > 0
    assert "launch_s" in json.loads(path.read_text())[key]


@pytest.mark.parametrize("kept", ["{not json", '{"AMD": 12.5e9}', "[]"])
def test_a_corrupt_or_foreign_host_cache_is_measured_again(fresh_host, kept):
    path = host_cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(kept)
    host = host_cpu()
    assert 0 < host.dram_bytes_per_s < float("inf")  # measured anew; how fast is not a test's business
    entries = json.loads(path.read_text())
    assert entries[_entry_key(entries, host.sm_count)]["dram_bytes_per_s"] == host.dram_bytes_per_s


def test_a_host_profile_keeps_its_own_bandwidth(fresh_host, tmp_path):
    """A profile's figures win over the cached measurement."""
    import dataclasses

    from costmodels import RooflineParams
    from costmodels.profile import Profile, save_profile

    spec = dataclasses.replace(host_cpu(), dram_bytes_per_s=7e9)
    path = save_profile(Profile(device=spec, params=RooflineParams()), tmp_path / "profile.json")
    assert load_device(str(path))[0].dram_bytes_per_s == 7e9
