"""The backend registry: one check of a backend's name for every command (exit 2, one line naming
the option and the choices), availability with its reason, and each backend's runner, library
call and null calls on real kernels (the emulator's results equal the C backend's); what is taken
off a sample (`CallCosts`) on fixed timings, never wall time."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from fusesearch.backends.codegen import generate
from fusesearch.backends.library import CHAIN, run_costs
from fusesearch.backends.registry import (
    BACKENDS,
    CALL_FLOOR_S,
    CallCosts,
    NullCalls,
    backend_names,
    get_backend,
)
from fusesearch.backends.timing import Timing
from fusesearch.errors import BadInput
from fusesearch.groups import FusionGroup
from fusesearch.ir.canonicalize import to_proto
from fusesearch.lowering import lower, lower_as_library
from fusesearch.pipeline import prepare
from fusesearch.verify import all_values, random_feeds
from tests.conftest import gpu_available, make_model, save


def _dense(tmp_path) -> str:
    """x[4,8] @ w[8,8] + b, Relu: a Gemm (a library call alone) and a fusable epilogue."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             helper.make_node("Add", ["m", "b"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["y"], name="relu")]
    inits = [("w", rng.standard_normal((8, 8)).astype(np.float32)), ("b", rng.standard_normal(8).astype(np.float32))]
    return save(make_model(nodes, [("x", [4, 8])], [("y", [4, 8])], inits), tmp_path / "dense.onnx")


def test_names_and_what_each_backend_can_do():
    assert tuple(BACKENDS) == ("cpu", "cupy", "emulate")
    assert backend_names() == ("cpu", "cupy") and backend_names(timing=False) == ("cpu", "cupy", "emulate")
    cpu, cupy, emulate = BACKENDS.values()
    assert (cpu.cuda, cupy.cuda, emulate.cuda) == (False, True, True)
    assert [b.end_to_end for b in BACKENDS.values()] == [True, False, False]
    assert (cpu.default_device, cupy.default_device) == ("host", "h200")
    assert get_backend(cupy) is cupy and get_backend("emulate", timing=False) is emulate


@pytest.mark.parametrize("name, timing, choices", [
    ("tpu", True, "cpu, cupy"), ("emulate", True, "cpu, cupy"), ("tpu", False, "cpu, cupy, emulate"),
    ("CPU", True, "cpu, cupy")])
def test_an_unknown_name_is_bad_input_naming_the_choices(name, timing, choices):
    with pytest.raises(BadInput) as err:
        get_backend(name, timing=timing)
    assert str(err.value) == f"--backend {name}: choose one of {choices}"
    with pytest.raises(BadInput) as err:
        get_backend(name, timing=timing, named=f"s.toml: backend = {name!r}", optional=True)
    assert str(err.value) == f"s.toml: backend = {name!r}: choose one of {choices} or leave it out"


@pytest.mark.parametrize("command, choices", [("measure", "cpu, cupy"), ("calibrate", "cpu, cupy"),
                                              ("run", "cpu, cupy, emulate")])
@pytest.mark.parametrize("name", ["tpu", "emulate"])
def test_every_command_checks_backend_with_the_registry(run_cli, tmp_path, command, choices, name):
    """One check for every command: exit 2 and one line; `emulate` times nothing, so only `run`
    (which checks the CUDA program with it) takes it."""
    args = ("--backend", name, "-o", tmp_path / "p.json") if command == "calibrate" else (_dense(tmp_path), "--backend", name)
    code, stdout, stderr = run_cli(command, *args)
    if command == "run" and name == "emulate":
        assert code == 0, stderr
        return
    assert code == 2 and stdout == ""
    line, = stderr.strip().splitlines()
    assert line == f"fusesearch: error: --backend {name}: choose one of {choices}"


def test_a_sweep_file_names_its_backend_key(tmp_path):
    from fusesearch.sweep import load_config

    path = tmp_path / "s.toml"
    path.write_text('models = ["zoo:unet"]\ndevices = ["t4"]\nbackend = "emulate"\n')
    with pytest.raises(BadInput) as err:
        load_config(path)
    assert str(err.value) == f"{path}: backend = 'emulate': choose one of cpu, cupy or leave it out"
    path.write_text('models = ["zoo:unet"]\ndevices = ["t4"]\nbackend = "cupy"\n')
    assert load_config(path).measure == ("kernels",)  # cupy times kernels; the cpu also whole programs
    path.write_text('models = ["zoo:unet"]\ndevices = ["t4"]\nbackend = "cpu"\n')
    assert load_config(path).measure == ("kernels", "end_to_end")


@pytest.mark.skipif(gpu_available(), reason="a GPU is visible here")
def test_cupy_without_a_gpu_says_why_and_what_runs_here():
    cupy = get_backend("cupy")
    decision = cupy.available()
    assert not decision and ("cupy is not installed" in decision.reason or "no CUDA device" in decision.reason)
    with pytest.raises(BadInput) as err:
        cupy.require()  # the commands that time: cpu is the alternative
    assert str(err.value) == (f"--backend cupy: no GPU/CuPy available ({decision.reason}); "
                              "use --backend cpu to run here")
    with pytest.raises(BadInput) as err:
        cupy.require(timing=False)  # run: the emulator checks the CUDA program too
    assert str(err.value).endswith("; use --backend cpu to run here, or --backend emulate to check the CUDA "
                                   "program without a GPU")
    with pytest.raises(BadInput, match="no GPU/CuPy available"):
        cupy.cost_device()
    import sys

    assert "cupy" not in sys.modules  # asked, never imported where it is missing


