"""The wide link's components in Amaranth's simulator: the parallel CRC-32 against zlib, the
beat compactor and realigning byte window, chunks to beats, the constant divider, and the
result serializer with fewer output lanes than columns against the host's reply layout."""

import random
import zlib

import numpy as np
import pytest
from amaranth import Module, Signal
from amaranth.sim import Simulator

from hbfp.golden.bfp import quantize
from hbfp.host import protocol
from hbfp.host.protocol import OutFormat
from hbfp.hw.crc import ParallelCRC32, crc32_state, crc32_update
from hbfp.hw.link import BeatCompactor, BeatsToBytes, ByteCollector, BytesToBeats, ByteWindow, ChunkToBeat, StreamRegister
from hbfp.hw.packet import ResultSerializer, divmod_const
from hbfp.hw.params import CoreConfig


def _run(dut, *testbenches):
    sim = Simulator(dut)
    sim.add_clock(1e-8)
    for tb in testbenches:
        sim.add_testbench(tb)
    sim.run()


@pytest.mark.parametrize("registered_ready", [False, True])
@pytest.mark.parametrize("in_chance, out_chance", [(1.0, 1.0), (0.7, 0.5), (0.3, 0.9), (1.0, 0.2)])
def test_stream_register_keeps_every_beat(registered_ready, in_chance, out_chance):
    """Beats offered with random gaps and taken under random backpressure come out in order,
    none lost or repeated; with both sides always willing, one beat a cycle after one cycle of
    latency; with ``registered_ready`` the input's ready never follows the output's in the same
    cycle (it is a register)."""
    rng = random.Random(int(in_chance * 10 + out_chance * 100) + registered_ready)
    dut = StreamRegister(16, registered_ready=registered_ready)
    beats = [rng.randrange(1 << 16) for _ in range(300)]
    got, taken_at = [], []

    async def producer(ctx):
        for beat in beats:
            while rng.random() >= in_chance:
                ctx.set(dut.i.valid, 0)
                await ctx.tick()
            ctx.set(dut.i.valid, 1)
            ctx.set(dut.i.payload, beat)
            await ctx.tick().until(dut.i.ready)
        ctx.set(dut.i.valid, 0)

    async def consumer(ctx):
        cycle = 0
        while len(got) < len(beats):
            assert cycle < 20_000, f"{len(got)} of {len(beats)} beats came out"
            ready = rng.random() < out_chance
            ctx.set(dut.o.ready, ready)
            if registered_ready:
                before = ctx.get(dut.i.ready)
                ctx.set(dut.o.ready, not ready)
                assert ctx.get(dut.i.ready) == before
                ctx.set(dut.o.ready, ready)
            if ready and ctx.get(dut.o.valid):
                got.append(ctx.get(dut.o.payload))
                taken_at.append(cycle)
            await ctx.tick()
            cycle += 1

    _run(dut, producer, consumer)
    assert got == beats
    if in_chance == out_chance == 1.0:
        assert taken_at == list(range(1, len(beats) + 1))


