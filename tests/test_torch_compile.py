"""torch.compile under hbfp.torch.offload (hbfp.torch.compiled): a compiled model gives the eager
bits (losses and parameters over SGD steps, forward and backward), its products reach the device
(report() counts what eager code counts), and what cannot be compiled says so."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hbfp.host as host
import hbfp.torch as ht
from hbfp.torch import storage as hbfp_storage
from hbfp.torch.lean import _Lean

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's own use of torch.jit


class _Encoder(nn.Module):
    """A small transformer: MultiheadAttention (its products at the ATen level: projections,
    attention's bmm), layer norms, feed-forward Linears (routed functions), a mean."""

    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(20, 32)
        self.t = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0), 1)
        self.o = nn.Linear(32, 20)

    def forward(self, x):
        return self.o(self.t(self.e(x))).mean(1)


class _Stacks(nn.Module):
    """torch.matmul on stacks (``matmul``'s route): under the default recipe, matrix by matrix."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return torch.matmul(self.q(x), self.k(x).transpose(1, 2)).mean(1)


def _mlp():
    return nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def _train(model, x, y, device, compiled, steps=3, recipe=None, storage=False):
    """Losses, parameters and report of ``steps`` SGD steps of a copy of ``model`` under
    ``offload(device)``, compiled or eager."""
    torch._dynamo.reset()
    model = copy.deepcopy(model)
    fn = torch.compile(model) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if storage:
        ht.wide_weight_storage(model, opt)
    ht.reset_report()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with ht.offload(device, recipe=recipe):
            loss = F.cross_entropy(fn(x), y)
            loss.backward()
        opt.step()
        losses.append(loss.detach())
    report = {op: (c.calls, c.device_macs, c.host_macs) for op, c in ht.report().items()}
    return losses, [p.detach().clone() for p in model.parameters()], report


def _same(eager, compiled):
    (le, pe, re_), (lc, pc, rc) = eager, compiled
    assert all(torch.equal(a, b) for a, b in zip(le, lc)), (le, lc)
    assert all(torch.equal(a, b) for a, b in zip(pe, pc))
    assert rc == re_  # every product of the compiled graphs counted where and as eager code counts it
    assert all(host_macs == 0 for _, _, host_macs in rc.values())


def test_mlp_compiled_equals_eager_and_runs_on_the_device():
    torch.manual_seed(0)
    model, x, y = _mlp(), torch.randn(32, 48), torch.randint(0, 10, (32,))
    device = host.open("emu")
    eager = _train(model, x, y, device, compiled=False)
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    compiled = _train(model, x, y, device, compiled=True)
    _same(eager, compiled)
    assert set(compiled[2]) == {"linear"} and compiled[2]["linear"][1] > 0
    # one graph for the model, compiled once: a new offload context every step recompiles nothing
    assert torch._dynamo.utils.counters["frames"]["ok"] - frames == 1
    with torch.no_grad(), ht.offload(device):  # inference: the same bits as well
        assert torch.equal(torch.compile(model)(x), model(x))


def test_offload_leaves_torch_compile_as_it_found_it():
    """A model compiled and run under offload, then outside it: the same compiled model and a
    new one of the same class are compiled again (Dynamo does not skip their code), compute in
    fp32 on the host (nothing reaches the device) and give eager fp32's bits."""
    torch.manual_seed(0)
    model, x = _mlp(), torch.randn(32, 48)
    compiled = torch.compile(model)
    with torch.no_grad(), ht.offload(host.open("emu")):
        on_device = compiled(x)
    from torch._dynamo.testing import CompileCounter

    counters, counter = torch._dynamo.utils.counters, CompileCounter()
    for m in (compiled, torch.compile(copy.deepcopy(model), backend=counter)):
        frames = counters["frames"]["ok"]
        ht.reset_report()
        with torch.no_grad():
            y = m(x)
        assert counters["frames"]["ok"] > frames  # compiled again, not run eagerly
        assert torch.equal(y, model(x)) and not torch.equal(y, on_device)
        assert not ht.report()
    assert counter.frame_count == 1


def test_transformer_compiled_equals_eager_and_runs_on_the_device():
    torch.manual_seed(0)
    model, x, y = _Encoder(), torch.randint(0, 20, (4, 12)), torch.randint(0, 20, (4,))
    device = host.open("emu")
    compiled = _train(model, x, y, device, compiled=True)
    _same(_train(model, x, y, device, compiled=False), compiled)
    # the attention's and projections' products (ATen level) and the routed Linears, forward and backward
    assert {"aten.bmm", "aten.mm", "aten.addmm", "linear"} <= set(compiled[2])


def test_compiled_stacks_follow_the_recipe_and_its_seeds():
    torch.manual_seed(1)
    model, x, y = _Stacks(), torch.randn(3, 8, 16), torch.randint(0, 8, (3,))
    device = host.open("emu")
    for recipe in ("default", "nearest"):  # matrix by matrix (stochastic gradients) / the stack at once
        _same(_train(model, x, y, device, False, steps=2, recipe=recipe),
              _train(model, x, y, device, True, steps=2, recipe=recipe))


@pytest.mark.parametrize("spec,recipe", [("emu:format=MXINT8", "mxint8"), ("emu:wire=1", "nearest")])
def test_compiled_on_other_devices(spec, recipe):
    """Blocks along K (no forward codes kept), and a device reached through its driver."""
    torch.manual_seed(2)
    model, x, y = _Encoder(), torch.randint(0, 20, (2, 6)), torch.randint(0, 20, (2,))
    device = host.open(spec)
    _same(_train(model, x, y, device, False, steps=2, recipe=recipe),
          _train(model, x, y, device, True, steps=2, recipe=recipe))


