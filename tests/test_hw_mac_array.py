# amaranth: UnusedElaboratable=no
import os

import pytest

from hbfp.contract import MAC_LATENCY
from hbfp.hw.mac_array import MacArray
from hbfp.hw.openflow import ECP5
from hbfp.hw.params import psum_width
from hbfp.sim import runner

FULL = os.environ.get("HBFP_SIM_FULL") == "1"

CONFIGS = [
    # rows, cols, tk, ma, mb, dsp_macs (None: all), groups: HBFP8 K-tiles on two array shapes,
    # MXINT8 blocks, wide codes; DSP and LUT multipliers mixed (a row split between them, all
    # LUT); sums drained in groups of columns (accumulate lanes shared: 4 of 8, 1 of 4, 2 of 6)
    (4, 4, 24, 8, 8, None, 1),
    (8, 8, 24, 8, 8, 20, 1),
    (8, 8, 32, 8, 8, None, 1),
    (4, 2, 24, 16, 8, 3, 1),
    (4, 4, 24, 8, 8, 0, 1),
    (2, 4, 16, 5, 7, 3, 1),
    (8, 8, 24, 8, 8, None, 2),
    (4, 4, 24, 8, 8, 0, 4),
    (3, 6, 12, 8, 8, None, 3),
]
#: (rows, cols, control_pes): the control registers in copies (a copy per 2 rows, per row,
#: a last copy of 1 row), each run by the generic elaboration and by the ECP5's.
CONTROL_COPIES = [(4, 4, 8), (3, 4, 4), (3, 4, 8)]


@pytest.mark.parametrize("sim", runner.SIMULATORS)
@pytest.mark.parametrize("rows, cols, tk, ma, mb, dsp_macs, groups", CONFIGS)
def test_mac_array_equals_partial_sums(sim, rows, cols, tk, ma, mb, dsp_macs, groups):
    runner.require(sim)
    cfg = dict(rows=rows, cols=cols, tk=tk, ma=ma, mb=mb, psum_width=psum_width(ma, mb, tk), seed=rows * 100 + tk,
               tiles=200 if FULL else 40, latency=MacArray.LATENCY, dsp_macs=dsp_macs, groups=groups)
    tests, failed = runner.run(lambda: MacArray(rows, cols, tk, ma, mb, dsp_macs, groups), "mac_array",
                               "tb_mac_array", sim, cfg)
    assert tests == 3 and failed == 0


@pytest.mark.parametrize("sim, rows, cols, tk, ma, mb, dsp_macs",
                         [("icarus", 4, 4, 24, 8, 8, 10), ("verilator", 4, 4, 24, 8, 8, 10), ("icarus", 2, 4, 16, 5, 7, None)])
def test_mac_array_for_ecp5_equals_partial_sums(sim, rows, cols, tk, ma, mb, dsp_macs):
    """Elaborated for an ECP5, the DSP PEs are MULT18X18D instances with their registers
    (``ecp5_multiplier``), simulated with a behavioural model of that primitive
    (sim/mult18x18d_model.v): the same sums and latency, beside LUT PEs too."""
    runner.require(sim)
    cfg = dict(rows=rows, cols=cols, tk=tk, ma=ma, mb=mb, psum_width=psum_width(ma, mb, tk), seed=rows * 10 + tk,
               tiles=40, latency=MacArray.LATENCY, dsp_macs=dsp_macs)
    tests, failed = runner.run(lambda: MacArray(rows, cols, tk, ma, mb, dsp_macs), "mac_array", "tb_mac_array", sim,
                               cfg, platform=ECP5)
    assert tests == 3 and failed == 0


@pytest.mark.parametrize("sim", runner.SIMULATORS)
@pytest.mark.parametrize("platform", [None, ECP5], ids=["generic", "ecp5"])
@pytest.mark.parametrize("rows, cols, control_pes", CONTROL_COPIES)
def test_mac_array_with_control_copies_equals_partial_sums(sim, platform, rows, cols, control_pes):
    """The control registers in copies (``control_pes``; elaborated for an ECP5, TRELLIS_FF
    instances, simulated with sim/trellis_ff_model.v), DSP and LUT PEs and a grouped drain:
    the same sums and latency."""
    runner.require(sim)
    tk, groups, dsp_macs = 24, 2, 5
    cfg = dict(rows=rows, cols=cols, tk=tk, ma=8, mb=8, psum_width=psum_width(8, 8, tk), seed=rows * 7 + control_pes,
               tiles=40, latency=MacArray.LATENCY, dsp_macs=dsp_macs, groups=groups)
    make = lambda: MacArray(rows, cols, tk, 8, 8, dsp_macs, groups, control_pes=control_pes)  # noqa: E731
    assert make().control_copies == -(-rows // max(1, control_pes // cols)) > 1
    tests, failed = runner.run(make, "mac_array", "tb_mac_array", sim, cfg, platform=platform)
    assert tests == 3 and failed == 0


def test_control_copies_are_kept_for_an_ecp5():
    """One TRELLIS_FF per copy and control register (valid, first, last, full) for an ECP5,
    none with one copy (the default for up to ``CONTROL_PES`` PEs) or in portable Verilog."""
    from amaranth.back import verilog

    from hbfp.hw.mac_array import CONTROL_PES

    mac = MacArray(16, 16, 24, 8, 8, dsp_macs=144)
    assert (mac.control_rows, mac.control_copies) == (CONTROL_PES // 16, 16 * 16 // CONTROL_PES)
    assert verilog.convert(mac, name="m", platform=ECP5).count("TRELLIS_FF ") == 4 * mac.control_copies
    assert "TRELLIS_FF" not in verilog.convert(MacArray(4, 4, 24, 8, 8, control_pes=4), name="m")
    assert "TRELLIS_FF" not in verilog.convert(MacArray(8, 8, 24, 8, 8), name="m", platform=ECP5)


def test_ecp5_elaboration_instantiates_registered_dsps():
    from amaranth.back import verilog

    text = verilog.convert(MacArray(4, 4, 24, 8, 8, dsp_macs=10), name="m", platform=ECP5)
    assert text.count("MULT18X18D ") == 10
    for reg in ("REG_INPUTA_CLK", "REG_INPUTB_CLK", "REG_OUTPUT_CLK"):
        assert text.count(f'.{reg}("CLK0")') == 10
    assert "MULT18X18D" not in verilog.convert(MacArray(4, 4, 24, 8, 8), name="m")  # portable otherwise


def test_latency_is_the_contracts():
    assert MacArray.LATENCY == MAC_LATENCY == 5


@pytest.mark.parametrize("args, message", [
    ((4, 4, 3), r"K-tile \(3\) must be at least as long as rows x groups \(4 x 1\)"),
    ((4, 4, 24, 8, 8, None, 8), r"groups \(8\) must divide cols \(4\)"),
    ((4, 4, 15, 8, 8, None, 4), r"K-tile \(15\) must be at least as long as rows x groups \(4 x 4\)"),
    ((4, 4, 24, 8, 8, 17), r"dsp_macs must be 0\.\.16"),
    ((0, 4, 24), "must be positive"),
    ((4, 4, 24, 8, 8, None, 1, 0), "control_pes must be positive"),
])
def test_refused(args, message):
    with pytest.raises(ValueError, match=message):
        MacArray(*args)


def test_dsp_macs_row_major():
    mac = MacArray(4, 4, 24, dsp_macs=6)
    assert [mac.uses_dsp(i, j) for i in range(2) for j in range(4)] == [True] * 6 + [False] * 2
    assert MacArray(4, 4, 24).dsp_macs == 16
