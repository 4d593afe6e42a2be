"""Area and Fmax of a GEMM core on ECP5 through the open flow (YoWASP Yosys + nextpnr-ecp5).

Generates the core's Verilog (``hbfp verilog`` options), synthesizes it with ``synth_ecp5``,
places and routes it out of context (no I/O buffers: the core's ports are internal to a
board top) on an LFE5U-85F, and prints LUT4s, flip-flops, MULT18X18D, DP16KD block RAMs and
Fmax; ``--write`` also saves the table under docs/reports/.

Needs the ``fpga`` extra: ``pip install -e .[fpga]``. The first YoWASP call takes about a
minute to prepare; synthesis of the 8x8 core takes minutes, place and route longer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hbfp.hw.generate import generate
from hbfp.hw.openflow import pnr_ecp5, synth_ecp5
from hbfp.hw.params import CoreConfig

from report import publish  # benchmarks/report.py

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--cols", type=int, default=8)
    p.add_argument("--size", type=int, default=96)
    p.add_argument("--functions", nargs="+", default=["relu", "gelu"], help="activation units built (default relu gelu)")
    p.add_argument("--device", default="85k", help="nextpnr-ecp5 device option (default 85k)")
    p.add_argument("--package", default="CABGA381")
    p.add_argument("--freq", type=float, default=100.0, help="target clock in MHz")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="build/ecp5", help="work folder")
    p.add_argument("--write", action="store_true", help="write docs/reports/ecp5-<config>.md")
    args = p.parse_args(argv)

    cfg = CoreConfig(rows=args.rows, cols=args.cols, size=args.size, functions=tuple(args.functions))
    name = f"core-{cfg.rows}x{cfg.cols}-s{cfg.size}"
    work = ROOT / args.out / name
    print(f"{name}: Verilog")
    generate(cfg, work, only=["gemm_core"], log=lambda s: None)
    print(f"{name}: synth_ecp5 ...", flush=True)
    synth = synth_ecp5(work / "gemm_core.v", "gemm_core", work)
    print(f"{name}: nextpnr-ecp5 --{args.device} --out-of-context ...", flush=True)
    pnr = pnr_ecp5(synth["json"], work, args.device, args.package, args.freq, args.seed)
    t_synth, t_pnr = synth["seconds"], pnr["seconds"]
    util = pnr["utilization"]
    fmax = max(pnr["fmax"].values())
    rows = [(k, *util[k]) for k in ("TRELLIS_COMB", "TRELLIS_FF", "MULT18X18D", "DP16KD") if k in util]
    macs = cfg.rows * cfg.cols * fmax * 1e6
    lines = [
        f"# ECP5 reading: {cfg.rows}x{cfg.cols} GEMM core, HBFP8, {cfg.size}x{cfg.size} buffers, activations {', '.join(cfg.functions)}",
        "",
        f"Command: `python benchmarks/ecp5_area.py --rows {cfg.rows} --cols {cfg.cols} --size {cfg.size} "
        f"--functions {' '.join(cfg.functions)} --device {args.device} --freq {args.freq:g} --seed {args.seed}`",
        f"(YoWASP Yosys `synth_ecp5`, nextpnr-ecp5 out of context on LFE5U-{args.device.upper()} {args.package}; "
        f"synthesis {t_synth:.0f} s, place and route {t_pnr:.0f} s).",
        "",
        "| resource | used | available | share |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {k} | {u:,} | {a:,} | {100 * u / a:.0f}% |" for k, u, a in rows]
    lines += ["", f"Fmax after place and route: **{fmax:.1f} MHz** (target {args.freq:g} MHz); "
              f"peak {macs / 1e9:.2f} GMAC/s at that clock.", ""]
    stat = synth["stat"]
    lines += ["Yosys cell counts (before packing):", "", "```", stat.strip(), "```", ""]
    text = "\n".join(lines)
    publish(text, f"ecp5-{name}.md", args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
