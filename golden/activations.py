"""The bf16 activation units and their gradients (docs/numerics.md, section 4).

Every function takes bf16 bit patterns (anything ``bf16.as_bits`` accepts) and returns
``uint16`` patterns of the broadcast shape. Shared rules:

- DAZ: a subnormal input (exponent field 0, mantissa != 0) reads as a zero of its sign.
- FTZ: a result below 2**-126 in magnitude is a zero of its sign.
- A NaN input gives the quiet NaN ``QNAN`` with the input's sign; +-inf give the
  mathematical limits.

Piecewise-linear units (no table):

- ``relu(x)``: ``x`` for ``x > 0`` (``+inf`` included), ``+0`` otherwise (so ``relu(-0)`` is
  ``+0``).
- ``leaky_relu(x, shift)``: ``x`` for ``x >= +0``; ``x * 2**-shift`` for negative ``x``, made by
  decrementing the exponent field (exact), flushed to ``-0`` when the field would drop below
  1. ``-inf`` stays ``-inf`` and ``leaky_relu(-0) = -0`` (the product ``x * slope`` keeps the
  sign; unlike relu no comparator is needed on the negative side).

Table units (``gelu``, ``sigmoid``, ``tanh``, ``exp`` and the derivative units ``gelu_deriv``,
``sigmoid_deriv``, ``tanh_deriv``): each is a ``TableUnit`` with a window of biased exponent
fields ``[f_lo, f_hi]`` and a ROM of ``2 * (f_hi - f_lo + 1) * 128`` bf16 patterns read at::

    index = (sign * (f_hi - f_lo + 1) + (field - f_lo)) * 128 + mantissa

where ``sign``, ``field`` and ``mantissa`` are the input's 1, 8 and 7 bit fields. Inputs
outside the window take a rule instead:

- ``field < f_lo`` (zeros and DAZ'd subnormals included): ``small_rule``;
- ``field > f_hi`` (``+-inf`` included): ``large_rule_pos`` or ``large_rule_neg`` by sign;
- NaN: ``QNAN | sign``.

A rule is one of ``("const", pattern)``, ``("x",)`` (the input, DAZ applied) or ``("half",)``
(the input times 0.5 by exponent decrement, flushed to a zero of its sign when the field is
1 or 0). The ROM holds the correctly rounded result (one RNE rounding of the exact value,
then FTZ) of every input in the window, and the window is the smallest one whose outside
inputs all get their correctly rounded result from the rules, so every table unit is
correctly rounded on all 65,536 inputs. The ROMs are generated (``table_unit``) on first use
from float64 references (``reference``); ``midpoint_margins`` checks that those references
lie far enough from every bf16 rounding boundary that no libm last-bit difference can change
a ROM entry.

Gradients: ``<name>_grad(x, g) = bf16.mul(<name>_deriv(x), g)``, the product rounded once,
RNE/FTZ, as the multiplier after the derivative unit does it. ``relu_deriv(x)`` is 1.0 for
``x > 0`` and +0 otherwise; ``leaky_relu_deriv(x, shift)`` is 1.0 for ``x > 0`` and
``2**-shift`` otherwise (zeros included); both give NaN for a NaN ``x``. Because the gradient
is a real multiplication, ``relu_grad(x, g)`` for ``x <= 0`` is a zero carrying the sign of
``g`` (``+0 * g``), and NaN when ``g`` is NaN or infinite.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from . import bf16
from .bf16 import QNAN, as_bits, from_f64, to_f32

__all__ = [
    "evaluate",
    "LEAKY_SHIFT",
    "TABLE_NAMES",
    "REFERENCE_NAMES",
    "Rule",
    "RULE_KINDS",
    "TableUnit",
    "TABLES",
    "UNARY",
    "DERIVATIVES",
    "GRADIENTS",
    "get",
    "table_unit",
    "reference",
    "midpoint_margins",
    "relu",
    "leaky_relu",
    "gelu",
    "sigmoid",
    "tanh",
    "exp",
    "relu_deriv",
    "leaky_relu_deriv",
    "gelu_deriv",
    "sigmoid_deriv",
    "tanh_deriv",
    "relu_grad",
    "leaky_relu_grad",
    "gelu_grad",
    "sigmoid_grad",
    "tanh_grad",
]

#: Default leaky_relu negative slope is ``2**-LEAKY_SHIFT`` (1/128, close to the usual 0.01).
LEAKY_SHIFT = 7

#: bf16 field layout.
MANT_BITS = 7
MANT_COUNT = 1 << MANT_BITS
FIELD_INF = 0xFF
_SIGN = np.uint16(0x8000)
_ABS = np.uint16(0x7FFF)
_INF = np.uint16(0x7F80)
_ONE = 0x3F80
_HALF = 0x3F00
_QUARTER = 0x3E80
_NEG_ONE = 0xBF80
_POS_ZERO = 0x0000
_NEG_ZERO = 0x8000
_POS_INF = 0x7F80

_SQRT1_2 = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

# Rounding boundaries of float64 -> bf16 that are not midpoints inside a binade: values
# below _FTZ_EDGE flush to zero (the midpoint between 2**-126 and its 8-bit predecessor
# 2**-126 - 2**-134), values at or above _OVF_EDGE round to inf (the midpoint between the
# largest finite bf16 and 2**128).
_FTZ_EDGE = 2.0**-126 - 2.0**-135
_OVF_EDGE = 2.0**128 - 2.0**119

#: A rule for inputs outside a table window: ``("const", pattern)``, ``("x",)`` or ``("half",)``.
Rule = tuple

#: The rule kinds a ``Rule`` can name (its first element).
RULE_KINDS = ("const", "x", "half")


def _nan_out(b: np.ndarray) -> np.ndarray:
    return (b & _SIGN) | np.uint16(QNAN)


def _is_nan(b: np.ndarray) -> np.ndarray:
    return (b & _ABS) > _INF


def _is_positive(b: np.ndarray) -> np.ndarray:
    """x > 0 after DAZ: sign clear, field non-zero, not NaN (+inf included)."""
    field = (b >> np.uint16(MANT_BITS)) & np.uint16(0xFF)
    return ((b & _SIGN) == 0) & (field != 0) & ~_is_nan(b)


# ---------------------------------------------------------------------------------------
# float64 references (the exact values the ROMs are the correct rounding of)
# ---------------------------------------------------------------------------------------


def _erfc(t: np.ndarray) -> np.ndarray:
    return np.frompyfunc(math.erfc, 1, 1)(t).astype(np.float64)


def _ref_exp(x):
    # exp overflows float64 only far above bf16's range; inf is then the right limit.
    with np.errstate(over="ignore"):
        return np.exp(x)


def _ref_sigmoid(x):
    # exp(-|x|) never overflows; each branch is a quotient of positive terms.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _ref_tanh(x):
    # expm1 keeps full relative precision near 0 where 1 - exp(-2|x|) would cancel.
    m = np.expm1(-2.0 * np.abs(x))
    return np.copysign(-m / (2.0 + m), x)


def _ref_gelu(x):
    return 0.5 * x * _erfc(-x * _SQRT1_2)


def _ref_sigmoid_deriv(x):
    e = np.exp(-np.abs(x))
    return e / (1.0 + e) ** 2


def _ref_tanh_deriv(x):
    e = np.exp(-2.0 * np.abs(x))
    return 4.0 * e / (1.0 + e) ** 2


def _ref_gelu_deriv(x):
    y = 0.5 * _erfc(-x * _SQRT1_2) + x * np.exp(-0.5 * x * x) * _INV_SQRT_2PI
    # Below x = -38.6 both terms underflow float64 to +0 (+0 + -0); the exact value is
    # negative there (gelu' < 0 for all x < -0.75), so its zero is -0.
    return np.where((y == 0) & (x < 0), -0.0, y)


def _ref_relu(x):
    return np.where(x > 0, x, 0.0)


def _ref_relu_deriv(x):
    return np.where(x > 0, 1.0, 0.0)


# name -> (finite-input formula, value at -inf, value at +inf)
_REFERENCES: dict[str, tuple[Callable[[np.ndarray], np.ndarray], float, float]] = {
    "relu": (_ref_relu, 0.0, math.inf),
    "gelu": (_ref_gelu, -0.0, math.inf),
    "sigmoid": (_ref_sigmoid, 0.0, 1.0),
    "tanh": (_ref_tanh, -1.0, 1.0),
    "exp": (_ref_exp, 0.0, math.inf),
    "relu_deriv": (_ref_relu_deriv, 0.0, 1.0),
    "gelu_deriv": (_ref_gelu_deriv, -0.0, 1.0),
    "sigmoid_deriv": (_ref_sigmoid_deriv, 0.0, 0.0),
    "tanh_deriv": (_ref_tanh_deriv, 0.0, 0.0),
}

#: Names ``reference`` accepts.
REFERENCE_NAMES = (
    "relu",
    "leaky_relu",
    "gelu",
    "sigmoid",
    "tanh",
    "exp",
    "relu_deriv",
    "leaky_relu_deriv",
    "gelu_deriv",
    "sigmoid_deriv",
    "tanh_deriv",
)


def check_shift(shift, name: str = "shift") -> int:
    """A leaky_relu shift as a non-negative int (clear errors for anything else)."""
    if isinstance(shift, bool):
        raise TypeError(f"{name} must be a non-negative int, not bool")
    s = operator.index(shift)
    if s < 0:
        raise ValueError(f"{name} must be non-negative, got {s}")
    return s


def reference(name: str, x, *, shift: int = LEAKY_SHIFT) -> np.ndarray:
    """The float64 reference value of unit ``name`` (one of ``REFERENCE_NAMES``) at the bf16
    inputs ``x``, unrounded: DAZ on the input, NaN for NaN, the limits at +-inf.

    ``shift`` is the leaky_relu slope exponent (only used by the ``leaky_relu`` names)."""
    if name not in REFERENCE_NAMES:
        raise ValueError(f"unknown reference {name!r}; known: {', '.join(REFERENCE_NAMES)}")
    b = as_bits(x)
    # Quiet every NaN first: widening a signalling NaN would raise the invalid flag.
    v = to_f32(np.where(_is_nan(b), _nan_out(b), b)).astype(np.float64)
    finite = np.isfinite(v)
    xf = np.where(finite, v, 0.0)
    if name in ("leaky_relu", "leaky_relu_deriv"):
        slope = 2.0 ** -check_shift(shift)
        if name == "leaky_relu":
            # Exact; inf is kept even when the slope underflows float64 (huge shifts).
            y = np.where((v >= 0) | ~finite, v, xf * slope)
        else:
            y = np.where(v > 0, 1.0, slope)
        return np.where(np.isnan(v), np.nan, y)
    formula, at_neg_inf, at_pos_inf = _REFERENCES[name]
    y = formula(xf)
    y = np.where(v == -np.inf, at_neg_inf, y)
    y = np.where(v == np.inf, at_pos_inf, y)
    return np.where(np.isnan(v), np.nan, y)


# ---------------------------------------------------------------------------------------
# Table units
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TableUnit:
    """One table activation unit as the gateware builds it.

    ``f_lo``/``f_hi``: the window of biased exponent fields served by the ROM;
    ``small_rule``: the rule for fields below ``f_lo``; ``large_rule_pos``/``large_rule_neg``:
    the rules for fields above ``f_hi`` (inf included) of positive/negative inputs;
    ``rom``: read-only ``uint16`` array of ``rom_entries`` patterns, indexed by
    ``(sign * fields + (field - f_lo)) * 128 + mantissa`` with ``fields = f_hi - f_lo + 1``.
    Calling the unit evaluates it on bf16 patterns."""

    name: str
    f_lo: int
    f_hi: int
    small_rule: Rule
    large_rule_pos: Rule
    large_rule_neg: Rule
    rom: np.ndarray

    @property
    def fields(self) -> int:
        """Number of exponent fields in the window."""
        return self.f_hi - self.f_lo + 1

    @property
    def rom_entries(self) -> int:
        """Number of 16-bit ROM words."""
        return int(self.rom.size)

    @property
    def rom_bits(self) -> int:
        """ROM size in bits (16 per entry)."""
        return 16 * self.rom_entries

    def __call__(self, x) -> np.ndarray:
        """The unit's output patterns for the bf16 inputs ``x``."""
        b = as_bits(x)
        sign = b & _SIGN
        field = ((b >> np.uint16(MANT_BITS)) & np.uint16(0xFF)).astype(np.int32)
        mant = (b & np.uint16(MANT_COUNT - 1)).astype(np.int32)
        neg = sign != 0
        # The ROM address is built from the raw fields; out-of-window addresses are clamped
        # (their word is discarded by the rule multiplexer below).
        offset = np.clip(field - self.f_lo, 0, self.fields - 1)
        out = self.rom[(neg.astype(np.int32) * self.fields + offset) * MANT_COUNT + mant]
        large = field > self.f_hi
        out = np.where(field < self.f_lo, _apply_rule(self.small_rule, b), out)
        out = np.where(large & ~neg, _apply_rule(self.large_rule_pos, b), out)
        out = np.where(large & neg, _apply_rule(self.large_rule_neg, b), out)
        return np.where((b & _ABS) > _INF, sign | np.uint16(QNAN), out).astype(np.uint16)


