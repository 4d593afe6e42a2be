"""The network link's ARP, IPv4 and UDP layers (``hbfp.hw.eth_udp.UdpLink``, with its MAC)
against the RFC model of ``sim/tb_eth_udp.py`` and the datagram rules of
``hbfp.host.datagrams``, in the Amaranth simulator: frames on GMII in, frames on GMII out."""

import random

import pytest
from amaranth.sim import Simulator

from hbfp.host import datagrams as D
from hbfp.hw.eth_udp import UdpLink, UdpTx
from hbfp.sim import tb_eth_mac as mac
from hbfp.sim import tb_eth_udp as net

MAC, IP, PORT = 0x02_48_42_46_50_01, 0xC0A8_0132, 7000       # the device: 192.168.1.50:7000
HOST_MAC, HOST_IP, HOST_PORT = 0x02_00_00_00_00_99, 0xC0A8_0101, 50123


def run_link(frames, *, engine=b"", engine_at: int = 0, cycles: int = 0, ready_p: float = 1.0, seed: int = 0,
             timing: dict | None = None, rx_clock: tuple[float, float] | None = None):
    """Send ``frames`` (Ethernet frames without FCS) to a ``UdpLink`` on GMII, offer the
    engine's bytes ``engine`` on ``i`` from cycle ``engine_at``; the stream bytes taken from
    ``o``, the frames it sent (FCS checked, stripped) and its counters. ``timing`` (a dict)
    receives the cycles of the first and last byte taken from ``o`` and the line's cycles.
    ``rx_clock`` (period, phase; ns): the receive side on a clock of its own (a board's RGMII
    ``rx_clk``, the frames crossing to the link's 8 ns clock), else on the link's."""
    dut = UdpLink(MAC, IP, PORT, flush_cycles=16, rx_domain=None if rx_clock is None else "rx")
    rng = random.Random(seed)
    line_in = [(0, 0, 0)] * 2 + mac.gmii_cycles([mac.Burst(mac.wire(f)) for f in frames])
    total = max(len(line_in), engine_at) + cycles + 40 * len(engine) // 30 + 4000
    got, line = bytearray(), []
    counts = {}

    def drive_line(ctx, t):
        dv, er, d = line_in[t] if t < len(line_in) else (0, 0, 0)
        ctx.set(dut.rx_dv, dv)
        ctx.set(dut.rx_er, er)
        ctx.set(dut.rxd, d)

    async def receive_clock_line(ctx):
        for t in range(len(line_in) + 1):
            drive_line(ctx, t)
            await ctx.tick("rx")

    async def bench(ctx):
        k = 0
        for t in range(total):
            if rx_clock is None:
                drive_line(ctx, t)
            ready = rng.random() < ready_p
            ctx.set(dut.o.ready, ready)
            if ready and ctx.get(dut.o.valid):
                got.append(ctx.get(dut.o.payload))
                if timing is not None:
                    timing.setdefault("o_first", t)
                    timing["o_last"] = t
            offer = t >= engine_at and k < len(engine)
            ctx.set(dut.i.valid, offer)
            if offer:
                ctx.set(dut.i.payload, engine[k])
                k += ctx.get(dut.i.ready)
            line.append((ctx.get(dut.tx_en), ctx.get(dut.txd)))
            await ctx.tick()
        counts.update({n: ctx.get(getattr(dut, n)) for n in ("frames", "datagrams", "late", "lost", "arp_requests",
                                                              "sent", "pings")})

    sim = Simulator(dut)
    sim.add_clock(8e-9)
    if rx_clock is not None:
        sim.add_clock(rx_clock[0] * 1e-9, phase=rx_clock[1] * 1e-9, domain="rx")
        sim.add_testbench(receive_clock_line)
    sim.add_testbench(bench)
    sim.run()
    if timing is not None:
        timing["line"] = line
    sent = []
    for w in mac.decode_gmii(line)[0]:
        assert mac.fcs(w[:-4]) == w[-4:]
        sent.append(w[:-4])
    return bytes(got), sent, counts


