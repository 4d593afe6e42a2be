"""PyTorch integration: matrix products of a training loop in HBFP on an hbfp device.

- ``HbfpMatmul``: ``a @ b`` on the device, forward and both backward products
  (``grad_a = grad @ b^T``, ``grad_b = a^T @ grad``), each bit for bit as
  ``hbfp.golden.gemm.gemm`` on the device's format. With square tiles the backward products
  reuse the forward quantization of ``a`` and ``b`` (a transposed operand reuses its tiles).
- ``Linear``, ``Conv2d`` (im2col products) and ``convert(model)``, which swaps them into a
  model in place.
- ``offload(device)``: a context that routes ``mm``, ``addmm``, ``bmm``, ``matmul`` and
  ``linear`` of an unchanged model to the device, forward and backward.
- ``set_matmul_precision("highest" | "hbfp8")``, modelled on
  ``torch.set_float32_matmul_precision``: ``offload`` sets ``"hbfp8"`` while it is active and
  restores the previous value on exit, exceptions included.
- ``wide_weight_storage(model, optimizer)``: the paper's wide weight storage. The master
  weights of the model's linear and convolution layers are kept as HBFP16 (16-bit mantissas,
  the device's tiles): they are rounded onto the HBFP16 grid now and after every
  ``optimizer.step()``, so small updates accumulate in 16 bits; every product reads them as
  HBFP8 by ``requantize`` (same tile exponents, mantissas rounded to 8 bits), forward and
  backward.

Everything else (loss, optimizer, bias additions) stays in fp32 on the CPU.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "PRECISIONS",
    "set_matmul_precision",
    "get_matmul_precision",
    "matmul_precision",
    "default_device",
    "HbfpMatmul",
    "matmul",
    "Linear",
    "Conv1d",
    "Conv2d",
    "conv1d",
    "conv2d",
    "convert",
    "offload",
    "fallbacks",
    "reset_fallbacks",
    "HbfpFallbackWarning",
    "wide_weight_storage",
    "WideWeightStorage",
    "weight_storage",
]

#: "highest": fp32 products by PyTorch; "hbfp8": products on the hbfp device.
PRECISIONS = ("highest", "hbfp8")

_state = threading.local()
_default = {"device": None}
_default_lock = threading.Lock()


def set_matmul_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"matmul precision must be one of {PRECISIONS}, got {precision!r}")
    _state.precision = precision


def get_matmul_precision() -> str:
    return getattr(_state, "precision", "highest")


@contextlib.contextmanager
def matmul_precision(precision: str):
    """``set_matmul_precision`` for the body of a ``with`` block, restored on exit (exceptions
    included)."""
    previous = get_matmul_precision()
    set_matmul_precision(precision)
    try:
        yield
    finally:
        set_matmul_precision(previous)


def default_device():
    """The device used when none is given: the in-process ``emu`` (opened once)."""
    with _default_lock:
        if _default["device"] is None:
            from hbfp import host

            _default["device"] = host.open("emu")
        return _default["device"]


def _numpy(t: torch.Tensor) -> np.ndarray:
    if t.device.type != "cpu":
        raise ValueError(f"hbfp.torch runs CPU tensors through the device driver; got a tensor on {t.device}")
    return t.detach().to(torch.float32).contiguous().numpy()


def _device_gemm(device, a, b, **kw) -> torch.Tensor:
    """``a @ b`` on ``device`` (``Device.gemm``'s keywords): on the in-process emu with torch's
    kernels where the tensors are (no NumPy round trip), else through the device's driver.
    ``offload`` lets the kernels' own torch operations through (a backward product runs
    while the context routes products, outside its handler)."""
    previous = getattr(_state, "on_device", False)
    _state.on_device = True
    try:
        with torch._C.DisableTorchFunction():  # and no handler at all for the kernels' operations
            return _device_gemm_inner(device, a, b, **kw)
    finally:
        _state.on_device = previous


def _device_gemm_inner(device, a, b, **kw) -> torch.Tensor:
    if getattr(device, "direct_device", None) is not None:
        return device.gemm_tensors(a.detach() if isinstance(a, torch.Tensor) else a,
                                   b.detach() if isinstance(b, torch.Tensor) else b, **kw)
    from hbfp.golden.kernels import to_bfp_tensor

    # Tensors go as NumPy arrays, codes (stored weights) as BFPTensors.
    a, b = (to_bfp_tensor(*x, device.format()) if isinstance(x, tuple) else _numpy(x) for x in (a, b))
    return torch.from_numpy(np.ascontiguousarray(device.gemm(a, b, **kw)))


@dataclass(frozen=True)
class _StoredOperand:
    """The right operand of a product as the device reads it from wide storage: ``codes``
    (``(codes, exponents)`` tensors in the device's format, requantized from HBFP16) of the
    stored matrix, which is ``b`` itself or, with ``transposed``, ``b``'s transpose (a Linear's
    weight is stored out x in and used as in x out)."""

    codes: object
    transposed: bool


def _quantized(device, x: torch.Tensor):
    """``x`` as the products read it: on the in-process emu its codes and exponents in the
    device's format, quantized once for the forward and both backward products (the same
    codes each product's own quantization gives: a transposed operand reuses its square
    tiles); elsewhere ``x`` itself, which the driver quantizes."""
    if getattr(device, "direct_device", None) is None:
        return x
    from hbfp.golden import kernels

    fmt = device.format()
    with torch._C.DisableTorchFunction():
        x = x.detach()
        if (x.dim() == 2 and not x.is_contiguous() and x.t().is_contiguous() and fmt.tile[0] == fmt.tile[1]
                and fmt.rounding != "stochastic"):
            # A transposed view (a Linear's weight as in x out): square tiles hold the same
            # elements either way and the rounding is elementwise, so the stored matrix's codes
            # and exponents, transposed, are the view's own (no transposed copy to quantize).
            codes, exps = kernels.quantize(x.t(), fmt)
            return codes.t(), exps.t()
        return kernels.quantize(x, fmt)


class HbfpMatmul(torch.autograd.Function):
    """``a @ b`` (2-D) on ``device``, with the backward products on the device too.

    ``stored``: optional ``_StoredOperand`` of ``b`` (wide weight storage): the products read
    its codes instead of quantizing ``b``; the gradient still flows to ``b``."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, device, stored: _StoredOperand | None = None):
        ctx.device = device
        ctx.stored = stored
        ctx.qa = _quantized(device, a)
        ctx.qb = stored.codes if stored is not None else _quantized(device, b)
        ctx.transposed = stored is not None and stored.transposed
        return _device_gemm(device, ctx.qa, ctx.qb, transpose_b=ctx.transposed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_a = grad_b = None
        qg = _quantized(ctx.device, grad) if ctx.needs_input_grad[0] or ctx.needs_input_grad[1] else None
        if ctx.needs_input_grad[0]:  # grad @ b^T (b stored as in the forward product)
            grad_a = _device_gemm(ctx.device, qg, ctx.qb, transpose_b=not ctx.transposed)
        if ctx.needs_input_grad[1]:
            grad_b = _device_gemm(ctx.device, ctx.qa, qg, transpose_a=True)  # a^T @ grad
        return grad_a, grad_b, None, None


def matmul(a: torch.Tensor, b: torch.Tensor, device=None, *, stored: _StoredOperand | None = None) -> torch.Tensor:
    """``a @ b`` in HBFP with torch.matmul's shapes: matrices, stacks (leading axes broadcast)
    and vectors (a 1-D operand is a one-row or one-column matrix, its axis removed after)."""
    device = device or default_device()
    if a.dim() == 0 or b.dim() == 0:
        raise ValueError("hbfp matmul takes vectors, matrices or stacks of matrices, not scalars")
    if b.dim() == 1:  # (..., K) @ (K,): a one-column product
        return matmul(a, b[:, None], device, stored=stored)[..., 0]
    if a.dim() == 1:  # (K,) @ (..., K, N): a one-row product
        return matmul(a[None, :], b, device, stored=stored)[..., 0, :]
    if a.dim() == 2 and b.dim() == 2:
        return HbfpMatmul.apply(a, b, device, stored)
    if b.dim() == 2:  # (..., M, K) @ (K, N): one product over all leading rows
        lead = a.shape[:-1]
        return HbfpMatmul.apply(a.reshape(-1, a.shape[-1]), b, device, stored).reshape(*lead, b.shape[-1])
    if stored is not None:
        raise ValueError("a stored (wide) operand is a matrix, not a stack")
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    out = torch.stack([HbfpMatmul.apply(a[i], b[i], device) for i in range(a.shape[0])])
    return out.reshape(*batch, *out.shape[-2:])


# ---- wide weight storage ----------------------------------------------------------------

_STORAGE_ATTR = "_hbfp_storage"  # set on a weight Parameter: its storage Format (HBFP16)


def weight_storage(weight: torch.Tensor):
    """The BFP format ``weight`` is stored in (``wide_weight_storage``), or None (fp32)."""
    return getattr(weight, _STORAGE_ATTR, None)


def _matrix(weight: torch.Tensor) -> torch.Tensor:
    """A layer's weight as the matrix its product uses: out x (in * kernel)."""
    return weight.reshape(weight.shape[0], -1)


def _stored_operand(weight: torch.Tensor, device, matrix: torch.Tensor | None = None) -> _StoredOperand | None:
    """The codes the device reads of a wide-stored weight (None if stored as fp32): of its
    matrix, or of ``matrix`` (a group's rows of it)."""
    from hbfp.golden import kernels

    storage = weight_storage(weight)
    if storage is None:
        return None
    fmt = device.format()
    if storage.tile != fmt.tile:
        raise ValueError(f"wide weight storage in tiles {storage.tile} cannot be read by a device with tiles "
                         f"{fmt.tile}: requantize keeps the tiles (use a storage format with the device's tiles)")
    # exact: the weight is on the storage grid
    wide = kernels.quantize((_matrix(weight) if matrix is None else matrix).detach(), storage)
    return _StoredOperand(kernels.requantize(*wide, storage, fmt), transposed=True)


def _snap(weight: torch.Tensor, storage) -> None:
    from hbfp.golden import kernels

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


def wide_weight_storage(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                        storage=None) -> WideWeightStorage:
    """Keep the weights of ``model``'s ``Linear`` and ``Conv2d`` layers (torch's or ours) in
    wide BFP storage (default ``HBFP16``): rounded onto its grid now (to nearest even) and
    after every ``optimizer.step()``; the products (``hbfp.torch`` layers, ``offload``) read
    them as the device's format by ``requantize``. Biases stay fp32 (they are not products'
    operands). The training loop is unchanged."""
    from hbfp.golden import HBFP16, Format

    storage = HBFP16 if storage is None else storage
    if not isinstance(storage, Format):
        raise TypeError(f"storage must be a hbfp.golden.Format, got {storage!r}")
    if storage.rounding != "nearest_even":
        raise ValueError("wide weight storage rounds to nearest even (stochastic storage rounding needs a seed per step)")
    weights = [mod.weight for mod in model.modules() if isinstance(mod, (torch.nn.Linear, torch.nn.Conv2d))]
    if not weights:
        raise ValueError("the model has no Linear or Conv2d layer whose weights could be stored wide")
    return WideWeightStorage(weights, storage, optimizer)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, device) -> torch.Tensor:
    # W is stored out x in; the product uses it transposed, which reuses its square tiles. A 1-D
    # input is one row (matmul's vector case).
    y = matmul(x, weight.t(), device, stored=_stored_operand(weight, device))
    return y + bias if bias is not None else y


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` whose product runs in HBFP on ``device`` (default: ``emu``)."""

    def __init__(self, *args, device_handle=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.device_handle = device_handle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.weight, self.bias, self.device_handle or default_device())


class _Patches(torch.autograd.Function):
    """The patches of a convolution as one matrix, (N*OH*OW) x (C*KH*KW): ``F.unfold`` with its
    columns as rows, gathered in one pass by the compiled kernel (``hbfp.golden.native.im2col``;
    ``F.unfold`` and a transposed copy without it). The backward sums the gradient back onto the
    image as ``unfold``'s own backward (``F.fold``) does, in its order (``native.col2im``), so
    gradients keep their bits."""

    @staticmethod
    def forward(ctx, x, kernel, stride, padding, dilation):
        from hbfp.golden import native

        n = x.shape[0]
        ctx.geometry = (n, x.shape[1], tuple(x.shape[-2:]), kernel, stride, padding, dilation)
        if x.device.type == "cpu" and x.dtype == torch.float32 and native.available():
            return torch.from_numpy(native.im2col(x.detach().contiguous().numpy(), kernel, stride, padding, dilation))
        cols = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
        return cols.transpose(1, 2).reshape(n * cols.shape[2], cols.shape[1])

    @staticmethod
    def backward(ctx, grad):
        from hbfp.golden import native

        n, c, size, kernel, stride, padding, dilation = ctx.geometry
        if grad.device.type == "cpu" and grad.dtype == torch.float32 and native.available():
            g = native.col2im(grad.contiguous().numpy(), (n, c, *size), kernel, stride, padding, dilation)
            return torch.from_numpy(g), None, None, None, None
        cols = grad.reshape(n, grad.shape[0] // n, grad.shape[1]).transpose(1, 2)
        return F.fold(cols, size, kernel, dilation=dilation, padding=padding, stride=stride), None, None, None, None


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
        patches = _Patches.apply(xi, kernel, stride, padding, dilation)
        wi = matrix if groups == 1 else matrix[i * cout:(i + 1) * cout]
        ys.append(matmul(patches, wi.t(), device, stored=_stored_operand(weight, device, None if groups == 1 else wi)))
    y = ys[0] if groups == 1 else torch.cat(ys, dim=1)
    if bias is not None:
        y = y + bias
    return y.reshape(n, oh * ow, out_ch).transpose(1, 2).reshape(n, out_ch, oh, ow)


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


class Conv2d(torch.nn.Conv2d):
    """``torch.nn.Conv2d`` whose products run in HBFP on ``device`` (``conv2d``)."""

    def __init__(self, *args, device_handle=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.device_handle = device_handle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups,
                      self.device_handle or default_device(), padding_mode=self.padding_mode)


class Conv1d(torch.nn.Conv1d):
    """``torch.nn.Conv1d`` whose products run in HBFP on ``device`` (``conv1d``)."""

    def __init__(self, *args, device_handle=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.device_handle = device_handle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return conv1d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups,
                      self.device_handle or default_device(), padding_mode=self.padding_mode)


def _converted(layer: torch.nn.Module, device) -> torch.nn.Module | None:
    """The HBFP version of a torch ``Linear``, ``Conv1d`` or ``Conv2d`` (the same parameter
    tensors), else None."""
    if isinstance(layer, torch.nn.Linear) and not isinstance(layer, Linear):
        new = Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device_handle=device)
    elif isinstance(layer, (torch.nn.Conv1d, torch.nn.Conv2d)) and not isinstance(layer, (Conv1d, Conv2d)):
        cls = Conv2d if isinstance(layer, torch.nn.Conv2d) else Conv1d
        new = cls(layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride,
                  padding=layer.padding, dilation=layer.dilation, groups=layer.groups,
                  bias=layer.bias is not None, padding_mode=layer.padding_mode, device_handle=device)
    else:
        return None
    new.weight = layer.weight
    if layer.bias is not None:
        new.bias = layer.bias
    new.train(layer.training)
    return new


def convert(model: torch.nn.Module, device=None) -> torch.nn.Module:
    """Swap every ``nn.Linear``, ``nn.Conv1d`` and ``nn.Conv2d`` of ``model`` for the HBFP versions, in place,
    keeping their parameters (the same tensors); returns the model. A bare layer comes back as
    its HBFP version (use the returned module)."""
    bare = _converted(model, device)
    if bare is not None:
        return bare
    for name, child in list(model.named_children()):
        new = _converted(child, device)
        if new is None:
            convert(child, device)
        else:
            setattr(model, name, new)
    return model


class _Offload(TorchFunctionMode):
    """Routes the matrix products of torch's functional API to the device."""

    def __init__(self, device):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if get_matmul_precision() == "hbfp8" and not getattr(_state, "on_device", False):
            if func is F.linear:
                x, weight = args[0], args[1]
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                return _linear(x, weight, bias, self.device)
            if func in (torch.mm, torch.Tensor.mm, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm,
                        torch.Tensor.bmm):
                a, b = args[0], args[1]
                if a.dim() >= 1 and b.dim() >= 1 and a.is_floating_point() and b.is_floating_point():
                    return matmul(a, b, self.device)
            if func in (F.conv2d, torch.conv2d, F.conv1d, torch.conv1d):
                x, weight = args[0], args[1]
                names = ("bias", "stride", "padding", "dilation", "groups")
                extra = dict(zip(names, args[2:]))
                extra.update({k: v for k, v in kwargs.items() if k in names})
                fn = conv2d if func in (F.conv2d, torch.conv2d) else conv1d
                return fn(x, weight, device=self.device, **extra)
            if func in (torch.mv, torch.Tensor.mv, torch.dot, torch.Tensor.dot):
                return matmul(args[0], args[1], self.device)
            if func in (torch.addmm, torch.Tensor.addmm, torch.addmv, torch.Tensor.addmv, torch.baddbmm,
                        torch.Tensor.baddbmm):
                inp, a, b = args[0], args[1], args[2]
                beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
                return beta * inp + alpha * matmul(a, b, self.device)
            name = _FALLBACKS.get(func)
            if name is not None:
                _fallback(name)
        return func(*args, **kwargs)


class HbfpFallbackWarning(UserWarning):
    """An operation with matrix products ran in fp32 on the host under ``offload``."""


# Operations whose products ``offload`` does not send to the device yet: they run as torch runs
# them, with a warning the first time and a count (``fallbacks()``).
_FALLBACKS = {f: name for name, f in (
    ("multi_head_attention_forward", F.multi_head_attention_forward),
    ("scaled_dot_product_attention", F.scaled_dot_product_attention),
    ("einsum", torch.einsum), ("tensordot", torch.tensordot), ("bilinear", F.bilinear),
    ("addbmm", torch.addbmm), ("conv3d", F.conv3d), ("conv_transpose1d", F.conv_transpose1d),
    ("conv_transpose2d", F.conv_transpose2d), ("conv_transpose3d", F.conv_transpose3d),
    ("lstm", getattr(torch, "lstm", None)), ("gru", getattr(torch, "gru", None)),
    ("rnn_tanh", getattr(torch, "rnn_tanh", None)), ("rnn_relu", getattr(torch, "rnn_relu", None)),
) if f is not None}
_fallback_calls: dict[str, int] = {}


def _fallback(name: str) -> None:
    if name not in _fallback_calls:
        warnings.warn(f"{name} runs in fp32 on the host under hbfp.torch.offload: its matrix products are not "
                      "sent to the device (counted in hbfp.torch.fallbacks())", HbfpFallbackWarning, stacklevel=4)
    _fallback_calls[name] = _fallback_calls.get(name, 0) + 1


def fallbacks() -> dict[str, int]:
    """Calls, per operation, of the operations with products that ran in fp32 on the host under
    ``offload`` since the last ``reset_fallbacks()`` (each warned about once)."""
    return dict(_fallback_calls)


def reset_fallbacks() -> None:
    """Forget the counts of ``fallbacks()``; the next fallback of each operation warns again."""
    _fallback_calls.clear()


@contextlib.contextmanager
def offload(device=None, precision: str = "hbfp8"):
    """Run the matrix products of an unchanged model on ``device`` (default ``emu``) while
    the context is active; the matmul precision is restored on exit, exceptions included."""
    device = device or default_device()
    with matmul_precision(precision), _Offload(device):
        yield device
