"""The bf16 activation unit: every activation function and gradient of
``hbfp.golden.activations``, one result per cycle (docs/numerics.md, section 4).

Structure (one pipeline, every stage advancing together; each stage at most one carry chain
and a few LUT levels, or a block RAM's clock-to-out into a register, for 150 MHz on an ECP5):

- stages 1-3 of the table units (``ActivationTables``): the ROM address of every table unit,
  from the input's sign, exponent field and mantissa (``TableUnit`` indexing, out-of-window
  fields clamped as the golden model does), registered; the ROM read (synchronous); the
  table words registered as they leave the block RAMs (whose clock-to-out leaves no time for
  logic behind them);
- stages 1-3 beside them: the input carried along, and at stage 3 what depends on the input
  alone: its classes, the rule values and each table's window tests;
- stage 4: the function's output (``y``), chosen from the table word or a rule
  (``small_rule``, ``large_rule_pos``/``large_rule_neg``), or from comparators (relu,
  leaky_relu and their derivatives), with NaN inputs overriding everything, and the
  multiplier's second operand (the upstream gradient ``g`` for a gradient function, 1.0 for a
  unary one);
- stages 5-7: ``MulBF16Datapath`` computes ``bf16.mul(y, operand)``.

``ActivationDatapath`` is that pipeline; ``Activation`` puts stream ports around it.

A unary function goes through the multiplier too, times 1.0: every unit output is a normal,
a zero, an inf or ``QNAN | sign`` (never a subnormal), and the multiplier returns each of
those unchanged (the product of an 8-bit significand with 1.0 is exact, and a NaN times +1.0
keeps its sign), so no bypass registers or output multiplexer are needed.

The table contents, the windows and the rules are read from ``hbfp.golden.activations`` at
elaboration time (``table_unit(name)``): the gateware cannot drift from the golden model.
"""

from __future__ import annotations


from types import SimpleNamespace

from amaranth import Array, Cat, Const, Module, Mux, Signal, Value
from amaranth.lib import data, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from hbfp.golden import activations
from hbfp.golden.activations import FIELD_INF, LEAKY_SHIFT, MANT_BITS
from hbfp.golden.bf16 import QNAN

from hbfp.contract import ACTIVATION_LATENCY, FUNCTIONS, GRADIENT_FUNCTIONS, UNARY_FUNCTIONS, function_code
from hbfp.golden.activations import evaluate

from .params import BF16_WIDTH, EXP_BIAS

__all__ = [
    "FUNCTIONS",
    "UNARY_FUNCTIONS",
    "GRADIENT_FUNCTIONS",
    "FUNC_WIDTH",
    "BF16",
    "ACTIVATION_INPUT",
    "function_code",
    "evaluate",
    "table_of",
    "rom_bits",
    "MulBF16Datapath",
    "words_layout",
    "ActivationTables",
    "ActivationDatapath",
    "Activation",
]

# The runtime function codes are the device contract's (a function's code is its index in
# ``FUNCTIONS``), re-exported for the gateware.
#: Width of the ``func`` field.
FUNC_WIDTH = (len(FUNCTIONS) - 1).bit_length()

#: A bf16 pattern's fields (packed from the LSB, as in the IEEE format).
BF16 = data.StructLayout({"mantissa": MANT_BITS, "field": BF16_WIDTH - MANT_BITS - 1, "sign": 1})
#: One input beat of the activation unit.
ACTIVATION_INPUT = data.StructLayout({"x": BF16_WIDTH, "g": BF16_WIDTH, "func": FUNC_WIDTH})

#: Words of one ROM part: a DP16KD block RAM holds 1024 x 16 bits.
_ROM_PART_BITS = 10
_ROM_PART = 1 << _ROM_PART_BITS

_SIGN = 1 << (BF16_WIDTH - 1)
_INF = FIELD_INF << MANT_BITS
_ONE = EXP_BIAS << MANT_BITS


def table_of(name: str) -> str | None:
    """The table unit (``activations.TABLE_NAMES``) function ``name`` reads, or None for the
    comparator functions (relu, leaky_relu and their gradients)."""
    function_code(name)
    unit = name[: -len("_grad")] + "_deriv" if name.endswith("_grad") else name
    return unit if unit in activations.TABLE_NAMES else None


