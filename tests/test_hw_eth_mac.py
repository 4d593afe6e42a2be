"""The Ethernet MAC (``hbfp.hw.eth_mac``) against the IEEE 802.3 model of ``sim/tb_eth_mac.py``:
Amaranth-simulator tests of ``MacRx`` (good frames of every length at the shortest gap, every
kind of damage, a full buffer), ``MacTx`` (padding, FCS, preamble, gaps, backpressure) and the
two in a loop, and cocotb runs on both simulators (fuzzed bursts included).

``HBFP_SIM_FULL=1`` runs more frames and the 10^4-frame fuzz."""

import os
import random

import pytest
from amaranth.sim import Simulator

from hbfp.hw.eth_mac import IFG_CYCLES, MAX_FRAME, FrameFifo, MacRx, MacTx
from hbfp.sim import runner
from hbfp.sim import tb_eth_mac as tb

FULL = os.environ.get("HBFP_SIM_FULL") == "1"


# ---- Amaranth simulator ------------------------------------------------------------------


def run_rx(bursts, *, ready_p: float = 1.0, seed: int = 0, buffer_bytes: int = 4096, hold: int = 0):
    """Drive ``bursts`` into a ``MacRx``; the frames taken from ``o`` (ready with probability
    ``ready_p``; none at all during the first ``hold`` cycles) and the counters at the end."""
    dut = MacRx(buffer_bytes)
    rng = random.Random(seed)
    cycles = [(0, 0, 0)] * 2 + tb.gmii_cycles(bursts)  # an idle line first: reset waits for one
    frames, counts = [], {}

    async def bench(ctx):
        cur, t, quiet = [], 0, 0
        while t < len(cycles) or quiet < 64:
            dv, er, d = cycles[t] if t < len(cycles) else (0, 0, 0)
            ctx.set(dut.rx_dv, dv)
            ctx.set(dut.rx_er, er)
            ctx.set(dut.rxd, d)
            ready = t >= hold and rng.random() < ready_p
            ctx.set(dut.o.ready, ready)
            quiet = quiet + 1 if t >= len(cycles) and not ctx.get(dut.o.valid) else 0
            if ready and ctx.get(dut.o.valid):
                cur.append(ctx.get(dut.o.payload.data))
                if ctx.get(dut.o.payload.last):
                    frames.append(bytes(cur))
                    cur = []
            await ctx.tick()
            t += 1
        counts.update({c: ctx.get(getattr(dut, c)) for c in tb.COUNTERS})

    sim = Simulator(dut)
    sim.add_clock(8e-9)
    sim.add_testbench(bench)
    sim.run()
    return frames, counts


def run_tx(frames, *, valid_p: float = 1.0, seed: int = 0, buffer_bytes: int = 4096):
    """Offer ``frames`` to a ``MacTx`` (a byte with probability ``valid_p`` a cycle); the
    line ((tx_en, txd) a cycle) and the frame counter."""
    dut = MacTx(buffer_bytes)
    rng = random.Random(seed)
    line, sent = [], []

    async def bench(ctx):
        k = j = 0
        idle = 0
        limit = sum(2 * len(f) + 100 for f in frames) / valid_p + 1000
        while idle < 40:
            assert len(line) < limit, "the transmitter does not finish"
            offer = k < len(frames) and rng.random() < valid_p
            ctx.set(dut.i.valid, offer)
            if k < len(frames):
                ctx.set(dut.i.payload.data, frames[k][j])
                ctx.set(dut.i.payload.last, j == len(frames[k]) - 1)
            taken = offer and ctx.get(dut.i.ready)
            assert not ctx.get(dut.tx_er)
            line.append((ctx.get(dut.tx_en), ctx.get(dut.txd)))
            await ctx.tick()
            if taken:
                j += 1
                if j == len(frames[k]):
                    k, j = k + 1, 0
            idle = idle + 1 if k == len(frames) and not line[-1][0] else 0
        sent.append(ctx.get(dut.frames))

    sim = Simulator(dut)
    sim.add_clock(8e-9)
    sim.add_testbench(bench)
    sim.run()
    return line, sent[0]


def test_rx_good_frames_of_every_length_back_to_back():
    rng = random.Random(1)
    lengths = [1, 2, 45, 46, 47, 59, 60, 61, 100, 1000, 1513, 1514]
    lengths += [rng.randint(1, 1514) for _ in range(30 if FULL else 8)]
    bursts = [tb.Burst(tb.wire(tb.random_frame(rng, n)), gap=rng.choice([1, IFG_CYCLES])) for n in lengths]
    want, want_counts = tb.receive(bursts)
    got, counts = run_rx(bursts, seed=2)
    assert got == want and counts == want_counts and want_counts["frames"] == len(lengths)
    # a reader at half the line rate: the first frames (4 KiB) fit the buffer whatever it takes
    got, counts = run_rx(bursts[:11], ready_p=0.5, seed=2)
    assert got == want[:11] and counts == tb.receive(bursts[:11])[1]


