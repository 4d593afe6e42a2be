"""Transports: TCP to a served ``emu`` on 127.0.0.1, a serial port over a pseudo-terminal,
faults on a real socket, and the ``hbfp info``/``gemm``/``sim-server`` commands."""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import hbfp.host as host
from hbfp import cli
from hbfp.host import protocol as P
from hbfp.host.emu import EmuDevice
from hbfp.host.server import Server, serve_fd
from hbfp.host.transports import FaultyTransport, TcpTransport
from hbfp.contract import CoreConfig

CFG = CoreConfig(rows=4, cols=4, size=48)


def check_products(dev):
    rng = np.random.default_rng(0)
    for (m, k, n), kw in [((30, 40, 20), {}), ((100, 70, 60), dict(out="bfp", input="fp32")),
                          ((50, 100, 49), dict(out="bf16", input="bf16", activation="relu", transpose_b=True))]:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((n, k) if kw.get("transpose_b") else (k, n)).astype(np.float32)
        got = dev.gemm(a, b, **kw)
        want = host.reference_gemm(dev.format(), a, b, **kw)
        if kw.get("out") == "bfp":
            assert np.array_equal(got.codes, want.codes) and np.array_equal(got.exponents, want.exponents)
        else:
            assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


class Muted:
    """A byte device that can stop answering (it ignores what it receives meanwhile)."""

    def __init__(self, inner):
        self.inner, self.muted = inner, False
        self.cycles_per_second = inner.cycles_per_second

    def write(self, data):
        if not self.muted:
            self.inner.write(data)

    def read(self, max_bytes=None):
        return self.inner.read(max_bytes)

    def advance(self, cycles):
        self.inner.advance(cycles)


def test_tcp_to_a_served_emu():
    with Server(EmuDevice(CFG), "127.0.0.1", 0, connections=1).start() as server:
        assert server.port > 0 and server.spec.startswith("tcp:127.0.0.1:")
        with host.open(server.spec, timeout=5) as dev:
            assert dev.identity.size == 48
            check_products(dev)
            assert dev.stats.retries == 0
    assert server.served == 1


def test_tcp_faults_with_wall_clock_timeouts():
    emu = Muted(EmuDevice(CFG, frame_timeout=2_000_000))  # 20 ms at the nominal 100 MHz
    with Server(emu, "127.0.0.1", 0, connections=1).start() as server:
        link = FaultyTransport(TcpTransport(server.spec), seed=3)
        dev = host.Device(link, timeout=0.5, retries=2)
        # truncated: the server's clock times the frame out and the device says so
        link.truncate_next = 1
        assert dev.info().size == 48 and dev.stats.retries == 1
        # corrupted: BAD_CRC, resent
        link.corrupt_next = 1
        check_products(dev)
        # duplicated: the stale reply is ignored
        link.duplicate_next = 1
        dev.status()
        dev.info()
        assert dev.stats.stale_replies >= 1
        # a device that stops answering: Timeout within timeout * (retries + 1)
        emu.muted = True
        t0 = time.monotonic()
        with pytest.raises(host.Timeout):
            dev.status()
        assert time.monotonic() - t0 < 0.5 * 3 + 1.0
        emu.muted = False
        st = dev.status()
        assert st.last_error in (P.Status.TIMEOUT, P.Status.BAD_CRC)
        check_products(dev)
        dev.close()


def test_serial_over_a_pseudo_terminal():
    master, slave = os.openpty()
    stop = threading.Event()
    server = threading.Thread(target=serve_fd, args=(EmuDevice(CFG), master), kwargs=dict(stop=stop), daemon=True)
    server.start()
    try:
        with host.open(f"serial:{os.ttyname(slave)}:115200", timeout=5) as dev:
            assert dev.identity.rows == 4
            check_products(dev)
            assert dev.stats.retries == 0
    finally:
        stop.set()
        server.join(5)
        os.close(slave)
        os.close(master)


