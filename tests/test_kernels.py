"""The registry hbfp.kernels on torch tensors against the NumPy reference (hbfp.golden), bit for
bit, every implementation that runs here: quantization in every rounding (and of stacks),
requantization, dequantization, the product (sums, bias, activation, bf16 out; matrices and
stacks, transposed and sliced views, any number of threads) and the epilogue, on random
shapes, exponent spreads, special values and NaN tiles (more than 10**6 compared outputs per
implementation)."""

import numpy as np
import pytest
import torch

from hbfp import kernels as K
from hbfp.golden import HBFP8, HBFP16, MXINT8, Format, bf16, quantize, requantize
from hbfp.golden.activations import UNARY
from hbfp.golden.bfp import mix32, random_bits, stream_index
from hbfp.golden.gemm import epilogue
from hbfp.golden.gemm import gemm as golden_gemm
from hbfp.kernels import torch_ops as T


def gemm(a, b, **kw):
    """The reference product."""
    return golden_gemm(a, b, impl="reference", **kw)


def impl_params(names):
    return [pytest.param(n, marks=pytest.mark.skipif(not K.available(n), reason=f"{n}: {K.why(n)}")) for n in names]


#: Every implementation of the registry.
ALL = impl_params([*K.COMPILED, "numpy", "torch", "torch_int8"])

FORMATS = {"hbfp8": HBFP8, "hbfp16": HBFP16, "mxint8": MXINT8, "m6_3x5": Format(6, (3, 5))}
ROUNDINGS = ("nearest_even", "toward_zero", "stochastic")


def spread(rng, shape, decades=6):
    """Values whose magnitudes span ``decades`` powers of ten, with zeros and negative zeros."""
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-decades / 2, decades / 2, shape)
    x[rng.random(shape) < 0.05] = 0.0
    x[rng.random(shape) < 0.01] = -0.0
    return x.astype(np.float32)


def same(t: torch.Tensor, a: np.ndarray) -> bool:
    return np.array_equal(t.cpu().numpy(), a)


def test_seed_keys_equal_the_golden_generators():
    """The kernels' key of a seed (Python integers) is the golden generator's (NumPy)."""
    from hbfp.golden import bfp

    for seed in (0, 1, 7, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 5, 2**40 + 3, -1, -(2**31), np.uint32(9)):
        assert K._seed_key(seed) == int(bfp._key(seed))
    with pytest.raises(TypeError):
        K._seed_key(True)


