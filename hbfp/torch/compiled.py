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

Inductor's kernels compute what they fuse in an order of their own, and a reduction (a sum, a
softmax, a layer_norm) may then round otherwise than ATen's kernel: ``_EAGER_KERNELS`` stay
calls of their ATen kernels in a compiled graph (neither decomposed nor lowered), with their
operands in the eager layout. A product the graph would still run on the host (operands that
are not floating point, an operator with no route) stops the compilation with an error that
names it (``HostProducts``). Not compiled (a clear error): recipes that round forward operands
stochastically, and a compiled graph run under the matmul precision 'highest'.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import threading
import weakref
from types import SimpleNamespace

import torch
from torch._library.effects import EffectType

from . import aten as _aten
from . import counts as _report

__all__ = ["route", "compiling"]

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


def _forward_config(rounding):
    cfg = rounding.recipe.forward
    if cfg.rounding == "stochastic":
        raise NotImplementedError(f"recipe {rounding.recipe.name!r} rounds forward operands stochastically: compiled "
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


# ---- the routed functions' products: hbfp::mm, hbfp::bmm ---------------------------------------

def _stored_codes(b: torch.Tensor, storage: list[int], device):
    """The codes the device reads of a weight in wide storage (``b`` its transpose, as
    ``linear`` multiplies it); ``storage``: its format's mantissa bits and tile."""
    from hbfp.golden import Format

    from . import _stored_operand

    return _stored_operand(b.t(), device, storage=Format(storage[0], (storage[1], storage[2])))


def _mm_forward(product, a, b, storage: list[int]):
    """``HbfpMatmul``'s forward on the context's device: the product and the context its
    backward reads."""
    from . import HbfpMatmul, current_rounding

    rounding = current_rounding()
    _forward_config(rounding)
    stored = _stored_codes(b, storage, product.device) if storage else None
    ctx = SimpleNamespace()
    y = HbfpMatmul.forward(ctx, a, b, product.device, stored, rounding)
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
    from . import HbfpMatmul

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
    from . import _device_bmm, current_rounding

    product = _context()
    _note_weights(product, (a, b), weights)
    rounding = current_rounding()
    _report.count_call(label)
    with _report.routing(label):
        if _bmm_at_once(rounding.recipe):
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
    from . import HbfpMatmul, _device_bmm, current_rounding

    product = _context()
    grad_a = grad_b = None
    with _report.routing(label):
        if _bmm_at_once(current_rounding().recipe):
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


# ---- the other routed functions: hbfp::routed ----------------------------------------------------

def _template(args, kwargs):
    """The tensors among a call's arguments, and the rest as text (``repr``: literals, with each
    tensor as its index), which ``_arguments`` reads back."""
    tensors = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return ("__tensor__", len(tensors) - 1)
        if isinstance(v, (tuple, list)):
            return tuple(walk(x) for x in v)
        return v

    return tensors, repr((tuple(walk(a) for a in args), {k: walk(v) for k, v in kwargs.items()}))


def _arguments(template: str, tensors):
    import ast

    def fill(v):
        if isinstance(v, tuple) and len(v) == 2 and v[0] == "__tensor__":
            return tensors[v[1]]
        if isinstance(v, tuple):
            return tuple(fill(x) for x in v)
        return v

    args, kwargs = ast.literal_eval(template)
    return [fill(a) for a in args], {k: fill(v) for k, v in kwargs.items()}


@contextlib.contextmanager
def _recording():
    """Autograd on inside an operator's implementation, which runs below autograd (its keys
    excluded, as the dispatcher calls it) and, in a compiled graph, without grad mode."""
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set()
    for key in (C.DispatchKey.AutogradFunctionality, C.DispatchKey.AutogradOther, C.DispatchKey.AutogradNestedTensor):
        exclude = exclude.remove(key)
    with C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def _run_route(product, name: str, tensors, template: str, requires):
    """The eager route ``name`` (``offload``'s, e.g. ``conv2d``) on the context's device, with
    autograd recording its backward: (its output, the leaves standing for ``tensors``)."""
    from . import _ROUTES

    routed = next(r for r in _ROUTES.values() if r.name == name)
    leaves = [t.detach().requires_grad_(bool(r) and t.is_floating_point()) for t, r in zip(tensors, requires)]
    args, kwargs = _arguments(template, leaves)
    stand_in = SimpleNamespace(device=product.device, product=product)  # what the routes read of the mode
    with _recording(), torch.autocast("cpu", enabled=False):
        y = routed(stand_in, *args, **kwargs)
    if not isinstance(y, torch.Tensor):
        raise NotImplementedError(f"hbfp.torch.offload has no route of {name} with these arguments in a compiled "
                                  "graph: run it eagerly (torch.compiler.disable)")
    return y, leaves


@torch.library.custom_op("hbfp::routed", mutates_args=())
@_unrouted
def _routed(name: str, tensors: list[torch.Tensor], template: str, requires: list[bool],
            save: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A function ``offload`` routes as a whole (a convolution, ``bilinear``), computed by its
    eager route: the same products, counted alike; ``template``: its other arguments
    (``_template``). With ``save``, the autograd graph the route recorded is kept for
    ``hbfp::routed_backward`` (the returned handle)."""
    product = _context()
    y, leaves = _run_route(product, name, tensors, template, requires)
    handle = _Saved.keep(product, (y, leaves)) if save and y.requires_grad else 0
    return y.detach().contiguous(), _handle(handle)


@_routed.register_fake
def _(name, tensors, template, requires, save):
    import torch.nn.functional as F

    args, kwargs = _arguments(template, tensors)
    with torch._C.DisableTorchFunction():  # torch's own function gives the shape and dtype
        y = getattr(F, name)(*args, **kwargs)
    return y.new_empty(y.shape), tensors[0].new_empty((), dtype=torch.int64)


@torch.library.custom_op("hbfp::routed_backward", mutates_args=())
@_unrouted
def _routed_backward(grad: torch.Tensor, handle: torch.Tensor, name: str, tensors: list[torch.Tensor],
                     template: str, needs: list[bool]) -> list[torch.Tensor]:
    """The backward of ``hbfp::routed``: the recorded graph's (recorded again where it was not
    kept), for the tensors ``needs`` asks for (an empty tensor in place of the others)."""
    product = _context()
    kept = _Saved.take(product, int(handle))
    y, leaves = kept if kept is not None else _run_route(product, name, tensors, template, needs)
    wanted = [x for x, n in zip(leaves, needs) if n and x.requires_grad]
    grads = iter(torch.autograd.grad(y, wanted, grad, allow_unused=True) if wanted else ())
    out = []
    for t, x, n in zip(tensors, leaves, needs):
        g = next(grads) if n and x.requires_grad else None
        out.append(grad.new_empty(0) if g is None else _like(g, t))
    return out


@_routed_backward.register_fake
def _(grad, handle, name, tensors, template, needs):
    return [torch.empty_like(t) if n else grad.new_empty(0) for t, n in zip(tensors, needs)]


def _routed_setup(ctx, inputs, output):
    name, tensors, template, requires, _ = inputs
    ctx.save_for_backward(output[1], *tensors)
    ctx.name, ctx.template = name, template


def _routed_grad(ctx, grad, _):
    handle, *tensors = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[1])
    grads = ops.routed_backward(grad, handle, ctx.name, tensors, ctx.template, needs)
    return None, [g if n else None for g, n in zip(grads, needs)], None, None, None


_routed.register_autograd(_routed_grad, setup_context=_routed_setup)


# ---- the ATen-level products: hbfp::aten_mm, hbfp::aten_bmm -------------------------------------

def _aten_operand(product, x, cfg, backward: bool, forward_operand: bool):
    """``x`` as ``AtenOffload``'s product reads it (``_Product._operand``: a forward operand is
    remembered with its codes), with whether a backward product's operand is a forward operand
    decided when the graph was traced: its forward codes where its memory is remembered, else
    quantized again as the forward quantized it (to nearest: the same codes)."""
    from . import _operand

    if not backward:
        return product._operand(x, cfg, True)
    if product.forward is not None and forward_operand:
        hit, codes = product.forward.lookup(x)
        if hit and codes is not None:
            return codes
        return _operand(product.device, x, _forward_config(product.rounding), product.rounding)
    return _operand(product.device, x, cfg, product.rounding)


def _aten_stack(product, x, cfg, backward: bool, forward_operand: bool, seed: int):
    """A stack's codes as ``_Product._stack`` makes them, with the trace's knowledge of
    ``_aten_operand``."""
    from hbfp.host.device import stack_codes

    if not backward:
        return product._stack(x, cfg, True, seed)
    if forward_operand:
        hit, codes = product.forward.lookup(x)
        if hit and codes is not None:
            return codes
        return stack_codes(x.detach(), product.device.format(_forward_config(product.rounding).rounding), 0)
    return stack_codes(x.detach(), product.device.format(cfg.rounding), seed)


def _aten_config(product, backward: bool):
    recipe = product.rounding.recipe
    return recipe.grad_input if backward else _forward_config(product.rounding)


@torch.library.custom_op("hbfp::aten_mm", mutates_args=())
@_unrouted
def _aten_mm(a: torch.Tensor, b: torch.Tensor, label: str, backward: bool, a_forward: bool,
             b_forward: bool) -> torch.Tensor:
    """A 2-D fp32 product of an ATen operator (``label``) as ``AtenOffload`` computes it:
    ``backward``, and whether each operand is a forward operand, as traced."""
    from . import _device_work, _product

    product = _context()
    cfg = _aten_config(product, backward)
    _report.count_call(label)
    with _report.routing(label):
        with _device_work():
            qa = _aten_operand(product, a, cfg, backward, a_forward)
            qb = _aten_operand(product, b, cfg, backward, b_forward)
        return _product(product.device, qa, qb, cfg, product.rounding).contiguous()


@_aten_mm.register_fake
def _(a, b, label, backward, a_forward, b_forward):
    return a.new_empty(a.shape[0], b.shape[1])


@torch.library.custom_op("hbfp::aten_bmm", mutates_args=())
@_unrouted
def _aten_bmm(a: torch.Tensor, b: torch.Tensor, label: str, backward: bool, a_forward: bool,
              b_forward: bool) -> torch.Tensor:
    """A stack of fp32 products of an ATen operator as ``AtenOffload`` computes it
    (``_Product.batched``), with the trace's knowledge of ``hbfp::aten_mm``."""
    from hbfp.host.device import _seeds

    from . import _device_bmm, _device_work, _out

    product = _context()
    cfg = _aten_config(product, backward)
    _report.count_call(label)
    with _report.routing(label):
        seed = product.rounding.seed(cfg)
        if product.direct and product.forward is not None and a.shape[0] and a.shape[1] and b.shape[2] and a.shape[2]:
            sa, sb, _ = _seeds(seed, cfg.rounding)
            with _device_work():
                qa = _aten_stack(product, a, cfg, backward, a_forward, sa)
                qb = _aten_stack(product, b, cfg, backward, b_forward, sb)
            y = _out(_device_bmm(product.device, qa, qb), cfg)
        else:
            y = _out(_device_bmm(product.device, a, b, cfg.rounding, seed), cfg)
        return y.contiguous()


