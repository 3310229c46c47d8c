"""KernelSpec: plain data, validated, one flat table row."""

from __future__ import annotations

import numpy as np
import pytest

from costmodels import InvalidSpec, KernelSpec


def test_row_round_trip():
    """Serialization: to_row is flat scalars and from_row inverts it."""
    spec = KernelSpec("gemm", "float16", tc_flops=2e9, scalar_flops=1e6, dram_read_bytes=3e6,
                      dram_write_bytes=1e6, iteration_size=1 << 20, reduction_length=1024,
                      tile=(128, 128, 32), smem_bytes=32768, live_values_per_thread=80,
                      num_ops=3, op_types=("MatMul", "Add", "Relu"))
    row = spec.to_row()
    assert row["tile"] == "128x128x32" and row["op_types"] == "MatMul,Add,Relu"
    assert all(isinstance(v, str | int | float) for v in row.values())
    assert KernelSpec.from_row({**row, "measured_s": 1e-3}) == spec


def test_numpy_and_parquet_numbers_are_normalized():
    """Input coercion: numpy ints and integral floats (as read back from Parquet) become ints."""
    spec = KernelSpec("pointwise", iteration_size=np.int64(1024), smem_bytes=0.0,
                      dram_read_bytes=np.float32(4096))
    assert type(spec.iteration_size) is int and spec.iteration_size == 1024
    assert type(spec.smem_bytes) is int and type(spec.dram_read_bytes) is float
    assert spec.dram_bytes == 4096 and spec.flops == 0


@pytest.mark.parametrize("kwargs", [
    {"template": "fft"},
    {"template": "pointwise", "dtype": "float128"},
    {"template": "pointwise", "dram_read_bytes": -1},
    {"template": "pointwise", "scalar_flops": float("nan")},
    {"template": "pointwise", "iteration_size": 1.5},
    {"template": "pointwise", "threads_per_block": 0},
    {"template": "gemm", "tile": (128, 0, 32)},
    {"template": "pointwise", "smem_bytes": True},
])
def test_bad_specs_are_refused(kwargs):
    """Validation: unknown template or dtype, negative, non-finite or fractional counts."""
    with pytest.raises(InvalidSpec):
        KernelSpec(**kwargs)


def test_arithmetic_intensity():
    """Derived numbers: FLOPs per byte, inf when nothing moves."""
    assert KernelSpec("pointwise", scalar_flops=100, dram_read_bytes=50).arithmetic_intensity == 2
    assert KernelSpec("pointwise", scalar_flops=1).arithmetic_intensity == float("inf")
