"""One boundary for every fast implementation of the golden numerics (docs/numerics.md).

``hbfp.golden`` is the reference, slow and obvious. Everything that computes the same bits
faster sits behind this registry, and every caller (``hbfp.golden``'s own ``gemm`` and
``quantize`` by default, the ``emu`` device, ``hbfp.torch``, the gradient exchange) calls it:

- ``gemm(a, b, ...)``: the product's results (``C + A @ B + bias``, an activation, fp32 or
  bf16) of two stored operands, matrices or stacks of them;
- ``quantize(x, fmt, ...)``, ``dequantize(codes, exponents, fmt)``;
- ``im2col``/``col2im``: a convolution's patches as one matrix and back; ``transpose``: a
  stack of matrices transposed (blocked);
- ``lstm_cell``/``lstm_cell_backward``: an LSTM time step's elementwise work (compiled, or
  the same operations in torch: the same bits), for ``hbfp.torch.rnn``.

Implementations (``IMPLS``), each chosen with ``impl=`` and tested against the reference:

- compiled integer kernels (``build.VARIANTS``): ``avx512`` (exact int32 K-tile sums of int8
  codes by AVX-512 VNNI's vpdpbusd), ``avx2`` (by vpmaddwd), ``c`` (portable C, any CPU); built on first use for the CPU's features and loaded
  only where the CPU has them;
- ``numpy``: NumPy fp32 BLAS on the scaled codes, exact under checked preconditions (the
  reference outside them); no compiler needed;
- ``torch``: torch operations where the tensors are (CUDA included), ``torch_int8``: exact
  int32 sums by ``torch._int_mm`` (CPUs whose torch has it);
- ``reference``: ``hbfp.golden`` itself.

``impl=None`` takes the first available of ``preferred(device)``: the fastest compiled
variant for CPU memory (``numpy`` without a compiler, with one warning saying why), ``torch``
for tensors on an accelerator. Arguments are NumPy arrays or torch tensors; results come back
as the same kind. ``threads`` (default ``default_threads()``: torch's intra-op count when torch is
loaded, else the CPUs this process may run on; ``$HBFP_NUM_THREADS`` overrides) is how many
threads a compiled kernel shares its work over.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from typing import NamedTuple

import numpy as np

from hbfp.golden.bfp import BFPTensor, Format

from . import build
from .native import Compiled

__all__ = ["IMPLS", "COMPILED", "Codes", "KernelWarning", "available", "why", "preferred", "resolve", "default_threads",
           "gemm", "quantize", "requantize", "dequantize", "im2col", "col2im", "im2col_quantize", "lstm_cell", "lstm_cell_backward", "conv_geometry", "activation_table",
           "transpose"]

#: The compiled variants, fastest first.
COMPILED = tuple(v.name for v in build.VARIANTS)
#: Every implementation's name.
IMPLS = (*COMPILED, "numpy", "torch", "torch_int8", "reference")

_COMPILED = {name: Compiled(name) for name in COMPILED}


class KernelWarning(UserWarning):
    """The compiled kernels are not in use (issued once, with the reason)."""


class Codes(NamedTuple):
    """A stored operand: integer ``codes``, E8M0 ``exponents`` (one per tile) and its ``fmt``
    (NumPy arrays or torch tensors)."""

    codes: object
    exponents: object
    fmt: Format


_THREADS_ENV = os.environ.get("HBFP_NUM_THREADS")


def default_threads() -> int:
    """The threads a compiled kernel shares its work over by default (``$HBFP_NUM_THREADS``,
    read when hbfp.kernels is imported; else torch's intra-op threads where torch is loaded,
    else the CPUs this process may run on)."""
    if _THREADS_ENV:
        try:
            return max(1, int(_THREADS_ENV))
        except ValueError:
            raise ValueError(f"HBFP_NUM_THREADS must be a positive integer, got {_THREADS_ENV!r}") from None
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_num_threads"):
        return torch.get_num_threads()
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _torch_available() -> str | None:
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch is not installed (pip install 'hbfp[torch]')"
    return None


def why(impl: str) -> str | None:
    """Why ``impl`` cannot run here (None when it can)."""
    if impl in _COMPILED:
        return _COMPILED[impl].why()
    if impl in ("numpy", "reference"):
        return None
    if impl == "torch":
        return _torch_available()
    if impl == "torch_int8":
        missing = _torch_available()
        if missing:
            return missing
        from . import torch_ops

        return None if torch_ops._int_mm_works() else "this torch has no exact torch._int_mm on the CPU"
    raise ValueError(f"no implementation {impl!r}; known: {', '.join(IMPLS)}")


def available(impl: str) -> bool:
    return why(impl) is None


def preferred(device: str = "cpu") -> tuple[str, ...]:
    """The implementations ``impl=None`` tries, in order, for memory on ``device``."""
    if device != "cpu":
        return ("torch",)
    return (*COMPILED, "numpy")


_warned = False


@functools.lru_cache(maxsize=None)
def _best_cpu() -> str:
    global _warned
    for name in COMPILED:
        if available(name):
            return name
    reason = why("c")
    if not _warned and "HBFP_NATIVE=0" not in (reason or ""):
        _warned = True
        warnings.warn(f"hbfp's compiled kernels are not in use ({reason}); products run on NumPy BLAS, several "
                      "times slower", KernelWarning, stacklevel=3)
    return "numpy"


def resolve(impl: str | None, device: str = "cpu") -> str:
    """The implementation ``impl`` names (checked), or the preferred one for ``device``."""
    if impl is None:
        return _best_cpu() if device == "cpu" else "torch"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)} or None, got {impl!r}")
    reason = why(impl)
    if reason:
        raise RuntimeError(f"impl={impl!r} cannot run here: {reason}")
    if device != "cpu" and impl not in ("torch",):
        raise ValueError(f"impl={impl!r} takes CPU memory; the operands are on {device}")
    return impl


# ---- arrays of either kind -----------------------------------------------------------------

def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _device(x) -> str:
    return x.device.type if _is_torch(x) else "cpu"


def _numpy(x):
    """The NumPy view of a CPU array or tensor (a copy where its strides run backwards)."""
    if _is_torch(x):
        x = x.detach()
        if any(s < 0 for s in x.stride()):
            x = x.contiguous()
        return x.numpy()
    x = np.asarray(x)
    return np.ascontiguousarray(x) if any(s < 0 for s in x.strides) else x


def _writable(x) -> np.ndarray:
    """The NumPy view of a CPU array or tensor that writes reach (never a copy)."""
    return x.detach().numpy() if _is_torch(x) else x


def _like(x, arr: np.ndarray):
    """``arr`` as the kind of array ``x`` is."""
    if _is_torch(x):
        import torch

        return torch.from_numpy(arr)
    return arr


def _operand(x, fmt: Format | None, what: str) -> tuple:
    """(codes, exponents, fmt) of a BFPTensor, a Codes or a (codes, exponents) pair with ``fmt``."""
    if isinstance(x, (BFPTensor, Codes)):
        return x.codes, x.exponents, x.fmt
    if isinstance(x, tuple) and len(x) == 2:
        if fmt is None:
            raise ValueError(f"{what} given as (codes, exponents) needs its format")
        return x[0], x[1], fmt
    raise TypeError(f"{what} must be a BFPTensor, a Codes or (codes, exponents), got {type(x).__name__}")


@functools.lru_cache(maxsize=None)
def activation_table(name: str, leaky_shift: int | None = None) -> np.ndarray:
    """The bf16 unit ``name`` over all 65,536 bf16 patterns (uint16), as the kernels apply it."""
    from hbfp.golden import activations

    f = activations.get(name, leaky_shift=leaky_shift)
    t = f(np.arange(1 << 16, dtype=np.uint16)).astype(np.uint16)
    t.setflags(write=False)
    return t


# ---- the product ---------------------------------------------------------------------------

def gemm(a, b, *, fa: Format | None = None, fb: Format | None = None, c=None, bias=None,
         activation: str | None = None, out: str = "fp32", leaky_shift: int | None = None, impl: str | None = None,
         threads: int | None = None, qmax_a: int | None = None, qmax_b: int | None = None):
    """``act(C + A @ B + bias)`` of stored operands, bit for bit ``hbfp.golden.gemm.gemm``.

    ``a``, ``b``: BFPTensors, ``Codes`` or ``(codes, exponents)`` pairs in ``fa``/``fb``:
    matrices, or stacks with one leading axis (as many products). Transposed views are read
    as they are. ``c``: fp32 of the result's shape (``acc`` starts there; may be ``out``'s
    memory for an in-place update), ``bias``: N fp32 values, ``activation``: a bf16 unit of
    ``hbfp.golden.activations`` (``leaky_shift`` for leaky_relu), ``out``: "fp32" (float32)
    or "bf16" (bf16 patterns as uint16 for NumPy, a torch.bfloat16 tensor for torch).
    ``qmax_*``: the largest code magnitude an operand may hold where it is not its format's
    (a raw stored operand may hold one more)."""
    ca, ea, fa = _operand(a, fa, "A")
    cb, eb, fb = _operand(b, fb, "B")
    if out not in ("fp32", "bf16"):
        raise ValueError(f"out must be 'fp32' or 'bf16', got {out!r}")
    if impl is None and c is None and bias is None and activation is None and type(ca) is _Tensor():
        y = _gemm_lean(ca, ea, fa, cb, eb, fb, out, threads, qmax_a, qmax_b)
        if y is not None:
            return y
    name = resolve(impl, _device(ca))
    if name in _COMPILED:
        return _gemm_compiled(_COMPILED[name], ca, ea, fa, cb, eb, fb, c, bias, activation, out, leaky_shift,
                              default_threads() if threads is None else threads, qmax_a, qmax_b)
    torch_in = _is_torch(ca)
    if name in ("torch", "torch_int8"):
        import torch

        from . import torch_ops

        t = (lambda x: x if x is None or isinstance(x, torch.Tensor) else torch.from_numpy(_numpy(x)))
        ca, ea, cb, eb, c, bias = (t(x) for x in (ca, ea, cb, eb, c, bias))
        # torch._int_mm takes int8 codes on a CPU; the fp32 route does the rest
        route = "int8" if name == "torch_int8" and torch_ops._int8_applies(ca, cb) else "fp32"
        if ca.dim() == 3:
            sums = torch.stack([torch_ops.gemm((ca[i], ea[i]), (cb[i], eb[i]), fa, fb,
                                               c=None if c is None else c[i], bias=bias, impl=route)
                                for i in range(ca.shape[0])])
        else:
            sums = torch_ops.gemm((ca, ea), (cb, eb), fa, fb, c=c, bias=bias, impl=route)
        y = torch_ops.epilogue(sums, activation, out, leaky_shift=leaky_shift)
        if not torch_in:
            y = y.view(torch.int16).numpy().view(np.uint16) if out == "bf16" else y.numpy()
        return y
    # NumPy: the BLAS route or the reference, product by product
    from hbfp.golden import bf16 as _bf16
    from hbfp.golden.gemm import epilogue, reference_sums

    from . import numpy_ops

    na, xa, nb, xb = _numpy(ca), _numpy(ea), _numpy(cb), _numpy(eb)
    nc = None if c is None else _numpy(c)
    nbias = None if bias is None else _numpy(bias)
    sums_of = numpy_ops.gemm_sums if name == "numpy" else reference_sums

    def one(i=None):
        pick = (lambda x: x) if i is None else (lambda x: x[i])
        s = sums_of(BFPTensor(pick(na), pick(xa), fa), BFPTensor(pick(nb), pick(xb), fb),
                    c=None if nc is None else pick(nc), bias=nbias)
        y = epilogue(s, activation, out, leaky_shift=leaky_shift)
        return np.asarray(y).view(np.uint16) if out == "bf16" else y

    y = np.stack([one(i) for i in range(na.shape[0])]) if na.ndim == 3 else one()
    if torch_in:
        import torch

        return torch.from_numpy(y.view(np.int16)).view(torch.bfloat16) if out == "bf16" else torch.from_numpy(y)
    return y


def _Tensor():
    """torch.Tensor where torch is loaded (else nothing can be one: no import here)."""
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None)


def _lean_types():
    import torch

    return {torch.int8, torch.int16}, torch.uint8


def _gemm_lean(ca, ea, fa, cb, eb, fb, out, threads, qmax_a, qmax_b):
    """``gemm`` of CPU torch tensors by the preferred compiled kernel, in a few microseconds:
    None where a check fails (the general path then says why)."""
    name = _best_cpu()
    lib = _COMPILED.get(name)
    if lib is None:
        return None
    import torch

    codes, exps = _lean_types()
    if (ca.dtype not in codes or cb.dtype not in codes or ea.dtype != exps or eb.dtype != exps or not ca.is_cpu
            or not cb.is_cpu or ca.requires_grad or cb.requires_grad or ca.dim() not in (2, 3)
            or cb.dim() != ca.dim() or ea.dim() != ca.dim() or eb.dim() != ca.dim()):
        return None
    if min(ca.stride()) < 0 or min(cb.stride()) < 0 or min(ea.stride()) < 0 or min(eb.stride()) < 0:
        return None
    (m, k), (k2, n) = ca.shape[-2:], cb.shape[-2:]
    th, tk = fa.tile
    if k != k2 or tk != fb.tile[0] or tuple(ea.shape[-2:]) != (-(-m // th), -(-k // tk)) \
            or tuple(eb.shape[-2:]) != (-(-k // tk), -(-n // fb.tile[1])):
        return None
    if ca.dim() == 3 and not (cb.shape[0] == ea.shape[0] == eb.shape[0] == ca.shape[0]):
        return None
    shape = (*ca.shape[:-1], n)
    y = torch.from_numpy(np.empty(shape, np.float32)) if out == "fp32" else \
        torch.from_numpy(np.empty(shape, np.int16)).view(torch.bfloat16)  # (NumPy allocates faster)
    if y.numel():
        qa = (127 if ca.dtype == torch.int8 else _code_bound(ca.numpy(), fa)) if qmax_a is None else qmax_a
        qb = (127 if cb.dtype == torch.int8 else _code_bound(cb.numpy(), fb)) if qmax_b is None else qmax_b
        lib.gemm_tensor(ca, ea, fa, cb, eb, fb, y, default_threads() if threads is None else threads, qa, qb)
    return y


def _code_bound(codes: np.ndarray, fmt: Format) -> int:
    """The largest code magnitude an operand may hold, less one (the kernel allows for one
    more, -2**(m-1)): its dtype's for int8 codes, its format's for 16 bits, else its own."""
    if codes.dtype == np.int8:
        return 127
    if fmt.mantissa_bits == 16 or codes.size == 0:
        return 32767 if fmt.mantissa_bits == 16 else fmt.qmax
    return max(fmt.qmax, int(codes.max()), -int(codes.min()) - 1)


def _gemm_compiled(lib: Compiled, ca, ea, fa, cb, eb, fb, c, bias, activation, out, leaky_shift, nthreads, qmax_a,
                   qmax_b):
    if _is_torch(ca):  # torch's memory as it is (no NumPy views: they cost more than small products)
        import torch

        ca, ea, cb, eb = (x.detach() for x in (ca, ea, cb, eb))
        if min(ca.stride()) < 0 or min(cb.stride()) < 0:
            ca, cb = ca.contiguous(), cb.contiguous()
        qmax_a = (127 if ca.dtype == torch.int8 else _code_bound(ca.numpy(), fa)) if qmax_a is None else qmax_a
        qmax_b = (127 if cb.dtype == torch.int8 else _code_bound(cb.numpy(), fb)) if qmax_b is None else qmax_b
        shape = (*ca.shape[:-1], cb.shape[-1])
        y = torch.empty(shape, dtype=torch.bfloat16 if out == "bf16" else torch.float32)
        if c is not None:
            c = c.detach()
            if c.dtype != torch.float32:
                raise TypeError(f"c must be float32 (the fp32 accumulator), got {c.dtype}")
            if c.shape[-1] > 1 and c.stride(-1) != 1:
                c = c.contiguous()
        if bias is not None:
            bias = bias.detach()
            if bias.dtype != torch.float32:
                raise TypeError(f"bias must be float32, got {bias.dtype}")
            bias = bias.contiguous()
    else:
        ca, ea, cb, eb = _numpy(ca), _numpy(ea), _numpy(cb), _numpy(eb)
        qmax_a = _code_bound(ca, fa) if qmax_a is None else qmax_a
        qmax_b = _code_bound(cb, fb) if qmax_b is None else qmax_b
        y = np.empty((*ca.shape[:-1], cb.shape[-1]), np.uint16 if out == "bf16" else np.float32)
        if c is not None:
            c = _numpy(c)
            if c.dtype != np.float32:
                raise TypeError(f"c must be float32 (the fp32 accumulator), got {c.dtype}")
            if c.shape[-1] > 1 and c.strides[-1] != 4:
                c = np.ascontiguousarray(c)
        if bias is not None:
            bias = np.ascontiguousarray(_numpy(bias))
            if bias.dtype != np.float32:
                raise TypeError(f"bias must be float32, got {bias.dtype}")
    if y.shape[-1] == 0 or y.shape[-2] == 0 or (y.ndim == 3 and y.shape[0] == 0):
        return y  # no outputs
    table = activation_table(activation, leaky_shift) if activation is not None else None
    lib.gemm((ca, ea), fa, (cb, eb), fb, y, c=c, bias=bias, table=table, threads=nthreads, qmax_a=qmax_a,
             qmax_b=qmax_b)
    return y


# ---- quantization ----------------------------------------------------------------------------

def quantize(x, fmt: Format, *, seed: int | None = None, impl: str | None = None, threads: int | None = None):
    """``hbfp.golden.quantize`` of a matrix: ``(codes, exponents)`` of ``x``'s kind (int8 codes
    up to 8 mantissa bits, else int16; uint8 exponents, one per tile). ``x``: fp32, or another
    float type (converted to fp32 first, RNE; bf16 exactly).

    A stack of matrices (a leading axis) is quantized as one matrix of them stacked, each
    padded with zeros to whole tiles (so that no tile spans two of them): codes of the stack's
    shape, exponents (B, tile rows, tile columns). To nearest, each matrix's codes are its own
    quantization's; stochastically, the positions are the stacked matrix's."""
    from hbfp.golden import bfp

    if not isinstance(fmt, Format):
        raise TypeError(f"fmt must be a Format (for example HBFP8), got {fmt!r}")
    bfp._check_stochastic(fmt, seed)
    if impl is None and type(x) is _Tensor():
        q = _quantize_lean(x, fmt, seed, threads)
        if q is not None:
            return q
    name = resolve(impl, _device(x))
    torch_in = _is_torch(x)
    if torch_in:
        import torch

        xn = x.detach()
        if xn.dtype != torch.float32:
            xn = xn.to(torch.float32)
        if xn.dim() not in (2, 3):
            raise ValueError(f"quantize takes a matrix or a stack of them, got shape {tuple(xn.shape)}")
        if min(xn.stride()) < 0 or name not in _COMPILED and xn.shape[-1] > 1 and xn.stride(-1) != 1:
            xn = xn.contiguous()  # rows of consecutive values (the compiled kernels read any strides)
    else:
        xn = bfp._as_f32(x)
        if xn.ndim == 1:
            xn = xn[None, :]
        if xn.ndim not in (2, 3):
            raise ValueError(f"quantize takes a matrix or a stack of them, got shape {xn.shape}")
        if any(s < 0 for s in xn.strides) or name not in _COMPILED and xn.shape[-1] > 1 and xn.strides[-1] != 4:
            xn = np.ascontiguousarray(xn)
    th, tw = fmt.tile
    m, n = xn.shape[-2:]
    grid = (*xn.shape[:-2], -(-m // th), -(-n // tw))
    if name in _COMPILED:
        if torch_in:
            codes = torch.empty(tuple(xn.shape), dtype=torch.int8 if fmt.mantissa_bits <= 8 else torch.int16)
            exps = torch.empty(grid, dtype=torch.uint8)
        else:
            codes = np.empty(xn.shape, fmt.code_dtype)
            exps = np.empty(grid, np.uint8)
        if m and n:
            key = _seed_key(seed) if fmt.rounding == "stochastic" else None
            _COMPILED[name].quantize(xn, fmt, key, codes, exps, threads=default_threads() if threads is None else threads)
        else:
            exps[...] = 0
        return codes, exps
    if xn.ndim == 3:  # the stack as one matrix of padded matrices, quantized, then taken apart
        nb, (rp, cp) = xn.shape[0], (grid[1] * th, grid[2] * tw)
        if torch_in:
            padded = torch.nn.functional.pad(xn, (0, cp - n, 0, rp - m)).reshape(nb * rp, cp)
        else:
            padded = np.pad(xn, ((0, 0), (0, rp - m), (0, cp - n))).reshape(nb * rp, cp)
        codes, exps = quantize(padded, fmt, seed=seed, impl=impl, threads=threads)
        codes = codes.reshape(nb, rp, cp)[:, :m, :n]
        codes = codes.contiguous() if torch_in else np.ascontiguousarray(codes)
        return codes, exps.reshape(grid)
    if name in ("torch", "torch_int8"):
        from . import torch_ops

        t = xn if torch_in else __import__("torch").from_numpy(xn)
        codes, exps = torch_ops.quantize(t, fmt, seed=seed)
        return (codes, exps) if torch_in else (codes.numpy(), exps.numpy())
    t = bfp.quantize(xn.numpy() if torch_in else xn, fmt, seed=seed, impl="reference")  # the golden bands
    return (_like(x, t.codes), _like(x, t.exponents)) if torch_in else (t.codes, t.exponents)


@functools.lru_cache(maxsize=4096)
def _seed_key(seed: int) -> int:
    """``bfp._key(seed)`` (``mix32(seed ^ SEED_SALT)``) in Python integers: a few operations,
    where NumPy's scalars cost tens of microseconds a quantization."""
    from hbfp.golden import bfp

    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise TypeError(f"seed must be an integer, got {seed!r}")
    x = (int(seed) ^ bfp.SEED_SALT) & 0xFFFF_FFFF
    m0, m1 = bfp.MIX32_MULTIPLIERS
    x ^= x >> 16
    x = (x * m0) & 0xFFFF_FFFF
    x ^= x >> 15
    x = (x * m1) & 0xFFFF_FFFF
    return x ^ (x >> 16)


