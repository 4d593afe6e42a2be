"""Byte transports between the host driver and a device, and servers (TCP, pseudo-terminal) for any byte
device. One driver (``hbfp.host.device.Device``) runs over all of them (STYLE.md: Glasgow's
one interface, several pipes).

A ``Transport`` moves bytes: ``send(data)``, ``receive(timeout) -> bytes`` (whatever has
arrived, at least one byte, or ``b""`` once ``timeout`` seconds have passed), ``close()``.

A *byte device* is an in-process device: ``write(data)``, ``read(max_bytes=None)`` (the
bytes it has produced so far, maybe none) and ``advance(cycles)`` (its clock runs with no
input; how a begun frame times out), plus ``cycles_per_second`` (the rate at which waiting
time becomes cycles). ``EmuDevice`` is one; the simulator device is another. ``Server``
serves one on a TCP port, ``PtyServer`` on a pseudo-terminal (a serial port).
"""

from __future__ import annotations

import os
import random
import select
import socket
import threading
import time

from . import protocol as P
from .errors import LinkError, Timeout

__all__ = [
    "Transport",
    "LoopbackTransport",
    "TcpTransport",
    "SerialTransport",
    "FaultyTransport",
    "TransportDevice",
    "Server",
    "PtyServer",
    "serve",
    "serve_fd",
    "is_byte_device",
    "tcp_backend",
    "serial_backend",
]


def is_byte_device(obj) -> bool:
    return all(callable(getattr(obj, name, None)) for name in ("write", "read"))


