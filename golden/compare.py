"""Bit equality as the numerics contract states it (docs/numerics.md): two results are the
same when they have the same dtype, the same shape and the same bits. NaNs too: the contract
names the NaN every operation makes (its sign and payload), so a NaN equals only a NaN of the
same pattern.

``same_bits(got, want)`` answers for a whole result; ``same_bits_elementwise(got, want)``
gives the element-by-element answer (for a report of where two results differ). They take:

- floating-point arrays and scalars (``float16``, ``float32``, ``float64``,
  ``ml_dtypes.bfloat16``): bits compared exactly (``+0`` and ``-0`` differ, and so do two NaN
  patterns);
- integer and boolean arrays and scalars: values compared exactly (bf16 and fp32 results
  that travel as their patterns, ``uint16`` and ``uint32``, included);
- ``hbfp.golden.bfp.BFPTensor``: the same ``fmt`` (mantissa bits, tile and rounding), and
  codes and exponents the same arrays (dtype, shape, values). A NaN tile is its exponent
  code ``EXP_NAN``.

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

#: float dtype -> the unsigned integer of its width: floats compare as their bits.
_FLOATS = {
    np.dtype(np.float16): np.uint16,
    np.dtype(ml_dtypes.bfloat16): np.uint16,
    np.dtype(np.float32): np.uint32,
    np.dtype(np.float64): np.uint64,
}


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


def same_bits_elementwise(got, want) -> np.ndarray:
    """A boolean array of ``got``'s shape: where the elements have the same bits. ``got`` and
    ``want`` must have the same dtype and shape (``ValueError`` otherwise: that is a
    difference of the whole, not of elements)."""
    why = _mismatch(got, want)
    if why:
        raise ValueError(f"cannot compare element by element: {why}")
    g, w = np.asarray(got), np.asarray(want)
    view = _FLOATS.get(g.dtype)
    if view is None:
        return np.asarray(g == w)
    return np.asarray(g.view(view) == w.view(view))


def same_bits(got, want) -> bool:
    """Whether ``got`` and ``want`` are the same result: equal dtype and shape and equal bits
    (module docstring). Also for ``BFPTensor`` (format, codes and exponents) and scalars."""
    return describe_difference(got, want) is None


def describe_difference(got, want) -> str | None:
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
    ok = same_bits_elementwise(got, want)
    if ok.all():
        return None
    bad = np.argwhere(~ok) if ok.ndim else np.zeros((1, 0), int)
    first = tuple(int(i) for i in bad[0])
    g, w = np.asarray(got), np.asarray(want)
    return f"{int((~ok).sum())} of {ok.size} elements differ, first at {first}: {g[first]!r} against {w[first]!r}"
