"""A model of the network around the link's ARP, IPv4 and UDP layers (``hbfp.hw.eth_udp``),
written from RFC 826 (ARP), RFC 791 (IPv4), RFC 768 (UDP) and RFC 1071 (the internet
checksum), not from the gateware: frames a host sends (``udp_frame``, ``arp_request``) and
the fields of those a device sends (``parse_udp``, ``parse_arp_reply``, which check every
field the RFCs fix). The datagram layer's rules are ``hbfp.host.datagrams``'s."""

from __future__ import annotations

import struct

ETH_IPV4, ETH_ARP = 0x0800, 0x0806


def mac_bytes(mac: int) -> bytes:
    return mac.to_bytes(6, "big")


def internet_checksum(data: bytes) -> int:
    """RFC 1071: the one's complement of the one's complement sum of the 16-bit words."""
    if len(data) % 2:
        data += b"\x00"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def ipv4_header(src_ip: int, dst_ip: int, proto: int, payload_len: int, *, ident: int = 0, ttl: int = 64,
                flags_frag: int = 0x4000, options: bytes = b"", checksum: int | None = None) -> bytes:
    ihl = 5 + len(options) // 4
    head = struct.pack("!BBHHHBBHII", 0x40 | ihl, 0, 4 * ihl + payload_len, ident, flags_frag, ttl, proto, 0,
                       src_ip, dst_ip) + options
    c = internet_checksum(head) if checksum is None else checksum
    return head[:10] + struct.pack("!H", c) + head[12:]


def udp_frame(dst_mac: int, src_mac: int, src_ip: int, dst_ip: int, sport: int, dport: int, payload: bytes,
              **ip) -> bytes:
    """An Ethernet frame (no FCS) carrying a UDP datagram, its checksum computed as a host's
    stack does (over the pseudo-header)."""
    length = 8 + len(payload)
    pseudo = struct.pack("!IIBBH", src_ip, dst_ip, 0, 17, length)
    c = internet_checksum(pseudo + struct.pack("!HHHH", sport, dport, length, 0) + payload) or 0xFFFF
    udp = struct.pack("!HHHH", sport, dport, length, c) + payload
    return mac_bytes(dst_mac) + mac_bytes(src_mac) + struct.pack("!H", ETH_IPV4) + \
        ipv4_header(src_ip, dst_ip, 17, len(udp), **ip) + udp


def arp_request(sha: int, spa: int, tpa: int, *, dst_mac: int = 0xFFFF_FFFF_FFFF) -> bytes:
    return (mac_bytes(dst_mac) + mac_bytes(sha) + struct.pack("!HHHBBH", ETH_ARP, 1, ETH_IPV4, 6, 4, 1) +
            mac_bytes(sha) + spa.to_bytes(4, "big") + bytes(6) + tpa.to_bytes(4, "big"))


def parse_arp_reply(frame: bytes) -> dict:
    """The fields of an ARP reply (padding allowed); AssertionError for anything else."""
    assert len(frame) >= 42, len(frame)
    dst, src = int.from_bytes(frame[0:6], "big"), int.from_bytes(frame[6:12], "big")
    etype, htype, ptype, hlen, plen, oper = struct.unpack("!HHHBBH", frame[12:22])
    assert (etype, htype, ptype, hlen, plen, oper) == (ETH_ARP, 1, ETH_IPV4, 6, 4, 2)
    return {"dst": dst, "src": src, "sha": int.from_bytes(frame[22:28], "big"), "spa": int.from_bytes(frame[28:32], "big"),
            "tha": int.from_bytes(frame[32:38], "big"), "tpa": int.from_bytes(frame[38:42], "big")}


def parse_udp(frame: bytes) -> dict:
    """The fields of an Ethernet frame carrying an IPv4 UDP datagram, after checking what
    the RFCs require of it (version, header length, total length within the frame, header
    checksum, UDP length, a UDP checksum of 0 or right)."""
    assert int.from_bytes(frame[12:14], "big") == ETH_IPV4
    ip = frame[14:34]
    vihl, _, total, ident, frag, ttl, proto, _, src_ip, dst_ip = struct.unpack("!BBHHHBBHII", ip)
    assert vihl == 0x45 and proto == 17 and 28 <= total <= len(frame) - 14
    assert internet_checksum(ip) == 0, "IPv4 header checksum"
    sport, dport, length, csum = struct.unpack("!HHHH", frame[34:42])
    assert length == total - 20
    payload = frame[42:14 + total]
    if csum:
        pseudo = struct.pack("!IIBBH", src_ip, dst_ip, 0, 17, length)
        assert internet_checksum(pseudo + frame[34:14 + total]) == 0, "UDP checksum"
    return {"dst_mac": int.from_bytes(frame[0:6], "big"), "src_mac": int.from_bytes(frame[6:12], "big"),
            "src_ip": src_ip, "dst_ip": dst_ip, "ttl": ttl, "frag": frag, "ident": ident, "sport": sport,
            "dport": dport, "udp_checksum": csum, "payload": payload}


def icmp_echo_request(dst_mac: int, src_mac: int, src_ip: int, dst_ip: int, ident: int, seq: int, data: bytes,
                      *, icmp_type: int = 8, code: int = 0, checksum: int | None = None, **ip) -> bytes:
    """An Ethernet frame (no FCS) carrying an ICMP echo request (RFC 792), as ``ping`` sends it."""
    body = struct.pack("!HH", ident, seq) + data
    c = internet_checksum(struct.pack("!BBH", icmp_type, code, 0) + body) if checksum is None else checksum
    message = struct.pack("!BBH", icmp_type, code, c) + body
    return mac_bytes(dst_mac) + mac_bytes(src_mac) + struct.pack("!H", ETH_IPV4) + \
        ipv4_header(src_ip, dst_ip, 1, len(message), **ip) + message


def parse_icmp_echo_reply(frame: bytes) -> dict:
    """The fields of an ICMP echo reply, after checking the IPv4 header (checksum, lengths)
    and the ICMP checksum over the message."""
    assert int.from_bytes(frame[12:14], "big") == ETH_IPV4
    ip = frame[14:34]
    vihl, _, total, ident, frag, ttl, proto, _, src_ip, dst_ip = struct.unpack("!BBHHHBBHII", ip)
    assert vihl == 0x45 and proto == 1 and 28 <= total <= len(frame) - 14
    assert internet_checksum(ip) == 0, "IPv4 header checksum"
    message = frame[34:14 + total]
    assert internet_checksum(message) == 0, "ICMP checksum"
    icmp_type, code, _, echo_id, seq = struct.unpack("!BBHHH", message[:8])
    assert (icmp_type, code) == (0, 0)
    return {"dst_mac": int.from_bytes(frame[0:6], "big"), "src_mac": int.from_bytes(frame[6:12], "big"),
            "src_ip": src_ip, "dst_ip": dst_ip, "ttl": ttl, "ident": ident, "id": echo_id, "seq": seq,
            "data": message[8:]}
