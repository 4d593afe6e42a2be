"""The Ethernet MAC of the network link: frames in and out on GMII (a byte per cycle, 125 MHz
at 1 Gb/s), each a stream of bytes from the destination address to the end of the payload.

```
 rx_dv/rx_er/rxd -> MacRx (preamble, SFD, FCS checked, length) -> FrameFifo (commit or drop) -> o
 i -> FrameFifo (whole frames) -> MacTx (preamble, SFD, data, padding, FCS, gap) -> tx_en/tx_er/txd
```

- ``FrameFifo``: a store-and-forward byte FIFO of whole frames. A frame's bytes are written
  one a cycle and reach the reader only once the frame is committed whole; a dropped frame
  (a bad check, or one that found the buffer full) leaves no byte behind.
- ``MacRx``: a frame is the bytes after the start frame delimiter (0xD5, after any number of
  preamble bytes 0x55) while ``rx_dv`` stays high. It is kept when it is 64 .. ``MAX_FRAME``
  bytes long (its FCS included), had no ``rx_er`` and its FCS checks (the CRC register ends
  at ``crc.RESIDUE``); the FCS is stripped. Anything else is dropped and counted by its
  reason: ``runts``, ``oversize``, ``bad_fcs``, ``errors`` (rx_er), ``overflows`` (no room).
- ``MacTx``: sends each whole frame of its buffer: seven preamble bytes and the SFD, the
  frame's bytes, zeros up to ``MIN_FRAME - 4`` bytes, the FCS (``zlib.crc32`` of the frame,
  little-endian) and then ``IFG_CYCLES`` idle cycles.

The frames are the stream ``frame_layout``: a byte and ``last`` (the frame's final byte).
Both units run in one clock domain (``sync``; a top renames it to the link's 125 MHz domain).
"""

from __future__ import annotations

from amaranth import Const, Module, Mux, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from hbfp.host import datagrams as D

from .block_ram import NO_RW_CHECK, BlockRam
from .crc import PRESET, RESIDUE, crc32_step
from .link import StreamRegister

__all__ = ["frame_layout", "FrameFifo", "MacRx", "MacTx", "PREAMBLE", "SFD", "MIN_FRAME", "MAX_FRAME",
           "IFG_CYCLES", "FCS_BYTES"]

#: A preamble byte and the start frame delimiter, as GMII carries them.
PREAMBLE, SFD = 0x55, 0xD5
#: The shortest and longest frames on the wire, destination address to FCS (IEEE 802.3, no
#: VLAN tag), the frame check sequence's bytes, and the idle cycles between frames (the
#: interframe gap of 96 bit times): ``hbfp.host.datagrams``', which the host's figures use too.
MIN_FRAME, MAX_FRAME, FCS_BYTES, IFG_CYCLES = D.MIN_FRAME, D.MAX_FRAME, D.FCS, D.GAP
#: Preamble bytes a transmitter sends before the SFD.
PREAMBLE_BYTES = 7


def frame_layout() -> data.StructLayout:
    """One byte of a frame: ``data`` and ``last`` (the frame's final byte)."""
    return data.StructLayout({"data": 8, "last": 1})


