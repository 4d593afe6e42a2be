"""The byte stream of the wire protocol in UDP datagrams (``udp:HOST:PORT``; docs/protocol.md,
"UDP"): the rules both ends follow, the host (``hbfp.host.transports.UdpTransport``), the
servers (``hbfp.host.server.UdpServer``) and the board's network link alike.

A datagram is a 4-byte header and up to ``MAX_STREAM_BYTES`` bytes of the stream::

    seq (u16, little-endian) | flags (u8) | version (u8, VERSION) | stream bytes

Each sender numbers its datagrams 0, 1, 2, ... (wrapping at 2^16). A receiver takes a
datagram whose ``seq`` is ahead of the last one it took (by less than 2^15: ``Sequence``),
and drops the others (late, reordered or duplicated ones); datagrams lost on the way leave a
gap in the stream, which the protocol's CRC, timeout and retry recover, as on any lossy
link. ``SYNC`` in ``flags`` makes the receiver take the datagram whatever its number: a
host sets it until the first reply arrives, and again after a wait for a reply that brought
none (``hbfp.host.transports``' ``resync``), so that a device still counting another session's datagrams
follows this one. A datagram that is too short, of another version,
or larger than ``MAX_DATAGRAM`` is dropped.
"""

from __future__ import annotations

import struct

__all__ = ["HEADER", "VERSION", "SYNC", "MAX_DATAGRAM", "MAX_STREAM_BYTES", "GIGABIT", "WINDOW", "RECEIVE_BUFFER",
           "pack", "unpack", "Sequence", "Numbering", "wire_bytes"]

HEADER = struct.Struct("<HBB")
#: The version byte of this layout.
VERSION = 1
#: ``flags``: take this datagram whatever its number.
SYNC = 0x01
#: The largest UDP payload that fits one Ethernet frame (1500 - 20 IPv4 - 8 UDP).
MAX_DATAGRAM = 1472
#: Stream bytes a datagram carries at most.
MAX_STREAM_BYTES = MAX_DATAGRAM - HEADER.size
#: Request bytes a device on a network link holds unanswered (its receive buffer): the host
#: sends no more ahead of the replies (``Transport.window``), as a network has no flow control.
WINDOW = 12 * 1024
#: Bytes of Ethernet frames a device buffers to hold ``WINDOW`` stream bytes in full datagrams
#: and one more frame (``hw.eth_udp.UdpLink``'s receive buffer, a power of two).
RECEIVE_BUFFER = 16 * 1024
#: Bytes a second on a Gigabit Ethernet link (125 MHz, a byte a cycle each way).
GIGABIT = 125_000_000
#: Ethernet's sizes in bytes (IEEE 802.3; the gateware's MAC reads them here too): preamble
#: and SFD, the Ethernet header, the FCS, the interframe gap, the shortest and longest frame
#: (header to FCS, no VLAN tag); and the IPv4 (no options) and UDP headers.
PREAMBLE_SFD, ETHERNET_HEADER, FCS, GAP, MIN_FRAME, MAX_FRAME = 8, 14, 4, 12, 64, 1518
IPV4_HEADER, UDP_HEADER = 20, 8
#: Headers in front of a datagram's stream bytes in its frame: Ethernet, IPv4, UDP, datagram.
FRAME_HEADERS = ETHERNET_HEADER + IPV4_HEADER + UDP_HEADER + HEADER.size
#: What one datagram costs on Ethernet beyond its stream bytes.
_FRAMING = PREAMBLE_SFD + FRAME_HEADERS + FCS + GAP
#: Half the sequence space: a datagram this far or farther ahead is taken for a late one.
_WINDOW = 1 << 15


def pack(seq: int, data: bytes, flags: int = 0) -> bytes:
    """One datagram: the header and ``data`` (at most ``MAX_STREAM_BYTES``)."""
    if len(data) > MAX_STREAM_BYTES:
        raise ValueError(f"a datagram carries at most {MAX_STREAM_BYTES} stream bytes, got {len(data)}")
    return HEADER.pack(seq & 0xFFFF, flags, VERSION) + bytes(data)


def unpack(datagram: bytes) -> tuple[int, int, bytes] | None:
    """(seq, flags, stream bytes) of a datagram, or None for one to drop (too short, too long,
    another version)."""
    if not HEADER.size <= len(datagram) <= MAX_DATAGRAM:
        return None
    seq, flags, version = HEADER.unpack_from(datagram)
    if version != VERSION:
        return None
    return seq, flags, bytes(datagram[HEADER.size:])


def wire_bytes(stream_bytes: int) -> int:
    """Byte times on Ethernet that ``stream_bytes`` take at least, in full datagrams."""
    full, rest = divmod(stream_bytes, MAX_STREAM_BYTES)
    cost = full * (MAX_STREAM_BYTES + _FRAMING)
    if rest:
        cost += max(rest + _FRAMING, PREAMBLE_SFD + MIN_FRAME + GAP)
    return cost


class Sequence:
    """A receiver's rule for datagram numbers (module docstring): ``take(seq, flags)`` says
    whether to take a datagram; ``lost`` counts the numbers skipped, ``dropped`` the
    datagrams refused."""

    def __init__(self):
        self.expected: int | None = None
        self.lost = 0
        self.dropped = 0

    def take(self, seq: int, flags: int = 0) -> bool:
        if self.expected is None or flags & SYNC:
            self.expected = (seq + 1) & 0xFFFF
            return True
        ahead = (seq - self.expected) & 0xFFFF
        if ahead >= _WINDOW:
            self.dropped += 1
            return False
        self.lost += ahead
        self.expected = (seq + 1) & 0xFFFF
        return True


class Numbering:
    """A sender's numbering: ``next()`` is the number of its next datagram."""

    def __init__(self, start: int = 0):
        self.seq = start & 0xFFFF

    def next(self) -> int:
        seq = self.seq
        self.seq = (seq + 1) & 0xFFFF
        return seq

    def datagrams(self, data: bytes, flags: int = 0) -> list[bytes]:
        """``data`` in numbered datagrams of at most ``MAX_STREAM_BYTES`` stream bytes each."""
        return [pack(self.next(), data[i:i + MAX_STREAM_BYTES], flags)
                for i in range(0, len(data), MAX_STREAM_BYTES)]


# The receive buffer holds the window's datagrams as frames (stream bytes, 46 bytes of headers
# and the FCS each) and one frame more: checked where both are defined.
assert RECEIVE_BUFFER >= -(-WINDOW // MAX_STREAM_BYTES) * (MAX_DATAGRAM + ETHERNET_HEADER + FCS) + MAX_FRAME
