"""The UDP link (``udp:HOST:PORT``): the datagram rules (``hbfp.host.datagrams``), the host's
``UdpTransport`` against a ``UdpServer`` serving ``emu`` on 127.0.0.1 (products bit-exact in
every output format, pipelined), a lossy network (datagrams lost and damaged both ways:
every product still bit-exact), and ``hbfp sim-server --udp``."""

import re
import socket
import subprocess
import sys

import numpy as np
import pytest

import hbfp.host as host
from hbfp.contract import CoreConfig
from hbfp.host import datagrams as D
from hbfp.host.emu import EmuDevice
from hbfp.host.server import UdpServer
from hbfp.host.transports import UdpTransport

from .conftest import udp_server_gemm
from .test_host_transports import check_products

CFG = CoreConfig(rows=4, cols=4, size=48)


# ---- the datagram rules ------------------------------------------------------------------


def test_pack_and_unpack():
    d = D.pack(0x1234, b"abc", D.SYNC)
    assert d == bytes([0x34, 0x12, D.SYNC, D.VERSION]) + b"abc"
    assert D.unpack(d) == (0x1234, D.SYNC, b"abc")
    assert D.unpack(D.pack(7, b"")) == (7, 0, b"")
    assert D.unpack(b"\x00\x00\x00") is None  # too short
    assert D.unpack(bytes([0, 0, 0, D.VERSION + 1])) is None  # another version
    assert D.unpack(D.pack(1, bytes(D.MAX_STREAM_BYTES)) + b"x") is None  # larger than an Ethernet frame holds
    with pytest.raises(ValueError, match="at most 1468"):
        D.pack(0, bytes(D.MAX_STREAM_BYTES + 1))


def test_numbering_splits_and_wraps():
    n = D.Numbering(0xFFFE)
    parts = [D.unpack(d) for d in n.datagrams(bytes(range(256)) * 12, D.SYNC)]  # 3072 bytes
    assert [p[0] for p in parts] == [0xFFFE, 0xFFFF, 0]
    assert b"".join(p[2] for p in parts) == bytes(range(256)) * 12
    assert all(len(p[2]) <= D.MAX_STREAM_BYTES for p in parts) and n.next() == 1


def test_sequence_takes_what_is_ahead_and_drops_the_rest():
    s = D.Sequence()
    assert s.take(500)  # the first, whatever its number
    assert s.take(501) and s.take(505) and s.lost == 3  # a gap: taken, the loss counted
    assert not s.take(505) and not s.take(502)  # a duplicate, a late one
    assert s.dropped == 2
    assert s.take(100, D.SYNC) and s.take(101)  # SYNC: a new session's numbers
    assert not s.take(100 + 0x8000 + 2)  # half the space ahead or more: late
    w = D.Sequence()
    assert w.take(0xFFFF) and w.take(0) and w.take(3) and w.lost == 2  # across the wrap


# ---- host and server ------------------------------------------------------------------------


def test_products_over_udp_to_a_served_emu():
    with UdpServer(EmuDevice(CFG)).start() as server:
        assert re.fullmatch(r"udp:127\.0\.0\.1:\d+", server.spec)
        with host.open(server.spec, timeout=5) as dev:
            assert dev.pipeline and dev.identity.size == 48
            check_products(dev)
            a = np.random.default_rng(1).standard_normal((200, 150)).astype(np.float32)
            assert np.array_equal(dev.gemm(a, a.T).view(np.uint32),
                                  host.reference_gemm(dev.format(), a, a.T).view(np.uint32))
            assert dev.stats.retries == 0
    assert server.counts["taken"] == server.counts["received"] > 10 and server.counts["dropped"] == 0


def test_a_lossy_network_loses_no_product():
    """1% of the datagrams lost and 0.1% damaged, either way: every product bit-exact, by
    the protocol's CRC, timeouts and retries."""
    emu = EmuDevice(CFG, frame_timeout=2_000_000)  # 20 ms at the nominal 100 MHz
    with UdpServer(emu, drop=0.01, corrupt=0.001, seed=2).start() as server:
        with host.open(server.spec, timeout=0.3, retries=8) as dev:
            rng = np.random.default_rng(3)
            for i in range(100):
                m, k, n = rng.integers(1, 60, size=3)
                a = rng.standard_normal((m, k)).astype(np.float32)
                b = rng.standard_normal((k, n)).astype(np.float32)
                out = ("fp32", "bf16", "bfp")[i % 3]
                got, want = dev.gemm(a, b, out=out), host.reference_gemm(dev.format(), a, b, out=out)
                if out == "bfp":
                    assert np.array_equal(got.codes, want.codes) and np.array_equal(got.exponents, want.exponents)
                else:
                    assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)), i
            retries = dev.stats.retries
    assert server.counts["dropped"] > 0 and retries > 0


