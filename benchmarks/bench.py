"""Performance of HBFP emulation, every figure beside its fp32 baseline measured in the same run
(``make bench``; ``make bench JSON=FILE`` also writes them to FILE). Prints:

- training steps (SGD, cross-entropy) of five models in fp32 and in HBFP8 under
  ``hbfp.torch.offload(hbfp.host.open("emu"))``, at 1 and at 2 threads: an MLP 256-512-512-10
  (batch 128), an MLP 1024-2048-2048-10 (batch 256), a 2-layer TransformerEncoder (d128, 4
  heads, 32 sequences of 64 tokens), a CNN (3 -> 32 -> 64 channels, 32x32 images, batch 32) and
  a 2-layer LSTM (128 -> 256, 32 sequences of 64 tokens). Each figure is the median over
  interleaved rounds (a round runs one fp32 step, then one HBFP8 step) of the step's time, and
  the ratio is of the two medians;
- the same steps at 2 threads with another process busy on core 0 (pinned there);
- the HBFP8 steps compiled (``torch.compile``) against eager, under ``offload``, beside the same
  fp32 steps compiled against eager (what Inductor saves on that model here);
- the golden model's HBFP8 ``gemm`` (``hbfp.golden.gemm.gemm``, operands quantized) of
  1024^3 against NumPy's fp32 ``matmul``, at 1 and 2 threads (best of interleaved calls), and
  the kernel that ran it;
- ``quantize`` throughput per rounding mode and implementation.

The machine line gives the CPU, its features as the kernels read them (``hbfp.kernels.build``)
and the kernel implementation each product used (``hbfp.kernels.resolve``). Steps are timed as
``../shared/checks/faster.py`` times them, with the same models and seeds.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import warnings

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from threadpoolctl import threadpool_info, threadpool_limits

from hbfp import host, kernels
from hbfp.golden import HBFP8, MXINT8, quantize
from hbfp.golden.gemm import gemm
from hbfp.kernels import build


# ---- the models ---------------------------------------------------------------------------

class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(100, 128)
        self.t = nn.TransformerEncoder(nn.TransformerEncoderLayer(128, 4, 512, batch_first=True, dropout=0.0), 2)
        self.o = nn.Linear(128, 100)

    def forward(self, x):
        return self.o(self.t(self.e(x))).mean(1)


class _CharLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(100, 128)
        self.l = nn.LSTM(128, 256, 2, batch_first=True)
        self.o = nn.Linear(256, 100)

    def forward(self, x):
        return self.o(self.l(self.e(x))[0]).mean(1)


def models() -> dict:
    """Name: (model, inputs, targets), all from seed 0 (the acceptance check's)."""
    torch.manual_seed(0)
    return {
        "lstm": (_CharLSTM(), torch.randint(0, 100, (32, 64)), torch.randint(0, 100, (32,))),
        "mlp": (nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)),
                torch.randn(128, 256), torch.randint(0, 10, (128,))),
        "big mlp": (nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                                  nn.Linear(2048, 10)), torch.randn(256, 1024), torch.randint(0, 10, (256,))),
        "transformer": (_Encoder(), torch.randint(0, 100, (32, 64)), torch.randint(0, 100, (32,))),
        "cnn": (nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)),
                torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))),
    }


DESCRIPTIONS = {
    "mlp": "MLP 256-512-512-10, batch 128",
    "big mlp": "MLP 1024-2048-2048-10, batch 256",
    "transformer": "TransformerEncoder 2 layers d128, 32x64 tokens",
    "cnn": "CNN 3->32->64, 32x32 images, batch 32",
    "lstm": "LSTM 2 layers 128->256, 32x64 tokens",
}


def stepper(model, x, y, device, compiled: bool = False):
    import hbfp.torch as ht

    m = torch.compile(model) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        if device is None:
            loss = F.cross_entropy(m(x), y)
            loss.backward()
        else:
            with ht.offload(device):
                loss = F.cross_entropy(m(x), y)
                loss.backward()
        opt.step()
        return loss.detach()

    return step


