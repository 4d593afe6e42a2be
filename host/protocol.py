"""The wire protocol (docs/protocol.md) as code: frames, CRC, opcodes, status codes, and the
encoding of every command and reply. Shared by the host driver, the ``emu`` device and the
gateware testbenches."""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass

__all__ = [
    "MAGIC",
    "PROTOCOL_VERSION",
    "ABI_VERSION",
    "HEADER",
    "CRC_SIZE",
    "REPLY",
    "NO_ACTIVATION",
    "FRAME_TIMEOUT_TAG",
    "Op",
    "Status",
    "Target",
    "Encoding",
    "OutFormat",
    "Frame",
    "encode_frame",
    "FrameParser",
    "Identity",
    "encode_write",
    "encode_gemm",
    "encode_read",
    "encode_elementwise",
    "decode_identity",
    "encode_identity",
    "GEMM_FLAGS",
]

MAGIC = b"HB"
PROTOCOL_VERSION = 1
#: The device interface a host speaks: (major, minor). A different major is refused.
ABI_VERSION = (1, 0)
#: magic, version, opcode, tag, length
HEADER = struct.Struct("<2sBBHI")
CRC_SIZE = 4
#: A reply's opcode is the request's with this bit set.
REPLY = 0x80
NO_ACTIVATION = 0xFF
#: The tag of a TIMEOUT reply (the truncated frame's tag may not have arrived).
FRAME_TIMEOUT_TAG = 0xFFFF


class Op(enum.IntEnum):
    IDENTIFY = 0x01
    WRITE = 0x02
    READ = 0x03
    GEMM = 0x04
    ELEMENTWISE = 0x05
    STATUS = 0x06
    RESET = 0x07


class Status(enum.IntEnum):
    OK = 0
    BAD_CRC = 1
    BAD_OPCODE = 2
    BAD_LENGTH = 3
    BAD_ADDRESS = 4
    BAD_DESCRIPTOR = 5
    BAD_VERSION = 6
    TIMEOUT = 7


class Target(enum.IntEnum):
    A_CODES = 0
    B_CODES = 1
    A_EXPONENTS = 2
    B_EXPONENTS = 3
    ACC = 4
    BIAS = 5
    A_VALUES = 6
    B_VALUES = 7


class Encoding(enum.IntEnum):
    FP32 = 0
    BF16 = 1


class OutFormat(enum.IntEnum):
    FP32 = 0
    BF16 = 1
    BFP = 2


GEMM_FLAGS = {"transpose_a": 1, "transpose_b": 2, "accumulate": 4, "bias": 8}


@dataclass(frozen=True)
class Frame:
    opcode: int
    tag: int
    payload: bytes
    version: int = PROTOCOL_VERSION

    @property
    def is_reply(self) -> bool:
        return bool(self.opcode & REPLY)

    @property
    def status(self) -> Status:
        """A reply's status (its first payload byte)."""
        return Status(self.payload[0])

    @property
    def data(self) -> bytes:
        """A reply's data (after the status byte)."""
        return self.payload[1:]


def encode_frame(opcode: int, tag: int, payload: bytes = b"", *, version: int = PROTOCOL_VERSION) -> bytes:
    head = HEADER.pack(MAGIC, version, opcode, tag & 0xFFFF, len(payload))
    body = head + payload
    return body + struct.pack("<I", zlib.crc32(body))


class FrameParser:
    """Splits a byte stream into frames. ``feed(data)`` returns the complete frames so far,
    each a ``Frame`` or, for a frame whose CRC failed, ``(Status.BAD_CRC, opcode, tag)``.
    Bytes that do not start with the magic are skipped (resynchronization)."""

    def __init__(self, max_payload: int = 1 << 24):
        self.buf = bytearray()
        self.max_payload = max_payload

    def feed(self, data: bytes) -> list:
        self.buf += data
        out = []
        while True:
            i = self.buf.find(MAGIC)
            if i < 0:
                del self.buf[: max(0, len(self.buf) - 1)]
                return out
            del self.buf[:i]
            if len(self.buf) < HEADER.size:
                return out
            _, version, opcode, tag, length = HEADER.unpack_from(self.buf)
            if length > self.max_payload:
                out.append((Status.BAD_LENGTH, opcode, tag))
                del self.buf[:2]
                continue
            end = HEADER.size + length + CRC_SIZE
            if len(self.buf) < end:
                return out
            body = bytes(self.buf[: HEADER.size + length])
            (crc,) = struct.unpack_from("<I", self.buf, HEADER.size + length)
            if zlib.crc32(body) != crc:
                out.append((Status.BAD_CRC, opcode, tag))
                del self.buf[:2]  # hunt for the next magic inside what we took for a frame
                continue
            out.append(Frame(opcode, tag, body[HEADER.size :], version))
            del self.buf[:end]


