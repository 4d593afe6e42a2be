"""PyTorch integration: matrix products of a training loop in HBFP on an hbfp device.

- ``HbfpMatmul``: ``a @ b`` on the device, forward and both backward products
  (``grad_a = grad @ b^T``, ``grad_b = a^T @ grad``), each bit for bit as
  ``hbfp.golden.gemm.gemm`` on the device's format. With square tiles the backward products
  reuse the forward quantization of ``a`` and ``b`` (a transposed operand reuses its tiles).
- ``HbfpBmm``: a stack of products at once (``Device.bmm_tensors`` on ``emu``).
- ``Linear``, ``Conv1d``, ``Conv2d`` (im2col products) and ``convert(model)``, which swaps them
  into a model in place.
- ``offload(device)``: a context that runs every matrix product of an unchanged model on the
  device, forward and backward: the functions ``_Offload`` routes, and every other product at
  the ATen level (``hbfp.torch.aten``); ``report()`` says what ran where (docs/torch.md).
- ``set_matmul_precision("highest" | "hbfp8" | ...)``, modelled on
  ``torch.set_float32_matmul_precision``: ``offload`` sets its device's format's name
  (``"hbfp8"``, ``"mxint8"``) while it is active and restores the previous value on exit,
  exceptions included.
- Recipes (``Recipe``, ``RECIPES``, ``use_recipe``; ``hbfp.recipes``): per product
  (forward, grad_input, grad_weight) the format, the rounding (stochastic with its seeds) and
  the output format; the default rounds gradients stochastically.
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

from . import counts as _report
from hbfp.recipes import DEFAULT_RECIPE, RECIPES, ProductConfig, Recipe, Rounding, format_name
from hbfp.recipes import resolve as _resolve_recipe
from .counts import HbfpFallbackWarning, OpCount, fallbacks, format_report, report, reset_fallbacks, reset_report

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
    "wide_weight_storage",
    "WideWeightStorage",
    "weight_storage",
]

#: "highest": fp32 products by PyTorch; a format's name in lower case ("hbfp8", "mxint8",
#: "hbfp16"): products on the hbfp device, in that format (``offload`` sets its device's).
PRECISIONS = ("highest", "hbfp8", "hbfp16", "mxint8")

_state = threading.local()
_default = {"device": None}
_default_lock = threading.Lock()


def set_matmul_precision(precision: str) -> None:
    if precision not in PRECISIONS and not precision.startswith("bfp"):
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


class _Product:
    """The device's products as ``hbfp.torch.aten`` calls them: ``product(a, b)`` (2-D) and
    ``product.batched(a, b)`` (stacks), under ``rounding``'s recipe: its forward product's
    configuration outside a backward pass, its ``grad_input`` one inside. An ATen product does
    not say which operand is the gradient: on a device with square tiles, a backward product's
    operand that was a forward operand (the same tensor, not written since: ``operands``) is
    read as the forward products read it, the other (the output gradient) is rounded as the
    backward configuration says; elsewhere both are."""

    def __init__(self, device, rounding: Rounding):
        from .operands import ForwardOperands

        self.device, self.rounding = device, rounding
        self.forward = ForwardOperands() if _square(device) else None
        self.direct = device.in_process

    def _config(self) -> tuple[ProductConfig, bool]:
        recipe = self.rounding.recipe
        forward = torch._C._current_autograd_node() is None
        return (recipe.forward if forward else recipe.grad_input), forward

    def _operand(self, x, cfg: ProductConfig, forward: bool):
        if forward:
            self.rounding.note(x)
        if self.forward is not None and (not forward or cfg.rounding == "nearest_even"):
            hit, codes = self.forward.lookup(x)
            if hit and not forward:
                return x if codes is None else codes
            if hit and codes is not None:  # a forward operand again (an RNN's weight at every time
                return codes               # step): to nearest, its codes are the same; quantized once
        q = _operand(self.device, x, cfg, self.rounding)
        if self.forward is not None and forward:
            self.forward.remember(x, q if isinstance(q, tuple) else None)
        return q

    def __call__(self, a, b):
        cfg, forward = self._config()
        with _device_work():
            qa, qb = self._operand(a, cfg, forward), self._operand(b, cfg, forward)
        return _product(self.device, qa, qb, cfg, self.rounding)

    def _stack(self, x, cfg: ProductConfig, forward: bool, seed: int):
        """A stack's codes (``stack_codes``) on a device with square tiles, through ``forward``."""
        from hbfp.host.device import stack_codes

        if forward:
            self.rounding.note(x)
        if not forward:
            hit, codes = self.forward.lookup(x)
            if hit and codes is not None:
                return codes
        codes = stack_codes(x.detach(), self.device.format(cfg.rounding), seed)
        if forward:
            self.forward.remember(x, codes)
        return codes

    def batched(self, a, b):
        cfg, forward = self._config()
        if forward:
            self.rounding.note(a, b)
        seed = self.rounding.seed(cfg)
        if self.forward is not None and a.shape[0] and a.shape[1] and b.shape[2] and a.shape[2]:
            from hbfp.host.device import _seeds

            sa, sb, _ = _seeds(seed, cfg.rounding)
            with _device_work():
                qa, qb = self._stack(a, cfg, forward, sa), self._stack(b, cfg, forward, sb)
            if self.direct:
                return _out(_device_bmm(self.device, qa, qb), cfg)
            # through the driver, matrix by matrix: the same codes (a forward operand's, read
            # again by a backward product, as the forward read it)
            return _out(torch.stack([_device_gemm(self.device, (qa[0][i], qa[1][i]), (qb[0][i], qb[1][i]))
                                     for i in range(a.shape[0])]), cfg)
        return _out(_device_bmm(self.device, a, b, cfg.rounding, seed), cfg)

    def close(self) -> None:
        if self.forward is not None:
            self.forward.clear()


