"""The wire protocol (docs/protocol.md) as code: frames, CRC, opcodes, status codes, and the
encoding of every command and reply. Shared by the host driver, the ``emu`` device and the
gateware testbenches."""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass

import numpy as np

__all__ = [
    "MAGIC",
    "PROTOCOL_VERSION",
    "ABI_VERSION",
    "HEADER",
    "CRC_SIZE",
    "REPLY",
    "NO_ACTIVATION",
    "FRAME_TIMEOUT_TAG",
    "ROUNDING_CODES",
    "UNITS",
    "Op",
    "Status",
    "Target",
    "Encoding",
    "OutFormat",
    "Frame",
    "encode_frame",
    "encode_reply",
    "FrameParser",
    "Identity",
    "DeviceStatus",
    "encode_write",
    "decode_write",
    "encode_gemm",
    "decode_gemm",
    "encode_read",
    "decode_read",
    "encode_elementwise",
    "decode_elementwise",
    "decode_identity",
    "encode_identity",
    "encode_status",
    "decode_status",
    "GEMM_FLAGS",
    "code_bytes",
    "encode_codes",
    "decode_codes",
    "to_tile_major",
    "from_tile_major",
    "encode_bfp",
    "decode_bfp",
    "result_size",
    "encode_result",
    "decode_result",
    "decode_cycles",
    "WRITE_HEADER",
    "ELEMENTWISE_HEADER",
    "IDENTITY_SIZE",
]

MAGIC = b"HB"
PROTOCOL_VERSION = 1
#: The device interface a host speaks: (major, minor). A different major is refused.
ABI_VERSION = (1, 1)
#: magic, version, opcode, tag, length
HEADER = struct.Struct("<2sBBHI")
CRC_SIZE = 4
#: A reply's opcode is the request's with this bit set.
REPLY = 0x80
NO_ACTIVATION = 0xFF
#: The tag of a TIMEOUT reply (the truncated frame's tag may not have arrived).
FRAME_TIMEOUT_TAG = 0xFFFF
#: Rounding modes on the wire (WRITE of values, READ and GEMM's BFP output).
ROUNDING_CODES = {"nearest_even": 0, "toward_zero": 1, "stochastic": 2}
#: The units a reduced device may be built without, and their bits in IDENTIFY's ``omitted``
#: mask (a set bit: the unit is not there; 0, as from an ABI 1.0 device: the full device).
#: ``value_quantizer``: WRITE of values (the device quantizes); ``bfp_output``: GEMM and READ
#: results in BFP; ``stochastic``: stochastic rounding in the device's quantizers. The names
#: are ``hw.params.CoreConfig``'s fields.
UNITS = {"value_quantizer": 0, "bfp_output": 1, "stochastic": 2}


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


def encode_reply(opcode: int, tag: int, status: int = Status.OK, data: bytes = b"") -> bytes:
    """A reply frame: the request's opcode with ``REPLY`` set, its tag, the status byte, data."""
    return encode_frame((opcode | REPLY) & 0xFF, tag, bytes([status]) + data)


