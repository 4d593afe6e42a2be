"""The open flow's bookkeeping, without running the tools: module names of generated Verilog,
cell counts of kept submodules, LUT4s as nextpnr counts them."""

import json
from pathlib import Path

import pytest
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


def test_comb_cells_by_module_counts_by_hierarchical_name(tmp_path):
    """nextpnr's logic cells per module of a routed netlist: by the cells' hierarchical names, a
    carry chain's cells that nextpnr made going with the named cells they share nets with."""
    from hbfp.hw.openflow import comb_cells_by_module

    def comb(*nets):
        return {"type": "TRELLIS_COMB", "connections": {f"P{i}": [n] for i, n in enumerate(nets)}}

    cells = {
        "mac.pe0.lut": comb(10, 11), "mac.pe1.lut": comb(11, 12),
        "$nextpnr_CCU2C_1$CCU2_COMB0": comb(12, 13),  # shares net 12 with the array's cell
        "$nextpnr_CCU2C_2$CCU2_COMB0": comb(13, 14),  # only with the made cell before it
        "accumulate$5.add0.sum": comb(20), "accumulate$5.normalize0.x": comb(21),
        "epilogue.quantize.mix": comb(30), "issue.count": comb(31),
        "mac.pe0.ff": {"type": "TRELLIS_FF", "connections": {"Q": [10]}},  # not a logic cell
    }
    path = tmp_path / "routed.json"
    path.write_text(json.dumps({"modules": {"top": {"cells": cells}}}))
    got = comb_cells_by_module(path, {"array": ["core.mac"],
                                      "lanes": ["core.accumulate$5.add0", "core.accumulate$5.normalize0"]})
    assert got == {"array": 4, "lanes": 2, "outside": 2, "all": 8}


@pytest.mark.parametrize("xaiger1", [False, True])
def test_synth_ecp5_takes_the_older_xaiger_writer_when_told(tmp_path, monkeypatch, xaiger1):
    """``synth_ecp5(..., xaiger1=True)`` sets ABC9's writer before ``synth_ecp5`` runs (the
    density experiment's cores that stop on the default writer with kept modules); not told,
    the script leaves it alone. The tool itself is not run here."""

    def tool(cmd, cwd, log):
        (Path(cwd) / "stat.json").write_text('{"modules": {"\\\\top": {"num_cells_by_type": {"LUT4": 3}}}}')
        (Path(cwd) / "stat.txt").write_text("")
        Path(log).write_text("")
        return 1.0

    monkeypatch.setattr(openflow, "run_tool", tool)
    (tmp_path / "top.v").write_text("module top; endmodule\n")
    got = openflow.synth_ecp5(tmp_path / "top.v", "top", tmp_path / "w", xaiger1=xaiger1)
    script = (tmp_path / "w" / "synth.ys").read_text()
    assert got["cells"] == {"LUT4": 3}
    if xaiger1:
        assert script.index(openflow.ABC9_XAIGER1) < script.index("synth_ecp5")
    else:
        assert "xaiger" not in script
