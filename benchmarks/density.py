"""The density experiment: whole GEMM cores in three number formats through one ECP5 flow.

HBFP's hardware claim (Drumond et al., NeurIPS 2018) is that fixed-point MACs are far
denser than floating-point ones: the paper quotes an fp16 multiplier at 5.8x the area of an
8-bit one, and 8.5x the throughput for 8-bit BFP over fp16 on an FPGA. This script measures
whole cores of our own gateware, of one ``CoreConfig`` (array, buffers, tile, activation units):

- BFP8: ``hbfp.hw.gemm_core.GemmCore`` (int8 MAC array, exponent memories, normalizer and
  fp32 adder lanes per column, accumulator, epilogue);
- bf16 and fp16: ``hbfp.hw.float_core.FloatCore`` (the same buffers, 16 bits wide,
  accumulator, bias and epilogue around ``FloatMacArray``: 16-bit float products, an fp32
  sum in every processing element, fp32 adders into the accumulator).

Neither includes the link (packet engine, UART), which would be the same logic for all three.
Each core goes through the flow of benchmarks/ecp5_area.py twice: ``synth_ecp5`` with
MULT18X18D blocks, and LUT-only (``-nodsp``; the BFP8 core then also takes ``dsp_macs=0``,
so that every PE multiplies with the carry-chain Booth multiplier of ``hbfp.hw.lut_mult``,
the core's own answer to running out of DSP blocks); the MAC array and the lanes keep their
module boundaries (``keep_hierarchy``) so that Yosys' statistics give their share; then
nextpnr-ecp5 out of context on an LFE5U-85F, once per placement seed (Fmax: the median). A
lone registered 18x18 multiplier, synthesized LUT-only, sets the LUT4 equivalent of one
MULT18X18D. MACs per second: rows x cols PEs, one MAC each per cycle at full throughput,
times Fmax.

    python benchmarks/density.py [--rows 4 --cols 4 --size 96 --tile 24 24] [--jobs 2] [--write] [--json FILE]

``--write`` writes docs/reports/density.md; ``--json FILE`` the figures for a machine
(``SUMMARY``'s keys, which benchmarks/fpga_report.py copies into summary.json, and every
design's figures). ``--reuse`` keeps the results of designs whose Verilog and options did not
change. Needs the ``fpga`` extra. A design that does not fit the device is reported with
what it needs (and its ratios are null).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import replace
from pathlib import Path

from amaranth import Module, Signal, signed
from amaranth.back import verilog
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out
from hbfp.contract import ConfigError
from hbfp.hw.boards import _nextpnr_utilisation
from hbfp.hw.float_core import FloatCore
from hbfp.hw.gemm_core import GemmCore
from hbfp.hw.openflow import ECP5, lut4_cells, pnr_ecp5, synth_ecp5, verilog_modules
from hbfp.hw.params import CoreConfig

from ecp5_area import ARRAY_MODULE, LANE_MODULES, measured_modules  # benchmarks/ecp5_area.py
from report import publish, verilog_logic  # benchmarks/report.py

ROOT = Path(__file__).resolve().parents[1]
#: The paper's figures (Drumond et al., NeurIPS 2018, section 5).
PAPER_MULTIPLIER_AREA = 5.8  # fp16 multiplier / 8-bit fixed-point multiplier
PAPER_THROUGHPUT = 8.5  # 8-bit BFP over fp16, on an FPGA
#: The floor the whole-core comparison is held to: MAC/s per LUT4, LUT-only, BFP8 over fp16.
FLOOR_VS_FP16 = 5.0

#: The cores compared, in the report's order, and the flows: "dsp" (MULT18X18D blocks) and
#: "lut" (``-nodsp``; BFP8 with ``dsp_macs=0``).
FORMATS = ("bfp8", "bf16", "fp16")
MODES = ("dsp", "lut")
TITLES = {"bfp8": "BFP8 `GemmCore`", "bf16": "bf16 `FloatCore`", "fp16": "fp16 `FloatCore`"}
#: summary.json's density figures: key -> (quantity, float format, flow). Ratios of BFP8 over
#: the float core (MAC/s per LUT4: BFP8's over the format's; LUT4 per MAC: the format's over BFP8's).
SUMMARY = {
    "density_mac_s_per_lut4_vs_fp16_core": ("mac_s_per_lut4", "fp16", "lut"),
    "density_mac_s_per_lut4_vs_bf16_core": ("mac_s_per_lut4", "bf16", "lut"),
    "density_lut4_per_mac_vs_fp16_core": ("lut4_per_mac", "fp16", "lut"),
    "density_mac_s_per_lut4_vs_fp16_core_with_dsp": ("mac_s_per_lut4", "fp16", "dsp"),
}


class Mult18(wiring.Component):
    """One signed multiplier (18x18 unless told) with registered inputs and output: what a
    MULT18X18D holds. Synthesized LUT-only, it gives the LUT4 equivalent of one DSP block
    (and benchmarks/lut_mult.py's reference: Yosys' own mapping of ``*``)."""

    LATENCY = 2

    def __init__(self, width_a: int = 18, width_b: int = 18):
        self.width_a, self.width_b = width_a, width_b
        super().__init__({"a": In(signed(width_a)), "b": In(signed(width_b)), "p": Out(signed(width_a + width_b))})

    def elaborate(self, platform):
        m = Module()
        a, b = Signal.like(self.a), Signal.like(self.b)
        m.d.sync += [a.eq(self.a), b.eq(self.b), self.p.eq(a * b)]
        return m


def core(cfg: CoreConfig, fmt: str, mode: str) -> tuple[str, wiring.Component]:
    """The Verilog top name and the component of core ``fmt`` in flow ``mode``."""
    if fmt == "bfp8":
        # LUT-only, every PE multiplies in LUTs and carry chains (hw/lut_mult.py).
        return "gemm_core", GemmCore(replace(cfg, dsp_macs=0 if mode == "lut" else None))
    return "float_core", FloatCore(cfg, fmt)


def designs(cfg: CoreConfig) -> dict:
    """(name, mode) -> (top name, component factory, nodsp): the six cores and the DSP
    equivalent (a LUT-only 18x18 multiplier)."""
    out = {(fmt, mode): (lambda fmt=fmt, mode=mode: core(cfg, fmt, mode)) for fmt in FORMATS for mode in MODES}
    out[("mult18", "lut")] = lambda: ("top", Mult18())
    return out


def measure(name: str, mode: str, factory, work: Path, args, log) -> dict:
    """Synthesize one design in ``work/<name>-<mode>`` (the array and lanes kept as modules, as
    benchmarks/ecp5_area.py does), place and route it once per seed; with ``--reuse`` a saved
    result stands while the design's Verilog and the flow options are unchanged."""
    nodsp = mode == "lut"
    # No "+" or spaces in the folder: ABC's script parser would split the path.
    d = work / f"{name}-{mode}"
    d.mkdir(parents=True, exist_ok=True)
    top, component = factory()
    # Elaborated for the ECP5, as benchmarks/ecp5_area.py elaborates the core: block RAMs with
    # their output register, DSP blocks with their input and output registers.
    text = verilog.convert(component, name=top, platform=ECP5)
    tag = f"{name} ({'LUT-only' if nodsp else 'DSP'})"
    options = {"device": args.device, "package": args.package, "freq": args.freq, "seeds": list(args.seeds),
               "nodsp": nodsp, "verilog_sha256": hashlib.sha256(verilog_logic(text).encode()).hexdigest()}
    saved = d / "result.json"
    if args.reuse and saved.exists():
        row = json.loads(saved.read_text())
        if row.get("options") == options:
            log(f"{tag}: reused {saved}")
            return {**row, "reused": True}
    src = d / f"{top}.v"
    src.write_text(text)
    names = verilog_modules(src)
    array, lanes = measured_modules(names, ARRAY_MODULE), measured_modules(names, LANE_MODULES)
    try:
        synth = synth_ecp5(src, top, d, nodsp=nodsp, keep=array + lanes, log=lambda s: log(f"{tag}: {s}"))
        kept = True
    except subprocess.CalledProcessError:
        # YoWASP's ABC9 step sometimes dies, without a message, on a design with kept modules
        # (seen on the FloatCores); the flattened design goes through, without the breakdown.
        log(f"{tag}: synthesis with kept modules failed (see {d / 'synth.log'}); again flattened")
        synth = synth_ecp5(src, top, d, nodsp=nodsp, log=lambda s: log(f"{tag}: {s}"))
        kept = False
    row = {
        "name": name, "mode": mode, "top": top, "fits": True, "kept": kept,
        "yosys_lut4": lut4_cells(synth["cells"]),
        "array_lut4": sum(lut4_cells(synth["modules"][n]) for n in array) if kept else None,
        "lanes_lut4": sum(lut4_cells(synth["modules"][n]) for n in lanes) if kept else None,
        "array_modules": array, "lanes_modules": lanes,
        "synth_s": synth["seconds"], "pnr_s": [], "seeds": [], "options": options,
    }
    for seed in args.seeds:
        try:
            pnr = pnr_ecp5(synth["json"], d / f"seed{seed}", args.device, args.package, args.freq, seed,
                           log=lambda s: log(f"{tag}: {s} (seed {seed})"))
        except subprocess.CalledProcessError:
            util = _nextpnr_utilisation(d / f"seed{seed}" / "pnr.log")
            over = {k: v for k, v in util.items() if v["used"] > v["available"]}
            if not over:
                raise
            row.update(fits=False, needs=over)
            log(f"{tag}: does not fit: " + ", ".join(f"{k} {v['used']:,}/{v['available']:,}" for k, v in over.items()))
            break
        row["seeds"].append({"seed": seed, "fmax_mhz": pnr["fmax_min"]})
        row["pnr_s"].append(pnr["seconds"])
        util = pnr["utilization"]  # packing comes before placement: the same for every seed
        row.update(lut4=util["TRELLIS_COMB"][0], ff=util["TRELLIS_FF"][0], dsp=util["MULT18X18D"][0],
                   bram=util["DP16KD"][0], ramw=util.get("TRELLIS_RAMW", (0, 0))[0])
    if row["fits"]:
        row["fmax_mhz"] = statistics.median(s["fmax_mhz"] for s in row["seeds"])
        log(f"{tag}: {row['lut4']:,} LUT4, {row['ff']:,} FF, {row['dsp']} MULT18X18D, {row['bram']} DP16KD, "
            f"{row['fmax_mhz']:.1f} MHz (synthesis {row['synth_s']:.0f} s, place and route "
            f"{sum(row['pnr_s']):.0f} s)")
    saved.write_text(json.dumps(row, indent=1) + "\n")
    return row


