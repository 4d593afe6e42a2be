"""Speed of the ``sim`` backend: the accelerator top under Verilator, driven through its byte
streams by the native harness (sim/device.py).

Opens the configuration (building its library once; later runs load it from the cache),
loads A and B as fp32 values (WRITE frames of one tile each, quantized by the device),
runs an M x N x K product with an fp32 reply, checks it bit for bit against
``hbfp.golden.gemm.gemm``, and prints simulated cycles per second and MACs per second
(MACs = M * N * K) over the whole exchange and over the GEMM command alone, by the wall clock
and per second of the CPU time of the thread that runs the model (a fairer figure on a
machine shared with other work).

    .venv/bin/python benchmarks/sim_speed.py                      # default 8x8 core, 96^3
    .venv/bin/python benchmarks/sim_speed.py --config rows=4,cols=4,size=48 --mnk 48
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from hbfp.golden.bfp import quantize
from hbfp.golden.gemm import gemm
from hbfp.host import protocol as P
from hbfp.hw.params import CoreConfig
from hbfp.sim import device as sim_device


class Link:
    """Frames over a SimDevice, pipelined: send all, then collect the replies in order."""

    def __init__(self, dev):
        self.dev = dev
        self.parser = P.FrameParser(1 << 24)
        self.tag = 0
        self.replies: list = []

    def send(self, opcode: int, payload: bytes = b"") -> int:
        self.tag = (self.tag + 1) & 0x7FFF
        self.dev.write(P.encode_frame(opcode, self.tag, payload))
        return self.tag

    def collect(self, count: int) -> list:
        while len(self.replies) < count:
            data = self.dev.read()
            if not data:
                raise RuntimeError(f"the device went quiet with {count - len(self.replies)} replies missing")
            self.replies += self.parser.feed(data)
        out, self.replies = self.replies[:count], self.replies[count:]
        for r in out:
            if not isinstance(r, P.Frame) or r.status != P.Status.OK:
                raise RuntimeError(f"device refused a request: {r}")
        return out


def write_values(link: Link, target: int, x: np.ndarray, tile: tuple[int, int], max_payload: int) -> int:
    """WRITE of fp32 values, as many whole tiles per frame as fit; returns the frame count."""
    th, tw = tile
    rows, cols = x.shape
    per_tile = th * tw * 4
    tiles_per_frame = max(1, (max_payload - P.WRITE_HEADER) // per_tile)
    frames = 0
    for r in range(0, rows, th):
        c = 0
        while c < cols:
            n = min(tiles_per_frame, (cols - c) // tw)
            block = x[r : r + th, c : c + n * tw]
            link.send(P.Op.WRITE, P.encode_write(target, r, c, th, n * tw, P.to_tile_major(block, tile).tobytes()))
            frames += 1
            c += n * tw
    return frames


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="", help="sim backend options (default: CoreConfig(), 1-byte streams)")
    ap.add_argument("--mnk", type=int, nargs="+", default=None, help="M N K (one number: all three; default: size)")
    ap.add_argument("--repeat", type=int, default=3, help="GEMM commands timed (best and median reported)")
    ap.add_argument("--rebuild", action="store_true", help="build the library even if cached")
    args = ap.parse_args(argv)

    opts = sim_device.parse_arg(args.config)
    cfg = CoreConfig(**{k: v for k, v in opts.items() if k in sim_device._CORE_FIELDS})
    mnk = args.mnk or [cfg.size]
    m, n, k = (mnk * 3)[:3] if len(mnk) == 1 else mnk

    t0 = time.perf_counter()
    dev = sim_device.backend.open(args.config, rebuild=args.rebuild or None, progress=lambda s: print(s, flush=True))
    t_open = time.perf_counter() - t0
    print(f"config: {cfg.rows}x{cfg.cols} array, tile {cfg.tile}, size {cfg.size}, "
          f"stream_bytes {dev.stream_bytes}; library {dev.library} (open: {t_open:.2f} s)")

    link = Link(dev)
    link.send(P.Op.IDENTIFY)
    (reply,) = link.collect(1)
    ident = P.decode_identity(reply.data)
    assert (ident.rows, ident.cols, ident.size) == (cfg.rows, cfg.cols, cfg.size), ident

    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    fmt = cfg.fmt()
    want = np.asarray(gemm(quantize(a, fmt), quantize(b, fmt)), np.float32)

    # Operands: every WRITE sent at once, then the replies.
    c0, w0 = dev.cycles, time.perf_counter()
    frames = write_values(link, P.Target.A_VALUES, a, cfg.tile, ident.max_payload)
    frames += write_values(link, P.Target.B_VALUES, b, cfg.tile, ident.max_payload)
    link.collect(frames)
    write_cycles, write_s = dev.cycles - c0, time.perf_counter() - w0
    write_bytes = a.nbytes + b.nbytes

    runs = []
    for _ in range(args.repeat):
        c1, w1, u1 = dev.cycles, time.perf_counter(), time.thread_time()
        link.send(P.Op.GEMM, P.encode_gemm(m, n, k))
        (reply,) = link.collect(1)
        runs.append((dev.cycles - c1, time.perf_counter() - w1, time.thread_time() - u1))
        device_cycles = P.decode_cycles(reply.data)  # after the result
        got = np.frombuffer(reply.data[:-P.CYCLES_SIZE], np.float32).reshape(m, n)  # the result, then the cycles
        if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
            print("MISMATCH against hbfp.golden.gemm.gemm")
            return 1

    total_cycles = write_cycles + sum(r[0] for r in runs)
    total_s = write_s + sum(r[1] for r in runs)
    macs = m * n * k
    best = min(runs, key=lambda r: r[1])
    med_s = statistics.median(r[1] for r in runs)
    cpu = min(r[2] for r in runs)
    print(f"operands: {frames} WRITE frames, {write_bytes} bytes of fp32 values: {write_cycles} cycles "
          f"in {write_s:.3f} s = {write_cycles / write_s:,.0f} cycles/s")
    print(f"GEMM {m}x{n}x{k} (fp32 reply, {m * n * 4} bytes): {best[0]} cycles on the wire, "
          f"{device_cycles} by the device's count; best {best[1]:.3f} s, median {med_s:.3f} s")
    print(f"  GEMM command: {best[0] / best[1]:,.0f} cycles/s, {macs / best[1]:,.0f} MACs/s (best of {len(runs)}, "
          f"wall clock); per CPU second: {best[0] / cpu:,.0f} cycles/s, {macs / cpu:,.0f} MACs/s")
    print(f"  whole exchange (writes + {len(runs)} GEMMs): {total_cycles / total_s:,.0f} cycles/s, "
          f"{macs * len(runs) / total_s:,.0f} MACs/s")
    print("  result: bit-exact with hbfp.golden.gemm.gemm")

    # The bare clock with nothing to do, for reference.
    t2, u2 = time.perf_counter(), time.thread_time()
    dev.run(500_000)
    print(f"idle clock: {500_000 / (time.perf_counter() - t2):,.0f} cycles/s "
          f"({500_000 / (time.thread_time() - u2):,.0f} per CPU second)")
    print(f"machine load average while measuring: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    dev.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
