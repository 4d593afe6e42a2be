"""cocotb testbench of ``hbfp.hw.add_f32.AddF32`` against ``hbfp.golden.bf16.add_f32``.

Configuration (``tb_config()``): ``seed``; ``random``, the number of uniformly random pattern
pairs; ``stall``, the probability of an idle cycle on either side in the stalled test.
The vector set (``vectors``) is also used by the Amaranth-simulator unit tests.
"""

from __future__ import annotations

import random

import cocotb
import numpy as np
from cocotb.triggers import ReadOnly, RisingEdge

from hbfp.golden import bf16
from hbfp.hw.add_f32 import F32_EXP_BITS, F32_FRAC_BITS, AddF32
from hbfp.hw.params import FP32_WIDTH
from hbfp.sim.runner import tb_config
from hbfp.sim.streams import StreamSink, StreamSource, start_clock_and_reset

FRAC_MASK = (1 << F32_FRAC_BITS) - 1
EXP_MAX = (1 << F32_EXP_BITS) - 1
SIGN = 1 << (FP32_WIDTH - 1)
ABS_MASK = SIGN - 1
INF = EXP_MAX << F32_FRAC_BITS
FLT_MAX = INF - 1
MIN_NORMAL = 1 << F32_FRAC_BITS

#: Values tried against each other in every combination.
SPECIALS = [
    0x0000_0000,  # +0
    SIGN,  # -0
    INF,
    SIGN | INF,
    0x7FC0_0000,  # quiet NaN
    0xFFC0_0000,
    0x7F80_0001,  # signalling NaN
    0xFFFF_FFFF,
    FLT_MAX,
    SIGN | FLT_MAX,
    MIN_NORMAL,  # 2**-126
    SIGN | MIN_NORMAL,
    MIN_NORMAL + 1,
    SIGN | (MIN_NORMAL + 1),
    0x0000_0001,  # subnormals: read as zeros
    0x807F_FFFF,
    0x3F80_0000,  # 1.0
    0xBF80_0000,
    0x3F7F_FFFF,  # 1 - 2**-24
    0x7F00_0000,  # 2**127
    0x7300_0000,  # 2**103: half an ulp of FLT_MAX
]


def pattern(sign, exp, frac) -> np.ndarray:
    """fp32 patterns from (arrays of) fields."""
    sign = np.asarray(sign, dtype=np.uint64)
    exp = np.asarray(exp, dtype=np.uint64)
    frac = np.asarray(frac, dtype=np.uint64)
    return ((sign << 31) | (exp << F32_FRAC_BITS) | (frac & FRAC_MASK)).astype(np.uint32)


