"""The ATen-level products in a compiled graph: ``hbfp::aten_mm`` and ``hbfp::aten_bmm``
(``AtenOffload``'s products), and the decompositions that map ATen's product operators to them
while a graph is traced (``_DECOMPOSITIONS``, with what ``AtenOffload`` would decide when it
runs: ``_Traced``) (``hbfp.torch.compiled``).
"""

from __future__ import annotations

import weakref

import torch
from torch._library.effects import EffectType

from . import aten as _aten
from . import counts as _report
from .compiled import _context, _forward_config, _unrouted

ops = torch.ops.hbfp


# ---- the ATen-level products: hbfp::aten_mm, hbfp::aten_bmm -------------------------------------

def _aten_operand(product, x, cfg, backward: bool, forward_operand: bool):
    """``x`` as ``AtenOffload``'s product reads it (``_Product._operand``: a forward operand is
    remembered with its codes), with whether a backward product's operand is a forward operand
    decided when the graph was traced: its forward codes where its memory is remembered, else
    quantized again as the forward quantized it (to nearest: the same codes)."""
    from .autograd import _operand

    if not backward:
        return product._operand(x, cfg, True)
    if product.forward is not None and forward_operand:
        hit, codes = product.forward.lookup(x)
        if hit and codes is not None:
            return codes
        return _operand(product.device, x, _forward_config(product.in_use), product.in_use)
    return _operand(product.device, x, cfg, product.in_use)


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
        return stack_codes(x.detach(), product.device.format(_forward_config(product.in_use).rounding), 0)
    return stack_codes(x.detach(), product.device.format(cfg.rounding), seed)


def _aten_config(product, backward: bool):
    recipe = product.in_use.recipe
    return recipe.grad_input if backward else _forward_config(product.in_use)


@torch.library.custom_op("hbfp::aten_mm", mutates_args=())
@_unrouted
def _aten_mm(a: torch.Tensor, b: torch.Tensor, label: str, backward: bool, a_forward: bool,
             b_forward: bool) -> torch.Tensor:
    """A 2-D fp32 product of an ATen operator (``label``) as ``AtenOffload`` computes it:
    ``backward``, and whether each operand is a forward operand, as traced."""
    from .autograd import _product
    from .device import _device_work

    product = _context()
    cfg = _aten_config(product, backward)
    _report.count_call(label)
    with _report.routing(label):
        with _device_work():
            qa = _aten_operand(product, a, cfg, backward, a_forward)
            qb = _aten_operand(product, b, cfg, backward, b_forward)
        return _product(product.device, qa, qb, cfg, product.in_use).contiguous()


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

    from .autograd import _out
    from .device import _device_bmm, _device_work

    product = _context()
    cfg = _aten_config(product, backward)
    _report.count_call(label)
    with _report.routing(label):
        seed = product.in_use.seed(cfg)
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


for _op in (_aten_mm, _aten_bmm):
    _op.register_effect(EffectType.ORDERED)
