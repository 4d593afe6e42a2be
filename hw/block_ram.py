"""A wide memory built of slices that each fit one block RAM deep.

A synchronous read from a memory deeper than one block RAM is a multiplexer behind several
block RAMs' outputs, selected by the address's high bits: on ECP5 the accumulator's 1,152
words of 256 bits became three 512-deep PDPW16KD rows, and the clock-to-output of a block RAM
without its output register (5.8 ns) plus that multiplexer set the 8x8 core's slowest path.
Block RAMs trade width for depth (ECP5's DP16KD and Intel's M20K: 36 or 40 bits x 512, 18/20 x
1024, 9/10 x 2048, ...), so a word split into slices as narrow as its depth requires is read
from one block RAM per slice, with no multiplexer: the same bits, the same latency, a few more
blocks.

Each slice's read data is registered once more (``LATENCY`` = 2: the block RAM's own
address register, then this one), so that the slow clock-to-output of a block RAM without its
output register (5.8 ns on ECP5) and the routing to wherever the data goes (the block RAMs of
a wide memory spread over the die) fall in two cycles. Yosys maps no register into an ECP5
block RAM's output register, and a flip-flop beside the block RAM still leaves the 5.8 ns
and whatever route the placer gives it in one cycle: so elaborated for an ECP5 (a platform
whose ``family`` is ``"ecp5"``) each slice is a DP16KD instantiated with its output register
(``REGMODE`` ``OUTREG``; ``dp16kd``), the same two cycles inside the block RAM (simulated
with the behavioural model sim/dp16kd_model.v). Elsewhere the register is a flip-flop.

``BlockRam(shape, depth, read_ports, granularity, stall=False)`` offers a write port ``write`` and read
ports ``read0``, ``read1``, ... with the signatures of ``amaranth.lib.memory``'s ports (reads
synchronous, data ``LATENCY`` cycles after the address, not transparent; the caller
guarantees no read meets a write of its address in the same cycle, as ``NO_RW_CHECK`` says
of the memories built here). A read port's ``en`` low holds the block RAM's stage: its data
is the last address read, a cycle later. With ``stall`` it holds both stages: a read
pipeline that stalls, whose data is the word addressed in the ``LATENCY``-th last cycle with ``en``
(a consumer that can wait, such as the packet engine's payload reader). With ``granularity``
(elements of an ``ArrayLayout`` shape, as in ``amaranth.lib.memory``) the write port has an
enable per that many elements. The elements of an ``ArrayLayout`` are sliced each on its own
(no slice spans two). Elaborated for an iCE40 (4 kbit block RAMs, 16 bits wide at most) the
memory is not sliced beyond its granules.
"""

from __future__ import annotations

from amaranth import C, Cat, ClockSignal, Instance, Module, Shape, Signal
from amaranth.lib import data, memory, wiring
from amaranth.lib.wiring import Out

#: Attributes of a memory whose reads never meet a write of the same address in one cycle:
#: Yosys then builds no forwarding multiplexer behind the block RAM's output.
NO_RW_CHECK = {"no_rw_check": 1}

__all__ = ["BlockRam", "BLOCK_RAM_ASPECTS", "NO_RW_CHECK", "slice_bits", "dp16kd"]

#: (depth, widest slice) of one block RAM in its aspect ratios, shallowest first: ECP5's DP16KD
#: (36 bits in its pseudo-dual-port mode); Intel's M20K offers at least these widths at these depths.
BLOCK_RAM_ASPECTS = ((512, 36), (1024, 18), (2048, 9), (4096, 4), (8192, 2), (16384, 1))


def slice_bits(depth: int) -> int:
    """The widest slice of a memory of ``depth`` words that one block RAM holds entirely."""
    for d, w in BLOCK_RAM_ASPECTS:
        if depth <= d:
            return w
    raise ValueError(f"a memory of {depth} words is deeper than one block RAM in any aspect "
                     f"ratio (at most {BLOCK_RAM_ASPECTS[-1][0]})")


#: DP16KD's data widths, each with the lowest address pin of its word address (the pins
#: below are byte enables at 18 and 36 bits, else unused): Lattice TN1264.
DP16KD_WORD_PIN = {1: 0, 2: 1, 4: 2, 9: 3, 18: 4, 36: 5}