def test_mix32_and_stream_index():
    x = np.random.default_rng(0).integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32)
    assert same(T.mix32(torch.from_numpy(x.astype(np.int64))), mix32(x).astype(np.int64))
    for rows, cols, tile in ((50, 70, (24, 24)), (5, 64, (1, 32)), (7, 11, (3, 5))):
        th, tw = tile
        grid = (-(-rows // th), -(-cols // tw))
        want = stream_index(grid, tile)[:rows, :cols].astype(np.int64)
        assert same(T.stream_index(rows, cols, tile), want)
        assert same(T.random_bits(9, T.stream_index(rows, cols, tile)), random_bits(9, want))


@pytest.mark.parametrize("impl", ALL)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_quantize_equals_golden(name, rounding, impl):
    fmt = FORMATS[name].with_rounding(rounding)
    rng = np.random.default_rng(len(name) * 7 + len(rounding))
    for m, n in ((1, 1), (37, 53), (96, 96), (130, 75)):
        x = spread(rng, (m, n), decades=12 if m == 130 else 6)
        if m > 30:
            x[3, 4], x[m - 1, 0] = np.nan, np.inf  # NaN tiles
            x[10, 10] = np.float32(1e-40)  # a subnormal: read as zero
            x[20, :] *= np.float32(2.0**100)  # exponents near the top of the range
        want = quantize(x, fmt, seed=m + n, impl="reference")
        codes, expo = K.quantize(torch.from_numpy(x), fmt, seed=m + n, impl=impl)
        assert same(codes, want.codes) and same(expo, want.exponents), (m, n)
        assert codes.dtype == {1: torch.int8, 2: torch.int16}[want.codes.dtype.itemsize]
    x16 = torch.from_numpy(spread(rng, (40, 60))).to(torch.bfloat16)
    want = quantize(bf16.to_dtype(bf16.as_bits(x16.view(torch.int16).numpy().view(np.uint16))), fmt, seed=1,
                    impl="reference")
    codes, expo = K.quantize(x16, fmt, seed=1, impl=impl)
    assert same(codes, want.codes) and same(expo, want.exponents)
    # a transposed view, and a stack (each matrix padded to whole tiles, positions as stacked)
    xt = torch.from_numpy(spread(rng, (50, 40))).t()
    want = quantize(xt.contiguous().numpy(), fmt, seed=2, impl="reference")
    codes, expo = K.quantize(xt, fmt, seed=2, impl=impl)
    assert same(codes, want.codes) and same(expo, want.exponents)
    stack = torch.from_numpy(spread(rng, (3, 30, 41)))
    th, tw = fmt.tile
    rp, cp = -(-30 // th) * th, -(-41 // tw) * tw
    padded = np.zeros((3, rp, cp), np.float32)
    padded[:, :30, :41] = stack.numpy()
    want = quantize(padded.reshape(3 * rp, cp), fmt, seed=5, impl="reference")
    codes, expo = K.quantize(stack, fmt, seed=5, impl=impl)
    assert same(codes, want.codes.reshape(3, rp, cp)[:, :30, :41])
    assert same(expo, want.exponents.reshape(3, rp // th, cp // tw))


@pytest.mark.parametrize("impl", ALL)
def test_dequantize_equals_golden(impl):
    rng = np.random.default_rng(8)
    x = spread(rng, (60, 70), decades=12)
    x[0, :3] = [np.nan, np.float32(2.0**-125), np.float32(3e38)]
    for fmt in (HBFP8, HBFP16, MXINT8):
        t = quantize(x, fmt)
        t.exponents[1, 0] = 2  # values at the bottom of fp32's range: flushed as the device does
        t.exponents[2, 0] = 0  # codes under exponent code 0: below 2**-126, read as zeros
        t.exponents[0, 1] = 254  # the top exponent: values up to 2**128 - 2**(121 or 113)
        t.exponents[1, 1] = 127 + fmt.frac_bits - 126  # the lowest exponent whose values are all normal
        t.exponents[2, 1] = 127 + fmt.frac_bits - 127  # one below: a code of 1 is subnormal
        got = K.dequantize(*T.from_bfp_tensor(t), fmt, impl=impl)
        assert np.array_equal(got.numpy().view(np.uint32), t.dequantize().view(np.uint32))


@pytest.mark.parametrize("impl", ALL)
def test_dequantize_into_out(impl):
    """``out=``: the values written into the given array or tensor (contiguous, or a strided
    view the writes must reach) and it returned; the wrong shape or type refused."""
    rng = np.random.default_rng(9)
    t = quantize(spread(rng, (50, 48)), HBFP8)
    want = t.dequantize()
    codes, exps = T.from_bfp_tensor(t)
    out = torch.full((50, 48), 7.0)
    assert K.dequantize(codes, exps, HBFP8, impl=impl, out=out) is out
    assert np.array_equal(out.numpy().view(np.uint32), want.view(np.uint32))
    wide = torch.full((50, 96), 7.0)
    K.dequantize(codes, exps, HBFP8, impl=impl, out=wide[:, ::2])  # a strided view
    assert np.array_equal(wide[:, ::2].numpy().view(np.uint32), want.view(np.uint32))
    assert (wide[:, 1::2] == 7.0).all()
    if not impl.startswith("torch"):  # the torch kernels take tensors only
        arr = np.full((50, 48), 7.0, np.float32)
        K.dequantize(t.codes, t.exponents, HBFP8, impl=impl, out=arr)
        assert np.array_equal(arr.view(np.uint32), want.view(np.uint32))
    for bad in (torch.empty(50, 47), torch.empty(50, 48, dtype=torch.float64), np.empty((50, 48), np.float32)):
        with pytest.raises(ValueError, match="out must be"):
            K.dequantize(codes, exps, HBFP8, impl=impl, out=bad)


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_requantize_equals_golden(rounding):
    rng = np.random.default_rng(3)
    wide = quantize(spread(rng, (70, 50)), HBFP16)
    want = requantize(wide, HBFP8.with_rounding(rounding), seed=4)
    codes, expo = K.requantize(*T.from_bfp_tensor(wide), HBFP16, HBFP8.with_rounding(rounding), seed=4)
    assert same(codes, want.codes) and same(expo, want.exponents)
    codes, expo = K.requantize(wide.codes, wide.exponents, HBFP16, HBFP8.with_rounding(rounding), seed=4)
    assert np.array_equal(codes, want.codes) and np.array_equal(expo, want.exponents)


def _operands(rng, m, k, n, fa, fb, decades):
    a = spread(rng, (m, k), decades)
    b = spread(rng, (k, n), decades)
    return quantize(a, fa), quantize(b, fb)


CASES = [  # m, k, n, format, exponent decades, with C, with bias
    (1, 1, 1, HBFP8, 2, False, False),
    (64, 96, 80, HBFP8, 4, True, True),
    (150, 200, 130, HBFP8, 8, False, True),
    (33, 250, 47, HBFP16, 6, True, False),
    (40, 96, 70, MXINT8, 6, True, True),
    (300, 500, 400, HBFP8, 6, True, True),
    (500, 300, 600, HBFP8, 3, False, False),
]


@pytest.mark.parametrize("impl", ALL)
@pytest.mark.parametrize("m, k, n, fmt, decades, with_c, with_bias", CASES)
def test_gemm_sums_equal_golden(m, k, n, fmt, decades, with_c, with_bias, impl):
    rng = np.random.default_rng(m + k + n)
    if fmt is MXINT8:  # B blocked along K: stored N x K and used transposed
        qa = quantize(spread(rng, (m, k), decades), fmt)
        qb = quantize(spread(rng, (n, k), decades), fmt).transpose()
    else:
        qa, qb = _operands(rng, m, k, n, fmt, fmt, decades)
    c = spread(rng, (m, n)) if with_c else None
    bias = spread(rng, (n,)) if with_bias else None
    want = gemm(qa, qb, c=c, bias=bias)
    got = K.gemm(T.from_bfp_tensor(qa), T.from_bfp_tensor(qb), fa=qa.fmt, fb=qb.fmt,
                 c=None if c is None else torch.from_numpy(c), bias=None if bias is None else torch.from_numpy(bias),
                 impl=impl)
    assert same(got.view(torch.int32), want.view(np.int32))


@pytest.mark.parametrize("impl", ALL)
def test_gemm_special_values_and_the_exact_fallback(impl):
    rng = np.random.default_rng(11)
    a = spread(rng, (60, 100))
    b = spread(rng, (100, 50))
    a[5, 7], b[30, 3] = np.nan, np.inf  # a NaN tile on each side
    qa, qb = quantize(a, HBFP8), quantize(b, HBFP8)
    c = spread(rng, (60, 50))
    c[2, 2], c[3, 3] = np.nan, -np.inf
    args = (T.from_bfp_tensor(qa), T.from_bfp_tensor(qb))
    got = K.gemm(*args, fa=HBFP8, fb=HBFP8, c=torch.from_numpy(c), impl=impl)
    assert np.array_equal(got.numpy(), gemm(qa, qb, c=c), equal_nan=True)
    # Exponents at the bottom of the range (products that would be subnormal) and a C below
    # 2**-103: outside the fast path's preconditions, the NumPy model's exact path.
    tiny = quantize(spread(rng, (30, 48)) * np.float32(2.0**-70), HBFP8)
    tiny_b = quantize(spread(rng, (48, 20)) * np.float32(2.0**-60), HBFP8)
    c2 = np.full((30, 20), np.float32(2.0**-110))
    got = K.gemm(T.from_bfp_tensor(tiny), T.from_bfp_tensor(tiny_b), fa=HBFP8, fb=HBFP8, c=torch.from_numpy(c2),
                 impl=impl)
    assert same(got.view(torch.int32), gemm(tiny, tiny_b, c=c2).view(np.int32))


@pytest.mark.parametrize("activation", [None, *UNARY])
@pytest.mark.parametrize("out", ["fp32", "bf16", "bfp"])
def test_epilogue_equals_golden(activation, out):
    rng = np.random.default_rng(len(activation or "") * 3 + len(out))
    acc = spread(rng, (50, 72), decades=10) * np.float32(4.0)
    acc[0, :4] = [np.nan, np.inf, -np.inf, np.float32(1e-39)]
    fmt = HBFP8.with_rounding("stochastic") if out == "bfp" else out
    want = epilogue(acc, activation, fmt, seed=7, leaky_shift=3)  # (a BFP output: quantize's default impl)
    got = T.epilogue(torch.from_numpy(acc), activation, fmt, seed=7, leaky_shift=3)
    if out == "bfp":
        assert same(got[0], want.codes) and same(got[1], want.exponents)
    elif out == "bf16":
        assert same(got.view(torch.int16), want.view(np.int16))
    else:
        assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("impl", ALL)
def test_random_products_equal_golden(impl):
    """Random shapes, formats, exponent spreads, NaN tiles, C and bias: over 10**6 outputs."""
    rng = np.random.default_rng(2024)
    compared = 0
    while compared < 10**6:
        m, k, n = (int(v) for v in rng.integers(1, 400, 3))
        fmt = [HBFP8, HBFP16, Format(6, (12, 12))][int(rng.integers(3))]
        qa, qb = _operands(rng, m, k, n, fmt, fmt, float(rng.uniform(0, 12)))
        if rng.random() < 0.2:
            qa.exponents[0, 0] = 0xFF  # a NaN tile
        c = spread(rng, (m, n)) if rng.random() < 0.5 else None
        bias = spread(rng, (n,)) if rng.random() < 0.5 else None
        want = gemm(qa, qb, c=c, bias=bias)
        got = K.gemm(T.from_bfp_tensor(qa), T.from_bfp_tensor(qb), fa=fmt, fb=fmt, impl=impl,
                     c=None if c is None else torch.from_numpy(c), bias=None if bias is None else torch.from_numpy(bias))
        assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32)) or (
            np.array_equal(np.isnan(got.numpy()), np.isnan(want))
            and np.array_equal(got.numpy()[~np.isnan(want)].view(np.uint32), want[~np.isnan(want)].view(np.uint32))
        ), (m, k, n, fmt)
        compared += m * n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_kernels_on_cuda_equal_golden():
    rng = np.random.default_rng(12)
    qa, qb = _operands(rng, 200, 300, 150, HBFP8, HBFP8, 6)
    c, bias = spread(rng, (200, 150)), spread(rng, (150,))
    got = K.gemm(T.from_bfp_tensor(qa, "cuda"), T.from_bfp_tensor(qb, "cuda"), fa=HBFP8, fb=HBFP8,
                 c=torch.from_numpy(c).cuda(), bias=torch.from_numpy(bias).cuda())
    assert same(got.view(torch.int32), gemm(qa, qb, c=c, bias=bias).view(np.int32))
    x = spread(rng, (100, 90))
    fmt = HBFP8.with_rounding("stochastic")
    codes, expo = K.quantize(torch.from_numpy(x).cuda(), fmt, seed=3)
    want = quantize(x, fmt, seed=3)
    assert same(codes, want.codes) and same(expo, want.exponents)