@pytest.mark.parametrize("stream_bytes", [1, 2, 3, 4])
@pytest.mark.parametrize("in_chance, out_chance", [(1.0, 1.0), (0.6, 0.8), (1.0, 0.3)])
def test_bytes_to_beats_and_back(stream_bytes, in_chance, out_chance):
    """Bytes offered with random gaps, packed into beats (``BytesToBeats``: each beat's kept
    lanes a prefix, full beats while bytes come back to back, a partial one only after a cycle
    with no byte) and unpacked (``BeatsToBytes``) under random backpressure: the same bytes in
    order. Both sides always willing: a byte a cycle through, and every beat full but the last."""
    rng = random.Random(stream_bytes * 7 + int(in_chance * 10) + int(out_chance * 100))
    m = Module()
    m.submodules.pack = pack = BytesToBeats(stream_bytes)
    m.submodules.unpack = unpack = BeatsToBytes(stream_bytes)
    m.d.comb += [unpack.i.valid.eq(pack.o.valid), unpack.i.payload.eq(pack.o.payload), pack.o.ready.eq(unpack.i.ready)]
    sent = [rng.randrange(256) for _ in range(400)]
    got, beats, taken_at = [], [], []

    async def producer(ctx):
        for byte in sent:
            while rng.random() >= in_chance:
                ctx.set(pack.i.valid, 0)
                await ctx.tick()
            ctx.set(pack.i.valid, 1)
            ctx.set(pack.i.payload, byte)
            await ctx.tick().until(pack.i.ready)
        ctx.set(pack.i.valid, 0)

    async def consumer(ctx):
        cycle = 0
        while len(got) < len(sent):
            assert cycle < 20_000, f"{len(got)} of {len(sent)} bytes came out"
            ready = rng.random() < out_chance
            ctx.set(unpack.o.ready, ready)
            if ctx.get(pack.o.valid) and ctx.get(pack.o.ready):
                keep = ctx.get(pack.o.payload.keep)
                assert keep & (keep + 1) == 0 and keep, f"keep {keep:b} is no prefix"
                beats.append(keep)
            if ready and ctx.get(unpack.o.valid):
                got.append(ctx.get(unpack.o.payload))
                taken_at.append(cycle)
            await ctx.tick()
            cycle += 1

    _run(m, producer, consumer)
    assert got == sent
    if in_chance == out_chance == 1.0:
        full = (1 << stream_bytes) - 1
        assert all(k == full for k in beats[:-1]) and len(beats) == -(-len(sent) // stream_bytes)
        assert taken_at[-1] - taken_at[0] == len(sent) - 1


def test_beats_to_bytes_takes_any_keep():
    """Sparse and empty ``keep`` masks: the kept lanes in lane order, nothing for an empty beat."""
    rng = random.Random(5)
    dut = BeatsToBytes(4)
    beats = [[rng.randrange(256) for _ in range(4)] + [rng.randrange(16)] for _ in range(200)]
    want = [lanes[b] for *lanes, keep in beats for b in range(4) if keep >> b & 1]
    got = []

    async def producer(ctx):
        for *lanes, keep in beats:
            ctx.set(dut.i.valid, 1)
            ctx.set(dut.i.payload, {"data": lanes, "keep": keep})
            await ctx.tick().until(dut.i.ready)
        ctx.set(dut.i.valid, 0)

    async def consumer(ctx):
        for _ in range(5000):
            ctx.set(dut.o.ready, rng.random() < 0.7)
            if ctx.get(dut.o.ready) and ctx.get(dut.o.valid):
                got.append(ctx.get(dut.o.payload))
            await ctx.tick()

    _run(dut, producer, consumer)
    assert got == want


@pytest.mark.parametrize("limit", [1, 2, 16, 64])
def test_byte_collector_groups(limit):
    """Bytes offered one a cycle with random gaps (and empty chunks) come out as groups of
    ``limit`` bytes in order, each taken whole when the consumer is willing; no byte enters
    while a full group waits, and the input's ready is ``level < limit``."""
    rng = random.Random(limit)
    dut = ByteCollector(64)
    data = rng.randbytes(limit * 40)
    groups = []

    async def producer(ctx):
        ctx.set(dut.limit, limit)
        for byte in data:
            while rng.random() < 0.3:  # a gap, or an empty chunk
                ctx.set(dut.i.valid, rng.random() < 0.5)
                ctx.set(dut.i.payload.count, 0)
                await ctx.tick()
            ctx.set(dut.i.valid, 1)
            ctx.set(dut.i.payload.count, 1)
            ctx.set(dut.i.payload.data[0], byte)
            await ctx.tick().until(dut.i.ready)
        ctx.set(dut.i.valid, 0)

    async def consumer(ctx):
        cycles = 0
        while len(groups) < 40:
            cycles += 1
            assert cycles < 20_000
            level = ctx.get(dut.o.level)
            assert level <= limit
            assert ctx.get(dut.i.ready) == (level < limit)
            if level == limit and rng.random() < 0.6:
                groups.append(bytes(ctx.get(dut.o.data[k]) for k in range(limit)))
                ctx.set(dut.o.take, limit)
            else:
                ctx.set(dut.o.take, 0)
            await ctx.tick()

    _run(dut, producer, consumer)
    assert b"".join(groups) == data


@pytest.mark.parametrize("width", [1, 3, 4, 16])
def test_parallel_crc32_matches_zlib(width):
    """Random messages fed in chunks of random sizes (0 .. width bytes, any alignment against
    the width), with idle cycles between: the register follows zlib.crc32 after every chunk,
    and a message followed by its own CRC ends at the residue."""
    rng = random.Random(width)
    dut = ParallelCRC32(width)
    messages = [rng.randbytes(rng.randrange(1, 80)) for _ in range(12)]

    async def bench(ctx):
        for data in messages:
            framed = data + zlib.crc32(data).to_bytes(4, "little")
            ctx.set(dut.clear, 1)
            await ctx.tick()
            ctx.set(dut.clear, 0)
            pos = 0
            while pos < len(framed):
                k = min(rng.randrange(0, width + 1), len(framed) - pos)
                chunk = framed[pos:pos + k] + rng.randbytes(width - k)  # lanes beyond count: noise
                ctx.set(dut.i.valid, 1)
                ctx.set(dut.i.payload.count, k)
                ctx.set(dut.i.payload.data, list(chunk))
                await ctx.tick()
                ctx.set(dut.i.valid, 0)
                pos += k
                if pos <= len(data):
                    assert ctx.get(dut.crc) == zlib.crc32(framed[:pos])
                while rng.random() < 0.2:
                    await ctx.tick()
            assert ctx.get(dut.residue_ok)

    _run(dut, bench)


def test_crc32_update_is_bytewise_steps():
    rng = random.Random(1)
    for k in range(0, 20):
        data, state = rng.randbytes(k), rng.getrandbits(32)
        assert crc32_update(state, data, k) == crc32_state(data, state)


@pytest.mark.parametrize("stream_bytes", [1, 2, 3, 4, 16])
def test_compactor_and_window(stream_bytes):
    """Beats with any keep pattern (empty ones too) through ``BeatCompactor`` and a
    ``ByteWindow``; a consumer taking a random 0 .. level bytes a cycle gets the kept bytes
    in lane order, and full-rate producer and consumer move N bytes a cycle."""
    sb = stream_bytes
    rng = random.Random(sb)
    beats = []
    for _ in range(80):
        keep = rng.getrandbits(sb) if rng.random() < 0.5 else (1 << sb) - 1
        beats.append(([rng.randrange(256) for _ in range(sb)], keep))
    want = [d[i] for d, k in beats for i in range(sb) if k >> i & 1]

    m = Module()
    m.submodules.compactor = comp = BeatCompactor(sb)
    m.submodules.window = win = ByteWindow(sb, sb)
    m.d.comb += [win.i.valid.eq(comp.o.valid), win.i.payload.eq(comp.o.payload), comp.o.ready.eq(win.i.ready)]
    m.d.sync += Signal(name="clock_for_wires").eq(1)  # a 1-byte window is wires
    got = []

    async def feed(ctx):
        for lanes, keep in beats:
            ctx.set(comp.i.payload.data, lanes)
            ctx.set(comp.i.payload.keep, keep)
            ctx.set(comp.i.valid, 1)
            while True:
                _, _, ready = await ctx.tick().sample(comp.i.ready)
                if ready:
                    break
            ctx.set(comp.i.valid, 0)
            while rng.random() < 0.2:
                await ctx.tick()

    async def take(ctx):
        while len(got) < len(want):
            level = ctx.get(win.o.level)
            k = rng.randrange(0, level + 1) if rng.random() < 0.5 else level
            window = ctx.get(win.o.data)
            ctx.set(win.o.take, k)
            got.extend(window[:k])
            await ctx.tick()
            ctx.set(win.o.take, 0)

    _run(m, feed, take)
    assert got == want

    # Full rate: a full beat every cycle in, N bytes taken every cycle out.
    m = Module()
    m.submodules.window = win = ByteWindow(sb, sb)
    m.d.sync += Signal(name="clock_for_wires").eq(1)
    n_beats, cycles = 40, 0

    async def stream_in(ctx):
        for b in range(n_beats):
            ctx.set(win.i.payload.data, [(b * sb + j) & 0xFF for j in range(sb)])
            ctx.set(win.i.payload.count, sb)
            ctx.set(win.i.valid, 1)
            while True:
                _, _, ready = await ctx.tick().sample(win.i.ready)
                if ready:
                    break
        ctx.set(win.i.valid, 0)

    out = []

    async def stream_out(ctx):
        nonlocal cycles
        while len(out) < n_beats * sb:
            level = ctx.get(win.o.level)
            ctx.set(win.o.take, level)
            out.extend(ctx.get(win.o.data)[:level])
            await ctx.tick()
            cycles += 1

    _run(m, stream_in, stream_out)
    assert out == [k & 0xFF for k in range(n_beats * sb)]
    assert cycles <= n_beats + 3


def test_chunk_to_beat_keeps_the_first_lanes():
    dut = ChunkToBeat(5)

    async def bench(ctx):
        for count in range(6):
            ctx.set(dut.i.payload.count, count)
            await ctx.delay(1e-9)
            assert ctx.get(dut.o.payload.keep) == (1 << count) - 1

    sim = Simulator(dut)
    sim.add_testbench(bench)
    sim.run()


@pytest.mark.parametrize("divisor", [1, 2, 3, 5, 7, 16, 255])
def test_divmod_const(divisor):
    limit = 5000
    values = list(range(0, 600)) + list(range(limit - 600, limit + 1))
    for v in values:
        assert divmod_const(v, divisor, limit) == divmod(v, divisor)
    # As gateware: the same numbers from a signal.
    sig = Signal(range(limit + 1))
    q, r = divmod_const(sig, divisor, limit)
    qs, rs = Signal(range(limit + 1)), Signal(range(divisor + 1))
    m = Module()
    m.d.comb += [qs.eq(q), rs.eq(r)]

    async def bench(ctx):
        for v in values[::37]:
            ctx.set(sig, v)
            await ctx.delay(1e-9)
            assert (ctx.get(qs), ctx.get(rs)) == divmod(v, divisor)

    sim = Simulator(m)
    sim.add_testbench(bench)
    sim.run()


def _core_beats(cfg: CoreConfig, result, out_format: int, m: int, n: int, rng):
    """The core's output beats of ``out_lanes`` values for a result: fp32/bf16 rows of
    ``ceil(n / out_lanes)`` beats with noise in the padding lanes; BFP tile-major, a tile's
    ``th * tw`` codes ``out_lanes`` a beat, each beat carrying the tile's exponent."""
    L = cfg.out_lanes
    beats = []
    if out_format in (OutFormat.FP32, OutFormat.BF16):
        bits = np.asarray(result).view(np.uint32 if out_format == OutFormat.FP32 else np.uint16)
        for r in range(m):
            for c0 in range(0, n, L):
                lanes = [int(bits[r, c]) if c < n else rng.getrandbits(32) for c in range(c0, c0 + L)]
                beats.append((lanes, rng.randrange(256)))
        return beats
    th, tw = cfg.tile
    tr, tc = result.exponents.shape
    padded = np.zeros((tr * th, tc * tw), dtype=np.int64)
    padded[:m, :n] = result.codes
    for i in range(tr):
        for j in range(tc):
            flat = padded[i * th:(i + 1) * th, j * tw:(j + 1) * tw].reshape(-1)
            for k in range(0, th * tw, L):
                beats.append(([int(v) & 0xFFFFFFFF for v in flat[k:k + L]], int(result.exponents[i, j])))
    return beats


@pytest.mark.parametrize(("mantissa_bits", "out_lanes", "out_format"),
                         [(8, 1, OutFormat.FP32), (8, 2, OutFormat.BF16), (8, 2, OutFormat.BFP),
                          (12, 4, OutFormat.BFP), (8, 8, OutFormat.FP32), (12, 1, OutFormat.BFP)])
def test_result_serializer_out_lanes(mantissa_bits, out_lanes, out_format):
    """``ResultSerializer`` on beats of ``out_lanes`` (< cols) values: its chunks, joined,
    are the reply's result bytes as the host encodes them (``protocol.encode_result``)."""
    cfg = CoreConfig(8, 8, mantissa_bits, (16, 16), 48, out_lanes=out_lanes)
    rng = random.Random(out_lanes * 10 + out_format)
    nrng = np.random.default_rng(out_lanes)
    m, n = 19, 21
    x = nrng.standard_normal((m, n)).astype(np.float32)
    if out_format == OutFormat.FP32:
        result = x
    elif out_format == OutFormat.BF16:
        result = (x.view(np.uint32) >> 16).astype(np.uint16)
    else:
        result = quantize(x, cfg.fmt())
    want = protocol.encode_result(None, result, out_format)
    beats = _core_beats(cfg, result, out_format, m, n, rng)

    dut = ResultSerializer(cfg)
    got = bytearray()

    async def feed(ctx):
        ctx.set(dut.out_format, out_format)
        ctx.set(dut.n, n)
        ctx.set(dut.start, 1)
        await ctx.tick()
        ctx.set(dut.start, 0)
        for lanes, exponent in beats:
            ctx.set(dut.i.payload.lanes, lanes)
            ctx.set(dut.i.payload.exponent, exponent)
            ctx.set(dut.i.valid, 1)
            while True:
                _, _, ready = await ctx.tick().sample(dut.i.ready)
                if ready:
                    break
            ctx.set(dut.i.valid, 0)

    async def take(ctx):
        while len(got) < len(want):
            ready = rng.random() < 0.7
            ctx.set(dut.o.ready, ready)
            _, _, valid, data, count = await ctx.tick().sample(dut.o.valid, dut.o.payload.data, dut.o.payload.count)
            if valid and ready:
                got.extend(data[:count])

    _run(dut, feed, take)
    assert bytes(got) == want
