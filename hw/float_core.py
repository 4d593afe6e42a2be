"""A floating-point GEMM core: the reference of the whole-core density comparison.

The BFP8 core's buffers, accumulator, bias and epilogue (``hw.epilogue``) and its ports, with
``hw.float_mac.FloatMacArray`` (bf16 or fp16 products, fp32 sums in every processing
element) in place of the BFP MAC array and its normalizers: what a floating-point
accelerator of the same shape costs, through the same flow (benchmarks/ecp5_area.py,
docs/reports/density.md).

It computes, bit for bit (``reference``): for each K-tile of ``tk`` steps, ``float_mac`` of
the two operands' slices (K padded with zeros), added in ascending K-tile order with
``add_f32`` onto +0 (or C), then the bias, activation and output format as the BFP core's
epilogue does. The array runs ``INTERLEAVE`` independent accumulations (``FloatMacArray``): a
run of ``INTERLEAVE * tk`` beats computes one K-tile of ``INTERLEAVE`` adjacent output blocks
of a row-block. Operands are stored as 16-bit patterns (``a_codes``/``b_codes`` writes; there
are no exponents). Unlike the BFP core it may stall (the array waits while a group's sums
drain), and it keeps no cycle model: it exists to be measured.
"""

from __future__ import annotations

import numpy as np
from amaranth import Array, Const, Module, Mux, Signal
from amaranth.lib import data, fifo, wiring

from hbfp.contract import OutFormat, Target

from .accumulate import delayed
from .add_f32 import AddF32Datapath
from .block_ram import BlockRam
from .buffers import READ_COLUMN, READ_ROW, OperandBuffer, times_constant
from .epilogue import Epilogue, plan_layout, rows_closed
from .float_mac import FloatMacArray
from .gemm_core import _ceil_table, accept_command, command_layout, core_signature
from .params import ACC_READ_LATENCY, FP32_WIDTH, OPERAND_READ_LATENCY, CoreConfig

__all__ = ["FloatCore", "reference"]