@_aten_bmm.register_fake
def _(a, b, label, backward, a_forward, b_forward):
    return a.new_empty(a.shape[0], a.shape[1], b.shape[2])


for _op in (_mm, _mm_backward, _bmm, _bmm_backward, _routed, _routed_backward, _aten_mm, _aten_bmm):
    _op.register_effect(EffectType.ORDERED)


# ---- tracing the ATen-level products ------------------------------------------------------------

def _storage_key(x: torch.Tensor):
    """The memory a traced tensor reads, as ``operands`` keys a real one (its storage's
    identity in place of an address: traced tensors have none)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from .operands import _layout

    layout = _layout(x)
    if layout is None:
        return None
    try:
        storage = StorageWeakRef(x.untyped_storage()).cdata
    except (RuntimeError, NotImplementedError):
        return None
    return (storage, x.storage_offset(), *layout[0], x._version, x.dtype)


class _Traced:
    """The product of ``AtenOffload``'s handlers while a graph is traced: each product becomes
    ``hbfp::aten_mm`` or ``hbfp::aten_bmm``, with what ``AtenOffload`` would decide when it
    runs: whether it is a backward product (an autograd node is running), and whether each
    operand of a backward product is a forward operand (the same memory as an operand of a
    forward product of this trace, as ``operands.ForwardOperands`` says for real tensors)."""

    #: per trace (its proxy mode): the keys of the forward operands, and the tensors themselves
    #: (so that no storage is freed and its identity reused while the trace lasts)
    _forward: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, label: str):
        self.label = label

    def _flags(self, *xs) -> tuple[bool, list[bool]]:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        backward = torch._C._current_autograd_node() is not None
        mode = get_proxy_mode()
        seen = self._forward.setdefault(mode, ({}, [])) if mode is not None else ({}, [])
        keys = [_storage_key(x) for x in xs]
        if backward:
            return True, [k is not None and k in seen[0] for k in keys]
        for k, x in zip(keys, xs):
            if k is not None:
                seen[0][k] = True
                seen[1].append(x)
        return False, [False] * len(xs)

    def __call__(self, a, b):
        backward, (fa, fb) = self._flags(a, b)
        return ops.aten_mm(a, b, self.label, backward, fa, fb)

    def batched(self, a, b):
        backward, (fa, fb) = self._flags(a, b)
        return ops.aten_bmm(a, b, self.label, backward, fa, fb)


def _decomposition(name: str):
    """Inductor's decomposition of the ATen product ``name`` under ``offload``: ``AtenOffload``'s
    handler with the traced product; operands that are not floating point are left to the
    check (``HostProducts``)."""
    handler = _aten._typed(_aten._OPS[name][0])
    label = f"aten.{name}"

    def decompose(*args, **kwargs):
        tensors = [t for t in args[:3] if isinstance(t, torch.Tensor)]
        if not all(t.is_floating_point() for t in tensors):
            return NotImplemented
        return handler(_Traced(label), *args, **kwargs)

    decompose.__name__ = f"hbfp_{name}"
    return decompose


_DECOMPOSITIONS = {getattr(torch.ops.aten, name).default: _decomposition(name) for name in _aten._OPS}


# ---- the routed functions while Dynamo traces ---------------------------------------------------

def _weights(*xs) -> list[bool]:
    """Whether each traced operand is (a view of) a weight, for the stream of seeds
    (``Rounding.note``: the compiled graph's operands no longer say so when it runs)."""
    from hbfp.recipes import _weight_of

    return [_weight_of(x) is not None for x in xs]


def _note_weights(product, operands, weights: list[bool]) -> None:
    product.rounding.note_weights(*(x for x, w in zip(operands, weights) if w))


def _mm2(a, b, label: str, storage: list[int]):
    save = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    return ops.mm(a, b, label, storage, save, _weights(a, b))[0]


def _matmul(a, b, label: str, storage: list[int]):
    """``hbfp.torch.matmul``'s shapes (vectors, matrices, stacks broadcast) around
    ``hbfp::mm`` and ``hbfp::bmm``."""
    from . import _HALF

    if a.dim() == 0 or b.dim() == 0:
        raise ValueError("hbfp matmul takes vectors, matrices or stacks of matrices, not scalars")
    if a.dtype in _HALF or b.dtype in _HALF:  # as fp32 (exactly); the result rounded to their dtype
        return _matmul(a.float(), b.float(), label, storage).to(torch.promote_types(a.dtype, b.dtype))
    if b.dim() == 1:
        return _matmul(a, b[:, None], label, storage)[..., 0]
    if a.dim() == 1:
        return _matmul(a[None, :], b, label, storage)[..., 0, :]
    if a.dim() == 2 and b.dim() == 2:
        return _mm2(a, b, label, storage)
    if b.dim() == 2:
        lead = a.shape[:-1]
        return _mm2(a.reshape(-1, a.shape[-1]), b, label, storage).reshape(*lead, b.shape[-1])
    if storage:
        raise ValueError("a stored (wide) operand is a matrix, not a stack")
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    weights = _weights(a, b)
    save = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    out = ops.bmm(a, b, label, save, weights)[0]
    return out.reshape(*batch, *out.shape[-2:])


def _linear(x, weight, bias=None):
    from . import weight_storage

    storage = weight_storage(weight)
    stored = [] if storage is None else [storage.mantissa_bits, *storage.tile]
    y = _matmul(x, weight.t(), "linear", stored)
    return y + bias if bias is not None else y


def _scaled(inp, a, b, *, beta=1, alpha=1):
    return beta * inp + alpha * _matmul(a, b, "addmm", [])


_COMPILED = {"linear": _linear, "matmul": lambda a, b: _matmul(a, b, "matmul", []), "addmm": _scaled}


def _routed_call(name, args, kwargs):
    tensors, template = _template(args, kwargs)
    requires = [t.requires_grad for t in tensors]
    save = torch.is_grad_enabled() and any(requires)
    return ops.routed(name, tensors, template, requires, save)[0]


def route(mode, func, args, kwargs):
    """``offload``'s torch-function mode while Dynamo traces: the routed functions' products
    as ``hbfp`` operators (``hbfp::mm``, ``hbfp::bmm``; ``hbfp::routed`` for the convolutions
    and ``bilinear``, computed by their eager routes); everything else as it is."""
    from . import _ROUTES, _applies

    _prepare()
    routed = _ROUTES.get(func)
    if routed is None or not getattr(routed, "compiled", True) or not _applies(args, kwargs):
        return func(*args, **kwargs)
    if routed.autocast and torch.is_autocast_enabled("cpu"):  # as autocast runs a product: in its dtype
        dtype = torch.get_autocast_dtype("cpu")
        args = [t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t for t in args]
        kwargs = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.dtype == torch.float32 else v
                  for k, v in kwargs.items()}
    with torch.autocast("cpu", enabled=False):
        fn = _COMPILED.get(routed.name)
        return fn(*args, **kwargs) if fn is not None else _routed_call(routed.name, args, kwargs)


