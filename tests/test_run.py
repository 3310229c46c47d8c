"""`fusesearch run`: a plan executed end to end as one program, checked against ONNX Runtime.

Tiny models built in code: an MLP chain (one generated segment), a chain with a data-dependent
If (a library segment between generated ones), a lone If (library only), a float16 conv the
generator refuses (library per node); the CUDA program through the emulator (`--backend emulate`
and `--backend cupy` have their own file, test_run_cuda.py); the arena's greedy placement; the JSON contract; exit 1
naming the first differing kernel when the tolerance is 0 (our dot products sum in another order
than ONNX Runtime's); bad flags exit 2 with one line naming the option."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
from onnx import TensorProto, helper

from fusesearch.backends import cpu
from fusesearch.backends.cpu import ALIGN, PAGE, aligned_empty
from fusesearch.run import Step, plan_arena, segments
from fusesearch.values import usable_cpus
from tests.conftest import make_model, save

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler")
RNG = np.random.default_rng(0)
FAST = ("--strategy", "greedy", "--repeat", "2", "--warmup", "0")
KEYS = ("plan", "unfused", "ort_enable_all", "ort_enable_all_canonical", "ort_enable_extended", "ort_disable_all")


def _w(*shape, dtype=np.float32):
    return (RNG.standard_normal(shape) * 0.3).astype(dtype)


def mlp():
    """x -> MatMul+Add -> Relu -> MatMul -> Tanh -> Reshape -> Softmax: a chain of kernels and a view."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="add1"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu1"),
             helper.make_node("MatMul", ["r", "w2"], ["z"], name="mm2"),
             helper.make_node("Tanh", ["z"], ["t"], name="tanh"),
             helper.make_node("Reshape", ["t", "shape"], ["t2"], name="reshape"),
             helper.make_node("Softmax", ["t2"], ["y"], name="softmax", axis=-1)]
    inits = [("w1", _w(64, 128)), ("b1", _w(128)), ("w2", _w(128, 64)), ("shape", np.array([16, 128], np.int64))]
    return make_model(nodes, [("x", [32, 64])], [("y", [16, 128])], inits)


def with_if():
    """Relu, then an If on the sign of its sum (then: *2, else: a Softmax, which keeps it an If run by ONNX
    Runtime; both capturing r), then Tanh."""
    then = helper.make_graph([helper.make_node("Mul", ["r", "two"], ["a"], name="then_mul")], "then", [],
                             [helper.make_tensor_value_info("a", TensorProto.FLOAT, [8, 16])])
    other = helper.make_graph([helper.make_node("Softmax", ["r"], ["b"], name="else_softmax")], "else", [],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [8, 16])])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("ReduceSum", ["r"], ["s"], name="sum", keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["c"], name="positive"),
             helper.make_node("If", ["c"], ["branch"], name="choose", then_branch=then, else_branch=other),
             helper.make_node("Add", ["branch", "x"], ["u"], name="add"),
             helper.make_node("Tanh", ["u"], ["y"], name="tanh")]
    inits = [("two", np.float32(2.0)), ("zero", np.float32(0.0))]
    return make_model(nodes, [("x", [8, 16])], [("y", [8, 16])], inits, opset=13)


def lone_if():
    """Only an If (a Softmax branch: run by ONNX Runtime): a plan with no generated kernel at all."""
    then = helper.make_graph([helper.make_node("Relu", ["x"], ["a"], name="then_relu")], "then", [],
                             [helper.make_tensor_value_info("a", TensorProto.FLOAT, [4, 4])])
    other = helper.make_graph([helper.make_node("Softmax", ["x"], ["b"], name="else_softmax")], "else", [],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [4, 4])])
    nodes = [helper.make_node("If", ["c"], ["y"], name="choose", then_branch=then, else_branch=other)]
    return make_model(nodes, [("c", [], TensorProto.BOOL), ("x", [4, 4])], [("y", [4, 4])], opset=13)


