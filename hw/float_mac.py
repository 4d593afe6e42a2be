"""A floating-point MAC array: R x C processing elements, 16-bit float products, fp32 sums.

The reference design of the density experiment (benchmarks/density.py, docs/reports/
density.md): the broadcast shape of ``hbfp.hw.mac_array.MacArray`` (every beat brings a
column of ``rows`` A values and a row of ``cols`` B values; PE (i, j) multiplies ``a[i] *
b[j]`` and accumulates), but with bf16 or fp16 operands and an fp32 accumulator per PE,
computing ``hbfp.golden.float_mac.float_mac`` bit for bit.

An fp32 adder needs ``AddF32Datapath.LATENCY`` = 7 cycles, so one accumulator cannot take a
product every cycle. Each PE therefore runs ``INTERLEAVE`` = 7 independent accumulations
whose partial sums circulate through its adder pipeline: the adder's output is its own
input ``INTERLEAVE`` cycles later, so the pipeline registers are the accumulators.
Consecutive beats belong to consecutive accumulations ("groups"): beat ``n`` feeds group
``n % INTERLEAVE``. The array thus computes ``INTERLEAVE`` independent R x C products at
once (in a GEMM: seven output blocks, or seven K-slices summed later), each a sum of ``k``
products.

Multipliers, as in ``MacArray``: the first ``dsp_macs`` PEs in row-major order multiply the
significands with ``*`` (a MULT18X18D with its input and output registers, elaborated for an
ECP5), the others with ``hbfp.hw.lut_mult.BoothProduct`` (LUTs and carry chains), so that a
LUT-only comparison with the BFP8 core gives both the same multiplier family.
"""

from __future__ import annotations

from types import SimpleNamespace

from amaranth.hdl import Cat, Const, EnableInserter, Module, Mux, Signal, Value, signed
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out
from hbfp.golden.float_mac import FORMATS, float_format

from .add_f32 import AddF32Datapath, _leading_zeros
from .lut_mult import BoothProduct
from .mac_array import control_register, ecp5_multiplier
from .params import (
    F32_BIAS,
    F32_EXP_BITS,
    F32_EXP_INF,
    F32_FRAC_BITS,
    F32_QNAN,
    FP32_WIDTH,
)

__all__ = ["FloatMacArray", "FORMATS"]

_SIGN = 1 << (FP32_WIDTH - 1)


def operand_layout(significand_bits: int) -> data.StructLayout:
    """A 16-bit operand widened to fp32 fields at the array's edge: its significand with the
    implicit one (``significand_bits``), the biased fp32 exponent field, sign, and class."""
    return data.StructLayout({
        "sig": significand_bits,
        "exp": F32_EXP_BITS,
        "sign": 1,
        "zero": 1,
        "inf": 1,
        "nan": 1,
    })


