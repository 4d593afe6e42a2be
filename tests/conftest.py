"""What several test files share: the small ``emu`` configuration, opening ``emu`` byte
devices from an option string, and the ``sim`` tests' requirements (a Verilator build
toolchain; one pytest-xdist worker for every test of the simulated top, which shares its
built library and one open device)."""

from __future__ import annotations

import os

import pytest

#: ``CoreConfig`` fields of a 4x4 array with 48x48 buffers: everything above 48 is tiled.
SMALL = dict(rows=4, cols=4, size=48)

#: The configuration of the simulated top that the ``sim`` tests open (small: the build
#: dominates their time; a short frame timeout keeps timeouts cheap).
SIM_TOP_ARG = os.environ.get(
    "HBFP_SIM_TEST_CONFIG",
    "rows=4,cols=4,tile=16x16,size=32,stream_bytes=4,functions=relu+gelu,frame_timeout=4096")


def _sim_unavailable() -> str | None:
    try:
        from hbfp.sim.harness import build
    except Exception as e:  # a broken tree mid-edit: skip rather than fail at collection
        return f"hbfp.sim.harness unavailable: {e!r}"
    return build.unavailable()


#: Marks of a test of the simulated top: skipped without a Verilator toolchain, and kept on
#: one pytest-xdist worker (``--dist loadgroup``) with tests/test_sim_device.py.
SIM_MARKS = [
    pytest.mark.skipif(_sim_unavailable() is not None, reason=str(_sim_unavailable())),
    pytest.mark.xdist_group("sim_device"),
]


def requires_sim(test):
    """Decorator: ``SIM_MARKS`` on one test (``pytestmark = SIM_MARKS`` for a whole file)."""
    for mark in SIM_MARKS:
        test = mark(test)
    return test


def open_emu(spec: str = ""):
    """An ``EmuDevice`` (the byte device itself) from an ``emu:`` option string."""
    from hbfp.host.emu import EmuDevice, parse_options

    return EmuDevice(**parse_options(spec))


@pytest.fixture(scope="session")
def sim_top_device():
    """The simulated top of ``SIM_TOP_ARG`` (built on first use, then cached under build/),
    opened once per worker."""
    try:
        from hbfp.hw.top import AcceleratorTop  # noqa: F401
    except Exception as e:
        pytest.skip(f"hw.top.AcceleratorTop unavailable: {e!r}")
    from hbfp.sim.device import backend

    dev = backend.open(SIM_TOP_ARG, progress=lambda msg: print(msg, flush=True))
    yield dev
    dev.close()


@pytest.fixture
def sim_top(sim_top_device):
    """``sim_top_device`` after a power-on reset."""
    sim_top_device.reset()
    return sim_top_device


