"""On-chip operand buffer with free transposed reads.

A stored matrix of codes is spread over ``lanes`` banks along its diagonals: element
``(r, c)`` lives in bank ``(r + c) % lanes`` at address ``(r // lanes) * cols + c``. Then the
``lanes`` elements of a row chunk ``(r, c0 .. c0+lanes-1)`` and those of a column chunk
``(r0 .. r0+lanes-1, c)`` (``c0``, ``r0`` multiples of ``lanes``) always sit in ``lanes``
different banks, so either is read in one cycle: the operand is stored once and read
as it is or transposed (docs/architecture.md, "Operand buffers").
"""

from __future__ import annotations

from amaranth import Array, Module, Mux, Signal, signed
from amaranth.lib import data, memory, wiring
from amaranth.lib.wiring import In, Out

__all__ = ["OperandBuffer", "READ_COLUMN", "READ_ROW"]

#: ``mode`` of a read: ``lanes`` rows of one column, or ``lanes`` columns of one row.
READ_COLUMN = 0
READ_ROW = 1


def _log2(n: int) -> int:
    if n < 1 or n & (n - 1):
        raise ValueError(f"{n} is not a power of two")
    return n.bit_length() - 1


class OperandBuffer(wiring.Component):
    """``rows`` x ``cols`` codes of ``code_width`` bits in ``lanes`` diagonal banks.

    Write (``w_en``, ``w_row``, ``w_col``, ``w_data``): the row chunk ``(w_row, w_col ..
    w_col+lanes-1)``, lane t holding column ``w_col + t``; ``w_col`` a multiple of ``lanes``.
    Read (``r_en``, ``r_mode``, ``r_row``, ``r_col``): ``READ_COLUMN`` gives rows ``r_row ..
    r_row+lanes-1`` of column ``r_col`` (``r_row`` a multiple of ``lanes``), ``READ_ROW``
    gives columns ``r_col .. r_col+lanes-1`` of row ``r_row`` (``r_col`` a multiple of
    ``lanes``); ``r_data`` lane t holds the t-th element one cycle after a cycle with
    ``r_en`` and holds it while ``r_en`` is low. One read and one write per cycle.
    """

    def __init__(self, lanes: int, code_width: int, rows: int, cols: int):
        self.shift = _log2(lanes)
        if rows % lanes or cols % lanes:
            raise ValueError(f"buffer sides {rows}x{cols} must be multiples of lanes={lanes}")
        self.lanes, self.code_width, self.rows, self.cols = lanes, code_width, rows, cols
        lane_data = data.ArrayLayout(signed(code_width), lanes)
        super().__init__({
            "w_en": In(1),
            "w_row": In(range(rows)),
            "w_col": In(range(cols)),
            "w_data": In(lane_data),
            "r_en": In(1),
            "r_mode": In(1),
            "r_row": In(range(rows)),
            "r_col": In(range(cols)),
            "r_data": Out(lane_data),
        })

    def elaborate(self, platform):
        m = Module()
        L, s = self.lanes, self.shift
        depth = (self.rows // L) * self.cols
        banks = []
        for b in range(L):
            mem = memory.Memory(shape=signed(self.code_width), depth=depth, init=[])
            m.submodules[f"bank{b}"] = mem
            banks.append((mem.read_port(), mem.write_port()))

        def mod_lanes(value):
            return value[:s] if s else 0

        # Write a row chunk: lane t -> bank (r + t) % L at address base + c0 + t, i.e. bank b
        # takes lane (b - r) % L.
        w_base = (self.w_row >> s) * self.cols + self.w_col
        w_lanes = Array(self.w_data[t] for t in range(L))
        for b, (_, wp) in enumerate(banks):
            t = Signal(max(s, 1), name=f"w_lane{b}")
            m.d.comb += [
                t.eq(mod_lanes(b - mod_lanes(self.w_row))),
                wp.en.eq(self.w_en),
                wp.addr.eq(w_base + t),
                wp.data.eq(w_lanes[t]),
            ]

        # Read: a column chunk hits every bank at one address; a row chunk hits bank b at
        # base + c0 + (b - r) % L. Either way lane t comes from bank (t + rot) % L, with rot
        # the column (column chunk) or the row (row chunk) modulo L.
        r_base = (self.r_row >> s) * self.cols + self.r_col
        is_row = self.r_mode == READ_ROW
        for b, (rp, _) in enumerate(banks):
            offset = Signal(max(s, 1), name=f"r_offset{b}")
            m.d.comb += [
                offset.eq(mod_lanes(b - mod_lanes(self.r_row))),
                rp.en.eq(self.r_en),
                rp.addr.eq(r_base + Mux(is_row, offset, 0)),
            ]
        rot = Signal(max(s, 1))
        with m.If(self.r_en):
            m.d.sync += rot.eq(Mux(is_row, mod_lanes(self.r_row), mod_lanes(self.r_col)))
        bank_data = Array(rp.data for rp, _ in banks)
        for t in range(L):
            lane_bank = Signal(max(s, 1), name=f"r_bank{t}")
            m.d.comb += [lane_bank.eq(mod_lanes(t + rot)), self.r_data[t].eq(bank_data[lane_bank])]
        return m
