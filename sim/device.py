"""The ``sim`` backend: the generated Verilog of the accelerator top under Verilator, behind
the same byte-pipe interface as every other device (``write``, ``read``), so the one host
driver runs against simulated gateware and against hardware alike.

The model runs in a small C++ harness (``sim/harness/harness.cpp``) that ctypes loads; Python
does no work per clock cycle. ``write`` queues bytes for the device's ``i`` stream; ``read``
runs the clock natively until a complete reply frame has arrived on ``o``, or until nothing
more can happen without the host (a partial frame waits for its remaining bytes), and
returns the bytes; ``advance`` lets time pass (how a begun frame times out); ``run`` drives
the clock explicitly. The default 8x8 top runs about 600,000 cycles a second.

The harness reaches the top through a wrapper (``build.wrapper_verilog``): its reset comes
from a power-on counter (``reset()`` builds a new model) and, unless ``buffered=0``, each
stream passes a 2-entry FIFO (full rate, one cycle of latency each way), which makes the
model about 40% faster.

Opening a configuration the first time builds its library (Verilog, Verilator, g++: one to
two minutes); later opens load it from ``build/simlib/`` at once (``sim/harness/build.py``).

With ``uart=N`` (clock cycles per bit, >= 4) the model is ``hw.uart.UartLoop`` instead: the
top behind the UART a board uses (``hw.uart.UartTop``: receiver, receive FIFO of
``fifo_depth`` bytes, default 4096, transmitter), reached through a host-side UART, so every
byte crosses the line at ``10 * N`` cycles each way; the harness is the same. Without
``uart`` (or with ``uart=0``) the library and its cache key are those of the plain top.

The host finds this backend through the entry-point group ``hbfp.devices``:
``sim = "hbfp.sim.device:backend"``; ``backend.open("rows=4,cols=4,size=48,stream_bytes=4")``,
``backend.open("rows=4,cols=4,size=48,uart=8")``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import threading
from collections.abc import Callable
from pathlib import Path

from hbfp import contract
from hbfp.host import protocol

from .harness import build

__all__ = ["SimDevice", "SimBackend", "backend", "parse_arg", "top_library", "DEFAULT_TIMEOUT_CYCLES",
           "Stop"]

#: How many cycles ``read`` runs at most, waiting for a reply (the host may pass its own).
DEFAULT_TIMEOUT_CYCLES = 20_000_000
#: Cycles of reset at open and on ``reset()`` (at least the wrapper's power-on reset).
RESET_CYCLES = build.RESET_CYCLES
#: ``run_until_idle``'s default quiet time.
IDLE_CYCLES = 256
#: Simulated cycles per second of host waiting time (``advance``): about what the model
#: runs per wall-clock second, so that a host's timeouts last about as long as on a board.
CYCLES_PER_SECOND = 1_000_000


class Stop(enum.IntFlag):
    """Stop conditions of the harness's run loop (``hbfp_run``)."""

    FRAME = 1    # a complete frame is buffered beyond what has been read
    OUTPUT = 2   # any output byte is buffered
    DRAINED = 4  # every written byte has been accepted by the device
    IDLE = 8     # drained, and no beat on either stream for ``idle_cycles``
    WAITING = 16  # drained, and every whole request the device took has its reply: nothing
    #               more can happen until the host writes (or time passes on a partial frame)


class _Counter(enum.IntEnum):
    CYCLES = 0
    QUEUED = 1
    PENDING = 2
    FRAME_READY = 3
    REQUESTS = 4
    IN_MID_FRAME = 5
    REPLIES = 6
    IN_BEATS = 7
    OUT_BEATS = 8
    FINISHED = 9
    WIRE_CYCLES = 10


_N_COUNTERS = len(_Counter)
_libraries: dict[Path, ctypes.CDLL] = {}
_libraries_lock = threading.Lock()


