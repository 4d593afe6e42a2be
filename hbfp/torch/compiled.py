"""``torch.compile`` under ``hbfp.torch.offload``: the device's products as operators of the
compiled graph, everything else compiled by Inductor, with the bits of the eager code.

A compiled graph calls no Python of the model, so the two layers through which ``offload``
routes eager products (docs/torch.md) become operators of the ``hbfp`` namespace
(``torch.library.custom_op``: a fake implementation gives Dynamo and Inductor the shapes; the
real one computes on the device of the ``offload`` context the graph runs in, through the code
the eager routes use):

- The functions ``offload``'s torch-function mode routes: while Dynamo traces, the mode
  (``route``) emits ``hbfp::mm`` (a 2-D product: ``HbfpMatmul``'s forward) or ``hbfp::bmm`` (a
  stack, as ``matmul`` multiplies it) for ``linear``, ``matmul`` and ``addmm`` and their
  families, with autograd formulas (``register_autograd``) whose backward products are
  ``hbfp::mm_backward`` and ``hbfp::bmm_backward`` (``HbfpMatmul``'s backward, reading the
  forward's codes: ``_Saved``). Convolutions and ``bilinear`` become ``hbfp::routed``: their
  eager route runs inside the operator, autograd records its backward there, and
  ``hbfp::routed_backward`` runs it.
- The products that reach ATen (attention, ``nn.MultiheadAttention``'s projections, einsum,
  every product of torch's derivative formulas): on a thread where an ``offload`` context is
  active, Inductor's decomposition table maps the product operators (``aten.mm``, ``addmm``,
  ``bmm``, ...) to ``hbfp::aten_mm`` and ``hbfp::aten_bmm`` with ``AtenOffload``'s handlers,
  below autograd. What ``AtenOffload`` decides when it runs, from the tensors' memory (whether
  a backward product's operand is a forward operand: ``hbfp.torch.operands``), is decided
  when the graph is traced, from the traced tensors' storage (``_Traced``), and passed as the
  operators' arguments.

Every operator counts its calls and MACs in ``report()`` as the eager code counts them, and
draws the seeds of its stochastic roundings from the recipe of its context in the eager order:
the operators are ordered effects (``EffectType.ORDERED``), so the compiled graphs keep them in
the order they were traced, the eager one (the autograd engine's, for the backward graph).
This module holds the context the operators run in and ``hbfp::mm``, ``hbfp::bmm``;
``hbfp.torch.compiled_routed`` ``hbfp::routed``; ``hbfp.torch.compiled_aten`` the ATen-level
operators and their decompositions; ``hbfp.torch.compiled_trace`` what Dynamo and Inductor are
given while an ``offload`` context is active (``route``, ``compiling``).

Inductor's kernels compute what they fuse in an order of their own, and a reduction (a sum, a
softmax, a layer_norm) may then round otherwise than ATen's kernel: ``_EAGER_KERNELS`` stay
calls of their ATen kernels in a compiled graph (neither decomposed nor lowered), with their
operands in the eager layout. A product the graph would still run on the host (operands that
are not floating point, an operator with no route) stops the compilation with an error that
names it (``HostProducts``). Not compiled (a clear error): recipes that round forward operands
stochastically, and a compiled graph run under the matmul precision 'highest'.
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from types import SimpleNamespace

import torch
from torch._library.effects import EffectType

from . import aten as _aten
from . import counts as _report

ops = torch.ops.hbfp


# ---- the context a compiled graph runs in ------------------------------------------------------

def _context():
    """The ``_Product`` of the ``offload`` context active on this thread: a compiled graph with
    the device's products runs inside one, its products routed (not under the precision
    'highest', under which the eager code would compute them on the host)."""
    routes = getattr(_aten._local, "routes", None)
    if not routes:
        raise RuntimeError("a graph compiled under hbfp.torch.offload runs its products on the device of an offload "
                           "context: run it inside one (or torch._dynamo.reset() to compile it again)")
    product, active = routes[-1]
    if not active():
        raise RuntimeError("a graph compiled under hbfp.torch.offload runs its products on the device, but the matmul "
                           "precision is 'highest' here: run that code eagerly (torch.compiler.disable), or outside "
                           "offload")
    return product


def _forward_config(in_use):
    cfg = in_use.recipe.forward
    if cfg.rounding == "stochastic":
        raise NotImplementedError(f"recipe {in_use.recipe.name!r} rounds forward operands stochastically: compiled "
                                  "products under offload support forward roundings to nearest or toward zero only "
                                  "(run the model eagerly)")
    return cfg


class _Saved:
    """What a compiled forward product keeps for its backward products (``HbfpMatmul``'s
    context: the operands' codes, the recipe's stream), per ``offload`` context, by the handle
    the forward operator returns; the backward operator takes it out. Without it (a backward
    in another context) the forward's operands are quantized again: to nearest, the same
    codes."""

    _lock = threading.Lock()
    _handles = itertools.count(1)
    _by_context: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    @classmethod
    def keep(cls, product, entry) -> int:
        with cls._lock:
            handle = next(cls._handles)
            cls._by_context.setdefault(product, {})[handle] = entry
        return handle

    @classmethod
    def take(cls, product, handle: int):
        with cls._lock:
            return cls._by_context.get(product, {}).pop(handle, None)


def _unrouted(fn):
    """An operator's implementation runs as ``offload``'s routes run in eager code: without the
    torch-function mode (which is active where the compiled graph runs), so that the torch
    functions it calls are themselves."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch._C.DisableTorchFunction():
            return fn(*args, **kwargs)
    return run