class FloatMacArray(wiring.Component):
    """``rows`` x ``cols`` floating-point MACs; equals ``hbfp.golden.float_mac.float_mac``.

    ``fmt``: the operand format, "bf16" or "fp16". ``k``: the products each output sums.

    Input ``i``: ``{a: rows patterns, b: cols patterns}`` (16 bits each), one per beat. Beats
    come in runs of ``INTERLEAVE * k``: beat ``n`` of a run is step ``n // INTERLEAVE`` of
    group ``g = n % INTERLEAVE``, i.e. ``A_g[:, step]`` and ``B_g[step, :]``.
    Output ``o``: ``INTERLEAVE`` beats per run, ``{sums: rows x cols fp32 patterns, group}``,
    group 0 first: ``sums[i][j] = float_mac(A_g, B_g, fmt)[i, j]`` (NaN as ``0x7FC00000``).

    Throughput: one beat per cycle, every PE one MAC per cycle, while beats keep coming and
    the output keeps up. A group's partial sum passes the adder once every ``INTERLEAVE``
    cycles, so a beat can only enter in its group's cycle: after an idle input cycle the
    next beat waits ``INTERLEAVE - 1`` cycles. An output beat not taken stalls the array.
    Latency: a group's result is offered ``LATENCY`` cycles after its last beat entered.

    ``dsp_macs``: how many PEs (row-major) use a DSP multiplier (None: all); the rest use
    Booth LUT multipliers.

    ``ready_ahead``: the consumer gives ``o.ready``'s value of the next cycle on the input
    ``o_ready_next`` (as a consumer whose ready is a register can: ``FloatCore``'s drain), and
    ``o.ready`` must then follow it. The array's stall is then a register, copied into every
    PE, rather than a gate of ``o.ready`` whose change reaches every register of the array
    in the same cycle.

    Pipeline (``PE_STAGES`` registers from the input to an adder's operand): the edge widens
    the broadcast operands to fp32 fields (``rows + cols`` converters, shared by a row or
    column of PEs) and registers them (1), then again with the negated significand for Booth
    products (2); in every PE (3, 4) the significand product (a DSP block's input and output
    registers, or a Booth product's partial products and sum) beside the exponent sum, sign,
    class and range tests, (5) a fabric copy of the product, (6) the fp32 product pattern (one
    normalizing shift, specials) and the adder's operand selects, then the 7-stage
    ``AddF32Datapath`` whose output loops back to its second addend.
    """

    INTERLEAVE = AddF32Datapath.LATENCY
    #: Registers from a beat on ``i`` to its product at a PE's adder: two at the edge, two for
    #: the multiplier, the fabric copy, the pattern.
    PE_STAGES = 6
    #: Cycles from a group's last beat accepted to its result valid on ``o``.
    LATENCY = PE_STAGES + AddF32Datapath.LATENCY

    def __init__(self, rows: int, cols: int, fmt: str, k: int, dsp_macs: int | None = None, *,
                 ready_ahead: bool = False):
        try:
            if not isinstance(rows, int) or not isinstance(cols, int) or rows < 1 or cols < 1:
                raise ValueError(f"rows and cols must be positive integers, got {rows} x {cols}")
            if not isinstance(k, int) or k < 1:
                raise ValueError(f"k (products per output) must be a positive integer, got {k!r}")
            if dsp_macs is not None and not 0 <= dsp_macs <= rows * cols:
                raise ValueError(f"dsp_macs must be 0..{rows * cols} (rows x cols), got {dsp_macs}")
            self.fmt = float_format(fmt)
        except ValueError:
            # A component that failed to construct was never meant to be elaborated: keep
            # Amaranth from warning that it went unused.
            self._MustUse__used = True
            raise
        self.rows, self.cols, self.k = rows, cols, k
        self.dsp_macs = rows * cols if dsp_macs is None else dsp_macs
        self.ready_ahead = ready_ahead
        in_layout = data.StructLayout({
            "a": data.ArrayLayout(self.fmt.width, rows),
            "b": data.ArrayLayout(self.fmt.width, cols),
        })
        out_layout = data.StructLayout({
            "sums": data.ArrayLayout(data.ArrayLayout(FP32_WIDTH, cols), rows),
            "group": range(self.INTERLEAVE),
        })
        ports = {"i": In(stream.Signature(in_layout)), "o": Out(stream.Signature(out_layout))}
        if ready_ahead:
            ports["o_ready_next"] = In(1)
        super().__init__(ports)

    def _widen(self, m: Module, bits: Value) -> Value:
        """Fields of one operand pattern, as ``hbfp.golden.float_mac.widen`` reads it."""
        f = self.fmt
        S = f.significand_bits
        frac = bits[: f.frac_bits]
        e = bits[f.frac_bits : f.frac_bits + f.exp_bits]
        e_max = 2**f.exp_bits - 1
        out = Signal(operand_layout(S))
        m.d.comb += [
            out.sign.eq(bits[-1]),
            out.inf.eq((e == e_max) & (frac == 0)),
            out.nan.eq((e == e_max) & (frac != 0)),
            out.sig.eq(Cat(frac, Const(1, 1))),
            out.exp.eq(e + (F32_BIAS - f.bias)),
        ]
        if not f.subnormals:
            m.d.comb += out.zero.eq(e == 0)  # DAZ
            return out
        m.d.comb += out.zero.eq((e == 0) & (frac == 0))
        # A subnormal frac * 2**(1 - bias - frac_bits) is a normal fp32 value: bring its
        # leading one to the implicit position. The count's input is padded with ones below
        # to a power of two (the tree of hw.add_f32).
        width = 1 << (f.frac_bits - 1).bit_length()
        pad = width - f.frac_bits
        lz, _ = _leading_zeros(Cat(Const((1 << pad) - 1, pad), frac))
        with m.If((e == 0) & (frac != 0)):
            m.d.comb += [
                out.sig.eq(frac << (lz + 1)),
                out.exp.eq(F32_BIAS - f.bias - lz),
            ]
        return out

    def uses_dsp(self, i: int, j: int) -> bool:
        """Whether PE (i, j) multiplies with a DSP block (``*``) rather than a Booth LUT product."""
        return i * self.cols + j < self.dsp_macs

    def _product(self, m: Module, stage, platform, i: int, j: int, edge_a, b, ctl):
        """PE (i, j)'s fp32 product pattern of the edge's registered operands ``edge_a.x`` and
        ``b``, ``PE_STAGES - 2`` stages after them (``stage``: registers enabled by the PE's
        copy of the array's advance, ``stage.en``): the
        significand product in two (a DSP block's input and output registers, or a staged
        Booth product's partial products and sum), a fabric copy of it, then the pattern.
        Returns the adder's operands as registers of the PE (``ctl``: the control bits beside
        the pattern's inputs): ``a``, the pattern, or -0 in an empty slot; ``zero_b``, a group's
        first product (its sum starts at +0)."""
        a = edge_a.x
        S = self.fmt.significand_bits
        P = 2 * S  # product bits; its leading one is at bit P - 1 or P - 2
        name = f"pe{i}_{j}"

        # Sign, class and exponent beside the product. The biased exponent before
        # normalizing lies in -127 .. 381; the range tests of both normalizations (the
        # product's leading one at bit P - 1 adds one) are made a stage ahead of their use.
        nan = a.nan | b.nan | (a.inf & b.zero) | (a.zero & b.inf)
        exp_sum = Signal(signed(F32_EXP_BITS + 2), name=f"{name}_exp_sum")
        m.d.comb += exp_sum.eq(a.exp + b.exp - F32_BIAS)
        s1 = stage(f"{name}_side1", exp=exp_sum, sign=a.sign ^ b.sign, nan=nan, inf=(a.inf | b.inf) & ~nan,
                   zero=a.zero | b.zero)
        s2 = stage(f"{name}_side2", sign=s1.sign, nan=s1.nan, inf=s1.inf, zero=s1.zero,
                   exp0=s1.exp[:F32_EXP_BITS], exp1=(s1.exp + 1)[:F32_EXP_BITS],
                   ovf0=s1.exp >= F32_EXP_INF, ovf1=s1.exp >= F32_EXP_INF - 1, unf0=s1.exp < 1, unf1=s1.exp < 0)
        s3 = stage(f"{name}_side3", **vars(s2))

        # The exact significand product, two stages after the edge.
        sig = Signal(P, name=f"{name}_sig")
        if not self.uses_dsp(i, j):
            booth = BoothProduct(S + 1, S + 1, staged=True)
            m.submodules[f"booth_{i}_{j}"] = EnableInserter(stage.en)(booth)
            m.d.comb += [booth.a.eq(a.sig), booth.neg_a.eq(edge_a.neg), booth.b.eq(b.sig)]
            m.d.comb += sig.eq(stage(f"{name}_mul", p=booth.p).p)
        elif getattr(platform, "family", None) == "ecp5":
            # A MULT18X18D with its input and output registers, held with the array.
            ecp5_multiplier(m, f"dsp_{i}_{j}", a.sig, b.sig, sig, ce=stage.en)
        else:
            ops = stage(f"{name}_ops", a=a.sig, b=b.sig)
            m.d.comb += sig.eq(stage(f"{name}_mul", p=ops.a * ops.b).p)
        # A fabric copy: the route from a DSP block to its PE gets a cycle of its own.
        p3 = stage(f"{name}_prod3", sig=sig).sig

        # The fp32 pattern: one normalizing shift (a product of two significands in [1, 2)
        # lies in [1, 4)) and the range tests. The significand is exact, so "below 2**-126
        # after rounding" is "exponent field below 1".
        top = p3[P - 1]
        frac = Mux(top, p3[: P - 1] << (F32_FRAC_BITS - (P - 1)), p3[: P - 2] << (F32_FRAC_BITS - (P - 2)))
        prod = Signal(FP32_WIDTH, name=f"{name}_prod")
        sign = Cat(Const(0, FP32_WIDTH - 1), s3.sign)
        with m.If(s3.nan):
            m.d.comb += prod.eq(F32_QNAN)
        with m.Elif(s3.inf | Mux(top, s3.ovf1, s3.ovf0)):
            m.d.comb += prod.eq(sign | (F32_EXP_INF << F32_FRAC_BITS))
        with m.Elif(s3.zero | Mux(top, s3.unf1, s3.unf0)):
            m.d.comb += prod.eq(sign)
        with m.Else():
            m.d.comb += prod.eq(Cat(frac[:F32_FRAC_BITS], Mux(top, s3.exp1, s3.exp0), s3.sign))
        return stage(f"{name}_pack", a=Mux(ctl.v, prod, _SIGN), zero_b=ctl.v & ctl.first)

    def _advance(self, m: Module, platform):
        """The array's advance (every stage moves: no finished group waits at ``o``), as the
        edge's copy and each PE's, and ``out_valid`` (``now``: ``o.valid``; ``before``: the
        valid bit a stage earlier, which ``o.valid`` takes on an advancing cycle), which the
        caller drives. Without ``ready_ahead`` one gate of ``o.ready`` (every copy the same).
        With it, a register: the stall's next value from ``out_valid`` and ``o_ready_next``,
        in one flip-flop per PE and one for the edge (kept apart for an ECP5, as
        ``MacArray``'s control copies are), so that no copy drives more than a PE."""
        R, C = self.rows, self.cols
        out_valid = SimpleNamespace(now=Signal(name="out_valid"), before=Signal(name="out_valid_before"))
        if not self.ready_ahead:
            advance = Signal(name="advance")
            m.d.comb += advance.eq(~(self.o.valid & ~self.o.ready))
            return advance, [[advance] * C for _ in range(R)], out_valid
        ecp5 = getattr(platform, "family", None) == "ecp5"
        # stall(t + 1) = o.valid(t + 1) & ~o.ready(t + 1); a flip-flop resets to "no stall".
        stall_next = Signal(name="stall_next")
        copies = []
        for c in range(R * C + 1):
            stall, adv = Signal(name=f"stall_c{c}"), Signal(name=f"advance_c{c}")
            control_register(m, f"stall_c{c}", stall_next, stall, ecp5)
            m.d.comb += adv.eq(~stall)
            copies.append(adv)
        advance = copies[-1]
        m.d.comb += stall_next.eq(Mux(advance, out_valid.before, out_valid.now) & ~self.o_ready_next)
        return advance, [copies[i * C : (i + 1) * C] for i in range(R)], out_valid

    def elaborate(self, platform):
        m = Module()
        R, C, L, K = self.rows, self.cols, self.INTERLEAVE, self.k

        # The whole array moves together unless a finished group waits at the output; the
        # adder pipelines must never skip a cycle, or the groups would leave their slots.
        # ``advance``: the edge's and the bookkeeping's copy; ``pe_advance[i][j]``: PE (i, j)'s.
        advance, pe_advance, out_valid = self._advance(m, platform)

        # Slot bookkeeping: ``phase`` counts advancing cycles (which group's partial sum is
        # due at the adders), ``group`` and ``step`` count accepted beats. A beat enters only
        # in its own group's cycle.
        phase = Signal(range(L))
        group = Signal(range(L))
        step = Signal(range(K))
        m.d.comb += self.i.ready.eq(advance & (phase == group))
        take = self.i.valid & self.i.ready
        with m.If(advance):
            m.d.sync += phase.eq(Mux(phase == L - 1, 0, phase + 1))
        with m.If(take):
            m.d.sync += group.eq(Mux(group == L - 1, 0, group + 1))
            with m.If(group == L - 1):
                m.d.sync += step.eq(Mux(step == K - 1, 0, step + 1))

        def stager(en, reset_less=True):
            def stage(name, **values):
                # Data registers have no reset (the valid bits say what they hold); the
                # control bits (``control``) do.
                regs = {}
                for key, value in values.items():
                    shape = value.shape() if isinstance(value, data.View) else Value.cast(value).shape()
                    reg = Signal(shape, name=f"{name}_{key}", reset_less=reset_less)
                    with m.If(en):
                        m.d.sync += reg.eq(value)
                    regs[key] = reg
                return SimpleNamespace(**regs)
            stage.en = en
            return stage

        stage, control = stager(advance), stager(advance, reset_less=False)

        # Edge: widen the broadcast operands once per row and column and register them, then
        # register them again (the second register cuts the fan-out to R * C multipliers);
        # beside the second, a row with LUT PEs registers its significand's negation, which
        # their Booth products take (a carry chain of its own, not after the widening's).
        edge_a, edge_b = [], []
        for i in range(R):
            x = stage(f"edge1_a{i}", x=self._widen(m, self.i.payload.a[i])).x
            lut_row = not all(self.uses_dsp(i, j) for j in range(C))
            edge_a.append(stage(f"edge_a{i}", x=x, **({"neg": -x.sig} if lut_row else {})))
        edge_b = [stage(f"edge_b{j}", x=stage(f"edge1_b{j}", x=self._widen(m, self.i.payload.b[j])).x).x
                  for j in range(C)]
        # The control bits beside the PEs' stages: valid, a group's first and last product.
        ctls = [control("ctl1", v=take, first=step == 0, last=step == K - 1)]
        for n in range(2, self.PE_STAGES + 1):
            ctls.append(control(f"ctl{n}", v=ctls[-1].v, first=ctls[-1].first, last=ctls[-1].last))
        ctl = ctls[-1]

        # A group's last product marks its sum on the way out: the adders' valid bits (``L``
        # advancing cycles), kept once beside them.
        ends = [ctl.v & ctl.last]
        for n in range(L):
            ends.append(control(f"end{n + 1}", v=ends[-1]).v)
        m.d.comb += [out_valid.now.eq(ends[-1]), out_valid.before.eq(ends[-2])]

        for i in range(R):
            for j in range(C):
                en = pe_advance[i][j]
                ops = self._product(m, stager(en), platform, i, j, edge_a[i], edge_b[j], ctls[-2])
                # Accumulate. A group's first product adds to +0; an empty slot adds -0,
                # which leaves every partial sum unchanged (x + -0 = x, -0 + -0 = -0). Both
                # selects are the PE's own registers (``_product``), not the array's ``ctl``.
                add = AddF32Datapath()
                m.submodules[f"add_{i}_{j}"] = add
                m.d.comb += [
                    add.advance.eq(en),
                    add.a.eq(ops.a),
                    add.b.eq(Mux(ops.zero_b, 0, add.result)),
                    # A group's last product: its valid bit would come out with the final sum
                    # (the adder's ``out_valid``; the array's ``ends`` stand for every PE's).
                    add.in_valid.eq(ctl.v & ctl.last),
                ]
                m.d.comb += self.o.payload.sums[i][j].eq(add.result)

        out_group = Signal(range(L))
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += out_group.eq(Mux(out_group == L - 1, 0, out_group + 1))
        m.d.comb += [self.o.valid.eq(out_valid.now), self.o.payload.group.eq(out_group)]
        return m
