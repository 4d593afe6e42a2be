"""The ``hbfp`` command line. Subcommands grow with the project; each is a thin wrapper.

Every command checks all of its arguments, opens its devices (once) and checks its output
folder before it trains, builds or writes anything. A user's mistake is one line on stderr,
``hbfp COMMAND: message``, and exit status 2, as argparse's own errors (``UsageError``); a
failure that is no bug (a device that does not answer, FPGA tools that fail) is one line and
exit status 1 (``Failure``); anything else is a bug and keeps its traceback (exit status 1)."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

import numpy as np

from hbfp import contract


class UsageError(Exception):
    """A user's mistake, found before any work: ``hbfp COMMAND: message``, exit status 2."""


class Failure(Exception):
    """A failure that is not a bug (a device that does not answer, a build that fails): one
    line, ``hbfp COMMAND: message``, exit status 1."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in the commands' form: one line ``hbfp COMMAND: message``
    (``--help`` shows the usage), exit status 2."""

    def error(self, message):
        message = re.sub(r"^argument (\S+): (?=must )", r"\1 ", message)  # "--epochs must be at least 1, got 0"
        self.exit(2, f"{self.prog}: {message.removeprefix('argument ')}\n")


def _range(low, high=None) -> str:
    return f"at least {low}" if high is None else f"{low} .. {high}"


