"""NCHWc conv kernels: a conv group in the target's blocked layout is a schedule choice (product
"nchwc", `Schedule.layout_in`/`layout_out`), priced with its padded traffic, and its C, fed and
read in that layout, equals ONNX Runtime (the reference's inputs and outputs reordered here, by
numpy, `layout.to_blocked`/`from_blocked`): 1x1, k x k, strided, depthwise, with a bias, an
activation and a residual Add, channel counts that fill no whole block."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from onnx import helper

from costmodels import DEVICES, RooflineModel, RooflineParams
from fusesearch.backends import cpu
from fusesearch.backends.codegen import CodegenRefused, generate
from fusesearch.backends.codegen.cpu_conv_nchwc import reorder_kernel
from fusesearch.costing import kernel_cost
from fusesearch.groups import FusionGroup
from fusesearch.ir.canonicalize import to_proto
from fusesearch.layout import NCHW, Layout, from_blocked, to_blocked
from fusesearch.lowering import choices, nchwc_choices, reorder
from fusesearch.pipeline import prepare
from fusesearch.schedule import CpuTarget, nchwc_conv, nchwc_items
from fusesearch.verify import all_values, random_feeds
from tests.conftest import make_model, save

needs_cc = pytest.mark.skipif(not cpu.available(), reason="no C compiler")
AVX512, AVX2 = CpuTarget(lanes=16), CpuTarget(lanes=8)


def _w(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.3


def _conv_group(tmp_path, xs, cout, k, stride, *, depthwise=False, residual=False, act="Relu"):
    """Conv (bias) -> activation [-> + r] as one group, its graph and ONNX Runtime's values."""
    cin = xs[1]
    group = cin if depthwise else 1
    ws = [cout, cin // group, k, k]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[k, k], strides=[stride] * 2,
                              pads=[k // 2] * 4, group=group)]
    last = "y"
    if act:
        nodes.append(helper.make_node(act, ["y"], ["a"]))
        last = "a"
    inputs = [("x", xs)]
    if residual:
        ho = (xs[2] + 2 * (k // 2) - k) // stride + 1
        wo = (xs[3] + 2 * (k // 2) - k) // stride + 1
        inputs.append(("r", [xs[0], cout, ho, wo]))
        nodes.append(helper.make_node("Add", [last, "r"], ["out"]))
        last = "out"
    model = make_model(nodes, inputs, [(last, None)], [("w", _w(ws)), ("b", _w([cout], 1))])
    prep = prepare(save(model, tmp_path / "m.onnx"))
    canonical = to_proto(prep.canonical)
    return prep.graph, all_values(canonical, random_feeds(canonical, 0))


def _whole(graph) -> FusionGroup:
    return FusionGroup(frozenset(range(len(graph))))


def _runs_blocked(graph, kernel, values, threads: int = 0):
    """The kernel run on its inputs as they lie under its schedule (with `threads` OpenMP threads,
    0: as set); its outputs back in NCHW equal ONNX Runtime's, padded lanes zero."""
    from fusesearch.backends.cpu import openmp_threads

    gk = generate(graph, kernel)
    assert "fs_vb" in gk.c_source
    feeds = {}
    for a in gk.inputs:
        v = values[a.tensor]
        feeds[a.tensor] = to_blocked(v, Layout(a.shape[-1])) if len(a.shape) == 5 else v
    with openmp_threads(threads):
        out = cpu.run(gk, feeds)
    for a in gk.outputs:
        ref = values[a.tensor].astype(np.float64)
        assert len(a.shape) == 5, "every output of an NCHWc conv group lies blocked"
        layout = Layout(a.shape[-1])
        got = from_blocked(out[a.tensor], layout, ref.shape[1])
        scale = max(1.0, float(np.max(np.abs(ref))))
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * scale, err_msg=a.tensor)
        padded = out[a.tensor].transpose(0, 1, 4, 2, 3).reshape(ref.shape[0], -1, *ref.shape[2:])[:, ref.shape[1]:]
        assert not padded.any(), "padded channels hold zeros"
    return gk


CASES = {  # xs, cout, k, stride, depthwise, residual, activation
    "1x1": ([1, 32, 7, 7], 64, 1, 1, False, False, "Relu"),
    "1x1-residual-partial-blocks": ([1, 24, 9, 5], 40, 1, 1, False, True, None),
    "3x3": ([1, 16, 10, 12], 32, 3, 1, False, True, "Relu"),
    "3x3-partial": ([2, 20, 8, 8], 24, 3, 1, False, False, "Sigmoid"),
    "3x3-stride2": ([1, 32, 15, 14], 48, 3, 2, False, False, "Relu"),
    "1x1-stride2": ([1, 32, 14, 14], 64, 1, 2, False, False, None),
    "5x5": ([1, 16, 9, 9], 16, 5, 1, False, False, "Relu"),
    "depthwise-3x3": ([1, 48, 14, 14], 48, 3, 1, True, False, "Relu"),
    "depthwise-3x3-stride2-partial": ([1, 40, 13, 12], 40, 3, 2, True, False, "Relu"),
    "depthwise-5x5-residual": ([1, 32, 7, 7], 32, 5, 1, True, True, None),
    "image-3x3-stride2": ([1, 3, 17, 16], 32, 3, 2, False, False, "Clip"),
    "image-7x7-stride2": ([2, 3, 20, 20], 24, 7, 2, False, False, "Relu"),
    # the register tile's edges: rows wider than no whole strip (9 of 8 or 6 pixels), the last
    # block of rows shorter, a tile of fewer output blocks than the widest, input blocks in passes
    # (a 1x1 over 10 blocks of 16: 8 then 2), channels off the block, a residual at stride 2
    "3x3-pad1-strip-edges-residual": ([1, 32, 8, 9], 48, 3, 1, False, True, "Relu"),
    "1x1-input-passes-rest-tile": ([1, 160, 5, 6], 80, 1, 1, False, True, "Relu"),
    "3x3-stride2-channels-off-residual": ([1, 40, 13, 11], 56, 3, 2, False, True, None),
    "3x3-7x7-deep": ([1, 96, 7, 7], 96, 3, 1, False, True, "Relu"),
    # strided 1x1 convs, their blocks' pixels copied together first: several blocks of rows
    # (an odd side), two images, channels off the block with a residual, a stride of 3
    "1x1-stride2-row-blocks-odd": ([2, 16, 41, 39], 24, 1, 2, False, False, "Relu"),
    "1x1-stride2-channels-off-residual": ([1, 40, 13, 11], 56, 1, 2, False, True, None),
    "1x1-stride3": ([1, 32, 10, 11], 40, 1, 3, False, False, "Sigmoid"),
}


@needs_cc
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("target", [AVX512, AVX2], ids=["block16", "block8"])
def test_nchwc_conv_groups_equal_onnx_runtime_in_their_layout(tmp_path, name, target):
    xs, cout, k, stride, depthwise, residual, act = CASES[name]
    graph, values = _conv_group(tmp_path, xs, cout, k, stride, depthwise=depthwise, residual=residual, act=act)
    (kernel,) = nchwc_choices(graph, _whole(graph), target)
    block = target.channel_block
    assert kernel.schedule.product == "nchwc"
    image = xs[1] < block  # an image's few channels are read where they lie, in NCHW
    assert kernel.schedule.layout_out == Layout(block)
    assert kernel.schedule.layout_in == (NCHW if image else Layout(block))
    assert kernel.template == ("depthwise" if depthwise else "conv_disjoint" if k == 1 else "conv")
    gk = _runs_blocked(graph, kernel, values)
    assert gk.packed and gk.packed[0].block == block  # the filters packed once, in blocks
    assert "FS_VB_FMA(" in gk.c_source  # one FMA per filter vector and input, at the block's width
    if not (depthwise or image) and xs[1] % block:  # the last input block's zero lanes are skipped
        assert f"(icb < {xs[1] // block}LL ? {block} : {xs[1] % block})" in gk.c_source


@needs_cc
def test_a_dense_tile_reads_its_filters_in_passes_over_the_input_blocks(tmp_path):
    """A 1x1 conv over 10 input blocks of 16 runs them in passes of `nchwc_chunk` (8: the tile's
    filters for them within NCHWC_SLICE_FLOATS), its 5 output blocks as a tile of 4 and one of 1,
    the filters packed per tile in the order the tile reads them: the kernel equals ONNX Runtime,
    and the packed filters are the model's in that order."""
    from fusesearch.schedule import NCHWC_SLICE_FLOATS, nchwc_chunk

    graph, values = _conv_group(tmp_path, [1, 160, 5, 6], 80, 1, 1, act="Relu")
    (kernel,) = nchwc_choices(graph, _whole(graph), AVX512)
    assert nchwc_chunk(16, 4, 16, 1) == 8 and 4 * 16 * 16 * 8 == NCHWC_SLICE_FLOATS
    gk = _runs_blocked(graph, kernel, values)
    assert "c0 += 8LL" in gk.c_source and "if (ot < 1LL)" in gk.c_source
    (pack,) = gk.packed
    assert pack.tile == 4
    packed = cpu.runner(gk, {a.tensor: values[a.tensor] for a in gk.inputs}).packed[0]  # packed by its _pack
    w = values["w"].reshape(80, 160)
    panel = 10 * 16 * 16  # per output block: 10 input blocks x 16 lanes x 16 outputs
    first = packed[: 4 * panel].reshape(10, 16, 4, 16)  # the tile of 4: input block, lane, the 4 x 16 outputs
    np.testing.assert_array_equal(first.transpose(2, 3, 0, 1).reshape(64, 160), w[:64])
    last = packed[4 * panel:].reshape(10, 16, 16)  # the tile of 1
    np.testing.assert_array_equal(last.transpose(2, 0, 1).reshape(16, 160), w[64:])


@needs_cc
def test_a_pass_reads_at_most_eight_input_blocks(tmp_path):
    """At block 8 a 1x1 tile of 2 output blocks has filters for 64 input blocks within
    NCHWC_SLICE_FLOATS, but a pass reads NCHWC_PASS_BLOCKS (8) of them: each input block is a
    stream of its own. 200 channels: passes of 8, 8, 8 and 1 blocks, equal to ONNX Runtime."""
    from fusesearch.schedule import NCHWC_PASS_BLOCKS, NCHWC_SLICE_FLOATS, nchwc_chunk

    assert NCHWC_SLICE_FLOATS // (2 * 8 * 8) == 64 and nchwc_chunk(8, 2, 8, 1) == NCHWC_PASS_BLOCKS == 8
    assert nchwc_chunk(8, 2, 8, 9) == 7  # a 3x3's slice allows fewer
    graph, values = _conv_group(tmp_path, [1, 200, 5, 6], 16, 1, 1, act="Relu")
    (kernel,) = nchwc_choices(graph, _whole(graph), AVX2)
    gk = _runs_blocked(graph, kernel, values)
    assert "c0 += 8LL" in gk.c_source and "c0 < 25LL" in gk.c_source


@needs_cc
def test_an_odd_multiple_of_three_output_blocks_takes_tiles_of_three(tmp_path):
    """At block 8 a dense tile holds 2 output blocks x 6 pixels, but 24 output channels (3
    blocks) take one tile of 3 x 4 pixels and no tile of one block left over; 32 (4 blocks) keep
    tiles of 2, and 40 (5 blocks, no multiple of 3) 2 + 1. Each equal to ONNX Runtime."""
    for cout, o_tile, tiles in ((24, 3, 1), (32, 2, 2), (40, 2, 3)):
        folder = tmp_path / str(cout)
        folder.mkdir()
        graph, values = _conv_group(folder, [1, 48, 5, 6], cout, 1, 1, act="Relu")
        (kernel,) = nchwc_choices(graph, _whole(graph), AVX2)
        items = nchwc_items(8, False, [1, 48, 5, 6], [1, cout, 5, 6], (1, 1, 1, 1), False)
        assert (items.o_tile, items.tiles, items.rest) == (o_tile, tiles, cout // 8 % o_tile)
        source = _runs_blocked(graph, kernel, values).c_source
        assert f"ocb0 = ot * {o_tile}LL" in source
        assert ("a2_0" in source) == (o_tile == 3)  # a third block's accumulators


@needs_cc
@pytest.mark.parametrize("target", [AVX512, AVX2], ids=["block16", "block8"])
def test_the_epilogue_runs_on_each_tiles_final_sums(tmp_path, target):
    """Bias, activation and residual run on a register tile's sums at its last pass over the input
    blocks and store each output once: a conv whose input blocks fit one pass has no buffer of
    partial sums at all; one in passes (160 channels in blocks of 16: 8 then 2) keeps its sums in
    cbuf until its last pass only. Both equal ONNX Runtime."""
    graph, values = _conv_group(tmp_path, [1, 16, 6, 9], 40, 3, 1, residual=True, act="Relu")
    (kernel,) = nchwc_choices(graph, _whole(graph), target)
    source = _runs_blocked(graph, kernel, values).c_source
    assert "cbuf" not in source and "fs_a[l]" in source
    graph, values = _conv_group(tmp_path, [1, 160, 5, 6], 80, 1, 1, residual=True, act="Relu")
    (kernel,) = nchwc_choices(graph, _whole(graph), AVX512)
    source = _runs_blocked(graph, kernel, values).c_source
    assert "if (c1 < 10LL) {" in source and "cbuf[" not in source  # sums read back as whole vectors only


def test_the_interior_of_a_conv_axis():
    """The outputs whose window lies inside the input, along one axis: a 3x3 conv with pad 1 all
    but the first and last; stride 2 over an even size with the pad after the input only: all but
    the last; a 5x5 with pad 2 over 7: the middle 3."""
    from fusesearch.schedule import nchwc_interior

    assert nchwc_interior(56, 3, 1, 1, 56) == (1, 55)
    assert nchwc_interior(8, 3, 2, 0, 4) == (0, 3)
    assert nchwc_interior(7, 5, 1, 2, 7) == (2, 5)
    assert nchwc_interior(2, 3, 1, 1, 2) == (1, 1)  # no interior: every output on the border


@needs_cc
@pytest.mark.parametrize("target", [AVX512, AVX2], ids=["block16", "block8"])
@pytest.mark.parametrize("shape,k,stride,pads", [((1, 32, 9, 7), 3, 1, [1, 1, 1, 1]), ((1, 16, 8, 8), 3, 2, [0, 0, 1, 1]),
                                                  ((1, 16, 7, 6), 5, 1, [2, 2, 2, 2]), ((1, 16, 2, 2), 3, 1, [1, 1, 1, 1])],
                         ids=["3x3", "stride2-pads-after", "5x5", "no-interior"])
def test_a_padded_dense_conv_reads_its_input_where_it_lies(tmp_path, target, shape, k, stride, pads):
    """No zero-bordered copy of the input (its writes and the zero taps cost more): each row's
    interior in tiles over its valid kh, each border column in tiles down the rows whose window
    lies inside the input vertically, the corners one by one over their valid taps; pads after
    the input only, a 5x5's two border columns each side, a plane with no interior pixel. Equal
    to ONNX Runtime."""
    w = _w([16, shape[1], k, k])
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[k, k], strides=[stride] * 2, pads=pads),
             helper.make_node("Relu", ["y"], ["out"])]
    prep = prepare(save(make_model(nodes, [("x", list(shape))], [("out", None)], [("w", w)]), tmp_path / "p.onnx"))
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    (kernel,) = nchwc_choices(prep.graph, _whole(prep.graph), target)
    source = _runs_blocked(prep.graph, kernel, values).c_source
    assert "patch" not in source and "long long ra = oh0" in source


def test_the_block_is_the_targets_lanes_and_none_below_eight():
    assert (AVX512.channel_block, AVX2.channel_block, CpuTarget(lanes=4).channel_block, CpuTarget().channel_block) == (
        16, 8, 0, 0)


def test_the_blocked_form_is_priced_with_its_padding_and_kept_out_of_the_plans_choices(tmp_path):
    """A 3x3 conv of 24 channels to 24 (bias, Relu) at 14 x 14 in blocks of 16 stores 32 of each:
    priced by hand, compute-bound (the regime where its FLOPs set its time), the blocked kernel
    multiplies and adds for 32 output channels (its vectors compute the padded lanes; the 8 zero
    input lanes of the last input block it skips: 24 input channels), reads 32/24 of the NCHW
    bytes of its input and of its filters (packed for 32 outputs) and writes 32/24 of its output;
    the bias, the epilogue and the plan's own NCHW choices as they were."""
    from costmodels.roofline import host_params
    from tests.search.test_layouts import host16

    graph, _ = _conv_group(tmp_path, [1, 24, 14, 14], 24, 3, 1, act="Relu")
    (blocked,) = nchwc_choices(graph, _whole(graph), AVX512)
    nchw = choices(graph, _whole(graph), host=AVX512)
    assert all(kn.schedule.product != "nchwc" and not kn.schedule.layout_out.blocked for kn in nchw)
    pixels, taps, bias = 14 * 14, 3 * 3, 24 * 14 * 14
    assert blocked.tc_flops == 2 * 32 * pixels * 24 * taps + bias == 2_714_208
    assert nchw[0].tc_flops == 2 * 24 * pixels * 24 * taps + bias == 2_036_832
    assert blocked.scalar_flops == nchw[0].scalar_flops == 24 * pixels  # the Relu, over the real lanes
    assert blocked.read_bytes == (32 * pixels + 32 * 24 * taps + 24) * 4 == 52_832
    assert blocked.write_bytes == 32 * pixels * 4 == 25_088
    assert (nchw[0].read_bytes, nchw[0].write_bytes) == ((24 * pixels + 24 * 24 * taps + 24) * 4, 24 * pixels * 4)
    cost = kernel_cost(blocked, host16(), RooflineModel(host_params()))
    assert cost.bound == "compute" and cost.flops == blocked.tc_flops + blocked.scalar_flops
    assert blocked.spec().product == "nchwc"
    assert nchwc_choices(graph, _whole(graph), CpuTarget(lanes=4)) == ()


def test_groups_without_a_blocked_form(tmp_path):
    """A prologue before the conv, a grouped (not depthwise) conv and a dilated one have none."""
    nodes = [helper.make_node("Relu", ["x"], ["p"]),
             helper.make_node("Conv", ["p", "w"], ["y"], kernel_shape=[1, 1])]
    model = make_model(nodes, [("x", [1, 16, 4, 4])], [("y", None)], [("w", _w([16, 16, 1, 1]))])
    prep = prepare(save(model, tmp_path / "p.onnx"))
    conv = next(n for n in prep.graph.nodes if n.op_type == "Conv")
    assert not nchwc_conv(prep.graph, frozenset(range(len(prep.graph))), conv)
    assert nchwc_conv(prep.graph, frozenset({conv.id}), conv)
    for attrs, ws in (({"group": 2}, [16, 8, 3, 3]), ({"dilations": [2, 2]}, [16, 16, 3, 3])):
        nodes = [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], **attrs)]
        model = make_model(nodes, [("x", [1, 16, 8, 8])], [("y", None)], [("w", _w(ws))])
        graph = prepare(save(model, tmp_path / "g.onnx")).graph
        assert nchwc_choices(graph, _whole(graph), AVX512) == ()


@needs_cc
@pytest.mark.parametrize("shape,block", [((2, 24, 5, 7), 16), ((1, 32, 4, 4), 8), ((1, 3, 6, 6), 16)])
def test_reorders_between_nchw_and_nchwc_equal_numpys(shape, block):
    """NCHW -> NCHWc pads with zero channels; NCHWc -> NCHW drops them; both as numpy reorders."""
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    layout = Layout(block)
    to = reorder_kernel("x", shape, NCHW, layout)
    assert to.outputs[0].shape == layout.shape(shape) and to.outputs[0].tensor == f"x@NCHW{block}c"
    blocked = cpu.run(to, {"x": x})[to.outputs[0].tensor]
    np.testing.assert_array_equal(blocked, to_blocked(x, layout))
    back = reorder_kernel("x", shape, layout, NCHW)
    np.testing.assert_array_equal(cpu.run(back, {"x": blocked})["x@NCHW"], x)
    with pytest.raises(CodegenRefused, match="one NCHW <-> NCHWc copy"):
        reorder_kernel("x", shape, layout, layout)


def _epilogue_chain(graph, conv) -> frozenset[int]:
    """The conv and the chain of ops after it a plan fuses as its epilogue: each the one reader
    of the value before, elementwise over the conv's output shape (an activation, a residual Add)."""
    nodes, t = {conv.id}, conv.outputs[0]
    while len(users := graph.consumers(t)) == 1 and not graph.is_output(t):
        n = graph.nodes[users[0]]
        if n.op_type not in ("Relu", "Clip", "Add", "Sigmoid", "Mul") or graph.tensors[n.outputs[0]].shape != \
                graph.tensors[t].shape:
            break
        nodes.add(n.id)
        t = n.outputs[0]
    return frozenset(nodes)


@needs_cc
@pytest.mark.parametrize("model", ["mobilenetv2", "resnet18"])
def test_every_distinct_zoo_conv_group_in_nchwc_equals_onnx_runtime(model):
    """Each distinct conv group of the model (the conv with its fused activation and residual
    Add) in the machine's block and in AVX2's: the image's stem reading NCHW, depthwise convs
    at stride 1 and 2, 1x1 expansions and projections with their residual, 3x3 and strided
    dense convs; every conv group has a blocked form."""
    prep = prepare(f"zoo:{model}")
    graph, canonical = prep.graph, to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    seen = set()
    for conv in (n for n in graph.nodes if n.op_type == "Conv"):
        group = FusionGroup(_epilogue_chain(graph, conv))
        ops = tuple(graph.nodes[i].op_type for i in sorted(group.nodes))
        key = (graph.tensors[conv.inputs[0]].shape, graph.tensors[conv.inputs[1]].shape, str(sorted(conv.attrs.items())),
               ops)
        if key in seen:
            continue
        seen.add(key)
        for target in (AVX512, AVX2):
            (kernel,) = nchwc_choices(graph, group, target)
            _runs_blocked(graph, kernel, values)
    assert len(seen) >= (30 if model == "mobilenetv2" else 10)


POINTWISE = {  # nodes, inputs (name, shape), output
    "maxpool-3x3-stride2": ([helper.make_node("MaxPool", ["x"], ["out"], kernel_shape=[3, 3], strides=[2, 2],
                                              pads=[1, 1, 1, 1])], [("x", [1, 24, 15, 16])]),
    "avgpool-2x2": ([helper.make_node("AveragePool", ["x"], ["out"], kernel_shape=[2, 2], strides=[2, 2])],
                    [("x", [2, 32, 8, 8])]),
    "add-relu": ([helper.make_node("Add", ["x", "r"], ["s"]), helper.make_node("Relu", ["s"], ["out"])],
                 [("x", [1, 40, 7, 9]), ("r", [1, 40, 7, 9])]),
    "relu-maxpool-two-outputs": ([helper.make_node("Relu", ["x"], ["a"]),
                                  helper.make_node("MaxPool", ["a"], ["out"], kernel_shape=[2, 2], strides=[2, 2])],
                                 [("x", [1, 16, 6, 6])]),
}


@needs_cc
@pytest.mark.parametrize("name", POINTWISE)
@pytest.mark.parametrize("target", [AVX512, AVX2], ids=["block16", "block8"])
def test_pools_and_elementwise_groups_in_nchwc_equal_onnx_runtime(tmp_path, name, target):
    """An anchorless group of pools and elementwise ops over blocked tensors: every tensor of the
    group's channel count blocked, priced with its padding, no CUDA form."""
    nodes, inputs = POINTWISE[name]
    outputs = [("out", None)] + ([("a", None)] if name.endswith("two-outputs") else [])
    prep = prepare(save(make_model(nodes, inputs, outputs), tmp_path / "p.onnx"))
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    (kernel,) = nchwc_choices(prep.graph, _whole(prep.graph), target)
    assert kernel.template == "pointwise" and kernel.schedule.layout_out == Layout(target.channel_block)
    gk = generate(prep.graph, kernel)
    assert not gk.cuda_source
    feeds = {a.tensor: to_blocked(values[a.tensor], Layout(a.shape[-1])) for a in gk.inputs}
    out = cpu.run(gk, feeds)
    for a in gk.outputs:
        ref = values[a.tensor]
        got = from_blocked(out[a.tensor], Layout(a.shape[-1]), ref.shape[1])
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * max(1.0, float(np.abs(ref).max())), err_msg=a.tensor)
        pad = out[a.tensor].transpose(0, 1, 4, 2, 3).reshape(ref.shape[0], -1, *ref.shape[2:])[:, ref.shape[1]:]
        assert not pad.any()


CONCATS = {  # nodes, inputs, initializers: channel concats whose inputs but the last fill whole blocks
    "silu-concat": ([helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["m"]),
                     helper.make_node("Concat", ["m", "r"], ["out"], axis=1)],
                    [("x", [1, 16, 5, 7]), ("r", [1, 24, 5, 7])], []),
    "upsample-concat": ([helper.make_node("Resize", ["x", "", "scales"], ["u"], mode="nearest",
                                          coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
                         helper.make_node("Concat", ["u", "r"], ["out"], axis=1)],
                        [("x", [1, 32, 3, 4]), ("r", [1, 8, 6, 8])],
                        [("scales", np.array([1, 1, 2, 2], np.float32))]),
    "shuffle-concat": ([helper.make_node("DepthToSpace", ["x"], ["u"], blocksize=2),  # a U-Net upsampling's shuffle
                        helper.make_node("Concat", ["u", "r"], ["out"], axis=1)],
                       [("x", [1, 128, 3, 4]), ("r", [1, 8, 6, 8])], []),
}


@needs_cc
@pytest.mark.parametrize("name", CONCATS)
@pytest.mark.parametrize("target", [AVX512, AVX2], ids=["block16", "block8"])
def test_a_concat_of_whole_blocks_runs_blocked_and_equals_onnx_runtime(tmp_path, name, target):
    """A channel concat (after an activation, a nearest upsample, a DepthToSpace) in NCHWc: each
    output block read from one input block by the block's index, no division per lane; equal to
    ONNX Runtime with the padded lanes zero."""
    nodes, inputs, inits = CONCATS[name]
    prep = prepare(save(make_model(nodes, inputs, [("out", None)], initializers=inits), tmp_path / "c.onnx"))
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    (kernel,) = nchwc_choices(prep.graph, _whole(prep.graph), target)
    gk = generate(prep.graph, kernel)
    b = target.channel_block
    assert f"(cb < {16 // b if name == 'silu-concat' else 32 // b}LL)" in gk.c_source.replace("if (cb <", "(cb <")
    out = cpu.run(gk, {a.tensor: to_blocked(values[a.tensor], Layout(a.shape[-1])) if len(a.shape) == 5
                       else values[a.tensor] for a in gk.inputs})
    (a,) = gk.outputs
    got = from_blocked(out[a.tensor], Layout(b), 40)
    np.testing.assert_allclose(got, values["out"], rtol=0, atol=1e-5 * max(1.0, float(np.abs(values["out"]).max())))


def test_a_concat_off_the_block_boundary_stays_nchw(tmp_path):
    """24 + 16 channels in blocks of 16: the second input starts inside a block, so an output
    block would mix two inputs' lanes; no blocked form (at block 8 both fill whole blocks)."""
    nodes = [helper.make_node("Concat", ["x", "r"], ["out"], axis=1)]
    prep = prepare(save(make_model(nodes, [("x", [1, 24, 4, 4]), ("r", [1, 16, 4, 4])], [("out", None)]),
                        tmp_path / "c.onnx"))
    assert nchwc_choices(prep.graph, _whole(prep.graph), AVX512) == ()
    assert len(nchwc_choices(prep.graph, _whole(prep.graph), AVX2)) == 1


def test_a_blocked_pool_reads_its_taps_without_branches(tmp_path):
    """A padded max pool's taps outside the input read the clamped position as it is (the window's
    edge element: the max unchanged), neither guarded (a branch in the lane loop left GCC's masked
    loads unvectorized: resnet18's stem pool 3.2 ms) nor bounded per pixel (a select GCC built
    bit by bit: 0.44 ms against 0.09 ms alone)."""
    nodes, inputs = POINTWISE["maxpool-3x3-stride2"]
    prep = prepare(save(make_model(nodes, inputs, [("out", None)]), tmp_path / "p.onnx"))
    (kernel,) = nchwc_choices(prep.graph, _whole(prep.graph), AVX512)
    body = generate(prep.graph, kernel).c_source.split("#pragma omp simd", 1)[1]
    assert "if (" not in body and "INFINITY" not in body and body.count("FS_FMAX(") == 8


def test_a_reorder_is_priced_as_the_copy_of_each_side_as_it_lies(tmp_path):
    """On a pinned CPU device: a reorder reads the NCHW bytes and writes the padded NCHWc ones
    (or back), computes nothing, is priced by its traffic (more bytes, more time), and costs less
    than the conv it feeds; the blocked conv is priced as its product "nchwc"."""
    device = replace(DEVICES["t4"], name="pinned-cpu", kind="cpu", warp_size=16, sm_count=1)
    model = RooflineModel(RooflineParams())
    graph, _ = _conv_group(tmp_path, [1, 24, 28, 28], 64, 3, 1, act="Relu")
    x, layout = "x", Layout(16)
    into, back = reorder(graph, x, NCHW, layout), reorder(graph, x, layout, NCHW)
    nchw_bytes = 24 * 28 * 28 * 4
    assert (into.read_bytes, into.write_bytes) == (nchw_bytes, 32 * 28 * 28 * 4) == (back.write_bytes, back.read_bytes)
    assert into.tc_flops == into.scalar_flops == 0 and into.schedule.layout_out == layout
    (conv,) = nchwc_choices(graph, _whole(graph), CpuTarget(lanes=16))
    t_into, t_back, t_conv = (kernel_cost(k, device, model) for k in (into, back, conv))
    assert t_into.feasible and t_into.bound != "compute" and 0 < t_into.time_s < t_conv.time_s
    wide = reorder(graph, conv.outputs[0], NCHW, layout)  # 64 channels
    assert kernel_cost(wide, device, model).memory_s > t_into.memory_s


TWO = CpuTarget(lanes=16, threads=2)


def _pinned_two_threads():
    """Two threads of a CPU: a team's fork and barrier 5 us, a one-thread region's call 0.3 us."""
    return replace(DEVICES["t4"], name="pinned-cpu", kind="cpu", warp_size=16, sm_count=2, launch_overhead_s=5e-6,
                   serial_launch_overhead_s=0.3e-6, cache_curve=())


@needs_cc
@pytest.mark.parametrize("name", ["3x3", "depthwise-3x3", "image-3x3-stride2", "maxpool-3x3-stride2"])
def test_blocked_choices_have_their_one_thread_form_above_one_thread(tmp_path, name):
    """At 2 threads each blocked choice (a dense, depthwise or image conv, a pool) is followed by
    its one-thread form (split "one", `cpu_threads` 1, imbalance 1), priced with the one-thread
    region's call instead of the team's fork and at one thread's share of the rates, its region
    `num_threads(1)`; both forms, run with 2 OpenMP threads, equal ONNX Runtime. At one thread
    there is none."""
    from fusesearch.backends.cpu import openmp_threads
    from fusesearch.schedule import ONE_THREAD

    if name in POINTWISE:
        nodes, inputs = POINTWISE[name]
        prep = prepare(save(make_model(nodes, inputs, [("out", None)]), tmp_path / "p.onnx"))
        graph, values = prep.graph, all_values(to_proto(prep.canonical), random_feeds(to_proto(prep.canonical), 0))
    else:
        xs, cout, k, stride, depthwise, residual, act = CASES[name]
        graph, values = _conv_group(tmp_path, xs, cout, k, stride, depthwise=depthwise, residual=residual, act=act)
    team, alone = nchwc_choices(graph, _whole(graph), TWO)
    assert (team.schedule.split, alone.schedule.split) == ("", ONE_THREAD)
    assert alone.schedule.layout_out == team.schedule.layout_out and alone.schedule.product == team.schedule.product
    assert (team.spec().cpu_threads, alone.spec().cpu_threads, alone.imbalance) == (0, 1, 1.0)
    assert len(nchwc_choices(graph, _whole(graph), AVX512)) == 1
    device, model = _pinned_two_threads(), RooflineModel(RooflineParams())
    t, a = kernel_cost(team, device, model), kernel_cost(alone, device, model)
    assert (t.launch_s, a.launch_s) == (5e-6, 0.3e-6) and a.memory_s == pytest.approx(2 * t.memory_s)
    for kernel in (team, alone):
        gk = generate(graph, kernel)
        assert ("#pragma omp parallel num_threads(1)\n" in gk.c_source) == (kernel is alone)
        feeds = {a_.tensor: to_blocked(values[a_.tensor], Layout(a_.shape[-1])) if len(a_.shape) == 5
                 else values[a_.tensor] for a_ in gk.inputs}
        with openmp_threads(2):
            out = cpu.run(gk, feeds)
        for a_ in gk.outputs:
            ref = values[a_.tensor]
            got = from_blocked(out[a_.tensor], Layout(a_.shape[-1]), ref.shape[1])
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * max(1.0, float(np.abs(ref).max())))


