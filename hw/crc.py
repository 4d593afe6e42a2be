"""CRC-32 (IEEE 802.3, ``zlib.crc32``), one byte per cycle: the frame check of the wire
protocol (docs/protocol.md).

The CRC is reflected (bytes enter LSB first) with the polynomial 0xEDB88320, a register
preset to all ones and a final complement. ``crc32_step`` is the combinational update of the
register by one byte (eight unrolled shift/XOR steps, which synthesis folds into one XOR
network of at most nine inputs per bit); ``CRC32`` holds the register.
"""

from __future__ import annotations

from amaranth import Const, Module, Mux, Signal, Value
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

__all__ = ["POLY", "PRESET", "RESIDUE", "crc32_step", "crc32_state", "CRC32"]

#: The reflected generator polynomial.
POLY = 0xEDB88320
#: The register's value before the first byte.
PRESET = 0xFFFFFFFF
#: The register after a message followed by its own CRC (little-endian, as the protocol
#: sends it): a frame checks when the register ends here, without knowing where the CRC is.
RESIDUE = 0xDEBB20E3


def crc32_step(crc, byte):
    """The register after one more byte: a Python int function of ints, or an Amaranth
    expression of Values (32-bit register, 8-bit byte)."""
    if isinstance(crc, int) and isinstance(byte, int):
        crc ^= byte & 0xFF
        for _ in range(8):
            crc = (crc >> 1) ^ (POLY if crc & 1 else 0)
        return crc
    crc = Value.cast(crc)[:32] ^ Value.cast(byte)[:8]
    for _ in range(8):
        crc = (crc >> 1) ^ Mux(crc[0], Const(POLY, 32), Const(0, 32))
    return crc[:32]


def crc32_state(data: bytes, state: int = PRESET) -> int:
    """The register after ``data`` (``zlib.crc32(data) == crc32_state(data) ^ 0xFFFFFFFF``)."""
    for b in data:
        state = crc32_step(state, b)
    return state


class CRC32(wiring.Component):
    """The CRC-32 register, advanced by one byte per cycle.

    Ports: ``i`` (stream in, 8 bits, always ready): each valid byte updates the register;
    ``clear`` (in): the register is loaded with ``init`` instead (``clear`` wins over a byte in
    the same cycle); ``crc`` (out): the CRC of the bytes so far (the complemented register),
    little-endian on the wire; ``residue_ok`` (out): the bytes so far end with their own CRC.

    ``init``: the register after ``clear``, by default ``PRESET``; a receiver that has already
    consumed a known prefix (the magic, found by a comparator before a frame starts) presets
    ``crc32_state(prefix)``. Latency: ``crc`` follows a byte one cycle later; one byte per cycle.
    """

    def __init__(self, init: int = PRESET):
        self.init = init
        super().__init__({
            "i": In(stream.Signature(8, always_ready=True)),
            "clear": In(1),
            "crc": Out(32),
            "residue_ok": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        reg = Signal(32, init=self.init)
        with m.If(self.clear):
            m.d.sync += reg.eq(self.init)
        with m.Elif(self.i.valid):
            m.d.sync += reg.eq(crc32_step(reg, self.i.payload))
        m.d.comb += [self.crc.eq(~reg), self.residue_ok.eq(reg == RESIDUE)]
        return m
