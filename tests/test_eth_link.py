"""The network link end to end: the ``sim`` backend with ``link=eth`` (``hw.eth_top.EthLoop``:
the accelerator behind its Ethernet, IPv4 and UDP gateware, reached by a host-side MAC under
Verilator) in-process and bridged to real UDP datagrams on 127.0.0.1 (``UdpServer``,
``hbfp sim-server --udp``), the host's driver over ``udp:`` against the golden model bit for
bit, a lossy network included."""

from __future__ import annotations


import numpy as np
import pytest

from hbfp import host
from hbfp.host.server import UdpServer
from hbfp.host.transports import DatagramTransport
from hbfp.sim import device as sim_device
from hbfp.sim.harness import build
from hbfp.sim.network import NetworkSim

from .conftest import udp_server_gemm

#: A small core (the build dominates the time): a 4x4 HBFP8 array, 48x48 buffers, relu.
CORE_ARG = "rows=4,cols=4,size=48,functions=relu"
#: A frame timeout of 50,000 cycles (far above the link's latency, a few thousand): the
#: conformance table's timeout cases wait that long, not the default's 2^20. The core takes
#: 2 bytes a cycle behind the link's one (as on the ECPIX-5: ``hw.link.BytesToBeats``).
SIM_ARG = f"{CORE_ARG},frame_timeout=50000,link=eth,stream_bytes=2"


# ---- the option, without a build ------------------------------------------------------------


def test_link_option_selects_the_network_loop(recorded_builds):
    opts = sim_device.parse_arg(SIM_ARG)
    assert opts["link"] == "eth"
    _, plain = sim_device.top_library(sim_device.parse_arg(SIM_ARG.replace(",link=eth", "")))
    _, eth = sim_device.top_library(opts)
    assert eth == {**plain, "top": "hw.eth_top.EthLoop", "link": "eth"} and "link" not in plain
    top = recorded_builds[1][0]()
    from hbfp.hw.eth_top import EthLoop

    assert isinstance(top, EthLoop) and top.device.cfg.size == 48
    top._MustUse__used = True
    top.device._MustUse__used = True
    top.device.link._MustUse__used = True


@pytest.mark.parametrize(("arg", "match"), [
    ("link=wifi", "link must be one of"), ("link=eth,uart=8", "two different links"),
])
def test_link_option_errors(recorded_builds, arg, match):
    with pytest.raises(ValueError, match=match):
        sim_device.top_library(sim_device.parse_arg(f"{CORE_ARG},{arg}"))
    assert not recorded_builds


# ---- the gateware under Verilator -------------------------------------------------------------

needs_build = pytest.mark.skipif(build.unavailable() is not None, reason=str(build.unavailable()))
one_worker = pytest.mark.xdist_group("eth_link")


@pytest.fixture(scope="module")
def eth_sim():
    transport = sim_device.backend.open(SIM_ARG, progress=lambda msg: print(msg, flush=True))
    assert isinstance(transport, DatagramTransport) and isinstance(transport.datagrams, NetworkSim)
    yield transport
    transport.close()


def products(dev, emu, rng, count: int, sizes=(1, 40)):
    """``count`` random products on ``dev`` and ``emu``, every output format in turn: bit for bit."""
    for i in range(count):
        m, k, n = (int(x) for x in rng.integers(*sizes, size=3))
        a = (rng.standard_normal((m, k)) * 4).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        out = ("fp32", "bf16", "bfp")[i % 3]
        got, want = dev.gemm(a, b, out=out), emu.gemm(a, b, out=out)
        if out == "bfp":
            assert np.array_equal(got.codes, want.codes) and np.array_equal(got.exponents, want.exponents), i
        else:
            assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)), (i, out)


@needs_build
@one_worker
def test_products_through_the_gateware_network_stack(eth_sim):
    """The driver in-process over the simulated link: IDENTIFY and products (one larger than
    the buffers, tiled and pipelined) equal ``emu``'s, no retry."""
    emu = host.open(f"emu:{CORE_ARG}")
    dev = host.Device(eth_sim, name="sim:link=eth", timeout=30)
    assert dev.pipeline and dev.identity.size == 48 and dev.identity.stream_bytes == 2
    rng = np.random.default_rng(1)
    products(dev, emu, rng, 6)
    products(dev, emu, rng, 1, sizes=(90, 120))
    assert dev.stats.retries == 0
    net = eth_sim.datagrams
    assert net.sim.counters()["in_beats"] > 0
    emu.close()


@needs_build
@one_worker
def test_udp_bridge_through_a_lossy_network(eth_sim):
    """Real datagrams on 127.0.0.1 bridged whole into the simulated link (the gateware numbers
    and checks them), 1% lost and 0.1% damaged either way: 100 products, every one bit-exact."""
    emu = host.open(f"emu:{CORE_ARG}")
    with UdpServer(eth_sim.datagrams, drop=0.01, corrupt=0.001, seed=4).start() as server:
        with host.open(server.spec, timeout=1.0, retries=10) as dev:
            products(dev, emu, np.random.default_rng(2), 100, sizes=(1, 30))
            retries = dev.stats.retries
    assert server.counts["taken"] > 100 and retries >= 0
    emu.close()


@needs_build
@one_worker
def test_cli_sim_server_udp_serves_the_network_link(eth_sim):
    udp_server_gemm(f"sim:{SIM_ARG}", timeout=300)


@needs_build
@one_worker
def test_conformance_table_over_the_network_link(eth_sim):
    """The wire protocol's whole conformance table (host/conformance.py) through the gateware's
    Ethernet, IPv4 and UDP: every malformed frame, timeout and back-to-back case answered as
    on the top's own ports (the link's latency is far below a frame's timeout)."""
    from hbfp.host import conformance as K
    from hbfp.host.transports import TransportDevice

    dev = TransportDevice(DatagramTransport(eth_sim.datagrams))  # a session of its own: SYNC first
    ident = K.identify(dev)
    assert (ident.rows, ident.size) == (4, 48)
    table = K.cases(ident)
    failures = K.run_cases(dev, table, ident)
    assert not failures, "\n".join(str(e) for _, e in failures)
