"""The native half of the `sim` backend: ``harness.cpp`` (a Verilated top driven through its
byte streams) and ``build.py`` (Verilog, Verilator, g++, and the library cache)."""
