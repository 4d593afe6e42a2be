"""Byte transports between the host driver and a device, and servers (TCP, pseudo-terminal) for any byte
device. One driver (``hbfp.host.device.Device``) runs over all of them (STYLE.md: Glasgow's
one interface, several pipes).

A ``Transport`` moves bytes: ``send(data)``, ``receive(timeout) -> bytes`` (whatever has
arrived, at least one byte, or ``b""`` once ``timeout`` seconds have passed), ``close()``.

A *byte device* is an in-process device: ``write(data)``, ``read(max_bytes=None)`` (the
bytes it has produced so far, maybe none) and ``advance(cycles)`` (its clock runs with no
input; how a begun frame times out), plus ``cycles_per_second`` (the rate at which waiting
time becomes cycles). ``EmuDevice`` is one; the simulator device is another. ``Server``
serves one on a TCP port to several clients at once, each in a session of its own (its
frames, its buffers, its STATUS; bounded queues, idle clients dropped); ``PtyServer`` serves
one on a pseudo-terminal (a serial port) to one peer.
"""

from __future__ import annotations

import os
import random
import select
import selectors
import socket
import threading
import time
from collections import deque

import numpy as np

from . import protocol as P
from .emu import Buffers
from .errors import LinkError, Timeout
from .protocol import Op, Status, Target

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


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host`` (a name, an IPv4 or IPv6 address; ``::``: every
    address, IPv4 too where the system allows both on one socket) and ``port``."""
    if host == "::" and socket.has_dualstack_ipv6():
        return socket.create_server((host, port), family=socket.AF_INET6, dualstack_ipv6=True)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    return socket.create_server(address[:2], family=family)


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


# ---- several TCP clients on one device -------------------------------------------------

#: Commands that read or change the device's buffers: the session's buffer contents are put
#: back on the device before one of these runs (``Server``, "Sessions").
_STATEFUL = frozenset({Op.WRITE, Op.READ, Op.GEMM, Op.RESET})
#: Device time one session may take while others wait: the turn then passes to the next.
_TURN_SECONDS = 0.02
#: Most bytes handed to one ``send`` call on a client socket.
_SEND_CHUNK = 1 << 18
#: What a frame waiting for the device costs beyond its payload (the ``Frame`` object): a
#: client's waiting frames are counted so against ``max_queued``, or a flood of small
#: requests would queue hundreds of thousands of them.
_FRAME_COST = 256
#: ``FrameParser`` removes each frame from the front of its buffer: fed in slices this
#: small, a chunk that holds thousands of small frames costs time in proportion to its size.
_FEED_SLICE = 4096


class _Session:
    """One client connection: its socket, its own frame parser (a device-side one: the device
    itself only ever receives whole frames), the frames waiting for the device, the reply
    bytes not yet sent, the STATUS counters of its own replies, and its buffers."""

    def __init__(self, sock: socket.socket, name: str, ident: P.Identity, now: float):
        self.sock = sock
        self.name = name
        self.parser = P.FrameParser(ident.max_payload, device=True)
        #: In arrival order: a ``P.Frame`` for the device, or ``(status, reply)`` that the
        #: server's parser answered (a frame that failed); replies leave in this order.
        self.inbox: deque = deque()
        self.inbox_bytes = 0
        self.out = bytearray()
        #: Its buffers as they would be had it the device alone since it connected (zeros at
        #: first and after its RESET): what it wrote, and the accumulator its products left,
        #: read back when another session takes the device (``dirty``: the corner its products
        #: changed since it got the device, whole blocks of the array).
        self.buffers = Buffers(ident)
        self.dirty: tuple[int, int] | None = None
        self.last_byte = now  # the frame timeout counts from here
        self.last_progress = now  # the client timeout counts from here
        self.eof = False
        self.told_paused = False
        self.events = 0
        self.clear_counters()

    def clear_counters(self) -> None:
        self.accepted = 0
        self.refused = 0
        self.last_cycles = 0
        self.last_error = Status.OK

    def count(self, status: int) -> None:
        """Count a reply (every reply counts once, as the device counts them)."""
        if status == Status.OK:
            self.accepted += 1
        else:
            self.refused += 1
            if status in Status._value2member_map_:
                self.last_error = Status(status)

    def mid_frame(self) -> bool:
        """A frame has begun and the server reads on: the frame timeout runs."""
        return (self.parser.in_progress or self.parser.skipping) and bool(self.events & selectors.EVENT_READ)

    def has_work(self, max_queued: int) -> bool:
        """A frame waits for the device and the client reads its replies."""
        return bool(self.inbox) and isinstance(self.inbox[0], P.Frame) and len(self.out) < max_queued


class Server(_Serving):
    """Serves a byte device on a local TCP port to several clients at once.

    ``Server(device, "127.0.0.1", 0)`` binds at once (port 0: an ephemeral port, see
    ``port``/``spec``). ``run()`` serves in this thread, ``start()`` in a background one.
    It stops by itself after ``connections`` connections have come and gone (None: no
    limit), after ``idle_timeout`` seconds without a new client or a byte either way (None:
    never), or on ``stop()``. ``log``: called with a one-line message per event that matters
    (a client connected, left or dropped and why, a client paused, a lost reply).

    Sessions. Each connection is a session on the one device, as if it had the device alone:

    - The server splits each client's bytes into frames itself, with a device-side
      ``FrameParser`` of the device's ``max_payload`` (asked by IDENTIFY when ``run`` starts),
      and gives the device one whole frame at a time, waiting for its one reply, which goes
      back to the client that sent the frame: clients never meet inside the device's frame
      parser, and their tags are their own. Frames that the client's parser rejects are
      answered by the server as the device answers them (docs/protocol.md): ``BAD_CRC`` and
      an oversized ``BAD_LENGTH`` echo the frame's opcode and tag, and a frame that stops
      arriving for the device's ``frame_timeout`` (cycles at ``cycles_per_second``, while
      the server reads from the client) gets ``TIMEOUT`` with tag 0xFFFF; none of their
      bytes reach the device. A client that
      leaves, or is dropped, mid-frame leaves nothing behind: its half frame is discarded.
    - Buffers: a product takes several frames (WRITEs, then GEMMs that may accumulate), so
      each session has buffers of its own, as if it had the device alone: zeros when it
      connects and after its RESET, then what its WRITEs put there and what its products
      left in the accumulator (``Buffers``, applied as the device applies each WRITE it
      accepted). Before a WRITE, READ, GEMM or RESET of a session other than the last one to
      use the device, the server reads that session's accumulator back (the blocks its
      products changed) and writes the new session's buffers where they differ (all of them
      when the device's contents are no session's: at first, after a RESET, after that
      session left); ``switches`` counts these hand-overs. A hand-over costs the same however
      many WRITEs made the buffers, and no session reads what another wrote. The frames of
      one session run in the order they came; sessions with frames waiting take turns of
      about 20 ms of device time (``_TURN_SECONDS``).
    - STATUS reports the session's own counters (its replies, the cycles of its last GEMM
      or READ) in the device's reply; RESET also clears the session's counters.
    - Queues are bounded: once a client's unsent replies reach ``max_queued`` bytes, its
      frames stop running and the server stops reading from it until it reads them (a
      client's queue peaks below ``max_queued`` plus one reply; ``peak_queued`` is the most
      any client had). Nor is more read from a client while its frames waiting for the
      device take ``max_queued`` bytes (their payloads and ``_FRAME_COST`` each). At most
      ``max_clients`` clients are served; a client that comes when they are takes the place
      of the one that has sent no complete frame for the longest.
    - ``client_timeout`` (None: never): a connection that sends no complete frame for that
      many seconds, and has none waiting for the device, is closed. Only a whole valid frame
      counts as a sign of life: neither partial frames nor the replies it reads (the server's
      own TIMEOUT replies to its partial frames among them).
    - ``reply_timeout``: a device that sends no byte of a reply for that many seconds has
      lost the frame; the client gets no reply (its driver resends) and serving goes on.
      ``poll``: the seconds between two looks at a device whose reply has not come yet.
    """

    def __init__(self, device, host: str = "127.0.0.1", port: int = 0, *, connections: int | None = None,
                 idle_timeout: float | None = None, client_timeout: float | None = 30.0,
                 max_queued: int = 4 << 20, max_clients: int = 16, reply_timeout: float = 1.0,
                 poll: float = 0.005, log=None):
        if not is_byte_device(device):
            raise TypeError(f"serve needs a byte device (write/read), got {type(device).__name__}")
        self.device = device
        self.connections = connections
        self.idle_timeout = idle_timeout
        self.client_timeout = client_timeout
        self.max_queued = max_queued
        self.max_clients = max_clients
        self.reply_timeout = reply_timeout
        self.poll = poll
        self.log = log
        self.sock = _listening_socket(host, port)
        self.sock.setblocking(False)
        self.host, self.port = self.sock.getsockname()[:2]
        #: Connections served so far.
        self.served = 0
        #: The most reply bytes queued for one client at any time.
        self.peak_queued = 0
        #: Times the device's buffers passed from one session to another.
        self.switches = 0
        #: The device's identity (IDENTIFY when ``run`` starts).
        self.identity: P.Identity | None = None
        self._cps = getattr(device, "cycles_per_second", 100_000_000)
        self._advance = getattr(device, "advance", None)
        self._frame_seconds = 0.0  # the device's frame_timeout (from IDENTIFY) in seconds
        self._replies = P.FrameParser()
        self._tag = 0
        self._sessions: list[_Session] = []
        self._holder: _Session | None = None  # whose buffers the device holds
        self._turn: _Session | None = None
        self._turn_start = 0.0
        self._active = time.monotonic()
        self._listening = True
        self._selector: selectors.BaseSelector | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def spec(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp:{host}:{self.port}"

    def _thread_name(self) -> str:
        return f"hbfp-serve-{self.port}"

    def _stopped_before_start(self) -> None:
        self.sock.close()

    def _say(self, message: str) -> None:
        if self.log is not None:
            self.log(message)

    # ---- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        self._selector = selectors.DefaultSelector()
        try:
            self._identify()
            self._selector.register(self.sock, selectors.EVENT_READ)
            self._active = time.monotonic()
            while not self._stop.is_set():
                busy = any(s.has_work(self.max_queued) for s in self._sessions)
                ready = self._selector.select(0 if busy else self._wait_time(time.monotonic()))
                now = time.monotonic()
                for key, mask in ready:
                    if key.fileobj is self.sock:
                        self._accept(now)
                    elif key.data in self._sessions:
                        self._io(key.data, mask, now)
                self._expire(now)
                s = self._pick(now)
                if s is not None:
                    self._execute(s)
                    self._active = time.monotonic()
                for s in list(self._sessions):
                    self._interest(s)
                if self._finished(time.monotonic()):
                    return
        finally:
            for s in list(self._sessions):
                self._close(s)
            self._selector.close()
            self.sock.close()

    def _finished(self, now: float) -> bool:
        if self.connections is not None and self.served >= self.connections:
            if self._listening:
                self._selector.unregister(self.sock)
                self.sock.close()  # later clients are refused rather than left waiting
                self._listening = False
            if not self._sessions:
                return True
        return self.idle_timeout is not None and now - self._active > self.idle_timeout

    def _wait_time(self, now: float) -> float:
        """How long the loop may sleep in ``select``: until the next partial frame times out."""
        wait = 0.05
        for s in self._sessions:
            if s.mid_frame():
                wait = min(wait, s.last_byte + self._frame_seconds - now)
        return max(0.0, wait)

    # ---- clients -------------------------------------------------------------------------

    def _accept(self, now: float) -> None:
        try:
            conn, addr = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        name = f"[{addr[0]}]:{addr[1]}" if ":" in addr[0] else f"{addr[0]}:{addr[1]}"
        if len(self._sessions) >= self.max_clients:
            # The longest without a complete frame makes room (so connections that send none
            # cannot keep every client out).
            idle = min(self._sessions, key=lambda s: s.last_progress)
            self._drop(idle, f"dropped for {name}: {self.max_clients} clients are connected and it sent no complete "
                             f"frame for the longest ({now - idle.last_progress:.1f} s)")
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.served += 1
        self._active = now
        self._sessions.append(_Session(conn, name, self.identity, now))
        self._say(f"{name} connected ({len(self._sessions)} client(s))")

    def _io(self, s: _Session, mask: int, now: float) -> None:
        if mask & selectors.EVENT_READ:
            try:
                data = s.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError as e:
                self._drop(s, f"left ({e.strerror or e})")
                return
            if data == b"":
                self._end_of_input(s)
            elif data:
                s.last_byte = self._active = now
                for i in range(0, len(data), _FEED_SLICE):
                    for item in s.parser.feed(data[i : i + _FEED_SLICE]):
                        self._parsed(s, item, now)
        if mask & selectors.EVENT_WRITE and s.out:
            try:
                n = s.sock.send(s.out[:_SEND_CHUNK])
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                self._drop(s, f"left ({e.strerror or e})")
                return
            if n:
                del s.out[:n]
                self._active = now

    def _end_of_input(self, s: _Session) -> None:
        """The client sent its last byte: a frame it left unfinished is discarded; what it
        sent whole is still answered (it may be reading), then the connection closes."""
        p = s.parser
        partial = len(p.buf) + p.skip if p.in_progress or p.skipping else 0
        p.buf.clear()
        p.skip = 0
        s.eof = True
        self._say(f"{s.name} left" + (f" mid-frame ({partial} bytes of it discarded)" if partial else ""))

    def _parsed(self, s: _Session, item, now: float) -> None:
        if isinstance(item, P.Frame):
            s.inbox.append(item)
            s.inbox_bytes += len(item.payload) + _FRAME_COST
            s.last_progress = now
        else:  # BAD_CRC, or BAD_LENGTH for a length above max_payload: as the device replies
            status, opcode, tag = item
            self._answer(s, status, P.encode_reply(opcode, tag, status))

    def _answer(self, s: _Session, status: int, reply: bytes) -> None:
        """A reply of the server's own, after the replies to the frames that came before."""
        s.inbox.append((status, reply))
        self._release_answers(s)

    def _release_answers(self, s: _Session) -> None:
        while s.inbox and not isinstance(s.inbox[0], P.Frame):
            status, reply = s.inbox.popleft()
            s.count(status)
            self._queue(s, reply)

    def _queue(self, s: _Session, reply: bytes) -> None:
        s.out += reply
        self.peak_queued = max(self.peak_queued, len(s.out))

    def _expire(self, now: float) -> None:
        for s in list(self._sessions):
            p = s.parser
            if s.mid_frame() and now - s.last_byte >= self._frame_seconds:
                # As the device's parser does after frame_timeout cycles without a byte.
                while p.in_progress or p.skipping:
                    if p.in_progress:
                        opcode = p.partial_opcode or 0
                        self._answer(s, Status.TIMEOUT, P.encode_reply(opcode, P.FRAME_TIMEOUT_TAG, Status.TIMEOUT))
                    for item in p.expire():
                        self._parsed(s, item, now)
            if s.eof and not s.inbox and not s.out:
                self._close(s)
            elif (self.client_timeout is not None and now - s.last_progress > self.client_timeout
                  and not s.has_work(self.max_queued)):
                self._drop(s, f"dropped: no complete frame for {self.client_timeout:g} s")

    def _interest(self, s: _Session) -> None:
        """Read from a client only while its queues have room; write while replies wait."""
        paused = len(s.out) >= self.max_queued
        if paused and not s.told_paused:
            s.told_paused = True  # once: a client may pause and resume at every reply
            self._say(f"{s.name} is not reading its replies: paused at {len(s.out):,} bytes queued")
        events = 0
        if not s.eof and not paused and s.inbox_bytes < self.max_queued:
            events |= selectors.EVENT_READ
        if s.out:
            events |= selectors.EVENT_WRITE
        if events == s.events:
            return
        if events & ~s.events & selectors.EVENT_READ:
            s.last_byte = time.monotonic()  # a frame's silence counts only while the server reads
        if not events:
            self._selector.unregister(s.sock)
        elif not s.events:
            self._selector.register(s.sock, events, s)
        else:
            self._selector.modify(s.sock, events, s)
        s.events = events

    def _drop(self, s: _Session, why: str) -> None:
        self._say(f"{s.name} {why}")
        self._close(s)

    def _close(self, s: _Session) -> None:
        if s.events:
            self._selector.unregister(s.sock)
            s.events = 0
        s.sock.close()
        self._sessions.remove(s)
        if self._holder is s:
            self._holder = None  # its buffers need not be kept
        if self._turn is s:
            self._turn = None

    # ---- the device ----------------------------------------------------------------------

    def _pick(self, now: float) -> _Session | None:
        """The session whose next frame runs: the one whose turn it is, while its turn
        lasts and it has frames; else the next one, in the order they connected."""
        ready = [s for s in self._sessions if s.has_work(self.max_queued)]
        if not ready:
            return None
        t = self._turn
        if t in ready and now - self._turn_start < _TURN_SECONDS:
            return t
        order = self._sessions
        if t in order:
            i = order.index(t) + 1
            order = order[i:] + order[:i]
        self._turn = next(s for s in order if s in ready)
        self._turn_start = now
        return self._turn

    def _execute(self, s: _Session) -> None:
        frame = s.inbox.popleft()
        s.inbox_bytes -= len(frame.payload) + _FRAME_COST
        op = frame.opcode
        if op in _STATEFUL:
            self._switch_to(s)
        reply = self._transact(P.encode_frame(op, frame.tag, frame.payload, version=frame.version), op, frame.tag)
        if reply is None:
            name = Op(op).name if op in Op._value2member_map_ else f"opcode {op:#04x}"
            self._say(f"{s.name}: the device sent no reply to {name} for {self.reply_timeout:g} s")
        else:
            self._answered(s, frame, reply)
        self._release_answers(s)

    def _answered(self, s: _Session, frame: P.Frame, reply: P.Frame) -> None:
        op = frame.opcode
        status = reply.payload[0] if reply.payload else None
        if status == Status.OK:
            if op == Op.WRITE:
                s.buffers.write(frame.payload)
            elif op == Op.GEMM:
                d = P.decode_gemm(frame.payload)
                self._changed_accumulator(s, d["m"], d["n"])
                s.last_cycles = P.decode_cycles(reply.payload[1:])
            elif op == Op.READ:
                # A READ's reply has no cycles: the device's STATUS has them.
                st = self._internal(Op.STATUS)
                if st is not None:
                    s.last_cycles = P.decode_status(st).last_cycles
        if op == Op.RESET and status == Status.OK:
            # The device's buffers are undefined now: the session's read as zeros, written
            # before its next command that uses them.
            s.buffers.clear()
            s.dirty = None
            self._holder = None
            s.clear_counters()
        elif status is not None:
            s.count(status)
        payload = reply.payload
        if op == Op.STATUS and status == Status.OK:
            # The session's own counters in place of the device's, which count every
            # session's frames and the server's. (STATUS still goes to the device: it is how
            # a client learns that the device answers.)
            payload = payload[:1] + P.encode_status(P.DeviceStatus(s.accepted, s.refused, s.last_cycles, s.last_error))
        self._queue(s, P.encode_frame(reply.opcode, reply.tag, payload, version=reply.version))

    def _changed_accumulator(self, s: _Session, m: int, n: int) -> None:
        """A GEMM of ``s`` left sums in the accumulator: in whole blocks of the array (the
        padding too, docs/protocol.md "GEMM")."""
        ident = self.identity
        m = min(ident.size, -(-m // ident.rows) * ident.rows)
        n = min(ident.size, -(-n // ident.cols) * ident.cols)
        dm, dn = s.dirty or (0, 0)
        s.dirty = (max(dm, m), max(dn, n))

    def _switch_to(self, s: _Session) -> None:
        """Give the device's buffers to ``s``: read back the accumulator of the session that
        had them, then write ``s``'s buffers where they differ from that session's (all of
        them where the device's contents are not a session's: at first, after a RESET, after
        the session that had them left). A hand-over costs the same however many WRITEs made
        the buffers, and a session sees nothing another one wrote."""
        h = self._holder
        if h is s:
            return
        if h is not None:
            self.switches += 1
            if h.dirty is not None:
                self._save_accumulator(h)
        for name in Buffers.NAMES:
            mine = getattr(s.buffers, name)
            if h is not None and np.array_equal(getattr(h.buffers, name), mine):
                continue
            for payload in s.buffers.writes(name, self.identity.max_payload):
                if self._internal(Op.WRITE, payload) is None:
                    self._say(f"{s.name}: the device refused to restore a buffer write; its buffers may be wrong")
        self._holder = s

    def _save_accumulator(self, s: _Session) -> None:
        """Read back the corner of the accumulator ``s``'s products wrote into its buffers. (A
        READ flushes subnormals to zero; every later use of the accumulator flushes them too,
        so nothing that can be observed changes.)"""
        m, n = s.dirty
        s.dirty = None
        data = self._internal(Op.READ, P.encode_read(m, n))
        if data is None or len(data) != 4 * m * n:
            self._say(f"{s.name}: the device did not return the accumulator; its accumulator is lost")
            return
        s.buffers.acc[:m, :n] = np.frombuffer(data, "<f4").reshape(m, n)

    def _identify(self) -> None:
        data = self._internal(Op.IDENTIFY)
        if data is None or len(data) < P.IDENTITY_SIZE:
            raise LinkError(f"the device did not answer IDENTIFY within {self.reply_timeout:g} s")
        ident = P.decode_identity(data)
        self.identity = ident
        # The longest reply: a whole fp32 result, or a reply to the longest request.
        self._replies.max_payload = max(ident.max_payload, 5 + 4 * ident.size * ident.size) + 64
        self._frame_seconds = ident.frame_timeout / self._cps

    def _internal(self, op: int, payload: bytes = b"") -> bytes | None:
        """A request of the server's own: the reply's data, or None unless it is OK."""
        tag = self._tag
        self._tag = (self._tag + 1) % P.FRAME_TIMEOUT_TAG
        reply = self._transact(P.encode_frame(op, tag, payload), op, tag)
        if reply is None or reply.payload[:1] != bytes([Status.OK]):
            return None
        return reply.payload[1:]

    def _transact(self, frame: bytes, op: int, tag: int) -> P.Frame | None:
        """Write one whole frame to the device and wait for its reply (the same tag and the
        request's opcode with ``REPLY`` set); None after ``reply_timeout`` seconds without a
        byte. Other frames from the device (late replies of lost frames) are dropped."""
        self.device.write(frame)
        want = ((op | P.REPLY) & 0xFF, tag)
        heard = tick = time.monotonic()
        while True:
            data = self.device.read()
            now = time.monotonic()
            if data:
                heard = now
                for item in self._replies.feed(data):
                    if isinstance(item, P.Frame) and (item.opcode, item.tag) == want:
                        return item
                continue
            if now - heard > self.reply_timeout:
                self._replies = P.FrameParser(self._replies.max_payload)  # what came of the reply is no use
                return None
            if self._advance is not None:
                self._advance(int((now - tick) * self._cps))  # a device whose clock runs when told
                tick = now
            time.sleep(self.poll)


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
