"""Convolutions as matrix products on the device: one path for every kind.

``convolution``: ``aten.convolution`` of any number of spatial dimensions, transposed or not,
with groups, as im2col products through ``matmul`` (``HbfpMatmul``: the forward product and
both backward ones, each under its configuration of the recipe, ``grad_input`` and
``grad_weight``; a weight in wide storage read as its codes):

- a convolution: per group, patches @ W^T (``_Patches``: gathered by the compiled kernels in
  2-d, or quantized from the image directly where the product reads only their codes,
  ``_LazyPatches``); their gradient summed back onto the image (``col2im``; on an in-process
  device folded onto it as the product makes it, and with one group the product made straight
  into the output's layout with its bias: ``hbfp.torch.image_products``);
- a transposed one (weight Cin x Cout/g x K): per group, col2im(x @ W) onto the output
  (``_Col2im``), whose gradient is the patches of the output's gradient.

``conv2d`` and ``conv1d`` (``F.conv2d``, ``F.conv1d``; the layers ``Conv2d``, ``Conv1d``) add
torch's padding strings and modes and unbatched input; ``offload`` routes ``F.conv3d`` and
``F.conv_transpose1d`` .. ``3d`` to ``convolution`` itself (``hbfp.torch.routes``).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from .device import default_device
from .functional import _add_bias, matmul
from .image_products import _ImageProduct, _LazyPatches
from .storage import _matrix, _stored_operand

__all__ = ["convolution", "conv2d", "conv1d", "patches", "col2im"]


# ---- the patches: compiled kernels in 2-d, torch's operations in any ------------------------

@torch.compiler.disable  # compiled kernels: a call torch.compile leaves as it is
def _im2col(x, kernel, stride, padding, dilation):
    from hbfp import kernels

    return kernels.im2col(x, kernel, stride, padding, dilation)


@torch.compiler.disable
def _col2im(cols, shape, kernel, stride, padding, dilation):
    from hbfp import kernels

    return kernels.col2im(cols, shape, kernel, stride, padding, dilation)


def patches(x: torch.Tensor, kernel, stride, padding, dilation) -> torch.Tensor:
    """The patches of ``x`` (N, C, *S) as one matrix (N * prod(O), C * prod(K)), rows in
    (n, *o) order, columns in (c, *k) order (``F.unfold``'s columns as rows); zero padding."""
    n, c = x.shape[:2]
    if len(kernel) == 2 and x.dtype == torch.float32 and x.device.type == "cpu":
        return _im2col(x, tuple(kernel), tuple(stride), tuple(padding), tuple(dilation))
    pads = [p for q in reversed(padding) for p in (q, q)]
    v = F.pad(x, pads) if any(pads) else x
    for d, (k, s, dl) in enumerate(zip(kernel, stride, dilation)):
        v = v.unfold(2 + d, dl * (k - 1) + 1, s)
    nd = len(kernel)
    v = v[(..., *(slice(None, None, dl) for dl in dilation))]
    out = v.shape[2:2 + nd]
    v = v.permute(0, *range(2, 2 + nd), 1, *range(2 + nd, 2 + 2 * nd))
    return v.reshape(n * math.prod(out), c * math.prod(kernel))


def col2im(cols: torch.Tensor, shape, kernel, stride, padding, dilation) -> torch.Tensor:
    """The adjoint of ``patches``: every patch entry of ``cols`` added back onto an image of
    ``shape`` (N, C, *S) (each kernel offset in turn; rows and columns past the last patch
    position, such as a transposed convolution's output padding, stay zero)."""
    n, c, *size = shape
    nd = len(kernel)
    if nd == 2 and cols.dtype == torch.float32 and cols.device.type == "cpu":
        return _col2im(cols, tuple(shape), tuple(kernel), tuple(stride), tuple(padding), tuple(dilation))
    out = _out_size(size, kernel, stride, padding, dilation, False, None)
    c6 = cols.reshape(n, *out, c, *kernel).permute(0, nd + 1, *range(1, nd + 1), *range(nd + 2, 2 * nd + 2))
    image = torch.zeros(n, c, *(s + 2 * p for s, p in zip(size, padding)), dtype=cols.dtype, device=cols.device)
    for offs in itertools.product(*(range(k) for k in kernel)):
        where = tuple(slice(o * dl, o * dl + st * (q - 1) + 1, st) for o, dl, st, q in zip(offs, dilation, stride, out))
        image[(slice(None), slice(None), *where)] += c6[(..., *offs)]
    return image[(slice(None), slice(None), *(slice(p, p + s) for p, s in zip(padding, size)))]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(N, C, *S) as a matrix (N * prod(S), C)."""
    return x.movedim(1, -1).reshape(-1, x.shape[1])


def _out_size(size, kernel, stride, padding, dilation, transposed, output_padding):
    if transposed:
        return [(i - 1) * st - 2 * p + dl * (k - 1) + op + 1
                for i, k, st, p, dl, op in zip(size, kernel, stride, padding, dilation, output_padding)]
    return [(s + 2 * p - dl * (k - 1) - 1) // st + 1 for s, k, st, p, dl in zip(size, kernel, stride, padding, dilation)]


class _Patches(torch.autograd.Function):
    """The patches of a convolution as one matrix (``patches``: ``F.unfold`` with its columns
    as rows; gathered in one pass by the compiled kernels in 2-d); with ``lazy``, a stand-in of
    no memory (a zero expanded to the matrix's shape) that only carries the gradient, for a
    product that reads the patches' codes (``_LazyPatches``). The backward sums the gradient
    back onto the image (``col2im``: in 2-d as ``unfold``'s own backward, ``F.fold``, sums it,
    in its order), so gradients keep their bits."""

    @staticmethod
    def forward(ctx, x, kernel, stride, padding, dilation, lazy=None):
        ctx.geometry = (tuple(x.shape), kernel, stride, padding, dilation)
        ctx.lazy = lazy
        if lazy is not None:
            from hbfp import kernels

            g = kernels.conv_geometry(tuple(x.shape), kernel, stride, padding, dilation)
            return x.new_zeros(()).expand(g[0] * g[12] * g[13], g[1] * g[4] * g[5])
        return patches(x, kernel, stride, padding, dilation)

    @staticmethod
    def backward(ctx, grad):
        shape, kernel, stride, padding, dilation = ctx.geometry
        if ctx.lazy is not None and ctx.lazy.grad is not None:  # the product's backward made it
            image, ctx.lazy.grad = ctx.lazy.grad, None
            return image, None, None, None, None, None
        if not grad.t().is_contiguous():  # (the product makes it transposed: col2im reads either)
            grad = grad.contiguous()
        return col2im(grad, shape, kernel, stride, padding, dilation), None, None, None, None, None


class _Col2im(torch.autograd.Function):
    """A transposed convolution's output from its columns (``col2im``); the gradient of the
    columns is the patches of the output's gradient."""

    @staticmethod
    def forward(ctx, cols, shape, kernel, stride, padding, dilation):
        ctx.geometry = (kernel, stride, padding, dilation)
        return col2im(cols, shape, kernel, stride, padding, dilation)

    @staticmethod
    def backward(ctx, grad):
        return patches(grad, *ctx.geometry), None, None, None, None, None


# ---- every convolution ----------------------------------------------------------------------

def _tuple(v, nd: int) -> tuple:
    """A convolution's stride, padding, dilation or output padding as one number a spatial
    dimension (torch takes a number for all of them, or a sequence)."""
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * nd


def convolution(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride, padding, dilation,
                transposed: bool = False, output_padding=None, groups: int = 1, device=None, *,
                mm=None) -> torch.Tensor:
    """``aten.convolution`` (input N x C x *S; stride, padding, dilation and output_padding one
    number per spatial axis) as matrix products on ``device``: one product per group, forward
    and backward (``HbfpMatmul``'s), the bias added to the fp32 result and rounded once to the
    operands' dtype. ``mm(a, b, **kw)``: the products by another function (tests: the geometry
    alone, with exact products)."""
    nd = x.dim() - 2
    if nd < 1:
        raise ValueError(f"a convolution takes (N, C, *spatial) input, got shape {tuple(x.shape)}")
    if x.dtype != torch.float32:  # bf16, fp16: their patches in fp32 (exact), one rounding at the end
        y = convolution(x.float(), weight, None, stride, padding, dilation, transposed, output_padding, groups,
                        device, mm=mm)
        if bias is not None:
            return _add_bias(y, bias.reshape(-1, *(1,) * nd), x.dtype, weight.dtype)
        return y.to(torch.promote_types(x.dtype, weight.dtype))
    kernel = tuple(weight.shape[2:])
    stride, padding, dilation, output_padding = (_tuple(v, nd) for v in (stride, padding, dilation, output_padding or 0))
    n, size = x.shape[0], tuple(x.shape[2:])
    out = _out_size(size, kernel, stride, padding, dilation, transposed, output_padding)
    on_device = mm is None  # (else a test's products: the geometry alone)
    if mm is None:
        device = device or default_device()
        mm = lambda a, b, **kw: matmul(a, b, device, **kw)  # noqa: E731
        stored = lambda m, t: _stored_operand(weight, device, m, transposed=t)  # noqa: E731
    else:
        stored = lambda m, t: None  # noqa: E731
    if transposed:
        cin, cout = x.shape[1] // groups, weight.shape[1]
        ys = []
        for g in range(groups):
            wg = weight[g * cin:(g + 1) * cin].reshape(cin, -1)  # Cin/g x (Cout/g * K)
            cols = mm(_rows(x[:, g * cin:(g + 1) * cin]), wg, stored=stored(wg, False), fp32_out=bias is not None)
            ys.append(_Col2im.apply(cols, (n, cout, *out), kernel, stride, padding, dilation))
        y = ys[0] if groups == 1 else torch.cat(ys, dim=1)
        return y if bias is None else _add_bias(y, bias.reshape(-1, *(1,) * nd), x.dtype, weight.dtype)
    out_ch = weight.shape[0]
    cin, cout = x.shape[1] // groups, out_ch // groups
    matrix = _matrix(weight)  # out x (in / groups * K)
    if (on_device and nd == 2 and _LazyPatches.applies(device, x)
            and _ImageProduct.applies(device, x, weight, bias, groups)):
        lazy = _LazyPatches(x, kernel, stride, padding, dilation)
        pg = _Patches.apply(x, kernel, stride, padding, dilation, lazy)
        return _ImageProduct.apply(pg, matrix.t(), bias, device, stored(matrix, True), lazy, (n, out_ch, *out))
    ys = []
    for g in range(groups):
        # (N * prod(O), C/g * prod(K)) @ (C/g * prod(K), OUT/g)
        xg = x if groups == 1 else x[:, g * cin:(g + 1) * cin]
        lazy = _LazyPatches(xg, kernel, stride, padding, dilation) \
            if nd == 2 and device is not None and _LazyPatches.applies(device, xg) else None
        pg = _Patches.apply(xg, kernel, stride, padding, dilation, lazy)
        wg = matrix if groups == 1 else matrix[g * cout:(g + 1) * cout]
        extra = {"patches": lazy} if lazy is not None else {}
        ys.append(mm(pg, wg.t(), stored=stored(wg, True), grad_a_t=True, out_t=True, fp32_out=bias is not None,
                     **extra))
    # (N * prod(O)) x OUT, each product made transposed: its channels' rows lie as the image's
    # planes, one copy from the image's layout (torch's own, where an activation and its
    # backward run several times faster than on mixed strides)
    y = ys[0] if groups == 1 else torch.cat(ys, dim=1)
    if bias is not None:
        y = _add_bias(y, bias, x.dtype, weight.dtype)
    return y.t().reshape(out_ch, n, math.prod(out)).transpose(0, 1).contiguous().view(n, out_ch, *out)


def _same_padding(kernel, dilation) -> tuple[int, ...]:
    """F.pad's amounts (last axis first) of padding='same': the total dilation * (k - 1) per
    axis, the extra one on the right, as torch's convolution pads it."""
    out = []
    for k, d in reversed(list(zip(kernel, dilation))):
        total = d * (k - 1)
        out += [total // 2, total - total // 2]
    return tuple(out)


def _pair(v) -> tuple[int, int]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


def conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride=1, padding=0, dilation=1,
           groups: int = 1, device=None, *, padding_mode: str = "zeros") -> torch.Tensor:
    """``F.conv2d`` as im2col products in HBFP on ``device``: any stride, dilation and groups (one
    product per group, depthwise included), padding as numbers, ``'same'`` or ``'valid'``, every
    padding mode (the input padded first, as torch does), batched or unbatched input. The
    weight's wide storage (``wide_weight_storage``) is read as the products' codes."""
    device = device or default_device()
    if x.dim() == 3:  # unbatched (C, H, W)
        return conv2d(x[None], weight, bias, stride, padding, dilation, groups, device, padding_mode=padding_mode)[0]
    if x.dim() != 4:
        raise ValueError(f"conv2d takes (N, C, H, W) or (C, H, W) input, got shape {tuple(x.shape)}")
    kernel, stride, dilation = tuple(weight.shape[-2:]), _pair(stride), _pair(dilation)
    if isinstance(padding, str):
        if padding not in ("same", "valid"):
            raise ValueError(f"padding must be a number, a pair, 'same' or 'valid', got {padding!r}")
        if padding == "same" and stride != (1, 1):
            raise ValueError("padding='same' needs stride 1 (as in torch)")
        amounts = _same_padding(kernel, dilation) if padding == "same" else (0, 0, 0, 0)
        padding = (0, 0)
    else:
        padding = _pair(padding)
        amounts = (padding[1], padding[1], padding[0], padding[0])
        if padding_mode != "zeros":
            padding = (0, 0)
    if any(amounts) and padding == (0, 0):
        x = F.pad(x, amounts, mode="constant" if padding_mode == "zeros" else padding_mode)
    return convolution(x, weight, bias, stride, padding, dilation, False, (0, 0), groups, device)


def conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride=1, padding=0, dilation=1,
           groups: int = 1, device=None, *, padding_mode: str = "zeros") -> torch.Tensor:
    """``F.conv1d`` in HBFP: ``conv2d`` on a height of one."""
    if x.dim() == 2:  # unbatched (C, L)
        return conv1d(x[None], weight, bias, stride, padding, dilation, groups, device, padding_mode=padding_mode)[0]
    one = lambda v: (1, v[0] if isinstance(v, (tuple, list)) else v)  # noqa: E731
    pad = padding if isinstance(padding, str) else (0, padding[0] if isinstance(padding, (tuple, list)) else padding)
    if isinstance(padding, str) or padding_mode == "zeros":
        y = conv2d(x[:, :, None], weight[:, :, None], bias, one(stride), pad, one(dilation), groups, device,
                   padding_mode=padding_mode)
    else:  # pad the length only, in the mode (a 2-D pad would pad the height of one too)
        x = F.pad(x, (pad[1], pad[1]), mode=padding_mode)
        y = conv2d(x[:, :, None], weight[:, :, None], bias, one(stride), 0, one(dilation), groups, device)
    return y[:, :, 0]
