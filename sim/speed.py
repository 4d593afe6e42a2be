"""Simulation speed of the cocotb regression, per simulator (``python -m hbfp.sim.speed``).

Sums the cycles simulated and the seconds spent in the tests (builds excluded) that
``hbfp.sim.runner`` logged in ``build/sim/speed.jsonl``, and lists the figures testbenches
recorded (``build/sim/figures.jsonl``); ``--clear`` starts new logs.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from hbfp.sim.runner import FIGURES_LOG, SPEED_LOG


def summarize(rows: list[dict]) -> dict:
    total = defaultdict(lambda: [0.0, 0.0])
    per_top = defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        total[r["sim"]][0] += r["cycles"]
        total[r["sim"]][1] += r["seconds"]
        per_top[(r["sim"], r["toplevel"])][0] += r["cycles"]
        per_top[(r["sim"], r["toplevel"])][1] += r["seconds"]
    return {"total": dict(total), "per_toplevel": dict(per_top)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--clear", action="store_true", help="empty the log")
    args = p.parse_args(argv)
    if args.clear:
        SPEED_LOG.unlink(missing_ok=True)
        FIGURES_LOG.unlink(missing_ok=True)
        return 0
    if not SPEED_LOG.exists():
        print(f"no runs logged in {SPEED_LOG}: run `make sim` first")
        return 1
    rows = [json.loads(line) for line in SPEED_LOG.read_text().splitlines() if line.strip()]
    s = summarize(rows)
    print(f"{'simulator':<10} {'component':<16} {'cycles':>12} {'seconds':>9} {'cycles/s':>10}")
    for (sim, top), (cyc, sec) in sorted(s["per_toplevel"].items()):
        print(f"{sim:<10} {top:<16} {cyc:>12,.0f} {sec:>9.1f} {cyc / max(sec, 1e-9):>10,.0f}")
    for sim, (cyc, sec) in sorted(s["total"].items()):
        print(f"{sim:<10} {'(all)':<16} {cyc:>12,.0f} {sec:>9.1f} {cyc / max(sec, 1e-9):>10,.0f}")
    if FIGURES_LOG.exists():
        print()
        for line in FIGURES_LOG.read_text().splitlines():
            f = json.loads(line)
            if f.get("figure") == "utilization":
                print(f"utilization {f['m']}x{f['n']}x{f['k']} on {f['rows']}x{f['cols']} (tile {f['tile'][0]}x{f['tile'][1]}): "
                      f"{f['cycles']} cycles, ideal {f['ideal']:.0f}: {100 * f['utilization']:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
