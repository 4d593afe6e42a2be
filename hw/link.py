"""The link's byte plumbing: beats of the top's ports, chunks of bytes moving together, and a
realigning byte window that lets a consumer take as many bytes a cycle as it can use.

A wide link (``stream_bytes`` N > 1) carries frames that start at any byte of a beat and
beats whose ``keep`` masks may be sparse. ``BeatCompactor`` packs a beat's kept bytes to the
front (a chunk); ``ByteWindow`` queues chunks and offers the oldest bytes, up to its
``out_bytes``, lane 0 first, whatever their alignment on the wire; the consumer says each
cycle how many it takes (``WindowSignature``'s ``take``). The packet engine's receiver takes
1 byte a cycle in a header and N in a payload; the WRITE replay takes a row chunk's bytes;
the reply path takes N.
"""

from __future__ import annotations

from amaranth import Cat, Const, Module, Mux, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from .crc import chunk_layout

__all__ = ["beat_layout", "chunk_layout", "reply_chunk_layout", "WindowSignature", "BeatCompactor", "ByteWindow",
           "ChunkToBeat", "StreamRegister", "ByteCollector", "BytesToBeats", "BeatsToBytes"]


def beat_layout(stream_bytes: int) -> data.StructLayout:
    """One beat of the top's ``i``/``o`` ports: ``data`` lanes (lane 0 first on the wire) and
    the ``keep`` mask (bit b: lane b holds a byte)."""
    return data.StructLayout({"data": data.ArrayLayout(8, stream_bytes), "keep": stream_bytes})


def reply_chunk_layout(width: int) -> data.StructLayout:
    """A chunk of a reply on its way out: ``last`` marks the chunk holding a frame's final byte."""
    return data.StructLayout({"data": data.ArrayLayout(8, width), "count": range(width + 1), "last": 1})


class WindowSignature(wiring.Signature):
    """The window a ``ByteWindow`` offers (its side): ``data``, the oldest bytes, lane 0 first;
    ``level``, how many of them are there (0 .. width); ``take`` (from the consumer), how
    many it takes this cycle (at most ``level``); ``arrived``, bytes entered the window this
    cycle (the link is not idle, even if the consumer is waiting for more)."""

    def __init__(self, width: int):
        self.width = width
        super().__init__({
            "data": Out(data.ArrayLayout(8, width)),
            "level": Out(range(width + 1)),
            "take": In(range(width + 1)),
            "arrived": Out(1),
        })


class BeatCompactor(wiring.Component):
    """A beat (``beat_layout``) to a chunk (``chunk_layout``): the kept bytes in lane order at
    the front. Combinational (a prefix count of ``keep`` and one selector a lane)."""

    def __init__(self, stream_bytes: int):
        self.stream_bytes = stream_bytes
        super().__init__({
            "i": In(stream.Signature(beat_layout(stream_bytes))),
            "o": Out(stream.Signature(chunk_layout(stream_bytes))),
        })

    def elaborate(self, platform):
        m = Module()
        n = self.stream_bytes
        keep, lanes = self.i.payload.keep, self.i.payload.data
        m.d.comb += [self.o.valid.eq(self.i.valid), self.i.ready.eq(self.o.ready),
                     self.o.payload.count.eq(sum(keep[b].as_unsigned() for b in range(n)))]
        before = [Const(0, range(n + 1))]
        for b in range(1, n):
            before.append(before[-1] + keep[b - 1])
        for j in range(n):
            picked = Const(0, 8)
            for b in range(j, n):  # lane b lands at position popcount(keep[:b]) <= b
                picked = picked | Mux(keep[b] & (before[b] == j), lanes[b], 0)
            m.d.comb += self.o.payload.data[j].eq(picked)
        return m


class StreamRegister(wiring.Component):
    """One register stage on a stream of ``layout``: ``o`` is ``i`` a cycle later, one beat a
    cycle while ``o`` takes them. ``o``'s valid and payload are registers; so that the logic in
    front and the logic behind fall into different cycles.

    ``registered_ready`` False: ``i.ready`` is ``o`` empty or taken (one gate of ``o.ready``).
    True: a skid buffer (a second register for the beat that arrives as ``o`` stalls), and
    ``i.ready`` is a register too, which also cuts a consumer's ready logic off from the
    producer's."""

    def __init__(self, layout, *, registered_ready: bool = False):
        self.registered_ready = registered_ready
        super().__init__({
            "i": In(stream.Signature(layout)),
            "o": Out(stream.Signature(layout)),
        })

    def elaborate(self, platform):
        m = Module()
        if not self.registered_ready:
            m.d.comb += self.i.ready.eq(~self.o.valid | self.o.ready)
            with m.If(self.i.ready):
                m.d.sync += [self.o.valid.eq(self.i.valid), self.o.payload.eq(self.i.payload)]
            return m
        skid = Signal.like(self.i.payload)
        skid_valid = Signal()
        m.d.comb += self.i.ready.eq(~skid_valid)
        with m.If(~self.o.valid | self.o.ready):  # o's register is free after this cycle
            with m.If(skid_valid):
                m.d.sync += [self.o.valid.eq(1), self.o.payload.eq(skid), skid_valid.eq(0)]
            with m.Else():
                m.d.sync += [self.o.valid.eq(self.i.valid), self.o.payload.eq(self.i.payload)]
        with m.Elif(self.i.valid & ~skid_valid):  # o holds: the arriving beat waits beside it
            m.d.sync += [skid.eq(self.i.payload), skid_valid.eq(1)]
        return m


