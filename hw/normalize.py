"""The normalizer: a K-tile's exact integer sum and its two tile exponents to one fp32 ``p``.

It computes ``hbfp.golden.gemm.normalize``: ``p = s * 2**(E_A + E_B - (m_A - 2) - (m_B - 2))``
rounded to fp32 by the device rules of docs/numerics.md (RNE with an unbounded exponent, then
FTZ: a rounded result below 2**-126 becomes a zero of its sign; overflow to +-inf; an integer
zero is +0; NaN, emitted as the quiet NaN ``0x7FC00000``, when either exponent code is 0xFF).
"""

from __future__ import annotations

from amaranth.hdl import Cat, Const, Module, Mux, Shape, Signal, signed
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from .add_f32 import _leading_zeros
from .params import EXP_BIAS, EXP_NAN, EXP_WIDTH, F32_BIAS, F32_EXP_BITS, F32_EXP_INF, F32_FRAC_BITS, F32_QNAN, FP32_WIDTH
from .params import NORMALIZE_LATENCY

__all__ = ["NormalizeDatapath", "Normalize", "normalize_layout"]

F32_SIGNIFICAND_BITS = F32_FRAC_BITS + 1


def normalize_layout(psum_width: int) -> data.StructLayout:
    """The payload of ``Normalize.i``: one K-tile sum and the E8M0 codes of its two tiles."""
    return data.StructLayout({"s": signed(psum_width), "exp_a": EXP_WIDTH, "exp_b": EXP_WIDTH})


def _check_parameters(psum_width: int, mantissa_bits_a: int, mantissa_bits_b: int) -> None:
    if psum_width < 2:
        raise ValueError(f"psum_width must be at least 2 (a sign and one bit), got {psum_width}")
    for name, mb in (("mantissa_bits_a", mantissa_bits_a), ("mantissa_bits_b", mantissa_bits_b)):
        if mb < 2:
            raise ValueError(f"{name} must be at least 2, got {mb}")


