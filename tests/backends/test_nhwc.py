"""Channels last on a GPU (`layout.NHWC`): a tensor-core conv group's NHWC form (K = (r, s, c), its A
tile staged in 16-byte chunks of channels where they are whole, outputs stored as they lie), the
CUDA NCHW <-> NHWC reorder, their prices (the sectors and loads the staging moves in each layout)
and the plan that chooses them; emulated equal to ONNX Runtime in both layouts, compiled by NVRTC
for sm_80 and sm_90 without spills."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import jsonschema
import numpy as np
import pytest
from onnx import helper

from costmodels import RooflineModel
from costmodels.devices import get_device
from costmodels.profile import Profile, save_profile
from costmodels.roofline import RooflineParams
from fusesearch.api import for_device, resolve_device
from fusesearch.backends import cudnn, emulate
from fusesearch.backends.codegen import cuda_module, generate
from fusesearch.backends.codegen.mma import TOLERANCE
from fusesearch.backends.codegen.nhwc import reorder_cuda_kernel
from fusesearch.groups import FusionGroup
from fusesearch.ir.canonicalize import to_proto
from fusesearch.layout import NCHW, NHWC, copy_name, from_blocked, to_blocked
from fusesearch.lowering import choices, nhwc_choices
from fusesearch.pipeline import prepare
from fusesearch.plans import Plan, plan_schema
from fusesearch.run import plan_steps, run_emulated
from fusesearch.schedule import a_load_elements, activation_sectors
from fusesearch.search import search
from fusesearch.search.problem import SearchConfig, SearchProblem
from fusesearch.verify import all_values, random_feeds
from tests.backends.test_cuda_emulated import rand
from tests.conftest import make_model, save

emulated = pytest.mark.skipif(not emulate.available(), reason="no C++ compiler")


@pytest.fixture
def no_cudnn(monkeypatch):
    """Plans priced without cuDNN (`cudnn.ROUTE_ENV` im2col: a conv's library call is im2col +
    cuBLAS), the route's cache cleared before and after."""
    monkeypatch.setenv(cudnn.ROUTE_ENV, "im2col")
    cudnn.conv_route.cache_clear()
    yield
    cudnn.conv_route.cache_clear()


def conv_relu(tmp_path, cin: int, cout: int, k: int, stride: int, hw: int = 7) -> str:
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[k // 2] * 4, strides=[stride] * 2),
             helper.make_node("Relu", ["y"], ["out"])]
    inits = [("w", rand(cout, cin, k, k) * 0.3), ("b", rand(cout, seed=4))]
    tmp_path.mkdir(parents=True, exist_ok=True)
    return save(make_model(nodes, [("x", [2, cin, hw, hw])], [("out", None)], inits), tmp_path / "c.onnx")