def _handle(value: int) -> torch.Tensor:
    return torch.full((), value, dtype=torch.int64)


def _weights(*xs) -> list[bool]:
    """Whether each traced operand is (a view of) a weight, for the stream of seeds
    (``RecipeInUse.note``: the compiled graph's operands no longer say so when it runs)."""
    from hbfp.recipes import _weight_of

    return [_weight_of(x) is not None for x in xs]


def _note_weights(product, operands, weights: list[bool]) -> None:
    product.in_use.note_weights(*(x for x, w in zip(operands, weights) if w))


# ---- the routed functions' products: hbfp::mm, hbfp::bmm ---------------------------------------

def _stored_codes(b: torch.Tensor, storage: list[int], device):
    """The codes the device reads of a weight in wide storage (``b`` its transpose, as
    ``linear`` multiplies it); ``storage``: its format's mantissa bits and tile."""
    from hbfp.golden import Format

    from .storage import _stored_operand

    return _stored_operand(b.t(), device, storage=Format(storage[0], (storage[1], storage[2])))


def _mm_forward(product, a, b, storage: list[int]):
    """``HbfpMatmul``'s forward on the context's device: the product and the context its
    backward reads."""
    from .autograd import HbfpMatmul
    from .config import recipe_in_use

    in_use = recipe_in_use()
    _forward_config(in_use)
    stored = _stored_codes(b, storage, product.device) if storage else None
    ctx = SimpleNamespace()
    y = HbfpMatmul.forward(ctx, a, b, product.device, stored, in_use)
    return y, ctx


def _like(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y`` in the layout of ``x`` (``torch.empty_like``'s: the layout the fake implementations
    give), copied only where it is not."""
    if y.stride() == x.stride() or y.stride() == torch.empty_like(x).stride():
        return y
    out = torch.empty_like(x)
    out.copy_(y)
    return out


@torch.library.custom_op("hbfp::mm", mutates_args=())
@_unrouted
def _mm(a: torch.Tensor, b: torch.Tensor, label: str, storage: list[int], save: bool,
        weights: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """``a @ b`` (2-D fp32) on the device as ``HbfpMatmul`` computes it, counted as a call of
    ``label``; ``storage``: b's transpose is a weight in wide storage of that format (mantissa
    bits, tile; empty: none); ``save``: keep the codes for the backward products (the returned
    handle); ``weights``: whether a and b are (views of) weights, as traced (``_weights``)."""
    product = _context()
    _note_weights(product, (a, b), weights)
    _report.count_call(label)
    with _report.routing(label):
        y, ctx = _mm_forward(product, a, b, storage)
    return y.contiguous(), _handle(_Saved.keep(product, ctx) if save else 0)


@_mm.register_fake
def _(a, b, label, storage, save, weights):
    return a.new_empty(a.shape[0], b.shape[1]), a.new_empty((), dtype=torch.int64)


@torch.library.custom_op("hbfp::mm_backward", mutates_args=())
@_unrouted
def _mm_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor, handle: torch.Tensor, label: str,
                 storage: list[int], need_a: bool, need_b: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``HbfpMatmul``'s backward products of ``hbfp::mm`` (those asked for; an empty tensor in
    place of the other)."""
    from .autograd import HbfpMatmul

    product = _context()
    ctx = _Saved.take(product, int(handle))
    with _report.routing(label):
        if ctx is None:
            _, ctx = _mm_forward(product, a, b, storage)
        ctx.needs_input_grad = (need_a, need_b)
        grad_a, grad_b = HbfpMatmul._backward(ctx, grad)[:2]
    empty = grad.new_empty(0)
    return (_like(grad_a, a) if need_a else empty), (_like(grad_b, b) if need_b else empty)


@_mm_backward.register_fake
def _(grad, a, b, handle, label, storage, need_a, need_b):
    empty = grad.new_empty(0)
    return (torch.empty_like(a) if need_a else empty), (torch.empty_like(b) if need_b else empty)


