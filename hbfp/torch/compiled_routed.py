"""``hbfp::routed``: a function ``offload`` routes as a whole (a convolution, ``bilinear``) in a
compiled graph, computed inside the operator by its eager route, whose backward autograd
records there and ``hbfp::routed_backward`` runs (``hbfp.torch.compiled``).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
from torch._library.effects import EffectType

from .compiled import _context, _handle, _like, _Saved, _unrouted

ops = torch.ops.hbfp


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
    from .routes import _ROUTES

    routed = next(r for r in _ROUTES.values() if r.name == name)
    leaves = [t.detach().requires_grad_(bool(r) and t.is_floating_point()) for t, r in zip(tensors, requires)]
    args, kwargs = _arguments(template, leaves)
    stand_in = SimpleNamespace(device=product.device)  # what the routes read of the mode
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


def _routed_call(name, args, kwargs):
    tensors, template = _template(args, kwargs)
    requires = [t.requires_grad for t in tensors]
    save = torch.is_grad_enabled() and any(requires)
    return ops.routed(name, tensors, template, requires, save)[0]


for _op in (_routed, _routed_backward):
    _op.register_effect(EffectType.ORDERED)
