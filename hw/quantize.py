"""The BFP quantizer: a tile-major fp32 (or bf16) stream in, BFP codes and exponents out."""

from __future__ import annotations

from types import SimpleNamespace

from amaranth.hdl import Array, Cat, Const, Module, Mux, Shape, Signal, Value, signed, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from hbfp.contract import QUANTIZE_LATENCY, Rounding
from hbfp.golden.bfp import Format

from .block_ram import BlockRam
from .params import BF16_WIDTH, EXP_NAN, EXP_WIDTH, F32_FRAC_BITS, FP32_WIDTH, MIX32_MULTIPLIERS, RANDOM_BITS, SEED_SALT

__all__ = ["Quantize", "INPUT_FORMATS", "KEY_LATENCY", "LATENCY", "MIX32_MULTIPLIERS", "SERIAL_KEY_BEATS"]

#: Element widths of the supported input formats.
INPUT_FORMATS = {"fp32": FP32_WIDTH, "bf16": BF16_WIDTH}
#: Cycles from a change of the ``seed`` port until the quantizer may take it: the key's pipeline
#: (two constant multiplies in five stages) where it has one (see ``SERIAL_KEY_BEATS``).
KEY_LATENCY = 5
#: Cycles of the serial key unit: its start's register, two bit-serial constant multiplies of 32
#: steps each, and the cycle that writes the key into its bank.
_SERIAL_KEY_CYCLES = 1 + 2 * 32 + 1
#: Beats per tile from which the key is computed serially, once per tile, while the tile fills
#: (about 130 LUT4s instead of the key pipeline's 800): a tile's fill then outlasts the key's
#: computation, which therefore never delays the drain.
SERIAL_KEY_BEATS = _SERIAL_KEY_CYCLES
#: Cycles from the cycle in which a tile's last input beat is accepted to the cycle in which
#: its first output beat is valid (without output stalls): the fill pipeline, the bank
#: handover, the memory read and the drain pipeline (the contract's ``QUANTIZE_LATENCY``,
#: which ``emu`` counts).
LATENCY = QUANTIZE_LATENCY

_FRAC_BITS = F32_FRAC_BITS  # fp32 fraction field
_MAX_MANTISSA = 16  # the widest format (Format allows 2..16): alignment shifts start at 0 there
# Alignment: with d = E - field, an element's |y| * 2**RANDOM_BITS is sig * 2**(_PRESHIFT - t)
# for t = d + (_MAX_MANTISSA - m) >= 0 (sig: the 24-bit significand).
_PRESHIFT = RANDOM_BITS + _MAX_MANTISSA - 2 - _FRAC_BITS
# t is clamped here: from here up sig * 2**(_PRESHIFT - t) < 1, i.e. |y| < 2**-RANDOM_BITS and the
# code is 0 in every rounding mode.
_SHIFT_CLAMP = _PRESHIFT + _FRAC_BITS + 1

# Pipelining, for 150 MHz on an ECP5: a stage holds at most two chained 32-bit carry chains,
# or one chain and one LUT level. The fill side registers an input beat _FILL_STAGES times
# while a tree (one level per stage, up to 8 lanes) takes the max of its exponent fields.
_FILL_STAGES = 3
# The adder-tree levels (of the four in each constant multiply) after which mix32 registers:
# [xor-shift, level 1] [levels 2, 3] [level 4, xor-shift] for the first multiply, [levels 1, 2]
# [levels 3, 4] for the second. Five stages, in the lanes and in the key.
_MIX_CUTS = ((1, 3), (2,))
_MIX_STAGES = sum(len(c) + 1 for c in _MIX_CUTS)
# The drain pipeline after the memory read: the read data registered (twice, beside the
# generator's first stage), the mix32 stages (the element's decoding and alignment run beside
# the last four), the rounding decision, the saturated magnitude, the signed code (the output
# register).
_DRAIN_STAGES = 1 + _MIX_STAGES + 3
assert _MIX_STAGES == 5, "the element's four stages end with the generator's"
assert LATENCY == _FILL_STAGES + 2 + _DRAIN_STAGES, "QUANTIZE_LATENCY counts the stages below"


