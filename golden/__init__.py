"""The numerics contract as NumPy code (docs/numerics.md): every bit the device computes.

``bf16``: bfloat16/fp32 device arithmetic; ``bfp``: formats and quantization;
``gemm``: the BFP matrix product; ``activations``: the bf16 activation units.
"""

from . import bf16, bfp
from .bfp import HBFP8, HBFP16, MXINT8, BFPTensor, Format, quantize, requantize

__all__ = ["bf16", "bfp", "Format", "BFPTensor", "HBFP8", "HBFP16", "MXINT8", "quantize", "requantize"]