@needs_cc
@pytest.mark.parametrize("shape,block", [((1, 40, 9, 8), 16), ((1, 20, 40, 30), 16), ((2, 16, 32, 32), 16),
                                         ((1, 20, 9, 8), 8), ((1, 3, 5, 5), 8)])
def test_reorders_transpose_whole_squares_and_the_pixels_past_them(shape, block):
    """Planes of 72 pixels (4 squares of 16 and 8 pixels past them), 1200 (two runs of pixels:
    1024 then 176), exactly one run, a block of 8, fewer pixels than a square; channels off the
    block (padded lanes zero into NCHWc, not written back): both directions equal numpy's."""
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    layout = Layout(block)
    to = reorder_kernel("x", shape, NCHW, layout)
    assert "__builtin_shufflevector" in to.c_source
    blocked = cpu.run(to, {"x": x})[to.outputs[0].tensor]
    np.testing.assert_array_equal(blocked, to_blocked(x, layout))
    back = reorder_kernel("x", shape, layout, NCHW)
    np.testing.assert_array_equal(cpu.run(back, {"x": blocked})["x@NCHW"], x)


@needs_cc
def test_a_reorder_has_its_one_thread_form_above_one_thread(tmp_path):
    """`reorder_choices` at 2 threads: the reorder, then its one-thread form (priced with the
    one-thread region's call), whose C (`reorder_kernel` with the schedule's `cpu_threads`) runs
    `num_threads(1)` and equals numpy's reorder at 2 OpenMP threads; at one thread the reorder
    alone."""
    from fusesearch.backends.cpu import openmp_threads
    from fusesearch.lowering import reorder_choices
    from fusesearch.schedule import ONE_THREAD

    graph, values = _conv_group(tmp_path, [1, 24, 6, 6], 32, 1, 1, act=None)
    layout = Layout(16)
    team, alone = reorder_choices(graph, "x", NCHW, layout, TWO)
    assert (team.schedule.split, alone.schedule.split, alone.spec().cpu_threads) == ("", ONE_THREAD, 1)
    assert reorder_choices(graph, "x", NCHW, layout, AVX512) == (team,)
    device, model = _pinned_two_threads(), RooflineModel(RooflineParams())
    assert (kernel_cost(team, device, model).launch_s, kernel_cost(alone, device, model).launch_s) == (5e-6, 0.3e-6)
    for kernel in (team, alone):
        gk = reorder_kernel("x", (1, 24, 6, 6), NCHW, layout, threads=kernel.schedule.cpu_threads)
        assert ("num_threads(1)" in gk.c_source) == (kernel is alone)
        with openmp_threads(2):
            got = cpu.run(gk, {"x": values["x"]})[gk.outputs[0].tensor]
        np.testing.assert_array_equal(got, to_blocked(values["x"], layout))


