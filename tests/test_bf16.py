import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from hbfp.golden import bf16

from . import reference as ref

ALL = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def f32_from_bits(u):
    return np.asarray(u, dtype=np.uint32).view(np.float32)


def classes(bits):
    exp = (bits >> 7) & 0xFF
    mant = bits & 0x7F
    return exp, mant


def test_every_bf16_pattern_round_trips():
    exp, mant = classes(ALL)
    back = bf16.from_f32(bf16.to_f32(ALL))
    normal_or_inf_or_zero = ((exp > 0) & (exp < 255)) | ((exp == 255) & (mant == 0)) | ((exp == 0) & (mant == 0))
    assert np.array_equal(back[normal_or_inf_or_zero], ALL[normal_or_inf_or_zero])
    sub = (exp == 0) & (mant != 0)
    assert np.array_equal(back[sub], ALL[sub] & 0x8000)  # DAZ: a signed zero
    nan = (exp == 255) & (mant != 0)
    assert np.array_equal(back[nan], (ALL[nan] & 0x8000) | bf16.QNAN)


def test_to_f32_appends_sixteen_zero_bits():
    exp, mant = classes(ALL)
    wide = bf16.to_f32(ALL).view(np.uint32)
    keep = exp > 0
    assert np.array_equal(wide[keep], ALL[keep].astype(np.uint32) << 16)
    assert np.array_equal(wide[~keep], (ALL[~keep].astype(np.uint32) & 0x8000) << 16)


def test_from_f32_equals_ml_dtypes_on_ten_million_normals():
    rng = np.random.default_rng(2024)
    n = 10_000_000
    u = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    exp = (u >> 23) & 0xFF
    u = np.where((exp == 0) | (exp == 255), u ^ np.uint32(0x4000_0000), u)  # make every value finite normal
    x = u.view(np.float32)
    assert np.all(np.isfinite(x)) and np.all(np.abs(x) >= np.float32(2.0**-126))
    ours = bf16.from_f32(x)
    theirs = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(ours, theirs)


CORNERS = {
    # name: (fp32 pattern, expected bf16 pattern)
    "tie, kept LSB even -> down": (0x3F80_8000, 0x3F80),
    "tie, kept LSB odd -> up": (0x3F81_8000, 0x3F82),
    "just above tie -> up": (0x3F80_8001, 0x3F81),
    "just below tie -> down": (0x3F80_7FFF, 0x3F80),
    "negative tie odd -> up in magnitude": (0xBF81_8000, 0xBF82),
    "mantissa carry into exponent": (0x3FFF_8000, 0x4000),
    "largest finite -> inf": (0x7F7F_FFFF, 0x7F80),
    "overflow boundary tie -> inf": (0x7F7F_8000, 0x7F80),
    "below overflow boundary": (0x7F7F_7FFF, 0x7F7F),
    "negative largest finite -> -inf": (0xFF7F_FFFF, 0xFF80),
    "smallest normal": (0x0080_0000, 0x0080),
    "smallest normal, negative": (0x8080_0000, 0x8080),
    "largest subnormal -> +0": (0x007F_FFFF, 0x0000),
    "smallest subnormal, negative -> -0": (0x8000_0001, 0x8000),
    "+0": (0x0000_0000, 0x0000),
    "-0": (0x8000_0000, 0x8000),
    "+inf": (0x7F80_0000, 0x7F80),
    "-inf": (0xFF80_0000, 0xFF80),
    "quiet NaN": (0x7FC0_0000, 0x7FC0),
    "signalling NaN, payload in low bits": (0x7F80_0001, 0x7FC0),
    "negative NaN keeps sign": (0xFFC1_2345, 0xFFC0),
}


