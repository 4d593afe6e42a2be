"""The device contract: every code and layout that the gateware, the host driver, ``emu`` and
the tests share, defined once and without HDL imports (docs/protocol.md).

Dependencies run one way: ``hbfp.golden`` <- this module <- ``hbfp.hw`` and ``hbfp.host``.
The gateware uses the enums below as port shapes and in ``m.Case``; it builds its
``data.StructLayout`` views of command descriptors from the ``Descriptor`` tables here
(``hbfp.hw.params.layout``), from which the host's encoders and decoders are generated too
(``Descriptor.pack``/``unpack``), so the two sides cannot lay a field out differently.

What is here:

- framing constants (``MAGIC``, ``PROTOCOL_VERSION``, ``ABI_VERSION``, ``REPLY``, ...);
- the codes: ``Op``, ``Status``, ``Target``, ``Encoding``, ``OutFormat``, ``Rounding``,
  ``Unit`` (bits of IDENTIFY's ``omitted`` mask), ``GemmFlag``, the activation function codes
  (``FUNCTIONS``) and the named formats (``FORMATS``);
- each command's descriptor and each fixed reply as fields and widths (``HEADER``, ``WRITE``,
  ``GEMM``, ``READ``, ``ELEMENTWISE``, ``IDENTITY``, ``STATUS``, ``CYCLES``);
- the core configuration (``CoreConfig``), its checks (``ConfigError``), the device around it
  (``DeviceSpec``: link width, clock, payload buffer, frame timeout) and the identity it reports
  (``Identity``);
- one parser of device options (``parse_options``) for ``emu:``/``sim:`` specs, the command
  line and the boards' defaults.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hbfp.golden import activations
from hbfp.golden.bfp import HBFP8, HBFP16, MXINT8, ROUNDINGS, Format

__all__ = [
    "MAGIC",
    "MAGIC_WORD",
    "PROTOCOL_VERSION",
    "ABI_VERSION",
    "CRC_SIZE",
    "REPLY",
    "NO_ACTIVATION",
    "FRAME_TIMEOUT_TAG",
    "DEFAULT_MAX_PAYLOAD",
    "DEFAULT_FRAME_TIMEOUT",
    "Op",
    "Status",
    "Target",
    "Encoding",
    "OutFormat",
    "Rounding",
    "ROUNDING_CODES",
    "Unit",
    "GemmFlag",
    "FUNCTIONS",
    "UNARY_FUNCTIONS",
    "GRADIENT_FUNCTIONS",
    "function_code",
    "functions_mask",
    "mask_functions",
    "FORMATS",
    "Field",
    "Descriptor",
    "HEADER",
    "WRITE",
    "GEMM",
    "READ",
    "ELEMENTWISE",
    "IDENTITY",
    "STATUS",
    "CYCLES",
    "frame_size",
    "ConfigError",
    "CoreConfig",
    "DeviceSpec",
    "DEVICE_FIELDS",
    "DeviceStatus",
    "Identity",
    "rmw_latency",
    "ACC_GROUP_SELECT",
    "fewest_acc_lanes",
    "product_width",
    "psum_width",
    "NORMALIZE_LATENCY",
    "ADD_LATENCY",
    "ACTIVATION_LATENCY",
    "CHUNK_SELECT",
    "ACTIVATION_INPUT_REGISTER",
    "QUANTIZE_LATENCY",
    "MAC_LATENCY",
    "OPTIONS",
    "Option",
    "parse_int",
    "parse_tile",
    "parse_format",
    "parse_bool",
    "parse_functions",
    "parse_options",
]

# ---- framing ------------------------------------------------------------------------------

MAGIC = b"HB"
#: The magic as HEADER's 16-bit ``magic`` field reads it (little-endian).
MAGIC_WORD = int.from_bytes(MAGIC, "little")
PROTOCOL_VERSION = 2
#: The device interface a host speaks: (major, minor). A different major is refused.
ABI_VERSION = (1, 1)
CRC_SIZE = 4
#: A reply's opcode is the request's with this bit set.
REPLY = 0x80
#: The activation code of "no activation".
NO_ACTIVATION = 0xFF
#: The tag of a TIMEOUT reply (the truncated frame's tag may not have arrived).
FRAME_TIMEOUT_TAG = 0xFFFF
#: Bytes of a device's request payload buffer, unless configured otherwise.
DEFAULT_MAX_PAYLOAD = 4096
#: Cycles without a byte after which a begun frame is dropped, unless configured otherwise.
DEFAULT_FRAME_TIMEOUT = 1 << 20


# ---- codes --------------------------------------------------------------------------------


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


class _Coded(enum.IntEnum):
    """A code whose host-side name is its member's name in lower case (``label``)."""

    #: What the codes are, for the error of an unknown label.
    _kind = enum.nonmember("code")

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def from_label(cls, label: str):
        """The member named ``label`` (any case); ``ValueError`` listing the labels otherwise."""
        key = str(label).upper()
        if key not in cls.__members__:
            _unknown(cls._kind, label, (m.label for m in cls))
        return cls[key]


