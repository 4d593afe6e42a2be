"""The MAC array: R x C processing elements, exact integer sums per K-tile.

Dataflow (docs/architecture.md): output-stationary with broadcast operands. Every cycle one
beat brings a column of A (``rows`` codes, ``A[i0:i0+R, k]``) and a row of B (``cols`` codes,
``B[k, j0:j0+C]``); PE (i, j) adds ``a[i] * b[j]`` to its own accumulator. After ``tk`` beats
(one K-tile) every accumulator holds ``hbfp.golden.gemm.partial_sums`` for its output; the
sums move to a shadow bank in the same cycle the next K-tile starts, and drain one row of C
sums per cycle while the PEs go on.
"""

from __future__ import annotations

from amaranth import Module, Mux, Signal, signed
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from .params import psum_width

__all__ = ["MacArray"]


class MacArray(wiring.Component):
    """``rows`` x ``cols`` int MACs; equals ``hbfp.golden.gemm.partial_sums`` per K-tile.

    Input ``i``: one K step per beat, ``{a: rows codes, b: cols codes}``; every ``tk`` beats
    close a K-tile. Output ``o``: ``rows`` beats per K-tile, ``{sums: cols sums, row}``, row 0
    first. Latency: the first row of a K-tile leaves 3 cycles after the tile's last beat
    enters. Throughput: one beat per cycle (every PE one MAC per cycle) while ``tk >= rows``
    and the output keeps up; a K-tile whose sums find the shadow bank still draining waits.
    """

    def __init__(self, rows: int, cols: int, tk: int, mantissa_bits_a: int = 8, mantissa_bits_b: int = 8):
        if rows < 1 or cols < 1 or tk < 1:
            raise ValueError("rows, cols and tk must be positive")
        self.rows, self.cols, self.tk = rows, cols, tk
        self.mantissa_bits_a, self.mantissa_bits_b = mantissa_bits_a, mantissa_bits_b
        self.psum_width = psum_width(mantissa_bits_a, mantissa_bits_b, tk)
        in_layout = data.StructLayout({
            "a": data.ArrayLayout(signed(mantissa_bits_a), rows),
            "b": data.ArrayLayout(signed(mantissa_bits_b), cols),
        })
        out_layout = data.StructLayout({
            "sums": data.ArrayLayout(signed(self.psum_width), cols),
            "row": range(rows),
        })
        super().__init__({"i": In(stream.Signature(in_layout)), "o": Out(stream.Signature(out_layout))})

    def elaborate(self, platform):
        m = Module()
        R, C, W = self.rows, self.cols, self.psum_width
        prod_w = self.mantissa_bits_a + self.mantissa_bits_b

        # Stage 1 registers the broadcast operands (fan-out to R*C multipliers); stage 2 the
        # products (the DSP block's output register); stage 3 the accumulators.
        k = Signal(range(self.tk))
        a1 = Signal.like(self.i.payload.a)
        b1 = Signal.like(self.i.payload.b)
        v1, first1, last1 = Signal(name="v1"), Signal(name="first1"), Signal(name="last1")
        prod = [[Signal(signed(prod_w), name=f"prod_{i}_{j}") for j in range(C)] for i in range(R)]
        v2, first2, last2 = Signal(name="v2"), Signal(name="first2"), Signal(name="last2")
        acc = [[Signal(signed(W), name=f"acc_{i}_{j}") for j in range(C)] for i in range(R)]
        shadow = [[Signal(signed(W), name=f"shadow_{i}_{j}") for j in range(C)] for i in range(R)]
        full = Signal()  # the shadow bank holds sums not yet drained
        row = Signal(range(R))

        drain_done = self.o.valid & self.o.ready & (row == R - 1)
        # The beat that closes a K-tile may only move its sums into a free shadow bank.
        advance = ~(v2 & last2 & full & ~drain_done)
        m.d.comb += self.i.ready.eq(advance)

        with m.If(advance):
            m.d.sync += [
                a1.eq(self.i.payload.a),
                b1.eq(self.i.payload.b),
                v1.eq(self.i.valid),
                first1.eq(k == 0),
                last1.eq(k == self.tk - 1),
                v2.eq(v1),
                first2.eq(first1),
                last2.eq(last1),
            ]
            with m.If(self.i.valid):
                m.d.sync += k.eq(Mux(k == self.tk - 1, 0, k + 1))
            for i in range(R):
                for j in range(C):
                    m.d.sync += prod[i][j].eq(a1[i] * b1[j])
                    nxt = Mux(first2, prod[i][j], acc[i][j] + prod[i][j])
                    with m.If(v2):
                        m.d.sync += acc[i][j].eq(nxt)
                        with m.If(last2):
                            m.d.sync += shadow[i][j].eq(nxt)

        with m.If(advance & v2 & last2):
            m.d.sync += [full.eq(1), row.eq(0)]
        with m.Elif(self.o.valid & self.o.ready):
            m.d.sync += row.eq(row + 1)
            with m.If(row == R - 1):
                m.d.sync += full.eq(0)

        m.d.comb += [self.o.valid.eq(full), self.o.payload.row.eq(row)]
        for i in range(R):
            with m.If(row == i):
                for j in range(C):
                    m.d.comb += self.o.payload.sums[j].eq(shadow[i][j])
        return m
