"""A floating-point MAC array: R x C processing elements, 16-bit float products, fp32 sums.

The reference design of the density experiment (benchmarks/density.py, docs/reports/
density.md): the broadcast shape of ``hbfp.hw.mac_array.MacArray`` (every beat brings a
column of ``rows`` A values and a row of ``cols`` B values; PE (i, j) multiplies ``a[i] *
b[j]`` and accumulates), but with bf16 or fp16 operands and an fp32 accumulator per PE,
computing ``hbfp.golden.float_mac.float_mac`` bit for bit.

An fp32 adder needs ``AddF32Datapath.LATENCY`` = 5 cycles, so one accumulator cannot take a
product every cycle. Each PE therefore runs ``INTERLEAVE`` = 5 independent accumulations
whose partial sums circulate through its adder pipeline: the adder's output is its own
input ``INTERLEAVE`` cycles later, so the pipeline registers are the accumulators.
Consecutive beats belong to consecutive accumulations ("groups"): beat ``n`` feeds group
``n % INTERLEAVE``. The array thus computes ``INTERLEAVE`` independent R x C products at
once (in a GEMM: five output blocks, or five K-slices summed later), each a sum of ``k``
products.
"""

from __future__ import annotations

from types import SimpleNamespace

from amaranth.hdl import Cat, Const, Module, Mux, Signal, Value, signed
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out
from hbfp.golden.float_mac import FORMATS, float_format

from .add_f32 import AddF32Datapath, _leading_zeros
from .params import (
    F32_BIAS,
    F32_EXP_BITS,
    F32_EXP_INF,
    F32_FRAC_BITS,
    F32_QNAN,
    FP32_WIDTH,
)

__all__ = ["FloatMacArray", "FORMATS"]

_SIGN = 1 << (FP32_WIDTH - 1)


def operand_layout(significand_bits: int) -> data.StructLayout:
    """A 16-bit operand widened to fp32 fields at the array's edge: its significand with the
    implicit one (``significand_bits``), the biased fp32 exponent field, sign, and class."""
    return data.StructLayout({
        "sig": significand_bits,
        "exp": F32_EXP_BITS,
        "sign": 1,
        "zero": 1,
        "inf": 1,
        "nan": 1,
    })


