"""`run` of a plan that chose layouts: the program stores blocked tensors with their padded
channels, runs the blocked kernels and the plan's reorders in order (filters packed once), reads
the model's outputs from their NCHW copies, and equals ONNX Runtime."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fusesearch.backends import cpu
from fusesearch.ir.canonicalize import to_proto
from fusesearch.layout import Layout
from fusesearch.pipeline import prepare
from fusesearch.run import Program, plan_steps, program_inputs, restore_threads, run_plan
from tests.search.test_layouts import DEPTHWISE_SLOW, _plan, depthwise_chain

needs_cc = pytest.mark.skipif(not cpu.available(), reason="no C compiler")


def _steps(plan):
    return [(s.group, s.inputs, s.sources, s.outputs) for s in plan_steps(plan.graph, plan)]


@needs_cc
def test_a_blocked_chain_runs_its_reorders_in_order_and_equals_onnx_runtime(tmp_path):
    """24 channels in blocks of 16: the input copied into blocks first, each blocked kernel
    reading the one before it where it lies, the output copied back last; 32 channels stored."""
    path = depthwise_chain(tmp_path, channels=24)
    plan = _plan(path, params=DEPTHWISE_SLOW)
    steps = _steps(plan)
    assert steps[0] == (-1, ("x",), ("x",), ("x@NCHW16c",))
    assert steps[1][2][0] == "x@NCHW16c" and steps[1][1][0] == "x"  # the first conv reads the copy
    assert [s[2][0] for s in steps[2:4]] == ["a0", "a1"]  # the others their producer's blocked output
    assert steps[-1] == (-1, ("a2",), ("a2",), ("a2@NCHW",))
    prep = prepare(path, keep_original=True)
    report = run_plan(prep, plan, _plan(path, strategy="none"), repeat=1, warmup=0)
    assert report.max_rel_err < 1e-5 and report.kernels == 5 and report.library_steps == 0
    canonical, weights, _ = program_inputs(prep, 0, None)
    try:
        program = Program(prep.graph, to_proto(prep.canonical), plan_steps(prep.graph, plan), weights, 1)
    finally:
        restore_threads()
    assert program.laid["a0"] == Layout(16) and program.sizes["a0"] == 32 * 14 * 14 * 4
    assert program.sizes["a2@NCHW"] == 24 * 14 * 14 * 4 and program.out_name == {"a2": "a2@NCHW"}


@needs_cc
def test_each_blocked_step_equals_onnx_runtime_on_its_own_inputs(tmp_path):
    """--check-each: every step's blocked output, viewed in NCHW, equals ONNX Runtime's run of its
    nodes on the program's values; a stem reading the image where it lies."""
    path = depthwise_chain(tmp_path, convs=2, stem=True)
    plan = _plan(path, params=DEPTHWISE_SLOW)
    assert plan.groups[0].kernel.schedule.layout_out.blocked and len(plan.reorders) == 1
    report = run_plan(prepare(path, keep_original=True), plan, _plan(path, strategy="none"), repeat=1, warmup=0,
                      check_each=True)
    assert report.max_rel_err < 1e-5


@needs_cc
def test_run_on_the_cli_with_and_without_layouts(tmp_path, run_cli):
    from costmodels.profile import Profile, save_profile
    from costmodels.roofline import host_params
    from tests.search.test_layouts import host16

    profile = save_profile(Profile(host16(), host_params().with_updates(**DEPTHWISE_SLOW), backend="cpu"),
                           tmp_path / "profile.json")
    path = depthwise_chain(tmp_path)
    kernels = {}
    for layouts in ("auto", "nchw"):
        code, out, err = run_cli("run", path, "--device", profile, "--repeat", "1", "--warmup", "0", "--layouts",
                                 layouts, "--json")
        assert code == 0, err
        doc = json.loads(out)
        kernels[layouts] = doc["kernels"]
        assert doc["max_rel_err"] < 1e-5
    assert kernels == {"auto": 5, "nchw": 3}  # two reorders


@needs_cc
@pytest.mark.slow
def test_mobilenetv2_with_layouts_runs_equal_to_onnx_runtime():
    """The zoo's mobilenetv2 planned where depthwise convs pay blocked (its NCHW depthwise loop at
    0.41 of the rate, dense NCHWc convs at 0.8, as bench_nchwc measured): blocked groups and
    their reorders, equal to ONNX Runtime."""
    import dataclasses

    from costmodels import RooflineModel
    from costmodels.devices import get_device
    from costmodels.roofline import host_params
    from fusesearch.search import search
    from fusesearch.search.problem import SearchConfig

    prep = prepare("zoo:mobilenetv2", keep_original=True)
    model = RooflineModel(host_params().with_updates(product_efficiency={"depthwise": 0.41, "nchwc": 0.8}))
    device = dataclasses.replace(get_device("host", 1), warp_size=16)
    plan = search(prep.graph, device, model, "cpsat", config=SearchConfig(workers=1))
    unfused = search(prep.graph, device, model, "none", config=SearchConfig(workers=1))
    assert plan.reorders and any(g.kernel.schedule.layout_out.blocked for g in plan.groups)
    report = run_plan(prep, plan, unfused, repeat=1, warmup=0)
    assert report.max_rel_err < 1e-4 and np.isfinite(report.max_rel_err)


@needs_cc
def test_run_plan_json_runs_its_layouts_as_chosen(tmp_path, run_cli):
    """`run --plan plan.json` runs the file's blocked groups and reorders (two more kernels than
    its groups); a file whose block is not this CPU's is refused naming the fix."""
    from costmodels.profile import Profile, save_profile
    from costmodels.roofline import host_params
    from tests.search.test_layouts import host16

    profile = save_profile(Profile(host16(), host_params().with_updates(**DEPTHWISE_SLOW), backend="cpu"),
                           tmp_path / "profile.json")
    path, out = depthwise_chain(tmp_path), tmp_path / "plan.json"
    code, _, err = run_cli("plan", path, "--device", profile, "-o", out, "--workers", "1")
    assert code == 0, err
    code, stdout, err = run_cli("run", path, "--device", profile, "--plan", out, "--repeat", "1", "--warmup", "0",
                                "--json")
    assert code == 0, err
    assert json.loads(stdout)["kernels"] == 5
    doc = json.loads(out.read_text())
    doc["layouts"]["block"] = 8
    (tmp_path / "eight.json").write_text(json.dumps(doc))
    code, _, err = run_cli("run", path, "--device", profile, "--plan", tmp_path / "eight.json", "--repeat", "1")
    assert code == 2 and "channel blocks of 8, this CPU's are 16; plan again" in err


@needs_cc
def test_measure_times_each_blocked_kernel_on_its_inputs_as_they_lie(tmp_path):
    """`measure` runs a blocked group alone on its inputs in channel blocks (24 channels padded to
    32) and compares its outputs, back in NCHW, with ONNX Runtime's; it used to hand the kernel
    NCHW arrays and fail comparing the padded output."""
    from fusesearch.measure import measure_plan

    path = depthwise_chain(tmp_path, channels=24)
    plan = _plan(path, params=DEPTHWISE_SLOW)
    assert sum(g.kernel.schedule.layout_out.blocked for g in plan.groups) == 3
    report = measure_plan(prepare(path), plan, _plan(path, strategy="none"), "cpu", budget_s=0.01)
    assert [m.how for m in report.plan] == ["generated"] * 3
    assert all(m.max_rel_err < 1e-5 for m in report.plan), [m.max_rel_err for m in report.plan]
