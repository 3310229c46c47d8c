"""A CPU kernel's thread count is a priced choice: at a target of more than one thread each
generated form also runs on one thread (split "one", its OpenMP region `num_threads(1)`), priced
at one thread's share of the rates plus the one-thread region's cost instead of a team's fork and
barrier, so a kernel whose work is below what a parallel region costs runs on one thread and a
large one keeps its parallel split; the C is written as scheduled and equals ONNX Runtime."""

from __future__ import annotations

from dataclasses import replace as with_

import numpy as np
import pytest
from onnx import helper

from costmodels import DEVICES, DeviceSpec, RooflineModel
from costmodels.roofline import host_params
from fusesearch.backends import cpu
from fusesearch.backends.codegen import generate
from fusesearch.backends.cpu import openmp_threads
from fusesearch.costing import cheapest, device_choices
from fusesearch.lowering import choices
from fusesearch.schedule import ONE_THREAD, CpuTarget
from tests.backends.test_cpu_products import _body, _graph, _whole
from tests.backends.test_cpu_split import _bias_relu, _w

needs_cc = pytest.mark.skipif(not cpu.available(), reason="no C compiler")
REGION_S, SERIAL_S = 5e-6, 0.3e-6  # a 2-thread team's fork and barrier; a one-thread region's call


def _two_threads(serial_s: float = SERIAL_S) -> DeviceSpec:
    """Two threads of a CPU's rates: 100 GFLOP/s, 20 GB/s, no cache curve."""
    return with_(DEVICES["t4"], name="pinned-cpu", kind="cpu", warp_size=16, sm_count=2, launch_overhead_s=REGION_S,
                 serial_launch_overhead_s=serial_s, fp32_flops_per_s=1e11, dram_bytes_per_s=2e10, cache_curve=())


def _softmax(m: int, n: int = 64):
    nodes = [helper.make_node("Mul", ["x", "s"], ["y"]), helper.make_node("Softmax", ["y"], ["out"], axis=-1)]
    return nodes, [("x", [m, n])], [("out", None)], [("s", np.float32(0.125))]


def _tanh(m: int):
    return [helper.make_node("Tanh", ["x"], ["out"])], [("x", [m, 64])], [("out", None)], []


def _layernorm_free_rows(m: int):  # a row reduction and a pointwise tail: the rowwise skeleton
    nodes = [helper.make_node("ReduceMean", ["x"], ["mu"], axes=[-1]), helper.make_node("Sub", ["x", "mu"], ["d"]),
             helper.make_node("Mul", ["d", "g"], ["out"])]
    return nodes, [("x", [m, 48])], [("out", None)], [("g", _w([48]))]


GROUPS = {"gemm": lambda m: _bias_relu(m, k=16, n=32), "softmax": _softmax, "pointwise": _tanh,
          "rows": _layernorm_free_rows}


def test_one_thread_forms_come_last_and_only_above_one_thread():
    """At 2 threads a gemm lists its splits, then each product's one-thread form (imbalance 1,
    `cpu_threads` 1); at one thread nothing is added (the choices, hence the plan, as before)."""
    from tests.test_lowering import graph_of

    graph = graph_of(*_bias_relu(96))
    two = choices(graph, _whole(graph), host=CpuTarget(lanes=16, threads=2))
    forms = [(k.schedule.product, k.schedule.split) for k in two]
    assert forms[-2:] == [("own", ONE_THREAD), ("blas", ONE_THREAD)]
    assert ONE_THREAD not in {s for _, s in forms[:-2]}
    assert [(k.imbalance, k.spec().cpu_threads) for k in two[-2:]] == [(1.0, 1), (1.0, 1)]
    assert all(k.spec().cpu_threads == 0 for k in two[:-2])
    assert two[-1].schedule.to_dict()["split"] == ONE_THREAD
    one = choices(graph, _whole(graph), host=CpuTarget(lanes=16, threads=1))
    assert ONE_THREAD not in {k.schedule.split for k in one} and len(one) == 2
    tanh = graph_of(*_tanh(8))
    assert [k.schedule.split for k in choices(tanh, _whole(tanh), host=CpuTarget(threads=2))] == ["", ONE_THREAD]
    assert [k.schedule.split for k in choices(tanh, _whole(tanh), host=CpuTarget(threads=1))] == [""]


