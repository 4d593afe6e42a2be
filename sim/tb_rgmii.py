"""cocotb testbenches of the RGMII interface (``hbfp.hw.rgmii``) with the Ethernet MAC behind it,
at the pins and at RGMII's timing, against a model of the PHY written from RGMII v2.0 and the
IEEE 802.3 reference of ``sim/tb_eth_mac.py``.

The PHY (``RgmiiPhy``), at 1 Gb/s with its internal delays (RGMII-ID, as the boards' PHYs are
set: the FPGA's clock and data are edge-aligned, the PHY skews them by a quarter period):

- receive: drives ``rx_clk`` (125 MHz) without pause; a cycle's byte goes out low nibble for the
  rising edge, high nibble for the falling one, ``rx_ctl`` RX_DV for the rising edge and RX_DV
  XOR RX_ER for the falling one, each value set a quarter period before the edge that samples it
  (the PHY's delay of ``rx_clk``), so that every edge finds it steady. Between frames ``rx_data``
  carries the in-band status (link up, 1000 Mb/s, full duplex) that RGMII allows there.
- transmit: samples ``tx_data`` and ``tx_ctl`` a quarter period after each edge of the forwarded
  ``tx_clk`` (the PHY's delay of ``tx_clk``), and puts each cycle's nibbles together into a byte,
  TX_EN and TX_ER.

Clock-to-data delays in the FPGA (``RgmiiRx(delay_ns=...)``, ``RgmiiTx(clock_delay_ns=...)``:
the configuration's ``rx_delay_ps`` and ``tx_clock_delay_ps``, the DUT built with them): the
DELAYG model (``sim/ecp5_io_model.v``) delays under Icarus and passes through under Verilator.
Where it delays, the PHY model leaves to the FPGA what the FPGA adds: it launches each received
nibble ``rx_delay_ps`` earlier (a quarter period plus that before the edge that samples it: so
the nibble reaches the IDDRX1F, past the DELAYG, a quarter period before that edge, as without a
delay), and it samples the transmit pins ``tx_clock_delay_ps`` sooner after each edge of
``tx_clk`` (at the edge itself for 2 ns: a PHY without a transmit delay of its own, as the
ECPIX-5's). It measures the delay of ``tx_clk`` behind ``eth_clk`` (the data's clock) and checks
that it is the configured one (0 where the model passes through), and checks that every change of
the received lines past the DELAYGs (the IDDRX1Fs' inputs) keeps RGMII's setup and hold (1 ns)
from ``rx_clk``'s edges. So under Icarus the runs show that the delays sit on the right signals
with the right size; they do not show that the size suits a board (``hbfp.hw.rgmii``'s
docstring: the simulation has no clock network, and so none of its insertion delay). Under
Verilator they show that the delayed paths carry the same bits in the same order as the
undelayed ones.

DUT ``RgmiiLoop``: ``RgmiiRx`` -> ``MacRx`` (in ``eth_rx``, clocked by ``rx_clk`` through its input
buffer, reset-less, as ``hw.boards.EthBoardTop`` has it) -> ``o``, and ``i`` -> ``MacTx`` ->
``RgmiiTx`` (in ``eth``, the testbench's 125 MHz ``eth_clk``, at another phase); with ``loop`` high,
the received frames cross an asynchronous FIFO into ``MacTx`` instead (``i`` and ``o`` idle): a
frame goes in at the receive pins and out at the transmit pins. It is elaborated for an ECP5
(``ECP5_IO``): its buffers are the Lattice platform's IB, OBZ, IDDRX1F and ODDRX1F, and with delays
``hbfp.hw.rgmii``'s DELAYGs (``sim/ecp5_io_model.v``). ``mutation`` breaks the RGMII side on
purpose, in the wiring between the RGMII units and the MAC, to show that the tests notice:
``rx_nibbles``/``tx_nibbles`` swap the nibbles of each byte, ``rx_ctl`` takes RX_ER from the falling
edge's ``rx_ctl`` itself, ``tx_ctl`` puts TX_ER on the falling edge (neither XORed with the valid
bit).

Tests: good frames of 64 .. 1518 bytes on the wire (random payloads) at the shortest gaps and
line rate; every kind of damage of ``tb_eth_mac.damaged`` (rx_er, bad FCS, runts, oversize, ...)
and a false carrier, with a reader that stalls; frames given to ``MacTx`` on the pins (preamble,
SFD, padding, FCS, gaps, ``tx_clk``'s period and duty cycle); frames and damage looped back.

Configuration (``tb_config()``): ``seed``, ``frames`` (random good frames), ``loop_frames``,
``rx_delay_ps`` and ``tx_clock_delay_ps`` (the DUT's delays, 0 if not given).
"""

