"""The golden numerics as torch operations, computed where the tensors are (a CPU or a CUDA
device: the same code): the registry's ``torch`` implementations (``hbfp.kernels``), equal bit
for bit to ``hbfp.golden``'s NumPy functions of the same names (tests/test_kernels.py).

- ``quantize(x, fmt, seed)``: a matrix of floats to ``(codes, exponents)``, every rounding
  (stochastic with the generator of ``bfp.random_bits``, whose positions are the tile-major
  stream of ``bfp.stream_index``); ``requantize`` narrows codes in place of their tiles.
- ``gemm(a, b, ...)``: the product's fp32 sums (``C + A @ B + bias``; docs/numerics.md, section
  3): each K-tile's exact integer sum times its two tiles' powers of two is one fp32 product of
  scaled codes (exact under ``bfp``'s preconditions, checked here as the NumPy fast path checks
  them), added to the accumulator in K-tile order by batched torch products (``impl="fp32"``) or
  ``torch._int_mm``'s exact int32 sums (``"int8"``, a CPU whose torch has it); inputs outside
  those preconditions go through the NumPy reference.
- ``epilogue(acc, activation, out, seed)``: the activation as a table of the bf16 unit over
  all 65,536 inputs (``activations.get``), then fp32, bf16 patterns or a BFP output.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from hbfp.golden import activations as _activations
from hbfp.golden import bf16 as _bf16
from hbfp.golden.bfp import (EXP_BIAS, EXP_NAN, MIX32_MULTIPLIERS, RANDOM_BITS, SEED_SALT, BFPTensor, Format,
                             mix32 as _mix32_np)

#: Exponent of the smallest fp32 normal, and of fp32's largest power of two.
_MIN_NORMAL_EXP = -126
_MAX_EXP = 127

__all__ = ["mix32", "random_bits", "stream_index", "quantize", "requantize", "dequantize", "gemm", "epilogue",
           "bf16_from_f32", "flush_f32", "to_bfp_tensor", "from_bfp_tensor", "lstm_cell", "lstm_cell_backward"]

_MASK32 = 0xFFFF_FFFF
_F32_EXP = int(_bf16._F32_EXP)  # fp32's exponent field


def _mul_lo32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in [0, 2**32) and a 32-bit constant ``c``, without
    int64 overflow: the constant's two halves multiply separately."""
    hi, lo = c >> 16, c & 0xFFFF
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """``bfp.mix32`` on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul_lo32(x, MIX32_MULTIPLIERS[0])
    x = x ^ (x >> 15)
    x = _mul_lo32(x, MIX32_MULTIPLIERS[1])
    return x ^ (x >> 16)


def stream_index(rows: int, cols: int, tile: tuple[int, int], device=None) -> torch.Tensor:
    """``bfp.stream_index`` of a ``rows x cols`` matrix (padded to whole tiles) as int64 (mod
    2**32): tiles in row-major order of the tile grid, elements row-major within a tile."""
    th, tw = tile
    tc = -(-cols // tw)
    r = torch.arange(rows, dtype=torch.int64, device=device)[:, None]
    c = torch.arange(cols, dtype=torch.int64, device=device)[None, :]
    return ((((r // th) * tc + c // tw) * th + r % th) * tw + c % tw) & _MASK32


def random_bits(seed: int, index: torch.Tensor) -> torch.Tensor:
    """``bfp.random_bits``: the ``RANDOM_BITS`` random bits of stream positions ``index``."""
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise TypeError(f"seed must be an integer, got {seed!r}")
    key = int(_mix32_np(np.uint32((int(seed) ^ SEED_SALT) & _MASK32)))
    return mix32(index ^ key) >> (32 - RANDOM_BITS)


def flush_f32(x: torch.Tensor) -> torch.Tensor:
    """``bf16.flush_f32``: subnormals to zeros of their sign (FTZ/DAZ)."""
    u = x.view(torch.int32)
    return torch.where((u & _F32_EXP) == 0, u & torch.iinfo(torch.int32).min, u).view(torch.float32)


def bf16_from_f32(x: torch.Tensor) -> torch.Tensor:
    """``bf16.from_f32``: fp32 to bf16 patterns (int32 holding uint16 values): RNE, overflow to
    inf, subnormals to zeros, every NaN to the quiet NaN with its sign."""
    u = x.contiguous().view(torch.int32).to(torch.int64) & _MASK32
    sign16 = (u >> 16) & 0x8000
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    out = torch.where((u & _F32_EXP) == 0, sign16, rounded)
    out = torch.where((u & int(_bf16._F32_ABS)) > _F32_EXP, sign16 | _bf16.QNAN, out)
    return out.to(torch.int32)


def _code_dtype(fmt: Format) -> torch.dtype:
    return {np.dtype(np.int8): torch.int8, np.dtype(np.int16): torch.int16}.get(fmt.code_dtype, torch.int32)


def _round(y: torch.Tensor, rounding: str, rand: torch.Tensor | None) -> torch.Tensor:
    """``bfp._round``: exact values to integers (float64 or float32 in, int64 out)."""
    if rounding == "nearest_even":
        return torch.round(y).to(torch.int64)
    if rounding == "toward_zero":
        return torch.trunc(y).to(torch.int64)
    mag = torch.floor(y.abs().to(torch.float64) * float(1 << RANDOM_BITS)).to(torch.int64)
    q = (mag + rand) >> RANDOM_BITS
    return torch.where(y < 0, -q, q)


def quantize(x: torch.Tensor, fmt: Format, *, seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``bfp.quantize`` of a matrix: ``(codes, exponents)``, codes of ``x``'s shape (int8 up to 8
    mantissa bits, else int16), exponents one E8M0 code per tile (uint8). ``x``: fp32, or
    bf16/fp16/fp64 (converted to fp32 first, RNE), on any device."""
    if x.dim() != 2:
        raise ValueError(f"quantize takes a matrix, got shape {tuple(x.shape)}")
    if fmt.rounding == "stochastic" and seed is None:
        raise ValueError("stochastic rounding needs a seed (quantize(..., seed=N)) to be reproducible")
    x = x.to(torch.float32)
    m, n = x.shape
    th, tw = fmt.tile
    tr, tc = -(-m // th), -(-n // tw)
    if (m, n) != (tr * th, tc * tw):
        x = torch.nn.functional.pad(x, (0, tc * tw - n, 0, tr * th - m))
    x = x.contiguous()
    field = (x.view(torch.int32) >> 23) & 0xFF
    expo = field.view(tr, th, tc, tw).amax(dim=(1, 3))
    drop = field == 0
    nan_tiles = expo == EXP_NAN
    if bool(nan_tiles.any()):
        drop |= nan_tiles.repeat_interleave(th, 0).repeat_interleave(tw, 1)
    xz = torch.where(drop, torch.zeros((), dtype=torch.float32, device=x.device), x)
    shift = fmt.frac_bits + EXP_BIAS - expo
    live = (expo != 0) & (expo != EXP_NAN)
    wide = bool(live.any()) and bool(((shift < -126) & live).any() or ((shift > 127) & live).any())
    dtype = torch.float64 if wide else torch.float32
    exps = shift if wide else shift.clamp(-126, 127)
    scale = torch.ldexp(torch.ones((), dtype=dtype, device=x.device), exps.to(dtype))
    y = (xz.to(dtype).view(tr, th, tc, tw) * scale[:, None, :, None]).view(tr * th, tc * tw)
    rand = None
    if fmt.rounding == "stochastic":
        rand = random_bits(seed, stream_index(tr * th, tc * tw, fmt.tile, x.device))
    q = _round(y, fmt.rounding, rand).clamp_(-fmt.qmax, fmt.qmax)
    return q[:m, :n].to(_code_dtype(fmt)).contiguous(), expo.to(torch.uint8)


def requantize(codes: torch.Tensor, exponents: torch.Tensor, src: Format, fmt: Format, *,
               seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``bfp.requantize``: narrower mantissas on the same tiles and exponents."""
    if fmt.tile != src.tile:
        raise ValueError(f"requantize keeps the tiles: {src.tile} != {fmt.tile}")
    shift = src.mantissa_bits - fmt.mantissa_bits
    if shift < 0:
        raise ValueError("requantize narrows mantissas; it cannot widen them")
    if fmt.rounding == "stochastic" and seed is None:
        raise ValueError("stochastic rounding needs a seed (quantize(..., seed=N)) to be reproducible")
    if codes.device.type == "cpu" and fmt.rounding != "stochastic":
        # NumPy on the CPU tensor's memory: the same exact halving and rounding, a few times
        # faster than torch's small operations
        y = np.ldexp(codes.numpy().astype(np.float64), -shift)
        q = np.rint(y) if fmt.rounding == "nearest_even" else np.trunc(y)
        q = np.clip(q, -fmt.qmax, fmt.qmax).astype(fmt.code_dtype)
        return torch.from_numpy(q), exponents.clone()
    y = torch.ldexp(codes.to(torch.float64), torch.tensor(float(-shift), dtype=torch.float64, device=codes.device))
    rand = None
    if fmt.rounding == "stochastic":
        rand = random_bits(seed, stream_index(*codes.shape, fmt.tile, codes.device))
    q = _round(y, fmt.rounding, rand).clamp_(-fmt.qmax, fmt.qmax)
    return q.to(_code_dtype(fmt)), exponents.clone()


def _scale_exponents(exponents: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Per tile: ``E - frac_bits`` (int32), the power of two of a code step."""
    return exponents.to(torch.int32) - EXP_BIAS - fmt.frac_bits


def dequantize(codes: torch.Tensor, exponents: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``BFPTensor.dequantize``: fp32 values by the device rules (``bf16.round_f32``: RNE,
    a result below 2**-126 a zero of its sign, overflow to inf); NaN tiles give NaN."""
    th, tw = fmt.tile
    m, n = codes.shape
    tr, tc = exponents.shape
    s = _scale_exponents(exponents, fmt)
    live = (exponents != 0) & (exponents != EXP_NAN)
    if fmt.mantissa_bits <= 24 and not bool(((s < _MIN_NORMAL_EXP) & live).any()) and (
            not bool(live.any()) or int(s[live].max()) + fmt.mantissa_bits <= _MAX_EXP):
        # Every value is a code (at most 24 bits) times a normal power of two, a normal fp32
        # itself or zero: the fp32 product is exact, nothing to flush or to overflow.
        out = _scaled(codes, exponents, fmt, tr * th, tc * tw)[:m, :n]
    else:
        scale = torch.ldexp(torch.ones((), dtype=torch.float64, device=codes.device), s.to(torch.float64))
        scale = scale.repeat_interleave(th, 0).repeat_interleave(tw, 1)[:m, :n]
        exact = codes.to(torch.float64) * scale
        out = exact.to(torch.float32)
        out = torch.where(exact.abs() < _bf16._F32_FTZ_EDGE, torch.copysign(torch.zeros((), device=codes.device), out),
                          out)
    nan = exponents == EXP_NAN
    if bool(nan.any()):
        nan = nan.repeat_interleave(th, 0).repeat_interleave(tw, 1)[:m, :n]
        out = torch.where(nan, torch.full((), float("nan"), device=codes.device), out)
    return out.contiguous()


def to_bfp_tensor(codes: torch.Tensor, exponents: torch.Tensor, fmt: Format) -> BFPTensor:
    """The NumPy ``BFPTensor`` of codes and exponents (copied to the CPU if elsewhere)."""
    return BFPTensor(codes.cpu().numpy().astype(fmt.code_dtype, copy=False), exponents.cpu().numpy(), fmt)


def from_bfp_tensor(t: BFPTensor, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(np.ascontiguousarray(t.codes)).to(device), torch.from_numpy(t.exponents.copy()).to(device)


# ---- the product ---------------------------------------------------------------------------

def _live_range(codes: torch.Tensor, exponents: torch.Tensor, fmt: Format) -> tuple[int, int] | None:
    """(min, max) of ``E - frac_bits`` over tiles that hold a nonzero finite value (the NumPy
    fast path's ``_nonzero_range``): exponent code 0 counts only where its tile holds a nonzero
    code."""
    live = (exponents != 0) & (exponents != EXP_NAN)
    empty = exponents == 0
    if bool(empty.any()):
        th, tw = fmt.tile
        tr, tc = exponents.shape
        m, n = codes.shape
        nz = torch.nn.functional.pad((codes != 0).to(torch.uint8), (0, tc * tw - n, 0, tr * th - m))
        live |= empty & (nz.view(tr, th, tc, tw).amax(dim=(1, 3)) != 0)
    if not bool(live.any()):
        return None
    s = _scale_exponents(exponents, fmt)[live]
    return int(s.min()), int(s.max())


def _magnitude(codes: torch.Tensor, fmt: Format) -> int:
    """The largest code magnitude ``codes`` may hold (``gemm._code_magnitude``): int8 codes
    at most 128 whatever they hold (a bound that costs no pass over them), else their own."""
    if codes.numel() == 0:
        return fmt.qmax
    if codes.dtype == torch.int8:
        return 128
    lo, hi = torch.aminmax(codes)
    return max(fmt.qmax, int(hi), -int(lo))


def _fast_path_ok(a, b, fa: Format, fb: Format, tk: int, c: torch.Tensor | None) -> bool:
    """``gemm._fast_path_ok`` on torch tensors: every K-tile's product of scaled codes is exact
    in fp32 and no accumulator sum can be subnormal."""
    qa, qb = _magnitude(a[0], fa), _magnitude(b[0], fb)
    bound = tk * qa * qb
    if bound >= 2**24:
        return False
    ra, rb = _live_range(*a, fa), _live_range(*b, fb)
    for r, q in ((ra, qa), (rb, qb)):
        if r is not None and r[1] + q.bit_length() > _MAX_EXP + 1:
            return False
    if ra is None or rb is None:
        return True
    if ra[0] < _MIN_NORMAL_EXP or rb[0] < _MIN_NORMAL_EXP or ra[0] + rb[0] < _MIN_NORMAL_EXP:
        return False
    if ra[1] + rb[1] + int(bound).bit_length() > _MAX_EXP:
        return False
    if c is not None:
        mag = c.abs()[torch.isfinite(c) & (c != 0)]
        if mag.numel() and float(mag.min()) < 2.0 ** (_MIN_NORMAL_EXP + 23):
            return False
    return True


def _scaled(codes: torch.Tensor, exponents: torch.Tensor, fmt: Format, rows: int, cols: int) -> torch.Tensor:
    """``gemm._scaled``: codes times their tile's power of two, fp32, padded to ``rows x cols``
    (whole tiles); NaN tiles and tiles of exponent code 0 scale to 0."""
    th, tw = fmt.tile
    if tuple(codes.shape) == (rows, cols):
        out = codes.to(torch.float32)
    else:
        out = torch.zeros((rows, cols), dtype=torch.float32, device=codes.device)
        out[: codes.shape[0], : codes.shape[1]] = codes
    s = _scale_exponents(exponents, fmt).clamp(_MIN_NORMAL_EXP, _MAX_EXP).to(torch.float32)
    scale = torch.ldexp(torch.ones((), dtype=torch.float32, device=codes.device), s)
    # NaN tiles, and tiles of exponent code 0 (any code of theirs is below 2**-126, read as 0)
    scale = torch.where((exponents == EXP_NAN) | (exponents == 0), torch.zeros((), device=codes.device), scale)
    tr, tc = exponents.shape
    out.view(tr, th, tc, tw).mul_(scale[:, None, :, None])
    return out


#: K-tile products of a block of rows held at once while they are added (fits a core's cache).
_BLOCK_ELEMENTS = 1 << 19


def _add_in_order(p: torch.Tensor, acc: torch.Tensor) -> None:
    """``acc += p[0]``, then ``p[1]``, ...: fp32 additions in index order (each rounded). On a
    CPU one NumPy reduction over the outer axis, which adds in that order into an fp32
    output; elsewhere one addition a K-tile."""
    if p.device.type == "cpu" and acc.is_contiguous() and p.is_contiguous():
        pn, an = p.numpy(), acc.numpy()
        with np.errstate(over="ignore", invalid="ignore"):  # an inf (or inf - inf) is a result here
            np.add(pn[0], an, out=pn[0])
            np.add.reduce(pn, axis=0, out=an)
        return
    for j in range(p.shape[0]):
        acc += p[j]


#: The ways ``gemm`` forms each K-tile's products.
IMPLS = ("fp32", "int8")


@functools.lru_cache(maxsize=None)
def _int_mm_works() -> bool:
    """Whether this torch multiplies int8 matrices into exact int32 sums on a CPU."""
    try:
        a = torch.ones((24, 24), dtype=torch.int8)
        return bool((torch._int_mm(a, a) == 24).all())
    except Exception:  # noqa: BLE001 - an older torch or a CPU without the kernel
        return False


def _int8_applies(ca: torch.Tensor, cb: torch.Tensor) -> bool:
    return ca.dtype == cb.dtype == torch.int8 and ca.device.type == "cpu" and _int_mm_works()


def _round8(x: int, least: int = 8) -> int:
    return max(least, -(-x // 8) * 8)


def _accumulate_int8(ca, ea, cb, eb, fa: Format, fb: Format, acc: torch.Tensor) -> None:
    """``acc`` += every K-tile's p in K-tile order, each p an exact int32 sum of int8 codes
    (``torch._int_mm``: sides padded with zero codes to its multiples of 8, more than 16 rows)
    times its two tiles' power of two, exact in fp32 under ``_fast_path_ok``."""
    m, k = ca.shape
    n = cb.shape[1]
    th, tk, tw = fa.tile[0], fa.tile[1], fb.tile[1]
    tr, kt, tc = ea.shape[0], -(-k // tk), eb.shape[1]
    mp, np_ = tr * th, tc * tw
    mi, ni = _round8(mp, 24), _round8(np_)
    a_pad = torch.zeros((mi, kt * tk), dtype=torch.int8)
    a_pad[:m, :k] = ca
    a3 = a_pad.view(mi, kt, tk).transpose(0, 1).contiguous()
    b_pad = torch.zeros((kt * tk, ni), dtype=torch.int8)
    b_pad[:k, :n] = cb
    b3 = b_pad.view(kt, tk, ni)
    # Each (K-tile, row tile, column tile): 2**(sa + sb), clamped where no code can be nonzero.
    sa = _scale_exponents(ea, fa)  # (tr, kt)
    sb = _scale_exponents(eb, fb)  # (kt, tc)
    exps = (sa.t()[:, :, None] + sb[:, None, :]).clamp(_MIN_NORMAL_EXP, _MAX_EXP).to(torch.float32)
    scale = torch.ldexp(torch.ones((), dtype=torch.float32), exps)[:, :, None, :, None]
    # Blocks of whole row tiles, their sums of every K-tile at once.
    rows = max(1, _BLOCK_ELEMENTS // max(kt * ni * th, 1)) * th
    s32 = torch.empty((kt, _round8(min(rows, mp), 24), ni), dtype=torch.int32)
    for r0 in range(0, mp, rows):
        r1 = min(mp, r0 + rows)
        t0, t1 = r0 // th, -(-r1 // th)
        # _int_mm's rows: the block's, at least 17 and a multiple of 8 (past them, zero codes)
        q1 = min(mi, r0 + _round8(r1 - r0, 24))
        sb_ = s32[:, : q1 - r0]
        for j in range(kt):
            torch._int_mm(a3[j, r0:q1], b3[j], out=sb_[j])
        p = sb_[:, : r1 - r0, :np_].to(torch.float32).view(kt, t1 - t0, th, tc, tw)
        p *= scale[:, t0:t1]
        p = p.view(kt, r1 - r0, np_)[:, : min(m, r1) - r0, :n].contiguous()
        _add_in_order(p, acc[r0:min(m, r1)])


def _accumulate_fp32(af: torch.Tensor, bf: torch.Tensor, acc: torch.Tensor, tk: int, kt: int) -> None:
    """``acc`` += every K-tile's p in K-tile order: A as (KT, M, tk), B as (KT, tk, N), every
    K-tile's p of a block of rows in one batched product (exact), then the additions in order."""
    m, n = acc.shape
    a3 = af.view(m, kt, tk).transpose(0, 1)
    b3 = bf.reshape(kt, tk, n)
    rows = max(1, min(m, _BLOCK_ELEMENTS // max(kt * n, 1)))
    p = torch.empty((kt, rows, n), dtype=torch.float32, device=acc.device)
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        pb = p[:, : r1 - r0]
        torch.bmm(a3[:, r0:r1], b3, out=pb)
        _add_in_order(pb, acc[r0:r1])


def gemm(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], fa: Format, fb: Format, *,
         c: torch.Tensor | None = None, bias: torch.Tensor | None = None, impl: str = "fp32") -> torch.Tensor:
    """The fp32 sums ``C + A @ B + bias`` of ``hbfp.golden.gemm.gemm`` (before its epilogue):
    ``a`` = (codes M x K, exponents), ``b`` = (codes K x N, exponents) in formats ``fa``,
    ``fb`` whose tiles agree along K; ``c`` (M x N) and ``bias`` (N) fp32.

    ``impl``: how each K-tile's products are formed: ``"fp32"`` (batched fp32 products of the
    codes scaled into fp32 operands, any device) or ``"int8"`` (exact int32 sums of int8 codes,
    ``torch._int_mm``, then scaled by the tiles' powers of two: int8 codes on a CPU whose torch
    has it). Both give the same bits; inputs outside the fp32 route's preconditions go through
    the NumPy reference."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "int8" and not _int8_applies(a[0], b[0]):
        raise ValueError("impl='int8' takes int8 codes on a CPU whose torch has _int_mm")
    (ca, ea), (cb, eb) = a, b
    m, k = ca.shape
    k2, n = cb.shape
    if k != k2:
        raise ValueError(f"gemm shapes do not agree: A is {m}x{k}, B is {k2}x{n}")
    if fa.tile[1] != fb.tile[0]:
        raise ValueError(f"the tiles of A and B must agree along K: {fa.tile} and {fb.tile}")
    dev = ca.device
    tk = fa.tile[1]
    kt = -(-k // tk)
    if c is not None:
        c = flush_f32(c.to(torch.float32).contiguous())
    if kt and not _fast_path_ok(a, b, fa, fb, tk, c):
        from hbfp.golden.gemm import gemm as golden_gemm

        acc = golden_gemm(to_bfp_tensor(ca, ea, fa), to_bfp_tensor(cb, eb, fb),
                          c=None if c is None else c.cpu().numpy(),
                          bias=None if bias is None else bias.to(torch.float32).cpu().numpy(), impl="reference")
        return torch.from_numpy(acc).to(dev)
    acc = torch.zeros((m, n), dtype=torch.float32, device=dev) if c is None else c.clone()
    if kt and m and n:
        acc += 0.0  # -0 + p and +0 + p agree on every p of the fast route; a NaN of C stays NaN
    if kt and m and n and impl == "int8":
        _accumulate_int8(ca, ea, cb, eb, fa, fb, acc)
    elif kt and m and n:
        ma = ea.shape[0] * fa.tile[0]
        nb = eb.shape[1] * fb.tile[1]
        af = _scaled(ca, ea, fa, ma, kt * tk)[:m]
        bf = _scaled(cb, eb, fb, kt * tk, nb)[:, :n]
        _accumulate_fp32(af, bf, acc, tk, kt)
    # A NaN tile on either side makes every output it meets NaN.
    nan_a, nan_b = ea == EXP_NAN, eb == EXP_NAN
    if bool(nan_a.any()) or bool(nan_b.any()):
        rows_nan = nan_a.any(dim=1).repeat_interleave(fa.tile[0])[:m]
        cols_nan = nan_b.any(dim=0).repeat_interleave(fb.tile[1])[:n]
        acc = torch.where(rows_nan[:, None] | cols_nan[None, :], torch.full((), float("nan"), device=dev), acc)
    if bias is not None:
        acc = flush_f32(acc + flush_f32(bias.to(torch.float32))[None, :])
    if kt or bias is not None:  # every NaN an addition made: the one quiet NaN
        qnan = torch.tensor(int(_bf16.F32_QNAN), dtype=torch.int32).view(torch.float32).to(dev)
        acc = torch.where(torch.isnan(acc), qnan, acc)
    return acc


# ---- the epilogue --------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _table(name: str, leaky_shift: int | None) -> torch.Tensor:
    """The bf16 unit ``name`` over all 65,536 bf16 patterns (int32 holding uint16)."""
    f = _activations.get(name, leaky_shift=leaky_shift)
    return torch.from_numpy(f(np.arange(1 << 16, dtype=np.uint16)).astype(np.int32))


def epilogue(acc: torch.Tensor, activation: str | None = None, out: str | Format = "fp32", seed: int | None = None,
             *, leaky_shift: int | None = None):
    """``gemm.epilogue``: the activation (on ``acc`` rounded to bf16), then the output: fp32
    (a float32 tensor), ``"bf16"`` (a torch.bfloat16 tensor, bit for bit the patterns) or a BFP
    ``Format`` (``(codes, exponents)``; ``seed`` for stochastic rounding)."""
    if not (isinstance(out, Format) or out in ("fp32", "bf16")):
        raise ValueError(f"out must be fp32, bf16 or a BFP Format, got {out!r}")
    bits = None
    if activation is not None:
        table = _table(activation, leaky_shift).to(acc.device)
        bits = table[bf16_from_f32(acc).to(torch.int64)]
    elif out == "bf16":
        bits = bf16_from_f32(acc)
    if bits is not None:
        if out == "bf16":
            return bits.to(torch.int16).view(torch.bfloat16)
        acc = (bits << 16).view(torch.float32)
    if isinstance(out, Format):
        return quantize(acc, out, seed=seed)
    return acc


# ---- the LSTM cell (src/cell.c) as torch operations --------------------------------------------

@functools.lru_cache(maxsize=None)
def _cell_constants() -> dict:
    from .capi import CELL_CONSTANTS

    return {k: float.fromhex(v) for k, v in CELL_CONSTANTS.items()}


def _exp_f(x: torch.Tensor) -> torch.Tensor:
    """src/cell.c's exp_f: the same fp32 operations in the same order."""
    k = _cell_constants()
    x = x.clamp(k["EXP_LO"], k["EXP_HI"])
    t = x * k["LOG2E"] + k["ROUND"]
    n = t - k["ROUND"]
    r = x - n * k["LN2_HI"]
    r = r - n * k["LN2_LO"]
    z = r * r
    p = r * k["EXP0"] + k["EXP1"]
    for c in ("EXP2", "EXP3", "EXP4", "EXP5"):
        p = p * r + k[c]
    p = p * z + r
    p = p + 1.0
    round_bits = int(np.float32(k["ROUND"]).view(np.int32))
    return p * ((t.view(torch.int32) - round_bits + 127) << 23).view(torch.float32)


def _sigmoid_f(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, 1.0) / (1.0 + _exp_f(-x))


def _tanh_f(x: torch.Tensor) -> torch.Tensor:
    k = _cell_constants()
    a = x.abs()
    z = x * x
    p = z * k["TANH0"] + k["TANH1"]
    for c in ("TANH2", "TANH3", "TANH4"):
        p = p * z + k[c]
    small = p * z * x + x
    big = 1.0 - torch.full_like(a, 2.0) / (_exp_f(a + a) + 1.0)  # (a number over a tensor is two roundings)
    big = torch.where(x < 0, -big, big)
    return torch.where(a < k["TANH_SMALL"], small, big)


def lstm_cell(p, xp, c_prev, acts, c, tc, h) -> None:
    """src/cell.c's hbfp_lstm_cell: the gates p + xp (rows x 4H: input, forget, cell, output)
    after their nonlinearities into ``acts``, c = f * c_prev + i * g, tc = tanh(c), h = o * tc."""
    hid = c.shape[-1]
    g = p + xp
    acts[:, :2 * hid] = _sigmoid_f(g[:, :2 * hid])
    acts[:, 2 * hid:3 * hid] = _tanh_f(g[:, 2 * hid:3 * hid])
    acts[:, 3 * hid:] = _sigmoid_f(g[:, 3 * hid:])
    i, f, gg, o = acts.split(hid, dim=1)
    c.copy_(f * c_prev + i * gg)
    tc.copy_(_tanh_f(c))
    h.copy_(o * tc)


def lstm_cell_backward(acts, c_prev, tc, dy, dh, dc, dgates, dc_prev) -> None:
    """src/cell.c's hbfp_lstm_cell_backward."""
    hid = tc.shape[-1]
    i, f, g, o = acts.split(hid, dim=1)
    d = dy + dh
    dct = d * o * (1.0 - tc * tc) + dc
    dgates[:, :hid] = dct * g * (1.0 - i) * i
    dgates[:, hid:2 * hid] = dct * c_prev * (1.0 - f) * f
    dgates[:, 2 * hid:3 * hid] = dct * i * (1.0 - g * g)
    dgates[:, 3 * hid:] = d * tc * (1.0 - o) * o
    dc_prev.copy_(dct * f)