def _check_functions(functions) -> tuple[str, ...]:
    if isinstance(functions, str):
        raise TypeError("functions must be a collection of names, not a string")
    names = tuple(functions)
    for n in names:
        function_code(n)
    if not names:
        raise ValueError("functions must name at least one function")
    # Canonical order, duplicates dropped: the hardware does not depend on the caller's order.
    return tuple(n for n in FUNCTIONS if n in names)


def rom_bits(functions=FUNCTIONS) -> int:
    """ROM bits an ``Activation(functions=...)`` holds (16 per table word)."""
    units = {table_of(n) for n in _check_functions(functions)} - {None}
    return sum(activations.table_unit(u).rom_bits for u in units)


def _classes(v: data.View):
    """(zero after DAZ, inf, NaN) of a bf16 view."""
    top = v.field == FIELD_INF
    return v.field == 0, top & (v.mantissa == 0), top & (v.mantissa != 0)


class MulBF16Datapath(wiring.Component):
    """bf16 x bf16 -> bf16 product, equal to ``hbfp.golden.bf16.mul``: DAZ on both inputs,
    the exact product of the 8-bit significands rounded once (RNE), overflow to +-inf, FTZ
    after rounding; NaN when an input is NaN or for 0 * inf, as ``QNAN`` with the sign
    ``sign(a) ^ sign(b)`` (the golden model's rule too).

    Advance/valid pipeline: every register moves when ``advance`` is high; ``o_valid``
    follows ``i_valid`` ``LATENCY`` advances later. Latency 3 cycles, one product per cycle:
    (1) the significand product (a DSP block), the field sum, the classes; (2) normalization,
    the rounding decision and its carry, the range tests; (3) the rounding increment and the
    result.

    Ports: ``advance``, ``i_valid``, ``a``, ``b`` (bf16 patterns) in; ``o_valid``, ``o`` out.
    """

    #: Register stages between ``a``/``b`` and ``o``.
    LATENCY = 3

    def __init__(self):
        super().__init__(
            {
                "advance": In(1),
                "i_valid": In(1),
                "a": In(BF16_WIDTH),
                "b": In(BF16_WIDTH),
                "o_valid": Out(1),
                "o": Out(BF16_WIDTH),
            }
        )

    def elaborate(self, platform):
        m = Module()
        sig_bits = MANT_BITS + 1
        a = data.View(BF16, self.a)
        b = data.View(BF16, self.b)
        a_zero, a_inf, a_nan = _classes(a)
        b_zero, b_inf, b_nan = _classes(b)

        # Stage 1: the 8x8 significand product (one DSP multiplier; its output register is
        # this stage's register), the exponent-field sum and the special classes.
        prod = Signal(2 * sig_bits, reset_less=True)
        field_sum = Signal(a.field.shape().width + 1, reset_less=True)
        sign = Signal(reset_less=True)
        nan = Signal(reset_less=True)
        inf = Signal(reset_less=True)
        zero = Signal(reset_less=True)
        valid = Signal()
        with m.If(self.advance):
            m.d.sync += [
                prod.eq(Cat(a.mantissa, Const(1, 1)) * Cat(b.mantissa, Const(1, 1))),
                field_sum.eq(a.field + b.field),
                sign.eq(a.sign ^ b.sign),
                nan.eq(a_nan | b_nan | (a_zero & b_inf) | (a_inf & b_zero)),
                inf.eq(a_inf | b_inf),
                zero.eq(a_zero | b_zero),
                valid.eq(self.i_valid),
            ]

        def reg(value, name):
            r = Signal(Value.cast(value).shape(), name=name, reset_less=True)
            with m.If(self.advance):
                m.d.sync += r.eq(value)
            return r

        # Stage 2: normalize (the product of two significands in [1, 2) lies in [1, 4): at
        # most one right shift) and decide the rounding (RNE on the dropped bits), and whether
        # it carries out of the significand; beside them, the range tests for each exponent
        # the result may get. The sum of two biased fields counts the bias twice; the
        # normalizing shift and a rounding carry (which leaves the mantissa bits at 0) each add
        # one, so the result's field plus EXP_BIAS is field_sum + k, k = top + carry in 0..2.
        top = prod[-1]
        kept = Mux(top, prod[sig_bits:], prod[sig_bits - 1 : -1])
        guard = Mux(top, prod[sig_bits - 1], prod[sig_bits - 2])
        sticky = Mux(top, prod[: sig_bits - 1] != 0, prod[: sig_bits - 2] != 0)
        up = guard & (sticky | kept[0])
        k = top + (up & kept.all())
        field_width = a.field.shape().width
        overflow = Array(field_sum >= FIELD_INF + EXP_BIAS - j for j in range(3))[k]
        underflow = Array(field_sum <= EXP_BIAS - j for j in range(3))[k]
        field = Array((field_sum + j - EXP_BIAS)[:field_width] for j in range(3))[k]
        kept2 = reg(kept, "kept2")
        up2 = reg(up, "up2")
        field2 = reg(field, "field2")
        sign2 = reg(sign, "sign2")
        # The output's class: NaN, inf (an input or an overflow), zero (an input or FTZ after
        # rounding) or a normal number.
        nan2 = reg(nan, "nan2")
        inf2 = reg(~nan & (inf | overflow), "inf2")
        zero2 = reg(~nan & ~inf & ~overflow & (zero | underflow), "zero2")
        valid2 = Signal()
        with m.If(self.advance):
            m.d.sync += valid2.eq(valid)

        # Stage 3: the rounding increment (a carry out leaves the mantissa bits at 0) and the
        # result.
        mantissa = (kept2 + up2)[:MANT_BITS]
        sign_bit = Cat(Const(0, BF16_WIDTH - 1), sign2)
        out = Signal(BF16_WIDTH)
        with m.If(nan2):
            m.d.comb += out.eq(sign_bit | QNAN)
        with m.Elif(inf2):
            m.d.comb += out.eq(sign_bit | _INF)
        with m.Elif(zero2):
            m.d.comb += out.eq(sign_bit)
        with m.Else():
            m.d.comb += out.eq(Cat(mantissa, field2, sign2))

        o = Signal(BF16_WIDTH, reset_less=True)
        o_valid = Signal()
        with m.If(self.advance):
            m.d.sync += [o.eq(out), o_valid.eq(valid2)]
        m.d.comb += [self.o.eq(o), self.o_valid.eq(o_valid)]
        return m