# ---- figures: pure arithmetic on the measured rows -------------------------------------------

def per_design(row: dict, macs: int, dsp_eq: float) -> dict:
    """LUT4 and FF per MAC, MAC/s per LUT4 (and per LUT4 + DSP-equivalent) of one measured
    design; None where it did not fit."""
    if not row.get("fits", True):
        return {"lut4_per_mac": None, "ff_per_mac": None, "mac_s_per_lut4": None, "mac_s_per_lut4_eq": None}
    mac_s = macs * row["fmax_mhz"] * 1e6
    return {
        "lut4_per_mac": row["lut4"] / macs, "ff_per_mac": row["ff"] / macs,
        "mac_s_per_lut4": mac_s / row["lut4"],
        "mac_s_per_lut4_eq": mac_s / (row["lut4"] + dsp_eq * row["dsp"]),
    }


#: Quantities where less is better: their ratio is the format's over BFP8's (how many times
#: BFP8 is denser); for the others it is BFP8's over the format's.
SMALLER_IS_BETTER = {"lut4_per_mac", "ff_per_mac"}


def ratio(pm: dict, quantity: str, fmt: str, mode: str) -> float | None:
    """How many times BFP8's core beats ``fmt``'s in ``quantity`` and flow ``mode``."""
    b, f = pm[("bfp8", mode)][quantity], pm[(fmt, mode)][quantity]
    if b is None or f is None:
        return None
    return f / b if quantity in SMALLER_IS_BETTER else b / f


