"""The MAC array: R x C processing elements, exact integer sums per K-tile.

Dataflow (docs/architecture.md): output-stationary with broadcast operands. Every cycle one
beat brings a column of A (``rows`` codes, ``A[i0:i0+R, k]``) and a row of B (``cols`` codes,
``B[k, j0:j0+C]``); PE (i, j) adds ``a[i] * b[j]`` to its own accumulator. After ``tk`` beats
(one K-tile) every accumulator holds ``hbfp.golden.gemm.partial_sums`` for its output; the
sums move to a shadow bank in the same cycle the next K-tile starts, and drain while the PEs
go on: ``groups`` beats a row (row 0 first), each of ``cols / groups`` sums (group 0 first), one
beat per cycle (``groups`` = ``CoreConfig.acc_groups``: the accumulate lanes serve that many
columns each). The shadow bank drains as a shift register (each beat moves up a place a cycle
and leaves from row 0), so no multiplexer gathers the sums from across the array.

Multipliers: the first ``dsp_macs`` PEs in row-major order multiply with ``*`` (which Yosys
maps to a MULT18X18D on ECP5), the others with ``hbfp.hw.lut_mult.BoothProduct`` (LUTs and
carry chains, never a DSP block), for arrays larger than the FPGA's DSP blocks. Elaborated
for an ECP5 (a platform whose ``family`` is ``"ecp5"``, as Amaranth's Lattice platforms and
``hbfp.hw.openflow.ECP5`` are), a DSP PE is a MULT18X18D instance with its input and output
registers on (``ecp5_multiplier``): Yosys packs no registers into ECP5 DSP blocks, and a
multiplier used without them (register, routing, the multiply, routing, register) is the
slowest path of the core. The registers are the generic PE's operand copy and product
register, so the latency and every bit are the same. Elaborated for an ECP5, every PE's
accumulator also adds in one carry chain whose LUTs clear it on a K-tile's first beat
(``ecp5_cleared_sum``), where Yosys maps the generic ``Mux(first, p, acc + p)`` to a carry
chain and a LUT4 per bit (what it saves: docs/architecture.md, "Timing of the 8 x 8 core").
"""

from __future__ import annotations

from amaranth import ClockSignal, Const, Instance, Module, Mux, ResetSignal, Signal, signed
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from hbfp.contract import MAC_LATENCY

from .lut_mult import BoothProduct
from .params import psum_width

__all__ = ["CLEARED_SUM_INIT", "CONTROL_PES", "MacArray", "control_register", "ecp5_cleared_sum", "ecp5_multiplier"]


def ecp5_multiplier(m: Module, name: str, a, b, p, ce=1) -> None:
    """Adds to ``m`` (as submodule ``name``) a signed ``p = a * b`` (``a``, ``b`` up to 18 bits, ``p`` up to 36) in an ECP5
    MULT18X18D whose A and B input registers and output register are clocked by the sync
    domain: ``p`` follows ``a`` and ``b`` two cycles later (Lattice TN1267, the DSP's
    18x18 multiplier with REG_INPUTA/B and REG_OUTPUT on CLK0; no pipeline register). The
    registers take a new value only while ``ce`` (CE0) is high."""
    a18, b18 = Signal(signed(18)), Signal(signed(18))
    p36 = Signal(signed(36))
    ports = {f"i_A{k}": a18[k] for k in range(18)}
    ports |= {f"i_B{k}": b18[k] for k in range(18)}
    ports |= {f"i_C{k}": Const(0, 1) for k in range(18)}
    ports |= {f"o_P{k}": p36[k] for k in range(36)}
    inst = Instance(
        "MULT18X18D",
        p_REG_INPUTA_CLK="CLK0", p_REG_INPUTB_CLK="CLK0", p_REG_OUTPUT_CLK="CLK0",
        p_REG_PIPELINE_CLK="NONE", p_REG_INPUTC_CLK="NONE",
        i_SIGNEDA=Const(1, 1), i_SIGNEDB=Const(1, 1), i_SOURCEA=Const(0, 1), i_SOURCEB=Const(0, 1),
        i_CLK0=ClockSignal("sync"), i_CE0=ce, i_RST0=Const(0, 1),
        **ports,
    )
    m.submodules[name] = inst
    m.d.comb += [a18.eq(a), b18.eq(b), p.eq(p36)]


