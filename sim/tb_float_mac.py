"""cocotb testbench of ``hbfp.hw.float_mac.FloatMacArray`` against
``hbfp.golden.float_mac.float_mac``.

Configuration (``tb_config()``): ``rows``, ``cols``, ``fmt`` ("bf16"/"fp16"), ``k``,
``interleave`` (the array's ``INTERLEAVE``), ``runs`` (runs of ``interleave * k`` beats in the
stalled test), ``seed``, ``ready_ahead`` (the array's: the sink tells its ready a cycle early). Every run draws its operands from one of the classes of
``operands``; the results are compared bit for bit (a NaN is the contract's ``0x7FC00000``).
"""

from __future__ import annotations

import random

import cocotb
import numpy as np
from cocotb.triggers import RisingEdge
from hbfp.golden.float_mac import float_format, float_mac
from hbfp.sim.runner import tb_config
from hbfp.sim.streams import (
    StreamSink,
    StreamSource,
    pack,
    start_clock_and_reset,
    unpack,
)

F32_QNAN = 0x7FC0_0000
KINDS = ("moderate", "random", "specials", "cancel", "extreme", "tiny")


def _pattern(fmt, sign, exp, frac) -> np.ndarray:
    f = float_format(fmt)
    return ((np.asarray(sign) << (f.width - 1)) | (np.asarray(exp) << f.frac_bits) | np.asarray(frac)).astype(np.uint16)


def specials(fmt) -> np.ndarray:
    """Zeros, subnormals, infs, NaNs, the extremes of the normal range, 1.0 and its
    neighbours, in both signs."""
    f = float_format(fmt)
    e_max = 2**f.exp_bits - 1
    frac_max = 2**f.frac_bits - 1
    mags = [
        _pattern(fmt, 0, 0, 0),  # 0
        _pattern(fmt, 0, 0, 1),  # smallest subnormal
        _pattern(fmt, 0, 0, frac_max),  # largest subnormal
        _pattern(fmt, 0, 1, 0),  # smallest normal
        _pattern(fmt, 0, e_max - 1, frac_max),  # largest finite
        _pattern(fmt, 0, e_max, 0),  # inf
        _pattern(fmt, 0, e_max, 1 << (f.frac_bits - 1)),  # quiet NaN
        _pattern(fmt, 0, e_max, 1),  # signalling NaN
        _pattern(fmt, 0, f.bias, 0),  # 1.0
        _pattern(fmt, 0, f.bias, frac_max),  # 2 - ulp
        _pattern(fmt, 0, f.bias - 1, frac_max),  # 1 - ulp / 2
    ]
    mags = np.array(mags, dtype=np.uint16)
    return np.concatenate([mags, mags | np.uint16(0x8000)])


def _values(rng, fmt, kind, shape) -> np.ndarray:
    """16-bit patterns of one class (``KINDS``)."""
    f = float_format(fmt)
    e_max = 2**f.exp_bits - 1
    sign = rng.integers(0, 2, shape)
    frac = rng.integers(0, 2**f.frac_bits, shape)
    if kind == "random":  # every pattern equally likely: NaN, inf, subnormals included
        return rng.integers(0, 1 << 16, shape).astype(np.uint16)
    if kind == "moderate":  # values near 1 with a few binades' spread: rounding in the sums
        return _pattern(fmt, sign, f.bias + rng.integers(-6, 7, shape), frac)
    if kind == "specials":
        # Dense enough that 0 * inf, inf - inf and the like meet in many sums; NaN operands
        # rarer, as one NaN product decides a whole sum.
        s = specials(fmt)
        nan = (s & np.uint16(0x7FFF)) > _pattern(fmt, 0, e_max, 0)
        v = _values(rng, fmt, "moderate", shape)
        u = rng.random(shape)
        v = np.where(u < 0.6, s[~nan][rng.integers(0, (~nan).sum(), shape)], v)
        return np.where(u > 0.98, s[nan][rng.integers(0, nan.sum(), shape)], v).astype(np.uint16)
    if kind == "extreme":
        # The ends of the exponent range: bf16 products overflow to inf or flush below
        # 2**-126; fp16 subnormals and maxima; sums that overflow.
        lo = rng.integers(0, 4, shape)
        hi = rng.integers(e_max - 4, e_max, shape)
        mid = rng.integers(1, e_max, shape)
        pick = rng.integers(0, 3, shape)
        exp = np.choose(pick, [lo, hi, mid])
        return _pattern(fmt, sign, exp, frac)
    if kind == "tiny":
        # bf16: products about 2**-126 of both signs (exponent fields summing to 126..130:
        # a product flushed, or normal only when its significand product reaches 2), whose
        # sums cancel below it and flush to zeros of either sign. fp16: subnormal operands
        # (exact, never flushed).
        if f.subnormals:
            return _pattern(fmt, sign, np.where(rng.random(shape) < 0.5, 0, rng.integers(1, 4, shape)), frac)
        return _pattern(fmt, sign, rng.integers(63, 66, shape), frac)
    raise ValueError(f"unknown operand class {kind!r}")


