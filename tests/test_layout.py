"""The layout leaf type: NCHW as in the model or NCHWc, its padded channels, physical shape and
bytes, the block read from the target's lanes in one place, and numpy's reorders."""

from __future__ import annotations

import numpy as np
import pytest

from fusesearch.layout import NCHW, NHWC, Layout, channel_block, from_blocked, to_blocked


def test_a_blocked_layout_pads_its_channels_to_whole_blocks():
    layout = Layout(16)
    assert (layout.name, NCHW.name, layout.blocked, NCHW.blocked) == ("NCHW16c", "NCHW", True, False)
    assert layout.channels(24) == 32 and layout.channels(32) == 32 and NCHW.channels(24) == 24
    assert layout.shape((2, 24, 7, 5)) == (2, 2, 7, 5, 16) and NCHW.shape((2, 24, 7, 5)) == (2, 24, 7, 5)
    assert layout.nbytes((1, 24, 7, 7), 4) == 32 * 49 * 4 and NCHW.nbytes((1, 24, 7, 7), 4) == 24 * 49 * 4


@pytest.mark.parametrize("block", [-8, 3, 12])
def test_a_block_is_zero_or_a_power_of_two(block):
    with pytest.raises(ValueError, match="channel block"):
        Layout(block)


def test_the_block_is_the_vector_lanes_from_eight():
    assert [channel_block(lanes) for lanes in (0, 4, 8, 16, 12)] == [0, 0, 8, 16, 0]


def test_numpys_reorders_are_inverse_and_zero_the_padding():
    x = np.random.default_rng(0).standard_normal((2, 20, 3, 4)).astype(np.float32)
    blocked = to_blocked(x, Layout(8))
    assert blocked.shape == (2, 3, 3, 4, 8) and blocked[1, 2, 1, 3, 3] == x[1, 19, 1, 3]
    assert not blocked[:, 2, :, :, 4:].any()
    np.testing.assert_array_equal(from_blocked(blocked, Layout(8), 20), x)
    np.testing.assert_array_equal(to_blocked(x, NCHW), x)


def test_nhwc_is_the_one_block_of_all_channels():
    """Channels last: no padding, (N, H, W, C), laid out otherwise than the model (a plan copies
    it), numpy's reorders a transpose each way; no block with it."""
    x = np.random.default_rng(1).standard_normal((2, 5, 3, 4)).astype(np.float32)
    assert (NHWC.name, NHWC.blocked, NHWC.block, NHWC.channels(5)) == ("NHWC", True, 0, 5)
    assert NHWC.shape((2, 5, 3, 4)) == (2, 3, 4, 5) and NHWC.nbytes((2, 5, 3, 4), 2) == NCHW.nbytes((2, 5, 3, 4), 2)
    laid = to_blocked(x, NHWC)
    assert laid.shape == (2, 3, 4, 5) and laid[1, 2, 3, 4] == x[1, 4, 2, 3] and laid.flags.c_contiguous
    np.testing.assert_array_equal(from_blocked(laid, NHWC, 5), x)
    with pytest.raises(ValueError, match="channel block"):
        Layout(16, channels_last=True)
