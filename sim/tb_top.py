"""cocotb testbench of ``hbfp.hw.top.AcceleratorTop``: the device driven through the wire
protocol only, with the host's encoders (``hbfp.host.protocol``), and every result compared
with the golden model (``hbfp.golden``) bit for bit, NaNs included.

The host side (``Link``) sends frames on ``i`` in beats of ``stream_bytes`` lanes, some of
them partly filled or empty (``keep``), with random idle cycles; it takes ``o`` with random
backpressure and splits the bytes into frames with ``protocol.FrameParser``. ``Device``
adds requests and replies on top, and a model of the STATUS counters.

Configuration (``tb_config()``): the ``CoreConfig`` fields, ``built`` (the functions built),
``stream_bytes``, ``clock_hz``, ``max_payload``, ``frame_timeout``, ``seed``, ``stall`` and
``products`` (how many random products ``random_products`` runs, ``max_side`` their largest
side).

A reduced device (``CoreConfig``'s ``value_quantizer``, ``bfp_output``, ``stochastic`` False,
or few ``functions``) gets only requests for the units it has, except in ``bad_frames`` and
where a test checks that the device refuses the others (BAD_DESCRIPTOR) and keeps working.
"""

from __future__ import annotations

import random
import struct
from collections import deque

import cocotb
import ml_dtypes
import numpy as np
from cocotb.triggers import ClockCycles, Event, ReadOnly, RisingEdge, with_timeout

from hbfp.contract import functions_mask
from hbfp.golden import activations, bf16
from hbfp.golden.bfp import BFPTensor, Format, quantize
from hbfp.golden.compare import same_bits_elementwise
from hbfp.golden.gemm import gemm
from hbfp.host import conformance, protocol
from hbfp.host.protocol import Frame, Op, OutFormat, Status, Target
from hbfp.hw.activation import FUNCTIONS, UNARY_FUNCTIONS
from hbfp.sim.runner import CLOCK_PERIOD_NS, tb_config
from hbfp.sim.streams import StreamSource, start_clock_and_reset

ROUNDINGS = ("nearest_even", "toward_zero", "stochastic")
LOADS = ("codes", "fp32", "bf16")
#: Cycles to wait for a reply (the longest: a product's run plus its reply at 1 byte a beat).
REPLY_TIMEOUT = 200_000


# ---- the host side of the link -------------------------------------------------------------


class Link:
    """Frames out on ``i`` (random partial beats and stalls), reply frames in from ``o``."""

    def __init__(self, dut, stream_bytes: int, rng: random.Random, stall: float):
        self.dut = dut
        self.sb = stream_bytes
        self.rng = rng
        self.stall = stall
        self.src = StreamSource(dut, "i", stall=stall, rng=rng)
        self.o_valid, self.o_ready, self.o_payload = dut.o__valid, dut.o__ready, dut.o__payload
        self.parser = protocol.FrameParser(max_payload=1 << 30)
        self.frames: deque = deque()
        #: The bytes received while ``record`` is set, for a reader of raw bytes (``take``).
        self.raw = bytearray()
        self.record = False
        self.arrived = Event()
        self.received = 0
        cocotb.start_soon(self._monitor())

    def beats(self, data: bytes) -> list[int]:
        """``data`` as beats: full ones mostly; with several lanes, also beats with fewer
        bytes in scattered lanes, and empty beats."""
        sb, out, pos = self.sb, [], 0
        mask = (1 << 8 * sb) - 1
        while pos < len(data):
            if sb == 1:
                lanes = [0]
            elif self.rng.random() < 0.05:
                out.append(self.rng.getrandbits(8 * sb) & mask)  # keep = 0: a null beat
                continue
            elif self.rng.random() < 0.7:
                lanes = list(range(sb))
            else:
                lanes = sorted(self.rng.sample(range(sb), self.rng.randint(1, sb)))
            chunk = data[pos:pos + len(lanes)]
            lanes = lanes[:len(chunk)]
            pos += len(chunk)
            word, keep = 0, 0
            for lane, b in zip(lanes, chunk):
                word |= b << (8 * lane)
                keep |= 1 << lane
            out.append(word | (keep << (8 * sb)))
        return out

    def set_stall(self, stall: float) -> None:
        self.stall = self.src.stall = stall

    async def send(self, data: bytes) -> None:
        await self.src.send(self.beats(data))

    async def _monitor(self) -> None:
        clk, sb = self.dut.clk, self.sb
        while True:
            ready = not (self.stall and self.rng.random() < self.stall)
            self.o_ready.value = int(ready)
            await ReadOnly()
            if ready and self.o_valid.value:
                value = self.o_payload.value
                assert value.is_resolvable, f"o: payload {value} has X/Z bits on a valid beat"
                word = int(value)
                keep = word >> (8 * sb)
                n = bin(keep).count("1")
                assert keep and keep == (1 << n) - 1, f"o: keep {keep:#x} is not a run of lanes from lane 0"
                chunk = bytes((word >> (8 * i)) & 0xFF for i in range(n))
                self.received += n
                if self.record:
                    self.raw += chunk
                frames = self.parser.feed(chunk)
                if frames:
                    self.frames.extend(frames)
                    self.arrived.set()
            await RisingEdge(clk)

    async def reply(self, timeout_cycles: int = REPLY_TIMEOUT):
        if not self.frames:
            while not self.frames:
                self.arrived.clear()
                await with_timeout(self.arrived.wait(), timeout_cycles * CLOCK_PERIOD_NS, "ns")
            await RisingEdge(self.dut.clk)  # out of the monitor's read-only phase
        return self.frames.popleft()

    async def idle(self, cycles: int) -> None:
        await ClockCycles(self.dut.clk, cycles)

    def take(self) -> bytes:
        """The raw bytes received since the last ``take``."""
        out = bytes(self.raw)
        self.raw.clear()
        return out


