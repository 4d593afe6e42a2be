"""The packet engine: the device side of the wire protocol (docs/protocol.md).

Bytes come in one per cycle; the engine hunts for the magic, takes the header, stores the
payload in a ``max_payload``-byte buffer while it runs the CRC, and acts on a frame only
after its CRC has checked and its fields have been validated. It then drives the GEMM core
(writes and commands), the input quantizer (WRITE of values) and an activation unit
(ELEMENTWISE), and sends exactly one reply per frame, whose CRC it computes on the way out.

Components, each with stream ports:

- ``ByteUnpacker`` / ``BytePacker``: the AXI-stream-style beats of the top's ports (``data``
  lanes and a ``keep`` mask) to and from one byte per cycle;
- ``ReplyFramer``: magic, header, payload bytes and CRC of a reply;
- ``LaneAssembler``: payload bytes to beats of 32-bit lanes (codes sign-extended, fp32 as is,
  bf16 widened to fp32);
- ``ResultSerializer``: the core's output beats to the reply layout (fp32 or bf16 row-major
  without the padding lanes, BFP tile-major with each tile's exponent byte first);
- ``PacketEngine``: the protocol state machine around those.
"""

from __future__ import annotations

from amaranth import Cat, Const, Module, Mux, Signal, signed, unsigned
from amaranth.lib import data, memory, stream, wiring
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
from .crc import CRC32, crc32_state
from .gemm_core import command_layout, output_layout, write_layout
from .params import BF16_WIDTH, EXP_WIDTH, FP32_WIDTH, CoreConfig, layout

__all__ = [
    "BYTE",
    "beat_layout",
    "quantize_output_layout",
    "ByteUnpacker",
    "BytePacker",
    "ReplyFramer",
    "LaneAssembler",
    "ResultSerializer",
    "PacketEngine",
    "ASSEMBLE_MODES",
    "DESCRIPTOR_BYTES",
]

#: Fixed payload sizes of the commands, from the contract's descriptors: WRITE's header
#: before its data, READ's and GEMM's descriptors, ELEMENTWISE's header before x (and g).
WRITE_HEADER = protocol.WRITE.size
READ_SIZE = protocol.READ.size
GEMM_SIZE = protocol.GEMM.size
ELEMENTWISE_HEADER = protocol.ELEMENTWISE.size

#: A byte of a reply on its way out: ``last`` marks the final byte of a frame.
BYTE = data.StructLayout({"data": 8, "last": 1})
#: Payload bytes the engine keeps in registers (the longest command descriptor, WRITE's).
DESCRIPTOR_BYTES = max(WRITE_HEADER, READ_SIZE, GEMM_SIZE, ELEMENTWISE_HEADER)
#: ``LaneAssembler`` modes: how an element's bytes fill its 32-bit lane.
ASSEMBLE_MODES = {"sign_extend": 0, "raw": 1, "high_half": 2}


def beat_layout(stream_bytes: int) -> data.StructLayout:
    """One beat of the top's ``i``/``o`` ports: ``data`` lanes (lane 0 first on the wire) and
    the ``keep`` mask (bit b: lane b holds a byte)."""
    return data.StructLayout({"data": data.ArrayLayout(8, stream_bytes), "keep": stream_bytes})


def quantize_output_layout(mantissa_bits: int, lanes: int) -> data.StructLayout:
    """The output payload of ``hw.quantize.Quantize`` (its ``out_layout``)."""
    return data.StructLayout({
        "codes": data.ArrayLayout(signed(mantissa_bits), lanes),
        "exponent": unsigned(EXP_WIDTH),
        "last": unsigned(1),
    })


def _lowest_set(mask: Signal, width: int):
    """Index of the lowest set bit of ``mask`` (0 when none): a priority encoder."""
    index = Const(0, range(width))
    for b in reversed(range(width)):
        index = Mux(mask[b], b, index)
    return index


class ByteUnpacker(wiring.Component):
    """Beats of ``stream_bytes`` lanes (``beat_layout``) in, their kept bytes out in lane
    order, one per cycle. A beat with an empty ``keep`` is dropped.

    Throughput: one byte per cycle; a beat of k kept bytes takes k cycles, and the next beat
    is accepted in the cycle its last byte leaves (no bubble). Latency 1 cycle (the beat is
    registered), 0 for ``stream_bytes`` = 1 (wires).
    """

    def __init__(self, stream_bytes: int):
        self.stream_bytes = stream_bytes
        super().__init__({
            "i": In(stream.Signature(beat_layout(stream_bytes))),
            "o": Out(stream.Signature(8)),
        })

    def elaborate(self, platform):
        m = Module()
        n = self.stream_bytes
        if n == 1:
            m.d.comb += [
                self.o.valid.eq(self.i.valid & self.i.payload.keep[0]),
                self.o.payload.eq(self.i.payload.data[0]),
                self.i.ready.eq(self.o.ready | ~self.i.payload.keep[0]),
            ]
            return m
        held = Signal(data.ArrayLayout(8, n))
        left = Signal(n)  # lanes of ``held`` still to send
        first = _lowest_set(left, n)
        rest = Signal(n)
        m.d.comb += [
            rest.eq(left & (left - 1)),
            self.o.valid.eq(left != 0),
            self.o.payload.eq(held[first]),
            self.i.ready.eq((left == 0) | (self.o.ready & (rest == 0))),
        ]
        with m.If(self.i.valid & self.i.ready):
            m.d.sync += [held.eq(self.i.payload.data), left.eq(self.i.payload.keep)]
        with m.Elif(self.o.valid & self.o.ready):
            m.d.sync += left.eq(rest)
        return m


