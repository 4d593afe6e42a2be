import math
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from hbfp import kernels
from hbfp.golden import HBFP8, HBFP16, MXINT8, BFPTensor, Format, bf16, quantize
from hbfp.golden.compare import describe_difference, same_bits
from hbfp.golden.gemm import gemm as golden_gemm
from hbfp.kernels import numpy_ops

from . import reference as ref

#: The implementation the tests' ``gemm`` runs (the ``path`` fixture sets it; None: the
#: registry's choice for this machine).
_impl = None
#: Every implementation of the product, the reference first (torch_int8, a CPU's torch._int_mm,
#: is held against the reference in tests/test_kernels.py).
IMPLS = ("reference", *kernels.COMPILED, "numpy", "torch")


def gemm(*args, **kw):
    kw.setdefault("impl", _impl)
    return golden_gemm(*args, **kw)


def available_impls():
    return [name for name in IMPLS if kernels.available(name)]


def reference_gemm(a: BFPTensor, b: BFPTensor, c=None, bias=None):
    out = ref.gemm_matrix(
        a.codes.tolist(), a.exponents.tolist(), a.fmt.mantissa_bits, a.fmt.tile,
        b.codes.tolist(), b.exponents.tolist(), b.fmt.mantissa_bits, b.fmt.tile,
        c=None if c is None else c.tolist(), bias=None if bias is None else bias.tolist(), n=b.shape[1],
    )
    return np.array(out, dtype=np.float32).reshape(a.shape[0], b.shape[1])


@pytest.fixture(params=IMPLS)
def path(request, monkeypatch):
    """Run a test once per implementation of the product (hbfp.kernels.IMPLS and the reference),
    each skipped where it cannot run, with its reason."""
    reason = kernels.why(request.param)
    if reason:
        pytest.skip(f"{request.param}: {reason}")
    monkeypatch.setattr(sys.modules[__name__], "_impl", request.param)
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
    assert same_bits(gemm(a, b), reference_gemm(a, b))
    assert same_bits(gemm(a, b, c=c, bias=bias), reference_gemm(a, b, c=c, bias=bias))


def test_blas_route_is_taken_on_ordinary_data():
    rng = np.random.default_rng(0)
    a, b = quantize(random_matrix(rng, (40, 50))), quantize(random_matrix(rng, (50, 30)))
    assert numpy_ops._fast_path_ok(a, b, 24, None)


def test_extreme_exponents_equal_reference(path):
    """Products that overflow to inf, underflow to zero, land subnormal before the flush:
    outside the BLAS route's preconditions, against the scalar reference."""
    rng = np.random.default_rng(1)
    row_exp = np.repeat([-70, 60, 0], 24)[:, None]  # A's tile rows
    col_exp = np.repeat([-62, 68, 0], 24)[None, :50]  # B's tile columns
    a = quantize((rng.standard_normal((72, 48)) * np.exp2(row_exp)).astype(np.float32))
    b = quantize((rng.standard_normal((48, 50)) * np.exp2(col_exp)).astype(np.float32))
    assert not numpy_ops._fast_path_ok(a, b, 24, None)
    got, want = gemm(a, b), reference_gemm(a, b)
    assert same_bits(got, want)
    assert np.isinf(got[24:48, 24:48]).any() and (got[:24, :24] == 0).all()
    assert np.all(np.isfinite(got[:24, 24:48])) and np.all(got[:24, 24:48] != 0)


def test_cancellation_below_the_smallest_normal_flushes(path):
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
    assert same_bits(got, reference_gemm(a, b))
    assert got[0, 0] == 0 and math.copysign(1, got[0, 0]) == 1.0  # p0 + p1 = 2**-132: flushed to +0


def test_accumulating_onto_small_c(path):
    rng = np.random.default_rng(2)
    a, b = quantize(random_matrix(rng, (30, 30))), quantize(random_matrix(rng, (30, 20)))
    c = (rng.standard_normal((30, 20)) * 2.0**-110).astype(np.float32)
    c[0, 0] = np.float32(2.0**-130)  # subnormal C reads as zero
    c[0, 1] = -0.0
    assert not numpy_ops._fast_path_ok(a, b, 24, c)
    assert same_bits(gemm(a, b, c=c), reference_gemm(a, b, c=c))


