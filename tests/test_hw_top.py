"""The accelerator top (``hbfp.hw.top.AcceleratorTop``) through the wire protocol, in cocotb
on both simulators against the golden model (sim/tb_top.py); and its elaboration checks."""

import os
import random
import struct
import zlib

import pytest
from amaranth.sim import Simulator

from hbfp.hw.params import CoreConfig
from hbfp.hw.top import AcceleratorTop
from hbfp.sim import runner

# name: (array side, mantissa bits, tile, buffer size, stream_bytes, max_payload, simulators).
# "bytes1": a 2x2 core with 12-bit codes (two bytes each on the wire) and 12x12 tiles;
# "bytes4": a 4x4 HBFP8 core with 24x24 tiles; "mxint8": a 4x4 core with the non-square
# 1x32 tile, on a 2-byte link, on Icarus only (its build is free); "bytes16": the 4x4 HBFP8
# core on a 16-byte link (payloads N bytes a cycle each way). Each max_payload holds a
# tile of fp32 values and is no power of two. Reduced devices (UNITS below): "reduced", a
# 2x2 HBFP8 core with none of the optional units; "nostoch", a 4x4 core with 6-bit codes
# and 16x16 tiles on a 3-byte link whose quantizers round only to nearest and toward zero.
# make test runs the 1-byte link and the reduced device under Verilator only (their Icarus
# runs, about a minute each, come with make sim-full), the 16-byte link under Verilator and
# "nostoch" under Icarus; the 4-byte link and the MXINT8 device (whose quantizer and core
# make test checks on both simulators on their own) come with make sim-full.
FULL = os.environ.get("HBFP_SIM_FULL") == "1"
BOTH_IF_FULL = runner.SIMULATORS if FULL else ("verilator",)
LINKS = {
    "bytes1": (2, 12, (12, 12), 24, 1, 700, BOTH_IF_FULL),
    "bytes4": (4, 8, (24, 24), 48, 4, 3000, runner.SIMULATORS if FULL else ()),
    "mxint8": (4, 8, (1, 32), 64, 2, 600, ("icarus",) if FULL else ()),
    "bytes16": (4, 8, (24, 24), 48, 16, 2500, ("verilator",)),
    "reduced": (2, 8, (24, 24), 24, 1, 2340, BOTH_IF_FULL),
    "nostoch": (4, 6, (16, 16), 32, 3, 1100, ("icarus",)),
}
# The CoreConfig fields of the reduced devices (the others are full: every unit, FUNCTIONS).
UNITS = {
    "reduced": dict(value_quantizer=False, bfp_output=False, stochastic=False, functions=()),
    "nostoch": dict(stochastic=False, functions=("relu",)),
}
# Icarus compiles any design in seconds, so its cores carry a table activation (gelu) and its
# gradient; a table unit in each activation lane doubles Verilator's C++ build, so its cores
# have the comparator ones.
FUNCTIONS = {
    "icarus": ("relu", "gelu", "relu_grad", "gelu_grad"),
    "verilator": ("relu", "leaky_relu", "relu_grad", "leaky_relu_grad"),
}
FRAME_TIMEOUT = 256
# Products per run and their largest side (None: the buffer's). Icarus runs this design
# about ten times slower than Verilator. Products rotate through the output formats and the
# ways to load A and B (sim/tb_top.py), and bad_frames adds one: three cover them all.
PRODUCTS = {"verilator": (6, None), "icarus": (2, 16)}
ELEMENTWISE = {"verilator": 200, "icarus": 40}


def core_config(sim: str, name: str) -> CoreConfig:
    side, bits, tile, size, *_ = LINKS[name]
    units = {"functions": FUNCTIONS[sim], **UNITS.get(name, {})}
    return CoreConfig(side, side, bits, tile, size, **units)


def tb_config(sim: str, name: str) -> dict:
    *_, stream_bytes, max_payload, _ = LINKS[name]
    products, side = PRODUCTS[sim]
    cfg = core_config(sim, name)
    d = cfg.to_dict()  # value_quantizer, bfp_output, stochastic, functions among them
    d.update(
        built=list(cfg.built_functions),
        stream_bytes=stream_bytes,
        clock_hz=50_000_000,
        max_payload=max_payload,
        frame_timeout=FRAME_TIMEOUT,
        seed=stream_bytes * 7 + len(sim),
        stall=0.3,
        products=products,
        max_side=min(cfg.size, side or cfg.size),
        elementwise_count=ELEMENTWISE[sim],
    )
    return d


def make_top(sim: str, name: str) -> AcceleratorTop:
    *_, stream_bytes, max_payload, _ = LINKS[name]
    return AcceleratorTop(core_config(sim, name), stream_bytes=stream_bytes, clock_hz=50_000_000,
                          frame_timeout=FRAME_TIMEOUT, max_payload=max_payload)


@pytest.mark.parametrize(("name", "sim"), [(name, sim) for name, link in LINKS.items() for sim in link[-1]])
def test_top_protocol(name, sim):
    runner.require(sim)
    tests, failed = runner.run(lambda: make_top(sim, name), "top", "tb_top", sim, tb_config(sim, name))
    assert tests == 5 and failed == 0


def test_top_takes_any_array_shape():
    """Rectangular arrays, sides no power of two, columns not dividing the tile: the top and
    ``hbfp verilog``'s component list take them (their replies: tests/test_hw_top_amaranth.py)."""
    from amaranth.back import rtlil

    from hbfp.hw.generate import components

    for shape in ((4, 8, (24, 24), 24), (6, 4, (24, 24), 24), (16, 8, (16, 16), 32)):
        assert "top" in components(CoreConfig(*shape[:2], 8, *shape[2:]))
    cfg = CoreConfig(rows=8, cols=8, tile=(12, 12), size=24, functions=())
    top = components(cfg)["top"]()
    assert isinstance(top, AcceleratorTop)
    assert "module" in rtlil.convert(top, name="top")


@pytest.mark.parametrize("kw", [dict(stream_bytes=0), dict(max_payload=16), dict(frame_timeout=0), dict(clock_hz=-1)])
def test_top_parameters_are_checked(kw):
    with pytest.raises(ValueError):
        AcceleratorTop(CoreConfig(4, 4, 8, (24, 24), 48), **kw)


# ---- the link's small components, in Amaranth's simulator --------------------------------


def _run(dut, *testbenches):
    sim = Simulator(dut)
    sim.add_clock(1e-8)
    for tb in testbenches:
        sim.add_testbench(tb)
    sim.run()


def test_crc32_matches_zlib():
    from hbfp.hw.crc import CRC32, crc32_state

    rng = random.Random(3)
    data = rng.randbytes(200)
    framed = data + struct.pack("<I", zlib.crc32(data))
    dut = CRC32()

    async def bench(ctx):
        ctx.set(dut.clear, 1)
        await ctx.tick()
        ctx.set(dut.clear, 0)
        for n, b in enumerate(framed):
            while rng.random() < 0.3:  # idle cycles leave the register alone
                await ctx.tick()
            ctx.set(dut.i.valid, 1)
            ctx.set(dut.i.payload, b)
            await ctx.tick()
            ctx.set(dut.i.valid, 0)
            if n < len(data):
                assert ctx.get(dut.crc) == zlib.crc32(framed[: n + 1])
        assert ctx.get(dut.residue_ok)

    _run(dut, bench)
    assert crc32_state(data) ^ 0xFFFFFFFF == zlib.crc32(data)


# The link's own components (beat compactor, byte window, parallel CRC, result serializer):
# tests/test_hw_link.py.
