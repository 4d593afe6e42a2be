"""``hbfp.hw.packet.CommandCheck``'s reply size (``result_bytes``), in Amaranth's simulator,
against the host's ``protocol.result_size`` (what the host reads and emu sends), for the
formats whose tiles are square and those of one row (MXINT8's 1 x 32 blocks: a side of one tile
count is then narrower than the other, which the size's multiplier once refused to elaborate)
at the default buffer side.
"""

from __future__ import annotations

import random

import pytest
from amaranth.sim import Simulator

from hbfp.contract import CoreConfig
from hbfp.host import protocol as P
from hbfp.host.protocol import Op, OutFormat
from hbfp.hw.packet import CommandCheck

CONFIGS = {
    "MXINT8 96": CoreConfig(4, 4, 8, (1, 32), 96),
    "HBFP8 96": CoreConfig(8, 8, 8, (24, 24), 96),
    "HBFP16 12x12 48": CoreConfig(6, 8, 16, (12, 12), 48),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_result_bytes_are_the_hosts_result_size(name):
    cfg = CONFIGS[name]
    D = cfg.size
    rng = random.Random(name)
    sides = sorted({1, 2, D - 1, D, *cfg.tile, *(t + 1 for t in cfg.tile if t < D)} & set(range(1, D + 1)))
    cases = [(m, n, f) for m in sides for n in sides for f in OutFormat]
    cases += [(rng.randint(1, D), rng.randint(1, D), rng.choice(list(OutFormat))) for _ in range(60)]
    dut = CommandCheck(cfg)
    seen = []

    async def bench(ctx):
        ctx.set(dut.frame.head.opcode, Op.GEMM)
        for m, n, fmt in cases:
            desc = P.encode_gemm(m, n, 1, transpose_b=not cfg.square, out_format=fmt)  # as one-row tiles need
            ctx.set(dut.frame.desc, int.from_bytes(desc, "little"))
            await ctx.tick().repeat(4)
            seen.append((m, n, fmt, ctx.get(dut.ok), ctx.get(dut.result_bytes)))

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    for m, n, fmt, ok, got in seen:
        assert ok, (m, n, fmt)
        assert got == P.result_size(m, n, fmt, cfg.mantissa_bits, cfg.tile), (name, m, n, OutFormat(fmt).name, got)
