"""The BFP quantizer: a tile-major fp32 (or bf16) stream in, BFP codes and exponents out."""

from __future__ import annotations

from amaranth.hdl import Array, Cat, Const, Module, Mux, Signal, signed, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from hbfp.contract import QUANTIZE_LATENCY, Rounding
from hbfp.golden.bfp import Format

from .params import BF16_WIDTH, EXP_NAN, EXP_WIDTH, F32_FRAC_BITS, FP32_WIDTH, MIX32_MULTIPLIERS, RANDOM_BITS, SEED_SALT

__all__ = ["Quantize", "INPUT_FORMATS", "KEY_LATENCY", "LATENCY", "MIX32_MULTIPLIERS"]

#: Element widths of the supported input formats.
INPUT_FORMATS = {"fp32": FP32_WIDTH, "bf16": BF16_WIDTH}
#: Cycles from a change of the ``seed`` port until the registered key follows it.
KEY_LATENCY = 2
#: Cycles from the cycle in which a tile's last input beat is accepted to the cycle in which
#: its first output beat is valid (without output stalls): the bank handover, the memory read
#: and four pipeline stages (the contract's ``QUANTIZE_LATENCY``, which ``emu`` counts).
LATENCY = QUANTIZE_LATENCY

_FRAC_BITS = F32_FRAC_BITS  # fp32 fraction field
_MAX_MANTISSA = 16  # the widest format (Format allows 2..16): alignment shifts start at 0 there
# Alignment: with d = E - field, an element's |y| * 2**RANDOM_BITS is sig * 2**(_PRESHIFT - t)
# for t = d + (_MAX_MANTISSA - m) >= 0 (sig: the 24-bit significand).
_PRESHIFT = RANDOM_BITS + _MAX_MANTISSA - 2 - _FRAC_BITS
# t is clamped here: from here up sig * 2**(_PRESHIFT - t) < 1, i.e. |y| < 2**-RANDOM_BITS and the
# code is 0 in every rounding mode.
_SHIFT_CLAMP = _PRESHIFT + _FRAC_BITS + 1


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


def _times_constant(x, c: int, width: int = 32):
    """``x * c mod 2**width`` as shifts, adds and subtracts of ``x`` (the NAF of ``c``, a tree of
    ``width``-bit adders): a multiply by a constant takes no DSP block, which the MAC array
    needs (an ECP5 maps every ``$mul`` to one or more MULT18X18D)."""
    plus = [(x << s)[:width] for s, d in _naf(c % 2**width) if s < width and d > 0]
    minus = [(x << s)[:width] for s, d in _naf(c % 2**width) if s < width and d < 0]

    def total(terms):
        while len(terms) > 1:
            terms = [(terms[i] + terms[i + 1])[:width] if i + 1 < len(terms) else terms[i]
                     for i in range(0, len(terms), 2)]
        return terms[0] if terms else 0

    return (total(plus) - total(minus))[:width] if minus else total(plus)


def _mix32_first(x):
    """The first half of mix32, up to and including the first multiply (one pipeline stage)."""
    return _times_constant(x ^ (x >> 16), MIX32_MULTIPLIERS[0])


