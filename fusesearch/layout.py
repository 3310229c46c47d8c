"""How a 4-D activation tensor lies in memory inside a CPU program: as in the model, or in channel blocks.

Problem: a conv in NCHW reads one channel's plane at a time, so its vector lanes run along a row of
pixels (short rows at 7x7 and 14x14, borders, strided reads); a depthwise conv cannot vectorize
across channels at all. NCHWc (ONNX Runtime's NCHWc transformer, oneDNN's nChw16c) stores each
pixel's channels in blocks of c, c the float32 lanes of the CPU's vectors, so a block of output
channels is one vector register and a depthwise tap one vector FMA.
Approach: `Layout` is a frozen value: NCHW (block 0) or NCHWc (block c), with its padded channel
count, physical shape and byte size; `channel_block(lanes)` is the one place the block is read from
the target (`schedule.CpuTarget.lanes`, the device's float32 lanes from its flags: 16 with
AVX-512, 8 with AVX2, none below); `to_blocked`/`from_blocked` are numpy's reorders, the
reference every C reorder and test compares with.
Invariants: the padded channels of a blocked tensor hold zeros (every kernel writing one stores
them), so a consumer may read whole blocks; a layout never changes a tensor's logical shape."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MIN_BLOCK = 8  # below 8 float32 lanes (SSE, NEON) no blocked layout is offered


@dataclass(frozen=True)
class Layout:
    """NCHW as in the model (`block` 0) or NCHWc, channels in blocks of `block` (innermost)."""

    block: int = 0

    def __post_init__(self) -> None:
        if self.block < 0 or (self.block and self.block & (self.block - 1)):
            raise ValueError(f"layout: channel block {self.block}, expected 0 or a power of two")

    @property
    def blocked(self) -> bool:
        return self.block > 0

    @property
    def name(self) -> str:
        return f"NCHW{self.block}c" if self.block else "NCHW"

    def channels(self, c: int) -> int:
        """The channel count stored: `c` rounded up to whole blocks."""
        return -(-c // self.block) * self.block if self.block else c

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The physical shape of a tensor of logical `shape` (N, C, H, W): (N, C/c, H, W, c)."""
        if not self.block:
            return tuple(shape)
        n, c, h, w = shape
        return n, self.channels(c) // self.block, h, w, self.block

    def size(self, shape: tuple[int, ...]) -> int:
        """Elements stored, padded channels included."""
        return math.prod(self.shape(shape))

    def nbytes(self, shape: tuple[int, ...], itemsize: int) -> int:
        return self.size(shape) * itemsize


NCHW = Layout()


def channel_block(lanes: int) -> int:
    """The NCHWc block for a CPU whose vectors hold `lanes` float32 lanes (16 with AVX-512, 8 with
    AVX2): one output-channel block per vector register; 0 (no blocked layout) below MIN_BLOCK or
    where the lanes are unknown (0)."""
    return lanes if lanes >= MIN_BLOCK and not lanes & (lanes - 1) else 0


def copy_name(tensor: str, layout: Layout) -> str:
    """What a program calls its copy of `tensor` in `layout` (a reorder's output): `tensor@NCHW16c`."""
    return f"{tensor}@{layout.name}"


def arg_layout(arg_shape: tuple[int, ...], shape: tuple[int, ...]) -> Layout:
    """How a kernel argument of `arg_shape` holds a tensor of logical `shape`: in channel blocks
    where a 4-D tensor is passed 5-D (the block its last dim), else as in the model."""
    return Layout(arg_shape[-1]) if len(shape) == 4 and len(arg_shape) == 5 else NCHW


def to_blocked(x: np.ndarray, layout: Layout) -> np.ndarray:
    """An NCHW array in `layout` (padded channels zero), contiguous."""
    if not layout.blocked:
        return np.ascontiguousarray(x)
    n, c, h, w = x.shape
    padded = np.zeros((n, layout.channels(c), h, w), dtype=x.dtype)
    padded[:, :c] = x
    return np.ascontiguousarray(padded.reshape(n, -1, layout.block, h, w).transpose(0, 1, 3, 4, 2))


def from_blocked(x: np.ndarray, layout: Layout, channels: int) -> np.ndarray:
    """A `layout` array back in NCHW with its `channels` logical channels."""
    if not layout.blocked:
        return np.ascontiguousarray(x)
    n, cb, h, w, b = x.shape
    return np.ascontiguousarray(x.transpose(0, 1, 4, 2, 3).reshape(n, cb * b, h, w)[:, :channels])
