"""hbfp.torch against the golden model: forward and both backward products bit for bit."""

import copy
import warnings

import numpy as np
import pytest
import torch

import hbfp.host
import hbfp.torch as ht
from hbfp.torch import convolution
from hbfp.torch import device as torch_device
from hbfp.host.device import reference_gemm


def bits(t):
    return np.asarray(t.detach().numpy() if isinstance(t, torch.Tensor) else t, np.float32).view(np.uint32)


@pytest.fixture
def dev():
    return ht.default_device()


@pytest.fixture(autouse=True)
def nearest():
    """These tests hold every product, backward ones included, to the golden model's rounding
    to nearest (the "nearest" recipe); the stochastic recipes: tests/test_torch_recipes.py."""
    with ht.use_recipe("nearest"):
        yield


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

    in_process = False  # products go through gemm (NumPy operands)

    def gemm(self, a, b, *, transpose_a=False, transpose_b=False, **kw):
        a = np.asarray(a, np.float64)
        b = np.asarray(b, np.float64)
        return (a.T if transpose_a else a) @ (b.T if transpose_b else b)


def test_backward_formulas_pass_gradcheck_with_quantization_off(monkeypatch):
    # The driver's results come back as they are (fp64 here), so gradcheck sees exact math.
    monkeypatch.setattr(torch_device, "_numpy", lambda t: t.detach().numpy())
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


# ---- wide weight storage ------------------------------------------------------------------

def _on_grid(w, fmt):
    from hbfp.golden import quantize

    m = w.detach().reshape(w.shape[0], -1).numpy()
    return np.array_equal(bits(quantize(m, fmt).dequantize()), bits(m))


def test_wide_weights_are_hbfp16_and_products_read_them_as_hbfp8(dev):
    from hbfp.golden import HBFP16, quantize, requantize

    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(50, 30), torch.nn.ReLU(), torch.nn.Linear(30, 7))
    w0 = model[0].weight.detach().clone()
    assert not _on_grid(w0, HBFP16)  # fp32 initial weights are not HBFP16 values
    ht.convert(model, dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    store = ht.wide_weight_storage(model, opt)
    assert ht.weight_storage(model[0].weight) is HBFP16 and ht.weight_storage(model[0].bias) is None
    assert _on_grid(model[0].weight, HBFP16) and _on_grid(model[2].weight, HBFP16)
    assert torch.allclose(model[0].weight, w0, rtol=0, atol=2.0 ** -14)  # rounded, not moved

    # The product reads the HBFP8 requantization of the stored HBFP16 codes, forward and backward.
    fmt = dev.format()
    x = torch.randn(16, 50, requires_grad=True)
    w = model[0].weight.detach().numpy()
    codes = requantize(quantize(w, HBFP16), fmt)
    h = model[0](x)
    want = reference_gemm(fmt, x.detach().numpy(), codes, transpose_b=True) + model[0].bias.detach().numpy()
    assert np.array_equal(bits(h), bits(want))
    g = torch.randn(16, 30)
    h.backward(g)
    assert np.array_equal(bits(x.grad), bits(reference_gemm(fmt, g.numpy(), codes)))
    assert np.array_equal(bits(model[0].weight.grad),
                          bits(reference_gemm(fmt, g.numpy(), x.detach().numpy(), transpose_a=True)))

    # After a step the master weights are HBFP16 again (the hook ran), and they moved.
    before = model[0].weight.detach().clone()
    opt.step()
    assert _on_grid(model[0].weight, HBFP16) and not torch.equal(model[0].weight, before)
    store.remove()
    assert ht.weight_storage(model[0].weight) is None
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    assert not _on_grid(model[0].weight, HBFP16)  # fp32 master weights once removed


def test_wide_storage_accumulates_updates_too_small_for_hbfp8(dev):
    """An update of 1/64 of an HBFP8 step is lost in 8-bit storage but accumulates in 16
    bits: after 64 steps the weights the product reads have moved by one HBFP8 step."""
    from hbfp.golden import HBFP8, HBFP16, quantize

    lin = torch.nn.Linear(24, 24, bias=False)
    with torch.no_grad():
        lin.weight.fill_(0.5)
        lin.weight[0, 0] = 1.0  # the tile's largest value: exponent so that an HBFP8 step is 2**-6
    step8 = 2.0 ** -6
    opt = torch.optim.SGD(lin.parameters(), lr=1.0)
    ht.wide_weight_storage(lin, opt)
    narrow = lin.weight.detach().clone()
    for _ in range(64):
        lin.weight.grad = torch.full_like(lin.weight, -step8 / 64)
        lin.weight.grad[0, 0] = 0
        opt.step()
        # fp32 rounded to HBFP8 after every step (narrow storage) never moves
        narrow = torch.from_numpy(quantize((narrow - lin.weight.grad).numpy(), HBFP8).dequantize())
    assert torch.equal(narrow[1:, 1:], torch.full((23, 23), 0.5))
    assert torch.equal(lin.weight.detach()[1:, 1:], torch.full((23, 23), 0.5 + step8))
    read = quantize(lin.weight.detach().numpy(), HBFP16)
    assert np.all(read.dequantize()[1:, 1:] == 0.5 + step8)


def test_wide_storage_in_offload_and_conv(dev):
    from hbfp.golden import HBFP16, quantize, requantize

    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(4 * 5 * 5, 3))
    ht.wide_weight_storage(model)  # no optimizer: rounded once
    assert _on_grid(model[0].weight, HBFP16) and _on_grid(model[2].weight, HBFP16)
    fmt = dev.format()

    def read(w):  # the codes the device reads: HBFP16 storage requantized to the device's format
        return requantize(quantize(w.detach().reshape(w.shape[0], -1).numpy(), HBFP16), fmt)

    feat = torch.randn(3, 100)
    with ht.offload(dev):
        y = model[2](feat)  # an unchanged nn.Linear under offload
    want = reference_gemm(fmt, feat.numpy(), read(model[2].weight), transpose_b=True) + model[2].bias.detach().numpy()
    assert np.array_equal(bits(y), bits(want))
    conv = ht.convert(model, dev)[0]
    x = torch.randn(2, 2, 5, 5)
    patches = torch.nn.functional.unfold(x, 3, padding=1).transpose(1, 2).reshape(50, 18).numpy()
    want = reference_gemm(fmt, patches, read(conv.weight), transpose_b=True) + conv.bias.detach().numpy()
    want = want.reshape(2, 25, 4).transpose(0, 2, 1).reshape(2, 4, 5, 5)
    assert np.array_equal(bits(conv(x)), bits(want))


