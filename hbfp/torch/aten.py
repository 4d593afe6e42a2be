"""``offload``'s interception at the ATen level: the matrix products that reach the
dispatcher below autograd (inside ``nn.MultiheadAttention``, ``F.scaled_dot_product_attention``,
RNNs, ``einsum``, ``tensordot``, and every backward product of them and of everything else) run
on the device.

While any ``offload`` context is active, ``AtenOffload`` replaces the CPU kernels of the product
operators (``torch.library``, process-wide): autograd records torch's own derivative formulas
above them, so the backward products arrive as ATen products too and run on the device as well.
Only the product operators pass through Python; every other operator keeps its compiled kernel
(a Python dispatch mode would run Python for each of them: 27 us an operator, more than the
whole cell of an LSTM time step). On a thread where no context routes products (or inside the
device's own work), the replaced kernel computes as torch does, through the operator's ``out=``
form, which keeps torch's own kernel. While a context is active, ``offload`` also turns off
oneDNN (so ``nn.LSTM`` runs its cells as ``addmm``/``mm`` rather than one fused
``mkldnn_rnn_layer``) and selects the math attention (``bmm``, softmax on the host), both
process-wide and restored on exit.

Routed: ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``addbmm`` (one product with the batches along
K), ``mv``, ``addmv``, ``dot``, ``vdot``. Convolutions of every kind are routed where torch's
functional API is called (``F.conv1d`` .. ``F.conv_transpose3d``: ``hbfp.torch.routes``, with
``hbfp.torch.convolution``). Products of non-floating operands run on the host, warned about
once and counted (``hbfp.torch.report()``). Floating inputs of other dtypes (bf16, fp16) go to
the device as fp32 (exactly) and the fp32 result is rounded to their dtype (to nearest even, as
a bf16 output of the device is).

The device's products are ``_Product``'s (``offload`` makes one per context): under the recipe
in use, with the forward operands remembered for the backward products (``hbfp.torch.operands``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings

import torch

from hbfp.recipes import ProductConfig, RecipeInUse

from . import counts
from .autograd import _operand, _out, _product
from .device import _device_bmm, _device_gemm, _device_work, _square

__all__ = ["AtenOffload", "backend_flags", "ROUTED"]

aten = torch.ops.aten


# ---- the interception -----------------------------------------------------------------------

def _macs_mm(a, b):
    return a.shape[0] * a.shape[1] * b.shape[-1]


def _typed(fn):
    """Operands of any floating dtype go as fp32; the result comes back in the operands' dtype."""
    def wrapped(product, *args, **kwargs):
        dtypes = {t.dtype for t in args if isinstance(t, torch.Tensor) and t.is_floating_point()}
        dtype = torch.promote_types(*dtypes) if len(dtypes) > 1 else (dtypes.pop() if dtypes else torch.float32)
        args = [t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in args]
        out = fn(product, *args, **kwargs)
        cast = (lambda t: t.to(dtype) if isinstance(t, torch.Tensor) else t)
        return tuple(cast(t) for t in out) if isinstance(out, tuple) else cast(out)
    return wrapped


def _scaled(beta, c, alpha, p):
    """beta * c + alpha * p as torch's addmm defines it (beta == 0: c ignored, NaNs included)."""
    if alpha != 1:
        p = alpha * p
    if beta == 0:
        return p
    return (c if beta == 1 else beta * c) + p


def _mm(product, a, b):
    return product(a, b)


def _addmm(product, c, a, b, *, beta=1, alpha=1):
    return _scaled(beta, c, alpha, product(a, b))


def _bmm(product, a, b):
    if a.shape[0] == 0:
        return a.new_zeros(0, a.shape[1], b.shape[2])
    if hasattr(product, "batched"):
        return product.batched(a, b)
    return torch.stack([product(a[i], b[i]) for i in range(a.shape[0])])


def _baddbmm(product, c, a, b, *, beta=1, alpha=1):
    return _scaled(beta, c, alpha, _bmm(product, a, b))


def _addbmm(product, c, a, b, *, beta=1, alpha=1):
    # sum_i a_i @ b_i: one product with the batches side by side along K
    bat, m, k = a.shape
    if bat == 0:
        return _scaled(beta, c, alpha, a.new_zeros(m, b.shape[2]))
    return _scaled(beta, c, alpha, product(a.permute(1, 0, 2).reshape(m, bat * k), b.reshape(bat * k, -1)))


