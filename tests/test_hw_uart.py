"""The UART link (``hbfp.hw.uart``) against a bit-level model of 8N1 (``sim/tb_uart.py``):
Amaranth-simulator unit tests of ``UartRx`` and ``UartTx`` (every divisor from 4 to 9 and a
larger one, rates off by most of the tolerance, latency), cocotb runs of both on both
simulators, and ``UartTop`` (the accelerator on its pins) driven bit by bit with protocol
requests, its products against the golden model.

``HBFP_SIM_FULL=1`` runs more bytes and larger products."""

import os
import random

import pytest
from amaranth.back import verilog
from amaranth.sim import Simulator

from hbfp.hw.params import CoreConfig
from hbfp.hw.uart import UartLoop, UartRx, UartTop, UartTx, divisor_for, min_fifo_depth
from hbfp.sim import runner
from hbfp.sim import tb_uart as tb

FULL = os.environ.get("HBFP_SIM_FULL") == "1"


# ---- Amaranth simulator: the reference against the gateware --------------------------------


def rx_bytes(divisor: int, runs, *, ready_p: float = 1.0, seed: int = 0, tail: int = 0):
    """Draw ``runs`` on a ``UartRx``'s pin; the bytes taken from ``o`` (ready with
    probability ``ready_p``), the edge counts at which they were taken, and the flags
    (framing_error, overrun) at the end."""
    dut = UartRx(divisor)
    rng = random.Random(seed)
    got, first, flags = [], [], []

    async def bench(ctx):
        t = 0
        for level, n in list(runs) + [(1, tail or 20 * divisor)]:
            ctx.set(dut.rx, level)
            for _ in range(n):
                ready = rng.random() < ready_p
                ctx.set(dut.o.ready, ready)
                if ready and ctx.get(dut.o.valid):
                    got.append(ctx.get(dut.o.payload))
                    first.append(t)
                await ctx.tick()
                t += 1
        flags.extend((ctx.get(dut.framing_error), ctx.get(dut.overrun)))

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    return got, first, tuple(flags)


def tx_line(divisor: int, data, *, valid_p: float = 1.0, seed: int = 0):
    """Offer ``data`` to a ``UartTx`` (``i.valid`` with probability ``valid_p`` a cycle);
    the line's transitions (cycle, level) and the cycle observation ended."""
    dut = UartTx(divisor)
    rng = random.Random(seed)
    edges, end = [], []

    async def bench(ctx):
        t, k, prev = 0, 0, 1
        idle_after = 0
        while idle_after < 12 * divisor:
            valid = k < len(data) and rng.random() < valid_p
            ctx.set(dut.i.valid, valid)
            if k < len(data):
                ctx.set(dut.i.payload, data[k])
            taken = valid and ctx.get(dut.i.ready)
            await ctx.tick()
            t += 1
            k += taken
            if k == len(data):
                idle_after += 1
            level = ctx.get(dut.tx)
            if level != prev:
                edges.append((t, level))
                prev = level
        end.append(t)

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    return edges, end[0]


DIVISORS = (4, 5, 6, 7, 8, 9, 37)


@pytest.mark.parametrize("divisor", DIVISORS)
def test_rx_against_reference(divisor):
    rng = random.Random(divisor)
    slow, fast = tb.rate_tolerance(divisor)
    for scale in (1.0, 1 + 0.9 * slow, 1 - 0.9 * fast):
        chars = [tb.Byte(rng.randrange(256), idle=rng.choice((0, 0, 0.3, 2))) for _ in range(60)]
        chars += [tb.Byte(b) for b in (0x00, 0xFF, 0x55, 0xAA, 0x01, 0x80)]
        got, _, flags = rx_bytes(divisor, tb.line_runs(chars, divisor * scale, lead=3), ready_p=0.5, seed=divisor)
        assert got == tb.received(chars), f"bit period {divisor * scale}"
        assert flags == (0, 0)
    # A framing error: that byte is dropped, the flag stays set, the next bytes arrive.
    chars = [tb.Byte(0x12), tb.Byte(0x34, stop=0, idle=1), tb.Byte(0x56), tb.Byte(0x78)]
    got, _, flags = rx_bytes(divisor, tb.line_runs(chars, divisor))
    assert got == [0x12, 0x56, 0x78] and flags == (1, 0)


