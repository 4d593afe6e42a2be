"""The device on a network: the accelerator top behind the Ethernet link (``hw.eth_udp``).

```
 GMII rx -> UdpLink -> BytesToBeats (link domain) -> FIFO -> AcceleratorTop(stream_bytes) (sync)
 GMII tx <- UdpLink <- BeatsToBytes <- StreamRegister (link domain) <- FIFO <-
```

- ``EthTop``: what a board top instantiates, its GMII pins in the link's clock domain (125 MHz
  at 1 Gb/s), the core in ``sync``; two asynchronous FIFOs of beats cross between them
  (``hw.crossing.AsyncStreamFifo``, ``CROSSING_DEPTH``; with ``link_domain="sync"`` both their
  sides on one clock). The link moves a byte a cycle; the core takes and gives
  ``stream_bytes`` a cycle (``stream_bytes_for``: enough that a core clock slower than the
  link's is not the bottleneck).
- ``EthLoop``: a simulation harness with ``AcceleratorTop``'s ports (streams ``i`` and ``o`` of
  ``beat_layout(1)``), so that the ``sim`` backend (``sim:link=eth``) drives the network path:
  a host-side ``MacTx`` and ``MacRx`` on the ``EthTop``'s GMII, each frame on ``i`` and ``o`` as
  its length (2 bytes, little-endian) and its bytes (no FCS).
"""

from __future__ import annotations

from amaranth import DomainRenamer, Module, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from .crossing import AsyncStreamFifo
from .eth_mac import MacRx, MacTx
from .eth_udp import LINK_COUNTERS, UdpLink
from .link import BeatsToBytes, BytesToBeats, StreamRegister, beat_layout
from .params import CoreConfig
from .top import DEFAULT_FRAME_TIMEOUT, DEFAULT_MAX_PAYLOAD, AcceleratorTop

__all__ = ["EthTop", "EthLoop", "DEFAULT_MAC", "DEFAULT_IP", "DEFAULT_PORT", "CROSSING_DEPTH", "stream_bytes_for"]

#: The address a device has unless its build says otherwise: a locally administered MAC
#: ("HBFP" in it), 192.168.1.50, port 7000.
DEFAULT_MAC, DEFAULT_IP, DEFAULT_PORT = 0x02_48_42_46_50_01, 0xC0A8_0132, 7000
#: Beats of each FIFO between the link's domain and the core's (``AsyncStreamFifo``'s memory; its
#: output register holds one more). 8 covers the pointers' round trip through their
#: synchronizers even at equal clocks (a beat each cycle of the slower clock:
#: tests/test_hw_crossing.py), so the faster side waits on the slower one, not on the
#: synchronizers; deeper pointers cost a level of logic in their comparisons.
CROSSING_DEPTH = 8


