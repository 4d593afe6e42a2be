"""The packet engine: the device side of the wire protocol (docs/protocol.md), on a link of
``stream_bytes`` (N) bytes a cycle.

Bytes come from a realigning window (``hw.link.ByteWindow``) in front of the engine, which
offers up to N bytes whatever their place in the link's beats. The engine hunts for the
magic and takes the header a byte a cycle, then the payload N bytes a cycle into an N-byte
wide buffer (two slots of ``max_payload`` bytes in words of N: a frame arrives in one while
the one before is executed from the other) while a parallel CRC-32 runs over it; it
acts on a frame only after the CRC has checked and the fields have been validated. It then
drives the GEMM core (writes and commands), the input quantizer (WRITE of values) and an
activation unit (ELEMENTWISE), and sends exactly one reply per frame, up to N payload bytes
a cycle, whose CRC it computes on the way out.

Components, each with named ports, in the order a frame meets them:

- ``FrameReceiver``: hunt, header, payload into the buffer, CRC, timeouts and the skipping
  of an oversize frame; hands each frame over as one ``FRAME`` record;
- ``FrameChecker``: the validation order of docs/protocol.md as a function of a ``FRAME``:
  the status and the ``plan`` (``plan_layout``) of what to execute and reply, from the checks
  of each command (``WriteCheck``, ``CommandCheck`` for GEMM and READ, ``ElementwiseCheck``);
- ``PayloadReader``: buffer words back out as byte chunks of one or two regions (a WRITE's
  data; ELEMENTWISE's x and g);
- ``LaneAssembler``: a window of payload bytes to a beat of 32-bit lanes, one a cycle;
- ``WriteReplay``: a WRITE's beats to the core, as row chunks (``rows`` codes of A,
  ``cols`` elements of B, the accumulator, the bias) or through the quantizer;
- ``ElementwiseFeed``: ELEMENTWISE's x (and g) from their windows to the activation unit;
- ``ResultSerializer``: the core's output beats (``cfg.out_lanes`` values each) to the
  reply's byte layout, a beat's bytes a cycle;
- ``StatusCounters``: the STATUS record (replies accepted and refused, the last error, the
  last cycles);
- ``ReplySender``: a reply's header, then its status, stream and fixed bytes as chunks;
- ``ReplyFramer``: magic, header, payload (up to N bytes a cycle) and CRC of a reply;
- ``Dispatch``: the state machine: a frame's plan, its execution, its reply, its release;
- ``PacketEngine``: all of them joined.
"""

from __future__ import annotations

from amaranth.lib import enum

from amaranth import Cat, Const, Module, Mux, Signal, Value, signed, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from hbfp import contract as protocol
from hbfp.contract import (
    DEFAULT_FRAME_TIMEOUT,
    DEFAULT_MAX_PAYLOAD,
    DeviceSpec,
    Encoding,
    GemmFlag,
    Op,
    OutFormat,
    Rounding,
    Status,
    Target,
    functions_mask,
)

from .activation import ACTIVATION_INPUT, FUNC_WIDTH, UNARY_FUNCTIONS
from .block_ram import BlockRam
from .crc import ParallelCRC32, chunk_layout, crc32_state
from .gemm_core import command_layout, output_layout, write_layout
from .link import ByteCollector, ByteWindow, StreamRegister, WindowSignature, beat_layout, reply_chunk_layout
from .params import BF16_WIDTH, EXP_WIDTH, FP32_WIDTH, CoreConfig, layout
from .quantize import KEY_LATENCY

__all__ = [
    "beat_layout",
    "chunk_layout",
    "reply_chunk_layout",
    "quantize_output_layout",
    "HEAD",
    "FrameEvent",
    "frame_layout",
    "Action",
    "plan_layout",
    "FrameReceiver",
    "FrameChecker",
    "WriteCheck",
    "CommandCheck",
    "ElementwiseCheck",
    "PayloadReader",
    "LaneAssembler",
    "WriteReplay",
    "ResultSerializer",
    "ReplyFramer",
    "StatusCounters",
    "ElementwiseFeed",
    "ReplySender",
    "Dispatch",
    "PacketEngine",
    "REPLY_HEADER",
    "FIXED_BYTES",
    "ASSEMBLE_MODES",
    "DESCRIPTOR_BYTES",
    "result_chunk_bytes",
    "write_lanes",
    "value_lanes",
]

#: Fixed payload sizes of the commands, from the contract's descriptors: WRITE's header
#: before its data, READ's and GEMM's descriptors, ELEMENTWISE's header before x (and g).
WRITE_HEADER = protocol.WRITE.size
READ_SIZE = protocol.READ.size
GEMM_SIZE = protocol.GEMM.size
ELEMENTWISE_HEADER = protocol.ELEMENTWISE.size

#: Payload bytes the engine keeps in registers (the longest command descriptor, WRITE's).
DESCRIPTOR_BYTES = max(WRITE_HEADER, READ_SIZE, GEMM_SIZE, ELEMENTWISE_HEADER)
#: ``LaneAssembler`` modes: how an element's bytes fill its 32-bit lane.
ASSEMBLE_MODES = {"sign_extend": 0, "raw": 1, "high_half": 2}
#: A frame's header after the magic, as received.
HEAD = data.StructLayout({"version": 8, "opcode": 8, "tag": 16, "length": 32})
#: A reply's header as the ``ReplyFramer`` takes it (the opcode with the reply bit set).
REPLY_HEADER = data.StructLayout({"opcode": 8, "tag": 16, "length": 32})
#: The most bytes a reply carries from registers after its status (IDENTIFY's identity).
FIXED_BYTES = protocol.IDENTITY.size


class FrameEvent(enum.Enum, shape=2):
    """How a received frame ended: whole (CRC and all), refused at its header (a length
    beyond ``max_payload``: its remaining bytes are skipped after the reply), or dropped
    after ``frame_timeout`` cycles without a byte."""

    COMPLETE = 0
    OVERSIZE = 1
    TIMEOUT = 2


def frame_layout() -> data.StructLayout:
    """A received frame as the receiver hands it over: the header, the first
    ``DESCRIPTOR_BYTES`` of the payload, whether the CRC checked, and how it ended."""
    return data.StructLayout({"head": HEAD, "desc": 8 * DESCRIPTOR_BYTES, "crc_ok": 1, "event": FrameEvent})


class Action(enum.Enum, shape=3):
    """What the engine does with a frame before (or instead of) its reply's payload."""

    REPLY = 0  # an error, IDENTIFY, STATUS: the reply alone
    WRITE = 1
    CORE = 2  # GEMM and READ
    ELEMENTWISE = 3
    RESET = 4


