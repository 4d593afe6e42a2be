"""cocotb testbench of ``hbfp.hw.normalize.Normalize`` against ``hbfp.golden.gemm.normalize``.

Configuration (``runner.tb_config()``): ``psum_width``, ``mantissa_bits_a``,
``mantissa_bits_b``, ``seed``, ``random`` (random vectors in the stalled run), ``throughput``
(random vectors in the no-stall run), ``stall`` (probability of an idle cycle on either side).

The stimulus functions are plain NumPy so that the Amaranth-simulator tests share them.
"""

from __future__ import annotations

import random

import cocotb
import numpy as np
from cocotb.triggers import ReadOnly, RisingEdge

from hbfp.golden.gemm import normalize
from hbfp.hw.normalize import F32_BIAS, Normalize
from hbfp.hw.params import EXP_BIAS, EXP_NAN, EXP_WIDTH
from hbfp.sim.runner import tb_config
from hbfp.sim.streams import StreamSink, StreamSource, start_clock_and_reset

# Codes of a finite tile: 0 (E = -127) up to 254; EXP_NAN is the NaN tile.
_CODE_MAX = EXP_NAN - 1
# Biased fp32 exponents around the two edges of the normal range (1 and 254): the stimulus
# picks tile codes so that the exact, unrounded result lands on one of these.
EDGE_EXPONENTS = (-2, -1, 0, 1, 2, 253, 254, 255, 256)


def _msb(s: np.ndarray) -> np.ndarray:
    """Position of the leading one of |s| (s != 0)."""
    mag = np.abs(s.astype(object))
    return np.array([int(v).bit_length() - 1 for v in mag], dtype=np.int64)


def codes_for(s, biased_exp, mantissa_bits_a: int, mantissa_bits_b: int, rng: np.random.Generator):
    """Tile codes (exp_a, exp_b) that put ``s * 2**scale`` (before rounding) at the fp32 biased
    exponent ``biased_exp``, where reachable with codes 0..254; returns (s, ea, eb) of the
    reachable ones. Stimulus only: the expected results always come from the golden model."""
    s = np.asarray(s, dtype=np.int64)
    biased_exp = np.broadcast_to(np.asarray(biased_exp, dtype=np.int64), s.shape)
    nz = s != 0
    s, biased_exp = s[nz], biased_exp[nz]
    # value = |s| * 2**(ea + eb - 2*EXP_BIAS - (mA - 2) - (mB - 2)), |s| in [2**msb, 2**(msb+1))
    total = biased_exp - F32_BIAS - _msb(s) + 2 * EXP_BIAS + (mantissa_bits_a - 2) + (mantissa_bits_b - 2)
    ok = (total >= 0) & (total <= 2 * _CODE_MAX)
    s, total = s[ok], total[ok]
    lo = np.maximum(0, total - _CODE_MAX)
    hi = np.minimum(_CODE_MAX, total)
    ea = lo + (rng.random(total.shape) * (hi - lo + 1)).astype(np.int64)
    return s, ea, total - ea


