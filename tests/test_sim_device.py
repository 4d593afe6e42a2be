"""The ``sim`` backend: a Verilated top behind the byte-pipe interface (sim/device.py).

Against the accelerator top (``hw.top.AcceleratorTop``, a small configuration: the build
dominates the time) when it elaborates: IDENTIFY, a frame timeout and a GEMM through
``hbfp.host.protocol``, bit for bit as ``hbfp.golden.gemm.gemm``, and the host's driver
(``hbfp.host.open("sim:...")``) against ``reference_gemm``. Always against a stand-in with
the top's ports (an echo behind a FIFO, with backpressure), which checks the harness itself:
byte order and keep lanes, frame-complete reads, throttled streams, bulk runs with no Python
per cycle, both port wrappers, and the library cache.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hbfp.host import protocol
from hbfp.sim import device as sim_device
from hbfp.sim.device import SimDevice, Stop, backend, parse_arg
from hbfp.sim.harness import build

from .conftest import SIM_TOP_ARG

pytestmark = [
    pytest.mark.skipif(build.unavailable() is not None, reason=str(build.unavailable())),
    # Under pytest-xdist all tests of this file share one worker: they share built libraries.
    pytest.mark.xdist_group("sim_device"),
]


# ---- the stand-in ---------------------------------------------------------------------

def make_standin(stream_bytes: int, depth: int = 16, accept_every: int = 3):
    """A component with the accelerator top's ports that echoes every beat it takes (data and
    keep) behind a FIFO of ``depth`` beats: ``i.ready`` is high only every ``accept_every``-th
    cycle and while the FIFO has room, and the FIFO fills while ``o`` is held off."""
    from amaranth import Module, Signal
    from amaranth.lib import data, fifo, stream, wiring
    from amaranth.lib.wiring import In, Out

    layout = data.StructLayout({"data": data.ArrayLayout(8, stream_bytes), "keep": stream_bytes})

    class Standin(wiring.Component):
        def __init__(self):
            super().__init__({"i": In(stream.Signature(layout)), "o": Out(stream.Signature(layout))})

        def elaborate(self, platform):
            m = Module()
            m.submodules.fifo = q = fifo.SyncFIFOBuffered(width=layout.size, depth=depth)
            phase = Signal(range(accept_every))
            m.d.sync += phase.eq(phase + 1)
            with m.If(phase == accept_every - 1):
                m.d.sync += phase.eq(0)
            m.d.comb += [
                q.w_data.eq(self.i.payload.as_value()),
                q.w_en.eq(self.i.valid & (phase == 0)),
                self.i.ready.eq(q.w_rdy & (phase == 0)),
                self.o.payload.eq(q.r_data),
                self.o.valid.eq(q.r_rdy),
                q.r_en.eq(self.o.ready),
            ]
            return m

    return Standin()


STANDIN_SOURCES = (Path(__file__),)


def standin_device(stream_bytes: int, buffered: bool = True, **kw) -> SimDevice:
    lib = build.build_library(lambda: make_standin(stream_bytes), {"standin": 1}, stream_bytes=stream_bytes,
                              name="standin", sources=STANDIN_SOURCES, buffered=buffered)
    return SimDevice(lib, **kw)


@pytest.fixture(scope="module", params=[(1, True), (4, False)], ids=["1byte-buffered", "4bytes-direct"])
def standin(request):
    with standin_device(*request.param) as dev:
        yield dev


def frames(data: bytes) -> list:
    return protocol.FrameParser().feed(data)


# ---- the harness, on the stand-in -----------------------------------------------------

def test_echo_frame_complete_read(standin):
    dev = standin
    dev.reset()
    assert dev.cycles == 0 and dev.read(timeout_cycles=0) == b""
    req = protocol.encode_frame(protocol.Op.IDENTIFY, 0x1234)
    big = protocol.encode_frame(protocol.Op.WRITE, 7, bytes(range(256)) * 3 + b"\x01\x02\x03")
    dev.write(req + big)
    got = dev.read()
    # read() runs until one complete frame is buffered, then returns what is buffered.
    assert got[: len(req)] == req
    rest = got[len(req):]
    while len(rest) < len(big):
        more = dev.read()
        assert more, "device went quiet before the second frame came back"
        rest += more
    assert rest == big
    assert [f.tag for f in frames(got[: len(req)] + rest)] == [0x1234, 7]
    c = dev.counters()
    assert c["requests"] == 2 and c["replies"] == 2 and c["queued"] == 0
    # Nothing outstanding: read returns at once with nothing, running no cycle.
    before = dev.cycles
    assert dev.read() == b""
    assert dev.cycles == before


def test_partial_reads_and_odd_lengths(standin):
    dev = standin
    dev.reset()
    # Lengths that are not multiples of the stream width exercise the keep lanes.
    payloads = [b"", b"\x00", b"ab", b"xyz", bytes(range(5)), bytes(97)]
    sent = b"".join(protocol.encode_frame(protocol.Op.STATUS, t, p) for t, p in enumerate(payloads))
    dev.write(sent)
    got = b""
    while len(got) < len(sent):
        chunk = dev.read(7)
        assert 0 < len(chunk) <= 7
        got += chunk
    assert got == sent
    assert [f.payload for f in frames(got)] == payloads


def test_throttled_streams(standin):
    dev = standin
    dev.reset()
    dev.throttle(in_chance=0.3, out_chance=0.4, seed=5)
    try:
        sent = protocol.encode_frame(protocol.Op.GEMM, 3, os.urandom(300))
        dev.write(sent)
        got = b""
        while len(got) < len(sent):
            chunk = dev.read()
            assert chunk
            got += chunk
        assert got == sent
    finally:
        dev.throttle()


def test_run_and_stop_conditions(standin):
    dev = standin
    dev.reset()
    assert dev.run(1000) == 1000 and dev.cycles == 1000
    dev.write(b"garbage without magic")
    dev.flush()
    assert dev.queued == 0
    n = dev.run(100_000, stop=Stop.OUTPUT)
    assert n < 100 and dev.pending > 0
    dev.run_until_idle(idle_cycles=50)
    assert dev.read(timeout_cycles=0) == b"garbage without magic"
    # A partial frame: read runs only until the device has taken what there is (more bytes
    # may come), then time passes with advance() alone.
    frame = protocol.encode_frame(protocol.Op.STATUS, 1, b"12345")
    dev.write(frame[:-3])
    start = dev.cycles
    got = dev.read()
    assert dev.queued == 0 and dev.cycles - start < 200
    dev.advance(5000)  # no complete frame comes: all of it passes
    assert dev.cycles - start >= 5000
    got += dev.read()
    assert got == frame[:-3]
    dev.write(frame[-3:])
    assert dev.read() == frame[-3:]
    assert dev.counters()["requests"] == 1 == dev.counters()["replies"]


def test_bulk_runs_no_python_per_cycle(standin):
    """A read that runs many cycles calls back into Python a bounded number of times: the clock
    loop is native."""
    dev = standin
    dev.reset()
    payload = os.urandom(20_000)
    sent = protocol.encode_frame(protocol.Op.WRITE, 9, payload)
    dev.write(sent)
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    start = dev.cycles
    sys.setprofile(count)
    try:
        got = dev.read()
    finally:
        sys.setprofile(None)
    cycles = dev.cycles - start
    assert got == sent
    # stand-in: one beat per 3 cycles
    assert cycles >= len(sent) / dev.stream_bytes * 3 * 0.9
    assert calls < 50, f"{calls} Python calls for {cycles} cycles"


def test_run_counts_every_cycle(standin):
    # Speed is a benchmark's business (benchmarks/sim_speed.py), never a test's: here only
    # that a long native run advances the clock by exactly the cycles asked for.
    dev = standin
    dev.reset()
    before = dev.cycles
    dev.run(1_000_000)
    assert dev.cycles - before == 1_000_000


def test_library_cache(tmp_path):
    a = build.build_library(lambda: make_standin(2), {"standin": 1}, stream_bytes=2, name="standin",
                            sources=STANDIN_SOURCES)
    # A second open must not build: the factory would fail the test if it were elaborated.
    b = build.build_library(lambda: pytest.fail("a cached library is not elaborated again"), {"standin": 1},
                            stream_bytes=2, name="standin", sources=STANDIN_SOURCES, force=False)
    assert a == b and a.is_file() and a.parent.parent == build.CACHE_ROOT
    # Another configuration is another library; a changed source is another key.
    key1, _ = build.library_key({"x": 1}, sources=STANDIN_SOURCES)
    key2, _ = build.library_key({"x": 2}, sources=STANDIN_SOURCES)
    other = tmp_path / "other.py"
    other.write_text("# a different source\n")
    key3, _ = build.library_key({"x": 1}, sources=(other,))
    assert len({key1, key2, key3}) == 3
    # Two libraries (two stream widths) and two devices in one process stay apart.
    with standin_device(2) as d2, standin_device(1) as d1:
        frame = protocol.encode_frame(protocol.Op.IDENTIFY, 1)
        d1.write(frame)
        d2.write(frame + frame)
        assert d1.read() == frame
        got = d2.read()
        got += d2.read() if len(got) < 2 * len(frame) else b""
        assert got == frame + frame


def test_parse_arg():
    assert parse_arg("rows=4,cols=4,size=48,stream_bytes=4") == dict(rows=4, cols=4, size=48, stream_bytes=4)
    assert parse_arg("tile=1x32, functions=relu+gelu") == dict(tile=(1, 32), functions=("relu", "gelu"))
    assert parse_arg("format=MXINT8") == dict(mantissa_bits=8, tile=(1, 32))
    assert parse_arg("") == {}
    with pytest.raises(ValueError):
        parse_arg("bogus=1")
    # A reduced device: the optional units as the emu backend spells them.
    assert parse_arg("value_quantizer=0,bfp_output=No,stochastic=off,functions=") == dict(
        value_quantizer=False, bfp_output=False, stochastic=False, functions=())
    with pytest.raises(ValueError, match="yes/no"):
        parse_arg("stochastic=maybe")
    assert backend.ABI_VERSION == protocol.ABI_VERSION


# ---- the accelerator top ----------------------------------------------------------------

def _top_available() -> str | None:
    try:
        from hbfp.hw.top import AcceleratorTop  # noqa: F401
    except Exception as e:  # not written yet, or broken mid-edit
        return f"hw.top.AcceleratorTop unavailable: {e!r}"
    return None


#: The configuration the tests build (small: the build dominates the suite's time).
TOP_ARG = SIM_TOP_ARG


@pytest.fixture(scope="module")
def top_device():
    why = _top_available()
    if why:
        pytest.skip(why)
    t0 = time.perf_counter()
    dev = backend.open(TOP_ARG, progress=lambda msg: print(msg, flush=True))
    print(f"top library ready in {time.perf_counter() - t0:.1f} s: {dev.library}")
    yield dev
    dev.close()


@pytest.fixture
def top(top_device):
    top_device.reset()  # a new model: a power-on reset
    return top_device


def _transact(dev: SimDevice, opcode: int, tag: int, payload: bytes = b"") -> protocol.Frame:
    dev.write(protocol.encode_frame(opcode, tag, payload))
    parser = protocol.FrameParser()
    got = []
    while not got:
        chunk = dev.read()
        assert chunk, f"no reply to opcode {opcode:#x}"
        got = parser.feed(chunk)
    (reply,) = got
    assert isinstance(reply, protocol.Frame), reply
    assert reply.opcode == opcode | protocol.REPLY and reply.tag == tag
    return reply


def test_top_identify(top):
    opts = parse_arg(TOP_ARG)
    reply = _transact(top, protocol.Op.IDENTIFY, 0x55)
    assert reply.status == protocol.Status.OK
    ident = protocol.decode_identity(reply.data)
    assert ident.protocol_version == protocol.PROTOCOL_VERSION
    assert (ident.abi_major, ident.abi_minor) == protocol.ABI_VERSION
    assert ident.stream_bytes == opts["stream_bytes"]
    assert (ident.rows, ident.cols, ident.size) == (opts["rows"], opts["cols"], opts["size"])


def test_top_frame_timeout(top):
    """A frame that stops arriving: read() returns at once (the rest may still come), time
    passes with advance(), the device drops the frame with a TIMEOUT reply, and the next
    request works."""
    frame_timeout = parse_arg(TOP_ARG)["frame_timeout"]
    top.write(protocol.encode_frame(protocol.Op.STATUS, 9)[:7])
    start = top.cycles
    assert top.read() == b""
    assert top.cycles - start < 100
    top.advance(4 * frame_timeout)  # stops once the reply is in
    assert frame_timeout <= top.cycles - start < 2 * frame_timeout
    (reply,) = frames(top.read())
    assert (reply.tag, reply.status) == (protocol.FRAME_TIMEOUT_TAG, protocol.Status.TIMEOUT)
    assert _transact(top, protocol.Op.IDENTIFY, 10).status == protocol.Status.OK


def test_top_gemm_bit_exact(top):
    from hbfp.golden.bfp import quantize
    from hbfp.golden.gemm import gemm
    from hbfp.hw.params import CoreConfig

    opts = parse_arg(TOP_ARG)
    cfg = CoreConfig(**{k: v for k, v in opts.items() if k in sim_device._CORE_FIELDS})
    th, tw = cfg.tile
    rng = np.random.default_rng(3)
    # Sides on the tile grid (a WRITE of values takes whole tiles); N below the buffer size.
    m, n, k = cfg.size, max(tw, cfg.size // 2), cfg.size
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = (rng.standard_normal((k, n)) * 4).astype(np.float32)

    def tile_major(x):
        r, c = x.shape
        return x.reshape(r // th, th, c // tw, tw).transpose(0, 2, 1, 3).tobytes()

    ok = protocol.Status.OK
    tag = 0
    # One tile row per WRITE: a whole operand is more than max_payload.
    for target, x in ((protocol.Target.A_VALUES, a), (protocol.Target.B_VALUES, b)):
        for r in range(0, x.shape[0], th):
            tag += 1
            w = protocol.encode_write(target, r, 0, th, x.shape[1], tile_major(x[r : r + th]))
            assert _transact(top, protocol.Op.WRITE, tag, w).status == ok
    start, wire_start = top.cycles, top.wire_cycles
    reply = _transact(top, protocol.Op.GEMM, 3, protocol.encode_gemm(m, n, k))
    assert reply.status == ok, reply.status
    device_cycles = protocol.decode_cycles(reply.data)  # after the result
    # The exchange occupies the link from its request's first beat to its reply's last: the
    # core's run, which the reply's bytes at stream_bytes a beat overlap (each row-block's
    # rows leave once its sums are done), and nothing while the host idles.
    wire = top.wire_cycles - wire_start
    reply_beats = (len(reply.data) + 1 + protocol.HEADER.size + protocol.CRC_SIZE) / top.stream_bytes
    assert max(device_cycles, reply_beats) < wire < device_cycles + reply_beats, (device_cycles, reply_beats, wire)
    assert wire <= top.cycles - start
    top.run(1000)
    assert top.wire_cycles - wire_start == wire
    got = np.frombuffer(reply.data[:-protocol.CYCLES_SIZE], np.float32).reshape(m, n)  # the result, then the cycles
    fmt = cfg.fmt()
    want = np.asarray(gemm(quantize(a, fmt), quantize(b, fmt)), np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    print(f"GEMM {m}x{n}x{k}: {device_cycles} device cycles, {wire} on the wire, {top.cycles - start} simulated")


def test_host_driver_over_sim(top):
    """The host's one driver (``hbfp.host.open``) over the ``sim`` backend, as the entry point
    ``hbfp.devices: sim`` gives it: a product larger than the buffers (the driver tiles it),
    with bias and an activation, against ``reference_gemm``."""
    from hbfp import host
    from hbfp.host import registry
    from hbfp.host.device import reference_gemm

    if "sim" not in {ep.name for ep in registry._entry_points()}:
        registry.register_backend("sim", backend)  # an install older than the entry point
    assert registry.load_backend("sim") is backend
    with host.open("sim:" + TOP_ARG) as dev:
        ident = dev.identity
        fmt = dev.format()
        rng = np.random.default_rng(11)
        size = ident.size
        m, k, n = size + ident.tile_rows, size, size // 2 + ident.cols
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        bias = rng.standard_normal(n).astype(np.float32)
        for kw in (dict(), dict(bias=bias, activation="relu", out="bf16")):
            got = dev.gemm(a, b, **kw)
            want = reference_gemm(fmt, a, b, **kw)
            assert np.array_equal(np.asarray(got).view(np.uint16 if kw else np.uint32),
                                  np.asarray(want).view(np.uint16 if kw else np.uint32))


@pytest.mark.parametrize("shape", [(7, 5, 3), (33, 40, 17), (70, 45, 50)])
def test_sim_equals_emu(top, shape):
    """The same host code on ``sim`` (the RTL) and on ``emu`` (the golden model): random
    products, some larger than the buffers (tiled by the driver), equal bit for bit, in
    every output format and with device-side quantization of fp32 inputs."""
    from hbfp import host

    emu_arg = ",".join(kv for kv in TOP_ARG.split(",") if not kv.startswith("stream_bytes="))
    m, k, n = shape
    rng = np.random.default_rng(m * 1000 + k)
    a = (rng.standard_normal((m, k)) * 4).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    runs = [dict(), dict(out="bf16", bias=bias, activation="gelu"), dict(out="bfp", rounding="stochastic", seed=5),
            dict(input="fp32", transpose_b=True)]
    with host.open("sim:" + TOP_ARG) as sim_dev, host.open("emu:" + emu_arg) as emu_dev:
        for kw in runs:
            bb = b.T.copy() if kw.get("transpose_b") else b
            got, want = sim_dev.gemm(a, bb, **kw), emu_dev.gemm(a, bb, **kw)
            if kw.get("out") == "bfp":
                assert np.array_equal(got.codes, want.codes) and np.array_equal(got.exponents, want.exponents), kw
            else:
                g, w = np.asarray(got), np.asarray(want)
                view = np.uint16 if kw.get("out") == "bf16" else np.uint32
                assert np.array_equal(g.view(view), w.view(view)), kw