# ---- the device's optional units (hw.params.CoreConfig) -------------------------------------


def has(cfg: dict, unit: str) -> bool:
    """Whether the device was built with ``unit`` (a ``protocol.UNITS`` name)."""
    return bool(cfg.get(unit, True))


def omitted_mask(cfg: dict) -> int:
    """IDENTIFY's ``omitted``: a bit per unit left out."""
    return sum(1 << bit for unit, bit in protocol.UNITS.items() if not has(cfg, unit))


def roundings(cfg: dict) -> tuple[str, ...]:
    """The roundings the device's quantizers do (values WRITEs, BFP results)."""
    return ROUNDINGS if has(cfg, "stochastic") else ROUNDINGS[:2]


def loads(cfg: dict) -> tuple[str, ...]:
    """The ways to load an operand: codes, or values the device quantizes."""
    return LOADS if has(cfg, "value_quantizer") else LOADS[:1]


def out_formats(cfg: dict) -> tuple[OutFormat, ...]:
    return tuple(OutFormat) if has(cfg, "bfp_output") else (OutFormat.FP32, OutFormat.BF16)


def activations_built(cfg: dict) -> list[str]:
    """The unary functions built: a GEMM's or READ's activations."""
    return [f for f in cfg["built"] if f in UNARY_FUNCTIONS]


def refused_unless(present: bool) -> int:
    """The status of a request the device serves only with a unit."""
    return Status.OK if present else Status.BAD_DESCRIPTOR


# ---- requests, replies and the golden model --------------------------------------------------


