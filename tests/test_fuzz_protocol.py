"""A bounded, seeded fuzz of the wire protocol: bursts of random bytes (valid requests,
requests with flipped, inserted or deleted bytes, truncated ones, several back to back,
garbage, oversized lengths) against ``emu`` and against the simulated gateware (fewer).

After every burst: no exception; one reply per complete frame, in order, with the opcode and
tag the frame carried (a frame's limits are those of the device-side ``FrameParser``, the
packet engine's rules: docs/protocol.md), and the known status where framing decides it
(BAD_CRC, BAD_LENGTH of an oversized frame, BAD_VERSION, TIMEOUT of a frame left
incomplete); no hang (every wait is a bounded number of clock cycles); and a STATUS that
works and whose counters account for every reply seen. On ``sim`` the same bursts also run
on an ``emu`` of the same identity, and every reply's status and data size must agree.

Reproducible: each test's bursts come from ``random.Random(seed)``; a failure names the seed
and the burst. ``HBFP_FUZZ_FULL=1`` runs many more bursts and seeds (``make fuzz``);
``HBFP_FUZZ_BURSTS=N`` sets the bursts per emu test (sim: a quarter), ``HBFP_FUZZ_SEED=S``
the first seed.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from hbfp.host import protocol as P
from hbfp.host.emu import EmuDevice
from hbfp.host.protocol import Op, Status

from .conftest import SIM_TOP_ARG, open_emu, requires_sim

FULL = os.environ.get("HBFP_FUZZ_FULL", "") not in ("", "0")
EMU_BURSTS = int(os.environ.get("HBFP_FUZZ_BURSTS", 20_000 if FULL else 1000))
SIM_BURSTS = max(1, EMU_BURSTS // 4)
SEED = int(os.environ.get("HBFP_FUZZ_SEED", 1))
SEEDS = [SEED + i for i in range(4 if FULL else 1)]

#: ``emu:`` options of the devices fuzzed: the default device, a small one with a short
#: frame timeout, a reduced one, and a non-square tile.
EMU_CONFIGS = {
    "default": "frame_timeout=5000",
    "small": "rows=4,cols=4,size=48,functions=relu+gelu_grad,frame_timeout=700",
    "reduced": "rows=4,cols=4,size=48,bfp_output=0,value_quantizer=0,stochastic=0,functions=none,frame_timeout=900",
    "mxint8": "format=MXINT8,rows=4,cols=4,size=64,frame_timeout=600",
}


# ---- random bytes -------------------------------------------------------------------------------


class Bursts:
    """Random requests and bursts for a device of identity ``ident``, from ``rng``."""

    def __init__(self, ident: P.Identity, rng: random.Random, *, small: bool = False):
        from hbfp.contract import FUNCTIONS

        self.i, self.r = ident, rng
        self.nf = len(FUNCTIONS)
        self.cb = P.code_bytes(ident.mantissa_bits)
        self.small = small  # keep products and payloads short (a simulator's cycles)

    def side(self) -> int:
        r, D = self.r, self.i.size
        return r.choice([0, 1, 2, 3, 4, r.randint(1, 8 if self.small else D), D, D + 1])

    def payload(self, op: int) -> bytes:
        r, i = self.r, self.i
        D, th, tw = i.size, i.tile_rows, i.tile_cols
        if op == Op.WRITE:
            target = r.choice([0, 1, 2, 3, 4, 5, 6, 7, 0, 4, 6, r.randrange(256)])
            lanes = {0: i.rows, 1: i.cols, 4: i.cols, 5: i.cols}.get(target, 1)
            if target in (6, 7):
                rows, cols = th * r.randint(0, 2), tw * r.randint(0, 2 if th * tw <= 64 else 1)
            elif target in (2, 3):
                rows, cols = r.randint(0, 3), r.randint(0, 3)
            else:
                rows, cols = r.randint(0, 4 if self.small else 8), lanes * r.randint(0, 4)
            if target == 5:
                rows = 1
            if r.random() < 0.15:
                rows, cols = rows + r.choice([-1, 1]), cols + r.choice([-1, 1])
            rows, cols = max(0, rows), max(0, cols)
            row = r.choice([0, 0, th, D - rows if rows <= D else 0, r.randrange(D + 2)])
            col = r.choice([0, 0, lanes, tw, D - cols if cols <= D else 0, r.randrange(D + 2)])
            encoding = r.choice([0, 0, 1, 1, 2]) if target in (6, 7) else r.choice([0, 0, 0, 1])
            rounding = r.choice([0, 1, 2, 0, 3])
            width = {0: self.cb, 1: self.cb, 2: 1, 3: 1, 4: 4, 5: 4}.get(target, 4 if encoding == 0 else 2)
            n = rows * cols * width
            if r.random() < 0.15:
                n = max(0, n + r.choice([-1, 1, -width, width, 7]))
            n = min(n, i.max_payload - 16 + r.choice([0, 0, 0, 1]))
            data = bytes(r.getrandbits(8) for _ in range(min(n, 64))) + bytes(max(0, n - 64))
            return P.encode_write(target, row & 0xFFFF, col & 0xFFFF, rows & 0xFFFF, cols & 0xFFFF, data,
                                  encoding=encoding, rounding=rounding, seed=r.getrandbits(32))
        if op in (Op.GEMM, Op.READ):
            act = r.choice([P.NO_ACTIVATION, P.NO_ACTIVATION, r.randrange(self.nf + 2), 0xFE])
            out = r.choice([0, 1, 2, 0, 1, 2, 3])
            rounding = r.choice([0, 1, 2, 3])
            if op == Op.GEMM:
                p = P.encode_gemm(self.side(), self.side(), self.side(), transpose_a=r.random() < 0.3,
                                  transpose_b=r.random() < 0.5, accumulate=r.random() < 0.3, bias=r.random() < 0.3,
                                  activation=act, out_format=out, rounding=rounding, seed=r.getrandbits(32))
            else:
                p = P.encode_read(self.side(), self.side(), out_format=out, activation=act, bias=r.random() < 0.3,
                                  rounding=rounding, seed=r.getrandbits(32))
            if r.random() < 0.05:
                p = p[: r.randrange(len(p))] if r.random() < 0.5 else p + bytes(r.randint(1, 3))
            return p
        if op == Op.ELEMENTWISE:
            code = r.choice([r.randrange(self.nf), r.randrange(self.nf), self.nf, 0xFF])
            count = r.randint(0, 16)
            x = bytes(r.getrandbits(8) for _ in range(2 * count))
            g = bytes(r.getrandbits(8) for _ in range(2 * count)) if r.random() < 0.5 else b""
            p = P.encode_elementwise(code, x, g)
            if r.random() < 0.1:
                p = p[: r.randrange(len(p) + 1)]
            return p
        if op in (Op.IDENTIFY, Op.STATUS, Op.RESET) and r.random() < 0.85:
            return b""
        return bytes(r.getrandbits(8) for _ in range(r.choice([0, 1, 3, 16, 40])))

    def request(self) -> bytes:
        r = self.r
        op = r.choices([Op.IDENTIFY, Op.STATUS, Op.WRITE, Op.READ, Op.GEMM, Op.ELEMENTWISE, Op.RESET, -1],
                       weights=[2, 3, 6, 3, 4, 3, 0.5, 1])[0]
        if op == -1:
            op = r.choice([0, 8, 0x7F, 0x81, r.randrange(256)])
        version = P.PROTOCOL_VERSION if r.random() > 0.04 else r.randrange(256)
        return P.encode_frame(op, r.randrange(1 << 16), self.payload(op), version=version)

    def mutate(self, data: bytes) -> bytes:
        r = self.r
        b = bytearray(data)
        for _ in range(r.randint(1, 3)):
            if not b:
                break
            k = r.randrange(len(b))
            what = r.choice(["flip", "flip", "byte", "insert", "delete"])
            if what == "flip":
                b[k] ^= 1 << r.randrange(8)
            elif what == "byte":
                b[k] = r.randrange(256)
            elif what == "insert":
                b.insert(k, r.randrange(256))
            else:
                del b[k]
        return bytes(b)

    def garbage(self) -> bytes:
        r = self.r
        g = bytearray(r.getrandbits(8) for _ in range(r.randint(0, 48)))
        for _ in range(r.randint(0, 3)):
            g.insert(r.randint(0, len(g)), r.choice([0x48, 0x48, 0x42]))  # "H", "B"
        if r.random() < 0.2:
            g += b"HB"
        return bytes(g)

    def oversized(self) -> bytes:
        r, M = self.r, self.i.max_payload
        length = r.choice([M + 1, M + r.randint(2, 300), 0xFFFF_FFFF, r.randrange(M + 1, 1 << 32)])
        head = P.MAGIC + bytes([P.PROTOCOL_VERSION, r.randrange(256)]) + r.randbytes(2) + length.to_bytes(4, "little")
        rest = length + 4 if length + 4 < M + 400 and r.random() < 0.5 else r.randint(0, 64)
        return head + bytes(r.getrandbits(8) for _ in range(min(rest, 64))) + bytes(max(0, rest - 64))

    def part(self) -> bytes:
        r = self.r
        kind = r.choices(["valid", "mutated", "truncated", "garbage", "oversized"], weights=[5, 3, 2, 2, 0.5])[0]
        if kind == "valid":
            return self.request()
        if kind == "mutated":
            return self.mutate(self.request())
        if kind == "truncated":
            f = self.request()
            return f[: r.randrange(1, len(f))]
        if kind == "garbage":
            return self.garbage()
        return self.oversized()

    def burst(self) -> bytes:
        """One to five parts back to back (a truncated or oversized one swallows what follows)."""
        return b"".join(self.part() for _ in range(self.r.choice([1, 1, 2, 3, 5])))


# ---- the checks -----------------------------------------------------------------------------------


class Checker:
    """Sends bursts to a byte device and checks its replies (module docstring). The device
    starts from reset (counters 0)."""

    def __init__(self, dev, ident: P.Identity, *, read_budget: int = 2_000_000):
        self.dev, self.ident = dev, ident
        self.T = ident.frame_timeout
        self.budget = read_budget
        self.parser = P.FrameParser(max_payload=1 << 30)
        self.accepted = self.refused = 0
        self.last_error = Status.OK
        self.status_tag = 0x4000

    def _collect(self, count: int, patience: int) -> list:
        """Replies until ``count`` are in or ``patience`` cycles have passed without them."""
        got: list = []
        spent = 0
        step = max(1, self.T // 4)
        while len(got) < count:
            data = self.dev.read()
            if data:
                got += self.parser.feed(data)
                continue
            if spent >= patience:
                break
            self.dev.advance(step)
            spent += step
        return got

    def _count(self, frame: P.Frame) -> None:
        status = frame.payload[0]
        if status == Status.OK and frame.opcode == Op.RESET | P.REPLY:
            self.accepted = self.refused = 0
            self.last_error = Status.OK
        elif status == Status.OK:
            self.accepted += 1
        else:
            self.refused += 1
            self.last_error = Status(status)

    def burst(self, data: bytes) -> list:
        """Send ``data``; returns its replies (checked)."""
        model = P.FrameParser(max_payload=self.ident.max_payload, device=True)
        items = model.feed(data)
        expect = []
        for it in items:
            if isinstance(it, P.Frame):
                known = Status.BAD_VERSION if it.version != P.PROTOCOL_VERSION else None
                expect.append(((it.opcode | P.REPLY) & 0xFF, it.tag, known))
            else:
                status, opcode, tag = it
                expect.append(((opcode | P.REPLY) & 0xFF, tag, status))
        if model.in_progress:  # left incomplete: a TIMEOUT once frame_timeout passes
            expect.append(((model.partial_opcode or 0) | P.REPLY, P.FRAME_TIMEOUT_TAG, Status.TIMEOUT))
        self.dev.write(data)
        got = self._collect(len(items), self.budget)
        if model.in_progress or model.skipping:
            # the burst ends mid-frame: frame_timeout quiet cycles end it (a skip silently)
            got += self._collect(len(expect) - len(got), 2 * self.T)
            if model.skipping:
                # (the skip ends frame_timeout cycles after the device took the last byte: a
                # device may take bytes at one a cycle after replying to the header)
                self.dev.advance(self.T + 64 + len(data))
        got += self._collect(len(expect) - len(got), 0)  # nothing more may come
        assert len(got) == len(expect), f"{len(got)} replies for {len(expect)} frames: {got} vs {expect}"
        for n, (frame, (opcode, tag, status)) in enumerate(zip(got, expect)):
            assert isinstance(frame, P.Frame), f"reply {n}: its CRC fails: {frame}"
            assert frame.version == P.PROTOCOL_VERSION and frame.payload, f"reply {n}: {frame}"
            assert (frame.opcode, frame.tag) == (opcode, tag), f"reply {n}: {frame} for a frame {(opcode, tag)}"
            if status is not None:
                assert frame.payload[0] == status, f"reply {n}: {frame}, expected {Status(status).name}"
            assert frame.payload[0] in Status._value2member_map_, f"reply {n}: unknown status in {frame}"
            if frame.payload[0] != Status.OK:
                assert len(frame.payload) == 1, f"reply {n}: an error reply with data: {frame}"
            self._count(frame)
        return got

    def status(self) -> P.DeviceStatus:
        """A STATUS request: it works, and its counters account for every reply seen."""
        self.status_tag = (self.status_tag + 1) & 0x7FFF
        self.dev.write(P.encode_frame(Op.STATUS, self.status_tag))
        got = self._collect(1, self.budget)
        got += self._collect(0, 0)
        assert len(got) == 1, f"STATUS: {got}"
        (f,) = got
        assert isinstance(f, P.Frame) and (f.opcode, f.tag) == (Op.STATUS | P.REPLY, self.status_tag), f
        assert f.payload[:1] == b"\0" and len(f.payload) == 17, f
        st = P.decode_status(f.payload[1:])
        self.accepted += 1
        assert (st.accepted, st.refused, st.last_error) == (self.accepted, self.refused, self.last_error), (
            f"STATUS {st}, replies seen: {self.accepted} accepted, {self.refused} refused, last {self.last_error!r}")
        return st


def fuzz(checkers: list, bursts: Bursts, count: int, seed: int, *, deadline: float | None = None) -> int:
    """``count`` bursts on each checker's device (the same bytes on all); the replies of all
    but the first are compared with the first's (status, data size). Returns the bursts run."""
    for n in range(count):
        data = bursts.burst()
        try:
            replies = [c.burst(data) for c in checkers]
            ref = replies[0]
            for other in replies[1:]:
                a = [(f.opcode, f.tag, f.payload[0], len(f.payload)) for f in ref]
                b = [(f.opcode, f.tag, f.payload[0], len(f.payload)) for f in other]
                assert a == b, f"the devices disagree:\n  {a}\n  {b}"
            for c in checkers:
                c.status()
        except Exception as e:  # a wrong reply, or the device raised
            where = f"seed {seed}, burst {n} ({len(data)} bytes: {data[:200].hex()}{'...' if len(data) > 200 else ''})"
            if isinstance(e, AssertionError):
                raise AssertionError(f"{where}: {e}") from None
            raise AssertionError(f"{where}: the device raised {type(e).__name__}: {e}") from e
        if deadline is not None and time.monotonic() > deadline:
            return n + 1
    return count


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", list(EMU_CONFIGS))
def test_fuzz_emu(name, seed):
    dev = open_emu(EMU_CONFIGS[name])
    rng = random.Random(f"{name}-{seed}")
    checker = Checker(dev, dev.identity)
    fuzz([checker], Bursts(dev.identity, rng), EMU_BURSTS, seed)
    # and a READ (the epilogue) still runs after all that
    (reply,) = checker.burst(P.encode_frame(Op.READ, 7, P.encode_read(1, 1)))
    assert reply.payload == b"\0" + bytes(reply.payload[1:]) and len(reply.payload) == 5, reply
    checker.status()


