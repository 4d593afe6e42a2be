"""nn.LSTM under offload (hbfp.torch.rnn): the recurrence's arithmetic against torch's own LSTM
(with exact products), its products on the device, the same bits as the wire-level emu, and
what goes to ATen's LSTM instead."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import hbfp.host
import hbfp.torch as ht
from hbfp.torch import aten, autograd, rnn  # noqa: F401 (aten: below)
from hbfp.torch.device import _device_work
from hbfp.torch.lean import _Lean


def _exact_products(monkeypatch):
    """Every product of hbfp.torch in fp32 (operands unquantized): what remains is the
    recurrence's own arithmetic. (hbfp.torch.aten binds autograd's ``_product`` and ``_operand``
    when it is first imported, which ``offload`` does: it is imported above, before any patch,
    so that it never keeps these for the tests after.)"""
    def product(device, a, b, cfg, rounding, transpose_a=False, transpose_b=False, **kw):
        with _device_work():
            return (a.t() if transpose_a else a).detach() @ (b.t() if transpose_b else b).detach()

    monkeypatch.setattr(autograd, "_product", product)
    monkeypatch.setattr(autograd, "_operand", lambda device, x, cfg, rounding: x)
    monkeypatch.setattr(_Lean, "of", classmethod(lambda cls, device: None))  # HbfpMatmul's general path


def _run(lstm, x, hx, context):
    lstm.zero_grad()
    leaves = [x, *(hx or ())]
    for t in leaves:
        t.grad = None
    with context:
        y, (h, c) = lstm(x, hx) if hx is not None else lstm(x)
        (y.sin().sum() + h.cos().sum() + (c * c).sum()).backward()
    return [y, h, c] + [t.grad for t in leaves] + [p.grad for p in lstm.parameters()]


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("layers,bias,given", [(2, True, True), (1, False, True), (3, True, False)])
def test_recurrence_with_exact_products_is_torchs_lstm(monkeypatch, batch_first, layers, bias, given):
    torch.manual_seed(3)
    lstm = nn.LSTM(12, 20, layers, bias=bias, batch_first=batch_first)
    b, t = 5, 7
    x = torch.randn(*((b, t) if batch_first else (t, b)), 12, requires_grad=True)
    hx = (torch.randn(layers, b, 20, requires_grad=True), torch.randn(layers, b, 20, requires_grad=True)) if given \
        else None
    ref = [r.clone() for r in _run(lstm, x, hx, torch.enable_grad())]
    _exact_products(monkeypatch)
    ht.reset_report()
    got = _run(lstm, x, hx, ht.offload(hbfp.host.open("emu")))
    assert "lstm" in ht.report() and not any(k.startswith("aten.") for k in ht.report())
    assert got[0].shape == ref[0].shape and got[0].is_contiguous()
    for mine, theirs in zip(got, ref):
        assert mine.shape == theirs.shape
        assert (mine - theirs).abs().max() <= 2e-6 * theirs.abs().max()


@pytest.mark.parametrize("given,forward", [(False, "nearest_even"), (True, "nearest_even"), (True, "stochastic")])
def test_lstm_products_on_the_device_same_bits_as_the_wire(given, forward):
    """The lean path (a layer's steps in one call of the compiled kernels) against the wire's
    general path: the same losses, parameters, gradients of a given initial state, and counts;
    with forward operands rounded stochastically too (each step's state its own seed)."""
    from hbfp.recipes import ProductConfig, Recipe

    recipe = Recipe("lstm-test", forward=ProductConfig(rounding=forward))
    torch.manual_seed(5)
    lstm = nn.LSTM(16, 24, 2, batch_first=True)
    head = nn.Linear(24, 7)
    x, y = torch.randn(6, 9, 16), torch.randint(0, 7, (6,))
    hx = (torch.randn(2, 6, 24), torch.randn(2, 6, 24)) if given else None

    def train(device, steps=2):
        m, h = copy.deepcopy(lstm), copy.deepcopy(head)
        opt = torch.optim.SGD([*m.parameters(), *h.parameters()], lr=0.1)
        losses, state_grads = [], []
        for _ in range(steps):
            opt.zero_grad()
            state = tuple(t.clone().requires_grad_() for t in hx) if given else None
            with ht.offload(device, recipe=recipe):
                loss = nn.functional.cross_entropy(h(m(x, state)[0][:, -1]), y)
                loss.backward()
            opt.step()
            losses.append(loss.detach())
            state_grads += [t.grad for t in state] if given else []
        return losses, [p.detach().clone() for p in [*m.parameters(), *h.parameters()]], state_grads

    dev = hbfp.host.open("emu")
    ht.reset_report()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ht.HbfpFallbackWarning)
        fast = train(dev)
    report = ht.report()
    assert report["lstm"].host_macs == 0 and report["lstm"].device_macs > 0
    ht.reset_report()
    wire = train(hbfp.host.open("emu:wire=1"))
    assert ht.report()["lstm"] == report["lstm"]
    assert all(torch.equal(p, q) for p, q in zip(fast[0] + fast[1] + fast[2], wire[0] + wire[1] + wire[2]))
    assert len(fast[2]) == (4 if given else 0)


@pytest.mark.parametrize("kind", ["bidirectional", "proj_size", "packed"])
def test_other_lstms_run_as_atens_with_products_on_the_device(kind):
    torch.manual_seed(2)
    lstm = nn.LSTM(8, 10, bidirectional=kind == "bidirectional", proj_size=6 if kind == "proj_size" else 0)
    x = torch.randn(5, 3, 8, requires_grad=True)
    arg = nn.utils.rnn.pack_padded_sequence(x, [5, 4, 2]) if kind == "packed" else x
    ht.reset_report()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ht.HbfpFallbackWarning)
        with ht.offload(hbfp.host.open("emu")):
            out = lstm(arg)[0]
            out = out.data if kind == "packed" else out
            out.sum().backward()
    report = ht.report()
    assert "lstm" not in report and sum(c.device_macs for c in report.values()) > 0
    assert sum(c.host_macs for c in report.values()) == 0 and x.grad is not None


