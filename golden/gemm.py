"""The BFP matrix product, bit for bit (docs/numerics.md, section 3).

``C = act(A @ B + bias)``: for every output, an exact integer partial sum per K-tile, scaled
by the two tile exponents into fp32 (RNE/FTZ), accumulated in fp32 in ascending K-tile order,
then the bias, the activation and the output format (``epilogue``: the last two, on their
own, for a host that applies what a device left out).

Two paths of the same contract, chosen per call:
- ``_accumulate_exact``: integer partial sums through float64 BLAS (exact below 2**53),
  explicit rounding and flushing after every step. Correct for every input.
- ``_accumulate_fast``: the codes scaled by their tiles' powers of two are exact fp32
  operands, each K-tile's product of them *is* ``p`` exactly under checked preconditions (all
  partial sums are integers times one power of two, below 2**24), and every sum stays a
  multiple of 2**-126 so that no flush can ever be needed. Used when those preconditions
  hold, which is the ordinary case in training: compiled for this CPU where a C compiler is
  present (``hbfp.golden.native``), else one fp32 BLAS call per K-tile.
"""

from __future__ import annotations


import numpy as np
from threadpoolctl import ThreadpoolController

from . import bf16, native
from .bfp import _WORKERS, EXP_BIAS, EXP_NAN, BFPTensor, Format, _run_chunks, quantize

__all__ = ["gemm", "epilogue", "partial_sums", "normalize", "OUTPUTS"]

#: Output formats besides a BFP ``Format``.
OUTPUTS = ("fp32", "bf16")

# Exponent of the smallest fp32 normal, and of fp32's largest power of two.
_MIN_NORMAL_EXP = -126
_MAX_EXP = 127


def _check_operands(a: BFPTensor, b: BFPTensor):
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, BFPTensor):
            raise TypeError(f"gemm operand {name} must be a BFPTensor (see hbfp.golden.quantize), got {type(t).__name__}")
        if t.codes.ndim != 2:
            raise ValueError(f"gemm operand {name} must be a matrix, got shape {t.shape}")
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"gemm shapes do not agree: A is {m}x{k}, B is {k2}x{n}")
    if a.fmt.tile[1] != b.fmt.tile[0]:
        raise ValueError(
            f"the tiles of A and B must agree along K: A's tile {a.fmt.tile} has {a.fmt.tile[1]} "
            f"columns, B's tile {b.fmt.tile} has {b.fmt.tile[0]} rows (store an operand "
            "transposed, e.g. MXINT8 B as N x K with transpose_b=True)"
        )
    return m, k, n


def _pad_k(codes: np.ndarray, kp: int, axis: int) -> np.ndarray:
    pad = kp - codes.shape[axis]
    if pad == 0:
        return codes
    widths = [(0, 0), (0, 0)]
    widths[axis] = (0, pad)
    return np.pad(codes, widths)


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
    if native.available():
        # The same additions in the same order, compiled for this CPU (golden/native.c).
        native.gemm_codes(a.codes, a.exponents, a.fmt, b.codes, b.exponents, b.fmt, acc)
        return acc
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