from __future__ import annotations

import random
import zlib
from collections import deque
from types import SimpleNamespace

import cocotb
from amaranth import Cat, ClockDomain, DomainRenamer, Module, Mux
from amaranth.lib import io, stream, wiring
from amaranth.lib.wiring import In, Out
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge, First, ReadOnly, RisingEdge, Timer
from cocotb.utils import get_sim_time

from hbfp.hw.crossing import AsyncStreamFifo
from hbfp.hw.eth_mac import IFG_CYCLES, MacRx, MacTx, frame_layout
from hbfp.hw.eth_udp import RX_CROSSING_DEPTH
from hbfp.hw.rgmii import RgmiiRx, RgmiiTx
from hbfp.sim import tb_eth_mac as ref
from hbfp.sim.runner import tb_config

# ---- elaboration for an ECP5 --------------------------------------------------------------


class _Ecp5Io:
    """A platform for ``verilog.convert`` that gives ``io.Buffer`` and ``io.DDRBuffer`` the
    primitives an ECP5 board's build has: ``amaranth.vendor.LatticePlatform.get_io_buffer``
    itself (which reads only ``family``). ``family`` also selects the primitives' models
    (``runner.PRIMITIVE_MODELS``)."""

    family = "ecp5"

    def get_io_buffer(self, buffer):
        from amaranth.vendor import LatticePlatform

        return LatticePlatform.get_io_buffer(self, buffer)

    def __repr__(self):
        return "ECP5_IO"


ECP5_IO = _Ecp5Io()


def rgmii_pins() -> SimpleNamespace:
    """The pins of an ``eth_rgmii`` resource (as ``platform.request(..., dir="-")`` gives them),
    each a top-level port of the generated Verilog under its own name."""
    def port(name, width=1):
        return io.SingleEndedPort(io.IOPort(width, name=name))

    return SimpleNamespace(rx_clk=port("rx_clk"), rx_data=port("rx_data", 4), rx_ctl=port("rx_ctl"),
                           tx_clk=port("tx_clk"), tx_data=port("tx_data", 4), tx_ctl=port("tx_ctl"))


MUTATIONS = ("rx_nibbles", "rx_ctl", "tx_nibbles", "tx_ctl")


