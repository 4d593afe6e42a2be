"""Byte transports between the host driver and a device. One driver (``hbfp.host.device.Device``)
runs over all of them (as Glasgow's applets: one interface, several pipes); the servers that put
a byte device on a TCP port or a pseudo-terminal are ``hbfp.host.server``.

A ``Transport`` moves bytes: ``send(data)``, ``receive(timeout) -> bytes`` (whatever has
arrived, at least one byte, or ``b""`` once ``timeout`` seconds have passed), ``close()``.

A *byte device* is an in-process device: ``write(data)``, ``read(max_bytes=None)`` (the
bytes it has produced so far, maybe none) and ``advance(cycles)`` (its clock runs with no
input; how a begun frame times out), plus ``cycles_per_second`` (the rate at which waiting
time becomes cycles). ``EmuDevice`` is one; the simulator device is another.
"""

from __future__ import annotations

import random
import select
import socket
import time

from . import datagrams as D
from . import protocol as P
from .errors import LinkError, Timeout

__all__ = [
    "Transport",
    "LoopbackTransport",
    "TcpTransport",
    "UdpTransport",
    "SerialTransport",
    "FaultyTransport",
    "DatagramTransport",
    "TransportDevice",
    "is_byte_device",
    "is_datagram_device",
    "tcp_backend",
    "udp_backend",
    "serial_backend",
]


def is_byte_device(obj) -> bool:
    return all(callable(getattr(obj, name, None)) for name in ("write", "read"))


def is_datagram_device(obj) -> bool:
    """An in-process device on a network link: ``send_datagram(payload)``,
    ``receive_datagrams(budget_cycles)`` (the UDP payloads it sent, running its clock at most
    that long for them), ``advance(cycles)``, ``cycles_per_second`` (``hbfp.sim.network``)."""
    return all(callable(getattr(obj, name, None)) for name in ("send_datagram", "receive_datagrams"))


