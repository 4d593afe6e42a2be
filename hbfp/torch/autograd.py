"""The device's products under a recipe, and their autograd functions.

- ``_operand``, ``_product``: an operand quantized and a product computed under a product's
  configuration (``ProductConfig``) with the recipe's stream of seeds: every route's products
  (``HbfpMatmul``'s, ``hbfp.torch.aten``'s, ``hbfp.torch.rnn``'s, the compiled operators')
  are made by them.
- ``HbfpMatmul``: ``a @ b`` on the device, forward and both backward products
  (``grad_a = grad @ b^T``, ``grad_b = a^T @ grad``), each bit for bit as
  ``hbfp.golden.gemm.gemm`` on the device's format. With square tiles the backward products
  reuse the forward quantization of ``a`` and ``b`` (a transposed operand reuses its tiles);
  on an in-process device with square tiles by its lean path (``hbfp.torch.lean``).
- ``HbfpBmm``: a stack of products at once (``Device.bmm_tensors`` on ``emu``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hbfp.recipes import ProductConfig, RecipeInUse

from . import counts as _report
from .config import recipe_in_use
from .device import _compiled_cpu, _device_bmm, _device_gemm, _device_work, _quantized, _square
from .lean import _Lean

if TYPE_CHECKING:
    from .storage import _StoredOperand

__all__ = ["HbfpMatmul", "HbfpBmm"]


def _operand(device, x, cfg: ProductConfig, in_use: RecipeInUse):
    """``x`` as a product under ``cfg`` reads it (``_quantized``), its seed the next of
    ``in_use``'s stream where the device's tiles are square."""
    return _quantized(device, x, cfg.rounding, in_use.seed(cfg) if _square(device) else None)


def _product(device, a, b, cfg: ProductConfig, in_use: RecipeInUse, **kw) -> torch.Tensor:
    """``_device_gemm`` under ``cfg``: a device with blocks along K rounds both operands as
    ``cfg`` says (its operands go as values); the result in ``cfg.out``."""
    if not _square(device) and cfg.rounding != "nearest_even":
        kw.update(rounding=cfg.rounding, seed=in_use.seed(cfg))
    return _out(_device_gemm(device, a, b, **kw), cfg)


def _out(y: torch.Tensor, cfg: ProductConfig) -> torch.Tensor:
    if cfg.out == "bf16":  # the device's bf16 output: the fp32 sums rounded to nearest even
        from hbfp.kernels import torch_ops

        with _device_work():
            y = torch_ops.epilogue(y, None, "bf16").to(torch.float32)
    return y


class HbfpMatmul(torch.autograd.Function):
    """``a @ b`` (2-D) on ``device``, with the backward products on the device too.

    ``stored``: optional ``_StoredOperand`` of ``b`` (wide weight storage): the products read
    its codes instead of quantizing ``b``; the gradient still flows to ``b``. ``patches``:
    optional ``_LazyPatches`` that ``a`` stands for (``a`` then only carries the gradient):
    ``a``'s codes are quantized from the image directly, the same codes as of ``a`` itself.
    ``grad_a_t``: ``a``'s gradient as the transposed view of (b @ grad^T), the same sums (a
    patch matrix's, which col2im reads in runs there); ``out_t``: the product itself as the
    transposed view of (b^T @ a^T) (a convolution's, whose channels then lie as the image's)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, device, stored: _StoredOperand | None = None,
                in_use: RecipeInUse | None = None, patches=None, grad_a_t: bool = False, out_t: bool = False):
        in_use = in_use or recipe_in_use()
        in_use.note(a, b)
        cfg = in_use.recipe.forward
        ctx.device, ctx.stored, ctx.in_use = device, stored, in_use
        ctx.op = _report.current()
        ctx.lean, ctx.patches = None, patches
        if stored is None and patches is None and not (grad_a_t or out_t) and _Lean.fits(a, b, in_use.recipe):
            lean, lib = _Lean.of(device), _compiled_cpu()
            if lean is not None and lib is not None:  # the general path's codes, made leaner
                ctx.lean, ctx.transposed, ctx.a_t = lean, False, False
                y, ctx.qa, ctx.qb, ctx.b_view = lean.forward(lib, a, b, in_use)
                return y
        HbfpMatmul._operands(ctx, a, b, cfg, in_use, grad_a_t)
        if out_t:  # (b^T @ a^T)^T: the same sums, the same bits, a transposed view
            return _product(device, ctx.qb, ctx.qa, cfg, in_use, transpose_a=not ctx.transposed,
                            transpose_b=True).t()
        return _product(device, ctx.qa, ctx.qb, cfg, in_use, transpose_b=ctx.transposed)

    @staticmethod
    def _operands(ctx, a, b, cfg: ProductConfig, in_use: RecipeInUse, grad_a_t: bool) -> None:
        """The general path's operands in ``ctx`` (``ctx.device``, ``ctx.stored``, ``ctx.patches``
        set): their codes (``qa``, ``qb``), in this order, with the recipe's seeds, and how the
        backward products read them."""
        device, stored, patches = ctx.device, ctx.stored, ctx.patches
        ctx.qa = patches.codes(device, cfg, in_use) if patches is not None else _operand(device, a, cfg, in_use)
        ctx.qb = stored.codes if stored is not None else _operand(device, b, cfg, in_use)
        ctx.transposed = stored is not None and stored.transposed
        # b a transposed view of a matrix (a Linear's weight as in x out): its gradient is made
        # in the matrix's layout, so that autograd hands it to the weight without a copy
        ctx.b_view = ctx.transposed or (b.dim() == 2 and not b.is_contiguous() and b.t().is_contiguous())
        # grad_a_t: a's gradient made transposed (a patch matrix's: col2im reads runs of it there)
        ctx.a_t = grad_a_t

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with _report.routing(ctx.op or "matmul"):
            return HbfpMatmul._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad: torch.Tensor):
        lib = _compiled_cpu() if ctx.lean is not None else None
        if lib is not None and grad.dtype == torch.float32 and grad.device.type == "cpu":
            grad_a, grad_b = ctx.lean.backward(lib, grad, ctx.qa, ctx.qb, ctx.b_view, ctx.in_use,
                                               *ctx.needs_input_grad[:2])
            return grad_a, grad_b, None, None, None, None, None, None
        grad_a = grad_b = None
        dev, in_use = ctx.device, ctx.in_use
        gi, gw = in_use.recipe.grad_input, in_use.recipe.grad_weight
        qg = {}  # the output gradient quantized once per rounding the products ask for

        def quantized(cfg):
            if cfg.rounding not in qg:
                qg[cfg.rounding] = _operand(dev, grad, cfg, in_use)
            return qg[cfg.rounding]

        if ctx.needs_input_grad[0]:  # grad @ b^T (b stored as in the forward product)
            if ctx.a_t and ctx.patches is not None and ctx.patches.folds(dev, grad, gi):
                # a's gradient folded onto the image as it is made (_Patches.backward returns it);
                # a stands for the patches and takes no memory, nor does its gradient
                ctx.patches.fold(dev, ctx.qb, ctx.transposed, quantized(gi))
                grad_a = grad.new_zeros(()).expand(grad.shape[0], ctx.qb[0].shape[1 if ctx.transposed else 0])
            elif ctx.a_t:  # (b @ grad^T)^T: the same sums, the same bits, a transposed view
                grad_a = _product(dev, ctx.qb, quantized(gi), gi, in_use, transpose_a=ctx.transposed,
                                  transpose_b=True).t()
            else:
                grad_a = _product(dev, quantized(gi), ctx.qb, gi, in_use, transpose_b=not ctx.transposed)
        if ctx.needs_input_grad[1]:  # a^T @ grad, or (grad^T @ a)^T: the same sums, the same bits
            if ctx.b_view:
                grad_b = _product(dev, quantized(gw), ctx.qa, gw, in_use, transpose_a=True).t()
            else:
                grad_b = _product(dev, ctx.qa, quantized(gw), gw, in_use, transpose_a=True)
        return grad_a, grad_b, None, None, None, None, None, None


class HbfpBmm(torch.autograd.Function):
    """The stack ``a[i] @ b[i]`` (B x M x K, B x K x N) on ``device``, forward and both backward
    stacks of products, each product as ``HbfpMatmul``'s."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, device):
        ctx.device = device
        ctx.op = _report.current()
        ctx.save_for_backward(a, b)
        recipe_in_use().note(a, b)
        return _device_bmm(device, a, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        grad_a = grad_b = None
        with _report.routing(ctx.op or "matmul"):
            if ctx.needs_input_grad[0]:
                grad_a = _device_bmm(ctx.device, grad, b.transpose(1, 2))
            if ctx.needs_input_grad[1]:
                grad_b = _device_bmm(ctx.device, a.transpose(1, 2), grad)
        return grad_a, grad_b, None