# ---- command payloads -------------------------------------------------------------------

_WRITE = struct.Struct("<BBBBIHHHH")
_GEMM = struct.Struct("<HHHBBBBHI")
_READ = struct.Struct("<HHBBBBI")
_ELEMENTWISE = struct.Struct("<BBHI")
_IDENTITY = struct.Struct("<BBBBHHBBBBHHIIII")


def encode_write(target: int, row: int, col: int, rows: int, cols: int, data: bytes, *,
                 encoding: int = 0, rounding: int = 0, seed: int = 0) -> bytes:
    return _WRITE.pack(target, encoding, rounding, 0, seed & 0xFFFFFFFF, row, col, rows, cols) + data


def decode_write(payload: bytes):
    """(target, encoding, rounding, seed, row, col, rows, cols, data) or None if too short."""
    if len(payload) < _WRITE.size:
        return None
    target, encoding, rounding, _, seed, row, col, rows, cols = _WRITE.unpack_from(payload)
    return target, encoding, rounding, seed, row, col, rows, cols, payload[_WRITE.size :]


def encode_gemm(m: int, n: int, k: int, *, transpose_a=False, transpose_b=False, accumulate=False,
                bias=False, activation: int = NO_ACTIVATION, out_format: int = OutFormat.FP32,
                rounding: int = 0, seed: int = 0) -> bytes:
    flags = (
        GEMM_FLAGS["transpose_a"] * bool(transpose_a)
        | GEMM_FLAGS["transpose_b"] * bool(transpose_b)
        | GEMM_FLAGS["accumulate"] * bool(accumulate)
        | GEMM_FLAGS["bias"] * bool(bias)
    )
    return _GEMM.pack(m, n, k, flags, activation, out_format, rounding, 0, seed & 0xFFFFFFFF)


def decode_gemm(payload: bytes):
    """dict of the GEMM fields, or None when the length is wrong."""
    if len(payload) != _GEMM.size:
        return None
    m, n, k, flags, activation, out_format, rounding, _, seed = _GEMM.unpack(payload)
    return dict(m=m, n=n, k=k, flags=flags, activation=activation, out_format=out_format, rounding=rounding, seed=seed)


def encode_read(m: int, n: int, *, out_format: int = OutFormat.FP32, activation: int = NO_ACTIVATION,
                bias: bool = False, rounding: int = 0, seed: int = 0) -> bytes:
    return _READ.pack(m, n, out_format, activation, GEMM_FLAGS["bias"] * bool(bias), rounding, seed & 0xFFFFFFFF)


def decode_read(payload: bytes):
    if len(payload) != _READ.size:
        return None
    m, n, out_format, activation, flags, rounding, seed = _READ.unpack(payload)
    return dict(m=m, n=n, k=0, flags=flags & GEMM_FLAGS["bias"], activation=activation, out_format=out_format,
                rounding=rounding, seed=seed)


def encode_elementwise(function: int, x: bytes, g: bytes = b"") -> bytes:
    return _ELEMENTWISE.pack(function, 0, 0, len(x) // 2) + x + g


def decode_elementwise(payload: bytes):
    if len(payload) < _ELEMENTWISE.size:
        return None
    function, _, _, count = _ELEMENTWISE.unpack_from(payload)
    return function, count, payload[_ELEMENTWISE.size :]


@dataclass(frozen=True)
class Identity:
    protocol_version: int
    abi_major: int
    abi_minor: int
    stream_bytes: int
    rows: int
    cols: int
    mantissa_bits: int
    tile_rows: int
    tile_cols: int
    leaky_shift: int
    size: int
    functions_mask: int
    clock_hz: int
    max_payload: int
    frame_timeout: int


def encode_identity(ident: Identity) -> bytes:
    return _IDENTITY.pack(
        ident.protocol_version, ident.abi_major, ident.abi_minor, ident.stream_bytes, ident.rows, ident.cols,
        ident.mantissa_bits, ident.tile_rows, ident.tile_cols, ident.leaky_shift, ident.size,
        ident.functions_mask, ident.clock_hz, ident.max_payload, ident.frame_timeout, 0,
    )


def decode_identity(data: bytes) -> Identity:
    fields = _IDENTITY.unpack(data[: _IDENTITY.size])
    return Identity(*fields[:15])
