"""The GEMM core: buffers, MAC array, accumulate lanes and the epilogue.

Given A and B of at most ``size`` x ``size`` in the operand buffers, a command computes
``act(op(A) @ op(B) + C + bias)`` exactly as ``hbfp.golden.gemm.gemm`` does, and streams the
result out in fp32, bf16 or the core's BFP format. docs/architecture.md draws the dataflow.

A command runs two overlapping phases:

1. MAC: for each R x C output block (row-blocks of R rows, column-blocks of C columns), for
   each K-tile, ``tk`` beats of operand chunks go from the buffers to the MAC array, one a
   cycle (``MacIssue``); the exponents of the K-tile's tiles are prefetched while it streams
   (``ExponentPrefetch``). Each K-tile's sums drain row by row (``DrainRegister``) into the
   accumulate lanes (``hw.accumulate``), which normalize them and add them into the
   accumulator buffer. Nothing in this phase waits for the output.
2. Epilogue (``hw.epilogue``): a row of the accumulator goes out through bias, activation and
   output format as soon as its row-block is closed, so a row-block's results stream while the
   next row-block computes. The output's backpressure reaches only the epilogue's issue.

The two read the accumulator through separate ports; the exponent memories, the
accumulator, the bias and the operand banks all have registered outputs. The host writes them
while the core is idle (``HostWrites``).
"""

from __future__ import annotations

from amaranth import Array, Const, Module, Mux, Signal, Value, signed
from amaranth.lib import data, fifo, memory, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import ceil_log2

from hbfp.contract import OutFormat, Rounding, Target

from .accumulate import Accumulate, delayed, drain_layout
from .activation import FUNC_WIDTH
from .block_ram import BlockRam
from .buffers import NO_RW_CHECK, READ_COLUMN, READ_ROW, OperandBuffer, times_constant
from .epilogue import Epilogue, output_layout, plan_layout, rows_closed
from .mac_array import MacArray
from .params import ACC_READ_LATENCY, EXP_WIDTH, FP32_WIDTH, OPERAND_READ_LATENCY, PREFETCH_CYCLES, CoreConfig

__all__ = [
    "GemmCore", "core_signature", "accept_command", "count_cycles", "command_error", "write_layout", "command_layout", "output_layout",
    "BufferWriteSignature", "BufferReadSignature", "connect_buffer", "AccWriteSignature", "exponent_grid", "issue_layout", "exponents_layout", "HostWrites", "MacIssue",
    "ExponentPrefetch", "DrainRegister",
]

# The write port's targets are the contract's ``Target`` codes below A_VALUES (the packet
# engine sends values through the quantizer first); a command's output format is ``OutFormat``
# and its rounding ``Rounding``: the enums are the ports' shapes.


