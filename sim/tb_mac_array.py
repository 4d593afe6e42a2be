"""cocotb testbench of ``hbfp.hw.mac_array.MacArray`` against ``golden.gemm.partial_sums``.

The array never stalls: ``o.ready`` is held at 1 (the sink only collects), ``i.ready`` must
stay 1, and the input has random gaps."""

import random

import cocotb
import numpy as np
from cocotb.triggers import ReadOnly, RisingEdge

from hbfp.golden.gemm import partial_sums
from hbfp.sim.runner import tb_config
from hbfp.sim.streams import StreamSink, StreamSource, pack, start_clock_and_reset, unpack


def operands(rng: np.random.Generator, cfg: dict, tiles: int):
    """Random codes for ``tiles`` K-tiles, with rows of extremes mixed in."""
    R, C, tk = cfg["rows"], cfg["cols"], cfg["tk"]
    qa, qb = 2 ** (cfg["ma"] - 1) - 1, 2 ** (cfg["mb"] - 1) - 1
    a = rng.integers(-qa, qa + 1, (R, tiles * tk))
    b = rng.integers(-qb, qb + 1, (tiles * tk, C))
    for t in range(0, tiles, 3):  # every third K-tile at full scale: the sums' extremes
        ks = slice(t * tk, (t + 1) * tk)
        a[:, ks] = rng.choice([-qa, qa], (R, tk))
        b[ks, :] = np.where(rng.random((tk, C)) < 0.5, qb, -qb) * (1 if t % 2 else np.sign(a[0, ks])[:, None])
    return a, b


def beats(a, b, cfg):
    w_a, w_b = cfg["ma"], cfg["mb"]
    R = cfg["rows"]
    return [pack(a[:, k], w_a) | (pack(b[k, :], w_b) << (R * w_a)) for k in range(a.shape[1])]


def expected_rows(a, b, cfg):
    """The drained beats, in order: (K-tile, row, group, that group's sums)."""
    sums = partial_sums(a, b, cfg["tk"])  # (KT, R, C)
    G = cfg.get("groups", 1)
    L = cfg["cols"] // G
    return [(kt, i, g, sums[kt, i, g * L:(g + 1) * L].tolist())
            for kt in range(sums.shape[0]) for i in range(cfg["rows"]) for g in range(G)]


def check(got, want, cfg, width):
    R, G = cfg["rows"], cfg.get("groups", 1)
    L = cfg["cols"] // G
    row_bits, group_bits = (R - 1).bit_length(), (G - 1).bit_length()
    assert len(got) == len(want)
    for word, (kt, i, grp, sums) in zip(got, want):
        g = unpack(word, width, L, signed=True)
        row = (word >> (L * width)) & ((1 << row_bits) - 1)
        group = (word >> (L * width + row_bits)) & ((1 << group_bits) - 1)
        assert (row, group) == (i, grp), f"K-tile {kt}: row {row} group {group}, want {i} {grp}"
        assert g == sums, f"K-tile {kt} row {i} group {grp}: got {g}, want {sums}"


async def always_ready(dut, cycles: int) -> None:
    """``i.ready`` is 1 on every cycle: the array takes a beat whenever one is offered."""
    for _ in range(cycles):
        await ReadOnly()
        assert dut.i__ready.value == 1, "i.ready fell"
        await RisingEdge(dut.clk)


@cocotb.test()
async def random_with_gaps(dut):
    cfg = tb_config()
    await start_clock_and_reset(dut, sources=["i"], sinks=["o"])
    rng = np.random.default_rng(cfg["seed"])
    a, b = operands(rng, cfg, cfg["tiles"])
    src = StreamSource(dut, "i", stall=0.3, rng=random.Random(cfg["seed"]))
    snk = StreamSink(dut, "o")  # o.ready = 1 throughout
    cocotb.start_soon(always_ready(dut, 2 * a.shape[1]))
    cocotb.start_soon(src.send(beats(a, b, cfg)))
    want = expected_rows(a, b, cfg)
    got = await snk.receive(len(want), timeout_cycles=200)
    check(got, want, cfg, cfg["psum_width"])


@cocotb.test()
async def full_throughput(dut):
    """No stalls: one beat per cycle in, every PE one MAC per cycle."""
    cfg = tb_config()
    await start_clock_and_reset(dut, sources=["i"], sinks=["o"])
    rng = np.random.default_rng(cfg["seed"] + 7)
    tiles = max(4, cfg["tiles"] // 4)
    a, b = operands(rng, cfg, tiles)
    src = StreamSource(dut, "i")
    snk = StreamSink(dut, "o")
    want = expected_rows(a, b, cfg)
    recv = cocotb.start_soon(snk.receive(len(want), timeout_cycles=200))
    start = cocotb.utils.get_sim_time("ns")
    await src.send(beats(a, b, cfg))
    cycles = (cocotb.utils.get_sim_time("ns") - start) / 10
    assert cycles == a.shape[1], f"{a.shape[1]} beats took {cycles} cycles"
    got = await recv
    check(got, want, cfg, cfg["psum_width"])
    await RisingEdge(dut.clk)


@cocotb.test()
async def latency(dut):
    """The first beat of a K-tile is valid ``LATENCY`` cycles after the tile's last beat
    enters, its ``rows * groups`` beats on consecutive cycles."""
    cfg = tb_config()
    await start_clock_and_reset(dut, sources=["i"], sinks=["o"])
    dut.o__ready.value = 1
    a, b = operands(np.random.default_rng(cfg["seed"] + 3), cfg, 1)
    src = StreamSource(dut, "i")
    await src.send(beats(a, b, cfg))  # returns on the edge that takes the last beat
    valid = []
    drain = cfg["rows"] * cfg.get("groups", 1)
    for _ in range(cfg["latency"] + drain + 2):
        await ReadOnly()
        valid.append(int(dut.o__valid.value))
        await RisingEdge(dut.clk)
    # valid[0] is the cycle after the last beat's edge: latency 1 would be valid there.
    want = [0] * (cfg["latency"] - 1) + [1] * drain + [0] * 3
    assert valid == want, f"o.valid after the last beat: {valid}, want {want}"
