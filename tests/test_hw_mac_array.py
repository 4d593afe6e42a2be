import os

import pytest

from hbfp.hw.mac_array import MacArray
from hbfp.hw.params import psum_width
from hbfp.sim import runner

FULL = os.environ.get("HBFP_SIM_FULL") == "1"

CONFIGS = [
    # rows, cols, tk, ma, mb: HBFP8 K-tiles on two array shapes, MXINT8 blocks, wide codes
    (4, 4, 24, 8, 8),
    (8, 8, 24, 8, 8),
    (8, 8, 32, 8, 8),
    (4, 2, 24, 16, 8),
]


@pytest.mark.parametrize("sim", runner.SIMULATORS)
@pytest.mark.parametrize("rows, cols, tk, ma, mb", CONFIGS)
def test_mac_array_equals_partial_sums(sim, rows, cols, tk, ma, mb):
    runner.require(sim)
    cfg = dict(rows=rows, cols=cols, tk=tk, ma=ma, mb=mb, psum_width=psum_width(ma, mb, tk), seed=rows * 100 + tk, tiles=200 if FULL else 40)
    tests, failed = runner.run(lambda: MacArray(rows, cols, tk, ma, mb), "mac_array", "tb_mac_array", sim, cfg)
    assert tests == 2 and failed == 0
