"""Block floating point: formats, quantization, requantization (docs/numerics.md, section 2).

A ``Format`` names every numeric choice of a BFP tensor: mantissa bits (sign included), the
tile shape that shares one exponent, and the rounding mode. ``quantize`` turns floats into a
``BFPTensor`` of integer ``codes`` and one E8M0 exponent code per tile (``exponents``).

The stochastic rounding generator is counter-based so that the gateware reproduces it for
any number of lanes: element ``n`` of the tile-major stream (see ``stream_index``) draws
``RANDOM_BITS`` bits from ``mix32(n ^ mix32(seed ^ SEED_SALT)) >> (32 - RANDOM_BITS)``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from . import bf16

__all__ = [
    "ROUNDINGS",
    "RANDOM_BITS",
    "SEED_SALT",
    "MIX32_MULTIPLIERS",
    "EXP_BIAS",
    "EXP_NAN",
    "Format",
    "HBFP8",
    "HBFP16",
    "MXINT8",
    "BFPTensor",
    "quantize",
    "requantize",
    "mix32",
    "stream_index",
    "random_bits",
]

ROUNDINGS = ("nearest_even", "toward_zero", "stochastic")
#: Random bits per element used by stochastic rounding (the top bits of ``mix32``).
RANDOM_BITS = 16
#: The two constant multipliers of ``mix32`` (the gateware reads them from here).
MIX32_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
#: XORed into the seed before it is hashed into the key (so that seed 0 has no zero key).
SEED_SALT = 0x9E3779B9
#: E8M0: the stored exponent code is ``E + EXP_BIAS``.
EXP_BIAS = 127
#: The exponent code that marks a NaN tile.
EXP_NAN = 0xFF


@dataclass(frozen=True)
class Format:
    """A BFP format: ``mantissa_bits`` (sign included), the ``tile`` (rows, cols) of the
    stored matrix that shares one exponent, and the ``rounding`` mode.

    An element's value is ``code * 2**(E - (mantissa_bits - 2))`` with
    ``|code| <= 2**(mantissa_bits - 1) - 1``."""

    mantissa_bits: int
    tile: tuple[int, int]
    rounding: str = "nearest_even"

    def __post_init__(self):
        if not isinstance(self.mantissa_bits, int) or not 2 <= self.mantissa_bits <= 16:
            raise ValueError(f"mantissa_bits must be an integer in 2..16, got {self.mantissa_bits!r}")
        tile = tuple(self.tile)
        if len(tile) != 2 or not all(isinstance(t, int) and t >= 1 for t in tile):
            raise ValueError(f"tile must be two positive integers (rows, cols), got {self.tile!r}")
        object.__setattr__(self, "tile", tile)
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")

    @property
    def qmax(self) -> int:
        """Largest code magnitude (codes are symmetric: -qmax..qmax)."""
        return 2 ** (self.mantissa_bits - 1) - 1

    @property
    def frac_bits(self) -> int:
        """Bits of a code below the binary point: value = code * 2**(E - frac_bits)."""
        return self.mantissa_bits - 2

    @property
    def code_dtype(self) -> np.dtype:
        return np.dtype(np.int8 if self.mantissa_bits <= 8 else np.int16)

    def with_rounding(self, rounding: str) -> "Format":
        return dataclasses.replace(self, rounding=rounding)

    def transposed(self) -> "Format":
        """The format of the transposed matrix: the tile's sides swap."""
        return dataclasses.replace(self, tile=(self.tile[1], self.tile[0]))


HBFP8 = Format(8, (24, 24))
HBFP16 = Format(16, (24, 24))
MXINT8 = Format(8, (1, 32))


