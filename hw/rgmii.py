"""RGMII on an FPGA's DDR I/O: the PHY's 4-bit double-data-rate interface as GMII's byte a cycle
(``hw.eth_mac``'s ports), 125 MHz at 1 Gb/s.

RGMII (v2.0) carries a byte a clock cycle on 4 data lines, its low nibble on the rising edge and
its high nibble on the falling one, and the control line ``ctl`` the data valid on the rising
edge and valid XOR error on the falling one (so an idle line is low on both). The receive side
comes with the PHY's clock (``rx_clk``: its own domain, ``RgmiiRx``'s ``domain``); the transmit
side goes with a clock the FPGA forwards (``tx_clk``, from the link's domain, a register pair that
toggles). The clock-to-data skew RGMII needs (about 2 ns) is the PHY's to add (its internal
delays, the default of the boards' PHYs), so data and clock leave and arrive edge-aligned here.

``io.DDRBuffer`` maps to the ECP5's IDDRX1F and ODDRX1F (``amaranth.vendor.LatticePlatform``).
"""

from __future__ import annotations

from amaranth import Module
from amaranth.lib import io, wiring
from amaranth.lib.wiring import In, Out

__all__ = ["RgmiiRx", "RgmiiTx", "decode_rx", "encode_tx"]


def decode_rx(rise_ctl, fall_ctl):
    """(rx_dv, rx_er) of a cycle's two ``ctl`` samples."""
    return rise_ctl, rise_ctl ^ fall_ctl


def encode_tx(tx_en, tx_er):
    """(rising, falling) ``ctl`` of a cycle's tx_en and tx_er."""
    return tx_en, tx_en ^ tx_er


class RgmiiRx(wiring.Component):
    """The receive side of ``pins`` (a platform's ``eth_rgmii`` resource, requested with
    ``dir="-"``) as GMII in ``domain`` (clocked by the PHY's ``rx_clk``, which the caller makes
    that domain's clock: ``clock`` is its input buffer's output): ``rx_dv``, ``rx_er``, ``rxd``,
    registered once after the DDR input registers."""

    def __init__(self, pins, *, domain: str = "eth_rx", ctl: str = "rx_ctl"):
        self.pins, self.domain, self.ctl = pins, domain, ctl
        super().__init__({"rx_dv": Out(1), "rx_er": Out(1), "rxd": Out(8), "clock": Out(1)})

    def elaborate(self, platform):
        m = Module()
        m.submodules.clk = clk = io.Buffer("i", self.pins.rx_clk)
        m.d.comb += self.clock.eq(clk.i)
        m.submodules.data = data = io.DDRBuffer("i", self.pins.rx_data, i_domain=self.domain)
        m.submodules.ctl = ctl = io.DDRBuffer("i", getattr(self.pins, self.ctl), i_domain=self.domain)
        dv, er = decode_rx(ctl.i[0], ctl.i[1])
        m.d[self.domain] += [self.rx_dv.eq(dv), self.rx_er.eq(er), self.rxd.eq(data.i[1] << 4 | data.i[0])]
        return m


class RgmiiTx(wiring.Component):
    """GMII ``tx_en``, ``tx_er``, ``txd`` in ``domain`` onto the transmit side of ``pins``,
    with ``tx_clk`` forwarded from the domain's clock (high on the rising half)."""

    def __init__(self, pins, *, domain: str = "eth", ctl: str = "tx_ctl"):
        self.pins, self.domain, self.ctl = pins, domain, ctl
        super().__init__({"tx_en": In(1), "tx_er": In(1), "txd": In(8)})

    def elaborate(self, platform):
        m = Module()
        m.submodules.data = data = io.DDRBuffer("o", self.pins.tx_data, o_domain=self.domain)
        m.submodules.ctl = ctl = io.DDRBuffer("o", getattr(self.pins, self.ctl), o_domain=self.domain)
        m.submodules.clk = clk = io.DDRBuffer("o", self.pins.tx_clk, o_domain=self.domain)
        rise, fall = encode_tx(self.tx_en, self.tx_er)
        m.d.comb += [data.o[0].eq(self.txd[:4]), data.o[1].eq(self.txd[4:]), ctl.o[0].eq(rise), ctl.o[1].eq(fall),
                     clk.o[0].eq(1), clk.o[1].eq(0)]
        return m
