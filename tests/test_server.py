"""The TCP server with several clients at once (``hbfp.host.server.Server``): products
of concurrent clients bit for bit, sessions that keep their own buffers, tags and STATUS,
silent, dripping, departing and never-reading clients that cannot hold the others up, and
``hbfp sim-server``'s options. Every server and client runs on 127.0.0.1 and stops by itself."""

import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import hbfp.host as host
from hbfp import cli
from hbfp.contract import CoreConfig
from hbfp.golden.compare import same_bits
from hbfp.host import protocol as P
from hbfp.host.emu import EmuDevice, command_cycles
from hbfp.host.protocol import Op, Status, Target
from hbfp.host.server import Server

CFG = CoreConfig(rows=4, cols=4, size=48)


class Raw:
    """A client that speaks frames by hand (its own tags, its own pace)."""

    def __init__(self, server: Server, **sockopts):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        for opt, value in sockopts.items():
            self.sock.setsockopt(socket.SOL_SOCKET, getattr(socket, opt), value)
        self.sock.settimeout(5)
        self.sock.connect((server.host, server.port))
        self.parser = P.FrameParser(1 << 24)
        self.frames: list = []

    def send(self, op: int, tag: int, payload: bytes = b"") -> None:
        self.sock.sendall(P.encode_frame(op, tag, payload))

    def reply(self, timeout: float = 5.0) -> P.Frame:
        deadline = time.monotonic() + timeout
        while not self.frames:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            data = self.sock.recv(1 << 16)
            assert data, "the server closed the connection"
            self.frames += self.parser.feed(data)
        return self.frames.pop(0)

    def closed_within(self, seconds: float) -> bool:
        """Whether the server closes the connection within ``seconds`` (replies are skipped)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                if self.sock.recv(1 << 16) == b"":
                    return True
            except TimeoutError:
                return False
            except ConnectionResetError:
                return True
        return False

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def product(dev, rng, m, k, n, **kw) -> bool:
    """A random product on ``dev``, compared bit for bit with ``reference_gemm``."""
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if kw.get("transpose_b") else (k, n)).astype(np.float32)
    if kw.pop("with_c", False):
        kw["c"] = rng.standard_normal((m, n)).astype(np.float32)
    if kw.pop("with_bias", False):
        kw["bias"] = rng.standard_normal(n).astype(np.float32)
    return same_bits(dev.gemm(a, b, **kw), host.reference_gemm(dev.format(), a, b, **kw))


def test_several_clients_at_once_get_their_own_products_bit_for_bit():
    """Four clients connected together, their products interleaved on the one device: each
    product (tiled, K chains on the accumulator, C and bias loaded) equals the golden model's."""
    jobs = [((100, 70, 60), {}), ((60, 100, 49), dict(out="bfp", input="fp32", with_bias=True)),
            ((50, 120, 30), dict(out="bf16", input="bf16", activation="relu", transpose_b=True, with_c=True))]
    clients = 4
    opened = threading.Barrier(clients, timeout=10)
    results: dict[int, list] = {}
    errors: list = []

    def client(i: int) -> None:
        try:
            with host.open(server.spec, timeout=10) as dev:
                opened.wait()  # all are connected before any product starts
                rng = np.random.default_rng(i)
                results[i] = [product(dev, rng, *shape, **dict(kw)) for shape, kw in jobs]
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(f"client {i}: {e!r}")

    with Server(EmuDevice(CFG)).start() as server:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert results == {i: [True] * len(jobs) for i in range(clients)}
    assert server.served == clients
    assert server.switches > 0  # the sessions did share the device