def _apply_rule(rule: Rule, b: np.ndarray) -> np.ndarray:
    """Evaluate a rule on patterns ``b`` (only its result on the rule's region is used)."""
    kind = rule[0]
    sign = b & _SIGN
    field = (b >> np.uint16(MANT_BITS)) & np.uint16(0xFF)
    if kind == "const":
        return np.full(b.shape, rule[1], dtype=np.uint16)
    if kind == "x":
        # DAZ: a subnormal input passes through as a zero of its sign.
        return np.where(field == 0, sign, b)
    if kind == "half":
        # Exponent decrement; field 1 would become subnormal and field 0 is a zero: both
        # give a zero of the input's sign (FTZ). inf stays inf.
        halved = b - np.uint16(1 << MANT_BITS)
        return np.where(field <= 1, sign, np.where(field == FIELD_INF, b, halved))
    raise ValueError(f"unknown rule {rule!r}")


# name -> (reference name, small rule, large rule for +, large rule for -)
_TABLE_SPECS: dict[str, tuple[str, Rule, Rule, Rule]] = {
    "exp": ("exp", ("const", _ONE), ("const", _POS_INF), ("const", _POS_ZERO)),
    "sigmoid": ("sigmoid", ("const", _HALF), ("const", _ONE), ("const", _POS_ZERO)),
    "tanh": ("tanh", ("x",), ("const", _ONE), ("const", _NEG_ONE)),
    "gelu": ("gelu", ("half",), ("x",), ("const", _NEG_ZERO)),
    "sigmoid_deriv": (
        "sigmoid_deriv",
        ("const", _QUARTER),
        ("const", _POS_ZERO),
        ("const", _POS_ZERO),
    ),
    "tanh_deriv": ("tanh_deriv", ("const", _ONE), ("const", _POS_ZERO), ("const", _POS_ZERO)),
    # gelu'(x) = Phi(x) + x phi(x) is negative for x < -0.75 and underflows there: -0.
    "gelu_deriv": ("gelu_deriv", ("const", _HALF), ("const", _ONE), ("const", _NEG_ZERO)),
}