def test_wide_storage_errors():
    from hbfp.golden import HBFP16, MXINT8

    with pytest.raises(ValueError, match="no layer with products"):
        ht.wide_weight_storage(torch.nn.ReLU())
    with pytest.raises(TypeError, match="Format"):
        ht.wide_weight_storage(torch.nn.Linear(2, 2), storage="hbfp16")
    with pytest.raises(ValueError, match="nearest even"):
        ht.wide_weight_storage(torch.nn.Linear(2, 2), storage=HBFP16.with_rounding("stochastic"))
    from hbfp import host

    assert MXINT8.tile != HBFP16.tile


def test_wide_storage_under_a_device_of_other_tiles():
    """HBFP16 storage (24 x 24 tiles) under an MXINT8 device (1 x 32): the device quantizes the
    stored weight's values (points of the storage grid) as any operand, the same product as the
    plain layer with those values, and a few training steps run."""
    from hbfp import host

    torch.manual_seed(4)
    lin = torch.nn.Linear(40, 8)
    ht.wide_weight_storage(lin)
    mx = host.open("emu:format=MXINT8")
    x = torch.randn(3, 40)
    plain = torch.nn.Linear(40, 8)
    plain.load_state_dict(lin.state_dict())  # the stored values, in a layer without storage
    y = ht.convert(torch.nn.Sequential(lin), mx)[0](x)
    assert torch.equal(y, ht.convert(torch.nn.Sequential(plain), mx)[0](x))
    m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ht.wide_weight_storage(m, opt)
    data, labels = torch.randn(16, 64), torch.randint(0, 10, (16,))
    losses = []
    for _ in range(3):
        opt.zero_grad()
        with ht.offload(recipe="mxint8"):
            loss = torch.nn.functional.cross_entropy(m(data), labels)
            loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_training_runs_equal_through_the_wire_and_in_process():
    """A few steps of an MLP and a small CNN under ``offload``: emu computing products in-process
    and emu through the wire protocol and the device's tiling (``emu:wire=1``, 4x4 array,
    48x48 buffers: every product tiled, K in chunks) give the same losses and weights, bit for
    bit, with wide weight storage and SGD with momentum."""
    from hbfp import host

    def run(spec):
        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3, padding=1),
                                    torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 8 * 8, 30), torch.nn.ReLU(),
                                    torch.nn.Linear(30, 10))
        # the convolutions as im2col products (the second's input gradient by col2im), the linears through offload
        ht.convert(model[:3])
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ht.wide_weight_storage(model, opt)
        dev = host.open(spec)
        for layer in model.modules():
            if isinstance(layer, ht.Conv2d):
                layer.device_handle = dev
        g = torch.Generator().manual_seed(6)
        losses = []
        for _ in range(3):
            x, y = torch.randn(20, 1, 8, 8, generator=g), torch.randint(0, 10, (20,), generator=g)
            with ht.offload(dev):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in model.parameters()], dev.stats

    direct = run("emu:rows=4,cols=4,size=48")
    wire = run("emu:rows=4,cols=4,size=48,wire=1")
    assert direct[0] == wire[0]
    assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(direct[1], wire[1]))
    assert direct[2].macs == wire[2].macs and direct[2].cycles == wire[2].cycles and direct[2].bytes_sent < 100