def test_every_implementation_agrees_on_larger_products():
    rng = np.random.default_rng(3)
    a, b = quantize(random_matrix(rng, (200, 300), 10)), quantize(random_matrix(rng, (300, 170), 10))
    c = random_matrix(rng, (200, 170))
    want = gemm(a, b, c=c, impl="reference")
    for name in available_impls():
        assert same_bits(gemm(a, b, c=c, impl=name), want), name


def test_blas_route_blocks_and_workers_do_not_change_bits(monkeypatch):
    rng = np.random.default_rng(4)
    a, b = quantize(random_matrix(rng, (150, 200))), quantize(random_matrix(rng, (200, 130)))
    base = gemm(a, b, impl="numpy")
    monkeypatch.setattr(numpy_ops, "_FAST_BLOCK_BYTES", 4 * 9 * 7 * 13)
    monkeypatch.setattr(numpy_ops, "_FAST_BLOCK_COLS", 13)
    monkeypatch.setattr(numpy_ops, "_FAST_PARALLEL_MIN", 0)
    assert same_bits(gemm(a, b, impl="numpy"), base)
    assert same_bits(base, gemm(a, b, impl="reference"))


def test_nan_tiles_poison_their_rows_and_columns(path):
    rng = np.random.default_rng(5)
    x, y = random_matrix(rng, (50, 48)), random_matrix(rng, (48, 30))
    x[30, 5] = np.nan  # tile row 1 (rows 24..47), K-tile 0
    y[40, 27] = np.inf  # K-tile 1, tile column 1 (columns 24..29)
    a, b = quantize(x), quantize(y)
    got = gemm(a, b)
    assert same_bits(got, reference_gemm(a, b))
    assert np.isnan(got[24:48]).all() and np.isnan(got[:, 24:]).all()
    assert not np.isnan(got[:24, :24]).any() and not np.isnan(got[48:, :24]).any()


def test_transposed_operands(path):
    rng = np.random.default_rng(6)
    x, y = random_matrix(rng, (40, 30)), random_matrix(rng, (50, 40))
    a, b = quantize(x), quantize(y)  # A stored K x M, B stored N x K
    got = gemm(a, b, transpose_a=True, transpose_b=True)
    assert same_bits(got, gemm(a.T, b.T))
    assert same_bits(got, reference_gemm(a.T, b.T))
    # With square tiles, quantizing the transpose is the same as transposing the codes.
    assert same_bits(got, gemm(quantize(x.T), quantize(y.T)))


def test_mxint8_needs_both_operands_blocked_along_k():
    rng = np.random.default_rng(7)
    x, w = random_matrix(rng, (16, 64)), random_matrix(rng, (20, 64))
    a, b = quantize(x, MXINT8), quantize(w, MXINT8)  # both 1 x 32 blocks along K
    got = gemm(a, b, transpose_b=True)
    assert same_bits(got, reference_gemm(a, b.T))
    with pytest.raises(ValueError, match="agree along K"):
        gemm(a, quantize(w.T, MXINT8))


def test_output_formats(path):
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


def test_zero_products_are_positive_zero(path):
    # 0 * negative codes: the integer sum is 0, which converts to +0 even onto C = -0.
    a = BFPTensor(np.zeros((2, 3), np.int8), np.zeros((1, 1), np.uint8), HBFP8)
    b = quantize(-np.ones((3, 2), np.float32))
    c = np.full((2, 2), -0.0, np.float32)
    for got in (gemm(a, b), gemm(a, b, c=c)):
        assert np.all(got.view(np.uint32) == 0)
    assert same_bits(gemm(a, b, c=c), reference_gemm(a, b, c=c))


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
def test_activation_epilogue_runs_in_bf16(name, path):
    from hbfp.golden import activations

    rng = np.random.default_rng(9)
    a, b = quantize(random_matrix(rng, (20, 30))), quantize(random_matrix(rng, (30, 10)))
    bias = random_matrix(rng, (1, 10))[0]
    acc = gemm(a, b, bias=bias)
    want = activations.get(name)(bf16.from_f32(acc))
    assert np.array_equal(gemm(a, b, bias=bias, activation=name, out="bf16").view(np.uint16), want)
    assert same_bits(gemm(a, b, bias=bias, activation=name), bf16.to_f32(want))
    t = gemm(a, b, bias=bias, activation=name, out=MXINT8)
    assert np.array_equal(t.codes, quantize(bf16.to_f32(want), MXINT8).codes)
    with pytest.raises(ValueError, match="relu"):
        gemm(a, b, activation="softmax")


