"""Quick checks of the GEMM core under Amaranth's own simulator (seconds, no HDL simulator):
small products through the write port, compared with the golden gemm, on a full core and on
a reduced one (no output quantizer, no activation units), which refuses a BFP output. The
cocotb regression (test_hw_gemm_core.py) is the thorough one."""

import numpy as np
import pytest
from amaranth.sim import Simulator

from hbfp.golden import bf16, quantize
from hbfp.golden.gemm import gemm
from hbfp.contract import OutFormat, Target
from hbfp.hw.gemm_core import GemmCore
from hbfp.hw.params import ROUNDING_CODES, CoreConfig

FULL = CoreConfig(rows=4, cols=4, tile=(24, 24), size=48, functions=("relu",))
REDUCED = CoreConfig(rows=2, cols=2, tile=(24, 24), size=24, functions=(), value_quantizer=False, bfp_output=False,
                     stochastic=False)
NO_STOCHASTIC = CoreConfig(rows=2, cols=2, tile=(24, 24), size=24, functions=(), value_quantizer=False,
                           stochastic=False)


def run_commands(cfg: CoreConfig, qa, qb, commands: list[dict]) -> list[dict]:
    """Load A and B, then run each command (``command_layout`` fields); per command the
    output beats' lanes, the ``error`` flag after acceptance and ``busy`` at the end."""
    dut = GemmCore(cfg)
    lanes = max(cfg.rows, cfg.cols)
    results = []

    async def tb(ctx):
        def write(target, row, col, values):
            ctx.set(dut.w.payload.target, target)
            ctx.set(dut.w.payload.row, row)
            ctx.set(dut.w.payload.col, col)
            ctx.set(dut.w.payload.data, [int(v) & 0xFFFFFFFF for v in values] + [0] * (lanes - len(values)))

        ctx.set(dut.w.valid, 1)
        for t, codes, exps, step in ((qa, Target.A_CODES, Target.A_EXPONENTS, cfg.rows),
                                     (qb, Target.B_CODES, Target.B_EXPONENTS, cfg.cols)):
            for r in range(t.shape[0]):
                for c0 in range(0, t.shape[1], step):
                    write(codes, r, c0, [int(v) & 0xFF for v in t.codes[r, c0 : c0 + step]])
                    await ctx.tick()
            for (tr, tc), e in np.ndenumerate(t.exponents):
                write(exps, tr, tc, [int(e)])
                await ctx.tick()
        ctx.set(dut.w.valid, 0)
        ctx.set(dut.o.ready, 1)
        for command in commands:
            for name, value in command.items():
                ctx.set(getattr(dut.cmd.payload, name), value)
            ctx.set(dut.cmd.valid, 1)
            await ctx.tick()
            ctx.set(dut.cmd.valid, 0)
            beats, exponents = [], []
            for _ in range(20_000):
                if ctx.get(dut.error) or not ctx.get(dut.busy):
                    break
                if ctx.get(dut.o.valid):
                    beats.append([int(x) for x in ctx.get(dut.o.payload.lanes)])
                    exponents.append(ctx.get(dut.o.payload.exponent))
                    if ctx.get(dut.o.payload.last):
                        await ctx.tick()  # the last beat is taken at this edge; the core is then idle
                        break
                await ctx.tick()
            results.append({"beats": beats, "exponents": exponents, "error": ctx.get(dut.error),
                            "busy": ctx.get(dut.busy), "cycles": ctx.get(dut.cycles)})

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(tb)
    sim.run()
    return results


def operands(m: int, n: int, k: int):
    rng = np.random.default_rng(m * 100 + n * 10 + k)
    qa = quantize(rng.standard_normal((m, k)).astype(np.float32))
    qb = quantize(rng.standard_normal((k, n)).astype(np.float32))
    return qa, qb


def as_matrix(beats, m: int, n: int, dtype) -> np.ndarray:
    out = np.array(beats, dtype=np.uint32).reshape(m, -1)[:, :n]
    return out.astype(np.uint16) if dtype == "bf16" else out


