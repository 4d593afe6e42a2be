"""Accuracy of the bf16 activation units against their float64 references.

Measures every unary unit and derivative unit of ``hbfp.golden.activations`` over all
65,536 bf16 inputs, and every gradient (derivative unit times an upstream gradient, rounded
again) on seeded random samples of finite ``(x, g)`` pairs. Prints the markdown report and
writes it to ``docs/activations.md``.

Usage: ``.venv/bin/python benchmarks/activation_accuracy.py [--samples N] [--seed S]
[--output PATH]``
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from hbfp.golden import activations as act
from hbfp.golden import bf16

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "docs" / "activations.md"
DEFAULT_SAMPLES = 1_000_000
DEFAULT_SEED = 2018  # HBFP's year; any fixed seed makes the report reproducible
COMMAND = "python benchmarks/activation_accuracy.py"

ALL = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
MIN_NORMAL = 2.0**-126
TWO_128 = 2.0**128
# Gradient-like magnitudes for the second sample: |g| in [2**-20, 2**21).
G_FIELDS = (127 - 20, 127 + 20)

# (report name, unit, reference name, table unit name or None)
UNITS = [
    ("relu", act.relu, "relu", None),
    (f"leaky_relu (shift {act.LEAKY_SHIFT})", act.leaky_relu, "leaky_relu", None),
    ("gelu", act.gelu, "gelu", "gelu"),
    ("sigmoid", act.sigmoid, "sigmoid", "sigmoid"),
    ("tanh", act.tanh, "tanh", "tanh"),
    ("exp", act.exp, "exp", "exp"),
    ("relu_deriv", act.relu_deriv, "relu_deriv", None),
    (f"leaky_relu_deriv (shift {act.LEAKY_SHIFT})", act.leaky_relu_deriv, "leaky_relu_deriv", None),
    ("gelu_deriv", act.gelu_deriv, "gelu_deriv", "gelu_deriv"),
    ("sigmoid_deriv", act.sigmoid_deriv, "sigmoid_deriv", "sigmoid_deriv"),
    ("tanh_deriv", act.tanh_deriv, "tanh_deriv", "tanh_deriv"),
]

GRADS = ["relu", "leaky_relu", "gelu", "sigmoid", "tanh"]


def ftz_ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Number of steps between two bf16 patterns along the values an FTZ device can hold:
    +0 and -0 are one value, subnormal patterns none (so 0 to 2**-126 is one step, where
    ``bf16.ulp_distance`` counts the 127 subnormal patterns in between). NaN against NaN is
    0, NaN against a number 2**16."""

    def ordered(bits):
        mag = (bits & 0x7FFF).astype(np.int32)
        idx = np.where(mag >= 0x80, mag - 0x7F, 0)
        return np.where(bits & 0x8000, -idx, idx)

    d = np.abs(ordered(a) - ordered(b))
    na, nb = bf16.is_nan(a), bf16.is_nan(b)
    d = np.where(na & nb, 0, d)
    return np.where(na ^ nb, 1 << 16, d)


def ulp_of(ref: np.ndarray) -> np.ndarray:
    """Spacing of bf16 at the magnitude of ``ref``: 2**(floor(log2|ref|) - 7), clamped at
    the spacing of the smallest normal (2**-133)."""
    a = np.abs(ref)
    _, e = np.frexp(np.where((a > 0) & np.isfinite(a), a, 1.0))
    return np.ldexp(1.0, np.maximum(e - 1, -126) - 7)