class Target(enum.IntEnum):
    """WRITE's targets. The first five are also the core's buffer codes (``hw.gemm_core``);
    the value targets go through the input quantizer into the code and exponent buffers."""

    A_CODES = 0
    B_CODES = 1
    A_EXPONENTS = 2
    B_EXPONENTS = 3
    ACC = 4
    BIAS = 5
    A_VALUES = 6
    B_VALUES = 7


class Encoding(enum.IntEnum):
    """How WRITE's values travel."""

    FP32 = 0
    BF16 = 1


class OutFormat(_Coded):
    """The output format of GEMM and READ; ``label`` is the host's name (``"fp32"``, ``"bf16"``,
    ``"bfp"``)."""

    _kind = enum.nonmember("output format")
    FP32 = 0
    BF16 = 1
    BFP = 2


#: The rounding modes of the quantizers; a mode's code is its index in
#: ``hbfp.golden.bfp.ROUNDINGS`` (the golden model's names).
Rounding = _Coded("Rounding", [(name.upper(), code) for code, name in enumerate(ROUNDINGS)], module=__name__)
Rounding.__doc__ = "Rounding modes on the wire (WRITE of values, GEMM and READ with a BFP output)."
Rounding._kind = "rounding mode"
#: The rounding modes by the golden model's names -> codes.
ROUNDING_CODES = {r.label: int(r) for r in Rounding}


class Unit(_Coded):
    """The units a reduced device may be built without, as bits of IDENTIFY's ``omitted``
    mask (a set bit: the unit is not there; 0, as from an ABI 1.0 device: the full device).
    Their lower-case names are ``CoreConfig``'s fields. ``VALUE_QUANTIZER``: WRITE of values
    (the device quantizes); ``BFP_OUTPUT``: GEMM and READ results in BFP; ``STOCHASTIC``:
    stochastic rounding in the device's quantizers."""

    _kind = enum.nonmember("unit")
    VALUE_QUANTIZER = 0
    BFP_OUTPUT = 1
    STOCHASTIC = 2


class GemmFlag(enum.IntFlag):
    """GEMM's ``flags`` byte (READ's carries ``BIAS`` only)."""

    TRANSPOSE_A = 1
    TRANSPOSE_B = 2
    ACCUMULATE = 4
    BIAS = 8


def _unknown(what: str, value, known: Iterable[str]):
    raise ValueError(f"unknown {what} {value!r}; known: {', '.join(known)}")


#: Runtime function codes of the activation units: a function's code is its index here. The
#: golden registries' order: the unary functions, then the gradients as ``<name>_grad``.
FUNCTIONS: tuple[str, ...] = tuple(activations.UNARY) + tuple(f"{n}_grad" for n in activations.GRADIENTS)
#: Functions of ``x`` alone; ELEMENTWISE ignores ``g`` for them.
UNARY_FUNCTIONS = tuple(n for n in FUNCTIONS if not n.endswith("_grad"))
#: Functions of ``(x, g)``: ``bf16.mul(<name>_deriv(x), g)``.
GRADIENT_FUNCTIONS = tuple(n for n in FUNCTIONS if n.endswith("_grad"))


def function_code(name: str) -> int:
    """The runtime code of function ``name`` (its index in ``FUNCTIONS``)."""
    try:
        return FUNCTIONS.index(name)
    except ValueError:
        _unknown("function", name, FUNCTIONS)


def functions_mask(names: Iterable[str]) -> int:
    """IDENTIFY's ``functions_mask`` of the functions ``names``: bit ``function_code(name)``."""
    return sum(1 << function_code(n) for n in set(names))


def mask_functions(mask: int) -> tuple[str, ...]:
    """The functions of a ``functions_mask``, in code order."""
    return tuple(name for code, name in enumerate(FUNCTIONS) if mask >> code & 1)


#: The named BFP formats (the golden model's presets), by the names the options use.
FORMATS: dict[str, Format] = {"HBFP8": HBFP8, "HBFP16": HBFP16, "MXINT8": MXINT8}


