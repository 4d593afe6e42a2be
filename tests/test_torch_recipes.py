"""hbfp.torch recipes: per-product rounding (stochastic gradients with their seeds), output
format, the format a recipe needs, and why the default rounds gradients stochastically."""

import numpy as np
import pytest
import torch
import torch.nn as nn

import hbfp.host
import hbfp.torch as ht
from hbfp.golden import BFPTensor, quantize
from hbfp.golden.gemm import gemm as golden_gemm
from hbfp.recipes import RecipeInUse, stream_seed


def u32(t):
    return np.asarray(t.detach().numpy() if isinstance(t, torch.Tensor) else t, np.float32).view(np.uint32)


def test_recipes_and_their_errors():
    assert {"default", "nearest", "hbfp8", "mxint8"} <= set(ht.RECIPES)
    d = ht.RECIPES["default"]
    assert d.forward.rounding == "nearest_even" and d.grad_input.rounding == d.grad_weight.rounding == "stochastic"
    assert ht.current_recipe().name == "default"
    with pytest.raises(ValueError, match="rounding"):
        ht.ProductConfig(rounding="up")
    with pytest.raises(ValueError, match="format"):
        ht.ProductConfig(format="FP8")
    with pytest.raises(ValueError, match="out"):
        ht.ProductConfig(out="fp16")
    with pytest.raises(ValueError, match="recipe must be"):
        with ht.offload(recipe="fancy"):
            pass
    with pytest.raises(ValueError, match="MXINT8.*emu:format=MXINT8"):
        with ht.offload(hbfp.host.open("emu"), recipe="mxint8"):
            pass
    with ht.offload(recipe="mxint8") as dev:  # no device: an emu of the recipe's format
        assert dev.identity.tile == (1, 32) and ht.get_matmul_precision() == "mxint8"
    with ht.offload(hbfp.host.open("emu")):
        assert ht.get_matmul_precision() == "hbfp8"


def test_stochastic_gradients_equal_the_golden_model_with_the_recipes_seeds():
    dev = hbfp.host.open("emu")
    fmt = dev.format()
    g = torch.Generator().manual_seed(0)
    a = torch.randn(40, 50, generator=g, requires_grad=True)
    b = torch.randn(50, 30, generator=g, requires_grad=True)
    grad = torch.randn(40, 30, generator=g)
    recipe = ht.RECIPES["default"].with_seed(7)
    with ht.use_recipe(recipe):
        y = ht.matmul(a, b, dev)
        y.backward(grad)
    # the forward to nearest; the output gradient rounded stochastically once, with the first
    # seed of the recipe's stream, for both backward products
    seed = RecipeInUse(recipe).seed(recipe.grad_input)
    qa, qb = quantize(a.detach().numpy(), fmt), quantize(b.detach().numpy(), fmt)
    qg = quantize(grad.numpy(), fmt.with_rounding("stochastic"), seed=seed)
    assert np.array_equal(u32(y), u32(golden_gemm(qa, qb)))
    qbt = BFPTensor(qb.codes.T.copy(), qb.exponents.T.copy(), fmt.transposed())
    qat = BFPTensor(qa.codes.T.copy(), qa.exponents.T.copy(), fmt.transposed())
    assert np.array_equal(u32(a.grad), u32(golden_gemm(qg, qbt)))
    assert np.array_equal(u32(b.grad), u32(golden_gemm(qat, qg)))
    # nearest gradients differ
    assert not np.array_equal(u32(a.grad), u32(golden_gemm(quantize(grad.numpy(), fmt), qbt)))


def _grads(seed, recipe="default"):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(30, 20), nn.ReLU(), nn.Linear(20, 5))
    x = torch.randn(16, 30)
    with ht.offload(hbfp.host.open("emu"), recipe=ht.RECIPES[recipe].with_seed(seed)):
        nn.functional.cross_entropy(model(x), torch.arange(16) % 5).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_same_seed_same_bits_and_another_seed_other_bits():
    one, again, other = _grads(3), _grads(3), _grads(4)
    assert all(torch.equal(p, q) for p, q in zip(one, again))
    assert not all(torch.equal(p, q) for p, q in zip(one, other))
    nearest = _grads(3, "nearest")
    assert not torch.equal(one[0], nearest[0])