def _load(path: Path) -> ctypes.CDLL:
    path = Path(path).resolve()
    with _libraries_lock:
        lib = _libraries.get(path)
        if lib is None:
            lib = ctypes.CDLL(str(path))
            c_void_p, c_int, c_int64, c_uint32, c_uint64 = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                                                            ctypes.c_uint32, ctypes.c_uint64)
            lib.hbfp_abi.restype = c_uint32
            lib.hbfp_abi.argtypes = []
            lib.hbfp_stream_bytes.restype = c_int
            lib.hbfp_stream_bytes.argtypes = []
            lib.hbfp_new.restype = c_void_p
            lib.hbfp_new.argtypes = [c_int]
            lib.hbfp_free.restype = None
            lib.hbfp_free.argtypes = [c_void_p]
            lib.hbfp_reset.restype = None
            lib.hbfp_reset.argtypes = [c_void_p, c_int]
            lib.hbfp_write.restype = c_int64
            lib.hbfp_write.argtypes = [c_void_p, ctypes.c_char_p, c_int64]
            lib.hbfp_read.restype = c_int64
            lib.hbfp_read.argtypes = [c_void_p, ctypes.c_void_p, c_int64]
            lib.hbfp_run.restype = c_uint64
            lib.hbfp_run.argtypes = [c_void_p, c_uint64, c_uint32, c_uint64]
            lib.hbfp_set_throttle.restype = None
            lib.hbfp_set_throttle.argtypes = [c_void_p, c_uint32, c_uint32, c_uint32]
            lib.hbfp_counters.restype = None
            lib.hbfp_counters.argtypes = [c_void_p, ctypes.POINTER(c_uint64)]
            if lib.hbfp_abi() >> 16 != 1:
                raise RuntimeError(f"{path}: harness ABI {lib.hbfp_abi():#x}, expected 1.x")
            _libraries[path] = lib
        return lib


class _RequestScanner:
    """The request stream as the harness's ``FrameScanner`` follows it (sim/harness/harness.cpp),
    over the bytes the device has taken: frames by magic, header and ``length + 4`` more
    bytes. It also knows what the harness does not: the length field of a frame whose header
    is in and whose body is not, so ``SimDevice.read`` can tell a reply that the device
    sends before the frame is complete (a length above ``max_payload``) from a wait for the
    host's remaining bytes."""

    _MAGIC = protocol.MAGIC
    _HEADER = protocol.HEADER.size
    _CRC = protocol.CRC_SIZE

    def __init__(self):
        self.state = 0  # 0: hunting the magic's first byte, 1: its second, 2: header, 3: body
        self.header = bytearray()
        self.length = 0  # the length field of the frame in state 3
        self.body_left = 0
        self.completed = 0

    def feed(self, data: bytes) -> None:
        i, n = 0, len(data)
        first, second = self._MAGIC
        while i < n:
            if self.state == 0:
                j = data.find(first, i)
                if j < 0:
                    return
                self.state, i = 1, j + 1
            elif self.state == 1:
                b = data[i]
                i += 1
                if b == second:
                    self.state, self.header = 2, bytearray(self._MAGIC)
                elif b != first:
                    self.state = 0
            elif self.state == 2:
                take = min(self._HEADER - len(self.header), n - i)
                self.header += data[i : i + take]
                i += take
                if len(self.header) == self._HEADER:
                    self.length = int.from_bytes(self.header[-4:], "little")
                    self.body_left = self.length + self._CRC
                    self.state = 3
            else:
                take = min(self.body_left, n - i)
                self.body_left -= take
                i += take
                if self.body_left == 0:
                    self.state = 0
                    self.completed += 1

    def resync(self) -> None:
        """The harness dropped the frame in progress (the device timed it out)."""
        self.state, self.header, self.body_left = 0, bytearray(), 0


