"""A deliberately slow scalar reference of the numerics contract (docs/numerics.md).

Python integers, ``fractions.Fraction`` and ``struct``; no NumPy arithmetic. It is written
from the contract's text, not from ``hbfp.golden``, so that the fast model is checked
against a second, independent reading of the same rules.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

F32_MIN_NORMAL = Fraction(1, 2**126)


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def f32_from_bits(u: int) -> float:
    return struct.unpack("<f", struct.pack("<I", u & 0xFFFFFFFF))[0]


def daz(x: float) -> float:
    """A subnormal fp32 input reads as a zero of its sign."""
    if x != 0 and math.isfinite(x) and abs(x) < 2.0**-126:
        return math.copysign(0.0, x)
    return x


def _round_significand(v: Fraction, bits: int) -> tuple[int, int]:
    """|v| > 0 as q * 2**e with 2**(bits-1) <= q < 2**bits, RNE, unbounded exponent."""
    v = abs(v)
    e = v.numerator.bit_length() - v.denominator.bit_length()
    if Fraction(2) ** e > v:
        e -= 1
    # Now 2**e <= v < 2**(e+1).
    shift = bits - 1 - e
    scaled = v * (Fraction(2) ** shift)
    q = round(scaled)  # Fraction rounds half to even
    if q == 2**bits:
        q //= 2
        shift -= 1
    return q, -shift


def round_f32(v: Fraction, *, zero_sign: float = 1.0) -> float:
    """Round an exact value to fp32: RNE with an unbounded exponent, then flush below
    2**-126 to a zero of its sign, overflow to +-inf. An exact zero gives +0 (or the sign
    passed in ``zero_sign``)."""
    if v == 0:
        return math.copysign(0.0, zero_sign)
    sign = -1.0 if v < 0 else 1.0
    q, e = _round_significand(v, 24)
    value = Fraction(q) * Fraction(2) ** e
    if value < F32_MIN_NORMAL:
        return math.copysign(0.0, sign)
    if value >= Fraction(2) ** 128:
        return sign * math.inf
    return sign * float(value)


def f32_add(x: float, y: float) -> float:
    x, y = daz(x), daz(y)
    if not (math.isfinite(x) and math.isfinite(y)):
        s = x + y  # IEEE: inf + -inf is NaN, NaN propagates ...
        return math.nan if math.isnan(s) else s  # ... as the contract's one NaN, 0x7FC00000
    s = Fraction(x) + Fraction(y)
    if s == 0:
        # RNE: the sum of two zeros of the same sign keeps it; x + (-x) is +0.
        both_neg = math.copysign(1.0, x) < 0 and math.copysign(1.0, y) < 0 and x == 0 and y == 0
        return -0.0 if both_neg else 0.0
    return round_f32(s)


def f32_mul(x: float, y: float) -> float:
    x, y = daz(x), daz(y)
    if not (math.isfinite(x) and math.isfinite(y)):
        p = x * y  # inf * 0 and a NaN operand: the contract's one NaN, 0x7FC00000
        return math.nan if math.isnan(p) else p
    p = Fraction(x) * Fraction(y)
    sign = math.copysign(1.0, x) * math.copysign(1.0, y)
    return round_f32(p, zero_sign=sign) if p != 0 else math.copysign(0.0, sign)


def bf16_from_value(v: Fraction | float) -> int:
    """Correctly rounded bf16 pattern of an exact value (RNE, FTZ, overflow to inf)."""
    if isinstance(v, float):
        if math.isnan(v):
            return 0x7FC0 | (0x8000 if math.copysign(1.0, v) < 0 else 0)
        if math.isinf(v):
            return 0x7F80 | (0x8000 if v < 0 else 0)
        sign = 0x8000 if math.copysign(1.0, v) < 0 else 0
        if v == 0:
            return sign
        v = Fraction(v)
    else:
        sign = 0x8000 if v < 0 else 0
        if v == 0:
            return 0
    q, e = _round_significand(v, 8)
    # value = q * 2**e with 128 <= q < 256: unbiased exponent e + 7.
    ue = e + 7
    if ue > 127:
        return sign | 0x7F80
    if ue < -126:
        return sign
    return sign | ((ue + 127) << 7) | (q - 128)


def mix32(x: int) -> int:
    """The generator's hash, as written in docs/numerics.md."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x ^= x >> 16
    return x


