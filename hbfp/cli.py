"""The ``hbfp`` command line. Subcommands grow with the project; each is a thin wrapper."""

from __future__ import annotations

import argparse
import sys

import numpy as np


def _golden_demo(args) -> int:
    from hbfp.golden import HBFP8, HBFP16, MXINT8, bf16, quantize
    from hbfp.golden.gemm import gemm

    m, k, n = args.m, args.k, args.n
    rng = np.random.default_rng(args.seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    # Columns of B at different scales, as in a layer whose output channels differ.
    b = (rng.standard_normal((k, n)) * np.exp2(rng.integers(-3, 4, n))).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    norm = np.linalg.norm(exact)
    fp32_bytes = 4 * (a.size + b.size)

    def row(name, c, nbytes):
        c = np.asarray(c, np.float64)
        rel = np.linalg.norm(c - exact) / norm
        worst = np.abs(c - exact).max() / np.abs(exact).max()
        print(f"{name:<34} {rel:>12.3e} {worst:>12.3e} {nbytes:>10,} {100 * (1 - nbytes / fp32_bytes):>8.1f}%")

    print(f"C = A @ B with A {m}x{k}, B {k}x{n} (seed {args.seed}); errors against float64")
    print(f"{'format':<34} {'rel. error':>12} {'max error':>12} {'op. bytes':>10} {'saved':>9}")
    row("fp32 (numpy matmul)", a @ b, fp32_bytes)
    a16, b16 = bf16.to_f32(bf16.from_f32(a)), bf16.to_f32(bf16.from_f32(b))
    row("bf16 operands, fp32 sums", a16 @ b16, 2 * (a.size + b.size))
    qa, qb = quantize(a, HBFP8), quantize(b, HBFP8)
    row("HBFP8 (8-bit, 24x24 tiles)", gemm(qa, qb), qa.storage_bytes() + qb.storage_bytes())
    wa, wb = quantize(a, HBFP16), quantize(b, HBFP16)
    row("HBFP16 (16-bit, 24x24 tiles)", gemm(wa, wb), wa.storage_bytes() + wb.storage_bytes())
    # MXINT8 blocks run along K in both operands: B is stored transposed (N x K).
    xa, xb = quantize(a, MXINT8), quantize(b.T, MXINT8)
    row("MXINT8 (8-bit, 1x32 blocks)", gemm(xa, xb, transpose_b=True), xa.storage_bytes() + xb.storage_bytes())
    return 0


FORMATS = {"HBFP8": (8, (24, 24)), "HBFP16": (16, (24, 24)), "MXINT8": (8, (1, 32))}


def _config_from_args(args):
    from hbfp.hw.params import CoreConfig

    bits, tile = FORMATS[args.format]
    if args.mantissa_bits is not None:
        bits = args.mantissa_bits
    if args.tile is not None:
        tile = tuple(args.tile)
    return CoreConfig(
        rows=args.rows, cols=args.cols, mantissa_bits=bits, tile=tile, size=args.size,
        functions=tuple(args.functions) if args.functions else None,
    )


def _verilog(args) -> int:
    from pathlib import Path

    from hbfp.hw.generate import generate

    try:
        cfg = _config_from_args(args)
    except ValueError as e:
        print(f"hbfp verilog: {e}", file=sys.stderr)
        return 2
    print(f"GEMM core {cfg.rows}x{cfg.cols}, {cfg.mantissa_bits}-bit codes, tile {cfg.tile[0]}x{cfg.tile[1]}, "
          f"buffers {cfg.size}x{cfg.size} -> {args.output}")
    generate(cfg, Path(args.output), only=args.only)
    return 0


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """The core configuration options (shared by the commands that build a core)."""
    from hbfp.hw.activation import FUNCTIONS

    p.add_argument("--rows", type=int, default=8, help="MAC array rows (a power of two; default 8)")
    p.add_argument("--cols", type=int, default=8, help="MAC array columns (a power of two; default 8)")
    p.add_argument("--format", choices=sorted(FORMATS), default="HBFP8", help="BFP format of operands and BFP outputs (default HBFP8)")
    p.add_argument("--mantissa-bits", type=int, help="override the format's mantissa bits")
    p.add_argument("--tile", type=int, nargs=2, metavar=("ROWS", "COLS"), help="override the format's tile")
    p.add_argument("--size", type=int, default=96, help="buffer side: operands and outputs up to SIZE x SIZE (default 96)")
    p.add_argument("--functions", nargs="+", choices=FUNCTIONS, help="activation units to build (default: all)")


def build_parser() -> argparse.ArgumentParser:
    from hbfp import __version__

    p = argparse.ArgumentParser(prog="hbfp", description="Hybrid Block Floating Point accelerator tools")
    p.add_argument("--version", action="version", version=f"hbfp {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "golden-demo",
        help="quantize a random matrix product with HBFP8 and MXINT8; print errors and bytes saved",
    )
    demo.add_argument("--m", type=int, default=256, help="rows of A (default 256)")
    demo.add_argument("--k", type=int, default=768, help="columns of A, rows of B (default 768)")
    demo.add_argument("--n", type=int, default=192, help="columns of B (default 192)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_golden_demo)

    vl = sub.add_parser("verilog", help="write the Verilog of the GEMM core and its components, and params.json")
    add_config_arguments(vl)
    vl.add_argument("-o", "--output", default="build/verilog", help="output folder (default build/verilog)")
    vl.add_argument("--only", nargs="+", help="write only these components (e.g. gemm_core mac_array)")
    vl.set_defaults(func=_verilog)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    for name in ("m", "k", "n"):
        if getattr(args, name, 1) < 1:
            parser.error(f"--{name} must be at least 1")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