#: A CCU2C half's LUT4 (``INIT0``/``INIT1``) for ``ecp5_cleared_sum``'s bit i: inputs A = a[i], B =
#: b[i], C = clear, D = 1. Entries with D = 1 are the propagate, (A & ~C) ^ B: a cleared adds
#: nothing. Entries 0-3 (C = D = 0) are the generate, read where the propagate is 0: then
#: (A & ~C) = B, so both addends' bit is B's, and so is the carry. Lattice TN1267's carry cell, as
#: Yosys models it (share/ecp5/ccu2c_sim.vh) and sim/ccu2c_model.v does.
CLEARED_SUM_INIT = 0xC6CC


def ecp5_cleared_sum(m: Module, name: str, clear, a, b, s) -> None:
    """Adds to ``m`` ``s = (0 if clear else a) + b`` (modulo 2 ** len(s); ``a`` and ``b`` are
    extended to ``len(s)`` bits as their signedness says) as one ECP5 carry chain: CCU2C cells
    (submodules ``name``0, 1, ...), each adding two bits, whose LUTs also clear ``a``. An
    accumulator's ``Mux(first, b, acc + b)`` takes Yosys a carry chain and a LUT4 per bit; this,
    the chain alone."""
    width = len(s)
    a_ext, b_ext, s_ext = Signal(width + 1), Signal(width + 1), Signal(width + 1)
    m.d.comb += [a_ext.eq(a), b_ext.eq(b), s.eq(s_ext[:width])]
    carry = Const(0, 1)
    init = Const(CLEARED_SUM_INIT, 16)
    for k, i in enumerate(range(0, width, 2)):
        cout = Signal(name=f"{name}{k}_cout")
        m.submodules[f"{name}{k}"] = Instance(
            "CCU2C", p_INIT0=init, p_INIT1=init, p_INJECT1_0="NO", p_INJECT1_1="NO",
            i_CIN=carry, i_A0=a_ext[i], i_B0=b_ext[i], i_C0=clear, i_D0=Const(1, 1),
            i_A1=a_ext[i + 1], i_B1=b_ext[i + 1], i_C1=clear, i_D1=Const(1, 1),
            o_S0=s_ext[i], o_S1=s_ext[i + 1], o_COUT=cout)
        carry = cout


#: PEs that one copy of the array's control registers drives at most (``MacArray``'s
#: ``control_pes``): the 8x8 core's 64, one copy, meet 100 MHz on an ECP5; a 16x16 array has 4.
CONTROL_PES = 64


def control_register(m: Module, name: str, d, q, ecp5: bool) -> None:
    """``q`` is ``d`` a cycle later (sync domain, reset to 0): one copy of a control register.
    Yosys merges flip-flops that have the same input, so elaborated for an ECP5 each copy is a
    TRELLIS_FF instance (synchronous reset on LSR, always enabled; CE and M unconnected, as
    Yosys' own mapping leaves them: nextpnr's packer takes M), which it keeps."""
    if not ecp5:
        m.d.sync += q.eq(d)
        return
    m.submodules[name] = Instance(
        "TRELLIS_FF", p_GSR="DISABLED", p_CEMUX="1", p_CLKMUX="CLK", p_LSRMUX="LSR", p_SRMODE="LSR_OVER_CE",
        p_REGSET="RESET", i_CLK=ClockSignal("sync"), i_LSR=ResetSignal("sync"), i_DI=d, o_Q=q)


