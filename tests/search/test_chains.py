"""NCHWc chains: a 1x1 conv, its activation and the depthwise conv after it as one kernel
(`schedule.anchor_chain`, product CHAIN), which has no NCHW form. Its C equals ONNX Runtime in
its layout; it is priced as the two kernels it replaces less their middle tensor's traffic; the
exact search finds it from each depthwise conv and runs it blocked (the heuristics and `--layouts
nchw` never do); plan.json records it, `run --plan` runs it, the fused export keeps its ops."""

from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import helper

from fusesearch.backends import cpu
from fusesearch.groups import FusionGroup
from fusesearch.ir.canonicalize import to_proto
from fusesearch.layout import Layout
from fusesearch.lowering import choices, nchwc_choices
from fusesearch.pipeline import prepare
from fusesearch.run import run_plan
from fusesearch.schedule import (
    CHAIN,
    CHAIN_FILTER_FLOATS,
    ChainItems,
    CpuTarget,
    anchor_chain,
    chain_items,
)
from fusesearch.verify import all_values, random_feeds
from tests.backends.test_cpu_nchwc import _runs_blocked
from tests.conftest import make_model, save
from tests.search.test_layouts import DEPTHWISE_SLOW, _plan

needs_cc = pytest.mark.skipif(not cpu.available(), reason="no C compiler")