def _int(low: int, high: int | None = None):
    """An argparse type: an integer from ``low`` to ``high`` (None: no upper bound)."""

    def parse(text: str) -> int:
        value = int(text)  # a ValueError: argparse says "invalid int value"
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {_range(low, high)}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def _float(low: float, high: float | None = None, *, positive: bool = False):
    """An argparse type: a finite number from ``low`` to ``high``, above ``low`` if ``positive``."""

    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value < low or (positive and value == low) or (high is not None and value > high):
            want = "a positive number" if positive and low == 0 else _range(low, high)
            raise argparse.ArgumentTypeError(f"must be {want}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


def _folder(text: str) -> str:
    """An argparse type: an output folder's name (not empty: that would be the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must name a folder, got an empty name")
    return text


def _spec(text: str) -> str:
    """An argparse type: a device spec, NAME or NAME:ARG (checked further when it is opened)."""
    if not text.partition(":")[0].strip():
        raise argparse.ArgumentTypeError(f"must be a device spec NAME[:ARG] (e.g. emu, sim, tcp:127.0.0.1:7000), "
                                         f"got {text!r}")
    return text


#: Seeds: 32 bits, as the device's stochastic rounding takes them (hbfp.host masks them so).
SEED = _int(0, 2**32 - 1)
#: Port numbers: TCP and UDP's 16 bits (0: a free one, where a server picks).
PORT = _int(0, 65535)
SECONDS = _float(0, positive=True)


def _open(spec: str, option: str | None = None, hint: str = "", **options):
    """``hbfp.host.open(spec)``, before any work: a spec that names no backend or that its
    backend refuses (an option, a missing extra) is the user's mistake; a device that does not
    answer or speaks another ABI is a ``Failure``. ``option``: the option that gave ``spec``;
    ``hint``: what to add to the user's mistake."""
    import hbfp.host as host

    try:
        return host.open(spec, **options)
    except host.BackendError as e:
        raise UsageError(f"{option + ': ' if option else ''}{e}{hint}") from None
    except host.HbfpError as e:
        raise Failure(f"{option + ' ' if option else ''}{spec}: {e}") from None


def _check_backend(spec: str, option: str, hint: str = "") -> None:
    """The backend that ``spec`` names loads (no device is opened): else the user's mistake."""
    from hbfp.host import BackendError
    from hbfp.host.registry import load_backend, parse_spec

    try:
        load_backend(parse_spec(spec)[0])
    except BackendError as e:
        raise UsageError(f"{option}: {e}{hint}") from None


#: What ``hbfp train`` adds to a ``--sim`` it cannot use.
SIM_HINT = " (--sim-epochs 0: no run on the RTL)"


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
    from hbfp.outputs import Output

    try:
        cfg = _config_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.only:
        known = list(components(cfg))
        unknown = [name for name in args.only if name not in known]
        if unknown:
            raise UsageError(f"unknown component(s) {', '.join(map(repr, unknown))} for --only; this configuration "
                             f"has {', '.join(known)}")
    output = Path(args.output)
    # before any work: a file or a link in the way, files of the user's it would overwrite, a
    # folder it cannot write (OutputError: exit status 2)
    out = Output(output, generated_files(cfg, args.only), command="hbfp verilog", manifest=MANIFEST)
    print(f"GEMM core {cfg.rows}x{cfg.cols}, {cfg.mantissa_bits}-bit codes, tile {cfg.tile[0]}x{cfg.tile[1]}, "
          f"buffers {cfg.size}x{cfg.size} -> {args.output}")
    try:
        out.begin()
        generate(cfg, output, only=args.only, write=out.put)
    except OSError as e:
        raise Failure(f"cannot write {output}: {e}") from None
    return 0


def _build(args) -> int:
    from pathlib import Path

    from hbfp.host.protocol import UNITS
    from hbfp.hw import boards
    from hbfp.outputs import OutputError, check_folder

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
            raise UsageError(f"--ip: {e}") from None
    if args.format:
        overrides["mantissa_bits"], overrides["tile"] = FORMATS[args.format]
    if args.mantissa_bits is not None:
        overrides["mantissa_bits"] = args.mantissa_bits
    if args.tile is not None:
        overrides["tile"] = tuple(args.tile)
    if args.functions:
        overrides["functions"] = _functions_from_args(args)
    overrides.update(_units_from_args(args))
    # Before any work: the board and its configuration, the output folder, the FPGA tools.
    try:
        board, _, _ = boards.board_config(args.board, **overrides)
    except ValueError as e:
        raise UsageError(str(e)) from None
    check_folder(Path(args.output) / board.name, "hbfp build")
    run = not args.no_run and board.flow != "quartus"
    if run:
        try:
            boards.yowasp_env(board.flow)
        except RuntimeError as e:  # the open FPGA flow is an extra (hbfp[fpga])
            raise UsageError(f"{e} (or --no-run: the project only)") from None
    try:
        result = boards.build(args.board, args.output, run=run, seed=args.seed, **overrides)
    except OutputError:  # files of the user's where the elaborated project's go
        raise
    except (ValueError, RuntimeError) as e:
        raise Failure(str(e)) from None
    except OSError as e:
        raise Failure(f"cannot write {args.output}: {e}") from None
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

    with _open(args.device, timeout=args.timeout) as dev:
        try:
            ident = dev.info()
        except host.HbfpError as e:
            raise Failure(f"{args.device}: {e}") from None
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
    print("backends (entry-point group hbfp.devices):")
    for name, b in sorted(host.backends().items()):
        if b.ok:
            print(f"  {name:<8} ABI {b.abi[0]}.{b.abi[1]}  {b.description}")
        else:
            print(f"  {name:<8} unavailable: {b.error}")
    return 0


def _gemm(args) -> int:
    import time

    import hbfp.host as host
    from hbfp.golden.bfp import BFPTensor

    m, n, k = args.m, args.n, args.k
    dev = _open(args.device, timeout=args.timeout)
    rng = np.random.default_rng(args.seed)
    a = rng.standard_normal((k, m) if args.transpose_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if args.transpose_b else (k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if args.bias else None
    kw = dict(bias=bias, activation=args.activation, out=args.out, transpose_a=args.transpose_a,
              transpose_b=args.transpose_b, input=args.input, rounding=args.rounding, seed=args.seed)
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
        except host.HbfpError as e:  # a product this device cannot run (its units, its tiles) is the user's
            raise (UsageError if isinstance(e, (ValueError, TypeError)) else Failure)(str(e)) from None
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


def _check_address(host: str, port: int, udp: bool) -> None:
    """Bind ``host:port`` once and let it go, before the device is opened: a name that does not
    resolve, an address that is not this machine's or a port in use is the user's mistake."""
    import socket

    kind = socket.SOCK_DGRAM if udp else socket.SOCK_STREAM
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=kind, flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind) as s:
            if not udp:  # as the server's socket (socket.create_server): a port in TIME_WAIT is free
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as e:
        raise UsageError(f"cannot serve on {host}:{port}{' (UDP)' if udp else ''}: {e.strerror or e}") from None


def _sim_server(args) -> int:
    from hbfp.host import BackendError, HbfpError
    from hbfp.host.registry import open_backend
    from hbfp.host.server import PtyServer, Server, UdpServer
    from hbfp.host.transports import Transport, TransportDevice

    tcp_only = {"--connections": args.connections, "--client-timeout": args.client_timeout,
                "--max-queued": args.max_queued, "--max-clients": args.max_clients,
                "--reply-timeout": args.reply_timeout}
    given = [name for name, value in tcp_only.items() if value is not None]
    if args.pty and args.udp is not None:
        raise UsageError("--pty and --udp are two different links: give one")
    if (args.pty or args.udp is not None) and given:
        link = "a pseudo-terminal (--pty)" if args.pty else "a UDP port (--udp)"
        raise UsageError(f"{', '.join(given)} are options of the TCP server; {link} has one peer and no connections "
                         "(use --idle-timeout)")
    faults = [name for name, value in (("--drop", args.drop), ("--corrupt", args.corrupt)) if value]
    if faults and args.udp is None:
        raise UsageError(f"{', '.join(faults)} are faults of the UDP link (--udp)")
    if not args.pty:
        _check_address(args.host, args.port if args.udp is None else args.udp, udp=args.udp is not None)
    try:
        device = open_backend(args.device)
    except BackendError as e:
        raise UsageError(str(e)) from None
    except HbfpError as e:  # a device to relay that does not answer, another ABI
        raise Failure(f"{args.device}: {e}") from None
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
        close = getattr(device, "close", None)
        if close:
            close()
        raise Failure(f"cannot serve on {where}: {e}") from None
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
        raise Failure(f"{args.device}: {e}") from None
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
    """The report's folder (``hbfp.train.report_output``), checked before any training:
    ``OutputError`` (exit status 2) if it cannot be used."""
    from pathlib import Path

    from hbfp import train as tr

    return tr.report_output(Path(args.out))


def _train_needs(args) -> None:
    """Import now what the trainings and the report need (``hbfp[train]``), so that a missing
    package is said before any training, not after the first runs."""
    import importlib

    from hbfp import train as tr

    digits = not args.model and set(args.models) & set(tr.CLASSIFIERS)
    for name in ("torch", "matplotlib", "tqdm") + (("sklearn",) if digits else ()):  # the curves, progress bars
        importlib.import_module(name)


def _load_task(args):
    """``--model MODULE:FACTORY``: the module imported as ``python -m`` finds one (the current
    folder first, then PYTHONPATH), the factory called and its result checked (``load_task``)."""
    from hbfp import train as tr

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return tr.load_task(args.model, seed=args.seed)
    except tr.TaskError as e:
        raise UsageError(f"--model {args.model}: {e}") from None


def _rank_spec(args, rank: int) -> str:
    from hbfp import distributed as hd

    try:
        return hd.rank_spec(args.device, rank)
    except ValueError as e:
        raise UsageError(f"--device: {e}") from None


def _train(args) -> int:
    if args.error_feedback and args.grad_compression == "none":
        raise UsageError("--error-feedback needs --grad-compression hbfp8 or mxint8")
    if args.sim_epochs is None:  # the RTL run is the demo's MLP; with your own model, on request
        args.sim_epochs = 0 if args.model else 1
    _train_output(args)
    # The backends the specs name, before hbfp.distributed imports torch: a mistyped name
    # answers at once (each rank's spec is checked again, and the devices opened, below).
    _check_backend(args.device, "--device")
    if args.sim_epochs:
        _check_backend(args.sim, "--sim", SIM_HINT)
    from hbfp import distributed as hd

    if hd.launched():  # a rank started by torchrun (or by the launcher below)
        return _train_rank(args)
    if args.nproc == 1:
        return _train_ranks(args, 0, 1)
    # Each rank opens its own device: here, before any rank starts, every rank's spec names a
    # backend that loads; the packages, your model.
    for rank in range(args.nproc):
        _check_backend(_rank_spec(args, rank), "--device")
    _train_needs(args)
    if args.model:
        _load_task(args)
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
    why = _why_ranks_ended(failed, stopped, said, args.timeout)
    print(f"\nhbfp train: {why}", file=sys.stderr)  # on a line of its own, after any progress bar
    return 1


def _why_ranks_ended(failed: list[tuple[int, int]], stopped: list[int], said: dict, timeout: float) -> str:
    """The line that says why a data-parallel training ended: ``failed`` (rank, exit code) of the
    ranks that ended badly, ``stopped`` the ranks found stopped, ``said`` the line each failed
    rank sent. A stopped rank is the cause whatever way its peers ended: a peer's timed-out
    collective may raise, or abort the process (SIGABRT) from gloo's own thread. Else, of the
    ranks that ended in the same moment, a rank killed by another signal, then one that failed
    with a line of its own, comes before one that aborted: gloo aborts a rank whose peer went
    away, so a SIGABRT is the others' consequence."""
    import signal

    if stopped:
        rank = failed[0][0]
        return (f"rank {', '.join(map(str, stopped))} stopped answering: rank {rank} gave up waiting for it after "
                f"--timeout {timeout:g} s")

    def order(item):
        rank, code = item
        killed = code < 0 and code != -signal.SIGABRT
        return (0 if killed else 1 if rank in said else 2 if code != -signal.SIGABRT else 3, rank)

    rank, code = min(failed, key=order)
    if code < 0:
        return f"rank {rank} died ({signal.Signals(-code).name})"
    if rank in said:
        return f"rank {rank} failed: {said[rank]}"
    return f"rank {rank} exited with status {code}"


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` was stopped (SIGSTOP, a debugger), where /proc says so."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _spawned_rank(rank: int, args, port: int, errors) -> None:
    """A rank started by ``_launch_ranks``; ``errors``: its end of the pipe for the line it fails with."""
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
    import torch.distributed as dist

    from hbfp import distributed as hd

    world = int(os.environ["WORLD_SIZE"])
    if args.nproc not in (1, world):
        raise UsageError(f"--nproc {args.nproc} but the launcher started {world} ranks")
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

    from hbfp import host, recipes
    from hbfp import train as tr

    out = Path(args.out)
    lead = rank == 0  # the rank that prints and writes the report
    output = _train_output(args) if lead else None
    # Before any training: the device (opened once), the recipe on it, the packages, your
    # model, and the simulator (its build may take minutes: last).
    spec = _rank_spec(args, rank)
    device = _open(spec, "--device")
    try:
        recipes.resolve(args.recipe).check(device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    _train_needs(args)
    task = _load_task(args) if args.model else None
    sim = None
    if args.sim_epochs and world == 1:
        print(f"building / opening the simulator ({args.sim}) ...", flush=True)
        t0 = time.perf_counter()
        sim = _open(args.sim, "--sim", SIM_HINT)
        opened = time.perf_counter() - t0
        print(f"simulator ready in {opened:.1f} s", flush=True)
    runs, extra, ok = [], [], True
    if world > 1 and lead:
        extra.append(f"data-parallel on {world} ranks (torch.distributed, gloo), one device per rank "
                     f"({_rank_spec(args, 0)} on rank 0), gradients exchanged as {args.grad_compression}"
                     + (f" ({args.grad_exchange.replace('_', '-')}{', error feedback' if args.error_feedback else ''})"
                        if args.grad_compression != "none" else "") + ".")
    for kind in [task] if task is not None else args.models:
        name = task.name if task is not None else kind
        for optimizer in args.optimizers:
            pair = []
            for precision in ("fp32", "hbfp8"):
                epochs = args.epochs if args.epochs is not None else tr.DEFAULT_EPOCHS.get(name, tr.TASK_EPOCHS)
                r = tr.train(kind, precision, device=device if precision == "hbfp8" else None,
                             device_name=spec if precision == "hbfp8" else None, epochs=epochs, seed=args.seed,
                             weight_storage=args.weight_storage, grad_compression=args.grad_compression,
                             grad_exchange=args.grad_exchange, error_feedback=args.error_feedback,
                             grad_overlap=args.grad_overlap, progress=lead, optimizer=optimizer, recipe=args.recipe)
                if lead:
                    print(f"{name} {optimizer} {precision}: {tr._metric(r)} ({r.seconds:.1f} s)"
                          + (f", {r.allreduce_bytes:,} bytes sent in gradient exchanges, ranks "
                             f"{'equal' if r.params_equal_across_ranks else 'DIFFERENT'}" if world > 1 else ""),
                          flush=True)
                ok &= r.params_equal_across_ranks is not False
                runs.append(r)
                pair.append(r)
            # The demo's models have targets (the exit status says whether they were met); your
            # own model gets the comparison alone.
            demo = task is None
            if pair[0].metric == "loss":
                gap = 100 * (pair[1].val_loss - pair[0].val_loss) / pair[0].val_loss
                side = "above" if gap >= 0 else "below"
                what = "validation" if kind in tr.LANGUAGE_MODELS else "test"
                extra.append(f"{name} {optimizer}: HBFP8 {what} loss {abs(gap):.2f}% {side} FP32's"
                             + (" (target: within 3%)." if demo else "."))
                ok &= gap <= 3.0 or not demo
            else:
                gap = 100 * (pair[0].final_accuracy - pair[1].final_accuracy)
                side = "below" if gap >= 0 else "above"
                extra.append(f"{name} {optimizer}: HBFP8 test accuracy {abs(gap):.2f} percentage points {side} FP32"
                             + (" (target: within 1)." if demo else "."))
                ok &= abs(gap) <= 1.0 or not demo
    if args.sim_epochs and world > 1:
        if lead:
            extra.append("(the sim run is left out of data-parallel trainings: run it with --nproc 1)")
    elif sim is not None:
        # The same model on the RTL: every batch loss must equal the emu run's, bit for bit.
        kind = task if task is not None else "mlp"
        name = task.name if task is not None else "mlp"
        ref = tr.train(kind, "hbfp8", device=host.open("emu"), device_name="emu", epochs=args.sim_epochs,
                       seed=args.seed, progress=False, weight_storage=args.weight_storage, recipe=args.recipe)
        r = tr.train(kind, "hbfp8", device=sim, device_name=args.sim, epochs=args.sim_epochs, seed=args.seed,
                     weight_storage=args.weight_storage, recipe=args.recipe)
        runs.append(r)
        same = ref.batch_losses == r.batch_losses
        ok &= same
        extra.append(f"{name} on {args.sim} (the RTL under Verilator), {args.sim_epochs} epoch(s), {len(r.batch_losses)} "
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

    p = _Parser(prog="hbfp", description="Hybrid Block Floating Point accelerator tools")
    p.add_argument("--version", action="version", version=f"hbfp {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "golden-demo",
        help="quantize a random matrix product with HBFP8 and MXINT8; print errors and bytes saved",
    )
    demo.add_argument("--m", type=_int(1), default=256, help="rows of A (default 256)")
    demo.add_argument("--k", type=_int(1), default=768, help="columns of A, rows of B (default 768)")
    demo.add_argument("--n", type=_int(1), default=192, help="columns of B (default 192)")
    demo.add_argument("--seed", type=SEED, default=0, help="of the random operands (default 0)")
    demo.set_defaults(func=_golden_demo)

    vl = sub.add_parser("verilog", help="write the Verilog of the GEMM core and its components, and params.json")
    add_config_arguments(vl)
    vl.add_argument("-o", "--output", type=_folder, default="build/verilog", help="output folder (default build/verilog)")
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
    bp.add_argument("--functions", nargs="+", choices=(*contract.FUNCTIONS, "none"),
                    help="activation units to build (default: the board's; none: no unit)")
    add_units_argument(bp, "the board's")
    bp.add_argument("--baud", type=_int(1), help="UART boards: line rate (default: the board's, hbfp.hw.boards.DEFAULT_BAUD)")
    bp.add_argument("--fifo-depth", type=_int(1), help="UART boards: bytes of the receive FIFO")
    bp.add_argument("--max-payload", type=_int(1), help="bytes of the request buffer")
    bp.add_argument("--ip", help="Ethernet boards: the device's IPv4 address (default 192.168.1.50)")
    bp.add_argument("--port", type=_int(1, 65535), help="Ethernet boards: the device's UDP port (default 7000)")
    bp.add_argument("--seed", type=_int(0, 2**31 - 1), default=1, help="nextpnr placement seed (default 1)")
    bp.add_argument("--no-run", action="store_true", help="open flows: write the project, do not run the tools")
    bp.add_argument("-o", "--output", type=_folder, default="build/boards", help="output folder (default build/boards; "
                    "the build goes to OUTPUT/BOARD)")
    bp.set_defaults(func=_build)

    from hbfp.recipes import DEFAULT_RECIPE, RECIPES
    from hbfp.train import MODELS, OPTIMIZERS

    tp = sub.add_parser("train", help="train digits classifiers (MLP, CNN) and character language models (MLP, "
                        "transformer), or your own model (--model), in FP32 and HBFP8 with SGD and AdamW; curves and "
                        "a table")
    tp.add_argument("--device", type=_spec, default="emu", help="device for the HBFP8 runs (default emu)")
    which = tp.add_mutually_exclusive_group()
    which.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS),
                       help="the demo's models (default all)")
    which.add_argument("--model", type=_task_spec, metavar="MODULE:FACTORY",
                       help="your own model instead: FACTORY() in MODULE (imported from the current folder or "
                       "PYTHONPATH) returns a dict with model (an nn.Module), train and test (torch Datasets of (x, y)) "
                       "and optionally loss (default cross-entropy) and metric (accuracy or loss); e.g. "
                       "examples.my_model:build")
    tp.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS),
                    help="SGD (momentum 0.9) and/or AdamW (weight decay 0.01); default both")
    tp.add_argument("--recipe", choices=tuple(RECIPES), default=DEFAULT_RECIPE,
                    help=f"the HBFP8 runs' products (hbfp.torch.RECIPES; default {DEFAULT_RECIPE}: gradients rounded "
                    "stochastically)")
    tp.add_argument("--epochs", type=_int(1), default=None,
                    help="epochs of every model (default: hbfp.train.DEFAULT_EPOCHS, 10 for digits, 5 of 200 "
                    "batches for the language models; 10 for your own)")
    tp.add_argument("--seed", type=SEED, default=0, help="initial weights, batch order, stochastic rounding (default 0)")
    tp.add_argument("--weight-storage", choices=("hbfp16", "fp32"), default="hbfp16",
                    help="master weights of the HBFP8 runs: hbfp16 (wide weight storage, default) or fp32")
    tp.add_argument("--sim-epochs", type=_int(0), default=None,
                    help="epochs of the MLP (with --model: of yours) on the sim backend, whose batch losses must equal "
                    "emu's bit for bit (0: skip; default 1, with --model 0)")
    tp.add_argument("--sim", type=_spec, default="sim", help="the simulator spec (default sim: the default 8x8 top)")
    tp.add_argument("-o", "--out", type=_folder, default="build/demo", help="output folder (default build/demo)")
    tp.add_argument("--nproc", type=_int(1), default=1,
                    help="ranks of a data-parallel training (torch.distributed over gloo; default 1). Launched here, "
                    "or by torchrun (then --nproc may be left out). Each rank opens its own device: --device may "
                    "name the rank, e.g. tcp:127.0.0.1:{7000+rank}")
    tp.add_argument("--timeout", type=SECONDS, default=300.0, metavar="SECONDS",
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
                    help="exchange each gradient bucket before backward goes on (default: its collectives run "
                    "on gloo's threads while backward goes on)")
    tp.set_defaults(func=_train)

    from hbfp.contract import UNARY_FUNCTIONS

    info = sub.add_parser("info", help="a device's identity (array, format, buffers, units) and the device backends")
    info.add_argument("device", nargs="?", type=_spec, default="emu", help="device spec (default emu; e.g. tcp:127.0.0.1:7000, "
                      "serial:/dev/ttyUSB0, sim)")
    info.add_argument("--timeout", type=SECONDS, default=5.0, help="seconds to wait for each reply (default 5)")
    info.set_defaults(func=_info)

    gm = sub.add_parser("gemm", help="a random product on a device: checked bit for bit against the golden model, "
                        "with throughput, bytes on the link per MAC and device utilization")
    gm.add_argument("device", type=_spec, help="device spec (emu, emu:rows=4,cols=4,size=48, tcp:HOST:PORT, serial:PORT, sim)")
    gm.add_argument("--m", type=_int(1), default=96, help="rows of the output (default 96)")
    gm.add_argument("--n", type=_int(1), default=96, help="columns of the output (default 96)")
    gm.add_argument("--k", type=_int(1), default=96, help="the inner dimension (default 96)")
    gm.add_argument("--out", choices=("fp32", "bf16", "bfp"), default="fp32", help="output format (default fp32)")
    gm.add_argument("--input", choices=("codes", "fp32", "bf16"), default="codes",
                    help="operands sent as codes (quantized by the host) or values the device quantizes (default codes)")
    gm.add_argument("--rounding", choices=("nearest_even", "toward_zero", "stochastic"), default="nearest_even")
    gm.add_argument("--activation", choices=UNARY_FUNCTIONS, help="activation of the epilogue")
    gm.add_argument("--bias", action="store_true", help="add a random bias")
    gm.add_argument("--transpose-a", action="store_true", help="store A as K x M")
    gm.add_argument("--transpose-b", action="store_true", help="store B as N x K")
    gm.add_argument("--seed", type=SEED, default=0, help="operands and stochastic rounding (default 0)")
    gm.add_argument("--timeout", type=SECONDS, default=5.0, help="seconds to wait for each reply (default 5)")
    gm.set_defaults(func=_gemm)

    import inspect

    from hbfp.host.server import Server

    # The server's defaults, as its constructor defines them.
    served = {name: p.default for name, p in inspect.signature(Server).parameters.items()}
    srv = sub.add_parser("sim-server", help="serve a device (default: the simulator) on a local TCP port to several "
                                            "clients at once or, with --pty, on a pseudo-terminal (a serial port), "
                                            "with --udp, on a UDP port")
    srv.add_argument("--device", type=_spec, default="sim", help="device spec to serve (default sim; emu for a quick test)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=PORT, default=7000, help="TCP port (default 7000; 0 picks a free one)")
    srv.add_argument("--connections", type=_int(1), help="stop after this many connections (default: no limit)")
    srv.add_argument("--idle-timeout", type=SECONDS, help="stop after this many seconds without a client or a byte")
    srv.add_argument("--client-timeout", type=_float(0), metavar="SECONDS",
                     help=f"close a connection that sends no complete frame for this long (default "
                          f"{served['client_timeout']:g}; 0: never)")
    srv.add_argument("--max-queued", type=_int(1), metavar="BYTES",
                     help="stop running and reading a client's requests while this many bytes of its replies are "
                          f"unread (default {served['max_queued']})")
    srv.add_argument("--max-clients", type=_int(1), metavar="N",
                     help=f"clients served at once; more are closed (default {served['max_clients']})")
    srv.add_argument("--reply-timeout", type=SECONDS, metavar="SECONDS",
                     help=f"a device silent this long has lost a request; its client gets no reply (default "
                          f"{served['reply_timeout']:g})")
    srv.add_argument("--pty", action="store_true",
                     help="serve on a pseudo-terminal instead of TCP: prints serial:/dev/pts/N for serial: clients "
                          "(with sim:...,uart=N the bytes also cross the gateware's UART)")
    srv.add_argument("--udp", type=PORT, metavar="PORT",
                     help="serve on this UDP port instead of TCP (0 picks a free one): prints udp:HOST:PORT for udp: "
                          "clients, one peer at a time, as a board's network link")
    srv.add_argument("--drop", type=_float(0, 1), default=0.0, metavar="P",
                     help="with --udp: lose each datagram, either way, with probability P (tests of recovery)")
    srv.add_argument("--corrupt", type=_float(0, 1), default=0.0, metavar="P",
                     help="with --udp: flip a bit of each datagram's stream bytes with probability P")
    srv.set_defaults(func=_sim_server)
    return p


#: The extra of the ``hbfp`` distribution each command needs as a whole, named when a package
#: of it is missing (``hbfp train`` needs torch, scikit-learn, matplotlib and tqdm: hbfp[train]).
COMMAND_EXTRAS = {"verilog": "hw", "build": "hw", "train": "train"}


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from hbfp.outputs import OutputError

    try:
        status = args.func(args)
        sys.stdout.flush()  # here, so that a reader that went away is seen here, not at exit
        return status
    except BrokenPipeError:
        # stdout's reader went away (hbfp info emu | head -1): end quietly, as Python's
        # documentation advises (signal module, "Note on SIGPIPE"); stdout now goes nowhere.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (UsageError, contract.ConfigError, OutputError) as e:
        # the user's mistake (an option, a configuration no core can have, an output folder)
        print(f"hbfp {args.command}: {e}", file=sys.stderr)
        return 2
    except Failure as e:
        print(f"hbfp {args.command}: {e}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:
        from hbfp.host.registry import missing_extra

        hint = missing_extra(e, COMMAND_EXTRAS.get(args.command))
        if hint is None:
            raise
        # A host-only install: the HDL, simulator or training packages are extras.
        print(f"hbfp {args.command} needs an optional part: {hint}", file=sys.stderr)
        return 2


def _task_spec(text: str) -> str:
    """An argparse type: ``--model MODULE:FACTORY`` as text (the module is imported later)."""
    from hbfp.train import TaskError, check_task_spec

    try:
        return check_task_spec(text)
    except TaskError:
        raise argparse.ArgumentTypeError(f"must be MODULE:FACTORY (e.g. examples.my_model:build), got {text!r}") from None


if __name__ == "__main__":
    sys.exit(main())
