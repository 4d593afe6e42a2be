"""cocotb testbench of ``hbfp.hw.activation.Activation`` against ``hbfp.golden.activations``.

Configuration (``tb_config()``):

- ``seed``; ``leaky_shift`` and ``functions``: what the DUT was built with; ``latency``: the
  DUT's ``LATENCY``;
- ``exhaustive``: every unary function on all 65,536 bf16 inputs and every gradient on all
  65,536 ``x`` (one sampled ``g`` each); otherwise ``per_function`` random inputs per function,
  plus the corner cases, for every function;
- ``stall_beats``: beats of the phase with random stalls on both sides (``stall``).

Expected values come from the golden functions; every output is compared bit for bit, NaNs
included (the contract names them: ``QNAN | sign(x)`` from a unary unit, ``QNAN |
sign(a) ^ sign(b)`` from a gradient's product).
"""

from __future__ import annotations

import random

import cocotb
import numpy as np
from cocotb.triggers import FallingEdge, RisingEdge

from hbfp.golden import activations, bf16
from hbfp.hw.activation import FUNC_WIDTH, FUNCTIONS, GRADIENT_FUNCTIONS, function_code
from hbfp.sim.runner import tb_config
from hbfp.sim.streams import StreamSink, StreamSource, start_clock_and_reset

ALL = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)

#: Special upstream gradients: zeros, subnormals, the normal extremes, infinities, NaNs
#: (quiet, signalling, negative), one.
SPECIAL_G = np.array(
    [0x0000, 0x8000, 0x0001, 0x807F, 0x0080, 0x8080, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80,
     0x7FC0, 0xFFC0, 0x7F81, 0xFFFF, 0x3F80, 0xBF80, 0x0100, 0x7F00],
    dtype=np.uint16,
)


def corner_x(cfg: dict) -> np.ndarray:
    """Inputs on every decision boundary: zeros, subnormals, the normal extremes, infinities,
    NaNs, and the first and last mantissas of the fields on both sides of every table window
    and of the leaky_relu flush edge, both signs."""
    fields = {0, 1, 2, 126, 127, 128, 253, 254, 255}
    for name in activations.TABLE_NAMES:
        u = activations.table_unit(name)
        fields |= {u.f_lo - 1, u.f_lo, u.f_hi, u.f_hi + 1}
    s = min(cfg["leaky_shift"], 255)
    fields |= {f for f in (s - 1, s, s + 1) if 0 <= f <= 255}
    pats = [(sign << 15) | (f << 7) | m for sign in (0, 1) for f in sorted(fields) for m in (0, 1, 0x40, 0x7E, 0x7F)]
    return np.array(pats, dtype=np.uint16)


def sample_g(rng: np.random.Generator, n: int) -> np.ndarray:
    """Upstream gradients: uniform patterns, gradient-like magnitudes (2**-20 to 2**21) and
    specials, mixed."""
    g = rng.integers(0, 1 << 16, n).astype(np.uint16)
    kind = rng.random(n)
    mags = (rng.integers(0, 2, n) << 15) | (rng.integers(107, 148, n) << 7) | rng.integers(0, 128, n)
    g = np.where(kind < 0.25, mags.astype(np.uint16), g)
    return np.where(kind > 0.85, rng.choice(SPECIAL_G, n), g).astype(np.uint16)


def expected(code: int, x: np.ndarray, g: np.ndarray, cfg: dict) -> np.ndarray:
    """The golden output of function ``code`` (QNAN for a function not built or no function)."""
    if code >= len(FUNCTIONS) or FUNCTIONS[code] not in cfg["functions"]:
        return np.full(x.shape, bf16.QNAN, dtype=np.uint16)
    name = FUNCTIONS[code]
    shift = {"shift": cfg["leaky_shift"]} if name.startswith("leaky_relu") else {}
    if name in GRADIENT_FUNCTIONS:
        return activations.get(name[: -len("_grad")], "grad")(x, g, **shift)
    return activations.get(name)(x, **shift)


def expected_all(x: np.ndarray, g: np.ndarray, func: np.ndarray, cfg: dict) -> np.ndarray:
    out = np.zeros(x.shape, dtype=np.uint16)
    for code in np.unique(func):
        sel = func == code
        out[sel] = expected(int(code), x[sel], g[sel], cfg)
    return out


def pack_beats(x: np.ndarray, g: np.ndarray, func: np.ndarray) -> list[int]:
    """``ACTIVATION_INPUT`` payloads: x in bits 0-15, g in 16-31, func above."""
    return (x.astype(np.uint64) | (g.astype(np.uint64) << 16) | (func.astype(np.uint64) << 32)).tolist()


def check(x, g, func, got, want, what: str) -> None:
    got = np.asarray(got, dtype=np.uint16)
    assert got.shape == want.shape, f"{what}: {got.size} results for {want.size} beats"
    bad = np.nonzero(got != want)[0]
    if bad.size:
        lines = [
            f"  {FUNCTIONS[func[k]] if func[k] < len(FUNCTIONS) else f'code {func[k]}'}"
            f"(x=0x{x[k]:04x}, g=0x{g[k]:04x}): expected 0x{want[k]:04x}, got 0x{got[k]:04x}"
            for k in bad[:20]
        ]
        raise AssertionError(f"{what}: {bad.size} of {want.size} mismatches; first:\n" + "\n".join(lines))