def datagram(seq, data, flags=0, **kw):
    d = {"dst_mac": MAC, "dst_ip": IP, "dport": PORT, "src_ip": HOST_IP, "sport": HOST_PORT}
    d.update(kw)
    payload = kw.pop("raw", None) or D.pack(seq, data, flags)
    ip = {k: d[k] for k in ("ident", "ttl", "flags_frag", "options", "checksum") if k in d}
    return net.udp_frame(d["dst_mac"], HOST_MAC, d["src_ip"], d["dst_ip"], d["sport"], d["dport"], payload, **ip)


def _udp_length(frame: bytes, length: int) -> bytes:
    """``frame`` with its UDP length field (bytes 38-39) replaced."""
    return frame[:38] + length.to_bytes(2, "big") + frame[40:]


def _header_checksum(frame: bytes) -> int:
    return int.from_bytes(frame[24:26], "big")


def test_arp_requests_for_our_address_are_answered():
    frames = [net.arp_request(HOST_MAC, HOST_IP, 0xC0A8_0133),  # someone else's address
              net.arp_request(HOST_MAC, HOST_IP, IP ^ 0x0100_0000),  # ... differing in its first byte
              net.arp_request(HOST_MAC, HOST_IP, IP, dst_mac=MAC ^ 1),  # to another MAC
              net.arp_request(HOST_MAC, HOST_IP, IP, dst_mac=0xFFFF_FFFF_FFFE),
              net.arp_request(HOST_MAC, HOST_IP, IP),
              net.arp_request(HOST_MAC, HOST_IP, IP, dst_mac=MAC)]  # unicast, as a cache refresh asks
    got, sent, counts = run_link(frames)
    assert got == b"" and counts["arp_requests"] == 2 and len(sent) == 2
    for frame in sent:
        assert len(frame) == 60  # 42 bytes, padded
        reply = net.parse_arp_reply(frame)
        assert reply == {"dst": HOST_MAC, "src": MAC, "sha": MAC, "spa": IP, "tha": HOST_MAC, "tpa": HOST_IP}


def test_ping_is_answered():
    """Echo requests (RFC 792) for our address: replies with the same identifier, sequence
    number and data, checksums right (the reply's ICMP checksum adjusted for the type, for
    every value of the request's, 0xF7FF .. 0x0800 around the carry included). Other ICMP
    types, a bad code, a truncated message and requests for another address: no reply."""
    rng = random.Random(5)
    good = [(7, 1, b""), (7, 2, bytes(range(56))), (0x1234, 0xFFFF, bytes(rng.getrandbits(8) for _ in range(1472))),
            (9, 3, bytes(range(1, 58))), (5, 5, b"z")]  # odd lengths: the last word's low byte is zero
    # requests whose checksums lie around the adjustment's carry: a data word found to make them so
    for target in (0xF7FE, 0xF7FF, 0xF800, 0x07FF, 0x0800, 0x0000):
        word = next(w for w in range(0x10000)
                    if net.internet_checksum(bytes([8, 0, 0, 0, 0, 0, 0, 0]) + w.to_bytes(2, "big")) == target)
        good.append((0, 0, word.to_bytes(2, "big")))
    frames = [net.icmp_echo_request(MAC, HOST_MAC, HOST_IP, IP, i, s, d) for i, s, d in good]
    frames += [net.icmp_echo_request(MAC, HOST_MAC, HOST_IP, IP, 1, 1, b"x", icmp_type=13),  # a timestamp
               net.icmp_echo_request(MAC, HOST_MAC, HOST_IP, IP, 1, 1, b"x", code=1),
               net.icmp_echo_request(MAC, HOST_MAC, HOST_IP, IP + 1, 1, 1, b"x"),
               net.icmp_echo_request(MAC, HOST_MAC, HOST_IP, IP ^ 0x0100_0000, 1, 1, b"x"),
               net.icmp_echo_request(MAC, HOST_MAC, HOST_IP, IP, 1, 1, bytes(100))[:-10]]  # shorter than its header says
    got, sent, counts = run_link(frames, cycles=8000)
    assert got == b"" and counts["pings"] == len(good) == len(sent)
    for (ident, seq, data), frame in zip(good, sent):
        reply = net.parse_icmp_echo_reply(frame)
        assert (reply["dst_mac"], reply["src_mac"], reply["src_ip"], reply["dst_ip"], reply["ttl"]) == \
            (HOST_MAC, MAC, IP, HOST_IP, 64)
        assert (reply["id"], reply["seq"], reply["data"]) == (ident, seq, data)