def test_link_errors():
    with pytest.raises(host.LinkError, match="cannot connect"):
        TcpTransport("127.0.0.1:1", connect_timeout=1)
    with pytest.raises(host.BackendError):
        host.open("tcp:nonsense")
    with pytest.raises(host.LinkError, match="cannot open serial port"):
        host.open("serial:/dev/hbfp-no-such-port")
    server = Server(EmuDevice(CFG), "127.0.0.1", 0, connections=1, idle_timeout=0.2).start()
    dev = host.open(server.spec)
    server.stop()  # the server closes the connection
    with pytest.raises(host.LinkError, match="closed|pipe|reset"):
        dev.status()
    dev.close()


def test_cli_info_and_gemm(capsys):
    assert cli.main(["info", "emu:rows=4,cols=4,size=48"]) == 0
    out = capsys.readouterr().out
    assert "MAC array 4x4" in out and "buffers 48x48" in out and f"ABI {P.ABI_VERSION[0]}.{P.ABI_VERSION[1]}" in out
    assert "emu " in out and "tcp " in out and "serial " in out
    for spec in ("emu:rows=4,cols=4,size=48,wire=1", "emu:rows=4,cols=4,size=48"):
        assert cli.main(["gemm", spec, "--m", "60", "--n", "50", "--k", "70", "--out", "bfp",
                         "--input", "fp32", "--rounding", "stochastic", "--bias", "--activation", "gelu"]) == 0
        out = capsys.readouterr().out
        assert "bit-exact" in out and "utilization 91.6%" in out
        assert "done on the host: 3 quantizations, 0 activations" in out  # split stochastic streams
        # through the wire: its bytes; in-process: none
        assert ("bytes/MAC" in out) == spec.endswith("wire=1") and ("link: none" in out) != spec.endswith("wire=1")
    # A reduced device: the same command, the missing units' work done on the host.
    reduced = "emu:rows=4,cols=4,size=48,value_quantizer=0,bfp_output=0,stochastic=0,functions=none"
    assert cli.main(["info", reduced]) == 0
    out = capsys.readouterr().out
    assert "optional units: none (without value_quantizer, bfp_output, stochastic" in out
    assert "activation units: none" in out
    assert cli.main(["gemm", reduced, "--m", "60", "--n", "50", "--k", "70", "--out", "bfp", "--input", "fp32",
                     "--rounding", "stochastic", "--bias", "--activation", "gelu"]) == 0
    out = capsys.readouterr().out
    assert "bit-exact" in out and "done on the host: 3 quantizations, 1 activations" in out
    assert cli.main(["info", "nope"]) == 2
    assert "no device backend" in capsys.readouterr().err


def test_cli_sim_server_serves_emu():
    proc = subprocess.Popen(
        [sys.executable, "-m", "hbfp.cli", "sim-server", "--device", "emu:rows=4,cols=4,size=48", "--port", "0",
         "--connections", "1", "--idle-timeout", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving emu"), (line, proc.stderr.read() if proc.poll() is not None else "")
        spec = line.split()[-1]
        assert spec.startswith("tcp:127.0.0.1:")
        assert cli.main(["gemm", spec, "--m", "50", "--n", "49", "--k", "100"]) == 0
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert "served 1 connection" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_pipelining_follows_the_transports_flow_control():
    """No pipelining over a UART by default (the board's receive FIFO would overflow);
    links with flow control pipeline."""
    from hbfp.host.device import Device
    from hbfp.host.emu import EmuDevice
    from hbfp.host.transports import LoopbackTransport, SerialTransport

    serial_link = SerialTransport("loop://")
    try:
        assert Device(serial_link, check=False).pipeline is False
        assert Device(serial_link, check=False, pipeline=True).pipeline is True
    finally:
        serial_link.close()
    assert Device(LoopbackTransport(EmuDevice()), check=False).pipeline is True
