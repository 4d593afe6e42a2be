import math

import ml_dtypes
import numpy as np
import pytest

from hbfp.golden import HBFP8, HBFP16, MXINT8, BFPTensor, Format, bf16, quantize
from hbfp.golden import gemm as gemm_mod
from hbfp.golden.gemm import gemm

from . import reference as ref


def bits_equal(x, y):
    """fp32 arrays equal bit for bit, NaNs compared by class."""
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    nx, ny = np.isnan(x), np.isnan(y)
    return np.array_equal(nx, ny) and np.array_equal(x[~nx].view(np.uint32), y[~ny].view(np.uint32))


def reference_gemm(a: BFPTensor, b: BFPTensor, c=None, bias=None):
    out = ref.gemm_matrix(
        a.codes.tolist(), a.exponents.tolist(), a.fmt.mantissa_bits, a.fmt.tile,
        b.codes.tolist(), b.exponents.tolist(), b.fmt.mantissa_bits, b.fmt.tile,
        c=None if c is None else c.tolist(), bias=None if bias is None else bias.tolist(),
    )
    return np.array(out, dtype=np.float32).reshape(a.shape[0], b.shape[1])


@pytest.fixture(params=["fast", "exact"])
def path(request, monkeypatch):
    """Run a test once as gemm chooses, once with the fast path forbidden."""
    if request.param == "exact":
        monkeypatch.setattr(gemm_mod, "_fast_path_ok", lambda *args: False)
    return request.param


def random_matrix(rng, shape, spread=4):
    scale = np.exp2(rng.integers(-spread, spread + 1, (shape[0], 1)))
    return (rng.standard_normal(shape) * scale).astype(np.float32)


