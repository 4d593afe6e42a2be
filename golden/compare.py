"""Bit equality as the numerics contract states it (docs/numerics.md, section 5): two results
are the same when they have the same dtype, the same shape and the same bits, except that
NaNs compare by class (which NaN encoding appears is not part of the contract: any NaN
equals any NaN, whatever its sign and payload).

``same_bits(got, want)`` answers for a whole result; ``same_bits_elementwise(got, want)``
gives the element-by-element answer (for a report of where two results differ). They take:

- floating-point arrays and scalars (``float16``, ``float32``, ``float64``,
  ``ml_dtypes.bfloat16``): bits compared exactly, NaNs by class; ``+0`` and ``-0`` differ;
- integer and boolean arrays and scalars: values compared exactly. bf16 results that travel
  as their 16-bit patterns (``uint16``) compare exactly too, unless ``bf16_patterns=True``:
  then the patterns ``0x7F81..0x7FFF`` and ``0xFF81..0xFFFF`` are NaNs and compare by class
  (``f32_patterns=True`` does the same for fp32 patterns in ``uint32``);
- ``hbfp.golden.bfp.BFPTensor``: the same ``fmt`` (mantissa bits, tile and rounding), and
  codes and exponents the same arrays (dtype, shape, values). A NaN tile is its exponent
  code ``EXP_NAN``, so it needs no class rule.

Nothing is converted: a float32 result never equals a float64 one, a ``bfloat16`` array
never equals its ``uint16`` patterns, a (3, 4) array never equals a (12,) one, and a Python
float is a float64 scalar. Convert explicitly (``bf16.as_bits``, ``.astype``) when a
comparison across representations is what is meant.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .bfp import BFPTensor

__all__ = ["same_bits", "same_bits_elementwise", "describe_difference"]

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
#: dtype -> (unsigned view, exponent-and-mantissa mask, infinity pattern): a pattern whose
#: magnitude bits exceed the infinity's is a NaN.
_FLOATS = {
    np.dtype(np.float16): (np.uint16, 0x7FFF, 0x7C00),
    _BFLOAT16: (np.uint16, 0x7FFF, 0x7F80),
    np.dtype(np.float32): (np.uint32, 0x7FFF_FFFF, 0x7F80_0000),
    np.dtype(np.float64): (np.uint64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
}


def _nan_rule(dtype: np.dtype, bf16_patterns: bool, f32_patterns: bool):
    """(unsigned view, magnitude mask, infinity) of the NaN class for ``dtype``, or None when
    its values compare exactly."""
    if dtype in _FLOATS:
        return _FLOATS[dtype]
    if bf16_patterns and dtype == np.uint16:
        return _FLOATS[_BFLOAT16]
    if f32_patterns and dtype == np.uint32:
        return _FLOATS[np.dtype(np.float32)]
    return None


def _mismatch(got, want) -> str | None:
    """Why ``got`` and ``want`` cannot be compared element by element (None: they can)."""
    if isinstance(got, BFPTensor) or isinstance(want, BFPTensor):
        return "a BFPTensor has no elements to compare one by one" if isinstance(got, BFPTensor) and isinstance(
            want, BFPTensor) else f"{type(got).__name__} against {type(want).__name__}"
    g, w = np.asarray(got), np.asarray(want)
    if g.dtype != w.dtype:
        return f"dtype {g.dtype} against {w.dtype}"
    if g.shape != w.shape:
        return f"shape {g.shape} against {w.shape}"
    if g.dtype.kind not in "biuf" and g.dtype not in _FLOATS:
        return f"dtype {g.dtype} is not a number type"
    return None


def same_bits_elementwise(got, want, *, bf16_patterns: bool = False, f32_patterns: bool = False) -> np.ndarray:
    """A boolean array of ``got``'s shape: where the elements have the same bits (NaNs by
    class, see the module docstring). ``got`` and ``want`` must have the same dtype and shape
    (``ValueError`` otherwise: that is a difference of the whole, not of elements)."""
    why = _mismatch(got, want)
    if why:
        raise ValueError(f"cannot compare element by element: {why}")
    g, w = np.asarray(got), np.asarray(want)
    rule = _nan_rule(g.dtype, bf16_patterns, f32_patterns)
    if rule is None:
        return np.asarray(g == w)
    view, magnitude, inf = rule
    gb, wb = g.view(view), w.view(view)
    gnan = (gb & view(magnitude)) > view(inf)
    wnan = (wb & view(magnitude)) > view(inf)
    return np.asarray((gb == wb) | (gnan & wnan))


def same_bits(got, want, *, bf16_patterns: bool = False, f32_patterns: bool = False) -> bool:
    """Whether ``got`` and ``want`` are the same result: equal dtype and shape and equal bits,
    NaNs compared by class (module docstring). Also for ``BFPTensor`` (format, codes and
    exponents) and scalars. ``bf16_patterns``/``f32_patterns``: ``uint16``/``uint32`` arrays
    are bf16/fp32 patterns, their NaNs compared by class."""
    return describe_difference(got, want, bf16_patterns=bf16_patterns, f32_patterns=f32_patterns) is None


def describe_difference(got, want, *, bf16_patterns: bool = False, f32_patterns: bool = False) -> str | None:
    """None when ``same_bits(got, want)``, else a short account of the first difference found
    (type, format, dtype, shape, or how many elements differ and the first of them): for
    assertion messages."""
    if isinstance(got, BFPTensor) or isinstance(want, BFPTensor):
        if not (isinstance(got, BFPTensor) and isinstance(want, BFPTensor)):
            return f"{type(got).__name__} against {type(want).__name__}"
        if got.fmt != want.fmt:
            return f"format {got.fmt} against {want.fmt}"
        for part in ("exponents", "codes"):
            why = describe_difference(getattr(got, part), getattr(want, part))
            if why:
                return f"{part}: {why}"
        return None
    why = _mismatch(got, want)
    if why:
        return why
    ok = same_bits_elementwise(got, want, bf16_patterns=bf16_patterns, f32_patterns=f32_patterns)
    if ok.all():
        return None
    bad = np.argwhere(~ok) if ok.ndim else np.zeros((1, 0), int)
    first = tuple(int(i) for i in bad[0])
    g, w = np.asarray(got), np.asarray(want)
    return f"{int((~ok).sum())} of {ok.size} elements differ, first at {first}: {g[first]!r} against {w[first]!r}"
