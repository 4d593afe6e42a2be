"""Wide weight storage (``wide_weight_storage(model, optimizer)``), the paper's: the master
weights of the model's products are kept as HBFP16 (16-bit mantissas, the device's tiles).
They are rounded onto the HBFP16 grid now and after every ``optimizer.step()``, so small
updates accumulate in 16 bits; every product reads them as the device's format by
``requantize`` (same tile exponents, mantissas rounded to 8 bits for HBFP8), forward and
backward (``_stored_operand``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["wide_weight_storage", "WideWeightStorage", "weight_storage"]


@dataclass(frozen=True)
class _StoredOperand:
    """The right operand of a product as the device reads it from wide storage: ``codes``
    (``(codes, exponents)`` tensors in the device's format, requantized from HBFP16) of the
    stored matrix, which is ``b`` itself or, with ``transposed``, ``b``'s transpose (a Linear's
    weight is stored out x in and used as in x out)."""

    codes: object
    transposed: bool


_STORAGE_ATTR = "_hbfp_storage"  # set on a weight Parameter: its storage Format (HBFP16)


def weight_storage(weight: torch.Tensor):
    """The BFP format ``weight`` is stored in (``wide_weight_storage``), or None (fp32)."""
    return getattr(weight, _STORAGE_ATTR, None)


def _matrix(weight: torch.Tensor) -> torch.Tensor:
    """A layer's weight as the matrix its product uses: out x (in * kernel)."""
    return weight.reshape(weight.shape[0], -1)


def _stored_operand(weight: torch.Tensor, device, matrix: torch.Tensor | None = None,
                    storage=None, transposed: bool = True) -> _StoredOperand | None:
    """The codes the device reads of a wide-stored weight (None if stored as fp32): of its
    matrix, or of ``matrix`` (a group's rows of it); ``storage``: its format, where not the
    weight's own (a compiled graph's tensors carry no attribute: ``hbfp.torch.compiled``);
    ``transposed``: the product reads the matrix transposed (a Linear's, a convolution's), or
    as it is (a transposed convolution's, Cin x Cout/g * K)."""
    from hbfp import kernels

    storage = weight_storage(weight) if storage is None else storage
    if storage is None:
        return None
    fmt = device.format()
    if storage.tile != fmt.tile:
        # requantize keeps the tiles: a device of other tiles (MXINT8's 1 x 32 under HBFP16's
        # 24 x 24) quantizes the weight's values, points of the storage grid, as any operand
        return None
    # exact: the weight is on the storage grid
    wide = kernels.quantize((_matrix(weight) if matrix is None else matrix).detach(), storage)
    return _StoredOperand(kernels.requantize(*wide, storage, fmt), transposed=transposed)


def _snap(weight: torch.Tensor, storage) -> None:
    from hbfp import kernels

    with torch.no_grad():
        snapped = kernels.dequantize(*kernels.quantize(_matrix(weight), storage), storage)
        weight.copy_(snapped.reshape(weight.shape).to(weight.dtype))


class WideWeightStorage:
    """The handle ``wide_weight_storage`` returns: ``weights`` (the stored parameters),
    ``storage`` (their format), ``snap()`` (round them onto the storage grid again) and
    ``remove()`` (back to fp32 master weights; the hook is removed)."""

    def __init__(self, weights: list[torch.nn.Parameter], storage, optimizer):
        self.weights = weights
        self.storage = storage
        for w in weights:
            setattr(w, _STORAGE_ATTR, storage)
        self.snap()
        self._hook = None
        if optimizer is not None:
            self._hook = optimizer.register_step_post_hook(lambda opt, args, kwargs: self.snap())

    def snap(self) -> None:
        for w in self.weights:
            _snap(w, self.storage)

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for w in self.weights:
            if getattr(w, _STORAGE_ATTR, None) is self.storage:
                delattr(w, _STORAGE_ATTR)


def _product_weights(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights that are operands of products: of linear layers and convolutions of any
    kind, Bilinear, MultiheadAttention's input projections and the RNNs' matrices (once each)."""
    out, seen = [], set()
    for mod in model.modules():
        if isinstance(mod, (torch.nn.Linear, torch.nn.modules.conv._ConvNd, torch.nn.Bilinear)):
            params = [mod.weight]
        elif isinstance(mod, torch.nn.MultiheadAttention):
            params = [mod.in_proj_weight, mod.q_proj_weight, mod.k_proj_weight, mod.v_proj_weight]
        elif isinstance(mod, torch.nn.RNNBase):
            params = [p for n, p in mod.named_parameters(recurse=False) if n.startswith("weight_")]
        else:
            continue
        for p in params:
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def wide_weight_storage(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                        storage=None) -> WideWeightStorage:
    """Keep the weights of ``model``'s products (linear layers, convolutions, Bilinear,
    MultiheadAttention's input projections, RNNs; torch's layers or ours) in wide BFP storage
    (default ``HBFP16``): rounded onto its grid now (to nearest even) and
    after every ``optimizer.step()``. The products of the layers ``convert`` swaps and of the
    functions ``offload`` routes read them as the device's format by ``requantize``; the
    products routed at the ATen level (attention, RNNs, ...) quantize their values (points of
    the storage grid) as any operand. Biases stay fp32 (they are not products' operands). The
    training loop is unchanged."""
    from hbfp.golden import HBFP16, Format

    storage = HBFP16 if storage is None else storage
    if not isinstance(storage, Format):
        raise TypeError(f"storage must be a hbfp.golden.Format, got {storage!r}")
    if storage.rounding != "nearest_even":
        raise ValueError("wide weight storage rounds to nearest even (stochastic storage rounding needs a seed per step)")
    weights = _product_weights(model)
    if not weights:
        raise ValueError("the model has no layer with products (Linear, convolutions, attention, RNNs, Bilinear) "
                         "whose weights could be stored wide")
    return WideWeightStorage(weights, storage, optimizer)
