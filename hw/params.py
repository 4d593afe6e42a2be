"""Elaboration-time parameters of the gateware, defined once.

Every width the components share is derived here from the numeric format (``hbfp.golden``)
and the configuration; the generated parameters file (``hbfp verilog``) records them for
the host and the tests.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hbfp.golden.bf16 import QNAN
from hbfp.golden.bfp import EXP_BIAS, EXP_NAN, MIX32_MULTIPLIERS, RANDOM_BITS, SEED_SALT

__all__ = [
    "FP32_WIDTH",
    "BF16_WIDTH",
    "F32_FRAC_BITS",
    "F32_EXP_BITS",
    "F32_BIAS",
    "F32_EXP_INF",
    "F32_QNAN",
    "MIX32_MULTIPLIERS",
    "EXP_WIDTH",
    "EXP_BIAS",
    "EXP_NAN",
    "RANDOM_BITS",
    "SEED_SALT",
    "ROUNDING_CODES",
    "psum_width",
    "product_width",
    "CoreConfig",
]

FP32_WIDTH = 32
BF16_WIDTH = 16
#: The fp32 fields (IEEE binary32): 23 stored fraction bits behind an implicit one, the
#: biased exponent field, the sign.
F32_FRAC_BITS = 23
F32_EXP_BITS = FP32_WIDTH - 1 - F32_FRAC_BITS
F32_BIAS = 2 ** (F32_EXP_BITS - 1) - 1
F32_EXP_INF = 2**F32_EXP_BITS - 1  # the exponent field of inf and NaN
#: The quiet NaN every fp32 NaN result becomes: the bf16 one widened (0x7FC00000).
F32_QNAN = QNAN << (FP32_WIDTH - BF16_WIDTH)
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


@dataclass(frozen=True)
class CoreConfig:
    """One configuration of the GEMM core, decided at elaboration time.

    ``rows`` x ``cols``: the MAC array (powers of two). ``mantissa_bits`` and ``tile``: the BFP
    format of both stored operands and of BFP outputs (the tile's column side is the K-tile
    ``tk``; a non-square tile, such as MXINT8's 1 x 32, needs A stored M x K and B stored N x K).
    ``size``: the buffers hold ``size`` x ``size`` operands and outputs (a multiple of the
    tile sides and of the array sides). ``functions``: the activation units built.
    """

    rows: int = 8
    cols: int = 8
    mantissa_bits: int = 8
    tile: tuple[int, int] = (24, 24)
    size: int = 96
    functions: tuple[str, ...] | None = None  # None: every function of hw.activation.FUNCTIONS
    leaky_shift: int = 7
    value_quantizer: bool = True
    bfp_output: bool = True
    stochastic: bool = True

    def __post_init__(self):
        object.__setattr__(self, "tile", tuple(self.tile))
        from hbfp.host.protocol import UNITS  # here: hbfp.host imports this module

        for name in UNITS:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.functions is not None:
            from .activation import FUNCTIONS

            unknown = [f for f in self.functions if f not in FUNCTIONS]
            if isinstance(self.functions, str) or unknown:
                raise ValueError(f"functions must be names of {', '.join(FUNCTIONS)} (or None: all of them), "
                                 f"got {self.functions!r}")
        if self.stochastic and not (self.value_quantizer or self.bfp_output):
            raise ValueError("stochastic rounding needs a quantizer: value_quantizer or bfp_output")
        for name in ("rows", "cols"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        th, tw = self.tile
        for side in (th, tw, self.rows, self.cols):
            if self.size % side:
                raise ValueError(f"size {self.size} must be a multiple of the tile sides {self.tile} and the array sides")
        if tw % self.cols:
            raise ValueError(f"the tile's columns ({tw}) must be a multiple of cols ({self.cols}) for BFP output")
        if self.tk < max(self.rows, self.cols):
            raise ValueError(f"the K-tile ({self.tk}) must be at least as long as the array's sides")

    @property
    def tk(self) -> int:
        """The K-tile: the tile's column side (K runs along the stored rows of A and B^T)."""
        return self.tile[1]

    @property
    def square(self) -> bool:
        return self.tile[0] == self.tile[1]

    def fmt(self, rounding: str = "nearest_even"):
        from hbfp.golden.bfp import Format

        return Format(self.mantissa_bits, self.tile, rounding)

    @property
    def built_functions(self) -> tuple[str, ...]:
        """The activation units built, in ``hw.activation.FUNCTIONS`` order: every one for
        ``functions`` None, none for an empty tuple."""
        from .activation import FUNCTIONS  # here: hw.activation imports this module

        return tuple(f for f in FUNCTIONS if self.functions is None or f in self.functions)

    @property
    def omitted(self) -> int:
        """IDENTIFY's mask of the units left out (``hbfp.host.protocol.UNITS``)."""
        from hbfp.host.protocol import UNITS

        return sum(1 << bit for name, bit in UNITS.items() if not getattr(self, name))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tile"] = list(self.tile)
        d["tk"] = self.tk
        d["psum_width"] = psum_width(self.mantissa_bits, self.mantissa_bits, self.tk)
        return d
