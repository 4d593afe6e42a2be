"""offload's ATen-level interception (hbfp.torch.aten): every product of attention, RNNs,
einsum, tensordot, bilinear, 1-3 d and transposed convolutions on the device, forward and
backward; the report of what ran where; dtypes; torch.compile."""

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import hbfp.host
import hbfp.torch as ht
from hbfp.host.device import reference_gemm
from hbfp.torch import aten, convolution


def bits(t):
    return np.asarray(t.detach().float().numpy(), np.float32).view(np.uint32)


@pytest.fixture(autouse=True)
def nearest():
    """Products held to the golden model's rounding to nearest (the "nearest" recipe)."""
    with ht.use_recipe("nearest"):
        yield


def exact(a, b, **_):
    """A product with quantization off (fp64, rounded once to fp32): the geometry alone."""
    return (a.double() @ b.double()).float()


# ---- convolution geometry against torch's own convolutions ------------------------------------

CONVS = [
    # (spatial dims, transposed, in, out, kernel, stride, padding, dilation, groups, output_padding)
    (1, False, 4, 6, 3, 1, 0, 1, 1, 0),
    (1, False, 4, 6, 3, 2, 2, 2, 2, 0),
    (2, False, 3, 4, (3, 2), (2, 1), (1, 0), (1, 2), 1, 0),
    (2, False, 4, 4, 3, 1, 1, 1, 4, 0),  # depthwise
    (3, False, 2, 4, (2, 3, 1), (1, 2, 1), (0, 1, 0), 1, 2, 0),
    (1, True, 4, 6, 3, 2, 1, 1, 2, 1),
    (2, True, 3, 4, (3, 2), (2, 3), (1, 0), (2, 1), 1, (1, 2)),
    (3, True, 2, 2, 2, 2, 0, 1, 1, 0),
]


@pytest.mark.parametrize("case", CONVS, ids=lambda c: f"{c[0]}d{'T' if c[1] else ''}")
def test_convolution_geometry_equals_torch_forward_and_backward(case):
    nd, transposed, cin, cout, k, s, p, d, g, op = case
    tup = lambda v: (v,) * nd if isinstance(v, int) else v  # noqa: E731
    k, s, p, d, op = map(tup, (k, s, p, d, op))
    torch.manual_seed(0)
    x = torch.randn(2, cin, *(5 + i for i in range(nd)), dtype=torch.float64, requires_grad=True)
    wshape = (cin, cout // g, *k) if transposed else (cout, cin // g, *k)
    w = torch.randn(*wshape, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(cout, dtype=torch.float64, requires_grad=True)
    want = torch.ops.aten.convolution(x, w, bias, s, p, d, transposed, op, g)
    grad = torch.randn_like(want)
    gx, gw, gb = torch.autograd.grad(want, (x, w, bias), grad)
    xf, wf, bf = (t.detach().float().requires_grad_() for t in (x, w, bias))
    got = convolution.convolution(xf, wf, bf, s, p, d, transposed, op, g, mm=exact)
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    back = torch.autograd.grad(got, (xf, wf, bf), grad.float())
    for mine, theirs in zip(back, (gx, gw, gb)):
        torch.testing.assert_close(mine.double(), theirs, rtol=1e-5, atol=1e-5)


class _Golden(torch.autograd.Function):
    """A product and its backward products (grad @ b^T, a^T @ grad) as the golden model makes
    them on ``emu``'s format, to nearest (the "nearest" recipe)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.from_numpy(reference_gemm(hbfp.host.open("emu").format(), _np(a), _np(b)))

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        fmt, g = hbfp.host.open("emu").format(), _np(grad)
        return (torch.from_numpy(reference_gemm(fmt, g, _np(b), transpose_b=True)),
                torch.from_numpy(reference_gemm(fmt, _np(a), g, transpose_a=True)))


def _np(t):
    return np.ascontiguousarray(t.detach().numpy())


@pytest.mark.parametrize("name", ["conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"])
def test_every_convolution_takes_one_path_its_products_the_golden_models(name):
    """3-d and transposed convolutions under offload: the im2col products of conv2d's path
    (``convolution.convolution``), forward and backward, each bit for bit the golden model's."""
    torch.manual_seed(5)
    layer, (x,) = OPS[name]()
    geometry = (layer.stride, layer.padding, layer.dilation, layer.transposed, layer.output_padding, layer.groups)
    dev = hbfp.host.open("emu")
    with ht.offload(dev):
        y = layer(x)
    grad = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, layer.weight, layer.bias), grad)
    w, b = layer.weight.detach().requires_grad_(), layer.bias.detach().requires_grad_()
    xx = x.detach().requires_grad_()
    want = convolution.convolution(xx, w, b, *geometry, mm=lambda a, b, **_: _Golden.apply(a, b))
    assert np.array_equal(bits(y), bits(want))
    for mine, theirs in zip(got, torch.autograd.grad(want, (xx, w, b), grad)):
        assert np.array_equal(bits(mine), bits(theirs))