def half_conv():
    """torch `.half()` export: a float16 Conv+Relu, one generated kernel (half storage, float32 math)."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="/conv/Conv", kernel_shape=[3, 3],
                              pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"], name="/relu/Relu")]
    inits = [("w", _w(8, 3, 3, 3, dtype=np.float16)), ("b", _w(8, dtype=np.float16))]
    return make_model(nodes, [("x", [1, 3, 8, 8], TensorProto.FLOAT16)], [("y", None, TensorProto.FLOAT16)], inits)


def _run_json(run_cli, path, *extra):
    code, stdout, stderr = run_cli("run", path, *FAST, "--json", *extra)
    assert code == 0, stderr
    return json.loads(stdout)


def test_chain_equals_ort_with_valid_json(run_cli, tmp_path):
    doc = _run_json(run_cli, save(mlp(), tmp_path / "mlp.onnx"))
    for key in KEYS:
        t = doc[key]
        assert 0 < t["p20_s"] <= t["median_s"] <= t["p80_s"], (key, t)
    assert doc["threads"] == 1
    assert doc["max_rel_err"] <= 1e-4 and doc["unfused_max_rel_err"] <= 1e-4
    assert doc["segments"] == {"generated": 1, "library": 0}  # one ctypes call runs every kernel
    assert 0 < doc["arena_peak_bytes"] < doc["activation_bytes"]
    assert doc["unfused_arena_peak_bytes"] < doc["activation_bytes"]
    assert doc["ratios"]["plan_vs_unfused"] == pytest.approx(doc["plan"]["median_s"] / doc["unfused"]["median_s"])


def test_threads_reach_the_json_and_are_restored(run_cli, tmp_path):
    """OpenMP's thread count is the caller's again after the run (the kernels' libgomp is this one)."""
    import ctypes

    gomp = ctypes.CDLL("libgomp.so.1")
    before = gomp.omp_get_max_threads()
    threads = 1 if before != 1 else usable_cpus()  # another count than the caller's where the machine has one
    doc = _run_json(run_cli, save(with_if(), tmp_path / "if.onnx"), "--threads", str(threads))
    assert doc["threads"] == threads and doc["max_rel_err"] <= 1e-4
    assert gomp.omp_get_max_threads() == before


def test_if_splits_the_program_and_still_equals_ort(run_cli, tmp_path):
    doc = _run_json(run_cli, save(with_if(), tmp_path / "if.onnx"), "--check-each")
    assert doc["segments"]["library"] == 1 and doc["segments"]["generated"] == 2, doc["segments"]
    assert doc["max_rel_err"] <= 1e-4 and doc["library_steps"] == 1


@pytest.mark.parametrize("build, generated, library", [(lone_if, 0, 1), (half_conv, 1, 0)])
def test_plan_of_only_library_nodes_or_a_float16_model_runs(run_cli, tmp_path, build, generated, library):
    doc = _run_json(run_cli, save(build(), tmp_path / "m.onnx"))
    assert doc["segments"] == {"generated": generated, "library": 1 - generated}
    assert doc["library_steps"] == library and doc["max_rel_err"] <= 1e-3


def conv_transpose(pads=(0, 0, 0, 0)):
    """A decoder step: ConvTranspose 2x2 stride 2, then Relu (U-Net's upsampling)."""
    nodes = [helper.make_node("ConvTranspose", ["x", "w"], ["u"], name="up", strides=[2, 2], pads=list(pads)),
             helper.make_node("Relu", ["u"], ["y"], name="relu")]
    side = 16 - pads[0] - pads[2]
    return make_model(nodes, [("x", [1, 16, 8, 8])], [("y", [1, 8, side, side])], [("w", _w(16, 8, 2, 2))])


def test_a_padded_conv_transpose_runs_in_onnx_runtime_on_the_cpu(run_cli, tmp_path):
    """The C backend writes a ConvTranspose only as a per-output gather loop, so the CPU plan keeps
    it alone (legality) and the program runs it through ONNX Runtime, in both the plan and the
    unfused program; the Relu is generated."""
    doc = _run_json(run_cli, save(conv_transpose((1, 1, 1, 1)), tmp_path / "ct.onnx"))
    assert doc["library_steps"] == 1 and doc["segments"] == {"generated": 1, "library": 1}, doc
    assert doc["max_rel_err"] <= 1e-4 and doc["unfused_max_rel_err"] <= 1e-4


def test_a_conv_transpose_with_kernel_equal_to_stride_is_generated_on_the_cpu(run_cli, tmp_path):
    """U-Net's unpadded 2x2 stride-2 upsampling is a 1x1 Conv and a DepthToSpace after
    canonicalization (`conv_transpose_to_conv`): the whole program is generated, equal to ONNX
    Runtime on the model as given."""
    doc = _run_json(run_cli, save(conv_transpose(), tmp_path / "ct.onnx"))
    assert doc["library_steps"] == 0 and doc["segments"] == {"generated": 1, "library": 0}, doc
    assert doc["max_rel_err"] <= 1e-4 and doc["unfused_max_rel_err"] <= 1e-4


def test_zero_tolerance_names_the_first_differing_kernel(run_cli, tmp_path):
    """Our GEMMs sum their products in another order than ONNX Runtime's: at rtol 0 a group differs
    (which one depends on the rounding of each sum: the first GEMM, its bias added at the store,
    can match ONNX Runtime bit for bit), and the message names the first that does, with its
    kernel and nodes."""
    code, stdout, stderr = run_cli("run", save(mlp(), tmp_path / "mlp.onnx"), *FAST, "--rtol", "0")
    assert code == 1 and stdout == ""
    line, = stderr.strip().splitlines()
    assert "plan program differs from ONNX Runtime" in line, line
    assert re.search(r"plan group g\d+ \(generated k_gemm_[\d_]+: [A-Za-z+]+, nodes '(mm1|add1|relu1|mm2|tanh)'", line), line


def test_check_each_writes_parquet_and_a_table(run_cli, tmp_path):
    out = tmp_path / "rows.parquet"
    code, stdout, stderr = run_cli("run", save(mlp(), tmp_path / "mlp.onnx"), *FAST, "--check-each", "-o", out)
    assert code == 0, stderr
    assert "ONNX Runtime ENABLE_ALL" in stdout and "equal to ONNX Runtime" in stdout
    rows = pd.read_parquet(out)
    assert list(rows["program"]) == list(KEYS) and (rows["median_s"] > 0).all()


def test_plan_file_round_trip(run_cli, tmp_path):
    model = save(mlp(), tmp_path / "mlp.onnx")
    code, _, stderr = run_cli("plan", model, "--device", "host", "--strategy", "greedy", "-o", tmp_path / "p.json")
    assert code == 0, stderr
    doc = _run_json(run_cli, model, "--plan", tmp_path / "p.json")
    assert doc["strategy"] == "file" and doc["max_rel_err"] <= 1e-4


@pytest.mark.parametrize("flags, named", [
    (("--plan", "missing.json"), "--plan missing.json: no such file"),
    (("--repeat", "0"), "--repeat 0"),
    (("--threads", "0"), "--threads 0"),
    (("--warmup", "-1"), "--warmup -1"),
    (("--rtol", "-1"), "--rtol -1"),
    (("--backend", "tpu"), "--backend tpu"),
])
def test_bad_flags_exit_2_with_one_line(run_cli, tmp_path, flags, named):
    code, stdout, stderr = run_cli("run", save(mlp(), tmp_path / "mlp.onnx"), *flags)
    assert code == 2 and stdout == ""
    line, = stderr.strip().splitlines()
    assert line.startswith("fusesearch: error: ") and named in line, line


def _unrunnable(kind: str):
    """Models `run` cannot execute: (model, needles of its one error line)."""
    relu = helper.make_node("Relu", ["x"], ["a"], name="relu")
    if kind == "string input":
        nodes = [helper.make_node("Identity", ["s"], ["t"], name="pass"), relu]
        return make_model(nodes, [("x", [2, 3]), ("s", [2], TensorProto.STRING)],
                          [("a", [2, 3]), ("t", [2], TensorProto.STRING)]), ["node 'pass'", "'s'", "string"]
    if kind == "NonZero":
        nodes = [relu, helper.make_node("NonZero", ["a"], ["nz"], name="nonzero")]
        return (make_model(nodes, [("x", [2, 3])], [("nz", None, TensorProto.INT64)]),
                ["node 'nonzero' (NonZero)", "'nz' of shape 2x", "depends on the values"])
    if kind == "float8 Cast":
        nodes = [relu, helper.make_node("Cast", ["a"], ["c"], name="to8", to=TensorProto.FLOAT8E4M3FN),
                 helper.make_node("Cast", ["c"], ["y"], name="back", to=TensorProto.FLOAT)]
        return make_model(nodes, [("x", [2, 3])], [("y", [2, 3])], opset=19), ["node 'to8' (Cast)", "float8_e4m3fn"]
    seq = helper.make_tensor_sequence_value_info("sq", TensorProto.FLOAT, [2, 3])
    nodes = [helper.make_node("SequenceAt", ["sq", "i"], ["x"], name="at"), relu]
    return (make_model(nodes, [seq], [("a", [2, 3])], [("i", np.array(0, np.int64))]),
            ["input 'sq' is a sequence", "tensor inputs"])


@pytest.mark.parametrize("backend", ["cpu", "emulate"])
@pytest.mark.parametrize("kind", ["string input", "NonZero", "float8 Cast", "sequence input"])
def test_models_run_cannot_execute_exit_2_naming_the_node(run_cli, tmp_path, kind, backend):
    model, needles = _unrunnable(kind)
    code, stdout, stderr = run_cli("run", save(model, tmp_path / "m.onnx"), *FAST, "--device", "t4",
                                   "--backend", backend)
    assert code == 2 and stdout == "", stderr
    line, = stderr.strip().splitlines()
    assert line.startswith("fusesearch: error: ") and all(n in line for n in needles), line


def test_a_corrupt_cached_program_is_built_again(tmp_path):
    """A cached program library or kernel object cut short (a full disk, a killed build) is built
    again on the next run, not loaded (a fresh process: dlopen would reuse a loaded library)."""
    import os
    import subprocess
    import sys

    path = save(mlp(), tmp_path / "mlp.onnx")
    env = {**os.environ, "FUSESEARCH_CACHE": str(tmp_path / "cache"), "PYTHONPATH": os.getcwd()}
    command = [sys.executable, "-m", "fusesearch", "run", path, *FAST, "--device", "t4", "--json"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    built = [p for p in (tmp_path / "cache" / "cpu").iterdir() if p.suffix in (".so", ".o")]
    assert any(p.name.startswith("program-") for p in built)
    for p in built:
        p.write_bytes(p.read_bytes()[:100])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["max_rel_err"] <= 1e-4
    assert all(p.stat().st_size > 100 for p in built)


def test_existing_output_is_kept(run_cli, tmp_path):
    out = tmp_path / "rows.parquet"
    out.write_text("mine")
    code, _, stderr = run_cli("run", save(mlp(), tmp_path / "mlp.onnx"), *FAST, "-o", out)
    assert code == 2 and "--force" in stderr and out.read_text() == "mine"


def test_arena_reuses_memory_on_a_chain():
    """A chain of ten 1 KiB tensors, each read only by the next step: two slots suffice."""
    sizes = {f"t{i}": 1024 for i in range(10)}
    lifetimes = {f"t{i}": (i, i + 1) for i in range(10)}
    offsets, peak = plan_arena(sizes, lifetimes)
    assert peak == 2048 < sum(sizes.values())
    _, flat = plan_arena(sizes, lifetimes, reuse=False)
    assert flat == 10 * 1024


def test_arena_starts_every_tensor_of_a_page_or_more_on_a_page():
    """Tensors of 100 B, 5000 B and 70000 B, all alive together and laid end to end: the large
    ones start on pages (so they fall alike modulo 4 KiB), the small one on a cache line."""
    sizes = {"small": 100, "mid": 5000, "big": 70000}
    lifetimes = dict.fromkeys(sizes, (0, 1))
    for reuse in (True, False):
        offsets, peak = plan_arena(sizes, lifetimes, reuse=reuse)
        assert offsets["mid"] % PAGE == 0 and offsets["big"] % PAGE == 0 and offsets["small"] % ALIGN == 0
        assert peak >= sum(sizes.values()) and len(set(offsets.values())) == 3
    assert aligned_empty(5000).ctypes.data % PAGE == 0 and aligned_empty(100).ctypes.data % ALIGN == 0


def test_arena_never_overlaps_live_tensors():
    rng = np.random.default_rng(1)
    sizes = {f"t{i}": int(rng.integers(1, 5000)) for i in range(60)}
    lifetimes = {}
    for t in sizes:
        first = int(rng.integers(0, 40))
        lifetimes[t] = (first, first + int(rng.integers(0, 10)))
    offsets, peak = plan_arena(sizes, lifetimes)
    for a in sizes:  # a page from a page up (4096 and more here), a cache line below
        assert offsets[a] % (PAGE if sizes[a] >= PAGE else ALIGN) == 0 and offsets[a] + sizes[a] <= peak
        for b in sizes:
            live = lifetimes[a][0] <= lifetimes[b][1] and lifetimes[b][0] <= lifetimes[a][1]
            if a < b and live:
                assert offsets[a] + sizes[a] <= offsets[b] or offsets[b] + sizes[b] <= offsets[a], (a, b)


def conv_pool():
    """Conv+Relu (generated) then a MaxPool over an 81-tap window (not unrolled by the generator:
    the GPU library path) then Flatten and Sigmoid."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[9, 9]),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
             helper.make_node("Sigmoid", ["f"], ["y"], name="sigmoid")]
    inits = [("w", _w(4, 3, 3, 3)), ("b", _w(4))]
    return make_model(nodes, [("x", [1, 3, 10, 10])], [("y", [1, 16])], inits, opset=13)


@pytest.mark.parametrize("build", [mlp, conv_pool])
def test_cuda_program_through_the_emulator_equals_ort(tmp_path, build):
    """The CUDA sources, launched in plan order with their own grids over one arena (the emulator
    runs them on host threads), give ONNX Runtime's outputs; the large MaxPool goes through arraylib."""
    from fusesearch.api import plan as make_plan
    from fusesearch.backends import emulate
    from fusesearch.pipeline import prepare
    from fusesearch.run import run_emulated

    if not emulate.available():
        pytest.skip("no C++ compiler")
    path = save(build(), tmp_path / "m.onnx")
    prep = prepare(path)
    result = run_emulated(prep, make_plan(path, device="t4", strategy="greedy", prepared=prep), check_each=True)
    assert result["max_rel_err"] <= 1e-4
    assert result["segments"]["generated"] >= 1
    assert result["segments"]["library"] == (build is conv_pool)


def test_a_gpu_plans_lone_anchors_run_as_the_library_calls_it_priced(tmp_path, monkeypatch):
    """A GPU plan prices a lone MatMul as the library's call (cuBLAS): the CUDA program runs it
    through `arraylib` on the device's buffers (cupy on a GPU, numpy in the emulator here), not as
    our tiled kernel, and still gives ONNX Runtime's outputs; with library steps between its
    kernels the program is launched step by step, not captured."""
    from fusesearch.api import plan as make_plan
    from fusesearch.backends import arraylib, emulate
    from fusesearch.pipeline import prepare
    from fusesearch.run import plan_steps, run_emulated

    if not emulate.available():
        pytest.skip("no C++ compiler")
    path = save(mlp(), tmp_path / "m.onnx")
    prep = prepare(path)
    none = make_plan(path, device="t4", strategy="none", prepared=prep)
    products = [s for s in plan_steps(prep.graph, none) if prep.graph.nodes[s.nodes[0]].op_type in ("MatMul", "Gemm")]
    assert len(products) == 2 and all(s.how == "library" and s.kernel is None for s in products)
    calls = []
    real = arraylib.run
    monkeypatch.setattr(arraylib, "run", lambda xp, op_type, *a: calls.append(op_type) or real(xp, op_type, *a))
    result = run_emulated(prep, none, check_each=True)
    assert result["max_rel_err"] <= 1e-4 and result["cuda_graph"] is False
    assert result["library_steps"] >= 2 and len(calls) >= len(products)
    assert set(calls) == {prep.graph.nodes[s.nodes[0]].op_type for s in products}  # every run of them by arraylib


def test_cuda_program_runs_an_if_through_onnx_runtime(tmp_path):
    """A node with no generated kernel (If) runs through ONNX Runtime between the kernels: the
    program is launched one by one, not captured as a CUDA graph."""
    from fusesearch.api import plan as make_plan
    from fusesearch.backends import emulate
    from fusesearch.pipeline import prepare
    from fusesearch.run import run_emulated

    if not emulate.available():
        pytest.skip("no C++ compiler")
    path = save(with_if(), tmp_path / "if.onnx")
    prep = prepare(path)
    result = run_emulated(prep, make_plan(path, device="t4", strategy="greedy", prepared=prep))
    assert result["segments"] == {"generated": 2, "library": 1} and result["cuda_graph"] is False
    assert result["max_rel_err"] <= 1e-4


def test_measure_end_to_end_adds_the_run(run_cli, tmp_path):
    rows = tmp_path / "rows.parquet"
    code, stdout, stderr = run_cli("measure", save(mlp(), tmp_path / "mlp.onnx"), "--strategy", "greedy",
                                   "--budget", "0.01", "--end-to-end", "--json", "-o", rows)
    assert code == 0, stderr
    doc = json.loads(stdout)
    assert doc["totals"]["measured_s"] > 0  # measure's own figures stay
    whole = doc["end_to_end"]
    assert all(whole[k]["median_s"] > 0 for k in KEYS) and whole["max_rel_err"] <= 1e-4
    # -o: a row per kernel, each also carrying the run's figures, named by their JSON key path
    frame = pd.read_parquet(rows)
    assert len(frame) == len(doc["groups"]) + frame["plan"].eq("unfused").sum()
    for k in KEYS:
        for stat in ("median_s", "p20_s", "p80_s"):
            assert (frame[f"end_to_end_{k}_{stat}"] == whole[k][stat]).all()
    for key in ("threads", "arena_peak_bytes", "activation_bytes", "max_rel_err"):
        assert (frame[f"end_to_end_{key}"] == whole[key]).all()
    assert (frame["end_to_end_segments_generated"] == whole["segments"]["generated"]).all()
    assert (frame["end_to_end_ratios_plan_vs_unfused"] == whole["ratios"]["plan_vs_unfused"]).all()
    assert "end_to_end_model" not in frame and frame["max_rel_err"].notna().all()  # each kernel's own stays
    code, _, stderr = run_cli("measure", save(mlp(), tmp_path / "mlp.onnx"), "--backend", "cupy", "--end-to-end")
    assert code == 2 and "--end-to-end" in stderr


def test_aliases_never_split_a_segment():
    def step(i, how):
        return Step(i, how, (i,), (), ())

    hows = ["alias", "generated", "alias", "generated", "library", "alias", "library", "generated"]
    runs = segments([step(i, how) for i, how in enumerate(hows)])
    assert [(kind, [s.group for s in run]) for kind, run in runs] == [
        ("generated", [1, 2, 3]), ("library", [4, 5, 6]), ("generated", [7])]


def test_zoo_bert_small_equals_ort_step_by_step(run_cli):
    doc = _run_json(run_cli, "zoo:bert-small", "--dim", "seq=16", "--check-each")
    assert doc["max_rel_err"] <= 1e-4 and doc["segments"]["generated"] >= 1
    assert doc["arena_peak_bytes"] <= 0.6 * doc["activation_bytes"]


def test_a_plan_whose_convs_read_packed_filters_equals_ort(run_cli, tmp_path):
    """Fused convs whose filters are packed once (3x3 convs: their band product packs them): the
    program packs them when it is built (the driver's fs_pack), every call reads the packed copy,
    and the whole plan equals ONNX Runtime."""
    import fusesearch
    from fusesearch.backends.codegen import generate

    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], kernel_shape=[3, 3], pads=[1] * 4, strides=[2, 2]),
             helper.make_node("Add", ["c2", "s"], ["a2"]), helper.make_node("Relu", ["a2"], ["out"])]
    path = save(make_model(nodes, [("x", [1, 8, 6, 6]), ("s", [1, 40, 3, 3])], [("out", None)],
                           [("w1", _w(40, 8, 3, 3)), ("b1", _w(40)), ("w2", _w(40, 40, 3, 3))]), tmp_path / "convs.onnx")
    p = fusesearch.plan(path, device="host", strategy="greedy")
    packed = [generate(p.graph, g.kernel).packed for g in p.groups if g.kernel.impl == "generated"]
    assert any(packed)  # a fused conv reads its filters packed
    doc = _run_json(run_cli, path)
    assert doc["max_rel_err"] <= 1e-4 and doc["segments"]["generated"] >= 1