def ratio(slow, fast, rounds: int) -> tuple[float, float, float]:
    """(median of fast's times, median of slow's, their ratio) over interleaved rounds."""
    for _ in range(2):
        fast()
        slow()
    tf, ts = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fast()
        t1 = time.perf_counter()
        slow()
        t2 = time.perf_counter()
        tf.append(t1 - t0)
        ts.append(t2 - t1)
    f, s = statistics.median(tf), statistics.median(ts)
    return f, s, s / f


def _busy():
    os.sched_setaffinity(0, {0})
    t = time.time()
    while time.time() - t < 3600:
        pass


def bench_steps(rounds: int, threads: int, names) -> dict:
    torch.set_num_threads(threads)
    dev = host.open("emu")
    out = {}
    with threadpool_limits(threads):
        for name, (base, x, y) in models().items():
            if name not in names:
                continue
            f, s, r = ratio(stepper(copy.deepcopy(base), x, y, dev), stepper(copy.deepcopy(base), x, y, None), rounds)
            out[name] = {"fp32_ms": f * 1e3, "hbfp8_ms": s * 1e3, "ratio": r}
            print(f"  {DESCRIPTIONS[name]:>48} {threads}t  fp32 {f * 1e3:8.2f} ms  hbfp8 {s * 1e3:8.2f} ms  "
                  f"{r:5.2f}x", flush=True)
    return out


def bench_compile(rounds: int, names) -> dict:
    torch.set_num_threads(2)
    dev = host.open("emu")
    out = {}
    for name in ("mlp", "transformer"):
        if name not in names:
            continue
        base, x, y = models()[name]
        eager, compiled = stepper(copy.deepcopy(base), x, y, dev), stepper(copy.deepcopy(base), x, y, dev, True)
        same = all(torch.equal(a, b) for a, b in zip([eager() for _ in range(3)], [compiled() for _ in range(3)]))
        e, c, r = ratio(compiled, eager, rounds)
        # the baseline: torch.compile of the same fp32 step, no offload (what Inductor itself
        # saves or costs on this model and machine)
        fe, fc, fr = ratio(stepper(copy.deepcopy(base), x, y, None, True), stepper(copy.deepcopy(base), x, y, None),
                           rounds)
        out[name] = {"eager_ms": e * 1e3, "compiled_ms": c * 1e3, "ratio": r, "same_bits": same,
                     "fp32_eager_ms": fe * 1e3, "fp32_compiled_ms": fc * 1e3, "fp32_ratio": fr}
        print(f"  {DESCRIPTIONS[name]:>48}  eager {e * 1e3:8.2f} ms  compiled {c * 1e3:8.2f} ms  {r:5.2f}x  "
              f"{'same bits' if same else 'BITS DIFFER'}", flush=True)
        print(f"  {'the same in fp32, no offload':>48}  eager {fe * 1e3:8.2f} ms  compiled {fc * 1e3:8.2f} ms  "
              f"{fr:5.2f}x", flush=True)
    return out


def bench_gemm(n: int, repeats: int) -> dict:
    out = {}
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(np.float32)
    b = rng.standard_normal((n, n)).astype(np.float32)
    qa, qb = quantize(a, HBFP8), quantize(b, HBFP8)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        with threadpool_limits(threads):
            tg, tf = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                gemm(qa, qb)
                t1 = time.perf_counter()
                a @ b
                t2 = time.perf_counter()
                tg.append(t1 - t0)
                tf.append(t2 - t1)
            g, f = min(tg[1:]), min(tf[1:])
            out[f"{threads}t"] = {"hbfp8_ms": g * 1e3, "numpy_fp32_ms": f * 1e3, "ratio": g / f,
                                  "hbfp8_gmacs": n**3 / g / 1e9, "numpy_fp32_gmacs": n**3 / f / 1e9}
            print(f"  {n}^3 {threads}t: hbfp8 gemm {g * 1e3:8.2f} ms ({n**3 / g / 1e9:5.1f} GMAC/s), numpy fp32 "
                  f"{f * 1e3:8.2f} ms ({n**3 / f / 1e9:5.1f} GMAC/s): {g / f:5.2f}x", flush=True)
    return out