def stream_bytes_for(link_hz: int, core_hz: int) -> int:
    """The bytes a cycle a core at ``core_hz`` must take to keep up with a byte a cycle at
    ``link_hz``."""
    return max(1, -(-link_hz // core_hz))


class EthTop(wiring.Component):
    """The accelerator (``AcceleratorTop(cfg, stream_bytes)``) behind a ``UdpLink`` for
    ``mac``, ``ip`` and ``port``. Ports: GMII ``rx_dv``, ``rx_er``, ``rxd`` (in ``rx_domain``,
    RGMII's receive clock, if given, else ``link_domain``), ``tx_en``, ``tx_er``, ``txd`` (in
    ``link_domain``) and the link's counters."""

    def __init__(self, cfg: CoreConfig = CoreConfig(), *, mac: int = DEFAULT_MAC, ip: int = DEFAULT_IP,
                 port: int = DEFAULT_PORT, link_domain: str = "eth", rx_domain: str | None = None, clock_hz: int = 0,
                 frame_timeout: int = DEFAULT_FRAME_TIMEOUT, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 stream_bytes: int = 1):
        try:
            AcceleratorTop._check(cfg, stream_bytes, clock_hz, frame_timeout, max_payload)
            self.link = UdpLink(mac, ip, port, rx_domain=rx_domain)  # checks the address
        except (ValueError, TypeError):
            self._MustUse__used = True
            raise
        self.cfg, self.link_domain, self.stream_bytes = cfg, link_domain, stream_bytes
        self.top_kw = dict(clock_hz=clock_hz, frame_timeout=frame_timeout, max_payload=max_payload)
        super().__init__({
            "rx_dv": In(1), "rx_er": In(1), "rxd": In(8),
            "tx_en": Out(1), "tx_er": Out(1), "txd": Out(8),
            **{name: Out(32) for name in LINK_COUNTERS},
        })

    def elaborate(self, platform):
        m = Module()
        link_domain = self.link_domain
        m.submodules.link = link = DomainRenamer(link_domain)(self.link)
        n = self.stream_bytes
        m.submodules.top = top = AcceleratorTop(self.cfg, stream_bytes=n, **self.top_kw)
        link_side = DomainRenamer(link_domain)
        m.submodules.pack = pack = link_side(BytesToBeats(n))
        m.submodules.unpack = unpack = link_side(BeatsToBytes(n))
        # a skid buffer: the ready the crossing's read side sees (the enable of its pointers
        # and output register) is a register, not the unpacker's decision
        m.submodules.skid = skid = link_side(StreamRegister(beat_layout(n), registered_ready=True))
        # (with link_domain "sync", EthLoop's, both sides of each crossing run on one clock)
        m.submodules.to_core = to_core = AsyncStreamFifo(beat_layout(n), depth=CROSSING_DEPTH,
                                                         w_domain=link_domain, r_domain="sync")
        m.submodules.to_link = to_link = AsyncStreamFifo(beat_layout(n), depth=CROSSING_DEPTH,
                                                         w_domain="sync", r_domain=link_domain)
        m.d.comb += [link.rx_dv.eq(self.rx_dv), link.rx_er.eq(self.rx_er), link.rxd.eq(self.rxd),
                     self.tx_en.eq(link.tx_en), self.tx_er.eq(link.tx_er), self.txd.eq(link.txd)]
        m.d.comb += [getattr(self, c).eq(getattr(link, c)) for c in LINK_COUNTERS]
        wiring.connect(m, link.o, pack.i)
        wiring.connect(m, pack.o, to_core.i)
        wiring.connect(m, to_core.o, top.i)
        wiring.connect(m, top.o, to_link.i)
        wiring.connect(m, to_link.o, skid.i)
        wiring.connect(m, skid.o, unpack.i)
        wiring.connect(m, unpack.o, link.i)
        return m


class EthLoop(wiring.Component):
    """Simulation only: an ``EthTop`` (one clock domain) between a host-side ``MacTx`` and
    ``MacRx``, with the ports of ``AcceleratorTop(cfg, stream_bytes=1)``: each Ethernet frame
    (no FCS) travels on ``i`` and ``o`` as its length (2 bytes, little-endian) and its bytes.
    Parameters: ``EthTop``'s."""

    def __init__(self, cfg: CoreConfig = CoreConfig(), **device_kw):
        self.device = EthTop(cfg, link_domain="sync", **device_kw)
        super().__init__({
            "i": In(stream.Signature(beat_layout(1))),
            "o": Out(stream.Signature(beat_layout(1))),
        })

    def elaborate(self, platform):
        m = Module()
        m.submodules.device = device = self.device
        m.submodules.host_tx = host_tx = MacTx(16384)
        m.submodules.host_rx = host_rx = MacRx(16384)
        m.d.comb += [device.rx_dv.eq(host_tx.tx_en), device.rx_er.eq(host_tx.tx_er), device.rxd.eq(host_tx.txd),
                     host_rx.rx_dv.eq(device.tx_en), host_rx.rx_er.eq(device.tx_er), host_rx.rxd.eq(device.txd)]

        # i: a frame's length, then its bytes, into the host's transmitter
        left = Signal(16)
        low = Signal(8)
        byte, keep = self.i.payload.data[0], self.i.payload.keep[0]
        with m.FSM():
            with m.State("LOW"):
                m.d.comb += self.i.ready.eq(1)
                with m.If(self.i.valid & keep):
                    m.d.sync += low.eq(byte)
                    m.next = "HIGH"
            with m.State("HIGH"):
                m.d.comb += self.i.ready.eq(1)
                with m.If(self.i.valid & keep):
                    m.d.sync += left.eq(byte << 8 | low)
                    m.next = "DATA"
            with m.State("DATA"):
                with m.If(left == 0):
                    m.next = "LOW"
                with m.Else():
                    m.d.comb += [host_tx.i.valid.eq(self.i.valid & keep), host_tx.i.payload.data.eq(byte),
                                 host_tx.i.payload.last.eq(left == 1), self.i.ready.eq(host_tx.i.ready | ~keep)]
                    with m.If(self.i.valid & keep & host_tx.i.ready):
                        m.d.sync += left.eq(left - 1)

        # o: each frame the host receives, its length first
        length = Signal(16)
        # (keep as valid rather than a constant: a port bit no signal drives is never set by an
        # event-driven always block in Verilator)
        m.d.comb += self.o.payload.keep.eq(self.o.valid)
        with m.FSM():
            with m.State("IDLE"):
                with m.If(host_rx.o.valid):
                    m.d.sync += length.eq(host_rx.length)
                    m.next = "LOW"
            with m.State("LOW"):
                m.d.comb += [self.o.valid.eq(1), self.o.payload.data[0].eq(length[:8])]
                with m.If(self.o.ready):
                    m.next = "HIGH"
            with m.State("HIGH"):
                m.d.comb += [self.o.valid.eq(1), self.o.payload.data[0].eq(length[8:])]
                with m.If(self.o.ready):
                    m.next = "DATA"
            with m.State("DATA"):
                m.d.comb += [self.o.valid.eq(host_rx.o.valid), self.o.payload.data[0].eq(host_rx.o.payload.data),
                             host_rx.o.ready.eq(self.o.ready)]
                with m.If(host_rx.o.valid & self.o.ready & host_rx.o.payload.last):
                    m.next = "IDLE"
        return m
