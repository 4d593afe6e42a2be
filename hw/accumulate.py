"""The accumulate lanes: each K-tile's exact sums, normalized to fp32 and added into the
accumulator buffer (the read-modify-write of ``hbfp.golden.gemm.gemm``'s K-tile loop).

A drained row of the MAC array (``cols`` sums, the row's A exponent, the columns' B
exponents, the accumulator address of the row) enters ``i``; ``cols`` normalizer lanes turn
the sums into fp32 products, the old accumulator word is read so that it arrives with them,
``cols`` fp32 adders add, and the word is written back. The lanes never stall: the core
drains one row a cycle, and the loop closes within a K-tile (``hbfp.contract.rmw_latency``).
"""

from __future__ import annotations

from amaranth import Module, Mux, Signal, signed
from amaranth.lib import data, memory, stream, wiring
from amaranth.lib.wiring import In, Out

from .add_f32 import AddF32Datapath
from .normalize import NormalizeDatapath
from .params import ACC_READ_LATENCY, EXP_WIDTH, FP32_WIDTH, CoreConfig, psum_width

__all__ = ["Accumulate", "drain_layout", "delayed"]


def drain_layout(cfg: CoreConfig) -> data.StructLayout:
    """One drained row: its sums, exponents, accumulator address and flags."""
    return data.StructLayout({
        "sums": data.ArrayLayout(signed(psum_width(cfg.mantissa_bits, cfg.mantissa_bits, cfg.tk)), cfg.cols),
        "exp_a": EXP_WIDTH,
        "exp_b": data.ArrayLayout(EXP_WIDTH, cfg.cols),
        "addr": range(cfg.size * (cfg.size // cfg.cols)),
        "zero": 1,  # the first K-tile of a product that does not accumulate: start from +0
        "closes": 1,  # the last row of a row-block's last K-tile: the row-block is complete
    })


def delayed(m: Module, value, cycles: int, name: str):
    """``value`` ``cycles`` cycles later (a line of registers; the value itself for 0)."""
    for s in range(cycles):
        reg = Signal.like(value, name=f"{name}_d{s + 1}")
        m.d.sync += reg.eq(value)
        value = reg
    return value


class Accumulate(wiring.Component):
    """``acc[addr] = add_f32(zero ? +0 : acc[addr], normalize(sums, exp_a, exp_b))`` per lane.

    Ports: ``i`` (stream in, ``drain_layout``; ``ready`` is always 1: a row a cycle at most),
    ``acc_read`` (a read port of the accumulator buffer, synchronous, whose data this component
    registers: ``ACC_READ_LATENCY`` cycles), ``acc_write`` (its write port, driven only while
    ``active``; the core multiplexes the host's writes in otherwise), ``closed`` (a strobe in the
    cycle a row-block's last word is written: it is readable from the next cycle).

    Latency: a row entering in cycle t is written in cycle t + ``NormalizeDatapath.LATENCY`` +
    ``AddF32Datapath.LATENCY``; the read of the old word is issued in cycle t + Ln - 2.
    """

    def __init__(self, cfg: CoreConfig):
        self.cfg = cfg
        words = cfg.size * (cfg.size // cfg.cols)
        word = data.ArrayLayout(FP32_WIDTH, cfg.cols)
        super().__init__({
            "i": In(stream.Signature(drain_layout(cfg))),
            "acc_read": In(memory.ReadPort.Signature(addr_width=max(1, (words - 1).bit_length()), shape=word)),
            "acc_write": In(memory.WritePort.Signature(addr_width=max(1, (words - 1).bit_length()), shape=word)),
            "closed": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self.cfg
        C, mb = cfg.cols, cfg.mantissa_bits
        Ln, La = NormalizeDatapath.LATENCY, AddF32Datapath.LATENCY
        if Ln < ACC_READ_LATENCY:
            raise ValueError(f"the normalizer ({Ln} cycles) must cover the accumulator read ({ACC_READ_LATENCY})")
        row = self.i.payload
        valid = self.i.valid
        m.d.comb += self.i.ready.eq(1)

        # The old word: read so that its registered data arrives with the normalizers' results.
        read_addr = delayed(m, row.addr, Ln - ACC_READ_LATENCY, "read_addr")
        # A row that starts from +0 clears the register instead (a flip-flop's synchronous
        # reset: no multiplexer in front of the adders).
        old = Signal.like(self.acc_read.data)
        # Read in every cycle (the data is taken only with a valid row): no enable net to the
        # block RAMs.
        m.d.comb += [self.acc_read.addr.eq(read_addr), self.acc_read.en.eq(1)]
        m.d.sync += old.eq(Mux(delayed(m, row.zero, Ln - 1, "zero"), 0, self.acc_read.data))

        for j in range(C):
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
                self.acc_write.data[j].eq(ad.result),
            ]
        m.d.comb += [
            self.acc_write.en.eq(delayed(m, valid, Ln + La, "write_en")),
            self.acc_write.addr.eq(delayed(m, row.addr, Ln + La, "write_addr")),
            self.closed.eq(delayed(m, valid & row.closes, Ln + La, "closed")),
        ]
        return m