class FrameParser:
    """Splits a byte stream into frames. ``feed(data)`` returns the complete frames so far,
    each a ``Frame`` or, for a frame that failed, ``(Status.BAD_CRC, opcode, tag)`` or
    ``(Status.BAD_LENGTH, opcode, tag)`` (a length field above ``max_payload``).
    Bytes that do not start with the magic are skipped (resynchronization).

    Two behaviours, as docs/protocol.md describes them:

    - the host side (default): after a CRC failure the hunt for the magic resumes two bytes
      into the failed frame (a truncated frame costs that frame only), and so does it after
      a frame whose length field is too large, or one given up by ``expire()``;
    - the device side (``device=True``), as the gateware's packet engine does with bytes
      that go by only once: a failed frame is consumed whole (length + 4 bytes after its
      header), a too-long frame is reported as soon as its header is in and its ``length +
      4`` remaining bytes are skipped, and ``expire()`` (a frame that stopped arriving)
      drops everything received of the frame."""

    def __init__(self, max_payload: int = 1 << 24, *, device: bool = False):
        self.buf = bytearray()
        self.max_payload = max_payload
        self.device = device
        #: Bytes still to be skipped of an oversized frame.
        self.skip = 0

    @property
    def in_progress(self) -> bool:
        """A frame has begun (its magic is in) but is not complete."""
        return self.skip == 0 and self.buf[:2] == MAGIC

    @property
    def skipping(self) -> bool:
        return self.skip > 0

    @property
    def partial_opcode(self) -> int | None:
        """The opcode of the frame in progress, if its byte has arrived."""
        return self.buf[3] if self.in_progress and len(self.buf) > 3 else None

    def expire(self) -> list:
        """Give up the partial frame (or the skip of an oversized one). Returns the frames
        found in what was buffered behind it (host side)."""
        if self.skip:
            self.skip = 0
            return self.feed(b"")
        if self.buf[:2] == MAGIC:
            if self.device:
                self.buf.clear()
            else:
                del self.buf[:2]
        return self.feed(b"")

    def feed(self, data: bytes) -> list:
        self.buf += data
        out = []
        while True:
            if self.skip:
                n = min(self.skip, len(self.buf))
                del self.buf[:n]
                self.skip -= n
                if self.skip:
                    return out
            i = self.buf.find(MAGIC)
            if i < 0:
                del self.buf[: max(0, len(self.buf) - 1)]
                if self.buf[:1] != MAGIC[:1]:
                    self.buf.clear()
                return out
            del self.buf[:i]
            if len(self.buf) < HEADER.size:
                return out
            _, version, opcode, tag, length = HEADER.unpack_from(self.buf)
            if length > self.max_payload:
                out.append((Status.BAD_LENGTH, opcode, tag))
                if self.device:
                    del self.buf[: HEADER.size]
                    self.skip = length + CRC_SIZE
                else:
                    del self.buf[:2]
                continue
            end = HEADER.size + length + CRC_SIZE
            if len(self.buf) < end:
                return out
            body = bytes(self.buf[: HEADER.size + length])
            (crc,) = struct.unpack_from("<I", self.buf, HEADER.size + length)
            if zlib.crc32(body) != crc:
                out.append((Status.BAD_CRC, opcode, tag))
                # The host hunts for the next magic inside what it took for a frame.
                del self.buf[: end if self.device else 2]
                continue
            out.append(Frame(opcode, tag, body[HEADER.size :], version))
            del self.buf[:end]


# ---- command payloads -------------------------------------------------------------------

_WRITE = struct.Struct("<BBBBIHHHH")
_GEMM = struct.Struct("<HHHBBBBHI")
_READ = struct.Struct("<HHBBBBI")
_ELEMENTWISE = struct.Struct("<BBHI")
_IDENTITY = struct.Struct("<BBBBHHBBBBHHIIII")
_STATUS = struct.Struct("<IIIB3x")
_CYCLES = struct.Struct("<I")

#: Size of a WRITE request's header (before the data).
WRITE_HEADER = _WRITE.size
#: Size of an ELEMENTWISE request's header (before x and g).
ELEMENTWISE_HEADER = _ELEMENTWISE.size


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
    omitted: int = 0  # the units left out: bit UNITS[name]

    @property
    def abi(self) -> tuple[int, int]:
        return (self.abi_major, self.abi_minor)

    @property
    def tile(self) -> tuple[int, int]:
        return (self.tile_rows, self.tile_cols)

    @property
    def tk(self) -> int:
        """The K-tile (the tile's column side)."""
        return self.tile_cols

    @property
    def square(self) -> bool:
        return self.tile_rows == self.tile_cols

    def fmt(self, rounding: str = "nearest_even"):
        """The device's BFP format (``hbfp.golden.bfp.Format``) with a rounding mode."""
        from hbfp.golden.bfp import Format

        return Format(self.mantissa_bits, self.tile, rounding)

    @property
    def functions(self) -> tuple[str, ...]:
        """Names of the activation units built (``hw.activation.FUNCTIONS`` codes)."""
        from hbfp.hw.activation import FUNCTIONS

        return tuple(name for code, name in enumerate(FUNCTIONS) if self.functions_mask >> code & 1)

    def has(self, unit: str) -> bool:
        """Whether the device was built with ``unit`` (a name of ``UNITS``)."""
        if unit not in UNITS:
            raise ValueError(f"unknown unit {unit!r}; units: {', '.join(UNITS)}")
        return not self.omitted >> UNITS[unit] & 1

    @property
    def units(self) -> tuple[str, ...]:
        """The optional units built (``UNITS`` names)."""
        return tuple(u for u in UNITS if self.has(u))


