"""The ``emu`` device at the byte level: buffers, commands against the golden model, every
error status, frame timeouts and the STATUS counters."""

import numpy as np
import pytest

from hbfp.contract import FUNCTIONS, CoreConfig, DeviceSpec
from hbfp.golden import activations, bf16
from hbfp.golden.bfp import Format, quantize
from hbfp.golden.compare import same_bits
from hbfp.golden.gemm import gemm
from hbfp.host import conformance
from hbfp.host import protocol as P
from hbfp.host.emu import EmuDevice, command_cycles, parse_options
from hbfp.host.protocol import Frame, FrameParser, Op, OutFormat, Status, Target


#: A payload buffer for a whole 96 x 96 buffer of fp32 values: the tests write blocks in one frame.
WHOLE = P.WRITE_HEADER + 4 * 96 * 96


class Raw:
    """Frames to an EmuDevice, replies back, and a model of its STATUS counters."""

    def __init__(self, dev: EmuDevice):
        self.dev = dev
        self.parser = FrameParser()
        self.tag = 0
        self.accepted = self.refused = 0

    def send(self, data: bytes) -> list:
        self.dev.write(data)
        return self.parser.feed(self.dev.read())

    def request(self, op, payload=b"", status=Status.OK, version=P.PROTOCOL_VERSION) -> Frame:
        self.tag += 1
        (reply,) = self.send(P.encode_frame(op, self.tag, payload, version=version))
        assert isinstance(reply, Frame) and reply.tag == self.tag and reply.opcode == (op | P.REPLY) & 0xFF
        assert reply.status == status, (Status(reply.status), status)
        if status == Status.OK:
            self.accepted += 1
        else:
            self.refused += 1
            assert reply.data == b""
        return reply

    def write(self, target, row, col, rows, cols, data, status=Status.OK, **kw):
        return self.request(Op.WRITE, P.encode_write(target, row, col, rows, cols, data, **kw), status)


