"""The pipelined fp32 adder of the device (docs/numerics.md, section 1).

``AddF32Datapath`` is the bare pipeline with a shared ``advance`` enable, the form the GEMM
core instantiates once per lane; ``AddF32`` wraps it with stream ports and the standard
pipeline handshake. Both compute ``hbfp.golden.bf16.add_f32`` bit for bit and emit the
canonical quiet NaN ``0x7FC00000`` for every NaN result.
"""

from __future__ import annotations

from types import SimpleNamespace

from amaranth.hdl import Cat, Const, Module, Mux, Signal, Value, signed
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from .params import ADD_LATENCY, F32_EXP_BITS, F32_FRAC_BITS, F32_QNAN, FP32_WIDTH

__all__ = [
    "F32_FRAC_BITS",
    "F32_EXP_BITS",
    "F32Layout",
    "OperandsLayout",
    "F32_QNAN",
    "AddF32Datapath",
    "AddF32",
]

#: An fp32 pattern, fields from the LSB as IEEE lays them out.
F32Layout = data.StructLayout({"frac": F32_FRAC_BITS, "exp": F32_EXP_BITS, "sign": 1})
#: The payload of ``AddF32.i``: the two addends.
OperandsLayout = data.StructLayout({"a": FP32_WIDTH, "b": FP32_WIDTH})

_EXP_MAX = 2**F32_EXP_BITS - 1  # the inf/NaN field
_SIG_BITS = F32_FRAC_BITS + 1  # significand with its hidden bit
# Below the significand the aligned addend keeps a guard and a round bit, then one sticky
# bit; with these three, RNE of a sum or difference is exact (a difference of operands more
# than one binade apart needs at most one normalizing left shift, which uses the round bit).
_GR_BITS = 2
_EXT_BITS = _SIG_BITS + _GR_BITS + 1  # significand, guard, round, sticky
# Shifting the smaller significand further than this leaves it entirely in the sticky bit.
_ALIGN_MAX = _SIG_BITS + _GR_BITS


def _leading_zeros(value: Value) -> tuple[Value, int]:
    """Leading zeros of ``value`` (width a power of two, not all zero), as a balanced tree
    of 2:1 muxes (log2 levels, not a priority chain). Returns (count, count width)."""
    width = len(value)
    if width == 2:
        return ~value[1], 1
    half = width // 2
    lo_count, w = _leading_zeros(value[:half])
    hi_count, _ = _leading_zeros(value[half:])
    hi_zero = value[half:] == 0
    return Mux(hi_zero, Cat(lo_count, Const(1, 1)), Cat(hi_count, Const(0, 1))), w + 1


