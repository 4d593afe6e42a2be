"""``offload(device)``: a context that runs every matrix product of an unchanged model on the
device, forward and backward, through two layers (docs/torch.md):

- ``_Offload``, a torch-function mode, takes the functions of ``_ROUTES`` (``linear``, the
  ``matmul`` family, ``addmm`` and its kin, the convolutions, ``bilinear``, ``nn.LSTM``'s
  ``torch.lstm``) with more than ATen sees of them (a weight's wide storage, a convolution's
  patches);
- every other product is taken at the ATen level (``hbfp.torch.aten``), below autograd.

``report()`` says what ran where.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hbfp.recipes import RecipeInUse, format_name
from hbfp.recipes import resolve as _resolve_recipe

from . import counts as _report
from .config import _routing_active, _using, current_recipe, matmul_precision
from .convolution import _same_padding, _tuple, conv1d, conv2d, convolution
from .device import default_device
from .functional import _linear, _scaled_sum, bilinear, matmul

__all__ = ["offload"]


class _Offload(TorchFunctionMode):
    """Routes the matrix products of torch's functional API to the device: linear layers with
    their wide storage, the convolutions (conv1d and conv2d by im2col products with their
    compiled patches; 3-d and transposed ones by ``convolution.convolution``, the same im2col
    products), bilinear."""

    def __init__(self, device):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if type(func) is torch._ops.OpOverload:  # an operator itself (a compiled graph calls them): no route
            return func(*args, **kwargs)
        if torch.compiler.is_compiling():  # Dynamo traces: the products as operators of the graph
            from .compiled_trace import route as compiled_route

            return compiled_route(self, func, args, kwargs)
        route = _ROUTES.get(func) if _routing_active() else None
        if route is not None:
            out = route(self, *args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


def _counted(name: str, fn, autocast: bool = True):
    """``fn`` routed as ``name``: counted, and under ``torch.autocast`` with its operands cast
    as autocast casts them for this operation (``autocast``: whether it is on autocast's
    lower-precision list). ``fn`` takes the device first."""
    def routed(offload, *args, **kwargs):
        device = offload.device
        if not _applies(args, kwargs):
            return NotImplemented
        _report.count_call(name)
        if not torch.is_autocast_enabled("cpu"):
            with _report.routing(name):
                return fn(device, *args, **kwargs)
        if autocast:
            # as autocast runs a product: fp32 operands in its dtype, the result in it
            dtype = torch.get_autocast_dtype("cpu")
            cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t  # noqa: E731
            args, kwargs = [cast(t) for t in args], {k: cast(v) for k, v in kwargs.items()}
        with _report.routing(name), torch.autocast("cpu", enabled=False):
            return fn(device, *args, **kwargs)
    routed.name, routed.autocast = name, autocast  # what hbfp.torch.compiled emits for it
    return routed


def _applies(args, kwargs) -> bool:
    """Floating CPU operands and no ``out=``: else torch's (and the ATen mode's) own."""
    tensors = [t for t in args[:3] if isinstance(t, torch.Tensor)]
    return "out" not in kwargs and all(t.dim() >= 1 and t.is_floating_point() and t.device.type == "cpu"
                                       for t in tensors)


def _route_linear(device, x, weight, bias=None):
    return _linear(x, weight, bias, device)


def _route_matmul(device, a, b):
    return matmul(a, b, device)


def _route_conv(fn):
    names = ("bias", "stride", "padding", "dilation", "groups")

    def route(device, x, weight, *args, **kwargs):
        extra = dict(zip(names, args))
        extra.update({k: v for k, v in kwargs.items() if k in names})
        return fn(x, weight, device=device, **extra)
    return route


def _route_scaled(device, inp, a, b, *, beta=1, alpha=1):
    return _scaled_sum(matmul(a, b, device, fp32_out=True), inp, a.dtype, b.dtype, beta, alpha)


def _route_bilinear(device, x1, x2, weight, bias=None):
    return bilinear(x1, x2, weight, bias, device)


def _route_conv_nd(nd: int, transposed: bool):
    """A route of ``F.conv3d`` or ``F.conv_transposeNd`` (their arguments as torch takes them)
    to ``convolution.convolution``: padding strings and numbers as torch reads them."""
    names = (("bias", "stride", "padding", "output_padding", "groups", "dilation") if transposed
             else ("bias", "stride", "padding", "dilation", "groups"))

    def route(device, x, weight, *args, **kwargs):
        if not isinstance(x, torch.Tensor) or x.dim() not in (nd + 1, nd + 2):
            return NotImplemented
        kw = dict(zip(names, args))
        kw.update({k: v for k, v in kwargs.items() if k in names})
        unbatched = x.dim() == nd + 1
        if unbatched:
            x = x[None]
        stride, dilation = _tuple(kw.get("stride", 1), nd), _tuple(kw.get("dilation", 1), nd)
        padding = kw.get("padding", 0)
        if isinstance(padding, str):
            if padding not in ("same", "valid") or transposed:
                return NotImplemented
            if padding == "same":
                amounts = _same_padding(tuple(weight.shape[2:]), dilation)
                if any(amounts):
                    x = F.pad(x, amounts)
            padding = 0
        y = convolution(x, weight, kw.get("bias"), stride, _tuple(padding, nd), dilation, transposed,
                        _tuple(kw.get("output_padding", 0), nd), int(kw.get("groups", 1)), device)
        return y[0] if unbatched else y
    return route


_ROUTES = {}
for _name, _fn, _funcs in (
    ("linear", _route_linear, (F.linear,)),
    ("matmul", _route_matmul, (torch.mm, torch.Tensor.mm, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
                               torch.bmm, torch.Tensor.bmm, torch.mv, torch.Tensor.mv, torch.dot, torch.Tensor.dot)),
    ("conv2d", _route_conv(conv2d), (F.conv2d, torch.conv2d)),
    ("conv1d", _route_conv(conv1d), (F.conv1d, torch.conv1d)),
    ("addmm", _route_scaled, (torch.addmm, torch.Tensor.addmm, torch.addmv, torch.Tensor.addmv, torch.baddbmm,
                              torch.Tensor.baddbmm)),
    ("bilinear", _route_bilinear, (F.bilinear,)),
):
    for _f in _funcs:
        _ROUTES[_f] = _counted(_name, _fn, autocast=_name != "bilinear")  # autocast runs bilinear in fp32
for _name, _nd, _transposed, _funcs in (
    ("conv3d", 3, False, (F.conv3d, torch.conv3d)),
    ("conv_transpose1d", 1, True, (F.conv_transpose1d, torch.conv_transpose1d)),
    ("conv_transpose2d", 2, True, (F.conv_transpose2d, torch.conv_transpose2d)),
    ("conv_transpose3d", 3, True, (F.conv_transpose3d, torch.conv_transpose3d)),
):
    for _f in _funcs:
        _ROUTES[_f] = _counted(_name, _route_conv_nd(_nd, _transposed))


def _route_lstm():
    """``torch.lstm`` (nn.LSTM's call) by ``hbfp.torch.rnn`` where it applies, else ATen's LSTM
    (its products routed at the ATen level). Eager only: a compiled graph keeps torch.lstm."""
    from . import rnn

    counted = _counted("lstm", rnn.layers, autocast=False)

    def route(offload, *args, **kwargs):
        return counted(offload, *args, **kwargs) if rnn.applies(args, kwargs) else NotImplemented
    route.name, route.autocast, route.compiled = "lstm", False, False
    return route


_ROUTES[torch.lstm] = _route_lstm()


@contextlib.contextmanager
def offload(device=None, precision: str | None = None, recipe=None, seed: int | None = None):
    """Run the matrix products of an unchanged model on ``device`` while the context is
    active, forward and backward: the functions ``_Offload`` routes, and every other product at
    the ATen level (``hbfp.torch.aten``: attention, RNNs, einsum, tensordot, 3-d and transposed
    convolutions, ...). ``report()`` says what ran where. ``recipe`` (a name of ``RECIPES`` or a
    ``Recipe``; None: the recipe in use, ``use_recipe``'s, else "default": the device's format,
    gradients rounded stochastically) configures each product. Its stochastic roundings' seeds
    continue where the model's last context left them (``RecipeInUse.continuing``: a context per
    step draws new seeds each step; a copy of the model starts as the model did), unless
    ``seed`` is given: then a fresh stream from that seed. Without a ``device``, an ``emu`` of
    the recipe's format (default ``emu``). ``precision``: the matmul precision while active (default: the device's format's
    name, e.g. "hbfp8"). The precision, the recipe and the backend flags are restored on exit,
    exceptions included."""
    from .aten import AtenOffload, _Product, backend_flags

    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"offload's seed must be an integer >= 0, got {seed!r}")
    r = _resolve_recipe(recipe) if recipe is not None else current_recipe()
    if device is None:
        formats = r.formats()
        if len(formats) > 1:
            raise ValueError(f"recipe {r.name!r} names several formats ({', '.join(sorted(formats))}): "
                             "give offload a device")
        from hbfp import host

        device = host.open(f"emu:format={formats.pop()}") if formats else default_device()
    r.check(device)
    precision = precision or format_name(device.format()).lower().replace(" ", "")
    from .compiled_trace import compiling  # torch.compile'd code: its products as hbfp operators

    in_use = RecipeInUse(r, continuing=True) if seed is None else RecipeInUse(r.with_seed(seed))
    with matmul_precision(precision), _using(in_use), backend_flags(), compiling():
        product = _Product(device, in_use)
        try:
            with AtenOffload(product, _routing_active), _Offload(device):
                yield device
        finally:
            product.close()
            in_use.finish()
