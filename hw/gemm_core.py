"""The GEMM core: buffers, MAC array, normalizers, fp32 accumulators and the epilogue.

Given A and B of at most ``size`` x ``size`` in the operand buffers, a command computes
``act(op(A) @ op(B) + C + bias)`` exactly as ``hbfp.golden.gemm.gemm`` does, and streams the
result out in fp32, bf16 or the core's BFP format. docs/architecture.md draws the dataflow.

Phases of a command:

1. MAC: for each R x C output block, for each K-tile, ``tk`` beats of operand chunks go from
   the buffers to the MAC array; each K-tile's sums drain row by row through ``cols``
   normalizer lanes (with the tile exponents, prefetched while the K-tile streams) into
   ``cols`` fp32 adder lanes that read, add and write back the accumulator buffer. This part
   never stalls: the accumulator is read ``LATENCY`` cycles after a row drains and written
   back before the same row drains again ``tk`` cycles later.
2. Epilogue: the accumulator buffer streams out, ``cols`` values a beat, row-major (fp32,
   bf16) or tile-major (BFP), through the bias adders, the activation units and the output
   format, under the output stream's backpressure.
"""

from __future__ import annotations

from amaranth import Array, Const, Module, Mux, Signal
from amaranth.lib import data, fifo, memory, stream, wiring
from amaranth.lib.wiring import In, Out

from . import convert
from .activation import FUNC_WIDTH, UNARY_FUNCTIONS, ActivationDatapath
from .add_f32 import AddF32Datapath
from .buffers import READ_COLUMN, READ_ROW, OperandBuffer
from .mac_array import MacArray
from .normalize import NormalizeDatapath
from hbfp.contract import OutFormat, Rounding, Target

from .params import EXP_WIDTH, FP32_WIDTH, ConfigError, CoreConfig
from .quantize import Quantize

__all__ = ["GemmCore", "write_layout", "command_layout", "output_layout"]

# The write port's targets are the contract's ``Target`` codes below A_VALUES (the packet
# engine sends values through the quantizer first); a command's output format is ``OutFormat``
# and its rounding ``Rounding``: the enums are the ports' shapes.


def write_layout(cfg: CoreConfig) -> data.StructLayout:
    return data.StructLayout({
        "target": Target,
        "row": range(cfg.size),
        "col": range(cfg.size),
        "data": data.ArrayLayout(FP32_WIDTH, max(cfg.rows, cfg.cols)),
    })


def command_layout(cfg: CoreConfig) -> data.StructLayout:
    return data.StructLayout({
        "m": range(cfg.size + 1),
        "n": range(cfg.size + 1),
        "k": range(cfg.size + 1),
        "transpose_a": 1,
        "transpose_b": 1,
        "accumulate": 1,
        "bias": 1,
        "act_en": 1,
        "act_func": FUNC_WIDTH,
        "out_format": OutFormat,
        "rounding": Rounding,
        "seed": 32,
    })


def output_layout(cfg: CoreConfig) -> data.StructLayout:
    return data.StructLayout({
        "lanes": data.ArrayLayout(FP32_WIDTH, cfg.cols),
        "exponent": EXP_WIDTH,
        "last": 1,
    })