# ---- what offload sets while it is active -------------------------------------------------------

#: ATen operators with matrix products: none may remain in a graph compiled under offload.
_PRODUCT_OPERATORS = frozenset({
    *_aten._OPS, "_int_mm", "_weight_int8pack_mm", "_addmm_activation", "addr", "linear", "matmul", "einsum",
    "tensordot", "bilinear", "_trilinear", "convolution", "_convolution", "convolution_backward", "conv1d", "conv2d",
    "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "mkldnn_convolution", "mkldnn_rnn_layer",
    "lstm", "gru", "rnn_tanh", "rnn_relu", "_scaled_dot_product_attention_math",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_cudnn_attention",
    "scaled_dot_product_attention",
})


_CHECKS: dict = {}  # HostProducts by the pass it follows (made where Inductor is imported)


def _host_products_check(inner=None):
    """The ``HostProducts`` pass that runs after ``inner`` (a pass set before ``offload``)."""
    key = id(inner)
    if key in _CHECKS and _CHECKS[key][0] is inner:
        return _CHECKS[key][1]
    from pathlib import Path

    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    here = Path(__file__).parent
    code = get_hash_for_files(tuple(str(here / f) for f in ("compiled.py", "aten.py", "__init__.py")))

    class HostProducts(CustomGraphPass):
        """Inductor's last pass over each graph compiled under ``offload``: a matrix product
        that would run on the host (an operator with no route, operands that are not floating
        point) stops the compilation, naming it. Its uuid keys Inductor's caches: no graph
        compiled without offload, or by other code of this package, is reused under it."""

        def __call__(self, graph):
            if inner is not None:
                inner(graph)
            if not _active():
                return
            host = sorted({f"aten.{n.target._opname}" for n in graph.nodes
                           if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                           and n.target.namespace == "aten" and n.target._opname in _PRODUCT_OPERATORS})
            if host:
                raise RuntimeError(f"under hbfp.torch.offload, this compiled graph would run matrix products on the "
                                   f"host: {', '.join(host)} (operands that are not floating point, or an operator "
                                   "without a route); run that code eagerly (torch.compiler.disable), where offload "
                                   "routes them or reports them")

        def uuid(self):
            inner_id = inner.uuid() if inner is not None and hasattr(inner, "uuid") else None
            return (code, _active(), inner_id)

    _CHECKS[key] = (inner, HostProducts())
    return _CHECKS[key][1]