# ---- descriptors: fields and widths --------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """A field of a descriptor: ``bits`` wide (a whole number of bytes), unsigned, little-endian
    on the wire. ``reserved`` fields are sent as 0 and not read."""

    name: str
    bits: int
    reserved: bool = False


_STRUCT_CODES = {8: "B", 16: "H", 32: "I"}


class Descriptor:
    """A fixed-layout record of the protocol: the fields in wire order, each a whole number of
    bytes, little-endian. The host packs and unpacks it (``pack``, ``unpack``); the gateware
    views its bytes as a ``data.StructLayout`` with the same fields (``hbfp.hw.params.layout``:
    Amaranth lays fields out from the least significant bit, which is the first byte here).
    ``fields`` are ``Field``s or ``(name, bits)`` pairs; a name starting with ``_`` is
    reserved."""

    def __init__(self, name: str, fields: Iterable[Field | tuple[str, int]]):
        self.name = name
        self.fields = tuple(f if isinstance(f, Field) else Field(f[0], f[1], f[0].startswith("_"))
                            for f in fields)
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"descriptor {name}: duplicate field names {names}")
        for f in self.fields:
            if f.bits not in _STRUCT_CODES:
                raise ValueError(f"descriptor {name}: field {f.name} is {f.bits} bits, not 8, 16 or 32")
        self.struct = struct.Struct("<" + "".join(_STRUCT_CODES[f.bits] for f in self.fields))
        self.offsets: dict[str, int] = {}
        offset = 0
        for f in self.fields:
            self.offsets[f.name] = offset
            offset += f.bits // 8
        self._names = tuple(f.name for f in self.fields if not f.reserved)
        self._name_set = frozenset(self._names)
        # (name or None for a reserved field) per field, in wire order: what pack() fills in.
        self._slots = tuple(None if f.reserved else f.name for f in self.fields)

    @property
    def size(self) -> int:
        """Bytes on the wire."""
        return self.struct.size

    @property
    def names(self) -> tuple[str, ...]:
        """The fields that carry values (reserved ones left out)."""
        return self._names

    def pack(self, **values) -> bytes:
        """The bytes of the record; missing fields are 0. ``ValueError`` for an unknown field or
        a value that does not fit its width."""
        if not self._name_set.issuperset(values):
            unknown = sorted(set(values) - self._name_set)
            raise ValueError(f"{self.name}: unknown fields {unknown}; fields: {', '.join(self._names)}")
        out = [0 if n is None else values.get(n, 0) for n in self._slots]
        try:
            return self.struct.pack(*out)
        except struct.error:  # a value out of its field's range (or not an integer): say which
            for f, v in zip(self.fields, out):
                v = int(v)
                if not 0 <= v < 1 << f.bits:
                    raise ValueError(f"{self.name}.{f.name} = {v} does not fit {f.bits} bits") from None
            raise

    def unpack(self, data: bytes, offset: int = 0) -> dict:
        """The fields (reserved ones left out) of the record at ``data[offset:]``."""
        vals = self.struct.unpack_from(data, offset)
        return {f.name: v for f, v in zip(self.fields, vals) if not f.reserved}

    def __repr__(self) -> str:
        return f"Descriptor({self.name!r}, {[(f.name, f.bits) for f in self.fields]})"


#: A frame's header (then ``length`` payload bytes and a CRC-32 of header and payload).
HEADER = Descriptor("header", [("magic", 16), ("version", 8), ("opcode", 8), ("tag", 16), ("length", 32)])
#: WRITE's descriptor, followed by the data (``rows x cols`` elements of the target).
WRITE = Descriptor("write", [("target", 8), ("encoding", 8), ("rounding", 8), ("_pad", 8), ("seed", 32),
                             ("row", 16), ("col", 16), ("rows", 16), ("cols", 16)])
#: GEMM's descriptor (the whole payload).
GEMM = Descriptor("gemm", [("m", 16), ("n", 16), ("k", 16), ("flags", 8), ("activation", 8),
                           ("out_format", 8), ("rounding", 8), ("_pad", 16), ("seed", 32)])
#: READ's descriptor (the whole payload): the epilogue alone on the accumulator.
READ = Descriptor("read", [("m", 16), ("n", 16), ("out_format", 8), ("activation", 8), ("flags", 8),
                           ("rounding", 8), ("seed", 32)])
#: ELEMENTWISE's descriptor, followed by ``count`` bf16 x (and ``count`` bf16 g for a gradient).
ELEMENTWISE = Descriptor("elementwise", [("function", 8), ("_pad", 8), ("_pad2", 16), ("count", 32)])
#: IDENTIFY's reply data.
IDENTITY = Descriptor("identity", [
    ("protocol_version", 8), ("abi_major", 8), ("abi_minor", 8), ("stream_bytes", 8),
    ("rows", 16), ("cols", 16), ("mantissa_bits", 8), ("tile_rows", 8), ("tile_cols", 8),
    ("leaky_shift", 8), ("size", 16), ("functions_mask", 16), ("clock_hz", 32), ("max_payload", 32),
    ("frame_timeout", 32), ("omitted", 32)])
#: STATUS's reply data.
STATUS = Descriptor("status", [("accepted", 32), ("refused", 32), ("last_cycles", 32), ("last_error", 8),
                               ("_pad", 8), ("_pad2", 16)])
#: The cycles at the end of a GEMM reply's data (after the result).
CYCLES = Descriptor("cycles", [("cycles", 32)])


def frame_size(payload_bytes: int) -> int:
    """Bytes of a whole frame (header, payload, CRC) with ``payload_bytes`` of payload; a reply's
    payload is its status byte and data."""
    return HEADER.size + payload_bytes + CRC_SIZE


# ---- configuration ---------------------------------------------------------------------------


class ConfigError(ValueError):
    """A configuration that cannot be built: the message names the rule and the values."""


# Pipeline latencies of the gateware's components, which the configuration rules and ``emu``'s
# cycle count read; the components are built to them (their ``LATENCY``).
#: The accumulator's read-modify-write (``hw.normalize``, ``hw.add_f32``): the normalizer's
#: cycles from a K-tile sum to its fp32 value, the adder's from its operands to the sum (five
#: and seven stages, each at most one carry chain or a few LUT levels: 150 MHz on an ECP5).
NORMALIZE_LATENCY = 5
ADD_LATENCY = 7
#: The activation unit's cycles from a bf16 input to its bf16 output (``hw.activation``): the
#: ROM address, the ROM read, its output register, the function select and the three-stage
#: multiplier.
ACTIVATION_LATENCY = 7
#: The epilogue's registers between its stages (``hw.epilogue``): a read's chunk of
#: ``out_lanes`` values, once selected from the accumulator word; the activation units' bf16
#: input, once rounded from the bias stage's fp32 value.
CHUNK_SELECT = 1
ACTIVATION_INPUT_REGISTER = 1
#: The BFP quantizer's cycles from the cycle a tile's last input beat is accepted to the cycle
#: its first output beat is valid (``hw.quantize``): three fill stages (the exponent max), the
#: bank handover, the memory read and nine drain stages (the read data registered twice, the
#: random generator's five, rounding, saturation, sign).
QUANTIZE_LATENCY = 14
#: The MAC array's cycles from a K-tile's last beat in to its first row of sums out (``hw.mac_array``):
#: the row/column operand registers, a copy in every PE, the product, the product again (a
#: DSP block's route to its PE's adder), the accumulator.
MAC_LATENCY = 5


def product_width(mantissa_bits_a: int, mantissa_bits_b: int) -> int:
    """Bits of a signed product of two symmetric codes (|q| <= 2**(m-1) - 1)."""
    return mantissa_bits_a + mantissa_bits_b - 1


def psum_width(mantissa_bits_a: int, mantissa_bits_b: int, tk: int) -> int:
    """Bits of a signed K-tile sum of ``tk`` products: exact, never wraps."""
    bound = tk * (2 ** (mantissa_bits_a - 1) - 1) * (2 ** (mantissa_bits_b - 1) - 1)
    return bound.bit_length() + 1


#: The GEMM core's own stages (``hw.gemm_core`` is built to them; ``emu``'s cycle count reads
#: them): an operand buffer read (the request registered, the banks' outputs registered before
#: the lane rotation), an
#: accumulator or bias read (the block RAM's address register, its data registered beside it
#: (``hw.block_ram``), then in the reader), and the cycles of a K-tile's
#: exponent prefetch beyond ``max(rows, cols)`` (start register, address register, read, queue,
#: release): K-tiles start every ``max(tk, max(rows, cols) + PREFETCH_CYCLES)`` cycles.
OPERAND_READ_LATENCY = 3
ACC_READ_LATENCY = 3
PREFETCH_CYCLES = 5


#: The accumulate lanes' group select (``hw.accumulate``), in a core with fewer accumulate lanes
#: than columns (``CoreConfig.acc_lanes``): the old accumulator word, registered whole as it
#: leaves the block RAMs, is narrowed to the drained group's columns in a register of its own.
ACC_GROUP_SELECT = 1


def rmw_latency(cfg: "CoreConfig | None" = None) -> int:
    """Cycles the accumulator's read-modify-write loop takes: the read (issued so that the old
    value arrives with the normalizer's result), the group select of a core that shares its
    lanes (``cfg.acc_groups > 1``), the adder and the write (docs/architecture.md). The loop
    must close within one K-tile, since the next K-tile's sum of the same output arrives
    ``tk`` cycles later."""
    select = ACC_GROUP_SELECT if cfg is not None and cfg.acc_groups > 1 else 0
    return ACC_READ_LATENCY + select + ADD_LATENCY + 1


#: Processing elements of the MAC array per epilogue lane (bias adder, activation unit,
#: quantizer lane) when a configuration does not choose ``out_lanes``.
PES_PER_OUT_LANE = 64


def default_out_lanes(rows: int, cols: int, tile: tuple[int, int], stream_bytes: int = 1) -> int:
    """The epilogue's lanes (results a cycle) when a configuration does not choose them: the
    fewest that divide both ``cols`` and the tile's columns and give one lane per
    ``PES_PER_OUT_LANE`` processing elements (so the epilogue grows with the array and stays
    a small part of it) and at least the link's fp32 rate (``stream_bytes / 4`` values a
    cycle). The epilogue of a row-block overlaps the next row-block's products, so only the
    last one's ``rows * N / out_lanes`` cycles add to a product's length."""
    unit = math.gcd(cols, tile[1])
    want = max(-(-rows * cols // PES_PER_OUT_LANE), -(-stream_bytes // 4), 1)
    return next((d for d in range(1, unit + 1) if unit % d == 0 and d >= want), unit)


def fewest_acc_lanes(rows: int, cols: int, tk: int) -> int:
    """The fewest accumulate lanes (``CoreConfig.acc_lanes``) a core can have, its default: the
    smallest divisor of ``cols`` whose lanes drain a K-tile's ``rows x cols`` sums within the
    K-tile (``rows * cols / acc_lanes <= tk``) and, if they are shared (fewer than ``cols``),
    whose read-modify-write with the group select closes within it (``rmw_latency``); each lane
    then works in most cycles, and the array at full rate."""
    shared_rmw = ACC_READ_LATENCY + ACC_GROUP_SELECT + ADD_LATENCY + 1
    return next(d for d in range(1, cols + 1)
                if cols % d == 0 and rows * (cols // d) <= tk and (d == cols or shared_rmw <= tk))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class CoreConfig:
    """One configuration of the GEMM core, decided at elaboration time.

    ``rows`` x ``cols``: the MAC array (any sides). ``mantissa_bits`` and ``tile``: the BFP
    format of both stored operands and of BFP outputs (the tile's column side is the K-tile
    ``tk``; a non-square tile, such as MXINT8's 1 x 32, needs A stored M x K and B stored N x K).
    ``size``: the buffers hold ``size`` x ``size`` operands and outputs (a multiple of the
    tile sides and of the array sides). ``functions``: the activation units built (None: every
    function of ``FUNCTIONS``). ``value_quantizer``, ``bfp_output``, ``stochastic``: the optional
    units (``Unit``); a device without them is a *reduced* device. ``out_lanes``: the epilogue's
    results a cycle (None: ``default_out_lanes``). ``acc_lanes``: the normalizer and fp32 adder
    lanes that take the MAC array's K-tile sums into the accumulator (a divisor of ``cols``;
    None: the fewest that keep the array at full rate, ``fewest_acc_lanes``): each serves
    ``acc_groups = cols / acc_lanes`` columns,
    and a K-tile's sums drain in ``rows * acc_groups`` beats, which must fit in the K-tile.
    ``dsp_macs``: the processing elements that multiply in DSP blocks, the rest in LUTs (None:
    all). None of the three changes a result.
    Every rule is checked here, as ``ConfigError``, for the gateware and ``emu`` alike."""

    rows: int = 8
    cols: int = 8
    mantissa_bits: int = 8
    tile: tuple[int, int] = (24, 24)
    size: int = 96
    functions: tuple[str, ...] | None = None
    leaky_shift: int = activations.LEAKY_SHIFT
    value_quantizer: bool = True
    bfp_output: bool = True
    stochastic: bool = True
    out_lanes: int | None = None
    acc_lanes: int | None = None
    dsp_macs: int | None = None

    def __post_init__(self):
        try:
            tile = tuple(self.tile)
        except TypeError:
            raise ConfigError(f"tile must be (rows, cols), got {self.tile!r}") from None
        object.__setattr__(self, "tile", tile)
        for unit in Unit:
            if not isinstance(getattr(self, unit.label), bool):
                raise ConfigError(f"{unit.label} must be True or False, got {getattr(self, unit.label)!r}")
        if self.functions is not None:
            if isinstance(self.functions, str) or any(f not in FUNCTIONS for f in self.functions):
                raise ConfigError(f"functions must be names of {', '.join(FUNCTIONS)} (or None: all of them), "
                                  f"got {self.functions!r}")
            object.__setattr__(self, "functions", tuple(self.functions))
        if len(tile) != 2 or not all(_is_int(s) and s >= 1 for s in tile):
            raise ConfigError(f"tile must be two positive integers, got {self.tile!r}")
        for name in ("rows", "cols", "size", "mantissa_bits"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if not 2 <= self.mantissa_bits <= 16:
            raise ConfigError(f"mantissa_bits must be 2..16 (codes of one or two bytes), got {self.mantissa_bits}")
        if not _is_int(self.leaky_shift) or not 0 <= self.leaky_shift <= 15:
            raise ConfigError(f"leaky_shift must be an integer 0..15, got {self.leaky_shift!r}")
        if self.size >= 1 << 16:
            raise ConfigError(f"size {self.size} does not fit the descriptors' 16-bit sides")
        if self.stochastic and not (self.value_quantizer or self.bfp_output):
            raise ConfigError("stochastic rounding needs a quantizer: value_quantizer or bfp_output")
        th, tw = tile
        for side in (th, tw, self.rows, self.cols):
            if self.size % side:
                raise ConfigError(f"size {self.size} must be a multiple of the tile sides {tile} and the array "
                                  f"sides ({self.rows}, {self.cols})")
        if self.tk < max(self.rows, self.cols):
            raise ConfigError(f"the K-tile ({self.tk}) must be at least as long as the array's sides "
                              f"({self.rows}, {self.cols})")
        if self.out_lanes is None:
            object.__setattr__(self, "out_lanes", default_out_lanes(self.rows, self.cols, tile))
        lanes_unit = math.gcd(self.cols, tw)
        if not _is_int(self.out_lanes) or self.out_lanes < 1 or lanes_unit % self.out_lanes:
            raise ConfigError(f"out_lanes must divide cols ({self.cols}) and the tile's columns ({tw}), "
                              f"got {self.out_lanes!r}")
        if self.acc_lanes is None:
            object.__setattr__(self, "acc_lanes", fewest_acc_lanes(self.rows, self.cols, self.tk))
        if not _is_int(self.acc_lanes) or self.acc_lanes < 1 or self.cols % self.acc_lanes:
            raise ConfigError(f"acc_lanes must divide cols ({self.cols}), got {self.acc_lanes!r}")
        if self.rows * self.acc_groups > self.tk:
            raise ConfigError(f"{self.acc_lanes} accumulate lanes drain a K-tile's {self.rows} x {self.cols} sums in "
                              f"{self.rows * self.acc_groups} beats, more than the K-tile's {self.tk}: "
                              f"acc_lanes must be a divisor of cols of at least {-(-self.rows * self.cols // self.tk)}")
        if self.dsp_macs is not None and (not _is_int(self.dsp_macs) or not 0 <= self.dsp_macs <= self.rows * self.cols):
            raise ConfigError(f"dsp_macs must be 0 .. rows * cols ({self.rows * self.cols}) or None (all), "
                              f"got {self.dsp_macs!r}")
        if rmw_latency(self) > self.tk:
            select = f", group select {ACC_GROUP_SELECT}" if self.acc_groups > 1 else ""
            raise ConfigError(f"the accumulator's read-modify-write ({rmw_latency(self)} cycles: read "
                              f"{ACC_READ_LATENCY}{select}, adder {ADD_LATENCY}, write 1) must finish within a "
                              f"K-tile of {self.tk} cycles")

    @property
    def acc_groups(self) -> int:
        """The columns each accumulate lane serves: a K-tile's row drains in this many beats."""
        return self.cols // self.acc_lanes

    @property
    def tk(self) -> int:
        """The K-tile: the tile's column side (K runs along the stored rows of A and B^T)."""
        return self.tile[1]

    @property
    def square(self) -> bool:
        return self.tile[0] == self.tile[1]

    def fmt(self, rounding: str = "nearest_even") -> Format:
        """The device's BFP format with a rounding mode."""
        return Format(self.mantissa_bits, self.tile, rounding)

    @property
    def built_functions(self) -> tuple[str, ...]:
        """The activation units built, in ``FUNCTIONS`` order: every one for ``functions`` None,
        none for an empty tuple."""
        return tuple(f for f in FUNCTIONS if self.functions is None or f in self.functions)

    @property
    def omitted(self) -> int:
        """IDENTIFY's mask of the units left out (``Unit``)."""
        return sum(1 << unit for unit in Unit if not getattr(self, unit.label))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tile"] = list(self.tile)
        d["tk"] = self.tk
        d["psum_width"] = psum_width(self.mantissa_bits, self.mantissa_bits, self.tk)
        return d


