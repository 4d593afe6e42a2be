"""The GEMM planner (hbfp.host.planner) on its own, without a transport: the blocks, the loop
order, what the host does for a reduced device, and each block's commands (operand writes
only where the buffers do not hold them, one GEMM per K chunk accumulating, the result's
format, bias and activation on the last)."""

import numpy as np

from hbfp.contract import CoreConfig
from hbfp.golden import quantize
from hbfp.host import planner
from hbfp.host import protocol as P
from hbfp.host.emu import EmuDevice
from hbfp.host.protocol import Op, OutFormat, Target


class _Op:
    """An operand as Device sends it: codes (``t``), or values (``v``)."""

    def __init__(self, x, fmt, values=False):
        self.values, self.input, self.fmt, self.seed = values, "fp32", fmt, 0
        self.v, self.t = (x, None) if values else (None, quantize(x, fmt))


def test_a_product_larger_than_the_buffers():
    ident = EmuDevice().identity  # buffers 96, tile 24, 8x8 array
    plan = planner.plan_gemm(ident, 200, 150, 250, transpose_a=False, transpose_b=False, out="fp32",
                             act=P.NO_ACTIVATION, rounding="nearest_even", out_seed=0, input="codes",
                             a_values=False, b_values=False, a_shape=(200, 250), b_shape=(250, 150))
    assert plan.blocks == planner.Blocks(96, 96, 96, 3, 2, 3)
    assert sorted(plan.order) == [(i, j) for i in range(3) for j in range(2)] and len(set(plan.order)) == 6
    assert plan.final == OutFormat.FP32 and not (plan.host_a or plan.host_b or plan.host_act or plan.host_out)
    rng = np.random.default_rng(0)
    fmt = ident.fmt()
    a, b = _Op(rng.standard_normal((200, 250), np.float32), fmt), _Op(rng.standard_normal((250, 150), np.float32), fmt)
    bias = rng.standard_normal(150).astype(np.float32)
    resident: dict = {}
    steps = planner.chain(plan, ident, 2, 1, resident, a, b, None, bias)
    gemms = [s for s in steps if s.op == Op.GEMM]
    assert len(gemms) == 3 and all(s.heavy for s in gemms)
    assert [s.accumulate for s in gemms] == [False, True, True]
    assert [s.reply for s in gemms] == [("partial", 8, 54, 96), ("partial", 8, 54, 96), ("result", 192, 200, 96, 150, 58)]
    last = P.decode_gemm(gemms[-1].payload)
    assert (last["m"], last["n"], last["k"], last["out_format"]) == (8, 54, 58, OutFormat.FP32)
    assert last["flags"] & P.GEMM_FLAGS["bias"] and not P.decode_gemm(gemms[0].payload)["flags"] & P.GEMM_FLAGS["bias"]
    writes = [P.decode_write(s.payload)[0] for s in steps if s.op == Op.WRITE]
    assert writes.count(Target.BIAS) == 1 and Target.A_CODES in writes and Target.B_CODES in writes
    # the same block again: its last K chunk's operands are still in the buffers
    again = planner.chain(plan, ident, 2, 1, resident, a, b, None, bias)
    assert [P.decode_write(s.payload)[0] for s in again if s.op == Op.WRITE].count(Target.A_CODES) > 0
    assert resident["A"] == ("A", 2, 2) and resident["B"] == ("B", 2, 1)


def test_a_reduced_device_leaves_the_host_what_it_lacks():
    ident = EmuDevice(CoreConfig(value_quantizer=False, bfp_output=False, stochastic=False, functions=())).identity
    plan = planner.plan_gemm(ident, 30, 40, 50, transpose_a=False, transpose_b=True, out="bfp", act=None,
                             rounding="nearest_even", out_seed=3, input="fp32", a_values=True, b_values=True,
                             a_shape=(30, 50), b_shape=(40, 50))
    assert plan.host_a and plan.host_b and plan.host_act and plan.host_out
    assert plan.final == OutFormat.BF16 and plan.act == P.NO_ACTIVATION and plan.out_rounding == 0


def test_k_zero_reads_c_through_the_epilogue():
    ident = EmuDevice().identity
    plan = planner.plan_gemm(ident, 10, 20, 0, transpose_a=False, transpose_b=False, out="bf16",
                             act=P.NO_ACTIVATION, rounding="nearest_even", out_seed=0, input="codes",
                             a_values=False, b_values=False, a_shape=(10, 0), b_shape=(0, 20))
    c = np.ones((10, 20), np.float32)
    steps = planner.chain(plan, ident, 0, 0, {}, None, None, c, None)
    assert [s.op for s in steps][-1] == Op.READ and steps[-1].reply == ("result", 0, 10, 0, 20, 0)
    assert all(P.decode_write(s.payload)[0] == Target.ACC for s in steps[:-1])