class BytePacker(wiring.Component):
    """Bytes (``BYTE``: ``data``, ``last``) in, beats of ``stream_bytes`` lanes out: lanes fill
    from lane 0, and a frame's ``last`` byte sends its beat at once with the unused lanes'
    ``keep`` bits clear (a reply never waits in a half-full beat).

    Throughput: one byte per cycle (a full beat every ``stream_bytes`` cycles); the filling
    beat and the beat on offer are separate registers. Latency 1 cycle after a beat's last
    byte; wires for ``stream_bytes`` = 1.
    """

    def __init__(self, stream_bytes: int):
        self.stream_bytes = stream_bytes
        super().__init__({
            "i": In(stream.Signature(BYTE)),
            "o": Out(stream.Signature(beat_layout(stream_bytes))),
        })

    def elaborate(self, platform):
        m = Module()
        n = self.stream_bytes
        if n == 1:
            m.d.comb += [
                self.o.valid.eq(self.i.valid),
                self.o.payload.data[0].eq(self.i.payload.data),
                self.o.payload.keep.eq(1),
                self.i.ready.eq(self.o.ready),
            ]
            return m
        fill = Signal(data.ArrayLayout(8, n))
        count = Signal(range(n))
        # An accepted byte may complete a beat, which needs the output register: accept only
        # when that register is free or leaving (ready does not depend on the byte's value).
        m.d.comb += self.i.ready.eq(~self.o.valid | self.o.ready)
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += self.o.valid.eq(0)
        with m.If(self.i.valid & self.i.ready):
            complete = self.i.payload.last | (count == n - 1)
            with m.If(complete):
                for b in range(n):
                    m.d.sync += self.o.payload.data[b].eq(Mux(count == b, self.i.payload.data, fill[b]))
                m.d.sync += [
                    self.o.payload.keep.eq((Const(2, n + 1) << count) - 1),
                    self.o.valid.eq(1),
                    count.eq(0),
                ]
            with m.Else():
                m.d.sync += [fill[count].eq(self.i.payload.data), count.eq(count + 1)]
        return m


class ReplyFramer(wiring.Component):
    """Frames a reply: ``header`` (opcode with the reply bit already set, tag, payload length)
    starts a frame; the magic, version, opcode, tag and length go out, then exactly ``length``
    bytes taken from ``i``, then the CRC-32 of all of them (``last`` on its final byte).

    Throughput: one byte per cycle; ``i`` passes straight through (``i.ready`` is
    ``o.ready`` while the payload flows). A frame costs ``length`` + 14 cycles; the next
    ``header`` is accepted once the previous CRC has left.
    """

    def __init__(self):
        super().__init__({
            "header": In(stream.Signature(data.StructLayout({"opcode": 8, "tag": 16, "length": 32}))),
            "i": In(stream.Signature(8)),
            "o": Out(stream.Signature(BYTE)),
        })

    def elaborate(self, platform):
        m = Module()
        m.submodules.crc = crc = CRC32()
        head = Signal(self.header.payload.shape())
        index = Signal(range(protocol.HEADER.size))
        left = Signal(32)
        magic = int.from_bytes(protocol.MAGIC, "little")
        head_bytes = Cat(Const(magic, 16), Const(protocol.PROTOCOL_VERSION, 8), head.opcode, head.tag, head.length)
        fire = self.o.valid & self.o.ready
        m.d.comb += crc.clear.eq(self.header.valid & self.header.ready)
        with m.FSM():
            with m.State("IDLE"):
                m.d.comb += self.header.ready.eq(1)
                with m.If(self.header.valid):
                    m.d.sync += [head.eq(self.header.payload), left.eq(self.header.payload.length), index.eq(0)]
                    m.next = "HEAD"
            with m.State("HEAD"):
                m.d.comb += [
                    self.o.valid.eq(1),
                    self.o.payload.data.eq(head_bytes.word_select(index, 8)),
                    crc.i.valid.eq(fire),
                    crc.i.payload.eq(self.o.payload.data),
                ]
                with m.If(fire):
                    m.d.sync += index.eq(index + 1)
                    with m.If(index == protocol.HEADER.size - 1):
                        m.d.sync += index.eq(0)
                        m.next = "PAYLOAD"
                        with m.If(left == 0):
                            m.next = "CRC"
            with m.State("PAYLOAD"):
                m.d.comb += [
                    self.o.valid.eq(self.i.valid),
                    self.o.payload.data.eq(self.i.payload),
                    self.i.ready.eq(self.o.ready),
                    crc.i.valid.eq(fire),
                    crc.i.payload.eq(self.i.payload),
                ]
                with m.If(fire):
                    m.d.sync += left.eq(left - 1)
                    with m.If(left == 1):
                        m.next = "CRC"
            with m.State("CRC"):
                m.d.comb += [
                    self.o.valid.eq(1),
                    self.o.payload.data.eq(crc.crc.word_select(index[:2], 8)),
                    self.o.payload.last.eq(index == protocol.CRC_SIZE - 1),
                ]
                with m.If(fire):
                    m.d.sync += index.eq(index + 1)
                    with m.If(index == protocol.CRC_SIZE - 1):
                        m.next = "IDLE"
        return m


class LaneAssembler(wiring.Component):
    """Bytes to beats of ``lanes`` 32-bit lanes: ``elems`` elements a beat (1 .. lanes; the
    other lanes are don't-care), ``elem_bytes`` little-endian bytes an element (1, 2 or 4),
    placed by ``mode`` (``ASSEMBLE_MODES``): ``sign_extend`` (BFP codes), ``raw`` (fp32,
    zero-extended), ``high_half`` (bf16 into the high half: its exact fp32 widening).

    The configuration ports must hold still while a beat assembles. Throughput one byte per
    cycle; a beat is offered the cycle after its last byte and assembling goes on while it
    leaves (the beat register is the assembly register: a byte is taken when the beat on
    offer is absent or leaving).
    """

    def __init__(self, lanes: int):
        self.lanes = lanes
        super().__init__({
            "i": In(stream.Signature(8)),
            "o": Out(stream.Signature(data.ArrayLayout(FP32_WIDTH, lanes))),
            "elem_bytes": In(range(5)),
            "elems": In(range(lanes + 1)),
            "mode": In(2),
        })

    def elaborate(self, platform):
        m = Module()
        elem = Signal(range(self.lanes))
        nbyte = Signal(2)  # byte of the element
        byte = self.i.payload
        pos = Signal(2)  # byte position in the lane
        m.d.comb += pos.eq(nbyte + Mux(self.mode == ASSEMBLE_MODES["high_half"], 2, 0))
        # The first byte of an element clears the rest of its lane: stale bytes of the
        # previous beat never leak into a narrower element.
        current = Mux(nbyte == 0, 0, self.o.payload[elem])
        placed = Signal(FP32_WIDTH)
        m.d.comb += placed.eq(current | (byte << (pos * 8)))
        last_byte = nbyte == self.elem_bytes - 1
        lane = Signal(FP32_WIDTH)
        with m.If((self.mode == ASSEMBLE_MODES["sign_extend"]) & last_byte):
            m.d.comb += lane.eq(Mux(nbyte == 0, byte.as_signed(), Cat(current[:8], byte).as_signed()))
        with m.Else():
            m.d.comb += lane.eq(placed)
        m.d.comb += self.i.ready.eq(~self.o.valid | self.o.ready)
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += self.o.valid.eq(0)
        with m.If(self.i.valid & self.i.ready):
            m.d.sync += [self.o.payload[elem].eq(lane), nbyte.eq(nbyte + 1)]
            with m.If(last_byte):
                m.d.sync += [nbyte.eq(0), elem.eq(elem + 1)]
                with m.If(elem == self.elems - 1):
                    m.d.sync += [elem.eq(0), self.o.valid.eq(1)]
        return m


