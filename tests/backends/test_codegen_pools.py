"""MaxPool and AveragePool generated as unrolled window reductions equal ONNX Runtime: alone over a
table of window attributes, and fused with their producer (Conv+Relu → MaxPool, resnet's stem)
or consumer, on the CPU backend and through the CUDA emulator; the pools codegen does not take
(MaxPool's Indices, 1-D, a large window) run alone as library calls, with the reason; lowering
prices the producer's recompute per window tap."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from costmodels import RooflineModel, load_device
from fusesearch.backends import cpu, emulate
from fusesearch.backends.codegen import CAPABILITIES, GENERATED_OPS, generate
from fusesearch.candidates.rules import Legality
from fusesearch.groups import FusionDecision, FusionGroup
from fusesearch.ir.op_kind import OpKind, kind_of, node_flops
from fusesearch.ir.pool import pool_window
from fusesearch.lowering import lower, try_lower
from fusesearch.pipeline import prepare
from tests.backends.test_codegen_cpu import whole_graph_as_one_group
from tests.backends.test_cuda_emulated import one_group
from tests.conftest import make_model, save

needs_cc = pytest.mark.skipif(not cpu.available(), reason="no C compiler")
needs_cxx = pytest.mark.skipif(not emulate.available(), reason="no C++ compiler")


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# id -> (op, attributes, input shape); every row runs alone and behind a Relu (the producer inlined)
POOLS = {
    "max-resnet-3x3-s2-p1": ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, [1, 3, 12, 11]),
    "max-2x2-s2": ("MaxPool", {"kernel_shape": [2, 2], "strides": [2, 2]}, [2, 2, 8, 6]),
    "max-1x1-s2": ("MaxPool", {"kernel_shape": [1, 1], "strides": [2, 2]}, [1, 2, 7, 8]),
    "max-ceil-pads": ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1},
                      [1, 2, 7, 8]),
    "max-asymmetric-pads": ("MaxPool", {"kernel_shape": [3, 2], "strides": [1, 2], "pads": [2, 0, 0, 1]}, [1, 2, 6, 7]),
    "max-dilated-ceil": ("MaxPool", {"kernel_shape": [3, 2], "strides": [2, 2], "ceil_mode": 1, "dilations": [1, 2]},
                         [1, 2, 8, 9]),
    "max-dilated-pads": ("MaxPool", {"kernel_shape": [3, 3], "strides": [1, 2], "dilations": [2, 2],
                                     "pads": [2, 1, 1, 2]}, [1, 2, 8, 9]),
    "max-same-upper": ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}, [1, 2, 7, 8]),
    "max-same-lower": ("MaxPool", {"kernel_shape": [2, 3], "strides": [1, 1], "auto_pad": "SAME_LOWER"}, [1, 2, 7, 8]),
    "max-valid": ("MaxPool", {"kernel_shape": [2, 2], "strides": [2, 2], "auto_pad": "VALID"}, [1, 2, 7, 9]),
    "avg-resnet-3x3-s2-p1": ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
                             [1, 3, 12, 11]),
    "avg-include-pad": ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1],
                                        "count_include_pad": 1}, [1, 2, 7, 8]),
    "avg-ceil": ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1},
                 [1, 2, 7, 8]),
    "avg-ceil-include-pad-clipped": ("AveragePool", {"kernel_shape": [3, 2], "strides": [3, 2], "ceil_mode": 1,
                                                     "count_include_pad": 1}, [1, 2, 8, 7]),
    "avg-ceil-include-asymmetric": ("AveragePool", {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 0, 1],
                                                    "ceil_mode": 1, "count_include_pad": 1}, [1, 2, 8, 7]),
    "avg-same-upper-include-pad": ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER",
                                                   "count_include_pad": 1}, [1, 2, 7, 8]),
    "avg-same-lower": ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_LOWER"},
                       [1, 2, 7, 8]),
    "avg-2x2-s2-whole-windows": ("AveragePool", {"kernel_shape": [2, 2], "strides": [2, 2]}, [2, 3, 6, 8]),
    "avg-1x1": ("AveragePool", {"kernel_shape": [1, 1]}, [1, 2, 3, 5]),
}


def _pool_nodes(case, relu: bool):
    op, attrs, shape = POOLS[case]
    nodes = [helper.make_node("Relu", ["x"], ["r"])] if relu else []
    nodes.append(helper.make_node(op, ["r" if relu else "x"], ["y"], **attrs))
    return nodes, [("x", shape)]


@needs_cc
@pytest.mark.parametrize("relu", [False, True], ids=["alone", "after-relu"])
@pytest.mark.parametrize("case", list(POOLS))
def test_pool_on_the_cpu_backend_equals_onnx_runtime(tmp_path, case, relu):
    nodes, inputs = _pool_nodes(case, relu)
    whole_graph_as_one_group(tmp_path, nodes, inputs, [("y", None)], opset=19)


def _stem(pool_op="MaxPool", **pool):
    """resnet's stem in miniature: Conv 7x7/2 + bias, Relu, 3x3/2 pool with padding."""
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], **pool}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[7, 7], strides=[2, 2], pads=[3, 3, 3, 3]),
             helper.make_node("Relu", ["c"], ["r"]), helper.make_node(pool_op, ["r"], ["y"], **attrs)]
    inits = [("w", rand(16, 3, 7, 7, seed=1)), ("b", rand(16, seed=2))]
    return nodes, [("x", [1, 3, 30, 26])], inits