class Transport:
    """A byte pipe to a device."""

    #: True when bytes travel while the host waits (a socket, a UART): sending the next
    #: request before the previous reply has arrived overlaps transfers with compute.
    streaming = True
    #: True when the link holds a sender back while the device cannot take bytes (a socket,
    #: the simulator). A UART has no flow control: what the board's receive FIFO cannot hold
    #: is lost, so the driver does not pipeline requests over it by default.
    flow_control = True
    #: Request bytes the device holds unanswered, where the link does not hold the sender back
    #: but the device says how much it buffers (a network link: ``datagrams.WINDOW``): the
    #: driver keeps no more in flight. None: no limit.
    window: int | None = None

    def send(self, data: bytes) -> None:
        raise NotImplementedError

    def receive(self, timeout: float) -> bytes:
        """Bytes that have arrived (at least one), or ``b""`` after ``timeout`` seconds."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class LoopbackTransport(Transport):
    """An in-process byte device (``EmuDevice``, the simulator device) as a transport.

    The device answers while ``send`` runs; ``receive`` returns what it produced. When there
    is nothing, the time the host would wait passes on the device's clock instead
    (``advance(timeout * cycles_per_second)``, in steps of ``step_cycles`` if given), so a
    truncated frame times out on the device as it would on a board, without real waiting."""

    streaming = False

    def __init__(self, device, *, step_cycles: int | None = None):
        if not is_byte_device(device):
            raise TypeError(f"LoopbackTransport needs a byte device (write/read), got {type(device).__name__}")
        self.device = device
        self.step_cycles = step_cycles

    def send(self, data: bytes) -> None:
        self.device.write(bytes(data))

    def receive(self, timeout: float) -> bytes:
        data = self.device.read()
        if data or not hasattr(self.device, "advance"):
            return data
        budget = int(max(0.0, timeout) * getattr(self.device, "cycles_per_second", 100_000_000))
        deadline = time.monotonic() + max(0.0, timeout)
        while budget > 0:
            step = budget if self.step_cycles is None else min(budget, self.step_cycles)
            self.device.advance(step)
            budget -= step
            data = self.device.read()
            if data or time.monotonic() > deadline:
                break
        return data

    def close(self) -> None:
        close = getattr(self.device, "close", None)
        if close:
            close()


def _split_host_port(arg: str) -> tuple[str, int]:
    host, sep, port = arg.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {arg!r}")
    if not 0 < int(port) < 65536:
        raise ValueError(f"a port is a number 1 .. 65535, got {port} in {arg!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


class TcpTransport(Transport):
    """A TCP connection: ``TcpTransport("127.0.0.1:7000")`` (or ``"tcp:127.0.0.1:7000"``)."""

    def __init__(self, address: str, *, connect_timeout: float = 5.0, send_timeout: float = 30.0):
        if address.startswith("tcp:"):
            address = address[4:]
        self.address = _split_host_port(address)
        try:
            self.sock = socket.create_connection(self.address, timeout=connect_timeout)
        except OSError as e:
            raise LinkError(f"cannot connect to tcp:{self.address[0]}:{self.address[1]}: {e}") from e
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(send_timeout)

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except socket.timeout as e:
            raise Timeout(f"tcp:{self.address[0]}:{self.address[1]}: the device stopped taking bytes") from e
        except OSError as e:
            raise LinkError(f"tcp:{self.address[0]}:{self.address[1]}: {e}") from e

    def receive(self, timeout: float) -> bytes:
        r, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        if not r:
            return b""
        try:
            data = self.sock.recv(1 << 16)
        except OSError as e:
            raise LinkError(f"tcp:{self.address[0]}:{self.address[1]}: {e}") from e
        if not data:
            raise LinkError(f"tcp:{self.address[0]}:{self.address[1]}: the device closed the connection")
        return data

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class UdpTransport(Transport):
    """UDP datagrams to a device on a network (a board's Ethernet link, ``hbfp sim-server
    --udp``): ``UdpTransport("192.168.1.50:7000")`` (or ``"udp:..."``). The stream goes in
    numbered datagrams (``hbfp.host.datagrams``: at most 1,472 bytes each, ``SYNC`` until the
    first reply and after a wait that brought none: ``resync``); replies out of order or
    duplicated are dropped, lost ones leave a gap that the
    protocol's CRC, timeout and retry recover. The driver pipelines over it as over TCP, with
    at most ``window`` (``datagrams.WINDOW``) request bytes unanswered: what the device buffers."""

    window = D.WINDOW

    def __init__(self, address: str, *, receive_buffer: int = 1 << 22):
        if address.startswith("udp:"):
            address = address[4:]
        self.address = _split_host_port(address)
        self.name = f"udp:{self.address[0]}:{self.address[1]}"
        try:
            family, kind, proto, _, target = socket.getaddrinfo(*self.address, type=socket.SOCK_DGRAM)[0]
            self.sock = socket.socket(family, kind, proto)
        except OSError as e:
            raise LinkError(f"cannot open {self.name}: {e}") from e
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
            self.sock.connect(target)  # datagrams from this address only
        except OSError as e:
            self.sock.close()
            raise LinkError(f"cannot open {self.name}: {e}") from e
        self.numbering = D.Numbering()
        self.sequence = D.Sequence()
        self.resync = True  # SYNC: until the device answers, and after a wait it did not

    def send(self, data: bytes) -> None:
        flags = D.SYNC if self.resync else 0
        try:
            for datagram in self.numbering.datagrams(bytes(data), flags):
                self.sock.send(datagram)
        except ConnectionRefusedError as e:
            raise LinkError(f"{self.name}: nothing listens there (the port is closed)") from e
        except OSError as e:
            raise LinkError(f"{self.name}: {e}") from e

    def receive(self, timeout: float) -> bytes:
        deadline = time.monotonic() + max(0.0, timeout)
        got = bytearray()
        wait = max(0.0, timeout)
        while True:
            r, _, _ = select.select([self.sock], [], [], wait)
            if not r:
                self.resync = self.resync or (not got and timeout > 0)
                return bytes(got)
            try:
                datagram = self.sock.recv(1 << 16)
            except ConnectionRefusedError as e:
                raise LinkError(f"{self.name}: nothing listens there (the port is closed)") from e
            except OSError as e:
                raise LinkError(f"{self.name}: {e}") from e
            parts = D.unpack(datagram)
            if parts is not None and self.sequence.take(parts[0], parts[1]):
                got += parts[2]
                self.resync = False
            # whatever else has arrived already, then back to the caller
            wait = 0.0 if got else max(0.0, deadline - time.monotonic())
            if not got and wait == 0.0:
                self.resync = self.resync or timeout > 0
                return b""

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class DatagramTransport(Transport):
    """A datagram device (``is_datagram_device``: the simulated board on its network link,
    ``sim:link=eth``) as a transport: the stream in numbered datagrams as ``UdpTransport`` sends
    them, the device's datagrams taken by the same rule; the time the host waits passes on the
    device's clock. ``datagrams``: the device (what ``hbfp sim-server --udp`` bridges). At most
    ``window`` request bytes unanswered, as over ``udp:``."""

    streaming = False
    window = D.WINDOW

    def __init__(self, device):
        if not is_datagram_device(device):
            raise TypeError(f"DatagramTransport needs a datagram device, got {type(device).__name__}")
        self.datagrams = device
        self.numbering = D.Numbering()
        self.sequence = D.Sequence()
        self.resync = True  # SYNC: until the device answers, and after a wait it did not

    def send(self, data: bytes) -> None:
        flags = D.SYNC if self.resync else 0
        for datagram in self.numbering.datagrams(bytes(data), flags):
            self.datagrams.send_datagram(datagram)

    def receive(self, timeout: float) -> bytes:
        """The stream bytes of the datagrams taken, at least one, or ``b""`` once ``timeout``
        seconds of the device's clock have passed (its ``receive_datagrams`` returns early when
        the link is quiet: the clock, ``cycles``, says how much time that was)."""
        budget = int(max(0.0, timeout) * getattr(self.datagrams, "cycles_per_second", 1_000_000))
        got = bytearray()
        while True:
            start = getattr(self.datagrams, "cycles", None)
            for datagram in self.datagrams.receive_datagrams(budget):
                parts = D.unpack(datagram)
                if parts is not None and self.sequence.take(parts[0], parts[1]):
                    got += parts[2]
                    self.resync = False
            spent = budget if start is None else self.datagrams.cycles - start
            if got or spent <= 0 or spent >= budget:
                self.resync = self.resync or (not got and timeout > 0)
                return bytes(got)
            budget -= spent

    def advance(self, cycles: int) -> None:
        """``cycles`` of the device's clock pass (a host idle: how a begun frame times out)."""
        self.datagrams.advance(cycles)

    def close(self) -> None:
        close = getattr(self.datagrams, "close", None)
        if close:
            close()


