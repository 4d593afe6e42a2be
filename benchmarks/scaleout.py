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


def _overlap_rank(rank, world, port, rounds, out):
    """One rank of the overlap measurement: the same DDP model twice, its exchange overlapped
    with backward and in the hook, steps alternating between the two; rank 0 writes the
    median step of each."""
    import os
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from hbfp import distributed as hd

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    steps = {}
    for overlap in (True, False):
        model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                    torch.nn.ReLU(), torch.nn.Linear(2048, 10))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        hd.attach(ddp, "hbfp8", overlap=overlap)
        steps[overlap] = (ddp, torch.optim.SGD(model.parameters(), lr=0.01), [])
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 1024, generator=g), torch.randint(0, 10, (64,), generator=g)
    for i in range(rounds + 2):
        for overlap, (ddp, opt, times) in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            if i >= 2:
                times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({str(k): statistics.median(v[2]) for k, v in steps.items()}))
    dist.destroy_process_group()
    hd.exit_rank(0)


def overlap(rounds: int = 40) -> dict:
    """The median step of a 6.3 M-parameter MLP (several DDP buckets) on 2 ranks, HBFP8
    two-step exchange overlapped with backward or not: {"True": s, "False": s}."""
    import tempfile

    import torch.multiprocessing as mp

    from hbfp import distributed as hd

    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "overlap.json")
        mp.spawn(_overlap_rank, args=(2, hd.free_port(), rounds, out), nprocs=2, join=True)
        return json.loads(Path(out).read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 3, 4], help="numbers of ranks (default 2 3 4)")
    p.add_argument("--models", nargs="+", default=["mlp", "cnn", "charlm"])
    p.add_argument("--epochs", type=int, default=None, help="epochs (default: hbfp train's per model)")
    p.add_argument("--optimizers", nargs="+", default=["adamw"], help="hbfp train's optimizers (default adamw)")
    p.add_argument("--exchanges", nargs="+", default=list(EXCHANGES), choices=list(EXCHANGES))
    p.add_argument("-o", "--out", default="build/scaleout")
    p.add_argument("--json", help="also write every run (runs.json's fields plus the exchange) to this file")
    p.add_argument("--overlap", action="store_true",
                   help="instead: the median step of a 6.3 M-parameter MLP on 2 ranks, its HBFP8 exchange overlapped "
                   "with backward and not, steps alternating")
    p.add_argument("--rounds", type=int, default=40, help="--overlap: measured steps of each (default 40)")
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error("--rounds: at least 3 steps of each")
    if args.overlap:
        t = overlap(args.rounds)
        print(f"2 ranks, MLP 1024-2048-2048-10, batch 64, HBFP8 two-step exchange: median step "
              f"{1000 * t['True']:.1f} ms overlapped, {1000 * t['False']:.1f} ms in the hook "
              f"({t['True'] / t['False']:.2f}x)")
        return 0
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
