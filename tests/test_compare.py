"""hbfp.golden.compare: bit equality by the numerics contract (same dtype, shape and bits,
NaNs' bits included) for fp32, bf16 (ml_dtypes and uint16 patterns), scalars and BFP tensors."""

import ml_dtypes
import numpy as np
import pytest

from hbfp.golden import bf16
from hbfp.golden.bfp import HBFP8, BFPTensor, quantize
from hbfp.golden.compare import describe_difference, same_bits, same_bits_elementwise

F32_NANS = np.array([0x7FC0_0000, 0xFFC0_0000, 0x7F80_0001, 0x7FFF_FFFF, 0xFFA0_0000], np.uint32).view(np.float32)
BF16_NANS = np.array([0x7FC0, 0xFFC0, 0x7F81, 0x7FFF, 0xFF81, 0xFFFF], np.uint16)


def test_equal_arrays_and_scalars():
    x = np.array([[1.0, -0.0, np.inf], [-np.inf, 1e-40, 3.5]], np.float32)
    assert same_bits(x, x.copy())
    assert same_bits(np.float32(2.5), np.float32(2.5))
    assert same_bits(np.float32(np.nan), np.float32(np.nan))
    assert same_bits(3, 3) and same_bits(True, True) and same_bits(1.5, 1.5)
    assert same_bits(np.zeros(0, np.float32), np.zeros(0, np.float32))
    assert same_bits(np.arange(6, dtype=np.int16), np.arange(6, dtype=np.int16))


def test_different_dtype_fails():
    x = np.array([1.0, 2.0], np.float32)
    assert not same_bits(x, x.astype(np.float64))
    assert not same_bits(x.astype(ml_dtypes.bfloat16), bf16.from_f32(x))  # bfloat16 vs its uint16 patterns
    assert not same_bits(np.arange(3, dtype=np.int8), np.arange(3, dtype=np.int16))
    assert not same_bits(np.float32(1.0), 1.0)  # a Python float is a float64
    assert "dtype float32 against float64" in describe_difference(x, x.astype(np.float64))


def test_different_shape_fails():
    x = np.arange(12, dtype=np.float32)
    assert not same_bits(x, x.reshape(3, 4))
    assert not same_bits(x.reshape(3, 4), x.reshape(4, 3))
    assert not same_bits(x[:1], np.float32(0.0))  # (1,) against a scalar: no broadcasting
    assert "shape" in describe_difference(x, x.reshape(3, 4))
    with pytest.raises(ValueError, match="shape"):
        same_bits_elementwise(x, x.reshape(3, 4))


def test_different_bits_fail():
    x = np.array([1.0, 2.0, 3.0], np.float32)
    y = x.copy()
    y.view(np.uint32)[1] ^= 1  # one ULP
    assert not same_bits(x, y)
    assert same_bits_elementwise(x, y).tolist() == [True, False, True]
    assert "1 of 3 elements differ, first at (1,)" in describe_difference(x, y)
    assert not same_bits(np.float32(0.0), np.float32(-0.0))  # zeros keep their sign
    assert not same_bits(np.float32(np.inf), np.float32(np.nan))
    assert not same_bits(np.array([np.nan], np.float32), np.array([1.0], np.float32))
    b = x.astype(ml_dtypes.bfloat16)
    c = b.copy()
    c.view(np.uint16)[2] ^= 1
    assert not same_bits(b, c) and same_bits(b, b.copy())
    assert not same_bits(np.array([1, 2], np.uint16), np.array([1, 3], np.uint16))


def test_nans_compare_by_their_bits():
    # fp32: a NaN equals only the same pattern (sign, quiet or signalling, payload)
    a = F32_NANS
    assert same_bits(a, a.copy())
    assert same_bits_elementwise(a, np.roll(a, 2)).tolist() == [False] * len(a)
    assert not same_bits(np.float64(np.nan), -np.float64(np.nan))
    assert not same_bits(np.array([np.nan], np.float16), np.array([-np.nan], np.float16))
    assert "1 of 1 elements differ" in describe_difference(np.float32(np.nan), -np.float32(np.nan))
    # ml_dtypes bfloat16 and uint16 patterns alike
    nan16 = BF16_NANS.view(ml_dtypes.bfloat16)
    assert same_bits(nan16, nan16.copy()) and not same_bits(nan16, np.roll(nan16, 3))
    assert not same_bits(BF16_NANS, np.roll(BF16_NANS, 1))
    # a NaN is not an infinity, nor the largest finite value
    assert not same_bits(np.array([0x7F80], np.uint16).view(ml_dtypes.bfloat16), nan16[:1])
    assert not same_bits(np.array([0x7F7F], np.uint16).view(ml_dtypes.bfloat16), nan16[:1])
    # every bf16 pattern against the quiet NaN: equal at 0x7FC0 only
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    ok = same_bits_elementwise(every.view(ml_dtypes.bfloat16), np.full_like(every, bf16.QNAN).view(ml_dtypes.bfloat16))
    assert np.flatnonzero(ok).tolist() == [bf16.QNAN]


def test_bfp_tensors():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((30, 50)).astype(np.float32)
    t = quantize(x, HBFP8)
    assert same_bits(t, quantize(x, HBFP8))
    assert not same_bits(t, quantize(x, HBFP8.with_rounding("toward_zero")))  # same codes maybe, not the same fmt
    codes = t.codes.copy()
    codes[3, 7] += 1
    assert not same_bits(t, BFPTensor(codes, t.exponents, t.fmt))
    assert "codes: 1 of 1500 elements differ" in describe_difference(t, BFPTensor(codes, t.exponents, t.fmt))
    exps = t.exponents.copy()
    exps[0, 1] += 1
    assert not same_bits(t, BFPTensor(t.codes, exps, t.fmt))
    assert not same_bits(t, quantize(x[:, :48], HBFP8))  # shape
    assert not same_bits(t, x) and not same_bits(x, t)
    with pytest.raises(ValueError):
        same_bits_elementwise(t, t)


def test_not_numbers_are_refused():
    assert not same_bits(np.array(["a"]), np.array(["a"]))
    assert "not a number type" in describe_difference(np.array([None]), np.array([None]))