FUSED = {
    "conv-relu-maxpool": _stem(),
    "conv-relu-avgpool-ceil": _stem("AveragePool", ceil_mode=1, count_include_pad=1),
    # a pool as the prologue of a conv (resnet's layer1 reads the stem pool) with a residual epilogue
    "maxpool-conv-add": ([helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[3, 3], strides=[2, 2],
                                           pads=[1, 1, 1, 1]),
                          helper.make_node("Conv", ["p", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
                          helper.make_node("Add", ["c", "p"], ["y"])],
                         [("x", [1, 8, 9, 10])], [("w", rand(8, 8, 3, 3, seed=3))]),
    # pools under a pointwise epilogue (a residual Add, a Relu): the C column loop split at the border
    "maxpool-add-relu": ([helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[3, 3], strides=[2, 2],
                                           pads=[1, 1, 1, 1]),
                          helper.make_node("Add", ["p", "z"], ["a"]), helper.make_node("Relu", ["a"], ["y"])],
                         [("x", [1, 3, 12, 11]), ("z", [1, 3, 6, 6])], []),
    "avgpool-ceil-dilated-max-add": ([helper.make_node("AveragePool", ["x"], ["p"], kernel_shape=[3, 2], strides=[2, 2],
                                                       pads=[1, 0, 0, 1], ceil_mode=1, count_include_pad=1),
                                      helper.make_node("MaxPool", ["x"], ["q"], kernel_shape=[3, 2], strides=[2, 2],
                                                       pads=[1, 0, 0, 1], ceil_mode=1),
                                      helper.make_node("Add", ["p", "q"], ["y"])], [("x", [1, 2, 8, 7])], []),
    # stacked pools: the first unrolled inside the second's row passes
    "maxpool-avgpool": ([helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
                         helper.make_node("AveragePool", ["p"], ["y"], kernel_shape=[2, 3], strides=[2, 2],
                                          pads=[0, 1, 1, 1], ceil_mode=1)], [("x", [1, 2, 9, 8])], []),
    # pool then a pointwise epilogue, and a pool under a row reduction
    "avgpool-mul-globalavg": ([helper.make_node("AveragePool", ["x"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
                               helper.make_node("Mul", ["p", "s"], ["m"]),
                               helper.make_node("GlobalAveragePool", ["m"], ["y"])],
                              [("x", [2, 3, 8, 6])], [("s", np.float32(1.5))]),
}


@needs_cc
@pytest.mark.parametrize("case", list(FUSED))
def test_fused_pool_on_the_cpu_backend_equals_onnx_runtime(tmp_path, case):
    nodes, inputs, inits = FUSED[case]
    prep = whole_graph_as_one_group(tmp_path, nodes, inputs, [("y", None)], inits, opset=19)
    assert len(prep.graph) == len(nodes)  # nothing folded away: the fused group is what ran


@needs_cxx
@pytest.mark.parametrize(("case", "skeleton"), [
    ("max-resnet-3x3-s2-p1", "grid-stride"), ("max-dilated-ceil", "grid-stride"),
    ("avg-ceil-include-asymmetric", "grid-stride"), ("avg-same-lower", "grid-stride")])
def test_pool_cuda_kernel_emulated_equals_onnx_runtime(tmp_path, case, skeleton):
    nodes, inputs = _pool_nodes(case, relu=True)
    one_group(tmp_path, nodes, inputs, [("y", None)], skeleton=skeleton)


@needs_cxx
@pytest.mark.parametrize(("case", "skeleton"), [
    ("conv-relu-maxpool", "direct"), ("conv-relu-avgpool-ceil", "direct"),
    ("maxpool-conv-add", "tiled"), ("avgpool-mul-globalavg", "block-per-row")])
def test_fused_pool_cuda_kernel_emulated_equals_onnx_runtime(tmp_path, case, skeleton):
    """After an anchor the pool reads the product at other positions than its own: one thread per
    pool output, the conv's dot product inline at every tap (`direct`); before one, the pool is
    computed in the tile loads (`tiled`); under a row reduction, in the row's passes."""
    nodes, inputs, inits = FUSED[case]
    one_group(tmp_path, nodes, inputs, [("y", None)], inits, skeleton=skeleton)


def _prepared(tmp_path, nodes, inputs, inits=(), outputs=(("y", None),)):
    return prepare(save(make_model(nodes, inputs, list(outputs), inits, opset=19), tmp_path / "m.onnx"))


def test_pools_are_generated_injective_ops():
    assert {"MaxPool", "AveragePool"} <= GENERATED_OPS
    assert kind_of("MaxPool") == kind_of("AveragePool") == OpKind.INJECTIVE
    assert kind_of("LpPool") == OpKind.OPAQUE


# pools codegen does not take, behind a Relu: (nodes, input shape, what the reason names)
NOT_GENERATED = {
    "indices": ([helper.make_node("MaxPool", ["r"], ["y", "i"], kernel_shape=[2, 2])], [1, 2, 4, 4], "Indices"),
    "1-d": ([helper.make_node("MaxPool", ["r"], ["y"], kernel_shape=[2])], [1, 2, 8], "2-D"),
    "large-window": ([helper.make_node("AveragePool", ["r"], ["y"], kernel_shape=[9, 9])], [1, 2, 12, 12], "81 taps"),
    "window-in-padding": ([helper.make_node("MaxPool", ["r"], ["y"], kernel_shape=[2, 2], pads=[2, 2, 2, 2])],
                          [1, 2, 4, 4], "wholly in the padding"),
    "dilated-average": ([helper.make_node("AveragePool", ["r"], ["y"], kernel_shape=[2, 2], dilations=[2, 2])],
                        [1, 2, 8, 8], "dilations"),
}


@pytest.mark.parametrize("case", list(NOT_GENERATED))
def test_a_pool_codegen_does_not_take_runs_alone_as_a_library_call(tmp_path, case):
    nodes, shape, reason = NOT_GENERATED[case]
    outputs = [(t, None, TensorProto.INT64 if t == "i" else TensorProto.FLOAT) for t in nodes[0].output]
    prep = _prepared(tmp_path, [helper.make_node("Relu", ["x"], ["r"]), *nodes], [("x", shape)], outputs=outputs)
    graph = prep.graph
    pool = next(n for n in graph.nodes if n.op_type in ("MaxPool", "AveragePool"))
    assert lower(graph, FusionGroup.single(pool.id)).template == "opaque"
    decision = try_lower(graph, FusionGroup(frozenset(range(len(graph)))))
    assert isinstance(decision, FusionDecision) and not decision and reason in decision.reason, decision
    assert pool.name in decision.reason


def test_the_stem_group_is_legal_and_prices_the_conv_recomputed_per_tap(tmp_path):
    """Conv+Relu → MaxPool 3x3/2 pad 1: every pool output recomputes the product at its in-bounds
    taps (about 9/4 per product element), on CUDA cores (a thread per output, no tensor cores)."""
    nodes, inputs, inits = FUSED["conv-relu-maxpool"]
    prep = _prepared(tmp_path, nodes, inputs, inits)
    graph = prep.graph
    device, params = load_device("h100-sxm")
    verdict = Legality(graph, device, RooflineModel(params), CAPABILITIES).check(range(len(graph)))
    assert verdict.decision, verdict.decision.reason
    kernel = verdict.kernel
    conv, relu, pool = graph.nodes
    window = pool_window("MaxPool", pool.attrs, graph.tensors[pool.inputs[0]].shape,
                         graph.tensors[pool.outputs[0]].shape)
    ratio = window.reads / graph.tensors[pool.inputs[0]].size
    assert 2.0 < ratio < 2.25  # 9/4 less the taps that fall in the padding
    flops = [node_flops(n.op_type, n.attrs, graph.node_inputs(n), graph.node_outputs(n)) for n in (conv, relu, pool)]
    assert kernel.tc_flops == 0
    assert kernel.scalar_flops == round(ratio * flops[0]) + round(ratio * flops[1]) + flops[2]
    alone = lower(graph, FusionGroup.single(pool.id))
    assert alone.template == "pointwise" and alone.impl == "generated" and alone.scalar_flops == flops[2]


def test_generated_pool_rows_are_separable_and_vectorized(tmp_path):
    """C: a pool's output is computed per output row in two `omp simd` passes — the window's rows
    reduced over contiguous input columns into a padded row buffer (a row outside the input
    bounded once per row), then each output column's taps from the buffer."""
    op, attrs, shape = POOLS["max-resnet-3x3-s2-p1"]  # 12x11 in, 6x6 out
    prep = _prepared(tmp_path, [helper.make_node(op, ["x"], ["y"], **attrs)], [("x", shape)])
    c = generate(prep.graph, lower(prep.graph, FusionGroup.single(0))).c_source
    c = c[c.index("void k_"):]
    assert c.count("#pragma omp simd") == 2 and "float rb[13];" in c
    assert "for (long long c = 0; c < 11LL; ++c)" in c and "rb[j * 2LL + 2LL]" in c
    assert c.count("FS_FMIN(") == 1 and c.count("FS_FMAX(") == 4  # the top row bounded; 2 + 2 maxima
    prep = _prepared(tmp_path, [helper.make_node("AveragePool", ["x"], ["y"], **attrs)], [("x", shape)])
    c = generate(prep.graph, lower(prep.graph, FusionGroup.single(0))).c_source
    assert "static const float fs_rh[6]" in c and "static const float fs_cw[6]" in c  # 1/count tables


def test_pool_under_an_epilogue_splits_the_column_loop_at_the_border(tmp_path):
    """C: a pool read by a pointwise epilogue runs unrolled in the epilogue's loop nest, its
    column loop split into the border columns (clamped taps bounded by -INFINITY) and the
    interior (plain strided loads, no check); a max reads a clamped tap as it is (the window's
    own edge element), so no -INFINITY bound is built."""
    nodes, inputs, _ = FUSED["maxpool-add-relu"]  # 11 columns in, 6 out: 0 and 5 cross an edge
    prep = _prepared(tmp_path, nodes, inputs)
    c = generate(prep.graph, lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))))).c_source
    c = c[c.index("void k_"):]
    assert c.count("#pragma omp simd") == 3 and c.count("FS_FMAX(") == 3 * 8 + 3  # taps, and the Relus
    assert all(f"for (long long j = {a}; j < {b}LL; ++j)" in c for a, b in (("0", 1), ("1LL", 5), ("5LL", 6)))
    interior = c[c.index("for (long long j = 1LL"):c.index("for (long long j = 5LL")]
    # the top row of the first output row is padding: read clamped, no bound; no column is checked
    assert "? 0 :" in c and "INFINITY" not in c
    assert "(j) * 2LL - 1LL" in interior and " < 11LL" not in interior


def test_every_pool_kernel_compiles_for_the_gpu(tmp_path):
    """The CUDA source of every pool kernel above (alone, and fused) compiles with NVRTC (or nvcc)
    for sm_80 and sm_90."""
    nvrtc = pytest.importorskip("fusesearch.backends.nvrtc")
    if not nvrtc.toolchain_available():
        pytest.skip("no CUDA compiler (NVRTC or nvcc)")
    models = [(*_pool_nodes(case, relu=False), ()) for case in POOLS] + list(FUSED.values())
    kernels = []
    for nodes, inputs, inits in models:
        folder = tmp_path / f"{len(kernels)}"
        folder.mkdir()
        prep = _prepared(folder, nodes, inputs, inits)
        kernel = lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))))
        kernels.append(generate(prep.graph, kernel, name=f"k{len(kernels)}"))
    source = "\n".join(f"namespace n{k.name} {{\n{k.cuda_source}\n}}" for k in kernels)
    for arch in nvrtc.ARCHES:
        result = nvrtc.compile_cuda(source, arch=arch)
        for gk in kernels:
            assert result.resource(gk.name).registers > 0, (gk.name, arch)
