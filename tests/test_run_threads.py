"""`run` with several OpenMP threads: whole programs equal ONNX Runtime at 2 and 3 threads.

A generated kernel splits its work by the thread count it finds when it runs (a conv's or a
GEMM's row blocks, `fs_threads()`; row kernels over OpenMP's static schedule), so a program that
equals ONNX Runtime on one thread proves nothing about two. Every zoo model, and a SqueezeNet 1.0
export as the ONNX model zoo ships it (opset 9, Fire modules, a Softmax over a [1, 1000, 1, 1]
tensor), runs as one program — the plan (greedy, host) and the unfused graph, each compiled once —
at 2 and then 3 threads (a second `run_plan` finds every object and program in the cache), each
checked against ONNX Runtime on seeded inputs. The text models run at their smallest useful sizes
(one layer, seq 16); the image models at their fixed 224x224; the slowest to compile under -m slow.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusesearch.api import plan as make_plan
from fusesearch.backends import cpu
from fusesearch.ir.shapes import ShapeBindings
from fusesearch.pipeline import prepare
from fusesearch.run import run_plan
from fusesearch.zoo import ZOO, build_model
from tests.conftest import SCALED_TWINS, save, zoo_params

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler")

THREADS = (2, 3)
SEQ = 16
# the smallest sizes at which a text model keeps every skeleton of its full size (rows of at least a
# micro-kernel's 16 columns, two heads); the scaled twins keep theirs
SMALL = {"bert-small": {"layers": 1, "hidden": 64, "heads": 2, "intermediate": 128, "vocab": 100},
         "gpt2": {"layers": 1, "hidden": 64, "heads": 2, "vocab": 100, "n_positions": SEQ}}


def squeezenet(size: int = 224, classes: int = 1000, seed: int = 0) -> onnx.ModelProto:
    """SqueezeNet 1.0 as the ONNX model zoo's squeezenet1.0-9 is laid out: opset 9, nodes n0..n65,
    conv 96 7x7/2 + Relu, MaxPool 3/2, eight Fire modules (squeeze 1x1 + Relu, expand 1x1 and 3x3
    + Relu, Concat on channels) with two more MaxPools, Dropout, conv10 1x1 to `classes` + Relu,
    GlobalAveragePool, Softmax (opset 9: axis 1 of the [1, classes, 1, 1] tensor) into
    'softmaxout_1'; He-scaled weights from a fixed seed."""
    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []
    weights: list[onnx.TensorProto] = []

    def node(op: str, inputs: list[str], output: str | None = None, **attrs) -> str:
        name = f"n{len(nodes)}"
        nodes.append(helper.make_node(op, inputs, [output or name], name=name, **attrs))
        return output or name

    def conv_relu(x: str, cin: int, cout: int, k: int, stride: int = 1, pad: int = 0) -> str:
        w, b = f"n{len(nodes)}_w", f"n{len(nodes)}_b"
        weights.append(numpy_helper.from_array(
            (rng.standard_normal((cout, cin, k, k)) * np.sqrt(2.0 / (cin * k * k))).astype(np.float32), w))
        weights.append(numpy_helper.from_array((rng.standard_normal(cout) * 0.01).astype(np.float32), b))
        y = node("Conv", [x, w, b], kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4)
        return node("Relu", [y])

    def fire(x: str, cin: int, squeeze: int, expand: int) -> tuple[str, int]:
        s = conv_relu(x, cin, squeeze, 1)
        return node("Concat", [conv_relu(s, squeeze, expand, 1), conv_relu(s, squeeze, expand, 3, pad=1)], axis=1), 2 * expand

    def pool(x: str) -> str:
        return node("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[0, 0, 1, 1])

    x, c = pool(conv_relu("data_0", 3, 96, 7, stride=2)), 96
    for i, (squeeze, expand) in enumerate(((16, 64), (16, 64), (32, 128), (32, 128), (48, 192), (48, 192),
                                           (64, 256), (64, 256))):
        x, c = fire(x, c, squeeze, expand)
        if i in (2, 6):
            x = pool(x)
    x = node("GlobalAveragePool", [conv_relu(node("Dropout", [x], ratio=0.5), c, classes, 1)])
    node("Softmax", [x], "softmaxout_1")
    graph = helper.make_graph(nodes, "squeezenet", [helper.make_tensor_value_info("data_0", TensorProto.FLOAT, [1, 3, size, size])],
                              [helper.make_tensor_value_info("softmaxout_1", TensorProto.FLOAT, [1, classes, 1, 1])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], ir_version=4)


def _model(name: str) -> onnx.ModelProto:
    return squeezenet() if name == "squeezenet" else build_model(name, **SMALL.get(name, {}))


def _dims(name: str) -> list[str]:
    """The zoo model's default dims (its file leaves them unbound), a text model's seq at SEQ."""
    dims = dict(ZOO[name].default_dims) if name in ZOO else {}
    return [f"{d}={SEQ if d == 'seq' else v}" for d, v in dims.items()]


# compiling a model's two programs dominates: cold, on this 2-core VM under load, vit-small took
# 451 s, resnet50 162, yolo-neck 138, mobilenetv2 108; resnet18 64, the SqueezeNet 55, unet 41,
# bert-small 31, gpt2 21, rnn-control 4 (18 min in all). The first four join the scaled twins
# under -m slow (`make test-all`), so `make test` keeps a CNN, a transformer encoder and decoder,
# a U-Net, control flow and the SqueezeNet.
HEAVY = (*SCALED_TWINS, "vit-small", "resnet50", "yolo-neck", "mobilenetv2")


@pytest.mark.parametrize("name", [*zoo_params(HEAVY), "squeezenet"])
def test_every_zoo_program_equals_ort_at_two_and_three_threads(name, tmp_path):
    path = save(_model(name), tmp_path / f"{name}.onnx")
    prep = prepare(path, ShapeBindings.parse(dims=_dims(name)))
    plan = make_plan(path, device="host", strategy="greedy", prepared=prep)
    unfused = make_plan(path, device="host", strategy="none", prepared=prep)
    for threads in THREADS:  # Mismatch names the first step that differs
        report = run_plan(prep, plan, unfused, threads=threads, time_it=False)
        assert report.threads == threads and report.kernels >= 1


def test_a_kernel_sharing_a_product_buffer_equals_ort_at_two_and_three_threads(tmp_path):
    """Attention's scores as one kernel (product into a shared buffer, then scaled, masked Softmax
    rows reading it, both worksharing loops of the kernel's one OpenMP region): at 2 and 3 threads,
    every thread reads the product the others wrote into the one buffer."""
    from tests.conftest import make_model

    rng = np.random.default_rng(4)
    nodes = [helper.make_node("MatMul", ["q", "k"], ["s"]), helper.make_node("Mul", ["s", "c"], ["sc"]),
             helper.make_node("Add", ["sc", "m"], ["sm"]), helper.make_node("Softmax", ["sm"], ["y"], axis=-1)]
    inits = [("c", np.array(0.125, dtype=np.float32)), ("m", rng.standard_normal((1, 1, 1, 48)).astype(np.float32))]
    path = save(make_model(nodes, [("q", [1, 2, 48, 16]), ("k", [1, 2, 16, 48])], [("y", None)], inits),
                tmp_path / "scores.onnx")
    prep = prepare(str(path))
    plan = make_plan(str(path), device="host", prepared=prep)
    unfused = make_plan(str(path), device="host", strategy="none", prepared=prep)
    assert any(len(g.nodes) == len(prep.graph) for g in plan.groups)
    for threads in THREADS:
        report = run_plan(prep, plan, unfused, threads=threads, time_it=False)
        assert report.threads == threads and report.kernels >= 1
