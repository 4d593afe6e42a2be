"""ARP, IPv4 and UDP for one address and port: the network link's datagrams (docs/protocol.md,
"UDP") between the Ethernet MAC (``hw.eth_mac``) and the packet engine's byte stream.

```
 MacRx -> UdpRx --o--> stream bytes (to the engine)
            |  \\--arp--> ArpResponder --\\
            |  \\--icmp--> IcmpEcho -------FrameArbiter -> MacTx
            peer                           /
 stream bytes (from the engine) --i--> UdpTx ---/
```

- ``UdpRx`` reads each received frame (FCS already checked) once, a byte a cycle: an ARP
  request for ``ip`` goes to ``ArpResponder``; an IPv4 datagram to ``mac`` and ``ip`` (no
  options, not fragmented, header checksum right) for UDP port ``port``, with the datagram
  header's version and a number ``Sequence`` takes (``hbfp.host.datagrams``), gives its
  stream bytes on ``o`` and makes its sender the ``peer``; an ICMP message for ``ip`` goes to
  ``IcmpEcho``. Anything else is ignored.
- ``UdpTx`` collects the engine's bytes into datagrams of at most ``MAX_STREAM_BYTES`` (sent
  when full, or once no byte has come for ``flush_cycles``) in a ``FrameFifo``, and sends
  each to the peer: Ethernet, IPv4 (header checksum, TTL 64, don't fragment) and UDP
  headers (no checksum), the datagram header with its number, the bytes.
- ``ArpResponder``: the 42-byte ARP reply to a request (``MacTx`` pads it).
- ``IcmpEcho``: the echo reply to an ICMP echo request for ``ip`` (``ping``).
- ``FrameArbiter``: whole frames from several streams, one at a time, the first stream first.
- ``UdpLink``: all of it on GMII, with ``MacRx`` and ``MacTx``.

Everything runs in one clock domain (the link's 125 MHz in a board top).
"""

from __future__ import annotations

from types import SimpleNamespace

from amaranth import Cat, Const, DomainRenamer, Module, Mux, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from hbfp.host import datagrams as D

from .crossing import AsyncStreamFifo
from .eth_mac import FrameFifo, MacRx, MacTx, frame_layout
from .link import StreamRegister

__all__ = ["UdpRx", "UdpTx", "ArpResponder", "IcmpEcho", "FrameArbiter", "UdpLink", "LINK_COUNTERS", "ETHERTYPE_IPV4", "ETHERTYPE_ARP",
           "BROADCAST", "TTL", "HEADER_BYTES"]

ETHERTYPE_IPV4, ETHERTYPE_ARP = 0x0800, 0x0806
BROADCAST = 0xFFFF_FFFF_FFFF
IP_PROTO_UDP, IP_PROTO_ICMP = 17, 1
ICMP_ECHO_REQUEST, ICMP_ECHO_REPLY = 8, 0
#: The time to live of the datagrams sent.
TTL = 64
#: The headers in front of a datagram's stream bytes in its frame (``datagrams.FRAME_HEADERS``).
HEADER_BYTES = D.FRAME_HEADERS
#: Bytes of an ARP request or reply after the Ethernet header.
ARP_BYTES = 28
#: The last byte of a frame that ``UdpRx`` reads as a header (a datagram header's version).
LAST_HEADER_BYTE = 45
#: An IPv4 ARP request's fields after the Ethernet header (bytes 14-21: hardware Ethernet,
#: protocol IPv4, address lengths 6 and 4, operation 1).
ARP_REQUEST = 0x0001_0800_0604_0001
#: Bytes of the FIFO from the receive clock (RGMII's) to the link's, both 125 MHz nominally (a
#: byte each cycle of either while a frame passes): twice the pointers' round trip at equal
#: clocks (``AsyncStreamFifo`` keeps a byte a cycle from 8), as the two clocks drift.
RX_CROSSING_DEPTH = 16


def _check_address(component, mac, ip, port):
    """Refuse an address a device cannot have (``component`` is then never elaborated)."""
    why = None
    for name, value, bits in (("mac", mac, 48), ("ip", ip, 32), ("port", port, 16)):
        if why is None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << bits):
            why = f"{name} must be an integer of {bits} bits, got {value!r}"
    if why is None and mac & (1 << 40):
        why = f"mac {mac:012x} is a group address: a device needs an individual one"
    if why is not None:
        component._MustUse__used = True
        raise ValueError(why)


def big_endian(value, nbytes: int) -> list:
    """The bytes of ``value`` (an int or a Value of ``8 * nbytes`` bits), most significant first."""
    if isinstance(value, int):
        return [Const((value >> (8 * (nbytes - 1 - i))) & 0xFF, 8) for i in range(nbytes)]
    return [value[8 * (nbytes - 1 - i):8 * (nbytes - i)] for i in range(nbytes)]


class Checksum(wiring.Component):
    """The IPv4 header checksum (RFC 1071: the one's complement of the one's complement sum of
    its 16-bit words) of a header whose constant words sum to ``fixed`` and whose others are
    ``words`` (held steady meanwhile), a word a cycle, then folded twice (registers all the way,
    for the link's 125 MHz): ``start`` begins; ``len(words) + 2`` cycles later ``done`` rises,
    with ``value``, until the next ``start``."""

    def __init__(self, fixed: int, count: int):
        self.fixed, self.count = fixed, count
        super().__init__({"start": In(1), "words": In(data.ArrayLayout(16, count)), "done": Out(1),
                          "value": Out(16)})

    def elaborate(self, platform):
        m = Module()
        n = self.count
        acc = Signal(max(self.fixed.bit_length(), 16) + n.bit_length() + 1)
        step = Signal(range(n + 3))
        m.d.comb += self.value.eq(~acc[:16])
        with m.If(self.start):
            m.d.sync += [acc.eq(self.fixed), step.eq(0), self.done.eq(0)]
        with m.Elif(step < n):
            m.d.sync += [acc.eq(acc + self.words[step]), step.eq(step + 1)]
        with m.Elif(step < n + 2):  # the end-around carries
            m.d.sync += [acc.eq(acc[:16] + acc[16:]), step.eq(step + 1)]
        with m.Else():
            m.d.sync += self.done.eq(1)
        return m