#: Names of the table units (``table_unit`` / ``TABLES`` keys).
TABLE_NAMES = tuple(_TABLE_SPECS)


def _all_patterns() -> np.ndarray:
    """Every bf16 pattern, shaped (sign, field, mantissa) = (2, 256, 128)."""
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(2, 256, MANT_COUNT)


@functools.lru_cache(maxsize=None)
def table_unit(name: str) -> TableUnit:
    """Generate the table unit ``name`` (one of ``TABLE_NAMES``): the correctly rounded
    results of every input, the smallest window outside which the unit's rules reproduce
    them, and the ROM of the window. Deterministic; cached."""
    if name not in _TABLE_SPECS:
        raise ValueError(f"unknown table unit {name!r}; known: {', '.join(TABLE_NAMES)}")
    ref_name, small, large_pos, large_neg = _TABLE_SPECS[name]
    for rule in (small, large_pos, large_neg):
        if rule[0] not in RULE_KINDS:
            raise ValueError(f"unknown rule {rule!r}")
    pats = _all_patterns()
    cr = from_f64(reference(ref_name, pats))
    finite = pats[:, :FIELD_INF, :]
    cr_finite = cr[:, :FIELD_INF, :]
    if bf16.is_nan(cr_finite).any():
        raise AssertionError(f"{name}: NaN reference at a finite input")

    # Per field: does the rule give the correctly rounded result on every mantissa (and, for
    # the small rule, on both signs)?
    small_ok = (_apply_rule(small, finite) == cr_finite).all(axis=(0, 2))
    large_ok = np.stack(
        [
            (_apply_rule(large_pos, finite[0]) == cr_finite[0]).all(axis=1),
            (_apply_rule(large_neg, finite[1]) == cr_finite[1]).all(axis=1),
        ]
    ).all(axis=0)
    if small_ok.all() or large_ok.all():
        raise AssertionError(f"{name}: a rule covers every field; no table needed")
    f_lo = int(np.argmin(small_ok))  # first field where the small rule fails
    f_hi = int(FIELD_INF - 1 - np.argmin(large_ok[::-1]))  # last field where a large rule fails
    if f_lo == 0 or f_hi == FIELD_INF - 1 or f_lo > f_hi:
        raise AssertionError(f"{name}: rules do not fit the function (window [{f_lo}, {f_hi}])")
    infs = np.array([_POS_INF, _POS_INF | _NEG_ZERO], dtype=np.uint16)
    for rule, pattern, want in zip((large_pos, large_neg), infs, cr[:, FIELD_INF, 0]):
        if _apply_rule(rule, np.array([pattern]))[0] != want:
            raise AssertionError(f"{name}: large rule {rule} is not the limit at inf")
    rom = np.ascontiguousarray(cr[:, f_lo : f_hi + 1, :]).reshape(-1)
    rom.flags.writeable = False
    return TableUnit(name, f_lo, f_hi, small, large_pos, large_neg, rom)


