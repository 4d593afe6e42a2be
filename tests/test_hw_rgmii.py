"""RGMII (``hbfp.hw.rgmii``) with the Ethernet MAC behind it, at the pins and at RGMII's timing:
cocotb runs of ``sim/tb_rgmii.py`` (a PHY model written from RGMII v2.0, the IEEE 802.3 reference
of ``sim/tb_eth_mac.py``) on the DUT elaborated for an ECP5 (the Lattice platform's DDR buffers,
``sim/ecp5_io_model.v``), on both simulators, and with the FPGA's clock-to-data delays on both
sides under Icarus (whose DELAYG model delays: ``tb_rgmii``'s docstring says what that shows);
the control line's encoding against RGMII's table; where the delays' DELAYGs sit in the netlist,
and the delays' limits.

``HBFP_SIM_FULL=1`` runs more frames, the delays under Verilator too (a second Verilator build;
its DELAYG model passes through), and shows that each mutation of the RGMII side
(``tb_rgmii.MUTATIONS``: nibble order, ``ctl`` encoding, each direction) fails the tests."""

import json
import math
import os

import pytest
from amaranth.back import rtlil, verilog

from hbfp.hw.rgmii import RgmiiRx, RgmiiTx, decode_rx, delay_taps, encode_tx
from hbfp.sim import runner
from hbfp.sim import tb_rgmii as tb

FULL = os.environ.get("HBFP_SIM_FULL") == "1"

#: RGMII v2.0's control line for each (valid, error) of GMII: (rising edge, falling edge). With
#: neither, the line idles low; an error without valid is a false carrier (or carrier extension).
CTL_TABLE = {(0, 0): (0, 0), (1, 0): (1, 1), (1, 1): (1, 0), (0, 1): (0, 1)}


def test_ctl_encoding_is_rgmii():
    for (valid, error), edges in CTL_TABLE.items():
        assert encode_tx(valid, error) == edges
        assert decode_rx(*edges) == (valid, error)


def test_dut_has_the_ecp5_ddr_primitives():
    """What the cocotb runs simulate is what an ECP5 build has: the Lattice platform's buffers."""
    text = verilog.convert(tb.RgmiiLoop(), name="rgmii_loop", platform=tb.ECP5_IO)
    # rx: 4 data and ctl; tx: 4 data, ctl and the forwarded clock
    assert text.count("IDDRX1F ") == 5 and text.count("ODDRX1F ") == 6
    assert text.count("\n  IB ") == 6 and text.count("OBZ ") == 6  # a buffer a pin
    assert "DELAYG" not in text  # the delayed paths' netlists: below
    with pytest.raises(ValueError, match="mutation"):
        tb.RgmiiLoop(mutation="swap")


# ---- the delays' DELAYGs in the netlist ---------------------------------------------------

#: The outputs of the primitives (Yosys knows them only as cells of unknown types).
OUTPUTS = {"IB": {"O"}, "OBZ": {"O"}, "DELAYG": {"Z"}, "IDDRX1F": {"Q0", "Q1"}, "ODDRX1F": {"Q"},
           "FD1S3AX": {"Q"}, "OFS1P3DX": {"Q"}}


