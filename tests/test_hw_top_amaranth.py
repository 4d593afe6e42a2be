"""The accelerator top (``hbfp.hw.top.AcceleratorTop``) on rectangular arrays, in Amaranth's
own simulator (seconds, no HDL simulator), against ``emu`` (``hbfp.host.emu.EmuDevice``, the
device's model): the same request frames must give the same reply bytes.

Two arrays the packet engine once refused: 16 x 8 (A's codes in row chunks of 16, B's, the
accumulator's and the bias's of 8; the input quantizer's beats of 8 values write half of an
A chunk), and 6 x 8 with 12 x 12 tiles (rows not a power of two, cols not dividing the tile:
the quantizer's beats of 6 values fill A's chunks and part of B's). Each gets every WRITE
target (codes, exponents, values in fp32 and bf16 with nearest, toward-zero and stochastic
rounding, accumulator, bias; whole buffers and regions inside them), WRITEs misaligned for
one operand's chunks but not the other's (BAD_ADDRESS, as emu refuses them), GEMMs in every
output format (their replies carry the cycles), READs of the whole accumulator, and STATUS.
The cocotb and Verilator runs of such arrays: tests/test_emu_gateware.py (make sim-full).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from amaranth.sim import Simulator

from hbfp.contract import CoreConfig
from hbfp.golden import bf16
from hbfp.host import protocol as P
from hbfp.host.emu import EmuDevice
from hbfp.host.protocol import Op, OutFormat, Status, Target
from hbfp.hw.activation import FUNCTIONS
from hbfp.hw.packet import value_lanes
from hbfp.hw.top import AcceleratorTop

NEAREST, TOWARD_ZERO, STOCHASTIC = (P.ROUNDING_CODES[r] for r in ("nearest_even", "toward_zero", "stochastic"))

#: name: (CoreConfig, stream_bytes, max_payload). A payload holds the whole accumulator; the
#: epilogue's lanes are those the ``sim`` backend gives the link (``default_out_lanes``).
CONFIGS = {
    "16x8": (CoreConfig(16, 8, 8, (16, 16), 32, functions=("relu",), out_lanes=4), 16, 4200),
    "6x8": (CoreConfig(6, 8, 8, (12, 12), 24, functions=("relu",), out_lanes=2), 8, 2400),
}
FRAME_TIMEOUT = 5000
RELU = FUNCTIONS.index("relu")
CLOCK_HZ = 12_345_678


def _codes(rng, shape, cfg):
    qmax = 2 ** (cfg.mantissa_bits - 1) - 1
    return P.encode_codes(rng.integers(-qmax, qmax + 1, size=shape), cfg.mantissa_bits)


def _values(rng, rows, cols, cfg, encoding):
    """rows x cols values of mixed magnitudes, tile-major, fp32 or bf16 bytes."""
    x = (rng.standard_normal((rows, cols)) * np.exp2(rng.integers(-8, 8, size=(rows, cols)))).astype(np.float32)
    x[rng.random((rows, cols)) < 0.05] = 0.0
    flat = P.to_tile_major(x, cfg.tile)
    if encoding == P.Encoding.FP32:
        return flat.astype("<f4").tobytes()
    return bf16.from_f32(flat).astype("<u2").tobytes()


def requests(cfg: CoreConfig, rng: np.random.Generator) -> list[tuple[str, bytes]]:
    """(what, request frame) pairs; each frame's reply is compared with emu's."""
    D, R, C = cfg.size, cfg.rows, cfg.cols
    th, tw = cfg.tile
    out = []

    def frame(what, opcode, payload=b""):
        out.append((what, P.encode_frame(opcode, len(out) + 1, payload)))

    def write(what, target, row, col, rows, cols, data, **kw):
        frame(f"WRITE {what}", Op.WRITE, P.encode_write(target, row, col, rows, cols, data, **kw))

    frame("IDENTIFY", Op.IDENTIFY)
    # Whole buffers: A's codes go R to a chunk, B's C.
    write("A codes", Target.A_CODES, 0, 0, D, D, _codes(rng, (D, D), cfg))
    write("B codes", Target.B_CODES, 0, 0, D, D, _codes(rng, (D, D), cfg))
    for target in (Target.A_EXPONENTS, Target.B_EXPONENTS):
        exps = rng.integers(120, 134, size=(D // th, D // tw)).astype(np.uint8)
        write(target.name, target, 0, 0, D // th, D // tw, exps.tobytes())
    write("ACC", Target.ACC, 0, 0, D, D, (rng.standard_normal((D, D)) * 4).astype("<f4").tobytes())
    write("BIAS", Target.BIAS, 0, 0, 1, D, rng.standard_normal(D).astype("<f4").tobytes())
    # Regions inside the buffers, at the chunk sides' multiples.
    write("A codes region", Target.A_CODES, 3, R, 5, D - R, _codes(rng, (5, D - R), cfg))
    write("B codes region", Target.B_CODES, 1, C, 7, C, _codes(rng, (7, C), cfg))
    write("ACC region", Target.ACC, 2, C, 3, C, rng.standard_normal((3, C)).astype("<f4").tobytes())
    write("BIAS region", Target.BIAS, 0, D - C, 1, C, rng.standard_normal(C).astype("<f4").tobytes())
    # Columns off a chunk's (or the tile's) grid, each the other operand's chunk where that is
    # off too, so the sides' two rules are told apart: refused (BAD_ADDRESS), as emu does.
    def off(step, other):
        return other if other % step else 1

    a_off, b_off = off(R, C), off(C, R)
    write("A codes off the chunks", Target.A_CODES, 0, a_off, 1, R, _codes(rng, (1, R), cfg))
    write("A codes of part of a chunk", Target.A_CODES, 0, 0, 1, a_off, _codes(rng, (1, a_off), cfg))
    write("B codes off the chunks", Target.B_CODES, 0, b_off, 1, C, _codes(rng, (1, C), cfg))
    write("B codes of part of a chunk", Target.B_CODES, 0, 0, 1, b_off, _codes(rng, (1, b_off), cfg))
    write("ACC off the chunks", Target.ACC, 0, b_off, 1, C, bytes(4 * C))
    write("BIAS of part of a chunk", Target.BIAS, 0, 0, 1, b_off, bytes(4 * b_off))
    v_off = off(tw, R)
    write("A values off the tile grid", Target.A_VALUES, 0, v_off, th, tw, bytes(4 * th * tw))
    write("B values of part of a tile", Target.B_VALUES, 0, 0, th, off(tw, C), bytes(4 * th * off(tw, C)))
    write("A codes beyond the buffer", Target.A_CODES, D, 0, 1, R, _codes(rng, (1, R), cfg))
    # B's chunks where A's are off, and the other way round: accepted.
    write("B codes at A's off column", Target.B_CODES, 4, C * (R // C + 1), 2, C, _codes(rng, (2, C), cfg))
    # A product over all of it: every code, exponent, accumulator and bias element written.
    frame(f"GEMM {D}x{D}x{D} onto the accumulator", Op.GEMM, P.encode_gemm(D, D, D, accumulate=True, bias=True))
    # Values, quantized on the device: nearest, toward zero and stochastic; fp32 and bf16.
    for target, (row, col, rows, cols), encoding, rounding in (
            (Target.A_VALUES, (0, 0, D, D), P.Encoding.FP32, NEAREST),
            (Target.B_VALUES, (0, 0, D, D), P.Encoding.BF16, STOCHASTIC),
            (Target.A_VALUES, (th, tw, th, D - tw), P.Encoding.BF16, TOWARD_ZERO),
            (Target.B_VALUES, (th, 0, th, tw), P.Encoding.FP32, STOCHASTIC)):
        write(f"{target.name} {rows}x{cols} at ({row}, {col}) {encoding.name} rounding {rounding}", target,
              row, col, rows, cols, _values(rng, rows, cols, cfg, encoding), encoding=encoding,
              rounding=rounding, seed=int(rng.integers(0, 2**32)))
    # Products in every output format (the reply's cycles included; A's values all read by the
    # first, B's by the second), then the accumulator (the padding beyond M and N included).
    for m, n, k, kw in (
            (D, C + 3, D, dict(out_format=OutFormat.BF16, accumulate=True, activation=RELU)),
            (th - 1, D, D, dict(out_format=OutFormat.BFP, rounding=STOCHASTIC, seed=0xC0FFEE, transpose_a=True)),
            (R + 1, tw - 2, D - 1, dict(out_format=OutFormat.BFP, bias=True, transpose_b=True, accumulate=True))):
        frame(f"GEMM {m}x{n}x{k} {kw}", Op.GEMM, P.encode_gemm(m, n, k, **kw))
    frame(f"READ {D}x{D}", Op.READ, P.encode_read(D, D))
    frame("READ BFP", Op.READ, P.encode_read(th, D - 3, out_format=OutFormat.BFP, rounding=STOCHASTIC, seed=7))
    frame("STATUS", Op.STATUS)
    return out


def gateware_replies(top: AcceleratorTop, frames: list[bytes], seed: int) -> list[bytes]:
    """Each frame's reply from the top in Amaranth's simulator: the frame goes in beats of
    random sparse ``keep`` with idle cycles, the reply comes out under random backpressure."""
    N = top.stream_bytes
    rng = random.Random(seed)
    replies = []

    async def bench(ctx):
        parser = P.FrameParser()
        for f in frames:
            pos, got, raw, idle = 0, [], b"", 0
            beat = None
            while not got:
                if beat is None and pos < len(f) and rng.random() < 0.95:
                    lanes = sorted(rng.sample(range(N), min(N, rng.randint(1, N), len(f) - pos)))
                    data = [rng.randrange(256) for _ in range(N)]
                    for t, lane in enumerate(lanes):
                        data[lane] = f[pos + t]
                    beat = (data, sum(1 << lane for lane in lanes), len(lanes))
                ctx.set(top.i.valid, beat is not None)
                if beat is not None:
                    ctx.set(top.i.payload, {"data": beat[0], "keep": beat[1]})
                ready = rng.random() < 0.9
                ctx.set(top.o.ready, ready)
                if beat is not None and ctx.get(top.i.ready):
                    pos += beat[2]
                    beat = None
                if ready and ctx.get(top.o.valid):
                    keep, data = ctx.get(top.o.payload.keep), ctx.get(top.o.payload.data)
                    chunk = bytes(data[b] for b in range(N) if keep >> b & 1)
                    raw += chunk
                    got = parser.feed(chunk)
                    idle = 0
                await ctx.tick()
                idle += 1
                assert idle < 20_000, f"no reply to frame {len(replies)}"
            ctx.set(top.i.valid, 0)
            replies.append(raw)

    sim = Simulator(top)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    return replies


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rectangular_top_equals_emu(name):
    cfg, stream_bytes, max_payload = CONFIGS[name]
    assert value_lanes(cfg, stream_bytes) < max(cfg.rows, cfg.cols)  # partial chunk writes on the way in
    rng = np.random.default_rng(cfg.rows * 100 + cfg.cols)
    table = requests(cfg, rng)
    spec = dict(stream_bytes=stream_bytes, clock_hz=CLOCK_HZ, max_payload=max_payload, frame_timeout=FRAME_TIMEOUT)
    emu = EmuDevice(cfg, **spec)
    want = []
    for _, f in table:
        emu.write(f)
        want.append(emu.read())
    top = AcceleratorTop(cfg, **spec)
    got = gateware_replies(top, [f for _, f in table], seed=cfg.rows)
    statuses = {}
    for (what, _), e, s in zip(table, want, got):
        assert s == e, f"{name} {what}: gateware {s[:32].hex()}.. ({len(s)} bytes), emu {e[:32].hex()}.. ({len(e)} bytes)"
        statuses[what] = e[P.HEADER.size]
    # The table exercises both sides of the alignment rules (emu decides which side is which).
    refused = {w for w, st in statuses.items() if st != Status.OK}
    assert all(st == Status.BAD_ADDRESS for w, st in statuses.items() if w in refused)
    assert len(refused) == 9 and all(w.startswith("WRITE") for w in refused)
