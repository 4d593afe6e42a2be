"""The wire protocol (docs/protocol.md) as code: frames, CRC, opcodes, status codes, and the
encoding of every command and reply. Shared by the host driver, the ``emu`` device and the
gateware testbenches."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

from hbfp import contract as C
from hbfp.contract import (
    ABI_VERSION,
    CRC_SIZE,
    FRAME_TIMEOUT_TAG,
    MAGIC,
    NO_ACTIVATION,
    PROTOCOL_VERSION,
    REPLY,
    ROUNDING_CODES,
    DeviceStatus,
    Encoding,
    GemmFlag,
    Identity,
    Op,
    OutFormat,
    Rounding,
    Status,
    Target,
    Unit,
)

__all__ = [
    "MAGIC",
    "PROTOCOL_VERSION",
    "ABI_VERSION",
    "HEADER",
    "CYCLES_SIZE",
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

# The codes and layouts are the device contract's (hbfp.contract), re-exported here for the
# host's code that reads them as protocol names.
HEADER = C.HEADER.struct  # magic, version, opcode, tag, length
#: Bytes of the u32 cycles that end a GEMM reply's data.
CYCLES_SIZE = C.CYCLES.size
#: The optional units by ``CoreConfig`` field name -> bit of IDENTIFY's ``omitted`` mask.
UNITS = {u.label: int(u) for u in Unit}
GEMM_FLAGS = {f.name.lower(): int(f) for f in GemmFlag}


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
    head = C.HEADER.pack(magic=C.MAGIC_WORD, version=version, opcode=opcode, tag=tag & 0xFFFF,
                         length=len(payload))
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


# ---- command payloads: generated from the contract's descriptors --------------------------

_CYCLES = C.CYCLES.struct
#: Size of a WRITE request's header (before the data).
WRITE_HEADER = C.WRITE.size
#: Size of an ELEMENTWISE request's header (before x and g).
ELEMENTWISE_HEADER = C.ELEMENTWISE.size
#: Size of the IDENTIFY reply's data.
IDENTITY_SIZE = C.IDENTITY.size


def _flags(**named) -> int:
    return int(sum((GemmFlag[name.upper()] for name, on in named.items() if on), GemmFlag(0)))


def encode_write(target: int, row: int, col: int, rows: int, cols: int, data: bytes, *,
                 encoding: int = 0, rounding: int = 0, seed: int = 0) -> bytes:
    return C.WRITE.pack(target=target, encoding=encoding, rounding=rounding, seed=seed & 0xFFFFFFFF,
                        row=row, col=col, rows=rows, cols=cols) + data


def decode_write(payload: bytes):
    """(target, encoding, rounding, seed, row, col, rows, cols, data) or None if too short."""
    if len(payload) < C.WRITE.size:
        return None
    d = C.WRITE.unpack(payload)
    return (d["target"], d["encoding"], d["rounding"], d["seed"], d["row"], d["col"], d["rows"], d["cols"],
            payload[C.WRITE.size:])


def encode_gemm(m: int, n: int, k: int, *, transpose_a=False, transpose_b=False, accumulate=False,
                bias=False, activation: int = NO_ACTIVATION, out_format: int = OutFormat.FP32,
                rounding: int = 0, seed: int = 0) -> bytes:
    flags = _flags(transpose_a=transpose_a, transpose_b=transpose_b, accumulate=accumulate, bias=bias)
    return C.GEMM.pack(m=m, n=n, k=k, flags=flags, activation=activation, out_format=out_format,
                       rounding=rounding, seed=seed & 0xFFFFFFFF)


def decode_gemm(payload: bytes):
    """dict of the GEMM fields, or None when the length is wrong."""
    if len(payload) != C.GEMM.size:
        return None
    return C.GEMM.unpack(payload)


def encode_read(m: int, n: int, *, out_format: int = OutFormat.FP32, activation: int = NO_ACTIVATION,
                bias: bool = False, rounding: int = 0, seed: int = 0) -> bytes:
    return C.READ.pack(m=m, n=n, out_format=out_format, activation=activation, flags=_flags(bias=bias),
                       rounding=rounding, seed=seed & 0xFFFFFFFF)


def decode_read(payload: bytes):
    """dict of the READ fields as GEMM's (``k`` = 0, only the bias flag), or None when the
    length is wrong."""
    if len(payload) != C.READ.size:
        return None
    d = C.READ.unpack(payload)
    d["k"] = 0
    d["flags"] &= GemmFlag.BIAS
    return d


def encode_elementwise(function: int, x: bytes, g: bytes = b"") -> bytes:
    return C.ELEMENTWISE.pack(function=function, count=len(x) // 2) + x + g


def decode_elementwise(payload: bytes):
    if len(payload) < C.ELEMENTWISE.size:
        return None
    d = C.ELEMENTWISE.unpack(payload)
    return d["function"], d["count"], payload[C.ELEMENTWISE.size:]


def encode_identity(ident: Identity) -> bytes:
    return ident.encode()


def decode_identity(data: bytes) -> Identity:
    return Identity.decode(data[: C.IDENTITY.size])


def encode_status(s: DeviceStatus) -> bytes:
    return s.encode()


def decode_status(data: bytes) -> DeviceStatus:
    return DeviceStatus.decode(data[: C.STATUS.size])


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
    """Bytes of a GEMM/READ result (a GEMM's u32 cycles after it not counted)."""
    if out_format == OutFormat.FP32:
        return 4 * m * n
    if out_format == OutFormat.BF16:
        return 2 * m * n
    th, tw = tile
    return -(-m // th) * -(-n // tw) * (1 + th * tw * code_bytes(mantissa_bits))


def encode_result(cycles: int | None, result, out_format: int) -> bytes:
    """A GEMM reply's data: the result (fp32 array, bf16 patterns as uint16, or a
    BFPTensor), then the u32 cycles; a READ reply's (``cycles`` None): the result alone."""
    if out_format == OutFormat.FP32:
        body = np.ascontiguousarray(result, dtype="<f4").tobytes()
    elif out_format == OutFormat.BF16:
        body = np.ascontiguousarray(result, dtype="<u2").tobytes()
    else:
        body = encode_bfp(result)
    return body if cycles is None else body + _CYCLES.pack(cycles & 0xFFFFFFFF)


def decode_result(data: bytes, m: int, n: int, out_format: int, fmt, *, cycles: bool = True):
    """(cycles, result) from a GEMM reply's data (``cycles=False``: a READ reply, which has
    no cycles; they are None): an fp32 array, an ``ml_dtypes.bfloat16`` array or a
    ``BFPTensor`` (in ``fmt``). ``ValueError`` when the size is wrong."""
    tail = _CYCLES.size if cycles else 0
    size = result_size(m, n, out_format, fmt.mantissa_bits, fmt.tile)
    if len(data) != size + tail:
        raise ValueError(f"a {m}x{n} {OutFormat(out_format).name} result needs {size + tail} bytes, got {len(data)}")
    count = _CYCLES.unpack_from(data, size)[0] if cycles else None
    body = data[:size]
    if out_format == OutFormat.FP32:
        return count, np.frombuffer(body, dtype="<f4").reshape(m, n).astype(np.float32)
    if out_format == OutFormat.BF16:
        import ml_dtypes

        return count, np.frombuffer(body, dtype="<u2").reshape(m, n).astype(np.uint16).view(ml_dtypes.bfloat16)
    return count, decode_bfp(body, m, n, fmt)


def decode_cycles(data: bytes) -> int:
    """The u32 cycles at the end of a GEMM reply's data (after its result)."""
    if len(data) < _CYCLES.size:
        raise ValueError(f"a GEMM reply's data ends with its u32 cycles: {len(data)} bytes")
    return _CYCLES.unpack_from(data, len(data) - _CYCLES.size)[0]