class Netlist:
    """``component`` elaborated for an ECP5 (``tb.ECP5_IO``) and flattened by Yosys (Amaranth's
    own, which ``verilog.convert`` runs): its ports' bits, and which cell drives and which cells
    read each bit."""

    def __init__(self, component, name: str):
        from amaranth._toolchain.yosys import find_yosys

        text = rtlil.convert(component, name=name, platform=tb.ECP5_IO)
        script = f"read_rtlil <<rtlil\n{text}\nrtlil\nproc\nflatten\nopt_expr\nopt_clean\nwrite_json\n"
        module = json.loads(find_yosys(lambda ver: ver >= (0, 40)).run(["-q", "-"], script))["modules"][name]
        self.ports = {p: v["bits"] for p, v in module["ports"].items()}
        self.cells = [c for c in module["cells"].values() if c["type"] in OUTPUTS]
        self.driver, self.readers = {}, {}
        for c in self.cells:
            for port, bits in c["connections"].items():
                for b in bits:
                    if port in OUTPUTS[c["type"]]:
                        self.driver[b] = (c, port)
                    else:
                        self.readers.setdefault(b, []).append((c, port))

    def count(self, kind: str) -> int:
        return sum(c["type"] == kind for c in self.cells)

    def pin_reader(self, bit, kind: str, port: str):
        """The one cell reading ``bit``, which must be a ``kind`` reading it on ``port``."""
        readers = self.readers.get(bit, [])
        assert [(c["type"], p) for c, p in readers] == [(kind, port)], f"{bit} read by {readers}"
        return readers[0][0]

    def pin_driver(self, bit, kind: str, port: str):
        c, p = self.driver[bit]
        assert (c["type"], p) == (kind, port), f"{bit} driven by {c['type']}.{p}"
        return c


def _taps(cell) -> int:
    assert cell["parameters"]["DEL_MODE"] == "USER_DEFINED"
    return int(cell["parameters"]["DEL_VALUE"], 2)


def test_rx_delay_is_on_data_and_ctl_only():
    """``RgmiiRx(delay_ns=2.0)``: each of rx_data's 4 lines and rx_ctl go IB -> DELAYG (80 taps of
    25 ps) -> IDDRX1F on the domain's clock; rx_clk's IB goes to no DELAYG."""
    n = Netlist(RgmiiRx(tb.rgmii_pins(), delay_ns=2.0), "rx")
    (sclk,) = n.ports["eth_rx_clk"]
    assert len(n.ports["rx_data"]) == 4 and n.count("DELAYG") == 5 and n.count("IDDRX1F") == 5
    for bit in n.ports["rx_data"] + n.ports["rx_ctl"]:
        ib = n.pin_reader(bit, "IB", "I")
        delay = n.pin_reader(ib["connections"]["O"][0], "DELAYG", "A")
        assert _taps(delay) == 80
        iddr = n.pin_reader(delay["connections"]["Z"][0], "IDDRX1F", "D")
        assert iddr["connections"]["SCLK"] == [sclk]
    (clk,) = n.ports["rx_clk"]
    ib = n.pin_reader(clk, "IB", "I")
    assert all(c["type"] != "DELAYG" for c, _ in n.readers.get(ib["connections"]["O"][0], []))


def test_tx_delay_is_on_the_clock_only():
    """``RgmiiTx(clock_delay_ns=2.0)``: one DELAYG (80 taps), ODDRX1F -> DELAYG -> OBZ on tx_clk;
    tx_data's lines and tx_ctl go ODDRX1F -> OBZ."""
    n = Netlist(RgmiiTx(tb.rgmii_pins(), clock_delay_ns=2.0), "tx")
    assert n.count("DELAYG") == 1 and n.count("ODDRX1F") == 6
    (clk,) = n.ports["tx_clk"]
    obz = n.pin_driver(clk, "OBZ", "O")
    delay = n.pin_driver(obz["connections"]["I"][0], "DELAYG", "Z")
    assert _taps(delay) == 80
    oddr = n.pin_driver(delay["connections"]["A"][0], "ODDRX1F", "Q")
    assert oddr["connections"]["D0"] == ["1"] and oddr["connections"]["D1"] == ["0"]  # high on the rising half
    for bit in n.ports["tx_data"] + n.ports["tx_ctl"]:
        obz = n.pin_driver(bit, "OBZ", "O")
        n.pin_driver(obz["connections"]["I"][0], "ODDRX1F", "Q")


def test_no_delay_no_delayg():
    assert Netlist(RgmiiRx(tb.rgmii_pins()), "rx").count("DELAYG") == 0
    assert Netlist(RgmiiTx(tb.rgmii_pins()), "tx").count("DELAYG") == 0