def ulp_errors(out: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Error of each output against its float64 reference in bf16 ULPs, and the mask of
    inputs where it is defined: not NaN, and the reference not beyond the overflow
    threshold (there the output is inf and the error is unbounded by definition).
    An inf output against a finite reference counts as 2**128 (the value IEEE rounding
    gives the name inf)."""
    y = bf16.to_f32(out).astype(np.float64)
    finite_ref = np.isfinite(ref)
    y = np.where(np.isinf(y) & finite_ref, np.copysign(TWO_128, y), y)
    defined = ~np.isnan(ref) & ~(finite_ref & (np.abs(ref) >= TWO_128))
    with np.errstate(invalid="ignore"):
        diff = np.where(finite_ref, np.abs(y - ref), np.where(y == ref, 0.0, np.inf))
    err = np.where(defined, diff / ulp_of(ref), 0.0)
    return err, defined


def unit_rows() -> list[dict]:
    rows = []
    for label, fn, ref_name, table in UNITS:
        out = fn(ALL)
        ref = act.reference(ref_name, ALL)
        cr = bf16.from_f64(ref)
        dist = ftz_ulp_distance(out, cr)
        err, defined = ulp_errors(out, ref)
        a = np.abs(ref)
        in_range = defined & ((a == 0) | (a >= MIN_NORMAL) | np.isinf(a))
        row = {
            "unit": label,
            "max_err_normal": float(err[in_range].max()),
            "max_err_all": float(err[defined].max()),
            "max_ulp_cr": int(dist.max()),
            "cr_share": float((dist == 0).mean()),
        }
        if table is not None:
            u = act.table_unit(table)
            row.update(window=(u.f_lo, u.f_hi), entries=u.rom_entries, bits=u.rom_bits)
        rows.append(row)
    return rows


def finite_patterns(rng: np.random.Generator, n: int) -> np.ndarray:
    """Uniform over the 65,280 patterns with a finite value (subnormals included)."""
    finite = ALL[((ALL >> 7) & 0xFF) != 0xFF]
    return finite[rng.integers(0, finite.size, size=n)]


def window_patterns(rng: np.random.Generator, n: int, f_lo: int, f_hi: int) -> np.ndarray:
    """Uniform over the patterns whose exponent field lies in [f_lo, f_hi], both signs."""
    sign = rng.integers(0, 2, size=n, dtype=np.uint32) << 15
    field = rng.integers(f_lo, f_hi + 1, size=n, dtype=np.uint32) << 7
    mant = rng.integers(0, 128, size=n, dtype=np.uint32)
    return (sign | field | mant).astype(np.uint16)


def grad_stats(name: str, x: np.ndarray, g: np.ndarray) -> dict:
    out = act.GRADIENTS[name](x, g)
    d_ref = act.reference(f"{name}_deriv", x)
    # d_ref * g in float64 (g has 8 significant bits: one float64 rounding, 2**-53 away).
    cr = bf16.from_f64(d_ref * bf16.to_f32(g).astype(np.float64))
    dist = ftz_ulp_distance(out, cr)
    d_normal = np.abs(d_ref) >= MIN_NORMAL
    return {
        "cr_share": float((dist == 0).mean()),
        "within1": float((dist <= 1).mean()),
        "max_ulp": int(dist.max()),
        "max_ulp_dnormal": int(dist[d_normal | (d_ref == 0)].max()),
    }


def grad_rows(samples: int, seed: int) -> list[dict]:
    rows = []
    for i, name in enumerate(GRADS):
        rng = np.random.default_rng([seed, i])
        x = finite_patterns(rng, samples)
        g = finite_patterns(rng, samples)
        rows.append({"grad": name, "sample": "x, g uniform over finite", **grad_stats(name, x, g)})
        table = f"{name}_deriv"
        if table in act.TABLE_NAMES:
            u = act.table_unit(table)
            xw = window_patterns(rng, samples, u.f_lo, u.f_hi)
            gw = window_patterns(rng, samples, *G_FIELDS)
            sample = "x in window, abs(g) in [2^-20, 2^21)"
            rows.append({"grad": name, "sample": sample, **grad_stats(name, xw, gw)})
    return rows


def fmt_err(v: float) -> str:
    return f"{v:.3f}"


def fmt_share(v: float) -> str:
    if v == 1.0:
        return "100%"
    return f"{100 * v:.4f}%"


def window_text(row: dict) -> tuple[str, str, str]:
    if "window" not in row:
        return "none (comparators)", "0", "0"
    lo, hi = row["window"]
    return (
        f"[{lo}, {hi}]: 2^{lo - 127} <= abs(x) < 2^{hi - 126}",
        f"{row['entries']:,}",
        f"{row['bits']:,}",
    )


def report(samples: int, seed: int) -> str:
    rows = unit_rows()
    grows = grad_rows(samples, seed)
    margins = act.midpoint_margins()
    total_bits = sum(r.get("bits", 0) for r in rows)
    lines = [
        "# bf16 activation units: accuracy",
        "",
        "Every activation unit of the accelerator works on bf16 (FTZ/DAZ, RNE; "
        "docs/numerics.md, section 4; golden model `hbfp.golden.activations`). `relu` and "
        "`leaky_relu` (slope `2**-shift`, an exponent decrement) and their derivatives are "
        "comparators. `gelu`, `sigmoid`, `tanh`, `exp` and the derivative units `gelu_deriv`, "
        "`sigmoid_deriv`, `tanh_deriv` are each a ROM plus three rules: inputs whose biased "
        "exponent field lies in a window `[f_lo, f_hi]` read the ROM at "
        "`(sign * (f_hi - f_lo + 1) + field - f_lo) * 128 + mantissa`; smaller fields (zeros "
        "and subnormals included) take a small-value rule, larger fields (inf included) a "
        "per-sign large-value rule, each a constant, the input itself, or the input halved. "
        "The ROM holds the correctly rounded value of each input in the window, computed from "
        "a float64 reference, and the window is the smallest one outside which the rules are "
        "correctly rounded too, so the table units are correctly rounded on all 65,536 "
        "inputs. A gradient is the derivative unit's bf16 output times the upstream gradient, "
        "rounded once more (RNE/FTZ): that second rounding is where gradients can differ "
        "from the correctly rounded product.",
        "",
        "## Unary units (all 65,536 inputs)",
        "",
        "Error in ULPs is `abs(y - ref) / ulp(ref)` against the unrounded float64 reference, "
        "with `ulp(ref) = 2**(floor(log2 abs(ref)) - 7)` clamped at the smallest normal "
        "(`2**-133`); an inf output counts as `2**128`. \"normal range\" leaves out the "
        "inputs whose reference is a nonzero value below `2**-126` (flushed to zero by FTZ, "
        "which \"incl. FTZ\" counts, up to 128 ULPs of `2**-133`); inputs whose reference is "
        "at least `2**128` (exp overflow to inf) and NaNs are left out of both error columns. "
        "\"ULP to CR\" is the number of steps between the output and the correctly rounded "
        "result (`bf16.from_f64(ref)`, FTZ and overflow included) along the values an FTZ "
        "device holds (the zeros are one value, subnormal patterns none, so 0 to `2**-126` "
        "is one step); NaNs compare by class.",
        "",
        "| unit | max err, normal range (ULP) | max err incl. FTZ (ULP) | max ULP to CR "
        "| correctly rounded | window (exponent fields) | ROM entries | ROM bits |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        win, entries, bits = window_text(r)
        lines.append(
            f"| {r['unit']} | {fmt_err(r['max_err_normal'])} | {fmt_err(r['max_err_all'])} "
            f"| {r['max_ulp_cr']} | {fmt_share(r['cr_share'])} | {win} | {entries} | {bits} |"
        )
    lines += [
        "",
        f"Total ROM: {total_bits:,} bits ({total_bits // 8 // 1024} KiB) for the seven table "
        "units.",
        "",
        "Platform independence: the smallest relative distance between a float64 reference "
        "and a bf16 rounding boundary (midpoint, FTZ edge, overflow edge), over all finite "
        "inputs, so that libm's last-bit differences (about 2**-52) cannot change a table: "
        + ", ".join(f"{n} 2^{math.log2(m):.1f}" for n, m in margins.items())
        + ".",
        "",
        f"## Gradients ({samples:,} seeded random (x, g) pairs per sample)",
        "",
        "Against the correctly rounded product `bf16.from_f64(deriv_ref(x) * g)`. The first "
        "sample draws both operands uniformly from the finite bf16 patterns; the second "
        "draws `x` from the derivative unit's table window (where the derivative is not a "
        "rule constant) and `g` from gradient-like magnitudes. The last column leaves out "
        "the pairs whose exact derivative is a nonzero value below `2**-126`: the derivative "
        "unit flushes it to zero, so the gradient is zero even where `deriv(x) * g` is a "
        "normal number. ULP distances count steps as in the first table.",
        "",
        "| gradient | sample | correctly rounded | within 1 ULP | max ULP to CR "
        "| max ULP to CR, normal deriv(x) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in grows:
        lines.append(
            f"| {r['grad']} | {r['sample']} | {fmt_share(r['cr_share'])} "
            f"| {fmt_share(r['within1'])} | {r['max_ulp']} | {r['max_ulp_dnormal']} |"
        )
    lines += [
        "",
        f"Produced by `{COMMAND}`"
        + (f" (`--samples {samples}`)" if samples != DEFAULT_SAMPLES else "")
        + (f" (`--seed {seed}`)" if seed != DEFAULT_SEED else "")
        + ".",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    text = report(args.samples, args.seed)
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)


if __name__ == "__main__":
    main()