def test_sessions_keep_their_own_buffers_tags_and_status():
    """Two clients fill the same accumulator region with the same tags: each reads back its
    own values; STATUS counts each one's replies; a bad CRC is answered with its tag."""
    x = np.arange(4 * 8, dtype="<f4").reshape(4, 8)
    with Server(EmuDevice(CFG)).start() as server, Raw(server) as a, Raw(server) as b:
        for client, values in ((a, x), (b, -x)):
            client.send(Op.WRITE, 7, P.encode_write(Target.ACC, 0, 0, 4, 8, values.tobytes()))
        for client in (a, b):
            r = client.reply()
            assert (r.opcode, r.tag, r.status) == (Op.WRITE | P.REPLY, 7, Status.OK)
        for client, values in ((b, -x), (a, x)):
            client.send(Op.READ, 7, P.encode_read(4, 8))
            r = client.reply()
            assert r.tag == 7 and r.status == Status.OK
            assert np.array_equal(np.frombuffer(r.data, "<f4").reshape(4, 8), values)
        bad = bytearray(P.encode_frame(Op.IDENTIFY, 9))
        bad[-1] ^= 1
        a.sock.sendall(bytes(bad))
        r = a.reply()
        assert (r.opcode, r.tag, r.status) == (Op.IDENTIFY | P.REPLY, 9, Status.BAD_CRC)
        a.send(Op.STATUS, 10)
        st = P.decode_status(a.reply().data)
        assert (st.accepted, st.refused, st.last_error) == (3, 1, Status.BAD_CRC)  # WRITE, READ, STATUS
        b.send(Op.STATUS, 10)
        st = P.decode_status(b.reply().data)
        assert (st.accepted, st.refused, st.last_error) == (3, 0, Status.OK)
        assert st.last_cycles == command_cycles(CFG, 4, 8, 0)  # its READ's (0)


def _gemm_all(client: Raw, tag: int, size: int) -> np.ndarray:
    """A size^3 GEMM of whatever the buffers hold: its fp32 result."""
    client.send(Op.GEMM, tag, P.encode_gemm(size, size, size))
    r = client.reply()
    assert r.status == Status.OK
    return np.frombuffer(r.data[:-P.CYCLES_SIZE], "<f4")  # the result, then the cycles


def _read_all(client: Raw, tag: int, size: int) -> np.ndarray:
    client.send(Op.READ, tag, P.encode_read(size, size))
    r = client.reply()
    assert r.status == Status.OK
    return np.frombuffer(r.data, "<f4")


def test_a_session_never_sees_another_ones_data():
    """A session reads zeros where it has not written: beside a session that has, after that
    one left, and after its own RESET or another's (the device's buffers still hold them)."""
    size = CFG.size
    rng = np.random.default_rng(3)
    x, y = (rng.standard_normal((size, size)).astype(np.float32) for _ in range(2))
    with Server(EmuDevice(CFG)).start() as server:
        a = host.open(server.spec, timeout=5)
        a.gemm(x, y)
        with Raw(server) as b:
            assert not _read_all(b, 1, size).any()  # A's accumulator
            assert not _gemm_all(b, 2, size).any()  # A's operands
            assert not _read_all(b, 3, size).any()  # its own GEMM of zeros, nothing of A's
        a.close()
        with Raw(server) as c:  # A has left: its data is still in the device
            assert not _gemm_all(c, 4, size).any()
        a2 = host.open(server.spec, timeout=5)
        a2.gemm(y, x)
        a2.reset()
        with Raw(server) as d:
            assert not _gemm_all(d, 5, size).any()
        with Raw(server) as e:  # a session's own RESET: its buffers read as zeros, on the device too
            e.send(Op.WRITE, 6, P.encode_write(Target.ACC, 0, 0, 4, 8, np.ones((4, 8), "<f4").tobytes()))
            assert e.reply().status == Status.OK
            assert _read_all(e, 7, size).any()
            e.send(Op.RESET, 8)
            assert e.reply().status == Status.OK
            assert not _read_all(e, 9, size).any()
        a2.close()