@functools.lru_cache(maxsize=64)
def _format(mantissa_bits: int, tile: tuple[int, int], rounding: str) -> Format:
    """One Format object per format (a product asks for its device's several times)."""
    return Format(mantissa_bits, tile, rounding)


@dataclass(frozen=True)
class Identity:
    """What IDENTIFY reports (``IDENTITY``'s fields)."""

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
    omitted: int = 0  # the units left out: bit ``Unit``

    def encode(self) -> bytes:
        return IDENTITY.pack(**dataclasses.asdict(self))

    @classmethod
    def decode(cls, data: bytes) -> "Identity":
        return cls(**IDENTITY.unpack(data))

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

    def fmt(self, rounding: str = "nearest_even") -> Format:
        """The device's BFP format (``hbfp.golden.bfp.Format``) with a rounding mode."""
        return _format(self.mantissa_bits, self.tile, rounding)

    @property
    def functions(self) -> tuple[str, ...]:
        """Names of the activation units built."""
        return mask_functions(self.functions_mask)

    def has(self, unit: str | Unit) -> bool:
        """Whether the device was built with ``unit`` (a ``Unit`` or its lower-case name)."""
        if not isinstance(unit, Unit):
            unit = Unit.from_label(unit)
        return not self.omitted >> unit & 1

    @property
    def units(self) -> tuple[str, ...]:
        """The optional units built (``Unit`` labels)."""
        return tuple(u.label for u in Unit if self.has(u))


