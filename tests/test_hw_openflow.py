"""The open flow's bookkeeping, without running the tools: module names of generated Verilog,
cell counts of kept submodules, LUT4s as nextpnr counts them."""

from amaranth.back import verilog

from hbfp.hw import openflow
from hbfp.hw.mac_array import MacArray


def test_verilog_modules_name_submodules_by_path(tmp_path):
    path = tmp_path / "mac.v"
    path.write_text(verilog.convert(MacArray(2, 2, 4, dsp_macs=3), name="mac"))
    assert sorted(openflow.verilog_modules(path)) == ["mac", "mac.booth_1_1"]


def test_totals_count_submodules_in():
    modules = {
        # as Yosys writes them: cell types without the backslash of the module names
        "\\top": {"num_cells_by_type": {"LUT4": 10, "CCU2C": 1, "top.sub": 2}},
        "\\top.sub": {"num_cells_by_type": {"LUT4": 3, "top.sub.leaf": 1}},
        "\\top.sub.leaf": {"num_cells_by_type": {"CCU2C": 4}},
    }
    memo = {}
    assert openflow._totals(modules, "\\top", memo) == {"LUT4": 16, "CCU2C": 9}
    assert openflow._totals(modules, "\\top.sub", memo) == {"LUT4": 3, "CCU2C": 4}
    assert openflow.lut4_cells({"LUT4": 16, "CCU2C": 9, "TRELLIS_FF": 5}) == 34


def test_conflicting_drivers_are_read_from_yosys_check(tmp_path):
    """A netlist whose nets are driven twice (Yosys' CHECK after a mis-synthesis) is named."""
    log = tmp_path / "synth.log"
    log.write_text("Checking module top...\n"
                   "Warning: multiple conflicting drivers for top.\\acc.read0__data [1]:\n"
                   "    port DOB1[0] of cell acc.slice0 (DP16KD)\n"
                   "    port DOB0[0] of cell acc.slice2 (DP16KD)\n"
                   "Found and reported 1 problems.\n")
    assert openflow.conflicting_drivers(log) == ["top.\\acc.read0__data [1]"]
    (tmp_path / "clean.log").write_text("Checking module top...\nFound and reported 0 problems.\n")
    assert openflow.conflicting_drivers(tmp_path / "clean.log") == []
    assert openflow.conflicting_drivers(tmp_path / "absent.log") == []
