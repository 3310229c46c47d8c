"""`--dump DIR` (plan, measure, run) and `run --trace FILE`: the files, their contents, bad paths."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from onnx import helper

from fusesearch.backends import cpu
from fusesearch.trace import TracedStep, chrome_trace, trace_rounds
from tests.conftest import make_model, save
from tests.test_run import with_if

FAST = ("--strategy", "greedy", "--repeat", "3", "--warmup", "1")
needs_cc = pytest.mark.skipif(not cpu.available(), reason="no C compiler")


def chain():
    """MatMul+Add+Relu, a Reshape (a view: an alias group), Softmax: generated groups and an alias."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Add", ["h", "b"], ["hb"], name="add"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu"),
             helper.make_node("Reshape", ["r", "shape"], ["r2"], name="reshape"),
             helper.make_node("Softmax", ["r2"], ["y"], name="softmax", axis=-1)]
    inits = [("w", (rng.standard_normal((32, 64)) * 0.3).astype(np.float32)),
             ("b", (rng.standard_normal(64) * 0.3).astype(np.float32)), ("shape", np.array([32, 32], np.int64))]
    return make_model(nodes, [("x", [16, 32])], [("y", [32, 32])], inits)


def _files(folder):
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


# -- dumps ------------------------------------------------------------------------------------

def test_plan_dump_holds_each_groups_sources_schedule_and_launch(run_cli, tmp_path):
    """A GPU plan: every generated group has the C and CUDA source the program compiles, its
    schedule as plan.json has it and its launch (grid, block); an alias has its JSON only."""
    from fusesearch.api import plan as make_plan
    from fusesearch.run import plan_steps

    path = save(chain(), tmp_path / "m.onnx")
    dump = tmp_path / "dump"
    code, _, err = run_cli("plan", path, "--device", "t4", "--strategy", "greedy", "--dump", dump)
    assert code == 0, err
    assert f"written to {dump}" in err
    plan = make_plan(path, device="t4", strategy="greedy")
    steps = {s.group: s for s in plan_steps(plan.graph, plan)}
    index = json.loads((dump / "index.json").read_text())
    assert [g["id"] for g in index["groups"]] == [g.id for g in plan.groups]
    assert index["model"] == "t" and index["device"] == "t4" and index["strategy"] == "greedy"
    hows = set()
    for g, row in zip(plan.groups, index["groups"], strict=True):
        doc = json.loads((dump / f"g{g.id}.json").read_text())
        assert doc["schedule"] == g.kernel.schedule.to_dict() and doc["runs_as"] == steps[g.id].how == row["runs_as"]
        hows.add(doc["runs_as"])
        assert all((dump / name).is_file() for name in row["files"])
        if doc["runs_as"] != "generated":
            assert row["files"] == [f"g{g.id}.json"] and doc["launch"] is None
            continue
        kernel = steps[g.id].kernel
        assert (dump / f"g{g.id}.c").read_text() == kernel.c_source
        assert (dump / f"g{g.id}.cu").read_text() == kernel.cuda_source
        launch = doc["launch"]
        assert launch["function"] == kernel.name and launch["cuda"]["grid"] == list(kernel.grid)
        assert launch["cuda"]["block"] == list(kernel.block)
        assert [a["tensor"] for a in launch["inputs"]] == [a.tensor for a in kernel.inputs]
    assert hows == {"generated", "alias"}
    assert set(_files(dump)) == {"index.json"} | {n for row in index["groups"] for n in row["files"]}


def test_a_host_plans_packed_gemm_has_c_only(run_cli, tmp_path):
    """A CPU schedule (packed) has no CUDA source: its group dumps a .c and no .cu."""
    path = save(chain(), tmp_path / "m.onnx")
    dump = tmp_path / "dump"
    code, _, err = run_cli("plan", path, "--device", "host", "--strategy", "greedy", "--dump", dump)
    assert code == 0, err
    groups = json.loads((dump / "index.json").read_text())["groups"]
    gemm = next(g for g in groups if g["template"] == "gemm")
    assert json.loads((dump / f"g{gemm['id']}.json").read_text())["schedule"]["skeleton"] == "packed"
    assert gemm["files"] == [f"g{gemm['id']}.c", f"g{gemm['id']}.json"]
    assert "cuda" not in json.loads((dump / f"g{gemm['id']}.json").read_text())["launch"]