def write_layout(cfg: CoreConfig) -> data.StructLayout:
    return data.StructLayout({
        "target": Target,
        "row": range(cfg.size),
        "col": range(cfg.size),
        "data": data.ArrayLayout(FP32_WIDTH, max(cfg.rows, cfg.cols)),
        "skip": max(cfg.rows, cfg.cols),  # operand codes: lanes not to write (0: the whole chunk)
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


def _ceil_table(size: int, divisor: int, scale: int = 1) -> Array:
    """``ceil(v / divisor) * scale`` for v = 0 .. size, as a table indexed by a side (no divider)."""
    return Array(Const(-(-v // divisor) * scale, range((size // divisor + 1) * scale + 1)) for v in range(size + 1))


def core_signature(cfg: CoreConfig) -> wiring.Signature:
    """The ports of a GEMM core (``GemmCore``, and ``hw.float_core.FloatCore``)."""
    return wiring.Signature({
        "w": In(stream.Signature(write_layout(cfg))),
        "cmd": In(stream.Signature(command_layout(cfg))),
        "o": Out(stream.Signature(output_layout(cfg))),
        "busy": Out(1),
        "error": Out(1),
        "cycles": Out(32),
    })


def accept_command(m: Module, core: wiring.Component, desc, busy, bad):
    """A core's command acceptance (``GemmCore``, ``hw.float_core.FloatCore``): ``cmd`` is taken
    while idle and no write waits; a ``bad`` command sets ``error`` and starts nothing; a good
    one is registered in ``desc`` and sets ``busy`` (``count_cycles`` restarts ``cycles`` from
    ``started``). Returns ``(start, started)``: the accepting cycle, and the next one (``desc``
    valid)."""
    m.d.comb += core.cmd.ready.eq(~busy & ~core.w.valid)
    accept = core.cmd.valid & core.cmd.ready
    start = Signal()
    m.d.comb += start.eq(accept & ~bad)
    started = Signal()
    m.d.sync += started.eq(start)
    with m.If(accept):
        m.d.sync += core.error.eq(bad)
    with m.If(start):
        m.d.sync += [desc.eq(core.cmd.payload), busy.eq(1)]
    return start, started


def count_cycles(m: Module, core: wiring.Component, busy, all_rows_next, started):
    """A core's ``cycles``: from the cycle after acceptance (``started``: the count is 0 there)
    while some row-block's sums are still to be closed (``all_rows_next``, ``rows_closed``'s);
    the epilogue after them goes at the reply's pace and is not counted. A K = 0 command counts
    0. The count restarts from ``started``, a register, rather than from the accepting cycle's
    decision (whose fan-out across the die it would lengthen): it reads as the last command's
    in that one cycle, and the reply, which reads it, comes long after."""
    sums_in = Signal()  # every row closed (``rows_closed``'s count, registered)
    m.d.sync += sums_in.eq(all_rows_next)
    counting = busy & ~sums_in
    with m.If(started):
        m.d.sync += core.cycles.eq(counting)
    with m.Elif(counting):
        m.d.sync += core.cycles.eq(core.cycles + 1)


class BufferWriteSignature(wiring.Signature):
    """An ``OperandBuffer``'s write request, from the writer's side (its ``w_en``, ``w_row``,
    ``w_col``, ``w_skip``, ``w_data``): the row chunk (``row``, ``col`` ..) of ``lanes`` codes,
    lanes whose ``skip`` bit is set left as they are."""

    def __init__(self, lanes: int, code_width: int, size: int):
        super().__init__({
            "en": Out(1),
            "row": Out(range(size)),
            "col": Out(range(size)),
            "skip": Out(lanes),
            "data": Out(data.ArrayLayout(signed(code_width), lanes)),
        })


class BufferReadSignature(wiring.Signature):
    """An ``OperandBuffer``'s read, from the reader's side (its ``r_en``, ``r_mode``, ``r_row``,
    ``r_col``, ``r_data``): a row or a column chunk of ``lanes`` codes."""

    def __init__(self, lanes: int, code_width: int, size: int):
        super().__init__({
            "en": Out(1),
            "mode": Out(1),
            "row": Out(range(size)),
            "col": Out(range(size)),
            "data": In(data.ArrayLayout(signed(code_width), lanes)),
        })


def connect_buffer(m: Module, buffer: OperandBuffer, *, write=None, read=None):
    """Join a ``BufferWriteSignature`` port (``write``) and a ``BufferReadSignature`` port
    (``read``) to the operand buffer's write and read ports."""
    if write is not None:
        m.d.comb += [buffer.w_en.eq(write.en), buffer.w_row.eq(write.row), buffer.w_col.eq(write.col),
                     buffer.w_skip.eq(write.skip), buffer.w_data.eq(write.data)]
    if read is not None:
        m.d.comb += [buffer.r_en.eq(read.en), buffer.r_mode.eq(read.mode), buffer.r_row.eq(read.row),
                     buffer.r_col.eq(read.col), read.data.eq(buffer.r_data)]


class AccWriteSignature(wiring.Signature):
    """A write of a whole accumulator word (every column), from the writer's side."""

    def __init__(self, cfg: CoreConfig):
        D, C = cfg.size, cfg.cols
        super().__init__({
            "en": Out(1),
            "addr": Out(max(1, (D * (D // C) - 1).bit_length())),
            "data": Out(data.ArrayLayout(FP32_WIDTH, C)),
        })


def exponent_grid(cfg: CoreConfig) -> int:
    """Words of an exponent memory: a code per stored tile, ``size / th`` x ``size / tw``."""
    return (cfg.size // cfg.tile[0]) * (cfg.size // cfg.tile[1])


def command_error(cfg: CoreConfig, cmd) -> Value:
    """Whether ``GemmCore`` refuses command ``cmd`` (``command_layout``): a zero M or N, a side
    above ``size``, transposes a non-square tile cannot serve, or a BFP output the core was
    built without (no ``cfg.bfp_output``, or stochastic without ``cfg.stochastic``)."""
    D = cfg.size
    # K = 0 reads the accumulator through the epilogue (no MAC phase).
    bad = (cmd.m == 0) | (cmd.n == 0) | (cmd.m > D) | (cmd.n > D) | (cmd.k > D)
    if not cfg.square:
        bad = bad | ((cmd.k != 0) & (cmd.transpose_a | ~cmd.transpose_b))
    cmd_bfp = cmd.out_format == OutFormat.BFP
    if not cfg.bfp_output:
        bad = bad | cmd_bfp
    elif not cfg.stochastic:
        bad = bad | (cmd_bfp & (cmd.rounding == Rounding.STOCHASTIC))
    return bad


def issue_layout(cfg: CoreConfig) -> data.StructLayout:
    """A beat of the MAC phase (``MacIssue.beat``): its K index, the output block's first row and
    column and its K-tile, the accumulator address of the block's row 0, whether it is a
    K-tile's first beat, and whether that K-tile is a row-block's last (it *closes* it)."""
    D, tk = cfg.size, cfg.tk
    return data.StructLayout({
        "k": range(D + tk),
        "row0": range(D),
        "col0": range(D),
        "kt": range(D // tk),
        "base": range(D * (D // cfg.cols)),
        "first": 1,
        "closes": 1,
    })


def exponents_layout(cfg: CoreConfig) -> data.StructLayout:
    """A K-tile's exponents (``ExponentPrefetch.o``): the R exponents of A's rows and the C of
    B's columns, the accumulator address of the block's row 0, whether it is the block's first
    K-tile and whether it closes a row-block."""
    return data.StructLayout({
        "ea": data.ArrayLayout(EXP_WIDTH, cfg.rows),
        "eb": data.ArrayLayout(EXP_WIDTH, cfg.cols),
        "base": range(cfg.size * (cfg.size // cfg.cols)),  # accumulator address of the block's row 0
        "first": 1,  # the block's first K-tile
        "closes": 1,  # the last K-tile of a row-block's last block
    })


def _single(size: int, divisor: int) -> Array:
    """``ceil(v / divisor) <= 1`` for v = 0 .. size, as a table indexed by a side."""
    return Array(Const(v <= divisor, 1) for v in range(size + 1))


class MacIssue(wiring.Component):
    """The MAC phase's loop: for each R x C output block (row-blocks of R rows, each column-block
    of C columns in turn), for each K-tile, ``tk`` beats (``issue_layout``), one a cycle.

    Ports: ``start`` (strobe: ``cmd``, the command being accepted, is valid); ``beat`` (stream
    out): valid while the command has beats left (none for K = 0); the consumer may hold a
    K-tile's first beat (``ready`` low) until it can take the K-tile.

    Where each counter stands is kept in flags beside it (registers, so that the loop's next
    state and its fan-out to the counters and the buffers' requests start from flip-flops, not
    from compares): kk at 0 or at tk - 1, kt, jb and ib at their last value; and which counters
    the next issue moves on (``kt_wrap``, ``jb_wrap``, ``ib_wrap``), so that each counter's
    enable is the issue decision and one register.
    """

    def __init__(self, cfg: CoreConfig):
        self.cfg = cfg
        super().__init__({
            "start": In(1),
            "cmd": In(command_layout(cfg)),
            "beat": Out(stream.Signature(issue_layout(cfg))),
        })

    def elaborate(self, platform):
        m = Module()
        cfg, start, cmd = self.cfg, self.start, self.cmd
        R, C, D, tk = cfg.rows, cfg.cols, cfg.size, cfg.tk
        words_per_row = D // C

        # Block and K-tile counts of the command, registered with it.
        blocks_m = Signal(range(D // R + 1))
        blocks_n = Signal(range(D // C + 1))
        ktiles = Signal(range(D // tk + 1))
        with m.If(start):
            m.d.sync += [
                blocks_m.eq(_ceil_table(D, R)[cmd.m]),
                blocks_n.eq(_ceil_table(D, C)[cmd.n]),
                ktiles.eq(_ceil_table(D, tk)[cmd.k]),
            ]

        ib = Signal(range(D // R))
        jb = Signal(range(D // C))
        kt = Signal(range(D // tk))
        kk = Signal(range(tk))
        k = Signal(range(D + tk))  # kt * tk + kk
        row0 = Signal(range(D))  # ib * R
        col0 = Signal(range(D))  # jb * C
        block_base = Signal(range(D * words_per_row))  # ib * R * words_per_row + jb
        row_base = Signal(range(D * words_per_row))  # ib * R * words_per_row
        issuing = Signal()  # the issue loop has beats left
        kk_first = Signal()
        kk_last = Signal()
        kt_last = Signal()
        jb_last = Signal()
        ib_last = Signal()
        one_ktile, one_block_n, one_block_m = Signal(), Signal(), Signal()
        issue = Signal()
        m.d.comb += [self.beat.valid.eq(issuing), issue.eq(self.beat.valid & self.beat.ready)]
        single = lambda divisor: _single(D, divisor)  # noqa: E731
        # The flags' next values; beside the flags, registered from the same next values, which
        # counters an issue moves on: ``kt_wrap`` (kk and kt at their last), ``jb_wrap`` (and jb),
        # ``ib_wrap`` (and ib: the last beat). Each counter's enable is then the issue decision
        # and one register (one LUT), not a chain of the flags.
        flags = (kk_last, kt_last, jb_last, ib_last)
        kk_last_n, kt_last_n, jb_last_n, ib_last_n = nxt = [Signal(name=f"{f.name}_next") for f in flags]
        kt_wrap, jb_wrap, ib_wrap = Signal(), Signal(), Signal()
        m.d.comb += [n.eq(f) for n, f in zip(nxt, flags)]
        with m.If(start):
            m.d.sync += [issuing.eq(cmd.k != 0), ib.eq(0), jb.eq(0), kt.eq(0), kk.eq(0), k.eq(0), row0.eq(0),
                         col0.eq(0), block_base.eq(0), row_base.eq(0), kk_first.eq(1),
                         one_ktile.eq(single(tk)[cmd.k]), one_block_n.eq(single(C)[cmd.n]),
                         one_block_m.eq(single(R)[cmd.m])]
            m.d.comb += [kk_last_n.eq(tk == 1), kt_last_n.eq(single(tk)[cmd.k]), jb_last_n.eq(single(C)[cmd.n]),
                         ib_last_n.eq(single(R)[cmd.m])]
        with m.If(issue):
            m.d.comb += kk_last_n.eq(kk == tk - 2)
            with m.If(kk_last):
                m.d.comb += [kk_last_n.eq(tk == 1), kt_last_n.eq(kt + 2 == ktiles)]
                with m.If(kt_last):
                    m.d.comb += [kt_last_n.eq(one_ktile), jb_last_n.eq(jb + 2 == blocks_n)]
                    with m.If(jb_last):
                        m.d.comb += [jb_last_n.eq(one_block_n), ib_last_n.eq(ib + 2 == blocks_m)]
        m.d.sync += [*(f.eq(n) for f, n in zip(flags, nxt)), kt_wrap.eq(kk_last_n & kt_last_n),
                     jb_wrap.eq(kk_last_n & kt_last_n & jb_last_n), ib_wrap.eq(kk_last_n & kt_last_n & jb_last_n & ib_last_n)]
        # The counters: each later block overrides the earlier ones (a wrap implies the ones before).
        with m.If(issue):
            m.d.sync += [kk.eq(kk + 1), k.eq(k + 1), kk_first.eq(0)]
        with m.If(issue & kk_last):
            m.d.sync += [kk.eq(0), kt.eq(kt + 1), kk_first.eq(1)]
        with m.If(issue & kt_wrap):
            m.d.sync += [kt.eq(0), k.eq(0), jb.eq(jb + 1), col0.eq(col0 + C), block_base.eq(block_base + 1)]
        with m.If(issue & jb_wrap):
            m.d.sync += [jb.eq(0), col0.eq(0), ib.eq(ib + 1), row0.eq(row0 + R), row_base.eq(row_base + R * words_per_row),
                         block_base.eq(row_base + R * words_per_row)]
        with m.If(issue & ib_wrap):
            m.d.sync += issuing.eq(0)
        beat = self.beat.payload
        m.d.comb += [beat.k.eq(k), beat.row0.eq(row0), beat.col0.eq(col0), beat.kt.eq(kt), beat.base.eq(block_base),
                     beat.first.eq(kk_first), beat.closes.eq(kt_last & jb_last)]
        return m


class ExponentPrefetch(wiring.Component):
    """A K-tile's exponents, read while it streams: the R exponents of A's rows and the C of B's
    columns, one each a cycle (an address register, then the read), shifted into place and
    queued (``exponents_layout``) for the K-tile's drain, which starts no earlier than the
    queue can be read (tk >= max(R, C)).

    Ports: ``start`` (strobe: a K-tile's first beat is issued, ``beat`` its position; both
    registered here first, so that the issue decision reaches the prefetch across the die in a
    cycle of its own);
    ``transpose_a``, ``transpose_b`` (the command's); ``exp_a``, ``exp_b`` (read ports of the
    exponent memories, tile-grid pitch ``size / tw``); ``hold`` (the next K-tile's exponents
    cannot start yet: a prefetch runs, or the queue is full); ``o`` (stream out: the queue).
    A prefetch takes ``max(R, C) + PREFETCH_CYCLES - 1`` cycles from ``start``, the register
    included.
    """

    def __init__(self, cfg: CoreConfig):
        self.cfg = cfg
        port = memory.ReadPort.Signature(addr_width=ceil_log2(exponent_grid(cfg)), shape=EXP_WIDTH)
        super().__init__({
            "start": In(1),
            "beat": In(issue_layout(cfg)),
            "transpose_a": In(1),
            "transpose_b": In(1),
            "exp_a": In(port),
            "exp_b": In(port),
            "hold": Out(1),
            "o": Out(stream.Signature(exponents_layout(cfg))),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self.cfg
        R, C, D = cfg.rows, cfg.cols, cfg.size
        th, tw = cfg.tile
        grid_cols = D // tw  # tile-grid pitch of the exponent memories
        exps_layout = exponents_layout(cfg)
        depth = 4
        m.submodules.exps = exps = fifo.SyncFIFO(width=exps_layout.size, depth=depth)
        prefetch_busy = Signal()
        # ``hold`` is prefetch_busy | (queue level >= depth - 1), computed a cycle ahead from the next
        # values of both and registered: the MAC phase's issue decision, which spreads over the
        # die, then starts from a flip-flop.
        hold = Signal()
        m.d.comb += self.hold.eq(hold)

        span = max(R, C)
        pf_end = span + PREFETCH_CYCLES - 3  # the next K-tile may start PREFETCH_CYCLES after the span
        p = Signal(range(pf_end + 1))
        pf_row0 = Signal(range(D + pf_end + 1))
        pf_col0 = Signal(range(D + pf_end + 1))
        pf_kt = Signal.like(self.beat.kt)
        stage = Signal(exps_layout)
        # The start and the beat registered (a first beat comes at most every tk >=
        # rmw_latency cycles, so none comes while the start is in this register).
        start = Signal()
        beat = Signal.like(self.beat)
        m.d.sync += [start.eq(self.start), beat.eq(self.beat)]
        busy_next = Signal()
        m.d.comb += busy_next.eq(prefetch_busy)
        with m.If(start):
            m.d.comb += busy_next.eq(1)
            m.d.sync += [p.eq(0), pf_row0.eq(beat.row0), pf_col0.eq(beat.col0), pf_kt.eq(beat.kt),
                         stage.first.eq(beat.kt == 0), stage.closes.eq(beat.closes), stage.base.eq(beat.base)]
        with m.Elif(prefetch_busy):
            m.d.sync += [p.eq(p + 1), pf_row0.eq(pf_row0 + 1), pf_col0.eq(pf_col0 + 1)]
            with m.If(p == pf_end):
                m.d.comb += busy_next.eq(0)
        # The queue's level (SyncFIFO's count, 0 .. depth) at least depth - 1 next cycle:
        # decoded, no adder.
        put, take = exps.w_en & exps.w_rdy, exps.r_en & exps.r_rdy
        level = exps.level
        full_next = ((level == depth) | ((level == depth - 1) & ~(take & ~put))
                     | ((level == depth - 2) & put & ~take))
        m.d.sync += [prefetch_busy.eq(busy_next), hold.eq(busy_next | full_next)]
        row_tile = Array(Const(min(i, D - 1) // th, range(D // th)) for i in range(D + pf_end + 1))
        col_tile = Array(Const(min(i, D - 1) // tw, range(D // tw)) for i in range(D + pf_end + 1))
        ia = pf_row0  # row0 + p and col0 + p: counted
        jv = pf_col0
        kt_a = times_constant(pf_kt, grid_cols)
        # Exponent of A's row i in K-tile kt: tile (i // th, kt) of A, or (kt, i // tw) of A^T;
        # of B's column j: tile (kt, j // tw) of B, or (j // th, kt) of B^T.
        addr_a = Signal.like(self.exp_a.addr)
        addr_b = Signal.like(self.exp_b.addr)
        m.d.sync += [
            addr_a.eq(Mux(self.transpose_a, kt_a + col_tile[ia], times_constant(row_tile[ia], grid_cols) + pf_kt)),
            addr_b.eq(Mux(self.transpose_b, times_constant(row_tile[jv], grid_cols) + pf_kt, kt_a + col_tile[jv])),
        ]
        m.d.comb += [self.exp_a.addr.eq(addr_a), self.exp_b.addr.eq(addr_b)]
        # The sample of index t arrives in cycle p = t + 2 and is shifted straight into the stage
        # (its register is the memory's output register); R (C) shifts leave row 0 (column 0)
        # in lane 0.
        with m.If(prefetch_busy & (p >= 2) & (p < R + 2)):
            m.d.sync += [stage.ea[t].eq(stage.ea[t + 1]) for t in range(R - 1)]
            m.d.sync += stage.ea[R - 1].eq(self.exp_a.data)
        with m.If(prefetch_busy & (p >= 2) & (p < C + 2)):
            m.d.sync += [stage.eb[t].eq(stage.eb[t + 1]) for t in range(C - 1)]
            m.d.sync += stage.eb[C - 1].eq(self.exp_b.data)
        m.d.comb += [
            exps.w_en.eq(prefetch_busy & (p == pf_end)), exps.w_data.eq(stage),
            self.o.valid.eq(exps.r_rdy), self.o.payload.eq(exps.r_data), exps.r_en.eq(self.o.ready),
        ]
        return m


class DrainRegister(wiring.Component):
    """One register between the MAC array's drain multiplexer and the accumulate lanes: each
    drained beat (a row's sums of one group of columns) with its row's A exponent, its columns'
    B exponents, its accumulator address, its group and flags (``drain_layout``). The beats of a
    K-tile drain in consecutive cycles, row-major, so each row's address is the previous one's
    plus a row; the K-tile's exponents (``exps``) are taken with its last beat.

    Ports: ``i`` (stream in: the array's ``o``; always ready), ``exps`` (stream in,
    ``exponents_layout``: its head is the draining K-tile's), ``accumulate`` (the command's:
    its first K-tile adds onto C), ``o`` (stream out, ``drain_layout``: a beat a cycle, a cycle
    after ``i``; never waits).
    """

    def __init__(self, cfg: CoreConfig, array: stream.Signature):
        self.cfg = cfg
        super().__init__({
            "i": In(array),
            "exps": In(stream.Signature(exponents_layout(cfg))),
            "accumulate": In(1),
            "o": Out(stream.Signature(drain_layout(cfg))),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self.cfg
        R, L, G = cfg.rows, cfg.acc_lanes, cfg.acc_groups
        words_per_row = cfg.size // cfg.cols
        head = Signal(exponents_layout(cfg))
        m.d.comb += [head.eq(self.exps.payload), self.i.ready.eq(1)]
        drain = self.i.valid
        drain_row, drain_group = self.i.payload.row, self.i.payload.group
        last_beat = (drain_row == R - 1) & (drain_group == G - 1)
        m.d.comb += self.exps.ready.eq(drain & last_beat)
        ea_lanes = Array(head.ea[t] for t in range(R))
        eb_groups = Array(head.eb.as_value()[g * L * EXP_WIDTH:(g + 1) * L * EXP_WIDTH] for g in range(G))
        drained = self.o.payload
        m.d.sync += [
            self.o.valid.eq(drain),
            drained.sums.eq(self.i.payload.sums),
            drained.exp_a.eq(ea_lanes[drain_row]),
            drained.exp_b.eq(eb_groups[drain_group]),
            drained.group.eq(drain_group),
            drained.addr.eq(Mux((drain_row == 0) & (drain_group == 0), head.base,
                                Mux(drain_group == 0, drained.addr + words_per_row, drained.addr))),
            drained.zero.eq(head.first & ~self.accumulate),
            drained.closes.eq(head.closes & last_beat),
        ]
        return m


class HostWrites(wiring.Component):
    """The host's writes into the core's memories, taken while the core is idle (``busy`` low):
    a ``w`` beat (``write_layout``) to the write port of its ``target``: a row chunk of an
    operand buffer, an exponent, or (registered) a word of the accumulator or the bias.

    The accumulator's and the bias's writes are registered before they reach the block RAMs
    (whose pins spread over the die): no logic between the host's stream or ``busy`` and those
    pins. A command is accepted no sooner than the cycle after the last host write, and reads
    neither memory in its first cycles.

    Ports: ``w`` (stream in), ``busy``; ``a_codes``, ``b_codes`` (the operand buffers' writes,
    ``BufferWriteSignature``); ``a_exponents``, ``b_exponents``, ``bias`` (write ports);
    ``acc`` (the accumulator's write, every column of a word, which the core multiplexes with
    the accumulate lanes' writes).
    """

    def __init__(self, cfg: CoreConfig):
        self.cfg = cfg
        R, C, D = cfg.rows, cfg.cols, cfg.size
        word = data.ArrayLayout(FP32_WIDTH, C)
        exp_port = memory.WritePort.Signature(addr_width=ceil_log2(exponent_grid(cfg)), shape=EXP_WIDTH)
        super().__init__({
            "w": In(stream.Signature(write_layout(cfg))),
            "busy": In(1),
            "a_codes": Out(BufferWriteSignature(R, cfg.mantissa_bits, D)),
            "b_codes": Out(BufferWriteSignature(C, cfg.mantissa_bits, D)),
            "a_exponents": In(exp_port),
            "b_exponents": In(exp_port),
            "bias": In(memory.WritePort.Signature(addr_width=max(1, (D // C - 1).bit_length()), shape=word)),
            "acc": Out(AccWriteSignature(cfg)),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self.cfg
        R, C, D = cfg.rows, cfg.cols, cfg.size
        grid_cols = D // cfg.tile[1]  # tile-grid pitch of the exponent memories
        words_per_row = D // C
        w = self.w.payload
        m.d.comb += self.w.ready.eq(~self.busy)
        w_fire = self.w.valid & ~self.busy
        exp_w_addr = times_constant(w.row, grid_cols) + w.col
        # The accumulator word of a chunk's column (a multiple of C): a table, since C need not
        # be a power of two.
        col_word = Array(Const(v // C, range(words_per_row)) for v in range(D))[w.col]
        for port, target, lanes in ((self.a_codes, Target.A_CODES, R), (self.b_codes, Target.B_CODES, C)):
            m.d.comb += [port.en.eq(w_fire & (w.target == target)), port.row.eq(w.row), port.col.eq(w.col),
                         port.skip.eq(w.skip[:lanes])]
            m.d.comb += [port.data[t].eq(w.data[t]) for t in range(lanes)]
        for port, target in ((self.a_exponents, Target.A_EXPONENTS), (self.b_exponents, Target.B_EXPONENTS)):
            m.d.comb += [port.en.eq(w_fire & (w.target == target)), port.addr.eq(exp_w_addr), port.data.eq(w.data[0])]

        # The registered writes of the bias and the accumulator (one data register for both).
        host_data = Signal.like(self.acc.data, reset_less=True)
        m.d.sync += [host_data[j].eq(w.data[j]) for j in range(C)]
        host_bias = Signal()
        host_bias_addr = Signal.like(self.bias.addr, reset_less=True)
        m.d.sync += [host_bias.eq(w_fire & (w.target == Target.BIAS)), host_bias_addr.eq(col_word)]
        m.d.comb += [self.bias.en.eq(host_bias), self.bias.addr.eq(host_bias_addr), self.bias.data.eq(host_data)]
        host_acc = Signal()
        host_addr = Signal.like(self.acc.addr, reset_less=True)
        m.d.sync += [host_acc.eq(w_fire & (w.target == Target.ACC)),
                     host_addr.eq(times_constant(w.row, words_per_row) + col_word)]
        m.d.comb += [self.acc.en.eq(host_acc), self.acc.addr.eq(host_addr), self.acc.data.eq(host_data)]
        return m


class GemmCore(wiring.Component):
    """``act(op(A) @ op(B) + C + bias)`` for operands up to ``cfg.size`` square.

    Ports:

    - ``w`` (stream in, ``write_layout``): loads a buffer while idle. ``a_codes``/``b_codes``:
      the row chunk (``row``, ``col`` .. ``col`` + lanes - 1) of the stored operand (lanes =
      ``rows`` for A, ``cols`` for B; codes in the low bits of each 32-bit lane; lanes whose
      ``skip`` bit is set are left as they are). The stored
      operand is A (M x K) or, with ``transpose_a``, A^T (K x M); B (K x N) or, with
      ``transpose_b``, B^T (N x K). Regions beyond the product's K need not be cleared.
      ``a_exponents``/``b_exponents``: the E8M0 code of stored tile (``row``, ``col``) in lane 0.
      ``acc``: C (fp32) for row ``row``, columns ``col`` .. ``col`` + cols - 1.
      ``bias``: bias values for columns ``col`` .. ``col`` + cols - 1.
    - ``cmd`` (stream in, ``command_layout``): starts a product; accepted while idle.
    - ``o`` (stream out, ``output_layout``): the result, ``out_lanes`` values a beat; fp32 and
      bf16 row-major over ``ceil(N / out_lanes)`` beats a row; BFP tile-major, ``exponent``
      carrying the tile's code and the codes sign-extended in ``lanes``. Values outside M x N
      are zero. ``last`` marks the final beat.
    - ``busy``, ``error`` (a command with a zero M or N, a side above ``size``, transposes
      a non-square tile cannot serve, or a BFP output the core was built without (no
      ``cfg.bfp_output``, or stochastic without ``cfg.stochastic``); it produces no output),
      ``cycles`` (the last command's, from acceptance until its last row-block of sums is in
      the accumulator: ``count_cycles``).

    A command with K = 0 runs the epilogue alone: it reads the accumulator (C), with bias,
    activation and output format, which is how the host reads results back.
    """

    def __init__(self, cfg: CoreConfig = CoreConfig()):
        self.cfg = cfg
        super().__init__(core_signature(cfg))

    def elaborate(self, platform):
        m = Module()
        cfg = self.cfg
        R, C, D, tk = cfg.rows, cfg.cols, cfg.size, cfg.tk
        th, tw = cfg.tile
        mb = cfg.mantissa_bits
        words_per_row = D // C  # accumulator words of a row

        # ---- storage -------------------------------------------------------------------
        m.submodules.buf_a = buf_a = OperandBuffer(R, mb, D, D)
        m.submodules.buf_b = buf_b = OperandBuffer(C, mb, D, D)
        exp_depth = exponent_grid(cfg)
        # No memory of the core is read at an address in the cycle it is written (host writes come
        # while idle; the accumulate loop's read and write of a row are a K-tile apart; the
        # epilogue reads closed rows only): NO_RW_CHECK.
        m.submodules.exp_a = exp_a = memory.Memory(shape=EXP_WIDTH, depth=exp_depth, init=[], attrs=NO_RW_CHECK)
        m.submodules.exp_b = exp_b = memory.Memory(shape=EXP_WIDTH, depth=exp_depth, init=[], attrs=NO_RW_CHECK)
        acc_word = data.ArrayLayout(FP32_WIDTH, C)
        # An accumulator or bias read: the BlockRam's cycles, then the reader's register.
        assert BlockRam.LATENCY + 1 == ACC_READ_LATENCY
        m.submodules.acc_mem = acc_mem = BlockRam(acc_word, D * words_per_row, read_ports=2, granularity=1)
        m.submodules.bias_mem = bias_mem = BlockRam(acc_word, words_per_row)

        # ---- host writes (only while idle) and commands --------------------------------
        busy = Signal()
        m.d.comb += self.busy.eq(busy)
        m.submodules.host = host = HostWrites(cfg)
        wiring.connect(m, wiring.flipped(self.w), host.w)
        m.d.comb += host.busy.eq(busy)
        connect_buffer(m, buf_a, write=host.a_codes)
        connect_buffer(m, buf_b, write=host.b_codes)
        wiring.connect(m, host.a_exponents, exp_a.write_port())
        wiring.connect(m, host.b_exponents, exp_b.write_port())
        wiring.connect(m, host.bias, bias_mem.write)

        desc = Signal(command_layout(cfg))
        plan = Signal(plan_layout(cfg))
        cmd = self.cmd.payload
        start, started = accept_command(m, self, desc, busy, command_error(cfg, cmd))
        rows_total = Signal(range(D + R + 1))  # the rows the MAC phase computes: ceil(M / R) * R
        with m.If(start):
            m.d.sync += [
                rows_total.eq(_ceil_table(D, R, R)[cmd.m]),
                plan.tiles_m.eq(_ceil_table(D, th)[cmd.m]),
                plan.tiles_n.eq(_ceil_table(D, tw)[cmd.n]),
                plan.chunks.eq(_ceil_table(D, cfg.out_lanes)[cmd.n]),
            ]

        # ---- MAC phase: operand beats, exponents prefetched per K-tile ------------------------
        m.submodules.issue = issue = MacIssue(cfg)
        m.submodules.prefetch = prefetch = ExponentPrefetch(cfg)
        beat = issue.beat.payload
        # A K-tile's first beat waits until its exponents can be prefetched.
        m.d.comb += [issue.start.eq(start), issue.cmd.eq(cmd), issue.beat.ready.eq(~(beat.first & prefetch.hold))]
        issued = issue.beat.valid & issue.beat.ready
        m.d.comb += [prefetch.start.eq(issued & beat.first), prefetch.beat.eq(beat),
                     prefetch.transpose_a.eq(desc.transpose_a), prefetch.transpose_b.eq(desc.transpose_b)]
        wiring.connect(m, prefetch.exp_a, exp_a.read_port())
        wiring.connect(m, prefetch.exp_b, exp_b.read_port())
        m.submodules.mac = mac = MacArray(R, C, tk, mb, mb, dsp_macs=cfg.dsp_macs, groups=cfg.acc_groups)
        # A column chunk of A (rows row0.., column k) is read as such, or as a row chunk of
        # the stored A^T; a row chunk of B (row k, columns col0..) likewise from B or B^T.
        k, row0, col0 = beat.k, beat.row0, beat.col0
        m.d.comb += [
            buf_a.r_en.eq(issued),
            buf_a.r_mode.eq(Mux(desc.transpose_a, READ_ROW, READ_COLUMN)),
            buf_a.r_row.eq(Mux(desc.transpose_a, k, row0)),
            buf_a.r_col.eq(Mux(desc.transpose_a, row0, k)),
            buf_b.r_en.eq(issued),
            buf_b.r_mode.eq(Mux(desc.transpose_b, READ_COLUMN, READ_ROW)),
            buf_b.r_row.eq(Mux(desc.transpose_b, col0, k)),
            buf_b.r_col.eq(Mux(desc.transpose_b, k, col0)),
        ]
        assert OperandBuffer.LATENCY == OPERAND_READ_LATENCY
        beat_valid = delayed(m, issued, OPERAND_READ_LATENCY, "beat_valid")
        beat_pad = delayed(m, k >= desc.k, OPERAND_READ_LATENCY, "beat_pad", reset_less=True)  # k beyond K: stale codes
        for t in range(R):
            m.d.comb += mac.i.payload.a[t].eq(Mux(beat_pad, 0, buf_a.r_data[t]))
        for t in range(C):
            m.d.comb += mac.i.payload.b[t].eq(buf_b.r_data[t])
        m.d.comb += mac.i.valid.eq(beat_valid)  # the array never stalls (its ready is 1)

        # ---- MAC phase: drain into the accumulate lanes --------------------------------------
        m.submodules.drain = drain = DrainRegister(cfg, mac.o.signature)
        wiring.connect(m, mac.o, drain.i)
        wiring.connect(m, prefetch.o, drain.exps)
        m.d.comb += drain.accumulate.eq(desc.accumulate)
        m.submodules.accumulate = acc_lanes = Accumulate(cfg)
        wiring.connect(m, drain.o, acc_lanes.i)
        wiring.connect(m, acc_lanes.acc_read, acc_mem.read0)
        # The host's registered write of the accumulator meets the lanes' writes, and itself
        # selects (the lanes write only while busy).
        acc_wr, acc_w, host_acc = acc_mem.write, acc_lanes.acc_write, host.acc
        m.d.comb += [
            acc_wr.en.eq(Mux(host_acc.en, Const((1 << C) - 1, C), acc_w.en)),
            acc_wr.addr.eq(Mux(host_acc.en, host_acc.addr, acc_w.addr)),
        ]
        for j in range(C):
            m.d.comb += acc_wr.data[j].eq(Mux(host_acc.en, host_acc.data[j], acc_w.data[j]))

        # Rows whose accumulation is final: whole row-blocks as the lanes close them; every row
        # at once for K = 0 (the epilogue takes the counters' next values).
        rows_done, all_rows = rows_closed(m, cfg, start, cmd.k == 0, acc_lanes.closed, rows_total)
        count_cycles(m, self, busy, all_rows, started)

        # ---- epilogue ------------------------------------------------------------------------
        m.submodules.epilogue = epi = Epilogue(cfg, command_layout(cfg))
        m.d.comb += [
            epi.start.eq(started),
            epi.desc.eq(desc),
            epi.plan.eq(plan),
            epi.rows_done_next.eq(rows_done),
            epi.all_rows_next.eq(all_rows),
        ]
        wiring.connect(m, epi.acc_read, acc_mem.read1)
        wiring.connect(m, epi.bias_read, bias_mem.read0)
        wiring.connect(m, epi.o, wiring.flipped(self.o))
        with m.If(self.o.valid & self.o.ready & self.o.payload.last):
            m.d.sync += busy.eq(0)
        return m
