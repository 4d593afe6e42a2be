"""hbfp: a Hybrid Block Floating Point training accelerator.

Subpackages: ``hbfp.golden`` (the bit-exact numerics), ``hbfp.hw`` (Amaranth gateware),
``hbfp.sim`` (cocotb verification), ``hbfp.host`` (device driver).
"""

__version__ = "0.1.0"
