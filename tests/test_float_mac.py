"""The golden model of the floating-point MAC array (``hbfp.golden.float_mac``): conversions
against NumPy's float16 and ml_dtypes' bfloat16, products and sums against the scalar
``fractions`` reference (tests/reference.py), and the corner cases one by one."""

import math

import ml_dtypes
import numpy as np
import pytest
from hbfp.golden import float_mac as fm
from hbfp.golden.compare import same_bits

from . import reference as ref

ALL = np.arange(1 << 16, dtype=np.uint32)


def bits32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def is_nan32(u) -> np.ndarray:
    return (np.asarray(u, dtype=np.uint32) & 0x7FFF_FFFF) > 0x7F80_0000


def test_fp16_widens_exactly_like_numpy_on_every_pattern():
    got = bits32(fm.widen(ALL, "fp16"))
    want = bits32(ALL.astype(np.uint16).view(np.float16).astype(np.float32))
    nan = is_nan32(want)
    assert (nan == is_nan32(got)).all()
    assert (got[~nan] == want[~nan]).all()
    # NaNs become the quiet NaN with their sign.
    assert set(got[nan] & 0x7FFF_FFFF) == {0x7FC0_0000}
    assert ((got[nan] >> 31) == (ALL[nan] >> 15)).all()
    # Subnormals keep their value: 2**-24 is the smallest.
    assert fm.widen(np.array([1, 0x8001]), "fp16").tolist() == [2.0**-24, -(2.0**-24)]


def test_bf16_widens_by_the_contract_on_every_pattern():
    got = bits32(fm.widen(ALL, "bf16"))
    want = bits32(ALL.astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32))
    exp = (ALL >> 7) & 0xFF
    normal = (exp != 0) & (exp != 0xFF)
    assert (got[normal] == want[normal]).all()
    # DAZ: subnormal (and zero) patterns read as zeros of their sign.
    assert (got[exp == 0] == (ALL[exp == 0] >> 15) << 31).all()
    special = exp == 0xFF
    assert (is_nan32(got[special]) == is_nan32(want[special])).all()
    assert (got[special & ~is_nan32(want)] == want[special & ~is_nan32(want)]).all()


def random_patterns(rng, fmt, n):
    """Uniform patterns, and patterns at the two ends of the exponent range."""
    f = fm.float_format(fmt)
    e_max = 2**f.exp_bits - 1
    uniform = rng.integers(0, 1 << 16, n)
    e = np.where(rng.random(n) < 0.5, rng.integers(0, 4, n), rng.integers(e_max - 4, e_max + 1, n))
    ends = (rng.integers(0, 2, n) << 15) | (e << f.frac_bits) | rng.integers(0, 2**f.frac_bits, n)
    return np.concatenate([uniform, ends]).astype(np.uint16)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_products_equal_the_fraction_reference(fmt):
    rng = np.random.default_rng(1)
    a = random_patterns(rng, fmt, 4000)
    b = random_patterns(rng, fmt, 4000)[rng.permutation(8000)]
    got = fm.product(a, b, fmt)
    wa, wb = fm.widen(a, fmt), fm.widen(b, fmt)
    for k in range(len(a)):
        want = ref.f32_mul(float(wa[k]), float(wb[k]))
        g = float(got[k])
        if math.isnan(want):
            assert math.isnan(g), (hex(a[k]), hex(b[k]))
        else:
            assert ref.f32_bits(g) == ref.f32_bits(want), (hex(a[k]), hex(b[k]), g, want)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_products_are_exact_inside_the_fp32_range(fmt):
    """The significand of every product fits fp32's: only range, never rounding."""
    a = ALL[::23].astype(np.uint16)
    b = ALL[::29].astype(np.uint16)
    with np.errstate(invalid="ignore"):  # signalling NaNs
        wa = fm.widen(a, fmt).astype(np.float64)[:, None]
        wb = fm.widen(b, fmt).astype(np.float64)[None, :]
        exact = wa * wb
        got = fm.product(a[:, None], b[None, :], fmt).astype(np.float64)
    inside = np.isfinite(exact) & (np.abs(exact) >= 2.0**-126) & (np.abs(exact) < 2.0**128)
    assert (got[inside] == exact[inside]).all()
    flushed = np.isfinite(exact) & (exact != 0) & (np.abs(exact) < 2.0**-126)
    assert (got[flushed] == 0).all() and (np.signbit(got[flushed]) == np.signbit(exact[flushed])).all()
    if fmt == "fp16":
        # fp16 products lie within [2**-48, 2**32): never flushed, never overflowing.
        assert not flushed.any() and not (np.isinf(got) & np.isfinite(exact)).any()
    else:
        assert flushed.any() and (np.isinf(got) & np.isfinite(exact)).any()


