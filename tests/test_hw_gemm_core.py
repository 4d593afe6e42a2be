"""The GEMM core in cocotb on both simulators, against hbfp.golden.gemm."""

import os

import pytest

from hbfp.hw.activation import FUNC_WIDTH, FUNCTIONS
from hbfp.hw.gemm_core import GemmCore
from hbfp.hw.openflow import ECP5
from hbfp.hw.params import CoreConfig
from hbfp.sim import runner

FULL = os.environ.get("HBFP_SIM_FULL") == "1"

# Every activation unit is built in the 8x8 HBFP8 core; the others carry a few (each unit is
# exhaustively checked on its own in test_hw_activation.py), which keeps their builds short.
SOME = ("relu", "gelu", "sigmoid")
CONFIGS = {
    "4x4-hbfp8": CoreConfig(rows=4, cols=4, tile=(24, 24), size=48, functions=SOME),
    "8x8-hbfp8": CoreConfig(rows=8, cols=8, tile=(24, 24), size=96),
    "4x4-mxint8": CoreConfig(rows=4, cols=4, tile=(1, 32), size=64, functions=SOME),
    "8x8-mxint8": CoreConfig(rows=8, cols=8, tile=(1, 32), size=96, functions=SOME),
    # One accumulate lane for the four columns (each lane serves acc_groups = 4 columns).
    "4x4-hbfp8-l1": CoreConfig(rows=4, cols=4, tile=(24, 24), size=48, functions=("relu",), acc_lanes=1),
    # The same elaborated for an ECP5: its memories DP16KD blocks with their output registers,
    # its PEs MULT18X18D blocks (sim/dp16kd_model.v, sim/mult18x18d_model.v).
    "4x4-hbfp8-l1-ecp5": CoreConfig(rows=4, cols=4, tile=(24, 24), size=48, functions=("relu",), acc_lanes=1),
}
#: The platform a configuration is elaborated for (default: none, the portable gateware).
PLATFORMS = {"4x4-hbfp8-l1-ecp5": ECP5}
if FULL:
    # Array shapes (make test checks them under Amaranth's simulator, in
    # test_hw_gemm_core_amaranth.py): rectangular with rows not a power of two and a full-width
    # epilogue; columns that do not divide the tile (16 against 24) with 8 output lanes; a
    # 16 x 16 array with HBFP8's 24 x 24 tiles and its default 4 lanes.
    CONFIGS["6x4-hbfp8-e4"] = CoreConfig(rows=6, cols=4, tile=(24, 24), size=48, functions=SOME, out_lanes=4)
    CONFIGS["4x16-hbfp8-e8"] = CoreConfig(rows=4, cols=16, tile=(24, 24), size=48, functions=SOME, out_lanes=8)
    CONFIGS["16x16-hbfp8"] = CoreConfig(rows=16, cols=16, tile=(24, 24), size=48, functions=SOME)
    CONFIGS["6x12-hbfp8"] = CoreConfig(rows=6, cols=12, tile=(24, 24), size=48, functions=SOME)
    CONFIGS["8x8-hbfp8-l4"] = CoreConfig(rows=8, cols=8, tile=(24, 24), size=96, functions=SOME, acc_lanes=4)
# Output elements compared per configuration. Icarus runs about a hundred times slower than
# Verilator on this design, so it checks a sample of the same random products.
ELEMENTS = {"verilator": 100_000, "icarus": 4_000}


def tb_config(cfg: CoreConfig, elements: int, seed: int) -> dict:
    d = cfg.to_dict()
    d.update(
        functions=list(FUNCTIONS),
        built=list(cfg.functions or FUNCTIONS),
        func_width=FUNC_WIDTH,
        elements=elements,
        seed=seed,
        full=FULL,
    )
    return d


# make test leaves to make sim-full (to keep within its budget): the 8x8 MXINT8 core and the
# portable shared-lane core (the 4x4 MXINT8 core covers the format, the same core for an ECP5
# the shared lane, and Amaranth's simulator shared lanes in other shapes:
# test_hw_gemm_core_amaranth.py), and the ECP5 core on Icarus.
FULL_ONLY = {"8x8-mxint8": runner.SIMULATORS, "4x4-hbfp8-l1": runner.SIMULATORS, "4x4-hbfp8-l1-ecp5": ("icarus",)}


@pytest.mark.parametrize("sim, name", [(sim, name) for name in CONFIGS for sim in runner.SIMULATORS
                                       if FULL or sim not in FULL_ONLY.get(name, ())])
def test_gemm_core_equals_golden(sim, name):
    runner.require(sim)
    cfg = CONFIGS[name]
    elements = ELEMENTS[sim] * (10 if FULL else 1)
    # The utilization figure is deterministic: measured on Verilator (and everywhere by sim-full).
    testcase = None if (sim == "verilator" or FULL) else "random_products"
    tests, failed = runner.run(
        lambda: GemmCore(cfg), "gemm_core", "tb_gemm_core", sim, tb_config(cfg, elements, seed=len(name)), testcase=testcase,
        platform=PLATFORMS.get(name),
    )
    assert tests == (2 if testcase is None else 1) and failed == 0