def operands(rng: np.random.Generator, cfg: dict, kind: str):
    """One run: A (L, R, k) and B (L, k, C) patterns of class ``kind``; "cancel" pairs every
    product with its negation (exact zeros, signs of zero sums)."""
    L, R, C, k = cfg["interleave"], cfg["rows"], cfg["cols"], cfg["k"]
    if kind == "cancel":
        a = _values(rng, cfg["fmt"], "moderate", (L, R, k))
        b = _values(rng, cfg["fmt"], "moderate", (L, k, C))
        half = k // 2
        a[:, :, half : 2 * half] = a[:, :, :half] ^ np.uint16(0x8000)
        b[:, half : 2 * half, :] = b[:, :half, :]
        return a, b
    a, b = _values(rng, cfg["fmt"], kind, (L, R, k)), _values(rng, cfg["fmt"], kind, (L, k, C))
    if kind == "tiny":
        # -0 products after the first half: a sum flushed to -0 must stay -0 (also through
        # the empty slots of input stalls). Group 0 sums only -0 products: +0, as the sum
        # starts at +0.
        b = b & np.uint16(0x7FFF)
        a[:, :, k // 2 :] = 0x8000
        a[0] = 0x8000
    return a, b


def beats(a: np.ndarray, b: np.ndarray, cfg: dict) -> list[int]:
    """The beats of one run: step-major, group-minor."""
    L, R, k = cfg["interleave"], cfg["rows"], cfg["k"]
    w = float_format(cfg["fmt"]).width
    return [pack(a[g, :, s], w) | (pack(b[g, s, :], w) << (R * w)) for s in range(k) for g in range(L)]


def check(got: list[int], runs: list[tuple[str, np.ndarray, np.ndarray]], cfg: dict) -> None:
    L, R, C = cfg["interleave"], cfg["rows"], cfg["cols"]
    assert len(got) == L * len(runs)
    group_bits = (L - 1).bit_length()
    for r, (kind, a, b) in enumerate(runs):
        want = np.asarray(float_mac(a, b, cfg["fmt"])).view(np.uint32)  # (L, R, C)
        for g in range(L):
            word = got[r * L + g]
            group = (word >> (R * C * 32)) & ((1 << group_bits) - 1)
            assert group == g, f"run {r}: beat {g} carries group {group}"
            sums = np.array(unpack(word, 32, R * C), dtype=np.uint32).reshape(R, C)
            w = want[g]
            bad = sums != w
            if bad.any():
                i, j = np.argwhere(bad)[0]
                raise AssertionError(
                    f"run {r} ({kind}), group {g}, PE ({i}, {j}): got {sums[i, j]:08x}, want {w[i, j]:08x}; "
                    f"a={[hex(x) for x in a[g, i]]} b={[hex(x) for x in b[g, :, j]]}"
                )


def _runs(cfg: dict, count: int, seed: int):
    rng = np.random.default_rng(seed)
    return [(kind, *operands(rng, cfg, kind)) for kind in (KINDS[r % len(KINDS)] for r in range(count))]


def _ahead(dut, cfg) -> str | None:
    """With ``ready_ahead`` the array's input that takes the next cycle's ready, held low
    from before the reset (it feeds the stall register)."""
    if not cfg.get("ready_ahead"):
        return None
    dut.o_ready_next.value = 0
    return "o_ready_next"


@cocotb.test()
async def random_with_stalls(dut):
    """Every operand class, idle cycles on both sides."""
    cfg = tb_config()
    ahead = _ahead(dut, cfg)
    await start_clock_and_reset(dut, sources=["i"], sinks=["o"])
    runs = _runs(cfg, cfg["runs"], cfg["seed"])
    src = StreamSource(dut, "i", stall=0.2, rng=random.Random(cfg["seed"]))
    snk = StreamSink(dut, "o", stall=0.4, rng=random.Random(cfg["seed"] + 1), ahead=ahead)
    cocotb.start_soon(src.send([beat for _, a, b in runs for beat in beats(a, b, cfg)]))
    got = await snk.receive(cfg["interleave"] * len(runs), timeout_cycles=200)
    check(got, runs, cfg)


@cocotb.test()
async def full_throughput(dut):
    """No stalls: one beat per cycle in (every PE one MAC per cycle), one result out per
    group, the last ``LATENCY`` cycles after the last beat."""
    cfg = tb_config()
    ahead = _ahead(dut, cfg)
    await start_clock_and_reset(dut, sources=["i"], sinks=["o"])
    runs = _runs(cfg, len(KINDS), cfg["seed"] + 7)
    stream = [beat for _, a, b in runs for beat in beats(a, b, cfg)]
    src = StreamSource(dut, "i")
    snk = StreamSink(dut, "o", ahead=ahead)
    recv = cocotb.start_soon(snk.receive(cfg["interleave"] * len(runs), timeout_cycles=200))
    start = cocotb.utils.get_sim_time("ns")
    await src.send(stream)
    cycles = (cocotb.utils.get_sim_time("ns") - start) / 10
    assert cycles == len(stream), f"{len(stream)} beats took {cycles} cycles"
    got = await recv
    done = (cocotb.utils.get_sim_time("ns") - start) / 10
    # The last beat was accepted at edge len(stream); its group's sum is taken LATENCY
    # edges later.
    assert done == len(stream) + cfg["latency"], f"last result after {done} cycles"
    check(got, runs, cfg)
    await RisingEdge(dut.clk)
