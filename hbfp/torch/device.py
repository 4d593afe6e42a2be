"""The device's products from torch: ``a @ b`` and stacks of them on an hbfp device
(``hbfp.host``), of tensors or of their codes, counted in ``report()``.

- ``default_device()``: the in-process ``emu``, opened once, where no device is given.
- ``_device_gemm``, ``_device_bmm``: a product, a stack of products, on a device: on the
  in-process emu with torch's kernels where the tensors are (no NumPy round trip), else
  through the device's driver.
- ``_device_work``: the device's own torch operations, which no route takes again.
- ``_quantized``: an operand's codes as the products read them, made once for all of them.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from . import counts as _report
from .config import _state

__all__ = ["default_device"]

_default = {"device": None}
_default_lock = threading.Lock()


@torch.compiler.disable  # a handle torch.compile need not look into
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


class _device_work:
    """The device's own work: no torch-function handler for its torch operations (``offload``'s
    mode off) and ``on_device`` set, so that neither the functional routes nor the ATen-level
    kernels route the device's own operations (a backward product runs while the context routes
    products). Entered again inside itself, it does nothing (a context class rather than a
    generator: it runs several times per product)."""

    __slots__ = ("outer", "guard")

    def __enter__(self):
        self.outer = getattr(_state, "on_device", False)
        if not self.outer:
            _state.on_device = True
            self.guard = torch._C.DisableTorchFunction()
            self.guard.__enter__()
        return self

    def __exit__(self, *exc):
        if not self.outer:
            try:
                self.guard.__exit__(*exc)
            finally:
                _state.on_device = False
        return False


def _compiled_cpu():
    from hbfp.kernels import compiled_cpu

    return compiled_cpu()


def _shape(x, transposed: bool) -> tuple[int, int]:
    rows, cols = (x[0] if isinstance(x, tuple) else x).shape
    return (cols, rows) if transposed else (rows, cols)


@torch.compiler.disable  # the device's work is a call torch.compile leaves as it is (a graph break)
def _device_gemm(device, a, b, **kw) -> torch.Tensor:
    """``a @ b`` on ``device`` (``Device.gemm``'s keywords): on the in-process emu with torch's
    kernels where the tensors are (no NumPy round trip), else through the device's driver;
    its MACs counted in ``report()`` under the operation being routed."""
    (m, k), (_, n) = _shape(a, kw.get("transpose_a", False)), _shape(b, kw.get("transpose_b", False))
    with _device_work():
        out = _device_gemm_inner(device, a, b, **kw)
    _report.count_device(m * k * n)
    return out


def _square(device) -> bool:
    """Whether the device's tiles are square (a stand-in without an identity: yes)."""
    identity = getattr(device, "identity", None)
    return identity is None or identity.square


def _device_gemm_inner(device, a, b, **kw) -> torch.Tensor:
    if not _square(device):
        # Blocks along K only (MXINT8's 1 x 32): A goes stored M x K, B stored N x K (views).
        if isinstance(a, tuple) or isinstance(b, tuple):
            raise ValueError(f"{device.name}'s tile {device.identity.tile} is not square: stored codes cannot be read")
        a = a.t() if kw.pop("transpose_a", False) else a
        b = b if kw.pop("transpose_b", False) else b.t()
        kw["transpose_b"] = True
    if device.in_process:
        return device.gemm_tensors(a.detach() if isinstance(a, torch.Tensor) else a,
                                   b.detach() if isinstance(b, torch.Tensor) else b, **kw)
    from hbfp.kernels.torch_ops import to_bfp_tensor

    # Tensors go as NumPy arrays, codes (stored weights) as BFPTensors.
    a, b = (to_bfp_tensor(*x, device.format()) if isinstance(x, tuple) else _numpy(x) for x in (a, b))
    return torch.from_numpy(np.ascontiguousarray(device.gemm(a, b, **kw)))


@torch.compiler.disable
def _device_bmm(device, a: torch.Tensor, b: torch.Tensor, rounding: str = "nearest_even", seed=None) -> torch.Tensor:
    """The stack ``a[i] @ b[i]`` on ``device``: at once on the in-process emu
    (``Device.bmm_tensors``, which rounds each stack as one matrix), else product by product
    (rounded otherwise than to nearest: from the same stacked codes, made here)."""
    if isinstance(a, tuple) or isinstance(b, tuple):  # stored codes (a stack's): on an in-process device
        (nb, m, k), n = (a[0] if isinstance(a, tuple) else a).shape, (b[0] if isinstance(b, tuple) else b).shape[2]
        with _device_work():
            out = device.bmm_tensors(a, b, rounding=rounding, seed=seed)
        _report.count_device(nb * m * k * n)
        return out
    nb = a.shape[0]
    if nb == 0:
        return a.new_zeros(0, a.shape[1], b.shape[2])
    if device.in_process:
        with _device_work():
            out = device.bmm_tensors(a.detach(), b.detach(), rounding=rounding, seed=seed)
        _report.count_device(nb * a.shape[1] * a.shape[2] * b.shape[2])
        return out
    if rounding == "nearest_even" or not _square(device):
        kw = {} if rounding == "nearest_even" else {"rounding": rounding, "seed": seed}
        return torch.stack([_device_gemm(device, a[i], b[i], **kw) for i in range(nb)])
    from hbfp.host.device import _seeds, stack_codes

    sa, sb, _ = _seeds(seed, rounding)
    with _device_work():
        ca, ea = stack_codes(a.detach(), device.format(rounding), sa)
        cb, eb = stack_codes(b.detach(), device.format(rounding), sb)
    return torch.stack([_device_gemm(device, (ca[i], ea[i]), (cb[i], eb[i])) for i in range(nb)])


@torch.compiler.disable
def _quantized(device, x: torch.Tensor, rounding: str = "nearest_even", seed: int | None = None):
    """``x`` as the products read it: on the in-process emu its codes and exponents in the
    device's format, quantized once for the forward and both backward products (the same
    codes each product's own quantization gives: a transposed operand reuses its square
    tiles); elsewhere ``x`` itself, which the driver quantizes. Rounded otherwise than to
    nearest (``rounding``, ``seed``), the codes are made here for every device (the driver's
    quantization rounds to nearest), except on a device with blocks along K, whose product
    rounds both operands so (``_product``)."""
    if rounding != "nearest_even" and _square(device):
        from hbfp import kernels

        with _device_work():
            return kernels.quantize(x.detach(), device.format(rounding), seed=seed)  # any strides
    if not device.in_process or not _square(device):
        return x  # quantized by the product itself (blocks along K: in the layout it stores)
    from hbfp import kernels

    fmt = device.format()
    with _device_work():
        x = x.detach()
        if (x.dim() == 2 and not x.is_contiguous() and x.t().is_contiguous() and fmt.tile[0] == fmt.tile[1]
                and fmt.rounding != "stochastic"):
            # A transposed view (a Linear's weight as in x out): square tiles hold the same
            # elements either way and the rounding is elementwise, so the stored matrix's codes
            # and exponents, transposed, are the view's own (no transposed copy to quantize).
            codes, exps = kernels.quantize(x.t(), fmt)
            return codes.t(), exps.t()
        return kernels.quantize(x, fmt)
