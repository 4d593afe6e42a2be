"""bfloat16 and fp32 arithmetic as the device does it (docs/numerics.md, section 1).

bf16 values travel as their 16-bit patterns (``uint16`` arrays): the pattern is the
contract, and NumPy has no bf16 arithmetic of its own. ``as_bits`` also accepts
``ml_dtypes.bfloat16`` arrays, and ``to_dtype`` gives one back.

Every device operation is FTZ/DAZ with round-to-nearest-even (RNE): a subnormal input reads
as a zero of its sign, and a result is rounded as if the exponent range were unbounded, then
flushed to a zero of its sign when it is below 2**-126 in magnitude.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = [
    "QNAN",
    "from_f32",
    "from_f64",
    "to_f32",
    "as_bits",
    "to_dtype",
    "flush_f32",
    "round_f32",
    "add_f32",
    "mul_f32",
    "mul",
    "is_nan",
    "ulp_distance",
    "canonical_nan_f32",
    "F32_QNAN",
]

#: The quiet NaN that every NaN becomes (the sign bit is kept on top of it).
QNAN = 0x7FC0
#: The one fp32 NaN every fp32 result of the device is (``add_f32``, ``mul_f32``, a NaN tile's
#: product: the accumulator's NaNs): the bf16 one widened, positive.
F32_QNAN = np.uint32(QNAN << 16)

_F32_SIGN = np.uint32(0x8000_0000)
_F32_EXP = np.uint32(0x7F80_0000)
_F32_ABS = np.uint32(0x7FFF_FFFF)
# Smallest magnitude that rounds (unbounded exponent, RNE) to 2**-126 rather than below it:
# the midpoint between 2**-126 and its predecessor at 24-bit precision, 2**-126 - 2**-151,
# rounds up because 2**-126 has the even significand.
_F32_FTZ_EDGE = 2.0**-126 - 2.0**-151


@functools.cache
def _bfloat16() -> np.dtype:
    """``ml_dtypes.bfloat16``, imported when first needed: its import takes half a second,
    more than the rest of the ``hbfp`` command line's start."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def as_bits(x) -> np.ndarray:
    """bf16 bit patterns as ``uint16``: from ``uint16`` arrays or ``ml_dtypes.bfloat16``."""
    a = np.asarray(x)
    if a.dtype == _bfloat16():
        return a.view(np.uint16)
    if a.dtype == np.uint16:
        return a
    if a.dtype.kind in "iu":
        if a.size and (a.min() < 0 or a.max() > 0xFFFF):
            raise ValueError("bf16 bit patterns must lie in 0..0xFFFF")
        return a.astype(np.uint16)
    raise TypeError(
        f"expected bf16 bit patterns (uint16) or ml_dtypes.bfloat16, got dtype {a.dtype}; "
        "use from_f32() to round floats to bf16"
    )


def to_dtype(bits) -> np.ndarray:
    """The same patterns viewed as an ``ml_dtypes.bfloat16`` array (no copy)."""
    return as_bits(bits).view(_bfloat16())


