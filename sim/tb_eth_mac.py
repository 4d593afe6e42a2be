"""cocotb testbenches of the Ethernet MAC (``hbfp.hw.eth_mac``) against a GMII model of
IEEE 802.3 frames, and the model itself (also used by the Amaranth-simulator tests).

The reference is written from the standard, not from the gateware: ``wire`` puts a frame on
the line as a transmitter must (preamble, SFD, the frame padded to 60 bytes, its FCS:
``zlib.crc32`` little-endian); ``gmii_cycles`` draws a sequence of such frames, or of damaged
ones (``Burst``: a wrong FCS, a runt, an oversize frame, an ``rx_er``, a short or missing
preamble, garbage), as (rx_dv, rx_er, rxd) a cycle with idle gaps; ``receive`` says which
frames a receiver keeps (their bytes without FCS) and how many it drops for each reason;
``decode_gmii`` takes a transmitter's recorded line apart into frames and the gaps between
them.

DUT ``MacPair``: a ``MacRx`` and a ``MacTx`` side by side (``rx_*``/``o`` and ``i``/``tx_*``).
Tests: random good frames of every length at the shortest gap with random ``o.ready``;
every kind of damaged frame between good ones, counters compared; the transmitter with
back-to-back and gapped input, every frame decoded and checked; a fuzz of random frames and
line noise (``fuzz`` bursts of ``fuzz_frames`` each) after each of which a good frame still
passes.

Configuration (``tb_config()``): ``seed``, ``frames`` (random good frames), ``ready``
(probability of ``o.ready`` a cycle), ``fuzz`` and ``fuzz_frames``.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

import cocotb
from amaranth import Module
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out
from cocotb.triggers import ReadOnly, RisingEdge

from hbfp.hw.eth_mac import (FCS_BYTES, IFG_CYCLES, MAX_FRAME, MIN_FRAME, PREAMBLE, SFD, MacRx, MacTx,
                             frame_layout)
from hbfp.sim.runner import tb_config
from hbfp.sim.streams import start_clock_and_reset

# ---- the reference ------------------------------------------------------------------------

COUNTERS = ("frames", "runts", "oversize", "bad_fcs", "errors", "overflows")


def fcs(frame: bytes) -> bytes:
    """The frame check sequence of ``frame`` as it follows the frame on the wire."""
    return zlib.crc32(frame).to_bytes(4, "little")


def padded(frame: bytes) -> bytes:
    """``frame`` padded with zeros to the shortest frame (less its FCS)."""
    return frame + bytes(max(0, MIN_FRAME - FCS_BYTES - len(frame)))


def wire(frame: bytes) -> bytes:
    """The bytes after the SFD that a transmitter sends for ``frame``: padded, then its FCS."""
    p = padded(frame)
    return p + fcs(p)


@dataclass
class Burst:
    """One stretch of activity on the receive line: ``data`` (the bytes after the SFD, or the
    whole burst when ``sfd`` is False), ``preamble`` bytes before the SFD, ``error_at`` (a
    byte index where rx_er is high, or None), ``gap`` idle cycles after it."""

    data: bytes
    preamble: int = 7
    sfd: bool = True
    error_at: int | None = None
    gap: int = IFG_CYCLES
    note: str = field(default="good")


def gmii_cycles(bursts: list[Burst]) -> list[tuple[int, int, int]]:
    """(rx_dv, rx_er, rxd) for each cycle of ``bursts`` on the line."""
    out = []
    for b in bursts:
        lead = [PREAMBLE] * b.preamble + ([SFD] if b.sfd else [])
        for i, byte in enumerate(lead + list(b.data)):
            k = i - len(lead)
            out.append((1, int(b.error_at is not None and k == b.error_at), byte))
        out.extend([(0, 0, 0)] * b.gap)
    return out


def frame_of(b: Burst) -> tuple[bytes, bool] | None:
    """The frame a receiver finds in a burst: the bytes after the first SFD that follows only
    preamble bytes (any number, none included), and whether rx_er was high in them; None
    when there is no such SFD (or rx_er came before it)."""
    lead = [PREAMBLE] * b.preamble + ([SFD] if b.sfd else [])
    line = lead + list(b.data)
    errors = [b.error_at is not None and i - len(lead) == b.error_at for i in range(len(line))]
    i = 0
    while i < len(line) and line[i] == PREAMBLE and not errors[i]:
        i += 1
    if i == len(line) or errors[i] or line[i] != SFD:
        return None
    return bytes(line[i + 1:]), any(errors[i + 1:])


def verdict(b: Burst) -> str | None:
    """What a receiver does with a burst: "frames" (kept), a counter's name (dropped for that
    reason), or None (no frame began)."""
    found = frame_of(b)
    if found is None:
        return None
    frame, error = found
    if error:
        return "errors"
    if len(frame) > MAX_FRAME:
        return "oversize"
    if len(frame) < MIN_FRAME:
        return "runts"
    if zlib.crc32(frame) != 0x2144DF1C:  # the CRC of any message followed by its own FCS
        return "bad_fcs"
    return "frames"


def receive(bursts: list[Burst]) -> tuple[list[bytes], dict[str, int]]:
    """The frames a receiver keeps (without FCS) and its counters, for a buffer that never
    fills."""
    kept, counts = [], dict.fromkeys(COUNTERS, 0)
    for b in bursts:
        v = verdict(b)
        if v is not None:
            counts[v] += 1
            if v == "frames":
                kept.append(frame_of(b)[0][:-FCS_BYTES])
    return kept, counts


def decode_gmii(samples: list[tuple[int, int]]) -> tuple[list[bytes], list[int]]:
    """A transmitter's line ((tx_en, txd) a cycle) as the frames it sent (the bytes after the
    SFD, FCS included) and the idle cycles before each frame after the first. Raises
    AssertionError on a preamble that is not seven 0x55 then 0xD5."""
    frames, gaps, idle, cur = [], [], None, None
    for en, d in samples + [(0, 0)]:
        if en:
            if cur is None:
                cur = []
                if idle is not None:
                    gaps.append(idle)
            cur.append(d)
        elif cur is not None:
            assert cur[:8] == [PREAMBLE] * 7 + [SFD], f"preamble {bytes(cur[:8]).hex()}"
            frames.append(bytes(cur[8:]))
            cur, idle = None, 1
        elif idle is not None:
            idle += 1
    return frames, gaps


def random_frame(rng: random.Random, length: int | None = None) -> bytes:
    """A frame (no FCS) of ``length`` bytes (random: 1 .. MAX_FRAME - FCS_BYTES)."""
    n = rng.randint(1, MAX_FRAME - FCS_BYTES) if length is None else length
    return bytes(rng.getrandbits(8) for _ in range(n))


def damaged(rng: random.Random) -> list[Burst]:
    """One burst of each kind of damage a receiver must drop or survive, between good frames."""
    good = lambda: Burst(wire(random_frame(rng, rng.randint(46, 200))))  # noqa: E731
    bad_fcs = bytearray(wire(random_frame(rng, 100)))
    bad_fcs[rng.randrange(len(bad_fcs))] ^= 1 << rng.randrange(8)
    runt, short = random_frame(rng, 40), random_frame(rng, MIN_FRAME - FCS_BYTES - 1)
    return [
        good(), Burst(bytes(bad_fcs), note="bad FCS"), good(),
        Burst(runt + fcs(runt), note="runt (44 bytes, its FCS right)"), good(),
        Burst(short + fcs(short), note="runt (63 bytes, its FCS right)"),
        Burst(wire(random_frame(rng, MAX_FRAME - FCS_BYTES + 1)), note="oversize (1519 bytes)"), good(),
        Burst(wire(random_frame(rng, MAX_FRAME - FCS_BYTES)), note="longest frame (1518 bytes)"),
        Burst(wire(random_frame(rng, 80)), error_at=30, note="rx_er"), good(),
        Burst(wire(random_frame(rng, 80)), preamble=1, note="one preamble byte"),
        Burst(wire(random_frame(rng, 80)), preamble=0, note="no preamble"),
        Burst(bytes([PREAMBLE] * 5 + [0x12, 0x34]), preamble=0, sfd=False, note="preamble, no SFD"),
        Burst(bytes(rng.getrandbits(8) for _ in range(30)), preamble=0, sfd=False, note="garbage"), good(),
        Burst(wire(random_frame(rng, 60)), gap=1, note="one idle cycle after"), good(),
    ]


def fuzz_bursts(rng: random.Random, n: int) -> list[Burst]:
    """``n`` random bursts: random lengths, preambles, errors and garbage, some good."""
    out = []
    for _ in range(n):
        kind = rng.random()
        length = rng.choice([rng.randint(0, 80), rng.randint(0, MAX_FRAME + 20)])
        frame = random_frame(rng, length) if length else b""
        if kind < 0.3 and length >= 1:
            data = wire(frame)
        else:
            data = frame
        out.append(Burst(data, preamble=rng.choice([0, 1, 7, 7, 12]), sfd=rng.random() < 0.9,
                         error_at=rng.randrange(len(data) + 1) if data and rng.random() < 0.1 else None,
                         gap=rng.choice([1, 2, IFG_CYCLES, 40]), note="fuzz"))
    return out


# ---- the DUT ------------------------------------------------------------------------------


class MacPair(wiring.Component):
    """A ``MacRx`` and a ``MacTx`` side by side (their ports prefixed ``rx_`` and ``tx_``,
    the streams ``o`` and ``i``)."""

    def __init__(self, buffer_bytes: int = 4096):
        self.buffer_bytes = buffer_bytes
        from amaranth.lib import stream
        super().__init__({
            "rx_dv": In(1), "rx_er": In(1), "rxd": In(8),
            "o": Out(stream.Signature(frame_layout())),
            **{f"rx_{c}": Out(32) for c in COUNTERS},
            "i": In(stream.Signature(frame_layout())),
            "tx_en": Out(1), "tx_er": Out(1), "txd": Out(8),
        })

    def elaborate(self, platform):
        m = Module()
        m.submodules.rx = rx = MacRx(self.buffer_bytes)
        m.submodules.tx = tx = MacTx(self.buffer_bytes)
        m.d.comb += [rx.rx_dv.eq(self.rx_dv), rx.rx_er.eq(self.rx_er), rx.rxd.eq(self.rxd),
                     self.tx_en.eq(tx.tx_en), self.tx_er.eq(tx.tx_er), self.txd.eq(tx.txd)]
        m.d.comb += [getattr(self, f"rx_{c}").eq(getattr(rx, c)) for c in COUNTERS]
        wiring.connect(m, rx.o, wiring.flipped(self.o))
        wiring.connect(m, wiring.flipped(self.i), tx.i)
        return m


# ---- cocotb -------------------------------------------------------------------------------


async def _setup(dut):
    dut.rx_dv.value = 0
    dut.rx_er.value = 0
    dut.rxd.value = 0
    dut.i__payload.value = 0
    await start_clock_and_reset(dut, sources=["i"], sinks=["o"], period_ns=8)
    for _ in range(2):  # an idle line: the receiver leaves reset waiting for the end of a frame
        await RisingEdge(dut.clk)


def paced(bursts: list[Burst], ready_p: float) -> list[Burst]:
    """``bursts`` with gaps long enough for a reader that takes a byte with probability
    ``ready_p`` a cycle to keep up (a buffer that never fills, as ``receive`` assumes)."""
    for b in bursts:
        b.gap = max(b.gap, int(len(b.data) * (1 / ready_p - 1) * 1.5) + IFG_CYCLES)
    return bursts


async def _drive(dut, cycles):
    for dv, er, d in cycles:
        dut.rx_dv.value, dut.rx_er.value, dut.rxd.value = dv, er, d
        await RisingEdge(dut.clk)
    dut.rx_dv.value = 0
    dut.rx_er.value = 0


async def _collect(dut, frames: list, ready_p: float, rng: random.Random, stop, clock=None) -> None:
    """Takes ``o``'s frames on ``clock``'s rising edges (default ``dut.clk``), ``o.ready`` high
    with probability ``ready_p``, until ``stop()``."""
    clock = dut.clk if clock is None else clock
    cur = []
    while not stop():
        dut.o__ready.value = int(rng.random() < ready_p)
        await ReadOnly()
        if int(dut.o__valid.value) and int(dut.o__ready.value):
            p = int(dut.o__payload.value)
            cur.append(p & 0xFF)
            if p >> 8 & 1:
                frames.append(bytes(cur))
                cur = []
        await RisingEdge(clock)


def _counters(dut) -> dict[str, int]:
    return {c: int(getattr(dut, f"rx_{c}").value) for c in COUNTERS}


async def _receive_bursts(dut, bursts, ready_p, rng, *, counts_before=None):
    """Drive ``bursts`` and collect what comes out; compare with the reference."""
    want, want_counts = receive(bursts)
    got = []
    done = [False]
    collector = cocotb.start_soon(_collect(dut, got, ready_p, rng, lambda: done[0]))
    await _drive(dut, gmii_cycles(bursts))
    for _ in range(4 * sum(len(f) for f in want) + 200):
        if len(got) >= len(want):
            break
        await RisingEdge(dut.clk)
    for _ in range(20):
        await RisingEdge(dut.clk)
    done[0] = True
    await collector
    base = counts_before or dict.fromkeys(COUNTERS, 0)
    counts = {c: v - base[c] for c, v in _counters(dut).items()}
    assert got == want, f"frames differ: got {len(got)}, want {len(want)}"
    assert counts == want_counts, f"counters {counts}, want {want_counts}"


@cocotb.test()
async def test_rx_random_frames(dut):
    cfg = tb_config()
    rng = random.Random(cfg.get("seed", 1))
    await _setup(dut)
    lengths = [1, 45, 46, 47, 59, 60, 61, 1513, 1514]
    lengths += [rng.randint(1, 1514) for _ in range(cfg.get("frames", 40))]
    bursts = [Burst(wire(random_frame(rng, n)), gap=rng.choice([1, IFG_CYCLES])) for n in lengths]
    await _receive_bursts(dut, bursts, 1.0, rng)  # at line rate, the shortest gaps
    before = _counters(dut)
    ready = cfg.get("ready", 0.8)
    await _receive_bursts(dut, paced(bursts, ready), ready, rng, counts_before=before)


@cocotb.test()
async def test_rx_damaged_frames(dut):
    cfg = tb_config()
    rng = random.Random(cfg.get("seed", 1) + 1)
    await _setup(dut)
    ready = cfg.get("ready", 0.8)
    await _receive_bursts(dut, paced(damaged(rng), ready), ready, rng)


@cocotb.test()
async def test_rx_fuzz(dut):
    cfg = tb_config()
    rng = random.Random(cfg.get("seed", 1) + 2)
    await _setup(dut)
    for _ in range(cfg.get("fuzz", 4)):
        before = _counters(dut)
        bursts = fuzz_bursts(rng, cfg.get("fuzz_frames", 50))
        bursts.append(Burst(wire(random_frame(rng, 100)), note="good after the burst"))
        await _receive_bursts(dut, bursts, 1.0, rng, counts_before=before)


@cocotb.test()
async def test_tx_frames(dut):
    cfg = tb_config()
    rng = random.Random(cfg.get("seed", 1) + 3)
    await _setup(dut)
    dut.o__ready.value = 1
    frames = [random_frame(rng, n) for n in (1, 59, 60, 61, 1514)]
    frames += [random_frame(rng) for _ in range(cfg.get("frames", 40) // 4)]
    line = []
    done = [False]

    async def watch():
        while not done[0]:
            await ReadOnly()
            line.append((int(dut.tx_en.value), int(dut.txd.value)))
            assert int(dut.tx_er.value) == 0
            await RisingEdge(dut.clk)

    watcher = cocotb.start_soon(watch())
    for f in frames:
        for j, byte in enumerate(f):
            while rng.random() < 0.2:  # gaps in the input: the frame still goes out whole
                dut.i__valid.value = 0
                await RisingEdge(dut.clk)
            dut.i__valid.value = 1
            dut.i__payload.value = byte | (int(j == len(f) - 1) << 8)
            while True:
                await ReadOnly()
                taken = int(dut.i__ready.value)
                await RisingEdge(dut.clk)
                if taken:
                    break
    dut.i__valid.value = 0
    for _ in range(sum(len(f) + 40 for f in frames)):
        await RisingEdge(dut.clk)
    done[0] = True
    await watcher
    sent, gaps = decode_gmii(line)
    assert sent == [wire(f) for f in frames], f"{len(sent)} frames sent, {len(frames)} given"
    assert min(gaps) >= IFG_CYCLES, f"an interframe gap of {min(gaps)} cycles"