def _naf(c: int) -> list[tuple[int, int]]:
    """The non-adjacent form of ``c``: (shift, +1 or -1) pairs with ``sum(d << s) == c``."""
    digits, shift = [], 0
    while c:
        if c & 1:
            d = 2 - (c & 3)
            c -= d
            digits.append((shift, d))
        c >>= 1
        shift += 1
    return digits


def _times_constant(x, c: int, width: int = 32, *, cut=None):
    """``x * c mod 2**width`` as shifts, adds and subtracts of ``x`` (the NAF of ``c``, a
    balanced tree of adders and subtractors): a multiply by a constant takes no DSP block,
    which the MAC array needs (an ECP5 maps every ``$mul`` to one or more MULT18X18D).
    Every term is known to end in zeros (``x << s``), so each adder's carry chain starts
    where the first nonzero bit can be (below it the sum is the other term's bits).
    ``cut(level, values)``, if given, may register the values after each tree level (a
    pipeline stage boundary) and returns what the next level reads."""
    # Signed terms: (d, v, z) stands for d * v, whose z low bits are zero, so a mix of signs
    # needs no negation.
    terms = [(d, (x << s)[:width], s) for s, d in _naf(c % 2**width) if s < width]

    def add(a, za, b, zb):
        z = max(za, zb)  # below z one term is zero: the other's bits, no carry
        low = a[:z] if za < zb else b[:z]
        return Cat(low, (a[z:] + b[z:])[:width - z]), min(za, zb)

    def sub(a, za, b, zb):  # a - b; below zb, b is zero: a's bits, no borrow
        return Cat(a[:zb], (a[zb:] - b[zb:])[:width - zb]), min(za, zb)

    level = 0
    while len(terms) > 1:
        pairs = [terms[i:i + 2] for i in range(0, len(terms), 2)]
        terms = []
        for pair in pairs:
            if len(pair) == 1:
                terms.append(pair[0])
                continue
            (da, a, za), (db, b, zb) = pair
            if da == db:
                v, z = add(a, za, b, zb)
                terms.append((da, v, z))
            elif da > 0:
                terms.append((1, *sub(a, za, b, zb)))
            else:
                terms.append((1, *sub(b, zb, a, za)))
        level += 1
        if cut is not None:
            regs = cut(level, [v for _, v, _ in terms])
            terms = [(d, r, z) for (d, _, z), r in zip(terms, regs)]
    if not terms:
        return Const(0, width)
    d, v, _ = terms[0]
    return v if d > 0 else (-v)[:width]


def _xorshift(x, k: int):
    return x ^ (x >> k)


def _mix32_stages(x, register):
    """mix32 from its first multiply on, i.e. of an ``x`` that already had its first
    ``x ^= x >> 16``, and without its final one, in ``_MIX_STAGES`` pipeline stages:
    ``register(value)`` returns the value's register. The final xor-shift is left out
    because every user can do without it: the top ``RANDOM_BITS`` bits are untouched by it,
    and the key's cancels against the lane's first one (``x ^ (x >> 16)`` is linear and its
    own inverse on 32 bits: ``xs(n ^ xs(k)) == xs(n) ^ k``)."""

    def cutter(cuts):
        return lambda level, values: [register(v) for v in values] if level in cuts else values

    p = register(_xorshift(_times_constant(x, MIX32_MULTIPLIERS[0], cut=cutter(_MIX_CUTS[0])), 15))
    return register(_times_constant(p, MIX32_MULTIPLIERS[1], cut=cutter(_MIX_CUTS[1])))


