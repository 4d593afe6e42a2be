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