#: Size of the IDENTIFY reply's data.
IDENTITY_SIZE = _IDENTITY.size


def encode_identity(ident: Identity) -> bytes:
    return _IDENTITY.pack(
        ident.protocol_version, ident.abi_major, ident.abi_minor, ident.stream_bytes, ident.rows, ident.cols,
        ident.mantissa_bits, ident.tile_rows, ident.tile_cols, ident.leaky_shift, ident.size,
        ident.functions_mask, ident.clock_hz, ident.max_payload, ident.frame_timeout, ident.omitted,
    )


def decode_identity(data: bytes) -> Identity:
    fields = _IDENTITY.unpack(data[: _IDENTITY.size])
    return Identity(*fields)


@dataclass(frozen=True)
class DeviceStatus:
    """The STATUS reply: frames accepted and refused (any error status) since reset, the
    cycles of the last GEMM or READ, and the last error status (``OK`` if none)."""

    accepted: int
    refused: int
    last_cycles: int
    last_error: Status


def encode_status(s: DeviceStatus) -> bytes:
    return _STATUS.pack(s.accepted, s.refused, s.last_cycles, int(s.last_error))


def decode_status(data: bytes) -> DeviceStatus:
    accepted, refused, cycles, last = _STATUS.unpack(data[: _STATUS.size])
    return DeviceStatus(accepted, refused, cycles, Status(last))


# ---- data layouts -----------------------------------------------------------------------


def code_bytes(mantissa_bits: int) -> int:
    """Bytes of one code on the wire: one for m <= 8, two (two's complement) up to 16."""
    return 1 if mantissa_bits <= 8 else 2


def _code_wire_dtype(mantissa_bits: int) -> np.dtype:
    return np.dtype(np.int8) if mantissa_bits <= 8 else np.dtype("<i2")


def encode_codes(codes: np.ndarray, mantissa_bits: int) -> bytes:
    """Codes, row-major, one or two bytes each."""
    return np.ascontiguousarray(codes, dtype=_code_wire_dtype(mantissa_bits)).tobytes()


def decode_codes(data: bytes, rows: int, cols: int, mantissa_bits: int) -> np.ndarray:
    """Codes as int8 (m <= 8) or int16, shape (rows, cols), sign-extended from m bits."""
    raw = np.frombuffer(data, dtype=_code_wire_dtype(mantissa_bits), count=rows * cols).reshape(rows, cols)
    dtype = np.int8 if mantissa_bits <= 8 else np.int16
    if mantissa_bits in (8, 16):
        return raw.astype(dtype)
    # A buffer word holds m bits: the code is the low m bits, sign-extended.
    wide = raw.astype(np.int32) & ((1 << mantissa_bits) - 1)
    wide = np.where(wide >= 1 << (mantissa_bits - 1), wide - (1 << mantissa_bits), wide)
    return wide.astype(dtype)


