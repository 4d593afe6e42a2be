"""cocotb drivers for ``amaranth.lib.stream`` ports, with random stalls on both sides.

Amaranth flattens a stream port ``name`` into ``name__valid``, ``name__ready`` and
``name__payload`` (a packed vector; a ``data.Struct`` payload packs its fields from the LSB
in declaration order). Payloads travel here as Python ints; ``pack``/``unpack`` convert
lanes of fixed width.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ReadOnly, RisingEdge


def pack(values: Iterable[int], width: int) -> int:
    """Lanes (lane 0 in the LSBs) of ``width`` bits each, two's complement for negatives."""
    word = 0
    mask = (1 << width) - 1
    for i, v in enumerate(values):
        word |= (int(v) & mask) << (i * width)
    return word


def unpack(word: int, width: int, count: int, signed: bool = False) -> list[int]:
    mask = (1 << width) - 1
    out = []
    for i in range(count):
        v = (word >> (i * width)) & mask
        if signed and v >> (width - 1):
            v -= 1 << width
        out.append(v)
    return out


async def start_clock_and_reset(dut, *, sources: Sequence[str] = (), sinks: Sequence[str] = (), cycles: int = 2, period_ns: int = 10) -> None:
    """Start the clock and hold ``rst`` for
    ``cycles`` cycles. The handshake inputs of the DUT's stream ports (``valid`` of
    ``sources``, ``ready`` of ``sinks``) are driven low first, so that no X from an
    undriven input enters the design on a 4-state simulator."""
    for name in sources:
        getattr(dut, f"{name}__valid").value = 0
    for name in sinks:
        getattr(dut, f"{name}__ready").value = 0
    # cocotb ends every task a test started when the test ends: each test starts its clock.
    cocotb.start_soon(Clock(dut.clk, period_ns, unit="ns").start())
    dut.rst.value = 1
    for _ in range(cycles):
        await RisingEdge(dut.clk)
    dut.rst.value = 0


class StreamSource:
    """Drives ``name__valid``/``name__payload``; holds a beat until ``name__ready``.

    ``stall`` is the probability of an idle cycle before each beat."""

    def __init__(self, dut, name: str, *, stall: float = 0.0, rng: random.Random | None = None):
        self.dut = dut
        self.valid = getattr(dut, f"{name}__valid")
        self.ready = getattr(dut, f"{name}__ready")
        self.payload = getattr(dut, f"{name}__payload")
        self.stall = stall
        self.rng = rng or random.Random(0)
        self.valid.value = 0
        self.sent = 0

    async def send(self, beats: Sequence[int]) -> None:
        clk = self.dut.clk
        for beat in beats:
            while self.stall and self.rng.random() < self.stall:
                self.valid.value = 0
                await RisingEdge(clk)
            self.payload.value = beat
            self.valid.value = 1
            while True:
                await ReadOnly()
                accepted = bool(self.ready.value)
                await RisingEdge(clk)
                if accepted:
                    break
            self.sent += 1
        self.valid.value = 0


class StreamSink:
    """Drives ``name__ready`` (randomly low with probability ``stall``) and collects payloads.

    ``ahead``: the name of an input that takes the ready of the next cycle (a producer that
    registers its stall, as ``FloatMacArray(ready_ahead=True)``): each cycle's ready is then
    decided a cycle early and told there."""

    def __init__(self, dut, name: str, *, stall: float = 0.0, rng: random.Random | None = None,
                 ahead: str | None = None):
        self.dut = dut
        self.valid = getattr(dut, f"{name}__valid")
        self.ready = getattr(dut, f"{name}__ready")
        self.payload = getattr(dut, f"{name}__payload")
        self.ahead = getattr(dut, ahead) if ahead else None
        self.stall = stall
        self.rng = rng or random.Random(1)
        self.ready.value = 0
        if self.ahead is not None:
            self.ahead.value = 0
        self.told = False  # the ready told for the coming cycle
        self.beats: list[int] = []

    async def receive(self, count: int, *, timeout_cycles: int | None = None) -> list[int]:
        """Collect ``count`` beats; raises TimeoutError after ``timeout_cycles`` without one."""
        clk = self.dut.clk
        got: list[int] = []
        idle = 0
        while len(got) < count:
            ready = not (self.stall and self.rng.random() < self.stall)
            if self.ahead is not None:
                ready, self.told = self.told, ready
                self.ahead.value = int(self.told)
            self.ready.value = int(ready)
            await ReadOnly()
            fire = ready and bool(self.valid.value)
            if fire:
                value = self.payload.value
                if not value.is_resolvable:
                    raise ValueError(f"{self.payload._name}: payload {value} has X/Z bits on a valid beat")
                got.append(int(value))
                idle = 0
            else:
                idle += 1
                if timeout_cycles is not None and idle > timeout_cycles:
                    raise TimeoutError(f"no beat on the output for {timeout_cycles} cycles ({len(got)}/{count} received)")
            await RisingEdge(clk)
        self.beats.extend(got)
        if self.ahead is not None and self.told:
            # Ready was told for this cycle: it is kept (in the background, so that the caller
            # sees the last beat's cycle), then "not ready" from the next on; a beat taken in
            # that cycle is one more than asked for, kept in ``beats``.
            cocotb.start_soon(self._keep_told(clk))
        else:
            self.ready.value = 0
        return got

    async def _keep_told(self, clk) -> None:
        self.ready.value = 1
        self.ahead.value = self.told = 0
        await ReadOnly()
        if self.valid.value:
            self.beats.append(int(self.payload.value))
        await RisingEdge(clk)
        self.ready.value = 0