def test_compiled_wide_weight_storage_and_convolutions(monkeypatch):
    """Weights in wide storage are read as their stored codes; a convolution (routed as a whole,
    ``hbfp::routed``) runs its eager route inside the compiled graph."""
    reads = []
    stored_operand = hbfp_storage._stored_operand
    monkeypatch.setattr(hbfp_storage, "_stored_operand",
                        lambda *a, **k: reads.append(k.get("storage")) or stored_operand(*a, **k))
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5))
    x, y = torch.randn(3, 2, 4, 4), torch.randint(0, 5, (3,))
    device = host.open("emu")
    eager = _train(model, x, y, device, False, steps=2, storage=True)
    reads.clear()
    compiled = _train(model, x, y, device, True, steps=2, storage=True)
    _same(eager, compiled)
    assert {"conv2d", "linear"} <= set(compiled[2])
    assert any(s is not None and s.mantissa_bits == 16 for s in reads)  # the Linear's stored codes, in the graph


def test_what_compiled_code_cannot_do_says_so():
    device = host.open("emu")
    torch._dynamo.reset()

    class Integers(nn.Module):
        def forward(self, x):
            return (x.long() @ x.long().t()).float()

    with ht.offload(device), pytest.raises(Exception, match="would run matrix products on the host: aten.mm"):
        torch.compile(Integers())(torch.ones(4, 4))

    lin = torch.compile(nn.Linear(8, 8))
    stochastic_forward = ht.Recipe("sf", forward=ht.ProductConfig(rounding="stochastic"))
    with ht.offload(device, recipe=stochastic_forward), pytest.raises(NotImplementedError, match="forward"):
        lin(torch.randn(4, 8))
    torch._dynamo.reset()
    with ht.offload(device):
        lin(torch.randn(4, 8))
        with ht.matmul_precision("highest"), pytest.raises(RuntimeError, match="'highest'"):
            lin(torch.randn(4, 8))
    assert lin(torch.randn(4, 8)).shape == (4, 8)  # outside offload: compiled again, torch's own products


class _Products(nn.Module):
    """Products of every layout the lean path reads: a Linear (its weight a transposed view), a
    weight multiplied as it is stored (``torch.matmul(h, w)``), and an input without gradient."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(30, 40)
        self.w = nn.Parameter(torch.randn(40, 26) / 7)

    def forward(self, x):
        return torch.matmul(torch.relu(self.a(x)), self.w)


_TOWARD_ZERO = ht.Recipe("tz", grad_input=ht.ProductConfig(rounding="toward_zero"),
                         grad_weight=ht.ProductConfig(rounding="stochastic"), seed=5)
_BF16_OUT = ht.Recipe("bf16", grad_weight=ht.ProductConfig(out="bf16"))


@pytest.mark.parametrize("recipe,lean", [("default", True), ("nearest", True), (_TOWARD_ZERO, True),
                                         (_BF16_OUT, False)])
def test_lean_products_equal_the_general_path(monkeypatch, recipe, lean):
    """``HbfpMatmul``'s lean path (``hbfp.torch.lean._Lean``: the kernels called without the general
    path's layers) gives the general path's bits, seeds and counts, device cycles included,
    eager and compiled, under recipes with gradients rounded each way; a recipe with a bf16
    result takes the general path."""
    calls = []
    forward, of = _Lean.forward, _Lean.of
    monkeypatch.setattr(_Lean, "forward", lambda self, *a: calls.append(1) or forward(self, *a))
    torch.manual_seed(4)
    model, x, y = _Products(), torch.randn(35, 30), torch.randint(0, 26, (35,))

    def run(compiled):
        device = host.open("emu")
        return _train(model, x, y, device, compiled, steps=2, recipe=recipe), (device.stats.cycles, device.stats.macs)

    monkeypatch.setattr(_Lean, "of", classmethod(lambda cls, device: None))
    general, general_stats = run(False)
    assert not calls
    monkeypatch.setattr(_Lean, "of", of)
    for compiled in (False, True):
        result, stats = run(compiled)
        _same(general, result)
        assert stats == general_stats and stats[1] > 0
    assert bool(calls) == lean


def test_lean_products_of_empty_and_strided_operands():
    """Empty sides, a zero-stride gradient (a sum's) and sliced operands: the general path's
    results, gradients and counts."""
    torch.manual_seed(6)
    cases = [(torch.randn(0, 30), torch.randn(30, 9)), (torch.randn(5, 0), torch.randn(0, 9)),
             (torch.randn(40, 60)[::2, 5:35], torch.randn(9, 30).t()), (torch.randn(7, 30), torch.randn(30, 50)[:, ::3])]
    for a0, b0 in cases:
        results = []
        for lean in (False, True):
            device = host.open("emu")
            a, b = a0.clone().requires_grad_() if a0.is_contiguous() else a0.requires_grad_(), b0.requires_grad_()
            of = _Lean.of
            if not lean:
                _Lean.of = classmethod(lambda cls, d: None)
            try:
                ht.reset_report()
                with ht.offload(device):
                    y = ht.matmul(a, b, device)
                    y.sum().backward()
            finally:
                _Lean.of = of
            results.append((y.detach(), a.grad, b.grad, ht.report(), device.stats.cycles, device.stats.macs))
            a.grad = b.grad = None
        (y0, ga0, gb0, r0, c0, m0), (y1, ga1, gb1, r1, c1, m1) = results
        assert torch.equal(y0, y1) and r0 == r1 and (c0, m0) == (c1, m1)
        assert (ga0 is None) == (ga1 is None) and (ga0 is None or torch.equal(ga0, ga1))
        assert (gb0 is None) == (gb1 is None) and (gb0 is None or torch.equal(gb0, gb1))
