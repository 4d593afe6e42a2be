"""The LUT multiplier against Yosys' own LUT mapping of ``*``, on ECP5 without DSP blocks.

Two signed 8x8 multipliers (``--width``), both with registered operands and a registered
product (2 cycles), synthesized with ``synth_ecp5 -nodsp`` and placed and routed out of
context on an LFE5U-85F once per seed (``hbfp.hw.openflow``):

- ``generic``: ``a * b`` (benchmarks/density.py's ``Mult18`` at this width), which Yosys maps
  to AND terms summed by carry-save full adders in LUTs and one carry chain;
- ``booth``: ``hbfp.hw.lut_mult.LutMultiplier``, radix-4 Booth partial products summed by a
  tree of carry chains.

A register stage in front of each (``PortRegisters``) makes every path timed, the negation
of ``a`` that ``LutMultiplier`` does before its operand registers included. ``--array R C``
adds an R x C ``MacArray`` (tk 24) both ways: every PE's multiplier in LUTs by the Booth
construction (``dsp_macs=0``) and Yosys' mapping of the DSP PEs under ``-nodsp`` (placed with
the first seed only).

    python benchmarks/lut_mult.py [--width 8] [--seeds 1 2 3] [--array 8 8] [--write]

``--write`` writes docs/reports/lut-mult.md. Needs the ``fpga`` extra.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from amaranth import Module, Signal
from amaranth.back import verilog
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out
from hbfp.hw.lut_mult import LutMultiplier
from hbfp.hw.mac_array import MacArray
from hbfp.hw.openflow import lut4_cells, pnr_ecp5, synth_ecp5

from density import Mult18  # benchmarks/density.py
from report import publish  # benchmarks/report.py

ROOT = Path(__file__).resolve().parents[1]


class PortRegisters(wiring.Component):
    """``inner`` (a multiplier with ports ``a``, ``b``, ``p``) behind one more register on its
    operands, so that whatever ``inner`` does before its own registers is timed too."""

    def __init__(self, inner):
        self.inner = inner
        super().__init__({"a": In(inner.a.shape()), "b": In(inner.b.shape()), "p": Out(inner.p.shape())})

    def elaborate(self, platform):
        m = Module()
        m.submodules.inner = inner = self.inner
        a0, b0 = Signal.like(self.a), Signal.like(self.b)
        m.d.sync += [a0.eq(self.a), b0.eq(self.b)]
        m.d.comb += [inner.a.eq(a0), inner.b.eq(b0), self.p.eq(inner.p)]
        return m


def run(name: str, factory, work: Path, seeds, args, log) -> dict:
    """Synthesize LUT-only, place and route once per seed; Yosys' and nextpnr's counts."""
    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "top.v").write_text(verilog.convert(factory(), name="top"))
    log(f"{name}: synth_ecp5 -nodsp")
    synth = synth_ecp5(d / "top.v", "top", d, nodsp=True)
    fmax = []
    for seed in seeds:
        pnr = pnr_ecp5(synth["json"], d / f"seed{seed}", args.device, args.package, args.freq, seed)
        fmax.append(pnr["fmax_min"])
        log(f"{name}: seed {seed}: {pnr['utilization']['TRELLIS_COMB'][0]} TRELLIS_COMB, {pnr['fmax_min']:.1f} MHz")
    c = synth["cells"]
    return {"lut4": c.get("LUT4", 0), "ccu2c": c.get("CCU2C", 0), "pfumx": c.get("PFUMX", 0),
            "l6mux": c.get("L6MUX21", 0), "ff": c.get("TRELLIS_FF", 0), "lut4_eq": lut4_cells(c),
            "comb": pnr["utilization"]["TRELLIS_COMB"][0], "fmax": fmax, "fmax_median": statistics.median(fmax)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=8, help="operand bits, sign included (default 8)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--array", type=int, nargs=2, metavar=("ROWS", "COLS"), help="also an R x C MacArray both ways")
    p.add_argument("--device", default="85k")
    p.add_argument("--package", default="CABGA381")
    p.add_argument("--freq", type=float, default=200.0, help="target clock in MHz (default 200)")
    p.add_argument("--out", default="build/lut_mult", help="work folder")
    p.add_argument("--write", action="store_true", help="write docs/reports/lut-mult.md")
    args = p.parse_args(argv)
    w = args.width
    work = ROOT / args.out

    def log(s):
        print(s, flush=True)

    designs = {
        f"generic{w}": (f"{w}x{w} `*`, Yosys' mapping", lambda: PortRegisters(Mult18(w, w))),
        f"booth{w}": (f"{w}x{w} `LutMultiplier` (Booth, carry chains)", lambda: PortRegisters(LutMultiplier(w, w))),
    }
    if args.array:
        R, C = args.array
        designs[f"array{R}x{C}-generic"] = (f"{R}x{C} `MacArray`, Yosys' mapping of `*` (-nodsp)",
                                            lambda: MacArray(R, C, 24, w, w))
        designs[f"array{R}x{C}-booth"] = (f"{R}x{C} `MacArray`, every PE a `BoothProduct` (dsp_macs=0)",
                                          lambda: MacArray(R, C, 24, w, w, dsp_macs=0))
    # The arrays take minutes per placement: the first seed only.
    res = {k: run(k, f, work, args.seeds if k.startswith(("generic", "booth")) else args.seeds[:1], args, log)
           for k, (_, f) in designs.items()}

    seeds = " ".join(map(str, args.seeds))
    lines = [
        f"# LUT multipliers on ECP5: Booth and carry chains against Yosys' mapping ({w}x{w} signed)",
        "",
        f"Command: `python benchmarks/lut_mult.py --width {w} --seeds {seeds}"
        + (f" --array {args.array[0]} {args.array[1]}" if args.array else "") + " --write`. "
        f"YoWASP Yosys `synth_ecp5 -nodsp`, nextpnr-ecp5 out of context on LFE5U-{args.device.upper()} "
        f"{args.package}, target {args.freq:g} MHz, seeds {seeds}; Fmax is their median. Both multipliers "
        "have registered operands and a registered product, behind one more operand register.",
        "",
        "| design | LUT4 | CCU2C | PFUMX | L6MUX21 | FF | LUT4 + 2 CCU2C | TRELLIS_COMB | Fmax (MHz) | per seed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for k, (desc, _) in designs.items():
        r = res[k]
        lines.append(f"| {desc} | {r['lut4']:,} | {r['ccu2c']:,} | {r['pfumx']:,} | {r['l6mux']:,} | {r['ff']:,} | "
                     f"{r['lut4_eq']:,} | {r['comb']:,} | {r['fmax_median']:.1f} | "
                     f"{', '.join(f'{f:.1f}' for f in r['fmax'])} |")
    g, b = res[f"generic{w}"], res[f"booth{w}"]
    lines += [
        "",
        f"The Booth multiplier takes {b['comb'] / g['comb']:.2f}x the logic cells of Yosys' mapping "
        f"({b['comb']} against {g['comb']}) at {b['fmax_median'] / g['fmax_median']:.2f}x its Fmax. Its sums are "
        "carry chains because each adder's result is a signal of its own (`keep`): left to itself, Yosys' "
        "`alumacc` merges a tree of additions into one multi-operand sum and maps it to full adders in LUTs.",
        "",
    ]
    publish("\n".join(lines), "lut-mult.md", args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
