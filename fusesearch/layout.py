"""How a 4-D activation tensor lies in memory inside a program: as in the model, in channel blocks, or channels last.

Problem: a CPU conv in NCHW vectorizes along short rows of pixels (a depthwise conv not across
channels at all); NCHWc (ONNX Runtime's NCHWc, oneDNN's nChw16c) keeps each pixel's channels in
blocks of c, the CPU's float32 lanes: an output block is one register, a depthwise tap one FMA. A
GPU tensor-core conv reads K = (r, s, c) of its implicit GEMM: in NHWC (channels last, cuDNN's
and CUTLASS's form) a pixel's channels are contiguous, staged in 16-byte vectors.
Approach: `Layout` is a frozen value: NCHW (block 0), NCHWc (block c) or NHWC (`channels_last`:
one block of all the channels, no padding), with its padded channel count, physical shape and
bytes; `blocked` is every layout but the model's; `channel_block(lanes)` is the one place the
block is read from the target (`schedule.CpuTarget.lanes`: 16 with AVX-512, 8 with AVX2, none
below); `to_blocked`/`from_blocked` are numpy's reorders, the reference every C and CUDA reorder
and test compares with.
Invariants: the padded channels of a blocked tensor hold zeros (every kernel writing one stores
them), so a consumer may read whole blocks; a layout never changes a tensor's logical shape."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MIN_BLOCK = 8  # below 8 float32 lanes (SSE, NEON) no blocked layout is offered


@dataclass(frozen=True)
class Layout:
    """NCHW as in the model (`block` 0), NCHWc, channels in blocks of `block` (innermost), or
    NHWC (`channels_last`: every channel of a pixel innermost, one block of them all)."""

    block: int = 0
    channels_last: bool = False

    def __post_init__(self) -> None:
        if self.block < 0 or (self.block and self.block & (self.block - 1)) or (self.block and self.channels_last):
            raise ValueError(f"layout: channel block {self.block}, expected 0 or a power of two (0 channels last)")

    @property
    def blocked(self) -> bool:
        """Laid out otherwise than the model (NCHWc or NHWC): a plan copies it at the edges."""
        return self.block > 0 or self.channels_last

    @property
    def name(self) -> str:
        return "NHWC" if self.channels_last else f"NCHW{self.block}c" if self.block else "NCHW"

    def channels(self, c: int) -> int:
        """The channel count stored: `c` rounded up to whole blocks."""
        return -(-c // self.block) * self.block if self.block else c

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The physical shape of a tensor of logical `shape` (N, C, H, W): (N, C/c, H, W, c)."""
        if self.channels_last:
            n, c, h, w = shape
            return n, h, w, c
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
NHWC = Layout(channels_last=True)


def channel_block(lanes: int) -> int:
    """The NCHWc block for a CPU whose vectors hold `lanes` float32 lanes (16 with AVX-512, 8 with
    AVX2): one output-channel block per vector register; 0 (no blocked layout) below MIN_BLOCK or
    where the lanes are unknown (0)."""
    return lanes if lanes >= MIN_BLOCK and not lanes & (lanes - 1) else 0


def copy_name(tensor: str, layout: Layout) -> str:
    """What a program calls its copy of `tensor` in `layout` (a reorder's output): `tensor@NCHW16c`."""
    return f"{tensor}@{layout.name}"


def to_blocked(x: np.ndarray, layout: Layout) -> np.ndarray:
    """An NCHW array in `layout` (padded channels zero), contiguous."""
    if layout.channels_last:
        return np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    if not layout.blocked:
        return np.ascontiguousarray(x)
    n, c, h, w = x.shape
    padded = np.zeros((n, layout.channels(c), h, w), dtype=x.dtype)
    padded[:, :c] = x
    return np.ascontiguousarray(padded.reshape(n, -1, layout.block, h, w).transpose(0, 1, 3, 4, 2))


def from_blocked(x: np.ndarray, layout: Layout, channels: int) -> np.ndarray:
    """A `layout` array back in NCHW with its `channels` logical channels."""
    if layout.channels_last:
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    if not layout.blocked:
        return np.ascontiguousarray(x)
    n, cb, h, w, b = x.shape
    return np.ascontiguousarray(x.transpose(0, 1, 4, 2, 3).reshape(n, cb * b, h, w)[:, :channels])


def laid_out(runner, generated, inputs: dict, shapes: dict) -> tuple:
    """`runner(generated, feeds)`'s (run, fetch) (a backend's) on `inputs` (tensor -> array as in
    the model) laid as the kernel's arguments lie (`Arg.layout`: channel blocks, NHWC), fetching
    its outputs back as in the model (`shapes`: each output's logical shape)."""
    laid = {a.tensor: (a.layout, tuple(a.shape)) for a in (*generated.inputs, *generated.outputs)}
    run, fetch = runner(generated, {t: to_blocked(v, laid[t][0]) for t, v in inputs.items()})

    def as_in_the_model() -> dict:
        return {t: from_blocked(np.asarray(y).reshape(laid[t][1]), laid[t][0], shapes[t][1])
                if laid[t][0].blocked else y for t, y in fetch().items()}
    return run, as_in_the_model