class SerialTransport(Transport):
    """A serial port through pyserial: ``SerialTransport("/dev/ttyUSB0:115200")`` (or
    ``"serial:..."``; the baud rate defaults to 115200). Any pyserial URL works too
    (``loop://``, ``socket://host:port``, ``rfc2217://...``). No flow control: ``Device``
    sends one heavy request at a time over it unless told ``pipeline=True``."""

    flow_control = False

    def __init__(self, port: str, baudrate: int | None = None):
        import serial  # pyserial: only needed for this transport

        if port.startswith("serial:"):
            port = port[len("serial:") :]
        head, sep, tail = port.rpartition(":")
        if baudrate is None and sep and tail.isdigit() and "://" not in port:
            port, baudrate = head, int(tail)
        self.port_name = port
        try:
            self.port = serial.serial_for_url(port, baudrate=baudrate or 115200, timeout=0, write_timeout=30)
        except (serial.SerialException, ValueError) as e:
            raise LinkError(f"cannot open serial port {port}: {e}") from e
        self.port.reset_input_buffer()  # bytes of an earlier session are no replies of ours

    def send(self, data: bytes) -> None:
        import serial

        try:
            self.port.write(data)
        except serial.SerialTimeoutException as e:
            raise Timeout(f"serial {self.port_name}: the device stopped taking bytes") from e
        except serial.SerialException as e:
            raise LinkError(f"serial {self.port_name}: {e}") from e

    def receive(self, timeout: float) -> bytes:
        import serial

        try:
            self.port.timeout = max(0.0, timeout)
            data = self.port.read(1)
            if data:
                waiting = self.port.in_waiting
                if waiting:
                    self.port.timeout = 0
                    data += self.port.read(waiting)
        except serial.SerialException as e:
            raise LinkError(f"serial {self.port_name}: {e}") from e
        return data

    def close(self) -> None:
        try:
            self.port.close()
        except Exception:  # noqa: BLE001 - closing a port that failed is not an error
            pass