def figures(results: dict, cfg: CoreConfig) -> dict:
    """What ``--json`` writes: ``SUMMARY``'s keys, the per-design figures, the ratios."""
    macs = cfg.rows * cfg.cols
    dsp_eq = results[("mult18", "lut")]["lut4"]
    pm = {k: per_design(results[k], macs, dsp_eq) for k in ((f, m) for f in FORMATS for m in MODES)}
    ratios = {f"{q}_{fmt}_{mode}": ratio(pm, q, fmt, mode) for q in ("lut4_per_mac", "ff_per_mac", "mac_s_per_lut4",
                                                                       "mac_s_per_lut4_eq")
              for fmt in ("bf16", "fp16") for mode in MODES}
    return {
        **{key: ratio(pm, q, fmt, mode) for key, (q, fmt, mode) in SUMMARY.items()},
        "config": {"rows": cfg.rows, "cols": cfg.cols, "size": cfg.size, "tile": list(cfg.tile),
                   "functions": list(cfg.built_functions), "bfp_output": cfg.bfp_output,
                   "stochastic": cfg.stochastic, "acc_lanes": cfg.acc_lanes, "macs": macs},
        "dsp_equivalent_lut4": dsp_eq,
        "designs": {f"{f}-{m}": {**{k: v for k, v in results[(f, m)].items() if k != "options"}, **pm[(f, m)]}
                    for f, m in pm},
        "ratios": ratios,
        "paper_throughput": PAPER_THROUGHPUT, "paper_multiplier_area": PAPER_MULTIPLIER_AREA,
        "floor_vs_fp16": FLOOR_VS_FP16,
    }


