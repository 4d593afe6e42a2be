"""The protocol's conformance table (``hbfp.host.conformance``) on every byte device: ``emu``
in several configurations (a reduced one, a non-square tile, two-byte codes), the simulated
gateware (``sim``), and an ``emu`` served over TCP driven by a raw socket client. Every
case: the replies (one per complete frame: status, opcode, tag, data size) and the effect
on STATUS's counters. Also: the runner notices a device that answers wrong."""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from collections import Counter

import pytest

from hbfp.host import conformance as K
from hbfp.host import protocol as P
from hbfp.host.emu import EmuDevice
from hbfp.host.protocol import Op, Status

from .conftest import SIM_TOP_ARG, SMALL, open_emu, requires_sim

#: name -> ``emu:`` options. "small" is the configuration tests/test_host_emu.py used for its
#: error statuses (a gradient unit built, a unary one not); "reduced" has none of the
#: optional units and no activation unit; "mxint8" a non-square tile; "codes16" two-byte
#: codes on a 2x2 array without stochastic rounding.
EMU_CONFIGS = {
    "default": "",
    "small": "rows=4,cols=4,size=48,functions=relu+gelu_grad,max_payload=4096,frame_timeout=1000",
    "reduced": "bfp_output=0,value_quantizer=0,stochastic=0,functions=none",
    "mxint8": "format=MXINT8,rows=4,cols=4,size=64,frame_timeout=500",
    "codes16": "rows=2,cols=2,mantissa_bits=12,tile=12x12,size=24,stochastic=0,functions=relu+tanh_grad,"
               "max_payload=700,frame_timeout=300",
}
_TABLES = {name: K.cases(open_emu(spec).identity) for name, spec in EMU_CONFIGS.items()}
_DEVICES: dict[str, EmuDevice] = {}


def emu_device(name: str) -> EmuDevice:
    """One device per configuration for the whole module: cases run on whatever the earlier
    ones left (buffers, counters), as on a real device."""
    if name not in _DEVICES:
        _DEVICES[name] = open_emu(EMU_CONFIGS[name])
    return _DEVICES[name]


def test_the_table():
    """Names are unique; every category of docs/protocol.md's error cases is there; each case
    sends bytes and expects at most one reply per frame it sends; counters follow the
    replies."""
    for name, table in _TABLES.items():
        names = [c.name for c in table]
        assert len(names) == len(set(names)), name
        cats = Counter(c.category for c in table)
        for cat in ("crc", "resync", "version", "opcode", "length", "timeout", "write-address", "write-length",
                    "write-descriptor", "gemm-descriptor", "gemm-length", "read-descriptor", "read-length",
                    "elementwise-descriptor", "elementwise-length", "units", "reset", "b2b"):
            assert cats[cat], (name, cat)
        statuses = {r.status for c in table for r in c.replies}
        assert statuses == set(Status), (name, set(Status) - statuses)
        for c in table:
            assert c.request, c.name
            frames = c.request.count(P.MAGIC)
            assert len(c.replies) <= frames + 1, c.name  # (+1: a frame cut into two writes)
            assert c.counters.refused == sum(r.status != Status.OK for r in c.replies) or c.counters.reset
    # identity-dependent: the reduced device refuses what needs its missing units
    reduced = {c.name: c for c in _TABLES["reduced"]}
    assert reduced["units/gemm-bfp-nearest"].replies[0].status == Status.BAD_DESCRIPTOR
    assert reduced["write-length/a-values-fp32-1"].replies[0].status == Status.BAD_DESCRIPTOR
    full = {c.name: c for c in _TABLES["default"]}
    assert full["units/gemm-bfp-nearest"].replies[0].status == Status.OK
    assert "elementwise-descriptor/unbuilt-relu" in reduced and "elementwise/relu" in full
    print({name: len(t) for name, t in _TABLES.items()})


@pytest.mark.parametrize("name,case", [pytest.param(name, case, id=f"{name}:{case.name}")
                                       for name, table in _TABLES.items() for case in table])
def test_emu(name, case):
    dev = emu_device(name)
    K.run_case(dev, case, dev.identity)


# ---- the runner catches a device that answers wrong ----------------------------------------------


