"""The GEMM planner: how a product is tiled to a device's buffers and the commands that carry it,
as pure functions of the device's identity (IDENTIFY) and the product. No transport, no
session: ``hbfp.host.Device.gemm`` asks ``plan_gemm`` what to do, then runs the plan's
commands (``chain``, block by block in ``Plan.order``) through its session, or computes the
product in process (the in-process emu) with the cycles those commands would take
(``blocks``, ``discarded``).

A plan's decisions: the block sides and counts along M, N and K (blocks aligned to the tiles a
stored operand or a BFP output needs whole), the loop order (with one K chunk, the operand
whose re-sending would cost more stays in its buffer), what the host does that the device
cannot (quantize values, the activation, a BFP output: a reduced device, or a stochastic
stream a block would restart), and each command's result format (a K chunk before the last
only leaves its sums in the accumulator: the smallest reply the device can send)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import protocol as P
from .errors import NotSupported
from .protocol import Op, OutFormat, Target

__all__ = ["Blocks", "Plan", "Step", "blocks", "discarded", "plan_gemm", "chain", "OUT_CODES"]

#: The wire's result format of each ``out`` of ``Device.gemm``.
OUT_CODES = {"fp32": OutFormat.FP32, "bf16": OutFormat.BF16, "bfp": OutFormat.BFP}


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class Blocks(NamedTuple):
    """Block sides ``bm, bn, bk`` and their counts ``nI, nJ, nP`` along M, N and K."""

    bm: int
    bn: int
    bk: int
    nI: int
    nJ: int
    nP: int


def blocks(ident: P.Identity, M: int, N: int, K: int, transpose_a: bool, transpose_b: bool, bfp_out: bool,
           name: str = "the device") -> Blocks:
    """How a product is tiled to the buffers (blocks aligned to the tiles that a stored
    operand, or a BFP output, needs whole)."""
    D = ident.size
    th, tw = ident.tile
    align_m = math.lcm(tw if transpose_a else th, th if bfp_out else 1)
    align_n = math.lcm(th if transpose_b else tw, tw if bfp_out else 1)

    def side(total: int, align: int) -> int:
        if total <= D:
            return max(total, 1)
        if D < align:
            raise NotSupported(f"{name}'s buffers ({D}) are smaller than the alignment {align} tiling needs")
        return D // align * align

    bm, bn, bk = side(M, align_m), side(N, align_n), side(K, ident.tk)
    return Blocks(bm, bn, bk, -(-M // bm), -(-N // bn), max(1, -(-K // bk)))


def discarded(ident: P.Identity, m: int, n: int) -> OutFormat:
    """The result format of a K chunk before the last, which only leaves its sums in the
    accumulator and whose reply is discarded: the smallest result the device can send (BFP,
    unless a block of few elements in padded tiles is smaller in bf16 or the device has no
    output quantizer)."""
    if ident.has("bfp_output") and (P.result_size(m, n, OutFormat.BFP, ident.mantissa_bits, ident.tile)
                                    <= P.result_size(m, n, OutFormat.BF16, ident.mantissa_bits, ident.tile)):
        return OutFormat.BFP
    return OutFormat.BF16


@dataclass
class Plan:
    """What ``Device.gemm`` does with a product (``plan_gemm``)."""

    M: int
    N: int
    K: int
    transpose_a: bool
    transpose_b: bool
    blocks: Blocks
    #: (i, j) of the output blocks, in the order their chains run.
    order: list
    #: The format the device sends the final results in, and the activation it applies.
    final: OutFormat
    act: int
    #: What the host does: quantize A's or B's values, the activation, the BFP output.
    host_a: bool
    host_b: bool
    host_act: bool
    host_out: bool
    #: The rounding code and seed of a BFP result sent by the device (0 otherwise).
    out_rounding: int
    out_seed: int

    def block(self, i: int, j: int) -> tuple[int, int, int, int]:
        """Rows m0:m1 and columns n0:n1 of output block (i, j)."""
        b = self.blocks
        return i * b.bm, min(self.M, (i + 1) * b.bm), j * b.bn, min(self.N, (j + 1) * b.bn)


def plan_gemm(ident: P.Identity, M: int, N: int, K: int, *, transpose_a: bool, transpose_b: bool, out: str,
              act: int | None, rounding: str, out_seed: int, input: str, a_values: bool, b_values: bool,
              a_shape: tuple, b_shape: tuple, name: str = "the device") -> Plan:
    """The plan of ``act(op(A) @ op(B) + C + bias)`` (M x K by K x N, M and N positive):
    ``act`` the device's code of the activation (None: the device has no unit for it, so the
    host applies it; ``P.NO_ACTIVATION``: none), ``a_values``/``b_values`` whether an operand
    goes as values for the device to quantize (``input`` "fp32" or "bf16")."""
    th, tw = ident.tile
    bfp_out = out == "bfp"
    bl = blocks(ident, M, N, K, transpose_a, transpose_b, bfp_out, name)
    stochastic = rounding == "stochastic"

    def on_device(quantizer: str) -> bool:
        # A reduced device may lack the quantizer, or its stochastic rounding.
        return ident.has(quantizer) and (ident.has("stochastic") or not stochastic)

    host_q = []
    for values, shape, whole in ((a_values, a_shape, bl.nI == 1 and bl.nP == 1),
                                 (b_values, b_shape, bl.nJ == 1 and bl.nP == 1)):
        # The device's stream positions start at each written region's first tile: they are
        # the whole matrix's only if the operand goes in one piece. (With K = 0 no operand is
        # sent.)
        rp, cp = _round_up(shape[0], th), _round_up(shape[1], tw)
        one_write = rp * cp * (4 if input == "fp32" else 2) <= ident.max_payload - P.WRITE_HEADER
        host_q.append(bool(values and K) and (not on_device("value_quantizer")
                                               or (stochastic and not (whole and one_write))))
    host_act = act is None
    # A BFP output is quantized here from the fp32 result when the device cannot, or when it
    # is split and stochastic, for the same reason (the device would start every block's
    # stream at 0), or after an activation applied here.
    split_out = bl.nI > 1 or bl.nJ > 1
    host_out = bfp_out and (host_act or not on_device("bfp_output") or (stochastic and split_out))
    if host_act:
        # The activation reads the sums rounded to bf16 (golden.gemm.epilogue), which is
        # what the device sends as a bf16 result without one: half the bytes of fp32.
        final = OutFormat.BF16
    else:
        final = OutFormat.FP32 if host_out else OUT_CODES[out]
    out_rounding, seed = (P.ROUNDING_CODES[rounding], out_seed) if final == OutFormat.BFP else (0, 0)
    # Loop order: with one K chunk an operand block can stay in its buffer across the other
    # loop; keep the one whose re-sending would cost more.
    nI, nJ = bl.nI, bl.nJ
    if bl.nP == 1 and N * nI > M * nJ:
        order = [(i, j) for j in range(nJ) for i in (range(nI) if j % 2 == 0 else range(nI - 1, -1, -1))]
    else:
        order = [(i, j) for i in range(nI) for j in (range(nJ) if i % 2 == 0 else range(nJ - 1, -1, -1))]
    return Plan(M, N, K, transpose_a, transpose_b, bl, order, final, P.NO_ACTIVATION if host_act else act,
                host_q[0], host_q[1], host_act, host_out, out_rounding, seed)


# ---- commands ------------------------------------------------------------------------------

@dataclass
class Step:
    """One command of a plan: its opcode and payload, whether it occupies the device (GEMM,
    READ) and accumulates onto the accumulator (running it twice changes the result), and
    what its reply carries: ``("result", m0, m1, n0, n1, k)`` (a block of the result),
    ``("partial", m, n, k)`` (a discarded K chunk: its cycles), or None (a status)."""

    op: Op
    payload: bytes
    heavy: bool = False
    accumulate: bool = False
    reply: tuple | None = None


def region_writes(ident: P.Identity, target: int, rows: int, cols: int, unit_bytes: int, row_align: int,
                  col_align: int, data_of: Callable[[int, int, int, int], bytes], name: str = "the device",
                  **fields) -> list[Step]:
    """WRITE commands for a region (0, 0, rows, cols) of a buffer, split to fit
    ``max_payload`` in aligned pieces; ``data_of(r0, r1, c0, c1)`` gives a piece's data."""
    limit = ident.max_payload - P.WRITE_HEADER
    col_step = cols
    if cols * row_align * unit_bytes > limit:
        col_step = (limit // (row_align * unit_bytes)) // col_align * col_align
        if col_step < 1:
            raise NotSupported(f"{name}: max_payload {ident.max_payload} is too small for a write")
    row_step = max(row_align, (limit // (col_step * unit_bytes)) // row_align * row_align)
    steps = []
    for r0 in range(0, rows, row_step):
        r1 = min(rows, r0 + row_step)
        for c0 in range(0, cols, col_step):
            c1 = min(cols, c0 + col_step)
            payload = P.encode_write(target, r0, c0, r1 - r0, c1 - c0, data_of(r0, r1, c0, c1), **fields)
            steps.append(Step(Op.WRITE, payload))
    return steps


def operand_writes(ident: P.Identity, op, buffer: str, r0: int, r1: int, c0: int, c1: int,
                   name: str = "the device") -> list[Step]:
    """Write the stored region [r0:r1, c0:c1] of an operand (``Device``'s ``_Operand``: its
    codes ``t`` or its values ``v``) at the buffer's origin."""
    th, tw = ident.tile
    rows, cols = r1 - r0, c1 - c0
    if op.values:
        v = op.v[r0:r1, c0:c1]
        rp, cp = _round_up(rows, th), _round_up(cols, tw)
        pad = np.zeros((rp, cp), v.dtype)
        pad[:rows, :cols] = v
        fp32 = op.input == "fp32"
        wire = "<f4" if fp32 else "<u2"
        target = Target.A_VALUES if buffer == "A" else Target.B_VALUES
        return region_writes(
            ident, target, rp, cp, 4 if fp32 else 2, th, tw,
            lambda a, b, c, d: P.to_tile_major(pad[a:b, c:d], (th, tw)).astype(wire).tobytes(), name,
            encoding=P.Encoding.FP32 if fp32 else P.Encoding.BF16,
            rounding=P.ROUNDING_CODES[op.fmt.rounding], seed=op.seed)
    lanes = ident.rows if buffer == "A" else ident.cols
    mb = ident.mantissa_bits
    codes = np.zeros((rows, _round_up(cols, lanes)), op.t.codes.dtype)
    codes[:, :cols] = op.t.codes[r0:r1, c0:c1]
    exps = np.ascontiguousarray(op.t.exponents[r0 // th : -(-r1 // th), c0 // tw : -(-c1 // tw)])
    targets = (Target.A_CODES, Target.A_EXPONENTS) if buffer == "A" else (Target.B_CODES, Target.B_EXPONENTS)
    steps = region_writes(ident, targets[0], rows, codes.shape[1], P.code_bytes(mb), 1, lanes,
                          lambda a, b, c, d: P.encode_codes(codes[a:b, c:d], mb), name)
    steps += region_writes(ident, targets[1], *exps.shape, 1, 1, 1, lambda a, b, c, d: exps[a:b, c:d].tobytes(), name)
    return steps


def fp32_writes(ident: P.Identity, target: int, x: np.ndarray, name: str = "the device") -> list[Step]:
    """C (accumulator) or bias values at the buffer's origin, padded to the array's lanes."""
    lanes = ident.cols
    rows, cols = x.shape
    pad = np.zeros((rows, _round_up(cols, lanes)), "<f4")
    pad[:, :cols] = x
    return region_writes(ident, target, rows, pad.shape[1], 4, 1, lanes, lambda a, b, c, d: pad[a:b, c:d].tobytes(),
                         name)


def _c_alone(plan: Plan, ident: P.Identity, m0: int, m1: int, n0: int, n1: int, c, bias, name: str) -> list[Step]:
    """K = 0: the product is C alone: load it (or zeros) and read it through the epilogue."""
    mi, nj = m1 - m0, n1 - n0
    steps = fp32_writes(ident, Target.ACC, c[m0:m1, n0:n1] if c is not None else np.zeros((mi, nj), np.float32), name)
    if bias is not None:
        steps += fp32_writes(ident, Target.BIAS, bias[None, n0:n1], name)
    payload = P.encode_read(mi, nj, out_format=plan.final, activation=plan.act, bias=bias is not None,
                            rounding=plan.out_rounding, seed=plan.out_seed)
    return steps + [Step(Op.READ, payload, heavy=True, reply=("result", m0, m1, n0, n1, 0))]


def chain(plan: Plan, ident: P.Identity, i: int, j: int, resident: dict, op_a, op_b, c, bias,
          name: str = "the device") -> list[Step]:
    """The commands of output block (i, j): its operands' blocks (those not already in the
    buffers: ``resident``, updated), C and the bias, then one GEMM per K chunk, accumulating,
    the last with the bias, the activation and the result's format."""
    m0, m1, n0, n1 = plan.block(i, j)
    if plan.K == 0:
        return _c_alone(plan, ident, m0, m1, n0, n1, c, bias, name)
    mi, nj = m1 - m0, n1 - n0
    bk, nP = plan.blocks.bk, plan.blocks.nP
    steps: list[Step] = []
    for p in range(nP):
        k0, k1 = p * bk, min(plan.K, (p + 1) * bk)
        last = p == nP - 1
        if resident.get("A") != ("A", i, p):
            region = (k0, k1, m0, m1) if plan.transpose_a else (m0, m1, k0, k1)
            steps += operand_writes(ident, op_a, "A", *region, name)
            resident["A"] = ("A", i, p)
        if resident.get("B") != ("B", p, j):
            region = (n0, n1, k0, k1) if plan.transpose_b else (k0, k1, n0, n1)
            steps += operand_writes(ident, op_b, "B", *region, name)
            resident["B"] = ("B", p, j)
        if p == 0 and c is not None:
            steps += fp32_writes(ident, Target.ACC, c[m0:m1, n0:n1], name)
        if last and bias is not None and resident.get("bias") != ("bias", j):
            steps += fp32_writes(ident, Target.BIAS, bias[None, n0:n1], name)
            resident["bias"] = ("bias", j)
        accumulate = p > 0 or c is not None
        payload = P.encode_gemm(
            mi, nj, k1 - k0, transpose_a=plan.transpose_a, transpose_b=plan.transpose_b, accumulate=accumulate,
            bias=last and bias is not None, activation=plan.act if last else P.NO_ACTIVATION,
            out_format=plan.final if last else discarded(ident, mi, nj),
            rounding=plan.out_rounding if last else 0, seed=plan.out_seed if last else 0)
        reply = ("result", m0, m1, n0, n1, k1 - k0) if last else ("partial", mi, nj, k1 - k0)
        steps.append(Step(Op.GEMM, payload, heavy=True, accumulate=accumulate, reply=reply))
    return steps