# Raw operands: a BFPTensor (or a raw WRITE, whose codes are any m-bit integers) can hold
# what quantize never makes: nonzero codes under exponent code 0, the code -2**(m-1).


def test_exponent_code_zero_with_nonzero_codes(path):
    """E = -127 (code 0) with nonzero codes: the contract's p = s * 2**(E_A + E_B - 12),
    not a tile of zeros, and not the step 2**-126 the fast path's scaling would give."""
    fmt = Format(8, (16, 16))
    a = BFPTensor(np.ones((16, 16), np.int8), np.array([[252]], np.uint8), fmt)
    b = BFPTensor(np.ones((16, 16), np.int8), np.array([[0]], np.uint8), fmt)
    got = gemm(a, b)
    assert got[0, 0] == np.float32(16 * 2.0 ** (125 - 127 - 6 - 6)) == np.float32(0.0009765625)
    assert same_bits(got, reference_gemm(a, b))
    assert same_bits(gemm(b.T, a.T), reference_gemm(b.T, a.T))


def test_blas_route_refuses_raw_operands_it_cannot_scale():
    fmt = Format(8, (16, 16))
    ones = np.ones((16, 16), np.int8)
    a = BFPTensor(ones, np.array([[252]], np.uint8), fmt)
    assert not numpy_ops._fast_path_ok(a, BFPTensor(ones, np.array([[0]], np.uint8), fmt), 16, None)  # step 2**-133
    big = BFPTensor(np.full((16, 16), -128, np.int8), np.array([[254]], np.uint8), fmt)
    assert not numpy_ops._fast_path_ok(big, BFPTensor(ones, np.array([[100]], np.uint8), fmt), 16, None)  # -2**128
    zero = BFPTensor(np.zeros((16, 16), np.int8), np.zeros((1, 1), np.uint8), fmt)
    assert not numpy_ops._fast_path_ok(zero, big, 16, None)
    assert numpy_ops._fast_path_ok(zero, a, 16, None)
    # Tiles of zeros under code 0, as quantize makes them, still leave the fast path open.
    rng = np.random.default_rng(13)
    x = random_matrix(rng, (48, 48))
    x[:24, 24:] = 0
    q = quantize(x)
    assert (q.exponents == [[q.exponents[0, 0], 0], [q.exponents[1, 0], q.exponents[1, 1]]]).all()
    assert numpy_ops._fast_path_ok(q, q, 24, None)


def test_code_beyond_qmax_at_the_largest_exponent(path):
    """-128 (an 8-bit code a raw WRITE can hold) at E = 127 scales to -2**128, beyond fp32:
    the fast path must not compute with it (an inf, or 0 * inf = NaN)."""
    fmt = Format(8, (16, 16))
    a = BFPTensor(np.full((16, 16), -128, np.int8), np.array([[254]], np.uint8), fmt)
    b = BFPTensor(np.ones((16, 16), np.int8), np.array([[100]], np.uint8), fmt)
    got = gemm(a, b)
    assert same_bits(got, np.full((16, 16), -(2.0**99), np.float32))  # -2048 * 2**(127 - 27 - 12)
    assert same_bits(got, reference_gemm(a, b))
    zero = BFPTensor(np.zeros((16, 16), np.int8), np.zeros((1, 1), np.uint8), fmt)
    assert same_bits(gemm(zero, a), np.zeros((16, 16), np.float32))  # every s is 0: +0


