"""The ``hbfp`` command line. Subcommands grow with the project; each is a thin wrapper."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from hbfp import contract


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


#: The contract's named formats as (mantissa bits, tile), the options they set.
FORMATS = {name: (f.mantissa_bits, f.tile) for name, f in contract.FORMATS.items()}


def _config_from_args(args):
    """The ``CoreConfig`` of the configuration options (``add_config_arguments``), checked by the
    contract as ``emu:``/``sim:`` options are."""
    bits, tile = FORMATS[args.format]
    if args.mantissa_bits is not None:
        bits = args.mantissa_bits
    if args.tile is not None:
        tile = tuple(args.tile)
    return contract.CoreConfig(
        rows=args.rows, cols=args.cols, mantissa_bits=bits, tile=tile, size=args.size,
        functions=_functions_from_args(args), **_units_from_args(args),
    )


def _functions_from_args(args) -> tuple[str, ...] | None:
    """``--functions``: the activation units (``none``: no unit; absent: None, the default)."""
    if not args.functions:
        return None
    return () if args.functions == ["none"] else tuple(f for f in args.functions if f != "none")


def _units_from_args(args) -> dict:
    """``--units``: CoreConfig's optional-unit fields (all of them when the option is absent)."""
    from hbfp.host.protocol import UNITS

    if args.units is None:
        return {}
    return {unit: unit in args.units for unit in UNITS}


def _verilog(args) -> int:
    from pathlib import Path

    from hbfp.hw.generate import MANIFEST, components, generate, generated_files
    from hbfp.outputs import Output, OutputConflict

    try:
        cfg = _config_from_args(args)
    except ValueError as e:
        print(f"hbfp verilog: {e}", file=sys.stderr)
        return 2
    if args.only:
        known = list(components(cfg))
        unknown = [name for name in args.only if name not in known]
        if unknown:
            print(f"hbfp verilog: unknown component(s) {', '.join(map(repr, unknown))} for --only; this "
                  f"configuration has {', '.join(known)}", file=sys.stderr)
            return 2
    output = Path(args.output)
    try:  # before any work: a file or a link in the way, or files of the user's it would overwrite
        out = Output(output, generated_files(cfg, args.only), command="hbfp verilog", manifest=MANIFEST)
    except OutputConflict as e:
        print(f"hbfp verilog: {e}", file=sys.stderr)
        return 2
    print(f"GEMM core {cfg.rows}x{cfg.cols}, {cfg.mantissa_bits}-bit codes, tile {cfg.tile[0]}x{cfg.tile[1]}, "
          f"buffers {cfg.size}x{cfg.size} -> {args.output}")
    try:
        out.begin()
        generate(cfg, output, only=args.only, write=out.put)
    except OSError as e:
        print(f"hbfp verilog: cannot write {output}: {e}", file=sys.stderr)
        return 1
    return 0