class SimDevice:
    """A simulated device: a Verilated top behind a byte pipe (the byte-device interface of
    ``hbfp.host.transports``, as ``EmuDevice``'s).

    - ``write(data)`` queues request bytes for the device's input stream (nothing runs).
    - ``read(max_bytes=None, *, timeout_cycles=None)``: reply bytes. Unless a complete reply
      frame is already buffered, it first runs the clock (natively) until one is, or until
      nothing more can happen without the host (every queued byte taken, every whole request
      answered: a partial frame waits for its remaining bytes, unless its length field
      exceeds ``max_payload``, which the device answers as soon as the header is in), or
      ``timeout_cycles`` pass. Returns what is buffered (at most ``max_bytes``), maybe ``b""``.
    - ``advance(cycles)``: time passes with no new byte: the clock runs ``cycles`` cycles, or
      until a complete reply frame is buffered (how a begun frame times out on the device).
    - ``run(cycles, stop=...)``: the clock, explicitly; ``run_until_idle()``; ``flush()``.
    - ``cycles``: clock cycles since the last reset; ``wire_cycles``: those an exchange
      occupied the link; ``reset()``; ``close()``.
    - ``pending``: reply bytes buffered; ``queued``: written bytes the device has not taken.

    A device is used from one thread at a time; ctypes releases the GIL while the clock runs.
    """

    def __init__(self, library: str | Path, *, timeout_cycles: int = DEFAULT_TIMEOUT_CYCLES,
                 reset_cycles: int = RESET_CYCLES, cycles_per_second: int = CYCLES_PER_SECOND,
                 info: dict | None = None, max_payload: int | None = None):
        self.library = Path(library)
        self._lib = _load(self.library)
        self.stream_bytes = self._lib.hbfp_stream_bytes()
        self.timeout_cycles = timeout_cycles
        self.reset_cycles = reset_cycles
        self.cycles_per_second = cycles_per_second
        #: What was opened (configuration, library); for reports.
        self.info = dict(info or {})
        #: The device's max_payload (None: unknown, e.g. not an accelerator top): a request
        #: whose length field exceeds it is answered as soon as its header is in.
        self.max_payload = max_payload if max_payload is not None else self._configured_max_payload()
        self._requests = _RequestScanner()
        self._untracked = bytearray()  # written bytes the scanner has not seen (not yet taken)
        self._counters = (ctypes.c_uint64 * _N_COUNTERS)()
        self._buf = ctypes.create_string_buffer(1 << 16)
        self._h = self._lib.hbfp_new(reset_cycles)
        if not self._h:
            raise RuntimeError("could not create the simulation model")

    # ---- byte pipe -------------------------------------------------------------------

    def write(self, data: bytes) -> int:
        """Queue ``data`` for the device's input stream; returns its length."""
        data = bytes(data)
        self._check_open()
        n = self._lib.hbfp_write(self._h, data, len(data))
        self._untracked += data[:n]
        return n

    def read(self, max_bytes: int | None = None, *, timeout_cycles: int | None = None) -> bytes:
        """Reply bytes (at most ``max_bytes``), after running the clock until a complete reply
        frame is buffered or nothing more can happen without the host (class docstring)."""
        self._check_open()
        if not self._poll()[_Counter.FRAME_READY]:
            budget = self.timeout_cycles if timeout_cycles is None else timeout_cycles
            if budget > 0:
                ran = self._run(budget, Stop.FRAME | Stop.WAITING)
                # WAITING counts whole requests; a frame too long for the device is answered
                # after its header alone: that reply comes without more input.
                if ran < budget and not self._poll()[_Counter.FRAME_READY] and self._early_reply_due():
                    self._run(budget - ran, Stop.FRAME)
        return self._take(max_bytes)

    def advance(self, cycles: int) -> None:
        """``cycles`` cycles pass without a new byte (fewer once a complete reply is buffered)."""
        self._check_open()
        if cycles > 0:
            self._run(int(cycles), Stop.FRAME)

    def flush(self) -> None:
        """Run until the device has accepted every queued byte (replies stay buffered)."""
        self._check_open()
        self._run(self.timeout_cycles, Stop.DRAINED)

    # ---- clock -----------------------------------------------------------------------

    def run(self, cycles: int, *, stop: Stop = Stop(0), idle_cycles: int = 0) -> int:
        """Advance ``cycles`` clock cycles (fewer when a ``stop`` condition holds first);
        returns the cycles run."""
        self._check_open()
        return self._run(int(cycles), stop, int(idle_cycles))

    def run_until_idle(self, idle_cycles: int = IDLE_CYCLES, max_cycles: int | None = None) -> int:
        """Run until every queued byte is accepted and neither stream moved for
        ``idle_cycles`` (a long computation is quiet too: give it enough)."""
        return self.run(self.timeout_cycles if max_cycles is None else max_cycles, stop=Stop.IDLE,
                        idle_cycles=idle_cycles)

    @property
    def cycles(self) -> int:
        return self._poll()[_Counter.CYCLES]

    def counters(self) -> dict:
        """Cycles, queue levels, frames and beats seen (for tests and reports)."""
        c = self._poll()
        return {k.name.lower(): int(c[k]) for k in _Counter}

    @property
    def wire_cycles(self) -> int:
        """Simulated cycles an exchange has occupied the link since the last reset: every
        cycle from a request's first beat offered to its reply's last beat taken, while a
        request byte is queued or in flight, a frame is part-way in either direction, or a
        request awaits its reply (the device computing or making the link wait); cycles in
        which nothing is outstanding (the host idle between exchanges) do not count
        (docs/host.md, "Cycles on the wire")."""
        return self._poll()[_Counter.WIRE_CYCLES]

    @property
    def pending(self) -> int:
        """Reply bytes buffered (readable without running the clock)."""
        return self._poll()[_Counter.PENDING]

    @property
    def queued(self) -> int:
        """Written bytes the device has not taken yet."""
        return self._poll()[_Counter.QUEUED]

    def throttle(self, in_chance: float = 1.0, out_chance: float = 1.0, seed: int = 1) -> None:
        """Test the device under gaps: offer an input beat in a cycle with ``in_chance``, hold
        ``o.ready`` high with ``out_chance`` (pseudo-random, from ``seed``). 1.0: always."""
        self._check_open()
        self._lib.hbfp_set_throttle(self._h, round(in_chance * 256), round(out_chance * 256), seed & 0xFFFFFFFF)

    def reset(self) -> None:
        self._check_open()
        self._lib.hbfp_reset(self._h, self.reset_cycles)
        self._requests = _RequestScanner()
        self._untracked.clear()

    def close(self) -> None:
        if self._h:
            self._lib.hbfp_free(self._h)
            self._h = None

    @property
    def closed(self) -> bool:
        return not self._h

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        state = "closed" if self.closed else f"{self.cycles} cycles"
        return f"<SimDevice {self.info.get('config', self.library)} {state}>"

    # ---- internals -------------------------------------------------------------------

    def _check_open(self):
        if not self._h:
            raise ValueError("device is closed")

    def _poll(self):
        self._lib.hbfp_counters(self._h, self._counters)
        return self._counters

    def _configured_max_payload(self) -> int | None:
        config = self.info.get("config") or {}
        if "max_payload" in config:
            return int(config["max_payload"])
        if "top" in config:  # an accelerator top built with its default
            return contract.DEFAULT_MAX_PAYLOAD
        return None

    def _run(self, cycles: int, stop: Stop, idle_cycles: int = 0) -> int:
        """The harness's run loop, then the request scanner brought up to what the device took."""
        ran = self._lib.hbfp_run(self._h, cycles, int(stop), idle_cycles)
        c = self._poll()
        taken = len(self._untracked) - c[_Counter.QUEUED]  # taken by the device since the last run
        if taken > 0:
            self._requests.feed(bytes(self._untracked[:taken]))
            del self._untracked[:taken]
        if c[_Counter.REQUESTS] > self._requests.completed:
            # A TIMEOUT reply: the harness counts the dropped frame as answered and hunts anew
            # (with no byte queued: a frame times out only while none arrives).
            self._requests.resync()
            self._requests.completed = c[_Counter.REQUESTS]
        return ran

    def _early_reply_due(self) -> bool:
        """A reply the device sends without more input is still to come: the frame in progress
        has its header in, a length field above ``max_payload``, and no reply yet (every
        whole request has one: ``Stop.WAITING``)."""
        c = self._poll()
        req = self._requests
        return (self.max_payload is not None and req.state == 3 and req.length > self.max_payload
                and bool(c[_Counter.IN_MID_FRAME]) and c[_Counter.REPLIES] <= c[_Counter.REQUESTS])

    def _take(self, max_bytes: int | None) -> bytes:
        want = self._poll()[_Counter.PENDING]
        if max_bytes is not None:
            want = min(want, max_bytes)
        if want <= 0:
            return b""
        if want > len(self._buf):
            self._buf = ctypes.create_string_buffer(1 << (want - 1).bit_length())
        n = self._lib.hbfp_read(self._h, self._buf, want)
        return ctypes.string_at(self._buf, n)


