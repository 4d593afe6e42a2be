"""The bf16 activation units (golden/activations.py) against references written here.

The expected outputs are computed in this file from float64 formulas that differ from the
module's (np.tanh, math.exp, cosh forms, and a normal CDF by Marsaglia's series and the
Laplace continued fraction instead of libm's erfc), rounded once with ``bf16.from_f64``.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from hbfp.golden import activations as act
from hbfp.golden import bf16
from hbfp.golden.compare import same_bits

ALL = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
FIELD = (ALL >> 7) & 0xFF
NAN_IN = (ALL & 0x7FFF) > 0x7F80
FINITE_IN = FIELD != 0xFF
POS_INF, NEG_INF = np.uint16(0x7F80), np.uint16(0xFF80)
ONE, HALF = 0x3F80, 0x3F00
PZERO, NZERO = 0x0000, 0x8000

SQRT_2PI = math.sqrt(2.0 * math.pi)
# Below this |x| the normal CDF comes from Marsaglia's series, above from the continued
# fraction: both converge to float64 precision there with the term counts below, and the
# series' cancellation (1/2 - phi * sum for x < 0) stays small (relative error < 2**-48).
SERIES_LIMIT = 1.0
SERIES_TERMS = 60
CF_TERMS = 400


def values(bits) -> np.ndarray:
    """float64 values of bf16 patterns with DAZ (NaN patterns quieted first)."""
    b = np.asarray(bits, dtype=np.uint16)
    b = np.where((b & 0x7FFF) > 0x7F80, np.uint16(0x7FC0), b)
    return bf16.to_f32(b).astype(np.float64)


def npdf(x):
    return np.exp(-0.5 * x * x) / SQRT_2PI


def marsaglia_sum(x):
    """sum over k of x**(2k+1) / (2k+1)!!, so that Phi(x) = 1/2 + phi(x) * sum."""
    term = x.copy()
    total = x.copy()
    for k in range(1, SERIES_TERMS):
        term = term * (x * x) / (2 * k + 1)
        total = total + term
    return total


def mills_ratio(a):
    """(1 - Phi(a)) / phi(a) for a > 0 by Laplace's continued fraction
    1 / (a + 1 / (a + 2 / (a + 3 / (a + ...)))), evaluated backwards."""
    k = a.copy()
    for j in range(CF_TERMS, 0, -1):
        k = a + j / k
    return 1.0 / k


def gelu_and_deriv(x):
    """(x * Phi(x), Phi(x) + x * phi(x)) for finite x, free of cancellation."""
    a = np.abs(x)
    p = npdf(x)
    near = a < SERIES_LIMIT
    cdf_near = 0.5 + p * marsaglia_sum(np.where(near, x, 0.0))
    tail = p * mills_ratio(np.where(near, SERIES_LIMIT, a))  # 1 - Phi(|x|)
    cdf = np.where(near, cdf_near, np.where(x < 0, tail, 1.0 - tail))
    # For x < 0 in the tail, Phi(x) + x phi(x) = phi(x) * (R(|x|) - |x|): no cancellation.
    r = mills_ratio(np.where(near, SERIES_LIMIT, a))
    deriv_tail_neg = p * (r - a)
    deriv = np.where(~near & (x < 0), deriv_tail_neg, cdf + x * p)
    return x * cdf, deriv


def t_exp(x):
    return np.array([math.inf if v > 709.0 else math.exp(v) for v in x.tolist()])


def t_sigmoid(x):
    with np.errstate(over="ignore"):
        neg = 1.0 / (1.0 + np.exp(-x))
    return np.where(x >= 0, 0.5 * (1.0 + np.tanh(0.5 * x)), neg)


def t_tanh(x):
    return np.tanh(x)


def t_gelu(x):
    return gelu_and_deriv(x)[0]


def t_gelu_deriv(x):
    return gelu_and_deriv(x)[1]


def t_sigmoid_deriv(x):
    with np.errstate(over="ignore"):
        return 0.25 / np.cosh(0.5 * x) ** 2


def t_tanh_deriv(x):
    with np.errstate(over="ignore"):
        return 1.0 / np.cosh(x) ** 2


def t_relu(x):
    return np.where(x > 0, x, 0.0)


def t_leaky(x, shift=act.LEAKY_SHIFT):
    slope = 2.0**-shift  # 0.0 for huge shifts: -inf must stay -inf, not -inf * 0
    return np.where((x >= 0) | np.isinf(x), x, np.where(np.isinf(x), 0.0, x) * slope)


def t_relu_deriv(x):
    return np.where(x > 0, 1.0, 0.0)


def t_leaky_deriv(x, shift=act.LEAKY_SHIFT):
    return np.where(x > 0, 1.0, 2.0**-shift)


# name -> (module function, test formula for finite inputs, output at -inf, output at +inf)
UNITS = {
    "relu": (act.relu, t_relu, PZERO, 0x7F80),
    "leaky_relu": (act.leaky_relu, t_leaky, 0xFF80, 0x7F80),
    "gelu": (act.gelu, t_gelu, NZERO, 0x7F80),
    "sigmoid": (act.sigmoid, t_sigmoid, PZERO, ONE),
    "tanh": (act.tanh, t_tanh, 0xBF80, ONE),
    "exp": (act.exp, t_exp, PZERO, 0x7F80),
    "relu_deriv": (act.relu_deriv, t_relu_deriv, PZERO, ONE),
    "leaky_relu_deriv": (act.leaky_relu_deriv, t_leaky_deriv, 0x3C00, ONE),
    "gelu_deriv": (act.gelu_deriv, t_gelu_deriv, NZERO, ONE),
    "sigmoid_deriv": (act.sigmoid_deriv, t_sigmoid_deriv, PZERO, PZERO),
    "tanh_deriv": (act.tanh_deriv, t_tanh_deriv, PZERO, PZERO),
}

DERIV_OF = {
    "relu": "relu_deriv",
    "leaky_relu": "leaky_relu_deriv",
    "gelu": "gelu_deriv",
    "sigmoid": "sigmoid_deriv",
    "tanh": "tanh_deriv",
}

_EXPECTED: dict[str, np.ndarray] = {}


def expected(name: str) -> np.ndarray:
    """The correctly rounded output of unit ``name`` for all 65,536 inputs, computed here."""
    if name not in _EXPECTED:
        _, formula, at_neg_inf, at_pos_inf = UNITS[name]
        x = values(ALL)
        y = formula(np.where(FINITE_IN, x, 0.0))
        out = bf16.from_f64(y)
        out = np.where(ALL == NEG_INF, np.uint16(at_neg_inf), out)
        out = np.where(ALL == POS_INF, np.uint16(at_pos_inf), out)
        _EXPECTED[name] = np.where(NAN_IN, (ALL & np.uint16(0x8000)) | np.uint16(bf16.QNAN), out).astype(np.uint16)
    return _EXPECTED[name]


def expected_deriv_at(name: str, x_bits) -> np.ndarray:
    return expected(DERIV_OF[name])[np.asarray(x_bits, dtype=np.uint16)]


# --------------------------------------------------------------------------- exhaustive


@pytest.mark.parametrize("name", list(UNITS))
def test_correctly_rounded_on_every_input(name):
    fn = UNITS[name][0]
    out = fn(ALL)
    assert out.dtype == np.uint16 and out.shape == ALL.shape
    want = expected(name)
    dist = bf16.ulp_distance(out, want)
    bad = np.flatnonzero(dist)
    assert bad.size == 0, (
        f"{name}: {bad.size} inputs differ, max {dist.max()} ULP; first "
        + ", ".join(f"x={b:#06x} got {out[b]:#06x} want {want[b]:#06x}" for b in bad[:5])
    )
    # bit for bit: signed zeros, and a NaN input's QNAN with its sign
    assert same_bits(out, want)


@pytest.mark.parametrize("name", list(UNITS))
def test_nan_in_nan_out_with_sign(name):
    fn = UNITS[name][0]
    nans = ALL[NAN_IN]
    out = fn(nans)
    assert bf16.is_nan(out).all()
    assert ((out & 0x8000) == (nans & 0x8000)).all()
    assert set(np.unique(out & 0x7FFF).tolist()) == {0x7FC0}


@pytest.mark.parametrize("name", list(UNITS))
def test_outputs_never_subnormal_and_nan_only_from_nan(name):
    out = UNITS[name][0](ALL)
    assert not (((out & 0x7F80) == 0) & ((out & 0x7F) != 0)).any()
    assert (bf16.is_nan(out) == NAN_IN).all()


@pytest.mark.parametrize("name", list(UNITS))
def test_subnormal_inputs_read_as_zeros(name):
    fn = UNITS[name][0]
    sub = np.arange(1, 0x80, dtype=np.uint16)
    assert (fn(sub) == fn(np.uint16(0))).all()
    assert (fn(sub | np.uint16(0x8000)) == fn(np.uint16(0x8000))).all()


# --------------------------------------------------------------------------- special values


def test_infinity_limits():
    infs = np.array([0x7F80, 0xFF80], dtype=np.uint16)
    table = {
        act.exp: (0x7F80, PZERO),
        act.sigmoid: (ONE, PZERO),
        act.tanh: (ONE, 0xBF80),
        act.gelu: (0x7F80, NZERO),
        act.relu: (0x7F80, PZERO),
        act.leaky_relu: (0x7F80, 0xFF80),
        act.sigmoid_deriv: (PZERO, PZERO),
        act.tanh_deriv: (PZERO, PZERO),
        act.gelu_deriv: (ONE, NZERO),
        act.relu_deriv: (ONE, PZERO),
    }
    for fn, want in table.items():
        assert fn(infs).tolist() == list(want), fn.__name__


def test_zeros():
    z = np.array([PZERO, NZERO], dtype=np.uint16)
    assert act.relu(z).tolist() == [PZERO, PZERO]
    assert act.leaky_relu(z).tolist() == [PZERO, NZERO]
    assert act.gelu(z).tolist() == [PZERO, NZERO]
    assert act.tanh(z).tolist() == [PZERO, NZERO]
    assert act.exp(z).tolist() == [ONE, ONE]
    assert act.sigmoid(z).tolist() == [HALF, HALF]
    assert act.gelu_deriv(z).tolist() == [HALF, HALF]
    assert act.sigmoid_deriv(z).tolist() == [0x3E80, 0x3E80]
    assert act.tanh_deriv(z).tolist() == [ONE, ONE]
    assert act.relu_deriv(z).tolist() == [PZERO, PZERO]
    assert act.leaky_relu_deriv(z).tolist() == [0x3C00, 0x3C00]


def test_relu_negatives_give_positive_zero():
    neg = ALL[(ALL >= 0x8000) & ~NAN_IN]
    assert (act.relu(neg) == 0).all()
    pos = ALL[(ALL < 0x8000) & (FIELD != 0) & ~NAN_IN]
    assert (act.relu(pos) == pos).all()


@pytest.mark.parametrize("shift", [0, 1, 7, 20, 126, 127, 200, 10**10])
def test_leaky_relu_shift(shift):
    x = ALL[~NAN_IN]
    out = act.leaky_relu(x, shift)
    want = bf16.from_f64(t_leaky(values(x), shift))
    assert (out == want).all()
    slope = bf16.from_f64(2.0**-shift)
    d = act.leaky_relu_deriv(x, shift)
    assert (d == np.where((x < 0x8000) & ((x & 0x7F80) != 0), np.uint16(ONE), slope)).all()


def test_leaky_relu_shift_validation():
    with pytest.raises(ValueError):
        act.leaky_relu(np.uint16(0x3F80), -1)
    with pytest.raises(TypeError):
        act.leaky_relu(np.uint16(0x3F80), True)
    with pytest.raises(TypeError):
        act.leaky_relu_grad(np.uint16(0x3F80), np.uint16(0x3F80), 1.5)


def test_input_forms_and_shapes():
    x = np.array([[0x3F80, 0xBF80], [0x4000, 0x0000]], dtype=np.uint16)
    for name, (fn, *_) in UNITS.items():
        out = fn(x)
        assert out.shape == (2, 2) and out.dtype == np.uint16, name
        assert (fn(x.view(ml_dtypes.bfloat16)) == out).all(), name
        assert (fn(x.astype(np.int64)) == out).all(), name
        scalar = fn(0x3F80)
        assert scalar.shape == () and scalar == out[0, 0], name
    with pytest.raises(TypeError):
        act.gelu(np.array([1.0], dtype=np.float32))


# --------------------------------------------------------------------------- gradients

RNG_SEED = 20240611
FIXED_G = [0x3F80, 0xC060, 0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x0080, 0x7F7F, 0x0005, 0x4B00]


@pytest.mark.parametrize("name", list(act.GRADIENTS))
def test_gradient_random_pairs(name):
    rng = np.random.default_rng(RNG_SEED)
    x = rng.integers(0, 1 << 16, size=200_000, dtype=np.uint32).astype(np.uint16)
    g = rng.integers(0, 1 << 16, size=200_000, dtype=np.uint32).astype(np.uint16)
    out = act.GRADIENTS[name](x, g)
    want = bf16.mul(expected_deriv_at(name, x), g)
    assert bf16.ulp_distance(out, want).max() == 0
    assert (bf16.is_nan(out) == bf16.is_nan(want)).all()
    assert ((out == want) | bf16.is_nan(want)).all()


@pytest.mark.parametrize("name", list(act.GRADIENTS))
@pytest.mark.parametrize("g", FIXED_G)
def test_gradient_all_x_fixed_g(name, g):
    gg = np.full(ALL.shape, g, dtype=np.uint16)
    out = act.GRADIENTS[name](ALL, gg)
    want = bf16.mul(expected(DERIV_OF[name]), gg)
    assert same_bits(out, want)
    assert (bf16.is_nan(out) == bf16.is_nan(want)).all()


def test_gradient_broadcasts():
    x = np.array([0x3F80, 0xBF80, 0x0000], dtype=np.uint16)
    out = act.gelu_grad(x[:, None], np.array([[0x3F80, 0x4000]], dtype=np.uint16))
    assert out.shape == (3, 2)
    assert (out[:, 0] == act.gelu_deriv(x)).all()


def test_relu_grad_specifics():
    one, neg = np.uint16(0x3F80), np.uint16(0xBF80)
    g = np.uint16(0x40A0)  # 5.0
    nan = np.uint16(0x7FC0)
    assert act.relu_grad(one, g) == g
    assert act.relu_grad(neg, g) == PZERO
    assert act.relu_grad(neg, g | np.uint16(0x8000)) == NZERO  # +0 * (-5) = -0
    assert act.relu_grad(np.uint16(PZERO), g) == PZERO
    assert act.relu_grad(np.uint16(NZERO), g) == PZERO
    assert bf16.is_nan(act.relu_grad(nan, g))
    assert bf16.is_nan(act.relu_grad(one, nan))
    assert bf16.is_nan(act.relu_grad(neg, nan))
    assert bf16.is_nan(act.relu_grad(neg, POS_INF))  # 0 * inf
    assert act.relu_grad(one, NEG_INF) == NEG_INF
    assert act.relu_grad(one, np.uint16(0x0005)) == PZERO  # DAZ on g
    # For x > 0 the gradient passes g through unchanged (DAZ aside).
    gs = ALL[(FIELD != 0) & ~NAN_IN]
    assert (act.relu_grad(one, gs) == gs).all()


def test_leaky_relu_grad_specifics():
    one, neg = np.uint16(0x3F80), np.uint16(0xBF80)
    g = np.uint16(0x40A0)  # 5.0
    scaled = bf16.from_f64(5.0 * 2.0**-act.LEAKY_SHIFT)
    assert act.leaky_relu_grad(one, g) == g
    assert act.leaky_relu_grad(neg, g) == scaled
    assert act.leaky_relu_grad(np.uint16(PZERO), g) == scaled
    assert act.leaky_relu_grad(np.uint16(NZERO), g) == scaled
    assert act.leaky_relu_grad(neg, g, 0) == g
    assert bf16.is_nan(act.leaky_relu_grad(np.uint16(0xFFC0), g))
    assert bf16.is_nan(act.leaky_relu_grad(neg, np.uint16(0x7FC0)))
    assert act.leaky_relu_grad(neg, POS_INF) == POS_INF
    assert act.leaky_relu_grad(neg, np.uint16(0x0080)) == PZERO  # 2**-126 * 2**-7 flushes


# --------------------------------------------------------------------------- tables


def test_midpoint_guard():
    margins = act.midpoint_margins()
    assert set(margins) == set(act.TABLE_NAMES)
    for name, m in margins.items():
        assert m > 2.0**-40, f"{name}: a reference lies {m:.3g} from a rounding boundary"


@pytest.mark.parametrize("name", act.TABLE_NAMES)
def test_table_unit_layout(name):
    unit = act.TABLES[name]
    assert unit is act.table_unit(name)
    assert 1 <= unit.f_lo <= unit.f_hi <= 253
    fields = unit.f_hi - unit.f_lo + 1
    assert unit.fields == fields
    assert unit.rom.dtype == np.uint16 and unit.rom.shape == (2 * fields * 128,)
    assert unit.rom_entries == 2 * fields * 128 and unit.rom_bits == 16 * unit.rom_entries
    assert not unit.rom.flags.writeable
    rom = unit.rom
    assert not bf16.is_nan(rom).any()
    assert not (((rom & 0x7F80) == 0) & ((rom & 0x7F) != 0)).any()
    # The documented index order, checked against the correctly rounded values.
    sign = ALL >> 15
    mant = ALL & 0x7F
    inside = (FIELD >= unit.f_lo) & (FIELD <= unit.f_hi)
    idx = (sign * fields + (FIELD.astype(np.int64) - unit.f_lo)) * 128 + mant
    assert (rom[idx[inside]] == expected(name)[inside]).all()
    # The window is the smallest: each edge field has an input that its rule gets wrong.
    cr = expected(name)
    lo_row = ALL[FIELD == unit.f_lo]
    hi_row = ALL[FIELD == unit.f_hi]
    rules = (unit.small_rule, unit.large_rule_pos, unit.large_rule_neg)
    n = fields * 128
    # Drop the lowest field of both sign halves: the small rule then gets one input wrong.
    raised = act.TableUnit(
        name, unit.f_lo + 1, unit.f_hi, *rules, rom[np.r_[128:n, n + 128 : 2 * n]]
    )
    assert (raised(lo_row) != cr[lo_row]).any()
    # Drop the highest field: a large rule then gets one input wrong, and nothing else moves.
    lowered = act.TableUnit(
        name, unit.f_lo, unit.f_hi - 1, *rules, rom[np.r_[0 : n - 128, n : 2 * n - 128]]
    )
    assert (lowered(hi_row) != cr[hi_row]).any()
    rest = ALL[FIELD != unit.f_hi]
    assert (lowered(rest) == unit(rest)).all()


def test_table_rules_documented_choices():
    rules = {n: (u.small_rule, u.large_rule_pos, u.large_rule_neg) for n, u in act.TABLES.items()}
    assert rules == {
        "exp": (("const", 0x3F80), ("const", 0x7F80), ("const", 0x0000)),
        "sigmoid": (("const", 0x3F00), ("const", 0x3F80), ("const", 0x0000)),
        "tanh": (("x",), ("const", 0x3F80), ("const", 0xBF80)),
        "gelu": (("half",), ("x",), ("const", 0x8000)),
        "sigmoid_deriv": (("const", 0x3E80), ("const", 0x0000), ("const", 0x0000)),
        "tanh_deriv": (("const", 0x3F80), ("const", 0x0000), ("const", 0x0000)),
        "gelu_deriv": (("const", 0x3F00), ("const", 0x3F80), ("const", 0x8000)),
    }


def test_generation_is_deterministic():
    for name in act.TABLE_NAMES:
        again = act.table_unit.__wrapped__(name)
        unit = act.table_unit(name)
        assert (again.f_lo, again.f_hi) == (unit.f_lo, unit.f_hi)
        assert np.array_equal(again.rom, unit.rom)


def test_tables_mapping():
    assert list(act.TABLES) == list(act.TABLE_NAMES) and len(act.TABLES) == len(act.TABLE_NAMES)
    with pytest.raises(KeyError):
        act.TABLES["relu"]
    with pytest.raises(ValueError, match="gelu"):
        act.table_unit("softplus")


def test_reference_values():
    x = np.array([0x3F80, 0xBF80, 0x7F80, 0xFF80, 0x7FC0, 0x0001], dtype=np.uint16)
    r = act.reference("sigmoid", x)
    assert r[0] == pytest.approx(1 / (1 + math.exp(-1)), rel=1e-15)
    assert r[2] == 1.0 and r[3] == 0.0 and math.isnan(r[4]) and r[5] == 0.5
    with pytest.raises(ValueError, match="tanh_deriv"):
        act.reference("softplus", x)


# --------------------------------------------------------------------------- registry


def test_registries():
    assert set(act.UNARY) == {"relu", "leaky_relu", "gelu", "sigmoid", "tanh", "exp"}
    assert set(act.GRADIENTS) == {"relu", "leaky_relu", "gelu", "sigmoid", "tanh"}
    assert set(act.DERIVATIVES) == set(act.GRADIENTS)
    for name, fn in act.UNARY.items():
        assert act.get(name) is fn
    for name, fn in act.GRADIENTS.items():
        assert act.get(name, "grad") is fn
        assert act.get(name, "deriv") is act.DERIVATIVES[name]
    with pytest.raises(ValueError, match="relu, leaky_relu, gelu, sigmoid, tanh, exp"):
        act.get("softplus")
    with pytest.raises(ValueError, match="relu, leaky_relu, gelu, sigmoid, tanh"):
        act.get("exp", "grad")
    with pytest.raises(ValueError, match="unary"):
        act.get("relu", "forward")
