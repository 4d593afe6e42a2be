"""cocotb testbench of ``hbfp.hw.gemm_core.GemmCore`` against ``hbfp.golden.gemm.gemm``.

Each product loads the buffers through the write port, runs one command and compares every
output element bit for bit with the golden model (NaNs included). Products are drawn at
random: shapes up to the buffer size, transposed operands (square tiles), accumulation onto
C, bias, the activation units, and fp32, bf16 and BFP outputs in every rounding mode.
"""

from __future__ import annotations

import random

import cocotb
import numpy as np
from cocotb.triggers import RisingEdge

from hbfp.golden import bf16
from hbfp.golden.bfp import Format, quantize
from hbfp.golden.compare import same_bits_elementwise
from hbfp.golden.gemm import gemm
from hbfp.contract import OutFormat, Target
from hbfp.hw.params import ROUNDING_CODES
from hbfp.sim.runner import record_figure, tb_config
from hbfp.sim.streams import StreamSink, StreamSource, pack, start_clock_and_reset, unpack

UNARY = ("relu", "leaky_relu", "gelu", "sigmoid", "tanh", "exp")


class Core:
    """Packs writes and commands for the DUT from the configuration's widths."""

    def __init__(self, dut, cfg: dict, rng: random.Random, stall: float):
        self.dut, self.cfg = dut, cfg
        self.R, self.C, self.D = cfg["rows"], cfg["cols"], cfg["size"]
        self.th, self.tw = cfg["tile"]
        self.m_bits = cfg["mantissa_bits"]
        self.lanes = max(self.R, self.C)
        self.dim_bits = max(1, (self.D - 1).bit_length())
        self.w = StreamSource(dut, "w", stall=stall, rng=rng)
        self.cmd = StreamSource(dut, "cmd", stall=0.0, rng=rng)
        self.o = StreamSink(dut, "o", stall=stall, rng=random.Random(rng.random()))

    def write_word(self, target: int, row: int, col: int, lanes: list[int]) -> int:
        b = self.dim_bits
        word = target | (row << 3) | (col << (3 + b))
        return word | (pack(lanes, 32) << (3 + 2 * b))

    def operand_writes(self, target_codes, target_exps, t, lanes):
        rows, cols = t.shape
        words = []
        codes = t.codes.astype(np.int64)
        for r in range(rows):
            for c0 in range(0, cols, lanes):
                chunk = [int(v) & ((1 << self.m_bits) - 1) for v in codes[r, c0 : c0 + lanes]]
                words.append(self.write_word(target_codes, r, c0, chunk + [0] * (lanes - len(chunk))))
        for (tr, tc), e in np.ndenumerate(t.exponents):
            words.append(self.write_word(target_exps, tr, tc, [int(e)]))
        return words

    def fp32_writes(self, target, rows_of_values):
        words = []
        for r, vals in enumerate(rows_of_values):
            bits = np.asarray(vals, np.float32).view(np.uint32)
            for c0 in range(0, len(bits), self.C):
                chunk = [int(v) for v in bits[c0 : c0 + self.C]]
                words.append(self.write_word(target, r, c0, chunk + [0] * (self.C - len(chunk))))
        return words

    def command(self, m, n, k, ta, tb, acc, bias, act, out, rounding, seed) -> int:
        fields = [  # (value, width) in command_layout order
            (m, (self.D).bit_length()),
            (n, (self.D).bit_length()),
            (k, (self.D).bit_length()),
            (ta, 1), (tb, 1), (acc, 1), (bias, 1),
            (act is not None, 1),
            (0 if act is None else self.cfg["functions"].index(act), self.cfg["func_width"]),
            (OutFormat.from_label(out), 2),
            (ROUNDING_CODES[rounding], 2),
            (seed, 32),
        ]
        word, shift = 0, 0
        for value, width in fields:
            word |= (int(value) & ((1 << width) - 1)) << shift
            shift += width
        return word


