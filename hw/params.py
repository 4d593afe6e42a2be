"""Elaboration-time parameters of the gateware, defined once.

Every width the components share is derived here from the numeric format (``hbfp.golden``)
and the configuration; the generated parameters file (``hbfp verilog``) records them for
the host and the tests. The configuration itself (``CoreConfig``, its rules and
``ConfigError``) and the latencies those rules read are the device contract's
(``hbfp.contract``), re-exported here for the gateware.
"""

from __future__ import annotations

from amaranth.lib import data

from hbfp.contract import (
    ACC_GROUP_SELECT,
    ACC_READ_LATENCY,
    ADD_LATENCY,
    OPERAND_READ_LATENCY,
    PREFETCH_CYCLES,
    NORMALIZE_LATENCY,
    ConfigError,
    CoreConfig,
    ROUNDING_CODES,
    Descriptor,
    Rounding,
    product_width,
    psum_width,
    rmw_latency,
)
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
    "Rounding",
    "psum_width",
    "product_width",
    "NORMALIZE_LATENCY",
    "ADD_LATENCY",
    "ACC_READ_LATENCY",
    "ACC_GROUP_SELECT",
    "OPERAND_READ_LATENCY",
    "PREFETCH_CYCLES",
    "rmw_latency",
    "ConfigError",
    "CoreConfig",
    "layout",
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


def layout(descriptor: Descriptor) -> data.StructLayout:
    """The gateware's view of a contract ``Descriptor``: its fields from the least significant
    bit, so that byte ``i`` of the record on the wire is bits ``8i..8i+7`` of the view."""
    return data.StructLayout({f.name: f.bits for f in descriptor.fields})
