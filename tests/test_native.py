"""hbfp.golden.native (the K-tile loop compiled for this CPU) against the K-tile sums computed
independently: every K-tile's exact sum in float64 BLAS, added to the fp32 accumulator in
K-tile order. Edges of the register blocks and packing buffers, strided operands, the split over
threads, special accumulator values, bad arguments, and the fallback when nothing can build."""

import os
import subprocess
import sys

import numpy as np
import pytest

from hbfp.golden import HBFP8, HBFP16, MXINT8, Format, bfp, quantize
from hbfp.golden import gemm as gemm_mod
from hbfp.golden import native

from .stubs import NoNative

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no compiled kernels: {native.why()}")


def operands(rng, m, k, n, fmt=HBFP8, spread=6):
    """Two stored operands, A m x K and B K x n, in ``fmt`` (B's tile transposed to agree along K)."""
    x = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-spread, spread + 1, (m, 1)))).astype(np.float32)
    y = (rng.standard_normal((k, n)) * np.exp2(rng.integers(-spread, spread + 1, (1, n)))).astype(np.float32)
    return quantize(x, fmt), quantize(y, fmt.transposed())


def reference(qa, qb, acc):
    """Every K-tile's sum of the scaled codes in float64 (exact), added to fp32 ``acc`` in order."""
    (m, k), n = qa.shape, qb.shape[1]
    tk = qa.fmt.tile[1]
    kp = -(-k // tk) * tk
    a = gemm_mod._scaled(qa, (qa.exponents.shape[0] * qa.fmt.tile[0], kp))[:m]
    b = gemm_mod._scaled(qb, (kp, qb.exponents.shape[1] * qb.fmt.tile[1]))[:, :n]
    out = acc.copy()
    for t in range(kp // tk):
        ks = slice(t * tk, (t + 1) * tk)
        p = a[:, ks].astype(np.float64) @ b[ks].astype(np.float64)
        assert np.array_equal(p.astype(np.float32).astype(np.float64), p)  # exact in fp32
        out = out + p.astype(np.float32)  # one fp32 rounding per K-tile, in order
    return out


def same(x, y):
    return np.array_equal(x.view(np.int32), y.view(np.int32))


def run(qa, qb, acc):
    native.gemm_codes(qa.codes, qa.exponents, qa.fmt, qb.codes, qb.exponents, qb.fmt, acc)


SHAPES = [(1, 24, 1), (5, 48, 31), (6, 24, 32), (7, 72, 33), (13, 240, 64), (100, 250, 70), (64, 500, 600),
          (40, 9, 16), (30, 50, 48), (9, 4096, 16),
          (3, 24 * 400, 40)]  # the last: packed B over all of K needs several column blocks


@pytest.mark.parametrize("m, k, n", SHAPES)
def test_k_tile_sums_in_order(m, k, n):
    rng = np.random.default_rng(m * k + n)
    qa, qb = operands(rng, m, k, n)
    acc = (rng.standard_normal((m, n)) * 1e3).astype(np.float32)
    want = reference(qa, qb, acc)
    run(qa, qb, acc)
    assert same(acc, want)


@pytest.mark.parametrize("fmt", [Format(8, (1, 32)), Format(6, (3, 5)), Format(4, (2, 1)), Format(10, (4, 4)),
                                 Format(8, (5, 7))])
def test_other_formats_and_tiles(fmt):
    rng = np.random.default_rng(5)
    qa, qb = operands(rng, 29, 7 * fmt.tile[1] - 1, 45, fmt)
    if fmt.mantissa_bits > 8:
        assert qa.codes.dtype == np.int16
    acc = np.zeros((29, 45), np.float32)
    want = reference(qa, qb, acc)
    run(qa, qb, acc)
    assert same(acc, want)


def test_transposed_operands_and_a_strided_accumulator():
    rng = np.random.default_rng(6)
    sa = operands(rng, 96, 24, 1)[0]  # A stored K x M, used transposed: 24 x 96
    qb = operands(rng, 1, 96, 40)[1]
    sb = operands(rng, 40, 96, 1)[0]  # B stored N x K, used transposed
    a_view = (sa.codes.T, sa.exponents.T, sa.fmt.transposed())  # views, as torch's .t() hands them over
    assert not a_view[0].flags.c_contiguous
    for b, b_view in ((qb, (qb.codes, qb.exponents, qb.fmt)), (sb.transpose(), (sb.codes.T, sb.exponents.T, sb.fmt))):
        big = np.full((30, 90), 7.0, np.float32)
        acc = big[3:27, 11:51]
        want = reference(sa.transpose(), b, acc)
        native.gemm_codes(*a_view, *b_view, acc)
        assert same(acc, want)
        rest = big.copy()
        rest[3:27, 11:51] = 7.0
        assert (rest == 7.0).all()


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("split", ["columns", "rows"])
def test_the_split_over_threads_keeps_the_bits(split, threads):
    rng = np.random.default_rng(7)
    m, n = (40, 700) if split == "columns" else (90, 30)
    qa, qb = operands(rng, m, 120, n)
    acc = np.zeros((m, n), np.float32)
    want = reference(qa, qb, acc)
    native.gemm_codes(qa.codes, qa.exponents, qa.fmt, qb.codes, qb.exponents, qb.fmt, acc, threads=threads)
    assert same(acc, want)


def test_infinities_and_nans_of_the_accumulator_stay():
    rng = np.random.default_rng(8)
    qa, qb = operands(rng, 8, 48, 40)
    acc = np.zeros((8, 40), np.float32)
    acc[0, 0], acc[1, 1], acc[2, 2] = np.inf, -np.inf, np.nan
    run(qa, qb, acc)
    assert acc[0, 0] == np.inf and acc[1, 1] == -np.inf and np.isnan(acc[2, 2])
    assert np.isfinite(np.delete(acc.ravel(), [0, 41, 82])).all()


def test_bad_arguments_are_refused():
    rng = np.random.default_rng(9)
    qa, qb = operands(rng, 4, 48, 5)
    with pytest.raises(ValueError, match="acc has shape"):
        run(qa, qb, np.zeros((4, 6), np.float32))
    with pytest.raises(ValueError, match="do not agree along K"):
        run(qa, operands(rng, 4, 47, 5)[1], np.zeros((4, 5), np.float32))
    with pytest.raises(ValueError, match="float32"):
        run(qa, qb, np.zeros((4, 5), np.float64))
    with pytest.raises(ValueError, match="contiguous rows"):
        run(qa, qb, np.zeros((5, 4), np.float32).T)
    with pytest.raises(ValueError, match="a_codes must be a matrix"):
        native.gemm_codes(qa.codes.astype(np.float32), qa.exponents, qa.fmt, qb.codes, qb.exponents, qb.fmt,
                          np.zeros((4, 5), np.float32))
    with pytest.raises(ValueError, match="b_exps has shape"):
        native.gemm_codes(qa.codes, qa.exponents, qa.fmt, qb.codes, qb.exponents[:1], qb.fmt,
                          np.zeros((4, 5), np.float32))
    with pytest.raises(ValueError, match="writeable"):
        acc = np.zeros((4, 5), np.float32)
        acc.flags.writeable = False
        run(qa, qb, acc)


@pytest.mark.parametrize("rounding", bfp.ROUNDINGS)
@pytest.mark.parametrize("fmt", [HBFP8, HBFP16, MXINT8, Format(6, (3, 5)), Format(2, (1, 1))])
def test_quantize_equals_the_numpy_bands(monkeypatch, fmt, rounding):
    """Every exponent range (subnormals, NaN and inf tiles, zeros of both signs), ragged edges,
    a strided input, both the single-thread and the banded split."""
    fmt = fmt.with_rounding(rounding)
    rng = np.random.default_rng(fmt.mantissa_bits)
    for shape in [(1, 1), (50, 70), (24, 24), (97, 33), (300, 500), (300, 16), (50, 9)]:
        with np.errstate(over="ignore"):
            x = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-40, 40, shape)).astype(np.float32)
        x[rng.random(shape) < 0.05] = 0.0
        x[rng.random(shape) < 0.01] = -0.0
        x[rng.random(shape) < 0.02] = np.float32(1e-40)
        if shape[0] > 30:
            x[31, 5] = np.nan
            x[-1, -1] = -np.inf
        for view in (x, x.T.copy().T):
            got = quantize(view, fmt, seed=shape[0])
            with monkeypatch.context() as mp:
                mp.setattr(bfp, "native", NoNative)
                want = quantize(view, fmt, seed=shape[0])
            assert got.codes.dtype == want.codes.dtype
            assert np.array_equal(got.codes, want.codes) and np.array_equal(got.exponents, want.exponents)
    key = None if fmt.rounding != "stochastic" else int(bfp._key(3))
    codes, exps = native.quantize(x, fmt, key, threads=2)
    monkeypatch.setattr(bfp, "native", NoNative)
    want = quantize(x, fmt, seed=3)
    assert np.array_equal(codes, want.codes) and np.array_equal(exps, want.exponents)


