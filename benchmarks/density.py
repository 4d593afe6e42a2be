"""The density experiment: whole GEMM cores in three number formats through one ECP5 flow.

HBFP's hardware claim (Drumond et al., NeurIPS 2018) is that fixed-point MACs are far
denser than floating-point ones: the paper quotes an fp16 multiplier at 5.8x the area of an
8-bit one, and 8.5x the throughput for 8-bit BFP over fp16 on an FPGA. This script measures
whole cores of our own gateware, of one ``CoreConfig`` (buffers, tile, activation units) at
two or more array sizes:

- BFP8: ``hbfp.hw.gemm_core.GemmCore`` (int8 MAC array, exponent memories, normalizer and
  fp32 adder lanes, accumulator, epilogue);
- bf16 and fp16: ``hbfp.hw.float_core.FloatCore`` (the same buffers, 16 bits wide,
  accumulator, bias and epilogue around ``FloatMacArray``: 16-bit float products, an fp32
  sum in every processing element, fp32 adders into the accumulator).

Like for like: every core goes through the same flow (``synth_ecp5``, the MAC array and the
lanes kept as modules, the rest flattened; ABC9 through the older XAIGER writer where the
default one fails on the kept modules), twice:
with MULT18X18D blocks (every core's PEs multiply in DSP blocks with their input and output
registers, ``hw/mac_array.py``'s ``ecp5_multiplier``) and LUT-only (``-nodsp``, every core
built with ``dsp_macs=0``: all PEs multiply with the carry-chain Booth multiplier of
``hbfp.hw.lut_mult``, the BFP8 core's 9x9 and the float cores' significand products alike);
then nextpnr-ecp5 out of context on an LFE5U-85F, once per placement seed (Fmax: the median).
A lone registered 18x18 multiplier, synthesized LUT-only, sets the LUT4 equivalent of one
MULT18X18D. MACs per second: rows x cols PEs, one MAC each per cycle at full throughput,
times Fmax. The cost of a core is fitted as fixed + per PE x PEs over the array sizes
(nextpnr's packed LUT4 count, which a design that does not fit also has).

    python benchmarks/density.py [--arrays 4x4 8x8:static] [--size 96 --tile 24 24] [--seeds 1 2 3] [--jobs 2] [--write] [--json FILE]

``--write`` writes docs/reports/density.md and the density figures of summary.json; ``--json FILE`` the figures for a machine
(``SUMMARY``'s keys, which benchmarks/fpga_report.py copies into summary.json, and every
design's figures). ``--reuse`` keeps each synthesis and each seed's place and route whose
design (Verilog) and options did not change, so a run that stops goes on where it stopped.
``--formats`` and ``--modes`` measure a part (the figures that need the rest are null).
Needs the ``fpga`` extra. A design that does not fit the device is reported with what it
needs (its packed count still enters the fit).
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
from hbfp.hw.add_f32 import AddF32Datapath
from hbfp.hw.float_core import FloatCore
from hbfp.hw.gemm_core import GemmCore
from hbfp.hw.openflow import ECP5, lut4_cells, pnr_ecp5, synth_ecp5, verilog_modules
from hbfp.hw.params import CoreConfig

from ecp5_area import ARRAY_MODULE, LANE_MODULES, measured_modules  # benchmarks/ecp5_area.py
from report import REPORTS, publish, verilog_logic  # benchmarks/report.py

ROOT = Path(__file__).resolve().parents[1]
#: The paper's figures (Drumond et al., NeurIPS 2018, section 5).
PAPER_MULTIPLIER_AREA = 5.8  # fp16 multiplier / 8-bit fixed-point multiplier
PAPER_THROUGHPUT = 8.5  # 8-bit BFP over fp16, on an FPGA
#: The floor the comparisons are held to (issue 34): whole-core MAC/s per LUT4 and LUT4 per
#: PE, BFP8 over fp16.
FLOOR_VS_FP16 = 6.0

#: The cores compared, in the report's order, and the flows: "dsp" (MULT18X18D blocks) and
#: "lut" (``-nodsp``; every core with ``dsp_macs=0``).
FORMATS = ("bfp8", "bf16", "fp16")
MODES = ("dsp", "lut")
FLOWS = {"dsp": "with DSP blocks", "lut": "LUT-only"}
TITLES = {"bfp8": "BFP8 `GemmCore`", "bf16": "bf16 `FloatCore`", "fp16": "fp16 `FloatCore`"}
#: summary.json's density figures. The whole-core ones are the largest array's, in the flow
#: ``density_flow`` names (LUT-only where both cores fit the device, else with DSP blocks);
#: the per-PE ones come from the fit over the arrays in that flow too (with DSP blocks: one
#: MULT18X18D a PE in every core), and ``density_per_pe_lut4_vs_fp16_lut`` from the LUT-only
#: fit (every multiplier in LUTs; a core that does not fit enters it with its packed count).
SUMMARY = (
    "density_mac_s_per_lut4_vs_fp16_core", "density_mac_s_per_lut4_vs_bf16_core",
    "density_lut4_per_mac_vs_fp16_core", "density_mac_s_per_lut4_vs_fp16_core_with_dsp", "density_flow",
    "density_bfp8_core_lut4", "density_bfp8_core_fmax_mhz", "density_fp16_core_lut4", "density_fp16_core_fmax_mhz",
    "density_per_pe_lut4_vs_fp16", "density_per_pe_lut4_vs_bf16", "density_per_pe_lut4_bfp8",
    "density_per_pe_lut4_fp16", "density_per_pe_lut4_bf16", "density_fixed_lut4_bfp8", "density_fixed_lut4_fp16",
    "density_per_pe_lut4_vs_fp16_lut",
)
#: What summary.json takes from the experiment: ``SUMMARY`` and the array it compares at.
SUMMARY_FIGURES = (*SUMMARY, "density_rows", "density_cols")


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


Array = tuple[int, int]


def core(cfg: CoreConfig, fmt: str, mode: str) -> tuple[str, wiring.Component]:
    """The Verilog top name and the component of core ``fmt`` in flow ``mode``: LUT-only,
    every PE multiplies in LUTs and carry chains (``dsp_macs=0``, hw/lut_mult.py)."""
    cfg = replace(cfg, dsp_macs=0 if mode == "lut" else None)
    if fmt == "bfp8":
        return "gemm_core", GemmCore(cfg)
    return "float_core", FloatCore(cfg, fmt)


def designs(cfgs: dict[Array, CoreConfig], formats=FORMATS, modes=MODES) -> dict:
    """(format, mode, array) -> a factory of (top name, component): every core of ``formats``
    in every flow of ``modes`` at every array, and the DSP equivalent ("mult18", "lut",
    None: a LUT-only 18x18 multiplier)."""
    out = {(fmt, mode, a): (lambda fmt=fmt, mode=mode, cfg=cfg: core(cfg, fmt, mode))
           for a, cfg in cfgs.items() for fmt in formats for mode in modes}
    out[("mult18", "lut", None)] = lambda: ("top", Mult18())
    return out


def _folder(key) -> str:
    fmt, mode, a = key
    # No "+" or spaces in the folder: ABC's script parser would split the path.
    return f"{fmt}-{mode}" + (f"-{a[0]}x{a[1]}" if a else "")


def _saved(path: Path, options: dict):
    """The saved result at ``path`` if it was measured with ``options``, else None."""
    if path.exists():
        res = json.loads(path.read_text())
        if res.get("options") == options:
            return res
    return None


def measure(key, factory, work: Path, args, log) -> dict:
    """Synthesize design ``key`` in ``work/<format>-<mode>-<array>`` (the array and lanes kept as
    modules, as benchmarks/ecp5_area.py keeps them), then place and route it once per seed. With ``--reuse`` a saved synthesis or seed stands while the
    design's Verilog and its options are unchanged (each is saved as soon as it is done)."""
    fmt, mode, a = key
    placer = placers(args).get(a, "heap")
    nodsp = mode == "lut"
    d = work / _folder(key)
    d.mkdir(parents=True, exist_ok=True)
    top, component = factory()
    # Elaborated for the ECP5, as benchmarks/ecp5_area.py elaborates the core: block RAMs with
    # their output register, DSP blocks with their input and output registers.
    text = verilog.convert(component, name=top, platform=ECP5)
    tag = f"{_folder(key)} ({FLOWS[mode]})"
    options = {"nodsp": nodsp, "kept": True, "verilog_sha256": hashlib.sha256(verilog_logic(text).encode()).hexdigest()}
    synth = _saved(d / "synth.json", options) if args.reuse or args.saved else None
    if args.saved and synth is None:
        log(f"{tag}: not measured yet")
        return None
    if synth is not None and Path(synth["json"]).exists():
        log(f"{tag}: synthesis reused")
        synth["reused"] = True
    else:
        src = d / f"{top}.v"
        src.write_text(text)
        names = verilog_modules(src)
        array, lanes = measured_modules(names, ARRAY_MODULE), measured_modules(names, LANE_MODULES)
        keep = array + lanes
        try:
            out, writer = synth_ecp5(src, top, d, nodsp=nodsp, keep=keep, log=lambda s: log(f"{tag}: {s}")), "xaiger2"
        except subprocess.CalledProcessError:
            # YoWASP Yosys 0.70's ABC9 step stops on an assertion with kept modules on some
            # designs (the BFP8 cores with the default writer, the float cores with the older
            # one): the same mapping through the other exchange format goes through.
            log(f"{tag}: ABC9 failed with kept modules (see {d / 'synth.log'}); again through the older XAIGER writer")
            out, writer = synth_ecp5(src, top, d, nodsp=nodsp, keep=keep, xaiger1=True,
                                     log=lambda s: log(f"{tag}: {s}")), "xaiger"
        synth = {"options": options, "json": str(out["json"]), "abc9_writer": writer,
                 "yosys_lut4": lut4_cells(out["cells"]),
                 "array_lut4": sum(lut4_cells(out["modules"][n]) for n in array),
                 "lanes_lut4": sum(lut4_cells(out["modules"][n]) for n in lanes),
                 "array_modules": array, "lanes_modules": lanes, "synth_s": out["seconds"]}
        (d / "synth.json").write_text(json.dumps(synth, indent=1) + "\n")
    row = {"name": fmt, "mode": mode, "top": top, "fits": True, "seeds": [], "pnr_s": [],
           **{k: synth[k] for k in ("yosys_lut4", "array_lut4", "lanes_lut4", "synth_s", "abc9_writer")},
           "reused": bool(synth.get("reused"))}
    # Packing first (seconds): the counts, which placement does not change; a design whose
    # packed cells exceed the device is not placed.
    pack_options = {**options, "device": args.device, "package": args.package}
    pack = _saved(d / "pack" / "result.json", pack_options) if args.reuse or args.saved else None
    if args.saved and pack is None:
        log(f"{tag}: not packed yet")
        return None
    if pack is None:
        out = pnr_ecp5(synth["json"], d / "pack", args.device, args.package, args.freq, pack_only=True,
                       log=lambda s: log(f"{tag}: {s}"))
        pack = {"options": pack_options,
                "utilization": {k: {"used": u, "available": a} for k, (u, a) in out["utilization"].items()}}
        (d / "pack").mkdir(exist_ok=True)
        (d / "pack" / "result.json").write_text(json.dumps(pack, indent=1) + "\n")
    util = pack["utilization"]
    row.update(lut4=util["TRELLIS_COMB"]["used"], ff=util.get("TRELLIS_FF", {}).get("used", 0),
               dsp=util.get("MULT18X18D", {}).get("used", 0), bram=util.get("DP16KD", {}).get("used", 0))
    over = {k: v for k, v in util.items() if v["used"] > v["available"]}
    if over:
        row.update(fits=False, needs=over)
        log(f"{tag}: {row['lut4']:,} LUT4: does not fit: "
            + ", ".join(f"{k} {v['used']:,}/{v['available']:,}" for k, v in over.items()))
        return row
    for seed in ([] if args.pack_only else args.seeds):
        sd = d / f"seed{seed}"
        seed_options = {**options, "device": args.device, "package": args.package, "freq": args.freq, "seed": seed,
                        **({"placer": placer} if placer != "heap" else {})}
        res = _saved(sd / "result.json", seed_options) if args.reuse or args.saved else None
        if res is None and args.saved:
            row.setdefault("seeds_not_run", []).append(seed)
            continue
        if res is None:
            sd.mkdir(parents=True, exist_ok=True)
            try:
                pnr = pnr_ecp5(synth["json"], sd, args.device, args.package, args.freq, seed,
                               placer=None if placer == "heap" else placer,
                               log=lambda s: log(f"{tag}: {s} (seed {seed})"))
                util = {k: {"used": u, "available": a} for k, (u, a) in pnr["utilization"].items()}
                res = {"fits": True, "fmax_mhz": pnr["fmax_min"], "seconds": pnr["seconds"], "utilization": util}
            except subprocess.CalledProcessError:
                util = _nextpnr_utilisation(sd / "pnr.log")
                over = {k: v for k, v in util.items() if v["used"] > v["available"]}
                if not over:
                    raise
                res = {"fits": False, "needs": over, "utilization": util}
            res["options"] = seed_options
            (sd / "result.json").write_text(json.dumps(res, indent=1) + "\n")
        if not res["fits"]:
            row.update(fits=False, needs=res["needs"])
            log(f"{tag}: does not fit: " + ", ".join(f"{k} {v['used']:,}/{v['available']:,}" for k, v in res["needs"].items()))
            break  # packing is the same for every seed: none of them fits
        row["seeds"].append({"seed": seed, "fmax_mhz": res["fmax_mhz"]})
        row["pnr_s"].append(res["seconds"])
    if row["fits"] and row["seeds"]:
        row["fmax_mhz"] = statistics.median(s["fmax_mhz"] for s in row["seeds"])
        log(f"{tag}: {row['lut4']:,} LUT4, {row['ff']:,} FF, {row['dsp']} MULT18X18D, {row['bram']} DP16KD, "
            f"{row['fmax_mhz']:.1f} MHz (seeds {', '.join(format(s['fmax_mhz'], '.1f') for s in row['seeds'])})")
    return row


