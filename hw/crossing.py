"""Streams from one clock domain to another.

``AsyncStreamFifo``: an asynchronous FIFO (Gray-coded pointers through two-flop synchronizers,
Cummings' "style 2") whose every decision is a register. Amaranth's ``AsyncFIFOBuffered``
computes its read side's pointer increment, Gray encoding and emptiness from the consumer's
``ready`` in the same cycle (``consume_r_nxt = consume_r_bin + r_en``, then the memory's
address and the next pointer's comparison): six levels of logic behind ``ready``, the slowest
path of the Colorlight's 125 MHz link. Here each side keeps its pointer and the pointer's
successor, binary and Gray-coded, in registers, so that advancing is a choice between two
registers; the flags (``i.ready``, and the read side's ``empty``) are registers computed a
cycle ahead, for both outcomes of the cycle's handshake, from registered pointers; and
``o.valid`` and ``o.payload`` are registers. The consumer's ``ready`` reaches one gate (the
read side's load enable) before the flip-flops' enables, the producer's ``valid`` likewise.
"""

from __future__ import annotations

from amaranth import Module, Mux, ResetSignal, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.cdc import AsyncFFSynchronizer, FFSynchronizer
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

__all__ = ["AsyncStreamFifo", "POINTER_STAGES", "RESET_STAGES"]

#: Flip-flops of each Gray-coded pointer's synchronizer into the other domain.
POINTER_STAGES = 2
#: Flip-flops of the write domain's reset into the read domain: one more than the pointer's,
#: so that the read side leaves its reset only after the write pointer's reset value has
#: crossed (the read side then rewinds to it; see ``AsyncStreamFifo``).
RESET_STAGES = POINTER_STAGES + 1


def _gray(value):
    """The reflected binary Gray code of ``value``: consecutive values differ in one bit, so a
    synchronizer that samples the pointer as it changes reads the old value or the new one."""
    return value ^ value[1:]


def _pointer(m: Module, domain: str, bits: int, name: str, advance, rewind=None):
    """A ``bits``-wide pointer (an address and a wrap bit) in registers of ``domain``: itself
    binary (``bin``) and Gray-coded (``gry``), and its successor likewise (``bin_next``,
    ``gry_next``). ``advance`` moves it on by one: each register takes the next one's value,
    the successors the value one further on (an increment of registers, not of ``advance``).
    ``rewind`` (its domain's registers then ``reset_less``): back to 0 first."""
    reset_less = rewind is not None
    regs = dict(bin=Signal(bits, name=f"{name}_bin", reset_less=reset_less),
                gry=Signal(bits, name=f"{name}_gry", reset_less=reset_less),
                bin_next=Signal(bits, name=f"{name}_bin_next", init=1, reset_less=reset_less),
                gry_next=Signal(bits, name=f"{name}_gry_next", init=1, reset_less=reset_less))
    after = Signal(bits, name=f"{name}_after")
    m.d.comb += after.eq(regs["bin_next"] + 1)
    if rewind is not None:
        with m.If(rewind):
            m.d[domain] += [regs["bin"].eq(0), regs["gry"].eq(0), regs["bin_next"].eq(1), regs["gry_next"].eq(1)]
    with (m.Elif if rewind is not None else m.If)(advance):
        m.d[domain] += [regs["bin"].eq(regs["bin_next"]), regs["gry"].eq(regs["gry_next"]),
                        regs["bin_next"].eq(after), regs["gry_next"].eq(_gray(after))]
    return regs