class RgmiiLoop(wiring.Component):
    """``RgmiiRx`` -> ``MacRx`` -> ``o`` and ``i`` -> ``MacTx`` -> ``RgmiiTx`` on ``rgmii_pins()``;
    with ``loop`` high, ``MacRx``'s frames go to ``MacTx`` (module docstring). The receive side
    runs in ``eth_rx`` (the PHY's ``rx_clk``), the transmit side in ``eth`` (``eth_clk``,
    ``eth_rst``). Counters: ``MacRx``'s, prefixed ``rx_``, and ``tx_frames``.
    ``rx_delay_ns``, ``tx_clock_delay_ns``: ``RgmiiRx``'s ``delay_ns``, ``RgmiiTx``'s ``clock_delay_ns``."""

    def __init__(self, buffer_bytes: int = 4096, *, mutation: str | None = None, rx_delay_ns: float = 0.0,
                 tx_clock_delay_ns: float = 0.0):
        if mutation is not None and mutation not in MUTATIONS:
            self._MustUse__used = True  # never elaborated: no warning that it was not
            raise ValueError(f"mutation must be one of {MUTATIONS}, not {mutation!r}")
        self.buffer_bytes, self.mutation = buffer_bytes, mutation
        self.pins = rgmii_pins()
        self.rgmii_rx = RgmiiRx(self.pins, domain="eth_rx", delay_ns=rx_delay_ns)
        self.rgmii_tx = RgmiiTx(self.pins, domain="eth", clock_delay_ns=tx_clock_delay_ns)
        super().__init__({
            "o": Out(stream.Signature(frame_layout())),
            **{f"rx_{c}": Out(32) for c in ref.COUNTERS},
            "i": In(stream.Signature(frame_layout())),
            "tx_frames": Out(32),
            "loop": In(1),
        })

    def elaborate(self, platform):
        m = Module()
        m.submodules.rgmii_rx = rx = self.rgmii_rx
        m.submodules.rgmii_tx = tx = self.rgmii_tx
        m.domains.eth_rx = eth_rx = ClockDomain("eth_rx", reset_less=True)
        m.d.comb += eth_rx.clk.eq(rx.clock)
        mac_rx, mac_tx = MacRx(self.buffer_bytes), MacTx(self.buffer_bytes)
        m.submodules.mac_rx = DomainRenamer("eth_rx")(mac_rx)
        m.submodules.mac_tx = DomainRenamer("eth")(mac_tx)

        swap = lambda byte: Cat(byte[4:], byte[:4])  # noqa: E731
        mut = self.mutation
        m.d.comb += [
            mac_rx.rx_dv.eq(rx.rx_dv),
            mac_rx.rx_er.eq(rx.rx_er ^ rx.rx_dv if mut == "rx_ctl" else rx.rx_er),
            mac_rx.rxd.eq(swap(rx.rxd) if mut == "rx_nibbles" else rx.rxd),
            tx.tx_en.eq(mac_tx.tx_en),
            tx.tx_er.eq(mac_tx.tx_er ^ mac_tx.tx_en if mut == "tx_ctl" else mac_tx.tx_er),
            tx.txd.eq(swap(mac_tx.txd) if mut == "tx_nibbles" else mac_tx.txd),
        ]
        m.d.comb += [getattr(self, f"rx_{c}").eq(getattr(mac_rx, c)) for c in ref.COUNTERS]
        m.d.comb += self.tx_frames.eq(mac_tx.frames)

        # The loop: the receive clock's frames into the transmit clock's, as hw.eth_udp crosses.
        m.submodules.crossing = crossing = AsyncStreamFifo(frame_layout(), depth=RX_CROSSING_DEPTH,
                                                           w_domain="eth_rx", r_domain="eth")
        loop = self.loop
        m.d.comb += [
            self.o.valid.eq(mac_rx.o.valid & ~loop),
            self.o.payload.eq(mac_rx.o.payload),
            crossing.i.valid.eq(mac_rx.o.valid & loop),
            crossing.i.payload.eq(mac_rx.o.payload),
            mac_rx.o.ready.eq(Mux(loop, crossing.i.ready, self.o.ready)),
            mac_tx.i.valid.eq(Mux(loop, crossing.o.valid, self.i.valid)),
            mac_tx.i.payload.eq(Mux(loop, crossing.o.payload, self.i.payload)),
            crossing.o.ready.eq(loop & mac_tx.i.ready),
            self.i.ready.eq(~loop & mac_tx.i.ready),
        ]
        return m


# ---- the PHY ------------------------------------------------------------------------------

#: 125 MHz, a byte a cycle at 1 Gb/s.
PERIOD_PS = 8000
#: The PHY's internal delay of a clock against its data (RGMII-ID: 1.5 .. 2 ns), a quarter period.
SKEW_PS = PERIOD_PS // 4
#: Where the first rising edge of ``eth_clk`` falls after ``rx_clk``'s: the two clocks are
#: unrelated (in phase, here; in frequency too, on a board).
ETH_PHASE_PS = 3300
#: ``rx_data`` while RX_DV and RX_ER are low, on both edges: RGMII's in-band status (bit 0 link
#: up, bits 2:1 the receive clock's speed, 0b10 for 125 MHz, bit 3 full duplex).
IN_BAND_STATUS = 0b1101
#: GMII's RXD for a false carrier (RX_ER without RX_DV: IEEE 802.3 table 35-2).
FALSE_CARRIER = 0x0E
#: RGMII v2.0's setup and hold at a receiver (TsetupR, TholdR), ps.
SETUP_HOLD_PS = 1000