class _Counting:
    """A byte device that counts the frames the server sends it."""

    def __init__(self, device):
        self.device, self.frames, self._parser = device, [], P.FrameParser(1 << 20, device=True)

    def write(self, data: bytes) -> None:
        self.frames += [f.opcode for f in self._parser.feed(data) if isinstance(f, P.Frame)]
        self.device.write(data)

    def read(self, max_bytes=None) -> bytes:
        return self.device.read(max_bytes)


def test_a_hand_over_costs_the_same_however_many_writes_made_the_buffers():
    """A session of many small WRITEs: the frames a hand-over sends the device do not grow
    with them (its buffers are put back whole, not replayed), and the session still gets its
    own data back."""
    size = CFG.size
    device = _Counting(EmuDevice(CFG))
    costs = []
    codes = np.random.default_rng(4).integers(-127, 128, (size, size), dtype=np.int8)
    with Server(device).start() as server, Raw(server) as many, Raw(server) as other:
        tiles = size // CFG.tile[0]
        for target, data in ((Target.A_CODES, codes), (Target.B_CODES, codes),
                             (Target.B_EXPONENTS, np.full((tiles, tiles), 120, np.uint8))):
            many.send(Op.WRITE, 9, P.encode_write(target, 0, 0, *data.shape, data.tobytes()))
            assert many.reply().status == Status.OK
        for writes in (4, 400):
            tag = 0
            for i in range(writes):  # single exponents, one byte each, over and over
                many.send(Op.WRITE, tag, P.encode_write(Target.A_EXPONENTS, i % 2, 0, 1, 1, bytes([100 + i % 7])))
                assert many.reply().status == Status.OK
                tag += 1
            want = _gemm_all(many, tag, size)
            other.send(Op.STATUS, 1)
            assert other.reply().status == Status.OK
            _read_all(other, 2, size)  # other takes the device
            before = len(device.frames)
            got = _read_all(many, tag + 1, size)  # and gives it back
            costs.append(len(device.frames) - before)
            assert want.any() and np.array_equal(got, want)
    assert costs[1] == costs[0], costs


def test_partial_frames_and_their_timeouts_are_no_sign_of_life():
    """Connections that only ever start frames (their TIMEOUT replies read) are dropped after
    client_timeout, and at max_clients a new client takes the place of the longest idle one."""
    messages: list[str] = []
    with Server(EmuDevice(CFG, frame_timeout=1000), client_timeout=1.0, max_clients=2,
                log=messages.append).start() as server, Raw(server) as junk1, Raw(server) as junk2:
        for _ in range(4):
            for junk in (junk1, junk2):
                junk.sock.sendall(b"HB")
            time.sleep(0.1)
        with host.open(server.spec, timeout=5) as dev:  # a third client while two are connected
            assert dev.info().size == CFG.size
        assert junk1.closed_within(3.0) and junk2.closed_within(3.0)
    assert any("dropped for" in m and "2 clients are connected" in m for m in messages), messages


def test_ipv6_loopback_serves():
    if not socket.has_ipv6:
        pytest.skip("this Python has no IPv6")
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    with Server(EmuDevice(CFG), "::1", 0).start() as server:
        assert server.spec.startswith("tcp:[::1]:")
        with host.open(server.spec, timeout=5) as dev:
            assert product(dev, np.random.default_rng(2), 20, 30, 10)


def drip(server: Server, stop: threading.Event) -> None:
    """One byte every 50 ms: IDENTIFY requests, over and over, until ``stop``."""
    frame = P.encode_frame(Op.IDENTIFY, 1)
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        for i in range(200):  # 10 s at most
            if stop.wait(0.05):
                return
            sock.sendall(frame[i % len(frame) : i % len(frame) + 1])