def test_work_items_split_evenly_among_threads_and_their_imbalance_is_priced(tmp_path):
    """A 3x3 conv over 16 channels at 14 x 14, block 8: 4 blocks of rows (4 rows each at least, 56
    pixels) x 1 tile of 2 output blocks. In blocks of 4, 4, 4 and 2 rows two threads' contiguous
    halves would hold 8 and 6 rows; bounded at 14 - (4 - k) x 14 / 4 the blocks hold 4, 3, 4, 3:
    7 rows each, even (imbalance 1). With 3 threads the 4 blocks are cut to 3. Over 256 channels
    (resnet18's third stage) the filters outweigh the input: one block of all 14 rows, its 16
    tiles 8 a thread. A depthwise conv's blocks are rows (7 at 7 x 7: 6 blocks, 4 and 3 rows on
    two threads, 8/7); a conv to one tile over one block of rows has one item, all on one of two
    threads (2). The C cuts its blocks so at run time, and a 7 x 7 depthwise group's two-thread
    choice carries its imbalance (the cost model divides the product's rate by it), at one
    thread none."""
    dense = nchwc_items(8, False, (1, 16, 14, 14), (1, 16, 14, 14), (3, 3, 1, 1), True)
    assert (dense.rows, dense.least_blocks, dense.o_tile, dense.tiles, dense.count(2)) == (4, 4, 2, 1, 4)
    assert [dense.work(r, 2) for r in (0, 1, 3)] == [4 * 14 * 2, 3 * 14 * 2, 3 * 14 * 2]
    assert dense.imbalance(1) == dense.imbalance(2) == 1.0 and dense.blocks(3) == 3 and dense.most_rows == 8
    deep = nchwc_items(8, False, (1, 256, 14, 14), (1, 256, 14, 14), (3, 3, 1, 1), True)
    assert (deep.rows, deep.blocks(2), deep.tiles, deep.imbalance(2)) == (14, 1, 16, 1.0)
    depthwise = nchwc_items(8, True, (1, 96, 7, 7), (1, 96, 7, 7), (3, 3, 1, 1), True)
    assert (depthwise.rows, depthwise.tiles, depthwise.blocks(2)) == (1, 1, 6)
    assert depthwise.imbalance(2) == pytest.approx(8 / 7)
    assert nchwc_items(16, False, (1, 32, 7, 7), (1, 32, 7, 7), (1, 1, 1, 1), False).imbalance(2) == 2.0
    graph, _ = _conv_group(tmp_path, [1, 96, 7, 7], 96, 3, 1, depthwise=True)
    group = FusionGroup(frozenset(range(len(graph.nodes))))
    one, two = (nchwc_choices(graph, group, replace(AVX2, threads=t))[0] for t in (1, 2))
    assert (one.imbalance, two.imbalance) == (1.0, pytest.approx(8 / 7))
    assert "blocks = 7LL >= nt ? 7LL - 7LL % nt : 7LL" in generate(graph, two).c_source


