"""CRC-32 (IEEE 802.3, ``zlib.crc32``), one byte or up to ``width`` bytes per cycle: the frame
check of the wire protocol (docs/protocol.md).

The CRC is reflected (bytes enter LSB first) with the polynomial 0xEDB88320, a register
preset to all ones and a final complement. ``crc32_step`` is the combinational update of the
register by one byte (eight unrolled shift/XOR steps, which synthesis folds into one XOR
network of at most nine inputs per bit); ``CRC32`` holds the register. ``crc32_update`` is
the register after ``k`` bytes at once: the CRC is linear over GF(2) in the register and the
data jointly, so each bit of the result is the XOR of a fixed set of register and data bits,
found here by pushing unit vectors through ``crc32_step``; ``ParallelCRC32`` holds the
register and takes 0 .. ``width`` bytes a cycle (a wide link's payload beats, a frame's
last partial beat).
"""

from __future__ import annotations

from functools import lru_cache

from amaranth import Cat, Const, Module, Mux, Signal, Value
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

__all__ = ["POLY", "PRESET", "RESIDUE", "crc32_step", "crc32_state", "crc32_update", "CRC32", "ParallelCRC32",
           "chunk_layout"]

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


def chunk_layout(width: int) -> data.StructLayout:
    """Up to ``width`` bytes moving together: ``data`` lanes (lane 0 first on the wire) of
    which the first ``count`` hold bytes."""
    return data.StructLayout({"data": data.ArrayLayout(8, width), "count": range(width + 1)})


@lru_cache(maxsize=None)
def _update_taps(k: int) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """For each of the 32 bits of the register after ``k`` bytes: the register bits and the
    data bits (byte j bit t as 8j + t) whose XOR it is."""
    def state(crc: int, data: bytes) -> int:
        for b in data:
            crc = crc32_step(crc, b)
        return crc

    from_reg = [state(1 << r, bytes(k)) for r in range(32)]
    from_data = []
    for j in range(k):
        for t in range(8):
            d = bytearray(k)
            d[j] = 1 << t
            from_data.append(state(0, bytes(d)))
    return tuple((tuple(r for r in range(32) if from_reg[r] >> i & 1),
                  tuple(x for x in range(8 * k) if from_data[x] >> i & 1)) for i in range(32))


def crc32_update(crc, chunk: bytes | Value, k: int):
    """The register after the first ``k`` bytes of ``chunk`` (lane 0 first): a Python int of
    ints (``chunk`` bytes), or an Amaranth expression of a 32-bit register and a Value whose
    bits ``8j .. 8j+7`` are byte j. Equal to ``k`` steps of ``crc32_step``."""
    if isinstance(crc, int) and isinstance(chunk, (bytes, bytearray)):
        return crc32_state(bytes(chunk[:k]), crc)
    crc, chunk = Value.cast(crc), Value.cast(chunk)
    if k == 0:
        return crc[:32]
    bits = []
    for regs, datas in _update_taps(k):
        terms = [crc[r] for r in regs] + [chunk[x] for x in datas]
        bits.append(Cat(*terms).xor() if terms else Const(0, 1))
    return Cat(*bits)


class ParallelCRC32(wiring.Component):
    """The CRC-32 register, advanced by 0 .. ``width`` bytes per cycle.

    Ports: ``i`` (stream in, ``chunk_layout(width)``, always ready): a valid chunk advances
    the register by its first ``count`` bytes; ``clear``, ``crc``, ``residue_ok`` and
    ``init`` as ``CRC32``'s. Latency: ``crc`` follows a chunk one cycle later. Each count
    has its own XOR network (at most ``32 + 8 * width`` inputs a bit); the count selects.
    """

    def __init__(self, width: int, init: int = PRESET):
        self.width = width
        self.init = init
        super().__init__({
            "i": In(stream.Signature(chunk_layout(width), always_ready=True)),
            "clear": In(1),
            "crc": Out(32),
            "residue_ok": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        reg = Signal(32, init=self.init)
        chunk = self.i.payload.data.as_value()
        with m.If(self.clear):
            m.d.sync += reg.eq(self.init)
        with m.Elif(self.i.valid):
            with m.Switch(self.i.payload.count):
                for k in range(1, self.width + 1):
                    with m.Case(k):
                        m.d.sync += reg.eq(crc32_update(reg, chunk, k))
        m.d.comb += [self.crc.eq(~reg), self.residue_ok.eq(reg == RESIDUE)]
        return m