def _conv_steps(kw: dict, storage: bool) -> tuple:
    """Two SGD steps of a Conv2d(**kw) under ``offload(emu)`` (``storage``: wide weight storage,
    whose codes the products read transposed): every output and gradient (input, weight, bias),
    the report, the device's MACs and cycles."""
    torch.manual_seed(4)
    conv = torch.nn.Conv2d(**kw)
    opt = torch.optim.SGD(conv.parameters(), lr=0.1)
    if storage:
        ht.wide_weight_storage(conv, opt)
    dev = hbfp.host.open("emu")
    outs = []
    ht.reset_report()
    for _ in range(2):
        x = (torch.randn(5, kw["in_channels"], 11, 9) * 4).requires_grad_()
        opt.zero_grad()
        with ht.offload(dev):
            y = conv(x)
            (y * torch.linspace(-3, 3, y.numel()).reshape(y.shape)).sum().backward()
        outs += [y.detach(), x.grad] + [q.grad.clone() for q in conv.parameters()]
        opt.step()
    return outs, ht.report(), (dev.stats.macs, dev.stats.cycles)


@pytest.mark.parametrize("kw,storage", [
    (dict(in_channels=5, out_channels=7, kernel_size=3, padding=1), False),
    (dict(in_channels=5, out_channels=7, kernel_size=3, padding=1, bias=False), False),
    (dict(in_channels=6, out_channels=4, kernel_size=(3, 2), stride=(2, 1), padding=(2, 0), dilation=(1, 2)), False),
    (dict(in_channels=6, out_channels=6, kernel_size=3, padding=1, groups=3), False),
    (dict(in_channels=5, out_channels=7, kernel_size=3, padding=1), True),
])
@pytest.mark.parametrize("path", ["fold", "image"])
def test_conv2d_made_a_few_images_at_a_time_has_the_whole_products_bits(kw, storage, path, monkeypatch):
    """A convolution's products made a few images at a time (here one image at a time, whose
    positions, 99 or 49, end inside a tile) equal, bit for bit, the whole products: ``fold``,
    the input gradient folded onto the image as its columns are made, against col2im of the
    whole patch gradient; ``image``, the product made straight into the (N, OUT, OH, OW) output
    with its bias (``_ImageProduct``, one group), against the product, the bias's sum and the
    copy into the image's layout one after another. Over two SGD steps: every output and
    gradient (input, weight, bias), the product counts and the device's MACs and cycles."""
    from hbfp.torch.image_products import _ImageProduct, _LazyPatches

    owner, name, switch = ((_LazyPatches, "fold", "folds") if path == "fold" else
                           (_ImageProduct, "forward", "applies"))
    with monkeypatch.context() as mp:
        mp.setattr(_LazyPatches, "FOLD_BYTES", 1)  # one image a time
        calls, real = [], getattr(owner, name)
        counted = (lambda self, *a: calls.append(1) or real(self, *a)) if path == "fold" else \
            staticmethod(lambda *a: calls.append(1) or real(*a))
        mp.setattr(owner, name, counted)
        by_images = _conv_steps(kw, storage)
    assert bool(calls) == (path == "fold" or kw.get("groups", 1) == 1)  # the path was taken where it applies
    with monkeypatch.context() as mp:
        mp.setattr(owner, switch, staticmethod(lambda *a: False))
        whole = _conv_steps(kw, storage)
    assert len(by_images[0]) == len(whole[0])
    for got, want in zip(by_images[0], whole[0]):
        assert got.shape == want.shape and got.is_contiguous() == want.is_contiguous()
        assert np.array_equal(bits(got), bits(want))
    assert by_images[1] == whole[1] and by_images[2] == whole[2]