class NormalizeDatapath(wiring.Component):
    """The normalizer's pipeline without a handshake, for lanes that share one enable.

    Computes ``hbfp.golden.gemm.normalize(i_s, i_exp_a, i_exp_b, mantissa_bits_a,
    mantissa_bits_b)`` as the fp32 bit pattern ``o_result``, for a signed ``i_s`` of any
    ``psum_width`` >= 2 (rounding is only ever needed above 24 bits of magnitude).

    Ports: ``advance`` moves every stage one step (when low, all stages hold, so ``o_result``
    and ``o_valid`` hold); ``i_valid`` travels with its operands and comes out as ``o_valid``.
    Latency ``LATENCY`` = 5 advances; throughput one result per advance.

    Stages: (1) sign and magnitude, NaN flag, exponent sum; (2) leading-zero count and the
    shift's largest step; (3) the rest of the normalizing shift and the exponent before the
    rounding carry; (4) RNE rounding to 24
    significand bits, with the range tests for both outcomes of the carry; (5) the carry picks
    the exponent, FTZ, overflow, zero and NaN, and packing.
    """

    LATENCY = NORMALIZE_LATENCY  # the five stages below (hw.params: CoreConfig checks the K-tile against it)

    def __init__(self, psum_width: int, mantissa_bits_a: int = 8, mantissa_bits_b: int = 8):
        _check_parameters(psum_width, mantissa_bits_a, mantissa_bits_b)
        self.psum_width = psum_width
        self.mantissa_bits_a = mantissa_bits_a
        self.mantissa_bits_b = mantissa_bits_b
        super().__init__(
            {
                "advance": In(1),
                "i_valid": In(1),
                "i_s": In(signed(psum_width)),
                "i_exp_a": In(EXP_WIDTH),
                "i_exp_b": In(EXP_WIDTH),
                "o_valid": Out(1),
                "o_result": Out(FP32_WIDTH),
            }
        )

    def elaborate(self, platform):
        m = Module()
        w = self.psum_width
        # Bits of the leading-zero count: 2**(steps-1) < w <= 2**steps, so any count of a
        # nonzero magnitude (at most w - 1) fits.
        steps = (w - 1).bit_length()

        # The biased fp32 exponent of |s| * 2**scale whose most significant one is at bit
        # w - 1 - lzc is  (w - 1 - lzc) + (exp_a - EXP_BIAS) + (exp_b - EXP_BIAS)
        # - (m_A - 2) - (m_B - 2) + F32_BIAS: everything but the codes and lzc is one constant.
        offset = (w - 1) - 2 * EXP_BIAS - (self.mantissa_bits_a - 2) - (self.mantissa_bits_b - 2) + F32_BIAS
        code_max = 2**EXP_WIDTH - 1
        esum_shape = Shape.cast(range(offset, 2 * code_max + offset + 1))
        # Room for the full count range (an all-zero magnitude may count up to 2**steps - 1)
        # and the carry.
        exp_shape = Shape.cast(range(offset - (2**steps - 1), 2 * code_max + offset + 2))

        en = self.advance

        def reg(shape, name):
            # Operand registers need no reset: only the valid bits say whether they mean anything.
            return Signal(shape, name=name, reset_less=True)

        # Stage 1: sign and magnitude (|s| of the most negative s still fits w unsigned bits).
        v1 = Signal(name="v1")
        sign1 = reg(1, "sign1")
        mag1 = reg(w, "mag1")
        nan1 = reg(1, "nan1")
        esum1 = reg(esum_shape, "esum1")
        with m.If(en):
            m.d.sync += [
                v1.eq(self.i_valid),
                sign1.eq(self.i_s < 0),
                mag1.eq(Mux(self.i_s < 0, -self.i_s, self.i_s)),
                nan1.eq((self.i_exp_a == EXP_NAN) | (self.i_exp_b == EXP_NAN)),
                esum1.eq(self.i_exp_a + self.i_exp_b + offset),
            ]

        # Stage 2: the leading-zero count, a balanced tree (log2 levels) over the magnitude
        # padded with ones below to a power of two. Whatever a zero magnitude counts, it shifts
        # to zero, which stage 4 sees in its top bit. The count's top bit (the top half is all
        # zero) is known early, from the tree's first test: its step of the normalizing shift
        # is taken here, the others in stage 3.
        pad = 2**steps - w
        lzc, _ = _leading_zeros(Cat(Const(2**pad - 1, pad), mag1))
        top_step = 2 ** (steps - 1)
        coarse = Mux(lzc[-1], (mag1 << top_step)[:w], mag1)
        v2 = Signal(name="v2")
        sign2 = reg(1, "sign2")
        nan2 = reg(1, "nan2")
        mag2 = reg(w, "mag2")
        lzc2 = reg(steps, "lzc2")
        esum2 = reg(esum_shape, "esum2")
        with m.If(en):
            m.d.sync += [
                v2.eq(v1),
                sign2.eq(sign1),
                nan2.eq(nan1),
                mag2.eq(coarse),
                lzc2.eq(lzc),
                esum2.eq(esum1),
            ]

        # Stage 3: the rest of the normalizing shift (a barrel shifter driven by the count's
        # low bits) and, beside it, the exponent of the normalized magnitude.
        v3 = Signal(name="v3")
        sign3 = reg(1, "sign3")
        nan3 = reg(1, "nan3")
        norm3 = reg(w, "norm3")
        exp3 = reg(exp_shape, "exp3")
        with m.If(en):
            m.d.sync += [
                v3.eq(v2),
                sign3.eq(sign2),
                nan3.eq(nan2),
                norm3.eq((mag2 << lzc2[: steps - 1])[:w] if steps > 1 else mag2),
                exp3.eq(esum2 - lzc2),
            ]

        # Stage 4: round the normalized magnitude to 24 significand bits (RNE). The sum may
        # carry out to 2**24 (all ones rounded up); the range tests run beside the increment
        # for both outcomes (FTZ and overflow look at the exponent after the rounding carry: a
        # value just below 2**-126 that rounds up to it is kept; one that rounds up to 2**128 is
        # inf), and stage 5 picks one by the carry.
        if w > F32_SIGNIFICAND_BITS:
            cut = w - F32_SIGNIFICAND_BITS  # bits dropped below the significand
            kept = norm3[cut:]
            guard = norm3[cut - 1]
            sticky = norm3[: cut - 1].any() if cut > 1 else Const(0)
            rounded = kept + (guard & (sticky | kept[0]))
        else:
            rounded = norm3 << (F32_SIGNIFICAND_BITS - w)  # exact: no bit is dropped
        v4 = Signal(name="v4")
        sign4 = reg(1, "sign4")
        nan4 = reg(1, "nan4")
        zero4 = reg(1, "zero4")
        mant4 = reg(F32_SIGNIFICAND_BITS + 1, "mant4")
        field4 = reg(F32_EXP_BITS, "field4")  # the exponent field without and with the carry
        field4_up = reg(F32_EXP_BITS, "field4_up")
        tiny4 = reg(2, "tiny4")  # below 2**-126, without and with the carry
        huge4 = reg(2, "huge4")  # 2**128 or more, without and with the carry
        with m.If(en):
            m.d.sync += [
                v4.eq(v3),
                sign4.eq(sign3),
                nan4.eq(nan3),
                # A nonzero magnitude always has its leading one at the top after stage 3.
                zero4.eq(~norm3[w - 1]),
                mant4.eq(rounded),
                field4.eq(exp3[:F32_EXP_BITS]),
                field4_up.eq((exp3 + 1)[:F32_EXP_BITS]),
                tiny4.eq(Cat(exp3 < 1, exp3 < 0)),
                huge4.eq(Cat(exp3 >= F32_EXP_INF, exp3 >= F32_EXP_INF - 1)),
            ]

        # Stage 5: the carry picks the exponent and the range tests; zero, NaN; packing.
        carry = mant4[F32_SIGNIFICAND_BITS]
        packed = Signal(FP32_WIDTH, name="packed")
        sign_bit = sign4 << (FP32_WIDTH - 1)
        with m.If(nan4):
            m.d.comb += packed.eq(F32_QNAN)
        with m.Elif(zero4):
            m.d.comb += packed.eq(0)
        with m.Elif(tiny4.bit_select(carry, 1)):
            m.d.comb += packed.eq(sign_bit)
        with m.Elif(huge4.bit_select(carry, 1)):
            m.d.comb += packed.eq(sign_bit | (F32_EXP_INF << F32_FRAC_BITS))
        with m.Else():
            # After a carry the significand is exactly 2**24, whose fraction bits are zero.
            m.d.comb += packed.eq(Cat(mant4[:F32_FRAC_BITS], Mux(carry, field4_up, field4), sign4))
        v5 = Signal(name="v5")
        result5 = reg(FP32_WIDTH, "result5")
        with m.If(en):
            m.d.sync += [v5.eq(v4), result5.eq(packed)]

        m.d.comb += [self.o_valid.eq(v5), self.o_result.eq(result5)]
        return m