class AddF32Datapath(wiring.Component):
    """Pipelined fp32 adder: ``result = hbfp.golden.bf16.add_f32(a, b)`` bit for bit (DAZ on
    both inputs, RNE, FTZ on the result, overflow to +-inf, every NaN result ``0x7FC00000``).

    All stages move together on a cycle with ``advance`` high: then ``a``, ``b`` and
    ``in_valid`` are taken in, and ``result`` with ``out_valid`` show the operands taken in
    ``LATENCY`` advancing cycles earlier. With ``advance`` low every stage holds, so
    ``result`` holds too. Several lanes may share one ``advance``.

    Latency: ``LATENCY`` = 5 cycles. Throughput: one addition per cycle.

    Stages (a register after each): 1. unpack, DAZ, classify, compare magnitudes, swap,
    exponent difference; 2. align the smaller significand (guard/round/sticky); 3. add or
    subtract; 4. leading-zero count and normalize; 5. round, pack, specials, FTZ, overflow.
    """

    LATENCY = ADD_LATENCY  # the five stages below (hw.params: CoreConfig checks the K-tile against it)

    def __init__(self):
        super().__init__(
            {
                "a": In(FP32_WIDTH),
                "b": In(FP32_WIDTH),
                "in_valid": In(1),
                "advance": In(1),
                "result": Out(FP32_WIDTH),
                "out_valid": Out(1),
            }
        )

    def _stage(self, m: Module, name: str, **values) -> SimpleNamespace:
        # Data registers have no reset: only the valid bits say what they hold.
        regs = {}
        for key, value in values.items():
            value = Value.cast(value)
            reg = Signal(value.shape(), name=f"{name}_{key}", reset_less=True)
            with m.If(self.advance):
                m.d.sync += reg.eq(value)
            regs[key] = reg
        return SimpleNamespace(**regs)

    def elaborate(self, platform):
        m = Module()

        valid = self.in_valid
        for k in range(self.LATENCY):
            reg = Signal(name=f"s{k + 1}_valid")
            with m.If(self.advance):
                m.d.sync += reg.eq(valid)
            valid = reg
        m.d.comb += self.out_valid.eq(valid)

        # 1. Unpack, DAZ, classify, order the operands by magnitude.
        a = F32Layout(self.a)
        b = F32Layout(self.b)
        # DAZ: a subnormal input has exponent field 0 and reads as a zero of its sign, so
        # its fraction is dropped and no hidden bit is set.
        a_zero = a.exp == 0
        b_zero = b.exp == 0
        a_mag = Mux(a_zero, 0, Cat(a.frac, a.exp))
        b_mag = Mux(b_zero, 0, Cat(b.frac, b.exp))
        a_sig = Mux(a_zero, 0, Cat(a.frac, Const(1, 1)))
        b_sig = Mux(b_zero, 0, Cat(b.frac, Const(1, 1)))
        a_nan = (a.exp == _EXP_MAX) & (a.frac != 0)
        b_nan = (b.exp == _EXP_MAX) & (b.frac != 0)
        a_inf = (a.exp == _EXP_MAX) & (a.frac == 0)
        b_inf = (b.exp == _EXP_MAX) & (b.frac == 0)
        # Magnitudes compare as integers (exponent above fraction); the larger one sets the
        # sign and the exponent, so the significand difference is never negative.
        swap = b_mag > a_mag
        exp_big = Mux(swap, b.exp, a.exp)
        exp_small = Mux(swap, a.exp, b.exp)
        exp_diff = (exp_big - exp_small)[:F32_EXP_BITS]
        s1 = self._stage(
            m,
            "s1",
            sign=Mux(swap, b.sign, a.sign),
            sub=a.sign ^ b.sign,
            exp=exp_big,
            sig_big=Mux(swap, b_sig, a_sig),
            sig_small=Mux(swap, a_sig, b_sig),
            shift=Mux(exp_diff > _ALIGN_MAX, _ALIGN_MAX, exp_diff),
            # inf + -inf is invalid; otherwise an inf is the larger magnitude, so its sign
            # is the sign carried with the larger operand.
            nan=a_nan | b_nan | (a_inf & b_inf & (a.sign ^ b.sign)),
            inf=a_inf | b_inf,
            # The sign of an exact zero sum: -0 only for (-0) + (-0) (RNE).
            zero_sign=a.sign & b.sign,
        )

        # 2. Align the smaller significand; what falls below the round bit ORs into sticky.
        wide = Cat(Const(0, _ALIGN_MAX), s1.sig_small) >> s1.shift
        kept = wide[_ALIGN_MAX - _GR_BITS :]
        sticky = wide[: _ALIGN_MAX - _GR_BITS] != 0
        s2 = self._stage(
            m,
            "s2",
            sign=s1.sign,
            sub=s1.sub,
            exp=s1.exp,
            big=Cat(Const(0, _GR_BITS + 1), s1.sig_big),
            small=Cat(sticky, kept),
            nan=s1.nan,
            inf=s1.inf,
            zero_sign=s1.zero_sign,
        )

        # 3. One adder for both: a difference adds the complement (one extra bit for the
        # carry of a sum). The sticky LSB makes a difference round right: the true value lies
        # strictly between the computed one and the next multiple of two sticky units.
        small = Cat(s2.small, Const(0, 1))
        total = (Cat(s2.big, Const(0, 1)) + (small ^ s2.sub.replicate(_EXT_BITS + 1)) + s2.sub)[: _EXT_BITS + 1]
        s3 = self._stage(
            m,
            "s3",
            sign=s2.sign,
            exp=s2.exp,
            total=total,
            nan=s2.nan,
            inf=s2.inf,
            zero_sign=s2.zero_sign,
        )

        # 4. Normalize: bring the leading one to the top bit. Padding the count's input with
        # ones below gives a power-of-two tree and a count of _EXT_BITS + 1 for a zero total.
        pad = (1 << _EXT_BITS.bit_length()) - (_EXT_BITS + 1)
        lzc, _ = _leading_zeros(Cat(Const((1 << pad) - 1, pad), s3.total))
        normal = (s3.total << lzc)[: _EXT_BITS + 1]
        # The hidden bit of the larger operand sits one below the top bit: a count of zero is
        # a carry out of the significand, one is no change, more is cancellation.
        exp_res = Signal(signed(F32_EXP_BITS + 2))
        m.d.comb += exp_res.eq(s3.exp + 1 - lzc)
        s4 = self._stage(
            m,
            "s4",
            sign=s3.sign,
            exp=exp_res,
            sig=normal[-_SIG_BITS:],
            guard=normal[-_SIG_BITS - 1],
            sticky=normal[: -_SIG_BITS - 1] != 0,
            zero=s3.total == 0,
            nan=s3.nan,
            inf=s3.inf,
            zero_sign=s3.zero_sign,
        )

        # 5. Round to nearest even and pack. Adding the rounding increment to exponent and
        # fraction together lets a carry out of the significand step the exponent (and turn
        # the largest finite magnitude into the inf pattern).
        round_up = s4.guard & (s4.sticky | s4.sig[0])
        packed = (Cat(s4.sig[:F32_FRAC_BITS], s4.exp[:F32_EXP_BITS]) + round_up)[: FP32_WIDTH - 1]
        # A sum of two normals below 2**-126 is a multiple of 2**-149 and so exact (no guard
        # or sticky bit), hence "below 2**-126 after rounding" is "exponent below 1" here.
        tiny = s4.exp < 1
        huge = (s4.exp >= _EXP_MAX) | (packed[F32_FRAC_BITS:] == _EXP_MAX)
        zero_magnitude = Const(0, FP32_WIDTH - 1)
        inf_magnitude = Const(_EXP_MAX << F32_FRAC_BITS, FP32_WIDTH - 1)
        result = Signal(FP32_WIDTH)
        with m.If(s4.nan):
            m.d.comb += result.eq(F32_QNAN)
        with m.Elif(s4.inf):
            m.d.comb += result.eq(Cat(inf_magnitude, s4.sign))
        with m.Elif(s4.zero):
            m.d.comb += result.eq(Cat(zero_magnitude, s4.zero_sign))
        with m.Elif(tiny):
            m.d.comb += result.eq(Cat(zero_magnitude, s4.sign))
        with m.Elif(huge):
            m.d.comb += result.eq(Cat(inf_magnitude, s4.sign))
        with m.Else():
            m.d.comb += result.eq(Cat(packed, s4.sign))
        s5 = self._stage(m, "s5", result=result)
        m.d.comb += self.result.eq(s5.result)
        return m


