"""Data-parallel training with and without compressed gradients (``make scaleout``): runs
``hbfp train --nproc N --grad-compression C`` for each C and prints one table of every run
(accuracy, bytes each rank sent in gradient exchanges, their ratio to fp32 all-reduce, whether
the ranks ended equal, seconds). Each run's own report lands in OUT/C/."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--optimizers", nargs="+", default=["sgd"], help="hbfp train's optimizers (default sgd)")
    p.add_argument("--compressions", nargs="+", default=["none", "hbfp8", "mxint8"])
    p.add_argument("-o", "--out", default="build/scaleout")
    args = p.parse_args(argv)
    rows, ok = [], True
    for comp in args.compressions:
        out = Path(args.out) / comp
        print(f"== --nproc {args.nproc} --grad-compression {comp}", flush=True)
        r = subprocess.run([sys.executable, "-m", "hbfp.cli", "train", "--nproc", str(args.nproc), "--grad-compression",
                            comp, "--models", *args.models, "--optimizers", *args.optimizers, "--epochs",
                            str(args.epochs), "--sim-epochs", "0", "-o", str(out)])
        if r.returncode:
            print(f"the run with --grad-compression {comp} failed (exit {r.returncode})", file=sys.stderr)
            ok = False
            continue
        rows += json.loads((out / "runs.json").read_text())
    base = {(x["model"], x["precision"]): x["allreduce_bytes"] for x in rows if x["grad_compression"] == "none"}
    print(f"\n{args.nproc} ranks, {args.epochs} epochs\n")
    print("| model | products | gradients | test accuracy | bytes sent per rank | vs fp32 all-reduce | ranks equal | seconds |")
    print("|---|---|---|---:|---:|---:|---|---:|")
    for x in rows:
        b = base.get((x["model"], x["precision"]))
        ratio = f"{b / x['allreduce_bytes']:.2f}x fewer" if b and x["grad_compression"] != "none" else ""
        print(f"| {x['model']} | {x['precision']} | {x['grad_compression']} | {100 * x['test_accuracy']:.2f}% | "
              f"{x['allreduce_bytes']:,} | {ratio} | {'yes' if x['params_equal_across_ranks'] else 'NO'} | "
              f"{x['seconds']:.1f} |")
        ok &= bool(x["params_equal_across_ranks"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