def _mv(product, a, v):
    return product(a, v[:, None])[:, 0]


def _addmv(product, c, a, v, *, beta=1, alpha=1):
    return _scaled(beta, c, alpha, _mv(product, a, v))


def _dot(product, a, b):
    return product(a[None, :], b[:, None])[0, 0]


def _own_dot(a, b):
    """torch's own dot product of two vectors, as a 1 x 1 ``mm.out`` (whose CPU kernel, unlike
    ``dot.out``'s, does not call the routed operator again)."""
    if a.dim() != 1 or b.dim() != 1 or a.shape != b.shape:
        raise RuntimeError(f"dot: 1D tensors of the same size expected, got {tuple(a.shape)} and {tuple(b.shape)}")
    return aten.mm.out(a.resolve_conj()[None, :], b.resolve_conj()[:, None], out=a.new_empty((1, 1)))[0, 0]


def _out_mm(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


def _out_bmm(a, b):
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))


#: Per routed operator: its name, the device's computation (``handler(product, *args)``), the
#: MACs of its products, and torch's own computation (its ``out=`` form) for the threads and
#: the work that are not routed.
_OPS = {
    "mm": (_mm, lambda a, b: _macs_mm(a, b), lambda a, b: aten.mm.out(a, b, out=_out_mm(a, b))),
    "addmm": (_addmm, lambda c, a, b, **k: _macs_mm(a, b),
              lambda c, a, b, **k: aten.addmm.out(c, a, b, **k, out=_out_mm(a, b))),
    "bmm": (_bmm, lambda a, b: a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2],
            lambda a, b: aten.bmm.out(a, b, out=_out_bmm(a, b))),
    "baddbmm": (_baddbmm, lambda c, a, b, **k: a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2],
                lambda c, a, b, **k: aten.baddbmm.out(c, a, b, **k, out=_out_bmm(a, b))),
    "addbmm": (_addbmm, lambda c, a, b, **k: a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2],
               lambda c, a, b, **k: aten.addbmm.out(c, a, b, **k, out=a.new_empty((a.shape[1], b.shape[2])))),
    "mv": (_mv, lambda a, v: a.numel(), lambda a, v: aten.mv.out(a, v, out=a.new_empty((a.shape[0],)))),
    "addmv": (_addmv, lambda c, a, v, **k: a.numel(),
              lambda c, a, v, **k: aten.addmv.out(c, a, v, **k, out=a.new_empty((a.shape[0],)))),
    # (dot.out's CPU kernel calls dot itself, which is routed here: torch's own as a 1 x 1 mm.out)
    "dot": (_dot, lambda a, b: a.numel(), lambda a, b: _own_dot(a, b)),
    "vdot": (_dot, lambda a, b: a.numel(), lambda a, b: _own_dot(a.conj() if a.is_complex() else a, b)),
}
#: The operators whose CPU kernels ``AtenOffload`` replaces.
ROUTED = tuple(f"aten.{name}" for name in _OPS)

_local = threading.local()  # the routes of this thread: a stack of (product, active)
_registration_lock = threading.Lock()
_registration = {"library": None, "users": 0}


def _kernel(name: str):
    handler, macs, own = _OPS[name]
    handler = _typed(handler)
    label = f"aten.{name}"

    def kernel(*args, **kwargs):
        routes = getattr(_local, "routes", None)
        route = routes[-1] if routes else None
        if route is None or not route[1]():
            return own(*args, **kwargs)  # a thread that routes nothing, or the device's own work
        tensors = [t for t in args[:3] if isinstance(t, torch.Tensor)]
        if all(t.is_floating_point() for t in tensors):
            if counts.current() is None:  # else a product of an operation already counted
                counts.count_call(label)
            with counts.routing(label):
                return handler(route[0], *args, **kwargs)
        counts.count_host(label, macs(*args, **kwargs), "its operands are not floating point tensors")
        return own(*args, **kwargs)

    kernel.__name__ = f"hbfp_{name}"
    return kernel


def _register() -> None:
    with _registration_lock:
        if _registration["users"] == 0:
            lib = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():  # torch says, once, that the kernels are overridden
                warnings.simplefilter("ignore")
                for name in _OPS:
                    lib.impl(name, _kernel(name), "CPU")
            _registration["library"] = lib
        _registration["users"] += 1