def to_tile_major(x: np.ndarray, tile: tuple[int, int]) -> np.ndarray:
    """The elements of a matrix in tile-major order (tiles row-major over the tile grid,
    elements row-major within a tile), padded with zeros to whole tiles; a flat array."""
    th, tw = tile
    rows, cols = x.shape
    tr, tc = -(-rows // th), -(-cols // tw)
    if (rows, cols) != (tr * th, tc * tw):
        p = np.zeros((tr * th, tc * tw), dtype=x.dtype)
        p[:rows, :cols] = x
        x = p
    return np.ascontiguousarray(x.reshape(tr, th, tc, tw).transpose(0, 2, 1, 3)).reshape(-1)


def from_tile_major(flat: np.ndarray, rows: int, cols: int, tile: tuple[int, int]) -> np.ndarray:
    """Inverse of ``to_tile_major``: the rows x cols matrix (padding dropped)."""
    th, tw = tile
    tr, tc = -(-rows // th), -(-cols // tw)
    x = np.asarray(flat).reshape(tr, tc, th, tw).transpose(0, 2, 1, 3).reshape(tr * th, tc * tw)
    return x[:rows, :cols]


def encode_bfp(t) -> bytes:
    """A BFP matrix as the GEMM reply carries it: its tile grid, tile-major, each tile its
    E8M0 exponent byte followed by ``th x tw`` codes (padding included, zeros)."""
    th, tw = t.fmt.tile
    tr, tc = t.exponents.shape
    cb = code_bytes(t.fmt.mantissa_bits)
    codes = to_tile_major(t.codes.astype(_code_wire_dtype(t.fmt.mantissa_bits)), t.fmt.tile)
    out = np.empty((tr * tc, 1 + th * tw * cb), dtype=np.uint8)
    out[:, 0] = t.exponents.reshape(-1)
    out[:, 1:] = codes.view(np.uint8).reshape(tr * tc, th * tw * cb)
    return out.tobytes()


def decode_bfp(data: bytes, m: int, n: int, fmt):
    """Inverse of ``encode_bfp``: a ``BFPTensor`` of shape (m, n) in ``fmt``."""
    from hbfp.golden.bfp import BFPTensor

    th, tw = fmt.tile
    tr, tc = -(-m // th), -(-n // tw)
    cb = code_bytes(fmt.mantissa_bits)
    arr = np.frombuffer(data, dtype=np.uint8, count=tr * tc * (1 + th * tw * cb)).reshape(tr * tc, 1 + th * tw * cb)
    exps = np.ascontiguousarray(arr[:, 0]).reshape(tr, tc)
    flat = np.ascontiguousarray(arr[:, 1:]).view(_code_wire_dtype(fmt.mantissa_bits)).reshape(-1)
    codes = from_tile_major(flat, m, n, fmt.tile).astype(fmt.code_dtype)
    return BFPTensor(np.ascontiguousarray(codes), exps, fmt)


def result_size(m: int, n: int, out_format: int, mantissa_bits: int, tile: tuple[int, int]) -> int:
    """Bytes of a GEMM/READ result (after the u32 cycles)."""
    if out_format == OutFormat.FP32:
        return 4 * m * n
    if out_format == OutFormat.BF16:
        return 2 * m * n
    th, tw = tile
    return -(-m // th) * -(-n // tw) * (1 + th * tw * code_bytes(mantissa_bits))


def encode_result(cycles: int, result, out_format: int) -> bytes:
    """A GEMM/READ reply's data: u32 cycles, then the result (fp32 array, bf16 patterns
    as uint16, or a BFPTensor)."""
    head = _CYCLES.pack(cycles & 0xFFFFFFFF)
    if out_format == OutFormat.FP32:
        return head + np.ascontiguousarray(result, dtype="<f4").tobytes()
    if out_format == OutFormat.BF16:
        return head + np.ascontiguousarray(result, dtype="<u2").tobytes()
    return head + encode_bfp(result)


def decode_result(data: bytes, m: int, n: int, out_format: int, fmt, *, cycles: bool = True):
    """(cycles, result) from a GEMM reply's data (``cycles=False``: a READ reply, which has
    no cycles; they are None): an fp32 array, an ``ml_dtypes.bfloat16`` array or a
    ``BFPTensor`` (in ``fmt``). ``ValueError`` when the size is wrong."""
    head = _CYCLES.size if cycles else 0
    need = head + result_size(m, n, out_format, fmt.mantissa_bits, fmt.tile)
    if len(data) != need:
        raise ValueError(f"a {m}x{n} {OutFormat(out_format).name} result needs {need} bytes, got {len(data)}")
    count = _CYCLES.unpack_from(data)[0] if cycles else None
    body = data[head:]
    if out_format == OutFormat.FP32:
        return count, np.frombuffer(body, dtype="<f4").reshape(m, n).astype(np.float32)
    if out_format == OutFormat.BF16:
        import ml_dtypes

        return count, np.frombuffer(body, dtype="<u2").reshape(m, n).astype(np.uint16).view(ml_dtypes.bfloat16)
    return count, decode_bfp(body, m, n, fmt)


def decode_cycles(data: bytes) -> int:
    """The u32 cycles at the start of a GEMM/READ reply's data."""
    return _CYCLES.unpack_from(data)[0]
