"""A signed multiplier in LUTs and carry chains, for the PEs that find no DSP block.

An LFE5U-85F has 156 MULT18X18D blocks; a 16x16 MAC array needs 256 multipliers. Yosys maps a
``$mul`` without DSPs (``synth_ecp5 -nodsp``) to an array of AND terms summed by carry-save
full adders in LUTs; this module builds the product from radix-4 Booth partial products summed
by a tree of two-operand adders, each of which Yosys maps to one CCU2C carry chain
(docs/reports/lut-mult.md compares the two).

- ``BoothProduct``: the combinational product ``p = a * b`` from ``a``, ``neg_a = -a`` and ``b``.
  The caller supplies ``-a`` so that an array can negate each row's operand once for all of
  its columns.
- ``LutMultiplier``: a ``BoothProduct`` between registered operands and a registered product,
  the registers a DSP block would hold: ``p`` is valid ``LATENCY`` = 2 cycles after ``a``, ``b``.

The partial products: digit ``k >= 1`` of ``b`` (bits ``2k+1, 2k, 2k-1``) selects ``0, ±a,
±2a``; a negative one is added as its one's complement plus a one at its lowest bit, and that
one is the carry-in of an adder of the tree (every row but row 0 is the higher operand of
exactly one adder, whose carry chain starts at that row's lowest bit). Row 0's digit (bits 1,
0 and an implicit 0) is one of ``0, a, -2a, -a``, selected exactly from ``a`` and ``-a``, so it
needs no carry-in. Sign extension is replaced by constant ones (the usual "1, ~s" prefixes),
and everything is summed modulo ``2**(width_a + width_b)``, where the product fits.
"""

from __future__ import annotations

from amaranth import Cat, Const, Module, Mux, Signal, signed
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

__all__ = ["BoothProduct", "LutMultiplier"]


