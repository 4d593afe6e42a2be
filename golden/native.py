"""The golden product's hot loop compiled for this CPU (``native.c``), with the portable path
as the fallback.

On first use the C source is compiled with the system's C compiler (``$CC``, else ``cc``) for
the machine it runs on (``-O3 -march=native``) into a cache directory (``$HBFP_CACHE``, else
``~/.cache/hbfp``), keyed by the source, the flags and the CPU, and loaded with ctypes; later
processes load the cached library. ``HBFP_NATIVE=0`` turns it off. Without a compiler (or if
the build fails) ``available()`` is False, ``why()`` says why, and the callers keep their
NumPy/torch path: the two give the same bits (tests/test_kernels.py holds them equal).

``gemm_codes(a_codes, a_exps, fa, b_codes, b_exps, fb, acc)``: ``acc += p`` for every K-tile's
exact sum ``p`` in K-tile order (``gemm._accumulate_fast``'s arithmetic) of two stored operands
(codes and exponents as they are, no scaled copies). ``quantize(x, fmt, key)``: ``bfp.quantize``
of an fp32 matrix, every rounding. Both share their work out over OpenMP threads: the library
is built with ``-fopenmp``, and the dynamic linker gives it the OpenMP runtime already loaded
(torch's, when torch came first), so the threads that run torch's operations run these too
instead of spinning beside them.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

__all__ = ["available", "why", "disabled", "gemm_codes", "gemm_raw", "dead_tiles_hold_codes", "quantize", "dequantize", "im2col", "col2im", "library_path"]

_SOURCE = Path(__file__).with_name("native.c")
_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared", "-std=c11")
_ABI = 9

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why: str | None = None
_tried = False


def _cpu_key() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("flags", "model name", "Features", "CPU part"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    return Path(os.environ.get("HBFP_CACHE") or Path.home() / ".cache" / "hbfp")


def library_path() -> Path:
    """Where this machine's build of ``native.c`` is (or will be) cached."""
    cc = os.environ.get("CC", "cc")
    h = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), cc.encode(), " ".join(_FLAGS).encode(), _cpu_key().encode(),
                 platform.machine().encode()):
        h.update(part)
        h.update(b"\0")
    return _cache_dir() / f"hbfp_native-{h.hexdigest()[:16]}.so"


def _build(path: Path) -> None:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise OSError(f"no C compiler ({cc!r} is not on PATH; set CC)")
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename: processes that build at once never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *_FLAGS, "-o", tmp, str(_SOURCE)], capture_output=True, text=True)
        if r.returncode != 0:
            raise OSError(f"{cc} failed on {_SOURCE.name}: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> ctypes.CDLL | None:
    global _lib, _why, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            if os.environ.get("HBFP_NATIVE", "1") == "0":
                raise OSError("turned off by HBFP_NATIVE=0")
            path = library_path()
            if not path.exists():
                _build(path)
            lib = ctypes.CDLL(str(path))
            if lib.hbfp_native_abi() != _ABI:
                raise OSError(f"{path} has ABI {lib.hbfp_native_abi()}, expected {_ABI}")
            f = lib.hbfp_gemm_codes
            f.restype = ctypes.c_int
            side = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                    ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_int]
            f.argtypes = [*side, *side, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                          ctypes.c_int, ctypes.c_int]
            f = lib.hbfp_quantize
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.c_void_p, *[ctypes.c_long] * 5, ctypes.c_int, ctypes.c_int, ctypes.c_uint32,
                          ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
            f = lib.hbfp_dead_tiles_hold_codes
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.c_void_p, ctypes.c_int, *[ctypes.c_long] * 4, ctypes.c_void_p, *[ctypes.c_long] * 4]
            f = lib.hbfp_dequantize
            f.restype = None
            f.argtypes = [ctypes.c_void_p, ctypes.c_int, *[ctypes.c_long] * 3, ctypes.c_void_p, *[ctypes.c_long] * 3,
                          ctypes.c_int, ctypes.c_void_p]
            for f in (lib.hbfp_im2col, lib.hbfp_col2im):
                f.restype = None
                f.argtypes = [ctypes.c_void_p, *[ctypes.c_long] * 14, ctypes.c_void_p]
            _lib = lib
        except OSError as e:
            _why = str(e)
        _tried = True
    return _lib


_off = 0  # depth of ``disabled()`` contexts


def available() -> bool:
    """Whether the compiled kernels are loaded (building them on first call) and not turned off
    by ``disabled()``."""
    return _off == 0 and _load() is not None