class Tampered:
    """An EmuDevice whose reply bytes pass through ``edit`` (a list of frames -> bytes)."""

    def __init__(self, edit):
        self.dev = open_emu(EMU_CONFIGS["small"])
        self.identity = self.dev.identity
        self.edit = edit
        self.parser = P.FrameParser(max_payload=1 << 30)

    def write(self, data):
        self.dev.write(data)

    def advance(self, cycles):
        self.dev.advance(cycles)

    def read(self):
        frames = [f for f in self.parser.feed(self.dev.read()) if isinstance(f, P.Frame)]
        return self.edit(frames)


def _encode(frames) -> bytes:
    return b"".join(P.encode_frame(f.opcode, f.tag, f.payload, version=f.version) for f in frames)


def _case(name):
    return next(c for c in _TABLES["small"] if c.name == name)


def test_the_runner_notices_wrong_replies():
    def status_bad_length_as_descriptor(frames):
        return _encode(P.Frame(f.opcode, f.tag, bytes([Status.BAD_DESCRIPTOR]) + f.payload[1:])
                       if f.payload[:1] == bytes([Status.BAD_LENGTH]) else f for f in frames)

    def drop_errors(frames):
        return _encode(f for f in frames if f.payload[:1] in (b"\0",))

    def wrong_tag(frames):
        return _encode(P.Frame(f.opcode, f.tag ^ 1, f.payload) if f.tag != K.STATUS_TAG else f for f in frames)

    def status_forgets_itself(frames):
        out = []
        for f in frames:
            if f.opcode == Op.STATUS | P.REPLY and len(f.payload) == 17:
                acc, ref, cyc, last = struct.unpack_from("<IIIB", f.payload, 1)
                f = P.Frame(f.opcode, f.tag, b"\0" + P.encode_status(P.DeviceStatus(acc - 1, ref, cyc, Status(last))))
            out.append(f)
        return _encode(out)

    def bad_reply_crc(frames):
        data = bytearray(_encode(frames))
        if data:
            data[-1] ^= 1
        return bytes(data)

    def error_with_data(frames):
        return _encode(P.Frame(f.opcode, f.tag, f.payload + b"x") if f.payload[:1] != b"\0" else f for f in frames)

    for edit, name, match, harmless in [
        (status_bad_length_as_descriptor, "length/identify-payload", "BAD_DESCRIPTOR.*expected BAD_LENGTH", True),
        (drop_errors, "opcode/0x00", "0 replies, expected 1", True),
        (wrong_tag, "b2b/three", "tag", False),
        (status_forgets_itself, "reset/clears-counters", "STATUS after: accepted 0", False),
        (bad_reply_crc, "gemm/valid-fp32", "STATUS (before|after)|CRC", False),
        (error_with_data, "opcode/0x08", "bytes of data, expected 0", True),
    ]:
        dev = Tampered(edit)
        with pytest.raises(K.ConformanceError, match=match):
            K.run_case(dev, _case(name), dev.identity)
        if harmless:  # the same device passes a case its tampering does not touch
            K.run_case(dev, _case("write/acc"), dev.identity)


def test_the_runner_notices_a_device_that_times_out_early_or_never():
    case = _case("timeout/cut-12")

    class Early:
        """Replies TIMEOUT at a quarter of frame_timeout."""

        def __init__(self):
            self.dev = EmuDevice(**{**_emu_kwargs("small"), "frame_timeout": 250})
            self.identity = self.dev.identity

        def write(self, data):
            self.dev.write(data)

        def read(self):
            return self.dev.read()

        def advance(self, cycles):
            self.dev.advance(cycles)

    dev = Early()
    small = open_emu(EMU_CONFIGS["small"]).identity
    with pytest.raises(K.ConformanceError, match="after step 2"):
        K.run_case(dev, case, small)
    never = open_emu(EMU_CONFIGS["small"])
    never.advance = lambda cycles: None  # time never passes
    with pytest.raises(K.ConformanceError, match="after step 3.*0 replies, expected 1"):
        K.run_case(never, case, never.identity, patience=10_000)


def _emu_kwargs(name: str) -> dict:
    from hbfp.host.emu import parse_options

    return parse_options(EMU_CONFIGS[name])


