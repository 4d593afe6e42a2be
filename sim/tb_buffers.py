"""cocotb testbench of ``hbfp.hw.buffers.OperandBuffer``: a stored matrix written in row
chunks reads back as row chunks and as column chunks (the transposed operand), equal to the
matrix's own rows and columns: one read at a time, then a read every cycle (with gaps) whose
chunks must arrive exactly ``LATENCY`` cycles after their requests."""

import random

import cocotb
import numpy as np
from cocotb.triggers import FallingEdge, ReadOnly, RisingEdge

from hbfp.hw.buffers import READ_COLUMN, READ_ROW, OperandBuffer
from hbfp.sim.runner import tb_config
from hbfp.sim.streams import pack, start_clock_and_reset, unpack


@cocotb.test()
async def write_then_read_both_ways(dut):
    cfg = tb_config()
    L, rows, cols, width = cfg["lanes"], cfg["rows"], cfg["cols"], cfg["code_width"]
    dut.w_en.value = 0
    dut.w_skip.value = 0
    dut.r_en.value = 0
    await start_clock_and_reset(dut)
    rng = np.random.default_rng(cfg["seed"])
    q = 2 ** (width - 1) - 1
    for rnd in range(cfg["rounds"]):
        stored = rng.integers(-q, q + 1, (rows, cols))
        # Row chunks at any column (a lane count that does not divide the tile's columns): from
        # round 1 on shifted by rnd, with chunks at both edges (overlapping ones agree).
        starts = sorted({0, cols - L, *range(rnd % L, cols - L + 1, L)})
        order = [(r, c0) for r in range(rows) for c0 in starts]
        random.Random(rnd).shuffle(order)
        for r, c0 in order:
            dut.w_en.value = 1
            dut.w_row.value, dut.w_col.value = r, c0
            dut.w_data.value = pack(stored[r, c0 : c0 + L], width)
            await RisingEdge(dut.clk)
        # Partial chunks: lanes with their skip bit set keep what they hold.
        for _ in range(rows):
            r, c0 = int(rng.integers(rows)), int(rng.integers(cols - L + 1))
            skip = int(rng.integers(1 << L))
            chunk = rng.integers(-q, q + 1, L)
            dut.w_en.value = 1
            dut.w_row.value, dut.w_col.value, dut.w_skip.value = r, c0, skip
            dut.w_data.value = pack(chunk, width)
            await RisingEdge(dut.clk)
            for t in range(L):
                if not skip >> t & 1:
                    stored[r, c0 + t] = chunk[t]
        dut.w_skip.value = 0
        dut.w_en.value = 0
        reads = [(READ_ROW, r, c0) for r in range(rows) for c0 in range(0, cols - L + 1)]
        reads += [(READ_COLUMN, r0, c) for r0 in range(0, rows, L) for c in range(cols)]
        random.Random(rnd + 100).shuffle(reads)
        for mode, r, c in reads:
            dut.r_en.value = 1
            dut.r_mode.value, dut.r_row.value, dut.r_col.value = mode, r, c
            await RisingEdge(dut.clk)  # the request's register
            dut.r_en.value = 0  # r_data holds while r_en is low
            for _ in range(OperandBuffer.LATENCY - 1):  # the banks, their output register
                await RisingEdge(dut.clk)
            await ReadOnly()  # r_data: LATENCY cycles after the request
            got = unpack(int(dut.r_data.value), width, L, signed=True)
            want = stored[r, c : c + L] if mode == READ_ROW else stored[r : r + L, c]
            assert got == want.tolist(), f"{'row' if mode == READ_ROW else 'column'} chunk at ({r}, {c}): got {got}, want {want.tolist()}"
            await FallingEdge(dut.clk)
        dut.r_en.value = 0
        # A read every cycle but for random gaps: after the clock edge that takes request i,
        # r_data is the chunk of the last request taken LATENCY - 1 or more edges earlier.
        taken = []
        for i, (mode, r, c) in enumerate(reads):
            gap = rng.random() < 0.2
            dut.r_en.value = 0 if gap else 1
            dut.r_mode.value, dut.r_row.value, dut.r_col.value = mode, r, c
            await RisingEdge(dut.clk)
            taken.append(None if gap else (mode, r, c))
            await ReadOnly()
            due = [x for x in taken[: max(0, len(taken) - (OperandBuffer.LATENCY - 1))] if x is not None]
            if due:
                mode_d, r_d, c_d = due[-1]
                got = unpack(int(dut.r_data.value), width, L, signed=True)
                want = stored[r_d, c_d : c_d + L] if mode_d == READ_ROW else stored[r_d : r_d + L, c_d]
                assert got == want.tolist(), f"streamed read {i}: chunk of {due[-1]}: got {got}, want {want.tolist()}"
            await FallingEdge(dut.clk)
        dut.r_en.value = 0