def _register(m: Module, advance, value, name: str) -> Signal:
    """``value`` registered when the pipeline advances (a data register: no reset)."""
    r = Signal(Value.cast(value).shape(), name=name, reset_less=True)
    with m.If(advance):
        m.d.sync += r.eq(value)
    return r


def words_layout(tables) -> data.StructLayout:
    """The table words of an input (``ActivationTables.words``): one bf16 word per table unit."""
    return data.StructLayout({name: BF16_WIDTH for name in tables})


class ActivationTables(wiring.Component):
    """Stages 1-3 of the activation pipeline for the table units: each unit's word for an
    input ``x`` (``words_layout(tables)``), 3 advances after ``x`` is taken in.

    Stage 1: each table unit's ROM address, registered (it is too deep to share a cycle with
    the block RAM's address setup). Stage 2: the ROM, synchronous, read every cycle the
    pipeline moves and holding its words while it stalls, like the registers; it is built of
    parts of one block RAM each (``_ROM_PART`` words), so that every block RAM output goes
    straight into a register (stage 3) and the part is chosen after it, by the address's high
    bits. An out-of-window field reads a clamped (in-range) word that the rules replace.

    Ports: ``advance``, ``x`` (bf16) in; ``words`` out.
    """

    def __init__(self, tables):
        self.tables = tuple(tables)
        super().__init__({
            "advance": In(1),
            "x": In(BF16),
            "words": Out(words_layout(self.tables)),
        })

    def elaborate(self, platform):
        m = Module()
        advance = self.advance
        x0 = self.x
        field_width = x0.field.shape().width
        for name in self.tables:
            unit = activations.table_unit(name)
            # Stage 1: the row is the field's offset in the window, in the negative half for a
            # negative x: the window tests and both offsets are computed side by side, then
            # selected.
            below = x0.field < unit.f_lo
            above = x0.field > unit.f_hi
            offset = (x0.field - unit.f_lo)[:field_width]
            offset_neg = (x0.field + (unit.fields - unit.f_lo))[:field_width + 1]
            half = unit.fields * x0.sign
            row = Mux(below, half, Mux(above, half + unit.fields - 1, Mux(x0.sign, offset_neg, offset)))
            address = Signal(range(unit.rom_entries), name=f"address_{name}", reset_less=True)
            with m.If(advance):
                m.d.sync += address.eq(Cat(x0.mantissa, row))
            # Stage 2: the ROM parts, and which of them the address reads.
            rom_words = [int(w) for w in unit.rom]
            outs = []
            for p, start in enumerate(range(0, unit.rom_entries, _ROM_PART)):
                chunk = rom_words[start:start + _ROM_PART]
                rom = Memory(shape=BF16_WIDTH, depth=len(chunk), init=chunk)
                m.submodules[f"rom_{name}_{p}"] = rom
                port = rom.read_port(domain="sync")
                m.d.comb += [port.addr.eq(address[:_ROM_PART_BITS]), port.en.eq(advance)]
                outs.append(port.data)
            part = Signal(range(len(outs)), name=f"part_{name}", reset_less=True)
            with m.If(advance):
                m.d.sync += part.eq(address[_ROM_PART_BITS:])
            # Stage 3: the block RAM words registered as they come out (their clock-to-out
            # leaves no time for logic behind them), the part chosen after the registers.
            words = Array(_register(m, advance, w, f"word_{name}_{p}") for p, w in enumerate(outs))
            m.d.comb += self.words[name].eq(words[_register(m, advance, part, f"part2_{name}")])
        return m