class ByteWindow(wiring.Component):
    """A queue of bytes that takes chunks of up to ``in_bytes`` and offers up to ``out_bytes``.

    Ports: ``i`` (stream in, ``chunk_layout(in_bytes)``): accepted while at most ``depth -
    in_bytes`` bytes are queued (``i.ready`` is a function of registers only); ``o`` (out,
    ``WindowSignature(out_bytes)``): the oldest ``o.level`` bytes; the consumer's ``o.take``
    removes that many at the clock edge. ``depth`` (bytes held, default ``2 * in_bytes +
    out_bytes``): with the default a consumer taking ``out_bytes`` whenever that many are
    there and a producer giving ``in_bytes`` a cycle both run at full rate, whatever the
    alignment of the two (the level stays between ``out_bytes`` and ``in_bytes + out_bytes``,
    where the window still takes a chunk; with ``in_bytes + out_bytes`` it would alternate).

    Latency: a chunk is on offer the cycle after it enters. With ``in_bytes = out_bytes = 1``
    the window is wires (the 1-byte link: a byte is on offer as it arrives, taken as it is).
    """

    def __init__(self, in_bytes: int, out_bytes: int, depth: int | None = None):
        self.in_bytes, self.out_bytes = in_bytes, out_bytes
        self.depth = 2 * in_bytes + out_bytes if depth is None else depth
        if self.depth < max(in_bytes, out_bytes):
            raise ValueError(f"a window of {self.depth} bytes cannot take {in_bytes} or offer {out_bytes}")
        super().__init__({
            "i": In(stream.Signature(chunk_layout(in_bytes))),
            "o": Out(WindowSignature(out_bytes)),
        })

    def elaborate(self, platform):
        m = Module()
        if self.in_bytes == self.out_bytes == 1:
            # Wires: ready follows the consumer (a stream's ready may depend on its valid).
            m.d.comb += [
                self.o.data[0].eq(self.i.payload.data[0]),
                self.o.level.eq(self.i.valid & (self.i.payload.count != 0)),
                self.i.ready.eq(self.o.take | (self.i.payload.count == 0)),
                self.o.arrived.eq(self.i.valid & (self.i.payload.count != 0)),
            ]
            return m
        D, out = self.depth, self.out_bytes
        held = Signal(8 * D)  # bytes at and beyond ``level`` are zero, so a chunk ORs in
        level = Signal(range(D + 1))
        take = self.o.take
        push = self.i.valid & self.i.ready
        count = self.i.payload.count
        incoming = Signal(8 * self.in_bytes)
        mask = Signal(8 * self.in_bytes)
        m.d.comb += [
            # bytes below ``count``: a comparator a byte (no carry chain as wide as the chunk)
            mask.eq(Cat(*((count > k).replicate(8) for k in range(self.in_bytes)))),
            incoming.eq(Mux(push, self.i.payload.data.as_value() & mask, 0)),
            self.i.ready.eq(level <= D - self.in_bytes),
            self.o.data.eq(held[:8 * out]),
            self.o.level.eq(Mux(level > out, out, level)),
            self.o.arrived.eq(push & (count != 0)),
        ]
        # The chunk goes in at ``level`` (it fits: i.ready), then the consumer's share goes out:
        # ``take`` (late: a consumer's ready) only drives the final shift, no subtraction.
        joined = Signal(8 * D)
        m.d.comb += joined.eq(held | (incoming << (level * 8))[:8 * D])
        m.d.sync += [
            held.eq(joined >> (take * 8)),
            level.eq(level + Mux(push, count, 0) - take),
        ]
        return m


