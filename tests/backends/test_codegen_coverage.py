"""The code generator covers every op OpKind calls fusible, and its code for the ops exported
models fuse most (Pad, HardSigmoid, GatherND, Resize linear, an unfolded BatchNormalization, the
remaining activations and math) equals ONNX Runtime: one node alone, and fused with the
neighbours exporters put around it, on the CPU backend and through the CUDA emulator; and every
such kernel's CUDA source compiles (NVRTC or nvcc) for sm_80 and sm_90."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from costmodels import RooflineModel, load_device
from fusesearch.backends import cpu, emulate
from fusesearch.backends.codegen import CAPABILITIES, GENERATED_OPS, cuda_module, generate
from fusesearch.candidates.rules import Legality
from fusesearch.groups import FusionGroup
from fusesearch.ir.canonicalize import to_proto
from fusesearch.ir.op_kind import OP_KINDS, OpKind
from fusesearch.lowering import lower
from fusesearch.pipeline import prepare
from fusesearch.verify import all_values, random_feeds
from tests.backends.test_codegen_cpu import whole_graph_as_one_group
from tests.backends.test_cuda_emulated import check as check_emulated
from tests.conftest import make_model, save

FUSIBLE = OpKind.REDUCE  # kind <= REDUCE may join a group (ANCHOR has its own templates)

# Fusible ops without a generator, and why. This list only shrinks: an op listed here that gains
# a generator fails `test_not_generated_lists_only_ops_without_a_generator`.
NOT_GENERATED = {
    "BitShift": "defined on unsigned integers only, which have no C type in the generator",
    "QuantizeLinear": "8-bit integer tensors have no C type in the generator",
    "DequantizeLinear": "8-bit integer tensors have no C type in the generator",
    "BitCast": "opset 26: reinterprets bits across dtypes; no ONNX Runtime release runs it to check against",
    "SwiGLU": "opset 28; no ONNX Runtime release runs it to check against",
    "RotaryEmbedding": "opset 23: a gather of the cos/sin caches at each token's position and the "
                       "rotation partner; not generated yet",
    "ConstantOfShape": "its shape is a tensor's value: folded by canonicalize when constant, else its "
                       "shape is not static and it never joins a group",
    "Range": "its shape is a tensor's value: folded by canonicalize when constant, else its shape is not "
             "static and it never joins a group",
    "Upsample": "deprecated since opset 10: the loader upgrades models to Resize (a model the converter "
                "cannot upgrade keeps it, and measure runs its group node by node)",
    "ReduceProd": "a product: the block reductions combine by sum or max",
    "GroupNormalization": "onnx's shape inference gives its output no shape, so it never joins a group "
                          "(lowering needs static shapes)",
}


def _fusible() -> list[str]:
    return sorted(op for op, kind in OP_KINDS.items() if kind <= FUSIBLE)


def test_every_fusible_op_has_a_generator_or_a_listed_reason():
    missing = [op for op in _fusible() if op not in GENERATED_OPS and op not in NOT_GENERATED]
    assert not missing, (f"OpKind calls {missing} fusible but the code generator has no code for them: "
                         "generate them, or list them in NOT_GENERATED with the reason")


def test_not_generated_lists_only_ops_without_a_generator():
    generated = sorted(op for op in NOT_GENERATED if op in GENERATED_OPS)
    assert not generated, f"{generated} have a generator now: remove them from NOT_GENERATED"
    stale = sorted(op for op in NOT_GENERATED if OP_KINDS.get(op, OpKind.OPAQUE) > FUSIBLE)
    assert not stale, f"{stale} are not fusible (OpKind): remove them from NOT_GENERATED"


needs_cc = pytest.mark.skipif(not cpu.available(), reason="no C compiler")
needs_cxx = pytest.mark.skipif(not emulate.available(), reason="no C++ compiler")


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def node(op, inputs, outputs=("y",), **attrs):
    return helper.make_node(op, list(inputs), list(outputs), **attrs)


def _to_unit(x="x", out="u"):  # tanh first: arguments inside (-1, 1) for asin, acos, atanh
    return node("Tanh", [x], [out])


def _above_one(x="x", out="u"):  # |x| + 1: arguments >= 1 for acosh
    return [node("Abs", [x], ["a"]), node("Add", ["a", "one"], [out])]


ONE = ("one", np.float32(1.0))
X = [("x", [2, 3, 4])]

# One row per op (a node alone, or behind the node that puts its input in its domain):
# id -> (nodes, graph inputs, initializers, opset)
SINGLE = {
    "HardSigmoid": ([node("HardSigmoid", ["x"], alpha=0.3, beta=0.4)], X, [], 17),
    "HardSigmoid-default": ([node("HardSigmoid", ["x"])], X, [], 17),
    "HardSwish": ([node("HardSwish", ["x"])], X, [], 17),
    "Mish": ([node("Mish", ["x"])], X, [], 18),
    "Softplus": ([node("Softplus", ["x"])], X, [], 17),
    "Softplus-Mish-large": ([node("Mul", ["x", "big"], ["xb"]), node("Softplus", ["xb"], ["sp"]),
                             node("Mish", ["xb"], ["m"]), node("Add", ["sp", "m"])], X, [("big", np.float32(200.0))], 18),
    "Selu": ([node("Selu", ["x"], alpha=1.5, gamma=1.1)], X, [], 17),
    "Celu": ([node("Celu", ["x"], alpha=0.7)], X, [], 17),
    "ThresholdedRelu": ([node("ThresholdedRelu", ["x"], alpha=0.3)], X, [], 17),
    "Shrink": ([node("Shrink", ["x"], lambd=0.4, bias=0.2)], X, [], 17),
    "PRelu": ([node("PRelu", ["x", "slope"])], [("x", [2, 3, 4, 5])],
              [("slope", rand(3, 1, 1, seed=1))], 17),
    "Gelu-tanh": ([node("Gelu", ["x"], approximate="tanh")], X, [], 20),
    "Gelu": ([node("Gelu", ["x"])], X, [], 20),
    "Erf": ([node("Erf", ["x"])], X, [], 17),
    "Asin": ([_to_unit(), node("Asin", ["u"])], X, [], 17),
    "Acos": ([_to_unit(), node("Acos", ["u"])], X, [], 17),
    "Atanh": ([_to_unit(), node("Atanh", ["u"])], X, [], 17),
    "Acosh": ([*_above_one(), node("Acosh", ["u"])], X, [ONE], 17),
    "Asinh": ([node("Asinh", ["x"])], X, [], 17),
    "Atan": ([node("Atan", ["x"])], X, [], 17),
    "Sinh": ([node("Sinh", ["x"])], X, [], 17),
    "Cosh": ([node("Cosh", ["x"])], X, [], 17),
    "Tan": ([node("Tan", ["x"])], X, [], 17),
    "IsNaN-IsInf": ([node("Log", ["x"], ["l"]), node("Div", ["x", "zero"], ["d"]),
                     node("IsNaN", ["l"], ["n"]), node("IsInf", ["d"], ["i"], detect_negative=0),
                     node("Or", ["n", "i"], ["o"]), node("Cast", ["o"], ["y"], to=TensorProto.FLOAT)],
                    X, [("zero", np.zeros(4, np.float32))], 17),
    "Mod-float": ([node("Mod", ["x", "m"], fmod=1)], X, [("m", np.float32([0.7, -0.5, 1.3, -1.1]))], 17),
    "Mod-int": ([node("Cast", ["x"], ["c"], to=TensorProto.INT64), node("Mul", ["c", "k"], ["ck"]),
                 node("Mod", ["ck", "m"], ["r"]), node("Mod", ["ck", "m"], ["f"], fmod=1),
                 node("Sub", ["r", "f"], ["d"]), node("Cast", ["d"], ["y"], to=TensorProto.FLOAT)],
                X, [("k", np.int64(7)), ("m", np.int64([3, -4, 5, -2]))], 17),
    "Bitwise": ([node("Cast", ["x"], ["c"], to=TensorProto.INT32), node("Mul", ["c", "k"], ["ck"]),
                 node("BitwiseAnd", ["ck", "m"], ["a"]), node("BitwiseXor", ["a", "ck"], ["b"]),
                 node("BitwiseNot", ["b"], ["n"]), node("BitwiseOr", ["n", "m"], ["o"]),
                 node("Cast", ["o"], ["y"], to=TensorProto.FLOAT)],
                X, [("k", np.int32(37)), ("m", np.int32([3, 12, 96, 7]))], 18),
    "BatchNormalization": ([node("Relu", ["x"], ["r"]),
                            node("BatchNormalization", ["r", "s", "b", "mean", "var"], epsilon=1e-3)],
                           [("x", [2, 3, 4, 5])],
                           [("s", rand(3, seed=1)), ("b", rand(3, seed=2)), ("mean", rand(3, seed=3)),
                            ("var", np.float32([0.5, 1.0, 2.0]))], 15),
    "Pad-constant": ([node("Pad", ["x", "pads", "v"], mode="constant")], [("x", [1, 2, 4, 5])],
                     [("pads", np.int64([0, 0, 1, 2, 0, 0, 2, 1])), ("v", np.float32(-1.5))], 18),
    "Pad-reflect": ([node("Pad", ["x", "pads"], mode="reflect")], [("x", [1, 2, 4, 5])],
                    [("pads", np.int64([0, 0, 2, 3, 0, 0, 3, 1]))], 18),
    "Pad-edge": ([node("Pad", ["x", "pads"], mode="edge")], [("x", [1, 2, 4, 5])],
                 [("pads", np.int64([0, 0, 3, 0, 0, 0, 1, 4]))], 18),
    "Pad-negative": ([node("Pad", ["x", "pads"], mode="constant")], [("x", [1, 2, 4, 5])],
                     [("pads", np.int64([0, 0, -1, 2, 0, 0, 1, -2]))], 18),
    "Pad-axes": ([node("Pad", ["x", "pads", "", "axes"], mode="edge")], [("x", [1, 2, 4, 5])],
                 [("pads", np.int64([1, 2, 2, 1])), ("axes", np.int64([-1, 2]))], 18),
    "Pad-opset10-attribute": ([node("Pad", ["x"], mode="constant", pads=[0, 1, 1, 0, 2, 0], value=0.5)],
                              [("x", [2, 3, 4])], [], 10),
    "GatherND": ([node("GatherND", ["x", "idx"])], [("x", [3, 4, 5])],
                 [("idx", np.int64([[[0, 1], [2, -1]], [[1, 3], [0, 0]]]))], 17),
    "GatherND-batch": ([node("GatherND", ["x", "idx"], batch_dims=1)], [("x", [3, 4, 5])],
                       [("idx", np.int64([[[1], [3]], [[0], [2]], [[-1], [1]]]))], 17),
    "GatherND-input-indices": ([node("Relu", ["x"], ["r"]), node("GatherND", ["r", "idx"])],
                               [("x", [2, 3, 4]), ("idx", [5, 2], TensorProto.INT64)], [], 17),
    "GatherElements": ([node("GatherElements", ["x", "idx"], axis=1)], [("x", [3, 4])],
                       [("idx", np.int64([[0, 3], [-1, 1], [2, 2]]))], 17),
    "Tile": ([node("Tile", ["x", "rep"])], X, [("rep", np.int64([2, 1, 3]))], 17),
    "DepthToSpace-DCR": ([node("DepthToSpace", ["x"], blocksize=2)], [("x", [1, 8, 2, 3])], [], 17),
    "DepthToSpace-CRD": ([node("DepthToSpace", ["x"], blocksize=2, mode="CRD")], [("x", [1, 8, 2, 3])], [], 17),
    "SpaceToDepth": ([node("SpaceToDepth", ["x"], blocksize=2)], [("x", [1, 2, 4, 6])], [], 17),
    "Trilu": ([node("Trilu", ["x", "k"], upper=0)], [("x", [2, 4, 5])], [("k", np.int64(1))], 17),
    "OneHot": ([node("OneHot", ["i", "depth", "vals"], axis=1)], [("i", [2, 3], TensorProto.INT64)],
               [("depth", np.int64(4)), ("vals", np.float32([-1.0, 2.0]))], 17),
    "ReverseSequence": ([node("ReverseSequence", ["x", "lens"], batch_axis=0, time_axis=1)], [("x", [3, 4, 2])],
                        [("lens", np.int64([4, 1, 3]))], 17),
    "CenterCropPad": ([node("CenterCropPad", ["x", "shape"])], [("x", [5, 4, 3])],
                      [("shape", np.int64([3, 7, 3]))], 18),
    "Resize-linear-half_pixel": ([node("Resize", ["x", "", "scales"], mode="linear")], [("x", [1, 2, 4, 5])],
                                 [("scales", np.float32([1, 1, 2, 1.5]))], 18),
    "Resize-linear-pytorch_half_pixel": ([node("Resize", ["x", "", "", "sizes"], mode="linear",
                                               coordinate_transformation_mode="pytorch_half_pixel")],
                                         [("x", [1, 2, 4, 5])], [("sizes", np.int64([1, 2, 7, 1]))], 18),
    "Resize-linear-align_corners": ([node("Resize", ["x", "", "", "sizes"], mode="linear",
                                          coordinate_transformation_mode="align_corners")],
                                    [("x", [1, 2, 4, 5])], [("sizes", np.int64([1, 2, 8, 3]))], 18),
    "Resize-linear-asymmetric": ([node("Resize", ["x", "", "scales"], mode="linear",
                                       coordinate_transformation_mode="asymmetric")],
                                 [("x", [1, 2, 4, 5])], [("scales", np.float32([1, 1, 2, 2]))], 18),
    "Resize-linear-downsample": ([node("Resize", ["x", "", "scales"], mode="linear")], [("x", [1, 2, 6, 8])],
                                 [("scales", np.float32([1, 1, 0.5, 0.75]))], 18),
    "Resize-nearest-align_corners": ([node("Resize", ["x", "", "", "sizes"], mode="nearest",
                                           coordinate_transformation_mode="align_corners",
                                           nearest_mode="round_prefer_ceil")],
                                     [("x", [1, 2, 4, 5])], [("sizes", np.int64([1, 2, 7, 9]))], 18),
    # PyTorch's nearest upsampling (asymmetric, floor): integer factors index by i / s in integers,
    # fractional ones through the float coordinate
    "Resize-nearest-asymmetric-floor": ([node("Resize", ["x", "", "scales"], mode="nearest",
                                              coordinate_transformation_mode="asymmetric", nearest_mode="floor")],
                                        [("x", [1, 2, 5, 3])], [("scales", np.float32([1, 1, 2, 3]))], 18),
    "Resize-nearest-asymmetric-floor-fraction": ([node("Resize", ["x", "", "scales"], mode="nearest",
                                                       coordinate_transformation_mode="asymmetric",
                                                       nearest_mode="floor")],
                                                 [("x", [1, 2, 4, 5])], [("scales", np.float32([1, 1, 1.5, 2.5]))], 18),
    "Row-reductions": ([node("Mul", ["x", "k"], ["a"]), node("Abs", ["a"], ["b"]),
                        *[node(op, [src, "axes"], [f"r{i}"]) for i, (op, src) in enumerate(
                            [("ReduceMin", "a"), ("ReduceL1", "a"), ("ReduceL2", "a"), ("ReduceSumSquare", "a"),
                             ("ReduceLogSumExp", "a"), ("ReduceLogSum", "b")])],
                        node("Sum", [f"r{i}" for i in range(6)])],
                       [("x", [3, 4, 10])], [("k", np.float32(1.5)), ("axes", np.int64([-1]))], 18),
    "GlobalMaxPool": ([node("Relu", ["x"], ["r"]), node("GlobalMaxPool", ["r"])], [("x", [2, 3, 4, 5])], [], 17),
    # index pairs a + 512·b as float (exact): ties at the zeros of the Relu pick the first / last index
    "ArgMax-ArgMin": ([node("Relu", ["x"], ["r"]), node("ArgMax", ["r"], ["a"], axis=-1),
                       node("ArgMin", ["r"], ["b"], axis=-1, select_last_index=1), node("Mul", ["b", "k"], ["bk"]),
                       node("Add", ["a", "bk"], ["s"]), node("Cast", ["s"], ["y"], to=TensorProto.FLOAT)],
                      [("x", [3, 4, 300])], [("k", np.int64(512))], 17),
    "Hardmax": ([node("Relu", ["x"], ["r"]), node("Hardmax", ["r"], ["h"], axis=-1), node("Add", ["h", "r"])],
                [("x", [3, 4, 300])], [], 17),
    "ArgMin-ArgMax-last": ([node("Relu", ["x"], ["r"]), node("ArgMin", ["r"], ["a"], axis=-1, keepdims=0),
                            node("ArgMax", ["x"], ["b"], axis=2, keepdims=0, select_last_index=1),
                            node("Mul", ["b", "k"], ["bk"]), node("Add", ["a", "bk"], ["s"]),
                            node("Cast", ["s"], ["y"], to=TensorProto.FLOAT)],
                           [("x", [3, 4, 300])], [("k", np.int64(512))], 17),
    "GlobalLpPool": ([node("Relu", ["x"], ["r"]), node("GlobalLpPool", ["r"], ["a"]),
                      node("GlobalLpPool", ["x"], ["b"], p=3), node("GlobalLpPool", ["x"], ["c"], p=1),
                      node("Sum", ["a", "b", "c"])], [("x", [2, 3, 4, 5])], [], 17),
    "InstanceNormalization": ([node("Add", ["x", "one"], ["a"]),
                               node("InstanceNormalization", ["a", "s", "b"], epsilon=1e-3)],
                              [("x", [2, 3, 4, 5])], [ONE, ("s", rand(3, seed=1)), ("b", rand(3, seed=2))], 17),
    "MeanVarianceNormalization": ([node("Relu", ["x"], ["r"]), node("MeanVarianceNormalization", ["r"], axes=[2, 3])],
                                  [("x", [2, 3, 4, 5])], [], 13),
    "RMSNormalization": ([node("Mul", ["x", "k"], ["a"]), node("RMSNormalization", ["a", "s"], axis=-2, epsilon=1e-3)],
                         [("x", [2, 3, 4, 5])], [("k", np.float32(2.0)), ("s", rand(4, 5, seed=3))], 23),
    "LpNormalization": ([node("LpNormalization", ["x"], ["a"], axis=-1),
                         node("LpNormalization", ["x"], ["b"], axis=-1, p=1), node("Add", ["a", "b"])],
                        [("x", [3, 4, 6])], [], 17),
    "CastLike": ([node("Mul", ["x", "k"], ["xk"]), node("CastLike", ["xk", "like"], ["c"]),
                  node("Cast", ["c"], ["y"], to=TensorProto.FLOAT)], X,
                 [("k", np.float32(9.0)), ("like", np.int64([1]))], 17),
}


@needs_cc
@pytest.mark.parametrize("case", list(SINGLE))
def test_op_on_the_cpu_backend_equals_onnx_runtime(tmp_path, case):
    nodes, inputs, inits, opset = SINGLE[case]
    outputs = [(o, None) for o in nodes[-1].output]
    whole_graph_as_one_group(tmp_path, nodes, inputs, outputs, inits, opset=opset)


# Fused with the neighbours exporters put around them: (nodes, inputs, inits, opset)
FUSED = {
    # MobileNetV3 / PP-LCNet (paddle): conv, then x * hardsigmoid(x) as two nodes
    "Conv-HardSigmoid-Mul": ([node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
                              node("HardSigmoid", ["c"], ["h"], alpha=1 / 6, beta=0.5),
                              node("Mul", ["c", "h"])],
                             [("x", [1, 3, 6, 7])], [("w", rand(8, 3, 3, 3, seed=1)), ("b", rand(8, seed=2))], 17),
    # torch reflection / replication padding before a conv without pads
    "Pad-reflect-Conv": ([node("Pad", ["x", "pads"], ["p"], mode="reflect"),
                          node("Conv", ["p", "w"], ["c"]), node("Relu", ["c"])],
                         [("x", [1, 4, 6, 6])], [("pads", np.int64([0, 0, 1, 1, 0, 0, 1, 1])),
                                                 ("w", rand(8, 4, 3, 3, seed=3))], 18),
    "Pad-constant-Conv": ([node("Pad", ["x", "pads"], ["p"]), node("Conv", ["p", "w"], strides=[2, 2])],
                          [("x", [1, 4, 7, 6])], [("pads", np.int64([0, 0, 1, 0, 0, 0, 2, 1])),
                                                  ("w", rand(6, 4, 3, 3, seed=4))], 18),
    # FPN / segmentation heads: conv then a bilinear upsample
    "Conv-Resize-linear": ([node("Conv", ["x", "w"], ["c"]),
                            node("Resize", ["c", "", "scales"], mode="linear")],
                           [("x", [1, 3, 5, 6])], [("w", rand(4, 3, 1, 1, seed=5)),
                                                   ("scales", np.float32([1, 1, 2, 2]))], 18),
    # a BatchNormalization canonicalize cannot fold (after an Add, not a conv)
    "Add-BatchNormalization-Relu": ([node("Add", ["x", "z"], ["a"]),
                                     node("BatchNormalization", ["a", "s", "b", "mean", "var"], ["n"]),
                                     node("Relu", ["n"])],
                                    [("x", [2, 4, 3, 3]), ("z", [2, 4, 3, 3])],
                                    [("s", rand(4, seed=6)), ("b", rand(4, seed=7)), ("mean", rand(4, seed=8)),
                                     ("var", np.float32([0.5, 1.0, 2.0, 3.0]))], 15),
    # paddle gather_nd behind an activation, then a scale
    "Relu-GatherND-Mul": ([node("Relu", ["x"], ["r"]), node("GatherND", ["r", "idx"], ["g"]),
                           node("Mul", ["g", "s"])],
                          [("x", [4, 6, 3])], [("idx", np.int64([[1, 2], [3, 0], [0, 5]])), ("s", np.float32(0.5))],
                          17),
    "MatMul-Mish": ([node("MatMul", ["x", "w"], ["m"]), node("Mish", ["m"])],
                    [("x", [5, 12])], [("w", rand(12, 9, seed=9))], 18),
}


@needs_cc
@pytest.mark.parametrize("case", list(FUSED))
def test_fused_with_neighbours_on_the_cpu_backend(tmp_path, case):
    nodes, inputs, inits, opset = FUSED[case]
    prep = whole_graph_as_one_group(tmp_path, nodes, inputs, [("y", None)], inits, opset=opset)
    assert len(prep.graph) == len(nodes)  # nothing folded away: the fused group is what ran


def _prepared(tmp_path, nodes, inputs, inits, opset):
    path = save(make_model(nodes, inputs, [(o, None) for o in nodes[-1].output], inits, opset=opset),
                tmp_path / "m.onnx")
    prep = prepare(path)
    canonical = to_proto(prep.canonical)
    return prep, all_values(canonical, random_feeds(canonical, 0))


EMULATED = {
    "HardSigmoid": (SINGLE, "vectorized"), "Mish": (SINGLE, "vectorized"), "Pad-reflect": (SINGLE, "grid-stride"),
    "GatherND": (SINGLE, "grid-stride"), "Resize-linear-half_pixel": (SINGLE, "grid-stride"),
    "Resize-nearest-asymmetric-floor": (SINGLE, "grid-stride"),
    "BatchNormalization": (SINGLE, "vectorized"), "Conv-HardSigmoid-Mul": (FUSED, "mma-tf32"),
    "Pad-constant-Conv": (FUSED, "mma-tf32"), "Conv-Resize-linear": (FUSED, "direct"),
    "Row-reductions": (SINGLE, "block-per-row"), "GlobalMaxPool": (SINGLE, "block-per-row"),
    "ArgMax-ArgMin": (SINGLE, "block-per-row"), "ArgMin-ArgMax-last": (SINGLE, "block-per-row"),
    "Hardmax": (SINGLE, "block-per-row"),
    "InstanceNormalization": (SINGLE, "block-per-row"), "LpNormalization": (SINGLE, "block-per-row"),
    "RMSNormalization": (SINGLE, "block-per-row"), "MeanVarianceNormalization": (SINGLE, "block-per-row"),
}


@needs_cxx
@pytest.mark.parametrize("case", list(EMULATED))
def test_cuda_kernel_emulated_equals_onnx_runtime(tmp_path, case):
    table, skeleton = EMULATED[case]
    prep, values = _prepared(tmp_path, *table[case])
    check_emulated(prep, values, range(len(prep.graph)), skeleton)


@pytest.mark.parametrize("case", ["Conv-HardSigmoid-Mul", "Pad-reflect-Conv", "Conv-Resize-linear",
                                  "Add-BatchNormalization-Relu", "Relu-GatherND-Mul"])
def test_legality_accepts_the_fused_group(tmp_path, case):
    """Lowering and the legality rules take these groups whole, so a plan can fuse them."""
    prep, _ = _prepared(tmp_path, *FUSED[case])
    device, params = load_device("h100-sxm")
    verdict = Legality(prep.graph, device, RooflineModel(params), CAPABILITIES).check(range(len(prep.graph)))
    assert verdict.decision, verdict.decision.reason
    assert lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph))))).template != "opaque"


def test_every_new_kernel_compiles_for_the_gpu(tmp_path):
    """The CUDA source of every kernel above compiles with NVRTC (or nvcc) for sm_80 and sm_90."""
    nvrtc = pytest.importorskip("fusesearch.backends.nvrtc")
    if not nvrtc.toolchain_available():
        pytest.skip("no CUDA compiler (NVRTC or nvcc)")
    kernels = []
    for table in (SINGLE, FUSED):
        for nodes, inputs, inits, opset in table.values():
            folder = tmp_path / f"{len(kernels)}"
            folder.mkdir()
            path = save(make_model(nodes, inputs, [(o, None) for o in nodes[-1].output], inits, opset=opset),
                        folder / "m.onnx")
            prep = prepare(path)
            kernel = lower(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))))
            kernels.append(generate(prep.graph, kernel, name=f"k{len(kernels)}"))
    source = cuda_module(kernels)  # each in its namespace, the #include lines first
    for arch in nvrtc.ARCHES:
        result = nvrtc.compile_cuda(source, arch=arch)
        for gk in kernels:
            assert result.resource(gk.name).registers > 0, (gk.name, arch)


@needs_cc
@pytest.mark.parametrize(("opset", "op", "mode", "scales"), [
    (9, "Upsample", "linear", [1, 1, 2, 2]), (9, "Upsample", "nearest", [1, 1, 1.5, 2.5]),
    (10, "Resize", "linear", [1, 1, 0.5, 0.75]), (10, "Resize", "linear", [1, 1, 2, 3])])
def test_resize_of_old_opsets_equals_onnx_runtime_on_the_original_model(tmp_path, opset, op, mode, scales):
    """Upsample and Resize-10 interpolate at asymmetric coordinates; the upgraded model must too."""
    import onnxruntime as ort

    model = make_model([node(op, ["x", "s"], mode=mode)], [("x", [1, 2, 6, 8])], [("y", None)],
                       [("s", np.float32(scales))], opset=opset)
    path = save(model, tmp_path / "m.onnx")
    x = rand(1, 2, 6, 8)
    (ref,) = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    prep = prepare(path)
    gk = generate(prep.graph, lower(prep.graph, FusionGroup(frozenset({0}))))
    feeds = {a.tensor: x if a.tensor == "x" else prep.graph.constant_value(a.tensor) for a in gk.inputs}
    got = cpu.run(gk, feeds)[gk.outputs[0].tensor]
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * max(1.0, float(np.abs(ref).max())))


@pytest.mark.parametrize(("case", "float_axes"), [("Resize-nearest-asymmetric-floor", 0),
                                                  ("Resize-nearest-asymmetric-floor-fraction", 2)])
def test_a_nearest_integer_upscale_indexes_in_integers(tmp_path, case, float_axes):
    """An axis upsampled by an integer factor at asymmetric coordinates with floor reads its source
    at i / s (no float coordinate, no floorf, so the loop vectorizes: yolo-neck's Resize went from
    76 to 9 us); a fractional factor keeps the float coordinate, one floorf per axis."""
    nodes, inputs, inits, opset = SINGLE[case]
    path = save(make_model(nodes, inputs, [("y", None)], inits, opset=opset), tmp_path / "m.onnx")
    prep = prepare(path)
    gk = generate(prep.graph, lower(prep.graph, FusionGroup(frozenset({0}))))
    assert gk.c_source.count("floorf(") == float_axes
    assert ("/ 2LL" in gk.c_source and "/ 3LL" in gk.c_source) == (float_axes == 0)


def test_a_group_the_generator_cannot_write_is_not_a_candidate(tmp_path):
    """Legality refuses a fused group holding an op without a generator (ReduceProd after a Relu),
    naming it; each op alone stays a candidate (a library call), so the plan still covers it."""
    model = make_model([node("Relu", ["x"], ["r"]), node("ReduceProd", ["r"], ["y"], axes=[-1], keepdims=0)],
                       [("x", [4, 8])], [("y", None)], opset=17)
    prep = prepare(str(save(model, tmp_path / "prod.onnx")))
    device, params = load_device("h100-sxm")
    legality = Legality(prep.graph, device, RooflineModel(params), CAPABILITIES)
    verdict = legality.check({0, 1})
    assert not verdict.decision and "ReduceProd" in verdict.decision.reason and "no code generator" in verdict.decision.reason
    assert legality.check({0}).decision and legality.check({1}).decision
