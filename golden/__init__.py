"""The numerics contract as NumPy code (docs/numerics.md): every bit the device computes.

``bf16``: bfloat16/fp32 device arithmetic; ``bfp``: formats and quantization;
``gemm``: the BFP matrix product (``from hbfp.golden.gemm import gemm``);
``activations``: the bf16 activation units; ``float_mac``: the bf16 and fp16 multiply-add
baselines of the density experiment (fp32 sums).
"""

from . import activations, bf16, bfp, float_mac, gemm
from .bfp import HBFP8, HBFP16, MXINT8, BFPTensor, Format, quantize, requantize

__all__ = ["activations", "bf16", "bfp", "float_mac", "gemm", "Format", "BFPTensor", "HBFP8", "HBFP16", "MXINT8", "quantize", "requantize"]