def _in_subprocess(env_extra, tmp_path):
    code = ("from hbfp.golden import native, HBFP8, quantize; from hbfp.golden.gemm import gemm; import numpy as np\n"
            "x = np.arange(48 * 30, dtype=np.float32).reshape(48, 30) / 7\n"
            "print(native.available()); print(native.why())\n"
            "print(gemm(quantize(x, HBFP8), quantize(x.T.copy(), HBFP8)).tobytes().hex()[:64])\n")
    env = {**os.environ, "HBFP_CACHE": str(tmp_path), **env_extra}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return r.stdout.splitlines()


def test_without_a_compiler_the_portable_path_gives_the_same_bits(tmp_path):
    on = _in_subprocess({}, tmp_path / "on")
    off = _in_subprocess({"HBFP_NATIVE": "0"}, tmp_path / "off")
    no_cc = _in_subprocess({"CC": "no-such-compiler-hbfp"}, tmp_path / "nocc")
    assert on[0] == "True" and on[1] == "None"
    assert off[0] == "False" and "HBFP_NATIVE=0" in off[1]
    assert no_cc[0] == "False" and "no-such-compiler-hbfp" in no_cc[1]
    assert on[2] == off[2] == no_cc[2]
    assert any(p.name.startswith("hbfp_native-") for p in (tmp_path / "on").iterdir())