# ---- figures: pure arithmetic on the measured rows -------------------------------------------

def per_design(row: dict | None, macs: int, dsp_eq: float | None) -> dict:
    """LUT4 and FF per MAC, MAC/s per LUT4 (and per LUT4 + DSP-equivalent) of one measured
    design; None where it was not measured, or (MAC/s) not placed: it did not fit, or only its
    packing ran (``--pack-only``)."""
    none = {"lut4_per_mac": None, "ff_per_mac": None, "mac_s_per_lut4": None, "mac_s_per_lut4_eq": None}
    if row is None or not row.get("fits", True):
        return none
    out = {**none, "lut4_per_mac": row["lut4"] / macs, "ff_per_mac": row["ff"] / macs}
    if row.get("fmax_mhz") is None:
        return out
    mac_s = macs * row["fmax_mhz"] * 1e6
    return {**out, "mac_s_per_lut4": mac_s / row["lut4"],
            "mac_s_per_lut4_eq": None if dsp_eq is None else mac_s / (row["lut4"] + dsp_eq * row["dsp"])}


#: Quantities where less is better: their ratio is the format's over BFP8's (how many times
#: BFP8 is denser); for the others it is BFP8's over the format's.
SMALLER_IS_BETTER = {"lut4_per_mac", "ff_per_mac", "per_pe_lut4", "fixed_lut4"}


