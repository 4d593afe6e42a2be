"""The pipelined fp32 adder (``hbfp.hw.add_f32``) against ``hbfp.golden.bf16.add_f32``:
Amaranth-simulator unit tests of the datapath, and the cocotb testbench
``hbfp.sim.tb_add_f32`` on the generated Verilog with every simulator.

``HBFP_SIM_FULL=1`` runs the cocotb testbench on many more vectors."""

import os
import random

import numpy as np
import pytest
from amaranth.back import verilog
from amaranth.sim import Simulator

from hbfp.hw.add_f32 import F32_QNAN, AddF32, AddF32Datapath
from hbfp.sim import runner
from hbfp.sim import tb_add_f32 as tb

FULL = os.environ.get("HBFP_SIM_FULL") == "1"


def run_datapath(a, b, *, advance_p=1.0, valid_p=1.0, seed=0) -> list[int]:
    """Feed ``a``, ``b`` through ``AddF32Datapath`` under the Amaranth simulator with random
    ``advance`` and ``in_valid``; a result counts when it leaves (``advance & out_valid``)."""
    dut = AddF32Datapath()
    rng = random.Random(seed)
    got: list[int] = []

    async def bench(ctx):
        k = 0
        while len(got) < len(a):
            advance = rng.random() < advance_p
            valid = k < len(a) and rng.random() < valid_p
            ctx.set(dut.advance, advance)
            ctx.set(dut.in_valid, valid)
            if valid:
                ctx.set(dut.a, int(a[k]))
                ctx.set(dut.b, int(b[k]))
            if advance and ctx.get(dut.out_valid):
                got.append(ctx.get(dut.result))
            if advance and valid:
                k += 1
            await ctx.tick()

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    return got


def test_datapath_matches_golden_on_corner_classes():
    a, b, _ = tb.vectors(seed=7, n_random=2000)
    got = run_datapath(a, b)
    assert tb.mismatches(a, b, got) == []
    nan = tb.is_nan(np.asarray(got, dtype=np.uint32))
    assert nan.any() and set(np.asarray(got, dtype=np.uint32)[nan]) == {F32_QNAN}, "NaN results are canonical"


def test_datapath_holds_and_keeps_order_when_advance_drops():
    a, b, _ = tb.vectors(seed=8, n_random=300)
    a, b = a[:1000], b[:1000]
    got = run_datapath(a, b, advance_p=0.6, valid_p=0.7, seed=3)
    assert tb.mismatches(a, b, got) == []


def test_datapath_latency():
    dut = AddF32Datapath()
    seen = []

    async def bench(ctx):
        ctx.set(dut.advance, 1)
        ctx.set(dut.a, 0x3F80_0000)  # 1 + 1
        ctx.set(dut.b, 0x3F80_0000)
        ctx.set(dut.in_valid, 1)
        await ctx.tick()
        ctx.set(dut.in_valid, 0)
        for _ in range(2 * dut.LATENCY):
            seen.append((ctx.get(dut.out_valid), ctx.get(dut.result)))
            await ctx.tick()

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    valid_at = [k + 1 for k, (v, _) in enumerate(seen) if v]
    assert valid_at == [AddF32Datapath.LATENCY]
    assert seen[AddF32Datapath.LATENCY - 1][1] == 0x4000_0000


def test_vectors_hold_ties_of_both_parities_flushes_and_overflows():
    """The targeted classes reach what they are meant to (checked in exact float64)."""
    a, b, _ = tb.vectors(seed=1, n_random=0)
    with np.errstate(all="ignore"):  # NaN operands
        fa = tb.bf16.flush_f32(a.view(np.float32)).astype(np.float64)
        fb = tb.bf16.flush_f32(b.view(np.float32)).astype(np.float64)
        s = fa + fb
        y = s.astype(np.float32)
        up = np.nextafter(y, np.where(s > y, np.float32(np.inf), np.float32(-np.inf)))
        mid = (y.astype(np.float64) + up.astype(np.float64)) / 2
    finite = np.isfinite(s) & np.isfinite(y) & np.isfinite(up)
    tie = finite & (s != y) & (mid == s)
    kept = np.where(np.abs(y) < np.abs(up), y, up).view(np.uint32)
    assert (tie & ((kept & 1) == 0)).sum() > 100 and (tie & ((kept & 1) == 1)).sum() > 100
    e = tb.expected(a, b)
    assert (((e & 0x7FFF_FFFF) == 0) & finite & (s != 0)).sum() > 50, "flushed results"
    assert ((e == tb.SIGN) & (s != 0)).sum() > 10, "flushed to -0"
    assert (((e & 0x7FFF_FFFF) == tb.INF) & np.isfinite(fa) & np.isfinite(fb)).sum() > 50, "overflows"
    assert ((e & 0x7FFF_FFFF) == tb.FLT_MAX).sum() > 20, "results at FLT_MAX"


def test_verilog_converts():
    text = verilog.convert(AddF32(), name="add_f32")
    for port in ("i__payload", "i__valid", "i__ready", "o__payload", "o__valid", "o__ready"):
        assert port in text
    verilog.convert(AddF32Datapath(), name="add_f32_datapath")


@pytest.mark.parametrize("sim", runner.SIMULATORS)
def test_add_f32_cocotb(sim):
    runner.require(sim)
    config = {
        "seed": 1,
        "random": 200_000 if FULL else 20_000,
        "scale": 10 if FULL else 1,
        "full_throughput": 50_000 if FULL else 4_000,
        "stall": 0.3,
    }
    tests, failed = runner.run(lambda: AddF32(), "add_f32", "tb_add_f32", sim, config)
    assert tests > 0 and failed == 0