@pytest.mark.parametrize("compiled", [True, False])
def test_convolution_patches_keep_unfolds_bits_forward_and_backward(compiled, monkeypatch):
    from hbfp import kernels

    if compiled and not kernels.available("c"):
        pytest.skip(f"no compiled kernels: {kernels.why('c')}")
    if not compiled:  # torch's unfold and fold, as without a compiler
        monkeypatch.setattr(kernels, "_conv_lib", lambda x: None)
    F = torch.nn.functional
    for shape, k, s, p, d in [((8, 16, 8, 8), (3, 3), (1, 1), (1, 1), (1, 1)), ((3, 5, 11, 9), (3, 2), (2, 1), (2, 0), (1, 2))]:
        x1 = torch.randn(*shape, requires_grad=True)
        x2 = x1.detach().clone().requires_grad_()
        cols = F.unfold(x1, k, dilation=d, padding=p, stride=s)
        want = cols.transpose(1, 2).reshape(-1, cols.shape[1])
        got = convolution._Patches.apply(x2, k, s, p, d)
        g = torch.randn_like(want) * 100
        want.backward(g)
        got.backward(g)
        assert torch.equal(got, want) and torch.equal(x2.grad, x1.grad)


def _conv_pair(**kw):
    torch.manual_seed(3)
    ref = torch.nn.Conv2d(**kw)
    return ref, ht.convert(copy.deepcopy(ref))


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_conv2d_padding_modes_and_strings_pad_the_input_as_torch_does(mode):
    F = torch.nn.functional
    x = torch.randn(2, 3, 9, 8)
    for kw in (dict(padding=2, padding_mode=mode), dict(padding="same", padding_mode=mode),
               dict(kernel_size=(4, 2), padding="same"), dict(padding="valid", stride=1)):
        args = dict(in_channels=3, out_channels=5, kernel_size=3)
        args.update(kw)
        ref, conv = _conv_pair(**args)
        plain = ht.Conv2d(3, 5, args["kernel_size"], bias=True)
        plain.weight, plain.bias = conv.weight, conv.bias
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = conv(x1)
        mode_ = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
        want = plain(F.pad(x2, conv._reversed_padding_repeated_twice, mode=mode_))
        with warnings.catch_warnings():  # torch's note on 'same' with an even kernel
            warnings.simplefilter("ignore")
            shape = ref(x).shape
        assert y.shape == shape and torch.equal(y, want)
        g = torch.randn_like(y)
        y.backward(g)
        want.backward(g)
        assert torch.equal(x1.grad, x2.grad)