def test_applies_only_to_what_it_computes():
    w = [torch.randn(16, 3), torch.randn(16, 4), torch.randn(16), torch.randn(16)]
    x, hx = torch.randn(5, 2, 3), (torch.zeros(1, 2, 4), torch.zeros(1, 2, 4))
    assert rnn.applies((x, hx, w, True, 1, 0.0, True, False, False), {})
    assert not rnn.applies((x, hx, w, True, 1, 0.0, True, True, False), {})           # bidirectional
    assert not rnn.applies((x.double(), hx, w, True, 1, 0.0, True, False, False), {})  # not fp32
    assert not rnn.applies((x, torch.tensor([5, 4]), hx, w, True, 1, 0.0, True, False), {})  # packed
    with torch.autocast("cpu"):
        assert not rnn.applies((x, hx, w, True, 1, 0.0, True, False, False), {})
    assert not rnn.applies((x[:0], hx, w, True, 1, 0.0, True, False, False), {})  # empty: ATen's error


def test_an_empty_sequence_raises_torchs_error():
    lstm = nn.LSTM(3, 4)
    with ht.offload(hbfp.host.open("emu")), pytest.raises(RuntimeError, match="sequence length"):
        lstm(torch.randn(0, 2, 3))


def test_dropout_between_layers_in_training_only():
    torch.manual_seed(1)
    lstm = nn.LSTM(8, 8, 3, dropout=0.5)
    x = torch.randn(4, 2, 8)
    with ht.offload(hbfp.host.open("emu")):
        torch.manual_seed(0)
        a = lstm(x)[0]
        torch.manual_seed(1)
        b = lstm(x)[0]
        lstm.eval()
        c, d = lstm(x)[0], lstm(x)[0]
    assert not torch.equal(a, b) and torch.equal(c, d)