class Transport:
    """A byte pipe to a device."""

    #: True when bytes travel while the host waits (a socket, a UART): sending the next
    #: request before the previous reply has arrived overlaps transfers with compute.
    streaming = True
    #: True when the link holds a sender back while the device cannot take bytes (a socket,
    #: the simulator). A UART has no flow control: what the board's receive FIFO cannot hold
    #: is lost, so the driver does not pipeline requests over it by default.
    flow_control = True

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
    """A transport seen as a byte device (so that ``serve`` can relay a remote device)."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self.cycles_per_second = 100_000_000

    def write(self, data: bytes) -> None:
        self.transport.send(data)

    def read(self, max_bytes: int | None = None) -> bytes:
        return self.transport.receive(0.0)

    def advance(self, cycles: int) -> None:
        pass

    def close(self) -> None:
        self.transport.close()


# ---- serving a byte device -------------------------------------------------------------


def _pump(device, fileno: int, recv, send, stop: threading.Event, poll: float, idle_timeout: float | None) -> None:
    """Relay bytes between a file descriptor and a byte device until the peer closes, ``stop``
    is set or ``idle_timeout`` seconds pass without a byte. Never blocks on a send: bytes
    for the peer are queued while requests keep being read (no deadlock with a host that
    sends ahead)."""
    out = bytearray()
    cps = getattr(device, "cycles_per_second", 100_000_000)
    advance = getattr(device, "advance", None)
    last_tick = last_byte = time.monotonic()
    while not stop.is_set():
        try:
            r, w, _ = select.select([fileno], [fileno] if out else [], [], poll)
        except (OSError, ValueError):
            return
        now = time.monotonic()
        if r:
            try:
                data = recv()
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                return
            if data == b"":
                return  # the peer closed
            if data:
                device.write(data)
                last_tick = last_byte = now
        elif advance is not None:
            cycles = int((now - last_tick) * cps)
            if cycles > 0:
                advance(cycles)
                last_tick = now
        out += device.read()
        if out:
            try:
                n = send(bytes(out[: 1 << 16]))
                del out[:n]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                return
        if idle_timeout is not None and not out and now - last_byte > idle_timeout:
            return


class _Serving:
    """Runs ``run()`` on a daemon thread: ``start()``, ``stop()``, and a ``with`` block."""

    _thread: threading.Thread | None = None

    def run(self) -> None:
        raise NotImplementedError

    def _thread_name(self) -> str:
        raise NotImplementedError

    def _stopped_before_start(self) -> None:
        """Release what ``__init__`` took when ``stop`` comes before ``start``."""

    def start(self):
        self._thread = threading.Thread(target=self.run, name=self._thread_name(), daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self._stopped_before_start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class Server(_Serving):
    """Serves a byte device on a local TCP port, one connection at a time.

    ``Server(device, "127.0.0.1", 0)`` binds at once (port 0: an ephemeral port, see
    ``port``/``spec``). ``run()`` serves in this thread, ``start()`` in a background one.
    It stops by itself after ``connections`` connections (None: no limit), after
    ``idle_timeout`` seconds without a client or a byte (None: never), or on ``stop()``."""

    def __init__(self, device, host: str = "127.0.0.1", port: int = 0, *, connections: int | None = None,
                 idle_timeout: float | None = None, poll: float = 0.005):
        if not is_byte_device(device):
            raise TypeError(f"serve needs a byte device (write/read), got {type(device).__name__}")
        self.device = device
        self.connections = connections
        self.idle_timeout = idle_timeout
        self.poll = poll
        self.sock = socket.create_server((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.served = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def spec(self) -> str:
        return f"tcp:{self.host}:{self.port}"

    def run(self) -> None:
        try:
            idle_since = time.monotonic()
            while not self._stop.is_set() and (self.connections is None or self.served < self.connections):
                r, _, _ = select.select([self.sock], [], [], 0.05)
                if not r:
                    if self.idle_timeout is not None and time.monotonic() - idle_since > self.idle_timeout:
                        return
                    continue
                conn, _ = self.sock.accept()
                self.served += 1
                with conn:
                    conn.setblocking(False)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    _pump(self.device, conn.fileno(), lambda c=conn: c.recv(1 << 16), conn.send, self._stop,
                          self.poll, self.idle_timeout)
                idle_since = time.monotonic()
        finally:
            self.sock.close()

    def _thread_name(self) -> str:
        return f"hbfp-serve-{self.port}"


class PtyServer(_Serving):
    """Serves a byte device on a pseudo-terminal: a serial port for ``serial:`` clients
    (``hbfp.host.open(server.spec)``), as a board's UART appears to the host.

    ``PtyServer(device)`` opens the pair at once (``path``: the terminal to open, e.g.
    ``/dev/pts/5``; ``spec``: ``serial:`` and that path) and puts the terminal in raw mode
    (no echo, no line editing, no newline translation: every byte passes as it is). It keeps
    the terminal open itself, so clients may come and go: bytes are relayed between the
    master side and the device until ``stop()``, or until ``idle_timeout`` seconds pass
    without a byte (None: never). ``run()`` serves in this thread, ``start()`` in a
    background one. Unlike a TCP client, a client leaving is not seen: a request it left
    half-sent times out on the device (a ``TIMEOUT`` reply the next client ignores)."""

    def __init__(self, device, *, idle_timeout: float | None = None, poll: float = 0.005):
        import tty

        if not is_byte_device(device):
            raise TypeError(f"serve needs a byte device (write/read), got {type(device).__name__}")
        self.device = device
        self.idle_timeout = idle_timeout
        self.poll = poll
        self.master, self.slave = os.openpty()
        try:
            tty.setraw(self.slave)
            self.path = os.ttyname(self.slave)
        except OSError:
            self._close_fds()
            raise
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def spec(self) -> str:
        return f"serial:{self.path}"

    def run(self) -> None:
        try:
            serve_fd(self.device, self.master, stop=self._stop, poll=self.poll, idle_timeout=self.idle_timeout)
        finally:
            self._close_fds()

    def _thread_name(self) -> str:
        return f"hbfp-serve-{self.path}"

    def _stopped_before_start(self) -> None:
        self._close_fds()

    def _close_fds(self) -> None:
        for name in ("slave", "master"):
            fd = getattr(self, name, None)
            if fd is not None:
                setattr(self, name, None)
                try:
                    os.close(fd)
                except OSError:
                    pass


def serve(device, host: str = "127.0.0.1", port: int = 0, **options) -> None:
    """Serve a byte device on ``host:port`` in this thread (``Server`` options)."""
    Server(device, host, port, **options).run()


def serve_fd(device, fd: int, *, stop: threading.Event | None = None, poll: float = 0.005,
             idle_timeout: float | None = None) -> None:
    """Serve a byte device on a file descriptor (a pseudo-terminal's master side, a pipe):
    until the other side closes, ``stop`` is set, or ``idle_timeout`` seconds pass."""
    os.set_blocking(fd, False)
    _pump(device, fd, lambda: os.read(fd, 1 << 16), lambda b: os.write(fd, b), stop or threading.Event(), poll,
          idle_timeout)


# ---- backends (entry points ``hbfp.devices: tcp, serial``) -----------------------------------


class _TcpBackend:
    """``tcp:HOST:PORT``: a device (a board's bridge, ``hbfp sim-server``) on a TCP port."""

    ABI_VERSION = P.ABI_VERSION
    description = "a device served on a TCP port (hbfp sim-server, a board's network bridge)"

    def open(self, arg: str, **options) -> TcpTransport:
        return TcpTransport(arg, **options)


class _SerialBackend:
    """``serial:PORT[:BAUD]``: a device on a serial port (pyserial)."""

    ABI_VERSION = P.ABI_VERSION
    description = "a device on a serial port (pyserial), serial:PORT[:BAUD]"

    def open(self, arg: str, **options) -> SerialTransport:
        return SerialTransport(arg, **options)


tcp_backend = _TcpBackend()
serial_backend = _SerialBackend()