#: Operators whose results depend on an order of fp32 operations that Inductor's kernels do
#: not keep (reductions, normalizations, softmax, the accumulation of an embedding's gradient):
#: under ``offload`` they stay calls of their ATen kernels in a compiled graph, neither
#: decomposed nor lowered, with their operands in the layout the eager code gives them.
_EAGER_KERNELS = (
    "sum.default", "sum.dim_IntList", "mean.default", "mean.dim", "prod.default", "prod.dim_int",
    "var.correction", "var_mean.correction", "std.correction", "std_mean.correction", "logsumexp.default",
    "linalg_vector_norm.default", "_softmax.default", "_log_softmax.default", "_softmax_backward_data.default",
    "_log_softmax_backward_data.default", "native_layer_norm.default", "native_layer_norm_backward.default",
    "native_group_norm.default", "native_group_norm_backward.default", "native_batch_norm.default",
    "native_batch_norm_backward.default", "_native_batch_norm_legit.default",
    "_native_batch_norm_legit_no_training.default", "_native_batch_norm_legit_functional.default",
    "embedding_dense_backward.default", "nll_loss_forward.default", "nll_loss_backward.default",
    "_adaptive_avg_pool2d.default", "_adaptive_avg_pool2d_backward.default", "avg_pool2d.default",
    "avg_pool2d_backward.default", "native_dropout.default", "native_dropout_backward.default",
    "threshold_backward.default",
)