class GemmCore(wiring.Component):
    """``act(op(A) @ op(B) + C + bias)`` for operands up to ``cfg.size`` square.

    Ports:

    - ``w`` (stream in, ``write_layout``): loads a buffer while idle. ``a_codes``/``b_codes``:
      the row chunk (``row``, ``col`` .. ``col`` + lanes - 1) of the stored operand (lanes =
      ``rows`` for A, ``cols`` for B; codes in the low bits of each 32-bit lane). The stored
      operand is A (M x K) or, with ``transpose_a``, A^T (K x M); B (K x N) or, with
      ``transpose_b``, B^T (N x K). Regions beyond the product's K need not be cleared.
      ``a_exponents``/``b_exponents``: the E8M0 code of stored tile (``row``, ``col``) in lane 0.
      ``acc``: C (fp32) for row ``row``, columns ``col`` .. ``col`` + cols - 1.
      ``bias``: bias values for columns ``col`` .. ``col`` + cols - 1.
    - ``cmd`` (stream in, ``command_layout``): starts a product; accepted while idle.
    - ``o`` (stream out, ``output_layout``): the result, ``cols`` values a beat; fp32 and bf16
      row-major over ``ceil(N / cols)`` beats a row; BFP tile-major, ``exponent`` carrying the
      tile's code and the codes sign-extended in ``lanes``. Values outside M x N are zero.
      ``last`` marks the final beat.
    - ``busy``, ``error`` (a command with a zero M or N, a side above ``size``, transposes
      a non-square tile cannot serve, or a BFP output the core was built without (no
      ``cfg.bfp_output``, or stochastic without ``cfg.stochastic``); it produces no output), ``cycles`` (length of the last
      command, from acceptance to its last output beat).

    A command with K = 0 runs the epilogue alone: it reads the accumulator (C), with bias,
    activation and output format, which is how the host reads results back.
    """

    def __init__(self, cfg: CoreConfig = CoreConfig()):
        self.cfg = cfg
        super().__init__({
            "w": In(stream.Signature(write_layout(cfg))),
            "cmd": In(stream.Signature(command_layout(cfg))),
            "o": Out(stream.Signature(output_layout(cfg))),
            "busy": Out(1),
            "error": Out(1),
            "cycles": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self.cfg
        R, C, D, tk = cfg.rows, cfg.cols, cfg.size, cfg.tk
        th, tw = cfg.tile
        mb = cfg.mantissa_bits
        grid_cols = D // tw  # tile-grid pitch of the exponent buffers
        words_per_row = D // C  # accumulator words of a row

        # ---- storage -------------------------------------------------------------------
        m.submodules.buf_a = buf_a = OperandBuffer(R, mb, D, D)
        m.submodules.buf_b = buf_b = OperandBuffer(C, mb, D, D)
        exp_depth = (D // th) * grid_cols
        m.submodules.exp_a = exp_a = memory.Memory(shape=EXP_WIDTH, depth=exp_depth, init=[])
        m.submodules.exp_b = exp_b = memory.Memory(shape=EXP_WIDTH, depth=exp_depth, init=[])
        acc_word = data.ArrayLayout(FP32_WIDTH, C)
        m.submodules.acc_mem = acc_mem = memory.Memory(shape=acc_word, depth=D * words_per_row, init=[])
        m.submodules.bias_mem = bias_mem = memory.Memory(shape=acc_word, depth=words_per_row, init=[])
        exp_a_rd, exp_b_rd = exp_a.read_port(), exp_b.read_port()
        exp_a_wr, exp_b_wr = exp_a.write_port(), exp_b.write_port()
        acc_rd, acc_wr = acc_mem.read_port(), acc_mem.write_port()
        bias_rd, bias_wr = bias_mem.read_port(), bias_mem.write_port()

        # ---- command registers and the phase machine ---------------------------------
        desc = Signal(command_layout(cfg))
        busy = Signal()
        mac_phase = Signal()
        epi_phase = Signal()
        m.d.comb += [self.busy.eq(busy)]

        # Host writes (only while idle).
        w = self.w.payload
        m.d.comb += self.w.ready.eq(~busy)
        w_fire = self.w.valid & ~busy
        m.d.comb += [
            buf_a.w_en.eq(w_fire & (w.target == Target.A_CODES)),
            buf_a.w_row.eq(w.row),
            buf_a.w_col.eq(w.col),
            buf_b.w_en.eq(w_fire & (w.target == Target.B_CODES)),
            buf_b.w_row.eq(w.row),
            buf_b.w_col.eq(w.col),
            exp_a_wr.en.eq(w_fire & (w.target == Target.A_EXPONENTS)),
            exp_a_wr.addr.eq(w.row * grid_cols + w.col),
            exp_a_wr.data.eq(w.data[0]),
            exp_b_wr.en.eq(w_fire & (w.target == Target.B_EXPONENTS)),
            exp_b_wr.addr.eq(w.row * grid_cols + w.col),
            exp_b_wr.data.eq(w.data[0]),
            bias_wr.en.eq(w_fire & (w.target == Target.BIAS)),
            bias_wr.addr.eq(w.col // C),
        ]
        for t in range(R):
            m.d.comb += buf_a.w_data[t].eq(w.data[t])
        for t in range(C):
            m.d.comb += [buf_b.w_data[t].eq(w.data[t]), bias_wr.data[t].eq(w.data[t])]

        # Command acceptance and validation.
        cmd = self.cmd.payload
        # K = 0 reads the accumulator through the epilogue (no MAC phase).
        bad = (cmd.m == 0) | (cmd.n == 0) | (cmd.m > D) | (cmd.n > D) | (cmd.k > D)
        if not cfg.square:
            bad = bad | ((cmd.k != 0) & (cmd.transpose_a | ~cmd.transpose_b))
        cmd_bfp = cmd.out_format == OutFormat.BFP
        if not cfg.bfp_output:
            bad = bad | cmd_bfp
        elif not cfg.stochastic:
            bad = bad | (cmd_bfp & (cmd.rounding == Rounding.STOCHASTIC))
        m.d.comb += self.cmd.ready.eq(~busy & ~self.w.valid)
        start = Signal()
        m.d.comb += start.eq(self.cmd.valid & self.cmd.ready & ~bad)
        with m.If(self.cmd.valid & self.cmd.ready):
            m.d.sync += self.error.eq(bad)
            with m.If(~bad):
                m.d.sync += [desc.eq(cmd), busy.eq(1), mac_phase.eq(cmd.k != 0), self.cycles.eq(0)]
        with m.If(busy):
            m.d.sync += self.cycles.eq(self.cycles + 1)

        # Block, K-tile and tile counts of the command, registered with the descriptor. They
        # come from small tables indexed by the side (no divider in the command path).
        def ceil_table(divisor):
            return Array(Const(-(-v // divisor), range(D // divisor + 1)) for v in range(D + 1))

        blocks_m = Signal(range(D // R + 1))
        blocks_n = Signal(range(D // C + 1))
        ktiles = Signal(range(D // tk + 1))
        tiles_m = Signal(range(D // th + 1))
        tiles_n = Signal(range(D // tw + 1))
        with m.If(self.cmd.valid & self.cmd.ready):
            m.d.sync += [
                blocks_m.eq(ceil_table(R)[cmd.m]),
                blocks_n.eq(ceil_table(C)[cmd.n]),
                ktiles.eq(ceil_table(tk)[cmd.k]),
                tiles_m.eq(ceil_table(th)[cmd.m]),
                tiles_n.eq(ceil_table(tw)[cmd.n]),
            ]

        # ---- MAC phase: operand beats ----------------------------------------------------
        m.submodules.mac = mac = MacArray(R, C, tk, mb, mb)
        beat_layout = mac.i.payload.shape()
        m.submodules.beats = beats = fifo.SyncFIFO(width=beat_layout.size, depth=4)
        exps_layout = data.StructLayout({
            "ea": data.ArrayLayout(EXP_WIDTH, R),
            "eb": data.ArrayLayout(EXP_WIDTH, C),
            "base": range(D * words_per_row),  # accumulator address of the block's row 0
            "first": 1,
        })
        m.submodules.exps = exps = fifo.SyncFIFO(width=exps_layout.size, depth=4)

        ib = Signal(range(D // R))
        jb = Signal(range(D // C))
        kt = Signal(range(D // tk))
        kk = Signal(range(tk))
        issuing = Signal()  # the issue loop has beats left
        k = Signal(range(D + tk))  # kt * tk + kk, counted rather than multiplied
        # One beat is in flight between the buffer read and the FIFO.
        issue = Signal()
        prefetch_busy = Signal()
        m.d.comb += issue.eq(issuing & (beats.level < 3) & ~((kk == 0) & (prefetch_busy | (exps.level >= 3))))
        with m.If(start):
            m.d.sync += [issuing.eq(cmd.k != 0), ib.eq(0), jb.eq(0), kt.eq(0), kk.eq(0), k.eq(0)]
        with m.If(issue):
            m.d.sync += [kk.eq(kk + 1), k.eq(k + 1)]
            with m.If(kk == tk - 1):
                m.d.sync += [kk.eq(0), kt.eq(kt + 1)]
                with m.If(kt == ktiles - 1):
                    m.d.sync += [kt.eq(0), k.eq(0), jb.eq(jb + 1)]
                    with m.If(jb == blocks_n - 1):
                        m.d.sync += [jb.eq(0), ib.eq(ib + 1)]
                        with m.If(ib == blocks_m - 1):
                            m.d.sync += issuing.eq(0)

        # A column chunk of A (rows ib*R.., column k) is read as such, or as a row chunk of
        # the stored A^T; a row chunk of B (row k, columns jb*C..) likewise from B or B^T.
        m.d.comb += [
            buf_a.r_en.eq(issue),
            buf_a.r_mode.eq(Mux(desc.transpose_a, READ_ROW, READ_COLUMN)),
            buf_a.r_row.eq(Mux(desc.transpose_a, k, ib * R)),
            buf_a.r_col.eq(Mux(desc.transpose_a, ib * R, k)),
            buf_b.r_en.eq(issue),
            buf_b.r_mode.eq(Mux(desc.transpose_b, READ_COLUMN, READ_ROW)),
            buf_b.r_row.eq(Mux(desc.transpose_b, jb * C, k)),
            buf_b.r_col.eq(Mux(desc.transpose_b, k, jb * C)),
        ]
        read_valid = Signal()
        read_pad = Signal()  # k beyond K: the buffer may hold stale codes there
        m.d.sync += [read_valid.eq(issue), read_pad.eq(k >= desc.k)]
        beat = Signal(beat_layout)
        for t in range(R):
            m.d.comb += beat.a[t].eq(Mux(read_pad, 0, buf_a.r_data[t]))
        for t in range(C):
            m.d.comb += beat.b[t].eq(buf_b.r_data[t])
        m.d.comb += [
            beats.w_en.eq(read_valid),
            beats.w_data.eq(beat),
            mac.i.valid.eq(beats.r_rdy),
            mac.i.payload.eq(beats.r_data),
            beats.r_en.eq(mac.i.ready),
        ]

        # Exponent prefetch: while a K-tile streams, read the R exponents of A's rows and the
        # C exponents of B's columns for it (max(R, C) <= tk cycles), then queue them.
        p = Signal(range(max(R, C) + 2))
        pf_ib = Signal.like(ib)
        pf_jb = Signal.like(jb)
        pf_kt = Signal.like(kt)
        stage = Signal(exps_layout)
        with m.If(issue & (kk == 0)):
            m.d.sync += [prefetch_busy.eq(1), p.eq(0), pf_ib.eq(ib), pf_jb.eq(jb), pf_kt.eq(kt), stage.first.eq(kt == 0)]
        with m.Elif(prefetch_busy):
            m.d.sync += p.eq(p + 1)
        with m.If(prefetch_busy & (p == 0)):
            m.d.sync += stage.base.eq(pf_ib * (R * words_per_row) + pf_jb)
        row_tile = Array(Const(i // th, range(D // th)) for i in range(D))
        col_tile = Array(Const(i // tw, range(D // tw)) for i in range(D))
        ia = Signal(range(D))
        jbv = Signal(range(D))
        m.d.comb += [ia.eq(pf_ib * R + p), jbv.eq(pf_jb * C + p)]
        # Exponent of A's row i in K-tile kt: tile (i // th, kt) of A, or (kt, i // tw) of A^T;
        # of B's column j: tile (kt, j // tw) of B, or (j // th, kt) of B^T.
        m.d.comb += [
            exp_a_rd.addr.eq(Mux(desc.transpose_a, pf_kt * grid_cols + col_tile[ia], row_tile[ia] * grid_cols + pf_kt)),
            exp_b_rd.addr.eq(Mux(desc.transpose_b, row_tile[jbv] * grid_cols + pf_kt, pf_kt * grid_cols + col_tile[jbv])),
        ]
        p_prev = Signal.like(p)
        m.d.sync += p_prev.eq(p)
        with m.If(prefetch_busy & (p >= 1)):
            for t in range(R):
                with m.If(p_prev == t):
                    m.d.sync += stage.ea[t].eq(exp_a_rd.data)
            for t in range(C):
                with m.If(p_prev == t):
                    m.d.sync += stage.eb[t].eq(exp_b_rd.data)
        pf_end = max(R, C) + 1
        with m.If(prefetch_busy & (p == pf_end)):
            m.d.sync += prefetch_busy.eq(0)
        m.d.comb += [exps.w_en.eq(prefetch_busy & (p == pf_end)), exps.w_data.eq(stage)]

        # ---- MAC phase: drain, normalize, accumulate ----------------------------------
        head = Signal(exps_layout)
        m.d.comb += [head.eq(exps.r_data), mac.o.ready.eq(1)]
        drain = mac.o.valid
        m.d.comb += exps.r_en.eq(drain & (mac.o.payload.row == R - 1))
        ea_row = Signal(EXP_WIDTH)
        ea_lanes = Array(head.ea[t] for t in range(R))
        m.d.comb += ea_row.eq(ea_lanes[mac.o.payload.row])

        norms, adders = [], []
        for j in range(C):
            nd = NormalizeDatapath(mac.psum_width, mb, mb)
            ad = AddF32Datapath()
            m.submodules[f"normalize{j}"] = nd
            m.submodules[f"add{j}"] = ad
            norms.append(nd)
            adders.append(ad)
        Ln, La = NormalizeDatapath.LATENCY, AddF32Datapath.LATENCY
        if Ln + La + 2 > tk:  # CoreConfig refuses such a configuration first (rmw_latency)
            raise ConfigError(f"the accumulator's read-modify-write ({Ln + La + 2} cycles: normalizer {Ln}, adder "
                              f"{La}, read and write 2) must finish within a K-tile, got a K-tile of {tk} cycles")

        # Side channel beside the normalizers: the accumulator address and "start from +0".
        side = data.StructLayout({"valid": 1, "addr": range(D * words_per_row), "zero": 1})
        side_line = [Signal(side, name=f"side{s}") for s in range(Ln + La + 1)]
        row_offset = Array(Const(t * words_per_row, range(R * words_per_row)) for t in range(R))
        m.d.sync += [
            side_line[0].valid.eq(drain),
            side_line[0].addr.eq(head.base + row_offset[mac.o.payload.row]),
            side_line[0].zero.eq(head.first & ~desc.accumulate),
        ]
        for s in range(1, len(side_line)):
            m.d.sync += side_line[s].eq(side_line[s - 1])

        # Epilogue read requests share the accumulator read port (the phases never overlap).
        epi_addr = Signal(range(D * words_per_row))
        epi_read = Signal()
        at_norm_out = side_line[Ln - 1]  # aligned with the normalizers' outputs
        mac_read = side_line[Ln - 2]  # the read is issued one cycle before its data is used
        # Without a bias the epilogue reads each word again La - 1 stages later (``late_read``,
        # below), when its value is due at the bias stage's end: no delay line of values.
        late_read = Signal(range(D * words_per_row))
        epi_advance = Signal()
        m.d.comb += [
            acc_rd.en.eq(Mux(mac_phase, 1, Mux(desc.bias, epi_read, epi_advance))),
            acc_rd.addr.eq(Mux(mac_phase, mac_read.addr, Mux(desc.bias, epi_addr, late_read))),
        ]
        for j in range(C):
            nd, ad = norms[j], adders[j]
            m.d.comb += [
                nd.advance.eq(1),
                nd.i_valid.eq(drain),
                nd.i_s.eq(mac.o.payload.sums[j]),
                nd.i_exp_a.eq(ea_row),
                nd.i_exp_b.eq(head.eb[j]),
            ]

        # ---- epilogue ----------------------------------------------------------------
        # e0: the read issued in the previous advancing cycle; aligned with the read data.
        e0 = Signal(data.StructLayout({"valid": 1, "row": range(D + 1), "col": range(D + C), "last": 1,
                                       "addr": range(D * words_per_row)}))
        bias_en = desc.bias
        # Adders: the MAC phase's accumulation, then the epilogue's bias.
        for j in range(C):
            nd, ad = norms[j], adders[j]
            m.d.comb += [
                ad.advance.eq(Mux(mac_phase, 1, epi_advance)),
                ad.in_valid.eq(Mux(mac_phase, nd.o_valid, e0.valid)),
                ad.a.eq(Mux(mac_phase, nd.o_result, acc_rd.data[j])),
                ad.b.eq(Mux(mac_phase, Mux(at_norm_out.zero, 0, acc_rd.data[j]), bias_rd.data[j])),
            ]
        wb = side_line[Ln - 1 + La]
        m.d.comb += [
            acc_wr.en.eq(Mux(busy, mac_phase & wb.valid, w_fire & (w.target == Target.ACC))),
            acc_wr.addr.eq(Mux(busy, wb.addr, w.row * words_per_row + w.col // C)),
        ]
        for j in range(C):
            m.d.comb += acc_wr.data[j].eq(Mux(busy, adders[j].result, w.data[j]))

        # MAC phase ends when every K-tile has drained and the last write-back is done; a
        # command with K = 0 goes to the epilogue one cycle after it is accepted (once the
        # descriptor is in its register).
        flush = Signal(range(Ln + La + 4))
        epi_kick = Signal()
        m.d.sync += epi_kick.eq(start & (cmd.k == 0))
        epi_start = Signal()
        m.d.comb += epi_start.eq((mac_phase & (flush == Ln + La + 2)) | epi_kick)
        with m.If(epi_kick):
            m.d.sync += epi_phase.eq(1)
        with m.If(mac_phase & ~issuing & ~beats.r_rdy & ~exps.r_rdy & ~mac.o.valid & ~read_valid & ~prefetch_busy):
            m.d.sync += flush.eq(flush + 1)
            with m.If(flush == Ln + La + 2):
                m.d.sync += [mac_phase.eq(0), epi_phase.eq(1), flush.eq(0)]
        with m.Else():
            m.d.sync += flush.eq(0)

        # Epilogue issue order: row-major (row, word) for fp32/bf16; tile-major for BFP. The
        # row, word and address are counters (no multiplier between them and the buffer).
        bfp_out = desc.out_format == OutFormat.BFP if cfg.bfp_output else Const(0)
        words_tile = tw // C
        row_now = Signal(range(D + 1))
        word_now = Signal(range(D // C + 1))
        row_addr = Signal(range((D + 1) * words_per_row))  # row_now * words_per_row
        t_i = Signal(range(D // th + 1))  # BFP: tile row, tile col, row in tile, word in tile row
        t_j = Signal(range(D // tw + 1))
        t_r = Signal(range(th))
        t_w = Signal(range(words_tile))
        row_base = Signal(range(D + 1))  # BFP: first row and word of the current tile
        row_base_addr = Signal(range((D + 1) * words_per_row))
        word_base = Signal(range(D // C + 1))
        epi_issuing = Signal()
        with m.If(epi_start):
            m.d.sync += [epi_issuing.eq(1), row_now.eq(0), word_now.eq(0), row_addr.eq(0), t_i.eq(0), t_j.eq(0),
                         t_r.eq(0), t_w.eq(0), row_base.eq(0), row_base_addr.eq(0), word_base.eq(0)]
        last_now = Signal()
        m.d.comb += last_now.eq(Mux(
            bfp_out,
            (t_i == tiles_m - 1) & (t_j == tiles_n - 1) & (t_r == th - 1) & (t_w == words_tile - 1),
            (row_now == desc.m - 1) & (word_now == blocks_n - 1),
        ))
        m.d.comb += [
            epi_read.eq(epi_issuing & epi_advance),
            epi_addr.eq(row_addr + word_now),
            bias_rd.en.eq(epi_advance),
            bias_rd.addr.eq(word_now),
        ]
        with m.If(epi_read):
            with m.If(bfp_out):
                with m.If(t_w != words_tile - 1):
                    m.d.sync += [t_w.eq(t_w + 1), word_now.eq(word_now + 1)]
                with m.Elif(t_r != th - 1):
                    m.d.sync += [t_w.eq(0), word_now.eq(word_base), t_r.eq(t_r + 1), row_now.eq(row_now + 1),
                                 row_addr.eq(row_addr + words_per_row)]
                with m.Elif(t_j != tiles_n - 1):
                    m.d.sync += [t_w.eq(0), t_r.eq(0), t_j.eq(t_j + 1), word_base.eq(word_base + words_tile),
                                 word_now.eq(word_base + words_tile), row_now.eq(row_base), row_addr.eq(row_base_addr)]
                with m.Else():
                    m.d.sync += [t_w.eq(0), t_r.eq(0), t_j.eq(0), t_i.eq(t_i + 1), word_base.eq(0), word_now.eq(0),
                                 row_base.eq(row_base + th), row_now.eq(row_base + th),
                                 row_base_addr.eq(row_base_addr + th * words_per_row),
                                 row_addr.eq(row_base_addr + th * words_per_row)]
            with m.Else():
                with m.If(word_now != blocks_n - 1):
                    m.d.sync += word_now.eq(word_now + 1)
                with m.Else():
                    m.d.sync += [word_now.eq(0), row_now.eq(row_now + 1), row_addr.eq(row_addr + words_per_row)]
            with m.If(last_now):
                m.d.sync += epi_issuing.eq(0)
        with m.If(epi_advance):
            m.d.sync += [
                e0.valid.eq(epi_read),
                e0.row.eq(row_now),
                e0.col.eq(word_now * C),  # C is a power of two: a shift
                e0.last.eq(last_now),
                e0.addr.eq(epi_addr),
            ]

        # Bias stage: the adders (La cycles), or, without a bias, the accumulator read again
        # from the address the stage before last carries, so that the read port's data (which
        # moves only when the pipeline advances) comes with the last stage's position.
        assert La >= 2
        meta = data.StructLayout({"row": range(D + 1), "col": range(D + C), "last": 1})
        by_line = [Signal(data.StructLayout({"meta": meta, "addr": range(D * words_per_row)}), name=f"bias_stage{s}")
                   for s in range(La)]
        with m.If(epi_advance):
            m.d.sync += [by_line[0].meta.row.eq(e0.row), by_line[0].meta.col.eq(e0.col), by_line[0].meta.last.eq(e0.last),
                         by_line[0].addr.eq(e0.addr)]
            for s in range(1, La):
                m.d.sync += by_line[s].eq(by_line[s - 1])
        m.d.comb += late_read.eq(by_line[La - 2].addr)
        b_valid = adders[0].out_valid
        b_meta = by_line[La - 1].meta
        # Without a bias the value bypasses the adder; the flush is the adder's DAZ, which
        # only matters for a C read back with K = 0 (sums never come out subnormal).
        b_vals = [Mux(bias_en, adders[j].result, convert.flush_f32(acc_rd.data[j])) for j in range(C)]

        # Activation stage: C units (or a bypass line), bf16 in and out. A core built without
        # unary functions has no stage (its commands never ask for an activation).
        act_en = desc.act_en
        unary = tuple(f for f in cfg.built_functions if f in UNARY_FUNCTIONS)
        fp32_vals, bf16_vals = [], []
        if not unary:
            # The adders also run during the MAC phase: only epilogue values go on.
            f_valid, f_meta = b_valid & epi_phase, b_meta
            for j in range(C):
                fp32_vals.append(b_vals[j])
                bf16_vals.append(convert.from_f32(b_vals[j]))
        else:
            acts = []
            for j in range(C):
                ad = ActivationDatapath(leaky_shift=cfg.leaky_shift, functions=cfg.built_functions)
                m.submodules[f"act{j}"] = ad
                acts.append(ad)
            Lact = ActivationDatapath.LATENCY
            a_line = [Signal(data.StructLayout({"meta": meta, "val": acc_word}), name=f"act_bypass{s}")
                      for s in range(Lact)]
            with m.If(epi_advance):
                m.d.sync += [a_line[0].meta.eq(b_meta)]
                for j in range(C):
                    m.d.sync += a_line[0].val[j].eq(b_vals[j])
                for s in range(1, Lact):
                    m.d.sync += a_line[s].eq(a_line[s - 1])
            for j in range(C):
                m.d.comb += [
                    acts[j].advance.eq(epi_advance),
                    # The adders also run during the MAC phase: only epilogue values go on.
                    acts[j].i_valid.eq(b_valid & epi_phase),
                    acts[j].i.x.eq(convert.from_f32(b_vals[j])),
                    acts[j].i.g.eq(0),
                    acts[j].i.func.eq(desc.act_func),
                ]
            f_valid = acts[0].o_valid
            f_meta = a_line[Lact - 1].meta
            for j in range(C):
                acc32 = a_line[Lact - 1].val[j]
                fp32_vals.append(Mux(act_en, convert.to_f32(acts[j].o), acc32))
                bf16_vals.append(Mux(act_en, acts[j].o, convert.from_f32(acc32)))

        # Output stage: a register for fp32/bf16, the quantizer for BFP.
        out_reg = Signal(output_layout(cfg))
        out_valid = Signal()
        sink_ready = Signal()
        m.d.comb += epi_advance.eq(~out_valid | sink_ready)
        with m.If(epi_advance):
            m.d.sync += out_valid.eq(f_valid & epi_phase)
            m.d.sync += [out_reg.last.eq(f_meta.last), out_reg.exponent.eq(0)]
            for j in range(C):
                inside = (f_meta.row < desc.m) & (f_meta.col + j < desc.n)
                val = Mux(desc.out_format == OutFormat.BF16, bf16_vals[j], fp32_vals[j])
                m.d.sync += out_reg.lanes[j].eq(Mux(inside, val, 0))
        out_fire = self.o.valid & self.o.ready
        if not cfg.bfp_output:  # a reduced core: fp32 and bf16 results only
            m.d.comb += [sink_ready.eq(self.o.ready), self.o.valid.eq(out_valid), self.o.payload.eq(out_reg)]
        else:
            m.submodules.quantize = qz = Quantize(mb, cfg.tile, C, "fp32", stochastic=cfg.stochastic)
            m.d.comb += [qz.rounding.eq(desc.rounding), qz.seed.eq(desc.seed), qz.clear.eq(start)]
            m.d.comb += sink_ready.eq(Mux(bfp_out, qz.i.ready, self.o.ready))
            for j in range(C):
                m.d.comb += qz.i.payload[j].eq(out_reg.lanes[j])
            m.d.comb += qz.i.valid.eq(out_valid & bfp_out)

            # BFP output: count tiles so that the last beat of the last tile carries ``last``.
            tiles_left = Signal(range((D // th) * (D // tw) + 1))
            with m.If(start):
                m.d.sync += tiles_left.eq(0)
            with m.If(epi_start):
                m.d.sync += tiles_left.eq(tiles_m * tiles_n)
            q_last = qz.o.payload.last & (tiles_left == 1)
            with m.If(bfp_out):
                m.d.comb += [
                    self.o.valid.eq(qz.o.valid),
                    qz.o.ready.eq(self.o.ready),
                    self.o.payload.exponent.eq(qz.o.payload.exponent),
                    self.o.payload.last.eq(q_last),
                ]
                for j in range(C):
                    m.d.comb += self.o.payload.lanes[j].eq(qz.o.payload.codes[j].as_signed())
            with m.Else():
                m.d.comb += [self.o.valid.eq(out_valid), self.o.payload.eq(out_reg)]
            with m.If(out_fire & bfp_out & qz.o.payload.last):
                m.d.sync += tiles_left.eq(tiles_left - 1)
        with m.If(out_fire & self.o.payload.last):
            m.d.sync += [busy.eq(0), epi_phase.eq(0)]
        return m
