"""Performance of HBFP emulation, each figure beside its fp32 baseline run in the same process
(``make bench``). Prints, from one run:

- training steps (median over interleaved rounds: each round runs one step of every variant):
  an MLP 256-512-512-10 (batch 128), the digits CNN of ``hbfp train`` (batch 64) and a
  transformer block (``nn.TransformerEncoderLayer`` d64, 4 heads, feed-forward 256, and a
  linear head; 16 sequences of 32 tokens), in fp32, in HBFP8 on ``emu`` (products computed
  in-process) and in HBFP8 on ``emu:wire=1`` (through the wire protocol and the device's
  tiling), with the ratios to fp32 (every forward and backward product that ``hbfp.torch``
  routes runs in HBFP8: linear layers, matrix products, convolutions swapped in by
  ``convert``);
- the golden model's HBFP8 ``gemm`` (operands already quantized) against NumPy's fp32
  ``matmul`` at 512^3 and 1024^3 (best of interleaved calls), with the quantization of both
  operands, and without the compiled kernels (``hbfp.golden.native.disabled()``: the portable
  path of NumPy BLAS products per K-tile);
- ``quantize`` throughput per rounding mode: the compiled kernel (which ``hbfp.golden.quantize``
  and ``hbfp.golden.kernels.quantize`` run for a CPU matrix), the NumPy model's bands (without
  it) and the kernels' torch operations (what runs on a GPU), in elements per second;
- the peak memory the golden model allocates (NumPy's allocations, ``tracemalloc``) for a
  1024^3 and a 4096x4096x1024 product, quantization of the operands included, against the
  bytes of its fp32 operands and result.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import tracemalloc

import numpy as np
import torch
from threadpoolctl import threadpool_info

from hbfp import host
from hbfp.golden import HBFP8, MXINT8, quantize
from hbfp.golden import kernels, native
from hbfp.golden.gemm import gemm


def best_of(fns: dict, repeats: int, alternate: bool = False) -> dict:
    """Best wall time of each function over ``repeats`` calls after a warm-up call; with
    ``alternate`` the functions take turns (each also pays for what the others leave running)."""
    best = {name: float("inf") for name in fns}

    def run(name, fn):
        t0 = time.perf_counter()
        fn()
        best[name] = min(best[name], time.perf_counter() - t0)

    for fn in fns.values():
        fn()  # warm-up: thread pools, page faults, BLAS buffers
    if alternate:
        for _ in range(repeats):
            for name, fn in fns.items():
                run(name, fn)
    else:
        for name, fn in fns.items():
            for _ in range(repeats):
                run(name, fn)
    return best


# ---- training steps ---------------------------------------------------------------------

def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 10))
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(128, 256, generator=g), torch.randint(0, 10, (128,), generator=g)


def _cnn():
    from hbfp.train import load_digits_split, make_model

    x, y, _, _ = load_digits_split(0)
    return make_model("cnn", 0), x[:64], y[:64]


class _Transformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = torch.nn.TransformerEncoderLayer(64, 4, dim_feedforward=256, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.block(x).mean(dim=1))


def _transformer():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return _Transformer(), torch.randn(16, 32, 64, generator=g), torch.randint(0, 10, (16,), generator=g)


MODELS = {"MLP 256-512-512-10, batch 128": _mlp, "digits CNN, batch 64": _cnn,
          "transformer block d64, 16x32 tokens": _transformer}


def _stepper(make, spec: str | None):
    """One training step of a fresh copy of the model: fp32 (``spec`` None) or HBFP8 on the
    device ``spec`` (``convert`` for its layers, ``offload`` for the rest: attention)."""
    import hbfp.torch as ht

    model, x, y = make()
    dev = None
    if spec is not None:
        import warnings

        dev = host.open(spec)
        with warnings.catch_warnings():  # the transformer's attention: the steps run under offload
            warnings.simplefilter("ignore", ht.HbfpFallbackWarning)
            ht.convert(model, dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        opt.zero_grad()
        if dev is None:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
        else:
            with ht.offload(dev):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
        opt.step()

    return step


def bench_steps(rounds: int, wire: bool) -> list[tuple[str, dict, float]]:
    """The steps' medians per model, and the share of the HBFP steps' MACs that ran on the
    device (``hbfp.torch.report()``)."""
    import hbfp.torch as ht

    out = []
    for name, make in MODELS.items():
        variants = {"fp32": _stepper(make, None), "hbfp8": _stepper(make, "emu")}
        if wire:
            variants["hbfp8 wire"] = _stepper(make, "emu:wire=1")
        times = {k: [] for k in variants}
        for fn in variants.values():
            fn()  # warm-up
        ht.reset_report()
        for _ in range(rounds):
            for k, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        counts = ht.report().values()
        device = sum(c.device_macs for c in counts)
        share = device / max(1, device + sum(c.host_macs for c in counts))
        out.append((name, {k: statistics.median(v) for k, v in times.items()}, share))
    return out


# ---- the golden model -------------------------------------------------------------------

def bench_gemm(n: int, repeats: int, rng) -> dict:
    a = rng.standard_normal((n, n)).astype(np.float32)
    b = rng.standard_normal((n, n)).astype(np.float32)
    qa, qb = quantize(a, HBFP8), quantize(b, HBFP8)

    def portable():
        with native.disabled():
            gemm(qa, qb)

    fns = {"fp32": lambda: np.matmul(a, b), "hbfp8": lambda: gemm(qa, qb),
           "hbfp8+q": lambda: gemm(quantize(a, HBFP8), quantize(b, HBFP8))}
    if native.available():
        fns["portable"] = portable
    return best_of(fns, repeats, alternate=True)


def bench_quantize(shape, repeats: int, rng) -> dict:
    x = rng.standard_normal(shape).astype(np.float32)
    xt = torch.from_numpy(x)
    fmts = {"HBFP8 nearest_even": HBFP8, "HBFP8 toward_zero": HBFP8.with_rounding("toward_zero"),
            "HBFP8 stochastic": HBFP8.with_rounding("stochastic"), "MXINT8 nearest_even": MXINT8}
    def bands(f):
        with native.disabled():
            quantize(x, f, seed=1)

    fns = {}
    for name, f in fmts.items():
        if native.available():
            fns[(name, "native")] = lambda f=f: quantize(x, f, seed=1)
        fns[(name, "numpy")] = lambda f=f: bands(f)
        fns[(name, "torch")] = lambda f=f: kernels.quantize(xt, f, seed=1, impl="torch")
    return best_of(fns, repeats)


def peak_memory(m: int, k: int, n: int, rng) -> tuple[int, int]:
    """(peak bytes NumPy allocates for quantize + gemm of m x k by k x n, bytes of the fp32
    operands and result)."""
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    tracemalloc.start()
    tracemalloc.reset_peak()
    gemm(quantize(a, HBFP8), quantize(b, HBFP8))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak, 4 * (m * k + k * n + m * n)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rounds", type=int, default=20, help="interleaved rounds of training steps (default 20)")
    p.add_argument("--no-wire", action="store_true", help="leave out the wire path's training steps")
    p.add_argument("--quantize-shape", type=int, nargs=2, default=[2048, 2048], metavar=("ROWS", "COLS"))
    p.add_argument("--memory", type=int, nargs=3, action="append", metavar=("M", "K", "N"),
                   help="products whose peak memory to measure (default 1024^3 and 4096x4096x1024)")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    blas = ", ".join(f"{i['internal_api']} {i.get('version')} ({i['num_threads']} threads)"
                     for i in threadpool_info() if i["user_api"] == "blas")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; numpy {np.__version__}; "
          f"BLAS: {blas}; torch {torch.__version__} ({torch.get_num_threads()} threads)")

    print("\ntraining steps (median of interleaved rounds)")
    print(f"{'model':>38} {'fp32':>9} {'hbfp8 emu':>10} {'ratio':>7}" + ("" if args.no_wire else
                                                                         f" {'hbfp8 wire':>11} {'ratio':>7}"))
    shares = []
    for name, t, share in bench_steps(args.rounds, not args.no_wire):
        line = f"{name:>38} {t['fp32'] * 1e3:>7.2f}ms {t['hbfp8'] * 1e3:>8.2f}ms {t['hbfp8'] / t['fp32']:>6.1f}x"
        if "hbfp8 wire" in t:
            line += f" {t['hbfp8 wire'] * 1e3:>9.2f}ms {t['hbfp8 wire'] / t['fp32']:>6.1f}x"
        print(line)
        shares.append(f"{name} {100 * share:.1f}%")
    print("MACs of the HBFP steps on the device (hbfp.torch.report): " + ", ".join(shares))

    print(f"\ncompiled kernels (hbfp.golden.native): {'loaded' if native.available() else native.why()}")
    print("\nHBFP8 gemm (24x24 tiles, fp32 accumulation in K-tile order) vs numpy fp32 matmul, interleaved;"
          "\n'portable': the same gemm without the compiled kernels (NumPy BLAS per K-tile)")
    print(f"{'size':>10} {'fp32 matmul':>12} {'hbfp8 gemm':>12} {'ratio':>7} {'gemm+quantize':>14} {'ratio':>7}"
          f" {'portable':>10} {'ratio':>7}")
    for n in args.sizes:
        t = bench_gemm(n, args.repeats, rng)
        line = (f"{f'{n}^3':>10} {t['fp32'] * 1e3:>10.2f}ms {t['hbfp8'] * 1e3:>10.2f}ms "
                f"{t['hbfp8'] / t['fp32']:>6.2f}x {t['hbfp8+q'] * 1e3:>12.2f}ms {t['hbfp8+q'] / t['fp32']:>6.2f}x")
        if "portable" in t:
            line += f" {t['portable'] * 1e3:>8.2f}ms {t['portable'] / t['fp32']:>6.2f}x"
        print(line)

    shape = tuple(args.quantize_shape)
    print(f"\nquantize throughput ({shape[0]}x{shape[1]} fp32), M elements/s: the compiled kernel (what "
          "hbfp.golden.quantize and hbfp.golden.kernels.quantize run for a CPU matrix), the NumPy model's "
          "bands (without it) and the kernels' torch operations (what runs on a GPU)")
    q = bench_quantize(shape, args.repeats, rng)
    impls = [i for i in ("native", "numpy", "torch") if any(k[1] == i for k in q)]
    print(f"{'format and rounding':>22}" + "".join(f" {i:>9}" for i in impls))
    for name in dict.fromkeys(k for k, _ in q):
        print(f"{name:>22}" + "".join(f" {shape[0] * shape[1] / q[(name, i)] / 1e6:>9.1f}" for i in impls))

    print("\npeak memory of the golden model's product (quantize both operands, then gemm; NumPy's "
          "allocations; the compiled kernel packs at most 0.6 MiB of operands per thread besides)")
    for m, k, n in args.memory or [(1024, 1024, 1024), (4096, 4096, 1024)]:
        peak, data = peak_memory(m, k, n, rng)
        print(f"{f'{m}x{k}x{n}':>16}: {peak / 2**20:8.1f} MiB allocated at the peak, {peak / data:.2f}x the "
              f"{data / 2**20:.1f} MiB of fp32 operands and result")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