def test_fuzz_is_reproducible():
    ident = open_emu(EMU_CONFIGS["small"]).identity
    a = Bursts(ident, random.Random(5))
    b = Bursts(ident, random.Random(5))
    assert [a.burst() for _ in range(50)] == [b.burst() for _ in range(50)]


@requires_sim
@pytest.mark.parametrize("seed", SEEDS)
def test_fuzz_sim(sim_top, seed):
    """The same bursts on the gateware and on an ``emu`` of the same identity."""
    from hbfp.host import conformance

    from hbfp.contract import CoreConfig

    ident = conformance.identify(sim_top)

    cfg = CoreConfig(rows=ident.rows, cols=ident.cols, mantissa_bits=ident.mantissa_bits, tile=ident.tile,
                     size=ident.size, functions=ident.functions, leaky_shift=ident.leaky_shift,
                     **{u: ident.has(u) for u in ("value_quantizer", "bfp_output", "stochastic")})
    emu = EmuDevice(cfg, max_payload=ident.max_payload, frame_timeout=ident.frame_timeout,
                    stream_bytes=ident.stream_bytes)
    assert emu.identity == ident, (emu.identity, ident)
    sim_check, emu_check = Checker(sim_top, ident), Checker(emu, ident)
    sim_check.accepted = 1  # the IDENTIFY above
    t0 = time.monotonic()
    timeout, sim_top.timeout_cycles = sim_top.timeout_cycles, 1_000_000  # no reply: a failure, not a hang
    try:
        n = fuzz([emu_check, sim_check], Bursts(ident, random.Random(f"sim-{seed}"), small=True), SIM_BURSTS, seed,
                 deadline=None if FULL else t0 + 20)
    finally:
        sim_top.timeout_cycles = timeout
    print(f"sim: {n} bursts in {time.monotonic() - t0:.1f} s, {sim_top.cycles} cycles ({SIM_TOP_ARG})")
