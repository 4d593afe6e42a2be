"""Load on ``hbfp sim-server`` (host/server.py ``Server``): good clients running products
while bad clients are connected, against the same good clients alone.

For each scenario a fresh server runs as a subprocess (``hbfp sim-server --device DEVICE
--port 0``, the port it picks read from its first line). ``--clients`` good clients (threads
of this process, one connection each) run M x K x N products for ``--seconds``, each checked
bit for bit against ``hbfp.host.reference_gemm`` (operands and references computed before the
clock starts). In the loaded scenario three bad clients are connected meanwhile: a silent one
(connects, sends nothing), a dripping one (an IDENTIFY request, one byte every 50 ms, over
and over; it never reads) and a never-reading one (READ requests of a whole fp32 result for as
long as the server takes them; it never reads). Reported per scenario: products correct of
run, the latency of one product (median and p95), products per second, and the server's
memory (VmRSS of its process from /proc/PID/status before the clients start and after they
ran, while the bad clients are still connected; VmHWM, its peak).

    .venv/bin/python benchmarks/server_load.py                    # 4 clients, 20 s, 96^3 on emu
    .venv/bin/python benchmarks/server_load.py --seconds 5 --mnk 48
"""

from __future__ import annotations

import argparse
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

import hbfp.host as host
from hbfp.golden.compare import same_bits
from hbfp.host import protocol as P
from hbfp.host.protocol import Op


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


class ServerProcess:
    """``hbfp sim-server`` in a subprocess, on a port it picks."""

    def __init__(self, device: str):
        command = [sys.executable, "-m", "hbfp.cli", "sim-server", "--device", device, "--port", "0"]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("serving "):
            self.proc.kill()
            raise RuntimeError(f"the server did not start: {line!r} {self.proc.communicate()[1]}")
        self.spec = line.split()[-1]
        host_, port = self.spec[len("tcp:"):].rsplit(":", 1)
        self.address = (host_, int(port))

    def stop(self) -> str:
        """Stop the server (as Ctrl-C does); returns what it wrote on stderr."""
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=20)
        return err


def silent(address, stop: threading.Event) -> None:
    with socket.create_connection(address, timeout=5):
        stop.wait()


def dripping(address, stop: threading.Event) -> None:
    frame = P.encode_frame(Op.IDENTIFY, 1)
    with socket.create_connection(address, timeout=5) as sock:
        i = 0
        while not stop.wait(0.05):
            sock.sendall(frame[i % len(frame) : i % len(frame) + 1])
            i += 1


def never_reading(address, stop: threading.Event, size: int, sent: list) -> None:
    read = P.encode_frame(Op.READ, 2, P.encode_read(size, size))
    with socket.create_connection(address, timeout=5) as sock:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                sock.sendall(read)
                sent[0] += 1
            except TimeoutError:
                pass  # the server stopped reading from it; try again