def random_bits(seed: int, n: int, bits: int = 16) -> int:
    key = mix32((seed ^ 0x9E3779B9) & 0xFFFFFFFF)
    return mix32((n & 0xFFFFFFFF) ^ key) >> (32 - bits)


def round_int(v: Fraction, mode: str, r: int | None = None, rbits: int = 16) -> int:
    if mode == "nearest_even":
        return round(v)
    if mode == "toward_zero":
        return math.trunc(v)
    mag = abs(v)
    kept = math.floor(mag * 2**rbits)  # RANDOM_BITS fraction bits, the rest truncated
    q = (kept + r) >> rbits
    return -q if v < 0 else q


def quantize_matrix(x: list[list[float]], m_bits: int, tile: tuple[int, int], mode: str, seed: int | None = None):
    """Quantize one matrix of fp32 values. Returns (codes, exponent codes) as nested lists."""
    rows, cols = len(x), len(x[0])
    th, tw = tile
    tr, tc = -(-rows // th), -(-cols // tw)
    qmax = 2 ** (m_bits - 1) - 1
    codes = [[0] * cols for _ in range(rows)]
    exps = [[0] * tc for _ in range(tr)]
    for ti in range(tr):
        for tj in range(tc):
            cells = [(i, j) for i in range(ti * th, min(rows, ti * th + th)) for j in range(tj * tw, min(cols, tj * tw + tw))]
            vals = {c: daz(x[c[0]][c[1]]) for c in cells}
            if any(not math.isfinite(v) for v in vals.values()):
                exps[ti][tj] = 0xFF
                continue
            amax = max((abs(v) for v in vals.values()), default=0.0)
            if amax == 0:
                exps[ti][tj] = 0
                continue
            e = math.frexp(amax)[1] - 1  # floor(log2(amax)), exact
            exps[ti][tj] = e + 127
            for (i, j), v in vals.items():
                scaled = Fraction(v) * Fraction(2) ** (m_bits - 2 - e)
                r = None
                if mode == "stochastic":
                    # Position in the tile-major stream (padded tiles count whole).
                    n = ((ti * tc + tj) * th + (i - ti * th)) * tw + (j - tj * tw)
                    r = random_bits(seed, n)
                q = round_int(scaled, mode, r)
                codes[i][j] = max(-qmax, min(qmax, q))
    return codes, exps


def gemm_matrix(qa, ea, ma, tile_a, qb, eb, mb, tile_b, c=None, bias=None, n=None) -> list[list[float]]:
    """The BFP product of section 3 from codes and exponent codes (nested lists). ``n``: the
    number of columns of B, needed when K = 0 (B has no rows to count them in)."""
    m, k = len(qa), len(qb)
    if n is None:
        n = len(qb[0])
    tm, tk = tile_a
    _, tn = tile_b
    out = []
    for i in range(m):
        row = []
        for j in range(n):
            acc = daz(c[i][j]) if c is not None else 0.0
            for kt in range(-(-k // tk)):
                e_a, e_b = ea[i // tm][kt], eb[kt][j // tn]
                if e_a == 0xFF or e_b == 0xFF:
                    p = math.nan
                else:
                    s = sum(qa[i][kk] * qb[kk][j] for kk in range(kt * tk, min(k, kt * tk + tk)))
                    p = round_f32(Fraction(s) * Fraction(2) ** (e_a - 127 - (ma - 2) + e_b - 127 - (mb - 2)))
                acc = f32_add(acc, p)
            if bias is not None:
                acc = f32_add(acc, bias[j])
            row.append(acc)
        out.append(row)
    return out