CONVS = [((64, 16, 8, 8), (3, 3), (1, 1), (1, 1), (1, 1)), ((3, 5, 11, 9), (3, 2), (2, 1), (2, 0), (1, 2)),
         ((2, 3, 7, 7), (5, 5), (2, 2), (2, 2), (1, 1)), ((1, 2, 9, 9), (3, 3), (3, 3), (0, 0), (2, 2)),
         ((2, 2, 5, 5), (3, 3), (1, 1), (4, 4), (1, 1)), ((1, 1, 4, 4), (2, 2), (3, 3), (1, 1), (3, 3))]


@pytest.mark.parametrize("shape, kernel, stride, padding, dilation", CONVS)
def test_im2col_and_col2im_equal_torchs_unfold_and_fold(shape, kernel, stride, padding, dilation):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[2]))
    cols = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
    want = cols.transpose(1, 2).reshape(-1, cols.shape[1])
    got = native.im2col(x.numpy(), kernel, stride, padding, dilation)
    assert np.array_equal(got, want.numpy())
    g = (torch.randn(*want.shape, generator=torch.Generator().manual_seed(1)) * 1e3).contiguous()
    folded = F.fold(g.reshape(shape[0], -1, g.shape[1]).transpose(1, 2), shape[2:], kernel, dilation=dilation,
                    padding=padding, stride=stride)
    back = native.col2im(g.numpy(), shape, kernel, stride, padding, dilation)
    assert same(back, folded.numpy())  # the same additions in the same order


def test_conv_geometry_and_layout_are_checked():
    x = np.zeros((1, 1, 4, 4), np.float32)
    with pytest.raises(ValueError, match="no convolution output"):
        native.im2col(x, (5, 5), (1, 1), (0, 0), (1, 1))
    with pytest.raises(ValueError, match="contiguous"):
        native.im2col(x.astype(np.float64), (3, 3), (1, 1), (1, 1), (1, 1))
    with pytest.raises(ValueError, match="16 x 9"):
        native.col2im(np.zeros((16, 8), np.float32), (1, 1, 4, 4), (3, 3), (1, 1), (1, 1), (1, 1))


@pytest.mark.parametrize("fmt", [HBFP8, HBFP16, MXINT8, Format(6, (3, 5))])
def test_dequantize_equals_the_numpy_model(fmt):
    rng = np.random.default_rng(11)
    with np.errstate(over="ignore"):
        x = (rng.standard_normal((61, 70)) * 10.0 ** rng.uniform(-40, 40, (61, 70))).astype(np.float32)
    x[0, :3] = [np.nan, np.float32(2.0**-125), np.float32(3e38)]
    t = quantize(x, fmt)
    t.exponents[1 % t.exponents.shape[0], 0] = 2  # values at the bottom of fp32's range: flushed
    t.exponents[2 % t.exponents.shape[0], 0] = 0  # codes under exponent code 0: below 2**-126
    got = native.dequantize(t.codes, t.exponents, fmt)
    assert same(got, t.dequantize())
    assert same(native.dequantize(np.asfortranarray(t.codes), t.exponents, fmt), t.dequantize())


def test_dead_tiles_hold_codes_reads_the_tiles_of_exponent_code_zero():
    rng = np.random.default_rng(12)
    t = quantize(rng.standard_normal((50, 70)).astype(np.float32), HBFP8)
    codes, exps = t.codes.copy(), t.exponents.copy()

    def check(c, e):
        return native.dead_tiles_hold_codes((c.ctypes.data, c.itemsize, c.strides[0] // c.itemsize,
                                             c.strides[1] // c.itemsize), *c.shape,
                                            (e.ctypes.data, e.strides[0], e.strides[1]), (24, 24))

    assert not check(codes, exps)
    exps[2, 1] = 0  # a tile of exponent code 0 whose codes are nonzero (rows 48..49, columns 24..47)
    assert check(codes, exps)
    codes[48:, 24:48] = 0
    assert not check(codes, exps)
    codes[49, 47] = -1
    assert check(codes, exps)
    assert check(np.ascontiguousarray(codes.T).T, exps)  # a transposed layout reads the same codes
