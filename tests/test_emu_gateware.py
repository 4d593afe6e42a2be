"""``emu`` is the device's model: its replies, accumulator contents, cycle counts and STATUS
equal the gateware's (docs/protocol.md, "Details every device shares").

Both byte devices, ``hbfp.host.emu.EmuDevice`` and the Verilated top (``hbfp.sim.device``),
get the same request frames (``hbfp.host.protocol``'s encoders) and must send back the same
reply bytes: random products in every output format, with bias, activation, accumulation,
transposes and rounding modes, on buffers full of stale data; after each product a READ of
the whole accumulator (``size`` x ``size``, the padding beyond M and N included) and a STATUS;
READs of K = 0 (whose cycles only STATUS shows); refused frames. A few configurations: the
default 8 x 8 top, the small top tests/test_sim_device.py builds (its library is shared), a
non-square MXINT8-like tile on an array too large for its K-tile to run without stalls, a
reduced device without activation units, output quantizer or stochastic rounding, and (in
`make sim-full`) rectangular arrays.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from hbfp.host import protocol as P
from hbfp.host.emu import EmuDevice, command_cycles
from hbfp.host.protocol import Op, OutFormat, Status, Target
from hbfp.contract import CoreConfig
from hbfp.sim.harness import build

from .conftest import SIM_TOP_ARG

#: Under pytest-xdist the tests of this file run on a worker of their own, beside the one of
#: tests/test_sim_device.py (a build of a library both use, the small top's, waits for the
#: other's under the build's file lock).
pytestmark = pytest.mark.xdist_group("emu_gateware")
needs_sim = pytest.mark.skipif(build.unavailable() is not None, reason=str(build.unavailable()))

#: sim configurations (``sim:ARG``), each a Verilator build the first time.
CONFIGS = {
    "default": "",
    "small": SIM_TOP_ARG,
    "reduced": "rows=2,cols=2,tile=12x12,size=24,functions=none,value_quantizer=0,bfp_output=0,stochastic=0",
}
if os.environ.get("HBFP_SIM_FULL"):
    # In `make sim-full` only (its build takes about 4 minutes on 2 cores): a 1 x 16 tile
    # (MXINT8-like: K along the stored rows of A and B^T) on a 16 x 16 array: the exponent
    # prefetch, max(R, C) + 4 cycles, outlasts a K-tile of 16 (as on a 32 x 32 array with
    # 32 x 32 tiles).
    CONFIGS["tile1x16"] = "rows=16,cols=16,tile=1x16,size=32,functions=relu"
    # Rectangular arrays (A's codes in chunks of R, B's of C, the input quantizer's beats as
    # partial chunks): the 16 x 8 top of `hbfp gemm sim:rows=16,cols=8,stream_bytes=16` (its
    # build is shared), and 6 x 8 on 12 x 12 tiles (rows no power of two, cols not dividing
    # the tile). Amaranth's simulator checks both kinds in make test (test_hw_top_amaranth.py).
    CONFIGS["16x8"] = "rows=16,cols=8,stream_bytes=16"
    CONFIGS["6x8"] = "rows=6,cols=8,tile=12x12,size=24,stream_bytes=8,functions=relu,frame_timeout=4096"


def _top_available() -> str | None:
    try:
        from hbfp.hw.top import AcceleratorTop  # noqa: F401
    except Exception as e:  # broken mid-edit
        return f"hw.top.AcceleratorTop unavailable: {e!r}"
    return None


def _open_sim(arg: str):
    why = _top_available()
    if why:
        pytest.skip(why)
    from hbfp.sim.device import backend

    return backend.open(arg, progress=lambda msg: print(msg, flush=True))


def _frame_length(data: bytes) -> int | None:
    """The length of the frame at the start of ``data`` (None: its header is not in yet)."""
    if len(data) < P.HEADER.size:
        return None
    return P.HEADER.size + int.from_bytes(data[6:10], "little") + P.CRC_SIZE


class Pair:
    """The gateware (a ``SimDevice``, after a power-on reset) and its model (an ``EmuDevice``
    built from the gateware's IDENTIFY), driven with the same frames."""

    def __init__(self, sim):
        self.sim = sim
        self.tag = 0
        sim.reset()
        ident = P.decode_identity(P.FrameParser().feed(self._sim_reply(P.encode_frame(Op.IDENTIFY, 0)))[0].data)
        sim.reset()  # both start from power-on: no frame counted yet
        self.ident = ident
        from hbfp.hw.activation import FUNCTIONS, UNARY_FUNCTIONS

        functions = tuple(f for i, f in enumerate(FUNCTIONS) if ident.functions_mask >> i & 1)
        units = {name: not (ident.omitted >> bit & 1) for name, bit in P.UNITS.items()}
        # IDENTIFY does not report the epilogue's lanes (they change cycle counts only): the
        # build's description does.
        out_lanes = sim.info["config"]["core"]["out_lanes"]
        self.cfg = CoreConfig(rows=ident.rows, cols=ident.cols, mantissa_bits=ident.mantissa_bits,
                              tile=(ident.tile_rows, ident.tile_cols), size=ident.size,
                              leaky_shift=ident.leaky_shift, functions=functions, out_lanes=out_lanes, **units)
        self.unary = [FUNCTIONS.index(f) for f in functions if f in UNARY_FUNCTIONS]
        self.emu = EmuDevice(self.cfg, max_payload=ident.max_payload, frame_timeout=ident.frame_timeout,
                             clock_hz=ident.clock_hz, stream_bytes=ident.stream_bytes)
        self.exchange(Op.IDENTIFY)

    def _sim_reply(self, frame: bytes) -> bytes:
        self.sim.write(frame)
        got = b""
        while _frame_length(got) is None or len(got) < _frame_length(got):
            chunk = self.sim.read()
            assert chunk, f"sim: no (complete) reply; got {got.hex()}"
            got += chunk
        assert len(got) == _frame_length(got), "sim: bytes beyond the reply"
        return got

    def exchange(self, opcode: int, payload: bytes = b"", *, frame: bytes | None = None, what: str = "") -> bytes:
        """Send one request to both; their replies must be the same bytes. Returns the reply."""
        self.tag = (self.tag + 1) & 0x7FFF
        if frame is None:
            frame = P.encode_frame(opcode, self.tag, payload)
        self.emu.write(frame)
        e = self.emu.read()
        s = self._sim_reply(frame)
        if e != s:
            pytest.fail(f"{what or Op(opcode).name}: emu and sim replies differ: {_describe(e, s)}")
        return s

    def write(self, target: int, row: int, col: int, rows: int, cols: int, data: bytes) -> None:
        reply = self.exchange(Op.WRITE, P.encode_write(target, row, col, rows, cols, data),
                              what=f"WRITE {Target(target).name}")
        assert _status(reply) == Status.OK


def _status(reply: bytes) -> int:
    return reply[P.HEADER.size]


def _describe(e: bytes, s: bytes) -> str:
    out = [f"lengths emu {len(e)}, sim {len(s)}"]
    if len(e) > P.HEADER.size and len(s) > P.HEADER.size:
        out.append(f"status emu {_status(e)}, sim {_status(s)}")
        if e[3] in (Op.GEMM | P.REPLY, Op.STATUS | P.REPLY) and len(e) >= 15 + 12 and len(s) >= 15 + 12:
            lo = P.HEADER.size + 1
            out.append(f"first words emu {np.frombuffer(e[lo:lo + 12], '<u4')}, "
                       f"sim {np.frombuffer(s[lo:lo + 12], '<u4')}")
    if len(e) == len(s):
        diff = np.flatnonzero(np.frombuffer(e, np.uint8) != np.frombuffer(s, np.uint8))
        out.append(f"{diff.size} bytes differ, the first at offset {diff[0]}")
    return "; ".join(out)


def fill(pair: Pair, rng: np.random.Generator) -> None:
    """Every buffer (operand codes and exponents, accumulator, bias) full of random data."""
    cfg = pair.cfg
    D = cfg.size
    th, tw = cfg.tile
    qmax = 2 ** (cfg.mantissa_bits - 1) - 1
    room = pair.ident.max_payload - P.WRITE_HEADER
    for target in (Target.A_CODES, Target.B_CODES):
        codes = rng.integers(-qmax, qmax + 1, size=(D, D))
        step = room // (D * P.code_bytes(cfg.mantissa_bits))
        for r in range(0, D, step):
            rows = min(step, D - r)
            pair.write(target, r, 0, rows, D, P.encode_codes(codes[r : r + rows], cfg.mantissa_bits))
    for target in (Target.A_EXPONENTS, Target.B_EXPONENTS):
        exps = rng.integers(118, 136, size=(D // th, D // tw)).astype(np.uint8)
        step = room // (D // tw)
        for r in range(0, D // th, step):
            rows = min(step, D // th - r)
            pair.write(target, r, 0, rows, D // tw, exps[r : r + rows].tobytes())
    acc = (rng.standard_normal((D, D)) * 8).astype("<f4")
    step = room // (4 * D)
    for r in range(0, D, step):
        rows = min(step, D - r)
        pair.write(Target.ACC, r, 0, rows, D, acc[r : r + rows].tobytes())
    pair.write(Target.BIAS, 0, 0, 1, D, rng.standard_normal(D).astype("<f4").tobytes())


def write_values(pair: Pair, rng: np.random.Generator) -> None:
    """Values into a random whole-tile region of A and of B, quantized on the device (fp32 or
    bf16, every rounding; a reduced device refuses them as emu does)."""
    cfg = pair.cfg
    D = cfg.size
    th, tw = cfg.tile
    room = pair.ident.max_payload - P.WRITE_HEADER
    for target in (Target.A_VALUES, Target.B_VALUES):
        encoding = P.Encoding(int(rng.integers(0, 2)))
        width = 4 if encoding == P.Encoding.FP32 else 2
        tiles_c = int(rng.integers(1, min(D // tw, room // (width * th * tw)) + 1))
        tiles_r = int(rng.integers(1, min(D // th, room // (width * th * tw * tiles_c)) + 1))
        row = th * int(rng.integers(0, D // th - tiles_r + 1))
        col = tw * int(rng.integers(0, D // tw - tiles_c + 1))
        x = (rng.standard_normal(tiles_r * th * tiles_c * tw) * 4).astype(np.float32)
        data = x.astype("<f4").tobytes() if width == 4 else (x.view(np.uint32) >> 16).astype("<u2").tobytes()
        rounding = int(rng.integers(0, 3))
        pair.exchange(Op.WRITE, P.encode_write(target, row, col, tiles_r * th, tiles_c * tw, data, encoding=encoding,
                                               rounding=rounding, seed=int(rng.integers(0, 2**32))),
                      what=f"WRITE {target.name} {encoding.name} rounding {rounding}")


def rewrite_codes(pair: Pair, rng: np.random.Generator) -> None:
    """New codes in a random region of A or B (the next products read other stale data)."""
    cfg = pair.cfg
    D = cfg.size
    target = rng.choice([Target.A_CODES, Target.B_CODES])
    lanes = cfg.rows if target == Target.A_CODES else cfg.cols
    qmax = 2 ** (cfg.mantissa_bits - 1) - 1
    room = pair.ident.max_payload - P.WRITE_HEADER
    cols = lanes * int(rng.integers(1, D // lanes + 1))
    col = lanes * int(rng.integers(0, (D - cols) // lanes + 1))
    rows = int(rng.integers(1, min(D, room // (cols * P.code_bytes(cfg.mantissa_bits))) + 1))
    row = int(rng.integers(0, D - rows + 1))
    codes = rng.integers(-qmax, qmax + 1, size=(rows, cols))
    pair.write(int(target), row, col, rows, cols, P.encode_codes(codes, cfg.mantissa_bits))


def random_product(pair: Pair, rng: np.random.Generator, shape=None) -> dict:
    cfg = pair.cfg
    D = cfg.size
    m, n, k = shape or (int(v) for v in rng.integers(1, D + 1, size=3))
    formats = [OutFormat.FP32, OutFormat.BF16] + ([OutFormat.BFP] if cfg.bfp_output else [])
    roundings = [0, 1] + ([2] if cfg.stochastic else [])
    if cfg.square:
        ta, tb = (bool(v) for v in rng.integers(0, 2, size=2))
    else:  # K along the stored rows: A as M x K, B as N x K
        ta, tb = False, True
    return dict(m=m, n=n, k=k, transpose_a=ta, transpose_b=tb, accumulate=bool(rng.integers(0, 2)),
                bias=bool(rng.integers(0, 2)),
                activation=int(rng.choice(pair.unary + [P.NO_ACTIVATION])),
                out_format=int(rng.choice(formats)), rounding=int(rng.choice(roundings)),
                seed=int(rng.integers(0, 2**32)))


def run_products(pair: Pair, rng: np.random.Generator, count: int) -> None:
    """Products on stale buffers; after each the whole accumulator and STATUS; now and then a
    READ with the epilogue's options, or new codes in part of an operand buffer."""
    cfg = pair.cfg
    D, R, C, tk = cfg.size, cfg.rows, cfg.cols, cfg.tk
    fixed = [(D, D, D), (1, 1, 1), (R + 1, C + 1, tk + 1), (D - 1, 1, D)]
    for i in range(count):
        d = random_product(pair, rng, fixed[i] if i < len(fixed) else None)
        what = f"GEMM {d}"
        reply = pair.exchange(Op.GEMM, P.encode_gemm(**d), what=what)
        assert _status(reply) == Status.OK, what
        want = command_cycles(cfg, d["m"], d["n"], d["k"])
        assert P.decode_cycles(reply[P.HEADER.size + 1 : -P.CRC_SIZE]) == want, what
        # The accumulator, padding included: what the product left beyond M and N.
        assert _status(pair.exchange(Op.READ, P.encode_read(D, D), what=f"READ {D}x{D} after {what}")) == Status.OK
        pair.exchange(Op.STATUS, what=f"STATUS after {what}")
        if i % 3 == 2:
            r = random_product(pair, rng)
            desc = dict(out_format=r["out_format"], activation=r["activation"], bias=r["bias"],
                        rounding=r["rounding"], seed=r["seed"])
            pair.exchange(Op.READ, P.encode_read(r["m"], r["n"], **desc), what=f"READ {r['m']}x{r['n']} {desc}")
            pair.exchange(Op.STATUS, what="STATUS after a READ")  # a READ's cycles
        if i % 4 == 3:
            rewrite_codes(pair, rng)


def other_commands(pair: Pair, rng: np.random.Generator) -> None:
    """ELEMENTWISE (where units are built) and refused frames of every kind: errors count in
    STATUS (refused, last error) as on the gateware; RESET clears the counters."""
    D, C = pair.cfg.size, pair.cfg.cols
    if pair.unary:
        x = rng.standard_normal(20).astype(np.float32).view(np.uint32) >> 16
        pair.exchange(Op.ELEMENTWISE, P.encode_elementwise(pair.unary[-1], x.astype("<u2").tobytes()))
    pair.exchange(Op.ELEMENTWISE, P.encode_elementwise(0x7F, bytes(4)), what="ELEMENTWISE of no function")
    pair.exchange(Op.GEMM, P.encode_gemm(0, 1, 1), what="GEMM with M = 0")
    pair.exchange(Op.READ, P.encode_read(D + 1, 1), what="READ beyond the buffer")
    pair.exchange(Op.READ, P.encode_read(1, 1)[:-1], what="READ one byte short")
    pair.exchange(Op.WRITE, P.encode_write(Target.ACC, D, 0, 1, C, bytes(4 * C)), what="WRITE beyond the buffer")
    pair.exchange(0x55, what="an unknown opcode")
    pair.exchange(Op.STATUS, frame=P.encode_frame(Op.STATUS, 0x4321, version=P.PROTOCOL_VERSION + 1),
                  what="another protocol version")
    good = P.encode_frame(Op.STATUS, 0x1234)
    bad_crc = good[:-4] + ((zlib.crc32(good[:-4]) ^ 1).to_bytes(4, "little"))
    pair.exchange(Op.STATUS, frame=bad_crc, what="a frame with a bad CRC")
    pair.exchange(Op.STATUS, what="STATUS after refused frames")
    timeout = pair.ident.frame_timeout
    if timeout <= 10_000:  # a frame that stops arriving: both drop it with a TIMEOUT reply
        partial = P.encode_frame(Op.STATUS, 0x777)[:7]
        pair.emu.write(partial)
        pair.sim.write(partial)
        pair.emu.advance(2 * timeout)
        pair.sim.advance(2 * timeout)
        e, s = pair.emu.read(), pair.sim.read()
        assert e == s and P.FrameParser().feed(s)[0].status == Status.TIMEOUT, _describe(e, s)
        pair.exchange(Op.STATUS, what="STATUS after a TIMEOUT")
    pair.exchange(Op.RESET)
    pair.exchange(Op.STATUS, what="STATUS after RESET")


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def sim_device(request):
    dev = _open_sim(CONFIGS[request.param])
    yield dev
    dev.close()


@pytest.fixture
def pair(sim_device):
    return Pair(sim_device)


@needs_sim
def test_replies_accumulator_cycles_and_status_equal_the_gateware(pair):
    rng = np.random.default_rng(pair.cfg.rows * 1000 + pair.cfg.cols * 10 + pair.cfg.size)
    fill(pair, rng)
    write_values(pair, rng)
    run_products(pair, rng, 9)
    other_commands(pair, rng)


@needs_sim
def test_one_nan_where_an_addition_makes_one(pair):
    """inf + (-inf) in the accumulator (C = +inf plus a product that overflows to -inf) and in
    the bias addition: the gateware, emu and the golden model give the one quiet NaN
    0x7FC00000 (docs/numerics.md), bit for bit; as bf16, 0x7FC0."""
    from hbfp.golden import bf16
    from hbfp.golden.bfp import BFPTensor
    from hbfp.golden.gemm import gemm

    cfg = pair.cfg
    C, R, th, tw = cfg.cols, cfg.rows, cfg.tile[0], cfg.tile[1]
    qmax = (1 << (cfg.mantissa_bits - 1)) - 1
    ones = np.ones((1, C), "<f4")
    pair.write(Target.ACC, 0, 0, 1, C, (ones * np.inf).tobytes())
    pair.write(Target.BIAS, 0, 0, 1, C, (ones * -np.inf).tobytes())
    reply = pair.exchange(Op.READ, P.encode_read(1, C, bias=True))
    got = np.frombuffer(reply[P.HEADER.size + 1 : -P.CRC_SIZE], "<u4")
    assert (got == 0x7FC00000).all(), [hex(x) for x in got]
    # A product of the largest codes and exponents overflows to -inf onto C = +inf.
    k = min(cfg.tk, cfg.size)
    a_codes = np.full((R, k), qmax, np.int8 if cfg.mantissa_bits <= 8 else np.int16)
    b_codes = np.full((k, C), -qmax, a_codes.dtype)
    exps = np.full((1, 1), 254, np.uint8)
    pair.write(Target.A_CODES, 0, 0, R, k, P.encode_codes(a_codes, cfg.mantissa_bits))
    pair.write(Target.B_CODES, 0, 0, k, C, P.encode_codes(b_codes, cfg.mantissa_bits))
    pair.write(Target.A_EXPONENTS, 0, 0, 1, 1, exps.tobytes())
    pair.write(Target.B_EXPONENTS, 0, 0, 1, 1, exps.tobytes())
    pair.write(Target.ACC, 0, 0, 1, C, (ones * np.inf).tobytes())
    for out, want in ((P.OutFormat.FP32, 0x7FC00000), (P.OutFormat.BF16, 0x7FC0)):
        if out == P.OutFormat.BF16:
            pair.write(Target.ACC, 0, 0, 1, C, (ones * np.inf).tobytes())
        reply = pair.exchange(Op.GEMM, P.encode_gemm(1, C, k, accumulate=True, out_format=out))
        data = reply[P.HEADER.size + 1 : -P.CRC_SIZE - P.CYCLES_SIZE]  # status, the result, the cycles
        got = np.frombuffer(data, "<u4" if out == P.OutFormat.FP32 else "<u2")
        assert (got == want).all(), [hex(x) for x in got]
    fmt = cfg.fmt()
    a = BFPTensor(a_codes[:1].copy(), np.full((1, -(-k // tw)), 254, np.uint8), fmt)
    # B as the golden model reads it: K x N for a square tile, else stored N x K (its tiles run
    # along K) and multiplied transposed; every exponent is 254 either way.
    square = th == tw
    b_stored = b_codes if square else np.ascontiguousarray(b_codes.T)
    b = BFPTensor(b_stored.copy(), np.full((-(-b_stored.shape[0] // th), -(-b_stored.shape[1] // tw)), 254, np.uint8),
                  fmt)
    golden = gemm(a, b, c=np.full((1, C), np.inf, np.float32), transpose_b=not square, impl="reference")
    assert (golden.view(np.uint32) == 0x7FC00000).all() and bf16.F32_QNAN == 0x7FC00000


@needs_sim
def test_padding_is_the_product_of_the_stale_operands(sim_device):
    """A product smaller than one array block rewrites the whole block of the accumulator:
    the rows to ceil(M/R)*R and columns to ceil(N/C)*C hold the products of the stale codes
    there (A's codes beyond K read as zeros); an accumulating product over that padding then
    adds to them."""
    pair = Pair(sim_device)
    cfg = pair.cfg
    rng = np.random.default_rng(7)
    fill(pair, rng)
    m, n, k = max(1, cfg.rows // 2), 1, max(1, cfg.tk // 2)
    ta, tb = (False, True) if not cfg.square else (False, False)
    pair.exchange(Op.GEMM, P.encode_gemm(m, n, k, transpose_a=ta, transpose_b=tb))
    mp, np_ = -(-m // cfg.rows) * cfg.rows, -(-n // cfg.cols) * cfg.cols
    reply = pair.exchange(Op.READ, P.encode_read(cfg.size, cfg.size))
    acc = np.frombuffer(reply[P.HEADER.size + 1 : -P.CRC_SIZE], "<f4").reshape(cfg.size, cfg.size)
    from hbfp.golden.bfp import BFPTensor
    from hbfp.golden.gemm import gemm

    e = pair.emu
    th, tw = cfg.tile
    a_shape = (mp, k)
    b_shape = (np_, k) if tb else (k, np_)
    a = BFPTensor(e.a_codes[: a_shape[0], : a_shape[1]].copy(),
                  e.a_exponents[: -(-a_shape[0] // th), : -(-a_shape[1] // tw)].copy(), cfg.fmt())
    b = BFPTensor(e.b_codes[: b_shape[0], : b_shape[1]].copy(),
                  e.b_exponents[: -(-b_shape[0] // th), : -(-b_shape[1] // tw)].copy(), cfg.fmt())
    want = gemm(a, b, transpose_b=tb)
    assert np.array_equal(acc[:mp, :np_].view(np.uint32), want.view(np.uint32))
    # A second product over the padding, accumulating: the gateware adds onto what it left.
    pair.exchange(Op.GEMM, P.encode_gemm(mp, np_, k, transpose_a=ta, transpose_b=tb, accumulate=True))
    pair.exchange(Op.READ, P.encode_read(cfg.size, cfg.size))


@needs_sim
def test_read_returns_the_reply_to_an_oversized_frame(sim_device):
    """A frame whose length field exceeds max_payload is answered (BAD_LENGTH) as soon as its
    header is in: read() returns that reply without more input, and the device then skips
    the frame's ``length + 4`` remaining bytes."""
    pair = Pair(sim_device)
    max_payload = pair.ident.max_payload
    assert sim_device.max_payload == max_payload
    frame = P.encode_frame(Op.WRITE, 77, bytes(max_payload + 1))
    for head in (P.HEADER.size, P.HEADER.size + 5):  # the header alone; with part of the payload
        sim_device.write(frame[:head])
        start = sim_device.cycles
        got = sim_device.read()
        assert got, "read() returned nothing for a reply the device sends without more input"
        assert sim_device.cycles - start < 1000
        (reply,) = P.FrameParser().feed(got)
        assert (reply.opcode, reply.tag, reply.status) == (Op.WRITE | P.REPLY, 77, Status.BAD_LENGTH)
        # The rest of the frame is skipped; a partial frame still makes read() return at once.
        sim_device.write(frame[head:-3])
        assert sim_device.read() == b""
        sim_device.write(frame[-3:])
        assert sim_device.read() == b""
        pair.emu.write(frame)
        assert pair.emu.read() == got
        pair.exchange(Op.STATUS)  # both counted the refusal; the next frame works


@needs_sim
def test_host_products_count_the_gateware_cycles():
    """The host driver's ``stats.cycles`` (the cycles of every command it ran) on emu and on
    sim, for products the driver tiles, in fp32, bf16 and BFP."""
    why = _top_available()
    if why:
        pytest.skip(why)
    from hbfp import host
    from hbfp.host import registry
    from hbfp.sim.device import backend

    if "sim" not in {ep.name for ep in registry._entry_points()}:
        registry.register_backend("sim", backend)
    rng = np.random.default_rng(5)
    with host.open("emu") as emu_dev, host.open("sim") as sim_dev:
        for m, n, k, out in [(96, 96, 96, "fp32"), (40, 70, 50, "bf16"), (96, 48, 200, "fp32"), (50, 50, 50, "bfp")]:
            a = rng.standard_normal((m, k)).astype(np.float32)
            b = rng.standard_normal((k, n)).astype(np.float32)
            cycles = []
            for d in (emu_dev, sim_dev):
                d.reset_stats()
                d.gemm(a, b, out=out)
                cycles.append(d.stats.cycles)
            print(f"{m}x{n}x{k} {out}: emu {cycles[0]}, sim {cycles[1]} cycles")
            assert cycles[0] == cycles[1], (m, n, k, out, cycles)


def test_command_cycles_of_the_default_core():
    """The figures docs/architecture.md quotes: the MAC phase of 96^3 on the default 8 x 8 core
    and of 240^3 on a 16 x 16 core with HBFP8's 24 x 24 tiles within 1% of the array's bound
    (M N K / (R C) cycles): K-tiles follow without a gap, and only the last one's drain and
    accumulation add to it."""
    assert 13_824 / command_cycles(CoreConfig(), 96, 96, 96) >= 0.99
    big = CoreConfig(rows=16, cols=16, size=240)
    assert 240**3 / 256 / command_cycles(big, 240, 240, 240) >= 0.99