def _words(max_payload: int, stream_bytes: int) -> int:
    return -(-max_payload // stream_bytes)


def write_lanes(cfg: CoreConfig) -> int:
    """The lanes of a WRITE beat (the core's ``w`` port): a row chunk of A has ``rows``
    codes, one of B, the accumulator or the bias ``cols`` elements."""
    return max(cfg.rows, cfg.cols)


def value_lanes(cfg: CoreConfig, stream_bytes: int = 1) -> int:
    """The input quantizer's lanes (elements a beat) for a WRITE of values: a run of one tile
    row (a divisor of the tile's columns, so a beat never leaves its row) that fits a row
    chunk of A (``rows`` lanes) and of B (``cols`` lanes), sized to the link: the fewest that
    take the ``stream_bytes`` of a cycle as bf16 values (2 bytes each), or the widest that fits
    if none does. Each code beat is then one row chunk write, partial (``skip``) where the
    buffer's chunk is wider. The stochastic rounding's stream position is an element's place
    in the tile-major stream, whatever the lanes, so any choice gives the same codes."""
    tw = cfg.tile[1]
    fits = [d for d in range(1, min(cfg.rows, cfg.cols, tw) + 1) if tw % d == 0]
    return next((d for d in fits if 2 * d >= stream_bytes), fits[-1])


def write_plan_layout(cfg: CoreConfig) -> data.StructLayout:
    """A WRITE's replay: the core target of its code beats, the region (row and column
    bounds, in elements; in tiles for exponents), the column step of a beat, its tile grid
    position (values), the quantizer's rounding and seed, and how the ``LaneAssembler``
    builds a beat (``beat_bytes``: its elements times ``elem_bytes``, a shift in the decision)."""
    D, W = cfg.size, write_lanes(cfg)
    th, tw = cfg.tile
    return data.StructLayout({
        "values": 1, "target": 3,
        "row": range(D + 1), "col": range(D + 1), "col_end": range(D + 1), "row_end": range(D + 1),
        "step": range(W + 1), "empty": 1,
        "erow": range(D // th + 1), "ecol": range(D // tw + 1),
        "rounding": Rounding, "seed": 32,
        "elem_bytes": range(5), "beat_bytes": range(4 * W + 1), "mode": 2,
    })


def read_plan_layout(stream_bytes: int, max_payload: int) -> data.StructLayout:
    """The payload regions ``PayloadReader`` streams: region a from word ``a_word`` byte
    ``a_offset``, ``length`` bytes; with ``interleave`` region b (same length) too."""
    words = _words(max_payload, stream_bytes)
    return data.StructLayout({
        "a_word": range(words + 1), "a_offset": range(stream_bytes), "length": range(max_payload + 1),
        "b_word": range(words + 1), "b_offset": range(stream_bytes), "interleave": 1,
    })


def plan_layout(cfg: CoreConfig, stream_bytes: int, max_payload: int) -> data.StructLayout:
    """``FrameChecker``'s decision: the reply (status, opcode, tag; ``fixed`` bytes from
    registers after the status, then ``stream`` bytes from a unit) and what to execute."""
    return data.StructLayout({
        "status": 8, "opcode": 8, "tag": 16, "fixed": range(FIXED_BYTES + 1), "stream": 32,
        "action": Action,
        "write": write_plan_layout(cfg),
        "read": read_plan_layout(stream_bytes, max_payload),
        "cmd": command_layout(cfg),
        "gradient": 1, "e_func": FUNC_WIDTH,
    })


def quantize_output_layout(mantissa_bits: int, lanes: int) -> data.StructLayout:
    """The output payload of ``hw.quantize.Quantize`` (its ``out_layout``)."""
    return data.StructLayout({
        "codes": data.ArrayLayout(signed(mantissa_bits), lanes),
        "exponent": unsigned(EXP_WIDTH),
        "last": unsigned(1),
    })


def result_chunk_bytes(cfg: CoreConfig) -> int:
    """The most reply bytes one output beat of the core makes: ``out_lanes`` fp32 values, or a
    BFP tile's exponent byte and ``out_lanes`` codes."""
    code_bytes = 1 if cfg.mantissa_bits <= 8 else 2
    return max(4 * cfg.out_lanes, 1 + code_bytes * cfg.out_lanes)


def _min(a, b):
    return Mux(a < b, a, b)


def _multiple_of(value, step: int, limit: int):
    """``value`` is one of 0, step, 2*step, .. <= limit (a few comparators instead of a
    divider; ``step`` need not be a power of two, e.g. a 24-row tile)."""
    return Cat(*(value == k * step for k in range(limit // step + 1))).any()


def _quotient_of_multiple(value, step: int, limit: int):
    """``value // step`` for a ``value`` that ``_multiple_of`` accepted."""
    q = Const(0, range(limit // step + 1))
    for k in range(1, limit // step + 1):
        q = Mux(value == k * step, k, q)
    return q


def _ceil_div(value, step: int, limit: int):
    """``ceil(value / step)`` for 0 <= value <= limit: a sum of comparators."""
    return sum((value > k * step).as_unsigned() for k in range(-(-limit // step)))


def _bounded_product(a, b, limit: int):
    """``a * b`` for 0 <= a, b <= limit (exact only there: the caller refuses larger fields
    first), as shifts and adds of ``limit.bit_length()``-bit operands: a few small adders in
    LUTs, no DSP block (those are the MAC array's; a registered multiplier here also trips
    Yosys 0.70's synth_ecp5, an assertion in ABC_OPS_REINTEGRATE)."""
    bits = limit.bit_length()
    a, b = a[:bits], b[:bits]  # either may be narrower than limit's bits (a side of one-row tiles)
    return _tree_sum([Mux(b[i], a << i, 0) for i in range(len(b))])


def _tree_sum(terms):
    """The sum of ``terms`` as a balanced tree of adders (depth log2 of their number)."""
    while len(terms) > 1:
        terms = [terms[i] + terms[i + 1] if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return terms[0]


def divmod_const(value, divisor: int, limit: int):
    """``(value // divisor, value % divisor)`` for 0 <= value <= limit, by a multiplication
    with a reciprocal: with ``m = ceil(2**s / divisor)`` and ``2**s > limit * divisor`` the
    product's high part is the exact quotient (the error ``m * divisor - 2**s`` stays below
    ``divisor``). Python ints or Amaranth Values."""
    if divisor == 1:
        return value, 0 * value if isinstance(value, int) else Const(0, 1)
    s = (limit * divisor).bit_length()
    mult = -(-(1 << s) // divisor)
    q = (value * mult) >> s
    return q, value - q * divisor


class StoreSignature(wiring.Signature):
    """A write port of the payload buffer, from the writer's side: word ``addr`` gets ``data``
    (N bytes, lane 0 the lowest address) when ``en``."""

    def __init__(self, stream_bytes: int, words: int):
        super().__init__({
            "en": Out(1),
            "addr": Out(range(words)),
            "data": Out(data.ArrayLayout(8, stream_bytes)),
        })


class FrameReceiver(wiring.Component):
    """Frames from the byte window into the payload buffer, one ``FRAME`` record each, into
    its two slots by turns.

    Ports: ``i`` (``WindowSignature(N)``): the link's bytes; ``store``
    (``StoreSignature``): payload word ``k`` of the frame is bytes ``k*N .. k*N+N-1`` (the
    last word's lanes beyond the length are don't-care) of slot ``slot``; ``frame`` (stream
    out, ``frame_layout()``): offered once a frame has ended and held until taken; taking it
    (``frame.ready``) releases the receiver, which turns to the other slot and hunts for the
    next magic, or first skips the ``length + 4`` bytes of an oversize frame (silently
    dropped after ``frame_timeout`` cycles without a byte). The engine takes a frame once it
    has decided it, and a frame only after it is done with the one before (``Dispatch``): so
    the slot the receiver turns to is free, and the next frame arrives while this one is
    executed and answered.

    Throughput: hunting, the 8 header bytes after the magic and the 4 CRC bytes take a byte a
    cycle; the payload N bytes a cycle (the window offers them at any alignment on the wire);
    skipping up to N. The receiver takes no byte while a frame waits in ``frame``: the link
    stalls while the engine executes the frame before it. A frame stopped mid-way for
    ``frame_timeout`` cycles without a byte arriving (``i.arrived``, or taken) ends with
    ``TIMEOUT``, with whatever of the header had arrived (the rest zero).
    """

    def __init__(self, stream_bytes: int, max_payload: int, frame_timeout: int):
        self.stream_bytes, self.max_payload, self.frame_timeout = stream_bytes, max_payload, frame_timeout
        self.words = _words(max_payload, stream_bytes)
        super().__init__({
            "i": In(WindowSignature(stream_bytes)),
            "store": Out(StoreSignature(stream_bytes, self.words)),
            "slot": Out(1),
            "frame": Out(stream.Signature(frame_layout())),
        })

    def elaborate(self, platform):
        m = Module()
        N, P = self.stream_bytes, self.max_payload
        m.submodules.crc = crc = ParallelCRC32(N, init=crc32_state(protocol.MAGIC))
        win = self.i
        byte = win.data[0]
        have = win.level != 0

        head = Signal(HEAD)
        desc = Signal(8 * DESCRIPTOR_BYTES)
        event = Signal(FrameEvent)
        head_index = Signal(range(protocol.HEADER.size))  # header byte after the magic
        count = Signal(range(P + 1))  # payload bytes received
        word = Signal(range(self.words + 1))
        crc_index = Signal(range(protocol.CRC_SIZE))
        idle = Signal(range(self.frame_timeout + 1))  # cycles without a byte, mid-frame
        seen_h = Signal()
        skip_left = Signal(34)
        m.d.comb += [
            self.frame.payload.head.eq(head),
            self.frame.payload.desc.eq(desc),
            self.frame.payload.event.eq(event),
            self.frame.payload.crc_ok.eq(crc.residue_ok),
            crc.i.payload.data.eq(win.data),
            self.store.addr.eq(word),
            self.store.data.eq(win.data),
        ]
        left = Signal(32)  # payload bytes still to come
        want = Signal(range(N + 1))  # the payload bytes of the next word
        m.d.comb += [left.eq(head.length - count), want.eq(Mux(left >= N, N, left))]
        took = Signal()  # bytes of the frame taken this cycle
        activity = win.arrived | took

        def take_bytes(k):
            m.d.comb += [win.take.eq(k), took.eq(k != 0), crc.i.valid.eq(k != 0), crc.i.payload.count.eq(k)]

        def mid_frame_timeout(then_reply: bool):
            """A frame that stops arriving: after ``frame_timeout`` cycles without a byte."""
            with m.If(activity):
                m.d.sync += idle.eq(0)
            with m.Elif(idle == self.frame_timeout - 1):
                # The bytes of the frame that did arrive go with it: a payload's last bytes
                # wait in the window for a whole word (fewer than the frame's rest, so none of
                # them belongs to a later frame).
                m.d.comb += win.take.eq(win.level)
                m.d.sync += idle.eq(0)
                if then_reply:
                    m.d.sync += event.eq(FrameEvent.TIMEOUT)
                    m.next = "DONE"
                else:
                    m.next = "HUNT"
            with m.Else():
                m.d.sync += idle.eq(idle + 1)

        with m.FSM():
            with m.State("HUNT"):
                m.d.comb += win.take.eq(have)
                with m.If(have):
                    m.d.sync += seen_h.eq(byte == protocol.MAGIC[0])
                    with m.If(seen_h & (byte == protocol.MAGIC[1])):
                        m.d.comb += crc.clear.eq(1)
                        m.d.sync += [seen_h.eq(0), head.eq(0), head_index.eq(0), idle.eq(0), count.eq(0),
                                     word.eq(0), crc_index.eq(0), event.eq(FrameEvent.COMPLETE)]
                        m.next = "HEADER"
            with m.State("HEADER"):
                take_bytes(have)
                with m.If(have):
                    m.d.sync += [head.as_value().word_select(head_index, 8).eq(byte), head_index.eq(head_index + 1)]
                    with m.If(head_index == protocol.HEADER.size - len(protocol.MAGIC) - 1):
                        m.next = "LENGTH"
                mid_frame_timeout(True)
            with m.State("LENGTH"):
                # A length beyond the buffer is refused as soon as the header is in; the
                # frame's remaining length + 4 bytes are skipped after the reply.
                with m.If(head.length > P):
                    m.d.sync += event.eq(FrameEvent.OVERSIZE)
                    m.next = "DONE"
                with m.Elif(head.length == 0):
                    m.next = "CRC"
                with m.Else():
                    m.next = "PAYLOAD"
            with m.State("PAYLOAD"):
                full = win.level >= want
                with m.If(full):
                    take_bytes(want)
                    m.d.comb += self.store.en.eq(1)
                    m.d.sync += [count.eq(count + want), word.eq(word + 1)]
                    for j in range(DESCRIPTOR_BYTES):
                        with m.If((word == j // N) & (j % N < want)):
                            m.d.sync += desc.word_select(j, 8).eq(win.data[j % N])
                    with m.If(left <= N):
                        m.next = "CRC"
                mid_frame_timeout(True)
            with m.State("CRC"):
                take_bytes(have)
                with m.If(have):
                    m.d.sync += crc_index.eq(crc_index + 1)
                    with m.If(crc_index == protocol.CRC_SIZE - 1):
                        m.next = "DONE"
                mid_frame_timeout(True)
            with m.State("DONE"):
                m.d.comb += self.frame.valid.eq(1)
                with m.If(self.frame.ready):
                    m.d.sync += [skip_left.eq(head.length + protocol.CRC_SIZE), self.slot.eq(~self.slot)]
                    m.next = "HUNT"
                    with m.If(event == FrameEvent.OVERSIZE):
                        m.next = "SKIP"
            with m.State("SKIP"):
                k = Signal(range(N + 1))
                m.d.comb += [k.eq(Mux(skip_left < win.level, skip_left, win.level)), win.take.eq(k), took.eq(k != 0)]
                m.d.sync += skip_left.eq(skip_left - k)
                with m.If(skip_left == k):
                    m.next = "HUNT"
                mid_frame_timeout(False)
        return m


def _early(m: Module, value, name: str) -> Signal:
    """``value`` of a received frame, registered (the frame holds still while offered): valid
    from the cycle after the frame is offered, a cycle after the registers it reads."""
    r = Signal(Value.cast(value).shape(), name=name, reset_less=True)
    m.d.sync += r.eq(value)
    return r


class WriteCheck(wiring.Component):
    """``FrameChecker``'s checks of a WRITE, and its replay's plan.

    Ports: ``frame`` (``frame_layout()``, held while offered); registered (valid from the
    second cycle after the frame is offered, some from the first): ``short`` (a length too
    short for WRITE's header), ``address_ok`` (the region fits the target's buffer and its
    alignment; an unknown target is a bad address), ``desc_ok`` (encoding and rounding of
    values; a reduced device's omitted units), ``length_ok`` (the length is the header and the
    region's elements); ``plan`` (``write_plan_layout``, from the frame's fields).
    """

    def __init__(self, cfg: CoreConfig, *, stream_bytes: int):
        self.cfg, self.stream_bytes = cfg, stream_bytes
        super().__init__({
            "frame": In(frame_layout()),
            "short": Out(1),
            "address_ok": Out(1),
            "desc_ok": Out(1),
            "length_ok": Out(1),
            "plan": Out(write_plan_layout(cfg)),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self.cfg
        D, R, C = cfg.size, cfg.rows, cfg.cols
        th, tw = cfg.tile
        cb = 1 if cfg.mantissa_bits <= 8 else 2
        length = self.frame.head.length

        def early(value, name):
            return _early(m, value, name)

        w_desc = data.View(layout(protocol.WRITE), self.frame.desc[:8 * WRITE_HEADER])
        w_target, w_encoding, w_rounding = w_desc.target, w_desc.encoding, w_desc.rounding
        w_row, w_col, w_rows, w_cols = w_desc.row, w_desc.col, w_desc.rows, w_desc.cols
        w_row_end = Signal(17)
        w_col_end = Signal(17)
        m.d.comb += [w_row_end.eq(w_row + w_rows), w_col_end.eq(w_col + w_cols)]
        # Stage 1: the parts of the region check; stage 2: the check for the target.
        in_elements = early((w_row_end <= D) & (w_col_end <= D), "in_elements")
        in_tiles = early((w_row_end <= D // th) & (w_col_end <= D // tw), "in_tiles")
        # Row chunks: A's codes go R to a chunk, B's codes, the accumulator's and the bias's C.
        chunked_c = early(_multiple_of(w_col, C, D) & _multiple_of(w_cols, C, D), "chunked_c")
        chunked_r = chunked_c if R == C else early(_multiple_of(w_col, R, D) & _multiple_of(w_cols, R, D), "chunked_r")
        tiled = early(_multiple_of(w_row, th, D) & _multiple_of(w_rows, th, D)
                      & _multiple_of(w_col, tw, D) & _multiple_of(w_cols, tw, D), "tiled")
        bias_row = early((w_row == 0) & (w_rows == 1), "bias_row")
        is_a_codes = w_target == Target.A_CODES
        is_codes = is_a_codes | (w_target == Target.B_CODES)
        is_exps = (w_target == Target.A_EXPONENTS) | (w_target == Target.B_EXPONENTS)
        is_values = (w_target == Target.A_VALUES) | (w_target == Target.B_VALUES)
        m.d.comb += self.address_ok.eq(early(Mux(
            is_a_codes, in_elements & chunked_r,
            Mux((w_target == Target.B_CODES) | (w_target == Target.ACC), in_elements & chunked_c,
                Mux(is_exps, in_tiles,
                    Mux(w_target == Target.BIAS, bias_row & in_elements & chunked_c,
                        Mux(is_values, in_elements & tiled, 0))))), "address_ok"))
        # The elements of a replay beat: a row chunk (R or C), an exponent, or a quantizer beat.
        chunk_lanes = Mux(is_exps, 1, Mux(is_a_codes, R, C))
        value_bf16 = w_encoding == Encoding.BF16
        write_desc_ok = ~is_values | ((w_encoding <= max(Encoding)) & (w_rounding <= max(Rounding)))
        # A reduced device refuses the work of the units it was built without (CoreConfig).
        if not cfg.value_quantizer:
            write_desc_ok = ~is_values
        elif not cfg.stochastic:
            write_desc_ok = write_desc_ok & (w_rounding != Rounding.STOCHASTIC)
        m.d.comb += self.desc_ok.eq(early(write_desc_ok, "write_desc_ok"))
        element_bytes = Mux(is_codes, cb, Mux(is_exps, 1, Mux(is_values & value_bf16, 2, 4)))
        region = early(_bounded_product(w_rows, w_cols, D), "region")  # exact in a WRITE that address_ok admits
        # region * element_bytes (1, 2 or 4): a shift of the registered product
        write_bytes = Signal(35)
        element_shift = Mux(element_bytes == 4, 2, Mux(element_bytes == 2, 1, 0))
        m.d.comb += write_bytes.eq(region << early(element_shift, "element_shift"))
        m.d.comb += [self.length_ok.eq(early(length == WRITE_HEADER + write_bytes, "write_length_ok")),
                     self.short.eq(early(length < WRITE_HEADER, "short_write"))]

        wp = self.plan
        beat_elems = Mux(is_values, value_lanes(cfg, self.stream_bytes), chunk_lanes)
        m.d.comb += [
            # Paths to units a reduced device lacks are never taken (refused above): their
            # logic is not built.
            wp.values.eq(is_values if cfg.value_quantizer else 0),
            wp.target.eq(Mux(is_values, w_target - (Target.A_VALUES - Target.A_CODES), w_target)),
            wp.row.eq(w_row), wp.col.eq(w_col), wp.col_end.eq(w_col_end), wp.row_end.eq(w_row_end),
            wp.step.eq(chunk_lanes),
            wp.empty.eq((w_rows == 0) | (w_cols == 0)),
            wp.erow.eq(_quotient_of_multiple(w_row, th, D)),
            wp.ecol.eq(_quotient_of_multiple(w_col, tw, D)),
            wp.rounding.eq(w_rounding),
            wp.seed.eq(w_desc.seed),
            wp.elem_bytes.eq(element_bytes),
            wp.beat_bytes.eq(beat_elems << element_shift),
            wp.mode.eq(Mux(is_codes, ASSEMBLE_MODES["sign_extend"],
                           Mux(is_values & value_bf16, ASSEMBLE_MODES["high_half"], ASSEMBLE_MODES["raw"]))),
        ]
        return m


class CommandCheck(wiring.Component):
    """``FrameChecker``'s checks of a GEMM or a READ (one set of fields: READ has K = 0 and
    only the bias flag), and the core's command.

    Ports: ``frame`` (``frame_layout()``, held while offered); registered: ``bad_length`` (the
    length is not the command's descriptor's), ``ok`` (sides, transposes, activation, format,
    rounding; a reduced device's omitted units), ``result_bytes`` (the reply's result bytes
    in the command's format, padding included); ``cmd`` (``command_layout``, from the
    registered fields).
    """

    def __init__(self, cfg: CoreConfig):
        self.cfg = cfg
        super().__init__({
            "frame": In(frame_layout()),
            "bad_length": Out(1),
            "ok": Out(1),
            "result_bytes": Out(32),
            "cmd": Out(command_layout(cfg)),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self.cfg
        D = cfg.size
        th, tw = cfg.tile
        cb = 1 if cfg.mantissa_bits <= 8 else 2
        functions = cfg.built_functions
        head, desc = self.frame.head, self.frame.desc

        def early(value, name):
            return _early(m, value, name)

        g_desc = data.View(layout(protocol.GEMM), desc[:8 * GEMM_SIZE])
        r_desc = data.View(layout(protocol.READ), desc[:8 * READ_SIZE])
        is_read = head.opcode == Op.READ
        # Stage 1: the command's fields; stage 2: their checks and products; stage 3: the
        # result's bytes.
        c_m = early(Mux(is_read, r_desc.m, g_desc.m), "c_m")
        c_n = early(Mux(is_read, r_desc.n, g_desc.n), "c_n")
        c_k = early(Mux(is_read, 0, g_desc.k), "c_k")
        c_flags = early(Mux(is_read, r_desc.flags & GemmFlag.BIAS, g_desc.flags), "c_flags")
        c_act = early(Mux(is_read, r_desc.activation, g_desc.activation), "c_act")
        c_format = early(Mux(is_read, r_desc.out_format, g_desc.out_format), "c_format")
        c_rounding = early(Mux(is_read, r_desc.rounding, g_desc.rounding), "c_rounding")
        c_seed = early(Mux(is_read, r_desc.seed, g_desc.seed), "c_seed")
        c_read = early(is_read, "c_read")
        flag = {f.name.lower(): c_flags & f != 0 for f in GemmFlag}
        unary_mask = functions_mask(n for n in functions if n in UNARY_FUNCTIONS)
        act_ok = (c_act == protocol.NO_ACTIVATION) | Const(unary_mask, 256).bit_select(c_act, 1)
        sides_ok = ((c_m >= 1) & (c_m <= D) & (c_n >= 1) & (c_n <= D)
                    & (c_read | ((c_k >= 1) & (c_k <= D))))
        transposes_ok = 1 if cfg.square else (c_read | (~flag["transpose_a"] & flag["transpose_b"]))
        command_ok = (sides_ok & act_ok & transposes_ok & (c_format <= max(OutFormat))
                      & (c_rounding <= max(Rounding)))
        c_bfp = c_format == OutFormat.BFP
        if not cfg.bfp_output:
            command_ok = command_ok & ~c_bfp
        elif not cfg.stochastic:
            command_ok = command_ok & ~(c_bfp & (c_rounding == Rounding.STOCHASTIC))
        m.d.comb += self.ok.eq(early(command_ok, "command_ok"))
        # exact in a command that sides_ok admits
        tiles = early(_bounded_product(_ceil_div(c_m, th, D), _ceil_div(c_n, tw, D), -(-D // min(th, tw))), "tiles")
        elements = early(_bounded_product(c_m, c_n, D), "elements")
        m.d.comb += self.result_bytes.eq(early(Mux(c_format == OutFormat.FP32, elements << 2,
                                                   Mux(c_format == OutFormat.BF16, elements << 1,
                                                       tiles * (1 + th * tw * cb))),
                                               "result_bytes"))
        m.d.comb += self.bad_length.eq(early(head.length != Mux(is_read, READ_SIZE, GEMM_SIZE), "bad_command_length"))

        cmd = self.cmd
        m.d.comb += [
            cmd.m.eq(c_m), cmd.n.eq(c_n), cmd.k.eq(c_k),
            cmd.transpose_a.eq(flag["transpose_a"]),
            cmd.transpose_b.eq(flag["transpose_b"]),
            cmd.accumulate.eq(flag["accumulate"]),
            cmd.bias.eq(flag["bias"]),
            cmd.act_en.eq(c_act != protocol.NO_ACTIVATION),
            cmd.act_func.eq(c_act),
            cmd.out_format.eq(c_format),
            cmd.rounding.eq(c_rounding),
            cmd.seed.eq(c_seed),
        ]
        return m


class ElementwiseCheck(wiring.Component):
    """``FrameChecker``'s checks of an ELEMENTWISE, and where its g starts in the payload.

    Ports: ``frame`` (``frame_layout()``, held while offered); ``function``, ``count`` (the
    descriptor's), ``gradient`` (the function is a built gradient: x and g); registered:
    ``short`` (a length too short for the header), ``built`` (the function is built),
    ``length_ok`` (the length is the header and the count's x, and g), ``b_word``,
    ``b_offset`` (g's first byte, after x, as a payload word and the byte in it).
    """

    def __init__(self, cfg: CoreConfig, *, stream_bytes: int, max_payload: int):
        self.cfg, self.stream_bytes, self.max_payload = cfg, stream_bytes, max_payload
        rp, e_desc = read_plan_layout(stream_bytes, max_payload), layout(protocol.ELEMENTWISE)
        super().__init__({
            "frame": In(frame_layout()),
            "function": Out(e_desc["function"].shape),
            "count": Out(e_desc["count"].shape),
            "gradient": Out(1),
            "short": Out(1),
            "built": Out(1),
            "length_ok": Out(1),
            "b_word": Out(rp["b_word"].shape),
            "b_offset": Out(rp["b_offset"].shape),
        })

    def elaborate(self, platform):
        m = Module()
        N, P = self.stream_bytes, self.max_payload
        functions = self.cfg.built_functions
        length = self.frame.head.length
        e_desc = data.View(layout(protocol.ELEMENTWISE), self.frame.desc[:8 * ELEMENTWISE_HEADER])
        e_function, e_count = e_desc.function, e_desc.count
        built_mask = functions_mask(functions)
        gradient_mask = functions_mask(n for n in functions if n not in UNARY_FUNCTIONS)
        e_gradient = Const(gradient_mask, 256).bit_select(e_function, 1)  # a built gradient function
        e_bytes = Signal(35)
        m.d.comb += e_bytes.eq(Mux(e_gradient, e_count << 2, e_count << 1))
        m.d.comb += [
            self.function.eq(e_function), self.count.eq(e_count), self.gradient.eq(e_gradient),
            self.length_ok.eq(_early(m, length == ELEMENTWISE_HEADER + e_bytes, "e_length_ok")),
            self.built.eq(_early(m, Const(built_mask, 256).bit_select(e_function, 1), "e_built")),
            self.short.eq(_early(m, length < ELEMENTWISE_HEADER, "short_elementwise")),
        ]
        b_start = Signal(range(P + ELEMENTWISE_HEADER + 1))
        m.d.comb += b_start.eq(ELEMENTWISE_HEADER + (e_count << 1))
        b_word, b_offset = divmod_const(b_start, N, P + ELEMENTWISE_HEADER)
        m.d.comb += [self.b_word.eq(_early(m, b_word, "b_word")), self.b_offset.eq(_early(m, b_offset, "b_offset"))]
        return m


class FrameChecker(wiring.Component):
    """The decision on a received frame: ``plan`` from ``frame``.

    Three register stages (``LATENCY`` = 3), each a few levels of logic: the first holds the
    command's fields (GEMM's or READ's), the parts of a WRITE's region check and its
    element count, and the checks of lengths and codes against constants; the second the
    descriptor and region checks, a result's elements and tiles, and a WRITE's length check;
    the third the reply's byte count. The status and the plan are then a few levels of logic
    from registers. The ``plan`` of a frame is valid from the third cycle after the frame is
    offered and holds while the frame does: the receiver holds a frame still until it is
    taken, and the engine takes the plan ``LATENCY`` cycles after it first sees the frame
    (``CHECK``, ``DECIDE``). On a ULX3S build the whole decision in one cycle, with two DSP
    multipliers, was a 24 ns path; with one register stage it was still 13 levels of logic.

    The first failing check gives the status (docs/protocol.md): a dropped frame TIMEOUT (tag
    0xFFFF), an oversize one BAD_LENGTH, then CRC, version, opcode, then per command: a length
    too short for the command's fixed part, the region (WRITE: BAD_ADDRESS, also for an
    unknown target), the descriptor (encoding, rounding; GEMM/READ: sides, transposes,
    activation, format, rounding; a reduced device's omitted units, ``CoreConfig``'s
    ``value_quantizer``, ``bfp_output``, ``stochastic``; ELEMENTWISE: the function), and last
    the length against what the fields imply. With an OK status the plan also says what to
    execute and how many reply bytes follow the status.
    """

    LATENCY = 3

    def __init__(self, cfg: CoreConfig, *, stream_bytes: int, max_payload: int):
        self.cfg, self.stream_bytes, self.max_payload = cfg, stream_bytes, max_payload
        super().__init__({
            "frame": In(frame_layout()),
            "plan": Out(plan_layout(cfg, stream_bytes, max_payload)),
        })

    def elaborate(self, platform):
        m = Module()
        cfg, N = self.cfg, self.stream_bytes
        head, plan = self.frame.head, self.plan
        opcode, length = head.opcode, head.length
        is_op = {op: opcode == op for op in Op}
        is_read = is_op[Op.READ]

        # The checks of each command, each its first two stages (``WriteCheck``,
        # ``CommandCheck``, ``ElementwiseCheck``).
        m.submodules.write = write = WriteCheck(cfg, stream_bytes=N)
        m.submodules.command = command = CommandCheck(cfg)
        m.submodules.elementwise = ew = ElementwiseCheck(cfg, stream_bytes=N, max_payload=self.max_payload)
        m.d.comb += [write.frame.eq(self.frame), command.frame.eq(self.frame), ew.frame.eq(self.frame)]
        # An ELEMENTWISE that runs: none on a device without functions (it is refused), whose
        # path to the activation unit is then not built.
        elementwise = is_op[Op.ELEMENTWISE] if cfg.built_functions else Const(0)

        # The first stage too: the length and version checks against constants, each a register.
        bad_version = _early(m, head.version != protocol.PROTOCOL_VERSION, "bad_version")
        has_payload = _early(m, length != 0, "has_payload")

        status = Signal(8)
        event = self.frame.event
        with m.If(event == FrameEvent.TIMEOUT):
            m.d.comb += status.eq(Status.TIMEOUT)
        with m.Elif(event == FrameEvent.OVERSIZE):
            m.d.comb += status.eq(Status.BAD_LENGTH)
        with m.Elif(~self.frame.crc_ok):
            m.d.comb += status.eq(Status.BAD_CRC)
        with m.Elif(bad_version):
            m.d.comb += status.eq(Status.BAD_VERSION)
        with m.Elif(~Cat(*is_op.values()).any()):
            m.d.comb += status.eq(Status.BAD_OPCODE)
        with m.Elif(is_op[Op.WRITE]):
            with m.If(write.short):
                m.d.comb += status.eq(Status.BAD_LENGTH)
            with m.Elif(~write.address_ok):
                m.d.comb += status.eq(Status.BAD_ADDRESS)
            with m.Elif(~write.desc_ok):
                m.d.comb += status.eq(Status.BAD_DESCRIPTOR)
            with m.Elif(~write.length_ok):
                m.d.comb += status.eq(Status.BAD_LENGTH)
        with m.Elif(is_op[Op.GEMM] | is_read):
            with m.If(command.bad_length):
                m.d.comb += status.eq(Status.BAD_LENGTH)
            with m.Elif(~command.ok):
                m.d.comb += status.eq(Status.BAD_DESCRIPTOR)
        with m.Elif(is_op[Op.ELEMENTWISE]):
            with m.If(ew.short):
                m.d.comb += status.eq(Status.BAD_LENGTH)
            with m.Elif(~ew.built):
                m.d.comb += status.eq(Status.BAD_DESCRIPTOR)
            with m.Elif(~ew.length_ok):
                m.d.comb += status.eq(Status.BAD_LENGTH)
        with m.Else():  # IDENTIFY, STATUS, RESET carry no payload
            with m.If(has_payload):
                m.d.comb += status.eq(Status.BAD_LENGTH)

        # ---- the plan ---------------------------------------------------------------------
        ok = status == Status.OK
        timed_out = event == FrameEvent.TIMEOUT
        m.d.comb += [
            plan.status.eq(status),
            plan.opcode.eq(opcode | protocol.REPLY),
            plan.tag.eq(Mux(timed_out, protocol.FRAME_TIMEOUT_TAG, head.tag)),
            plan.fixed.eq(Mux(~ok, 0, Mux(is_op[Op.IDENTIFY], protocol.IDENTITY.size,
                                          Mux(is_op[Op.STATUS], protocol.STATUS.size,
                                              Mux(is_op[Op.GEMM], protocol.CYCLES.size, 0))))),
            plan.stream.eq(Mux(~ok, 0, Mux(elementwise, ew.count << 1,
                                           Mux(is_op[Op.GEMM] | is_read, command.result_bytes, 0)))),
            plan.action.eq(Mux(~ok, Action.REPLY,
                               Mux(is_op[Op.WRITE], Action.WRITE,
                                   Mux(is_op[Op.GEMM] | is_read, Action.CORE,
                                       Mux(elementwise, Action.ELEMENTWISE,
                                           Mux(is_op[Op.RESET], Action.RESET, Action.REPLY)))))),
            plan.write.eq(write.plan),
            plan.cmd.eq(command.cmd),
            plan.gradient.eq(ew.gradient),
            plan.e_func.eq(ew.function),
        ]
        # Payload regions in buffer words: a WRITE's data after its header; ELEMENTWISE's x,
        # and its g after x.
        rp = plan.read
        a_start = Mux(is_op[Op.WRITE], WRITE_HEADER, ELEMENTWISE_HEADER)
        m.d.comb += [
            rp.a_word.eq(Mux(is_op[Op.WRITE], WRITE_HEADER // N, ELEMENTWISE_HEADER // N)),
            rp.a_offset.eq(Mux(is_op[Op.WRITE], WRITE_HEADER % N, ELEMENTWISE_HEADER % N)),
            rp.length.eq(Mux(is_op[Op.WRITE], length - a_start, ew.count << 1)),
            rp.b_word.eq(ew.b_word),
            rp.b_offset.eq(ew.b_offset),
            rp.interleave.eq(elementwise & ew.gradient),
        ]
        return m


class PayloadReader(wiring.Component):
    """Payload bytes back out of the buffer: region a (``plan.a_word``, ``a_offset``,
    ``length`` bytes) as chunks on ``a`` and, with ``plan.interleave``, region b (same length)
    on ``b``, alternating words between them so that neither runs far ahead.

    Ports: ``start`` (strobe: the plan is valid), ``plan`` (``read_plan_layout``), the
    buffer's read port (``rd_addr``, ``rd_en`` out; ``rd_data`` in: a read pipeline of
    ``latency`` stages that advances while ``rd_en`` is high, as a ``BlockRam`` with ``stall``),
    ``a`` and ``b`` (streams out of ``chunk_layout(N)``). Throughput: one word a cycle; a
    region's first chunk holds the bytes of its first word from its offset on, its last the
    rest of its length.
    """

    def __init__(self, stream_bytes: int, max_payload: int, latency: int = BlockRam.LATENCY):
        self.stream_bytes, self.max_payload, self.latency = stream_bytes, max_payload, latency
        words = _words(max_payload, stream_bytes)
        super().__init__({
            "start": In(1),
            "plan": In(read_plan_layout(stream_bytes, max_payload)),
            "rd_addr": Out(range(words)),
            "rd_en": Out(1),
            "rd_data": In(8 * stream_bytes),
            "a": Out(stream.Signature(chunk_layout(stream_bytes))),
            "b": Out(stream.Signature(chunk_layout(stream_bytes))),
        })

    def elaborate(self, platform):
        m = Module()
        N, P = self.stream_bytes, self.max_payload
        words = _words(P, N)
        regions = []
        for name in ("a", "b"):
            regions.append({"word": Signal(range(words + 1), name=f"{name}_word"),
                            "offset": Signal(range(N), name=f"{name}_offset"),
                            "left": Signal(range(P + 1), name=f"{name}_left")})
        ra, rb = regions
        # What each stage of the read pipeline holds: whether a word for a chunk, of which
        # region, from which offset, how many bytes; the last stage's is on rd_data.
        stages = [{"held": Signal(name=f"held{k}"), "b": Signal(name=f"held_b{k}"),
                   "offset": Signal(range(N), name=f"held_offset{k}"),
                   "count": Signal(range(N + 1), name=f"held_count{k}")} for k in range(self.latency)]
        last = stages[-1]
        held, held_b, held_offset, held_count = last["held"], last["b"], last["offset"], last["count"]
        out_ready = Mux(held_b, self.b.ready, self.a.ready)
        advance = ~held | out_ready
        b_turn = Signal()
        use_b = (rb["left"] != 0) & (b_turn | (ra["left"] == 0))
        cur = {k: Mux(use_b, rb[k], ra[k]) for k in ("word", "offset", "left")}
        room = N - cur["offset"]
        count = Signal(range(N + 1))
        m.d.comb += [
            count.eq(Mux(cur["left"] < room, cur["left"], room)),
            self.rd_en.eq(advance),
            self.rd_addr.eq(cur["word"]),
        ]
        chunk = Signal(8 * N)
        m.d.comb += chunk.eq(self.rd_data >> (held_offset * 8))
        for port, is_b in ((self.a, 0), (self.b, 1)):
            m.d.comb += [
                port.valid.eq(held & (held_b == is_b)),
                port.payload.data.eq(chunk),
                port.payload.count.eq(held_count),
            ]
        with m.If(self.start):
            m.d.sync += [stage["held"].eq(0) for stage in stages]
            m.d.sync += [
                b_turn.eq(0),
                ra["word"].eq(self.plan.a_word), ra["offset"].eq(self.plan.a_offset), ra["left"].eq(self.plan.length),
                rb["word"].eq(self.plan.b_word), rb["offset"].eq(self.plan.b_offset),
                rb["left"].eq(Mux(self.plan.interleave, self.plan.length, 0)),
            ]
        with m.Elif(advance):
            issue = cur["left"] != 0
            first = stages[0]
            for k in range(1, self.latency):
                m.d.sync += [stages[k][f].eq(stages[k - 1][f]) for f in stages[k]]
            m.d.sync += first["held"].eq(issue)
            with m.If(issue):
                m.d.sync += [first["b"].eq(use_b), first["offset"].eq(cur["offset"]), first["count"].eq(count),
                             b_turn.eq(~use_b)]
                for r, sel in ((ra, ~use_b), (rb, use_b)):
                    with m.If(sel):
                        m.d.sync += [r["word"].eq(r["word"] + 1), r["offset"].eq(0), r["left"].eq(r["left"] - count)]
        return m


class LaneAssembler(wiring.Component):
    """A window of payload bytes to beats of ``lanes`` 32-bit lanes, one beat a cycle:
    ``beat_bytes`` bytes a beat (1 .. ``lanes`` elements, in the first lanes; the others are
    don't-care: a WRITE sets them per target), ``elem_bytes`` little-endian bytes an element
    (1, 2 or 4), placed by ``mode`` (``ASSEMBLE_MODES``): ``sign_extend`` (BFP codes), ``raw``
    (fp32, exponents: zero-extended), ``high_half`` (bf16 into the high half: its exact fp32
    widening).

    Ports: ``i`` (``WindowSignature(4 * lanes)``), ``o`` (stream out); the configuration
    ports hold still during a replay. Combinational: a beat is offered while the window holds
    its ``beat_bytes`` and taken from the window as it leaves.
    """

    def __init__(self, lanes: int):
        self.lanes = lanes
        super().__init__({
            "i": In(WindowSignature(4 * lanes)),
            "o": Out(stream.Signature(data.ArrayLayout(FP32_WIDTH, lanes))),
            "elem_bytes": In(range(5)),
            "beat_bytes": In(range(4 * lanes + 1)),
            "mode": In(2),
        })

    def elaborate(self, platform):
        m = Module()
        L = self.lanes
        window = self.i.data
        chunk = self.beat_bytes
        m.d.comb += [
            self.o.valid.eq((self.i.level >= chunk) & (chunk != 0)),
            self.i.take.eq(Mux(self.o.valid & self.o.ready, chunk, 0)),
        ]
        sign = self.mode == ASSEMBLE_MODES["sign_extend"]
        high = self.mode == ASSEMBLE_MODES["high_half"]
        for j in range(L):
            one = window[j]
            two = Cat(window[2 * j], window[2 * j + 1]) if 2 * j + 1 < 4 * L else Const(0, 16)
            four = Cat(*(window[4 * j + t] for t in range(4)))
            lane = Signal(FP32_WIDTH, name=f"lane{j}")
            with m.Switch(self.elem_bytes):
                with m.Case(1):
                    m.d.comb += lane.eq(Mux(sign, one.as_signed(), one))
                with m.Case(2):
                    m.d.comb += lane.eq(Mux(high, two << 16, Mux(sign, two.as_signed(), two)))
                with m.Default():
                    m.d.comb += lane.eq(four)
            m.d.comb += self.o.payload[j].eq(lane)
        return m


class WriteReplay(wiring.Component):
    """A WRITE's data, from the payload window, into the core's buffers.

    Ports: ``start`` (strobe, with ``plan`` valid: ``write_plan_layout``), ``done`` (strobe:
    the last beat has gone), ``i`` (``WindowSignature(4 * write_lanes(cfg))``: the data bytes
    in order), ``w`` (to the core), and the input quantizer's ``q_i``, ``q_o``,
    ``q_rounding``, ``q_seed``, ``q_clear`` (a pulse at ``start``).

    Codes, exponents, the accumulator and the bias go as ``w`` beats, row-major over the
    region: row chunks of ``rows`` lanes for A's codes, of ``cols`` lanes for B's codes, the
    accumulator and the bias, one exponent a beat. Values go through the quantizer (``q_i``
    beats of ``lanes`` (L, ``value_lanes``) fp32 elements, bf16 widened); its ``q_o`` codes go back
    to ``w`` as partial row chunks of L lanes (the lanes beyond L skipped), then one exponent
    beat per tile. Throughput: one beat a cycle while the window holds its bytes (``elem_bytes``
    times its elements: the link's N bytes a cycle feed a beat every ``ceil(bytes / N)``
    cycles).
    """

    def __init__(self, cfg: CoreConfig, lanes: int):
        self.cfg, self.lanes = cfg, lanes
        W, L = write_lanes(cfg), lanes
        super().__init__({
            "start": In(1),
            "plan": In(write_plan_layout(cfg)),
            "done": Out(1),
            "i": In(WindowSignature(4 * W)),
            "w": Out(stream.Signature(write_layout(cfg))),
            "q_i": Out(stream.Signature(data.ArrayLayout(FP32_WIDTH, L))),
            "q_o": In(stream.Signature(quantize_output_layout(cfg.mantissa_bits, L))),
            "q_rounding": Out(Rounding),
            "q_seed": Out(32),
            "q_clear": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        cfg, plan = self.cfg, self.plan
        D, W, L = cfg.size, write_lanes(cfg), self.lanes
        th, tw = cfg.tile
        m.submodules.assembler = asm = LaneAssembler(W)
        wiring.connect(m, wiring.flipped(self.i), asm.i)
        m.d.comb += [asm.elem_bytes.eq(plan.elem_bytes), asm.beat_bytes.eq(plan.beat_bytes), asm.mode.eq(plan.mode),
                     self.q_rounding.eq(plan.rounding), self.q_seed.eq(plan.seed),
                     self.q_clear.eq(self.start & plan.values)]

        running = Signal()
        # The next chunk's row and column; the region is done once the row passes its end.
        row = Signal(range(D + 1))
        col = Signal(range(D + 1))
        # Values: the tile being written (absolute row and column of its corner), the row
        # and column offset inside it, and its index in the exponent grid.
        v_row, v_col = Signal(range(D + 1)), Signal(range(D + 1))
        v_r, v_c = Signal(range(th)), Signal(range(tw))
        v_erow, v_ecol = Signal(range(D // th + 1)), Signal(range(D // tw + 1))
        v_exp = Signal()  # the tile's codes are written: its exponent goes next
        v_exponent = Signal(EXP_WIDTH)
        v_done = Signal()
        w_fire = self.w.valid & self.w.ready

        with m.If(self.start):
            m.d.sync += [running.eq(1), row.eq(plan.row), col.eq(plan.col),
                         v_row.eq(plan.row), v_col.eq(plan.col), v_r.eq(0), v_c.eq(0),
                         v_erow.eq(plan.erow), v_ecol.eq(plan.ecol), v_exp.eq(0), v_done.eq(plan.empty)]
        chunks_done = plan.empty | (row == plan.row_end)
        finished = Mux(plan.values, v_done, chunks_done)
        with m.If(running & finished):
            m.d.comb += self.done.eq(1)
            m.d.sync += running.eq(0)

        with m.If(running & ~plan.values):
            m.d.comb += [
                self.w.valid.eq(asm.o.valid & ~chunks_done),
                asm.o.ready.eq(self.w.ready & ~chunks_done),
                self.w.payload.target.eq(plan.target),
                self.w.payload.row.eq(row),
                self.w.payload.col.eq(col),
            ]
            for j in range(W):
                m.d.comb += self.w.payload.data[j].eq(asm.o.payload[j])
            with m.If(w_fire):
                m.d.sync += col.eq(col + plan.step)
                with m.If(col + plan.step == plan.col_end):
                    m.d.sync += [col.eq(plan.col), row.eq(row + 1)]
        # Paths to units a reduced device lacks are never taken (refused): not built.
        if cfg.value_quantizer:
            # The quantizer's key follows ``q_seed`` KEY_LATENCY cycles late: no value goes in
            # before (on a wide link the first beat may be ready within a cycle or two).
            key_wait = Signal(range(KEY_LATENCY + 1))
            with m.If(self.start):
                m.d.sync += key_wait.eq(KEY_LATENCY)
            with m.Elif(key_wait != 0):
                m.d.sync += key_wait.eq(key_wait - 1)
            with m.If(running & plan.values):
                m.d.comb += [
                    self.q_i.valid.eq(asm.o.valid & (key_wait == 0)),
                    asm.o.ready.eq(self.q_i.ready & (key_wait == 0)),
                ]
                for j in range(L):
                    m.d.comb += self.q_i.payload[j].eq(asm.o.payload[j])
                with m.If(v_exp):
                    m.d.comb += [
                        self.w.valid.eq(1),
                        self.w.payload.target.eq(plan.target + (Target.A_EXPONENTS - Target.A_CODES)),
                        self.w.payload.row.eq(v_erow),
                        self.w.payload.col.eq(v_ecol),
                        self.w.payload.data[0].eq(v_exponent),
                    ]
                    with m.If(w_fire):
                        m.d.sync += v_exp.eq(0)
                        with m.If(v_col + tw == plan.col_end):
                            m.d.sync += [v_col.eq(plan.col), v_ecol.eq(plan.ecol), v_row.eq(v_row + th),
                                         v_erow.eq(v_erow + 1)]
                            with m.If(v_row + th == plan.row_end):
                                m.d.sync += v_done.eq(1)
                        with m.Else():
                            m.d.sync += [v_col.eq(v_col + tw), v_ecol.eq(v_ecol + 1)]
                with m.Else():
                    m.d.comb += [
                        self.w.valid.eq(self.q_o.valid),
                        self.q_o.ready.eq(self.w.ready),
                        self.w.payload.target.eq(plan.target),
                        self.w.payload.row.eq(v_row + v_r),
                        self.w.payload.col.eq(v_col + v_c),
                        # A quantizer beat fills L lanes of the buffer's chunk (R or C lanes).
                        self.w.payload.skip.eq(Const((1 << W) - (1 << L), W)),
                    ]
                    for j in range(L):
                        m.d.comb += self.w.payload.data[j].eq(self.q_o.payload.codes[j])
                    with m.If(w_fire):
                        m.d.sync += v_c.eq(v_c + L)
                        with m.If(v_c == tw - L):
                            m.d.sync += [v_c.eq(0), v_r.eq(v_r + 1)]
                            with m.If(v_r == th - 1):
                                m.d.sync += [v_r.eq(0), v_exp.eq(1), v_exponent.eq(self.q_o.payload.exponent)]
        return m


class ResultSerializer(wiring.Component):
    """The core's output beats (``output_layout``; the first ``cfg.out_lanes`` lanes of each
    beat hold its values) to reply bytes, as docs/protocol.md lays out a GEMM result:
    ``out_format`` fp32 (4 bytes a value) or bf16 (2 bytes), row-major, only the first ``n``
    columns of each row (a row is ``ceil(n / out_lanes)`` beats whose lanes beyond ``n`` are
    padding); BFP tile-major (``th * tw / out_lanes`` beats a tile), every tile's exponent
    byte before its codes, 1 or 2 bytes a code (``cfg.mantissa_bits``), padding included.

    Ports: ``i`` (stream in), ``o`` (stream out, ``chunk_layout(result_chunk_bytes(cfg))``):
    a beat's bytes as one chunk, in order; ``out_format``, ``n``; ``start`` (strobe) rewinds
    the row and tile position before a result. Combinational: one beat a cycle (``i.ready``
    is ``o.ready``), so the padding lanes cost no cycles.
    """

    def __init__(self, cfg: CoreConfig):
        self.cfg = cfg
        self.code_bytes = 1 if cfg.mantissa_bits <= 8 else 2
        self.lanes = cfg.out_lanes
        th, tw = cfg.tile
        if (th * tw) % self.lanes or cfg.cols % self.lanes:
            raise ValueError(f"out_lanes {self.lanes} must divide cols and the tile")
        super().__init__({
            "i": In(stream.Signature(output_layout(cfg))),
            "o": Out(stream.Signature(chunk_layout(result_chunk_bytes(cfg)))),
            "out_format": In(2),
            "n": In(range(cfg.size + 1)),
            "start": In(1),
        })

    def elaborate(self, platform):
        m = Module()
        cfg, L, cb = self.cfg, self.lanes, self.code_bytes
        th, tw = cfg.tile
        beats_per_tile = th * tw // L
        R = result_chunk_bytes(cfg)
        cols_left = Signal(range(cfg.size + 1))  # columns of the row from this beat on
        tile_beat = Signal(range(beats_per_tile))
        bfp = self.out_format == OutFormat.BFP if cfg.bfp_output else Const(0)
        bf16 = self.out_format == OutFormat.BF16
        lanes = self.i.payload.lanes
        lanes_here = Signal(range(L + 1))
        m.d.comb += lanes_here.eq(Mux(bfp | (cols_left >= L), L, cols_left))
        exp_first = Signal()
        m.d.comb += exp_first.eq(bfp & (tile_beat == 0))
        body = Signal(8 * 4 * L)
        with m.If(bfp):
            m.d.comb += body.eq(Cat(*(lanes[j][:8 * cb] for j in range(L))))
        with m.Elif(bf16):
            m.d.comb += body.eq(Cat(*(lanes[j][:BF16_WIDTH] for j in range(L))))
        with m.Else():
            m.d.comb += body.eq(Cat(*(lanes[j] for j in range(L))))
        bytes_per_lane = Mux(bfp, cb, Mux(bf16, 2, 4))
        m.d.comb += [
            self.o.valid.eq(self.i.valid),
            self.i.ready.eq(self.o.ready),
            self.o.payload.data.eq(Mux(exp_first, Cat(self.i.payload.exponent, body), body)[:8 * R]),
            self.o.payload.count.eq(exp_first + lanes_here * bytes_per_lane),
        ]
        with m.If(self.start):
            m.d.sync += [cols_left.eq(self.n), tile_beat.eq(0)]
        with m.Elif(self.o.valid & self.o.ready):
            with m.If(cols_left <= L):
                m.d.sync += cols_left.eq(self.n)
            with m.Else():
                m.d.sync += cols_left.eq(cols_left - L)
            with m.If(tile_beat == beats_per_tile - 1):
                m.d.sync += tile_beat.eq(0)
            with m.Else():
                m.d.sync += tile_beat.eq(tile_beat + 1)
        return m


class ReplyFramer(wiring.Component):
    """Frames a reply: ``header`` (opcode with the reply bit already set, tag, payload length)
    starts a frame; the magic, version, opcode, tag and length go out, then exactly ``length``
    payload bytes taken from the window ``i``, then the CRC-32 of all of them.

    Ports: ``header`` (stream in), ``i`` (``WindowSignature(N)``), ``o`` (stream out,
    ``reply_chunk_layout(N)``: ``last`` on the chunk with the CRC's final byte).
    Throughput: the 10 header bytes and the 4 CRC bytes go N a chunk; the payload a full
    chunk of N bytes a cycle, taken as soon as the window holds N (or the payload's rest).
    The next ``header`` is accepted once the previous CRC has left.
    """

    def __init__(self, stream_bytes: int):
        self.stream_bytes = stream_bytes
        super().__init__({
            "header": In(stream.Signature(REPLY_HEADER)),
            "i": In(WindowSignature(stream_bytes)),
            "o": Out(stream.Signature(reply_chunk_layout(stream_bytes))),
        })

    def elaborate(self, platform):
        m = Module()
        N = self.stream_bytes
        H, T = protocol.HEADER.size, protocol.CRC_SIZE
        m.submodules.crc = crc = ParallelCRC32(N)
        head = Signal(self.header.payload.shape())
        index = Signal(range(H + N + 1))
        left = Signal(32)
        head_bytes = Cat(Const(protocol.MAGIC_WORD, 16), Const(protocol.PROTOCOL_VERSION, 8), head.opcode, head.tag,
                         head.length)
        fire = self.o.valid & self.o.ready
        k = Signal(range(N + 1))  # bytes of this chunk
        m.d.comb += [
            crc.clear.eq(self.header.valid & self.header.ready),
            crc.i.payload.data.eq(self.o.payload.data),
            crc.i.payload.count.eq(k),
            self.o.payload.count.eq(k),
        ]
        with m.FSM():
            with m.State("IDLE"):
                m.d.comb += self.header.ready.eq(1)
                with m.If(self.header.valid):
                    m.d.sync += [head.eq(self.header.payload), left.eq(self.header.payload.length), index.eq(0)]
                    m.next = "HEAD"
            with m.State("HEAD"):
                m.d.comb += [
                    k.eq(_min(H - index, N)),
                    self.o.valid.eq(1),
                    crc.i.valid.eq(fire),
                    self.o.payload.data.eq((head_bytes >> (index * 8))[:8 * N]),
                ]
                with m.If(fire):
                    m.d.sync += index.eq(index + k)
                    with m.If(index + k == H):
                        m.d.sync += index.eq(0)
                        m.next = "PAYLOAD"
                        with m.If(left == 0):
                            m.next = "CRC"
            with m.State("PAYLOAD"):
                want = _min(left, N)
                m.d.comb += [
                    k.eq(want),
                    self.o.valid.eq(self.i.level >= want),
                    crc.i.valid.eq(fire),
                    self.o.payload.data.eq(self.i.data),
                    self.i.take.eq(Mux(fire, want, 0)),
                ]
                with m.If(fire):
                    m.d.sync += left.eq(left - want)
                    with m.If(left == want):
                        m.next = "CRC"
            with m.State("CRC"):
                m.d.comb += [
                    k.eq(_min(T - index, N)),
                    self.o.valid.eq(1),
                    self.o.payload.data.eq((crc.crc >> (index * 8))[:8 * N]),
                    self.o.payload.last.eq(index + k == T),
                ]
                with m.If(fire):
                    m.d.sync += index.eq(index + k)
                    with m.If(index + k == T):
                        m.next = "IDLE"
        return m


class StatusCounters(wiring.Component):
    """The STATUS counters (docs/protocol.md, 0x06): the replies with status OK (``accepted``)
    and the others (``refused``; ``last_error``, the last one's status), and the cycles of the
    last GEMM or READ (``last_cycles``).

    Ports: ``count`` (strobe: a reply of status ``status`` counts), ``clear`` (strobe: RESET
    zeroes them all, after its own reply counted), ``capture`` (strobe: ``cycles`` becomes the
    last cycles); ``record`` (STATUS's reply data, ``layout(protocol.STATUS)``).
    """

    def __init__(self):
        super().__init__({
            "count": In(1),
            "status": In(8),
            "clear": In(1),
            "capture": In(1),
            "cycles": In(32),
            "record": Out(layout(protocol.STATUS)),
        })

    def elaborate(self, platform):
        m = Module()
        accepted, refused, last_cycles, last_error = Signal(32), Signal(32), Signal(32), Signal(8)
        with m.If(self.count):
            with m.If(self.status == Status.OK):
                m.d.sync += accepted.eq(accepted + 1)
            with m.Else():
                m.d.sync += [refused.eq(refused + 1), last_error.eq(self.status)]
        with m.If(self.clear):
            m.d.sync += [accepted.eq(0), refused.eq(0), last_cycles.eq(0), last_error.eq(0)]
        with m.If(self.capture):
            m.d.sync += last_cycles.eq(self.cycles)
        m.d.comb += [self.record.accepted.eq(accepted), self.record.refused.eq(refused),
                     self.record.last_cycles.eq(last_cycles), self.record.last_error.eq(last_error)]
        return m


class ElementwiseFeed(wiring.Component):
    """ELEMENTWISE's operands to the activation unit: x from window ``x`` (and g, for a
    gradient function, from window ``g``), two bytes each, a beat a cycle while both hold
    theirs.

    Ports: ``enable`` (the frame is an ELEMENTWISE), ``gradient``, ``func`` (the plan's);
    ``x`` (``WindowSignature(width)``, its ``take`` for the engine to select), ``g``
    (``WindowSignature(2)``); ``o`` (stream out, ``ACTIVATION_INPUT``). Combinational.
    """

    def __init__(self, width: int):
        super().__init__({
            "enable": In(1),
            "gradient": In(1),
            "func": In(FUNC_WIDTH),
            "x": In(WindowSignature(width)),
            "g": In(WindowSignature(2)),
            "o": Out(stream.Signature(ACTIVATION_INPUT)),
        })

    def elaborate(self, platform):
        m = Module()
        x, g, feed = self.x, self.g, self.o
        ready_g = ~self.gradient | (g.level >= 2)
        m.d.comb += [
            feed.valid.eq(self.enable & (x.level >= 2) & ready_g),
            feed.payload.x.eq(Cat(x.data[0], x.data[1])),
            feed.payload.g.eq(Cat(g.data[0], g.data[1])),
            feed.payload.func.eq(self.func),
        ]
        fed = feed.valid & feed.ready
        m.d.comb += [x.take.eq(Mux(fed, 2, 0)), g.take.eq(Mux(fed & self.gradient, 2, 0))]
        return m


class ReplySender(wiring.Component):
    """A reply: the header to the ``ReplyFramer`` (opcode, tag and the payload's length), then
    the payload as chunks of up to R bytes (R = ``max(N, result_chunk_bytes(cfg), 2)``): the
    status byte, ``plan.stream`` bytes from ``act`` (ELEMENTWISE: two bytes a result) or
    ``result`` (GEMM and READ: the ``ResultSerializer``'s chunks, as the core gives them), then
    ``plan.fixed`` bytes of ``fixed`` (IDENTIFY's identity, STATUS's record, GEMM's cycles after
    its result).

    Ports: ``start`` (strobe: the header goes from the next cycle on), ``plan``
    (``plan_layout``), ``fixed`` (read in the payload's last chunks); ``act``, ``result``
    (streams in); ``header``, ``o`` (streams out); ``done`` (strobe: the payload's last chunk
    has gone, the cycle after).
    """

    def __init__(self, cfg: CoreConfig, *, stream_bytes: int, max_payload: int):
        self.cfg, self.stream_bytes = cfg, stream_bytes
        self.chunk_bytes = max(stream_bytes, result_chunk_bytes(cfg), 2)
        super().__init__({
            "start": In(1),
            "plan": In(plan_layout(cfg, stream_bytes, max_payload)),
            "fixed": In(8 * FIXED_BYTES),
            "act": In(stream.Signature(BF16_WIDTH)),
            "result": In(stream.Signature(chunk_layout(result_chunk_bytes(cfg)))),
            "header": Out(stream.Signature(REPLY_HEADER)),
            "o": Out(stream.Signature(chunk_layout(self.chunk_bytes))),
            "done": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        R, plan, src = self.chunk_bytes, self.plan, self.o
        fixed_index = Signal(range(FIXED_BYTES + 1))
        fixed_left = Signal(range(FIXED_BYTES + 1))  # plan.fixed - fixed_index, kept (no subtraction before the window)
        stream_left = Signal(32)
        fixed_k = Signal(range(R + 1))
        m.d.comb += fixed_k.eq(_min(fixed_left, R))
        m.d.comb += [
            self.header.payload.opcode.eq(plan.opcode),
            self.header.payload.tag.eq(plan.tag),
            self.header.payload.length.eq(1 + plan.fixed + plan.stream),
        ]
        pushed = src.valid & src.ready
        with m.FSM():
            with m.State("IDLE"):
                with m.If(self.start):
                    m.next = "HEADER"
            with m.State("HEADER"):
                m.d.comb += self.header.valid.eq(1)
                with m.If(self.header.ready):
                    m.d.sync += [fixed_index.eq(0), fixed_left.eq(plan.fixed), stream_left.eq(plan.stream)]
                    m.next = "STATUS"
            with m.State("STATUS"):
                m.d.comb += [src.valid.eq(1), src.payload.data[0].eq(plan.status), src.payload.count.eq(1)]
                with m.If(src.ready):
                    with m.If(plan.stream != 0):
                        m.next = "STREAM"
                    with m.Elif(plan.fixed != 0):
                        m.next = "FIXED"
                    with m.Else():
                        m.next = "DONE"
            with m.State("STREAM"):
                with m.If(plan.action == Action.ELEMENTWISE):
                    m.d.comb += [
                        src.valid.eq(self.act.valid),
                        src.payload.data[0].eq(self.act.payload[:8]),
                        src.payload.data[1].eq(self.act.payload[8:]),
                        src.payload.count.eq(2),
                        self.act.ready.eq(src.ready),
                    ]
                with m.Else():
                    m.d.comb += [
                        src.valid.eq(self.result.valid),
                        src.payload.data.eq(self.result.payload.data),
                        src.payload.count.eq(self.result.payload.count),
                        self.result.ready.eq(src.ready),
                    ]
                with m.If(pushed):
                    m.d.sync += stream_left.eq(stream_left - src.payload.count)
                    with m.If(stream_left == src.payload.count):
                        m.next = "FIXED"
                        with m.If(plan.fixed == 0):
                            m.next = "DONE"
            with m.State("FIXED"):
                m.d.comb += [src.valid.eq(1), src.payload.data.eq((self.fixed >> (fixed_index * 8))[:8 * R]),
                             src.payload.count.eq(fixed_k)]
                with m.If(src.ready):
                    m.d.sync += [fixed_index.eq(fixed_index + fixed_k), fixed_left.eq(fixed_left - fixed_k)]
                    with m.If(fixed_left == fixed_k):
                        m.next = "DONE"
            with m.State("DONE"):
                m.d.comb += self.done.eq(1)
                m.next = "IDLE"
        return m


class Dispatch(wiring.Component):
    """The packet engine's state machine: a received frame's plan, its execution, its reply.

    A frame offered by the receiver (``received``) is decided ``FrameChecker.LATENCY`` cycles
    later (``check``, registered as ``plan``); the reply counts in STATUS (``count``) the next
    cycle, and RESET then zeroes the counters (``clear``). Then, by ``plan.action``: WRITE
    starts the payload's reader and replay (``read``, ``replay``) and waits for the replay's end
    (``replayed``); GEMM and READ run the core's command (``cmd_valid``, ``cmd_ready``) and
    start the reply as the core accepts it, so that its output goes into the reply as the rows
    close, and take the core's cycles (``capture``) once the reply has gone; ELEMENTWISE starts
    the reader. A frame is released (``release``) as it is decided: the receiver takes the next
    one into the payload buffer's other slot while this one is executed and answered; the
    next is decided in the cycle after this reply's last chunk (``reply``: ``ReplySender``;
    ``replied``), while the framer still sends its last bytes.
    """

    def __init__(self, cfg: CoreConfig, *, stream_bytes: int, max_payload: int):
        super().__init__({
            "received": In(1),
            "release": Out(1),
            "check": In(plan_layout(cfg, stream_bytes, max_payload)),
            "plan": Out(plan_layout(cfg, stream_bytes, max_payload)),
            "count": Out(1),
            "clear": Out(1),
            "capture": Out(1),
            "read": Out(1),
            "replay": Out(1),
            "replayed": In(1),
            "cmd_valid": Out(1),
            "cmd_ready": In(1),
            "reply": Out(1),
            "replied": In(1),
        })

    def elaborate(self, platform):
        m = Module()
        plan = self.plan
        assert FrameChecker.LATENCY >= 2
        check_wait = Signal(range(FrameChecker.LATENCY))
        with m.FSM():
            with m.State("IDLE"):
                m.d.sync += check_wait.eq(FrameChecker.LATENCY - 2)
                with m.If(self.received):
                    m.next = "CHECK"
            with m.State("CHECK"):  # the checker's stages but its last
                m.d.sync += check_wait.eq(check_wait - 1)
                with m.If(check_wait == 0):
                    m.next = "DECIDE"
            with m.State("DECIDE"):  # the frame offered LATENCY cycles ago: its plan is valid
                m.d.comb += self.release.eq(1)  # the receiver goes on into the other slot
                m.d.sync += plan.eq(self.check)
                m.next = "DISPATCH"
            with m.State("DISPATCH"):
                m.d.comb += self.count.eq(1)
                with m.Switch(plan.action):
                    with m.Case(Action.WRITE):
                        m.d.comb += [self.read.eq(1), self.replay.eq(1)]
                        m.next = "WRITE"
                    with m.Case(Action.CORE):
                        m.next = "CORE_RUN"
                    with m.Case(Action.ELEMENTWISE):
                        m.d.comb += [self.read.eq(1), self.reply.eq(1)]
                        m.next = "REPLY"
                    with m.Case(Action.RESET):
                        m.d.comb += [self.clear.eq(1), self.reply.eq(1)]
                        m.next = "REPLY"
                    with m.Default():
                        m.d.comb += self.reply.eq(1)
                        m.next = "REPLY"
            with m.State("WRITE"):
                with m.If(self.replayed):
                    m.d.comb += self.reply.eq(1)
                    m.next = "REPLY"
            with m.State("CORE_RUN"):
                m.d.comb += self.cmd_valid.eq(1)
                with m.If(self.cmd_ready):
                    m.d.comb += self.reply.eq(1)
                    m.next = "REPLY"
            with m.State("REPLY"):
                with m.If(self.replied):
                    # After the result: the core's count stopped with its last sums.
                    m.d.comb += self.capture.eq(plan.action == Action.CORE)
                    m.next = "IDLE"
        return m


class PacketEngine(wiring.Component):
    """The protocol engine (docs/protocol.md) on a link of ``stream_bytes`` (N) bytes a cycle.

    Ports: ``i`` (``WindowSignature(N)``: the link's bytes, from a ``hw.link.ByteWindow``),
    ``o`` (stream out, ``reply_chunk_layout(N)``: reply bytes, ``last`` on each reply's final
    chunk); the GEMM core's ``w``, ``cmd``, ``result``, ``core_cycles``; the input quantizer's
    ``q_i``, ``q_o``, ``q_rounding``, ``q_seed``, ``q_clear``; the activation unit's ``act_i``,
    ``act_o``.

    Receiving (``FrameReceiver``): the magic and header a byte a cycle, the payload N bytes a
    cycle into one of the buffer's two slots of ``max_payload`` bytes in N-byte words (the
    next frame arrives in the other while this one executes), never stalling ``i`` inside a
    frame; nothing is executed before the CRC has checked: a corrupted WRITE changes no
    buffer (the reply is BAD_CRC and the host simply sends it again).

    Deciding (``FrameChecker``; registered ``FrameChecker.LATENCY`` cycles after the receiver hands a frame over):
    the status and the plan. A length beyond ``max_payload`` is refused as soon as the
    header is in, and then ``length + 4`` bytes are skipped (or until ``frame_timeout`` cycles
    pass without a byte); a frame that stops for ``frame_timeout`` cycles after its magic gets
    a TIMEOUT reply with tag 0xFFFF and the opcode as far as it arrived (0x80 if not).

    Executing:

    - WRITE replays the data from the buffer (``PayloadReader`` -> a window ->
      ``WriteReplay``): up to a row chunk a cycle, as ``w`` beats to the core or through the
      input quantizer; the reply goes out after the last beat.
    - GEMM and READ run the core's command once, its output through the ``ResultSerializer``
      into the reply as the core's epilogue gives it (each row-block's rows as they close,
      while the next row-block is computed), at the reply's pace; GEMM's ``cycles`` follow the
      result. They are the core's count until its last sums were in the accumulator, which the
      host's pace does not change (the MAC phase never waits on the epilogue), and STATUS
      keeps them (a READ's: 0).
    - ELEMENTWISE streams x (and g, from its own window) through ``act_i``, and ``act_o``
      into the reply, two bytes a result.
    - IDENTIFY, STATUS, RESET reply from registers. Every reply counts in STATUS the cycle
      after its status is decided, from the registered plan (so a STATUS reply counts
      itself); RESET then zeroes the counters, the last error and the last cycles
      (``StatusCounters``).

    ``Dispatch`` sequences these steps. Replying (``ReplySender``): every payload byte passes a window of ``result_chunk_bytes`` + N bytes in
    front of the ``ReplyFramer``, which sends N a cycle. Throughput: N bytes a cycle each way
    in a payload (a GEMM's result as fast as the core's epilogue gives it, up to N).
    """

    def __init__(self, cfg: CoreConfig, *, stream_bytes: int = 1, clock_hz: int = 0,
                 max_payload: int = DEFAULT_MAX_PAYLOAD, frame_timeout: int = DEFAULT_FRAME_TIMEOUT):
        self.cfg = cfg
        self.stream_bytes = stream_bytes
        self.clock_hz = clock_hz
        self.max_payload = max_payload
        self.frame_timeout = frame_timeout
        self.functions = cfg.built_functions
        N, L = stream_bytes, value_lanes(cfg, stream_bytes)
        super().__init__({
            "i": In(WindowSignature(N)),
            "o": Out(stream.Signature(reply_chunk_layout(N))),
            # GemmCore
            "w": Out(stream.Signature(write_layout(cfg))),
            "cmd": Out(stream.Signature(command_layout(cfg))),
            "result": In(stream.Signature(output_layout(cfg))),
            "core_cycles": In(32),
            # the input Quantize
            "q_i": Out(stream.Signature(data.ArrayLayout(FP32_WIDTH, L))),
            "q_o": In(stream.Signature(quantize_output_layout(cfg.mantissa_bits, L))),
            "q_rounding": Out(Rounding),
            "q_seed": Out(32),
            "q_clear": Out(1),
            # the Activation unit
            "act_i": Out(stream.Signature(ACTIVATION_INPUT)),
            "act_o": In(stream.Signature(BF16_WIDTH)),
        })

    def identity(self) -> bytes:
        """The 32 bytes of the IDENTIFY reply's data."""
        return DeviceSpec(self.cfg, stream_bytes=self.stream_bytes, clock_hz=self.clock_hz,
                          max_payload=self.max_payload, frame_timeout=self.frame_timeout).identity().encode()

    def elaborate(self, platform):
        m = Module()
        cfg = self.cfg
        N, P = self.stream_bytes, self.max_payload

        m.submodules.receiver = rx = FrameReceiver(N, P, self.frame_timeout)
        m.submodules.checker = checker = FrameChecker(cfg, stream_bytes=N, max_payload=P)
        m.submodules.dispatch = dispatch = Dispatch(cfg, stream_bytes=N, max_payload=P)
        m.submodules.reader = reader = PayloadReader(N, P)
        # x (and WRITE data) and g. Their default depths keep ELEMENTWISE from deadlocking:
        # the reader alternates words between them, so while one window is too full to take
        # a word, the other holds at least the 2 bytes of the next element.
        # On a 1-byte link window a collects one beat (or element) at a time: no shifter.
        if N == 1:
            m.submodules.window_a = win_a = ByteCollector(4 * write_lanes(cfg))
        else:
            m.submodules.window_a = win_a = ByteWindow(N, 4 * write_lanes(cfg))
        m.submodules.window_b = win_b = ByteWindow(N, 2)
        m.submodules.replay = replay = WriteReplay(cfg, value_lanes(cfg, N))
        m.submodules.serializer = ser = ResultSerializer(cfg)
        m.submodules.counters = counters = StatusCounters()
        m.submodules.sender = sender = ReplySender(cfg, stream_bytes=N, max_payload=P)
        # The reply's chunks pass a register before the window, so that the dispatch's choice
        # of source (and the sources' own handshakes) and the window's shift are in different cycles.
        m.submodules.reply_register = reply_register = StreamRegister(chunk_layout(sender.chunk_bytes))
        m.submodules.reply_window = reply = ByteWindow(sender.chunk_bytes, N)
        m.submodules.framer = framer = ReplyFramer(N)
        # Two slots of max_payload bytes: a frame arrives in one while the one before it is
        # executed from the other (``FrameReceiver``); ``exec_slot``: the decided frame's.
        W = _words(P, N)
        m.submodules.payload = buf = BlockRam(8 * N, 2 * W, stall=True)
        buf_wr, buf_rd = buf.write, buf.read0
        exec_slot = Signal()
        with m.If(dispatch.release):
            m.d.sync += exec_slot.eq(rx.slot)

        def in_slot(addr, slot):
            return Cat(addr, slot) if W & (W - 1) == 0 else addr + Mux(slot, W, 0)

        wiring.connect(m, wiring.flipped(self.i), rx.i)
        wiring.connect(m, sender.o, reply_register.i)
        wiring.connect(m, reply_register.o, reply.i)
        wiring.connect(m, reply.o, framer.i)
        wiring.connect(m, sender.header, framer.header)
        wiring.connect(m, framer.o, wiring.flipped(self.o))
        wiring.connect(m, reader.a, win_a.i)
        wiring.connect(m, reader.b, win_b.i)
        m.d.comb += [
            buf_wr.en.eq(rx.store.en), buf_wr.addr.eq(in_slot(rx.store.addr, rx.slot)), buf_wr.data.eq(rx.store.data),
            buf_rd.en.eq(reader.rd_en), buf_rd.addr.eq(in_slot(reader.rd_addr, exec_slot)),
            reader.rd_data.eq(buf_rd.data),
            checker.frame.eq(rx.frame.payload),
        ]

        # ---- the dispatch: a frame's plan, its execution and its reply -----------------------
        plan = dispatch.plan
        m.d.comb += [
            dispatch.received.eq(rx.frame.valid), rx.frame.ready.eq(dispatch.release), dispatch.check.eq(checker.plan),
            reader.start.eq(dispatch.read), reader.plan.eq(plan.read),
            replay.start.eq(dispatch.replay), replay.plan.eq(plan.write), dispatch.replayed.eq(replay.done),
        ]

        # ---- WRITE: window a into the replay ---------------------------------------------
        wiring.connect(m, replay.w, wiring.flipped(self.w))
        wiring.connect(m, replay.q_i, wiring.flipped(self.q_i))
        wiring.connect(m, wiring.flipped(self.q_o), replay.q_o)
        m.d.comb += [
            replay.i.data.eq(win_a.o.data), replay.i.level.eq(win_a.o.level), replay.i.arrived.eq(win_a.o.arrived),
            self.q_rounding.eq(replay.q_rounding), self.q_seed.eq(replay.q_seed), self.q_clear.eq(replay.q_clear),
        ]
        elementwise = plan.action == Action.ELEMENTWISE
        if N == 1:  # what the consumer of window a takes at once: a beat, or an element's x
            m.d.comb += win_a.limit.eq(Mux(elementwise, 2, plan.write.beat_bytes))

        # ---- ELEMENTWISE: x (and g) from their windows, a result a cycle --------------------
        if self.functions:
            m.submodules.feed = feed = ElementwiseFeed(4 * write_lanes(cfg))
            wiring.connect(m, feed.o, wiring.flipped(self.act_i))
            wiring.connect(m, win_b.o, feed.g)
            m.d.comb += [
                feed.enable.eq(elementwise), feed.gradient.eq(plan.gradient), feed.func.eq(plan.e_func),
                feed.x.data.eq(win_a.o.data), feed.x.level.eq(win_a.o.level),
                win_a.o.take.eq(Mux(elementwise, feed.x.take, replay.i.take)),
            ]
        else:
            m.d.comb += win_a.o.take.eq(replay.i.take)

        # ---- GEMM and READ: the core's command, its output into the reply ----------------------
        m.d.comb += [
            self.cmd.valid.eq(dispatch.cmd_valid), dispatch.cmd_ready.eq(self.cmd.ready),
            self.cmd.payload.eq(plan.cmd),
            ser.out_format.eq(plan.cmd.out_format),
            ser.n.eq(plan.cmd.n),
            ser.start.eq(self.cmd.valid & self.cmd.ready),
        ]
        wiring.connect(m, wiring.flipped(self.result), ser.i)

        # ---- STATUS counters (docs/protocol.md, 0x06): every reply counts once, the cycle
        # after its status is decided (from the plan's register, not the checker's last
        # stage); a STATUS reply thus counts itself, and RESET's zeroing comes after its count.
        m.d.comb += [counters.count.eq(dispatch.count), counters.status.eq(plan.status),
                     counters.clear.eq(dispatch.clear), counters.capture.eq(dispatch.capture),
                     counters.cycles.eq(self.core_cycles)]

        # ---- the reply: status, the stream, then fixed bytes ---------------------------------
        op = plan.opcode[:7]  # the request's opcode (the reply bit cleared)
        identity = int.from_bytes(self.identity(), "little")
        m.d.comb += [
            sender.start.eq(dispatch.reply), sender.plan.eq(plan),
            sender.fixed.eq(Mux(op == Op.IDENTIFY, Const(identity, 8 * FIXED_BYTES),
                                Mux(op == Op.STATUS, counters.record, self.core_cycles))),
            dispatch.replied.eq(sender.done),
        ]
        wiring.connect(m, wiring.flipped(self.act_o), sender.act)
        wiring.connect(m, ser.o, sender.result)
        return m
