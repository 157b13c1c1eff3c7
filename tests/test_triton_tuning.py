"""Issue 32 item 8: the kernels' launch configuration, chosen in Python from the
tile sizes (pure functions: no kernel runs here; the results of every choice
are checked against the literal formula in test_triton_kernel.py)."""
from __future__ import annotations

import pytest

from qsv_pyg.nn import triton_kernel as tk


@pytest.mark.parametrize("tile,warps", [(0, 1), (1, 1), (16, 1), (64, 1), (128, 1),
                                        (129, 2), (256, 2), (257, 4), (512, 4), (1024, 8),
                                        (4096, 8), (10 ** 6, 8)])
def test_num_warps_for_tile(tile, warps):
    assert tk.num_warps_for(tile) == warps


def test_num_warps_is_a_power_of_two_growing_with_the_tile():
    last = 0
    for tile in range(0, 5000, 7):
        w = tk.num_warps_for(tile)
        assert w & (w - 1) == 0 and 1 <= w <= tk.MAX_WARPS
        assert w >= last
        last = w