def delays_modelled() -> bool:
    """Whether this simulator's DELAYG model delays (``sim/ecp5_io_model.v``: not Verilator's)."""
    return "verilator" not in cocotb.SIM_NAME.lower()


class RgmiiPhy:
    """The PHY's side of the DUT's RGMII pins (module docstring). ``send`` queues GMII cycles
    ((rx_dv, rx_er, rxd) each) for the receive pins, which idle in between; ``tx_line`` collects
    (tx_en, tx_er, txd) for each ``tx_clk`` cycle while ``recording``, and ``tx_halves`` the
    lengths (ps) of ``tx_clk``'s high and low halves, ("high" or "low", ps) each.

    ``rx_lead``: how long before the edge that samples it each nibble goes on the receive pins
    (a quarter period, plus the DUT's delay of its receive inputs where the simulator models it);
    ``tx_after``: how long after each edge of ``tx_clk`` the transmit pins are sampled (a quarter
    period, less the DUT's delay of ``tx_clk`` where the simulator models it: ``_setup`` sets it
    from the delay it measures)."""

    def __init__(self, dut, *, rx_lead: int = SKEW_PS, tx_after: int = SKEW_PS):
        assert 0 < rx_lead <= PERIOD_PS // 2 and 0 <= tx_after < PERIOD_PS // 2
        self.dut, self.rx_lead, self.tx_after = dut, rx_lead, tx_after
        self.rx_edge = 0  # when rx_clk last changed (ps)
        self.rx: deque[tuple[int, int, int]] = deque()
        self.tx_line: list[tuple[int, int, int]] = []
        self.tx_halves: set[tuple[str, float]] = set()
        self.recording = False

    def start(self) -> None:
        self.dut.rx_clk.value = 0
        self.dut.rx_ctl.value = 0
        self.dut.rx_data.value = IN_BAND_STATUS
        cocotb.start_soon(self._drive_rx())
        cocotb.start_soon(self._monitor_tx())

    def send(self, cycles) -> None:
        self.rx.extend(cycles)

    async def drained(self) -> None:
        """Returns once every queued cycle has been on the pins."""
        while self.rx:
            await RisingEdge(self.dut.rx_clk)
        await RisingEdge(self.dut.rx_clk)

    async def _drive_rx(self) -> None:
        dut = self.dut
        idle = (0, 0, IN_BAND_STATUS * 0x11)
        lead, rest = self.rx_lead, PERIOD_PS // 2 - self.rx_lead
        while True:
            dv, er, d = self.rx.popleft() if self.rx else idle
            if not dv and not er:
                d = idle[2]
            # RGMII v2.0: RXD[3:0] and RX_DV for the rising edge, RXD[7:4] and RX_DV XOR RX_ER for
            # the falling one; each set ``rx_lead`` (a quarter period) before its edge.
            for clk, data, ctl in ((1, d & 0xF, dv), (0, d >> 4, dv ^ er)):
                dut.rx_data.value = data
                dut.rx_ctl.value = ctl
                await Timer(lead, "ps")
                dut.rx_clk.value = clk
                self.rx_edge = get_sim_time("ps")
                if rest:
                    await Timer(rest, "ps")

    def _sample(self) -> tuple[int, int]:
        data, ctl = self.dut.tx_data.value, self.dut.tx_ctl.value
        if self.recording:
            assert data.is_resolvable and ctl.is_resolvable, f"tx_data {data}, tx_ctl {ctl}"
        return (int(data), int(ctl)) if data.is_resolvable and ctl.is_resolvable else (0, 0)

    async def _monitor_tx(self) -> None:
        dut = self.dut
        fell = None
        while True:
            await RisingEdge(dut.tx_clk)
            rose = get_sim_time("ps")
            if self.recording and fell is not None:
                self.tx_halves.add(("low", rose - fell))
            if self.tx_after:
                await Timer(self.tx_after, "ps")
            low, ctl_rise = self._sample()
            await FallingEdge(dut.tx_clk)
            fell = get_sim_time("ps")
            if self.tx_after:
                await Timer(self.tx_after, "ps")
            high, ctl_fall = self._sample()
            # TX_EN at the rising edge, TX_EN XOR TX_ER at the falling one.
            if self.recording:
                self.tx_halves.add(("high", fell - rose))
                self.tx_line.append((ctl_rise, ctl_rise ^ ctl_fall, low | high << 4))