# ---- the accelerator top ------------------------------------------------------------

#: The links ``link=`` names.
LINKS = ("stream", "eth")


def _parse_link(value: str) -> str:
    if value not in LINKS:
        raise ValueError(f"link must be one of {', '.join(LINKS)}, got {value!r}")
    return value


#: The simulator's own options beside the contract's device options (``hbfp.contract.OPTIONS``).
SIM_OPTIONS: dict[str, contract.Option] = {
    "threads": contract.Option(contract.parse_int, "sim", "Verilator threads of the build"),
    "buffered": contract.Option(contract.parse_bool, "sim", "a 2-entry FIFO on each stream (0: the top's ports directly)"),
    "timeout_cycles": contract.Option(contract.parse_int, "sim", "cycles read() runs the clock waiting for a reply"),
    "uart": contract.Option(contract.parse_int, "sim", "the top behind its UART: clock cycles per bit (0: none)"),
    "fifo_depth": contract.Option(contract.parse_int, "sim", "bytes of the UART's receive FIFO"),
    "link": contract.Option(_parse_link, "sim",
                            "the host link: stream (the top's ports) or eth (Ethernet, IPv4 and UDP: hw.eth_top.EthLoop)"),
}
_CORE_FIELDS = tuple(f.name for f in dataclasses.fields(contract.CoreConfig))
_TOP_FIELDS = contract.DEVICE_FIELDS