def bench_quantize(shape, repeats: int) -> dict:
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32)
    xt = torch.from_numpy(x)
    fmts = {"HBFP8 nearest_even": HBFP8, "HBFP8 toward_zero": HBFP8.with_rounding("toward_zero"),
            "HBFP8 stochastic": HBFP8.with_rounding("stochastic"), "MXINT8 nearest_even": MXINT8}
    impls = [i for i in (*kernels.COMPILED, "reference", "torch") if kernels.available(i)]
    out = {}
    torch.set_num_threads(1)
    for name, fmt in fmts.items():
        row = {}
        for impl in impls:
            def run(fmt=fmt, impl=impl):
                kernels.quantize(xt if impl == "torch" else x, fmt, seed=1, impl=impl, threads=1)
            run()
            best = min(_timed(run) for _ in range(repeats))
            row[impl] = x.size / best / 1e6
        out[name] = row
        print(f"  {name:>22}" + "".join(f"  {impl} {v:8.1f}" for impl, v in row.items()), flush=True)
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds per step figure (default 15)")
    p.add_argument("--repeats", type=int, default=6,
                   help="calls per gemm and quantize figure, the first a warm-up (default 6, at least 2)")
    p.add_argument("--models", nargs="+", default=list(DESCRIPTIONS), choices=list(DESCRIPTIONS))
    p.add_argument("--no-load", action="store_true", help="leave out the steps beside a busy process")
    p.add_argument("--no-compile", action="store_true", help="leave out torch.compile")
    p.add_argument("--size", type=int, default=1024, help="the gemm's side (default 1024)")
    p.add_argument("--quantize-shape", type=int, nargs=2, default=[2048, 2048], metavar=("ROWS", "COLS"))
    p.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.repeats < 2 or args.size < 1 or min(args.quantize_shape) < 1:
        p.error("--rounds, --size and --quantize-shape take positive numbers, --repeats at least 2 (the first "
                "call of a figure warms up and is not timed)")
    warnings.simplefilter("ignore")
    blas = ", ".join(f"{i['internal_api']} {i.get('version')}" for i in threadpool_info() if i["user_api"] == "blas")
    impl = kernels.resolve(None)
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "features": sorted(build.features()), "kernel": impl, "kernel_why_not": {
                   v: kernels.why(v) for v in kernels.COMPILED if not kernels.available(v)},
               "numpy": np.__version__, "blas": blas, "torch": torch.__version__, "python": platform.python_version()}
    try:
        machine["model_name"] = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                                     if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"machine: {machine.get('model_name', machine['cpu'])}, {machine['cores']} cores, features "
          f"{', '.join(machine['features']) or 'none'}; products by the {impl!r} kernels; numpy {np.__version__} "
          f"({blas}); torch {torch.__version__}", flush=True)
    result = {"machine": machine}

    print("\ntraining steps (medians over interleaved rounds; hbfp8 = offload(open('emu')))")
    result["steps"] = {f"{t}t": bench_steps(args.rounds, t, args.models) for t in (1, 2)}
    if not args.no_load:
        print("\nthe same at 2 threads, another process busy on core 0")
        proc = mp.get_context("spawn").Process(target=_busy, daemon=True)
        proc.start()
        try:
            time.sleep(1)
            result["steps"]["loaded"] = bench_steps(max(5, args.rounds // 2), 2, args.models)
        finally:
            proc.terminate()
            proc.join()
    if not args.no_compile:
        print("\ntorch.compile under offload (2 threads)")
        result["compile"] = bench_compile(args.rounds, args.models)
    print(f"\nthe golden model's HBFP8 gemm (hbfp.golden.gemm.gemm, the {impl!r} kernels) vs numpy fp32 matmul")
    result["gemm"] = {str(args.size): bench_gemm(args.size, args.repeats)}
    shape = tuple(args.quantize_shape)
    print(f"\nquantize throughput ({shape[0]}x{shape[1]} fp32, one thread), M elements/s")
    result["quantize"] = bench_quantize(shape, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