def _w(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.3


def inverted_residual(tmp_path, xs=(1, 16, 14, 14), expanded=48, k=3, stride=1, residual=False, project=True):
    """x -> 1x1 conv (bias) -> Clip(0, 6) -> depthwise k x k conv (bias, stride) -> Clip(0, 6)
    [-> + r] [-> 1x1 conv back to x's channels]: MobileNetV2's block; names e, m, d, y, out, p."""
    n, cin, h, w = xs
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["e"], kernel_shape=[1, 1]),
             helper.make_node("Clip", ["e", "lo", "hi"], ["m"]),
             helper.make_node("Conv", ["m", "w2", "b2"], ["d"], kernel_shape=[k, k], strides=[stride] * 2,
                              pads=[k // 2] * 4, group=expanded),
             helper.make_node("Clip", ["d", "lo", "hi"], ["y"])]
    inits = [("w1", _w([expanded, cin, 1, 1])), ("b1", _w([expanded], 1)), ("w2", _w([expanded, 1, k, k], 2)),
             ("b2", _w([expanded], 3)), ("lo", np.array(0, np.float32)), ("hi", np.array(6, np.float32))]
    inputs, last = [("x", list(xs))], "y"
    oh, ow = (h + 2 * (k // 2) - k) // stride + 1, (w + 2 * (k // 2) - k) // stride + 1
    if residual:
        inputs.append(("r", [n, expanded, oh, ow]))
        nodes.append(helper.make_node("Add", ["y", "r"], ["out"]))
        last = "out"
    if project:
        nodes.append(helper.make_node("Conv", [last, "w3", "b3"], ["p"], kernel_shape=[1, 1]))
        inits += [("w3", _w([cin, expanded, 1, 1], 4)), ("b3", _w([cin], 5))]
        last = "p"
    return save(make_model(nodes, inputs, [(last, None)], inits), tmp_path / "ir.onnx")


def _graph(path):
    prep = prepare(path)
    canonical = to_proto(prep.canonical)
    return prep.graph, all_values(canonical, random_feeds(canonical, 0))


def _ids(graph, *names):
    return frozenset(n.id for n in graph.nodes if n.outputs[0] in names)


CASES = {  # input shape, expanded channels, depthwise kernel, stride, a residual after it
    "3x3": ((1, 16, 12, 10), 48, 3, 1, False),
    "3x3-stride2-odd": ((1, 16, 13, 11), 40, 3, 2, False),
    "3x3-residual-two-images": ((2, 24, 9, 9), 36, 3, 1, True),
    "5x5-stride2-channels-off-block": ((1, 20, 7, 16), 92, 5, 2, False),
    "wide-rows": ((1, 8, 5, 57), 24, 3, 1, False),
}


@needs_cc
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("lanes", [16, 8], ids=["block16", "block8"])
def test_a_chain_equals_onnx_runtime_in_its_layout(tmp_path, name, lanes):
    """The chain's one kernel, fed and read blocked, equals ONNX Runtime; the tensors between its
    anchors (the 1x1 conv's output and its Clip) are no arguments of it; it has no NCHW form."""
    xs, expanded, k, stride, residual = CASES[name]
    graph, values = _graph(inverted_residual(tmp_path, xs, expanded, k, stride, residual, project=False))
    group = FusionGroup(frozenset(range(len(graph))))
    kernels = nchwc_choices(graph, group, CpuTarget(lanes=lanes))
    assert [k_.schedule.product for k_ in kernels] == [CHAIN]
    kernel = kernels[0]
    assert kernel.schedule.layout_in == kernel.schedule.layout_out == Layout(lanes)
    assert not {"e", "m", "d"} & {*kernel.inputs, *kernel.outputs}
    gk = _runs_blocked(graph, kernel, values)
    assert [a.tensor for a in gk.inputs if len(a.shape) == 5] == ["x", *(["r"] if residual else [])]
    # the source runs the items and tiles the price was computed with (`schedule.ChainItems`)
    items = chain_items(graph, anchor_chain(graph, group.nodes), lanes)
    assert f"groups = {items.c_groups('nt')};" in gk.c_source
    assert f"for (long long ot = t0; ot < (t1 < {items.channel_blocks // items.o_tile}LL" in gk.c_source
    assert [p.tile for p in gk.packed] == [items.o_tile, 1]
    assert not choices(graph, group), "two anchors have no NCHW form"


def test_a_chain_is_priced_as_its_two_kernels_less_their_middle_tensor(tmp_path):
    """At one thread (no row computed twice) and channels in whole blocks: the chain's multiply-adds
    are the expansion's and the depthwise conv's, its reads theirs less the middle tensor the
    depthwise conv read (and the Clips' bounds, which both read, read once), its writes the
    depthwise conv's alone."""
    graph, _ = _graph(inverted_residual(tmp_path, (1, 16, 14, 14), 48, project=False))
    target = CpuTarget(lanes=8)
    (chain,) = nchwc_choices(graph, FusionGroup(frozenset(range(len(graph)))), target)
    (expand,) = nchwc_choices(graph, FusionGroup(_ids(graph, "e", "m")), target)
    (dw,) = nchwc_choices(graph, FusionGroup(_ids(graph, "d", "y")), target)
    middle = graph.tensors["m"].nbytes
    shared = sum(graph.tensors[t].nbytes for t in set(expand.inputs) & set(dw.inputs))
    assert shared == 8 and chain.tc_flops == expand.tc_flops + dw.tc_flops
    assert chain.read_bytes == expand.read_bytes + dw.read_bytes - middle - shared
    assert chain.write_bytes == dw.write_bytes and expand.write_bytes == middle


def test_chain_items_split_the_expanded_channel_blocks():
    """One group of every block per image at one thread; at two, the tiles of expanded blocks
    (the 1x1 conv's register tile) in two contiguous groups, their imbalance from the blocks each
    holds (MobileNetV2's 144 channels at block 8: 9 tiles of 2 blocks, 8 and 10 blocks); images
    share the threads first."""
    items = ChainItems(images=1, channel_blocks=18, o_tile=2)
    assert items.groups(1) == 1 and items.imbalance(1) == 1.0
    assert items.groups(2) == 2 and [items.bounds(g, 2) for g in range(2)] == [(0, 4), (4, 9)]
    assert [items.blocks(g, 2) for g in range(2)] == [8, 10] and items.imbalance(2) == pytest.approx(20 / 18)
    odd = ChainItems(1, 5, 2)  # 40 channels: tiles of 2, 2 and the one block left
    assert [odd.blocks(g, 2) for g in range(2)] == [2, 3] and odd.imbalance(2) == pytest.approx(6 / 5)
    assert ChainItems(4, 12, 2).groups(2) == 1, "images share the threads first"


def test_a_chain_at_two_threads_reads_its_input_once_per_group(tmp_path):
    """Priced for two threads the chain reads its input twice (each group of channel blocks reads
    it all), computes nothing twice, and its imbalance is its groups'."""
    graph, _ = _graph(inverted_residual(tmp_path, (1, 16, 14, 14), 48, project=False))
    whole = FusionGroup(frozenset(range(len(graph))))
    one = nchwc_choices(graph, whole, CpuTarget(lanes=8, threads=1))[0]
    two = nchwc_choices(graph, whole, CpuTarget(lanes=8, threads=2))[0]
    assert two.read_bytes - one.read_bytes == graph.tensors["x"].nbytes and two.tc_flops == one.tc_flops
    assert two.imbalance == ChainItems(1, 6, 2).imbalance(2) == pytest.approx(4 / 3), "3 tiles of 2 blocks: 1 and 2"


def test_what_is_no_chain(tmp_path):
    """A middle op left out, the projection after the depthwise conv (a third anchor), 1x1
    filters past CHAIN_FILTER_FLOATS: no chain."""
    graph, _ = _graph(inverted_residual(tmp_path, (1, 16, 14, 14), 48))
    assert anchor_chain(graph, frozenset(range(len(graph)))) is None, "three anchors"
    whole = frozenset(range(len(graph))) - _ids(graph, "p")
    assert anchor_chain(graph, whole) is not None
    assert anchor_chain(graph, whole - _ids(graph, "y")) is not None, "the activation after it is optional"
    assert anchor_chain(graph, whole - _ids(graph, "m")) is None, "not convex: the Clip between them left out"
    wide = 1 + CHAIN_FILTER_FLOATS // 128
    big, _ = _graph(inverted_residual(tmp_path, (1, 128, 4, 4), -(-wide // 8) * 8, project=False))
    assert anchor_chain(big, frozenset(range(len(big)))) is None


@needs_cc
def test_the_exact_search_runs_the_chain_blocked_and_the_plan_equals_onnx_runtime(tmp_path):
    """CP-SAT takes the expansion, its Clip, the depthwise conv and its Clip as one blocked group
    (the projection apart: a chain ends at the depthwise conv's epilogue); the plan's price is its
    groups' and reorders'; the program equals ONNX Runtime. Greedy and `--layouts nchw` keep
    two kernels."""
    path = inverted_residual(tmp_path, (1, 16, 28, 28), 96, stride=2)
    plan = _plan(path, params=DEPTHWISE_SLOW)
    chains = [g for g in plan.groups if g.kernel.schedule.product == CHAIN]
    assert [frozenset(g.nodes) for g in chains] == [_ids(plan.graph, "e", "m", "d", "y")]
    assert plan.time_s == pytest.approx(sum(g.cost.time_s for g in plan.groups) + sum(r.cost.time_s for r in plan.reorders))
    report = run_plan(prepare(path, keep_original=True), plan, _plan(path, strategy="none"), repeat=1, warmup=0)
    assert report.max_rel_err < 1e-5
    for other in (_plan(path, strategy="greedy", params=DEPTHWISE_SLOW),
                  _plan(path, layouts="nchw", params=DEPTHWISE_SLOW)):
        assert not any(g.kernel.schedule.product == CHAIN for g in other.groups)


@needs_cc
def test_a_plan_json_with_a_chain_runs_and_exports(tmp_path, run_cli):
    """plan.json records the chain (product and layout), the same bytes every time; `--explain`
    says it has no NCHW form, `run --plan` runs it equal to ONNX Runtime and `export` writes its
    ops as one function."""
    import onnx

    from costmodels.profile import Profile, save_profile
    from costmodels.roofline import host_params
    from tests.search.test_layouts import host16

    profile = save_profile(Profile(host16(), host_params().with_updates(**DEPTHWISE_SLOW), backend="cpu"),
                           tmp_path / "profile.json")
    path, out, emit = inverted_residual(tmp_path, (1, 16, 28, 28), 96, stride=2), tmp_path / "plan.json", tmp_path / "f.onnx"
    code, _, err = run_cli("plan", path, "--device", profile, "-o", out, "--workers", "1", "--explain")
    assert code == 0, err
    assert "(no NCHW form)" in err and "conv" in err
    code, _, err = run_cli("plan", path, "--device", profile, "-o", tmp_path / "again.json", "--workers", "1")
    assert code == 0 and (tmp_path / "again.json").read_bytes() == out.read_bytes(), "the same file every time"
    doc = json.loads(out.read_text())
    (chain,) = [g for g in doc["groups"] if g["schedule"]["product"] == CHAIN]
    assert chain["ops"] == ["Conv", "Clip", "Conv", "Clip"]
    assert chain["layout"] == {"in": "NCHW16c", "out": "NCHW16c"}
    code, stdout, err = run_cli("run", path, "--device", profile, "--plan", out, "--repeat", "1", "--warmup", "0",
                                "--json")
    assert code == 0, err
    assert json.loads(stdout)["max_rel_err"] < 1e-5
    code, _, err = run_cli("export", out, path, "--emit", emit)
    assert code == 0, err
    fused = onnx.load(str(emit))
    assert [f.name for f in fused.functions if [n.op_type for n in f.node] == chain["ops"]]
