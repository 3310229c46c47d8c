"""`fusesearch run --backend cupy|emulate`: the plan's CUDA program (one module, one stream, a CUDA
graph when no library step splits it) equals ONNX Runtime.

Without a GPU the same orchestration (`run.CudaProgram`) runs on the CUDA emulator
(`--backend emulate`): a MatMul+Add+Relu and a LayerNorm-like row group, then a Softmax row group
(two row kernels whose helpers share names, in one module), captured and replayed as a graph; the
same with an If between the kernels (an ONNX Runtime step: launched one by one). The gpu-marked
tests run the real program on the GPU and time it beside ONNX Runtime."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from onnx import TensorProto, helper

from fusesearch.backends import emulate
from tests.backends.test_cuda_emulated import GELU_CONSTANTS, gelu
from tests.conftest import gpu_available, make_model, save

pytestmark = pytest.mark.skipif(not emulate.available(), reason="no C++ compiler for the CUDA emulator")
RNG = np.random.default_rng(0)
KEYS = ("plan", "unfused", "ort_enable_all", "ort_enable_extended", "ort_disable_all")


def _w(*shape):
    return (RNG.standard_normal(shape) * 0.3).astype(np.float32)


def _layernorm(x: str, y: str) -> list:
    """A LayerNorm over the last axis written out as ONNX exports it op by op (a row group)."""
    return [helper.make_node("ReduceMean", [x], [f"{y}_mu"], name=f"{y}_mean", axes=[-1]),
            helper.make_node("Sub", [x, f"{y}_mu"], [f"{y}_d"], name=f"{y}_sub"),
            helper.make_node("Mul", [f"{y}_d", f"{y}_d"], [f"{y}_sq"], name=f"{y}_square"),
            helper.make_node("ReduceMean", [f"{y}_sq"], [f"{y}_var"], name=f"{y}_var_mean", axes=[-1]),
            helper.make_node("Add", [f"{y}_var", "eps"], [f"{y}_ve"], name=f"{y}_add_eps"),
            helper.make_node("Sqrt", [f"{y}_ve"], [f"{y}_std"], name=f"{y}_sqrt"),
            helper.make_node("Div", [f"{y}_d", f"{y}_std"], [f"{y}_n"], name=f"{y}_div"),
            helper.make_node("Mul", [f"{y}_n", "gamma"], [f"{y}_g"], name=f"{y}_gamma"),
            helper.make_node("Add", [f"{y}_g", "beta"], [y], name=f"{y}_beta")]


def dense_norm():
    """x -> MatMul+Add+Relu -> LayerNorm -> MatMul -> Softmax: generated kernels only."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="add1"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu1"),
             *_layernorm("r", "ln"),
             helper.make_node("MatMul", ["ln", "w2"], ["z"], name="mm2"),
             helper.make_node("Softmax", ["z"], ["y"], name="softmax", axis=-1)]
    inits = [("w1", _w(32, 64)), ("b1", _w(64)), ("gamma", 1 + _w(64)), ("beta", _w(64)),
             ("eps", np.float32(1e-5)), ("w2", _w(64, 32))]
    return make_model(nodes, [("x", [4, 32])], [("y", [4, 32])], inits)


