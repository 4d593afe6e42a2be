"""RGMII on an FPGA's DDR I/O: the PHY's 4-bit double-data-rate interface as GMII's byte a cycle
(``hw.eth_mac``'s ports), 125 MHz at 1 Gb/s.

RGMII (v2.0) carries a byte a clock cycle on 4 data lines, its low nibble on the rising edge and
its high nibble on the falling one, and the control line ``ctl`` the data valid on the rising
edge and valid XOR error on the falling one (so an idle line is low on both). The receive side
comes with the PHY's clock (``rx_clk``: its own domain, ``RgmiiRx``'s ``domain``); the transmit
side goes with a clock the FPGA forwards (``tx_clk``, from the link's domain, a register pair that
toggles).

``io.DDRBuffer`` maps to the ECP5's IDDRX1F and ODDRX1F (``amaranth.vendor.LatticePlatform``).

Clock-to-data delays
--------------------

Without delays of its own each end sends clock and data edge-aligned, and each receiver needs its
clock's edges about 2 ns (a quarter period) after the data's changes. Someone has to add that delay
in each direction: the PHY (its internal delays, RGMII-ID), the board (longer clock traces), or the
FPGA. On our two boards the PHY adds one of the two and the FPGA must add the other, as the boards'
known-good open designs do (LiteX's targets, on LiteEth's ECP5 RGMII PHY):

- Colorlight 5A-75B: its PHY delays the transmit clock itself; the FPGA delays the received data
  and ``ctl`` by 2 ns (``RgmiiRx(..., delay_ns=2.0)``). (LiteX: ``tx_delay=0``, ``rx_delay`` 2 ns.)
- ECPIX-5: its KSZ9031 delays the receive clock itself; the FPGA delays the forwarded ``tx_clk``
  by 2 ns (``RgmiiTx(..., clock_delay_ns=2.0)``). (LiteX: ``rx_delay=0``, ``tx_delay`` 2 ns.)

The delay is an ECP5 ``DELAYG`` in each I/O cell's path, ``DEL_MODE="USER_DEFINED"`` with
``DEL_VALUE`` taps of 25 ps (``TAP_PS``; 0 .. 127 taps, ``MAX_TAPS``, so up to 3.175 ns):
``round(delay_ns / 0.025)``, 80 for 2 ns. On the receive side each data line and ``ctl`` go pad
-> IB -> DELAYG -> IDDRX1F (the clock itself is not delayed); on the transmit side the forwarded
clock goes ODDRX1F -> DELAYG -> OBZ -> pad (data and ``ctl`` are not delayed). ``io.DDRBuffer``
has no place for a delay element, so with a delay the primitives are instantiated here the way
``LatticePlatform`` instantiates them for ``io.DDRBuffer`` (same ports, ``Q0`` the rising edge's
bit, ``port.invert`` applied behind the DDR register), with the DELAYG in between; without one
(the default, 0) the path is ``io.DDRBuffer``'s. A delay needs an ECP5 platform: elaborating
one for any other platform (or none) is an error.

What simulation shows of this, and what not. ``sim/tb_rgmii.py`` runs these units on the
behavioural models of ``sim/ecp5_io_model.v``. Under Icarus the DELAYG model delays by
``DEL_VALUE`` x 25 ps, and the testbench checks that the forwarded clock's edges come
``clock_delay_ns`` after the data's (both leave ODDRX1Fs on the same clock, so on the chip too
the difference is the DELAYG's, give or take the pads' and routing's skew) and that the received
data and ``ctl``, launched by its PHY model that much earlier than a quarter period before their
edges, change past the DELAYGs at least RGMII's 1 ns setup and hold away from ``rx_clk``'s edges
and are sampled right. Under Verilator (built here without ``--timing``) the model is a
pass-through and the runs show only that the delayed paths carry the same bits in the same order
as the undelayed ones. Neither models the ECP5's clock network: in simulation ``rx_clk`` reaches
the IDDRX1Fs the instant it reaches its pin, while on the chip it arrives through the clock
network later, by an insertion delay the simulation does not have. Whether data delayed by 2 ns
then meet the IDDRX1Fs' setup and hold depends on that delay and on the pads' and routing's, which
neither the simulation nor this flow checks (nextpnr is given no I/O timing constraints): the
2 ns is what the known-good designs use on these boards, and only a board shows it right.

nextpnr-ecp5 packs each pin's DELAYG with its IDDRX1F or ODDRX1F into the pin's IOLOGIC (a
small build for the Colorlight 5A-75B with both delays: 11 IOLOGIC, as many as without delays,
six of them with ``DELAY.DEL_VALUE`` 80, the transmit clock's with the output delay enabled).
"""