def from_f32(x) -> np.ndarray:
    """Round fp32 values to bf16 patterns: RNE on the 16 dropped bits, overflow to +-inf,
    subnormal inputs to +-0, +-inf kept, every NaN to ``QNAN`` with its sign kept.

    ``x`` is read as fp32 (``np.asarray(x, np.float32)``)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    sign16 = (u >> 16).astype(np.uint16) & np.uint16(0x8000)
    # Adding 0x7FFF plus the kept LSB and truncating is RNE; a carry out of the mantissa
    # steps the exponent, and the largest finite values carry into the inf pattern.
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    out = np.where((u & _F32_EXP) == 0, sign16, rounded)
    return np.where((u & _F32_ABS) > _F32_EXP, sign16 | np.uint16(QNAN), out)


def from_f64(x) -> np.ndarray:
    """Round fp64 values to bf16 patterns in one rounding (RNE, FTZ after rounding with an
    unbounded exponent, overflow to +-inf, NaN to ``QNAN`` with its sign).

    This is the correctly rounded bf16 of a float64 value: the reference that activation
    tables and accuracy measurements are made from."""
    u = np.asarray(x, dtype=np.float64).view(np.uint64)
    sign16 = ((u >> 48) & np.uint64(0x8000)).astype(np.uint16)
    mag = u & np.uint64(0x7FFF_FFFF_FFFF_FFFF)
    # RNE to 8 significant bits: the kept LSB is bit 45 of the fp64 pattern.
    r = (mag + np.uint64((1 << 44) - 1) + ((mag >> 45) & np.uint64(1))) >> 45
    exp = (r >> 7).astype(np.int64) - 1023  # unbiased exponent after rounding
    mant = (r & np.uint64(0x7F)).astype(np.uint16)
    normal = sign16 | ((np.clip(exp, -126, 127) + 127).astype(np.uint16) << 7) | mant
    out = np.where(exp > 127, sign16 | np.uint16(0x7F80), normal)
    out = np.where(exp < -126, sign16, out)
    out = np.where(mag == np.uint64(0x7FF0_0000_0000_0000), sign16 | np.uint16(0x7F80), out)
    return np.where(mag > np.uint64(0x7FF0_0000_0000_0000), sign16 | np.uint16(QNAN), out)


def to_f32(bits) -> np.ndarray:
    """Widen bf16 patterns to fp32 exactly (append 16 zero bits); subnormals read as +-0."""
    b = as_bits(bits).astype(np.uint32)
    b = np.where((b & np.uint32(0x7F80)) == 0, b & np.uint32(0x8000), b)
    return (b << 16).view(np.float32)


def is_nan(bits) -> np.ndarray:
    """True where a bf16 pattern is a NaN (any payload, either sign)."""
    return (as_bits(bits) & np.uint16(0x7FFF)) > np.uint16(0x7F80)


def flush_f32(x) -> np.ndarray:
    """FTZ/DAZ on fp32: subnormals become zeros of their sign, everything else is kept."""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    return np.where((u & _F32_EXP) == 0, u & _F32_SIGN, u).view(np.float32)


def round_f32(x) -> np.ndarray:
    """Round exact fp64 values to fp32 by the device rules: RNE with an unbounded exponent,
    then a result below 2**-126 in magnitude becomes a zero of its sign; overflow to +-inf.

    Only correct when ``x`` holds the exact value (for example an integer sum times a power
    of two, or a product of two fp32 values); it is one rounding, never two."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        y = x.astype(np.float32)
    tiny = np.abs(x) < _F32_FTZ_EDGE
    return np.where(tiny, np.copysign(np.float32(0), y), y).astype(np.float32)


def add_f32(a, b) -> np.ndarray:
    """fp32 addition with DAZ on both inputs, RNE, and FTZ on the result.

    A subnormal sum of two normals is always exact (both are multiples of 2**-149), so IEEE
    addition followed by a flush is the contract's "round unbounded, then flush"."""
    a = flush_f32(a)
    b = flush_f32(b)
    with np.errstate(over="ignore", invalid="ignore"):
        return canonical_nan_f32(flush_f32(np.add(a, b, dtype=np.float32)))


def canonical_nan_f32(x) -> np.ndarray:
    """fp32 values with every NaN as ``F32_QNAN`` (inf + -inf, for one, gives a NaN whose sign
    the CPU chooses)."""
    x = np.asarray(x, dtype=np.float32)
    return np.where(np.isnan(x), F32_QNAN.view(np.float32), x).astype(np.float32)


def mul_f32(a, b) -> np.ndarray:
    """fp32 multiplication with DAZ, RNE and FTZ (the product is exact in fp64, then
    rounded once with ``round_f32``)."""
    with np.errstate(invalid="ignore"):
        return canonical_nan_f32(round_f32(flush_f32(a).astype(np.float64) * flush_f32(b).astype(np.float64)))


def mul(a, b) -> np.ndarray:
    """Product of two bf16 patterns rounded RNE/FTZ to bf16 (exact in fp64, one rounding). A NaN
    operand, or zero times infinity, gives ``QNAN`` with the sign ``sign(a) ^ sign(b)`` (the
    gateware multiplier's NaN, not the host FPU's)."""
    a, b = as_bits(a), as_bits(b)
    # Widening a signalling-NaN pattern raises NumPy's "invalid" flag: NaN stays NaN anyway.
    with np.errstate(invalid="ignore"):
        out = from_f64(to_f32(a).astype(np.float64) * to_f32(b).astype(np.float64))
    sign = (a ^ b) & np.uint16(0x8000)
    return np.where(is_nan(out), sign | np.uint16(QNAN), out).astype(np.uint16)


def _ordered(bits: np.ndarray) -> np.ndarray:
    b = bits.astype(np.int32)
    mag = b & 0x7FFF
    return np.where(b & 0x8000, -mag, mag)


def ulp_distance(a, b) -> np.ndarray:
    """Distance in bf16 ULPs between two arrays of patterns: the number of representable
    values between them (+0 and -0 count as one value). NaN against NaN is 0 (a distance
    between values: any two NaNs); NaN against a number is 2**16, more than any distance
    between numbers."""
    a = as_bits(a)
    b = as_bits(b)
    d = np.abs(_ordered(a) - _ordered(b))
    na, nb = is_nan(a), is_nan(b)
    d = np.where(na & nb, 0, d)
    return np.where(na ^ nb, 1 << 16, d)
