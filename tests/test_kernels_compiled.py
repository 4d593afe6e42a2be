"""The compiled kernels (hbfp.kernels.build, src/*.c), every variant this CPU runs, against the
reference (hbfp.golden) bit for bit: the product on the edges of the register tiles and the
blocks, every storage order of the operands (transposed and sliced views), stacks, any number
of threads, the fused bias, activation and bf16 output; quantization of stacks; the
convolutions' patches; and the cache: a library that fails a check is rebuilt, never loaded,
and without the kernels (no compiler, or turned off) the portable paths give the same bits."""

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from hbfp import kernels
from hbfp.golden import HBFP8, HBFP16, MXINT8, BFPTensor, Format, bf16, quantize
from hbfp.golden.gemm import gemm as golden_gemm
from hbfp.kernels import build

VARIANTS = [pytest.param(v, marks=pytest.mark.skipif(not kernels.available(v), reason=f"{v}: {kernels.why(v)}"))
            for v in kernels.COMPILED]


def same(x, y) -> bool:
    x, y = np.asarray(x), np.asarray(y)
    if x.shape != y.shape:
        return False
    xn, yn = np.isnan(x), np.isnan(y)
    return np.array_equal(xn, yn) and np.array_equal(x[~xn].view(np.uint32), y[~yn].view(np.uint32))


def reference(qa, qb, **kw):
    return golden_gemm(qa, qb, impl="reference", **kw)


def operands(rng, m, k, n, fmt=HBFP8, spread=6):
    x = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-spread, spread + 1, (m, 1)))).astype(np.float32)
    y = (rng.standard_normal((k, n)) * np.exp2(rng.integers(-spread, spread + 1, (1, n)))).astype(np.float32)
    return quantize(x, fmt), quantize(y, fmt.transposed())


# Edges of the 6 x 16 register tile (6 x 32 for the VNNI tile), the 24-row and 512-column blocks,
# the K blocks (384 codes, or up to 4 MiB of packed panels: several only for a K this long beside
# few rows and columns), K-tiles that are not whole pairs or quads, and a long K.
SHAPES = [(1, 24, 1), (5, 48, 31), (6, 24, 16), (7, 72, 17), (13, 240, 64), (25, 250, 70), (64, 500, 600),
          (40, 9, 16), (30, 50, 48), (9, 4096, 16), (3, 24 * 40, 530), (100, 385, 33), (6, 24, 32),
          (12, 26, 33), (7, 51, 95), (97, 98, 64), (5, 3, 40), (4, 200_000, 5)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_products_equal_reference(variant, m, k, n):
    rng = np.random.default_rng(m * k + n)
    qa, qb = operands(rng, m, k, n)
    c = (rng.standard_normal((m, n)) * 1e3).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    for kw in ({}, {"c": c}, {"c": c, "bias": bias}):
        assert same(golden_gemm(qa, qb, impl=variant, **kw), reference(qa, qb, **kw))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", [MXINT8, Format(6, (3, 5)), Format(4, (2, 1)), Format(10, (4, 4)), Format(8, (5, 7)),
                                 HBFP16, Format(12, (24, 24))])