def test_transposed_convolutions_read_wide_storage():
    from hbfp.golden import HBFP16, quantize, requantize

    torch.manual_seed(6)
    layer = nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1)
    ht.wide_weight_storage(layer)
    dev = hbfp.host.open("emu")
    x = torch.randn(2, 4, 5, 5)
    with ht.offload(dev):
        y = layer(x)
    # the device reads the weight (Cin x Cout * K, not transposed) as HBFP16 storage requantized
    read = requantize(quantize(layer.weight.detach().reshape(4, -1).numpy(), HBFP16), dev.format())
    cols = reference_gemm(dev.format(), _np(x.movedim(1, -1).reshape(-1, 4)), read)
    want = convolution.col2im(torch.from_numpy(cols), y.shape, (3, 3), (2, 2), (1, 1), (1, 1))
    assert np.array_equal(bits(y), bits(want + layer.bias.detach().reshape(-1, 1, 1)))


def test_patches_match_unfold_and_col2im_is_its_adjoint():
    torch.manual_seed(1)
    x = torch.randn(2, 3, 7, 6)
    geometry = ((3, 2), (2, 1), (1, 1), (1, 2))
    want = F.unfold(x, *geometry[:1], dilation=geometry[3], padding=geometry[2], stride=geometry[1])
    got = convolution.patches(x.double(), *geometry)  # the generic path (fp64: not the compiled one)
    assert torch.equal(got.float(), want.transpose(1, 2).reshape(-1, want.shape[1]))
    cols = torch.randn_like(got)
    # <patches(x), cols> == <x, col2im(cols)>
    lhs = (got * cols).sum()
    rhs = (x.double() * convolution.col2im(cols, x.shape, *geometry)).sum()
    torch.testing.assert_close(lhs, rhs)


# ---- products at the ATen level, bit for bit ---------------------------------------------------

def test_aten_products_equal_the_golden_model():
    dev = hbfp.host.open("emu")
    fmt = dev.format()
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(3, 20, 30, generator=g), torch.randn(3, 30, 10, generator=g)
    c = torch.randn(20, 10, generator=g)
    with ht.offload(dev):
        bmm = torch.ops.aten.bmm(a, b)
        ein = torch.einsum("bij,bjk->bik", a, b)
        addbmm = torch.addbmm(c, a, b, beta=0.5)
        td = torch.tensordot(a[0], b[0], dims=1)
    want = np.stack([reference_gemm(fmt, a[i].numpy(), b[i].numpy()) for i in range(3)])
    assert np.array_equal(bits(bmm), want.view(np.uint32))
    assert np.array_equal(bits(ein), want.view(np.uint32))
    assert np.array_equal(bits(td), want[0].view(np.uint32))
    # addbmm: one product with the batches side by side along K
    wide = reference_gemm(fmt, a.permute(1, 0, 2).reshape(20, 90).numpy(), b.reshape(90, 10).numpy())
    assert np.array_equal(bits(addbmm), bits(0.5 * c + torch.from_numpy(wide)))


def test_backward_products_at_the_aten_level_run_on_the_device():
    dev = hbfp.host.open("emu")
    fmt = dev.format()
    g = torch.Generator().manual_seed(3)
    a = torch.randn(2, 16, 40, generator=g, requires_grad=True)
    b = torch.randn(2, 40, 24, generator=g, requires_grad=True)
    grad = torch.randn(2, 16, 24, generator=g)
    with ht.offload(dev):
        torch.einsum("bij,bjk->bik", a, b).backward(grad)
    A, B, G = a.detach().numpy(), b.detach().numpy(), grad.numpy()
    for i in range(2):
        assert np.array_equal(bits(a.grad[i]), reference_gemm(fmt, G[i], B[i], transpose_b=True).view(np.uint32))
        assert np.array_equal(bits(b.grad[i]), reference_gemm(fmt, A[i], G[i], transpose_a=True).view(np.uint32))


# ---- every listed operation, forward and backward, all MACs on the device ---------------------

