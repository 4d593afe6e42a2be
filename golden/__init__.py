"""The numerics contract as NumPy code (docs/numerics.md): every bit the device computes.

``bf16``: bfloat16/fp32 device arithmetic; ``bfp``: formats and quantization;
``gemm``: the BFP matrix product (``from hbfp.golden.gemm import gemm``);
``activations``: the bf16 activation units.
"""

from . import activations, bf16, bfp, gemm
from .bfp import HBFP8, HBFP16, MXINT8, BFPTensor, Format, quantize, requantize

__all__ = ["activations", "bf16", "bfp", "gemm", "Format", "BFPTensor", "HBFP8", "HBFP16", "MXINT8", "quantize", "requantize"]