class _Tables(Mapping):
    """Read-only mapping name -> ``TableUnit``, generated on first access."""

    def __getitem__(self, name: str) -> TableUnit:
        if name not in _TABLE_SPECS:
            raise KeyError(name)
        return table_unit(name)

    def __iter__(self) -> Iterator[str]:
        return iter(TABLE_NAMES)

    def __len__(self) -> int:
        return len(TABLE_NAMES)

    def __repr__(self) -> str:
        return f"TABLES({', '.join(TABLE_NAMES)})"


#: name -> ``TableUnit`` for every name in ``TABLE_NAMES`` (generated lazily).
TABLES: Mapping[str, TableUnit] = _Tables()


def _midpoint_distance(r: np.ndarray) -> np.ndarray:
    """Relative distance of each float64 value to the nearest float64 -> bf16 rounding
    boundary (RNE midpoints of the 8-bit grid, the FTZ edge, the overflow edge); inf for
    zeros, infinities and NaNs (they round exactly)."""
    a = np.abs(r)
    out = np.full(a.shape, np.inf)
    with np.errstate(invalid="ignore"):
        normal = (a >= 2.0**-126) & (a < 2.0**128)
        tiny = (a > 0) & (a < 2.0**-126)
        huge = (a >= 2.0**128) & np.isfinite(a)
    # Scale each normal value into [128, 256): midpoints are then the odd multiples of 0.5.
    frac, exp2 = np.frexp(np.where(normal, a, 1.0))
    m = frac * 256.0
    out = np.where(normal, np.abs(m - np.floor(m) - 0.5) / m, out)
    out = np.where(tiny, np.abs(a - _FTZ_EDGE) / np.where(tiny, a, 1.0), out)
    return np.where(huge, (a - _OVF_EDGE) / np.where(huge, a, 1.0), out)