from __future__ import annotations

import math

from amaranth import ClockSignal, Const, Instance, Module, Signal
from amaranth.lib import io, wiring
from amaranth.lib.wiring import In, Out

__all__ = ["MAX_TAPS", "TAP_PS", "RgmiiRx", "RgmiiTx", "decode_rx", "delay_taps", "encode_tx"]

#: A DELAYG tap (``DEL_MODE="USER_DEFINED"``), in ps.
TAP_PS = 25
#: The most taps ``DEL_VALUE`` takes.
MAX_TAPS = 127


def decode_rx(rise_ctl, fall_ctl):
    """(rx_dv, rx_er) of a cycle's two ``ctl`` samples."""
    return rise_ctl, rise_ctl ^ fall_ctl


def encode_tx(tx_en, tx_er):
    """(rising, falling) ``ctl`` of a cycle's tx_en and tx_er."""
    return tx_en, tx_en ^ tx_er


def delay_taps(delay_ns: float, what: str = "delay_ns") -> int:
    """The DELAYG taps (``DEL_VALUE``) nearest ``delay_ns``; a ValueError outside 0 .. ``MAX_TAPS``."""
    taps = round(delay_ns * 1000 / TAP_PS) if math.isfinite(delay_ns) and delay_ns >= 0 else None
    if taps is None or taps > MAX_TAPS:
        raise ValueError(f"{what}={delay_ns!r}: an ECP5 DELAYG delays by 0 .. {MAX_TAPS} taps of {TAP_PS} ps "
                         f"(0 .. {MAX_TAPS * TAP_PS / 1000} ns)")
    return taps


def _require_ecp5(platform, who: str) -> None:
    family = getattr(platform, "family", None)
    if family != "ecp5":
        raise ValueError(f"{who} needs an ECP5 platform (its DELAYG), and this is "
                         f"{'no platform' if platform is None else f'{platform!r} (family {family!r})'}")


def _uninverted(port):
    """``port`` without its inversion (a caller applies it past the DDR register, so that nothing
    comes between the pad's buffer and the I/O cell's delay and register)."""
    if isinstance(port, io.SingleEndedPort):
        return io.SingleEndedPort(port.io, direction=port.direction)
    if isinstance(port, io.DifferentialPort):
        return io.DifferentialPort(port.p, port.n, direction=port.direction)
    raise TypeError(f"a delayed RGMII pin must be a SingleEndedPort or DifferentialPort, not {port!r}")


def _delayg(taps: int, a, z) -> Instance:
    return Instance("DELAYG", p_DEL_MODE="USER_DEFINED", p_DEL_VALUE=taps, i_A=a, o_Z=z)


class _DelayedDDRInput(wiring.Component):
    """``io.DDRBuffer("i", port, i_domain=domain)`` as ``LatticePlatform`` builds it for an ECP5
    (IB, IDDRX1F: ``i[0]`` the bits at the rising edge, ``i[1]`` at the falling one after it),
    with a DELAYG of ``taps`` between each pin's IB and its IDDRX1F."""

    def __init__(self, port, domain: str, taps: int):
        self.port, self.domain, self.taps = port, domain, taps
        super().__init__({"i": Out(2 * len(port))})

    def elaborate(self, platform):
        m = Module()
        n = len(self.port)
        m.submodules.buf = buf = io.Buffer("i", _uninverted(self.port))
        delayed, q0, q1 = Signal(n, name="delayed"), Signal(n, name="q0"), Signal(n, name="q1")
        for bit in range(n):
            m.submodules[f"delay{bit}"] = _delayg(self.taps, buf.i[bit], delayed[bit])
            m.submodules[f"i_ddr{bit}"] = Instance("IDDRX1F", i_SCLK=ClockSignal(self.domain), i_RST=Const(0),
                                                   i_D=delayed[bit], o_Q0=q0[bit], o_Q1=q1[bit])
        inv = sum(inv << bit for bit, inv in enumerate(self.port.invert))
        m.d.comb += [self.i[:n].eq(q0 ^ inv), self.i[n:].eq(q1 ^ inv)]
        return m