@dataclass(frozen=True)
class DeviceStatus:
    """The STATUS reply (``STATUS``'s fields): frames accepted and refused (any error status)
    since reset, the cycles of the last GEMM or READ, and the last error status (``OK`` if
    none)."""

    accepted: int
    refused: int
    last_cycles: int
    last_error: Status

    def encode(self) -> bytes:
        return STATUS.pack(accepted=self.accepted, refused=self.refused, last_cycles=self.last_cycles,
                           last_error=int(self.last_error))

    @classmethod
    def decode(cls, data: bytes) -> "DeviceStatus":
        d = STATUS.unpack(data)
        return cls(d["accepted"], d["refused"], d["last_cycles"], Status(d["last_error"]))


@dataclass(frozen=True)
class DeviceSpec:
    """A whole device: the core and what surrounds it (the link's ``stream_bytes`` per beat,
    the clock it reports, the request payload buffer, the frame timeout in cycles). ``emu`` and
    the gateware's top take the same spec, so they cannot disagree on a default."""

    config: CoreConfig = CoreConfig()
    stream_bytes: int = 1
    clock_hz: int = 0
    max_payload: int = DEFAULT_MAX_PAYLOAD
    frame_timeout: int = DEFAULT_FRAME_TIMEOUT

    def __post_init__(self):
        if not isinstance(self.config, CoreConfig):
            raise ConfigError(f"config must be a CoreConfig, got {type(self.config).__name__}")
        for name in ("stream_bytes", "max_payload", "frame_timeout"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if not _is_int(self.clock_hz) or not 0 <= self.clock_hz < 1 << 32:
            raise ConfigError(f"clock_hz must be an integer 0..2^32-1 (0: unknown), got {self.clock_hz!r}")
        if self.stream_bytes > 255:
            raise ConfigError(f"stream_bytes must be 1..255, got {self.stream_bytes}")
        if self.max_payload < WRITE.size:
            raise ConfigError(f"max_payload ({self.max_payload}) must hold at least WRITE's descriptor "
                              f"({WRITE.size} bytes)")
        for name in ("max_payload", "frame_timeout"):
            if getattr(self, name) >= 1 << 32:
                raise ConfigError(f"{name} must be below 2^32, got {getattr(self, name)}")

    def identity(self, abi_version: tuple[int, int] = ABI_VERSION) -> Identity:
        """What this device reports to IDENTIFY."""
        cfg = self.config
        return Identity(
            protocol_version=PROTOCOL_VERSION, abi_major=abi_version[0], abi_minor=abi_version[1],
            stream_bytes=self.stream_bytes, rows=cfg.rows, cols=cfg.cols, mantissa_bits=cfg.mantissa_bits,
            tile_rows=cfg.tile[0], tile_cols=cfg.tile[1], leaky_shift=cfg.leaky_shift, size=cfg.size,
            functions_mask=functions_mask(cfg.built_functions), clock_hz=self.clock_hz,
            max_payload=self.max_payload, frame_timeout=self.frame_timeout, omitted=cfg.omitted,
        )

    @classmethod
    def from_options(cls, options: dict) -> "DeviceSpec":
        """A spec from ``parse_options``' core and device keys (other keys: ``ConfigError``)."""
        core = {k: v for k, v in options.items() if OPTIONS.get(k, _NOT).group == "core"}
        dev = {k: v for k, v in options.items() if OPTIONS.get(k, _NOT).group == "device"}
        other = set(options) - set(core) - set(dev)
        if other:
            raise ConfigError(f"unknown device options {sorted(other)}; known: {', '.join(OPTIONS)}")
        if "out_lanes" not in core:  # the epilogue keeps up with the link (default_out_lanes)
            base = CoreConfig(**core)
            core["out_lanes"] = default_out_lanes(base.rows, base.cols, base.tile, dev.get("stream_bytes", 1))
        return cls(CoreConfig(**core), **dev)

    def to_dict(self) -> dict:
        return {"core": self.config.to_dict(), "stream_bytes": self.stream_bytes, "clock_hz": self.clock_hz,
                "max_payload": self.max_payload, "frame_timeout": self.frame_timeout}


#: ``DeviceSpec``'s fields beside the core: the top's (and ``emu``'s) device parameters.
DEVICE_FIELDS = tuple(f.name for f in dataclasses.fields(DeviceSpec) if f.name != "config")


# ---- options: one parser for specs, the command line and the boards -------------------------

_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def parse_bool(value: str) -> bool:
    """An option's yes or no: 0/1, true/false, yes/no, on/off (any case)."""
    word = str(value).strip().lower()
    if word not in _BOOLS:
        raise ConfigError(f"expected 0/1, true/false, yes/no or on/off, got {value!r}")
    return _BOOLS[word]


def parse_functions(value: str) -> tuple[str, ...]:
    """An option's activation units: ``relu+gelu`` (or separated by spaces or colons); ``none``
    or nothing: no unit; ``all``: every one."""
    names = str(value).replace("+", " ").replace(":", " ").split()
    low = [n.lower() for n in names]
    if low == ["none"] or not names:
        return ()
    if low == ["all"]:
        return FUNCTIONS
    for n in names:
        if n not in FUNCTIONS:
            _unknown("function", n, FUNCTIONS)
    return tuple(names)


def parse_int(value: str) -> int:
    try:
        return int(str(value).strip(), 0)
    except ValueError:
        raise ConfigError(f"expected an integer, got {value!r}") from None


def parse_tile(value: str) -> tuple[int, int]:
    """``24x24`` (or one number for a square tile)."""
    parts = str(value).lower().replace("*", "x").split("x")
    try:
        if len(parts) == 1:
            return (int(parts[0]), int(parts[0]))
        th, tw = (int(p) for p in parts)
    except ValueError:
        raise ConfigError(f"tile must be ROWSxCOLS (e.g. 24x24), got {value!r}") from None
    return (th, tw)


def parse_format(value: str) -> Format:
    if str(value).upper() not in FORMATS:
        _unknown("format", value, FORMATS)
    return FORMATS[str(value).upper()]


@dataclass(frozen=True)
class Option:
    """A device option: its parser from text, the group it belongs to (``core``: a
    ``CoreConfig`` field, ``device``: a ``DeviceSpec`` field, ``format``: sets mantissa bits and
    tile, or a backend's own group) and what it means."""

    parse: Callable[[str], object]
    group: str
    help: str


_NOT = Option(str, "", "")

#: The options every device spec understands (``emu:...``, ``sim:...``, the command line, the
#: boards' defaults). A backend adds its own with ``parse_options(arg, extra=...)``.
OPTIONS: dict[str, Option] = {
    "format": Option(parse_format, "format", f"a named format ({', '.join(FORMATS)}): mantissa bits and tile"),
    "rows": Option(parse_int, "core", "MAC array rows"),
    "cols": Option(parse_int, "core", "MAC array columns"),
    "mantissa_bits": Option(parse_int, "core", "BFP mantissa bits, sign included"),
    "tile": Option(parse_tile, "core", "BFP tile, ROWSxCOLS (e.g. 24x24)"),
    "size": Option(parse_int, "core", "buffer side: operands and outputs up to SIZE x SIZE"),
    "functions": Option(parse_functions, "core", "activation units built: relu+gelu, none, all"),
    "leaky_shift": Option(parse_int, "core", "leaky_relu's slope 2^-SHIFT"),
    "out_lanes": Option(parse_int, "core", "epilogue lanes: results a cycle (divides cols and the tile's columns)"),
    "acc_lanes": Option(parse_int, "core", "normalizer/adder lanes into the accumulator (divides cols; default: the fewest at full rate)"),
    "dsp_macs": Option(parse_int, "core", "processing elements that multiply in DSP blocks (the rest in LUTs)"),
    **{u.label: Option(parse_bool, "core", f"build the {u.label} unit (0/1)") for u in Unit},
    "stream_bytes": Option(parse_int, "device", "bytes per beat of the link"),
    "clock_hz": Option(parse_int, "device", "clock reported by IDENTIFY (0: unknown)"),
    "max_payload": Option(parse_int, "device", "bytes of the request payload buffer"),
    "frame_timeout": Option(parse_int, "device", "cycles without a byte after which a begun frame is dropped"),
}


def parse_options(arg: str | None, *, extra: dict[str, Option] | None = None, what: str = "device") -> dict:
    """``"rows=4,cols=4,size=48"`` -> typed options. Keys are ``OPTIONS``' and ``extra``'s (a
    backend's own); ``format`` expands to ``mantissa_bits`` and ``tile`` (later keys override
    it); ``-`` may stand for ``_``; ``;`` may separate items. ``ConfigError`` names the item."""
    table = {**OPTIONS, **(extra or {})}
    out: dict = {}
    for item in str(arg or "").replace(";", ",").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise ConfigError(f"{what} option {item!r} is not key=value")
        if key not in table:
            raise ConfigError(f"unknown {what} option {key!r}; known: {', '.join(table)}")
        try:
            parsed = table[key].parse(value.strip())
        except ConfigError as e:
            raise ConfigError(f"{what} option {key}: {e}") from None
        except ValueError as e:
            raise ConfigError(f"{what} option {key}: {e}") from None
        if key == "format":
            out["mantissa_bits"], out["tile"] = parsed.mantissa_bits, parsed.tile
        else:
            out[key] = parsed
    return out
