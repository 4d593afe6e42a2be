"""The accumulate lanes: each K-tile's exact sums, normalized to fp32 and added into the
accumulator buffer (the read-modify-write of ``hbfp.golden.gemm.gemm``'s K-tile loop).

A drained beat of the MAC array (the sums of one row's group of ``acc_lanes`` columns, the
row's A exponent, those columns' B exponents, the accumulator address of the row, the group)
enters ``i``; ``acc_lanes`` normalizer lanes turn the sums into fp32 products, the old
accumulator word is read so that it arrives with them, ``acc_lanes`` fp32 adders add, and the
group's columns of the word are written back. The lanes never stall: the core drains one beat
a cycle, and the loop closes within a K-tile (``hbfp.contract.rmw_latency``).

With fewer lanes than columns (``acc_groups`` > 1) each lane serves ``acc_groups`` columns:
lane l takes column ``group * acc_lanes + l``. The old word then is registered whole as it
leaves the block RAMs and narrowed to the group's columns in a register of its own
(``ACC_GROUP_SELECT``): the read is issued a cycle earlier, so the row still meets its old
value, and no multiplexer follows a block RAM in the cycle of its read.
"""

from __future__ import annotations

from amaranth import Module, Mux, Signal, signed
from amaranth.lib import data, memory, stream, wiring
from amaranth.lib.wiring import In, Out

from .add_f32 import AddF32Datapath
from .normalize import NormalizeDatapath
from .params import ACC_GROUP_SELECT, ACC_READ_LATENCY, EXP_WIDTH, FP32_WIDTH, CoreConfig, psum_width

__all__ = ["Accumulate", "drain_layout", "delayed"]


def drain_layout(cfg: CoreConfig) -> data.StructLayout:
    """One drained beat: a row's sums of one group of columns, their exponents, the row's
    accumulator address, the group and flags."""
    return data.StructLayout({
        "sums": data.ArrayLayout(signed(psum_width(cfg.mantissa_bits, cfg.mantissa_bits, cfg.tk)), cfg.acc_lanes),
        "exp_a": EXP_WIDTH,
        "exp_b": data.ArrayLayout(EXP_WIDTH, cfg.acc_lanes),
        "addr": range(cfg.size * (cfg.size // cfg.cols)),
        "group": range(cfg.acc_groups),
        "zero": 1,  # the first K-tile of a product that does not accumulate: start from +0
        "closes": 1,  # the last row of a row-block's last K-tile: the row-block is complete
    })


def delayed(m: Module, value, cycles: int, name: str, *, reset_less: bool = False):
    """``value`` ``cycles`` cycles later (a line of registers; the value itself for 0).
    ``reset_less`` for data that counts only beside a valid bit: a large design's reset then
    reaches fewer registers (on a full FPGA its net spans the die)."""
    for s in range(cycles):
        reg = Signal.like(value, name=f"{name}_d{s + 1}", reset_less=reset_less)
        m.d.sync += reg.eq(value)
        value = reg
    return value


class Accumulate(wiring.Component):
    """``acc[addr][c] = add_f32(zero ? +0 : acc[addr][c], normalize(sums[l], exp_a, exp_b[l]))``
    for each lane l and its column ``c = group * acc_lanes + l``.

    Ports: ``i`` (stream in, ``drain_layout``; ``ready`` is always 1: a beat a cycle at most),
    ``acc_read`` (a read port of the accumulator buffer, synchronous, whose data this component
    registers: ``ACC_READ_LATENCY`` cycles, and ``ACC_GROUP_SELECT`` more with groups),
    ``acc_write`` (its write port, one enable per column; the core multiplexes the host's writes
    in while idle), ``closed`` (a strobe in the cycle a row-block's last word is written: it is
    readable from the next cycle).

    Latency: a beat entering in cycle t is written in cycle t + ``NormalizeDatapath.LATENCY`` +
    ``AddF32Datapath.LATENCY``; the read of the old word is issued in cycle t + Ln -
    ``ACC_READ_LATENCY`` (a cycle earlier with groups).
    """

    def __init__(self, cfg: CoreConfig):
        self.cfg = cfg
        words = cfg.size * (cfg.size // cfg.cols)
        word = data.ArrayLayout(FP32_WIDTH, cfg.cols)
        super().__init__({
            "i": In(stream.Signature(drain_layout(cfg))),
            "acc_read": In(memory.ReadPort.Signature(addr_width=max(1, (words - 1).bit_length()), shape=word)),
            "acc_write": In(memory.WritePort.Signature(addr_width=max(1, (words - 1).bit_length()), shape=word,
                                                       granularity=1)),
            "closed": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self.cfg
        C, L, G, mb = cfg.cols, cfg.acc_lanes, cfg.acc_groups, cfg.mantissa_bits
        Ln, La = NormalizeDatapath.LATENCY, AddF32Datapath.LATENCY
        select = ACC_GROUP_SELECT if G > 1 else 0
        if Ln < ACC_READ_LATENCY + select:
            raise ValueError(f"the normalizer ({Ln} cycles) must cover the accumulator read "
                             f"({ACC_READ_LATENCY + select})")
        row = self.i.payload
        valid = self.i.valid
        m.d.comb += self.i.ready.eq(1)

        # The old word: read so that its registered data arrives with the normalizers' results.
        read_addr = delayed(m, row.addr, Ln - ACC_READ_LATENCY - select, "read_addr", reset_less=True)
        # Read in every cycle (the data is taken only with a valid beat): no enable net to the
        # block RAMs.
        m.d.comb += [self.acc_read.addr.eq(read_addr), self.acc_read.en.eq(1)]
        # A beat that starts from +0 clears the register instead.
        old = Signal(data.ArrayLayout(FP32_WIDTH, L))
        zero = delayed(m, row.zero, Ln - 1, "zero", reset_less=True)
        if G == 1:
            m.d.sync += old.eq(Mux(zero, 0, self.acc_read.data))
        else:
            word = Signal.like(self.acc_read.data)
            m.d.sync += word.eq(self.acc_read.data)
            group = delayed(m, row.group, Ln - 1, "read_group", reset_less=True)
            with m.If(zero):
                m.d.sync += old.eq(0)
            for g in range(G):
                with m.Elif(group == g):
                    m.d.sync += [old[j].eq(word[g * L + j]) for j in range(L)]

        write_group = delayed(m, row.group, Ln + La, "write_group", reset_less=True)
        write_en = delayed(m, valid, Ln + La, "write_en")
        for c in range(C):
            m.d.comb += self.acc_write.en[c].eq(write_en & (write_group == c // L))
        for j in range(L):
            nd = NormalizeDatapath(len(row.sums[j]), mb, mb)
            ad = AddF32Datapath()
            m.submodules[f"normalize{j}"] = nd
            m.submodules[f"add{j}"] = ad
            m.d.comb += [
                nd.advance.eq(1),
                nd.i_valid.eq(valid),
                nd.i_s.eq(row.sums[j]),
                nd.i_exp_a.eq(row.exp_a),
                nd.i_exp_b.eq(row.exp_b[j]),
                ad.advance.eq(1),
                ad.in_valid.eq(nd.o_valid),
                ad.a.eq(nd.o_result),
                ad.b.eq(old[j]),
                *(self.acc_write.data[g * L + j].eq(ad.result) for g in range(G)),
            ]
        m.d.comb += [
            self.acc_write.addr.eq(delayed(m, row.addr, Ln + La, "write_addr", reset_less=True)),
            self.closed.eq(delayed(m, valid & row.closes, Ln + La, "closed")),
        ]
        return m