def special_magnitudes(w: int) -> list[int]:
    """|s| values that exercise the normalizer: powers of two and their neighbours, all-ones,
    and for w > 24 the rounding cases at a few leading-one positions (exact ties to even and
    to odd, one above and below a tie, all dropped bits set, the carry out of all-ones)."""
    top = 1 << (w - 1)  # |min s|
    mags = {1, top - 1, top}
    for k in range(1, w):
        mags.update((1 << k, (1 << k) - 1, (1 << k) + 1))
    positions = {24, 25, 26, 24 + (w - 24) // 2, w - 2, w - 1}
    for p in sorted(q for q in positions if 24 <= q < w):  # leading one at bit p
        cut = p - 23  # bits rounded off
        for sig in ((1 << 24) - 1, (1 << 24) - 2, 1 << 23, (1 << 23) + 1, 0xAAAAAA, 0xD55555):
            base = sig << cut
            half = 1 << (cut - 1)
            mags.update((base, base + half, base + half - 1, base + half + 1, base + (1 << cut) - 1))
    return sorted(v for v in mags if 0 < v <= top)


def corner_vectors(w: int, mantissa_bits_a: int, mantissa_bits_b: int, rng: np.random.Generator):
    """Targeted cases: 0, +-1, +-2**k, +-(2**k - 1), max and min s and the rounding cases,
    against fixed code pairs (0 = E -127, 254, 127) and against codes that put them at the
    edges of fp32's normal range (FTZ, rounding up to 2**-126, FLT_MAX, overflow); a sample
    of them against NaN codes on either side."""
    top = 1 << (w - 1)
    mags = special_magnitudes(w)
    s_all = np.array([0] + mags + [-v for v in mags], dtype=np.int64)
    s_all = s_all[s_all <= top - 1]
    parts = []
    for ea, eb in [(0, 0), (0, _CODE_MAX), (_CODE_MAX, _CODE_MAX), (EXP_BIAS, EXP_BIAS)]:
        parts.append((s_all, np.full(s_all.shape, ea), np.full(s_all.shape, eb)))
    for be in EDGE_EXPONENTS:
        parts.append(codes_for(s_all, be, mantissa_bits_a, mantissa_bits_b, rng))
    for ea, eb in [(EXP_NAN, 0), (0, EXP_NAN), (EXP_NAN, EXP_NAN), (EXP_NAN, _CODE_MAX), (EXP_BIAS, EXP_NAN)]:
        s_nan = np.concatenate([[0, 1, -1, top - 1, -top], rng.choice(s_all, size=20)])
        parts.append((s_nan, np.full(s_nan.shape, ea), np.full(s_nan.shape, eb)))
    s = np.concatenate([p[0] for p in parts])
    ea = np.concatenate([p[1] for p in parts]).astype(np.int64)
    eb = np.concatenate([p[2] for p in parts]).astype(np.int64)
    return s, ea, eb


def random_vectors(w: int, mantissa_bits_a: int, mantissa_bits_b: int, count: int, rng: np.random.Generator):
    """``count`` random vectors: a third with s uniform over all w-bit values, a third with
    |s| log-uniform (uniform leading-one position, random sign), codes uniform over 0..255
    for both; the last third log-uniform s with codes put at the edges of the normal range."""
    n1 = count // 3
    n2 = count // 3
    n3 = count - n1 - n2
    top = 1 << (w - 1)
    s1 = rng.integers(-top, top, size=n1, dtype=np.int64)

    def log_uniform(n):
        k = rng.integers(0, w - 1, size=n)  # the leading one at bit k (|s| < 2**(w-1))
        mag = (np.int64(1) << k) + (rng.random(n) * (np.int64(1) << k).astype(np.float64)).astype(np.int64)
        mag = np.minimum(mag, (np.int64(1) << k + 1) - 1)  # float rounding could reach 2**(k+1)
        return np.where(rng.random(n) < 0.5, -mag, mag)

    s2 = log_uniform(n2)
    codes = rng.integers(0, 2**EXP_WIDTH, size=(2, n1 + n2), dtype=np.int64)
    s3 = log_uniform(n3)
    s3, ea3, eb3 = codes_for(s3, rng.choice(EDGE_EXPONENTS, size=n3), mantissa_bits_a, mantissa_bits_b, rng)
    return (
        np.concatenate([s1, s2, s3]),
        np.concatenate([codes[0], ea3]),
        np.concatenate([codes[1], eb3]),
    )


def expected(s, ea, eb, mantissa_bits_a: int, mantissa_bits_b: int) -> np.ndarray:
    """The golden model's fp32 bit patterns (uint32)."""
    return normalize(s, ea, eb, mantissa_bits_a, mantissa_bits_b).view(np.uint32)


def is_nan(bits: int) -> bool:
    return bool(np.isnan(np.array(bits, dtype=np.uint32).view(np.float32)))


def mismatches(s, ea, eb, want, got, w: int) -> list[str]:
    """Descriptions (hex) of the results that differ; NaN equals NaN of any encoding."""
    bad = []
    for i, (x, y) in enumerate(zip(want, got)):
        x, y = int(x), int(y)
        if x == y or (is_nan(x) and is_nan(y)):
            continue
        sv = int(s[i])
        bad.append(
            f"#{i}: s={sv} (0x{sv & ((1 << w) - 1):0{(w + 3) // 4}x}) exp_a=0x{int(ea[i]):02x} "
            f"exp_b=0x{int(eb[i]):02x}: expected 0x{x:08x}, got 0x{y:08x}"
        )
    return bad


def pack_inputs(s, ea, eb, w: int) -> list[int]:
    """Payloads of ``normalize_layout(w)``: s (two's complement), exp_a, exp_b from the LSB."""
    mask = (1 << w) - 1
    return [(int(x) & mask) | (int(a) << w) | (int(b) << (w + EXP_WIDTH)) for x, a, b in zip(s, ea, eb)]


def _setup():
    cfg = tb_config()
    w = cfg["psum_width"]
    ma, mb = cfg.get("mantissa_bits_a", 8), cfg.get("mantissa_bits_b", 8)
    return cfg, w, ma, mb


def _check(dut, s, ea, eb, got, w, ma, mb, what):
    want = expected(s, ea, eb, ma, mb)
    assert len(got) == len(want), f"{what}: {len(got)} results for {len(want)} inputs"
    bad = mismatches(s, ea, eb, want, got, w)
    for line in bad[:20]:
        dut._log.error(line)
    assert not bad, f"{what}: {len(bad)} of {len(want)} results differ from the golden model, first: {bad[0]}"
    dut._log.info(f"{what}: {len(want)} vectors equal to the golden model")


async def _protocol_checker(dut):
    """Once o.valid is up and o.ready is low, o must hold its beat until it is taken."""
    held = None
    while True:
        await ReadOnly()
        valid, ready = int(dut.o__valid.value), int(dut.o__ready.value)
        payload = int(dut.o__payload.value) if valid else None
        if held is not None:
            assert valid and payload == held, f"o dropped or changed a beat under backpressure: 0x{held:08x}"
        held = payload if valid and not ready else None
        await RisingEdge(dut.clk)


@cocotb.test()
async def test_corners_and_random_with_stalls(dut):
    """Targeted corners, then random vectors, with random stalls on both sides."""
    cfg, w, ma, mb = _setup()
    rng = np.random.default_rng(cfg.get("seed", 1))
    parts = [corner_vectors(w, ma, mb, rng), random_vectors(w, ma, mb, cfg.get("random", 20000), rng)]
    s, ea, eb = (np.concatenate([p[i] for p in parts]) for i in range(3))
    await start_clock_and_reset(dut, sources=["i"], sinks=["o"])
    cocotb.start_soon(_protocol_checker(dut))
    stall = cfg.get("stall", 0.3)
    src = StreamSource(dut, "i", stall=stall, rng=random.Random(cfg.get("seed", 1)))
    sink = StreamSink(dut, "o", stall=stall, rng=random.Random(cfg.get("seed", 1) + 1))
    receiving = cocotb.start_soon(sink.receive(len(s), timeout_cycles=1000))
    await src.send(pack_inputs(s, ea, eb, w))
    got = await receiving
    _check(dut, s, ea, eb, got, w, ma, mb, "stalled run")


@cocotb.test()
async def test_full_throughput(dut):
    """No stalls: one input accepted and one result out per cycle, LATENCY cycles apart."""
    cfg, w, ma, mb = _setup()
    rng = np.random.default_rng(cfg.get("seed", 1) + 100)
    s, ea, eb = random_vectors(w, ma, mb, cfg.get("throughput", 4000), rng)
    n = len(s)
    await start_clock_and_reset(dut, sources=["i"], sinks=["o"])
    fired_in, fired_out = [], []

    async def monitor():
        cycle = 0
        while True:
            await ReadOnly()
            if int(dut.i__valid.value) and int(dut.i__ready.value):
                fired_in.append(cycle)
            if int(dut.o__valid.value) and int(dut.o__ready.value):
                fired_out.append(cycle)
            await RisingEdge(dut.clk)
            cycle += 1

    cocotb.start_soon(monitor())
    src = StreamSource(dut, "i")
    sink = StreamSink(dut, "o")
    receiving = cocotb.start_soon(sink.receive(n, timeout_cycles=100))
    await src.send(pack_inputs(s, ea, eb, w))
    got = await receiving
    _check(dut, s, ea, eb, got, w, ma, mb, "full-throughput run")
    assert len(fired_in) == n and fired_in[-1] - fired_in[0] == n - 1, (
        f"inputs not accepted one per cycle: {n} beats over {fired_in[-1] - fired_in[0] + 1} cycles"
    )
    assert len(fired_out) == n and fired_out[-1] - fired_out[0] == n - 1, (
        f"results not one per cycle: {n} beats over {fired_out[-1] - fired_out[0] + 1} cycles"
    )
    latency = fired_out[0] - fired_in[0]
    assert latency == Normalize.LATENCY, f"latency {latency} cycles, the component says {Normalize.LATENCY}"
    dut._log.info(f"{n} results in {n} consecutive cycles, latency {latency}")
