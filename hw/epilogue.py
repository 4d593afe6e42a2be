"""The epilogue: the accumulator buffer out through the bias adders, the activation units and
the output format (``hbfp.golden.gemm.epilogue`` after ``gemm``'s bias), ``out_lanes`` values a
cycle.

It runs beside the MAC phase: a row is read once the accumulate lanes have closed its
row-block (``rows_done``), so the epilogue of one row-block overlaps the next row-block's
products. The datapath never stalls: a read is issued only while the output queue has room
for everything in flight (credits), so the output's ``ready`` gates nothing but the issue.

Order: fp32 and bf16 row-major, ``ceil(N / out_lanes)`` beats a row (lanes beyond N zero);
BFP tile-major (``th`` rows of ``tw / out_lanes`` beats a tile), through the BFP quantizer.
"""

from __future__ import annotations

from amaranth import Array, Cat, Const, Module, Mux, Signal, Value
from amaranth.lib import data, fifo, memory, stream, wiring
from amaranth.lib.wiring import In, Out

from hbfp.contract import ACTIVATION_INPUT_REGISTER, CHUNK_SELECT, OutFormat

from . import convert
from .accumulate import delayed
from .activation import UNARY_FUNCTIONS, ActivationDatapath
from .add_f32 import AddF32Datapath
from .params import ACC_READ_LATENCY, EXP_WIDTH, FP32_WIDTH, CoreConfig
from .quantize import KEY_LATENCY, Quantize

__all__ = ["Epilogue", "output_layout", "plan_layout", "epilogue_latency", "rows_closed"]


def output_layout(cfg: CoreConfig) -> data.StructLayout:
    """A beat of the core's output: ``out_lanes`` values (fp32 or bf16 patterns, or BFP codes
    sign-extended), the BFP tile's exponent code, and ``last`` on the final beat."""
    return data.StructLayout({
        "lanes": data.ArrayLayout(FP32_WIDTH, cfg.out_lanes),
        "exponent": EXP_WIDTH,
        "last": 1,
    })


