"""The BFP quantizer (``hbfp.hw.quantize.Quantize``) against ``hbfp.golden.bfp.quantize``:
cocotb on Icarus and Verilator, plus quick checks under Amaranth's own simulator."""

import os
import random

import numpy as np
import pytest
from amaranth.back import verilog
from amaranth.sim import Simulator

from hbfp.hw.params import ROUNDING_CODES
from hbfp.hw.quantize import KEY_LATENCY, SERIAL_KEY_BEATS, Quantize
from hbfp.sim import runner
from hbfp.sim.tb_quantize import beats_of, check_segment, make_segments

FULL = os.environ.get("HBFP_SIM_FULL") == "1"

# name: (mantissa_bits, tile, lanes, input_format, tiles of each kind per segment)
CONFIGS = {
    "hbfp8": (8, (24, 24), 8, "fp32", 1),
    "mxint8": (8, (1, 32), 8, "fp32", 3),
    "odd_m6_3x5": (6, (3, 5), 5, "fp32", 3),
    "m16_bf16_4x4": (16, (4, 4), 4, "bf16", 3),
    "m2_bf16_beat_is_tile": (2, (2, 2), 4, "bf16", 3),
}
# HBFP8 tiles are 72 beats each: a shorter segment plan keeps the run within budget.
SHORT_PLAN = ("hbfp8",)


def _config(name: str) -> dict:
    m, tile, lanes, fmt, reps = CONFIGS[name]
    return dict(m=m, tile=tile, lanes=lanes, input_format=fmt, reps=reps * (8 if FULL else 1),
                seed=sum(map(ord, name)), stall=0.3, short_plan=name in SHORT_PLAN and not FULL)


@pytest.mark.parametrize("sim", runner.SIMULATORS)
@pytest.mark.parametrize("name", CONFIGS)
def test_quantize_cocotb(sim, name):
    runner.require(sim)
    cfg = _config(name)
    m, tile, lanes, fmt, _ = CONFIGS[name]
    tests, failed = runner.run(lambda: Quantize(m, tile, lanes, fmt), "quantize", "tb_quantize", sim, cfg)
    assert tests == 2 and failed == 0


# ---- Amaranth simulator ------------------------------------------------------------------------


def _amaranth_run(cfg: dict, plan, *, src_stall=0.3, snk_stall=0.3, early_clear=False) -> list[str]:
    """Stream the plan's segments through the DUT in Amaranth's simulator; the mismatches.

    ``early_clear``: a segment's ``clear`` strobe comes in the middle of the previous
    segment's last tile (it must take effect at the next tile)."""
    dut = Quantize(cfg["m"], tuple(cfg["tile"]), cfg["lanes"], cfg["input_format"],
                   stochastic=cfg.get("stochastic", True))
    send = cfg.get("send", ROUNDING_CODES)  # the code put on the port for a segment's rounding
    rng = np.random.default_rng(cfg["seed"])
    segs = make_segments(rng, cfg, plan)
    width = 32 if cfg["input_format"] == "fp32" else 16
    total = sum(s.tiles.size for s in segs) // cfg["lanes"]
    bpt = dut.beats_per_tile
    got = []
    stalls = random.Random(cfg["seed"])

    async def source(ctx):
        for k, seg in enumerate(segs):
            ctx.set(dut.rounding, send[seg.rounding])
            ctx.set(dut.seed, seg.seed)
            await ctx.tick().repeat(KEY_LATENCY)
            if not early_clear or k == 0:
                ctx.set(dut.clear, seg.clear)
            beats = beats_of(seg.tiles, cfg["lanes"], width)
            early_at = len(beats) - bpt + bpt // 2  # mid last tile
            next_clear = early_clear and k + 1 < len(segs) and segs[k + 1].clear
            for i, beat in enumerate(beats):
                if next_clear and i == early_at:
                    ctx.set(dut.clear, 1)
                while stalls.random() < src_stall:
                    await ctx.tick()
                    ctx.set(dut.clear, 0)
                ctx.set(dut.i.payload.as_value(), beat)
                ctx.set(dut.i.valid, 1)
                while True:
                    _, _, ready = await ctx.tick().sample(dut.i.ready)
                    ctx.set(dut.clear, 0)
                    if ready:
                        break
                ctx.set(dut.i.valid, 0)

    async def sink(ctx):
        while len(got) < total:
            ready = stalls.random() >= snk_stall
            ctx.set(dut.o.ready, ready)
            _, _, valid, word = await ctx.tick().sample(dut.o.valid, dut.o.payload.as_value())
            if ready and valid:
                got.append(word)

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(source)
    sim.add_testbench(sink, background=False)
    slowest = 1 / (1 - max(src_stall, snk_stall))
    sim.run_until(1e-8 * (slowest * 2 * total + 200 * len(segs) + 100))
    assert len(got) == total, f"{len(got)} of {total} beats came out"
    errors, pos = [], 0
    for seg in segs:
        n = seg.tiles.size // cfg["lanes"]
        errors += check_segment(seg, got[pos:pos + n], cfg)
        pos += n
    return errors