class FrameFifo(wiring.Component):
    """Whole frames, first in first out, in a buffer of ``depth`` bytes (a power of two).

    Write side: ``w_data`` with ``w_valid`` writes a byte of the current frame; ``w_end``
    ends it (in the same cycle as its last byte, or later on its own): with ``w_ok`` the
    frame is committed, less its final ``trim`` bytes (an FCS to strip), else dropped.
    ``p_en`` patches the current frame: ``p_data`` replaces its byte ``p_addr`` (one written
    already), in a cycle without ``w_valid`` (a checksum known only once its bytes are in).
    ``w_room`` says whether a byte written now finds room (and a frame ended now a place among
    the ``max_frames`` waiting, default one per 32 bytes of buffer; a register, so it keeps a
    byte of the buffer free); one written while it is low
    breaks the frame: at its end it is dropped too, and ``overflow`` pulses (also when a frame
    ends with no place left: a writer that cannot wait, a receiver). A frame with no byte left
    after ``trim`` commits nothing.

    ``waits``: the writer writes a byte, and ends a frame it keeps, only while ``w_room`` is
    high (a transmitter's writer, which can wait): no frame is then broken, ``overflow`` never
    pulses, and an end commits on ``w_ok`` and a length left after ``trim`` alone (fewer terms
    into the registers it updates, for the link's 125 MHz).

    Read side: ``o``, the committed frames' bytes (``frame_layout``), one a cycle while
    ``o.ready`` is high (a frame's bytes back to back once its first is offered);
    ``length``, the number of bytes of the frame whose first byte ``o`` offers.
    """

    @staticmethod
    def check_depth(component, depth) -> None:
        """Refuse a buffer that is no power of two >= 64 (``component`` is then never elaborated)."""
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 64 or depth & (depth - 1):
            component._MustUse__used = True
            raise ValueError(f"a frame buffer's bytes must be a power of two >= 64, got {depth!r}")

    def __init__(self, depth: int, *, trim: int = 0, max_frames: int | None = None, waits: bool = False):
        self.check_depth(self, depth)
        self.depth, self.trim, self.waits = depth, trim, waits
        self.max_frames = depth // 32 if max_frames is None else max_frames
        super().__init__({
            "w_data": In(8),
            "w_valid": In(1),
            "w_end": In(1),
            "w_ok": In(1),
            "p_en": In(1),
            "p_addr": In(range(depth)),
            "p_data": In(8),
            "w_room": Out(1),
            "overflow": Out(1),
            "o": Out(stream.Signature(frame_layout())),
            "length": Out(depth.bit_length()),
        })

    def elaborate(self, platform):
        m = Module()
        depth = self.depth
        bits = depth.bit_length() - 1
        # the bytes: block RAM read in two cycles (``BlockRam``: on an ECP5 its output register,
        # so that its slow clock-to-output does not share a cycle with anything)
        m.submodules.mem = mem = BlockRam(8, depth, stall=True)
        wr_port, rd_port = mem.write, mem.read(0)
        # the committed frames' lengths, each written a cycle after its frame ends (``push``), in
        # a list (a deep one goes to block RAM) read (``pop``) into a register; ``held`` of them
        # not yet read, and ``any_held`` (``held != 0``) a register computed a cycle ahead, so
        # that ``pop`` is a gate of registers, not behind a comparison of ``held`` and the adder
        # that updates it (SyncFIFOBuffered's level: the receive clock's slowest path)
        push, push_length, pop = Signal(), Signal(bits + 1), Signal()
        max_frames = self.max_frames
        m.submodules.lengths = lengths = Memory(shape=bits + 1, depth=max_frames, init=[], attrs=NO_RW_CHECK)
        lengths_w, lengths_r = lengths.write_port(), lengths.read_port()
        l_wr, l_rd = Signal(range(max_frames)), Signal(range(max_frames))
        held, any_held = Signal(range(max_frames + 1)), Signal()
        m.d.comb += [lengths_w.addr.eq(l_wr), lengths_w.data.eq(push_length), lengths_w.en.eq(push),
                     lengths_r.addr.eq(l_rd), lengths_r.en.eq(pop)]
        with m.If(push):
            m.d.sync += l_wr.eq(Mux(l_wr == max_frames - 1, 0, l_wr + 1))
        with m.If(pop):
            m.d.sync += l_rd.eq(Mux(l_rd == max_frames - 1, 0, l_rd + 1))
        # (a pop needs a length held: after a push at least one is)
        m.d.sync += [held.eq(held + push - pop), any_held.eq(push | Mux(pop, held >= 2, any_held))]
        trim = self.trim
        m.d.sync += push.eq(0)

        # The write side's inputs pass a register first (``w``): a writer's late decision then
        # only reaches these registers in its cycle, and the buffer's own logic starts from
        # registers in the next, for the link's 125 MHz. ``w_room`` answers for a byte whose
        # write lands a cycle later, so it keeps three bytes (and three lengths) in hand.
        # Beside them, the ``room`` and ``place`` the writer saw: what the buffer promised.
        w = Signal(data.StructLayout({"w_valid": 1, "w_end": 1, "w_ok": 1, "w_data": 8,
                                      "p_en": 1, "p_addr": bits, "p_data": 8, "room": 1, "place": 1}))
        start = Signal(bits + 1)   # where the current frame began (the committed end)
        wr = Signal(bits + 1)      # the next byte's address, wrap bit on top
        rd = Signal(bits + 1)
        broken = Signal()
        # Registers, so that what the writer decides late in its cycle (``w_valid``, ``w_end``,
        # ``w_ok``: a byte, an end) only selects among values ready early, for the link's 125 MHz:
        # ``room``, at least three bytes free (a byte may go in during the cycle it is computed,
        # and one may wait in ``w``); ``place``, a place for three more frames' lengths; ``n0``/``n1``, the
        # current frame's length less ``trim`` now and one byte on, ``ok0``/``ok1``, whether each
        # is > 0; ``end0``, where the frame ends if it ends now (``wr - trim``). With no ``trim``,
        # ``end0`` is ``wr`` and ``ok1`` always 1: neither is a register of its own (fewer
        # registers behind the end's decision).
        room, place, room_place = Signal(init=1), Signal(init=1), Signal(init=1)
        n0 = Signal(range(-trim - 1, depth + 2), init=-trim)
        n1 = Signal(range(-trim - 1, depth + 2), init=1 - trim)
        ok0 = Signal()
        ok1 = Signal() if trim else Const(1)
        end0 = Signal(bits + 1, init=-trim % (2 * depth)) if trim else wr
        # ``room_now``: at most depth - 3 bytes in the buffer, wr - rd <= depth - 3, as one carry
        # chain: ``limit`` (a register: rd + depth - 3 a cycle late, so never more room than
        # there is) less wr is depth - 3 - (wr - rd) >= -3, whose sign, modulo 2 * depth, is its
        # top bit (a subtraction, then a comparison, missed the link's 8 ns)
        limit = Signal(bits + 1, init=depth - 3)
        m.d.sync += limit.eq(rd + depth - 3)
        room_now, place_now = ~(limit - wr)[bits], held + push <= max_frames - 3
        m.d.sync += [room.eq(room_now), place.eq(place_now),
                     room_place.eq(room_now & place_now)]  # w_room a register itself: no gate after it
        m.d.comb += self.w_room.eq(room_place)
        m.d.sync += [w.w_valid.eq(self.w_valid), w.w_end.eq(self.w_end), w.w_ok.eq(self.w_ok),
                     w.w_data.eq(self.w_data), w.p_en.eq(self.p_en), w.p_addr.eq(self.p_addr),
                     w.p_data.eq(self.p_data), w.room.eq(room), w.place.eq(place)]

        write = w.w_valid if self.waits else w.w_valid & ~broken & w.room
        # each byte (or patch) reaches the block RAM a cycle later, through registers: a reader
        # sees a frame only cycles after its end, and a writer's data path ends here
        m.d.sync += [wr_port.addr.eq(Mux(w.p_en, (start + w.p_addr)[:bits], wr[:bits])),
                     wr_port.data.eq(Mux(w.p_en, w.p_data, w.w_data)), wr_port.en.eq(write | w.p_en)]
        broken_now = Const(0) if self.waits else broken | (w.w_valid & ~w.room)
        length, length_ok = Mux(write, n1, n0), Mux(write, ok1, ok0)
        m.d.sync += self.overflow.eq(0)
        # ``write`` is late: it selects among sums of registers (``Mux(write, x + 1, x)``, not
        # ``x + write``, which would run it through a carry chain)
        def plus_write(x):
            return Mux(write, x + 1, x)[:bits + 1]
        with m.If(w.w_end):
            commit = w.w_ok & length_ok if self.waits else w.w_ok & ~broken_now & w.place & length_ok
            with m.If(commit):
                end = plus_write(end0)  # = start + length
                m.d.sync += [start.eq(end), wr.eq(end), push.eq(1), push_length.eq(length[:bits + 1])]
                if trim:
                    m.d.sync += end0.eq(plus_write(end0 - trim))
            with m.Else():  # the frame's bytes are forgotten
                m.d.sync += wr.eq(start)
                if trim:
                    m.d.sync += end0.eq(start - trim)
            m.d.sync += [broken.eq(0), self.overflow.eq(0 if self.waits else w.w_ok & (broken_now | ~w.place)),
                         n0.eq(-trim), n1.eq(1 - trim), ok0.eq(0)]
            if trim:
                m.d.sync += ok1.eq(0)
        with m.Else():
            m.d.sync += [wr.eq(plus_write(wr)), broken.eq(broken_now)]
            if trim:
                m.d.sync += end0.eq(plus_write(end0))
            with m.If(write):
                m.d.sync += [n0.eq(n1), ok0.eq(ok1), n1.eq(n1 + 1)]
                if trim:
                    m.d.sync += ok1.eq(n1 >= 0)

        # The reader: a frame's length, then its bytes from the block RAM (two stages, ``s1``
        # and ``s2``, each byte's place in its frame beside it), then a register: all advancing
        # together while that register can take a byte.
        remaining, length = Signal(bits + 1), Signal(bits + 1)
        meta = data.StructLayout({"valid": 1, "last": 1, "length": bits + 1})
        s1, s2 = Signal(meta), Signal(meta)
        m.submodules.out = out = StreamRegister(data.StructLayout({"byte": frame_layout(), "length": bits + 1}))
        advance = out.i.ready
        fetch = advance & (remaining != 0)
        # a length leaves its list (``pop``: read from the block RAM) into ``next_length`` (a
        # register straight behind it) a cycle later, and from there into the reader
        next_length, has_next, popped = Signal(bits + 1), Signal(), Signal()
        m.d.comb += pop.eq(any_held & ~has_next & ~popped)
        m.d.sync += popped.eq(pop)
        with m.If(popped):
            m.d.sync += [next_length.eq(lengths_r.data), has_next.eq(1)]
        m.d.comb += [rd_port.addr.eq(rd[:bits]), rd_port.en.eq(advance),
                     out.i.valid.eq(s2.valid), out.i.payload.byte.data.eq(rd_port.data),
                     out.i.payload.byte.last.eq(s2.last), out.i.payload.length.eq(s2.length)]
        with m.If((remaining == 0) & has_next):
            m.d.sync += [remaining.eq(next_length), length.eq(next_length), has_next.eq(0)]
        with m.If(advance):
            m.d.sync += [s2.eq(s1), s1.valid.eq(fetch), s1.last.eq(remaining == 1), s1.length.eq(length)]
        with m.If(fetch):
            m.d.sync += [rd.eq(rd + 1), remaining.eq(remaining - 1)]
        m.d.comb += [self.o.valid.eq(out.o.valid), self.o.payload.eq(out.o.payload.byte),
                     out.o.ready.eq(self.o.ready), self.length.eq(out.o.payload.length)]
        return m