def test_the_one_thread_price():
    """One thread of two: twice the compute and memory time, and the one-thread region's cost as
    its launch; with no such figure (0) the team's, so it never wins."""
    from tests.test_lowering import graph_of

    graph = graph_of(*_bias_relu(96))
    kernels = choices(graph, _whole(graph), host=CpuTarget(lanes=16, threads=2))
    team = next(k for k in kernels if k.schedule.product == "own" and k.schedule.split == "rows")
    alone = next(k for k in kernels if k.schedule.product == "own" and k.schedule.split == ONE_THREAD)
    model = RooflineModel(host_params())
    t, a = model.cost(team.spec(), _two_threads()), model.cost(alone.spec(), _two_threads())
    assert (t.launch_s, a.launch_s) == (REGION_S, SERIAL_S)
    assert a.compute_s == pytest.approx(2 * t.compute_s * team.imbalance) and a.memory_s == pytest.approx(2 * t.memory_s)
    assert model.cost(alone.spec(), _two_threads(0.0)).launch_s == REGION_S
    single = with_(_two_threads(), sm_count=1)  # a one-thread device: the one-thread form is the kernel
    assert model.cost(alone.spec(), single).time_s == model.cost(team.spec(), single).time_s


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_a_small_kernel_runs_on_one_thread_a_large_one_keeps_its_team(name):
    """The cheapest choice at 2 threads: a few rows' kernel, whose work is below a team's fork and
    barrier, on one thread, its region `num_threads(1)`; thousands of rows keep the team, the
    region as before."""
    from tests.test_lowering import graph_of

    device, model = _two_threads(), RooflineModel(host_params())
    small, large = graph_of(*GROUPS[name](4)), graph_of(*GROUPS[name](4096))
    best_small, _ = cheapest(device_choices(small, _whole(small), device), device, model)
    best_large, _ = cheapest(device_choices(large, _whole(large), device), device, model)
    assert best_small.schedule.split == ONE_THREAD and best_large.schedule.split != ONE_THREAD
    assert "#pragma omp parallel num_threads(1)\n" in _body(generate(small, best_small))
    large_body = _body(generate(large, best_large))
    assert "#pragma omp parallel\n" in large_body and "num_threads" not in large_body


@needs_cc
@pytest.mark.parametrize("name", sorted(GROUPS))
def test_one_thread_forms_equal_onnx_runtime_at_two_threads(tmp_path, name):
    """Every one-thread form (and its team form beside it), run with 2 OpenMP threads, equals ONNX
    Runtime."""
    graph, values = _graph(tmp_path, *GROUPS[name](24))
    kernels = [k for k in choices(graph, _whole(graph), host=CpuTarget(lanes=16, threads=2)) if k.impl == "generated"]
    assert ONE_THREAD in {k.schedule.split for k in kernels}
    for kernel in kernels:
        gk = generate(graph, kernel)
        assert ("num_threads(1)" in _body(gk)) == (kernel.schedule.split == ONE_THREAD)
        with openmp_threads(2):
            out = cpu.run(gk, {a.tensor: values[a.tensor] for a in gk.inputs})
        for a in gk.outputs:
            ref = values[a.tensor].astype(np.float64)
            np.testing.assert_allclose(out[a.tensor], ref, rtol=0, atol=1e-4 * max(1.0, float(np.abs(ref).max())),
                                       err_msg=str(kernel.schedule))


def test_a_device_without_the_one_thread_figure_loads():
    """`serial_launch_overhead_s` is optional in a device's JSON (a profile written before it)."""
    data = _two_threads().to_dict()
    assert data["serial_launch_overhead_s"] == SERIAL_S
    del data["serial_launch_overhead_s"]
    assert DeviceSpec.from_dict(data).serial_launch_overhead_s == 0.0


@needs_cc
def test_a_one_thread_region_computes_its_blocks_for_one_thread(tmp_path):
    """`fs_threads()`, which a gemm's and a conv's C divide their blocks by, is the region's team:
    1 in a `num_threads(1)` region of a 2-thread program (one block, as priced), 2 in a team, the
    program's threads outside any region."""
    import re
    import subprocess

    from fusesearch.backends.codegen import c_prelude

    source = "".join(v for v in vars(c_prelude).values() if isinstance(v, str) and "fs_threads(void)" in v)
    helper_c = re.search(r"#include <omp.h>\nstatic inline long long fs_threads\(void\) \{[^}]*\}", source).group(0)
    (tmp_path / "t.c").write_text(
        f"#include <stdio.h>\n{helper_c}\nint main(void) {{\n long long one = 0, team = 0;\n"
        " #pragma omp parallel num_threads(1)\n one = fs_threads();\n #pragma omp parallel\n #pragma omp master\n"
        ' team = fs_threads();\n printf("%lld %lld %lld\\n", one, team, fs_threads());\n return 0;\n}\n')
    subprocess.run([cpu.compiler(), "-fopenmp", "-o", str(tmp_path / "t"), str(tmp_path / "t.c")], check=True)
    out = subprocess.run([str(tmp_path / "t")], capture_output=True, text=True, check=True,
                         env={"OMP_NUM_THREADS": "2", "OMP_DYNAMIC": "false"}).stdout.split()
    assert out == ["1", "2", "2"]


def test_the_lower_bound_stays_below_a_one_thread_plan():
    """The physical bound starts its one call at the cheaper region, so a tiny kernel on one
    thread (cheaper than a team's fork) is still no faster than the bound."""
    from fusesearch.costing import graph_figures
    from tests.test_lowering import graph_of

    graph, device, model = graph_of(*_tanh(4)), _two_threads(), RooflineModel(host_params())
    _, cost = cheapest(device_choices(graph, _whole(graph), device), device, model)
    assert graph_figures(graph, device, model).lower_bound_s <= cost.time_s < REGION_S