# ---- sim: the gateware ----------------------------------------------------------------------------


def _sim_identity() -> P.Identity:
    from hbfp.contract import DeviceSpec
    from hbfp.sim.device import SIM_OPTIONS, parse_arg

    opts = parse_arg(SIM_TOP_ARG)
    return DeviceSpec.from_options({k: v for k, v in opts.items() if k not in SIM_OPTIONS}).identity()


def _report(failures) -> str:
    return "\n".join(str(e) for _, e in failures)


@requires_sim
def test_sim(sim_top):
    """The whole table on the gateware (the simulated top of ``SIM_TOP_ARG``). STATUS's
    last_cycles is compared only where no GEMM or READ ran."""
    ident = K.identify(sim_top)
    assert ident == _sim_identity()
    table = K.cases(ident)
    t0 = time.perf_counter()
    failures = K.run_cases(sim_top, table, ident)
    print(f"sim: {len(table)} cases in {time.perf_counter() - t0:.1f} s, {sim_top.cycles} cycles")
    assert not failures, f"{len(failures)} of {len(table)} cases differ on sim:\n{_report(failures)}"


@requires_sim
@pytest.mark.skipif(not any(os.environ.get(v, "") not in ("", "0") for v in ("HBFP_SIM_FULL", "HBFP_FUZZ_FULL")),
                    reason="the default top takes minutes to build and about 15 M cycles: HBFP_SIM_FULL=1")
def test_sim_default_top():
    """The whole table on the default top (``sim`` with no options: 8x8, 96x96 buffers, every
    unit, a frame timeout of 2**20 cycles)."""
    from hbfp.sim.device import backend

    with backend.open("", progress=lambda msg: print(msg, flush=True)) as dev:
        ident = K.identify(dev)
        table = K.cases(ident)
        failures = K.run_cases(dev, table, ident)
    assert not failures, f"{len(failures)} of {len(table)} cases differ on the default top:\n{_report(failures)}"


# ---- TCP: a served emu, a raw socket client ---------------------------------------------------------


class SocketDevice:
    """A raw TCP client as a byte device: ``write`` sends; ``read`` returns what has arrived
    (waiting ``poll`` seconds at most); ``advance(cycles)`` lets ``cycles`` of the device's
    clock pass (the server turns wall time into cycles), or less once bytes arrive, as
    ``SimDevice.advance`` stops at a reply."""

    def __init__(self, host: str, port: int, cycles_per_second: float, poll: float = 0.005):
        self.sock = socket.create_connection((host, port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.cps, self.poll = cycles_per_second, poll
        self.buf = bytearray()

    def _pull(self, timeout: float) -> bool:
        r, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        if not r:
            return False
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buf += data
        return True

    def write(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read(self) -> bytes:
        while self._pull(0 if self.buf else self.poll):
            pass
        out = bytes(self.buf)
        self.buf.clear()
        return out

    def advance(self, cycles: int) -> None:
        end = time.monotonic() + cycles / self.cps
        while not self.buf and time.monotonic() < end:
            self._pull(end - time.monotonic())

    def close(self) -> None:
        self.sock.close()


def test_tcp():
    """The whole table through a ``Server`` serving an emu on 127.0.0.1 (the device's clock
    is the server's wall clock: frame_timeout 10 M cycles at the nominal 100 MHz, 0.1 s)."""
    from hbfp.host.server import Server
    from hbfp.contract import CoreConfig

    emu = EmuDevice(CoreConfig(**SMALL, functions=("relu", "gelu", "relu_grad")), frame_timeout=10_000_000)
    ident = emu.identity
    table = K.cases(ident)
    with Server(emu, "127.0.0.1", 0).start() as server:
        client = SocketDevice(server.host, server.port, emu.cycles_per_second)
        try:
            assert K.identify(client, patience_cycles=10 ** 9, step=10 ** 6) == ident
            t0 = time.perf_counter()
            failures = K.run_cases(client, table, ident, patience=40 * ident.frame_timeout)
            print(f"tcp: {len(table)} cases in {time.perf_counter() - t0:.1f} s")
        finally:
            client.close()
    assert not failures, f"{len(failures)} of {len(table)} cases differ over TCP:\n{_report(failures)}"