@needs_cc
def test_measure_and_run_dump_what_plan_dumps(run_cli, tmp_path):
    """One dump for the three commands: the same plan gives the same files."""
    path = save(chain(), tmp_path / "m.onnx")
    code, _, err = run_cli("plan", path, "--device", "host", "--strategy", "greedy", "--dump", tmp_path / "p")
    assert code == 0, err
    code, _, err = run_cli("measure", path, "--strategy", "greedy", "--budget", "0.01", "--dump", tmp_path / "m")
    assert code == 0, err
    code, _, err = run_cli("run", path, *FAST, "--dump", tmp_path / "r")
    assert code == 0, err
    assert _files(tmp_path / "p") == _files(tmp_path / "m") == _files(tmp_path / "r")


def test_a_blocked_plans_dump_holds_the_reorders_its_program_runs(run_cli, tmp_path):
    """24 channels in blocks of 16, the input copied into blocks and the output back: each reorder
    step of the program (`run.plan_steps`) dumped, its C source the step's, named by index, tensor
    and direction, its JSON the plan's reorder with its schedule and launch, listed in index.json."""
    from costmodels.profile import Profile, save_profile
    from costmodels.roofline import host_params
    from fusesearch.api import plan as make_plan
    from fusesearch.run import plan_steps
    from tests.search.test_layouts import DEPTHWISE_SLOW, depthwise_chain, host16

    profile = save_profile(Profile(host16(), host_params().with_updates(**DEPTHWISE_SLOW), backend="cpu"),
                           tmp_path / "profile.json")
    path, dump = depthwise_chain(tmp_path, channels=24), tmp_path / "dump"
    code, _, err = run_cli("plan", path, "--device", profile, "--workers", "1", "--dump", dump)
    assert code == 0, err
    assert "of 3 groups and 2 reorders written" in err
    plan = make_plan(path, device=str(profile), workers=1)
    reorders = {s.outputs[0]: s.kernel for s in plan_steps(plan.graph, plan) if s.group == -1}
    assert set(reorders) == {"x@NCHW16c", "a2@NCHW"}
    index = json.loads((dump / "index.json").read_text())
    assert [r["files"] for r in index["reorders"]] == [["r0.x.NCHW-NCHW16c.c", "r0.x.NCHW-NCHW16c.json"],
                                                       ["r1.a2.NCHW16c-NCHW.c", "r1.a2.NCHW16c-NCHW.json"]]
    for r, row, copy in zip(plan.reorders, index["reorders"], ("x@NCHW16c", "a2@NCHW"), strict=True):
        source, doc = row["files"]
        assert (dump / source).read_text() == reorders[copy].c_source
        doc = json.loads((dump / doc).read_text())
        assert {k: doc[k] for k in ("tensor", "from", "to", "after")} == {
            "tensor": r.tensor, "from": r.source.name, "to": r.target.name, "after": r.after}
        assert doc["runs_as"] == "generated" and doc["schedule"] == r.kernel.schedule.to_dict()
        assert doc["launch"]["function"] == reorders[copy].name
        assert [a["tensor"] for a in doc["launch"]["outputs"]] == [copy]
        assert doc["launch"]["inputs"][0]["shape"] == ([1, 24, 14, 14] if r.tensor == "x" else [1, 2, 14, 14, 16])
    assert index["reorders"][1]["after"] == plan.groups[-1].id
    assert set(_files(dump)) == {"index.json"} | {n for row in index["groups"] + index["reorders"] for n in row["files"]}


