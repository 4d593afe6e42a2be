"""Data-parallel training with fp32 and compressed gradient exchanges (``make scaleout``): runs
``hbfp train --nproc N`` for each number of ranks and each exchange, and prints one table of
every run: accuracy (or the language model's validation loss), the bytes rank 0 sent in
gradient exchanges, their ratio to a fp32 ring all-reduce of the same buckets, whether the
ranks ended equal, and the median training step. Each run's own report lands in
OUT/N<ranks>/<exchange>/.

The exchanges (``--exchanges``): ``fp32`` (DDP's all-reduce), ``gather`` (HBFP8, one step:
an all-gather of every rank's codes), ``hbfp8`` and ``mxint8`` (two steps: all-to-all, a sum
per shard, all-gather), ``hbfp8-ef`` and ``mxint8-ef`` (the same with error feedback), and
``hbfp8-sync`` (two steps in the hook, not overlapped with backward)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

#: hbfp train's options of each exchange
EXCHANGES = {
    "fp32": ["--grad-compression", "none"],
    "gather": ["--grad-compression", "hbfp8", "--grad-exchange", "gather"],
    "hbfp8": ["--grad-compression", "hbfp8"],
    "hbfp8-ef": ["--grad-compression", "hbfp8", "--error-feedback"],
    "hbfp8-sync": ["--grad-compression", "hbfp8", "--no-grad-overlap"],
    "mxint8": ["--grad-compression", "mxint8"],
    "mxint8-ef": ["--grad-compression", "mxint8", "--error-feedback"],
}


def _result(x) -> str:
    if x.get("val_loss") == x.get("val_loss") and x.get("val_losses"):  # a language model
        return f"val loss {x['val_loss']:.4f}"
    return f"{100 * x['test_accuracy']:.2f}%"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 3, 4], help="numbers of ranks (default 2 3 4)")
    p.add_argument("--models", nargs="+", default=["mlp", "cnn", "charlm"])
    p.add_argument("--epochs", type=int, default=None, help="epochs (default: hbfp train's per model)")
    p.add_argument("--optimizers", nargs="+", default=["adamw"], help="hbfp train's optimizers (default adamw)")
    p.add_argument("--exchanges", nargs="+", default=list(EXCHANGES), choices=list(EXCHANGES))
    p.add_argument("-o", "--out", default="build/scaleout")
    p.add_argument("--json", help="also write every run (runs.json's fields plus the exchange) to this file")
    args = p.parse_args(argv)
    if any(n < 2 for n in args.nproc):
        p.error("--nproc: data-parallel runs need at least 2 ranks")
    rows, ok = [], True
    for n in args.nproc:
        for name in args.exchanges:
            out = Path(args.out) / f"N{n}" / name
            print(f"== {n} ranks, exchange {name}", flush=True)
            cmd = [sys.executable, "-m", "hbfp.cli", "train", "--nproc", str(n), *EXCHANGES[name], "--models",
                   *args.models, "--optimizers", *args.optimizers, "--sim-epochs", "0", "-o", str(out)]
            if args.epochs is not None:
                cmd += ["--epochs", str(args.epochs)]
            r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if r.returncode:
                print(f"the run with {n} ranks and exchange {name} failed (exit {r.returncode}): "
                      f"{r.stderr.strip()[-500:]}", file=sys.stderr)
                ok = False
                continue
            rows += [{**x, "exchange": name} for x in json.loads((out / "runs.json").read_text())]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print("\n| ranks | model | products | exchange | result | bytes sent (rank 0) | vs fp32 ring | ranks equal "
          "| step (median) |")
    print("|---:|---|---|---|---:|---:|---:|---|---:|")
    for x in rows:
        ratio = x["allreduce_bytes_fp32_ring"] / x["allreduce_bytes"] if x["allreduce_bytes"] else float("nan")
        print(f"| {x['nproc']} | {x['model']} {x['optimizer']} | {x['precision']} | {x['exchange']} | {_result(x)} | "
              f"{x['allreduce_bytes']:,} | {ratio:.2f}x fewer | {'yes' if x['params_equal_across_ranks'] else 'NO'} | "
              f"{1000 * x['step_seconds']:.1f} ms |")
        ok &= bool(x["params_equal_across_ranks"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
