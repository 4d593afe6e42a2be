"""``hbfp.hw.float_mac.FloatMacArray`` against ``hbfp.golden.float_mac.float_mac``: the cocotb
testbench ``hbfp.sim.tb_float_mac`` on the generated Verilog with every simulator, and the
constructor's checks.

``HBFP_SIM_FULL=1`` runs many more runs."""

import os

import pytest
from amaranth.back import verilog
from hbfp.hw.float_mac import FloatMacArray
from hbfp.hw.openflow import ECP5
from hbfp.sim import runner

FULL = os.environ.get("HBFP_SIM_FULL") == "1"

# Both formats on both simulators at 2x2 (DSP products, Booth products, both in one array);
# at 4x4 one format per simulator (a Verilator build of the 4x4 array takes about half a
# minute), one with DSP products and one with Booth products.
# With ``ready_ahead`` (FloatCore's array: its stall a register) as well as without.
CONFIGS = [
    # rows, cols, fmt, k, dsp_macs, ready_ahead, sim
    *[(2, 2, fmt, 6, dsp, dsp == 0, sim) for fmt in ("bf16", "fp16") for dsp in (None, 0) for sim in runner.SIMULATORS],
    (2, 2, "fp16", 5, 1, False, "icarus"),
    (4, 4, "bf16", 4, None, True, "icarus"),
    (4, 4, "fp16", 4, 0, False, "verilator"),
]


@pytest.mark.parametrize("rows, cols, fmt, k, dsp_macs, ready_ahead, sim", CONFIGS)
def test_float_mac_array_equals_golden(rows, cols, fmt, k, dsp_macs, ready_ahead, sim):
    runner.require(sim)
    cfg = dict(rows=rows, cols=cols, fmt=fmt, k=k, interleave=FloatMacArray.INTERLEAVE, latency=FloatMacArray.LATENCY,
               runs=200 if FULL else 20, seed=rows * 10 + k, ready_ahead=ready_ahead)
    tests, failed = runner.run(lambda: FloatMacArray(rows, cols, fmt, k, dsp_macs=dsp_macs, ready_ahead=ready_ahead),
                               "float_mac", "tb_float_mac", sim, cfg)
    assert tests == 2 and failed == 0


@pytest.mark.parametrize("fmt, dsp_macs, sim", [("fp16", 2, "icarus"), ("bf16", None, "verilator")])
def test_float_mac_array_for_ecp5_equals_golden(fmt, dsp_macs, sim):
    """Elaborated for an ECP5, a DSP PE's significand product is a MULT18X18D whose registers
    hold with the array (CE0), and the stall's copies are kept flip-flops (``ready_ahead``):
    the behavioural models of the primitives, stalls on both sides."""
    runner.require(sim)
    cfg = dict(rows=2, cols=2, fmt=fmt, k=5, interleave=FloatMacArray.INTERLEAVE, latency=FloatMacArray.LATENCY,
               runs=200 if FULL else 20, seed=7, ready_ahead=True)
    tests, failed = runner.run(lambda: FloatMacArray(2, 2, fmt, 5, dsp_macs=dsp_macs, ready_ahead=True), "float_mac",
                               "tb_float_mac", sim, cfg, platform=ECP5)
    assert tests == 2 and failed == 0


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 4, "bf16", 4), "rows and cols"),
        ((4, -1, "fp16", 4), "rows and cols"),
        ((4, 4, "fp8", 4), "unknown float format"),
        ((4, 4, "bf16", 0), "k "),
        ((2, 2, "fp16", 4, 5), "dsp_macs"),
        ((2, 2, "fp16", 4, -1), "dsp_macs"),
    ],
)
def test_bad_parameters(args, message):
    with pytest.raises(ValueError, match=message):
        FloatMacArray(*args)


def test_ports():
    dut = FloatMacArray(3, 2, "fp16", 5)
    assert dut.i.payload.shape().size == 16 * (3 + 2)
    assert dut.o.payload.shape().size == 32 * 3 * 2 + (FloatMacArray.INTERLEAVE - 1).bit_length()
    text = verilog.convert(dut, name="float_mac")
    for port in ("i__payload", "i__valid", "i__ready", "o__payload", "o__valid", "o__ready"):
        assert port in text
