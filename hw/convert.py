"""Combinational fp32 <-> bf16 conversions (``hbfp.golden.bf16.from_f32`` / ``to_f32``)."""

from __future__ import annotations

from amaranth import Cat, Const, Mux, Value

from hbfp.golden.bf16 import QNAN

__all__ = ["from_f32", "to_f32", "flush_f32"]


def from_f32(u: Value) -> Value:
    """fp32 pattern -> bf16 pattern: RNE on the 16 dropped bits (a carry may step the exponent
    and reach inf), subnormals to a zero of their sign, NaN to ``QNAN`` with its sign."""
    sign = u[31]
    field = u[23:31]
    rounded = (u + 0x7FFF + u[16])[16:32]
    is_nan = (field == 0xFF) & (u[:23] != 0)
    return Mux(is_nan, Cat(Const(QNAN, 15), sign), Mux(field == 0, Cat(Const(0, 15), sign), rounded))


def to_f32(b: Value) -> Value:
    """bf16 pattern -> fp32 pattern: 16 zero bits appended; a subnormal reads as a signed zero."""
    return Mux(b[7:15] == 0, Cat(Const(0, 31), b[15]), Cat(Const(0, 16), b[:16]))


def flush_f32(u: Value) -> Value:
    """DAZ/FTZ of an fp32 pattern (``hbfp.golden.bf16.flush_f32``): a subnormal becomes a zero
    of its sign."""
    return Mux(u[23:31] == 0, Cat(Const(0, 31), u[31]), u)