def test_silent_and_dripping_clients_do_not_hold_up_a_good_one():
    messages: list[str] = []
    stop = threading.Event()
    with Server(EmuDevice(CFG), client_timeout=1.5, log=messages.append).start() as server, Raw(server) as silent:
        dripper = threading.Thread(target=drip, args=(server, stop))
        dripper.start()
        try:
            time.sleep(0.2)  # both are connected first
            t0 = time.monotonic()
            with host.open(server.spec, timeout=5) as dev:
                assert product(dev, np.random.default_rng(1), 60, 70, 50)
            assert time.monotonic() - t0 < 5.0
            # The silent one is dropped after client_timeout.
            assert silent.closed_within(5.0)
        finally:
            stop.set()
            dripper.join(5)
    assert any("dropped: no complete frame for 1.5 s" in m for m in messages), messages
    assert sum("connected" in m for m in messages) == 3


def test_a_client_leaving_mid_frame_leaves_nothing_behind():
    """Half a WRITE, then the client goes (or stays, silent): the next client's first
    request gets its own reply at once."""
    messages: list[str] = []
    half = P.encode_frame(Op.WRITE, 3, P.encode_write(Target.ACC, 0, 0, 4, 8, bytes(128)))[:20]
    with Server(EmuDevice(CFG), log=messages.append).start() as server:
        with Raw(server) as staying:
            staying.sock.sendall(half)
            with Raw(server) as leaving:
                leaving.sock.sendall(half)
            for tag in (1234, 1235):
                with Raw(server) as nxt:
                    nxt.send(Op.IDENTIFY, tag)
                    r = nxt.reply(2.0)
                    assert (r.opcode, r.tag, r.status) == (Op.IDENTIFY | P.REPLY, tag, Status.OK)
    assert any("left mid-frame (20 bytes of it discarded)" in m for m in messages), messages


def test_a_client_that_never_reads_is_paused_at_the_bound():
    bound = 64 << 10
    read = P.encode_frame(Op.READ, 5, P.encode_read(48, 48))
    reply_bytes = P.HEADER.size + 1 + 4 * 48 * 48 + P.CRC_SIZE
    with Server(EmuDevice(CFG), max_queued=bound).start() as server, Raw(server, SO_RCVBUF=4096) as greedy:
        greedy.sock.setblocking(False)
        sent = 0
        for _ in range(3000):  # requests for 28 MB of replies
            try:
                sent += greedy.sock.send(read)
            except BlockingIOError:
                break
        deadline = time.monotonic() + 10
        while server.peak_queued < bound and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # a paused client's frames no longer run
        assert bound <= server.peak_queued < bound + reply_bytes, (server.peak_queued, sent)
        with host.open(server.spec, timeout=5) as dev:
            assert product(dev, np.random.default_rng(2), 30, 40, 20)
        assert server.peak_queued < bound + reply_bytes


def test_cli_sim_server_drops_idle_clients():
    assert cli.main(["sim-server", "--pty", "--client-timeout", "1", "--device", "emu"]) == 2
    proc = subprocess.Popen(
        [sys.executable, "-m", "hbfp.cli", "sim-server", "--device", "emu:rows=4,cols=4,size=48", "--port", "0",
         "--connections", "2", "--client-timeout", "1", "--max-queued", "65536"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving emu"), line
        address = line.split()[-1][len("tcp:"):].rsplit(":", 1)
        with socket.create_connection((address[0], int(address[1])), timeout=5) as silent:
            assert cli.main(["gemm", line.split()[-1], "--m", "30", "--n", "20", "--k", "40"]) == 0
            silent.settimeout(5)
            assert silent.recv(1) == b""  # dropped
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert "served 2 connection(s)" in out
        assert "dropped: no complete frame for 1 s" in err and err.count("connected") == 2, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("option", [["--max-queued", "0"], ["--max-clients", "0"]])
def test_cli_sim_server_refuses_bad_options(option, capsys):
    with pytest.raises(SystemExit) as e:  # the option's type refuses it, as argparse does
        cli.main(["sim-server", "--device", "emu", "--port", "0", *option])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == f"hbfp sim-server: {option[0]} must be at least 1, got 0"