def _active() -> bool:
    """Whether an ``offload`` context is active on this thread: read while Inductor traces and
    lowers a graph (which it does on the thread that runs the compiled code). Not whether it
    routes products now (its matmul precision): a compiled graph is reused whatever the
    precision, so its products are the device's, and ``_context`` refuses to run them under
    the precision 'highest'."""
    return bool(getattr(_aten._local, "routes", None))


def _decomposition_under_offload(op, offload, original):
    """A decomposition table's entry for ``op``: ``offload``'s (``NotImplemented``: none) where
    an ``offload`` context routes products, else the table's ``original`` one (or none)."""
    def decompose(*args, **kwargs):
        if _active():
            return offload(*args, **kwargs) if offload is not None else NotImplemented
        return original(*args, **kwargs) if original is not None else NotImplemented

    decompose.__name__ = f"hbfp_{op.name().replace('::', '_').replace('.', '_')}"
    return decompose


def _lowering_under_offload(op, original):
    """``lowerings[op]``: an ATen call of ``op`` where an ``offload`` context routes products,
    else Inductor's ``original`` lowering (or its implicit fallback, where it has none)."""
    from torch._inductor import lowering

    fallback = lowering.fallback_handler(op, add_to_fallback_set=False)

    def lower(*args, **kwargs):
        return (fallback if _active() or original is None else original)(*args, **kwargs)
    return lower


