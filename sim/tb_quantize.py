"""cocotb testbench of ``hbfp.hw.quantize.Quantize`` against ``hbfp.golden.bfp.quantize``.

The stimulus is a sequence of *segments*: a rounding mode, a seed, whether ``clear`` is
strobed before it, and a list of tiles (random and corner-case kinds). The tiles stream
tile-major; the golden expectation of a segment is ``quantize`` of its tiles stacked
vertically (a one-column tile grid, whose ``stream_index`` is the streamed order), with the
tiles streamed since the last ``clear`` prepended as zero tiles so that the stream positions
line up. Codes and exponents are compared exactly.

The configuration (``tb_config()``): ``m``, ``tile``, ``lanes``, ``input_format``, ``seed``
(of the stimulus), ``reps`` (tiles of each kind per segment) and ``stall``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import cocotb
import ml_dtypes
import numpy as np
from cocotb.triggers import ReadOnly, RisingEdge

from hbfp.golden.bfp import Format, quantize
from hbfp.hw.params import ROUNDING_CODES
from hbfp.hw.quantize import KEY_LATENCY, LATENCY
from hbfp.sim.runner import tb_config
from hbfp.sim.streams import StreamSink, StreamSource, start_clock_and_reset

# ---- stimulus and golden expectation (also used by the Amaranth-simulator tests) ----------------

F32_MAX_BITS = 0x7F7FFFFF


def _f32_bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def _scaled(rng, shape, k):
    return rng.standard_normal(shape) * 2.0 ** k


def tile_kinds(m: int) -> dict:
    """Generators of one tile (fp32 bit patterns, uint32, shape (rows, cols)), by kind."""
    fmt = Format(m, (1, 1))
    qmax, fb = fmt.qmax, fmt.frac_bits

    def normal(rng, shape):  # a random scale per tile
        return _f32_bits(_scaled(rng, shape, int(rng.integers(-40, 41))))

    def uniform(rng, shape):
        return _f32_bits(rng.uniform(-1, 1, shape) * 2.0 ** int(rng.integers(-10, 11)))

    def wide(rng, shape):  # exponents spread far below the max: alignment shifts past 31
        e = rng.integers(-70, 70, shape).astype(np.float64)
        return _f32_bits(rng.choice([-1.0, 1.0], shape) * (1 + rng.random(shape)) * 2.0 ** e)

    def bits(rng, shape):  # every fraction pattern; fields within 40 of the max
        top = int(rng.integers(41, 255))
        field = rng.integers(top - 40, top + 1, shape).astype(np.uint32)
        b = (rng.integers(0, 2, shape).astype(np.uint32) << 31) | (field << 23) | rng.integers(0, 1 << 23, shape).astype(np.uint32)
        return b.astype(np.uint32)

    def zeros(rng, shape):  # some zeros of either sign among normals
        b = normal(rng, shape)
        mask = rng.random(shape) < 0.5
        return np.where(mask, rng.integers(0, 2, shape).astype(np.uint32) << 31, b).astype(np.uint32)

    def allzero(rng, shape):
        return (rng.integers(0, 2, shape).astype(np.uint32) << 31).astype(np.uint32)

    def subnormal(rng, shape):  # subnormals (DAZ) among small normals
        b = _f32_bits(_scaled(rng, shape, -124))
        sub = rng.integers(1, 1 << 23, shape).astype(np.uint32) | (rng.integers(0, 2, shape).astype(np.uint32) << 31)
        return np.where(rng.random(shape) < 0.5, sub, b).astype(np.uint32)

    def allsub(rng, shape):  # subnormals and zeros only: exponent code 0
        sub = rng.integers(0, 1 << 23, shape).astype(np.uint32) | (rng.integers(0, 2, shape).astype(np.uint32) << 31)
        return sub.astype(np.uint32)

    def nan(rng, shape):
        b = normal(rng, shape)
        payload = int(rng.choice([1, 1 << 22, int(rng.integers(1, 1 << 23))]))
        b.flat[int(rng.integers(b.size))] = (int(rng.integers(0, 2)) << 31) | 0x7F800000 | payload
        return b

    def inf(rng, shape):
        b = normal(rng, shape)
        b.flat[int(rng.integers(b.size))] = (int(rng.integers(0, 2)) << 31) | 0x7F800000
        return b

    def fltmax(rng, shape):  # amax at the top of the range (E = 127), others far below
        b = wide(rng, shape)
        b.flat[int(rng.integers(b.size))] = (int(rng.integers(0, 2)) << 31) | int(rng.choice([F32_MAX_BITS, 0x7F000000, int(rng.integers(0x7F000000, F32_MAX_BITS))]))
        more = rng.random(shape) < 0.3
        b[more] = (rng.integers(0x7E000000, F32_MAX_BITS + 1, int(more.sum())).astype(np.uint32)
                   | (rng.integers(0, 2, int(more.sum())).astype(np.uint32) << 31))
        return b.astype(np.uint32)

    def minnormal(rng, shape):  # amax at the smallest normal (code 1), subnormals beside it
        b = rng.integers(0, 1 << 23, shape).astype(np.uint32)
        b = np.where(rng.random(shape) < 0.6, b | (1 << 23), b)
        b.flat[int(rng.integers(b.size))] = 0x00800000
        return (b | (rng.integers(0, 2, shape).astype(np.uint32) << 31)).astype(np.uint32)

    def pow2(rng, shape):
        e = int(rng.integers(-100, 100))
        x = rng.choice([-1.0, 1.0], shape) * 2.0 ** (e - rng.integers(0, 20, shape))
        return _f32_bits(x)

    def ties(rng, shape):  # halfway cases of round-to-nearest-even, odd and even
        e = int(rng.integers(-50, 50))
        step = 2.0 ** (e - fb)
        k = rng.integers(0, qmax, shape)
        x = rng.choice([-1.0, 1.0], shape) * (k + 0.5) * step
        x.flat[int(rng.integers(x.size))] = 2.0 ** e  # pins the exponent at e
        small = rng.random(shape) < 0.3  # ties further down: half of a finer step
        j = rng.integers(1, 20, shape)
        x = np.where(small, rng.choice([-1.0, 1.0], shape) * (2 * k + 1) * step * 2.0 ** -j, x)
        return _f32_bits(x)

    def saturate(rng, shape):  # magnitudes that round up to 2**(m-1) or sit near qmax
        e = int(rng.integers(-50, 50))
        step = 2.0 ** (e - fb)
        j = rng.integers(1, 24, shape)
        x = np.where(rng.random(shape) < 0.5, (2.0 - 2.0 ** -j.astype(np.float64)) * 2.0 ** e,
                     (qmax + rng.choice([0.25, 0.5, 0.75, 0.999, -0.5, -0.25], shape)) * step)
        x = np.minimum(x.astype(np.float32), np.float32((2.0 - 2.0 ** -23) * 2.0 ** e))  # keep the exponent at e
        return _f32_bits(rng.choice([-1.0, 1.0], shape) * x)

    return {f.__name__: f for f in (normal, uniform, wide, bits, zeros, allzero, subnormal, allsub, nan, inf,
                                    fltmax, minnormal, pow2, ties, saturate)}


def make_tiles(rng: np.random.Generator, m: int, tile, reps: int) -> np.ndarray:
    """``reps`` tiles of every kind, shuffled: uint32 fp32 patterns, shape (n, rows, cols)."""
    kinds = tile_kinds(m)
    tiles = [gen(rng, tuple(tile)) for gen in kinds.values() for _ in range(reps)]
    order = rng.permutation(len(tiles))
    return np.stack([tiles[i] for i in order]).astype(np.uint32)


def as_input(tiles_f32: np.ndarray, input_format: str) -> np.ndarray:
    """The element patterns streamed to the DUT: fp32 as is, bf16 as the top 16 bits (which
    keeps subnormals, NaNs and infinities as such)."""
    if input_format == "fp32":
        return tiles_f32.astype(np.uint32)
    return (tiles_f32 >> np.uint32(16)).astype(np.uint16)


def golden_stream(tiles: np.ndarray, input_format: str, fmt: Format, seed: int, n_tiles_before: int):
    """Expected (codes, exponents) of ``tiles`` (input patterns, shape (n, rows, cols)) streamed
    after ``n_tiles_before`` tiles since the last clear: ``quantize`` of the vertical stack."""
    rows, cols = fmt.tile
    pad = np.zeros((n_tiles_before * rows, cols), dtype=tiles.dtype)
    stack = np.concatenate([pad, tiles.reshape(-1, cols)])
    x = stack.view(np.float32) if input_format == "fp32" else stack.view(ml_dtypes.bfloat16)
    res = quantize(x, fmt, seed=seed)
    codes = res.codes.reshape(-1)[n_tiles_before * rows * cols:]
    exps = res.exponents.reshape(-1)[n_tiles_before:]
    return codes.astype(np.int64), exps.astype(np.int64)


@dataclass
class Segment:
    rounding: str
    seed: int
    clear: bool
    tiles: np.ndarray  # input patterns, (n, rows, cols)
    n_tiles_before: int = 0  # tiles streamed since the last clear (or reset)


def make_segments(rng: np.random.Generator, cfg: dict, plan) -> list[Segment]:
    """Segments for ``plan``, a list of (rounding, seed, clear); positions tracked."""
    segs, since_clear = [], 0
    for rounding, seed, clear in plan:
        tiles = as_input(make_tiles(rng, cfg["m"], cfg["tile"], cfg["reps"]), cfg["input_format"])
        if clear:
            since_clear = 0
        segs.append(Segment(rounding, seed, clear, tiles, since_clear))
        since_clear += tiles.shape[0]
    return segs


def default_plan(rng: np.random.Generator, short: bool = False) -> list:
    """Every rounding mode; stochastic at seeds 0, 2**32 - 1 and random ones; the first segment
    relies on the reset value of n, one continues the stream without a clear. ``short``: five
    segments instead of eight (for big tiles)."""
    r = [int(rng.integers(0, 2**32)) for _ in range(2)]
    if short:
        return [
            ("nearest_even", r[0], False),
            ("stochastic", 0, True),
            ("toward_zero", r[1], True),
            ("stochastic", 2**32 - 1, True),
            ("stochastic", 2**32 - 1, False),  # n continues
        ]
    return [
        ("nearest_even", r[0], False),
        ("stochastic", 0, True),
        ("toward_zero", r[1], True),
        ("stochastic", 2**32 - 1, True),
        ("stochastic", r[0], True),
        ("stochastic", r[0], False),  # n continues
        ("nearest_even", 0, True),
        ("stochastic", r[1], True),
    ]


def beats_of(tiles: np.ndarray, lanes: int, width: int) -> list[int]:
    flat = tiles.reshape(-1, lanes)
    return [sum(int(v) << (i * width) for i, v in enumerate(row)) for row in flat]


def decode(word: int, m: int, lanes: int) -> tuple[list[int], int, int]:
    mask = (1 << m) - 1
    codes = []
    for i in range(lanes):
        v = (word >> (i * m)) & mask
        codes.append(v - (1 << m) if v >> (m - 1) else v)
    rest = word >> (m * lanes)
    return codes, rest & 0xFF, (rest >> 8) & 1


def check_segment(seg: Segment, words: list[int], cfg: dict) -> list[str]:
    """Compare the DUT's beats of one segment with the golden model; the mismatches, readable."""
    m, lanes, tile = cfg["m"], cfg["lanes"], tuple(cfg["tile"])
    fmt = Format(m, tile, seg.rounding)
    T = tile[0] * tile[1]
    bpt = T // lanes
    want_codes, want_exp = golden_stream(seg.tiles, cfg["input_format"], fmt, seg.seed, seg.n_tiles_before)
    xs = seg.tiles.reshape(-1)
    hexw = 8 if cfg["input_format"] == "fp32" else 4
    errors = []
    if len(words) != len(want_codes) // lanes:
        return [f"{seg.rounding}/seed {seg.seed:#x}: {len(words)} beats, want {len(want_codes) // lanes}"]
    for b, word in enumerate(words):
        codes, exp, last = decode(word, m, lanes)
        t = b // bpt
        where = f"{seg.rounding}/seed {seg.seed:#x} tile {t} beat {b % bpt}"
        if exp != want_exp[t]:
            errors.append(f"{where}: exponent {exp:#04x}, want {want_exp[t]:#04x} "
                          f"(tile {[f'{v:#0{hexw + 2}x}' for v in seg.tiles[t].reshape(-1)]})")
        if last != (b % bpt == bpt - 1):
            errors.append(f"{where}: last={last}")
        for lane, got in enumerate(codes):
            e = b * lanes + lane
            if got != want_codes[e]:
                errors.append(f"{where} lane {lane} (n={seg.n_tiles_before * T + e}): input {int(xs[e]):#0{hexw + 2}x}, "
                              f"tile exponent {want_exp[t]:#04x}: got code {got & ((1 << m) - 1):#x} ({got}), "
                              f"want {int(want_codes[e]) & ((1 << m) - 1):#x} ({want_codes[e]})")
        if len(errors) > 20:
            break
    return errors