def test_delay_limits():
    """0 .. 127 taps of 25 ps, refused at construction beyond."""
    assert [delay_taps(ns) for ns in (0, 0.5, 2.0, 3.175)] == [0, 20, 80, 127]
    for bad in (3.2, 10.0, -0.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="DELAYG delays by 0 .. 127 taps of 25 ps"):
            RgmiiRx(tb.rgmii_pins(), delay_ns=bad)
        with pytest.raises(ValueError, match="clock_delay_ns"):
            RgmiiTx(tb.rgmii_pins(), clock_delay_ns=bad)


def test_delay_needs_an_ecp5():
    from amaranth_boards.icebreaker import ICEBreakerPlatform

    for platform, what in ((None, "no platform"), (ICEBreakerPlatform(), "family 'iCE40'")):
        with pytest.raises(ValueError, match=rf"RgmiiRx\(delay_ns=2.0\) needs an ECP5 platform .*{what}"):
            verilog.convert(RgmiiRx(tb.rgmii_pins(), delay_ns=2.0), name="rx", platform=platform)
        with pytest.raises(ValueError, match=rf"RgmiiTx\(clock_delay_ns=2.0\) needs an ECP5 platform .*{what}"):
            verilog.convert(RgmiiTx(tb.rgmii_pins(), clock_delay_ns=2.0), name="tx", platform=platform)


# ---- cocotb -------------------------------------------------------------------------------


def _config(sim: str, **extra) -> dict:
    # Icarus runs the testbench some ten times slower than Verilator: fewer frames there
    frames = {"verilator": 30 if FULL else 8, "icarus": 12 if FULL else 2}[sim]
    return {"seed": 5, "frames": frames, "loop_frames": 3 * frames // 4 or 1, **extra}


#: The boards' delays, both on one DUT: 2 ns on the receive data (Colorlight 5A-75B) and on the
#: forwarded transmit clock (ECPIX-5).
DELAYS = {"rx_delay_ps": 2000, "tx_clock_delay_ps": 2000}


@pytest.mark.parametrize("sim,delays", [
    ("verilator", False), ("icarus", False), ("icarus", True),
    pytest.param("verilator", True, marks=pytest.mark.skipif(not FULL, reason=(
        "a second Verilator build, its DELAYG a pass-through (Icarus runs the delays): HBFP_SIM_FULL=1"))),
], ids=["verilator", "icarus", "icarus-delays", "verilator-delays"])
def test_rgmii_cocotb(sim, delays):
    runner.require(sim)
    config = _config(sim, **(DELAYS if delays else {}))
    rx_ns, tx_ns = (config.get(k, 0) / 1000 for k in ("rx_delay_ps", "tx_clock_delay_ps"))
    tests, failed = runner.run(lambda: tb.RgmiiLoop(rx_delay_ns=rx_ns, tx_clock_delay_ns=tx_ns), "rgmii_loop",
                               "tb_rgmii", sim, config, platform=tb.ECP5_IO)
    assert tests == 4 and failed == 0


#: The tests each mutation must fail (the receive side's fail the reception and the loop, the
#: transmit side's the transmission and the loop).
MUTANT_FAILURES = {"rx_nibbles": 3, "rx_ctl": 3, "tx_nibbles": 2, "tx_ctl": 2}


@pytest.mark.skipif(not FULL, reason="a Verilator build per mutation: HBFP_SIM_FULL=1")
@pytest.mark.parametrize("mutation", tb.MUTATIONS)
def test_rgmii_mutations_fail(mutation):
    runner.require("verilator")
    config = _config("verilator", mutation=mutation)
    tests, failed = runner.run(lambda: tb.RgmiiLoop(mutation=mutation), "rgmii_loop", "tb_rgmii", "verilator",
                               config, platform=tb.ECP5_IO)
    assert tests == 4 and failed == MUTANT_FAILURES[mutation]
