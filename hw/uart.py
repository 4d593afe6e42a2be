"""The UART host link: an 8N1 receiver and transmitter, and the accelerator behind them.

```
 rx pin -> UartRx -> SyncFIFO (fifo_depth bytes) -> a register -> AcceleratorTop(stream_bytes=1) -> UartTx -> tx pin
```

The line is 8N1: idle high, a start bit (low), eight data bits LSB first, one stop bit
(high); every bit lasts ``divisor`` clock cycles (``clock_hz / baud``, rounded: a 100 MHz
clock at 115200 baud gives 868, 0.01% off, far inside the +-2% an 8N1 receiver that samples
mid-bit tolerates).

- ``UartRx``: the receiver, with a two-flop synchronizer on its pin.
- ``UartTx``: the transmitter, back to back at full rate.
- ``UartTop``: what a board top instantiates: ``AcceleratorTop`` behind the two, with a FIFO
  on the receive side that holds bytes while the packet engine is not taking them (while
  it executes a command and sends the reply: a UART has no backpressure).
- ``UartLoop``: a simulation harness with ``AcceleratorTop``'s ports (streams ``i`` and ``o``
  of ``beat_layout(1)``): a host-side transmitter and receiver around a ``UartTop``, so that
  the ``sim`` backend (``sim:...,uart=N``) drives the board-level path unchanged.

A UART has no flow control here: bytes the host sends while the receive FIFO is full are
lost (``overrun``), so the host must not send further ahead than ``fifo_depth`` bytes plus
what the engine takes while it is idle; see ``UartTop``.
"""

from __future__ import annotations

from amaranth import Cat, Module, Signal
from amaranth.lib import fifo, stream, wiring
from amaranth.lib.cdc import FFSynchronizer
from amaranth.lib.wiring import In, Out

from hbfp import contract

from .packet import beat_layout
from .params import CoreConfig
from .top import DEFAULT_FRAME_TIMEOUT, DEFAULT_MAX_PAYLOAD, AcceleratorTop

__all__ = ["UartRx", "UartTx", "UartTop", "UartLoop", "MIN_DIVISOR", "DEFAULT_FIFO_DEPTH", "divisor_for",
           "min_fifo_depth"]

#: The smallest bit time in cycles: the receiver waits ``divisor // 2 - 1`` cycles after it
#: sees a start bit's edge before it samples its middle, and that must be at least one.
MIN_DIVISOR = 4
#: Bytes of the receive FIFO: 4 KiB, a payload's. The engine takes a request while the one
#: before it executes and replies, and stops taking bytes at the end of that one until the
#: first has its reply; the FIFO holds what the host sends meanwhile.
DEFAULT_FIFO_DEPTH = 4096
#: Bits on the line per byte: start, eight data bits, stop.
BITS_PER_BYTE = 10