def icmp_layout() -> data.StructLayout:
    """Where an ICMP message came from (its sender's MAC and IP), its IPv4 identification and
    its length (the IPv4 total length less the header)."""
    return data.StructLayout({"mac": 48, "ip": 32, "ident": 16, "length": 16})


def peer_layout() -> data.StructLayout:
    """Where replies go: the sender of the last datagram taken."""
    return data.StructLayout({"mac": 48, "ip": 32, "port": 16})


class UdpRx(wiring.Component):
    """Received frames (``i``, ``frame_layout``, FCS checked and stripped) to stream bytes
    (``o``), ARP requests (``arp``) and the ``peer`` (module docstring).

    Counters (32 bits): ``datagrams`` (taken), ``late`` (refused by their number), ``lost``
    (numbers skipped), ``arp_requests`` (for our address)."""

    COUNTERS = ("datagrams", "late", "lost", "arp_requests")

    def __init__(self, mac: int, ip: int, port: int):
        _check_address(self, mac, ip, port)
        self.mac, self.ip, self.port = mac, ip, port
        super().__init__({
            "i": In(stream.Signature(frame_layout())),
            "o": Out(stream.Signature(8)),
            "arp": Out(stream.Signature(data.StructLayout({"mac": 48, "ip": 32}))),
            "peer": Out(peer_layout()),
            "peer_valid": Out(1),
            "icmp": Out(stream.Signature(frame_layout())),
            "icmp_from": Out(icmp_layout()),
            **{name: Out(32) for name in self.COUNTERS},
        })

    def elaborate(self, platform):
        m = Module()
        byte = self.i.payload.data
        # The byte's place in its frame while it is in the headers read here, one-hot (``at[k]``:
        # byte k; none past byte ``LAST_HEADER_BYTE``): each header register's enable is then
        # ``take`` and a flip-flop, not ``take`` and a comparison of a counter's 11 bits, for the
        # link's 125 MHz.
        at = Signal(LAST_HEADER_BYTE + 1, init=1)
        sh = Signal(64)            # the frame's last eight bytes, the newest in the low bits
        nxt = Cat(byte, sh[:56])   # ... with this one
        take = self.i.valid & self.i.ready
        with m.If(take):
            m.d.sync += sh.eq(nxt)
            with m.If(self.i.payload.last):
                m.d.sync += at.eq(1)
            with m.Else():
                m.d.sync += at.eq(at << 1)

        unicast, for_us = Signal(), Signal()  # to our MAC; to it or broadcast
        src_mac = Signal(48)
        arp_ok, arp_sha, arp_spa = Signal(), Signal(48), Signal(32)
        ip_hdr, total_len, src_ip = Signal(), Signal(16), Signal(32)
        ip_fields = Signal()  # ip_hdr, not a fragment, a length that holds a UDP header
        # a datagram for us, its parts each a register of one enable (no chain of updates):
        # the IPv4 header's (``udp_ok``), the port (``port_ok``), the UDP length (``len_ok``),
        # all three (``dgram_ok``, the byte before the datagram header's version)
        udp_ok, port_ok, len_ok, dgram_ok = Signal(), Signal(), Signal(), Signal()
        ip_payload = Signal(16)                # total_len less the IPv4 header: the UDP datagram or ICMP message
        ident = Signal(16)
        udp_src, seq, flags = Signal(16), Signal(16), Signal(8)
        stream_len = Signal(16)                # udp_len less the UDP and datagram headers
        synced, expected, ahead = Signal(), Signal(16), Signal(16)
        # The bytes passed on, counted down (a register each way, for the link's 125 MHz):
        forward, forward_left = Signal(), Signal(16)  # a datagram's stream bytes, to ``o``
        echo, echo_left = Signal(), Signal(16)        # an ICMP message, to ``icmp``

        csum_ok = self._header_checksum(m, take, at, nxt)

        # Comparisons with constants are made a byte ahead where they can: a flag registered at
        # the byte before a decision holds the earlier bytes' part, and the decision adds the
        # last byte's comparison (eight bits) and a few registered flags, for the link's 125 MHz.
        mac_hi, bcast_hi = Signal(), Signal()     # bytes 0-4 are our MAC's first five, all 0xFF
        is_arp, is_ipv4 = Signal(), Signal()      # the EtherType
        arp_hi = Signal()                         # ARP bytes 14-20 are an IPv4 request's
        len_udp, len_stream = Signal(), Signal()  # total_len holds a UDP header; and a datagram header
        frag_ok = Signal()                        # not a fragment
        is_udp, is_icmp = Signal(), Signal()      # the protocol
        dst_hi, tpa_hi, port_hi = Signal(), Signal(), Signal()  # our IP's first three bytes; our port's first
        # The header's registers and flags, which the parts below set and read (each flag is set
        # afresh at its byte before any later byte of the frame reads it).
        h = SimpleNamespace(at=at, byte=byte, nxt=nxt, take=take, unicast=unicast, for_us=for_us, src_mac=src_mac,
                            arp_ok=arp_ok, arp_sha=arp_sha, arp_spa=arp_spa, ip_hdr=ip_hdr, total_len=total_len,
                            src_ip=src_ip, ip_fields=ip_fields, udp_ok=udp_ok, port_ok=port_ok, len_ok=len_ok,
                            dgram_ok=dgram_ok, ip_payload=ip_payload, ident=ident, udp_src=udp_src, seq=seq,
                            flags=flags, stream_len=stream_len, synced=synced, expected=expected, ahead=ahead,
                            forward=forward, forward_left=forward_left, echo=echo, echo_left=echo_left,
                            csum_ok=csum_ok, mac_hi=mac_hi, bcast_hi=bcast_hi, is_arp=is_arp, is_ipv4=is_ipv4,
                            arp_hi=arp_hi, len_udp=len_udp, len_stream=len_stream, frag_ok=frag_ok, is_udp=is_udp,
                            is_icmp=is_icmp, dst_hi=dst_hi, tpa_hi=tpa_hi, port_hi=port_hi)
        with m.If(take):
            self._ethernet_and_arp(m, h)
            self._ipv4_and_udp(m, h)
        with m.If(self.arp.valid & self.arp.ready):
            m.d.sync += self.arp.valid.eq(0)

        self._pass_on(m, h)
        return m

    def _header_checksum(self, m, take, at, nxt):
        """The IPv4 header's checksum: its words summed as they pass (the destination address,
        which must be ours, counted from the start), folded twice while it ends, checked at
        its last byte; returns the register that says it is right."""
        ip_hi, ip_lo = self.ip >> 16, self.ip & 0xFFFF
        csum, csum_ok = Signal(20), Signal()
        with m.If(take):
            with m.If(at[14]):
                m.d.sync += csum.eq(ip_hi + ip_lo)
            with m.Elif(at[15:30:2].any()):
                m.d.sync += csum.eq(csum + nxt[:16])
            with m.Elif(at[30] | at[31]):
                m.d.sync += csum.eq(csum[:16] + csum[16:])
            with m.Elif(at[32]):
                m.d.sync += csum_ok.eq(csum == 0xFFFF)

        return csum_ok

    def _ethernet_and_arp(self, m, h):
        """At a byte taken: the Ethernet header's flags (to us or broadcast, the source, the
        EtherType) and an ARP request's fields; a request for our address answered on ``arp``."""
        at, byte, nxt, unicast, for_us, src_mac = h.at, h.byte, h.nxt, h.unicast, h.for_us, h.src_mac
        arp_ok, arp_sha, arp_spa, mac_hi, bcast_hi = h.arp_ok, h.arp_sha, h.arp_spa, h.mac_hi, h.bcast_hi
        is_arp, is_ipv4, arp_hi, tpa_hi = h.is_arp, h.is_ipv4, h.arp_hi, h.tpa_hi
        mac, ip = self.mac.to_bytes(6, "big"), self.ip.to_bytes(4, "big")
        with m.If(at[4]):
            m.d.sync += [mac_hi.eq(nxt[:40] == self.mac >> 8), bcast_hi.eq(nxt[:40] == BROADCAST >> 8)]
        with m.If(at[5]):
            m.d.sync += [unicast.eq(mac_hi & (byte == mac[5])),
                         for_us.eq((mac_hi & (byte == mac[5])) | (bcast_hi & (byte == 0xFF)))]
        with m.If(at[11]):
            m.d.sync += src_mac.eq(nxt[:48])
        with m.If(at[13]):
            m.d.sync += [is_arp.eq(nxt[:16] == ETHERTYPE_ARP), is_ipv4.eq(nxt[:16] == ETHERTYPE_IPV4)]
        # ARP: hardware Ethernet, protocol IPv4, lengths 6 and 4, a request
        with m.If(at[20]):
            m.d.sync += arp_hi.eq(nxt[:56] == ARP_REQUEST >> 8)
        with m.If(at[21]):
            m.d.sync += arp_ok.eq(for_us & is_arp & arp_hi & (byte == ARP_REQUEST & 0xFF))
        with m.If(at[27]):
            m.d.sync += arp_sha.eq(nxt[:48])
        with m.If(at[31]):
            m.d.sync += arp_spa.eq(nxt[:32])
        with m.If(at[40]):
            m.d.sync += tpa_hi.eq(nxt[:24] == self.ip >> 8)
        with m.If(at[41]):
            with m.If(arp_ok & tpa_hi & (byte == ip[3])):
                m.d.sync += self.arp_requests.eq(self.arp_requests + 1)
                with m.If(~self.arp.valid):  # one at a time: the requester asks again
                    m.d.sync += [self.arp.valid.eq(1), self.arp.payload.mac.eq(arp_sha),
                                 self.arp.payload.ip.eq(arp_spa)]

    def _ipv4_and_udp(self, m, h):
        """At a byte taken: the IPv4 header's fields and checks, then the UDP header's and our
        datagram header's; at its last byte a datagram is taken (or refused by its number)."""
        at, byte, nxt, unicast, src_mac, ip_hdr = h.at, h.byte, h.nxt, h.unicast, h.src_mac, h.ip_hdr
        total_len, src_ip, ip_fields, udp_ok, port_ok = h.total_len, h.src_ip, h.ip_fields, h.udp_ok, h.port_ok
        len_ok, dgram_ok, ip_payload, ident, udp_src = h.len_ok, h.dgram_ok, h.ip_payload, h.ident, h.udp_src
        seq, flags, stream_len, synced, expected, ahead = h.seq, h.flags, h.stream_len, h.synced, h.expected, h.ahead
        forward_left, echo_left, csum_ok, is_ipv4 = h.forward_left, h.echo_left, h.csum_ok, h.is_ipv4
        len_udp, len_stream, frag_ok, is_udp, is_icmp = h.len_udp, h.len_stream, h.frag_ok, h.is_udp, h.is_icmp
        dst_hi, port_hi = h.dst_hi, h.port_hi
        ip = self.ip.to_bytes(4, "big")
        # IPv4: version 4, 5 words of header (no options), not a fragment, to our address
        with m.If(at[14]):
            m.d.sync += ip_hdr.eq(unicast & is_ipv4 & (byte == 0x45))
        with m.If(at[17]):
            m.d.sync += total_len.eq(nxt[:16])
        with m.If(at[18]):
            m.d.sync += [ip_payload.eq(total_len - D.IPV4_HEADER),
                         len_udp.eq(total_len >= D.IPV4_HEADER + D.UDP_HEADER),
                         len_stream.eq(total_len >= D.IPV4_HEADER + D.UDP_HEADER + D.HEADER.size)]
        with m.If(at[19]):
            m.d.sync += ident.eq(nxt[:16])
        with m.If(at[21]):
            m.d.sync += frag_ok.eq((nxt[:16] & 0x3FFF) == 0)  # bytes 20-21: flags and fragment offset
        with m.If(at[23]):
            m.d.sync += [ip_fields.eq(ip_hdr & frag_ok & len_udp),
                         is_udp.eq(byte == IP_PROTO_UDP), is_icmp.eq(byte == IP_PROTO_ICMP)]
        with m.If(at[29]):
            m.d.sync += src_ip.eq(nxt[:32])
        with m.If(at[32]):
            m.d.sync += dst_hi.eq(nxt[:24] == self.ip >> 8)
        with m.If(at[33]):
            hdr_ok = ip_fields & dst_hi & (byte == ip[3]) & csum_ok
            m.d.sync += [udp_ok.eq(hdr_ok & is_udp & len_stream), echo_left.eq(ip_payload),
                         self.icmp_from.mac.eq(src_mac), self.icmp_from.ip.eq(src_ip),
                         self.icmp_from.ident.eq(ident), self.icmp_from.length.eq(ip_payload)]
        with m.If(at[35]):
            m.d.sync += udp_src.eq(nxt[:16])
        with m.If(at[36]):
            m.d.sync += port_hi.eq(byte == self.port >> 8)
        with m.If(at[37]):
            m.d.sync += port_ok.eq(port_hi & (byte == self.port & 0xFF))
        with m.If(at[39]):
            m.d.sync += [stream_len.eq(nxt[:16] - (D.UDP_HEADER + D.HEADER.size)),
                         len_ok.eq((nxt[:16] >= D.UDP_HEADER + D.HEADER.size) & (nxt[:16] <= ip_payload))]
        with m.If(at[43]):
            m.d.sync += seq.eq(Cat(nxt[8:16], nxt[:8]))  # little-endian
        with m.If(at[44]):
            m.d.sync += [flags.eq(byte), ahead.eq(seq - expected), dgram_ok.eq(udp_ok & port_ok & len_ok)]
        with m.If(at[LAST_HEADER_BYTE]):  # the datagram header is whole: take it or not
            in_order = ~synced | flags[0] | ~ahead[15]
            ok = dgram_ok & (byte == D.VERSION)
            with m.If(ok & in_order):
                m.d.sync += [forward_left.eq(stream_len), synced.eq(1), expected.eq(seq + 1),
                             self.datagrams.eq(self.datagrams + 1),
                             self.peer.mac.eq(src_mac), self.peer.ip.eq(src_ip), self.peer.port.eq(udp_src),
                             self.peer_valid.eq(1)]
                with m.If(synced & ~flags[0]):
                    m.d.sync += self.lost.eq(self.lost + ahead)
            with m.Elif(ok):
                m.d.sync += self.late.eq(self.late + 1)

    def _pass_on(self, m, h):
        """The bytes passed on: a datagram's stream bytes to ``o``, an ICMP message to ``icmp``;
        every other byte is taken and dropped."""
        at, byte, take, ip_fields, dgram_ok, flags = h.at, h.byte, h.take, h.ip_fields, h.dgram_ok, h.flags
        stream_len, synced, ahead, forward, forward_left = h.stream_len, h.synced, h.ahead, h.forward, h.forward_left
        echo, echo_left, csum_ok, is_icmp, dst_hi = h.echo, h.echo_left, h.csum_ok, h.is_icmp, h.dst_hi
        ip = self.ip.to_bytes(4, "big")
        # the stream bytes (positions 46 .. 34 + udp_len - 1 of a datagram taken) and an ICMP
        # message (34 .. 14 + total_len - 1, its last the frame's if that is shorter)
        # (``forward`` and ``echo`` each set at one byte or counted down, one choice: no chain)
        last = self.i.payload.last
        with m.If(take & at[LAST_HEADER_BYTE]):
            in_order = ~synced | flags[0] | ~ahead[15]
            m.d.sync += forward.eq(dgram_ok & (byte == D.VERSION) & in_order & (stream_len != 0) & ~last)
        with m.Elif(take & forward):
            m.d.sync += forward.eq(~last & (forward_left != 1))
        with m.If(take & forward):
            m.d.sync += forward_left.eq(forward_left - 1)
        with m.If(take & at[33]):
            m.d.sync += echo.eq(ip_fields & dst_hi & (byte == ip[3]) & csum_ok & is_icmp & ~last)
        with m.Elif(take & echo):
            m.d.sync += echo.eq(~last & (echo_left != 1))
        with m.If(take & echo):
            m.d.sync += echo_left.eq(echo_left - 1)
        m.d.comb += [self.o.payload.eq(byte), self.o.valid.eq(self.i.valid & forward),
                     self.icmp.payload.data.eq(byte), self.icmp.valid.eq(self.i.valid & echo),
                     self.icmp.payload.last.eq(last | (echo_left == 1)),
                     self.i.ready.eq(Mux(forward, self.o.ready, Mux(echo, self.icmp.ready, 1)))]