def test_a_strided_1x1_conv_copies_its_blocks_pixels_together_and_weighs_what_it_copies(tmp_path):
    """A dense unpadded strided 1x1 conv over a blocked input copies each block of rows' pixels
    into a thread's scratch (`nchwc_compacts`), once per block a thread takes, and runs without a
    stride over them; a padded one, a 3x3, a depthwise one and an image's (NCHW) do not. Its
    rows weigh the filters against the pixels it copies, its output's: resnet18's 256 -> 512
    (14 -> 7 a side) and resnet50's 1024 -> 2048 take all their rows in one block (each tile's
    filters read once), resnet50's 256 -> 512 (56 -> 28) blocks of 48 pixels. The source copies
    with the stride and reads the copy without it; both targets equal ONNX Runtime at 2 threads
    (`test_nchwc_conv_groups_equal_onnx_runtime_in_their_layout` at one)."""
    from fusesearch.schedule import nchwc_compacts

    assert nchwc_compacts(8, False, (1, 256, 14, 14), (1, 1, 2, 2), False)
    assert not nchwc_compacts(8, False, (1, 256, 14, 14), (1, 1, 1, 1), False)
    assert not nchwc_compacts(8, False, (1, 256, 14, 14), (3, 3, 2, 2), False)
    assert not nchwc_compacts(8, False, (1, 256, 14, 14), (1, 1, 2, 2), True)
    assert not nchwc_compacts(8, True, (1, 256, 14, 14), (1, 1, 2, 2), False)
    assert not nchwc_compacts(8, False, (1, 3, 14, 14), (1, 1, 2, 2), False)
    r18 = nchwc_items(8, False, (1, 256, 14, 14), (1, 512, 7, 7), (1, 1, 2, 2), False)
    r50 = nchwc_items(8, False, (1, 1024, 14, 14), (1, 2048, 7, 7), (1, 1, 2, 2), False)
    wide = nchwc_items(8, False, (1, 256, 56, 56), (1, 512, 28, 28), (1, 1, 2, 2), False)
    assert (r18.rows, r18.least_blocks, r50.rows, r50.least_blocks) == (7, 1, 7, 1)
    assert (wide.rows, wide.least_blocks) == (2, 14)
    graph, values = _conv_group(tmp_path, [1, 24, 17, 15], 32, 1, 2, residual=True, act="Relu")
    for target in (AVX512, AVX2):
        (kernel,) = nchwc_choices(graph, _whole(graph), target)
        b = target.channel_block
        gk = _runs_blocked(graph, kernel, values, threads=2)
        assert "long long copied = -1;" in gk.c_source and f"src + ow * {2 * b}LL" in gk.c_source
        assert "xq + " in gk.c_source
        priced = nchwc_items(b, False, (1, 24, 17, 15), (1, 32, 9, 8), (1, 1, 2, 2), False, kernel.schedule.layout_out.channels(32))
        assert f"blocks = {priced.c_blocks('nt')};" in gk.c_source  # the rows written are the rows priced
    three, _ = _conv_group(tmp_path, [1, 24, 17, 15], 32, 3, 2)
    (padded,) = nchwc_choices(three, _whole(three), AVX2)
    assert "copied" not in generate(three, padded).c_source


