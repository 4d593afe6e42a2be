"""Golden-model performance, run side by side with its NumPy fp32 baseline (`make bench`).

Prints, from one run:
- HBFP8 ``gemm`` (operands already quantized) against ``numpy.matmul`` in fp32 at 512^3 and
  1024^3: the time of each (best of several interleaved runs) and the ratio;
- the same with the quantization of both operands included, and the gemm ratio when the two
  calls alternate (each then also pays for what the other leaves running);
- ``quantize`` throughput in elements per second for HBFP8, MXINT8 and stochastic HBFP8.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np
from threadpoolctl import threadpool_info

from hbfp.golden import HBFP8, MXINT8, quantize
from hbfp.golden.gemm import gemm


def best_of(fns: dict, repeats: int, alternate: bool = False) -> dict:
    """Best wall time of each function over ``repeats`` calls after a warm-up call.

    By default each function runs its calls back to back (its steady state). With
    ``alternate`` the functions take turns, which also charges each with what the others
    leave behind (for example BLAS threads still spinning after a NumPy matmul)."""
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


def bench_gemm(n: int, repeats: int, rng) -> dict:
    a = rng.standard_normal((n, n)).astype(np.float32)
    b = rng.standard_normal((n, n)).astype(np.float32)
    qa, qb = quantize(a, HBFP8), quantize(b, HBFP8)
    fns = {
        "fp32": lambda: np.matmul(a, b),
        "hbfp8": lambda: gemm(qa, qb),
        "hbfp8+q": lambda: gemm(quantize(a, HBFP8), quantize(b, HBFP8)),
    }
    t = best_of(fns, repeats)
    alt = best_of({k: fns[k] for k in ("fp32", "hbfp8")}, repeats, alternate=True)
    t["alternating"] = alt["hbfp8"] / alt["fp32"]
    return t


def bench_quantize(shape, repeats: int, rng) -> dict:
    x = rng.standard_normal(shape).astype(np.float32)
    fmts = {"HBFP8": HBFP8, "MXINT8": MXINT8, "HBFP8 stochastic": HBFP8.with_rounding("stochastic")}
    return best_of({name: (lambda f=f: quantize(x, f, seed=1)) for name, f in fmts.items()}, repeats)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quantize-shape", type=int, nargs=2, default=[2048, 2048], metavar=("ROWS", "COLS"))
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)

    blas = ", ".join(f"{i['internal_api']} {i.get('version')} ({i['num_threads']} threads)" for i in threadpool_info() if i["user_api"] == "blas")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; numpy {np.__version__}; BLAS: {blas}")
    print()
    print("HBFP8 gemm (24x24 tiles, fp32 accumulation in K-tile order) vs numpy fp32 matmul")
    print(f"{'size':>10} {'fp32 matmul':>12} {'hbfp8 gemm':>12} {'ratio':>7} {'gemm+quantize':>14} {'ratio':>7} {'ratio, alternating calls':>25}")
    for n in args.sizes:
        t = bench_gemm(n, args.repeats, rng)
        print(
            f"{f'{n}^3':>10} {t['fp32'] * 1e3:>10.2f}ms {t['hbfp8'] * 1e3:>10.2f}ms {t['hbfp8'] / t['fp32']:>6.2f}x"
            f" {t['hbfp8+q'] * 1e3:>12.2f}ms {t['hbfp8+q'] / t['fp32']:>6.2f}x {t['alternating']:>24.2f}x"
        )
    print()
    shape = tuple(args.quantize_shape)
    print(f"quantize throughput ({shape[0]}x{shape[1]} fp32)")
    for name, sec in bench_quantize(shape, args.repeats, rng).items():
        print(f"{name:>18}: {shape[0] * shape[1] / sec / 1e6:8.1f} M elements/s ({sec * 1e3:.2f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
