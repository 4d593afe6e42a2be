"""The UART host link end to end: the ``sim`` backend with ``uart=N`` (``hw.uart.UartLoop``:
the accelerator behind its UART, reached through a host-side UART, under Verilator), served
on a pseudo-terminal (``PtyServer``, ``hbfp sim-server --pty``), and the host's one driver
over ``serial:`` (pyserial) against ``emu`` (the golden model) bit for bit."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hbfp import cli, host
from hbfp.host import protocol
from hbfp.host.emu import EmuDevice
from hbfp.host.server import PtyServer
from hbfp.sim import device as sim_device
from hbfp.sim.harness import build

#: A small core: a 4x4 HBFP8 array with 48x48 buffers and one activation unit (the build
#: dominates the time), on a UART of 8 cycles a bit.
CORE_ARG = "rows=4,cols=4,size=48,functions=relu"
DIVISOR = 8
SIM_ARG = f"{CORE_ARG},uart={DIVISOR}"


# ---- the option, without a build ------------------------------------------------------------


def test_uart_option_selects_the_uart_loop(recorded_builds):
    opts = sim_device.parse_arg(CORE_ARG)
    assert sim_device.parse_arg(SIM_ARG) == {**opts, "uart": DIVISOR}
    _, plain = sim_device.top_library(opts)
    _, zero = sim_device.top_library({**opts, "uart": 0})
    _, uart = sim_device.top_library(sim_device.parse_arg(SIM_ARG))
    # Without a UART (absent or 0) the configuration, hence the library's cache key, is the
    # one it always was: AcceleratorTop's, with no "uart" entry.
    assert plain == zero and "uart" not in plain and plain["top"] == "hw.top.AcceleratorTop"
    assert uart == {**plain, "top": "hw.uart.UartLoop", "uart": DIVISOR}
    assert recorded_builds[0][1] == plain and recorded_builds[2][1] == uart
    assert recorded_builds[2][2]["stream_bytes"] == 1
    make = recorded_builds[2][0]
    top = make()
    from hbfp.hw.uart import UartLoop

    assert isinstance(top, UartLoop) and top.divisor == DIVISOR and top.cfg.size == 48
    top._MustUse__used = True  # not elaborated here: the build test does
    _, deep = sim_device.top_library({**opts, "uart": DIVISOR, "fifo_depth": 128})
    top = recorded_builds[3][0]()
    top._MustUse__used = True
    assert deep == {**uart, "fifo_depth": 128} and top.device_kw["fifo_depth"] == 128


@pytest.mark.parametrize(("arg", "match"), [
    ("uart=3", "uart"), ("uart=8,stream_bytes=4", "stream_bytes=1"), ("fifo_depth=64", "needs uart"),
])
def test_uart_option_errors(recorded_builds, arg, match):
    with pytest.raises(ValueError, match=match):
        sim_device.top_library(sim_device.parse_arg(f"{CORE_ARG},{arg}"))
    assert not recorded_builds


# ---- the pseudo-terminal bridge (emu: no build) ----------------------------------------------


def test_pty_server_relays_a_byte_device():
    """``PtyServer`` on the golden-model device: its terminal is raw (bytes pass unchanged,
    no echo of replies back to the device), clients may come and go."""
    import termios

    with PtyServer(EmuDevice(config=None)).start() as server:
        assert server.spec == f"serial:{server.path}" and server.path.startswith("/dev/")
        attrs = termios.tcgetattr(server.slave)
        assert not attrs[3] & (termios.ECHO | termios.ICANON)
        for _ in range(2):  # two sessions, one after the other
            with host.open(server.spec, timeout=5) as dev:
                assert dev.identity.size == 96
                a = np.arange(12, dtype=np.float32).reshape(3, 4)
                assert np.array_equal(dev.gemm(a, a.T), host.reference_gemm(dev.format(), a, a.T))
                assert dev.stats.retries == 0
    assert server.master is None and server.slave is None  # closed on stop


def test_cli_sim_server_pty(capsys):
    assert cli.main(["sim-server", "--pty", "--connections", "1", "--device", "emu"]) == 2
    assert "--idle-timeout" in capsys.readouterr().err
    proc = subprocess.Popen(
        [sys.executable, "-m", "hbfp.cli", "sim-server", "--pty", "--device", "emu:rows=4,cols=4,size=48",
         "--idle-timeout", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving emu:rows=4,cols=4,size=48 on serial:/dev/"), (
            line, proc.stderr.read() if proc.poll() is not None else "")
        spec = line.split()[-1]
        assert cli.main(["gemm", spec, "--m", "30", "--n", "20", "--k", "50", "--out", "bf16"]) == 0
        assert "bit-exact" in capsys.readouterr().out
        _, err = proc.communicate(timeout=20)  # stops itself after 2 s without a byte
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# ---- the gateware's UART under Verilator --------------------------------------------------------

needs_build = pytest.mark.skipif(build.unavailable() is not None, reason=str(build.unavailable()))
#: pytest-xdist: every test of the library in one worker, so that it is built once.
one_worker = pytest.mark.xdist_group("uart_link")


@pytest.fixture(scope="module")
def uart_sim():
    dev = sim_device.backend.open(SIM_ARG, progress=lambda msg: print(msg, flush=True))
    yield dev
    dev.close()


@needs_build
@one_worker
def test_sim_uart_device_takes_line_time(uart_sim):
    """IDENTIFY on the ``sim`` device with ``uart=8``: the reply's fields, and the time it
    took: every byte of the request and of the reply crossed a UART line at 10 bits of
    8 cycles (twice: the host's and the device's transmitters)."""
    uart_sim.reset()
    request = protocol.encode_frame(protocol.Op.IDENTIFY, 0x4242)
    start = uart_sim.cycles
    uart_sim.write(request)
    (reply,) = protocol.FrameParser().feed(uart_sim.read())
    took = uart_sim.cycles - start
    assert reply.tag == 0x4242 and reply.status == protocol.Status.OK
    ident = protocol.decode_identity(reply.data)
    assert (ident.rows, ident.size, ident.stream_bytes) == (4, 48, 1)
    wire = len(request) + protocol.HEADER.size + 1 + protocol.IDENTITY_SIZE + protocol.CRC_SIZE
    assert 10 * DIVISOR * wire <= took <= 10 * DIVISOR * wire + 400, took


@needs_build
@one_worker
def test_serial_over_pty_through_the_uart_equals_emu(uart_sim):
    """The host's driver on ``serial:`` (pyserial on a pseudo-terminal), relayed to the
    ``sim`` device whose bytes cross the gateware's UART both ways: ``info`` and random
    products (fp32 and bf16 out, one larger than the buffers, tiled by the driver, which
    does not pipeline over a UART) equal ``emu``'s bit for bit, with no retry."""
    uart_sim.reset()
    emu = host.open(f"emu:{CORE_ARG}")
    rng = np.random.default_rng(6)
    with PtyServer(uart_sim).start() as server, host.open(server.spec, timeout=10) as dev:
        assert dev.pipeline is False  # a serial link has no flow control
        ident, ref = dev.info(), emu.info()
        fields = ("rows", "cols", "mantissa_bits", "tile_rows", "tile_cols", "size", "functions_mask", "leaky_shift")
        assert [getattr(ident, f) for f in fields] == [getattr(ref, f) for f in fields]
        assert ident.stream_bytes == 1
        runs = [((24, 24, 24), dict()), ((17, 30, 9), dict(out="bf16", bias=rng.standard_normal(9).astype(np.float32),
                                                           activation="relu")),
                ((60, 70, 50), dict())]
        for (m, k, n), kw in runs:
            a = (rng.standard_normal((m, k)) * 4).astype(np.float32)
            b = rng.standard_normal((k, n)).astype(np.float32)
            got, want = dev.gemm(a, b, **kw), emu.gemm(a, b, **kw)
            view = np.uint16 if kw.get("out") == "bf16" else np.uint32
            assert np.array_equal(np.asarray(got).view(view), np.asarray(want).view(view)), ((m, k, n), kw)
        assert dev.stats.retries == 0 and dev.stats.stale_replies == 0
    emu.close()