def _unit_output(name: str, c: SimpleNamespace, words, leaky_shift: int):
    """Function ``name``'s output (stage 4) from the stage-3 values ``c`` and the table units'
    ``words``: a comparator's choice, or a table word replaced by a rule out of its window."""
    if name == "relu":
        return Mux(c.positive, c.x.as_value(), 0)
    if name == "leaky_relu":
        return Mux(c.x_neg, c.leaky_neg, c.x_daz)
    if name == "relu_grad":
        return Mux(c.positive, _ONE, 0)
    if name == "leaky_relu_grad":
        slope = (EXP_BIAS - leaky_shift) << MANT_BITS if leaky_shift < EXP_BIAS else 0
        return Mux(c.positive, _ONE, slope)
    unit_name = table_of(name)
    unit = activations.table_unit(unit_name)
    below, above = c.windows[unit_name]

    def rule(r):
        kind = r[0]
        if kind == "const":
            return Const(r[1], BF16_WIDTH)
        if kind == "x":
            return c.x_daz
        if kind == "half":
            return c.x_half
        raise ValueError(f"unknown rule {r!r}")

    return Mux(
        below,
        rule(unit.small_rule),
        Mux(above, Mux(c.x.sign, rule(unit.large_rule_neg), rule(unit.large_rule_pos)), words[unit_name]),
    )


def _rule_values(x1: data.View, leaky_shift: int):
    """Stage 3's values of a bf16 input ``x1`` (unregistered): a zero of its sign, its classes
    (zero after DAZ, NaN), ``x * 0.5`` and leaky_relu's output for a negative ``x``."""
    field_width = x1.field.shape().width
    sign16 = Cat(Const(0, BF16_WIDTH - 1), x1.sign)
    x_zero, _, x_nan = _classes(x1)
    # x * 0.5 by exponent decrement; fields 1 and 0 flush to a zero of x's sign.
    x_half = Mux(
        x1.field <= 1,
        sign16,
        Mux(x1.field == FIELD_INF, x1.as_value(), x1.as_value() - (1 << MANT_BITS)),
    )
    # leaky_relu: shifts past the field range flush every finite negative input (as the
    # golden model's clamp to 255 does).
    s = min(leaky_shift, FIELD_INF)
    leaky_neg = Mux(
        x1.field == FIELD_INF,
        x1.as_value(),
        Mux(x1.field <= s, sign16, Cat(x1.mantissa, (x1.field - s)[:field_width], x1.sign)),
    )
    return sign16, x_zero, x_nan, x_half, leaky_neg


