"""Edges of the public API: operands with negative strides (NumPy views such as ``a[::-1]``)
give the bits of their contiguous copies on every path, and ``c`` or ``bias`` that are not
real numbers are refused with a TypeError, not silently converted."""

import numpy as np
import pytest

import hbfp.host as host
from hbfp import kernels
from hbfp.golden import HBFP8, quantize
from hbfp.golden.compare import same_bits
from hbfp.golden.gemm import gemm


def _views():
    rng = np.random.default_rng(11)
    a = rng.standard_normal((50, 40)).astype(np.float32)
    b = rng.standard_normal((40, 30)).astype(np.float32)
    return a[::-1], b[:, ::-1]  # negative strides along each axis


@pytest.mark.parametrize("impl", [i for i in kernels.IMPLS if kernels.available(i)])
def test_negative_strides_in_the_registry(impl):
    av, bv = _views()
    ac, bc = np.ascontiguousarray(av), np.ascontiguousarray(bv)
    qa, qb = kernels.quantize(av, HBFP8, impl=impl), kernels.quantize(bv, HBFP8, impl=impl)
    want_a, want_b = quantize(ac, HBFP8), quantize(bc, HBFP8)
    assert np.array_equal(qa[0], want_a.codes) and np.array_equal(qa[1], want_a.exponents)
    assert np.array_equal(qb[0], want_b.codes) and np.array_equal(qb[1], want_b.exponents)
    codes_view = (np.ascontiguousarray(qa[0][::-1])[::-1], qa[1])  # the codes themselves a reversed view
    got = kernels.gemm(codes_view, qb, fa=HBFP8, fb=HBFP8, impl=impl)
    assert same_bits(got, gemm(want_a, want_b))


@pytest.mark.parametrize("spec", ["emu", "emu:wire=1"])
@pytest.mark.parametrize("input", ["codes", "fp32"])
def test_negative_strides_on_the_device(spec, input):
    av, bv = _views()
    dev = host.open(spec)
    c = np.arange(50 * 30, dtype=np.float32).reshape(50, 30)[::-1] / 100
    want = dev.gemm(np.ascontiguousarray(av), np.ascontiguousarray(bv), c=np.ascontiguousarray(c), input=input)
    assert same_bits(dev.gemm(av, bv, c=c, input=input), want)
    assert same_bits(want, host.reference_gemm(dev.format(), av, bv, c=c, input=input))


@pytest.mark.parametrize("what", ["c", "bias"])
@pytest.mark.parametrize("bad", [np.complex64, "U1"])
def test_c_and_bias_must_be_real_numbers(what, bad):
    a = np.ones((20, 30), np.float32)
    shape = (20, 20) if what == "c" else (20,)
    value = np.ones(shape).astype(bad)
    dev = host.open("emu")
    for run in (lambda: dev.gemm(a, a.T, **{what: value}), lambda: host.reference_gemm(dev.format(), a, a.T, **{what: value})):
        with pytest.raises(TypeError, match=what):
            run()


def test_float64_under_offload_keeps_torchs_dtype_on_every_route():
    """Every routed product of float64 operands returns float64 (torch's dtype for them): the
    device's fp32 product of the operands rounded to fp32, widened exactly (a bias then added
    in float64, as torch adds it); gradients too."""
    import torch
    import torch.nn.functional as F

    import hbfp.torch as ht

    torch.manual_seed(0)
    a, b = torch.randn(30, 40, dtype=torch.float64), torch.randn(40, 20, dtype=torch.float64)
    w, bias = torch.randn(20, 40, dtype=torch.float64), torch.randn(20, dtype=torch.float64)
    ker = torch.randn(4, 3, 3, 3, dtype=torch.float64)
    routes = {"mm": lambda a, b: torch.mm(a, b), "matmul": lambda a, b: a @ b, "mv": lambda a, b: torch.mv(a, b[:, 0]),
              "linear": lambda a, b: F.linear(a, w.to(a.dtype)), "addmm": lambda a, b: torch.addmm(bias, a, b),
              "bmm": lambda a, b: torch.bmm(a[None].expand(2, -1, -1), b[None].expand(2, -1, -1)),
              "einsum": lambda a, b: torch.einsum("ik,kj->ij", a, b),
              "conv2d": lambda a, b: F.conv2d(a[:24].reshape(1, 3, 8, 40), ker.to(a.dtype))}
    device = host.open("emu")
    for name, f in routes.items():
        with ht.offload(device, recipe="nearest"):
            x = a.clone().requires_grad_()
            y64 = f(x, b)
            y64.sum().backward()
            y32 = (a.float() @ b.float()) if name == "addmm" else f(a.float(), b.float())
        assert y64.dtype == torch.float64 and x.grad.dtype == torch.float64, name
        assert torch.equal(y64, bias + y32.double() if name == "addmm" else y32.double()), name


def test_a_product_over_the_memory_limit_is_refused_before_any_allocation(monkeypatch):
    """Device.gemm, reference_gemm and the torch routes refuse (TooLarge, a MemoryError) a
    product whose codes and result would pass the limit, before anything is allocated."""
    import tracemalloc

    import torch

    import hbfp.torch as ht

    a = np.ones((600, 500), np.float32)
    dev = host.open("emu")
    assert host.memory_limit() > 0  # a quarter of the physical memory by default
    host.set_memory_limit(1 << 20)
    try:
        tracemalloc.start()
        for run in (lambda: dev.gemm(a, a.T), lambda: host.reference_gemm(dev.format(), a, a.T),
                    lambda: host.open("emu:wire=1").gemm(a, a.T)):
            before = tracemalloc.get_traced_memory()[0]
            with pytest.raises(host.TooLarge, match="limit"):
                run()
            assert tracemalloc.get_traced_memory()[0] - before < 100_000
        tracemalloc.stop()
        with ht.offload(dev), pytest.raises(MemoryError, match="limit"):
            torch.from_numpy(a) @ torch.from_numpy(a.T.copy())
        assert dev.gemm(a[:100, :100], a[:100, :100]).shape == (100, 100)  # below it
    finally:
        host.set_memory_limit(None)
    monkeypatch.setenv("HBFP_MEMORY_LIMIT", "12345")
    assert host.memory_limit() == 12345
    with pytest.raises(ValueError):
        host.set_memory_limit(0)