SMALL = dict(m=6, tile=(3, 5), lanes=5, input_format="fp32", reps=1, seed=5)


@pytest.mark.parametrize("rounding", list(ROUNDING_CODES))
def test_quantize_amaranth_sim(rounding):
    plan = [(rounding, 0, False), (rounding, 2**32 - 1, True), (rounding, 12345, False)]
    errors = _amaranth_run(SMALL, plan)
    assert not errors, "\n".join(errors[:20])


def test_quantize_without_stochastic_rounding():
    """``stochastic=False`` (a reduced device): nearest-even and toward-zero as the golden
    model; the stochastic code (which such a device refuses before it gets here) and the
    unused code 3 round to nearest even."""
    cfg = dict(SMALL, stochastic=False)
    plan = [("nearest_even", 0, True), ("toward_zero", 7, False), ("nearest_even", 9, True)]
    assert not _amaranth_run(cfg, plan)
    for code in (ROUNDING_CODES["stochastic"], 3):
        errors = _amaranth_run(dict(cfg, send={"nearest_even": code}), [("nearest_even", 5, True)])
        assert not errors, "\n".join(errors[:20])


def test_quantize_clear_mid_tile_applies_to_next_tile():
    plan = [("stochastic", 3, False), ("stochastic", 3, True), ("stochastic", 3, False), ("stochastic", 9, True)]
    errors = _amaranth_run(SMALL, plan, early_clear=True)
    assert not errors, "\n".join(errors[:20])


def test_quantize_serial_key():
    """Tiles of SERIAL_KEY_BEATS beats or more take their key from the serial unit: new seeds
    with and without ``clear``, every rounding, stalls on both sides (the cocotb runs of the
    HBFP8 configuration, 72 beats a tile, check its full throughput and latency)."""
    cfg = dict(m=8, tile=(8, 9), lanes=1, input_format="fp32", reps=1, seed=11)
    for args, kw, serial in [((8, (8, 9), 1), {}, True), ((8, (8, 9), 1), {"stochastic": False}, False),
                             ((6, (3, 5), 5), {}, False), ((8, (24, 24), 8), {}, True), ((8, (1, 32), 1), {}, False)]:
        q = Quantize(*args, **kw)
        q._MustUse__used = True  # built for its attributes only
        assert q.serial_key == serial
        assert q.serial_key == (q.stochastic and q.beats_per_tile >= SERIAL_KEY_BEATS)
    plan = [("stochastic", 0, True), ("stochastic", 2**32 - 1, False), ("nearest_even", 5, True),
            ("stochastic", 77, False), ("stochastic", 78, True)]
    errors = _amaranth_run(cfg, plan, src_stall=0.2, snk_stall=0.5)
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("src_stall, snk_stall", [(0.0, 0.8), (0.8, 0.0)])
def test_quantize_backpressure(src_stall, snk_stall):
    """A slow sink fills both banks (the input must stall); a slow source starves the drain."""
    cfg = dict(SMALL, m=16, input_format="bf16", tile=(4, 4), lanes=4)
    plan = [("stochastic", 1, True), ("nearest_even", 2, True), ("toward_zero", 0, False)]
    errors = _amaranth_run(cfg, plan, src_stall=src_stall, snk_stall=snk_stall)
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("name", CONFIGS)
def test_quantize_converts_to_verilog(name):
    m, (rows, cols), lanes, fmt, _ = CONFIGS[name]
    q = Quantize(m, (rows, cols), lanes, fmt)
    assert q.beats_per_tile == rows * cols // lanes
    assert q.i.payload.shape().size == (32 if fmt == "fp32" else 16) * lanes
    assert q.o.payload.shape().size == m * lanes + 8 + 1
    text = verilog.convert(q, name="quantize")
    assert "module quantize" in text


def test_quantize_rejects_bad_parameters():
    with pytest.raises(ValueError, match="must divide"):
        Quantize(8, (3, 5), 4)
    with pytest.raises(ValueError, match="input_format"):
        Quantize(8, (1, 32), 8, "fp16")
    with pytest.raises(ValueError, match="mantissa_bits"):
        Quantize(17, (1, 32), 8)
    with pytest.raises(ValueError, match="lanes"):
        Quantize(8, (1, 32), 0)