def ratio(pm: dict, quantity: str, fmt: str, mode: str, a=None) -> float | None:
    """How many times BFP8's core beats ``fmt``'s in ``quantity``, flow ``mode`` (and array ``a``)."""
    b, f = pm.get(("bfp8", mode, a), {}).get(quantity), pm.get((fmt, mode, a), {}).get(quantity)
    if b is None or f is None or b == 0 or f == 0:
        return None
    return f / b if quantity in SMALLER_IS_BETTER else b / f


def fit(points: list[tuple[int, int]]) -> dict | None:
    """LUT4 = fixed + per_pe x PEs, least squares over (PEs, LUT4) points of two or more sizes."""
    if len({n for n, _ in points}) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    per_pe = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return {"per_pe_lut4": per_pe, "fixed_lut4": my - per_pe * mx, "points": points}


def figures(results: dict, cfgs: dict[Array, CoreConfig], placer_of: dict[Array, str] | None = None) -> dict:
    """What ``--json`` writes: ``SUMMARY``'s keys, the per-design figures, the fits, the ratios
    (``placer_of``: each array's placer, for the record)."""
    placer_of = placer_of or {}
    arrays = sorted(cfgs, key=lambda a: a[0] * a[1])
    m18 = results.get(("mult18", "lut", None))
    dsp_eq = m18["lut4"] if m18 else None
    pm = {(f, m, a): per_design(results.get((f, m, a)), a[0] * a[1], dsp_eq)
          for a in arrays for f in FORMATS for m in MODES}
    fits = {}
    for f in FORMATS:
        for m in MODES:
            pts = [(a[0] * a[1], results[(f, m, a)]["lut4"]) for a in arrays if (f, m, a) in results]
            fits[(f, m, None)] = fit(pts) or {}
            # The MAC array module alone (Yosys' count of the kept module): its PEs, and the
            # edge logic of its sides, without the lanes, buffers and epilogue.
            pts = [(a[0] * a[1], results[(f, m, a)]["array_lut4"]) for a in arrays
                   if results.get((f, m, a), {}).get("array_lut4") is not None]
            fits[(f, m, "array")] = fit(pts) or {}
    top = arrays[-1]
    both = lambda m: all(results.get((f, m, top), {}).get("fmax_mhz") for f in ("bfp8", "fp16"))  # noqa: E731
    flow = "lut" if both("lut") else ("dsp" if both("dsp") else None)
    quantities = ("lut4_per_mac", "ff_per_mac", "mac_s_per_lut4", "mac_s_per_lut4_eq")
    ratios = {f"{a[0]}x{a[1]}": {f"{q}_{fmt}_{mode}": ratio(pm, q, fmt, mode, a) for q in quantities
                                 for fmt in ("bf16", "fp16") for mode in MODES} for a in arrays}
    fit_ratios = {f"{q}_{fmt}_{mode}": ratio(fits, q, fmt, mode) for q in ("per_pe_lut4", "fixed_lut4")
                  for fmt in ("bf16", "fp16") for mode in MODES}
    core_of = lambda f: results.get((f, flow, top), {}) if flow else {}  # noqa: E731
    pe_flow = flow or "lut"
    summary = {
        "density_mac_s_per_lut4_vs_fp16_core": flow and ratio(pm, "mac_s_per_lut4", "fp16", flow, top),
        "density_mac_s_per_lut4_vs_bf16_core": flow and ratio(pm, "mac_s_per_lut4", "bf16", flow, top),
        "density_lut4_per_mac_vs_fp16_core": flow and ratio(pm, "lut4_per_mac", "fp16", flow, top),
        "density_mac_s_per_lut4_vs_fp16_core_with_dsp": ratio(pm, "mac_s_per_lut4", "fp16", "dsp", top),
        "density_flow": flow,
        "density_bfp8_core_lut4": core_of("bfp8").get("lut4"), "density_bfp8_core_fmax_mhz": core_of("bfp8").get("fmax_mhz"),
        "density_fp16_core_lut4": core_of("fp16").get("lut4"), "density_fp16_core_fmax_mhz": core_of("fp16").get("fmax_mhz"),
        "density_per_pe_lut4_vs_fp16": fit_ratios[f"per_pe_lut4_fp16_{pe_flow}"],
        "density_per_pe_lut4_vs_bf16": fit_ratios[f"per_pe_lut4_bf16_{pe_flow}"],
        **{f"density_per_pe_lut4_{f}": fits[(f, pe_flow, None)].get("per_pe_lut4") for f in FORMATS},
        **{f"density_fixed_lut4_{f}": fits[(f, pe_flow, None)].get("fixed_lut4") for f in ("bfp8", "fp16")},
        "density_per_pe_lut4_vs_fp16_lut": fit_ratios["per_pe_lut4_fp16_lut"],
    }
    assert set(summary) == set(SUMMARY)
    c = cfgs[top]
    return {
        **summary,
        "density_rows": top[0], "density_cols": top[1],
        "density_per_pe_flow": pe_flow,
        "config": {"arrays": [f"{a[0]}x{a[1]}" for a in arrays], "size": c.size, "tile": list(c.tile),
                   "placers": {f"{a[0]}x{a[1]}": placer_of.get(a, "heap") for a in arrays},
                   "functions": list(c.built_functions), "bfp_output": c.bfp_output, "stochastic": c.stochastic,
                   "acc_lanes": {f"{a[0]}x{a[1]}": cfgs[a].acc_lanes for a in arrays}},
        "dsp_equivalent_lut4": dsp_eq,
        "designs": {_folder(k): {**results[k], **pm[k]} for k in pm if k in results},
        "fits": {f"{f}-{m}": v for (f, m, part), v in fits.items() if v and part is None},
        "array_fits": {f"{f}-{m}": v for (f, m, part), v in fits.items() if v and part == "array"},
        "array_fit_ratios": {f"per_pe_lut4_{fmt}_{mode}": ratio(fits, "per_pe_lut4", fmt, mode, "array")
                             for fmt in ("bf16", "fp16") for mode in MODES},
        "ratios": ratios, "fit_ratios": fit_ratios,
        "paper_throughput": PAPER_THROUGHPUT, "paper_multiplier_area": PAPER_MULTIPLIER_AREA,
        "floor_vs_fp16": FLOOR_VS_FP16,
    }