def _x(*shape):
    return torch.randn(*shape, requires_grad=True)


class _SelfAttention(nn.Module):
    """nn.MultiheadAttention without the weights (its fused path in torch, SDPA inside)."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, q):
        return self.mha(q, q, q, need_weights=False)[0]


OPS = {
    "mha": lambda: (nn.MultiheadAttention(16, 2, batch_first=True), (_x(2, 5, 16),) * 3),
    "mha_no_weights": lambda: (_SelfAttention(), (_x(2, 5, 16),)),
    "sdpa": lambda: (F.scaled_dot_product_attention, (_x(2, 2, 6, 8), _x(2, 2, 7, 8), _x(2, 2, 7, 8))),
    "transformer": lambda: (nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), (_x(2, 5, 16),)),
    "lstm": lambda: (nn.LSTM(12, 8, num_layers=2, batch_first=True), (_x(3, 4, 12),)),
    "gru": lambda: (nn.GRU(12, 8, bidirectional=True), (_x(4, 3, 12),)),
    "rnn": lambda: (nn.RNN(12, 8), (_x(4, 3, 12),)),
    "einsum": lambda: (lambda p, q: torch.einsum("bhij,bhjk->bhik", p, q), (_x(2, 2, 5, 8), _x(2, 2, 8, 3))),
    "tensordot": lambda: (lambda p, q: torch.tensordot(p, q, dims=([1, 2], [0, 1])), (_x(4, 5, 6), _x(5, 6, 3))),
    "bilinear": lambda: (nn.Bilinear(6, 5, 4), (_x(7, 6), _x(7, 5))),
    "conv1d": lambda: (nn.Conv1d(4, 6, 3, padding="same", padding_mode="reflect", groups=2), (_x(2, 4, 9),)),
    "conv2d": lambda: (nn.Conv2d(3, 4, 3, stride=2, dilation=2), (_x(2, 3, 9, 9),)),
    "conv3d": lambda: (nn.Conv3d(2, 4, (2, 3, 3), padding=1, groups=2), (_x(2, 2, 4, 5, 5),)),
    "conv_transpose1d": lambda: (nn.ConvTranspose1d(4, 6, 3, stride=2, output_padding=1), (_x(2, 4, 7),)),
    "conv_transpose2d": lambda: (nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, groups=2), (_x(2, 4, 5, 5),)),
    "conv_transpose3d": lambda: (nn.ConvTranspose3d(2, 2, 2, stride=2), (_x(1, 2, 3, 3, 3),)),
    "linear_any_rank": lambda: (nn.Linear(8, 5), (_x(2, 3, 4, 8),)),
    "matmul_broadcast": lambda: (torch.matmul, (_x(2, 1, 5, 8), _x(3, 8, 4))),
    "matmul_vectors": lambda: (lambda v, m: v @ m @ v[:4], (_x(8), _x(8, 4))),
    "baddbmm": lambda: (lambda c, p, q: torch.baddbmm(c, p, q, alpha=0.5), (_x(2, 5, 4), _x(2, 5, 8), _x(2, 8, 4))),
    "addmv": lambda: (torch.addmv, (_x(5), _x(5, 8), _x(8))),
}


def _outputs(out):
    return [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_operation_runs_all_its_products_on_the_device(name):
    torch.manual_seed(4)
    fn, inputs = OPS[name]()
    params = list(fn.parameters()) if isinstance(fn, nn.Module) else []
    leaves = [*inputs, *params]

    def run(context):
        for t in leaves:
            t.grad = None
        with context:
            outs = _outputs(fn(*inputs))
            loss = sum((o * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum() for o in outs)
            loss.backward()
        return outs, [t.grad.clone() for t in leaves]

    with aten.backend_flags(), FlopCounterMode(display=False) as flops:
        fp32, fp32_grads = run(torch.enable_grad())
    dev = hbfp.host.open("emu")
    ht.reset_report()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ht.HbfpFallbackWarning)  # no fallback
        hb, hb_grads = run(ht.offload(dev))
    report = ht.report()
    device = sum(c.device_macs for c in report.values())
    assert sum(c.host_macs for c in report.values()) == 0 and ht.fallbacks() == {}
    assert dev.stats.macs == device
    assert device == _macs(name, flops.get_flop_counts().get("Global", {})) > 0
    for mine, theirs in zip(hb + hb_grads, fp32 + fp32_grads):
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
    for mine, theirs in zip(hb, fp32):
        assert not torch.equal(mine, theirs)  # HBFP, not fp32
        assert (mine - theirs).norm() / theirs.norm() < 0.05
    # every weight's gradient and some input's come from products on the device
    n_in = len(inputs)
    assert all(not torch.equal(m, t) for m, t, p in zip(hb_grads[n_in:], fp32_grads[n_in:], params) if p.dim() >= 2)
    assert any(not torch.equal(m, t) for m, t in zip(hb_grads[:n_in], fp32_grads[:n_in]))
    flat = lambda ts: torch.cat([t.flatten() for t in ts])  # noqa: E731
    assert (flat(hb_grads) - flat(fp32_grads)).norm() / flat(fp32_grads).norm() < 0.1


def _macs(name, flops):
    """The MACs of an operation's products, forward and backward: torch's flop counter's for
    products it counts as we compute them, the formulas for the rest."""
    flops = {str(k).split("'")[1] if "'" in str(k) else str(k): v for k, v in flops.items()}
    if name == "bilinear":  # one product of the outer products with W (N x I*J x O), three times
        return 3 * 7 * 6 * 5 * 4
    if name == "addmv":  # forward (5 x 8), grad of the matrix (outer product, K = 1) and of the vector
        return 3 * 5 * 8
    if name == "matmul_vectors":  # v @ M (8 x 4), then (v @ M) @ v[:4]; three products each
        return 3 * 8 * 4 + 3 * 4
    if "aten.convolution" in flops:  # forward, grad_input and grad_weight: the forward's MACs each
        return 3 * flops["aten.convolution"] // 2
    return sum(flops.values()) // 2


def test_report_counts_host_fallbacks_and_warns_once():
    dev = hbfp.host.open("emu")
    ht.reset_report()
    a = torch.randint(-3, 3, (4, 5))
    with ht.offload(dev):
        with pytest.warns(ht.HbfpFallbackWarning, match="aten.mm"):
            torch.mm(a, a.t())
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per operation
            torch.mm(a, a.t())
        torch.mm(a.float(), a.t().float())
    report = ht.report()
    assert report["aten.mm"].host_macs == 2 * 4 * 5 * 4 and ht.fallbacks() == {"aten.mm": 2}
    assert report["matmul"].device_macs == 4 * 5 * 4  # torch.mm of floats: routed as a function
    table = ht.format_report()
    assert "aten.mm" in table and "on the device: 33.3% of 240 MACs" in table
    ht.reset_report()
    assert ht.report() == {} and ht.fallbacks() == {}


def test_flags_are_restored_and_nothing_is_routed_outside():
    mkldnn = torch._C._get_mkldnn_enabled()
    with ht.offload():
        assert not torch._C._get_mkldnn_enabled()
    assert torch._C._get_mkldnn_enabled() == mkldnn
    ht.reset_report()
    torch.bmm(torch.randn(2, 3, 4), torch.randn(2, 4, 5))
    assert ht.report() == {}


# ---- dtypes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_give_outputs_of_their_dtype_rounded_from_the_device(dtype):
    dev = hbfp.host.open("emu")
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(2, 12, 30, generator=g).to(dtype), torch.randn(2, 30, 9, generator=g).to(dtype)
    w = torch.randn(9, 30, generator=g).to(dtype)
    with ht.offload(dev):
        y = torch.bmm(a, b)  # a function route
        z = torch.ops.aten.bmm(a, b)  # the ATen route
        lin = F.linear(a, w)
    fp32 = torch.stack([ht.matmul(a[i].float(), b[i].float(), dev) for i in range(2)])
    assert y.dtype == z.dtype == lin.dtype == dtype
    assert torch.equal(y, fp32.to(dtype)) and torch.equal(z, fp32.to(dtype))
    assert torch.equal(lin, ht.matmul(a.float(), w.float().t(), dev).to(dtype))


def test_autocast_is_respected():
    torch.manual_seed(6)
    x = torch.randn(2, 5, 16)
    mha, lin = nn.MultiheadAttention(16, 2, batch_first=True), nn.Linear(16, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = (mha(x, x, x)[0].dtype, lin(x).dtype, F.bilinear(x, x, torch.randn(3, 16, 16)).dtype)
        with ht.offload():
            got = (mha(x, x, x)[0].dtype, lin(x), F.bilinear(x, x, torch.randn(3, 16, 16)).dtype)
    assert want == (torch.bfloat16, torch.bfloat16, torch.float32) == (got[0], got[1].dtype, got[2])
    # the product saw what autocast gives it: operands in bf16; its fp32 result plus the (bf16)
    # bias in fp32, rounded once to bf16
    assert torch.equal(got[1], (ht.matmul(x.bfloat16(), lin.weight.bfloat16().t(), fp32_out=True)
                                + lin.bias.bfloat16().float()).to(torch.bfloat16))


# ---- torch.compile -----------------------------------------------------------------------------

class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.mha = nn.MultiheadAttention(4, 2, batch_first=True)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        y = self.conv(x).flatten(2).transpose(1, 2)
        return self.out(self.mha(y, y, y)[0]).sum()


def _step(model, fn, x, context):
    model.zero_grad()
    with context:
        loss = fn(x)
        loss.backward()
    return [loss.detach(), *(p.grad.clone() for p in model.parameters())]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's own use of torch.jit
def test_torch_compile_equals_eager_under_offload_and_converted():
    torch._dynamo.reset()
    torch.manual_seed(7)
    model, x = _Net(), torch.randn(2, 2, 4, 4)
    eager = _step(model, model, x, ht.offload())
    compiled = _step(model, torch.compile(model), x, ht.offload())
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    converted = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    ht.convert(converted)
    eager = _step(converted, lambda v: converted(v).sum(), x, torch.enable_grad())
    fn = torch.compile(converted)
    compiled = _step(converted, lambda v: fn(v).sum(), x, torch.enable_grad())
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    with torch.no_grad():  # the same parameters in torch's own layers: fp32, not equal
        conv, lin = converted[0], converted[3]
        fp32 = F.linear(F.relu(F.conv2d(x, conv.weight, conv.bias, padding=1)).flatten(1), lin.weight, lin.bias).sum()
    assert not torch.equal(eager[0], fp32)


# ---- stacks of products at once ------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["emu", "emu:format=MXINT8"])
def test_a_stack_at_once_equals_its_products_one_by_one(spec):
    """Device.bmm_tensors against gemm_tensors product by product: bits, MACs and cycles."""
    dev = hbfp.host.open(spec)
    g = torch.Generator().manual_seed(8)
    cases = [(6, 30, 50, 7), (3, 24, 24, 24), (2, 1, 70, 1), (1, 5, 5, 5), (0, 4, 4, 4)]
    for nb, m, k, n in cases:
        a, b = torch.randn(nb, m, k, generator=g), torch.randn(nb, k, n, generator=g)
        if nb == 6:
            a[2, 3, 4] = float("nan")  # a NaN tile: product by product
            b[4] *= 2.0**100  # sums beyond fp32's exact range: the golden path
        if dev.identity.square:
            before = (dev.stats.macs, dev.stats.cycles)
            want = [dev.gemm_tensors(a[i], b[i]) for i in range(nb)]
        else:  # blocks along K: B stored N x K
            before = (dev.stats.macs, dev.stats.cycles)
            want = [dev.gemm_tensors(a[i], b[i].t().contiguous(), transpose_b=True) for i in range(nb)]
        one_by_one = (dev.stats.macs - before[0], dev.stats.cycles - before[1])
        got = dev.bmm_tensors(a, b)
        assert got.shape == (nb, m, n) and got.dtype == torch.float32
        assert all(torch.equal(got[i].view(torch.int32), want[i].view(torch.int32)) for i in range(nb))
        assert (dev.stats.macs - before[0] - one_by_one[0], dev.stats.cycles - before[1] - one_by_one[1]) == one_by_one
    with pytest.raises(hbfp.host.ShapeMismatch):
        hbfp.host.open("emu").bmm_tensors(torch.zeros(2, 3, 4), torch.zeros(3, 4, 5))


def test_offload_on_a_device_with_blocks_along_k():
    """MXINT8's 1 x 32 blocks: every product goes with B stored N x K, forward and backward."""
    dev = hbfp.host.open("emu:format=MXINT8")
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(40, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(5, 40)
    with ht.offload(dev):
        y = model(x)
        y.sum().backward()
        att = F.scaled_dot_product_attention(*(torch.randn(2, 1, 6, 40),) * 3)
    fmt = dev.format()
    w = model[0].weight.detach().numpy()
    want = reference_gemm(fmt, x.numpy(), w, transpose_b=True) + model[0].bias.detach().numpy()
    h = model[0](x)  # fp32 again outside the context
    assert np.array_equal(bits(ht.matmul(x, model[0].weight.t(), dev) + model[0].bias), want.view(np.uint32))
    assert not torch.equal(h, torch.from_numpy(want)) and att.shape == (2, 1, 6, 40)
    forward, backward = 5 * 40 * 16 + 5 * 16 * 3, 2 * 5 * 16 * 3 + 40 * 5 * 16  # no gradient for x
    attention = 2 * (6 * 40 * 6 + 6 * 6 * 40)
    assert dev.stats.macs == forward + backward + attention + 5 * 40 * 16  # and the check's own product


# ---- convert and wide storage around the interception ------------------------------------------

def test_convert_swaps_what_it_can_and_warns_about_the_rest():
    model = nn.Sequential(nn.Linear(8, 8), nn.MultiheadAttention(8, 2), nn.LSTM(8, 8), nn.ConvTranspose1d(8, 8, 3),
                          nn.Sequential(nn.Conv1d(8, 8, 3), nn.Bilinear(4, 4, 2)))
    mha_out = model[1].out_proj
    with pytest.warns(ht.HbfpFallbackWarning, match="Bilinear, ConvTranspose1d, LSTM, MultiheadAttention"):
        ht.convert(model)
    assert isinstance(model[0], ht.Linear) and isinstance(model[4][0], ht.Conv1d)
    assert model[1].out_proj is mha_out  # MHA reads its weight; left to the interception
    assert type(model[2]) is nn.LSTM and type(model[3]) is nn.ConvTranspose1d


def test_wide_storage_covers_attention_rnn_and_bilinear_weights():
    from hbfp.golden import HBFP16
    from hbfp import kernels

    model = nn.Sequential(nn.MultiheadAttention(24, 2), nn.GRU(24, 24), nn.Bilinear(6, 5, 4), nn.Conv3d(2, 2, 2))
    handle = ht.wide_weight_storage(model)
    names = {id(p): n for n, p in model.named_parameters()}
    stored = {names[id(w)] for w in handle.weights}
    assert stored == {"0.in_proj_weight", "0.out_proj.weight", "1.weight_ih_l0", "1.weight_hh_l0", "2.weight",
                      "3.weight"}
    for w in handle.weights:  # on the HBFP16 grid
        m = w.detach().reshape(w.shape[0], -1)
        assert torch.equal(kernels.dequantize(*kernels.quantize(m, HBFP16), HBFP16), m)


def test_dot_runs_on_the_host_where_the_thread_routes_nothing():
    """Under the matmul precision 'highest' inside offload (and for integer operands) dot and
    vdot run as torch's own computation: dot.out's CPU kernel calls the routed dot again, so
    the host's computation must not go through it (it recursed until the stack ran out)."""
    a, b = torch.arange(7.0) - 3, torch.arange(7.0) * 2 + 1  # integer values: exact in any order
    ai, bi = torch.arange(7), torch.arange(7) + 2
    with ht.offload(hbfp.host.open("emu")):
        with ht.matmul_precision("highest"):
            assert torch.equal(torch.dot(a, b), (a * b).sum()) and torch.equal(torch.vdot(a, b), (a * b).sum())
            with pytest.raises(RuntimeError, match="1D tensors of the same size"):
                torch.dot(a, b[:3])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ht.HbfpFallbackWarning)
            got = torch.dot(ai, bi)
    assert got.dtype == torch.int64 and int(got) == int((ai * bi).sum())