@pytest.mark.parametrize("cfg", [FULL, REDUCED], ids=["full", "reduced"])
def test_small_product_equals_golden(cfg):
    m, n, k = (10, 7, 30) if cfg is FULL else (5, 3, 20)
    qa, qb = operands(m, n, k)
    res = run_commands(cfg, qa, qb, [dict(m=m, n=n, k=k, out_format=OutFormat.FP32),
                                     dict(m=m, n=n, k=0, out_format=OutFormat.BF16)])
    assert [r["error"] for r in res] == [0, 0] and [r["busy"] for r in res] == [0, 0]
    assert len(res[0]["beats"]) == m * -(-n // cfg.out_lanes)
    assert np.array_equal(as_matrix(res[0]["beats"], m, n, "fp32"), gemm(qa, qb).view(np.uint32))
    # K = 0 reads the accumulator back as bf16: the golden product rounded to bf16.
    assert np.array_equal(as_matrix(res[1]["beats"], m, n, "bf16"), bf16.from_f32(gemm(qa, qb)))


def test_reduced_core_refuses_what_it_lacks():
    """Without an output quantizer a BFP command is an error (no output, idle again) and the
    core still serves the next command; without stochastic rounding only a stochastic BFP
    output is refused."""
    m, n, k = 4, 3, 24
    qa, qb = operands(m, n, k)
    bfp, fp32 = OutFormat.BFP, OutFormat.FP32
    stochastic = ROUNDING_CODES["stochastic"]
    res = run_commands(REDUCED, qa, qb, [dict(m=m, n=n, k=k, out_format=bfp),
                                         dict(m=m, n=n, k=k, out_format=fp32, rounding=stochastic)])
    assert (res[0]["beats"], res[0]["error"], res[0]["busy"]) == ([], 1, 0)
    assert res[1]["error"] == 0 and np.array_equal(as_matrix(res[1]["beats"], m, n, "fp32"),
                                                    gemm(qa, qb).view(np.uint32))
    res = run_commands(NO_STOCHASTIC, qa, qb, [dict(m=m, n=n, k=k, out_format=bfp, rounding=stochastic),
                                               dict(m=m, n=n, k=k, out_format=bfp, rounding=0)])
    assert (res[0]["beats"], res[0]["error"], res[0]["busy"]) == ([], 1, 0)
    want = gemm(qa, qb, out=qa.fmt)
    assert res[1]["error"] == 0
    # One tile, tile-major, out_lanes a beat; codes sign-extended in the 32-bit lanes.
    codes = np.array(res[1]["beats"], dtype=np.uint32).view(np.int32).reshape(24, 24)[:m, :n]
    assert np.array_equal(codes, want.codes)


#: Array shapes beyond the defaults: rows and columns not powers of two, rectangular, columns
#: that do not divide the tile, several output lanes, accumulate lanes shared by columns.
SHAPES = {
    "6x3": CoreConfig(rows=6, cols=3, tile=(12, 12), size=24, functions=()),
    "3x6-e3": CoreConfig(rows=3, cols=6, tile=(24, 24), size=48, functions=("relu",), out_lanes=3),
    "4x16-e8": CoreConfig(rows=4, cols=16, tile=(24, 24), size=48, functions=()),
    "4x4-l1": CoreConfig(rows=4, cols=4, tile=(24, 24), size=48, functions=("relu",), acc_lanes=1),
    "3x6-l2-e3": CoreConfig(rows=3, cols=6, tile=(24, 24), size=48, functions=(), acc_lanes=2, out_lanes=3),
}


@pytest.mark.parametrize("name", SHAPES)
def test_any_array_shape_equals_golden_and_emus_cycle_count(name):
    """fp32 products, a READ and a BFP output on each shape, bit for bit against the golden
    model, and each command's ``cycles`` equal to ``emu``'s count (``command_cycles``)."""
    from hbfp.host.emu import command_cycles

    cfg = SHAPES[name]
    m, n, k = 13, cfg.size - 1, cfg.size // 2 + 1
    rng = np.random.default_rng(len(name))
    qa = quantize(rng.standard_normal((m, k)).astype(np.float32), cfg.fmt())
    qb = quantize(rng.standard_normal((k, n)).astype(np.float32), cfg.fmt())
    commands = [dict(m=m, n=n, k=k, out_format=OutFormat.FP32), dict(m=m, n=n, k=0, out_format=OutFormat.FP32),
                dict(m=m, n=n, k=k, out_format=OutFormat.BFP)]
    res = run_commands(cfg, qa, qb, commands)
    assert [r["error"] for r in res] == [0, 0, 0]
    for c, r in zip(commands, res):
        assert r["cycles"] == command_cycles(cfg, c["m"], c["n"], c["k"]), (name, c)
    want = gemm(qa, qb).view(np.uint32)
    assert np.array_equal(as_matrix(res[0]["beats"], m, n, "fp32"), want)
    assert np.array_equal(as_matrix(res[1]["beats"], m, n, "fp32"), want)
    # BFP: tile-major, tw / out_lanes beats a tile row; every beat carries its tile's exponent.
    th, tw = cfg.tile
    tm, tn = -(-m // th), -(-n // tw)
    tiles = np.array(res[2]["beats"], dtype=np.uint32).view(np.int32).reshape(tm, tn, th, tw)
    exps = np.array(res[2]["exponents"]).reshape(tm, tn, -1)
    want_bfp = gemm(qa, qb, out=cfg.fmt())
    assert np.array_equal(tiles.transpose(0, 2, 1, 3).reshape(tm * th, tn * tw)[:m, :n], want_bfp.codes)
    assert (exps == want_bfp.exponents[:, :, None]).all()