class AddF32(wiring.Component):
    """Stream fp32 adder: each beat ``{a, b}`` on ``i`` gives ``hbfp.golden.bf16.add_f32(a,
    b)`` on ``o`` (32-bit fp32 pattern, NaN results as ``0x7FC00000``), in order.

    Latency: ``LATENCY`` = ``AddF32Datapath.LATENCY`` = 5 cycles from a beat accepted on ``i``
    to its result valid on ``o``. Throughput: one beat per cycle. ``i.ready`` follows
    ``o.ready`` combinationally (``advance = ~o.valid | o.ready``).
    """

    LATENCY = AddF32Datapath.LATENCY

    def __init__(self):
        super().__init__(
            {
                "i": In(stream.Signature(OperandsLayout)),
                "o": Out(stream.Signature(FP32_WIDTH)),
            }
        )

    def elaborate(self, platform):
        m = Module()
        m.submodules.datapath = dp = AddF32Datapath()
        # The whole pipeline moves unless a finished result waits at the output.
        advance = ~self.o.valid | self.o.ready
        m.d.comb += [
            dp.advance.eq(advance),
            self.i.ready.eq(advance),
            dp.a.eq(self.i.payload.a),
            dp.b.eq(self.i.payload.b),
            dp.in_valid.eq(self.i.valid),
            self.o.valid.eq(dp.out_valid),
            self.o.payload.eq(dp.result),
        ]
        return m