@contextlib.contextmanager
def disabled():
    """Within the context, callers take their portable path (NumPy and torch operations), as
    without a compiler; for comparisons in one process (``make bench``)."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def why() -> str | None:
    """Why the compiled kernels are not available (None when they are)."""
    _load()
    return _why


def _matrix(x: np.ndarray, name: str, dtypes) -> tuple[int, int]:
    """Strides of a matrix in elements (a transposed view is fine; no copy)."""
    if not isinstance(x, np.ndarray) or x.ndim != 2 or x.dtype not in dtypes:
        raise ValueError(f"{name} must be a matrix of {', '.join(str(np.dtype(d)) for d in dtypes)}, "
                         f"got {getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}")
    rs, cs = (st // x.itemsize for st in x.strides)
    if any(st % x.itemsize or st < 0 for st in x.strides):
        raise ValueError(f"{name} has strides {x.strides} that are not whole, nonnegative elements")
    return rs, cs


_CODES = (np.dtype(np.int8), np.dtype(np.int16), np.dtype(np.int32))


def gemm_codes(a_codes: np.ndarray, a_exps: np.ndarray, fa, b_codes: np.ndarray, b_exps: np.ndarray, fb,
               acc: np.ndarray, *, zero: bool = False, threads: int = 0) -> None:
    """``acc = acc + 0`` (``+0`` if ``zero``: ``acc``'s values are not read), then ``+= p_0``,
    then ``p_1``, ...: ``p_t`` the exact sum over K-tile ``t`` of A @ B, A and
    B stored as codes (int8/int16/int32, any strides) and E8M0 exponents (uint8, one per tile)
    in formats ``fa``, ``fb`` (``gemm._accumulate_fast``'s arithmetic, exact under
    ``gemm._fast_path_ok``; NaN tiles count as zeros: the caller replaces their outputs).
    ``acc``: m x n float32 with contiguous rows. ``threads``: OpenMP threads to share it out
    over (0: OpenMP's default for products of 2**21 multiply-adds or more, else one; the
    result is the same for any number)."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the native kernels are not available: {_why}")
    (m, k), (k2, n) = a_codes.shape, b_codes.shape
    th, tk = fa.tile
    tk2, tw = fb.tile
    if k != k2 or tk != tk2:
        raise ValueError(f"gemm_codes: A {a_codes.shape} with tile {fa.tile} and B {b_codes.shape} with tile "
                         f"{fb.tile} do not agree along K")
    if acc.shape != (m, n):
        raise ValueError(f"gemm_codes: acc has shape {acc.shape}, the product {(m, n)}")
    for name, e, rows, cols in (("a", a_exps, -(-m // th), -(-k // tk)), ("b", b_exps, -(-k // tk), -(-n // tw))):
        _matrix(e, f"{name}_exps", (np.dtype(np.uint8),))
        if e.shape != (rows, cols):
            raise ValueError(f"gemm_codes: {name}_exps has shape {e.shape}, its tiles {(rows, cols)}")
    ars, acs = _matrix(a_codes, "a_codes", _CODES)
    brs, bcs = _matrix(b_codes, "b_codes", _CODES)
    aers, aecs = _matrix(a_exps, "a_exps", (np.dtype(np.uint8),))
    bers, becs = _matrix(b_exps, "b_exps", (np.dtype(np.uint8),))
    crs, ccs = _matrix(acc, "acc", (np.dtype(np.float32),))
    if n > 1 and ccs != 1:
        raise ValueError("acc must have contiguous rows")
    if not acc.flags.writeable:
        raise ValueError("acc must be writeable")
    if m == 0 or n == 0:
        return
    gemm_raw((a_codes.ctypes.data, a_codes.itemsize, ars, acs, a_exps.ctypes.data, aers, aecs), fa,
             (b_codes.ctypes.data, b_codes.itemsize, brs, bcs, b_exps.ctypes.data, bers, becs), fb,
             acc.ctypes.data, crs, m, n, k, zero=zero, threads=threads)


def gemm_raw(a: tuple, fa, b: tuple, fb, acc: int, ldc: int, m: int, n: int, k: int, *, zero: bool = False,
             threads: int = 0) -> None:
    """``gemm_codes`` on raw memory, unchecked: for a caller that holds the operands in other
    arrays (``hbfp.golden.kernels``: torch tensors) and has checked them. ``a``, ``b``: (codes
    address, bytes per code, row and column strides in codes, exponents address, their row and
    column strides); ``acc``: the accumulator's address, ``ldc`` its row stride in floats."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the native kernels are not available: {_why}")
    th, tk = fa.tile
    tw = fb.tile[1]
    rc = lib.hbfp_gemm_codes(*a, th, tk, fa.frac_bits, *b, tk, tw, fb.frac_bits, acc, ldc, m, n, k, int(zero),
                             threads)
    if rc != 0:
        raise MemoryError("hbfp_gemm_codes could not allocate its packing buffers")


def dead_tiles_hold_codes(codes: tuple, m: int, n: int, exps: tuple, tile: tuple[int, int]) -> bool:
    """Whether a tile of exponent code 0 holds a nonzero code, on raw memory (unchecked, as
    ``gemm_raw``): ``codes`` = (address, bytes per code, row stride, column stride), ``exps`` =
    (address, row stride, column stride). Reads only those tiles."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the native kernels are not available: {_why}")
    return bool(lib.hbfp_dead_tiles_hold_codes(*codes, m, n, *exps, *tile))


_ROUNDINGS = {"nearest_even": 0, "toward_zero": 1, "stochastic": 2}


def quantize(x: np.ndarray, fmt, key: int | None, *, threads: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``bfp.quantize`` of an fp32 matrix ``x`` (any strides): ``(codes, exponents)`` as its
    BFPTensor holds them. ``key``: the stochastic generator's key (``bfp._key(seed)``).
    ``threads``: OpenMP threads (0: the default from 2**17 elements, else one)."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the native kernels are not available: {_why}")
    _matrix(x, "x", (np.dtype(np.float32),))
    if x.shape[1] > 1 and x.strides[1] != 4:
        x = np.ascontiguousarray(x)  # rows of consecutive values vectorize (a copy is cheaper than strided reads)
    rs, cs = _matrix(x, "x", (np.dtype(np.float32),))
    if fmt.rounding == "stochastic" and key is None:
        raise ValueError("stochastic rounding needs the generator's key")
    m, n = x.shape
    th, tw = fmt.tile
    tr, tc = -(-m // th), -(-n // tw)
    codes = np.empty((m, n), dtype=fmt.code_dtype)
    exps = np.empty((tr, tc), dtype=np.uint8)
    if codes.size == 0:
        exps[...] = 0
        return codes, exps
    rc = lib.hbfp_quantize(x.ctypes.data, rs, m, n, th, tw, fmt.mantissa_bits, _ROUNDINGS[fmt.rounding],
                           int(key or 0), codes.ctypes.data, codes.itemsize, n, exps.ctypes.data, tc, threads)
    if rc != 0:
        raise MemoryError("hbfp_quantize could not allocate its column tables")
    return codes, exps


def dequantize(codes: np.ndarray, exps: np.ndarray, fmt) -> np.ndarray:
    """``BFPTensor.dequantize`` to float32 (the device rules: RNE, a result below 2**-126 a zero
    of its sign, overflow to inf; NaN tiles give NaN) of a matrix's codes (rows contiguous) and
    exponents."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the native kernels are not available: {_why}")
    rs, cs = _matrix(codes, "codes", _CODES)
    if codes.shape[1] > 1 and cs != 1:
        codes = np.ascontiguousarray(codes)
        rs = codes.shape[1]
    exps = np.ascontiguousarray(exps)
    m, n = codes.shape
    th, tw = fmt.tile
    if exps.dtype != np.uint8 or exps.shape != (-(-m // th), -(-n // tw)):
        raise ValueError(f"dequantize: exponents {exps.dtype} {exps.shape} do not match codes {codes.shape} in "
                         f"tiles {fmt.tile}")
    out = np.empty((m, n), dtype=np.float32)
    if out.size:
        lib.hbfp_dequantize(codes.ctypes.data, codes.itemsize, m, n, rs, exps.ctypes.data, exps.shape[1], th, tw,
                            fmt.frac_bits, out.ctypes.data)
    return out


def _conv_geometry(shape, kernel, stride, padding, dilation) -> tuple:
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


def im2col(x: np.ndarray, kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int],
           dilation: tuple[int, int]) -> np.ndarray:
    """The patches of a convolution of ``x`` (N x C x H x W float32, contiguous) as one matrix,
    (N * OH * OW) x (C * KH * KW): torch's ``unfold`` transposed to rows of output positions,
    zero padding."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the native kernels are not available: {_why}")
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 4 or not x.flags.c_contiguous:
        raise ValueError("im2col takes a contiguous N x C x H x W float32 array")
    g = _conv_geometry(x.shape, kernel, stride, padding, dilation)
    out = np.empty((g[0] * g[12] * g[13], g[1] * g[4] * g[5]), dtype=np.float32)
    lib.hbfp_im2col(x.ctypes.data, *g, out.ctypes.data)
    return out


def col2im(cols: np.ndarray, shape: tuple[int, int, int, int], kernel: tuple[int, int], stride: tuple[int, int],
           padding: tuple[int, int], dilation: tuple[int, int]) -> np.ndarray:
    """The adjoint of ``im2col``: the patches' values (a contiguous float32 matrix as ``im2col``
    gives it) summed back onto an N x C x H x W image ``shape``, bit for bit as torch's ``fold``
    of the transposed patches sums them."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the native kernels are not available: {_why}")
    g = _conv_geometry(shape, kernel, stride, padding, dilation)
    want = (g[0] * g[12] * g[13], g[1] * g[4] * g[5])
    if (not isinstance(cols, np.ndarray) or cols.dtype != np.float32 or cols.shape != want
            or not cols.flags.c_contiguous):
        raise ValueError(f"col2im takes a contiguous {want[0]} x {want[1]} float32 matrix, got "
                         f"{getattr(cols, 'dtype', type(cols).__name__)} {getattr(cols, 'shape', '')}")
    out = np.empty(tuple(shape), dtype=np.float32)
    lib.hbfp_col2im(cols.ctypes.data, *g, out.ctypes.data)
    return out
