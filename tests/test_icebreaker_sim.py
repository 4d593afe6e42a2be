"""The iCEBreaker's device in simulation: the board's own configuration (``hw.boards``: a
reduced 1x1 core without quantizers, stochastic rounding or activation units, its receive
FIFO and payload buffer) behind its UART (``sim`` with ``uart=N``), served on a
pseudo-terminal and driven over ``serial:`` like the board. Every product needs the host's
fallbacks (docs/host.md, "Reduced devices") and must still equal ``reference_gemm`` (the
golden model on the whole problem) bit for bit; requests for the missing units are refused."""

from __future__ import annotations

import numpy as np
import pytest

from hbfp import host
from hbfp.host import protocol
from hbfp.host.device import reference_gemm
from hbfp.host.errors import DeviceError
from hbfp.host.protocol import Op, OutFormat, Status, Target
from hbfp.host.server import PtyServer
from hbfp.hw import boards
from hbfp.sim import device as sim_device
from hbfp.sim.harness import build

DIVISOR = 8  # clock cycles a UART bit (the board runs 12 cycles a bit at 1 Mbaud)


def board_options() -> dict:
    """The ``sim`` options of the iCEBreaker's default build."""
    board, cfg, top_kw = boards.board_config("icebreaker")
    opts = {f: getattr(cfg, f) for f in sim_device._CORE_FIELDS}
    opts.update(fifo_depth=top_kw["fifo_depth"], max_payload=top_kw["max_payload"], uart=DIVISOR)
    return opts


pytestmark = [
    pytest.mark.skipif(build.unavailable() is not None, reason=str(build.unavailable())),
    pytest.mark.xdist_group("icebreaker_sim"),
]


@pytest.fixture(scope="module")
def board():
    sim = sim_device.backend.open(**board_options(), progress=lambda msg: print(msg, flush=True))
    with PtyServer(sim).start() as server, host.open(server.spec, timeout=20) as dev:
        yield dev
    sim.close()


def test_the_board_reports_a_reduced_device(board):
    _, cfg, top_kw = boards.board_config("icebreaker")
    ident = board.info()
    assert (ident.rows, ident.cols, ident.size, ident.max_payload) == (cfg.rows, cfg.cols, cfg.size,
                                                                       top_kw["max_payload"])
    assert ident.units == () and ident.functions == ()
    assert ident.omitted == sum(1 << bit for bit in protocol.UNITS.values())


RUNS = [
    # (m, k, n), keyword arguments of gemm: one block; split along every side (the buffers
    # hold 24x24); values in, BFP out with stochastic rounding; activations on the host.
    ((24, 24, 24), dict(input="fp32", out="bfp", rounding="stochastic", seed=11, activation="relu", bias=True)),
    ((30, 50, 20), dict(out="bf16", activation="gelu", c=True)),
    ((10, 24, 9), dict(input="bf16", rounding="toward_zero")),
    ((7, 30, 26), dict(out="bfp", transpose_b=True)),
]


@pytest.mark.parametrize("shape, kw", RUNS)
def test_products_equal_the_golden_model(board, shape, kw):
    m, k, n = shape
    rng = np.random.default_rng(m * k + n)
    kw = dict(kw)
    a = (rng.standard_normal((m, k)) * 4).astype(np.float32)
    b = rng.standard_normal((n, k) if kw.get("transpose_b") else (k, n)).astype(np.float32)
    if kw.pop("bias", False):
        kw["bias"] = rng.standard_normal(n).astype(np.float32)
    if kw.pop("c", False):
        kw["c"] = rng.standard_normal((m, n)).astype(np.float32)
    before = board.stats.copy()
    got = board.gemm(a, b, **kw)
    want = reference_gemm(board.format(), a, b, **kw)
    if kw.get("out") == "bfp":
        assert np.array_equal(got.codes, want.codes) and np.array_equal(got.exponents, want.exponents)
    else:
        view = np.uint16 if kw.get("out") == "bf16" else np.uint32
        assert np.array_equal(np.asarray(got).view(view), np.asarray(want).view(view))
    done = board.stats - before
    assert done.retries == 0 and done.macs == m * n * k
    assert done.host_quantized == (2 if kw.get("input") in ("fp32", "bf16") else 0) + (kw.get("out") == "bfp")
    assert done.host_activations == (1 if "activation" in kw else 0)


@pytest.mark.parametrize("op, payload", [
    (Op.WRITE, protocol.encode_write(Target.A_VALUES, 0, 0, 24, 24, bytes(2 * 576), encoding=protocol.Encoding.BF16)),
    (Op.GEMM, protocol.encode_gemm(4, 4, 4, out_format=OutFormat.BFP)),
    (Op.READ, protocol.encode_read(4, 4, activation=0)),
    (Op.ELEMENTWISE, protocol.encode_elementwise(0, bytes(2 * 8))),
])
def test_requests_for_missing_units_are_refused(board, op, payload):
    with pytest.raises(DeviceError) as e:
        board.command(op, payload)
    assert e.value.status == Status.BAD_DESCRIPTOR
    assert board.status().last_error == Status.BAD_DESCRIPTOR
