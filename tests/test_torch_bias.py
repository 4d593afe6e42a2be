"""A bias under hbfp.torch: the device's fp32 product plus the bias in fp32, rounded once to the
layer's dtype (torch's own bf16 kernels round once; adding a bf16 bias to a bf16-rounded
product rounds twice)."""

import pytest
import torch
import torch.nn.functional as F

import hbfp.host as H
import hbfp.torch as HT


def test_the_reproducer_rounds_once():
    x = torch.zeros(1, 25)
    x[0, 0], x[0, 24] = 1.0, 2.0 ** -8
    w, b = torch.ones(1, 25), torch.tensor([2.0 ** -10])
    with HT.offload(H.open("emu")):
        y = F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16())
    assert y.dtype == torch.bfloat16 and float(y) == 1.0078125  # 1 + 2^-8 + 2^-10, rounded once


def test_random_bf16_layers_with_bias_are_the_fp32_product_plus_bias_rounded_once():
    g = torch.Generator().manual_seed(3)
    dev = H.open("emu")
    x = torch.randn(16, 48, generator=g).bfloat16()
    w = torch.randn(24, 48, generator=g).bfloat16()
    b = (torch.randn(24, generator=g) * 4).bfloat16()
    img = torch.randn(2, 3, 9, 9, generator=g).bfloat16()
    k = torch.randn(5, 3, 3, 3, generator=g).bfloat16()
    kb = (torch.randn(5, generator=g) * 4).bfloat16()
    with HT.offload(dev):
        y, y32 = F.linear(x, w, b), F.linear(x.float(), w.float())  # bf16 -> fp32 is exact: the same codes
        c, c32 = F.conv2d(img, k, kb, padding=1), F.conv2d(img.float(), k.float(), padding=1)
    assert y.dtype == c.dtype == torch.bfloat16
    assert torch.equal(y, (y32 + b.float()).bfloat16())
    assert torch.equal(c, (c32 + kb.float()[:, None, None]).bfloat16())
    # a rounding of the product first would differ somewhere on these shapes
    assert not torch.equal(y, y32.bfloat16() + b) or not torch.equal(c, c32.bfloat16() + kb[:, None, None])
    # a converted layer (hbfp.torch.Linear) rounds the same way
    lin = HT.Linear(48, 24, device_handle=dev).bfloat16()
    lin.weight.data.copy_(w)
    lin.bias.data.copy_(b)
    assert torch.equal(lin(x), y)


def test_the_addmm_family_rounds_once_and_beta_0_ignores_the_input():
    """``torch.addmm``, ``addmv`` and ``baddbmm`` in bf16 under offload: the fp32 device product
    plus the input in fp32, rounded once (the reproducer's 1.0078125, as torch gives); alpha and
    beta scale in fp32; beta 0 ignores a NaN input, as torch does."""
    x = torch.zeros(1, 25)
    x[0, 0], x[0, 24] = 1.0, 2.0 ** -8
    w, b = torch.ones(1, 25).bfloat16(), torch.tensor([2.0 ** -10]).bfloat16()
    xb = x.bfloat16()
    dev = H.open("emu")
    with HT.offload(dev):
        got = {"addmm": torch.addmm(b, xb, w.t()), "addmv": torch.addmv(b, w, xb[0]),
               "baddbmm": torch.baddbmm(b.view(1, 1, 1), xb[None], w.t()[None]),
               "Tensor.addmm": b[None].addmm(xb, w.t())}
        nan = torch.addmm(torch.full((1, 1), float("nan")).bfloat16(), xb, w.t(), beta=0)
        g = torch.Generator().manual_seed(1)
        inp, a, m = (torch.randn(8, 24, generator=g).bfloat16(), torch.randn(8, 40, generator=g).bfloat16(),
                     torch.randn(40, 24, generator=g).bfloat16())
        scaled, prod = torch.addmm(inp, a, m, beta=0.5, alpha=3), torch.mm(a.float(), m.float())
    for name, y in got.items():
        assert y.dtype == torch.bfloat16 and float(y.flatten()[0]) == 1.0078125, name
    assert float(nan) == 1.0  # 1 + 2^-8 rounded to bf16; the NaN input ignored
    assert torch.equal(scaled, (3 * prod + 0.5 * inp.float()).bfloat16())


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's own use of torch.jit
def test_compiled_bf16_linear_and_addmm_round_once_as_eager():
    """Under torch.compile the same values as eager: the traced routes add the bias (or the
    input) to the fp32 product in fp32 and round once."""
    x = torch.zeros(1, 25)
    x[0, 0], x[0, 24] = 1.0, 2.0 ** -8
    w, b = torch.ones(1, 25).bfloat16(), torch.tensor([2.0 ** -10]).bfloat16()
    xb = x.bfloat16()
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w, b: (F.linear(x, w, b), torch.addmm(b, x, w.t(), beta=0.5)))
    with torch.no_grad(), HT.offload(H.open("emu")):
        y, z = fn(xb, w, b)
    torch._dynamo.reset()
    assert y.dtype == z.dtype == torch.bfloat16
    assert float(y) == 1.0078125 and float(z) == float((1.00390625 + 0.5 * 2.0 ** -10) * torch.ones(1).bfloat16())