class ArpResponder(wiring.Component):
    """The ARP reply of ``mac``/``ip`` to each request on ``i`` (the requester's MAC and IP),
    as a 42-byte frame on ``o`` (``frame_layout``)."""

    def __init__(self, mac: int, ip: int):
        _check_address(self, mac, ip, 0)
        self.mac, self.ip = mac, ip
        super().__init__({
            "i": In(stream.Signature(data.StructLayout({"mac": 48, "ip": 32}))),
            "o": Out(stream.Signature(frame_layout())),
        })

    def elaborate(self, platform):
        m = Module()
        who = self.i.payload
        frame = (big_endian(who.mac, 6) + big_endian(self.mac, 6) + big_endian(ETHERTYPE_ARP, 2) +
                 big_endian(0x0001_0800_0604_0002, 8) + big_endian(self.mac, 6) + big_endian(self.ip, 4) +
                 big_endian(who.mac, 6) + big_endian(who.ip, 4))
        # the reply in a shift register, loaded whole when a request comes: its next byte is a
        # register's (no multiplexer in front of the transmitter)
        reply = Signal(8 * len(frame))
        k = Signal(range(len(frame)))
        busy = Signal()
        m.d.comb += [self.i.ready.eq(~busy), self.o.valid.eq(busy), self.o.payload.data.eq(reply[:8]),
                     self.o.payload.last.eq(k == len(frame) - 1)]
        with m.If(self.i.valid & ~busy):
            m.d.sync += [reply.eq(Cat(*frame)), busy.eq(1), k.eq(0)]
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += [reply.eq(reply >> 8), k.eq(k + 1)]
            with m.If(self.o.payload.last):
                m.d.sync += busy.eq(0)
        return m