def divisor_for(clock_hz: int, baud: int) -> int:
    """Clock cycles per bit for ``baud`` at ``clock_hz`` (rounded to the nearest)."""
    if not (isinstance(clock_hz, int) and isinstance(baud, int)) or baud <= 0 or clock_hz <= 0:
        raise ValueError(f"clock_hz and baud must be positive integers, got {clock_hz!r}, {baud!r}")
    divisor = (clock_hz + baud // 2) // baud
    if divisor < MIN_DIVISOR:
        raise ValueError(f"{baud} baud needs at least {MIN_DIVISOR * baud} Hz, the clock is {clock_hz} Hz")
    return divisor


def min_fifo_depth(divisor: int, max_payload: int) -> int:
    """The smallest receive FIFO that never loses a byte of a host that sends the next
    request while a WRITE executes (the driver does, over a serial link): the bytes that
    arrive while the engine replays the largest WRITE's payload (a byte a cycle) and sends
    its reply (a byte a byte time), plus one."""
    byte_cycles = BITS_PER_BYTE * divisor
    write_reply = contract.frame_size(1)  # a WRITE's reply: the status byte alone
    return -(-max_payload // byte_cycles) + write_reply + 1


def _check_divisor(divisor) -> None:
    if not isinstance(divisor, int) or isinstance(divisor, bool) or divisor < MIN_DIVISOR:
        raise ValueError(f"divisor (clock cycles per bit) must be an integer >= {MIN_DIVISOR}, got {divisor!r}")


def _refuse(component, check) -> None:
    """Run ``check()``; a component whose parameters are refused is never elaborated."""
    try:
        check()
    except (ValueError, TypeError):
        component._MustUse__used = True  # never meant to be elaborated: no warning when collected
        raise


class UartRx(wiring.Component):
    """An 8N1 receiver: bytes from the line ``rx`` on the stream ``o``.

    Ports: ``rx`` (in, asynchronous: a two-flop synchronizer), ``o`` (stream out, 8 bits),
    ``framing_error`` and ``overrun`` (out, sticky until reset).

    A falling edge on the idle line starts a byte; the start bit is sampled in its middle
    (``divisor // 2`` cycles after the edge; a line high again there was a glitch, and the
    receiver returns to idle), then each data bit and the stop bit ``divisor`` cycles after
    the one before. A stop bit found low is a framing error: the byte is dropped,
    ``framing_error`` set, and the receiver waits for the line to go high (a break) before it
    hunts again. A byte is held on ``o`` until taken; a byte completed while the one before
    is still held is dropped and sets ``overrun``.

    Latency: ``o.valid`` rises 3 + ``divisor // 2`` + 9 ``divisor`` clock edges after the
    start bit's falling edge (two synchronizer flops, and the output register). The
    receiver hunts again right after the middle of the stop bit, so bytes back to back are
    received, also from a transmitter whose rate is off: up to ``(divisor - divisor // 2 -
    1) / (10 * divisor)`` fast (2.5% at ``divisor`` 4, 4.4% at 16) or ``(divisor // 2) / (9 *
    divisor)`` slow (5.5%), what the one cycle of uncertainty of the start edge leaves.
    """

    def __init__(self, divisor: int):
        _refuse(self, lambda: _check_divisor(divisor))
        self.divisor = divisor
        super().__init__({
            "rx": In(1, init=1),
            "o": Out(stream.Signature(8)),
            "framing_error": Out(1),
            "overrun": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        d = self.divisor
        line = Signal(init=1)
        m.submodules.sync = FFSynchronizer(self.rx, line, init=1)
        count = Signal(range(d))  # cycles until the next sample
        bit = Signal(range(8))
        shift = Signal(8)

        with m.If(self.o.ready):
            m.d.sync += self.o.valid.eq(0)
        with m.FSM():
            with m.State("IDLE"):
                with m.If(~line):
                    m.d.sync += count.eq(d // 2 - 1)
                    m.next = "START"
            with m.State("START"):
                with m.If(count != 0):
                    m.d.sync += count.eq(count - 1)
                with m.Elif(line):
                    m.next = "IDLE"  # high again mid-bit: noise, not a start bit
                with m.Else():
                    m.d.sync += [count.eq(d - 1), bit.eq(0)]
                    m.next = "DATA"
            with m.State("DATA"):
                with m.If(count != 0):
                    m.d.sync += count.eq(count - 1)
                with m.Else():
                    m.d.sync += [shift.eq(Cat(shift[1:], line)), bit.eq(bit + 1), count.eq(d - 1)]
                    with m.If(bit == 7):
                        m.next = "STOP"
            with m.State("STOP"):
                with m.If(count != 0):
                    m.d.sync += count.eq(count - 1)
                with m.Elif(~line):
                    m.d.sync += self.framing_error.eq(1)
                    m.next = "BREAK"
                with m.Else():
                    with m.If(self.o.valid & ~self.o.ready):
                        m.d.sync += self.overrun.eq(1)
                    with m.Else():
                        m.d.sync += [self.o.payload.eq(shift), self.o.valid.eq(1)]
                    m.next = "IDLE"
            with m.State("BREAK"):
                # A low stop bit may be a break (the line held low): a falling edge comes
                # only after the line has been high.
                with m.If(line):
                    m.next = "IDLE"
        return m


class UartTx(wiring.Component):
    """An 8N1 transmitter: bytes from the stream ``i`` onto the line ``tx``.

    Ports: ``i`` (stream in, 8 bits), ``tx`` (out, a register: high when idle).

    A byte taken at a clock edge starts its start bit at that edge; each bit lasts
    ``divisor`` cycles. ``i.ready`` is high while idle and in the last cycle of a stop bit,
    so bytes offered back to back follow each other with exactly one stop bit: one byte
    every ``10 * divisor`` cycles.
    """

    def __init__(self, divisor: int):
        _refuse(self, lambda: _check_divisor(divisor))
        self.divisor = divisor
        super().__init__({
            "i": In(stream.Signature(8)),
            "tx": Out(1, init=1),
        })

    def elaborate(self, platform):
        m = Module()
        d = self.divisor
        busy = Signal()
        count = Signal(range(d))  # cycles left of the current bit, minus one
        left = Signal(range(BITS_PER_BYTE))  # bits after the current one
        shift = Signal(BITS_PER_BYTE - 1)  # those bits, next first: data, then the stop bit

        m.d.comb += self.i.ready.eq(~busy | ((count == 0) & (left == 0)))
        with m.If(self.i.valid & self.i.ready):
            m.d.sync += [
                self.tx.eq(0),
                shift.eq(Cat(self.i.payload, 1)),
                count.eq(d - 1),
                left.eq(BITS_PER_BYTE - 1),
                busy.eq(1),
            ]
        with m.Elif(busy):
            with m.If(count != 0):
                m.d.sync += count.eq(count - 1)
            with m.Elif(left == 0):
                m.d.sync += busy.eq(0)  # the stop bit is over; the line stays high
            with m.Else():
                m.d.sync += [
                    self.tx.eq(shift[0]),
                    shift.eq(Cat(shift[1:], 1)),
                    left.eq(left - 1),
                    count.eq(d - 1),
                ]
        return m


class UartTop(wiring.Component):
    """The device on a UART: ``AcceleratorTop(cfg, stream_bytes=1)`` behind a ``UartRx`` and
    a ``UartTx``. What an FPGA board's top instantiates, with its UART pins on ``rx``/``tx``.

    Ports: ``rx`` (in, asynchronous), ``tx`` (out, a register), ``framing_error`` and
    ``overrun`` (out, the receiver's sticky flags, for LEDs).

    Parameters: ``cfg``; ``divisor`` (clock cycles per bit, >= 4: ``divisor_for(clock_hz,
    baud)``); ``clock_hz`` (reported by IDENTIFY); ``fifo_depth`` (bytes of the receive FIFO,
    at least ``min_fifo_depth(divisor, max_payload)``, at most 2**20); ``frame_timeout`` and ``max_payload`` as ``AcceleratorTop``'s.

    The engine takes a byte a cycle while it receives a frame, and none from the end of a
    frame until the end of its reply, which leaves at the line rate (one byte per ``10 *
    divisor`` cycles). The FIFO holds what arrives meanwhile; beyond ``fifo_depth`` bytes
    they are lost and ``overrun`` is set (a UART has no backpressure): a host may send the
    next WRITE while one executes, but must not send a request while a long reply (a
    product's) is on its way, beyond what the FIFO holds.
    """

    def __init__(self, cfg: CoreConfig = CoreConfig(), *, divisor: int, clock_hz: int = 0,
                 fifo_depth: int = DEFAULT_FIFO_DEPTH, frame_timeout: int = DEFAULT_FRAME_TIMEOUT,
                 max_payload: int = DEFAULT_MAX_PAYLOAD):
        _refuse(self, lambda: self._check(cfg, divisor, clock_hz, fifo_depth, frame_timeout, max_payload))
        self.cfg = cfg
        self.divisor = divisor
        self.clock_hz = clock_hz
        self.fifo_depth = fifo_depth
        self.frame_timeout = frame_timeout
        self.max_payload = max_payload
        super().__init__({
            "rx": In(1, init=1),
            "tx": Out(1, init=1),
            "framing_error": Out(1),
            "overrun": Out(1),
        })

    @staticmethod
    def _check(cfg, divisor, clock_hz, fifo_depth, frame_timeout, max_payload):
        _check_divisor(divisor)
        if not isinstance(fifo_depth, int) or isinstance(fifo_depth, bool) or not 2 <= fifo_depth <= 2**20:
            raise ValueError(f"fifo_depth must be an integer in 2 .. {2**20}, got {fifo_depth!r}")
        AcceleratorTop._check(cfg, 1, clock_hz, frame_timeout, max_payload)
        need = min_fifo_depth(divisor, max_payload)
        if fifo_depth < need:
            raise ValueError(
                f"fifo_depth {fifo_depth} is too small: {need} bytes can arrive while a WRITE of max_payload "
                f"{max_payload} bytes executes and replies at {divisor} cycles a bit")

    def elaborate(self, platform):
        m = Module()
        m.submodules.uart_rx = rx = UartRx(self.divisor)
        m.submodules.uart_tx = tx = UartTx(self.divisor)
        m.submodules.rx_fifo = rx_fifo = fifo.SyncFIFOBuffered(width=8, depth=self.fifo_depth)
        m.submodules.top = top = AcceleratorTop(self.cfg, stream_bytes=1, clock_hz=self.clock_hz,
                                                frame_timeout=self.frame_timeout, max_payload=self.max_payload)
        m.d.comb += [
            rx.rx.eq(self.rx),
            self.tx.eq(tx.tx),
            self.framing_error.eq(rx.framing_error),
            self.overrun.eq(rx.overrun),
        ]
        wiring.connect(m, rx.o, rx_fifo.w_stream)
        # Two registers between the FIFO and the top: the FIFO's byte comes from its block RAM
        # late in the cycle (on ECP5 5.8 ns clock-to-output), and the placer puts a 4 kB memory
        # wherever one is free, on a full part across the die from the receiver's decoding
        # (16 x 16 on an LFE5U-85F: 11 ns of the placement's estimate), so the byte crosses in a
        # cycle of its own. Each takes a byte only when empty, so no path crosses them in one
        # cycle (the receiver's ready to the FIFO's level): a byte every 2 cycles, where the
        # line brings one every 10 * divisor.
        fifo_out = rx_fifo.r_stream
        rx_byte0, rx_valid0 = Signal(8), Signal()
        rx_byte, rx_valid = Signal(8), Signal()
        m.d.comb += fifo_out.ready.eq(~rx_valid0)
        with m.If(~rx_valid0):
            m.d.sync += [rx_valid0.eq(fifo_out.valid), rx_byte0.eq(fifo_out.payload)]
        with m.Elif(~rx_valid):
            m.d.sync += rx_valid0.eq(0)
        with m.If(~rx_valid):
            m.d.sync += [rx_valid.eq(rx_valid0), rx_byte.eq(rx_byte0)]
        with m.Elif(top.i.ready):
            m.d.sync += rx_valid.eq(0)
        # Bytes to beats of one lane, and back (a beat with an empty keep carries no byte).
        m.d.comb += [
            top.i.payload.data[0].eq(rx_byte),
            top.i.payload.keep.eq(1),
            top.i.valid.eq(rx_valid),
            tx.i.payload.eq(top.o.payload.data[0]),
            tx.i.valid.eq(top.o.valid & top.o.payload.keep[0]),
            top.o.ready.eq(tx.i.ready | ~top.o.payload.keep[0]),
        ]
        return m


class UartLoop(wiring.Component):
    """Simulation only: a ``UartTop`` between a host-side ``UartTx`` and ``UartRx``, with the
    ports of ``AcceleratorTop(cfg, stream_bytes=1)`` (streams ``i`` and ``o`` of
    ``beat_layout(1)``), so that a harness written for that top drives the UART path.

    Bytes taken on ``i`` go out on the host's line at the line rate (``i.ready`` is low while
    a byte is being sent); reply bytes come out on ``o`` one per ``10 * divisor`` cycles at
    most. ``o`` must be taken within a byte's time, as a host's UART must read its receive
    register; a byte not taken is lost. Parameters: as ``UartTop``'s.
    """

    def __init__(self, cfg: CoreConfig = CoreConfig(), *, divisor: int, clock_hz: int = 0,
                 fifo_depth: int = DEFAULT_FIFO_DEPTH, frame_timeout: int = DEFAULT_FRAME_TIMEOUT,
                 max_payload: int = DEFAULT_MAX_PAYLOAD):
        _refuse(self, lambda: UartTop._check(cfg, divisor, clock_hz, fifo_depth, frame_timeout, max_payload))
        self.cfg = cfg
        self.divisor = divisor
        self.device_kw = dict(divisor=divisor, clock_hz=clock_hz, fifo_depth=fifo_depth,
                              frame_timeout=frame_timeout, max_payload=max_payload)
        super().__init__({
            "i": In(stream.Signature(beat_layout(1))),
            "o": Out(stream.Signature(beat_layout(1))),
        })

    def elaborate(self, platform):
        m = Module()
        m.submodules.host_tx = host_tx = UartTx(self.divisor)
        m.submodules.device = device = UartTop(self.cfg, **self.device_kw)
        m.submodules.host_rx = host_rx = UartRx(self.divisor)
        m.d.comb += [
            host_tx.i.payload.eq(self.i.payload.data[0]),
            host_tx.i.valid.eq(self.i.valid & self.i.payload.keep[0]),
            self.i.ready.eq(host_tx.i.ready | ~self.i.payload.keep[0]),
            device.rx.eq(host_tx.tx),
            host_rx.rx.eq(device.tx),
            self.o.payload.data[0].eq(host_rx.o.payload),
            self.o.payload.keep.eq(1),
            self.o.valid.eq(host_rx.o.valid),
            host_rx.o.ready.eq(self.o.ready),
        ]
        return m
