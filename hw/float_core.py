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
of a row-block (``FloatIssue``), and a run's sums are added into the accumulator one row a
cycle (``FloatDrain``). Operands are stored as 16-bit patterns (``a_codes``/``b_codes``
writes; there are no exponents). Unlike the BFP core it may stall (the array waits while a
group's sums drain), and it keeps no cycle model: it exists to be measured.
"""

from __future__ import annotations

import numpy as np
from amaranth import Array, Const, Module, Mux, Signal
from amaranth.lib import data, fifo, memory, stream, wiring
from amaranth.lib.wiring import In, Out

from hbfp.contract import OutFormat, Target

from .accumulate import delayed
from .add_f32 import AddF32Datapath
from .block_ram import BlockRam
from .buffers import READ_COLUMN, READ_ROW, OperandBuffer, times_constant
from .epilogue import Epilogue, plan_layout, rows_closed
from .float_mac import FloatMacArray
from .gemm_core import (AccWriteSignature, BufferReadSignature, _ceil_table, accept_command, command_layout,
                        connect_buffer, core_signature, count_cycles)
from .params import ACC_READ_LATENCY, FP32_WIDTH, OPERAND_READ_LATENCY, CoreConfig

__all__ = ["FloatCore", "FloatIssue", "FloatDrain", "run_layout", "reference"]


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


def run_layout(cfg: CoreConfig) -> data.StructLayout:
    """A run of ``INTERLEAVE * tk`` beats as queued beside the array (``FloatIssue.runs``): the
    accumulator address of its first block's row 0, its first column-block, whether it is the
    blocks' first K-tile, and whether it closes a row-block."""
    D, C, G = cfg.size, cfg.cols, FloatMacArray.INTERLEAVE
    return data.StructLayout({"base": range(D * (D // C) + G + 1), "jb0": range(D // C + G + 1),
                              "first": 1, "closes": 1})


class FloatIssue(wiring.Component):
    """``FloatCore``'s operand beats: runs of ``G * tk`` beats (G = ``INTERLEAVE``), beat n of a
    run step ``n // G`` of column-block ``n % G`` of the run, for each K-tile of each run of G
    adjacent column-blocks of each row-block; the operands read from the buffers, K beyond the
    product's and column-blocks beyond ``size`` padded with zeros, and queued for the array,
    which may stall (a beat is issued only while the queue has room for everything in flight).
    Each run's position is queued for the drain (``runs``).

    Ports: ``start`` (strobe: ``cmd``, the command being accepted, is valid); ``k`` (the
    command's K, from the cycle after ``start``); ``a_read``, ``b_read`` (the operand buffers'
    reads); ``o`` (stream out: the array's beats); ``runs`` (stream out, ``run_layout``: the
    queue's head); ``blocks_n`` (the command's column-blocks, registered with it).
    """

    def __init__(self, cfg: CoreConfig, beat: data.StructLayout):
        self.cfg, self.beat = cfg, beat
        R, C, D = cfg.rows, cfg.cols, cfg.size
        super().__init__({
            "start": In(1),
            "cmd": In(command_layout(cfg)),
            "k": In(range(D + 1)),
            "a_read": Out(BufferReadSignature(R, 16, D)),
            "b_read": Out(BufferReadSignature(C, 16, D)),
            "o": Out(stream.Signature(beat)),
            "runs": Out(stream.Signature(run_layout(cfg))),
            "blocks_n": Out(range(D // C + 1)),
        })

    def elaborate(self, platform):
        m = Module()
        cfg, start, cmd = self.cfg, self.start, self.cmd
        R, C, D, tk = cfg.rows, cfg.cols, cfg.size, cfg.tk
        G = FloatMacArray.INTERLEAVE
        words_per_row = D // C
        blocks_m = Signal(range(D // R + 1))
        groups_n = Signal(range(D // (C * G) + 2))  # runs of G column-blocks
        ktiles = Signal(range(D // tk + 1))
        with m.If(start):
            m.d.sync += [
                blocks_m.eq(_ceil_table(D, R)[cmd.m]),
                self.blocks_n.eq(_ceil_table(D, C)[cmd.n]),
                groups_n.eq(_ceil_table(D, C * G)[cmd.n]),
                ktiles.eq(_ceil_table(D, tk)[cmd.k]),
            ]

        depth = OPERAND_READ_LATENCY + 4
        m.submodules.beats = beats = fifo.SyncFIFO(width=self.beat.size, depth=depth)
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
        a_read, b_read = self.a_read, self.b_read
        m.d.comb += [
            a_read.en.eq(issue), a_read.mode.eq(READ_COLUMN), a_read.row.eq(row0), a_read.col.eq(k),
            b_read.en.eq(issue), b_read.mode.eq(READ_ROW), b_read.row.eq(k), b_read.col.eq(b_col),
        ]
        # K beyond the product's, or a column-block beyond N: zeros (a stale inf would make NaN).
        pad = delayed(m, (k >= self.k) | (b_col >= D), OPERAND_READ_LATENCY, "beat_pad")
        beat = Signal(self.beat)
        m.d.comb += [beat.a[t].eq(Mux(pad, 0, a_read.data[t])) for t in range(R)]
        m.d.comb += [beat.b[t].eq(Mux(pad, 0, b_read.data[t])) for t in range(C)]
        m.d.comb += [
            beats.w_en.eq(delayed(m, issue, OPERAND_READ_LATENCY, "beat_valid")),
            beats.w_data.eq(beat),
            self.o.valid.eq(beats.r_rdy),
            self.o.payload.eq(beats.r_data),
            beats.r_en.eq(self.o.ready),
        ]
        m.d.sync += held.eq(held + issue - (beats.r_rdy & self.o.ready))

        # Each run's block address, first column-block, first K-tile and whether it is a
        # row-block's last are queued beside the array.
        run = run_layout(cfg)
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
            self.runs.valid.eq(runs.r_rdy), self.runs.payload.eq(runs.r_data), runs.r_en.eq(self.runs.ready),
        ]
        return m


class FloatDrain(wiring.Component):
    """``FloatCore``'s drain: a group's R x C sums (``i``, the array's output), one row a cycle,
    into C fp32 adders (``AddF32Datapath``) with the accumulator's old word (or +0 on a
    product's first K-tile without ``accumulate``), written back; a column-block beyond N is
    not written back. The run's position is the head of ``runs``, taken with its last group.

    Ports: ``i`` (stream in; not ready while a group drains: R cycles; ``ready_next``: its
    ready of the next cycle, for the array's ``ready_ahead``); ``runs`` (stream in,
    ``run_layout``); ``blocks_n`` (the command's column-blocks); ``accumulate`` (the
    command's); ``acc_read`` (a read port of the accumulator); ``write`` (the write back,
    ``AccWriteSignature``); ``closed`` (strobe: a row-block's last word is written).
    Latency: a row is written ``ACC_READ_LATENCY + AddF32Datapath.LATENCY`` cycles after its
    read.
    """

    def __init__(self, cfg: CoreConfig, array: stream.Signature):
        self.cfg = cfg
        D, C = cfg.size, cfg.cols
        super().__init__({
            "i": In(array),
            "runs": In(stream.Signature(run_layout(cfg))),
            "blocks_n": In(range(D // C + 1)),
            "accumulate": In(1),
            "acc_read": In(memory.ReadPort.Signature(addr_width=max(1, (D * (D // C) - 1).bit_length()),
                                                     shape=data.ArrayLayout(FP32_WIDTH, C))),
            "write": Out(AccWriteSignature(cfg)),
            "closed": Out(1),
            "ready_next": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self.cfg
        R, C, D = cfg.rows, cfg.cols, cfg.size
        G = FloatMacArray.INTERLEAVE
        words_per_row = D // C
        acc_word = data.ArrayLayout(FP32_WIDTH, C)
        head, blocks_n = self.runs.payload, self.blocks_n
        sums = Signal(self.i.payload.sums.shape())
        group = Signal(range(G))
        row = Signal(range(R))
        row_addr = Signal(range(R * words_per_row + 1))  # row * words_per_row
        draining, draining_next = Signal(), Signal()
        m.d.comb += [self.i.ready.eq(~draining), self.ready_next.eq(~draining_next),
                     draining_next.eq(Mux(draining, row != R - 1, self.i.valid))]
        m.d.sync += draining.eq(draining_next)
        with m.If(self.i.valid & ~draining):
            m.d.sync += [sums.eq(self.i.payload.sums), group.eq(self.i.payload.group), row.eq(0), row_addr.eq(0)]
        with m.Elif(draining):
            m.d.sync += [row.eq(row + 1), row_addr.eq(row_addr + words_per_row)]
        m.d.comb += self.runs.ready.eq(draining & (row == R - 1) & (group == G - 1))
        block = head.jb0 + group
        live = draining & (block < blocks_n)  # a column-block beyond N is not written back
        last_live = (row == R - 1) & ((group == G - 1) | (block == blocks_n - 1))
        rows = Array(sums[i] for i in range(R))
        row_sums = Signal(acc_word)
        m.d.comb += row_sums.eq(rows[row])
        addr = Signal(range(D * words_per_row + G + R * words_per_row))
        m.d.comb += addr.eq(head.base + group + row_addr)

        acc_rd = self.acc_read
        old = Signal(acc_word)
        m.d.comb += [acc_rd.addr.eq(addr), acc_rd.en.eq(live)]
        m.d.sync += old.eq(acc_rd.data)
        La = AddF32Datapath.LATENCY
        lat = ACC_READ_LATENCY
        zero = delayed(m, head.first & ~self.accumulate, lat, "zero")
        sums_d = delayed(m, row_sums, lat, "row_sums")
        valid_d = delayed(m, live, lat, "live")
        for j in range(C):
            ad = AddF32Datapath()
            m.submodules[f"add{j}"] = ad
            m.d.comb += [ad.advance.eq(1), ad.in_valid.eq(valid_d), ad.a.eq(sums_d[j]),
                         ad.b.eq(Mux(zero, 0, old[j])), self.write.data[j].eq(ad.result)]
        m.d.comb += [
            self.write.en.eq(delayed(m, live, lat + La, "write_en")),
            self.write.addr.eq(delayed(m, addr, lat + La, "write_addr")),
            self.closed.eq(delayed(m, live & last_live & self.runs.payload.closes, lat + La, "closed")),
        ]
        return m


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
        rows_total = Signal(range(D + R + 1))
        with m.If(start):
            m.d.sync += [
                rows_total.eq(_ceil_table(D, R, R)[cmd.m]),
                plan.tiles_m.eq(_ceil_table(D, cfg.tile[0])[cmd.m]),
                plan.tiles_n.eq(_ceil_table(D, cfg.tile[1])[cmd.n]),
                plan.chunks.eq(_ceil_table(D, cfg.out_lanes)[cmd.n]),
            ]

        # ---- issue: runs of G * tk beats, beat n of a run step n // G of group n % G ---------
        # The drain's ready is a register, so the array's stall is one too (``ready_ahead``).
        m.submodules.mac = mac = FloatMacArray(R, C, self.fmt, tk, dsp_macs=cfg.dsp_macs, ready_ahead=True)
        m.submodules.issue = issue = FloatIssue(cfg, mac.i.payload.shape())
        m.d.comb += [issue.start.eq(start), issue.cmd.eq(cmd), issue.k.eq(desc.k)]
        connect_buffer(m, buf_a, read=issue.a_read)
        connect_buffer(m, buf_b, read=issue.b_read)
        wiring.connect(m, issue.o, mac.i)

        # ---- drain: a group's R x C sums, one row a cycle, into C adders and the accumulator --
        m.submodules.drain = drain = FloatDrain(cfg, mac.o.signature)
        wiring.connect(m, mac.o, drain.i)
        m.d.comb += mac.o_ready_next.eq(drain.ready_next)
        wiring.connect(m, issue.runs, drain.runs)
        m.d.comb += [drain.blocks_n.eq(issue.blocks_n), drain.accumulate.eq(desc.accumulate)]
        wiring.connect(m, drain.acc_read, acc_mem.read0)
        wb = drain.write
        # A host write of the accumulator is registered, and selects itself, as in GemmCore.
        host_acc = Signal()
        host_addr = Signal.like(acc_wr.addr)
        host_data = Signal(acc_word)
        m.d.sync += [host_acc.eq(w_fire & (w.target == Target.ACC)),
                     host_addr.eq(times_constant(w.row, words_per_row) + col_word),
                     host_data.eq(w.data.as_value()[:C * FP32_WIDTH])]
        m.d.comb += [
            acc_wr.en.eq(host_acc | wb.en),
            acc_wr.addr.eq(Mux(host_acc, host_addr, wb.addr)),
            acc_wr.data.eq(Mux(host_acc, host_data, wb.data)),
        ]

        rows_done, all_rows = rows_closed(m, cfg, start, cmd.k == 0, drain.closed, rows_total)
        count_cycles(m, self, busy, all_rows, started)

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