# ---- the report ------------------------------------------------------------------------------

def _x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def _n(v) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _device_name(device: str) -> str:
    """nextpnr's device option as Lattice names the part ("85k" -> "LFE5U-85F")."""
    family, _, size = device.rpartition("-")
    prefix = {"": "LFE5U", "um": "LFE5UM", "um5g": "LFE5UM5G"}.get(family, f"LFE5{family.upper()}")
    return f"{prefix}-{size.upper().replace('K', 'F')}"


def command(args) -> str:
    functions = "".join(f" {f}" for f in args.functions)  # no names: no activation units
    part = ""
    if tuple(args.formats) != FORMATS:
        part += f" --formats {' '.join(args.formats)}"
    if tuple(args.modes) != MODES:
        part += f" --modes {' '.join(args.modes)}"
    if args.pack_only:
        part += " --pack-only"
    return (f"python benchmarks/density.py --arrays {' '.join(args.arrays)} --size {args.size} "
            f"--tile {args.tile[0]} {args.tile[1]} --functions{functions}{' --reduced' if args.reduced else ''}{part} "
            f"--device {args.device} --package {args.package} --freq {args.freq:g} "
            f"--seeds {' '.join(map(str, args.seeds))} --write")


def _fmax(x: dict) -> str:
    seeds = [s["fmax_mhz"] for s in x["seeds"]]
    spread = f" ({min(seeds):.1f}-{max(seeds):.1f})" if len(seeds) > 1 else ""
    return f"{x['fmax_mhz']:.1f} MHz{spread}"