def _build(args) -> int:
    from hbfp.host.protocol import UNITS
    from hbfp.hw import boards

    if args.list or not args.board:
        print("boards (hbfp build --board NAME):")
        for b in boards.BOARDS.values():
            c = b.cfg
            omitted = [u for u in UNITS if not getattr(c, u)]
            print(f"  {b.name:11s} {b.title}; {b.flow} flow, {b.link} link; default {c.rows}x{c.cols}, tile "
                  f"{c.tile[0]}x{c.tile[1]}, buffers {c.size}x{c.size}"
                  + (f", without {', '.join(omitted)}" if omitted else ""))
        return 0 if args.list else 2
    overrides = {"rows": args.rows, "cols": args.cols, "size": args.size, "baud": args.baud,
                 "fifo_depth": args.fifo_depth, "max_payload": args.max_payload, "port": args.port}
    if args.ip is not None:
        try:
            overrides["ip"] = boards.parse_ip(args.ip)
        except ValueError as e:
            print(f"hbfp build: --ip: {e}", file=sys.stderr)
            return 2
    if args.format:
        overrides["mantissa_bits"], overrides["tile"] = FORMATS[args.format]
    if args.mantissa_bits:
        overrides["mantissa_bits"] = args.mantissa_bits
    if args.tile:
        overrides["tile"] = tuple(args.tile)
    if args.functions:
        overrides["functions"] = _functions_from_args(args)
    overrides.update(_units_from_args(args))
    try:
        result = boards.build(args.board, args.output, run=not args.no_run, seed=args.seed, **overrides)
    except boards.OutputConflict as e:  # a file or a symbolic link in the way, or the user's files
        print(f"hbfp build: {e}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError) as e:
        print(f"hbfp build: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"hbfp build: cannot write {args.output}: {e}", file=sys.stderr)
        return 1
    for path in result.files:
        if path.suffix in (".bit", ".bin", ".qsf", ".sdc", ".sh", ".v") and not path.name.endswith(".debug.v"):
            print(f"  {path}")
    if result.report:
        util = ", ".join(f"{k} {v['used']}/{v['available']}" for k, v in result.report["utilization"].items())
        print(f"  utilization: {util}")
        if not result.report["timing_met"]:
            slow = [(mhz, want) for mhz, want in result.report.get("clocks", {}).values() if mhz < want]
            print("warning: timing not met: " + (", ".join(f"a clock reaches {mhz:.1f} MHz of its {want:g}"
                                                           for mhz, want in slow) if slow else
                                                 f"Fmax {result.report['fmax_mhz']:.1f} MHz is below the board's "
                                                 f"{result.report['clock_mhz']:.1f} MHz clock"), file=sys.stderr)
    return 0


# ---- device commands (hbfp.host) ----------------------------------------------------------


def _info(args) -> int:
    import hbfp.host as host

    status = 0
    if args.device:
        try:
            with host.open(args.device, timeout=args.timeout) as dev:
                ident = dev.info()
                R, C = ident.rows, ident.cols
                print(f"device {args.device}")
                print(f"  protocol {ident.protocol_version}, ABI {ident.abi_major}.{ident.abi_minor} "
                      f"(host speaks {host.protocol.ABI_VERSION[0]}.{host.protocol.ABI_VERSION[1]})")
                print(f"  MAC array {R}x{C}, {ident.mantissa_bits}-bit codes, tile {ident.tile_rows}x{ident.tile_cols} "
                      f"(K-tile {ident.tk}), buffers {ident.size}x{ident.size}")
                print(f"  activation units: {', '.join(ident.functions) or 'none'} (leaky_relu shift {ident.leaky_shift})")
                omitted = [u for u in host.protocol.UNITS if not ident.has(u)]
                print(f"  optional units: {', '.join(ident.units) or 'none'}"
                      + (f" (without {', '.join(omitted)}: the host does their work)" if omitted else ""))
                clock = f"{ident.clock_hz / 1e6:g} MHz" if ident.clock_hz else "unknown"
                print(f"  clock {clock}, stream {ident.stream_bytes} byte(s)/beat, max payload {ident.max_payload:,} bytes, "
                      f"frame timeout {ident.frame_timeout:,} cycles")
        except host.HbfpError as e:
            print(f"hbfp info: {args.device}: {e}", file=sys.stderr)
            status = 1
    print("backends (entry-point group hbfp.devices):")
    for name, b in sorted(host.backends().items()):
        if b.ok:
            print(f"  {name:<8} ABI {b.abi[0]}.{b.abi[1]}  {b.description}")
        else:
            print(f"  {name:<8} unavailable: {b.error}")
    return status


def _gemm(args) -> int:
    import time

    import hbfp.host as host
    from hbfp.golden.bfp import BFPTensor

    m, n, k = args.m, args.n, args.k
    rng = np.random.default_rng(args.seed)
    a = rng.standard_normal((k, m) if args.transpose_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if args.transpose_b else (k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if args.bias else None
    kw = dict(bias=bias, activation=args.activation, out=args.out, transpose_a=args.transpose_a,
              transpose_b=args.transpose_b, input=args.input, rounding=args.rounding, seed=args.seed)
    try:
        dev = host.open(args.device, timeout=args.timeout)
    except host.HbfpError as e:
        print(f"hbfp gemm: {args.device}: {e}", file=sys.stderr)
        return 1
    # A simulated device counts the cycles the exchange occupies the link (docs/host.md).
    link_device = getattr(dev.transport, "device", None)
    wire = (lambda: link_device.wire_cycles) if hasattr(link_device, "wire_cycles") else None
    with dev:
        ident = dev.identity
        before = dev.stats.copy()
        wire_before = wire() if wire else 0
        t0 = time.perf_counter()
        try:
            got = dev.gemm(a, b, **kw)
        except host.HbfpError as e:
            print(f"hbfp gemm: {e}", file=sys.stderr)
            return 1
        seconds = time.perf_counter() - t0
        st = dev.stats - before
        wire_cycles = wire() - wire_before if wire else None
    want = host.reference_gemm(ident.fmt(), a, b, **kw)
    if isinstance(want, BFPTensor):
        bad = int((got.codes != want.codes).sum()) + int((got.exponents != want.exponents).sum())
    else:
        bad = int((np.asarray(got).view(np.uint16 if args.out == "bf16" else np.uint32)
                   != np.asarray(want).view(np.uint16 if args.out == "bf16" else np.uint32)).sum())
    macs = m * n * k
    ideal = macs / (ident.rows * ident.cols)
    print(f"{args.device}: {m}x{k} @ {k}x{n} ({args.input} in, {args.out} out), {macs:,} MACs")
    print(f"  golden model: {'bit-exact' if not bad else f'{bad} values differ'}")
    print(f"  host time {seconds * 1e3:.1f} ms: {macs / seconds / 1e6:.1f} M MAC/s through the driver")
    if dev.in_process:
        print("  link: none (emu computes products in-process; emu:wire=1 sends them through the wire protocol)")
    else:
        print(f"  link: {st.bytes_sent:,} bytes sent, {st.bytes_received:,} received, {st.bytes_per_mac:.4f} bytes/MAC, "
              f"{st.frames_sent} frames, {st.retries} retries")
    if st.host_quantized or st.host_activations:
        print(f"  done on the host: {st.host_quantized} quantizations, {st.host_activations} activations "
              "(units the device lacks, or a split stochastic stream: docs/host.md)")
    line = f"  device: {st.cycles:,} cycles, ideal {ideal:,.0f} ({ident.rows}x{ident.cols} MACs/cycle): " \
           f"utilization {100 * ideal / st.cycles:.1f}%" if st.cycles else "  device: no cycle count"
    if ident.clock_hz and st.cycles:
        line += f", {st.cycles / ident.clock_hz * 1e3:.3f} ms at {ident.clock_hz / 1e6:g} MHz"
    print(line)
    if wire_cycles is not None:
        ratio = f" ({wire_cycles / st.cycles:.2f}x the device's)" if st.cycles else ""
        print(f"  wire: {wire_cycles:,} cycles on the wire{ratio}, {ident.stream_bytes} byte(s) a beat")
    _print_link_bound(dev, st, ident)
    return 0 if not bad else 1


def _print_link_bound(dev, st, ident) -> None:
    """On a network link (udp:, sim:link=eth): how long the exchange's bytes take on Gigabit
    Ethernet (datagrams, headers and gaps included, the busier direction) against the device's
    cycles, at its clock (IDENTIFY's; unknown: the link's 125 MHz, as the simulated board runs)."""
    from hbfp.host import datagrams as D
    from hbfp.host.transports import DatagramTransport, UdpTransport

    if not isinstance(dev.transport, (UdpTransport, DatagramTransport)) or not st.cycles:
        return
    wire = max(D.wire_bytes(st.bytes_sent), D.wire_bytes(st.bytes_received)) / D.GIGABIT
    clock = ident.clock_hz or D.GIGABIT
    device = st.cycles / clock
    where = f"{clock / 1e6:g} MHz" + ("" if ident.clock_hz else " (the link's clock: the device reports none)")
    print(f"  link-bound factor {wire / device:.2f}: {wire * 1e6:,.1f} us on Gigabit Ethernet, "
          f"{device * 1e6:,.1f} us of the device at {where}")


def _sim_server(args) -> int:
    from hbfp.host import HbfpError
    from hbfp.host.registry import open_backend
    from hbfp.host.server import PtyServer, Server, UdpServer
    from hbfp.host.transports import Transport, TransportDevice

    tcp_only = {"--connections": args.connections, "--client-timeout": args.client_timeout,
                "--max-queued": args.max_queued, "--max-clients": args.max_clients,
                "--reply-timeout": args.reply_timeout}
    given = [name for name, value in tcp_only.items() if value is not None]
    if args.pty and args.udp is not None:
        print("hbfp sim-server: --pty and --udp are two different links: give one", file=sys.stderr)
        return 2
    if (args.pty or args.udp is not None) and given:
        link = "a pseudo-terminal (--pty)" if args.pty else "a UDP port (--udp)"
        print(f"hbfp sim-server: {', '.join(given)} are options of the TCP server; {link} "
              "has one peer and no connections (use --idle-timeout)", file=sys.stderr)
        return 2
    faults = [name for name, value in (("--drop", args.drop), ("--corrupt", args.corrupt)) if value]
    if faults and args.udp is None:
        print(f"hbfp sim-server: {', '.join(faults)} are faults of the UDP link (--udp)", file=sys.stderr)
        return 2
    for name, value in (("--drop", args.drop), ("--corrupt", args.corrupt)):
        if not 0.0 <= value <= 1.0:
            print(f"hbfp sim-server: {name} is a probability (0 .. 1), got {value:g}", file=sys.stderr)
            return 2
    for name in ("--max-queued", "--max-clients"):
        if tcp_only[name] is not None and tcp_only[name] < 1:
            print(f"hbfp sim-server: {name} must be at least 1", file=sys.stderr)
            return 2
    try:
        device = open_backend(args.device)
    except HbfpError as e:
        print(f"hbfp sim-server: {e}", file=sys.stderr)
        return 1
    if args.udp is not None and getattr(device, "datagrams", None) is not None:
        device = device.datagrams  # a board on its network link (sim:link=eth): its datagrams bridged whole
    elif isinstance(device, Transport):
        device = TransportDevice(device)  # relay a remote device
    try:
        if args.pty:
            server = PtyServer(device, idle_timeout=args.idle_timeout)
        elif args.udp is not None:
            server = UdpServer(device, args.host, args.udp, idle_timeout=args.idle_timeout, drop=args.drop,
                               corrupt=args.corrupt)
        else:
            # The options given; Server's defaults for the others.
            options = {key: getattr(args, key) for key in ("max_queued", "max_clients", "reply_timeout")
                       if getattr(args, key) is not None}
            if args.client_timeout is not None:
                options["client_timeout"] = args.client_timeout or None  # 0: never
            server = Server(device, args.host, args.port, connections=args.connections, idle_timeout=args.idle_timeout,
                            log=lambda message: print(f"hbfp sim-server: {message}", file=sys.stderr, flush=True),
                            **options)
    except OSError as e:
        where = "a pseudo-terminal" if args.pty else f"{args.host}:{args.port if args.udp is None else args.udp}"
        print(f"hbfp sim-server: cannot serve on {where}: {e}", file=sys.stderr)
        close = getattr(device, "close", None)
        if close:
            close()
        return 1
    print(f"serving {args.device} on {server.spec}", flush=True)
    import signal

    def stop(signum, frame):  # SIGTERM ends the server as Ctrl-C does: its summary, then exit 0
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    except HbfpError as e:
        print(f"hbfp sim-server: {args.device}: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        close = getattr(device, "close", None)
        if close:
            close()
    if isinstance(server, UdpServer):
        print("datagrams: " + ", ".join(f"{v} {k}" for k, v in server.counts.items()), flush=True)
    elif not args.pty:
        print(f"served {server.served} connection(s)", flush=True)
    return 0


def _train_output(args):
    """The report's folder, checked before any training (None: refused, said why)."""
    from pathlib import Path

    from hbfp import train as tr
    from hbfp.outputs import OutputConflict

    try:
        return tr.report_output(Path(args.out))
    except OutputConflict as e:
        print(f"hbfp train: {e}", file=sys.stderr)
        return None


def _train(args) -> int:
    from hbfp import distributed as hd

    if args.nproc < 1:
        print("hbfp train: --nproc must be at least 1", file=sys.stderr)
        return 2
    if not args.timeout > 0:
        print("hbfp train: --timeout must be a positive number of seconds", file=sys.stderr)
        return 2
    if args.error_feedback and args.grad_compression == "none":
        print("hbfp train: --error-feedback needs --grad-compression hbfp8 or mxint8", file=sys.stderr)
        return 2
    if _train_output(args) is None:
        return 2
    if hd.launched():  # a rank started by torchrun (or by the launcher below)
        return _train_rank(args)
    if args.nproc == 1:
        return _train_ranks(args, 0, 1)
    return _launch_ranks(args)


def _launch_ranks(args) -> int:
    """Start the ranks here (one process each, a rendezvous on a free local port) and watch
    them: when one dies, or fails (a peer that stopped answering times out its collectives
    after ``--timeout`` seconds), the others are stopped and one line says which rank and why."""
    import multiprocessing
    import signal
    import time

    from hbfp import distributed as hd

    ctx = multiprocessing.get_context("spawn")
    port = hd.free_port()
    # One pipe a rank for the line it fails with (pipes hold no semaphore that a killed rank
    # would leave behind)
    pipes = [ctx.Pipe(duplex=False) for _ in range(args.nproc)]
    procs = [ctx.Process(target=_spawned_rank, args=(rank, args, port, pipes[rank][1]), daemon=True)
             for rank in range(args.nproc)]
    for p in procs:
        p.start()
    interrupted = False
    try:
        while any(p.exitcode is None for p in procs) and not any(p.exitcode for p in procs if p.exitcode is not None):
            time.sleep(0.2)
    except KeyboardInterrupt:
        interrupted = True
    failed = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode]
    running = [rank for rank, p in enumerate(procs) if p.exitcode is None]
    stopped = [rank for rank in running if _stopped(procs[rank].pid)]
    for p in procs:  # a stopped rank takes no SIGTERM until it runs again: SIGKILL after a grace
        if p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()
    said = {}
    for rank, (receiving, sending) in enumerate(pipes):
        sending.close()
        try:
            if receiving.poll():
                said[rank] = receiving.recv()
        except (EOFError, OSError):
            pass
        receiving.close()
    if interrupted:
        print("\nhbfp train: interrupted", file=sys.stderr)
        return 130
    if not failed:
        return 0
    rank, code = failed[0]
    if code < 0:
        why = f"rank {rank} died ({signal.Signals(-code).name})"
    elif stopped:
        why = (f"rank {', '.join(map(str, stopped))} stopped answering: rank {rank} gave up waiting for it after "
               f"--timeout {args.timeout:g} s")
    elif rank in said:
        why = f"rank {rank} failed: {said[rank]}"
    else:
        why = f"rank {rank} exited with status {code}"
    print(f"\nhbfp train: {why}", file=sys.stderr)  # on a line of its own, after any progress bar
    return 1


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` was stopped (SIGSTOP, a debugger), where /proc says so."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _spawned_rank(rank: int, args, port: int, errors) -> None:
    """A rank started by ``_launch_ranks``; ``errors``: its end of the pipe for the line it fails with."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.nproc),
                      LOCAL_RANK=str(rank))
    try:
        rc = _train_rank(args)  # ends the process, once the group was up
    except Exception as e:  # one line for the launcher; the traceback is noise to the user
        first = (str(e).strip().splitlines() or [""])[0][:300]
        errors.send(f"{type(e).__name__}: {first}")
        raise SystemExit(1) from None
    raise SystemExit(rc)


def _train_rank(args) -> int:
    """One rank of a data-parallel ``hbfp train`` (gloo: the trainings' tensors are on the CPU);
    ends the process with its status once the group is down (``hbfp.distributed.exit_rank``)."""
    import os

    import torch.distributed as dist

    from hbfp import distributed as hd

    world = int(os.environ["WORLD_SIZE"])
    if args.nproc not in (1, world):
        print(f"hbfp train: --nproc {args.nproc} but the launcher started {world} ranks", file=sys.stderr)
        return 2
    import datetime

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    try:
        rc = _train_ranks(args, dist.get_rank(), world)
    finally:
        dist.destroy_process_group()
    hd.exit_rank(rc)


def _train_ranks(args, rank: int, world: int) -> int:
    import time
    from pathlib import Path

    from hbfp import distributed as hd
    from hbfp import host
    from hbfp import train as tr

    out = Path(args.out)
    lead = rank == 0  # the rank that prints and writes the report
    output = _train_output(args) if lead else None
    if lead and output is None:
        return 2
    spec = hd.rank_spec(args.device, rank)
    device = host.open(spec)
    from hbfp import recipes

    try:
        recipes.resolve(args.recipe).check(device)
    except ValueError as e:
        print(f"hbfp train: {e}", file=sys.stderr)
        return 2
    runs, extra, ok = [], [], True
    if world > 1 and lead:
        extra.append(f"data-parallel on {world} ranks (torch.distributed, gloo), one device per rank "
                     f"({hd.rank_spec(args.device, 0)} on rank 0), gradients exchanged as {args.grad_compression}"
                     + (f" ({args.grad_exchange.replace('_', '-')}{', error feedback' if args.error_feedback else ''})"
                        if args.grad_compression != "none" else "") + ".")
    for kind in args.models:
        for optimizer in args.optimizers:
            pair = []
            for precision in ("fp32", "hbfp8"):
                epochs = args.epochs if args.epochs is not None else tr.DEFAULT_EPOCHS[kind]
                r = tr.train(kind, precision, device=device if precision == "hbfp8" else None,
                             device_name=spec if precision == "hbfp8" else None, epochs=epochs, seed=args.seed,
                             weight_storage=args.weight_storage, grad_compression=args.grad_compression,
                             grad_exchange=args.grad_exchange, error_feedback=args.error_feedback,
                             grad_overlap=args.grad_overlap, progress=lead, optimizer=optimizer, recipe=args.recipe)
                if lead:
                    print(f"{kind} {optimizer} {precision}: {tr._metric(r)} ({r.seconds:.1f} s)"
                          + (f", {r.allreduce_bytes:,} bytes sent in gradient exchanges, ranks "
                             f"{'equal' if r.params_equal_across_ranks else 'DIFFERENT'}" if world > 1 else ""),
                          flush=True)
                ok &= r.params_equal_across_ranks is not False
                runs.append(r)
                pair.append(r)
            if kind in tr.LANGUAGE_MODELS:
                gap = 100 * (pair[1].val_loss - pair[0].val_loss) / pair[0].val_loss
                side = "above" if gap >= 0 else "below"
                extra.append(f"{kind} {optimizer}: HBFP8 validation loss {abs(gap):.2f}% {side} FP32's (target: within 3%).")
                ok &= gap <= 3.0
            else:
                gap = 100 * (pair[0].final_accuracy - pair[1].final_accuracy)
                side = "below" if gap >= 0 else "above"
                extra.append(f"{kind} {optimizer}: HBFP8 test accuracy {abs(gap):.2f} percentage points {side} FP32 "
                             "(target: within 1).")
                ok &= abs(gap) <= 1.0
    if args.sim_epochs and world > 1:
        if lead:
            extra.append("(the sim run is left out of data-parallel trainings: run it with --nproc 1)")
    elif args.sim_epochs:
        # The same MLP on the RTL: every batch loss must equal the emu run's, bit for bit.
        print(f"building / opening the simulator ({args.sim}) ...", flush=True)
        t0 = time.perf_counter()
        sim = host.open(args.sim)
        opened = time.perf_counter() - t0
        print(f"simulator ready in {opened:.1f} s", flush=True)
        ref = tr.train("mlp", "hbfp8", device=host.open("emu"), device_name="emu", epochs=args.sim_epochs, seed=args.seed,
                       progress=False, weight_storage=args.weight_storage, recipe=args.recipe)
        r = tr.train("mlp", "hbfp8", device=sim, device_name=args.sim, epochs=args.sim_epochs, seed=args.seed,
                     weight_storage=args.weight_storage, recipe=args.recipe)
        runs.append(r)
        same = ref.batch_losses == r.batch_losses
        ok &= same
        extra.append(f"mlp on {args.sim} (the RTL under Verilator), {args.sim_epochs} epoch(s), {len(r.batch_losses)} "
                     f"batches: losses {'equal' if same else 'DIFFERENT from'} the emu run's bit for bit ({r.seconds:.1f} s; "
                     f"simulator build/open {opened:.1f} s).")
    if not lead:
        return 0 if ok else 1
    table = tr.write_report(runs, out, extra, output)
    print()
    print(table)
    print(f"\ncurves: {out / 'curves.png'}, table: {out / 'results.md'}")
    return 0 if ok else 1


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """The core configuration options (shared by the commands that build a core)."""
    from hbfp.contract import FUNCTIONS

    p.add_argument("--rows", type=int, default=8, help="MAC array rows (a power of two; default 8)")
    p.add_argument("--cols", type=int, default=8, help="MAC array columns (a power of two; default 8)")
    p.add_argument("--format", choices=sorted(FORMATS), default="HBFP8", help="BFP format of operands and BFP outputs (default HBFP8)")
    p.add_argument("--mantissa-bits", type=int, help="override the format's mantissa bits")
    p.add_argument("--tile", type=int, nargs=2, metavar=("ROWS", "COLS"), help="override the format's tile")
    p.add_argument("--size", type=int, default=96, help="buffer side: operands and outputs up to SIZE x SIZE (default 96)")
    p.add_argument("--functions", nargs="+", choices=(*FUNCTIONS, "none"),
                   help="activation units to build (default: all; none: no unit)")
    add_units_argument(p, "all")


def add_units_argument(p: argparse.ArgumentParser, default: str) -> None:
    from hbfp.host.protocol import UNITS

    p.add_argument("--units", nargs="*", choices=tuple(UNITS), metavar="UNIT",
                   help=f"the optional units to build, of {', '.join(UNITS)} (default: {default}; "
                   "--units alone: none, a reduced device whose host does their work)")


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

    bp = sub.add_parser("build", help="an FPGA board build: bitstream (ECP5, iCE40: YoWASP) or Quartus project (Intel)")
    bp.add_argument("--board", help="board name (--list shows them)")
    bp.add_argument("--list", action="store_true", help="list the boards and their default configurations")
    bp.add_argument("--rows", type=int, help="MAC array rows (default: the board's)")
    bp.add_argument("--cols", type=int, help="MAC array columns (default: the board's)")
    bp.add_argument("--format", choices=sorted(FORMATS), help="BFP format (sets mantissa bits and tile)")
    bp.add_argument("--mantissa-bits", type=int)
    bp.add_argument("--tile", type=int, nargs=2, metavar=("ROWS", "COLS"))
    bp.add_argument("--size", type=int, help="buffer side (default: the board's)")
    bp.add_argument("--functions", nargs="+", help="activation units to build (default: the board's; none: no unit)")
    add_units_argument(bp, "the board's")
    bp.add_argument("--baud", type=int, help="UART boards: line rate (default: the board's, hbfp.hw.boards.DEFAULT_BAUD)")
    bp.add_argument("--fifo-depth", type=int, help="UART boards: bytes of the receive FIFO")
    bp.add_argument("--max-payload", type=int, help="bytes of the request buffer")
    bp.add_argument("--ip", help="Ethernet boards: the device's IPv4 address (default 192.168.1.50)")
    bp.add_argument("--port", type=int, help="Ethernet boards: the device's UDP port (default 7000)")
    bp.add_argument("--seed", type=int, default=1, help="nextpnr placement seed")
    bp.add_argument("--no-run", action="store_true", help="open flows: write the project, do not run the tools")
    bp.add_argument("-o", "--output", default="build/boards", help="output folder (default build/boards; "
                    "the build goes to OUTPUT/BOARD)")
    bp.set_defaults(func=_build)

    from hbfp.recipes import DEFAULT_RECIPE, RECIPES
    from hbfp.train import MODELS, OPTIMIZERS

    tp = sub.add_parser("train", help="train digits classifiers (MLP, CNN) and character language models (MLP, "
                        "transformer) in FP32 and HBFP8 with SGD and AdamW; curves and a table")
    tp.add_argument("--device", default="emu", help="device for the HBFP8 runs (default emu)")
    tp.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    tp.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS),
                    help="SGD (momentum 0.9) and/or AdamW (weight decay 0.01); default both")
    tp.add_argument("--recipe", choices=tuple(RECIPES), default=DEFAULT_RECIPE,
                    help=f"the HBFP8 runs' products (hbfp.torch.RECIPES; default {DEFAULT_RECIPE}: gradients rounded "
                    "stochastically)")
    tp.add_argument("--epochs", type=int, default=None,
                    help="epochs of every model (default: hbfp.train.DEFAULT_EPOCHS, 10 for digits, 5 of 200 "
                    "batches for the language models)")
    tp.add_argument("--seed", type=int, default=0)
    tp.add_argument("--weight-storage", choices=("hbfp16", "fp32"), default="hbfp16",
                    help="master weights of the HBFP8 runs: hbfp16 (wide weight storage, default) or fp32")
    tp.add_argument("--sim-epochs", type=int, default=1, help="epochs of the MLP on the sim backend (0: skip)")
    tp.add_argument("--sim", default="sim", help="the simulator spec (default sim: the default 8x8 top)")
    tp.add_argument("-o", "--out", default="build/demo", help="output folder (default build/demo)")
    tp.add_argument("--nproc", type=int, default=1,
                    help="ranks of a data-parallel training (torch.distributed over gloo; default 1). Launched here, "
                    "or by torchrun (then --nproc may be left out). Each rank opens its own device: --device may "
                    "name the rank, e.g. tcp:127.0.0.1:{7000+rank}")
    tp.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                    help="data-parallel ranks: how long a rank waits for the others in a collective before it gives "
                    "up; a rank that dies or stops then ends the training with one line (default 300)")
    tp.add_argument("--grad-compression", choices=("none", "hbfp8", "mxint8"), default="none",
                    help="how ranks exchange gradients: fp32 all-reduce (none, default) or BFP codes and exponents "
                    "(docs/scaleout.md)")
    tp.add_argument("--grad-exchange", choices=("two_step", "gather"), default="two_step",
                    help="a compressed exchange in two steps (all-to-all of shards, a sum per shard, all-gather of "
                    "the quantized sums: about 4x fewer bytes than fp32 at any number of ranks; default) or one "
                    "(all-gather of every rank's codes: one rounding fewer, bytes growing with the ranks)")
    tp.add_argument("--error-feedback", action="store_true",
                    help="each rank adds what its gradient's quantization dropped to its next gradient")
    tp.add_argument("--no-grad-overlap", dest="grad_overlap", action="store_false",
                    help="exchange each gradient bucket before backward goes on (default: on a worker thread, "
                    "while backward goes on)")
    tp.set_defaults(func=_train)

    from hbfp.contract import UNARY_FUNCTIONS

    info = sub.add_parser("info", help="a device's identity (array, format, buffers, units) and the device backends")
    info.add_argument("device", nargs="?", default="emu", help="device spec (default emu; e.g. tcp:127.0.0.1:7000, "
                      "serial:/dev/ttyUSB0, sim)")
    info.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each reply (default 5)")
    info.set_defaults(func=_info)

    gm = sub.add_parser("gemm", help="a random product on a device: checked bit for bit against the golden model, "
                        "with throughput, bytes on the link per MAC and device utilization")
    gm.add_argument("device", help="device spec (emu, emu:rows=4,cols=4,size=48, tcp:HOST:PORT, serial:PORT, sim)")
    gm.add_argument("--m", type=int, default=96, help="rows of the output (default 96)")
    gm.add_argument("--n", type=int, default=96, help="columns of the output (default 96)")
    gm.add_argument("--k", type=int, default=96, help="the inner dimension (default 96)")
    gm.add_argument("--out", choices=("fp32", "bf16", "bfp"), default="fp32", help="output format (default fp32)")
    gm.add_argument("--input", choices=("codes", "fp32", "bf16"), default="codes",
                    help="operands sent as codes (quantized by the host) or values the device quantizes (default codes)")
    gm.add_argument("--rounding", choices=("nearest_even", "toward_zero", "stochastic"), default="nearest_even")
    gm.add_argument("--activation", choices=UNARY_FUNCTIONS, help="activation of the epilogue")
    gm.add_argument("--bias", action="store_true", help="add a random bias")
    gm.add_argument("--transpose-a", action="store_true", help="store A as K x M")
    gm.add_argument("--transpose-b", action="store_true", help="store B as N x K")
    gm.add_argument("--seed", type=int, default=0, help="operands and stochastic rounding (default 0)")
    gm.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each reply (default 5)")
    gm.set_defaults(func=_gemm)

    import inspect

    from hbfp.host.server import Server

    # The server's defaults, as its constructor defines them.
    served = {name: p.default for name, p in inspect.signature(Server).parameters.items()}
    srv = sub.add_parser("sim-server", help="serve a device (default: the simulator) on a local TCP port to several "
                                            "clients at once or, with --pty, on a pseudo-terminal (a serial port), "
                                            "with --udp, on a UDP port")
    srv.add_argument("--device", default="sim", help="device spec to serve (default sim; emu for a quick test)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=7000, help="TCP port (default 7000; 0 picks a free one)")
    srv.add_argument("--connections", type=int, help="stop after this many connections (default: no limit)")
    srv.add_argument("--idle-timeout", type=float, help="stop after this many seconds without a client or a byte")
    srv.add_argument("--client-timeout", type=float, metavar="SECONDS",
                     help=f"close a connection that sends no complete frame for this long (default "
                          f"{served['client_timeout']:g}; 0: never)")
    srv.add_argument("--max-queued", type=int, metavar="BYTES",
                     help="stop running and reading a client's requests while this many bytes of its replies are "
                          f"unread (default {served['max_queued']})")
    srv.add_argument("--max-clients", type=int, metavar="N",
                     help=f"clients served at once; more are closed (default {served['max_clients']})")
    srv.add_argument("--reply-timeout", type=float, metavar="SECONDS",
                     help=f"a device silent this long has lost a request; its client gets no reply (default "
                          f"{served['reply_timeout']:g})")
    srv.add_argument("--pty", action="store_true",
                     help="serve on a pseudo-terminal instead of TCP: prints serial:/dev/pts/N for serial: clients "
                          "(with sim:...,uart=N the bytes also cross the gateware's UART)")
    srv.add_argument("--udp", type=int, metavar="PORT",
                     help="serve on this UDP port instead of TCP (0 picks a free one): prints udp:HOST:PORT for udp: "
                          "clients, one peer at a time, as a board's network link")
    srv.add_argument("--drop", type=float, default=0.0, metavar="P",
                     help="with --udp: lose each datagram, either way, with probability P (tests of recovery)")
    srv.add_argument("--corrupt", type=float, default=0.0, metavar="P",
                     help="with --udp: flip a bit of each datagram's stream bytes with probability P")
    srv.set_defaults(func=_sim_server)
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
    try:
        return args.func(args)
    except contract.ConfigError as e:
        print(f"hbfp {args.command}: {e}", file=sys.stderr)  # a configuration no core can have: one line
        return 2
    except ModuleNotFoundError as e:
        from hbfp.host.registry import missing_extra

        hint = missing_extra(e)
        if hint is None:
            raise
        # A host-only install: the HDL, simulator or training packages are extras.
        print(f"hbfp {args.command} needs an optional part: {hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