def test_a_profiled_program_times_each_kernel_and_computes_the_same(tmp_path):
    """`Program(profile=True)` (benchmarks/bench_program.py): each generated group's seconds inside
    the program, summed over runs, positive and no more than the runs' wall time; `reset` starts
    again from zero; the outputs are the unprofiled program's. A program built without it refuses."""
    import time

    import onnx

    from fusesearch.api import plan as make_plan
    from fusesearch.ir.canonicalize import to_proto
    from fusesearch.pipeline import prepare
    from fusesearch.run import Program, plan_steps
    from fusesearch.verify import random_feeds

    path = save(mlp(), tmp_path / "mlp.onnx")
    prep = prepare(path)
    plan = make_plan(path, device="host", strategy="greedy", prepared=prep)
    canonical = to_proto(prep.canonical)
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in canonical.graph.initializer}
    feeds = random_feeds(canonical, 0)
    steps = plan_steps(prep.graph, plan)
    plain, profiled = (Program(prep.graph, canonical, steps, weights, 1, profile=p) for p in (False, True))
    expected = plain(feeds)
    start = time.perf_counter()
    for _ in range(3):
        got = profiled(feeds)
    wall = time.perf_counter() - start
    seconds = profiled.kernel_seconds(reset=True)
    generated = sorted(s.group for s in steps if s.how == "generated")
    assert sorted(seconds) == generated and len(generated) >= 2
    assert all(s > 0 for s in seconds.values()) and sum(seconds.values()) <= wall
    assert all(s == 0 for s in profiled.kernel_seconds().values())
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value)
    with pytest.raises(ValueError, match="profile=True"):
        plain.kernel_seconds()


