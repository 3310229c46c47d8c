"""`KernelSpec`: the numbers a cost model needs about one kernel, and nothing about graphs.

Problem: the cost model must score a fused group without knowing what a graph is (as XLA's
gpu_performance_model scores a fusion from its cost analysis, not from the pass that asks).
Approach: the graph side (`fusesearch.lowering`) reduces a group to counts — FLOPs split by the
unit that runs them, DRAM bytes, iteration space, resource requests — and hands over this plain
record; `costmodels` turns it into time. `to_row()` / `from_row()` make it one flat table row
(measurements are stored as Parquet rows of specs and times).
Invariants: frozen; every count is finite and non-negative; `template` and `dtype` come from the
closed lists below; `tile` and `op_types` are tuples.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from costmodels.errors import InvalidSpec

TEMPLATES = ("pointwise", "rowwise", "gemm", "conv", "conv_disjoint", "depthwise", "opaque")
IMPLS = ("generated", "library")  # our generated kernel, or a vendor library call (cuBLAS, MLAS, ...)
UNITS = ("tensor-core", "cuda-core", "cpu-simd", "none")  # the main loop's instruction class (cpu-simd: C only)
# how a generated gemm/conv's product runs in C (`fusesearch.schedule.Schedule.product`)
# ("nchwc-chain": a 1x1 conv and the depthwise conv after it in one NCHWc kernel, `anchor_chain`)
CPU_PRODUCTS = ("own", "blas", "loops", "band", "packed", "rows", "im2col", "depthwise", "nchwc", "nchwc-chain")
TEMPLATE_PRODUCTS = {"gemm": ("own", "blas", "loops"),
                     "conv": ("band", "packed", "rows", "im2col", "loops", "nchwc", "nchwc-chain"),
                     "conv_disjoint": ("band", "packed", "rows", "im2col", "loops", "nchwc"),
                     "depthwise": ("depthwise", "loops", "nchwc")}

# A GEMM view's shape class, for the tuned tile table (`fusesearch.schedule.shape_class`): M under
# 64 rows, fewer than 256 output tiles of 128 x 128, or more
SHAPE_CLASSES = ("skinny", "small", "large")

DTYPE_BYTES: Mapping[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
    "int64": 8, "uint64": 8, "bool": 1,
    "float8e4m3fn": 1, "float8e5m2": 1, "float8e4m3fnuz": 1, "float8e5m2fnuz": 1,
}

DEFAULT_THREADS_PER_BLOCK = 256

_FLOAT_FIELDS = ("tc_flops", "scalar_flops", "transcendentals", "divisions", "dram_read_bytes",
                 "dram_write_bytes", "staged_loads")
_INT_FIELDS = ("iteration_size", "reduction_length", "smem_bytes", "live_values_per_thread",
               "threads_per_block", "num_ops", "index_divisions", "blocks", "cpu_threads")


@dataclass(frozen=True)
class KernelSpec:
    """One kernel, as counts.

    - `template`: the code shape that runs it — "pointwise" (one thread per output element),
      "rowwise" (reductions over a row, e.g. Softmax / LayerNorm), "gemm", "conv", "conv_disjoint"
      (a conv whose windows do not overlap: a 1x1 conv, a patch embedding), "depthwise"
      (a conv in groups of one input channel: a loop over each channel's plane, not a GEMM), or
      "opaque" (a library call or an op without a lowering).
    - `tc_flops`: FLOPs a tensor core may run (the GEMM / conv main loop; FMA = 2).
      `scalar_flops`: other arithmetic, on CUDA cores. `transcendentals`: exp / log / tanh /
      erf / rsqrt ... evaluations (counted apart; the model weighs them).
    - `dram_read_bytes` / `dram_write_bytes`: compulsory DRAM traffic (each input read once,
      each output written once; the lowering adds re-reads it expects).
    - `iteration_size`: size of the parallel iteration space = output elements (for a rowwise
      reduction that keeps the row, rows x columns; for one that drops it, rows). Used only to
      count blocks in the grid (see `resources.grid_blocks`).
    - `reduction_length`: elements reduced per output (K of a GEMM, the row of a Softmax), 0 if
      none. `tile`: (M, N, K) block tile for gemm / conv, () otherwise.
    - `smem_bytes`: shared memory requested per block. `live_values_per_thread`: values a thread
      keeps live at the peak (accumulators + operands), the register-pressure proxy.
    - `index_divisions`: integer divisions / modulos by a non-power-of-two constant that turn
      a thread's flat index into a multi-index, per element (a power of two is a shift, free) —
      the index arithmetic the model charges per element (`RooflineParams.index_division_flops`).
    - `divisions`: of the scalar FLOPs, the floating-point divisions and square roots (Div, Sqrt,
      Reciprocal elements), which take several times a multiply's throughput; charged extra by
      `RooflineParams.division_flops`.
    - `staged_loads`: the loads a generated conv's A staging issues (one element each, or 16 bytes
      of channels where the input lies channels last), each decoding its pixel and tap: charged
      `RooflineParams.staging_load_flops` each.
    - `num_ops` / `op_types`: the fused operators, for reports only.
    - `impl`: "generated" (a kernel the code generator writes; on a GPU its GEMM main loop runs
      `fmaf` on CUDA cores) or "library" (a lone anchor or opaque op through the vendor library,
      which uses tensor cores where the dtype allows: TF32 for float32, as cuBLAS under ONNX
      Runtime's CUDA provider). The cost model prices each on the unit it really uses.
    - `unit`: the instruction class of the main loop on a GPU, as the kernel's schedule decided it:
      "tensor-core" (a library GEMM/conv, a generated `mma-*` kernel), "cuda-core" (other generated
      kernels: `fmaf`; opaque library ops) or "none" (an alias). `roofline.compute_unit` names it for a device and dtype. Left
      empty, it follows `impl`: a library call with tensor-core FLOPs uses tensor cores.
    - `blocks`: the launch grid's blocks when the kernel's writer knows them exactly (a generated
      tile per batch or group, a block per row); 0 derives them from the iteration space.
    - `min_arch`: the oldest GPU architecture (compute capability x 10, e.g. 80 for sm_80) the
      kernel's code runs on; 0 for any. On an older GPU the kernel is infeasible.
    - `product`: on a CPU, the code path of a generated gemm/conv's product (one of
      CPU_PRODUCTS: our micro-kernel, a BLAS call per block, a conv's band...), priced at its own
      efficiency (`RooflineParams.product_efficiency`); "" for any other kernel.
    - `imbalance`: on a CPU, how much longer a generated gemm's product runs than its work shared
      evenly among the threads (>= 1: blocks fewer than the threads, or below the micro-kernel's
      tile; `fusesearch.schedule.split_imbalance`); the product's rate is divided by it.
    - `cpu_threads`: on a CPU, the OpenMP threads the kernel's region runs with: 0, all of the
      device's (`sm_count`); fewer (1: `fusesearch.schedule.ONE_THREAD`) gets their share of the
      device's compute and bandwidth and pays the region's cost at one thread
      (`DeviceSpec.serial_launch_overhead_s`) instead of a team's fork and barrier.
    - `mma_sync`: a generated tensor-core kernel written with `mma.sync` (ldmatrix, swizzled
      shared memory, a multistage cp.async pipeline), priced at `RooflineParams.mma_sync_efficiency`
      instead of the wmma kernels' `mma_efficiency`.
    """

    template: str
    dtype: str = "float32"
    tc_flops: float = 0.0
    scalar_flops: float = 0.0
    transcendentals: float = 0.0
    dram_read_bytes: float = 0.0
    dram_write_bytes: float = 0.0
    iteration_size: int = 0
    reduction_length: int = 0
    tile: tuple[int, ...] = ()
    smem_bytes: int = 0
    live_values_per_thread: int = 4
    threads_per_block: int = DEFAULT_THREADS_PER_BLOCK
    num_ops: int = 1
    op_types: tuple[str, ...] = ()
    index_divisions: int = 0
    divisions: float = 0.0
    staged_loads: float = 0.0
    impl: str = "generated"
    blocks: int = 0
    unit: str = ""
    min_arch: int = 0
    product: str = ""
    imbalance: float = 1.0
    cpu_threads: int = 0
    mma_sync: bool = False

    def __post_init__(self) -> None:
        if self.template not in TEMPLATES:
            raise InvalidSpec(f"KernelSpec.template {self.template!r}, expected one of {TEMPLATES}")
        if self.impl not in IMPLS:
            raise InvalidSpec(f"KernelSpec.impl {self.impl!r}, expected one of {IMPLS}")
        if self.unit and self.unit not in UNITS:
            raise InvalidSpec(f"KernelSpec.unit {self.unit!r}, expected one of {UNITS} or empty")
        if self.product and self.product not in CPU_PRODUCTS:
            raise InvalidSpec(f"KernelSpec.product {self.product!r}, expected one of {CPU_PRODUCTS} or empty")
        if self.dtype not in DTYPE_BYTES:
            raise InvalidSpec(
                f"KernelSpec.dtype {self.dtype!r}, expected one of {', '.join(DTYPE_BYTES)}"
            )
        for name in _FLOAT_FIELDS:
            object.__setattr__(self, name, _count(name, getattr(self, name)))
        object.__setattr__(self, "imbalance", _count("imbalance", self.imbalance))
        if self.imbalance < 1.0:
            raise InvalidSpec(f"KernelSpec.imbalance = {self.imbalance}, expected >= 1")
        for name in _INT_FIELDS:
            object.__setattr__(self, name, _int_count(name, getattr(self, name)))
        if self.threads_per_block < 1:
            raise InvalidSpec(f"KernelSpec.threads_per_block = {self.threads_per_block}, expected >= 1")
        object.__setattr__(self, "tile", tuple(_int_count("tile", t) for t in self.tile))
        if 0 in self.tile:
            raise InvalidSpec(f"KernelSpec.tile = {self.tile!r}, expected positive ints")
        object.__setattr__(self, "op_types", tuple(str(t) for t in self.op_types))

    @property
    def main_unit(self) -> str:
        """`unit`, or when it is empty the one `impl` implies: a library call with tensor-core
        FLOPs on tensor cores, anything else on CUDA cores."""
        return self.unit or ("tensor-core" if self.impl == "library" and self.tc_flops > 0 else "cuda-core")

    @property
    def flops(self) -> float:
        """Arithmetic count: tensor-core + scalar FLOPs + transcendental evaluations."""
        return self.tc_flops + self.scalar_flops + self.transcendentals

    @property
    def dram_bytes(self) -> float:
        return self.dram_read_bytes + self.dram_write_bytes

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per DRAM byte (inf when no bytes move)."""
        return self.flops / self.dram_bytes if self.dram_bytes else math.inf

    def to_row(self) -> dict[str, Any]:
        """Flat row: scalars only (`tile` as '128x128x32', `op_types` as 'Conv,Relu')."""
        row = asdict(self)
        row["tile"] = "x".join(str(t) for t in self.tile)
        row["op_types"] = ",".join(self.op_types)
        return row

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> KernelSpec:
        """Inverse of `to_row` (extra keys, e.g. measured times in the same row, are ignored)."""
        kwargs = {f.name: row[f.name] for f in fields(cls) if f.name in row}
        tile = kwargs.get("tile", ())
        if isinstance(tile, str):
            kwargs["tile"] = tuple(int(t) for t in tile.split("x") if t)
        ops = kwargs.get("op_types", ())
        if isinstance(ops, str):
            kwargs["op_types"] = tuple(t for t in ops.split(",") if t)
        return cls(**kwargs)


def _count(name: str, value: object) -> float:
    """A finite, non-negative number as a Python float; InvalidSpec otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidSpec(f"KernelSpec.{name} = {value!r}, expected a number >= 0")
    if not math.isfinite(value) or value < 0:
        raise InvalidSpec(f"KernelSpec.{name} = {value!r}, expected a finite number >= 0")
    return float(value)


def _int_count(name: str, value: object) -> int:
    """A non-negative integer (a float like 3.0, as read back from Parquet, is accepted)."""
    number = _count(name, value)
    if not number.is_integer():
        raise InvalidSpec(f"KernelSpec.{name} = {value!r}, expected an integer")
    return int(number)