class ByteCollector(wiring.Component):
    """A ``ByteWindow`` for a producer of one byte a cycle and a consumer that takes whole
    groups: it collects up to ``limit`` bytes (1 .. ``out_bytes``; held still while bytes are
    in) and the consumer takes all it holds or none (``o.take`` is 0 or ``o.level``).

    Ports as ``ByteWindow(1, out_bytes)`` (``i``: chunks of at most one byte, accepted while
    fewer than ``limit`` bytes are held, a register test), plus ``limit``. Each byte is
    written in place, so there is no shifter: a few LUTs a byte where a window of 64 bytes
    costs thousands. The price: no byte enters in the cycle a group leaves, one cycle in
    ``limit + 1``."""

    def __init__(self, out_bytes: int):
        self.out_bytes = out_bytes
        super().__init__({
            "i": In(stream.Signature(chunk_layout(1))),
            "o": Out(WindowSignature(out_bytes)),
            "limit": In(range(out_bytes + 1)),
        })

    def elaborate(self, platform):
        m = Module()
        out = self.out_bytes
        level = Signal(range(out + 1))
        push = self.i.valid & self.i.ready & (self.i.payload.count != 0)
        m.d.comb += [
            self.i.ready.eq(level < self.limit),
            self.o.level.eq(level),
            self.o.arrived.eq(push),
        ]
        for k in range(out):
            byte = Signal(8, name=f"byte{k}", reset_less=True)  # data: only ``level`` says what counts
            m.d.comb += self.o.data[k].eq(byte)
            with m.If(push & (level == k)):
                m.d.sync += byte.eq(self.i.payload.data[0])
        with m.If(self.o.take != 0):
            m.d.sync += level.eq(0)
        with m.Elif(push):
            m.d.sync += level.eq(level + 1)
        return m


class ChunkToBeat(wiring.Component):
    """Reply chunks (``reply_chunk_layout``) to beats of the top's ``o`` (``beat_layout``): a
    chunk is a beat whose first ``count`` lanes are kept. Wires."""

    def __init__(self, stream_bytes: int):
        self.stream_bytes = stream_bytes
        super().__init__({
            "i": In(stream.Signature(reply_chunk_layout(stream_bytes))),
            "o": Out(stream.Signature(beat_layout(stream_bytes))),
        })

    def elaborate(self, platform):
        m = Module()
        n = self.stream_bytes
        m.d.comb += [
            self.o.valid.eq(self.i.valid),
            self.i.ready.eq(self.o.ready),
            self.o.payload.data.eq(self.i.payload.data),
            self.o.payload.keep.eq(((Const(1, n + 1) << self.i.payload.count) - 1)[:n]),
        ]
        return m


class BytesToBeats(wiring.Component):
    """A byte a cycle (``i``) to beats of ``stream_bytes`` lanes (``o``, ``beat_layout``), lane 0
    first: a beat goes once its lanes are full, or with fewer (``keep`` a prefix) as soon as a
    cycle brings no byte, so that no byte waits for the next. ``o`` is a register; ``i`` takes
    a byte a cycle while ``o`` does not stall. (A narrow link, the network's, feeding a core
    whose clock is slower than the link's.)"""

    def __init__(self, stream_bytes: int):
        self.stream_bytes = stream_bytes
        super().__init__({
            "i": In(stream.Signature(8)),
            "o": Out(stream.Signature(beat_layout(stream_bytes))),
        })

    def elaborate(self, platform):
        m = Module()
        n = self.stream_bytes
        lanes = Signal(data.ArrayLayout(8, n))
        count = Signal(range(n + 1))
        free = ~self.o.valid | self.o.ready            # o's register takes a beat this cycle
        send = (count == n) | ((count != 0) & ~self.i.valid)
        m.d.comb += self.i.ready.eq((count != n) | free)
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += self.o.valid.eq(0)
        take = self.i.valid & self.i.ready
        with m.If(send & free):
            m.d.sync += [self.o.valid.eq(1), self.o.payload.data.eq(lanes),
                         self.o.payload.keep.eq(((Const(1, n + 1) << count) - 1)[:n]),
                         count.eq(take)]
            with m.If(take):
                m.d.sync += lanes[0].eq(self.i.payload)
        with m.Elif(take):
            m.d.sync += [lanes[count].eq(self.i.payload), count.eq(count + 1)]
        return m


class BeatsToBytes(wiring.Component):
    """Beats of ``stream_bytes`` lanes (``i``, ``beat_layout``, any ``keep``) to a byte a cycle
    (``o``): each beat's kept lanes in lane order. A beat waits in a register while its bytes
    go; the next is taken as its last byte leaves."""

    def __init__(self, stream_bytes: int):
        self.stream_bytes = stream_bytes
        super().__init__({
            "i": In(stream.Signature(beat_layout(stream_bytes))),
            "o": Out(stream.Signature(8)),
        })

    def elaborate(self, platform):
        m = Module()
        n = self.stream_bytes
        lanes = Signal(data.ArrayLayout(8, n))
        left = Signal(n)                    # the lanes still to send
        first = Signal(n)                   # the lowest of them, one-hot
        m.d.comb += first.eq(left & (~left + 1))
        byte = Const(0, 8)
        for b in range(n):
            byte = byte | Mux(first[b], lanes[b], 0)
        m.d.comb += [self.o.valid.eq(left != 0), self.o.payload.eq(byte)]
        after = Mux(self.o.ready, left & ~first, left)  # the lanes left after this cycle
        m.d.comb += self.i.ready.eq(after == 0)
        with m.If(self.i.valid & self.i.ready):
            m.d.sync += [lanes.eq(self.i.payload.data), left.eq(self.i.payload.keep)]
        with m.Else():
            m.d.sync += left.eq(after)
        return m
