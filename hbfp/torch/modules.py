"""The HBFP layers (``Linear``, ``Conv1d``, ``Conv2d``: torch's, their products on the device,
without a context) and ``convert(model)``, which swaps them into a model in place.
"""

from __future__ import annotations

import warnings

import torch

from hbfp.recipes import RecipeInUse
from hbfp.recipes import resolve as _resolve_recipe

from .config import _using
from .convolution import conv1d, conv2d
from .counts import HbfpFallbackWarning
from .device import default_device
from .functional import _linear

__all__ = ["Linear", "Conv1d", "Conv2d", "convert"]


class _OnDevice:
    """What the HBFP layers add to torch's: ``device_handle`` (None: ``default_device()``),
    ``in_use`` (the recipe of ``convert``; None: the recipe in use where the layer runs) and
    a ``forward`` that torch.compile runs as it is and compiles around; ``_product(x, device)``
    is the layer's own computation."""

    def __init__(self, *args, device_handle=None, in_use: RecipeInUse | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.device_handle = device_handle
        self.in_use = in_use

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _using(self.in_use):
            return self._product(x, self.device_handle or default_device())


class Linear(_OnDevice, torch.nn.Linear):
    """``torch.nn.Linear`` whose product runs in HBFP on ``device`` (default: ``emu``)."""

    def _product(self, x, device):
        return _linear(x, self.weight, self.bias, device)


class Conv2d(_OnDevice, torch.nn.Conv2d):
    """``torch.nn.Conv2d`` whose products run in HBFP on ``device`` (``conv2d``)."""

    def _product(self, x, device):
        return conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups, device,
                      padding_mode=self.padding_mode)


class Conv1d(_OnDevice, torch.nn.Conv1d):
    """``torch.nn.Conv1d`` whose products run in HBFP on ``device`` (``conv1d``)."""

    def _product(self, x, device):
        return conv1d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups, device,
                      padding_mode=self.padding_mode)


def _swapped(layer: torch.nn.Module) -> bool:
    """Whether ``convert`` swaps ``layer``: a torch ``Linear``, ``Conv1d`` or ``Conv2d`` (not ours)."""
    return (isinstance(layer, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d))
            and not isinstance(layer, (Linear, Conv1d, Conv2d)))


def _converted(layer: torch.nn.Module, device, in_use: RecipeInUse | None = None) -> torch.nn.Module:
    """The HBFP version of a torch ``Linear``, ``Conv1d`` or ``Conv2d`` (``_swapped``), with the
    same parameter tensors."""
    if isinstance(layer, torch.nn.Linear):
        new = Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device_handle=device,
                     in_use=in_use)
    else:
        cls = Conv2d if isinstance(layer, torch.nn.Conv2d) else Conv1d
        new = cls(layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride,
                  padding=layer.padding, dilation=layer.dilation, groups=layer.groups,
                  bias=layer.bias is not None, padding_mode=layer.padding_mode, device_handle=device, in_use=in_use)
    new.weight = layer.weight
    if layer.bias is not None:
        new.bias = layer.bias
    new.train(layer.training)
    return new


def convert(model: torch.nn.Module, device=None, recipe=None, *, module_filter_fn=None) -> torch.nn.Module:
    """Swap every ``nn.Linear``, ``nn.Conv1d`` and ``nn.Conv2d`` of ``model`` for the HBFP versions, in place,
    keeping their parameters (the same tensors); returns the model. A bare layer comes back as
    its HBFP version (use the returned module). ``recipe`` (a name of ``RECIPES`` or a
    ``Recipe``): the products' configuration, with one stream of seeds for the model; None:
    the recipe in use where the layers run (``offload``, ``use_recipe``, else the default).
    ``module_filter_fn(module, fqn) -> bool`` (as torchao's ``convert_to_float8_training``):
    whether to swap each of those layers, ``fqn`` its name in ``model`` (``named_modules``'s; ""
    for ``model`` itself); None: every one."""
    in_use = None
    if recipe is not None:
        in_use = RecipeInUse(_resolve_recipe(recipe))
        if device is not None:
            in_use.recipe.check(device)
    if _swapped(model):
        return _converted(model, device, in_use) if module_filter_fn is None or module_filter_fn(model, "") else model
    left: set[str] = set()
    _convert(model, "", device, in_use, module_filter_fn, left)
    if left:
        warnings.warn(f"convert left {', '.join(sorted(left))} as they are: their products run on the device under "
                      "hbfp.torch.offload only (the ATen-level interception), in fp32 without it", HbfpFallbackWarning,
                      stacklevel=2)
    return model


#: Layers with matrix products that ``convert`` does not swap: ``offload`` routes their
#: products at the ATen level. (A MultiheadAttention's out_proj is not called as a module:
#: ``F.multi_head_attention_forward`` reads its weight, so it stays as it is too.)
_UNCONVERTED = (torch.nn.MultiheadAttention, torch.nn.RNNBase, torch.nn.Conv3d, torch.nn.modules.conv._ConvTransposeNd,
                torch.nn.Bilinear)


def _convert(model, prefix: str, device, in_use, module_filter_fn, left: set) -> None:
    for name, child in list(model.named_children()):
        fqn = f"{prefix}{name}"
        if isinstance(child, _UNCONVERTED):
            left.add(type(child).__name__)
        elif not _swapped(child):
            _convert(child, f"{fqn}.", device, in_use, module_filter_fn, left)
        elif module_filter_fn is None or module_filter_fn(child, fqn):
            setattr(model, name, _converted(child, device, in_use))