class ActivationDatapath(wiring.Component):
    """The activation pipeline in advance/valid form (``Activation`` puts streams around it).

    Computes, for the function whose code (``function_code``) is ``i.func``,
    ``hbfp.golden.activations.<name>(i.x)`` for a unary function (``i.g`` ignored) or
    ``<name>(i.x, i.g)`` for a gradient; leaky_relu's slope is ``2**-leaky_shift``. A code of
    a function left out of ``functions`` (or an unassigned code) gives ``0x7FC0`` (NaN).

    Every register moves when ``advance`` is high; ``o_valid`` follows ``i_valid`` ``LATENCY``
    advances later. Latency 7 cycles, one result per cycle.

    Ports: ``advance``, ``i_valid``, ``i`` (``ACTIVATION_INPUT``) in; ``o_valid``, ``o`` out.
    """

    #: ROM address, ROM read, ROM output register, function select, then the multiplier (4 +
    #: ``MulBF16Datapath.LATENCY``): the contract's ``ACTIVATION_LATENCY``, which ``emu`` counts.
    LATENCY = ACTIVATION_LATENCY

    def __init__(self, *, functions=FUNCTIONS, leaky_shift: int = LEAKY_SHIFT):
        self.functions = _check_functions(functions)
        self.leaky_shift = activations.check_shift(leaky_shift, "leaky_shift")
        #: Table units built, in ``activations.TABLE_NAMES`` order.
        self.tables = tuple(
            u for u in activations.TABLE_NAMES if u in {table_of(n) for n in self.functions}
        )
        super().__init__(
            {
                "advance": In(1),
                "i_valid": In(1),
                "i": In(ACTIVATION_INPUT),
                "o_valid": Out(1),
                "o": Out(BF16_WIDTH),
            }
        )

    @property
    def rom_bits(self) -> int:
        """ROM bits of the built table units."""
        return rom_bits(self.functions)

    def elaborate(self, platform):
        m = Module()
        advance = self.advance

        def reg(value, name):
            return _register(m, advance, value, name)

        # Stages 1-3 of the table units: their words for the input (``ActivationTables``).
        words = {}
        if self.tables:
            m.submodules.tables = tables = ActivationTables(self.tables)
            m.d.comb += [tables.advance.eq(advance), tables.x.eq(self.i.x)]
            words = tables.words

        # Stages 1 and 2: the input, registered beside the ROM address and the ROM.
        xa = Signal(BF16, reset_less=True)
        ga = Signal(BF16_WIDTH, reset_less=True)
        funca = Signal(FUNC_WIDTH, reset_less=True)
        va = Signal()
        with m.If(advance):
            m.d.sync += [xa.eq(self.i.x), ga.eq(self.i.g), funca.eq(self.i.func), va.eq(self.i_valid)]
        x1 = Signal(BF16, reset_less=True)
        g1 = Signal(BF16_WIDTH, reset_less=True)
        func1 = Signal(FUNC_WIDTH, reset_less=True)
        v1 = Signal()
        with m.If(advance):
            m.d.sync += [x1.eq(xa), g1.eq(ga), func1.eq(funca), v1.eq(va)]

        # Stage 3: beside the table words (registered in ``ActivationTables``), everything
        # that depends on the input alone: its classes, the rule values and each table's
        # window tests.
        sign16, x_zero, x_nan, x_half, leaky_neg = _rule_values(x1, self.leaky_shift)
        x2 = Signal(BF16, reset_less=True)
        with m.If(advance):
            m.d.sync += x2.eq(x1)
        c = SimpleNamespace(
            x=x2,
            positive=reg(~x1.sign & ~x_zero, "positive2"),  # x > 0 after DAZ (NaN is overridden below)
            x_neg=reg(x1.sign & ~x_zero, "x_neg2"),
            x_daz=reg(Mux(x_zero, sign16, x1.as_value()), "x_daz2"),
            x_half=reg(x_half, "x_half2"),
            leaky_neg=reg(leaky_neg, "leaky_neg2"),
            windows={name: (reg(x1.field < activations.table_unit(name).f_lo, f"below_{name}"),
                            reg(x1.field > activations.table_unit(name).f_hi, f"above_{name}"))
                     for name in self.tables},
        )
        g2 = reg(g1, "g2")
        func2 = reg(func1, "func2")
        x_nan = reg(x_nan, "x_nan2")
        sign16 = reg(sign16, "sign16_2")
        v2 = Signal()
        with m.If(advance):
            m.d.sync += v2.eq(v1)

        # Stage 4: the unit outputs, chosen by the function, and the multiplier's operands.
        y = Signal(BF16_WIDTH)
        operand = Signal(BF16_WIDTH)
        built = Signal()
        with m.Switch(func2):
            for name in self.functions:
                with m.Case(function_code(name)):
                    m.d.comb += [
                        y.eq(_unit_output(name, c, words, self.leaky_shift)),
                        operand.eq(g2 if name in GRADIENT_FUNCTIONS else _ONE),
                        built.eq(1),
                    ]
            with m.Default():
                m.d.comb += [y.eq(QNAN), operand.eq(_ONE), built.eq(0)]

        # (Registered, so that the function multiplexer is not in front of the multiplier.)
        y2 = Signal(BF16_WIDTH, reset_less=True)
        operand2 = Signal(BF16_WIDTH, reset_less=True)
        v3 = Signal()
        with m.If(advance):
            m.d.sync += [
                y2.eq(Mux(x_nan & built, sign16 | QNAN, y)),
                operand2.eq(operand),
                v3.eq(v2),
            ]

        # Stages 5-7: y times g (gradients) or times 1.0 (unary functions: exact identity).
        if not any(name in GRADIENT_FUNCTIONS for name in self.functions):
            # Unary functions only: every operand is 1.0 and the product is y itself, so a
            # delay line of the multiplier's latency stands in for it (the same timing).
            y, v = y2, v3
            for k in range(MulBF16Datapath.LATENCY):
                v_next = Signal(name=f"v_d{k + 1}")  # valid bits keep their reset
                with m.If(advance):
                    m.d.sync += v_next.eq(v)
                y, v = reg(y, f"y_d{k + 1}"), v_next
            m.d.comb += [self.o.eq(y), self.o_valid.eq(v)]
            return m
        m.submodules.mul = mul = MulBF16Datapath()
        m.d.comb += [
            mul.advance.eq(advance),
            mul.i_valid.eq(v3),
            mul.a.eq(y2),
            mul.b.eq(operand2),
            self.o.eq(mul.o),
            self.o_valid.eq(mul.o_valid),
        ]
        return m


