"""The pipelined fp32 adder of the device (docs/numerics.md, section 1).

``AddF32Datapath`` is the bare pipeline with a shared ``advance`` enable, the form the GEMM
core instantiates once per lane: ``AddF32Align`` (stages 1-3: classify, order, align) and
``AddF32Sum`` (stages 4-6: add, count leading zeros, normalize) in front of its rounding
stage. ``AddF32`` wraps it with stream ports and the standard
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
    "ALIGNED",
    "NORMALIZED",
    "AddF32Align",
    "AddF32Sum",
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


#: What the alignment (``AddF32Align``, stages 1-3) hands the sum (``AddF32Sum``): the larger
#: operand's sign and exponent, whether the significands subtract, both significands with
#: guard, round and sticky bits (the smaller one shifted into place), and the special cases.
ALIGNED = data.StructLayout({
    "sign": 1, "sub": 1, "exp": F32_EXP_BITS, "big": _EXT_BITS, "small": _EXT_BITS,
    "nan": 1, "inf": 1, "zero_sign": 1,
})
#: What the sum (``AddF32Sum``, stages 4-6) hands the rounding (stage 7 of ``AddF32Datapath``):
#: the normalized significand, its exponent, guard and sticky bits, and the result's class
#: (first match: ``nan``, ``inf``, an exact ``zero``, ``tiny`` (flushed), ``at_inf`` (overflow),
#: else the rounded sum, whose increment may carry into the inf pattern).
NORMALIZED = data.StructLayout({
    "sign": 1, "exp": F32_EXP_BITS, "sig": _SIG_BITS, "guard": 1, "sticky": 1,
    "nan": 1, "inf": 1, "zero": 1, "tiny": 1, "at_inf": 1, "zero_sign": 1,
})


def _stage(m: Module, advance, name: str, **values) -> SimpleNamespace:
    """A pipeline stage: a register for each of ``values``, loaded when ``advance`` is high."""
    # Data registers have no reset: only the valid bits say what they hold.
    regs = {}
    for key, value in values.items():
        value = Value.cast(value)
        reg = Signal(value.shape(), name=f"{name}_{key}", reset_less=True)
        with m.If(advance):
            m.d.sync += reg.eq(value)
        regs[key] = reg
    return SimpleNamespace(**regs)


def _drive(m: Module, port, stage: SimpleNamespace):
    """The fields of ``port`` (a layout's view) from the registers of ``stage``, by name."""
    for key, reg in vars(stage).items():
        assert len(getattr(port, key)) == len(reg), key
        m.d.comb += getattr(port, key).eq(reg)


class AddF32Align(wiring.Component):
    """Stages 1-3 of ``AddF32Datapath``: the operands classified, ordered by magnitude, DAZ'd,
    and the smaller significand aligned to the larger one (``ALIGNED``).

    Ports: ``advance``, ``a``, ``b`` (fp32 patterns) in; ``o`` (``ALIGNED``) out, the operands
    taken in 3 advancing cycles earlier. No valid bit: the datapath keeps the valid line.
    """

    LATENCY = 3

    def __init__(self):
        super().__init__({
            "advance": In(1),
            "a": In(FP32_WIDTH),
            "b": In(FP32_WIDTH),
            "o": Out(ALIGNED),
        })

    def elaborate(self, platform):
        m = Module()
        advance = self.advance

        # 1. Classify; compare magnitudes; both exponent differences, so that stage 2 only
        # selects one (the subtractors run beside the comparator instead of after it).
        a = F32Layout(self.a)
        b = F32Layout(self.b)
        a_nan = (a.exp == _EXP_MAX) & (a.frac != 0)
        b_nan = (b.exp == _EXP_MAX) & (b.frac != 0)
        a_inf = (a.exp == _EXP_MAX) & (a.frac == 0)
        b_inf = (b.exp == _EXP_MAX) & (b.frac == 0)
        # Magnitudes compare as integers (exponent above fraction); the larger one sets the
        # sign and the exponent, so the significand difference is never negative. The raw
        # patterns order like the DAZ'd ones except among two subnormals or zeros, whose sum is
        # an exact zero (sign ``zero_sign``, exponent 0) in either order: no DAZ mux in front.
        s1 = _stage(
            m,
            advance,
            "s1",
            a=self.a,
            b=self.b,
            swap=b.as_value()[: FP32_WIDTH - 1] > a.as_value()[: FP32_WIDTH - 1],
            diff_ab=(a.exp - b.exp)[:F32_EXP_BITS],
            diff_ba=(b.exp - a.exp)[:F32_EXP_BITS],
            # inf + -inf is invalid; otherwise an inf is the larger magnitude, so its sign
            # is the sign carried with the larger operand.
            nan=a_nan | b_nan | (a_inf & b_inf & (a.sign ^ b.sign)),
            inf=a_inf | b_inf,
        )

        # 2. Order the operands; DAZ: a subnormal input has exponent field 0 and reads as a zero
        # of its sign, so its fraction is dropped and no hidden bit is set.
        a = F32Layout(s1.a)
        b = F32Layout(s1.b)
        a_sig = Mux(a.exp == 0, 0, Cat(a.frac, Const(1, 1)))
        b_sig = Mux(b.exp == 0, 0, Cat(b.frac, Const(1, 1)))
        exp_diff = Mux(s1.swap, s1.diff_ba, s1.diff_ab)
        s2 = _stage(
            m,
            advance,
            "s2",
            sign=Mux(s1.swap, b.sign, a.sign),
            sub=a.sign ^ b.sign,
            exp=Mux(s1.swap, b.exp, a.exp),
            sig_big=Mux(s1.swap, b_sig, a_sig),
            sig_small=Mux(s1.swap, a_sig, b_sig),
            shift=Mux(exp_diff > _ALIGN_MAX, _ALIGN_MAX, exp_diff),
            nan=s1.nan,
            inf=s1.inf,
            # The sign of an exact zero sum: -0 only for (-0) + (-0) (RNE).
            zero_sign=a.sign & b.sign,
        )

        # 3. Align the smaller significand; what falls below the round bit ORs into sticky.
        # Bit i of the significand lands below the round bit when i + _GR_BITS < shift: the
        # sticky bit is decoded from the shift amount beside the shifter, not after it, through
        # a table (one LUT per mask bit, where a comparison would take a carry chain).
        wide = Cat(Const(0, _ALIGN_MAX), s2.sig_small) >> s2.shift
        kept = wide[_ALIGN_MAX - _GR_BITS :]
        below = Signal(_SIG_BITS)  # the significand bits that the shift drops below the round bit
        with m.Switch(s2.shift):
            for k in range(_ALIGN_MAX + 1):
                with m.Case(k):
                    m.d.comb += below.eq((1 << max(k - _GR_BITS, 0)) - 1)
        sticky = (s2.sig_small & below) != 0
        s3 = _stage(
            m,
            advance,
            "s3",
            sign=s2.sign,
            sub=s2.sub,
            exp=s2.exp,
            big=Cat(Const(0, _GR_BITS + 1), s2.sig_big),
            small=Cat(sticky, kept),
            nan=s2.nan,
            inf=s2.inf,
            zero_sign=s2.zero_sign,
        )
        _drive(m, self.o, s3)
        return m


class AddF32Sum(wiring.Component):
    """Stages 4-6 of ``AddF32Datapath``: the aligned significands added (or subtracted), their
    leading zeros counted, the sum normalized, and the result's exponent, range tests and
    class decided (``NORMALIZED``).

    Ports: ``advance``, ``i`` (``ALIGNED``) in; ``o`` (``NORMALIZED``) out, 3 advancing cycles
    later.
    """

    LATENCY = 3

    def __init__(self):
        super().__init__({
            "advance": In(1),
            "i": In(ALIGNED),
            "o": Out(NORMALIZED),
        })

    def elaborate(self, platform):
        m = Module()
        advance, s3 = self.advance, self.i

        # 4. One adder for both: a difference adds the complement (one extra bit for the
        # carry of a sum). The sticky LSB makes a difference round right: the true value lies
        # strictly between the computed one and the next multiple of two sticky units.
        small = Cat(s3.small, Const(0, 1))
        total = (Cat(s3.big, Const(0, 1)) + (small ^ s3.sub.replicate(_EXT_BITS + 1)) + s3.sub)[: _EXT_BITS + 1]
        s4 = _stage(
            m,
            advance,
            "s4",
            sign=s3.sign,
            exp=s3.exp,
            total=total,
            nan=s3.nan,
            inf=s3.inf,
            zero_sign=s3.zero_sign,
        )

        # 5. Count the leading zeros. Padding the count's input with ones below gives a
        # power-of-two tree and a count of _EXT_BITS + 1 for a zero total. Beside the count,
        # what stage 6's range tests need of the exponent and the total: the result's exponent
        # is exp + 1 - lzc, so each test becomes one of the count against registered bits, with
        # no carry chain after the count.
        pad = (1 << _EXT_BITS.bit_length()) - (_EXT_BITS + 1)
        lzc, lzc_bits = _leading_zeros(Cat(Const((1 << pad) - 1, pad), s4.total))
        exp = s4.exp
        s5 = _stage(
            m,
            advance,
            "s5",
            sign=s4.sign,
            exp=exp,
            total=s4.total,
            lzc=lzc,
            zero=s4.total == 0,
            # tiny (exp + 1 - lzc <= 0, i.e. lzc > exp) needs an exponent below 2**lzc_bits
            exp_small=exp[lzc_bits:] == 0,
            # overflow (exp + 1 - lzc >= _EXP_MAX) needs the top finite field (a larger
            # operand's field is _EXP_MAX only for inf and NaN, whose class comes first)
            exp_top=exp == _EXP_MAX - 1,
            nan=s4.nan,
            inf=s4.inf,
            zero_sign=s4.zero_sign,
        )

        # 6. Normalize: bring the leading one to the top bit. The hidden bit of the larger
        # operand sits one below the top bit: a count of zero is a carry out of the
        # significand, one is no change, more is cancellation. Beside the shifter, the range
        # tests of stage 7 from stage 5's bits and the count alone (a comparison of the count
        # with the exponent's low bits, and decodes of small counts): stage 7 is then the
        # rounding increment and a multiplexer whose selects are registers.
        normal = (s5.total << s5.lzc)[: _EXT_BITS + 1]
        exp_res = (s5.exp + 1 - s5.lzc)[:F32_EXP_BITS]  # the exponent field where no test below holds
        # A sum of two normals below 2**-126 is a multiple of 2**-149 and so exact (no guard
        # or sticky bit), hence "below 2**-126 after rounding" is "exponent below 1" here:
        # exp + 1 - lzc <= 0.
        tiny = s5.exp_small & (s5.lzc > s5.exp[:lzc_bits])
        # exp + 1 - lzc >= _EXP_MAX: the top finite field with no shift (a carry out of the
        # significand). A sum that rounds up past the largest finite magnitude needs no test:
        # stage 7's increment carries into the exponent and makes the inf pattern.
        at_inf = s5.exp_top & (s5.lzc == 0)
        sig = normal[-_SIG_BITS:]
        s6 = _stage(
            m,
            advance,
            "s6",
            sign=s5.sign,
            exp=exp_res,
            sig=sig,
            guard=normal[-_SIG_BITS - 1],
            sticky=normal[: -_SIG_BITS - 1] != 0,
            # The result's class, first match: NaN, inf, an exact zero, flushed to zero,
            # overflow to inf (``at_inf``), else the rounded sum.
            nan=s5.nan,
            inf=s5.inf,
            zero=~s5.nan & ~s5.inf & s5.zero,
            tiny=~s5.nan & ~s5.inf & ~s5.zero & tiny,
            at_inf=~s5.nan & ~s5.inf & ~s5.zero & ~tiny & at_inf,
            zero_sign=s5.zero_sign,
        )
        _drive(m, self.o, s6)
        return m


class AddF32Datapath(wiring.Component):
    """Pipelined fp32 adder: ``result = hbfp.golden.bf16.add_f32(a, b)`` bit for bit (DAZ on
    both inputs, RNE, FTZ on the result, overflow to +-inf, every NaN result ``0x7FC00000``).

    All stages move together on a cycle with ``advance`` high: then ``a``, ``b`` and
    ``in_valid`` are taken in, and ``result`` with ``out_valid`` show the operands taken in
    ``LATENCY`` advancing cycles earlier. With ``advance`` low every stage holds, so
    ``result`` holds too. Several lanes may share one ``advance``.

    Latency: ``LATENCY`` = 7 cycles. Throughput: one addition per cycle.

    Stages (a register after each; each is at most one carry chain or a few LUT levels deep,
    for 150 MHz on an ECP5): ``AddF32Align``: 1. classify, compare magnitudes, both exponent
    differences; 2. swap, DAZ, clamp the alignment shift; 3. align the smaller significand,
    sticky decoded from the shift amount; ``AddF32Sum``: 4. add or subtract; 5. leading-zero
    count; 6. normalizing shift, result exponent and, beside them, its range tests and the
    result's class (special, FTZ, overflow); here: 7. round (RNE increment) and a multiplexer
    on the registered class, pack.
    """

    LATENCY = ADD_LATENCY  # the seven stages below (hw.params: CoreConfig checks the K-tile against it)

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

    def elaborate(self, platform):
        m = Module()
        assert AddF32Align.LATENCY + AddF32Sum.LATENCY + 1 == self.LATENCY

        valid = self.in_valid
        for k in range(self.LATENCY):
            reg = Signal(name=f"s{k + 1}_valid")
            with m.If(self.advance):
                m.d.sync += reg.eq(valid)
            valid = reg
        m.d.comb += self.out_valid.eq(valid)

        m.submodules.align = align = AddF32Align()
        m.submodules.sum = total = AddF32Sum()
        m.d.comb += [
            align.advance.eq(self.advance),
            align.a.eq(self.a),
            align.b.eq(self.b),
            total.advance.eq(self.advance),
            total.i.eq(align.o),
        ]
        s6 = total.o

        # 7. Round to nearest even and pack. Adding the rounding increment to exponent and
        # fraction together lets a carry out of the significand step the exponent (and turn the
        # largest finite magnitude into the inf pattern).
        round_up = s6.guard & (s6.sticky | s6.sig[0])
        packed = (Cat(s6.sig[:F32_FRAC_BITS], s6.exp) + round_up)[: FP32_WIDTH - 1]
        zero_magnitude = Const(0, FP32_WIDTH - 1)
        inf_magnitude = Const(_EXP_MAX << F32_FRAC_BITS, FP32_WIDTH - 1)
        special = s6.nan | s6.inf | s6.zero | s6.tiny | s6.at_inf
        result = Signal(FP32_WIDTH)
        with m.If(s6.nan):
            m.d.comb += result.eq(F32_QNAN)
        with m.Elif(s6.inf | s6.at_inf):
            m.d.comb += result.eq(Cat(inf_magnitude, s6.sign))
        with m.Elif(s6.zero):
            m.d.comb += result.eq(Cat(zero_magnitude, s6.zero_sign))
        with m.Elif(special):  # tiny
            m.d.comb += result.eq(Cat(zero_magnitude, s6.sign))
        with m.Else():
            m.d.comb += result.eq(Cat(packed, s6.sign))
        s7 = _stage(m, self.advance, "s7", result=result)
        m.d.comb += self.result.eq(s7.result)
        return m


class AddF32(wiring.Component):
    """Stream fp32 adder: each beat ``{a, b}`` on ``i`` gives ``hbfp.golden.bf16.add_f32(a,
    b)`` on ``o`` (32-bit fp32 pattern, NaN results as ``0x7FC00000``), in order.

    Latency: ``LATENCY`` = ``AddF32Datapath.LATENCY`` = 7 cycles from a beat accepted on ``i``
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