def test_a_program_rebinds_new_inputs_and_returns_fresh_outputs(tmp_path):
    """A Program binds an input array once and keeps its pointer while the same array comes
    back (an array changed in place is read afresh); a new array, or one it must convert
    (float64, not contiguous), is bound anew; each call's outputs are copies the next run
    does not overwrite. Each result equals ONNX Runtime's on those values."""
    import onnx

    from fusesearch.api import plan as make_plan
    from fusesearch.ir.canonicalize import to_proto
    from fusesearch.pipeline import prepare
    from fusesearch.run import Program, plan_steps
    from fusesearch.verify import run as ort_run

    path = save(mlp(), tmp_path / "mlp.onnx")
    prep = prepare(path)
    plan = make_plan(path, device="host", strategy="greedy", prepared=prep)
    canonical = to_proto(prep.canonical)
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in canonical.graph.initializer}
    program = Program(prep.graph, canonical, plan_steps(prep.graph, plan), weights, 1)
    x = _w(32, 64)
    first = program({"x": x})
    x *= -2.0  # the same array, changed in place
    second = program({"x": x})
    wide = _w(32, 64).astype(np.float64)
    fresh = program({"x": wide})  # converted to float32 and bound anew
    strided = np.asfortranarray(_w(32, 64))
    last = program({"x": strided})
    assert not np.array_equal(first["y"], second["y"])  # the earlier copy kept its values
    for values, out in zip([x / -2.0, x, wide, strided], [first, second, fresh, last], strict=True):
        want = ort_run(path, {"x": np.ascontiguousarray(values, dtype=np.float32)})["y"]
        np.testing.assert_allclose(out["y"], want, rtol=1e-4, atol=1e-5)
    # an ONNX Runtime step between kernels binds the arena tensors it reads once: each call's
    # values reach it (the If's condition and the Relu it captures, both written by our kernels)
    path = save(with_if(), tmp_path / "if.onnx")
    prep = prepare(path)
    plan = make_plan(path, device="host", strategy="greedy", prepared=prep)
    canonical = to_proto(prep.canonical)
    steps = plan_steps(prep.graph, plan)
    assert any(s.how == "library" for s in steps)
    program = Program(prep.graph, canonical, steps, {t.name: onnx.numpy_helper.to_array(t)
                                                     for t in canonical.graph.initializer}, 1)
    x = np.abs(_w(8, 16)) + 0.1
    for change in (None, -1.0, -3.0):  # the then branch, the else branch, the then branch again
        if change is not None:
            x *= change
        got = program({"x": x})["y"]
        np.testing.assert_allclose(got, ort_run(path, {"x": x.copy()})["y"], rtol=1e-4, atol=1e-5)


