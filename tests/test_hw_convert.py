"""The fp32 <-> bf16 converters of the epilogue against the golden model (Amaranth's
simulator: they are combinational)."""

import numpy as np
from amaranth import Module, Signal
from amaranth.sim import Simulator

from hbfp.golden import bf16
from hbfp.hw import convert


def run_comb(fn, width_in, width_out, values):
    m = Module()
    a, y = Signal(width_in), Signal(width_out)
    m.d.comb += y.eq(fn(a))
    out = []

    async def tb(ctx):
        for v in values:
            ctx.set(a, int(v))
            out.append(ctx.get(y))

    sim = Simulator(m)
    sim.add_testbench(tb)
    sim.run()
    return np.array(out, dtype=np.uint64)


def test_from_f32_equals_golden():
    rng = np.random.default_rng(0)
    corners = [0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00800000, 0x007FFFFF,
               0x80000001, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFC12345, 0, 0x80000000]
    u = np.concatenate([rng.integers(0, 1 << 32, 3000, dtype=np.uint64), corners]).astype(np.uint32)
    got = run_comb(convert.from_f32, 32, 16, u)
    assert np.array_equal(got.astype(np.uint16), bf16.from_f32(u.view(np.float32)))


def test_to_f32_equals_golden_on_every_pattern():
    b = np.arange(1 << 16, dtype=np.uint32)[::7].astype(np.uint16)
    got = run_comb(convert.to_f32, 16, 32, b)
    want = bf16.to_f32(b).view(np.uint32)
    assert np.array_equal(got.astype(np.uint32), want)


def test_flush_f32_equals_golden():
    rng = np.random.default_rng(1)
    u = np.concatenate([rng.integers(0, 1 << 32, 2000, dtype=np.uint64), [1, 0x807FFFFF, 0x00800000, 0, 0x80000000]]).astype(np.uint32)
    got = run_comb(convert.flush_f32, 32, 32, u)
    assert np.array_equal(got.astype(np.uint32), bf16.flush_f32(u.view(np.float32)).view(np.uint32))
