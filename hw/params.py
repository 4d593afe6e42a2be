"""Elaboration-time parameters of the gateware, defined once.

Every width the components share is derived here from the numeric format (``hbfp.golden``)
and the configuration; the generated parameters file (``hbfp verilog``) records them for
the host and the tests.
"""

from __future__ import annotations

from hbfp.golden.bfp import EXP_BIAS, EXP_NAN, RANDOM_BITS, SEED_SALT

__all__ = [
    "FP32_WIDTH",
    "BF16_WIDTH",
    "EXP_WIDTH",
    "EXP_BIAS",
    "EXP_NAN",
    "RANDOM_BITS",
    "SEED_SALT",
    "ROUNDING_CODES",
    "psum_width",
    "product_width",
]

FP32_WIDTH = 32
BF16_WIDTH = 16
#: An E8M0 exponent code.
EXP_WIDTH = 8
#: The runtime encoding of a rounding mode on the quantizer's ``rounding`` port.
ROUNDING_CODES = {"nearest_even": 0, "toward_zero": 1, "stochastic": 2}


def product_width(mantissa_bits_a: int, mantissa_bits_b: int) -> int:
    """Bits of a signed product of two symmetric codes (|q| <= 2**(m-1) - 1)."""
    return mantissa_bits_a + mantissa_bits_b - 1


def psum_width(mantissa_bits_a: int, mantissa_bits_b: int, tk: int) -> int:
    """Bits of a signed K-tile sum of ``tk`` products: exact, never wraps."""
    bound = tk * (2 ** (mantissa_bits_a - 1) - 1) * (2 ** (mantissa_bits_b - 1) - 1)
    return bound.bit_length() + 1