class BoothProduct(wiring.Component):
    """``p = a * b`` (signed ``width_a`` x ``width_b`` bits, product ``width_a + width_b``), given
    ``neg_a = -a``: one LUT level of partial products and ``ceil(log2(digits))`` carry chains,
    ``digits = ceil(width_b / 2)``. Combinational (``LATENCY`` 0), or with ``staged`` the
    partial products are registered (no reset, no enable; ``LATENCY`` 1): ``p`` is the product
    of the previous cycle's operands, and a cycle holds the LUT level or the adder tree, not
    both."""

    def __init__(self, width_a: int, width_b: int, staged: bool = False):
        if width_a < 2 or width_b < 2:
            self._MustUse__used = True  # never to be elaborated: no "unused" warning
            raise ValueError(f"operands must have at least 2 bits (sign included), got {width_a} x {width_b}")
        self.width_a, self.width_b = width_a, width_b
        self.staged = staged
        self.LATENCY = int(staged)
        super().__init__({
            "a": In(signed(width_a)),
            "neg_a": In(signed(width_a + 1)),
            "b": In(signed(width_b)),
            "p": Out(signed(width_a + width_b)),
        })

    def elaborate(self, platform):
        m = Module()
        wa, wb = self.width_a, self.width_b
        W = wa + wb
        n = (wb + 1) // 2
        a, na = self.a.as_unsigned(), self.neg_a.as_unsigned()
        b = [self.b[min(j, wb - 1)] for j in range(2 * n)]  # sign-extended to 2n bits

        def top(x, lsb):  # x placed at bit lsb: zero-extended or cut to the product's width
            return Cat(x, Const(0, max(0, W - lsb - len(x))))[: W - lsb]

        # Row 0: (b1, b0) selects 0, a, -2a, -a, as an exact (wa + 2)-bit number; its "~s"
        # prefix bit stands for the sign extension.
        a2 = Cat(a, a[-1], a[-1])
        na2 = Cat(na, na[-1])
        def stage(value, name):  # the partial products' register, if staged
            if not self.staged:
                return value
            r = Signal(len(value), name=f"{name}_q", reset_less=True)
            m.d.sync += r.eq(value)
            return r

        r0 = Signal(wa + 2, name="row0_pp")
        with m.Switch(Cat(b[0], b[1])):
            with m.Case(1):
                m.d.comb += r0.eq(a2)
            with m.Case(2):
                m.d.comb += r0.eq(Cat(Const(0, 1), na2[:-1]))
            with m.Case(3):
                m.d.comb += r0.eq(na2)
        r0 = stage(r0, "row0_pp")
        rows = [(0, top(Cat(r0, ~r0[-1]), 0))]
        negs = [None]
        for k in range(1, n):
            hi, mid, lo = b[2 * k + 1], b[2 * k], b[2 * k - 1]
            one = mid ^ lo
            two = (hi & ~mid & ~lo) | (~hi & mid & lo)
            # |digit| * a in wa + 1 bits, complemented for a negative digit (hi: a digit of
            # 111 gives ~0 + 1 = 0, also right).
            s = Mux(one, Cat(a, a[-1]), Mux(two, Cat(Const(0, 1), a), 0))
            x = Signal(wa + 1, name=f"row{k}_pp")
            m.d.comb += x.eq(s ^ hi.replicate(wa + 1))
            x, hi = stage(x, f"row{k}_pp"), stage(hi, f"row{k}_neg")
            rows.append((2 * k, top(Cat(x[:wa], ~x[wa], Const(1, 1)), 2 * k)))
            negs.append(hi)

        # A balanced tree of two-operand adders. Each sum is kept as a signal of its own
        # (``keep``): otherwise Yosys' alumacc merges the tree into one multi-operand sum and
        # maps it to carry-save full adders in LUTs instead of carry chains.
        level = 0
        while len(rows) > 1:
            nxt = []
            for i in range(0, len(rows) - 1, 2):
                (lo_lsb, lo_bits), (hi_lsb, hi_bits) = rows[i], rows[i + 1]
                skip = hi_lsb - lo_lsb  # the lower row's bits below the higher one pass by
                s = Signal(W - hi_lsb, name=f"sum{level}_{i // 2}", attrs={"keep": 1})
                m.d.comb += s.eq(lo_bits[skip:] + hi_bits + negs[hi_lsb // 2])
                nxt.append((lo_lsb, Cat(lo_bits[:skip], s)))
            if len(rows) % 2:
                nxt.append(rows[-1])
            rows = nxt
            level += 1
        m.d.comb += self.p.eq(rows[0][1])
        return m


class LutMultiplier(wiring.Component):
    """``p = a * b`` (signed), ``LATENCY`` = 2 cycles from ``a``, ``b`` to ``p``, one product per
    cycle: registered operands (and ``-a``), a ``BoothProduct``, a registered product: the
    stages of a DSP block with input and output registers, in LUTs and carry chains. With
    ``staged`` the first register holds the partial products instead (a staged
    ``BoothProduct`` fed from ``a``, ``-a`` and ``b``): the same latency, the LUT level in the
    first cycle and the adder tree in the second."""

    LATENCY = 2

    def __init__(self, width_a: int, width_b: int, staged: bool = False):
        self.width_a, self.width_b = width_a, width_b
        self.staged = staged
        super().__init__({
            "a": In(signed(width_a)),
            "b": In(signed(width_b)),
            "p": Out(signed(width_a + width_b)),
        })

    def elaborate(self, platform):
        m = Module()
        m.submodules.product = product = BoothProduct(self.width_a, self.width_b, staged=self.staged)
        if self.staged:
            m.d.comb += [product.a.eq(self.a), product.neg_a.eq(-self.a), product.b.eq(self.b)]
            m.d.sync += self.p.eq(product.p)
            return m
        # Data registers without reset: what a DSP block's input and output registers are.
        a1 = Signal.like(self.a, reset_less=True)
        na1 = Signal(signed(self.width_a + 1), reset_less=True)
        b1 = Signal.like(self.b, reset_less=True)
        m.d.sync += [a1.eq(self.a), na1.eq(-self.a), b1.eq(self.b), self.p.eq(product.p)]
        m.d.comb += [product.a.eq(a1), product.neg_a.eq(na1), product.b.eq(b1)]
        return m