def test_rx_drops_and_counts_damaged_frames():
    rng = random.Random(3)
    bursts = tb.damaged(rng)
    want, want_counts = tb.receive(bursts)
    got, counts = run_rx(bursts, ready_p=0.7, seed=4)
    assert got == want
    assert counts == want_counts
    # every reason occurs, and the good frames between the damaged ones all pass
    assert all(want_counts[c] for c in ("frames", "runts", "oversize", "bad_fcs", "errors"))
    assert want_counts["frames"] == sum(b.note in ("good", "longest frame (1518 bytes)", "one preamble byte",
                                               "no preamble", "one idle cycle after") for b in bursts)


def test_rx_full_buffer_drops_whole_frames():
    """Nothing read for a while: frames that find no room are dropped whole and counted as
    overflows; those kept are intact, and the receiver works on once the reader drains it."""
    rng = random.Random(5)
    frames = [tb.random_frame(rng, 300) for _ in range(6)]
    bursts = [tb.Burst(tb.wire(f)) for f in frames]
    got, counts = run_rx(bursts, buffer_bytes=1024, hold=len(tb.gmii_cycles(bursts)) + 2)
    assert got == frames[:3]  # 3 x 300 bytes fit 1024 (the FCS is stripped as each frame ends)
    assert counts["overflows"] == 3 and counts["frames"] == 3
    # the same, then a long pause (the reader drains the buffer) and one more frame
    after = bursts[:-1] + [tb.Burst(bursts[-1].data, gap=2000), tb.Burst(tb.wire(tb.random_frame(rng, 100)))]
    got, counts = run_rx(after, buffer_bytes=1024, hold=len(tb.gmii_cycles(bursts)) + 2)
    assert got == frames[:3] + [after[-1].data[:-4]] and counts["frames"] == 4 and counts["overflows"] == 3


def _take_byte(ctx, dut, cur: list, out: list) -> None:
    """The byte a ``FrameFifo`` offers, taken this cycle, onto the frame ``cur``: at its last,
    the frame (its ``length``, which each of its bytes carries, checked) into ``out``."""
    cur.append(ctx.get(dut.o.payload.data))
    if ctx.get(dut.o.payload.last):
        assert ctx.get(dut.length) == len(cur), (ctx.get(dut.length), len(cur))
        out.append(bytes(cur))
        cur.clear()


def test_frame_fifo_keeps_no_more_frames_than_its_list_of_lengths():
    """``FrameFifo`` with room for many more bytes than frames (``max_frames`` 8): short frames
    written while nothing is read fill its list of lengths; those that find no place are
    dropped whole (``overflow``), those kept come out intact, each with its ``length``, in
    order; drained, it takes as many again (its pointers wrapping), three rounds."""
    dut = FrameFifo(1024, max_frames=8)
    rng = random.Random(3)
    rounds = [[bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 20))) for _ in range(14)] for _ in range(3)]
    kept, dropped = [], []

    async def bench(ctx):
        for frames in rounds:
            ctx.set(dut.o.ready, 0)
            for frame in frames:
                for i, b in enumerate(frame):
                    ctx.set(dut.w_valid, 1)
                    ctx.set(dut.w_data, b)
                    ctx.set(dut.w_end, i == len(frame) - 1)
                    ctx.set(dut.w_ok, 1)
                    await ctx.tick()
                ctx.set(dut.w_valid, 0)
                ctx.set(dut.w_end, 0)
                for _ in range(3):  # the verdict a cycle or two after the frame's end
                    dropped.append(ctx.get(dut.overflow))
                    await ctx.tick()
            out, cur = [], []
            ctx.set(dut.o.ready, 1)
            for _ in range(400):
                if ctx.get(dut.o.valid):
                    _take_byte(ctx, dut, cur, out)
                await ctx.tick()
            kept.append(out)

    sim = Simulator(dut)
    sim.add_clock(8e-9)
    sim.add_testbench(bench)
    sim.run()
    for frames, out in zip(rounds, kept):
        # the first frames are kept, 8 of them: the list's 5 (max_frames less the three it
        # keeps in hand) and those whose lengths have left it for the reader; the rest dropped
        assert out == frames[:8], [len(f) for f in out]
    assert sum(dropped) == sum(len(frames) - len(out) for frames, out in zip(rounds, kept))


