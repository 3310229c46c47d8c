"""`run` blames a step only when it is wrong given its own inputs.

Every step of a program is checked against ONNX Runtime's run of its nodes alone on the values
the program gave its inputs. A Softmax over large logits amplifies the float32 rounding the
MatMul before it makes (its summation order is ours, not ONNX Runtime's, and each logit is within
rtol x max|logit|), so its outputs differ from ONNX Runtime's whole-model values by more than
rtol while every step equals ONNX Runtime given its own inputs: the run passes, with one warning
line per program and `amplified_err` in its report. A kernel built from a deliberately wrong C
source is still named, as the first step that differs given its own inputs.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import subprocess
import sys

import numpy as np
import pytest
from onnx import helper

from fusesearch.api import plan as make_plan
from fusesearch.backends import cpu, emulate
from fusesearch.pipeline import prepare
from fusesearch.run import Mismatch, Program, _reference, checked, plan_steps, run_plan
from fusesearch.verify import random_feeds
from fusesearch.verify import run as ort_run
from tests.conftest import make_model, save

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler")
RTOL = 1e-4
AMPLIFIED = "every step equals ONNX Runtime given its own inputs: float32 rounding the model amplifies"


def tied_softmax():
    """x [1, 4096] (run's seeded input) -> MatMul by N(0, 300^2) weights [4096, 1000] -> Add a
    bias that ties the two largest logits in float64 -> Softmax: two outputs near 0.5 whose
    difference is the logits' float32 rounding (thousands of units) times e^0."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["z"], name="mm"),
             helper.make_node("Add", ["z", "b"], ["l"], name="bias"),
             helper.make_node("Softmax", ["l"], ["y"], name="softmax", axis=-1)]
    x = random_feeds(make_model(nodes, [("x", [1, 4096])], [("y", [1, 1000])]), 0)["x"]
    w = (np.random.default_rng(2).standard_normal((4096, 1000)) * 300).astype(np.float32)
    logits = x.astype(np.float64) @ w.astype(np.float64)
    first, second = np.argsort(logits[0])[::-1][:2]
    b = np.zeros(1000)
    b[second] = logits[0, first] - logits[0, second]
    return make_model(nodes, [("x", [1, 4096])], [("y", [1, 1000])], [("w", w), ("b", b.astype(np.float32))])


def chain():
    """Relu -> Exp -> Softmax, a kernel each in the unfused plan."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Exp", ["r"], ["e"], name="exp"),
             helper.make_node("Softmax", ["e"], ["y"], name="softmax", axis=-1)]
    return make_model(nodes, [("x", [8, 64])], [("y", [8, 64])])


def _unfused(model, tmp_path):
    path = save(model, tmp_path / "m.onnx")
    prep = prepare(path)
    return prep, make_plan(path, device="host", strategy="none", prepared=prep)


def test_onnx_runtime_itself_is_off_by_more_than_rtol():
    """The premise: against a float64 softmax of the float64 logits, ONNX Runtime's own output
    is off by more than rtol, so no float32 program can be held to its values at rtol."""
    model = tied_softmax()
    x = random_feeds(model, 0)["x"]
    w, b = (np.frombuffer(t.raw_data, np.float32).reshape(t.dims).astype(np.float64) for t in model.graph.initializer)
    logits = x.astype(np.float64) @ w + b
    exact = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    assert np.abs(ort_run(model, {"x": x})["y"] - exact).max() > RTOL


@pytest.mark.parametrize("check_each", [False, True])
def test_amplified_rounding_passes_with_a_warning_and_is_recorded(tmp_path, caplog, check_each):
    prep, unfused = _unfused(tied_softmax(), tmp_path)
    with caplog.at_level(logging.WARNING, logger="fusesearch.run"):
        report = run_plan(prep, unfused, unfused, rtol=RTOL, check_each=check_each, time_it=False)
    assert report.amplified_err > RTOL and report.unfused_amplified_err == report.amplified_err
    assert report.amplified_err == pytest.approx(report.max_rel_err)  # Softmax: scale 1
    doc = report.to_dict()
    assert doc["amplified_err"] == report.amplified_err and doc["unfused_amplified_err"] == report.amplified_err
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [line.split("'s output")[0] for line in lines] == ["the plan program", "the unfused program"]
    for line in lines:
        assert "\n" not in line and AMPLIFIED in line, line
        assert f"output 'y' differs from ONNX Runtime's by max abs err {report.amplified_err:.3g}" in line, line
        assert f"rtol {RTOL:g}" in line, line


def test_outputs_within_rtol_record_no_amplified_error(tmp_path, caplog):
    prep, unfused = _unfused(chain(), tmp_path)
    with caplog.at_level(logging.WARNING, logger="fusesearch.run"):
        report = run_plan(prep, unfused, unfused, rtol=RTOL, check_each=True, time_it=False)
    assert report.amplified_err is None and report.to_dict()["amplified_err"] is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("check_each", [False, True])
def test_a_kernel_wrong_given_its_inputs_is_named(tmp_path, check_each):
    """The Exp kernel's C source stores 1.001 e^r: the Relu before it is right, the Softmax after
    it is right given the wrong values it reads, and the Exp is the step named."""
    prep, unfused = _unfused(chain(), tmp_path)
    canonical, weights, feeds, reference = _reference(prep, {"plan": unfused}, 0, None)
    steps = plan_steps(prep.graph, unfused)
    i = next(i for i, s in enumerate(steps) if prep.graph.nodes[s.nodes[0]].op_type == "Exp")
    kernel = steps[i].kernel
    source, n = re.subn(r"(out0\[[^\]]*\] = )", r"\g<1>1.001f * ", kernel.c_source)
    assert n == 1
    steps[i] = dataclasses.replace(steps[i], kernel=kernel.with_c_source(source))
    where = re.escape(f"plan group g{steps[i].group} (generated {kernel.name}: Exp, nodes 'exp') writes 'e' ")
    with pytest.raises(Mismatch, match=rf"{where}with max abs err [\d.e-]+ \(scale [\d.e+]+, rtol 0.0001\) "
                                       "given its own inputs$"):
        checked("plan", lambda reuse: Program(prep.graph, canonical, steps, weights, 1, reuse=reuse), canonical,
                feeds, reference, RTOL, check_each)


@pytest.mark.parametrize("backend, programs", [
    ("cpu", ["plan", "unfused"]),
    pytest.param("emulate", ["plan (CUDA, emulated)"],
                 marks=pytest.mark.skipif(not emulate.available(), reason="no C++ compiler for the CUDA emulator"))])
def test_cli_run_passes_amplified_rounding_with_one_warning_line_per_program(tmp_path, backend, programs):
    path = save(tied_softmax(), tmp_path / "tied.onnx")
    proc = subprocess.run([sys.executable, "-m", "fusesearch", "run", path, "--strategy", "none", "--backend", backend,
                           "--no-tf32", "--repeat", "2", "--warmup", "0"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # the timer's busy-machine line (another load above half the CPUs the timing leaves) is no warning about outputs
    lines = [line for line in proc.stderr.strip().splitlines() if "fusesearch.backends.timing" not in line]
    assert [line.split("'s output")[0] for line in lines] == [f"WARNING fusesearch.run: the {p} program"
                                                              for p in programs], lines
    assert all(AMPLIFIED in line and "output 'y'" in line for line in lines), lines