class MacRx(wiring.Component):
    """Frames from GMII's receive side to ``o`` (``frame_layout``), FCS checked and stripped,
    through a ``FrameFifo`` of ``buffer_bytes``.

    Ports: ``rx_dv``, ``rx_er``, ``rxd`` (GMII, sampled each cycle); ``o``; ``length`` (of the
    frame whose first byte ``o`` offers: ``FrameFifo``'s); the counters
    (32 bits, wrapping) ``frames`` (kept), ``runts``, ``oversize``, ``bad_fcs``, ``errors``
    and ``overflows`` (module docstring). Reset finds the line mid-frame: the receiver waits
    for ``rx_dv`` low before it hunts for a preamble.
    """

    COUNTERS = ("frames", "runts", "oversize", "bad_fcs", "errors", "overflows")

    def __init__(self, buffer_bytes: int = 4096):
        FrameFifo.check_depth(self, buffer_bytes)
        self.buffer_bytes = buffer_bytes
        super().__init__({
            "rx_dv": In(1),
            "rx_er": In(1),
            "rxd": In(8),
            "o": Out(stream.Signature(frame_layout())),
            "length": Out(buffer_bytes.bit_length()),
            **{name: Out(32) for name in self.COUNTERS},
        })

    def elaborate(self, platform):
        m = Module()
        m.submodules.buffer = buf = FrameFifo(self.buffer_bytes, trim=FCS_BYTES)
        wiring.connect(m, buf.o, wiring.flipped(self.o))
        m.d.comb += self.length.eq(buf.length)

        crc = Signal(32, init=PRESET)
        count = Signal(range(MAX_FRAME + 2))  # bytes after the SFD, up to MAX_FRAME + 1
        over = Signal()                       # more than MAX_FRAME of them: no more are kept
        error = Signal()
        ending = Signal()  # a frame ended last cycle, its verdict in ``why``
        why = Signal(data.StructLayout({"error": 1, "long": 1, "runt": 1, "bad": 1}))
        dv, er, d = self.rx_dv, self.rx_er, self.rxd
        # the bytes go into the buffer a cycle later, from registers (the link's 125 MHz)
        store, byte = Signal(), Signal(8)
        m.d.sync += [store.eq(0), byte.eq(d), ending.eq(0)]
        m.d.comb += [buf.w_valid.eq(store), buf.w_data.eq(byte)]

        with m.FSM(init="SKIP"):
            with m.State("SKIP"):  # inside a frame that is not ours to take: wait for its end
                with m.If(~dv):
                    m.next = "IDLE"
            with m.State("IDLE"):
                m.d.sync += [crc.eq(PRESET), count.eq(0), error.eq(0), over.eq(0)]
                with m.If(dv):
                    with m.If(er):
                        m.next = "SKIP"
                    with m.Elif(d == SFD):
                        m.next = "DATA"
                    with m.Elif(d == PREAMBLE):
                        m.next = "PREAMBLE"
                    with m.Else():
                        m.next = "SKIP"
            with m.State("PREAMBLE"):
                with m.If(~dv):
                    m.next = "IDLE"
                with m.Elif(er | ((d != PREAMBLE) & (d != SFD))):
                    m.next = "SKIP"
                with m.Elif(d == SFD):
                    m.next = "DATA"
            with m.State("DATA"):
                with m.If(dv):
                    m.d.sync += store.eq(~over)
                    m.d.sync += [crc.eq(crc32_step(crc, d)), error.eq(error | er), over.eq(over | (count == MAX_FRAME))]
                    with m.If(~over):
                        m.d.sync += count.eq(count + 1)
                with m.Else():  # the frame's end: judged now, committed or dropped next cycle
                    m.d.sync += [ending.eq(1), why.error.eq(error), why.long.eq(over),
                                 why.runt.eq(count < MIN_FRAME), why.bad.eq(crc != RESIDUE)]
                    m.next = "IDLE"
        # The judged frame ends in the buffer (its next frame's SFD is a cycle or more away);
        # one that passed its checks but found no room is counted when the buffer says so, two
        # cycles later (``FrameFifo``'s inputs pass a register).
        ok = ~why.error & ~why.long & ~why.runt & ~why.bad
        m.d.comb += [buf.w_end.eq(ending), buf.w_ok.eq(ok)]
        with m.If(ending):
            with m.If(why.error):
                m.d.sync += self.errors.eq(self.errors + 1)
            with m.Elif(why.long):
                m.d.sync += self.oversize.eq(self.oversize + 1)
            with m.Elif(why.runt):
                m.d.sync += self.runts.eq(self.runts + 1)
            with m.Elif(why.bad):
                m.d.sync += self.bad_fcs.eq(self.bad_fcs + 1)
        judged, kept = Signal(), Signal()
        m.d.sync += [judged.eq(buf.w_end & buf.w_ok), kept.eq(judged)]
        with m.If(buf.overflow):
            m.d.sync += self.overflows.eq(self.overflows + 1)
        with m.Elif(kept):
            m.d.sync += self.frames.eq(self.frames + 1)
        return m