def _mix32_second(x):
    """The second multiply of mix32 (one pipeline stage); the final ``x ^= x >> 16`` leaves the
    top 16 bits alone, so the top ``RANDOM_BITS`` of this product already are the random bits."""
    return _times_constant(x ^ (x >> 15), MIX32_MULTIPLIERS[1])


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

    Latency: the first output beat of a tile is valid ``LATENCY`` = 6 cycles after the cycle
    in which the tile's last input beat is accepted (without output stalls), i.e. T/L + 5
    cycles after its first beat on a gapless stream.

    ``stochastic`` False builds no random generator (no key, no multiplies): the stochastic
    code then rounds to nearest even like the unused code 3, and ``seed`` is unused. A reduced
    device (``CoreConfig.stochastic``) refuses stochastic requests before they get here.

    Resources: a 2T/L x (L * input width) simple dual-port memory; per lane an 8-bit
    max, a 55-bit right shifter, two 32-bit constant multiplies (low halves, one pipeline stage
    each, as trees of 12-13 adders: no DSP blocks) and the rounding logic; two more constant
    multiplies for the key. Without ``stochastic``, no multiplies.
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
        mb = self.mantissa_bits
        qmax = self.fmt.qmax
        ew = self.element_width

        # ---- the key: mix32(seed ^ SEED_SALT), one multiply per stage -------------------------
        key = Signal(32)
        if self.stochastic:
            key_h1 = Signal(32)
            key_h2 = Signal(32)
            m.d.sync += key_h1.eq(_mix32_first(self.seed ^ SEED_SALT))
            m.d.comb += key_h2.eq(_mix32_second(key_h1))
            m.d.sync += key.eq(key_h2 ^ (key_h2 >> 16))

        # ---- the tile buffer: two banks of B beats -----------------------------------------------
        m.submodules.mem = mem = Memory(shape=unsigned(ew * L), depth=2 * B, init=[])
        wr = mem.write_port()
        rd = mem.read_port(domain="sync")

        # Per-bank state, written by the fill side while the bank is free and read by the drain
        # side while it is full, so the two sides never race on it.
        full = Signal(2)
        bank_exp = Array(Signal(EXP_WIDTH, name=f"bank_exp{b}") for b in range(2))
        bank_base = Array(Signal(32, name=f"bank_base{b}") for b in range(2))
        bank_key = Array(Signal(32, name=f"bank_key{b}") for b in range(2))
        bank_rnd = Array(Signal(len(self.rounding), name=f"bank_rnd{b}") for b in range(2))

        # ---- fill side --------------------------------------------------------------------------
        wr_bank = Signal()
        wr_beat = Signal(range(B))
        run_max = Signal(EXP_WIDTH)  # max exponent field of the tile so far
        next_base = Signal(32)  # stream position of the next tile's first element

        m.d.comb += self.i.ready.eq(~full.bit_select(wr_bank, 1))

        # The exponent code is a max over the 8-bit exponent fields: 0xFF (NaN/inf) wins by
        # itself, and field 0 (zero, subnormal: DAZ) never raises it.
        def max_of(a, b, name):
            r = Signal(EXP_WIDTH, name=name)
            m.d.comb += r.eq(Mux(a > b, a, b))
            return r

        level = [self.i.payload[l][ew - 1 - EXP_WIDTH:ew - 1] for l in range(L)]
        depth = 0
        while len(level) > 1:  # a balanced comparator tree over the lanes
            level = [max_of(level[k], level[k + 1], f"field_max{depth}_{k // 2}") if k + 1 < len(level) else level[k]
                     for k in range(0, len(level), 2)]
            depth += 1
        beat_max = level[0]
        first_in = wr_beat == 0
        tile_max = Signal(EXP_WIDTH)
        m.d.comb += tile_max.eq(Mux(first_in, beat_max, max_of(beat_max, run_max, "field_max_run")))
        start_base = Mux(self.clear, 0, next_base)

        m.d.comb += [
            wr.addr.eq(wr_beat + Mux(wr_bank, B, 0)),
            wr.data.eq(self.i.payload.as_value()),
            wr.en.eq(self.i.valid & self.i.ready),
        ]
        with m.If(self.i.valid & self.i.ready):
            m.d.sync += run_max.eq(tile_max)
            with m.If(first_in):
                m.d.sync += [
                    bank_base[wr_bank].eq(start_base),
                    bank_key[wr_bank].eq(key),
                    bank_rnd[wr_bank].eq(self.rounding),
                    next_base.eq(start_base + T),
                ]
            with m.Elif(self.clear):
                m.d.sync += next_base.eq(0)
            with m.If(wr_beat == B - 1):
                m.d.sync += [
                    wr_beat.eq(0),
                    wr_bank.eq(~wr_bank),
                    bank_exp[wr_bank].eq(tile_max),
                ]
            with m.Else():
                m.d.sync += wr_beat.eq(wr_beat + 1)
        with m.Elif(self.clear):
            m.d.sync += next_base.eq(0)

        # ---- drain side: a pipeline in which all stages advance together ------------------------
        advance = Signal()
        m.d.comb += advance.eq(~self.o.valid | self.o.ready)

        rd_bank = Signal()
        rd_beat = Signal(range(B))
        rd_off = Signal(range(T + 1))  # rd_beat * L
        s0_valid = full.bit_select(rd_bank, 1)
        m.d.comb += [
            rd.addr.eq(rd_beat + Mux(rd_bank, B, 0)),
            # A stalled pipeline keeps the read data: the memory's output register is stage 1.
            rd.en.eq(advance),
        ]

        # Stage 1: memory data; the beat's stream position, exponent, key and mode.
        s1_valid = Signal()
        s1_n = Signal(32)
        s1_exp = Signal(EXP_WIDTH)
        s1_key = Signal(32)
        s1_rnd = Signal(len(self.rounding))
        s1_last = Signal()

        fill_done = Signal(2)  # the fill side completes a bank in this cycle
        drain_done = Signal(2)  # the drain side issues a bank's last read in this cycle
        with m.If(self.i.valid & self.i.ready & (wr_beat == B - 1)):
            m.d.comb += fill_done.eq(Mux(wr_bank, 0b10, 0b01))
        with m.If(advance):
            m.d.sync += [
                s1_valid.eq(s0_valid),
                s1_n.eq(bank_base[rd_bank] + rd_off),
                s1_exp.eq(bank_exp[rd_bank]),
                s1_key.eq(bank_key[rd_bank]),
                s1_rnd.eq(bank_rnd[rd_bank]),
                s1_last.eq(rd_beat == B - 1),
            ]
            with m.If(s0_valid):
                with m.If(rd_beat == B - 1):
                    m.d.comb += drain_done.eq(Mux(rd_bank, 0b10, 0b01))
                    m.d.sync += [rd_beat.eq(0), rd_off.eq(0), rd_bank.eq(~rd_bank)]
                with m.Else():
                    m.d.sync += [rd_beat.eq(rd_beat + 1), rd_off.eq(rd_off + L)]
        # A bank is never filled and drained in the same cycle (fill needs it free, drain full).
        m.d.sync += full.eq((full | fill_done) & ~drain_done)

        # Per-lane registers of stages 2..4.
        def lane_sigs(name, shape):
            return [Signal(shape, name=f"{name}{l}") for l in range(L)]

        s2_h = lane_sigs("s2_h", 32)  # n ^ key
        s2_sig = lane_sigs("s2_sig", _FRAC_BITS + 1)  # significand with the hidden bit
        s2_shift = lane_sigs("s2_shift", range(_SHIFT_CLAMP + 1))
        s2_sign = lane_sigs("s2_sign", 1)
        s2_zero = lane_sigs("s2_zero", 1)  # DAZ element or NaN tile: code 0
        s3_h = lane_sigs("s3_h", 32)
        a_width = mb - 1 + RANDOM_BITS  # |y| < 2**(m-1): t >= _MAX_MANTISSA - m
        s3_a = lane_sigs("s3_a", a_width)  # |y| with RANDOM_BITS fraction bits, truncated
        s3_sticky = lane_sigs("s3_sticky", 1)  # any bit of |y| below those
        s3_sign = lane_sigs("s3_sign", 1)
        s3_zero = lane_sigs("s3_zero", 1)
        s4_r = lane_sigs("s4_r", RANDOM_BITS)
        s4_a = lane_sigs("s4_a", a_width)
        s4_sticky = lane_sigs("s4_sticky", 1)
        s4_sign = lane_sigs("s4_sign", 1)
        s4_zero = lane_sigs("s4_zero", 1)
        s2_valid, s3_valid, s4_valid = Signal(), Signal(), Signal()
        s2_exp, s3_exp, s4_exp = Signal(EXP_WIDTH), Signal(EXP_WIDTH), Signal(EXP_WIDTH)
        s2_rnd, s3_rnd, s4_rnd = (Signal(len(self.rounding)) for _ in range(3))
        s2_last, s3_last, s4_last = Signal(), Signal(), Signal()

        with m.If(advance):
            m.d.sync += [
                s2_valid.eq(s1_valid), s3_valid.eq(s2_valid), s4_valid.eq(s3_valid),
                s2_exp.eq(s1_exp), s3_exp.eq(s2_exp), s4_exp.eq(s3_exp),
                s2_rnd.eq(s1_rnd), s3_rnd.eq(s2_rnd), s4_rnd.eq(s3_rnd),
                s2_last.eq(s1_last), s3_last.eq(s2_last), s4_last.eq(s3_last),
                self.o.valid.eq(s4_valid),
                self.o.payload.exponent.eq(s4_exp),
                self.o.payload.last.eq(s4_last),
            ]

        word = rd.data
        s1_nan = Signal()
        m.d.comb += s1_nan.eq(s1_exp == EXP_NAN)
        for l in range(L):
            raw = word[l * ew:(l + 1) * ew]
            x = Cat(Const(0, FP32_WIDTH - ew), raw)  # bf16 -> fp32: append 16 zero bits
            field = x[_FRAC_BITS:_FRAC_BITS + EXP_WIDTH]
            # y = |x| * 2**((m-2) - E); A = |y| * 2**RANDOM_BITS = sig * 2**(_PRESHIFT - t).
            shift = Signal(range(2**EXP_WIDTH + _MAX_MANTISSA), name=f"s1_shift{l}")
            m.d.comb += shift.eq(s1_exp - field + (_MAX_MANTISSA - mb))  # E - field >= 0: E is the tile's max
            with m.If(advance):
                if self.stochastic:  # stage 1 -> 2: the random generator's counter and key
                    m.d.sync += s2_h[l].eq((s1_n + l) ^ s1_key)
                m.d.sync += [
                    # Stage 1 -> 2: the element decoded.
                    s2_sig[l].eq(Cat(x[:_FRAC_BITS], 1)),
                    s2_shift[l].eq(Mux(shift > _SHIFT_CLAMP, _SHIFT_CLAMP, shift)),
                    s2_sign[l].eq(x[-1]),
                    s2_zero[l].eq((field == 0) | s1_nan),
                ]
            # Stage 2 -> 3: align to RANDOM_BITS fraction bits. Every bit of sig << _SHIFT_CLAMP
            # survives the shift, so the bits below A give an exact sticky bit. At the clamp
            # A = 0 with a zero round bit, which is the code of every larger shift too.
            aligned = Signal(_SHIFT_CLAMP + _FRAC_BITS + 1, name=f"s2_aligned{l}")
            m.d.comb += aligned.eq(Cat(Const(0, _SHIFT_CLAMP), s2_sig[l]) >> s2_shift[l])
            drop = _SHIFT_CLAMP - _PRESHIFT
            with m.If(advance):
                if self.stochastic:  # the two multiplies of mix32, a stage each; R is the top bits
                    m.d.sync += [
                        s3_h[l].eq(_mix32_first(s2_h[l])),
                        s4_r[l].eq(_mix32_second(s3_h[l])[32 - RANDOM_BITS:]),
                    ]
                m.d.sync += [
                    s3_a[l].eq(aligned[drop:drop + a_width]),
                    s3_sticky[l].eq(aligned[:drop].any()),
                    s3_sign[l].eq(s2_sign[l]),
                    s3_zero[l].eq(s2_zero[l]),
                    s4_a[l].eq(s3_a[l]),
                    s4_sticky[l].eq(s3_sticky[l]),
                    s4_sign[l].eq(s3_sign[l]),
                    s4_zero[l].eq(s3_zero[l]),
                ]
            # Stage 4 -> output: round the magnitude, saturate, apply the sign.
            a = s4_a[l]
            q_int = a[RANDOM_BITS:]
            frac = a[:RANDOM_BITS]
            up = Signal(name=f"s4_up{l}")
            with m.Switch(s4_rnd):
                with m.Case(Rounding.TOWARD_ZERO):
                    m.d.comb += up.eq(0)
                if self.stochastic:
                    with m.Case(Rounding.STOCHASTIC):
                        m.d.comb += up.eq((frac + s4_r[l])[RANDOM_BITS])
                with m.Default():  # nearest_even
                    m.d.comb += up.eq(frac[-1] & (q_int[0] | frac[:-1].any() | s4_sticky[l]))
            q = Signal(mb, name=f"s4_q{l}")  # <= 2**(m-1): q_int <= 2**(m-1) - 1
            q_sat = Signal(mb - 1, name=f"s4_qsat{l}")
            m.d.comb += [
                q.eq(q_int + up),
                q_sat.eq(Mux(q[mb - 1], qmax, q[:mb - 1])),
            ]
            with m.If(advance):
                m.d.sync += self.o.payload.codes[l].eq(Mux(s4_zero[l], 0, Mux(s4_sign[l], -q_sat, q_sat)))

        return m
