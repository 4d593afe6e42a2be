"""The functions whose products run on the device, with torch's shapes and dtypes: ``matmul``
(vectors, matrices, stacks broadcast), ``linear`` (a weight in wide storage read as its codes)
and ``bilinear``; the convolutions are ``hbfp.torch.convolution``'s. A result has torch's dtype
for its operands (docs/torch.md, "Dtypes").
"""

from __future__ import annotations

import torch

from .autograd import HbfpBmm, HbfpMatmul
from .config import current_recipe
from .device import default_device
from .storage import _stored_operand, _StoredOperand

__all__ = ["matmul", "bilinear"]


#: The 16-bit float dtypes: their operands reach the device as fp32 (exactly), their results
#: come back rounded to nearest even. Every product's result has torch's dtype for its operands
#: (``torch.promote_types``): float64 operands are rounded to fp32 for the device, and the fp32
#: result widened to float64 (``matmul``; docs/torch.md, "Dtypes").
_HALF = {torch.bfloat16, torch.float16}


def matmul(a: torch.Tensor, b: torch.Tensor, device=None, *, stored: _StoredOperand | None = None,
           patches=None, grad_a_t: bool = False, out_t: bool = False, fp32_out: bool = False) -> torch.Tensor:
    """``a @ b`` in HBFP with torch.matmul's shapes: matrices, stacks (leading axes broadcast)
    and vectors (a 1-D operand is a one-row or one-column matrix, its axis removed after).
    The result has torch's dtype for the operands; ``fp32_out``: the device's fp32 result as
    it is (a bias is then added in fp32 and the sum rounded once, as torch's kernels do)."""
    device = device or default_device()
    if a.dim() == 0 or b.dim() == 0:
        raise ValueError("hbfp matmul takes vectors, matrices or stacks of matrices, not scalars")
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        # fp32 operands for the device; the result in torch's dtype for these operands
        dtype = torch.float32 if fp32_out else torch.promote_types(a.dtype, b.dtype)
        return matmul(a.float(), b.float(), device, stored=stored, patches=patches, grad_a_t=grad_a_t,
                      out_t=out_t).to(dtype)
    if b.dim() == 1:  # (..., K) @ (K,): a one-column product
        return matmul(a, b[:, None], device, stored=stored)[..., 0]
    if a.dim() == 1:  # (K,) @ (..., K, N): a one-row product
        return matmul(a[None, :], b, device, stored=stored)[..., 0, :]
    if a.dim() == 2 and b.dim() == 2:
        return HbfpMatmul.apply(a, b, device, stored, None, patches, grad_a_t, out_t)
    if b.dim() == 2:  # (..., M, K) @ (K, N): one product over all leading rows
        lead = a.shape[:-1]
        return HbfpMatmul.apply(a.reshape(-1, a.shape[-1]), b, device, stored).reshape(*lead, b.shape[-1])
    if stored is not None:
        raise ValueError("a stored (wide) operand is a matrix, not a stack")
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    recipe = current_recipe()
    if all(c.rounding == "nearest_even" and c.out == "fp32" for c in recipe.products.values()):
        out = HbfpBmm.apply(a, b, device)  # the stack at once
    else:
        out = torch.stack([HbfpMatmul.apply(a[i], b[i], device) for i in range(a.shape[0])])
    return out.reshape(*batch, *out.shape[-2:])


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, device) -> torch.Tensor:
    # W is stored out x in; the product uses it transposed, which reuses its square tiles. A 1-D
    # input is one row (matmul's vector case).
    if bias is None:
        return matmul(x, weight.t(), device, stored=_stored_operand(weight, device))
    y = matmul(x, weight.t(), device, stored=_stored_operand(weight, device), fp32_out=True)
    return _add_bias(y, bias, x.dtype, weight.dtype)


def _add_bias(y: torch.Tensor, bias: torch.Tensor, x_dtype: torch.dtype, w_dtype: torch.dtype) -> torch.Tensor:
    """The device's fp32 product ``y`` plus ``bias``, added in fp32 (or wider) and rounded once
    to torch's dtype for the operands: bf16 and fp16 layers round as torch's kernels do."""
    dtype = torch.promote_types(torch.promote_types(x_dtype, w_dtype), bias.dtype)
    acc = torch.promote_types(torch.float32, dtype)
    return (y.to(acc) + bias.to(acc)).to(dtype)


def _scaled_sum(y: torch.Tensor, inp: torch.Tensor, a_dtype: torch.dtype, b_dtype: torch.dtype, beta=1,
                alpha=1) -> torch.Tensor:
    """``beta * inp + alpha * y`` (``y`` the device's fp32 product of operands of these dtypes)
    as torch's ``addmm`` family computes it: scaled and added in fp32 (or wider), rounded once to
    the result's dtype; ``beta`` 0 ignores ``inp`` (its NaN and inf included), as torch does."""
    dtype = torch.promote_types(torch.promote_types(a_dtype, b_dtype), inp.dtype)
    acc = torch.promote_types(torch.float32, dtype)
    y = y.to(acc)
    if alpha != 1:
        y = alpha * y
    if beta != 0:
        y = y + (inp.to(acc) if beta == 1 else beta * inp.to(acc))
    return y.to(dtype)


def bilinear(x1: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             device=None) -> torch.Tensor:
    """``F.bilinear`` in HBFP: y[o] = sum_ij x1[i] W[o, i, j] x2[j] as one product of the
    outer products x1[i] * x2[j] (elementwise, on the host) with W as an (I * J) x O matrix."""
    device = device or default_device()
    lead = torch.broadcast_shapes(x1.shape[:-1], x2.shape[:-1])
    i, j = x1.shape[-1], x2.shape[-1]
    outer = (x1.expand(*lead, i)[..., :, None] * x2.expand(*lead, j)[..., None, :]).reshape(-1, i * j)
    y = matmul(outer, weight.reshape(weight.shape[0], i * j).t(), device).reshape(*lead, weight.shape[0])
    return y + bias if bias is not None else y