def parse_arg(arg: str | None) -> dict:
    """``"rows=4,cols=4,size=48,stream_bytes=4"`` -> dict of typed options: the contract's
    device options (``hbfp.contract.parse_options``, as ``emu:`` takes them) and the
    simulator's (``SIM_OPTIONS``)."""
    return contract.parse_options(arg, extra=SIM_OPTIONS, what="sim")


def top_library(options: dict | None = None, *, progress: Callable[[str], None] | None = None,
                force: bool | None = None) -> tuple[Path, dict]:
    """(library path, description) of ``hw.top.AcceleratorTop`` configured by ``options``
    (CoreConfig fields, ``stream_bytes``, ``frame_timeout``, ``clock_hz``, ``max_payload``;
    ``threads``, ``buffered`` for the build), or with ``uart`` (clock cycles per bit, >= 4)
    of ``hw.uart.UartLoop``: that top behind its UART (``UartTop``), reached through a
    host-side UART (``stream_bytes`` is then 1)."""
    options = dict(options or {})
    spec = contract.DeviceSpec.from_options({k: v for k, v in options.items() if k not in SIM_OPTIONS})
    core = spec.config
    top_kw = {k: getattr(spec, k) for k in _TOP_FIELDS}
    threads = options.get("threads", build.DEFAULT_THREADS)
    buffered = bool(options.get("buffered", True))
    uart = options.get("uart", 0)
    link = options.get("link", "stream")
    if link == "eth":
        if uart:
            raise ValueError("sim: link=eth and uart=N are two different links: give one")
        eth_kw = dict(top_kw)  # stream_bytes: the core's, behind the link's byte a cycle

        def make_eth():
            from hbfp.hw.eth_top import EthLoop

            return EthLoop(core, **eth_kw)

        config = {"top": "hw.eth_top.EthLoop", "core": core.to_dict(), **top_kw, "link": "eth"}
        lib = build.build_library(make_eth, config, stream_bytes=1, threads=threads, buffered=buffered,
                                  progress=progress, force=force)
        return lib, config
    if "fifo_depth" in options and not uart:
        raise ValueError("sim: fifo_depth (bytes of the UART's receive FIFO) needs uart=N (clock cycles per bit)")

    if uart:
        from hbfp.hw.uart import MIN_DIVISOR

        if not isinstance(uart, int) or isinstance(uart, bool) or uart < MIN_DIVISOR:
            raise ValueError(f"sim: uart is the UART's clock cycles per bit, an integer >= {MIN_DIVISOR} "
                             f"(0: no UART), got {uart!r}")
        if top_kw["stream_bytes"] != 1:
            raise ValueError(f"sim: a UART carries one byte at a time: uart={uart} needs stream_bytes=1, "
                             f"got {top_kw['stream_bytes']}")
        loop_kw = {k: v for k, v in top_kw.items() if k != "stream_bytes"}
        if "fifo_depth" in options:
            loop_kw["fifo_depth"] = options["fifo_depth"]

        def make():
            from hbfp.hw.uart import UartLoop

            return UartLoop(core, divisor=uart, **loop_kw)

        # The default path's configuration (and cache key) stays as it was without ``uart``.
        config = {"top": "hw.uart.UartLoop", "core": core.to_dict(), **top_kw, "uart": uart,
                  **({"fifo_depth": options["fifo_depth"]} if "fifo_depth" in options else {})}
        lib = build.build_library(make, config, stream_bytes=1, threads=threads, buffered=buffered,
                                  progress=progress, force=force)
        return lib, config

    def make():
        from hbfp.hw.top import AcceleratorTop

        return AcceleratorTop(core, **top_kw)

    config = {"top": "hw.top.AcceleratorTop", "core": core.to_dict(), **top_kw}
    lib = build.build_library(make, config, stream_bytes=top_kw["stream_bytes"], threads=threads,
                              buffered=buffered, progress=progress, force=force)
    return lib, config