def report(fig: dict, args, seconds: float) -> str:
    c, d = fig["config"], fig["designs"]
    tool = sum(x["synth_s"] * (not x.get("reused")) + sum(x["pnr_s"]) for x in d.values())
    synth, pnr = sum(x["synth_s"] for x in d.values()), sum(sum(x["pnr_s"]) for x in d.values())
    functions = ", ".join(c["functions"]) or "none"
    units = "BFP output with stochastic rounding" if c["bfp_output"] and c["stochastic"] else (
        "BFP output" if c["bfp_output"] else "fp32/bf16 output only")
    arrays = c["arrays"]
    missing = {name: x["seeds_not_run"] for name, x in d.items() if x.get("seeds_not_run")}
    lines = [
        f"# Density: whole GEMM cores on ECP5, BFP8 against bf16 and fp16 ({' and '.join(arrays)} arrays)",
        "",
        *([f"**Incomplete:** this report gives what runs of its command saved up to now (`--saved`); the placements "
           f"of {', '.join(missing)} are not all run yet (the raw figures say which). Figures that need them are "
           "null.", ""] if missing else []),
        f"Command: `{command(args)}` "
        + (f"(this report from the results its runs saved, `--saved`: synthesis {synth / 60:.0f} min and place and "
           f"route {pnr / 60:.0f} min, summed over the designs and seeds; " if args.saved else
           f"({seconds / 60:.0f} min; place and route and new syntheses of this run {tool / 60:.0f} min summed, "
           f"{args.jobs} at a time; ")
        + "`--reuse` keeps each synthesis and seed whose "
        f"design and options are unchanged). Core configuration: MAC arrays {', '.join(arrays)}, "
        f"{c['size']}x{c['size']} buffers, tile {c['tile'][0]}x{c['tile'][1]}, activation units {functions}, {units}.",
        "",
        "**One flow for every core** (`hbfp.hw.openflow`, as benchmarks/ecp5_area.py drives it): elaborated for "
        "the ECP5 (block RAMs as DP16KDs with their output register; a DSP PE's multiplier a MULT18X18D with its "
        "input and output registers, `ecp5_multiplier`), YoWASP Yosys `synth_ecp5` with the MAC array and the "
        "lanes kept as modules (`keep_hierarchy`, the rest flattened), then nextpnr-ecp5 out of context on "
        f"{_device_name(args.device)} {args.package}, target {args.freq:g} MHz, placement seeds "
        f"{', '.join(map(str, args.seeds))} (Fmax: the median, the range beside it), one placer for every core of "
        "an array size: "
        + ", ".join(f"{a} {'HeAP (the default)' if p == 'heap' else p}" for a, p in c["placers"].items())
        + ". Two flows: **with DSP "
        "blocks** (every PE's product in a MULT18X18D) and **LUT-only** (`-nodsp`, every core built with "
        "`dsp_macs=0`: every PE multiplies with the carry-chain Booth multiplier of `hw/lut_mult.py`, "
        "`BoothProduct`, the BFP8 core's 8x8 codes and the float cores' significands alike: 11x11 for fp16, 8x8 "
        "for bf16, each as a signed 12x12 or 9x9 product). Every PE does one MAC per cycle at full throughput: "
        "MAC/s = PEs x Fmax. No core includes the link (packet engine, UART): it would be the same logic in all "
        "three.",
        "",
    ]
    older = [name for name, x in d.items() if x.get("abc9_writer") == "xaiger"]
    if older:
        lines += ["ABC9 exchanged each netlist with ABC through Yosys' default XAIGER writer, except where YoWASP Yosys "
                  "stopped on an assertion with the kept modules; those went through the older writer "
                  f"(`ABC9_XAIGER1`, as the board builds do; the same mapping): {', '.join(older)}.", ""]
    for a in arrays:
        placer = c["placers"].get(a, "heap")
        lines += [
            f"## {a} arrays" + ("" if placer == "heap" else f" (nextpnr's {placer} placer)"),
            "",
            "| core | flow | LUT4 | FF | MULT18X18D | DP16KD | Fmax (seeds' range) | LUT4/MAC | MAC/s per LUT4 "
            "| MAC/s per (LUT4 + DSP-eq.) | MAC array LUT4 (Yosys) | lanes LUT4 (Yosys) | whole (Yosys) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for fmt in FORMATS:
            for mode in MODES:
                x = d.get(f"{fmt}-{mode}-{a}")
                if x is None:
                    lines.append(f"| {TITLES[fmt]} | {FLOWS[mode]} | not measured | | | | | | | | | | |")
                    continue
                yosys = f"{_n(x['array_lut4'])} | {_n(x['lanes_lut4'])} | {x['yosys_lut4']:,} |"
                if not x["fits"]:
                    needs = ", ".join(f"{k} {v['used']:,}/{v['available']:,}" for k, v in x["needs"].items())
                    lines.append(f"| {TITLES[fmt]} | {FLOWS[mode]} | {x['lut4']:,} (**does not fit**: {needs}) | "
                                 f"{x['ff']:,} | {x['dsp']} | {x['bram']} | | | | | {yosys}")
                    continue
                eq, mac_s = x["mac_s_per_lut4_eq"], x["mac_s_per_lut4"]
                lines.append(
                    f"| {TITLES[fmt]} | {FLOWS[mode]} | {x['lut4']:,} | {x['ff']:,} | {x['dsp']} | {x['bram']} | "
                    + (f"{_fmax(x)}" if x.get("fmax_mhz") else "not placed") + f" | {x['lut4_per_mac']:,.1f} | "
                    + (f"{mac_s / 1e3:,.1f} k" if mac_s else "-") + " | "
                    + (f"{eq / 1e3:,.1f} k" if mode == "dsp" and eq is not None else "") + f" | {yosys}")
        r = fig["ratios"][a]
        lines += [
            "",
            f"How many times the BFP8 core beats the float cores at {a}:",
            "",
            "| | bf16 / BFP8 | fp16 / BFP8 |",
            "|---|---:|---:|",
        ]
        for label, q, mode in (("LUT4 per MAC, LUT-only", "lut4_per_mac", "lut"),
                               ("LUT4 per MAC, with DSP blocks", "lut4_per_mac", "dsp"),
                               ("FF per MAC, LUT-only", "ff_per_mac", "lut"),
                               ("MAC/s per LUT4, LUT-only", "mac_s_per_lut4", "lut"),
                               ("MAC/s per LUT4, with DSP blocks", "mac_s_per_lut4", "dsp"),
                               ("MAC/s per (LUT4 + DSP-eq.), with DSP blocks", "mac_s_per_lut4_eq", "dsp")):
            lines.append(f"| {label} | {_x(r[f'{q}_bf16_{mode}'])} | {_x(r[f'{q}_fp16_{mode}'])} |")
        lines.append("")
    lines += [
        "LUT4: nextpnr's TRELLIS_COMB cells after packing (a LUT4 each, two per CCU2C carry cell, distributed "
        "RAM's LUTs included; a design that does not fit has them too). The last three columns are Yosys' counts "
        "of the same synthesis (LUT4 + 2 x CCU2C): the MAC array (`mac`), the lanes (BFP8: a normalizer and an "
        f"fp32 adder per accumulate lane, `acc_lanes` {', '.join(f'{v} at {k}' for k, v in c['acc_lanes'].items())}; "
        "float: an fp32 adder per column into the accumulator) and the whole core. **DSP-equivalent**: one "
        + (f"MULT18X18D counted as the {fig['dsp_equivalent_lut4']:,} LUT4s" if fig["dsp_equivalent_lut4"] else
           "MULT18X18D counted as the LUT4s (not measured in this run)")
        + " that the same flow needs for a registered 18x18 signed multiplier without DSPs (its replacement cost "
        "in logic, not its silicon area).",
        "",
        *fit_table(fig),
        *reading(fig, args),
        *raw(fig),
    ]
    return "\n".join(lines)


def fit_table(fig: dict) -> list[str]:
    fits, fr = fig["fits"], fig["fit_ratios"]
    if not fits:
        return []
    lines = [
        "## Fixed and per-PE cost",
        "",
        f"nextpnr's LUT4 of each core fitted as fixed + per PE x PEs over the arrays ({', '.join(fig['config']['arrays'])}; "
        "two sizes: the line through them). The fixed part is what does not grow with the array's PEs (control, "
        "command and epilogue logic); the buffers and lanes grow with the array's sides, and the BFP8 core's "
        "accumulate lanes with its columns' rate (`acc_lanes`), so the whole-core slope counts them in. Beside it "
        "the same fit of the MAC array module alone (Yosys' count of the kept module: the PEs and the edge "
        "logic of the array's sides).",
        "",
        "| core | flow | fixed LUT4 | LUT4 per PE | per PE, over BFP8's | MAC array: LUT4 per PE (Yosys) "
        "| over BFP8's |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    arr, ar = fig.get("array_fits", {}), fig.get("array_fit_ratios", {})
    for fmt in FORMATS:
        for mode in MODES:
            x = fits.get(f"{fmt}-{mode}")
            if not x:
                continue
            over = "" if fmt == "bfp8" else _x(fr[f"per_pe_lut4_{fmt}_{mode}"])
            y = arr.get(f"{fmt}-{mode}")
            a_over = "" if fmt == "bfp8" else _x(ar.get(f"per_pe_lut4_{fmt}_{mode}"))
            lines.append(f"| {TITLES[fmt]} | {FLOWS[mode]} | {x['fixed_lut4']:,.0f} | {x['per_pe_lut4']:,.1f} | {over} | "
                         + (f"{y['per_pe_lut4']:,.1f} | {a_over} |" if y else "- | |"))
    return lines + [""]


def reading(fig: dict, args) -> list[str]:
    """What the figures say, phrased from the figures themselves."""
    out = ["## Reading", ""]
    key, flow = fig["density_mac_s_per_lut4_vs_fp16_core"], fig["density_flow"]
    size = f"{fig['density_rows']}x{fig['density_cols']}"
    if key is None:
        out.append(f"- The whole-core comparison at {size} is incomplete: the BFP8 and fp16 cores were not both "
                   "measured, or do not both fit, in either flow; summary.json's `density_mac_s_per_lut4_vs_fp16_core` "
                   "is null.")
    else:
        floor = "meets" if key >= FLOOR_VS_FP16 else "**misses**"
        why = ("" if flow == "lut" else
               f" (LUT-only the fp16 core does not fit {_device_name(args.device)} at {size})")
        out.append(
            f"- **Whole cores at {size}, {FLOWS[flow]}**{why} (summary.json's `density_mac_s_per_lut4_vs_fp16_core`): "
            f"BFP8 {fig['density_bfp8_core_lut4']:,} LUT4 at {fig['density_bfp8_core_fmax_mhz']:.1f} MHz, fp16 "
            f"{fig['density_fp16_core_lut4']:,} LUT4 at {fig['density_fp16_core_fmax_mhz']:.1f} MHz: the BFP8 core's "
            f"MAC/s per LUT4 are **{key:.2f}x** the fp16 core's ({_x(fig['density_mac_s_per_lut4_vs_bf16_core'])} the "
            f"bf16 core's); this {floor} the floor of {FLOOR_VS_FP16:g}x (the paper: {PAPER_THROUGHPUT}x).")
    pe = fig["density_per_pe_lut4_vs_fp16"]
    if pe is not None:
        floor = "meets" if pe >= FLOOR_VS_FP16 else "**misses**"
        pe_flow = fig["density_per_pe_flow"]
        dsp = (" (one MULT18X18D a PE in every core: the LUT4 are the rest of the PE), as the whole cores compare"
               if pe_flow == "dsp" else "")
        lut = fig["density_per_pe_lut4_vs_fp16_lut"]
        lut_only = ("" if pe_flow == "lut" or lut is None else
                    f" LUT-only (every multiplier in LUTs; `density_per_pe_lut4_vs_fp16_lut`, a core that does not "
                    f"fit entering with its packed count) the fit gives **{lut:.2f}x**.")
        out.append(
            f"- **Per PE, {FLOWS[pe_flow]}**{dsp} (summary.json's `density_per_pe_lut4_vs_fp16`, from the fit): an "
            f"fp16 PE costs {fig['density_per_pe_lut4_fp16']:,.0f} LUT4 against a BFP8 PE's "
            f"{fig['density_per_pe_lut4_bfp8']:,.0f}: **{pe:.2f}x** ({_x(fig['density_per_pe_lut4_vs_bf16'])} for "
            f"bf16); this {floor} the floor of {FLOOR_VS_FP16:g}x.{lut_only} The paper's {PAPER_MULTIPLIER_AREA}x "
            "compares an fp16 multiplier with an 8-bit one; a PE here is multiplier, accumulator and pipeline: a "
            "float PE's fp32 adder is most of its cost, a BFP8 PE adds its products in an integer accumulator and "
            "leaves the fp32 additions to the lanes.")
    out += [
        f"- The fixed logic weighs on small arrays: the fewer the PEs, the closer the whole-core ratios come to 1, "
        "and the more they approach the per-PE ratio as the array grows.",
        "",
        "What differs between the cores, beyond the number format:",
        "",
        "- The float cores accumulate every product in fp32 in its PE (RNE, FTZ, as `hbfp.golden.float_mac`); "
        f"BFP8 sums a K-tile of {fig['config']['tile'][1]} products exactly in integers and converts once per "
        "K-tile per column. The float cores' operand buffers hold 16-bit patterns, the BFP8 core's 8-bit codes "
        "plus shared exponents. The float core stalls while a group of sums drains and takes no transposes "
        "(`FloatCore`): its full-throughput MAC/s is an upper bound.",
        "- Both kinds of PE are pipelined alike: operands registered at the array's edge, the multiplier's two "
        "stages (a DSP block's input and output registers, or a Booth product's partial products and sum), a "
        "fabric copy of the product, then the accumulation (BFP8: an integer add; float: the pattern, then the "
        f"{AddF32Datapath.LATENCY}-stage fp32 adder whose output is its own accumulator, `FloatMacArray`).",
        "",
    ]
    return out


def raw(fig: dict) -> list[str]:
    lines = ["## Raw figures", "", "| design | Fmax per seed | synthesis | place and route |", "|---|---|---:|---:|"]
    for name, x in fig["designs"].items():
        seeds = ", ".join(f"{s['fmax_mhz']:.1f} MHz (seed {s['seed']})" for s in x["seeds"]) or "-"
        if x.get("seeds_not_run"):
            seeds += f"; seed{'s' * (len(x['seeds_not_run']) > 1)} {', '.join(map(str, x['seeds_not_run']))} not run yet"
        lines.append(f"| {name} | {seeds} | {x['synth_s']:.0f} s | {' + '.join(f'{s:.0f}' for s in x['pnr_s']) or '-'} s |")
    lines.append("")
    return lines


# ---- command line ----------------------------------------------------------------------------

#: nextpnr's placers an array may name (``--arrays 8x8:static``); HeAP is nextpnr's default.
PLACERS = ("heap", "static")


def _array(text: str) -> str:
    size, _, placer = text.lower().partition(":")
    try:
        r, c = (int(v) for v in size.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"an array is ROWSxCOLS[:PLACER], e.g. 8x8, got {text!r}") from None
    if r < 1 or c < 1:
        raise argparse.ArgumentTypeError(f"an array's sides must be positive, got {text!r}")
    if placer and placer not in PLACERS:
        raise argparse.ArgumentTypeError(f"placer {placer!r} is not one of {', '.join(PLACERS)}")
    return f"{r}x{c}" + (f":{placer}" if placer and placer != "heap" else "")


def placers(args) -> dict[Array, str]:
    """Each array's placer (``--arrays 8x8:static``; HeAP unless named)."""
    out = {}
    for text in args.arrays:
        size, _, placer = text.partition(":")
        r, c = (int(v) for v in size.split("x"))
        out[(r, c)] = placer or "heap"
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arrays", type=_array, nargs="+", default=["4x4", "8x8:static"],
                   help="MAC arrays measured, ROWSxCOLS[:PLACER] (default 4x4 8x8:static; two sizes or more "
                        "give the per-PE fit; PLACER: nextpnr's, heap unless named, for every core of that size)")
    p.add_argument("--size", type=int, default=96, help="buffer side (default 96)")
    p.add_argument("--tile", type=int, nargs=2, default=[24, 24], metavar=("ROWS", "COLS"),
                   help="BFP tile; its column side is the K-tile (default 24 24)")
    p.add_argument("--functions", nargs="*", default=["relu", "gelu"],
                   help="activation units built (default relu gelu; none: give the option no names)")
    p.add_argument("--reduced", action="store_true", help="cores without BFP output and stochastic rounding")
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS), help="cores measured (default all)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="flows (default dsp lut)")
    p.add_argument("--device", default="85k", help="nextpnr-ecp5 device option (default 85k)")
    p.add_argument("--package", default="CABGA381")
    p.add_argument("--freq", type=float, default=100.0, help="target clock in MHz")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3],
                   help="placement seeds (default 1 2 3); Fmax: the median")
    p.add_argument("--jobs", type=int, default=2, help="flows run at a time (default 2)")
    p.add_argument("--out", default="build/density", help="work folder")
    p.add_argument("--write", action="store_true",
                   help="write docs/reports/density.md and summary.json's density figures")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE")
    p.add_argument("--saved", action="store_true",
                   help="run no tool: report what earlier runs of these options saved (a design, or a seed, "
                        "not run yet is reported so)")
    p.add_argument("--pack-only", action="store_true",
                   help="count each design after packing, without placing it: the per-PE fit, no Fmax")
    p.add_argument("--reuse", action="store_true",
                   help="keep each saved synthesis and seed whose design and options are unchanged")
    return p


