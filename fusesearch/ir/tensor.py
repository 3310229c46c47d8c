"""A value of the graph: its name, static shape and dtype — the leaf type every analysis shares.

Invariants: frozen; `shape` is None when not static; `nbytes` uses the one dtype-size table
(costmodels' table of priced dtypes, plus the storage-only ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from costmodels import DTYPE_BYTES

STORAGE_BYTES = {**DTYPE_BYTES, "int4": 1, "uint4": 1, "complex64": 8, "complex128": 16, "string": 8}


@dataclass(frozen=True)
class TensorInfo:
    """A value of the graph: static shape (None if unknown), dtype name ('float32', ...)."""

    name: str
    shape: tuple[int, ...] | None
    dtype: str
    constant: bool = False

    @property
    def size(self) -> int:
        """Element count (0 when the shape is unknown)."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape is not None else 0

    @property
    def nbytes(self) -> int:
        return self.size * STORAGE_BYTES.get(self.dtype, 4)
