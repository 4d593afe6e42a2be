"""hbfp.host.protocol: frames, the parser's resynchronization, and every payload layout."""

import struct
import zlib

import numpy as np
import pytest

from hbfp import contract
from hbfp.golden.bfp import HBFP8, HBFP16, MXINT8, Format, quantize
from hbfp.host import protocol as P
from hbfp.host.protocol import Frame, FrameParser, Op, OutFormat, Status


def test_frame_layout_and_round_trip():
    frame = P.encode_frame(Op.GEMM, 0x1234, b"abc")
    assert frame[:2] == b"HB" and frame[2] == P.PROTOCOL_VERSION == 2 and frame[3] == Op.GEMM
    assert struct.unpack_from("<HI", frame, 4) == (0x1234, 3)
    assert frame[10:13] == b"abc"
    assert struct.unpack_from("<I", frame, 13)[0] == zlib.crc32(frame[:13])
    (f,) = FrameParser().feed(frame)
    assert f == Frame(Op.GEMM, 0x1234, b"abc")
    reply = P.encode_reply(Op.GEMM, 7, Status.OK, b"xy")
    (r,) = FrameParser().feed(reply)
    assert r.is_reply and r.opcode == Op.GEMM | P.REPLY and r.status == Status.OK and r.data == b"xy"


def test_parser_byte_by_byte_and_garbage():
    frames = [P.encode_frame(Op.STATUS, t, bytes(range(t))) for t in range(5)]
    stream = b"xxHH" + frames[0] + b"garbage H" + b"".join(frames[1:])
    p = FrameParser()
    got = []
    for i in range(len(stream)):
        got += p.feed(stream[i : i + 1])
    assert [f.tag for f in got] == list(range(5))
    assert not p.in_progress


def test_parser_reports_bad_crc_and_resynchronizes():
    good = P.encode_frame(Op.IDENTIFY, 1)
    bad = bytearray(P.encode_frame(Op.WRITE, 2, b"payload"))
    bad[12] ^= 0x10
    got = FrameParser().feed(bytes(bad) + good)
    assert got[0] == (Status.BAD_CRC, Op.WRITE, 2)
    assert isinstance(got[1], Frame) and got[1].tag == 1


def test_truncated_frame_host_rescans_device_consumes():
    # A frame cut short swallows the start of the next one; the host side finds the next
    # frame inside it, the device side (the gateware's behaviour) loses it too.
    cut = P.encode_frame(Op.WRITE, 1, bytes(40))[:30]
    nxt = P.encode_frame(Op.IDENTIFY, 2)
    after = P.encode_frame(Op.IDENTIFY, 3) + bytes(40)
    host = FrameParser().feed(cut + nxt + after)
    assert host[0] == (Status.BAD_CRC, Op.WRITE, 1) and [f.tag for f in host[1:]] == [2, 3]
    dev = FrameParser(device=True).feed(cut + nxt + after)
    assert dev[0] == (Status.BAD_CRC, Op.WRITE, 1)
    assert all(not isinstance(f, Frame) or f.tag != 2 for f in dev)


def test_expire_gives_up_a_partial_frame():
    p = FrameParser()
    assert p.feed(P.encode_frame(Op.WRITE, 1, bytes(20))[:15]) == []
    assert p.in_progress and p.partial_opcode == Op.WRITE
    assert p.expire() == [] and not p.in_progress
    d = FrameParser(device=True)
    d.feed(b"HB" + bytes([P.PROTOCOL_VERSION]))
    assert d.in_progress and d.partial_opcode is None
    d.expire()
    assert not d.in_progress and d.feed(P.encode_frame(Op.IDENTIFY, 9))[0].tag == 9


def test_oversized_length():
    head = contract.HEADER.pack(magic=contract.MAGIC_WORD, version=P.PROTOCOL_VERSION, opcode=Op.WRITE, tag=5, length=1000)
    # host: reported, and the hunt goes on at once
    got = FrameParser(100).feed(head + P.encode_frame(Op.IDENTIFY, 6))
    assert got[0] == (Status.BAD_LENGTH, Op.WRITE, 5) and got[1].tag == 6
    # device: reported at once, then length + 4 bytes are skipped
    d = FrameParser(100, device=True)
    assert d.feed(head) == [(Status.BAD_LENGTH, Op.WRITE, 5)]
    assert d.skipping and d.feed(bytes(1003)) == [] and d.skipping
    assert d.feed(b"\0" + P.encode_frame(Op.IDENTIFY, 7))[0].tag == 7