# ---- the cocotb tests --------------------------------------------------------------------------


async def _reset(dut):
    dut.rounding.value = 0
    dut.seed.value = 0
    dut.clear.value = 0
    await start_clock_and_reset(dut, sources=["i"], sinks=["o"])


async def _pulse_clear(dut):
    dut.clear.value = 1
    await RisingEdge(dut.clk)
    dut.clear.value = 0


async def _drive(dut, src: StreamSource, segs: list[Segment], cfg: dict):
    """Stream the segments back to back: the mode and seed of the next segment are set as
    soon as the last beat of the previous one is in, while its tiles still drain."""
    width = 32 if cfg["input_format"] == "fp32" else 16
    for seg in segs:
        dut.rounding.value = ROUNDING_CODES[seg.rounding]
        dut.seed.value = seg.seed
        for _ in range(KEY_LATENCY):
            await RisingEdge(dut.clk)
        if seg.clear:
            cocotb.start_soon(_pulse_clear(dut))
        await src.send(beats_of(seg.tiles, cfg["lanes"], width))


async def _monitor(dut, log: dict):
    """Cycle numbers of every input and output transfer."""
    cycle = 0
    while True:
        await ReadOnly()
        if dut.i__valid.value and dut.i__ready.value:
            log["in"].append(cycle)
        if dut.o__valid.value and dut.o__ready.value:
            log["out"].append(cycle)
        await RisingEdge(dut.clk)
        cycle += 1


