"""The normalizer (hw/normalize.py) against ``hbfp.golden.gemm.normalize``.

Amaranth-simulator tests of the datapath over many widths (with a random ``advance``), Verilog
conversion, and the cocotb testbench ``hbfp.sim.tb_normalize`` of the stream component on
Icarus and Verilator. ``HBFP_SIM_FULL=1`` runs ten times the vectors.
"""

from __future__ import annotations

import gc
import os
import random

import numpy as np
import pytest
from amaranth.back import verilog
from amaranth.hdl import Fragment
from amaranth.sim import Simulator

from hbfp.hw.normalize import Normalize, NormalizeDatapath, normalize_layout
from hbfp.hw.params import EXP_BIAS, EXP_WIDTH, FP32_WIDTH, psum_width
from hbfp.sim import runner
from hbfp.sim.tb_normalize import corner_vectors, expected, is_nan, random_vectors

FULL = os.environ.get("HBFP_SIM_FULL") == "1"

# (mantissa_bits_a, mantissa_bits_b, tk): HBFP8, HBFP16 and a mixed 16 x 8 product.
CONFIGS = [(8, 8, 24), (16, 16, 24), (16, 8, 24)]


def _datapath_run(w: int, ma: int, mb: int, s, ea, eb, seed: int, p_advance: float = 0.7, p_valid: float = 0.8):
    """Drive the datapath with a random ``advance`` and ``i_valid``; a delay line of LATENCY
    advances says which input must be on the output; returns (index, result) pairs."""
    dut = NormalizeDatapath(w, ma, mb)
    rng = random.Random(seed)
    n = len(s)
    out = []

    async def bench(ctx):
        line = [None] * dut.LATENCY  # input index per stage, None for a bubble
        i = 0
        while i < n or any(x is not None for x in line):
            adv = rng.random() < p_advance
            valid = i < n and rng.random() < p_valid
            ctx.set(dut.advance, adv)
            ctx.set(dut.i_valid, valid)
            if i < n:
                ctx.set(dut.i_s, int(s[i]))
                ctx.set(dut.i_exp_a, int(ea[i]))
                ctx.set(dut.i_exp_b, int(eb[i]))
            head = line[-1]
            assert ctx.get(dut.o_valid) == (head is not None)
            if head is not None and adv:
                out.append((head, ctx.get(dut.o_result)))
            await ctx.tick()
            if adv:
                line = [i if valid else None] + line[:-1]
                i += valid

    sim = Simulator(dut)
    sim.add_clock(1e-6)
    sim.add_testbench(bench)
    sim.run()
    return out


def _assert_golden(s, ea, eb, ma, mb, w, out):
    want = expected(s, ea, eb, ma, mb)
    assert [k for k, _ in out] == list(range(len(s))), "results out of order or lost"
    for k, got in out:
        x = int(want[k])
        assert x == got or (is_nan(x) and is_nan(got)), (
            f"w={w}: s={int(s[k])} exp_a=0x{int(ea[k]):02x} exp_b=0x{int(eb[k]):02x}: "
            f"expected 0x{x:08x}, got 0x{got:08x}"
        )


# Widths around the rounding boundary (24 significand bits), the project's configurations
# (20, 28, 36) and the extremes the golden model handles exactly.
@pytest.mark.parametrize(
    "w, ma, mb",
    [(2, 8, 8), (3, 8, 8), (20, 8, 8), (24, 8, 8), (25, 8, 8), (26, 8, 8), (28, 16, 8), (36, 16, 16), (53, 16, 16), (41, 2, 16)],
)
def test_datapath_amaranth(w, ma, mb):
    rng = np.random.default_rng(w * 1000 + ma * 10 + mb)
    cs, cea, ceb = corner_vectors(w, ma, mb, rng)
    pick = rng.choice(len(cs), size=min(len(cs), 600), replace=False)
    rs, rea, reb = random_vectors(w, ma, mb, 400, rng)
    s = np.concatenate([cs[pick], rs])
    ea = np.concatenate([cea[pick], rea])
    eb = np.concatenate([ceb[pick], reb])
    out = _datapath_run(w, ma, mb, s, ea, eb, seed=w)
    _assert_golden(s, ea, eb, ma, mb, w, out)