def test_emulate_runs_the_cuda_kernel_as_the_cpu_runs_the_c_kernel(tmp_path):
    """The emulator is available wherever a C++ compiler is, compiles the kernel's CUDA source
    and its runner gives what the C backend's gives, and ONNX Runtime's values."""
    emulate, cpu = get_backend("emulate", timing=False), get_backend("cpu")
    assert emulate.available() and cpu.available()
    prep = prepare(_dense(tmp_path), tf32=False)
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    kernel = lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))))
    generated = generate(prep.graph, kernel)
    assert hasattr(emulate.compile(generated), "fs_launch") and hasattr(cpu.compile(generated), generated.name)
    inputs = {t: values[t] for t in kernel.inputs}
    got = {}
    for backend in (cpu, emulate):
        run, fetch = backend.runner(generated, inputs)
        run()
        got[backend.name] = fetch()
    for t in kernel.outputs:
        np.testing.assert_allclose(got["emulate"][t], got["cpu"][t], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["cpu"][t], values[t], rtol=1e-4, atol=1e-4)


def test_library_calls_run_the_node_through_each_backends_library(tmp_path):
    """A lone anchor (the MatMul and Add, canonical as one Gemm) through ONNX Runtime (cpu) and
    `arraylib` with numpy (emulate) equals the model's value; a node the array library lacks is (None, why), not an error."""
    prep = prepare(_dense(tmp_path), tf32=False)
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    ids = {n.op_type: i for i, n in enumerate(prep.graph.nodes)}
    matmul = lower_as_library(prep.graph, FusionGroup.single(ids["Gemm"]))
    for backend in (get_backend("cpu"), get_backend("emulate", timing=False)):
        call, why = backend.library_call(canonical, prep.graph, matmul, values)
        assert call is not None and why == ""
        run, fetch = call
        run()
        np.testing.assert_allclose(fetch()[matmul.outputs[0]], values[matmul.outputs[0]], rtol=1e-5, atol=1e-5)
    relu = lower_as_library(prep.graph, FusionGroup.single(ids["Relu"]))
    call, why = get_backend("emulate", timing=False).library_call(canonical, prep.graph, relu, values)
    assert call is None and why.startswith("no emulated GPU library kernel for relu(Relu)")


def test_the_cpu_null_calls_are_onnx_runtimes_runs_then_a_c_call():
    cpu = get_backend("cpu")
    assert len(cpu.null_calls(library=True, generated=True).runs) == 3
    assert len(cpu.null_calls(library=False, generated=True).runs) == 1
    assert len(cpu.null_calls(library=True, generated=False).runs) == 2
    for backend in BACKENDS.values():
        if backend is not cpu:  # a GPU's events time the device's work alone
            assert backend.null_calls(library=True, generated=True) == NullCalls()
    for run in cpu.null_calls(library=True, generated=True).runs:
        run()


def test_call_costs_take_the_null_calls_off_each_sample():
    """Fixed medians of the null runs: one Run 10 us, the chain 10 us + CHAIN x 0.5 us, a C call
    1.5 us; a generated sample loses the call (at least CALL_FLOOR_S), a library sample of two
    nodes loses two Runs (at least two nodes' share); nothing timed apart, nothing taken off."""
    one_s, node_s, call_s = 10e-6, 0.5e-6, 1.5e-6
    costs = NullCalls((print, print, print), library=True, generated=True).costs(
        [one_s, one_s + CHAIN * node_s, call_s])
    run_s, node_share = run_costs(one_s, one_s + CHAIN * node_s)
    assert costs == CallCosts(call_s, run_s, node_share)
    sample = Timing((1e-6, 30e-6), 1, "fixed")
    assert costs.net("generated", sample).samples_s == pytest.approx((CALL_FLOOR_S, 30e-6 - call_s))
    assert costs.net("library", sample, calls=2).samples_s == pytest.approx((2 * node_share, 30e-6 - 2 * run_s))
    assert CallCosts().net("generated", sample) is sample
    only_call = NullCalls((print,), generated=True).costs([call_s])
    assert only_call == CallCosts(call_s=call_s)
    with pytest.raises(ValueError, match="one median per null run"):
        only_call = NullCalls((print,), generated=True).costs([])


def test_an_io_bound_run_keeps_its_arrays_alive():
    """ONNX Runtime's IO binding holds the outputs' addresses, not the arrays: a run whose caller
    lets go of its output and fixed input still has both (writing freed memory corrupted the
    heap, a segfault at exit), and writes its values there."""
    import gc
    import weakref

    from fusesearch.backends.library import host_binding
    from fusesearch.verify import session

    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", [4, 8])], [("y", [4, 8])])
    x = np.linspace(-1.0, 1.0, 32, dtype=np.float32).reshape(4, 8)
    y = np.empty((4, 8), np.float32)
    refs = weakref.ref(x), weakref.ref(y)
    run = host_binding(session(model), [("x", x)], [("y", y)])
    x = y = None
    gc.collect()
    assert all(r() is not None for r in refs)
    run()
    assert np.array_equal(refs[1](), np.maximum(refs[0](), 0.0))
    del run
    gc.collect()
    assert all(r() is None for r in refs)