def midpoint_margins() -> dict[str, float]:
    """For every table unit: the smallest relative distance between its float64 reference
    at any finite input and the nearest bf16 rounding boundary. A reference error smaller
    than this (libm differences are ~2**-52) cannot change a ROM entry or a rule decision."""
    pats = _all_patterns()[:, :FIELD_INF, :]
    return {
        name: float(_midpoint_distance(reference(spec[0], pats)).min())
        for name, spec in _TABLE_SPECS.items()
    }


# ---------------------------------------------------------------------------------------
# Public units
# ---------------------------------------------------------------------------------------


def relu(x) -> np.ndarray:
    """max(x, +0): ``x`` where ``x > 0``, ``+0`` for zeros, subnormals and negatives; NaN kept."""
    b = as_bits(x)
    out = np.where(_is_positive(b), b, np.uint16(_POS_ZERO))
    return np.where(_is_nan(b), _nan_out(b), out).astype(np.uint16)


def leaky_relu(x, shift: int = LEAKY_SHIFT) -> np.ndarray:
    """``x`` for ``x >= 0``, ``x * 2**-shift`` for ``x < 0`` (exact by exponent decrement,
    ``-0`` when it falls below 2**-126, ``-inf`` kept); ``leaky_relu(-0) = -0``; DAZ; NaN kept."""
    # Any shift past 254 flushes every finite negative input; clamping keeps int32 exact.
    s = min(check_shift(shift), 0xFF)
    b = as_bits(x)
    sign = b & _SIGN
    field = ((b >> np.uint16(MANT_BITS)) & np.uint16(0xFF)).astype(np.int32)
    daz = np.where(field == 0, sign, b)
    new_field = field - s
    scaled = (b & ~np.uint16(0x7F80)) | (np.clip(new_field, 0, 0xFF).astype(np.uint16) << 7)
    neg_out = np.where(new_field < 1, sign, scaled)
    neg_out = np.where(field == FIELD_INF, b, neg_out)  # -inf * slope = -inf
    out = np.where((sign != 0) & (field != 0), neg_out, daz)
    return np.where(_is_nan(b), _nan_out(b), out).astype(np.uint16)