class SimBackend:
    """The ``sim`` entry of the ``hbfp.devices`` group."""

    ABI_VERSION = protocol.ABI_VERSION  # the gateware's packet engine encodes it from the same module

    name = "sim"
    description = "the gateware's Verilog under Verilator (hw.top.AcceleratorTop), cycle-accurate"

    def open(self, arg: str = "", **options) -> SimDevice:
        """Open a simulated accelerator. ``arg``: ``key=value`` options separated by commas
        (``format``, ``rows``, ``cols``, ``mantissa_bits``, ``tile``, ``size``, ``functions``,
        ``leaky_shift``, ``stream_bytes``, ``frame_timeout``, ``clock_hz``, ``max_payload``,
        ``threads``, ``buffered``, ``timeout_cycles``, ``uart``, ``fifo_depth``). ``buffered=0``
        connects the harness to the top's ports directly (port timing exact, about 20% slower)
        instead of through a 2-entry FIFO on each stream (one cycle of latency each way).
        ``uart=N`` (clock cycles per bit, >= 4; 0: none) puts the top behind its UART
        (``hw.uart.UartLoop``, module docstring), ``fifo_depth`` sets its receive FIFO's bytes.
        ``link=eth`` puts it behind its network link (``hw.eth_top.EthLoop``: Ethernet, IPv4,
        UDP) and returns a ``DatagramTransport`` over ``hbfp.sim.network.NetworkSim``.
        Keyword ``options`` add to or override them; they may
        also be ``config`` (a ``CoreConfig``), ``progress`` (a callable for build messages) and
        ``rebuild`` (bool: build even if cached)."""
        progress = options.pop("progress", None)
        rebuild = options.pop("rebuild", None)
        config = options.pop("config", None)
        opts = parse_arg(arg)
        if config is not None:
            opts.update({k: getattr(config, k) for k in _CORE_FIELDS})
        for key, value in options.items():
            if key not in contract.OPTIONS and key not in SIM_OPTIONS or key == "format":
                raise TypeError(f"sim: unknown option {key!r}")
            opts[key] = value
        timeout = opts.pop("timeout_cycles", DEFAULT_TIMEOUT_CYCLES)
        lib, config = top_library(opts, progress=progress, force=rebuild)
        device = SimDevice(lib, timeout_cycles=timeout, info={"config": config, "library": str(lib)})
        if opts.get("link") == "eth":  # the board on its network: datagrams, numbered as udp: numbers them
            from hbfp.host.transports import DatagramTransport
            from hbfp.hw.eth_top import DEFAULT_IP, DEFAULT_MAC, DEFAULT_PORT

            from .network import NetworkSim

            return DatagramTransport(NetworkSim(device, mac=DEFAULT_MAC, ip=DEFAULT_IP, port=DEFAULT_PORT))
        return device


backend = SimBackend()