def _mm_setup(ctx, inputs, output):
    a, b, label, storage, _, _ = inputs
    ctx.save_for_backward(a, b, output[1])
    ctx.label, ctx.storage = label, storage


def _mm_grad(ctx, grad, _):
    a, b, handle = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    grad_a, grad_b = ops.mm_backward(grad, a, b, handle, ctx.label, ctx.storage, need_a, need_b)
    return (grad_a if need_a else None), (grad_b if need_b else None), None, None, None, None


_mm.register_autograd(_mm_grad, setup_context=_mm_setup)


def _bmm_at_once(recipe) -> bool:
    """Whether ``matmul`` multiplies a stack at once (``HbfpBmm``) under ``recipe``, rather than
    matrix by matrix (``HbfpMatmul`` each, as any other rounding or output needs)."""
    return all(c.rounding == "nearest_even" and c.out == "fp32" for c in recipe.products.values())


@torch.library.custom_op("hbfp::bmm", mutates_args=())
@_unrouted
def _bmm(a: torch.Tensor, b: torch.Tensor, label: str, save: bool,
         weights: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """The stack ``a[i] @ b[i]`` (3-D fp32) as ``matmul`` computes it: at once (``HbfpBmm``), or
    matrix by matrix (``HbfpMatmul``) under a recipe that rounds otherwise than to nearest;
    ``weights`` as ``hbfp::mm``'s."""
    from .config import recipe_in_use
    from .device import _device_bmm

    product = _context()
    _note_weights(product, (a, b), weights)
    in_use = recipe_in_use()
    _report.count_call(label)
    with _report.routing(label):
        if _bmm_at_once(in_use.recipe):
            y, ctx = _device_bmm(product.device, a, b), None
        else:
            pairs = [_mm_forward(product, a[i], b[i], []) for i in range(a.shape[0])]
            y, ctx = torch.stack([p[0] for p in pairs]), [p[1] for p in pairs]
    return y.contiguous(), _handle(_Saved.keep(product, ctx) if save and ctx is not None else 0)


@_bmm.register_fake
def _(a, b, label, save, weights):
    return a.new_empty(a.shape[0], a.shape[1], b.shape[2]), a.new_empty((), dtype=torch.int64)


@torch.library.custom_op("hbfp::bmm_backward", mutates_args=())
@_unrouted
def _bmm_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor, handle: torch.Tensor, label: str,
                  need_a: bool, need_b: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward products of ``hbfp::bmm``: ``HbfpBmm``'s, or each matrix's ``HbfpMatmul``
    ones, the last matrix's first (the autograd engine's order: the latest node first)."""
    from .autograd import HbfpMatmul
    from .config import recipe_in_use
    from .device import _device_bmm

    product = _context()
    grad_a = grad_b = None
    with _report.routing(label):
        if _bmm_at_once(recipe_in_use().recipe):
            if need_a:
                grad_a = _device_bmm(product.device, grad, b.transpose(1, 2))
            if need_b:
                grad_b = _device_bmm(product.device, a.transpose(1, 2), grad)
        else:
            ctxs = _Saved.take(product, int(handle))
            if ctxs is None:
                ctxs = [_mm_forward(product, a[i], b[i], [])[1] for i in range(a.shape[0])]
            ga, gb = [None] * a.shape[0], [None] * a.shape[0]
            for i in reversed(range(a.shape[0])):
                ctxs[i].needs_input_grad = (need_a, need_b)
                ga[i], gb[i] = HbfpMatmul._backward(ctxs[i], grad[i])[:2]
            grad_a = torch.stack(ga) if need_a else None
            grad_b = torch.stack(gb) if need_b else None
    empty = grad.new_empty(0)
    return (_like(grad_a, a) if need_a else empty), (_like(grad_b, b) if need_b else empty)


@_bmm_backward.register_fake
def _(grad, a, b, handle, label, need_a, need_b):
    empty = grad.new_empty(0)
    return (torch.empty_like(a) if need_a else empty), (torch.empty_like(b) if need_b else empty)


def _bmm_setup(ctx, inputs, output):
    a, b, label, _, _ = inputs
    ctx.save_for_backward(a, b, output[1])
    ctx.label = label


def _bmm_grad(ctx, grad, _):
    a, b, handle = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    grad_a, grad_b = ops.bmm_backward(grad, a, b, handle, ctx.label, need_a, need_b)
    return (grad_a if need_a else None), (grad_b if need_b else None), None, None, None


_bmm.register_autograd(_bmm_grad, setup_context=_bmm_setup)


for _op in (_mm, _mm_backward, _bmm, _bmm_backward):
    _op.register_effect(EffectType.ORDERED)
