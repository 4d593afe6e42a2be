"""Convolutions as matrix products on the device.

- ``conv2d`` and ``conv1d`` (``F.conv2d``, ``F.conv1d``; the layers ``Conv2d``, ``Conv1d``):
  im2col products through ``matmul``, the patches gathered by the compiled kernels
  (``_Patches``), or quantized from the image directly where the product reads only their codes
  (``_LazyPatches``); groups, dilation, every padding mode, ``'same'``, unbatched input; a
  weight in wide storage read as its codes.
- ``conv`` and ``conv_backward``: ``aten.convolution`` and its backward of any number of
  spatial dimensions, transposed or not, every matrix product by a given ``product`` (the
  ATen-level products of ``offload``: 3-d and transposed convolutions, ``Convolution``).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from hbfp.recipes import ProductConfig, RecipeInUse

from . import counts
from .device import _device_work, _square, default_device
from .functional import _add_bias, matmul
from .storage import _matrix, _stored_operand

__all__ = ["conv2d", "conv1d", "patches", "col2im", "conv", "conv_backward", "Convolution"]


# ---- conv2d and conv1d: im2col products -------------------------------------------------

@torch.compiler.disable  # compiled kernels: a call torch.compile leaves as it is
def _im2col(x, kernel, stride, padding, dilation):
    from hbfp import kernels

    return kernels.im2col(x, kernel, stride, padding, dilation)


@torch.compiler.disable
def _col2im(cols, shape, kernel, stride, padding, dilation):
    from hbfp import kernels

    return kernels.col2im(cols, shape, kernel, stride, padding, dilation)


class _LazyPatches:
    """The patches of a convolution of ``x`` that a product reads as codes only: quantized from
    the image directly (``hbfp.kernels.im2col_quantize``: no fp32 patch matrix), with the
    rounding and the seed the product would give the patch matrix itself."""

    def __init__(self, x, kernel, stride, padding, dilation):
        self.x, self.geometry = x.detach(), (kernel, stride, padding, dilation)

    @staticmethod
    def applies(device, x) -> bool:
        from hbfp import kernels

        return (device.in_process and _square(device) and x.dtype == torch.float32
                and x.device.type == "cpu" and kernels._conv_lib(x) is not None)

    @torch.compiler.disable
    def codes(self, device, cfg: ProductConfig, in_use: RecipeInUse):
        from hbfp import kernels

        seed = in_use.seed(cfg)  # as _operand draws it: one a quantization
        with _device_work():
            return kernels.im2col_quantize(self.x, *self.geometry, device.format(cfg.rounding), seed=seed)


class _Patches(torch.autograd.Function):
    """The patches of a convolution as one matrix, (N*OH*OW) x (C*KH*KW): ``F.unfold`` with its
    columns as rows, gathered in one pass (``hbfp.kernels.im2col``); with ``lazy``, a stand-in
    of no memory (a zero expanded to the matrix's shape) that only carries the gradient, for a
    product that reads the patches' codes (``_LazyPatches``). The backward sums the gradient
    back onto the image as ``unfold``'s own backward (``F.fold``) does, in its order
    (``hbfp.kernels.col2im``), so gradients keep their bits."""

    @staticmethod
    def forward(ctx, x, kernel, stride, padding, dilation, lazy=False):
        ctx.geometry = (x.shape[0], x.shape[1], tuple(x.shape[-2:]), kernel, stride, padding, dilation)
        if lazy:
            from hbfp import kernels

            g = kernels.conv_geometry(tuple(x.shape), kernel, stride, padding, dilation)
            return x.new_zeros(()).expand(g[0] * g[12] * g[13], g[1] * g[4] * g[5])
        return _im2col(x, kernel, stride, padding, dilation)

    @staticmethod
    def backward(ctx, grad):
        n, c, size, kernel, stride, padding, dilation = ctx.geometry
        if not grad.t().is_contiguous():  # (the product makes it transposed: col2im reads either)
            grad = grad.contiguous()
        return _col2im(grad, (n, c, *size), kernel, stride, padding, dilation), None, None, None, None, None


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
    if x.dtype != torch.float32:  # bf16, fp16: their patches in fp32 (exact), one rounding at the end
        y = conv2d(x.float(), weight, None, stride, padding, dilation, groups, device, padding_mode=padding_mode)
        if bias is not None:
            return _add_bias(y, bias[:, None, None], x.dtype, weight.dtype)
        return y.to(torch.promote_types(x.dtype, weight.dtype))
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
    n, _, h, w = x.shape
    kh, kw = kernel
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    out_ch = weight.shape[0]
    cin, cout = x.shape[1] // groups, out_ch // groups
    matrix = _matrix(weight)  # out x (in / groups * KH * KW)
    ys = []
    for i in range(groups):
        # (N*OH*OW, C/g*KH*KW) @ (C/g*KH*KW, OUT/g)
        xi = x if groups == 1 else x[:, i * cin:(i + 1) * cin]
        lazy = _LazyPatches(xi, kernel, stride, padding, dilation) if _LazyPatches.applies(device, xi) else None
        patches = _Patches.apply(xi, kernel, stride, padding, dilation, lazy is not None)
        wi = matrix if groups == 1 else matrix[i * cout:(i + 1) * cout]
        ys.append(matmul(patches, wi.t(), device, stored=_stored_operand(weight, device, None if groups == 1 else wi),
                         patches=lazy, grad_a_t=True, out_t=True, fp32_out=bias is not None))
    # (N*OH*OW) x OUT, each product made transposed: its channels' rows lie as the image's
    # planes, one copy from the image's layout (torch's own, where an activation and its
    # backward run several times faster than on mixed strides)
    y = ys[0] if groups == 1 else torch.cat(ys, dim=1)
    if bias is not None:
        y = _add_bias(y, bias, x.dtype, weight.dtype)
    return y.t().reshape(out_ch, n, oh * ow).transpose(0, 1).contiguous().view(n, out_ch, oh, ow)


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


# ---- convolution geometry, any number of spatial dimensions ------------------------------

def patches(x: torch.Tensor, kernel, stride, padding, dilation) -> torch.Tensor:
    """The patches of ``x`` (N, C, *S) as one matrix (N * prod(O), C * prod(K)), rows in
    (n, *o) order, columns in (c, *k) order (``F.unfold``'s columns as rows); zero padding."""
    from hbfp import kernels

    n, c = x.shape[:2]
    if len(kernel) == 2 and x.dtype == torch.float32 and x.device.type == "cpu":
        return kernels.im2col(x, tuple(kernel), tuple(stride), tuple(padding), tuple(dilation))
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
    from hbfp import kernels

    n, c, *size = shape
    nd = len(kernel)
    if nd == 2 and cols.dtype == torch.float32 and cols.device.type == "cpu":
        return kernels.col2im(cols, tuple(shape), tuple(kernel), tuple(stride), tuple(padding), tuple(dilation))
    out = [(s + 2 * p - dl * (k - 1) - 1) // st + 1 for s, k, st, p, dl in zip(size, kernel, stride, padding, dilation)]
    c6 = cols.reshape(n, *out, c, *kernel).permute(0, nd + 1, *range(1, nd + 1), *range(nd + 2, 2 * nd + 2))
    image = torch.zeros(n, c, *(s + 2 * p for s, p in zip(size, padding)), dtype=cols.dtype, device=cols.device)
    for offs in itertools.product(*(range(k) for k in kernel)):
        where = tuple(slice(o * dl, o * dl + st * (q - 1) + 1, st) for o, dl, st, q in zip(offs, dilation, stride, out))
        image[(slice(None), slice(None), *where)] += c6[(..., *offs)]
    return image[(slice(None), slice(None), *(slice(p, p + s) for p, s in zip(padding, size)))]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(N, C, *S) as a matrix (N * prod(S), C)."""
    return x.movedim(1, -1).reshape(-1, x.shape[1])


def _image(rows: torch.Tensor, n: int, size) -> torch.Tensor:
    """The inverse of ``_rows``: (N * prod(S), C) to (N, C, *S)."""
    return rows.reshape(n, *size, rows.shape[1]).movedim(-1, 1)


def _out_size(size, kernel, stride, padding, dilation, transposed, output_padding):
    if transposed:
        return [(i - 1) * st - 2 * p + dl * (k - 1) + op + 1
                for i, k, st, p, dl, op in zip(size, kernel, stride, padding, dilation, output_padding)]
    return [(s + 2 * p - dl * (k - 1) - 1) // st + 1 for s, k, st, p, dl in zip(size, kernel, stride, padding, dilation)]


def conv(product, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """``aten.convolution`` with every matrix product by ``product(a, b)`` (2-D fp32):
    a convolution is patches @ W^T per group; a transposed one (weight Cin x Cout/g x K) is
    col2im(x @ W) onto the output."""
    nd = x.dim() - 2
    kernel = list(weight.shape[2:])
    n, size = x.shape[0], list(x.shape[2:])
    out = _out_size(size, kernel, stride, padding, dilation, transposed, output_padding)
    ys = []
    for g in range(groups):
        if transposed:
            cin = x.shape[1] // groups
            wg = weight[g * cin:(g + 1) * cin]
            cols = product(_rows(x[:, g * cin:(g + 1) * cin]), wg.reshape(cin, -1))
            ys.append(col2im(cols, (n, wg.shape[1], *out), kernel, stride, padding, dilation))
        else:
            cout, cin = weight.shape[0] // groups, x.shape[1] // groups
            wg = weight[g * cout:(g + 1) * cout].reshape(cout, -1)
            y = product(patches(x[:, g * cin:(g + 1) * cin], kernel, stride, padding, dilation), wg.t())
            ys.append(_image(y, n, out))
    y = ys[0] if groups == 1 else torch.cat(ys, dim=1)
    if bias is not None:
        y = y + bias.reshape(1, -1, *([1] * nd))
    assert y.dim() == nd + 2
    return y


def conv_backward(product, grad, x, weight, stride, padding, dilation, transposed, output_padding, groups, mask):
    """``aten.convolution_backward``: (grad_input, grad_weight, grad_bias) where ``mask`` asks
    for them, every matrix product by ``product``; the bias gradient is a sum on the host."""
    nd = x.dim() - 2
    kernel = list(weight.shape[2:])
    n, size = x.shape[0], list(x.shape[2:])
    gi, gw = [], []
    for g in range(groups):
        if transposed:
            cin, cout = x.shape[1] // groups, weight.shape[1]
            wg = weight[g * cin:(g + 1) * cin].reshape(cin, -1)  # Cin/g x (Cout/g * K)
            gcols = patches(grad[:, g * cout:(g + 1) * cout], kernel, stride, padding, dilation)
            if mask[0]:
                gi.append(_image(product(gcols, wg.t()), n, size))
            if mask[1]:
                xg = _rows(x[:, g * cin:(g + 1) * cin])
                gw.append(product(xg.t(), gcols).reshape(cin, cout, *kernel))
        else:
            cout, cin = weight.shape[0] // groups, x.shape[1] // groups
            wg = weight[g * cout:(g + 1) * cout].reshape(cout, -1)  # Cout/g x (Cin/g * K)
            gg = _rows(grad[:, g * cout:(g + 1) * cout])
            if mask[0]:
                gi.append(col2im(product(gg, wg), (n, cin, *size), kernel, stride, padding, dilation))
            if mask[1]:
                pg = patches(x[:, g * cin:(g + 1) * cin], kernel, stride, padding, dilation)
                gw.append(product(pg.t(), gg).t().reshape(cout, cin, *kernel))
    grad_input = (gi[0] if groups == 1 else torch.cat(gi, dim=1)) if mask[0] else None
    grad_weight = (gw[0] if groups == 1 else torch.cat(gw, dim=0)) if mask[1] else None
    grad_bias = grad.sum(dim=(0, *range(2, nd + 2))) if mask[2] else None
    return grad_input, grad_weight, grad_bias


class Convolution(torch.autograd.Function):
    """A convolution of any kind (``conv``) with its backward (``conv_backward``), every matrix
    product by ``product`` (``offload``'s ATen-level products: forward operands rounded by the
    recipe's forward configuration, backward ones by its backward configuration)."""

    @staticmethod
    def forward(ctx, x, weight, bias, product, stride, padding, dilation, transposed, output_padding, groups):
        ctx.product = product
        ctx.geometry = (stride, padding, dilation, transposed, output_padding, groups)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        return conv(product, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        mask = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
        with counts.routing("conv"):
            gi, gw, gb = conv_backward(ctx.product, grad, x, weight, *ctx.geometry, mask)
        return gi, gw, gb, None, None, None, None, None, None, None