def test_rx_rate_beyond_tolerance_fails():
    """The reference's tolerance is tight: a transmitter well beyond it loses bytes (so the
    test above does test the sampling point)."""
    divisor = 8
    rng = random.Random(1)
    chars = [tb.Byte(rng.randrange(256)) for _ in range(40)]
    got, _, _ = rx_bytes(divisor, tb.line_runs(chars, divisor * (1 - 1.6 * tb.rate_tolerance(divisor)[1])))
    assert got != tb.received(chars)


def test_rx_latency_and_flags():
    for divisor in (4, 5, 8, 13):
        got, first, flags = rx_bytes(divisor, [(1, 3)] + tb.line_runs([tb.Byte(0xA5)], divisor))
        assert got == [0xA5] and flags == (0, 0)
        # The line falls before edge 4 (after the 3-cycle lead); o.valid is seen after
        # 3 + divisor // 2 + 9 * divisor more edges (UartRx's docstring).
        assert first == [3 + 3 + divisor // 2 + 9 * divisor]


@pytest.mark.parametrize("divisor", (4, 7, 16))
def test_tx_against_reference(divisor):
    rng = random.Random(divisor)
    data = [rng.randrange(256) for _ in range(50)]
    edges, end = tx_line(divisor, data)
    chars = tb.decode_line(edges, divisor, end)
    assert [b for _, b in chars] == data
    starts = [t for t, _ in chars]
    assert starts[0] == 1, "the start bit begins at the edge that takes the byte"
    assert {b - a for a, b in zip(starts, starts[1:])} == {10 * divisor}, "back to back, one stop bit"
    edges, end = tx_line(divisor, data, valid_p=0.02, seed=divisor)
    chars = tb.decode_line(edges, divisor, end)
    assert [b for _, b in chars] == data
    assert max(b - a for a, b in zip(starts, starts[1:])) >= 10 * divisor


def _edges(runs) -> tuple[list[tuple[int, int]], int]:
    """(cycle, new level) at each change of a line drawn as ``runs``, and the cycle it ends."""
    edges, t = [], 0
    for level, n in runs:
        if level != (edges[-1][1] if edges else 1):
            edges.append((t, level))
        t += n
    return edges, t


def test_reference_decoder_catches_bad_timing():
    """``decode_line`` refuses a line whose bits are not ``divisor`` cycles long."""
    edges, t = _edges(tb.line_runs([tb.Byte(0x3C)], 8.5))
    with pytest.raises(AssertionError, match="bit boundary"):
        tb.decode_line(edges, 8, t + 100)
    edges, t = _edges(tb.line_runs([tb.Byte(0x3C)], 8))
    assert tb.decode_line(edges, 8, t + 10) == [(0, 0x3C)]


def test_parameters_are_checked():
    for bad in (3, 0, -8, 4.0, True, "8", None):
        with pytest.raises(ValueError, match="divisor"):
            UartRx(bad)
        with pytest.raises(ValueError, match="divisor"):
            UartTx(bad)
    cfg = CoreConfig(4, 4, 8, (24, 24), 48)
    with pytest.raises(ValueError, match="divisor"):
        UartTop(cfg, divisor=2)
    with pytest.raises(ValueError, match="fifo_depth"):
        UartTop(cfg, divisor=8, fifo_depth=1)
    # A WRITE of 4096 bytes executes for 4096+ cycles: 52 bytes of 80 cycles, and 15 of its reply.
    assert min_fifo_depth(8, 4096) == 52 + 15 + 1
    with pytest.raises(ValueError, match="fifo_depth 67 is too small: 68 bytes"):
        UartTop(cfg, divisor=8, fifo_depth=67)
    with pytest.raises(ValueError, match="max_payload"):
        UartTop(cfg, divisor=8, max_payload=8)
    assert divisor_for(100_000_000, 115_200) == 868
    assert divisor_for(12_000_000, 3_000_000) == 4
    with pytest.raises(ValueError, match="at least"):
        divisor_for(10_000_000, 3_000_000)


def test_verilog_ports():
    cfg = CoreConfig(4, 4, 8, (24, 24), 48, functions=("relu",))
    text = verilog.convert(UartTop(cfg, divisor=8, fifo_depth=128), name="uart_top")
    header = text[text.index("module uart_top("):]
    header = header[: header.index(");")]
    assert {p.strip() for p in header[len("module uart_top("):].split(",")} == {
        "clk", "rst", "rx", "tx", "framing_error", "overrun"}


def test_loop_through_the_device_path_in_amaranth():
    """``UartLoop`` in Amaranth's simulator: an IDENTIFY frame in on ``i`` comes back as a
    reply on ``o`` whose fields are the configuration's."""
    from hbfp.host import protocol

    cfg = CoreConfig(2, 2, 8, (12, 12), 24, functions=("relu",))
    dut = UartLoop(cfg, divisor=4, fifo_depth=32, clock_hz=1234, max_payload=64, frame_timeout=5000)
    request = protocol.encode_frame(protocol.Op.IDENTIFY, 0x1234)
    parser = protocol.FrameParser()
    frames = []

    async def bench(ctx):
        k, cycles = 0, 0
        ctx.set(dut.o.ready, 1)
        while not frames:
            ctx.set(dut.i.valid, k < len(request))
            if k < len(request):
                ctx.set(dut.i.payload, {"data": [request[k]], "keep": 1})
            taken = k < len(request) and ctx.get(dut.i.ready)
            if ctx.get(dut.o.valid):
                frames.extend(parser.feed(bytes([ctx.get(dut.o.payload.data[0])])))
            await ctx.tick()
            k += taken
            cycles += 1
            assert cycles < 40 * (len(request) + 60)

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    (reply,) = frames
    assert reply.tag == 0x1234 and reply.status == protocol.Status.OK
    ident = protocol.decode_identity(reply.data)
    assert (ident.rows, ident.size, ident.stream_bytes, ident.clock_hz, ident.max_payload) == (2, 24, 1, 1234, 64)


# ---- cocotb on the generated Verilog ------------------------------------------------------------

PAIR_DIVISORS = {"icarus": (4, 7), "verilator": (4, 13)}


@pytest.mark.parametrize(("sim", "divisor"), [(s, d) for s in runner.SIMULATORS for d in PAIR_DIVISORS[s]])
def test_uart_pair_cocotb(sim, divisor):
    runner.require(sim)
    config = {"divisor": divisor, "seed": divisor, "bytes": 400 if FULL else 60, "ready": 0.4}
    tests, failed = runner.run(lambda: tb.UartPair(divisor), "uart_pair", "tb_uart", sim, config,
                               testcase=["test_rx_random_bytes", "test_rx_framing_error_break_glitch",
                                         "test_rx_overrun", "test_tx_back_to_back_and_gaps"])
    assert tests == 4 and failed == 0


# The device: a 4x4 HBFP8 core (24x24 tiles, 48x48 buffers) on a UART of 4 cycles a bit.
# Icarus runs it about a hundred times slower than Verilator: IDENTIFY and one small product.
TOP_FUNCTIONS = ("relu",)
TOP_PRODUCTS = {
    "verilator": [(24, 24, 24, "FP32"), (30, 17, 40, "BF16"), (48, 48, 48, "BFP")] if FULL
    else [(13, 20, 9, "BF16")],  # (the pipelined product below returns FP32)
    "icarus": [(4, 5, 6, "FP32")],
}
TOP_PIPELINED = {"verilator": (24, 24, 24), "icarus": None}


def top_config(sim: str) -> dict:
    cfg = CoreConfig(4, 4, 8, (24, 24), 48, functions=TOP_FUNCTIONS)
    d = cfg.to_dict()
    d.update(built=list(TOP_FUNCTIONS), divisor=4, clock_hz=12_000_000, max_payload=600, frame_timeout=5000,
             fifo_depth=256, seed=5, stall=0.2, products=TOP_PRODUCTS[sim], pipelined=TOP_PIPELINED[sim])
    return d


@pytest.mark.parametrize("sim", runner.SIMULATORS)
def test_uart_top_cocotb(sim):
    runner.require(sim)
    c = top_config(sim)
    cfg = CoreConfig(c["rows"], c["cols"], c["mantissa_bits"], tuple(c["tile"]), c["size"], functions=TOP_FUNCTIONS)

    def make():
        return UartTop(cfg, divisor=c["divisor"], clock_hz=c["clock_hz"], fifo_depth=c["fifo_depth"],
                       frame_timeout=c["frame_timeout"], max_payload=c["max_payload"])

    cases = ["test_top_identify_and_products"] + (["test_top_pipelined_requests"] if c["pipelined"] else [])
    tests, failed = runner.run(make, "uart_top", "tb_uart", sim, c, testcase=cases)
    assert tests == len(cases) and failed == 0