def test_converted_layers_keep_their_recipes_stream_of_seeds():
    def run():
        torch.manual_seed(2)
        model = ht.convert(nn.Sequential(nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 3)), recipe="default")
        model(torch.randn(8, 24)).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    assert all(torch.equal(p, q) for p, q in zip(run(), run()))


def test_bf16_output_is_the_fp32_result_rounded_to_nearest_even():
    dev = hbfp.host.open("emu")
    cfg = ht.ProductConfig(out="bf16")
    recipe = ht.Recipe("bf16 out", forward=cfg, grad_input=cfg, grad_weight=cfg)
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(30, 40, generator=g), torch.randn(40, 20, generator=g)
    with ht.use_recipe(recipe):
        y = ht.matmul(a, b, dev)
    with ht.use_recipe("nearest"):
        y32 = ht.matmul(a, b, dev)
    assert y.dtype == torch.float32 and torch.equal(y, y32.to(torch.bfloat16).to(torch.float32))
    assert not torch.equal(y, y32)


def test_nearest_gradients_are_biased_where_stochastic_ones_are_not():
    """The cause of AdamW's divergence on a language model (docs/torch.md, "Fidelity"): the
    output gradient of a softmax over many classes is one large negative entry per row and many
    small positive ones. A 24 x 24 tile to nearest flushes the small ones (below half a quantum of
    the largest): its sum, which is 0 exactly, turns clearly negative. Stochastic rounding keeps
    the expectation: averaged over seeds, the sums come back to 0."""
    fmt = hbfp.host.open("emu").format()
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(48, 96, generator=g) * 2
    p = torch.softmax(logits, 1)
    grad = p - nn.functional.one_hot(torch.randint(0, 96, (48,), generator=g), 96).float()
    exact = grad.sum(1)  # zero up to rounding
    nearest = torch.from_numpy(quantize(grad.numpy(), fmt).dequantize()).sum(1)
    flushed = (torch.from_numpy(quantize(grad.numpy(), fmt).codes) == 0) & (grad != 0)
    assert flushed.float().mean() > 0.5  # most small entries vanish
    assert (nearest < 0).all() and nearest.mean() < -0.03 and exact.abs().max() < 1e-5  # all rows: one sign
    sr = torch.stack([torch.from_numpy(quantize(grad.numpy(), fmt.with_rounding("stochastic"), seed=s).dequantize())
                      for s in range(64)]).mean(0).sum(1)
    assert sr.abs().mean() < nearest.abs().mean() / 4, (sr.abs().mean(), nearest.abs().mean())


def _linear_grad(layer, x, dev, **kw):
    with ht.offload(dev, **kw):
        return torch.autograd.grad(layer(x).square().sum(), layer.weight)[0]


def test_the_seed_stream_continues_across_contexts_per_model():
    """Each offload context on a model draws new seeds (its weights count the contexts they were
    read in), a copy of the model starts where the model started, and a given seed restarts the
    stream; every gradient is the golden model's with the seed ``stream_seed`` gives
    (generation g mixed into the recipe's stream)."""
    import copy

    dev = hbfp.host.open("emu")
    fmt = dev.format()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 24, generator=g)
    torch.manual_seed(3)
    layer = nn.Linear(24, 24)
    twin = copy.deepcopy(layer)
    first, second = _linear_grad(layer, x, dev), _linear_grad(layer, x, dev)
    assert not torch.equal(first, second)
    assert torch.equal(_linear_grad(twin, x, dev), first)  # a copy: its own first context
    seeded = [_linear_grad(layer, x, dev, seed=11) for _ in range(2)]
    assert torch.equal(seeded[0], seeded[1])
    with pytest.raises(ValueError, match="seed"):
        _linear_grad(layer, x, dev, seed=-1)

    recipe = ht.RECIPES["default"]
    y = x @ layer.weight.detach().t() + layer.bias.detach()
    qx = quantize(x.numpy(), fmt)
    qxt = BFPTensor(qx.codes.T.copy(), qx.exponents.T.copy(), fmt.transposed())
    for generation, got in ((0, first), (1, second)):
        with torch.no_grad(), ht.offload(dev, seed=99):  # the forward product, as the device computes it
            y = layer(x)
        seed = stream_seed(recipe.seed, 1, generation)
        qg = quantize((2 * y).numpy(), fmt.with_rounding("stochastic"), seed=seed)
        assert np.array_equal(u32(got.t()), u32(golden_gemm(qxt, qg))), generation