def test_other_formats_and_tiles(variant, fmt):
    rng = np.random.default_rng(5)
    qa, qb = operands(rng, 29, 7 * fmt.tile[1] - 1, 45, fmt)
    assert same(golden_gemm(qa, qb, impl=variant), reference(qa, qb))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_storage_order_and_sliced_views(variant):
    """A and B stored as they are, transposed (K x M, N x K), as column slices of a wider matrix
    and with a row step: the kernel reads each through its strides."""
    rng = np.random.default_rng(6)
    qa, qb = operands(rng, 50, 100, 70, spread=10)
    want = reference(qa, qb)
    at = BFPTensor(np.ascontiguousarray(qa.codes.T).T, np.ascontiguousarray(qa.exponents.T).T, qa.fmt)
    bt = BFPTensor(np.ascontiguousarray(qb.codes.T).T, np.ascontiguousarray(qb.exponents.T).T, qb.fmt)
    for a in (qa, at):
        for b in (qb, bt):
            assert same(golden_gemm(a, b, impl=variant), want)
    wide = np.zeros((100, 96), np.int8)
    wide[:, 3:73] = qb.codes
    b_slice = BFPTensor(wide[:, 3:73], qb.exponents, qb.fmt)
    assert same(golden_gemm(qa, b_slice, impl=variant), want)
    assert same(kernels.gemm((qa.codes, qa.exponents), (qb.codes[::-1][::-1], qb.exponents), fa=qa.fmt, fb=qb.fmt,
                             impl=variant), want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_int8_code_in_long_transposed_operands(variant):
    """Every int8 code, -128 (a raw operand's) included, in operands stored transposed over more
    rows than one packing chunk (96), with K-tiles that are not whole quads: the int8 tiles add
    128 to B's codes and take 128 times A's code sums back off, exactly."""
    rng = np.random.default_rng(16)
    m, k, n = 200, 7 * 24 + 5, 70
    ea = rng.integers(110, 140, (-(-m // 24), -(-k // 24))).astype(np.uint8)
    eb = rng.integers(110, 140, (-(-k // 24), -(-n // 24))).astype(np.uint8)
    ca = rng.integers(-128, 128, (m, k)).astype(np.int8)
    cb = rng.integers(-128, 128, (k, n)).astype(np.int8)
    ca[:, :24] = -128  # the extreme sums of a K-tile
    cb[:24, :] = -128
    want = reference(BFPTensor(ca, ea, HBFP8), BFPTensor(cb, eb, HBFP8))
    at = BFPTensor(np.ascontiguousarray(ca.T).T, ea, HBFP8)
    bt = BFPTensor(np.ascontiguousarray(cb.T).T, eb, HBFP8)
    for a in (BFPTensor(ca, ea, HBFP8), at):
        for b in (BFPTensor(cb, eb, HBFP8), bt):
            for threads in (1, 2):
                assert same(kernels.gemm(a, b, impl=variant, threads=threads), want)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_the_split_over_threads_keeps_the_bits(variant, threads):
    rng = np.random.default_rng(7)
    qa, qb = operands(rng, 300, 500, 700, spread=8)
    want = reference(qa, qb)
    assert same(kernels.gemm(qa, qb, impl=variant, threads=threads), want)
    x = (rng.standard_normal((500, 300)) * 10).astype(np.float32)
    fmt = HBFP8.with_rounding("stochastic")
    ref = quantize(x, fmt, seed=9, impl="reference")
    codes, exps = kernels.quantize(x, fmt, seed=9, impl=variant, threads=threads)
    assert np.array_equal(codes, ref.codes) and np.array_equal(exps, ref.exponents)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rounding", ["nearest_even", "toward_zero", "stochastic"])
def test_quantize_reads_any_strides(variant, rounding):
    """A transposed view (a gradient's transpose, read down its stored rows), a column slice and
    a view with a row step quantize as their contiguous copies do, stochastic positions
    included (they are the view's own), at 1 and 2 threads, NumPy and torch alike."""
    import torch

    rng = np.random.default_rng(17)
    base = (rng.standard_normal((130, 75)) * np.exp2(rng.integers(-8, 9, (130, 1)))).astype(np.float32)
    base[7, 3] = np.nan
    fmt = HBFP8.with_rounding(rounding)
    seed = 5 if rounding == "stochastic" else None
    # base[:, :67].T: a last band of 19 rows (8-row blocks and a tail), 130 columns (a tail)
    for view in (base.T, base[:, :67].T, base[:, 10:60], base[::2], base.T[::3, 1:]):
        ref = quantize(np.ascontiguousarray(view), fmt, seed=seed, impl="reference")
        for x in (view, torch.from_numpy(base).T if view is base.T else None):
            if x is None:
                continue
            for threads in (1, 2):
                codes, exps = kernels.quantize(x, fmt, seed=seed, impl=variant, threads=threads)
                assert np.array_equal(np.asarray(codes), ref.codes) and np.array_equal(np.asarray(exps), ref.exponents)
        if view is base.T:  # the lean path of torch tensors (impl=None)
            codes, exps = kernels.quantize(torch.from_numpy(base).T, fmt, seed=seed)
            assert np.array_equal(codes.numpy(), ref.codes) and np.array_equal(exps.numpy(), ref.exponents)


@pytest.mark.parametrize("variant", VARIANTS)
def test_stacks_equal_their_products(variant):
    rng = np.random.default_rng(8)
    nb, m, k, n = 5, 30, 70, 26
    x = rng.standard_normal((nb, m, k)).astype(np.float32)
    y = rng.standard_normal((nb, k, n)).astype(np.float32)
    ca, ea = kernels.quantize(x, HBFP8, impl=variant)
    cb, eb = kernels.quantize(y, HBFP8, impl=variant)
    c = rng.standard_normal((nb, m, n)).astype(np.float32)
    got = kernels.gemm((ca, ea), (cb, eb), fa=HBFP8, fb=HBFP8, c=c, impl=variant)
    for i in range(nb):
        qa, qb = quantize(x[i], HBFP8), quantize(y[i], HBFP8)
        assert np.array_equal(ca[i], qa.codes) and np.array_equal(ea[i], qa.exponents)
        assert same(got[i], reference(qa, qb, c=c[i]))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "leaky_relu"])
def test_fused_bias_activation_and_bf16_output(variant, activation):
    rng = np.random.default_rng(9)
    qa, qb = operands(rng, 40, 90, 33)
    bias = rng.standard_normal(33).astype(np.float32)
    bias[0] = np.float32(1e-40)  # a subnormal bias reads as zero
    for out in ("fp32", "bf16"):
        got = golden_gemm(qa, qb, bias=bias, activation=activation, out=out, impl=variant)
        want = reference(qa, qb, bias=bias, activation=activation, out=out)
        if out == "bf16":
            assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
        else:
            assert same(got, want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_accumulator_specials_and_in_place(variant):
    rng = np.random.default_rng(10)
    qa, qb = operands(rng, 20, 48, 20)
    c = rng.standard_normal((20, 20)).astype(np.float32)
    c[0, :5] = [np.nan, np.inf, -np.inf, -0.0, np.float32(1e-41)]
    want = reference(qa, qb, c=c)
    assert same(golden_gemm(qa, qb, c=c, impl=variant), want)
    assert np.isnan(want[0, 0]) and np.isposinf(want[0, 1]) and np.isneginf(want[0, 2])


@pytest.mark.parametrize("variant", VARIANTS)
def test_bad_arguments_are_refused(variant):
    lib = kernels._COMPILED[variant]
    qa, qb = operands(np.random.default_rng(0), 4, 30, 5)
    out = np.empty((4, 5), np.float32)
    with pytest.raises(TypeError, match="int8 or int16"):
        lib.gemm((qa.codes.astype(np.int32), qa.exponents), qa.fmt, (qb.codes, qb.exponents), qb.fmt, out)
    with pytest.raises(ValueError, match="exponents"):
        lib.gemm((qa.codes, qa.exponents[:, :1]), qa.fmt, (qb.codes, qb.exponents), qb.fmt, out)
    with pytest.raises(ValueError, match="out must be"):
        lib.gemm((qa.codes, qa.exponents), qa.fmt, (qb.codes, qb.exponents), qb.fmt, np.empty((4, 4), np.float32))
    with pytest.raises(ValueError, match="agree along K"):
        lib.gemm((qa.codes, qa.exponents), qa.fmt, (qb.codes[:20], qb.exponents), qb.fmt, out)
    with pytest.raises(ValueError, match="negative strides"):
        lib.gemm((qa.codes[::-1], qa.exponents), qa.fmt, (qb.codes, qb.exponents), qb.fmt, out)


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
    got = kernels.im2col(x, kernel, stride, padding, dilation)
    assert torch.equal(got, want)
    g = (torch.randn(*want.shape, generator=torch.Generator().manual_seed(1)) * 1e3).contiguous()
    folded = F.fold(g.reshape(shape[0], -1, g.shape[1]).transpose(1, 2), shape[2:], kernel, dilation=dilation,
                    padding=padding, stride=stride)
    back = kernels.col2im(g, shape, kernel, stride, padding, dilation)
    assert same(back.numpy(), folded.numpy())  # the same additions in the same order
    # the matrix stored transposed (a product's transposed output), read where it lies
    gt = g.t().contiguous().t()
    assert same(kernels.col2im(gt, shape, kernel, stride, padding, dilation).numpy(), folded.numpy())
    assert same(kernels.col2im(gt.numpy(), shape, kernel, stride, padding, dilation), folded.numpy())


@pytest.mark.parametrize("shape, kernel, stride, padding, dilation", CONVS + [((4, 6, 13, 13), (3, 3), (1, 1), (1, 1), (1, 1))])
@pytest.mark.parametrize("rounding", ["nearest_even", "stochastic"])
def test_patches_quantized_from_the_image_equal_the_quantized_patches(shape, kernel, stride, padding, dilation,
                                                                       rounding):
    """im2col_quantize (each 24-row band of the patch matrix gathered into the cache, runs of
    8 positions x 8 columns through the registers, masked at the image's edges) gives the
    golden quantization of torch's unfold, stochastic positions included."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3)) * 4
    fmt = HBFP8.with_rounding(rounding)
    seed = 11 if rounding == "stochastic" else None
    cols = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
    patches = cols.transpose(1, 2).reshape(-1, cols.shape[1]).contiguous().numpy()
    ref = quantize(patches, fmt, seed=seed, impl="reference")
    codes, exps = kernels.im2col_quantize(x, kernel, stride, padding, dilation, fmt, seed=seed)
    assert np.array_equal(codes.numpy(), ref.codes) and np.array_equal(exps.numpy(), ref.exponents)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape, kernel, stride, padding, dilation", CONVS[:4])
def test_conv_runs_equal_the_whole_products(variant, shape, kernel, stride, padding, dilation):
    """conv_runs, a convolution's product a run of images at a time (the runs side by side on
    the threads, each product on one thread into its own buffer): the golden product of the
    whole matrices, then col2im of it (``fold``) or its planes plus the bias in fp32 (torch's
    addition), bit for bit, on 1 to 3 threads and runs of 1, 2 or every image; a NaN tile
    included."""
    import torch

    lib = kernels._COMPILED[variant]
    g = kernels.conv_geometry(shape, kernel, stride, padding, dilation)
    n, c, positions, ckk, out_ch = g[0], g[1], g[0] * g[12] * g[13], g[1] * g[4] * g[5], 7
    rng = np.random.default_rng(positions)
    fmt = HBFP8

    def stored(x):  # codes and exponents as torch tensors, and the golden operand
        q = quantize(x, fmt)
        return torch.from_numpy(q.codes), torch.from_numpy(q.exponents), q

    rows = (rng.standard_normal((positions, out_ch)) * 8).astype(np.float32)  # an output gradient
    wt = rng.standard_normal((ckk, out_ch)).astype(np.float32)  # W^T, C*KH*KW x OUT
    wt[:3, :2] = np.nan
    cr, er, qr = stored(rows)
    cw, ew, qw = stored(wt)
    want_fold = kernels.col2im(np.ascontiguousarray(golden_gemm(qw, qr.T).T), shape, kernel, stride,
                               padding, dilation)
    patches = rng.standard_normal((positions, ckk)).astype(np.float32)
    w = rng.standard_normal((out_ch, ckk)).astype(np.float32)
    bias = torch.from_numpy(rng.standard_normal(out_ch).astype(np.float32))
    cp, ep, qp = stored(patches)
    cv, ev, qv = stored(w)
    sums = torch.from_numpy(golden_gemm(qv, qp.T))  # OUT x positions
    want_planes = (sums + bias[:, None]).reshape(out_ch, n, -1).transpose(0, 1).reshape(n, out_ch, g[12], g[13])
    bound = kernels._code_bound(cp.numpy(), fmt)  # int8 codes: 127
    for threads in (1, 2, 3):
        for run_images in sorted({1, 2, n}):
            grad = torch.full(shape, 7.0)
            lib.conv_runs(cw, ew, fmt, cr.t(), er.t(), fmt.transposed(), run_images, None, g, grad, True, threads,
                          bound, bound)
            assert same(grad.numpy(), want_fold), (threads, run_images)
            out = torch.full((n, out_ch, g[12], g[13]), 7.0)
            lib.conv_runs(cv, ev, fmt, cp.t(), ep.t(), fmt.transposed(), run_images, bias, g, out, False, threads,
                          bound, bound)
            assert same(out.numpy(), want_planes.numpy()), (threads, run_images)
            lib.conv_runs(cv, ev, fmt, cp.t(), ep.t(), fmt.transposed(), run_images, None, g, out, False, threads,
                          bound, bound)
            assert same(out.numpy(), sums.reshape(out_ch, n, -1).transpose(0, 1).reshape(out.shape).numpy())
    with pytest.raises(ValueError):  # a fold's rows are C*KH*KW
        lib.conv_runs(cv, ev, fmt, cp.t(), ep.t(), fmt.transposed(), 1, None, g, torch.empty(shape), True, 1, bound,
                      bound)


@pytest.mark.parametrize("shape", [(32, 1024, 64), (3, 5, 7), (2, 17, 9), (1, 33, 40), (4, 8, 8), (2, 100, 3), (0, 4, 4)])
def test_transpose_equals_a_copy_of_the_transposed_view(shape):
    """kernels.transpose (a convolution's rows to the image and back): the blocks of 8 x 8 in
    registers and every edge past them, NumPy and torch alike."""
    import torch

    x = np.random.default_rng(19).standard_normal(shape).astype(np.float32)
    assert np.array_equal(kernels.transpose(x), np.ascontiguousarray(np.swapaxes(x, 1, 2)))
    t = torch.from_numpy(x)
    got = kernels.transpose(t)
    assert got.is_contiguous() and torch.equal(got, t.transpose(1, 2).contiguous())
    with pytest.raises(ValueError, match="3 axes"):
        kernels.transpose(x.reshape(-1))


def test_conv_geometry_is_checked():
    x = np.zeros((1, 1, 4, 4), np.float32)
    with pytest.raises(ValueError, match="no convolution output"):
        kernels.im2col(x, (5, 5), (1, 1), (0, 0), (1, 1))
    with pytest.raises(ValueError, match="16 x 9"):
        kernels.col2im(np.zeros((16, 8), np.float32), (1, 1, 4, 4), (3, 3), (1, 1), (1, 1), (1, 1))


def test_the_cpu_features_decide_the_variants():
    feats = build.features()
    assert kernels.available("c") == (build.load("c") is not None)
    if "avx2" not in feats:
        assert not kernels.available("avx2") and "lacks avx2" in kernels.why("avx2")
    for v in build.VARIANTS:
        lib = build.load(v.name)
        if lib is not None:
            assert lib.hbfp_isa().decode() == v.name


# ---- the cache ------------------------------------------------------------------------------

_PROBE = """
import numpy as np, warnings
from hbfp import kernels
from hbfp.golden import HBFP8, quantize
from hbfp.golden.gemm import gemm
rng = np.random.default_rng(1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    a = quantize(rng.standard_normal((30, 50)).astype(np.float32))
    b = quantize(rng.standard_normal((50, 20)).astype(np.float32))
    y = gemm(a, b)
for w in caught:
    print("WARNING", w.message)
print(kernels.available("c"))
print(kernels.why("c"))
print(y.view(np.uint32).sum())
"""


def _probe(env, cache):
    full = {**os.environ, "HBFP_CACHE": str(cache), "HBFP_KERNELS": "c", **env}  # one build: the portable one
    r = subprocess.run([sys.executable, "-c", _PROBE], env=full, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory):
    """A cache with the portable build in it (built once for the tests below)."""
    cache = tmp_path_factory.mktemp("kernel-cache")
    assert _probe({}, cache)[0] == "True"
    return cache


def _copy_cache(src, dst):
    import shutil

    shutil.copytree(src, dst)
    os.chmod(dst, stat.S_IRWXU)
    return dst


def test_without_the_kernels_the_portable_paths_give_the_same_bits(tmp_path, built_cache):
    on = _probe({}, _copy_cache(built_cache, tmp_path / "on"))
    off = _probe({"HBFP_NATIVE": "0"}, tmp_path / "off")
    no_cc = _probe({"CC": "no-such-compiler-hbfp"}, tmp_path / "nocc")
    assert on[0] == "True" and on[1] == "None"
    assert off[0] == "False" and "HBFP_NATIVE=0" in off[1]  # turned off on purpose: no warning
    assert no_cc[0].startswith("WARNING") and "no-such-compiler-hbfp" in no_cc[0]  # one warning, the reason
    assert no_cc[1] == "False" and "no-such-compiler-hbfp" in no_cc[2]
    assert on[2] == off[2] == no_cc[3]
    assert any(p.name.startswith("hbfp-kernels-c-") for p in (tmp_path / "on").iterdir())


def test_a_cached_library_that_fails_a_check_is_rebuilt_not_loaded(tmp_path, built_cache):
    cache = _copy_cache(built_cache, tmp_path / "cache")
    libs = sorted(p for p in cache.iterdir() if p.name.startswith("hbfp-kernels-c-"))
    assert libs
    lib = libs[0]
    # A library replaced by other content: its name's hash no longer matches. Its constructor
    # would run on load; it must not.
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.c"
    evil.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void f(void) {{ FILE *o = fopen("{marker}", "w"); if (o) fclose(o); }}\n')
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", str(lib), str(evil)], check=True)
    out = _probe({}, cache)
    assert out[0] == "True" and not marker.exists()
    fresh = sorted(p for p in cache.iterdir() if p.name.startswith("hbfp-kernels-c-"))
    assert all(build._verified(p) is not None for p in fresh)
    # A library others may write is not loaded either (it is rebuilt instead).
    os.chmod(fresh[0], 0o777)
    assert build._verified(fresh[0]) is None
    os.chmod(fresh[0], 0o700)
    assert build._verified(fresh[0]) is not None
    # A cache directory others may write is not used at all.
    os.chmod(cache, 0o777)
    out = _probe({}, cache)
    assert out[1] == "False" and "other users" in out[2]
    os.chmod(cache, stat.S_IRWXU)


def test_the_compiler_runs_under_a_time_limit(tmp_path):
    slow = tmp_path / "slowcc"
    slow.write_text("#!/bin/sh\nsleep 30\n")
    slow.chmod(0o755)
    out = _probe({"CC": str(slow), "HBFP_CC_TIMEOUT": "1"}, tmp_path / "cache")
    assert out[0].startswith("WARNING")
    assert out[1] == "False" and ("more than 1 s" in out[2] or "slowcc" in out[2])


_THREADS_PROBE = """
import numpy as np
from hbfp import kernels
from hbfp.golden import HBFP8, quantize
from hbfp.golden.gemm import gemm
rng = np.random.default_rng(2)
a = quantize(rng.standard_normal((300, 400)).astype(np.float32))
b = quantize(rng.standard_normal((400, 500)).astype(np.float32))
one = kernels.gemm(a, b, threads=1)
two = kernels.gemm(a, b, threads=2)
three = kernels.gemm(a, b, threads=3)
ref = gemm(a, b, impl="reference")
print(all(np.array_equal(x.view(np.uint32), ref.view(np.uint32)) for x in (one, two, three)))
"""


def test_the_pool_without_openmp_keeps_the_bits(tmp_path, built_cache):
    """Where the compiler has no OpenMP the kernels' own thread pool shares the work out: the
    same bits on any number of threads (built here with HBFP_OPENMP=0)."""
    env = {**os.environ, "HBFP_CACHE": str(_copy_cache(built_cache, tmp_path / "cache")), "HBFP_KERNELS": "c",
           "HBFP_OPENMP": "0"}
    r = subprocess.run([sys.executable, "-c", _THREADS_PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"


def _same_or_both_nan(x, y) -> bool:
    """The same bits, or NaN in both (whatever their sign and payload)."""
    xn, yn = np.isnan(x.numpy()), np.isnan(y.numpy())
    return np.array_equal(xn, yn) and np.array_equal(x.numpy()[~xn].view(np.int32), y.numpy()[~yn].view(np.int32))


@pytest.mark.parametrize("variant", VARIANTS)
def test_lstm_cell_equals_its_torch_operations_and_torchs_functions(variant):
    """src/cell.c's LSTM cell, forward and backward, gives the bits of the same operations in
    torch (torch_ops.lstm_cell, the portable path) on every build, extreme and special gates
    included; its sigmoid and tanh are within 4 ulp of torch's (outside the clamp of exp)."""
    torch = pytest.importorskip("torch")
    from hbfp.kernels import torch_ops

    lib = kernels._COMPILED[variant]
    g = torch.Generator().manual_seed(3)
    rows, hid = 7, 37  # (not whole vectors)
    p = torch.randn(rows, 4 * hid, generator=g) * 6
    p[0, :12] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0, 100.0, -100.0, float("nan"), float("inf"),
                              -float("inf"), 0.624])
    xp = torch.randn(rows, 4 * hid, generator=g)
    cp = torch.randn(rows, hid, generator=g) * 3
    mine = [torch.empty(rows, 4 * hid), *(torch.empty(rows, hid) for _ in range(3))]
    theirs = [torch.empty_like(t) for t in mine]
    lib.lstm_cell(p, xp, cp, *mine)
    torch_ops.lstm_cell(p, xp, cp, *theirs)
    assert all(_same_or_both_nan(a, b) for a, b in zip(mine, theirs))
    acts, c, tc, h = mine
    dy, dh, dc = (torch.randn(rows, hid, generator=g) for _ in range(3))
    mine_b = [torch.empty(rows, 4 * hid), torch.empty(rows, hid)]
    theirs_b = [torch.empty_like(t) for t in mine_b]
    lib.lstm_cell_backward(acts, cp, tc, dy, dh, dc, *mine_b)
    torch_ops.lstm_cell_backward(acts, cp, tc, dy, dh, dc, *theirs_b)
    assert all(_same_or_both_nan(a, b) for a, b in zip(mine_b, theirs_b))
    # the nonlinearities beside torch's
    x = torch.cat([torch.linspace(-80, 80, 100_001), torch.logspace(-30, 1, 10_001), -torch.logspace(-30, 1, 10_001)])

    def ulps(a, b):
        return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max().item()

    assert ulps(torch_ops._tanh_f(x), torch.tanh(x)) <= 4 and ulps(torch_ops._sigmoid_f(x), torch.sigmoid(x)) <= 4