def expected(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The golden model's sums, as patterns."""
    a = np.asarray(a, dtype=np.uint32)
    b = np.asarray(b, dtype=np.uint32)
    return np.asarray(bf16.add_f32(a.view(np.float32), b.view(np.float32))).view(np.uint32)


def is_nan(x) -> np.ndarray:
    return (np.asarray(x, dtype=np.uint32) & np.uint32(ABS_MASK)) > np.uint32(INF)


def mismatches(a, b, got) -> list[str]:
    """Descriptions of the results that differ from the golden model (bit for bit, NaNs included)."""
    a = np.asarray(a, dtype=np.uint32)
    b = np.asarray(b, dtype=np.uint32)
    got = np.asarray(got, dtype=np.uint32)
    exp = expected(a, b)
    ok = got == exp
    return [
        f"a={a[k]:08x} b={b[k]:08x}: expected {exp[k]:08x}, got {got[k]:08x}"
        for k in np.flatnonzero(~ok)
    ]


def vectors(seed: int, n_random: int, scale: int = 1) -> tuple[np.ndarray, np.ndarray, dict]:
    """Operand pairs: ``n_random`` uniformly random patterns (every exponent, NaN, inf and
    subnormal included) and the targeted classes, ``scale`` times their base counts.
    Returns (a, b, {class name: count}), shuffled together."""
    rng = np.random.default_rng(seed)
    parts: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def rand_bits(n, bits):
        return rng.integers(0, 1 << bits, n, dtype=np.uint64)

    def signs(n):
        return rand_bits(n, 1)

    # Uniform over all 2**32 patterns.
    parts["random"] = (rand_bits(n_random, 32).astype(np.uint32), rand_bits(n_random, 32).astype(np.uint32))

    # Close exponents, opposite signs: cancellation; with small exponents the difference
    # drops below 2**-126 and must flush; b = -a gives an exact zero.
    n = 2000 * scale
    ea = rng.integers(1, EXP_MAX, n)
    ea = np.where(rng.random(n) < 0.4, rng.integers(1, 5, n), ea)
    eb = np.clip(ea + rng.integers(-2, 3, n), 1, EXP_MAX - 1)
    fa = rand_bits(n, F32_FRAC_BITS)
    fb = np.where(rng.random(n) < 0.5, (fa.astype(np.int64) + rng.integers(-8, 9, n)) & FRAC_MASK, rand_bits(n, F32_FRAC_BITS))
    sa = signs(n)
    sb = np.where(rng.random(n) < 0.9, 1 - sa, sa)
    a = pattern(sa, ea, fa)
    b = pattern(sb, eb, fb)
    exact = rng.random(n) < 0.2
    b = np.where(exact, a ^ np.uint32(SIGN), b)
    parts["cancellation"] = (a, b)

    # Subnormal inputs (DAZ) against anything and against each other.
    n = 500 * scale
    sub = pattern(signs(n), 0, rng.integers(1, FRAC_MASK + 1, n))
    other = np.where(rng.random(n) < 0.5, rand_bits(n, 32), pattern(signs(n), 0, rand_bits(n, F32_FRAC_BITS)))
    swap = rng.random(n) < 0.5
    parts["subnormal"] = (np.where(swap, sub, other).astype(np.uint32), np.where(swap, other, sub).astype(np.uint32))

    # Every exponent difference 0..40 (>= 25: the smaller addend is sticky only).
    d = np.repeat(np.arange(41), 40 * scale)
    n = len(d)
    ea = rng.integers(d + 1, EXP_MAX)
    a = pattern(signs(n), ea, rand_bits(n, F32_FRAC_BITS))
    b = pattern(signs(n), ea - d, rand_bits(n, F32_FRAC_BITS))
    swap = rng.random(n) < 0.5
    parts["exponent difference"] = (np.where(swap, b, a), np.where(swap, a, b))

    # Rounding ties: the part of the smaller significand shifted out is exactly one half
    # (bit d-1 set, those below clear); the kept LSB is random, so both even and odd occur.
    d = np.repeat(np.arange(1, 25), 40 * scale)
    n = len(d)
    ea = rng.integers(d + 1, EXP_MAX)
    sig_small = (rand_bits(n, F32_FRAC_BITS + 1) | (1 << F32_FRAC_BITS)) >> d.astype(np.uint64) << d.astype(np.uint64)
    sig_small |= np.uint64(1) << (d - 1).astype(np.uint64)
    sa = signs(n)
    sb = np.where(rng.random(n) < 0.5, sa, 1 - sa)
    parts["ties"] = (pattern(sa, ea, rand_bits(n, F32_FRAC_BITS)), pattern(sb, ea - d, sig_small))

    # Carries out of the significand: an all-ones fraction plus a same-signed addend.
    n = 400 * scale
    d = rng.integers(0, 30, n)
    ea = rng.integers(d + 1, EXP_MAX)
    sa = signs(n)
    parts["carry"] = (pattern(sa, ea, FRAC_MASK - rand_bits(n, 2)), pattern(sa, ea - d, rand_bits(n, F32_FRAC_BITS)))

    # Near FLT_MAX: sums that stay finite, round to FLT_MAX, tie up into inf, or overflow; a
    # fraction all ones but one bit rounds up short of inf.
    n = 400 * scale
    d = rng.integers(0, 30, n)
    sa = signs(n)
    sb = np.where(rng.random(n) < 0.8, sa, 1 - sa)
    pick = rng.random(n)
    one_short = FRAC_MASK ^ (np.uint64(1) << rng.integers(0, F32_FRAC_BITS, n).astype(np.uint64))
    fa = np.where(pick < 0.4, FRAC_MASK, np.where(pick < 0.7, one_short, rand_bits(n, F32_FRAC_BITS)))
    a = pattern(sa, EXP_MAX - 1, fa)
    b = pattern(sb, EXP_MAX - 1 - d, rand_bits(n, F32_FRAC_BITS))
    half_ulp = pattern(sa, EXP_MAX - 1 - 24, 0)  # 2**103: a tie against FLT_MAX
    edge = np.array([0, 1], dtype=np.uint32)[rng.integers(0, 2, n)]  # or just below it
    b = np.where(rng.random(n) < 0.2, half_ulp - edge, b)
    parts["overflow"] = (a, b.astype(np.uint32))

    # Every combination of the special values.
    s = np.array(SPECIALS, dtype=np.uint32)
    parts["specials"] = (np.repeat(s, len(s)), np.tile(s, len(s)))

    a = np.concatenate([p[0] for p in parts.values()]).astype(np.uint32)
    b = np.concatenate([p[1] for p in parts.values()]).astype(np.uint32)
    order = rng.permutation(len(a))
    return a[order], b[order], {k: len(v[0]) for k, v in parts.items()}


def _operands(a, b) -> list[int]:
    # The payload layout packs "a" into the low 32 bits.
    return [int(x) | (int(y) << FP32_WIDTH) for x, y in zip(a, b)]


def _check(dut, a, b, got) -> None:
    bad = mismatches(a, b, got)
    for line in bad[:20]:
        dut._log.error(line)
    assert not bad, f"{len(bad)} of {len(a)} sums differ from bf16.add_f32; first: {bad[0]}"


async def _protocol_monitor(dut) -> None:
    """A result offered on ``o`` and not taken must stay offered and unchanged."""
    held = None
    while True:
        await ReadOnly()
        valid = bool(dut.o__valid.value)
        if held is not None:
            assert valid, "o.valid dropped before the beat was accepted"
            assert int(dut.o__payload.value) == held, "o.payload changed before the beat was accepted"
        held = int(dut.o__payload.value) if valid and not bool(dut.o__ready.value) else None
        await RisingEdge(dut.clk)


@cocotb.test()
async def test_stalls(dut):
    """All vectors with random idle cycles on both sides."""
    cfg = tb_config()
    seed = cfg.get("seed", 1)
    stall = cfg.get("stall", 0.3)
    a, b, counts = vectors(seed, cfg.get("random", 20000), cfg.get("scale", 1))
    dut._log.info("vectors: %s", counts)
    # The drivers hold valid and ready low from the start, so no X enters during reset.
    src = StreamSource(dut, "i", stall=stall, rng=random.Random(seed))
    sink = StreamSink(dut, "o", stall=stall, rng=random.Random(seed + 1))
    await start_clock_and_reset(dut)
    cocotb.start_soon(_protocol_monitor(dut))
    cocotb.start_soon(src.send(_operands(a, b)))
    got = await sink.receive(len(a), timeout_cycles=100)
    _check(dut, a, b, got)


@cocotb.test()
async def test_full_throughput(dut):
    """No stalls: one result per cycle, the first one LATENCY cycles after the first beat."""
    cfg = tb_config()
    seed = cfg.get("seed", 1) + 100
    a, b, _ = vectors(seed, cfg.get("full_throughput", 4000), 1)
    n = len(a)
    src = StreamSource(dut, "i")
    sink = StreamSink(dut, "o")
    await start_clock_and_reset(dut)
    cycles = 0

    async def count():
        nonlocal cycles
        while True:
            await RisingEdge(dut.clk)
            cycles += 1

    cocotb.start_soon(count())
    cocotb.start_soon(src.send(_operands(a, b)))
    got = await sink.receive(n, timeout_cycles=100)
    _check(dut, a, b, got)
    # Beat k is accepted at edge k + 1 and its result taken at edge k + 1 + LATENCY.
    assert cycles == n + AddF32.LATENCY, f"{n} results took {cycles} cycles (latency {AddF32.LATENCY})"