class FaultyTransport(Transport):
    """A transport that damages the link, for tests of the driver's recovery.

    Random faults: ``drop`` (each byte sent is lost with this probability) and
    ``drop_received`` (each byte received). One-shot faults, each applied to the next frames
    sent (the driver sends one frame per ``send``): ``corrupt_next`` (flip a bit of the
    payload or CRC), ``truncate_next`` (send only the first half), ``duplicate_next`` (send it
    twice). ``mute``: drop everything sent and received (a device that stopped answering)."""

    def __init__(self, inner: Transport, *, drop: float = 0.0, drop_received: float = 0.0, seed: int = 0):
        self.inner = inner
        self.drop = drop
        self.drop_received = drop_received
        self.rng = random.Random(seed)
        self.corrupt_next = 0
        self.truncate_next = 0
        self.duplicate_next = 0
        self.mute = False
        self.streaming = inner.streaming

    def _lose(self, data: bytes, p: float) -> bytes:
        if p <= 0 or not data:
            return data
        return bytes(b for b in data if self.rng.random() >= p)

    def send(self, data: bytes) -> None:
        data = bytearray(data)
        if self.mute:
            return
        if self.corrupt_next:
            self.corrupt_next -= 1
            i = self.rng.randrange(P.HEADER.size, len(data))  # the payload or the CRC
            data[i] ^= 1 << self.rng.randrange(8)
        if self.truncate_next:
            self.truncate_next -= 1
            data = data[: len(data) // 2]
        if self.duplicate_next:
            self.duplicate_next -= 1
            data = data + data
        self.inner.send(self._lose(bytes(data), self.drop))

    def receive(self, timeout: float) -> bytes:
        if self.mute:
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                self.inner.receive(min(left, 0.05))  # swallow whatever still arrives
            return b""
        data = self.inner.receive(timeout)
        return self._lose(data, self.drop_received)

    def close(self) -> None:
        self.inner.close()


class TransportDevice:
    """A transport seen as a byte device (so that ``serve`` can relay a remote device, and the
    conformance table's runner drive one): ``read`` takes what has arrived without waiting;
    ``advance`` lets the device's clock run where the transport has one (``DatagramTransport``)."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self.cycles_per_second = 100_000_000

    def write(self, data: bytes) -> None:
        self.transport.send(data)

    def read(self, max_bytes: int | None = None) -> bytes:
        return self.transport.receive(0.0)

    def advance(self, cycles: int) -> None:
        advance = getattr(self.transport, "advance", None)
        if advance is not None:
            advance(cycles)

    def close(self) -> None:
        self.transport.close()


# ---- backends (entry points ``hbfp.devices: tcp, serial``) -----------------------------------


class _TcpBackend:
    """``tcp:HOST:PORT``: a device (a board's bridge, ``hbfp sim-server``) on a TCP port."""

    ABI_VERSION = P.ABI_VERSION
    description = "a device served on a TCP port (hbfp sim-server, a board's network bridge)"

    def open(self, arg: str, **options) -> TcpTransport:
        return TcpTransport(arg, **options)


class _UdpBackend:
    """``udp:HOST:PORT``: a device on a network (a board's Ethernet link, ``hbfp sim-server --udp``)."""

    ABI_VERSION = P.ABI_VERSION
    description = "a device on a network, UDP datagrams (a board's Ethernet link, hbfp sim-server --udp)"

    def open(self, arg: str, **options) -> UdpTransport:
        return UdpTransport(arg, **options)


class _SerialBackend:
    """``serial:PORT[:BAUD]``: a device on a serial port (pyserial)."""

    ABI_VERSION = P.ABI_VERSION
    description = "a device on a serial port (pyserial), serial:PORT[:BAUD]"

    def open(self, arg: str, **options) -> SerialTransport:
        return SerialTransport(arg, **options)


tcp_backend = _TcpBackend()
udp_backend = _UdpBackend()
serial_backend = _SerialBackend()