def test_a_tile_of_few_sums_splits_its_work_into_chains():
    """FMA_CHAINS independent sums keep the FMA units busy: a dense tile of fewer splits its input
    lanes into chains (2 blocks x 1 pixel: 4 chains; 2 x 2: 2; 2 x 6: none), as many as divide
    every input block's lanes (an image's 3 channels: none); a depthwise tile of fewer than 8
    pixels a chain per filter row, as many as fit 12 accumulators (filter row kh into chain kh
    mod their count)."""
    from fusesearch.schedule import nchwc_chains

    assert [nchwc_chains(n, 8, 8) for n in (1, 2, 3, 4, 8, 12)] == [8, 4, 2, 2, 1, 1]
    assert nchwc_chains(2, 16, 8) == 4 and nchwc_chains(2, 3, 3) == 1 and nchwc_chains(1, 8, 2) == 2
    assert [nchwc_chains(p, 3, 3, depthwise=True) for p in (1, 4, 5, 6, 7, 8)] == [3, 3, 2, 2, 1, 1]
    assert [nchwc_chains(p, 5, 5, depthwise=True) for p in (2, 3, 4)] == [5, 4, 3]
    assert nchwc_chains(1, 1, 1, depthwise=True) == 1  # a 1x1 depthwise filter: one row