def test_a_session_left_behind_by_another_syncs_again():
    """Session A takes the device, session B talks to it with numbers far ahead of A's, then
    A again: A's datagrams are late to the device, so its request goes unanswered; after that
    wait A sends with ``SYNC`` and its retry lands (without, it would never be heard again)."""
    with UdpServer(EmuDevice(CFG)).start() as server:
        with host.open(server.spec, timeout=0.5, retries=3) as a:
            check_products(a)
            assert not a.transport.resync
            with host.open(server.spec, timeout=5) as b:
                b.transport.numbering.seq = (a.transport.numbering.seq + 1000) & 0xFFFF
                check_products(b)
            late = server.counts["received"] - server.counts["taken"]
            check_products(a)
            assert a.stats.retries >= 1 and server.counts["received"] - server.counts["taken"] > late
            assert not a.transport.resync


def test_late_foreign_and_malformed_datagrams_are_ignored():
    """A datagram repeating a number the server has taken, an empty one and one from a
    stranger reach no stream: the driver goes on without a retry."""
    with UdpServer(EmuDevice(CFG)).start() as server:
        t = UdpTransport(server.spec)
        dev = host.Device(t, timeout=5)
        assert dev.info().size == 48
        t.sock.send(D.pack((t.numbering.seq - 1) & 0xFFFF, b"\xff" * 30))  # a late duplicate number
        t.sock.send(b"")  # too short
        stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        stranger.sendto(D.pack(0, b"\x00" * 40, D.SYNC), t.sock.getsockname())  # the client hears its server only
        stranger.close()
        check_products(dev)
        assert dev.stats.retries == 0
        dev.close()
    assert server.counts["received"] - server.counts["taken"] == 2


def test_link_errors():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(host.LinkError, match="nothing listens"):
        host.open(f"udp:127.0.0.1:{port}", timeout=0.2, retries=0)
    with pytest.raises(ValueError, match="HOST:PORT"):
        UdpTransport("nowhere")
    with pytest.raises(ValueError, match="probability"):
        UdpServer(EmuDevice(CFG), drop=1.5)


def test_cli_sim_server_udp():
    assert " 0 dropped" in udp_server_gemm("emu")
    r = subprocess.run([sys.executable, "-m", "hbfp.cli", "sim-server", "--device", "emu", "--drop", "0.1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--udp" in r.stderr
    r = subprocess.run([sys.executable, "-m", "hbfp.cli", "sim-server", "--device", "emu", "--udp", "0", "--pty"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "one" in r.stderr


def test_the_driver_keeps_within_the_links_window():
    """Over a link with a ``window`` (a network's: the device's receive buffer), the request
    bytes sent and not yet answered never exceed it, pipelining included; the products stay
    bit-exact. A link that delivers what was sent only when the driver waits for a reply
    shows what is in flight."""
    from hbfp.host.transports import LoopbackTransport, Transport

    class Held(Transport):
        window = 9000

        def __init__(self):
            self.inner = LoopbackTransport(EmuDevice(CFG))
            self.held, self.most = [], 0

        def send(self, data):
            self.held.append(bytes(data))
            self.most = max(self.most, sum(map(len, self.held)))

        def receive(self, timeout):
            for data in self.held:
                self.inner.send(data)
            self.held.clear()
            return self.inner.receive(timeout)

    link = Held()
    dev = host.Device(link, timeout=5)
    assert dev.pipeline
    rng = np.random.default_rng(4)
    a = rng.standard_normal((150, 200)).astype(np.float32)  # fp32 operands: several WRITEs a block
    b = rng.standard_normal((200, 120)).astype(np.float32)
    got = dev.gemm(a, b, input="fp32")
    assert np.array_equal(got.view(np.uint32), host.reference_gemm(dev.format(), a, b, input="fp32").view(np.uint32))
    assert 4096 < link.most <= Held.window  # more than one WRITE in flight, never more than the window
    assert UdpTransport.window == D.WINDOW and D.WINDOW <= D.RECEIVE_BUFFER