def test_nan_tile_with_codes(path):
    """A NaN tile of a raw tensor may hold codes (quantize gives 0): its outputs are NaN and
    its codes take part in nothing, not even an overflow of the fast path's scaling."""
    fmt = Format(8, (16, 16))
    a = BFPTensor(np.full((32, 16), 127, np.int8), np.array([[0xFF], [130]], np.uint8), fmt)
    b = BFPTensor(np.ones((16, 16), np.int8), np.array([[127]], np.uint8), fmt)
    got = gemm(a, b)
    assert same_bits(got, reference_gemm(a, b))
    assert np.isnan(got[:16]).all() and (got[16:] == np.float32(16 * 127 * 2.0 ** (3 - 12))).all()


def _targets(ea: int, frac_bits: int) -> list[int]:
    """Codes of B that put ``p = s * 2**(E_A + E_B - frac_bits)`` of a code-``ea`` tile near
    each edge of fp32 (|s| < 2**16 here), besides the ends of the code range."""
    scales = [-180, -150, -145, -143, -142, -141, -140, -139, -138, -137, -136, -135, -134, -133, -130, -127,
              -126, -125, -110, -60, 0, 60, 100, 106, 108, 109, 110, 111, 112, 113, 115, 120, 127, 128]
    codes = {0, 1, 2, 127, 253, 254, 255} | {s + 254 + frac_bits - ea for s in scales}
    return sorted(e for e in codes if 0 <= e <= 255)


def test_every_exponent_code_against_reference(path):
    """Every exponent code of A (0..254 and 0xFF) against codes of B at the ends of the code
    range and at every edge of fp32 (products that flush, that round up to 2**-126, that
    overflow), over two K-tiles."""
    fa, fb = Format(8, (2, 4)), Format(8, (4, 2))
    rng = np.random.default_rng(14)
    qa = rng.integers(-127, 128, (2, 8)).astype(np.int8)
    qb = rng.integers(-127, 128, (8, 2)).astype(np.int8)
    qa[0, :4], qb[:4, 0] = 127, 127  # the largest sum of a K-tile, 4 * 127**2
    qa[1, 4:], qb[4:, 1] = [1, 0, 0, -1], [1, 0, 0, 0]  # the smallest, 1
    qa[1, :4], qb[:4, 1] = [3, -1, 0, 0], [1, 3, 0, 0]  # an exact 0 in K-tile 0
    for ea in range(256):
        a = BFPTensor(qa, np.full((1, 2), ea, np.uint8), fa)
        for eb in _targets(ea, fa.frac_bits + fb.frac_bits):
            b = BFPTensor(qb, np.array([[eb], [max(0, eb - 1)]], np.uint8), fb)
            got, want = gemm(a, b), reference_gemm(a, b)
            assert same_bits(got, want), (ea, eb, describe_difference(got, want))


# Formats of A and B (tiles agreeing along K), small enough for the scalar reference.
RAW_FORMATS = [
    (Format(8, (4, 4)), Format(8, (4, 4))),
    (Format(8, (3, 5)), Format(6, (5, 2))),
    (Format(16, (2, 3)), Format(8, (3, 4))),
    (Format(2, (4, 4)), Format(16, (4, 4))),
    (Format(8, (1, 8)), Format(8, (8, 1))),
    (Format(16, (2, 2)), Format(16, (2, 2))),
]

_F32_SPECIAL = [0.0, -0.0, 2.0**-126, -(2.0**-126), 2.0**-149, 1.0, 3.4e38, -3.4e38, math.inf, -math.inf, math.nan]