@pytest.mark.parametrize("trim", [0, 4])
def test_frame_fifo_with_a_writer_that_waits(trim):
    """``FrameFifo(waits=True)``: a writer that writes and ends a kept frame only while
    ``w_room`` is high (its end in the cycle of its last byte or later on its own, some frames
    dropped with ``w_ok`` low, random pauses) against a reader that pauses at random, through a
    buffer small enough that room and places run out: the kept frames come out whole, in
    order, less ``trim`` bytes (those with none left: nothing), each with its ``length``;
    ``overflow`` never pulses."""
    dut = FrameFifo(64, max_frames=4, trim=trim, waits=True)
    rng = random.Random(7 + trim)
    frames = [(bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 40))), rng.random() < 0.8)
              for _ in range(60)]
    out, overflow, waited = [], [], []

    async def writer(ctx):
        for frame, keep in frames:
            for i, b in enumerate(frame):
                while rng.random() < 0.2:
                    await ctx.tick()
                together = i == len(frame) - 1 and rng.random() < 0.5
                await when_room(ctx)  # a byte (or an end) only in a cycle w_room is high
                ctx.set(dut.w_data, b)
                ctx.set(dut.w_end, together)
                ctx.set(dut.w_ok, keep)
                ctx.set(dut.w_valid, 1)
                await ctx.tick()
                ctx.set(dut.w_valid, 0)
                ctx.set(dut.w_end, 0)
            if not together:
                await when_room(ctx)
                ctx.set(dut.w_end, 1)
                ctx.set(dut.w_ok, keep)
                await ctx.tick()
                ctx.set(dut.w_end, 0)

    async def when_room(ctx):
        while not ctx.get(dut.w_room):
            waited.append(1)
            await ctx.tick()

    async def reader(ctx):
        cur = []
        for _ in range(12000):
            ready = rng.random() < 0.5
            ctx.set(dut.o.ready, ready)
            overflow.append(ctx.get(dut.overflow))
            if ready and ctx.get(dut.o.valid):
                _take_byte(ctx, dut, cur, out)
            await ctx.tick()

    sim = Simulator(dut)
    sim.add_clock(8e-9)
    sim.add_testbench(writer)
    sim.add_testbench(reader)
    sim.run()
    want = [f[:len(f) - trim] for f, keep in frames if keep and len(f) > trim]
    assert out == want, (len(out), len(want))
    assert not any(overflow) and len(waited) > 100  # the writer waited for room and places


def test_rx_fuzz_keeps_working():
    rng = random.Random(6)
    for _ in range(3):
        bursts = tb.fuzz_bursts(rng, 30) + [tb.Burst(tb.wire(tb.random_frame(rng, 80)))]
        want, want_counts = tb.receive(bursts)
        got, counts = run_rx(bursts, seed=7)
        assert got == want and counts == want_counts
        assert got[-1] == bursts[-1].data[:-4]


def test_tx_frames_padded_checked_and_spaced():
    rng = random.Random(8)
    frames = [tb.random_frame(rng, n) for n in (1, 14, 59, 60, 61, 300, MAX_FRAME - 4)]
    for valid_p in (1.0, 0.3):
        line, sent = run_tx(frames, valid_p=valid_p, seed=9)
        got, gaps = tb.decode_gmii(line)
        assert got == [tb.wire(f) for f in frames]
        assert sent == len(frames)
        assert min(gaps) >= IFG_CYCLES


def test_tx_backpressure_with_a_small_buffer():
    rng = random.Random(10)
    frames = [tb.random_frame(rng, rng.randint(100, 500)) for _ in range(6)]
    line, sent = run_tx(frames, buffer_bytes=512)
    assert tb.decode_gmii(line)[0] == [tb.wire(f) for f in frames] and sent == 6


def test_tx_into_rx_loop():
    """What the transmitter sends, the receiver keeps (padding included: a MAC cannot know it)."""
    rng = random.Random(11)
    frames = [tb.random_frame(rng, rng.randint(1, 1514)) for _ in range(5)]
    line, _ = run_tx(frames)
    bursts = [tb.Burst(w, preamble=7, gap=IFG_CYCLES) for w in tb.decode_gmii(line)[0]]
    got, counts = run_rx(bursts)
    assert got == [tb.padded(f) for f in frames] and counts["frames"] == 5


def test_parameters_are_checked():
    for bad in (0, 63, 100, 4095, "4096", True):
        for make in (FrameFifo, MacRx, MacTx):
            with pytest.raises(ValueError, match="power of two"):
                make(bad)


def test_reference_model_is_the_standard():
    """The model's FCS: CRC-32's check value (of "123456789") sent least significant byte
    first; a frame followed by its FCS has the CRC-32 residue; a short frame is padded."""
    import zlib

    assert tb.fcs(b"123456789") == bytes.fromhex("2639f4cb")
    frame = bytes(range(60))
    assert zlib.crc32(frame + tb.fcs(frame)) == 0x2144DF1C
    assert tb.wire(b"\x01")[:60] == b"\x01" + bytes(59) and len(tb.wire(b"\x01")) == 64


# ---- cocotb on the generated Verilog ----------------------------------------------------------


@pytest.mark.parametrize("sim", runner.SIMULATORS)
def test_mac_cocotb(sim):
    runner.require(sim)
    # Icarus runs the testbench some ten times slower than Verilator: fewer frames there
    fuzz = {"verilator": (200, 50) if FULL else (10, 40), "icarus": (20, 50) if FULL else (1, 15)}[sim]
    frames = {"verilator": 60 if FULL else 12, "icarus": 30 if FULL else 3}[sim]
    config = {"seed": 3, "frames": frames, "ready": 0.7, "fuzz": fuzz[0], "fuzz_frames": fuzz[1]}
    tests, failed = runner.run(lambda: tb.MacPair(4096), "mac_pair", "tb_eth_mac", sim, config)
    assert tests == 4 and failed == 0