def test_datagrams_in_by_the_rules():
    rng = random.Random(1)
    blobs = [bytes(rng.getrandbits(8) for _ in range(n)) for n in (1, 10, 300, D.MAX_STREAM_BYTES, 5, 7, 9, 11)]
    cases = [  # (frame, what it is)
        (datagram(40, blobs[0], D.SYNC), "first, SYNC"),
        (datagram(41, blobs[1]), "next"),
        (datagram(41, b"dup"), "duplicate"),
        (datagram(40, b"late"), "late"),
        (datagram(45, blobs[2]), "a gap of three"),
        (datagram(46, b"port", dport=PORT + 1), "another port"),
        (datagram(46, b"ip", dst_ip=IP + 1), "another address"),
        (datagram(46, b"mac", dst_mac=MAC + 1), "another MAC"),
        # differing only in a first byte (the header's comparisons are made a byte ahead)
        (datagram(46, b"port", dport=PORT ^ 0x100), "another port"),
        (datagram(46, b"ip", dst_ip=IP ^ 0x0100_0000), "another address"),
        (datagram(46, b"ip", dst_ip=IP ^ 0x0100_0000, checksum=_header_checksum(datagram(46, b"ip"))),
         "another address"),  # with the header checksum of one to ours (which the device sums)
        (datagram(46, b"mac", dst_mac=MAC ^ 1 << 40), "another MAC"),
        (datagram(46, b"mac", dst_mac=0xFFFF_FFFF_FFFE), "another MAC"),
        (datagram(46, b"bcast", dst_mac=0xFFFF_FFFF_FFFF), "broadcast"),
        (datagram(46, b"csum", checksum=0x1234), "a bad header checksum"),
        (datagram(46, b"frag", flags_frag=0x2000), "a fragment"),
        (datagram(46, b"opts", options=b"\x01\x01\x01\x01"), "IP options"),
        (datagram(46, b"ver", raw=bytes([46, 0, 0, 9]) + b"ver"), "another version"),
        (datagram(46, b"", raw=b"\x2e\x00\x00"), "too short"),
        (_udp_length(datagram(46, b"udplen"), 8 + D.HEADER.size + 7), "a UDP length beyond the IP payload"),
        (_udp_length(datagram(46, b"udplen"), 8 + D.HEADER.size - 1), "a UDP length short of the header"),
        (datagram(46, blobs[3]), "the largest"),
        (datagram(47, blobs[4], ttl=1), "TTL 1"),
        (datagram(3, blobs[5], D.SYNC), "SYNC: a new session"),
        (datagram(4, blobs[6]), "next"),
        (datagram(5 + 0x8000, b"far"), "half the space ahead"),
        (datagram(5, blobs[7]), "next"),
    ]
    rule, want = D.Sequence(), bytearray()
    taken = 0
    for frame, what in cases:
        ok = what not in ("another port", "another address", "another MAC", "broadcast", "a bad header checksum",
                          "a fragment", "IP options", "another version", "too short",
                          "a UDP length beyond the IP payload", "a UDP length short of the header")
        parts = D.unpack(frame[42:])
        if ok and rule.take(parts[0], parts[1]):
            want += parts[2]
            taken += 1
    got, sent, counts = run_link([f for f, _ in cases], ready_p=0.6, seed=2)
    assert got == bytes(want)
    assert (counts["datagrams"], counts["late"], counts["lost"]) == (taken, rule.dropped, rule.lost)
    assert (taken, rule.dropped, rule.lost) == (8, 3, 3) and sent == []


