"""``hbfp.hw.float_mac.FloatMacArray`` against ``hbfp.golden.float_mac.float_mac``: the cocotb
testbench ``hbfp.sim.tb_float_mac`` on the generated Verilog with every simulator, and the
constructor's checks.

``HBFP_SIM_FULL=1`` runs many more runs."""

import os

import pytest
from amaranth.back import verilog
from hbfp.hw.float_mac import FloatMacArray
from hbfp.sim import runner

FULL = os.environ.get("HBFP_SIM_FULL") == "1"

# Both formats on both simulators at 2x2; at 4x4 one format per simulator (a Verilator
# build of the 4x4 array takes about half a minute).
CONFIGS = [
    # rows, cols, fmt, k, sim
    *[(2, 2, fmt, 6, sim) for fmt in ("bf16", "fp16") for sim in runner.SIMULATORS],
    (4, 4, "bf16", 4, "icarus"),
    (4, 4, "fp16", 4, "verilator"),
]


@pytest.mark.parametrize("rows, cols, fmt, k, sim", CONFIGS)
def test_float_mac_array_equals_golden(rows, cols, fmt, k, sim):
    runner.require(sim)
    cfg = dict(rows=rows, cols=cols, fmt=fmt, k=k, interleave=FloatMacArray.INTERLEAVE, latency=FloatMacArray.LATENCY,
               runs=200 if FULL else 20, seed=rows * 10 + k)
    tests, failed = runner.run(lambda: FloatMacArray(rows, cols, fmt, k), "float_mac", "tb_float_mac", sim, cfg)
    assert tests == 2 and failed == 0


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 4, "bf16", 4), "rows and cols"),
        ((4, -1, "fp16", 4), "rows and cols"),
        ((4, 4, "fp8", 4), "unknown float format"),
        ((4, 4, "bf16", 0), "k "),
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