def tile_major(x: np.ndarray, tile) -> np.ndarray:
    """Elements of a matrix (sides multiples of the tile) in tile-major order."""
    th, tw = tile
    r, c = x.shape
    return x.reshape(r // th, th, c // tw, tw).transpose(0, 2, 1, 3).reshape(-1)


def pad_to(x: np.ndarray, rows: int, cols: int) -> np.ndarray:
    out = np.zeros((rows, cols), x.dtype)
    out[: x.shape[0], : x.shape[1]] = x
    return out


def ceil_to(v: int, step: int) -> int:
    return -(-v // step) * step


class Device:
    """Requests through the protocol, checked replies, and the STATUS counters' model."""

    def __init__(self, dut, cfg: dict, link: Link):
        self.dut, self.cfg, self.link = dut, cfg, link
        self.R, self.C, self.D = cfg["rows"], cfg["cols"], cfg["size"]
        self.tile = tuple(cfg["tile"])
        self.mb = cfg["mantissa_bits"]
        self.fmt = Format(self.mb, self.tile)
        self.code_dtype = np.dtype("<i1") if self.mb <= 8 else np.dtype("<i2")
        self.max_payload = cfg["max_payload"]
        self.tag = random.Random(cfg["seed"]).randrange(1 << 16)
        self.accepted = self.refused = self.last_error = 0
        self.last_cycles = None

    def next_tag(self) -> int:
        self.tag = (self.tag + 1) & 0xFFFF
        if self.tag == protocol.FRAME_TIMEOUT_TAG:  # keep TIMEOUT replies unambiguous
            self.tag = 0
        return self.tag

    def count(self, status: int) -> None:
        if status == Status.OK:
            self.accepted += 1
        else:
            self.refused += 1
            self.last_error = status

    async def check_reply(self, opcode: int, tag: int, status: int) -> Frame:
        reply = await self.link.reply()
        assert isinstance(reply, Frame), f"the reply's CRC does not check: {reply}"
        assert reply.version == protocol.PROTOCOL_VERSION
        assert reply.opcode == (opcode | protocol.REPLY) & 0xFF, f"reply opcode {reply.opcode:#x} to {opcode:#x}"
        assert reply.tag == tag, f"reply tag {reply.tag:#x}, request tag {tag:#x}"
        assert reply.status == status, f"opcode {opcode:#x}: status {reply.status!r}, expected {Status(status)!r}"
        self.count(status)
        return reply

    async def request(self, opcode: int, payload: bytes = b"", *, status: int = Status.OK, version: int = protocol.PROTOCOL_VERSION,
                      corrupt=None) -> Frame:
        tag = self.next_tag()
        frame = bytearray(protocol.encode_frame(opcode, tag, payload, version=version))
        if corrupt is not None:
            corrupt(frame)
        await self.link.send(bytes(frame))
        return await self.check_reply(opcode, tag, status)

    # -- commands --------------------------------------------------------------------

    async def identify(self) -> protocol.Identity:
        reply = await self.request(Op.IDENTIFY)
        assert len(reply.data) == 32
        return protocol.decode_identity(reply.data)

    async def status(self) -> tuple[int, int, int, int]:
        reply = await self.request(Op.STATUS)
        assert len(reply.data) == 16
        accepted, refused, cycles, last_error = struct.unpack("<IIIB3x", reply.data)
        return accepted, refused, cycles, last_error

    async def check_status(self) -> None:
        accepted, refused, cycles, last_error = await self.status()  # counts itself
        assert (accepted, refused, last_error) == (self.accepted, self.refused, self.last_error), (
            f"STATUS counters {(accepted, refused, last_error)}, expected "
            f"{(self.accepted, self.refused, self.last_error)}")
        if self.last_cycles is not None:
            assert cycles == self.last_cycles, f"STATUS cycles {cycles}, last GEMM replied {self.last_cycles}"

    async def reset(self) -> None:
        await self.request(Op.RESET)
        self.accepted = self.refused = self.last_error = 0
        self.last_cycles = 0

    async def write(self, target, row, col, rows, cols, data: bytes, **kw) -> None:
        await self.request(Op.WRITE, protocol.encode_write(target, row, col, rows, cols, data, **kw))

    def rows_per_write(self, row_bytes: int) -> int:
        return max(1, (self.max_payload - 16) // row_bytes)

    async def write_codes(self, target: int, t: BFPTensor) -> None:
        """The stored operand ``t`` as codes and exponents (codes padded to whole chunks: R
        codes for A, C for B)."""
        rows, cols = t.shape
        lanes = self.R if target == Target.A_CODES else self.C
        padded = pad_to(t.codes.astype(self.code_dtype), rows, ceil_to(cols, lanes))
        step = self.rows_per_write(padded.shape[1] * self.code_dtype.itemsize)
        for r0 in range(0, rows, step):
            part = padded[r0:r0 + step]
            await self.write(target, r0, 0, part.shape[0], part.shape[1], part.tobytes())
        e = t.exponents
        await self.write(target + Target.A_EXPONENTS, 0, 0, e.shape[0], e.shape[1], e.astype(np.uint8).tobytes())

    async def write_values(self, target: int, x: np.ndarray, *, encoding: int, rounding: str, seed: int,
                           rng: random.Random) -> BFPTensor:
        """``x`` (fp32 or bf16, the stored operand) quantized by the device, in regions of
        whole tiles; returns the golden quantization of what was written."""
        th, tw = self.tile
        rows, cols = ceil_to(x.shape[0], th), ceil_to(x.shape[1], tw)
        xp = pad_to(x, rows, cols)
        codes = np.zeros((rows, cols), self.fmt.code_dtype)
        exps = np.zeros((rows // th, cols // tw), np.uint8)
        esize = 4 if encoding == protocol.Encoding.FP32 else 2
        # Regions of random whole-tile shapes, each quantized as its own stream (seed + r0).
        room = (self.max_payload - 16) // esize  # elements a WRITE can carry
        assert room >= th * tw, "max_payload must hold a tile of fp32 values"
        r0 = 0
        while r0 < rows:
            h = th * rng.randint(1, min(rows - r0, room // tw) // th)
            c0 = 0
            while c0 < cols:
                wmax = max(1, min(cols - c0, (self.max_payload - 16) // (h * esize)) // tw)
                w = tw * rng.randint(1, wmax)
                region = xp[r0:r0 + h, c0:c0 + w]
                s = (seed + r0 * 7 + c0) & 0xFFFFFFFF
                await self.write(target, r0, c0, h, w, tile_major(region, self.tile).tobytes(),
                                 encoding=encoding, rounding=ROUNDINGS.index(rounding), seed=s)
                q = quantize(region, self.fmt.with_rounding(rounding), seed=s)
                codes[r0:r0 + h, c0:c0 + w] = q.codes
                exps[r0 // th:(r0 + h) // th, c0 // tw:(c0 + w) // tw] = q.exponents
                c0 += w
            r0 += h
        m, n = x.shape
        return BFPTensor(np.ascontiguousarray(codes[:m, :n]), exps[: -(-m // th), : -(-n // tw)], self.fmt)

    async def write_fp32(self, target: int, x: np.ndarray) -> None:
        """Accumulator rows (or the bias, one row), padded to whole chunks."""
        rows, cols = x.shape
        padded = pad_to(x.astype("<f4"), rows, ceil_to(cols, self.C))
        step = 1 if target == Target.BIAS else self.rows_per_write(padded.shape[1] * 4)
        for r0 in range(0, rows, step):
            part = padded[r0:r0 + step]
            await self.write(target, r0, 0, part.shape[0], part.shape[1], part.tobytes())

    def decode_result(self, data: bytes, m: int, n: int, out_format: int):
        if out_format == OutFormat.FP32:
            assert len(data) == 4 * m * n
            return np.frombuffer(data, "<f4").reshape(m, n).astype(np.float32)
        if out_format == OutFormat.BF16:
            assert len(data) == 2 * m * n
            return np.frombuffer(data, "<u2").reshape(m, n).astype(np.uint16)
        th, tw = self.tile
        tm, tn = -(-m // th), -(-n // tw)
        per_tile = 1 + th * tw * self.code_dtype.itemsize
        assert len(data) == tm * tn * per_tile, f"BFP reply of {len(data)} bytes for {tm}x{tn} tiles"
        codes = np.zeros((tm * th, tn * tw), np.int64)
        exps = np.zeros((tm, tn), np.uint8)
        pos = 0
        for i in range(tm):
            for j in range(tn):
                exps[i, j] = data[pos]
                tile = np.frombuffer(data[pos + 1:pos + per_tile], self.code_dtype).reshape(th, tw)
                codes[i * th:(i + 1) * th, j * tw:(j + 1) * tw] = tile
                pos += per_tile
        return codes, exps

    def compare(self, got, want, out_format: int, what: str) -> None:
        if out_format == OutFormat.BFP:
            codes, exps = got
            m, n = want.shape
            assert (exps == want.exponents).all(), f"{what}: {(exps != want.exponents).sum()} exponents differ"
            assert (codes[:m, :n] == want.codes).all(), f"{what}: {(codes[:m, :n] != want.codes).sum()} codes differ"
            assert not codes[m:, :].any() and not codes[:, n:].any(), f"{what}: nonzero padding codes"
            return
        if out_format == OutFormat.BF16:
            want16 = bf16.as_bits(want)
            ok = same_bits_elementwise(got, want16)
            gf, wf = bf16.to_f32(got), bf16.to_f32(want16)
        else:
            ok = same_bits_elementwise(got, want)
            gf, wf = got, want
        if not ok.all():
            bad = np.argwhere(~ok)[:5]
            raise AssertionError(f"{what}: {int((~ok).sum())} of {ok.size} differ; " + ", ".join(
                f"({i},{j}) got {gf[i, j]!r} want {wf[i, j]!r}" for i, j in bad))


# ---- random products ------------------------------------------------------------------------


def random_matrix(rng: np.random.Generator, shape, specials: bool) -> np.ndarray:
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-6, 7, (shape[0], 1)))).astype(np.float32)
    if specials and x.size:
        x[rng.integers(0, shape[0]), rng.integers(0, shape[1])] = rng.choice([np.inf, -np.inf, np.nan])
        x[rng.integers(0, shape[0])] *= np.float32(2.0**-110)
    return x


async def run_product(dev: Device, rng: random.Random, nrng: np.random.Generator, prod: dict, log) -> None:
    """Load the operands (codes or values), run one GEMM, check its reply; maybe READ."""
    m, n, k = prod["m"], prod["n"], prod["k"]
    a = random_matrix(nrng, (m, k), prod["specials"])
    b = random_matrix(nrng, (k, n), False)
    a_st = a.T if prod["ta"] else a
    b_st = b.T if prod["tb"] else b
    operands = []
    for target, x, how in ((Target.A_CODES, a_st, prod["load_a"]), (Target.B_CODES, b_st, prod["load_b"])):
        if how == "codes":
            q = quantize(x, dev.fmt)
            await dev.write_codes(target, q)
        else:
            enc = protocol.Encoding.BF16 if how == "bf16" else protocol.Encoding.FP32
            values = x.astype(ml_dtypes.bfloat16) if how == "bf16" else x
            q = await dev.write_values(target + (Target.A_VALUES - Target.A_CODES), values, encoding=enc,
                                       rounding=prod["in_rounding"], seed=prod["seed"] ^ 0x55, rng=rng)
        operands.append(q)
    qa, qb = operands
    c = (nrng.standard_normal((m, n)) * 4).astype(np.float32) if prod["acc"] else None
    bias = nrng.standard_normal(n).astype(np.float32) if prod["bias"] else None
    if c is not None:
        await dev.write_fp32(Target.ACC, c)
    if bias is not None:
        await dev.write_fp32(Target.BIAS, bias[None, :])
    if prod["corrupt"]:
        # A WRITE of garbage over A whose CRC fails must leave A as it was.
        rows = min(qa.shape[0], 4)
        cols = ceil_to(qa.shape[1], dev.R)
        garbage = bytes(rng.randrange(256) for _ in range(rows * cols * dev.code_dtype.itemsize))
        data_at = protocol.HEADER.size + 16 + rng.randrange(len(garbage))
        await dev.request(Op.WRITE, protocol.encode_write(Target.A_CODES, 0, 0, rows, cols, garbage),
                          status=Status.BAD_CRC, corrupt=lambda f: f.__setitem__(data_at, f[data_at] ^ 0x10))

    out = prod["out"]
    out_fmt = dev.fmt.with_rounding(prod["rounding"]) if out == OutFormat.BFP else ("fp32", "bf16")[out]
    act = prod["act"]
    want = gemm(qa, qb, c=c, bias=bias, activation=act, out=out_fmt,
                transpose_a=prod["ta"], transpose_b=prod["tb"], seed=prod["seed"])
    payload = protocol.encode_gemm(
        m, n, k, transpose_a=prod["ta"], transpose_b=prod["tb"], accumulate=prod["acc"], bias=prod["bias"],
        activation=protocol.NO_ACTIVATION if act is None else FUNCTIONS.index(act), out_format=out,
        rounding=ROUNDINGS.index(prod["rounding"]), seed=prod["seed"])
    reply = await dev.request(Op.GEMM, payload)
    cycles = protocol.decode_cycles(reply.data)  # after the result
    got = dev.decode_result(reply.data[:-protocol.CYCLES_SIZE], m, n, out)
    dev.compare(got, want, out, f"GEMM {prod}")
    if prod["repeat"]:
        # The same command again, the host now taking bytes at full speed: the same reply,
        # cycles included (the count stops with the last sums, whatever the reply's pace).
        stall = dev.link.stall
        dev.link.set_stall(0.0)
        again = await dev.request(Op.GEMM, payload)
        dev.link.set_stall(stall)
        assert again.payload == reply.payload, f"GEMM {prod} repeated: another reply ({again.data[-protocol.CYCLES_SIZE:]!r} cycles)"
    # The core's own count, until its last sums are in the accumulator: at least its MAC beats
    # (tk a K-tile of each R x C block), and the same whatever the host's pace (the MAC phase
    # never waits on the reply).
    R, C = dev.R, dev.C
    tk = dev.tile[1]
    macs = -(-m // R) * -(-n // C) * -(-k // tk) * tk
    assert macs <= cycles <= 2 * macs + 400, f"GEMM cycles {cycles} against a floor of {macs}"
    dev.last_cycles = cycles
    log.info(f"GEMM {m}x{n}x{k} ta={prod['ta']} tb={prod['tb']} acc={prod['acc']} bias={prod['bias']} "
             f"act={act} out={OutFormat(out).name} loads={prod['load_a']}/{prod['load_b']}: {cycles} cycles")

    if prod["read"]:
        # READ re-reads the accumulator the GEMM left (its sums before bias and activation)
        # through another epilogue.
        # (An fp32 or bf16 result ignores its rounding: any valid code, even one the device's
        # quantizers lack.)
        r_out = rng.choice(out_formats(dev.cfg))
        r_act = rng.choice([None] + activations_built(dev.cfg))
        r_bias = bias is not None and rng.random() < 0.5
        r_round = rng.choice(roundings(dev.cfg) if r_out == OutFormat.BFP else ROUNDINGS)
        r_seed = rng.randrange(1 << 32)
        r_fmt = dev.fmt.with_rounding(r_round) if r_out == OutFormat.BFP else ("fp32", "bf16")[r_out]
        want = gemm(qa, qb, c=c, bias=bias if r_bias else None, activation=r_act, out=r_fmt,
                    transpose_a=prod["ta"], transpose_b=prod["tb"], seed=r_seed)
        reply = await dev.request(Op.READ, protocol.encode_read(
            m, n, out_format=r_out, activation=protocol.NO_ACTIVATION if r_act is None else FUNCTIONS.index(r_act),
            bias=r_bias, rounding=ROUNDINGS.index(r_round), seed=r_seed))
        dev.compare(dev.decode_result(reply.data, m, n, r_out), want, r_out, f"READ after {prod}")
        dev.last_cycles = 0  # a READ computes no sums: STATUS's cycles become 0


def random_product(rng: random.Random, cfg: dict, index: int = 0) -> dict:
    """A random product; ``index`` rotates the output format and the ways A and B are
    loaded (those the device has), so that a few products cover all of them."""
    side = cfg["max_side"]
    square = cfg["tile"][0] == cfg["tile"][1]
    outs, lds, rnds = out_formats(cfg), loads(cfg), roundings(cfg)
    out = outs[index % len(outs)]
    acc = rng.random() < 0.4
    return dict(
        m=rng.randint(1, side), n=rng.randint(1, side), k=rng.randint(1, side),
        ta=bool(rng.randint(0, 1)) if square else False,
        tb=bool(rng.randint(0, 1)) if square else True,
        acc=acc,
        bias=rng.random() < 0.4,
        act=rng.choice([None, None] + activations_built(cfg)),
        out=out,
        rounding=rng.choice(rnds) if out == OutFormat.BFP else "nearest_even",
        seed=rng.randrange(1 << 32),
        load_a=lds[index % len(lds)],
        load_b=lds[(index + 1 + index // 3) % len(lds)],
        in_rounding=rnds[(index + index // 3) % len(rnds)],
        specials=index % 4 == 1,
        read=rng.random() < 0.5,
        corrupt=rng.random() < 0.5,
        repeat=not acc and rng.random() < 0.5,
    )


async def setup(dut, *, stall: float | None = None):
    cfg = tb_config()
    await start_clock_and_reset(dut, sources=["i"], sinks=["o"])
    rng = random.Random(cfg["seed"])
    link = Link(dut, cfg["stream_bytes"], rng, cfg["stall"] if stall is None else stall)
    return cfg, rng, Device(dut, cfg, link)


# ---- tests ------------------------------------------------------------------------------------


@cocotb.test()
async def identify_status_reset(dut):
    """IDENTIFY's fields; STATUS counters; RESET clears them."""
    cfg, rng, dev = await setup(dut)
    ident = await dev.identify()
    mask = functions_mask(cfg["built"])
    want = protocol.Identity(
        protocol_version=protocol.PROTOCOL_VERSION, abi_major=protocol.ABI_VERSION[0], abi_minor=protocol.ABI_VERSION[1],
        stream_bytes=cfg["stream_bytes"], rows=cfg["rows"], cols=cfg["cols"], mantissa_bits=cfg["mantissa_bits"],
        tile_rows=cfg["tile"][0], tile_cols=cfg["tile"][1], leaky_shift=cfg["leaky_shift"], size=cfg["size"],
        functions_mask=mask, clock_hz=cfg["clock_hz"], max_payload=cfg["max_payload"],
        frame_timeout=cfg["frame_timeout"], omitted=omitted_mask(cfg))
    assert ident == want, f"IDENTIFY {ident} != {want}"
    assert ident.units == tuple(u for u in protocol.UNITS if has(cfg, u))
    await dev.check_status()
    # Empty regions are valid, empty WRITEs (of values: only on a device that quantizes them).
    await dev.write(Target.A_CODES, 0, 0, 0, cfg["cols"], b"")
    await dev.request(Op.WRITE, protocol.encode_write(Target.B_VALUES, 0, 0, cfg["tile"][0], 0, b""),
                      status=refused_unless(has(cfg, "value_quantizer")))
    await dev.write(Target.A_EXPONENTS, 1, 1, 0, 0, b"")
    await dev.request(0x55, status=Status.BAD_OPCODE)
    await dev.check_status()
    await dev.reset()
    await dev.check_status()
    # Requests back to back: the device takes the next one once it has replied.
    tags = [dev.next_tag() for _ in range(3)]
    await dev.link.send(b"".join(protocol.encode_frame(op, t) for op, t in zip((Op.IDENTIFY, Op.STATUS, Op.IDENTIFY), tags)))
    for op, t in zip((Op.IDENTIFY, Op.STATUS, Op.IDENTIFY), tags):
        await dev.check_reply(op, t, Status.OK)
    await dev.check_status()


@cocotb.test()
async def random_products(dut):
    """WRITEs of every target, GEMMs in every output format, READs: against the golden gemm."""
    cfg, rng, dev = await setup(dut)
    nrng = np.random.default_rng(cfg["seed"])
    for index in range(cfg["products"]):
        await run_product(dev, rng, nrng, random_product(rng, cfg, index), dut._log)
    await dev.check_status()


@cocotb.test()
async def write_acc_read(dut):
    """The accumulator written and read back (K = 0 through the epilogue), with bias, in
    each output format the device has (BFP in two roundings)."""
    cfg, rng, dev = await setup(dut)
    nrng = np.random.default_rng(cfg["seed"] + 1)
    m, n = rng.randint(1, cfg["max_side"]), rng.randint(1, cfg["max_side"])
    c = (nrng.standard_normal((m, n)) * 8).astype(np.float32)
    c[0, 0] = np.float32(1e-40)  # a subnormal: DAZ on the way out
    bias = nrng.standard_normal(n).astype(np.float32)
    await dev.write_fp32(Target.ACC, c)
    await dev.write_fp32(Target.BIAS, bias[None, :])
    # The golden epilogue over C alone: a product with one all-zero K step adds +0.
    # (B stored N x 1, used transposed: that also suits a non-square tile.)
    th, tw = dev.tile
    zero_a = BFPTensor(np.zeros((m, 1), dev.fmt.code_dtype), np.zeros((-(-m // th), 1), np.uint8), dev.fmt)
    zero_b = BFPTensor(np.zeros((n, 1), dev.fmt.code_dtype), np.zeros((-(-n // th), 1), np.uint8), dev.fmt)
    # fp32 as written (DAZ aside); bf16 with the bias and the stochastic rounding code, which
    # an fp32 or bf16 result ignores (even on a device without stochastic rounding); BFP
    # (where built) with the bias, rounded to nearest and in the device's last rounding
    # (stochastic, or toward zero on a device without stochastic rounding).
    reads = [(OutFormat.FP32, "nearest_even"), (OutFormat.BF16, "stochastic")]
    if has(cfg, "bfp_output"):
        reads += [(OutFormat.BFP, "nearest_even"), (OutFormat.BFP, roundings(cfg)[-1])]
    for out, rounding in reads:
        use_bias = out != OutFormat.FP32
        seed = rng.randrange(1 << 32)
        fmt = dev.fmt.with_rounding(rounding) if out == OutFormat.BFP else ("fp32", "bf16")[out]
        want = gemm(zero_a, zero_b, c=c, bias=bias if use_bias else None, out=fmt, seed=seed, transpose_b=True)
        reply = await dev.request(Op.READ, protocol.encode_read(m, n, out_format=out, bias=use_bias,
                                                                rounding=ROUNDINGS.index(rounding), seed=seed))
        dev.compare(dev.decode_result(reply.data, m, n, out), want, out, f"READ {OutFormat(out).name} {rounding}")
    _, _, cycles, _ = await dev.status()
    assert cycles == 0, f"STATUS reports the last READ's cycles, 0 (it computes no sums), not {cycles}"


@cocotb.test()
async def elementwise(dut):
    """ELEMENTWISE: every built function, unary and gradient, on random and special inputs
    (a device without functions refuses them all)."""
    cfg, rng, dev = await setup(dut)
    if not cfg["built"]:
        for name in ("relu", "relu_grad"):
            g = b"" if name in UNARY_FUNCTIONS else bytes(4)
            await dev.request(Op.ELEMENTWISE, protocol.encode_elementwise(FUNCTIONS.index(name), bytes(4), g),
                              status=Status.BAD_DESCRIPTOR)
            await dev.request(Op.ELEMENTWISE, protocol.encode_elementwise(FUNCTIONS.index(name), b""),
                              status=Status.BAD_DESCRIPTOR)
        await dev.identify()
        await dev.check_status()
        return
    nrng = np.random.default_rng(cfg["seed"] + 2)
    specials = np.array([0x0000, 0x8000, 0x0001, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x3F80, 0xBF80, 0x4120, 0xC120],
                        np.uint16)
    for name in cfg["built"]:
        most = (cfg["max_payload"] - 8) // (2 if name in UNARY_FUNCTIONS else 4)
        count = int(nrng.integers(1, min(most, cfg["elementwise_count"]) + 1))
        x = nrng.integers(0, 1 << 16, count).astype(np.uint16)
        x[: min(count, len(specials))] = specials[: min(count, len(specials))]
        code = FUNCTIONS.index(name)
        shift = {"shift": cfg["leaky_shift"]} if name.startswith("leaky_relu") else {}
        if name in UNARY_FUNCTIONS:
            want = activations.get(name)(x, **shift)
            g = np.zeros(0, np.uint16)
        else:
            g = bf16.from_f32(nrng.standard_normal(count).astype(np.float32))
            want = activations.get(name[: -len("_grad")], "grad")(x, g, **shift)
        reply = await dev.request(Op.ELEMENTWISE, protocol.encode_elementwise(code, x.astype("<u2").tobytes(),
                                                                              g.astype("<u2").tobytes()))
        got = np.frombuffer(reply.data, "<u2").astype(np.uint16)
        assert got.shape == want.shape, f"{name}: {got.shape} results for {count} inputs"
        ok = same_bits_elementwise(got, bf16.as_bits(want))
        assert ok.all(), f"{name}: {int((~ok).sum())} of {count} differ, e.g. x={x[~ok][:4]} got {got[~ok][:4]}"
    # count = 0 is a valid, empty request
    reply = await dev.request(Op.ELEMENTWISE, protocol.encode_elementwise(FUNCTIONS.index(cfg["built"][0]), b""))
    assert reply.data == b""
    await dev.check_status()


async def run_conformance(dev: Device, ident: protocol.Identity) -> list[str]:
    """The protocol's conformance table (``hbfp.host.conformance``: every error case, each
    followed by a STATUS that checks the counters) through this link: its random stalls and
    partial beats. Returns the failures (a failed case leaves the device resynchronized)."""
    link, clk = dev.link, dev.dut.clk
    failures = []
    before = None
    link.record = True
    link.take()
    for case in conformance.cases(ident):
        gen = conformance.drive(case, ident, before, patience=REPLY_TIMEOUT)
        got = None
        try:
            while True:
                action = gen.send(got)
                got = None
                if action[0] == "write":
                    await link.send(action[1])
                elif action[0] == "read":
                    got = link.take()
                else:
                    await ClockCycles(clk, action[1])
        except StopIteration as stop:
            before = stop.value
        except conformance.ConformanceError as e:
            failures.append(str(e))
            dev.dut._log.error(str(e))
            before = None
    link.record = False
    link.frames.clear()  # the host parser's copies of the same replies
    if before is None:
        st = await dev.request(Op.STATUS)
        before = protocol.decode_status(st.data)
    # the model of the counters goes on from the last STATUS
    dev.accepted, dev.refused, dev.last_error = before.accepted, before.refused, before.last_error
    dev.last_cycles = None
    return failures


def core_of(cfg: dict):
    """The ``CoreConfig`` of a testbench configuration."""
    import dataclasses

    from hbfp.hw.params import CoreConfig

    fields = {f.name for f in dataclasses.fields(CoreConfig)}
    return CoreConfig(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in cfg.items() if k in fields})


@cocotb.test()
async def bad_frames(dut):
    """Every error status and the framing rules (docs/protocol.md), as the conformance table
    states them for this device (its size, tile, units and functions built), each case
    followed by a STATUS that works; then a product still runs correctly."""
    cfg, rng, dev = await setup(dut)
    ident = conformance.identity_of(core_of(cfg), max_payload=cfg["max_payload"],
                                    frame_timeout=cfg["frame_timeout"], stream_bytes=cfg["stream_bytes"],
                                    clock_hz=cfg["clock_hz"])
    got = await dev.identify()
    assert got == ident, f"IDENTIFY {got} != {ident}"
    failures = await run_conformance(dev, ident)
    assert not failures, f"{len(failures)} conformance cases fail:\n" + "\n".join(failures)
    await dev.check_status()

    # And a product still runs correctly after all that.
    nrng = np.random.default_rng(cfg["seed"] + 3)
    prod = dict(random_product(rng, cfg, 2), corrupt=True)
    await run_product(dev, rng, nrng, prod, dut._log)
    await dev.check_status()