def plan_layout(cfg: CoreConfig) -> data.StructLayout:
    """What the epilogue needs of a command beyond its descriptor: the tile grid of the output
    and the beats of a row."""
    D, (th, tw) = cfg.size, cfg.tile
    return data.StructLayout({
        "tiles_m": range(D // th + 1),
        "tiles_n": range(D // tw + 1),
        "chunks": range(D // cfg.out_lanes + 1),  # ceil(N / out_lanes)
    })


def epilogue_latency(cfg: CoreConfig) -> int:
    """Cycles from a read's issue to its values entering the output queue: the accumulator
    read, the chunk's register, the bias adders, the activation units (if any unary function
    is built)."""
    unary = any(f in UNARY_FUNCTIONS for f in cfg.built_functions)
    return (ACC_READ_LATENCY + CHUNK_SELECT + AddF32Datapath.LATENCY
            + (ACTIVATION_INPUT_REGISTER + ActivationDatapath.LATENCY if unary else 0))


#: What a read moves on, one bit each of the epilogue's ``step``: BFP output tile by tile (the
#: chunk in the tile's row, the tile's row, the band's tile, the band), fp32 and bf16 row by
#: row (the chunk in the row, the row).
_STEPS = ("tile_chunk", "tile_row", "tile", "band", "chunk", "row")


def rows_closed(m: Module, cfg: CoreConfig, start, k_zero, closed, rows_total) -> tuple[Signal, Signal]:
    """A core's count of the accumulator rows that are final: reset by ``start`` (every row at
    once when ``k_zero``: K = 0 reads the accumulator as it is), moved on by ``cfg.rows`` with
    each ``closed`` (a row-block's last word written), all of them at ``rows_total``. Adds the
    counters to ``m`` and returns the values they take at the coming clock edge,
    ``(rows_done_next, all_rows_next)``: the ``Epilogue``'s ports of the same names."""
    R = cfg.rows
    rows_done = Signal(range(cfg.size + R + 1), name="rows_done")
    all_rows = Signal(name="all_rows")
    rows_done_next = Signal.like(rows_done, name="rows_done_next")
    all_rows_next = Signal(name="all_rows_next")
    m.d.comb += [rows_done_next.eq(rows_done), all_rows_next.eq(all_rows)]
    with m.If(start):
        m.d.comb += [rows_done_next.eq(0), all_rows_next.eq(k_zero)]
    with m.Elif(closed):
        m.d.comb += rows_done_next.eq(rows_done + R)
        with m.If(rows_done + R == rows_total):
            m.d.comb += all_rows_next.eq(1)
    m.d.sync += [rows_done.eq(rows_done_next), all_rows.eq(all_rows_next)]
    return rows_done_next, all_rows_next


class _Column:
    """A column position in E-chunks: the accumulator word, the chunk inside it, the column."""

    def __init__(self, cfg: CoreConfig, name: str):
        D, C, E = cfg.size, cfg.cols, cfg.out_lanes
        self.per_word = C // E
        self.word = Signal(range(D // C + 1), name=f"{name}_word")
        self.sel = Signal(range(self.per_word), name=f"{name}_sel")
        self.col = Signal(range(D + C), name=f"{name}_col")
        self.E = E

    def set(self, other: "_Column"):
        return [self.word.eq(other.word), self.sel.eq(other.sel), self.col.eq(other.col)]

    def clear(self):
        return [self.word.eq(0), self.sel.eq(0), self.col.eq(0)]

    def wraps(self, other: "_Column", chunks: int):
        """Whether ``chunks`` chunks (a constant) move ``other`` past the end of a word: a
        decode of ``sel`` (a LUT), not a comparison (a carry chain)."""
        sels = chunks % self.per_word
        return Array(Const(int(s + sels >= self.per_word), 1) for s in range(self.per_word))[other.sel]

    def word_after(self, other: "_Column", chunks: int):
        """The word of ``other`` moved on by ``chunks`` chunks (a constant)."""
        return other.word + chunks // self.per_word + self.wraps(other, chunks)

    def advanced(self, other: "_Column", chunks: int):
        """Statements setting self to ``other`` moved on by ``chunks`` chunks (a constant)."""
        sels = chunks % self.per_word
        carry = self.wraps(other, chunks)
        return [
            self.word.eq(self.word_after(other, chunks)),
            self.sel.eq(Mux(carry, other.sel + sels - self.per_word, other.sel + sels)),
            self.col.eq(other.col + chunks * self.E),
        ]


class _Steps:
    """Where the read position's counters that end at a command's sides stand, as flags kept
    beside them (registers, so that the next read's decision starts from flip-flops, not from
    compares against the plan or a constant): chunk, row, t_c, t_r, t_j and t_i at their last
    value. From the flags, ``step`` (a register, one-hot) says which counters the next read
    moves on (``_STEPS``): each counter's enable is the read's decision and one bit of it, one
    LUT level."""

    def __init__(self, bfp):
        self.bfp = bfp
        self.last = {k: Signal(name=f"{name}_last")
                     for k, name in (("tc", "tc"), ("tr", "tr"), ("tj", "tj"), ("ti", "ti"), ("ch", "chunk"),
                                     ("rw", "row"))}
        self.step = Signal(len(_STEPS), name="step")
        self.on = {name: self.step[k] for k, name in enumerate(_STEPS)}

    def set(self, tc=None, tr=None, tj=None, ti=None, ch=None, rw=None):
        """Statements setting the flags given (the others stay) and ``step`` from them."""
        new = dict(self.last)
        given = dict(tc=tc, tr=tr, tj=tj, ti=ti, ch=ch, rw=rw)
        out = []
        for k, v in given.items():
            if v is not None:
                v = Value.cast(v)  # a comparison of constants is a Python bool
                new[k] = v
                out.append(self.last[k].eq(v))
        tc_, tr_, tj_, ch_ = new["tc"], new["tr"], new["tj"], new["ch"]
        bfp = self.bfp
        out.append(self.step.eq(Cat(
            bfp & ~tc_, bfp & tc_ & ~tr_, bfp & tc_ & tr_ & ~tj_, bfp & tc_ & tr_ & tj_,
            ~bfp & ~ch_, ~bfp & ch_)))
        return out


def read_layout(cfg: CoreConfig) -> data.StructLayout:
    """What travels beside a read's data (``EpilogueIssue.read``): whether a read is issued, the
    chunk in the accumulator word, which lanes are inside M x N, and ``last``."""
    C, E = cfg.cols, cfg.out_lanes
    return data.StructLayout({"valid": 1, "sel": range(C // E), "inside": E, "last": 1})


def entry_layout(cfg: CoreConfig) -> data.StructLayout:
    """An entry of the epilogue's output queue (``EpilogueDatapath.o``): ``out_lanes`` fp32 or
    bf16 patterns (zero outside M x N) and ``last``."""
    return data.StructLayout({"lanes": data.ArrayLayout(FP32_WIDTH, cfg.out_lanes), "last": 1})


def _read_port_signatures(cfg: CoreConfig):
    """The read ports of the accumulator and the bias buffers, as the epilogue sees them."""
    D, C = cfg.size, cfg.cols
    word = data.ArrayLayout(FP32_WIDTH, C)
    return (memory.ReadPort.Signature(addr_width=max(1, (D * (D // C) - 1).bit_length()), shape=word),
            memory.ReadPort.Signature(addr_width=max(1, (D // C - 1).bit_length()), shape=word))


class EpilogueIssue(wiring.Component):
    """The epilogue's reads of the accumulator: the position of the next one, in the command's
    output order, and the decision to issue it.

    Ports: ``start``, ``desc``, ``plan``, ``rows_done_next``, ``all_rows_next`` (the
    ``Epilogue``'s); ``room`` (the output queue has room for everything in flight and a read
    more); ``read`` (``read_layout``: ``valid`` in the cycle a read is issued, beside what
    travels with its data); ``acc_addr``, ``bias_addr`` (the read's accumulator and bias
    words, which the block RAMs read in every cycle).

    A read is issued while the command has reads left, ``room`` is high and its row is final,
    one a cycle: fp32 and bf16 row-major, ``plan.chunks`` reads a row; BFP tile-major (``th``
    rows of ``tw / out_lanes`` reads a tile, tiles row by row of tiles).
    """

    def __init__(self, cfg: CoreConfig, command: data.StructLayout):
        self.cfg = cfg
        acc_port, bias_port = _read_port_signatures(cfg)
        super().__init__({
            "start": In(1),
            "desc": In(command),
            "plan": In(plan_layout(cfg)),
            "rows_done_next": In(range(cfg.size + cfg.rows + 1)),
            "all_rows_next": In(1),
            "room": In(1),
            "read": Out(read_layout(cfg)),
            "acc_addr": Out(acc_port.members["addr"].shape),
            "bias_addr": Out(bias_port.members["addr"].shape),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self.cfg
        D, E = cfg.size, cfg.out_lanes
        th, tw = cfg.tile
        words_per_row = D // cfg.cols
        desc, plan = self.desc, self.plan
        bfp = (desc.out_format == OutFormat.BFP) if cfg.bfp_output else Const(0)
        tile_chunks = tw // E

        going = Signal()
        row = Signal(range(D + th + 1))
        row_addr = Signal(range((D + th + 1) * words_per_row))  # row * words_per_row
        chunk = Signal(range(D // E + 1))  # fp32/bf16: chunk of the row
        pos = _Column(cfg, "pos")
        # BFP: tile row and column, row and chunk inside the tile, the tile's first row and column.
        t_i = Signal(range(D // th + 1))
        t_j = Signal(range(D // tw + 1))
        t_r = Signal(range(th))
        t_c = Signal(range(tile_chunks))
        band_row = Signal(range(D + th + 1))
        band_addr = Signal(range((D + th + 1) * words_per_row))
        tile_pos = _Column(cfg, "tile")

        # The read's decision from three registers: going, room (the queue's credits) and
        # ready_row (the read's row is final: all rows are, or row < rows done), each computed
        # a cycle ahead from the next values of what it compares (below).
        ready_row = Signal()
        issue = Signal()
        m.d.comb += issue.eq(going & self.room & ready_row)
        steps = _Steps(bfp)
        flags, on = steps.set, steps.on
        last = Signal()
        m.d.comb += last.eq((on["band"] & steps.last["ti"]) | (on["row"] & steps.last["rw"]))

        # The accumulator's read address (row_addr + pos.word) is a register of its own, set with
        # the two: the adder stays before a flip-flop, and the flip-flop alone drives the address
        # pins of the accumulator's block RAMs across the die.
        read_addr = Signal.like(self.acc_addr)
        # It is row_addr + pos.word after every step, so the next chunk's address is it plus
        # what a chunk adds to the word (a whole word when a word is one chunk, else the wrap):
        # one carry chain after the flip-flops.
        next_chunk_addr = read_addr + (pos.wraps(pos, 1) if pos.per_word > 1 else 1)
        with m.If(self.start):
            m.d.sync += [going.eq(1), row.eq(0), row_addr.eq(0), chunk.eq(0), t_i.eq(0), t_j.eq(0), t_r.eq(0),
                         t_c.eq(0), band_row.eq(0), band_addr.eq(0), *pos.clear(), *tile_pos.clear(), read_addr.eq(0),
                         *flags(tc=tile_chunks == 1, tr=th == 1, tj=plan.tiles_n == 1, ti=plan.tiles_m == 1,
                                ch=plan.chunks == 1, rw=desc.m == 1)]
        with m.Elif(issue):
            with m.If(last):
                m.d.sync += going.eq(0)
            # BFP: tile by tile, each row by row.
            with m.If(on["tile_chunk"]):  # the tile row's next chunk
                m.d.sync += [t_c.eq(t_c + 1), *pos.advanced(pos, 1), read_addr.eq(next_chunk_addr),
                             *flags(tc=t_c + 2 == tile_chunks)]
            with m.If(on["tile_row"]):  # the tile's next row
                m.d.sync += [t_c.eq(0), t_r.eq(t_r + 1), row.eq(row + 1), row_addr.eq(row_addr + words_per_row),
                             *pos.set(tile_pos), read_addr.eq(row_addr + words_per_row + tile_pos.word),
                             *flags(tc=tile_chunks == 1, tr=t_r + 2 == th)]
            with m.If(on["tile"]):  # the band's next tile
                m.d.sync += [t_c.eq(0), t_r.eq(0), t_j.eq(t_j + 1), row.eq(band_row), row_addr.eq(band_addr),
                             *tile_pos.advanced(tile_pos, tile_chunks), *pos.advanced(tile_pos, tile_chunks),
                             read_addr.eq(band_addr + pos.word_after(tile_pos, tile_chunks)),
                             *flags(tc=tile_chunks == 1, tr=th == 1, tj=t_j + 2 == plan.tiles_n)]
            with m.If(on["band"]):  # the next band of tiles
                m.d.sync += [t_c.eq(0), t_r.eq(0), t_j.eq(0), t_i.eq(t_i + 1), row.eq(band_row + th),
                             row_addr.eq(band_addr + th * words_per_row), band_row.eq(band_row + th),
                             band_addr.eq(band_addr + th * words_per_row), *tile_pos.clear(), *pos.clear(),
                             read_addr.eq(band_addr + th * words_per_row),
                             *flags(tc=tile_chunks == 1, tr=th == 1, tj=plan.tiles_n == 1, ti=t_i + 2 == plan.tiles_m)]
            # fp32 and bf16: row by row.
            with m.If(on["chunk"]):  # the row's next chunk
                m.d.sync += [chunk.eq(chunk + 1), *pos.advanced(pos, 1), read_addr.eq(next_chunk_addr),
                             *flags(ch=chunk + 2 == plan.chunks)]
            with m.If(on["row"]):  # the next row
                m.d.sync += [chunk.eq(0), row.eq(row + 1), row_addr.eq(row_addr + words_per_row), *pos.clear(),
                             read_addr.eq(row_addr + words_per_row),
                             *flags(ch=plan.chunks == 1, rw=row + 2 == desc.m)]

        # ready_row for the next cycle: the row after this cycle's read (if any) against the rows
        # done from the next cycle on; a read moves the row on by one (the next row, the next
        # band) or back to the band's first (the next tile) or keeps it.
        moves = on["tile_row"] | on["band"] | on["row"]
        row_after = Mux(moves, row + 1, Mux(on["tile"], band_row, row))
        m.d.sync += ready_row.eq(self.all_rows_next | Mux(
            self.start, self.rows_done_next != 0,
            Mux(issue, row_after < self.rows_done_next, row < self.rows_done_next)))

        # What travels beside the data: the chunk in the word, which lanes are inside M x N, last.
        inside = Signal(E)
        m.d.comb += inside.eq(Cat(*((row < desc.m) & (pos.col + j < desc.n) for j in range(E))))
        m.d.comb += [
            self.acc_addr.eq(read_addr),
            self.bias_addr.eq(pos.word),
            self.read.valid.eq(issue), self.read.sel.eq(pos.sel), self.read.inside.eq(inside), self.read.last.eq(last),
        ]
        return m


class EpilogueDatapath(wiring.Component):
    """The values of the epilogue's reads, ``out_lanes`` (E) lanes: the chunk of the
    accumulator and bias words, E bias adders (or the value, flushed as the adder's DAZ would,
    beside them), E activation units (bf16 in and out; none if no unary function is built),
    and the command's format (fp32 or bf16; zero outside M x N). It never stalls.

    Ports: ``desc`` (the command); ``i`` (``read_layout``, in the cycle of the read's issue);
    ``acc_data``, ``bias_data`` (the read ports' data, ``BlockRam.LATENCY`` cycles after the
    issue); ``o_valid``, ``o`` (``entry_layout``), ``epilogue_latency(cfg)`` cycles after the
    issue.
    """

    def __init__(self, cfg: CoreConfig, command: data.StructLayout):
        self.cfg = cfg
        acc_port, bias_port = _read_port_signatures(cfg)
        super().__init__({
            "desc": In(command),
            "i": In(read_layout(cfg)),
            "acc_data": In(acc_port.members["data"].shape),
            "bias_data": In(bias_port.members["data"].shape),
            "o_valid": Out(1),
            "o": Out(entry_layout(cfg)),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self.cfg
        C, E = cfg.cols, cfg.out_lanes
        # The command's fields that select in the lanes (bias, activation, format), from a copy
        # registered here: ``desc`` holds from the command's start, and the datapath's first
        # value comes many cycles after it (the read, the chunk select, the bias adders), so the
        # copy holds the same bits whenever they select, and the route from the core's
        # descriptor across the die has a cycle of its own.
        desc = Signal(self.desc.shape(), name="desc_q")
        m.d.sync += desc.eq(self.desc)

        # The read: data registered, then the chunk selected.
        acc_q = Signal.like(self.acc_data, reset_less=True)
        bias_q = Signal.like(self.bias_data, reset_less=True)
        m.d.sync += [acc_q.eq(self.acc_data), bias_q.eq(self.bias_data)]
        meta2 = delayed(m, self.i, ACC_READ_LATENCY, "read_meta")
        acc_chunks = Array(Array(acc_q[s * E + j] for j in range(E)) for s in range(C // E))
        bias_chunks = Array(Array(bias_q[s * E + j] for j in range(E)) for s in range(C // E))
        # The chunk is registered after the selection (one level of multiplexers a cycle).
        vals = [Signal(FP32_WIDTH, name=f"chunk{j}") for j in range(E)]
        biases = [Signal(FP32_WIDTH, name=f"chunk_bias{j}") for j in range(E)]
        m.d.sync += [v.eq(acc_chunks[meta2.sel][j]) for j, v in enumerate(vals)]
        m.d.sync += [b.eq(bias_chunks[meta2.sel][j]) for j, b in enumerate(biases)]
        meta2 = delayed(m, meta2, CHUNK_SELECT, "chunk_meta")

        # Bias: E adders, or the value (flushed, the adder's DAZ) beside them.
        La = AddF32Datapath.LATENCY
        b_vals = []
        for j in range(E):
            ad = AddF32Datapath()
            m.submodules[f"bias_add{j}"] = ad
            m.d.comb += [ad.advance.eq(1), ad.in_valid.eq(meta2.valid), ad.a.eq(vals[j]), ad.b.eq(biases[j])]
            bypass = delayed(m, convert.flush_f32(vals[j]), La, f"no_bias{j}", reset_less=True)
            b_vals.append(Mux(desc.bias, ad.result, bypass))
        b_meta = delayed(m, meta2, La, "bias_meta")

        # Activation: E units (bf16 in and out), or none if no unary function is built.
        unary = tuple(f for f in cfg.built_functions if f in UNARY_FUNCTIONS)
        fp32_vals, bf16_vals = [], []
        if not unary:
            f_meta = b_meta
            for j in range(E):
                fp32_vals.append(b_vals[j])
                bf16_vals.append(convert.from_f32(b_vals[j]))
        else:
            # The units' bf16 input is registered once converted (the bias stage's multiplexer
            # and the rounding to bf16 would otherwise share a cycle with the ROM address).
            Lact = ACTIVATION_INPUT_REGISTER + ActivationDatapath.LATENCY
            f_meta = delayed(m, b_meta, Lact, "act_meta")
            for j in range(E):
                act = ActivationDatapath(leaky_shift=cfg.leaky_shift, functions=cfg.built_functions)
                m.submodules[f"act{j}"] = act
                x_bf16 = delayed(m, convert.from_f32(b_vals[j]), ACTIVATION_INPUT_REGISTER, f"act_in{j}",
                                 reset_less=True)
                m.d.comb += [
                    act.advance.eq(1),
                    act.i_valid.eq(delayed(m, b_meta.valid, ACTIVATION_INPUT_REGISTER, f"act_in_valid{j}")),
                    act.i.x.eq(x_bf16),
                    act.i.g.eq(0),
                    act.i.func.eq(desc.act_func),
                ]
                acc32 = delayed(m, b_vals[j], Lact, f"no_act{j}", reset_less=True)
                # Its bf16 rounding made at the delay line's input (the activation's input, the
                # same bits) and delayed beside it: the output stage keeps no carry chain.
                acc16 = delayed(m, convert.from_f32(b_vals[j]), Lact, f"no_act_bf16_{j}", reset_less=True)
                fp32_vals.append(Mux(desc.act_en, convert.to_f32(act.o), acc32))
                bf16_vals.append(Mux(desc.act_en, act.o, acc16))

        # The format, and zeros outside M x N.
        for j in range(E):
            value = Mux(desc.out_format == OutFormat.BF16, bf16_vals[j], fp32_vals[j])
            m.d.comb += self.o.lanes[j].eq(Mux(f_meta.inside[j], value, 0))
        m.d.comb += [self.o.last.eq(f_meta.last), self.o_valid.eq(f_meta.valid)]
        return m


class Epilogue(wiring.Component):
    """Streams ``act(acc + bias)`` in the command's output format, as rows become complete.

    Ports: ``start`` (strobe: ``desc`` and ``plan`` hold the command from this cycle on; the
    previous command's output is out), ``desc`` (``hw.gemm_core.command_layout``), ``plan``
    (``plan_layout``), ``rows_done_next`` and ``all_rows_next`` (from the next cycle on, rows
    0 .. rows_done_next - 1 of the accumulator are final, or with ``all_rows_next`` every row
    is: the values the core's counters take at the coming clock edge, ``rows_closed``),
    ``acc_read`` and ``bias_read`` (read ports of the accumulator and bias buffers, data
    registered here), ``o`` (``output_layout``).

    Throughput: one beat of ``out_lanes`` values a cycle while rows are complete and ``o`` takes
    them. Latency: a read issued in cycle t reaches the output queue in t +
    ``epilogue_latency(cfg)``; the queue (``SyncFIFOBuffered``) offers it two cycles later;
    a BFP tile leaves the quantizer ``QUANTIZE_LATENCY`` cycles after its last value enters.
    """

    def __init__(self, cfg: CoreConfig, command: data.StructLayout):
        self.cfg, self.command = cfg, command
        D = cfg.size
        acc_port, bias_port = _read_port_signatures(cfg)
        self.queue_depth = epilogue_latency(cfg) + 4
        super().__init__({
            "start": In(1),
            "desc": In(command),
            "plan": In(plan_layout(cfg)),
            "rows_done_next": In(range(D + cfg.rows + 1)),
            "all_rows_next": In(1),
            "acc_read": In(acc_port),
            "bias_read": In(bias_port),
            "o": Out(stream.Signature(output_layout(cfg))),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self.cfg
        E = cfg.out_lanes
        th, tw = cfg.tile
        D = cfg.size
        desc, plan = self.desc, self.plan
        bfp = (desc.out_format == OutFormat.BFP) if cfg.bfp_output else Const(0)

        # ---- issue: the reads, in the output's order, while their rows are final and the
        # output queue has room for them (credits: so the datapath never stalls).
        m.submodules.issue = issue = EpilogueIssue(cfg, self.command)
        room = Signal(init=1)  # held + issue - pop < queue_depth, a register computed a cycle ahead
        m.d.comb += [
            issue.start.eq(self.start), issue.desc.eq(desc), issue.plan.eq(plan),
            issue.rows_done_next.eq(self.rows_done_next), issue.all_rows_next.eq(self.all_rows_next),
            issue.room.eq(room),
        ]
        issued = issue.read.valid
        # The block RAMs read in every cycle (their data is taken only with a read's metadata):
        # no enable net from the read decision to the accumulator's two dozen block RAMs.
        m.d.comb += [
            self.acc_read.en.eq(1),
            self.acc_read.addr.eq(issue.acc_addr),
            self.bias_read.en.eq(1),
            self.bias_read.addr.eq(issue.bias_addr),
        ]

        # ---- the values: chunk, bias, activation, format ------------------------------------
        m.submodules.datapath = dp = EpilogueDatapath(cfg, self.command)
        m.d.comb += [dp.desc.eq(desc), dp.i.eq(issue.read), dp.acc_data.eq(self.acc_read.data),
                     dp.bias_data.eq(self.bias_read.data)]

        # ---- the output queue ------------------------------------------------------------
        entry = entry_layout(cfg)
        m.submodules.queue = queue = fifo.SyncFIFOBuffered(width=entry.size, depth=self.queue_depth)
        m.d.comb += [queue.w_en.eq(dp.o_valid), queue.w_data.eq(dp.o)]
        q_out = data.View(entry, queue.r_data)
        pop = queue.r_en & queue.r_rdy
        held = Signal(range(self.queue_depth + 1))  # reads in flight and values queued
        m.d.sync += held.eq(held + issued - pop)
        # held + issue - pop < queue_depth, without the sum.
        m.d.sync += room.eq(Mux(issued & ~pop, held < self.queue_depth - 1,
                                Mux(~issued & pop, 1, held < self.queue_depth)))

        # fp32 and bf16 leave straight from the queue.
        direct = [
            self.o.valid.eq(queue.r_rdy),
            queue.r_en.eq(self.o.ready),
            self.o.payload.lanes.eq(q_out.lanes),
            self.o.payload.last.eq(q_out.last),
        ]
        if not cfg.bfp_output:  # a reduced core: fp32 and bf16 results only
            m.d.comb += direct
            return m

        m.submodules.quantize = qz = Quantize(cfg.mantissa_bits, cfg.tile, E, "fp32", stochastic=cfg.stochastic)
        # The key follows ``desc.seed`` (set with ``start``) KEY_LATENCY cycles late; the first
        # value reaches the quantizer no sooner than the pipeline's latency after ``start``.
        assert epilogue_latency(cfg) >= KEY_LATENCY
        m.d.comb += [qz.rounding.eq(desc.rounding), qz.seed.eq(desc.seed), qz.clear.eq(self.start)]
        for j in range(E):
            m.d.comb += qz.i.payload[j].eq(q_out.lanes[j])
        # BFP: count the tiles out, so that the last beat of the last tile carries ``last``.
        out_i = Signal(range(D // th + 1))
        out_j = Signal(range(D // tw + 1))
        with m.If(self.start):
            m.d.sync += [out_i.eq(0), out_j.eq(0)]
        with m.If(bfp):
            m.d.comb += [
                qz.i.valid.eq(queue.r_rdy),
                queue.r_en.eq(qz.i.ready),
                self.o.valid.eq(qz.o.valid),
                qz.o.ready.eq(self.o.ready),
                self.o.payload.exponent.eq(qz.o.payload.exponent),
                self.o.payload.last.eq(qz.o.payload.last & (out_i == plan.tiles_m - 1) & (out_j == plan.tiles_n - 1)),
            ]
            for j in range(E):
                m.d.comb += self.o.payload.lanes[j].eq(qz.o.payload.codes[j].as_signed())
            with m.If(self.o.valid & self.o.ready & qz.o.payload.last):
                m.d.sync += out_j.eq(out_j + 1)
                with m.If(out_j == plan.tiles_n - 1):
                    m.d.sync += [out_j.eq(0), out_i.eq(out_i + 1)]
        with m.Else():
            m.d.comb += direct
        return m