_ATTENTION_WIRE = """
import copy, torch, torch.nn as nn, torch.nn.functional as F
import hbfp.host, hbfp.torch as ht
torch.manual_seed(7)
class TF(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(20, 16)
        self.t = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0), 1)
        self.o = nn.Linear(16, 20)
    def forward(self, x):
        return self.o(self.t(self.e(x))).mean(1)
base = TF()
x, y = torch.randint(0, 20, (3, 5)), torch.randint(0, 20, (3,))
def train(spec):
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dev = hbfp.host.open(spec)
    for _ in range(2):
        opt.zero_grad()
        with ht.offload(dev):
            F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]
fast, wire = train("emu"), train("emu:wire=1")
moved = not all(torch.equal(p, q) for p, q in zip(fast, base.parameters()))
print("equal" if all(torch.equal(p, q) for p, q in zip(fast, wire)) and moved else "differ")
"""


def test_attention_training_steps_equal_through_the_wire_and_in_process():
    """A small transformer's steps (attention's stacked products, forward and backward) give the
    same bits on the in-process emu and through the wire protocol: a backward stack product
    reads a forward operand as the forward read it on both (not quantized again with the
    gradients' rounding on the wire). In a process of its own: run inside pytest, the
    difference this guards against did not show (the cause is not known)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _ATTENTION_WIRE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "equal"
