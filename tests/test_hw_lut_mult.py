"""``hbfp.hw.lut_mult.LutMultiplier`` against integer products: every input pair of small
widths (8 x 8: all 2^16), random pairs and the extremes of wide ones; and its construction
from adders only (no ``$mul`` for Yosys to map)."""

import itertools

import numpy as np
import pytest
from amaranth.back import rtlil
from amaranth.sim import Simulator

from hbfp.hw.lut_mult import BoothProduct, LutMultiplier


def products(width_a: int, width_b: int, pairs: list[tuple[int, int]], staged: bool = False) -> list[int]:
    """The multiplier's ``p`` for ``pairs``, one pair a cycle, read ``LATENCY`` cycles later."""
    dut = LutMultiplier(width_a, width_b, staged=staged)
    got: list[int] = []

    async def bench(ctx):
        for t in range(len(pairs) + LutMultiplier.LATENCY):
            if t < len(pairs):
                ctx.set(dut.a, pairs[t][0])
                ctx.set(dut.b, pairs[t][1])
            await ctx.tick()
            if t + 1 >= LutMultiplier.LATENCY:
                got.append(ctx.get(dut.p))

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    return got[: len(pairs)]


def every_pair(width_a: int, width_b: int) -> list[tuple[int, int]]:
    ra = range(-(1 << (width_a - 1)), 1 << (width_a - 1))
    rb = range(-(1 << (width_b - 1)), 1 << (width_b - 1))
    return list(itertools.product(ra, rb))


@pytest.mark.parametrize("staged", [False, True], ids=["registered-operands", "staged"])
@pytest.mark.parametrize("width_a, width_b", [(8, 8), (4, 4), (2, 2), (5, 3), (3, 6), (7, 7), (6, 9)])
def test_every_pair(width_a, width_b, staged):
    pairs = every_pair(width_a, width_b)
    want = [a * b for a, b in pairs]
    got = products(width_a, width_b, pairs, staged)
    bad = [(p, g, w) for p, g, w in zip(pairs, got, want) if g != w]
    assert not bad, f"{len(bad)} of {len(pairs)} products wrong, first: {bad[0]}"


@pytest.mark.parametrize("staged", [False, True], ids=["registered-operands", "staged"])
@pytest.mark.parametrize("width_a, width_b", [(16, 8), (8, 16), (16, 16), (12, 11)])
def test_random_and_extreme_pairs(width_a, width_b, staged):
    rng = np.random.default_rng(width_a * 100 + width_b)
    lo_a, hi_a = -(1 << (width_a - 1)), (1 << (width_a - 1)) - 1
    lo_b, hi_b = -(1 << (width_b - 1)), (1 << (width_b - 1)) - 1
    corners = list(itertools.product([lo_a, lo_a + 1, -1, 0, 1, hi_a], [lo_b, lo_b + 1, -1, 0, 1, hi_b]))
    pairs = corners + list(zip(rng.integers(lo_a, hi_a + 1, 3000).tolist(), rng.integers(lo_b, hi_b + 1, 3000).tolist()))
    assert products(width_a, width_b, pairs, staged) == [a * b for a, b in pairs]


def test_built_from_adders_only():
    """No multiplication for Yosys to infer (and map to a DSP block): the netlist has adders."""
    text = rtlil.convert(BoothProduct(8, 8), name="booth")
    assert "$mul" not in text and "$add" in text


def test_too_narrow():
    with pytest.raises(ValueError, match="at least 2 bits"):
        BoothProduct(1, 8)