def run(device: str, clients: int, seconds: float, mnk: int, bad: bool) -> dict:
    server = ServerProcess(device)
    stop = threading.Event()
    sent = [0]
    bad_threads = []
    try:
        with host.open(server.spec, timeout=10) as dev:
            fmt = dev.format()
            ident = dev.identity
            size = ident.size
            rng = np.random.default_rng(0)
            pairs = [tuple(rng.standard_normal((mnk, mnk)).astype(np.float32) for _ in "ab") for _ in range(8)]
            refs = [host.reference_gemm(fmt, a, b) for a, b in pairs]
            assert same_bits(dev.gemm(*pairs[0]), refs[0])  # warm the server up
        time.sleep(0.5)
        before = memory(server.proc.pid)
        if bad:
            bad_threads = [threading.Thread(target=silent, args=(server.address, stop)),
                           threading.Thread(target=dripping, args=(server.address, stop)),
                           threading.Thread(target=never_reading, args=(server.address, stop, size, sent))]
            for t in bad_threads:
                t.start()
            time.sleep(1.0)  # connected, and the never-reading one has filled its queue
        latencies: list[float] = []
        results = {"ok": 0, "wrong": 0, "errors": []}
        lock = threading.Lock()
        deadline = time.monotonic() + seconds

        def good(i: int) -> None:
            try:
                with host.open(server.spec, timeout=10) as dev:
                    j = i
                    while time.monotonic() < deadline:
                        a, b = pairs[j % len(pairs)]
                        t0 = time.perf_counter()
                        got = dev.gemm(a, b)
                        seconds = time.perf_counter() - t0
                        same = same_bits(got, refs[j % len(pairs)])
                        key = "ok" if same else "wrong"
                        with lock:
                            latencies.append(seconds)
                            results[key] += 1
                        j += 1
            except host.HbfpError as e:
                results["errors"].append(f"client {i}: {e}")

        t0 = time.monotonic()
        threads = [threading.Thread(target=good, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        after = memory(server.proc.pid)
    finally:
        stop.set()
        for t in bad_threads:
            t.join(10)
        err = server.stop()
    lat = sorted(latencies)
    return {
        "ok": results["ok"], "run": results["ok"] + results["wrong"], "errors": results["errors"],
        "median": statistics.median(lat) if lat else float("nan"),
        "p95": lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else float("nan"),
        "rate": len(lat) / elapsed, "rss_before": before["VmRSS"], "rss_after": after["VmRSS"],
        "hwm": after["VmHWM"], "reads_sent": sent[0], "size": size, "identity": ident,
        "events": [line for line in err.splitlines() if line.strip()],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="emu", help="the device the server serves (default emu)")
    ap.add_argument("--clients", type=int, default=4, help="good clients (default 4)")
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds each scenario runs (default 20)")
    ap.add_argument("--mnk", type=int, default=96, help="M = N = K of every product (default 96)")
    args = ap.parse_args()
    print(f"hbfp sim-server --device {args.device}: {args.clients} clients, {args.mnk}^3 fp32 products, "
          f"{args.seconds:g} s per scenario", flush=True)
    base = run(args.device, args.clients, args.seconds, args.mnk, bad=False)
    loaded = run(args.device, args.clients, args.seconds, args.mnk, bad=True)
    ident = base["identity"]
    print(f"device: {ident.rows}x{ident.cols} array, buffers {ident.size}, max_payload {ident.max_payload:,}, "
          f"frame_timeout {ident.frame_timeout:,} cycles")
    mb = 1 << 20
    rows = [
        ("products correct / run", lambda r: f"{r['ok']} / {r['run']}"),
        ("products per second", lambda r: f"{r['rate']:.1f}"),
        ("latency median (ms)", lambda r: f"{1e3 * r['median']:.1f}"),
        ("latency p95 (ms)", lambda r: f"{1e3 * r['p95']:.1f}"),
        ("server VmRSS before (MiB)", lambda r: f"{r['rss_before'] / mb:.1f}"),
        ("server VmRSS after (MiB)", lambda r: f"{r['rss_after'] / mb:.1f}"),
        ("server VmRSS growth (MiB)", lambda r: f"{(r['rss_after'] - r['rss_before']) / mb:+.1f}"),
        ("server VmHWM (MiB)", lambda r: f"{r['hwm'] / mb:.1f}"),
    ]
    print(f"{'':28} {'good clients alone':>20} {'+ silent, dripping, never-reading':>34}")
    for name, cell in rows:
        print(f"{name:28} {cell(base):>20} {cell(loaded):>34}")
    size = loaded["size"]
    asked = loaded["reads_sent"] * (P.HEADER.size + 1 + 4 * size * size + P.CRC_SIZE)
    print(f"never-reading client: {loaded['reads_sent']} READ requests of {size}x{size} fp32 taken by its socket "
          f"({asked / mb:.0f} MiB of replies asked); server events on stderr: {len(loaded['events'])} lines")
    for line in loaded["events"]:
        if "connected" not in line:
            print(f"  {line}")
    failed = base["errors"] + loaded["errors"]
    for e in failed:
        print(f"error: {e}", file=sys.stderr)
    return 0 if not failed and base["ok"] == base["run"] and loaded["ok"] == loaded["run"] else 1


if __name__ == "__main__":
    sys.exit(main())
