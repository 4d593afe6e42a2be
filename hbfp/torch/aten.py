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
functional API is called (``F.conv1d`` .. ``F.conv_transpose3d``: ``hbfp.torch``'s functional
routes, with ``conv`` below). Products of non-floating operands run on the host, warned about
once and counted (``hbfp.torch.report()``). Floating inputs of other dtypes (bf16, fp16) go to
the device as fp32 (exactly) and the fp32 result is rounded to their dtype (to nearest even, as
a bf16 output of the device is).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import threading
import warnings

import torch
import torch.nn.functional as F

from . import counts

__all__ = ["AtenOffload", "backend_flags", "patches", "col2im", "conv", "conv_backward", "ROUTED"]

aten = torch.ops.aten


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
