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
    Latency ``LATENCY`` = 4 advances; throughput one result per advance.

    Stages: (1) sign and magnitude, NaN flag, exponent sum; (2) leading-zero count fused with
    the normalizing shift; (3) RNE rounding to 24 significand bits, exponent before the rounding
    carry; (4) the carry into the exponent, then FTZ, overflow, zero and NaN, and packing.
    """

    LATENCY = NORMALIZE_LATENCY  # the four stages below (hw.params: CoreConfig checks the K-tile against it)

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
        # Shift steps of the normalizer: 2**(steps-1) < w <= 2**steps, so any count of leading
        # zeros of a nonzero magnitude (at most w - 1) is a sum of distinct steps.
        steps = (w - 1).bit_length()

        # The biased fp32 exponent of |s| * 2**scale whose most significant one is at bit
        # w - 1 - lzc is  (w - 1 - lzc) + (exp_a - EXP_BIAS) + (exp_b - EXP_BIAS)
        # - (m_A - 2) - (m_B - 2) + F32_BIAS: everything but the codes and lzc is one constant.
        offset = (w - 1) - 2 * EXP_BIAS - (self.mantissa_bits_a - 2) - (self.mantissa_bits_b - 2) + F32_BIAS
        code_max = 2**EXP_WIDTH - 1
        esum_shape = Shape.cast(range(offset, 2 * code_max + offset + 1))
        # Room for the full lzc range (an all-zero magnitude shifts by every step) and the carry.
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

        # Stage 2: normalize. Each step tests the top 2**j bits and shifts them out when they
        # are all zero; the tests, largest step first, are the bits of the leading-zero count.
        # This is log2(w) levels of 2:1 muxes instead of a priority encoder followed by a
        # barrel shifter.
        x = mag1
        lz_bits = []
        for j in reversed(range(steps)):
            step = 1 << j
            top_zero = Signal(name=f"lz{j}")
            m.d.comb += top_zero.eq(x[w - step :] == 0)
            shifted = Signal(w, name=f"norm_step{j}")
            m.d.comb += shifted.eq(Mux(top_zero, (x << step)[:w], x))
            x = shifted
            lz_bits.insert(0, top_zero)
        v2 = Signal(name="v2")
        sign2 = reg(1, "sign2")
        nan2 = reg(1, "nan2")
        norm2 = reg(w, "norm2")
        lzc2 = reg(steps, "lzc2")
        esum2 = reg(esum_shape, "esum2")
        with m.If(en):
            m.d.sync += [
                v2.eq(v1),
                sign2.eq(sign1),
                nan2.eq(nan1),
                norm2.eq(x),
                lzc2.eq(Cat(*lz_bits)),
                esum2.eq(esum1),
            ]

        # Stage 3: round the normalized magnitude to 24 significand bits (RNE). The sum may
        # carry out to 2**24 (all ones rounded up); stage 4 folds that carry into the exponent,
        # so the exponent subtraction here runs beside the increment.
        if w > F32_SIGNIFICAND_BITS:
            cut = w - F32_SIGNIFICAND_BITS  # bits dropped below the significand
            kept = norm2[cut:]
            guard = norm2[cut - 1]
            sticky = norm2[: cut - 1].any() if cut > 1 else Const(0)
            rounded = kept + (guard & (sticky | kept[0]))
        else:
            rounded = norm2 << (F32_SIGNIFICAND_BITS - w)  # exact: no bit is dropped
        v3 = Signal(name="v3")
        sign3 = reg(1, "sign3")
        nan3 = reg(1, "nan3")
        zero3 = reg(1, "zero3")
        mant3 = reg(F32_SIGNIFICAND_BITS + 1, "mant3")
        exp3 = reg(exp_shape, "exp3")
        with m.If(en):
            m.d.sync += [
                v3.eq(v2),
                sign3.eq(sign2),
                nan3.eq(nan2),
                # A nonzero magnitude always has its leading one at the top after stage 2.
                zero3.eq(~norm2[w - 1]),
                mant3.eq(rounded),
                exp3.eq(esum2 - lzc2),
            ]

        # Stage 4: FTZ and overflow look at the exponent after the rounding carry (a value just
        # below 2**-126 that rounds up to it is kept; one that rounds up to 2**128 is inf).
        carry = mant3[F32_SIGNIFICAND_BITS]
        exp4 = Signal(exp_shape, name="exp4")
        m.d.comb += exp4.eq(exp3 + carry)
        packed = Signal(FP32_WIDTH, name="packed")
        sign_bit = sign3 << (FP32_WIDTH - 1)
        with m.If(nan3):
            m.d.comb += packed.eq(F32_QNAN)
        with m.Elif(zero3):
            m.d.comb += packed.eq(0)
        with m.Elif(exp4 < 1):
            m.d.comb += packed.eq(sign_bit)
        with m.Elif(exp4 >= F32_EXP_INF):
            m.d.comb += packed.eq(sign_bit | (F32_EXP_INF << F32_FRAC_BITS))
        with m.Else():
            # After a carry the significand is exactly 2**24, whose fraction bits are zero.
            m.d.comb += packed.eq(Cat(mant3[:F32_FRAC_BITS], exp4[:F32_EXP_BITS], sign3))
        v4 = Signal(name="v4")
        result4 = reg(FP32_WIDTH, "result4")
        with m.If(en):
            m.d.sync += [v4.eq(v3), result4.eq(packed)]

        m.d.comb += [self.o_valid.eq(v4), self.o_result.eq(result4)]
        return m


class Normalize(wiring.Component):
    """Stream wrapper of ``NormalizeDatapath``: ``hbfp.golden.gemm.normalize`` per beat.

    ``i``: stream of ``normalize_layout(psum_width)`` (``s`` signed, ``exp_a``, ``exp_b``
    E8M0 codes; packed from the LSB in that order). ``o``: stream of the fp32 bit pattern.
    Latency ``LATENCY`` = 4 cycles from an accepted input to its result on ``o``; one beat per
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
