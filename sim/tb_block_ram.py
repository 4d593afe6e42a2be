"""cocotb testbench of ``hbfp.hw.block_ram.BlockRam``: random writes and reads, a read
enabled in random cycles, against the read pipeline its docstring states: the block RAM's
stage takes the addressed word in a cycle with ``en``; the output register takes that
stage every cycle, or with ``stall`` only in cycles with ``en`` (the two stages advance
together). ``read0.data`` is checked every cycle once both stages hold a known word."""

import cocotb
import numpy as np
from cocotb.triggers import FallingEdge, ReadOnly, RisingEdge

from hbfp.sim.runner import tb_config
from hbfp.sim.streams import start_clock_and_reset


@cocotb.test()
async def reads_follow_the_pipeline(dut):
    cfg = tb_config()
    depth, width, stall, cycles = cfg["depth"], cfg["width"], cfg["stall"], cfg["cycles"]
    rng = np.random.default_rng(cfg["seed"])
    dut.write__en.value = 0
    dut.read0__en.value = 0
    await start_clock_and_reset(dut)
    mem = [int(x) for x in rng.integers(0, 1 << width, depth, dtype=np.uint64)]
    for a, word in enumerate(mem):
        dut.write__en.value, dut.write__addr.value, dut.write__data.value = 1, a, word
        await RisingEdge(dut.clk)
    dut.write__en.value = 0
    await FallingEdge(dut.clk)
    stage = out = None  # the words of the block RAM's stage and of the output register (None: not known)
    checked = 0
    for _ in range(cycles):
        en = bool(rng.random() < 0.6)
        addr = int(rng.integers(depth))
        write = bool(rng.random() < 0.3)
        w_addr = int(rng.integers(depth))
        if w_addr == addr:  # a read never meets a write of its address (NO_RW_CHECK)
            write = False
        w_data = int(rng.integers(0, 1 << width, dtype=np.uint64))
        dut.read0__en.value, dut.read0__addr.value = int(en), addr
        dut.write__en.value, dut.write__addr.value, dut.write__data.value = int(write), w_addr, w_data
        await RisingEdge(dut.clk)
        if en or not stall:
            out = stage
        if en:
            stage = mem[addr]
        if write:
            mem[w_addr] = w_data
        await ReadOnly()
        if out is not None:
            got = int(dut.read0__data.value)
            assert got == out, f"read0.data {got:#x}, want {out:#x} (stall={stall})"
            checked += 1
        await FallingEdge(dut.clk)
    assert checked > cycles // 2