def _quantize_lean(x, fmt: Format, seed, threads):
    """``quantize`` of a CPU fp32 torch tensor (a matrix or a stack, any nonnegative strides:
    a transposed view is read as it lies) by the preferred compiled kernel, in a few
    microseconds: None elsewhere."""
    name = _best_cpu()
    lib = _COMPILED.get(name)
    if lib is None:
        return None
    import torch

    if x.dtype != torch.float32 or not x.is_cpu or x.dim() not in (2, 3) or min(x.stride()) < 0:
        return None
    th, tw = fmt.tile
    m, n = x.shape[-2:]
    codes = torch.from_numpy(np.empty(tuple(x.shape), fmt.code_dtype))
    exps = torch.from_numpy(np.empty((*x.shape[:-2], -(-m // th), -(-n // tw)), np.uint8))
    if m and n and x.numel():
        key = _seed_key(seed) if fmt.rounding == "stochastic" else 0
        lib.quantize_tensor(x.detach(), fmt, key, codes, exps, default_threads() if threads is None else threads)
    else:
        exps.zero_()
    return codes, exps


def requantize(codes, exponents, src: Format, fmt: Format, *, seed: int | None = None):
    """``hbfp.golden.requantize`` (narrower mantissas on the same tiles and exponents, e.g.
    HBFP16 storage read as HBFP8) of a matrix's codes and exponents, of their kind."""
    if _is_torch(codes):
        from . import torch_ops

        return torch_ops.requantize(codes, exponents, src, fmt, seed=seed)
    from hbfp.golden.bfp import requantize as golden_requantize

    t = golden_requantize(BFPTensor(np.asarray(codes), np.asarray(exponents), src), fmt, seed=seed)
    return t.codes, t.exponents


def dequantize(codes, exponents, fmt: Format, *, impl: str | None = None, out=None):
    """``BFPTensor.dequantize`` (fp32 by the device rules) of a matrix's codes and exponents.
    ``out``: a float32 array or tensor of the codes' shape (and kind) to write the values into
    and return, instead of a new one (the compiled kernels write it directly where it is
    contiguous)."""
    if out is not None and (tuple(out.shape) != tuple(codes.shape) or _is_torch(out) != _is_torch(codes)
                            or str(out.dtype) not in ("float32", "torch.float32")):
        raise ValueError(f"dequantize: out must be a float32 {'tensor' if _is_torch(codes) else 'array'} of the "
                         f"codes' shape {tuple(codes.shape)}, got {type(out).__name__} {tuple(out.shape)} {out.dtype}")
    name = resolve(impl, _device(codes))
    if name in ("torch", "torch_int8"):
        from . import torch_ops

        y = torch_ops.dequantize(codes, exponents, fmt)
        return y if out is None else out.copy_(y)
    nc, ne = _numpy(codes), _numpy(exponents)
    if name in _COMPILED and nc.ndim == 2:
        if nc.shape[1] > 1 and nc.strides[1] != nc.itemsize:
            nc = np.ascontiguousarray(nc)
        ne = np.ascontiguousarray(ne)
        y = None if out is None else _writable(out)
        if y is None or not y.flags.c_contiguous:
            y = np.empty(nc.shape, np.float32)
        if y.size:
            _COMPILED[name].dequantize(nc, ne, fmt, y, threads=default_threads())
    else:
        y = BFPTensor(nc, ne, fmt).dequantize()
    if out is None:
        return _like(codes, y)
    view = _writable(out)
    if not np.shares_memory(y, view):
        view[...] = y
    return out


# ---- convolutions ----------------------------------------------------------------------------

def conv_geometry(shape, kernel, stride, padding, dilation) -> tuple:
    """(n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow) of a 2-d convolution of ``shape``."""
    n, c, h, w = shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, padding, dilation
    if min(kh, kw, sh, sw, dh, dw) < 1 or min(ph, pw) < 0:
        raise ValueError(f"convolution geometry: kernel {kernel}, stride {stride}, padding {padding}, "
                         f"dilation {dilation}")
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if oh < 1 or ow < 1:
        raise ValueError(f"no convolution output for input {tuple(shape)}, kernel {kernel}, stride {stride}, "
                         f"padding {padding}, dilation {dilation}")
    return (n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow)


def compiled_cpu() -> Compiled | None:
    """The compiled kernels the registry runs on the CPU (``impl=None``'s choice), or None where
    none can run here. Their ``quantize_tensor`` and ``gemm_tensor`` are the registry's lean
    entries for torch tensors a caller has checked (``hbfp.torch.compiled``'s products)."""
    return _COMPILED.get(_best_cpu())


def _conv_lib(x) -> Compiled | None:
    if _device(x) != "cpu":
        return None
    return compiled_cpu()


def im2col(x, kernel, stride, padding, dilation):
    """The patches of a convolution of ``x`` (N x C x H x W float32) as one matrix,
    (N * OH * OW) x (C * KH * KW): torch's ``unfold`` transposed to rows of output positions,
    zero padding. Compiled where a CPU build is available, else torch's ``unfold``."""
    g = conv_geometry(tuple(x.shape), tuple(kernel), tuple(stride), tuple(padding), tuple(dilation))
    lib = _conv_lib(x)
    xn = None
    if lib is not None:
        xn = np.ascontiguousarray(_numpy(x))
        if xn.dtype != np.float32:
            lib = None
    if lib is None:
        import torch
        import torch.nn.functional as F

        t = x if _is_torch(x) else torch.from_numpy(np.asarray(x))
        cols = F.unfold(t, tuple(kernel), dilation=tuple(dilation), padding=tuple(padding), stride=tuple(stride))
        y = cols.transpose(1, 2).reshape(g[0] * cols.shape[2], cols.shape[1])
        return y if _is_torch(x) else y.numpy()
    out = np.empty((g[0] * g[12] * g[13], g[1] * g[4] * g[5]), np.float32)
    lib.im2col(xn, g, out, threads=default_threads())
    return _like(x, out)


def im2col_quantize(x, kernel, stride, padding, dilation, fmt: Format, *, seed: int | None = None):
    """``quantize(im2col(x), fmt, seed=seed)``, without the fp32 patch matrix where the
    compiled kernels run (each band of it gathered into the cache and quantized there)."""
    from hbfp.golden import bfp

    bfp._check_stochastic(fmt, seed)
    g = conv_geometry(tuple(x.shape), tuple(kernel), tuple(stride), tuple(padding), tuple(dilation))
    lib = _conv_lib(x)
    xn = None
    if lib is not None:
        xn = np.ascontiguousarray(_numpy(x))
        if xn.dtype != np.float32:
            lib = None
    if lib is None:
        return quantize(im2col(x, kernel, stride, padding, dilation), fmt, seed=seed)
    m, n = g[0] * g[12] * g[13], g[1] * g[4] * g[5]
    th, tw = fmt.tile
    codes = np.empty((m, n), fmt.code_dtype)
    exps = np.empty((-(-m // th), -(-n // tw)), np.uint8)
    if codes.size:
        key = _seed_key(seed) if fmt.rounding == "stochastic" else 0
        lib.im2col_quantize(xn, g, fmt, key, codes, exps, threads=default_threads())
    else:
        exps[...] = 0
    return _like(x, codes), _like(x, exps)


def col2im(cols, shape, kernel, stride, padding, dilation):
    """The adjoint of ``im2col``: the patches' values summed back onto an N x C x H x W image
    ``shape``, bit for bit as torch's ``fold`` of the transposed patches sums them. ``cols``
    may be stored row-major or transposed (a view of the transposed matrix: read as it is)."""
    g = conv_geometry(tuple(shape), tuple(kernel), tuple(stride), tuple(padding), tuple(dilation))
    want = (g[0] * g[12] * g[13], g[1] * g[4] * g[5])
    if tuple(cols.shape) != want:
        raise ValueError(f"col2im takes a {want[0]} x {want[1]} matrix, got {tuple(cols.shape)}")
    lib = _conv_lib(cols)
    cn = None
    if lib is not None:
        cn = _numpy(cols)
        if cn.ndim != 2 or not (cn.strides[1] == cn.itemsize or cn.strides[0] == cn.itemsize):
            cn = np.ascontiguousarray(cn)
        if cn.dtype != np.float32:
            lib = None
    if lib is None:
        import torch
        import torch.nn.functional as F

        t = cols if _is_torch(cols) else torch.from_numpy(np.asarray(cols))
        n = g[0]
        c3 = t.reshape(n, t.shape[0] // n, t.shape[1]).transpose(1, 2)
        y = F.fold(c3, tuple(shape[-2:]), tuple(kernel), dilation=tuple(dilation), padding=tuple(padding),
                   stride=tuple(stride))
        return y if _is_torch(cols) else y.numpy()
    out = np.empty(tuple(shape), np.float32)
    lib.col2im(cn, g, out, threads=default_threads())
    return _like(cols, out)


def _cell_tensors(*ts) -> bool:
    import torch

    return all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in ts)


def lstm_cell(p, xp, c_prev, acts, c, tc, h) -> None:
    """One LSTM time step's elementwise work (hbfp.torch.rnn), into ``acts``, ``c``, ``tc``,
    ``h``: the gates ``p + xp`` (rows x 4H, input | forget | cell | output: the step's product
    and its projected input) after their nonlinearities, the cell state
    ``c = f * c_prev + i * g``, ``tc = tanh(c)`` and the hidden state ``h = o * tc``. Torch
    tensors; compiled (src/cell.c) for contiguous fp32 CPU ones, else the same operations in
    torch (``torch_ops.lstm_cell``): the same bits either way."""
    lib = _conv_lib(p)
    if lib is not None and _cell_tensors(p, xp, c_prev, acts, c, tc, h):
        lib.lstm_cell(p, xp, c_prev, acts, c, tc, h)
    else:
        from . import torch_ops

        torch_ops.lstm_cell(p, xp, c_prev, acts, c, tc, h)


def lstm_cell_backward(acts, c_prev, tc, dy, dh, dc, dgates, dc_prev) -> None:
    """``lstm_cell``'s backward: from the step's ``acts``, ``c_prev``, ``tc`` and the gradients
    of h (``dy`` from the layer's output, ``dh`` from the next step) and of c (``dc``), the
    gates' gradient before their nonlinearities into ``dgates`` and c_prev's into ``dc_prev``."""
    lib = _conv_lib(acts)
    if lib is not None and _cell_tensors(acts, c_prev, tc, dy, dh, dc, dgates, dc_prev):
        lib.lstm_cell_backward(acts, c_prev, tc, dy, dh, dc, dgates, dc_prev)
    else:
        from . import torch_ops

        torch_ops.lstm_cell_backward(acts, c_prev, tc, dy, dh, dc, dgates, dc_prev)


def transpose(x):
    """``x`` (a stack of matrices, B x M x N) as the contiguous stack of their transposes,
    B x N x M: a convolution's product rows (output positions, channels) to the image's layout
    and back. Blocked in the compiled kernels for float32 CPU memory (torch's copy of a
    transposed view runs several times slower), else the array library's own copy."""
    if x.ndim != 3:
        raise ValueError(f"transpose takes a stack of matrices (3 axes), got shape {tuple(x.shape)}")
    lib = _conv_lib(x)
    torch_in = _is_torch(x)
    if lib is not None and (x.dtype == np.float32 if not torch_in else str(x.dtype) == "torch.float32"):
        xn = _numpy(x)
        if not xn.flags.c_contiguous:
            xn = np.ascontiguousarray(xn)
        out = np.empty((xn.shape[0], xn.shape[2], xn.shape[1]), np.float32)
        if out.size:
            lib.transpose(xn, out, threads=default_threads())
        return _like(x, out)
    return x.transpose(1, 2).contiguous() if torch_in else np.ascontiguousarray(np.swapaxes(x, 1, 2))