def _check_all(segs, got, cfg):
    errors, pos = [], 0
    for seg in segs:
        n = seg.tiles.size // cfg["lanes"]
        errors += check_segment(seg, got[pos:pos + n], cfg)
        pos += n
    assert not errors, "mismatches:\n" + "\n".join(errors[:20])


@cocotb.test()
async def all_roundings_with_stalls(dut):
    """Every segment of the default plan, random stalls on both sides."""
    cfg = tb_config()
    await _reset(dut)
    rng = np.random.default_rng(cfg["seed"])
    segs = make_segments(rng, cfg, default_plan(rng, cfg.get("short_plan", False)))
    stall = cfg.get("stall", 0.3)
    src = StreamSource(dut, "i", stall=stall, rng=random.Random(cfg["seed"]))
    snk = StreamSink(dut, "o", stall=stall, rng=random.Random(cfg["seed"] + 1))
    total = sum(s.tiles.size for s in segs) // cfg["lanes"]
    cocotb.start_soon(_drive(dut, src, segs, cfg))
    got = await snk.receive(total, timeout_cycles=200)
    dut._log.info(f"{total} beats, {len(segs)} segments, {sum(s.tiles.shape[0] for s in segs)} tiles checked")
    _check_all(segs, got, cfg)


@cocotb.test()
async def full_throughput(dut):
    """No stalls: one beat in and one beat out every cycle, and the documented latency."""
    cfg = tb_config()
    await _reset(dut)
    rng = np.random.default_rng(cfg["seed"] + 7)
    # One segment, so that the stream is gapless.
    [seg] = make_segments(rng, cfg, [("stochastic", int(rng.integers(0, 2**32)), True)])
    log = {"in": [], "out": []}
    mon = cocotb.start_soon(_monitor(dut, log))
    src, snk = StreamSource(dut, "i"), StreamSink(dut, "o")
    total = seg.tiles.size // cfg["lanes"]
    recv = cocotb.start_soon(snk.receive(total, timeout_cycles=200))
    await _drive(dut, src, [seg], cfg)
    got = await recv
    mon.cancel()
    _check_all([seg], got, cfg)
    ins, outs = log["in"], log["out"]
    assert len(ins) == total and ins[-1] - ins[0] == total - 1, f"input: {total} beats over {ins[-1] - ins[0] + 1} cycles"
    assert len(outs) == total and outs[-1] - outs[0] == total - 1, f"output: {total} beats over {outs[-1] - outs[0] + 1} cycles"
    bpt = seg.tiles[0].size // cfg["lanes"]
    latency = outs[0] - ins[bpt - 1]
    assert latency == LATENCY, f"first output {latency} cycles after the tile's last input beat, documented {LATENCY}"
    dut._log.info(f"{total} beats in {ins[-1] - ins[0] + 1} cycles in, {outs[-1] - outs[0] + 1} out; latency {latency}")
