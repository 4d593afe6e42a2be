"""Area and Fmax of a GEMM core on ECP5 through the open flow (YoWASP Yosys + nextpnr-ecp5).

Generates the core's Verilog (``hbfp verilog`` options), synthesizes it once with
``synth_ecp5`` (``--no-dsp``: LUT-only, ``-nodsp``), places and routes that netlist out of
context (no I/O buffers: the core's ports are internal to a board top) on an LFE5U-85F once
per placement seed (``--seeds``, default 1 2 3), and prints LUT4s, flip-flops, MULT18X18D,
DP16KD block RAMs and Fmax (the median over the seeds). ``--write`` also saves the table
under docs/reports/; ``--json FILE`` writes the figures for a machine:

- ``lut4``, ``ff``, ``dsp``, ``bram``: nextpnr's TRELLIS_COMB, TRELLIS_FF, MULT18X18D, DP16KD;
- ``fmax_mhz``: the median Fmax over the seeds; ``seeds``: ``[{seed, fmax_mhz}, ...]``;
- ``array_lut4``, ``lanes_lut4``: nextpnr's TRELLIS_COMB cells (``lut4``'s count) of the MAC
  array (the core's ``mac`` submodule) and of the normalizer and adder lanes (submodules named
  ``normalize<j>``, ``add<j>``), counted by their cells' hierarchical names in the first seed's
  routed netlist (``hbfp.hw.openflow.comb_cells_by_module``; the design is synthesized
  flattened, as the board builds are, and its cells keep the names of the modules they came
  from); ``share_outside_array_and_lanes`` = 1 - (array + lanes) / ``lut4``, all three
  nextpnr's; ``yosys_lut4``: Yosys' LUT4 + 2 x CCU2C of the whole core, before packing.

Needs the ``fpga`` extra: ``pip install -e .[fpga]``. The first YoWASP call takes about a
minute to prepare; synthesis of the 8x8 core takes minutes, each place and route longer
(about 10 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hbfp.hw.generate import generate
from hbfp.hw.openflow import ECP5, comb_cells_by_module, lut4_cells, pnr_ecp5, synth_ecp5, verilog_modules
from hbfp.hw.params import CoreConfig

from report import publish, verilog_logic  # benchmarks/report.py

ROOT = Path(__file__).resolve().parents[1]
#: The core's submodules measured within it: the MAC array, and the lanes (normalizers and fp32
#: adders, one of each per column), by the last part of their Amaranth path.
ARRAY_MODULE = re.compile(r"mac")
LANE_MODULES = re.compile(r"(normalize|add)\d*")


def measured_modules(names: list[str], pattern: re.Pattern) -> list[str]:
    """Modules whose last path component matches ``pattern``, leaving out those inside one."""
    hits = [n for n in names if "." in n and pattern.fullmatch(n.rsplit(".", 1)[1])]
    return [n for n in hits if not any(n.startswith(h + ".") for h in hits)]


def measure(cfg: CoreConfig, work: Path, seeds=(1, 2, 3), nodsp: bool = False, device: str = "85k",
            package: str = "CABGA381", freq: float = 100.0, *, reuse: bool = False, jobs: int = 1,
            published: Path | None = None, log=print) -> dict:
    """Synthesize the core of ``cfg`` once, place and route it once per seed in ``work``
    (``jobs`` seeds at a time); the figures ``--json`` writes (also saved as
    ``work/result.json``). ``reuse``: return the saved figures when the core's Verilog (its
    logic) and the options are those measured: ``work/result.json``'s, else those of
    ``published`` (a ``--json`` file, e.g. the one under docs/reports; the result then has
    ``"reused": str(published)``)."""
    generate(cfg, work, only=["gemm_core"], log=lambda s: None, platform=ECP5)
    src = work / "gemm_core.v"
    options = {"seeds": list(seeds), "nodsp": nodsp, "device": device, "package": package, "freq": freq,
               "verilog_sha256": hashlib.sha256(verilog_logic(src).encode()).hexdigest()}
    saved = work / "result.json"
    if reuse:
        for path in (saved, published):
            if path is not None and path.exists():
                res = json.loads(path.read_text())
                if res.get("options") == options:
                    log(f"reused {path}")
                    return res if path == saved else {**res, "reused": str(path)}
    names = verilog_modules(src)
    array, lanes = measured_modules(names, ARRAY_MODULE), measured_modules(names, LANE_MODULES)
    log(f"synth_ecp5{' -nodsp' if nodsp else ''} ...")
    synth = synth_ecp5(src, "gemm_core", work, nodsp=nodsp)
    def place_and_route(seed):
        log(f"nextpnr-ecp5 --{device} --out-of-context --seed {seed} ...")
        pnr = pnr_ecp5(synth["json"], work / f"seed{seed}", device, package, freq, seed, routed=seed == seeds[0])
        log(f"  seed {seed}: {pnr['fmax_min']:.1f} MHz ({pnr['seconds']:.0f} s)")
        return {"seed": seed, "fmax_mhz": pnr["fmax_min"], "utilization": pnr["utilization"],
                "seconds": pnr["seconds"]}

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:  # each seed a nextpnr process
        runs = list(pool.map(place_and_route, seeds))
    util = runs[0]["utilization"]  # packing comes before placement: the same for every seed
    # Packing comes before placement: every seed's netlist has the same cells.
    placed = comb_cells_by_module(work / f"seed{seeds[0]}" / "routed.json", {"array": array, "lanes": lanes})
    assert placed["all"] == util["TRELLIS_COMB"][0], (placed, util["TRELLIS_COMB"])
    res = {
        "config": {"rows": cfg.rows, "cols": cfg.cols, "size": cfg.size, "functions": list(cfg.built_functions),
                   "acc_lanes": cfg.acc_lanes, "out_lanes": cfg.out_lanes,
                   "nodsp": nodsp, "device": device, "package": package, "freq_mhz": freq},
        "lut4": util["TRELLIS_COMB"][0], "ff": util["TRELLIS_FF"][0], "dsp": util["MULT18X18D"][0],
        "bram": util["DP16KD"][0], "available": {k: util[k][1] for k in ("TRELLIS_COMB", "TRELLIS_FF",
                                                                         "MULT18X18D", "DP16KD")},
        "fmax_mhz": statistics.median(r["fmax_mhz"] for r in runs),
        "seeds": [{"seed": r["seed"], "fmax_mhz": r["fmax_mhz"]} for r in runs],
        "array_lut4": placed["array"], "lanes_lut4": placed["lanes"],
        "share_outside_array_and_lanes": placed["outside"] / placed["all"],
        "share_count": "nextpnr TRELLIS_COMB cells (LUT4s and carry halves, packed) by hierarchical name",
        "yosys_lut4": lut4_cells(synth["cells"]),
        "array_modules": array, "lanes_modules": lanes,
        "hierarchy": "synth_ecp5 flattened, as the board builds",
        "synth_seconds": synth["seconds"], "pnr_seconds": [r["seconds"] for r in runs],
        "stat": synth["stat"], "options": options,
    }
    saved.write_text(json.dumps(res, indent=1) + "\n")
    return res


def figures(res: dict) -> dict:
    """``measure``'s result without Yosys' statistics text: what ``--json`` writes."""
    return {k: v for k, v in res.items() if k != "stat"}


def table(res: dict, command: str) -> str:
    c = res["config"]
    names = {"TRELLIS_COMB": "lut4", "TRELLIS_FF": "ff", "MULT18X18D": "dsp", "DP16KD": "bram"}
    fmax = res["fmax_mhz"]
    seeds = ", ".join(f"{s['fmax_mhz']:.1f} (seed {s['seed']})" for s in res["seeds"])
    lines = [
        f"# ECP5 reading: {c['rows']}x{c['cols']} GEMM core, HBFP8, {c['size']}x{c['size']} buffers, "
        f"activations {', '.join(c['functions']) or 'none'}{', LUT-only' if c['nodsp'] else ''}",
        "",
        f"Command: `{command}`",
        f"(YoWASP Yosys `synth_ecp5{' -nodsp' if c['nodsp'] else ''}`, nextpnr-ecp5 out of context on "
        f"LFE5U-{c['device'].upper()} {c['package']}; synthesis {res['synth_seconds']:.0f} s, place and route "
        f"{' + '.join(f'{s:.0f}' for s in res['pnr_seconds'])} s).",
        "",
        "| resource | used | available | share |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {k} | {res[v]:,} | {res['available'][k]:,} | {100 * res[v] / res['available'][k]:.0f}% |"
              for k, v in names.items()]
    lines += [
        "",
        f"Fmax after place and route: **{fmax:.1f} MHz**, the median of {seeds} (target {c['freq_mhz']:g} MHz); "
        f"peak {c['rows'] * c['cols'] * fmax / 1e3:.2f} GMAC/s at that clock.",
        "",
        f"Within the core ({res['hierarchy']}), nextpnr's TRELLIS_COMB cells by their hierarchical names: "
        f"the MAC array {res['array_lut4']:,}, the {res['config'].get('acc_lanes', '')} normalizer and adder "
        f"lanes {res['lanes_lut4']:,}, of {res['lut4']:,}: {100 * res['share_outside_array_and_lanes']:.1f}% of the "
        f"logic is outside the array and the lanes (Yosys: {res['yosys_lut4']:,} LUT4 + 2 x CCU2C before packing).",
        "",
        "Yosys cell counts (before packing):", "", "```", res["stat"].strip(), "```", "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--cols", type=int, default=8)
    p.add_argument("--size", type=int, default=96)
    p.add_argument("--functions", nargs="+", default=["relu", "gelu"], help="activation units built (default relu gelu)")
    p.add_argument("--device", default="85k", help="nextpnr-ecp5 device option (default 85k)")
    p.add_argument("--package", default="CABGA381")
    p.add_argument("--freq", type=float, default=100.0, help="target clock in MHz")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3],
                   help="placement seeds, one place and route each on the same netlist (default 1 2 3)")
    p.add_argument("--no-dsp", action="store_true", help="LUT-only: synth_ecp5 -nodsp (for density comparisons)")
    p.add_argument("--jobs", type=int, default=1, help="seeds placed and routed at a time (default 1)")
    p.add_argument("--out", default="build/ecp5", help="work folder")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE")
    p.add_argument("--write", action="store_true", help="write docs/reports/ecp5-<config>.md")
    p.add_argument("--reuse", action="store_true", help="keep the saved figures if the Verilog and options are unchanged")
    args = p.parse_args(argv)

    cfg = CoreConfig(rows=args.rows, cols=args.cols, size=args.size, functions=tuple(args.functions))
    name = f"core-{cfg.rows}x{cfg.cols}-s{cfg.size}{'-lut' if args.no_dsp else ''}"
    res = measure(cfg, ROOT / args.out / name, args.seeds, args.no_dsp, args.device, args.package, args.freq,
                  reuse=args.reuse, jobs=args.jobs, log=lambda s: print(f"{name}: {s}", flush=True))
    command = (f"python benchmarks/ecp5_area.py --rows {cfg.rows} --cols {cfg.cols} --size {cfg.size} "
               f"--functions {' '.join(args.functions)} --device {args.device} --freq {args.freq:g} "
               f"--seeds {' '.join(map(str, args.seeds))}{' --no-dsp' if args.no_dsp else ''}")
    publish(table(res, command), f"ecp5-{name}.md", args.write)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures(res), indent=1) + "\n")
        print(f"written {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