# ---- cocotb -------------------------------------------------------------------------------


def line_cycles(bursts: list[ref.Burst]) -> list[tuple[int, int, int]]:
    """``tb_eth_mac.gmii_cycles`` of ``bursts``, after a few idle cycles."""
    return [(0, 0, 0)] * 4 + ref.gmii_cycles(bursts)


async def _tx_clock_delay(dut) -> int:
    """How long (ps) each rising edge of ``tx_clk`` comes after ``eth_clk``'s, the clock of the
    data's DDR registers (so after the data's changes)."""
    await RisingEdge(dut.eth_clk)
    edge = get_sim_time("ps")
    await RisingEdge(dut.tx_clk)  # in the same time step if not delayed, or a period on
    return (get_sim_time("ps") - edge) % PERIOD_PS


async def _setup(dut, *, loop: int = 0) -> RgmiiPhy:
    cfg = tb_config()
    rx_delay, tx_delay = (cfg.get(k, 0) if delays_modelled() else 0 for k in ("rx_delay_ps", "tx_clock_delay_ps"))
    dut.loop.value = loop
    dut.i__valid.value = 0
    dut.i__payload.value = 0
    dut.o__ready.value = 0
    phy = RgmiiPhy(dut, rx_lead=SKEW_PS + rx_delay)
    phy.start()
    await Timer(ETH_PHASE_PS, "ps")
    cocotb.start_soon(Clock(dut.eth_clk, PERIOD_PS, unit="ps").start())
    dut.eth_rst.value = 1
    for _ in range(3):
        await RisingEdge(dut.eth_clk)
    dut.eth_rst.value = 0
    measured = await _tx_clock_delay(dut)  # ODDRX1F's pipeline full: tx_clk toggles
    assert measured == tx_delay, f"tx_clk {measured} ps behind eth_clk, want {tx_delay} (config {cfg})"
    phy.tx_after = SKEW_PS - measured
    for _ in range(4):  # the DDR registers fill; MacRx sees an idle line and leaves its SKIP
        await RisingEdge(dut.rx_clk)
    if rx_delay:
        cocotb.start_soon(_watch_delayed_rx(dut, phy))
    return phy


async def _watch_delayed_rx(dut, phy: RgmiiPhy) -> None:
    """Where the DELAYG model delays: each change of the receive side's data and ``ctl`` past
    their DELAYGs (``RgmiiRx``'s ``delayed``, the IDDRX1Fs' inputs) comes at least RGMII's setup
    time before the next edge of ``rx_clk`` and its hold time after the last one."""
    lines = (dut.rgmii_rx.data.delayed, dut.rgmii_rx.ctl.delayed)
    half = PERIOD_PS // 2
    while True:
        await First(*(line.value_change for line in lines))
        now = get_sim_time("ps")
        hold, setup = now - phy.rx_edge, phy.rx_edge + half - now
        assert min(hold, setup) >= SETUP_HOLD_PS, (f"at {now:.0f} ps, past the DELAYGs, a change {hold:.0f} ps "
                                                  f"after rx_clk's edge and {setup:.0f} ps before the next")


