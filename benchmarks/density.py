"""The density experiment: the same MAC array in three number formats through one ECP5 flow.

HBFP's hardware claim (Drumond et al., NeurIPS 2018) is that fixed-point MACs are far
denser than floating-point ones: the paper quotes an fp16 multiplier at 5.8x the area of an
8-bit one, and 8.5x the throughput for 8-bit BFP over fp16 on an FPGA. This script measures
our own gateware:

- BFP8: ``hbfp.hw.mac_array.MacArray`` (int8 x int8, exact integer sums per K-tile of
  ``tk``), alone and with the fp32 conversion the GEMM core gives each column (one
  ``NormalizeDatapath`` and one ``AddF32Datapath`` per column, as in ``hbfp.hw.gemm_core``);
- bf16 and fp16: ``hbfp.hw.float_mac.FloatMacArray`` (16-bit float products, one fp32
  accumulation per product);

all at the same size (default 4 x 4), each synthesized twice with ``synth_ecp5`` (with
MULT18X18D blocks, and LUT-only with ``-nodsp``) and placed and routed out of context on an
LFE5U-85F (``hbfp.hw.openflow``). A lone registered 18x18 multiplier, synthesized LUT-only,
sets the LUT4 equivalent of one MULT18X18D.

    python benchmarks/density.py [--rows 4 --cols 4] [--jobs 2] [--write]

``--write`` writes docs/reports/density.md. Needs the ``fpga`` extra. With the defaults on
two cores it takes about 20 minutes (the report records the tool time); `--reuse` keeps the
results of designs whose Verilog and options did not change.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from amaranth import Module, Signal, signed
from amaranth.back import verilog
from amaranth.lib import data, wiring
from amaranth.lib.wiring import In, Out
from hbfp.hw.add_f32 import AddF32Datapath
from hbfp.hw.float_mac import FloatMacArray
from hbfp.hw.mac_array import MacArray
from hbfp.hw.normalize import NormalizeDatapath
from hbfp.hw.openflow import pnr_ecp5, synth_ecp5
from hbfp.hw.params import EXP_WIDTH, FP32_WIDTH, psum_width

from report import publish, verilog_logic  # benchmarks/report.py

ROOT = Path(__file__).resolve().parents[1]
#: The paper's figures (Drumond et al., NeurIPS 2018, section 5).
PAPER_MULTIPLIER_AREA = 5.8  # fp16 multiplier / 8-bit fixed-point multiplier
PAPER_THROUGHPUT = 8.5  # 8-bit BFP over fp16, on an FPGA


class ConversionLanes(wiring.Component):
    """The fp32 conversion the GEMM core attaches to a ``cols``-wide MAC array: per column one
    ``NormalizeDatapath`` (a K-tile's integer sum and its tile exponents to fp32) feeding one
    ``AddF32Datapath`` (the fp32 accumulation), wired as in ``hbfp.hw.gemm_core``. The sums,
    exponents and the accumulator values read back are ports (in ``GemmCore`` they come from
    the array, a FIFO and the accumulator memory), so the measurement holds the arithmetic.

    Measured on its own and added to the ``MacArray`` figures: synthesized together with the
    array, Yosys' ABC9 step fails in this flow (it reports a logic loop neither part has)."""

    def __init__(self, cols: int, psum_width: int, mantissa_bits: int = 8):
        self.cols, self.psum_width, self.mantissa_bits = cols, psum_width, mantissa_bits
        super().__init__({
            "valid_in": In(1),
            "sums": In(data.ArrayLayout(signed(psum_width), cols)),
            "exp_a": In(EXP_WIDTH),
            "exp_b": In(data.ArrayLayout(EXP_WIDTH, cols)),
            "acc": In(data.ArrayLayout(FP32_WIDTH, cols)),
            "result": Out(data.ArrayLayout(FP32_WIDTH, cols)),
            "valid": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        for j in range(self.cols):
            nd = m.submodules[f"normalize{j}"] = NormalizeDatapath(self.psum_width, self.mantissa_bits, self.mantissa_bits)
            ad = m.submodules[f"add{j}"] = AddF32Datapath()
            m.d.comb += [
                nd.advance.eq(1),
                nd.i_valid.eq(self.valid_in),
                nd.i_s.eq(self.sums[j]),
                nd.i_exp_a.eq(self.exp_a),
                nd.i_exp_b.eq(self.exp_b[j]),
                ad.advance.eq(1),
                ad.in_valid.eq(nd.o_valid),
                ad.a.eq(nd.o_result),
                ad.b.eq(self.acc[j]),
                self.result[j].eq(ad.result),
            ]
            if j == 0:
                m.d.comb += self.valid.eq(ad.out_valid)
        return m


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


def designs(rows: int, cols: int, tk: int) -> dict:
    """name -> (description, component factory, MACs per cycle)."""
    macs = rows * cols
    return {
        "bfp8": (f"BFP8 MacArray (tk {tk})", lambda: MacArray(rows, cols, tk), macs),
        "lanes": (f"{cols} normalizer/adder lanes alone", lambda: ConversionLanes(cols, psum_width(8, 8, tk)), macs),
        "bf16": ("bf16 FloatMacArray, fp32 sums", lambda: FloatMacArray(rows, cols, "bf16", tk), macs),
        "fp16": ("fp16 FloatMacArray, fp32 sums", lambda: FloatMacArray(rows, cols, "fp16", tk), macs),
    }


def measure(name: str, factory, nodsp: bool, work: Path, args, log) -> dict:
    """Synthesize, place and route one design in ``work/<name>-<dsp|lut>``; with ``--reuse``
    a saved result stands while the design's Verilog and the flow options are unchanged."""
    mode = "lut" if nodsp else "dsp"
    # No "+" or spaces in the folder: ABC's script parser would split the path.
    d = work / f"{name}-{mode}"
    d.mkdir(parents=True, exist_ok=True)
    top = "top"
    text = verilog.convert(factory(), name=top)
    tag = f"{name} ({'LUT-only' if nodsp else 'DSP'})"
    options = {"device": args.device, "package": args.package, "freq": args.freq, "seed": args.seed}
    saved = d / "result.json"
    if args.reuse and saved.exists() and (d / "top.v").exists() and verilog_logic(d / "top.v") == verilog_logic(text):
        row = json.loads(saved.read_text())
        if row.get("options") == options:
            log(f"{tag}: reused {saved}")
            return row
    (d / "top.v").write_text(text)
    synth = synth_ecp5(d / "top.v", top, d, nodsp=nodsp, log=lambda s: log(f"{tag}: {s}"))
    pnr = pnr_ecp5(synth["json"], d, args.device, args.package, args.freq, args.seed, log=lambda s: log(f"{tag}: {s}"))
    util = pnr["utilization"]
    row = {
        "name": name, "mode": mode,
        "lut4": util["TRELLIS_COMB"][0], "ff": util["TRELLIS_FF"][0], "dsp": util["MULT18X18D"][0],
        "ramw": util.get("TRELLIS_RAMW", (0, 0))[0],
        "fmax": pnr["fmax_min"], "cells": synth["cells"],
        "synth_s": synth["seconds"], "pnr_s": pnr["seconds"], "options": options,
    }
    saved.write_text(json.dumps(row, indent=1))
    log(f"{tag}: {row['lut4']} LUT4, {row['ff']} FF, {row['dsp']} MULT18X18D, {row['fmax']:.1f} MHz "
        f"(synthesis {row['synth_s']:.0f} s, place and route {row['pnr_s']:.0f} s)")
    return row


def _f(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}"


def report(results: dict, dsp_eq: float, args, seconds: float) -> str:
    R, C = args.rows, args.cols
    n = R * C
    tool = sum(r["synth_s"] + r["pnr_s"] for r in results.values())
    runs = list(designs(R, C, args.tk))
    desc = {k: v[0] for k, v in designs(R, C, args.tk).items()}
    # BFP8 with its conversion: the array's and the lanes' figures added, the slower clock.
    results = dict(results)
    for mode in ("dsp", "lut"):
        a, b = results[("bfp8", mode)], results[("lanes", mode)]
        results[("bfp8-lanes", mode)] = {
            **{k: a[k] + b[k] for k in ("lut4", "ff", "dsp")}, "fmax": min(a["fmax"], b["fmax"]),
        }
    desc["bfp8-lanes"] = f"BFP8 MacArray + {C} normalizer/adder lanes"
    names = ["bfp8", "bfp8-lanes", "bf16", "fp16"]
    get = lambda name, mode: results[(name, mode)]

    def per_mac(name):
        d, lut = get(name, "dsp"), get(name, "lut")
        mhz_dsp, mhz_lut = d["fmax"], lut["fmax"]
        return {
            "lut4": d["lut4"] / n, "ff": d["ff"] / n, "dsp": d["dsp"] / n, "fmax_dsp": mhz_dsp,
            "lut4_lut": lut["lut4"] / n, "ff_lut": lut["ff"] / n, "fmax_lut": mhz_lut,
            # MAC/s per LUT4: the array's peak MACs per second over its LUT4s.
            "macs_per_lut": n * mhz_lut * 1e6 / lut["lut4"],
            "macs_per_eq": n * mhz_dsp * 1e6 / (d["lut4"] + dsp_eq * d["dsp"]),
        }

    pm = {k: per_mac(k) for k in names}
    cmd = (f"python benchmarks/density.py --rows {R} --cols {C} --tk {args.tk} --device {args.device} "
           f"--package {args.package} --freq {args.freq:g} --seed {args.seed} --write")
    lines = [
        f"# Density: BFP8 against bf16 and fp16 MACs on ECP5 ({R}x{C} arrays)",
        "",
        f"Command: `{cmd}`. The nine flows take {tool / 60:.0f} min of tool time (synthesis plus place and route, "
        f"summed); {args.jobs} at a time on the 2-core development machine, a full run took about "
        f"{max(seconds, tool / args.jobs) / 60:.0f} min.",
        f"Every design went through the same flow (`hbfp.hw.openflow`): YoWASP Yosys `synth_ecp5`, once with "
        f"MULT18X18D blocks and once LUT-only (`-nodsp`), then nextpnr-ecp5 out of context on "
        f"{_device_name(args.device)} {args.package}, target {args.freq:g} MHz, seed {args.seed}. "
        f"All designs have {n} processing elements, each one MAC per cycle at full throughput.",
        "",
        "| design | LUT4/MAC | FF/MAC | MULT18X18D/MAC | Fmax (DSP) | LUT4/MAC LUT-only | FF/MAC LUT-only | Fmax LUT-only "
        "| MAC/s per LUT4, LUT-only | MAC/s per (LUT4 + DSP-eq.) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k in names:
        p = pm[k]
        lines.append(
            f"| {desc[k]} | {_f(p['lut4'])} | {_f(p['ff'])} | {p['dsp']:.2f} | {_f(p['fmax_dsp'])} MHz | "
            f"{_f(p['lut4_lut'])} | {_f(p['ff_lut'])} | {_f(p['fmax_lut'])} MHz | "
            f"{p['macs_per_lut'] / 1e3:,.0f} k | {p['macs_per_eq'] / 1e3:,.1f} k |"
        )
    lines += [
        "",
        f"LUT4 counts are nextpnr's TRELLIS_COMB cells (one LUT4 each; a carry-chain cell CCU2C "
        f"takes two). **DSP-equivalent**: one MULT18X18D is counted as the {dsp_eq:.0f} LUT4s "
        f"that the same flow needs for a registered 18x18 signed multiplier without DSPs (its "
        f"replacement cost in logic, not its silicon area). MAC/s: {n} MACs times Fmax.",
        "",
        "## Ratios against BFP8",
        "",
        "How many times BFP8 is denser (LUT4 per MAC of the format over LUT4 per MAC of BFP8) and "
        "how many times its throughput per logic is higher, for the BFP8 array alone and with its "
        "conversion lanes:",
        "",
        "| | bf16 / BFP8 | fp16 / BFP8 | bf16 / BFP8+lanes | fp16 / BFP8+lanes | paper (fp16 / 8-bit) |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def ratio_row(label, key, inverse, paper):
        cells = []
        for base in ("bfp8", "bfp8-lanes"):
            for fmt in ("bf16", "fp16"):
                r = pm[base][key] / pm[fmt][key] if inverse else pm[fmt][key] / pm[base][key]
                cells.append(f"{r:.2f}x")
        return f"| {label} | " + " | ".join(cells) + f" | {paper} |"

    lines += [
        ratio_row("LUT4 per MAC, LUT-only", "lut4_lut", False, f"{PAPER_MULTIPLIER_AREA}x (multiplier area)"),
        ratio_row("LUT4 per MAC, with DSPs", "lut4", False, ""),
        ratio_row("FF per MAC, LUT-only", "ff_lut", False, ""),
        ratio_row("MAC/s per LUT4, LUT-only", "macs_per_lut", True, f"{PAPER_THROUGHPUT}x (throughput)"),
        ratio_row("MAC/s per (LUT4 + DSP-eq.)", "macs_per_eq", True, ""),
        "",
    ]
    lines += ["## Raw figures", "", "| design | flow | LUT4 | FF | MULT18X18D | Fmax | synthesis | place and route |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for k in runs:
        for mode in ("dsp", "lut"):
            r = get(k, mode)
            lines.append(f"| {desc[k]} | {'DSP' if mode == 'dsp' else 'LUT-only'} | {r['lut4']:,} | {r['ff']:,} | {r['dsp']} | "
                         f"{r['fmax']:.1f} MHz | {r['synth_s']:.0f} s | {r['pnr_s']:.0f} s |")
    m18 = results[("mult18", "lut")]
    lines.append(f"| registered 18x18 multiplier (DSP-equivalent) | LUT-only | {m18['lut4']:,} | {m18['ff']:,} | 0 | "
                 f"{m18['fmax']:.1f} MHz | {m18['synth_s']:.0f} s | {m18['pnr_s']:.0f} s |")
    lines.append("")
    lines += discussion(pm, results, args)
    return "\n".join(lines)


def discussion(pm: dict, results: dict, args) -> list[str]:
    """What the figures say and what differs from the paper's comparison."""
    R, C, n = args.rows, args.cols, args.rows * args.cols
    psum = psum_width(8, 8, args.tk)
    fmts = ("bf16", "fp16")
    lane_lut = results[("lanes", "lut")]["lut4"] / C
    area = {f: pm[f]["lut4_lut"] / pm["bfp8"]["lut4_lut"] for f in fmts}
    area_lanes = {f: pm[f]["lut4_lut"] / pm["bfp8-lanes"]["lut4_lut"] for f in fmts}
    area_dsp = {f: pm[f]["lut4"] / pm["bfp8"]["lut4"] for f in fmts}
    area_dsp_lanes = {f: pm[f]["lut4"] / pm["bfp8-lanes"]["lut4"] for f in fmts}
    thr = {f: pm["bfp8"]["macs_per_lut"] / pm[f]["macs_per_lut"] for f in fmts}
    thr_lanes = {f: pm["bfp8-lanes"]["macs_per_lut"] / pm[f]["macs_per_lut"] for f in fmts}
    bfp_mult = pm["bfp8"]["lut4_lut"] - pm["bfp8"]["lut4"]  # LUT4s the DSP block absorbs
    return [
        "## Reading",
        "",
        f"- **With DSP blocks** (how the arrays would be built on ECP5) every design uses one MULT18X18D "
        f"per MAC, so the difference is in the logic around the multiplier: {pm['bfp8']['lut4']:.0f} LUT4s per "
        f"BFP8 MAC (a {psum}-bit integer accumulator, the shadow bank's multiplexer) against "
        f"{pm['bf16']['lut4']:.0f} (bf16) and {pm['fp16']['lut4']:.0f} (fp16), which is "
        f"{area_dsp['bf16']:.0f}x and {area_dsp['fp16']:.0f}x. Almost all of a float MAC's logic is its "
        f"fp32 accumulation (alignment shifter, leading-zero count, normalizing shifter, rounding, five "
        f"pipeline stages): one normalizer + adder lane costs {lane_lut:.0f} LUT4s. BFP8 needs such a lane "
        f"once per column of {R} MACs, working once per {args.tk}-product K-tile; counting the lanes, the "
        f"float MACs take {area_dsp_lanes['bf16']:.1f}x and {area_dsp_lanes['fp16']:.1f}x the LUT4s.",
        f"- **LUT-only** the multipliers move into logic, and in this flow a multiplier is expensive: the "
        f"BFP8 MAC grows by {bfp_mult:.0f} LUT4s (to {pm['bfp8']['lut4_lut']:.0f}), so the 8x8 product "
        f"becomes most of it (Yosys with `-nodsp` maps products through ABC into plain LUTs, not "
        f"carry-chain adder trees; a lone 18x18 takes {results[('mult18', 'lut')]['lut4']:,} LUT4s). The float "
        f"MACs then take {area['bf16']:.1f}x (bf16) and {area['fp16']:.1f}x (fp16) the LUT4s of a BFP8 MAC, "
        f"{area_lanes['bf16']:.1f}x and {area_lanes['fp16']:.1f}x counting the lanes.",
        f"- **Throughput per LUT4** (LUT-only) also gains from the clock: the BFP8 array closes at "
        f"{pm['bfp8']['fmax_lut']:.0f} MHz, the float arrays at {min(pm[f]['fmax_lut'] for f in fmts):.0f}-"
        f"{max(pm[f]['fmax_lut'] for f in fmts):.0f} MHz (their fp32 adders, like the lanes at "
        f"{results[('lanes', 'lut')]['fmax']:.0f} MHz, hold the critical paths). BFP8 delivers "
        f"{thr['fp16']:.1f}x the MAC/s per LUT4 of fp16 (paper: {PAPER_THROUGHPUT}x) and {thr['bf16']:.1f}x "
        f"those of bf16; with the lanes, whose clock then bounds the whole, {thr_lanes['fp16']:.1f}x and "
        f"{thr_lanes['bf16']:.1f}x.",
        "",
        "What differs from the paper's comparison:",
        "",
        f"- The paper's {PAPER_MULTIPLIER_AREA}x compares multipliers alone; here a MAC is multiplier, accumulator "
        "and pipeline registers, placed and routed on an FPGA, and the accumulator is where fixed point "
        "saves most. Our LUT-only area ratio is below the paper's multiplier ratio because this flow's LUT "
        "multipliers dominate the small BFP8 MAC; with DSP blocks, where multipliers cost no LUTs, it is "
        "far above it.",
        f"- The float arrays accumulate every product in fp32 (RNE, FTZ, as `hbfp.golden.float_mac` defines); "
        f"BFP8 sums {args.tk} products exactly in integers and converts once per K-tile. Its conversion "
        f"lanes are shared by the {R} MACs of a column, so their share per MAC halves with each doubling of "
        f"the array's rows ({R}x{C} here; the GEMM core is 8x8). The lanes were placed and routed on their "
        "own and their figures added to the array's (Yosys' ABC9 step fails on the two synthesized "
        "together in this flow).",
        f"- BFP8's `MacArray` includes a shadow bank ({psum} flip-flops per MAC) and a row multiplexer that drain "
        "the sums while the next K-tile runs; `FloatMacArray` offers all its sums at once on a wide output "
        "and has neither. This favours the float arrays.",
        "- `FloatMacArray` widens bf16/fp16 to fp32 fields once per row and column at the array's edge "
        f"({R} + {C} converters for {n} MACs), the counterpart of BFP's shared exponents. The BFP8 figures "
        "include no quantizer (the GEMM core quantizes at the operand buffers' input, once per element).",
        f"- {R}x{C} arrays, one placement seed, out of context at a {args.freq:g} MHz target: Fmax figures "
        "carry some placement noise, and edge logic weighs more per MAC than in a larger array.",
        "",
    ]


def _device_name(device: str) -> str:
    """nextpnr's device option as Lattice names the part ("85k" -> "LFE5U-85F")."""
    family, _, size = device.rpartition("-")
    prefix = {"": "LFE5U", "um": "LFE5UM", "um5g": "LFE5UM5G"}.get(family, f"LFE5{family.upper()}")
    return f"{prefix}-{size.upper().replace('K', 'F')}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--cols", type=int, default=4)
    p.add_argument("--tk", type=int, default=24, help="BFP8 K-tile (also the float arrays' products per output)")
    p.add_argument("--device", default="85k", help="nextpnr-ecp5 device option (default 85k)")
    p.add_argument("--package", default="CABGA381")
    p.add_argument("--freq", type=float, default=100.0, help="target clock in MHz")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--jobs", type=int, default=2, help="flows run at a time (default 2)")
    p.add_argument("--out", default="build/density", help="work folder")
    p.add_argument("--write", action="store_true", help="write docs/reports/density.md")
    p.add_argument("--reuse", action="store_true", help="keep the saved result of every design whose Verilog and options are unchanged")
    args = p.parse_args(argv)
    if args.rows < 1 or args.cols < 1 or args.tk < 1 or args.jobs < 1:
        p.error("--rows, --cols, --tk and --jobs must be positive")

    t0 = time.perf_counter()
    work = ROOT / args.out / f"{args.rows}x{args.cols}"

    def log(s: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f} s] {s}", flush=True)

    jobs = [(name, factory, nodsp) for name, (_, factory, _) in designs(args.rows, args.cols, args.tk).items()
            for nodsp in (True, False)]
    jobs.append(("mult18", Mult18, True))
    # The float arrays first (the longest flows), so that the workers finish together.
    jobs.sort(key=lambda j: (j[0] == "mult18", j[0] in ("bfp8", "lanes"), not j[2]))
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {(name, "lut" if nodsp else "dsp"): pool.submit(measure, name, factory, nodsp, work, args, log)
                   for name, factory, nodsp in jobs}
        results = {key: f.result() for key, f in futures.items()}
    seconds = time.perf_counter() - t0
    (work / "results.json").write_text(json.dumps({f"{k[0]}-{k[1]}": v for k, v in results.items()}, indent=1))
    dsp_eq = results[("mult18", "lut")]["lut4"]
    text = report(results, dsp_eq, args, seconds)
    publish(text, "density.md", args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
