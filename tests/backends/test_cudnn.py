"""cuDNN convs as priced library choices on a GPU (`backends.cudnn`, `lowering.conv_routed`): a
lone 2-D conv is cuDNN's call and a conv + bias + activation group is also cuDNN's one fused graph
("library, fused epilogue"), each priced at the profile's library efficiency; with no cuDNN route
installed the lone conv is the named im2col fallback (its panel's round trip priced), the fused
graph no choice, and the plan says why; the conv group runs in the CUDA program (emulated here:
the fallback's math) equal to ONNX Runtime; on a GPU each route runs equal to ONNX Runtime."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from onnx import helper

from costmodels import RooflineModel
from costmodels.roofline import RooflineParams
from fusesearch.api import for_device, resolve_device
from fusesearch.api import plan as make_plan
from fusesearch.backends import cudnn, emulate
from fusesearch.costing import cheapest, device_choices, kernel_cost
from fusesearch.groups import FusionGroup
from fusesearch.pipeline import prepare
from fusesearch.run import run_emulated
from tests.backends.test_cuda_emulated import rand
from tests.conftest import make_model, save


@pytest.fixture
def route(monkeypatch):
    """Set the conv route for the test (`cudnn.ROUTE_ENV`; None: detected), the cache cleared
    before and after."""
    def set_route(name):
        if name is None:
            monkeypatch.delenv(cudnn.ROUTE_ENV, raising=False)
        else:
            monkeypatch.setenv(cudnn.ROUTE_ENV, name)
        cudnn.conv_route.cache_clear()
        return cudnn.conv_route()

    yield set_route
    cudnn.conv_route.cache_clear()


def conv_bias_relu(tmp_path, n=8, c=64, hw=56, k=64):
    """A 3x3 padded Conv, + a [K, 1, 1] bias constant, ReLU."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "b"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    model = make_model(nodes, [("x", [n, c, hw, hw])], [("y", None)], [("w", rand(k, c, 3, 3)), ("b", rand(k, 1, 1, seed=3))])
    tmp_path.mkdir(parents=True, exist_ok=True)
    return save(model, tmp_path / "conv.onnx")


def on_h100(path, **prepare_args):
    _, spec, params, _ = resolve_device("h100-sxm")
    prep, params = for_device(prepare(path, tf32=True, **prepare_args), spec, params)
    return prep, spec, params


def test_conv_group_choices_and_prices_with_cudnn_on_h100(tmp_path, route):
    """With a cuDNN route: the lone Conv's first choice is cuDNN's call; the Conv + bias + ReLU
    group's choices end with cuDNN's fused graph, its traffic the group's compulsory bytes (x, w,
    the bias read once, y written once: no round trip of the conv's output), on TF32 tensor cores,
    priced at the profile's library efficiency for convs (halving it doubles the compute time),
    and on h100-sxm cheaper than cuDNN's conv alone plus the epilogue's kernel."""
    assert route("cudnn-frontend").cudnn
    prep, spec, params = on_h100(conv_bias_relu(tmp_path))
    graph, model = prep.graph, RooflineModel(params)
    lone = device_choices(graph, FusionGroup(frozenset({0})), spec)
    assert lone[0].impl == "library" and lone[0].schedule.library == "cudnn"
    assert all(k.schedule.library == "" for k in lone[1:])
    group = device_choices(graph, FusionGroup(frozenset(range(3))), spec)
    fused = group[-1]
    assert fused.schedule.library == "cudnn-fused" and fused.impl == "library"
    assert [k.schedule.library for k in group[:-1]] == [""] * (len(group) - 1)
    x, w, b, y = (graph.tensors[t] for t in ("x", "w", "b", "y"))
    assert fused.read_bytes == x.nbytes + w.nbytes + b.nbytes and fused.write_bytes == y.nbytes
    assert fused.tc_flops == lone[0].tc_flops == 2 * 8 * 64 * 56 * 56 * 64 * 9
    cost = kernel_cost(fused, spec, model)
    assert cost.compute_unit == "tf32-tensor-core" and math.isfinite(cost.time_s)
    slower = RooflineParams(**{**params.__dict__, "library_efficiency": {
        **dict(params.library_efficiency), "conv": dict(params.library_efficiency)["conv"] / 2}})
    halved = kernel_cost(fused, spec, RooflineModel(slower))
    scalar = cost.compute_s - fused.tc_flops / (spec.tf32_flops_per_s * dict(params.library_efficiency)["conv"])
    assert halved.compute_s - scalar == pytest.approx(2 * (cost.compute_s - scalar), rel=1e-6)
    epilogue = device_choices(graph, FusionGroup(frozenset({1, 2})), spec)[0]
    apart = kernel_cost(lone[0], spec, model).time_s + kernel_cost(epilogue, spec, model).time_s
    assert cost.time_s < apart
    assert cheapest(group, spec, model)[1].time_s <= cost.time_s