class HbfpBmm(torch.autograd.Function):
    """The stack ``a[i] @ b[i]`` (B x M x K, B x K x N) on ``device``, forward and both backward
    stacks of products, each product as ``HbfpMatmul``'s."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, device):
        ctx.device = device
        ctx.op = _report.current()
        ctx.save_for_backward(a, b)
        current_rounding().note(a, b)
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


@dataclass(frozen=True)
class _StoredOperand:
    """The right operand of a product as the device reads it from wide storage: ``codes``
    (``(codes, exponents)`` tensors in the device's format, requantized from HBFP16) of the
    stored matrix, which is ``b`` itself or, with ``transposed``, ``b``'s transpose (a Linear's
    weight is stored out x in and used as in x out)."""

    codes: object
    transposed: bool


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


def current_rounding() -> Rounding:
    """The recipe in use on this thread (``offload``, ``use_recipe``; else the default's
    stream of seeds)."""
    r = getattr(_state, "rounding", None)
    return r if r is not None else _DEFAULT_ROUNDING


def current_recipe() -> Recipe:
    return current_rounding().recipe


_DEFAULT_ROUNDING = Rounding(_resolve_recipe(None))


@contextlib.contextmanager
def _rounding_scope(rounding: Rounding | None):
    """``rounding`` in use in the body (None: unchanged)."""
    if rounding is None:
        yield
        return
    previous = getattr(_state, "rounding", None)
    _state.rounding = rounding
    try:
        yield
    finally:
        _state.rounding = previous


@contextlib.contextmanager
def use_recipe(recipe=None, seed: int | None = None):
    """Products issued in the body follow ``recipe`` (a name of ``RECIPES`` or a ``Recipe``;
    ``seed`` replaces its seed), with a fresh stream of seeds; restored on exit."""
    r = _resolve_recipe(recipe)
    with _rounding_scope(Rounding(r if seed is None else r.with_seed(seed))):
        yield current_recipe()


def _operand(device, x, cfg: ProductConfig, rounding: Rounding):
    return _quantized(device, x, cfg.rounding, rounding.seed(cfg) if _square(device) else None)


def _product(device, a, b, cfg: ProductConfig, rounding: Rounding, **kw) -> torch.Tensor:
    """``_device_gemm`` under ``cfg``: a device with blocks along K rounds both operands as
    ``cfg`` says (its operands go as values); the result in ``cfg.out``."""
    if not _square(device) and cfg.rounding != "nearest_even":
        kw.update(rounding=cfg.rounding, seed=rounding.seed(cfg))
    return _out(_device_gemm(device, a, b, **kw), cfg)


def _out(y: torch.Tensor, cfg: ProductConfig) -> torch.Tensor:
    if cfg.out == "bf16":  # the device's bf16 output: the fp32 sums rounded to nearest even
        from hbfp.kernels import torch_ops

        with _device_work():
            y = torch_ops.epilogue(y, None, "bf16").to(torch.float32)
    return y


class _Lean:
    """``HbfpMatmul``'s products where nothing asks for more than the kernels: on an in-process
    device with square tiles (emu), fp32 CPU operands, every product's result fp32 (``fits``),
    with the registry's compiled kernels (``kernels.compiled_cpu``). The registry's calls the
    general path makes there (``_quantized``, ``Device.gemm_tensors``), in its order with its
    seeds, so its bits: each operand quantized once (a transposed view by its matrix), then each
    product of their codes, counted as ``gemm_tensors`` counts it; by the kernels' lean entries,
    without the general path's layers of checks and dispatch, which cost as much as the kernels
    on a training step's small products. One per device (``of``; None: not such a device)."""

    __slots__ = ("device", "fmt", "__weakref__")
    _by_device = None  # device -> _Lean or None (weak keys)

    @classmethod
    def of(cls, device) -> "_Lean | None":
        if cls._by_device is None:
            import weakref

            cls._by_device = weakref.WeakKeyDictionary()
        try:
            lean = cls._by_device.get(device, False)
        except TypeError:  # a device that cannot be a weak key
            return None
        if lean is False:
            square = device.in_process and _square(device)
            lean = cls._by_device[device] = cls(device) if square else None
        return lean

    def __init__(self, device):
        self.device = device
        self.fmt = {r: device.format(r) for r in ("nearest_even", "toward_zero", "stochastic")}

    @staticmethod
    def fits(a: torch.Tensor, b: torch.Tensor, recipe: Recipe) -> bool:
        return (a.dtype == torch.float32 and b.dtype == torch.float32 and a.dim() == 2 and b.dim() == 2
                and a.device.type == "cpu" and b.device.type == "cpu" and _fp32_results(recipe))

    def _quantize(self, lib, x: torch.Tensor, cfg: ProductConfig, rounding: Rounding):
        """``x``'s codes and exponents under ``cfg`` (``_operand``'s)."""
        from hbfp.kernels import _seed_key, default_threads

        seed = rounding.seed(cfg)
        fmt = self.fmt[cfg.rounding]
        transposed = seed is None and not x.is_contiguous() and x.t().is_contiguous()  # a Linear's weight
        if transposed:
            x = x.t()
        (m, n), (th, tw) = x.shape, fmt.tile
        codes = torch.empty((m, n), dtype=torch.int8 if fmt.mantissa_bits <= 8 else torch.int16)
        exps = torch.empty((-(-m // th), -(-n // tw)), dtype=torch.uint8)
        if m and n:
            lib.quantize_tensor(x.detach(), fmt, 0 if seed is None else _seed_key(seed), codes, exps,
                                default_threads())
        else:
            exps.zero_()
        return (codes.t(), exps.t()) if transposed else (codes, exps)

    def _gemm(self, lib, qa, qb, m: int, n: int, k: int, transpose_a: bool = False, transpose_b: bool = False):
        """The product of codes ``qa`` (m x k) and ``qb`` (k x n) (``_device_gemm``'s)."""
        from hbfp.kernels import default_threads

        _report.count_device(m * n * k)
        y = torch.empty((m, n), dtype=torch.float32)
        if m and n:
            self.device.count_tensors_product(m, n, k, transpose_a, transpose_b)
            fmt = self.fmt["nearest_even"]
            bits = fmt.mantissa_bits  # the largest code magnitude, as kernels.gemm bounds it
            qmax = 127 if bits <= 8 else 32767 if bits == 16 else fmt.qmax
            lib.gemm_tensor(qa[0], qa[1], fmt, qb[0], qb[1], fmt, y, default_threads(), qmax, qmax)
        return y

    def forward(self, lib, a: torch.Tensor, b: torch.Tensor, rounding: Rounding):
        """``a @ b``, the operands' codes and whether ``b`` is a transposed view (what the
        backward products read)."""
        from hbfp.host.device import check_product_size

        cfg = rounding.recipe.forward
        code_bytes = 1 if self.fmt["nearest_even"].mantissa_bits <= 8 else 2
        check_product_size(a.shape[0], b.shape[1], a.shape[1], code_bytes=code_bytes)
        with _device_work():
            qa, qb = self._quantize(lib, a, cfg, rounding), self._quantize(lib, b, cfg, rounding)
            b_view = not b.is_contiguous() and b.t().is_contiguous()
            return self._gemm(lib, qa, qb, a.shape[0], b.shape[1], a.shape[1]), qa, qb, b_view

    def backward(self, lib, grad: torch.Tensor, qa, qb, b_view: bool, rounding: Rounding, need_a: bool,
                 need_b: bool):
        """``HbfpMatmul._backward``'s products: grad @ b^T, then a^T @ grad (made as
        (grad^T @ a)^T where b is a transposed view: the layout of its matrix), the output
        gradient quantized once per rounding they ask for."""
        (ca, ea), (cb, eb) = qa, qb
        recipe = rounding.recipe
        qg: dict = {}

        def quantized(cfg):
            if cfg.rounding not in qg:
                qg[cfg.rounding] = self._quantize(lib, grad, cfg, rounding)
            return qg[cfg.rounding]

        grad_a = grad_b = None
        with _device_work():
            (m, n), k = grad.shape, ca.shape[1]
            if need_a:
                grad_a = self._gemm(lib, quantized(recipe.grad_input), (cb.t(), eb.t()), m, k, n, transpose_b=True)
            if need_b:
                cg, eg = quantized(recipe.grad_weight)
                if b_view:
                    grad_b = self._gemm(lib, (cg.t(), eg.t()), (ca, ea), n, k, m, transpose_a=True).t()
                else:
                    grad_b = self._gemm(lib, (ca.t(), ea.t()), (cg, eg), k, n, m, transpose_a=True)
        return grad_a, grad_b


_FP32_RESULTS: dict = {}


def _fp32_results(recipe: Recipe) -> bool:
    """Whether every product of ``recipe`` returns its fp32 sums."""
    fits = _FP32_RESULTS.get(recipe)
    if fits is None:
        fits = _FP32_RESULTS[recipe] = all(c.out == "fp32" for c in recipe.products.values())
    return fits


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
                rounding: Rounding | None = None, patches=None, grad_a_t: bool = False, out_t: bool = False):
        rounding = rounding or current_rounding()
        rounding.note(a, b)
        cfg = rounding.recipe.forward
        ctx.device, ctx.stored, ctx.rounding = device, stored, rounding
        ctx.op = _report.current()
        ctx.lean = None
        if stored is None and patches is None and not (grad_a_t or out_t) and _Lean.fits(a, b, rounding.recipe):
            lean, lib = _Lean.of(device), _compiled_cpu()
            if lean is not None and lib is not None:  # the general path's codes, made leaner
                ctx.lean, ctx.transposed, ctx.a_t = lean, False, False
                y, ctx.qa, ctx.qb, ctx.b_view = lean.forward(lib, a, b, rounding)
                return y
        ctx.qa = patches.codes(device, cfg, rounding) if patches is not None else _operand(device, a, cfg, rounding)
        ctx.qb = stored.codes if stored is not None else _operand(device, b, cfg, rounding)
        ctx.transposed = stored is not None and stored.transposed
        # b a transposed view of a matrix (a Linear's weight as in x out): its gradient is made
        # in the matrix's layout, so that autograd hands it to the weight without a copy
        ctx.b_view = ctx.transposed or (b.dim() == 2 and not b.is_contiguous() and b.t().is_contiguous())
        # grad_a_t: a's gradient made transposed (a patch matrix's: col2im reads runs of it there)
        ctx.a_t = grad_a_t
        if out_t:  # (b^T @ a^T)^T: the same sums, the same bits, a transposed view
            return _product(device, ctx.qb, ctx.qa, cfg, rounding, transpose_a=not ctx.transposed,
                            transpose_b=True).t()
        return _product(device, ctx.qa, ctx.qb, cfg, rounding, transpose_b=ctx.transposed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with _report.routing(ctx.op or "matmul"):
            return HbfpMatmul._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad: torch.Tensor):
        lib = _compiled_cpu() if ctx.lean is not None else None
        if lib is not None and grad.dtype == torch.float32 and grad.device.type == "cpu":
            grad_a, grad_b = ctx.lean.backward(lib, grad, ctx.qa, ctx.qb, ctx.b_view, ctx.rounding,
                                               *ctx.needs_input_grad[:2])
            return grad_a, grad_b, None, None, None, None, None, None
        grad_a = grad_b = None
        dev, rounding = ctx.device, ctx.rounding
        gi, gw = rounding.recipe.grad_input, rounding.recipe.grad_weight
        qg = {}  # the output gradient quantized once per rounding the products ask for

        def quantized(cfg):
            if cfg.rounding not in qg:
                qg[cfg.rounding] = _operand(dev, grad, cfg, rounding)
            return qg[cfg.rounding]

        if ctx.needs_input_grad[0]:  # grad @ b^T (b stored as in the forward product)
            if ctx.a_t:  # (b @ grad^T)^T: the same sums, the same bits, a transposed view
                grad_a = _product(dev, ctx.qb, quantized(gi), gi, rounding, transpose_a=ctx.transposed,
                                  transpose_b=True).t()
            else:
                grad_a = _product(dev, quantized(gi), ctx.qb, gi, rounding, transpose_b=not ctx.transposed)
        if ctx.needs_input_grad[1]:  # a^T @ grad, or (grad^T @ a)^T: the same sums, the same bits
            if ctx.b_view:
                grad_b = _product(dev, quantized(gw), ctx.qa, gw, rounding, transpose_a=True).t()
            else:
                grad_b = _product(dev, ctx.qa, quantized(gw), gw, rounding, transpose_a=True)
        return grad_a, grad_b, None, None, None, None, None, None


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


# ---- wide weight storage ----------------------------------------------------------------

_STORAGE_ATTR = "_hbfp_storage"  # set on a weight Parameter: its storage Format (HBFP16)


def weight_storage(weight: torch.Tensor):
    """The BFP format ``weight`` is stored in (``wide_weight_storage``), or None (fp32)."""
    return getattr(weight, _STORAGE_ATTR, None)


def _matrix(weight: torch.Tensor) -> torch.Tensor:
    """A layer's weight as the matrix its product uses: out x (in * kernel)."""
    return weight.reshape(weight.shape[0], -1)


def _stored_operand(weight: torch.Tensor, device, matrix: torch.Tensor | None = None,
                    storage=None) -> _StoredOperand | None:
    """The codes the device reads of a wide-stored weight (None if stored as fp32): of its
    matrix, or of ``matrix`` (a group's rows of it); ``storage``: its format, where not the
    weight's own (a compiled graph's tensors carry no attribute: ``hbfp.torch.compiled``)."""
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
    return _StoredOperand(kernels.requantize(*wide, storage, fmt), transposed=True)


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


class _OnDevice:
    """What the HBFP layers add to torch's: ``device_handle`` (None: ``default_device()``),
    ``rounding`` (the recipe of ``convert``; None: the recipe in use where the layer runs) and
    a ``forward`` that torch.compile runs as it is and compiles around; ``_product(x, device)``
    is the layer's own computation."""

    def __init__(self, *args, device_handle=None, rounding: Rounding | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.device_handle = device_handle
        self.rounding = rounding

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _rounding_scope(self.rounding):
            return self._product(x, self.device_handle or default_device())


class Linear(_OnDevice, torch.nn.Linear):
    """``torch.nn.Linear`` whose product runs in HBFP on ``device`` (default: ``emu``)."""

    def _product(self, x, device):
        return _linear(x, self.weight, self.bias, device)


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
    def codes(self, device, cfg: ProductConfig, rounding: Rounding):
        from hbfp import kernels

        seed = rounding.seed(cfg)  # as _operand draws it: one a quantization
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


def _converted(layer: torch.nn.Module, device, rounding: Rounding | None = None) -> torch.nn.Module | None:
    """The HBFP version of a torch ``Linear``, ``Conv1d`` or ``Conv2d`` (the same parameter
    tensors), else None."""
    if isinstance(layer, torch.nn.Linear) and not isinstance(layer, Linear):
        new = Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device_handle=device,
                     rounding=rounding)
    elif isinstance(layer, (torch.nn.Conv1d, torch.nn.Conv2d)) and not isinstance(layer, (Conv1d, Conv2d)):
        cls = Conv2d if isinstance(layer, torch.nn.Conv2d) else Conv1d
        new = cls(layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride,
                  padding=layer.padding, dilation=layer.dilation, groups=layer.groups,
                  bias=layer.bias is not None, padding_mode=layer.padding_mode, device_handle=device, rounding=rounding)
    else:
        return None
    new.weight = layer.weight
    if layer.bias is not None:
        new.bias = layer.bias
    new.train(layer.training)
    return new


def convert(model: torch.nn.Module, device=None, recipe=None) -> torch.nn.Module:
    """Swap every ``nn.Linear``, ``nn.Conv1d`` and ``nn.Conv2d`` of ``model`` for the HBFP versions, in place,
    keeping their parameters (the same tensors); returns the model. A bare layer comes back as
    its HBFP version (use the returned module). ``recipe`` (a name of ``RECIPES`` or a
    ``Recipe``): the products' configuration, with one stream of seeds for the model; None:
    the recipe in use where the layers run (``offload``, ``use_recipe``, else the default)."""
    rounding = None
    if recipe is not None:
        rounding = Rounding(_resolve_recipe(recipe))
        if device is not None:
            rounding.recipe.check(device)
    bare = _converted(model, device, rounding)
    if bare is not None:
        return bare
    left: set[str] = set()
    _convert(model, device, rounding, left)
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


def _convert(model, device, rounding, left: set) -> None:
    for name, child in list(model.named_children()):
        if isinstance(child, _UNCONVERTED):
            left.add(type(child).__name__)
            continue
        new = _converted(child, device, rounding)
        if new is None:
            _convert(child, device, rounding, left)
        else:
            setattr(model, name, new)


def _routing_active() -> bool:
    return get_matmul_precision() != "highest" and not getattr(_state, "on_device", False)


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


class _Offload(TorchFunctionMode):
    """Routes the matrix products of torch's functional API to the device: linear layers with
    their wide storage, the convolutions (conv1d and conv2d by im2col products with their
    compiled patches; 3-d and transposed ones by ``aten.Convolution``, their products the
    ATen-level ``product``'s), bilinear."""

    def __init__(self, device, product=None):
        super().__init__()
        self.device = device
        self.product = product

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if type(func) is torch._ops.OpOverload:  # an operator itself (a compiled graph calls them): no route
            return func(*args, **kwargs)
        if torch.compiler.is_compiling():  # Dynamo traces: the products as operators of the graph
            from .compiled import route as compiled_route

            return compiled_route(self, func, args, kwargs)
        route = _ROUTES.get(func) if _routing_active() else None
        if route is not None:
            out = route(self, *args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


def _counted(name: str, fn, autocast: bool = True, mode: bool = False):
    """``fn`` routed as ``name``: counted, and under ``torch.autocast`` with its operands cast
    as autocast casts them for this operation (``autocast``: whether it is on autocast's
    lower-precision list). ``fn`` takes the device first, or with ``mode`` the routing mode."""
    def routed(offload, *args, **kwargs):
        device = offload if mode else offload.device
        if not _applies(args, kwargs):
            return NotImplemented
        _report.count_call(name)
        if autocast and torch.is_autocast_enabled("cpu"):
            # as autocast runs a product: fp32 operands in its dtype, the result in it
            dtype = torch.get_autocast_dtype("cpu")
            cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t  # noqa: E731
            args, kwargs = [cast(t) for t in args], {k: cast(v) for k, v in kwargs.items()}
        with _report.routing(name), torch.autocast("cpu", enabled=False):
            return fn(device, *args, **kwargs)
    routed.name, routed.autocast = name, autocast  # what hbfp.torch.compiled emits for it
    return routed


def _applies(args, kwargs) -> bool:
    """Floating CPU operands and no ``out=``: else torch's (and the ATen mode's) own."""
    tensors = [t for t in args[:3] if isinstance(t, torch.Tensor)]
    return "out" not in kwargs and all(t.dim() >= 1 and t.is_floating_point() and t.device.type == "cpu"
                                       for t in tensors)


def _route_linear(device, x, weight, bias=None):
    return _linear(x, weight, bias, device)


def _route_matmul(device, a, b):
    return matmul(a, b, device)


def _route_conv(fn):
    names = ("bias", "stride", "padding", "dilation", "groups")

    def route(device, x, weight, *args, **kwargs):
        extra = dict(zip(names, args))
        extra.update({k: v for k, v in kwargs.items() if k in names})
        return fn(x, weight, device=device, **extra)
    return route


def _route_scaled(device, inp, a, b, *, beta=1, alpha=1):
    return beta * inp + alpha * matmul(a, b, device)


def _route_bilinear(device, x1, x2, weight, bias=None):
    return bilinear(x1, x2, weight, bias, device)


def _tuple(v, nd: int) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * nd


def _route_conv_nd(nd: int, transposed: bool):
    """A route of ``F.conv3d`` or ``F.conv_transposeNd`` (their arguments as torch takes them)
    to ``aten.Convolution``: padding strings and numbers as torch reads them."""
    names = (("bias", "stride", "padding", "output_padding", "groups", "dilation") if transposed
             else ("bias", "stride", "padding", "dilation", "groups"))

    def route(mode, x, weight, *args, **kwargs):
        from .aten import Convolution

        if mode.product is None or not isinstance(x, torch.Tensor) or x.dim() not in (nd + 1, nd + 2):
            return NotImplemented
        kw = dict(zip(names, args))
        kw.update({k: v for k, v in kwargs.items() if k in names})
        unbatched = x.dim() == nd + 1
        if unbatched:
            x = x[None]
        stride, dilation = _tuple(kw.get("stride", 1), nd), _tuple(kw.get("dilation", 1), nd)
        padding = kw.get("padding", 0)
        if isinstance(padding, str):
            if padding not in ("same", "valid") or transposed:
                return NotImplemented
            if padding == "same":
                amounts = _same_padding(tuple(weight.shape[2:]), dilation)
                if any(amounts):
                    x = F.pad(x, amounts)
            padding = 0
        y = Convolution.apply(x, weight, kw.get("bias"), mode.product, list(stride), list(_tuple(padding, nd)),
                              list(dilation), transposed, list(_tuple(kw.get("output_padding", 0), nd)),
                              int(kw.get("groups", 1)))
        return y[0] if unbatched else y
    return route


_ROUTES = {}
for _name, _fn, _funcs in (
    ("linear", _route_linear, (F.linear,)),
    ("matmul", _route_matmul, (torch.mm, torch.Tensor.mm, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
                               torch.bmm, torch.Tensor.bmm, torch.mv, torch.Tensor.mv, torch.dot, torch.Tensor.dot)),
    ("conv2d", _route_conv(conv2d), (F.conv2d, torch.conv2d)),
    ("conv1d", _route_conv(conv1d), (F.conv1d, torch.conv1d)),
    ("addmm", _route_scaled, (torch.addmm, torch.Tensor.addmm, torch.addmv, torch.Tensor.addmv, torch.baddbmm,
                              torch.Tensor.baddbmm)),
    ("bilinear", _route_bilinear, (F.bilinear,)),
):
    for _f in _funcs:
        _ROUTES[_f] = _counted(_name, _fn, autocast=_name != "bilinear")  # autocast runs bilinear in fp32
for _name, _nd, _transposed, _funcs in (
    ("conv3d", 3, False, (F.conv3d, torch.conv3d)),
    ("conv_transpose1d", 1, True, (F.conv_transpose1d, torch.conv_transpose1d)),
    ("conv_transpose2d", 2, True, (F.conv_transpose2d, torch.conv_transpose2d)),
    ("conv_transpose3d", 3, True, (F.conv_transpose3d, torch.conv_transpose3d)),
):
    for _f in _funcs:
        _ROUTES[_f] = _counted(_name, _route_conv_nd(_nd, _transposed), mode=True)


def _route_lstm():
    """``torch.lstm`` (nn.LSTM's call) by ``hbfp.torch.rnn`` where it applies, else ATen's LSTM
    (its products routed at the ATen level). Eager only: a compiled graph keeps torch.lstm."""
    from . import rnn

    counted = _counted("lstm", rnn.layers, autocast=False)

    def route(offload, *args, **kwargs):
        return counted(offload, *args, **kwargs) if rnn.applies(args, kwargs) else NotImplemented
    route.name, route.autocast, route.compiled = "lstm", False, False
    return route


_ROUTES[torch.lstm] = _route_lstm()


@contextlib.contextmanager
def offload(device=None, precision: str | None = None, recipe=None, seed: int | None = None):
    """Run the matrix products of an unchanged model on ``device`` while the context is
    active, forward and backward: the functions ``_Offload`` routes, and every other product at
    the ATen level (``hbfp.torch.aten``: attention, RNNs, einsum, tensordot, 3-d and transposed
    convolutions, ...). ``report()`` says what ran where. ``recipe`` (a name of ``RECIPES`` or a
    ``Recipe``; None: the recipe in use, ``use_recipe``'s, else "default": the device's format,
    gradients rounded stochastically) configures each product. Its stochastic roundings' seeds
    continue where the model's last context left them (``Rounding.continuing``: a context per
    step draws new seeds each step; a copy of the model starts as the model did), unless
    ``seed`` is given: then a fresh stream from that seed. Without a ``device``, an ``emu`` of
    the recipe's format (default ``emu``). ``precision``: the matmul precision while active (default: the device's format's
    name, e.g. "hbfp8"). The precision, the recipe and the backend flags are restored on exit,
    exceptions included."""
    from .aten import AtenOffload, backend_flags

    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"offload's seed must be an integer >= 0, got {seed!r}")
    r = _resolve_recipe(recipe) if recipe is not None else current_recipe()
    if device is None:
        formats = r.formats()
        if len(formats) > 1:
            raise ValueError(f"recipe {r.name!r} names several formats ({', '.join(sorted(formats))}): "
                             "give offload a device")
        from hbfp import host

        device = host.open(f"emu:format={formats.pop()}") if formats else default_device()
    r.check(device)
    precision = precision or format_name(device.format()).lower().replace(" ", "")
    from .compiled import compiling  # torch.compile'd code: its products as hbfp operators

    rounding = Rounding(r, continuing=True) if seed is None else Rounding(r.with_seed(seed))
    with matmul_precision(precision), _rounding_scope(rounding), backend_flags(), compiling():
        product = _Product(device, rounding)
        try:
            with AtenOffload(product, _routing_active), _Offload(device, product):
                yield device
        finally:
            product.close()
            rounding.finish()
