import pytest

from hbfp.hw.buffers import OperandBuffer
from hbfp.hw.openflow import ECP5
from hbfp.sim import runner


@pytest.mark.parametrize("sim", runner.SIMULATORS)
@pytest.mark.parametrize("lanes, rows, cols", [(4, 48, 48), (8, 32, 96), (3, 24, 36)])
def test_operand_buffer_reads_rows_and_columns(sim, lanes, rows, cols):
    runner.require(sim)
    cfg = dict(lanes=lanes, rows=rows, cols=cols, code_width=8, seed=lanes, rounds=2)
    tests, failed = runner.run(lambda: OperandBuffer(lanes, 8, rows, cols), "operand_buffer", "tb_buffers", sim, cfg)
    assert tests == 1 and failed == 0


@pytest.mark.parametrize("sim", runner.SIMULATORS)
@pytest.mark.parametrize("lanes, rows, cols", [(4, 48, 48), (8, 32, 96)])
def test_operand_buffer_for_ecp5_reads_rows_and_columns(sim, lanes, rows, cols):
    """Elaborated for an ECP5 each bank is a DP16KD with its output register (18 bits wide
    at 576 words, 36 at 384), simulated with sim/dp16kd_model.v: the same reads, the same
    latency."""
    runner.require(sim)
    cfg = dict(lanes=lanes, rows=rows, cols=cols, code_width=8, seed=lanes + 1, rounds=2)
    tests, failed = runner.run(lambda: OperandBuffer(lanes, 8, rows, cols), "operand_buffer", "tb_buffers", sim, cfg,
                               platform=ECP5)
    assert tests == 1 and failed == 0


def test_ecp5_elaboration_instantiates_registered_block_rams():
    from amaranth.back import verilog

    text = verilog.convert(OperandBuffer(8, 8, 32, 96), name="b", platform=ECP5)
    assert text.count("DP16KD ") == 8
    assert text.count('.REGMODE_B("OUTREG")') == 8 and text.count(".DATA_WIDTH_B(32'd36)") == 8
    assert "DP16KD" not in verilog.convert(OperandBuffer(8, 8, 32, 96), name="b")  # portable otherwise


@pytest.mark.parametrize("sim", runner.SIMULATORS)
@pytest.mark.parametrize("platform", [None, "ecp5"])
@pytest.mark.parametrize("stall", [False, True])
def test_block_ram_read_pipeline(sim, platform, stall):
    """Random reads and writes against the read pipeline BlockRam documents, with and without
    ``stall``; for an ECP5 the slices are DP16KDs (18 and 2 bits wide at 600 words: one
    narrower than its block) simulated with sim/dp16kd_model.v."""
    from hbfp.hw.block_ram import BlockRam

    runner.require(sim)
    cfg = dict(depth=600, width=20, stall=stall, cycles=1500, seed=3 + stall)
    tests, failed = runner.run(lambda: BlockRam(20, 600, stall=stall), "block_ram", "tb_block_ram", sim, cfg,
                               platform=ECP5 if platform else None)
    assert tests == 1 and failed == 0
