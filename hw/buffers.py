"""On-chip operand buffer with free transposed reads.

A stored matrix of codes is spread over ``lanes`` banks along its diagonals: element
``(r, c)`` lives in bank ``(r + c) % lanes`` at address ``(r // lanes) * cols + c``. Then the
``lanes`` elements of a row chunk ``(r, c0 .. c0+lanes-1)`` and those of a column chunk
``(r0 .. r0+lanes-1, c)`` (``c0``, ``r0`` multiples of ``lanes``) always sit in ``lanes``
different banks, so either is read in one cycle: the operand is stored once and read
as it is or transposed (docs/architecture.md, "Operand buffers").

Reads take ``LATENCY`` = 3 cycles: the request is registered, and the banks' outputs are
registered before the lane rotation (each bank a ``BlockRam``: on ECP5 its block RAM's output
register), so at most one adder precedes and no logic follows a block RAM access in the same
cycle. Writes land the cycle
after their request (registered the same way).
"""

from __future__ import annotations

from amaranth import Array, Cat, Const, Module, Mux, Signal, signed
from amaranth.lib import data, wiring
from amaranth.lib.wiring import In, Out

from .block_ram import NO_RW_CHECK, BlockRam
from .params import OPERAND_READ_LATENCY

__all__ = ["OperandBuffer", "READ_COLUMN", "READ_ROW", "times_constant", "NO_RW_CHECK"]

#: ``mode`` of a read: ``lanes`` rows of one column, or ``lanes`` columns of one row.
READ_COLUMN = 0
READ_ROW = 1


def times_constant(value, constant: int):
    """``value * constant`` as a sum of shifted copies of ``value`` (one per set bit): an
    address pitch such as 96 then costs an adder, not a DSP block (Yosys maps a ``$mul`` by a
    constant to one)."""
    terms = [value << s for s in range(constant.bit_length()) if constant >> s & 1]
    if not terms:
        return Const(0)
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total


def rotate(values: list, amount, direction: int) -> list:
    """``[values[(t + direction * amount) % L] for t in range(L)]`` for an ``amount`` signal
    below L = len(values), as log2(L) stages of two-way multiplexers (a rotation by 2**k each,
    modulo L: any L)."""
    L = len(values)
    out = list(values)
    for k in range(max(1, (L - 1).bit_length()) if L > 1 else 0):
        step = direction * (1 << k)
        out = [Mux(amount[k], out[(t + step) % L], out[t]) for t in range(L)]
    return out