# ---- the report ------------------------------------------------------------------------------

def _x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def _n(v: int | None) -> str:
    return "-" if v is None else f"{v:,}"


def _device_name(device: str) -> str:
    """nextpnr's device option as Lattice names the part ("85k" -> "LFE5U-85F")."""
    family, _, size = device.rpartition("-")
    prefix = {"": "LFE5U", "um": "LFE5UM", "um5g": "LFE5UM5G"}.get(family, f"LFE5{family.upper()}")
    return f"{prefix}-{size.upper().replace('K', 'F')}"


def command(args) -> str:
    functions = "".join(f" {f}" for f in args.functions)  # no names: no activation units
    return (f"python benchmarks/density.py --rows {args.rows} --cols {args.cols} --size {args.size} "
            f"--tile {args.tile[0]} {args.tile[1]} --functions{functions}{' --reduced' if args.reduced else ''} "
            f"--device {args.device} --package {args.package} --freq {args.freq:g} "
            f"--seeds {' '.join(map(str, args.seeds))} --write")


def report(fig: dict, args, seconds: float) -> str:
    c, d, r = fig["config"], fig["designs"], fig["ratios"]
    n = c["macs"]
    tool = sum(x["synth_s"] + sum(x["pnr_s"]) for x in d.values()) + fig.get("mult18_s", 0)
    reused = sum(1 for x in d.values() if x.get("reused")) + fig.get("mult18_reused", 0)
    functions = ", ".join(c["functions"]) or "none"
    units = "BFP output with stochastic rounding" if c["bfp_output"] and c["stochastic"] else (
        "BFP output" if c["bfp_output"] else "fp32/bf16 output only")
    lines = [
        f"# Density: whole GEMM cores on ECP5, BFP8 against bf16 and fp16 ({c['rows']}x{c['cols']} arrays)",
        "",
        f"Command: `{command(args)}`. Core configuration: {c['rows']}x{c['cols']} MAC array, "
        f"{c['size']}x{c['size']} buffers, tile {c['tile'][0]}x{c['tile'][1]}, activation units {functions}, {units}. "
        f"Tool time {tool / 60:.0f} min (synthesis plus place and route, summed); {args.jobs} at a time, "
        + (f"the run took {seconds / 60:.0f} min." if not reused else
           f"this run reused the saved results of {reused} of the {len(d) + 1} designs (`--reuse`: their Verilog "
           "and flow options unchanged), which were measured as the table says."),
        "",
        "Every core went through the same flow (`hbfp.hw.openflow`, as benchmarks/ecp5_area.py drives it): "
        "elaborated for the ECP5 (block RAMs as DP16KDs with their output register, `hw/block_ram.py`), "
        "YoWASP Yosys `synth_ecp5`, once with MULT18X18D blocks and once LUT-only (`-nodsp`), the MAC array "
        "and the lanes kept as modules (`keep_hierarchy`, the rest flattened), then nextpnr-ecp5 out of context "
        f"on {_device_name(args.device)} {args.package}, target {args.freq:g} MHz, placement seed(s) "
        f"{', '.join(map(str, args.seeds))} (Fmax: the median). **LUT-only, the BFP8 core is built with "
        "`dsp_macs=0`**: every PE multiplies with the carry-chain Booth multiplier of `hw/lut_mult.py` "
        "(`BoothProduct`), which the core uses where DSP blocks run out; the float cores' mantissa products "
        "are Yosys' mapping of `*` (they have no LUT multiplier of their own). All cores have "
        f"{n} processing elements, each one MAC per cycle at full throughput: MAC/s = {n} x Fmax. "
        "Neither the BFP8 nor the float cores include the link (packet engine, UART): it would be the same "
        "logic in all three.",
        "",
        "| core | flow | LUT4 | FF | MULT18X18D | DP16KD | Fmax | LUT4/MAC | MAC/s per LUT4 "
        "| MAC/s per (LUT4 + DSP-eq.) | MAC array LUT4 (Yosys) | lanes LUT4 (Yosys) | whole (Yosys) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for fmt in FORMATS:
        for mode in MODES:
            x = d[f"{fmt}-{mode}"]
            flow = "DSP" if mode == "dsp" else ("LUT-only, Booth LUT multipliers" if fmt == "bfp8" else "LUT-only")
            if not x["fits"]:
                needs = ", ".join(f"{k} {v['used']:,}/{v['available']:,}" for k, v in x["needs"].items())
                lines.append(f"| {TITLES[fmt]} | {flow} | **does not fit**: {needs} | | | | | | | | "
                             f"{_n(x['array_lut4'])} | {_n(x['lanes_lut4'])} | {x['yosys_lut4']:,} |")
                continue
            lines.append(
                f"| {TITLES[fmt]} | {flow} | {x['lut4']:,} | {x['ff']:,} | {x['dsp']} | {x['bram']} | "
                f"{x['fmax_mhz']:.1f} MHz | {x['lut4_per_mac']:,.1f} | {x['mac_s_per_lut4'] / 1e3:,.1f} k | "
                + (f"{x['mac_s_per_lut4_eq'] / 1e3:,.1f} k" if mode == "dsp" else "") + " | "
                f"{_n(x['array_lut4'])} | {_n(x['lanes_lut4'])} | {x['yosys_lut4']:,} |")
    flat = [f"{TITLES[name.split('-')[0]]} ({'LUT-only' if name.endswith('lut') else 'DSP'})"
            for name, x in d.items() if not x.get("kept", True)]
    lines += [
        "",
        "LUT4: nextpnr's TRELLIS_COMB cells (a LUT4 each, two per CCU2C carry cell, distributed RAM's LUTs "
        "included). The last three columns are Yosys' counts of the same synthesis (LUT4 + 2 x CCU2C): the MAC "
        "array (`mac`), the lanes (BFP8: a normalizer and an fp32 adder per accumulate lane, "
        f"`acc_lanes` = {fig['config']['acc_lanes']} of them for {fig['config']['cols']} columns; float: an fp32 "
        "adder per column into the accumulator) and the whole core. **DSP-equivalent**: one MULT18X18D counted as the "
        f"{fig['dsp_equivalent_lut4']:,} LUT4s that the same flow needs for a registered 18x18 signed "
        "multiplier without DSPs (its replacement cost in logic, not its silicon area)."
        + (" Synthesized flattened (no breakdown), because Yosys' ABC9 step failed on the kept modules: "
           f"{', '.join(flat)}." if flat else ""),
        "",
        "## Ratios: BFP8 core against the float cores",
        "",
        "How many times the BFP8 core is denser (LUT4 per MAC of the float core over the BFP8 core's) and how "
        "many times its MAC/s per LUT4 are higher:",
        "",
        "| | bf16 / BFP8 | fp16 / BFP8 | paper (fp16 / 8-bit) |",
        "|---|---:|---:|---:|",
    ]
    rows = [
        ("LUT4 per MAC, LUT-only", "lut4_per_mac", "lut", f"{PAPER_MULTIPLIER_AREA}x (multiplier area)"),
        ("LUT4 per MAC, with DSPs", "lut4_per_mac", "dsp", ""),
        ("FF per MAC, LUT-only", "ff_per_mac", "lut", ""),
        ("**MAC/s per LUT4, LUT-only** (summary.json)", "mac_s_per_lut4", "lut", f"{PAPER_THROUGHPUT}x (throughput)"),
        ("MAC/s per LUT4, with DSPs", "mac_s_per_lut4", "dsp", ""),
        ("MAC/s per (LUT4 + DSP-eq.), with DSPs", "mac_s_per_lut4_eq", "dsp", ""),
    ]
    for label, q, mode, paper in rows:
        lines.append(f"| {label} | {_x(r[f'{q}_bf16_{mode}'])} | {_x(r[f'{q}_fp16_{mode}'])} | {paper} |")
    lines += ["", *reading(fig, args), *raw(fig)]
    return "\n".join(lines)


def reading(fig: dict, args) -> list[str]:
    """What the figures say, phrased from the figures themselves."""
    c, d, r = fig["config"], fig["designs"], fig["ratios"]
    key = fig["density_mac_s_per_lut4_vs_fp16_core"]
    b, f16, b16 = d["bfp8-lut"], d["fp16-lut"], d["bf16-lut"]
    out = ["## Reading", ""]
    if key is None:
        missing = [TITLES[f] for f in FORMATS if not d[f"{f}-lut"]["fits"]]
        out.append(f"- **LUT-only** the comparison is incomplete: {', '.join(missing)} does not fit "
                   f"{_device_name(args.device)}, so summary.json's `density_mac_s_per_lut4_vs_fp16_core` is null. "
                   "A smaller array (or a larger part) is needed for the whole-core ratio.")
    else:
        floor = "meets" if key >= FLOOR_VS_FP16 else "**misses**"
        paper = "above" if key > PAPER_THROUGHPUT else "below"
        out.append(
            f"- **LUT-only** (summary.json's `density_mac_s_per_lut4_vs_fp16_core`): the BFP8 core takes "
            f"{b['lut4_per_mac']:,.0f} LUT4s per MAC against {f16['lut4_per_mac']:,.0f} (fp16) and "
            f"{b16['lut4_per_mac']:,.0f} (bf16), {_x(r['lut4_per_mac_fp16_lut'])} and "
            f"{_x(r['lut4_per_mac_bf16_lut'])}; "
            f"it closes at {b['fmax_mhz']:.0f} MHz against {f16['fmax_mhz']:.0f} and {b16['fmax_mhz']:.0f} MHz. "
            f"Its MAC/s per LUT4 are {key:.2f}x the fp16 core's ({_x(r['mac_s_per_lut4_bf16_lut'])} the bf16 "
            f"core's), {paper} the paper's {PAPER_THROUGHPUT}x; this {floor} the floor of {FLOOR_VS_FP16:g}x.")

    def where(x):
        if x["array_lut4"] is None:
            return "not broken down (synthesized flattened)"
        rest = x["yosys_lut4"] - x["array_lut4"] - x["lanes_lut4"]
        return (f"array {100 * x['array_lut4'] / x['yosys_lut4']:.0f}%, lanes "
                f"{100 * x['lanes_lut4'] / x['yosys_lut4']:.0f}%, the rest (buffers, control, epilogue) "
                f"{rest:,} LUT4s")

    out.append(
        f"- Where the LUT-only logic is (Yosys): BFP8 {where(b)}; fp16 {where(f16)}; bf16 {where(b16)}. The rest "
        "is logic the three cores share in kind, and it grows with the array's sides (buffer banks, output "
        f"lanes), not with its {c['rows']} x {c['cols']} MACs: the smaller the array, the more it weighs on every "
        "MAC and the closer the ratios come to 1 (a float PE's own cost is its multiplier and fp32 adder, a "
        "BFP8 PE's an 8x8 product and an integer sum).")
    bd, fd = d["bfp8-dsp"], d["fp16-dsp"]
    if bd["fits"] and fd["fits"]:
        out.append(
            f"- **With DSP blocks** both cores use about one MULT18X18D per MAC ({bd['dsp']} and {fd['dsp']}), so "
            f"the LUT4s are the logic around the multipliers: {bd['lut4_per_mac']:,.0f} per MAC (BFP8) against "
            f"{fd['lut4_per_mac']:,.0f} (fp16), {_x(r['lut4_per_mac_fp16_dsp'])}; MAC/s per LUT4 "
            f"{_x(r['mac_s_per_lut4_fp16_dsp'])}, counting each DSP block as {fig['dsp_equivalent_lut4']:,} LUT4s "
            f"{_x(r['mac_s_per_lut4_eq_fp16_dsp'])}.")
    out += [
        "",
        "What differs from the paper's comparison:",
        "",
        f"- The paper's {PAPER_MULTIPLIER_AREA}x compares multipliers alone and its {PAPER_THROUGHPUT}x whole "
        "designs of its own; here a MAC is multiplier, accumulator and pipeline inside a whole core, placed and "
        "routed, with the buffers, control and epilogue counted in.",
        "- LUT-only, the BFP8 core's multipliers are Booth carry-chain multipliers (docs/reports/lut-mult.md: "
        "0.44x the logic cells of Yosys' 8x8 mapping) while the float cores' 11x11 (fp16) and 8x8 (bf16) "
        "mantissa products are Yosys' mapping: a LUT multiplier of the same kind in the float cores would "
        "narrow the LUT-only ratios by part of their multiplier's share.",
        "- The float cores accumulate every product in fp32 in its PE (RNE, FTZ, as `hbfp.golden.float_mac`); "
        f"BFP8 sums a K-tile of {c['tile'][1]} products exactly in integers and converts once per K-tile per "
        "column. The float cores' operand buffers hold 16-bit patterns, the BFP8 core's 8-bit codes plus "
        "shared exponents. The float core stalls while a group of sums drains and takes no transposes "
        "(`FloatCore`): its full-throughput MAC/s is an upper bound.",
        f"- {len(args.seeds)} placement seed(s), out of context at a {args.freq:g} MHz target: Fmax carries "
        "placement noise.",
        "",
    ]
    return out


def raw(fig: dict) -> list[str]:
    lines = ["## Raw figures", "", "| core | flow | Fmax per seed | synthesis | place and route |",
             "|---|---|---|---:|---:|"]
    for name, x in fig["designs"].items():
        fmt, mode = name.split("-")
        seeds = ", ".join(f"{s['fmax_mhz']:.1f} MHz (seed {s['seed']})" for s in x["seeds"]) or "-"
        lines.append(f"| {TITLES[fmt]} | {'DSP' if mode == 'dsp' else 'LUT-only'} | {seeds} | {x['synth_s']:.0f} s | "
                     f"{' + '.join(f'{s:.0f}' for s in x['pnr_s']) or '-'} s |")
    lines.append("")
    return lines


# ---- command line ----------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--cols", type=int, default=4)
    p.add_argument("--size", type=int, default=96, help="buffer side (default 96)")
    p.add_argument("--tile", type=int, nargs=2, default=[24, 24], metavar=("ROWS", "COLS"),
                   help="BFP tile; its column side is the K-tile (default 24 24)")
    p.add_argument("--functions", nargs="*", default=["relu", "gelu"],
                   help="activation units built (default relu gelu; none: give the option no names)")
    p.add_argument("--reduced", action="store_true", help="cores without BFP output and stochastic rounding")
    p.add_argument("--acc-lanes", type=int, default=None,
                   help="the BFP8 core's normalizer/adder lanes (default: the fewest that keep up, "
                        "hbfp.contract.fewest_acc_lanes)")
    p.add_argument("--device", default="85k", help="nextpnr-ecp5 device option (default 85k)")
    p.add_argument("--package", default="CABGA381")
    p.add_argument("--freq", type=float, default=100.0, help="target clock in MHz")
    p.add_argument("--seeds", type=int, nargs="+", default=[1], help="placement seeds (default 1); Fmax: the median")
    p.add_argument("--jobs", type=int, default=2, help="flows run at a time (default 2)")
    p.add_argument("--out", default="build/density", help="work folder")
    p.add_argument("--write", action="store_true", help="write docs/reports/density.md")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE")
    p.add_argument("--reuse", action="store_true",
                   help="keep the saved result of every design whose Verilog and options are unchanged")
    return p


def config(args) -> CoreConfig:
    units = dict(bfp_output=False, stochastic=False) if args.reduced else {}
    return CoreConfig(rows=args.rows, cols=args.cols, size=args.size, tile=tuple(args.tile),
                      functions=tuple(args.functions), acc_lanes=args.acc_lanes, **units)


def run(args) -> dict:
    """Measure every design (``args`` as ``parser`` makes them), print the report (with
    ``args.write`` save it) and return the figures."""
    cfg = config(args)
    t0 = time.perf_counter()
    functions = "-".join(cfg.built_functions) or "none"
    work = ROOT / args.out / (f"core-{cfg.rows}x{cfg.cols}-s{cfg.size}-t{cfg.tile[0]}x{cfg.tile[1]}-{functions}-l{cfg.acc_lanes}"
                              + ("-reduced" if args.reduced else ""))

    def log(s: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f} s] {s}", flush=True)

    jobs = designs(cfg)
    # The float cores LUT-only first (the longest flows), so that the workers finish together.
    order = sorted(jobs, key=lambda k: (k[0] == "mult18", k[0] == "bfp8", k[1] == "dsp"))
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(measure, k[0], k[1], jobs[k], work, args, log): k for k in order}
        results = {}
        for f in as_completed(futures):
            if f.exception() is not None:  # a failed flow stops the run: the others wait no longer
                for other in futures:
                    other.cancel()
                raise f.exception()
            results[futures[f]] = f.result()
    seconds = time.perf_counter() - t0
    fig = figures(results, cfg)
    m18 = results[("mult18", "lut")]
    fig["mult18_s"] = m18["synth_s"] + sum(m18["pnr_s"])
    fig["mult18_reused"] = int(bool(m18.get("reused")))
    (work / "figures.json").write_text(json.dumps(fig, indent=1) + "\n")
    publish(report(fig, args, seconds), "density.md", args.write)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(fig, indent=1) + "\n")
        print(f"written {args.json}")
    return fig


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if min(args.rows, args.cols, args.size, *args.tile, args.jobs) < 1:
        p.error("--rows, --cols, --size, --tile and --jobs must be positive")
    try:
        config(args)
    except ConfigError as e:
        p.error(str(e))
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