def test_a_bad_dump_folder_exits_2_before_any_work(run_cli, tmp_path):
    path = save(chain(), tmp_path / "m.onnx")
    plan = ("plan", path, "--device", "t4", "--strategy", "greedy", "--dump")
    a_file = tmp_path / "f.txt"
    a_file.write_text("mine")
    for target, named in ((a_file, "is a file"), (tmp_path / "no" / "dump", f"folder {tmp_path / 'no'} does not exist")):
        code, stdout, err = run_cli(*plan, target)
        assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1
        assert err.startswith(f"fusesearch: error: --dump {target}: {named}")
    assert a_file.read_text() == "mine"
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    (kept / "g0.json").write_text("mine")
    code, _, err = run_cli(*plan, kept)
    assert code == 2 and "not empty" in err and "--force" in err and (kept / "g0.json").read_text() == "mine"
    code, _, err = run_cli(*plan, kept, "--force")
    assert code == 0, err
    assert (kept / "notes.txt").read_text() == "mine" and (kept / "g0.json").read_text() != "mine"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_an_unwritable_dump_folder_exits_2(run_cli, tmp_path):
    path = save(chain(), tmp_path / "m.onnx")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        for target in (locked, locked / "dump"):
            code, _, err = run_cli("plan", path, "--device", "t4", "--strategy", "greedy", "--dump", target)
            assert code == 2 and f"--dump {target}:" in err and "writ" in err
    finally:
        locked.chmod(0o700)


# -- traces -----------------------------------------------------------------------------------

class FakeClock:
    """Durations from a list, in turn; `now` advances by a fixed tick per reading."""

    name = "fake"

    def __init__(self, durations):
        self.durations = list(durations)
        self.t = 0.0

    def start(self):
        return None

    def stop(self, _token):
        d = self.durations.pop(0)
        self.t += d
        return d

    def now(self):
        self.t += 1e-6
        return self.t


def test_trace_rounds_times_every_step_once_per_round_inside_its_round():
    calls = []
    steps = [TracedStep(f"g{i} k{i}", "generated" if i != 1 else "library", lambda i=i: calls.append(i),
                        {"group": i, "skeleton": "tiled"}) for i in range(3)]
    clock = FakeClock([1e-3, 2e-3, 0.0, 1e-3, 2e-3, 0.0])
    events = trace_rounds(steps, 2, clock, warmup=1, now=clock.now)
    assert calls == [0, 1, 2] * 3  # one untimed round, then two timed
    rounds = [e for e in events if e["cat"] == "round"]
    assert [e["args"]["round"] for e in rounds] == [0, 1]
    for r, outer in enumerate(rounds):
        inner = [e for e in events if e["cat"] != "round" and e["args"]["round"] == r]
        assert [e["name"] for e in inner] == ["g0 k0", "g1 k1", "g2 k2"]
        assert [e["dur"] for e in inner] == pytest.approx([1000.0, 2000.0, 0.0])  # microseconds
        assert [e["cat"] for e in inner] == ["generated", "library", "generated"]
        assert all(e["ph"] == "X" and e["args"]["skeleton"] == "tiled" for e in inner)
        assert all(outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] for e in inner)
        assert [e["ts"] for e in inner] == sorted(e["ts"] for e in inner)
    # ts: the origin is read once, each round and step start once more (1 us ticks), and the durations pass
    first = [e for e in events if e["args"]["round"] == 0 and e["cat"] != "round"]
    assert [e["ts"] for e in first] == pytest.approx([2.0, 1003.0, 3004.0])
    doc = chrome_trace(events, "p", "t", {"rounds": 2})
    assert [e["ph"] for e in doc["traceEvents"][:2]] == ["M", "M"] and doc["otherData"] == {"rounds": 2}
    json.dumps(doc, allow_nan=False)


def test_trace_rounds_needs_a_round():
    with pytest.raises(ValueError, match="rounds"):
        trace_rounds([], 0, FakeClock([]))