class OperandBuffer(wiring.Component):
    """``rows`` x ``cols`` codes of ``code_width`` bits in ``lanes`` diagonal banks.

    Write (``w_en``, ``w_row``, ``w_col``, ``w_data``, ``w_skip``): the row chunk ``(w_row,
    w_col .. w_col+lanes-1)``, lane t holding column ``w_col + t`` (any ``w_col``); a lane whose
    ``w_skip`` bit is set is not written (a partial chunk, e.g. a quantizer beat narrower than
    the buffer's lanes).
    Read (``r_en``, ``r_mode``, ``r_row``, ``r_col``): ``READ_COLUMN`` gives rows ``r_row ..
    r_row+lanes-1`` of column ``r_col`` (``r_row`` a multiple of ``lanes``), ``READ_ROW``
    gives columns ``r_col .. r_col+lanes-1`` of row ``r_row`` (any ``r_col``); ``r_data`` lane
    t holds the t-th element ``LATENCY`` = 3 cycles after a cycle with ``r_en`` and holds it
    while ``r_en`` is low. One read and one write per cycle; a write lands the cycle after its
    request; a read of an address in the cycle it is written is undefined (the core never does).
    """

    LATENCY = OPERAND_READ_LATENCY

    def __init__(self, lanes: int, code_width: int, rows: int, cols: int):
        if not isinstance(lanes, int) or lanes < 1:
            raise ValueError(f"lanes must be a positive integer, got {lanes!r}")
        self.shift = lanes.bit_length() - 1 if lanes & (lanes - 1) == 0 else None  # None: not a power of two
        if rows % lanes or cols % lanes:
            raise ValueError(f"buffer sides {rows}x{cols} must be multiples of lanes={lanes}")
        self.lanes, self.code_width, self.rows, self.cols = lanes, code_width, rows, cols
        lane_data = data.ArrayLayout(signed(code_width), lanes)
        super().__init__({
            "w_en": In(1),
            "w_row": In(range(rows)),
            "w_col": In(range(cols)),
            "w_data": In(lane_data),
            "w_skip": In(lanes),
            "r_en": In(1),
            "r_mode": In(1),
            "r_row": In(range(rows)),
            "r_col": In(range(cols)),
            "r_data": Out(lane_data),
        })

    def elaborate(self, platform):
        m = Module()
        L = self.lanes
        depth = (self.rows // L) * self.cols
        banks = []
        for b in range(L):
            m.submodules[f"bank{b}"] = mem = BlockRam(signed(self.code_width), depth)
            banks.append((mem.read0, mem.write))
        lane = range(L)

        def wrap(value):
            """``value % L`` for ``-L < value < 2 * L`` (a bit slice for a power-of-two L)."""
            if self.shift is not None:
                return value[:self.shift] if self.shift else Const(0)
            return Mux(value < 0, value + L, Mux(value >= L, value - L, value))

        def split(value, limit):
            """``(value // L, value % L)`` for 0 <= value < limit: a shift and a slice, or tables."""
            if self.shift is not None:
                return value >> self.shift, (value[:self.shift] if self.shift else Const(0))
            quotient = Array(Const(v // L, range(limit // L + 1)) for v in range(limit))
            remainder = Array(Const(v % L, lane) for v in range(limit))
            return quotient[value], remainder[value]

        # Write a row chunk: lane t -> bank (r + c0 + t) % L at address base + c0 + t, i.e. bank b
        # takes lane (b - r - c0) % L. The request is registered first, each bank's address
        # computed before that register: a register drives each bank's address pins.
        w_quot, w_rem = split(self.w_row, self.rows)
        _, wc_rem = split(self.w_col, self.cols)
        w_en = Signal()
        w_rot = Signal(lane)
        w_data = Signal.like(self.w_data)
        w_skip = Signal.like(self.w_skip)
        rot = Signal(lane)
        base = Signal(range(depth + L))
        m.d.comb += [rot.eq(wrap(w_rem + wc_rem)), base.eq(times_constant(w_quot, self.cols) + self.w_col)]
        m.d.sync += [w_en.eq(self.w_en), w_rot.eq(rot), w_data.eq(self.w_data), w_skip.eq(self.w_skip)]
        # Bank b takes lane (b - rot) % L: the lanes (with their skip bits) rotated by -rot.
        w_lanes = rotate([Cat(w_data[t], w_skip[t]) for t in range(L)], w_rot, -1)
        for b, (_, wp) in enumerate(banks):
            addr = Signal.like(wp.addr, name=f"w_addr{b}", reset_less=True)
            m.d.sync += addr.eq(base + wrap(b - rot))
            m.d.comb += [
                wp.en.eq(w_en & ~w_lanes[b][-1]),
                wp.addr.eq(addr),
                wp.data.eq(w_lanes[b][:-1]),
            ]

        # Read: a column chunk hits every bank at one address; a row chunk hits bank b at
        # base + c0 + (b - r - c0) % L. Either way lane t comes from bank (t + rot) % L, with rot
        # the column (column chunk) or the row and column (row chunk) modulo L. Stages: the
        # request's register (base, rotation), the banks, their output register, the rotation.
        r_quot, r_rem = split(self.r_row, self.rows)
        _, rc_rem = split(self.r_col, self.cols)
        is_row = self.r_mode == READ_ROW
        read1, read2 = Signal(), Signal()
        base1 = Signal(range(depth))
        r_rot = Signal(lane)
        rot1, rot2, rot3 = Signal(lane), Signal(lane), Signal(lane)
        m.d.comb += r_rot.eq(Mux(is_row, wrap(r_rem + rc_rem), rc_rem))
        m.d.sync += [read1.eq(self.r_en), read2.eq(read1)]
        with m.If(self.r_en):
            m.d.sync += [base1.eq(times_constant(r_quot, self.cols) + self.r_col), rot1.eq(r_rot)]
        for b, (rp, _) in enumerate(banks):
            # Bank b's offset from base1 (0 in a column chunk), registered with the request: a
            # bank's address is then one adder from flip-flops of its own.
            offset1 = Signal(lane, name=f"r_offset{b}")
            with m.If(self.r_en):
                m.d.sync += offset1.eq(Mux(is_row, wrap(b - r_rot), 0))
            m.d.comb += [
                rp.en.eq(read1),
                rp.addr.eq(base1 + offset1),
            ]
        with m.If(read1):
            m.d.sync += rot2.eq(rot1)
        with m.If(read2):
            m.d.sync += rot3.eq(rot2)
        # A bank's word (BlockRam.LATENCY = 2: its address register, its output register)
        # holds while no read is addressed to it, like rot3.
        assert BlockRam.LATENCY == 2
        # Lane t comes from bank (t + rot) % L: the banks' words rotated by rot.
        for t, word in enumerate(rotate([rp.data for rp, _ in banks], rot3, 1)):
            m.d.comb += self.r_data[t].eq(word)
        return m