def load(raw: Raw, target_codes, t, lanes):
    rows, cols = t.shape
    pad = np.zeros((rows, -(-cols // lanes) * lanes), t.codes.dtype)
    pad[:, :cols] = t.codes
    raw.write(target_codes, 0, 0, *pad.shape, P.encode_codes(pad, t.fmt.mantissa_bits))
    raw.write(target_codes + 2, 0, 0, *t.exponents.shape, t.exponents.tobytes())


def test_identify_and_config_options():
    raw = Raw(EmuDevice(**parse_options("rows=4,cols=8,size=48,functions=relu+gelu,frame_timeout=50")))
    ident = P.decode_identity(raw.request(Op.IDENTIFY).data)
    assert (ident.rows, ident.cols, ident.size, ident.tile, ident.frame_timeout) == (4, 8, 48, (24, 24), 50)
    assert ident.abi == P.ABI_VERSION and ident.functions == ("relu", "gelu")
    assert ident.max_payload == DeviceSpec().max_payload  # the contract's default, the gateware's
    assert parse_options("format=MXINT8,size=64")["config"].tile == (1, 32)
    assert parse_options("tile=4x16,size=32,mantissa_bits=6")["config"].fmt() == Format(6, (4, 16))
    with pytest.raises(ValueError, match="unknown emu option"):
        parse_options("colour=blue")
    with pytest.raises(ValueError, match="multiple of"):
        parse_options("rows=5")


def test_gemm_from_buffers_with_stale_data_accumulate_and_read():
    cfg = CoreConfig()
    dev = EmuDevice(cfg, max_payload=WHOLE)
    raw = Raw(dev)
    rng = np.random.default_rng(0)
    fmt = cfg.fmt()
    # Fill the buffers with garbage first: a later product must read only its region.
    big = quantize(rng.standard_normal((96, 96)).astype(np.float32) * 100, fmt)
    load(raw, Target.A_CODES, big, 8)
    load(raw, Target.B_CODES, big, 8)
    m, k, n = 30, 50, 20
    a = quantize(rng.standard_normal((m, k)).astype(np.float32), fmt)
    b = quantize(rng.standard_normal((k, n)).astype(np.float32), fmt)
    load(raw, Target.A_CODES, a, 8)
    load(raw, Target.B_CODES, b, 8)
    bias = rng.standard_normal(n).astype(np.float32)
    raw.write(Target.BIAS, 0, 0, 1, 24, np.pad(bias, (0, 4)).tobytes())
    reply = raw.request(Op.GEMM, P.encode_gemm(m, n, k, bias=True, activation=FUNCTIONS.index("gelu"),
                                               out_format=OutFormat.BF16))
    cycles, got = P.decode_result(reply.data, m, n, OutFormat.BF16, fmt)
    assert cycles == command_cycles(cfg, m, n, k)
    assert same_bits(got, gemm(a, b, bias=bias, activation="gelu", out="bf16"))
    # The accumulator holds the sums before bias and activation: READ them back.
    sums = gemm(a, b)
    _, back = P.decode_result(raw.request(Op.READ, P.encode_read(m, n)).data, m, n, OutFormat.FP32, fmt,
                              cycles=False)
    assert same_bits(back, sums)
    # Accumulate a second product onto them, BFP out with stochastic rounding.
    reply = raw.request(Op.GEMM, P.encode_gemm(m, n, k, accumulate=True, out_format=OutFormat.BFP, rounding=2,
                                               seed=77))
    _, got = P.decode_result(reply.data, m, n, OutFormat.BFP, fmt)
    want = gemm(a, b, c=sums, out=fmt.with_rounding("stochastic"), seed=77)
    assert np.array_equal(got.codes, want.codes) and np.array_equal(got.exponents, want.exponents)
    st = P.decode_status(raw.request(Op.STATUS).data)
    assert (st.accepted, st.refused, st.last_error) == (raw.accepted, 0, Status.OK)
    assert st.last_cycles == command_cycles(cfg, m, n, k)


def test_transposed_operands_and_values_quantized_on_the_device():
    cfg = CoreConfig(rows=4, cols=4, size=48)
    raw = Raw(EmuDevice(cfg, max_payload=WHOLE))
    rng = np.random.default_rng(1)
    th, tw = cfg.tile
    at = rng.standard_normal((40, 30)).astype(np.float32)  # A^T: K x M
    bt = rng.standard_normal((20, 40)).astype(np.float32)  # B^T: N x K

    def values(target, x, encoding, rounding, seed):
        rows, cols = -(-x.shape[0] // th) * th, -(-x.shape[1] // tw) * tw
        flat = P.to_tile_major(x, cfg.tile)
        data = flat.astype("<f4").tobytes() if encoding == 0 else bf16.from_f32(flat).astype("<u2").tobytes()
        raw.write(target, 0, 0, rows, cols, data, encoding=encoding, rounding=rounding, seed=seed)

    values(Target.A_VALUES, at, 0, 2, 5)
    values(Target.B_VALUES, bt, 1, 0, 0)
    fmt = cfg.fmt()
    qa = quantize(at, fmt.with_rounding("stochastic"), seed=5)
    qb = quantize(bf16.to_dtype(bf16.from_f32(bt)), fmt)
    reply = raw.request(Op.GEMM, P.encode_gemm(30, 20, 40, transpose_a=True, transpose_b=True))
    _, got = P.decode_result(reply.data, 30, 20, OutFormat.FP32, fmt)
    assert same_bits(got, gemm(qa, qb, transpose_a=True, transpose_b=True))


def test_elementwise_units():
    raw = Raw(EmuDevice())
    x = np.arange(0, 1 << 16, 97, dtype=np.uint16)
    g = x[::-1].copy()
    for name in ("relu", "gelu", "exp"):
        reply = raw.request(Op.ELEMENTWISE, P.encode_elementwise(FUNCTIONS.index(name), x.tobytes()))
        assert np.array_equal(np.frombuffer(reply.data, "<u2"), activations.get(name)(x))
    for name in ("tanh", "leaky_relu"):
        reply = raw.request(Op.ELEMENTWISE, P.encode_elementwise(FUNCTIONS.index(name + "_grad"), x.tobytes(),
                                                                 g.tobytes()))
        assert np.array_equal(np.frombuffer(reply.data, "<u2"), activations.get(name, "grad")(x, g))


def test_error_statuses_follow_the_conformance_table():
    """Every error status, the resynchronization and the STATUS counters: the protocol's
    conformance table (``hbfp.host.conformance``; tests/test_conformance.py runs it on more
    configurations, on sim and over TCP)."""
    dev = EmuDevice(CoreConfig(rows=4, cols=4, size=48, functions=("relu", "gelu_grad")), max_payload=4096,
                    frame_timeout=1000)
    failures = conformance.run_cases(dev, conformance.cases(dev.identity), dev.identity)
    assert not failures, "\n".join(str(e) for _, e in failures)


def test_frame_timeout_to_the_cycle():
    """emu's clock is virtual: a begun frame times out after exactly frame_timeout idle
    cycles (the gateware's reply comes a few cycles later)."""
    dev = EmuDevice(CoreConfig(rows=4, cols=4, size=48), frame_timeout=1000)
    raw = Raw(dev)
    for cut in (2, 3, 4, 12, 30):
        frame = P.encode_frame(Op.WRITE, 41, P.encode_write(Target.B_CODES, 0, 0, 1, 4, bytes(4)))
        assert raw.send(frame[:cut]) == []
        dev.advance(999)
        assert dev.read() == b""
        dev.advance(1)
        (reply,) = raw.parser.feed(dev.read())
        assert (reply.tag, reply.status) == (P.FRAME_TIMEOUT_TAG, Status.TIMEOUT)
        assert reply.opcode == (Op.WRITE if cut > 3 else 0) | P.REPLY
    # a skip after an oversized length ends silently at the same count
    raw.tag += 1
    (reply,) = raw.send(P.encode_frame(Op.WRITE, raw.tag, bytes(dev.identity.max_payload + 1))[:2000])
    assert reply.status == Status.BAD_LENGTH
    dev.advance(999)
    assert dev.read() == b"" and dev._parser.skipping
    dev.advance(1)
    assert dev.read() == b"" and not dev._parser.skipping
    assert raw.request(Op.IDENTIFY).status == Status.OK


def test_non_square_tile_serves_k_along_stored_rows_only():
    cfg = CoreConfig(rows=4, cols=4, mantissa_bits=8, tile=(1, 32), size=64)
    raw = Raw(EmuDevice(cfg, max_payload=WHOLE))
    raw.request(Op.GEMM, P.encode_gemm(4, 4, 4, transpose_b=False), status=Status.BAD_DESCRIPTOR)
    raw.request(Op.GEMM, P.encode_gemm(4, 4, 4, transpose_a=True, transpose_b=True), status=Status.BAD_DESCRIPTOR)
    rng = np.random.default_rng(3)
    fmt = cfg.fmt()
    a = quantize(rng.standard_normal((5, 40)).astype(np.float32), fmt)
    bt = quantize(rng.standard_normal((7, 40)).astype(np.float32), fmt)  # B stored N x K
    load(raw, Target.A_CODES, a, 4)
    load(raw, Target.B_CODES, bt, 4)
    reply = raw.request(Op.GEMM, P.encode_gemm(5, 7, 40, transpose_b=True, out_format=OutFormat.BFP))
    _, got = P.decode_result(reply.data, 5, 7, OutFormat.BFP, fmt)
    want = gemm(a, bt, transpose_b=True, out=fmt)
    assert np.array_equal(got.codes, want.codes) and np.array_equal(got.exponents, want.exponents)


def test_command_cycles_formula():
    # docs/architecture.md's formula written out on the default 8x8 core (tk 24, 4 accumulate
    # lanes: a K-tile drains in 8 x 2 beats): K-tiles every 24 cycles; the count stops when the
    # last row-block (b = 11) is closed, after its last K-tile (index 575) has streamed, drained
    # and been accumulated. The epilogue (and its output format) is not counted; a READ counts 0.
    from hbfp.contract import ADD_LATENCY, MAC_LATENCY, NORMALIZE_LATENCY, OPERAND_READ_LATENCY
    from hbfp.host.emu import DRAIN_REGISTER

    cfg = CoreConfig()
    assert cfg.acc_lanes == 4
    closed = OPERAND_READ_LATENCY + MAC_LATENCY + 16 + DRAIN_REGISTER + NORMALIZE_LATENCY + ADD_LATENCY
    assert command_cycles(cfg, 96, 96, 96) == 575 * 24 + 24 + closed - 1
    assert command_cycles(cfg, 96, 96, 0) == 0  # READ
    assert command_cycles(cfg, 96, 96, 24) == 143 * 24 + 24 + closed - 1  # 12 x 12 blocks, one K-tile each
    # 30 x 20 x 50: 4 row-blocks of 3 column-blocks of 3 K-tiles; partial blocks count whole.
    assert command_cycles(cfg, 30, 20, 50) == 35 * 24 + 24 + closed - 1