async def run_product(core: Core, rng: np.random.Generator, prod: dict, log) -> int:
    """Load, run and check one product; returns the number of output elements checked."""
    cfg = core.cfg
    m, n, k = prod["m"], prod["n"], prod["k"]
    fmt = Format(cfg["mantissa_bits"], tuple(cfg["tile"]))
    scale_a = np.exp2(rng.integers(-4, 5, (m, 1)))
    a = (rng.standard_normal((m, k)) * scale_a).astype(np.float32)
    b = (rng.standard_normal((k, n)) * np.exp2(rng.integers(-4, 5, (1, n)))).astype(np.float32)
    if prod.get("specials") and k > 0:
        a[rng.integers(0, m), rng.integers(0, k)] = rng.choice([np.inf, -np.inf, np.nan])
        a[rng.integers(0, m)] *= np.float32(2.0**-100)
        b[:, rng.integers(0, n)] = 0
    qa = quantize(a.T if prod["ta"] else a, fmt)
    qb = quantize(b.T if prod["tb"] else b, fmt)
    c = (rng.standard_normal((m, n)) * 4).astype(np.float32) if prod["acc"] else None
    bias = rng.standard_normal(n).astype(np.float32) if prod["bias"] else None
    out_fmt = fmt.with_rounding(prod["rounding"]) if prod["out"] == "bfp" else prod["out"]
    want = gemm(qa, qb, c=c, bias=bias, activation=prod["act"], out=out_fmt,
                transpose_a=bool(prod["ta"]), transpose_b=bool(prod["tb"]), seed=prod["seed"])

    words = core.operand_writes(Target.A_CODES, Target.A_EXPONENTS, qa, core.R)
    words += core.operand_writes(Target.B_CODES, Target.B_EXPONENTS, qb, core.C)
    if c is not None:
        words += core.fp32_writes(Target.ACC, c)
    if bias is not None:
        words += core.fp32_writes(Target.BIAS, [bias])
    await core.w.send(words)
    await core.cmd.send([core.command(m, n, k, prod["ta"], prod["tb"], prod["acc"], prod["bias"], prod["act"],
                                      prod["out"], prod["rounding"], prod["seed"])])
    await RisingEdge(core.dut.clk)
    assert not core.dut.error.value, f"command refused: {prod}"

    E, th, tw = core.cfg["out_lanes"], core.th, core.tw  # E: the output beat's lanes
    if prod["out"] == "bfp":
        tiles_m, tiles_n = -(-m // th), -(-n // tw)
        count = tiles_m * tiles_n * th * (tw // E)
    else:
        count = m * (-(-n // E))
    beats = await core.o.receive(count, timeout_cycles=50_000)
    lasts = [(bt >> (32 * E + 8)) & 1 for bt in beats]
    assert lasts[-1] == 1 and sum(lasts) == 1, f"'last' must mark only the final beat ({prod})"

    if prod["out"] == "bfp":
        codes = np.zeros((tiles_m * th, tiles_n * tw), np.int64)
        exps = np.zeros((tiles_m, tiles_n), np.int64)
        it = iter(beats)
        for ti in range(tiles_m):
            for tj in range(tiles_n):
                for r in range(th):
                    for wd in range(tw // E):
                        bt = next(it)
                        lanes = unpack(bt, 32, E, signed=True)
                        codes[ti * th + r, tj * tw + wd * E : tj * tw + (wd + 1) * E] = lanes
                        exps[ti, tj] = (bt >> (32 * E)) & 0xFF
        ok_e = exps == want.exponents
        ok_c = codes[:m, :n] == want.codes
        if not (ok_e.all() and ok_c.all()):
            bad = np.argwhere(~ok_c)[:5]
            raise AssertionError(
                f"{prod}: {int((~ok_e).sum())} exponent and {int((~ok_c).sum())} code mismatches; "
                + ", ".join(f"({i},{j}) got {codes[i, j]} want {want.codes[i, j]}" for i, j in bad)
            )
        return m * n

    words_per_row = -(-n // E)
    out = np.zeros((m, words_per_row * E), np.uint32)
    for idx, bt in enumerate(beats):
        i, wd = divmod(idx, words_per_row)
        out[i, wd * E : (wd + 1) * E] = unpack(bt, 32, E)
    out = out[:, :n]
    if prod["out"] == "bf16":
        got16 = out.astype(np.uint16)
        want16 = want.view(np.uint16)
        ok = same_bits_elementwise(got16, want16)
        got_f, want_f = bf16.to_f32(got16), bf16.to_f32(want16)
    else:
        got_f, want_f = out.view(np.float32), want
        ok = same_bits_elementwise(got_f, want_f)  # fp32, NaNs' bits too
    if not ok.all():
        bad = np.argwhere(~ok)[:5]
        raise AssertionError(
            f"{prod}: {int((~ok).sum())} of {m * n} outputs differ; "
            + ", ".join(f"({i},{j}) got {got_f[i, j]!r} want {want_f[i, j]!r}" for i, j in bad)
        )
    return m * n


def random_product(rng: random.Random, cfg: dict, full: bool) -> dict:
    D = cfg["size"]
    square = cfg["tile"][0] == cfg["tile"][1]
    big = rng.random() < 0.5
    dim = (lambda: D if rng.random() < 0.5 else rng.randint(D // 2, D)) if big else (lambda: rng.randint(1, D))
    out = rng.choice(["fp32", "fp32", "bf16", "bfp"])
    read_back = rng.random() < 0.05  # K = 0: the accumulator through the epilogue
    return dict(
        m=dim(), n=dim(), k=0 if read_back else dim(),
        ta=rng.randint(0, 1) if square else 0,
        tb=rng.randint(0, 1) if square else 1,
        acc=read_back or rng.random() < 0.3,
        bias=rng.random() < 0.4,
        act=rng.choice([None, None] + [f for f in UNARY if f in cfg["built"]]),
        out=out,
        rounding=rng.choice(["nearest_even", "toward_zero", "stochastic"]) if out == "bfp" else "nearest_even",
        seed=rng.randrange(2**32),
        specials=rng.random() < 0.2,
    )


@cocotb.test()
async def random_products(dut):
    """Random products with random stalls until ``elements`` outputs were compared."""
    cfg = tb_config()
    await start_clock_and_reset(dut, sources=["w", "cmd"], sinks=["o"])
    rng = random.Random(cfg["seed"])
    nrng = np.random.default_rng(cfg["seed"])
    core = Core(dut, cfg, rng, stall=0.2)
    checked, products = 0, 0
    while checked < cfg["elements"]:
        prod = random_product(rng, cfg, cfg.get("full", False))
        checked += await run_product(core, nrng, prod, dut._log)
        products += 1
    dut._log.info(f"{products} products, {checked} output elements equal to the golden model")


@cocotb.test()
async def utilization(dut):
    """A full buffer-sized product with no stalls: cycles against M*N*K / (R*C)."""
    cfg = tb_config()
    await start_clock_and_reset(dut, sources=["w", "cmd"], sinks=["o"])
    core = Core(dut, cfg, random.Random(5), stall=0.0)
    D = cfg["size"]
    square = cfg["tile"][0] == cfg["tile"][1]
    prod = dict(m=D, n=D, k=D, ta=0, tb=0 if square else 1, acc=False, bias=False, act=None, out="fp32",
                rounding="nearest_even", seed=0)
    await run_product(core, np.random.default_rng(5), prod, dut._log)
    cycles = int(dut.cycles.value)
    ideal = D * D * D / (cfg["rows"] * cfg["cols"])
    dut._log.info(f"UTILIZATION {D}x{D}x{D} on {cfg['rows']}x{cfg['cols']}: {cycles} cycles, ideal {ideal:.0f}, "
                  f"utilization {100 * ideal / cycles:.1f}%")
    record_figure({"figure": "utilization", "rows": cfg["rows"], "cols": cfg["cols"], "tile": cfg["tile"],
                   "m": D, "n": D, "k": D, "cycles": cycles, "ideal": ideal, "utilization": ideal / cycles})
    assert ideal / cycles >= 0.9, f"utilization {ideal / cycles:.3f} below 90%"