def test_a_lone_anchor_runs_as_its_plan_priced_it(tmp_path):
    """On the CPU a program runs what its plan priced: with the default efficiencies the library's
    GEMM and ours cost the same and the unfused plan (strategy none) keeps the MLP's lone MatMuls
    as our C (generated steps); with efficiencies that price the library's faster it calls the
    library, and the program runs them in ONNX Runtime (library steps) and still equals it."""
    from costmodels import RooflineModel, host_cpu
    from fusesearch.pipeline import prepare
    from fusesearch.run import plan_steps, run_plan
    from fusesearch.search import search

    prep = prepare(save(mlp(), tmp_path / "mlp.onnx"))
    graph = prep.graph
    products = [(n.id,) for n in graph.nodes if n.op_type in ("MatMul", "Gemm")]
    assert len(products) == 2
    fast_library = RooflineModel(RooflineModel().params.with_updates(
        **{"library_efficiency.gemm": 0.95, "tc_efficiency.gemm": 0.2}))
    for model, how in ((RooflineModel(), "generated"), (fast_library, "library")):
        none = search(graph, host_cpu(), model, "none")
        steps = {s.nodes: s.how for s in plan_steps(graph, none)}
        assert [steps[p] for p in products] == [how, how]
        assert none.unfused_time_s == pytest.approx(none.time_s, rel=1e-12)  # the plan's reference is none's
    report = run_plan(prep, none, none, time_it=False)
    assert report.library_steps == 2 and report.max_rel_err < 1e-4


