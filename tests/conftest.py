"""Shared test helpers: tiny ONNX models built in code, the CLI runner, and the GPU marker."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusesearch.cli import main as cli_main


def make_model(nodes, inputs, outputs, initializers=(), opset=17, name="t"):
    """A model from helper pieces; `inputs`/`outputs` are (name, shape) or ValueInfoProtos."""
    def vi(x, elem=TensorProto.FLOAT):
        if isinstance(x, onnx.ValueInfoProto):
            return x
        return helper.make_tensor_value_info(x[0], x[2] if len(x) > 2 else elem, x[1])

    graph = helper.make_graph(list(nodes), name, [vi(i) for i in inputs], [vi(o) for o in outputs],
                              [numpy_helper.from_array(np.asarray(a), n) for n, a in initializers])
    opsets = [helper.make_opsetid("", opset)]
    return helper.make_model(graph, opset_imports=opsets,
                             ir_version=max(7, helper.find_min_ir_version_for(opsets)))


def save(model: onnx.ModelProto, path) -> str:
    path.write_bytes(model.SerializeToString())
    return str(path)


@pytest.fixture
def run_cli(capsys):
    """Run the CLI in-process: returns (exit code, stdout, stderr)."""
    def run(*args):
        code = cli_main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err
    return run


def gpu_available() -> bool:
    try:
        from fusesearch.backends.cupy import gpu_count  # noqa: F401
    except Exception:
        return False
    return gpu_count() > 0


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not gpu_available():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU with CuPy")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