def chain(tmp_path, c0: int = 6, c1: int = 40, hw: int = 12, n: int = 2) -> str:
    """3x3 conv + ReLU, 3x3 stride-2 conv + ReLU, then a 1x1 conv + a 3x3 conv's output (the
    residual) + ReLU: 6 input channels (no whole 16-byte chunk of float32), 40 (not a tile)."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["y1"], pads=[1] * 4), helper.make_node("Relu", ["y1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["y2"], pads=[1] * 4, strides=[2, 2]),
             helper.make_node("Relu", ["y2"], ["r2"]),
             helper.make_node("Conv", ["r2", "w3", "b3"], ["y3"]),
             helper.make_node("Conv", ["r2", "w4"], ["y4"], pads=[1] * 4),
             helper.make_node("Add", ["y3", "y4"], ["s"]), helper.make_node("Relu", ["s"], ["out"])]
    inits = [("w1", rand(c1, c0, 3, 3) * 0.3), ("b1", rand(c1, seed=1)), ("w2", rand(c1, c1, 3, 3, seed=2) * 0.1),
             ("b2", rand(c1, seed=3)), ("w3", rand(c1, c1, 1, 1, seed=4) * 0.2), ("b3", rand(c1, seed=5)),
             ("w4", rand(c1, c1, 3, 3, seed=6) * 0.1)]
    tmp_path.mkdir(parents=True, exist_ok=True)
    return save(make_model(nodes, [("x", [n, c0, hw, hw])], [("out", None)], inits), tmp_path / "chain.onnx")


def gpu(path, device="h100-sxm", **prepare_args):
    _, spec, params, _ = resolve_device(device)
    prep, params = for_device(prepare(path, keep_original=True, **prepare_args), spec, params)
    return prep, spec, RooflineModel(params)


def whole(prep) -> FusionGroup:
    return FusionGroup(frozenset(range(len(prep.graph))))


def emulate_nhwc(prep, kernel):
    """The kernel generated and emulated on NHWC copies of ONNX Runtime's inputs; its outputs in
    NCHW beside ONNX Runtime's, within the tensor cores' tolerance."""
    values = all_values(to_proto(prep.canonical), random_feeds(to_proto(prep.canonical), 0))
    gk = generate(prep.graph, kernel)
    out = emulate.run(gk, {a.tensor: to_blocked(values[a.tensor], a.layout) for a in gk.inputs})
    for a in gk.outputs:
        ref = values[a.tensor].astype(np.float64)
        got = from_blocked(out[a.tensor], a.layout, ref.shape[1]).astype(np.float64)
        np.testing.assert_allclose(got, ref, rtol=0, atol=3e-3 * max(1.0, np.abs(ref).max()), err_msg=a.tensor)
    return gk


# -- the kernel -----------------------------------------------------------------------------------

@emulated
@pytest.mark.parametrize("cin,k,stride,chunked", [(8, 3, 1, True), (6, 3, 2, False), (16, 1, 1, True)],
                         ids=["3x3", "3x3-stride2-6ch", "1x1"])
def test_an_nhwc_conv_reads_and_writes_channels_last_equal_to_onnx_runtime(tmp_path, cin, k, stride, chunked):
    """Every mma.sync configuration of the NHWC form: the input and output arguments lie (N, H, W,
    C), the bias as in the model; A staged by 16-byte cp.async of 4 channels where the channels
    are whole chunks (8, 16), element by element where not (6); 20 output channels (a partial
    tile); emulated equal to ONNX Runtime."""
    prep, _, _ = gpu(conv_relu(tmp_path, cin, 20, k, stride), tf32=True)
    forms = nhwc_choices(prep.graph, whole(prep))
    assert forms and {f.schedule.skeleton for f in forms} == {"mma-sync-tf32"}
    assert all(f.schedule.layout_in == f.schedule.layout_out == NHWC for f in forms)
    for form in {f.schedule.tile: f for f in forms if f.schedule.split_k == 1}.values():
        gk = emulate_nhwc(prep, form)
        assert [(a.tensor, a.layout) for a in (*gk.inputs, *gk.outputs)] == [
            ("x", NHWC), ("w", NCHW), ("b", NCHW), ("out", NHWC)]
        assert gk.inputs[0].shape == (2, 7, 7, cin) and gk.c_source == ""  # a GPU schedule: CUDA only
        assert ("fs_cp_async16(&a_dst" in gk.cuda_source) == chunked


@emulated
@pytest.mark.parametrize("dtype,skeleton", [("float16", "mma-sync-f16"), ("bfloat16", "mma-sync-bf16")])
def test_a_half_nhwc_conv_stages_eight_channels_per_copy(tmp_path, dtype, skeleton):
    """The half model's 3x3 conv over 64 channels: 16-byte chunks of 8 halves per pixel and tap,
    equal to ONNX Runtime's half model; its split-K form (one output tile, 18 K steps) too."""
    prep, _, _ = gpu(conv_relu(tmp_path, 64, 24, 3, 1), tf32=True, dtype=dtype)
    forms = nhwc_choices(prep.graph, whole(prep))
    assert a_load_elements(prep.graph, prep.graph.nodes[forms[0].anchor], NHWC, 2) == 8
    for form in (forms[0], next(f for f in forms if f.schedule.split_k > 1)):
        gk = emulate_nhwc(prep, form)
        assert gk.skeleton == skeleton and "fs_cp_async16(&a_dst" in gk.cuda_source