class RgmiiRx(wiring.Component):
    """The receive side of ``pins`` (a platform's ``eth_rgmii`` resource, requested with
    ``dir="-"``) as GMII in ``domain`` (clocked by the PHY's ``rx_clk``, which the caller makes
    that domain's clock: ``clock`` is its input buffer's output): ``rx_dv``, ``rx_er``, ``rxd``,
    registered once after the DDR input registers.

    ``delay_ns``: the delay of each data line and ``ctl`` before its DDR register, an ECP5 DELAYG
    (module docstring); 0, none (``io.DDRBuffer``'s path). ``taps``: its ``DEL_VALUE``."""

    def __init__(self, pins, *, domain: str = "eth_rx", ctl: str = "rx_ctl", delay_ns: float = 0.0):
        try:
            self.taps = delay_taps(delay_ns, "RgmiiRx delay_ns")
        except ValueError:
            self._MustUse__used = True  # never elaborated: no warning that it was not
            raise
        self.pins, self.domain, self.ctl, self.delay_ns = pins, domain, ctl, delay_ns
        super().__init__({"rx_dv": Out(1), "rx_er": Out(1), "rxd": Out(8), "clock": Out(1)})

    def _ddr_in(self, m, name, port):
        """(rising, falling) of ``port`` through its DDR input register."""
        if self.delay_ns:
            m.submodules[name] = buf = _DelayedDDRInput(port, self.domain, self.taps)
            return buf.i[:len(port)], buf.i[len(port):]
        m.submodules[name] = buf = io.DDRBuffer("i", port, i_domain=self.domain)
        return buf.i[0], buf.i[1]

    def elaborate(self, platform):
        if self.delay_ns:
            _require_ecp5(platform, f"RgmiiRx(delay_ns={self.delay_ns})")
        m = Module()
        m.submodules.clk = clk = io.Buffer("i", self.pins.rx_clk)
        m.d.comb += self.clock.eq(clk.i)
        data = self._ddr_in(m, "data", self.pins.rx_data)
        ctl = self._ddr_in(m, "ctl", getattr(self.pins, self.ctl))
        dv, er = decode_rx(ctl[0], ctl[1])
        m.d[self.domain] += [self.rx_dv.eq(dv), self.rx_er.eq(er), self.rxd.eq(data[1] << 4 | data[0])]
        return m


class RgmiiTx(wiring.Component):
    """GMII ``tx_en``, ``tx_er``, ``txd`` in ``domain`` onto the transmit side of ``pins``,
    with ``tx_clk`` forwarded from the domain's clock (high on the rising half).

    ``clock_delay_ns``: the delay of the forwarded ``tx_clk`` behind its DDR register, an ECP5
    DELAYG (module docstring), so that its edges come that long after the data's; 0, none
    (``io.DDRBuffer``'s path). ``taps``: its ``DEL_VALUE``."""

    def __init__(self, pins, *, domain: str = "eth", ctl: str = "tx_ctl", clock_delay_ns: float = 0.0):
        try:
            self.taps = delay_taps(clock_delay_ns, "RgmiiTx clock_delay_ns")
        except ValueError:
            self._MustUse__used = True  # never elaborated: no warning that it was not
            raise
        self.pins, self.domain, self.ctl, self.clock_delay_ns = pins, domain, ctl, clock_delay_ns
        super().__init__({"tx_en": In(1), "tx_er": In(1), "txd": In(8)})

    def elaborate(self, platform):
        if self.clock_delay_ns:
            _require_ecp5(platform, f"RgmiiTx(clock_delay_ns={self.clock_delay_ns})")
        m = Module()
        m.submodules.data = data = io.DDRBuffer("o", self.pins.tx_data, o_domain=self.domain)
        m.submodules.ctl = ctl = io.DDRBuffer("o", getattr(self.pins, self.ctl), o_domain=self.domain)
        rise, fall = encode_tx(self.tx_en, self.tx_er)
        m.d.comb += [data.o[0].eq(self.txd[:4]), data.o[1].eq(self.txd[4:]), ctl.o[0].eq(rise), ctl.o[1].eq(fall)]
        if self.clock_delay_ns:
            # ODDRX1F -> DELAYG -> OBZ, as LatticePlatform's DDR output but for the delay (and its
            # output enable, always on here: the OBZ's T low rather than registered low).
            port = self.pins.tx_clk
            m.submodules.clk = clk = io.Buffer("o", _uninverted(port))
            inv = port.invert[0]
            oddr_q = Signal()
            m.submodules.clk_ddr = Instance("ODDRX1F", i_SCLK=ClockSignal(self.domain), i_RST=Const(0),
                                            i_D0=Const(1 ^ inv), i_D1=Const(0 ^ inv), o_Q=oddr_q)
            m.submodules.clk_delay = _delayg(self.taps, oddr_q, clk.o)
        else:
            m.submodules.clk = clk = io.DDRBuffer("o", self.pins.tx_clk, o_domain=self.domain)
            m.d.comb += [clk.o[0].eq(1), clk.o[1].eq(0)]
        return m