class MacArray(wiring.Component):
    """``rows`` x ``cols`` int MACs; equals ``hbfp.golden.gemm.partial_sums`` per K-tile.

    Input ``i``: one K step per beat, ``{a: rows codes, b: cols codes}``; every ``tk`` beats
    close a K-tile; ``i.ready`` is always 1. Output ``o``: ``rows * groups`` beats per K-tile,
    ``{sums: cols / groups sums, row, group}`` (the sums of columns ``group * cols / groups``
    on), row-major, on consecutive cycles. Latency: the first beat of a K-tile
    leaves ``LATENCY`` (``hbfp.contract.MAC_LATENCY`` = 5) cycles after the tile's last beat
    enters. Throughput: one beat per cycle, every PE one MAC per cycle.

    The array never stalls, so nothing in it is enabled by a ready: ``o.ready`` is assumed to
    be 1 (the stream signatures stay for the connection; a beat not taken is lost). That
    holds because a K-tile's ``rows * groups`` beats drain one a cycle, within the ``tk >=
    rows * groups`` beats that the next K-tile takes to close (the constructor refuses fewer).

    ``dsp_macs``: how many PEs (row-major) use a DSP multiplier; the rest use LUT multipliers.
    Default: all of them.

    ``control_pes``: the PEs that one copy of the last stage's control registers (valid,
    first and last beat of the K-tile, the shadow bank's ``full``) serves at most; every
    ``control_rows = control_pes // cols`` PE rows (at least one) have their copy, so that no
    control net spans the whole array (16x16: 4 copies, each driving 64 PEs' accumulators and
    shadow registers). All copies hold the same bits; with one copy the array is as before.
    """

    LATENCY = MAC_LATENCY

    def __init__(self, rows: int, cols: int, tk: int, mantissa_bits_a: int = 8, mantissa_bits_b: int = 8,
                 dsp_macs: int | None = None, groups: int = 1, control_pes: int = CONTROL_PES):
        try:
            if rows < 1 or cols < 1 or tk < 1 or groups < 1 or control_pes < 1:
                raise ValueError("rows, cols, tk, groups and control_pes must be positive")
            if cols % groups:
                raise ValueError(f"groups ({groups}) must divide cols ({cols})")
            if tk < rows * groups:
                raise ValueError(f"the K-tile ({tk}) must be at least as long as rows x groups ({rows} x {groups}): "
                                 "a K-tile's sums drain one beat a cycle before the next K-tile closes")
            if dsp_macs is not None and not 0 <= dsp_macs <= rows * cols:
                raise ValueError(f"dsp_macs must be 0..{rows * cols} (rows x cols), got {dsp_macs}")
        except ValueError:
            self._MustUse__used = True  # never to be elaborated: no "unused" warning
            raise
        self.rows, self.cols, self.tk, self.groups = rows, cols, tk, groups
        self.mantissa_bits_a, self.mantissa_bits_b = mantissa_bits_a, mantissa_bits_b
        self.dsp_macs = rows * cols if dsp_macs is None else dsp_macs
        self.control_pes = control_pes
        #: PE rows per copy of the control registers, and the copies (``control_copy(i)``).
        self.control_rows = max(1, control_pes // cols)
        self.control_copies = -(-rows // self.control_rows)
        self.psum_width = psum_width(mantissa_bits_a, mantissa_bits_b, tk)
        in_layout = data.StructLayout({
            "a": data.ArrayLayout(signed(mantissa_bits_a), rows),
            "b": data.ArrayLayout(signed(mantissa_bits_b), cols),
        })
        out_layout = data.StructLayout({
            "sums": data.ArrayLayout(signed(self.psum_width), cols // groups),
            "row": range(rows),
            "group": range(groups),
        })
        super().__init__({"i": In(stream.Signature(in_layout)), "o": Out(stream.Signature(out_layout))})

    def control_copy(self, i: int) -> int:
        """The copy of the control registers (valid, first, last, full) that PE row ``i`` uses."""
        return i // self.control_rows

    def uses_dsp(self, i: int, j: int) -> bool:
        """Whether PE (i, j) multiplies in a DSP block."""
        return i * self.cols + j < self.dsp_macs

    def elaborate(self, platform):
        m = Module()
        R, C, W = self.rows, self.cols, self.psum_width
        ma, mb = self.mantissa_bits_a, self.mantissa_bits_b
        ecp5 = getattr(platform, "family", None) == "ecp5"

        # Stage 1: the operands, registered once per PE row (a[i]) and column (b[j]). Stage 2: in
        # a DSP PE a copy of its operands (meant to give the fan-out across the die a cycle of
        # its own; Yosys merges equal registers, so in portable Verilog it does not; elaborated
        # for an ECP5 the DSP blocks' input registers are these copies), in a LUT PE its Booth
        # partial products. Stage 3: the products (for an ECP5 the DSP blocks' output
        # registers). Stage 4: the products again, in the fabric: a DSP block sits in a column
        # of DSP blocks, often far across the die from its PE's adder, and this register gives
        # that route a cycle of its own. Stage 5: the accumulators.
        # Data registers have no reset and no enable (nothing stalls): tools that pack
        # registers into DSP blocks can; only the valid pipeline and the drain are reset.
        k = Signal(range(self.tk))
        a1 = [Signal(signed(ma), name=f"a1_{i}", reset_less=True) for i in range(R)]
        b1 = [Signal(signed(mb), name=f"b1_{j}", reset_less=True) for j in range(C)]
        v1, first1, last1 = Signal(name="v1"), Signal(name="first1"), Signal(name="last1")
        prod = [[Signal(signed(ma + mb), name=f"prod_{i}_{j}", reset_less=True) for j in range(C)] for i in range(R)]
        prod4 = [[Signal(signed(ma + mb), name=f"prod4_{i}_{j}", reset_less=True) for j in range(C)] for i in range(R)]
        v1b, first1b, last1b = Signal(name="v1b"), Signal(name="first1b"), Signal(name="last1b")
        v1c, first1c, last1c = Signal(name="v1c"), Signal(name="first1c"), Signal(name="last1c")
        v2, first2, last2 = Signal(name="v2"), Signal(name="first2"), Signal(name="last2")
        acc = [[Signal(signed(W), name=f"acc_{i}_{j}", reset_less=True) for j in range(C)] for i in range(R)]
        shadow = [[Signal(signed(W), name=f"shadow_{i}_{j}", reset_less=True) for j in range(C)] for i in range(R)]
        full = Signal()  # the shadow bank holds sums not yet drained
        G = self.groups
        L = C // G
        row = Signal(range(R))
        group = Signal(range(G))
        load = Signal()  # a K-tile's last beat: its sums go to the shadow bank
        m.d.comb += load.eq(v2 & last2)

        m.d.comb += self.i.ready.eq(1)
        m.d.sync += [
            *(a1[i].eq(self.i.payload.a[i]) for i in range(R)),
            *(b1[j].eq(self.i.payload.b[j]) for j in range(C)),
            v1.eq(self.i.valid),
            first1.eq(k == 0),
            last1.eq(k == self.tk - 1),
            v1b.eq(v1),
            first1b.eq(first1),
            last1b.eq(last1),
            v1c.eq(v1b),
            first1c.eq(first1b),
            last1c.eq(last1b),
            v2.eq(v1c),
            first2.eq(first1c),
            last2.eq(last1c),
        ]
        with m.If(self.i.valid):
            m.d.sync += k.eq(Mux(k == self.tk - 1, 0, k + 1))

        # The control registers of the last stage, one copy per ``control_rows`` PE rows: the
        # accumulators' enable and the shadow bank's load and shift reach PE_W * control_pes
        # flip-flops each, not the whole array's. One copy: v2, first2, last2, full themselves.
        n = self.control_copies
        if n == 1:
            v2_c, first2_c, last2_c, load_c, full_c = [v2], [first2], [last2], [load], [full]
        else:
            # ``full``'s next value, which its copies take as it does.
            full_next = Mux(load, 1, Mux(full & (group == G - 1) & (row == R - 1), 0, full))
            copies = {}
            for name, d in (("v2", v1c), ("first2", first1c), ("last2", last1c), ("full", full_next)):
                copies[name] = [Signal(name=f"{name}_c{c}") for c in range(n)]
                for c, q in enumerate(copies[name]):
                    control_register(m, f"{name}_c{c}", d, q, ecp5)
            v2_c, first2_c, last2_c, full_c = (copies[x] for x in ("v2", "first2", "last2", "full"))
            load_c = [Signal(name=f"load_c{c}") for c in range(n)]
            m.d.comb += [load_c[c].eq(v2_c[c] & last2_c[c]) for c in range(n)]

        # -a[i] for a row's LUT PEs, registered beside a1[i]: the row's operands then reach its
        # PEs across the die from flip-flops, with no adder on the way.
        lut_rows = [i for i in range(R) if not all(self.uses_dsp(i, j) for j in range(C))]
        na1 = {i: Signal(signed(ma + 1), name=f"na1_{i}", reset_less=True) for i in lut_rows}
        m.d.sync += [na1[i].eq(-self.i.payload.a[i]) for i in lut_rows]
        for i in range(R):
            c = self.control_copy(i)
            for j in range(C):
                if self.uses_dsp(i, j) and ecp5:
                    # The DSP block's input registers are the operand copy, its output register
                    # the product's (``ecp5_multiplier``).
                    ecp5_multiplier(m, f"dsp_{i}_{j}", a1[i], b1[j], prod[i][j])
                elif self.uses_dsp(i, j):
                    a_pe = Signal(signed(ma), name=f"a2_{i}_{j}", reset_less=True)
                    b_pe = Signal(signed(mb), name=f"b2_{i}_{j}", reset_less=True)
                    m.d.sync += [a_pe.eq(a1[i]), b_pe.eq(b1[j]), prod[i][j].eq(a_pe * b_pe)]
                else:
                    # A staged Booth product: its partial products (from the row's a1 and -a1
                    # and the column's b1) are stage 2, its adder tree ends at stage 3.
                    pe = m.submodules[f"booth_{i}_{j}"] = BoothProduct(ma, mb, staged=True)
                    assert pe.LATENCY == 1
                    m.d.comb += [pe.a.eq(a1[i]), pe.neg_a.eq(na1[i]), pe.b.eq(b1[j])]
                    m.d.sync += prod[i][j].eq(pe.p)
                m.d.sync += prod4[i][j].eq(prod[i][j])
                if ecp5:
                    # The first beat's clear of the accumulator in the adder's own LUTs.
                    nxt = Signal(signed(W), name=f"nxt_{i}_{j}")
                    ecp5_cleared_sum(m, f"sum_{i}_{j}_", first2_c[c], acc[i][j], prod4[i][j], nxt)
                else:
                    nxt = Mux(first2_c[c], prod4[i][j], acc[i][j] + prod4[i][j])
                with m.If(v2_c[c]):
                    m.d.sync += acc[i][j].eq(nxt)
                # The shadow bank is a shift register of the drain's beats (row-major, ``groups``
                # beats a row): beat 0 leaves from row 0's first columns and every other moves
                # up a place a cycle, so the drain needs no multiplexer across the array.
                g, l = divmod(j, L)
                if g + 1 < G:
                    behind = shadow[i][(g + 1) * L + l]
                elif i + 1 < R:
                    behind = shadow[i + 1][l]
                else:
                    behind = Const(0, signed(W))
                with m.If(load_c[c]):
                    m.d.sync += shadow[i][j].eq(nxt)
                with m.Elif(full_c[c]):
                    m.d.sync += shadow[i][j].eq(behind)

        # A K-tile's sums drain on the R * G cycles after they reach the shadow bank.
        with m.If(load):
            m.d.sync += [full.eq(1), row.eq(0), group.eq(0)]
        with m.Elif(full):
            m.d.sync += group.eq(group + 1)
            with m.If(group == G - 1):
                m.d.sync += [group.eq(0), row.eq(row + 1)]
                with m.If(row == R - 1):
                    m.d.sync += full.eq(0)

        m.d.comb += [self.o.valid.eq(full), self.o.payload.row.eq(row), self.o.payload.group.eq(group)]
        for j in range(L):
            m.d.comb += self.o.payload.sums[j].eq(shadow[0][j])
        return m