class MacTx(wiring.Component):
    """Frames from ``i`` (``frame_layout``: destination address to the end of the payload, at
    most ``MAX_FRAME - FCS_BYTES`` bytes) onto GMII's transmit side, each once it is whole in a
    ``FrameFifo`` of ``buffer_bytes``: preamble and SFD, the frame, zero padding up to
    ``MIN_FRAME - FCS_BYTES`` bytes, the FCS, ``IFG_CYCLES`` idle. ``tx_er`` stays low. A frame
    longer than ``buffer_bytes`` would never be whole: the sender of ``i`` keeps to the limit.
    """

    def __init__(self, buffer_bytes: int = 4096):
        FrameFifo.check_depth(self, buffer_bytes)
        self.buffer_bytes = buffer_bytes
        super().__init__({
            "i": In(stream.Signature(frame_layout())),
            "tx_en": Out(1),
            "tx_er": Out(1),
            "txd": Out(8),
            "frames": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        m.submodules.buffer = buf = FrameFifo(self.buffer_bytes, waits=True)
        take = self.i.valid & buf.w_room
        m.d.comb += [self.i.ready.eq(buf.w_room), buf.w_data.eq(self.i.payload.data), buf.w_valid.eq(take),
                     buf.w_end.eq(take & self.i.payload.last), buf.w_ok.eq(1)]

        crc = Signal(32, init=PRESET)
        sent = Signal(range(MIN_FRAME + 1))  # frame bytes sent, saturating at the padded length
        count = Signal(range(max(PREAMBLE_BYTES, IFG_CYCLES) + 1))
        fcs = Signal(32)
        txd, src = self.txd, buf.o

        def byte(value):
            m.d.sync += [self.tx_en.eq(1), txd.eq(value)]

        def frame_byte(value):
            byte(value)
            m.d.sync += crc.eq(crc32_step(crc, value))
            with m.If(sent < MIN_FRAME):
                m.d.sync += sent.eq(sent + 1)

        m.d.sync += self.tx_en.eq(0)
        with m.FSM():
            with m.State("IDLE"):
                m.d.sync += [crc.eq(PRESET), sent.eq(0), count.eq(0)]
                with m.If(src.valid):  # a whole frame: its bytes follow back to back
                    m.next = "PREAMBLE"
            with m.State("PREAMBLE"):
                with m.If(count < PREAMBLE_BYTES):
                    byte(PREAMBLE)
                    m.d.sync += count.eq(count + 1)
                with m.Else():
                    byte(SFD)
                    m.d.sync += count.eq(0)
                    m.next = "DATA"
            with m.State("DATA"):
                m.d.comb += src.ready.eq(1)
                frame_byte(src.payload.data)
                with m.If(src.payload.last):
                    with m.If(sent + 1 < MIN_FRAME - FCS_BYTES):
                        m.next = "PAD"
                    with m.Else():
                        m.next = "FCS"
            with m.State("PAD"):
                frame_byte(0)
                with m.If(sent + 1 == MIN_FRAME - FCS_BYTES):
                    m.next = "FCS"
            with m.State("FCS"):
                m.d.comb += fcs.eq(~crc)
                byte(fcs[:8])
                m.d.sync += [crc.eq(crc >> 8), count.eq(count + 1)]
                with m.If(count == FCS_BYTES - 1):
                    m.d.sync += [count.eq(0), self.frames.eq(self.frames + 1)]
                    m.next = "GAP"
            with m.State("GAP"):
                m.d.sync += count.eq(count + 1)
                with m.If(count == IFG_CYCLES - 1):
                    m.next = "IDLE"
        return m