@emulated
@pytest.mark.parametrize("shape", [(2, 40, 12, 12), (1, 3, 5, 7)])
def test_the_cuda_reorder_is_numpys_both_ways(shape):
    """NCHW -> NHWC and back through squares of 32 channels x 32 pixels, the edge squares partial."""
    x = rand(*shape)
    there = reorder_cuda_kernel("t", shape, "float32", NCHW, NHWC)
    nhwc = emulate.run(there, {"t": x})[copy_name("t", NHWC)]
    np.testing.assert_array_equal(nhwc, to_blocked(x, NHWC))
    back = reorder_cuda_kernel("t", shape, "float32", NHWC, NCHW)
    np.testing.assert_array_equal(emulate.run(back, {"t": nhwc})[copy_name("t", NCHW)], x)
    assert there.grid == (-(-shape[2] * shape[3] // 32), -(-shape[1] // 32), shape[0])


def test_the_nhwc_forms_compile_for_sm80_and_sm90_without_spills(tmp_path):
    """The NHWC form's largest and smallest mma.sync tiles (TF32 over whole and partial chunks,
    FP16), and the reorders, compiled by NVRTC for sm_80 and sm_90: registers, no spills, the schedule's
    dynamic shared memory."""
    nvrtc = pytest.importorskip("fusesearch.backends.nvrtc")
    if not nvrtc.toolchain_available():
        pytest.skip("no CUDA compiler (NVRTC or nvcc)")
    kernels, smem = [], {}
    for cin, dtype in ((64, "float32"), (6, "float32"), (64, "float16")):
        prep, _, _ = gpu(conv_relu(tmp_path / f"{cin}{dtype}", cin, 96, 3, 1, hw=28), tf32=True, dtype=dtype)
        forms = [f for f in nhwc_choices(prep.graph, whole(prep)) if f.schedule.split_k == 1]
        for form in (forms[0], forms[-1]):  # the largest tile priced and the smallest
            gk = generate(prep.graph, form, name=f"k{len(kernels)}")
            kernels.append(gk)
            smem[gk.name] = form.schedule.smem_bytes
    kernels += [reorder_cuda_kernel("t", (2, 96, 28, 28), "float32", NCHW, NHWC, name="r0"),
                reorder_cuda_kernel("t", (2, 96, 28, 28), "float16", NHWC, NCHW, name="r1")]
    for arch in nvrtc.ARCHES:
        result = nvrtc.compile_cuda(cuda_module(kernels), arch=arch)
        for gk in kernels:
            res = result.resource(gk.name)
            assert res.registers > 0 and res.spill_store_bytes == res.spill_load_bytes == 0, (gk.name, arch, res)
            assert gk.dynamic_smem == smem.get(gk.name, 0), (gk.name, arch, res)


# -- prices ---------------------------------------------------------------------------------------

def test_the_nhwc_form_is_priced_at_the_sectors_and_loads_its_staging_moves(tmp_path):
    """A 3x3 stride-2 conv over 64 channels at 14x14 outputs: NCHW's A loads run along rows of 14
    pixels at stride 2 (27 floats spanning 4 sectors: 128 bytes for the 56 used), one element each; NHWC's along 64 channels (256 bytes, whole sectors), 4 per
    16-byte load. The same tile is priced with those bytes and loads, and the
    generator writes that schedule as given; with `staging_load_flops` the loads cost scalar work."""
    prep, _, _ = gpu(conv_relu(tmp_path, 64, 96, 3, 2, hw=28), tf32=True)
    anchor = next(n for n in prep.graph.nodes if n.op_type == "Conv")
    assert activation_sectors(prep.graph, anchor, NCHW, 4) == pytest.approx(128 / 56)
    assert activation_sectors(prep.graph, anchor, NHWC, 4) == 1.0
    assert (a_load_elements(prep.graph, anchor, NCHW, 4), a_load_elements(prep.graph, anchor, NHWC, 4)) == (1, 4)
    nchw = {k.schedule.tile: k for k in choices(prep.graph, whole(prep))
            if k.schedule.skeleton == "mma-sync-tf32" and k.schedule.split_k == 1}
    nhwc = {k.schedule.tile: k for k in nhwc_choices(prep.graph, whole(prep)) if k.schedule.split_k == 1}
    assert nchw.keys() == nhwc.keys()
    x = prep.graph.tensors["x"].nbytes
    for tile, a in nchw.items():
        b = nhwc[tile]
        assert a.read_bytes - b.read_bytes == round(x * (128 / 56 - 1))
        loads = 2 * 14 * 14 * 576 * math.ceil(96 / tile[1])  # M x K per column of tiles
        assert (a.staged_loads, b.staged_loads) == (loads, loads // 4) and a.scalar_flops == b.scalar_flops
        assert a.tc_flops == b.tc_flops and replace(a.schedule, layout_in=NHWC, layout_out=NHWC) == b.schedule
        gk = generate(prep.graph, b)
        assert gk.grid == b.schedule.grid and gk.dynamic_smem == b.schedule.smem_bytes


def test_a_gpu_reorder_is_priced_as_the_copy_it_is(tmp_path):
    prep, spec, model = gpu(chain(tmp_path), tf32=True)
    problem = SearchProblem.build(prep.graph, spec, model, SearchConfig(workers=1))
    kernel, cost = problem.legality.reorder("r1", NCHW, NHWC)
    info = prep.graph.tensors["r1"]
    assert (kernel.read_bytes, kernel.write_bytes, kernel.schedule.unit) == (info.nbytes, info.nbytes, "cuda-core")
    assert kernel.schedule.grid == (5, 2, 2) and cost.feasible


# -- the plan -------------------------------------------------------------------------------------

def staging_profile(tmp_path) -> str:
    """An H100 whose profile prices a conv's staging loads (`staging_load_flops`: 16 instructions
    a load, the datasheet model's estimate) as a GPU calibration would fit them."""
    params = RooflineParams(staging_load_flops=16.0)
    return save_profile(Profile(get_device("h100-sxm"), params, backend="cupy"), tmp_path / "h100-staging.json")


def test_where_channels_last_pays_the_solver_runs_the_chain_nhwc(tmp_path, no_cudnn, run_cli):
    """Without cuDNN (the convs' library call is im2col + cuBLAS) the chain's convs run on our
    mma.sync tiles; at 8 x 64 -> 96 channels over 56x56, with each staging load priced, their NCHW
    staging (a strided gather, one element per load) costs more than NHWC's (4 channels a load),
    and the chain pays its two reorders once: every conv group NHWC, the input copied first and
    the output back last; plan.json and --explain say so. With --layouts nchw nothing changes
    layout; with the datasheet model (staging in the efficiencies) the chain stays NCHW."""
    path, device = chain(tmp_path, 64, 96, 56, 8), staging_profile(tmp_path)
    prep, spec, model = gpu(path, tf32=True)
    datasheet = search(prep.graph, spec, model, "cpsat", config=SearchConfig(workers=1))
    assert not datasheet.reorders
    prep, spec, model = gpu(path, device, tf32=True)
    plan = search(prep.graph, spec, model, "cpsat", config=SearchConfig(workers=1, time_limit_s=30))
    convs = [g for g in plan.groups if g.kernel.anchor is not None]
    assert len(convs) == 4 and all(g.kernel.schedule.layout_out == NHWC for g in convs)
    assert [(r.tensor, r.source, r.target) for r in plan.reorders] == [("x", NCHW, NHWC), ("out", NHWC, NCHW)]
    assert plan.layouts == {"choice": "auto", "block": 0, "layout": "NHWC"}
    nchw = search(prep.graph, spec, model, "cpsat", config=SearchConfig(workers=1, time_limit_s=30, layouts="nchw"))
    assert not nchw.reorders and plan.time_s < nchw.time_s
    out = tmp_path / "plan.json"
    code, stdout, err = run_cli("plan", path, "--device", device, "--workers", "1", "--explain", "-o", out)
    assert code == 0, err
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, plan_schema())
    assert doc["layouts"]["layout"] == "NHWC" and [r["to"] for r in doc["layouts"]["reorders"]] == ["NHWC", "NCHW"]
    assert sum(g.get("layout", {}).get("out") == "NHWC" for g in doc["groups"]) == 4
    assert "layouts (--layouts auto): 4 groups in NHWC, 2 reorders" in stdout
    assert "[reorder] 'x' NCHW -> NHWC before the first group" in err and "in NHWC (reads NHWC)" in err


def test_with_cudnn_the_library_keeps_the_chain_nchw(tmp_path):
    """With cuDNN (priced as the library's NCHW call) the same chain stays NCHW: its NHWC forms are
    priced, and do not pay."""
    prep, spec, model = gpu(chain(tmp_path, 64, 96, 56, 8), tf32=True)
    problem = SearchProblem.build(prep.graph, spec, model, SearchConfig(workers=1))
    assert problem.legality.layout == NHWC
    plan = search(prep.graph, spec, model, "cpsat", problem=problem)
    assert not plan.reorders and all(g.kernel.schedule.layout_out == NCHW for g in plan.groups)


def forced_nhwc(prep, spec, model) -> Plan:
    """The cpsat plan's groups with every group that has an NHWC form run in it (the programs are
    checked in that layout whatever the prices say)."""
    problem = SearchProblem.build(prep.graph, spec, model, SearchConfig(workers=1))
    plan = search(prep.graph, spec, model, "cpsat", problem=problem)
    groups = [frozenset(g.nodes) for g in plan.groups]
    return Plan.build(problem.legality, groups, strategy="test", device=spec.name, profile=None, solver=plan.solver,
                      model=plan.model, unfused_time_s=plan.unfused_time_s, lower_bound_s=plan.lower_bound_s,
                      blocked={g for g in groups if problem.legality.blocked(g) is not None},
                      layouts=plan.layouts)


@emulated
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_program_in_both_layouts_equals_onnx_runtime_emulated(tmp_path, dtype, no_cudnn):
    """The chain's CUDA program in NCHW and with every group that has an NHWC form in it (6 input
    channels staged element by element, 40 in chunks; 3x3, 3x3 stride 2, a conv + residual Add +
    ReLU; a group with a prologue, ReLU before its conv, has none and stays NCHW between them):
    the reorders run as CUDA kernels each way, every step checked on its own inputs, outputs equal
    to ONNX Runtime (float32 within TF32's tolerance)."""
    prep, spec, model = gpu(chain(tmp_path), tf32=True, dtype=dtype)
    nchw = search(prep.graph, spec, model, "cpsat", config=SearchConfig(workers=1, layouts="nchw"))
    nhwc = forced_nhwc(prep, spec, model)
    assert sum(g.kernel.schedule.layout_out == NHWC for g in nhwc.groups) >= 3
    assert {(r.source, r.target) for r in nhwc.reorders} == {(NCHW, NHWC), (NHWC, NCHW)}
    steps = plan_steps(prep.graph, nhwc)
    assert steps[0].kernel.name == "fs_reorder0" and steps[0].outputs == (copy_name("x", NHWC),)
    assert steps[-1].outputs == (copy_name("out", NCHW),)
    rtol = TOLERANCE["mma-tf32"] if dtype == "float32" else None
    run_emulated(prep, nchw, check_each=True, rtol=rtol)
    result = run_emulated(prep, nhwc, check_each=True, rtol=rtol)
    assert result["kernels"] == len(nhwc.groups) + len(nhwc.reorders) and result["library_steps"] == 0