def _raw_operand(data, shape, fmt: Format, center: int) -> BFPTensor:
    """A BFPTensor as a raw WRITE may hold it: any m-bit codes (-2**(m-1) included), tiles of
    zeros under any exponent code, nonzero codes under code 0, NaN tiles (with codes), and
    exponent codes near ``center`` or anywhere in 0..255."""
    q = fmt.qmax
    code = st.one_of(st.integers(-q - 1, q), st.sampled_from([0, 1, -1, q, -q, -q - 1]))
    codes = data.draw(arrays(np.int64, shape, elements=code))
    th, tw = fmt.tile
    grid = (-(-shape[0] // th), -(-shape[1] // tw))
    empty = data.draw(arrays(np.bool_, grid))
    codes[np.repeat(np.repeat(empty, th, 0), tw, 1)[: shape[0], : shape[1]]] = 0
    # 0: code 0; 1: NaN; 2: anywhere; 3..9: within 3 of the center (clipped to 0..254).
    kind = data.draw(arrays(np.int64, grid, elements=st.integers(0, 9)))
    near = np.clip(center + data.draw(arrays(np.int64, grid, elements=st.integers(-3, 3))), 0, 254)
    anywhere = st.one_of(st.integers(0, 255), st.sampled_from([0, 1, 254, 255]))
    anywhere = data.draw(arrays(np.int64, grid, elements=anywhere))
    exps = np.select([kind == 0, kind == 1, kind == 2], [0, 0xFF, anywhere], near)
    return BFPTensor(codes.astype(fmt.code_dtype), exps.astype(np.uint8), fmt)


def _f32_values(data, shape, scale: int) -> np.ndarray:
    """fp32 values: any (subnormals, infs, NaN included), or near the magnitude 2**scale."""
    lo = min(126, max(-149, scale - 4))
    exponent = st.integers(lo, max(lo, min(126, scale + 24)))
    near = st.builds(lambda f, e: float(np.ldexp(f, e)), st.floats(-2, 2, width=32), exponent)
    values = st.one_of(st.floats(width=32), st.sampled_from(_F32_SPECIAL), near)
    return data.draw(arrays(np.float32, shape, elements=values.map(np.float32)))


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_raw_operands_equal_reference(data):
    """Raw BFPTensors with any exponent codes (0, 254, 0xFF included) and codes, both
    transposes, accumulation onto C and a bias: every implementation equals the scalar
    reference."""
    fa, fb = data.draw(st.sampled_from(RAW_FORMATS))
    m, k, n = (data.draw(st.integers(0, hi)) for hi in (9, 13, 9))
    ta, tb = data.draw(st.booleans()), data.draw(st.booleans())
    center_a = data.draw(st.integers(0, 254))
    # The code step of a product, 2**scale: where p flushes, is ordinary, overflows, or any.
    scale = data.draw(st.one_of(st.integers(-150, -115), st.integers(-30, 30), st.integers(100, 135),
                                st.integers(-300, 300)))
    center_b = min(254, max(0, scale + 2 * 127 + fa.frac_bits + fb.frac_bits - center_a))
    sa = _raw_operand(data, (k, m) if ta else (m, k), fa.transposed() if ta else fa, center_a)
    sb = _raw_operand(data, (n, k) if tb else (k, n), fb.transposed() if tb else fb, center_b)
    c = _f32_values(data, (m, n), scale) if data.draw(st.booleans()) else None
    bias = _f32_values(data, (n,), scale) if data.draw(st.booleans()) else None
    a, b = (sa.T if ta else sa), (sb.T if tb else sb)
    event("BLAS route" if k and numpy_ops._fast_path_ok(a, b, fa.tile[1], c) else "outside the BLAS route")
    want = reference_gemm(a, b, c=c, bias=bias)
    for name in available_impls():
        got = gemm(sa, sb, c=c, bias=bias, transpose_a=ta, transpose_b=tb, impl=name)
        assert same_bits(got, want), (name, describe_difference(got, want))


def test_gemm_with_no_columns(path):
    got = gemm(quantize(np.ones((3, 40)), HBFP8), quantize(np.zeros((40, 0)), HBFP8))
    assert same_bits(got, np.zeros((3, 0), np.float32))


@pytest.mark.parametrize("m, k, n", [(3, 40, 0), (0, 40, 5), (0, 40, 0), (3, 0, 5), (0, 0, 5), (3, 0, 0), (0, 0, 0)])
def test_empty_shapes(m, k, n, path):
    """An empty M, K or N: an empty result of every output format; K = 0 gives C (or +0)
    plus the bias through the epilogue."""
    from hbfp.golden import activations

    rng = np.random.default_rng(15)
    a, b = quantize(random_matrix(rng, (m, k))), quantize(random_matrix(rng, (k, n)))
    c, bias = random_matrix(rng, (m, n)), random_matrix(rng, (1, n))[0]
    assert same_bits(gemm(a, b), np.zeros((m, n), np.float32))
    assert same_bits(gemm(a.T, b.T, transpose_a=True, transpose_b=True), np.zeros((m, n), np.float32))
    want = reference_gemm(a, b, c=c, bias=bias)
    assert same_bits(want, bf16.add_f32(bf16.flush_f32(c), bias[None, :]))  # empty, or K = 0: C + bias
    assert same_bits(gemm(a, b, c=c, bias=bias), want)
    assert same_bits(gemm(a, b, c=c, bias=bias, out="bf16"), bf16.to_dtype(bf16.from_f32(want)))
    for fmt in (HBFP8, MXINT8, HBFP16.with_rounding("stochastic")):
        assert same_bits(gemm(a, b, c=c, bias=bias, out=fmt, seed=4), quantize(want, fmt, seed=4))
    gelu = activations.get("gelu")(bf16.from_f32(want))
    assert same_bits(gemm(a, b, c=c, bias=bias, activation="gelu", out="bf16"), bf16.to_dtype(gelu))
    assert same_bits(gemm(a, b, c=c, bias=bias, activation="gelu"), bf16.to_f32(gelu))
    assert same_bits(gemm(a, b, c=c, bias=bias, activation="gelu", out=HBFP8), quantize(bf16.to_f32(gelu), HBFP8))


def test_signalling_nan_in_the_accumulator_stays_nan(path):
    # Found by the protocol fuzz: a raw WRITE of 0x7F800001 into the accumulator, then an
    # accumulating product, made NumPy warn (an error here) instead of answering NaN.
    import warnings

    c = np.full((1, 8), 0x7F800001, np.uint32).view(np.float32)
    a = quantize(np.ones((1, 24), np.float32), HBFP8)
    b = quantize(np.ones((24, 8), np.float32), HBFP8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = gemm(a, b, c=c)
    assert np.isnan(got).all()


@pytest.mark.parametrize("impl", [i for i in kernels.IMPLS if kernels.available(i)])
def test_one_nan_from_every_implementation(impl):
    """inf + (-inf), in the accumulation (C = +inf, a product that overflows to -inf) and in
    the bias addition, is the one quiet NaN 0x7FC00000 on every path, bit for bit (the
    gateware's: tests/test_emu_gateware.py); as bf16 0x7FC0. A NaN tile gives it too."""
    fmt = HBFP8
    a = BFPTensor(np.full((3, 24), 127, np.int8), np.full((1, 1), 254, np.uint8), fmt)
    b = BFPTensor(np.full((24, 5), -127, np.int8), np.full((1, 1), 254, np.uint8), fmt)
    c = np.full((3, 5), np.inf, np.float32)
    got = kernels.gemm(a, b, c=c, impl=impl)
    assert (got.view(np.uint32) == 0x7FC00000).all(), [hex(x) for x in got.view(np.uint32).ravel()]
    assert (kernels.gemm(a, b, c=c, out="bf16", impl=impl).view(np.uint16) == 0x7FC0).all()
    zero = BFPTensor(np.zeros((24, 5), np.int8), np.zeros((1, 1), np.uint8), fmt)
    bias = np.full(5, -np.inf, np.float32)
    assert (kernels.gemm(a, zero, c=c, bias=bias, impl=impl).view(np.uint32) == 0x7FC00000).all()
    nan_tile = BFPTensor(np.zeros((24, 5), np.int8), np.full((1, 1), 255, np.uint8), fmt)
    assert (kernels.gemm(a, nan_tile, impl=impl).view(np.uint32) == 0x7FC00000).all()