@needs_cc
def test_run_trace_has_every_step_in_every_round(run_cli, tmp_path):
    """A plan with generated kernels and an ONNX Runtime step (an If): the trace holds each once
    per round, named by group, with durations >= 0, inside its round's event."""
    from fusesearch.api import plan as make_plan
    from fusesearch.run import one_by_one, plan_steps

    path = save(with_if(), tmp_path / "m.onnx")
    trace = tmp_path / "trace.json"
    code, _, err = run_cli("run", path, *FAST, "--trace", trace)
    assert code == 0, err
    doc = json.loads(trace.read_text())
    plan = make_plan(path, device="host", strategy="greedy")
    expected = [(f"g{s.group}", how) for how, [s] in one_by_one(plan_steps(plan.graph, plan))]
    assert {how for _, how in expected} == {"generated", "library"}
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert doc["otherData"]["rounds"] == 3 and doc["otherData"]["clock"] == "perf_counter"
    for r in range(3):
        outer = [e for e in events if e["cat"] == "round" and e["args"]["round"] == r]
        inner = [e for e in events if e["cat"] != "round" and e["args"]["round"] == r]
        assert len(outer) == 1
        assert [(e["name"].split()[0], e["cat"]) for e in inner] == expected
        assert all(e["dur"] >= 0 and e["args"]["group"] == int(e["name"].split()[0][1:]) for e in inner)
        assert all(outer[0]["ts"] <= e["ts"] <= e["ts"] + e["dur"] <= outer[0]["ts"] + outer[0]["dur"] + 1e-6
                   for e in inner)
    assert {e["args"]["skeleton"] for e in events if e["cat"] == "library"} == {"library"}


def test_run_trace_refuses_an_existing_file_and_the_emulator(run_cli, tmp_path):
    path = save(chain(), tmp_path / "m.onnx")
    trace = tmp_path / "trace.json"
    trace.write_text("mine")
    code, _, err = run_cli("run", path, *FAST, "--trace", trace)
    assert code == 2 and f"--trace {trace}: file exists" in err and trace.read_text() == "mine"
    code, _, err = run_cli("run", path, *FAST, "--backend", "emulate", "--device", "t4", "--trace", tmp_path / "t2")
    assert code == 2 and err.startswith("fusesearch: error: --trace: --backend emulate checks correctness only")


@pytest.mark.parametrize("on", ["cpu", "cuda-emulated"])
def test_a_program_run_step_by_step_gives_the_programs_outputs(tmp_path, on):
    """The trace's calls are the program's, one per step with code, in order: run once each they
    compute what ONNX Runtime computes (on the CPU a C entry point per kernel; the CUDA program's
    launches one by one, here on the emulator's host device)."""
    from fusesearch.api import plan as make_plan
    from fusesearch.backends import emulate
    from fusesearch.backends.timing import PerfCounterClock
    from fusesearch.pipeline import prepare
    from fusesearch.run import (
        CudaProgram,
        Program,
        one_by_one,
        plan_steps,
        program_inputs,
        restore_threads,
    )
    from fusesearch.trace import traced_steps
    from fusesearch.verify import all_values, compare

    if not (cpu.available() if on == "cpu" else emulate.available()):
        pytest.skip(f"no compiler for {on}")
    path = save(with_if(), tmp_path / "m.onnx")
    prep = prepare(path)
    plan = make_plan(path, device="host" if on == "cpu" else "t4", strategy="greedy", prepared=prep)
    canonical, weights, feeds = program_inputs(prep, 0, None)
    steps = plan_steps(prep.graph, plan)
    try:
        program = (Program(prep.graph, canonical, steps, weights, 1, split=one_by_one) if on == "cpu"
                   else CudaProgram(prep.graph, canonical, steps, weights, emulate.HostDevice(), 1))
        program.set_inputs(feeds)
        traced = traced_steps(prep.graph, plan, steps, program)
        events = trace_rounds(traced, 1, PerfCounterClock())
    finally:
        restore_threads()
    assert [(e["name"].split()[0], e["cat"]) for e in events[:-1]] == [
        (f"g{s.group}", how) for how, [s] in one_by_one(steps)]
    wanted = all_values(canonical, feeds, [])
    diffs = compare({t: wanted[t] for t in prep.graph.outputs}, program.outputs(), rtol=1e-4)
    assert diffs and all(d.ok for d in diffs)