class AsyncStreamFifo(wiring.Component):
    """A stream of ``shape`` (a width or a layout) from ``w_domain`` (``i``) to ``r_domain``
    (``o``): a memory of ``depth`` words (a power of 2, at least 2) and ``o``'s register,
    ``depth + 1`` words in all. No word is lost, duplicated or reordered.

    ``i.ready``, ``o.valid`` and ``o.payload`` are registers. A word taken at a write clock
    edge is on ``o`` after the fourth read clock edge that follows (two synchronizer stages,
    the empty flag, the output register); its slot is free for the writer at the third write
    clock edge after the word reaches ``o``. Throughput: a word each cycle of the slower
    clock, provided ``depth`` covers that round trip (7 or 8 cycles at equal clocks, fewer of
    the slower one's otherwise): from ``depth=8`` at any pair of clocks (measured in
    ``tests/test_hw_crossing.py``; ``depth=4`` gives 4 words in 7 or 8 cycles at equal clocks).
    The memory is read asynchronously (a small one becomes LUT RAM) into ``o``'s register.

    Reset, as Amaranth's ``AsyncFIFO``: the write domain's reset empties the FIFO; the read
    domain's own leaves its words in place (its registers are reset-less). The write domain's
    reset resets the write pointer to 0, and reaches the read side through an asynchronous-set
    synchronous-release synchronizer (``RESET_STAGES``), during which the read pointer rewinds
    to 0 as well and ``o`` empties. (A Gray-coded pointer reset on one side only would jump by
    more than one bit at the other; so the write side alone decides. AsyncFIFO copies the
    synchronized write pointer instead: a rewind to the constant needs no decoder, and a word
    written just after the reset, whose pointer crosses before the reset's release, is not
    skipped.) After its reset, the write side takes no word until it sees the read pointer
    back at 0 (the read side's rewind has crossed), so that a stale read pointer never makes
    it overwrite a word not yet read.
    """

    def __init__(self, shape, *, depth: int, w_domain: str = "write", r_domain: str = "read"):
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 2 or depth & (depth - 1):
            self._MustUse__used = True  # never elaborated: no warning that it was not
            raise ValueError(f"depth must be a power of 2, at least 2, got {depth!r}")
        self.shape, self.depth, self.w_domain, self.r_domain = shape, depth, w_domain, r_domain
        super().__init__({
            "i": In(stream.Signature(shape)),
            "o": Out(stream.Signature(shape)),
        })

    def elaborate(self, platform):
        m = Module()
        w, r = self.w_domain, self.r_domain
        abits = self.depth.bit_length() - 1
        bits = abits + 1                     # the address and a wrap bit: full and empty differ
        m.submodules.storage = storage = Memory(shape=self.shape, depth=self.depth, init=[])
        w_port = storage.write_port(domain=w)
        # read asynchronously into o's register (itself reset-less: a synchronous read port's
        # data would follow the read domain's reset); the LUT RAM a small memory becomes
        r_port = storage.read_port(domain="comb")

        # ---- write side: takes a word while a register says there is room
        store = Signal()
        m.d.comb += store.eq(self.i.valid & self.i.ready)
        wr = _pointer(m, w, bits, "wr", store)
        m.d.comb += [w_port.addr.eq(wr["bin"][:abits]), w_port.data.eq(self.i.payload), w_port.en.eq(store)]

        # ---- read side: loads o's register while it is free or taken and the FIFO holds a word
        w_rst = ResetSignal(w, allow_reset_less=True)
        r_rst = Signal()                # the write side's reset, in the read domain
        m.submodules.rst_sync = AsyncFFSynchronizer(w_rst, r_rst, o_domain=r, stages=RESET_STAGES)
        empty = Signal(init=1, reset_less=True)
        valid = Signal(reset_less=True)  # o.valid (the read domain's own reset keeps the word)
        load = Signal()
        m.d.comb += [load.eq(~empty & (~valid | self.o.ready)), self.o.valid.eq(valid)]
        rd = _pointer(m, r, bits, "rd", load, rewind=r_rst)
        payload = Signal.like(self.o.payload, reset_less=True)
        m.d.comb += [r_port.addr.eq(rd["bin"][:abits]), self.o.payload.eq(payload)]
        with m.If(load):
            m.d[r] += payload.eq(r_port.data)

        # ---- the pointers cross, Gray-coded, each into the other side's registers
        rd_in_w, wr_in_r = Signal(bits), Signal(bits)
        m.submodules.rd_sync = FFSynchronizer(rd["gry"], rd_in_w, o_domain=w, stages=POINTER_STAGES)
        m.submodules.wr_sync = FFSynchronizer(wr["gry"], wr_in_r, o_domain=r, stages=POINTER_STAGES)

        # i.ready for the next cycle: the write pointer as it will be (whether or not this
        # cycle stores) against the read pointer seen, each comparison of registers. Full:
        # a whole turn ahead (the wrap bit and the address's top bit, Gray-coded, both differ).
        turn = 0b11 << (abits - 1)
        settled = Signal()              # the read side's rewind has come back since the reset
        settled_next = settled | (rd_in_w == wr["gry"])
        room_now, room_after = (wr["gry"] != (rd_in_w ^ turn)), (wr["gry_next"] != (rd_in_w ^ turn))
        m.d[w] += [settled.eq(settled_next), self.i.ready.eq(settled_next & Mux(store, room_after, room_now))]

        # empty for the next cycle: the read pointer as it will be against the write pointer seen
        same_now, same_after = (rd["gry"] == wr_in_r), (rd["gry_next"] == wr_in_r)
        with m.If(r_rst):
            m.d[r] += [empty.eq(1), valid.eq(0)]
        with m.Else():
            m.d[r] += empty.eq(Mux(load, same_after, same_now))
            with m.If(load):
                m.d[r] += valid.eq(1)
            with m.Elif(self.o.ready):
                m.d[r] += valid.eq(0)
        return m
