"""hbfp.torch against the golden model: forward and both backward products bit for bit."""

import numpy as np
import pytest
import torch

import hbfp.torch as ht
from hbfp.host.device import reference_gemm


def bits(t):
    return np.asarray(t.detach().numpy() if isinstance(t, torch.Tensor) else t, np.float32).view(np.uint32)


@pytest.fixture
def dev():
    return ht.default_device()


def test_matmul_forward_and_backward_equal_golden(dev):
    fmt = dev.format()
    g = torch.Generator().manual_seed(0)
    a = torch.randn(40, 70, generator=g, requires_grad=True)
    b = torch.randn(70, 30, generator=g, requires_grad=True)
    y = ht.matmul(a, b, dev)
    grad = torch.randn(40, 30, generator=g)
    y.backward(grad)
    A, B, G = a.detach().numpy(), b.detach().numpy(), grad.numpy()
    assert np.array_equal(bits(y), bits(reference_gemm(fmt, A, B)))
    # grad_a = grad @ b^T (b stored as in the forward product), grad_b = a^T @ grad
    assert np.array_equal(bits(a.grad), bits(reference_gemm(fmt, G, B, transpose_b=True)))
    assert np.array_equal(bits(b.grad), bits(reference_gemm(fmt, A, G, transpose_a=True)))
    # HBFP8 is close to fp32 but not equal to it
    assert not np.array_equal(bits(y), bits(a.detach() @ b.detach()))
    assert torch.allclose(y, a.detach() @ b.detach(), rtol=0.1, atol=0.5)


def test_linear_and_convert(dev):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    weights = [model[0].weight, model[2].weight]
    ht.convert(model)
    assert isinstance(model[0], ht.Linear) and isinstance(model[2], ht.Linear)
    assert model[0].weight is weights[0] and model[2].weight is weights[1]  # parameters kept
    x = torch.randn(8, 20)
    y = model(x)
    fmt = dev.format()
    h = reference_gemm(fmt, x.numpy(), weights[0].detach().numpy(), transpose_b=True) + model[0].bias.detach().numpy()
    h = np.maximum(h, 0)
    want = reference_gemm(fmt, h, weights[1].detach().numpy(), transpose_b=True) + model[2].bias.detach().numpy()
    assert np.array_equal(bits(y), bits(want))
    y.sum().backward()
    assert model[0].weight.grad is not None and model[0].weight.grad.shape == (16, 20)


def test_conv2d_is_an_im2col_product(dev):
    torch.manual_seed(2)
    ref = torch.nn.Conv2d(3, 5, 3, padding=1)
    conv = ht.Conv2d(3, 5, 3, padding=1)
    conv.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 6, 6)
    y = conv(x)
    assert y.shape == ref(x).shape
    cols = torch.nn.functional.unfold(x, 3, padding=1).transpose(1, 2).reshape(2 * 36, -1).numpy()
    w = conv.weight.detach().reshape(5, -1).numpy()
    want = reference_gemm(dev.format(), cols, w, transpose_b=True) + conv.bias.detach().numpy()
    want = torch.from_numpy(want).reshape(2, 36, 5).transpose(1, 2).reshape(2, 5, 6, 6)
    assert np.array_equal(bits(y), bits(want))
    assert torch.allclose(y, ref(x), rtol=0.05, atol=0.1)


def test_offload_routes_an_unchanged_model(dev):
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    x = torch.randn(6, 12)
    fp32 = model(x)
    with ht.offload(dev) as d:
        assert d is dev and ht.get_matmul_precision() == "hbfp8"
        y = model(x)
        mm = torch.mm(x, model[0].weight.t())
        at = x @ model[0].weight.t()
        add = torch.addmm(model[0].bias, x, model[0].weight.t())
        bmm = torch.bmm(x.reshape(2, 3, 12), model[0].weight.t().expand(2, 12, 10))
    assert ht.get_matmul_precision() == "highest"
    fmt = dev.format()
    first = reference_gemm(fmt, x.numpy(), model[0].weight.detach().numpy().T.copy())
    assert np.array_equal(bits(mm), bits(first)) and np.array_equal(bits(at), bits(first))
    assert np.array_equal(bits(add), bits(torch.from_numpy(first) + model[0].bias.detach()))
    assert np.array_equal(bits(bmm.reshape(6, 10)[:3]), bits(reference_gemm(fmt, x.numpy()[:3], model[0].weight.detach().numpy().T.copy())))
    assert not np.array_equal(bits(y), bits(fp32))
    assert torch.allclose(y, fp32, rtol=0.05, atol=0.05)
    # Outside the context the same model is plain fp32 again.
    assert np.array_equal(bits(model(x)), bits(fp32))
    # Backward through the offloaded forward works.
    with ht.offload(dev):
        model(x).sum().backward()
    assert model[0].weight.grad is not None


def test_precision_knob_is_safe_under_exceptions():
    assert ht.get_matmul_precision() == "highest"
    with pytest.raises(RuntimeError, match="boom"):
        with ht.offload():
            assert ht.get_matmul_precision() == "hbfp8"
            raise RuntimeError("boom")
    assert ht.get_matmul_precision() == "highest"
    with pytest.raises(ValueError, match="precision"):
        ht.set_matmul_precision("tf32")
    # Inside offload, "highest" turns the routing off for a block, and comes back after it.
    x, w = torch.randn(30, 60), torch.randn(60, 30)
    fp32 = x @ w
    with ht.offload():
        assert not np.array_equal(bits(x @ w), bits(fp32))  # routed to the device
        with pytest.raises(KeyError):
            with ht.matmul_precision("highest"):
                assert np.array_equal(bits(x @ w), bits(fp32))  # plain torch again
                raise KeyError("inner")
        assert ht.get_matmul_precision() == "hbfp8"
    assert ht.get_matmul_precision() == "highest"


class ExactDevice:
    """A stand-in device with quantization off: exact fp64 products with the driver's
    ``gemm`` signature, so that gradcheck can test HbfpMatmul's backward formulas."""

    def gemm(self, a, b, *, transpose_a=False, transpose_b=False, **kw):
        a = np.asarray(a, np.float64)
        b = np.asarray(b, np.float64)
        return (a.T if transpose_a else a) @ (b.T if transpose_b else b)


def test_backward_formulas_pass_gradcheck_with_quantization_off(monkeypatch):
    # The driver's results come back as they are (fp64 here), so gradcheck sees exact math.
    monkeypatch.setattr(ht, "_numpy", lambda t: t.detach().numpy())
    a = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, y: ht.HbfpMatmul.apply(x, y, ExactDevice()), (a, b))


def test_gradients_match_autograd_on_the_dequantized_operands(dev):
    """HBFP gradients against fp32 autograd of the dequantized operands: close, not equal
    (the gradients themselves are quantized before their products)."""
    from hbfp.golden import quantize

    g = torch.Generator().manual_seed(4)
    a = torch.randn(48, 72, generator=g, requires_grad=True)
    b = torch.randn(72, 24, generator=g, requires_grad=True)
    grad = torch.randn(48, 24, generator=g)
    ht.matmul(a, b, dev).backward(grad)
    fmt = dev.format()
    qa = torch.from_numpy(quantize(a.detach().numpy(), fmt).dequantize()).requires_grad_()
    qb = torch.from_numpy(quantize(b.detach().numpy(), fmt).dequantize()).requires_grad_()
    (qa @ qb).backward(grad)
    for got, want in ((a.grad, qa.grad), (b.grad, qb.grad)):
        err = (got - want).norm() / want.norm()
        assert err < 0.02, err  # 8-bit mantissas on the gradient side: about 1e-2
