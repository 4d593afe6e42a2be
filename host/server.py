"""Servers for any byte device (``hbfp.host.transports``: ``write``, ``read``, ``advance``):
``Server`` serves one on a TCP port to several clients at once, each in a session of its own
(its frames, its buffers, its STATUS; bounded queues, idle clients dropped; docs/host.md,
"Serving a device"); ``PtyServer`` serves one on a pseudo-terminal (a serial port) to one
peer; ``UdpServer`` on a UDP port to one peer at a time, as a board's network link does
(``hbfp.host.datagrams``); ``serve`` and ``serve_fd`` run them in this thread."""

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

from . import datagrams as D
from . import protocol as P
from .emu import Buffers
from .errors import LinkError
from .protocol import Op, Status
from .transports import is_byte_device, is_datagram_device

__all__ = ["Server", "PtyServer", "UdpServer", "serve", "serve_fd"]


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host`` (a name, an IPv4 or IPv6 address; ``::``: every
    address, IPv4 too where the system allows both on one socket) and ``port``."""
    if host == "::" and socket.has_dualstack_ipv6():
        return socket.create_server((host, port), family=socket.AF_INET6, dualstack_ipv6=True)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    return socket.create_server(address[:2], family=family)



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
                s.last_cycles = 0  # a READ computes no sums (its count, which STATUS reports)
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
            for payload in s.buffers.writes(name, self.identity):
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


class UdpServer(_Serving):
    """Serves a byte device on a UDP port (``hbfp.host.open(server.spec)``: ``udp:HOST:PORT``)
    as a board's network link does: the stream bytes of the datagrams it takes
    (``hbfp.host.datagrams``: numbered, ``Sequence``'s rule) go to the device, the device's
    bytes go back in numbered datagrams of at most 1,472 bytes to the sender of the last
    datagram taken. One peer at a time, as on the board: a second client's requests interleave
    with the first's (use the TCP ``Server`` for several clients).

    A *datagram device* (``hbfp.host.transports.is_datagram_device``: the simulated board on
    its network link, ``sim:link=eth``) is bridged instead: each datagram goes to it whole and
    each of its datagrams back whole, the numbering being the device's own (its gateware's).

    Fault mode, for tests of the host's recovery: each datagram, either way, is lost with
    probability ``drop``, and one bit of its stream bytes flipped with probability ``corrupt``
    (the header stays whole: a network's UDP checksum drops a datagram with a damaged header;
    damage to the bytes, which a board's link does not check, is the protocol CRC's to find).
    ``counts``: datagrams ``received``, ``taken``, ``sent``, ``dropped`` and ``corrupted``."""

    def __init__(self, device, host: str = "127.0.0.1", port: int = 0, *, idle_timeout: float | None = None,
                 poll: float = 0.005, drop: float = 0.0, corrupt: float = 0.0, seed: int = 0):
        if not (is_byte_device(device) or is_datagram_device(device)):
            raise TypeError(f"serve needs a byte or datagram device, got {type(device).__name__}")
        for name, p in (("drop", drop), ("corrupt", corrupt)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} is a probability (0 .. 1), got {p!r}")
        self.device, self.idle_timeout, self.poll = device, idle_timeout, poll
        self.drop, self.corrupt, self.rng = drop, corrupt, random.Random(seed)
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM,
                                                             flags=socket.AI_PASSIVE)[0]
        self.sock = socket.socket(family, kind, proto)
        try:
            self.sock.bind(address)
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise
        self.host, self.port = host, self.sock.getsockname()[1]
        self.peer = None
        self.sequence = D.Sequence()
        self.numbering = D.Numbering()
        self.counts = dict.fromkeys(("received", "taken", "sent", "dropped", "corrupted"), 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def spec(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"udp:{host}:{self.port}"

    def _fault(self, datagram: bytes) -> bytes | None:
        """The datagram as the faulty network delivers it (None: lost)."""
        if self.drop and self.rng.random() < self.drop:
            self.counts["dropped"] += 1
            return None
        if self.corrupt and len(datagram) > D.HEADER.size and self.rng.random() < self.corrupt:
            self.counts["corrupted"] += 1
            damaged = bytearray(datagram)
            damaged[self.rng.randrange(D.HEADER.size, len(damaged))] ^= 1 << self.rng.randrange(8)
            return bytes(damaged)
        return datagram

    def _recv(self) -> bytes | None:
        datagram, sender = self.sock.recvfrom(1 << 16)
        self.counts["received"] += 1
        datagram = self._fault(datagram)
        parts = D.unpack(datagram) if datagram is not None else None
        if parts is None or not self.sequence.take(parts[0], parts[1]):
            return None
        self.counts["taken"] += 1
        self.peer = sender
        return parts[2] or None  # (b"" would mean a closed peer to the pump)

    def _send(self, data: bytes) -> int:
        if self.peer is None:
            return len(data)  # nobody asked: nowhere to answer
        sent = 0
        while sent < len(data):
            chunk = data[sent:sent + D.MAX_STREAM_BYTES]
            datagram = self._fault(D.pack(self.numbering.seq, chunk))
            if datagram is not None:
                try:
                    self.sock.sendto(datagram, self.peer)
                except (BlockingIOError, InterruptedError):
                    return sent
            self.numbering.next()
            self.counts["sent"] += 1
            sent += len(chunk)
        return sent

    def run(self) -> None:
        try:
            if is_datagram_device(self.device):
                self._bridge()
            else:
                _pump(self.device, self.sock.fileno(), self._recv, self._send, self._stop, self.poll,
                      self.idle_timeout)
        finally:
            self.sock.close()

    def _bridge(self) -> None:
        """Datagrams to and from a datagram device, whole, until ``stop`` or ``idle_timeout``."""
        cps = getattr(self.device, "cycles_per_second", 1_000_000)
        last = time.monotonic()
        waiting = False  # datagrams went in since the device last answered
        while not self._stop.is_set():
            r, _, _ = select.select([self.sock], [], [], 0.0 if waiting else self.poll)
            now = time.monotonic()
            if r:
                try:
                    datagram, sender = self.sock.recvfrom(1 << 16)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    return
                self.counts["received"] += 1
                datagram = self._fault(datagram)
                if datagram is not None:
                    self.counts["taken"] += 1
                    self.peer, last, waiting = sender, now, True
                    self.device.send_datagram(datagram)
                continue  # take every datagram waiting before the device runs
            # the device's clock: until its replies come (a poll's worth of cycles at a time)
            for reply in self.device.receive_datagrams(int(self.poll * cps)):
                waiting = False
                reply = self._fault(reply)
                if reply is not None and self.peer is not None:
                    self.sock.sendto(reply, self.peer)
                    self.counts["sent"] += 1
            if self.idle_timeout is not None and now - last > self.idle_timeout:
                return

    def _thread_name(self) -> str:
        return f"hbfp-serve-{self.spec}"

    def _stopped_before_start(self) -> None:
        self.sock.close()


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
