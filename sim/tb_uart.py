"""cocotb testbenches of the UART link (``hbfp.hw.uart``) against a bit-level model of the
line, and the reference itself (also used by the Amaranth-simulator tests).

The reference (``Byte``, ``line_runs``, ``received``, ``decode_line``) is written from the
8N1 definition, not from the gateware: ``line_runs`` draws the line a transmitter produces
(idle high, a low start bit, eight data bits LSB first, a stop bit; bit boundaries at
``round(k * period)`` cycles, so a period that is no integer models a transmitter whose
rate is off); ``decode_line`` takes a recorded line (its transitions) apart and checks that
every bit lasts exactly ``divisor`` cycles.

Two DUTs:

- ``UartPair`` (``test_rx_*``, ``test_tx_*``): a ``UartRx`` and a ``UartTx`` side by side.
  Random bytes at the exact rate and off by a few percent, back to back and with idle
  gaps; random ``ready`` on the receiver's output; a framing error, a break, a glitch and
  an overrun; the transmitter with back-to-back and gapped input, its line decoded and
  timed.
- ``hw.uart.UartTop`` (``test_top_*``): the whole device on its pins. The testbench is a
  host with a UART: it draws the bits of real protocol requests (``hbfp.host.protocol``)
  onto ``rx``, decodes ``tx`` into reply frames, and reuses ``sim/tb_top.py``'s ``Device``
  and ``run_product`` (the golden model's product, compared bit for bit).

Configuration (``tb_config()``): ``divisor`` (one for ``UartPair``; ``UartTop``'s), ``seed``,
``bytes`` (random bytes per rate), ``ready`` (probability of ``o.ready`` per cycle); for the
top, the ``CoreConfig`` fields and those ``tb_top.Device`` reads, and ``products``, a list
of (m, n, k, out format) run one after another, and ``pipelined`` (m, n, k) or null: a
product whose requests go out back to back while the device executes and replies.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass

import cocotb
import numpy as np
from amaranth import Module
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out
from cocotb.triggers import ClockCycles, Edge, Event, ReadOnly, RisingEdge, Timer, with_timeout
from cocotb.utils import get_sim_time

from hbfp.contract import functions_mask
from hbfp.host import protocol
from hbfp.host.protocol import Op, OutFormat, Status
from hbfp.hw.activation import FUNCTIONS
from hbfp.hw.uart import UartRx, UartTx
from hbfp.sim.runner import CLOCK_PERIOD_NS, tb_config
from hbfp.sim.streams import StreamSource, start_clock_and_reset

# ---- the reference: 8N1 on a line --------------------------------------------------------

#: Bits of a character: start, eight data, stop.
CHAR_BITS = 10


@dataclass(frozen=True)
class Byte:
    """A character on the line: ``value``, its stop bit's level (0: a framing error), and
    ``idle`` bits of idle line after it."""

    value: int
    stop: int = 1
    idle: float = 0.0


def line_runs(chars, period: float, *, lead: int = 0) -> list[tuple[int, int]]:
    """The line a transmitter draws for ``chars`` (``Byte``s) with bits of ``period`` cycles,
    as runs (level, cycles), after ``lead`` cycles of idle line. A bit boundary at time t
    (in cycles, from the first start bit) falls on cycle ``round(t)``."""
    levels: list[tuple[float, int]] = []  # (start time, level) of every bit
    t = 0.0
    for ch in chars:
        if not 0 <= ch.value < 256:
            raise ValueError(f"not a byte: {ch.value}")
        bits = [0] + [(ch.value >> i) & 1 for i in range(8)] + [ch.stop]
        for b in bits:
            levels.append((t, b))
            t += period
        if ch.idle:
            levels.append((t, 1))
            t += ch.idle * period
    levels.append((t, 1))
    runs: list[tuple[int, int]] = [(1, lead)] if lead else []
    for (t0, level), (t1, _) in zip(levels, levels[1:]):
        n = round(t1) - round(t0)
        if n <= 0:
            continue
        if runs and runs[-1][0] == level:
            runs[-1] = (level, runs[-1][1] + n)
        else:
            runs.append((level, n))
    return runs


def rate_tolerance(divisor: int) -> tuple[float, float]:
    """How much slower and faster than ``divisor`` cycles a bit a transmitter may be for a
    receiver that samples ``divisor // 2`` cycles after it sees the start bit's edge, with
    one cycle of uncertainty of that edge: the stop bit's sample, 9 bits on, must fall
    inside the stop bit."""
    return (divisor // 2) / (9 * divisor), (divisor - divisor // 2 - 1) / (10 * divisor)


def received(chars) -> list[int]:
    """What an 8N1 receiver delivers from ``chars``: the bytes whose stop bit is high."""
    return [ch.value for ch in chars if ch.stop]


def decode_line(edges: list[tuple[int, int]], divisor: int, end: int) -> list[tuple[int, int]]:
    """(start cycle, byte) of every character on a line that was high at cycle 0 and changed
    level at ``edges`` (cycle, new level), observed until cycle ``end``.

    Asserts the line a transmitter of ``divisor`` cycles a bit must draw: every transition
    at a bit boundary (start cycle + j * divisor), a high stop bit a whole bit long before
    the next start bit, and the line idle (high) at ``end``."""
    times = [t for t, _ in edges]

    def level(t: int) -> int:
        i = bisect.bisect_right(times, t)
        return 1 if i == 0 else edges[i - 1][1]

    for (t0, a), (t1, b) in zip(edges, edges[1:]):
        assert t0 < t1 and a != b, f"edges out of order or repeated at {t0}, {t1}"
    out = []
    i = 0
    while i < len(edges):
        t0, lv = edges[i]
        assert lv == 0, f"the line rose at {t0} without a start bit"
        stop_end = t0 + CHAR_BITS * divisor
        assert stop_end <= end, f"a character from {t0} is not over at {end}"
        j = i + 1
        while j < len(edges) and edges[j][0] < stop_end:
            t, _ = edges[j]
            assert (t - t0) % divisor == 0, f"a transition at {t}, {t - t0} cycles into the character from {t0}: " \
                                            f"not on a bit boundary ({divisor} cycles a bit)"
            j += 1
        bits = [level(t0 + k * divisor) for k in range(CHAR_BITS)]
        assert bits[0] == 0 and bits[-1] == 1, f"character at {t0}: start {bits[0]}, stop {bits[-1]}"
        out.append((t0, sum(b << k for k, b in enumerate(bits[1:9]))))
        i = j
    return out


# ---- a line driver and a line monitor (cocotb) -----------------------------------------------


async def drive_line(dut, pin, runs) -> None:
    """Draw ``runs`` (level, cycles) on ``pin``, changing it just after rising clock edges."""
    for lv, n in runs:
        pin.value = lv
        await ClockCycles(dut.clk, n)
    pin.value = 1


class LineMonitor:
    """Records the transitions of an output pin, in clock cycles since ``start``."""

    def __init__(self, dut, pin):
        self.dut, self.pin = dut, pin
        self.t0 = get_sim_time("ns")
        self.edges: list[tuple[int, int]] = []
        cocotb.start_soon(self._watch())

    def now(self) -> int:
        return round((get_sim_time("ns") - self.t0) / CLOCK_PERIOD_NS)

    async def _watch(self):
        while True:
            await Edge(self.pin)
            self.edges.append((self.now(), int(self.pin.value)))


class LineReceiver:
    """A host's UART receiver on ``pin``: samples each bit in its middle (a reference
    receiver) and feeds the bytes to a ``protocol.FrameParser``; a Link for
    ``tb_top.Device`` together with ``send`` (bit-banged on the device's ``rx``)."""

    def __init__(self, dut, divisor: int, rng: random.Random, *, stall: float = 0.0, longest_reply: int = 1 << 16):
        self.dut, self.d, self.rng = dut, divisor, rng
        self.longest_reply = longest_reply
        self.parser = protocol.FrameParser(max_payload=1 << 30)
        self.frames: list = []
        self.bytes = bytearray()
        self.arrived = Event()
        self.framing_errors = 0
        self.stall = stall  # the chance of an idle gap after a byte sent (tb_top's name)
        self.sent = 0
        cocotb.start_soon(self._receive())

    def set_stall(self, stall: float) -> None:
        self.stall = stall

    async def _receive(self):
        half = self.d * CLOCK_PERIOD_NS / 2 + 3  # +3 ns: never on a clock edge
        bit = self.d * CLOCK_PERIOD_NS
        while True:
            await Edge(self.dut.tx)
            if int(self.dut.tx.value):
                continue
            await Timer(half, "ns")
            if int(self.dut.tx.value):
                continue
            value = 0
            for k in range(8):
                await Timer(bit, "ns")
                value |= int(self.dut.tx.value) << k
            await Timer(bit, "ns")
            if not int(self.dut.tx.value):
                self.framing_errors += 1
                continue
            self.bytes.append(value)
            frames = self.parser.feed(bytes([value]))
            if frames:
                self.frames.extend(frames)
                self.arrived.set()

    async def send(self, data: bytes) -> None:
        """The bytes on ``rx``, back to back, with now and then an idle gap."""
        chars = [Byte(b, idle=self.rng.choice((0, 0, 0, 0.5, 2)) if self.stall else 0) for b in data]
        await drive_line(self.dut, self.dut.rx, line_runs(chars, self.d))
        self.sent += len(data)

    async def reply(self, timeout_cycles: int = 0):
        """The next reply frame; waits at most ``timeout_cycles`` (by default, the time of
        the longest reply on the line and as much again for its computation)."""
        timeout_cycles = timeout_cycles or 2 * CHAR_BITS * self.d * self.longest_reply + 100_000
        while not self.frames:
            self.arrived.clear()
            await with_timeout(self.arrived.wait(), timeout_cycles * CLOCK_PERIOD_NS, "ns")
        return self.frames.pop(0)

    async def idle(self, cycles: int) -> None:
        await ClockCycles(self.dut.clk, cycles)


# ---- UartRx and UartTx side by side ------------------------------------------------------------


class UartPair(wiring.Component):
    """A ``UartRx`` (ports ``rx``, ``o``, ``framing_error``, ``overrun``) and, unconnected to
    it, a ``UartTx`` (``i``, ``tx``), both of ``divisor`` cycles a bit: one build for both."""

    def __init__(self, divisor: int):
        self.divisor = divisor
        super().__init__({
            "rx": In(1, init=1), "o": Out(stream.Signature(8)), "framing_error": Out(1), "overrun": Out(1),
            "i": In(stream.Signature(8)), "tx": Out(1, init=1),
        })

    def elaborate(self, platform):
        m = Module()
        m.submodules.rx = rx = UartRx(self.divisor)
        m.submodules.tx = tx = UartTx(self.divisor)
        m.d.comb += [rx.rx.eq(self.rx), self.framing_error.eq(rx.framing_error), self.overrun.eq(rx.overrun),
                     self.tx.eq(tx.tx)]
        wiring.connect(m, rx.o, wiring.flipped(self.o))
        wiring.connect(m, wiring.flipped(self.i), tx.i)
        return m


async def _pair_setup(dut):
    dut.rx.value = 1
    await start_clock_and_reset(dut, sources=["i"], sinks=["o"])
    await ClockCycles(dut.clk, 4)


async def _collect(dut, count: int, ready_p: float, rng: random.Random, timeout_cycles: int) -> list[int]:
    """``count`` bytes from ``o``, ``ready`` high with probability ``ready_p`` each cycle."""
    got, idle = [], 0
    while len(got) < count:
        ready = rng.random() < ready_p
        dut.o__ready.value = int(ready)
        await ReadOnly()
        if ready and int(dut.o__valid.value):
            got.append(int(dut.o__payload.value))
            idle = 0
        else:
            idle += 1
            assert idle < timeout_cycles, f"no byte for {timeout_cycles} cycles ({len(got)}/{count})"
        await RisingEdge(dut.clk)
    dut.o__ready.value = 0
    return got


def _random_chars(rng: random.Random, n: int, gaps: bool) -> list[Byte]:
    return [Byte(rng.randrange(256), idle=rng.choice((0, 0, 0.3, 1, 3.7)) if gaps else 0) for _ in range(n)]


@cocotb.test()
async def test_rx_random_bytes(dut):
    """Random bytes back to back and with gaps, at the exact rate and from transmitters slow
    and fast by 3/4 of the tolerance ``UartRx`` documents; ``o.ready`` random: every byte,
    in order, no flag raised."""
    cfg = tb_config()
    d, rng = cfg["divisor"], random.Random(cfg["seed"])
    await _pair_setup(dut)
    for scale in (1.0, 1 + 0.75 * rate_tolerance(d)[0], 1 - 0.75 * rate_tolerance(d)[1]):
        for gaps in (False, True):
            chars = _random_chars(rng, cfg["bytes"], gaps)
            cocotb.start_soon(drive_line(dut, dut.rx, line_runs(chars, d * scale, lead=rng.randrange(3 * d))))
            got = await _collect(dut, len(chars), cfg["ready"], rng, 20 * d)
            assert got == received(chars), f"period {d * scale}, gaps {gaps}: {got[:8]} != {received(chars)[:8]}"
            await ClockCycles(dut.clk, 2 * CHAR_BITS * d)
    assert int(dut.framing_error.value) == 0 and int(dut.overrun.value) == 0


@cocotb.test()
async def test_rx_framing_error_break_glitch(dut):
    """A low stop bit drops its byte and sets ``framing_error``; a break (the line low for
    many bits) gives one framing error, not a stream of zero bytes; a pulse shorter than
    half a bit is no start bit; bytes after each are received."""
    cfg = tb_config()
    d, rng = cfg["divisor"], random.Random(cfg["seed"] + 1)
    await _pair_setup(dut)
    chars = _random_chars(rng, 6, False)
    chars[2] = Byte(chars[2].value, stop=0, idle=1)
    runs = line_runs(chars, d)
    cocotb.start_soon(drive_line(dut, dut.rx, runs))
    want = received(chars)
    got = await _collect(dut, len(want), cfg["ready"], rng, 30 * d)
    assert got == want and int(dut.framing_error.value) == 1 and int(dut.overrun.value) == 0

    # A break, then a glitch, then bytes: no spurious byte ever comes out.
    await RisingEdge(dut.clk)
    chars = _random_chars(rng, 4, False)
    runs = [(0, 25 * d), (1, 2 * d), (0, max(1, d // 2 - 2)), (1, 3 * d)] + line_runs(chars, d)
    cocotb.start_soon(drive_line(dut, dut.rx, runs))
    got = await _collect(dut, len(chars), 1.0, rng, 60 * d)
    assert got == received(chars)
    dut.o__ready.value = 1
    await ClockCycles(dut.clk, 3 * CHAR_BITS * d)
    assert int(dut.o__valid.value) == 0, "a spurious byte"


@cocotb.test()
async def test_rx_overrun(dut):
    """``o`` held off while three bytes arrive: the first is held, the next two dropped and
    ``overrun`` set; bytes sent after the first is taken are received."""
    cfg = tb_config()
    d, rng = cfg["divisor"], random.Random(cfg["seed"] + 2)
    await _pair_setup(dut)
    chars = _random_chars(rng, 3, False)
    await drive_line(dut, dut.rx, line_runs(chars, d))
    await ClockCycles(dut.clk, 2 * d)
    assert int(dut.overrun.value) == 1 and int(dut.framing_error.value) == 0
    assert int(dut.o__valid.value) == 1 and int(dut.o__payload.value) == chars[0].value
    got = await _collect(dut, 1, 1.0, rng, 4)
    assert got == [chars[0].value]
    more = _random_chars(rng, 5, True)
    cocotb.start_soon(drive_line(dut, dut.rx, line_runs(more, d)))
    assert await _collect(dut, len(more), cfg["ready"], rng, 30 * d) == received(more)


@cocotb.test()
async def test_tx_back_to_back_and_gaps(dut):
    """Random bytes offered back to back go out with exactly one stop bit (a character every
    ``10 * divisor`` cycles); with random gaps on ``i``, every character still on the bit
    grid; decoded by the reference, the bytes in order."""
    cfg = tb_config()
    d, rng = cfg["divisor"], random.Random(cfg["seed"] + 3)
    await _pair_setup(dut)
    mon = LineMonitor(dut, dut.tx)
    for stall in (0.0, 0.995):
        data = [rng.randrange(256) for _ in range(cfg["bytes"])]
        src = StreamSource(dut, "i", stall=stall, rng=rng)
        start = len(mon.edges)
        await src.send(data)
        await ClockCycles(dut.clk, CHAR_BITS * d + 2)
        chars = decode_line(mon.edges[start:], d, mon.now())
        assert [b for _, b in chars] == data, f"stall {stall}"
        starts = [t for t, _ in chars]
        if stall == 0.0:
            assert all(b - a == CHAR_BITS * d for a, b in zip(starts, starts[1:])), "not back to back"
        else:
            assert any(b - a > CHAR_BITS * d for a, b in zip(starts, starts[1:])), "no gap was tried"
    assert int(dut.tx.value) == 1


# ---- the device on its pins ------------------------------------------------------------------


async def _top_setup(dut):
    from hbfp.sim.tb_top import Device

    cfg = tb_config()
    dut.rx.value = 1
    await start_clock_and_reset(dut)
    rng = random.Random(cfg["seed"])
    # The longest reply: a whole fp32 result, its cycle count and the frame around it.
    link = LineReceiver(dut, cfg["divisor"], rng, stall=cfg["stall"], longest_reply=4 * cfg["size"] ** 2 + 32)
    return cfg, rng, Device(dut, cfg, link)


def _product(m, n, k, out, seed) -> dict:
    return dict(m=m, n=n, k=k, ta=False, tb=False, acc=False, bias=False, act=None, out=OutFormat[out],
                rounding="nearest_even", seed=seed, load_a="codes", load_b="codes", in_rounding="nearest_even",
                specials=False, read=False, corrupt=False, repeat=False)


@cocotb.test()
async def test_top_identify_and_products(dut):
    """IDENTIFY through the UART; the products of ``products`` one after another, each
    against the golden gemm bit for bit; STATUS counts them; no framing error or overrun."""
    from hbfp.sim.tb_top import run_product

    cfg, rng, dev = await _top_setup(dut)
    ident = await dev.identify()
    mask = functions_mask(cfg["built"])
    want = protocol.Identity(
        protocol_version=protocol.PROTOCOL_VERSION, abi_major=protocol.ABI_VERSION[0], abi_minor=protocol.ABI_VERSION[1], stream_bytes=1,
        rows=cfg["rows"], cols=cfg["cols"], mantissa_bits=cfg["mantissa_bits"], tile_rows=cfg["tile"][0],
        tile_cols=cfg["tile"][1], leaky_shift=cfg["leaky_shift"], size=cfg["size"], functions_mask=mask,
        clock_hz=cfg["clock_hz"], max_payload=cfg["max_payload"], frame_timeout=cfg["frame_timeout"])
    assert ident == want, f"IDENTIFY {ident} != {want}"
    nrng = np.random.default_rng(cfg["seed"])
    for i, (m, n, k, out) in enumerate(cfg["products"]):
        await run_product(dev, rng, nrng, _product(m, n, k, out, cfg["seed"] + i), dut._log)
    await dev.check_status()
    assert dev.link.framing_errors == 0
    assert int(dut.framing_error.value) == 0 and int(dut.overrun.value) == 0


@cocotb.test()
async def test_top_pipelined_requests(dut):
    """A product's WRITEs and GEMM, and a STATUS behind them, sent back to back with no wait
    for a reply: the receive FIFO holds what arrives while the engine executes a command
    and replies; every reply in order, the product bit for bit as the golden gemm."""
    from hbfp.golden.bfp import quantize
    from hbfp.golden.gemm import gemm
    from hbfp.host.protocol import Target
    from hbfp.sim.tb_top import ceil_to, pad_to, random_matrix

    cfg, _, dev = await _top_setup(dut)
    assert cfg.get("pipelined"), "configure the product (m, n, k) to send"
    m, n, k = cfg["pipelined"]
    nrng = np.random.default_rng(cfg["seed"] + 7)
    a, b = random_matrix(nrng, (m, k), False), random_matrix(nrng, (k, n), False)
    qa, qb = quantize(a, dev.fmt), quantize(b, dev.fmt)
    requests = []
    for target, q in ((Target.A_CODES, qa), (Target.B_CODES, qb)):
        rows, cols = q.shape
        codes = pad_to(q.codes.astype(dev.code_dtype), rows, ceil_to(cols, dev.C))
        step = dev.rows_per_write(codes.shape[1] * dev.code_dtype.itemsize)
        for r0 in range(0, rows, step):
            part = codes[r0:r0 + step]
            requests.append((Op.WRITE, protocol.encode_write(target, r0, 0, part.shape[0], part.shape[1],
                                                             part.tobytes())))
        e = q.exponents
        requests.append((Op.WRITE, protocol.encode_write(target + Target.A_EXPONENTS, 0, 0, e.shape[0], e.shape[1],
                                                         e.astype(np.uint8).tobytes())))
    requests += [(Op.GEMM, protocol.encode_gemm(m, n, k)), (Op.STATUS, b"")]
    tags = [dev.next_tag() for _ in requests]
    sending = cocotb.start_soon(dev.link.send(b"".join(protocol.encode_frame(op, t, p)
                                                        for (op, p), t in zip(requests, tags))))
    replies = [await dev.check_reply(op, t, Status.OK) for (op, _), t in zip(requests, tags)]
    await sending
    got = dev.decode_result(replies[-2].data[:-protocol.CYCLES_SIZE], m, n, OutFormat.FP32)  # the result, then the cycles
    dev.compare(got, gemm(qa, qb), OutFormat.FP32, f"pipelined GEMM {m}x{n}x{k}")
    status = protocol.decode_status(replies[-1].data)
    assert (status.accepted, status.refused) == (len(requests), 0), status  # STATUS counts itself
    assert int(dut.framing_error.value) == 0 and int(dut.overrun.value) == 0