class Activation(wiring.Component):
    """The bf16 activation unit with stream ports.

    Input ``i``: ``ACTIVATION_INPUT`` beats ``{x, g, func}`` (bf16 patterns and a code from
    ``function_code``). Output ``o``: one bf16 pattern per beat, in order, equal to
    ``hbfp.golden.activations.<name>(x)`` for a unary function (relu, leaky_relu with slope
    ``2**-leaky_shift``, gelu, sigmoid, tanh, exp; ``g`` ignored) and to
    ``<name>(x, g) = bf16.mul(<name>_deriv(x), g)`` for a gradient. Unary outputs match the
    golden patterns exactly, NaN included (``QNAN | sign(x)``); a gradient's NaN is ``QNAN``
    with the sign ``sign(deriv) ^ sign(g)``, as golden's.

    ``functions``: the subset of ``FUNCTIONS`` to build (small FPGAs leave out table units:
    see ``rom_bits``); a code of a function not built, or an unassigned code, gives ``0x7FC0``
    (NaN). ``leaky_shift``: the leaky_relu slope exponent.

    Latency 7 cycles (``LATENCY``); throughput one beat per cycle, any mix of functions;
    ``i.ready`` follows ``~o.valid | o.ready`` (all stages move together).
    """

    LATENCY = ActivationDatapath.LATENCY

    def __init__(self, *, functions=FUNCTIONS, leaky_shift: int = LEAKY_SHIFT):
        self.functions = _check_functions(functions)
        self.leaky_shift = activations.check_shift(leaky_shift, "leaky_shift")
        super().__init__(
            {
                "i": In(stream.Signature(ACTIVATION_INPUT)),
                "o": Out(stream.Signature(BF16_WIDTH)),
            }
        )

    @property
    def rom_bits(self) -> int:
        """ROM bits of the built table units."""
        return rom_bits(self.functions)

    def elaborate(self, platform):
        m = Module()
        m.submodules.datapath = dp = ActivationDatapath(
            functions=self.functions, leaky_shift=self.leaky_shift
        )
        advance = ~self.o.valid | self.o.ready
        m.d.comb += [
            dp.advance.eq(advance),
            self.i.ready.eq(advance),
            dp.i_valid.eq(self.i.valid),
            dp.i.eq(self.i.payload),
            self.o.valid.eq(dp.o_valid),
            self.o.payload.eq(dp.o),
        ]
        return m
