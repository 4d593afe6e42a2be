"""A wide memory built of slices that each fit one block RAM deep.

A synchronous read from a memory deeper than one block RAM is a multiplexer behind several
block RAMs' outputs, selected by the address's high bits: on ECP5 the accumulator's 1,152
words of 256 bits became three 512-deep PDPW16KD rows, and the clock-to-output of a block RAM
without its output register (5.8 ns) plus that multiplexer set the 8x8 core's slowest path.
Block RAMs trade width for depth (ECP5's DP16KD and Intel's M20K: 36 or 40 bits x 512, 18/20 x
1024, 9/10 x 2048, ...), so a word split into slices as narrow as its depth requires is read
from one block RAM per slice, with no multiplexer: the same bits, the same latency, a few more
blocks.

Each slice's read data is registered once more beside its block RAM (``LATENCY`` = 2: the
block RAM's own address register, then this one), so that the slow clock-to-output of a
block RAM without its output register (5.8 ns on ECP5) and the routing to wherever the data
goes (the block RAMs of a wide memory spread over the die) fall in two cycles. Yosys maps no
register into an ECP5 block RAM's output register; this one is a flip-flop that the placer
puts next to its block RAM.

``BlockRam(shape, depth, read_ports, granularity)`` offers a write port ``write`` and read
ports ``read0``, ``read1``, ... with the signatures of ``amaranth.lib.memory``'s ports (reads
synchronous, data ``LATENCY`` cycles after the address, not transparent; the caller
guarantees no read meets a write of its address in the same cycle, as ``NO_RW_CHECK`` says
of the memories built here). With ``granularity``
(elements of an ``ArrayLayout`` shape, as in ``amaranth.lib.memory``) the write port has an
enable per that many elements. The elements of an ``ArrayLayout`` are sliced each on its own
(no slice spans two). Elaborated for an iCE40 (4 kbit block RAMs, 16 bits wide at most) the
memory is not sliced beyond its granules.
"""

from __future__ import annotations

from amaranth import Module, Shape, Signal
from amaranth.lib import data, memory, wiring
from amaranth.lib.wiring import Out

from .buffers import NO_RW_CHECK

__all__ = ["BlockRam", "BLOCK_RAM_ASPECTS", "slice_bits"]

#: (depth, widest slice) of one block RAM in its aspect ratios, shallowest first: ECP5's DP16KD
#: (PDPW16KD for 36 bits); Intel's M20K offers at least these widths at these depths.
BLOCK_RAM_ASPECTS = ((512, 36), (1024, 18), (2048, 9), (4096, 4), (8192, 2), (16384, 1))


def slice_bits(depth: int) -> int:
    """The widest slice of a memory of ``depth`` words that one block RAM holds entirely."""
    for d, w in BLOCK_RAM_ASPECTS:
        if depth <= d:
            return w
    raise ValueError(f"a memory of {depth} words is deeper than one block RAM in any aspect "
                     f"ratio (at most {BLOCK_RAM_ASPECTS[-1][0]})")


class BlockRam(wiring.Component):
    LATENCY = 2

    def __init__(self, shape, depth: int, read_ports: int = 1, granularity: int | None = None):
        self.shape, self.depth, self.read_ports, self.granularity = shape, depth, read_ports, granularity
        self.width = Shape.cast(shape).width
        aw = max(1, (depth - 1).bit_length())
        members = {"write": Out(memory.WritePort.Signature(addr_width=aw, shape=shape, granularity=granularity))}
        for i in range(read_ports):
            members[f"read{i}"] = Out(memory.ReadPort.Signature(addr_width=aw, shape=shape))
        super().__init__(members)

    def read(self, i: int):
        return getattr(self, f"read{i}")

    def elaborate(self, platform):
        m = Module()
        # iCE40's block RAMs are 4 kbit, at most 16 bits wide: a deep memory is many of them
        # whatever its slices, so it is built whole there.
        whole = str(getattr(platform, "family", "")).lower() == "ice40"
        step = self.width if whole else slice_bits(self.depth)
        wdata = self.write.data.as_value() if hasattr(self.write.data, "as_value") else self.write.data
        if isinstance(self.shape, data.ArrayLayout) and not (whole and self.granularity is None):
            # slices of each element, its granule's enable
            ew = Shape.cast(self.shape.elem_shape).width
            slices = [(e * ew + lo, e * ew + min(lo + step, ew),
                       self.write.en if self.granularity is None else self.write.en[e // self.granularity])
                      for e in range(self.shape.length) for lo in range(0, ew, step)]
        else:  # slices of the word
            slices = [(lo, min(lo + step, self.width), self.write.en) for lo in range(0, self.width, step)]
        for s, (lo, hi, en) in enumerate(slices):
            m.submodules[f"slice{s}"] = mem = memory.Memory(shape=hi - lo, depth=self.depth, init=[],
                                                            attrs=NO_RW_CHECK)
            wp = mem.write_port()
            m.d.comb += [wp.en.eq(en), wp.addr.eq(self.write.addr), wp.data.eq(wdata[lo:hi])]
            for i in range(self.read_ports):
                port = self.read(i)
                rp = mem.read_port()
                rdata = port.data.as_value() if hasattr(port.data, "as_value") else port.data
                out = Signal(hi - lo, name=f"slice{s}_read{i}", reset_less=True)
                m.d.comb += [rp.en.eq(port.en), rp.addr.eq(port.addr), rdata[lo:hi].eq(out)]
                m.d.sync += out.eq(rp.data)  # no enable: a read holds in the block RAM only
        return m
