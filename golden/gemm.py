"""The BFP matrix product, bit for bit (docs/numerics.md, section 3).

``C = act(A @ B + bias)``: for every output, an exact integer partial sum per K-tile, scaled
by the two tile exponents into fp32 (RNE/FTZ), accumulated in fp32 in ascending K-tile order,
then the bias, the activation and the output format (``epilogue``: the last two, on their
own, for a host that applies what a device left out).

This module is the reference: integer partial sums through float64 BLAS (exact below 2**53),
explicit rounding and flushing after every step, correct for every input and slow. ``gemm``
with ``impl="reference"`` runs it; by default (``impl=None``) ``gemm`` runs the fastest
implementation the registry ``hbfp.kernels`` has for this machine (integer kernels compiled
for its CPU, NumPy BLAS, torch), every one of which is tested equal to this one bit for bit.
"""

from __future__ import annotations


import numpy as np

from . import bf16
from .bfp import EXP_BIAS, EXP_NAN, BFPTensor, Format, quantize

__all__ = ["gemm", "epilogue", "partial_sums", "normalize", "OUTPUTS"]

#: Output formats besides a BFP ``Format``.
OUTPUTS = ("fp32", "bf16")

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
    impl: str | None = None,
):
    """``act(op(A) @ op(B) + C + bias)`` in HBFP, bit for bit as the device computes it.

    ``a``, ``b``: BFPTensors; ``transpose_a``/``transpose_b`` use the transposed matrix
    (the tiles transpose with it; square tiles are reused unchanged). The tiles must agree
    along K. ``c``: an fp32 M x N matrix to accumulate onto (``acc`` starts there instead
    of +0). ``bias``: fp32, N values, added after the K-tiles. ``activation``: a name from
    ``hbfp.golden.activations`` (applied in bf16: the fp32 sum is rounded to bf16 first).
    ``out``: ``"fp32"`` (float32 array), ``"bf16"`` (``ml_dtypes.bfloat16`` array) or a
    BFP ``Format`` (a BFPTensor; ``seed`` for stochastic rounding). ``impl``: ``"reference"``
    (this module's arithmetic), a name of ``hbfp.kernels.IMPLS``, or None: the registry's
    fastest for this machine (the same bits).
    """
    if transpose_a:
        a = a.transpose() if isinstance(a, BFPTensor) else a
    if transpose_b:
        b = b.transpose() if isinstance(b, BFPTensor) else b
    m, k, n = _check_operands(a, b)
    if not (isinstance(out, Format) or out in OUTPUTS):
        raise ValueError(f"out must be one of {OUTPUTS} or a BFP Format, got {out!r}")
    _activation(activation)  # an unknown name fails before the product
    if c is not None:
        c = np.asarray(c)
        if c.shape != (m, n):
            raise ValueError(f"c must have the output's shape {(m, n)}, got {c.shape}")
        if c.dtype != np.float32:
            raise TypeError(f"c must be float32 (the fp32 accumulator), got {c.dtype}")
    if bias is not None:
        bias = np.asarray(bias)
        if bias.shape != (n,):
            raise ValueError(f"bias must have N = {n} values, got shape {bias.shape}")
        if bias.dtype != np.float32:
            raise TypeError(f"bias must be float32, got {bias.dtype}")
    if impl != "reference":
        from hbfp import kernels

        # the sums (and a bf16 output, and the activation) from the registry; a BFP output is
        # quantized here
        acc = kernels.gemm(a, b, c=c, bias=bias, activation=activation, out="fp32" if isinstance(out, Format) else out,
                           impl=impl)
        if out == "bf16":
            return bf16.to_dtype(acc)
        return quantize(acc, out, seed=seed) if isinstance(out, Format) else acc
    return epilogue(reference_sums(a, b, c=c, bias=bias), activation, out, seed)


def reference_sums(a: BFPTensor, b: BFPTensor, *, c=None, bias=None) -> np.ndarray:
    """The fp32 sums ``C + A @ B + bias`` of ``gemm`` (before its epilogue) by this module's
    arithmetic: every K-tile's exact integer sum (float64 BLAS), normalized and added in
    K-tile order, each step rounded and flushed as the contract says."""
    m, k, n = _check_operands(a, b)
    tk = a.fmt.tile[1]
    kt_count = -(-k // tk)
    acc = np.zeros((m, n), dtype=np.float32) if c is None else bf16.flush_f32(np.asarray(c, np.float32)).copy()
    if kt_count and m and n:
        acc = _accumulate_exact(a, b, acc, tk, kt_count)
    if bias is not None:
        acc = bf16.add_f32(acc, np.asarray(bias, np.float32)[None, :])
    return acc
