"""The compiled kernels of one variant (``build``) called on the memory of NumPy arrays or CPU
torch tensors: ``gemm``, ``quantize``, ``dequantize``, ``im2col``, ``col2im``. Shapes, dtypes
and layouts are checked here; the bits are the C code's (src/)."""

from __future__ import annotations

import array
import ctypes

import numpy as np

from . import build, capi

__all__ = ["Compiled", "ROUNDINGS", "Mem"]

#: The rounding codes of ``hbfp_quantize``.
ROUNDINGS = {"nearest_even": 0, "toward_zero": 1, "stochastic": 2}


class Mem:
    """An array's memory as the C code reads it: address, shape, strides in elements, item
    size and the NumPy dtype (NumPy arrays and CPU torch tensors alike, no copy)."""

    __slots__ = ("ptr", "shape", "strides", "itemsize", "dtype", "base")

    def __init__(self, x, what: str):
        if isinstance(x, np.ndarray):
            self.ptr = x.ctypes.data
            self.shape = x.shape
            self.itemsize = size = x.itemsize
            st = x.strides
            self.strides = tuple(s // size for s in st)
            if any(s % size for s in st):
                raise ValueError(f"{what} has strides {st} that are not whole elements")
            self.dtype = x.dtype
        else:  # a torch tensor
            if x.device.type != "cpu":
                raise ValueError(f"{what} is on {x.device}: the compiled kernels take CPU memory")
            self.ptr = x.data_ptr()
            self.shape = tuple(x.shape)
            self.strides = x.stride()
            self.itemsize = x.element_size()
            self.dtype = _TORCH_DTYPES[x.dtype]
            if self.dtype is None:
                raise TypeError(f"{what} has dtype {x.dtype}, which the compiled kernels do not take")
        if self.strides and min(self.strides) < 0:
            raise ValueError(f"{what} has negative strides {self.strides} (a flipped view): copy it first")
        self.base = x  # keeps the memory alive for the call


def _torch_dtypes():
    try:
        import torch
    except ImportError:
        return {}
    return {torch.int8: np.dtype(np.int8), torch.int16: np.dtype(np.int16), torch.uint8: np.dtype(np.uint8),
            torch.float32: np.dtype(np.float32), torch.uint16: np.dtype(np.uint16),
            torch.bfloat16: np.dtype(np.uint16)}


class _LazyDtypes(dict):
    def __missing__(self, key):
        self.update(_torch_dtypes())
        if key not in self:
            self[key] = None
        return self[key]


_TORCH_DTYPES = _LazyDtypes()
_CODES = (np.dtype(np.int8), np.dtype(np.int16))


def _check(rc: int, what: str) -> None:
    if rc == -1:
        raise MemoryError(f"{what}: the compiled kernel could not allocate its buffers")
    if rc != 0:
        raise ValueError(f"{what}: the compiled kernel refused its arguments (error {rc})")


class Compiled:
    """The kernels of one compiled variant (``build.VARIANTS``)."""

    def __init__(self, variant: str):
        self.name = variant
        self._lib = None

    @property
    def lib(self):
        if self._lib is None:
            self._lib = build.load(self.name)
            if self._lib is None:
                raise RuntimeError(f"the {self.name} kernels are not available: {build.why(self.name)}")
        return self._lib

    def available(self) -> bool:
        return build.load(self.name) is not None

    def why(self) -> str | None:
        return build.why(self.name)

    # ---- the product ------------------------------------------------------------------

    def gemm(self, a, fa, b, fb, out, *, c=None, bias=None, table=None, threads: int = 1,
             qmax_a: int | None = None, qmax_b: int | None = None) -> None:
        """``out`` = the product's results of stored operands ``a`` = (codes, exponents) in
        ``fa`` and ``b`` in ``fb`` (matrices, or stacks of them with a leading axis), as
        ``hbfp_gemm`` computes them: ``c`` to start from, ``bias``, ``table`` (an activation's
        65,536 bf16 patterns as uint16), ``out`` float32 or 16-bit (bf16 patterns) of the
        product's shape. ``qmax_*``: the largest code magnitude the operand may hold (default
        the format's; a raw operand may hold one more, which the kernel allows for)."""
        (ca, ea), (cb, eb) = a, b
        ma, mb = Mem(ca, "A's codes"), Mem(cb, "B's codes")
        xa, xb = Mem(ea, "A's exponents"), Mem(eb, "B's exponents")
        mo = Mem(out, "the output")
        batched = len(ma.shape) == 3
        if len(ma.shape) not in (2, 3) or len(mb.shape) != len(ma.shape) or len(xa.shape) != len(ma.shape) \
                or len(xb.shape) != len(ma.shape) or len(mo.shape) != len(ma.shape):
            raise ValueError("gemm takes matrices, or stacks of them (a leading axis) throughout")
        for m_, what in ((ma, "A's codes"), (mb, "B's codes")):
            if m_.dtype not in _CODES:
                raise TypeError(f"{what} must be int8 or int16, got {m_.dtype}")
        for m_, what in ((xa, "A's exponents"), (xb, "B's exponents")):
            if m_.dtype != np.uint8:
                raise TypeError(f"{what} must be uint8 E8M0 codes, got {m_.dtype}")
        nb = ma.shape[0] if batched else 1
        (m, k), (k2, n) = ma.shape[-2:], mb.shape[-2:]
        if k != k2 or fa.tile[1] != fb.tile[0]:
            raise ValueError(f"gemm: A {ma.shape} in tiles {fa.tile} and B {mb.shape} in tiles {fb.tile} do not "
                             "agree along K")
        if batched and (mb.shape[0] != nb or xa.shape[0] != nb or xb.shape[0] != nb or mo.shape[0] != nb):
            raise ValueError("gemm: the stacks differ in length")
        th, tk = fa.tile
        tw = fb.tile[1]
        if xa.shape[-2:] != (-(-m // th), -(-k // tk)) or xb.shape[-2:] != (-(-k // tk), -(-n // tw)):
            raise ValueError(f"gemm: exponents {xa.shape} and {xb.shape} do not match the tiles of the codes")
        if mo.shape[-2:] != (m, n) or mo.dtype not in (np.dtype(np.float32), np.dtype(np.uint16)):
            raise ValueError(f"gemm: out must be float32 or bf16 of shape {(m, n)}, got {mo.dtype} {mo.shape}")
        if n > 1 and mo.strides[-1] != 1:
            raise ValueError("gemm: out must have contiguous rows")
        oa = capi.Operand(ma.ptr, ma.itemsize, ma.strides[-2], ma.strides[-1], ma.strides[0] if batched else 0,
                          xa.ptr, xa.strides[-2], xa.strides[-1], xa.strides[0] if batched else 0,
                          th, tk, fa.frac_bits, fa.qmax if qmax_a is None else qmax_a)
        ob = capi.Operand(mb.ptr, mb.itemsize, mb.strides[-2], mb.strides[-1], mb.strides[0] if batched else 0,
                          xb.ptr, xb.strides[-2], xb.strides[-1], xb.strides[0] if batched else 0,
                          tk, tw, fb.frac_bits, fb.qmax if qmax_b is None else qmax_b)
        cptr = ldc = bsc = 0
        if c is not None:
            mc = Mem(c, "C")
            if mc.dtype != np.float32 or mc.shape != mo.shape or (n > 1 and mc.strides[-1] != 1):
                raise ValueError(f"gemm: C must be float32 of shape {mo.shape} with contiguous rows")
            cptr, ldc, bsc = mc.ptr, mc.strides[-2], mc.strides[0] if batched else 0
        bptr = 0
        if bias is not None:
            mbias = Mem(bias, "the bias")
            if mbias.dtype != np.float32 or mbias.shape != (n,) or (n > 1 and mbias.strides[0] != 1):
                raise ValueError(f"gemm: the bias must be {n} contiguous float32 values")
            bptr = mbias.ptr
        tptr = 0
        if table is not None:
            mt = Mem(table, "the activation table")
            if mt.shape != (65536,) or mt.itemsize != 2 or mt.strides[0] != 1:
                raise ValueError("gemm: the activation table must be 65,536 contiguous 16-bit patterns")
            tptr = mt.ptr
        oo = capi.Output(mo.ptr, mo.strides[-2], mo.strides[0] if batched else 0, int(mo.dtype == np.uint16),
                         cptr, ldc, bsc, bptr, tptr)
        _check(self.lib.hbfp_gemm(ctypes.addressof(oa), ctypes.addressof(ob), ctypes.addressof(oo), nb, m, n, k,
                                  threads), "gemm")

    # ---- the lean paths of torch tensors ---------------------------------------------------

    def gemm_tensor(self, ca, ea, fa, cb, eb, fb, out, threads: int, qmax_a: int, qmax_b: int) -> None:
        """``gemm`` of CPU torch tensors the caller has checked (codes int8/int16 with
        nonnegative strides, exponents uint8 matching the tiles, ``out`` float32 or bf16 with
        contiguous rows, matrices or stacks alike): no C, bias or activation. The products of a
        training step come by the hundred; this path spends a few microseconds on each (one
        vector of arguments, ``capi.vector_source``)."""
        batched = ca.dim() == 3
        sa, sb, xa, xb, so = ca.stride(), cb.stride(), ea.stride(), eb.stride(), out.stride()
        th, tk = fa.tile
        shape = ca.shape
        v = array.array("q", (
            ca.data_ptr(), ca.element_size(), sa[-2], sa[-1], sa[0] if batched else 0, ea.data_ptr(), xa[-2], xa[-1],
            xa[0] if batched else 0, th, tk, fa.frac_bits, qmax_a,
            cb.data_ptr(), cb.element_size(), sb[-2], sb[-1], sb[0] if batched else 0, eb.data_ptr(), xb[-2], xb[-1],
            xb[0] if batched else 0, tk, fb.tile[1], fb.frac_bits, qmax_b,
            out.data_ptr(), so[-2], so[0] if batched else 0, int(out.element_size() == 2), 0, 0, 0, 0, 0,
            shape[0] if batched else 1, shape[-2], cb.shape[-1], shape[-1], threads))
        rc = self.lib.hbfp_gemm_v(v.buffer_info()[0])
        if rc:
            _check(rc, "gemm")

    def conv_runs(self, ca, ea, fa, cb, eb, fb, run_images: int, bias, geometry: tuple, out, fold: bool,
                  threads: int, qmax_a: int, qmax_b: int) -> None:
        """``hbfp_conv_runs`` of CPU torch tensors the caller has checked: ``ca``/``ea`` op(W)'s
        codes and exponents (m x k), ``cb``/``eb`` the positions' (k x N*OH*OW, a transposed
        view), ``geometry`` ``conv_geometry``'s, ``out`` (contiguous fp32) the image's gradient
        (``fold``) or the N x OUT x OH x OW output, ``bias`` OUT fp32 values or None."""
        v = array.array("q", (
            *self._operand_slots(ca, ea, fa, qmax_a), *self._operand_slots(cb, eb, fb, qmax_b),
            ca.shape[0], ca.shape[1], run_images, 0 if bias is None else bias.data_ptr(), *geometry, out.data_ptr(),
            int(fold), threads))
        rc = self.lib.hbfp_conv_runs_v(v.buffer_info()[0])
        if rc:
            _check(rc, "conv_runs")

    def quantize_tensor(self, x, fmt, key: int, codes, exps, threads: int) -> None:
        """``quantize`` of a CPU fp32 torch tensor the caller has checked (a matrix or a stack,
        any nonnegative strides) into new ``codes`` and ``exps`` (contiguous)."""
        st, cst, est = x.stride(), codes.stride(), exps.stride()
        nd = x.dim()
        th, tw = fmt.tile
        v = array.array("q", (
            x.data_ptr(), st[-2], st[-1], x.shape[-2], x.shape[-1], th, tw, fmt.mantissa_bits, ROUNDINGS[fmt.rounding], key,
            codes.data_ptr(), codes.element_size(), cst[-2], exps.data_ptr(), est[-2], x.shape[0] if nd == 3 else 1,
            st[0] if nd == 3 else 0, cst[0] if nd == 3 else 0, est[0] if nd == 3 else 0, threads))
        rc = self.lib.hbfp_quantize_v(v.buffer_info()[0])
        if rc:
            _check(rc, "quantize")

    # ---- quantization ---------------------------------------------------------------------

    def quantize(self, x, fmt, key: int | None, codes, exps, *, threads: int = 1) -> None:
        """``bfp.quantize`` of an fp32 matrix ``x`` (any nonnegative strides) into ``codes`` (int8 or
        int16 of its shape, contiguous rows) and ``exps`` (uint8, one per tile, contiguous rows);
        or of a stack of them (a leading axis: each quantized alone, its stochastic positions
        those of the stack as one matrix, every matrix padded to whole tiles). ``key``: the
        stochastic generator's key (``bfp._key(seed)``)."""
        mx, mc, me = Mem(x, "x"), Mem(codes, "the codes"), Mem(exps, "the exponents")
        nd = len(mx.shape)
        if mx.dtype != np.float32 or nd not in (2, 3):
            raise ValueError("quantize takes an fp32 matrix (or a stack of them)")
        m, n = mx.shape[-2:]
        nb = mx.shape[0] if nd == 3 else 1
        th, tw = fmt.tile
        if mc.shape != mx.shape or mc.dtype != fmt.code_dtype or me.shape != (*mx.shape[:-2], -(-m // th), -(-n // tw)) \
                or (n > 1 and mc.strides[-1] != 1) or (me.shape[-1] > 1 and me.strides[-1] != 1):
            raise ValueError("quantize: codes or exponents of the wrong shape, type or layout")
        if fmt.rounding == "stochastic" and key is None:
            raise ValueError("stochastic rounding needs the generator's key")
        bs = (lambda m_: m_.strides[0] if nd == 3 else 0)
        _check(self.lib.hbfp_quantize(mx.ptr, mx.strides[-2], mx.strides[-1], m, n, th, tw, fmt.mantissa_bits, ROUNDINGS[fmt.rounding],
                                      int(key or 0), mc.ptr, mc.itemsize, mc.strides[-2], me.ptr, me.strides[-2], nb,
                                      bs(mx), bs(mc), bs(me), threads), "quantize")

    def dequantize(self, codes, exps, fmt, out, *, threads: int = 1) -> None:
        mc, me, mo = Mem(codes, "the codes"), Mem(exps, "the exponents"), Mem(out, "out")
        m, n = mc.shape
        th, tw = fmt.tile
        if mc.dtype not in _CODES or (n > 1 and mc.strides[1] != 1) or me.dtype != np.uint8 \
                or me.shape != (-(-m // th), -(-n // tw)) or (me.shape[1] > 1 and me.strides[1] != 1):
            raise ValueError("dequantize: codes (contiguous rows) and exponents do not match")
        if mo.shape != (m, n) or mo.dtype != np.float32 or (n > 1 and mo.strides[1] != 1) or mo.strides[0] != n:
            raise ValueError("dequantize: out must be a contiguous float32 matrix of the codes' shape")
        _check(self.lib.hbfp_dequantize(mc.ptr, mc.itemsize, m, n, mc.strides[0], me.ptr, me.strides[0], th, tw,
                                        fmt.frac_bits, mo.ptr, threads), "dequantize")

    # ---- convolutions ---------------------------------------------------------------------

    def im2col(self, x, geometry: tuple, out, *, threads: int = 1) -> None:
        _check(self.lib.hbfp_im2col(Mem(x, "x").ptr, *geometry, Mem(out, "out").ptr, threads), "im2col")

    def im2col_quantize(self, x, geometry: tuple, fmt, key: int, codes, exps, *, threads: int = 1) -> None:
        """``quantize`` of ``im2col(x)`` into codes and exponents (contiguous, the patch
        matrix's shape and tiles), without the matrix."""
        th, tw = fmt.tile
        v = array.array("q", (Mem(x, "x").ptr, *geometry, th, tw, fmt.mantissa_bits, ROUNDINGS[fmt.rounding], key,
                              Mem(codes, "codes").ptr, codes.itemsize if isinstance(codes, np.ndarray)
                              else codes.element_size(), Mem(exps, "exps").ptr, threads))
        _check(self.lib.hbfp_im2col_quantize_v(v.buffer_info()[0]), "im2col_quantize")

    def transpose(self, x, out, *, threads: int = 1) -> None:
        """``out[b] = x[b].T`` of a contiguous stack of fp32 matrices into a contiguous ``out``."""
        mx, mo = Mem(x, "x"), Mem(out, "out")
        nb, m, n = mx.shape
        if mx.dtype != np.float32 or mo.dtype != np.float32 or mo.shape != (nb, n, m) \
                or mx.strides != (m * n, n, 1) or mo.strides != (m * n, m, 1):
            raise ValueError("transpose takes a contiguous fp32 stack and a contiguous out of the transposed shape")
        _check(self.lib.hbfp_transpose(mx.ptr, nb, m, n, mo.ptr, threads), "transpose")

    def lstm_cell(self, p, xp, c_prev, acts, c, tc, h) -> None:
        """The LSTM cell forward (src/cell.c) on CPU fp32 torch tensors the caller has checked
        (contiguous, rows x 4H and rows x H)."""
        rows, hid = c.shape
        _check(self.lib.hbfp_lstm_cell(p.data_ptr(), xp.data_ptr(), c_prev.data_ptr(), rows, hid, acts.data_ptr(),
                                       c.data_ptr(), tc.data_ptr(), h.data_ptr()), "lstm_cell")

    def lstm_cell_backward(self, acts, c_prev, tc, dy, dh, dc, dgates, dc_prev) -> None:
        rows, hid = tc.shape
        _check(self.lib.hbfp_lstm_cell_backward(acts.data_ptr(), c_prev.data_ptr(), tc.data_ptr(), dy.data_ptr(),
                                                dh.data_ptr(), dc.data_ptr(), rows, hid, dgates.data_ptr(),
                                                dc_prev.data_ptr()), "lstm_cell_backward")

    @staticmethod
    def _operand_slots(codes, exps, fmt, qmax: int) -> tuple:
        """An operand's slots of a vector entry (``capi.OPERAND``): CPU torch codes and exponents."""
        sc, se = codes.stride(), exps.stride()
        return (codes.data_ptr(), codes.element_size(), sc[0], sc[1], 0, exps.data_ptr(), se[0], se[1], 0, *fmt.tile,
                fmt.frac_bits, qmax)

    def lstm_steps(self, w, fmt, qmax: int, xp, h0, c0, state_fmt, keys, acts, c, tc, h, threads: int) -> None:
        """``hbfp_lstm_steps`` (src/cell.c) of CPU torch tensors the caller has checked: ``w``
        W_hh^T's (codes, exponents) in ``fmt``, ``xp``, ``h0``, ``c0`` and the outputs
        contiguous fp32, ``state_fmt`` (mantissa bits, rounding) and ``keys`` (one per step)
        how each step's state is quantized."""
        steps, rows, g = xp.shape
        kv = array.array("I", keys)
        v = array.array("q", (*self._operand_slots(*w, fmt, qmax), xp.data_ptr(), h0.data_ptr(), c0.data_ptr(), steps,
                              rows, g // 4, state_fmt.mantissa_bits, ROUNDINGS[state_fmt.rounding], kv.buffer_info()[0],
                              acts.data_ptr(), c.data_ptr(), tc.data_ptr(), h.data_ptr(), threads))
        _check(self.lib.hbfp_lstm_steps_v(v.buffer_info()[0]), "lstm_steps")

    def lstm_steps_backward(self, wt, fmt, qmax: int, acts, c0, c, tc, dy, need_h0: bool, state_fmt, keys, dh, dc,
                            dgates, threads: int) -> None:
        """``hbfp_lstm_steps_backward`` (src/cell.c) of CPU torch tensors the caller has
        checked: ``wt`` W_hh's (codes, exponents) as the forward read them, ``dh`` and ``dc``
        (read, then written: the gradients of h0 and c0), ``keys`` one per product."""
        steps, rows, g = acts.shape
        kv = array.array("I", keys)
        v = array.array("q", (*self._operand_slots(*wt, fmt, qmax), acts.data_ptr(), c0.data_ptr(), c.data_ptr(),
                              tc.data_ptr(), dy.data_ptr(), steps, rows, g // 4, int(need_h0),
                              state_fmt.mantissa_bits, ROUNDINGS[state_fmt.rounding], kv.buffer_info()[0],
                              dh.data_ptr(), dc.data_ptr(), dgates.data_ptr(), threads))
        _check(self.lib.hbfp_lstm_steps_backward_v(v.buffer_info()[0]), "lstm_steps_backward")

    def col2im(self, cols, geometry: tuple, out, *, threads: int = 1) -> None:
        """``col2im`` of the patch matrix ``cols`` at its strides (row-major or transposed)."""
        mc = Mem(cols, "cols")
        _check(self.lib.hbfp_col2im(mc.ptr, mc.strides[0], mc.strides[1], *geometry, Mem(out, "out").ptr, threads),
               "col2im")