def gelu(x) -> np.ndarray:
    """GELU, x * Phi(x) (exact erf form), correctly rounded (table unit ``gelu``)."""
    return table_unit("gelu")(x)


def sigmoid(x) -> np.ndarray:
    """1 / (1 + exp(-x)), correctly rounded (table unit ``sigmoid``)."""
    return table_unit("sigmoid")(x)


def tanh(x) -> np.ndarray:
    """tanh(x), correctly rounded (table unit ``tanh``)."""
    return table_unit("tanh")(x)


def exp(x) -> np.ndarray:
    """exp(x), correctly rounded, overflow to +inf, FTZ (table unit ``exp``)."""
    return table_unit("exp")(x)


def relu_deriv(x) -> np.ndarray:
    """relu'(x): 1.0 for ``x > 0`` (+inf included), +0 otherwise (zeros included); NaN kept."""
    b = as_bits(x)
    out = np.where(_is_positive(b), np.uint16(_ONE), np.uint16(_POS_ZERO))
    return np.where(_is_nan(b), _nan_out(b), out).astype(np.uint16)


def leaky_relu_deriv(x, shift: int = LEAKY_SHIFT) -> np.ndarray:
    """leaky_relu'(x): 1.0 for ``x > 0``, ``2**-shift`` otherwise (zeros included; +0 when
    ``2**-shift`` is below 2**-126); NaN kept."""
    s = check_shift(shift)
    b = as_bits(x)
    slope = np.uint16((127 - s) << MANT_BITS) if s < 127 else np.uint16(_POS_ZERO)
    out = np.where(_is_positive(b), np.uint16(_ONE), slope)
    return np.where(_is_nan(b), _nan_out(b), out).astype(np.uint16)


def gelu_deriv(x) -> np.ndarray:
    """gelu'(x) = Phi(x) + x * phi(x), correctly rounded (table unit ``gelu_deriv``)."""
    return table_unit("gelu_deriv")(x)


def sigmoid_deriv(x) -> np.ndarray:
    """sigmoid'(x) = sigmoid(x) * (1 - sigmoid(x)), correctly rounded (``sigmoid_deriv``)."""
    return table_unit("sigmoid_deriv")(x)