class Normalize(wiring.Component):
    """Stream wrapper of ``NormalizeDatapath``: ``hbfp.golden.gemm.normalize`` per beat.

    ``i``: stream of ``normalize_layout(psum_width)`` (``s`` signed, ``exp_a``, ``exp_b``
    E8M0 codes; packed from the LSB in that order). ``o``: stream of the fp32 bit pattern.
    Latency ``LATENCY`` = 5 cycles from an accepted input to its result on ``o``; one beat per
    cycle without stalls; ``i.ready`` is ``~o.valid | o.ready``.
    """

    LATENCY = NormalizeDatapath.LATENCY

    def __init__(self, psum_width: int, mantissa_bits_a: int = 8, mantissa_bits_b: int = 8):
        self.psum_width = psum_width
        self.mantissa_bits_a = mantissa_bits_a
        self.mantissa_bits_b = mantissa_bits_b
        _check_parameters(psum_width, mantissa_bits_a, mantissa_bits_b)
        super().__init__(
            {
                "i": In(stream.Signature(normalize_layout(psum_width))),
                "o": Out(stream.Signature(FP32_WIDTH)),
            }
        )

    def elaborate(self, platform):
        m = Module()
        m.submodules.datapath = dp = NormalizeDatapath(self.psum_width, self.mantissa_bits_a, self.mantissa_bits_b)
        # All stages move together whenever the output register is free or being emptied.
        advance = ~self.o.valid | self.o.ready
        m.d.comb += [
            dp.advance.eq(advance),
            self.i.ready.eq(advance),
            dp.i_valid.eq(self.i.valid),
            dp.i_s.eq(self.i.payload.s),
            dp.i_exp_a.eq(self.i.payload.exp_a),
            dp.i_exp_b.eq(self.i.payload.exp_b),
            self.o.valid.eq(dp.o_valid),
            self.o.payload.eq(dp.o_result),
        ]
        return m