def partial_sums(a_codes: np.ndarray, b_codes: np.ndarray, tk: int) -> np.ndarray:
    """The MAC array's results: for every K-tile ``kt``, the exact integer sums
    ``sum(a[i, k] * b[k, j] for k in kt)``, shape (KT, M, N), int64. K is padded with zeros
    to whole tiles of ``tk``."""
    m, k = a_codes.shape
    n = b_codes.shape[1]
    kt_count = -(-k // tk)
    qa = _pad_k(np.asarray(a_codes), kt_count * tk, 1).astype(np.float64)
    qb = _pad_k(np.asarray(b_codes), kt_count * tk, 0).astype(np.float64)
    out = np.empty((kt_count, m, n), dtype=np.int64)
    for kt in range(kt_count):
        ks = slice(kt * tk, (kt + 1) * tk)
        out[kt] = qa[:, ks] @ qb[ks, :]  # exact in float64 below 2**53
    return out


def normalize(s, exp_a, exp_b, mantissa_bits_a: int = 8, mantissa_bits_b: int = 8) -> np.ndarray:
    """The normalizer: an integer K-tile sum ``s`` and the E8M0 exponent codes of its two
    tiles to the fp32 ``p = s * 2**(E_A + E_B - (m_A - 2) - (m_B - 2))`` (RNE, FTZ after
    rounding, overflow to inf; an integer zero is +0; NaN when either code is 0xFF)."""
    s = np.asarray(s, dtype=np.int64)
    ea = np.asarray(exp_a, dtype=np.int32)
    eb = np.asarray(exp_b, dtype=np.int32)
    scale = ea + eb - 2 * EXP_BIAS - (mantissa_bits_a - 2) - (mantissa_bits_b - 2)
    # |s| < 2**53 and the scale lies in [-284, 254]: the fp64 product is exact.
    p = bf16.round_f32(np.ldexp(s.astype(np.float64), scale))
    return np.where((ea == EXP_NAN) | (eb == EXP_NAN), np.float32(np.nan), p).astype(np.float32)


def _accumulate_exact(a: BFPTensor, b: BFPTensor, acc: np.ndarray, tk: int, kt_count: int) -> np.ndarray:
    th, tw = a.fmt.tile[0], b.fmt.tile[1]
    m, n = acc.shape
    sums = partial_sums(a.codes, b.codes, tk)
    for kt in range(kt_count):
        # Exponent codes of the two tiles that meet in each output, for this K-tile.
        ea = np.repeat(a.exponents[:, kt], th)[:m, None]
        eb = np.repeat(b.exponents[kt, :], tw)[None, :n]
        acc = bf16.add_f32(acc, normalize(sums[kt], ea, eb, a.fmt.mantissa_bits, b.fmt.mantissa_bits))
    return acc


def _activation(name: str | None, leaky_shift: int | None = None):
    """The bf16 unit called ``name`` (None for None): ``hbfp.golden.activations.get``, with
    ``leaky_relu``'s slope exponent ``leaky_shift`` (None: the default ``LEAKY_SHIFT``)."""
    if name is None:
        return None
    from . import activations

    return activations.get(name, leaky_shift=leaky_shift)


def epilogue(acc, activation: str | None = None, out: str | Format = "fp32", seed: int | None = None, *,
             leaky_shift: int | None = None):
    """The end of ``gemm`` after the bias, bit for bit: the activation, then the output format.

    ``acc``: the fp32 sums with the bias added (a float32 array, ``C + A @ B + bias`` as
    ``gemm`` computes it). ``activation``: a name from ``hbfp.golden.activations.UNARY`` or
    None; it is applied in bf16 (``acc`` is rounded to bf16 first, RNE/FTZ, so it sees
    ``bf16.from_f32(acc)`` only), and its bf16 result is widened to fp32 for an fp32 or BFP
    output. ``leaky_shift``: ``leaky_relu``'s slope exponent (a device's; None: the default
    ``activations.LEAKY_SHIFT``, as ``gemm`` uses). ``out``: ``"fp32"`` (float32 array),
    ``"bf16"`` (``ml_dtypes.bfloat16`` array) or a BFP ``Format`` (a BFPTensor quantized
    whole, ``seed`` for stochastic rounding).

    A device without an activation unit (or without its output quantizer) sends the sums
    and the host finishes with this (``hbfp.host.Device.gemm``)."""
    if not (isinstance(out, Format) or out in OUTPUTS):
        raise ValueError(f"out must be one of {OUTPUTS} or a BFP Format, got {out!r}")
    act = _activation(activation, leaky_shift)
    acc = np.asarray(acc)
    if acc.dtype != np.float32:
        raise TypeError(f"acc must be float32 (the fp32 sums), got {acc.dtype}")
    if act is not None:
        y = act(bf16.from_f32(acc))
        if out == "bf16":
            return bf16.to_dtype(y)
        acc = bf16.to_f32(y)
    elif out == "bf16":
        return bf16.to_dtype(bf16.from_f32(acc))
    if isinstance(out, Format):
        return quantize(acc, out, seed=seed)
    return acc


def gemm(
    a: BFPTensor,
    b: BFPTensor,
    *,
    c=None,
    bias=None,
    activation: str | None = None,
    out: str | Format = "fp32",
    transpose_a: bool = False,
    transpose_b: bool = False,
    seed: int | None = None,
):
    """``act(op(A) @ op(B) + C + bias)`` in HBFP, bit for bit as the device computes it.

    ``a``, ``b``: BFPTensors; ``transpose_a``/``transpose_b`` use the transposed matrix
    (the tiles transpose with it; square tiles are reused unchanged). The tiles must agree
    along K. ``c``: an fp32 M x N matrix to accumulate onto (``acc`` starts there instead
    of +0). ``bias``: fp32, N values, added after the K-tiles. ``activation``: a name from
    ``hbfp.golden.activations`` (applied in bf16: the fp32 sum is rounded to bf16 first).
    ``out``: ``"fp32"`` (float32 array), ``"bf16"`` (``ml_dtypes.bfloat16`` array) or a
    BFP ``Format`` (a BFPTensor; ``seed`` for stochastic rounding).
    """
    if transpose_a:
        a = a.transpose() if isinstance(a, BFPTensor) else a
    if transpose_b:
        b = b.transpose() if isinstance(b, BFPTensor) else b
    m, k, n = _check_operands(a, b)
    if not (isinstance(out, Format) or out in OUTPUTS):
        raise ValueError(f"out must be one of {OUTPUTS} or a BFP Format, got {out!r}")
    _activation(activation)  # an unknown name fails before the product

    tk = a.fmt.tile[1]
    kt_count = -(-k // tk)

    if c is None:
        acc = np.zeros((m, n), dtype=np.float32)
    else:
        c = np.asarray(c)
        if c.shape != (m, n):
            raise ValueError(f"c must have the output's shape {(m, n)}, got {c.shape}")
        if c.dtype != np.float32:
            raise TypeError(f"c must be float32 (the fp32 accumulator), got {c.dtype}")
        acc = bf16.flush_f32(c).copy()
    if bias is not None:
        bias = np.asarray(bias)
        if bias.shape != (n,):
            raise ValueError(f"bias must have N = {n} values, got shape {bias.shape}")
        if bias.dtype != np.float32:
            raise TypeError(f"bias must be float32, got {bias.dtype}")

    if kt_count and _fast_path_ok(a, b, tk, c):
        # -0 + p and +0 + p agree on every p the contract can produce (p = +0 for a zero). A
        # signalling NaN in C (a raw WRITE may hold one) stays a NaN: IEEE arithmetic quiets it,
        # which is the contract's NaN by class, and its "invalid" flag means nothing here.
        with np.errstate(invalid="ignore"):
            acc += np.float32(0)
            acc = _accumulate_fast(a, b, acc, tk, kt_count)
    else:
        acc = _accumulate_exact(a, b, acc, tk, kt_count)

    # A NaN tile on either side makes every p it meets NaN, and NaN absorbs all later sums.
    nan_rows = a.expand(a.nan_tiles).any(axis=1)
    nan_cols = b.expand(b.nan_tiles).any(axis=0)
    if nan_rows.any() or nan_cols.any():
        acc = np.where(nan_rows[:, None] | nan_cols[None, :], np.float32(np.nan), acc)

    if bias is not None:
        acc = bf16.add_f32(acc, bias[None, :])

    return epilogue(acc, activation, out, seed)