def scalar_float_mac(a, b, fmt):
    """The contract's order with the scalar reference: +0, then k ascending."""
    wa, wb = fm.widen(a, fmt), fm.widen(b, fmt)
    R, K = a.shape
    C = b.shape[1]
    out = np.zeros((R, C), dtype=np.float32)
    for i in range(R):
        for j in range(C):
            acc = 0.0
            for k in range(K):
                acc = ref.f32_add(acc, ref.f32_mul(float(wa[i, k]), float(wb[k, j])))
            out[i, j] = acc
    return out


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["moderate", "wide", "any"])
def test_float_mac_equals_the_scalar_reference(fmt, kind):
    rng = np.random.default_rng([["bf16", "fp16"].index(fmt), ["moderate", "wide", "any"].index(kind)])
    f = fm.float_format(fmt)
    shape_a, shape_b = (3, 40), (40, 4)

    def draw(shape):
        if kind == "any":
            return rng.integers(0, 1 << 16, shape).astype(np.uint16)
        spread = (-8, 9) if kind == "moderate" else (1 - f.bias, f.bias + 1)
        e = np.clip(f.bias + rng.integers(*spread, shape), 0, 2**f.exp_bits - 2)
        return ((rng.integers(0, 2, shape) << 15) | (e << f.frac_bits) | rng.integers(0, 2**f.frac_bits, shape)).astype(np.uint16)

    for _ in range(3):
        a, b = draw(shape_a), draw(shape_b)
        assert same_bits(fm.float_mac(a, b, fmt), scalar_float_mac(a, b, fmt))


def test_float_mac_batches_independent_products():
    rng = np.random.default_rng(5)
    a = rng.integers(0x3C00, 0x4400, (5, 2, 7)).astype(np.uint16)
    b = rng.integers(0x3C00, 0x4400, (5, 7, 3)).astype(np.uint16)
    got = fm.float_mac(a, b, "fp16")
    assert got.shape == (5, 2, 3)
    for g in range(5):
        assert same_bits(got[g], fm.float_mac(a[g], b[g], "fp16"))


def col(values):
    return np.array(values, dtype=np.uint16)[None, :]


def row(values):
    return np.array(values, dtype=np.uint16)[:, None]


BF16_ONE, BF16_NEG_ZERO, BF16_INF, BF16_NAN, BF16_MAX = 0x3F80, 0x8000, 0x7F80, 0x7FC0, 0x7F7F


def test_corner_cases_bf16():
    one = [BF16_ONE]
    mac = lambda a, b: fm.float_mac(col(a), row(b), "bf16")[0, 0]
    # The sum starts at +0: -0 products sum to +0.
    assert bits32(mac([BF16_NEG_ZERO, BF16_NEG_ZERO], [BF16_ONE, BF16_ONE])) == 0
    # 0 * inf, inf - inf: NaN; NaN propagates past inf.
    assert math.isnan(mac([0, 0], [BF16_INF, BF16_ONE]))
    assert math.isnan(mac([BF16_INF, BF16_INF | 0x8000], [BF16_ONE, BF16_ONE]))
    assert math.isnan(mac([BF16_INF, BF16_NAN], [BF16_ONE, BF16_ONE]))
    # Product overflow (2**127 * 2**127) and sum overflow (FLT_MAX-ish + FLT_MAX-ish).
    assert mac([0x7F00], [0x7F00]) == np.inf
    assert mac([BF16_MAX, BF16_MAX], one * 2) == np.inf
    # Product underflow: 2**-70 * 2**-70 flushes to a zero of its sign.
    assert bits32(mac([0x1C80 | 0x8000], [0x1C80])) == 0  # +0 + (-0) = +0
    # A sum below 2**-126 flushes to a zero of its sign: 1.5 * 2**-126 - 2 * 2**-126.
    assert bits32(mac([0x00C0, 0x8100], [BF16_ONE, BF16_ONE])) == 0x8000_0000
    # Subnormal inputs read as zeros (DAZ).
    assert mac([0x0001, BF16_ONE], [0x7F00, BF16_ONE]) == 1.0
    # Rounding of the sum: 1 + 2**-24 (a tie) rounds to even 1, 1 + 1.5 * 2**-24 up.
    assert mac([BF16_ONE, 0x3380], [BF16_ONE, BF16_ONE]) == 1.0  # 0x3380 = 2**-24
    assert mac([BF16_ONE, 0x33C0], [BF16_ONE, BF16_ONE]) == 1.0 + 2.0**-23  # 0.75 ulp


def test_corner_cases_fp16():
    mac = lambda a, b: fm.float_mac(col(a), row(b), "fp16")[0, 0]
    # Subnormal operands keep their values: 2**-24 * 2**-24 = 2**-48 exactly.
    assert mac([0x0001], [0x0001]) == 2.0**-48
    assert mac([0x03FF], [0x3C00]) == 1023 * 2.0**-24
    # fp16 max squared is finite in fp32; inf and NaN as in bf16.
    assert mac([0x7BFF], [0x7BFF]) == 65504.0**2
    assert mac([0xFC00], [0x3C00]) == -np.inf
    assert math.isnan(mac([0x0000], [0x7C00]))
    assert math.isnan(mac([0x7E00], [0x3C00]))


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown float format"):
        fm.widen(np.array([0]), "fp8")
    with pytest.raises(ValueError, match="unknown float format"):
        fm.float_format(None)
    with pytest.raises(ValueError, match="0..0xFFFF"):
        fm.widen(np.array([0x10000]), "fp16")
    with pytest.raises(TypeError, match="patterns"):
        fm.widen(np.array([1.0]), "fp16")
    with pytest.raises(ValueError, match="do not form a product"):
        fm.float_mac(np.zeros((2, 3), np.uint16), np.zeros((4, 2), np.uint16), "bf16")