def test_datapath_holds_without_advance():
    """With ``advance`` low the result and valid bit stay put, however the inputs change."""
    dut = NormalizeDatapath(20)

    async def bench(ctx):
        ctx.set(dut.advance, 1)
        ctx.set(dut.i_valid, 1)
        ctx.set(dut.i_s, -3)
        ctx.set(dut.i_exp_a, EXP_BIAS)
        ctx.set(dut.i_exp_b, EXP_BIAS + 12)  # s * 2**(0 + 12 - 6 - 6): p = -3.0
        await ctx.tick()
        ctx.set(dut.i_valid, 0)
        for _ in range(dut.LATENCY - 1):
            await ctx.tick()
        assert ctx.get(dut.o_valid) == 1
        assert ctx.get(dut.o_result) == 0xC0400000
        ctx.set(dut.advance, 0)
        ctx.set(dut.i_valid, 1)
        ctx.set(dut.i_s, 5)
        for _ in range(3):
            await ctx.tick()
            assert ctx.get(dut.o_valid) == 1
            assert ctx.get(dut.o_result) == 0xC0400000
        ctx.set(dut.advance, 1)
        ctx.set(dut.i_valid, 0)
        await ctx.tick()
        assert ctx.get(dut.o_valid) == 0

    sim = Simulator(dut)
    sim.add_clock(1e-6)
    sim.add_testbench(bench)
    sim.run()


def test_ports():
    w = psum_width(16, 8, 24)
    n = Normalize(w, 16, 8)
    Fragment.get(n, None)  # elaborates
    assert n.LATENCY == NormalizeDatapath.LATENCY
    assert n.i.payload.shape() == normalize_layout(w)
    assert normalize_layout(w).size == w + 2 * EXP_WIDTH
    assert n.o.payload.shape().width == FP32_WIDTH


# A constructor that raises leaves an elaboratable that Amaranth reports as unused.
@pytest.mark.filterwarnings("ignore::amaranth.hdl.UnusedElaboratable")
@pytest.mark.parametrize("cls", [Normalize, NormalizeDatapath])
def test_bad_parameters(cls):
    for bad in [(1, 8, 8), (20, 1, 8), (20, 8, 1)]:
        with pytest.raises(ValueError):
            cls(*bad)
    gc.collect()


@pytest.mark.parametrize("ma, mb, tk", CONFIGS + [(8, 8, 1024)])
def test_verilog_converts(ma, mb, tk):
    text = verilog.convert(Normalize(psum_width(ma, mb, tk), ma, mb), name="normalize")
    assert "module normalize" in text


def _cocotb_config(sim: str, ma: int, mb: int, tk: int) -> dict:
    # Each simulator draws its own random vectors (the corners are the same): 2 x 16k random
    # vectors per configuration in the regular run.
    return {
        "psum_width": psum_width(ma, mb, tk),
        "mantissa_bits_a": ma,
        "mantissa_bits_b": mb,
        "seed": 1 + runner.SIMULATORS.index(sim),
        "random": 200_000 if FULL else 12_000,
        "throughput": 40_000 if FULL else 4_000,
        "stall": 0.3,
    }


@pytest.mark.parametrize("ma, mb, tk", CONFIGS, ids=[f"m{a}x{b}-tk{t}" for a, b, t in CONFIGS])
@pytest.mark.parametrize("sim", runner.SIMULATORS)
def test_normalize_cocotb(sim, ma, mb, tk):
    runner.require(sim)
    w = psum_width(ma, mb, tk)
    tests, failed = runner.run(lambda: Normalize(w, ma, mb), "normalize", "tb_normalize", sim, _cocotb_config(sim, ma, mb, tk))
    assert tests > 0 and failed == 0