def configs(args) -> dict[Array, CoreConfig]:
    """The core configuration of each array (``ConfigError`` where one is not valid)."""
    units = dict(bfp_output=False, stochastic=False) if args.reduced else {}
    out = {}
    for r, c in placers(args):
        out[(r, c)] = CoreConfig(rows=r, cols=c, size=args.size, tile=tuple(args.tile),
                                 functions=tuple(args.functions), **units)
    return out


def run(args) -> dict:
    """Measure every design (``args`` as ``parser`` makes them), print the report (with
    ``args.write`` save it) and return the figures."""
    cfgs = configs(args)
    t0 = time.perf_counter()
    c = next(iter(cfgs.values()))
    functions = "-".join(c.built_functions) or "none"
    work = ROOT / args.out / (f"s{c.size}-t{c.tile[0]}x{c.tile[1]}-{functions}" + ("-reduced" if args.reduced else ""))

    def log(s: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f} s] {s}", flush=True)

    jobs = designs(cfgs, args.formats, args.modes)
    # The largest float cores first (the longest flows), so that the workers finish together.
    order = sorted(jobs, key=lambda k: (k[0] == "mult18", -(k[2][0] * k[2][1] if k[2] else 0), k[0] == "bfp8"))
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(measure, k, jobs[k], work, args, log): k for k in order}
        results = {}
        for f in as_completed(futures):
            if f.exception() is not None:  # a failed flow stops the run: the others wait no longer
                for other in futures:
                    other.cancel()
                raise f.exception()
            if f.result() is not None:  # None: --saved, and nothing saved
                results[futures[f]] = f.result()
    seconds = time.perf_counter() - t0
    fig = figures(results, cfgs, placers(args))
    (work / "figures.json").write_text(json.dumps(fig, indent=1) + "\n")
    publish(report(fig, args, seconds), "density.md", args.write)
    if args.write:
        # summary.json's density figures follow the report (benchmarks/fpga_report.py writes
        # the same keys when it runs the experiment).
        path = REPORTS / "summary.json"
        summary = json.loads(path.read_text()) if path.exists() else {}
        summary.update({key: fig[key] for key in SUMMARY_FIGURES})
        path.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"written {path} (its density figures)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(fig, indent=1) + "\n")
        print(f"written {args.json}")
    return fig


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if min(args.size, *args.tile, args.jobs) < 1:
        p.error("--size, --tile and --jobs must be positive")
    try:
        configs(args)
    except ConfigError as e:
        p.error(str(e))
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