class IcmpEcho(wiring.Component):
    """Echo replies (RFC 792) to the echo requests among the ICMP messages on ``i``
    (``UdpRx.icmp``, from ``from_``: ``icmp_layout``), so that ``ping`` answers: each reply a
    frame on ``o`` (``frame_layout``) once whole in a ``FrameFifo`` of ``buffer_bytes``, to its
    sender: the request's identification, TTL 64, type 0, the rest of the message as it came,
    the ICMP checksum summed over the reply as it passes and patched in at its end. Anything
    but a whole echo request (type 8, code 0, the length the IPv4 header says) leaves no reply."""

    def __init__(self, mac: int, ip: int, *, buffer_bytes: int = 2048):
        _check_address(self, mac, ip, 0)
        self.mac, self.ip, self.buffer_bytes = mac, ip, buffer_bytes
        super().__init__({
            "i": In(stream.Signature(frame_layout())),
            "from_": In(icmp_layout()),
            "o": Out(stream.Signature(frame_layout())),
            "replies": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        m.submodules.buffer = buf = FrameFifo(self.buffer_bytes, waits=True)
        wiring.connect(m, buf.o, wiring.flipped(self.o))
        to = Signal(icmp_layout())
        ip_len = Signal(16)  # the IPv4 total length
        left = Signal(16)    # the message's bytes still to come after the current one
        odd = Signal()       # the current byte is a word's second
        h = Signal(range(D.ETHERNET_HEADER + D.IPV4_HEADER))  # bytes of the headers written
        ok = Signal()
        # the reply's words summed (folded at its end: 2^11 words at most), a word's first byte
        total, high = Signal(16 + 12), Signal(8)
        ip_hi, ip_lo = self.ip >> 16, self.ip & 0xFFFF
        m.submodules.checksum = checksum = Checksum(0x4500 + (TTL << 8 | IP_PROTO_ICMP) + ip_hi + ip_lo, 4)
        m.d.comb += checksum.words.eq(Cat(ip_len, to.ident, to.ip[16:], to.ip[:16]))
        header = (big_endian(to.mac, 6) + big_endian(self.mac, 6) + big_endian(ETHERTYPE_IPV4, 2) +
                  big_endian(0x4500, 2) + big_endian(ip_len, 2) + big_endian(to.ident, 2) + big_endian(0, 2) +
                  big_endian(TTL << 8 | IP_PROTO_ICMP, 2) + big_endian(checksum.value, 2) + big_endian(self.ip, 4) +
                  big_endian(to.ip, 4))
        assert len(header) == D.ETHERNET_HEADER + D.IPV4_HEADER
        # the headers leave a shift register (a byte a cycle, no multiplexer of 34 bytes before
        # the buffer's registers: the link's 125 MHz)
        headers = Signal(8 * len(header))
        byte, last = self.i.payload.data, self.i.payload.last
        at_final = Signal()  # left == 0: the message's byte now is its last (a register)
        whole = Signal()     # the message was a whole echo request
        early = Signal(range(5))  # the bytes written while below 4 (its first bytes' tests: a 3-bit counter)
        reply_sum = ~total[:16]
        # the headers' shift register is loaded (``load``: the cycle after the checksum's done)
        # and shifted (``in_header``: the HEADER state) under registers, so that its enable is one
        # gate of registers and the buffer's room, for the link's 125 MHz
        load, in_header = Signal(), Signal()
        shift = in_header & ~load & buf.w_room
        m.d.sync += load.eq(0)
        with m.If(load):  # the headers into a shift register, whole
            m.d.sync += headers.eq(Cat(*header))
        with m.Elif(shift):
            m.d.sync += headers.eq(headers >> 8)
        word, add = Signal(16), Signal()  # the message's last whole word, to be added to ``total``
        m.d.sync += add.eq(0)
        with m.If(add):  # the last word lands in LAST, before the folds
            m.d.sync += total.eq(total + word)
        with m.FSM():
            with m.State("IDLE"):
                with m.If(self.i.valid):
                    m.d.comb += checksum.start.eq(1)
                    m.d.sync += [to.eq(self.from_), ip_len.eq(self.from_.length + D.IPV4_HEADER), left.eq(self.from_.length - 1),
                                 odd.eq(0), early.eq(0), total.eq(0), at_final.eq(self.from_.length == 1)]
                    m.next = "CHECKSUM"
            with m.State("CHECKSUM"):
                m.d.sync += ok.eq(to.length >= 8)
                with m.If(checksum.done):
                    m.d.sync += [load.eq(1), in_header.eq(1)]
                    m.next = "HEADER"
            with m.State("HEADER"):
                m.d.comb += [buf.w_valid.eq(shift), buf.w_data.eq(headers[:8])]
                with m.If(shift):
                    m.d.sync += h.eq(h + 1)
                    with m.If(h == len(header) - 1):
                        m.d.sync += [h.eq(0), in_header.eq(0)]
                        m.next = "MESSAGE"
            with m.State("MESSAGE"):
                # the type 8 -> 0, the checksum zero for now, the rest as it comes
                out = Signal(8)
                m.d.comb += out.eq(Mux((early == 0) | (early == 2) | (early == 3), 0, byte))
                m.d.comb += [buf.w_data.eq(out), buf.w_valid.eq(self.i.valid & buf.w_room),
                             self.i.ready.eq(buf.w_room)]
                with m.If(self.i.valid & buf.w_room):
                    m.d.sync += [left.eq(left - 1), at_final.eq(left == 1), odd.eq(~odd),
                                 early.eq(early + (early != 4))]
                    # a word is added to the sum a cycle later, from registers (``word``)
                    with m.If(odd):
                        m.d.sync += [word.eq(Cat(out, high)), add.eq(1)]
                    with m.Elif(last):  # an odd length: the last word's low byte is zero
                        m.d.sync += [word.eq(Cat(Const(0, 8), out)), add.eq(1)]
                    with m.Else():
                        m.d.sync += high.eq(out)
                    with m.If(early == 0):
                        m.d.sync += ok.eq(ok & (byte == ICMP_ECHO_REQUEST))
                    with m.If(early == 1):
                        m.d.sync += ok.eq(ok & (byte == 0))
                    with m.If(last):  # a whole echo request is answered, anything else dropped
                        m.next = "LAST"
                        m.d.sync += whole.eq(ok & at_final)
            with m.State("LAST"):
                with m.If(whole):
                    m.next = "FOLD"
                with m.Else():
                    m.d.comb += [buf.w_end.eq(1), buf.w_ok.eq(0)]
                    m.next = "IDLE"
            with m.State("FOLD"):  # the end-around carries, twice
                m.d.sync += total.eq(total[:16] + total[16:])
                m.next = "FOLD_AGAIN"
            with m.State("FOLD_AGAIN"):
                m.d.sync += total.eq(total[:16] + total[16:])
                m.next = "PATCH_HIGH"
            with m.State("PATCH_HIGH"):  # the checksum: bytes 2 and 3 of the message
                m.d.comb += [buf.p_en.eq(1), buf.p_addr.eq(len(header) + 2), buf.p_data.eq(reply_sum[8:])]
                m.next = "PATCH_LOW"
            with m.State("PATCH_LOW"):
                m.d.comb += [buf.p_en.eq(1), buf.p_addr.eq(len(header) + 3), buf.p_data.eq(reply_sum[:8])]
                m.next = "END"
            with m.State("END"):  # once the buffer has a place for its length
                with m.If(buf.w_room):
                    m.d.comb += [buf.w_end.eq(1), buf.w_ok.eq(1)]
                    m.d.sync += self.replies.eq(self.replies + 1)
                    m.next = "IDLE"
        return m


class UdpTx(wiring.Component):
    """Stream bytes (``i``) to the ``peer`` in datagrams (module docstring), as frames on
    ``o`` (``frame_layout``) for ``MacTx``. ``buffer_bytes``: the ``FrameFifo`` of datagrams
    waiting; ``flush_cycles``: the quiet time after which a partial datagram goes."""

    def __init__(self, mac: int, ip: int, port: int, *, buffer_bytes: int = 4096, flush_cycles: int = 16):
        _check_address(self, mac, ip, port)
        if buffer_bytes < 2 * D.MAX_STREAM_BYTES:
            self._MustUse__used = True
            raise ValueError(f"buffer_bytes must hold two datagrams ({2 * D.MAX_STREAM_BYTES}), got {buffer_bytes}")
        if flush_cycles < 1:
            self._MustUse__used = True
            raise ValueError(f"flush_cycles must be at least 1, got {flush_cycles}")
        self.mac, self.ip, self.port = mac, ip, port
        self.buffer_bytes, self.flush_cycles = buffer_bytes, flush_cycles
        super().__init__({
            "i": In(stream.Signature(8)),
            "peer": In(peer_layout()),
            "peer_valid": In(1),
            "o": Out(stream.Signature(frame_layout())),
            "datagrams": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        m.submodules.buffer = buf = FrameFifo(self.buffer_bytes, waits=True)

        # the collector: bytes into the current datagram; ended full or after a quiet time
        # (``last_byte``, ``some`` and ``quiet_out``: registers saying what ``count`` and ``quiet``
        # are, so that the datagram's end follows from them at once, for the link's 125 MHz)
        count = Signal(range(D.MAX_STREAM_BYTES + 1))
        quiet = Signal(range(self.flush_cycles + 1))
        last_byte, some, quiet_out = Signal(), Signal(), Signal()  # count == max - 1, != 0; quiet full
        byte_in = self.i.valid & buf.w_room
        full = byte_in & last_byte
        flush = some & ~self.i.valid & quiet_out & buf.w_room  # a place to end it
        m.d.comb += [self.i.ready.eq(buf.w_room), buf.w_data.eq(self.i.payload), buf.w_valid.eq(byte_in),
                     buf.w_end.eq(full | flush), buf.w_ok.eq(1)]
        with m.If(full | flush):
            m.d.sync += [count.eq(0), quiet.eq(0), last_byte.eq(0), some.eq(0), quiet_out.eq(0)]
        with m.Elif(byte_in):
            m.d.sync += [count.eq(count + 1), quiet.eq(0), quiet_out.eq(0), some.eq(1),
                         last_byte.eq(count == D.MAX_STREAM_BYTES - 2)]
        with m.Elif(~quiet_out):
            m.d.sync += [quiet.eq(quiet + 1), quiet_out.eq(quiet == self.flush_cycles - 1)]

        # the sender: the headers, then the datagram's bytes
        n = Signal(range(D.MAX_STREAM_BYTES + 1))
        to = Signal(peer_layout())
        seq, ident = Signal(16), Signal(16)
        ip_len, udp_len = Signal(16), Signal(16)
        ip_hi, ip_lo = self.ip >> 16, self.ip & 0xFFFF
        fixed = 0x4500 + 0x4000 + (TTL << 8 | 17) + ip_hi + ip_lo  # the header words that never change
        m.submodules.checksum = checksum = Checksum(fixed, 4)
        m.d.comb += checksum.words.eq(Cat(ip_len, ident, to.ip[16:], to.ip[:16]))
        csum = checksum.value
        header = (big_endian(to.mac, 6) + big_endian(self.mac, 6) + big_endian(ETHERTYPE_IPV4, 2) +
                  big_endian(0x4500, 2) + big_endian(ip_len, 2) + big_endian(ident, 2) + big_endian(0x4000, 2) +
                  big_endian(TTL << 8 | 17, 2) + big_endian(csum, 2) + big_endian(self.ip, 4) + big_endian(to.ip, 4) +
                  big_endian(self.port, 2) + big_endian(to.port, 2) + big_endian(udp_len, 2) + big_endian(0, 2) +
                  [seq[:8], seq[8:], Const(0, 8), Const(D.VERSION, 8)])
        assert len(header) == HEADER_BYTES
        headers = Signal(8 * HEADER_BYTES)  # their bytes, the next in the low bits
        k = Signal(range(HEADER_BYTES))
        with m.FSM():
            with m.State("IDLE"):
                with m.If(buf.o.valid & self.peer_valid):
                    m.d.sync += [n.eq(buf.length), to.eq(self.peer)]
                    m.next = "LENGTHS"
            with m.State("LENGTHS"):
                m.d.sync += [ip_len.eq(n + D.IPV4_HEADER + D.UDP_HEADER + D.HEADER.size), udp_len.eq(n + D.UDP_HEADER + D.HEADER.size), k.eq(0)]
                m.d.comb += checksum.start.eq(1)
                m.next = "CHECKSUM"
            with m.State("CHECKSUM"):
                with m.If(checksum.done):  # the headers into a shift register, whole
                    m.d.sync += headers.eq(Cat(*header))
                    m.next = "HEADER"
            with m.State("HEADER"):
                m.d.comb += [self.o.valid.eq(1), self.o.payload.data.eq(headers[:8])]
                with m.If(self.o.ready):
                    m.d.sync += [k.eq(k + 1), headers.eq(headers >> 8)]
                    with m.If(k == HEADER_BYTES - 1):
                        m.next = "DATA"
            with m.State("DATA"):
                wiring.connect(m, buf.o, wiring.flipped(self.o))
                with m.If(buf.o.valid & self.o.ready & buf.o.payload.last):
                    m.d.sync += [seq.eq(seq + 1), ident.eq(ident + 1), self.datagrams.eq(self.datagrams + 1)]
                    m.next = "IDLE"
        return m


class FrameArbiter(wiring.Component):
    """Whole frames from ``count`` streams (``i0``, ``i1``, ...: ``frame_layout``) onto one
    (``o``): the first stream with a frame waiting goes first; a frame, once begun, is passed
    to its last byte."""

    def __init__(self, count: int):
        self.count = count
        super().__init__({
            **{f"i{j}": In(stream.Signature(frame_layout())) for j in range(count)},
            "o": Out(stream.Signature(frame_layout())),
        })

    def elaborate(self, platform):
        m = Module()
        inputs = [getattr(self, f"i{j}") for j in range(self.count)]
        current = Signal(range(self.count))
        busy = Signal()
        with m.If(~busy):
            for j in reversed(range(self.count)):
                with m.If(inputs[j].valid):
                    m.d.sync += [current.eq(j), busy.eq(1)]
        with m.Else():
            with m.Switch(current):
                for j, src in enumerate(inputs):
                    with m.Case(j):
                        m.d.comb += [self.o.valid.eq(src.valid), self.o.payload.eq(src.payload),
                                     src.ready.eq(self.o.ready)]
                        with m.If(src.valid & self.o.ready & src.payload.last):
                            m.d.sync += busy.eq(0)
        return m


#: ``UdpLink``'s counters: the MAC's, ``UdpRx``'s, ``sent`` (datagrams) and ``pings`` (echo replies).
LINK_COUNTERS = MacRx.COUNTERS + UdpRx.COUNTERS + ("sent", "pings")


class UdpLink(wiring.Component):
    """The network link on GMII: ``MacRx`` -> ``UdpRx`` -> ``o`` (stream bytes to the engine),
    ``i`` (from it) -> ``UdpTx``, ARP and echo replies, ``FrameArbiter`` -> ``MacTx``
    (``LINK_COUNTERS``). ``rx_buffer_bytes``: frames received and not yet read
    (``datagrams.RECEIVE_BUFFER``: the host's ``datagrams.WINDOW`` of request bytes in
    flight); ``buffer_bytes``: each transmit buffer. ``rx_domain``: the receive side's own
    clock domain (RGMII's ``rx_clk``): ``MacRx`` runs there (its counters too) and its frames
    cross to this one through an asynchronous FIFO (``hw.crossing.AsyncStreamFifo``)."""

    def __init__(self, mac: int, ip: int, port: int, *, buffer_bytes: int = 4096,
                 rx_buffer_bytes: int = D.RECEIVE_BUFFER,
                 flush_cycles: int = 16, rx_domain: str | None = None):
        _check_address(self, mac, ip, port)
        self.mac, self.ip, self.port = mac, ip, port
        self.buffer_bytes, self.rx_buffer_bytes, self.flush_cycles = buffer_bytes, rx_buffer_bytes, flush_cycles
        self.rx_domain = rx_domain
        super().__init__({
            "rx_dv": In(1), "rx_er": In(1), "rxd": In(8),
            "tx_en": Out(1), "tx_er": Out(1), "txd": Out(8),
            "o": Out(stream.Signature(8)),
            "i": In(stream.Signature(8)),
            **{name: Out(32) for name in LINK_COUNTERS},
        })

    def elaborate(self, platform):
        m = Module()
        mac_rx = MacRx(self.rx_buffer_bytes)
        m.submodules.udp_rx = udp_rx = UdpRx(self.mac, self.ip, self.port)
        if self.rx_domain is None:
            m.submodules.mac_rx = mac_rx
            wiring.connect(m, mac_rx.o, udp_rx.i)
        else:
            m.submodules.mac_rx = mac_rx = DomainRenamer(self.rx_domain)(mac_rx)
            m.submodules.rx_crossing = crossing = AsyncStreamFifo(
                frame_layout(), depth=RX_CROSSING_DEPTH, w_domain=self.rx_domain, r_domain="sync")
            # and skid buffers on either side: the receiver's reader sees a register, not the
            # crossing's write enable (its pointers and memory); the crossing's read side sees a
            # register as its ready, not UdpRx's decision
            m.submodules.rx_in = rx_in = DomainRenamer(self.rx_domain)(
                StreamRegister(frame_layout(), registered_ready=True))
            m.submodules.rx_skid = skid = StreamRegister(frame_layout(), registered_ready=True)
            wiring.connect(m, mac_rx.o, rx_in.i)
            wiring.connect(m, rx_in.o, crossing.i)
            wiring.connect(m, crossing.o, skid.i)
            wiring.connect(m, skid.o, udp_rx.i)
        m.submodules.arp = arp = ArpResponder(self.mac, self.ip)
        m.submodules.udp_tx = udp_tx = UdpTx(self.mac, self.ip, self.port, buffer_bytes=self.buffer_bytes,
                                             flush_cycles=self.flush_cycles)
        m.submodules.echo = echo = IcmpEcho(self.mac, self.ip)
        m.submodules.arbiter = arbiter = FrameArbiter(3)
        m.submodules.mac_tx = mac_tx = MacTx(self.buffer_bytes)
        m.d.comb += [mac_rx.rx_dv.eq(self.rx_dv), mac_rx.rx_er.eq(self.rx_er), mac_rx.rxd.eq(self.rxd),
                     self.tx_en.eq(mac_tx.tx_en), self.tx_er.eq(mac_tx.tx_er), self.txd.eq(mac_tx.txd),
                     udp_tx.peer.eq(udp_rx.peer), udp_tx.peer_valid.eq(udp_rx.peer_valid), self.sent.eq(udp_tx.datagrams)]
        m.d.comb += [getattr(self, c).eq(getattr(mac_rx, c)) for c in MacRx.COUNTERS]
        m.d.comb += [getattr(self, c).eq(getattr(udp_rx, c)) for c in UdpRx.COUNTERS]
        # skid buffers behind the receiver: the readiness it sees (and so which of its bytes it
        # takes, the enable of its many header registers) is a register
        m.submodules.rx_out = rx_out = StreamRegister(8, registered_ready=True)
        m.submodules.rx_icmp = rx_icmp = StreamRegister(frame_layout(), registered_ready=True)
        wiring.connect(m, udp_rx.o, rx_out.i)
        wiring.connect(m, rx_out.o, wiring.flipped(self.o))
        wiring.connect(m, udp_rx.arp, arp.i)
        wiring.connect(m, wiring.flipped(self.i), udp_tx.i)
        wiring.connect(m, udp_rx.icmp, rx_icmp.i)
        wiring.connect(m, rx_icmp.o, echo.i)
        m.d.comb += [echo.from_.eq(udp_rx.icmp_from), self.pings.eq(echo.replies)]
        wiring.connect(m, arp.o, arbiter.i0)
        wiring.connect(m, echo.o, arbiter.i1)
        wiring.connect(m, udp_tx.o, arbiter.i2)
        # a skid buffer between the senders' header multiplexers and the transmit buffer: the
        # readiness the arbiter hands the senders (the enables of their header registers and
        # buffers) is a register, not the transmit buffer's
        m.submodules.to_mac = to_mac = StreamRegister(frame_layout(), registered_ready=True)
        wiring.connect(m, arbiter.o, to_mac.i)
        wiring.connect(m, to_mac.o, mac_tx.i)
        return m