def _layout_under_offload(original):
    """The layout constraint of an ``_EAGER_KERNELS`` operator: its operands in the layout the
    traced (eager) code gives them where an ``offload`` context routes products."""
    from torch._inductor import lowering

    def constrain(node, *args, **kwargs):
        if _active():
            return lowering.constrain_to_fx_strides(node, *args, **kwargs)
        return original(node, *args, **kwargs) if original is not None else (args, kwargs)
    return constrain


_install_lock = threading.Lock()
_installed = {"done": False, "probed": False, "users": 0, "checking": False, "check": None}


def _install() -> None:
    """Puts ``offload``'s entries in Inductor's tables, once per process: each acts as described
    only on a thread where an ``offload`` context is active, and as Inductor's own entry
    elsewhere (so that graphs compiled without ``offload``, on any thread, stay as they were)."""
    from torch._inductor import decomposition, lowering

    eager = []
    for name in _EAGER_KERNELS:
        packet, overload = name.split(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
        if op is not None:
            eager.append(op)
    for table in (decomposition.decompositions, decomposition.fast_random_decomps()):
        for op, fn in _DECOMPOSITIONS.items():
            table[op] = _decomposition_under_offload(op, fn, table.get(op))
        for op in eager:
            if op in table:
                table[op] = _decomposition_under_offload(op, None, table[op])
    for op in eager:
        lowering.lowerings[op] = _lowering_under_offload(op, lowering.lowerings.get(op))
        lowering._maybe_layout_constraints[op] = _layout_under_offload(lowering._maybe_layout_constraints.get(op))


_PROBE = "dynamo's probe"


def _probe() -> bool:
    """Dynamo's first compilation in a process runs each Python operator once on one-element
    tensors (to learn its torch function): run here first, where torch's own kernels compute it
    (no ``offload`` context has replaced them yet), or where this thread's context routes it
    (then on the device, and not counted in ``report()``). False where neither holds (another
    thread's context replaced the kernels): to be run later."""
    try:
        from torch._dynamo.variables.builtin import populate_builtin_to_tensor_fn_map
    except ImportError:
        return True
    routes = getattr(_aten._local, "routes", None)
    if routes and routes[-1][1]():
        with _report.routing(_PROBE):
            populate_builtin_to_tensor_fn_map()
        _report.discard(_PROBE)
        return True
    if not routes and _aten._registration["users"] == 0:
        populate_builtin_to_tensor_fn_map()
        return True
    return False


def _prepare_locked() -> None:
    """Inductor set for compiling under ``offload`` (``_install`` once; the check while any
    context is active); with ``_install_lock`` held and a context active."""
    import torch._inductor.config as inductor_config

    if not _installed["done"]:
        _install()
        _installed["done"] = True
    if not _installed["probed"]:
        _installed["probed"] = _probe()
    if not _installed["checking"]:
        _installed["check"] = inductor_config.post_grad_custom_post_pass
        inductor_config.post_grad_custom_post_pass = _host_products_check(_installed["check"])
        _installed["checking"] = True


@torch.compiler.assume_constant_result  # run (not traced) where Dynamo meets it: before Inductor compiles
def _prepare() -> bool:
    """Dynamo traces code under ``offload`` (``route``): Inductor, which compiles what it traces
    next, is set for it (the first time in a process where Inductor was not in use when the
    ``offload`` context began)."""
    with _install_lock:
        if _installed["users"]:
            _prepare_locked()
    return True


@contextlib.contextmanager
def compiling():
    """While an ``offload`` context is active: Inductor decomposes the ATen products of a graph
    it compiles on this thread into ``hbfp`` operators and keeps ``_EAGER_KERNELS`` as ATen calls
    (``_install``), and checks every graph it compiles for products left on the host
    (``HostProducts``, Inductor's last pass while any context is active). Nothing of Inductor is
    imported where it is not in use: eager code under ``offload`` does not pay for it (``route``
    prepares it when Dynamo traces)."""
    with _install_lock:
        _installed["users"] += 1
        if "torch._inductor.compile_fx" in sys.modules:  # Inductor in use (torch.compile imports it)
            _prepare_locked()
    try:
        yield
    finally:
        with _install_lock:
            _installed["users"] -= 1
            if _installed["users"] == 0 and _installed["checking"]:
                import torch._inductor.config as inductor_config

                inductor_config.post_grad_custom_post_pass = _installed["check"]
                _installed["check"], _installed["checking"] = None, False