def tanh_deriv(x) -> np.ndarray:
    """tanh'(x) = 1 - tanh(x)**2, correctly rounded (table unit ``tanh_deriv``)."""
    return table_unit("tanh_deriv")(x)


def relu_grad(x, g) -> np.ndarray:
    """``bf16.mul(relu_deriv(x), g)``: g where x > 0, else a zero with g's sign (NaN for g
    NaN or inf)."""
    return bf16.mul(relu_deriv(x), g)


def leaky_relu_grad(x, g, shift: int = LEAKY_SHIFT) -> np.ndarray:
    """``bf16.mul(leaky_relu_deriv(x, shift), g)``."""
    return bf16.mul(leaky_relu_deriv(x, shift), g)


def gelu_grad(x, g) -> np.ndarray:
    """``bf16.mul(gelu_deriv(x), g)``."""
    return bf16.mul(gelu_deriv(x), g)


def sigmoid_grad(x, g) -> np.ndarray:
    """``bf16.mul(sigmoid_deriv(x), g)``."""
    return bf16.mul(sigmoid_deriv(x), g)


def tanh_grad(x, g) -> np.ndarray:
    """``bf16.mul(tanh_deriv(x), g)``."""
    return bf16.mul(tanh_deriv(x), g)


#: name -> unary function of one bf16 argument.
UNARY: Mapping[str, Callable[..., np.ndarray]] = {
    "relu": relu,
    "leaky_relu": leaky_relu,
    "gelu": gelu,
    "sigmoid": sigmoid,
    "tanh": tanh,
    "exp": exp,
}

#: name -> derivative unit (one bf16 argument), for every name in ``GRADIENTS``.
DERIVATIVES: Mapping[str, Callable[..., np.ndarray]] = {
    "relu": relu_deriv,
    "leaky_relu": leaky_relu_deriv,
    "gelu": gelu_deriv,
    "sigmoid": sigmoid_deriv,
    "tanh": tanh_deriv,
}

#: name -> gradient function ``(x, g)``.
GRADIENTS: Mapping[str, Callable[..., np.ndarray]] = {
    "relu": relu_grad,
    "leaky_relu": leaky_relu_grad,
    "gelu": gelu_grad,
    "sigmoid": sigmoid_grad,
    "tanh": tanh_grad,
}

_KINDS = {"unary": UNARY, "deriv": DERIVATIVES, "grad": GRADIENTS}


def get(name: str, kind: str = "unary", leaky_shift: int | None = None) -> Callable[..., np.ndarray]:
    """The function registered as ``name`` in ``UNARY`` (``kind="unary"``), ``DERIVATIVES``
    (``"deriv"``) or ``GRADIENTS`` (``"grad"``); ``ValueError`` listing the names otherwise.
    ``leaky_shift``: leaky_relu's slope exponent bound into its functions (a device's; None:
    their default ``LEAKY_SHIFT``)."""
    if kind not in _KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of: {', '.join(_KINDS)}")
    registry = _KINDS[kind]
    if name not in registry:
        raise ValueError(
            f"unknown {kind} activation {name!r}; expected one of: {', '.join(registry)}"
        )
    fn = registry[name]
    if name == "leaky_relu" and leaky_shift is not None:
        shift = check_shift(leaky_shift, "leaky_shift")
        return lambda *args: fn(*args, shift)
    return fn


def evaluate(name: str, x, g=None, leaky_shift: int = LEAKY_SHIFT) -> np.ndarray:
    """What the activation unit's function ``name`` computes on bf16 patterns ``x`` (and the
    upstream gradient ``g`` for a gradient function, named ``<name>_grad``) with the unit's
    ``leaky_shift``: the ``emu`` device's ELEMENTWISE, and the host's for a device built
    without the unit. ``ValueError`` for an unknown name."""
    if name.endswith("_grad"):
        if g is None:
            raise TypeError(f"{name} needs the upstream gradient g")
        return get(name[: -len("_grad")], "grad", leaky_shift=leaky_shift)(x, g)
    return get(name, leaky_shift=leaky_shift)(x)