#: Tests that ``make test`` leaves to ``make sim-full`` (``HBFP_SIM_FULL=1``) to keep within its
#: budget of 15 minutes on 2 cores, each with what still checks the same in ``make test``: every
#: one is a second build (another simulator, a larger array) of a unit that make test runs.
SIM_FULL_ONLY = {
    "tests/test_hw_gemm_core.py::test_gemm_core_equals_golden[verilator-4x4-mxint8]": "the MXINT8 core on Icarus",
    "tests/test_hw_gemm_core.py::test_gemm_core_equals_golden[icarus-8x8-hbfp8]": "the 8x8 core on Verilator",
    "tests/test_hw_gemm_core.py::test_gemm_core_equals_golden[verilator-4x4-hbfp8-l1-ecp5]":
        "the ECP5 primitives' models in the block RAM and MAC array testbenches, both simulators",
    "tests/test_hw_top.py::test_top_protocol[bytes1-verilator]": "the 1-byte link in the UART top's testbench",
    "tests/test_hw_top.py::test_top_protocol[reduced-verilator]":
        "reduced devices against emu (test_emu_gateware.py) and the iCEBreaker's on sim",
    "tests/test_hw_quantize.py::test_quantize_cocotb[mxint8-verilator]": "its Icarus run",
    "tests/test_hw_quantize.py::test_quantize_cocotb[m16_bf16_4x4-verilator]": "its Icarus run",
    "tests/test_hw_quantize.py::test_quantize_cocotb[m2_bf16_beat_is_tile-verilator]": "its Icarus run",
    "tests/test_hw_mac_array.py::test_mac_array_equals_partial_sums[8-8-24-8-8-20-1-verilator]": "its Icarus run",
    "tests/test_hw_mac_array.py::test_mac_array_equals_partial_sums[8-8-32-8-8-None-1-verilator]": "its Icarus run",
    "tests/test_hw_mac_array.py::test_mac_array_equals_partial_sums[8-8-24-8-8-None-2-verilator]": "its Icarus run",
    "tests/test_hw_mac_array.py::test_mac_array_equals_partial_sums[4-4-24-8-8-0-4-verilator]": "its Icarus run",
    "tests/test_hw_buffers.py::test_operand_buffer_for_ecp5_reads_rows_and_columns[8-32-96-verilator]":
        "its Icarus run",
    "tests/test_hw_float_mac.py::test_float_mac_array_equals_golden[4-4-fp16-4-0-False-verilator]":
        "the 2x2 fp16 arrays (DSP and Booth products) on both simulators",
    "tests/test_boards.py::test_quartus_project_is_complete[stratix5-10.0-pins1]": "the DE10-Nano's Quartus project",
    # The Stratix board's own 32x32 configuration: two minutes to write its project.
    "tests/test_boards.py::test_stratix5_clock_is_the_kits_lvds_pair": "the DE10-Nano's clock and I/O standards",
    "tests/test_boards.py::test_stratix5_multipliers_fit_its_dsp_blocks":
        "dsp_macs' split between DSP and LUT PEs (tests/test_hw_mac_array.py, test_hw_lut_mult.py)",
    "tests/test_hw_rgmii.py::test_rgmii_cocotb[icarus]": "its run with the delays on, Icarus too",
}


def pytest_collection_modifyitems(config, items):
    """Deselects ``SIM_FULL_ONLY`` outside ``make sim-full``; a listed test that its file no
    longer has is an error (a renamed test would otherwise silently run in neither)."""
    collected = {item.nodeid for item in items}
    files = {nodeid.split("::")[0] for nodeid in collected}
    missing = [t for t in SIM_FULL_ONLY if t.split("::")[0] in files and t not in collected
               and not config.option.keyword and not config.option.markexpr]
    if missing and not any("::" in str(a) for a in config.args):
        raise pytest.UsageError(f"tests/conftest.py SIM_FULL_ONLY names tests that do not exist: {missing}")
    if os.environ.get("HBFP_SIM_FULL") == "1":
        return
    left = [item for item in items if item.nodeid in SIM_FULL_ONLY]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if item.nodeid not in SIM_FULL_ONLY]


@pytest.fixture
def recorded_builds(monkeypatch):
    """``hbfp.sim.device.top_library`` with ``build_library`` replaced by a recorder (nothing
    is built): the calls, (make, config, keywords) each."""
    from pathlib import Path

    from hbfp.sim import device as sim_device

    calls = []

    def fake(make, config, **kw):
        calls.append((make, config, kw))
        return Path("/nonexistent/libhbfpsim.so")

    monkeypatch.setattr(sim_device.build, "build_library", fake)
    return calls


def udp_server_gemm(device: str, *, timeout: float = 120) -> str:
    """``hbfp sim-server --device DEVICE --udp 0`` in a subprocess, one ``hbfp gemm`` over the
    ``udp:`` address it prints (asserted bit-exact), then SIGTERM; the server's output (its
    datagram counts), after asserting that it exited cleanly."""
    import re
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "hbfp.cli", "sim-server", "--device", device, "--udp", "0",
                          "--idle-timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        spec = re.search(r"udp:[\d.]+:\d+", line).group(0)
        r = subprocess.run([sys.executable, "-m", "hbfp.cli", "gemm", spec, "--m", "50", "--n", "40", "--k", "70"],
                           capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0 and "bit-exact" in r.stdout, r.stdout + r.stderr
    finally:
        p.terminate()  # SIGTERM: the server stops and says what it served
        try:
            out, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise
    assert p.returncode == 0 and "datagrams: " in out, out
    return out