def dense_gelu(rows: int = 256, width: int = 128, hidden: int = 512):
    """x (rows x width) -> MatMul + Add + GELU (erf form, as exported): a GEMM whose epilogue no
    library call takes."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="add1"), *gelu("hb", "y")]
    inits = [("w1", _w(width, hidden)), ("b1", _w(hidden)), *GELU_CONSTANTS]
    return make_model(nodes, [("x", [rows, width])], [("y", [rows, hidden])], inits)


def dense_if_norm():
    """MatMul+Add+Relu, then an If on the sign of its sum (an ONNX Runtime step: a Softmax branch), then a
    LayerNorm."""
    then = helper.make_graph([helper.make_node("Mul", ["r", "two"], ["a"], name="then_mul")], "then", [],
                             [helper.make_tensor_value_info("a", TensorProto.FLOAT, [4, 64])])
    other = helper.make_graph([helper.make_node("Softmax", ["r"], ["b"], name="else_softmax")], "else", [],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [4, 64])])
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="add1"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu1"),
             helper.make_node("ReduceSum", ["r"], ["s"], name="sum", keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["c"], name="positive"),
             helper.make_node("If", ["c"], ["branch"], name="choose", then_branch=then, else_branch=other),
             *_layernorm("branch", "y")]
    inits = [("w1", _w(32, 64)), ("b1", _w(64)), ("gamma", 1 + _w(64)), ("beta", _w(64)),
             ("eps", np.float32(1e-5)), ("two", np.float32(2.0)), ("zero", np.float32(0.0))]
    return make_model(nodes, [("x", [4, 32])], [("y", [4, 64])], inits, opset=13)


def _json(run_cli, path, *flags):
    code, stdout, stderr = run_cli("run", path, "--strategy", "greedy", "--json", *flags)
    assert code == 0, stderr
    return json.loads(stdout)


@pytest.mark.parametrize("build, segments, graph", [
    (dense_norm, {"generated": 1, "library": 0}, True),
    (dense_if_norm, {"generated": 2, "library": 1}, False),
])
def test_emulated_cuda_program_equals_ort(run_cli, tmp_path, build, segments, graph):
    """Every kernel in one module, launched in plan order over one arena (replayed from the
    emulated graph capture when all segments are generated), gives ONNX Runtime's outputs."""
    doc = _json(run_cli, save(build(), tmp_path / "m.onnx"), "--backend", "emulate", "--no-tf32", "--check-each")
    assert doc["backend"] == "emulate" and doc["segments"] == segments and doc["cuda_graph"] is graph
    assert doc["max_rel_err"] <= 1e-4 and doc["kernels"] >= 2 and doc["library_steps"] == segments["library"]
    assert 0 < doc["arena_peak_bytes"] < doc["activation_bytes"]
    assert not any(k in doc for k in KEYS)  # correctness only: nothing timed


def test_emulate_prints_its_check_without_timing(run_cli, tmp_path):
    code, stdout, stderr = run_cli("run", save(dense_if_norm(), tmp_path / "m.onnx"), "--strategy", "greedy",
                                   "--backend", "emulate", "--no-tf32")
    assert code == 0, stderr
    assert "correctness only, not timed" in stdout and "no CUDA graph" in stdout
    assert "equal to ONNX Runtime: max rel err" in stdout and "median" not in stdout


def test_emulate_zero_tolerance_names_the_first_differing_kernel(run_cli, tmp_path):
    """Our kernels sum in another order than ONNX Runtime (the LayerNorm's row mean, here): at
    rtol 0 a group differs, and the one line names the first, its kernel and its nodes."""
    code, stdout, stderr = run_cli("run", save(dense_norm(), tmp_path / "m.onnx"), "--strategy", "greedy",
                                   "--backend", "emulate", "--no-tf32", "--rtol", "0")
    assert code == 1 and stdout == ""
    line, = stderr.strip().splitlines()
    assert "plan (CUDA, emulated) program differs from ONNX Runtime" in line, line
    assert re.search(r"group g\d+ \(generated k_\w+: [\w+]+, nodes '\w+'", line), line


def test_one_module_holds_kernels_whose_helpers_share_names(tmp_path):
    """The LayerNorm and Softmax row kernels both define block_reduce; in one module each sits in
    its own namespace, and the module compiles and launches both by their plain names."""
    from fusesearch.api import plan as make_plan
    from fusesearch.backends.codegen import cuda_module
    from fusesearch.pipeline import prepare
    from fusesearch.run import plan_steps

    path = save(dense_norm(), tmp_path / "m.onnx")
    prep = prepare(path)
    kernels = [s.kernel for s in plan_steps(prep.graph, make_plan(path, device="t4", strategy="greedy",
                                                                      prepared=prep)) if s.kernel is not None]
    assert sum("block_reduce(" in k.cuda_source for k in kernels) >= 2
    text = cuda_module(kernels)
    assert all(f'extern "C" __global__ void {k.name}(' in text for k in kernels)
    assert set(emulate.module(kernels)) == {k.name for k in kernels}
    with pytest.raises(ValueError, match="repeat"):
        cuda_module([kernels[0], kernels[0]])
    from fusesearch.backends import nvrtc

    if nvrtc.toolchain_available("nvrtc"):  # the text NVRTC gets on the GPU: each kernel an entry by its name
        result = nvrtc.compile_cuda(text, arch="sm_90", options=("--std=c++17",), compiler="nvrtc")
        assert sorted(r.kernel for r in result.resources) == sorted(k.name for k in kernels)