def test_the_im2col_route_plan_names_the_fallback(tmp_path, route):
    """Plans priced for the im2col fallback (`FUSESEARCH_CONV_LIBRARY=im2col`): the lone conv's
    library choice is the fallback, priced with the unfolded panel (N·P x C·9 elements) written
    and read back, the fused graph is no choice; a plan of the lone conv on h100-sxm records
    `library: im2col` and the reason."""
    fallback = route("im2col")
    assert fallback.name == "im2col" and not fallback.cudnn and cudnn.ROUTE_ENV in fallback.reason
    path = conv_bias_relu(tmp_path, n=2, c=8, hw=10, k=16)
    prep, spec, _ = on_h100(path)
    graph = prep.graph
    lone = device_choices(graph, FusionGroup(frozenset({0})), spec)
    panel = 2 * 10 * 10 * 8 * 9 * 4
    x, w, c = (graph.tensors[t] for t in ("x", "w", "c"))
    assert lone[0].schedule.library == "im2col"
    assert lone[0].read_bytes == x.nbytes + w.nbytes + panel and lone[0].write_bytes == c.nbytes + panel
    group = device_choices(graph, FusionGroup(frozenset(range(3))), spec)
    assert all(k.schedule.library != "cudnn-fused" for k in group)
    p = make_plan(path, device="h100-sxm", strategy="greedy", lone_anchors="library", max_group_size=1)
    doc = json.loads(json.dumps(p.to_dict()))
    conv = next(g for g in doc["groups"] if g["ops"] == ["Conv"])
    assert conv["schedule"]["library"] == "im2col" and cudnn.ROUTE_ENV in conv["library_note"]


def test_plans_price_cudnn_whatever_the_planning_machine_has(tmp_path, route, monkeypatch):
    """Unset, the route plans price is cuDNN's Frontend even where neither package is installed
    (a plan is priced for the GPU), so the same flags give the same plan on any machine; a
    program on a machine without a cuDNN route refuses such a plan in one line (BadInput) naming
    the fix, and runs an im2col plan as im2col."""
    from fusesearch.errors import BadInput

    assert route(None).name == "cudnn-frontend"
    path = conv_bias_relu(tmp_path, n=2, c=8, hw=10, k=16)
    p = make_plan(path, device="h100-sxm", strategy="greedy", lone_anchors="library", max_group_size=1)
    conv = next(g for g in p.to_dict()["groups"] if g["ops"] == ["Conv"])
    assert conv["schedule"]["library"] == "cudnn" and "library_note" not in conv
    monkeypatch.setattr(cudnn, "installed_route", lambda: cudnn.ConvRoute("im2col", "no cuDNN here"))
    with pytest.raises(BadInput, match="no cuDNN here.*FUSESEARCH_CONV_LIBRARY=im2col"):
        cudnn.run_route()
    route("im2col")
    assert cudnn.run_route() == "im2col"


def test_a_bad_route_name_is_bad_input(tmp_path, monkeypatch, route, run_cli):
    """`FUSESEARCH_CONV_LIBRARY=cudnn` (not a route): exit 2, one line naming the variable and the
    routes."""
    path = conv_bias_relu(tmp_path, n=1, c=4, hw=6, k=4)
    monkeypatch.setenv(cudnn.ROUTE_ENV, "cudnn")
    cudnn.conv_route.cache_clear()
    code, _, err = run_cli("plan", path, "--device", "h100-sxm")
    assert code == 2 and err.count("\n") == 1 and err.startswith("fusesearch: error: "), err
    assert cudnn.ROUTE_ENV in err and "cudnn-frontend" in err


@pytest.mark.skipif(not emulate.available(), reason="no C++ compiler")
def test_the_fused_cudnn_group_runs_in_the_cuda_program_emulated(tmp_path, route):
    """With a cuDNN route the h100-sxm plan runs the Conv + bias + ReLU as the fused cuDNN graph
    (one library step, no kernel); the program (the emulator's device runs the group's call by the
    fallback's math) equals ONNX Runtime."""
    route("cudnn-frontend")
    path = conv_bias_relu(tmp_path, n=2, c=16, hw=12, k=32)
    prep = prepare(path, tf32=True)
    p = make_plan(path, device="h100-sxm", strategy="greedy", prepared=prep)
    assert [g.kernel.schedule.library for g in p.groups] == ["cudnn-fused"], [g.kernel.schedule for g in p.groups]
    report = run_emulated(prep, p)
    assert report["library_steps"] == 1 and report["kernels"] == 0 and report["max_rel_err"] < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("name", cudnn.ROUTES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_every_route_runs_the_fused_conv_equal_to_onnx_runtime(tmp_path, name, dtype):
    """On the GPU each route (the cuDNN Frontend graph, PyTorch's conv over DLPack-shared buffers,
    im2col + cuBLAS) runs Conv + bias + ReLU on CuPy arrays equal to ONNX Runtime within TF32's /
    FP16's tolerance; a route whose package is missing skips, naming it."""
    from fusesearch.backends import cupy as gpu
    from fusesearch.ir.canonicalize import to_proto
    from fusesearch.verify import all_values

    if not gpu.available():
        pytest.skip(gpu.available().reason)
    module = {"cudnn-frontend": "cudnn", "torch": "torch"}.get(name)
    if module:
        pytest.importorskip(module)
    cupy = gpu._import_cupy()
    prep = prepare(conv_bias_relu(tmp_path, n=2, c=32, hw=14, k=48), tf32=True, dtype=dtype)
    canonical = to_proto(prep.canonical)
    x = rand(2, 32, 14, 14, seed=5).astype(dtype)
    values = all_values(canonical, {"x": x})
    graph = prep.graph
    w, b = (cupy.asarray(graph.constant_value(t)) for t in ("w", "b"))
    y = cupy.empty(graph.tensors["y"].shape, dtype=dtype)
    go = cudnn.conv_runner(name, cupy, cudnn.ConvCall(graph.nodes[0].attrs, "Relu"), cupy.asarray(x), w, b, y)
    go()
    cupy.cuda.get_current_stream().synchronize()
    ref = values["y"].astype(np.float64)
    tol = 2e-3 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(cupy.asnumpy(y).astype(np.float64), ref, rtol=0, atol=tol * max(1.0, np.abs(ref).max()))
