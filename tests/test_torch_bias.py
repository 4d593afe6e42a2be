"""A bias under hbfp.torch: the device's fp32 product plus the bias in fp32, rounded once to the
layer's dtype (torch's own bf16 kernels round once; adding a bf16 bias to a bf16-rounded
product rounds twice)."""

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