@pytest.mark.skipif(gpu_available(), reason="a GPU is visible here: --backend cupy runs")
def test_cupy_without_a_gpu_exits_2_with_one_line(run_cli, tmp_path):
    code, stdout, stderr = run_cli("run", save(dense_norm(), tmp_path / "m.onnx"), "--backend", "cupy")
    assert code == 2 and stdout == ""
    line, = stderr.strip().splitlines()
    assert line.startswith("fusesearch: error: --backend cupy: no GPU/CuPy available") and \
        "--backend cpu" in line and "--backend emulate" in line, line


@pytest.mark.parametrize("flags, named", [
    (("--backend", "tpu"), "--backend tpu"),
    (("--backend", "emulate", "-o", "rows.parquet"), "-o: --backend emulate checks correctness only"),
    (("--backend", "emulate", "--device", "host"), "--device host: a plan for a CPU fuses GEMMs and convs as C only"),
])
def test_bad_backend_flags_exit_2(run_cli, tmp_path, flags, named):
    code, stdout, stderr = run_cli("run", save(dense_norm(), tmp_path / "m.onnx"), *flags)
    assert code == 2 and stdout == ""
    line, = stderr.strip().splitlines()
    assert line.startswith("fusesearch: error: ") and named in line, line


# -- on the GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("build, graph", [(dense_norm, True), (dense_if_norm, False)])
def test_cupy_program_equals_ort_and_is_timed(run_cli, tmp_path, build, graph):
    doc = _json(run_cli, save(build(), tmp_path / "m.onnx"), "--backend", "cupy", "--no-tf32", "--repeat", "5",
                "--warmup", "1", "--check-each")
    assert doc["backend"] == "cupy" and doc["cuda_graph"] is graph
    assert doc["max_rel_err"] <= 1e-4 and doc["unfused_max_rel_err"] <= 1e-4
    for key in KEYS:
        t = doc[key]
        assert 0 < t["p20_s"] <= t["median_s"] <= t["p80_s"], (key, t)
    assert doc["ort_provider"] in ("CUDAExecutionProvider", "CPUExecutionProvider")
    assert "torch" in doc  # the PyTorch baselines run beside every CUDA program, or it says why not
    if doc["torch"] != "not installed":
        assert doc["torch"]["device"] == "cuda" and "failed" not in doc["torch"], doc["torch"]
        for key in ("torch_eager", "torch_compile", "torch_compile_max_autotune"):
            assert 0 < doc[key]["p20_s"] <= doc[key]["median_s"] <= doc[key]["p80_s"], (key, doc[key])


def test_emulated_program_with_tensor_core_kernels(run_cli, tmp_path):
    """Planned for an H200 (TF32 allowed), the fused MatMul+Add+GELU of 256 rows is a tensor-core
    kernel in the module (its #include lines first; at a few rows the skinny CUDA-core tile prices
    lower): the program equals ONNX Runtime within the TF32 tolerance, the default --rtol then;
    with --no-tf32 the CUDA-core kernel, held to 1e-4."""
    path = save(dense_gelu(), tmp_path / "m.onnx")
    doc = _json(run_cli, path, "--backend", "emulate", "--device", "h200")
    assert doc["rtol"] == 2e-3 and doc["max_rel_err"] <= 2e-3 and doc["segments"] == {"generated": 1, "library": 0}
    off = _json(run_cli, path, "--backend", "emulate", "--device", "h200", "--no-tf32")
    assert off["rtol"] == 1e-4 and off["max_rel_err"] <= 1e-4
