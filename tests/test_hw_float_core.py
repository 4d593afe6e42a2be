"""The floating-point reference core (``hbfp.hw.float_core.FloatCore``, the density
comparison's fp16/bf16 core) under Amaranth's simulator, bit for bit against its golden
composition (``float_core.reference``: ``float_mac`` per K-tile, accumulated with
``add_f32``), with C, a bias and both operand formats."""

from dataclasses import replace

import numpy as np
import pytest
from amaranth.sim import Simulator

from hbfp.contract import OutFormat, Target
from hbfp.golden import bf16
from hbfp.golden.compare import same_bits
from hbfp.hw.float_core import FloatCore, reference
from hbfp.hw.params import CoreConfig

CFG = CoreConfig(rows=2, cols=3, tile=(12, 12), size=24, functions=(), bfp_output=False, value_quantizer=False,
                 stochastic=False)


def patterns(x: np.ndarray, fmt: str) -> np.ndarray:
    """16-bit patterns of float32 values: bf16 (RNE) or IEEE fp16."""
    if fmt == "bf16":
        return bf16.from_f32(x.astype(np.float32))
    return x.astype(np.float16).view(np.uint16)


def run(cfg, fmt, a, b, c, bias, m, n, k):
    dut = FloatCore(cfg, fmt)
    lanes = max(cfg.rows, cfg.cols)
    out = {}

    async def tb(ctx):
        def write(target, row, col, values):
            ctx.set(dut.w.payload.target, target)
            ctx.set(dut.w.payload.row, row)
            ctx.set(dut.w.payload.col, col)
            ctx.set(dut.w.payload.data, [int(v) for v in values] + [0] * (lanes - len(values)))
            ctx.set(dut.w.payload.skip, 0)

        ctx.set(dut.w.valid, 1)
        for t, target, step in ((a, Target.A_CODES, cfg.rows), (b, Target.B_CODES, cfg.cols)):
            for r in range(t.shape[0]):
                for c0 in range(0, t.shape[1], step):
                    chunk = [int(v) for v in t[r, c0:c0 + step]]
                    write(target, r, c0, chunk + [0] * (step - len(chunk)))
                    await ctx.tick()
        for r in range(m):
            for c0 in range(0, n, cfg.cols):
                chunk = [int(v) for v in c[r, c0:c0 + cfg.cols].view(np.uint32)]
                write(Target.ACC, r, c0, chunk + [0] * (cfg.cols - len(chunk)))
                await ctx.tick()
        for c0 in range(0, n, cfg.cols):
            chunk = [int(v) for v in bias[c0:c0 + cfg.cols].view(np.uint32)]
            write(Target.BIAS, 0, c0, chunk + [0] * (cfg.cols - len(chunk)))
            await ctx.tick()
        ctx.set(dut.w.valid, 0)
        ctx.set(dut.o.ready, 1)
        for name, value in dict(m=m, n=n, k=k, out_format=OutFormat.FP32, accumulate=1, bias=1).items():
            ctx.set(getattr(dut.cmd.payload, name), value)
        ctx.set(dut.cmd.valid, 1)
        await ctx.tick()
        ctx.set(dut.cmd.valid, 0)
        assert not ctx.get(dut.error)
        beats = []
        for _ in range(50_000):
            if ctx.get(dut.o.valid):
                beats.append([int(x) for x in ctx.get(dut.o.payload.lanes)])
                if ctx.get(dut.o.payload.last):
                    break
            await ctx.tick()
        out["beats"] = beats

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(tb)
    sim.run()
    return np.array(out["beats"], dtype=np.uint32).reshape(m, -1)[:, :n].view(np.float32)


# DSP products (``*``), Booth LUT products (the density experiment's LUT-only cores), both.
@pytest.mark.parametrize("fmt, dsp_macs", [("bf16", None), ("fp16", None), ("fp16", 0), ("bf16", 3)])
def test_float_core_equals_its_golden_composition(fmt, dsp_macs):
    m, n, k = 5, 17, 20  # 6 column-blocks (two runs of 5 groups, the second mostly beyond N), 2 K-tiles
    rng = np.random.default_rng(3)
    a = patterns(rng.standard_normal((m, k)), fmt)
    b = patterns(rng.standard_normal((k, n)), fmt)
    a[0, 0] = patterns(np.array([np.inf]), fmt)[0]  # an inf and a NaN take their paths too
    b[3, 4] = 0x7E01 if fmt == "fp16" else 0x7FC1
    c = rng.standard_normal((m, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    got = run(replace(CFG, dsp_macs=dsp_macs), fmt, a, b, c, bias, m, n, k)
    want = bf16.add_f32(reference(a, b, fmt, CFG.tk, c=c), bias[None, :])
    assert same_bits(got, want)
