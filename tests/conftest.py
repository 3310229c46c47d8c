"""Shared test helpers: tiny ONNX models built in code, the CLI runner, and the GPU marker.

Tests marked `gpu` skip only where no GPU can be: CuPy is not installed, or the CUDA runtime sees
no device (none present, or hidden by CUDA_VISIBLE_DEVICES). Any other failure — CuPy installed
but failing to import (a missing CUDA library), a driver too old for the runtime, a device that
errors — makes every gpu test an error that names it: a broken GPU setup must never read as
"no GPU here".
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusesearch.cli import main as cli_main
from fusesearch.zoo import ZOO

# bert-base and vit-base are bert-small's and vit-small's builders at a larger size: the same ops,
# the same fusion groups and skeletons, larger extents. The sweeps over every kernel of every zoo
# model run them under -m slow only (`make test-all`), keeping `make test` within CI's time.
SCALED_TWINS = ("bert-base", "vit-base")


def zoo_params(slow=SCALED_TWINS) -> list:
    """Every zoo model as a pytest parameter, those in `slow` marked slow."""
    return [pytest.param(name, marks=pytest.mark.slow) if name in slow else name for name in ZOO]


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


CUDA_NO_DEVICE = 100  # cudaErrorNoDevice
CUDA_INSUFFICIENT_DRIVER = 35  # cudaErrorInsufficientDriver: also what the runtime says with no driver at all
NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")  # present wherever the NVIDIA kernel driver is loaded


@functools.cache
def gpu_state() -> tuple[str, str]:
    """("ready" | "absent" | "broken", why): absent only when CuPy is not installed or no GPU is visible."""
    try:
        import cupy
    except ModuleNotFoundError as exc:
        if exc.name == "cupy":
            return "absent", "CuPy is not installed (pip install 'fusesearch[gpu]')"
        return "broken", f"CuPy is installed but does not import: {type(exc).__name__}: {exc}"
    except Exception as exc:  # a CUDA library missing or mismatched: anything can come out of the import
        return "broken", f"CuPy is installed but does not import: {type(exc).__name__}: {exc}"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        status = getattr(exc, "status", None)
        if status == CUDA_NO_DEVICE or (status == CUDA_INSUFFICIENT_DRIVER and not NVIDIA_DRIVER.exists()):
            return "absent", f"no GPU visible ({type(exc).__name__}: {exc})"
        return "broken", f"the CUDA runtime fails: {type(exc).__name__}: {exc}"
    if count == 0:
        return "absent", "no GPU visible (the CUDA runtime sees 0 devices)"
    return "ready", f"{count} CUDA device(s)"


def gpu_available() -> bool:
    return gpu_state()[0] == "ready"


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    state, why = gpu_state()
    if state == "absent":
        skip = pytest.mark.skip(reason=f"needs an NVIDIA GPU with CuPy: {why}")
        for item in gpu_items:
            item.add_marker(skip)


def pytest_runtest_setup(item):
    if "gpu" in item.keywords:
        state, why = gpu_state()
        if state == "broken":
            pytest.fail(f"GPU test cannot run: {why}", pytrace=False)