def _tiles(n: int, t: int) -> int:
    return -(-n // t)


@dataclass(frozen=True, eq=False)
class BFPTensor:
    """A matrix (or a stack of matrices: the last two axes) in a BFP format.

    ``codes``: integers of the matrix's own shape (padding is implicit zeros);
    ``exponents``: ``uint8`` E8M0 codes, one per tile, shape ``(..., tile_rows, tile_cols)``,
    ``EXP_NAN`` for a NaN tile (its codes are 0)."""

    codes: np.ndarray
    exponents: np.ndarray
    fmt: Format

    def __post_init__(self):
        if self.codes.ndim < 2:
            raise ValueError("BFPTensor codes must have at least two axes")
        if self.codes.dtype != self.fmt.code_dtype:
            raise TypeError(f"codes must be {self.fmt.code_dtype} for {self.fmt}, got {self.codes.dtype}")
        if self.exponents.dtype != np.uint8:
            raise TypeError(f"exponents must be uint8 E8M0 codes, got {self.exponents.dtype}")
        if self.exponents.shape != self.tile_grid_shape:
            raise ValueError(f"exponents shape {self.exponents.shape} does not match the tile grid {self.tile_grid_shape}")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    @property
    def tile_grid_shape(self) -> tuple[int, ...]:
        *lead, m, n = self.codes.shape
        return (*lead, _tiles(m, self.fmt.tile[0]), _tiles(n, self.fmt.tile[1]))

    @property
    def nan_tiles(self) -> np.ndarray:
        return self.exponents == EXP_NAN

    def storage_bytes(self) -> int:
        """Bytes of the packed form: ``mantissa_bits`` per element plus one byte a tile."""
        return math.ceil(self.codes.size * self.fmt.mantissa_bits / 8) + self.exponents.size

    def expand(self, per_tile: np.ndarray) -> np.ndarray:
        """Broadcast a per-tile array (shape of ``exponents``) to the element grid."""
        th, tw = self.fmt.tile
        *_, m, n = self.shape
        e = np.repeat(np.repeat(per_tile, th, axis=-2), tw, axis=-1)
        return e[..., :m, :n]

    def scale_exponents(self) -> np.ndarray:
        """Per-tile power of two of one code step: ``E - frac_bits`` (int32)."""
        return self.exponents.astype(np.int32) - EXP_BIAS - self.fmt.frac_bits

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        """The values ``code * 2**(E - frac_bits)``; NaN tiles give NaN.

        float64 is exact; float32 follows the device rules (values below 2**-126 flush)."""
        vals = np.ldexp(self.codes.astype(np.float64), self.expand(self.scale_exponents()))
        vals = np.where(self.expand(self.nan_tiles), np.nan, vals)
        if np.dtype(dtype) == np.float64:
            return vals
        if np.dtype(dtype) == np.float32:
            return bf16.round_f32(vals)
        raise TypeError(f"dequantize gives float32 or float64, not {np.dtype(dtype)}")

    def transpose(self) -> "BFPTensor":
        """The transposed matrix: codes and tile grid transposed, the tile's sides swapped.
        No value changes (with square tiles the format is the same)."""
        return BFPTensor(
            np.ascontiguousarray(np.swapaxes(self.codes, -1, -2)),
            np.ascontiguousarray(np.swapaxes(self.exponents, -1, -2)),
            self.fmt.transposed(),
        )

    @property
    def T(self) -> "BFPTensor":
        return self.transpose()


def mix32(x) -> np.ndarray:
    """A 32-bit integer hash (xorshift-multiply, two constant multiplies), the mixing
    function of the stochastic rounding generator. ``uint32`` in, ``uint32`` out."""
    # Arrays wrap around modulo 2**32 silently (NumPy warns only on scalar overflow, so a
    # scalar goes through a one-element array).
    a = np.asarray(x, dtype=np.uint32)
    x = a.reshape(-1) if a.ndim else a.reshape(1)
    x = x ^ (x >> np.uint32(16))
    x *= np.uint32(MIX32_MULTIPLIERS[0])
    x ^= x >> np.uint32(15)
    x *= np.uint32(MIX32_MULTIPLIERS[1])
    x ^= x >> np.uint32(16)
    return x.reshape(a.shape)


def stream_index(grid_shape: tuple[int, ...], tile: tuple[int, int]) -> np.ndarray:
    """Position of every element in the tile-major stream, as ``uint32`` (mod 2**32), in the
    padded element grid of a matrix stack whose tile grid is ``grid_shape``.

    Tiles go in row-major order of the tile grid (leading axes first), elements row-major
    within a tile: the order in which the quantizer receives a tile stream."""
    th, tw = tile
    *lead, tr, tc = grid_shape
    n_tiles = int(np.prod(grid_shape, dtype=np.int64))
    idx = np.arange(n_tiles * th * tw, dtype=np.uint64).astype(np.uint32)
    idx = idx.reshape(*lead, tr, tc, th, tw)
    idx = np.moveaxis(idx, -3, -2)  # (..., tr, th, tc, tw)
    return idx.reshape(*lead, tr * th, tc * tw)


def random_bits(seed: int, index: np.ndarray) -> np.ndarray:
    """The ``RANDOM_BITS`` random bits of stream positions ``index`` under ``seed``."""
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise TypeError(f"seed must be an integer, got {seed!r}")
    key = mix32(np.uint32((int(seed) ^ SEED_SALT) & 0xFFFF_FFFF))
    return (mix32(np.asarray(index, dtype=np.uint32) ^ key) >> np.uint32(32 - RANDOM_BITS)).astype(np.int64)


def _round(y: np.ndarray, rounding: str, rand: np.ndarray | None) -> np.ndarray:
    """Round exact float64 values to integers (int64) by the rounding mode."""
    if rounding == "nearest_even":
        return np.rint(y).astype(np.int64)
    if rounding == "toward_zero":
        return np.trunc(y).astype(np.int64)
    # Stochastic, on the magnitude: keep RANDOM_BITS fraction bits (truncating the rest),
    # add the random bits, drop the fraction. Unbiased down to 2**-RANDOM_BITS of a step.
    mag = np.floor(np.ldexp(np.abs(y), RANDOM_BITS)).astype(np.int64)
    q = (mag + rand) >> RANDOM_BITS
    return np.where(y < 0, -q, q)


def _as_f32(x) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype == bf16._bfloat16():
        return bf16.to_f32(a)
    if a.dtype.kind == "f":
        return a.astype(np.float32, copy=False)
    if a.dtype.kind in "iu":
        return a.astype(np.float32)
    raise TypeError(f"quantize takes floating-point values (fp32, bf16, fp16, fp64), got dtype {a.dtype}")


def _check_stochastic(fmt: Format, seed) -> None:
    if fmt.rounding == "stochastic" and seed is None:
        raise ValueError("stochastic rounding needs a seed (quantize(..., seed=N)) to be reproducible")


def quantize(x, fmt: Format = HBFP8, *, seed: int | None = None, impl: str | None = None) -> BFPTensor:
    """Quantize a matrix (or a stack: the last two axes; a 1-D array becomes one row, shape ``(1, n)``) to ``fmt``.

    fp32 is read as it is, bf16 is widened exactly, fp16/fp64/integers are first converted
    to fp32 (RNE). Ragged edges are padded with zeros that take part in no maximum.
    ``seed`` selects the stochastic rounding stream (required for ``stochastic``). ``impl``:
    ``"reference"`` (this module's NumPy bands), a name of ``hbfp.kernels.IMPLS``, or None: the
    registry's fastest for a matrix (the same bits)."""
    if not isinstance(fmt, Format):
        raise TypeError(f"fmt must be a Format (for example HBFP8), got {fmt!r}")
    _check_stochastic(fmt, seed)
    x = _as_f32(x)
    if x.ndim == 0:
        raise ValueError("quantize needs an array with at least one axis")
    if x.ndim == 1:
        x = x[None, :]
    *lead, m, n = x.shape
    if impl != "reference" and not lead:
        from hbfp import kernels

        codes, expo = kernels.quantize(x, fmt, seed=seed, impl=impl)
        return BFPTensor(codes, expo, fmt)
    th, tw = fmt.tile
    tr, tc = _tiles(m, th), _tiles(n, tw)
    if (m, n) == (tr * th, tc * tw):
        xp = np.ascontiguousarray(x)
    else:
        xp = np.zeros((*lead, tr * th, tc * tw), dtype=np.float32)
        xp[..., :m, :n] = x
    if xp.size == 0:
        return BFPTensor(np.zeros((*lead, m, n), fmt.code_dtype), np.zeros((*lead, tr, tc), np.uint8), fmt)
    # Tile-row bands (th rows of the padded matrix, leading axes first) are independent: they
    # go in chunks that stay in a core's cache, on a thread per core when there are many.
    bands = xp.reshape(-1, th, tc * tw)
    expo = np.empty((bands.shape[0], tc), dtype=np.uint8)
    codes = np.empty(bands.shape, dtype=fmt.code_dtype)
    per = max(1, _CHUNK_ELEMENTS // (th * tc * tw))
    chunks = [(b, min(bands.shape[0], b + per)) for b in range(0, bands.shape[0], per)]
    key = None if fmt.rounding != "stochastic" else _key(seed)
    pattern = _band_pattern(th, tw, tc) if key is not None else None

    def work(my_chunks):
        for b0, b1 in my_chunks:
            _quantize_bands(bands[b0:b1], fmt, b0, key, pattern, expo[b0:b1], codes[b0:b1])

    _run_chunks(work, chunks, parallel=xp.size >= _PARALLEL_ELEMENTS)
    expo = expo.reshape(*lead, tr, tc)
    codes = codes.reshape(*lead, tr * th, tc * tw)[..., :m, :n]
    return BFPTensor(np.ascontiguousarray(codes), expo, fmt)


#: Elements of a chunk of tile-row bands that ``quantize`` handles at once (its temporaries stay
#: in a core's cache), and the size from which chunks are shared out to a thread per core (the
#: pool that ``gemm``'s blocks use too).
_CHUNK_ELEMENTS = 1 << 16
_PARALLEL_ELEMENTS = 1 << 19
_WORKERS = max(1, min(4, os.cpu_count() or 1))
_pool: ThreadPoolExecutor | None = None


def _run_chunks(work, chunks: list, parallel: bool) -> None:
    global _pool
    if not parallel or _WORKERS == 1 or len(chunks) == 1:
        work(chunks)
        return
    if _pool is None:
        _pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="hbfp-golden")
    for f in [_pool.submit(work, chunks[i::_WORKERS]) for i in range(_WORKERS)]:
        f.result()


def _key(seed: int) -> np.uint32:
    """The stochastic generator's key of ``seed``: ``mix32(seed ^ SEED_SALT)``."""
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise TypeError(f"seed must be an integer, got {seed!r}")
    return mix32(np.uint32((int(seed) ^ SEED_SALT) & 0xFFFF_FFFF))[()]


def _band_pattern(th: int, tw: int, tc: int) -> np.ndarray:
    """Stream positions within one tile-row band (``stream_index`` of its first band)."""
    c = np.arange(tc * tw, dtype=np.uint32)
    r = np.arange(th, dtype=np.uint32)
    return ((c // tw) * np.uint32(th * tw))[None, :] + (r * np.uint32(tw))[:, None] + (c % tw)[None, :]


def _band_bits(key: np.uint32, pattern: np.ndarray, b0: int, b1: int) -> np.ndarray:
    """``random_bits`` of bands ``b0``..``b1`` (uint32): each band's stream positions are the
    first band's plus ``band * th * tc * tw`` (mod 2**32)."""
    step = pattern.size
    base = (np.arange(b0, b1, dtype=np.uint64) * step).astype(np.uint32)
    x = pattern[None] + base[:, None, None]
    x ^= key
    x = mix32(x)
    x >>= np.uint32(32 - RANDOM_BITS)
    return x


def _quantize_bands(xb: np.ndarray, fmt: Format, b0: int, key, pattern, expo_out: np.ndarray,
                    codes_out: np.ndarray) -> None:
    """``quantize`` of whole tile-row bands ``xb`` (bands, th, tc * tw) of the padded matrix,
    the first of them band ``b0``: their exponents and codes into the two outputs."""
    th, tw = fmt.tile
    nb, _, width = xb.shape
    tc = width // tw
    field = xb.view(np.uint32) & bf16._F32_EXP  # the exponent field, in place
    tiled = (nb, th, tc, tw)
    # The shared exponent is the largest exponent field of the tile: floor(log2(amax)) + 127,
    # 0 for an all-zero tile (E = -127), 0xFF when the tile holds a NaN or an inf.
    expo = (field.reshape(tiled).max(axis=(1, 3)) >> np.uint32(23)).astype(np.uint8)
    expo_out[...] = expo
    nan = expo == EXP_NAN
    live = (expo != 0) & ~nan
    # DAZ: subnormals count as zeros, and so do the elements of NaN tiles. Tiles of exponent
    # code 0 (zeros and subnormals only) and NaN tiles are scaled by 0 below; a subnormal in
    # a live tile of field E becomes |y| < 2**(frac_bits + 1 - E), which no rounding makes a
    # nonzero code while E >= frac_bits + 1 + RANDOM_BITS: only below that, or with NaN tiles
    # (inf * 0), are elements zeroed first.
    xz = xb
    if nan.any() or (live.any() and int(expo[live].min()) < fmt.frac_bits + 1 + RANDOM_BITS):
        drop = field == 0
        if nan.any():
            drop |= np.repeat(np.repeat(nan, th, axis=0).reshape(nb, th, tc), tw, axis=2)
        xz = np.where(drop, np.float32(0), xb)
    # y = x * 2**(frac_bits - E): a power-of-two scaling, exact in fp32 while the scale is a
    # normal fp32 number (a y that lands subnormal is below 2**-126, a code of 0 in any
    # rounding); tiles with exponents at the very ends of the range go through fp64.
    shift = fmt.frac_bits + EXP_BIAS - expo.astype(np.int32)
    dtype = np.float32 if not live.any() or (shift[live].min() >= -126 and shift[live].max() <= 127) else np.float64
    scale = np.ldexp(dtype(1), np.clip(shift, -126, 127) if dtype is np.float32 else shift).astype(dtype)
    scale[~live] = 0
    y = (xz.astype(dtype, copy=False).reshape(tiled) * scale[:, None, :, None]).reshape(xb.shape)
    if fmt.rounding == "stochastic":
        bits = _band_bits(key, pattern, b0, b0 + nb)
        if dtype is np.float32 and fmt.mantissa_bits <= 16:
            # |y| < 2**15: |y| * 2**16 is exact in fp32, its integer part (the conversion
            # truncates) fits a uint32 with the random bits added.
            mag = np.abs(y)
            mag *= np.float32(1 << RANDOM_BITS)
            u = mag.astype(np.uint32)
            u += bits
            u >>= np.uint32(RANDOM_BITS)
            q = u.view(np.int32)
            np.negative(q, out=q, where=y < 0)
        else:
            q = _round(y.astype(np.float64), "stochastic", bits.astype(np.int64))
    elif fmt.rounding == "nearest_even":
        q = np.rint(y, out=y)
    else:
        q = np.trunc(y, out=y)
    np.clip(q, -fmt.qmax, fmt.qmax, out=q)
    codes_out[...] = q


def requantize(t: BFPTensor, fmt: Format, *, seed: int | None = None) -> BFPTensor:
    """Narrow the mantissas of a BFP tensor (for example HBFP16 -> HBFP8): the exponents are
    kept and ``code / 2**(src_bits - dst_bits)`` is rounded by ``fmt.rounding`` and saturated."""
    if not isinstance(t, BFPTensor):
        raise TypeError("requantize takes a BFPTensor")
    if fmt.tile != t.fmt.tile:
        raise ValueError(f"requantize keeps the tiles: {t.fmt.tile} != {fmt.tile}")
    shift = t.fmt.mantissa_bits - fmt.mantissa_bits
    if shift < 0:
        raise ValueError("requantize narrows mantissas; it cannot widen them")
    _check_stochastic(fmt, seed)
    y = np.ldexp(t.codes.astype(np.float64), -shift)
    rand = None
    if fmt.rounding == "stochastic":
        idx = stream_index(t.exponents.shape, fmt.tile)[..., : t.shape[-2], : t.shape[-1]]
        rand = random_bits(seed, idx)
    q = np.clip(_round(y, fmt.rounding, rand), -fmt.qmax, fmt.qmax)
    return BFPTensor(q.astype(fmt.code_dtype), t.exponents.copy(), fmt)