@needs_cc
def test_border_tiles_of_few_sums_run_in_chains_and_equal_onnx_runtime(tmp_path):
    """A 3x3 conv over 7 x 7 pixels at block 8: each corner is a tile of one pixel x 2 blocks, its
    sums in 4 chains of input lanes added after its taps; the interior's 2 x 5 tiles in one. A
    depthwise conv's border pixels sum each filter row apart. Both equal ONNX Runtime."""
    graph, values = _conv_group(tmp_path, [1, 32, 7, 7], 32, 3, 1, residual=True, act="Relu")
    (kernel,) = nchwc_choices(graph, _whole(graph), AVX2)
    source = _runs_blocked(graph, kernel, values).c_source
    assert "ic += 4)" in source and "a1_0 = a1_0 + a1_0_1 + a1_0_2 + a1_0_3;" in source
    assert "ic += 1)" in source and "a1_4_1" not in source  # the 2 x 5 interior tile: one chain
    folder = tmp_path / "dw"
    folder.mkdir()
    graph, values = _conv_group(folder, [1, 16, 7, 7], 16, 3, 1, depthwise=True, act="Relu")
    (kernel,) = nchwc_choices(graph, _whole(graph), AVX2)
    source = _runs_blocked(graph, kernel, values).c_source
    assert "if (kh0 <= 2 && 2 < kh1)" in source and "a0_0 = a0_0 + a0_0_1 + a0_0_2;" in source
    assert "a0_4 = a0_4 + a0_4_1;" in source  # the 5 interior pixels: rows 0 and 2 in chain 0, 1 in 1


def test_relu_and_clip_of_a_blocked_conv_compile_as_vector_min_max(tmp_path):
    """A blocked conv of products, adds, Relu and Clip carries the pragma that lets GCC compile its
    min/max as vmaxps/vminps (`base.minmax_kernel`), scoped to the kernel's function; one with a
    Sigmoid, and the NCHW form, do not."""
    from fusesearch.backends.codegen.c_prelude import _MINMAX_OFF, _MINMAX_ON

    for act, expected in (("Relu", True), ("Clip", True), ("Sigmoid", False)):
        graph, _ = _conv_group(tmp_path, [1, 16, 8, 8], 32, 3, 1, residual=True, act=act)
        (kernel,) = nchwc_choices(graph, _whole(graph), AVX2)
        source = generate(graph, kernel).c_source
        assert (_MINMAX_ON in source) == expected, act
        if expected:
            body = source[source.index(_MINMAX_ON):source.index(_MINMAX_OFF)]
            assert body.count("#pragma omp parallel") == 1 and "_pack(" not in body
            nchw = choices(graph, _whole(graph), host=AVX2)[0]
            assert _MINMAX_ON not in generate(graph, nchw).c_source, "NCHW: as before"
