"""PyTorch integration: matrix products of a training loop in HBFP on an hbfp device.

- ``offload(device)``: a context that runs every matrix product of an unchanged model on the
  device, forward and backward: the functions its torch-function mode routes
  (``hbfp.torch.routes``), and every other product at the ATen level (``hbfp.torch.aten``);
  ``report()`` says what ran where (``hbfp.torch.counts``; docs/torch.md). ``torch.compile``d
  code under it: ``hbfp.torch.compiled``.
- ``set_matmul_precision("highest" | "hbfp8" | ...)`` and the recipe in use (``Recipe``,
  ``RECIPES``, ``use_recipe``; ``hbfp.recipes``): ``hbfp.torch.config``.
- ``HbfpMatmul``, ``HbfpBmm``: the autograd functions of the device's products
  (``hbfp.torch.autograd``; their lean path: ``hbfp.torch.lean``), and the functions made of
  them: ``matmul``, ``bilinear`` (``hbfp.torch.functional``), ``conv1d``, ``conv2d``
  (``hbfp.torch.convolution``, whose ``convolution`` makes every kind: any number of spatial
  dimensions, transposed or not; on the emu a 2-d one's products a few images at a time,
  ``hbfp.torch.image_products``).
- ``Linear``, ``Conv1d``, ``Conv2d`` and ``convert(model)``, which swaps them into a model in
  place (``hbfp.torch.modules``).
- ``wide_weight_storage(model, optimizer)``: the paper's wide weight storage
  (``hbfp.torch.storage``).

Everything else (loss, optimizer, bias additions) stays in fp32 on the CPU.
"""

from hbfp.recipes import DEFAULT_RECIPE, RECIPES, ProductConfig, Recipe

from .autograd import HbfpBmm, HbfpMatmul
from .config import (PRECISIONS, current_recipe, get_matmul_precision, matmul_precision, recipe_in_use,
                     set_matmul_precision, use_recipe)
from .convolution import conv1d, conv2d
from .counts import HbfpFallbackWarning, OpCount, fallbacks, format_report, report, reset_fallbacks, reset_report
from .device import default_device
from .functional import bilinear, matmul
from .modules import Conv1d, Conv2d, Linear, convert
from .routes import offload
from .storage import WideWeightStorage, weight_storage, wide_weight_storage

__all__ = [
    "PRECISIONS",
    "set_matmul_precision",
    "get_matmul_precision",
    "matmul_precision",
    "default_device",
    "HbfpMatmul",
    "HbfpBmm",
    "matmul",
    "Linear",
    "Conv1d",
    "Conv2d",
    "conv1d",
    "conv2d",
    "bilinear",
    "convert",
    "offload",
    "fallbacks",
    "reset_fallbacks",
    "report",
    "reset_report",
    "format_report",
    "OpCount",
    "HbfpFallbackWarning",
    "Recipe",
    "ProductConfig",
    "RECIPES",
    "DEFAULT_RECIPE",
    "use_recipe",
    "current_recipe",
    "recipe_in_use",
    "wide_weight_storage",
    "WideWeightStorage",
    "weight_storage",
]
