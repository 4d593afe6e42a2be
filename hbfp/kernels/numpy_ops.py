"""The registry's ``numpy`` product: NumPy fp32 BLAS on the codes scaled by their tiles' powers
of two, for a machine without a C compiler.

The scaled codes are exact fp32 operands, and each K-tile's product of them *is* ``p`` exactly
under checked preconditions (all partial sums are integers times one power of two, below
2**24, and every sum stays a multiple of 2**-126 so that no flush can ever be needed): one
batched fp32 product per block of K-tiles, then the K-tiles' additions in order. Outside the
preconditions the reference (``hbfp.golden.gemm``) computes the product.
"""

from __future__ import annotations

import numpy as np
from threadpoolctl import ThreadpoolController

from hbfp.golden import bf16
from hbfp.golden.bfp import _WORKERS, EXP_NAN, BFPTensor, _run_chunks

__all__ = ["gemm_sums"]

# Exponent of the smallest fp32 normal, and of fp32's largest power of two.
_MIN_NORMAL_EXP = -126
_MAX_EXP = 127


def _tiles_with_codes(t: BFPTensor) -> np.ndarray:
    """Per tile (the shape of ``exponents``): whether any of its codes is nonzero."""
    th, tw = t.fmt.tile
    tr, tc = t.exponents.shape
    codes = t.codes
    if codes.shape != (tr * th, tc * tw):
        codes = np.zeros((tr * th, tc * tw), dtype=t.codes.dtype)
        codes[: t.shape[0], : t.shape[1]] = t.codes
    # The OR of the codes' bits, read as the widest words that a tile's row is a whole
    # number of: over the tile's rows, then across its words (a few times faster than any()).
    width = tw * codes.itemsize
    word = next(w for w in (np.uint64, np.uint32, np.uint16, np.uint8) if width % np.dtype(w).itemsize == 0)
    u = np.ascontiguousarray(codes).view(word).reshape(tr, th, tc, width // np.dtype(word).itemsize)
    rows = np.bitwise_or.reduce(u, axis=1) if th > 1 else u[:, 0]
    if rows.shape[2] > 8:
        return np.bitwise_or.reduce(rows, axis=2) != 0
    bits = rows[..., 0].copy()
    for i in range(1, rows.shape[2]):
        bits |= rows[..., i]
    return bits != 0


def _nonzero_range(t: BFPTensor) -> tuple[int, int] | None:
    """(min, max) of ``E - frac_bits`` over the tiles that hold a nonzero, finite value."""
    live = (t.exponents != 0) & (t.exponents != EXP_NAN)
    empty = t.exponents == 0
    if empty.any():
        # Code 0 (E = -127) is what quantize gives a tile of zeros, but a BFPTensor or a raw
        # WRITE may hold nonzero codes under it: such a tile holds values (code steps of
        # 2**(-127 - frac_bits), below the fast path's range) and counts.
        live |= empty & _tiles_with_codes(t)
    if not live.any():
        return None
    s = t.scale_exponents()[live]
    return int(s.min()), int(s.max())


def _code_magnitude(t: BFPTensor) -> int:
    """The largest code magnitude the format allows, or that the codes hold if larger (a
    BFPTensor or a raw WRITE may hold -2**(m-1), one beyond ``qmax``)."""
    if t.codes.size == 0:
        return t.fmt.qmax
    return max(t.fmt.qmax, int(t.codes.max()), -int(t.codes.min()))


def _fast_path_ok(a: BFPTensor, b: BFPTensor, tk: int, c: np.ndarray | None) -> bool:
    # Every product term is code_a * code_b * 2**(sa + sb); a K-tile sum is an integer below
    # tk * qmax_a * qmax_b times that power of two (qmax, or a larger code a raw tensor
    # holds). In fp32 BLAS it is exact, whatever the summation order, when the integer fits
    # 24 bits, when 2**(sa + sb) is a normal number, and when the largest possible sum stays
    # below 2**128.
    qa, qb = _code_magnitude(a), _code_magnitude(b)
    bound = tk * qa * qb
    if bound >= 2**24:
        return False
    ra, rb = _nonzero_range(a), _nonzero_range(b)
    # Every scaled operand must be a finite fp32 (an inf would turn a zero product into NaN):
    # |code| * 2**s < 2**128. Always true for codes within qmax (s <= 127 - frac_bits).
    for r, q in ((ra, qa), (rb, qb)):
        if r is not None and r[1] + q.bit_length() > _MAX_EXP + 1:
            return False
    if ra is None or rb is None:
        return True  # every product is zero
    if ra[0] < _MIN_NORMAL_EXP or rb[0] < _MIN_NORMAL_EXP:
        return False  # a scaled operand would be subnormal (DAZ hardware would read 0)
    if ra[0] + rb[0] < _MIN_NORMAL_EXP:
        return False
    if ra[1] + rb[1] + int(bound).bit_length() > _MAX_EXP:
        return False
    if c is not None:
        # Sums stay multiples of 2**-126 (so never subnormal) only if C's values are: a
        # normal fp32 with exponent e is a multiple of 2**(e - 23).
        mag = np.abs(c[np.isfinite(c) & (c != 0)])
        if mag.size and mag.min() < 2.0 ** (_MIN_NORMAL_EXP + 23):
            return False
    return True


# The fast path holds all K-tile products of one block of outputs at once, sized to stay in
# a core's cache while they are summed; blocks are shared out to one worker per core, each
# running single-threaded BLAS (many small products scale badly on BLAS's own threads).
_FAST_BLOCK_BYTES = 1 << 20
_FAST_BLOCK_COLS = 1024
_FAST_PARALLEL_MIN = 1 << 20  # K-tile products (elements) below which one thread is faster
_blas: ThreadpoolController | None = None


def _run_blocks(work, blocks, parallel: bool) -> None:
    """``work`` on ``blocks``, shared out to ``bfp``'s thread per core with single-threaded BLAS."""
    global _blas
    if not parallel or _WORKERS == 1:
        work(blocks)
        return
    if _blas is None:
        _blas = ThreadpoolController()
    with _blas.limit(limits=1, user_api="blas"):
        _run_chunks(work, blocks, parallel=True)


def _scaled(t: BFPTensor, padded: tuple[int, int]) -> np.ndarray:
    """Codes times their tile's power of two, as fp32, padded to whole tiles (exact under
    the fast path's preconditions; tiles that hold only zeros get any normal scale). NaN
    tiles scale to 0: their outputs are replaced, and their codes (0 from quantize, anything
    in a raw tensor) must not overflow."""
    th, tw = t.fmt.tile
    out = np.zeros(padded, dtype=np.float32)
    out[: t.codes.shape[0], : t.codes.shape[1]] = t.codes
    scale = np.ldexp(np.float32(1), np.clip(t.scale_exponents(), _MIN_NORMAL_EXP, _MAX_EXP)).astype(np.float32)
    scale[t.nan_tiles] = 0
    tiles = out.reshape(padded[0] // th, th, padded[1] // tw, tw)
    tiles *= scale[:, None, :, None]
    return out


def _accumulate_fast(a: BFPTensor, b: BFPTensor, acc: np.ndarray, tk: int, kt_count: int) -> np.ndarray:
    m, n = acc.shape
    if m == 0 or n == 0:
        return acc  # no outputs (and no block of them to size)
    kp = kt_count * tk
    ma = a.exponents.shape[0] * a.fmt.tile[0]
    nb = b.exponents.shape[1] * b.fmt.tile[1]
    # Operands laid out K-tile-major: A as (KT, M, tk), B as (KT, tk, N).
    a_f = _scaled(a, (ma, kp))[:m]
    a_f = np.ascontiguousarray(a_f.reshape(m, kt_count, tk).transpose(1, 0, 2))
    b_f = _scaled(b, (kp, nb))[:, :n].reshape(kt_count, tk, n)
    cols = min(n, _FAST_BLOCK_COLS)
    rows = max(1, min(m, _FAST_BLOCK_BYTES // (4 * kt_count * cols)))
    blocks = [(r, c) for r in range(0, m, rows) for c in range(0, n, cols)]

    def work(my_blocks):
        p = np.empty((kt_count, rows, cols), dtype=np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            for r0, c0 in my_blocks:
                r1, c1 = min(m, r0 + rows), min(n, c0 + cols)
                pb = p[:, : r1 - r0, : c1 - c0]
                np.matmul(a_f[:, r0:r1], b_f[:, :, c0:c1], out=pb)  # every K-tile's p, exact
                np.add(pb[0], acc[r0:r1, c0:c1], out=pb[0])
                # A reduction over the outer axis adds in index order: acc + p0 + p1 + ...
                np.add.reduce(pb, axis=0, out=acc[r0:r1, c0:c1])

    _run_blocks(work, blocks, parallel=m * n * kt_count >= _FAST_PARALLEL_MIN)
    return acc


def gemm_sums(a: BFPTensor, b: BFPTensor, *, c=None, bias=None) -> np.ndarray:
    """``C + A @ B + bias`` (fp32 sums) of two BFPTensors, as ``hbfp.golden.gemm.reference_sums``."""
    from hbfp.golden.gemm import _check_operands, reference_sums

    m, k, n = _check_operands(a, b)
    tk = a.fmt.tile[1]
    kt_count = -(-k // tk)
    if not (kt_count and _fast_path_ok(a, b, tk, c)):
        return reference_sums(a, b, c=c, bias=bias)
    acc = np.zeros((m, n), dtype=np.float32) if c is None else bf16.flush_f32(np.asarray(c, np.float32)).copy()
    # -0 + p and +0 + p agree on every p of the fast route (p = +0 for a zero). A NaN in C stays
    # a NaN (IEEE arithmetic quiets it), made the contract's one NaN below.
    with np.errstate(invalid="ignore"):
        acc += np.float32(0)
        acc = _accumulate_fast(a, b, acc, tk, kt_count)
    # A NaN tile on either side makes every p it meets NaN, and NaN absorbs all later sums.
    nan_rows = a.expand(a.nan_tiles).any(axis=1)
    nan_cols = b.expand(b.nan_tiles).any(axis=0)
    if nan_rows.any() or nan_cols.any():
        acc = np.where(nan_rows[:, None] | nan_cols[None, :], np.float32(np.nan), acc)
    acc = bf16.canonical_nan_f32(acc)  # every sum went through an addition: its NaN is the one NaN
    if bias is not None:
        acc = bf16.add_f32(acc, np.asarray(bias, np.float32)[None, :])
    return acc