@pytest.mark.parametrize("groups", [2, 6])  # grouped and depthwise
def test_grouped_and_depthwise_conv2d_run_every_group_on_the_device(groups):
    dev = hbfp.host.open("emu")
    torch.manual_seed(4)
    ref = torch.nn.Conv2d(6, 12, 3, padding=1, groups=groups)
    conv = ht.convert(copy.deepcopy(ref), dev)
    x = torch.randn(4, 6, 10, 10, requires_grad=True)
    y = conv(x)
    want = ref(x)
    assert not torch.equal(y, want)  # HBFP, not fp32
    assert (y - want).abs().max() < 0.05 * want.abs().max()
    # forward: N*OH*OW x (C/g*9) x (OUT/g) per group
    assert dev.stats.macs == 4 * 10 * 10 * (6 // groups * 9) * (12 // groups) * groups
    y.sum().backward()
    assert conv.weight.grad is not None and x.grad is not None
    assert dev.stats.macs == 3 * 4 * 10 * 10 * (6 // groups * 9) * (12 // groups) * groups


def test_unbatched_input_bare_layers_and_vectors():
    dev = hbfp.host.open("emu")
    torch.manual_seed(5)
    conv = ht.convert(torch.nn.Conv2d(2, 3, 3, padding=1), dev)  # a bare layer comes back converted
    lin = ht.convert(torch.nn.Linear(24, 5), dev)
    assert isinstance(conv, ht.Conv2d) and isinstance(lin, ht.Linear)
    x = torch.randn(2, 6, 6)
    assert torch.equal(conv(x), conv(x[None])[0])
    v = torch.randn(24)
    assert torch.equal(lin(v), lin(v[None])[0])
    a, b = torch.randn(30, 24), torch.randn(24)
    before = dev.stats.macs
    with ht.offload(dev):
        mv = a @ b
        vm = b @ a.t()
        dot = b @ b
    assert dev.stats.macs - before == 30 * 24 + 24 * 30 + 24
    assert mv.shape == (30,) and vm.shape == (30,) and dot.shape == ()
    assert torch.equal(mv, ht.matmul(a, b[:, None], dev)[:, 0])
    with pytest.raises(ValueError, match="scalars"):
        ht.matmul(torch.tensor(2.0), a, dev)


def test_convert_swaps_the_layers_its_filter_takes_under_its_recipe():
    """``module_filter_fn(module, fqn)`` is asked about each layer convert would swap, by its name
    in the model; the layers it refuses stay torch's; ``recipe`` is the swapped layers' recipe."""
    dev = hbfp.host.open("emu")
    torch.manual_seed(8)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)))
    weights = [p for p in model.parameters()]
    asked = []

    def keep(module, fqn):
        asked.append((fqn, type(module)))
        return fqn != "3.2"

    assert ht.convert(model, dev, recipe="nearest", module_filter_fn=keep) is model
    assert asked == [("0", torch.nn.Conv2d), ("3.0", torch.nn.Linear), ("3.2", torch.nn.Linear)]
    assert isinstance(model[0], ht.Conv2d) and isinstance(model[3][0], ht.Linear)
    assert type(model[3][2]) is torch.nn.Linear  # refused: torch's own
    assert all(a is b for a, b in zip(model.parameters(), weights))  # the same parameter tensors
    assert model[0].in_use.recipe is ht.RECIPES["nearest"] and model[3][0].in_use is model[0].in_use
    x = torch.randn(5, 2, 6, 6)
    hidden = model[3][1](model[3][0](model[:3](x)))
    assert torch.equal(model(x), torch.nn.functional.linear(hidden, model[3][2].weight, model[3][2].bias))  # fp32
    assert not torch.equal(model[3][0](model[:3](x)), torch.nn.functional.linear(model[:3](x), model[3][0].weight,
                                                                                 model[3][0].bias))  # HBFP
    bare = torch.nn.Linear(4, 4)
    assert ht.convert(bare, dev, module_filter_fn=lambda m, fqn: fqn != "") is bare  # refused: as it was
    assert isinstance(ht.convert(bare, dev, module_filter_fn=lambda m, fqn: fqn == ""), ht.Linear)


@pytest.mark.parametrize("kw", [dict(stride=2, padding=1), dict(dilation=2, padding=2, groups=3),
                                dict(padding="same", padding_mode="reflect"), dict(padding=1, padding_mode="circular")])
def test_conv1d_and_conv2d_under_offload_run_on_the_device(kw):
    """An unchanged nn.Conv1d/nn.Conv2d under offload: its products go to the device (the same bits
    as the converted layer), forward and backward."""
    for cls, shape in ((torch.nn.Conv1d, (2, 6, 17)), (torch.nn.Conv2d, (2, 6, 9, 7))):
        torch.manual_seed(6)
        ref = cls(6, 9, 3, **kw)
        conv = ht.convert(copy.deepcopy(ref))
        x = torch.randn(*shape)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        dev = hbfp.host.open("emu")
        with ht.offload(dev):
            y = ref(x1)
        conv.device_handle = hbfp.host.open("emu")
        want = conv(x2)
        assert dev.stats.macs > 0 and torch.equal(y, want)
        assert not torch.equal(y, cls.forward(ref, x))  # not fp32
        g = torch.randn_like(y)
        with ht.offload(dev):
            y.backward(g)
        want.backward(g)
        assert torch.equal(x1.grad, x2.grad) and torch.equal(ref.weight.grad, conv.weight.grad)
        assert torch.equal(conv(x[0]), conv(x[:1])[0])  # unbatched


def test_vector_and_batched_add_products_run_on_the_device():
    dev = hbfp.host.open("emu")
    a, v, w = torch.randn(30, 24), torch.randn(24), torch.randn(30)
    b1, b2, c = torch.randn(3, 5, 24), torch.randn(3, 24, 7), torch.randn(3, 5, 7)
    with ht.offload(dev):
        mv, dot = torch.mv(a, v), torch.dot(v, v)
        amv = torch.addmv(w, a, v, beta=0.5, alpha=2.0)
        bad = torch.baddbmm(c, b1, b2)
    assert dev.stats.macs == 30 * 24 + 24 + 30 * 24 + 3 * 5 * 24 * 7
    assert torch.equal(mv, ht.matmul(a, v, dev)) and torch.equal(dot, ht.matmul(v, v, dev))
    assert torch.equal(amv, 0.5 * w + 2.0 * ht.matmul(a, v, dev))
    assert torch.equal(bad, c + ht.matmul(b1, b2, dev))