def _counters(dut) -> dict[str, int]:
    return {c: int(getattr(dut, f"rx_{c}").value) for c in ref.COUNTERS}


async def _collect(dut, frames: list, ready_p: float, rng: random.Random, stop) -> None:
    """Takes ``o``'s frames (in ``eth_rx``: ``rx_clk``), ``o.ready`` high with probability ``ready_p``."""
    await ref._collect(dut, frames, ready_p, rng, stop, clock=dut.rx_clk)
    dut.o__ready.value = 0


async def _receive(dut, phy: RgmiiPhy, bursts: list[ref.Burst], ready_p: float, rng: random.Random, *,
                   false_carrier_after: int | None = None) -> None:
    """Sends ``bursts`` from the PHY, takes ``o``'s frames; both they and the counters are the
    reference's. ``false_carrier_after``: a burst after whose first idle cycle come three cycles
    of false carrier (no frame, nothing counted)."""
    want, want_counts = ref.receive(bursts)
    before = _counters(dut)
    got: list[bytes] = []
    done = [False]
    collector = cocotb.start_soon(_collect(dut, got, ready_p, rng, lambda: done[0]))
    cycles = line_cycles(bursts)
    if false_carrier_after is not None:
        at = len(line_cycles(bursts[:false_carrier_after + 1])) - bursts[false_carrier_after].gap + 1
        assert bursts[false_carrier_after].gap >= 6 and cycles[at:at + 3] == [(0, 0, 0)] * 3
        cycles[at:at + 3] = [(0, 1, FALSE_CARRIER)] * 3
    phy.send(cycles)
    await phy.drained()
    for _ in range(4 * sum(len(f) for f in want) + 200):
        if len(got) >= len(want):
            break
        await RisingEdge(dut.rx_clk)
    for _ in range(20):
        await RisingEdge(dut.rx_clk)
    done[0] = True
    await collector
    counts = {c: v - before[c] for c, v in _counters(dut).items()}
    for k, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"frame {k}: got {len(g)} bytes {g[:16].hex()}.., want {len(w)} bytes {w[:16].hex()}.."
    assert len(got) == len(want), f"got {len(got)} frames, want {len(want)}"
    assert counts == want_counts, f"counters {counts}, want {want_counts}"


def _check_line(phy: RgmiiPhy, frames: list[bytes]) -> None:
    """What the PHY saw on the transmit pins is ``frames``, each as IEEE 802.3 puts it on the wire."""
    assert not any(er for _, er, _ in phy.tx_line), "TX_ER on the transmit pins"
    sent, gaps = ref.decode_gmii([(en, d) for en, _, d in phy.tx_line])  # checks preamble and SFD
    assert len(sent) == len(frames), f"{len(sent)} frames on the pins, {len(frames)} expected"
    for k, (s, f) in enumerate(zip(sent, frames)):
        w = ref.wire(f)
        if s != w:
            at = next((i for i, (a, b) in enumerate(zip(s, w)) if a != b), min(len(s), len(w)))
            raise AssertionError(f"frame {k}: {len(s)} bytes on the pins, {len(w)} expected; from byte {at}: "
                                 f"{s[at:at + 8].hex()} for {w[at:at + 8].hex()}")
        assert len(s) >= 64 and zlib.crc32(s) == 0x2144DF1C, f"frame {k}: its FCS wrong"  # the residue
    assert not gaps or min(gaps) >= IFG_CYCLES, f"an interframe gap of {min(gaps)} cycles"


def _check_tx_clock(phy: RgmiiPhy) -> None:
    """``tx_clk`` ran at 125 MHz, high for half of each period, while the PHY recorded."""
    half = PERIOD_PS // 2
    assert phy.tx_halves == {("high", half), ("low", half)}, f"tx_clk's halves (ps): {sorted(phy.tx_halves)}"


