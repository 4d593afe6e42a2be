"""A quick check of the GEMM core under Amaranth's own simulator (seconds, no HDL
simulator): one small product through the write port, compared with the golden gemm. The
cocotb regression (test_hw_gemm_core.py) is the thorough one."""

import numpy as np
from amaranth.sim import Simulator

from hbfp.golden import quantize
from hbfp.golden.gemm import gemm
from hbfp.hw.gemm_core import TARGETS, GemmCore
from hbfp.hw.params import CoreConfig


def test_small_product_equals_golden():
    cfg = CoreConfig(rows=4, cols=4, tile=(24, 24), size=48, functions=("relu",))
    dut = GemmCore(cfg)
    m, n, k = 10, 7, 30
    rng = np.random.default_rng(0)
    qa = quantize(rng.standard_normal((m, k)).astype(np.float32))
    qb = quantize(rng.standard_normal((k, n)).astype(np.float32))
    want = gemm(qa, qb)
    got, done = [], {}

    async def tb(ctx):
        def write(target, row, col, lanes):
            ctx.set(dut.w.payload.target, target)
            ctx.set(dut.w.payload.row, row)
            ctx.set(dut.w.payload.col, col)
            ctx.set(dut.w.payload.data, [int(v) & 0xFFFFFFFF for v in lanes] + [0] * (4 - len(lanes)))

        ctx.set(dut.w.valid, 1)
        for t, codes, exps in ((qa, TARGETS["a_codes"], TARGETS["a_exponents"]), (qb, TARGETS["b_codes"], TARGETS["b_exponents"])):
            for r in range(t.shape[0]):
                for c0 in range(0, t.shape[1], 4):
                    write(codes, r, c0, [int(v) & 0xFF for v in t.codes[r, c0 : c0 + 4]])
                    await ctx.tick()
            for (tr, tc), e in np.ndenumerate(t.exponents):
                write(exps, tr, tc, [int(e)])
                await ctx.tick()
        ctx.set(dut.w.valid, 0)
        ctx.set(dut.cmd.payload.m, m)
        ctx.set(dut.cmd.payload.n, n)
        ctx.set(dut.cmd.payload.k, k)
        ctx.set(dut.cmd.valid, 1)
        await ctx.tick()
        ctx.set(dut.cmd.valid, 0)
        ctx.set(dut.o.ready, 1)
        for _ in range(2000):
            await ctx.tick()
            if ctx.get(dut.o.valid):
                got.append([int(x) for x in ctx.get(dut.o.payload.lanes)])
                if ctx.get(dut.o.payload.last):
                    break
        await ctx.tick()  # the last beat is taken at this edge; the core is then idle
        done["busy"] = ctx.get(dut.busy)

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(tb)
    sim.run()
    assert len(got) == m * 2 and done["busy"] == 0
    out = np.array(got, dtype=np.uint32).reshape(m, -1)[:, :n]
    assert np.array_equal(out, want.view(np.uint32))
