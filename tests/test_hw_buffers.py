import pytest

from hbfp.hw.buffers import OperandBuffer
from hbfp.sim import runner


@pytest.mark.parametrize("sim", runner.SIMULATORS)
@pytest.mark.parametrize("lanes, rows, cols", [(4, 48, 48), (8, 32, 96), (3, 24, 36)])
def test_operand_buffer_reads_rows_and_columns(sim, lanes, rows, cols):
    runner.require(sim)
    cfg = dict(lanes=lanes, rows=rows, cols=cols, code_width=8, seed=lanes, rounds=2)
    tests, failed = runner.run(lambda: OperandBuffer(lanes, 8, rows, cols), "operand_buffer", "tb_buffers", sim, cfg)
    assert tests == 1 and failed == 0