@pytest.mark.parametrize("name", CORNERS)
def test_from_f32_corner_classes(name):
    src, want = CORNERS[name]
    got = int(bf16.from_f32(f32_from_bits(src)))
    assert got == want, f"{name}: {hex(src)} -> {hex(got)}, want {hex(want)}"
    x = f32_from_bits(src)
    if np.isfinite(x) and abs(x) >= 2.0**-126:
        assert got == int(x.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_from_f64_is_one_correct_rounding():
    rng = np.random.default_rng(7)
    u = rng.integers(0, 1 << 63, 20_000, dtype=np.uint64)
    # Values around the bf16 range, plus exact midpoints and their neighbours.
    x = np.ldexp(rng.uniform(1, 2, 20_000), rng.integers(-135, 135, 20_000)) * rng.choice([-1, 1], 20_000)
    mids = np.ldexp(np.float64(129.5) + np.arange(200), -7 + rng.integers(-130, 128, 200))
    near = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf)])
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 2.0**-126, 2.0**-126 * (1 - 2.0**-9), 2.0**-127, 3.4e38, 3.39e38, 1e300, -1e-300])
    x = np.concatenate([x, near, special, u.view(np.float64)[:2000]])
    got = bf16.from_f64(x)
    want = np.array([ref.bf16_from_value(float(v)) for v in x], dtype=np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.all(bf16.is_nan(got[nan]))


def test_from_f64_agrees_with_from_f32_on_fp32_values():
    x = bf16.to_f32(ALL).astype(np.float32)
    rng = np.random.default_rng(3)
    x = np.concatenate([x, (rng.standard_normal(100_000) * 10.0 ** rng.integers(-30, 30, 100_000)).astype(np.float32)])
    with np.errstate(invalid="ignore"):  # signalling-NaN patterns among the 65,536
        wide = x.astype(np.float64)
    a, b = bf16.from_f32(x), bf16.from_f64(wide)
    nan = np.isnan(x)
    assert np.array_equal(a[~nan], b[~nan])


def _rand_f32(rng, n, lo=-140, hi=130):
    with np.errstate(over="ignore"):
        return (rng.uniform(1, 2, n) * np.exp2(rng.integers(lo, hi, n)) * rng.choice([-1, 1], n)).astype(np.float32)


def test_round_f32_flushes_after_rounding():
    edge = 2.0**-126 - 2.0**-151
    cases = {
        edge: 2.0**-126,  # the tie rounds up to the even 2**-126: not flushed
        np.nextafter(edge, 0): 0.0,  # IEEE would give 2**-126 (subnormal grid); we flush
        2.0**-126 - 2.0**-150: 0.0,
        -(2.0**-126 - 2.0**-152): -(2.0**-126),
        2.0**-130: 0.0,
        -(2.0**-130): -0.0,
        2.0**128: math.inf,
        (2.0 - 2.0**-24) * 2.0**127: math.inf,
        (2.0 - 2.0**-23) * 2.0**127: np.finfo(np.float32).max,
    }
    for x, want in cases.items():
        got = float(bf16.round_f32(np.float64(x)))
        assert got == want and math.copysign(1, got) == math.copysign(1, want), (x, got, want)
        assert got == ref.round_f32(Fraction(x))


def test_add_f32_matches_reference():
    rng = np.random.default_rng(11)
    n = 4000
    a, b = _rand_f32(rng, n), _rand_f32(rng, n)
    # Cancellation down to (and below) the smallest normal, and subnormal inputs.
    c = np.float32(2.0**-126) * rng.integers(1, 8, n).astype(np.float32)
    a = np.concatenate([a, c, np.float32(2.0**-130) * np.arange(1, 50, dtype=np.float32), [np.inf, -np.inf, np.nan, 0.0, -0.0]]).astype(np.float32)
    b = np.concatenate([b, -c + np.float32(2.0**-149) * rng.integers(-3, 4, n).astype(np.float32), np.float32(-(2.0**-127)) * np.ones(49, np.float32), [-np.inf, 1.0, 1.0, -0.0, -0.0]]).astype(np.float32)
    got = bf16.add_f32(a, b)
    for x, y, g in zip(a.tolist(), b.tolist(), got.tolist()):
        w = ref.f32_add(x, y)
        assert (math.isnan(g) and math.isnan(w)) or (g == w and math.copysign(1, g) == math.copysign(1, w)), (x, y, g, w)
    assert not np.any((got != 0) & (np.abs(got) < 2.0**-126))


def test_mul_f32_matches_reference():
    rng = np.random.default_rng(12)
    n = 4000
    a, b = _rand_f32(rng, n, -70, 70), _rand_f32(rng, n, -70, 70)
    got = bf16.mul_f32(a, b)
    for x, y, g in zip(a.tolist(), b.tolist(), got.tolist()):
        w = ref.f32_mul(x, y)
        assert g == w and math.copysign(1, g) == math.copysign(1, w), (x, y, g, w)


def test_bf16_mul_is_correctly_rounded():
    rng = np.random.default_rng(13)
    a = rng.integers(0, 1 << 16, 20_000).astype(np.uint16)
    b = rng.integers(0, 1 << 16, 20_000).astype(np.uint16)
    got = bf16.mul(a, b)
    with np.errstate(invalid="ignore"):
        fa, fb = bf16.to_f32(a).astype(np.float64), bf16.to_f32(b).astype(np.float64)
    for x, y, g in zip(fa.tolist(), fb.tolist(), got.tolist()):
        if math.isfinite(x) and math.isfinite(y) and x != 0 and y != 0:
            w = ref.bf16_from_value(Fraction(x) * Fraction(y))
        elif math.isfinite(x) and math.isfinite(y):
            w = 0x8000 if math.copysign(1, x) * math.copysign(1, y) < 0 else 0
        else:
            w = ref.bf16_from_value(x * y)
        if (w & 0x7FFF) > 0x7F80:  # a NaN operand or 0 * inf: QNAN with the operands' sign product
            sign = 0x8000 if (math.copysign(1, x) < 0) != (math.copysign(1, y) < 0) else 0
            assert g == bf16.QNAN | sign, (x, y, hex(g))
        else:
            assert g == w, (x, y, hex(g), hex(w))


def test_bf16_mul_makes_the_gatewares_nan():
    """NaN out of a product: ``QNAN | sign(a) ^ sign(b)``, whatever the NaN operand's payload
    (the gateware's multiplier; the host FPU would keep the operand's NaN, or make 0 * inf
    negative on x86)."""
    a = np.array([0x7FC0, 0xFFC0, 0x7F81, 0xFFFF, 0x0000, 0x8000, 0x7F80, 0xFF80, 0x3F80], np.uint16)
    b = np.array([0x3F80, 0x3F80, 0xBF80, 0x4000, 0x7F80, 0x7F80, 0x8000, 0x0000, 0xFFC1], np.uint16)
    want = [0x7FC0, 0xFFC0, 0xFFC0, 0xFFC0, 0x7FC0, 0xFFC0, 0xFFC0, 0xFFC0, 0xFFC0]
    assert bf16.mul(a, b).tolist() == want


def test_ulp_distance():
    one = 0x3F80
    assert bf16.ulp_distance(np.uint16(one), np.uint16(one + 3)) == 3
    assert bf16.ulp_distance(np.uint16(0x0000), np.uint16(0x8000)) == 0
    # Across zero: smallest positive and smallest negative normal are 2 * 0x80 apart.
    assert bf16.ulp_distance(np.uint16(0x0080), np.uint16(0x8080)) == 2 * 0x80
    assert bf16.ulp_distance(np.uint16(0x7FC0), np.uint16(0xFFC1)) == 0
    assert bf16.ulp_distance(np.uint16(0x7FC0), np.uint16(one)) == 1 << 16
    assert bf16.ulp_distance(np.uint16(0x7F7F), np.uint16(0x7F80)) == 1


def test_as_bits_accepts_ml_dtypes_and_rejects_floats():
    x = np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)
    assert np.array_equal(bf16.as_bits(x), x.view(np.uint16))
    assert bf16.to_dtype(bf16.as_bits(x)).dtype == ml_dtypes.bfloat16
    with pytest.raises(TypeError, match="from_f32"):
        bf16.as_bits(np.array([1.0], dtype=np.float32))
    with pytest.raises(ValueError):
        bf16.as_bits(np.array([70000]))
