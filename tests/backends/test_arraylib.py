"""The array-library kernels (`backends.arraylib`) equal ONNX Runtime: with numpy here, and the
very same functions with cupy on a GPU (tests marked `gpu`, skipped without one)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from onnx import helper

from fusesearch.backends import arraylib
from fusesearch.backends.codegen.mma import TOLERANCE
from fusesearch.verify import run
from tests.conftest import make_model

RNG = np.random.default_rng(7)


def _f(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


# (op, attrs, inputs (None = omitted optional input))
CASES = {
    "matmul-2d": ("MatMul", {}, [_f(5, 7), _f(7, 3)]),
    "matmul-batched-broadcast": ("MatMul", {}, [_f(2, 3, 5, 8), _f(8, 4)]),
    "gemm-bias": ("Gemm", {"transB": 1}, [_f(4, 6), _f(5, 6), _f(5)]),
    "gemm-trans-alpha-beta": ("Gemm", {"transA": 1, "alpha": 0.5, "beta": 2.0}, [_f(6, 4), _f(6, 5), _f(4, 5)]),
    "gemm-no-bias": ("Gemm", {}, [_f(3, 4), _f(4, 2)]),
    "conv-resnet-stem": ("Conv", {"kernel_shape": [7, 7], "pads": [3, 3, 3, 3], "strides": [2, 2]},
                         [_f(1, 3, 20, 18), _f(8, 3, 7, 7), _f(8)]),
    "conv-grouped-dilated": ("Conv", {"group": 2, "dilations": [2, 1], "pads": [1, 0, 2, 1], "strides": [1, 2]},
                             [_f(2, 4, 9, 8), _f(6, 2, 3, 3), None]),
    "conv-depthwise-same-upper": ("Conv", {"group": 4, "auto_pad": "SAME_UPPER", "strides": [2, 2]},
                                  [_f(1, 4, 7, 6), _f(4, 1, 3, 3), _f(4)]),
    "conv-1d": ("Conv", {"pads": [1, 1]}, [_f(2, 3, 10), _f(5, 3, 3), _f(5)]),
    "conv-3d": ("Conv", {"strides": [1, 2, 1]}, [_f(1, 2, 4, 5, 4), _f(3, 2, 2, 2, 2), None]),
    "conv-transpose-unet": ("ConvTranspose", {"strides": [2, 2], "kernel_shape": [2, 2]},
                            [_f(1, 4, 5, 6), _f(4, 3, 2, 2), _f(3)]),
    "conv-transpose-pads-outpad-group": ("ConvTranspose", {"strides": [2, 3], "pads": [1, 0, 2, 1], "group": 2,
                                                           "output_padding": [1, 2], "dilations": [1, 2]},
                                         [_f(2, 4, 5, 4), _f(4, 3, 3, 3), _f(6)]),
    "maxpool-resnet": ("MaxPool", {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]}, [_f(1, 3, 11, 12)]),
    "maxpool-ceil-dilated": ("MaxPool", {"kernel_shape": [3, 2], "strides": [2, 2], "ceil_mode": 1, "dilations": [1, 2]},
                             [_f(2, 2, 10, 9)]),
    "maxpool-1d": ("MaxPool", {"kernel_shape": [2], "strides": [2]}, [_f(2, 3, 9)]),
    "avgpool-exclude-pad-ceil": ("AveragePool", {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2],
                                                 "ceil_mode": 1}, [_f(1, 2, 8, 9)]),
    "avgpool-include-pad": ("AveragePool", {"kernel_shape": [3, 2], "pads": [1, 0, 1, 1], "strides": [1, 2],
                                            "count_include_pad": 1}, [_f(1, 2, 7, 7)]),
    "global-average-pool": ("GlobalAveragePool", {}, [_f(2, 3, 5, 4)]),
    "global-max-pool": ("GlobalMaxPool", {}, [_f(2, 3, 5, 4)]),
}


def _reference(op: str, attrs: dict, inputs: list) -> np.ndarray:
    names = [f"i{k}" if x is not None else "" for k, x in enumerate(inputs)]
    node = helper.make_node(op, names, ["y"], **attrs)
    feeds = {n: x for n, x in zip(names, inputs, strict=True) if n}
    model = make_model([node], [(n, list(x.shape)) for n, x in feeds.items()], [("y", None)], opset=19)
    return run(model, feeds)["y"]


def _check(xp, case: str, atol: float = 1e-5) -> None:
    op, attrs, inputs = CASES[case]
    assert arraylib.supports(op, attrs), op
    ref = _reference(op, attrs, inputs)
    (got,) = arraylib.run(xp, op, attrs, [xp.asarray(x) if x is not None else None for x in inputs])
    got = got.get() if hasattr(got, "get") else got  # a cupy array comes back to the host
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, ref.shape, got.dtype)
    scale = max(1.0, float(np.max(np.abs(ref))))
    np.testing.assert_allclose(got.astype(np.float64), ref.astype(np.float64), rtol=0, atol=atol * scale)


@pytest.mark.parametrize("case", list(CASES))
def test_numpy_equals_onnx_runtime(case):
    _check(np, case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_cupy_equals_onnx_runtime(case):
    """With CUPY_TF32=1 (as gpu_check.sh runs, like ONNX Runtime's CUDA provider) cuBLAS rounds
    float32 operands to TF32: held to the tensor-core kernels' tolerance then."""
    tf32 = os.environ.get("CUPY_TF32") == "1"
    _check(pytest.importorskip("cupy"), case, atol=TOLERANCE["mma-tf32"] if tf32 else 1e-5)


def test_unsupported_nodes_are_refused_with_a_reason():
    assert not arraylib.supports("TopK", {})
    assert "no array-library implementation" in arraylib.supports("TopK", {}).reason
    assert "Indices" in arraylib.supports("MaxPool", {"kernel_shape": [2]}, n_outputs=2).reason
    assert not arraylib.supports("ConvTranspose", {"output_shape": [4, 4]})
    with pytest.raises(ValueError, match="Loop"):
        arraylib.run(np, "Loop", {}, [])