def test_command_payloads_round_trip():
    w = P.encode_write(P.Target.B_VALUES, 24, 48, 24, 24, b"data", encoding=1, rounding=2, seed=0xDEADBEEF)
    assert len(w) == P.WRITE_HEADER + 4
    assert P.decode_write(w) == (7, 1, 2, 0xDEADBEEF, 24, 48, 24, 24, b"data")
    g = P.encode_gemm(5, 6, 7, transpose_b=True, accumulate=True, activation=3, out_format=OutFormat.BFP,
                      rounding=2, seed=-1)
    assert len(g) == 16
    assert P.decode_gemm(g) == dict(m=5, n=6, k=7, flags=2 | 4, activation=3, out_format=2, rounding=2,
                                    seed=0xFFFFFFFF)
    r = P.encode_read(3, 4, out_format=OutFormat.BF16, activation=1, bias=True, rounding=1, seed=9)
    assert len(r) == 12 and P.decode_read(r) == dict(m=3, n=4, k=0, flags=8, activation=1, out_format=1,
                                                     rounding=1, seed=9)
    e = P.encode_elementwise(6, b"\1\2\3\4", b"\5\6\7\x08")
    assert P.decode_elementwise(e) == (6, 2, b"\1\2\3\4\5\6\7\x08")
    ident = P.Identity(1, 1, 0, 4, 8, 8, 8, 24, 24, 7, 96, 0x7FF, 0, 4096, 1000)
    data = P.encode_identity(ident)
    assert len(data) == P.IDENTITY_SIZE == 32 and P.decode_identity(data) == ident
    assert ident.tile == (24, 24) and ident.fmt() == HBFP8 and "gelu" in ident.functions
    st = P.DeviceStatus(5, 2, 1234, Status.BAD_CRC)
    assert len(P.encode_status(st)) == 16 and P.decode_status(P.encode_status(st)) == st


@pytest.mark.parametrize("bits", [8, 6, 16, 12])
def test_codes_sign_extended(bits):
    rng = np.random.default_rng(bits)
    q = rng.integers(-(2 ** (bits - 1)) + 1, 2 ** (bits - 1), (3, 8))
    data = P.encode_codes(q, bits)
    assert len(data) == q.size * P.code_bytes(bits)
    assert np.array_equal(P.decode_codes(data, 3, 8, bits), q)
    if bits < 8:  # a buffer word holds m bits: the high bits of the byte do not count
        raw = np.full(1, (1 << bits) - 1, np.int8).tobytes()
        assert P.decode_codes(raw, 1, 1, bits)[0, 0] == -1


@pytest.mark.parametrize("fmt,shape", [(HBFP8, (50, 30)), (HBFP16, (24, 48)), (MXINT8, (3, 70)),
                                       (Format(8, (4, 8)), (9, 9))])
def test_tile_major_and_bfp_layout(fmt, shape):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32)
    flat = P.to_tile_major(x, fmt.tile)
    th, tw = fmt.tile
    assert flat.size == -(-shape[0] // th) * th * -(-shape[1] // tw) * tw
    assert np.array_equal(flat[: th * tw].reshape(th, tw)[: min(th, shape[0]), : min(tw, shape[1])],
                          x[:th, :tw])
    assert np.array_equal(P.from_tile_major(flat, *shape, fmt.tile), x)
    t = quantize(x, fmt)
    data = P.encode_bfp(t)
    assert len(data) == P.result_size(*shape, OutFormat.BFP, fmt.mantissa_bits, fmt.tile)
    assert data[0] == t.exponents[0, 0]
    back = P.decode_bfp(data, *shape, fmt)
    assert np.array_equal(back.codes, t.codes) and np.array_equal(back.exponents, t.exponents)


def test_results_round_trip():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 7)).astype(np.float32)
    cycles, y = P.decode_result(P.encode_result(99, x, OutFormat.FP32), 5, 7, OutFormat.FP32, HBFP8)
    assert cycles == 99 and np.array_equal(x, y)
    bits = rng.integers(0, 1 << 16, (5, 7)).astype(np.uint16)
    data = P.encode_result(1, bits, OutFormat.BF16)
    body = data[:-P.CYCLES_SIZE]
    assert data[-P.CYCLES_SIZE:] == bytes([1, 0, 0, 0]) and body == P.encode_result(None, bits, OutFormat.BF16)  # cycles last
    _, y = P.decode_result(body, 5, 7, OutFormat.BF16, HBFP8, cycles=False)
    assert np.array_equal(y.view(np.uint16), bits) and P.decode_cycles(data) == 1
    with pytest.raises(ValueError, match="needs"):
        P.decode_result(b"\0" * 10, 5, 7, OutFormat.FP32, HBFP8)