def dp16kd(m: Module, name: str, width: int, w_en, w_addr, w_data, r_en, r_addr, r_data,
           *, stall: bool = False) -> None:
    """Adds to ``m`` (as submodule ``name``) an ECP5 DP16KD of ``width``-bit words (a width of
    ``DP16KD_WORD_PIN``) that port A writes and port B reads, both ports ``width`` wide (at 36
    bits the block's pseudo-dual-port mode: the word is ``{B, A}`` on both sides), clocked by
    the sync domain. A write of ``w_data`` to ``w_addr`` while ``w_en``. A read: the address
    is registered in a cycle with ``r_en`` and the word passes the output register
    (``REGMODE`` ``OUTREG``, enabled always) the next cycle, so ``r_data`` follows ``r_addr``
    two cycles later and holds while ``r_en`` is low. With ``stall`` the output register is
    enabled by ``r_en`` too: the two stages advance together (``BlockRam``'s ``stall``).
    ``w_data`` and ``r_data`` may be narrower than ``width``."""
    low = DP16KD_WORD_PIN[width]
    side = min(width, 18)
    wd, rd = Signal(width, name=f"{name}_wdata"), Signal(width, name=f"{name}_rdata")
    m.d.comb += [wd.eq(w_data), r_data.eq(rd[:len(r_data)])]
    ports = {}
    for port, addr, en in (("A", w_addr, w_en), ("B", r_addr, r_en)):
        pins = Cat(C(0, low), addr, C(0, 14))[:14]
        if port == "A" and width >= 18:  # the write's byte enables, all set
            pins = Cat(C((1 << (width // 9)) - 1, width // 9), pins[width // 9:])
        ports |= {f"i_AD{port}{k}": pins[k] for k in range(14)}
        ports |= {f"i_CS{port}{k}": C(0, 1) for k in range(3)}
        ports |= {f"i_CE{port}": en, f"i_CLK{port}": ClockSignal("sync"), f"i_RST{port}": C(0, 1),
                  f"i_OCE{port}": en if stall and port == "B" else C(1, 1)}
    ports["i_WEA"], ports["i_WEB"] = w_en, C(0, 1)
    ports |= {f"i_DIA{k}": wd[k] if k < width else C(0, 1) for k in range(18)}
    ports |= {f"i_DIB{k}": wd[18 + k] if width == 36 else C(0, 1) for k in range(18)}
    if width == 36:
        ports |= {f"o_DOA{k}": rd[k] for k in range(18)} | {f"o_DOB{k}": rd[18 + k] for k in range(18)}
    else:
        ports |= {f"o_DOB{k}": rd[k] for k in range(side)}
    m.submodules[name] = Instance(
        "DP16KD",
        p_DATA_WIDTH_A=width, p_DATA_WIDTH_B=width, p_REGMODE_A="OUTREG", p_REGMODE_B="OUTREG",
        p_RESETMODE="SYNC", p_ASYNC_RESET_RELEASE="SYNC", p_CSDECODE_A="0b000", p_CSDECODE_B="0b000",
        p_WRITEMODE_A="NORMAL", p_WRITEMODE_B="NORMAL", p_GSR="DISABLED",
        **ports,
    )


class BlockRam(wiring.Component):
    LATENCY = 2

    def __init__(self, shape, depth: int, read_ports: int = 1, granularity: int | None = None,
                 *, stall: bool = False):
        self.shape, self.depth, self.read_ports, self.granularity = shape, depth, read_ports, granularity
        self.stall = stall
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
        family = str(getattr(platform, "family", "")).lower()
        whole = family == "ice40"
        # Deeper than one block RAM in any aspect (a Stratix V's megabyte payload buffer): a
        # memory whole, whose multiplexer behind its block RAMs the vendor's tools build.
        deep = self.depth > BLOCK_RAM_ASPECTS[-1][0]
        if deep and family == "ecp5":
            raise ValueError(f"a BlockRam of {self.depth} words is deeper than an ECP5 DP16KD in any aspect "
                             f"ratio (at most {BLOCK_RAM_ASPECTS[-1][0]})")
        step = self.width if whole or deep else slice_bits(self.depth)
        wdata = self.write.data.as_value() if hasattr(self.write.data, "as_value") else self.write.data
        if isinstance(self.shape, data.ArrayLayout) and not (whole and self.granularity is None):
            # slices of each element, its granule's enable
            ew = Shape.cast(self.shape.elem_shape).width
            slices = [(e * ew + lo, e * ew + min(lo + step, ew),
                       self.write.en if self.granularity is None else self.write.en[e // self.granularity])
                      for e in range(self.shape.length) for lo in range(0, ew, step)]
        else:  # slices of the word
            slices = [(lo, min(lo + step, self.width), self.write.en) for lo in range(0, self.width, step)]
        if family == "ecp5":
            for s, (lo, hi, en) in enumerate(slices):
                for i in range(self.read_ports):
                    port = self.read(i)
                    rdata = port.data.as_value() if hasattr(port.data, "as_value") else port.data
                    dp16kd(m, f"slice{s}_read{i}", step, en, self.write.addr, wdata[lo:hi],
                           port.en, port.addr, rdata[lo:hi], stall=self.stall)
            return m
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
                if self.stall:
                    with m.If(port.en):
                        m.d.sync += out.eq(rp.data)
                else:
                    m.d.sync += out.eq(rp.data)  # no enable: a read holds in the block RAM only
        return m