def test_datagrams_out_to_the_peer():
    rng = random.Random(3)
    stream = bytes(rng.getrandbits(8) for _ in range(2 * D.MAX_STREAM_BYTES + 100))
    tail = b"tail"
    # a datagram makes the host the peer; then the engine's bytes: full datagrams, the rest after a pause
    frames = [datagram(0, b"hello", D.SYNC)]
    got, sent, counts = run_link(frames, engine=stream, engine_at=300)
    assert got == b"hello"
    assert counts["sent"] == len(sent) == 3  # two full datagrams, the rest once the engine is quiet
    seqs, data = [], b""
    for i, frame in enumerate(sent):
        f = net.parse_udp(frame)
        assert (f["dst_mac"], f["src_mac"], f["src_ip"], f["dst_ip"]) == (HOST_MAC, MAC, IP, HOST_IP)
        assert (f["sport"], f["dport"], f["ttl"], f["frag"], f["udp_checksum"], f["ident"]) == \
            (PORT, HOST_PORT, 64, 0x4000, 0, i)
        seq, flags, part = D.unpack(f["payload"])
        assert flags == 0 and len(part) <= D.MAX_STREAM_BYTES
        seqs.append(seq)
        data += part
    assert seqs == [0, 1, 2] and data == stream
    _, sent, _ = run_link(frames, engine=tail, engine_at=300)
    assert [D.unpack(net.parse_udp(f)["payload"]) for f in sent] == [(0, 0, tail)]  # padded frame, 4 bytes


@pytest.mark.parametrize("rx_clock", [None, (8.0, 3.1), (7.99, 1.0)], ids=["one-clock", "rx-8ns", "rx-7.99ns"])
def test_throughput_at_the_gigabit_clock(rx_clock):
    """Full datagrams at the shortest gap, each way: the stream bytes a cycle of the 125 MHz
    link clock, sustained (from the first stream byte to the last on the engine's side coming
    in, from the first frame's first byte to the last one's on the line going out), at least
    100 MB/s (simulated cycles; the rest of the line's time is headers, FCS and gaps). With
    the receive side on a clock of its own (out of phase; 0.1 % fast) the frames cross to the
    link's (``hw.crossing.AsyncStreamFifo``) at the same rate."""
    rng = random.Random(4)
    n = 6
    blobs = [bytes(rng.getrandbits(8) for _ in range(D.MAX_STREAM_BYTES)) for _ in range(n)]
    frames = [datagram(i, b, D.SYNC if i == 0 else 0) for i, b in enumerate(blobs)]
    timing = {}
    got, _, _ = run_link(frames, timing=timing, rx_clock=rx_clock)
    assert got == b"".join(blobs)
    rx = len(got) / (timing["o_last"] - timing["o_first"] + 1) * 125  # MB/s
    engine = b"".join(blobs)
    timing = {}
    _, sent, _ = run_link(frames[:1], engine=engine, engine_at=2000, timing=timing, rx_clock=rx_clock)
    assert b"".join(D.unpack(net.parse_udp(f)["payload"])[2] for f in sent) == engine
    busy = [t for t, (en, _) in enumerate(timing["line"]) if en]
    tx = len(engine) / (busy[-1] - busy[0] + 1) * 125
    print(f"payload each way at 125 MHz ({rx_clock or 'one clock'}): in {rx:.1f} MB/s, out {tx:.1f} MB/s")
    assert rx >= 100 and tx >= 100, (rx, tx)


def test_no_peer_no_datagram():
    """Bytes from the engine before any datagram came: nowhere to send them yet."""
    _, sent, counts = run_link([], engine=b"abc", engine_at=10)
    assert sent == [] and counts["sent"] == 0


def test_parameters_are_checked():
    with pytest.raises(ValueError, match="group address"):
        UdpLink(0x01_00_5E_00_00_01, IP, PORT)
    with pytest.raises(ValueError, match="ip must be"):
        UdpLink(MAC, 1 << 32, PORT)
    with pytest.raises(ValueError, match="two datagrams"):
        UdpTx(MAC, IP, PORT, buffer_bytes=2048)
    with pytest.raises(ValueError, match="flush_cycles"):
        UdpTx(MAC, IP, PORT, flush_cycles=0)


def test_reference_checksum():
    """RFC 1071's example words, and a header whose checksum is known (RFC 791 sample)."""
    assert net.internet_checksum(bytes.fromhex("0001f203f4f5f6f7")) == ~0xDDF2 & 0xFFFF
    head = bytes.fromhex("450000730000400040110000c0a80001c0a800c7")
    assert net.internet_checksum(head) == 0xB861