def _unregister() -> None:
    with _registration_lock:
        _registration["users"] -= 1
        if _registration["users"] == 0:
            _registration["library"]._destroy()  # torch's own CPU kernels again
            _registration["library"] = None


class AtenOffload:
    """While active on this thread, runs the ATen matrix products (module docstring) on
    ``product``'s device: ``product(a, b)`` computes a 2-D fp32 product there,
    ``product.batched(a, b)`` (where it has one) a stack of them; ``active()`` says whether to
    route now (the precision, not inside the device's own work)."""

    def __init__(self, product, active):
        self.product = product
        self.active = active

    def __enter__(self):
        _register()
        routes = getattr(_local, "routes", None)
        if routes is None:
            routes = _local.routes = []
        routes.append((self.product, self.active))
        return self

    def __exit__(self, *exc):
        try:
            _local.routes.pop()
        finally:
            _unregister()
        return False


# ---- the device's products -------------------------------------------------------------------

class _Product:
    """The device's products as the ATen-level kernels call them: ``product(a, b)`` (2-D) and
    ``product.batched(a, b)`` (stacks), under the recipe in use (``in_use``): its forward product's
    configuration outside a backward pass, its ``grad_input`` one inside. An ATen product does
    not say which operand is the gradient: on a device with square tiles, a backward product's
    operand that was a forward operand (the same tensor, not written since: ``operands``) is
    read as the forward products read it, the other (the output gradient) is rounded as the
    backward configuration says; elsewhere both are."""

    def __init__(self, device, in_use: RecipeInUse):
        from .operands import ForwardOperands

        self.device, self.in_use = device, in_use
        self.forward = ForwardOperands() if _square(device) else None
        self.direct = device.in_process

    def _config(self) -> tuple[ProductConfig, bool]:
        recipe = self.in_use.recipe
        forward = torch._C._current_autograd_node() is None
        return (recipe.forward if forward else recipe.grad_input), forward

    def _operand(self, x, cfg: ProductConfig, forward: bool):
        if forward:
            self.in_use.note(x)
        if self.forward is not None and (not forward or cfg.rounding == "nearest_even"):
            hit, codes = self.forward.lookup(x)
            if hit and not forward:
                return x if codes is None else codes
            if hit and codes is not None:  # a forward operand again (an RNN's weight at every time
                return codes               # step): to nearest, its codes are the same; quantized once
        q = _operand(self.device, x, cfg, self.in_use)
        if self.forward is not None and forward:
            self.forward.remember(x, q if isinstance(q, tuple) else None)
        return q

    def __call__(self, a, b):
        cfg, forward = self._config()
        with _device_work():
            qa, qb = self._operand(a, cfg, forward), self._operand(b, cfg, forward)
        return _product(self.device, qa, qb, cfg, self.in_use)

    def _stack(self, x, cfg: ProductConfig, forward: bool, seed: int):
        """A stack's codes (``stack_codes``) on a device with square tiles, through ``forward``."""
        from hbfp.host.device import stack_codes

        if forward:
            self.in_use.note(x)
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
            self.in_use.note(a, b)
        seed = self.in_use.seed(cfg)
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


_heap_tuned = False


def keep_large_buffers() -> None:
    """Large buffers from the heap, reused from step to step (process-wide, once; glibc only;
    ``HBFP_MALLOC_TUNING=0`` leaves malloc alone). A training step allocates tens of megabytes
    of temporaries (a convolution's patches and their gradient, the outputs); glibc maps each
    block over 32 MiB afresh, so every step pays a page fault and the zeroing of every page of
    them again (30 ms for 37 MiB here). Raising the mapping and trimming thresholds keeps them
    in the heap, as torch's CUDA allocator keeps device memory. Everything in the process gains,
    the fp32 baseline of a comparison included."""
    global _heap_tuned
    if _heap_tuned or os.environ.get("HBFP_MALLOC_TUNING", "1") == "0":
        return
    _heap_tuned = True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):  # not glibc: its own policy
        pass


@contextlib.contextmanager
def backend_flags():
    """The paths whose products reach this mode as products: oneDNN off (RNN cells as
    ``addmm``), the math attention (``bmm``); process-wide, restored on exit."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    keep_large_buffers()
    mkldnn = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch._C._set_mkldnn_enabled(mkldnn)
