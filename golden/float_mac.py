"""Floating-point multiply-accumulate as ``hbfp.hw.float_mac.FloatMacArray`` computes it.

The reference point of the density experiment (benchmarks/density.py): the same
output-stationary array as the BFP MAC array, but each processing element multiplies two
16-bit floats (bf16 or fp16) and accumulates in fp32. Bit for bit:

1. Widen both operands to fp32 exactly (``widen``). bf16 follows docs/numerics.md: append 16
   zero bits, a subnormal reads as +-0. fp16 widens exactly, subnormals included (every fp16
   value is a normal fp32 value); NaN becomes the quiet NaN ``0x7FC00000`` with its sign.
2. The product (``product``) is ``hbfp.golden.bf16.mul_f32`` of the widened operands. Their
   significands have 8 (bf16) or 11 (fp16) bits, so the product's 16 or 22 fit the 24 of
   fp32: it is exact unless it leaves fp32's range, where it flushes to a zero of its sign
   (below 2**-126) or overflows to +-inf (bf16 only; fp16 products lie within 2**-48 and
   2**32). 0 * inf and NaN operands give NaN.
3. Each output starts at +0 and adds its products in ascending k with
   ``hbfp.golden.bf16.add_f32`` (DAZ, RNE, FTZ, overflow to +-inf): not fused, the product
   is rounded (here: range-checked) before the addition.

A NaN result is the contract's one fp32 NaN, ``0x7FC00000`` (``add_f32`` and ``mul_f32``
make it; docs/numerics.md, section 1), as the gateware's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import bf16

__all__ = ["FloatFormat", "FORMATS", "float_format", "widen", "product", "float_mac"]


@dataclass(frozen=True)
class FloatFormat:
    """A 16-bit floating-point operand format: ``exp_bits`` exponent field bits (bias
    ``2**(exp_bits-1) - 1``), ``frac_bits`` stored fraction bits behind an implicit one, and
    whether subnormal inputs keep their value (``subnormals=True``) or read as zeros (DAZ)."""

    name: str
    exp_bits: int
    frac_bits: int
    subnormals: bool

    @property
    def width(self) -> int:
        return 1 + self.exp_bits + self.frac_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exp_bits - 1) - 1

    @property
    def significand_bits(self) -> int:
        """Significand bits including the implicit one (8 for bf16, 11 for fp16)."""
        return self.frac_bits + 1


#: The operand formats of ``FloatMacArray``.
FORMATS = {
    "bf16": FloatFormat("bf16", exp_bits=8, frac_bits=7, subnormals=False),
    "fp16": FloatFormat("fp16", exp_bits=5, frac_bits=10, subnormals=True),
}


def float_format(fmt: str | FloatFormat) -> FloatFormat:
    """The ``FloatFormat`` named ``fmt`` ("bf16" or "fp16"); ValueError for any other."""
    if isinstance(fmt, FloatFormat):
        return fmt
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"unknown float format {fmt!r}; expected one of {', '.join(FORMATS)}") from None


def _patterns(bits) -> np.ndarray:
    a = np.asarray(bits)
    if a.dtype.kind not in "iu":
        raise TypeError(f"expected 16-bit patterns as integers, got dtype {a.dtype}")
    if a.size and (a.min() < 0 or a.max() > 0xFFFF):
        raise ValueError("16-bit patterns must lie in 0..0xFFFF")
    return a.astype(np.uint32)


def widen(bits, fmt: str | FloatFormat) -> np.ndarray:
    """fp32 values (``float32`` array) of 16-bit ``fmt`` patterns, exactly (see step 1)."""
    f = float_format(fmt)
    if f.name == "bf16":
        return bf16.to_f32(_patterns(bits).astype(np.uint16))
    u = _patterns(bits)
    sign = (u >> 15) << 31
    e = (u >> f.frac_bits) & ((1 << f.exp_bits) - 1)
    frac = u & ((1 << f.frac_bits) - 1)
    e_max = (1 << f.exp_bits) - 1
    # A normal value rebiases its exponent and moves the fraction to the top of fp32's.
    normal = sign | ((e + (127 - f.bias)) << 23) | (frac << (23 - f.frac_bits))
    # A subnormal is frac * 2**(1 - bias - frac_bits): exact in fp32, where it is normal.
    sub_mag = np.ldexp(frac.astype(np.float32), 1 - f.bias - f.frac_bits).astype(np.float32).view(np.uint32)
    out = np.where(e == 0, sign | sub_mag, normal)
    out = np.where((e == e_max) & (frac == 0), sign | np.uint32(0x7F80_0000), out)
    out = np.where((e == e_max) & (frac != 0), sign | np.uint32(0x7FC0_0000), out)
    return out.astype(np.uint32).view(np.float32)


def product(a, b, fmt: str | FloatFormat) -> np.ndarray:
    """fp32 products of two arrays of ``fmt`` patterns (broadcasting), as in step 2."""
    with np.errstate(invalid="ignore"):  # 0 * inf, NaN operands: NaN by design
        return bf16.mul_f32(widen(a, fmt), widen(b, fmt))


def float_mac(a, b, fmt: str | FloatFormat) -> np.ndarray:
    """``A @ B`` as the array computes it: ``a`` (..., R, K) and ``b`` (..., K, C) hold
    ``fmt`` patterns (leading dimensions broadcast: independent products); every output
    starts at +0 and adds ``product(a[i, k], b[k, j])`` for k = 0, 1, ..., K-1 with
    ``bf16.add_f32``. Returns float32 (..., R, C)."""
    a = _patterns(a)
    b = _patterns(b)
    if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"shapes {a.shape} and {b.shape} do not form a product (..., R, K) @ (..., K, C)")
    lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    acc = np.zeros(lead + (a.shape[-2], b.shape[-1]), dtype=np.float32)
    for k in range(a.shape[-1]):
        acc = bf16.add_f32(acc, product(a[..., :, k, None], b[..., None, k, :], fmt))
    return acc