CASES = [
    # (M, K, N, format of A, format of B)
    (5, 7, 3, HBFP8, HBFP8),
    (30, 50, 27, HBFP8, HBFP8),
    (49, 73, 25, HBFP8, HBFP8),
    (9, 40, 11, Format(8, (4, 4)), Format(8, (4, 4))),
    (13, 17, 19, Format(6, (3, 5)), Format(8, (5, 2))),
    (20, 64, 1, MXINT8, Format(8, (32, 1))),
    (7, 30, 9, HBFP16, HBFP8),
    (6, 50, 5, HBFP16, HBFP16),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_gemm_equals_scalar_reference(case, path):
    m, k, n, fa, fb = CASES[case]
    rng = np.random.default_rng(case)
    a, b = quantize(random_matrix(rng, (m, k)), fa), quantize(random_matrix(rng, (k, n)), fb)
    c = random_matrix(rng, (m, n))
    bias = random_matrix(rng, (1, n))[0]
    assert bits_equal(gemm(a, b), reference_gemm(a, b))
    assert bits_equal(gemm(a, b, c=c, bias=bias), reference_gemm(a, b, c=c, bias=bias))


def test_fast_path_is_taken_on_ordinary_data():
    rng = np.random.default_rng(0)
    a, b = quantize(random_matrix(rng, (40, 50))), quantize(random_matrix(rng, (50, 30)))
    assert gemm_mod._fast_path_ok(a, b, 24, None)


def test_extreme_exponents_equal_reference():
    """Products that overflow to inf, underflow to zero, land subnormal before the flush:
    the exact path, against the scalar reference."""
    rng = np.random.default_rng(1)
    row_exp = np.repeat([-70, 60, 0], 24)[:, None]  # A's tile rows
    col_exp = np.repeat([-62, 68, 0], 24)[None, :50]  # B's tile columns
    a = quantize((rng.standard_normal((72, 48)) * np.exp2(row_exp)).astype(np.float32))
    b = quantize((rng.standard_normal((48, 50)) * np.exp2(col_exp)).astype(np.float32))
    assert not gemm_mod._fast_path_ok(a, b, 24, None)
    got, want = gemm(a, b), reference_gemm(a, b)
    assert bits_equal(got, want)
    assert np.isinf(got[24:48, 24:48]).any() and (got[:24, :24] == 0).all()
    assert np.all(np.isfinite(got[:24, 24:48])) and np.all(got[:24, 24:48] != 0)


def test_cancellation_below_the_smallest_normal_flushes():
    # Two K-tiles whose products are +-(2**-126 + a little): their sum is subnormal -> 0.
    k = 48
    qa = np.zeros((1, k), np.int8)
    qb = np.zeros((k, 1), np.int8)
    qa[0, 0], qb[0, 0] = 65, 64  # 65*64 * 2**(sa + sb)
    qa[0, 24], qb[24, 0] = -64, 64
    step = -126 - 12  # p0 = 4160 * 2**-138 = 1.015625 * 2**-126, p1 = -4096 * 2**-138 = -2**-126
    ea = np.array([[step // 2 + 6 + 127, step // 2 + 6 + 127]], np.uint8)
    eb = np.array([[step - step // 2 + 6 + 127], [step - step // 2 + 6 + 127]], np.uint8)
    a, b = BFPTensor(qa, ea, HBFP8), BFPTensor(qb, eb, HBFP8)
    got = gemm(a, b)
    assert bits_equal(got, reference_gemm(a, b))
    assert got[0, 0] == 0 and math.copysign(1, got[0, 0]) == 1.0  # p0 + p1 = 2**-132: flushed to +0


def test_accumulating_onto_small_c_uses_the_exact_path():
    rng = np.random.default_rng(2)
    a, b = quantize(random_matrix(rng, (30, 30))), quantize(random_matrix(rng, (30, 20)))
    c = (rng.standard_normal((30, 20)) * 2.0**-110).astype(np.float32)
    c[0, 0] = np.float32(2.0**-130)  # subnormal C reads as zero
    c[0, 1] = -0.0
    assert not gemm_mod._fast_path_ok(a, b, 24, c)
    assert bits_equal(gemm(a, b, c=c), reference_gemm(a, b, c=c))


def test_fast_and_exact_paths_agree_on_larger_products(monkeypatch):
    rng = np.random.default_rng(3)
    a, b = quantize(random_matrix(rng, (200, 300), 10)), quantize(random_matrix(rng, (300, 170), 10))
    c = random_matrix(rng, (200, 170))
    fast = gemm(a, b, c=c)
    monkeypatch.setattr(gemm_mod, "_fast_path_ok", lambda *args: False)
    assert bits_equal(fast, gemm(a, b, c=c))


def test_fast_path_blocks_and_workers_do_not_change_bits(monkeypatch):
    rng = np.random.default_rng(4)
    a, b = quantize(random_matrix(rng, (150, 200))), quantize(random_matrix(rng, (200, 130)))
    base = gemm(a, b)
    monkeypatch.setattr(gemm_mod, "_FAST_BLOCK_BYTES", 4 * 9 * 7 * 13)
    monkeypatch.setattr(gemm_mod, "_FAST_BLOCK_COLS", 13)
    monkeypatch.setattr(gemm_mod, "_FAST_PARALLEL_MIN", 0)
    assert bits_equal(gemm(a, b), base)


def test_nan_tiles_poison_their_rows_and_columns(path):
    rng = np.random.default_rng(5)
    x, y = random_matrix(rng, (50, 48)), random_matrix(rng, (48, 30))
    x[30, 5] = np.nan  # tile row 1 (rows 24..47), K-tile 0
    y[40, 27] = np.inf  # K-tile 1, tile column 1 (columns 24..29)
    a, b = quantize(x), quantize(y)
    got = gemm(a, b)
    assert bits_equal(got, reference_gemm(a, b))
    assert np.isnan(got[24:48]).all() and np.isnan(got[:, 24:]).all()
    assert not np.isnan(got[:24, :24]).any() and not np.isnan(got[48:, :24]).any()


def test_transposed_operands():
    rng = np.random.default_rng(6)
    x, y = random_matrix(rng, (40, 30)), random_matrix(rng, (50, 40))
    a, b = quantize(x), quantize(y)  # A stored K x M, B stored N x K
    got = gemm(a, b, transpose_a=True, transpose_b=True)
    assert bits_equal(got, gemm(a.T, b.T))
    assert bits_equal(got, reference_gemm(a.T, b.T))
    # With square tiles, quantizing the transpose is the same as transposing the codes.
    assert bits_equal(got, gemm(quantize(x.T), quantize(y.T)))


def test_mxint8_needs_both_operands_blocked_along_k():
    rng = np.random.default_rng(7)
    x, w = random_matrix(rng, (16, 64)), random_matrix(rng, (20, 64))
    a, b = quantize(x, MXINT8), quantize(w, MXINT8)  # both 1 x 32 blocks along K
    got = gemm(a, b, transpose_b=True)
    assert bits_equal(got, reference_gemm(a, b.T))
    with pytest.raises(ValueError, match="agree along K"):
        gemm(a, quantize(w.T, MXINT8))


def test_output_formats():
    rng = np.random.default_rng(8)
    a, b = quantize(random_matrix(rng, (30, 40))), quantize(random_matrix(rng, (40, 26)))
    fp32 = gemm(a, b)
    as_bf16 = gemm(a, b, out="bf16")
    assert as_bf16.dtype == ml_dtypes.bfloat16
    assert np.array_equal(as_bf16.view(np.uint16), bf16.from_f32(fp32))
    t = gemm(a, b, out=HBFP8)
    u = quantize(fp32, HBFP8)
    assert np.array_equal(t.codes, u.codes) and np.array_equal(t.exponents, u.exponents)
    s1 = gemm(a, b, out=HBFP8.with_rounding("stochastic"), seed=3)
    s2 = quantize(fp32, HBFP8.with_rounding("stochastic"), seed=3)
    assert np.array_equal(s1.codes, s2.codes)


def test_zero_products_are_positive_zero():
    # 0 * negative codes: the integer sum is 0, which converts to +0 even onto C = -0.
    a = BFPTensor(np.zeros((2, 3), np.int8), np.zeros((1, 1), np.uint8), HBFP8)
    b = quantize(-np.ones((3, 2), np.float32))
    c = np.full((2, 2), -0.0, np.float32)
    for got in (gemm(a, b), gemm(a, b, c=c)):
        assert np.all(got.view(np.uint32) == 0)
    assert bits_equal(gemm(a, b, c=c), reference_gemm(a, b, c=c))


def test_errors_are_clear():
    a = quantize(np.ones((4, 5), np.float32))
    b = quantize(np.ones((6, 3), np.float32))
    with pytest.raises(ValueError, match="4x5.*6x3"):
        gemm(a, b)
    with pytest.raises(TypeError, match="BFPTensor"):
        gemm(np.ones((4, 5)), b)
    good = quantize(np.ones((5, 3), np.float32))
    with pytest.raises(ValueError, match="out must be"):
        gemm(a, good, out="fp16")
    with pytest.raises(TypeError, match="float32"):
        gemm(a, good, c=np.ones((4, 3)))
    with pytest.raises(ValueError, match="shape"):
        gemm(a, good, c=np.ones((3, 3), np.float32))
    with pytest.raises(ValueError, match="bias"):
        gemm(a, good, bias=np.ones(4, np.float32))


@pytest.mark.parametrize("name", ["relu", "gelu", "sigmoid", "tanh", "exp", "leaky_relu"])
def test_activation_epilogue_runs_in_bf16(name):
    from hbfp.golden import activations

    rng = np.random.default_rng(9)
    a, b = quantize(random_matrix(rng, (20, 30))), quantize(random_matrix(rng, (30, 10)))
    bias = random_matrix(rng, (1, 10))[0]
    acc = gemm(a, b, bias=bias)
    want = activations.get(name)(bf16.from_f32(acc))
    assert np.array_equal(gemm(a, b, bias=bias, activation=name, out="bf16").view(np.uint16), want)
    assert bits_equal(gemm(a, b, bias=bias, activation=name), bf16.to_f32(want))
    t = gemm(a, b, bias=bias, activation=name, out=MXINT8)
    assert np.array_equal(t.codes, quantize(bf16.to_f32(want), MXINT8).codes)
    with pytest.raises(ValueError, match="relu"):
        gemm(a, b, activation="softmax")