class Quantize(wiring.Component):
    """Quantize a tile-major element stream to BFP: ``hbfp.golden.bfp.quantize``.

    Parameters: ``mantissa_bits`` m (sign included, 2..16), ``tile = (rows, cols)`` (T = rows *
    cols elements share an exponent), ``lanes`` L (elements per beat, T % L == 0) and
    ``input_format`` (``"fp32"`` or ``"bf16"``; bf16 is widened exactly, i.e. 16 zero bits are
    appended).

    Ports:

    - ``i`` (stream in), payload ``ArrayLayout(32 or 16, L)``: the tile-major element stream
      (tiles one after another, row-major inside a tile), L consecutive elements per beat, lane
      0 first. Every T/L beats form one tile.
    - ``o`` (stream out), payload ``StructLayout({"codes": ArrayLayout(signed(m), L),
      "exponent": 8, "last": 1})``: T/L beats per tile in the same element order; every beat
      carries its tile's E8M0 exponent code (``EXP_NAN`` for a NaN tile, whose codes are 0);
      ``last`` marks the final beat of a tile.
    - ``rounding`` (in, 2 bits): ``hbfp.contract.Rounding``; the unused code 3 rounds
      to nearest even.
    - ``seed`` (in, 32 bits): stochastic rounding uses ``R(n) = mix32(n ^ key) >> 16`` with
      ``key = mix32(seed ^ SEED_SALT)``, computed here into a register that follows ``seed``
      after ``KEY_LATENCY`` cycles.
    - ``clear`` (in, 1-cycle strobe): the next tile whose first beat is accepted in this cycle
      or later starts at stream position n = 0 (n is also 0 after reset). Without ``clear`` n
      keeps counting across tensors (mod 2**32), like one long stream.

    Each tile takes the ``rounding`` mode and key present in the cycle its first beat is
    accepted; so ``rounding`` and ``seed`` may change as soon as a tensor's last beat is in
    (set ``seed`` ``KEY_LATENCY`` cycles before the next tensor's first beat), without waiting
    for the output to drain. ``clear`` is meant for tensor boundaries: a strobe in the middle
    of a tile takes effect at the next tile.

    Throughput: L elements per cycle sustained (one beat in and one beat out per cycle). The
    tile is double-buffered in a 2T-element memory: tile t+1 fills while tile t drains.
    ``i.ready`` depends on registers only (no combinational path from ``o.ready``).

    Latency: the first output beat of a tile is valid ``LATENCY`` = 14 cycles after the cycle
    in which the tile's last input beat is accepted (without output stalls), i.e. T/L + 13
    cycles after its first beat on a gapless stream.

    Pipeline (every stage at most two chained carry chains or one chain and a LUT level, for
    150 MHz on an ECP5): the fill side registers each beat three times beside a tree that
    takes the max of its exponent fields (one level per stage), then writes it into the free
    bank; one cycle hands a completed bank over; the drain side reads the memory (1; ECP5:
    a DP16KD, its output register stage 2), registers the data once more (3); mix32 takes n's first xor-shift in
    stage 2 and then five stages (3: the xor with the key and the first multiply's
    first adder level; 4: its levels 2-3; 5: its level 4 and the xor-shift; 6: the second
    multiply's levels 1-2; 7: its levels 3-4) while the element is decoded (4), its shift
    clamped (5), aligned (6) and its sticky bit reduced (7); then come the rounding decision
    (8), the saturated magnitude (9) and the signed code (10, the output register). The key
    takes the same five stages from ``seed``; or, for tiles of ``SERIAL_KEY_BEATS`` beats or
    more (HBFP8's 24x24 tiles up to 8 lanes), the fill side carries the seed and a serial unit
    computes the tile's key while the tile fills (two bit-serial multiplies, 65 cycles); the
    drain waits for it, which it never has to on a gapless stream (a tile's fill is longer).

    ``stochastic`` False builds no random generator (no key, no multiplies): the stochastic
    code then rounds to nearest even like the unused code 3, and ``seed`` is unused; the
    latency stays the same. A reduced device (``CoreConfig.stochastic``) refuses stochastic
    requests before they get here.

    Resources: a 2T/L x (L * input width) simple dual-port memory; per lane an 8-bit
    max, a 55-bit right shifter, two 32-bit constant multiplies (low halves, as pipelined
    trees of 12-13 adders: no DSP blocks) and the rounding logic; two more constant
    multiplies for the key, or the serial key unit (one 32-bit adder). Without
    ``stochastic``, no multiplies.
    """

    def __init__(self, mantissa_bits: int, tile: tuple[int, int], lanes: int, input_format: str = "fp32", *,
                 stochastic: bool = True):
        try:
            fmt = self._check(mantissa_bits, tile, lanes, input_format)
        except (ValueError, TypeError):
            # A component that failed to construct was never meant to be elaborated: keep
            # Amaranth from warning that it went unused.
            self._MustUse__used = True
            raise
        rows, cols = fmt.tile
        self.fmt = fmt
        self.mantissa_bits = fmt.mantissa_bits
        self.tile = fmt.tile
        self.lanes = lanes
        self.input_format = input_format
        self.stochastic = bool(stochastic)
        self.tile_elements = rows * cols
        self.beats_per_tile = rows * cols // lanes
        #: Whether the key is computed serially per tile (``SERIAL_KEY_BEATS``).
        self.serial_key = self.stochastic and self.beats_per_tile >= SERIAL_KEY_BEATS
        self.element_width = INPUT_FORMATS[input_format]
        self.out_layout = data.StructLayout({
            "codes": data.ArrayLayout(signed(fmt.mantissa_bits), lanes),
            "exponent": unsigned(EXP_WIDTH),
            "last": unsigned(1),
        })
        super().__init__({
            "i": In(stream.Signature(data.ArrayLayout(unsigned(self.element_width), lanes))),
            "o": Out(stream.Signature(self.out_layout)),
            "rounding": In(Rounding),
            "seed": In(unsigned(32)),
            "clear": In(1),
        })

    @staticmethod
    def _check(mantissa_bits, tile, lanes, input_format) -> Format:
        # Format validates mantissa_bits and tile as the golden model does.
        fmt = Format(mantissa_bits, tuple(tile))
        if input_format not in INPUT_FORMATS:
            raise ValueError(f"input_format must be one of {tuple(INPUT_FORMATS)}, got {input_format!r}")
        if not isinstance(lanes, int) or lanes < 1:
            raise ValueError(f"lanes must be a positive integer, got {lanes!r}")
        rows, cols = fmt.tile
        if (rows * cols) % lanes:
            raise ValueError(
                f"lanes ({lanes}) must divide the tile's element count ({rows}x{cols} = {rows * cols}): "
                f"a beat never straddles two tiles")
        return fmt

    def elaborate(self, platform):
        m = Module()
        L, B, T = self.lanes, self.beats_per_tile, self.tile_elements
        ew = self.element_width

        # ---- the key: mix32(seed ^ SEED_SALT) but its final xor-shift (see _mix32_stages) ----
        # Pipelined from the ``seed`` port (KEY_LATENCY stages) for short tiles; for tiles of
        # SERIAL_KEY_BEATS beats or more the fill side carries the seed itself and a serial unit
        # computes each tile's key while the tile fills (``_serial_key``).
        key = Signal(32)
        if self.serial_key:
            m.d.comb += key.eq(self.seed)
        elif self.stochastic:
            def key_register(value):
                r = Signal(32)
                m.d.sync += r.eq(value)
                return r

            m.d.comb += key.eq(_mix32_stages(_xorshift(self.seed ^ SEED_SALT, 16), key_register))

        # ---- the tile buffer: two banks of B beats -----------------------------------------------
        # The drain reads only a full bank and the fill writes only a free one, so a read never
        # meets a write of its address: ``BlockRam``'s ``NO_RW_CHECK`` spares Yosys the logic to
        # forward write data on such a collision (a multiplexer behind the block RAM's output).
        # A ``BlockRam`` that stalls: its two stages (on an ECP5 the block RAM's address and
        # output registers) are the drain's stages 1 and 2, held while the pipeline waits.
        m.submodules.mem = mem = BlockRam(unsigned(ew * L), 2 * B, stall=True)
        wr = mem.write
        rd = mem.read0

        # Per-bank state, written by the fill side while the bank is free and read by the drain
        # side while it is full, so the two sides never race on it.
        full = Signal(2)
        bank = SimpleNamespace(
            exp=Array(Signal(EXP_WIDTH, name=f"bank_exp{b}") for b in range(2)),
            base=Array(Signal(32, name=f"bank_base{b}") for b in range(2)),
            key=Array(Signal(32, name=f"bank_key{b}") for b in range(2)),
            rnd=Array(Signal(len(self.rounding), name=f"bank_rnd{b}") for b in range(2)),
        )
        key_ready = Const(0b11, 2)  # the bank's key is there (the pipelined key: with its first beat)
        fill_done = self._fill(m, wr, full, bank, key)
        if self.serial_key:
            key_ready = self._serial_key(m, bank)
        drain_done = self._drain(m, rd, full & key_ready, bank)
        # A bank is never filled and drained in the same cycle (fill needs it free, drain full).
        m.d.sync += full.eq((full | fill_done) & ~drain_done)
        return m

    def _fill(self, m: Module, wr, full, bank, key):
        """The fill side: each accepted beat passes ``_FILL_STAGES`` registers, beside a tree
        that takes the max of its exponent fields, and the last one writes it into the free
        bank. Returns the bank that the last beat of a tile completes in this cycle (a mask)."""
        L, B, T = self.lanes, self.beats_per_tile, self.tile_elements
        ew = self.element_width

        # The whole fill pipeline moves unless its last beat waits for a full bank; i.ready is
        # therefore a function of registers only.
        go = Signal()
        accept = self.i.valid & go
        m.d.comb += self.i.ready.eq(go)

        # What a tile takes in the cycle its first beat is accepted: rounding mode, key, and
        # whether a ``clear`` came since the previous tile's first beat (its position restarts).
        in_beat = Signal(range(B))
        clear_pending = Signal()
        in_first = in_beat == 0
        with m.If(accept):
            m.d.sync += in_beat.eq(Mux(in_beat == B - 1, 0, in_beat + 1))
        with m.If(accept & in_first):
            m.d.sync += clear_pending.eq(0)
        with m.Elif(self.clear):
            m.d.sync += clear_pending.eq(1)

        # The exponent code is a max over the 8-bit exponent fields: 0xFF (NaN/inf) wins by
        # itself, and field 0 (zero, subnormal: DAZ) never raises it.
        def max_of(a, b):
            return Mux(a > b, a, b)

        levels = (L - 1).bit_length()
        per_stage = [levels // _FILL_STAGES + (k < levels % _FILL_STAGES) for k in range(_FILL_STAGES)]
        fields = [self.i.payload[l][ew - 1 - EXP_WIDTH:ew - 1] for l in range(L)]
        stage = SimpleNamespace(valid=accept, data=self.i.payload.as_value(), first=in_first,
                                clear=self.clear | clear_pending, key=key, rnd=self.rounding)
        for k in range(_FILL_STAGES):
            for _ in range(per_stage[k]):  # a balanced comparator tree over the lanes
                fields = [max_of(fields[j], fields[j + 1]) if j + 1 < len(fields) else fields[j]
                          for j in range(0, len(fields), 2)]
            nxt = SimpleNamespace()
            for name, value in vars(stage).items():
                reg = Signal(Value.cast(value).shape(), name=f"f{k + 1}_{name}", reset_less=name != "valid")
                with m.If(go):
                    m.d.sync += reg.eq(value)
                setattr(nxt, name, reg)
            regs = [Signal(EXP_WIDTH, name=f"f{k + 1}_max{j}", reset_less=True) for j in range(len(fields))]
            with m.If(go):
                m.d.sync += [r.eq(f) for r, f in zip(regs, fields)]
            stage, fields = nxt, regs
        [beat_max] = fields

        # The write stage.
        wr_bank = Signal()
        wr_beat = Signal(range(B))
        run_max = Signal(EXP_WIDTH)  # max exponent field of the tile so far
        next_base = Signal(32)  # stream position of the next tile's first element
        m.d.comb += go.eq(~(stage.valid & full.bit_select(wr_bank, 1)))
        write = stage.valid & go
        first = Signal(init=1)  # wr_beat == 0, kept as a flag beside it (no compare before the key unit's start)
        tile_max = Signal(EXP_WIDTH)
        m.d.comb += tile_max.eq(Mux(first, beat_max, max_of(beat_max, run_max)))
        start_base = Mux(stage.clear, 0, next_base)
        m.d.comb += [
            wr.addr.eq(wr_beat + Mux(wr_bank, B, 0)),
            wr.data.eq(stage.data),
            wr.en.eq(write),
        ]
        fill_done = Signal(2)
        bank.start = write & first  # a tile's first write: the serial key unit starts on its seed
        bank.start_bank = wr_bank
        bank.start_seed = stage.key
        with m.If(write):
            m.d.sync += run_max.eq(tile_max)
            with m.If(first):
                m.d.sync += [
                    bank.base[wr_bank].eq(start_base),
                    bank.rnd[wr_bank].eq(stage.rnd),
                    next_base.eq(start_base + T),
                ]
                if not self.serial_key:  # (the serial key unit writes the key, from this seed)
                    m.d.sync += bank.key[wr_bank].eq(stage.key)
            m.d.sync += first.eq(0)
            with m.If(wr_beat == B - 1):
                m.d.comb += fill_done.eq(Mux(wr_bank, 0b10, 0b01))
                m.d.sync += [
                    wr_beat.eq(0),
                    first.eq(1),
                    wr_bank.eq(~wr_bank),
                    bank.exp[wr_bank].eq(tile_max),
                ]
            with m.Else():
                m.d.sync += wr_beat.eq(wr_beat + 1)
        return fill_done

    def _serial_key(self, m: Module, bank):
        """The key of each tile, from the seed its first beat took: mix32(seed ^ SEED_SALT)
        without the final xor-shift (as ``_mix32_stages``), by two bit-serial multiplies by
        the constants (32 steps each: the multiplicand shifts left a bit a step and is added
        where the constant has a one), written into the tile's bank at the end. Returns the
        banks whose key is there (a mask): ``_SERIAL_KEY_CYCLES`` cycles after the tile's
        first write, no later than its last (a tile has at least SERIAL_KEY_BEATS beats). The
        start, its bank and seed are registered first: the unit then starts from flip-flops
        (its fan-out to the multiplicand's 32 bits does not follow the fill's decision)."""
        running = Signal()
        second = Signal()  # the second multiply
        end = Signal()  # this step is its multiply's last (a flag, so that no compare precedes the adder)
        count = Signal(range(32))
        acc = Signal(32)
        xs = Signal(32)  # the multiplicand, shifted left a bit a step
        bits = Signal(32)  # the constant's bits not yet taken, lowest first
        target = Signal()
        ready = Signal(2, init=0b11)
        total = (acc + Mux(bits[0], xs, 0))[:32]
        start, start_bank, start_seed = Signal(), Signal(), Signal(32)
        m.d.sync += [start.eq(bank.start), start_bank.eq(bank.start_bank), start_seed.eq(bank.start_seed)]
        with m.If(start):
            m.d.sync += [running.eq(1), second.eq(0), end.eq(0), count.eq(0), acc.eq(0),
                         xs.eq(_xorshift(start_seed ^ SEED_SALT, 16)), bits.eq(MIX32_MULTIPLIERS[0]),
                         target.eq(start_bank), ready.bit_select(start_bank, 1).eq(0)]
        with m.Elif(running):
            with m.If(end & ~second):  # the first product done: its xor-shift is the second's multiplicand
                m.d.sync += [second.eq(1), end.eq(0), count.eq(0), acc.eq(0), xs.eq(_xorshift(total, 15)),
                             bits.eq(MIX32_MULTIPLIERS[1])]
            with m.Elif(end):
                m.d.sync += [running.eq(0), bank.key[target].eq(total), ready.bit_select(target, 1).eq(1)]
            with m.Else():
                m.d.sync += [count.eq(count + 1), end.eq(count == 30), acc.eq(total), xs.eq(xs << 1),
                             bits.eq(bits >> 1)]
        return ready

    def _drain(self, m: Module, rd, full, bank):
        """The drain side: a pipeline in which all stages advance together. Returns the bank
        whose last read is issued in this cycle (a mask)."""
        L, B = self.lanes, self.beats_per_tile
        mb = self.mantissa_bits
        qmax = self.fmt.qmax
        ew = self.element_width

        advance = Signal()
        m.d.comb += advance.eq(~self.o.valid | self.o.ready)

        def register(value, name):
            r = Signal(Value.cast(value).shape(), name=name, reset_less=True)
            with m.If(advance):
                m.d.sync += r.eq(value)
            return r

        def delay(value, stages, name):
            for k in range(stages):
                value = register(value, f"{name}_d{k + 1}")
            return value

        rd_bank = Signal()
        rd_beat = Signal(range(B))
        rd_off = Signal(range(self.tile_elements + 1))  # rd_beat * L
        s0_valid = full.bit_select(rd_bank, 1)
        m.d.comb += [
            rd.addr.eq(rd_beat + Mux(rd_bank, B, 0)),
            # A stalled pipeline keeps the read data: the memory's two stages hold too.
            rd.en.eq(advance),
        ]
        drain_done = Signal(2)
        with m.If(advance & s0_valid):
            with m.If(rd_beat == B - 1):
                m.d.comb += drain_done.eq(Mux(rd_bank, 0b10, 0b01))
                m.d.sync += [rd_beat.eq(0), rd_off.eq(0), rd_bank.eq(~rd_bank)]
            with m.Else():
                m.d.sync += [rd_beat.eq(rd_beat + 1), rd_off.eq(rd_off + L)]

        # Stage 1: memory data; the beat's stream position, exponent, key and mode. The valid
        # bits (stages 1 to _DRAIN_STAGES, then the output's) are the only registers with a reset.
        valids = [Signal(name=f"s{k + 1}_valid") for k in range(_DRAIN_STAGES)]
        with m.If(advance):
            m.d.sync += [v.eq(u) for v, u in zip(valids, [s0_valid] + valids[:-1])]
            m.d.sync += self.o.valid.eq(valids[-1])
        s1_n = register(bank.base[rd_bank] + rd_off, "s1_n")
        s1_exp = register(bank.exp[rd_bank], "s1_exp")
        s1_key = register(bank.key[rd_bank], "s1_key")
        s1_rnd = register(bank.rnd[rd_bank], "s1_rnd")
        s1_last = register(rd_beat == B - 1, "s1_last")

        # Stages 2-3: the block RAM's output register (``BlockRam``'s second stage), then one
        # more: its clock-to-out leaves no time for logic or a long route after it. The tile's
        # exponent less the alignment offset, the NaN-tile flag.
        assert BlockRam.LATENCY == 2
        word = register(rd.data, "s3_word")
        exp_adj = delay(s1_exp + (_MAX_MANTISSA - mb), 2, "exp_adj")
        nan_tile = delay(s1_exp == EXP_NAN, 2, "nan_tile")
        key = register(s1_key, "s2_key")

        # The per-beat values that travel to the output register, and the mode to the rounding
        # stage (which reads stage 2 + _MIX_STAGES).
        last = delay(s1_last, _DRAIN_STAGES - 1, "last")
        exponent = delay(s1_exp, _DRAIN_STAGES - 1, "exp")
        rnd = delay(s1_rnd, 1 + _MIX_STAGES, "rnd")

        for l in range(L):
            raw = word[l * ew:(l + 1) * ew]
            x = Cat(Const(0, FP32_WIDTH - ew), raw)  # bf16 -> fp32: append 16 zero bits
            field = x[_FRAC_BITS:_FRAC_BITS + EXP_WIDTH]

            # The random bits: R(n) = top RANDOM_BITS of mix32(n ^ key); the first xor-shift is
            # taken on n alone (the key register holds the key before its last one).
            r = Const(0, RANDOM_BITS)
            if self.stochastic:
                nx = register(_xorshift(s1_n + l, 16), f"s2_nx{l}")
                r = _mix32_stages(nx ^ key, lambda v: register(v, f"mix{l}"))[32 - RANDOM_BITS:]

            # The element, beside the generator. Stage 4: t = E - field + (16 - m) >= 0 (E is
            # the tile's max); the significand; a DAZ element or a NaN tile has code 0.
            t = register(exp_adj - field, f"s4_t{l}")
            sig = register(Cat(x[:_FRAC_BITS], 1), f"s4_sig{l}")
            sign = register(x[-1], f"s4_sign{l}")
            zero = register((field == 0) | nan_tile, f"s4_zero{l}")
            # Stage 5: the clamped alignment shift.
            shift = register(Mux(t > _SHIFT_CLAMP, _SHIFT_CLAMP, t)[:Shape.cast(range(_SHIFT_CLAMP + 1)).width],
                             f"s5_shift{l}")
            sig = register(sig, f"s5_sig{l}")
            # Stage 6: align to RANDOM_BITS fraction bits. Every bit of sig << _SHIFT_CLAMP
            # survives the shift, so the bits below A give an exact sticky bit: significand bit
            # i falls below A when shift > _PRESHIFT + i, a table of the shift (LUTs beside the
            # shifter). At the clamp A = 0 with a zero round bit, the code of every larger shift.
            a_width = mb - 1 + RANDOM_BITS  # |y| < 2**(m-1): t >= _MAX_MANTISSA - m
            drop = _SHIFT_CLAMP - _PRESHIFT
            aligned = (Cat(Const(0, _SHIFT_CLAMP), sig) >> shift)[drop:drop + a_width]
            below = Signal(_FRAC_BITS + 1, name=f"s5_below{l}")
            with m.Switch(shift):
                for k in range(_SHIFT_CLAMP + 1):
                    with m.Case(k):
                        m.d.comb += below.eq((1 << min(max(k - _PRESHIFT, 0), _FRAC_BITS + 1)) - 1)
            a = register(aligned, f"s6_a{l}")  # |y| with RANDOM_BITS fraction bits, truncated
            dropped = register(sig & below, f"s6_dropped{l}")
            # Stage 7 (with the random bits): the sticky bit, any bit of |y| below A.
            sticky = register(dropped.any(), f"s7_sticky{l}")
            a = register(a, f"s7_a{l}")
            sign = delay(sign, 3, f"sign{l}")
            zero = delay(zero, 3, f"zero{l}")

            # Rounding stage: the decision to round the magnitude up.
            q_int = a[RANDOM_BITS:]
            frac = a[:RANDOM_BITS]
            up = Signal(name=f"up{l}")
            with m.Switch(rnd):
                with m.Case(Rounding.TOWARD_ZERO):
                    m.d.comb += up.eq(0)
                if self.stochastic:
                    with m.Case(Rounding.STOCHASTIC):
                        m.d.comb += up.eq((frac + r)[RANDOM_BITS])
                with m.Default():  # nearest_even
                    m.d.comb += up.eq(frac[-1] & (q_int[0] | frac[:-1].any() | sticky))
            s_up = register(up, f"r1_up{l}")
            s_q_int = register(q_int, f"r1_q{l}")
            sign = register(sign, f"r1_sign{l}")
            zero = register(zero, f"r1_zero{l}")
            # Saturation stage: q <= 2**(m-1) since q_int <= 2**(m-1) - 1.
            q = Signal(mb, name=f"r2_sum{l}")
            m.d.comb += q.eq(s_q_int + s_up)
            q_sat = register(Mux(q[mb - 1], qmax, q[:mb - 1]), f"r2_q{l}")
            sign = register(sign, f"r2_sign{l}")
            zero = register(zero, f"r2_zero{l}")
            # Output stage: the sign.
            with m.If(advance):
                m.d.sync += self.o.payload.codes[l].eq(Mux(zero, 0, Mux(sign, -q_sat, q_sat)))

        with m.If(advance):
            m.d.sync += [self.o.payload.exponent.eq(exponent), self.o.payload.last.eq(last)]
        return drain_done