class FloatMacArray(wiring.Component):
    """``rows`` x ``cols`` floating-point MACs; equals ``hbfp.golden.float_mac.float_mac``.

    ``fmt``: the operand format, "bf16" or "fp16". ``k``: the products each output sums.

    Input ``i``: ``{a: rows patterns, b: cols patterns}`` (16 bits each), one per beat. Beats
    come in runs of ``INTERLEAVE * k``: beat ``n`` of a run is step ``n // INTERLEAVE`` of
    group ``g = n % INTERLEAVE``, i.e. ``A_g[:, step]`` and ``B_g[step, :]``.
    Output ``o``: ``INTERLEAVE`` beats per run, ``{sums: rows x cols fp32 patterns, group}``,
    group 0 first: ``sums[i][j] = float_mac(A_g, B_g, fmt)[i, j]`` (NaN as ``0x7FC00000``).

    Throughput: one beat per cycle, every PE one MAC per cycle, while beats keep coming and
    the output keeps up. A group's partial sum passes the adder once every ``INTERLEAVE``
    cycles, so a beat can only enter in its group's cycle: after an idle input cycle the
    next beat waits ``INTERLEAVE - 1`` cycles. An output beat not taken stalls the array.
    Latency: a group's result is offered ``LATENCY`` cycles after its last beat entered.

    Pipeline: the edge widens the broadcast operands to fp32 fields (``rows + cols``
    converters, shared by a row or column of PEs) and registers them; in every PE (1) the
    significand product (a multiplier block), exponent sum, sign and class, (2) the fp32
    product pattern (one normalizing shift, range check, specials), then the 5-stage
    ``AddF32Datapath`` whose output loops back to its second addend.
    """

    INTERLEAVE = AddF32Datapath.LATENCY
    #: Cycles from a group's last beat accepted to its result valid on ``o``: edge, product,
    #: pack, then the adder.
    LATENCY = 3 + AddF32Datapath.LATENCY

    def __init__(self, rows: int, cols: int, fmt: str, k: int):
        try:
            if not isinstance(rows, int) or not isinstance(cols, int) or rows < 1 or cols < 1:
                raise ValueError(f"rows and cols must be positive integers, got {rows} x {cols}")
            if not isinstance(k, int) or k < 1:
                raise ValueError(f"k (products per output) must be a positive integer, got {k!r}")
            self.fmt = float_format(fmt)
        except ValueError:
            # A component that failed to construct was never meant to be elaborated: keep
            # Amaranth from warning that it went unused.
            self._MustUse__used = True
            raise
        self.rows, self.cols, self.k = rows, cols, k
        in_layout = data.StructLayout({
            "a": data.ArrayLayout(self.fmt.width, rows),
            "b": data.ArrayLayout(self.fmt.width, cols),
        })
        out_layout = data.StructLayout({
            "sums": data.ArrayLayout(data.ArrayLayout(FP32_WIDTH, cols), rows),
            "group": range(self.INTERLEAVE),
        })
        super().__init__({"i": In(stream.Signature(in_layout)), "o": Out(stream.Signature(out_layout))})

    def _widen(self, m: Module, bits: Value) -> Value:
        """Fields of one operand pattern, as ``hbfp.golden.float_mac.widen`` reads it."""
        f = self.fmt
        S = f.significand_bits
        frac = bits[: f.frac_bits]
        e = bits[f.frac_bits : f.frac_bits + f.exp_bits]
        e_max = 2**f.exp_bits - 1
        out = Signal(operand_layout(S))
        m.d.comb += [
            out.sign.eq(bits[-1]),
            out.inf.eq((e == e_max) & (frac == 0)),
            out.nan.eq((e == e_max) & (frac != 0)),
            out.sig.eq(Cat(frac, Const(1, 1))),
            out.exp.eq(e + (F32_BIAS - f.bias)),
        ]
        if not f.subnormals:
            m.d.comb += out.zero.eq(e == 0)  # DAZ
            return out
        m.d.comb += out.zero.eq((e == 0) & (frac == 0))
        # A subnormal frac * 2**(1 - bias - frac_bits) is a normal fp32 value: bring its
        # leading one to the implicit position. The count's input is padded with ones below
        # to a power of two (the tree of hw.add_f32).
        width = 1 << (f.frac_bits - 1).bit_length()
        pad = width - f.frac_bits
        lz, _ = _leading_zeros(Cat(Const((1 << pad) - 1, pad), frac))
        with m.If((e == 0) & (frac != 0)):
            m.d.comb += [
                out.sig.eq(frac << (lz + 1)),
                out.exp.eq(F32_BIAS - f.bias - lz),
            ]
        return out

    def elaborate(self, platform):
        m = Module()
        R, C, L, K = self.rows, self.cols, self.INTERLEAVE, self.k
        S = self.fmt.significand_bits
        P = 2 * S  # product bits; its leading one is at bit P - 1 or P - 2

        # The whole array moves together unless a finished group waits at the output; the
        # adder pipelines must never skip a cycle, or the groups would leave their slots.
        advance = Signal()
        m.d.comb += advance.eq(~(self.o.valid & ~self.o.ready))

        # Slot bookkeeping: ``phase`` counts advancing cycles (which group's partial sum is
        # due at the adders), ``group`` and ``step`` count accepted beats. A beat enters only
        # in its own group's cycle.
        phase = Signal(range(L))
        group = Signal(range(L))
        step = Signal(range(K))
        m.d.comb += self.i.ready.eq(advance & (phase == group))
        take = self.i.valid & self.i.ready
        with m.If(advance):
            m.d.sync += phase.eq(Mux(phase == L - 1, 0, phase + 1))
        with m.If(take):
            m.d.sync += group.eq(Mux(group == L - 1, 0, group + 1))
            with m.If(group == L - 1):
                m.d.sync += step.eq(Mux(step == K - 1, 0, step + 1))

        def stage(name, **values):
            # Data registers have no reset: the valid bits say what they hold.
            regs = {}
            for key, value in values.items():
                shape = value.shape() if isinstance(value, data.View) else Value.cast(value).shape()
                reg = Signal(shape, name=f"{name}_{key}", reset_less=True)
                with m.If(advance):
                    m.d.sync += reg.eq(value)
                regs[key] = reg
            return SimpleNamespace(**regs)

        def control(name, value):
            reg = Signal(name=name)
            with m.If(advance):
                m.d.sync += reg.eq(value)
            return reg

        # Edge: widen the broadcast operands once per row and column, then register them
        # (the register also cuts the fan-out to R * C multipliers).
        edge_a = [stage(f"edge_a{i}", x=self._widen(m, self.i.payload.a[i])).x for i in range(R)]
        edge_b = [stage(f"edge_b{j}", x=self._widen(m, self.i.payload.b[j])).x for j in range(C)]
        v1 = control("v1", take)
        first1 = control("first1", step == 0)
        last1 = control("last1", step == K - 1)
        v2, first2, last2 = control("v2", v1), control("first2", first1), control("last2", last1)
        v3, first3, last3 = control("v3", v2), control("first3", first2), control("last3", last2)

        results = [[None] * C for _ in range(R)]
        out_valid = []
        for i in range(R):
            for j in range(C):
                a, b = edge_a[i], edge_b[j]
                # 1. Significand product (exact), exponent sum, class.
                nan = a.nan | b.nan | (a.inf & b.zero) | (a.zero & b.inf)
                # The biased exponent of the product before normalizing: -127 .. 381.
                exp_sum = Signal(signed(F32_EXP_BITS + 2), name=f"pe{i}_{j}_exp_sum")
                m.d.comb += exp_sum.eq(a.exp + b.exp - F32_BIAS)
                s1 = stage(
                    f"pe{i}_{j}_mul",
                    sig=a.sig * b.sig,
                    exp=exp_sum,
                    sign=a.sign ^ b.sign,
                    nan=nan,
                    inf=(a.inf | b.inf) & ~nan,
                    zero=a.zero | b.zero,
                )
                # 2. The fp32 pattern: one normalizing shift (a product of two significands
                # in [1, 2) lies in [1, 4)), then the range check. The significand is exact,
                # so "below 2**-126 after rounding" is "exponent field below 1".
                top = s1.sig[P - 1]
                frac = Mux(top, s1.sig[: P - 1] << (F32_FRAC_BITS - (P - 1)), s1.sig[: P - 2] << (F32_FRAC_BITS - (P - 2)))
                exp = Signal(range(-F32_BIAS - 1, 2 * F32_EXP_INF), name=f"pe{i}_{j}_exp")
                m.d.comb += exp.eq(s1.exp + top)
                prod = Signal(FP32_WIDTH, name=f"pe{i}_{j}_prod")
                sign = Cat(Const(0, FP32_WIDTH - 1), s1.sign)
                with m.If(s1.nan):
                    m.d.comb += prod.eq(F32_QNAN)
                with m.Elif(s1.inf | (exp >= F32_EXP_INF)):
                    m.d.comb += prod.eq(sign | (F32_EXP_INF << F32_FRAC_BITS))
                with m.Elif(s1.zero | (exp < 1)):
                    m.d.comb += prod.eq(sign)
                with m.Else():
                    m.d.comb += prod.eq(Cat(frac[:F32_FRAC_BITS], exp[:F32_EXP_BITS], s1.sign))
                s2 = stage(f"pe{i}_{j}_pack", prod=prod)

                # 3. Accumulate. A group's first product adds to +0; an empty slot adds -0,
                # which leaves every partial sum unchanged (x + -0 = x, -0 + -0 = -0).
                add = AddF32Datapath()
                m.submodules[f"add_{i}_{j}"] = add
                m.d.comb += [
                    add.advance.eq(advance),
                    add.a.eq(Mux(v3, s2.prod, _SIGN)),
                    add.b.eq(Mux(v3 & first3, 0, add.result)),
                    # ``in_valid`` marks a group's last product: it comes out with the final sum.
                    add.in_valid.eq(v3 & last3),
                ]
                results[i][j] = add.result
                out_valid.append(add.out_valid)

        out_group = Signal(range(L))
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += out_group.eq(Mux(out_group == L - 1, 0, out_group + 1))
        # Every PE's adder carries the same valid bits; PE (0, 0)'s stands for all.
        m.d.comb += [self.o.valid.eq(out_valid[0]), self.o.payload.group.eq(out_group)]
        for i in range(R):
            for j in range(C):
                m.d.comb += self.o.payload.sums[i][j].eq(results[i][j])
        return m