@cocotb.test()
async def test_rx_good_frames(dut):
    """Frames of 64 .. 1518 bytes on the wire, random payloads, at line rate and the shortest gaps."""
    cfg = tb_config()
    rng = random.Random(cfg.get("seed", 1))
    phy = await _setup(dut)
    lengths = [1, 46, 59, 60, 61, 1514] + [rng.randint(60, 1514) for _ in range(cfg.get("frames", 8))]
    bursts = [ref.Burst(ref.wire(ref.random_frame(rng, n)), gap=rng.choice([1, IFG_CYCLES])) for n in lengths]
    await _receive(dut, phy, bursts, 1.0, rng)


@cocotb.test()
async def test_rx_damaged_frames(dut):
    """rx_er, a bad FCS, runts, oversize frames, short preambles, garbage and a false carrier,
    between good frames, with a reader that stalls."""
    cfg = tb_config()
    rng = random.Random(cfg.get("seed", 1) + 1)
    phy = await _setup(dut)
    bursts = ref.paced(ref.damaged(rng), 0.7)
    await _receive(dut, phy, bursts, 0.7, rng, false_carrier_after=2)


@cocotb.test()
async def test_tx_frames(dut):
    """Frames given to ``MacTx`` (with gaps in the input) on the transmit pins, and ``tx_clk``."""
    cfg = tb_config()
    rng = random.Random(cfg.get("seed", 1) + 2)
    phy = await _setup(dut)
    frames = [ref.random_frame(rng, n) for n in (1, 59, 60, 61, 1514)]
    frames += [ref.random_frame(rng) for _ in range(cfg.get("frames", 8) // 2)]
    before = int(dut.tx_frames.value)
    phy.recording = True
    for f in frames:
        for j, byte in enumerate(f):
            while rng.random() < 0.2:
                dut.i__valid.value = 0
                await RisingEdge(dut.eth_clk)
            dut.i__valid.value = 1
            dut.i__payload.value = byte | int(j == len(f) - 1) << 8
            while True:
                await ReadOnly()
                taken = int(dut.i__ready.value)
                await RisingEdge(dut.eth_clk)
                if taken:
                    break
    dut.i__valid.value = 0
    for _ in range(2 * sum(len(f) + 40 for f in frames)):
        if int(dut.tx_frames.value) - before == len(frames):
            break
        await RisingEdge(dut.eth_clk)
    for _ in range(2 * IFG_CYCLES):
        await RisingEdge(dut.eth_clk)
    phy.recording = False
    _check_line(phy, frames)
    assert int(dut.tx_frames.value) - before == len(frames)
    _check_tx_clock(phy)


@cocotb.test()
async def test_loopback(dut):
    """Frames in at the receive pins and out at the transmit pins (``loop``): those the
    reference keeps come back, each on the wire as a transmitter puts it; the rest are counted."""
    cfg = tb_config()
    rng = random.Random(cfg.get("seed", 1) + 3)
    phy = await _setup(dut, loop=1)
    good = [ref.Burst(ref.wire(ref.random_frame(rng, rng.randint(1, 1514)))) for _ in range(cfg.get("loop_frames", 6))]
    bad = [b for b in ref.damaged(rng) if b.note != "good"][:cfg.get("loop_frames", 6)]
    bursts = [b for pair in zip(good, bad) for b in pair] + good[len(bad):]
    for b in bursts:
        b.gap = max(b.gap, IFG_CYCLES)
    want, want_counts = ref.receive(bursts)
    before, tx_before = _counters(dut), int(dut.tx_frames.value)
    phy.recording = True
    phy.send(line_cycles(bursts))
    await phy.drained()
    for _ in range(2 * sum(len(f) + 40 for f in want) + 200):  # stored twice (MacRx, MacTx), then sent
        if int(dut.tx_frames.value) - tx_before == len(want):
            break
        await RisingEdge(dut.eth_clk)
    for _ in range(2 * IFG_CYCLES):
        await RisingEdge(dut.eth_clk)
    phy.recording = False
    _check_line(phy, want)
    counts = {c: v - before[c] for c, v in _counters(dut).items()}
    assert counts == want_counts, f"counters {counts}, want {want_counts}"
    assert int(dut.tx_frames.value) - tx_before == len(want)
    _check_tx_clock(phy)