def throughput_vectors(rng: np.random.Generator, cfg: dict):
    """(x, g, func) for the full-throughput phase, functions interleaved in random order."""
    xs, codes = [], []
    corners = corner_x(cfg)
    for name in cfg["functions"]:
        if cfg["exhaustive"]:
            x = ALL
        else:
            x = np.concatenate([corners, rng.integers(0, 1 << 16, cfg["per_function"]).astype(np.uint16)])
        xs.append(x)
        codes.append(np.full(x.shape, function_code(name), dtype=np.uint8))
    x = np.concatenate(xs)
    func = np.concatenate(codes)
    g = sample_g(rng, x.size)
    order = rng.permutation(x.size)
    return x[order], g[order], func[order]


async def reset(dut) -> None:
    dut.i__valid.value = 0
    dut.o__ready.value = 0
    await start_clock_and_reset(dut)


@cocotb.test()
async def full_throughput(dut):
    """Every function (exhaustive on request) streamed with no stalls: the input is taken
    every cycle and, after the pipeline's latency, one result leaves every cycle."""
    cfg = tb_config()
    rng = np.random.default_rng(cfg["seed"])
    x, g, func = throughput_vectors(rng, cfg)
    want = expected_all(x, g, func, cfg)
    beats = pack_beats(x, g, func)
    n, latency = len(beats), cfg["latency"]
    await reset(dut)

    i_payload, i_valid, i_ready = dut.i__payload, dut.i__valid, dut.i__ready
    o_payload, o_valid = dut.o__payload, dut.o__valid
    dut.o__ready.value = 1
    got: list[int] = []
    late: list[int] = []
    refused: list[int] = []
    edge = FallingEdge(dut.clk)
    await edge
    # Sampled between rising edges: what the DUT presents in a cycle transfers at the next
    # rising edge (o.ready is high), and the beat driven here is taken at that edge.
    for cycle in range(n + latency):
        if o_valid.value:
            got.append(o_payload.value.to_unsigned())
        elif cycle >= latency:
            late.append(cycle)
        if cycle < n:
            i_payload.value = beats[cycle]
            i_valid.value = 1
            if not i_ready.value:
                refused.append(cycle)
        else:
            i_valid.value = 0
        await edge
    assert not refused, f"input not ready in {len(refused)} cycles, first {refused[:5]}"
    assert not late, f"no result in {len(late)} cycles after the pipeline filled, first {late[:5]}"
    assert len(got) == n, f"{len(got)} results for {n} beats in {n + latency} cycles (latency {latency})"
    assert not o_valid.value, "a result beyond the beats sent"
    check(x, g, func, got, want, f"full throughput ({n} beats)")
    dut._log.info("full throughput: %d beats in %d cycles, all equal to the golden model", n, n + latency)


async def monitor_hold(dut, stop: list) -> None:
    """The output handshake rule: once o.valid is high, o.payload holds until taken."""
    edge = FallingEdge(dut.clk)
    held = None
    while not stop:
        await edge
        valid, ready = bool(dut.o__valid.value), bool(dut.o__ready.value)
        payload = dut.o__payload.value.to_unsigned() if valid else None
        if held is not None:
            assert valid, "o.valid dropped before the beat was taken"
            assert payload == held, f"o.payload changed from 0x{held:04x} to 0x{payload:04x} while stalled"
        held = payload if valid and not ready else None


@cocotb.test()
async def random_stalls(dut):
    """Random valid gaps on the input and random ready drops on the output (``stall``), all
    function codes mixed (unassigned codes included), corner inputs first."""
    cfg = tb_config()
    rng = np.random.default_rng(cfg["seed"] + 1)
    n = cfg["stall_beats"]
    corners = corner_x(cfg)
    x = np.concatenate([corners, rng.integers(0, 1 << 16, n).astype(np.uint16)])
    g = sample_g(rng, x.size)
    func = rng.integers(0, 1 << FUNC_WIDTH, x.size).astype(np.uint8)
    want = expected_all(x, g, func, cfg)
    await reset(dut)
    stop: list = []
    cocotb.start_soon(monitor_hold(dut, stop))
    src = StreamSource(dut, "i", stall=cfg["stall"], rng=random.Random(cfg["seed"]))
    snk = StreamSink(dut, "o", stall=cfg["stall"], rng=random.Random(cfg["seed"] + 1))
    cocotb.start_soon(src.send(pack_beats(x, g, func)))
    got = await snk.receive(x.size, timeout_cycles=100)
    stop.append(True)
    for _ in range(cfg["latency"] + 2):
        await RisingEdge(dut.clk)
    assert not dut.o__valid.value, "a result beyond the beats sent"
    check(x, g, func, got, want, f"random stalls ({x.size} beats)")
