"""``HbfpMatmul``'s lean path (``_Lean``): the general path's kernel calls without its layers,
on an in-process device with square tiles (``emu``), for fp32 CPU matrices under a recipe whose
products return fp32 sums. The same bits, seeds and counts as the general path
(tests/test_torch_compile.py compares them); on a training step's small products the general
path's layers cost as much as the kernels.
"""

from __future__ import annotations

import torch

from hbfp.recipes import ProductConfig, Recipe, RecipeInUse

from . import counts as _report
from .device import _device_work, _square


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

    def _quantize(self, lib, x: torch.Tensor, cfg: ProductConfig, in_use: RecipeInUse):
        """``x``'s codes and exponents under ``cfg`` (``_operand``'s)."""
        from hbfp.kernels import default_threads

        seed = in_use.seed(cfg)
        fmt = self.fmt[cfg.rounding]
        transposed = seed is None and not x.is_contiguous() and x.t().is_contiguous()  # a Linear's weight
        if transposed:
            x = x.t()
        (m, n), (th, tw) = x.shape, fmt.tile
        codes = torch.empty((m, n), dtype=torch.int8 if fmt.mantissa_bits <= 8 else torch.int16)
        exps = torch.empty((-(-m // th), -(-n // tw)), dtype=torch.uint8)
        if m and n:
            lib.quantize_tensor(x.detach(), fmt, _key(seed), codes, exps, default_threads())
        else:
            exps.zero_()
        return (codes.t(), exps.t()) if transposed else (codes, exps)

    def _gemm(self, lib, qa, qb, m: int, n: int, k: int, transpose_a: bool = False, transpose_b: bool = False):
        """The product of codes ``qa`` (m x k) and ``qb`` (k x n) (``_device_gemm``'s)."""
        from hbfp.kernels import default_threads

        self.count(m, n, k, transpose_a, transpose_b)
        y = torch.empty((m, n), dtype=torch.float32)
        if m and n:
            fmt = self.fmt["nearest_even"]
            lib.gemm_tensor(qa[0], qa[1], fmt, qb[0], qb[1], fmt, y, default_threads(), self.qmax(), self.qmax())
        return y

    def count(self, m: int, n: int, k: int, transpose_a: bool = False, transpose_b: bool = False) -> None:
        """A product of m x k by k x n counted, as ``_device_gemm`` counts it."""
        _report.count_device(m * n * k)
        if m and n:
            self.device.count_tensors_product(m, n, k, transpose_a, transpose_b)

    def qmax(self) -> int:
        """The largest code magnitude of the device's codes, as ``kernels.gemm`` bounds it."""
        fmt = self.fmt["nearest_even"]
        bits = fmt.mantissa_bits
        return 127 if bits <= 8 else 32767 if bits == 16 else fmt.qmax

    def key(self, cfg: ProductConfig, in_use: RecipeInUse) -> int:
        """The quantizing kernels' key of the next seed of ``in_use``'s stream under ``cfg``
        (``_quantize``'s: 0 where it gives none)."""
        return _key(in_use.seed(cfg))

    def forward(self, lib, a: torch.Tensor, b: torch.Tensor, in_use: RecipeInUse):
        """``a @ b``, the operands' codes and whether ``b`` is a transposed view (what the
        backward products read)."""
        from hbfp.host.device import check_product_size
        from hbfp.host.protocol import code_bytes

        cfg = in_use.recipe.forward
        bits = self.fmt["nearest_even"].mantissa_bits
        check_product_size(a.shape[0], b.shape[1], a.shape[1], code_bytes=code_bytes(bits))
        with _device_work():
            qa, qb = self._quantize(lib, a, cfg, in_use), self._quantize(lib, b, cfg, in_use)
            b_view = not b.is_contiguous() and b.t().is_contiguous()
            return self._gemm(lib, qa, qb, a.shape[0], b.shape[1], a.shape[1]), qa, qb, b_view

    def backward(self, lib, grad: torch.Tensor, qa, qb, b_view: bool, in_use: RecipeInUse, need_a: bool,
                 need_b: bool):
        """``HbfpMatmul._backward``'s products: grad @ b^T, then a^T @ grad (made as
        (grad^T @ a)^T where b is a transposed view: the layout of its matrix), the output
        gradient quantized once per rounding they ask for."""
        (ca, ea), (cb, eb) = qa, qb
        recipe = in_use.recipe
        qg: dict = {}

        def quantized(cfg):
            if cfg.rounding not in qg:
                qg[cfg.rounding] = self._quantize(lib, grad, cfg, in_use)
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


def _key(seed: int | None) -> int:
    """The quantizing kernels' key of a seed (0: none, rounding that draws no bits)."""
    from hbfp.kernels import _seed_key

    return 0 if seed is None else _seed_key(seed)


_FP32_RESULTS: dict = {}


def _fp32_results(recipe: Recipe) -> bool:
    """Whether every product of ``recipe`` returns its fp32 sums."""
    fits = _FP32_RESULTS.get(recipe)
    if fits is None:
        fits = _FP32_RESULTS[recipe] = all(c.out == "fp32" for c in recipe.products.values())
    return fits