class ResultSerializer(wiring.Component):
    """The core's output beats (``output_layout``) to reply bytes, as docs/protocol.md lays
    out a GEMM result: ``out_format`` fp32 (4 bytes a value) or bf16 (2 bytes), row-major,
    only the first ``n`` columns of each row (a row is ``ceil(n / cols)`` beats whose lanes
    beyond ``n`` are padding); BFP tile-major, every tile's exponent byte before its codes,
    1 or 2 bytes a code (``cfg.mantissa_bits``), padding included.

    ``start`` (strobe) rewinds the row and tile position before a result. Throughput one
    byte per cycle; a beat leaves (``i.ready``) with its last byte, so the padding lanes
    cost no cycles.
    """

    def __init__(self, cfg: CoreConfig):
        self.cfg = cfg
        self.code_bytes = 1 if cfg.mantissa_bits <= 8 else 2
        super().__init__({
            "i": In(stream.Signature(output_layout(cfg))),
            "o": Out(stream.Signature(8)),
            "out_format": In(2),
            "n": In(range(cfg.size + 1)),
            "start": In(1),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self.cfg
        C = cfg.cols
        th, tw = cfg.tile
        beats_per_tile = th * tw // C
        lane = Signal(range(C))
        nbyte = Signal(2)
        cols_left = Signal(range(cfg.size + 1))  # columns of the row from this beat on
        tile_beat = Signal(range(beats_per_tile))
        exp_sent = Signal()
        bfp = self.out_format == OutFormat.BFP if cfg.bfp_output else Const(0)
        bytes_per_lane = Mux(bfp, self.code_bytes, Mux(self.out_format == OutFormat.BF16, 2, 4))
        lanes_here = Mux(bfp | (cols_left >= C), C, cols_left)
        exp_phase = bfp & (tile_beat == 0) & ~exp_sent
        beat_done = ~exp_phase & (nbyte == bytes_per_lane - 1) & (lane == lanes_here - 1)
        value = self.i.payload.lanes[lane]
        m.d.comb += [
            self.o.valid.eq(self.i.valid),
            self.o.payload.eq(Mux(exp_phase, self.i.payload.exponent, value.word_select(nbyte, 8))),
            self.i.ready.eq(self.o.ready & beat_done),
        ]
        with m.If(self.start):
            m.d.sync += [lane.eq(0), nbyte.eq(0), cols_left.eq(self.n), tile_beat.eq(0), exp_sent.eq(0)]
        with m.Elif(self.o.valid & self.o.ready):
            with m.If(exp_phase):
                m.d.sync += exp_sent.eq(1)
            with m.Elif(nbyte == bytes_per_lane - 1):
                m.d.sync += [nbyte.eq(0), lane.eq(lane + 1)]
                with m.If(beat_done):
                    m.d.sync += lane.eq(0)
                    with m.If(cols_left <= C):
                        m.d.sync += cols_left.eq(self.n)
                    with m.Else():
                        m.d.sync += cols_left.eq(cols_left - C)
                    with m.If(tile_beat == beats_per_tile - 1):
                        m.d.sync += [tile_beat.eq(0), exp_sent.eq(0)]
                    with m.Else():
                        m.d.sync += tile_beat.eq(tile_beat + 1)
            with m.Else():
                m.d.sync += nbyte.eq(nbyte + 1)
        return m


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


class PacketEngine(wiring.Component):
    """The protocol engine (docs/protocol.md). One byte per cycle in (``i``) and out (``o``:
    reply bytes, ``last`` on each reply's final byte).

    Receiving: the engine hunts for the magic, then takes the header, the payload and the
    CRC, one byte per cycle, never stalling ``i`` inside a frame. The payload goes into a
    ``max_payload``-byte buffer (one block RAM of bytes) and its first ``DESCRIPTOR_BYTES``
    also into registers; the CRC register runs as the bytes arrive and the frame checks when
    it ends at ``crc.RESIDUE``. Nothing is executed before the CRC has checked: a corrupted
    WRITE changes no buffer (the reply is BAD_CRC and the host simply sends it again).

    Deciding (2 cycles after the last CRC byte): the first failing check gives the status:
    CRC, version, opcode, then per command: a length too short for the command's fixed part,
    the region (WRITE: BAD_ADDRESS, also for an unknown target), the descriptor (encoding,
    rounding; GEMM/READ: sides, transposes, activation, format, rounding; a reduced device's
    omitted units, ``CoreConfig.value_quantizer``, ``bfp_output``, ``stochastic``;
    ELEMENTWISE: the function), and last the length against what the fields imply. Two exceptions come
    earlier: a length beyond ``max_payload`` is refused (BAD_LENGTH) as soon as the header
    is in, and then ``length + 4`` bytes are skipped (or until ``frame_timeout`` cycles pass
    without a byte); a frame that stops for ``frame_timeout`` cycles after its magic gets a
    TIMEOUT reply with tag 0xFFFF and the opcode as far as it arrived (0x80 if not).

    Executing:

    - WRITE replays the data from the buffer, one byte per cycle, as ``w`` beats to the core
      (codes, exponents, accumulator, bias) or through the input quantizer (values: ``q_i``
      beats of ``cols`` fp32 elements, bf16 widened; ``q_o`` codes back to ``w`` as row
      chunks plus one exponent beat per tile); the reply goes out after the last beat.
    - GEMM and READ run the core twice: first the command itself with its output discarded
      (so the core never waits on the 1-byte-per-cycle reply, and the ``cycles`` of the
      reply and of STATUS are the core's own count for the command, independent of the
      host's pace), then, once the reply's header (and for GEMM the ``cycles``) is out, the
      same epilogue again as a K = 0 command whose output the ``ResultSerializer`` sends.
      K = 0 re-reads the accumulator the first pass left, so the second pass equals the
      first bit for bit (BFP stochastic rounding restarts at stream position 0 in both).
    - ELEMENTWISE streams x (and g, interleaved) from the buffer through ``act_i``, and
      ``act_o`` into the reply, two bytes a result.
    - IDENTIFY, STATUS, RESET reply from registers. Every reply counts in STATUS when its
      status is decided (so a STATUS reply counts itself); RESET then zeroes the counters,
      the last error and the last cycles.

    Throughput: 1 byte per cycle each way. Latency from a request's last CRC byte to its
    reply's first byte: 4 cycles (errors, IDENTIFY, STATUS, RESET, ELEMENTWISE); a WRITE of
    L payload bytes about L - 16 + 10 (the replay; quantized values add a tile's latency);
    a GEMM or READ its ``cycles`` + 6.
    """

    def __init__(self, cfg: CoreConfig, *, stream_bytes: int = 1, clock_hz: int = 0,
                 max_payload: int = DEFAULT_MAX_PAYLOAD, frame_timeout: int = DEFAULT_FRAME_TIMEOUT):
        self.cfg = cfg
        self.stream_bytes = stream_bytes
        self.clock_hz = clock_hz
        self.max_payload = max_payload
        self.frame_timeout = frame_timeout
        self.code_bytes = 1 if cfg.mantissa_bits <= 8 else 2
        self.functions = cfg.built_functions
        C = cfg.cols
        super().__init__({
            "i": In(stream.Signature(8)),
            "o": Out(stream.Signature(BYTE)),
            # GemmCore
            "w": Out(stream.Signature(write_layout(cfg))),
            "cmd": Out(stream.Signature(command_layout(cfg))),
            "result": In(stream.Signature(output_layout(cfg))),
            "core_cycles": In(32),
            # the input Quantize
            "q_i": Out(stream.Signature(data.ArrayLayout(FP32_WIDTH, C))),
            "q_o": In(stream.Signature(quantize_output_layout(cfg.mantissa_bits, C))),
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
        D, C = cfg.size, cfg.cols
        th, tw = cfg.tile
        cb = self.code_bytes
        P = self.max_payload

        m.submodules.rx_crc = rx_crc = CRC32(init=crc32_state(protocol.MAGIC))
        m.submodules.framer = framer = ReplyFramer()
        m.submodules.assembler = asm = LaneAssembler(C)
        m.submodules.serializer = ser = ResultSerializer(cfg)
        m.submodules.payload = buf = memory.Memory(shape=8, depth=P, init=[])
        buf_wr = buf.write_port()
        buf_rd = buf.read_port()
        wiring.connect(m, framer.o, wiring.flipped(self.o))

        byte = self.i.payload
        got = self.i.valid & self.i.ready

        # ---- received frame ------------------------------------------------------------
        head = Signal(data.StructLayout({"version": 8, "opcode": 8, "tag": 16, "length": 32}))
        head_index = Signal(range(protocol.HEADER.size))  # header byte after the magic
        desc = Signal(8 * DESCRIPTOR_BYTES)
        count = Signal(range(P + 1))  # payload bytes received
        crc_index = Signal(range(protocol.CRC_SIZE))
        idle = Signal(range(self.frame_timeout + 1))  # cycles without a byte, mid-frame
        seen_h = Signal()
        timed_out = Signal()
        skip_left = Signal(34)
        skip_after = Signal()  # the reply goes out before the rest of the frame is skipped

        # The descriptor's bytes seen through each command's contract layout.
        w_desc = data.View(layout(protocol.WRITE), desc[:8 * WRITE_HEADER])
        g_desc = data.View(layout(protocol.GEMM), desc[:8 * GEMM_SIZE])
        r_desc = data.View(layout(protocol.READ), desc[:8 * READ_SIZE])
        e_desc = data.View(layout(protocol.ELEMENTWISE), desc[:8 * ELEMENTWISE_HEADER])

        opcode, length = head.opcode, head.length
        is_op = {op: opcode == op for op in Op}

        # ---- validation (combinational from the frame's registers; registered in DECIDE) -
        # WRITE
        w_target, w_encoding, w_rounding = w_desc.target, w_desc.encoding, w_desc.rounding
        w_seed = w_desc.seed
        w_row, w_col, w_rows, w_cols = w_desc.row, w_desc.col, w_desc.rows, w_desc.cols
        w_row_end = Signal(17)
        w_col_end = Signal(17)
        m.d.comb += [w_row_end.eq(w_row + w_rows), w_col_end.eq(w_col + w_cols)]
        in_elements = (w_row_end <= D) & (w_col_end <= D)
        in_tiles = (w_row_end <= D // th) & (w_col_end <= D // tw)
        chunked = _multiple_of(w_col, C, D) & _multiple_of(w_cols, C, D)
        tiled = (_multiple_of(w_row, th, D) & _multiple_of(w_rows, th, D)
                 & _multiple_of(w_col, tw, D) & _multiple_of(w_cols, tw, D))
        is_codes = (w_target == Target.A_CODES) | (w_target == Target.B_CODES)
        is_exps = (w_target == Target.A_EXPONENTS) | (w_target == Target.B_EXPONENTS)
        is_values = (w_target == Target.A_VALUES) | (w_target == Target.B_VALUES)
        address_ok = Mux(
            is_codes | (w_target == Target.ACC), in_elements & chunked,
            Mux(is_exps, in_tiles,
                Mux(w_target == Target.BIAS, (w_row == 0) & (w_rows == 1) & in_elements & chunked,
                    Mux(is_values, in_elements & tiled, 0))))
        value_bf16 = w_encoding == Encoding.BF16
        stochastic = Rounding.STOCHASTIC
        write_desc_ok = ~is_values | ((w_encoding <= max(Encoding)) & (w_rounding <= max(Rounding)))
        # A reduced device refuses the work of the units it was built without (CoreConfig).
        if not cfg.value_quantizer:
            write_desc_ok = ~is_values
        elif not cfg.stochastic:
            write_desc_ok = write_desc_ok & (w_rounding != stochastic)
        element_bytes = Mux(is_codes, cb, Mux(is_exps, 1, Mux(is_values & value_bf16, 2, 4)))
        region = Signal(32)
        m.d.comb += region.eq(w_rows * w_cols)
        write_bytes = Signal(35)
        m.d.comb += write_bytes.eq(region * element_bytes)

        # GEMM and READ share one set of fields (READ: K = 0 and only the bias flag)
        is_read = is_op[Op.READ]
        c_m, c_n = Mux(is_read, r_desc.m, g_desc.m), Mux(is_read, r_desc.n, g_desc.n)
        c_k = Mux(is_read, 0, g_desc.k)
        c_flags = Mux(is_read, r_desc.flags & GemmFlag.BIAS, g_desc.flags)
        c_act = Mux(is_read, r_desc.activation, g_desc.activation)
        c_format = Mux(is_read, r_desc.out_format, g_desc.out_format)
        c_rounding = Mux(is_read, r_desc.rounding, g_desc.rounding)
        c_seed = Mux(is_read, r_desc.seed, g_desc.seed)
        flag = {f.name.lower(): c_flags & f != 0 for f in GemmFlag}
        unary_mask = functions_mask(n for n in self.functions if n in UNARY_FUNCTIONS)
        built_mask = functions_mask(self.functions)
        gradient_mask = functions_mask(n for n in self.functions if n not in UNARY_FUNCTIONS)
        act_ok = (c_act == protocol.NO_ACTIVATION) | Const(unary_mask, 256).bit_select(c_act, 1)
        sides_ok = ((c_m >= 1) & (c_m <= D) & (c_n >= 1) & (c_n <= D)
                    & (is_read | ((c_k >= 1) & (c_k <= D))))
        transposes_ok = 1 if cfg.square else (is_read | (~flag["transpose_a"] & flag["transpose_b"]))
        command_ok = (sides_ok & act_ok & transposes_ok & (c_format <= max(OutFormat))
                      & (c_rounding <= max(Rounding)))
        c_bfp = c_format == OutFormat.BFP
        if not cfg.bfp_output:
            command_ok = command_ok & ~c_bfp
        elif not cfg.stochastic:
            command_ok = command_ok & ~(c_bfp & (c_rounding == stochastic))
        tiles = Signal(32)
        m.d.comb += tiles.eq(_ceil_div(c_m, th, D) * _ceil_div(c_n, tw, D))
        elements = Signal(32)
        m.d.comb += elements.eq(c_m * c_n)
        result_bytes = Mux(c_format == OutFormat.FP32, elements << 2,
                           Mux(c_format == OutFormat.BF16, elements << 1, tiles * (1 + th * tw * cb)))

        # ELEMENTWISE
        e_function, e_count = e_desc.function, e_desc.count
        e_gradient = Const(gradient_mask, 256).bit_select(e_function, 1)  # a built gradient function
        # An ELEMENTWISE that runs: none on a device without functions (it is refused), whose
        # path to the activation unit is then not built.
        elementwise = is_op[Op.ELEMENTWISE] if self.functions else Const(0)
        e_built = Const(built_mask, 256).bit_select(e_function, 1)
        e_bytes = Signal(35)
        m.d.comb += e_bytes.eq(Mux(e_gradient, e_count << 2, e_count << 1))

        status = Signal(8)
        with m.If(~rx_crc.residue_ok):
            m.d.comb += status.eq(Status.BAD_CRC)
        with m.Elif(head.version != protocol.PROTOCOL_VERSION):
            m.d.comb += status.eq(Status.BAD_VERSION)
        with m.Elif(~Cat(*is_op.values()).any()):
            m.d.comb += status.eq(Status.BAD_OPCODE)
        with m.Elif(is_op[Op.WRITE]):
            with m.If(length < WRITE_HEADER):
                m.d.comb += status.eq(Status.BAD_LENGTH)
            with m.Elif(~address_ok):
                m.d.comb += status.eq(Status.BAD_ADDRESS)
            with m.Elif(~write_desc_ok):
                m.d.comb += status.eq(Status.BAD_DESCRIPTOR)
            with m.Elif(length != WRITE_HEADER + write_bytes):
                m.d.comb += status.eq(Status.BAD_LENGTH)
        with m.Elif(is_op[Op.GEMM] | is_read):
            with m.If(length != Mux(is_read, READ_SIZE, GEMM_SIZE)):
                m.d.comb += status.eq(Status.BAD_LENGTH)
            with m.Elif(~command_ok):
                m.d.comb += status.eq(Status.BAD_DESCRIPTOR)
        with m.Elif(is_op[Op.ELEMENTWISE]):
            with m.If(length < ELEMENTWISE_HEADER):
                m.d.comb += status.eq(Status.BAD_LENGTH)
            with m.Elif(~e_built):
                m.d.comb += status.eq(Status.BAD_DESCRIPTOR)
            with m.Elif(length != ELEMENTWISE_HEADER + e_bytes):
                m.d.comb += status.eq(Status.BAD_LENGTH)
        with m.Else():  # IDENTIFY, STATUS, RESET carry no payload
            with m.If(length != 0):
                m.d.comb += status.eq(Status.BAD_LENGTH)

        # ---- the reply in preparation ----------------------------------------------------
        r_status = Signal(8)
        r_fixed = Signal(range(33))  # bytes from registers after the status byte
        r_stream = Signal(32)  # bytes from a stream after those
        fixed_index = Signal(range(32))
        stream_left = Signal(32)

        # STATUS counters (docs/protocol.md, 0x06): every reply counts once, when its status
        # is decided; a STATUS reply thus counts itself.
        accepted = Signal(32)
        refused = Signal(32)
        last_cycles = Signal(32)
        last_error = Signal(8)
        count_status = Signal()
        counted = Signal(8)
        with m.If(count_status):
            with m.If(counted == Status.OK):
                m.d.sync += accepted.eq(accepted + 1)
            with m.Else():
                m.d.sync += [refused.eq(refused + 1), last_error.eq(counted)]

        identity = int.from_bytes(self.identity(), "little")
        fixed = Mux(is_op[Op.IDENTIFY], Const(identity, 256),
                    Mux(is_op[Op.STATUS], Cat(accepted, refused, last_cycles, last_error, Const(0, 24)),
                        last_cycles))

        # ---- payload reader: buffer -> assembler -------------------------------------------
        rd_left = Signal(range(P + 1))
        rd_a = Signal(range(P))
        rd_b = Signal(range(P))  # ELEMENTWISE gradients: g, interleaved with x
        rd_phase = Signal(2)
        rd_interleave = Signal()
        rd_valid = Signal()
        rd_kick = Signal()
        rd_advance = ~rd_valid | asm.i.ready
        use_b = rd_interleave & rd_phase[1]
        m.d.comb += [
            buf_rd.en.eq(rd_advance),
            buf_rd.addr.eq(Mux(use_b, rd_b, rd_a)),
            asm.i.valid.eq(rd_valid),
            asm.i.payload.eq(buf_rd.data),
        ]
        with m.If(rd_kick):
            m.d.sync += [
                rd_phase.eq(0),
                rd_interleave.eq(elementwise & e_gradient),
                rd_a.eq(Mux(is_op[Op.WRITE], WRITE_HEADER, ELEMENTWISE_HEADER)),
                rd_b.eq(ELEMENTWISE_HEADER + (e_count << 1)),
                rd_left.eq(Mux(is_op[Op.WRITE], length - WRITE_HEADER, length - ELEMENTWISE_HEADER)),
            ]
        with m.Elif(rd_advance):
            m.d.sync += rd_valid.eq(rd_left != 0)
            with m.If(rd_left != 0):
                m.d.sync += [rd_left.eq(rd_left - 1), rd_phase.eq(rd_phase + 1)]
                with m.If(use_b):
                    m.d.sync += rd_b.eq(rd_b + 1)
                with m.Else():
                    m.d.sync += rd_a.eq(rd_a + 1)

        # Assembler configuration, per command (held in registers during the replay).
        a_bytes = Signal(range(5))
        a_elems = Signal(range(C + 1))
        a_mode = Signal(2)
        m.d.comb += [asm.elem_bytes.eq(a_bytes), asm.elems.eq(a_elems), asm.mode.eq(a_mode)]

        # ---- WRITE: the assembler's beats to the core, row-major or through the quantizer --
        PATH_ROWS, PATH_VALUES, PATH_ACT = 0, 1, 2
        path = Signal(2)
        wr_target = Signal(3)  # core target of code beats (values: A or B codes)
        wr_row = Signal(range(D + 1))
        wr_col = Signal(range(D + 1))
        wr_col0 = Signal(range(D + 1))
        wr_col_end = Signal(range(D + 1))
        wr_step = Signal(range(C + 1))
        wr_left = Signal(range(D * D + 1))
        # Values: the tile being written (absolute row and column of its corner), the row
        # and column offset inside it, and its index in the exponent grid.
        v_row, v_col = Signal(range(D + 1)), Signal(range(D + 1))
        v_r, v_c = Signal(range(th)), Signal(range(tw))
        v_erow, v_ecol, v_ecol0 = Signal(range(D // th + 1)), Signal(range(D // tw + 1)), Signal(range(D // tw + 1))
        v_row_end = Signal(range(D + 1))
        v_exp = Signal()  # the tile's codes are written: its exponent goes next
        v_exponent = Signal(EXP_WIDTH)
        v_done = Signal()
        q_rounding = Signal(Rounding)
        q_seed = Signal(32)
        m.d.comb += [self.q_rounding.eq(q_rounding), self.q_seed.eq(q_seed)]
        w_fire = self.w.valid & self.w.ready
        writing = Signal()

        with m.If(writing & (path == PATH_ROWS)):
            m.d.comb += [
                self.w.valid.eq(asm.o.valid),
                asm.o.ready.eq(self.w.ready),
                self.w.payload.target.eq(wr_target),
                self.w.payload.row.eq(wr_row),
                self.w.payload.col.eq(wr_col),
            ]
            for j in range(C):
                m.d.comb += self.w.payload.data[j].eq(asm.o.payload[j])
            with m.If(w_fire):
                m.d.sync += [wr_left.eq(wr_left - 1), wr_col.eq(wr_col + wr_step)]
                with m.If(wr_col + wr_step == wr_col_end):
                    m.d.sync += [wr_col.eq(wr_col0), wr_row.eq(wr_row + 1)]
        with m.If(writing & (path == PATH_VALUES)):
            m.d.comb += [
                self.q_i.valid.eq(asm.o.valid),
                self.q_i.payload.eq(asm.o.payload),
                asm.o.ready.eq(self.q_i.ready),
            ]
            with m.If(v_exp):
                m.d.comb += [
                    self.w.valid.eq(1),
                    self.w.payload.target.eq(wr_target + (Target.A_EXPONENTS - Target.A_CODES)),
                    self.w.payload.row.eq(v_erow),
                    self.w.payload.col.eq(v_ecol),
                    self.w.payload.data[0].eq(v_exponent),
                ]
                with m.If(w_fire):
                    m.d.sync += v_exp.eq(0)
                    with m.If(v_col + tw == wr_col_end):
                        m.d.sync += [v_col.eq(wr_col0), v_ecol.eq(v_ecol0), v_row.eq(v_row + th), v_erow.eq(v_erow + 1)]
                        with m.If(v_row + th == v_row_end):
                            m.d.sync += v_done.eq(1)
                    with m.Else():
                        m.d.sync += [v_col.eq(v_col + tw), v_ecol.eq(v_ecol + 1)]
            with m.Else():
                m.d.comb += [
                    self.w.valid.eq(self.q_o.valid),
                    self.q_o.ready.eq(self.w.ready),
                    self.w.payload.target.eq(wr_target),
                    self.w.payload.row.eq(v_row + v_r),
                    self.w.payload.col.eq(v_col + v_c),
                ]
                for j in range(C):
                    m.d.comb += self.w.payload.data[j].eq(self.q_o.payload.codes[j])
                with m.If(w_fire):
                    m.d.sync += v_c.eq(v_c + C)
                    with m.If(v_c == tw - C):
                        m.d.sync += [v_c.eq(0), v_r.eq(v_r + 1)]
                        with m.If(v_r == th - 1):
                            m.d.sync += [v_r.eq(0), v_exp.eq(1), v_exponent.eq(self.q_o.payload.exponent)]
        write_done = Mux(path == PATH_VALUES, v_done, wr_left == 0)

        # ---- ELEMENTWISE: assembler -> activation -> two bytes a result -------------------
        e_func = Signal(FUNC_WIDTH)
        with m.If(path == PATH_ACT):
            m.d.comb += [
                self.act_i.valid.eq(asm.o.valid),
                self.act_i.payload.x.eq(asm.o.payload[0][:16]),
                self.act_i.payload.g.eq(asm.o.payload[0][16:]),
                self.act_i.payload.func.eq(e_func),
                asm.o.ready.eq(self.act_i.ready),
            ]
        act_high = Signal()  # the result's high byte goes next

        # ---- GEMM and READ: the core command -----------------------------------------------
        second_pass = Signal()
        draining = Signal()
        cmd = self.cmd.payload
        m.d.comb += [
            cmd.m.eq(c_m),
            cmd.n.eq(c_n),
            cmd.k.eq(Mux(second_pass, 0, c_k)),
            cmd.transpose_a.eq(flag["transpose_a"]),
            cmd.transpose_b.eq(flag["transpose_b"]),
            cmd.accumulate.eq(flag["accumulate"]),
            cmd.bias.eq(flag["bias"]),
            cmd.act_en.eq(c_act != protocol.NO_ACTIVATION),
            cmd.act_func.eq(c_act),
            cmd.out_format.eq(c_format),
            cmd.rounding.eq(c_rounding),
            cmd.seed.eq(c_seed),
            ser.out_format.eq(c_format),
            ser.n.eq(c_n),
            ser.start.eq(self.cmd.valid & self.cmd.ready),
            ser.i.valid.eq(self.result.valid & ~draining),
            ser.i.payload.eq(self.result.payload),
            self.result.ready.eq(draining | ser.i.ready),
        ]

        # ---- the state machine ---------------------------------------------------------
        tx = framer.i
        tx_fire = tx.valid & tx.ready
        m.d.comb += [
            framer.header.payload.opcode.eq(opcode | protocol.REPLY),
            framer.header.payload.tag.eq(Mux(timed_out, protocol.FRAME_TIMEOUT_TAG, head.tag)),
            framer.header.payload.length.eq(1 + r_fixed + r_stream),
        ]

        def mid_frame_timeout(then_reply: bool):
            """A frame that stops arriving: after ``frame_timeout`` cycles without a byte."""
            with m.If(got):
                m.d.sync += idle.eq(0)
            with m.Elif(idle == self.frame_timeout - 1):
                m.d.sync += idle.eq(0)
                if then_reply:
                    m.d.sync += [timed_out.eq(1), r_status.eq(Status.TIMEOUT), r_fixed.eq(0), r_stream.eq(0)]
                    m.d.comb += [count_status.eq(1), counted.eq(Status.TIMEOUT)]
                    m.next = "REPLY_HEADER"
                else:
                    m.next = "HUNT"
            with m.Else():
                m.d.sync += idle.eq(idle + 1)

        with m.FSM():
            with m.State("HUNT"):
                m.d.comb += self.i.ready.eq(1)
                with m.If(got):
                    m.d.sync += seen_h.eq(byte == protocol.MAGIC[0])
                    with m.If(seen_h & (byte == protocol.MAGIC[1])):
                        m.d.comb += rx_crc.clear.eq(1)
                        m.d.sync += [seen_h.eq(0), head.eq(0), head_index.eq(0), idle.eq(0), timed_out.eq(0),
                                     skip_after.eq(0), count.eq(0), crc_index.eq(0)]
                        m.next = "HEADER"
            with m.State("HEADER"):
                m.d.comb += [self.i.ready.eq(1), rx_crc.i.valid.eq(got), rx_crc.i.payload.eq(byte)]
                with m.If(got):
                    m.d.sync += [head.as_value().word_select(head_index, 8).eq(byte), head_index.eq(head_index + 1)]
                    with m.If(head_index == protocol.HEADER.size - len(protocol.MAGIC) - 1):
                        m.next = "LENGTH"
                mid_frame_timeout(True)
            with m.State("LENGTH"):
                # A length beyond the buffer is refused as soon as the header is in; the
                # frame's remaining length + 4 bytes are skipped after the reply.
                with m.If(length > P):
                    m.d.sync += [r_status.eq(Status.BAD_LENGTH), r_fixed.eq(0), r_stream.eq(0),
                                 skip_after.eq(1), skip_left.eq(length + protocol.CRC_SIZE)]
                    m.d.comb += [count_status.eq(1), counted.eq(Status.BAD_LENGTH)]
                    m.next = "REPLY_HEADER"
                with m.Elif(length == 0):
                    m.next = "CRC"
                with m.Else():
                    m.next = "PAYLOAD"
            with m.State("PAYLOAD"):
                m.d.comb += [
                    self.i.ready.eq(1),
                    rx_crc.i.valid.eq(got),
                    rx_crc.i.payload.eq(byte),
                    buf_wr.en.eq(got),
                    buf_wr.addr.eq(count),
                    buf_wr.data.eq(byte),
                ]
                with m.If(got):
                    m.d.sync += count.eq(count + 1)
                    with m.If(count < DESCRIPTOR_BYTES):
                        m.d.sync += desc.word_select(count[:(DESCRIPTOR_BYTES - 1).bit_length()], 8).eq(byte)
                    with m.If(count == length - 1):
                        m.next = "CRC"
                mid_frame_timeout(True)
            with m.State("CRC"):
                m.d.comb += [self.i.ready.eq(1), rx_crc.i.valid.eq(got), rx_crc.i.payload.eq(byte)]
                with m.If(got):
                    m.d.sync += crc_index.eq(crc_index + 1)
                    with m.If(crc_index == protocol.CRC_SIZE - 1):
                        m.next = "DECIDE"
                mid_frame_timeout(True)
            with m.State("DECIDE"):
                ok = status == Status.OK
                m.d.sync += [
                    r_status.eq(status),
                    r_fixed.eq(Mux(~ok, 0, Mux(is_op[Op.IDENTIFY], 32, Mux(is_op[Op.STATUS], 16,
                                                                            Mux(is_op[Op.GEMM], 4, 0))))),
                    r_stream.eq(Mux(~ok, 0, Mux(elementwise, e_count << 1,
                                                Mux(is_op[Op.GEMM] | is_read, result_bytes, 0)))),
                ]
                m.d.comb += [count_status.eq(1), counted.eq(status)]
                # Registers of the WRITE replay (used only if it runs).
                m.d.sync += [
                    # Paths to units a reduced device lacks are never taken (refused above):
                    # their logic is not built.
                    path.eq(Mux(elementwise, PATH_ACT,
                                Mux(is_values if cfg.value_quantizer else 0, PATH_VALUES, PATH_ROWS))),
                    wr_target.eq(Mux(is_values, w_target - (Target.A_VALUES - Target.A_CODES), w_target)),
                    wr_row.eq(w_row),
                    wr_col.eq(w_col),
                    wr_col0.eq(w_col),
                    wr_col_end.eq(w_col_end),
                    wr_step.eq(Mux(is_exps, 1, C)),
                    wr_left.eq(Mux(is_exps, region, region >> (C.bit_length() - 1))),
                    v_row.eq(w_row),
                    v_col.eq(w_col),
                    v_r.eq(0),
                    v_c.eq(0),
                    v_erow.eq(_quotient_of_multiple(w_row, th, D)),
                    v_ecol.eq(_quotient_of_multiple(w_col, tw, D)),
                    v_ecol0.eq(_quotient_of_multiple(w_col, tw, D)),
                    v_row_end.eq(w_row_end),
                    v_exp.eq(0),
                    v_done.eq(region == 0),
                    q_rounding.eq(w_rounding),
                    q_seed.eq(w_seed),
                    e_func.eq(e_function),
                    act_high.eq(0),
                    a_bytes.eq(Mux(elementwise, Mux(e_gradient, 4, 2), element_bytes)),
                    a_elems.eq(Mux(elementwise | is_exps, 1, C)),
                    a_mode.eq(Mux(is_codes & is_op[Op.WRITE], ASSEMBLE_MODES["sign_extend"],
                                  Mux(is_values & value_bf16 & is_op[Op.WRITE], ASSEMBLE_MODES["high_half"],
                                      ASSEMBLE_MODES["raw"]))),
                ]
                m.next = "DISPATCH"
            with m.State("DISPATCH"):
                with m.If(r_status != Status.OK):
                    m.next = "REPLY_HEADER"
                with m.Elif(is_op[Op.WRITE]):
                    m.d.comb += [rd_kick.eq(1), self.q_clear.eq(is_values)]
                    m.d.sync += writing.eq(1)
                    m.next = "WRITE"
                with m.Elif(is_op[Op.GEMM] | is_read):
                    m.d.sync += second_pass.eq(0)
                    m.next = "CORE_RUN"
                with m.Elif(is_op[Op.ELEMENTWISE]):
                    m.d.comb += rd_kick.eq(1)
                    m.next = "REPLY_HEADER"
                with m.Else():
                    with m.If(is_op[Op.RESET]):
                        m.d.sync += [accepted.eq(0), refused.eq(0), last_cycles.eq(0), last_error.eq(0)]
                    m.next = "REPLY_HEADER"
            with m.State("WRITE"):
                with m.If(write_done):
                    m.d.sync += writing.eq(0)
                    m.next = "REPLY_HEADER"
            with m.State("CORE_RUN"):
                m.d.comb += self.cmd.valid.eq(1)
                with m.If(self.cmd.ready):
                    m.next = "CORE_DRAIN"
            with m.State("CORE_DRAIN"):
                m.d.comb += draining.eq(1)
                with m.If(self.result.valid & self.result.payload.last):
                    m.next = "CORE_CYCLES"
            with m.State("CORE_CYCLES"):
                # The core's ``cycles`` is final the cycle after its last output beat.
                m.d.sync += [last_cycles.eq(self.core_cycles), second_pass.eq(1)]
                m.next = "REPLY_HEADER"
            with m.State("REPLY_HEADER"):
                m.d.comb += framer.header.valid.eq(1)
                with m.If(framer.header.ready):
                    m.d.sync += [fixed_index.eq(0), stream_left.eq(r_stream)]
                    m.next = "REPLY_STATUS"
            with m.State("REPLY_STATUS"):
                m.d.comb += [tx.valid.eq(1), tx.payload.eq(r_status)]
                with m.If(tx.ready):
                    with m.If(r_fixed != 0):
                        m.next = "REPLY_FIXED"
                    with m.Elif(r_stream != 0):
                        m.next = "REPLY_STREAM"
                    with m.Elif(skip_after):
                        m.next = "SKIP"
                    with m.Else():
                        m.next = "HUNT"
            with m.State("REPLY_FIXED"):
                m.d.comb += [tx.valid.eq(1), tx.payload.eq(fixed.word_select(fixed_index, 8))]
                with m.If(tx.ready):
                    m.d.sync += fixed_index.eq(fixed_index + 1)
                    with m.If(fixed_index == r_fixed - 1):
                        m.next = "REPLY_STREAM"
                        with m.If(r_stream == 0):
                            m.next = "HUNT"
            with m.State("REPLY_STREAM"):
                with m.If(path == PATH_ACT):  # ELEMENTWISE
                    m.d.comb += [
                        tx.valid.eq(self.act_o.valid),
                        tx.payload.eq(Mux(act_high, self.act_o.payload[8:], self.act_o.payload[:8])),
                        self.act_o.ready.eq(tx.ready & act_high),
                    ]
                    with m.If(tx_fire):
                        m.d.sync += act_high.eq(~act_high)
                with m.Else():
                    # The second pass: the same epilogue, now into the reply.
                    m.d.comb += [
                        self.cmd.valid.eq(second_pass),
                        tx.valid.eq(ser.o.valid),
                        tx.payload.eq(ser.o.payload),
                        ser.o.ready.eq(tx.ready),
                    ]
                    with m.If(self.cmd.valid & self.cmd.ready):
                        m.d.sync += second_pass.eq(0)
                with m.If(tx_fire):
                    m.d.sync += stream_left.eq(stream_left - 1)
                    with m.If(stream_left == 1):
                        m.next = "HUNT"
            with m.State("SKIP"):
                m.d.comb += self.i.ready.eq(1)
                with m.If(got):
                    m.d.sync += skip_left.eq(skip_left - 1)
                    with m.If(skip_left == 1):
                        m.next = "HUNT"
                mid_frame_timeout(False)
        return m