def test_a_segment_runs_its_team_kernels_in_one_region_and_a_one_thread_kernel_alone(tmp_path):
    """At 2 threads the two gemm kernels run on the team and share one OpenMP region, each called
    by every member (`<name>_team`), a barrier between them; the tiny Tanh, priced on one thread,
    is called alone (its own `num_threads(1)` region) so no team waits on it. The program, plain
    and profiled, equals ONNX Runtime at 2 threads, and so does one with a region per kernel
    (`shared=False`, `benchmarks/bench_regions.py`)."""
    import onnx

    from fusesearch.api import plan as make_plan
    from fusesearch.ir.canonicalize import to_proto
    from fusesearch.pipeline import prepare
    from fusesearch.run import Program, plan_steps, restore_threads
    from fusesearch.verify import run as ort_run

    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu1"),
             helper.make_node("MatMul", ["r", "w2"], ["z"], name="mm2"),
             helper.make_node("Tanh", ["s"], ["u"], name="small"),
             helper.make_node("Relu", ["z"], ["y"], name="last")]
    path = save(make_model(nodes, [("x", [32, 64]), ("s", [1, 64])], [("y", [32, 64]), ("u", [1, 64])],
                           [("w1", _w(64, 128)), ("w2", _w(128, 64))]), tmp_path / "mix.onnx")
    prep = prepare(path)
    steps = plan_steps(prep.graph, make_plan(path, device="host", strategy="greedy", prepared=prep, threads=2))
    kernels = [s.kernel for s in steps if s.kernel is not None]
    assert [k.c_threads for k in kernels] == [0, 0, 1], [(k.name, k.c_threads) for k in kernels]
    team, alone = kernels[:2], kernels[2]
    assert all(f"void {k.name}_team(" in k.c_source for k in team) and f"void {alone.name}_team(" not in alone.c_source
    canonical = to_proto(prep.canonical)
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in canonical.graph.initializer}
    feeds = {"x": _w(32, 64), "s": _w(1, 64)}
    want = ort_run(path, {k: v.copy() for k, v in feeds.items()})
    try:
        for profile in (False, True):
            program = Program(prep.graph, canonical, steps, weights, 2, profile=profile)
            driver = program.driver([steps])
            segment = driver[driver.index("void fs_segment_0("):]
            assert segment.count("#pragma omp parallel") == 1 and segment.count("#pragma omp barrier") == 1 + profile * 2
            assert all(segment.count(f"{k.name}_team(") == 1 for k in team) and f" {alone.name}(" in segment
            assert segment.index(f"{team[1].name}_team(") < segment.index("    }\n") < segment.index(f" {alone.name}(")
            got = program(feeds)
            for name in ("y", "u"):
                np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5)
            if profile:
                assert sorted(program.kernel_seconds()) == sorted(s.group for s in steps if s.kernel is not None)
        apart = Program(prep.graph, canonical, steps, weights, 2, shared=False)  # a region per kernel
        driver = apart.driver([steps])
        assert "#pragma omp" not in driver and all(f" {k.name}(" in driver for k in kernels)
        np.testing.assert_allclose(apart(feeds)["y"], want["y"], rtol=1e-4, atol=1e-5)
    finally:
        restore_threads()
