"""``emu``: an in-process model of the device that speaks the wire protocol, built on the
golden model (bit for bit as the gateware, and fast).

It holds the buffers the gateware holds (docs/architecture.md): the stored A and B codes
(``size`` x ``size``, as written: A or A^T, B or B^T), their exponent grids, the fp32
accumulator (``size`` x ``size``) and the bias (``size``). Nothing is cleared between
commands. A product leaves the fp32 sums (before bias and activation) in the accumulator as
the gateware does: over whole array blocks (rows to ceil(M/R)*R, columns to ceil(N/C)*C),
where the padding rows and columns hold the product of the stored operands' stale contents
(codes beyond K read as zeros, as the MAC array's K padding does); the reply carries the
M x N region. Every reply, the accumulator's contents and the cycle counts equal the
gateware's (docs/protocol.md).

The byte interface, the one ``LoopbackTransport`` and ``serve`` drive (a simulator device
offers the same):

- ``write(data)``: bytes arrive at the device; every complete frame is executed at once and
  its reply queued (replies are produced synchronously);
- ``read(max_bytes=None)``: the reply bytes queued so far;
- ``advance(cycles)``: ``cycles`` clock cycles pass with no byte arriving. A frame that has
  begun and sees no byte for ``frame_timeout`` cycles is dropped with a ``TIMEOUT`` reply.
  The clock is virtual: the emulator has no notion of wall time of its own;
  ``cycles_per_second`` is the rate at which a server or transport converts waiting time
  into cycles.

A reduced device (``CoreConfig`` with ``value_quantizer``, ``bfp_output`` or ``stochastic``
False) reports the units it lacks in IDENTIFY's ``omitted`` mask and refuses, with
``BAD_DESCRIPTOR``, what needs them: a WRITE of values without the value quantizer, a
GEMM or READ with a BFP output without the output quantizer, stochastic rounding in either
without the stochastic rounding unit (docs/protocol.md).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hbfp.golden import bf16
from hbfp.golden.bfp import BFPTensor, quantize
from hbfp.golden.gemm import epilogue, gemm
from hbfp.contract import (
    ADD_LATENCY,
    MAC_LATENCY,
    OPERAND_READ_LATENCY,
    PREFETCH_CYCLES,
    FUNCTIONS,
    NORMALIZE_LATENCY,
    DEVICE_FIELDS,
    CoreConfig,
    DeviceSpec,
)
from hbfp.contract import Option, parse_bool
from hbfp.contract import parse_options as parse_device_options
from hbfp.golden.activations import evaluate

from . import protocol as P
from .protocol import Op, OutFormat, Status, Target

__all__ = [
    "EmuDevice",
    "command_cycles",
    "parse_options",
    "backend",
    "NOMINAL_HZ",
    "EMU_OPTIONS",
]

#: The rate at which waiting time becomes cycles when the device reports no clock (0 Hz).
NOMINAL_HZ = 100_000_000

_ROUNDINGS = {code: name for name, code in P.ROUNDING_CODES.items()}


# ---- the gateware's cycle count (docs/architecture.md, "Latency and throughput of a command")

# The latencies of the gateware's components that the count adds up are the contract's
# (``OPERAND_READ_LATENCY``, ``PREFETCH_CYCLES``, ``MAC_LATENCY``, ``NORMALIZE_LATENCY``, ``ADD_LATENCY``:
# the gateware builds its components to them); tests/test_emu_gateware.py holds the whole count
# equal to the gateware's on every command.
#: The stage that only hw/gemm_core.py's structure sets: a drained row passes one register
#: before the accumulate lanes.
DRAIN_REGISTER = 1


def command_cycles(cfg: CoreConfig, m: int, n: int, k: int) -> int:
    """The cycles a GEMM (or, with ``k = 0``, a READ) counts on the gateware: the core's count
    from the cycle after it accepts the command to the cycle in which its last row-block of
    sums is in the accumulator, which the GEMM's reply (after its result) and STATUS report
    (docs/architecture.md, "Latency and throughput of a command"). The epilogue, which runs
    beside the MAC phase, sends the rows at the reply's pace, so what follows the last sums
    depends on the link and is not counted; a READ computes no sums and counts 0.

    The MAC phase issues K-tiles every ``period = max(tk, max(R, C) + PREFETCH_CYCLES)``
    cycles and never waits; counting the cycle after acceptance as 1, the last row-block is
    closed (its rows readable) in cycle::

        j * period + tk + OPERAND_READ_LATENCY + MAC_LATENCY + R * G + DRAIN_REGISTER
        + NORMALIZE_LATENCY + ADD_LATENCY,   j = the product's last K-tile's index

    (``G`` = ``acc_groups``: a K-tile's sums drain in ``R * G`` beats), and the count, which
    starts at 0 in the cycle after acceptance, is one less. It depends on the
    configuration and the sides only: not on the output format, transposes, bias, the
    activation, accumulation, rounding or the data."""
    if not k:
        return 0
    R, C, tk = cfg.rows, cfg.cols, cfg.tk
    period = max(tk, max(R, C) + PREFETCH_CYCLES)
    j = -(-m // R) * -(-n // C) * -(-k // tk) - 1
    closed = (j * period + tk + OPERAND_READ_LATENCY + MAC_LATENCY + R * cfg.acc_groups + DRAIN_REGISTER
              + NORMALIZE_LATENCY + ADD_LATENCY)
    return closed - 1


class Buffers:
    """The device's buffers (A's and B's codes and exponents, the accumulator, the bias) as the
    gateware holds them, starting as zeros, and what a WRITE does to them (``write``: a WRITE
    the device accepted; values quantized as the gateware's quantizer does on the way in).
    ``shape``: the device's core (a ``CoreConfig``) or its IDENTIFY (``Identity``): ``size``,
    ``tile``, ``mantissa_bits`` and ``fmt``. ``EmuDevice`` computes on them; the TCP server
    keeps one per session (``hbfp.host.server.Server``, "Sessions")."""

    NAMES = ("a_codes", "a_exponents", "b_codes", "b_exponents", "acc", "bias")

    def __init__(self, shape):
        self.shape = shape
        D = shape.size
        th, tw = shape.tile
        code_dtype = shape.fmt().code_dtype
        self.a_codes = np.zeros((D, D), dtype=code_dtype)
        self.b_codes = np.zeros((D, D), dtype=code_dtype)
        self.a_exponents = np.zeros((D // th, D // tw), dtype=np.uint8)
        self.b_exponents = np.zeros((D // th, D // tw), dtype=np.uint8)
        self.acc = np.zeros((D, D), dtype=np.float32)
        self.bias = np.zeros(D, dtype=np.float32)

    def clear(self) -> None:
        for name in self.NAMES:
            getattr(self, name)[...] = 0

    def write(self, payload: bytes) -> None:
        """What the WRITE ``payload`` (accepted: a valid region, length and encoding) does."""
        target, encoding, rounding, seed, row, col, rows, cols, data = P.decode_write(payload)
        th, tw = self.shape.tile
        mb = self.shape.mantissa_bits
        if rows * cols == 0:
            return
        if target in (Target.A_CODES, Target.B_CODES):
            buf = self.a_codes if target == Target.A_CODES else self.b_codes
            buf[row : row + rows, col : col + cols] = P.decode_codes(data, rows, cols, mb)
        elif target in (Target.A_EXPONENTS, Target.B_EXPONENTS):
            buf = self.a_exponents if target == Target.A_EXPONENTS else self.b_exponents
            buf[row : row + rows, col : col + cols] = np.frombuffer(data, np.uint8).reshape(rows, cols)
        elif target == Target.ACC:
            self.acc[row : row + rows, col : col + cols] = np.frombuffer(data, "<f4").reshape(rows, cols)
        elif target == Target.BIAS:
            self.bias[col : col + cols] = np.frombuffer(data, "<f4")
        else:  # values
            if encoding == P.Encoding.FP32:
                flat = np.frombuffer(data, "<f4").astype(np.float32)
            else:
                flat = bf16.to_dtype(np.frombuffer(data, "<u2").astype(np.uint16))
            x = P.from_tile_major(flat, rows, cols, (th, tw))
            t = quantize(x, self.shape.fmt(_ROUNDINGS[rounding]), seed=seed)
            if target == Target.A_VALUES:
                codes, exps = self.a_codes, self.a_exponents
            else:
                codes, exps = self.b_codes, self.b_exponents
            codes[row : row + rows, col : col + cols] = t.codes
            exps[row // th : (row + rows) // th, col // tw : (col + cols) // tw] = t.exponents

    def writes(self, name: str, ident: P.Identity) -> list[bytes]:
        """WRITE payloads that put buffer ``name`` on the device of ``ident`` as it is here, each
        within its ``max_payload`` (``planner.region_writes``' pieces)."""
        from .planner import region_writes

        target, lanes = {"a_codes": (Target.A_CODES, self.shape.rows), "b_codes": (Target.B_CODES, self.shape.cols),
                         "a_exponents": (Target.A_EXPONENTS, 1), "b_exponents": (Target.B_EXPONENTS, 1),
                         "acc": (Target.ACC, self.shape.cols), "bias": (Target.BIAS, self.shape.cols)}[name]
        buf = getattr(self, name)
        if name == "bias":
            buf = buf[None, :]
        mb = self.shape.mantissa_bits
        if name.endswith("codes"):
            width, data = P.code_bytes(mb), (lambda a, b, c, d: P.encode_codes(buf[a:b, c:d], mb))
        elif name.endswith("exponents"):
            width, data = 1, (lambda a, b, c, d: np.ascontiguousarray(buf[a:b, c:d], np.uint8).tobytes())
        else:
            width, data = 4, (lambda a, b, c, d: np.ascontiguousarray(buf[a:b, c:d], "<f4").tobytes())
        return [step.payload for step in region_writes(ident, target, *buf.shape, width, 1, lanes, data)]


class _Refused(Exception):
    def __init__(self, status: Status):
        super().__init__(status.name)
        self.status = status


class EmuDevice:
    """The device as a byte pipe, computed with ``hbfp.golden`` (module docstring).

    ``config``: the core (a ``CoreConfig``: array shape, format, buffer side, activation units
    built, the optional units of a reduced device) or the whole device (a ``DeviceSpec``, also
    as ``spec``); keywords set the spec's other fields, with the contract's defaults (those of
    the gateware's top): ``stream_bytes``, ``clock_hz`` (reported by IDENTIFY; 0: unknown),
    ``max_payload`` (the largest request payload), ``frame_timeout`` (cycles without a byte
    after which a begun frame is dropped). ``abi_version``: the ABI reported (a different one
    only to test hosts).

    ``wire``: what ``hbfp.host.Device`` does with a product. False (the default): ``direct`` is
    True, and the driver computes the product whole in-process with ``hbfp.golden`` (the
    result the device's commands would return, bit for bit; ``product_cycles`` gives the
    cycles they would take), without sending it, so the buffers here are left as they were.
    True: every product is framed, tiled to the buffers and executed here command by command,
    as on a board."""

    def __init__(self, config: CoreConfig | DeviceSpec | None = None, *, spec: DeviceSpec | None = None,
                 abi_version: tuple[int, int] = P.ABI_VERSION, wire: bool = False, **device):
        if isinstance(config, DeviceSpec):
            spec, config = config, None
        spec = spec or DeviceSpec()
        if config is not None:
            spec = dataclasses.replace(spec, config=config)
        unknown = set(device) - set(DEVICE_FIELDS)
        if unknown:
            raise TypeError(f"EmuDevice: unknown options {sorted(unknown)}; device options: {', '.join(DEVICE_FIELDS)}")
        if device.get("max_payload", 0) is None:  # None: the default
            del device["max_payload"]
        spec = dataclasses.replace(spec, **device) if device else spec
        self.spec = spec
        self.direct = not wire
        self._cycles: dict = {}
        cfg = self.config = spec.config
        self.functions = cfg.built_functions
        self.identity = spec.identity(abi_version)
        self.cycles_per_second = spec.clock_hz or NOMINAL_HZ
        # Buffer contents start as zeros (the gateware's memories have no reset either:
        # after RESET they keep whatever they held, "undefined" to the host).
        self.buffers = Buffers(cfg)
        b = self.buffers
        self.a_codes, self.b_codes, self.a_exponents, self.b_exponents = b.a_codes, b.b_codes, b.a_exponents, b.b_exponents
        self.acc, self.bias = b.acc, b.bias
        self._parser = P.FrameParser(spec.max_payload, device=True)
        self._out = bytearray()
        self._idle = 0
        self._clear_counters()

    # ---- byte interface ---------------------------------------------------------------

    def write(self, data: bytes) -> None:
        """Bytes arrive; complete frames are executed and their replies queued."""
        if not data:
            return
        self._idle = 0
        self._handle(self._parser.feed(bytes(data)))

    def read(self, max_bytes: int | None = None) -> bytes:
        """Reply bytes queued so far (at most ``max_bytes``)."""
        n = len(self._out) if max_bytes is None else min(max_bytes, len(self._out))
        out = bytes(self._out[:n])
        del self._out[:n]
        return out

    def advance(self, cycles: int) -> None:
        """``cycles`` clock cycles pass without a byte arriving."""
        self._idle += max(0, int(cycles))
        while self._idle >= self.identity.frame_timeout and (self._parser.in_progress or self._parser.skipping):
            if self._parser.in_progress:
                # A frame stopped arriving mid-way: drop it and tell the host (with the
                # frame's opcode if it had arrived), then hunt in the bytes that come next.
                self._reply(self._parser.partial_opcode or 0, P.FRAME_TIMEOUT_TAG, Status.TIMEOUT)
            self._handle(self._parser.expire())

    @property
    def pending(self) -> int:
        """Reply bytes waiting to be read."""
        return len(self._out)

    def product_cycles(self, m: int, n: int, k: int) -> int:
        """The cycles a GEMM of ``m x n x k`` (a READ with ``k = 0``) counts on this device
        (``command_cycles``, remembered: a training loop asks for the same few shapes again
        and again)."""
        key = (m, n, k)
        cycles = self._cycles.get(key)
        if cycles is None:
            cycles = self._cycles[key] = command_cycles(self.config, m, n, k)
        return cycles

    # ---- frames -----------------------------------------------------------------------

    def _clear_counters(self) -> None:
        self.accepted = 0
        self.refused = 0
        self.last_cycles = 0
        self.last_error = Status.OK

    def _reply(self, opcode: int, tag: int, status: Status, data: bytes = b"") -> None:
        if status != Status.OK:
            self.refused += 1
            self.last_error = status
            data = b""
        self._out += P.encode_reply(opcode, tag, status, data)

    def _handle(self, items) -> None:
        for item in items:
            if isinstance(item, tuple):  # BAD_CRC or BAD_LENGTH (length above max_payload)
                status, opcode, tag = item
                self._reply(opcode, tag, status)
                continue
            frame = item
            try:
                if frame.version != P.PROTOCOL_VERSION:
                    raise _Refused(Status.BAD_VERSION)
                data = self._execute(frame.opcode, frame.payload)
            except _Refused as e:
                self._reply(frame.opcode, frame.tag, e.status)
                continue
            if frame.opcode == Op.RESET:
                self._clear_counters()
                self._out += P.encode_reply(frame.opcode, frame.tag)
                continue
            self._out += P.encode_reply(frame.opcode, frame.tag, Status.OK, data)
            self.accepted += 1

    def _execute(self, opcode: int, payload: bytes) -> bytes:
        if opcode == Op.IDENTIFY:
            self._no_payload(payload)
            return P.encode_identity(self.identity)
        if opcode == Op.STATUS:
            self._no_payload(payload)
            # Every reply counts when its status is decided: STATUS counts itself.
            return P.encode_status(P.DeviceStatus(self.accepted + 1, self.refused, self.last_cycles, self.last_error))
        if opcode == Op.RESET:
            self._no_payload(payload)
            return b""
        if opcode == Op.WRITE:
            return self._write(payload)
        if opcode == Op.READ:
            d = P.decode_read(payload)
            if d is None:
                raise _Refused(Status.BAD_LENGTH)
            return self._product(d, read=True)
        if opcode == Op.GEMM:
            d = P.decode_gemm(payload)
            if d is None:
                raise _Refused(Status.BAD_LENGTH)
            return self._product(d)
        if opcode == Op.ELEMENTWISE:
            return self._elementwise(payload)
        raise _Refused(Status.BAD_OPCODE)

    @staticmethod
    def _no_payload(payload: bytes) -> None:
        if payload:
            raise _Refused(Status.BAD_LENGTH)

    # ---- WRITE --------------------------------------------------------------------------

    def _write(self, payload: bytes) -> bytes:
        d = P.decode_write(payload)
        if d is None:
            raise _Refused(Status.BAD_LENGTH)
        target, encoding, rounding, seed, row, col, rows, cols, data = d
        cfg = self.config
        D = cfg.size
        th, tw = cfg.tile
        mb = cfg.mantissa_bits
        if target not in Target._value2member_map_:
            raise _Refused(Status.BAD_ADDRESS)
        target = Target(target)

        def region(limit_r, limit_c, align_r=1, align_c=1):
            # An empty region is a valid write of nothing.
            if row + rows > limit_r or col + cols > limit_c:
                raise _Refused(Status.BAD_ADDRESS)
            if row % align_r or rows % align_r or col % align_c or cols % align_c:
                raise _Refused(Status.BAD_ADDRESS)

        def length(n):
            if len(data) != n:
                raise _Refused(Status.BAD_LENGTH)

        if target in (Target.A_CODES, Target.B_CODES):
            region(D, D, 1, cfg.rows if target == Target.A_CODES else cfg.cols)
            length(rows * cols * P.code_bytes(mb))
        elif target in (Target.A_EXPONENTS, Target.B_EXPONENTS):
            region(D // th, D // tw)
            length(rows * cols)
        elif target == Target.ACC:
            region(D, D, 1, cfg.cols)
            length(4 * rows * cols)
        elif target == Target.BIAS:
            if row != 0 or rows != 1:
                raise _Refused(Status.BAD_ADDRESS)
            region(1, D, 1, cfg.cols)
            length(4 * cols)
        else:  # values: quantized here, as the gateware's quantizer does on the way in
            region(D, D, th, tw)
            if encoding not in (0, 1) or rounding not in _ROUNDINGS:
                raise _Refused(Status.BAD_DESCRIPTOR)
            if not self._quantizes(cfg.value_quantizer, rounding):  # a reduced device
                raise _Refused(Status.BAD_DESCRIPTOR)
            length(rows * cols * (4 if encoding == P.Encoding.FP32 else 2))
        self.buffers.write(payload)
        return b""

    def _quantizes(self, unit: bool, rounding: int) -> bool:
        """Whether a quantizer (``unit``: it is built) can round with ``rounding`` (a code)."""
        return unit and (self.config.stochastic or rounding != P.ROUNDING_CODES["stochastic"])

    # ---- GEMM and READ ----------------------------------------------------------------

    def _activation(self, code: int) -> str | None:
        """The name of the built unary function ``code`` (None: no activation)."""
        if code == P.NO_ACTIVATION:
            return None
        if code >= len(FUNCTIONS) or FUNCTIONS[code] not in self.functions or FUNCTIONS[code].endswith("_grad"):
            raise _Refused(Status.BAD_DESCRIPTOR)
        return FUNCTIONS[code]

    def _product(self, d: dict, read: bool = False) -> bytes:
        cfg = self.config
        D = cfg.size
        m, n, k, flags = d["m"], d["n"], d["k"], d["flags"]
        ta = bool(flags & P.GEMM_FLAGS["transpose_a"])
        tb = bool(flags & P.GEMM_FLAGS["transpose_b"])
        accumulate = bool(flags & P.GEMM_FLAGS["accumulate"])
        add_bias = bool(flags & P.GEMM_FLAGS["bias"])
        if not (1 <= m <= D and 1 <= n <= D and (read or 1 <= k <= D)):
            raise _Refused(Status.BAD_DESCRIPTOR)
        # A non-square tile serves K along the stored rows only: A as M x K, B as N x K.
        if not cfg.square and k and (ta or not tb):
            raise _Refused(Status.BAD_DESCRIPTOR)
        if d["out_format"] not in OutFormat._value2member_map_ or d["rounding"] not in _ROUNDINGS:
            raise _Refused(Status.BAD_DESCRIPTOR)
        # A reduced device: a BFP output needs the output quantizer (and its stochastic
        # rounding). The rounding of an fp32 or bf16 output is unused.
        if d["out_format"] == OutFormat.BFP and not self._quantizes(cfg.bfp_output, d["rounding"]):
            raise _Refused(Status.BAD_DESCRIPTOR)
        act = self._activation(d["activation"])
        out_format = OutFormat(d["out_format"])

        if read:
            # The epilogue alone, on the accumulator as it is.
            sums = bf16.flush_f32(self.acc[:m, :n])
        else:
            # The MAC array computes whole R x C blocks, and the core writes all of them back:
            # the accumulator changes out to rows ceil(M/R)*R and columns ceil(N/C)*C. Beyond
            # M and N the array reads the buffers as they are (stale codes and exponents);
            # beyond K it reads A's codes as zeros (B's as they are, times zero). So the
            # padding holds the product of the stored operands' padded region, from the
            # accumulator's old contents with ``accumulate``, from +0 without.
            mp, np_ = -(-m // cfg.rows) * cfg.rows, -(-n // cfg.cols) * cfg.cols
            a = self._stored(self.a_codes, self.a_exponents, (k, mp) if ta else (mp, k))
            b = self._stored(self.b_codes, self.b_exponents, (np_, k) if tb else (k, np_))
            c = self.acc[:mp, :np_].copy() if accumulate else None
            self.acc[:mp, :np_] = gemm(a, b, c=c, transpose_a=ta, transpose_b=tb)
            sums = self.acc[:m, :n].copy()
        result = self._epilogue(sums, self.bias[:n] if add_bias else None, act, out_format,
                                _ROUNDINGS[d["rounding"]], d["seed"])
        cycles = command_cycles(cfg, m, n, k)
        self.last_cycles = cycles
        return P.encode_result(None if read else cycles, result, out_format)  # READ: the result alone

    def _stored(self, codes: np.ndarray, exponents: np.ndarray, shape: tuple[int, int]) -> BFPTensor:
        rows, cols = shape
        th, tw = self.config.tile
        return BFPTensor(
            np.ascontiguousarray(codes[:rows, :cols]),
            np.ascontiguousarray(exponents[: -(-rows // th), : -(-cols // tw)]),
            self.config.fmt(),
        )

    def _epilogue(self, acc, bias, act, out_format, rounding, seed):
        # hbfp.golden.gemm.gemm's end on the accumulator's sums: the bias, then its epilogue.
        if bias is not None:
            acc = bf16.add_f32(acc, bias[None, :])
        out = {OutFormat.FP32: "fp32", OutFormat.BF16: "bf16"}.get(out_format) or self.config.fmt(rounding)
        result = epilogue(acc, act, out, seed, leaky_shift=self.config.leaky_shift)
        return result.view(np.uint16) if out_format == OutFormat.BF16 else result  # bf16 as patterns

    # ---- ELEMENTWISE --------------------------------------------------------------------

    def _elementwise(self, payload: bytes) -> bytes:
        d = P.decode_elementwise(payload)
        if d is None:
            raise _Refused(Status.BAD_LENGTH)
        code, count, data = d
        if code >= len(FUNCTIONS) or FUNCTIONS[code] not in self.functions:
            raise _Refused(Status.BAD_DESCRIPTOR)
        name = FUNCTIONS[code]
        grad = name.endswith("_grad")
        if len(data) != (4 if grad else 2) * count:
            raise _Refused(Status.BAD_LENGTH)
        x = np.frombuffer(data, "<u2", count=count).astype(np.uint16)
        g = np.frombuffer(data, "<u2", count=count, offset=2 * count).astype(np.uint16) if grad else None
        y = evaluate(name, x, g, leaky_shift=self.config.leaky_shift)
        return np.ascontiguousarray(y, dtype="<u2").tobytes()


# ---- the ``emu`` backend (entry point ``hbfp.devices: emu``) --------------------------------


#: ``emu``'s own options beside the contract's device options.
EMU_OPTIONS = {
    "wire": Option(parse_bool, "emu", "1: products go through the wire protocol and the device's tiling "
                                      "(default 0: computed whole in-process, the same result)"),
}


def parse_options(arg: str) -> dict:
    """``"rows=4,cols=4,size=48"`` -> keyword arguments of ``EmuDevice``: the ``config`` (a
    ``CoreConfig``), the ``DeviceSpec``'s other fields and ``wire``. The keys are the contract's
    device options (``hbfp.contract.OPTIONS``: format, rows, cols, mantissa_bits, tile, size,
    functions, leaky_shift, value_quantizer, bfp_output, stochastic, stream_bytes, clock_hz,
    max_payload, frame_timeout), parsed as for ``sim:``, and ``EMU_OPTIONS``."""
    options = parse_device_options(arg, extra=EMU_OPTIONS, what="emu")
    wire = options.pop("wire", False)
    spec = DeviceSpec.from_options(options)
    return dict(config=spec.config, wire=wire, **{name: getattr(spec, name) for name in DEVICE_FIELDS})


class _EmuBackend:
    """``emu[:key=value,...]``: the in-process golden-model device."""

    ABI_VERSION = P.ABI_VERSION
    description = "in-process bit-exact model of the device (hbfp.golden)"

    def open(self, arg: str = "", **options) -> EmuDevice:
        parsed = parse_options(arg)
        options.setdefault("wire", parsed.pop("wire"))
        spec = DeviceSpec(parsed.pop("config"), **parsed)
        config = options.pop("config", None)
        if isinstance(config, DeviceSpec):
            spec = config
        elif config is not None:
            spec = dataclasses.replace(spec, config=config)
        device = {k: options.pop(k) for k in list(options) if k in DEVICE_FIELDS}
        if device:
            spec = dataclasses.replace(spec, **device)
        return EmuDevice(spec, **options)


backend = _EmuBackend()