def reference(a_bits, b_bits, fmt: str, tk: int, *, c=None) -> np.ndarray:
    """The fp32 sums ``FloatCore`` leaves in its accumulator for ``a_bits`` (M x K) and
    ``b_bits`` (K x N) patterns: per K-tile ``float_mac``, accumulated with ``add_f32``."""
    from hbfp.golden import bf16
    from hbfp.golden.float_mac import float_mac

    a_bits, b_bits = np.asarray(a_bits, np.uint16), np.asarray(b_bits, np.uint16)
    m, k = a_bits.shape
    n = b_bits.shape[1]
    kp = -(-k // tk) * tk
    a = np.zeros((m, kp), np.uint16)
    b = np.zeros((kp, n), np.uint16)
    a[:, :k], b[:k] = a_bits, b_bits
    acc = np.zeros((m, n), np.float32) if c is None else np.asarray(c, np.float32)
    for k0 in range(0, kp, tk):
        acc = bf16.add_f32(acc, float_mac(a[:, k0:k0 + tk], b[k0:k0 + tk], fmt))
    return acc


class FloatCore(wiring.Component):
    """``act(A @ B + C + bias)`` with 16-bit float operands (``fmt``: "bf16" or "fp16").

    Ports as ``hw.gemm_core.GemmCore``'s; commands take neither transposes nor accumulation
    across commands beyond C (``accumulate`` adds onto the accumulator's C). ``busy``,
    ``error`` (zero or oversized sides, transposes), ``cycles`` (the last command's length).
    """

    def __init__(self, cfg: CoreConfig, fmt: str):
        self.cfg, self.fmt = cfg, fmt
        super().__init__(core_signature(cfg))

    def elaborate(self, platform):
        m = Module()
        cfg = self.cfg
        R, C, D, tk = cfg.rows, cfg.cols, cfg.size, cfg.tk
        G = FloatMacArray.INTERLEAVE
        words_per_row = D // C

        # ---- storage, host writes, commands (as in the BFP core) ----------------------------
        m.submodules.buf_a = buf_a = OperandBuffer(R, 16, D, D)
        m.submodules.buf_b = buf_b = OperandBuffer(C, 16, D, D)
        acc_word = data.ArrayLayout(FP32_WIDTH, C)
        m.submodules.acc_mem = acc_mem = BlockRam(acc_word, D * words_per_row, read_ports=2)
        m.submodules.bias_mem = bias_mem = BlockRam(acc_word, words_per_row)
        acc_wr, bias_wr = acc_mem.write, bias_mem.write
        busy = Signal()
        m.d.comb += self.busy.eq(busy)
        w = self.w.payload
        m.d.comb += self.w.ready.eq(~busy)
        w_fire = self.w.valid & ~busy
        col_word = Array(Const(v // C, range(words_per_row)) for v in range(D))[w.col]
        m.d.comb += [
            buf_a.w_en.eq(w_fire & (w.target == Target.A_CODES)),
            buf_a.w_row.eq(w.row), buf_a.w_col.eq(w.col), buf_a.w_skip.eq(w.skip[:R]),
            buf_b.w_en.eq(w_fire & (w.target == Target.B_CODES)),
            buf_b.w_row.eq(w.row), buf_b.w_col.eq(w.col), buf_b.w_skip.eq(w.skip[:C]),
            bias_wr.en.eq(w_fire & (w.target == Target.BIAS)),
            bias_wr.addr.eq(col_word),
        ]
        m.d.comb += [buf_a.w_data[t].eq(w.data[t]) for t in range(R)]
        m.d.comb += [buf_b.w_data[t].eq(w.data[t]) for t in range(C)]
        m.d.comb += [bias_wr.data[t].eq(w.data[t]) for t in range(C)]

        desc = Signal(command_layout(cfg))
        plan = Signal(plan_layout(cfg))
        cmd = self.cmd.payload
        bad = (cmd.m == 0) | (cmd.n == 0) | (cmd.m > D) | (cmd.n > D) | (cmd.k > D)
        bad = bad | ((cmd.k != 0) & (cmd.transpose_a | cmd.transpose_b))
        if not cfg.bfp_output:
            bad = bad | (cmd.out_format == OutFormat.BFP)
        start, started = accept_command(m, self, desc, busy, bad)
        blocks_m = Signal(range(D // R + 1))
        groups_n = Signal(range(D // (C * G) + 2))  # runs of G column-blocks
        blocks_n = Signal(range(D // C + 1))
        ktiles = Signal(range(D // tk + 1))
        rows_total = Signal(range(D + R + 1))
        with m.If(start):
            m.d.sync += [
                blocks_m.eq(_ceil_table(D, R)[cmd.m]),
                blocks_n.eq(_ceil_table(D, C)[cmd.n]),
                groups_n.eq(_ceil_table(D, C * G)[cmd.n]),
                ktiles.eq(_ceil_table(D, tk)[cmd.k]),
                rows_total.eq(_ceil_table(D, R, R)[cmd.m]),
                plan.tiles_m.eq(_ceil_table(D, cfg.tile[0])[cmd.m]),
                plan.tiles_n.eq(_ceil_table(D, cfg.tile[1])[cmd.n]),
                plan.chunks.eq(_ceil_table(D, cfg.out_lanes)[cmd.n]),
            ]

        # ---- issue: runs of G * tk beats, beat n of a run step n // G of group n % G ---------
        m.submodules.mac = mac = FloatMacArray(R, C, self.fmt, tk)
        beat_layout = mac.i.payload.shape()
        depth = OPERAND_READ_LATENCY + 4
        m.submodules.beats = beats = fifo.SyncFIFO(width=beat_layout.size, depth=depth)
        ib = Signal(range(D // R + 1))
        jg = Signal(range(D // (C * G) + 2))
        kt = Signal(range(D // tk + 1))
        step = Signal(range(tk))
        g = Signal(range(G))
        row0 = Signal(range(D + R))
        col0 = Signal(range(D + C * G))  # column of the run's group 0
        k = Signal(range(D + tk))
        issuing = Signal()
        held = Signal(range(depth + 1))  # beats in flight and queued
        issue = Signal()
        m.d.comb += issue.eq(issuing & (held < depth))
        with m.If(start):
            m.d.sync += [issuing.eq(cmd.k != 0), ib.eq(0), jg.eq(0), kt.eq(0), step.eq(0), g.eq(0), row0.eq(0),
                         col0.eq(0), k.eq(0)]
        with m.If(issue):
            m.d.sync += g.eq(g + 1)
            with m.If(g == G - 1):
                m.d.sync += [g.eq(0), step.eq(step + 1), k.eq(k + 1)]
                with m.If(step == tk - 1):
                    m.d.sync += [step.eq(0), kt.eq(kt + 1)]
                    with m.If(kt == ktiles - 1):
                        m.d.sync += [kt.eq(0), k.eq(0), jg.eq(jg + 1), col0.eq(col0 + C * G)]
                        with m.If(jg == groups_n - 1):
                            m.d.sync += [jg.eq(0), col0.eq(0), ib.eq(ib + 1), row0.eq(row0 + R)]
                            with m.If(ib == blocks_m - 1):
                                m.d.sync += issuing.eq(0)
        b_col = Signal(range(D + C * G))
        m.d.comb += b_col.eq(col0 + times_constant(g, C))
        m.d.comb += [
            buf_a.r_en.eq(issue), buf_a.r_mode.eq(READ_COLUMN), buf_a.r_row.eq(row0), buf_a.r_col.eq(k),
            buf_b.r_en.eq(issue), buf_b.r_mode.eq(READ_ROW), buf_b.r_row.eq(k), buf_b.r_col.eq(b_col),
        ]
        # K beyond the product's, or a column-block beyond N: zeros (a stale inf would make NaN).
        pad = delayed(m, (k >= desc.k) | (b_col >= D), OPERAND_READ_LATENCY, "beat_pad")
        beat = Signal(beat_layout)
        m.d.comb += [beat.a[t].eq(Mux(pad, 0, buf_a.r_data[t])) for t in range(R)]
        m.d.comb += [beat.b[t].eq(Mux(pad, 0, buf_b.r_data[t])) for t in range(C)]
        m.d.comb += [
            beats.w_en.eq(delayed(m, issue, OPERAND_READ_LATENCY, "beat_valid")),
            beats.w_data.eq(beat),
            mac.i.valid.eq(beats.r_rdy),
            mac.i.payload.eq(beats.r_data),
            beats.r_en.eq(mac.i.ready),
        ]
        m.d.sync += held.eq(held + issue - (beats.r_rdy & mac.i.ready))

        # ---- drain: a group's R x C sums, one row a cycle, into C adders and the accumulator --
        # Each run's block address, first column-block, first K-tile and whether it is a
        # row-block's last are queued beside the array.
        run = data.StructLayout({"base": range(D * words_per_row + G + 1), "jb0": range(D // C + G + 1),
                                 "first": 1, "closes": 1})
        m.submodules.runs = runs = fifo.SyncFIFO(width=run.size, depth=4)
        block_base = Signal(range(D * words_per_row + G + 1))  # ib * R * words_per_row + jg * G
        row_base = Signal(range(D * words_per_row + R * words_per_row + 1))
        jb0 = Signal(range(D // C + G + 1))
        with m.If(start):
            m.d.sync += [block_base.eq(0), row_base.eq(0), jb0.eq(0)]
        with m.If(issue & (g == G - 1) & (step == tk - 1) & (kt == ktiles - 1)):
            m.d.sync += [block_base.eq(block_base + G), jb0.eq(jb0 + G)]
            with m.If(jg == groups_n - 1):
                m.d.sync += [row_base.eq(row_base + R * words_per_row), block_base.eq(row_base + R * words_per_row),
                             jb0.eq(0)]
        entry = Signal(run)
        m.d.comb += [
            entry.base.eq(block_base), entry.jb0.eq(jb0), entry.first.eq(kt == 0),
            entry.closes.eq((kt == ktiles - 1) & (jg == groups_n - 1)),
            runs.w_en.eq(issue & (g == 0) & (step == 0)), runs.w_data.eq(entry),
        ]
        head = data.View(run, runs.r_data)
        sums = Signal(mac.o.payload.sums.shape())
        group = Signal(range(G))
        row = Signal(range(R))
        row_addr = Signal(range(R * words_per_row + 1))  # row * words_per_row
        draining = Signal()
        m.d.comb += mac.o.ready.eq(~draining)
        with m.If(mac.o.valid & ~draining):
            m.d.sync += [sums.eq(mac.o.payload.sums), group.eq(mac.o.payload.group), row.eq(0), row_addr.eq(0),
                         draining.eq(1)]
        with m.Elif(draining):
            m.d.sync += [row.eq(row + 1), row_addr.eq(row_addr + words_per_row)]
            with m.If(row == R - 1):
                m.d.sync += draining.eq(0)
        m.d.comb += runs.r_en.eq(draining & (row == R - 1) & (group == G - 1))
        block = head.jb0 + group
        live = draining & (block < blocks_n)  # a column-block beyond N is not written back
        last_live = (row == R - 1) & ((group == G - 1) | (block == blocks_n - 1))
        rows = Array(sums[i] for i in range(R))
        row_sums = Signal(acc_word)
        m.d.comb += row_sums.eq(rows[row])
        addr = Signal(range(D * words_per_row + G + R * words_per_row))
        m.d.comb += addr.eq(head.base + group + row_addr)

        acc_rd = acc_mem.read0
        old = Signal(acc_word)
        m.d.comb += [acc_rd.addr.eq(addr), acc_rd.en.eq(live)]
        m.d.sync += old.eq(acc_rd.data)
        La = AddF32Datapath.LATENCY
        lat = ACC_READ_LATENCY
        zero = delayed(m, head.first & ~desc.accumulate, lat, "zero")
        sums_d = delayed(m, row_sums, lat, "row_sums")
        valid_d = delayed(m, live, lat, "live")
        wb_data = Signal(acc_word)
        for j in range(C):
            ad = AddF32Datapath()
            m.submodules[f"add{j}"] = ad
            m.d.comb += [ad.advance.eq(1), ad.in_valid.eq(valid_d), ad.a.eq(sums_d[j]),
                         ad.b.eq(Mux(zero, 0, old[j])), wb_data[j].eq(ad.result)]
        wb_en = delayed(m, live, lat + La, "write_en")
        wb_addr = delayed(m, addr, lat + La, "write_addr")
        closed = delayed(m, live & last_live & head.closes, lat + La, "closed")
        # A host write of the accumulator is registered, and selects itself, as in GemmCore.
        host_acc = Signal()
        host_addr = Signal.like(acc_wr.addr)
        host_data = Signal(acc_word)
        m.d.sync += [host_acc.eq(w_fire & (w.target == Target.ACC)),
                     host_addr.eq(times_constant(w.row, words_per_row) + col_word),
                     host_data.eq(w.data.as_value()[:C * FP32_WIDTH])]
        m.d.comb += [
            acc_wr.en.eq(host_acc | wb_en),
            acc_wr.addr.eq(Mux(host_acc, host_addr, wb_addr)),
            acc_wr.data.eq(Mux(host_acc, host_data, wb_data)),
        ]

        rows_done, all_rows = rows_closed(m, cfg, start, cmd.k == 0, closed, rows_total)

        # ---- epilogue: the BFP core's --------------------------------------------------------
        m.submodules.epilogue = epi = Epilogue(cfg, command_layout(cfg))
        m.d.comb += [epi.start.eq(started), epi.desc.eq(desc), epi.plan.eq(plan), epi.rows_done_next.eq(rows_done),
                     epi.all_rows_next.eq(all_rows)]
        wiring.connect(m, epi.acc_read, acc_mem.read1)
        wiring.connect(m, epi.bias_read, bias_mem.read0)
        wiring.connect(m, epi.o, wiring.flipped(self.o))
        with m.If(self.o.valid & self.o.ready & self.o.payload.last):
            m.d.sync += busy.eq(0)
        return m
