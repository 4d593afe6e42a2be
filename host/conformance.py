"""The wire protocol's conformance table (docs/protocol.md): every error case, and the valid
requests around them, as data that any device must answer the same way.

``cases(identity)`` is the table for one device (cases depend on its identity: buffer side,
array, tile, max_payload, frame_timeout, the activation units and optional units built).
Each ``Case`` holds

- ``steps``: what the host does: ``Send(bytes)`` (request bytes, possibly malformed: a bad
  CRC, a bad magic, an oversized length, a truncated frame, several frames back to back) and
  ``Idle(cycles)`` (clock cycles pass with no byte, how a truncated frame times out); a step
  may state how many replies must have arrived once it is done (``replies``: a frame's reply
  comes when it is complete, an oversized frame's as soon as its header is in, a timeout's
  only after ``frame_timeout`` quiet cycles);
- ``replies``: the reply expected for every complete frame, in order: status, opcode, tag,
  and the size or the bytes of an OK reply's data (an error reply carries its status alone);
- ``counters``: the effect on STATUS's counters (frames accepted and refused, last error,
  the cycles of the last GEMM or READ), relative to what they were before the case, or
  absolute after a RESET.

``run_case(device, case)`` drives one case through any byte device (``write(data)``,
``read()``: the reply bytes so far, ``advance(cycles)``): a STATUS before (unless given),
the case's steps, a STATUS after, and every check; it raises ``ConformanceError``.
``run_cases`` runs a list, chaining the STATUS replies. The driver itself is ``drive(case,
identity, before)``: a generator of actions (``("write", data)``, ``("read",)`` which is sent
back the bytes read, ``("advance", cycles)``), so that a testbench whose clock must be
awaited (cocotb, sim/tb_top.py) runs the same code through its own byte link.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass

from hbfp import contract

from . import protocol as P
from .protocol import Op, OutFormat, Status, Target

__all__ = [
    "Send",
    "Idle",
    "Reply",
    "Counters",
    "Case",
    "ConformanceError",
    "cases",
    "identity_of",
    "drive",
    "run_case",
    "run_cases",
    "identify",
    "STATUS_TAG",
]

#: The tag of the STATUS requests the driver adds around a case.
STATUS_TAG = 0xFFFE
_HEADER = contract.HEADER  # magic, version, opcode, tag, length (docs/protocol.md)
_STATUS_SIZE = 16


# ---- the table's vocabulary ------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """Bytes the host sends; ``replies``: the replies of the case that must have arrived
    once they are in (None: not checked here)."""

    data: bytes
    replies: int | None = None


@dataclass(frozen=True)
class Idle:
    """``cycles`` clock cycles pass with no byte sent; ``replies`` as for ``Send``."""

    cycles: int
    replies: int | None = None


@dataclass(frozen=True)
class Reply:
    """An expected reply: its status, opcode byte (the request's | 0x80) and tag; for an OK
    reply, its data's ``size`` and maybe its exact ``data`` (None: unchecked)."""

    status: Status
    opcode: int
    tag: int
    size: int | None = None
    data: bytes | None = None

    def __str__(self):
        more = f", {self.size} bytes" if self.size is not None else ""
        return f"{Status(self.status).name} (opcode {self.opcode:#04x}, tag {self.tag:#06x}{more})"


@dataclass(frozen=True)
class Counters:
    """The effect of a case on STATUS: ``accepted`` and ``refused`` frames added (absolute
    values after the case's last RESET when ``reset``), the ``last_error`` after it (None:
    unchanged), and ``last_cycles``: ``"same"`` (no GEMM or READ ran), ``"zero"`` (a RESET
    and no GEMM or READ after it) or ``"any"`` (a GEMM or READ ran: not compared, the count
    is the gateware's)."""

    accepted: int
    refused: int
    last_error: Status | None
    reset: bool = False
    last_cycles: str = "same"


@dataclass(frozen=True)
class Case:
    name: str  # "category/what"
    steps: tuple
    replies: tuple[Reply, ...]
    counters: Counters
    note: str = ""

    @property
    def category(self) -> str:
        return self.name.split("/", 1)[0]

    @property
    def request(self) -> bytes:
        """Every byte the case sends."""
        return b"".join(s.data for s in self.steps if isinstance(s, Send))

    @property
    def runs_product(self) -> bool:
        """A GEMM or READ runs (STATUS's last_cycles becomes the gateware's count)."""
        return self.counters.last_cycles == "any"

    def __str__(self):
        return self.name


class ConformanceError(AssertionError):
    pass


def _counters(replies: Iterable[Reply]) -> Counters:
    """The counters' effect of a case's replies (docs/protocol.md, STATUS and RESET): every
    reply counts once, an OK RESET clears everything after counting itself."""
    acc = ref = 0
    last = None
    reset = False
    cycles = "same"
    for r in replies:
        if r.status == Status.OK and r.opcode == Op.RESET | P.REPLY:
            acc = ref = 0
            last, reset, cycles = Status.OK, True, "zero"
        elif r.status == Status.OK:
            acc += 1
            if r.opcode in (Op.GEMM | P.REPLY, Op.READ | P.REPLY):
                cycles = "any"
        else:
            ref += 1
            last = Status(r.status)
    return Counters(acc, ref, last, reset, cycles)


# ---- the identity a configuration reports ------------------------------------------------------


def identity_of(config, *, max_payload: int, frame_timeout: int, stream_bytes: int = 1,
                clock_hz: int = 0) -> P.Identity:
    """The IDENTIFY a device built from ``config`` (a ``CoreConfig``) reports (the contract's
    ``DeviceSpec.identity``), so that a table can be made before the device is opened."""
    from hbfp.contract import DeviceSpec

    return DeviceSpec(config, stream_bytes=stream_bytes, clock_hz=clock_hz, max_payload=max_payload,
                      frame_timeout=frame_timeout).identity()


# ---- the table ----------------------------------------------------------------------------------


def _header(opcode: int, tag: int, length: int, *, version: int = P.PROTOCOL_VERSION,
            magic: bytes = P.MAGIC) -> bytes:
    return _HEADER.pack(magic=int.from_bytes(magic, "little"), version=version, opcode=opcode, tag=tag,
                        length=length)


class _Table:
    """Builds the cases of one identity (``cases``)."""

    def __init__(self, ident: P.Identity):
        from hbfp.contract import FUNCTIONS, UNARY_FUNCTIONS

        self.ident = ident
        self.FUNCTIONS, self.UNARY = FUNCTIONS, UNARY_FUNCTIONS
        self.out: list[Case] = []
        self._tag = 0x0100
        i = ident
        self.D, self.R, self.C = i.size, i.rows, i.cols
        self.th, self.tw = i.tile
        self.mb = i.mantissa_bits
        self.cb = P.code_bytes(self.mb)
        self.P, self.T = i.max_payload, i.frame_timeout
        self.square = i.tile_rows == i.tile_cols
        built = i.functions
        self.unary = [f for f in built if f in UNARY_FUNCTIONS]
        self.grads = [f for f in built if f not in UNARY_FUNCTIONS]
        self.unbuilt_unary = [f for f in UNARY_FUNCTIONS if f not in built]
        self.unbuilt_grads = [f for f in FUNCTIONS if f not in UNARY_FUNCTIONS and f not in built]
        self.vq, self.bfp, self.st = (i.has(u) for u in ("value_quantizer", "bfp_output", "stochastic"))
        self.s = min(4, self.D)  # sides of the small products

    # -- helpers -------------------------------------------------------------------------

    def tag(self) -> int:
        self._tag += 1
        if self._tag >= 0xFF00:
            self._tag = 0x0101
        return self._tag

    def add(self, name: str, steps, replies, note: str = "") -> None:
        replies = tuple(replies)
        assert all(c.name != name for c in self.out), f"two cases named {name}"
        self.out.append(Case(name, tuple(steps), replies, _counters(replies), note))

    def frame(self, op: int, payload: bytes = b"", *, version: int = P.PROTOCOL_VERSION, tag: int | None = None):
        """(frame bytes, tag)."""
        t = self.tag() if tag is None else tag
        return P.encode_frame(op, t, payload, version=version), t

    def one(self, name: str, op: int, payload: bytes = b"", status: Status = Status.OK, *,
            size: int | None = None, data: bytes | None = None, version: int = P.PROTOCOL_VERSION,
            note: str = "") -> None:
        """A case of one request and its one reply."""
        f, t = self.frame(op, payload, version=version)
        if status != Status.OK:
            size, data = 0, b""
        self.add(name, [Send(f, replies=1)], [Reply(status, (op | P.REPLY) & 0xFF, t, size, data)], note)

    def served(self, present: bool) -> Status:
        return Status.OK if present else Status.BAD_DESCRIPTOR

    def gemm(self, **kw) -> bytes:
        kw.setdefault("transpose_b", not self.square)  # a layout a non-square tile serves
        s = self.s
        for side in ("m", "n", "k"):
            kw.setdefault(side, s)
        m, n, k = kw.pop("m"), kw.pop("n"), kw.pop("k")
        return P.encode_gemm(m, n, k, **kw)

    def result(self, m: int, n: int, out_format: int) -> int:
        return P.result_size(m, n, out_format, self.mb, self.ident.tile)

    def fcode(self, name: str) -> int:
        return self.FUNCTIONS.index(name)

    # -- the cases -----------------------------------------------------------------------

    def build(self) -> list[Case]:
        for part in (self.crc, self.resync, self.version, self.opcode, self.oversized, self.timeout,
                     self.no_payload, self.write, self.gemm_cases, self.read_cases, self.elementwise,
                     self.units, self.reset, self.back_to_back):
            part()
        return self.out

    def crc(self):
        """BAD_CRC: a flipped bit anywhere after the magic; the reply echoes the tag and
        opcode as received; the frame is consumed whole (length + 4 bytes after its header)."""
        flips = [("payload", 12, 0x04), ("crc", -1, 0x80), ("tag", 5, 0x01), ("opcode", 3, 0x01),
                 ("version", 2, 0x02), ("opcode-reply-bit", 3, 0x80)]
        for what, offset, bit in flips:
            f, t = self.frame(Op.GEMM, self.gemm())
            f = bytearray(f)
            f[offset] ^= bit
            head = _HEADER.unpack(f)
            op, tag = head["opcode"], head["tag"]
            self.add(f"crc/{what}", [Send(bytes(f), replies=1)], [Reply(Status.BAD_CRC, op | P.REPLY, tag, 0, b"")])
        # a length field changed by the flip: the frame ends where the length says
        f, t = self.frame(Op.GEMM, self.gemm())  # length 16
        grown = bytearray(f)
        grown[6] ^= 0x08  # 24: 8 more bytes are taken into the frame
        assert zlib.crc32(bytes(grown[:-4]) + bytes(4)) != 0  # (the CRC the device reads: 4 zero bytes)
        self.add("crc/length-grown", [Send(bytes(grown), replies=0), Send(bytes(8), replies=1)],
                 [Reply(Status.BAD_CRC, Op.GEMM | P.REPLY, t, 0, b"")],
                 "the frame is consumed whole: length + 4 bytes after the header, then the hunt resumes")
        shrunk = bytearray(f)
        shrunk[6] ^= 0x10  # 0: the first 4 payload bytes are taken for the CRC
        rest = bytes(shrunk[_HEADER.size + 4:])
        assert zlib.crc32(bytes(shrunk[:_HEADER.size])) != struct.unpack_from("<I", shrunk, _HEADER.size)[0]
        assert P.MAGIC not in rest and not rest.endswith(P.MAGIC[:1])
        self.add("crc/length-shrunk", [Send(bytes(shrunk), replies=1)],
                 [Reply(Status.BAD_CRC, Op.GEMM | P.REPLY, t, 0, b"")],
                 "the bytes after the short frame are hunted for the magic (none there)")
        # a corrupted WRITE changes nothing: the accumulator keeps what it held
        C = self.C
        zero, tz = self.frame(Op.WRITE, P.encode_write(Target.ACC, 0, 0, 1, C, bytes(4 * C)))
        ones = bytearray(self.frame(Op.WRITE, P.encode_write(Target.ACC, 0, 0, 1, C,
                                                             struct.pack(f"<{C}f", *[1.0] * C)))[0])
        to = _HEADER.unpack(ones)["tag"]
        ones[-6] ^= 0x10  # in the data
        read, tr = self.frame(Op.READ, P.encode_read(1, C))
        self.add("crc/write-changes-nothing", [Send(zero + bytes(ones) + read, replies=3)],
                 [Reply(Status.OK, Op.WRITE | P.REPLY, tz, 0, b""),
                  Reply(Status.BAD_CRC, Op.WRITE | P.REPLY, to, 0, b""),
                  Reply(Status.OK, Op.READ | P.REPLY, tr, 4 * C, bytes(4 * C))])

    def resync(self):
        """The device hunts for the magic: garbage, a lone "H", a bad magic cost nothing."""
        f, t = self.frame(Op.IDENTIFY)
        ident = Reply(Status.OK, Op.IDENTIFY | P.REPLY, t, P.IDENTITY_SIZE, P.encode_identity(self.ident))
        self.add("resync/garbage", [Send(b"garbage without the magic\x00\xff" + f, replies=1)], [ident])
        f, t = self.frame(Op.IDENTIFY)
        self.add("resync/lone-H", [Send(b"xxH" + b"HH" + f, replies=1)],
                 [Reply(Status.OK, Op.IDENTIFY | P.REPLY, t, P.IDENTITY_SIZE)])
        f, t = self.frame(Op.IDENTIFY)
        self.add("resync/magic-split", [Send(b"zz" + f[:1], replies=0), Send(f[1:], replies=1)],
                 [Reply(Status.OK, Op.IDENTIFY | P.REPLY, t, P.IDENTITY_SIZE)], "the magic's two bytes in two writes")
        bad, _ = self.frame(Op.IDENTIFY)
        bad = b"HC" + bad[2:]
        assert P.MAGIC not in bad
        f, t = self.frame(Op.IDENTIFY)
        self.add("resync/bad-magic", [Send(bad, replies=0), Send(f, replies=1)],
                 [Reply(Status.OK, Op.IDENTIFY | P.REPLY, t, P.IDENTITY_SIZE)], "a frame without the magic is no frame")
        f, t = self.frame(Op.IDENTIFY)
        noise = bytes(range(0x40, 0x48)) * 3 + b"\x48\x41\x48\x43"  # "H"s never followed by "B"
        self.add("resync/h-without-b", [Send(noise + f, replies=1)],
                 [Reply(Status.OK, Op.IDENTIFY | P.REPLY, t, P.IDENTITY_SIZE)])

    def version(self):
        """BAD_VERSION, checked after the CRC and before the opcode."""
        other = P.PROTOCOL_VERSION + 1
        self.one(f"version/{other}", Op.IDENTIFY, status=Status.BAD_VERSION, version=other)
        self.one("version/0", Op.STATUS, status=Status.BAD_VERSION, version=0)
        self.one("version/255-write", Op.WRITE, P.encode_write(Target.ACC, 0, 0, 0, 0, b""),
                 status=Status.BAD_VERSION, version=255)
        self.one("version/before-opcode", 0x7E, status=Status.BAD_VERSION, version=other)
        self.one("version/before-length", Op.STATUS, b"\0", status=Status.BAD_VERSION, version=other)

    def opcode(self):
        """BAD_OPCODE: 0, above RESET, a reply's opcode, 0xFF."""
        self.one("opcode/0x00", 0x00, status=Status.BAD_OPCODE)
        self.one("opcode/0x08", 0x08, status=Status.BAD_OPCODE)
        self.one("opcode/0x7F-with-payload", 0x7F, b"abc", status=Status.BAD_OPCODE)
        self.one("opcode/reply-opcode", Op.IDENTIFY | P.REPLY, status=Status.BAD_OPCODE)
        self.one("opcode/0xFF", 0xFF, bytes(16), status=Status.BAD_OPCODE)

    def oversized(self):
        """A length above max_payload: BAD_LENGTH as soon as the header is in, then length + 4
        bytes are skipped (a frame inside them is not one), or skipping ends silently after
        frame_timeout quiet cycles."""
        P_, T = self.P, self.T
        t = self.tag()
        inner, _ = self.frame(Op.IDENTIFY)  # skipped: never answered
        skip = (inner + bytes(P_ + 1 + 4))[: P_ + 1 + 4]
        after, ta = self.frame(Op.IDENTIFY)
        self.add("length/oversized-skipped",
                 [Send(_header(Op.WRITE, t, P_ + 1), replies=1), Send(skip + after, replies=2)],
                 [Reply(Status.BAD_LENGTH, Op.WRITE | P.REPLY, t, 0, b""),
                  Reply(Status.OK, Op.IDENTIFY | P.REPLY, ta, P.IDENTITY_SIZE)])
        t = self.tag()
        self.add("length/oversized-then-quiet",
                 [Send(_header(Op.WRITE, t, P_ + 50) + bytes(min(P_ // 2, 64)), replies=1),
                  Idle(T + T // 4, replies=1)],
                 [Reply(Status.BAD_LENGTH, Op.WRITE | P.REPLY, t, 0, b"")],
                 "the skip ends silently after frame_timeout quiet cycles")
        t = self.tag()
        self.add("length/0xFFFFFFFF", [Send(_header(Op.GEMM, t, 0xFFFF_FFFF), replies=1), Idle(T + T // 4, replies=1)],
                 [Reply(Status.BAD_LENGTH, Op.GEMM | P.REPLY, t, 0, b"")],
                 "the largest length field: skipped until the pause, silently")
        t = self.tag()
        self.add("length/oversized-before-version",
                 [Send(_header(Op.IDENTIFY, t, P_ + 1, version=P.PROTOCOL_VERSION + 1) + bytes(P_ + 5), replies=1)],
                 [Reply(Status.BAD_LENGTH, Op.IDENTIFY | P.REPLY, t, 0, b"")],
                 "the length is checked when the header is in, before the CRC and the version")
        t = self.tag()
        body = _header(0x7E, t, P_ + 1)
        self.add("length/oversized-before-opcode", [Send(body + bytes(P_ + 5), replies=1)],
                 [Reply(Status.BAD_LENGTH, 0x7E | P.REPLY, t, 0, b"")])
        f, t = self.frame(Op.IDENTIFY, bytes(P_))
        self.add("length/max-payload-is-not-oversized",
                 [Send(f[: _HEADER.size], replies=0), Send(f[_HEADER.size:], replies=1)],
                 [Reply(Status.BAD_LENGTH, Op.IDENTIFY | P.REPLY, t, 0, b"")],
                 "max_payload bytes are received whole; IDENTIFY then refuses a payload")

    def timeout(self):
        """A frame cut short: TIMEOUT (tag 0xFFFF, the opcode if it arrived, else 0x80) after
        frame_timeout quiet cycles, not before; every byte restarts the count."""
        T = self.T
        quiet = T // 4
        write = P.encode_write(Target.B_CODES, 0, 0, 1, self.C, bytes(self.C * self.cb))
        for cut in (2, 3, 4, 9, 10, 12, -2):
            f, _ = self.frame(Op.WRITE, write)
            part = f[:cut]
            op = (Op.WRITE if len(part) > 3 else 0) | P.REPLY
            name = f"timeout/cut-{cut}" if cut > 0 else f"timeout/cut-in-crc{cut}"
            self.add(name, [Send(part, replies=0), Idle(quiet, replies=0), Idle(4 * T, replies=1)],
                     [Reply(Status.TIMEOUT, op, P.FRAME_TIMEOUT_TAG, 0, b"")])
        f, _ = self.frame(Op.WRITE, write)
        self.add("timeout/bytes-restart-the-count",
                 [Send(f[:12], replies=0), Idle(T // 2, replies=0), Send(f[12:14], replies=0),
                  Idle(T // 2, replies=0), Send(f[14:15], replies=0), Idle(T // 2, replies=0), Idle(4 * T, replies=1)],
                 [Reply(Status.TIMEOUT, Op.WRITE | P.REPLY, P.FRAME_TIMEOUT_TAG, 0, b"")])
        f, _ = self.frame(Op.IDENTIFY)
        self.add("timeout/lone-H-is-no-frame", [Send(b"H", replies=0), Idle(2 * T, replies=0)], [],
                 "a lone 'H' begins no frame: nothing to time out")
        # bytes sent behind a truncated frame are taken into it and lost with it
        f, t = self.frame(Op.WRITE, write)
        part = f[:_HEADER.size + 8]
        need = len(f) - len(part)
        nxt, _ = self.frame(Op.IDENTIFY)
        filler = bytes(max(0, need - len(nxt)))
        left = (nxt + filler)[need:]
        assert len(nxt + filler) >= need and P.MAGIC not in left and not left.endswith(P.MAGIC[:1])
        self.add("timeout/truncated-swallows-next", [Send(part, replies=0), Send(nxt + filler, replies=1)],
                 [Reply(Status.BAD_CRC, Op.WRITE | P.REPLY, t, 0, b"")],
                 "the next frame's bytes complete the truncated one, whose CRC fails; both are lost")

    def no_payload(self):
        """IDENTIFY, STATUS and RESET take no payload."""
        self.one("length/identify-payload", Op.IDENTIFY, b"\0", status=Status.BAD_LENGTH)
        self.one("length/status-payload", Op.STATUS, b"\0\0\0", status=Status.BAD_LENGTH)
        self.one("length/reset-payload", Op.RESET, b"\0", status=Status.BAD_LENGTH,
                 note="refused, so it clears nothing")

    def write(self):
        D, R, C, th, tw, cb = self.D, self.R, self.C, self.th, self.tw, self.cb
        ok_size = dict(size=0, data=b"")
        # valid writes, one per target (values where the device quantizes them)
        self.one("write/a-codes", Op.WRITE, P.encode_write(Target.A_CODES, 0, 0, 1, R, bytes(R * cb)), **ok_size)
        self.one("write/b-codes-last-row", Op.WRITE,
                 P.encode_write(Target.B_CODES, D - 1, D - C, 1, C, bytes(C * cb)), **ok_size)
        self.one("write/a-exponents", Op.WRITE,
                 P.encode_write(Target.A_EXPONENTS, D // th - 1, D // tw - 1, 1, 1, b"\x7f"), **ok_size)
        self.one("write/b-exponents", Op.WRITE, P.encode_write(Target.B_EXPONENTS, 0, 0, 1, 2 if D // tw > 1 else 1,
                                                                b"\x7f" * (2 if D // tw > 1 else 1)), **ok_size)
        self.one("write/acc", Op.WRITE, P.encode_write(Target.ACC, 1, C, 2, C, bytes(8 * C)), **ok_size)
        self.one("write/bias", Op.WRITE, P.encode_write(Target.BIAS, 0, 0, 1, C, bytes(4 * C)), **ok_size)
        # empty regions: a valid write of nothing
        self.one("write/empty-a-codes", Op.WRITE, P.encode_write(Target.A_CODES, 0, 0, 0, R, b""), **ok_size)
        self.one("write/empty-exponents", Op.WRITE, P.encode_write(Target.A_EXPONENTS, 1, 1, 0, 0, b""), **ok_size)
        self.one("write/empty-acc", Op.WRITE, P.encode_write(Target.ACC, 0, 0, 0, 0, b""), **ok_size)
        self.one("write/empty-bias", Op.WRITE, P.encode_write(Target.BIAS, 0, 0, 1, 0, b""), **ok_size)
        self.one("write/empty-b-values", Op.WRITE, P.encode_write(Target.B_VALUES, 0, 0, th, 0, b""),
                 self.served(self.vq), **ok_size, note="of values: only where the device quantizes them")
        self.write_length()
        self.write_address()
        self.write_descriptor()

    def write_length(self):
        """BAD_LENGTH: the header cut short, the data too short or too long."""
        R, C, th, tw, cb = self.R, self.C, self.th, self.tw, self.cb
        self.one("write-length/empty-payload", Op.WRITE, b"", status=Status.BAD_LENGTH)
        self.one("write-length/short-header", Op.WRITE, P.encode_write(Target.A_CODES, 0, 0, 1, R, b"")[:15],
                 status=Status.BAD_LENGTH)
        self.one("write-length/header-without-data", Op.WRITE, P.encode_write(Target.A_CODES, 0, 0, 1, R, b""),
                 status=Status.BAD_LENGTH)
        sizes = [("a-codes", Target.A_CODES, 1, R, R * cb), ("b-codes", Target.B_CODES, 2, C, 2 * C * cb),
                 ("a-exponents", Target.A_EXPONENTS, 1, 1, 1), ("b-exponents", Target.B_EXPONENTS, 1, 1, 1),
                 ("acc", Target.ACC, 1, C, 4 * C), ("bias", Target.BIAS, 1, C, 4 * C)]
        for what, target, rows, cols, n in sizes:
            for delta in (-1, 1):
                self.one(f"write-length/{what}{delta:+d}", Op.WRITE,
                         P.encode_write(target, 0, 0, rows, cols, bytes(n + delta)), status=Status.BAD_LENGTH)
        if 16 + 4 * th * tw + 4 <= self.P:
            # values: the descriptor is checked before the length (a device without the value
            # quantizer refuses the descriptor)
            for what, target, enc, width in (("a-values-fp32", Target.A_VALUES, 0, 4),
                                             ("b-values-bf16", Target.B_VALUES, 1, 2)):
                self.one(f"write-length/{what}-1", Op.WRITE,
                         P.encode_write(target, 0, 0, th, tw, bytes(width * th * tw - 1), encoding=enc),
                         Status.BAD_LENGTH if self.vq else Status.BAD_DESCRIPTOR)
            self.one("write-length/values-empty-region-with-data", Op.WRITE,
                     P.encode_write(Target.A_VALUES, 0, 0, 0, tw, bytes(4)),
                     Status.BAD_LENGTH if self.vq else Status.BAD_DESCRIPTOR)

    def write_address(self):
        """BAD_ADDRESS: outside the buffers, unaligned, unknown targets; checked before the
        data's length (4 bytes of data do) and before a values write's descriptor."""
        D, R, C, th, tw = self.D, self.R, self.C, self.th, self.tw
        bad = [("a-codes-rows-out", Target.A_CODES, D - 1, 0, 2, R),
               ("a-codes-row-at-end", Target.A_CODES, D, 0, 1, R),
               ("a-codes-cols-out", Target.A_CODES, 0, D - R, 1, 2 * R),
               ("b-codes-rows-out", Target.B_CODES, D - 1, 0, 2, C),
               ("b-codes-cols-out", Target.B_CODES, 0, D, 1, C),
               ("a-exponents-rows-out", Target.A_EXPONENTS, D // th, 0, 1, 1),
               ("a-exponents-cols-out", Target.A_EXPONENTS, 0, D // tw, 1, 1),
               ("b-exponents-cols-out", Target.B_EXPONENTS, 0, 0, 1, D // tw + 1),
               ("b-exponents-rows-out", Target.B_EXPONENTS, 0, 0, D // th + 1, 1),
               ("acc-rows-out", Target.ACC, D, 0, 1, C),
               ("acc-cols-out", Target.ACC, 0, D - C, 1, 2 * C),
               ("bias-row-1", Target.BIAS, 1, 0, 1, C),
               ("bias-rows-2", Target.BIAS, 0, 0, 2, C),
               ("bias-cols-out", Target.BIAS, 0, D - C, 1, 2 * C),
               ("a-values-region-out", Target.A_VALUES, D - th, D - tw, th, 2 * tw),
               ("b-values-rows-out", Target.B_VALUES, D, 0, th, tw),
               ("target-8", 8, 0, 0, 1, 1),
               ("target-0x80", 0x80, 0, 0, 1, 1),
               ("target-0xFF", 0xFF, 0, 0, 1, 1)]
        if R > 1:
            bad += [("a-codes-col-unaligned", Target.A_CODES, 0, R // 2, 1, R),
                    ("a-codes-cols-unaligned", Target.A_CODES, 0, 0, 1, R + 1)]
        if C > 1:
            bad += [("b-codes-col-unaligned", Target.B_CODES, 0, C // 2, 1, C),
                    ("acc-cols-unaligned", Target.ACC, 0, 0, 1, C + 1),
                    ("acc-col-unaligned", Target.ACC, 0, 1, 1, C),
                    ("bias-col-unaligned", Target.BIAS, 0, C // 2, 1, C)]
        if tw > 1:
            bad += [("a-values-col-unaligned", Target.A_VALUES, 0, 1, th, tw),
                    ("b-values-cols-unaligned", Target.B_VALUES, 0, 0, th, tw + 1)]
        if th > 1:
            bad += [("a-values-row-unaligned", Target.A_VALUES, 1, 0, th, tw),
                    ("b-values-rows-unaligned", Target.B_VALUES, 0, 0, th + 1, tw)]
        for what, target, row, col, rows, cols in bad:
            self.one(f"write-address/{what}", Op.WRITE, P.encode_write(target, row, col, rows, cols, bytes(4)),
                     status=Status.BAD_ADDRESS)
        self.one("write-address/before-descriptor", Op.WRITE,
                 P.encode_write(Target.A_VALUES, 0, D, th, tw, bytes(4), encoding=2, rounding=3),
                 status=Status.BAD_ADDRESS, note="the region is checked before the encoding and rounding")

    def write_descriptor(self):
        """BAD_DESCRIPTOR: an unknown encoding or rounding of values (before the length)."""
        th, tw = self.th, self.tw
        self.one("write-descriptor/encoding-2", Op.WRITE,
                 P.encode_write(Target.A_VALUES, 0, 0, th, tw, bytes(4), encoding=2), status=Status.BAD_DESCRIPTOR)
        self.one("write-descriptor/encoding-0xFF", Op.WRITE,
                 P.encode_write(Target.B_VALUES, 0, 0, th, tw, bytes(4), encoding=0xFF), status=Status.BAD_DESCRIPTOR)
        self.one("write-descriptor/rounding-3", Op.WRITE,
                 P.encode_write(Target.A_VALUES, 0, 0, th, tw, bytes(4), rounding=3), status=Status.BAD_DESCRIPTOR)

    def gemm_cases(self):
        D, s = self.D, self.s
        ok = self.result(s, s, OutFormat.FP32) + 4
        self.one("gemm/valid-fp32", Op.GEMM, self.gemm(), size=ok)
        self.one("gemm/valid-bf16-stochastic-code", Op.GEMM, self.gemm(out_format=OutFormat.BF16, rounding=2, seed=3),
                 size=self.result(s, s, OutFormat.BF16) + 4, note="an fp32 or bf16 result ignores its rounding")
        self.one("gemm-length/15", Op.GEMM, self.gemm()[:-1], status=Status.BAD_LENGTH)
        self.one("gemm-length/17", Op.GEMM, self.gemm() + b"\0", status=Status.BAD_LENGTH)
        self.one("gemm-length/0", Op.GEMM, b"", status=Status.BAD_LENGTH)
        self.one("gemm-length/read-descriptor", Op.GEMM, P.encode_read(s, s), status=Status.BAD_LENGTH)
        bad = [("m-0", dict(m=0)), ("n-0", dict(n=0)), ("k-0", dict(k=0)), ("m-above-size", dict(m=D + 1)),
               ("n-above-size", dict(n=D + 1)), ("k-above-size", dict(k=D + 1)), ("m-0xFFFF", dict(m=0xFFFF)),
               ("out-format-3", dict(out_format=3)), ("out-format-0xFF", dict(out_format=0xFF)),
               ("rounding-3-fp32", dict(rounding=3)), ("rounding-3-bfp", dict(out_format=OutFormat.BFP, rounding=3)),
               ("activation-0x20", dict(activation=0x20)), ("activation-0xFE", dict(activation=0xFE)),
               ("activation-past-functions", dict(activation=len(self.FUNCTIONS)))]
        if not self.square:
            bad += [("transpose-b-needed", dict(transpose_b=False)),
                    ("transpose-a-refused", dict(transpose_a=True, transpose_b=True))]
        if self.unbuilt_unary:
            bad.append((f"activation-unbuilt-{self.unbuilt_unary[0]}", dict(activation=self.fcode(self.unbuilt_unary[0]))))
        gradient = (self.grads or self.unbuilt_grads)[0]
        bad.append((f"activation-gradient-{gradient}", dict(activation=self.fcode(gradient))))
        for what, kw in bad:
            self.one(f"gemm-descriptor/{what}", Op.GEMM, self.gemm(**kw), status=Status.BAD_DESCRIPTOR)
        if self.unary:
            f = self.unary[0]
            self.one(f"gemm/activation-{f}", Op.GEMM, self.gemm(activation=self.fcode(f), out_format=OutFormat.BF16),
                     size=self.result(s, s, OutFormat.BF16) + 4)

    def read_cases(self):
        D, s = self.D, self.s
        self.one("read/valid-fp32", Op.READ, P.encode_read(s, s), size=self.result(s, s, OutFormat.FP32))
        self.one("read/valid-bf16-bias", Op.READ, P.encode_read(s, s, out_format=OutFormat.BF16, bias=True),
                 size=self.result(s, s, OutFormat.BF16))
        self.one("read-length/11", Op.READ, P.encode_read(s, s)[:-1], status=Status.BAD_LENGTH)
        self.one("read-length/13", Op.READ, P.encode_read(s, s) + b"\0", status=Status.BAD_LENGTH)
        self.one("read-length/gemm-descriptor", Op.READ, self.gemm(), status=Status.BAD_LENGTH)
        bad = [("m-0", dict(m=0)), ("n-0", dict(n=0)), ("m-above-size", dict(m=D + 1)), ("n-above-size", dict(n=D + 1)),
               ("out-format-3", dict(out_format=3)), ("rounding-3", dict(rounding=3)),
               ("activation-0x20", dict(activation=0x20)), ("activation-past-functions", dict(activation=len(self.FUNCTIONS)))]
        if self.unbuilt_unary:
            bad.append((f"activation-unbuilt-{self.unbuilt_unary[0]}", dict(activation=self.fcode(self.unbuilt_unary[0]))))
        gradient = (self.grads or self.unbuilt_grads)[0]
        bad.append((f"activation-gradient-{gradient}", dict(activation=self.fcode(gradient))))
        for what, kw in bad:
            kw = dict(dict(m=s, n=s), **kw)
            self.one(f"read-descriptor/{what}", Op.READ, P.encode_read(kw.pop("m"), kw.pop("n"), **kw),
                     status=Status.BAD_DESCRIPTOR)

    def elementwise(self):
        FUN = self.FUNCTIONS
        x = struct.pack("<2H", 0x3F80, 0xBF80)  # 1.0, -1.0
        self.one("elementwise-length/short-header", Op.ELEMENTWISE, P.encode_elementwise(0, b"")[:-1],
                 status=Status.BAD_LENGTH, note="a payload short of the fixed fields, whatever the function")
        self.one("elementwise-descriptor/past-functions", Op.ELEMENTWISE, P.encode_elementwise(len(FUN), x),
                 status=Status.BAD_DESCRIPTOR)
        self.one("elementwise-descriptor/0xFF", Op.ELEMENTWISE, P.encode_elementwise(0xFF, x),
                 status=Status.BAD_DESCRIPTOR)
        self.one("elementwise-descriptor/before-length", Op.ELEMENTWISE, P.encode_elementwise(len(FUN), x)[:-1],
                 status=Status.BAD_DESCRIPTOR, note="the function is checked before the data's length")
        for f in (self.unbuilt_unary[:1] + self.unbuilt_grads[:1]):
            g = x if f not in self.UNARY else b""
            self.one(f"elementwise-descriptor/unbuilt-{f}", Op.ELEMENTWISE, P.encode_elementwise(self.fcode(f), x, g),
                     status=Status.BAD_DESCRIPTOR)
            self.one(f"elementwise-descriptor/unbuilt-{f}-empty", Op.ELEMENTWISE,
                     P.encode_elementwise(self.fcode(f), b""), status=Status.BAD_DESCRIPTOR)
        if self.unary:
            code = self.fcode(self.unary[0])
            self.one(f"elementwise/{self.unary[0]}", Op.ELEMENTWISE, P.encode_elementwise(code, x), size=4)
            self.one(f"elementwise/{self.unary[0]}-empty", Op.ELEMENTWISE, P.encode_elementwise(code, b""), size=0,
                     data=b"", note="count 0 is a valid, empty request")
            payload = bytearray(P.encode_elementwise(code, x))
            payload[4] = 3  # count 3, two inputs
            self.one("elementwise-length/count-above-data", Op.ELEMENTWISE, bytes(payload), status=Status.BAD_LENGTH)
            self.one("elementwise-length/data-above-count", Op.ELEMENTWISE, P.encode_elementwise(code, x) + b"\0\0",
                     status=Status.BAD_LENGTH)
        if self.grads:
            code = self.fcode(self.grads[0])
            self.one(f"elementwise/{self.grads[0]}", Op.ELEMENTWISE, P.encode_elementwise(code, x, x), size=4)
            self.one("elementwise-length/gradient-without-g", Op.ELEMENTWISE, P.encode_elementwise(code, x),
                     status=Status.BAD_LENGTH)

    def units(self):
        """The optional units: a reduced device refuses the work of a unit it lacks
        (BAD_DESCRIPTOR); a device with the unit serves it."""
        th, tw, s = self.th, self.tw, self.s
        stochastic = P.ROUNDING_CODES["stochastic"]
        if 16 + 4 * th * tw <= self.P:
            for what, target, enc, rnd, present in (
                    ("a-values-fp32-toward-zero", Target.A_VALUES, 0, 1, self.vq),
                    ("b-values-bf16-nearest", Target.B_VALUES, 1, 0, self.vq),
                    ("b-values-bf16-stochastic", Target.B_VALUES, 1, stochastic, self.vq and self.st),
                    ("a-values-fp32-stochastic", Target.A_VALUES, 0, stochastic, self.vq and self.st)):
                width = 4 if enc == 0 else 2
                self.one(f"units/write-{what}", Op.WRITE,
                         P.encode_write(target, 0, 0, th, tw, bytes(width * th * tw), encoding=enc, rounding=rnd, seed=5),
                         self.served(present), size=0, data=b"")
        self.one("units/write-empty-stochastic-values", Op.WRITE,
                 P.encode_write(Target.A_VALUES, 0, 0, 0, 0, b"", rounding=stochastic),
                 self.served(self.vq and self.st), size=0, data=b"")
        bfp = self.result(s, s, OutFormat.BFP)
        for what, op, rnd, present in (("gemm-bfp-nearest", Op.GEMM, 0, self.bfp),
                                       ("gemm-bfp-stochastic", Op.GEMM, stochastic, self.bfp and self.st),
                                       ("read-bfp-toward-zero", Op.READ, 1, self.bfp),
                                       ("read-bfp-stochastic", Op.READ, stochastic, self.bfp and self.st)):
            if op == Op.GEMM:
                payload, size = self.gemm(out_format=OutFormat.BFP, rounding=rnd, seed=9), bfp + 4
            else:
                payload, size = P.encode_read(s, s, out_format=OutFormat.BFP, rounding=rnd, seed=9), bfp
            self.one(f"units/{what}", op, payload, self.served(present), size=size)
        self.one("units/read-fp32-stochastic-code", Op.READ, P.encode_read(s, s, rounding=stochastic),
                 size=self.result(s, s, OutFormat.FP32), note="the rounding of an fp32 result is unused")

    def reset(self):
        """RESET clears the counters, the last error and the last cycles (after counting
        itself); STATUS counts itself."""
        bad, tb = self.frame(0x00)
        rst, tr = self.frame(Op.RESET)
        self.add("reset/clears-counters", [Send(bad + rst, replies=2)],
                 [Reply(Status.BAD_OPCODE, P.REPLY, tb, 0, b""), Reply(Status.OK, Op.RESET | P.REPLY, tr, 0, b"")])
        rst, tr = self.frame(Op.RESET)
        bad, tb = self.frame(0x00)
        st, ts = self.frame(Op.STATUS)
        status = P.encode_status(P.DeviceStatus(1, 1, 0, Status.BAD_OPCODE))
        self.add("reset/then-status-counts-itself", [Send(rst + bad + st, replies=3)],
                 [Reply(Status.OK, Op.RESET | P.REPLY, tr, 0, b""), Reply(Status.BAD_OPCODE, P.REPLY, tb, 0, b""),
                  Reply(Status.OK, Op.STATUS | P.REPLY, ts, _STATUS_SIZE, status)])
        read, td = self.frame(Op.READ, P.encode_read(self.s, self.s))
        rst, tr = self.frame(Op.RESET)
        self.add("reset/clears-last-cycles", [Send(read, replies=1), Send(rst, replies=2)],
                 [Reply(Status.OK, Op.READ | P.REPLY, td, self.result(self.s, self.s, OutFormat.FP32)),
                  Reply(Status.OK, Op.RESET | P.REPLY, tr, 0, b"")])
        bad, tb = self.frame(Op.RESET, b"\0\0")
        ok, to = self.frame(Op.IDENTIFY)
        self.add("reset/with-payload-clears-nothing", [Send(bad + ok, replies=2)],
                 [Reply(Status.BAD_LENGTH, Op.RESET | P.REPLY, tb, 0, b""),
                  Reply(Status.OK, Op.IDENTIFY | P.REPLY, to, P.IDENTITY_SIZE)])

    def back_to_back(self):
        """Frames back to back: one reply each, in order; a refused one costs itself only."""
        frames, replies = [], []
        for op, size in ((Op.IDENTIFY, P.IDENTITY_SIZE), (Op.STATUS, _STATUS_SIZE), (Op.IDENTIFY, P.IDENTITY_SIZE)):
            f, t = self.frame(op)
            frames.append(f)
            replies.append(Reply(Status.OK, op | P.REPLY, t, size))
        self.add("b2b/three", [Send(b"".join(frames), replies=3)], replies)
        frames, replies = [], []
        for _ in range(16):
            f, t = self.frame(Op.IDENTIFY)
            frames.append(f)
            replies.append(Reply(Status.OK, Op.IDENTIFY | P.REPLY, t, P.IDENTITY_SIZE))
        self.add("b2b/sixteen", [Send(b"".join(frames), replies=16)], replies)
        crc, tc = self.frame(Op.IDENTIFY)
        crc = bytearray(crc)
        crc[-2] ^= 0x01
        good, tg = self.frame(Op.IDENTIFY)
        op0, t0 = self.frame(0x00)
        v2, tv = self.frame(Op.STATUS, version=P.PROTOCOL_VERSION + 1)
        gemm0, tz = self.frame(Op.GEMM, self.gemm(m=0))
        good2, tg2 = self.frame(Op.WRITE, P.encode_write(Target.ACC, 0, 0, 1, self.C, bytes(4 * self.C)))
        self.add("b2b/errors-between",
                 [Send(bytes(crc) + good + op0 + v2 + b"noise" + gemm0 + good2, replies=6)],
                 [Reply(Status.BAD_CRC, Op.IDENTIFY | P.REPLY, tc, 0, b""),
                  Reply(Status.OK, Op.IDENTIFY | P.REPLY, tg, P.IDENTITY_SIZE),
                  Reply(Status.BAD_OPCODE, P.REPLY, t0, 0, b""),
                  Reply(Status.BAD_VERSION, Op.STATUS | P.REPLY, tv, 0, b""),
                  Reply(Status.BAD_DESCRIPTOR, Op.GEMM | P.REPLY, tz, 0, b""),
                  Reply(Status.OK, Op.WRITE | P.REPLY, tg2, 0, b"")])
        f, t = self.frame(Op.IDENTIFY)
        g, tg = self.frame(Op.GEMM, self.gemm(k=0))
        self.add("b2b/byte-by-byte", [Send(f[i:i + 1]) for i in range(len(f))] + [Send(g[i:i + 1]) for i in range(len(g))],
                 [Reply(Status.OK, Op.IDENTIFY | P.REPLY, t, P.IDENTITY_SIZE),
                  Reply(Status.BAD_DESCRIPTOR, Op.GEMM | P.REPLY, tg, 0, b"")])
        C = self.C
        vals = struct.pack(f"<{C}f", *[float(i + 1) for i in range(C)])
        w, tw = self.frame(Op.WRITE, P.encode_write(Target.ACC, 0, 0, 1, C, vals))
        r, tr = self.frame(Op.READ, P.encode_read(1, C))
        self.add("b2b/write-then-read", [Send(w + r, replies=2)],
                 [Reply(Status.OK, Op.WRITE | P.REPLY, tw, 0, b""), Reply(Status.OK, Op.READ | P.REPLY, tr, 4 * C, vals)])


def cases(ident: P.Identity) -> list[Case]:
    """The conformance table for a device of identity ``ident`` (module docstring)."""
    return _Table(ident).build()


# ---- the driver ---------------------------------------------------------------------------------


def _status_frame() -> bytes:
    return P.encode_frame(Op.STATUS, STATUS_TAG)


def _fail(case: Case, what: str):
    return ConformanceError(f"{case.name}: {what}" + (f" ({case.note})" if case.note else ""))


def _check_reply(case: Case, i: int, got, want: Reply) -> None:
    where = f"reply {i + 1} of {len(case.replies)}"
    if not isinstance(got, P.Frame):
        raise _fail(case, f"{where}: a reply whose CRC or length does not check: {got!r}; expected {want}")
    desc = f"{Status(got.payload[0]).name if got.payload else 'no status'} (opcode {got.opcode:#04x}, tag {got.tag:#06x})"
    if got.version != P.PROTOCOL_VERSION:
        raise _fail(case, f"{where}: reply version {got.version}")
    if (got.opcode, got.tag) != (want.opcode, want.tag) or not got.payload or got.payload[0] != want.status:
        raise _fail(case, f"{where}: got {desc}, expected {want}")
    data = got.payload[1:]
    if want.size is not None and len(data) != want.size:
        raise _fail(case, f"{where}: {desc} with {len(data)} bytes of data, expected {want.size}")
    if want.data is not None and data != want.data:
        raise _fail(case, f"{where}: {desc} data {data[:32].hex()}..., expected {want.data[:32].hex()}...")


def _check_counters(case: Case, before: P.DeviceStatus | None, after: P.DeviceStatus) -> None:
    c = case.counters
    if c.reset:
        want_acc, want_ref = c.accepted + 1, c.refused  # + 1: the STATUS counts itself
        want_err = c.last_error if c.last_error is not None else Status.OK
    elif before is None:
        return
    else:
        want_acc, want_ref = before.accepted + c.accepted + 1, before.refused + c.refused
        want_err = c.last_error if c.last_error is not None else before.last_error
    got = (after.accepted, after.refused, after.last_error)
    if got != (want_acc, want_ref, want_err):
        raise _fail(case, f"STATUS after: accepted {got[0]}, refused {got[1]}, last error {Status(got[2]).name}; "
                          f"expected {want_acc}, {want_ref}, {Status(want_err).name}"
                          + (f" (before: {before.accepted}, {before.refused}, {Status(before.last_error).name})"
                             if before is not None else ""))
    if c.last_cycles == "zero" and after.last_cycles != 0:
        raise _fail(case, f"STATUS after: last cycles {after.last_cycles}, expected 0 (after RESET)")
    if c.last_cycles == "same" and before is not None and not c.reset and after.last_cycles != before.last_cycles:
        raise _fail(case, f"STATUS after: last cycles {after.last_cycles}, was {before.last_cycles}: "
                          "no GEMM or READ ran")


Action = tuple


def drive(case: Case, ident: P.Identity, before: P.DeviceStatus | None = None, *,
          patience: int | None = None) -> Generator[Action, bytes | None, P.DeviceStatus]:
    """Run ``case`` as a generator of actions: ``("write", data)``, ``("read",)`` (send the
    bytes read back in, maybe ``b""``), ``("advance", cycles)``. Returns (``StopIteration``'s
    value) the STATUS after the case; raises ``ConformanceError``. ``before``: the STATUS
    before (None: one is requested first). ``patience``: clock cycles to wait, in steps of
    ``frame_timeout / 8``, for replies that have not come (default ``4 * frame_timeout +
    100_000``)."""
    T = ident.frame_timeout
    step = max(1, T // 8)
    patience = 4 * T + 100_000 if patience is None else patience
    parser = P.FrameParser(max_payload=1 << 30)
    got: list = []

    def wait(count: int):
        """Read until ``count`` frames are in, letting time pass while nothing comes."""
        spent = 0
        while True:
            data = yield ("read",)
            if data:
                got.extend(parser.feed(bytes(data)))
            if len(got) >= count:
                return
            if not data:
                if spent >= patience:
                    return
                yield ("advance", step)
                spent += step

    def status(where: str) -> P.DeviceStatus:
        frame = got.pop()
        if not isinstance(frame, P.Frame) or (frame.opcode, frame.tag) != (Op.STATUS | P.REPLY, STATUS_TAG) \
                or frame.payload[:1] != bytes([Status.OK]) or len(frame.payload) != 1 + _STATUS_SIZE:
            raise _fail(case, f"the STATUS {where} the case got {frame!r}")
        return P.decode_status(frame.payload[1:])

    try:
        if before is None:
            yield ("write", _status_frame())
            yield from wait(1)
            if len(got) != 1:
                raise _fail(case, f"{len(got)} replies to the STATUS before the case")
            before = status("before")
        n = len(case.replies)
        for i, step_ in enumerate(case.steps):
            if isinstance(step_, Send):
                yield ("write", step_.data)
            else:
                yield ("advance", step_.cycles)
            if step_.replies is not None:
                yield from wait(step_.replies)
                if len(got) != step_.replies:
                    raise _fail(case, f"after step {i + 1} ({type(step_).__name__}): {len(got)} replies, "
                                      f"expected {step_.replies}; got {[_show(f) for f in got]}")
        yield ("write", _status_frame())
        yield from wait(n + 1)
        extra = yield ("read",)
        if extra:
            got.extend(parser.feed(bytes(extra)))
        if len(got) != n + 1:
            raise _fail(case, f"{len(got) - 1 if got else 0} replies, expected {n}: got {[_show(f) for f in got]}; "
                              f"expected {[str(r) for r in case.replies]}")
        after = status("after")
        for i, (frame, want) in enumerate(zip(got, case.replies)):
            _check_reply(case, i, frame, want)
        _check_counters(case, before, after)
        return after
    except ConformanceError:
        # leave the device ready for the next case: let any partial frame time out, drain
        yield ("advance", 2 * T + 16)
        yield ("read",)
        yield ("advance", 2 * T + 16)
        yield ("read",)
        raise


def _show(f) -> str:
    if isinstance(f, P.Frame):
        st = Status(f.payload[0]).name if f.payload and f.payload[0] in Status._value2member_map_ else "?"
        return f"{st}({f.opcode:#04x},{f.tag:#06x},{len(f.payload) - 1}B)"
    return repr(f)


def _run(gen, device) -> P.DeviceStatus:
    reply = None
    while True:
        try:
            action = gen.send(reply)
        except StopIteration as stop:
            return stop.value
        kind = action[0]
        reply = None
        if kind == "write":
            device.write(action[1])
        elif kind == "read":
            reply = device.read()
        else:
            device.advance(action[1])


def run_case(device, case: Case, ident: P.Identity, before: P.DeviceStatus | None = None, *,
             patience: int | None = None) -> P.DeviceStatus:
    """Run one case on a byte device (``write``, ``read``, ``advance``) and check its replies
    and STATUS counters; returns the STATUS after it. ``ConformanceError`` on a difference."""
    return _run(drive(case, ident, before, patience=patience), device)


def run_cases(device, table: Iterable[Case], ident: P.Identity, *, patience: int | None = None,
              on_result: Callable[[Case, Exception | None], None] | None = None) -> list[tuple[Case, Exception]]:
    """Run cases one after the other (each case's STATUS after is the next one's before);
    returns the failures, (case, error), after running them all (a failed case leaves the
    device resynchronized: the next one starts with a STATUS of its own)."""
    failures = []
    before = None
    for case in table:
        try:
            before = run_case(device, case, ident, before, patience=patience)
            err = None
        except ConformanceError as e:
            failures.append((case, e))
            before, err = None, e
        if on_result is not None:
            on_result(case, err)
    return failures


def identify(device, *, patience_cycles: int = 1_000_000, step: int = 1000) -> P.Identity:
    """IDENTIFY on a raw byte device (the identity a table is made for)."""
    device.write(P.encode_frame(Op.IDENTIFY, 0x0001))
    parser = P.FrameParser(max_payload=1 << 30)
    frames: list = []
    spent = 0
    while not frames:
        data = device.read()
        frames += parser.feed(data) if data else []
        if not data and not frames:
            if spent >= patience_cycles:
                raise ConformanceError("no reply to IDENTIFY")
            device.advance(step)
            spent += step
    (reply,) = frames
    if not isinstance(reply, P.Frame) or reply.payload[:1] != b"\0":
        raise ConformanceError(f"IDENTIFY: {reply!r}")
    return P.decode_identity(reply.payload[1:])
